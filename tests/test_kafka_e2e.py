"""The relay end to end on Kafka: a real Celery worker (SQLite outbox, the worker running the
schedule itself) publishing to Tansu (tests/kafka_support.py) while a consumer reads. A
backlog and live writes, a poison event (too large for Kafka) dead alone, the broker stopped
mid-run and started again: nothing lost, per-aggregate order of first arrivals held."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from outbox import Status

from relay_e2e_support import base_env, check_order, wait_until


class Reader(threading.Thread):
    """Reads every partition of ``topic`` from the start (assigned, not joined) until stopped."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.arrivals: list[tuple[int, str, Any]] = []
        self._done = threading.Event()

    def run(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"e2e-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        try:
            partitions: list[int] = []
            while not partitions and not self._done.is_set():
                try:
                    found = consumer.list_topics(self.topic, timeout=2).topics.get(self.topic)
                    partitions = sorted(found.partitions) if found is not None and found.error is None else []
                except Exception:  # noqa: BLE001 - the broker may be down or the topic not made yet
                    pass
                if not partitions:
                    time.sleep(0.2)
            consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
            while not self._done.is_set():
                message = consumer.poll(0.2)
                if message is not None and message.error() is None:
                    headers = {k: v.decode() for k, v in message.headers() or []}
                    self.arrivals.append((int(headers["outbox_id"]), headers["aggregate_id"],
                                          json.loads(message.value())))
        finally:
            consumer.close()

    def stop(self) -> list[tuple[int, str, Any]]:
        self._done.set()
        self.join(10)
        return self.arrivals


def test_celery_worker_relays_to_kafka_through_a_broker_restart(tmp_path: Path, sqlite_outbox: Any, tansu: Any,
                                                               procs_factory: Any) -> None:
    outbox = sqlite_outbox
    topic = "orders"
    expected: dict[str, list[int]] = {}
    aggregates = [f"agg-{i}" for i in range(6)]

    def write(rounds: range) -> None:
        with outbox.writer() as conn:
            for n in rounds:
                for aggregate in aggregates:
                    expected.setdefault(aggregate, []).append(outbox.add(conn, aggregate, n, topic=topic))
            conn.commit()

    write(range(10))  # a backlog
    with outbox.writer() as conn:
        poison = outbox.add(conn, "poisoned", 0, topic=topic, payload={"blob": "x" * 5000})
        conn.commit()
    procs = procs_factory(base_env(outbox, OUTBOX_PUBLISH_URL=tansu.url, OUTBOX_CLAIM_INTERVAL_S="0.2",
                                   OUTBOX_BATCH_SIZE="20", OUTBOX_KAFKA_AUTO_CREATE_TOPICS="1",
                                   OUTBOX_KAFKA_MESSAGE_MAX_BYTES="4000", OUTBOX_KAFKA_DELIVERY_TIMEOUT_S="2",
                                   OUTBOX_RELAY_BREAKER_S="1"))
    procs.start("w1", "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                "--without-heartbeat")
    first = Reader(tansu.bootstrap, topic)
    first.start()
    total = sum(map(len, expected.values()))
    assert wait_until(lambda: len({a[0] for a in first.arrivals}) >= total, timeout=40), (
        f"{len(first.arrivals)} of {total}\n{procs.log('w1')[-3000:]}")

    tansu.stop()  # mid-run: the events written now wait for the broker
    before = first.stop()
    write(range(10, 16))
    time.sleep(3)
    procs.check_alive()
    tansu.start()  # memory storage: an empty broker, the topic is auto-created again
    second = Reader(tansu.bootstrap, topic)
    second.start()
    total = sum(map(len, expected.values()))
    after_ids = lambda: {a[0] for a in before} | {a[0] for a in second.arrivals}  # noqa: E731
    assert wait_until(lambda: len(after_ids()) >= total, timeout=60), (
        f"{len(after_ids())} of {total}\n{procs.log('w1')[-3000:]}")
    arrivals = before + second.stop()

    check_order(arrivals, expected)  # nothing lost, first arrivals in id order per aggregate
    statuses = outbox.statuses()
    assert wait_until(lambda: all(outbox.statuses()[i] == Status.DONE for ids in expected.values() for i in ids),
                      timeout=15), outbox.status_counts()
    assert statuses.get(poison) == Status.DEAD or wait_until(lambda: outbox.statuses()[poison] == Status.DEAD, 10)
    assert "MSG_SIZE_TOO_LARGE" in (outbox.rows()[poison]["last_error"] or "")
    assert poison not in {a[0] for a in arrivals}
