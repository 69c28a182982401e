"""outbox.celery.redis_transport against a real Redis: garbage on a queue is dropped with
one log line and the next good message is delivered; an error that is not garbage (here
raised by the consumer's own handling of a good message) reaches the caller (Celery)
instead of being logged as a dropped message. Skipped without Redis, unless
OUTBOX_REQUIRE_SERVICES is set."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from kombu import Connection, Exchange, Queue
from services import REDIS_URL, require

from outbox.celery.redis_transport import Transport

#: Not JSON, JSON that is no envelope, JSON of another type, an envelope without its
#: delivery tag. (A body that is not its encoding reaches Celery, which handles it.)
GARBAGE = [b"\x00\xff not json at all", b'{"valid": "json, but no envelope"}', b"[1, 2, 3]",
           b'{"body": "e30=", "properties": {"body_encoding": "base64"}}',
           # envelopes kombu builds but its QoS cannot take (found in review: the worker
           # stopped, or lost its connection, instead of dropping them)
           b'{"body": "e30=", "properties": {"delivery_tag": "x"}}',
           b'{"body": "e30=", "properties": {"delivery_tag": "x", "delivery_info": "q"}}',
           b'{"body": "e30=", "properties": {"delivery_tag": [1], "delivery_info": {"exchange": "", "routing_key": ""}}}']


@pytest.fixture
def conn() -> Iterator[tuple[Connection, str, str]]:
    parts = urlsplit(REDIS_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    prefix = f"outbox-test-{uuid.uuid4().hex[:10]}:"
    with Connection(REDIS_URL, transport=Transport, transport_options={"global_keyprefix": prefix}) as c:
        yield c, prefix, f"q-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(REDIS_URL)
    for key in raw.keys(f"{prefix}*"):
        raw.delete(key)


def _queue(c: Connection, name: str) -> Queue:
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    queue(c.default_channel).declare()
    return queue


def test_garbage_is_dropped_and_the_next_message_delivered(
        conn: tuple[Connection, str, str], caplog: pytest.LogCaptureFixture) -> None:
    c, prefix, name = conn
    queue = _queue(c, name)
    raw = redis.Redis.from_url(REDIS_URL)
    for item in GARBAGE:
        raw.lpush(f"{prefix}{name}", item)
    c.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key=name, serializer="json")
    got: list[Any] = []
    with caplog.at_level(logging.ERROR, "outbox.celery"), \
            c.Consumer(queue, callbacks=[lambda body, message: (got.append(body), message.ack())], accept=["json"]):
        for _ in range(len(GARBAGE) + 1):
            if got:
                break
            c.drain_events(timeout=5)
    assert got == [{"n": 1}]
    dropped = [r.getMessage() for r in caplog.records if "dropped an undecodable message" in r.getMessage()]
    assert len(dropped) == len(GARBAGE), dropped
    assert any("UndecodableMessage" in line for line in dropped) and any("JSONDecodeError" in line for line in dropped)


def test_an_error_handling_a_good_message_is_not_taken_for_garbage(
        conn: tuple[Connection, str, str], caplog: pytest.LogCaptureFixture) -> None:
    c, _, name = conn
    queue = _queue(c, name)
    c.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key=name, serializer="json")

    def fails(body: Any, message: Any) -> None:
        raise AttributeError("'NoneType' object has no attribute 'fileno'")  # as a torn-down pool would

    with (caplog.at_level(logging.ERROR, "outbox.celery"), c.Consumer(queue, callbacks=[fails], accept=["json"]),
          pytest.raises(AttributeError, match="fileno")):
        c.drain_events(timeout=5)
    assert not [r for r in caplog.records if "undecodable" in r.getMessage()]


def test_a_new_connection_takes_the_poll_callback_of_a_closed_one_out_of_the_event_loop() -> None:
    """Celery's consumer registers each new connection's transport with its event loop and
    closes the old one after a loss of its broker. kombu's Redis transport left its
    ``on_tick`` callback behind, holding the closed transport: one more per reconnect, run
    on every turn of the loop. Here three connections in turn, each closed as the consumer
    closes it (``collect``, then ``close``) before the next registers: the loop holds the
    callback of the open one only, and a connection still open keeps its own."""
    from kombu.asynchronous import Hub

    parts = urlsplit(REDIS_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    hub = Hub()
    opened: list[Connection] = []
    try:
        before = set(hub.on_tick)
        for n in range(3):
            c = Connection(REDIS_URL, transport=Transport)
            c.connect()
            c.transport.register_with_event_loop(c.connection, hub)
            opened.append(c)
            added = set(hub.on_tick) - before
            assert len(added) == 1 and all(getattr(f, "__name__", "") == "on_poll_start" for f in added), (n, added)
            c.collect()
            c.close()
        kept = Connection(REDIS_URL, transport=Transport)
        kept.connect()
        kept.transport.register_with_event_loop(kept.connection, hub)
        other = Connection(REDIS_URL, transport=Transport)
        other.connect()
        other.transport.register_with_event_loop(other.connection, hub)
        assert len(set(hub.on_tick) - before) == 2  # both open: both polled
        opened += [kept, other]
    finally:
        for c in opened:
            c.close()
        hub.close()


def test_a_channel_left_polling_when_its_broker_went_away_closes_as_celery_closes_it() -> None:
    """Celery's consumer, after a loss of its broker, closes its connection twice
    (``collect``, then ``close``). A channel with an unacked message and a ``BRPOP`` in flight
    failed its first close at the read of that BRPOP's reply, and its second close, the
    connection having let go of its transport by then, raised ``AttributeError`` (no broker
    address to restore the message with), which stopped the worker. Here the broker (Redis
    behind a proxy) is cut in that state and both closes go through."""
    import socket

    from relay_e2e_support import Proxy

    parts = urlsplit(REDIS_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    prefix, name = f"outbox-test-{uuid.uuid4().hex[:10]}:", f"q-{uuid.uuid4().hex[:8]}"
    proxy = Proxy(target=(parts.hostname or "127.0.0.1", parts.port or 6379))
    try:
        c = Connection(proxy.url_for(REDIS_URL), transport=Transport, transport_options={"global_keyprefix": prefix})
        queue = _queue(c, name)
        c.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key=name, serializer="json")
        got: list[Any] = []
        c.Consumer(queue, callbacks=[lambda body, message: got.append(body)], accept=["json"]).consume()
        # A second channel consuming, as Celery's consumer has (its remote-control queue):
        # closed first by the transport, its failure left the first one to the second close.
        other = c.channel()
        c.Consumer(_queue(c, f"{name}-other"), channel=other, callbacks=[lambda body, message: None],
                   accept=["json"]).consume()
        c.drain_events(timeout=5)  # the message, left unacked
        with pytest.raises(socket.timeout):
            c.drain_events(timeout=0.2)  # a BRPOP sent on each channel, its reply not read
        channel = c.default_channel
        assert got == [{"n": 1}] and channel._in_poll and other._in_poll
        proxy.cut()
        c.collect()
        c.close()
        assert channel.closed and other.closed
    finally:
        proxy.close()
        raw = redis.Redis.from_url(REDIS_URL)
        for key in raw.keys(f"{prefix}*"):
            raw.delete(key)


_TRANSPORT_OPTIONS = """
import json
from outbox.celery import app
with app.connection_for_write() as conn:
    channel = conn.default_channel
    print(json.dumps({"options": app.conf.broker_transport_options, "channel": channel.visibility_timeout,
                      "limit": app.conf.task_annotations["outbox.publish"]["time_limit"]}))
"""


@pytest.mark.parametrize("own", [None, {"global_keyprefix": "own:"}, {"visibility_timeout": 99}])
def test_the_visibility_timeout_outlasts_a_long_lease_unless_the_user_sets_it(
        tmp_path: Any, own: dict[str, Any] | None) -> None:
    """A publish task may run up to its time limit (the lease) before Celery acks it; kombu's
    Redis transport redelivers an unacked message after its visibility timeout, 1 h by default,
    so a lease of 2 h had a running task redelivered and its rows adopted by another worker
    (found in review). It is twice the lease at least now, as on the database broker, read here
    from a channel on a real Redis; a config module's own options are kept, its own timeout too."""
    import json
    import os

    from relay_support import run_python

    parts = urlsplit(REDIS_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_CELERY_BROKER_URL": REDIS_URL,
           "OUTBOX_CLAIM_TIMEOUT_MS": "7200000"}
    if own is not None:
        (tmp_path / "ownconf.py").write_text(f"broker_transport_options = {own!r}\n")
        env.update(CELERY_CONFIG_MODULE="ownconf",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    done = run_python(_TRANSPORT_OPTIONS, tmp_path, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["limit"] == 7200.0
    if own is not None and "visibility_timeout" in own:
        assert out["options"] == own and out["channel"] == 99, out
    else:
        assert out["options"] == {"visibility_timeout": 14400.0, **(own or {})}, out
        assert out["channel"] == 14400.0
