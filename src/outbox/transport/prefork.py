"""Celery's prefork pool for a worker whose broker is not evented, as this transport is:
billiard's blocking pool, with the locks its processes share replaced by locks that die with
the process holding them, the wait for a task moved from ``read`` to ``poll``, and its two
pipes carrying messages in packets a process killed part-way cannot leave out of step
(docs/transport.md, "A pool process killed by SIGKILL"); and a task a pool process read but
died before starting handed back to the broker at once (docs/transport.md, "A task a killed
pool process had read"); and its processes forked and reaped by one thread at a time
(docs/transport.md, "Autoscaling").

``celery -A outbox worker`` uses it on its own; another Celery app on ``outboxdb`` sets
``worker_pool = "outbox.transport.prefork:TaskPool"``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import itertools
import logging
import mmap
import os
import select
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from billiard.connection import Connection, wait
from billiard.einfo import ExceptionInfo
from billiard.pool import ACK, RUN, TASK, stop_if_not_current
from billiard.queues import SimpleQueue
from billiard.reduction import ForkingPickler
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.exceptions import Reject


class ProcessLock:
    """A lock between the processes of one pool that the kernel frees when its holder dies:
    a POSIX record lock (``lockf``) on an unlinked temporary file, plus a thread lock for the
    threads of one process (record locks belong to a process, not to a thread). The file's
    descriptor is inherited by forked processes; a record lock is not. Fork only."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="outbox-pool-lock-")  # noqa: SIM115  (open for the lock's life)
        self._pid = os.getpid()
        self._threads = threading.Lock()

    def _thread_lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # forked: the parent's thread lock may have been copied held
            self._pid, self._threads = os.getpid(), threading.Lock()
        return self._threads

    def _lockf(self, block: bool) -> bool:
        while True:
            try:
                fcntl.lockf(self._file, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES) and not block:
                    return False
                if exc.errno != errno.EDEADLK:  # the kernel's deadlock guess, which threads can mislead
                    raise
                time.sleep(0.01)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        threads = self._thread_lock()
        if not threads.acquire(block, -1 if timeout is None or not block else timeout):
            return False
        try:
            if block and timeout is None:
                return self._lockf(True)
            deadline = time.monotonic() + (timeout or 0.0)
            while not self._lockf(False):
                if not block or time.monotonic() >= deadline:
                    threads.release()
                    return False
                time.sleep(0.01)
            return True
        except BaseException:  # a signal's exception (billiard's SIGTERM: SystemExit) while waiting
            threads.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self._file, fcntl.LOCK_UN)
        self._thread_lock().release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: Any) -> None:
        self.release()

    def __reduce__(self) -> Any:
        raise TypeError("a ProcessLock is shared by forking only (billiard's fork start method)")


log = logging.getLogger("outbox.transport")

#: A packet: one flag byte, then up to PIPE_BUF - 1 bytes of the message. A write of at most
#: PIPE_BUF bytes to a pipe is whole or nothing, and a read of a packet-mode pipe takes one
#: whole packet: no process killed part-way leaves half a packet behind.
PACKET = select.PIPE_BUF
FIRST, LAST = 1, 2


class PacketConnection(Connection):
    """One end of a packet-mode pipe (Linux's ``O_DIRECT`` pipes) carrying billiard's messages,
    each cut into packets flagged first and last. A message a killed process left unfinished
    (a writer that wrote only its first packets, a reader that took only its first packets) is
    dropped whole by the next reader, which starts again at the next first packet. ``poll``
    answers once a whole message is in (it reads the packets that are there), so a reader never
    waits for the rest of a message whose writer is dead."""

    def __init__(self, handle: int, readable: bool = True, writable: bool = True) -> None:
        super().__init__(handle, readable, writable)
        self._parts: list[bytes] | None = None  # the message being read, from its first packet
        self._ready: bytes | None = None  # a whole message read by ``poll``
        self._eof = False
        self._pid, self._send_lock = os.getpid(), threading.Lock()

    def _send_bytes(self, buf: Any) -> None:
        if self._pid != os.getpid():  # forked: the parent's lock may have been copied held
            self._pid, self._send_lock = os.getpid(), threading.Lock()
        view, size, step = memoryview(buf).cast("B"), len(buf), PACKET - 1
        with self._send_lock:
            for start in range(0, max(size, 1), step):
                flag = (FIRST if start == 0 else 0) | (LAST if start + step >= size else 0)
                packet = bytes((flag,)) + view[start:start + step]
                if os.write(self._handle, packet) != len(packet):  # pragma: no cover (PIPE_BUF)
                    raise OSError("a pipe wrote part of a packet")

    def _take_packet(self) -> None:
        packet = os.read(self._handle, PACKET)
        if not packet:
            self._eof = True
            return
        flag, body = packet[0], packet[1:]
        if flag & FIRST:
            if self._parts is not None:
                log.warning("outboxdb: a pool process died writing a message to the pool's pipe: the %d bytes "
                            "it wrote of it were dropped", sum(map(len, self._parts)))
            self._parts = [body]
        elif self._parts is None:  # the rest of a message a killed reader began, or a dropped one
            return
        else:
            self._parts.append(body)
        if flag & LAST:
            self._ready, self._parts = b"".join(self._parts), None

    def _poll(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._ready is None and not self._eof:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait([self._handle], left):
                return False
            self._take_packet()
        return True

    def _recv_bytes(self, maxsize: int | None = None) -> io.BytesIO | None:
        self._poll(None)
        if self._ready is None:
            raise EOFError
        message, self._ready = self._ready, None
        return None if maxsize is not None and len(message) > maxsize else io.BytesIO(message)


def packet_pipe() -> tuple[PacketConnection, PacketConnection] | None:
    """A packet-mode pipe's reading and writing ends, or None where there is none (not Linux)."""
    if not hasattr(os, "O_DIRECT") or not hasattr(os, "pipe2"):
        return None
    try:
        read, write = os.pipe2(os.O_DIRECT | os.O_CLOEXEC)
    except OSError:  # a kernel without packet pipes (before Linux 3.4)
        return None
    return PacketConnection(read, writable=False), PacketConnection(write, readable=False)


#: Every message of the task pipe ends with its number: billiard's ``loads`` of it, in a pool process
#: or in the main process dropping tasks at a stop (``_help_stuff_finish``), reads no further than
#: the pickle's end.
SEQ = struct.Struct("<q")
#: A message that carries no task: it makes the next reader look for numbers a dead reader took.
PROBE = bytes(ForkingPickler.dumps("outbox-probe"))
#: The result pipe's message that hands back tasks that were read but never started: (numbers, why).
UNSTARTED = "outbox-unstarted"


def _counter() -> mmap.mmap:
    """Eight bytes shared with the processes forked after it (an anonymous shared mapping)."""
    return mmap.mmap(-1, SEQ.size)


class TaskQueue(SimpleQueue):
    """billiard's task queue whose reader waits for a task in ``poll``, and reads only once one
    is there: a process killed in ``read`` could take a task's first bytes with it. It also keeps
    the record of what its readers took that ``Pool`` reads when one dies: the number of the
    message each process read last (``_mine``, its own) and of the last one read by anyone
    (``_last``); a reader that finds numbers skipped between the two reports them, since the
    process that read them died before recording them."""

    _mine: mmap.mmap | None = None
    _last: mmap.mmap | None = None
    _results: SimpleQueue | None = None

    def get_payload(self) -> bytes:
        with self._rlock:
            while True:
                self._reader.poll(None)
                payload = self._reader.recv_bytes()
                if self._last is None:
                    return payload
                self._took(payload)
                if len(payload) != len(PROBE) + SEQ.size or payload[:-SEQ.size] != PROBE:
                    return payload  # a task, or a stop sentinel

    def _took(self, payload: bytes) -> None:
        """Record the message read (under the read lock): first as this process's own, then as the
        last read; numbers skipped since the last were read by a process that died before this
        point, and are reported first (a kill between the reports and the record reports again)."""
        assert self._mine is not None and self._last is not None and self._results is not None
        (number,) = SEQ.unpack_from(payload, len(payload) - SEQ.size)
        SEQ.pack_into(self._mine, 0, number)
        (last,) = SEQ.unpack_from(self._last)
        if number > last + 1:
            self._results.put((UNSTARTED, (tuple(range(last + 1, number)),
                                           "its pool process died as it read it")))
        SEQ.pack_into(self._last, 0, number)


class Pool(PreforkPool.BlockingPool):  # billiard.pool.Pool
    """billiard's blocking pool with ``ProcessLock``s for its queues' shared locks, a
    ``TaskQueue`` for its tasks and packet pipes under both queues; its processes forked,
    reaped and counted under one lock (``_maintaining``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._maintain_lock = threading.RLock()
        self._maintain_depth = 0  # the lock holder's nesting
        self._unstarted: list[tuple[str, Any]] = []  # hand-backs found under the lock, sent after it
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def _maintaining(self) -> Iterator[None]:
        """The pool's processes are forked and reaped, and its size changed, by one thread at a
        time: billiard's supervisor and Celery's autoscaler both maintain the pool, and one took
        a process the other was still forking (in ``_pool``, no pid yet) for an exited one and
        crashed (``KeyError: None``; docs/transport.md, "Autoscaling"). What the holder found to
        hand back goes into the result pipe once the lock is released, so that no holder waits
        for that pipe while the result handler waits for the lock (the result handler sends none:
        it reads that pipe)."""
        with self._maintain_lock:
            self._maintain_depth += 1
            try:
                yield
            finally:
                self._maintain_depth -= 1
                outermost = self._maintain_depth == 0
        if outermost and threading.current_thread() is not getattr(self, "_result_handler", None):
            while self._unstarted:
                with contextlib.suppress(IndexError):  # another thread sent it
                    self._outqueue.put(self._unstarted.pop(0))

    def _join_exited_workers(self, shutdown: bool = False) -> Any:
        with self._maintaining():
            return super()._join_exited_workers(shutdown)

    def grow(self, n: int = 1) -> None:
        with self._maintaining():
            super().grow(n)

    def shrink(self, n: int = 1) -> None:
        """billiard's shrink, the processes chosen and stopped under the lock; the put lock's
        shrink, which waits for a free slot (a slot the supervisor may free), after it."""
        with self._maintaining():
            chosen = list(itertools.islice(self._iterinactive(), n))
            for worker in chosen:
                self._processes -= 1
                worker.terminate_controlled()
        for _ in chosen:
            if self._putlock:
                self._putlock.shrink()
            self.on_shrink(1)
        if len(chosen) < n:  # as billiard's
            raise ValueError("Can't shrink pool. All processes busy!")

    def _setup_queues(self) -> None:
        super()._setup_queues()
        if self._ctx.get_start_method() != "fork":  # spawn pickles the queues: billiard's stay
            return
        self._inqueue.__class__ = TaskQueue
        self._inqueue._rlock = ProcessLock()
        self._outqueue._wlock = ProcessLock()
        tasks, results = packet_pipe(), packet_pipe()
        if tasks is not None and results is not None:  # else not Linux: billiard's pipes
            for queue, pipe in ((self._inqueue, tasks), (self._outqueue, results)):
                queue.close()
                queue._reader, queue._writer = pipe
            self._quick_get = self._outqueue._reader.recv  # as billiard's, on the new pipes
            reader = self._outqueue._reader

            def _poll_result(timeout: float) -> tuple[bool, Any]:
                return (True, reader.recv()) if reader.poll(timeout) else (False, None)

            self._poll_result = _poll_result
        self._number_tasks()

    def _number_tasks(self) -> None:
        """Number every message of the task pipe, and remember which task went out under which
        number until it is accepted (``_handed``), so that a task a pool process took and died
        with before accepting it can be handed back (docs/transport.md, "A task a killed pool
        process had read")."""
        self._inqueue._last, self._inqueue._results = _counter(), self._outqueue
        self._sent, self._put_lock = 0, threading.Lock()
        self._handed: dict[int, tuple[int, Any]] = {}  # number: (job, i)
        self._numbers: dict[tuple[int, Any], int] = {}  # (job, i): number
        self._records: dict[int, mmap.mmap] = {}  # pid: that process's ``TaskQueue._mine``
        self._probe_owed = False  # a probe the supervisor could not write yet (``_probe``)
        self._quick_put = self._put_numbered

    def _put_numbered(self, obj: Any) -> None:
        """The pool's ``_quick_put`` (billiard's task handler, the stop sentinels)."""
        payload = ForkingPickler.dumps(obj)
        key = (obj[1][0], obj[1][1]) if isinstance(obj, tuple) and obj[0] == TASK else None
        with self._put_lock:
            self._write_numbered(payload, key)

    def _write_numbered(self, payload: Any, key: tuple[int, Any] | None) -> None:
        """Under ``_put_lock``: the task (``key``) is recorded before any reader can take it. Any
        message begun here follows whatever a dead reader left half read: it serves as a probe."""
        self._probe_owed = False
        self._sent += 1
        if key is not None:
            self._handed[self._sent], self._numbers[key] = key, self._sent
        self._inqueue._writer.send_bytes(b"".join((payload, SEQ.pack(self._sent))))

    def _create_worker_process(self, i: int) -> Any:
        with self._maintaining():
            if not hasattr(self, "_records"):  # spawn: billiard's queues
                return super()._create_worker_process(i)
            # Under the pool's lock, one fork at a time: the child keeps the counter it was forked with as its own.
            self._inqueue._mine = mine = _counter()
            process = super()._create_worker_process(i)
            self._records[process.pid] = mine
            return process

    def create_result_handler(self, **extra_kwargs: Any) -> Any:
        handler = super().create_result_handler(**extra_kwargs)
        if hasattr(self, "_handed"):
            on_ack = handler.state_handlers[ACK]

            def accepted(job: int, i: Any, *args: Any) -> None:
                number = self._numbers.pop((job, i), None)
                if number is not None:
                    self._handed.pop(number, None)
                on_ack(job, i, *args)

            handler.state_handlers[ACK] = accepted
            handler.state_handlers[UNSTARTED] = self._hand_back
        return handler

    def process_flush_queues(self, worker: Any) -> None:
        """A pool process is gone (billiard's supervisor found it exited): if the task it read last
        was not accepted, have the result handler hand it back once it has read every message the
        process wrote before it died (a task accepted meanwhile stays billiard's); and make the
        next reader look for messages the process read but never recorded (a probe)."""
        mine = getattr(self, "_records", {}).pop(worker.pid, None)
        if mine is None:
            return
        (number,) = SEQ.unpack_from(mine)
        mine.close()
        if self._state != RUN or threading.current_thread() is getattr(self, "_result_handler", None):
            return  # a stop: the channel's close hands back every unacknowledged message
        if number in self._handed:  # sent once the pool's lock is released (``_maintaining``)
            self._unstarted.append((UNSTARTED, ((number,), f"its pool process (pid {worker.pid}) died before it started it")))
        self._probe_owed = True
        self._probe()

    def _probe(self) -> None:
        """Write the probe owed since a pool process died, unless the task pipe is busy now: a
        message being written (it may be the very task the dead process was reading, larger than
        the pipe, its writer waiting for a reader) or a full pipe (it may hold only that task's
        rest). No message may come after those (``-c 1``: the broker sends nothing more until
        that task is done), so the probe stays owed, and the supervisor tries again on its next
        round (``_maintain_pool``, every 0.8 s), after it has forked the dead process's
        replacement; any message begun meanwhile pays it (``_write_numbered``)."""
        if not self._probe_owed or self._state != RUN:
            return
        if self._put_lock.acquire(blocking=False):
            try:
                if self._probe_owed and select.select([], [self._inqueue._writer.fileno()], [], 0)[1]:
                    self._write_numbered(PROBE, None)
            finally:
                self._put_lock.release()

    def _maintain_pool(self) -> None:
        """billiard's supervisor's round (processes found dead, replacements forked), then the probe
        still owed, if any; under the pool's lock, whichever thread runs it (the supervisor, the
        autoscaler)."""
        with self._maintaining():
            super()._maintain_pool()
            if hasattr(self, "_put_lock"):
                self._probe()

    def _hand_back(self, numbers: tuple[int, ...], why: str) -> None:
        """The result handler: tasks read by a pool process that died before it started them go
        back to the broker at once, through Celery's own path for a task that raises
        ``Reject(requeue=True)``, instead of waiting out the visibility timeout and holding a
        prefetch slot for the life of the channel."""
        for number in numbers:
            key = self._handed.pop(number, None)
            if key is None:
                continue  # a probe, a stop sentinel, or handed back already
            self._numbers.pop(key, None)
            job = self._cache.get(key[0])
            if job is None or key[1] is not None or job.accepted() or job.ready():
                continue
            log.warning("outboxdb: %s (task %s): its message is handed back to the broker",
                        why, job.correlation_id or key[0])
            try:
                raise Reject(f"not run: {why}", requeue=True)
            except Reject:
                self._cache.pop(key[0], None)  # no ACK will come to take it out
                job._set(None, (False, ExceptionInfo()))

    def join(self) -> None:
        """billiard's join, after one stop sentinel more for each pool process still waiting for
        a task once the task handler has sent its own: it sends one per process it sees, and one
        forked after that (the autoscaler growing the pool, the supervisor replacing one, while
        the pool closes) got none and waited for good, and the join with it (docs/transport.md,
        "A cold shutdown ends"). A sentinel goes only into an empty task pipe: one at a time,
        never more than the pipe holds."""
        stop_if_not_current(self._worker_handler)  # no process forked after this
        self._stop_task_handler(self._task_handler)  # its sentinels are in the pipe
        tasks = self._inqueue._reader.fileno()
        while any(process.is_alive() for process in self._pool):
            if not select.select([tasks], [], [], 0)[0]:  # nothing left for them to read
                self._quick_put(None)
            time.sleep(0.05)
        super().join()


#: Pools whose stop Celery asked for inside a signal handler, for the main thread to run once
#: it is out of the transport (``stop_deferred_pools``).
deferred: list[TaskPool] = []


def _in_signal_handler() -> bool:
    from celery.utils import log as celery_log

    return bool(getattr(celery_log, "_in_sighandler", False))  # set by Celery's shutdown handlers


def stop_deferred_pools() -> None:
    """The stops ``TaskPool.on_stop`` left to the main thread, run by the transport as the main
    thread enters or leaves its ``drain_events``: holding none of the transport's locks."""
    if threading.current_thread() is not threading.main_thread() or _in_signal_handler():
        return
    while deferred:
        deferred.pop().finish_deferred_stop()


class TaskPool(PreforkPool):
    """Celery's prefork pool; with a broker that is not evented Celery runs ``BlockingPool``.
    A stop asked for inside a signal handler (Celery's cold shutdown) is deferred to the main
    thread's next step out of the transport (docs/transport.md, "A cold shutdown ends")."""

    BlockingPool = Pool
    _stop_deferred = False

    def on_stop(self) -> None:
        if _in_signal_handler() and self._pool is not None:
            # The handler interrupted the main thread, maybe inside a statement on the broker's
            # connection; the pool's result handler waits for that connection to ack a result,
            # and joining it here waited for good.
            if not self._stop_deferred:
                self._stop_deferred = True
                deferred.append(self)
            return
        self._stop_deferred = False
        super().on_stop()

    def finish_deferred_stop(self) -> None:
        if self._stop_deferred:
            self._stop_deferred = False
            super().on_stop()

    def on_terminate(self) -> None:
        self.finish_deferred_stop()  # the graceful stop asked for first, as Celery would have run it
        super().on_terminate()


def robust_prefork(pool_cls: Any, use_eventloop: bool) -> Any:
    """``pool_cls`` (a worker's, a class or a name), or ``TaskPool`` when it is Celery's prefork
    pool and the worker runs it blocking (its broker is not evented)."""
    from celery import concurrency

    cls = concurrency.get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    return TaskPool if cls is PreforkPool and not use_eventloop else pool_cls
