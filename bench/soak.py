"""``python -m bench.soak``: does a worker leak under steady traffic? Memory, file descriptors,
threads and connections of every relay process, sampled over a bounded run.

For ``--minutes`` (10; 2 with ``--quick``) two writers commit events at a steady ``--rate`` (200/s)
over 100 aggregates, each commit followed by the post-commit wake, into PostgreSQL (``--engine
mysql`` or ``sqlite`` too); the relay (``--runner celery``: ``celery -A outbox worker -c 2`` + beat,
``bench.drain.Relay``; or ``dramatiq``: ``bench.dramatiq_drain.DramatiqRelay``) drains them to
RabbitMQ, and the bench's consumer checks the per-aggregate order and counts. The writing,
waking and checking are ``bench.live.run_live``'s (its ``wake`` variant), run for the soak's
length while a sampler thread reads, every ``--sample-s`` seconds (15; 5 with ``--quick``), for
every process of the worker's and the beat's (scheduler's) process trees, found again at each
sample:

* RSS (``VmRSS`` of ``/proc/<pid>/status``) and threads (its ``Threads``); the RSS also by kind of
  mapping (``bench.procs.rss_by_mapping``: brk heap, glibc's thread arenas, other anonymous
  mappings with CPython's arenas, files), printed for a process whose RSS steps or grows;
* open file descriptors (the entries of ``/proc/<pid>/fd``);
* its TCP connections by peer: to the database, RabbitMQ and Redis (``bench.procs.peers``;
  SQLite: the descriptors open on the database's files);
* and once per sample the database's own count of the relay's sessions: PostgreSQL's
  ``pg_stat_activity`` rows with the relay's ``application_name`` (the relay sets none: the bench
  gives its processes ``PGAPPNAME=outbox-soak-<run>``, which libpq reads); MariaDB's
  ``information_schema.PROCESSLIST`` rows whose client port is one of the relay processes'.

At the end it prints, per process (worker parent, each pool child, beat) and per measure, the value
at the end of the warm-up (the first ``--warmup`` share of the run, 20 %) and at the end, the
least-squares slope per hour after the warm-up, and a verdict (``assess``): **GROWS** where the
value's floor (the least value from a sample on, so a passing spike does not count) rose by more
than the measure's noise after the warm-up, in both halves of that window (by over half the noise
in each), and the slope is above the measure's threshold; **STEP** where it rose, but not in both
halves (a lazily opened resource, an allocator step, or the first sign of a slow leak: a longer
run tells); otherwise flat. The thresholds (``MEASURES``) and why: docs/benchmarks.md, "Soak:
leaks over time". Then throughput, commit-to-arrival p99
(whole run, warm-up, last fifth), order and duplicates. Nothing here asserts anything.

``--heap`` (investigation; cheap) has every relay process report its Python heap at the end of the
warm-up and at the end through a ``sitecustomize`` hook the bench puts on their ``PYTHONPATH``
(CPython's allocator statistics, gc-tracked objects by type) and prints what grew;
``--tracemalloc`` also traces every allocation and prints the tracebacks whose memory grew most
(it slows the relay, which may fall behind: then the figures describe a backlog).

``--faults``: do network blips leak, or leave the relay stuck? The relay's processes reach the
database, RabbitMQ (its publish URL) and Redis (Celery's or Dramatiq's broker) through one
``bench.latency.ProxyProcess`` with no added delay; the bench's writers, wake, consumer and
sampler keep their direct connections. From the end of the warm-up, every ``--fault-every``
seconds (60) the next of ``--fault-targets`` (database, RabbitMQ, Redis, in turn) is cut for
``--fault-s`` seconds (5): every live connection through its proxy is reset (RST), and new ones
are reset as soon as accepted until the cut ends; each cut is logged with its time and the
connections it reset, and none starts unless it and its ``--settle-s`` (10) end within the run.
The connections by peer are counted by the proxy's ports (``service_ports`` of the relay's own
URLs), so each still counts for the server behind it; MariaDB's sessions are those on the
proxy's ports to it. The verdicts compare like with like: the warm-up's end is the relay's
steady state before any cut, and they use only the samples taken settled, neither during a cut
(from ``FAULT_GUARD_S`` before) nor within ``--settle-s`` after it (``settled``): a sample with a
connection down, or its replacement half made, would move the floor and make a STEP of nothing,
and what a reconnect leaves behind still shows in the next settled sample. (Cuts during the
warm-up would make its end a post-cut state and hide the first reconnect's step.) The report
adds each cut, the events written and delivered, duplicates and order, and per cut
(``recovery``): the events that arrived during it, the first arrival after it, when every event
committed before its end had arrived, the longest gap in arrivals until the next cut, the events
lost, the events that came twice (``duplicates_by_cut``: each repeated arrival is charged to
the last cut begun before it), and whether delivery resumed and caught up; then the aggregates whose events never
arrived (``missing_by_aggregate``: a few with many is a chain held back, many with few a relay
behind everywhere). The lag windows are then on the faults' clock (the warm-up's p99 is before
the first cut, the last fifth's includes cuts).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backlog import connect
from .common import (
    Destination,
    Run,
    create_table,
    drop_table,
    flush_redis,
    log,
    machine_facts,
    percentile,
    process_tree,
    require_services,
    rss_kb,
    to_json,
)
from .engines import engine_names, query
from .procs import open_files, peers, rss_by_mapping, tcp_sockets

# -- the pure part: slopes and verdicts (tests/test_bench_soak.py) -------------------------------

@dataclass(frozen=True)
class Measure:
    """One sampled quantity and what counts as growth. ``noise``: a rise of the floor up to this
    is not growth (RSS moves in allocator steps; counts are exact, 0); ``per_hour``: the slope
    (after the warm-up) above which a rise counts."""

    key: str
    label: str
    unit: str
    noise: float
    per_hour: float


#: What each process is sampled for. RSS: 5 MB/h takes an idle 66 MB worker to the 256 MB
#: per-process target of issue 11 in under two days; a rise of 1 MB or less is one step of
#: the allocators (CPython's arenas are 1 MiB; glibc's malloc grows and trims its heap in steps of
#: about that size) and says nothing on its own. Counts: any rise that lasts is growth.
MEASURES: tuple[Measure, ...] = (
    Measure("rss_mb", "RSS", "MB", noise=1.0, per_hour=5.0),
    Measure("fds", "open fds", "", noise=0.0, per_hour=0.0),
    Measure("threads", "threads", "", noise=0.0, per_hour=0.0),
    Measure("db", "database connections", "", noise=0.0, per_hour=0.0),
    Measure("amqp", "RabbitMQ connections", "", noise=0.0, per_hour=0.0),
    Measure("redis", "Redis connections", "", noise=0.0, per_hour=0.0),
)
#: The database's own count of the relay's sessions (one series for the whole relay).
SESSIONS = Measure("sessions", "database sessions (server side)", "", noise=0.0, per_hour=0.0)


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, value)`` points, per unit of t (0 for fewer than two
    distinct times)."""
    if len({t for t, _ in points}) < 2:
        return 0.0
    return statistics.linear_regression([t for t, _ in points], [v for _, v in points]).slope


def floors(values: Sequence[float]) -> list[float]:
    """Each value's floor: the least value from it on (a spike that went away again is not
    part of it)."""
    out: list[float] = []
    low = math.inf
    for v in reversed(values):
        low = min(low, v)
        out.append(low)
    return out[::-1]


def assess(points: Sequence[tuple[float, float]], warmup_s: float, measure: Measure) -> dict[str, Any]:
    """The verdict on one series of ``(seconds into the run, value)`` samples: the value at the
    end of the warm-up (the last sample at or before ``warmup_s``) and at the end, the slope per
    hour over the samples from the end of the warm-up on, the floor's rise over them, and:

    * ``GROWS``: the floor rose by more than ``measure.noise`` in all, and by more than half
      the noise in each half of the window (growth still going on at the end, not a step that
      stopped; counts: by at least one in each half), with a slope above ``measure.per_hour``;
    * ``STEP``: the floor rose by more than the noise, but not in both halves;
    * ``flat``: otherwise (also a steep slope whose floor rose within the noise: ``note``);
    * ``too few samples``: fewer than three after the warm-up.

    ``resolution_per_hour``: the least slope that can lift the floor past the noise in this
    window (the noise over the window's length); a slower leak needs a longer run."""
    points = sorted(points)
    if not points:
        return {"verdict": "no samples", "samples": 0}
    before = [p for p in points if p[0] <= warmup_s]
    start = before[-1] if before else points[0]
    window = [p for p in points if p[0] >= start[0]]
    out: dict[str, Any] = {"warm": start[1], "end": points[-1][1], "samples": len(window),
                           "peak": max(v for _, v in points)}
    span_h = (window[-1][0] - window[0][0]) / 3600.0
    out["slope_per_hour"] = slope(window) * 3600.0
    out["resolution_per_hour"] = measure.noise / span_h if span_h > 0 and measure.noise > 0 else 0.0
    if len(window) < 3:
        out.update(verdict="too few samples", rise=0.0)
        return out
    low = floors([v for _, v in window])
    mid = len(low) // 2
    rise, first, second = low[-1] - low[0], low[mid] - low[0], low[-1] - low[mid]
    out["rise"] = rise
    if (rise > measure.noise and first > measure.noise / 2 and second > measure.noise / 2
            and out["slope_per_hour"] > measure.per_hour):
        out["verdict"] = "GROWS"
    elif rise > measure.noise:
        out["verdict"] = "STEP"
    else:
        out["verdict"] = "flat"
        if out["slope_per_hour"] > measure.per_hour and measure.per_hour > 0:
            out["note"] = (f"slope above {measure.per_hour:g}/h but the floor rose {rise:.2f} "
                           f"(noise {measure.noise:g})")
    return out


def verdict_line(measure: Measure, assessed: dict[str, dict[str, Any]]) -> str:
    """One line per measure over every process (``assessed``: process label -> ``assess``)."""
    unit = f" {measure.unit}" if measure.unit else ""
    by = {label: a for label, a in assessed.items() if "slope_per_hour" in a}
    if not by:
        return f"{measure.label}: no samples"
    grows = [label for label, a in by.items() if a["verdict"] == "GROWS"]
    steps = [label for label, a in by.items() if a["verdict"] == "STEP"]
    worst = max(by, key=lambda label: by[label]["slope_per_hour"])
    w = by[worst]
    tail = (f"steepest {worst}: {w['warm']:g} -> {w['end']:g}{unit}, {w['slope_per_hour']:+.2f}{unit}/h"
            + (f" (this run resolves >= {w['resolution_per_hour']:.1f}{unit}/h)" if w["resolution_per_hour"] else ""))
    if grows:
        return f"{measure.label}: GROWS in {', '.join(grows)}; {tail}"
    if steps:
        return (f"{measure.label}: STEP (rose once and held) in {', '.join(steps)}: "
                + ", ".join(f"{by[s]['warm']:g} -> {by[s]['end']:g}" for s in steps) + f"; {tail}")
    if any(a["verdict"] == "too few samples" for a in by.values()):
        return f"{measure.label}: too few samples after the warm-up to tell; {tail}"
    return f"{measure.label}: flat in every process; {tail}"


# -- faults (``--faults``): the schedule, which samples the verdicts use, and the recovery ----------

#: What ``--faults`` cuts, one after the other (those the run has: SQLite has no server to cut).
FAULT_TARGETS = ("database", "RabbitMQ", "Redis")
#: A sample taken this little before a cut is left out of the verdicts too: a sample and a cut
#: due at the same moment race.
FAULT_GUARD_S = 1.0


@dataclass(frozen=True)
class Fault:
    """One cut of ``target`` at ``at`` seconds on the sampler's clock, for ``seconds``."""

    target: str
    at: float
    seconds: float

    @property
    def end(self) -> float:
        return self.at + self.seconds


def fault_schedule(targets: Sequence[str], start: float, every: float, seconds: float, settle_s: float,
                   duration: float) -> list[Fault]:
    """A cut every ``every`` seconds from ``start`` on, of each of ``targets`` in turn, as long as
    the cut and the ``settle_s`` after it end by ``duration`` (so the last settled sample, and
    the end of the run's delivery, come after every cut)."""
    out: list[Fault] = []
    while targets and start + len(out) * every + seconds + settle_s <= duration + 1e-9:
        out.append(Fault(targets[len(out) % len(targets)], start + len(out) * every, seconds))
    return out


def settled(samples: Sequence[dict[str, Any]], faults: Sequence[Fault], settle_s: float) -> list[dict[str, Any]]:
    """The samples taken neither during a cut (from ``FAULT_GUARD_S`` before it) nor within
    ``settle_s`` after its end: the relay's steady state, all its connections made again. The
    verdicts compare these only (like with like: a sample taken while a connection is down, or
    while its replacement is being made, would move the floor and make a STEP of nothing)."""
    return [s for s in samples
            if not any(f.at - FAULT_GUARD_S <= s["t"] < f.end + settle_s for f in faults)]


def commit_arrivals(events: Sequence[dict[str, Any]]) -> list[tuple[float, float | None]]:
    """``(commit, first arrival or None)`` of each of ``run_live``'s events, in seconds (on the
    clock of their ``at_s``: ``main`` puts them on the sampler's, the faults')."""
    return [(e["at_s"], e["at_s"] + e["ms"] / 1000.0 if e["ms"] is not None else None) for e in events]


def longest_gap(arrivals: Sequence[float], lo: float, hi: float) -> float:
    """The longest stretch of ``[lo, hi]`` with no arrival (``arrivals`` sorted)."""
    edges = [lo, *(a for a in arrivals if lo <= a <= hi), hi]
    return max(b - a for a, b in zip(edges, edges[1:]))


def missing_by_aggregate(events: Sequence[dict[str, Any]], top: int = 10) -> list[dict[str, Any]]:
    """The aggregates with events that never arrived, most first: how many, and when the first
    of them was committed (``at_s``). A few aggregates with many: their chains stood still
    (a lease held, a chain stuck); many with one or two each: the relay was behind everywhere."""
    by: dict[str, list[float]] = {}
    for e in events:
        if e["ms"] is None:
            by.setdefault(e["aggregate"], []).append(e["at_s"])
    ranked = sorted(by.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    return [{"aggregate": a, "missing": len(ts), "first_at": round(min(ts), 2)} for a, ts in ranked[:top]] + (
        [{"aggregate": f"{len(ranked) - top} more", "missing": sum(len(ts) for _, ts in ranked[top:]),
          "first_at": round(min(min(ts) for _, ts in ranked[top:]), 2)}] if len(ranked) > top else [])


def recovery(commits: Sequence[tuple[float, float | None]], faults: Sequence[Fault], end: float) -> list[dict[str, Any]]:
    """Per fault, from ``commit_arrivals``' pairs: the events that arrived during the cut;
    the first arrival after its end and when every event committed before its end (since the
    previous cut's end) had arrived (``caught_up_s``, seconds after the end; None: some never
    did); the longest gap in arrivals from its end to the next cut (or ``end``, the writers' last
    commit); the events committed from the cut on (to the next) that never arrived;
    ``resumed``: an arrival after the end, before the next cut; ``caught_up``: every event
    committed before the end arrived, before the next cut, and none from the cut on is missing."""
    arrivals = sorted(a for _, a in commits if a is not None)
    out = []
    for k, f in enumerate(faults):
        nxt = faults[k + 1].at if k + 1 < len(faults) else math.inf
        until = min(nxt, max(end, f.end))
        first = next((a for a in arrivals if a >= f.end), None)
        since = faults[k - 1].end if k else -math.inf  # what an earlier cut lost is that cut's
        before = [a for c, a in commits if since <= c < f.end]
        caught_up = (max(0.0, max(a for a in before if a is not None) - f.end)
                     if before and None not in before else None)
        missing = sum(1 for c, a in commits if a is None and f.at <= c < nxt)
        out.append({"target": f.target, "at": round(f.at, 2), "seconds": f.seconds,
                    "arrived_during": sum(1 for a in arrivals if f.at <= a < f.end),
                    "first_after_s": None if first is None else round(first - f.end, 3),
                    "caught_up_s": None if caught_up is None else round(caught_up, 3),
                    "longest_gap_s": round(longest_gap(arrivals, f.end, until), 3), "missing": missing,
                    "resumed": first is not None and first < until,
                    "caught_up": caught_up is not None and f.end + caught_up < until and missing == 0})
    return out


# -- sampling ------------------------------------------------------------------------------------

def service_ports(run: Run) -> dict[str, int]:
    """The port of each server the relay talks to, by measure key (``db`` only for a database
    server), from ``run``'s URLs: with ``--faults``, the relay's run names the proxy's ports, so
    a connection to one of them counts for the server behind it."""
    from urllib.parse import urlsplit

    out = {"amqp": urlsplit(run.amqp_url).port or 5672, "redis": urlsplit(run.redis_url).port or 6379}
    if run.engine in ("postgresql", "mysql"):
        out["db"] = urlsplit(run.database_url).port or {"postgresql": 5432, "mysql": 3306}[run.engine]
    return out


def by_peer(conns: Sequence[tuple[int, int]], ports: dict[str, int]) -> dict[str, int]:
    """How many of ``conns`` (local port, remote port) go to each of ``ports`` (measure key ->
    port; a measure with no port, SQLite's ``db``, counts 0)."""
    return {key: sum(1 for _, remote in conns if remote == ports[key]) if key in ports else 0
            for key in ("db", "amqp", "redis")}


class ProcessNames:
    """Stable labels for the relay's processes: ``worker`` (the root), ``child 1..n`` in the order
    first seen (pid order within a sample), ``beat``. A child that ends and is replaced gets the
    next number, so its series does not continue its predecessor's."""

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        #: label -> the process's command line as first seen (what a ``child`` is).
        self.commands: dict[str, str] = {}
        self.children = 0

    def label(self, pid: int, root: int, group: str) -> str:
        if pid not in self.labels:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "?"
            if pid == root:
                self.labels[pid] = group
            else:
                self.children += 1
                self.labels[pid] = f"{group} child {self.children}" if group != "worker" else f"child {self.children}"
            self.commands[self.labels[pid]] = command.strip()
        return self.labels[pid]


class SoakSampler(threading.Thread):
    """Samples every relay process at ``t0 + k * interval`` until ``duration`` (``samples``:
    one dict per sample: ``t``, ``procs`` (label -> measures), ``sessions``)."""

    def __init__(self, run: Run, relay: Any, interval: float, duration: float, app_name: str,
                 snapshots: dict[float, Path] | None = None, relay_run: Run | None = None,
                 proxy_pid: int | None = None) -> None:
        super().__init__(name="bench-soak-sampler", daemon=True)
        self.run_, self.relay, self.interval, self.duration = run, relay, interval, duration
        self.app_name = app_name
        #: ``--heap``: at the first sample at or after each time, touch the file (the hook's trigger).
        self.snapshots = dict(snapshots or {})
        self.names = ProcessNames()
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.halt = threading.Event()
        #: The ports the relay's connections go to, by measure (``--faults``: the proxy's, from
        #: the relay's own ``relay_run``); the database's own port (the proxy's connections to it).
        self.ports = service_ports(relay_run or run)
        self.db_port = service_ports(run).get("db")
        #: ``--faults``: the proxy's process, whose connections to the database are the relay's.
        self.proxy_pid = proxy_pid
        self.sqlite_file = run.database_url.split("///", 1)[1] if run.engine == "sqlite" else None
        self.t0 = time.monotonic()
        self.t0_epoch = time.time()

    def roots(self) -> list[tuple[str, int]]:
        out = [("worker", self.relay.worker.pid)]
        if self.relay.beat is not None:
            out.append(("beat", self.relay.beat.pid))
        return out

    def sample_once(self, conn: Any) -> dict[str, Any]:
        sockets = tcp_sockets()
        procs: dict[str, dict[str, Any]] = {}
        relay_ports: set[int] = set()
        for group, root in self.roots():
            for pid in sorted(process_tree(root)):
                files = open_files(pid)
                rss, threads, kinds = rss_kb(pid), rss_kb(pid, "Threads"), rss_by_mapping(pid)
                if files is None or rss is None or threads is None or kinds is None:
                    continue  # ended between the listing and the read
                conns = peers(files, sockets)
                relay_ports.update(local for local, _ in conns)
                counts = by_peer(conns, self.ports)
                if self.sqlite_file is not None:
                    counts["db"] = sum(1 for f in files if f.startswith(self.sqlite_file))
                procs[self.names.label(pid, root, group)] = {
                    "pid": pid, "rss_mb": round(rss / 1024, 2), "threads": threads, "fds": len(files), **counts,
                    **{f"rss_{kind}_mb": round(kb / 1024, 2) for kind, kb in kinds.items()}}
        relay_ports.update(self.proxied_ports(sockets))
        return {"t": round(time.monotonic() - self.t0, 2), "procs": procs,
                "sessions": self.sessions(conn, relay_ports)}

    def proxied_ports(self, sockets: dict[int, tuple[int, int, int]]) -> set[int]:
        """``--faults``: the local ports of the proxy's connections to the database, which the
        database sees as the relay's (MariaDB's PROCESSLIST names the client's port)."""
        files = open_files(self.proxy_pid) if self.proxy_pid is not None else None
        return {local for local, remote in peers(files or [], sockets) if remote == self.db_port}

    def sessions(self, conn: Any, relay_ports: set[int]) -> int | None:
        """The database's count of the relay's sessions (None: SQLite, or the read failed)."""
        if conn is None:
            return None
        try:
            if self.run_.engine == "postgresql":
                rows = query(conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                             (self.app_name,))
                conn.commit()
                return int(rows[0][0])
            rows = query(conn, "SELECT HOST FROM information_schema.PROCESSLIST")
            conn.commit()
            ports = {int(h.rsplit(":", 1)[1]) for (h,) in rows if h and ":" in h}
            return len(ports & relay_ports)
        except Exception as exc:  # noqa: BLE001 - a lost sample is no failure; reported at the end
            self.errors.append(repr(exc))
            with contextlib.suppress(Exception):
                conn.rollback()
            return None

    def run(self) -> None:
        conn = connect(self.run_) if self.run_.engine in ("postgresql", "mysql") else None
        try:
            k = 0
            while not self.halt.is_set() and k * self.interval <= self.duration + 1e-6:
                delay = self.t0 + k * self.interval - time.monotonic()
                if delay > 0 and self.halt.wait(delay):
                    break
                try:
                    self.samples.append(self.sample_once(conn))
                except Exception as exc:  # noqa: BLE001 - the sampler must outlive one bad read
                    self.errors.append(repr(exc))
                for at in [at for at in self.snapshots if at <= k * self.interval + 1e-6]:
                    self.snapshots.pop(at).touch()
                k += 1
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


class FaultInjector(threading.Thread):
    """``--faults``: makes ``schedule``'s cuts through the proxy process at their times on the
    sampler's clock (``t0``, ``time.monotonic()``); ``urls``: each target's original URL, which
    names its proxy. ``made``: each cut as made (its actual time, the live connections it reset)."""

    def __init__(self, proxies: Any, urls: dict[str, str], schedule: Sequence[Fault], t0: float) -> None:
        super().__init__(name="bench-soak-faults", daemon=True)
        self.proxies, self.urls, self.schedule, self.t0 = proxies, urls, list(schedule), t0
        self.made: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        for number, fault in enumerate(self.schedule, 1):
            if self.halt.wait(max(0.0, self.t0 + fault.at - time.monotonic())):
                return
            at = time.monotonic() - self.t0
            try:
                reset = self.proxies.cut(self.urls[fault.target], fault.seconds)
            except Exception as exc:  # noqa: BLE001 - one failed cut must not end the others; reported
                self.errors.append(f"{fault.target} at {at:.1f} s: {exc!r}")
                continue
            self.made.append({"target": fault.target, "at": round(at, 2), "seconds": fault.seconds,
                              "reset": reset, "clock": time.strftime("%H:%M:%S")})
            log(f"fault {number}/{len(self.schedule)}: {fault.target} cut at {at:.1f} s into the run: {reset} live "
                f"connections reset, new ones refused for {fault.seconds:g} s (until {at + fault.seconds:.1f} s)")

    def faults(self) -> list[Fault]:
        return [Fault(m["target"], m["at"], m["seconds"]) for m in self.made]

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)


def proxied(run: Run, proxies: Any) -> Run:
    """``run`` as the relay sees it with ``--faults``: its database, RabbitMQ and Redis URLs
    through ``proxies`` (``bench.latency.ProxyProcess``), every name of the run the same."""
    changes = {"amqp_url": proxies.url(run.amqp_url), "redis_url": proxies.url(run.redis_url)}
    field = {"postgresql": "postgres_url", "mysql": "mysql_url"}.get(run.engine)
    if field is not None:
        changes[field] = proxies.url(run.database_url)
    return dataclasses.replace(run, **changes)


def wake_env(relay_run: Run, runner: str) -> dict[str, str]:
    """The settings this process wakes the relay with: the relay's own (``relay_run``: with
    ``--faults``, its URLs through the proxy), so the writers' namespace, claim token and wake
    channel are the ones the relay's workers listen on."""
    from .dramatiq_drain import dramatiq_env

    return relay_run.outbox_env(**(dramatiq_env(relay_run) if runner == "dramatiq" else {}))


def fault_urls(run: Run) -> dict[str, str]:
    """The original URL of each of ``FAULT_TARGETS`` the run has (``run``: the bench's own)."""
    urls = {"database": run.database_url, "RabbitMQ": run.amqp_url, "Redis": run.redis_url}
    return {name: urls[name] for name in FAULT_TARGETS if name != "database" or run.engine != "sqlite"}


def series(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """process label -> measure key -> [(t, value)], from ``SoakSampler.samples``; the database's
    sessions under the label ``database``."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for s in samples:
        for label, values in s["procs"].items():
            per = out.setdefault(label, {})
            for m in MEASURES:
                per.setdefault(m.key, []).append((s["t"], float(values[m.key])))
        if s.get("sessions") is not None:
            out.setdefault("database", {}).setdefault(SESSIONS.key, []).append((s["t"], float(s["sessions"])))
    return out


def analyse(samples: Sequence[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, dict[str, Any]]]:
    """measure key -> process label -> ``assess``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label, per in series(samples).items():
        for m in (*MEASURES, SESSIONS):
            if m.key in per:
                out.setdefault(m.key, {})[label] = assess(per[m.key], warmup_s, m)
    return out


def table(analysis: dict[str, dict[str, dict[str, Any]]], pids: dict[str, int]) -> str:
    """The per-process table: warm-up end, end, slope per hour, verdict."""
    lines = [f"{'process':16s} {'measure':31s} {'warm-up end':>11s} {'end':>9s} {'peak':>9s} {'slope/h':>9s}  verdict"]
    for m in (*MEASURES, SESSIONS):
        for label, a in analysis.get(m.key, {}).items():
            if "slope_per_hour" not in a:
                continue
            name = f"{label} ({pids[label]})" if label in pids else label
            lines.append(f"{name:16s} {m.label + (f' ({m.unit})' if m.unit else ''):31s} {a['warm']:11g} "
                         f"{a['end']:9g} {a['peak']:9g} {a['slope_per_hour']:+9.2f}  {a['verdict']}"
                         + (f" ({a['note']})" if a.get("note") else ""))
    return "\n".join(lines)


def rss_split(samples: Sequence[dict[str, Any]], label: str, warmup_s: float) -> str:
    """Where a process's RSS went from the end of the warm-up to the end, by kind of mapping
    (``bench.procs.rss_by_mapping``): CPython's and glibc's heaps are told apart this way."""
    mine = [s for s in samples if label in s["procs"]]
    if not mine:
        return "no samples"
    warm = [s for s in mine if s["t"] <= warmup_s]
    start = warm[-1] if warm else mine[0]
    a, b = start["procs"][label], mine[-1]["procs"][label]
    names = {"heap": "brk heap", "arenas": "malloc's thread arenas", "anon": "other anonymous (CPython's arenas...)",
             "file": "files"}
    return "RSS from the end of the warm-up to the end by mapping: " + ", ".join(
        f"{names[k]} {a.get(f'rss_{k}_mb', 0):g} -> {b.get(f'rss_{k}_mb', 0):g} MB" for k in names)


def lag_windows(events: Sequence[dict[str, Any]], duration: float, warmup_share: float) -> dict[str, Any]:
    """Commit-to-arrival p50/p99 in the warm-up and in the last fifth of the run, from
    ``run_live``'s events: a worker that slows down as it ages shows here first."""
    def window(lo: float, hi: float) -> dict[str, Any]:
        ms = [e["ms"] for e in events if e["ms"] is not None and lo <= e["at_s"] < hi]
        return {"events": len(ms), "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99)}

    return {"warmup": window(0.0, warmup_share * duration), "last_fifth": window(0.8 * duration, math.inf)}


# -- where memory grows: the heap of the relay's processes (``--heap``, ``--tracemalloc``) ------------

#: A ``sitecustomize`` that the bench puts first on the relay's ``PYTHONPATH`` with ``--heap`` or
#: ``--tracemalloc`` (nothing in src/ changes). In every process (pool children too, after their
#: fork) a thread waits for a file ``take-<name>`` in the directory (the sampler makes one at the
#: end of the warm-up and one at the end) and then writes ``<pid>-<name>.json``: CPython's own
#: allocator statistics (``sys._debugmallocstats``: arenas, bytes in allocated blocks), the count
#: of allocated blocks, and the gc-tracked objects counted by type; with tracemalloc on
#: (``OUTBOX_SOAK_TRACEMALLOC_FRAMES`` > 0) also a snapshot ``<pid>-<name>.snap``. The thread adds
#: one to each process's thread count; tracemalloc slows every allocation (the relay may fall behind).
HEAP_HOOK = """\
import collections
import gc
import json
import os
import sys
import tempfile
import threading
import time
import tracemalloc

_DIR = os.environ.get("OUTBOX_SOAK_HOOK_DIR")
_FRAMES = int(os.environ.get("OUTBOX_SOAK_TRACEMALLOC_FRAMES", "0"))


def _mallocstats():
    with tempfile.TemporaryFile() as f:  # _debugmallocstats writes to the C stderr
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def _take(name):
    base = os.path.join(_DIR, f"{os.getpid()}-{name}")
    gc.collect()
    types = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    stats = {"allocated_blocks": sys.getallocatedblocks(), "gc_objects": sum(types.values()),
             "types": dict(types.most_common(300)), "mallocstats": _mallocstats()}
    with open(base + ".json", "w") as f:
        json.dump(stats, f)
    if _FRAMES:
        tracemalloc.take_snapshot().dump(base + ".snap")


def _watch():
    done = set()
    while True:
        time.sleep(0.5)
        try:
            names = [n[5:] for n in os.listdir(_DIR) if n.startswith("take-")]
        except OSError:
            continue
        for name in names:
            if name not in done:
                done.add(name)
                _take(name)


def _start():
    threading.Thread(target=_watch, name="soak-heap", daemon=True).start()


if _DIR:
    if _FRAMES:
        tracemalloc.start(_FRAMES)
    _start()
    os.register_at_fork(after_in_child=_start)
"""


def hook_env(workdir: Path, frames: int) -> dict[str, str]:
    """Write the hook into ``workdir`` and return the relay's environment that loads it
    (``frames`` > 0: tracemalloc on, keeping that many frames per allocation)."""
    hook, snaps = workdir / "soak-hook", workdir / "heap"
    hook.mkdir()
    snaps.mkdir()
    (hook / "sitecustomize.py").write_text(HEAP_HOOK)
    # The hook first, then what ``Run.child_env`` gives the relay (bench/'s root, this PYTHONPATH).
    path = os.pathsep.join([str(hook), str(Path(__file__).resolve().parent.parent),
                            *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": path, "OUTBOX_SOAK_HOOK_DIR": str(snaps), "OUTBOX_SOAK_TRACEMALLOC_FRAMES": str(frames)}


def mallocstats(text: str) -> dict[str, int]:
    """The ``# name = number`` lines of ``sys._debugmallocstats()``'s report."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# ") and "=" in line:
            name, _, value = line[2:].partition("=")
            with contextlib.suppress(ValueError):
                out[name.strip()] = int(value.strip().replace(",", ""))
    return out


def compare_heaps(snaps: Path, labels: dict[int, str], first: str = "warm", last: str = "end",
                  top: int = 8) -> dict[str, Any]:
    """Per process, from the hook's two reports: CPython's arenas and bytes in allocated blocks,
    the allocated blocks and gc-tracked objects at both times, and the ``top`` types whose count
    grew most."""
    import json

    out: dict[str, Any] = {}
    for pid, label in sorted(labels.items()):
        a, b = snaps / f"{pid}-{first}.json", snaps / f"{pid}-{last}.json"
        if not (a.exists() and b.exists()):
            continue
        before, after = json.loads(a.read_text()), json.loads(b.read_text())
        m0, m1 = mallocstats(before["mallocstats"]), mallocstats(after["mallocstats"])
        keys = ("arenas allocated current", "arenas highwater mark", "bytes in allocated blocks",
                "bytes in available blocks", "bytes lost to pool headers", "bytes lost to quantization")
        grew = sorted(((after["types"].get(t, 0) - before["types"].get(t, 0), t)
                       for t in set(before["types"]) | set(after["types"])), reverse=True)[:top]
        out[label] = {"allocated_blocks": [before["allocated_blocks"], after["allocated_blocks"]],
                      "gc_objects": [before["gc_objects"], after["gc_objects"]],
                      "pymalloc": {k: [m0.get(k), m1.get(k)] for k in keys},
                      "types_grew": [{"type": t, "count_diff": d, "count": after["types"].get(t, 0)}
                                     for d, t in grew if d > 0]}
    return out


def compare_snapshots(snaps: Path, labels: dict[int, str], first: str = "warm", last: str = "end",
                      top: int = 8, frames: int = 8) -> dict[str, Any]:
    """Per process: the traced Python memory in both snapshots and the ``top`` tracebacks whose
    memory grew most between them (their ``frames`` innermost frames)."""
    import tracemalloc

    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
              tracemalloc.Filter(False, "<unknown>")]
    out: dict[str, Any] = {}
    for pid, label in sorted(labels.items()):
        a, b = snaps / f"{pid}-{first}.snap", snaps / f"{pid}-{last}.snap"
        if not (a.exists() and b.exists()):
            continue
        before = tracemalloc.Snapshot.load(str(a)).filter_traces(ignore)
        after = tracemalloc.Snapshot.load(str(b)).filter_traces(ignore)
        growth = after.compare_to(before, "traceback")[:top]
        out[label] = {
            "traced_mb": [round(sum(s.size for s in snap.statistics("filename")) / 2**20, 2) for snap in (before, after)],
            "top": [{"size_diff_kb": round(g.size_diff / 1024, 1), "count_diff": g.count_diff,
                     "size_kb": round(g.size / 1024, 1), "count": g.count,
                     "traceback": [f"{f.filename}:{f.lineno}" for f in list(g.traceback)[-frames:]]}
                    for g in growth]}
    return out


# -- the run ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, help="how long the writers write (default 10; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="a 2-minute run, sampled every 5 s")
    p.add_argument("--rate", type=float, default=200.0, help="events/s the writers commit (default 200)")
    p.add_argument("--aggregates", type=int, default=100)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--engine", default="postgresql", help="postgresql (default), mysql or sqlite")
    p.add_argument("--runner", choices=("celery", "dramatiq"), default="celery")
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads per Dramatiq worker process (default 2)")
    p.add_argument("--sample-s", type=float, help="seconds between samples (default 15; 5 with --quick)")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run that is warm-up (default 0.2)")
    p.add_argument("--loglevel", default="WARNING", help="the worker's log level")
    p.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment of the relay's processes (repeatable)")
    p.add_argument("--heap", action="store_true",
                   help="investigate: every relay process reports its Python heap (CPython's allocator statistics, "
                        "gc-tracked objects by type) at the end of the warm-up and at the end, through a sitecustomize "
                        "hook on its PYTHONPATH (bench only); what grew is printed. Cheap")
    p.add_argument("--tracemalloc", action="store_true",
                   help="--heap, and every relay process traces its Python allocations: the tracebacks whose memory "
                        "grew most are printed; slows the relay (it may fall behind)")
    p.add_argument("--tracemalloc-frames", type=int, default=25, help="frames kept per allocation (default 25)")
    p.add_argument("--faults", action="store_true",
                   help="route the relay's database, RabbitMQ and Redis connections through a proxy (bench.latency, "
                        "no added delay) and cut them in turn from the end of the warm-up on")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between two cuts (default 60)")
    p.add_argument("--fault-s", type=float, default=5.0,
                   help="how long a cut lasts: live connections reset, new ones refused (default 5)")
    p.add_argument("--fault-targets", default=",".join(FAULT_TARGETS),
                   help="what the cuts cut, in turn, comma-separated (default: database,RabbitMQ,Redis)")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="samples within this long after a cut's end are left out of the verdicts (default 10)")
    p.add_argument("--json", type=Path, help="also write every sample and figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs)")
    args = p.parse_args(argv)
    args.minutes = args.minutes or (2.0 if args.quick else 10.0)
    args.sample_s = args.sample_s or (5.0 if args.quick else 15.0)
    try:
        (args.engine,) = engine_names(args.engine)
    except ValueError as exc:
        p.error(str(exc))
    if args.aggregates % args.writers:
        p.error("--aggregates must be a multiple of --writers")
    args.fault_targets = [t.strip() for t in args.fault_targets.split(",") if t.strip()]
    if not set(args.fault_targets) <= set(FAULT_TARGETS) or not args.fault_targets:
        p.error(f"--fault-targets: some of {', '.join(FAULT_TARGETS)}")
    if args.faults and args.engine == "sqlite" and "database" in args.fault_targets:
        args.fault_targets.remove("database")  # SQLite: no server to cut
    if args.faults and args.fault_s + args.settle_s + FAULT_GUARD_S >= args.fault_every:
        p.error("--fault-every must leave room for a settled sample: more than --fault-s + --settle-s + "
                f"{FAULT_GUARD_S:g} s")
    return args


def main(argv: list[str] | None = None) -> int:
    from . import drain, live
    from .dramatiq_drain import DramatiqRelay

    args = parse_args(argv)
    require_services([args.engine])
    duration = args.minutes * 60.0
    warmup_s = args.warmup * duration
    workdir = Path(tempfile.mkdtemp(prefix="outbox-soak-"))
    run = Run(engine=args.engine, workdir=workdir)
    app_name = f"outbox-soak-{run.tag}"
    env = dict(item.split("=", 1) for item in args.worker_env)
    env.setdefault("PGAPPNAME", app_name)
    snapshots: dict[float, Path] = {}
    args.heap = args.heap or args.tracemalloc
    if args.heap:
        env.update(hook_env(workdir, args.tracemalloc_frames if args.tracemalloc else 0))
        snaps = Path(env["OUTBOX_SOAK_HOOK_DIR"])
        snapshots = {warmup_s: snaps / "take-warm", duration: snaps / "take-end"}
    # This process wakes the relay: it must see the worker's settings (and its runner).
    for key in [k for k in os.environ if k.startswith(("OUTBOX_", "CELERY_"))]:
        del os.environ[key]
    os.environ.update(wake_env(run, args.runner))
    from outbox.core.config import reset_settings

    reset_settings()
    log(f"soak {run.tag}: {args.runner} on {args.engine}, {args.rate:g} ev/s over {args.aggregates} aggregates "
        f"for {args.minutes:g} min, a sample every {args.sample_s:g} s, warm-up {warmup_s:.0f} s; work dir {workdir}")
    flush_redis(run.redis_url)
    results: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "run": run.tag, "machine": machine_facts(run)}
    create_table(run)
    destination = Destination(run)
    relay: Any = None
    sampler: SoakSampler | None = None
    injector: FaultInjector | None = None
    proxies: Any = None
    relay_run = run  # the relay's URLs; with --faults, through the proxy (the bench's own stay direct)
    try:
        if args.faults:
            from .latency import ProxyProcess

            urls = fault_urls(run)
            proxies = ProxyProcess(0.0, list(urls.values()))
            relay_run = proxied(run, proxies)
            # The writers wake the relay as a web process would: through its broker, in its
            # namespace (both named by the proxied URLs); their own writes stay direct. Before,
            # they woke a namespace and a wake channel no worker listened on, so no --faults run
            # tested wake-ups through the cuts (found in a soak run, 6 December).
            os.environ.update(wake_env(relay_run, args.runner))
            reset_settings()
            log("faults: the relay's " + ", ".join(f"{name} via {proxies.url(url)}" for name, url in urls.items())
                + f" (proxy pid {proxies.pid}); a {args.fault_s:g} s cut every {args.fault_every:g} s from "
                f"{warmup_s:.0f} s on")
        if args.runner == "celery":
            relay = drain.Relay(relay_run, concurrency=args.concurrency, loglevel=args.loglevel, **env)
        else:
            relay = DramatiqRelay(relay_run, args.concurrency, args.threads, args.loglevel, **env)
        relay.wait_ready(args.concurrency)
        sampler = SoakSampler(run, relay, args.sample_s, duration, app_name, snapshots, relay_run=relay_run,
                              proxy_pid=proxies.pid if proxies is not None else None)
        if proxies is not None:
            schedule = fault_schedule(args.fault_targets, warmup_s, args.fault_every, args.fault_s, args.settle_s,
                                      duration)
            injector = FaultInjector(proxies, urls, schedule, sampler.t0)
            injector.start()
        sampler.start()
        results["live"] = live.run_live(run, destination, "wake", args.rate, duration, args.aggregates, args.writers,
                                        cpu_groups=drain.cpu_groups(relay), alive=relay.check_alive,
                                        keep_events=True)
        sampler.stop()
        relay.check_alive()
        if args.heap:
            time.sleep(15)  # the hook reports within 0.5 s of the trigger; a tracemalloc dump takes seconds
    finally:
        if injector is not None:
            injector.stop()
        if sampler is not None:
            sampler.stop()
        if relay is not None:
            results["worker_log_tail"] = relay.log_tail(chars=2000)
            relay.stop()
        if proxies is not None:
            proxies.close()
        destination.close()
        with contextlib.suppress(Exception):
            drop_table(run)
        with contextlib.suppress(Exception):
            flush_redis(run.redis_url)
    assert sampler is not None
    events, repeats = results["live"].pop("events"), results["live"].pop("repeats")
    if injector is not None:  # on the faults' clock: the warm-up's window ends where the first cut begins
        offset = results["live"]["t0_epoch"] - sampler.t0_epoch
        events = [{**e, "at_s": e["at_s"] + offset} for e in events]
        repeats = [{**r, "first_s": r["first_s"] + offset, "again_s": r["again_s"] + offset} for r in repeats]
    results["lag"] = lag_windows(events, duration, args.warmup)
    results["samples"] = sampler.samples
    results["processes"] = sampler.names.commands
    results["sampler_errors"] = sampler.errors[:10]
    verdict_samples = sampler.samples
    if injector is not None:
        faults = injector.faults()
        verdict_samples = settled(sampler.samples, faults, args.settle_s)
        results["faults"] = fault_results(injector, faults, verdict_samples, events, repeats)
    analysis = analyse(verdict_samples, warmup_s)
    results["analysis"] = analysis
    pids = {label: v["pid"] for s in sampler.samples for label, v in s["procs"].items()}
    if args.heap:
        results["heap"] = compare_heaps(workdir / "heap", {pid: label for label, pid in pids.items()})
    if args.tracemalloc:
        results["tracemalloc"] = compare_snapshots(workdir / "heap", {pid: label for label, pid in pids.items()})
    report(results, analysis, pids, args, warmup_s)
    if args.json:
        args.json.write_text(to_json(results))
        log(f"wrote {args.json}")
    if args.keep:
        log(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def fault_results(injector: FaultInjector, faults: Sequence[Fault], verdict_samples: Sequence[dict[str, Any]],
                  events: Sequence[dict[str, Any]], repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``--faults``' figures: the cuts made, the samples the verdicts kept, each cut's recovery
    (``recovery``; ``events`` and ``repeats`` on the faults' clock, each cut's duplicates by
    ``duplicates_by_cut``), and for comparison the longest gap in arrivals before the first
    cut, from the tenth second on (the relay's start is no cut's)."""
    commits = commit_arrivals(events)
    arrivals = sorted(a for _, a in commits if a is not None)
    end = max((c for c, _ in commits), default=0.0)
    first = faults[0].at if faults else end
    before, by_cut = duplicates_by_cut(repeats, faults)
    rec = [{**r, "duplicates": n} for r, n in zip(recovery(commits, faults, end), by_cut)]
    return {"made": injector.made, "errors": injector.errors, "settled_samples": len(verdict_samples),
            "recovery": rec, "duplicates_before_faults": before, "missing_by_aggregate": missing_by_aggregate(events),
            "gap_before_faults_s": round(longest_gap(arrivals, 10.0, first), 3) if first > 10 else None}


def duplicates_by_cut(repeats: Sequence[dict[str, Any]], faults: Sequence[Fault]) -> tuple[int, list[int]]:
    """Each repeated arrival charged to the last cut that began before it came again (those
    before the first cut are counted apart): which kind of cut sends events twice."""
    starts = [f.at for f in faults]
    counts = [0] * len(faults)
    before = 0
    for r in repeats:
        k = bisect.bisect_right(starts, r["again_s"]) - 1
        if k < 0:
            before += 1
        else:
            counts[k] += 1
    return before, counts


def report(results: dict[str, Any], analysis: dict[str, dict[str, dict[str, Any]]], pids: dict[str, int],
           args: argparse.Namespace, warmup_s: float) -> None:
    r, lag = results["live"], results["lag"]
    order = r["order"]
    cores = r["cpu"]["cores_used"]
    print(f"\nsoak: {args.runner} on {args.engine}, {args.minutes:g} min at {args.rate:g} ev/s, "
          f"{len(results['samples'])} samples every {args.sample_s:g} s; warm-up = first {warmup_s:.0f} s; "
          f"slopes over the rest" + (f"; verdicts over the {results['faults']['settled_samples']} samples taken "
                                     f"settled (none during a cut or within {args.settle_s:g} s after it)"
                                     if "faults" in results else ""))
    for label, command in results["processes"].items():
        print(f"  {label} ({pids.get(label)}): {command[:110]}")
    print(table(analysis, pids))
    for label, a in analysis.get("rss_mb", {}).items():
        if a.get("verdict") in ("GROWS", "STEP"):
            print(f"  {label}: {rss_split(results['samples'], label, warmup_s)}")
    print()
    for m in (*MEASURES, SESSIONS):
        if m.key in analysis:
            print(verdict_line(m, analysis[m.key]))
    print(f"throughput: {r['committed']} committed at {r['achieved_rate']:.1f}/s ({r['late_commits']} late), "
          f"{r['arrived']} arrived; worker {cores.get('worker', 0):.2f} cores, beat {cores.get('beat', 0):.2f}, "
          f"machine busy {100 * r['cpu']['machine_busy']:.0f}%")
    print(f"commit-to-arrival: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.0f} ms; "
          f"p99 in the warm-up {lag['warmup']['p99_ms']:.1f} ms, in the last fifth {lag['last_fifth']['p99_ms']:.1f} ms")
    print(f"order ok={order['ok']}, duplicates {order['duplicates']}, missing {order['missing']}, "
          f"out of order in {order['violating_aggregates']} aggregates")
    if "faults" in results:
        print("\n".join(fault_lines(results["faults"], r, len(results["samples"]), args)))
    if results["sampler_errors"]:
        print(f"sampler errors: {results['sampler_errors']}")
    for label, heap in results.get("heap", {}).items():
        pm = heap["pymalloc"]
        print(f"heap, {label}: from the end of the warm-up to the end: allocated blocks {heap['allocated_blocks'][0]} -> "
              f"{heap['allocated_blocks'][1]}, gc-tracked objects {heap['gc_objects'][0]} -> {heap['gc_objects'][1]}; "
              "CPython's allocator: " + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in pm.items()))
        if heap["types_grew"]:
            print("  types that grew most: " + ", ".join(f"{g['type']} {g['count_diff']:+d} (now {g['count']})"
                                                          for g in heap["types_grew"]))
    for label, traced in results.get("tracemalloc", {}).items():
        print(f"tracemalloc, {label}: traced Python memory {traced['traced_mb'][0]} -> {traced['traced_mb'][1]} MB "
              "from the end of the warm-up to the end; grew most:")
        for g in traced["top"]:
            print(f"  {g['size_diff_kb']:+.1f} KiB ({g['count_diff']:+d} blocks; now {g['size_kb']} KiB in "
                  f"{g['count']}): " + " <- ".join(reversed(g["traceback"])))


def recovered(rec: dict[str, Any]) -> str:
    """One cut's outcome in words (``recovery``)."""
    if not rec["resumed"]:
        return "STUCK: nothing arrived after the cut"
    return "resumed, caught up" if rec["caught_up"] else "resumed, NOT caught up before the next cut or the end"


def fault_lines(faults: dict[str, Any], live: dict[str, Any], samples: int, args: argparse.Namespace) -> list[str]:
    """The report's lines on ``--faults``: each cut and how delivery came back after it."""
    order = live["order"]
    out = [f"faults: {len(faults['made'])} cuts of {args.fault_s:g} s, one every {args.fault_every:g} s; "
           f"{faults['settled_samples']} of {samples} samples settled (the verdicts' samples)",
           f"events: {live['committed']} written, {live['arrived']} delivered, {order['missing']} missing, "
           f"{order['duplicates']} duplicates, order ok={order['ok']}; longest gap in arrivals before the first "
           f"cut: {faults['gap_before_faults_s']} s; duplicates before the first cut: "
           f"{faults['duplicates_before_faults']}"]
    for made, rec in zip(faults["made"], faults["recovery"]):
        out.append(f"  {made['clock']} {rec['target']:8s} cut at {rec['at']:6.1f} s, {made['reset']} connections "
                   f"reset: {rec['arrived_during']} arrived during the cut, first arrival {rec['first_after_s']} s "
                   f"after it, caught up after {rec['caught_up_s']} s, longest gap after it {rec['longest_gap_s']} s, "
                   f"{rec['missing']} missing" + (f", {rec['duplicates']} sent twice" if rec["duplicates"] else "")
                   + ": " + recovered(rec))
    if faults["missing_by_aggregate"]:
        out.append("  never arrived, by aggregate: " + ", ".join(
            f"{m['aggregate']} {m['missing']} (first committed at {m['first_at']:.1f} s)"
            for m in faults["missing_by_aggregate"]))
    if faults["errors"]:
        out.append(f"  cuts that failed: {faults['errors']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
