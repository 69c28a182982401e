"""The relay end to end on Kafka: real workers (SQLite outbox) publishing to Tansu
(tests/kafka_support.py) while a consumer reads every partition, on both runners: a Celery
worker running the schedule itself (Celery's broker in memory), and Dramatiq's worker and
scheduler (Redis as its broker). A backlog and later writes, a poison event (too large for
Kafka) dead alone, the broker stopped mid-run and started again: nothing lost, per-aggregate
order of first arrivals held. A worker SIGKILLed: tests/test_kafka_recovery_e2e.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kafka_support import Reader, explain_missing
from relay_e2e_support import base_env, check_order, relay_env, require_relay_services, wait_until

from outbox import Status


def start_relay(procs_factory: Any, runner: Any, tmp_path: Path, outbox: Any, **settings: str) -> Any:
    """Celery: one worker running the schedule itself on Celery's in-memory broker (SQLite's
    default); Dramatiq: a worker and the scheduler on Redis."""
    if runner.name == "celery":
        procs = procs_factory(base_env(outbox, **settings))
        procs.start("w1", "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                    "--without-heartbeat")
        return procs
    require_relay_services()
    procs = procs_factory(relay_env(tmp_path, None, outbox, runner, **settings), runner)
    procs.worker("w1")
    procs.beat()
    return procs


def test_the_relay_reaches_kafka_through_a_broker_restart(tmp_path: Path, sqlite_outbox: Any, tansu: Any,
                                                          runner: Any, procs_factory: Any) -> None:
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
    procs = start_relay(procs_factory, runner, tmp_path, outbox, OUTBOX_PUBLISH_URL=tansu.url,
                        OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_BATCH_SIZE="20", OUTBOX_KAFKA_AUTO_CREATE_TOPICS="1",
                        OUTBOX_KAFKA_MESSAGE_MAX_BYTES="4000", OUTBOX_KAFKA_DELIVERY_TIMEOUT_S="2",
                        OUTBOX_RELAY_BREAKER_S="1")
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
        f"{len(after_ids())} of {total}, "
        f"{explain_missing(tansu.bootstrap, topic, sorted({i for ids in expected.values() for i in ids} - after_ids()), outbox.statuses(), second, tansu)}\n"
        f"{procs.log('w1')[-3000:]}")
    arrivals = before + second.stop()

    check_order(arrivals, expected)  # nothing lost, first arrivals in id order per aggregate
    statuses = outbox.statuses()
    assert wait_until(lambda: all(outbox.statuses()[i] == Status.DONE for ids in expected.values() for i in ids),
                      timeout=15), outbox.status_counts()
    assert statuses.get(poison) == Status.DEAD or wait_until(lambda: outbox.statuses()[poison] == Status.DEAD, 10)
    assert "MSG_SIZE_TOO_LARGE" in (outbox.rows()[poison]["last_error"] or "")
    assert poison not in {a[0] for a in arrivals}
