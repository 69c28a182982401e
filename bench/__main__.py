"""``python -m bench`` (``make bench``): the seven speed targets of issue 11, each printed next to
a baseline measured in the same run, with the ratio and the verdict. ``--quick`` for a small
run. Nothing here asserts a time: the figures are printed (and written as JSON with
``--json``); docs/benchmarks.md records them.

Phases, in order (each can be skipped with ``--skip``; optional ones are left out when the
``--max-minutes`` budget would not hold them):

1. ``confirm``  the publisher alone: the relay's publishing path against raw py-amqp waves
                of the same size (target 2), and the schemes the relay does not use;
2. ``drain``    the ordered drain, ``celery -A outbox worker -c 2`` + beat, at 100 and at
                10,000 aggregates, each against the raw unordered 2-process loop
                (``bench.rawloop``) on the same backlog (target 1); the worker's CPU per
                event (target 3) and each pool child's busy fraction (target 4);
3. ``hot``      10,000 events on one aggregate: the raw loop, strict ordering and the
                opt-in pipelined mode (``bench.hot``; issue 25: pipelined >= 0.9x the raw loop);
4. ``live``     commit-to-arrival latency at 200 events/s, each variant of ``bench.live.VARIANTS``
                (the wake, polling only, LISTEN/NOTIFY; claims in the worker's main process
                or through Celery) with its own worker; the wake's cost to the writer (target 6);
5. ``memory``   a backlog with 1 MB payloads mixed in (1 in 20), peak RSS of every worker
                process (``bench.memory``, target 7);
6. ``takeover`` two workers, one SIGKILLed mid-drain: the longest stand-still of any aggregate
                after the kill next to the fault-free drain's (``bench.takeover``, issue 19);
7. ``kafka``    issue 24: the relay's drain to Kafka (Tansu, or OUTBOX_BENCH_KAFKA_URL) against a raw
                idempotent confluent-kafka producer sending the same events, and against the same
                drain to RabbitMQ (``bench.kafka``; skipped when confluent-kafka or Tansu is missing);
8. ``profile``  py-spy on the worker while draining (where the time goes; optional);
9. ``tuning``   the worker with other settings (optional).
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import (
    PY_SPY,
    Destination,
    Run,
    create_table,
    drop_table,
    flush_redis,
    log,
    machine_facts,
    require_services,
    to_json,
    wait_quiet,
)
from .report import summary, target_rows

PHASES = ("confirm", "drain", "hot", "live", "memory", "takeover", "kafka", "profile", "tuning")
#: Phases left out of ``--quick`` (and first to go when the time budget is short).
OPTIONAL = ("profile", "tuning")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small run (about 4 minutes): 5,000-event drains, 2,000 hot events, 5 s live, "
                        "1,000 memory events, no profile or tuning")
    p.add_argument("--events", type=int, help="backlog of each drain (default 20,000; 5,000 with --quick)")
    p.add_argument("--aggregates", default="100,10000",
                   help="comma-separated aggregate counts of the drains (default 100,10000)")
    p.add_argument("--batch-size", type=int, default=100, help="OUTBOX_BATCH_SIZE of the relay and the raw loop")
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork)")
    p.add_argument("--hot-events", type=int, help="events on the hot aggregate (default 10,000; 2,000 quick)")
    p.add_argument("--memory-events", type=int, help="backlog of the memory phase (default 4,000; 1,000 quick)")
    p.add_argument("--big-every", type=int, default=20, help="memory phase: one event in this many is large")
    p.add_argument("--big-bytes", type=int, default=1_000_000, help="memory phase: payload of a large event")
    p.add_argument("--profile-events", type=int, help="backlog of the py-spy pass (default min(events, 20,000))")
    p.add_argument("--tuning-events", type=int, help="backlog of each tuning drain (default min(events, 20,000))")
    p.add_argument("--live-rate", type=float, default=200.0, help="events/s the writers commit")
    p.add_argument("--live-seconds", type=float, help="how long the writers write (default 20; 5 with --quick)")
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--no-listen", dest="listen", action="store_false",
                   help="skip the PostgreSQL LISTEN/NOTIFY live variants (--quick runs only wake and poll)")
    p.add_argument("--confirm-events", type=int, help="events per publisher variant (default 5,000; 1,000 quick)")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip: {', '.join(PHASES)}")
    p.add_argument("--worker-loglevel", default="WARNING")
    p.add_argument("--max-minutes", type=float, help="time budget (default 15; 4 with --quick): optional "
                                                     "phases and variants that would not fit are skipped")
    p.add_argument("--no-wait-quiet", action="store_true",
                   help="do not wait for an idle machine before each phase")
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs, py-spy output)")
    args = p.parse_args(argv)
    args.events = args.events or (5000 if args.quick else 20_000)
    args.aggregate_counts = [int(a) for a in str(args.aggregates).split(",") if a.strip()]
    args.hot_events = args.hot_events or (2000 if args.quick else 10_000)
    args.memory_events = args.memory_events or (1000 if args.quick else 4000)
    args.live_seconds = args.live_seconds or (5.0 if args.quick else 20.0)
    args.confirm_events = args.confirm_events or (1000 if args.quick else 5000)
    args.profile_events = args.profile_events or min(args.events, 20_000)
    args.tuning_events = args.tuning_events or min(args.events, 20_000)
    args.max_minutes = args.max_minutes or (4.0 if args.quick else 15.0)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) to skip: {', '.join(sorted(unknown))}")
    if args.quick:
        args.skip |= set(OPTIONAL)
        args.listen = False
    return args


# -- calling the phases' modules ---------------------------------------------------------------------

def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it accepts: the phases' modules are written by
    several people, and a knob one of them does not take yet must not break the run."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def optional_module(name: str) -> Any | None:
    """``bench.<name>`` if it exists (a phase whose module is not there yet is skipped)."""
    import importlib

    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name in (f"bench.{name}",):
            return None
        raise


# -- the run ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_services()
    started = time.monotonic()
    budget = args.max_minutes * 60.0

    def remaining() -> float:
        return budget - (time.monotonic() - started)

    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    run = Run(batch_size=args.batch_size, claim_interval_s=1.0, workdir=workdir)
    # This process wakes the relay (live phase): it must see the same settings as the worker.
    for key in [k for k in os.environ if k.startswith(("OUTBOX_", "CELERY_"))]:
        del os.environ[key]
    os.environ.update(run.outbox_env())
    sys.path.insert(0, str(workdir))

    results: dict[str, Any] = {"events": args.events, "tuning_events": args.tuning_events,
                               "aggregate_counts": args.aggregate_counts, "live_rate": args.live_rate,
                               "live_seconds": args.live_seconds, "skipped": [], "run": run.tag,
                               "quick": args.quick, "quiet": {}, "live": {}}
    log(f"run {run.tag}: table {run.table}, exchange {run.exchange}, Celery broker {run.redis_url}, "
        f"work dir {workdir}, budget {args.max_minutes:g} min")
    flushed = flush_redis(run.redis_url)
    if flushed:
        log(f"flushed {flushed} keys from {run.redis_url} (the bench's spare db)")
    results["machine"] = machine_facts(run)
    create_table(run)
    destination = Destination(run)
    relay = None
    from . import confirm, drain, kafka, live, memory, profiling, takeover

    def quiet(phase: str) -> None:
        """Other sessions may share this machine: start each phase on an idle machine if
        that happens within a bound, and record how busy it was."""
        if args.no_wait_quiet:
            return
        results["quiet"][phase] = wait_quiet(max_busy=0.25 if relay is None else 0.35,
                                             timeout=min(60.0, max(3.0, remaining() / 20)))

    def relay_factory(**env: str) -> Any:
        return drain.Relay(run, concurrency=args.concurrency, loglevel=args.worker_loglevel, **env)

    def stop_relay() -> None:
        nonlocal relay
        if relay is not None:
            relay.stop()
            relay = None

    def skip(phase: str, why: str) -> None:
        results["skipped"].append(f"{phase} ({why})")
        log(f"skipping {phase}: {why}")

    try:
        if "confirm" not in args.skip:
            quiet("confirm")
            results["confirm"] = confirm.run_confirm_bench(run, destination, args.confirm_events)

        if "drain" not in args.skip:
            stop_relay()
            spreads = tuple(args.aggregate_counts)
            quiet("drain")
            results["drain"], relay = drain.compare_with_raw_loop(
                run, destination, relay_factory, args.events, spreads, processes=args.concurrency,
                timeout=max(60.0, min(300.0, remaining() / (2 * len(spreads) + 2))))

        if "hot" not in args.skip:
            hot = optional_module("hot")
            if hot is None or not hasattr(hot, "run_hot"):
                skip("hot", "no bench/hot.py run_hot yet")
            elif remaining() < 60:
                skip("hot", "time budget")
            else:
                stop_relay()
                quiet("hot")
                # Its own table, exchange and consumer (a second consumer on ours would split the messages).
                results["hot"] = call(hot.run_hot, args.hot_events, batch_size=args.batch_size,
                                      concurrency=args.concurrency, timeout=max(60.0, min(300.0, remaining() / 4)))

        if "live" not in args.skip:
            # bench.live's variants: name -> (run_live's kind, the worker's extra environment).
            variants = dict(getattr(live, "VARIANTS", {"wake": ("wake", {}), "poll": ("poll", {}),
                                                      "listen": ("listen", {"OUTBOX_RELAY_LISTEN": "1"})}))
            if args.quick:  # the two the targets need
                variants = {k: v for k, v in variants.items() if k in ("wake", "poll")}
            elif not args.listen:
                variants = {k: v for k, v in variants.items() if v[0] != "listen"}
            current_env: dict[str, str] | None = None
            for name, (kind, env) in variants.items():
                if remaining() < args.live_seconds + 40:
                    skip(f"live {name}", "time budget")
                    continue
                if relay is None or env != current_env:
                    stop_relay()
                    relay, current_env = relay_factory(**env), env
                    relay.wait_ready(args.concurrency)
                quiet(f"live-{name}")
                live.set_listen(kind == "listen")
                try:
                    results["live"][name] = live.run_live(run, destination, kind, args.live_rate, args.live_seconds,
                                                          100, args.writers, cpu_groups=drain.cpu_groups(relay),
                                                          alive=relay.check_alive)
                finally:
                    live.set_listen(False)

        if "memory" not in args.skip:
            if remaining() < 45:
                skip("memory", "time budget")
            else:
                stop_relay()
                quiet("memory")
                results["memory"] = memory.run_memory(run, destination, relay_factory, args.memory_events, 100,
                                                      big_every=args.big_every, big_bytes=args.big_bytes,
                                                      timeout=max(60.0, min(300.0, remaining() / 2)))

        if "takeover" not in args.skip:
            if remaining() < 60:
                skip("takeover", "time budget")
            else:
                stop_relay()
                quiet("takeover")
                # Its own table, exchange, consumer and workers (two, one of them killed).
                results["takeover"] = takeover.run_takeover(min(args.events, 12_000), 40,
                                                            concurrency=args.concurrency)

        if "kafka" not in args.skip:
            if remaining() < 120:
                skip("kafka", "time budget")
            else:
                stop_relay()
                quiet("kafka")
                try:
                    # Its own table, topics, consumers and workers; a broker of its own unless
                    # OUTBOX_BENCH_KAFKA_URL names one.
                    results["kafka"] = kafka.run_kafka(args.events, 100, batch_size=args.batch_size,
                                                       concurrency=args.concurrency,
                                                       timeout=max(60.0, min(300.0, remaining() / 4)))
                except ImportError as exc:
                    skip("kafka", f"{exc.name} is not installed (the dev extra has confluent-kafka and Tansu)")

        if "profile" not in args.skip:
            if not os.path.exists(PY_SPY):
                skip("profile", f"no py-spy at {PY_SPY}: pip install py-spy")
            elif remaining() < 150:
                skip("profile", "time budget")
            else:
                stop_relay()
                relay = relay_factory()
                relay.wait_ready(args.concurrency)
                quiet("profile")
                results["profile"] = profiling.profile_drain(run, destination, relay, args.profile_events, 100,
                                                             timeout=min(240.0, remaining() / 3))

        if "tuning" not in args.skip:
            results["tuning"] = {}
            variants = [
                ("batch 400, task rows 200", {"OUTBOX_BATCH_SIZE": "400", "OUTBOX_RELAY_TASK_ROWS": "200"}),
                ("synchronous_commit=off", {"PGOPTIONS": "-c synchronous_commit=off"}),
            ]
            for name, env in variants:
                if remaining() < 60:
                    skip(f"tuning {name}", "time budget")
                    continue
                stop_relay()
                relay = relay_factory(**env)
                relay.wait_ready()
                quiet(f"tuning-{name}")
                results["tuning"][f"celery {name}"], relay = drain.run_celery_drain(
                    run, destination, relay_factory, args.tuning_events, 100,
                    timeout=max(60.0, min(300.0, remaining() / 2)), relay=relay, label=f"tuning drain [{name}]")

    finally:
        if relay is not None:
            results["worker_log_tail"] = relay.log_tail(chars=2000)
        stop_relay()
        destination.close()
        try:
            drop_table(run)
        except Exception as exc:  # noqa: BLE001
            log(f"could not drop {run.table}: {exc}")
        try:
            flush_redis(run.redis_url)
        except Exception as exc:  # noqa: BLE001
            log(f"could not flush {run.redis_url}: {exc}")
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        results["total_seconds"] = round(time.monotonic() - started, 1)
        results["targets"] = target_rows(results)
        if args.json:
            args.json.write_text(to_json(results))
            log(f"wrote {args.json}")
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
