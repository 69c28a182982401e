"""Celery's prefork pool for a worker whose broker is not evented, as this transport is:
billiard's blocking pool, with the locks its processes share replaced by locks that die with
the process holding them, and the wait for a task moved from ``read`` to ``poll``
(docs/transport.md, "A pool process killed by SIGKILL").

``celery -A outbox worker`` uses it on its own; another Celery app on ``outboxdb`` sets
``worker_pool = "outbox.transport.prefork:TaskPool"``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import threading
import time
from typing import Any

from billiard.queues import SimpleQueue
from celery.concurrency.prefork import TaskPool as PreforkPool


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


class TaskQueue(SimpleQueue):
    """billiard's task queue whose reader waits for a task in ``poll``, and reads only once one
    is there: a process killed in ``read`` could take a task's first bytes with it."""

    def get_payload(self) -> bytes:
        with self._rlock:
            self._reader.poll(None)
            return self._reader.recv_bytes()


class Pool(PreforkPool.BlockingPool):  # billiard.pool.Pool
    """billiard's blocking pool with ``ProcessLock``s for its queues' shared locks and a
    ``TaskQueue`` for its tasks."""

    def _setup_queues(self) -> None:
        super()._setup_queues()
        if self._ctx.get_start_method() == "fork":  # spawn pickles the queues: billiard's locks stay
            self._inqueue.__class__ = TaskQueue
            self._inqueue._rlock = ProcessLock()
            self._outqueue._wlock = ProcessLock()


class TaskPool(PreforkPool):
    """Celery's prefork pool; with a broker that is not evented Celery runs ``BlockingPool``."""

    BlockingPool = Pool


def robust_prefork(pool_cls: Any, use_eventloop: bool) -> Any:
    """``pool_cls`` (a worker's, a class or a name), or ``TaskPool`` when it is Celery's prefork
    pool and the worker runs it blocking (its broker is not evented)."""
    from celery import concurrency

    cls = concurrency.get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    return TaskPool if cls is PreforkPool and not use_eventloop else pool_cls
