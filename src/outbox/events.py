"""Validation of ``enqueue`` input: everything is checked before any SQL runs."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping

from .errors import EnqueueError
from .model import NewEvent

#: Column widths; the same on every engine.
MAX_TOPIC = 255
MAX_AGGREGATE = 255
MAX_KEY = 255
MAX_MESSAGE_ID = 64
MAX_HEADERS_BYTES = 64 * 1024

#: json.dumps writes a NUL character as \u0000 (an escape preceded by an even run of backslashes).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _reject_unknown(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def dump_json(value: Any, what: str) -> str:
    """Strict JSON: no NaN/Infinity, no objects json cannot represent, valid UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_reject_unknown)
        text.encode("utf-8")  # lone surrogates would fail later in the driver
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise EnqueueError(f"{what} is not valid JSON: {exc}") from None
    return text


def _text(name: str, value: Any, limit: int, *, required: bool = True) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise EnqueueError(f"{name} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise EnqueueError(f"{name} must not be empty")
    if len(value) > limit:
        raise EnqueueError(f"{name} is {len(value)} characters long; the limit is {limit}")
    if "\x00" in value:
        raise EnqueueError(f"{name} contains a NUL character")
    return value


def prepare_event(
    *,
    topic: str,
    aggregate_type: str,
    aggregate_id: str | int,
    payload: Any,
    headers: Mapping[str, Any] | None = None,
    key: str | None = None,
    message_id: str | None = None,
    trace_id: str | None = None,
    max_payload_bytes: int = 1_048_576,
) -> NewEvent:
    """Validate and serialize one event; raise ``EnqueueError`` naming the problem."""
    if isinstance(aggregate_id, int) and not isinstance(aggregate_id, bool):
        aggregate_id = str(aggregate_id)
    if not isinstance(payload, (dict, list)):
        raise EnqueueError(f"payload must be a JSON object or array, got {type(payload).__name__}")
    payload_json = dump_json(payload, "payload")
    if _NUL_ESCAPE.search(payload_json):
        raise EnqueueError("payload contains a NUL character (\\u0000), which PostgreSQL's JSON cannot store")
    size = len(payload_json.encode("utf-8"))
    if size > max_payload_bytes:
        raise EnqueueError(f"payload is {size} bytes; OUTBOX_MAX_PAYLOAD_BYTES allows {max_payload_bytes}")
    if headers is None:
        headers = {}
    if not isinstance(headers, Mapping):
        raise EnqueueError(f"headers must be a mapping, got {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise EnqueueError(f"header names must be non-empty strings, got {name!r}")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise EnqueueError(f"header {name!r} must be a string, number, boolean or None")
    headers_json = dump_json(dict(headers), "headers")
    if len(headers_json.encode("utf-8")) > MAX_HEADERS_BYTES:
        raise EnqueueError(f"headers are larger than {MAX_HEADERS_BYTES} bytes")
    if message_id is None:
        message_id = str(uuid.uuid4())
    return NewEvent(
        message_id=_text("message_id", message_id, MAX_MESSAGE_ID),  # type: ignore[arg-type]
        topic=_text("topic", topic, MAX_TOPIC),  # type: ignore[arg-type]
        aggregate_type=_text("aggregate_type", aggregate_type, MAX_AGGREGATE),  # type: ignore[arg-type]
        aggregate_id=_text("aggregate_id", aggregate_id, MAX_AGGREGATE),  # type: ignore[arg-type]
        partition_key=_text("key", key, MAX_KEY, required=False),
        payload_json=payload_json,
        headers_json=headers_json,
        trace_id=_text("trace_id", trace_id, 255, required=False),
    )
