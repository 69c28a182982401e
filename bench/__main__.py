"""``python -m bench`` (``make bench``): every benchmark, with ratios to baselines measured in
the same run. ``--quick`` for a small run. Nothing here asserts a time: the figures are
printed (and written as JSON with ``--json``), targets are compared in the summary.

Phases, in order (each can be skipped with ``--skip``):

1. ``confirm``   publisher micro-benchmark (stop-and-wait confirms vs alternatives);
2. ``baseline``  the drain baseline: a plain in-process claim -> publish_chain -> mark_done loop;
3. ``drain``     the same backlog through ``celery -A outbox worker -c 2`` + beat, with RSS sampling;
4. ``profile``   a second drain with py-spy attached to the worker's processes;
5. ``live``      commit-to-arrival latency at a fixed rate, with the post-commit wake and
                 without (polling), and with PostgreSQL LISTEN/NOTIFY (``--no-listen`` to skip);
6. ``tuning``    the shipped worker with other settings: 25-row tasks, bigger batches and tasks,
                 synchronous_commit=off for the relay's sessions, and inline publishing of
                 small claims turned off (its live latency shows what inline publishing saves).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import (PY_SPY, Destination, Run, create_table, drop_table, flush_redis, log, machine_facts,
                     require_services, to_json, wait_quiet)

TARGETS = {"drain_events_per_s": 6000.0, "live_p50_ms": 10.0, "live_p99_ms": 60.0, "worker_rss_mb": 256.0}
PHASES = ("confirm", "baseline", "drain", "profile", "live", "tuning")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run: 5,000 events, 5 s live, 1,000 confirm events")
    p.add_argument("--events", type=int, help="backlog size for the drain (default 50,000; 5,000 with --quick)")
    p.add_argument("--aggregates", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=100, help="OUTBOX_BATCH_SIZE of the relay and the baseline")
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork)")
    p.add_argument("--baseline-ack", choices=("batch", "chain", "both"), default="both",
                   help="baseline loop marks done per claimed batch, per chain, or runs both (default)")
    p.add_argument("--profile-events", type=int, help="backlog of the py-spy pass (default min(events, 20,000))")
    p.add_argument("--tuning-events", type=int, help="backlog of each tuning drain (default min(events, 20,000))")
    p.add_argument("--live-rate", type=float, default=200.0, help="events/s the writers commit")
    p.add_argument("--live-seconds", type=float, help="how long the writers write (default 20; 5 with --quick)")
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--no-listen", dest="listen", action="store_false",
                   help="skip the PostgreSQL LISTEN/NOTIFY live variant")
    p.add_argument("--confirm-events", type=int, help="events per publisher variant (default 5,000; 1,000 quick)")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip: {', '.join(PHASES)}")
    p.add_argument("--worker-loglevel", default="WARNING")
    p.add_argument("--max-minutes", type=float, default=13.0,
                   help="time budget: optional phases that would not fit are skipped")
    p.add_argument("--no-wait-quiet", action="store_true",
                   help="do not wait for an idle machine before each phase")
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs, py-spy output)")
    args = p.parse_args(argv)
    args.events = args.events or (5000 if args.quick else 50_000)
    args.live_seconds = args.live_seconds or (5.0 if args.quick else 20.0)
    args.confirm_events = args.confirm_events or (1000 if args.quick else 5000)
    args.profile_events = args.profile_events or min(args.events, 20_000)
    args.tuning_events = args.tuning_events or min(args.events, 20_000)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) to skip: {', '.join(sorted(unknown))}")
    return args


def fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def summary(results: dict[str, Any]) -> str:
    lines = ["", "=" * 78, "outbox relay benchmark summary", "=" * 78]
    m = results.get("machine", {})
    lines.append(f"machine: {m.get('nproc')} cores, {m.get('memory_mb')} MB, {m.get('cpu')}; {m.get('date')}")
    lines.append(f"versions: python {m.get('python')}, celery {m.get('celery')}, kombu {m.get('kombu')}, "
                 f"amqp {m.get('amqp')}, psycopg {m.get('psycopg')}; PostgreSQL {m.get('postgresql')} "
                 f"(synchronous_commit={m.get('pg_synchronous_commit')}), RabbitMQ {m.get('rabbitmq')}, "
                 f"Redis {m.get('redis_server')}")
    confirm = results.get("confirm")
    if confirm:
        lines.append("")
        lines.append("publisher micro-benchmark (events/s, ratio to kombu stop-and-wait):")
        for name, r in confirm.items():
            lines.append(f"  {name:30s} {fmt(r['events_per_s']):>9s} ev/s  {r['us_per_event']:>8.1f} us/ev  "
                         f"x{r['ratio']:.2f}")
    baselines = results.get("baseline", {})
    drain = results.get("drain")
    if baselines or drain:
        lines.append("")
        lines.append(f"backlog drain ({results.get('events')} events, {results.get('aggregates')} aggregates):")
        for ack, b in baselines.items():
            lines.append(f"  baseline loop, ack per {ack:5s}   {fmt(b['events_per_s']):>9s} ev/s "
                         f"(order ok={b['order']['ok']})")
        if drain:
            base = baselines.get("batch") or next(iter(baselines.values()), None)
            ratio = f"x{drain['events_per_s'] / base['events_per_s']:.2f} of the baseline loop" if base else ""
            lines.append(f"  celery worker -c 2 + beat        {fmt(drain['events_per_s']):>9s} ev/s {ratio} "
                         f"(steady {fmt(drain.get('steady_events_per_s'))} ev/s; order ok={drain['order']['ok']}, "
                         f"duplicates {drain['order']['duplicates']}, complete={drain['complete']})")
            for other, b in baselines.items():
                if b is not base:
                    lines.append(f"    vs baseline ack per {other}: x{drain['events_per_s'] / b['events_per_s']:.2f}")
            target = TARGETS["drain_events_per_s"]
            verdict = "met" if drain["events_per_s"] >= target else \
                f"MISSED: {100 * (1 - drain['events_per_s'] / target):.0f}% short (x{target / max(1, drain['events_per_s']):.1f} needed)"
            lines.append(f"  target >= {fmt(target)} ev/s: {verdict}")
            mem = drain["memory"]
            lines.append(f"  worker RSS (max while draining): " + ", ".join(
                f"{p['role']} {p['max_rss_mb']} MB" for p in mem["per_process"])
                + f"; target < {fmt(TARGETS['worker_rss_mb'])} MB: "
                + ("met" if mem["max_rss_mb"] < TARGETS["worker_rss_mb"] else "MISSED"))
            lines.append(f"  bounded in flight: publish queue max {mem['publish_queue_max']} tasks, "
                         f"rows claimed max {mem['rows_claimed_max']}")
            lines.append("  cores used while draining: " + ", ".join(
                f"{k} {v:.2f}" for k, v in drain["cpu"]["cores_used"].items())
                + f" (machine {100 * drain['cpu']['machine_busy']:.0f}% busy)")
            lines.append("  CPU per relayed event (us): " + ", ".join(
                f"{k} {v:.0f}" for k, v in drain["cpu_us_per_event"].items()))
    tuning = results.get("tuning")
    if tuning:
        lines.append("")
        lines.append(f"the shipped worker with other settings ({results.get('tuning_events')} events each):")
        base = baselines.get("batch")
        for name, r in tuning.items():
            extra = f"x{r['events_per_s'] / base['events_per_s']:.2f} of the baseline loop" if base else ""
            if drain and name.startswith("celery"):
                extra += f", x{r['events_per_s'] / drain['events_per_s']:.2f} of the shipped worker"
            lines.append(f"  {name:46s} {fmt(r['events_per_s']):>7s} ev/s  {extra} (order ok={r['order']['ok']}"
                         + (f", max RSS {r['memory']['max_rss_mb']} MB" if "memory" in r else "") + ")")
    prof = results.get("profile")
    if prof:
        lines.append("")
        lines.append(f"profile (py-spy --idle, {prof['events']} events, {fmt(prof['events_per_s'])} ev/s while sampled):")
        for role, s in prof["profiles"].items():
            if "buckets" in s:
                lines.append(f"  {role}: " + ", ".join(f"{k} {v}%" for k, v in list(s["buckets"].items())[:7]))
    prof_live = results.get("profile_live")
    if prof_live:
        lines.append(f"profile of the live path (py-spy --idle during a wake run; p50 {fmt(prof_live['p50_ms'], 1)} ms "
                     "while sampled):")
        for role, s in prof_live["profiles"].items():
            if "buckets" in s:
                lines.append(f"  {role}: " + ", ".join(f"{k} {v}%" for k, v in list(s["buckets"].items())[:7]))
    live = results.get("live", {})
    if live:
        lines.append("")
        lines.append(f"live latency, commit -> arrival ({fmt(results.get('live_rate'))} ev/s for "
                     f"{fmt(results.get('live_seconds'))} s):")
        poll = live.get("poll")
        for name, r in live.items():
            ratio = ""
            if poll and r is not poll and r["p50_ms"] > 0:
                ratio = f"  (p50 x{poll['p50_ms'] / r['p50_ms']:.1f} faster, p99 x{poll['p99_ms'] / r['p99_ms']:.1f} vs poll)"
            lines.append(f"  {name:42s} p50 {fmt(r['p50_ms'], 1):>7s} ms  p90 {fmt(r['p90_ms'], 1):>7s} ms  "
                         f"p99 {fmt(r['p99_ms'], 1):>7s} ms  max {fmt(r['max_ms'], 1):>7s} ms  "
                         f"({r['arrived']}/{r['committed']} arrived, order ok={r['order']['ok']}){ratio}")
        w = live.get("wake")
        if w:
            ok50 = w["p50_ms"] <= TARGETS["live_p50_ms"]
            ok99 = w["p99_ms"] <= TARGETS["live_p99_ms"]
            lines.append(f"  target with wake p50 <= 10 ms: {'met' if ok50 else 'MISSED by %.1f ms' % (w['p50_ms'] - 10)}"
                         f"; p99 <= 60 ms: {'met' if ok99 else 'MISSED by %.1f ms' % (w['p99_ms'] - 60)}")
    other = []
    for name, r in [("drain", drain), *[(f"live {k}", v) for k, v in live.items()],
                    *[(f"baseline {k}", v) for k, v in baselines.items()]]:
        if r and "cpu" in r:
            cores = r["cpu"]["cores_used"].get("other python (not this bench)", 0.0)
            if cores > 0.1:
                other.append(f"{name} {cores:.2f} cores")
    if other:
        lines.append("")
        lines.append("WARNING: other Python processes (not this bench) used CPU during: " + ", ".join(other)
                     + "; those figures are pessimistic")
    skipped = results.get("skipped")
    if skipped:
        lines.append("")
        lines.append("skipped: " + "; ".join(skipped))
    lines.append("=" * 78)
    return "\n".join(lines)


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
                               "aggregates": args.aggregates, "live_rate": args.live_rate,
                               "live_seconds": args.live_seconds, "skipped": [], "run": run.tag}
    log(f"run {run.tag}: table {run.table}, exchange {run.exchange}, Celery broker {run.redis_url}, "
        f"work dir {workdir}")
    flushed = flush_redis(run.redis_url)
    if flushed:
        log(f"flushed {flushed} keys from {run.redis_url} (the bench's spare db)")
    results["machine"] = machine_facts(run)
    create_table(run)
    destination = Destination(run)
    relay = None
    from . import confirm, drain, live

    results["quiet"] = {}
    results["live"] = {}

    def quiet(phase: str) -> None:
        """Other sessions may share this machine: start each phase on an idle machine if
        that happens within a bound, and record how busy it was."""
        if args.no_wait_quiet:
            return
        results["quiet"][phase] = wait_quiet(max_busy=0.25 if relay is None else 0.35,
                                             timeout=min(90.0, max(5.0, remaining() / 8)))

    def relay_factory(**env: str) -> Any:
        return drain.Relay(run, concurrency=args.concurrency, loglevel=args.worker_loglevel, **env)

    try:
        if "confirm" not in args.skip:
            quiet("confirm")
            results["confirm"] = confirm.run_confirm_bench(run, destination, args.confirm_events)

        if "baseline" not in args.skip:
            results["baseline"] = {}
            acks = ("batch", "chain") if args.baseline_ack == "both" else (args.baseline_ack,)
            for ack in acks:
                if ack != acks[0] and remaining() < 0.6 * budget:
                    results["skipped"].append(f"baseline ack per {ack} (time budget)")
                    continue
                quiet(f"baseline-{ack}")
                results["baseline"][ack] = drain.run_baseline(run, destination, args.events, args.aggregates, ack,
                                                              timeout=max(60.0, remaining() / 3))

        if "drain" not in args.skip:
            quiet("drain")
            results["drain"], relay = drain.run_celery_drain(
                run, destination, relay_factory, args.events, args.aggregates,
                timeout=max(60.0, min(300.0, remaining() / 2)))

        if "profile" not in args.skip:
            if not os.path.exists(PY_SPY):
                results["skipped"].append(f"profile (no py-spy at {PY_SPY}: pip install py-spy)")
            elif remaining() < 150:
                results["skipped"].append("profile (time budget)")
            else:
                if relay is None:
                    relay = relay_factory()
                    relay.wait_ready(args.concurrency)
                quiet("profile")
                results["profile"] = drain.profile_drain(run, destination, relay, args.profile_events,
                                                         args.aggregates, timeout=min(240.0, remaining() / 3))
                if "live" not in args.skip:
                    # Where the time goes on the live path: py-spy on the worker during a wake run.
                    quiet("profile-live")
                    seconds = min(args.live_seconds, 10.0)
                    spies = drain.start_spies(run, relay.worker_pids(), seconds + 2, "live")
                    profiled = live.run_live(run, destination, "wake", args.live_rate, seconds, args.aggregates,
                                             args.writers, cpu_groups=drain.cpu_groups(relay),
                                             alive=relay.check_alive)
                    profiled["profiles"] = drain.collect_spies(relay, spies)
                    drain.log_profiles("profile live", profiled["profiles"])
                    results["profile_live"] = profiled

        if "live" not in args.skip:
            if relay is None:
                relay = relay_factory()
                relay.wait_ready(args.concurrency)
            groups = drain.cpu_groups(relay)
            for variant in ("wake", "poll"):
                if remaining() < args.live_seconds + 40:
                    results["skipped"].append(f"live {variant} (time budget)")
                    continue
                quiet(f"live-{variant}")
                results["live"][variant] = live.run_live(run, destination, variant, args.live_rate,
                                                         args.live_seconds, args.aggregates, args.writers,
                                                         cpu_groups=groups, alive=relay.check_alive)
            if args.listen:
                try:
                    import outbox.listen  # noqa: F401
                except ImportError:
                    results["skipped"].append("live listen (no outbox.listen)")
                else:
                    if remaining() < args.live_seconds + 60:
                        results["skipped"].append("live listen (time budget)")
                    else:
                        relay.stop()
                        relay = relay_factory(OUTBOX_RELAY_LISTEN="1")
                        relay.wait_ready(args.concurrency)
                        live.set_listen(True)
                        quiet("live-listen")
                        try:
                            results["live"]["listen"] = live.run_live(
                                run, destination, "listen", args.live_rate, args.live_seconds, args.aggregates,
                                args.writers, cpu_groups=drain.cpu_groups(relay), alive=relay.check_alive)
                        finally:
                            live.set_listen(False)
            if relay is not None:
                results["worker_rss_after_live_mb"] = {
                    str(pid): round((drain.rss_kb(pid) or 0) / 1024, 1) for pid in relay.worker_pids()}

        if "tuning" not in args.skip:
            results["tuning"] = {}
            # (name, extra environment of the worker, also measure live latency)
            variants = [
                ("task rows 25", {"OUTBOX_RELAY_TASK_ROWS": "25"}, False),
                ("batch 400, task rows 200", {"OUTBOX_BATCH_SIZE": "400", "OUTBOX_RELAY_TASK_ROWS": "200"}, False),
                ("synchronous_commit=off", {"PGOPTIONS": "-c synchronous_commit=off"}, True),
                ("no inline publishing (INLINE_ROWS=0)", {"OUTBOX_RELAY_INLINE_ROWS": "0"}, True),
            ]
            for name, env, with_live in variants:
                live_seconds = min(args.live_seconds, 10.0)
                if remaining() < 45 + (live_seconds + 15 if with_live else 0):
                    results["skipped"].append(f"tuning {name} (time budget)")
                    continue
                if relay is not None:
                    relay.stop()
                relay = relay_factory(**env)
                relay.wait_ready()
                quiet(f"tuning-{name}")
                results["tuning"][f"celery {name}"], relay = drain.run_celery_drain(
                    run, destination, relay_factory, args.tuning_events, args.aggregates,
                    timeout=max(60.0, min(300.0, remaining() / 2)), relay=relay, label=f"tuning drain [{name}]")
                if with_live and "live" not in args.skip:
                    quiet(f"tuning-live-{name}")
                    results["live"][f"wake [{name}]"] = live.run_live(
                        run, destination, "wake", args.live_rate, live_seconds, args.aggregates,
                        args.writers, cpu_groups=drain.cpu_groups(relay), alive=relay.check_alive)

    finally:
        if relay is not None:
            results["worker_log_tail"] = relay.log_tail(chars=2000)
            relay.stop()
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
        if args.json:
            args.json.write_text(to_json(results))
            log(f"wrote {args.json}")
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
