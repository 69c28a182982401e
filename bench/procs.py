"""Process sampling from ``/proc``: process trees, RSS, CPU per process group over a window,
how busy the machine is, and stopping the process groups a phase started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .services import log

CLK_TCK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            except OSError:
                continue
            out.extend(int(x) for x in text.split())
    except OSError:
        pass
    return out


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children(p))
    return tree


def rss_kb(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident set (``VmRSS``) or its peak so far (``VmHWM``), in kB; any other
    numeric line of ``/proc/<pid>/status`` by its name (``Threads``: its thread count)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


#: glibc malloc's heaps of the arenas other than the main one (``HEAP_MAX_SIZE`` on 64-bit): each
#: is an anonymous mapping that starts on a multiple of this.
MALLOC_HEAP_ALIGN = 64 * 1024 * 1024


def rss_by_mapping(pid: int) -> dict[str, int] | None:
    """A process's resident set in kB by kind of mapping (``/proc/<pid>/smaps``): ``heap``, the
    brk heap (glibc malloc's main arena: the main thread's allocations); ``arenas``, glibc's
    other arenas (the other threads' allocations: anonymous mappings on a ``MALLOC_HEAP_ALIGN``
    boundary); ``anon``, every other anonymous mapping (CPython's 1 MiB arenas of small objects,
    which adjacent ones merge, glibc's mmap'd large blocks, thread stacks); ``file``, mapped
    files (the interpreter's and libraries' code and data) and the kernel's ``[vdso]``. None if
    the process is gone. (A large block that happens to start on the boundary counts as an arena.)"""
    out = {"heap": 0, "arenas": 0, "anon": 0, "file": 0}
    kind = "anon"
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            fields = rest.split(None, 4)
            path = fields[4].strip() if len(fields) > 4 else ""
            if path == "[heap]":
                kind = "heap"
            elif path in ("", "[stack]") or path.startswith("[anon"):
                kind = "arenas" if path == "" and int(head.split("-")[0], 16) % MALLOC_HEAP_ALIGN == 0 else "anon"
            else:
                kind = "file"
        elif head == "Rss:":
            out[kind] += int(rest.split()[0])
    return out


def open_files(pid: int) -> list[str] | None:
    """What each of a process's open file descriptors points at (``/proc/<pid>/fd``:
    ``socket:[inode]``, ``pipe:[inode]``, a path...); None if the process is gone."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    out = []
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since the listing
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def tcp_sockets() -> dict[int, tuple[int, int, int]]:
    """Every TCP socket of this network namespace (``/proc/net/tcp`` and ``tcp6``) by inode:
    (local port, remote port, state; 1 ESTABLISHED, 8 CLOSE_WAIT, 10 LISTEN). With
    ``open_files`` it tells whom a process's sockets talk to."""
    out: dict[int, tuple[int, int, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, remote = fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]
            out[int(fields[9])] = (int(local, 16), int(remote, 16), int(fields[3], 16))
    return out


def peers(files: list[str], sockets: dict[int, tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(local port, remote port) of each TCP connection among a process's ``open_files``
    (listening sockets and other kinds of files left out)."""
    out = []
    for target in files:
        if target.startswith("socket:["):
            entry = sockets.get(int(target[8:-1]))
            if entry is not None and entry[2] != 10:
                out.append((entry[0], entry[1]))
    return out


def cpu_seconds(pid: int, reaped: bool = False) -> float | None:
    """utime + stime of one process, in seconds; with ``reaped``, plus those of its
    children that ended and were waited for (cutime + cstime)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return sum(int(f) for f in fields[11:15 if reaped else 13]) / CLK_TCK


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """(comm, cpu seconds) of every process on the machine."""
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        cpu = cpu_seconds(pid)
        if cpu is not None:
            out[pid] = (comm, cpu)
    return out


def system_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return float(total - idle), float(total)


class CpuWindow:
    """CPU used by each group of processes between ``start`` and ``stop``."""

    def __init__(self, groups: dict[str, Any]) -> None:
        #: name -> callable(pid, comm) -> bool; first match wins, the rest is "other".
        self.groups = groups

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._procs0 = cpu_by_process()
        self._sys0 = system_cpu()

    def stop(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._t0
        procs1 = cpu_by_process()
        sys1 = system_cpu()
        used: dict[str, float] = dict.fromkeys(self.groups, 0.0)
        used["other"] = 0.0
        other: dict[str, float] = {}
        for pid, (comm, cpu) in procs1.items():
            before = self._procs0.get(pid)
            delta = cpu - (before[1] if before and before[0] == comm else 0.0)
            for name, match in self.groups.items():
                if match(pid, comm):
                    used[name] += delta
                    break
            else:
                used["other"] += delta
                other[comm] = other.get(comm, 0.0) + delta
        busy = (sys1[0] - self._sys0[0]) / max(1.0, sys1[1] - self._sys0[1])
        cores = os.cpu_count() or 1
        # CPU of processes that started and ended inside the window is not seen per process.
        seen = sum(used.values())
        unattributed = max(0.0, (sys1[0] - self._sys0[0]) / CLK_TCK - seen)
        top_other = sorted(other.items(), key=lambda kv: -kv[1])[:5]
        return {"elapsed_s": elapsed, "machine_busy": busy, "cores": cores,
                "cores_used": {k: v / elapsed for k, v in used.items() if elapsed > 0},
                "other_top": {k: round(v / elapsed, 3) for k, v in top_other if elapsed > 0},
                "unattributed_cores": round(unattributed / elapsed, 3) if elapsed > 0 else 0.0}


def cpu_summary(cpu: dict[str, Any], per_event: dict[str, float]) -> str:
    """One log line of ``CpuWindow.stop()``'s figures: cores used per group, the machine's
    busy share, and ``per_event`` (CPU microseconds per event per group)."""
    return ("cores used " + ", ".join(f"{k} {v:.2f}" for k, v in cpu["cores_used"].items())
            + f" (machine busy {100 * cpu['machine_busy']:.0f}%); CPU us/event "
            + ", ".join(f"{k} {v}" for k, v in per_event.items()))


def parent_pid(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])


def service_groups() -> dict[str, Any]:
    """CPU groups for the services and this process (with its direct children, e.g. the
    baseline loop). Python processes that are none of ours (other sessions' tests on a
    shared machine) get their own group, so a contaminated measurement shows."""
    me = os.getpid()
    return {
        "bench (consumer, writers, loop)": lambda pid, comm: pid == me or parent_pid(pid) == me,
        "postgres": lambda pid, comm: comm.startswith("postgres"),
        "mariadb": lambda pid, comm: comm.startswith(("mariadbd", "mysqld")),
        "rabbitmq": lambda pid, comm: comm.startswith(("beam", "erl", "epmd", "inet_gethost", "1_scheduler",
                                                       "2_scheduler", "dirty")),
        "redis": lambda pid, comm: comm.startswith("redis"),
        "other python (not this bench)": lambda pid, comm: comm.startswith(("python", "celery", "pytest", "py-spy")),
        # Mostly page writeback and block I/O (WAL, RabbitMQ's message store): on this VM I/O costs CPU.
        "kernel threads (writeback, I/O)": lambda pid, comm: comm.startswith(("kworker", "ksoftirqd", "kdamond",
                                                                              "kswapd", "jbd2", "kthreadd")),
    }


def wait_quiet(max_busy: float = 0.25, window: float = 1.0, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the machine is mostly idle (busy fraction over ``window`` below
    ``max_busy``), at most ``timeout`` seconds. On a shared machine other sessions may be
    running tests; a benchmark started in their middle measures them too."""
    started = time.monotonic()
    busy = 1.0
    while True:
        b0 = system_cpu()
        time.sleep(window)
        b1 = system_cpu()
        busy = (b1[0] - b0[0]) / max(1.0, b1[1] - b0[1])
        waited = time.monotonic() - started
        if busy <= max_busy or waited >= timeout:
            if busy > max_busy:
                log(f"machine still {100 * busy:.0f}% busy after {waited:.0f}s (other load); measuring anyway")
            return {"busy_before": round(busy, 3), "waited_s": round(waited, 1), "quiet": busy <= max_busy}


def stop_process_group(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM the process group we started, then SIGKILL what is left of it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
