"""Claimed rows into messages, leniently: a row another writer broke (NULLs, text that is not
JSON, headers enqueue would refuse) still yields what could be decoded and the list of what
could not, so the store can fence it and dead-letter it (docs/relay.md, "Bad rows: one bad
event never hurts another"). Engines differ only in how a timestamp comes back
(``Engine.to_datetime``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from ...core.model import OutboxMessage
from ...domain.events import text_problem

#: How an engine reads a timestamp column (``Engine.to_datetime``).
ToDatetime = Callable[[Any], "datetime | None"]


class UndecodableRow(ValueError):
    """A claimed row that does not decode into an ``OutboxMessage`` (``Engine.to_message``)."""


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: Made once: ``json.loads`` with an option builds a decoder per call, a fifth of a row's decoding.
_JSON = json.JSONDecoder(parse_constant=_reject_constant)


def to_message(row: Sequence[Any], lease: str, to_datetime: ToDatetime) -> OutboxMessage:
    """The claimed row as a message; ``UndecodableRow`` says why it cannot be one."""
    message, problems = decode_row(row, lease, to_datetime)
    if problems:
        raise UndecodableRow("; ".join(problems))
    return message


def decode_row(row: Sequence[Any], lease: str, to_datetime: ToDatetime) -> tuple[OutboxMessage, list[str]]:
    """Decode a row shaped like MESSAGE_COLUMNS, leniently: returns the message and the
    problems found. Each problem is a field that is NULL where it may not be, not text,
    not valid JSON, not the JSON enqueue writes (a payload object or array, flat headers
    of scalars), or text with a NUL or a lone surrogate. A field with a problem gets a
    harmless stand-in (``""``, ``{}``), so a row with problems still yields what could
    be decoded: enough to fence it by id and lease, and to send its dead-letter copy.

    Limits (AMQP's 255-byte short strings, 64-bit integers) are the publisher's to
    check: a row that breaks them is well-formed but cannot be published (POISON)."""
    problems: list[str] = []

    def text(index: int, name: str, required: bool = True) -> Any:
        value = row[index]
        if value is None:
            if required:
                problems.append(f"{name} is NULL")
                return ""
            return None
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.append(f"{name} is not UTF-8: {exc}")
                return "" if required else None
        if not isinstance(value, str):
            problems.append(f"{name} is not text ({type(value).__name__})")
            return "" if required else None
        problem = text_problem(value)
        if problem:
            problems.append(f"{name} {problem}")
        elif required and not value.strip():
            problems.append(f"{name} is empty")
        return value

    message_id, topic = text(1, "message_id"), text(2, "topic")
    aggregate_type, aggregate_id = text(3, "aggregate_type"), text(4, "aggregate_id")
    partition_key, trace_id = text(5, "partition_key", required=False), text(8, "trace_id", required=False)
    payload = _decode_payload(row[6], problems)
    headers = _decode_headers(row[7], problems)
    try:
        attempts = int(row[9])
    except (TypeError, ValueError):
        problems.append(f"attempts is not an integer: {row[9]!r}")
        attempts = 0
    try:
        created_at = to_datetime(row[10])
        if created_at is None:
            problems.append("created_at is NULL")
    except (TypeError, ValueError) as exc:
        problems.append(f"created_at is not a timestamp: {exc}")
        created_at = None
    message = OutboxMessage(id=int(row[0]), message_id=message_id, topic=topic, aggregate_type=aggregate_type,
                            aggregate_id=aggregate_id, partition_key=partition_key, payload=payload,
                            headers=headers, trace_id=trace_id, attempts=attempts,
                            created_at=created_at or _EPOCH, lease=lease)
    return message, problems


def _decode_payload(value: Any, problems: list[str]) -> str:
    """The payload as JSON text: an object or array, as enqueue writes it."""
    if value is None:
        problems.append("payload is NULL")
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"payload is not UTF-8: {exc}")
            return ""
    if not isinstance(value, str):  # a driver that decoded JSON for us
        parsed = value
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    else:
        try:
            parsed = _JSON.decode(value)
        except (ValueError, RecursionError) as exc:
            problems.append(f"payload is not valid JSON: {exc}")
            return ""
    if not isinstance(parsed, (dict, list)):
        problems.append(f"payload is not a JSON object or array (a JSON {type(parsed).__name__})")
        return ""
    return value


def _decode_headers(value: Any, problems: list[str]) -> dict[str, Any]:
    """The caller's headers: a flat JSON object of names to scalars, as enqueue writes it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"headers are not UTF-8: {exc}")
            return {}
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = _JSON.decode(value)
        except (ValueError, RecursionError) as exc:
            problems.append(f"headers are not valid JSON: {exc}")
            return {}
    if not isinstance(value, dict):
        problems.append(f"headers are not a JSON object (a JSON {type(value).__name__})")
        return {}
    for name, item in value.items():
        if not name:
            problems.append("headers have an empty name")
            return {}
        if item is not None and not isinstance(item, (str, int, float, bool)):
            problems.append(f"header {name!r} is not a string, number, boolean or null")
            return {}
        problem = text_problem(name) or (text_problem(item) if isinstance(item, str) else None)
        if problem:
            problems.append(f"header {name!r} {problem}")
            return {}
    return value
