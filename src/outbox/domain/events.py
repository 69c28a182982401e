"""Validation of ``enqueue`` input: everything is checked before any SQL runs.

What is checked, and why, field by field:

* Text columns (``message_id``, ``topic``, ``aggregate_type``, ``aggregate_id``, ``key``,
  ``trace_id``) must fit their column on *every* engine. PostgreSQL's and MySQL's
  ``VARCHAR(n)`` count characters (code points); SQL Server's ``NVARCHAR(n)`` counts
  UTF-16 code units, where a character outside the Basic Multilingual Plane (an emoji)
  takes two, and SQL Server truncates an over-long value bound to a variable without an
  error. So both counts are checked against the limit: an overflow is an
  ``EnqueueError``, never a silent truncation (which could make two long message ids
  collapse into one "duplicate"). No column is limited in bytes: MySQL's utf8mb4
  ``VARCHAR(n)`` counts characters too, and its ``TEXT`` ``last_error`` holds 65,535
  bytes, more than 4,000 UTF-16 units can take (12,000 bytes at most).
* What AMQP carries in a short string (at most 255 *bytes* of UTF-8) is checked in
  bytes: the routing key (``topic``), the ``message_id`` property and every header name.
  A header integer must fit AMQP's signed 64 bits.
* No text may hold a NUL character (PostgreSQL's text and JSON types refuse it and abort
  the caller's transaction) or a lone surrogate (not Unicode text: every driver fails to
  encode it).
* Every JSON object key in the payload, at any depth, must be a string. ``json.dumps``
  writes an ``int``, ``float``, ``bool`` or ``None`` key as text, silently: ``{1: "a",
  "1": "b"}`` becomes two ``"1"`` members, of which the database keeps one, and the
  consumer never sees the key the caller wrote. The walk runs after ``dump_json`` (which
  has refused cycles and nesting past Python's recursion limit) and visits only containers'
  keys and values, and builds the key's path only once it found one (``structure_problem``).
* The payload's arrays and objects nest at most ``MAX_JSON_DEPTH`` (31) levels deep.
  MariaDB's JSON check refuses 32 (the enqueue failed with the driver's CHECK error
  instead of an ``EnqueueError``), MySQL's JSON type 100; and a payload nested near
  Python's recursion limit was stored and then could not be read back by the relay (it
  went dead as undecodable). Found in review.
* A float that ``repr`` writes with an exponent (``1e+20``, ``1e-07``), in the payload or
  a header, is written out in full with a fraction (``100000000000000000000.0``,
  ``0.0000001``), the same number, before the size check. PostgreSQL's ``jsonb`` writes
  numbers out in full and keeps only the fraction it was given: ``1e+20`` came back as the
  integer 100000000000000000000, to Python's json and any typed reader, and as a header one
  that no AMQP header can carry (the event went dead as poison at its first publish); and a
  payload of such numbers came back far larger than the size checked here (980,001 bytes
  of ``[1e300, ...]`` came back as 42,420,000, 700,001 bytes of ``[5e-324, ...]`` as
  32,800,000, past every broker's limit). Found in review.
* A ``message_id`` may not start or end with whitespace. SQL Server's equality ignores
  trailing spaces, so ``m1`` and ``m1 `` would be one message there and two on the other
  engines; refusing both ends everywhere keeps the idempotency key the same on every engine
  (docs/sqlserver.md, "Enqueue: no key-range locks").

A ``message_id`` the caller leaves out is a new UUID of version 7: time-ordered, so the
unique index on ``message_id`` grows at one end and the purge and the archive empty the
other (docs/internals.md, "Message ids are time-ordered").

Every error names the field, and is raised before anything reaches the database, so the
caller's transaction is untouched.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

from uuid_utils import uuid7

from ..core.errors import EnqueueError
from ..core.model import NewEvent

#: Column widths; the same on every engine. Each is checked in code points and in UTF-16
#: code units (SQL Server's NVARCHAR counts those).
MAX_TOPIC = 255
MAX_AGGREGATE = 255
MAX_KEY = 255
MAX_MESSAGE_ID = 64
MAX_TRACE_ID = 255
MAX_HEADERS_BYTES = 64 * 1024
#: ``last_error`` is NVARCHAR(4000) on SQL Server: error texts are cut to fit in Python.
MAX_ERROR_UNITS = 4000
#: AMQP short strings (routing key, ``message_id`` property, header names): UTF-8 bytes.
MAX_SHORTSTR_BYTES = 255
#: AMQP field-table integers are signed 64-bit.
MIN_HEADER_INT, MAX_HEADER_INT = -(2 ** 63), 2 ** 63 - 1

#: json.dumps writes a NUL character as \u0000 (an escape preceded by an even run of backslashes).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def utf16_units(text: str) -> int:
    """Length in UTF-16 code units, as SQL Server's NVARCHAR counts it."""
    if text.isascii():  # a flag CPython keeps on every str: no scan (replay validates rows in bulk)
        return len(text)
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


def lone_surrogate_at(text: str) -> int | None:
    """Index of the first lone surrogate (which no UTF encoding can carry), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored and sent as text (NUL, lone surrogate), or None."""
    if "\x00" in text:
        return f"contains a NUL character (at index {text.index(chr(0))})"
    at = lone_surrogate_at(text)
    if at is not None:
        return f"contains a lone surrogate U+{ord(text[at]):04X} (at index {at}), which is not valid Unicode"
    return None


def fit_utf16(text: str, limit: int = MAX_ERROR_UNITS) -> str:
    """``text`` made storable in a column of ``limit`` UTF-16 code units (``last_error``):
    NUL and lone surrogates replaced by U+FFFD, then cut, never inside a surrogate pair,
    with ``...`` marking the cut. Done in Python so the database never truncates."""
    # Every code point takes at least one unit, so nothing past ``limit`` code points can fit.
    clean = "".join("\ufffd" if ch == "\x00" or 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text[:limit + 1])
    if utf16_units(clean) <= limit:
        return clean
    budget, units, cut = limit - 3, 0, 0
    for cut, ch in enumerate(clean):  # noqa: B007 - cut is read after the loop
        width = 2 if ord(ch) > 0xFFFF else 1
        if units + width > budget:
            break
        units += width
    return clean[:cut] + "..."


class _Unwritable(TypeError):
    """A value ``json.dumps`` has no type for (``dump_json`` names its path)."""


def _reject_unknown(value: Any) -> Any:
    raise _Unwritable(f"{type(value).__name__} is not JSON-serializable")


#: What to turn a value JSON has no type for into, by its type's name.
_CONVERT = {"Decimal": " (str() keeps every digit; a float may not)", "datetime": " (.isoformat())",
            "date": " (.isoformat())", "time": " (.isoformat())", "UUID": " (str())"}


def _unwritable_at(value: Any, what: str) -> str:
    """Where the first value ``json.dumps`` has no type for is in ``value`` (which holds one),
    in the order it writes them, and what it is."""
    path: list[Any] = []  # the keys and indexes down to the item, the root's None first
    stack: list[Iterator[tuple[Any, Any]]] = [iter([(None, value)])]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            continue
        key, item = step
        path = [*path[:len(stack) - 1], key]
        if isinstance(item, dict):
            stack.append(iter(item.items()))
        elif isinstance(item, (list, tuple)):
            stack.append(iter(enumerate(item)))
        elif not isinstance(item, (str, int, float)) and item is not None:
            name = type(item).__name__
            where = what + "".join(f"[{key!r}]" for key in path[1:])
            return f"{where} is a {name}, which JSON has no type for: convert it first{_CONVERT.get(name, '')}"
    return "a value JSON has no type for"


def dump_json(value: Any, what: str) -> str:
    """Strict JSON: no NaN/Infinity, no objects json cannot represent, valid UTF-8; floats
    with an exponent written out in full (module docstring)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_reject_unknown)
        text.encode("utf-8")  # lone surrogates would fail later in the driver
    except _Unwritable:
        raise EnqueueError(f"{what} is not valid JSON: {_unwritable_at(value, what)}") from None
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise EnqueueError(f"{what} is not valid JSON: {exc}") from None
    if "e+" in text or "e-" in text:
        text = _EXPONENT_NUMBER.sub(_written_out, text)
    return text


#: A JSON string (matched whole, so that nothing in it is taken for a number; by runs: a
#: megabyte of text containing "e+" takes 8 ms, not 120), or a number with an exponent
#: (group 1), as ``json.dumps`` writes them. A number is tried from its first character
#: only: tried from each digit, an integer's every try read to its end (4,000 digits: 8
#: million steps; 900 KB of 300-digit integers took 11.6 s; found in review).
_EXPONENT_NUMBER = re.compile(r'"(?:[^"\\]+|\\.)*"|(?<![\d.+-])(-?\d+(?:\.\d+)?e[+-]\d+)')


def _written_out(match: re.Match[str]) -> str:
    number = match[1]
    if number is None:
        return match[0]
    written = f"{Decimal(number):f}"
    return written if "." in written else f"{written}.0"


#: What ``json.dumps`` writes as a JSON object or array.
_CONTAINERS = (dict, list, tuple)


#: The deepest a payload's arrays and objects may nest (module docstring).
MAX_JSON_DEPTH = 31


class _TooDeep(Exception):
    """A container nested deeper than ``MAX_JSON_DEPTH``."""


def _non_str_key(value: Any, depth: int = 1) -> list[Any] | None:
    """The path (keys and indexes, innermost last) to the first object key that is not a
    string, or None; ``value`` is a dict, list or tuple that ``json.dumps`` wrote (no cycle),
    ``depth`` levels down. Raises ``_TooDeep`` past ``MAX_JSON_DEPTH``."""
    if depth > MAX_JSON_DEPTH:
        raise _TooDeep
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return [key]
            if isinstance(item, _CONTAINERS):
                inner = _non_str_key(item, depth + 1)
                if inner is not None:
                    return [key, *inner]
    else:
        for index, item in enumerate(value):
            if isinstance(item, _CONTAINERS):
                inner = _non_str_key(item, depth + 1)
                if inner is not None:
                    return [index, *inner]
    return None


def structure_problem(value: Any, what: str) -> str | None:
    """Why ``value``'s JSON would lose an object key (a key that is not a string), naming
    its path, or nests too deep; None when neither (module docstring)."""
    try:
        path = _non_str_key(value)
    except _TooDeep:
        return (f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (MariaDB's JSON check "
                f"refuses 32)")
    if path is None:
        return None
    *parents, key = path
    where = what + "".join(f"[{step!r}]" for step in parents)
    return (f"{where} has the key {key!r} ({type(key).__name__}): JSON object keys must be strings "
            f"(JSON would write it as text, and it could overwrite another key)")


def _text(name: str, value: Any, limit: int, *, required: bool = True,
          amqp_bytes: str | None = None) -> str | None:
    """A text column: type, emptiness, NUL and surrogates, then the limit in code points,
    UTF-16 code units and (``amqp_bytes`` names what AMQP carries it as) UTF-8 bytes."""
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise EnqueueError(f"{name} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise EnqueueError(f"{name} must not be empty")
    problem = text_problem(value)
    if problem:
        raise EnqueueError(f"{name} {problem}")
    if len(value) > limit:
        raise EnqueueError(f"{name} is {len(value)} characters long; the limit is {limit}")
    units = utf16_units(value)
    if units > limit:
        raise EnqueueError(f"{name} is {len(value)} characters but {units} UTF-16 code units long; the limit is "
                           f"{limit} (SQL Server's NVARCHAR({limit}) counts UTF-16 code units)")
    if amqp_bytes is not None:
        size = len(value.encode("utf-8"))
        if size > MAX_SHORTSTR_BYTES:
            raise EnqueueError(f"{name} is {size} bytes in UTF-8; AMQP carries at most {MAX_SHORTSTR_BYTES} "
                               f"bytes in {amqp_bytes}")
    return value


#: ``_text`` and ``_check_headers`` for code that validates many events at once (replay
#: checks each distinct value of a column once): the very same checks, by name.
check_text = _text


def _message_id(value: Any) -> str:
    """A message id: a text column, and no whitespace at either end (SQL Server's equality
    ignores trailing spaces: see the module docstring)."""
    text: str = _text("message_id", value, MAX_MESSAGE_ID,  # type: ignore[assignment]
                      amqp_bytes="the message_id property")
    if text != text.strip():
        raise EnqueueError(f"message_id {text!r} starts or ends with whitespace, which is refused on every engine: "
                           "SQL Server compares ids ignoring trailing spaces, so 'm1 ' and 'm1' would be one "
                           "message there and two elsewhere")
    return text


def _check_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """Flat headers AMQP can carry: names of 1 to 255 UTF-8 bytes, values that are
    strings, finite numbers (integers within signed 64 bits), booleans or None."""
    checked = dict(headers)
    for name, value in checked.items():
        if not isinstance(name, str) or not name:
            raise EnqueueError(f"header names must be non-empty strings, got {name!r}")
        problem = text_problem(name)
        if problem:
            raise EnqueueError(f"header name {name!r} {problem}")
        size = len(name.encode("utf-8"))
        if size > MAX_SHORTSTR_BYTES:
            raise EnqueueError(f"header name {name[:40]!r}... is {size} bytes in UTF-8; AMQP header names are "
                               f"at most {MAX_SHORTSTR_BYTES} bytes")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise EnqueueError(f"header {name!r} must be a string, number, boolean or None")
        if isinstance(value, str):
            problem = text_problem(value)
            if problem:
                raise EnqueueError(f"header {name!r}: its value {problem}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise EnqueueError(f"header {name!r} is {value!r}; NaN and infinity are not JSON")
        elif isinstance(value, int) and not isinstance(value, bool) and not (
                MIN_HEADER_INT <= value <= MAX_HEADER_INT):
            raise EnqueueError(f"header {name!r} is {value}, outside the signed 64-bit range AMQP carries")
    return checked


check_headers = _check_headers


#: What ``json.dumps(..., ensure_ascii=False)`` writes for a string (CPython's C encoder):
#: lets a caller append one string member to JSON that ``dump_json`` wrote.
encode_json_string = json.encoder.encode_basestring


def payload_json_problem(payload_json: str, max_payload_bytes: int) -> str | None:
    """What ``prepare_event`` refuses in a payload's JSON text once written (a NUL
    escape, the size), or None."""
    if "\\u0000" in payload_json and _NUL_ESCAPE.search(payload_json):
        return "payload contains a NUL character (\\u0000), which PostgreSQL's JSON cannot store"
    size = len(payload_json) if payload_json.isascii() else len(payload_json.encode("utf-8"))
    if size > max_payload_bytes:
        return f"payload is {size} bytes; OUTBOX_MAX_PAYLOAD_BYTES allows {max_payload_bytes}"
    return None


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
    problem = payload_json_problem(payload_json, max_payload_bytes) or structure_problem(payload, "payload")
    if problem:
        raise EnqueueError(problem)
    if headers is None:
        headers = {}
    if not isinstance(headers, Mapping):
        raise EnqueueError(f"headers must be a mapping, got {type(headers).__name__}")
    headers_text = dump_json(_check_headers(headers), "headers")
    if len(headers_text.encode("utf-8")) > MAX_HEADERS_BYTES:
        raise EnqueueError(f"headers are larger than {MAX_HEADERS_BYTES} bytes")
    if message_id is None:
        message_id = str(uuid7())
    return NewEvent(
        message_id=_message_id(message_id),
        topic=_text("topic", topic, MAX_TOPIC, amqp_bytes="a routing key"),  # type: ignore[arg-type]
        aggregate_type=_text("aggregate_type", aggregate_type, MAX_AGGREGATE),  # type: ignore[arg-type]
        aggregate_id=_text("aggregate_id", aggregate_id, MAX_AGGREGATE),  # type: ignore[arg-type]
        partition_key=_text("key", key, MAX_KEY, required=False),
        payload_json=payload_json,
        headers_json=headers_text,
        trace_id=_text("trace_id", trace_id, MAX_TRACE_ID, required=False),
    )
