"""The broker's database: one DB-API connection per process for a transport, shared by its
channels (``storage.connections``: short transactions, transient retries, dropped on
disconnect), the queue tables created or checked once per process, and the PostgreSQL
wake-up connection idle receivers wait on."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.errors import BrokerDatabaseUnavailable, ConfigError
from ..storage.connections import Connections
from ..storage.engines import engine_for_url, kind_of_url, mssql_driver
from .options import SCHEME
from .tables import queue_tables
from .tables.base import QueueTables

log = logging.getLogger("outbox.transport")
T = TypeVar("T")


#: Tables already migrated/checked in this process: (database URL, table).
_prepared: set[tuple[str, str]] = set()
_prepared_lock = threading.Lock()
#: Receipts of leases whose every try failed, which may have committed: (url, table, queue) ->
#: receipt. Kept per process, not per transport: Celery reconnects on a new one
#: (docs/transport.md, "A lease whose COMMIT's answer is lost").
_doubtful: dict[tuple[str, str, str], str] = {}
_doubtful_lock = threading.Lock()


def database_url_of(hostname: str | None) -> str:
    """The database URL behind a broker URL. kombu strips ``outboxdb+`` before the
    transport sees it; a bare ``outboxdb://`` means the outbox's own database
    (OUTBOX_DATABASE_URL)."""
    if not hostname or hostname.startswith(f"{SCHEME}:") or "://" not in hostname and "=" not in hostname:
        from ..core.config import get_settings
        return get_settings().database_url
    try:
        kind_of_url(hostname)
    except ConfigError as exc:
        detail = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"Celery broker URL {SCHEME}+...: {detail}") from None
    return hostname


class Database:
    """One DB-API connection per process for a transport, shared by its channels under a
    lock (acks may come from pool threads): ``storage.connections``. Each ``run`` is one
    short transaction, retried on transient errors; out of retries, a lost database is
    raised as ``BrokerDatabaseUnavailable`` for kombu to reconnect."""

    #: Retries after the first attempt.
    RETRIES = 3

    def __init__(self, url: str, table: str, schema: str | None, create: bool, wake: bool = True) -> None:
        self.url = url
        self.engine = engine_for_url(url, schema=schema)
        self.qt = queue_tables(self.engine, table)
        self.create = create
        self.wake = wake
        self.connections = Connections(self.engine, url, per_thread=False, on_connect=self._set_up)
        self._waiter: Any = None
        self._waiter_pid = 0
        self._waiter_retry_at = 0.0
        #: False from a ``run`` that ran out of retries until one succeeds (``QoS.restore_unacked``).
        self.available = True

    def doubt(self, queue: str, receipt: str) -> None:
        """A lease of ``queue`` under ``receipt`` failed every try: it may have committed."""
        with _doubtful_lock:
            _doubtful[(self.url, self.qt.table, queue)] = receipt

    def doubtful(self, queue: str) -> str | None:
        """The receipt of this process's last lease of ``queue`` that may have committed
        unbeknown to it, once (the next lease takes back what it holds)."""
        with _doubtful_lock:
            return _doubtful.pop((self.url, self.qt.table, queue), None)

    def wait(self, timeout: float) -> bool:
        """Idle: block until a send wakes us (PostgreSQL LISTEN) or ``timeout`` passes.
        Engines without wake-ups, and a waiter that failed, sleep instead."""
        waiter = self._waiter if self._waiter_pid == os.getpid() else None
        if waiter is None and self.wake and time.monotonic() >= self._waiter_retry_at:
            try:
                self.connection()  # tables exist before anyone listens
                waiter = self.qt.open_waiter(self.url)
            except Exception as exc:  # noqa: BLE001 - any failure to listen: polling only for a while
                log.warning("outboxdb: cannot listen for wake-ups (%s); polling only for a while", exc)
                self._waiter_retry_at = time.monotonic() + 30.0
                waiter = None
            self._waiter, self._waiter_pid = waiter, os.getpid()
            if waiter is None and not self._waiter_retry_at:
                self.wake = False  # this engine has none: stop asking
        if waiter is None:
            time.sleep(timeout)
            return False
        try:
            return waiter.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - any failure of the waiter: reconnect
            log.warning("outboxdb: wake-up connection lost (%s); reconnecting", exc)
            self._close_waiter()
            self._waiter_retry_at = time.monotonic() + 1.0
            return False

    def wakes_on_send(self) -> bool:
        """Sends wake this table's idle receivers now (PostgreSQL with a working LISTEN)."""
        return bool(self.wake) and self.qt.wakes_on_send and time.monotonic() >= self._waiter_retry_at

    def _close_waiter(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and self._waiter_pid == os.getpid():
            waiter.close()

    def connection(self) -> Any:
        return self.connections.get()

    def _set_up(self, conn: Any) -> None:
        """A new connection: the queue tables' session set-up, then (once per process) create
        or only check the tables, and warn about every index the receive loop or the purge
        needs that is missing."""
        self._on(conn, self.qt.session_setup)
        key = (self.url, self.qt.table)
        with _prepared_lock:
            if key in _prepared:
                return
            if self.create:
                self._on(conn, self.qt.migrate, ddl=True)
            missing = self._on(conn, self.qt.missing_indexes)
            for name in missing:
                log.warning("outboxdb: index %s on %s is missing; receiving and purging will scan the table. "
                            "Run `outbox migrate` (with OUTBOX_CELERY_BROKER_URL set) to create it.",
                            name, self.qt.table)
            _prepared.add(key)

    def _on(self, conn: Any, work: Callable[[Any], T], *, ddl: bool = False) -> T:
        with self.connections.transaction_on(conn, ddl=ddl) as cursor:
            return work(cursor)

    def run(self, work: Callable[[QueueTables, Any], T], *, alone: bool = False, ddl: bool = False) -> T:
        """``work(queue tables, cursor)`` in one short transaction. A dropped connection, a
        server restart, a deadlock victim: it runs again, on a fresh connection if need be
        (a send whose commit was cut off may then be stored twice: at least once). Out of
        retries, the error is raised as BrokerDatabaseUnavailable, one of the Transport
        class's connection_errors whatever the driver: kombu and Celery reconnect.
        ``alone``: ``work`` runs statements each atomic by itself, which the engine may run
        as transactions of their own, one round trip each (``Connections.transaction``:
        docs/transport.md, "A network cut")."""
        try:
            result = self.connections.run("broker", lambda cursor: work(self.qt, cursor), attempts=self.RETRIES + 1,
                                          alone=alone, ddl=ddl)
        except Exception as exc:
            if not self.connections.retryable(exc):
                raise
            self.connections.drop()
            self.available = False
            raise BrokerDatabaseUnavailable(
                f"outboxdb: the broker's database is unavailable ({type(exc).__name__}: {exc})") from exc
        self.available = True
        return result

    def run_counting(self, work: Callable[[QueueTables, Any, int], T], *, alone: bool = False) -> tuple[T, int]:
        """``run`` for work that must know which try it is (``work(queue tables, cursor, try)``,
        the first try 1): a retry after a lost connection may follow a try whose COMMIT went
        through and only its answer was lost (docs/transport.md, "A lease whose COMMIT's answer
        is lost"). Returns the result and how many tries it took."""
        tries = 0

        def counted(qt: QueueTables, cursor: Any) -> T:
            nonlocal tries
            tries += 1
            return work(qt, cursor, tries)

        return self.run(counted, alone=alone), tries

    def close(self) -> None:
        self._close_waiter()
        self.connections.drop()


def driver_errors(url: str) -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(connection errors, channel errors) of the driver ``url`` selects, for kombu's retry
    logic (``mssql+mssqlpython://`` raises mssql-python's classes, not pyodbc's)."""
    kind = kind_of_url(url)
    try:
        if kind == "sqlite":
            import sqlite3
            return (sqlite3.OperationalError,), (sqlite3.DatabaseError,)
        if kind == "postgresql":
            import psycopg
            return (psycopg.OperationalError, psycopg.InterfaceError), (psycopg.DatabaseError,)
        if kind == "mysql":
            import pymysql
            return (pymysql.err.OperationalError, pymysql.err.InterfaceError), (pymysql.err.DatabaseError,)
        if kind == "mssql" and mssql_driver(url) == "mssql_python":
            import mssql_python
            return (mssql_python.OperationalError, mssql_python.InterfaceError), (mssql_python.DatabaseError,)
        if kind == "mssql":
            import pyodbc
            return (pyodbc.OperationalError, pyodbc.InterfaceError), (pyodbc.DatabaseError,)
    except ImportError:
        pass
    return (), ()
