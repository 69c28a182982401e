"""The prefork pool for a broker that is not evented (``outbox.transport.prefork``): the
locks its pool processes share die with the process holding them. Real processes, forked
and SIGKILLed; the worker end to end: tests/test_transport_celery.py,
``test_a_pool_process_killed_while_idle_does_not_stall_its_worker``."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.exceptions import Reject

from outbox.transport.prefork import PacketConnection, Pool, ProcessLock, TaskPool, TaskQueue, robust_prefork


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
    # terminate waits for the read lock (_help_stuff_finish)
    ends_within(p, p.terminate, 10, lambda: "the pool's terminate waited for its task queue's read lock")


def ends_within(pool: Pool, call: Any, timeout: float, why: Any) -> None:
    """``call()`` in a thread, given ``timeout`` s: if it is still running then, the pool's
    processes are SIGKILLed and the test fails with ``why()``."""
    running = threading.Thread(target=call, daemon=True)
    running.start()
    running.join(timeout=timeout)
    if running.is_alive():
        message = why()
        for process in pool._pool:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGKILL)
        raise AssertionError(message)


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


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar for {pid}")


def _big(size: int) -> bytes:
    return b"r" * size


def test_a_pool_process_killed_while_writing_a_large_result_leaves_the_result_pipe_in_step(pool: Pool) -> None:
    """A result larger than a pipe takes at once is written in several writes. Its writer
    SIGKILLed between two of them left the start of it in the result pipe: the pool's result
    handler then read every later result as the rest of that one, and no job finished
    again. Now the next reader drops the unfinished message and reads on."""
    handler = pool._result_handler
    read_results, parked = threading.Event(), threading.Event()
    original = handler.poll

    def gated(timeout: float) -> Any:
        if not read_results.is_set():
            parked.set()
            read_results.wait()
        return original(timeout)

    handler.poll = gated  # the result handler looks it up again for each result
    try:
        assert parked.wait(10), "the result handler did not come back to its poll"
        pool.apply_async(_big, (4_000_000,))  # the result handler waits: the writer fills the pipe and waits too
        deadline = time.monotonic() + 10
        while not (writing := [p.pid for p in pool._pool if "pipe_write" in _wchan(p.pid)]):
            assert time.monotonic() < deadline, {p.pid: _wchan(p.pid) for p in pool._pool}
            time.sleep(0.005)
        os.kill(writing[0], signal.SIGKILL)
        assert _exit_code_of_child(writing[0])
    finally:
        read_results.set()
    for n in range(5):
        assert pool.apply_async(len, (b"x" * n * 3000,)).get(timeout=10) == n * 3000


def _exit_code_of_child(pid: int) -> bool:
    """True once ``pid`` (a pool process, reaped by the pool) is gone."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return True


def test_a_pool_process_killed_while_reading_a_large_task_leaves_the_task_pipe_in_step(pool: Pool) -> None:
    """A task larger than the task pipe holds is read in several reads. Its reader killed
    between two of them left the rest of it in the pipe: the next pool process read that rest
    as a message (a length out of the middle of it) and no task ran again. Now the next reader
    drops the rest and takes the next task. Three kills in a row."""
    size = 20_000_000
    for _ in range(3):
        deadline = time.monotonic() + 10
        while not (waiting := [p.pid for p in pool._pool if waits_for_a_task(_wchan(p.pid))]):
            assert time.monotonic() < deadline, {p.pid: _wchan(p.pid) for p in pool._pool}
            time.sleep(0.005)
        reader, before = waiting[0], _rchar(waiting[0])
        pool.apply_async(len, (b"t" * size,))
        deadline = time.monotonic() + 10
        while _rchar(reader) == before:  # it has begun reading the task
            assert time.monotonic() < deadline
        os.kill(reader, signal.SIGSTOP)
        taken = _rchar(reader) - before
        os.kill(reader, signal.SIGKILL)
        assert 0 < taken < size / 2, taken  # killed part-way through the task
        assert _exit_code_of_child(reader)
        assert pool.apply_async(len, (b"x" * 5000,)).get(timeout=10) == 5000


def test_a_process_forked_after_the_stop_sentinels_does_not_hold_up_the_join() -> None:
    """billiard's task handler, as the pool closes, sends one stop sentinel per pool process it
    sees; a process forked after that (the autoscaler growing the pool, or the supervisor
    replacing one, while the pool closes) got none, waited for a task for good, and the pool's
    join (a warm or cold shutdown) waited for it: 1 cold stop in 8 with ``--autoscale`` hung so.
    Forced here: the pool closed, its sentinels sent, then one more process forked."""
    pool = Pool(processes=2)
    pool.close()
    pool._task_handler.join(10)
    assert not pool._task_handler.is_alive()  # its sentinels are sent
    pool._processes += 1
    late = pool._create_worker_process(pool._avail_index())
    ends_within(pool, pool.join, 15,
                lambda: f"the pool's join waited for a process forked after its sentinels ({_wchan(late.pid)})")
    pool.terminate()


@pytest.mark.parametrize("killed", ["after-its-read", "inside-its-read"])
def test_a_task_whose_pool_process_died_before_starting_it_is_handed_back(
        killed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool process SIGKILLed after it read a task and before it accepted it (billiard's ACK):
    billiard's blocking pool does not know which process took a task from the shared pipe, so the
    task stayed in its cache for good, never run, never failed, and Celery's message with it (back
    only after the visibility timeout, its prefetch slot held for the life of the channel: with
    ``-c 1`` the worker received nothing again). Now the task is failed with ``Reject(requeue=True)``,
    which makes Celery hand its message back at once: killed once its read is done (the pool sees
    it when it finds the process dead), and killed inside it, the task read but not yet recorded
    (the next reader finds the task's number skipped). The pause is this test's, in the pool
    processes it forks; the kill is real."""
    park, parked = tmp_path / "park", tmp_path / "parked"
    report_read, report_write = os.pipe()
    where = TaskQueue if killed == "after-its-read" else PacketConnection
    method = "get_payload" if killed == "after-its-read" else "recv_bytes"
    read = getattr(where, method)

    def pausing(self: Any, *args: Any) -> Any:
        payload = read(self, *args)
        try:
            park.rename(parked)  # one reader parks, once
        except FileNotFoundError:
            return payload
        os.write(report_write, str(os.getpid()).encode())
        time.sleep(60)  # SIGKILLed here
        raise AssertionError("not killed")

    monkeypatch.setattr(where, method, pausing)
    pool = Pool(processes=2)
    try:
        park.touch()
        failed: list[Any] = []
        job = pool.apply_async(os.getpid, error_callback=failed.append)
        assert select.select([report_read], [], [], 10)[0], "no pool process read the task"
        reader = int(os.read(report_read, 20))
        os.kill(reader, signal.SIGKILL)
        _handed_back(job, failed)
        assert job._job not in pool._cache
        for _ in range(4):  # the pool runs on
            assert pool.apply_async(os.getpid).get(timeout=10) != reader
    finally:
        ends_within(pool, pool.terminate, 10, lambda: "the pool's terminate did not end")


def test_a_task_larger_than_the_pipe_whose_only_reader_died_inside_it_is_handed_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's only process SIGKILLed inside its read of a task larger than the task pipe holds:
    the main process, still writing that task, waits for a reader with the pipe's write lock held,
    so the supervisor wrote no probe when it found the process dead, and nothing else came down
    the pipe: its replacement dropped the task's rest and waited; the task's number was never
    found skipped, the task never run nor handed back (in review: not handed back within 15 s, and
    at once by the next task sent; a worker with ``-c 1`` gets no next task). The probe is now owed
    until the supervisor can write it. The pause is this test's, in the pool process; the kill is
    real."""
    park, parked = tmp_path / "park", tmp_path / "parked"
    report_read, report_write = os.pipe()
    take, parent = PacketConnection._take_packet, os.getpid()

    def pausing(self: PacketConnection) -> None:
        take(self)
        if os.getpid() == parent or self._parts is None or len(self._parts) < 2:
            return
        try:
            park.rename(parked)  # one reader parks, once, two packets into a message
        except FileNotFoundError:
            return
        os.write(report_write, str(os.getpid()).encode())
        time.sleep(60)  # SIGKILLed here
        raise AssertionError("not killed")

    monkeypatch.setattr(PacketConnection, "_take_packet", pausing)
    pool = Pool(processes=1)
    try:
        park.touch()
        failed: list[Any] = []
        job = pool.apply_async(len, (b"x" * 300_000,), error_callback=failed.append)  # some 75 packets
        assert select.select([report_read], [], [], 10)[0], "no pool process read the task"
        reader = int(os.read(report_read, 20))
        time.sleep(0.2)  # the main process fills the pipe with the task's rest and waits
        os.kill(reader, signal.SIGKILL)
        _handed_back(job, failed)
        assert pool.apply_async(os.getpid).get(timeout=10) != reader  # the pool runs on
    finally:
        ends_within(pool, pool.terminate, 10, lambda: "the pool's terminate did not end")


def test_a_process_being_forked_by_one_thread_is_not_reaped_by_another() -> None:
    """Celery's autoscaler maintains the pool from its own thread (it grows the pool, then forks
    the new processes in ``maintain_pool``) while billiard's supervisor does too: a process one
    thread was forking is already in the pool's list, with no pid yet, and the other took it for
    an exited one and crashed (``KeyError: None``); the supervisor's crash ended the worker (exit
    code 1, in review 1 run of 2 with pool processes SIGKILLed under ``--autoscale=4,1``; from
    outside, 3 of 4 runs within 1 s of the first scale-up). Forced here: the "autoscaler" thread
    parked inside the fork of the process it grew the pool by, the "supervisor" round run
    meanwhile. The pause is this test's; the forks are real."""
    pool = Pool(processes=1)
    pool._worker_handler.close()  # the test plays the supervisor: its crash would end pytest
    pool._worker_handler.join(10)
    assert not pool._worker_handler.is_alive()
    parked, go = threading.Event(), threading.Event()
    make = pool.WorkerProcess

    def parking(worker: Any) -> Any:
        process = make(worker)
        start = process.start

        def parked_start() -> None:
            if threading.current_thread().name == "autoscaler" and not parked.is_set():
                parked.set()  # in the pool's list, no pid yet
                go.wait(10)
            start()

        process.start = parked_start
        return process

    pool.WorkerProcess = parking  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def run(call: Any) -> None:
        try:
            call()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    def autoscale() -> None:
        pool.grow(1)
        pool._maintain_pool()  # Celery's Autoscaler.maybe_scale: grow, then maintain_pool

    try:
        autoscaler = threading.Thread(target=run, args=(autoscale,), name="autoscaler", daemon=True)
        autoscaler.start()
        assert parked.wait(10), "the autoscaler's fork was not reached"
        supervisor = threading.Thread(target=run, args=(pool._maintain_pool,), name="supervisor", daemon=True)
        supervisor.start()
        supervisor.join(0.5)  # a round's chance to run into the half-forked process
        go.set()
        for thread in (autoscaler, supervisor):
            thread.join(15)
            assert not thread.is_alive(), f"the {thread.name} thread did not end"
        assert errors == []
        pids = [process.pid for process in pool._pool]
        assert None not in pids and len(pids) == pool._processes == 2
        assert sorted(pool._poolctrl) == sorted(pids)
        assert all(process.is_alive() for process in pool._pool)
        assert pool.apply_async(os.getpid).get(timeout=10) in pids  # the pool runs on
    finally:
        go.set()
        ends_within(pool, pool.terminate, 10, lambda: "the pool's terminate did not end")


def _handed_back(job: Any, failed: list[Any]) -> None:
    """``job``, whose pool process was killed after reading it, ends within 15 s, failed with
    ``Reject(requeue=True)``: what Celery turns into the message handed back to the broker."""
    deadline = time.monotonic() + 15
    while not job.ready():
        assert time.monotonic() < deadline, f"the task the killed process read was not handed back: {job!r}"
        time.sleep(0.01)
    [info] = failed
    rejected = getattr(info.exception, "exc", info.exception)  # billiard's ExceptionWithTraceback, as Celery reads it
    assert isinstance(rejected, Reject) and rejected.requeue is True
