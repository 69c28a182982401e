"""Validation that needs no database: what ``prepare_event`` stores."""

from __future__ import annotations

import json
import uuid

import pytest

from outbox import EnqueueError
from outbox.events import prepare_event

BASE = {"topic": "orders.created", "aggregate_type": "order", "aggregate_id": "42"}


def test_a_valid_event_is_serialized_compactly_with_a_new_uuid() -> None:
    event = prepare_event(payload={"b": 1, "a": [1, 2]}, headers={"x": "y"}, key="k", **BASE)
    assert json.loads(event.payload_json) == {"b": 1, "a": [1, 2]}
    assert event.payload_json == '{"b":1,"a":[1,2]}'
    assert event.headers_json == '{"x":"y"}'
    assert uuid.UUID(event.message_id) and event.partition_key == "k"


def test_integer_aggregate_ids_are_accepted_as_text() -> None:
    assert prepare_event(payload=[], topic="t", aggregate_type="o", aggregate_id=7).aggregate_id == "7"


def test_the_payload_limit_counts_utf8_bytes() -> None:
    with pytest.raises(EnqueueError, match="payload is 11 bytes"):
        prepare_event(payload={"é": "é"}, max_payload_bytes=10, **BASE)


def test_circular_payload_is_rejected() -> None:
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(EnqueueError, match="payload is not valid JSON"):
        prepare_event(payload=loop, **BASE)


def test_bool_is_not_an_aggregate_id() -> None:
    with pytest.raises(EnqueueError, match="aggregate_id must be a string"):
        prepare_event(payload={}, topic="t", aggregate_type="o", aggregate_id=True)
