"""The outbox's stores on every engine (a pytest plugin, registered in tests/conftest.py):
``kind`` runs a test once per engine, ``store`` gives it a migrated store on a table of
its own (dropped afterwards), ``writer`` the application's connection to it. Test modules
find the fixtures by name and import the helpers: ``engine_url``, ``mssql_url`` and
``mssql_python_url``, and
rows written as the application would (``add``), read (``row``, ``statuses``) and
tampered with raw SQL (``tamper``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import MSSQL_URL, MYSQL_URL, POSTGRES_URL, require, unavailable

from outbox import enqueue
from outbox.storage.engines.mysql import MysqlEngine
from outbox.storage.store import OutboxStore

ENGINES = ["sqlite", "postgresql", "mysql", "mssql"]
#: MariaDB/MySQL on mysqlclient (``MySQLdb``, Django's default MySQL driver) instead of PyMySQL:
#: the same server, the store's own connections and ``writer`` mysqlclient's (``MysqlclientEngine``).
#: A module runs it by listing it in its own ``kind`` fixture (tests/test_store_conformance.py).
MYSQLCLIENT = "mysqlclient"


def require_mysqlclient() -> None:
    """Skip (or, under OUTBOX_REQUIRE_SERVICES, fail: CI installs it) without mysqlclient."""
    try:
        import MySQLdb  # noqa: F401
    except ImportError as exc:
        unavailable(f"mysqlclient (MySQLdb) cannot be imported ({exc}); it builds from source against "
                    "libmariadb-dev (or default-libmysqlclient-dev) with pkg-config and a C compiler, "
                    "as .ci/run installs it: pip install 'mysqlclient>=2.2'")


class MysqlclientEngine(MysqlEngine):
    """The MySQL engine whose own connections are mysqlclient's, set up as ``MysqlEngine.connect``
    sets up PyMySQL's (READ COMMITTED, the session bounds): the store's SQL, results and errors
    through the driver a Django project on MySQL hands to ``enqueue`` and the admin's requeue."""

    def connect(self, url: str) -> Any:
        import MySQLdb

        from outbox.core.config import session_bounds
        from outbox.storage.engines.mysql import CONNECT_TIMEOUT_S, pymysql_kwargs, session_sql

        kwargs = {k: v for k, v in pymysql_kwargs(url).items() if k in
                  ("host", "port", "user", "password", "database", "charset", "unix_socket")}
        conn = MySQLdb.connect(**kwargs, autocommit=False, connect_timeout=CONNECT_TIMEOUT_S,
                               init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        cursor = conn.cursor()
        cursor.execute(session_sql(conn.get_server_info(), **session_bounds(url)))
        cursor.close()
        conn.commit()
        return conn


def engine_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'outbox.db'}"
    if kind == "postgresql":
        require("PostgreSQL", "127.0.0.1", 5432)
        return POSTGRES_URL
    if kind in ("mysql", MYSQLCLIENT):
        require("MariaDB/MySQL", "127.0.0.1", 3306)
        if kind == MYSQLCLIENT:
            require_mysqlclient()
        return MYSQL_URL
    if kind == "mssql":
        return mssql_url()
    if kind == "mssql-python":
        return mssql_python_url(mssql_url())
    raise ValueError(kind)


def mssql_python_url(base: str) -> str:
    """``base`` (a pyodbc URL) for mssql-python: the same server, login and database."""
    from outbox.storage.engines.mssql.driver import mssql_python_url as rewrite

    if "://" not in base:
        pytest.skip("OUTBOX_TEST_MSSQL_URL is a raw ODBC string; the mssql-python URL is built from a URL")
    pytest.importorskip("mssql_python")
    return rewrite(base)


_mssql: dict[str, Any] = {}


def mssql_url() -> str:
    """SQL Server for the suite: OUTBOX_TEST_MSSQL_URL, else a testcontainers
    container (started once per session) where a Docker engine answers, else skip."""
    if MSSQL_URL:
        return MSSQL_URL
    if "url" in _mssql or "skip" in _mssql:
        if "skip" in _mssql:
            pytest.skip(_mssql["skip"])
        return _mssql["url"]
    reason = docker_unavailable()
    if reason:
        _mssql["skip"] = f"no SQL Server here: set OUTBOX_TEST_MSSQL_URL ({reason})"
        pytest.skip(_mssql["skip"])
    import atexit

    import pyodbc
    from testcontainers.community.mssql import SqlServerContainer

    container = SqlServerContainer("mcr.microsoft.com/mssql/server:2022-latest", dialect="mssql+pyodbc")
    container.start()
    atexit.register(container.stop)
    drivers = pyodbc.drivers()
    driver = next((d for d in drivers if "ODBC Driver" in d and "SQL Server" in d), "FreeTDS")
    extra = "TrustServerCertificate=yes" if driver != "FreeTDS" else "TDS_Version=7.4"
    host, port = container.get_container_host_ip(), container.get_exposed_port(1433)
    _mssql["url"] = (f"mssql+pyodbc://SA:{container.password}@{host}:{port}/tempdb"
                     f"?driver={driver.replace(' ', '+')}&{extra}")
    return _mssql["url"]


def docker_unavailable() -> str | None:
    """Why testcontainers cannot run here, or None when it can."""
    try:
        import docker
        import testcontainers.community.mssql  # noqa: F401
    except ImportError:
        return "testcontainers is not installed"
    try:
        docker.from_env(timeout=3).ping()
    except Exception:
        return "no Docker engine answers for testcontainers"
    return None


def drop_table(store: OutboxStore) -> None:
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
        store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.holders}")


@pytest.fixture(params=ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def url(kind: str, tmp_path: Path) -> str:
    return engine_url(kind, tmp_path)


@pytest.fixture
def make_store(url: str, kind: str) -> Iterator[Any]:
    """Build migrated stores on a per-test table; every one is dropped afterwards."""
    made: list[OutboxStore] = []

    def make(*, table: str | None = None, **options: Any) -> OutboxStore:
        name = table or f"outbox_t{uuid.uuid4().hex[:10]}"
        options.setdefault("claim_timeout_ms", 60_000)
        options.setdefault("max_attempts", 3)
        if kind == MYSQLCLIENT:
            options.setdefault("engine", MysqlclientEngine(table=name))
        store = OutboxStore(url, table=name, **options)
        store.migrate()
        made.append(store)
        return store

    yield make
    for store in made:
        try:
            drop_table(store)
        finally:
            store.close()


@pytest.fixture
def store(make_store: Any) -> OutboxStore:
    return make_store()


@pytest.fixture
def writer(store: OutboxStore, url: str) -> Iterator[Any]:
    """A plain DB-API connection playing the application that enqueues."""
    if store.engine.name == "sqlite":  # an application's connection: implicit transactions
        import sqlite3

        from outbox.storage.engines.sqlite import sqlite_path
        conn = sqlite3.connect(sqlite_path(url), timeout=30)
    else:
        conn = store.engine.connect(url)
    yield conn
    try:
        conn.rollback()
    finally:
        conn.close()


# -- rows: written as the application would, read and tampered with raw SQL -------------------

def add(writer: Any, store: OutboxStore, aggregate: str, count: int = 1, commit: bool = True,
        **kw: Any) -> list[int]:
    ids = [enqueue(writer, topic=kw.pop("topic", "orders.created") if i == 0 else "orders.created",
                   aggregate_type="order", aggregate_id=aggregate, payload=kw.get("payload", {"n": i}),
                   message_id=kw.get("message_id"), headers=kw.get("headers"), key=kw.get("key"),
                   table=store.engine.table_name)
           for i in range(count)]
    if commit:
        writer.commit()
    return ids


def statuses(store: OutboxStore) -> dict[int, int]:
    with store.transaction() as cursor:
        rows = store.engine.execute(cursor, f"SELECT id, status FROM {store.engine.table}").fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


def row(store: OutboxStore, id: int, columns: str) -> tuple:
    with store.transaction() as cursor:
        return tuple(store.engine.execute(
            cursor, f"SELECT {columns} FROM {store.engine.table} WHERE id = ?", [id]).fetchone())


def allow_null(store: OutboxStore, column: str) -> None:
    """Drop the NOT NULL of ``column``, as a table made by another script might lack it."""
    e = store.engine
    with store.transaction() as cursor:
        if e.name == "mssql":  # the same type, length and collation, NULL allowed; its indexes made again
            name, length, collation = e.execute(
                cursor, "SELECT TYPE_NAME(system_type_id), max_length, collation_name FROM sys.columns "
                        "WHERE object_id = OBJECT_ID(?) AND name = ?", [e.table, column]).fetchone()
            indexes = [r[0] for r in e.execute(
                cursor, "SELECT DISTINCT i.name FROM sys.indexes AS i INNER JOIN sys.index_columns AS ic "
                        "ON ic.object_id = i.object_id AND ic.index_id = i.index_id INNER JOIN sys.columns AS c "
                        "ON c.object_id = ic.object_id AND c.column_id = ic.column_id "
                        "WHERE i.object_id = OBJECT_ID(?) AND c.name = ? AND i.is_primary_key = 0",
                [e.table, column]).fetchall()]
            for index in indexes:
                e.execute(cursor, f"DROP INDEX {e.quote(index)} ON {e.table}")
            size = "MAX" if int(length) == -1 else str(int(length) // (2 if name.startswith("n") else 1))
            e.execute(cursor, f"ALTER TABLE {e.table} ALTER COLUMN {column} {name}({size}) COLLATE {collation} NULL")
        elif e.name == "postgresql":
            e.execute(cursor, f"ALTER TABLE {e.table} ALTER COLUMN {column} DROP NOT NULL")
        elif e.name == "mysql":
            e.execute(cursor, f"ALTER TABLE {e.table} MODIFY {column} VARCHAR(255) NULL")
        else:  # SQLite cannot drop a NOT NULL: rewrite the table's definition in place
            cursor.execute("PRAGMA writable_schema = ON")
            cursor.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) WHERE type = 'table' AND name = ?",
                           (f"{column} TEXT NOT NULL", f"{column} TEXT NULL", e.table_name))
            version = cursor.execute("PRAGMA schema_version").fetchone()[0]
            cursor.execute(f"PRAGMA schema_version = {int(version) + 1}")
            cursor.execute("PRAGMA writable_schema = OFF")
    if e.name == "mssql":
        store.migrate()  # the indexes dropped above
    store.close()  # new connections read the new definition


def tamper(store: OutboxStore, id: int, column: str, value: str | None) -> None:
    """Overwrite one column of one row with raw SQL, past the table's JSON checks where the
    engine allows that (SQLite's CHECK, SQL Server's constraints; PostgreSQL's jsonb and
    MySQL's JSON types refuse invalid JSON whatever one does)."""
    e = store.engine
    if value is None:
        allow_null(store, column)
    with store.transaction() as cursor:
        if e.name == "sqlite":
            cursor.execute("PRAGMA ignore_check_constraints = ON")
        elif e.name == "mssql":
            e.execute(cursor, f"ALTER TABLE {e.table} NOCHECK CONSTRAINT ALL")
        e.execute(cursor, f"UPDATE {e.table} SET {column} = ? WHERE id = ?", [value, id])
        if e.name == "sqlite":
            cursor.execute("PRAGMA ignore_check_constraints = OFF")
