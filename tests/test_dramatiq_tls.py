"""Dramatiq's broker over TLS: one URL (the publisher's form, ``outbox.core.tls``) that pika
(Dramatiq's RabbitmqBroker), kombu (the scheduler's RabbitMQ lock) and redis-py (its
RedisBroker and Redis lock) all read to mean the same, and ``outbox check`` reaching the broker
as the workers do. Found in review: ``amqps://...?ssl_ca_certs=`` stopped pika (unknown URL
parameter), pika's own ``?ssl_options={...}`` stopped the lock (no scheduler ever led), and a
bare ``rediss://`` on a private CA passed the check (kombu verifies nothing then) while every
worker failed on the certificate. Against the TLS proxy in front of RabbitMQ
(``tls_support``) and a TLS-only Redis (``tests/test_celery_redis_tls.py``'s)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from publisher_support import amqp_hostport
from services import require
from test_celery_redis_tls import TlsRedis, tls_redis  # noqa: F401 - the TLS Redis fixture
from tls_support import Pki, TlsProxy

from outbox.commands.doctor import FAIL, OK, check_dramatiq_broker
from outbox.core.config import dramatiq_settings
from outbox.dramatiq.brokers import make_broker, message
from outbox.dramatiq.scheduler import RabbitLock, RedisLock


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    require("RabbitMQ", *amqp_hostport())
    yield Pki(tmp_path_factory.mktemp("dramatiq-tls"))


@pytest.fixture
def proxy(pki: Pki) -> Iterator[TlsProxy]:
    front = TlsProxy(pki, "localhost")
    yield front
    front.close()


def send_and_count(url: str) -> int:
    """Send one message through Dramatiq's broker for ``url`` to a queue of its own; the count
    RabbitMQ then holds. The queues are deleted."""
    broker = make_broker(url, "dramatiq", middleware=[])
    queue = f"outbox-tls-{uuid.uuid4().hex[:8]}"
    try:
        broker.declare_queue(queue)
        broker.enqueue(message("nothing", queue, {}))
        return int(broker.get_queue_message_counts(queue)[0])
    finally:
        try:
            for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                broker.channel.queue_delete(name)
        finally:
            broker.close()


def hold_once(lock: Any) -> bool:
    try:
        return bool(lock.hold())
    finally:
        lock.release()


def test_one_amqps_url_serves_dramatiqs_broker_its_lock_and_the_check(proxy: TlsProxy, pki: Pki) -> None:
    url = proxy.url(ssl_ca_certs=str(pki.ca_file))
    assert dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": url}) is not None
    assert send_and_count(url) == 1
    assert hold_once(RabbitLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
    assert check_dramatiq_broker(url).state == OK, check_dramatiq_broker(url).line()


def test_a_client_certificate_reaches_pika_and_kombu(pki: Pki) -> None:
    front = TlsProxy(pki, "localhost", client_ca=pki.ca_file)
    try:
        cert, key = pki.issue("dramatiq-client", "relay.example")
        url = front.url(ssl_ca_certs=str(pki.ca_file), ssl_certfile=str(cert), ssl_keyfile=str(key))
        assert send_and_count(url) == 1
        assert hold_once(RabbitLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
        assert check_dramatiq_broker(url).state == OK
        assert len(front.peers) >= 3 and all(peer is not None for peer in front.peers)
        anonymous = front.url(ssl_ca_certs=str(pki.ca_file))
        assert check_dramatiq_broker(anonymous).state == FAIL
    finally:
        front.close()


def test_a_broker_certificate_for_another_name_is_refused_by_every_client(pki: Pki) -> None:
    front = TlsProxy(pki, "wrong.example")
    try:
        url = front.url(ssl_ca_certs=str(pki.ca_file))
        with pytest.raises(Exception) as caught:
            send_and_count(url)
        assert "wrong.example" in str(caught.value) or "ertificate" in repr(caught.value), repr(caught.value)
        assert not hold_once(RabbitLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
        report = check_dramatiq_broker(url)
        assert report.state == FAIL, report.line()
        assert front.handshakes_failed >= 3
    finally:
        front.close()


def test_a_rediss_url_with_its_ca_serves_the_broker_the_lock_and_the_check(tls_redis: TlsRedis) -> None:  # noqa: F811
    for url in (tls_redis.url(), tls_redis.url(ssl_cert_reqs="CERT_REQUIRED")):  # redis-py's and kombu's words
        broker = make_broker(url, f"tls-{uuid.uuid4().hex[:6]}", middleware=[])
        try:
            assert broker.client.ping()
        finally:
            broker.close()
        assert hold_once(RedisLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
        assert check_dramatiq_broker(url).state == OK, check_dramatiq_broker(url).line()
    # No CA given: the workers cannot verify the private CA, and the check now says so.
    bare = f"rediss://127.0.0.1:{tls_redis.port}/0"
    report = check_dramatiq_broker(bare)
    assert report.state == FAIL and "certificate verify failed" in report.detail, report.line()


def test_each_node_of_a_tls_list_is_checked_against_its_own_name(pki: Pki) -> None:
    """Per-node certificates (``tests/test_amqp_tls.py`` has the publisher's case): Dramatiq's
    broker (pika, a parameters object per node), the scheduler's lock (kombu, switching nodes
    itself) and the check reach the second node, checked against its own name, with the first
    down. Found in review: such a list was refused at start-up."""
    first, second = TlsProxy(pki, "localhost"), TlsProxy(pki, "127.0.0.1")
    url = f"{first.url('localhost')};{second.url('127.0.0.1', ssl_ca_certs=str(pki.ca_file))}"
    try:
        assert dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": url}) is not None
        assert hold_once(RabbitLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
        assert (len(first.peers), len(second.peers)) == (1, 0)
        first.close()
        assert send_and_count(url) == 1
        assert hold_once(RabbitLock(url, f"tls-{uuid.uuid4().hex[:8]}"))
        assert check_dramatiq_broker(url).state == OK, check_dramatiq_broker(url).line()
        assert len(second.peers) >= 3 and second.handshakes_failed == 0
    finally:
        first.close()
        second.close()
