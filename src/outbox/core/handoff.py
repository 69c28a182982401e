"""``HandOff``: run one function in a per-process daemon thread, once for every batch of
requests, so that whoever requests it never waits and never does its I/O.

The writer's post-commit wake (``outbox.wake``) and the worker's in-process claim
(``outbox.celery.worker``) are both this. Why, and what it guarantees: docs/waking-and-metrics.md,
"Post-commit wake-up" and "The in-process claim".
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("outbox.wake")

#: The signals a worker process handles in its main thread: stop (SIGTERM, SIGINT, SIGQUIT,
#: SIGHUP), a pool process's soft time limit and Celery's thread dump (SIGUSR1), SIGUSR2.
_MAIN_THREAD_SIGNALS = {getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1",
                                                            "SIGUSR2") if hasattr(signal, name)}


@contextmanager
def main_thread_signals() -> Iterator[None]:
    """Threads started inside it (``Thread.start``, an executor's first ``submit``) have the
    process's signals blocked, so that the kernel hands them to the main thread. A pool
    process's SIGTERM that landed in a helper thread killed the process while its main thread
    held a lock of the pool's queues, and the worker never exited (docs/relay.md, "Signal the
    main process only")."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    unmasked = signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
    try:
        yield  # a new thread inherits this thread's mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unmasked)


class HandOff:
    """``request()`` sets a flag under a lock and notifies the thread: no I/O, a few
    microseconds. The thread runs ``fn`` once; requests made while it runs make exactly one
    more run after it, so a burst costs one or two runs and the last request is always
    followed by a run that started after it.

    The thread starts on the first request and is made again in a forked child (threads do
    not survive ``fork``). ``fn`` must not raise (errors are logged). It is a daemon thread:
    at exit a pending run is lost unless someone calls ``flush`` (beat's tick is the safety
    net)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self.runs = 0  # runs made (tests, benchmarks)
        self._stop = False
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._pending = False
        self._busy = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        if self.pid != os.getpid():  # inherited over fork: the parent's thread is not here
            self._reset()
        with self._cond:
            self._pending, self._stop = True, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                with main_thread_signals():
                    self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._pending and not self._stop:
                    cond.wait()
                if self._stop:
                    self._thread = None
                    cond.notify_all()
                    return
                self._pending, self._busy = False, True
            try:
                self.fn()
            except Exception:
                log.exception("outbox: %s failed", self.name)
            finally:
                with cond:
                    self.runs += 1
                    self._busy = False
                    cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every request made so far has been run; False on timeout."""
        if self.pid != os.getpid():
            return True
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy) and self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Let the thread finish its current run and end; a later ``request`` starts it again."""
        if self.pid != os.getpid():
            return
        with self._cond:
            thread = self._thread
            self._stop = True
            self._pending = False
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


__all__ = ["HandOff", "main_thread_signals"]
