"""``outbox.transaction(conn)`` on the DB-API connections applications hold, on every engine:
the block is one transaction even when the connection is in autocommit mode (psycopg
``autocommit=True``, PyMySQL's and mysqlclient's ``autocommit=True``, sqlite3 ``isolation_level=None``), and a
block nested in another on the same connection is a savepoint, never a commit of the outer
block's work (docs/waking-and-metrics.md, "outbox.transaction")."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import ENGINES, MYSQLCLIENT, MysqlclientEngine

import outbox
import outbox.wake as wake
from outbox import enqueue
from outbox.core.errors import StoreError
from outbox.storage.store import OutboxStore

EVENT = {"topic": "orders.placed", "aggregate_type": "order", "aggregate_id": "1", "payload": {}}


@pytest.fixture(params=[*ENGINES, MYSQLCLIENT])
def kind(request: pytest.FixtureRequest) -> str:
    """Every engine, and MariaDB/MySQL once more on mysqlclient (``engine_support.MYSQLCLIENT``)."""
    return request.param


def app_connection(store: OutboxStore, url: str, autocommit: bool) -> Any:
    """The application's own connection, as its driver makes it."""
    kind = store.engine.name
    if isinstance(store.engine, MysqlclientEngine):
        import MySQLdb
        from test_enqueue_mysql import mysql_kwargs

        return MySQLdb.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=autocommit)
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


@pytest.mark.parametrize("kind", ["postgresql"])
def test_psycopgs_own_transaction_inside_a_block_is_a_savepoint_of_it(
        store: OutboxStore, conn: Any, wakes: list[int]) -> None:
    """psycopg's ``with conn.transaction():`` as the first thing in the block (autocommit off,
    psycopg's default) is a savepoint of the block's transaction, rolled back with it: the block
    is psycopg's own ``conn.transaction()``. A block that let the driver open the transaction at
    its first statement made that inner ``conn.transaction()`` the outermost one, which
    committed at its end whatever the block did after (found in review, of a proposed fix that
    gave up psycopg's transaction so that ``conn.commit()`` would work inside: it does not, see
    docs/waking-and-metrics.md, "outbox.transaction")."""
    import psycopg

    with pytest.raises(RuntimeError), outbox.transaction(conn):
        with conn.transaction():
            place_order(conn, store, 1)
        place_order(conn, store, 2)
        raise RuntimeError("payment declined")
    assert committed(store) == ([], []) and wakes == []

    # The driver's commit is psycopg's to refuse inside its transaction: the block rolls back.
    with pytest.raises(psycopg.ProgrammingError, match="Explicit commit"), outbox.transaction(conn):
        place_order(conn, store, 3)
        conn.commit()
    assert committed(store) == ([], []) and wakes == []


def test_a_transaction_the_caller_began_on_an_autocommit_connection_is_refused(
        store: OutboxStore, url: str) -> None:
    """BEGIN of the caller's own on an autocommit connection: the block cannot end a
    transaction it did not begin, nor know when it commits to wake the relay. mysqlclient
    (MariaDB): not told before, the block's START TRANSACTION committed the caller's work, which
    the caller's rollback then left committed; MariaDB is now asked (``@@in_transaction``)."""
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


@pytest.mark.parametrize("caught", [False, True], ids=["raised", "caught-and-carried-on"])
@pytest.mark.parametrize("kind", ["mysql", MYSQLCLIENT])
def test_a_deadlock_in_a_nested_block_reaches_the_caller_as_itself(store: OutboxStore, url: str, caught: bool) -> None:
    """InnoDB rolls the whole transaction back on a deadlock, and the savepoint with it: the
    inner block's ROLLBACK TO SAVEPOINT then failed with 1305 (SAVEPOINT does not exist), and
    that error, not the deadlock (1213), reached the caller, who retries on a deadlock and so
    did not (found in review). Two connections deadlock for real; the inner block's is the
    victim (InnoDB picks the transaction that changed fewer rows)."""
    table = f"{store.engine.table_name}_dl"
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"CREATE TABLE {table} (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
        store.engine.execute(cursor, f"INSERT INTO {table} (id, v) VALUES " + ", ".join(f"({i}, 0)" for i in range(1, 501)))
    app, other = app_connection(store, url, autocommit=False), app_connection(store, url, autocommit=False)
    both_hold_a_row = threading.Barrier(2, timeout=10)

    def run(conn: Any, *statements: str) -> None:
        cursor = conn.cursor()
        try:
            for statement in statements:
                cursor.execute(statement)
        finally:
            cursor.close()

    def heavier_transaction() -> None:  # id 2 and many rows, then waits for id 1
        run(other, f"UPDATE {table} SET v = 1 WHERE id = 2", f"UPDATE {table} SET v = 1 WHERE id > 100")
        both_hold_a_row.wait()
        time.sleep(0.3)  # the application's connection waits for id 2 by then
        run(other, f"UPDATE {table} SET v = 1 WHERE id = 1")
        other.commit()

    try:
        for conn in (app, other):
            run(conn, "SET SESSION innodb_lock_wait_timeout = 10")  # bounded if no deadlock comes
        thread = threading.Thread(target=heavier_transaction)
        thread.start()
        if not caught:
            with (pytest.raises(Exception) as raised, outbox.transaction(app, wake=False),
                  outbox.transaction(app, wake=False)):  # the outer block, then the inner one
                run(app, f"UPDATE {table} SET v = 2 WHERE id = 1")
                both_hold_a_row.wait()
                run(app, f"UPDATE {table} SET v = 2 WHERE id = 2")
        else:
            # Found in review: the caller catches the deadlock inside the outer block and carries
            # on; the deadlock had rolled back the outer block's own work (id 50) with it, and the
            # outer block then committed what came after (id 51), half a transaction. Now the
            # outer block rolls back and says so.
            with pytest.raises(StoreError, match="rolled back"), outbox.transaction(app, wake=False):
                run(app, f"UPDATE {table} SET v = 3 WHERE id = 50")
                with pytest.raises(Exception) as raised, outbox.transaction(app, wake=False):
                    run(app, f"UPDATE {table} SET v = 2 WHERE id = 1")
                    both_hold_a_row.wait()
                    run(app, f"UPDATE {table} SET v = 2 WHERE id = 2")
                run(app, f"UPDATE {table} SET v = 3 WHERE id = 51")
        thread.join(timeout=20)
        assert raised.value.args[0] == 1213, raised.value  # ER_LOCK_DEADLOCK, not 1305
        assert store.engine.is_transient(raised.value)
        with store.transaction() as cursor:  # nothing of the application's block committed
            assert store.engine.execute(cursor, f"SELECT COUNT(*) FROM {table} WHERE v IN (2, 3)").fetchone()[0] == 0
    finally:
        for conn in (app, other):
            conn.close()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE {table}")
