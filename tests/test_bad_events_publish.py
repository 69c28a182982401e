"""An event the publisher cannot encode is POISON for that event alone (issue 14 item 2),
and a row the claim cannot decode still gets its dead-letter copy (item 1): real RabbitMQ,
real stores on every engine, no Celery (``relay.handle_claim`` / ``handle_publish``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest
from engine_support import row, tamper
from publisher_support import make_message, raw_body
from services import AMQP_URL

from outbox import Status, enqueue
from outbox.core.model import OutboxMessage
from outbox.publisher import FailureKind, KombuPublisher
from outbox.relay import RelayContext, handle_claim, handle_publish
from outbox.storage.store import OutboxStore

LONG_TOPIC = "orders." + "é" * 150  # 157 characters: fits the column; 307 bytes: no routing key
LONG_NAME = "x-" + "n" * 300  # a header name of 302 bytes
LONG_ID = "\U0001F600" * 64  # 64 characters: fits VARCHAR(64); 256 bytes: no message_id property


def errors_of(store: OutboxStore, id: int) -> tuple:
    return row(store, id, "status, attempts, last_error")


def chains() -> list[list[OutboxMessage]]:
    return [[make_message(1, aggregate_id="a"), make_message(2, aggregate_id="a")],
            [make_message(3, LONG_TOPIC, aggregate_id="b"), make_message(4, aggregate_id="b")],
            [make_message(5, aggregate_id="c", headers={LONG_NAME: 1})],
            [make_message(6, aggregate_id="d")]]


def check_wave(results: list[Any], reasons: tuple[str, str]) -> None:
    assert [r.published for r in results] == [(1, 2), (), (), (6,)]
    assert [r.failed_id for r in results] == [None, 3, 5, None]
    for result, reason in zip((results[1], results[2]), reasons):
        assert result.failure.kind is FailureKind.POISON and reason in result.failure.reason, result.failure


def test_an_event_amqp_cannot_carry_is_poison_and_the_wave_goes_on(broker: dict[str, Any]) -> None:
    """A routing key or a header name over 255 bytes used to fail py-amqp's encoder with
    ``struct.error`` for the whole wave, as RETRIABLE: every innocent chain was charged."""
    with KombuPublisher(AMQP_URL, broker["exchange"]) as publisher:
        results = publisher.publish_chains(chains())
    check_wave(results, ("routing key (topic) 'orders.ééé", f"header name '{LONG_NAME[:20]}"))
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [1, 6, 2]  # waves: 1 and 6, then 2


def test_an_encoder_error_at_send_is_poison_for_that_event_alone(broker: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line: should a limit slip past the checks made before sending, the
    encoder's own error (raised before any byte is written) stops that event alone, and
    the connection stays good for the rest of the wave and the next call."""
    import outbox.publisher.message as publisher_module
    monkeypatch.setattr(publisher_module, "_shortstr_problem", lambda message, headers: None)
    with KombuPublisher(AMQP_URL, broker["exchange"]) as publisher:
        results = publisher.publish_chains(chains())
        # struct's words: "ubyte format requires ..." before Python 3.12, "'B' format requires ..." since.
        check_wave(results, ("format requires 0 <= number <= 255",) * 2)
        assert all(r.failure.reason.startswith("cannot be encoded: error: ") for r in results[1:3])
        assert publisher.publish_chain([make_message(7, aggregate_id="e")]).published == (7,)
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [1, 6, 2, 7]


def test_bad_rows_go_dead_with_their_reason_and_copies_while_the_rest_is_delivered(
        store: OutboxStore, writer: Any, broker: dict[str, Any]) -> None:
    """Rows tampered in the table (written by other code): a header name AMQP cannot carry,
    a topic too long for a routing key and a message id too long for the message_id
    property (decodable, not publishable: POISON at publish), headers that are not an
    object (undecodable: dead at claim). Each goes dead alone with its reason, gets a
    dead-letter copy (the long topic and message id replaced, their values in headers), and
    every other row is delivered on its first attempt, in order per aggregate."""
    def add(aggregate: str, n: int) -> list[int]:
        ids = [enqueue(writer, topic=f"orders.{aggregate}", aggregate_type="order", aggregate_id=aggregate,
                       payload={"n": i}, headers={"tenant": "acme"}, table=store.engine.table_name) for i in range(n)]
        writer.commit()
        return ids

    a = add("a", 3)
    b = add("b", 2)
    c = add("c", 2)
    d = add("d", 2)
    e = add("e", 2) if store.engine.name != "mssql" else []  # NVARCHAR(64) holds at most 192 bytes of UTF-8
    tamper(store, a[1], "headers", json.dumps({LONG_NAME: 1}))
    tamper(store, c[0], "topic", LONG_TOPIC)
    tamper(store, d[0], "headers", '["not", "an", "object"]')
    if e:
        tamper(store, e[0], "message_id", LONG_ID)

    with KombuPublisher(AMQP_URL, broker["exchange"], dead_letter_exchange=broker["dead"]) as publisher:
        def dispatch(task: list[list[OutboxMessage]], deadline: float) -> None:
            handle_publish(RelayContext(store, publisher), task)

        for _ in range(3):  # the rows released behind a poison event go on the next claim
            handle_claim(RelayContext(store, publisher=publisher), dispatch, batch_size=100, lease_s=60)

    innocent = [a[0], a[2], *b, c[1], d[1], *e[1:]]
    live = broker["live"]()
    assert sorted(m.headers["outbox_id"] for m in live) == sorted(innocent)
    assert all(m.headers["attempt"] == 1 for m in live)
    for aggregate, ids in (("a", [a[0], a[2]]), ("b", b)):
        assert [m.headers["outbox_id"] for m in live if m.headers["aggregate_id"] == aggregate] == ids
    for id in innocent:
        assert row(store, id, "status, attempts") in ((Status.DONE, 0),)

    errors = {id: row(store, id, "status, attempts, last_error") for id in (a[1], c[0], d[0])}
    assert errors[a[1]][:2] == (Status.DEAD, 1) and errors[a[1]][2].startswith(
        "poison: header name 'x-nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn'... is 302 bytes in UTF-8, above AMQP's 255")
    assert errors[c[0]][:2] == (Status.DEAD, 1) and errors[c[0]][2].startswith(
        "poison: routing key (topic) 'orders.ééé")
    assert errors[d[0]][:2] == (Status.DEAD, 1) and errors[d[0]][2] == (
        "undecodable row: headers are not a JSON object (a JSON list)")

    copies = {m.headers["outbox_id"]: m for m in broker["dead_letters"]()}
    # Every dead row has its copy: c0's topic cannot be a routing key, nor e0's message id a
    # message_id property, on the dead-letter exchange either (they used to get none).
    assert sorted(copies) == sorted([a[1], c[0], d[0], *e[:1]])
    unroutable = copies[c[0]]
    assert unroutable.delivery_info["routing_key"] == "outbox.dead.unroutable"
    assert unroutable.headers["topic"] == LONG_TOPIC and unroutable.headers["tenant"] == "acme"
    assert json.loads(raw_body(unroutable)) == {"n": 0}  # only the routing key had to change
    assert unroutable.headers["x-outbox-error"].startswith("poison: routing key (topic) 'orders.ééé")
    assert unroutable.headers["x-outbox-replaced"].startswith(
        "routing key 'outbox.dead.unroutable': the topic is 307 bytes in UTF-8, above AMQP's 255")
    if e:
        assert errors_of(store, e[0])[:2] == (Status.DEAD, 1)
        long_id = copies[e[0]]
        assert long_id.headers["message_id"] == LONG_ID and long_id.delivery_info["routing_key"] == "orders.e"
        assert long_id.properties["message_id"] == "sha256:" + hashlib.sha256(LONG_ID.encode()).hexdigest()
        assert long_id.headers["x-outbox-replaced"].startswith("message_id property 'sha256:")
        assert json.loads(raw_body(long_id)) == {"n": 0}
    stub = copies[a[1]]
    assert raw_body(stub) == b"" and LONG_NAME not in stub.headers and "tenant" not in stub.headers
    assert stub.headers["x-outbox-error"].startswith("poison: header name")
    assert stub.headers["x-outbox-omitted"].startswith("header name")
    undecodable = copies[d[0]]
    assert json.loads(raw_body(undecodable)) == {"n": 0}  # what could be decoded rides along
    assert undecodable.headers["x-outbox-error"] == "undecodable row: headers are not a JSON object (a JSON list)"
    assert undecodable.headers["aggregate_id"] == "d" and undecodable.delivery_info["routing_key"] == "orders.d"


def test_carriable_ids_replace_only_what_amqp_cannot_carry() -> None:
    from outbox.publisher.message import UNROUTABLE_DEAD_KEY, carriable_ids

    fine = make_message(1, aggregate_id="a")
    assert carriable_ids(fine) == (fine, None)
    both = replace(make_message(2, LONG_TOPIC, aggregate_id="a"), message_id=LONG_ID)
    copy, said = carriable_ids(both)
    assert copy.topic == UNROUTABLE_DEAD_KEY and copy.message_id.startswith("sha256:") and len(copy.message_id) == 71
    assert said is not None and "the topic is 307 bytes" in said and "the message id is 256 bytes" in said
    assert (copy.payload, copy.aggregate_id, copy.id) == (both.payload, both.aggregate_id, both.id)
