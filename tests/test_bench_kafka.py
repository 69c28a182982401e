"""``bench.kafka``'s in-process measurements against a real Kafka-protocol broker (Tansu): a
small run of each, so that a change to the publisher's internals the bench reaches into
(``KafkaPublisher._await``) breaks a test rather than the next benchmark run."""

from __future__ import annotations

from pathlib import Path

from kafka_support import tansu_or_skip


def test_the_publishing_path_and_the_raw_loops_measure_every_event(tmp_path: Path) -> None:
    tansu_or_skip()
    from bench.kafka import Broker, run_publisher, run_raw

    broker = Broker(tmp_path)
    try:
        path = run_publisher(broker, 301, 10, partitions=3, batch_size=100)
        raw = run_raw(broker, 301, 10, partitions=3, wait_every=100)  # the first one warms up, unmeasured
    finally:
        broker.stop()
    assert path["delivered"] == path["events"] == 300
    assert path["wait_ms_per_batch"] > 0 and path["us_per_event_besides_wait"] > 0
    assert raw["delivered"] == raw["events"] == 300 and not raw["errors"]
