"""Publishing claimed outbox rows to the destination broker, in per-aggregate chains.

The relay hands ``Publisher.publish_chains`` the chains of one publish task: each chain is
the claimed rows of one aggregate, in id order. The publisher's one hard promise is the
ordering rule of the contract: **what reaches the broker is always a prefix of each chain**.
Event *k+1* of a chain is never sent while event *k* may not have been delivered, so
``ChainResult.published`` lists exactly the ids that are known to be on the broker, in order,
and the relay may mark those done and release the rest.

AMQP (py-amqp transport, ``amqp://`` / ``pyamqp://``): confirms in waves
-------------------------------------------------------------------------
The channel is in confirm mode and every event is published with ``mandatory=True``.
``KombuPublisher`` sends a *wave*: the next unsent event of every chain still going, back to
back, without waiting; then it reads the broker's verdicts until each of them is acked (or
nacked, or returned). RabbitMQ sends the ``basic.return`` of an unroutable mandatory message
*before* its ``basic.ack``, so once a wave is fully acked we know, per event, that it is safely
on the broker (persistent messages on durable queues are acked only once written) and whether
it was routed anywhere. Then the next wave goes out, without the chains that stopped.

Within a chain this is stop-and-wait: event *k+1* leaves only after event *k*'s ack. Across
chains the round trip is shared, because chains of different aggregates carry no order
between them. A task costs as many round trips as its longest chain has events, not as many
as it has events; a backlog spread over many aggregates is mostly waves of one event per chain.

Why not fewer round trips within a chain?

* One AMQP transaction per chain (``tx_select`` / publish all / ``tx_commit``): RabbitMQ
  routes a transaction's messages, and sends the returns of unroutable ones, only while it
  processes ``tx.commit`` (checked against RabbitMQ 3.10: a synchronous round trip such as a
  passive ``exchange.declare`` after the publishes brings back no return; the returns arrive
  between ``tx.commit`` and ``tx.commit-ok``). By then the routed messages *after* an
  unroutable one have been delivered and there is nothing left to roll back. So with
  ``unroutable="fail"`` a chain ``[a, b(unroutable), c]`` would put ``c`` on the broker while
  ``b`` is still to be retried: an ordering violation. And in a transaction a queue that
  refuses a message (``x-overflow: reject-publish``, a quorum queue without a quorum) drops it
  silently; in confirm mode it is a ``basic.nack``.
* Pipelined confirms within a chain (publish all, then wait for all acks) fail the same way:
  by the time event *k*'s return or nack arrives, *k+1* is already routed.

When the broker nacks an event, a queue bound for its routing key refused it (RabbitMQ's
``x-overflow: reject-publish`` on a full queue, a quorum queue without a quorum): that is
back-pressure from one *route*, not from the broker. The failure is BACKPRESSURE with
``PublishFailure.route`` = the routing key; every chain still going whose next event has a
refused routing key stops there with the same failure, and the other chains carry on in
the next waves. (The relay pauses that route alone: ``outbox.relay.RouteGate``.)

Unroutable events (no queue bound for the routing key)
------------------------------------------------------
``unroutable="fail"`` (default): the chain stops *at* the unroutable event with kind
RETRIABLE and reason ``"unroutable: no queue bound for routing key 'X' on exchange 'E'"``.
The broker dropped it (it is delivered nowhere) and nothing after it was sent. The relay
retries it with back-off, so a consumer that binds its queue late still gets every event in
order, and if nobody ever binds, the event dead-letters after OUTBOX_MAX_ATTEMPTS and the
rest of its aggregate moves on.

``unroutable="drop"``: for fire-and-forget topologies where "nobody listens to this topic"
is normal. The unroutable event counts as published (its id is in ``published`` and also in
``ChainResult.unroutable`` so it can be logged/counted) and the chain carries on. This is the
broker's own semantics without ``mandatory``.

Other transports (``memory://``, ``redis://``, ...): sequential, weaker guarantee
----------------------------------------------------------------------------------
Kombu's virtual transports have neither confirms nor returns. Waves are sent one event at a
time and a chain stops at the first exception, so the prefix rule still holds as far as the client
can see; but a "successful" publish only means the transport accepted the call (for Redis: the
``LPUSH`` was acknowledged by Redis, durable only as far as Redis persistence is configured;
for ``memory://``: the message sits in this process and dies with it), and an event whose
routing key matches no binding is dropped silently whatever ``unroutable`` says.

Failure kinds (see ``classify``)
--------------------------------
RETRIABLE    try again later, spending an attempt (eventually dead after max attempts).
BACKPRESSURE the broker is unreachable, blocked or pushing back: release the rows without
             spending an attempt and try later. With ``route`` set (a ``basic.nack``) only
             that routing key is pushing back.
POISON       this event can never be published (too large, not encodable): dead-letter it.
FATAL        configuration is wrong (credentials, permissions, vhost, exchange declared with
             another type): no event can be published until an operator fixes it.

Connections
-----------
One lazy kombu connection per publisher *per process*: the process id is checked on every
call, and a connection inherited across ``fork()`` is dropped without being closed (closing
it would shut down the parent's socket). Connecting uses a short, bounded retry so a broker
that is down is reported as BACKPRESSURE within seconds instead of hanging a worker. After any
error the connection is discarded and the next call reconnects; a connection that was idle
since an earlier call and turns out to be dead is replaced once, transparently, and the
wave that failed is sent again (which may then reach the broker twice: delivery is
at-least-once, and the prefix rule is unaffected).

Headers
-------
Every message carries the caller's headers (``OutboxMessage.headers``) plus the reserved
headers ``message_id``, ``outbox_id``, ``topic``, ``aggregate_type``, ``aggregate_id``,
``partition_key`` (the aggregate id when none was given), ``attempt``, ``created_at`` (ISO-8601,
UTC) and, when a trace context was captured at enqueue, ``traceparent``. Reserved headers win:
a caller header with a reserved name is overwritten, because consumers rely on those values
for de-duplication and ordering. (A caller's own ``traceparent`` survives when none was
captured.)
"""

from __future__ import annotations

import enum
import json
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

from .errors import ConfigError
from .model import OutboxMessage
from .redact import redact

if TYPE_CHECKING:
    from .config import Settings

log = logging.getLogger(__name__)

#: The default refusal threshold for one message body. RabbitMQ 4.x refuses bodies above
#: 16 MiB by default (``max_message_size``; it was 128 MiB in 3.8-3.13), so this is the
#: largest size every supported broker accepts out of the box.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: The header table travels in one AMQP content-header frame, which must fit in the
#: negotiated ``frame_max`` (128 KiB by default on RabbitMQ and py-amqp). Past this the
#: broker closes the whole connection with FRAME_ERROR, so we refuse earlier, per event.
MAX_HEADER_BYTES = 64 * 1024

#: AMQP short strings (routing key, ``message_id``, header names) hold at most this many bytes.
MAX_SHORTSTR_BYTES = 255

#: ``x-outbox-error`` is cut to this many characters on dead-lettered messages.
MAX_ERROR_HEADER_CHARS = 1000

RESERVED_HEADERS = frozenset({
    "message_id", "outbox_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
    "attempt", "created_at",
})

UNROUTABLE_POLICIES = ("fail", "drop")


class FailureKind(enum.StrEnum):
    """What the relay should do about an event that was not published. A ``StrEnum``: it
    prints as its value (``poison``), which is what ``last_error`` and the metrics record."""

    RETRIABLE = "retriable"
    BACKPRESSURE = "backpressure"
    POISON = "poison"
    FATAL = "fatal"


@dataclass(frozen=True)
class PublishFailure:
    kind: FailureKind
    reason: str
    #: The exception behind the failure, if any (for logs; not part of equality).
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    #: BACKPRESSURE from one routing key only (a queue bound for it refused the message,
    #: ``basic.nack``); None when the broker as a whole is down or pushing back.
    route: str | None = None


@dataclass(frozen=True)
class ChainResult:
    """The outcome of one ``publish_chain`` call.

    ``published`` is always a prefix of the chain's ids, in order. When the chain stopped
    early, ``failed_id`` is the id of the first event that was not published (the one right
    after that prefix) and ``failure`` says why; everything after it was not sent either.
    """

    published: tuple[int, ...] = ()
    failed_id: int | None = None
    failure: PublishFailure | None = None
    #: Ids in ``published`` that the broker reported unroutable (``unroutable="drop"``).
    unroutable: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None


class PublisherLike(Protocol):
    """What the relay needs of a publisher (``Publisher`` and any stand-in with these
    methods): the relay calls ``publish_chains`` when the object has it."""

    def publish_chain(self, messages: Sequence[OutboxMessage]) -> "ChainResult": ...

    def publish_dead(self, message: OutboxMessage, error: str) -> "PublishFailure | None": ...


class Publisher(ABC):
    """Sends chains of outbox messages to the destination broker.

    Implementations never raise for a publishing problem: they report it in the result so
    the relay always learns exactly which prefix reached the broker.
    """

    @abstractmethod
    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        """Publish ``messages`` (one aggregate, id order) so that a prefix reaches the broker."""

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]]) -> list[ChainResult]:
        """Publish several chains (of different aggregates), one result per chain, in order.

        The prefix promise holds per chain; chains are independent of each other, so an
        implementation may interleave them to share broker round trips. This default
        publishes them one after the other."""
        return [self.publish_chain(chain) for chain in chains]

    def publish_dead(self, message: OutboxMessage, error: str) -> PublishFailure | None:
        """Send a copy of a dead row to the dead-letter exchange, if the publisher has one.

        Returns ``None`` on success and when dead-letter publishing is not configured. It is
        best effort: the dead row in the table stays the record of truth.
        """
        return None

    @abstractmethod
    def close(self) -> None:
        """Release the broker connection. The publisher reconnects if used again."""

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# -- message building (pure) ---------------------------------------------------------------

def iso_utc(moment: datetime) -> str:
    """ISO-8601 in UTC with a ``Z``; naive datetimes are taken to be UTC already (the store's
    convention)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_headers(message: OutboxMessage) -> dict[str, Any]:
    """The headers of the published message: the caller's, then the reserved ones on top."""
    headers: dict[str, Any] = dict(message.headers or {})
    headers.update({
        "message_id": message.message_id,
        "outbox_id": message.id,
        "topic": message.topic,
        "aggregate_type": message.aggregate_type,
        "aggregate_id": message.aggregate_id,
        "partition_key": message.partition_key if message.partition_key is not None else message.aggregate_id,
        "attempt": message.attempt,
        "created_at": iso_utc(message.created_at),
    })
    if message.trace_id:
        headers["traceparent"] = message.trace_id
    return headers


def encode_body(message: OutboxMessage) -> bytes:
    """The payload is stored as JSON text already; it is sent as those UTF-8 bytes, as is."""
    return message.payload.encode("utf-8")


def poison_check(message: OutboxMessage, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> PublishFailure | None:
    """Return a POISON failure for an event no broker will ever take, else ``None``.

    Checked before each publish so that a hopeless event costs no broker round trip and,
    above all, does not make the broker close the connection (an oversized message is a
    channel error on RabbitMQ, an oversized header a connection error).
    """
    return checked_headers(message, max_bytes)[1]


def checked_headers(message: OutboxMessage,
                    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], PublishFailure | None]:
    """``(build_headers(message), poison_check(message))`` with the headers built once: the
    publisher's hot path needs both."""
    try:
        size = len(encode_body(message))
    except UnicodeError as exc:
        return {}, PublishFailure(FailureKind.POISON, f"payload is not encodable as UTF-8: {exc}", exc)
    if size > max_bytes:
        return {}, PublishFailure(FailureKind.POISON,
                                  f"message size {size} bytes is above the maximum of {max_bytes} bytes")
    headers: dict[str, Any] = {}
    try:
        headers = build_headers(message)
        shortstr = _shortstr_problem(message, headers)
        if shortstr is not None:
            return headers, PublishFailure(FailureKind.POISON, shortstr)
        json_size = len(json.dumps(headers, allow_nan=False))  # virtual transports (redis, memory) send JSON
        # What AMQP sends is a field table. Headers are flat (names to strings, numbers, booleans
        # or None); per entry the table takes at most twice the JSON's bytes (``"k":1,`` is 6
        # bytes of JSON, 11 in the table), and its integers are 64-bit. So only headers that
        # could be too big, or hold a bigger integer, need encoding here to be sure.
        if 2 * json_size + 64 > MAX_HEADER_BYTES or any(
                type(v) is int and not -2**63 <= v < 2**63 for v in headers.values()):
            from amqp.serialization import dumps as amqp_dumps
            header_size = len(amqp_dumps("F", [headers]))
            if header_size > MAX_HEADER_BYTES:
                return headers, PublishFailure(
                    FailureKind.POISON,
                    f"headers are {header_size} bytes encoded, above the maximum of {MAX_HEADER_BYTES}")
    except Exception as exc:  # noqa: BLE001 - whatever the encoder objects to, it will every time
        return headers, PublishFailure(FailureKind.POISON,
                                       f"headers cannot be encoded: {type(exc).__name__}: {exc}", exc)
    return headers, None


def _shortstr_problem(message: OutboxMessage, headers: dict[str, Any]) -> str | None:
    """AMQP short strings carry at most 255 bytes: the routing key (the topic), the
    ``message_id`` property and every header name. A longer one makes py-amqp's encoder
    raise ``struct.error`` for this event, every time. (A string of at most 63 characters
    is at most 252 bytes, so only longer ones are encoded to count.)"""
    for what, text in (("routing key (topic)", message.topic), ("message_id", message.message_id),
                       *(("header name", name) for name in headers)):
        if isinstance(text, str) and len(text) > 63 and len(text.encode("utf-8")) > MAX_SHORTSTR_BYTES:
            return (f"{what} {text[:40]!r}... is {len(text.encode('utf-8'))} bytes in UTF-8, above AMQP's "
                    f"{MAX_SHORTSTR_BYTES}")
    return None


def _encoding_problem(message: OutboxMessage, headers: dict[str, Any], exchange: str) -> str | None:
    """Encode the publish of ``message`` as py-amqp would, without sending anything: why
    it cannot be encoded, or None. Used after a send raised, to tell an event that can
    never be encoded (POISON, that event only) from a broken connection (the whole wave)."""
    try:
        from amqp import Message as AmqpMessage
        from amqp.serialization import dumps as amqp_dumps

        amqp_dumps("Bssbb", (0, exchange, message.topic, True, False))
        AmqpMessage(encode_body(message), content_type="application/json", content_encoding="utf-8",
                    application_headers=headers, delivery_mode=2, priority=0,
                    message_id=message.message_id)._serialize_properties()
    except Exception as exc:  # noqa: BLE001 - whatever the encoder objects to, it will every time
        return f"cannot be encoded: {type(exc).__name__}: {exc}"
    return None


# -- error classification (pure) -------------------------------------------------------------

def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from (kombu wraps transport errors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _specific(exc: BaseException) -> FailureKind | None:
    """Errors whose class (and text) say exactly what happened."""
    from amqp import exceptions as amqp_exc

    text = str(exc).lower()
    if isinstance(exc, ConfigError):  # the URL names no transport kombu has: nothing can be published
        return FailureKind.FATAL
    if isinstance(exc, amqp_exc.PreconditionFailed):
        # RabbitMQ refuses an oversized body with 406 "message size N is larger than configured
        # max size M"; every other 406 is a declaration that does not match the broker's.
        return FailureKind.POISON if "message size" in text or "max size" in text else FailureKind.FATAL
    if isinstance(exc, (amqp_exc.ContentTooLarge, amqp_exc.FrameError, amqp_exc.FrameSyntaxError)):
        return FailureKind.POISON
    if isinstance(exc, (amqp_exc.AccessRefused, amqp_exc.NotAllowed, amqp_exc.InvalidPath,
                        amqp_exc.AMQPNotImplementedError)):
        return FailureKind.FATAL
    if isinstance(exc, (amqp_exc.ResourceLocked, amqp_exc.ResourceError, amqp_exc.MessageNacked,
                        amqp_exc.RecoverableConnectionError)):
        # includes Blocked (connection.blocked) and ConnectionForced (broker shutting down)
        return FailureKind.BACKPRESSURE
    if isinstance(exc, amqp_exc.AMQPError):
        return FailureKind.RETRIABLE  # NotFound (exchange deleted: redeclared on reconnect), 541, ...
    if isinstance(exc, UnicodeError):
        return FailureKind.POISON
    try:
        from kombu.exceptions import SerializationError
    except ImportError:  # pragma: no cover
        SerializationError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, SerializationError):
        return FailureKind.POISON
    return _redis_kind(exc, text)


def _redis_kind(exc: BaseException, text: str) -> FailureKind | None:
    try:
        from redis import exceptions as redis_exc
    except ImportError:
        return None
    if isinstance(exc, (redis_exc.AuthenticationError, redis_exc.AuthorizationError)):
        return FailureKind.FATAL
    if isinstance(exc, redis_exc.DataError):
        return FailureKind.POISON
    if isinstance(exc, (redis_exc.ConnectionError, redis_exc.TimeoutError)):  # BusyLoadingError too
        return FailureKind.BACKPRESSURE
    if isinstance(exc, redis_exc.ResponseError):
        if text.startswith(("noauth", "wrongpass", "noperm")):
            return FailureKind.FATAL
        if text.startswith(("oom", "busy", "loading", "tryagain", "masterdown", "readonly")):
            return FailureKind.BACKPRESSURE
        return FailureKind.RETRIABLE
    return None


def _generic(exc: BaseException) -> FailureKind | None:
    """Errors that only say "the broker could not be talked to"."""
    from kombu.exceptions import OperationalError

    if isinstance(exc, (OSError, OperationalError)):  # refused, reset, broken pipe, timeouts, DNS
        return FailureKind.BACKPRESSURE
    return None


def classify(exc: BaseException) -> FailureKind:
    """Map an exception raised while connecting or publishing to a ``FailureKind``.

    The exception and its causes are examined together: a specific cause (say, an
    ``AccessRefused`` wrapped in kombu's ``OperationalError``) decides over a generic
    connection error; anything unknown is RETRIABLE, so it is retried and, if it never goes
    away, dead-lettered after the maximum number of attempts.
    """
    chain = list(_causes(exc))
    for rule in (_specific, _generic):
        for cause in chain:
            kind = rule(cause)
            if kind is not None:
                return kind
    return FailureKind.RETRIABLE


def _connection_lost(exc: BaseException) -> bool:
    """The socket died under us (reset, broken pipe, closed by the peer). Not a timeout: that
    already cost the full confirm timeout and may mean the broker hangs. Not a nack either."""
    from amqp import exceptions as amqp_exc

    causes = list(_causes(exc))
    if any(isinstance(cause, TimeoutError) for cause in causes):  # socket.timeout is TimeoutError
        return False
    return any(isinstance(cause, (ConnectionError, amqp_exc.RecoverableConnectionError))
               or type(cause) is OSError for cause in causes)


def failure_from(exc: BaseException) -> PublishFailure:
    reason = redact(f"{type(exc).__name__}: {exc}")
    if len(reason) > MAX_ERROR_HEADER_CHARS:
        reason = reason[: MAX_ERROR_HEADER_CHARS - 3] + "..."
    return PublishFailure(classify(exc), reason, exc)


# -- the kombu publisher -----------------------------------------------------------------------

#: A wave verdict: the broker returned the message (no queue bound for its routing key).
_RETURNED = "returned"


def refused_by_route(routing_key: str, exchange: str) -> PublishFailure:
    """The failure for a ``basic.nack``: a queue bound for ``routing_key`` refused the
    message (full with ``x-overflow: reject-publish``, or unavailable). Back-pressure of
    that route only."""
    return PublishFailure(FailureKind.BACKPRESSURE,
                          f"the broker refused the message (basic.nack): a queue bound for routing key "
                          f"{routing_key!r} on exchange {exchange!r} is full or unavailable", route=routing_key)


class _ChainProgress:
    """How far one chain of a ``publish_chains`` call has got."""

    def __init__(self, chain: list[OutboxMessage]) -> None:
        self.chain = chain
        self.position = 0
        self.published: list[int] = []
        self.unroutable: list[int] = []
        self.failure: PublishFailure | None = None

    @property
    def next(self) -> OutboxMessage:
        return self.chain[self.position]

    @property
    def going(self) -> bool:
        return self.failure is None and self.position < len(self.chain)

    def advance(self, unroutable: bool = False) -> None:
        self.published.append(self.next.id)
        if unroutable:
            self.unroutable.append(self.next.id)
        self.position += 1

    def stop(self, failure: PublishFailure) -> None:
        self.failure = failure

    def result(self) -> ChainResult:
        failed_id = self.next.id if self.failure is not None else None
        return ChainResult(tuple(self.published), failed_id, self.failure, tuple(self.unroutable))


class KombuPublisher(Publisher):
    """``Publisher`` over any kombu transport; the strong guarantees need py-amqp (see the
    module docstring).

    Thread-safe (calls are serialized by a lock), fork-safe (one connection per process).
    """

    def __init__(self, url: str, exchange: str, *, dead_letter_exchange: str | None = None,
                 unroutable: str = "fail", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float = 3.0, connect_retries: int = 1,
                 confirm_timeout: float = 15.0) -> None:
        if unroutable not in UNROUTABLE_POLICIES:
            raise ValueError(f"unroutable={unroutable!r}: expected one of {', '.join(UNROUTABLE_POLICIES)}")
        if not exchange:
            raise ValueError("exchange must not be empty")
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be > 0")
        self.url = url
        self.exchange = exchange
        self.dead_letter_exchange = dead_letter_exchange or None
        self.unroutable = unroutable
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.connect_retries = connect_retries
        self.confirm_timeout = confirm_timeout
        self._lock = threading.RLock()
        self._pid: int | None = None
        self._conn: Any = None  # kombu.Connection
        self._channel: Any = None
        self._producer: Any = None  # kombu.Producer
        self._confirms = False  # py-amqp: confirm mode + mandatory + returns
        self._next_tag = 0  # the delivery tag of the last message sent on the channel
        self._unconfirmed: set[int] = set()  # delivery tags the broker has not acked or nacked yet
        self._nacked: set[int] = set()
        self._returned: set[str] = set()  # message ids the broker returned as unroutable

    @classmethod
    def from_settings(cls, settings: "Settings", **options: Any) -> "KombuPublisher":
        """Build from ``Settings``; options not (yet) in the settings may be passed in."""
        options.setdefault("dead_letter_exchange", getattr(settings, "dead_letter_exchange", None))
        options.setdefault("unroutable", getattr(settings, "publish_unroutable", None) or "fail")
        return cls(settings.publish_url, settings.exchange, **options)

    def __repr__(self) -> str:
        from kombu.utils.url import maybe_sanitize_url
        return f"<KombuPublisher {maybe_sanitize_url(self.url)} exchange={self.exchange!r}>"

    # -- public API ----------------------------------------------------------------
    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        return self.publish_chains([messages])[0]

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]]) -> list[ChainResult]:
        with self._lock:
            return self._publish_waves([list(chain) for chain in chains])

    def publish_dead(self, message: OutboxMessage, error: str) -> PublishFailure | None:
        """Publish a dead row to ``dead_letter_exchange`` (durable topic, routing key = topic)
        with the reason in ``x-outbox-error``. Not mandatory: an unbound dead-letter exchange
        just drops it; the dead row stays in the table for ``outbox dead list/requeue``.

        A row that cannot be published itself (a POISON row: too large, headers not
        encodable) is sent as a stub with an empty body (and without the caller's headers
        when those are what cannot be encoded), and ``x-outbox-omitted`` saying why; the
        full row stays in the table."""
        if self.dead_letter_exchange is None:
            return None
        poisoned = poison_check(message, self.max_message_bytes)
        omitted = None
        if poisoned is not None:
            omitted = poisoned.reason
            for stub in (replace(message, payload=""), replace(message, payload="", headers={})):
                poisoned = poison_check(stub, self.max_message_bytes)
                if poisoned is None:
                    message = stub
                    break
            else:  # even the reserved headers cannot go
                return poisoned
        headers = build_headers(message)
        headers["x-outbox-error"] = (error or "")[:MAX_ERROR_HEADER_CHARS]
        if omitted is not None:
            headers["x-outbox-omitted"] = omitted[:MAX_ERROR_HEADER_CHARS]
        with self._lock:
            try:
                self._ready()
                self._send(message, headers, self.dead_letter_exchange, mandatory=False)
                self._await_confirms()
            except Exception as exc:  # noqa: BLE001 - reported, never raised
                self._discard()
                return failure_from(exc)
            nacked = bool(self._nacked)
            self._nacked.clear()
        return PublishFailure(FailureKind.BACKPRESSURE, "the broker refused the message (basic.nack)") if nacked else None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                try:
                    self._conn.release()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    log.debug("error closing the publisher connection", exc_info=True)
            self._forget()

    # -- chains, in waves ----------------------------------------------------------------
    def _publish_waves(self, chains: list[list[OutboxMessage]]) -> list[ChainResult]:
        """Publish several chains (different aggregates) in waves: the next unsent event of
        every chain still going, back to back, then wait until the broker has confirmed (or
        returned, or nacked) every one of them; repeat. Within a chain this is stop-and-wait,
        so what reaches the broker is a prefix of each chain; across chains the round trips
        are shared, so a task costs as many round trips as its longest chain has events."""
        waves = [_ChainProgress(chain) for chain in chains]
        going = [w for w in waves if w.chain]
        reused = self._usable()  # a connection from an earlier call, maybe dead since
        refused: dict[str, PublishFailure] = {}  # routing key -> its nack
        while going:
            wave: list[_ChainProgress] = []
            headers: list[dict[str, Any]] = []
            for w in going:
                event_headers, poisoned = checked_headers(w.next, self.max_message_bytes)
                if poisoned is not None:
                    w.stop(poisoned)
                else:
                    wave.append(w)
                    headers.append(event_headers)
            if not wave:
                break
            try:
                self._ready()
                outcomes = self._send_wave([w.next for w in wave], headers)
            except Exception as exc:  # noqa: BLE001 - nothing of this wave is known to be on the broker
                self._discard()
                failure = failure_from(exc)
                if reused and _connection_lost(exc):
                    # Most likely a connection that died while idle: replace it once and send
                    # the wave again (its events may arrive twice: at-least-once, still a prefix).
                    reused = False
                    log.info("publisher connection was lost (%s); reconnecting once", failure.reason)
                    continue
                for w in wave:
                    w.stop(failure)
                break
            reused = False  # the connection just worked: a later error is not staleness
            broker_wide: PublishFailure | None = None
            for w, problem in zip(wave, outcomes):
                if problem is None:
                    w.advance()
                elif problem == _RETURNED and self.unroutable == "drop":
                    log.warning("outbox event %s (%s) was unroutable and is dropped (unroutable='drop')",
                                w.next.id, w.next.topic)
                    w.advance(unroutable=True)
                elif problem == _RETURNED:
                    w.stop(PublishFailure(
                        FailureKind.RETRIABLE,
                        f"unroutable: no queue bound for routing key {w.next.topic!r} on exchange {self.exchange!r}"))
                else:
                    w.stop(problem)
                    if problem.kind is FailureKind.POISON:
                        pass  # a poison verdict stops its own chain only
                    elif problem.route is not None:
                        refused[problem.route] = problem
                    else:
                        broker_wide = problem
            going = [w for w in wave if w.going]
            if broker_wide is not None:
                # The connection failed mid-wave (transports without confirms): send nothing more;
                # every chain still going stops at its next event for the same reason.
                for w in going:
                    w.stop(broker_wide)
                going = []
            if refused:
                # A queue of these routes refuses messages: chains whose next event goes the
                # same way stop there (the relay releases them, no attempt spent); chains of
                # other routes carry on.
                for w in going:
                    if w.next.topic in refused:
                        w.stop(refused[w.next.topic])
                going = [w for w in going if w.going]
        return [w.result() for w in waves]

    def _send_wave(self, messages: list[OutboxMessage], headers: list[dict[str, Any]]) -> list[Any]:
        """Send ``messages`` and wait for the broker's verdict on each: ``None`` (confirmed),
        ``_RETURNED`` (unroutable) or a ``PublishFailure`` (nacked). Raises when the
        connection fails: then nothing of the wave is known to have arrived.

        Without confirms (virtual transports) each send is its own verdict, so an exception
        stops the wave there and the events sent before it count as published."""
        if not self._confirms:
            verdicts: list[Any] = []
            for message, event_headers in zip(messages, headers):
                try:
                    self._send(message, event_headers, self.exchange, mandatory=False)
                except Exception as exc:  # noqa: BLE001
                    poisoned = self._poisoned(message, event_headers)
                    if poisoned is not None:
                        verdicts.append(poisoned)
                        continue
                    if not verdicts:
                        raise
                    self._discard()
                    failure = failure_from(exc)
                    verdicts.extend([failure] * (len(messages) - len(verdicts)))
                    return verdicts
                verdicts.append(None)
            return verdicts
        tags: list[Any] = []
        for m, h in zip(messages, headers):
            try:
                tags.append(self._send(m, h, self.exchange, mandatory=True))
            except Exception:  # noqa: BLE001
                poisoned = self._poisoned(m, h)
                if poisoned is None:
                    raise
                tags.append(poisoned)  # nothing of it left: py-amqp encodes a frame before writing it
        self._await_confirms()
        verdicts = []
        for message, tag in zip(messages, tags):
            if isinstance(tag, PublishFailure):
                verdicts.append(tag)
            elif tag in self._nacked:
                verdicts.append(refused_by_route(message.topic, self.exchange))
            elif message.message_id in self._returned:
                verdicts.append(_RETURNED)
            else:
                verdicts.append(None)
        self._nacked.clear()
        self._returned.clear()
        return verdicts

    def _poisoned(self, message: OutboxMessage, headers: dict[str, Any]) -> PublishFailure | None:
        """After a send raised: POISON for this event alone if it cannot be encoded at all."""
        problem = _encoding_problem(message, headers, self.exchange)
        if problem is None:
            return None
        log.error("outbox event %s %s", message.id, problem)
        return PublishFailure(FailureKind.POISON, problem)

    # -- connection management -------------------------------------------------------
    def _usable(self) -> bool:
        return self._conn is not None and self._pid == os.getpid() and self._producer is not None

    def _ready(self) -> None:
        """Connect (bounded retry), open the channel and declare the exchanges, once per
        connection. Raises whatever went wrong."""
        from kombu import Connection, Exchange, Producer

        if self._pid != os.getpid():
            self._forget()  # inherited over fork(): the parent's, not ours; never close it
        if self._conn is None:
            try:
                conn = Connection(self.url, connect_timeout=self.connect_timeout)
                driver = getattr(conn.transport, "driver_name", "")  # resolves the transport class
            except (KeyError, ImportError, ValueError) as exc:
                # kombu raises KeyError for an unknown scheme ("amqpx://"), ImportError when the
                # transport's library is missing: configuration errors, not a broker failure.
                raise ConfigError(redact(f"OUTBOX_PUBLISH_URL={self.url!r} cannot be used: "
                                         f"{type(exc).__name__}: {exc}")) from exc
            self._confirms = driver == "py-amqp"
            self._conn, self._pid = conn, os.getpid()
        if self._producer is not None and self._conn.connected:
            return
        self._channel = self._producer = None
        self._conn.ensure_connection(max_retries=self.connect_retries, interval_start=0.2,
                                     interval_step=0.3, interval_max=1.0)
        channel = self._conn.channel()
        self._next_tag = 0
        self._unconfirmed.clear()
        self._nacked.clear()
        self._returned.clear()
        if self._confirms:
            # Confirm mode: the broker acks (or nacks) every message, numbering them from 1
            # on this channel; we send without waiting and collect the verdicts in
            # _await_confirms. A mandatory message that no queue takes comes back as a
            # basic.return, always before its ack.
            channel.confirm_select()
            channel.events["basic_ack"].add(self._on_ack)
            channel.events["basic_nack"].add(self._on_nack)
            channel.events["basic_return"].add(self._on_return)
        exchanges = [Exchange(name, type="topic", durable=True)
                     for name in (self.exchange, self.dead_letter_exchange) if name]
        for exchange in exchanges:
            exchange(channel).declare()
        self._channel = channel
        self._producer = Producer(channel, exchange=exchanges[0], auto_declare=False)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        message_id = getattr(message, "properties", {}).get("message_id")
        if message_id:
            self._returned.add(message_id)

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        tags = [t for t in self._unconfirmed if t <= tag] if multiple else [tag]
        self._unconfirmed.difference_update(tags)
        return tags

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._nacked.update(self._settle(tag, multiple))

    def _await_confirms(self) -> None:
        """Read from the broker until every message sent is acked or nacked; raise
        ``TimeoutError`` if that takes longer than ``confirm_timeout``."""
        deadline = time.monotonic() + self.confirm_timeout
        while self._unconfirmed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no publisher confirm within {self.confirm_timeout:g} s "
                                   f"for {len(self._unconfirmed)} messages")
            self._conn.drain_events(timeout=remaining)

    def _send(self, message: OutboxMessage, headers: dict[str, Any], exchange: str, *, mandatory: bool) -> int:
        """Send one message without waiting; returns its delivery tag (0 without confirms)."""
        self._producer.publish(
            encode_body(message),
            exchange=exchange,
            routing_key=message.topic,
            delivery_mode=2,  # persistent
            mandatory=mandatory and self._confirms,
            content_type="application/json",
            content_encoding="utf-8",
            headers=headers,
            message_id=message.message_id,
            timeout=self.confirm_timeout,
            retry=False,
        )
        if not self._confirms:
            return 0
        self._next_tag += 1
        self._unconfirmed.add(self._next_tag)
        return self._next_tag

    def _discard(self) -> None:
        """Drop the connection after an error, without the protocol's closing handshake
        (the peer may be gone); the next call reconnects."""
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.collect()
            except Exception:  # noqa: BLE001
                log.debug("error discarding the publisher connection", exc_info=True)
        self._forget()

    def _forget(self) -> None:
        self._conn = self._channel = self._producer = None
        self._pid = None
        self._unconfirmed.clear()
        self._nacked.clear()
        self._returned.clear()


__all__ = [
    "Publisher", "PublisherLike", "KombuPublisher", "ChainResult", "PublishFailure", "FailureKind",
    "classify", "failure_from", "poison_check", "checked_headers", "build_headers", "encode_body", "iso_utc",
    "RESERVED_HEADERS", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES",
]
