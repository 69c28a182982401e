"""PostgreSQL LISTEN/NOTIFY (``outbox.relay.listen``): the channel, the writer's NOTIFY inside its
transaction, the listener thread and its reconnects, and a real worker that claims in its
main process when notified (no beat). Helpers shared with tests/test_wake.py."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from relay_e2e_support import Proxy
from services import POSTGRES_URL, REDIS_URL, require
from wake_support import CountingDestination, Workers, event, wait_done

from outbox import enqueue
from outbox.core.config import reset_settings
from outbox.relay.listen import Listener, Subscriber, channel_for, notify_channel
from outbox.storage.store import OutboxStore

# -- PostgreSQL LISTEN/NOTIFY --------------------------------------------------------------------

def test_channel_names() -> None:
    assert channel_for("outbox") == "outbox_outbox"
    assert channel_for("events", "app") == "outbox_app_events"
    long = channel_for("t" * 60, "s" * 20)
    assert long.startswith("outbox_") and len(long) <= 63 and long == channel_for("t" * 60, "s" * 20)


def test_notify_is_opt_in_and_postgresql_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert notify_channel("postgresql", "outbox", None) is None
    monkeypatch.setenv("OUTBOX_RELAY_LISTEN", "1")
    reset_settings()
    assert notify_channel("postgresql", "outbox", None) == "outbox_outbox"
    assert notify_channel("sqlite", "outbox", None) is None
    monkeypatch.setenv("OUTBOX_RELAY_LISTEN_CHANNEL", "relay_wake")
    reset_settings()
    assert notify_channel("postgresql", "outbox", None) == "relay_wake"


class Notified:
    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.event.set()

    def wait(self, timeout: float) -> bool:
        got = self.event.wait(timeout)
        self.event.clear()
        return got


@pytest.fixture
def listening(store: OutboxStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Listener, Notified]]:
    monkeypatch.setenv("OUTBOX_RELAY_LISTEN", "1")
    reset_settings()
    notified = Notified()
    listener = Listener(POSTGRES_URL, channel_for(store.engine.table_name), notified, poll_s=0.2, backoff_s=0.1)
    listener.start()
    assert listener.ready.wait(10), "the listener did not connect"
    assert notified.wait(5)  # the catch-up wake on connect
    yield listener, notified
    listener.stop()
    assert not listener.is_alive()


@pytest.mark.parametrize("kind", ["postgresql"])
def test_committed_enqueue_notifies_and_rolled_back_does_not(store: OutboxStore, url: str,
                                                              listening: tuple[Listener, Notified]) -> None:
    listener, notified = listening
    table = store.engine.table_name
    conn = store.engine.connect(url)
    try:
        for n in range(5):
            enqueue(conn, table=table, **event(n))
        assert not notified.wait(0.5)  # not before the commit
        conn.commit()
        assert notified.wait(5)
        time.sleep(0.3)
        assert listener.notifications == 1  # five enqueues in one transaction: one notification

        enqueue(conn, table=table, **event(9))
        conn.rollback()
        assert not notified.wait(1.0)
        assert listener.notifications == 1
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["postgresql"])
def test_notifying_enqueue_keeps_message_id_idempotence(store: OutboxStore, url: str,
                                                         listening: tuple[Listener, Notified]) -> None:
    """The insert and its notification are one statement on PostgreSQL: a message_id already
    stored still returns the stored row's id and writes nothing."""
    listener, notified = listening
    table = store.engine.table_name
    conn = store.engine.connect(url)
    try:
        first = enqueue(conn, table=table, message_id="m-1", **event(1))
        conn.commit()
        assert notified.wait(5)
        again = enqueue(conn, table=table, message_id="m-1", **event(2))
        conn.commit()
        assert again == first
        cursor = conn.cursor()
        cursor.execute(f"SELECT COUNT(*) FROM {table}")
        assert cursor.fetchone()[0] == 1
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["postgresql"])
def test_listener_reconnects_after_its_connection_is_killed(store: OutboxStore, url: str,
                                                             listening: tuple[Listener, Notified]) -> None:
    listener, notified = listening
    pid = listener.backend_pid
    admin = store.engine.connect(url)
    try:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        admin.commit()
        deadline = time.monotonic() + 15
        while (listener.connects < 2 or not listener.ready.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.connects >= 2 and listener.ready.is_set() and listener.backend_pid != pid
        notified.wait(2)  # the catch-up wake after reconnecting
        before = listener.notifications
        enqueue(admin, table=store.engine.table_name, **event(1))
        admin.commit()
        assert notified.wait(5) and listener.notifications == before + 1
    finally:
        admin.close()


@pytest.mark.parametrize("kind", ["postgresql"])
def test_no_notification_when_listen_is_off(store: OutboxStore, url: str) -> None:
    notified = Notified()
    listener = Listener(POSTGRES_URL, channel_for(store.engine.table_name), notified, poll_s=0.2)
    listener.start()
    try:
        assert listener.ready.wait(10) and notified.wait(5)
        conn = store.engine.connect(url)
        try:
            enqueue(conn, table=store.engine.table_name, **event(1))  # OUTBOX_RELAY_LISTEN unset
            conn.commit()
        finally:
            conn.close()
        assert not notified.wait(1.0) and listener.notifications == 0
    finally:
        listener.stop()


@pytest.mark.parametrize("kind", ["postgresql"])
def test_listen_drives_a_real_worker_without_beat(store: OutboxStore, url: str, counting_destination: CountingDestination,
                                                  workers: Workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain ``enqueue`` + commit, no wake call, no beat: only the worker's LISTEN thread
    can make it claim."""
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=url, OUTBOX_TABLE=store.engine.table_name,
                      OUTBOX_RELAY_LISTEN="1", OUTBOX_CLAIM_INTERVAL_S="3600")
    log = workers.start(env, "-c", "2")
    deadline = time.monotonic() + 20
    while "outbox listen: listening on" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
        time.sleep(0.1)
    monkeypatch.setenv("OUTBOX_RELAY_LISTEN", "1")
    reset_settings()
    conn = store.engine.connect(url)
    try:
        for n in range(3):
            time.sleep(0.5)  # past the claims the previous row caused: only a notification claims now
            outbox_id = enqueue(conn, table=store.engine.table_name, **event(n))
            conn.commit()
            assert wait_done(store, [outbox_id], 10) < 5, log.read_text(errors="replace")[-4000:]
        conn.rollback()
    finally:
        conn.close()
    assert counting_destination.count() == 3
    # The worker's main process claimed them itself (the in-process claim), no Celery hop.
    assert "INFO/MainProcess] outbox claimed 1 rows" in log.read_text(errors="replace")


# -- the Redis wake channel: writers PUBLISH, the worker's main process subscribes ------------------

def test_subscriber_fires_on_connect_and_on_every_publish() -> None:
    require("Redis", "127.0.0.1", 6379)
    import redis

    channel = f"outbox-wake-test-{uuid.uuid4().hex[:10]}:notify"
    notified = Notified()
    subscriber = Subscriber(REDIS_URL, channel, notified, poll_s=0.2)
    subscriber.start()
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        assert subscriber.ready.wait(10) and notified.wait(5)  # the catch-up wake on connect
        deadline = time.monotonic() + 10
        while client.publish(channel, b"") == 0:  # until the subscription is in place
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert notified.wait(5)
        assert client.publish(channel, b"") == 1 and notified.wait(5)
    finally:
        subscriber.stop()
        client.close()
    assert not subscriber.is_alive()
    # Nobody subscribes any more: a writer's PUBLISH reaches 0 receivers and it sends a claim message.
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        assert client.publish(channel, b"") == 0
    finally:
        client.close()


def test_subscriber_notices_a_connection_that_stopped_answering_and_subscribes_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """Redis behind a path that stops answering without a reset (a host gone, a NAT's idle
    timeout: ``Proxy.black_hole``). Redis still counts the subscriber, so writers' PUBLISH
    reports a receiver and sends no claim message, and the wake-ups are lost. The subscriber
    waited on that connection for good, and latency fell back to beat's tick (found in
    review); now an unanswered PING ends it within a bound, it subscribes again once the path
    is back, says each once, and a publish wakes it."""
    require("Redis", "127.0.0.1", 6379)
    import redis

    channel = f"outbox-wake-test-{uuid.uuid4().hex[:10]}:notify"
    proxy = Proxy(("127.0.0.1", 6379))
    notified = Notified()
    subscriber = Subscriber(proxy.url_for(REDIS_URL), channel, notified, poll_s=0.2, backoff_s=0.2, backoff_max_s=0.5,
                            ping_after_s=0.5, answer_within_s=1.0)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        with caplog.at_level(logging.INFO, logger="outbox.relay.listen"):
            subscriber.start()
            assert subscriber.ready.wait(10) and notified.wait(5)  # the catch-up wake on connect
            assert client.publish(channel, b"") == 1 and notified.wait(5)

            proxy.black_hole()
            stalled = time.monotonic()
            assert client.publish(channel, b"") == 1  # Redis still sees it subscribed: no claim message
            assert not notified.wait(0.3)  # that wake-up is lost
            while subscriber.ready.is_set():  # until it notices
                assert time.monotonic() - stalled < 5, "the subscriber never noticed its connection stopped answering"
                time.sleep(0.05)
            time.sleep(1.5)  # reconnects meanwhile find the path silent too, and say nothing more
            assert not subscriber.ready.is_set()

            proxy.recover()
            assert subscriber.ready.wait(10), "the subscriber did not subscribe again"
            assert notified.wait(5)  # the catch-up wake after subscribing again
            assert client.publish(channel, b"") >= 1 and notified.wait(5)
        lines = [r for r in caplog.records if r.name == "outbox.relay.listen" and r.levelno >= logging.INFO]
        lost = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
        back = [r.getMessage() for r in lines if "again" in r.getMessage()]
        assert len(lost) == 1 and "lost" in lost[0] and channel in lost[0], lost
        assert len(back) == 1 and channel in back[0], back
    finally:
        subscriber.stop()
        client.close()
        proxy.close()
    assert not subscriber.is_alive()
