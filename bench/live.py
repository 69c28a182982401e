"""Live latency: writers commit events at a fixed rate while the relay runs; we measure, per
event, the time from the writer's commit returning to the event's first arrival at the bench
consumer (both clocks are this process's ``perf_counter``).

Variants (same worker, same beat, same rate and duration):

* ``wake``: the writer calls the post-commit wake right after each commit
  (``outbox.wake.request_claim`` when that module exists, else ``outbox.celery.tasks.wake``); the
  call's own cost is part of the latency (it runs before the next event is written) and is
  also reported on its own.
* ``poll``: no wake at all; beat's claim tick every OUTBOX_CLAIM_INTERVAL_S (and the relay's
  drain mode, which chains claims after publish tasks) deliver. This is the baseline.
* ``listen`` (when ``outbox.relay.listen`` exists and ``--listen`` is on): PostgreSQL
  LISTEN/NOTIFY, writers' ``enqueue`` adds a ``pg_notify`` and the worker listens; needs a
  worker started with OUTBOX_RELAY_LISTEN=1.

The writer's own cost (target 6 of issue 11: the wake adds at most 0.3 ms to the writer's
enqueue+commit p50): in every variant each writer leaves every ``PLAIN_EVERY``-th commit
*plain*: the same row, enqueued and committed the same way, but with no wake call and (listen
variant) no ``pg_notify``. Plain and woken commits interleave in the same threads at the same
time, so ``writer_wake_p50_ms - writer_plain_p50_ms`` is what the wake costs the caller in the
same conditions. A writer's last commit is never plain (``plain_commit``; why:
docs/benchmarks.md, "Live latency"). The commit-to-arrival figures (``p50_ms``...) are over
every commit; the ``woken_*`` ones over the woken commits only; ``slowest`` lists the slowest
events and when they were committed (``--events``: every event).

``python -m bench.live --seconds 5`` runs the variants on their own (it starts its own worker
and beat; ``--help``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

from .backlog import connect
from .common import CpuWindow, Destination, Run, aggregate_name, check_order, log, percentile
from .engines import engine

#: Every this many commits of a writer, one is plain (no wake, no NOTIFY): the baseline of
#: the writer-side figure, measured in the same run and threads.
PLAIN_EVERY = 4
#: The slowest events reported (id, aggregate, when after the first due commit, latency).
SLOWEST = 10

_plain = threading.local()


def plain_commit(k: int, commits: int) -> bool:
    """Whether a writer's ``k``-th commit (0-based, of ``commits``) is plain: every
    ``PLAIN_EVERY``-th, except the writer's last one, which nothing after it would wake
    (docs/benchmarks.md, "Live latency")."""
    return k % PLAIN_EVERY == PLAIN_EVERY - 1 and k < commits - 1


def _install_plain_switch() -> None:
    """Let a writer thread enqueue without ``pg_notify`` (listen variant's plain commits):
    ``enqueue`` asks ``notify_channel``, which answers None while the thread's switch is on.
    Bench-only; installed once per process."""
    import importlib

    enqueue_module = importlib.import_module("outbox.enqueue")  # (``outbox.enqueue`` is also the function)
    original = enqueue_module.notify_channel
    if getattr(original, "bench_plain_switch", False):
        return

    def notify_channel(kind: str, table: str, schema: str | None) -> str | None:
        return None if getattr(_plain, "on", False) else original(kind, table, schema)

    notify_channel.bench_plain_switch = True  # type: ignore[attr-defined]
    enqueue_module.notify_channel = notify_channel  # type: ignore[assignment]


def resolve_wake() -> tuple[Callable[[], Any], str]:
    try:
        from outbox import wake as wake_module

        fn = getattr(wake_module, "request_claim", None)
        if callable(fn):
            return fn, "outbox.wake.request_claim"
    except ImportError:
        pass
    from outbox.celery.tasks import wake

    return wake, "outbox.celery.tasks.wake"


class Writer(threading.Thread):
    """Commits its share of the events on a fixed schedule, one event per transaction."""

    def __init__(self, run: Run, index: int, writers: int, rate: float, duration: float, aggregates: int,
                 t0: float, wake: Callable[[], Any] | None) -> None:
        super().__init__(name=f"bench-writer-{index}", daemon=True)
        self.run_ = run
        self.index, self.writers, self.rate, self.duration = index, writers, rate, duration
        self.aggregates, self.t0, self.wake = aggregates, t0, wake
        self.commits: list[tuple[int, str, float]] = []  # (outbox id, aggregate, commit returned at)
        self.woken: set[int] = set()  # outbox ids committed with the wake (or NOTIFY)
        self.wake_s: list[float] = []
        #: enqueue + commit (+ the wake call) as the caller sees it, woken and plain commits
        self.write_wake_s: list[float] = []
        self.write_plain_s: list[float] = []
        self.late = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from outbox import enqueue

        total = int(self.rate * self.duration)
        spec = engine(self.run_.engine)  # the run's database (``bench.soak --engine``); PostgreSQL here
        try:
            with closing(connect(self.run_)) as conn:
                mine = range(self.index, total, self.writers)
                for k, i in enumerate(mine):
                    due = self.t0 + i / self.rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    elif delay < -0.005:
                        self.late += 1
                    aggregate = aggregate_name(i % self.aggregates)
                    plain = plain_commit(k, len(mine))
                    _plain.on = plain
                    started = time.perf_counter()
                    spec.begin(conn)  # SQLite: BEGIN IMMEDIATE (the others open a transaction themselves)
                    outbox_id = enqueue(conn, topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                                        payload={"orderId": aggregate, "n": i, "state": "confirmed",
                                                 "amount": "129.90", "currency": "EUR"},
                                        headers={"x-tenant": "acme", "x-source": "bench-live"},
                                        table=self.run_.table)
                    conn.commit()
                    committed = time.perf_counter()
                    if plain:
                        self.write_plain_s.append(committed - started)
                    else:
                        if self.wake is not None:
                            self.wake()
                            self.wake_s.append(time.perf_counter() - committed)
                        self.write_wake_s.append(time.perf_counter() - started)
                        self.woken.add(outbox_id)
                    self.commits.append((outbox_id, aggregate, committed))
        except BaseException as exc:  # noqa: BLE001 - reported by run_live
            self.error = exc


def run_live(run: Run, destination: Destination, variant: str, rate: float, duration: float,
             aggregates: int = 100, writers: int = 2, cpu_groups: dict[str, Any] | None = None,
             alive: Callable[[], None] | None = None, keep_events: bool = False) -> dict[str, Any]:
    if aggregates % writers:
        raise ValueError("aggregates must be a multiple of writers (one writer per aggregate)")
    wake, wake_name = resolve_wake() if variant == "wake" else (None, None)
    _install_plain_switch()
    if wake is not None:
        wake()  # warm up: connections to Redis, the Celery producer pool
        time.sleep(0.5)
    destination.reset()
    window = CpuWindow(cpu_groups or {})
    window.start()
    t0 = time.perf_counter() + 0.2
    t0_epoch = time.time() + (t0 - time.perf_counter())  # to line events up with the worker's log
    threads = [Writer(run, k, writers, rate, duration, aggregates, t0, wake) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration + 60)
        if alive is not None:
            alive()
    errors = [t.error for t in threads if t.error is not None]
    if errors:
        raise RuntimeError(f"writer failed: {errors[0]!r}")
    commits = [c for t in threads for c in t.commits]
    wrote_for = max((c[2] for c in commits), default=t0) - t0
    destination.wait_for(len(commits), timeout=30, idle_timeout=max(5.0, 3 * run.claim_interval_s), alive=alive)
    cpu = window.stop()
    arrivals = list(destination.arrivals)
    first: dict[int, float] = {}
    for t, outbox_id, _ in arrivals:
        first.setdefault(outbox_id, t)
    latencies_ms = [(first[i] - committed) * 1000.0 for i, _, committed in commits if i in first]
    expected: dict[str, list[int]] = {}
    for i, aggregate, _ in sorted(commits, key=lambda c: c[0]):
        expected.setdefault(aggregate, []).append(i)
    wake_ms = [1000.0 * s for t in threads for s in t.wake_s]
    woken = set().union(*(t.woken for t in threads))
    woken_ms = [(first[i] - committed) * 1000.0 for i, _, committed in commits if i in first and i in woken]
    write_wake_ms = [1000.0 * s for t in threads for s in t.write_wake_s]
    write_plain_ms = [1000.0 * s for t in threads for s in t.write_plain_s]
    # Every event: (outbox id, aggregate, commit returned at, seconds after t0, latency ms,
    # woken?), commit order: which events were slow, and when in the run.
    events = sorted(((i, aggregate, committed - t0, (first[i] - committed) * 1000.0 if i in first else None,
                      i in woken) for i, aggregate, committed in commits), key=lambda e: e[2])
    slowest = sorted((e for e in events if e[3] is not None), key=lambda e: -e[3])[:SLOWEST]
    result = {
        "variant": variant, "wake_api": wake_name, "rate": rate, "duration_s": duration, "writers": writers,
        "committed": len(commits), "achieved_rate": len(commits) / wrote_for if wrote_for > 0 else 0.0,
        "late_commits": sum(t.late for t in threads), "arrived": len(latencies_ms),
        "p50_ms": percentile(latencies_ms, 0.50), "p90_ms": percentile(latencies_ms, 0.90),
        "p99_ms": percentile(latencies_ms, 0.99), "max_ms": max(latencies_ms, default=float("nan")),
        "mean_ms": sum(latencies_ms) / len(latencies_ms) if latencies_ms else float("nan"),
        "negative": sum(1 for x in latencies_ms if x < 0),
        "wake_call_p50_ms": percentile(wake_ms, 0.5) if wake_ms else None,
        "wake_call_p99_ms": percentile(wake_ms, 0.99) if wake_ms else None,
        "order": check_order(arrivals, expected), "cpu": cpu,
        "woken_p50_ms": percentile(woken_ms, 0.50), "woken_p99_ms": percentile(woken_ms, 0.99),
        "plain_every": PLAIN_EVERY,
        "writer_wake_p50_ms": percentile(write_wake_ms, 0.50), "writer_wake_p99_ms": percentile(write_wake_ms, 0.99),
        "writer_plain_p50_ms": percentile(write_plain_ms, 0.50),
        "writer_plain_p99_ms": percentile(write_plain_ms, 0.99),
        "slowest": [{"id": i, "aggregate": a, "at_s": round(at, 4), "ms": round(ms, 2), "woken": w}
                    for i, a, at, ms, w in slowest],
    }
    if keep_events:
        result["t0_epoch"] = t0_epoch
        result["events"] = [{"id": i, "aggregate": a, "at_s": round(at, 4), "ms": ms, "woken": w}
                            for i, a, at, ms, w in events]
        # Every arrival after an event's first (at-least-once), seconds after t0 as ``at_s``:
        # when it came again tells which fault sent it twice.
        result["repeats"] = [{"id": i, "aggregate": a, "first_s": round(first[i] - t0, 4), "again_s": round(t - t0, 4)}
                             for t, i, a in arrivals if first[i] != t]
    result["writer_added_p50_ms"] = result["writer_wake_p50_ms"] - result["writer_plain_p50_ms"]
    result["writer_added_p99_ms"] = result["writer_wake_p99_ms"] - result["writer_plain_p99_ms"]
    log(f"live {variant:6s}: {result['committed']} commits at {result['achieved_rate']:.0f}/s, "
        f"{result['arrived']} arrived; commit-to-arrival p50 {result['p50_ms']:.1f} ms, p90 "
        f"{result['p90_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms; "
        f"order ok={result['order']['ok']}"
        + (f"; wake call p50 {result['wake_call_p50_ms']:.2f} ms p99 {result['wake_call_p99_ms']:.2f} ms"
           if wake_ms else ""))
    log(f"live {variant:6s}: writer enqueue+commit p50 {result['writer_wake_p50_ms']:.2f} ms p99 "
        f"{result['writer_wake_p99_ms']:.2f} ms with the {variant}, {result['writer_plain_p50_ms']:.2f} / "
        f"{result['writer_plain_p99_ms']:.2f} ms plain (1 commit in {PLAIN_EVERY}): adds "
        f"{result['writer_added_p50_ms']:+.2f} ms p50, {result['writer_added_p99_ms']:+.2f} ms p99; woken commits "
        f"arrive p50 {result['woken_p50_ms']:.1f} ms p99 {result['woken_p99_ms']:.1f} ms")
    log(f"live {variant:6s}: slowest: " + ", ".join(
        f"{e['ms']:.0f} ms (id {e['id']} at {e['at_s']:.2f} s{'' if e['woken'] else ', plain'})"
        for e in result["slowest"][:5]))
    return result


def set_listen(enabled: bool) -> None:
    """Turn the writer side of LISTEN/NOTIFY on or off in this process."""
    if enabled:
        os.environ["OUTBOX_RELAY_LISTEN"] = "1"
    else:
        os.environ.pop("OUTBOX_RELAY_LISTEN", None)
    from outbox.core.config import reset_settings

    reset_settings()


#: ``python -m bench.live`` variants: (run_live variant, extra environment of the worker).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "wake": ("wake", {}),
    # The same wake with the worker's in-process claim off: every wake is a claim message
    # through Celery's broker to a pool process (the hop the in-process claim saves).
    "wake-celery": ("wake", {"OUTBOX_RELAY_IN_PROCESS_CLAIM": "0"}),
    "listen": ("listen", {"OUTBOX_RELAY_LISTEN": "1"}),
    "listen-celery": ("listen", {"OUTBOX_RELAY_LISTEN": "1", "OUTBOX_RELAY_IN_PROCESS_CLAIM": "0"}),
    "poll": ("poll", {}),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.live``: the live variants on their own, with a worker and beat of their own."""
    import argparse
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    from . import drain, profiling
    from .common import create_table, flush_redis, require_services, teardown, to_json

    p = argparse.ArgumentParser(prog="python -m bench.live", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="how long the writers write (default 5)")
    p.add_argument("--rate", type=float, default=200.0, help="events/s the writers commit")
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--aggregates", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork)")
    p.add_argument("--variants", default="wake,wake-celery,listen,poll",
                   help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=1, help="run the variants this many times, interleaved")
    p.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment of the worker (repeatable)")
    p.add_argument("--profile", action="store_true", help="py-spy --idle on the worker during the first wake run")
    p.add_argument("--profile-cpu", type=Path, metavar="DIR",
                   help="py-spy on-CPU samples (no --idle) of the worker during the first wake run, raw stacks kept in "
                        "DIR: where the CPU goes, to compare two trees")
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument("--events", action="store_true", help="with --json: every event's latency and commit time too")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    require_services()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-live-"))
    run = Run(workdir=workdir)
    for key in [k for k in os.environ if k.startswith(("OUTBOX_", "CELERY_"))]:
        del os.environ[key]
    os.environ.update(run.outbox_env())
    worker_env = dict(item.split("=", 1) for item in args.worker_env)
    flush_redis(run.redis_url)
    create_table(run)
    destination = Destination(run)
    relay: drain.Relay | None = None
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        current_env: dict[str, str] | None = None
        for _ in range(args.repeat):
            for variant in variants:
                kind, env = VARIANTS[variant]
                env = {**worker_env, **env}
                if relay is None or env != current_env:
                    if relay is not None:
                        relay.stop()
                    relay, current_env = drain.Relay(run, concurrency=args.concurrency, **env), env
                    relay.wait_ready(args.concurrency)
                listen = kind == "listen"
                set_listen(listen)
                spies = None
                if (args.profile or args.profile_cpu) and variant not in results:
                    if args.profile_cpu:
                        args.profile_cpu.mkdir(parents=True, exist_ok=True)
                    spies = profiling.start_spies(run, relay.worker_pids(), args.seconds + 2, "live",
                                                  idle=not args.profile_cpu, out_dir=args.profile_cpu)
                try:
                    r = run_live(run, destination, kind, args.rate, args.seconds, args.aggregates, args.writers,
                                 cpu_groups=drain.cpu_groups(relay), alive=relay.check_alive,
                                 keep_events=args.events)
                finally:
                    set_listen(False)
                if spies is not None:
                    r["profiles"] = profiling.collect_spies(relay, spies)
                    profiling.log_profiles("profile live", r["profiles"])
                results.setdefault(variant, []).append(r)
    finally:
        teardown(run, destination, relay)
        shutil.rmtree(workdir, ignore_errors=True)
    print("variant        commit->arrival p50/p99 ms (woken p50/p99)   writer enqueue+commit p50/p99 ms: "
          "with wake | plain | added p50")
    for variant, runs in results.items():
        for r in runs:
            print(f"{variant:13s}  {r['p50_ms']:6.1f} / {r['p99_ms']:6.1f}  ({r['woken_p50_ms']:6.1f} / "
                  f"{r['woken_p99_ms']:6.1f})        {r['writer_wake_p50_ms']:.2f} / {r['writer_wake_p99_ms']:.2f} | "
                  f"{r['writer_plain_p50_ms']:.2f} / {r['writer_plain_p99_ms']:.2f} | "
                  f"{r['writer_added_p50_ms']:+.2f}   order ok={r['order']['ok']} "
                  f"{r['arrived']}/{r['committed']} arrived")
    if args.json:
        args.json.write_text(to_json(results))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
