"""Fixtures shared by the suite: one store per test on every engine, each test with
a table of its own so tests never see each other's rows."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from outbox.core.config import reset_settings  # noqa: E402
from outbox.storage.store import OutboxStore  # noqa: E402
from services import MSSQL_URL, MYSQL_URL, POSTGRES_URL, require  # noqa: E402

ENGINES = ["sqlite", "postgresql", "mysql", "mssql"]


def engine_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'outbox.db'}"
    if kind == "postgresql":
        require("PostgreSQL", "127.0.0.1", 5432)
        return POSTGRES_URL
    if kind == "mysql":
        require("MariaDB/MySQL", "127.0.0.1", 3306)
        return MYSQL_URL
    if kind == "mssql":
        return mssql_url()
    raise ValueError(kind)


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


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("OUTBOX_") and not name.startswith("OUTBOX_TEST_") and name != "OUTBOX_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    reset_settings()
    yield
    reset_settings()


@pytest.fixture(params=ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def url(kind: str, tmp_path: Path) -> str:
    return engine_url(kind, tmp_path)


@pytest.fixture
def make_store(url: str) -> Iterator[Any]:
    """Build migrated stores on a per-test table; every one is dropped afterwards."""
    made: list[OutboxStore] = []

    def make(*, table: str | None = None, **options: Any) -> OutboxStore:
        name = table or f"outbox_t{uuid.uuid4().hex[:10]}"
        options.setdefault("claim_timeout_ms", 60_000)
        options.setdefault("max_attempts", 3)
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """When a test fails, show the logs its child processes wrote (``*.log`` in its
    tmp_path: workers, beat, web apps), so a failure under load explains itself."""
    outcome = yield
    report = outcome.get_result()
    if report.passed or report.skipped:
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp, Path) or not tmp.is_dir():
        return
    for log in sorted(tmp.rglob("*.log"))[:10]:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        report.sections.append((f"child log {log.relative_to(tmp)} (last 6000 characters)", text[-6000:]))
