"""The publisher's fast path (``outbox.publisher.frames``, docs/publisher.md "Fast path"):
the frames it writes are the bytes py-amqp writes for the same message, and what a real
RabbitMQ consumer receives is what the kombu ``Producer.publish`` path delivered before."""

from __future__ import annotations

import json
from typing import Any

import amqp
import pytest
from amqp.method_framing import frame_writer
from amqp.serialization import dumps
from kombu import Connection, Producer
from publisher_support import make_message, raw_body
from services import AMQP_URL

from outbox.core.model import OutboxMessage
from outbox.publisher import KombuPublisher, build_headers, encode_body
from outbox.publisher.frames import PublishFrames

UNICODE_HEADERS = {"tenant": "acmé ✓", "名前": "値", "x-emoji": "🚀"}
EVERY_VALUE = {"s": "v", "i": 7, "neg": -2147483647, "min32": -2147483648, "big": 2**40, "yes": True, "no": False,
               "none": None, "f": 2.5, "topic": "caller's, overwritten"}


def messages() -> list[OutboxMessage]:
    """Unicode in headers and payload, every header value type, a reserved name the caller
    also used, a traceparent, an empty-ish payload (``{}``, ``[]``), bodies around and far
    above ``frame_max`` (131,072 bytes by default)."""
    big = json.dumps({"blob": "é" * 200_000})  # 400 KB of UTF-8: four body frames
    edge = json.dumps({"pad": "x" * (131_072 - 8 - 11)})  # exactly frame_max - 8 bytes: one body frame
    return [make_message(1, "orders.créé", headers=UNICODE_HEADERS, payload='{"ü":"ß","n":[1,2.5,null]}'),
            make_message(2, headers=EVERY_VALUE, trace_id="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            make_message(3, payload="{}"),
            make_message(4, payload="[]", partition_key="p-4"),
            make_message(5, payload=big, headers={"x-size": "big"}),
            make_message(6, payload=edge),
            make_message(7, payload=edge[:-1] + ' }')]  # frame_max - 7 bytes: two body frames


# -- the bytes ---------------------------------------------------------------------------------

class _Sink:
    """Collects what py-amqp's frame writer writes."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))


class _Tuned:
    """What py-amqp's frame writer reads from its connection."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0


def py_amqp_bytes(message: OutboxMessage, headers: dict[str, Any], exchange: str, mandatory: bool,
                  frame_max: int) -> bytes:
    """What ``Channel.basic_publish`` writes for the message kombu's ``Producer.publish``
    built in the previous path (the same properties, checked against a capture)."""
    sink = _Sink()
    write = frame_writer(_Tuned(frame_max), sink)
    content = amqp.Message(encode_body(message), priority=0, content_type="application/json",
                           content_encoding="utf-8", application_headers=headers, delivery_mode=2,
                           message_id=message.message_id)
    write(1, 3, (60, 40), dumps("Bssbb", (0, exchange, message.topic, mandatory, False)), content)
    return b"".join(sink.written)


@pytest.mark.parametrize("frame_max", [131_072, 4096])
@pytest.mark.parametrize("mandatory", [True, False])
def test_the_frames_are_the_bytes_py_amqp_writes(frame_max: int, mandatory: bool) -> None:
    frames = PublishFrames(3, frame_max, "outbox-é", mandatory)
    for message in messages():
        headers = build_headers(message)
        mine = b"".join(frames.publish(message.topic, headers, message.message_id, encode_body(message)))
        assert mine == py_amqp_bytes(message, headers, "outbox-é", mandatory, frame_max), message.id


def test_values_the_fast_encoder_does_not_know_go_through_py_amqp() -> None:
    """Nested tables and arrays (not what the store holds, but a caller's dict could): the
    whole table is py-amqp's own encoding."""
    message = make_message(1, headers={"nested": {"a": [1, "x", None]}, "list": [True, 2.5]})
    headers = build_headers(message)
    mine = b"".join(PublishFrames(3, 131_072, "ex", True).publish(message.topic, headers, message.message_id,
                                                                   encode_body(message)))
    assert mine == py_amqp_bytes(message, headers, "ex", True, 131_072)


def test_what_py_amqp_cannot_encode_fails_the_same_way() -> None:
    """A short string over 255 bytes raises ``struct.error`` before anything is returned,
    as py-amqp's encoder does (the publisher then makes it POISON for that event alone)."""
    import struct

    frames = PublishFrames(3, 131_072, "ex", True)
    for topic, headers in (("t." + "é" * 200, {}), ("t", {"n" * 300: 1})):
        with pytest.raises(struct.error):
            frames.publish(topic, headers, "m", b"{}")
        with pytest.raises(struct.error):
            py_amqp_bytes(make_message(1, topic, headers=headers), headers, "ex", True, 131_072)


# -- what a consumer receives -------------------------------------------------------------------

def previous_path(channel: Any, message: OutboxMessage, headers: dict[str, Any], exchange: str,
                  mandatory: bool) -> None:
    """``KombuPublisher._send`` before the fast path: kombu's ``Producer.publish``."""
    Producer(channel, auto_declare=False).publish(
        encode_body(message), exchange=exchange, routing_key=message.topic, delivery_mode=2, mandatory=mandatory,
        content_type="application/json", content_encoding="utf-8", headers=headers,
        message_id=message.message_id, timeout=15, retry=False)


def received(message: Any) -> tuple[Any, ...]:
    """Everything a consumer sees of a message, but the delivery tag and the redelivered flag."""
    return (raw_body(message), message.properties, message.delivery_info["exchange"],
            message.delivery_info["routing_key"])


def test_rabbitmq_receives_from_the_fast_path_what_the_previous_path_delivered(broker: dict[str, Any]) -> None:
    sent = messages()
    # Confirmed, so every message of the previous path is queued before ``live`` reads the queue.
    with Connection(AMQP_URL, connect_timeout=3, transport_options={"confirm_publish": True}) as conn:
        channel = conn.channel()
        for message in sent:
            previous_path(channel, message, build_headers(message), broker["exchange"], mandatory=True)
        before = broker["live"]()
        with KombuPublisher(AMQP_URL, broker["exchange"], dead_letter_exchange=broker["dead"]) as publisher:
            results = publisher.publish_chains([[m] for m in sent])  # one wave
            assert all(r.ok for r in results) and [r.published for r in results] == [(m.id,) for m in sent]
            assert publisher.publish_dead(sent[0], "poison: an example") is None
        after = broker["live"]()
        headers = build_headers(sent[0])
        headers["x-outbox-error"] = "poison: an example"
        previous_path(channel, sent[0], headers, broker["dead"], mandatory=False)
        dead_after, dead_before = broker["dead_letters"]()
    assert len(before) == len(after) == len(sent)
    by_id = {m.headers["outbox_id"]: received(m) for m in after}
    for old in before:
        assert by_id[old.headers["outbox_id"]] == received(old)
    assert after[0].headers["名前"] == "値" and after[0].delivery_info["routing_key"] == "orders.créé"
    assert raw_body(after[4]) == encode_body(sent[4]) and len(raw_body(after[4])) > 131_072
    assert raw_body(after[2]) == b"{}"
    assert received(dead_after) == received(dead_before)


# -- the poison checks' one-pass shortcut ---------------------------------------------------------

def test_the_one_pass_shortcut_never_changes_a_poison_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """``checked_headers`` clears a plain event in one pass (``_plainly_fine``) before the
    full checks: on random events, with every edge it must leave to them (NaN, infinities,
    integers past 64 bits, names and topics past 63 characters, nested values, tables near
    the limit), the verdict and its reason are the full checks' own."""
    import random

    import outbox.publisher.message as message_module
    from outbox.publisher import checked_headers

    rng = random.Random(11)
    values = [0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 1.5, float("nan"), float("inf"), -float("inf"),
              True, False, None, "", "é" * 70, "🚀", "z" * 9000, {"nested": 1}, [1, 2], b"bytes"]
    names = ["k", "n" * 63, "n" * 64, "é" * 63, "é" * 86, "名" * 84, "名" * 86, "message_id", "topic"]
    topics = ["orders.created", "t" * 63, "é" * 64, "é" * 128]
    cases = []
    for i in range(600):
        headers = {f"{rng.choice(names)}{j if rng.random() < 0.8 else ''}": rng.choice(values)
                   for j in range(rng.randint(0, 12))}
        cases.append(make_message(i, rng.choice(topics), headers=headers))
    cases.append(make_message(0, headers={f"k{i}": "v" * 7 for i in range(2000)}))  # bound over, table under
    cases.append(make_message(0, headers={f"k{i}": "v" * 60 for i in range(2000)}))  # over for real
    shortcut = sum(message_module._plainly_fine(m, build_headers(m)) for m in cases)
    fast = [checked_headers(m) for m in cases]
    monkeypatch.setattr(message_module, "_plainly_fine", lambda message, headers: False)
    assert fast == [checked_headers(m) for m in cases]
    assert shortcut > 20 and sum(failure is not None for _, failure in fast) > 100  # both ways are exercised
