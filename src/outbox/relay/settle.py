"""Settling a chain's rows in the store (done, failed with back-off, released), with a
fallback to the ack queue when the database refuses a write."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

from ..core.model import Claim, FailResult, FenceResult, OutboxMessage, message_from_dict, message_to_dict
from ..publisher import DeadCopy, Publisher, PublishFailure
from .hooks import RelayHooks
from .logfields import describe, log_extra

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


#: ``OutboxStore.mark_failed`` accepts retry times up to a day.
MAX_RETRY_S = 86_400.0


def retry_delay(attempt: int, base_s: float, max_s: float, rng: Callable[[], float] = random.random) -> timedelta:
    """Exponential back-off with "equal jitter": half the step is fixed, half random,
    so retries of many rows that failed together spread out but never come back at once."""
    step = min(max_s, MAX_RETRY_S, base_s * math.pow(2, min(64, max(0, attempt - 1))))
    return timedelta(seconds=step / 2 + rng() * step / 2)


# -- store writes, with a fallback ------------------------------------------------------------

class StoreLike(Protocol):
    def claim(self, batch: int, *, behind: Sequence[int] = ()) -> Claim: ...
    def mark_done(self, ids: Sequence[int], lease: str) -> FenceResult: ...
    def mark_failed(self, id: int, lease: str, error: str, retry_in: timedelta | None = None,
                    *, dead: bool = False) -> FailResult: ...
    def release(self, ids: Sequence[int], lease: str, delay: timedelta | None = None) -> FenceResult: ...
    def held(self, ids: Sequence[int], lease: str) -> set[int]: ...
    # Lost workers (docs/internals.md): a store that leases for a process (``holder_id``, None
    # when it does not) adopts others' rows.
    holder_id: str | None
    def new_lease(self) -> str: ...
    def adopt(self, ids: Sequence[int], lease: str, new_lease: str) -> set[int]: ...


#: ``fallback(operation, kwargs)`` hands a store write that failed to someone who will
#: retry it later (the ack queue's tasks). Operations: "done", "failed", "release".
Fallback = Callable[[str, dict[str, Any]], None]

_handing = threading.local()  # this thread's ``done_marks_by``


@contextmanager
def done_marks_by(submit: Callable[[list[int], str], object]) -> Iterator[None]:
    """Inside the block, this thread's ``Settler.done`` hands each done mark to
    ``submit(ids, lease)`` instead of writing it: a drain slice's claim-ahead thread writes
    it while the slice publishes on (docs/internals.md, "Claims that continue a chain")."""
    _handing.submit = submit
    try:
        yield
    finally:
        _handing.submit = None


#: The key of a fail task's message dict that carries the dead-letter copy's added headers
#: (``Settler.failed``); ``message_from_dict`` reads named keys only, in every release.
DEAD_HEADERS_KEY = "dead_headers"


class Settler:
    """Applies a chain's outcome to the store: ``mark_done``, ``mark_failed``, ``release``.

    The publish task writes to the store directly: it is one short transaction per
    outcome, and the next chain of the aggregate cannot be claimed until it lands, so a
    hop through Celery would add latency to every aggregate and a task per chain. Only
    when the write fails (the database is down even after the store's own retries) is it
    handed to ``fallback``, normally the ack/fail/release tasks on the ack queue, which
    retry with back-off without holding up the publish worker. If even that fails the
    lease is the last line: the rows are claimed again once it expires.
    """

    def __init__(self, store: StoreLike, fallback: Fallback | None = None) -> None:
        self.store = store
        self.fallback = fallback

    def _run(self, operation: str, kwargs: dict[str, Any], call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - settling never raises: the fallback or the lease recovers the rows
            # The rows' ids and lease: a done mark that never lands means they go out again.
            ids = kwargs["ids"] if "ids" in kwargs else [kwargs["message"]["id"]]
            lease = kwargs["lease"] if "lease" in kwargs else kwargs["message"]["lease"]
            extra = {"outbox_event": f"{operation}_write_failed", "outbox_ids": ids, "lease": lease}
            log.error("outbox %s failed (%s: %s); %s outbox_ids=%s lease=%s", operation, type(exc).__name__, exc,
                      "handing it to the ack queue" if self.fallback else "the lease will recover the rows",
                      ids, lease, extra=extra)
            if self.fallback is not None:
                try:
                    self.fallback(operation, kwargs)
                except Exception as again:  # noqa: BLE001 - best effort: the lease recovers the rows
                    log.error("outbox %s: fallback failed too (%s); the lease will recover the rows outbox_ids=%s "
                              "lease=%s", operation, again, ids, lease, extra=extra)
            return None

    def done(self, ids: Sequence[int], lease: str) -> FenceResult | None:
        """None: the write failed and went to the fallback, or was handed on (``done_marks_by``)."""
        ids = list(ids)
        if not ids:
            return FenceResult(0, 0)
        submit = getattr(_handing, "submit", None)
        if submit is not None:
            submit(ids, lease)
            return None
        return self._run("done", {"ids": ids, "lease": lease}, lambda: self.store.mark_done(ids, lease))

    def failed(self, message: OutboxMessage, error: str, retry_in: timedelta | None,
               dead: bool = False, dead_headers: Mapping[str, Any] | None = None) -> FailResult | None:
        """``dead_headers``: added to the dead-letter copy the ack queue sends should this
        write be handed to it (the caller sends it otherwise). They travel inside the message
        dict (``DEAD_HEADERS_KEY``), not as a keyword of their own: the fail task of the previous
        release refused one (TypeError during a rolling deploy: found in the upgrade review) and
        ignores a key it does not read."""
        carried = message_to_dict(message)
        if dead_headers:
            carried[DEAD_HEADERS_KEY] = dict(dead_headers)
        kwargs = {"message": carried, "error": error,
                  "retry_in_s": retry_in.total_seconds() if retry_in is not None else None, "dead": dead}
        return self._run("failed", kwargs, lambda: self.store.mark_failed(
            message.id, message.lease, error, retry_in, dead=dead))

    def release(self, messages: Sequence[OutboxMessage], delay: timedelta | None = None) -> FenceResult | None:
        if not messages:
            return FenceResult(0, 0)
        lease = messages[0].lease
        ids = [m.id for m in messages]
        kwargs = {"ids": ids, "lease": lease, "delay_s": delay.total_seconds() if delay else None}
        return self._run("release", kwargs, lambda: self.store.release(ids, lease, delay))


# -- publishing one chain --------------------------------------------------------------------

def send_dead(publisher: Publisher | None, message: OutboxMessage, error: str,
              headers: Mapping[str, Any] | None = None) -> None:
    """Send the dead-letter copy of a dead row, with ``headers`` added to it; without a
    publisher, nothing. Best effort: the dead row in the table stays the record of truth."""
    if publisher is None:
        return
    problem: PublishFailure | Exception | None
    try:
        problem = publisher.publish_dead(message, error, headers=headers)
    except Exception as exc:  # noqa: BLE001 - best effort: the dead row in the table is the record
        problem = exc
    _log_dead_failure(message, problem)


def send_dead_all(publisher: Publisher | None, copies: Sequence[DeadCopy]) -> None:
    """``send_dead`` of each copy, through one call (``Publisher.publish_dead_all``: one child
    process for a claim's copies when it publishes apart)."""
    if publisher is None or not copies:
        return
    problems: Sequence[PublishFailure | Exception | None]
    try:
        problems = publisher.publish_dead_all(copies)
    except Exception as exc:  # noqa: BLE001 - best effort: the dead rows in the table are the record
        problems = [exc] * len(copies)
    for (message, _, _), problem in zip(copies, problems, strict=True):
        _log_dead_failure(message, problem)


def _log_dead_failure(message: OutboxMessage, problem: PublishFailure | Exception | None) -> None:
    if problem is not None:
        reason = problem.reason if isinstance(problem, PublishFailure) else str(problem)
        log.error("outbox dead-letter publish failed %s error=%r", describe(message), reason,
                  extra=log_extra(message, "dead_letter_failed"))


# -- failed writes handed to the ack queue ---------------------------------------------------

class SettleFailed(Exception):
    """An ack, fail or release task's store write failed because the database is down or
    refusing (after the store's own retries): the caller has counted it towards the database
    outage (its one WARNING, then DEBUG) and retries the task without a traceback per try."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def apply_fallback(store: StoreLike, publisher: Publisher | None, operation: str, kwargs: Mapping[str, Any],
                   hooks: RelayHooks | None = None) -> Any:
    """What the ack/fail/release tasks do with a write the publish task could not make.
    Raises on failure, so the task retries. A row that goes dead is reported to ``hooks``."""
    if operation == "done":
        return store.mark_done(kwargs["ids"], kwargs["lease"])
    if operation == "release":
        delay = kwargs.get("delay_s")
        return store.release(kwargs["ids"], kwargs["lease"], timedelta(seconds=delay) if delay else None)
    if operation == "failed":
        message = message_from_dict(kwargs["message"])
        retry = kwargs.get("retry_in_s")
        result = store.mark_failed(message.id, message.lease, kwargs["error"],
                                   timedelta(seconds=retry) if retry is not None else None,
                                   dead=bool(kwargs.get("dead")))
        if result.applied and result.dead:
            if hooks is not None:
                hooks.after_dead()
            send_dead(publisher, message, kwargs["error"],
                      kwargs["message"].get(DEAD_HEADERS_KEY) or kwargs.get("dead_headers"))
        return result
    raise ValueError(f"unknown operation {operation!r}")


#: The longest one run of the relay's purge goes on deleting (``purge_budget``): its chunks are
#: short transactions each, so the time only bounds how long a worker process is busy with it.
PURGE_RUN_S = 300.0


def purge_budget(interval_s: float) -> float:
    """How long a purge run may delete: half the purge interval (so runs never overlap), at
    most ``PURGE_RUN_S``."""
    return min(PURGE_RUN_S, interval_s / 2)


def purge_expired(store: StoreLike, retention_days: float, outage: Any = None,
                  logger: logging.Logger | None = None, budget_s: float = PURGE_RUN_S,
                  stopping: Callable[[], bool] | None = None) -> int:
    """The purge job of every task runner: delete done rows older than ``retention_days``,
    until none is left, ``budget_s`` seconds have passed, or ``stopping()`` says the worker
    is shutting down (no row cap: the rows done since the last run must all go, or the table
    grows for ever under a steady load; docs/relay.md, "Purge"). A database outage is logged
    once through ``outage`` and the next run purges."""
    try:
        deleted = store.purge_done(timedelta(days=retention_days), max_rows=None,  # type: ignore[attr-defined]
                                   max_seconds=budget_s, stop=stopping)
    except Exception as exc:
        if outage is None:
            raise
        outage.failed(exc)
        return 0
    (logger or log).info("outbox purge: deleted %d done rows older than %g days", deleted, retention_days)
    return deleted
