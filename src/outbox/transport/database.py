"""The broker's database: one DB-API connection per process for a transport, shared by its
channels (``storage.connections``: short transactions, transient retries, dropped on
disconnect), the queue tables created or checked once per process, and the PostgreSQL
wake-up connection idle receivers wait on."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


#: A statement the server cancelled (PostgreSQL's statement_timeout or pg_cancel_backend
#: 57014, MySQL/MariaDB's KILL QUERY or max_statement_time 70100, ODBC's HY008) or refused
#: because the server is read-only (25006: a failover's old primary): retried on a new
#: connection, which finds the primary (docs/transport.md, "Receiving and polling").
_CANCELLED_OR_READ_ONLY_SQLSTATES = {"57014", "70100", "HY008", "25006"}
#: The same as MySQL/MariaDB error codes whose SQLSTATE is the generic HY000: --read-only
#: (1290), read-only mode (1836), max_execution_time (3024); 1317, 1792 and 1969 for drivers
#: that carry no SQLSTATE.
_CANCELLED_OR_READ_ONLY_MYSQL_CODES = {1290, 1317, 1792, 1836, 1969, 3024}
#: SQLite's generic error code (SQL error, missing table): a programming error, though
#: sqlite3 raises it as OperationalError.
_SQLITE_ERROR = 1


def sqlstate_of(exc: BaseException) -> str | None:
    """The error's SQLSTATE: psycopg's and PyMySQL's ``sqlstate``, pyodbc's first argument."""
    state = getattr(exc, "sqlstate", None)
    if state is None and exc.args and isinstance(exc.args[0], str) and len(exc.args[0]) == 5:
        state = exc.args[0]
    return state if isinstance(state, str) else None


def cancelled_or_read_only(exc: BaseException) -> bool:
    """The server cancelled the statement or refused it as read-only (worth a new connection)."""
    if sqlstate_of(exc) in _CANCELLED_OR_READ_ONLY_SQLSTATES:
        return True
    code = exc.args[0] if exc.args else None
    return (isinstance(code, int) and code in _CANCELLED_OR_READ_ONLY_MYSQL_CODES
            and type(exc).__module__.split(".", 1)[0] in ("pymysql", "MySQLdb"))


def programming_error(exc: BaseException) -> bool:
    """Bad SQL or a missing object, which a reconnect cannot mend: SQLSTATE class 42 (PyMySQL
    raises an unknown column as OperationalError), SQLite's generic error."""
    state = sqlstate_of(exc)
    if state is not None and state.startswith("42"):
        return True
    return getattr(exc, "sqlite_errorcode", None) == _SQLITE_ERROR


class BrokerConnections(Connections):
    """The store's connection lifecycle, with a cancelled or read-only statement retried too,
    on a new connection (``cancelled_or_read_only``)."""

    def retryable(self, exc: BaseException, *, ddl: bool = False) -> bool:
        return super().retryable(exc, ddl=ddl) or cancelled_or_read_only(exc)

    @contextmanager
    def transaction_on(self, conn: Any, *, alone: bool = False, ddl: bool = False) -> Iterator[Any]:
        try:
            with super().transaction_on(conn, alone=alone, ddl=ddl) as cursor:
                yield cursor
        except Exception as exc:
            if cancelled_or_read_only(exc):
                self.drop()  # read-only: this server is no longer the primary
            raise


def is_own_database(hostname: str | None) -> bool:
    """Does the broker URL (kombu's hostname, ``outboxdb+`` stripped) name the outbox's own
    database: a bare ``outboxdb://``?"""
    return not hostname or hostname.startswith(f"{SCHEME}:") or "://" not in hostname and "=" not in hostname


def database_url_of(hostname: str | None) -> str:
    """The database URL behind a broker URL. kombu strips ``outboxdb+`` before the
    transport sees it; a bare ``outboxdb://`` means the outbox's own database
    (OUTBOX_DATABASE_URL)."""
    if not hostname or is_own_database(hostname):
        from ..core.config import get_settings
        return get_settings().database_url
    try:
        kind_of_url(hostname)
    except ConfigError as exc:
        detail = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"Celery broker URL {SCHEME}+...: {detail}") from None
    return hostname


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without the password of its user info, and that password as written (None when
    there is none). kombu keeps the database URL whole as the connection's hostname, which
    Celery's ``inspect stats`` replies with; its password field it leaves out
    (``Transport.__init__``)."""
    from urllib.parse import urlsplit

    prefix, sep, _ = url.partition("://")
    try:
        parts = urlsplit(url)
        netloc, password = parts.netloc, parts.password
    except ValueError:
        return url, None
    if not sep or password is None:
        return url, None
    userinfo, _, hosts = netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    rest = url[len(prefix) + len(sep) + len(netloc):]
    return f"{prefix}{sep}{user}@{hosts}{rest}", password


def with_password(url: str, password: str | None) -> str:
    """``split_password``'s inverse: ``password`` put back after the user of ``url``."""
    prefix, sep, rest = url.partition("://")
    if not password or not sep or "@" not in rest.split("/", 1)[0]:
        return url
    return f"{prefix}{sep}{rest.replace('@', f':{password}@', 1)}"


class Database:
    """One DB-API connection per process for a transport, shared by its channels under a
    lock (acks may come from pool threads): ``storage.connections``. Each ``run`` is one
    short transaction, retried on transient errors; out of retries, a lost database is
    raised as ``BrokerDatabaseUnavailable`` for kombu to reconnect."""

    #: Retries after the first attempt.
    RETRIES = 3

    def __init__(self, url: str, table: str, schema: str | None, create: bool, wake: bool = True,
                 check: bool = True) -> None:
        """``create``: migrate the tables on the process's first connection; ``check``: warn
        there about missing indexes (off for ``outbox migrate``, which makes them next)."""
        self.url = url
        self.check = check
        self.engine = engine_for_url(url, schema=schema)
        self.qt = queue_tables(self.engine, table)
        self.create = create
        self.wake = wake
        self.connections = BrokerConnections(self.engine, url, per_thread=False, on_connect=self._set_up)
        #: The driver's connection-level errors (OperationalError, InterfaceError).
        self.driver_errors = driver_errors(url)[0]
        self._waiter: Any = None
        self._waiter_pid = 0
        self._waiter_retry_at = 0.0
        #: A ``run`` ran out of retries since the transport's connection was established: set
        #: for good, whatever succeeds after it on other threads (``Transport.lost_database``).
        self.lost = False

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
            if waiter is not None:
                # Listening from now on: what was sent since the last look woke nobody, so look
                # again before waiting (each consumer's start opens a new LISTEN connection, the
                # last one's cancel closes it: a remote-control reply sent in between went unseen
                # for the whole wait, and `inspect()` timed out; docs/transport.md).
                return True
        if waiter is None:
            time.sleep(timeout)
            return False
        try:
            return waiter.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - any failure of the waiter: reconnect
            return self._waiter_lost(exc)

    def read_wake_ups(self) -> bool:
        """Read what the wake-up connection has received, without blocking (every poll does,
        so a consumer that never waits idle still reads it): True if a send woke us."""
        waiter = self._waiter if self._waiter_pid == os.getpid() else None
        if waiter is None:
            return False
        try:
            return waiter.drain()
        except Exception as exc:  # noqa: BLE001 - any failure of the waiter: reconnect
            return self._waiter_lost(exc)

    def _waiter_lost(self, exc: BaseException) -> bool:
        """The wake-up connection failed: closed, another tried in a second; no wake-up (False)."""
        log.warning("outboxdb: wake-up connection lost (%s); reconnecting", exc)
        self._close_waiter()
        self._waiter_retry_at = time.monotonic() + 1.0
        return False

    def stop_listening(self) -> None:
        """No consumer left: close the wake-up connection, which nothing would read (the next
        idle wait opens another)."""
        self._close_waiter()

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
        needs that is missing. The migration runs DDL only for what is missing; a step that
        waits too long for a lock on a live table (an open transaction that sent to it) is
        given up, with a warning, for the next process or ``outbox migrate``: while it waits,
        every send, lease and ack queues behind it (docs/transport.md, "Table layout")."""
        self._on(conn, self.qt.session_setup)
        key = (self.url, self.qt.table)
        if not (self.create or self.check):
            return
        with _prepared_lock:
            if key in _prepared:
                return
            migrated = True
            if self.create:
                try:
                    self._on(conn, lambda cursor: self.qt.migrate(cursor, start_up=True), ddl=True)
                except Exception as exc:
                    if not self.engine.is_transient(exc) or self.engine.is_disconnect(exc):
                        raise
                    log.warning("outboxdb: the start-up migration of %s waited too long for a lock (%s: %s); "
                                "skipped. Run `outbox migrate` (with OUTBOX_CELERY_BROKER_URL set).",
                                self.qt.table, type(exc).__name__, exc)
                    migrated = False
            missing = self._on(conn, self.qt.missing_indexes)
            for name in missing:
                log.warning("outboxdb: index %s on %s is missing; receiving and purging will scan the table. "
                            "Run `outbox migrate` (with OUTBOX_CELERY_BROKER_URL set) to create it.",
                            name, self.qt.table)
            if migrated:
                _prepared.add(key)

    def _on(self, conn: Any, work: Callable[[Any], T], *, ddl: bool = False) -> T:
        with self.connections.transaction_on(conn, ddl=ddl) as cursor:
            return work(cursor)

    def run(self, work: Callable[[QueueTables, Any], T], *, alone: bool = False, ddl: bool = False) -> T:
        """``work(queue tables, cursor)`` in one short transaction. A dropped connection, a
        server restart, a deadlock victim, a cancelled or read-only statement: it runs again,
        on a fresh connection if need be (a send whose commit was cut off may then be stored
        twice: at least once). Out of retries, the error is raised as
        BrokerDatabaseUnavailable, one of the Transport class's connection_errors whatever the
        driver: kombu and Celery reconnect. So is any other operational error of the driver
        (a full disk, too many connections): raised as itself it stopped the worker. Bad SQL
        is raised as itself.
        ``alone``: ``work`` runs statements each atomic by itself, which the engine may run
        as transactions of their own, one round trip each (``Connections.transaction``:
        docs/transport.md, "A network cut")."""
        try:
            result = self.connections.run("broker", lambda cursor: work(self.qt, cursor), attempts=self.RETRIES + 1,
                                          alone=alone, ddl=ddl)
        except Exception as exc:
            if not (self.connections.retryable(exc)
                    or isinstance(exc, self.driver_errors) and not programming_error(exc)):
                raise
            self.connections.drop()
            self.lost = True
            raise BrokerDatabaseUnavailable(
                f"outboxdb: the broker's database is unavailable ({type(exc).__name__}: {exc})") from exc
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
