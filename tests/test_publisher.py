"""The publisher: pure parts (headers, poison checks, error classification) and the real
brokers (RabbitMQ for the ordering and unroutable rules, Redis and memory:// for the
sequential transports)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

import pytest
from amqp import exceptions as amqp_exc
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError
from publisher_support import amqp_hostport, make_message, raw_body
from relay_e2e_support import Proxy
from services import AMQP_URL, require

from outbox.core.config import load_settings
from outbox.publisher import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ChainResult,
    FailureKind,
    KombuPublisher,
    Publisher,
    PublishFailure,
    build_headers,
    checked_headers,
    classify,
    failure_from,
    poison_check,
)

REDIS_PUBLISH_URL = os.environ.get("OUTBOX_TEST_PUBLISH_REDIS_URL", "redis://127.0.0.1:6379/15")
# -- headers -------------------------------------------------------------------------------

def test_headers_carry_the_contract_fields() -> None:
    m = make_message(7, headers={"tenant": "acme", "n": 3}, attempts=2,
                     trace_id="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    h = build_headers(m)
    assert h["message_id"] == m.message_id
    assert h["outbox_id"] == 7
    assert h["topic"] == "orders.created"
    assert h["aggregate_type"] == "order"
    assert h["aggregate_id"] == "42"
    assert h["partition_key"] == "42"  # defaults to the aggregate id
    assert h["attempt"] == 3
    assert h["created_at"] == "2024-05-01T12:30:45.123Z"
    assert h["traceparent"] == m.trace_id
    assert h["tenant"] == "acme" and h["n"] == 3


def test_reserved_headers_win_over_caller_headers() -> None:
    m = make_message(7, headers={"message_id": "forged", "outbox_id": 1, "attempt": 99, "topic": "x",
                                 "traceparent": "caller-tp"}, trace_id="captured-tp")
    h = build_headers(m)
    assert h["message_id"] == m.message_id and h["outbox_id"] == 7 and h["attempt"] == 1 and h["topic"] == "orders.created"
    assert h["traceparent"] == "captured-tp"
    # without a captured trace context, the caller's traceparent is kept
    assert build_headers(make_message(8, headers={"traceparent": "caller-tp"}))["traceparent"] == "caller-tp"
    assert "traceparent" not in build_headers(make_message(9))


def test_header_details() -> None:
    assert build_headers(make_message(1, partition_key="p-1"))["partition_key"] == "p-1"
    naive = make_message(1, created_at=datetime(2024, 1, 2, 3, 4, 5))
    assert build_headers(naive)["created_at"] == "2024-01-02T03:04:05.000Z"
    other_zone = make_message(1, created_at=datetime(2024, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2))))
    assert build_headers(other_zone)["created_at"] == "2024-01-02T03:04:05.000Z"
    m = make_message(1, headers={"a": 1})
    build_headers(m)["a"] = 2
    assert m.headers == {"a": 1}  # the message's headers are not modified


def test_created_at_is_isoformat_text_to_the_millisecond() -> None:
    """iso_utc formats from the fields (a faster path): the same text as ``isoformat``,
    milliseconds truncated, not rounded, and a four-digit year below 1000 too."""
    from outbox.publisher import iso_utc

    for moment in (datetime(2024, 12, 31, 23, 59, 59, 999_999), datetime(5, 1, 2, 3, 4, 5, 6_000),
                   datetime(2024, 1, 2, 3, 4, 5, 123_456, tzinfo=UTC),
                   datetime(2024, 1, 1, 0, 30, 0, 1_500, tzinfo=timezone(timedelta(hours=1)))):
        utc = moment if moment.tzinfo is None else moment.astimezone(UTC).replace(tzinfo=None)
        assert iso_utc(moment) == utc.isoformat(timespec="milliseconds") + "Z", moment
    assert iso_utc(datetime(2024, 12, 31, 23, 59, 59, 999_999)) == "2024-12-31T23:59:59.999Z"
    assert iso_utc(datetime(2024, 1, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))) == "2023-12-31T23:30:00.000Z"


# -- poison checks -----------------------------------------------------------------------------

def test_poison_check() -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 16 * 1024 * 1024
    assert poison_check(make_message(1)) is None
    big = make_message(1, payload=json.dumps({"x": "y" * 2000}))
    failure = poison_check(big, max_bytes=1000)
    assert failure is not None and failure.kind is FailureKind.POISON and "maximum of 1000" in failure.reason
    assert poison_check(big, max_bytes=10_000) is None
    # multi-byte characters count as bytes, not characters
    assert poison_check(make_message(1, payload='"' + "é" * 600 + '"'), max_bytes=1000) is not None
    surrogate = poison_check(make_message(1, payload='"\ud800"'))
    assert surrogate is not None and surrogate.kind is FailureKind.POISON
    unencodable = poison_check(make_message(1, headers={"huge": 2**70}))
    assert unencodable is not None and unencodable.kind is FailureKind.POISON and "headers" in unencodable.reason
    huge_headers = poison_check(make_message(1, headers={"blob": "z" * 100_000}))
    assert huge_headers is not None and huge_headers.kind is FailureKind.POISON


# -- classification ---------------------------------------------------------------------------

def wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as exc:
        return exc


def test_the_cheap_header_size_bound_holds_for_every_kind_of_header_value() -> None:
    """``checked_headers`` skips the AMQP encoding when 2 x the JSON size + 64 is under the
    limit: check that bound against the real encoder on flat headers of every value kind
    enqueue accepts (the worst case is many small integers)."""
    import random

    from amqp.serialization import dumps as amqp_dumps

    rng = random.Random(7)
    values = [0, 1, -1, 2**62, -(2**63), 1.5, -0.0, 1e300, True, False, None, "", "x", "é" * 5, "\u2603", "a" * 300]
    for _ in range(300):
        headers = {("k" * rng.randint(1, 3)) + str(i): rng.choice(values) for i in range(rng.randint(1, 60))}
        message = make_message(1, headers=headers)
        full = build_headers(message)
        encoded = len(amqp_dumps("F", [full]))
        assert encoded <= 2 * len(json.dumps(full, allow_nan=False)) + 64, full
        assert checked_headers(message) == (full, None)
    # and near the limit the real encoder decides
    many = make_message(1, headers={f"k{i}": 1 for i in range(8000)})
    assert checked_headers(many)[1] is not None and "bytes encoded" in checked_headers(many)[1].reason


@pytest.mark.parametrize("exc, kind", [
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), FailureKind.BACKPRESSURE),
    (ConnectionResetError(errno.ECONNRESET, "reset"), FailureKind.BACKPRESSURE),
    (BrokenPipeError(errno.EPIPE, "broken pipe"), FailureKind.BACKPRESSURE),
    (TimeoutError("timed out"), FailureKind.BACKPRESSURE),
    (socket.gaierror(-2, "Name or service not known"), FailureKind.BACKPRESSURE),
    (OSError("Server unexpectedly closed connection"), FailureKind.BACKPRESSURE),
    (OperationalError("[Errno 111] Connection refused"), FailureKind.BACKPRESSURE),
    (amqp_exc.RecoverableConnectionError("basic_publish: connection closed"), FailureKind.BACKPRESSURE),
    (amqp_exc.ConnectionForced(320, "CONNECTION_FORCED - broker forced connection closure"), FailureKind.BACKPRESSURE),
    (amqp_exc.ResourceLocked(405, "RESOURCE_LOCKED"), FailureKind.BACKPRESSURE),
    (amqp_exc.ResourceError(506, "resource error"), FailureKind.BACKPRESSURE),
    (amqp_exc.MessageNacked(), FailureKind.BACKPRESSURE),
    (amqp_exc.PreconditionFailed(406, "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'outbox' "
                                      "in vhost '/': received 'topic' but current is 'direct'"), FailureKind.FATAL),
    (amqp_exc.PreconditionFailed(406, "PRECONDITION_FAILED - message size 20000000 is larger than configured "
                                      "max size 16777216"), FailureKind.POISON),
    (amqp_exc.AccessRefused(403, "ACCESS_REFUSED - Login was refused"), FailureKind.FATAL),
    (amqp_exc.NotAllowed(530, "NOT_ALLOWED - vhost nosuch not found"), FailureKind.FATAL),
    (amqp_exc.InvalidPath(402, "INVALID_PATH"), FailureKind.FATAL),
    (amqp_exc.ContentTooLarge(311, "content too large"), FailureKind.POISON),
    (amqp_exc.FrameError(501, "FRAME_ERROR - frame_too_large"), FailureKind.POISON),
    (amqp_exc.FrameSyntaxError("Table type 'x' not handled by amqp."), FailureKind.POISON),
    (amqp_exc.NotFound(404, "NOT_FOUND - no exchange 'outbox' in vhost '/'"), FailureKind.RETRIABLE),
    (amqp_exc.InternalError(541, "INTERNAL_ERROR"), FailureKind.RETRIABLE),
    (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), FailureKind.POISON),
    (RuntimeError("something else"), FailureKind.RETRIABLE),
    (ValueError("???"), FailureKind.RETRIABLE),
])
def test_classify(exc: BaseException, kind: FailureKind) -> None:
    assert classify(exc) is kind


def test_classify_looks_through_wrappers() -> None:
    # kombu re-raises transport errors as OperationalError "from" the original
    refused = wrapped(OperationalError("Connection refused"), ConnectionRefusedError(111, "Connection refused"))
    assert classify(refused) is FailureKind.BACKPRESSURE
    auth = wrapped(OperationalError("login refused"), amqp_exc.AccessRefused(403, "ACCESS_REFUSED"))
    assert classify(auth) is FailureKind.FATAL  # the specific cause decides over the generic wrapper
    size = wrapped(RuntimeError("publish failed"), amqp_exc.PreconditionFailed(406, "message size 9 is larger "
                                                                                   "than configured max size 8"))
    assert classify(size) is FailureKind.POISON


def test_classify_redis_errors() -> None:
    redis_exc = pytest.importorskip("redis.exceptions")
    assert classify(redis_exc.ConnectionError("Error 111 connecting")) is FailureKind.BACKPRESSURE
    assert classify(redis_exc.TimeoutError("Timeout reading from socket")) is FailureKind.BACKPRESSURE
    assert classify(redis_exc.BusyLoadingError("LOADING")) is FailureKind.BACKPRESSURE
    assert classify(redis_exc.AuthenticationError("invalid password")) is FailureKind.FATAL
    assert classify(redis_exc.ResponseError("NOAUTH Authentication required.")) is FailureKind.FATAL
    assert classify(redis_exc.ResponseError("WRONGPASS invalid username-password pair")) is FailureKind.FATAL
    assert classify(redis_exc.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")) \
        is FailureKind.BACKPRESSURE
    assert classify(redis_exc.ResponseError("ERR something")) is FailureKind.RETRIABLE
    assert classify(redis_exc.DataError("Invalid input of type: 'dict'")) is FailureKind.POISON


def test_only_a_lost_connection_is_retried_transparently() -> None:
    from outbox.publisher import _connection_lost

    assert _connection_lost(ConnectionResetError(104, "reset"))
    assert _connection_lost(OSError("Server unexpectedly closed connection"))
    assert _connection_lost(amqp_exc.RecoverableConnectionError("basic_publish: connection closed"))
    assert not _connection_lost(wrapped(amqp_exc.RecoverableConnectionError("basic_publish: timed out"),
                                        TimeoutError("timed out")))
    assert not _connection_lost(amqp_exc.MessageNacked())
    assert not _connection_lost(amqp_exc.AccessRefused(403, "ACCESS_REFUSED"))


def test_failure_from_keeps_reason_short() -> None:
    failure = failure_from(RuntimeError("x" * 5000))
    assert failure.kind is FailureKind.RETRIABLE and len(failure.reason) <= 1000
    assert failure.reason.startswith("RuntimeError: ")


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="unroutable"):
        KombuPublisher("memory://", "outbox", unroutable="ignore")
    with pytest.raises(ValueError):
        KombuPublisher("memory://", "")
    p = KombuPublisher.from_settings(load_settings({"OUTBOX_PUBLISH_URL": "memory://", "OUTBOX_EXCHANGE": "ev"}))
    assert isinstance(p, Publisher) and p.url == "memory://" and p.exchange == "ev" and p.unroutable == "fail"
    assert p.dead_letter_exchange is None and p.publish_dead(make_message(1), "boom") is None
    assert p.publish_chain([]) == ChainResult()
    p.close()


# -- RabbitMQ -------------------------------------------------------------------------------

@pytest.fixture
def rabbit() -> Iterator[dict[str, Any]]:
    """A unique exchange (declared the way the publisher declares it, deleted afterwards)
    with an exclusive queue bound for ``orders.#``; yields a helper to drain the queue."""
    require("RabbitMQ", *amqp_hostport())
    name = f"outbox-test-{uuid.uuid4().hex[:10]}"
    conn = Connection(AMQP_URL, connect_timeout=3)
    channel = conn.channel()
    exchange = Exchange(name, type="topic", durable=True)
    exchange(channel).declare()
    queue = Queue(f"{name}-q", exchange=exchange, routing_key="orders.#", exclusive=True, auto_delete=True)
    bound = queue(channel)
    bound.declare()

    def drain() -> list[Any]:
        got = []
        while (message := bound.get(no_ack=True)) is not None:
            got.append(message)
        return got

    yield {"url": AMQP_URL, "exchange": name, "drain": drain, "channel": channel}
    try:
        exchange(channel).delete()
    finally:
        conn.release()


def test_rabbitmq_chain_arrives_in_order_with_properties(rabbit: dict[str, Any]) -> None:
    chain = [make_message(101, "orders.created", headers={"tenant": "acme"}),
             make_message(102, "orders.paid", trace_id="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
             make_message(103, "orders.shipped", payload='{"ü":"ß","n":[1,2.5,null]}')]
    with KombuPublisher(rabbit["url"], rabbit["exchange"]) as publisher:
        result = publisher.publish_chain(chain)
        assert result == ChainResult(published=(101, 102, 103))
        assert result.ok
        # a second chain on the same connection (the exchange is declared once per connection)
        assert publisher.publish_chain([make_message(104, "orders.closed")]).published == (104,)
    got = rabbit["drain"]()
    assert [m.headers["outbox_id"] for m in got] == [101, 102, 103, 104]
    for message, sent in zip(got, chain):
        assert raw_body(message) == sent.payload.encode("utf-8")  # the stored JSON, byte for byte
        assert message.content_type == "application/json"
        assert message.content_encoding == "utf-8"
        assert message.properties["delivery_mode"] == 2
        assert message.properties["message_id"] == sent.message_id
        assert message.delivery_info["routing_key"] == sent.topic
        assert message.headers == build_headers(sent)
    assert got[0].headers["tenant"] == "acme"
    assert got[1].headers["traceparent"].startswith("00-0af7")
    assert json.loads(raw_body(got[2])) == {"ü": "ß", "n": [1, 2.5, None]}


def test_rabbitmq_unroutable_event_stops_the_chain(rabbit: dict[str, Any]) -> None:
    chain = [make_message(201, "orders.created"), make_message(202, "nobody.listens"),
             make_message(203, "orders.paid")]
    with KombuPublisher(rabbit["url"], rabbit["exchange"]) as publisher:
        result = publisher.publish_chain(chain)
        assert result.published == (201,)
        assert result.failed_id == 202
        assert result.failure is not None and result.failure.kind is FailureKind.RETRIABLE
        assert result.failure.reason.startswith("unroutable: no queue bound for routing key 'nobody.listens'")
        assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [201]  # nothing after the gap
        # the publisher (and its connection) carry on normally afterwards
        assert publisher.publish_chain([make_message(204, "orders.paid")]).published == (204,)
        assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [204]
        # an unroutable event at the head: nothing published
        head = publisher.publish_chain([make_message(205, "nobody.listens"), make_message(206)])
        assert head.published == () and head.failed_id == 205
        assert rabbit["drain"]() == []


def test_rabbitmq_unroutable_drop_policy(rabbit: dict[str, Any]) -> None:
    chain = [make_message(301, "orders.created"), make_message(302, "nobody.listens"),
             make_message(303, "orders.paid")]
    with KombuPublisher(rabbit["url"], rabbit["exchange"], unroutable="drop") as publisher:
        result = publisher.publish_chain(chain)
    assert result == ChainResult(published=(301, 302, 303), unroutable=(302,))
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [301, 303]


def test_rabbitmq_poison_event_stops_the_chain_before_the_broker(rabbit: dict[str, Any]) -> None:
    chain = [make_message(401), make_message(402, payload=json.dumps({"blob": "x" * 5000})), make_message(403)]
    with KombuPublisher(rabbit["url"], rabbit["exchange"], max_message_bytes=1024) as publisher:
        result = publisher.publish_chain(chain)
        assert result.published == (401,) and result.failed_id == 402
        assert result.failure is not None and result.failure.kind is FailureKind.POISON
        assert publisher.publish_chain([make_message(403)]).ok
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [401, 403]


def test_rabbitmq_nack_stops_the_chain(rabbit: dict[str, Any]) -> None:
    """A queue that refuses a message nacks it in confirm mode: the chain stops there and
    the events behind it are not sent (in a transaction it would be dropped silently)."""
    full = Queue(f"{rabbit['exchange']}-full", exchange=Exchange(rabbit["exchange"], type="topic", durable=True),
                 routing_key="orders.#", exclusive=True, auto_delete=True,
                 queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"})(rabbit["channel"])
    full.declare()
    with KombuPublisher(rabbit["url"], rabbit["exchange"]) as publisher:
        result = publisher.publish_chain([make_message(1001), make_message(1002), make_message(1003)])
        assert result.published == (1001,) and result.failed_id == 1002
        assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE
        assert "basic.nack" in result.failure.reason
        full.purge()  # room for one more
        retry = publisher.publish_chain([make_message(1002), make_message(1003), make_message(1004)])
        assert retry.published == (1002,) and retry.failed_id == 1003
    # A nack means *some* queue refused it: the other queue bound to the exchange got each
    # nacked event (1002 the first time, 1003), and will get it again on retry (at-least-once).
    # Nothing behind a nacked event was ever sent.
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [1001, 1002, 1002, 1003]


def test_rabbitmq_chains_in_waves_each_arrive_as_a_prefix(rabbit: dict[str, Any]) -> None:
    """Several chains in one call share their round trips, and each still stops at its own
    problem: an unroutable event, a poison event, or nothing; the others carry on."""
    chains = [
        [make_message(1101), make_message(1102), make_message(1103), make_message(1104)],
        [make_message(1201), make_message(1202, "nobody.listens"), make_message(1203)],
        [make_message(1301, payload=json.dumps({"blob": "x" * 5000})), make_message(1302)],
        [make_message(1401)],
        [],
    ]
    with KombuPublisher(rabbit["url"], rabbit["exchange"], max_message_bytes=1024) as publisher:
        results = publisher.publish_chains(chains)
    assert results[0] == ChainResult(published=(1101, 1102, 1103, 1104))
    assert results[1].published == (1201,) and results[1].failed_id == 1202
    assert results[1].failure is not None and results[1].failure.reason.startswith("unroutable:")
    assert results[2].published == () and results[2].failed_id == 1301
    assert results[2].failure is not None and results[2].failure.kind is FailureKind.POISON
    assert results[3] == ChainResult(published=(1401,))
    assert results[4] == ChainResult()
    got = [m.headers["outbox_id"] for m in rabbit["drain"]()]
    assert sorted(got) == [1101, 1102, 1103, 1104, 1201, 1401]  # nothing behind a gap
    assert [i for i in got if i < 1200] == [1101, 1102, 1103, 1104]  # in order within the chain


def test_rabbitmq_a_message_the_broker_refuses_as_too_large_fails_alone(rabbit: dict[str, Any]) -> None:
    """Found in review: with OUTBOX_RELAY_MAX_MESSAGE_BYTES above the broker's
    max_message_size, RabbitMQ closes the channel over the large message (406) without
    saying which one it was, and every chain of its wave was failed as poison: their events
    went dead, one of them never sent. Now the call goes on one event a wave, and only the
    large one fails. 129 MiB: over RabbitMQ's default limit of 128 MiB."""
    large = make_message(2201, payload=json.dumps("x" * (129 * 1024 * 1024)))
    chains = [[make_message(2101), make_message(2102)], [large, make_message(2202)], [make_message(2301)]]
    with KombuPublisher(rabbit["url"], rabbit["exchange"], max_message_bytes=1 << 30) as publisher:
        results = publisher.publish_chains(chains)
        if results[1].published:
            pytest.skip("this RabbitMQ takes messages of 129 MiB (its max_message_size is larger)")
        assert publisher.publish_chains([[make_message(2401)]]) == [ChainResult(published=(2401,))]  # usable again
    assert results[0] == ChainResult(published=(2101, 2102))
    assert results[1].published == () and results[1].failed_id == 2201
    assert results[1].failure is not None and results[1].failure.kind is FailureKind.POISON
    assert "larger than configured max size" in results[1].failure.reason
    assert results[2] == ChainResult(published=(2301,))
    got = [m.headers["outbox_id"] for m in rabbit["drain"]()]
    assert set(got) == {2101, 2102, 2301, 2401}  # the first wave's may come twice: still prefixes
    assert [i for i in got if i < 2200] in ([2101, 2102], [2101, 2101, 2102])


def test_a_failure_after_a_wave_refused_as_a_whole_stops_every_chain_still_going() -> None:
    """After a wave refused as a whole (the call goes on one event a wave), a wave that then
    fails otherwise (the broker stops confirming) stopped its own chain only: the others
    came back with neither a failure nor all their events published, which the relay logs
    as an error per chain (found in review). A stand-in for the broker: the first wave is
    refused as a frame too large, every later one is not confirmed."""
    waves: list[list[int]] = []

    class Refusing(KombuPublisher):
        def _ready(self, deadline: float | None = None) -> None:
            pass

        def _discard(self) -> None:
            pass

        def _send_wave(self, messages: Any, headers: Any, deadline: float | None = None, **options: Any) -> list[Any]:
            waves.append([m.id for m in messages])
            if len(waves) == 1:
                raise amqp_exc.FrameError("frame too large")
            raise TimeoutError("no publisher confirm within 15 s")

    publisher = Refusing(AMQP_URL, "stand-in")
    results = publisher.publish_chains([[make_message(1, aggregate_id="a")], [make_message(2, aggregate_id="b")],
                                        [make_message(3, aggregate_id="c"), make_message(4, aggregate_id="c")]])
    assert waves == [[1, 2, 3], [1]]
    assert [(r.published, r.failed_id) for r in results] == [((), 1), ((), 2), ((), 3)]
    assert all(r.failure is not None and r.failure.kind is FailureKind.BACKPRESSURE for r in results), results


def test_rabbitmq_a_nack_stops_every_chain_of_the_call(rabbit: dict[str, Any]) -> None:
    """The broker pushing back on one event stops the whole call: the other chains stop at
    their next event with the same back-pressure failure, after what was already confirmed."""
    full = Queue(f"{rabbit['exchange']}-full", exchange=Exchange(rabbit["exchange"], type="topic", durable=True),
                 routing_key="orders.#", exclusive=True, auto_delete=True,
                 queue_arguments={"x-max-length": 2, "x-overflow": "reject-publish"})(rabbit["channel"])
    full.declare()
    with KombuPublisher(rabbit["url"], rabbit["exchange"]) as publisher:
        results = publisher.publish_chains([[make_message(1501), make_message(1502)],
                                            [make_message(1601), make_message(1602)],
                                            [make_message(1701), make_message(1702)]])
    # the first wave (1501, 1601, 1701): two fit in the queue, the third is nacked
    assert sum(len(r.published) for r in results) == 2
    assert all(r.failure is not None and r.failure.kind is FailureKind.BACKPRESSURE for r in results)
    assert all(r.published == () or r.published == (r.failed_id - 1,) for r in results)
    assert all(r.failed_id is not None and r.failed_id % 100 == len(r.published) + 1 for r in results)


def test_a_chain_stopped_by_a_route_another_event_was_refused_on_names_that_event() -> None:
    """Found in review: a chain whose next event goes to a route a queue refused in this call
    (its event never sent) was stopped with the very failure of the nacked event, "the broker
    refused the message (basic.nack)": the relay's one WARNING per route pause names the first
    chain it settles, so it named an event that was never sent as the one refused. Its
    failure now says it was not sent and which event was refused."""
    from outbox.publisher.waves import ChainProgress, Wave, settle_wave

    refusing = ChainProgress([make_message(3001, aggregate_id="a"), make_message(3002, aggregate_id="a")])
    waiting = ChainProgress([make_message(3101, aggregate_id="b"), make_message(3102, aggregate_id="b")])
    wave = Wave(windows=[(refusing, [refusing.next]), (waiting, [waiting.next])],
                messages=[refusing.next, waiting.next], headers=[{}, {}])
    nack = PublishFailure(FailureKind.BACKPRESSURE, "the broker refused the message (basic.nack)",
                          route="orders.created")
    refused: dict[str, PublishFailure] = {}
    assert settle_wave(wave, [nack, None], refused, unroutable="fail", exchange="x") == []
    assert refusing.result().failure == nack and refusing.result().failed_id == 3001
    stopped = waiting.result()
    assert stopped.published == (3101,) and stopped.failed_id == 3102
    assert stopped.failure is not None and stopped.failure.kind is FailureKind.BACKPRESSURE
    assert stopped.failure.route == "orders.created"
    assert stopped.failure.reason.startswith("not sent: a queue of its routing key refused outbox id 3001 "), (
        stopped.failure.reason)


def test_rabbitmq_exchange_of_another_type_is_fatal(rabbit: dict[str, Any]) -> None:
    name = f"outbox-test-direct-{uuid.uuid4().hex[:8]}"
    direct = Exchange(name, type="direct", durable=False, auto_delete=False)
    direct(rabbit["channel"]).declare()
    try:
        with KombuPublisher(rabbit["url"], name) as publisher:
            result = publisher.publish_chain([make_message(501), make_message(502)])
        assert result.published == () and result.failed_id == 501
        assert result.failure is not None and result.failure.kind is FailureKind.FATAL
        assert "inequivalent" in result.failure.reason
        from outbox.commands.doctor import check_destination  # outbox check says so too

        [_, bound] = check_destination(load_settings({"OUTBOX_PUBLISH_URL": rabbit["url"], "OUTBOX_EXCHANGE": name}))
        assert bound.state == "FAIL" and "inequivalent" in bound.detail
    finally:
        direct(rabbit["channel"]).delete()


def test_rabbitmq_bad_credentials_are_fatal(rabbit: dict[str, Any]) -> None:
    parts = urlsplit(rabbit["url"])
    url = f"amqp://guest:not-the-password@{parts.hostname}:{parts.port or 5672}//"
    with KombuPublisher(url, rabbit["exchange"]) as publisher:
        result = publisher.publish_chain([make_message(601)])
    assert result.failure is not None and result.failure.kind is FailureKind.FATAL


def test_rabbitmq_connection_lost_while_idle_is_replaced(rabbit: dict[str, Any]) -> None:
    with KombuPublisher(rabbit["url"], rabbit["exchange"]) as publisher:
        assert publisher.publish_chain([make_message(701)]).ok
        stale = publisher._conn
        # the broker side goes away while the publisher is idle
        stale.connection.transport.sock.shutdown(socket.SHUT_RDWR)
        result = publisher.publish_chain([make_message(702), make_message(703)])
        assert result == ChainResult(published=(702, 703))
        assert publisher._conn is not stale  # replaced once, transparently
    ids = [m.headers["outbox_id"] for m in rabbit["drain"]()]
    assert ids[0] == 701 and ids[-2:] == [702, 703]


def test_rabbitmq_a_dead_first_host_of_the_url_fails_over_to_the_next(rabbit: dict[str, Any]) -> None:
    """``OUTBOX_PUBLISH_URL`` may list alternates (``amqp://h1//;amqp://h2//``): with the
    first one down the publisher connects to the next, as kombu's own retry does. Found in
    review: the publisher's own connect attempts (capped by the deadline) never switched
    host, so every publish failed until the first came back."""
    dead_first = rabbit["url"].replace(f":{amqp_hostport()[1]}/", ":1/", 1) + ";" + rabbit["url"]
    assert dead_first.startswith("amqp://") and ":1/" in dead_first
    with KombuPublisher(dead_first, rabbit["exchange"]) as publisher:
        assert publisher.publish_chains([[make_message(711)]], deadline=time.monotonic() + 10) == [
            ChainResult(published=(711,))]
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [711]


def test_rabbitmq_a_silent_first_host_is_passed_over_by_the_next_connection(rabbit: dict[str, Any]) -> None:
    """A first host that stops answering without a reset (a dead VM behind a firewall that drops
    packets, a load balancer that passes nothing), and publishes with less time left than the
    connect timeout (3 s). Found in review: the attempt on the first host took all the time
    left and the next connection began at the first host again, so the second was never
    tried and every publish failed for as long as the first stayed silent. Each connection now
    begins at the host after the one that failed last (or at the one that worked last)."""
    silent = Proxy()
    silent.black_hole()
    try:
        with KombuPublisher(f"{silent.amqp_url};{rabbit['url']}", rabbit["exchange"]) as publisher:
            [first] = publisher.publish_chains([[make_message(721)]], deadline=time.monotonic() + 1.0)
            assert first.failure is not None and first.failure.kind is FailureKind.BACKPRESSURE, first.failure
            [second] = publisher.publish_chains([[make_message(722)]], deadline=time.monotonic() + 1.0)
            assert second.ok, second.failure
            publisher._discard()  # the connection lost: the next one begins at the host that worked
            began = time.monotonic()
            [third] = publisher.publish_chains([[make_message(723)]], deadline=began + 1.0)
            assert third.ok and time.monotonic() - began < 1.0, third.failure
    finally:
        silent.close()
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [722, 723]


def test_rabbitmq_a_host_that_refuses_the_login_does_not_hold_every_later_connection(rabbit: dict[str, Any]) -> None:
    """Alternates that do not all take the same login (another user's password on one node, a
    vhost down on one node): found in review of the rotated first host (7 December 2026). The
    first host drops out for a moment, the next refuses the login (FATAL, not retried), and
    every later connection began at that refusing host: FATAL at each, for as long as the
    process lived, though the first host was back. Before the rotation each connection began
    at the first host again. The next connection now begins after the host that failed last,
    whatever its failure."""
    proxy = Proxy()
    refusing = rabbit["url"].replace("guest:guest@", "guest:wrong-password@", 1)
    assert refusing != rabbit["url"]
    try:
        with KombuPublisher(f"{proxy.amqp_url};{refusing}", rabbit["exchange"]) as publisher:
            assert publisher.publish_chain([make_message(731)]).ok
            proxy.cut()
            publisher._discard()
            refused = publisher.publish_chain([make_message(732)])
            assert refused.failure is not None and refused.failure.kind is FailureKind.FATAL, refused.failure
            proxy.restore()
            again = publisher.publish_chain([make_message(733)])
            assert again.ok, again.failure
    finally:
        proxy.close()
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [731, 733]


def test_rabbitmq_confirms_held_back_past_the_lease_are_backpressure_within_it(rabbit: dict[str, Any]) -> None:
    """A broker that takes the messages but never confirms them (a stalled network path, a
    hung broker): the wave gives up within the publish's part of the lease (4 s x 0.8 here,
    not the 15 s default), so its rows are released as back-pressure with no attempt spent
    instead of being taken again by lease recovery with one spent."""
    proxy = Proxy()
    try:
        settings = load_settings({"OUTBOX_PUBLISH_URL": proxy.amqp_url, "OUTBOX_EXCHANGE": rabbit["exchange"],
                                  "OUTBOX_CLAIM_TIMEOUT_MS": "4000"})
        with KombuPublisher.from_settings(settings) as publisher:
            assert publisher.confirm_timeout == pytest.approx(3.2)
            assert publisher.publish_chain([make_message(801)]).ok  # connected, confirms flowing
            proxy.hold_replies()
            began = time.monotonic()
            result = publisher.publish_chain([make_message(802), make_message(803)])
            waited = time.monotonic() - began
        assert result.published == () and result.failed_id == 802 and result.failure is not None
        assert result.failure.kind is FailureKind.BACKPRESSURE, result.failure
        assert "no publisher confirm within 3.2 s" in result.failure.reason
        assert waited < 4.0, f"waited {waited:.1f} s, longer than the lease"
    finally:
        proxy.release_replies()
        proxy.close()


def test_rabbitmq_confirms_are_awaited_no_later_than_the_deadline_given(rabbit: dict[str, Any]) -> None:
    """The relay passes each publish its claim's deadline (monotonic). A wave waited its own
    confirm timeout from its start whatever that deadline, so a publish task that began just
    before it outlived its lease on a broker that never confirms, and lease recovery took the
    rows again with an attempt spent. Now the wave waits until the earlier of the two, and the
    rows are released as after the confirm timeout (BACKPRESSURE: no attempt spent); a
    deadline already gone sends nothing."""
    proxy = Proxy()
    try:
        with KombuPublisher(proxy.amqp_url, rabbit["exchange"], confirm_timeout=10.0) as publisher:
            assert publisher.publish_chain([make_message(811)]).ok  # connected, confirms flowing
            proxy.hold_replies()
            began = time.monotonic()
            [result] = publisher.publish_chains([[make_message(812), make_message(813)]], deadline=began + 1.0)
            waited = time.monotonic() - began
            assert result.published == () and result.failed_id == 812 and result.failure is not None
            assert result.failure.kind is FailureKind.BACKPRESSURE, result.failure
            assert 0.9 <= waited < 5.0, f"waited {waited:.1f} s for a deadline 1 s away (confirm timeout 10 s)"
            [late] = publisher.publish_chains([[make_message(814)]], deadline=time.monotonic() - 0.1)
            assert late.published == () and late.failed_id == 814 and late.failure is not None
            assert late.failure.kind is FailureKind.BACKPRESSURE and "deadline" in late.failure.reason
    finally:
        proxy.release_replies()
        proxy.close()
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [811, 812]


#: How long after its deadline a publish may return in these tests: scheduling and the
#: proxy's own pace, not a bound of the publisher.
DEADLINE_MARGIN_S = 1.0

#: ``channel.open`` on channel 1 (frame type 1, 5 bytes: class 20, method 10, an empty
#: short string): the publisher's first frame once the handshake is done.
CHANNEL_OPEN = b"\x01\x00\x01\x00\x00\x00\x05\x00\x14\x00\x0a\x00\xce"


def publish_by_a_deadline_then_after_the_stall(proxy: Proxy, exchange: str, first: int) -> float:
    """Publish event ``first`` on a new connection through ``proxy`` (stalled by the caller)
    with a deadline 1 s away: it fails as back-pressure; once the proxy lets the broker's
    answers through again event ``first + 1`` is published. Returns how long the first took."""
    with KombuPublisher(proxy.amqp_url, exchange, confirm_timeout=10.0) as publisher:
        began = time.monotonic()
        [result] = publisher.publish_chains([[make_message(first)]], deadline=began + 1.0)
        took = time.monotonic() - began
        assert result.published == () and result.failed_id == first and result.failure is not None, result
        assert result.failure.kind is FailureKind.BACKPRESSURE, result.failure
        proxy.release_replies()
        [after] = publisher.publish_chains([[make_message(first + 1)]], deadline=time.monotonic() + 5.0)
        assert after == ChainResult(published=(first + 1,))
    return took


def test_rabbitmq_a_new_connection_whose_handshake_gets_no_answer_ends_by_the_deadline(rabbit: dict[str, Any]) -> None:
    """Found in review: a publish with no live connection makes one, and that handshake was
    bounded by the connect timeout (3 s) with one retry, whatever the deadline: a broker
    that accepted the TCP connection and never answered (packets dropped) held the publish
    6 s past a deadline 1 s away, past its lease. Now every attempt waits the time left at
    most, and none begins once it is spent."""
    proxy = Proxy()
    try:
        proxy.hold_replies()
        took = publish_by_a_deadline_then_after_the_stall(proxy, rabbit["exchange"], 821)
        assert took < 1.0 + DEADLINE_MARGIN_S, f"the publish took {took:.1f} s for a deadline 1 s away"
    finally:
        proxy.release_replies()
        proxy.close()
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [822]


def test_rabbitmq_a_new_connection_whose_channel_is_never_opened_ends_by_the_deadline(rabbit: dict[str, Any]) -> None:
    """The handshake is answered, then the broker stops answering: opening the channel,
    confirm mode and the exchanges' declares were bounded by the confirm timeout (the
    socket's read timeout, 10 s here), not by the deadline. Now each waits the time left."""
    proxy = Proxy()
    try:
        proxy.hold_replies_after(CHANNEL_OPEN)
        took = publish_by_a_deadline_then_after_the_stall(proxy, rabbit["exchange"], 831)
        assert took < 1.0 + DEADLINE_MARGIN_S, f"the publish took {took:.1f} s for a deadline 1 s away"
    finally:
        proxy.release_replies()
        proxy.close()
    assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [832]


def test_rabbitmq_a_channel_the_broker_never_opens_is_given_up_on(rabbit: dict[str, Any]) -> None:
    """Found in review: py-amqp bounds its handshake (``connect_timeout``) and our confirm
    waits, but opening a channel, confirm mode and the declares after the handshake waited
    for ever on a broker that stopped answering there, holding the publisher's lock. The
    publisher's connections now carry ``read_timeout`` = the confirm timeout: a real
    connection through a proxy that holds every reply once the handshake is done."""
    proxy = Proxy()
    try:
        publisher = KombuPublisher(proxy.amqp_url, rabbit["exchange"], confirm_timeout=2.0)
        with Connection(proxy.amqp_url, connect_timeout=3,
                        transport_options=publisher._timeouts("py-amqp")) as conn:
            conn.connect()  # the handshake, answered
            proxy.hold_replies()
            began = time.monotonic()
            with pytest.raises(OSError):  # EAGAIN from the socket's receive timeout: back-pressure
                conn.channel()
            assert time.monotonic() - began < 10
    finally:
        proxy.release_replies()
        proxy.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_rabbitmq_connection_is_per_process(rabbit: dict[str, Any]) -> None:
    publisher = KombuPublisher(rabbit["url"], rabbit["exchange"])
    try:
        assert publisher.publish_chain([make_message(801)]).ok
        parent_conn = publisher._conn
        pid = os.fork()
        if pid == 0:  # child: must open its own connection and leave the parent's alone
            code = 1
            try:
                result = publisher.publish_chain([make_message(802)])
                code = 0 if result.ok and publisher._conn is not parent_conn else 2
                publisher.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert publisher._conn is parent_conn
        assert publisher.publish_chain([make_message(803)]).ok  # the parent's connection still works
    finally:
        publisher.close()
    assert sorted(m.headers["outbox_id"] for m in rabbit["drain"]()) == [801, 802, 803]


@contextmanager
def dead_letter_queue(rabbit: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The test's dead-letter exchange, declared with a queue bound to all of it: (its name,
    the queue); the exchange is deleted afterwards."""
    dlx = f"{rabbit['exchange']}-dead"
    channel = rabbit["channel"]
    exchange = Exchange(dlx, type="topic", durable=True)
    exchange(channel).declare()
    queue = Queue(f"{dlx}-q", exchange=exchange, routing_key="#", exclusive=True, auto_delete=True)(channel)
    queue.declare()
    try:
        yield dlx, queue
    finally:
        exchange(channel).delete()


def test_rabbitmq_dead_letter_exchange(rabbit: dict[str, Any]) -> None:
    with dead_letter_queue(rabbit) as (dlx, queue):
        message = make_message(901, attempts=9)
        with KombuPublisher(rabbit["url"], rabbit["exchange"], dead_letter_exchange=dlx) as publisher:
            assert publisher.publish_dead(message, "RuntimeError: " + "e" * 3000) is None
        dead = queue.get(no_ack=True)
        assert dead is not None and raw_body(dead) == message.payload.encode()
        assert dead.headers["outbox_id"] == 901 and dead.headers["attempt"] == 10
        assert dead.headers["x-outbox-error"].startswith("RuntimeError: ") and len(dead.headers["x-outbox-error"]) == 1000
        assert rabbit["drain"]() == []  # not on the main exchange


@contextmanager
def rabbitmq_user(configure: str) -> Iterator[str]:
    """A temporary RabbitMQ user (``rabbitmqctl``, so only on a local broker) with write and
    read permission on everything and configure permission on ``configure`` (a regex; ``^$``
    is none: the least-privilege user of a deployment whose exchanges ops declare); yields
    its URL and deletes the user afterwards."""
    user = f"outbox-test-{uuid.uuid4().hex[:8]}"

    def ctl(*args: str) -> None:
        try:
            subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"rabbitmqctl cannot be run here ({exc})")

    ctl("add_user", user, "pw")
    try:
        ctl("set_permissions", "-p", "/", user, configure, ".*", ".*")
        host, port = amqp_hostport()
        yield f"amqp://{user}:pw@{host}:{port}//"
    finally:
        subprocess.run(["rabbitmqctl", "-q", "delete_user", user], capture_output=True, timeout=60)


def test_rabbitmq_user_without_configure_permission_publishes_to_exchanges_ops_declared(
        rabbit: dict[str, Any]) -> None:
    """The usual least-privilege user (configure ``^$``) may not declare an exchange, not even
    one that exists: declaring both exchanges actively on every connection made each publish
    FATAL, while ``outbox check`` (a passive declare) said all was well (found in review)."""
    from outbox.commands.doctor import check_destination

    missing = f"{rabbit['exchange']}-missing"
    with dead_letter_queue(rabbit) as (dlx, queue), rabbitmq_user("^$") as url:
        with KombuPublisher(url, rabbit["exchange"], dead_letter_exchange=dlx) as publisher:
            assert publisher.publish_chain([make_message(1001), make_message(1002, "orders.paid")]) \
                    == ChainResult(published=(1001, 1002))
            assert publisher.publish_dead(make_message(1003), "boom") is None
        assert [m.headers["outbox_id"] for m in rabbit["drain"]()] == [1001, 1002]
        assert (got := queue.get(no_ack=True)) is not None and got.headers["outbox_id"] == 1003
        # An exchange it may not declare and nobody did: FATAL, as before.
        with KombuPublisher(url, missing) as publisher:
            result = publisher.publish_chain([make_message(1004)])
        assert result.failure is not None and result.failure.kind is FailureKind.FATAL
        assert "ACCESS_REFUSED" in result.failure.reason
        # outbox check agrees: no failure where the relay publishes, and says why it can.
        settings = load_settings({"OUTBOX_PUBLISH_URL": url, "OUTBOX_EXCHANGE": rabbit["exchange"],
                                  "OUTBOX_DEAD_LETTER_EXCHANGE": dlx})
        results = {r.name: r for r in check_destination(settings)}
        assert all(r.state != "FAIL" for r in results.values()), results
        assert "no configure permission" in results["queue bound to the exchange"].detail
        assert "no configure permission" in results["dead-letter exchange"].detail
        # ... and warns where the relay's first publish would be FATAL: a dead-letter
        # exchange it would have to declare.
        settings = load_settings({"OUTBOX_PUBLISH_URL": url, "OUTBOX_EXCHANGE": rabbit["exchange"],
                                  "OUTBOX_DEAD_LETTER_EXCHANGE": missing})
        results = {r.name: r for r in check_destination(settings)}
        assert results["dead-letter exchange"].state == "warn"
        assert "configure permission" in results["dead-letter exchange"].detail


# -- broker down ------------------------------------------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", ["amqp://guest:guest@127.0.0.1:1//", "amqp://guest:guest@127.0.0.1:{port}//",
                                 "redis://127.0.0.1:{port}/0"])
def test_unreachable_broker_is_backpressure(url: str) -> None:
    publisher = KombuPublisher(url.format(port=closed_port()), "outbox")
    try:
        result = publisher.publish_chain([make_message(1), make_message(2)])
        assert result.published == () and result.failed_id == 1
        assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE
        # and again on the next call (reconnect attempt, same answer)
        again = publisher.publish_chain([make_message(1)])
        assert again.failure is not None and again.failure.kind is FailureKind.BACKPRESSURE
    finally:
        publisher.close()


# -- memory:// and redis:// -------------------------------------------------------------------

def test_memory_transport() -> None:
    name = f"outbox-mem-{uuid.uuid4().hex[:8]}"
    with Connection("memory://") as conn:
        channel = conn.channel()
        exchange = Exchange(name, type="topic", durable=True)
        exchange(channel).declare()
        queue = Queue(f"{name}-q", exchange=exchange, routing_key="orders.#")(channel)
        queue.declare()
        chain = [make_message(1), make_message(2, "orders.paid"), make_message(3, "nobody.listens")]
        with KombuPublisher("memory://", name) as publisher:
            result = publisher.publish_chain(chain)
        # memory:// never leaves the process (the embedded default): an event no queue of
        # it takes is dropped, not unroutable (Redis: test_redis_unroutable_event_...)
        assert result == ChainResult(published=(1, 2, 3))
        got = []
        while (message := queue.get(no_ack=True)) is not None:
            got.append(message)
        assert [m.headers["outbox_id"] for m in got] == [1, 2]
        assert raw_body(got[0]) == chain[0].payload.encode()
        assert got[0].content_type == "application/json"
        assert got[0].properties["message_id"] == chain[0].message_id
        assert got[0].headers == build_headers(chain[0])
        queue.delete()


def test_redis_transport() -> None:
    parts = urlsplit(REDIS_PUBLISH_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    name = f"outbox-redis-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_PUBLISH_URL) as conn:
        channel = conn.channel()
        exchange = Exchange(name, type="topic", durable=True)
        exchange(channel).declare()
        queue = Queue(f"{name}-q", exchange=exchange, routing_key="orders.#")(channel)
        queue.declare()
        try:
            chain = [make_message(1), make_message(2, "orders.paid"), make_message(3, "orders.shipped")]
            with KombuPublisher(REDIS_PUBLISH_URL, name) as publisher:
                assert publisher.publish_chain(chain) == ChainResult(published=(1, 2, 3))
            got = []
            while (message := queue.get(no_ack=True)) is not None:
                got.append(message)
            assert [m.headers["outbox_id"] for m in got] == [1, 2, 3]
            assert [raw_body(m) for m in got] == [m.payload.encode() for m in chain]
            assert got[0].content_type == "application/json"
            assert got[0].properties["delivery_mode"] == 2
            assert got[2].headers == build_headers(chain[2])
        finally:
            queue.delete()
            client = channel.client
            client.delete(f"_kombu.binding.{name}")


def test_redis_unroutable_event_stops_the_chain_as_on_rabbitmq() -> None:
    """Redis (kombu's virtual exchanges) drops a message no binding routes without a word:
    before, such an event was counted published and marked done, and lost."""
    parts = urlsplit(REDIS_PUBLISH_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    name = f"outbox-redis-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_PUBLISH_URL) as conn:
        channel = conn.channel()
        try:
            chain = [make_message(1), make_message(2, "nobody.listens"), make_message(3)]
            with KombuPublisher(REDIS_PUBLISH_URL, name) as publisher:
                unbound = publisher.publish_chain(chain)  # no queue bound at all
                assert unbound.published == () and unbound.failed_id == 1
                exchange = Exchange(name, type="topic", durable=True)
                queue = Queue(f"{name}-q", exchange=exchange, routing_key="orders.#")(channel)
                queue.declare()
                result = publisher.publish_chain(chain)
                assert result.published == (1,) and result.failed_id == 2
                assert result.failure is not None and result.failure.kind is FailureKind.RETRIABLE
                assert result.failure.reason.startswith("unroutable: no queue bound for routing key 'nobody.listens'")
            with KombuPublisher(REDIS_PUBLISH_URL, name, unroutable="drop") as publisher:
                assert publisher.publish_chain(chain) == ChainResult(published=(1, 2, 3), unroutable=(2,))
            assert drained_ids(queue) == [1, 1, 3]
        finally:
            channel.client.delete(f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}", f"{name}-q")


def drained_ids(queue: Any) -> list[int]:
    """The ``outbox_id`` of every message left on ``queue``, taken off it in order."""
    ids = []
    while (message := queue.get(no_ack=True)) is not None:
        ids.append(message.headers["outbox_id"])
    return ids


def test_redis_pipelined_window_ends_at_an_unroutable_event() -> None:
    """Redis knows an event is unroutable before it sends it, yet the rest of its pipelined
    window went after it: a later event reached a queue, so the unroutable one was overtaken,
    dead at once instead of retried until its consumer binds (found in review). The window
    ends there now, as in a strict chain; under ``unroutable="drop"`` it goes on."""
    parts = urlsplit(REDIS_PUBLISH_URL)
    require("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    name = f"outbox-redis-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_PUBLISH_URL) as conn:
        channel = conn.channel()
        queue = Queue(f"{name}-q", exchange=Exchange(name, type="topic", durable=True), routing_key="orders.#")(channel)
        queue.declare()
        try:
            chain = [make_message(1), make_message(2, "billing.invoiced"), make_message(3, "orders.paid")]
            with KombuPublisher(REDIS_PUBLISH_URL, name) as publisher:
                [result] = publisher.publish_chains([chain], pipelined=lambda m: True)
            assert (result.published, result.failed_id, result.overtaken) == ((1,), 2, ())
            assert result.failure is not None and result.failure.kind is FailureKind.RETRIABLE
            assert result.failure.reason.startswith("unroutable: no queue bound for routing key 'billing.invoiced'")
            with KombuPublisher(REDIS_PUBLISH_URL, name, unroutable="drop") as publisher:
                assert publisher.publish_chains([chain], pipelined=lambda m: True) == [
                    ChainResult(published=(1, 2, 3), unroutable=(2,))]
            assert drained_ids(queue) == [1, 1, 3]
        finally:
            channel.client.delete(f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}", f"{name}-q")


def test_rabbitmq_dead_letter_copy_of_a_poison_row_is_a_stub(rabbit: dict[str, Any]) -> None:
    """A row that went dead because it cannot be published (too large, headers not
    encodable) still reaches the dead-letter exchange: reserved headers and the error,
    an empty body, and ``x-outbox-omitted`` saying what was left out and why."""
    dlx = f"{rabbit['exchange']}-dead"
    channel = rabbit["channel"]
    exchange = Exchange(dlx, type="topic", durable=True)
    exchange(channel).declare()
    queue = Queue(f"{dlx}-q", exchange=exchange, routing_key="#", exclusive=True, auto_delete=True)(channel)
    queue.declare()
    try:
        big = make_message(911, payload=json.dumps({"blob": "x" * 5000}), headers={"tenant": "acme"})
        bad_headers = make_message(912, headers={"huge": 2**70})
        with KombuPublisher(rabbit["url"], rabbit["exchange"], dead_letter_exchange=dlx,
                            max_message_bytes=4096) as publisher:
            assert not publisher.publish_chain([big]).ok
            assert publisher.publish_dead(big, "poison: too large") is None
            assert publisher.publish_dead(bad_headers, "poison: headers") is None
        first, second = queue.get(no_ack=True), queue.get(no_ack=True)
        assert first is not None and second is not None
        assert raw_body(first) == b"" and first.headers["outbox_id"] == 911
        assert first.headers["tenant"] == "acme"  # the caller's headers were fine: kept
        assert first.headers["x-outbox-error"] == "poison: too large"
        assert "above the maximum of 4096 bytes" in first.headers["x-outbox-omitted"]
        assert raw_body(second) == b"" and second.headers["outbox_id"] == 912 and "huge" not in second.headers
        assert second.headers["x-outbox-omitted"].startswith("headers cannot be encoded")
        assert rabbit["drain"]() == []
    finally:
        exchange(channel).delete()


def test_confirms_already_read_at_the_deadline_count() -> None:
    """A wave whose confirms reach the socket as its deadline passes: the wait gave up
    without reading them, so the wave counted as lost (connection dropped, events sent again
    though the broker had them; found in review). One read that waits for nothing comes
    first. The broker here is a stand-in for py-amqp's connection: it answers a read that
    waits for nothing with the confirm, and any longer one by waiting it out."""
    from outbox.publisher.kombu_publisher import KombuPublisher

    class Socket:
        def __init__(self, publisher: KombuPublisher) -> None:
            self.publisher = publisher

        def drain_events(self, timeout: float) -> None:
            if timeout == 0:
                self.publisher._unconfirmed.clear()  # the ack frame was already there
                return
            time.sleep(timeout)
            raise TimeoutError

    publisher = object.__new__(KombuPublisher)
    publisher.confirm_timeout = 5.0
    publisher._unconfirmed = {1, 2}
    publisher._conn = Socket(publisher)
    publisher._await_confirms(deadline=time.monotonic() + 0.05)
    assert not publisher._unconfirmed
