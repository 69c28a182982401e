"""Validation that needs no database: what ``prepare_event`` stores."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from outbox import EnqueueError
from outbox.domain.events import MAX_JSON_DEPTH, prepare_event

BASE = {"topic": "orders.created", "aggregate_type": "order", "aggregate_id": "42"}


def test_a_valid_event_is_serialized_compactly_with_a_new_uuid() -> None:
    event = prepare_event(payload={"b": 1, "a": [1, 2]}, headers={"x": "y"}, key="k", **BASE)
    assert json.loads(event.payload_json) == {"b": 1, "a": [1, 2]}
    assert event.payload_json == '{"b":1,"a":[1,2]}'
    assert event.headers_json == '{"x":"y"}'
    assert uuid.UUID(event.message_id) and event.partition_key == "k"


def test_default_message_ids_are_uuid7s_in_the_order_they_were_made() -> None:
    """Time-ordered ids keep the unique index's inserts and deletes at its two ends
    (docs/internals.md, "Message ids are time-ordered"); a UUIDv4 would fail both checks."""
    before_ms = time.time_ns() // 1_000_000
    ids = [prepare_event(payload={}, **BASE).message_id for _ in range(2000)]
    parsed = [uuid.UUID(i) for i in ids]
    assert {u.version for u in parsed} == {7} and all(str(u) == i for u, i in zip(parsed, ids, strict=True))
    assert all(a < b for a, b in zip(ids, ids[1:], strict=False)), "each id sorts after the one made before it"
    assert before_ms <= parsed[0].int >> 80 <= parsed[-1].int >> 80 <= time.time_ns() // 1_000_000



@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_message_ids_made_after_a_fork_share_no_random_state_with_the_parent() -> None:
    """Celery's prefork pool and preloading web servers fork a process that has made ids.
    uuid-utils before 0.14 carried its random generator's state into the child, so parent
    and child drew the same random bits (seen: up to 1,845 equal tails of 2,000, and up to
    348 repeated ids), and a repeated message_id is stored once: an event lost. The child
    must draw its own bits (docs/internals.md, "Message ids are time-ordered")."""
    made = 2000
    [prepare_event(payload={}, **BASE) for _ in range(10)]  # the parent's generator is in use
    read_end, write_end = os.pipe()
    pid = os.fork()
    ids = [uuid.UUID(prepare_event(payload={}, **BASE).message_id).int for _ in range(made)]
    if pid == 0:  # the child: hand its ids over (a buffered file writes them all) and leave at once
        try:
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                out.write(",".join(map(str, ids)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as handed:
        child = [int(i) for i in handed.read().decode().split(",")]
    os.waitpid(pid, 0)
    assert len(child) == made
    assert not set(ids) & set(child), "the child made ids its parent made too"
    same_tails = sum((a & 0xFFFFFFFF) == (b & 0xFFFFFFFF) for a, b in zip(ids, child, strict=True))
    assert same_tails <= 1, f"{same_tails} of {made} ids drew the same random bits in parent and child"


def test_integer_aggregate_ids_are_accepted_as_text() -> None:
    assert prepare_event(payload=[], topic="t", aggregate_type="o", aggregate_id=7).aggregate_id == "7"


def test_the_payload_limit_counts_utf8_bytes() -> None:
    with pytest.raises(EnqueueError, match="payload is 11 bytes"):
        prepare_event(payload={"é": "é"}, max_payload_bytes=10, **BASE)


def test_writing_out_exponents_reads_each_number_once() -> None:
    """The rewrite of floats with an exponent tried its number pattern at every digit of
    every integer, each try reading to the integer's end: 900 KB of 300-digit integers and
    one ``1e+20`` took 11.6 s in enqueue (the writer's transaction open meanwhile), 30
    integers of 4,000 digits 17 s. Each takes milliseconds now; the bound is generous."""
    payload = [10 ** 4000] * 30 + [1e20, -2.5e-7]
    started = time.monotonic()
    written = prepare_event(payload=payload, **BASE).payload_json
    assert time.monotonic() - started < 5
    assert json.loads(written) == payload and written.endswith(",100000000000000000000.0,-0.00000025]")


def test_circular_payload_is_rejected() -> None:
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(EnqueueError, match="payload is not valid JSON"):
        prepare_event(payload=loop, **BASE)


@pytest.mark.parametrize("payload, message", [
    ({"order": {"lines": [{"sku": "a"}, {"total": Decimal("9.99")}]}},
     r"payload\['order'\]\['lines'\]\[1\]\['total'\] is a Decimal, which JSON has no type for: convert it "
     r"first \(str\(\) keeps every digit; a float may not\)"),
    ([1, datetime(2026, 12, 7, tzinfo=UTC)],
     r"payload\[1\] is a datetime, which JSON has no type for: convert it first \(\.isoformat\(\)\)"),
    ({"tags": {"a"}}, r"payload\['tags'\] is a set, which JSON has no type for"),
])
def test_a_value_json_cannot_write_is_named_by_its_path(payload: Any, message: str) -> None:
    """A payload of hundreds of fields said only "Decimal is not JSON-serializable"."""
    with pytest.raises(EnqueueError, match="payload is not valid JSON: " + message):
        prepare_event(payload=payload, **BASE)

def test_bool_is_not_an_aggregate_id() -> None:
    with pytest.raises(EnqueueError, match="aggregate_id must be a string"):
        prepare_event(payload={}, topic="t", aggregate_type="o", aggregate_id=True)


# -- what AMQP and every engine's columns can hold (issue 14 items 2-3, issue 10 item 3) ---------

REFUSED = [
    # AMQP short strings are 255 bytes: a 255-character topic of 510 bytes cannot be a routing key.
    ({"topic": "é" * 255}, "topic is 510 bytes in UTF-8; AMQP carries at most 255 bytes in a routing key"),
    ({"headers": {"h" * 256: 1}}, "header name 'hhhh.*is 256 bytes in UTF-8; AMQP header names are at most 255"),
    ({"headers": {"é" * 128: 1}}, "header name .* is 256 bytes in UTF-8"),
    # NVARCHAR(n) counts UTF-16 code units: an emoji takes two.
    ({"message_id": "😀" * 64}, "message_id is 64 characters but 128 UTF-16 code units long; the limit is 64"),
    ({"aggregate_id": "😀" * 128}, "aggregate_id is 128 characters but 256 UTF-16 code units long; the limit is 255"),
    ({"key": "k" + "😀" * 128}, "key is 129 characters but 257 UTF-16 code units long; the limit is 255"),
    ({"aggregate_type": "😀" * 200}, "aggregate_type is 200 characters but 400 UTF-16 code units"),
    ({"headers": {"big": 2 ** 63}}, "header 'big' is 9223372036854775808, outside the signed 64-bit range"),
    ({"headers": {"small": -(2 ** 63) - 1}}, "outside the signed 64-bit range"),
    ({"headers": {"f": float("inf")}}, "header 'f' is inf; NaN and infinity are not JSON"),
    # NUL characters and lone surrogates, named by field.
    ({"headers": {"h": "a\x00b"}}, r"header 'h': its value contains a NUL character \(at index 1\)"),
    ({"headers": {"h\x00": "v"}}, r"header name 'h\\x00' contains a NUL character"),
    ({"headers": {"h": "\udc00"}}, "header 'h': its value contains a lone surrogate U\\+DC00"),
    ({"headers": {"\ud800h": "v"}}, "header name .* contains a lone surrogate U\\+D800"),
    ({"topic": "orders.\udc00"}, r"topic contains a lone surrogate U\+DC00 \(at index 7\)"),
    ({"aggregate_id": "\ud83d"}, "aggregate_id contains a lone surrogate"),
    ({"aggregate_type": "o\udfff"}, "aggregate_type contains a lone surrogate"),
    ({"key": "\udc00k"}, "key contains a lone surrogate"),
    ({"message_id": "m-\udc00"}, "message_id contains a lone surrogate"),
    ({"trace_id": "00-\udc00"}, "trace_id contains a lone surrogate"),
    ({"topic": "a\x00"}, "topic contains a NUL character"),
]


@pytest.mark.parametrize("override,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_amqp_or_a_column_cannot_hold_is_refused_naming_the_field(override: dict, message: str) -> None:
    event = {**BASE, "payload": {"ok": True}, **override}
    with pytest.raises(EnqueueError, match=message):
        prepare_event(**event)


def test_the_largest_values_that_fit_everywhere_are_accepted() -> None:
    event = prepare_event(payload={}, topic="t" * 255, aggregate_type="é" * 255, aggregate_id="😀" * 127 + "a",
                          key="k" * 255, message_id="€" * 64, headers={"h" * 255: 2 ** 63 - 1, "n": -(2 ** 63)})
    assert event.aggregate_id.endswith("a") and len(event.message_id.encode()) == 192


def test_fit_utf16_never_splits_a_pair_and_cleans_what_no_database_stores() -> None:
    from outbox.domain.events import fit_utf16, utf16_units
    assert fit_utf16("short") == "short"
    cut = fit_utf16("a" + "😀" * 10, 8)
    assert cut == "a😀😀..." and utf16_units(cut) == 8
    assert utf16_units(fit_utf16("😀" * 5000)) <= 4000
    assert fit_utf16("nul\x00 and \udc00 lone") == "nul\ufffd and \ufffd lone"


# -- message ids with whitespace at either end (issue 20 item 2) -------------------------------

@pytest.mark.parametrize("message_id", ["m1 ", " m1", "m1\t", "\u00a0m1", "m1\n", "m1\u3000"])
def test_a_message_id_with_whitespace_at_either_end_is_refused(message_id: str) -> None:
    """SQL Server's unique index ignores trailing spaces: ``m1 `` was silently merged into
    ``m1`` there and kept apart on PostgreSQL. Now refused on every engine, naming why."""
    with pytest.raises(EnqueueError, match=r"message_id .* starts or ends with whitespace.*trailing spaces"):
        prepare_event(payload={}, topic="t", aggregate_type="o", aggregate_id="a", message_id=message_id)


def test_whitespace_inside_a_message_id_is_kept() -> None:
    assert prepare_event(payload={}, topic="t", aggregate_type="o", aggregate_id="a",
                         message_id="order 42 created").message_id == "order 42 created"


KEY_LOSSES = [
    # json.dumps wrote these as "1", "null": PostgreSQL kept {"1": "b", "null": "d"}.
    ({1: "a", "1": "b", None: "d"}, r"payload has the key 1 \(int\)"),
    ({"ok": 1, False: 0}, r"payload has the key False \(bool\)"),
    ({"a": [{"b": {2.5: 1}}]}, r"payload\['a'\]\[0\]\['b'\] has the key 2.5 \(float\)"),
    ([{"x": ({None: 1},)}], r"payload\[0\]\['x'\]\[0\] has the key None \(NoneType\)"),
]


@pytest.mark.parametrize("payload,where", KEY_LOSSES, ids=["top", "bool", "nested", "array"])
def test_a_payload_key_that_is_not_a_string_is_refused_naming_its_path(payload: object, where: str) -> None:
    with pytest.raises(EnqueueError, match=where + ": JSON object keys must be strings"):
        prepare_event(payload=payload, **BASE)


def nested(levels: int) -> object:
    """Arrays and objects in turn, ``levels`` deep."""
    payload: object = {"leaf": 1}
    for level in range(levels - 1):
        payload = [payload] if level % 2 == 0 else {"a": payload}
    return payload


def test_a_payload_nested_deeper_than_every_engine_stores_is_refused() -> None:
    """Found in review: MariaDB's JSON check refuses 32 levels (a driver error, not an
    EnqueueError), and a payload near Python's recursion limit was stored and then went
    dead unread. 31 levels pass on every engine; 32 are refused, naming the limit."""
    assert prepare_event(payload=nested(MAX_JSON_DEPTH), **BASE).payload_json.count("[") > 0
    for levels in (MAX_JSON_DEPTH + 1, 900):
        with pytest.raises(EnqueueError, match="payload nests arrays and objects more than 31 levels deep"):
            prepare_event(payload=nested(levels), **BASE)


def test_header_names_that_are_not_strings_are_refused() -> None:
    with pytest.raises(EnqueueError, match="header names must be non-empty strings, got 1"):
        prepare_event(payload={}, headers={1: "a"}, **BASE)


def test_a_key_problem_reaches_no_database(tmp_path: Path) -> None:
    """enqueue refuses it before any SQL: the caller's transaction holds nothing."""
    from outbox import enqueue
    from outbox.storage.store import OutboxStore

    OutboxStore(f"sqlite:///{tmp_path / 'o.db'}").migrate()
    with sqlite3.connect(tmp_path / "o.db") as conn:
        with pytest.raises(EnqueueError, match="has the key 1"):
            enqueue(conn, payload={"ok": {1: "x"}}, **BASE)
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
        assert not conn.in_transaction
