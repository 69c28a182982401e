"""Building a message (body, headers) and the checks that find a poison event before any
byte is sent (docs/publisher.md, "Headers")."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from ..core.model import OutboxMessage
from .contract import DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES, MAX_SHORTSTR_BYTES, FailureKind, PublishFailure

log = logging.getLogger("outbox.publisher")  # one logger for the whole publisher package

#: The routing key of a dead-letter copy whose row's topic cannot be a routing key (over
#: 255 bytes of UTF-8): docs/relay.md, "Dead-letter exchange".
UNROUTABLE_DEAD_KEY = "outbox.dead.unroutable"


# -- message building (pure) ---------------------------------------------------------------

def iso_utc(moment: datetime) -> str:
    """ISO-8601 in UTC to the millisecond with a ``Z`` (``isoformat(timespec="milliseconds")``'s
    text); naive datetimes are taken to be UTC already (the store's convention). Formatted from
    the fields: half the time of ``replace`` + ``isoformat``, and every published event's
    ``created_at`` header goes through here (docs/benchmarks.md, "Issue 24: Kafka")."""
    if moment.tzinfo is not None and moment.tzinfo is not UTC:
        moment = moment.astimezone(UTC)
    # %-formatting: half the time of the same f-string with format specifiers
    fields = (moment.year, moment.month, moment.day, moment.hour, moment.minute, moment.second,
              moment.microsecond // 1000)
    return "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ" % fields  # noqa: UP031


def reserved_headers(message: OutboxMessage) -> dict[str, Any]:
    """The headers the relay sets on every published message (they win over the caller's)."""
    headers = {
        "message_id": message.message_id,
        "outbox_id": message.id,
        "topic": message.topic,
        "aggregate_type": message.aggregate_type,
        "aggregate_id": message.aggregate_id,
        "partition_key": message.partition_key if message.partition_key is not None else message.aggregate_id,
        "attempt": message.attempt,
        "created_at": iso_utc(message.created_at),
    }
    if message.trace_id:
        headers["traceparent"] = message.trace_id
    return headers


def build_headers(message: OutboxMessage) -> dict[str, Any]:
    """The headers of the published message: the caller's, then the reserved ones on top."""
    headers: dict[str, Any] = dict(message.headers or {})
    headers.update(reserved_headers(message))
    return headers


def _shortstr_bytes(text: Any) -> int:
    """How many bytes ``text`` takes as an AMQP short string (0 for a non-string)."""
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def carriable_ids(message: OutboxMessage) -> tuple[OutboxMessage, str | None]:
    """For a dead-letter copy: ``message`` with a topic and a message id AMQP can carry (a
    routing key and the ``message_id`` property are short strings, at most 255 bytes), and
    what was replaced, or None. An over-long topic becomes ``UNROUTABLE_DEAD_KEY``, an
    over-long message id ``sha256:<hex digest of it>``; the publisher puts the originals in
    the ``topic`` and ``message_id`` headers (header values have no such limit)."""
    changes: dict[str, Any] = {}
    said: list[str] = []
    topic_bytes, id_bytes = _shortstr_bytes(message.topic), _shortstr_bytes(message.message_id)
    if topic_bytes > MAX_SHORTSTR_BYTES:
        changes["topic"] = UNROUTABLE_DEAD_KEY
        said.append(f"routing key {UNROUTABLE_DEAD_KEY!r}: the topic is {topic_bytes} bytes in UTF-8, above "
                    f"AMQP's {MAX_SHORTSTR_BYTES} (the topic header holds it)")
    if id_bytes > MAX_SHORTSTR_BYTES:
        digest = hashlib.sha256(message.message_id.encode("utf-8", "surrogatepass")).hexdigest()
        changes["message_id"] = f"sha256:{digest}"
        said.append(f"message_id property {changes['message_id']!r}: the message id is {id_bytes} bytes in UTF-8, "
                    f"above AMQP's {MAX_SHORTSTR_BYTES} (the message_id header holds it)")
    if not changes:
        return message, None
    return replace(message, **changes), "; ".join(said)


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
        if _plainly_fine(message, headers):
            return headers, None
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


def _plainly_fine(message: OutboxMessage, headers: dict[str, Any]) -> bool:
    """One pass that clears the common event without the checks below (their verdict would
    be "no problem"): topic, message_id and header names of at most 63 characters (at most
    252 bytes), header values that are str, bool, None, 64-bit int or finite float (JSON and
    AMQP encode them), and a table that even at 4 bytes a character fits MAX_HEADER_BYTES.
    Anything else is left to those checks, whose verdicts and reasons it never changes."""
    topic, message_id = message.topic, message.message_id
    if type(topic) is not str or type(message_id) is not str or len(topic) > 63 or len(message_id) > 63:
        return False
    bound = 4  # the table's length prefix
    for name, value in headers.items():
        if type(name) is not str or len(name) > 63:
            return False
        kind = type(value)
        if kind is str:
            bound += 4 * (len(name) + len(value)) + 6
        elif kind is int:
            if not -2**63 <= value < 2**63:
                return False
            bound += 4 * len(name) + 10
        elif kind is float:
            if value - value != 0.0:  # NaN or infinite: not JSON
                return False
            bound += 4 * len(name) + 10
        elif kind is bool or value is None:
            bound += 4 * len(name) + 3
        else:
            return False
    return bound <= MAX_HEADER_BYTES


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
