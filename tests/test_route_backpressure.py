"""Per-route back-pressure and outage logging (issue 14, items 5, 7 and 9), below the
worker: the relay's logic on a real SQLite store with a scripted publisher, the route gate
and outage log shared through a real Redis, and the real publisher against RabbitMQ with a
queue that refuses messages. End to end with workers: tests/test_operations_e2e.py."""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from publisher_support import make_message
from services import AMQP_URL, REDIS_URL, require

from outbox import Status, enqueue
from outbox.core.model import OutboxMessage
from outbox.domain.chains import split_chains
from outbox.publisher import (
    ChainResult,
    FailureKind,
    KombuPublisher,
    Pipelined,
    Publisher,
    PublishFailure,
    refused_by_route,
)
from outbox.relay import Breaker, FileState, Outage, RedisState, RelayContext, RelayOptions, RouteGate, handle_publish
from outbox.storage.store import OutboxStore


def add(conn: sqlite3.Connection, aggregate: str, topics: Sequence[str]) -> list[int]:
    ids = [enqueue(conn, topic=topic, aggregate_type="order", aggregate_id=aggregate, payload={"n": n})
           for n, topic in enumerate(topics)]
    conn.commit()
    return ids


def rows(store: OutboxStore) -> dict[int, tuple[int, int, bool]]:
    """id -> (status, attempts, has a retry time)."""
    with store.transaction() as cursor:
        found = store.engine.execute(cursor, f"SELECT id, status, attempts, next_retry_at FROM {store.engine.table}")
        return {int(r[0]): (int(r[1]), int(r[2]), r[3] is not None) for r in found.fetchall()}


class RefusingPublisher(Publisher):
    """Publishes in memory, except that every event of a route in ``full`` is nacked, as
    RabbitMQ nacks a message a full ``reject-publish`` queue refuses."""

    def __init__(self, full: set[str]) -> None:
        self.full = full
        self.sent: list[int] = []
        self.calls = 0

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *,
                       pipelined: Pipelined | None = None, deadline: float | None = None) -> list[ChainResult]:
        self.calls += 1
        results = []
        for chain in chains:
            published: list[int] = []
            failure = None
            for m in chain:
                if m.topic in self.full:
                    failure = refused_by_route(m.topic, "ex")
                    break
                published.append(m.id)
                self.sent.append(m.id)
            results.append(ChainResult(tuple(published), chain[len(published)].id if failure else None, failure))
        return results

    def close(self) -> None:
        pass


def test_a_refused_route_pauses_alone_without_attempts_or_breaker(sqlite_store: OutboxStore, conn: sqlite3.Connection,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    a = add(conn, "a", ["orders.a", "orders.a"])
    b = add(conn, "b", ["orders.b", "orders.b"])
    mixed = add(conn, "m", ["orders.b", "orders.a", "orders.b"])
    publisher = RefusingPublisher({"orders.a"})
    breaker, routes = Breaker(), RouteGate()
    options = RelayOptions(route_pause_s=20, route_pause_max_s=60)
    with caplog.at_level(logging.DEBUG, logger="outbox.relay"):
        outcomes = handle_publish(RelayContext(sqlite_store, publisher, options=options, breaker=breaker, routes=routes),
                                  split_chains(sqlite_store.claim(100).messages))
    assert breaker.open_for() == 0  # claims go on
    assert 19 < routes.paused("orders.a") <= 20 and routes.paused("orders.b") == 0
    state = rows(sqlite_store)
    assert [state[i][0] for i in b] == [Status.DONE] * 2
    assert state[mixed[0]][0] == Status.DONE  # the prefix before the refused route went
    for i in a + mixed[1:]:
        assert state[i] == (Status.PENDING, 0, True), (i, state[i])  # released, due after the pause, no attempt
    assert {o.kind for o in outcomes if o.kind} == {"backpressure"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "route 'orders.a' refuses messages" in warnings[0].getMessage()

    # While the route is paused, its events are not even sent: released again with the
    # remaining pause, and the other routes flow.
    with conn:
        conn.execute("UPDATE outbox SET next_retry_at = NULL")
    more_b = add(conn, "b2", ["orders.b"])
    publisher.full.clear()
    handle_publish(RelayContext(sqlite_store, publisher, options=options, breaker=breaker, routes=routes),
                   split_chains(sqlite_store.claim(100).messages))
    state = rows(sqlite_store)
    assert state[more_b[0]][0] == Status.DONE
    assert all(state[i] == (Status.PENDING, 0, True) for i in a + mixed[1:])
    assert not set(a) & set(publisher.sent)


def test_a_refused_routes_long_chain_does_not_hold_the_other_routes_back(sqlite_store: OutboxStore,
                                                                         conn: sqlite3.Connection) -> None:
    """One aggregate of a refused route with more rows than a claim window: its claimed
    prefix is released with the pause, and the rest of it, still pending, fills every
    window from then on. The other routes must flow meanwhile: a claim that found nothing
    reads past those rows (docs/internals.md, "Claim windows"). Before, every claim came
    back empty until the pause ended."""
    hot = add(conn, "hot", ["orders.a"] * (3 * sqlite_store.engine.claim_window(100)))
    other = add(conn, "b", ["orders.b"])
    publisher = RefusingPublisher({"orders.a"})
    context = RelayContext(sqlite_store, publisher, options=RelayOptions(route_pause_s=20, route_pause_max_s=60),
                           breaker=Breaker(), routes=RouteGate())
    first = sqlite_store.claim(100).messages
    assert [m.id for m in first] == hot[:100]  # the oldest chain, cut at the batch
    handle_publish(context, split_chains(first))
    assert rows(sqlite_store)[hot[0]] == (Status.PENDING, 0, True)  # released until the pause ends
    second = sqlite_store.claim(100).messages
    assert [m.id for m in second] == other
    handle_publish(context, split_chains(second))
    assert rows(sqlite_store)[other[0]][0] == Status.DONE and publisher.sent == other


def test_route_pause_grows_while_refused_and_resets_after_a_quiet_spell() -> None:
    gate = RouteGate()
    assert gate.refuse("r", 1.0, 8.0, now=100.0) == (1.0, True)
    assert gate.refuse("r", 1.0, 8.0, now=100.5) == (0.5, False)  # one pause per refusal spell
    assert gate.refuse("r", 1.0, 8.0, now=101.2) == (2.0, True)  # refused right after: doubled
    assert gate.refuse("r", 1.0, 8.0, now=103.5) == (4.0, True)
    assert gate.refuse("r", 1.0, 8.0, now=107.6) == (8.0, True)
    assert gate.refuse("r", 1.0, 8.0, now=115.7) == (8.0, True)  # capped
    assert gate.refuse("r", 1.0, 8.0, now=200.0) == (1.0, True)  # quiet for long: back to the base
    assert gate.paused("other", now=200.0) == 0


def test_a_thread_reading_the_route_gate_while_another_refuses_a_route_sees_a_whole_map() -> None:
    """A process's threads share its gate (Dramatiq's worker threads, Celery's ``--pool
    threads``): ``any_paused`` iterated the map outside the lock while ``refuse`` added and
    dropped routes under it, and the publishing thread died with "dictionary changed size
    during iteration" (found in review). Many routes, all past their pause, so each read
    walks the whole map while the other thread refuses new routes."""
    gate = RouteGate()
    gate._routes.update({f"old.{i}": (1000.0, 1000.0) for i in range(20_000)})
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                assert gate.any_paused(now=1500.0) in (False, True)
                gate.paused("old.1", now=1500.0)
        except BaseException as exc:  # what the test looks for
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often: a walk of the map is cut short
    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 1.0
        refused = 0
        while not errors and time.monotonic() < deadline and refused < 2000:
            gate.refuse(f"new.{refused}", 1.0, 8.0, now=1500.0)
            refused += 1
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert gate.any_paused(now=1500.0) and gate.paused("new.0", now=1500.0) == 1.0


def test_route_pauses_are_shared_through_redis() -> None:
    require("Redis", "127.0.0.1", 6379)
    key = f"outbox-test-{uuid.uuid4().hex[:10]}:routes"
    one, two = RouteGate(RedisState(REDIS_URL), key), RouteGate(RedisState(REDIS_URL), key)
    try:
        assert one.refuse("orders.full", 5.0, 30.0) == (5.0, True)
        assert 4 < two.paused("orders.full") <= 5 and two.paused("orders.ok") == 0
        assert two.refuse("orders.full", 5.0, 30.0)[1] is False  # already paused by the other worker
        assert 0 < one.state.client.pttl(key) <= 95_000
    finally:
        one.state.client.delete(key)


def test_an_outage_logs_one_warning_and_one_end_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("outbox.test.outage")
    outage = Outage("database", "postgresql://app:***@db/app", "Claims retry every tick.", logger)
    with caplog.at_level(logging.DEBUG, logger="outbox.test.outage"):
        outage.ok()  # nothing to say
        for _ in range(20):
            outage.failed(ConnectionRefusedError("connection refused"))
        outage.ok()
        outage.ok()
    levels = [r.levelno for r in caplog.records]
    assert levels.count(logging.WARNING) == 1 and levels.count(logging.INFO) == 1
    assert levels.count(logging.DEBUG) == 19
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning == ("outbox: database unreachable (postgresql://app:***@db/app): ConnectionRefusedError: "
                       "connection refused. Claims retry every tick.")
    assert "database reachable again" in next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_a_claim_on_a_missing_table_says_to_migrate_not_that_the_database_is_down(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker pointed at a table that does not exist (OUTBOX_TABLE misspelt, `outbox
    migrate` not run) logged "database unreachable": the claim now says what to do."""
    from outbox.core.errors import StoreError
    from outbox.storage.store import OutboxStore

    store = OutboxStore(f"sqlite:///{tmp_path / 'o.db'}", table="nosuch")
    try:
        with pytest.raises(StoreError, match="table \"nosuch\" missing: run `outbox migrate`") as raised:
            store.claim(10)
    finally:
        store.close()
    logger = logging.getLogger("outbox.test.outage")
    with caplog.at_level(logging.WARNING, logger="outbox.test.outage"):
        Outage("database", "sqlite:///o.db", "Claims retry every tick.", logger).failed(raised.value)
    assert caplog.records[0].getMessage().startswith(
        'outbox: database cannot be used (sqlite:///o.db): StoreError: table "nosuch" missing: run `outbox migrate`')


def test_an_outage_is_announced_by_one_worker_through_redis(caplog: pytest.LogCaptureFixture) -> None:
    require("Redis", "127.0.0.1", 6379)
    key = f"outbox-test-{uuid.uuid4().hex[:10]}:outage"
    logger = logging.getLogger("outbox.test.outage2")
    one = Outage("database", "db", "meanwhile", logger, RedisState(REDIS_URL), key)
    two = Outage("database", "db", "meanwhile", logger, RedisState(REDIS_URL), key)
    try:
        with caplog.at_level(logging.INFO, logger="outbox.test.outage2"):
            one.failed("down")
            two.failed("down")
            two.ok()
            one.ok()
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    finally:
        one.state.client.delete(key)


def test_unknown_publish_transport_is_fatal_not_retriable() -> None:
    """kombu raises KeyError for a scheme it does not know: a configuration error, which
    stops claims (FATAL) instead of spending every event's attempts."""
    with KombuPublisher("amqpx://guest:Secr3tPass@127.0.0.1//", "ex") as publisher:
        result = publisher.publish_chain([make_message(1)])
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL
    assert "OUTBOX_PUBLISH_URL" in result.failure.reason and "Secr3tPass" not in result.failure.reason


# -- the real publisher against RabbitMQ -------------------------------------------------------

def test_rabbitmq_a_full_queue_stops_only_the_chains_of_its_route() -> None:
    from kombu import Connection, Exchange, Queue

    require("RabbitMQ", "127.0.0.1", 5672)
    name = f"outbox-test-{uuid.uuid4().hex[:10]}"
    conn = Connection(AMQP_URL, connect_timeout=3)
    channel = conn.channel()
    exchange = Exchange(name, type="topic", durable=True)
    exchange(channel).declare()
    full = Queue(f"{name}-a", exchange=exchange, routing_key="orders.a", exclusive=True, auto_delete=True,
                 queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"})(channel)
    other = Queue(f"{name}-b", exchange=exchange, routing_key="orders.b", exclusive=True, auto_delete=True)(channel)
    full.declare()
    other.declare()
    try:
        with KombuPublisher(AMQP_URL, name) as publisher:
            results = publisher.publish_chains([
                [make_message(1, "orders.a"), make_message(2, "orders.a")],
                [make_message(11, "orders.b"), make_message(12, "orders.b"), make_message(13, "orders.b")],
                [make_message(21, "orders.b"), make_message(22, "orders.a"), make_message(23, "orders.b")],
            ])
        assert results[0].published == (1,) and results[0].failed_id == 2
        assert results[0].failure is not None and results[0].failure.kind is FailureKind.BACKPRESSURE
        assert results[0].failure.route == "orders.a"
        assert results[1] == ChainResult(published=(11, 12, 13))  # the other route flowed on
        assert results[2].published == (21,) and results[2].failed_id == 22
        assert results[2].failure is not None and results[2].failure.route == "orders.a"
        got = []
        while (message := other(channel).get(no_ack=True)) is not None:
            got.append(message.headers["outbox_id"])
        assert sorted(got) == [11, 12, 13, 21]
    finally:
        exchange(channel).delete()
        conn.release()


def test_a_connection_failure_is_broker_wide(tmp_path: Path) -> None:
    """Nothing listens on the port: back-pressure of the whole broker (no route), which
    the relay answers with the breaker."""
    with KombuPublisher("amqp://guest:guest@127.0.0.1:1//", "ex", connect_timeout=0.5, connect_retries=0) as p:
        result = p.publish_chain([make_message(1)])
    assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE
    assert result.failure.route is None
    assert isinstance(result.failure, PublishFailure)


def test_file_backed_route_pauses_and_outages_are_shared_by_processes_of_a_host(tmp_path: Path) -> None:
    """Celery brokers other than Redis: the processes of one host share a file."""
    one, two = RouteGate(FileState(str(tmp_path)), "routes"), RouteGate(FileState(str(tmp_path)), "routes")
    assert one.refuse("orders.a", 5.0, 30.0)[1] is True
    one.refuse("orders.c", 5.0, 30.0)
    assert 4 < two.paused("orders.a") <= 5 and 4 < two.paused("orders.c") <= 5 and two.paused("orders.b") == 0
    first = Outage("database", "db", "meanwhile", state=FileState(str(tmp_path)), key="outage")
    second = Outage("database", "db", "meanwhile", state=FileState(str(tmp_path)), key="outage")
    assert first._begin() is True and second._begin() is False
    assert second._end() is True and first._end() is False
