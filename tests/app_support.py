"""What the example apps' tests share (tests/test_django_app.py, test_flask_alembic.py): a
database of each test's own, and a table's schema in the catalog's words to compare the
tables Django, Alembic and ``outbox migrate`` make. A pytest plugin (registered in
tests/conftest.py): test modules find the ``database`` fixture by name and import the helpers."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import MYSQL_URL, POSTGRES_URL, require


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """DATABASE_URL of a database of this test's own (dropped afterwards). ``mysql``, asked for
    by name: MariaDB/MySQL through Django's MySQL backend, which connects with mysqlclient."""
    if request.param == "sqlite":
        yield {"DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}", "kind": "sqlite"}
        return
    if request.param == "mysql":
        yield from mysql_database()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    import psycopg

    name = f"outbox_dj_{uuid.uuid4().hex[:10]}"
    admin_url = POSTGRES_URL.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield {"DATABASE_URL": POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}", "DJANGO_TEST_DATABASE_NAME": f"test_{name}",
               "kind": "postgresql"}
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'DROP DATABASE IF EXISTS "test_{name}" WITH (FORCE)')


def mysql_database() -> Iterator[dict[str, str]]:
    """``database`` on MariaDB/MySQL: a database and Django's test database of their own."""
    from engine_support import require_mysqlclient

    from outbox.storage.engines.mysql import MysqlEngine

    require("MariaDB/MySQL", "127.0.0.1", 3306)
    require_mysqlclient()
    name = f"outbox_dj_{uuid.uuid4().hex[:10]}"
    server = MYSQL_URL.rsplit("/", 1)[0]

    def run(statement: str) -> None:
        conn = MysqlEngine().connect(MYSQL_URL)
        try:
            cursor = conn.cursor()
            cursor.execute(statement)
            cursor.close()
        finally:
            conn.close()
    run(f"CREATE DATABASE `{name}`")
    try:
        yield {"DATABASE_URL": f"{server}/{name}", "DJANGO_TEST_DATABASE_NAME": f"test_{name}", "kind": "mysql"}
    finally:
        run(f"DROP DATABASE IF EXISTS `{name}`")
        run(f"DROP DATABASE IF EXISTS `test_{name}`")


def schema_of(url: str, table: str) -> Any:
    """What a table is made of, in the catalog's own words."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split("sqlite:///", 1)[1])
        try:
            return sorted(conn.execute("SELECT type, name, sql FROM sqlite_master WHERE tbl_name = ?",
                                       (table,)).fetchall())
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url) as conn:
        columns = conn.execute("SELECT column_name, data_type, is_nullable, column_default FROM "
                               "information_schema.columns WHERE table_name = %s ORDER BY column_name",
                               (table,)).fetchall()
        indexes = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname",
                               (table,)).fetchall()
        checks = conn.execute("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass "
                              "ORDER BY 1", (table,)).fetchall()
    return columns, indexes, checks


def renamed(schema: Any, old: str, new: str) -> Any:
    """``schema`` (what ``schema_of`` returned) with the table name ``old`` read as ``new``."""
    if isinstance(schema, str):
        return schema.replace(old, new)
    if isinstance(schema, (list, tuple)):
        items = [renamed(item, old, new) for item in schema]
        return sorted(items) if isinstance(schema, list) else tuple(items)
    return schema
