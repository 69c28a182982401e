"""``bench.kafka``'s in-process measurements against a real Kafka-protocol broker (Tansu): a
small run of each, so that a change to the publisher's internals the bench reaches into
(``KafkaPublisher._await``) breaks a test rather than the next benchmark run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kafka_support import tansu_or_skip

from bench.kafka import Broker


def test_the_publishing_path_and_the_raw_loops_measure_every_event(tmp_path: Path) -> None:
    tansu_or_skip()
    from bench.kafka import run_publisher, run_raw

    broker = Broker(tmp_path)
    try:
        path = run_publisher(broker, 301, 10, partitions=3, batch_size=100)
        raw = run_raw(broker, 301, 10, partitions=3, wait_every=100)  # the first one warms up, unmeasured
    finally:
        broker.stop()
    assert path["delivered"] == path["events"] == 300
    assert path["wait_ms_per_batch"] > 0 and path["us_per_event_besides_wait"] > 0
    assert raw["delivered"] == raw["events"] == 300 and not raw["errors"]


class _Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[int, int]] = []

    def seek(self, tp: Any) -> None:
        self.seeks.append((tp.partition, tp.offset))


def test_no_skips_goes_back_for_a_hole_drops_what_it_reads_again_and_gives_up_on_a_real_gap() -> None:
    """``bench.tansu.NoSkips`` (pure logic, a stand-in consumer): a message past the next
    offset sends the consumer back to it, once per burst; messages read again are dropped;
    a hole still missing after ``give_up_s`` is stepped over and counted."""
    pytest.importorskip("confluent_kafka")
    from bench.tansu import NoSkips

    consumer = _Consumer()
    order = NoSkips(consumer, "t", give_up_s=0.3)
    taken = [m.offset() for m in [_Message(0, 0), _Message(0, 1), _Message(0, 4), _Message(0, 5)]
             if order.accept(m)]
    assert taken == [0, 1] and consumer.seeks == [(0, 2)]  # one seek for the burst 4, 5
    taken = [m.offset() for m in [_Message(0, 2), _Message(0, 3), _Message(0, 4), _Message(1, 0), _Message(0, 3)]
             if order.accept(m)]
    assert taken == [2, 3, 4, 0] and order.gaps == 0  # the hole came; partition 1 apart; 3 again dropped
    assert not order.accept(_Message(0, 9))  # a new hole (5..8) ...
    time.sleep(0.35)
    assert order.accept(_Message(0, 9)) and order.gaps == 4  # ... given up on after give_up_s
    assert order.expected == {0: 10, 1: 1}


def test_no_skips_seeks_a_real_consumer_back_to_the_offset_it_expects(tmp_path: Path) -> None:
    """On a real consumer of Tansu: assigned past the start (offset 5 of 10), the first
    message read makes NoSkips seek back to 0, and every message then comes once, in order."""
    tansu_or_skip()
    from confluent_kafka import Consumer, Producer, TopicPartition
    from kafka_support import create_topic

    from bench.tansu import NoSkips

    broker = Broker(tmp_path)
    try:
        topic = create_topic(broker.bootstrap, partitions=1)
        producer = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True})
        for i in range(10):
            producer.produce(topic, value=str(i).encode(), partition=0)
        assert producer.flush(10) == 0
        consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "no-skips", "enable.auto.commit": False})
        try:
            consumer.assign([TopicPartition(topic, 0, 5)])
            order, values = NoSkips(consumer, topic), []
            deadline = time.monotonic() + 20
            while len(values) < 10 and time.monotonic() < deadline:
                message = consumer.poll(0.2)
                if message is not None and message.error() is None and order.accept(message):
                    values.append(int(message.value()))
        finally:
            consumer.close()
    finally:
        broker.stop()
    assert values == list(range(10)) and order.seeks >= 1 and order.gaps == 0
