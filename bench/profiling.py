"""Where a worker's time goes: ``py-spy record --idle`` on its processes, summarised by
buckets of activity (``python -m bench``'s ``profile`` phase, ``bench.live --profile``).

* ``profile_drain``: a drain like ``bench.drain.run_celery_drain`` with py-spy attached to the
  worker's processes (a separate pass: sampling costs CPU the measured run must not lose).
* ``start_spies`` / ``collect_spies`` / ``log_profiles``: py-spy around any phase.
* ``summarize_raw``: py-spy's raw collapsed stacks -> top frames and buckets (``_BUCKETS``).
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import (
    PY_SPY,
    CpuWindow,
    Destination,
    Run,
    check_order,
    lease_recovered,
    load_backlog,
    log,
    truncate_table,
    wait_all_done,
)
from .drain import Relay, arrival_rate, cpu_groups


def _frame_name(frame: str) -> str:
    """'handle_chain (outbox/relay/publish.py:52)' -> 'publish.py:handle_chain'."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{Path(path).name}:{name}"


#: Buckets for "where did a publish-worker process spend its time", first match on the stack wins
#: (checked from the leaf up, so the innermost known activity is charged).
_BUCKETS = [
    # every worker process: the lost-worker heartbeat's own thread (docs/internals.md, "Lost
    # workers"), idle in its wait nearly always; py-spy --idle samples it as often as the
    # thread doing the work, so without this bucket half of each process was "other"
    ("heartbeat thread (mostly idle)", ("holders.py:Heartbeat._run",)),
    # pool processes: the publish path
    ("amqp: wait for the wave's confirms", ("kombu_publisher.py:_await_confirms",)),
    ("amqp: send (frame encoding, socket)", ("kombu_publisher.py:_send_frames", "frames.py:",
                                             "channel.py:_basic_publish")),
    ("db: mark_done", ("store.py:mark_done",)),
    ("db: release / mark_failed", ("store.py:release", "store.py:mark_failed")),
    ("db: claim", ("store.py:claim",)),
    ("celery: send task (Redis)", ("task.py:apply_async", "base.py:send_task")),
    ("redis: wake token / breaker / queue depth", ("shared.py:", "tasks.py:queued_publish_tasks",
                                                   "wake.py:")),
    ("publisher: headers, checks, wave bookkeeping", ("message.py:checked_headers", "message.py:build_headers",
                                                      "waves.py:", "kombu_publisher.py:_publish_waves")),
    ("task args (dicts -> messages)", ("model.py:message_from_dict", "model.py:message_to_dict")),
    ("logging", ("__init__.py:info", "__init__.py:debug", "__init__.py:warning", "__init__.py:_log")),
    ("celery: rest of the task", ("trace.py:trace_task", "trace.py:fast_trace_task")),
    ("pool: idle, waiting for a task", ("pool.py:workloop", "pool.py:receive")),
    # the worker's parent process
    ("parent: epoll wait (idle)", ("eventio.py:poll",)),
    ("kombu Redis transport (BRPOP, LPUSH, ack, QoS)", ("redis.py:",)),
    ("parent: pool IPC (asynpool)", ("asynpool.py:",)),
    ("parent: wake subscriber, in-process claim, hand-off threads", ("handoff.py:", "listen.py:",
                                                                     "worker.py:_claim_in_process")),
]


def _matches(frame: str, needle: str) -> bool:
    """``needle`` is 'file.py:function' ('file.py:' for any function of the file); a frame's
    function may be qualified by its class ('KombuPublisher.publish_chain')."""
    file, _, func = needle.partition(":")
    frame_file, _, frame_func = frame.partition(":")
    if frame_file != file:
        return False
    return not func or frame_func == func or frame_func.endswith("." + func)


def _bucket(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, needles in _BUCKETS:
            if any(_matches(frame, n) for n in needles):
                return name
    return "other"


def summarize_raw(path: Path, top: int = 15) -> dict[str, Any]:
    """Summarise py-spy ``--format raw`` output: total samples, inclusive and self top lists,
    and a breakdown into buckets (see ``_BUCKETS``)."""
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        try:
            count = int(count_text)
        except ValueError:
            continue
        frames = [_frame_name(f) for f in stack_text.split(";") if f]
        if frames and frames[0].startswith(":process "):
            frames = frames[1:]  # --idle adds a 'process N' root
        frames = [f for f in frames if not f.startswith(":thread ")]
        total += count
        for f in set(frames):
            inclusive[f] += count
        if frames:
            leaf[frames[-1]] += count
        buckets[_bucket(frames)] += count
    pct = (lambda c: round(100.0 * c / total, 1)) if total else (lambda c: 0.0)
    # Frames on (nearly) every stack are the process's bootstrap: leave them out.
    interesting = [(k, v) for k, v in inclusive.most_common() if not total or v < 0.95 * total]
    return {"samples": total,
            "buckets": {k: pct(v) for k, v in buckets.most_common()},
            "inclusive": [(k, pct(v)) for k, v in interesting[:top]],
            "self": [(k, pct(v)) for k, v in leaf.most_common(top)]}


def start_spies(run: Run, pids: list[int], duration: float, tag: str, *, idle: bool = True,
                out_dir: Path | None = None) -> list[tuple[int, Path, Any]]:
    """``py-spy record`` on each pid, raw collapsed stacks (in ``out_dir``, else the run's
    workdir): with ``idle``, ``--idle`` (wall-clock: waits show), else on-CPU samples only
    (where the CPU goes: what ``bench.live --profile-cpu`` compares between two trees)."""
    spies = []
    for pid in pids:
        out = (out_dir or run.workdir) / f"pyspy-{tag}-{pid}.txt"
        spies.append((pid, out, subprocess.Popen(
            [PY_SPY, "record", "--pid", str(pid), "--rate", "200", *(["--idle"] if idle else []), "--nonblocking",
             "--format", "raw", "--duration", str(max(1, int(duration))), "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    time.sleep(0.5)
    return spies


def collect_spies(relay: Relay, spies: list[tuple[int, Path, Any]]) -> dict[str, Any]:
    for _, _, spy in spies:
        if spy.poll() is None:
            spy.send_signal(2)  # SIGINT: py-spy writes what it has
    profiles: dict[str, Any] = {}
    for pid, out, spy in spies:
        try:
            spy.wait(timeout=20)
        except subprocess.TimeoutExpired:
            spy.kill()
        role = "parent" if pid == relay.worker.pid else f"child {pid}"
        if out.exists():
            profiles[role] = summarize_raw(out)
        else:
            profiles[role] = {"error": (spy.stderr.read() if spy.stderr else b"").decode(errors="replace")[-500:]}
    return profiles


def log_profiles(label: str, profiles: dict[str, Any]) -> None:
    for role, summary in profiles.items():
        if "buckets" in summary:
            log(f"{label} {role}: " + ", ".join(f"{k} {v}%" for k, v in list(summary["buckets"].items())[:8]))


def profile_drain(run: Run, destination: Destination, relay: Relay, events: int, aggregates: int,
                  timeout: float = 240.0) -> dict[str, Any]:
    """Drain again with ``py-spy record --idle`` on the worker's parent and pool processes."""
    truncate_table(run)
    expected = load_backlog(run, events, aggregates)
    destination.reset()
    pids = relay.worker_pids()
    duration = max(5, int(min(timeout, events / 300.0)))
    spies = start_spies(run, pids, duration, "drain")
    log(f"profile: py-spy on worker processes {pids} for up to {duration}s")
    window = CpuWindow(cpu_groups(relay))
    window.start()
    destination.wait_for(events, timeout=timeout, idle_timeout=30, alive=relay.check_alive)
    cpu = window.stop()
    arrivals = list(destination.arrivals)
    profiles = collect_spies(relay, spies)
    counts = wait_all_done(run, timeout=75)
    late = check_order(list(destination.arrivals), expected)
    result = {"events": events, **arrival_rate(arrivals, events), "order": check_order(arrivals, expected),
              "table": counts, "lease_recovered": lease_recovered(run), "order_after_wait": late,
              "cpu": cpu, "profiles": profiles, "raw_files": [str(out) for _, out, _ in spies]}
    log(f"profile drain (perturbed by py-spy): {result['events_per_s']:.0f} ev/s")
    log_profiles("profile drain", profiles)
    return result
