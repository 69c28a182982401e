"""Memory while draining large events (issue 11, target 7: at most 256 MB RSS per worker process).

A backlog where every ``big_every``-th event carries a payload of about ``big_bytes`` (1 MB by
default, 1 in 20: the rest are ~200-byte events) is drained by a fresh
``celery -A outbox worker -c 2`` + beat with the shipped settings, PostgreSQL, RabbitMQ, and
Redis as Celery's broker. Every worker process (the parent and each pool child) is sampled
from ``/proc/<pid>/status`` every ``interval`` seconds (``VmRSS``), and its lifetime peak
(``VmHWM``, kept by the kernel, so a spike between two samples is not missed) is read at
the end. The worker is fresh, so that peak belongs to this drain. What bounds the figure:
docs/relay.md, "Memory: claims sized by bytes", and docs/benchmarks.md, "Memory (target 7)".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .common import (
    Destination,
    Run,
    check_order,
    load_backlog,
    log,
    process_tree,
    rss_kb,
    status_counts,
    truncate_table,
    wait_all_done,
)
from .drain import arrival_rate

TARGET_MB = 256.0


class RssSampler(threading.Thread):
    """VmRSS of every process under ``root`` (found again at each sample: a pool child
    replaced mid-run is sampled too)."""

    def __init__(self, root: int, interval: float = 0.05) -> None:
        super().__init__(name="bench-rss", daemon=True)
        self.root = root
        self.interval = interval
        self.max_kb: dict[int, int] = {}
        self.hwm_kb: dict[int, int] = {}
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        for pid in process_tree(self.root):
            kb = rss_kb(pid)
            if kb is not None:
                self.max_kb[pid] = max(kb, self.max_kb.get(pid, 0))
            hwm = rss_kb(pid, "VmHWM")
            if hwm is not None:
                self.hwm_kb[pid] = max(hwm, self.hwm_kb.get(pid, 0))
        self.samples += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.sample()  # the peaks as the kernel kept them, after the drain


def run_memory(run: Run, destination: Destination, relay_factory: Callable[..., Any], events: int,
               aggregates: int, big_every: int = 20, big_bytes: int = 1_000_000, timeout: float = 300.0,
               interval: float = 0.05, **worker_env: str) -> dict[str, Any]:
    """Load the mixed backlog, start a fresh worker, drain, and report every worker process's
    peak RSS against ``TARGET_MB``. The worker is stopped before returning."""
    truncate_table(run)
    big = events // big_every if big_every > 0 else 0
    log(f"memory: loading {events} events over {aggregates} aggregates, 1 in {big_every} of "
        f"{big_bytes / 1e6:.1f} MB ({big} large, {big * big_bytes / 1e6:.0f} MB of payloads)")
    expected = load_backlog(run, events, aggregates, big_every=big_every, big_bytes=big_bytes)
    destination.reset()
    # The worker may drain a small backlog before it is reported ready: sample from its start
    # (the kernel's VmHWM keeps any peak between samples), and take the rate from the arrivals.
    relay = relay_factory(**worker_env)
    try:
        sampler = RssSampler(relay.worker.pid, interval)
        sampler.start()
        relay.wait_ready()
        baseline = {pid: round((rss_kb(pid) or 0) / 1024, 1) for pid in relay.worker_pids()}
        reached = destination.wait_for(events, timeout=timeout, idle_timeout=30, alive=relay.check_alive)
        sampler.stop()
        arrivals = list(destination.arrivals)
        seconds = arrival_rate(arrivals, events)["seconds"]
        counts = wait_all_done(run, timeout=30 if reached else 60)
        parent = relay.worker.pid
        per_process = [{"pid": pid, "role": "parent" if pid == parent else "child",
                        "idle_rss_mb": baseline.get(pid),
                        "max_rss_mb": round(kb / 1024, 1),
                        "peak_hwm_mb": round(sampler.hwm_kb.get(pid, kb) / 1024, 1)}
                       for pid, kb in sorted(sampler.max_kb.items())]
        worst = max((max(p["max_rss_mb"], p["peak_hwm_mb"]) for p in per_process), default=0.0)
        result = {"events": events, "aggregates": aggregates, "big_every": big_every, "big_bytes": big_bytes,
                  "large_events": big, "complete": reached, "seconds": round(seconds, 2),
                  "events_per_s": round(len({a[1] for a in arrivals}) / seconds, 1) if seconds > 0 else None,
                  "idle_rss_note": "RSS when the pool was ready (it may already have been draining)",
                  "mb_per_s": round(big * big_bytes / 1e6 / seconds, 1) if seconds > 0 else None,
                  "order": check_order(arrivals, expected), "table": counts or status_counts(run),
                  "per_process": per_process, "max_rss_mb": worst, "target_mb": TARGET_MB,
                  "samples": sampler.samples, "worker_env": worker_env}
        if not reached:
            result["worker_log_tail"] = relay.log_tail()
        log(f"memory: {result['events_per_s']} ev/s ({result['mb_per_s']} MB/s of large payloads), "
            f"complete={reached}, order ok={result['order']['ok']}; peak RSS per worker process: "
            + ", ".join(f"{p['role']} {p['pid']} {max(p['max_rss_mb'], p['peak_hwm_mb'])} MB "
                        f"(idle {p['idle_rss_mb']})" for p in per_process)
            + f"; max {worst} MB against {TARGET_MB:.0f} MB")
        return result
    finally:
        relay.stop()
