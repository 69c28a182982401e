"""Engine modules, one per database, and the two ways of finding one: by database
URL (the relay) and by connection object (``enqueue``)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any

from ...core.checks import database_scheme
from ...core.errors import ConfigError, UnsupportedConnection
from .base import Engine


def engine_class(kind: str) -> type[Engine]:
    if kind == "sqlite":
        from .sqlite import SqliteEngine
        return SqliteEngine
    if kind == "postgresql":
        from .postgres import PostgresEngine
        return PostgresEngine
    if kind == "mysql":
        from .mysql import MysqlEngine
        return MysqlEngine
    if kind == "mssql":
        from .mssql import MssqlEngine
        return MssqlEngine
    raise ConfigError(f"OUTBOX_DATABASE_URL: unsupported database {kind!r}")


def kind_of_url(url: str) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    base = database_scheme(url)  # the start-up check's rule
    if base == "sqlite":
        return "sqlite"
    if base in ("postgresql", "postgres"):
        return "postgresql"
    if base in ("mysql", "mariadb"):
        return "mysql"
    if base in ("mssql", "sqlserver") or (not scheme and "driver=" in url.lower()):
        mssql_driver(url)  # an unknown driver is a configuration error now, not at first connect
        return "mssql"
    raise ConfigError(f"OUTBOX_DATABASE_URL: unsupported database URL scheme {scheme or url!r} "
                      "(use sqlite:///, postgresql://, mysql://, mssql+pyodbc:// or mssql+mssqlpython://)")


def mssql_driver(url: str) -> str:
    """The driver module a SQL Server URL selects: pyodbc for ``mssql://``,
    ``mssql+pyodbc://`` and raw ODBC strings, mssql_python for
    ``mssql+mssqlpython://``. One engine serves both; only driver quirks differ."""
    from .mssql import driver_of_url
    try:
        return driver_of_url(url)
    except ValueError as exc:
        raise ConfigError(f"OUTBOX_DATABASE_URL: {exc}") from None


#: The DB-API module each engine connects with (SQL Server's: ``mssql_driver``).
DRIVER_MODULES = {"sqlite": "sqlite3", "postgresql": "psycopg", "mysql": "pymysql"}


def import_engine(url: str) -> None:
    """Import the engine of ``url`` and the driver it connects with, connecting nothing (a
    worker's main process before its pool forks: docs/internals.md, "Worker processes"). A
    missing driver is left to the first connect, which names the extra to install."""
    kind = kind_of_url(url)
    engine_class(kind)
    with contextlib.suppress(ImportError):
        importlib.import_module(mssql_driver(url) if kind == "mssql" else DRIVER_MODULES[kind])


def engine_for_url(url: str, *, table: str = "outbox", schema: str | None = None) -> Engine:
    return engine_class(kind_of_url(url))(table=table, schema=schema)


_MODULE_KINDS = {"sqlite3": "sqlite", "psycopg": "postgresql", "pymysql": "mysql", "MySQLdb": "mysql",
                 "pyodbc": "mssql", "mssql_python": "mssql"}
DJANGO_VENDORS = {"sqlite": "sqlite", "postgresql": "postgresql", "mysql": "mysql", "microsoft": "mssql"}


def _one_database(session: Any) -> None:
    """A Session whose ``binds`` send models to several databases has no one connection for
    the event: its default one may not be where the business rows commit, and the two then
    commit apart (found in review: the order in one database, its event in another)."""
    binds = getattr(session, "binds", None) or {}
    engines = {id(bind) for bind in binds.values()} | ({id(session.bind)} if getattr(session, "bind", None) else set())
    if len(engines) > 1:
        raise UnsupportedConnection(
            "this SQLAlchemy Session binds models to several databases: pass the connection of the one your "
            "rows go to, session.connection(bind_arguments={'mapper': YourModel}), so the event commits with them")


def _synchronous(conn: Any) -> None:
    """An asyncio connection (psycopg's AsyncConnection, SQLAlchemy's AsyncSession and
    AsyncConnection, any whose ``commit`` is a coroutine function) is refused: enqueue writes
    synchronously, and its calls would only make coroutines, never awaited (README, "Write side")."""
    if inspect.iscoroutinefunction(getattr(conn, "commit", None)):
        raise UnsupportedConnection(
            f"enqueue needs a synchronous connection; got the asyncio {type(conn).__module__}.{type(conn).__name__}, "
            "whose calls return coroutines that enqueue cannot await. From async code, write the business rows "
            "and the event in one transaction on a synchronous connection (psycopg.connect, a SQLAlchemy "
            "create_engine Session) run in a thread: await asyncio.to_thread(your_function)")


def unwrap_connection(conn: Any) -> tuple[str, Any]:
    """Return (engine kind, DB-API connection) for anything ``enqueue`` accepts:
    a DB-API connection, a Django connection, or a SQLAlchemy Connection/Session."""
    _synchronous(conn)
    # SQLAlchemy Session -> its Connection in the current transaction.
    if type(conn).__module__.startswith("sqlalchemy") and hasattr(conn, "get_bind") and hasattr(conn, "connection"):
        _one_database(conn)
        conn = conn.connection()
    # SQLAlchemy Connection -> the pooled DB-API connection it runs on.
    if type(conn).__module__.startswith("sqlalchemy") and hasattr(conn, "connection"):
        _synchronous(getattr(conn.connection, "driver_connection", None))  # an asyncio engine's (run_sync)
        # The insert bypasses conn.execute(), so SQLAlchemy would not know a transaction is
        # open: a later conn.commit() would do nothing and the pool's reset on close would
        # roll the event back. Begin as conn.execute() would (autobegin), so it does.
        in_transaction = getattr(conn, "in_transaction", None)
        if callable(in_transaction) and not in_transaction():
            conn.begin()
        raw = conn.connection
        conn = getattr(raw, "dbapi_connection", None) or getattr(raw, "driver_connection", raw)
    # Django's DatabaseWrapper.
    vendor = getattr(conn, "vendor", None)
    if isinstance(vendor, str) and hasattr(conn, "ensure_connection"):
        kind = DJANGO_VENDORS.get(vendor)
        if kind is None:
            raise UnsupportedConnection(f"Django database vendor {vendor!r} is not supported")
        conn.ensure_connection()
        raw = conn.connection
        if type(raw).__module__.startswith("psycopg2"):  # Django's fallback when psycopg (3) is missing
            raise UnsupportedConnection(
                "Django's PostgreSQL connection runs on psycopg2, which enqueue does not support: install "
                "psycopg 3 (the postgres extra), which Django then uses instead")
        return kind, raw
    root = type(conn).__module__.split(".", 1)[0]
    kind = _MODULE_KINDS.get(root)
    if kind is None:
        raise UnsupportedConnection(
            f"enqueue needs an open DB-API connection (sqlite3, psycopg, PyMySQL, pyodbc, mssql-python), "
            "a Django connection "
            f"or a SQLAlchemy Connection/Session; got {type(conn).__module__}.{type(conn).__name__}")
    if not hasattr(conn, "cursor"):  # a DB-API cursor: refused, not unwrapped (README, "Write side")
        raise UnsupportedConnection(
            f"enqueue needs the connection, not a cursor: got {type(conn).__module__}.{type(conn).__name__}; "
            "pass the cursor's connection (cursor.connection)")
    return kind, conn


__all__ = ["DJANGO_VENDORS", "DRIVER_MODULES", "Engine", "engine_class", "engine_for_url", "import_engine", "kind_of_url",
           "mssql_driver", "unwrap_connection"]
