"""``enqueue`` on the MySQL/MariaDB connections applications hold: PyMySQL with a character
set other than utf8mb4 (``charset="utf8"`` is utf8mb3, Django's default before 5.2) and
mysqlclient (``MySQLdb``, Django's default MySQL driver)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from engine_support import MYSQLCLIENT, require_mysqlclient

from outbox import EnqueueError, StoreError, enqueue
from outbox.storage.store import OutboxStore, apply_migration

EMOJI_A, EMOJI_B = "\U0001F600", "\U0001F601"


def mysql_kwargs(url: str) -> dict[str, Any]:
    from outbox.storage.engines.mysql import pymysql_kwargs

    kwargs = pymysql_kwargs(url)
    kwargs.pop("charset")
    return kwargs


def stored(store: OutboxStore) -> list[tuple]:
    with store.transaction() as cursor:
        rows = store.engine.execute(
            cursor, f"SELECT message_id, aggregate_id, payload FROM {store.engine.table} ORDER BY id").fetchall()
    return [(r[0], r[1], json.loads(r[2])) for r in rows]


@pytest.mark.parametrize("kind", ["mysql"])
def test_the_deepest_payload_enqueue_takes_is_one_mariadb_stores(store: OutboxStore, url: str, writer: Any) -> None:
    """31 levels of arrays and objects pass MariaDB's json_valid check; 32 failed it with
    the driver's CHECK error and are now an EnqueueError before anything is written."""
    from test_events import nested

    table = store.engine.table_name
    enqueue(writer, topic="t", aggregate_type="o", aggregate_id="a", payload=nested(31), table=table)
    with pytest.raises(EnqueueError, match="more than 31 levels deep"):
        enqueue(writer, topic="t", aggregate_type="o", aggregate_id="a", payload=nested(32), table=table)
    writer.commit()
    assert [row[2] for row in stored(store)] == [nested(31)]


@pytest.mark.parametrize("kind", ["mysql"])
@pytest.mark.parametrize("sql_mode", ["strict", "not strict"])
def test_four_byte_characters_on_a_utf8mb3_connection_are_refused_before_the_insert(
        store: OutboxStore, url: str, sql_mode: str) -> None:
    """A utf8mb3 connection cannot carry a character of four UTF-8 bytes. In strict mode the
    server refused the row with a driver error; without it (sql_mode='') it stored '?' for
    each such character: two message ids that differ only there became one, and the second
    event was dropped as a duplicate of the first, its id returned. Now both are an
    EnqueueError before anything is written, and the caller's transaction goes on."""
    import pymysql

    conn = pymysql.connect(**mysql_kwargs(url), charset="utf8", autocommit=False)
    table = store.engine.table_name
    try:
        if sql_mode == "not strict":
            conn.cursor().execute("SET SESSION sql_mode = ''")
        for emoji in (EMOJI_A, EMOJI_B):
            with pytest.raises(EnqueueError, match="character set utf8mb3 cannot carry.*charset='utf8mb4'"):
                enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", message_id=f"m-{emoji}",
                        payload={"name": f"caf\u00e9 {emoji}"}, table=table)
        with pytest.raises(EnqueueError, match="four UTF-8 bytes"):  # anywhere: here in a header value
            enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", payload={}, headers={"x": EMOJI_A},
                    table=table)
        kept = enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", message_id="m-plain",
                       payload={"name": "caf\u00e9"}, table=table)  # three bytes at most: fine on utf8mb3
        conn.commit()
    finally:
        conn.close()
    assert stored(store) == [("m-plain", "a", {"name": "café"})]
    assert kept == 1

    conn = pymysql.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=False)
    try:
        ids = [enqueue(conn, topic="t", aggregate_type="o", aggregate_id=f"a-{emoji}", message_id=f"m-{emoji}",
                       payload={"name": emoji}, table=table) for emoji in (EMOJI_A, EMOJI_B)]
        conn.commit()
    finally:
        conn.close()
    assert len(set(ids)) == 2
    assert [r[0] for r in stored(store)] == ["m-plain", f"m-{EMOJI_A}", f"m-{EMOJI_B}"]


@pytest.mark.parametrize("kind", ["mysql"])
def test_a_mysqlclient_connection_enqueues_and_migrates(store: OutboxStore, url: str) -> None:
    """mysqlclient (``MySQLdb``) is Django's default MySQL driver. enqueue handed it PyMySQL's
    cursor class, which built broken SQL (error 1064), and the Django migration failed with
    AttributeError '_result'. Now each driver gets its own cursor: the event, a duplicate
    message_id (the stored row's id, nothing written), the missing-table hint and the
    migration all work on it."""
    require_mysqlclient()
    import MySQLdb

    conn = MySQLdb.connect(**mysql_kwargs(url), charset="utf8mb4")
    table = store.engine.table_name
    try:
        first = enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", message_id="m-1",
                        payload={"emoji": EMOJI_A}, table=table)
        again = enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", message_id="m-1", payload={},
                        table=table)
        conn.commit()
        with pytest.raises(StoreError, match="run `outbox migrate`"):
            enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", payload={}, table=table + "_none")
        cursor = store.engine.cursor_for(conn)
        assert apply_migration(store.engine, cursor) == 0  # the Django migration's path: nothing to repair
        cursor.close()
    finally:
        conn.close()
    assert first == again
    assert stored(store) == [("m-1", "a", {"emoji": EMOJI_A})]


@pytest.mark.parametrize("kind", [MYSQLCLIENT])
def test_enqueue_in_a_transaction_on_an_autocommit_mysqlclient_connection_does_not_say_autocommit(
        store: OutboxStore, url: str, caplog: pytest.LogCaptureFixture) -> None:
    """mysqlclient's autocommit flag (``get_autocommit``) stays on through a BEGIN: an event
    enqueued inside ``outbox.transaction`` or the caller's own BEGIN on an autocommit connection
    logged that it "was committed by itself, not with your business change", which was false
    (it committed or rolled back with the block). MariaDB is now asked (``@@in_transaction``);
    only the enqueue outside any transaction is told."""
    import logging
    import sys

    import MySQLdb

    import outbox

    write_side = sys.modules["outbox.enqueue"]
    conn = MySQLdb.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=True)
    table = store.engine.table_name

    def warned(aggregate: str) -> list[str]:
        write_side._warn_autocommit.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="outbox.enqueue"):
            enqueue(conn, topic="t", aggregate_type="o", aggregate_id=aggregate, payload={}, table=table)
        return [r.getMessage() for r in caplog.records if r.name == "outbox.enqueue"]

    try:
        with outbox.transaction(conn, wake=False):
            assert warned("block") == []
        cursor = conn.cursor()
        cursor.execute("BEGIN")
        assert warned("callers-begin") == []
        conn.rollback()
        assert any("autocommit mode, so the event was committed by itself" in w for w in warned("alone"))
    finally:
        write_side._warn_autocommit.cache_clear()
        conn.close()
    assert [row[1] for row in stored(store)] == ["block", "alone"]


@pytest.mark.parametrize("kind", ["mysql", MYSQLCLIENT])
def test_a_killed_connection_is_a_disconnect_on_either_driver_and_the_store_reconnects(
        store: OutboxStore, url: str) -> None:
    """The engine told transient and lost-connection errors by PyMySQL's classes alone: on
    mysqlclient a killed connection (2013, then 2006) and a deadlock (1213, tests/
    test_wake_transaction.py) were neither, so a store on mysqlclient connections raised
    instead of reconnecting and retrying. Both drivers' errors are now told by their codes."""
    import pymysql

    def kill(conn: Any) -> None:
        killer = pymysql.connect(**mysql_kwargs(url), autocommit=True)
        try:
            killer.cursor().execute(f"KILL {int(conn.thread_id())}")
        finally:
            killer.close()

    conn = store.connection()
    kill(conn)
    cursor = store.engine.cursor_for(conn)
    with pytest.raises(Exception) as raised:
        cursor.execute("SELECT 1")
    assert store.engine.is_disconnect(raised.value), raised.value
    assert store.engine.is_transient(raised.value), raised.value
    store.close()
    conn = store.connection()
    kill(conn)
    assert store.stats().counts["pending"] == 0  # dropped and connected again, within the retries
    assert store.connection() is not conn


@pytest.mark.parametrize("kind", ["mysql"])
def test_a_duplicate_enqueue_locks_nothing_the_relay_writes_or_claims(store: OutboxStore, url: str) -> None:
    """An application that runs its business step again (a consumer's redelivery) enqueues
    a stored message_id again. The insert's ON DUPLICATE KEY took an exclusive lock on the
    stored row until the application's transaction ended: the relay's mark_done of the
    claimed row waited innodb_lock_wait_timeout per try (5 tries), and a claim skipped the
    pending row. Now the duplicate is found by a plain read first, and nothing waits."""
    import pymysql

    table = store.engine.table_name
    writer = pymysql.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=False)  # no session bounds
    relay = OutboxStore(url + ("&" if "?" in url else "?") + "tcp_timeout_s=2", table=table, claim_timeout_ms=60_000)
    try:
        done = enqueue(writer, topic="t", aggregate_type="o", aggregate_id="a", payload={}, message_id="m-1",
                       table=table)
        pending = enqueue(writer, topic="t", aggregate_type="o", aggregate_id="b", payload={}, message_id="m-2",
                          table=table)
        writer.commit()
        claim = relay.claim(1)
        assert [m.id for m in claim.messages] == [done]
        # The application's retry: both ids again, its transaction left open.
        assert enqueue(writer, topic="t", aggregate_type="o", aggregate_id="a", payload={}, message_id="m-1",
                       table=table) == done
        assert enqueue(writer, topic="t", aggregate_type="o", aggregate_id="b", payload={}, message_id="m-2",
                       table=table) == pending
        started = time.monotonic()
        result = relay.mark_done([done], claim.lease)
        assert result.applied == 1
        assert time.monotonic() - started < 1
        assert [m.id for m in relay.claim(10).messages] == [pending]
        writer.commit()
    finally:
        writer.close()
        relay.close()


@pytest.mark.parametrize("kind", ["mysql"])
def test_enqueues_of_different_new_ids_at_serializable_do_not_wait_for_each_other(store: OutboxStore,
                                                                                   url: str) -> None:
    """At SERIALIZABLE InnoDB makes the plain read of the message_id a shared lock, on the
    index entry after the id too: a writer waited for another's uncommitted event (here
    until innodb_lock_wait_timeout, error 1205), and writers enqueueing new ids at once
    deadlocked (four writers: 525 of 800 transactions failed with 1213). The read is now
    skipped at SERIALIZABLE: the insert alone finds a stored id."""
    import pymysql

    table = store.engine.table_name
    first, second = (pymysql.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=False) for _ in range(2))
    try:
        for conn in (first, second):
            conn.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        second.cursor().execute("SET SESSION innodb_lock_wait_timeout = 2")
        held = enqueue(first, topic="t", aggregate_type="o", aggregate_id="a", payload={}, message_id="m-2",
                       table=table)  # left uncommitted
        mine = enqueue(second, topic="t", aggregate_type="o", aggregate_id="b", payload={}, message_id="m-1",
                       table=table)
        second.commit()
        first.commit()
        # A stored id is still found, and found again in the same transaction.
        assert enqueue(second, topic="t", aggregate_type="o", aggregate_id="a", payload={}, message_id="m-2",
                       table=table) == held
        assert enqueue(second, topic="t", aggregate_type="o", aggregate_id="b", payload={}, message_id="m-1",
                       table=table) == mine
        second.commit()
    finally:
        first.close()
        second.close()
    assert [row[0] for row in stored(store)] == ["m-2", "m-1"]


@pytest.mark.parametrize("kind", ["mysql"])
def test_an_enqueue_at_read_uncommitted_does_not_take_anothers_uncommitted_row_for_its_own(store: OutboxStore,
                                                                                         url: str) -> None:
    """At READ UNCOMMITTED the plain read of the message_id saw another transaction's
    uncommitted row of the same id and returned its id: when that one rolled back, the
    caller's event was lost (it committed nothing, told it was stored). The read is skipped
    there as at SERIALIZABLE: the insert waits for the other transaction, as at any level."""
    import pymysql

    table = store.engine.table_name
    first, second = (pymysql.connect(**mysql_kwargs(url), charset="utf8mb4", autocommit=False) for _ in range(2))
    got: list[Any] = []
    try:
        second.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
        enqueue(first, topic="t", aggregate_type="o", aggregate_id="a", payload={"who": "first"},
                message_id="m-1", table=table)  # left uncommitted
        racing = threading.Thread(target=lambda: got.append(enqueue(
            second, topic="t", aggregate_type="o", aggregate_id="b", payload={"who": "second"}, message_id="m-1",
            table=table)))
        racing.start()
        racing.join(1)
        first.rollback()
        racing.join(30)
        assert got, "the second enqueue did not return"
        second.commit()
    finally:
        first.close()
        second.close()
    assert stored(store) == [("m-1", "b", {"who": "second"})]


@pytest.mark.parametrize("server_info, variable", [
    ("10.11.19-MariaDB-0+deb12u1", "@@tx_isolation"), ("5.5.5-10.6.1-MariaDB", "@@tx_isolation"),
    ("11.0.1-MariaDB-log", "@@tx_isolation"), ("11.4.2-MariaDB", "@@transaction_isolation"),
    ("5.7.19-log", "@@tx_isolation"), ("5.7.44", "@@transaction_isolation"), ("8.0.36", "@@transaction_isolation"),
])
def test_the_isolation_variable_is_the_one_the_server_has(server_info: str, variable: str) -> None:
    from outbox.storage.engines.mysql import isolation_variable

    assert isolation_variable(server_info) == variable
