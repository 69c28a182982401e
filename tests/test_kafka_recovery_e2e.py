"""The relay on Kafka when a worker dies, on both runners (Celery and Dramatiq,
tests/runners.py): two workers and the scheduler relay a backlog and live writes over
several aggregates to Tansu (tests/kafka_support.py); one worker is SIGKILLed with its pool
while it holds publish tasks. A consumer reading every partition sees every committed event,
per aggregate in commit order with only duplicates of already-delivered events in between
(at-least-once without reordering: the contract's chain rule), and nothing rolled back.
Celery's and Dramatiq's broker: Redis (OUTBOX_TEST_REDIS_URL); the outbox: SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka_support import Reader, Tansu, create_topic, explain_missing, free_port, tansu_or_skip
from relay_e2e_support import Outbox, Proxy, Writer, check_order, relay_env, require_relay_services, wait_until

from outbox import Status


@pytest.fixture
def far_tansu(tmp_path: Path) -> Iterator[Tansu]:
    """Tansu behind a proxy that delays every reply by 15 ms, advertised at the proxy's
    port so that every client goes through it: a publish task lasts long enough for the
    kill to land while the worker holds leased rows, not between two tasks."""
    binary = tansu_or_skip()
    port = free_port()
    proxy = Proxy(target=("127.0.0.1", port), delay=0.015)
    broker = Tansu(binary, port, tmp_path / "tansu.log", advertised_port=proxy.port)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        proxy.close()


def check_partitions(arrivals: list[tuple[int, str, Any]]) -> None:
    """One aggregate, one partition (its key), so the order read is the broker's order."""
    partitions: dict[str, set[int]] = {}
    for _, aggregate, message in arrivals:
        partitions.setdefault(aggregate, set()).add(message.partition())
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert len({p for ps in partitions.values() for p in ps}) > 1, "every aggregate on one partition"


def test_a_worker_killed_while_publishing_to_kafka_loses_nothing_and_never_reorders(
        tmp_path: Path, sqlite_outbox: Outbox, far_tansu: Tansu, runner: Any, procs_factory: Any) -> None:
    require_relay_services()  # Redis, the runners' broker
    outbox, topic = sqlite_outbox, "orders"
    create_topic(far_tansu.bootstrap, topic, partitions=3)
    aggregates = [f"k-{i}" for i in range(8)]
    writer = Writer(outbox, aggregates, rollback_every=3, pace=0.03, topic=lambda _: topic)
    writer.write(range(10))  # a backlog over every aggregate
    procs = procs_factory(relay_env(tmp_path, None, outbox, runner, OUTBOX_PUBLISH_URL=far_tansu.url,
                                    OUTBOX_BATCH_SIZE="10", OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_CLAIM_TIMEOUT_MS="2000", OUTBOX_RELAY_TASK_ROWS="3",
                                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_S="5"), runner)
    reader = Reader(far_tansu.bootstrap, topic)
    reader.start()
    procs.worker("w1")
    procs.worker("w2")
    procs.beat()
    with writer:  # live writes in a thread of the writer's own, through the kill
        assert wait_until(lambda: len(reader.arrivals) >= 50, timeout=30), procs.log("w1")[-3000:]
        assert wait_until(lambda: bool(procs.tasks_in_hand("w1")), timeout=10, interval=0.005), (
            procs.log("w1")[-3000:])
        procs.kill("w1")  # main process and pool: a machine that died mid-publish
        procs.check_alive()
        wait_until(lambda: False, timeout=1.0)  # writers go on after the kill
    total = len(writer.written)
    arrived = lambda: {a[0] for a in reader.arrivals}  # noqa: E731
    assert wait_until(lambda: len(arrived()) >= total, timeout=40), (
        f"{len(arrived())} of {total} arrived, "
        f"{explain_missing(far_tansu.bootstrap, topic, sorted(set(writer.written) - arrived()), outbox.statuses(), reader, far_tansu)}\n"
        f"{procs.log('w2')[-3000:]}")
    arrivals = reader.stop()

    check_order(arrivals, writer.expected)  # nothing lost, per aggregate a prefix-ordered sequence
    check_partitions(arrivals)
    assert arrived() <= set(writer.written)  # nothing rolled back, nothing else
    attempts = [int(dict(m.headers())["attempt"]) for _, _, m in arrivals]
    assert max(attempts) >= 2, "w1 held nothing when it was killed"  # its rows came back by the lease
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), outbox.status_counts()
    assert len(outbox.statuses()) == total
