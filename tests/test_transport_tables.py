"""The queue tables' SQL (``outbox.transport.tables.base``) on live engines: DDL that repairs
itself, FIFO leases, fenced ack/release, delay, expiry, lease expiry, disjoint
concurrent receivers. Each test has tables of its own."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import engine_url

from outbox.storage.engines import engine_for_url
from outbox.transport.tables import queue_tables
from outbox.transport.tables.base import QueueTables

KINDS = ["sqlite", "postgresql", "mysql", "mssql"]


class Tables:
    """Queue tables on a per-test name, with a helper that runs one short transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = engine_for_url(url)
        self.qt: QueueTables = queue_tables(self.engine, f"q_{uuid.uuid4().hex[:10]}")
        self.conn = self.engine.connect(url)

    def tx(self, work: Callable[[Any], Any], conn: Any = None) -> Any:
        conn = conn or self.conn
        cursor = self.engine.cursor_for(conn)
        try:
            result = work(cursor)
            conn.commit()
            return result
        except BaseException:
            conn.rollback()
            raise

    def drop(self) -> None:
        self.tx(self.qt.drop)
        self.conn.close()


@pytest.fixture(params=KINDS)
def tables(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tables]:
    t = Tables(engine_url(request.param, tmp_path))
    t.tx(t.qt.migrate)
    yield t
    t.drop()


def put(t: Tables, queue: str, body: str, delay_ms: int = 0, ttl_ms: int | None = None) -> None:
    t.tx(lambda c: t.qt.put(c, queue, '{"properties": {}}', body, delay_ms, ttl_ms))


def lease(t: Tables, queue: str, limit: int = 10, visibility_ms: int = 60_000, conn: Any = None) -> list:
    receipt = uuid.uuid4().hex
    return [(row, receipt) for row in t.tx(lambda c: t.qt.lease(c, queue, limit, visibility_ms, receipt), conn)]


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_migration_is_idempotent_and_start_up_check_names_a_missing_index(tables: Tables) -> None:
    t = tables
    t.tx(t.qt.migrate)  # a second run changes nothing and does not fail
    assert t.tx(t.qt.missing_indexes) == []
    expires = t.qt.index_name("expires")
    drop = {"mysql": f"DROP INDEX `{expires}` ON {t.qt.table}", "mssql": f"DROP INDEX [{expires}] ON {t.qt.table}"}
    t.tx(lambda c: t.engine.execute(c, drop.get(t.engine.name, f'DROP INDEX "{expires}"')))
    assert t.tx(t.qt.missing_indexes) == [expires]
    t.tx(t.qt.migrate)  # repairs the partial deployment
    assert t.tx(t.qt.missing_indexes) == []


def test_fifo_lease_and_fenced_ack(tables: Tables) -> None:
    t = tables
    for n in range(5):
        put(t, "a", f"m{n}")
    put(t, "b", "other queue")
    got = lease(t, "a", limit=3)
    assert [r.body for r, _ in got] == ["m0", "m1", "m2"]
    assert all(r.deliveries == 1 and r.queue == "a" for r, _ in got)
    assert [r.body for r, _ in lease(t, "a", limit=10)] == ["m3", "m4"]  # leased rows are invisible
    assert lease(t, "a") == []
    row, receipt = got[0]
    assert t.tx(lambda c: t.qt.ack(c, row.id, "0" * 32)) == 0  # someone else's receipt: nothing
    assert t.tx(lambda c: t.qt.ack(c, row.id, receipt)) == 1
    assert t.tx(lambda c: t.qt.ack(c, row.id, receipt)) == 0
    assert t.tx(lambda c: t.qt.size(c, "b")) == 1
    assert t.tx(lambda c: t.qt.probe(c, ["a"])) is False
    assert t.tx(lambda c: t.qt.probe(c, ["a", "b"])) is True


def test_a_lease_is_found_again_by_its_receipt(tables: Tables) -> None:
    """``leased``: what a lease took, for its retry when the COMMIT's answer was lost
    (test_transport_kombu.py cuts a real connection there)."""
    t = tables
    for n in range(3):
        put(t, "a", f"m{n}")
    put(t, "b", "other queue")
    got = lease(t, "a", limit=2)
    receipt = got[0][1]
    assert t.tx(lambda c: t.qt.leased(c, "a", receipt)) == [r for r, _ in got]
    assert t.tx(lambda c: t.qt.leased(c, "a", "0" * 32)) == []
    assert t.tx(lambda c: t.qt.leased(c, "b", receipt)) == []
    t.tx(lambda c: t.qt.ack(c, got[0][0].id, receipt))
    assert [r.body for r in t.tx(lambda c: t.qt.leased(c, "a", receipt))] == ["m1"]


def test_release_makes_a_message_visible_again_and_counts_deliveries(tables: Tables) -> None:
    t = tables
    put(t, "a", "x")
    [(row, receipt)] = lease(t, "a")
    assert t.tx(lambda c: t.qt.release(c, row.id, receipt)) == 1
    [(again, receipt2)] = lease(t, "a")
    assert again.id == row.id and again.deliveries == 2
    assert t.tx(lambda c: t.qt.release(c, row.id, receipt)) == 0  # stale receipt: fenced


def test_lease_runs_out_after_the_visibility_timeout(tables: Tables) -> None:
    t = tables
    put(t, "a", "x")
    [(row, old)] = lease(t, "a", visibility_ms=500)
    assert lease(t, "a") == []
    again = wait_for(lambda: lease(t, "a"))
    assert [r.id for r, _ in again] == [row.id] and again[0][0].deliveries == 2
    assert t.tx(lambda c: t.qt.ack(c, row.id, old)) == 0  # the first receiver lost it


def test_delayed_message_is_invisible_until_due(tables: Tables) -> None:
    """Its CI flake (``[] == ['now']`` on PostgreSQL) was the rounded clock of
    test_a_message_sent_without_delay_is_visible_to_the_next_transaction. The clock starts
    before the delayed send, so a slow second send on a loaded machine cannot eat into the
    1.5 s it checks."""
    t = tables
    started = time.monotonic()
    put(t, "a", "later", delay_ms=1500)
    put(t, "a", "now")
    assert [r.body for r, _ in lease(t, "a")] == ["now"]
    later = wait_for(lambda: lease(t, "a"))
    assert [r.body for r, _ in later] == ["later"]
    assert time.monotonic() - started >= 1.4


def test_a_message_sent_without_delay_is_visible_to_the_next_transaction(tables: Tables) -> None:
    """A send with no delay, then at once a lease: it must get the message, every time.
    PostgreSQL rounded the send's clock (microseconds) up to the column's milliseconds, so
    the row's ``visible_at`` lay up to 0.5 ms ahead of the send and a lease (or a woken
    consumer's probe) within that half millisecond found nothing: 86 of 2,000 here, and the
    CI flake of ``test_delayed_message_is_invisible_until_due[postgresql]`` (``[] == ['now']``).
    The probe in the send's own transaction shows it every other time: PostgreSQL's clock
    stands still within a transaction."""
    t = tables
    unseen, missed = 0, 0
    for n in range(200):
        unseen += not t.tx(lambda c, n=n: (t.qt.put(c, "a", "{}", f"m{n}"), t.qt.probe(c, ["a"]))[1])
        got = lease(t, "a")
        if not got:
            missed += 1
            got = wait_for(lambda: lease(t, "a"))
        t.tx(lambda c, got=got: [t.qt.ack(c, r.id, rc) for r, rc in got])
    assert (unseen, missed) == (0, 0), f"of 200 sends, {unseen} were invisible to their own transaction " \
        f"and {missed} to the next one"


def test_a_delay_counts_from_the_send_not_from_the_start_of_its_transaction(tables: Tables) -> None:
    """``send_task(conn, ..., countdown=2)`` inside a business transaction that began 1.5 s
    earlier: the task must stay invisible for 2 s after the send. PostgreSQL's ``now()`` is
    the transaction's start, so it came due 1.5 s early, 0.5 s after the commit."""
    t = tables
    business = t.engine.connect(t.url)
    try:
        cursor = t.engine.cursor_for(business)
        t.engine.execute(cursor, f"SELECT COUNT(*) FROM {t.qt.table}").fetchall()  # the transaction begins
        time.sleep(1.5)
        sent = time.monotonic()
        t.qt.put(cursor, "a", "{}", "in 2 s", delay_ms=2000)
        business.commit()
    finally:
        business.close()
    time.sleep(max(sent + 1.0 - time.monotonic(), 0))
    assert lease(t, "a") == [], "a 2 s delay came due 1 s after its send"
    assert [r.body for r, _ in wait_for(lambda: lease(t, "a"))] == ["in 2 s"]
    assert time.monotonic() - sent >= 1.9


def test_expired_message_is_never_delivered_and_purged_in_chunks(tables: Tables) -> None:
    t = tables
    for n in range(5):
        put(t, "a", f"dies{n}", ttl_ms=1)
    put(t, "a", "lives", ttl_ms=600_000)
    time.sleep(0.1)
    assert [r.body for r, _ in lease(t, "a")] == ["lives"]
    assert t.tx(lambda c: t.qt.purge_expired(c, 3)) == 3
    assert t.tx(lambda c: t.qt.purge_expired(c, 3)) == 2
    assert t.tx(lambda c: t.qt.purge_expired(c, 3)) == 0


def test_a_delayed_messages_ttl_counts_from_when_it_becomes_visible(tables: Tables) -> None:
    """A countdown longer than the queue's message TTL: the message must not expire before
    it is due (it did: both counted from the send, and the purge deleted it unseen)."""
    t = tables
    put(t, "a", "due in 2 s, lives 1 s more", delay_ms=2000, ttl_ms=1000)
    put(t, "a", "due in 0.2 s, lives 0.2 s more", delay_ms=200, ttl_ms=200)
    time.sleep(2.1)
    assert [r.body for r, _ in lease(t, "a")] == ["due in 2 s, lives 1 s more"]
    assert t.tx(lambda c: t.qt.purge_expired(c, 10)) == 1  # the other one expired 0.4 s after its send


def test_bindings_are_stored_once(tables: Tables) -> None:
    t = tables
    for _ in range(2):
        t.tx(lambda c: t.qt.bind(c, "ex", "rk", "rk", "a"))
    t.tx(lambda c: t.qt.bind(c, "ex", "rk", "rk", "b", 5000))
    assert [(b.routing_key, b.queue, b.message_ttl_ms) for b in t.tx(lambda c: t.qt.table_bindings(c, "ex"))] \
        == [("rk", "a", None), ("rk", "b", 5000)]
    t.tx(lambda c: t.qt.unbind(c, "ex", "rk", "a"))
    put(t, "b", "x")
    t.tx(lambda c: t.qt.delete_queue(c, "b"))
    assert t.tx(lambda c: t.qt.table_bindings(c, "ex")) == []
    assert t.tx(lambda c: t.qt.size(c, "b")) == 0


def test_concurrent_receivers_never_lease_the_same_row(tables: Tables) -> None:
    t = tables
    total = 200
    t.tx(lambda c: [t.qt.put(c, "a", "{}", str(n)) for n in range(total)])
    seen: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def receiver(slot: int) -> None:
        conn = t.engine.connect(t.url)
        try:
            while True:
                got = lease(t, "a", limit=5, conn=conn)
                if not got:
                    if t.tx(lambda c: t.qt.size(c, "a"), conn) == 0:
                        return
                    continue
                seen[slot].extend(r.id for r, _ in got)
                t.tx(lambda c, got=got: [t.qt.ack(c, r.id, rc) for r, rc in got], conn)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=receiver, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    ids = [i for s in seen for i in s]
    assert len(ids) == total and len(set(ids)) == total
    for s in seen:
        assert s == sorted(s)  # each receiver sees the queue in FIFO order


def test_postgresql_sends_commit_durably_while_receives_commit_asynchronously(tmp_path: Path) -> None:
    """The transport's session commits leases and acks without waiting for the WAL flush
    (a crash redelivers, never loses), but every send turns synchronous commit back on
    for its own transaction."""
    t = Tables(engine_url("postgresql", tmp_path))
    try:
        t.tx(t.qt.migrate)
        t.tx(t.qt.session_setup)

        def setting(c: Any) -> str:
            return t.engine.execute(c, "SHOW synchronous_commit").fetchone()[0]

        assert t.tx(setting) == "off"
        assert t.tx(lambda c: (t.qt.put(c, "a", "{}", "x"), setting(c))[1]) == "on"
        assert t.tx(setting) == "off"  # SET LOCAL: only that transaction
        [(row, receipt)] = lease(t, "a")
        assert t.tx(lambda c: (t.qt.ack(c, row.id, receipt), setting(c))[1]) == "off"
    finally:
        t.drop()


def test_a_connection_whose_set_up_failed_is_not_kept(tmp_path: Path) -> None:
    """``Connections`` kept a new connection whose ``on_connect`` (the broker's session
    set-up and table check) raised, and every later call used it without that set-up."""
    from outbox.storage.connections import Connections
    from outbox.storage.engines import engine_for_url

    url = f"sqlite:///{tmp_path / 'c.db'}"
    set_up: list[Any] = []

    def on_connect(conn: Any) -> None:
        set_up.append(conn)
        if len(set_up) == 1:
            raise RuntimeError("set-up refused")

    connections = Connections(engine_for_url(url), url, per_thread=False, on_connect=on_connect)
    with pytest.raises(RuntimeError, match="set-up refused"):
        connections.get()
    conn = connections.get()
    assert len(set_up) == 2 and conn is set_up[1]  # connected again, and set up
    assert connections.get() is conn and len(set_up) == 2
    connections.drop()
