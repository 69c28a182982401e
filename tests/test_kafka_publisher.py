"""``KafkaPublisher`` against a real Kafka-protocol broker (Tansu, tests/kafka_support.py):
keyed, ordered per key, the AMQP path's headers, the confirmed prefix of each chain, and
the failures mapped onto ``FailureKind``; plus the pure parts (options, results)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from kafka_support import consume, create_topic

from outbox.core.config import ConfigError, KafkaOptions, load_settings
from outbox.core.model import OutboxMessage
from outbox.publisher import FailureKind, PublishFailure, build_headers
from outbox.publisher.kafka import (
    KafkaPublisher,
    chain_result,
    event_headers,
    kafka_headers,
    producer_config,
    topic_status,
)
from outbox.publisher.select import publisher_for
from outbox.storage.store import OutboxStore

CREATED = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def event(id_: int, topic: str, aggregate: str = "a1", payload: str | None = None, **extra: object) -> OutboxMessage:
    return OutboxMessage(id=id_, message_id=f"m-{id_}", topic=topic, aggregate_type="order", aggregate_id=aggregate,
                         partition_key=None, payload=payload or json.dumps({"n": id_}),
                         headers={"x-tenant": "acme", "x-n": id_}, trace_id=extra.get("trace_id"),  # type: ignore[arg-type]
                         attempts=0, created_at=CREATED, lease="L")


def publisher(bootstrap: str, **options: object) -> KafkaPublisher:
    return KafkaPublisher(f"kafka://{bootstrap}", options=KafkaOptions(**{"delivery_timeout_s": 5.0, **options}))


# -- against the broker --------------------------------------------------------------------------

def test_chains_arrive_keyed_in_order_with_the_amqp_headers(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    chains = [[event(100 * a + i, topic, aggregate=f"agg-{a}") for i in range(20)] for a in range(5)]
    chains[0][0] = event(0, topic, aggregate="agg-0", trace_id="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    with publisher(kafka_bootstrap) as pub:
        results = pub.publish_chains(chains)
    assert [r.published for r in results] == [tuple(m.id for m in chain) for chain in chains]
    assert all(r.ok and r.failed_id is None for r in results)
    received = consume(kafka_bootstrap, topic, 100)
    assert len(received) == 100
    per_key: dict[bytes, list[int]] = {}
    partitions: dict[bytes, set[int]] = {}
    for message in received:
        per_key.setdefault(message.key(), []).append(json.loads(message.value())["n"])
        partitions.setdefault(message.key(), set()).add(message.partition())
    assert per_key == {f"agg-{a}".encode(): [m.id for m in chains[a]] for a in range(5)}
    assert all(len(p) == 1 for p in partitions.values())  # one key, one partition
    first = next(m for m in received if json.loads(m.value())["n"] == 0)
    headers = dict(first.headers())
    assert headers["message_id"] == b"m-0" and headers["outbox_id"] == b"0" and headers["topic"] == topic.encode()
    assert headers["aggregate_type"] == b"order" and headers["aggregate_id"] == b"agg-0"
    assert headers["partition_key"] == b"agg-0" and headers["attempt"] == b"1"
    assert headers["created_at"] == b"2026-11-24T12:00:00.000Z" and headers["x-tenant"] == b"acme"
    assert headers["x-n"] == b"0" and headers["traceparent"].startswith(b"00-111")


def test_a_chain_over_two_topics_arrives_whole_in_its_waves(kafka_bootstrap: str) -> None:
    """One aggregate's events alternating between two topics: one wave per run of a topic
    (a chain that moves to another partition waits for the reports before it), all
    delivered, each topic holding its events in the chain's order."""
    orders, payments = create_topic(kafka_bootstrap), create_topic(kafka_bootstrap)
    chain = [event(i, orders if i % 3 else payments) for i in range(1, 10)]
    with publisher(kafka_bootstrap) as pub:
        result = pub.publish_chain(chain)
    assert result.ok and result.published == tuple(range(1, 10))
    for topic in (orders, payments):
        got = [json.loads(m.value())["n"] for m in consume(kafka_bootstrap, topic, sum(m.topic == topic for m in chain))]
        assert got == [m.id for m in chain if m.topic == topic]


def test_topic_template_maps_the_kafka_topic(kafka_bootstrap: str) -> None:
    target = create_topic(kafka_bootstrap, "prod.order.created")
    with publisher(kafka_bootstrap, topic_template="prod.{aggregate_type}.{topic}") as pub:
        result = pub.publish_chain([event(1, "created")])
    assert result.published == (1,)
    [message] = consume(kafka_bootstrap, target, 1)
    assert dict(message.headers())["topic"] == b"created"  # the event's own topic, as on AMQP


def test_unknown_topic_without_auto_create_is_fatal_and_nothing_is_sent(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    chain = [event(1, topic), event(2, "no-such-topic"), event(3, topic)]
    with publisher(kafka_bootstrap) as pub:
        result = pub.publish_chain(chain)
    assert result.published == (1,) and result.failed_id == 2
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL
    assert "'no-such-topic' does not exist" in result.failure.reason
    assert "OUTBOX_KAFKA_AUTO_CREATE_TOPICS" in result.failure.reason
    assert [json.loads(m.value())["n"] for m in consume(kafka_bootstrap, topic, 2, timeout=3)] == [1]


def test_a_failing_topic_is_charged_to_its_own_chains_and_the_other_topics_flow(
        kafka_bootstrap: str, sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """One topic failing (here: missing, auto-create off; Tansu cannot take one partition's
    leader down, see the scripted test below) stops only the chains that go there: that route
    pauses, their rows are released with no attempt spent, and the healthy topic's chains are
    marked done, now and at the next claim. Before, the missing topic's FATAL opened the
    breaker and claims stopped for every topic (docs/destinations.md, "Failures of one topic")."""
    from outbox import Status, enqueue
    from outbox.domain.chains import split_chains
    from outbox.relay import Breaker, RelayContext, RelayOptions, RouteGate, handle_publish

    healthy, missing = create_topic(kafka_bootstrap), f"outbox-missing-{uuid.uuid4().hex[:10]}"

    def add(aggregate: str, topic: str, count: int) -> list[int]:
        ids = [enqueue(conn, topic=topic, aggregate_type="order", aggregate_id=aggregate, payload={"n": n})
               for n in range(count)]
        conn.commit()
        return ids

    def rows() -> dict[int, tuple[int, int, bool]]:
        return {int(i): (int(s), int(a), r is not None) for i, s, a, r in
                conn.execute("SELECT id, status, attempts, next_retry_at FROM outbox").fetchall()}

    good, bad = add("good", healthy, 3), add("bad", missing, 2)
    breaker, routes = Breaker(), RouteGate()
    with publisher(kafka_bootstrap) as pub:
        relay = RelayContext(sqlite_store, pub, options=RelayOptions(route_pause_s=20, route_pause_max_s=60),
                             breaker=breaker, routes=routes)
        outcomes = handle_publish(relay, split_chains(sqlite_store.claim(100).messages))
        state = rows()
        assert [state[i][0] for i in good] == [Status.DONE] * 3, state
        assert breaker.open_for() == 0, breaker.reason  # claims go on for the other topics
        assert [state[i] for i in bad] == [(Status.PENDING, 0, True)] * 2, state  # released, paused, no attempt
        assert 19 < routes.paused(missing) <= 20 and routes.paused(healthy) == 0
        assert any(o.kind == "fatal" and "does not exist" in (o.reason or "") for o in outcomes), outcomes

        later = add("good2", healthy, 1)  # the next claim: the healthy topic flows, the missing one waits
        conn.execute("UPDATE outbox SET next_retry_at = NULL")
        conn.commit()
        handle_publish(relay, split_chains(sqlite_store.claim(100).messages))
        state = rows()
        assert state[later[0]][0] == Status.DONE and all(state[i][:2] == (Status.PENDING, 0) for i in bad), state
    assert sorted(json.loads(m.value())["n"] for m in consume(kafka_bootstrap, healthy, 4, timeout=5)) == [0, 0, 1, 2]


def test_auto_create_leaves_the_topic_to_the_broker(kafka_bootstrap: str) -> None:
    with publisher(kafka_bootstrap, auto_create_topics=True) as pub:
        result = pub.publish_chain([event(1, "made-by-the-broker")])
    assert result.ok and result.published == (1,)


def test_message_too_large_is_poison_for_that_event_only(kafka_bootstrap: str) -> None:
    topic = create_topic(kafka_bootstrap)
    big = json.dumps({"blob": "x" * 20_000})
    chains = [[event(1, topic), event(2, topic, payload=big), event(3, topic)],
              [event(11, topic, aggregate="other"), event(12, topic, aggregate="other")]]
    with publisher(kafka_bootstrap, message_max_bytes=10_000) as pub:
        tight, other = pub.publish_chains(chains)
    assert tight.published == (1,) and tight.failed_id == 2
    assert tight.failure is not None and tight.failure.kind is FailureKind.POISON
    assert "MSG_SIZE_TOO_LARGE" in tight.failure.reason
    assert other.ok and other.published == (11, 12)
    assert sorted(json.loads(m.value())["n"] for m in consume(kafka_bootstrap, topic, 4, timeout=3)) == [1, 11, 12]


@pytest.mark.parametrize("topic", ["orders created", ".", ".."])
def test_illegal_topic_name_is_poison(kafka_bootstrap: str, topic: str) -> None:
    """Kafka's characters and length, and its two names made of dots alone: refused before
    sending as POISON, that event dead (before, "." and ".." passed the check and were taken
    for missing topics, FATAL: the relay paused at every claim of that event)."""
    with publisher(kafka_bootstrap) as pub:
        result = pub.publish_chain([event(1, topic)])
    assert result.failure is not None and result.failure.kind is FailureKind.POISON
    assert "not a legal Kafka topic name" in result.failure.reason


def test_broker_down_is_backpressure_and_the_publisher_recovers(tansu) -> None:
    topic = create_topic(tansu.bootstrap)
    with publisher(tansu.bootstrap, delivery_timeout_s=2.0) as pub:
        assert pub.publish_chain([event(1, topic)]).published == (1,)
        tansu.stop()
        down = pub.publish_chain([event(2, topic), event(3, topic)])
        assert down.published == () and down.failed_id == 2
        assert down.failure is not None and down.failure.kind is FailureKind.BACKPRESSURE
        tansu.start()
        create_topic(tansu.bootstrap, topic)  # memory storage: the restart lost it
        again = pub.publish_chain([event(2, topic), event(3, topic)])
        if not again.ok:  # the new broker does not know the idempotent producer: it is made anew
            assert again.failure is not None and again.failure.kind is FailureKind.RETRIABLE
            assert "UNKNOWN_PRODUCER_ID" in again.failure.reason and again.published == ()
            again = pub.publish_chain([event(2, topic), event(3, topic)])
    assert again.ok and again.published == (2, 3)
    assert [json.loads(m.value())["n"] for m in consume(tansu.bootstrap, topic, 2)] == [2, 3]


@pytest.mark.parametrize("auto_create", [False, True])
def test_an_authentication_failure_is_fatal_and_says_why_whether_or_not_topics_are_checked(
        tansu, auto_create: bool) -> None:
    """Found in review (7 December 2026): with auto-create off (the default) a publish first
    reads the topic's metadata, which failed as `_TRANSPORT: ... Broker transport failure`
    (BACKPRESSURE: an outage, probed forever) while librdkafka's reason, SASL refused, waited
    in its error callback, which nothing polled. Tansu refuses every SASL handshake: the
    stand-in for credentials the brokers refuse. Either way it is FATAL and names the cause."""
    topic = create_topic(tansu.bootstrap)
    options = KafkaOptions(security_protocol="sasl_plaintext", delivery_timeout_s=2.0, auto_create_topics=auto_create)
    with KafkaPublisher(f"kafka://app:S3cret-pw@{tansu.bootstrap}", options=options) as pub:
        began = time.monotonic()
        result = pub.publish_chain([event(1, topic), event(2, topic)])
        took = time.monotonic() - began
    assert result.published == () and result.failed_id == 1
    assert result.failure is not None
    assert result.failure.kind is FailureKind.FATAL, result.failure
    assert "_AUTHENTICATION" in result.failure.reason and "S3cret-pw" not in result.failure.reason
    assert took < pub.wait_s + 1, took


def test_credentials_in_the_url_are_sent_under_the_ssl_protocol_too(tmp_path) -> None:
    """Found in review (7 December 2026): OUTBOX_KAFKA_SECURITY_PROTOCOL=ssl with credentials in
    the URL connected with TLS and no SASL at all, the user and password silently left out
    (a SASL_SSL listener then drops every connection: an outage, nothing saying why). Tansu
    behind a TLS proxy refuses every SASL handshake: a FATAL `_AUTHENTICATION` shows the
    credentials were sent, a delivered event that they were not."""
    from kafka_support import Tansu, free_port, tansu_or_skip
    from tls_support import Pki, TlsProxy

    pki, port = Pki(tmp_path), free_port()
    front = TlsProxy(pki, "localhost", "127.0.0.1", target=("127.0.0.1", port))
    broker = Tansu(tansu_or_skip(), port, tmp_path / "tansu.log", advertised_port=front.port)
    broker.start()
    try:
        options = KafkaOptions(security_protocol="ssl", ssl_ca_location=str(pki.ca_file), auto_create_topics=True,
                               delivery_timeout_s=3.0)
        with KafkaPublisher(f"kafka://localhost:{front.port}", options=options) as pub:
            assert pub.publish_chain([event(1, "orders")]).ok  # TLS alone: the proxy and broker work
        # The protocol unset (the SSL settings and the credentials make it sasl_ssl), or sasl_ssl.
        for protocol in (None, "sasl_ssl"):
            with KafkaPublisher(f"kafka://app:S3cret-pw@localhost:{front.port}",
                                options=replace(options, security_protocol=protocol)) as pub:
                result = pub.publish_chain([event(2, "orders")])
            assert result.failure is not None and result.failure.kind is FailureKind.FATAL, result
            assert "_AUTHENTICATION" in result.failure.reason and "S3cret-pw" not in result.failure.reason
    finally:
        broker.stop()
        front.close()
    assert producer_config(KafkaOptions(security_protocol="ssl"), "kafka://k1:9093")["security.protocol"] == "ssl"
    with pytest.raises(ConfigError):  # ssl with credentials: test_a_protocol_without_sasl_...
        producer_config(KafkaOptions(security_protocol="ssl"), "kafka://app:pw@k1:9093")


@pytest.mark.parametrize("protocol", ["ssl", "plaintext"])
def test_a_protocol_without_sasl_and_credentials_in_the_url_stop_start_up(
        protocol: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_KAFKA_SECURITY_PROTOCOL=ssl (or plaintext), librdkafka's protocol without SASL,
    with a user and password in the URL was replaced by sasl_ssl: a TLS-only listener (mutual
    TLS) that worked with credentials left in the URL was then sent SASL and refused every
    connection, behind one WARNING (``ssl``) or none (``plaintext``: TLS and SASL where clear
    text was asked). Found in review (7 December): an explicit protocol is never replaced; the
    contradiction stops start-up, ``outbox check`` and a publisher, naming both ways out."""
    from outbox.commands.doctor import FAIL, run_checks
    from outbox.core.config import reset_settings, startup_options

    url = "kafka://app:S3cret-pw@k1:9093"
    said = (f"OUTBOX_KAFKA_SECURITY_PROTOCOL={protocol} sends no user and password (librdkafka's security.protocol: "
            "only sasl_ssl and sasl_plaintext do), but OUTBOX_PUBLISH_URL has them: set sasl_ssl to send them over "
            f"TLS, or take them out of the URL for {protocol} alone")
    with pytest.raises(ConfigError) as caught:
        producer_config(KafkaOptions(security_protocol=protocol), url)
    assert str(caught.value) == said
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": url,
           "OUTBOX_KAFKA_SECURITY_PROTOCOL": protocol}
    [destination] = [r for r in run_checks(env) if r.name == "destination"]
    assert (destination.state, destination.detail) == (FAIL, said)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reset_settings()
    with pytest.raises(ConfigError) as caught:
        startup_options()
    assert str(caught.value) == said and "S3cret-pw" not in said
    # Without credentials, or with a SASL protocol, each is what it says.
    assert producer_config(KafkaOptions(security_protocol=protocol), "kafka://k1:9093")["security.protocol"] == protocol
    for sasl in ("sasl_ssl", "sasl_plaintext"):
        assert producer_config(KafkaOptions(security_protocol=sasl), url)["security.protocol"] == sasl
    assert producer_config(KafkaOptions(), url)["security.protocol"] == "sasl_ssl"  # unset: never in clear


def test_dead_letter_copy_goes_to_the_dead_letter_topic(kafka_bootstrap: str) -> None:
    dead = create_topic(kafka_bootstrap)
    pub = KafkaPublisher(f"kafka://{kafka_bootstrap}", options=KafkaOptions(message_max_bytes=10_000),
                         dead_letter_topic=dead)
    with pub:
        assert pub.publish_dead(event(1, "orders"), "poison: too large") is None
        assert pub.publish_dead(event(2, "orders", payload=json.dumps({"b": "x" * 20_000})), "poison") is None
    first, second = sorted(consume(kafka_bootstrap, dead, 2), key=lambda m: dict(m.headers())["outbox_id"])
    assert dict(first.headers())["x-outbox-error"] == b"poison: too large" and json.loads(first.value()) == {"n": 1}
    assert second.value() in (b"", None) and b"MSG_SIZE_TOO_LARGE" in dict(second.headers())["x-outbox-omitted"]


def test_a_missing_dead_letter_topic_is_said_at_once_and_not_created(kafka_bootstrap: str) -> None:
    """With auto-create off the dead-letter topic is checked like an event's: missing, the
    copy fails at once saying so, and nothing creates it. Before, the copy was produced
    unchecked: a broker that creates topics (Tansu does) made it although
    OUTBOX_KAFKA_AUTO_CREATE_TOPICS=0, and one that does not held each dead event for the
    delivery timeout (15 s) and then had its producer made anew (found in review)."""
    dead = f"outbox-test-dead-{uuid.uuid4().hex[:10]}"
    pub = KafkaPublisher(f"kafka://{kafka_bootstrap}", options=KafkaOptions(delivery_timeout_s=5.0),
                         dead_letter_topic=dead)
    with pub:
        started = time.monotonic()
        failure = pub.publish_dead(event(1, "orders"), "poison: too large")
        elapsed = time.monotonic() - started
    assert failure is not None and failure.kind is FailureKind.FATAL, failure
    assert f"dead-letter topic {dead!r} does not exist" in failure.reason
    assert "OUTBOX_DEAD_LETTER_EXCHANGE" in failure.reason and elapsed < 3.0
    assert dead not in topic_status(f"kafka://{kafka_bootstrap}", KafkaOptions())[1]


# -- pure ---------------------------------------------------------------------------------------

def test_chain_result_is_the_delivered_prefix_and_marks_overtaken_events() -> None:
    fail = PublishFailure(FailureKind.RETRIABLE, "x")
    assert chain_result([1, 2, 3], [None, None, None]).published == (1, 2, 3)
    stopped = chain_result([1, 2, 3], [None, fail, fail])
    assert (stopped.published, stopped.failed_id, stopped.failure) == ((1,), 2, fail)
    overtaken = chain_result([1, 2, 3, 4], [None, fail, None, fail])
    assert overtaken.published == (1, 3) and overtaken.failed_id == 4
    assert [(o.id, o.delivered_after) for o in overtaken.overtaken] == [(2, (3,))]


class FatalOnFlush:
    """A producer whose ``flush`` fails as confluent-kafka's does on a fatal error of the
    idempotent producer (seen after a broker restart: OUT_OF_ORDER_SEQUENCE_NUMBER): by
    setting the bare ``KafkaError`` as the raised object, from C, which ``except Exception``
    does not catch. Produced events get no delivery report. ``code``: the fatal error's
    (default OUT_OF_ORDER_SEQUENCE_NUMBER)."""

    def __init__(self, code: int | None = None) -> None:
        self.produced = 0
        self.code = code

    def produce(self, topic: str, **kwargs: object) -> None:
        self.produced += 1

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        import ctypes

        from confluent_kafka import KafkaError

        code = KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER if self.code is None else self.code
        error = KafkaError(code, "sequence desynchronization", fatal=True)
        ctypes.pythonapi.PyErr_SetObject(ctypes.py_object(KafkaError), ctypes.py_object(error))
        return 0  # pragma: no cover - the call above raises


def test_a_fatal_producer_error_is_a_failure_and_the_producer_is_made_anew() -> None:
    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True),
                         dead_letter_topic="outbox.dead")
    broken = FatalOnFlush()
    pub._producer, pub._pid = broken, os.getpid()
    results = pub.publish_chains([[event(1, "t"), event(2, "t")], [event(3, "t", aggregate="a2")]])
    assert broken.produced == 3
    assert [r.published for r in results] == [(), ()]
    assert [r.failed_id for r in results] == [1, 3]
    assert all(r.failure is not None and r.failure.kind is FailureKind.RETRIABLE
               and "OUT_OF_ORDER_SEQUENCE_NUMBER" in r.failure.reason for r in results)
    assert pub._producer is None  # the next publish makes a new producer (a new producer id)
    pub._producer, pub._pid = broken, os.getpid()
    failure = pub.publish_dead(event(4, "t"), "boom")  # the dead-letter path too
    assert failure is not None and failure.kind is FailureKind.RETRIABLE and pub._producer is None


@pytest.mark.parametrize("code", ["_UNSUPPORTED_FEATURE", "UNSUPPORTED_VERSION"])
def test_a_broker_without_the_idempotent_producer_is_fatal(code: str) -> None:
    """librdkafka fails an idempotent producer whose brokers lack it (older than 0.11, or a
    Kafka-protocol broker without InitProducerId) with the fatal ``_UNSUPPORTED_FEATURE``
    ("Idempotent producer not supported by any of the N broker(s)"): an operator must act,
    so FATAL (claims stop, one CRITICAL line). Before, it fell
    through to RETRIABLE, and every chain's head was charged an attempt at each publish until
    all went dead (found in review). Raised from ``flush`` as the library does, and reported
    through the error callback while the queued events are purged."""
    from confluent_kafka import KafkaError

    error = getattr(KafkaError, code)
    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True))
    pub._producer, pub._pid = FatalOnFlush(error), os.getpid()
    result = pub.publish_chain([event(1, "t"), event(2, "t")])
    assert result.published == () and result.failed_id == 1
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL and code in result.failure.reason

    class Unsupported(Scripted):
        def flush(self, timeout: float = 0) -> int:
            pub._on_error(KafkaError(error, "Idempotent producer not supported by any of the 1 connected broker(s)",
                                     fatal=True))
            return super().flush(timeout)

    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True))
    producer = Unsupported({1: KafkaError._PURGE_QUEUE, 2: KafkaError._PURGE_QUEUE})
    pub._producer, pub._pid = producer, os.getpid()
    result = pub.publish_chain([event(1, "t"), event(2, "t")])
    assert result.published == () and result.failed_id == 1
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL
    assert "Idempotent producer not supported" in result.failure.reason and pub._producer is None


class FatalOnProduce:
    """A producer in librdkafka's fatal state: ``produce`` fails at once with ``_FATAL``
    (confluent-kafka's ``KafkaException``, not itself marked fatal), and the first ``poll``
    hands the real fatal error, when ``cause`` gives one, to the error callback ``on_error``,
    as librdkafka queues it."""

    def __init__(self, on_error: object = None, cause: object = None) -> None:
        self.on_error, self.cause = on_error, cause
        self.produced = self.polls = 0

    def produce(self, topic: str, **kwargs: object) -> None:
        from confluent_kafka import KafkaError, KafkaException

        self.produced += 1
        raise KafkaException(KafkaError(KafkaError._FATAL, "Unable to produce message: Local: Fatal error"))

    def poll(self, timeout: float = 0) -> int:
        self.polls += 1
        cause, self.cause = self.cause, None
        if cause is not None:
            self.on_error(cause)  # type: ignore[operator]
        return 0

    def flush(self, timeout: float = 0) -> int:
        return self.poll(timeout)


def test_a_producer_whose_produce_fails_fatal_is_replaced_and_says_why() -> None:
    """Once librdkafka has a fatal error, every ``produce`` fails at once with ``_FATAL``.
    Before, that was a RETRIABLE failure of the event and nothing more: with no event pending
    nothing was flushed or polled, so the fatal error never reached the error callback and the
    same dead producer was used at every publish, each charging the chains' heads an attempt
    (found in review). Now the producer is dropped (a new one next publish) and polled once,
    so the real error comes out and gives the failure its kind."""
    from confluent_kafka import KafkaError

    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True))
    stuck = FatalOnProduce()  # the real error already served, or not yet queued
    pub._producer, pub._pid = stuck, os.getpid()
    result = pub.publish_chain([event(1, "t")])
    assert result.failed_id == 1 and result.failure is not None and "_FATAL" in result.failure.reason
    assert pub._producer is None and stuck.polls == 1

    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True))
    cause = KafkaError(KafkaError._UNSUPPORTED_FEATURE, "Idempotent producer not supported by any of the 1 connected "
                       "broker(s)", fatal=True)
    stuck = FatalOnProduce(pub._on_error, cause)
    pub._producer, pub._pid = stuck, os.getpid()
    first, second = pub.publish_chains([[event(1, "t")], [event(2, "t", aggregate="a2")]])
    for result in (first, second):
        assert result.published == () and result.failure is not None
        assert result.failure.kind is FailureKind.FATAL and "_UNSUPPORTED_FEATURE" in result.failure.reason
    assert pub._producer is None and stuck.produced == 2


class Scripted:
    """A producer that records, in order, each event produced (``("produce", outbox id)``) and
    each wait for delivery reports (``"flush"``), and answers each event's report at the next
    flush: delivered, or the ``KafkaError`` code that ``failing`` gives for its outbox id."""

    def __init__(self, failing: dict[int, int] | None = None) -> None:
        self.failing = failing or {}
        self.log: list[object] = []
        self._due: list[tuple[int, object]] = []

    def produce(self, topic: str, value: bytes, key: bytes, headers: list, on_delivery: object) -> None:
        outbox_id = int(dict(headers)["outbox_id"])
        self.log.append(("produce", outbox_id))
        self._due.append((outbox_id, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        from confluent_kafka import KafkaError

        self.log.append("flush")
        due, self._due = self._due, []
        for outbox_id, report in due:
            code = self.failing.get(outbox_id)
            report(None if code is None else KafkaError(code), None)  # type: ignore[operator]
        return 0


def scripted(failing: dict[int, int] | None = None) -> tuple[KafkaPublisher, Scripted]:
    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=True))
    producer = Scripted(failing)
    pub._producer, pub._pid = producer, os.getpid()
    return pub, producer


def keyed(id_: int, topic: str, key: str | None) -> OutboxMessage:
    return replace(event(id_, topic), partition_key=key)


def test_a_chain_waits_for_its_reports_where_it_moves_to_another_partition() -> None:
    """Kafka orders a partition, not a chain: one aggregate's events on two topics (or under
    two keys) go to two partitions, and the second topic's event, sent before the first's
    report, could be delivered while the first fails (a partition whose leader is down), so the
    broker would hold a chain's later event without the earlier one, which then went dead as
    overtaken (found in review). Events to one partition still go back to back."""
    pub, producer = scripted()
    results = pub.publish_chains([[event(1, "orders"), event(2, "orders"), event(3, "payments"), event(4, "payments")],
                                  [event(5, "orders", aggregate="a2")]])
    assert [r.published for r in results] == [(1, 2, 3, 4), (5,)]
    assert producer.log == [("produce", 1), ("produce", 2), ("produce", 5), "flush",
                            ("produce", 3), ("produce", 4), "flush"]

    from confluent_kafka import KafkaError
    pub, producer = scripted({1: KafkaError._MSG_TIMED_OUT})
    result = pub.publish_chain([event(1, "orders"), event(2, "payments")])
    assert producer.log == [("produce", 1), "flush"]  # the second topic's event never went
    assert result.published == () and result.failed_id == 1 and not result.overtaken
    assert result.failure is not None and "_MSG_TIMED_OUT" in result.failure.reason

    # another key is another partition; an empty key is none (librdkafka spreads it at random)
    pub, producer = scripted()
    pub.publish_chain([keyed(1, "t", "k1"), keyed(2, "t", "k1"), keyed(3, "t", "k2"), keyed(4, "t", ""),
                       keyed(5, "t", "")])
    assert producer.log == [("produce", 1), ("produce", 2), "flush", ("produce", 3), "flush",
                            ("produce", 4), "flush", ("produce", 5), "flush"]


def test_a_topic_whose_metadata_cannot_be_read_stops_its_chain_alone() -> None:
    """With auto-create off each new topic's existence is read from the cluster's metadata.
    When that read times out for the second chain's topic, that chain stops (BACKPRESSURE: no
    attempt spent) and the first chain, produced already, still gets its delivery report;
    before, the whole publish failed and the first chain's delivered event was sent again."""
    from types import SimpleNamespace

    from confluent_kafka import KafkaError, KafkaException

    class Metadata(Scripted):
        reads = 0

        def list_topics(self, timeout: float = 0) -> object:
            self.reads += 1
            if self.reads > 1:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
            return SimpleNamespace(topics={"orders": SimpleNamespace(error=None)})

    pub = KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(auto_create_topics=False))
    producer = Metadata()
    pub._producer, pub._pid = producer, os.getpid()
    first, second = pub.publish_chains([[event(1, "orders")], [event(2, "payments", aggregate="a2")]])
    assert first.ok and first.published == (1,)
    assert second.published == () and second.failed_id == 2 and second.failure is not None
    assert second.failure.kind is FailureKind.BACKPRESSURE and "_TIMED_OUT" in second.failure.reason
    assert producer.log == [("produce", 1), "flush"]


def test_a_partition_that_does_not_answer_is_charged_to_its_route_while_others_deliver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One partition whose leader is down: its events time out (``_MSG_TIMED_OUT``) while the
    events of the same publish to other partitions are delivered, so the cluster answers and
    the timeout is that topic's: BACKPRESSURE with ``route`` = the event's topic, which the
    relay pauses alone. Before, it had no route and opened the breaker for every topic. When
    nothing of the publish is delivered (the cluster down, or hanging) it stays broker-wide.
    A chain whose next wave had no time left, behind that partition's wait, is charged to the
    same route. (Scripted: Tansu, a single broker, cannot take one partition's leader down.)"""
    from confluent_kafka import KafkaError

    pub, _ = scripted({2: KafkaError._MSG_TIMED_OUT})
    good, stuck = pub.publish_chains([[event(1, "orders")], [event(2, "payments", aggregate="a2")]])
    assert good.ok and good.published == (1,)
    assert stuck.failure is not None and stuck.failure.kind is FailureKind.BACKPRESSURE
    assert stuck.failure.route == "payments" and "_MSG_TIMED_OUT" in stuck.failure.reason

    pub, _ = scripted({1: KafkaError._MSG_TIMED_OUT, 2: KafkaError._MSG_TIMED_OUT})
    results = pub.publish_chains([[event(1, "orders")], [event(2, "payments", aggregate="a2")]])
    assert [(r.failure.kind, r.failure.route) for r in results if r.failure] == [(FailureKind.BACKPRESSURE, None)] * 2

    pub, _ = scripted({2: KafkaError._MSG_TIMED_OUT})  # time runs out in the first wave's wait
    clock = iter([0.0, 0.0, 0.0] + [100.0] * 20)  # the publish's start, its first wave, its wait; then late
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    moved, stuck = pub.publish_chains([[event(1, "orders"), event(3, "audit")],
                                       [event(2, "payments", aggregate="a2")]])
    monkeypatch.undo()
    assert moved.published == (1,) and moved.failed_id == 3
    assert moved.failure is not None and moved.failure.route == "payments", moved.failure
    assert stuck.failure is not None and stuck.failure.route == "payments"


def test_an_event_opted_in_to_pipelining_goes_without_waiting_and_may_be_overtaken() -> None:
    from confluent_kafka import KafkaError

    pub, producer = scripted({1: KafkaError._MSG_TIMED_OUT})
    result = pub.publish_chains([[event(1, "orders"), event(2, "payments")]],
                                pipelined=lambda message: message.topic == "payments")[0]
    assert producer.log == [("produce", 1), ("produce", 2), "flush"]
    assert result.published == (2,) and [(o.id, o.delivered_after) for o in result.overtaken] == [(1, (2,))]


def test_a_strict_event_waits_for_every_earlier_event_of_its_wave_not_only_the_one_before_it() -> None:
    """A strict event goes in a wave only when every event produced before it in that wave
    went to its own partition. Before, each event was compared with the one right before it:
    strict 1 to 'orders', pipelined 2 and strict 3 to 'audit' (one partition) went in one
    wave, 3 was delivered while 1 timed out, and 1 went dead as overtaken by 3, a strict
    event (found in review, docs/relay.md: "a strict event keeps its full guarantee against
    everything before it")."""
    from confluent_kafka import KafkaError

    pub, producer = scripted({1: KafkaError._MSG_TIMED_OUT})
    result = pub.publish_chains([[event(1, "orders"), event(2, "audit"), event(3, "audit")]],
                                pipelined=lambda message: message.id == 2)[0]
    assert producer.log == [("produce", 1), ("produce", 2), "flush"]  # 3 never went
    assert result.published == (2,) and [(o.id, o.delivered_after) for o in result.overtaken] == [(1, (2,))]
    assert result.failed_id == 3

    pub, producer = scripted()  # all delivered: 3 goes in the next wave
    result = pub.publish_chains([[event(1, "orders"), event(2, "audit"), event(3, "audit")]],
                                pipelined=lambda message: message.id == 2)[0]
    assert producer.log == [("produce", 1), ("produce", 2), "flush", ("produce", 3), "flush"]
    assert result.ok and result.published == (1, 2, 3)

    # one partition all along: still one wave, a pipelined event in between or not
    pub, producer = scripted()
    pub.publish_chains([[event(1, "audit"), event(2, "audit"), event(3, "audit")]],
                       pipelined=lambda message: message.id == 2)
    assert producer.log == [("produce", 1), ("produce", 2), ("produce", 3), "flush"]


class Silent(Scripted):
    """A producer whose events never get a delivery report (a broker that hangs: connections
    open, no answer): each flush waits its whole timeout; ``purged`` counts the purges."""

    purged = 0

    def flush(self, timeout: float = 0) -> int:
        self.log.append("flush")
        time.sleep(timeout)
        return len(self._due)

    def purge(self) -> None:
        self.purged += 1
        self._due = []


def test_a_publish_waits_for_its_reports_no_later_than_the_deadline_it_is_given() -> None:
    """The relay passes each publish the deadline of its claim (``deadline``, monotonic: when
    the lease's safe part runs out). A publish waited its own ``wait_s`` from its start
    whatever that deadline, so a task that started just before it and met a hung broker ended
    long after the lease: lease recovery took the rows again with an attempt spent while the
    first publish still waited. Now it waits until the earlier of the two, then releases the
    rows as its own budget running out does (BACKPRESSURE: no attempt spent); a deadline
    already gone sends nothing."""
    pub = KafkaPublisher("kafka://127.0.0.1:1", max_wait_s=20.0,
                         options=KafkaOptions(auto_create_topics=True, delivery_timeout_s=30.0))
    assert pub.wait_s == 20.0
    producer = Silent()
    pub._producer, pub._pid = producer, os.getpid()
    began = time.monotonic()
    results = pub.publish_chains([[event(1, "orders"), event(2, "orders")], [event(3, "orders", aggregate="a2")]],
                                 deadline=began + 1.0)
    elapsed = time.monotonic() - began
    assert 0.9 <= elapsed < 10.0, f"waited {elapsed:.1f} s for a deadline 1 s away (wait_s 20 s)"
    assert [(r.published, r.failed_id) for r in results] == [((), 1), ((), 3)]
    for result in results:
        assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE, result.failure
        assert "no Kafka delivery report" in result.failure.reason
    assert producer.log[:3] == [("produce", 1), ("produce", 2), ("produce", 3)] and producer.purged == 1
    assert pub._producer is None  # purged: a new producer next time, as after its own budget

    producer = Silent()  # a deadline gone before the call: nothing is produced
    pub._producer, pub._pid = producer, os.getpid()
    [result] = pub.publish_chains([[event(4, "orders")]], deadline=time.monotonic() - 0.1)
    assert result.published == () and result.failed_id == 4 and producer.log == []
    assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE


def test_a_full_local_queue_waits_for_room_no_later_than_the_publish_deadline() -> None:
    """librdkafka refuses ``produce`` with ``BufferError`` when its local queue is full; the
    publisher then serves delivery reports for a while and tries once more. That wait was 1 s
    (or the delivery timeout) whatever the deadline, for each chain of the wave, so a publish
    overran its deadline by a second or more per chain. Now it waits no later than the
    deadline. A real producer whose broker hangs (a socket that listens and never answers:
    nothing leaves the producer's queue of one message, and no event ends a wait early)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:
        pub = KafkaPublisher(f"kafka://127.0.0.1:{silent.getsockname()[1]}",
                             options=KafkaOptions(auto_create_topics=True, delivery_timeout_s=30.0))
        pub._config["queue.buffering.max.messages"] = 1
        try:
            began = time.monotonic()
            results = pub.publish_chains([[event(i, "orders", aggregate=f"a{i}")] for i in range(1, 5)],
                                         deadline=began + 0.3)
            elapsed = time.monotonic() - began
        finally:
            pub._producer = None  # nothing to flush: its one message can never go
    assert elapsed < 0.3 + 0.5, f"a publish with a deadline 0.3 s away took {elapsed:.2f} s"
    full = [r.failure for r in results if r.failure is not None and "local queue is full" in r.failure.reason]
    assert full and all(f.kind is FailureKind.BACKPRESSURE and f.route is None for f in full), results


def test_headers_are_utf8_strings_and_json_for_other_values() -> None:
    assert kafka_headers({"a": "é", "n": 3, "b": True, "z": None}) == [
        ("a", "é".encode()), ("n", b"3"), ("b", b"true"), ("z", b"null")]


def test_event_headers_are_the_amqp_headers_as_kafka_headers() -> None:
    plain = event(7, "t", trace_id="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    clashing = replace(plain, headers={"x-big": 2**70, "attempt": "mine", "f": 1.5, "b": False, "x-tenant": "é",
                                       "kind": FailureKind.POISON})
    naive = replace(plain, headers={}, trace_id=None, created_at=CREATED.replace(tzinfo=None), partition_key="p")
    for message in (plain, clashing, naive):
        assert event_headers(message) == kafka_headers(build_headers(message))
        extra = {"x-outbox-error": "boom", "topic": "over"}
        assert event_headers(message, extra) == kafka_headers({**build_headers(message), **extra})
    assert dict(event_headers(clashing))["attempt"] == b"1" and dict(event_headers(clashing))["kind"] == b"poison"
    assert dict(event_headers(naive))["partition_key"] == b"p"


def test_producer_config_is_idempotent_and_takes_sasl_from_the_url() -> None:
    config = producer_config(KafkaOptions(sasl_mechanism="SCRAM-SHA-512"), "kafka://app:s%40cret@k1:9092,k2:9093")
    assert config["bootstrap.servers"] == "k1:9092,k2:9093"
    assert config["enable.idempotence"] is True and config["acks"] == "all"
    assert (config["sasl.username"], config["sasl.password"]) == ("app", "s@cret")
    assert config["sasl.mechanism"] == "SCRAM-SHA-512" and config["security.protocol"] == "sasl_ssl"


def first_bytes_a_producer_sends(options: KafkaOptions, userinfo: str = "") -> bytes:
    """What a producer made by ``producer_config`` first sends to a fake broker: a listener
    socket on a free port, read once (a TLS ClientHello starts with 0x16 0x03; Kafka's
    plaintext ApiVersions request with its 4-byte length)."""
    import socket

    from confluent_kafka import Producer

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    producer = None
    try:
        url = f"kafka://{userinfo}127.0.0.1:{listener.getsockname()[1]}"
        producer = Producer({**producer_config(options, url), "socket.connection.setup.timeout.ms": 5000})
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            return conn.recv(16)
    finally:
        listener.close()
        if producer is not None:
            producer.purge()
            producer.flush(0)


@pytest.fixture(scope="module")
def client_tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA, and a client certificate whose key is encrypted with ``KeyPass+42``."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    where = tmp_path_factory.mktemp("kafka-tls")
    ca = trustme.CA()
    cert = ca.issue_cert("relay.example")
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), password=None)
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(where / "client.pem"))
    (where / "client.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.BestAvailableEncryption(b"KeyPass+42")))
    return {"OUTBOX_KAFKA_SSL_CA_LOCATION": str(where / "ca.pem"),
            "OUTBOX_KAFKA_SSL_CERTIFICATE_LOCATION": str(where / "client.pem"),
            "OUTBOX_KAFKA_SSL_KEY_LOCATION": str(where / "client.key"),
            "OUTBOX_KAFKA_SSL_KEY_PASSWORD": "KeyPass+42"}


def test_kafka_ssl_settings_without_credentials_connect_with_tls(client_tls: dict[str, str]) -> None:
    """Found in review: the OUTBOX_KAFKA_SSL_* settings without credentials in the URL gave
    security.protocol=plaintext, and the producer's first bytes were a plaintext ApiVersions."""
    pytest.importorskip("confluent_kafka")
    plain = first_bytes_a_producer_sends(KafkaOptions())
    assert plain[:2] != b"\x16\x03" and plain[4:6] == b"\x00\x12"  # ApiVersions (key 18), in clear
    for settings in ({"OUTBOX_KAFKA_SSL_CA_LOCATION": client_tls["OUTBOX_KAFKA_SSL_CA_LOCATION"]}, client_tls):
        options = KafkaOptions.from_sources(settings)
        assert producer_config(options, "kafka://k1:9093")["security.protocol"] == "ssl"
        assert first_bytes_a_producer_sends(options)[:2] == b"\x16\x03"  # a TLS ClientHello
    with_credentials = KafkaOptions.from_sources(client_tls)
    assert producer_config(with_credentials, "kafka://app:pw@k1:9093")["security.protocol"] == "sasl_ssl"
    assert first_bytes_a_producer_sends(with_credentials, "app:pw@")[:2] == b"\x16\x03"


def test_the_kafka_key_password_reaches_librdkafka_and_is_masked(client_tls: dict[str, str]) -> None:
    from outbox.core.redact import redact

    options = KafkaOptions.from_sources(client_tls)
    assert producer_config(options, "kafka://k1:9093")["ssl.key.password"] == "KeyPass+42"
    assert "KeyPass+42" not in repr(options)
    assert redact("librdkafka: ssl.key.password=KeyPass+42 failed") == "librdkafka: ssl.key.password=*** failed"
    wrong = KafkaOptions.from_sources({**client_tls, "OUTBOX_KAFKA_SSL_KEY_PASSWORD": "wrong-pass"})
    with pytest.raises(Exception, match="ssl.key"):  # librdkafka cannot decrypt the key: refused at creation
        first_bytes_a_producer_sends(wrong)


@pytest.mark.parametrize("protocol", ["plaintext", "sasl_plaintext", "PLAINTEXT"])
def test_a_plaintext_protocol_with_kafka_ssl_settings_stops_start_up(protocol: str, client_tls: dict[str, str]) -> None:
    for name in client_tls:
        with pytest.raises(ConfigError) as caught:
            KafkaOptions.from_sources({name: client_tls[name], "OUTBOX_KAFKA_SECURITY_PROTOCOL": protocol})
        assert str(caught.value) == (f"OUTBOX_KAFKA_SECURITY_PROTOCOL={protocol.lower()!r} sends in clear, but "
                                     f"{name} is set: use ssl (sasl_ssl with credentials), or unset it")
    assert KafkaOptions.from_sources({**client_tls, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "sasl_ssl"})


@pytest.mark.parametrize("name,value,fragment", [
    ("OUTBOX_KAFKA_TOPIC_TEMPLATE", "{tenant}.{topic}", "only {topic} and {aggregate_type}"),
    ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "tls", "expected one of plaintext"),
    ("OUTBOX_KAFKA_SASL_MECHANISM", "GSSAPI", "expected one of PLAIN"),
    ("OUTBOX_KAFKA_AUTO_CREATE_TOPICS", "maybe", "is not a boolean"),
    ("OUTBOX_KAFKA_MESSAGE_MAX_BYTES", "10", "must be >= 1000"),
    ("OUTBOX_KAFKA_DELIVERY_TIMEOUT_S", "soon", "is not a number"),
])
def test_kafka_options_are_validated_naming_the_setting(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        KafkaOptions.from_sources({name: value})
    assert name in str(caught.value) and fragment in str(caught.value)


@pytest.mark.parametrize("url,fragment", [
    ("sqs://", "unknown broker transport 'sqs'"),
    ("confluentkafka://h:9092", "unknown broker transport 'confluentkafka'"),
    ("kafka://", "is not host:port"),
    ("kafka://h1:9092,h2", "'h2' is not host:port"),
    # Found in review (7 December 2026): dropped without a word, so a client meant for TLS spoke in clear
    ("kafka://h1:9093?security.protocol=ssl", "takes no parameters ('security.protocol=ssl' would be ignored)"),
    ("kafka://app:p%3Fw@h1:9093/?ssl_ca_certs=/ca.pem", "takes no parameters ('ssl_ca_certs=/ca.pem' would be ignored)"),
    ("kafka://h1:9092/prod", "takes no path ('/prod')"),
    ("kafka://h1:9092?sasl.password=S3cret-pw", "takes no parameters ('sasl.password=***' would be ignored)"),
])
def test_only_supported_destinations_are_accepted(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"OUTBOX_PUBLISH_URL": url})
    message = str(caught.value)
    assert "OUTBOX_PUBLISH_URL" in message and fragment in message
    if "transport" in fragment:
        assert "(known: amqp, amqps, pyamqp, redis, rediss, memory, kafka)" in message
    if "takes no" in fragment:
        assert "OUTBOX_KAFKA_" in message and "p%3Fw" not in message


@pytest.mark.parametrize("url", ["kafka://h1:9092", "kafka://h1:9092/", "kafka://app:p/w?x@h1:9092,h2:9093"])
def test_a_kafka_url_of_servers_alone_is_accepted(url: str) -> None:
    assert load_settings(environ={"OUTBOX_PUBLISH_URL": url}).publish_url == url


def test_the_publish_url_selects_the_publisher() -> None:
    kafka = publisher_for(load_settings(environ={"OUTBOX_PUBLISH_URL": "kafka://127.0.0.1:9092",
                                                 "OUTBOX_DEAD_LETTER_EXCHANGE": "dead"}))
    assert isinstance(kafka, KafkaPublisher) and kafka.dead_letter_topic == "dead"
    assert type(publisher_for(load_settings(environ={"OUTBOX_PUBLISH_URL": "memory://"}))).__name__ == "KombuPublisher"


# -- outbox check ------------------------------------------------------------------------------

def test_outbox_check_on_kafka(kafka_bootstrap: str, tmp_path) -> None:
    from outbox.commands.doctor import FAIL, OK, run_checks

    topic, dead = create_topic(kafka_bootstrap), create_topic(kafka_bootstrap)
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": f"kafka://{kafka_bootstrap}",
           "OUTBOX_DEAD_LETTER_EXCHANGE": dead}
    results = {r.name: r for r in run_checks(env, probe_topic=topic)}
    # the configuration line names the topics, not an exchange (which means nothing on Kafka)
    assert "Kafka topics '{topic}'" in results["configuration"].detail and "exchange" not in results["configuration"].detail
    assert results["destination"].state == OK and "reachable: 1 broker(s)" in results["destination"].detail
    assert results["kafka topics"].state == OK and f"dead-letter topic {dead!r} exists" in results["kafka topics"].detail
    # What a missing topic costs, as the relay does it (docs/destinations.md, "Failures of one topic")
    assert "that topic pauses, no attempt spent" in results["kafka topics"].detail
    assert results["kafka probe"].state == OK
    [probe] = consume(kafka_bootstrap, topic, 1)
    assert dict(probe.headers())["x-outbox-probe"] == b"true"
    missing = {r.name: r for r in run_checks({**env, "OUTBOX_DEAD_LETTER_EXCHANGE": "no-such-dead"})}
    assert missing["kafka topics"].state == FAIL and "'no-such-dead'" in missing["kafka topics"].detail
    bad = run_checks({**env, "OUTBOX_KAFKA_SECURITY_PROTOCOL": "tls"})
    assert bad[0].name == "configuration" and bad[0].state == FAIL and "OUTBOX_KAFKA_SECURITY_PROTOCOL" in bad[0].detail


def test_the_payload_limit_that_the_size_warning_names_fits_kafka(kafka_bootstrap: str, tmp_path) -> None:
    """With the defaults (a payload of up to 1 MiB, Kafka messages of up to 1,000,000 bytes)
    enqueue accepts events Kafka refuses: `outbox check` warns and names a payload limit; an
    event at that limit, with headers as large as enqueue allows, is delivered, and one
    over Kafka's own limit is not (so the warning is about something real)."""
    import re

    from outbox.commands.doctor import OK, WARN, run_checks
    from outbox.domain.events import MAX_HEADERS_BYTES, prepare_event
    from outbox.publisher.kafka import size_problem

    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": f"kafka://{kafka_bootstrap}"}
    [warned] = [r for r in run_checks(env) if r.name == "kafka message size"]
    assert warned.state == WARN and "goes dead at publish" in warned.detail
    limit = int(re.search(r"OUTBOX_MAX_PAYLOAD_BYTES=(\d+) or less", warned.detail)[1])  # type: ignore[index]
    [fits] = [r for r in run_checks({**env, "OUTBOX_MAX_PAYLOAD_BYTES": str(limit)}) if r.name == "kafka message size"]
    assert fits.state == OK
    assert size_problem(load_settings(environ={**env, "OUTBOX_MAX_PAYLOAD_BYTES": str(limit + 1)}), KafkaOptions())

    topic = create_topic(kafka_bootstrap)
    headers = {"x-big": "h" * (MAX_HEADERS_BYTES - 100)}
    largest = prepare_event(topic=topic, aggregate_type="order", aggregate_id="a" * 200, headers=headers,
                            payload={"blob": "x" * (limit - len('{"blob":""}'))}, max_payload_bytes=limit)
    assert len(largest.payload_json) == limit
    at_limit = replace(event(1, topic, aggregate="a" * 200, payload=largest.payload_json), headers=headers)
    over = replace(at_limit, id=2, payload=json.dumps({"blob": "x" * 1_000_000}))
    with publisher(kafka_bootstrap) as pub:
        delivered = pub.publish_chain([at_limit])
        refused = pub.publish_chain([over])
    assert delivered.ok, delivered.failure
    assert refused.failure is not None and refused.failure.kind is FailureKind.POISON


def test_outbox_check_on_an_unreachable_kafka(tmp_path) -> None:
    pytest.importorskip("confluent_kafka")
    from kafka_support import free_port

    from outbox.commands.doctor import FAIL, run_checks

    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": f"kafka://127.0.0.1:{free_port()}"}
    [destination] = [r for r in run_checks(env) if r.name == "destination"]
    assert destination.state == FAIL and "unreachable" in destination.detail
    assert "Connection refused" in destination.detail, destination.detail  # librdkafka's reason, not only "transport failure"


def test_outbox_check_on_a_wrong_kafka_url_says_why_within_its_bound(tansu, tmp_path) -> None:
    """Found in review (7 December 2026): `outbox check` said `unreachable: ... Broker transport
    failure` whatever the cause, since librdkafka's reason goes to its error callback, which
    the check never served; and a cluster whose brokers advertise an address this host cannot
    reach (advertised.listeners) passed as reachable, though every produce goes there."""
    from kafka_support import Tansu, free_port, tansu_or_skip

    from outbox.commands.doctor import FAIL, OK, run_checks

    def destination(url: str, **extra: str) -> tuple[str, str, float]:
        env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": url, **extra}
        began = time.monotonic()
        [result] = [r for r in run_checks(env) if r.name == "destination"]
        return result.state, result.detail, time.monotonic() - began

    state, detail, took = destination("kafka://no-such-host.invalid:9092")
    assert state == FAIL and "Failed to resolve 'no-such-host.invalid:9092'" in detail, detail
    # credentials refused (Tansu refuses every SASL handshake), password masked
    state, detail, took = destination(f"kafka://app:S3cret-pw@{tansu.bootstrap}",
                                      OUTBOX_KAFKA_SECURITY_PROTOCOL="sasl_plaintext")
    assert state == FAIL and "_AUTHENTICATION" in detail and "S3cret-pw" not in detail, detail
    # TLS (the URL's credentials mean sasl_ssl) to a listener in clear: nothing answers
    state, detail, took = destination(f"kafka://app:S3cret-pw@{tansu.bootstrap}")
    assert state == FAIL and "security.protocol sasl_ssl" in detail and "S3cret-pw" not in detail, detail
    assert took < 10, took
    # a CA file that cannot be read is the configuration's fault, not the network's
    state, detail, took = destination(f"kafka://{tansu.bootstrap}", OUTBOX_KAFKA_SSL_CA_LOCATION=str(tmp_path / "none.pem"))
    assert state == FAIL and "unreachable" not in detail and "ssl.ca.location" in detail, detail

    # brokers advertising a name this host cannot resolve: the metadata answers, no produce would
    port = free_port()
    hidden = Tansu(tansu_or_skip(), port, tmp_path / "hidden.log", advertised_port=9092, advertised_host="kafka.invalid")
    hidden.start()
    try:
        state, detail, took = destination(f"kafka://127.0.0.1:{port}")
    finally:
        hidden.stop()
    assert state == FAIL and "kafka.invalid:9092" in detail and "advertised.listeners" in detail, detail
    assert took < 10, took
    assert destination(f"kafka://{tansu.bootstrap}")[0] == OK


APART_SCRIPT = """
import json, logging, sys
from datetime import UTC, datetime
from outbox.core.config import Settings
from outbox.core.model import OutboxMessage
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    settings = Settings(publish_url=sys.argv[1], claim_timeout_ms=20_000)
    apart = ApartPublisher(settings, 15.0, publisher_for(settings))
    for n in range(3):
        event = OutboxMessage(id=n + 1, message_id=f"m-{n}", topic=sys.argv[2], aggregate_type="order",
                              aggregate_id="a1", partition_key=None, payload=json.dumps({"n": n}), headers={},
                              trace_id=None, attempts=2, created_at=datetime.now(UTC), lease="L")
        [result] = apart.publish_chains([[event]])
        print("ok" if result.ok else result.failure, flush=True)
"""


def test_a_kafka_publish_apart_does_not_repeat_the_size_warning(kafka_bootstrap: str, tmp_path) -> None:
    """Found in review (7 December 2026): each publish apart (Dramatiq's rows tried twice, a
    child process per call) made its publisher anew, and with it the once-per-process WARNING
    that OUTBOX_MAX_PAYLOAD_BYTES passes Kafka's message size (the defaults do): one more line
    on the worker's stderr per such publish. The worker's own publisher says it once."""
    import subprocess
    import sys

    topic = create_topic(kafka_bootstrap)
    script = tmp_path / "apart_kafka.py"
    script.write_text(APART_SCRIPT)
    done = subprocess.run([sys.executable, str(script), f"kafka://{kafka_bootstrap}", topic], capture_output=True,
                          text=True, timeout=90, env={k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")})
    assert done.stdout.split() == ["ok", "ok", "ok"], done.stdout + done.stderr[-2000:]
    assert done.stderr.count("Kafka refuses messages over") == 1, done.stderr[-3000:]


def test_the_relays_kafka_outage_line_names_no_exchange(caplog: pytest.LogCaptureFixture) -> None:
    """Found in review (7 December 2026): a Kafka outage was announced as `destination broker
    unreachable (kafka://... exchange 'outbox')`, pointing at OUTBOX_EXCHANGE, which plays no
    part on Kafka (`outbox check` already leaves it out for that reason)."""
    from outbox.core.config import RelayOptions
    from outbox.relay.shared import make_relay_outage

    settings = load_settings(environ={"OUTBOX_PUBLISH_URL": "kafka://app:S3cret-pw@127.0.0.1:9",
                                      "OUTBOX_DATABASE_URL": "sqlite:///unused.db"})
    outage = make_relay_outage("destination broker", settings, RelayOptions(), "memory://",
                               logging.getLogger("outbox.test.kafka-outage"))
    with caplog.at_level(logging.WARNING, logger="outbox.test.kafka-outage"):
        outage.failed("KafkaError _TRANSPORT: down")
    [line] = [r.getMessage() for r in caplog.records if r.name == "outbox.test.kafka-outage"]
    assert "destination broker unreachable (kafka://app:***@127.0.0.1:9)" in line, line
    assert "exchange" not in line and "S3cret-pw" not in line, line


def test_connection_failures_are_logged_once_per_outage(tansu, caplog: pytest.LogCaptureFixture) -> None:
    """librdkafka logs a connection failure at every reconnect while the broker is down: the
    first of an outage at WARNING, the rest at DEBUG, and a new outage warns again."""
    topic = create_topic(tansu.bootstrap)

    def failures() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "outbox.publisher.kafka" and r.getMessage().startswith("FAIL ")]

    caplog.set_level(logging.DEBUG, logger="outbox.publisher.kafka")
    with publisher(tansu.bootstrap, delivery_timeout_s=3.0) as pub:
        assert pub.publish_chain([event(1, topic)]).ok
        for outage in (1, 2):
            caplog.clear()
            tansu.stop()
            assert pub.publish_chain([event(10 + outage, topic)]).failure is not None
            levels = [r.levelno for r in failures()]
            # One WARNING, the later failures at DEBUG (a disconnection is at INFO). How many
            # later ones there are is librdkafka's: it reconnects with a growing backoff, to the
            # bootstrap address and to the broker, and leaves out repeats of the same error.
            assert levels.count(logging.WARNING) == 1, levels
            assert levels.count(logging.DEBUG) >= 1 and not {logging.ERROR, logging.CRITICAL} & set(levels), levels
            tansu.start()
            create_topic(tansu.bootstrap, topic)  # memory storage: the restart lost it
            for _ in range(3):  # the first send after a restart may meet UNKNOWN_PRODUCER_ID
                if pub.publish_chain([event(20 + outage, topic)]).ok:
                    break
            else:
                pytest.fail("the publisher did not recover")


def test_without_confluent_kafka_a_publish_is_fatal_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a new user's walkthrough: with OUTBOX_PUBLISH_URL=kafka://... and no `kafka`
    extra, the publisher's error handler imported confluent-kafka itself, so the intended
    configuration error became a RETRIABLE ModuleNotFoundError and every event went dead at
    OUTBOX_MAX_ATTEMPTS. It is FATAL (claims stop, no attempt spent), naming the extra."""
    import sys

    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # import confluent_kafka -> ImportError
    with KafkaPublisher("kafka://127.0.0.1:1", options=KafkaOptions(delivery_timeout_s=1.0)) as pub:
        [result] = pub.publish_chains([[event(1, "orders")]])
    assert result.published == () and result.failed_id == 1
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL, result.failure
    assert "confluent-kafka is not installed" in result.failure.reason and "kafka" in result.failure.reason
