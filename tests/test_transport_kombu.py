"""The ``outboxdb`` kombu transport through kombu's own API (Connection, SimpleQueue,
Producer/Consumer) on live SQLite, PostgreSQL, MariaDB (and SQL Server when
OUTBOX_TEST_MSSQL_URL is set): ack, reject, requeue, FIFO, native delay, expiry,
a killed receiver's message coming back after the visibility timeout, concurrent
receivers never sharing a message, fanout across connections. Each test has its
own queue tables (transport option ``queue_table``)."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from engine_support import engine_url
from kombu import Connection, Consumer, Exchange, Producer, Queue

import outbox.transport  # noqa: F401  (registers the outboxdb scheme)
from outbox.core.errors import ConfigError
from outbox.storage.engines import engine_for_url
from outbox.transport import drop_queue_tables

KINDS = ["sqlite", "postgresql", "mysql", "mssql"]


class Broker:
    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.url = f"outboxdb+{db_url}"
        self.table = f"kq_{uuid.uuid4().hex[:10]}"
        self.options = {"queue_table": self.table, "visibility_timeout": 3, "polling_interval": 0.2}

    def connect(self, **options: Any) -> Connection:
        return Connection(self.url, transport_options={**self.options, **options})

    def drop(self) -> None:
        drop_queue_tables(self.db_url, self.table)


@pytest.fixture(params=KINDS)
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    b = Broker(engine_url(request.param, tmp_path))
    yield b
    b.drop()


def get(queue: Any, timeout: float = 10.0) -> Any:
    return queue.get(block=True, timeout=timeout)


def test_round_trip_ack_reject_and_requeue(broker: Broker) -> None:
    with broker.connect() as conn:
        q = conn.SimpleQueue("work")
        q.put({"n": 1})
        q.put({"n": 2})
        q.put({"n": 3})
        m = get(q)
        assert m.payload == {"n": 1} and m.delivery_info["redelivered"] is False
        m.ack()
        m = get(q)
        assert m.payload == {"n": 2}
        m.reject()  # dropped
        m = get(q)
        assert m.payload == {"n": 3}
        m.requeue()
        m = get(q)
        assert m.payload == {"n": 3} and m.delivery_info["redelivered"] is True
        m.ack()
        with pytest.raises(Empty):
            q.get(block=True, timeout=0.5)
        assert q.qsize() == 0
        q.close()


def test_fifo_within_a_queue(broker: Broker) -> None:
    with broker.connect() as conn:
        q = conn.SimpleQueue("fifo")
        for n in range(30):
            q.put(n)
        got = []
        for _ in range(30):
            m = get(q)
            got.append(m.payload)
            m.ack()
        assert got == list(range(30))
        q.close()


def test_celery_eta_is_stored_invisible_until_due(broker: Broker) -> None:
    with broker.connect() as conn:
        q = conn.SimpleQueue("delayed")
        eta = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
        q.put({"later": True}, headers={"eta": eta})
        q.put({"now": True})
        started = time.monotonic()
        first = get(q)
        assert first.payload == {"now": True}
        first.ack()
        later = get(q, timeout=15)
        assert later.payload == {"later": True}
        assert time.monotonic() - started >= 1.5  # not before its eta (client/database clocks agree here)
        later.ack()
        q.close()


def test_expired_message_is_never_delivered(broker: Broker) -> None:
    with broker.connect() as conn:
        q = conn.SimpleQueue("ttl")
        q.put({"dies": True}, expiration=0.05)  # kombu: seconds; stored as expires_at
        q.put({"lives": True}, expiration=600)
        time.sleep(0.3)
        m = get(q)
        assert m.payload == {"lives": True}
        m.ack()
        with pytest.raises(Empty):
            q.get(block=True, timeout=0.5)
        q.close()


def test_an_idle_consumer_purges_expired_messages_of_every_queue(broker: Broker) -> None:
    """Expired messages in a queue nobody consumes (the pidbox of a worker gone, events) are
    deleted by any idle consumer of the table, all of them in one purge while full chunks
    come back. Before, the purge ran only in a poll that got past the idle probe, so an idle
    worker never purged, and one purge deleted one chunk per interval."""
    with broker.connect() as sender:
        q = sender.SimpleQueue("nobody-consumes")
        for n in range(50):
            q.put({"n": n}, expiration=0.05)
        q.close()
    time.sleep(0.2)
    with broker.connect(expired_purge_interval=1.0, expired_purge_batch=10) as conn:
        channel = conn.default_channel
        with Consumer(channel, [Queue("idle-work")], accept=["json"], callbacks=[]):
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.5)
        assert channel.db.run(lambda qt, c: qt.holds_any(c, "nobody-consumes")) is False


def test_a_countdown_longer_than_the_queues_message_ttl_is_still_delivered(broker: Broker) -> None:
    """The TTL counts from when the message becomes visible: a task retried with a countdown
    longer than its queue's TTL used to expire before it was due and was purged unseen."""
    with broker.connect(expired_purge_interval=0.1) as conn:
        q = conn.SimpleQueue(Queue("short-ttl", Exchange("short-ttl"), "short-ttl", message_ttl=0.5))
        eta = (datetime.now(UTC) + timedelta(seconds=1.5)).isoformat()
        q.put({"later": True}, headers={"eta": eta})
        m = get(q, timeout=15)
        assert m.payload == {"later": True}
        m.ack()
        q.close()


def test_a_celery_task_with_expires_is_delivered_after_it_for_the_worker_to_revoke(broker: Broker) -> None:
    """Celery 5.7 sends ``expires`` also as the message's expiration; the worker, not the
    broker, must see the expired task (it marks it REVOKED), as on Redis."""
    with broker.connect() as conn:
        q = conn.SimpleQueue("celery-expires")
        past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
        q.put({"task": True}, headers={"task": "proj.add", "id": "t1", "expires": past}, expiration=0.05)
        time.sleep(0.3)
        m = get(q)
        assert m.headers["expires"] == past
        m.ack()
        q.close()


def test_publish_arguments_json_cannot_encode_are_dropped_not_fatal(broker: Broker) -> None:
    """kombu turns unknown publish keyword arguments into message properties; like
    py-amqp, the transport drops the ones it cannot encode instead of failing the send."""
    class Signal:  # what Celery's own integration tests pass through apply_async
        pass

    with broker.connect() as conn:
        queue = Queue("odd-properties", Exchange("odd-properties"), "odd")
        Producer(conn.channel()).publish({"n": 1}, exchange=queue.exchange, routing_key="odd", declare=[queue],
                                         signal=Signal(), note="kept")
        q = conn.SimpleQueue(queue)
        m = get(q)
        assert m.payload == {"n": 1}
        assert m.properties.get("note") == "kept" and "signal" not in m.properties
        m.ack()
        q.close()


KILLED_RECEIVER = """
import os, sys, signal
import outbox.transport
from kombu import Connection
with Connection(sys.argv[1], transport_options={"queue_table": sys.argv[2], "visibility_timeout": 2}) as c:
    q = c.SimpleQueue("lease")
    m = q.get(block=True, timeout=20)
    print(m.payload["n"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lease, never acks
"""


def test_a_killed_receivers_message_comes_back_after_the_visibility_timeout(broker: Broker) -> None:
    with broker.connect(visibility_timeout=2) as conn:
        q = conn.SimpleQueue("lease")
        q.put({"n": 7})
        proc = subprocess.run([sys.executable, "-c", KILLED_RECEIVER, broker.url, broker.table],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9 and proc.stdout.strip() == "7", proc.stderr
        killed_at = time.monotonic()
        with pytest.raises(Empty):
            q.get(block=True, timeout=0.5)  # still leased to the dead receiver
        m = get(q, timeout=20)
        assert m.payload == {"n": 7} and m.delivery_info["redelivered"] is True
        assert time.monotonic() - killed_at >= 0.5
        m.ack()
        q.close()


def test_closing_a_connection_hands_unacked_messages_back_at_once(broker: Broker) -> None:
    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("warm")
        q.put("x")
        assert get(q).payload == "x"  # received, not acked
        q.close()
    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("warm")
        m = get(q, timeout=5)
        assert m.payload == "x" and m.delivery_info["redelivered"] is True
        m.ack()
        q.close()


@pytest.mark.parametrize("headers", ["{oops", "[]", '"text"', '{"properties": null}',
                                     '{"properties": {"delivery_info": []}}', '{"headers": [1]}'],
                         ids=["not-json", "array", "string", "null-properties", "array-delivery-info",
                              "array-headers"])
def test_a_row_that_is_not_a_message_is_dropped_alone(broker: Broker, caplog: pytest.LogCaptureFixture,
                                                      headers: str) -> None:
    """A damaged row (headers not JSON) failed every poll that leased it, with the rest of
    its batch left leased and unseen for the visibility timeout, again every timeout. So did
    headers that are JSON but not an envelope (an array, an object whose properties or
    headers are not objects), with a TypeError or AttributeError out of the poll, which
    stopped the worker (found in review)."""
    import logging

    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("damaged")
        for n in range(3):
            q.put({"n": n})
        engine = engine_for_url(broker.db_url)
        db = engine.connect(broker.db_url)
        try:
            cursor = db.cursor()
            ids = sorted(r[0] for r in engine.execute(cursor, f"SELECT id FROM {engine.qualify(broker.table)}"))
            engine.execute(cursor, f"UPDATE {engine.qualify(broker.table)} SET headers = ? WHERE id = ?",
                           [headers, ids[1]])
            db.commit()
        finally:
            db.close()
        received = []
        consumer = Consumer(conn.default_channel, [Queue("damaged")], accept=["json"], prefetch_count=10,
                            callbacks=[lambda body, message: (received.append(body), message.ack())])
        with caplog.at_level(logging.ERROR, logger="outbox.transport"), consumer:
            deadline = time.monotonic() + 10
            while len(received) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.5)
        assert received == [{"n": 0}, {"n": 2}]
        assert any(f"message {ids[1]} of queue damaged cannot be decoded" in r.getMessage() for r in caplog.records)
        assert q.qsize() == 0
        q.close()


@pytest.mark.parametrize("settle", ["ack", "reject", "requeue"])
def test_a_failed_ack_gives_its_prefetch_slot_back(broker: Broker, settle: str) -> None:
    """An ack (or reject) whose table update fails, the database lost past the retries for a
    moment: the message keeps its lease and comes back after the visibility timeout, and the
    consumer goes on receiving. Before, the failed settle left the tag in the prefetch window
    for the life of the channel: with prefetch 1 the consumer never received again."""
    from outbox.core.errors import BrokerDatabaseUnavailable

    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("failed-ack")
        q.put({"n": 1})
        q.put({"n": 2})
        channel = conn.default_channel
        got: list[tuple[Any, Any]] = []
        consumer = Consumer(channel, [Queue("failed-ack")], accept=["json"], prefetch_count=1,
                            callbacks=[lambda body, message: got.append((body, message))])

        def drain_until(count: int) -> None:
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.5)

        with consumer:
            drain_until(1)
            real = channel.db.run_counting

            def down(*args: Any, **kwargs: Any) -> Any:
                raise BrokerDatabaseUnavailable("the database went away during the ack")

            channel.db.run_counting = down
            try:
                with pytest.raises(BrokerDatabaseUnavailable):
                    message = got[0][1]
                    message.ack() if settle == "ack" else message.reject(requeue=settle == "requeue")
            finally:
                channel.db.run_counting = real  # the database is back
            drain_until(2)
        assert [body for body, _ in got] == [{"n": 1}, {"n": 2}]
        got[1][1].ack()
        assert channel.db.run(lambda qt, c: qt.holds_any(c, "failed-ack"))  # n=1: still leased, back after the timeout
        q.close()


def test_a_callback_that_raises_hands_the_rest_of_its_batch_back(broker: Broker) -> None:
    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("raising")
        for n in range(3):
            q.put({"n": n})

        def explode(body: Any, message: Any) -> None:
            raise RuntimeError("consumer bug")

        consumer = Consumer(conn.default_channel, [Queue("raising")], accept=["json"], prefetch_count=10,
                            callbacks=[explode])
        with consumer, pytest.raises(RuntimeError, match="consumer bug"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.5)
        assert q.qsize() == 2  # the two after the failed one are waiting again, not leased for an hour
        q.close()


def test_a_poll_that_fails_on_a_later_queue_delivers_what_it_leased(broker: Broker,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer of two queues: the lease of the second fails (the database lost between
    the two) after the first's committed. The first's message is delivered all the same;
    before, the poll raised and that message waited, leased to nobody, for the visibility
    timeout (an hour here)."""
    from outbox.core.errors import BrokerDatabaseUnavailable

    with broker.connect(visibility_timeout=3600) as conn:
        for name in ("first", "second"):
            conn.SimpleQueue(name).put({"queue": name})
        channel = conn.default_channel
        real = type(channel)._lease_queue

        def second_down(self: Any, queue: str, *args: Any) -> Any:
            if queue == "second":
                raise BrokerDatabaseUnavailable("the database went away")
            return real(self, queue, *args)

        monkeypatch.setattr(type(channel), "_lease_queue", second_down)
        got: list[Any] = []
        consumer = Consumer(channel, [Queue("first"), Queue("second")], accept=["json"], prefetch_count=10,
                            callbacks=[lambda body, message: (got.append(body), message.ack())])
        with consumer:
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError, BrokerDatabaseUnavailable):
                    conn.drain_events(timeout=0.5)
        assert got == [{"queue": "first"}]
        monkeypatch.undo()
        assert conn.SimpleQueue("second").get(timeout=10).payload == {"queue": "second"}


def test_size_purge_and_delete_if_empty_count_messages_whose_lease_ran_out(broker: Broker) -> None:
    """A message whose receiver's lease ran out is waiting again: counted and purged; and a
    queue holding only leased messages is not empty (they come back if their receiver dies)."""
    with broker.connect() as conn, broker.connect(visibility_timeout=0.5) as brief, broker.connect() as holder:
        q = conn.SimpleQueue("lapsed")
        q.put("a")
        q.put("b")
        assert Queue("lapsed")(brief.default_channel).get().payload == "a"  # leased for 0.5 s, never settled
        assert q.qsize() == 1
        time.sleep(1.0)
        assert q.qsize() == 2
        assert q.clear() == 2
        q.put("c")
        held = Queue("lapsed")(holder.default_channel).get()
        conn.default_channel.queue_delete("lapsed", if_empty=True)  # not empty: c is leased
        held.requeue()
        assert get(q).payload == "c"


@pytest.mark.parametrize("when", ["closed-while-down", "closed-when-back", "another-thread-acked-when-back"])
@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_late_ack_after_a_database_outage_settles_the_message(kind: str, when: str, tmp_path: Path) -> None:
    """The broker's database goes away (a TCP proxy cut, past the transport's retries) while
    an acks_late task runs; Celery then closes the connection (``collect``, as its consumer
    does) and reconnects. The message stays leased to the running task, nobody else gets it,
    and the task's late ack on the old channel deletes it: before, the close dropped its tag
    (requeueing it if the database was back), the ack skipped the table, and it ran again.
    ``another-thread-acked-when-back``: between the loss and the close another task's ack (a
    pool thread's) succeeds; the close requeued the running task all the same, as that
    success had reset the database's shared "available" flag."""
    from relay_e2e_support import Proxy

    direct = engine_url(kind, tmp_path)
    proxy = Proxy(target=("127.0.0.1", 5432 if kind == "postgresql" else 3306))
    broker = Broker(proxy.url_for(direct))
    try:
        worker = broker.connect(visibility_timeout=3600)
        q = worker.SimpleQueue("outage")
        q.put("task")
        q.put("finished")
        running, finished = get(q), get(q)
        assert (running.payload, finished.payload) == ("task", "finished")
        proxy.cut()
        with pytest.raises(worker.connection_errors):
            q.qsize()
        if when != "closed-while-down":
            proxy.restore()
        if when == "another-thread-acked-when-back":
            acker = threading.Thread(target=finished.ack)
            acker.start()
            acker.join(30)
        worker.collect()
        proxy.restore()
        with broker.connect() as other:
            with pytest.raises(Empty):
                other.SimpleQueue("outage").get(block=True, timeout=1.0)  # still leased to the running task
            running.ack()
            if not finished.acknowledged:
                finished.ack()
            assert other.default_channel.db.run(lambda qt, c: qt.holds_any(c, "outage")) is False
    finally:
        proxy.close()
        drop_queue_tables(direct, broker.table)


@pytest.mark.parametrize("gone", [False, True], ids=["retried", "database-gone"])
@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_lease_whose_commit_answer_is_lost_delivers_its_messages(kind: str, gone: bool, tmp_path: Path) -> None:
    """The connection breaks after the lease's COMMIT reached the database but before its
    answer came back. ``retried``: the transport retries on a new connection, and the retry
    must hand over what the committed lease took; it leased the next message instead, and the
    first stayed leased to nobody for the whole visibility timeout (an hour here), out of
    order. ``database-gone``: the proxy is cut from that moment, every retry fails, the
    receive raises a connection error and the consumer reconnects on a new transport, whose
    first lease must take back what the lost one holds; before, those messages waited for
    the visibility timeout too."""
    from relay_e2e_support import Proxy

    direct = engine_url(kind, tmp_path)
    proxy = Proxy(target=("127.0.0.1", 5432 if kind == "postgresql" else 3306))
    broker = Broker(proxy.url_for(direct))
    try:
        conn = broker.connect(visibility_timeout=3600)
        q = conn.SimpleQueue("lost-answer")
        q.put("first")
        q.put("second")
        cut = proxy.drop_answer_after(b"COMMIT", then_cut=gone)
        got = []
        if gone:
            with pytest.raises(conn.connection_errors):
                get(q, timeout=5)
            conn.collect()  # as Celery's consumer does before it reconnects
            proxy.restore()
            conn = broker.connect(visibility_timeout=3600)
            q = conn.SimpleQueue("lost-answer")
        got.append(get(q, timeout=5))
        assert cut.began.is_set()  # the lease's COMMIT ran and its answer was lost
        with contextlib.suppress(Empty):
            got.append(get(q, timeout=2))
        assert [m.payload for m in got] == ["first", "second"]
        for m in got:
            m.ack()
        assert conn.default_channel.db.run(lambda qt, c: qt.holds_any(c, "lost-answer")) is False
        q.close()
        conn.close()
    finally:
        proxy.close()
        drop_queue_tables(direct, broker.table)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_an_ack_whose_commit_answer_is_lost_is_done_and_not_reported_as_a_lost_lease(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The ack's COMMIT went through and only its answer was lost: the retry finds nothing to
    delete. The message is gone, as it should be, and no warning claims that its lease ran
    out and it was delivered again (it was not)."""
    from relay_e2e_support import Proxy

    direct = engine_url(kind, tmp_path)
    proxy = Proxy(target=("127.0.0.1", 5432 if kind == "postgresql" else 3306))
    broker = Broker(proxy.url_for(direct))
    try:
        with broker.connect(visibility_timeout=3600) as conn, caplog.at_level(logging.DEBUG, "outbox.transport"):
            q = conn.SimpleQueue("lost-ack-answer")
            q.put("only")
            message = get(q, timeout=5)
            cut = proxy.drop_answer_after(b"COMMIT")
            message.ack()
            assert cut.began.is_set()  # the ack's COMMIT ran and its answer was lost
            assert conn.default_channel.db.run(lambda qt, c: qt.holds_any(c, "lost-ack-answer")) is False
            with contextlib.suppress(Empty):
                assert get(q, timeout=1) is None, "the acked message came again"
            q.close()
    finally:
        proxy.close()
        drop_queue_tables(direct, broker.table)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("outbox.transport")]
    assert not [line for line in said if "changed nothing" in line], said
    assert [line for line in said if "was done by a try whose answer was lost" in line], said


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_receive_cut_off_before_its_commit_holds_its_rows_only_seconds(kind: str, tmp_path: Path) -> None:
    """Guard: a receiver whose network goes silent between its lease and its COMMIT leaves
    the server a transaction holding the rows' locks; the transport's sessions carry the
    engines' bounds (docs/relay.md, "A network cut"), so the server ends it after
    ``idle_transaction_timeout_s`` (5 s) and another receiver gets the message, instead of
    after TCP keepalive's two hours. The cut-off receiver, back, gets nothing."""
    from relay_e2e_support import Proxy

    direct = engine_url(kind, tmp_path)
    proxy = Proxy(target=("127.0.0.1", 5432 if kind == "postgresql" else 3306))
    broker = Broker(proxy.url_for(direct))
    results: list[Any] = []
    try:
        with broker.connect(visibility_timeout=3600) as cut_off:
            q = cut_off.SimpleQueue("silent")
            q.put("m")
            stall = proxy.stall_after(b"SKIP LOCKED", 12.0)

            def receive() -> None:
                try:
                    results.append(get(q, timeout=15).payload)
                except Empty:
                    results.append(None)

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
            assert stall.began.wait(10)
            with Broker(direct).connect(**{**broker.options, "visibility_timeout": 3600}) as other:
                m = get(other.SimpleQueue("silent"), timeout=20)
                waited = time.time() - stall.began_at
                m.ack()
            assert m.payload == "m" and waited < 10.0, waited  # the server's 5 s, not the 12 s stall
            thread.join(30)
            assert results == [None]
    finally:
        proxy.close()
        drop_queue_tables(direct, broker.table)


def test_concurrent_consumers_never_get_the_same_message(broker: Broker) -> None:
    total = 120
    with broker.connect() as conn:
        q = conn.SimpleQueue("shared")
        for n in range(total):
            q.put(n)
        q.close()
    seen: list[list[int]] = [[] for _ in range(3)]
    errors: list[BaseException] = []

    def consume(slot: int) -> None:
        try:
            with broker.connect() as conn:
                queue = Queue("shared", Exchange("shared"), "shared")

                def on_message(body: Any, message: Any) -> None:
                    seen[slot].append(body)
                    message.ack()

                with Consumer(conn, [queue], callbacks=[on_message], prefetch_count=5):
                    idle_since = time.monotonic()
                    while time.monotonic() - idle_since < 2.0:
                        before = len(seen[slot])
                        with contextlib.suppress(TimeoutError, OSError):
                            conn.drain_events(timeout=0.5)
                        if len(seen[slot]) != before:
                            idle_since = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    everything = [n for s in seen for n in s]
    assert sorted(everything) == list(range(total))  # every message once, none twice
    for s in seen:
        assert s == sorted(s)


def test_fanout_and_topic_routing_are_shared_between_connections(broker: Broker) -> None:
    fan = Exchange("bcast", type="fanout")
    topic = Exchange("events", type="topic")
    with broker.connect() as a, broker.connect() as b:
        qa = Queue("a.inbox", fan)
        qb = Queue("b.inbox", fan)
        qa(a.default_channel).declare()
        qb(b.default_channel).declare()
        qt = Queue("orders.all", topic, routing_key="orders.#")
        qt(b.default_channel).declare()
        with broker.connect() as sender:  # a third process-alike that bound nothing itself
            producer = Producer(sender.default_channel)
            producer.publish({"hi": 1}, exchange=fan, declare=[fan])
            producer.publish({"order": 1}, exchange=topic, routing_key="orders.created.eu", declare=[topic])
            producer.publish({"user": 1}, exchange=topic, routing_key="users.created", declare=[topic])
        for conn, name in ((a, "a.inbox"), (b, "b.inbox")):
            m = get(conn.SimpleQueue(name))
            assert m.payload == {"hi": 1}
            m.ack()
        sq = b.SimpleQueue(qt)
        m = get(sq)
        assert m.payload == {"order": 1}
        m.ack()
        with pytest.raises(Empty):
            sq.get(block=True, timeout=0.5)


def test_a_get_that_takes_back_a_doubtful_lease_of_several_hands_the_rest_back(broker: Broker) -> None:
    """A lease of three messages committed but its answer was lost (the process kept its
    receipt as doubtful); a single ``get`` takes the receipt's rows back, keeps the first and
    hands the other two back at once, instead of leaving them leased to nobody for the
    visibility timeout (an hour here)."""
    with broker.connect(visibility_timeout=3600) as conn:
        q = conn.SimpleQueue("doubt")
        for n in range(3):
            q.put({"n": n})
        channel = conn.default_channel
        receipt = uuid.uuid4().hex
        leased = channel.db.run(lambda qt, c: qt.lease(c, "doubt", 3, 3_600_000, receipt))
        assert len(leased) == 3 and q.qsize() == 0
        channel.db.doubt("doubt", receipt)
        first = channel.basic_get("doubt")  # kombu's Queue.get: one message, no consumer
        assert first is not None and json.loads(first.body) == {"n": 0}
        assert q.qsize() == 2  # the other two are waiting again
        first.ack()
        assert [get(q).payload for _ in range(2)] == [{"n": 1}, {"n": 2}]


def test_a_full_prefetch_window_does_not_poll_the_database_every_10_ms(broker: Broker,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's task channel holds a message it has not acked (prefetch 1: the window is
    full) while a second channel consumes another queue, as Celery's control channel does.
    The window is looked at every 10 ms, but the database no more often than an idle
    consumer polls it (here every 0.25 s); before, each 10 ms look probed the other
    channel's queue: about 100 round trips a second from every saturated worker."""
    from outbox.transport.database import Database

    with broker.connect(polling_interval=0.25) as conn:
        conn.SimpleQueue("work").put({"n": 1})
        held: list[Any] = []
        tasks = Consumer(conn.channel(), [Queue("work")], accept=["json"], prefetch_count=1,
                         callbacks=[lambda body, message: held.append(message)])  # never acked
        control = Consumer(conn.channel(), [Queue("ctl")], accept=["json"], callbacks=[])
        with tasks, control:
            deadline = time.monotonic() + 10
            while not held and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.2)
            assert held
            calls = {"n": 0}
            real_run, real_counting = Database.run, Database.run_counting

            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls["n"] += 1
                return real_run(self, *args, **kwargs)

            def run_counting(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls["n"] += 1
                return real_counting(self, *args, **kwargs)

            monkeypatch.setattr(Database, "run", run)
            monkeypatch.setattr(Database, "run_counting", run_counting)
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.2)
            monkeypatch.undo()
            assert 1 <= calls["n"] <= 20, calls  # every 0.25 s: about 8; every 10 ms: about 200
            held[0].ack()


def test_a_fanout_is_one_transaction(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fanout that fails on its third copy leaves no copy at all; sent again, every queue
    gets one. On SQLite, whose connection commits each statement by itself unless a
    transaction is begun, the first two copies used to stay (found in review)."""
    fan = Exchange("bcast", type="fanout")
    with broker.connect() as conn:
        queues = [Queue(f"q{i}.inbox", fan) for i in range(3)]
        for q in queues:
            q(conn.default_channel).declare()
        tables = type(conn.default_channel.db.qt)  # the engine's queue tables (PostgreSQL's put notifies)
        real, calls = tables.put, []

        def third_fails(self: Any, cursor: Any, queue: str, *args: Any, **kwargs: Any) -> None:
            calls.append(queue)
            if len(calls) == 3:
                raise RuntimeError("the third copy failed")
            real(self, cursor, queue, *args, **kwargs)

        monkeypatch.setattr(tables, "put", third_fails)
        with pytest.raises(RuntimeError, match="third copy"):
            Producer(conn.default_channel).publish({"n": 1}, exchange=fan, declare=[fan])
        monkeypatch.undo()
        assert [conn.SimpleQueue(q.name).qsize() for q in queues] == [0, 0, 0]
        Producer(conn.default_channel).publish({"n": 2}, exchange=fan, declare=[fan])
        assert [get(conn.SimpleQueue(q.name)).payload for q in queues] == [{"n": 2}] * 3


def test_a_queues_message_ttl_applies_to_messages_routed_by_other_connections(broker: Broker) -> None:
    """Celery's event and gossip queues declare a message TTL and are fed by other
    processes; without it a dead consumer's queue would grow for ever."""
    events = Exchange("evts", type="topic")
    with broker.connect() as consumer, broker.connect() as publisher:
        q = Queue("ev.short", events, routing_key="worker.#", message_ttl=0.2)
        q(consumer.default_channel).declare()
        producer = Producer(publisher.default_channel)
        producer.publish({"n": 1}, exchange=events, routing_key="worker.heartbeat", declare=[events])
        time.sleep(0.6)
        producer.publish({"n": 2}, exchange=events, routing_key="worker.heartbeat")
        sq = consumer.SimpleQueue(q)
        m = get(sq)
        assert m.payload == {"n": 2}
        m.ack()


def test_an_auto_delete_queue_goes_with_its_last_consumer(broker: Broker) -> None:
    """As on AMQP: when the last consumer of an auto-delete queue cancels (or its channel
    closes), the queue goes, bindings and messages; it kept taking a copy of every fanout
    message for ever (Celery's reply and broadcast queues)."""
    fan = Exchange("ad-fan", type="fanout")
    with broker.connect() as consumer, broker.connect() as sender:
        producer = Producer(sender.default_channel)
        got: list[Any] = []
        with Consumer(consumer, [Queue("ad.inbox", fan, auto_delete=True)],
                      callbacks=[lambda body, message: (got.append(body), message.ack())]):
            producer.publish({"n": 1}, exchange=fan, declare=[fan])
            consumer.drain_events(timeout=10)
        assert got == [{"n": 1}]
        producer.publish({"n": 2}, exchange=fan)
        db = sender.default_channel.db
        assert db.run(lambda qt, c: qt.table_bindings(c, "ad-fan")) == []
        assert db.run(lambda qt, c: qt.holds_any(c, "ad.inbox")) is False


def test_a_cancel_on_a_closed_channel_does_nothing(broker: Broker) -> None:
    """Celery's consumer, reconnecting after the broker's database was lost, closes the
    connection (kombu closes its channels and unhooks them) and then cancels its task and
    remote-control consumers on those closed channels, as kombu's own ``basic_cancel`` allows.
    It raised AttributeError ('NoneType' object has no attribute 'channels'), logged by Celery
    as "Error on restarting Control" and "... Tasks" on every reconnect (found in review)."""
    conn = broker.connect()
    channel = conn.channel()
    consumer = Consumer(channel, [Queue("closed", Exchange("closed"), "closed", auto_delete=True)], callbacks=[])
    consumer.consume()
    conn.close()
    assert channel.connection is None  # kombu's close_channel unhooks it
    consumer.cancel()  # Celery's Tasks and Control steps, after the close


def test_a_control_command_sent_to_a_killed_worker_is_not_run_by_the_next_of_its_name(broker: Broker) -> None:
    """A worker killed without closing leaves its remote-control queue bound (auto-delete,
    Celery's default, not exclusive). A command broadcast meanwhile (a shutdown) lands there;
    the next worker of that name must not run it once its ``expires`` passed before that
    worker began consuming. A command sent to the live worker still runs."""
    from kombu.pidbox import Mailbox

    mailbox = Mailbox("ctl", type="fanout", queue_exclusive=False, queue_ttl=300)
    ran: list[str] = []
    handlers = {"shutdown": lambda state, **kwargs: ran.append("shutdown")}
    with broker.connect() as killed, broker.connect() as client, broker.connect() as restarted:
        mailbox(killed).get_queue("w1@h")(killed.default_channel).declare()  # bound, then never cancelled
        mailbox(client)._broadcast("shutdown", timeout=0.2)
        time.sleep(0.5)
        mailbox(restarted).Node("w1@h", handlers=handlers, channel=restarted.default_channel).listen()
        with contextlib.suppress(TimeoutError, OSError):
            restarted.drain_events(timeout=1.5)
        assert ran == []
        mailbox(client)._broadcast("shutdown", timeout=5)
        restarted.drain_events(timeout=10)
        assert ran == ["shutdown"]


def test_a_control_command_sent_while_a_worker_reconnects_is_run_by_it(broker: Broker) -> None:
    """A worker whose broker database was lost (a cut, a restart) closes its connection and
    reconnects; its remote-control queue stays bound meanwhile, and a command broadcast then
    (a revoke, with Celery's 1 s timeout) waits there. It was meant for this live worker: its
    new consumer must run it. Before, the new channel's consumption began after the command's
    ``expires`` and dropped it as sent to a dead worker, so a task revoked during a database
    blip ran at its eta (found in review, with a real worker behind a TCP proxy)."""
    from kombu.pidbox import Mailbox

    mailbox = Mailbox("ctl", type="fanout", queue_exclusive=False, queue_ttl=300)
    ran: list[str] = []
    handlers = {"revoke": lambda state, **kwargs: ran.append("revoke")}
    with broker.connect() as client:
        lost = broker.connect()
        mailbox(lost).Node("w2@h", handlers=handlers, channel=lost.default_channel).listen()
        with contextlib.suppress(TimeoutError, OSError):
            lost.drain_events(timeout=0.3)
        for db in lost.transport._databases.values():
            db.lost = True  # a statement ran out of its retries: Celery closes and reconnects
        lost.close()  # the queue stays bound (the close follows a loss)
        mailbox(client)._broadcast("revoke", timeout=0.2)
        time.sleep(0.5)  # Celery's reconnect takes longer than the command's timeout
        with broker.connect() as reconnected:
            mailbox(reconnected).Node("w2@h", handlers=handlers, channel=reconnected.default_channel).listen()
            deadline = time.monotonic() + 5
            while not ran and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    reconnected.drain_events(timeout=0.5)
        assert ran == ["revoke"]


def test_a_control_command_sent_after_the_workers_clock_stepped_back_is_run(
        broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer of a remote-control queue drops a command whose ``expires`` passed before it
    began consuming, on the wall clock. The worker's host clock an hour ahead when it began (a
    VM restored, a host that booted ahead), then stepped back by NTP: for that hour every
    command sent to the live worker (ping, revoke, shutdown) had an ``expires`` before that
    beginning and was dropped as sent to an earlier consumer. It now counts the beginning as no
    later than now."""
    from kombu.pidbox import Mailbox

    import outbox.transport.channel as channel_module

    class HourAhead:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def time() -> float:
            return time.time() + 3600

    mailbox = Mailbox("ctl", type="fanout", queue_exclusive=False, queue_ttl=300)
    ran: list[str] = []
    handlers = {"ping": lambda state, **kwargs: ran.append("ping")}
    with broker.connect() as worker, broker.connect() as client:
        with monkeypatch.context() as ahead:
            ahead.setattr(channel_module, "time", HourAhead)
            mailbox(worker).Node("w3@h", handlers=handlers, channel=worker.default_channel).listen()
        mailbox(client)._broadcast("ping", timeout=5)  # the clock stepped back: the hour is gone
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, OSError):
                worker.drain_events(timeout=0.5)
        assert ran == ["ping"]

def test_a_worker_whose_app_name_has_a_reply_segment_polls_as_a_worker_not_as_a_client(tmp_path: Path) -> None:
    """A reply queue (``<id>.reply.<app>.pidbox``, a client awaiting replies for a second) makes
    the idle back-off stop at 0.05 s; a worker's own control queue (``<node>.<app>.pidbox``) at
    ``control_polling_interval``. Since the relay's app names its remote control after its outbox
    (``control_exchange``), a namespace with a ``reply`` segment (a schema or table named so,
    ``OUTBOX_NAMESPACE=svc.reply.orders``) made every idle worker read its table as a waiting
    client does, about 20 times a second instead of 4 on MariaDB (found in review)."""
    from kombu.pidbox import Mailbox

    broker = Broker(engine_url("sqlite", tmp_path))  # sends wake nobody: the ceiling applies
    mailbox = Mailbox("svc.reply.orders", type="fanout", queue_exclusive=False, queue_ttl=300)
    try:
        with broker.connect(polling_interval=1.0) as worker, broker.connect(polling_interval=1.0) as client:
            mailbox(worker).Node("celery@h", handlers={}, channel=worker.default_channel).listen()
            assert worker.transport._ceiling() == 0.25
            with Consumer(client.default_channel, [mailbox(client).reply_queue], callbacks=[], no_ack=True):
                assert client.transport._ceiling() == 0.05
    finally:
        broker.drop()


def test_postgresql_wakes_an_idle_consumer_at_once(tmp_path: Path) -> None:
    """With a 5 s idle ceiling, a send still reaches an idle, blocked consumer at once:
    LISTEN/NOTIFY (polling alone would take seconds after a few idle seconds)."""
    broker = Broker(engine_url("postgresql", tmp_path))
    try:
        got: list[float] = []
        sent: list[float] = []
        with broker.connect(polling_interval=5.0) as conn, broker.connect() as sender:
            queue = Queue("wake", Exchange("wake"), "wake")
            outbox_queue = sender.SimpleQueue("wake")

            def send() -> None:
                for n in range(3):
                    time.sleep(3.0)  # the consumer has backed off by now
                    sent.append(time.monotonic())
                    outbox_queue.put(n)

            def on_message(body: Any, message: Any) -> None:
                got.append(time.monotonic())
                message.ack()

            with Consumer(conn, [queue], callbacks=[on_message]):
                thread = threading.Thread(target=send)
                thread.start()
                deadline = time.monotonic() + 60
                while len(got) < 3 and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError, OSError):
                        conn.drain_events(timeout=10)
                thread.join()
        latencies = [g - s for g, s in zip(got, sent)]
        assert len(latencies) == 3 and max(latencies) < 1.0, latencies
    finally:
        broker.drop()


def test_a_fanout_wakes_the_idle_consumers_of_every_queue_it_reached_on_postgresql(tmp_path: Path) -> None:
    """A fanout's wake-up names every queue it reached, in one statement over an array of
    them (it was one ``pg_notify`` round trip per queue): three idle consumers, backed off
    towards a 5 s poll, each get the copy at once."""
    broker = Broker(engine_url("postgresql", tmp_path))
    try:
        fan = Exchange("wakefan", type="fanout")
        got: dict[str, float] = {}
        with contextlib.ExitStack() as stack:
            consumers = [stack.enter_context(broker.connect(polling_interval=5.0)) for _ in range(3)]
            sender = stack.enter_context(broker.connect())
            for n, conn in enumerate(consumers):
                def on_message(body: Any, message: Any, name: str = f"q{n}") -> None:
                    got[name] = time.monotonic()
                    message.ack()
                stack.enter_context(Consumer(conn, [Queue(f"wakefan{n}", fan)], callbacks=[on_message]))
            for conn in consumers:  # each drains once: idle, then blocked on its LISTEN
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.2)
            threading.Timer(3.0, lambda: sender.Producer().publish({"n": 1}, exchange=fan, routing_key="")).start()
            sent = time.monotonic() + 3.0
            results: list[threading.Thread] = []
            for conn in consumers:
                def drain(conn: Any = conn) -> None:
                    deadline = time.monotonic() + 15
                    while len(got) < 3 and time.monotonic() < deadline:
                        with contextlib.suppress(TimeoutError, OSError):
                            conn.drain_events(timeout=1)
                results.append(threading.Thread(target=drain))
                results[-1].start()
            for thread in results:
                thread.join(30)
        assert sorted(got) == ["q0", "q1", "q2"], got
        assert max(got.values()) - sent < 1.0, {q: t - sent for q, t in got.items()}
    finally:
        broker.drop()


def test_concurrent_sends_share_the_commit_flush_on_postgresql(tmp_path: Path) -> None:
    """PostgreSQL takes a database-wide lock when a transaction that NOTIFYs commits and holds
    it through the commit's WAL flush. Each send notified in its own durable transaction, so
    concurrent senders (a web server's processes) committed one at a time, every one waiting
    for the flush of the one before: 12 threads sent 600-750 messages/s here against about
    1,900 without the NOTIFY (found in review). The wake-up now goes in a statement of its own
    after the send's commit, which commits without waiting for the disk. A commit delay of
    100 ms (``commit_delay``, which sleeps before the flush) makes it plain: two senders of
    five messages each took 1.0 s one after the other, 0.6 s side by side."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url

    db_url = engine_url("postgresql", tmp_path)
    with psycopg.connect(make_conninfo(libpq_url(db_url)), autocommit=True) as admin:
        if not admin.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]:
            pytest.skip("commit_delay needs a superuser")
    delayed = db_url + ("&" if "?" in db_url else "?") + "options=-c%20commit_delay%3D100000%20-c%20commit_siblings%3D0"
    broker = Broker(delayed)
    try:
        conns = [broker.connect() for _ in range(2)]
        try:
            queues = [conn.SimpleQueue("flush") for conn in conns]
            for q in queues:
                q.put(0)  # connected, tables made
            threads = [threading.Thread(target=lambda q=q: [q.put(n) for n in range(5)]) for q in queues]
            started = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
            assert queues[0].qsize() == 12
        finally:
            for conn in conns:
                conn.close()
        assert elapsed < 0.85, f"{elapsed:.2f} s: the sends committed one at a time"
    finally:
        broker.drop()


def listeners(admin: Any, table: str) -> list[int]:
    """Backends whose last statement was the LISTEN of ``table``'s wake-up channel."""
    return [r[0] for r in admin.execute("SELECT pid FROM pg_stat_activity WHERE query = %s",
                                        [f'LISTEN "{table}_wake"']).fetchall()]


def test_a_process_that_stops_consuming_stops_listening_on_postgresql(tmp_path: Path) -> None:
    """A process that once waited (``inspect()``/``ping``, a ``result.get()``: a reply queue
    consumed for a second) and consumes nothing since kept its LISTEN connection open and
    never read it: the server keeps every notification until each listener has read it, so
    ``pg_notification_queue_usage()`` grew with every send of every process until sends
    failed. Now the last consumer's cancel closes the LISTEN connection."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url

    broker = Broker(engine_url("postgresql", tmp_path))
    admin = psycopg.connect(make_conninfo(libpq_url(broker.db_url)), autocommit=True)
    try:
        with broker.connect() as client, broker.connect() as sender:
            with Consumer(client.default_channel, [Queue("x.reply.celery.pidbox")], callbacks=[], no_ack=True):
                for _ in range(3):
                    with contextlib.suppress(TimeoutError, OSError):
                        client.drain_events(timeout=0.3)  # the idle wait opens the LISTEN connection
                assert listeners(admin, broker.table)
            q = sender.SimpleQueue("work")
            for n in range(20):
                q.put(n)  # each notifies the table's channel
            q.close()
            deadline = time.monotonic() + 5
            while listeners(admin, broker.table) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert listeners(admin, broker.table) == []
    finally:
        admin.close()
        broker.drop()


def test_a_busy_consumer_reads_its_wake_ups_on_postgresql(tmp_path: Path) -> None:
    """A worker that always finds messages never waits idle, and the idle wait was the only
    reader of its LISTEN connection: the notifications of every send piled up unread and held
    the server's notification queue. Now every poll reads what has arrived, without blocking."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url

    broker = Broker(engine_url("postgresql", tmp_path))
    admin = psycopg.connect(make_conninfo(libpq_url(broker.db_url)), autocommit=True)
    try:
        with broker.connect() as conn, broker.connect() as sender:
            got: list[Any] = []
            channel = conn.default_channel
            with Consumer(channel, [Queue("busy")], accept=["json"], prefetch_count=1,
                          callbacks=[lambda body, message: (got.append(body), message.ack())]):
                for _ in range(3):
                    with contextlib.suppress(TimeoutError, OSError):
                        conn.drain_events(timeout=0.3)  # idle: the LISTEN connection opens
                q = sender.SimpleQueue("busy")
                q.put(1)
                q.put(2)
                conn.drain_events(timeout=5)  # a delivery: the next poll comes at once, no idle wait
                assert got == [1]
                admin.execute(f"SELECT count(pg_notify('{broker.table}_wake', 'x' || g)) "
                              "FROM generate_series(1, 1000) g")
                time.sleep(0.3)  # arrived at the listener's socket
                conn.drain_events(timeout=5)
                assert got == [1, 2]
                assert channel.db.wait(0) is False  # nothing left unread
                q.close()
    finally:
        admin.close()
        broker.drop()


def test_a_wake_up_for_another_consumer_costs_an_idle_consumer_one_look_on_postgresql(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every send on a table wakes every idle consumer of it (one NOTIFY channel per table:
    another worker's queue, a reply, a beat tick). A woken consumer that finds nothing for
    itself goes back to waiting for the next wake-up; before, each wake-up restarted its
    10 ms back-off, about five more looks at the table per send per idle worker (found in
    review: 6 workers, 10 tasks/s, 58 index scans per task)."""
    from outbox.transport.database import Database

    broker = Broker(engine_url("postgresql", tmp_path))
    try:
        with broker.connect(polling_interval=1.0) as conn, broker.connect() as sender:
            producer = Producer(sender.default_channel)
            other = Queue("other", Exchange("other"), "other")
            with Consumer(conn, [Queue("idle", Exchange("idle"), "idle")], callbacks=[]):
                until = time.monotonic() + 2.5
                while time.monotonic() < until:  # backed off to the ceiling, LISTEN open
                    with contextlib.suppress(TimeoutError, OSError):
                        conn.drain_events(timeout=0.5)
                calls = {"n": 0}
                real_run = Database.run
                mine = conn.default_channel.db  # the sender's connection has a Database of its own

                def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                    calls["n"] += self is mine
                    return real_run(self, *args, **kwargs)

                stop = threading.Event()

                def send() -> None:
                    for n in range(10):
                        if stop.wait(0.2):
                            return
                        producer.publish({"n": n}, exchange=other.exchange, routing_key="other", declare=[other])

                monkeypatch.setattr(Database, "run", run)
                thread = threading.Thread(target=send)
                thread.start()
                until = time.monotonic() + 2.1
                while time.monotonic() < until:
                    with contextlib.suppress(TimeoutError, OSError):
                        conn.drain_events(timeout=0.3)
                monkeypatch.undo()
                stop.set()
                thread.join()
                # one look per wake-up (10) and at most two at the 1 s ceiling; before: about 50
                assert calls["n"] <= 16, calls
    finally:
        broker.drop()


@pytest.mark.parametrize("alone", [False, True])
def test_the_channel_sends_leases_and_acks_alone_where_the_tables_say_so(
        alone: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``QueueTables.writes_alone`` (SQL Server's, docs/transport.md, "A network cut before
    the COMMIT") is what makes the channel run a send, the lease and an ack alone: here on
    PostgreSQL, whose ``statement_alone`` really switches to autocommit, with its engine
    taken for one that cannot end an idle transaction, as SQL Server's, and as it is."""
    from outbox.storage.engines.postgres import PostgresEngine

    entered: list[bool] = []
    statement_alone = PostgresEngine.statement_alone

    @contextlib.contextmanager
    def watched(self: PostgresEngine, conn: Any) -> Iterator[None]:
        with statement_alone(self, conn):
            entered.append(conn.autocommit)
            yield

    monkeypatch.setattr(PostgresEngine, "statement_alone", watched)
    monkeypatch.setattr(PostgresEngine, "ends_idle_transactions", not alone)
    # The wake-up after a send is a statement of its own, alone on every engine that has one
    # (test_concurrent_sends_share_the_commit_flush_on_postgresql): not one of the writes here.
    from outbox.transport.channel import Channel
    monkeypatch.setattr(Channel, "_wake", lambda self, queues: None)
    broker = Broker(engine_url("postgresql", tmp_path))
    try:
        with broker.connect() as conn:
            q = conn.SimpleQueue("alone")
            q.put({"n": 1})
            sent = len(entered)
            m = get(q)
            leased = len(entered)
            m.ack()
            assert m.payload == {"n": 1}
            if alone:  # each step ran alone at least once
                assert 0 < sent < leased < len(entered), (sent, leased, entered)
            else:
                assert not entered, entered
            assert all(entered)  # in autocommit while inside
            q.put({"n": 2})
            assert get(q).payload == {"n": 2}  # and the connection back in manual commit works on
    finally:
        broker.drop()


def test_bad_urls_and_options_fail_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unsupported database URL scheme 'oracle'"):
        Connection("outboxdb+oracle://u@h/db").connect()
    url = f"outboxdb+sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigError, match="visibility_timeout"), \
            Connection(url, transport_options={"visibility_timeout": 0}) as conn:
        _ = conn.default_channel
    with pytest.raises(ConfigError, match="control_polling_interval=0.0 must be > 0"), \
            Connection(url, transport_options={"control_polling_interval": 0}) as conn:
        _ = conn.default_channel
    with Connection(url) as conn, pytest.raises(ValueError, match="(exchange|queue) name is 300 characters"):
        conn.SimpleQueue("q" * 300).put(1)


def test_the_connection_info_celery_replies_with_shows_no_password(tmp_path: Path) -> None:
    """``celery inspect stats`` replies with the broker connection's ``info()`` less its
    ``password``. kombu keeps a URL it does not parse whole as the hostname, so a worker on
    ``outboxdb+postgresql://app:secret@db/app`` showed the database password to anyone who
    could run ``inspect`` (found in review). The password now travels in kombu's own password
    field: a clone of the connection (kombu's pools, reconnects) still connects."""
    from urllib.parse import urlsplit

    url = engine_url("postgresql", tmp_path)
    parts = urlsplit(url)
    if parts.password is None:  # the suite's server trusts local connections: any password does
        url = url.replace(f"//{parts.username}@", f"//{parts.username}:Sup3r%2Fs3cret@", 1)
    secret = urlsplit(url).password
    assert secret
    table = f"kq_{uuid.uuid4().hex[:10]}"
    try:
        with Connection(f"outboxdb+{url}", transport_options={"queue_table": table}) as conn:
            conn.SimpleQueue("info").put({"n": 1})
            info = conn.info()
            info.pop("password", None)  # as Celery's worker does before it replies
            assert secret not in repr(info), info
            assert secret not in conn.as_uri()
            assert conn.transport.database_url == url
            with conn.clone() as clone:
                assert clone.transport.database_url == url
                assert get(clone.SimpleQueue("info")).payload == {"n": 1}
    finally:
        drop_queue_tables(url, table)


def test_a_connection_killed_by_the_server_is_replaced_without_losing_a_message(tmp_path: Path) -> None:
    """PostgreSQL terminates the transport's session (a failover, an admin): the next
    operation reconnects and carries on."""
    broker = Broker(engine_url("postgresql", tmp_path))
    try:
        with broker.connect() as conn:
            q = conn.SimpleQueue("resilient")
            q.put(1)
            db = conn.default_channel.db
            pid = db.run(lambda qt, c: c.execute("SELECT pg_backend_pid()").fetchone()[0])
            killer = engine_for_url(broker.db_url).connect(broker.db_url)
            killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            killer.commit()
            killer.close()
            q.put(2)
            got = [get(q), get(q)]
            assert [m.payload for m in got] == [1, 2]
            for m in got:
                m.ack()
            assert db.run(lambda qt, c: c.execute("SELECT pg_backend_pid()").fetchone()[0]) != pid
            q.close()
    finally:
        broker.drop()


def test_a_send_before_a_new_listen_connection_is_not_waited_through_on_postgresql(tmp_path: Path) -> None:
    """The last consumer's cancel closes the LISTEN connection and the next idle wait opens
    another: a message sent in between notified nobody, and that wait slept its whole
    timeout over it (Celery's own `inspect().active_queues()` test got no reply in time,
    found in a CI rehearsal). A wait that has just opened its LISTEN connection looks again
    first."""
    from outbox.transport.database import Database

    url = engine_url("postgresql", tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    db = Database(url, table, None, create=True)
    try:
        db.connection()
        db.stop_listening()  # as after a consumer's cancel
        assert db.wait(5.0) is True  # opened its LISTEN connection: look again at once
        assert db.wait(0.2) is False  # then it waits for sends as before
    finally:
        db.close()
        drop_queue_tables(url, table)
