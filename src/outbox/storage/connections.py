"""One connection lifecycle for everything that opens its own database connections: the store
(``OutboxStore``) and the database broker (``outbox.transport``).

- **Per thread and process.** A connection is opened on first use and again after a fork (a
  connection is never shared with a child process, which Celery's prefork pool would do).
  The store keeps one per thread; the broker keeps one per process, shared by its channels
  under a lock (acks come from the pool's threads).
- **Short transactions.** Each unit of work is one transaction: committed when it returns,
  rolled back when it raises.
- **Transient retries.** A deadlock victim, a lock timeout, a dropped connection: the work
  runs again, on a fresh connection if the old one is gone, with a short random exponential
  wait (``RETRY_WAIT``), at most ``attempts`` times; then the last error is raised. A
  migration's lock timeout is not retried: while DDL waits for a table, every writer of it
  waits too, so the wait is bounded once (README, "The table").
- **Drop on disconnect.** A connection whose error says it is gone, or whose rollback fails,
  is closed and forgotten; the next use opens another.

What an error means is the engine's (``Engine.is_transient``, ``Engine.is_disconnect``); what
the caller does once the retries are spent is the caller's (the broker raises it as
``BrokerDatabaseUnavailable`` for kombu to reconnect).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from types import SimpleNamespace
from typing import Any, TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from .engines import Engine

log = logging.getLogger("outbox.storage.connections")
T = TypeVar("T")

#: The wait before each retry: random, up to 0.05 s doubling per attempt, at most 2 s.
RETRY_WAIT = wait_random_exponential(multiplier=0.05, max=2.0)


class Connections:
    """The connections ``engine`` opens to ``url``: one per thread (``per_thread``) or one per
    process shared under a lock. ``on_connect(conn)`` runs once on each new connection
    (the broker's session set-up and table check)."""

    def __init__(self, engine: Engine, url: str, *, per_thread: bool = True,
                 on_connect: Callable[[Any], None] | None = None) -> None:
        self.engine = engine
        self.url = url
        self.on_connect = on_connect
        self._slot: Any = threading.local() if per_thread else SimpleNamespace()
        #: The error of the last connect that failed, None once one succeeds: how a caller tells
        #: a database it could not reach from a statement that failed (``connect_failed``).
        self.connect_error: BaseException | None = None
        #: Held around each use of a shared connection; a per-thread one needs none.
        self._lock: Any = nullcontext() if per_thread else threading.RLock()

    def get(self) -> Any:
        """This thread's (or process's) connection, opened on first use and after a fork.
        Every use enters ``Engine.in_use`` before the lock, so a use waiting there holds none."""
        with self.engine.in_use(), self._lock:
            conn = getattr(self._slot, "conn", None)
            if conn is None or self._slot.pid != os.getpid():
                try:
                    conn = self.engine.connect(self.url)
                except BaseException as exc:
                    self.connect_error = exc
                    raise
                self.connect_error = None
                if self.on_connect is not None:
                    try:
                        self.on_connect(conn)
                    except BaseException:
                        # Kept, it would serve every later call without its set-up (a
                        # session's lock timeout, say): the next call connects again.
                        with suppress(Exception):
                            conn.close()
                        raise
                self._slot.conn, self._slot.pid = conn, os.getpid()
            return conn

    def drop(self) -> None:
        """Close and forget the connection (one inherited from a parent process is only
        forgotten: it is the parent's to close)."""
        with self.engine.in_use(), self._lock:
            conn = getattr(self._slot, "conn", None)
            self._slot.conn = None
            if conn is not None and self._slot.pid == os.getpid():
                try:
                    conn.close()
                except Exception:  # closing a broken connection may itself fail
                    log.debug("outbox: error closing a dropped connection", exc_info=True)

    @contextmanager
    def transaction(self, *, alone: bool = False, ddl: bool = False) -> Iterator[Any]:
        """A cursor inside one short transaction: committed on success, rolled back (and
        the connection dropped if it broke) on error. ``alone``: the block runs single
        statements, each atomic by itself, which the engine may then run as transactions of
        their own, one round trip each (``Engine.statement_alone``; docs/relay.md, "A network
        cut"). ``ddl``: the block is a migration (``Engine.ddl_cursor``)."""
        with self.engine.in_use(), self._lock, self.transaction_on(self.get(), alone=alone, ddl=ddl) as cursor:
            yield cursor

    @contextmanager
    def transaction_on(self, conn: Any, *, alone: bool = False, ddl: bool = False) -> Iterator[Any]:
        """``transaction`` on ``conn`` itself: for ``on_connect``, which runs while ``get`` is
        still opening the connection."""
        cursor = self.engine.ddl_cursor(conn) if ddl else self.engine.cursor_for(conn)
        try:
            with (self.engine.ddl_bounds(cursor) if ddl else nullcontext(),
                  self.engine.statement_alone(conn) if alone else nullcontext()):
                yield cursor
            conn.commit()
        except BaseException as exc:
            try:
                conn.rollback()
            except Exception:  # noqa: BLE001 - a rollback that fails for any reason drops the connection
                self.drop()
            else:
                if self.engine.is_disconnect(exc):
                    self.drop()
            raise
        finally:
            _close(cursor)

    @contextmanager
    def outside_transaction(self) -> Iterator[Any]:
        """A migration's cursor (``Engine.ddl_cursor``) on this thread's connection in autocommit,
        each statement committed as it runs: for DDL no transaction may hold (PostgreSQL's
        ``CREATE INDEX CONCURRENTLY``). Nothing is retried; a connection whose error says it is
        gone is dropped."""
        with self.engine.in_use(), self._lock:
            conn = self.get()
            cursor = self.engine.ddl_cursor(conn)
            try:
                with self.engine.autocommit(conn):
                    yield cursor
            except BaseException as exc:
                if self.engine.is_disconnect(exc):
                    self.drop()
                raise
            finally:
                _close(cursor)

    def retryable(self, exc: BaseException, *, ddl: bool = False) -> bool:
        """Worth running the work again: a transient error, a dropped connection; for a
        migration (``ddl``) not a lock timeout."""
        if ddl and self.engine.is_lock_timeout(exc):
            return False
        return self.engine.is_transient(exc) or self.engine.is_disconnect(exc)

    def run(self, operation: str, work: Callable[[Any], T], *, attempts: int, alone: bool = False,
            ddl: bool = False) -> T:
        """``work(cursor)`` in a transaction (``alone``, ``ddl``: see ``transaction``), run again
        on a retryable error, ``attempts`` times in all; then the last error is raised."""
        def before_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            # DEBUG: the caller reports what finally happened (an outage is logged once).
            log.debug("outbox %s: transient database error, retrying (attempt %d): %s",
                      operation, state.attempt_number, exc)

        retrying = Retrying(retry=retry_if_exception(functools.partial(self.retryable, ddl=ddl)),
                            stop=stop_after_attempt(attempts),
                            wait=RETRY_WAIT, before_sleep=before_retry, reraise=True)
        for attempt in retrying:
            with attempt, self.transaction(alone=alone, ddl=ddl) as cursor:
                return work(cursor)
        raise AssertionError("unreachable: tenacity re-raises the last error")


def _close(cursor: Any) -> None:
    try:
        cursor.close()
    except Exception:
        log.debug("outbox: error closing a cursor", exc_info=True)


class CallerTransactions(Connections):
    """The store's transactions on a caller's connection instead of connections of its own
    (``OutboxStore.on_caller``: the Django admin's requeue). ``begin()`` opens one of the
    caller's transactions and yields a cursor in it; its exit commits or rolls back as the
    caller's framework does. Nothing is retried: the transaction is the caller's, which may
    hold work of its own that only the caller can run again."""

    def __init__(self, engine: Engine, begin: Callable[[], AbstractContextManager[Any]]) -> None:
        super().__init__(engine, "")
        self.begin = begin

    def get(self) -> Any:
        raise TypeError("a store on its caller's transactions opens no connection of its own")

    def drop(self) -> None:
        """The connection is the caller's to close."""

    @contextmanager
    def transaction(self, *, alone: bool = False, ddl: bool = False) -> Iterator[Any]:
        with self.begin() as cursor:
            yield cursor

    def run(self, operation: str, work: Callable[[Any], T], *, attempts: int, alone: bool = False,
            ddl: bool = False) -> T:
        with self.begin() as cursor:
            return work(cursor)
