"""``outbox pipeline replay``: archived events enqueued again, in bulk.

The selected events (committed runs of the archive, one row per outbox id, filtered
by topic, aggregate and creation time) are spread over Spark partitions by
``aggregate_id`` and sorted by their original id inside each partition, so every
aggregate's events are enqueued by one task, in their original order. Each task
writes through the store (``OutboxStore`` transactions with its transient-error
retries, the engine's insert columns) in transactions of ``batch`` events.

Every replayed event gets a new message id derived from the original one,
``uuid5(REPLAY_NAMESPACE, original message_id)``. Enqueueing a message id that is
already stored writes nothing, so a re-run, or a run after a crash half-way,
enqueues nothing twice; and because each task commits its aggregates' events in
order, what a crash leaves behind is a prefix of every aggregate, which the re-run
completes in order. The copy carries ``x-outbox-replay-of`` (the original message
id) in its headers, and the original's ``trace_id``.

The rows are validated exactly as ``enqueue`` validates them and written with the
engine's own column list, but a batch at a time rather than one ``enqueue`` call per
row: replay is a bulk load. How a batch is written is the one per-engine part
(``BULK_WRITERS``): ``COPY ... FROM STDIN`` on PostgreSQL, one multi-row INSERT on
MySQL/MariaDB, ``executemany`` elsewhere (SQLite's runs in C; SQL Server's driver
batches it). Each keeps the batch's order, so new ids follow the original order.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from ..core.config import get_settings
from ..domain.events import prepare_event
from ..storage.store import OutboxStore
from .archive import check_table, read_archive
from .common import PipelineError

#: Fixed forever: changing it would make a re-run enqueue everything again.
REPLAY_NAMESPACE = uuid.UUID("6f1c3e1a-9a51-4a47-9d0e-6b0c2a7d5e21")
REPLAY_HEADER = "x-outbox-replay-of"
SAMPLE = 5


def replay_message_id(original: str) -> str:
    return str(uuid.uuid5(REPLAY_NAMESPACE, original))


def select_events(spark: Any, archive: str, *, topic: str | None = None, aggregate_type: str | None = None,
                  aggregate_id: str | None = None, since: datetime | None = None,
                  until: datetime | None = None) -> Any:
    from pyspark.sql import functions as F

    if since and until and since >= until:
        raise PipelineError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
    events = read_archive(spark, archive)
    if topic is not None:
        known = sorted(r["topic"] for r in events.select("topic").distinct().collect())
        if topic not in known:
            raise PipelineError(f"unknown topic {topic!r}: the archive holds "
                                f"{', '.join(known) if known else 'no events'}")
        events = events.where(F.col("topic") == topic)
    if aggregate_type is not None:
        events = events.where(F.col("aggregate_type") == aggregate_type)
    if aggregate_id is not None:
        events = events.where(F.col("aggregate_id") == aggregate_id)
    if since is not None:
        events = events.where(F.col("created_at") >= F.lit(since))
    if until is not None:
        events = events.where(F.col("created_at") < F.lit(until))
    return events.select("id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
                         "payload", "headers", "trace_id")


def existing_sql(table: str, count: int) -> str:
    """Which of ``count`` message ids (``?`` each) are already stored."""
    return f"SELECT message_id FROM {table} WHERE message_id IN ({', '.join('?' * count)})"


def insert_sql(engine: Any) -> str:
    """One event row, columns and values exactly as ``enqueue`` writes them (the
    engine's column list and parameters), ``created_at`` from the database clock."""
    marks = ", ".join("?" * len(engine.INSERT_COLUMNS.split(",")))
    return f"INSERT INTO {engine.table} ({engine.INSERT_COLUMNS}, created_at) VALUES ({marks}, {engine.now})"


def _executemany(engine: Any, cursor: Any, rows: list[list[Any]]) -> None:
    cursor.executemany(engine.sql(insert_sql(engine)), rows)


def _copy(engine: Any, cursor: Any, rows: list[list[Any]]) -> None:
    """PostgreSQL: ``COPY FROM STDIN`` in the batch's order; ``created_at`` is the
    column's default, ``now()``, exactly what the INSERT writes."""
    with cursor.copy(f"COPY {engine.table} ({engine.INSERT_COLUMNS}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


#: A multi-row INSERT stays under this many bytes of values (MariaDB's default
#: ``max_allowed_packet`` is 16 MB; an event's payload is capped by OUTBOX_MAX_PAYLOAD_BYTES).
MULTI_ROW_BYTES = 4 * 2**20


def _multi_row_insert(engine: Any, cursor: Any, rows: list[list[Any]]) -> None:
    """MySQL/MariaDB: one ``INSERT ... VALUES (...), (...)`` per few MB of rows, in the
    batch's order (PyMySQL's own ``executemany`` rewrite cannot take ``created_at``'s
    ``UTC_TIMESTAMP(3)`` and would send one statement per row)."""
    one = "(" + ", ".join(["%s"] * len(engine.INSERT_COLUMNS.split(","))) + f", {engine.now})"
    head = f"INSERT INTO {engine.table} ({engine.INSERT_COLUMNS}, created_at) VALUES "
    chunk: list[list[Any]] = []
    size = 0

    def send() -> None:
        cursor.execute(head + ", ".join([one] * len(chunk)), [v for row in chunk for v in row])
    for row in rows:
        row_size = sum(len(v) for v in row if isinstance(v, str))
        if chunk and size + row_size > MULTI_ROW_BYTES:
            send()
            chunk, size = [], 0
        chunk.append(row)
        size += row_size
    if chunk:
        send()


#: How each engine writes a batch of new rows (default: ``executemany``).
BULK_WRITERS: dict[str, Callable[[Any, Any, list[list[Any]]], None]] = {
    "postgresql": _copy, "mysql": _multi_row_insert,
}


def _enqueue_partition(url: str, table: str, schema: str | None, batch: int, max_payload_bytes: int,
                       crash_after_batches: int | None) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The task body (``mapInArrow``): write this partition's events in order,
    ``batch`` per transaction; yields one record batch (events seen, newly written).

    Each event is validated exactly as ``enqueue`` validates it (``prepare_event``);
    a batch then skips the message ids already stored and writes the rest with the
    engine's bulk writer (``BULK_WRITERS``) in the batch's order, so ids still follow
    the original order. Two replays of the same
    events at the same moment could collide on the unique message id: the losing
    task fails on the duplicate key and Spark's retry finds those rows stored."""
    def run(batches_in: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        store = OutboxStore(url, table=table, schema=schema)
        engine = store.engine
        write = BULK_WRITERS.get(engine.name, _executemany)
        seen = written = batches = 0
        pending: list[Any] = []

        def flush() -> int:
            events = []
            for r in pending:
                headers = json.loads(r["headers"]) if r["headers"] else {}
                headers[REPLAY_HEADER] = r["message_id"]
                events.append(prepare_event(topic=r["topic"], aggregate_type=r["aggregate_type"],
                                            aggregate_id=r["aggregate_id"], payload=json.loads(r["payload"]),
                                            headers=headers, key=r["partition_key"],
                                            message_id=replay_message_id(r["message_id"]),
                                            trace_id=r["trace_id"], max_payload_bytes=max_payload_bytes))

            def work(cursor: Any) -> int:
                engine.begin(cursor)
                ids = [e.message_id for e in events]
                existing = {row[0] for row in engine.execute(cursor, existing_sql(engine.table, len(ids)),
                                                             ids).fetchall()}
                missing = [engine.event_params(e) for e in events if e.message_id not in existing]
                if missing:
                    write(engine, cursor, missing)
                return len(missing)
            return store._run("replay", work)

        try:
            rows = (row for record_batch in batches_in for row in record_batch.to_pylist())
            for row in rows:
                pending.append(row)
                if len(pending) >= batch:
                    seen, written = seen + len(pending), written + flush()
                    pending.clear()
                    batches += 1
                    if crash_after_batches is not None and batches >= crash_after_batches:
                        raise RuntimeError(f"injected crash after {batches} replay batch(es)")
            if pending:
                seen, written = seen + len(pending), written + flush()
        finally:
            store.close()
        yield pa.RecordBatch.from_pydict({"seen": [seen], "written": [written]},
                                         schema=pa.schema([("seen", pa.int64()), ("written", pa.int64())]))
    return run


def run_replay(spark: Any, *, archive: str, target: OutboxStore | None, topic: str | None = None,
               aggregate_type: str | None = None, aggregate_id: str | None = None,
               since: datetime | None = None, until: datetime | None = None, dry_run: bool = False,
               batch: int = 500, partitions: int = 4, progress: Callable[[str], None] | None = None,
               crash_after_batches: int | None = None) -> dict[str, Any]:
    """Replay the selected archived events into ``target``; ``dry_run`` only counts
    them and shows a sample. ``crash_after_batches`` makes each task fail after that
    many committed batches (crash injection for the tests)."""
    say = progress or (lambda message: None)
    if batch < 1:
        raise PipelineError("--batch must be at least 1")
    events = select_events(spark, archive, topic=topic, aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                           since=since, until=until).cache()
    try:
        counts = {r["topic"]: int(r["count"]) for r in events.groupBy("topic").count().orderBy("topic").collect()}
        total = sum(counts.values())
        sample = [{"id": r["id"], "topic": r["topic"], "aggregate": f"{r['aggregate_type']}/{r['aggregate_id']}",
                   "message_id": r["message_id"], "new_message_id": replay_message_id(r["message_id"])}
                  for r in events.orderBy("id").limit(SAMPLE).collect()]
        result: dict[str, Any] = {"dry_run": dry_run, "events": total, "per_topic": counts, "sample": sample,
                                  "written": 0, "already_present": 0}
        if dry_run or total == 0:
            return result
        if target is None:
            raise PipelineError("no target database to replay into")
        check_table(target)
        say(f"replaying {total} event(s) into {target.engine.name}:{target.engine.table_name} "
            f"(new message ids uuid5 of the originals)")
        parts = (events.repartition(partitions, "aggregate_id").sortWithinPartitions("id")
                 .mapInArrow(_enqueue_partition(target.url, target.engine.table_name, target.engine.schema,
                                                batch, get_settings().max_payload_bytes, crash_after_batches),
                             "seen BIGINT, written BIGINT")
                 .collect())
        result["written"] = sum(int(p["written"]) for p in parts)
        result["already_present"] = sum(int(p["seen"]) for p in parts) - result["written"]
        say(f"replayed {total} event(s): {result['written']} written, {result['already_present']} already present")
        return result
    finally:
        events.unpersist()


def utc_now() -> datetime:
    return datetime.now(UTC)
