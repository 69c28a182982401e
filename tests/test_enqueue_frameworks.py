"""``enqueue`` on the connections frameworks hand out: a SQLAlchemy Session and
Connection, and a Django connection. The event must ride the framework's own
transaction: committed with it, gone when it rolls back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import add

from outbox import UnsupportedConnection, enqueue
from outbox.storage.store import OutboxStore


def sqlalchemy_url(url: str) -> str:
    if url.startswith("postgresql"):
        return url.replace("postgresql://", "postgresql+psycopg://", 1)
    if url.startswith("mysql"):
        return url.replace("mysql://", "mysql+pymysql://", 1)
    return url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_sqlalchemy_session_and_connection(store: OutboxStore, url: str) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(sqlalchemy_url(url))
    table = store.engine.table_name
    try:
        with Session(engine) as session:
            kept = enqueue(session, topic="t", aggregate_type="o", aggregate_id="s", payload={"a": 1}, table=table)
            session.commit()
        with Session(engine) as session:
            enqueue(session, topic="t", aggregate_type="o", aggregate_id="s", payload={"a": 2}, table=table)
            session.rollback()
        with engine.begin() as connection:
            also = enqueue(connection, topic="t", aggregate_type="o", aggregate_id="c", payload=[1], table=table)
    finally:
        engine.dispose()
    assert [m.id for m in store.claim(10).messages] == [kept, also]


def test_a_session_binding_models_to_several_databases_is_refused_naming_what_to_pass(tmp_path: Path) -> None:
    """Found in review: a Session with ``binds`` enqueued on its default database while the
    business rows went to another, and the two committed apart. Now it is refused, before
    anything is written; the connection of the rows' database is what to pass."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session, declarative_base

    Base = declarative_base()

    class Order(Base):  # type: ignore[misc, valid-type]
        __tablename__ = "orders"
        id = sqlalchemy.Column(sqlalchemy.Integer, primary_key=True)

    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ("main", "orders")}
    for url in urls.values():
        OutboxStore(url).migrate()
    main, orders = (sqlalchemy.create_engine(url) for url in urls.values())
    Base.metadata.create_all(orders)
    event = {"topic": "t", "aggregate_type": "order", "aggregate_id": "1", "payload": {}}
    try:
        with Session(bind=main, binds={Order: orders}) as session:
            session.add(Order(id=1))
            with pytest.raises(UnsupportedConnection, match=r"bind_arguments=\{'mapper': YourModel\}"):
                enqueue(session, **event)
            enqueue(session.connection(bind_arguments={"mapper": Order}), **event)
            session.commit()
    finally:
        main.dispose()
        orders.dispose()
    assert [len(OutboxStore(url).claim(10).messages) for url in urls.values()] == [0, 1]


@pytest.mark.parametrize("kind", ["sqlite"])
def test_django_connection(store: OutboxStore, url: str, tmp_path: Path) -> None:
    pytest.importorskip("django")
    from django.conf import settings

    from outbox.storage.engines.sqlite import sqlite_path

    if not settings.configured:
        settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                                  "NAME": sqlite_path(url)}})
    import django
    django.setup()
    from django.db import connection, transaction

    table = store.engine.table_name
    with transaction.atomic():
        kept = enqueue(connection, topic="t", aggregate_type="o", aggregate_id="d", payload={"a": 1}, table=table)
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue(connection, topic="t", aggregate_type="o", aggregate_id="d", payload={"a": 2}, table=table)
        raise RuntimeError("roll back")
    connection.close()
    assert [m.id for m in store.claim(10).messages] == [kept]


def test_anything_else_is_refused_with_a_clear_error() -> None:
    with pytest.raises(UnsupportedConnection, match="enqueue needs an open DB-API connection"):
        enqueue(object(), topic="t", aggregate_type="o", aggregate_id="1", payload={})


@pytest.mark.parametrize("kind", ["postgresql"])
def test_an_async_connection_is_refused_naming_what_to_pass(store: OutboxStore, url: str) -> None:
    """Found in review: psycopg 3's AsyncConnection passed for a PostgreSQL connection (its
    module is psycopg's), and SQLAlchemy's AsyncSession for a Session: enqueue called methods
    that return coroutines, never awaited, wrote nothing and failed with "TypeError:
    'coroutine' object is not subscriptable". Each is refused before it is used, with what to
    do instead; so is ``run_sync``'s Session, whose driver is the asyncio one (it was refused
    as "not a DB-API connection")."""
    import asyncio
    import gc
    import warnings

    import psycopg
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    table = store.engine.table_name
    refused: list[str] = []

    def attempt(conn: Any) -> None:
        with pytest.raises(UnsupportedConnection) as caught:
            enqueue(conn, topic="t", aggregate_type="o", aggregate_id="1", payload={}, table=table)
        refused.append(str(caught.value))

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            attempt(conn)
        engine = create_async_engine(sqlalchemy_url(url))
        try:
            async with AsyncSession(engine) as session:
                attempt(session)
            async with engine.connect() as connection:
                attempt(connection)
            async with AsyncSession(engine) as session:  # its sync Session runs on the asyncio driver
                await session.run_sync(attempt)
        finally:
            await engine.dispose()

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert [str(w.message) for w in said if "never awaited" in str(w.message)] == []
    assert len(refused) == 4
    for message in refused:
        assert "enqueue needs a synchronous connection" in message, message
        assert "asyncio.to_thread" in message, message
    assert store.claim(10).messages == []


def test_validation_runs_before_the_connection_is_touched() -> None:
    class Exploding:
        def cursor(self) -> Any:
            raise AssertionError("the connection must not be used")
    from outbox import EnqueueError
    with pytest.raises(EnqueueError):
        enqueue(Exploding(), topic="", aggregate_type="o", aggregate_id="1", payload={})


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_a_cursor_is_refused_naming_what_to_pass(writer: Any) -> None:
    """A cursor once failed with AttributeError: 'Cursor' object has no attribute 'cursor'."""
    cursor = writer.cursor()
    with pytest.raises(UnsupportedConnection, match=r"enqueue needs the connection, not a cursor: got .*Cursor; "
                                                    r"pass the cursor's connection \(cursor.connection\)"):
        enqueue(cursor, topic="t", aggregate_type="o", aggregate_id="1", payload={})
    cursor.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_a_missing_table_says_to_migrate_and_keeps_the_drivers_error(writer: Any, store: OutboxStore) -> None:
    from outbox import StoreError

    with pytest.raises(StoreError) as raised:
        enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, table="never_migrated")
    assert str(raised.value) == ("enqueue: table " + store.engine.quote("never_migrated") + " missing: run "
                                 "`outbox migrate` (it creates the table and its indexes)")
    assert raised.value.__cause__ is not None and store.engine.is_missing_table(raised.value.__cause__)


def test_an_autocommit_connection_is_named_once_in_a_warning(writer: Any, store: OutboxStore,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """With autocommit on there is no transaction to share: the row commits by itself,
    which the README's promise (the event commits or vanishes with the business change)
    does not cover; enqueue says so once, and not inside the caller's own transaction."""
    import logging
    import sys

    write_side = sys.modules["outbox.enqueue"]  # the module: the package's `enqueue` is the function

    def event() -> None:
        enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, table=store.engine.table_name)

    write_side._warn_autocommit.cache_clear()
    with caplog.at_level(logging.WARNING, logger="outbox.enqueue"):
        event()  # the connection's own transaction
        writer.commit()
        kind = store.engine.name
        if kind == "sqlite":
            writer.isolation_level = None
        elif kind == "postgresql":
            writer.autocommit = True
        else:
            writer.autocommit(True)
        event()
        event()
        if kind == "postgresql":
            with writer.transaction():  # the caller's transaction, on an autocommit connection
                event()
        else:
            writer.cursor().execute("BEGIN")
            event()
            writer.commit()
    warnings = [r.getMessage() for r in caplog.records if r.name == "outbox.enqueue"]
    assert len(warnings) == 1 and "connection is in autocommit mode, so the event was committed by itself" in warnings[0]
    assert store.stats().counts["pending"] == 4
    write_side._warn_autocommit.cache_clear()


def test_a_sqlite_connection_in_python_312s_autocommit_mode_is_told_as_one() -> None:
    """``sqlite3.connect(..., autocommit=True)`` (Python 3.12+) opens no transaction and keeps
    ``isolation_level`` at ``""`` (seen on 3.12.1): only ``isolation_level = None`` counted,
    so an event enqueued there committed by itself, the caller's rollback left it, and no
    warning said so. A stand-in, as this suite's Python may be 3.11: the attributes 3.12 has."""
    from types import SimpleNamespace

    from outbox.storage.engines.sqlite import SqliteEngine

    engine = SqliteEngine()
    assert engine.commits_each_statement(SimpleNamespace(autocommit=True, isolation_level="", in_transaction=False))
    # The caller's own BEGIN on it; autocommit=False (a transaction always open); the legacy mode.
    assert not engine.commits_each_statement(SimpleNamespace(autocommit=True, isolation_level="", in_transaction=True))
    assert not engine.commits_each_statement(SimpleNamespace(autocommit=False, isolation_level="", in_transaction=True))
    assert not engine.commits_each_statement(SimpleNamespace(autocommit=-1, isolation_level="", in_transaction=False))

@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_a_sqlalchemy_connection_with_no_transaction_yet_commits_the_event(store: OutboxStore, url: str) -> None:
    """SQLAlchemy 2 begins a Connection's transaction at its first execute(); enqueue's insert
    does not go through execute(), so an enqueue on a fresh Connection left SQLAlchemy
    believing no transaction was open: conn.commit() did nothing and closing the connection
    rolled the event back, with its id already returned. enqueue begins it, as execute() would."""
    sqlalchemy = pytest.importorskip("sqlalchemy")

    engine = sqlalchemy.create_engine(sqlalchemy_url(url))
    table = store.engine.table_name
    try:
        with engine.connect() as connection:
            assert not connection.in_transaction()
            kept = enqueue(connection, topic="t", aggregate_type="o", aggregate_id="c", payload={"a": 1}, table=table)
            assert connection.in_transaction()
            connection.commit()
        with engine.connect() as connection:
            enqueue(connection, topic="t", aggregate_type="o", aggregate_id="c", payload={"a": 2}, table=table)
            connection.rollback()
        with engine.connect() as connection:  # the business change after the event: one transaction
            also = enqueue(connection, topic="t", aggregate_type="o", aggregate_id="c", payload={"a": 3}, table=table)
            connection.execute(sqlalchemy.text("SELECT 1"))
            connection.commit()
    finally:
        engine.dispose()
    assert [m.id for m in store.claim(10).messages] == [kept, also]


def test_django_on_psycopg2_is_refused_naming_psycopg_3() -> None:
    """Django's PostgreSQL backend runs on psycopg2 when psycopg 3 is missing; enqueue (which
    speaks psycopg 3) failed there on a missing attribute or module. Now it says what to
    install, before any SQL."""
    psycopg2_connection = type("connection", (), {"__module__": "psycopg2.extensions"})

    class DjangoWrapper:  # what unwrap_connection reads of django.db.backends' DatabaseWrapper
        vendor = "postgresql"
        connection = psycopg2_connection()

        def ensure_connection(self) -> None:
            pass

    with pytest.raises(UnsupportedConnection, match="runs on psycopg2.*install psycopg 3"):
        enqueue(DjangoWrapper(), topic="t", aggregate_type="o", aggregate_id="1", payload={})


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_a_table_an_older_release_made_says_to_migrate_on_claim_and_on_enqueue(writer: Any, store: OutboxStore) -> None:
    """A table that lacks a column this release uses (made by an older release or another
    script, never migrated since): the relay's claim and the enqueue raise a StoreError
    saying to run `outbox migrate`, the driver's error as its cause. Before, both raised the
    driver's bare error, which the relay's outage line called the database "unreachable"."""
    from outbox import StoreError

    e = store.engine

    def drop(column: str) -> None:
        with store.transaction() as cursor:
            e.execute(cursor, f"ALTER TABLE {e.table} DROP COLUMN {column}")
        store.close()

    for column in ("lease_token", "last_error"):  # the columns releases added after the first
        drop(column)
    add(writer, store, "1")
    with pytest.raises(StoreError, match=r"lacks a column this release uses .*: run `outbox migrate`") as raised:
        store.claim(10)
    assert raised.value.__cause__ is not None and e.is_missing_column(raised.value.__cause__)
    store.migrate()
    assert [m.aggregate_id for m in store.claim(10).messages] == ["1"]

    with store.transaction() as cursor:  # SQLite cannot drop a column an index names
        e.execute(cursor, f"DROP INDEX {e.qualify(e.index_name('agg_id_id'))}" + (f" ON {e.table}"
                  if e.name == "mysql" else ""))
    drop("trace_id")
    with pytest.raises(StoreError, match=r"lacks a column this release uses .*`outbox check` names") as raised:
        enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, table=e.table_name)
    assert raised.value.__cause__ is not None and e.is_missing_column(raised.value.__cause__)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_migrate_adds_every_missing_contract_column(writer: Any, store: OutboxStore, url: str) -> None:
    """`outbox migrate` added only the columns releases added (last_error, lease_token): on a
    table made by another script that lacked another column of the contract, it said "nothing
    to change" while `outbox check` and enqueue said to run it (found in review). Each column
    now has its guarded step: on a table holding rows (those the writer does not always give),
    and on a table that holds its id alone."""
    from outbox.commands.doctor import CONTRACT_COLUMNS, OK, check_database
    from outbox.core.config import load_settings

    e = store.engine
    [old] = add(writer, store, "1")
    with store.transaction() as cursor:
        # claim_ready indexes next_retry_at (SQLite refuses to drop an indexed column): the
        # other script made no such index either
        e.execute(cursor, f"DROP INDEX {e.quote(e.index_name('claim_ready'))}" + (f" ON {e.table}" if e.name == "mysql" else ""))
        for column in ("trace_id", "partition_key", "headers", "claimed_at", "next_retry_at", "attempts"):
            e.execute(cursor, f"ALTER TABLE {e.table} DROP COLUMN {column}")
    store.close()
    # the six columns and the index (SQLite's CREATE INDEX IF NOT EXISTS runs every time, not counted)
    assert store.migrate() == (6 if e.name == "sqlite" else 7)
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": e.table_name})
    assert [r.state for r in check_database(settings) if r.name == "table"] == [OK]
    [new] = add(writer, store, "1")
    assert [(m.id, m.headers, m.attempts) for m in store.claim(10).messages] == [(old, {}, 0), (new, {}, 0)]

    with store.transaction() as cursor:  # a table that holds its id alone
        e.execute(cursor, f"DROP TABLE {e.table}")
        e.execute(cursor, f"CREATE TABLE {e.table} (id " + {
            "sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT", "postgresql": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
            "mysql": "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY"}[e.name] + ")")
    store.close()
    assert store.migrate() >= len(CONTRACT_COLUMNS) - 1  # every column but the id
    assert [r.state for r in check_database(settings) if r.name in ("table", "indexes")] == [OK, OK]
    [first] = add(writer, store, "2")
    assert [m.id for m in store.claim(10).messages] == [first]
    if e.name == "sqlite":  # created_at cannot be added to a table with rows: every other repair is made
        with store.transaction() as cursor:
            for column in ("created_at", "lease_token"):
                e.execute(cursor, f"ALTER TABLE {e.table} DROP COLUMN {column}")
        store.close()
        assert store.migrate() == 1  # lease_token; the migration used to fail here, repairing nothing
        problems = [r.detail for r in check_database(settings) if r.name == "table"]
        assert any("created_at" in p for p in problems), problems
