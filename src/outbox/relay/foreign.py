"""A task that names another outbox: not run, handed on to that outbox's queue, logged once.

With each outbox on its own queues such a task never arrives; this is the last line of
defence (a hand-made message, a worker started with another outbox's ``-Q``, a mistyped
OUTBOX_NAMESPACE). Why it is forwarded rather than dropped or requeued: docs/relay.md,
"Several outboxes on one broker". Written once for both task runners."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..core.names import valid_namespace


class ForeignTasks:
    """The refusals of one worker process."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._told: set[str] = set()
        self._lock = threading.Lock()

    @staticmethod
    def belongs(named: Any, ours: str) -> bool:
        """Is a task that names ``named`` this outbox's? A task naming none (sent by an
        earlier version, or the in-process claim) is taken as ours: only ours reach our queues."""
        return named is None or named == ours

    def refuse(self, task: str, named: Any, ours: str, forward: Callable[[str], None]) -> str:
        """Refuse ``task`` named for outbox ``named``: ``forward(named)`` sends it to that
        outbox's own queue (it must not be lost: a publish task carries leased rows), then
        one warning per outbox per process. A name no outbox can have is dropped, with one
        line. Returns what was done ("forwarded" or "dropped"); a failed forward raises, so
        the runner treats the task as failed (its rows come back with their lease)."""
        if not valid_namespace(named):
            self._tell(f"bad:{named!r}", "outbox: dropped a %s task naming %r, which is not an outbox's namespace "
                       "(this worker relays %s)", task, named, ours)
            return "dropped"
        forward(named)
        self._tell(named, "outbox: refused a %s task of outbox %r (this worker relays %r): forwarded it to that "
                   "outbox's queue, not run. Check the worker's -Q and OUTBOX_NAMESPACE; further tasks of that "
                   "outbox are forwarded without a log line", task, named, ours)
        return "forwarded"

    def _tell(self, which: str, message: str, *args: Any) -> None:
        with self._lock:
            if which in self._told:
                return
            self._told.add(which)
        self.log.warning(message, *args)


__all__ = ["ForeignTasks"]
