"""Headers the publisher would refuse at every attempt are refused by ``enqueue``: the AMQP
header table of the caller's headers plus the relay's own must fit 64 KiB
(``publisher.MAX_HEADER_BYTES``). Before, headers whose JSON fitted ``enqueue``'s own 64 KiB
bound were stored, committed, and went dead at their first publish ("poison: headers are
65725 bytes encoded"): the caller was told nothing."""

from __future__ import annotations

from typing import Any

import pytest

from outbox import EnqueueError, enqueue
from outbox.publisher import poison_check
from outbox.storage.store import OutboxStore


@pytest.mark.parametrize("kind", ["sqlite"])
@pytest.mark.parametrize("headers", [{"x-blob": "a" * 65_500}, {f"h{i:05d}": 1.5 for i in range(4_900)}],
                         ids=["one long string", "many floats"])
def test_headers_the_publisher_would_refuse_are_refused_before_anything_is_written(
        writer: Any, store: OutboxStore, headers: dict[str, Any]) -> None:
    with pytest.raises(EnqueueError, match=r"headers: headers are \d+ bytes encoded, above the maximum of 65536"):
        enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, headers=headers,
                table=store.engine.table_name)
    writer.commit()
    assert store.stats().counts["pending"] == 0


@pytest.mark.parametrize("kind", ["sqlite"])
def test_headers_enqueue_accepts_near_the_limit_are_published(writer: Any, store: OutboxStore) -> None:
    """Around the limit, every event enqueue accepts passes the publisher's check on the row
    the relay claims (its real outbox_id, attempt and created_at)."""
    verdicts = {}
    for size in range(64_900, 65_500, 25):
        try:
            enqueue(writer, topic="orders.created", aggregate_type="order", aggregate_id="42", payload={},
                    headers={"x-blob": "a" * size}, message_id=f"m-{size}", table=store.engine.table_name)
        except EnqueueError:
            verdicts[size] = "refused"
        else:
            verdicts[size] = "accepted"
    writer.commit()
    assert set(verdicts.values()) == {"accepted", "refused"}
    claimed = store.claim(100).messages
    assert len(claimed) == list(verdicts.values()).count("accepted")
    assert [poison_check(m) for m in claimed] == [None] * len(claimed)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql", "mssql"])
def test_float_headers_with_an_exponent_come_back_as_the_same_floats(writer: Any, store: OutboxStore) -> None:
    """PostgreSQL's jsonb writes a number out in full and keeps only the fraction it was
    given: a float header stored as JSON's ``1e+20`` came back as the integer
    100000000000000000000, which no AMQP header can carry, and the event went dead as poison
    at its first publish (``9.2e18`` too; ``1e+16`` came back an int)."""
    headers = {"big": 1e20, "int64ish": 2.0 ** 63, "huge": -1.7976931348623157e308, "e16": 1e16, "small": 1e-7,
               "plain": 1.5, "n": 7}
    enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, headers=headers,
            table=store.engine.table_name)
    writer.commit()
    (message,) = store.claim(10).messages
    assert {name: (type(value), value) for name, value in message.headers.items()} == \
        {name: (type(value), value) for name, value in headers.items()}
    assert poison_check(message) is None
