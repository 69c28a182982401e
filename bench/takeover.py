"""A lost worker: the longest stand-still of any aggregate after one worker's process group is
SIGKILLed mid-drain (a node lost, no restart), next to the fault-free drain of the same run
(docs/internals.md, "Lost workers").

Two ``celery -A outbox worker -c 2`` (prefork) and one beat on PostgreSQL, default settings
(a lease of 60 s, a holder timeout of 3 s), a backlog of ``--events`` over ``--aggregates``:

1. fault-free: both workers drain the backlog; per aggregate, the longest gap between two
   first arrivals of its events;
2. lost worker: the same backlog again, and one worker's whole process group is SIGKILLed once
   ``--kill-at`` of it arrived; per aggregate, the longest wait from the kill (or from an
   arrival after it) to its next first arrival. Also: how many rows the survivor took over
   (its log line), duplicates, and whether the order held.

Nothing is asserted; the figures are printed (docs/benchmarks.md records them).

    python -m bench.takeover [--events 12000] [--aggregates 40] [--kill-at 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import (
    CELERY,
    Destination,
    Run,
    check_order,
    create_table,
    drop_table,
    flush_redis,
    load_backlog,
    log,
    process_tree,
    require_services,
    stop_process_group,
    to_json,
    truncate_table,
)
from .drain import arrival_rate

TAKEOVER = re.compile(r"took over (\d+) rows of a lost worker process \(holder (\w+).*silent for ([\d.]+) s, "
                      r"rows held for ([\d.]+) s")


class Worker:
    """One relay worker (prefork) as its own process group, its log in the run's directory."""

    def __init__(self, run: Run, name: str, concurrency: int, *args: str) -> None:
        self.name = name
        self.log_path = run.workdir / f"{name}.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [CELERY, "-A", "outbox", *args, "--loglevel=WARNING"] if args else
                [CELERY, "-A", "outbox", "worker", "-P", "prefork", "-c", str(concurrency), "-n",
                 f"bench-{name}-{run.tag}@%h", "--loglevel=WARNING", "--without-mingle", "--without-gossip",
                 "--without-heartbeat"],
                cwd=run.workdir, env=run.child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process_group(self.proc)


def stand_stills(arrivals: list[tuple[float, int, str]], since: float) -> dict[str, float]:
    """Per aggregate with first arrivals after ``since`` (perf_counter): the longest wait from
    ``since`` or one first arrival to the next."""
    first: dict[int, tuple[float, str]] = {}
    for t, outbox_id, aggregate in arrivals:
        first.setdefault(outbox_id, (t, aggregate))
    times: dict[str, list[float]] = {}
    for t, aggregate in first.values():
        times.setdefault(aggregate, []).append(t)
    gaps = {}
    for aggregate, ts in times.items():
        later = sorted(t for t in ts if t >= since)
        if later:
            points = [since, *later]
            gaps[aggregate] = max(b - a for a, b in zip(points, points[1:]))
    return gaps


def _drain(run: Run, destination: Destination, events: int, aggregates: int, concurrency: int,
           kill_at: float | None, timeout: float) -> dict[str, Any]:
    flush_redis(run.redis_url)
    truncate_table(run)
    destination.reset()
    workers = [Worker(run, "w1", concurrency), Worker(run, "w2", concurrency)]
    beat = Worker(run, "beat", 0, "beat", "-s", str(run.workdir / "beat-schedule"))
    try:
        deadline = time.monotonic() + 30
        while any(len(process_tree(w.proc.pid)) < concurrency + 1 for w in workers):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not start their pools in 30 s")
            time.sleep(0.1)
        time.sleep(2.0)  # the pools consume, and every process has beaten for longer than the holder timeout
        started = time.perf_counter()
        expected = load_backlog(run, events, aggregates)
        since = started
        if kill_at is not None:
            destination.wait_for(int(events * kill_at), timeout=timeout)
            workers[0].kill()
            since = time.perf_counter()
            log(f"lost worker: SIGKILLed w1's process group after {destination.unique()} of {events} arrived")
        reached = destination.wait_for(events, timeout=timeout, idle_timeout=90)
        arrivals = list(destination.arrivals)
        gaps = stand_stills(arrivals, since)
        taken = [m.groups() for m in TAKEOVER.finditer(workers[1].log())]
    finally:
        for w in (beat, *workers):
            w.stop()
    order = check_order(arrivals, expected)
    values = sorted(gaps.values())
    return {"events": events, "aggregates": aggregates, "complete": reached, **arrival_rate(arrivals, events),
            "longest_stand_still_s": values[-1] if values else 0.0,
            "median_stand_still_s": statistics.median(values) if values else 0.0,
            "aggregates_waiting": len(values), "order_ok": order["ok"], "duplicates": order["duplicates"],
            "rows_taken_over": sum(int(t[0]) for t in taken),
            "takeover_lines": [{"rows": int(r), "holder": h, "silent_s": float(s), "held_s": float(held)}
                               for r, h, s, held in taken]}


def run_takeover(events: int = 12_000, aggregates: int = 40, *, concurrency: int = 2, kill_at: float = 0.3,
                 timeout: float = 120.0) -> dict[str, Any]:
    """The fault-free drain, then the same with one worker lost; returns both and the figures."""
    require_services()
    run = Run(workdir=Path(tempfile.mkdtemp(prefix="bench-takeover-")))
    create_table(run)
    destination = Destination(run)
    try:
        clean = _drain(run, destination, events, aggregates, concurrency, None, timeout)
        log(f"fault-free drain: {clean['events_per_s']:.0f} ev/s over {clean['seconds']:.1f} s, longest stand-still "
            f"{clean['longest_stand_still_s']:.2f} s, order ok={clean['order_ok']}, dups={clean['duplicates']}")
        lost = _drain(run, destination, events, aggregates, concurrency, kill_at, timeout)
        log(f"lost worker: {lost['events_per_s']:.0f} ev/s over {lost['seconds']:.1f} s, longest stand-still after "
            f"the kill {lost['longest_stand_still_s']:.2f} s (median over {lost['aggregates_waiting']} aggregates "
            f"{lost['median_stand_still_s']:.2f} s), {lost['rows_taken_over']} rows taken over, order "
            f"ok={lost['order_ok']}, dups={lost['duplicates']}")
    finally:
        destination.close()
        drop_table(run)
        flush_redis(run.redis_url)
    return {"events": events, "aggregates": aggregates, "concurrency": concurrency, "kill_at": kill_at,
            "fault_free": clean, "lost_worker": lost,
            "longest_stand_still_s": lost["longest_stand_still_s"],
            "fault_free_longest_stand_still_s": clean["longest_stand_still_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=12_000, help="backlog of each drain (12000)")
    parser.add_argument("--aggregates", type=int, default=40, help="aggregates of the backlog (40)")
    parser.add_argument("--concurrency", type=int, default=2, help="processes of each worker (2)")
    parser.add_argument("--kill-at", type=float, default=0.3, help="fraction of the backlog arrived at the kill (0.3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full result here")
    args = parser.parse_args(argv)
    result = run_takeover(args.events, args.aggregates, concurrency=args.concurrency, kill_at=args.kill_at)
    if args.json is not None:
        args.json.write_text(to_json(result))
    clean, lost = result["fault_free"], result["lost_worker"]
    print(json.dumps({k: v for k, v in result.items() if k not in ("fault_free", "lost_worker")}))
    print(f"lost worker: longest stand-still {lost['longest_stand_still_s']:.2f} s (median "
          f"{lost['median_stand_still_s']:.2f} s), drain {lost['seconds']:.1f} s; fault-free: longest stand-still "
          f"{clean['longest_stand_still_s']:.2f} s, drain {clean['seconds']:.1f} s")
    return 0 if clean["order_ok"] and lost["order_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
