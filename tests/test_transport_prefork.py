"""The prefork pool for a broker that is not evented (``outbox.transport.prefork``): the
locks its pool processes share die with the process holding them. Real processes, forked
and SIGKILLed; the worker end to end: tests/test_transport_celery.py,
``test_a_pool_process_killed_while_idle_does_not_stall_its_worker``."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool

from outbox.transport.prefork import Pool, ProcessLock, TaskPool, robust_prefork


def _fork(body: object) -> int:
    """A forked process that runs ``body()`` and exits (0, or 1 when it raised or returned False)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            code = 0 if body() is not False else 1  # type: ignore[operator]
        finally:
            os._exit(code)
    return pid


def _exit_code(pid: int, timeout: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_lock_whose_holder_was_killed_is_free() -> None:
    lock = ProcessLock()
    read, write = os.pipe()

    def hold() -> None:
        lock.acquire()
        os.write(write, b"held")
        time.sleep(60)

    holder = _fork(hold)
    assert os.read(read, 4) == b"held"
    assert lock.acquire(False) is False  # held by the other process
    assert lock.acquire(timeout=0.05) is False
    os.kill(holder, signal.SIGKILL)  # billiard's semaphore stayed held for good here
    assert _exit_code(holder) == -signal.SIGKILL
    assert lock.acquire(timeout=5.0) is True
    lock.release()


def test_the_lock_excludes_other_processes_and_threads() -> None:
    lock = ProcessLock()
    with lock:
        assert _exit_code(_fork(lambda: lock.acquire(False))) == 1  # another process: not now
        waiter = _fork(lambda: lock.acquire(timeout=10.0))  # gets it once released
        other: list[bool] = []
        thread = threading.Thread(target=lambda: other.append(lock.acquire(timeout=0.05)))
        thread.start()
        thread.join()
        assert other == [False]  # another thread of this process: not now either
        time.sleep(0.1)
    assert _exit_code(waiter) == 0
    assert lock.acquire(False) is True  # the waiter's exit freed it
    lock.release()


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(processes=2)
    yield p
    stop = threading.Thread(target=p.terminate, daemon=True)  # waits for the read lock (_help_stuff_finish)
    stop.start()
    stop.join(timeout=10)
    if stop.is_alive():
        for process in p._pool:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
        raise AssertionError("the pool's terminate waited for its task queue's read lock")


def _wchan(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def waits_for_a_task(wchan: str) -> bool:
    """The pool process whose turn it is, asleep holding the task queue's read lock: in the
    pipe's ``poll`` (this pool), or in its ``read`` (billiard's own pool)."""
    return "poll" in wchan or "pipe_read" in wchan


def test_a_pool_whose_waiting_process_was_killed_runs_the_next_task(pool: Pool) -> None:
    """billiard's blocking pool: the idle process whose turn it is waits for a task holding the
    task queue's read lock, the other waits for the lock. Killed there, it left billiard's
    semaphore held and ``apply_async`` never ran; and a task written at once, before the killed
    process was gone, could lose its first bytes to it while it waited in ``read`` (the next
    process then read the rest as a message: EOFError, 1 kill in about 10). Twenty kills in a row,
    each followed at once by a task."""
    assert isinstance(pool._inqueue._rlock, ProcessLock) and isinstance(pool._outqueue._wlock, ProcessLock)
    killed: set[int] = set()
    for _ in range(20):
        deadline = time.monotonic() + 10
        while not (waiting := [p.pid for p in pool._pool if waits_for_a_task(_wchan(p.pid))]):
            assert time.monotonic() < deadline, {p.pid: _wchan(p.pid) for p in pool._pool}
            time.sleep(0.005)
        os.kill(waiting[0], signal.SIGKILL)
        killed.add(waiting[0])
        assert pool.apply_async(os.getpid).get(timeout=10) not in killed


def test_only_celerys_prefork_pool_run_blocking_is_replaced() -> None:
    assert robust_prefork("prefork", use_eventloop=False) is TaskPool
    assert robust_prefork(PreforkPool, use_eventloop=False) is TaskPool
    assert robust_prefork("prefork", use_eventloop=True) == "prefork"  # Redis, RabbitMQ: Celery's AsynPool
    assert robust_prefork(SoloPool, use_eventloop=False) is SoloPool
    assert robust_prefork("threads", use_eventloop=False) == "threads"
    assert TaskPool.BlockingPool is Pool and issubclass(TaskPool, PreforkPool)
