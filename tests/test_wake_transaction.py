"""``outbox.transaction(conn)`` on the DB-API connections applications hold, on every engine:
the block is one transaction even when the connection is in autocommit mode (psycopg
``autocommit=True``, PyMySQL ``autocommit=True``, sqlite3 ``isolation_level=None``), and a
block nested in another on the same connection is a savepoint, never a commit of the outer
block's work (docs/waking-and-metrics.md, "outbox.transaction")."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest

import outbox
import outbox.wake as wake
from outbox import enqueue
from outbox.storage.store import OutboxStore

EVENT = {"topic": "orders.placed", "aggregate_type": "order", "aggregate_id": "1", "payload": {}}


def app_connection(store: OutboxStore, url: str, autocommit: bool) -> Any:
    """The application's own connection, as its driver makes it."""
    kind = store.engine.name
    if kind == "sqlite":
        from outbox.storage.engines.sqlite import sqlite_path

        return sqlite3.connect(sqlite_path(url), timeout=30, **({"isolation_level": None} if autocommit else {}))
    if kind == "postgresql":
        import psycopg

        return psycopg.connect(url, autocommit=autocommit)
    if kind == "mysql":
        import pymysql
        from test_enqueue_mysql import mysql_kwargs

        return pymysql.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=autocommit)
    conn = store.engine.connect(url)  # SQL Server: pyodbc, autocommit off
    conn.autocommit = autocommit
    return conn


@pytest.fixture(params=[False, True], ids=["autocommit off", "autocommit on"])
def autocommit(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def conn(store: OutboxStore, url: str, autocommit: bool) -> Iterator[Any]:
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"CREATE TABLE {store.engine.table_name}_orders (id INT)")
    made = app_connection(store, url, autocommit)
    try:
        yield made
    finally:
        try:
            made.rollback()
        finally:
            made.close()
            with store.transaction() as cursor:
                store.engine.execute(cursor, f"DROP TABLE {store.engine.table_name}_orders")


@pytest.fixture
def wakes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(wake, "request_claim", lambda: calls.append(1) or True)
    return calls


def place_order(conn: Any, store: OutboxStore, order_id: int) -> None:
    cursor = conn.cursor()
    try:
        cursor.execute(f"INSERT INTO {store.engine.table_name}_orders (id) VALUES ({order_id})")
    finally:
        cursor.close()
    enqueue(conn, **{**EVENT, "aggregate_id": str(order_id)}, table=store.engine.table_name)


def committed(store: OutboxStore) -> tuple[list[int], list[str]]:
    """The orders and the events' aggregates another connection sees."""
    table = store.engine.table_name
    with store.transaction() as cursor:
        orders = store.engine.execute(cursor, f"SELECT id FROM {table}_orders ORDER BY id").fetchall()
        events = store.engine.execute(cursor, f"SELECT aggregate_id FROM {table} ORDER BY id").fetchall()
    return [int(r[0]) for r in orders], [str(r[0]) for r in events]


def test_a_block_that_raises_leaves_nothing_committed_even_in_autocommit(
        store: OutboxStore, conn: Any, wakes: list[int]) -> None:
    """On an autocommit connection no BEGIN was ever issued: the order and its event stayed
    committed after the block raised (found in review: psycopg autocommit=True)."""
    with pytest.raises(RuntimeError), outbox.transaction(conn):
        place_order(conn, store, 1)
        raise RuntimeError("business failure")
    assert committed(store) == ([], []) and wakes == []

    with outbox.transaction(conn):
        place_order(conn, store, 2)
    assert committed(store) == ([2], ["2"]) and wakes == [1]


def test_a_nested_block_is_a_savepoint_and_the_outer_block_commits(
        store: OutboxStore, conn: Any, wakes: list[int]) -> None:
    """A helper that runs its own ``outbox.transaction`` inside the caller's committed the
    caller's work at its end (found in review): the outer block then raised and rolled
    back nothing. Now the inner block is a savepoint, and only the outer one commits."""

    def helper(order_id: int, fail: bool = False) -> None:
        with outbox.transaction(conn):
            place_order(conn, store, order_id)
            if fail:
                raise ValueError("helper failure")

    with pytest.raises(RuntimeError), outbox.transaction(conn):
        place_order(conn, store, 1)
        helper(2)
        raise RuntimeError("payment declined")
    assert committed(store) == ([], []) and wakes == []

    with outbox.transaction(conn):
        place_order(conn, store, 3)
        with pytest.raises(ValueError):
            helper(4, fail=True)  # its savepoint rolls back alone
        helper(5)
        assert wakes == []  # not at the inner block's end: nothing is committed yet
    assert committed(store) == ([3, 5], ["3", "5"]) and wakes == [1]


def test_a_transaction_the_caller_began_on_an_autocommit_connection_is_refused(
        store: OutboxStore, url: str) -> None:
    """BEGIN of the caller's own on an autocommit connection: the block cannot end a
    transaction it did not begin, nor know when it commits to wake the relay."""
    if store.engine.name == "mssql":
        pytest.skip("pyodbc does not tell an open transaction on an autocommit connection")
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"CREATE TABLE {store.engine.table_name}_orders (id INT)")
    conn = app_connection(store, url, autocommit=True)
    try:
        cursor = conn.cursor()
        cursor.execute("BEGIN")
        cursor.close()
        with pytest.raises(outbox.UnsupportedConnection, match="did not begin"), outbox.transaction(conn):
            place_order(conn, store, 1)
        conn.rollback()
        assert committed(store) == ([], [])
    finally:
        conn.close()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE {store.engine.table_name}_orders")
