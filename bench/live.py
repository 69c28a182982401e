"""Live latency: writers commit events at a fixed rate while the relay runs; we measure, per
event, the time from the writer's commit returning to the event's first arrival at the bench
consumer (both clocks are this process's ``perf_counter``).

Variants (same worker, same beat, same rate and duration):

* ``wake``: the writer calls the post-commit wake right after each commit
  (``outbox.wake.request_claim`` when that module exists, else ``outbox.tasks.wake``); the
  call's own cost is part of the latency (it runs before the next event is written) and is
  also reported on its own.
* ``poll``: no wake at all; beat's claim tick every OUTBOX_CLAIM_INTERVAL_S (and the relay's
  drain mode, which chains claims after publish tasks) deliver. This is the baseline.
* ``listen`` (when ``outbox.listen`` exists and ``--listen`` is on): PostgreSQL
  LISTEN/NOTIFY, writers' ``enqueue`` adds a ``pg_notify`` and the worker listens; needs a
  worker started with OUTBOX_RELAY_LISTEN=1.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from .common import CpuWindow, Destination, Run, aggregate_name, check_order, log, percentile, pg_connect


def resolve_wake() -> tuple[Callable[[], Any], str]:
    try:
        from outbox import wake as wake_module

        fn = getattr(wake_module, "request_claim", None)
        if callable(fn):
            return fn, "outbox.wake.request_claim"
    except ImportError:
        pass
    from outbox.tasks import wake

    return wake, "outbox.tasks.wake"


class Writer(threading.Thread):
    """Commits its share of the events on a fixed schedule, one event per transaction."""

    def __init__(self, run: Run, index: int, writers: int, rate: float, duration: float, aggregates: int,
                 t0: float, wake: Callable[[], Any] | None) -> None:
        super().__init__(name=f"bench-writer-{index}", daemon=True)
        self.run_ = run
        self.index, self.writers, self.rate, self.duration = index, writers, rate, duration
        self.aggregates, self.t0, self.wake = aggregates, t0, wake
        self.commits: list[tuple[int, str, float]] = []  # (outbox id, aggregate, commit returned at)
        self.wake_s: list[float] = []
        self.late = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from outbox import enqueue

        total = int(self.rate * self.duration)
        try:
            with pg_connect(self.run_.postgres_url) as conn:
                for i in range(self.index, total, self.writers):
                    due = self.t0 + i / self.rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    elif delay < -0.005:
                        self.late += 1
                    aggregate = aggregate_name(i % self.aggregates)
                    outbox_id = enqueue(conn, topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                                        payload={"orderId": aggregate, "n": i, "state": "confirmed",
                                                 "amount": "129.90", "currency": "EUR"},
                                        headers={"x-tenant": "acme", "x-source": "bench-live"},
                                        table=self.run_.table)
                    conn.commit()
                    committed = time.perf_counter()
                    self.commits.append((outbox_id, aggregate, committed))
                    if self.wake is not None:
                        self.wake()
                        self.wake_s.append(time.perf_counter() - committed)
        except BaseException as exc:  # noqa: BLE001 - reported by run_live
            self.error = exc


def run_live(run: Run, destination: Destination, variant: str, rate: float, duration: float,
             aggregates: int = 100, writers: int = 2, cpu_groups: dict[str, Any] | None = None,
             alive: Callable[[], None] | None = None) -> dict[str, Any]:
    if aggregates % writers:
        raise ValueError("aggregates must be a multiple of writers (one writer per aggregate)")
    wake, wake_name = resolve_wake() if variant == "wake" else (None, None)
    if wake is not None:
        wake()  # warm up: connections to Redis, the Celery producer pool
        time.sleep(0.5)
    destination.reset()
    window = CpuWindow(cpu_groups or {})
    window.start()
    t0 = time.perf_counter() + 0.2
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
    }
    log(f"live {variant:6s}: {result['committed']} commits at {result['achieved_rate']:.0f}/s, "
        f"{result['arrived']} arrived; commit-to-arrival p50 {result['p50_ms']:.1f} ms, p90 "
        f"{result['p90_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms; "
        f"order ok={result['order']['ok']}"
        + (f"; wake call p50 {result['wake_call_p50_ms']:.2f} ms p99 {result['wake_call_p99_ms']:.2f} ms"
           if wake_ms else ""))
    return result


def set_listen(enabled: bool) -> None:
    """Turn the writer side of LISTEN/NOTIFY on or off in this process."""
    if enabled:
        os.environ["OUTBOX_RELAY_LISTEN"] = "1"
    else:
        os.environ.pop("OUTBOX_RELAY_LISTEN", None)
    from outbox.config import reset_settings

    reset_settings()
