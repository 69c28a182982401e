"""What the publisher tests share (tests/test_publisher.py, test_publisher_frames.py,
test_bad_events_publish.py, ...): messages as a claim would hand them over, the RabbitMQ
broker's address, and the bytes a message carried. A pytest plugin (registered in
tests/conftest.py): test modules find the ``broker`` fixture by name and import the helpers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kombu import Connection, Exchange, Queue
from services import AMQP_URL, require

from outbox.core.model import OutboxMessage

CREATED = datetime(2024, 5, 1, 12, 30, 45, 123000, tzinfo=UTC)


def make_message(id: int, topic: str = "orders.created", *, aggregate_id: str = "42", payload: str | None = None,
                 headers: dict[str, Any] | None = None, trace_id: str | None = None, attempts: int = 0,
                 partition_key: str | None = None, created_at: datetime = CREATED) -> OutboxMessage:
    return OutboxMessage(
        id=id, message_id=f"msg-{id}-{uuid.uuid4().hex[:6]}", topic=topic, aggregate_type="order",
        aggregate_id=aggregate_id, partition_key=partition_key,
        payload=payload if payload is not None else json.dumps({"orderId": aggregate_id, "seq": id}),
        headers=headers or {}, trace_id=trace_id, attempts=attempts, created_at=created_at, lease="lease-1")


def raw_body(message: Any) -> bytes:
    """The bytes on the wire: py-amqp decodes bodies that declare a content_encoding."""
    body = message.body
    return body if isinstance(body, bytes) else body.encode(message.content_encoding)


def amqp_hostport() -> tuple[str, int]:
    parts = urlsplit(AMQP_URL)
    return parts.hostname or "127.0.0.1", parts.port or 5672


@pytest.fixture
def broker() -> Iterator[dict[str, Any]]:
    """A unique topic exchange with a queue for everything, and a dead-letter exchange with
    a queue for everything; deleted afterwards."""
    require("RabbitMQ", *amqp_hostport())
    tag = uuid.uuid4().hex[:10]
    conn = Connection(AMQP_URL, connect_timeout=3)
    channel = conn.channel()
    names = {"exchange": f"outbox-test-{tag}", "dead": f"outbox-test-{tag}-dead"}
    exchanges, queues = [], []
    for _key, name in names.items():
        exchange = Exchange(name, type="topic", durable=True)
        exchange(channel).declare()
        queue = Queue(f"{name}-q", exchange=exchange, routing_key="#", exclusive=True, auto_delete=True)(channel)
        queue.declare()
        exchanges.append(exchange)
        queues.append(queue)

    def drain(index: int) -> list[Any]:
        got = []
        while (message := queues[index].get(no_ack=True)) is not None:
            got.append(message)
        return got

    yield {**names, "live": lambda: drain(0), "dead_letters": lambda: drain(1)}
    try:
        for exchange in exchanges:
            exchange(channel).delete()
    finally:
        conn.release()


#: A ``sitecustomize.py`` that makes publishing go wrong the way some payloads do in
#: production: a ``publish_chains`` of an event whose payload says "KILLER" SIGKILLs the
#: process publishing it (a crash in a native library, memory exhausted), one that says "HANG"
#: never returns, one that says "SLOW" takes 2 s. Its dead-letter copy (``publish_dead``, when
#: there is a dead-letter exchange to send it to) kills the same way: the same body goes out;
#: the copy of one that says "STALLCOPY" never returns (a dead-letter broker that hangs).
#: A publisher for an exchange whose name says "REFUSED" cannot be made: it raises a connection
#: error naming its URL, as a client that connects when it is made does. A fork server started
#: with OUTBOX_TEST_SLOW_FORKSERVER_S set serves its first child that many seconds late (a
#: loaded host). Written by ``install_killer``.
KILLER_HOOK = '''
import os, signal, time
from outbox.publisher import kombu_publisher as _kp
_init = _kp.KombuPublisher.__init__
def _refusing(self, url, exchange, **kw):
    if "REFUSED" in exchange:
        raise ConnectionError(f"cannot connect to {url}: connection refused")
    _init(self, url, exchange, **kw)
_kp.KombuPublisher.__init__ = _refusing
_publish_chains = _kp.KombuPublisher.publish_chains
def _killing(self, chains, **kw):
    if any("KILLER" in m.payload for chain in chains for m in chain):
        os.kill(os.getpid(), signal.SIGKILL)
    if any("HANG" in m.payload for chain in chains for m in chain):
        time.sleep(3600)
    if any("SLOW" in m.payload for chain in chains for m in chain):
        time.sleep(2)
    return _publish_chains(self, chains, **kw)
_kp.KombuPublisher.publish_chains = _killing
_publish_dead = _kp.KombuPublisher.publish_dead
def _killing_dead(self, message, error, **kw):
    if self.dead_letter_exchange is not None and "KILLER" in message.payload:
        os.kill(os.getpid(), signal.SIGKILL)
    if self.dead_letter_exchange is not None and "STALLCOPY" in message.payload:
        time.sleep(3600)
    return _publish_dead(self, message, error, **kw)
_kp.KombuPublisher.publish_dead = _killing_dead
import multiprocessing.forkserver as _fs
_fs_main = _fs.main
def _slow_main(*args, **kwargs):
    time.sleep(float(os.environ.get("OUTBOX_TEST_SLOW_FORKSERVER_S") or 0))
    return _fs_main(*args, **kwargs)
_fs.main = _slow_main
'''


def install_killer(directory: Path) -> None:
    """Write ``KILLER_HOOK`` as ``directory``'s ``sitecustomize.py``: every Python process
    started with ``directory`` on its PYTHONPATH runs it, a child its worker starts included."""
    (directory / "sitecustomize.py").write_text(KILLER_HOOK)
