"""``outbox pipeline replay``: archived events enqueued again, in bulk.

The selected events (committed runs of the archive, one row per outbox id, filtered
by topic, aggregate and creation time) are spread over Spark partitions by
``aggregate_id`` and sorted by their original id inside each partition, so every
aggregate's events are enqueued by one task, in their original order. Each task
writes through the store (``OutboxStore`` transactions with its transient-error
retries, the engine's insert columns) in transactions of ``batch`` events.

Every replayed event gets a new message id derived from the original one,
``uuid5(REPLAY_NAMESPACE, original message_id)``; an archived event that is itself an
earlier replay's copy derives from that copy's original (``replay_root``), so an event
and its copies are replayed once, under one message id. Enqueueing a message id that is
already stored, or that came earlier in the same batch, writes nothing, so a re-run, or
a run after a crash half-way, enqueues nothing twice; and because each task commits its
aggregates' events in order, what a crash leaves behind is a prefix of every aggregate,
which the re-run completes in order. A re-run that selects more than the run before it
(whose stored copies would then precede events of their aggregate not yet written) is
refused before it writes anything (``order_clashes``; docs/pipeline.md, "Replay"). The copy carries ``x-outbox-replay-of`` (the
original message id) in its headers, and the original's ``trace_id``.

The rows are validated exactly as ``enqueue`` validates them (``prepare_batch``: the
same checks, each distinct value once) and written with the engine's own column list, but a batch at a time rather than one ``enqueue`` call per
row: replay is a bulk load. How a batch is written is the one per-engine part
(``BULK_WRITERS``): ``COPY ... FROM STDIN`` on PostgreSQL, one multi-row INSERT on
MySQL/MariaDB, ``executemany`` elsewhere (SQLite's runs in C; on SQL Server mssql-python
sends a batch at once, pyodbc a row at a time: docs/pipeline.md, "Replay"). Each keeps the
batch's order, so new ids follow the original order.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from ..core.config import get_settings
from ..core.errors import EnqueueError
from ..core.model import NewEvent
from ..domain.events import (
    MAX_AGGREGATE,
    MAX_HEADERS_BYTES,
    MAX_KEY,
    MAX_TOPIC,
    MAX_TRACE_ID,
    check_headers,
    check_text,
    dump_json,
    encode_json_string,
    payload_json_problem,
    prepare_event,
    structure_problem,
    text_problem,
)
from ..storage.store import OutboxStore
from .archive import archive_frame, check_table
from .common import PipelineError

#: Fixed forever: changing it would make a re-run enqueue everything again.
REPLAY_NAMESPACE = uuid.UUID("6f1c3e1a-9a51-4a47-9d0e-6b0c2a7d5e21")
REPLAY_HEADER = "x-outbox-replay-of"
SAMPLE = 5


_NAMESPACE_BYTES = REPLAY_NAMESPACE.bytes


def replay_message_id(original: str) -> str:
    """``str(uuid.uuid5(REPLAY_NAMESPACE, original))``, computed without building a
    ``UUID`` (replay derives one per event): SHA-1 of namespace and name, the first 16
    bytes with the version (5) and RFC 4122 variant bits set."""
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + original.encode("utf-8")).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def replay_root(message_id: str, headers: Any) -> str:
    """The message id an archived event's copies derive from: its own, unless the event is
    itself a replay's copy (its ``x-outbox-replay-of`` header names an original whose
    ``replay_message_id`` is the event's message id), whose copies are then the copies of
    that original. So an archive that holds an event and a copy a replay made of it (a
    replay's copies are delivered and archived like any row) replays the event once, under
    the copy's message id, however many replays came before."""
    root = headers.get(REPLAY_HEADER) if isinstance(headers, dict) else None
    return root if isinstance(root, str) and replay_message_id(root) == message_id else message_id


def new_message_id(message_id: str, headers_text: str | None) -> str:
    """The message id replay gives an archived event (its headers as archived, JSON text)."""
    if not headers_text or REPLAY_HEADER not in headers_text:
        return replay_message_id(message_id)
    try:
        headers = json.loads(headers_text)
    except ValueError:
        headers = None
    return replay_message_id(replay_root(message_id, headers))


#: The text columns of an event, as ``prepare_event`` checks them: (column, name in
#: errors, limit, required, what AMQP carries it as).
_TEXT_COLUMNS = (("topic", "topic", MAX_TOPIC, True, "a routing key"),
                 ("aggregate_type", "aggregate_type", MAX_AGGREGATE, True, None),
                 ("aggregate_id", "aggregate_id", MAX_AGGREGATE, True, None),
                 ("partition_key", "key", MAX_KEY, False, None),
                 ("trace_id", "trace_id", MAX_TRACE_ID, False, None))
_REPLAY_MEMBER = "," + encode_json_string(REPLAY_HEADER) + ":"


def prepare_batch(cols: dict[str, list[Any]], max_payload_bytes: int) -> list[NewEvent]:
    """A batch of archived events (``cols``: column name -> values, in order) as new
    events, validated and serialised exactly as ``prepare_event`` does it for each, at a
    fraction of the cost (docs/pipeline.md, "Replay"): each distinct value of a text
    column is checked once, each distinct archived headers text is parsed and checked
    once and the replay header appended to its JSON as text; only the payload is parsed
    and written per event. A row that cannot be enqueued raises ``PipelineError``
    naming its archived id and message id and the problem, before anything of the
    batch is written."""
    ids, originals = cols["id"], cols["message_id"]

    def refuse(i: int, problem: object) -> PipelineError:
        return PipelineError(f"archived event id {ids[i]} (message_id {originals[i]!r}) cannot be replayed: "
                             f"{problem}")

    for i, original in enumerate(originals):
        if not isinstance(original, str):
            raise refuse(i, "the archived message_id is missing")
    for column, name, limit, required, amqp in _TEXT_COLUMNS:
        values = cols[column]
        for value in set(values):
            try:
                check_text(name, value, limit, required=required, amqp_bytes=amqp)
            except EnqueueError as exc:
                raise refuse(values.index(value), exc) from None
    heads: dict[str | None, str | None] = {}  # archived headers text -> its JSON without the closing brace
    for text in set(cols["headers"]):
        try:
            headers = json.loads(text) if text else {}
            if not isinstance(headers, dict):
                raise EnqueueError(f"headers must be a mapping, got {type(headers).__name__}")
            # (a copy that already carries the replay header: each row through prepare_event)
            heads[text] = None if REPLAY_HEADER in headers else dump_json(check_headers(headers), "headers")[:-1]
        except (EnqueueError, ValueError, RecursionError) as exc:
            raise refuse(cols["headers"].index(text), exc) from None
    events = []
    for i, (original, payload_text, headers_text) in enumerate(zip(originals, cols["payload"], cols["headers"])):
        head = heads[headers_text]
        try:
            if head is None:
                headers = json.loads(headers_text) if headers_text else {}
                root = replay_root(original, headers)  # a copy of an earlier replay: its original's
                headers[REPLAY_HEADER] = root
                events.append(prepare_event(
                    topic=cols["topic"][i], aggregate_type=cols["aggregate_type"][i],
                    aggregate_id=cols["aggregate_id"][i], payload=json.loads(payload_text), headers=headers,
                    key=cols["partition_key"][i], message_id=replay_message_id(root),
                    trace_id=cols["trace_id"][i], max_payload_bytes=max_payload_bytes))
                continue
            payload = json.loads(payload_text)
            if not isinstance(payload, (dict, list)):
                raise EnqueueError(f"payload must be a JSON object or array, got {type(payload).__name__}")
            payload_json = dump_json(payload, "payload")
            # what prepare_event checks of a payload, bar its keys (JSON text's are strings)
            problem = payload_json_problem(payload_json, max_payload_bytes) or structure_problem(payload, "payload")
            # the original message id is the replay header's value: checked as a header value is
            if problem is None and not (original.isascii() and "\x00" not in original):
                problem = text_problem(original)
                problem = problem and f"header {REPLAY_HEADER!r}: its value {problem}"
            if problem:
                raise EnqueueError(problem)
            headers_json = (head + _REPLAY_MEMBER if len(head) > 1 else head + _REPLAY_MEMBER[1:]) \
                + encode_json_string(original) + "}"
            if (len(headers_json) if headers_json.isascii() else len(headers_json.encode("utf-8"))) \
                    > MAX_HEADERS_BYTES:
                raise EnqueueError(f"headers are larger than {MAX_HEADERS_BYTES} bytes")
        except (EnqueueError, ValueError, RecursionError) as exc:  # JSON that does not parse, or nests past Python
            raise refuse(i, exc) from None
        # the new message id is a uuid5: 36 ASCII characters, valid by construction
        events.append(NewEvent(replay_message_id(original), cols["topic"][i], cols["aggregate_type"][i],
                               cols["aggregate_id"][i], cols["partition_key"][i], payload_json, headers_json,
                               cols["trace_id"][i]))
    return events


def select_events(spark: Any, archive: str, *, topic: str | None = None, aggregate_type: str | None = None,
                  aggregate_id: str | None = None, since: datetime | None = None,
                  until: datetime | None = None) -> tuple[Any, bool]:
    """The archived events to replay, and whether reading them picked one row per id
    (then they are worth caching: the counts, the sample and the writing read them)."""
    from pyspark.sql import functions as F

    if since and until and since >= until:
        raise PipelineError(f"--since ({since.isoformat()}) must be before --until ({until.isoformat()})")
    events, deduplicated = archive_frame(spark, archive)
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
                         "payload", "headers", "trace_id"), deduplicated


#: Message ids per "already stored?" statement: SQL Server takes at most 2,100 parameters.
EXISTING_CHUNK = 1000


def existing_sql(table: str, count: int) -> str:
    """Which of ``count`` message ids (``?`` each) are already stored."""
    return f"SELECT message_id FROM {table} WHERE message_id IN ({', '.join('?' * count)})"


def _existing_in_list(engine: Any, cursor: Any, ids: list[str]) -> set[str]:
    found: set[str] = set()
    for start in range(0, len(ids), EXISTING_CHUNK):
        chunk = ids[start:start + EXISTING_CHUNK]
        found.update(row[0] for row in engine.execute(cursor, existing_sql(engine.table, len(chunk)), chunk).fetchall())
    return found


def _existing_any(engine: Any, cursor: Any, ids: list[str]) -> set[str]:
    """PostgreSQL: the ids as one array parameter (``= ANY``), a statement the driver
    parses once instead of an ``IN`` list of a thousand placeholders per batch."""
    return {row[0] for row in engine.execute(cursor, f"SELECT message_id FROM {engine.table} "
                                             "WHERE message_id = ANY(?)", [ids]).fetchall()}


#: Which of a batch's message ids are already stored, per engine (default: an ``IN`` list).
EXISTING: dict[str, Callable[[Any, Any, list[str]], set[str]]] = {"postgresql": _existing_any}


def insert_sql(engine: Any) -> str:
    """One event row, columns and values exactly as ``enqueue`` writes them (the
    engine's column list and parameters), ``created_at`` from the database clock."""
    marks = ", ".join("?" * len(engine.INSERT_COLUMNS.split(",")))
    return f"INSERT INTO {engine.table} ({engine.INSERT_COLUMNS}, created_at) VALUES ({marks}, {engine.now})"


def _executemany(engine: Any, cursor: Any, rows: list[list[Any]]) -> None:
    engine.executemany(cursor, insert_sql(engine), rows)


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


def is_integrity_error(exc: BaseException) -> bool:
    """A DB-API ``IntegrityError`` of any driver (a duplicate message id, among others):
    the class every DB-API 2 driver names so."""
    return any(cls.__name__ == "IntegrityError" for cls in type(exc).__mro__)


def _enqueue_partition(url: str, table: str, schema: str | None, batch: int, max_payload_bytes: int,
                       crash_after_batches: int | None) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The task body (``mapInArrow``): write this partition's events in order,
    ``batch`` per transaction; yields one record batch (events seen, newly written).

    Each event is validated exactly as ``enqueue`` validates it (``prepare_batch``);
    a batch then skips the message ids already stored and writes the rest with the
    engine's bulk writer (``BULK_WRITERS``) in the batch's order, so ids still follow
    the original order. Two replays of the same events at the same moment (or one
    message id archived under two ids in two tasks' aggregates) can collide on the
    unique message id, each having checked before the other committed: the batch that
    fails on it is run once more, and its check then finds those rows stored (``local[*]``
    never retries a task; docs/pipeline.md, "Replay")."""
    def run(batches_in: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        store = OutboxStore(url, table=table, schema=schema)
        engine = store.engine
        write = BULK_WRITERS.get(engine.name, _executemany)
        existing_of = EXISTING.get(engine.name, _existing_in_list)
        seen = written = batches = 0

        def flush(rows: Any) -> int:
            events = prepare_batch({name: rows.column(name).to_pylist() for name in rows.column_names},
                                   max_payload_bytes)

            def work(cursor: Any) -> int:
                engine.begin(cursor)
                # Stored already, or earlier in this batch (one message id under two archived
                # ids: an event and a replay's copy of it, or a message id enqueued again once
                # its first row had left the table): written once, as enqueue stores one row.
                taken = existing_of(engine, cursor, [e.message_id for e in events])
                missing = []
                for e in events:
                    if e.message_id not in taken:
                        taken.add(e.message_id)
                        missing.append(engine.event_params(e))
                if missing:
                    write(engine, cursor, missing)
                return len(missing)
            try:
                return store._run("replay", work)
            except Exception as exc:
                if not is_integrity_error(exc):
                    raise
            return store._run("replay", work)  # another writer committed some of them since the check

        try:
            pending: list[Any] = []  # record batches not written yet, ``buffered`` rows
            buffered = 0
            for record_batch in batches_in:
                pending.append(record_batch)
                buffered += record_batch.num_rows
                while buffered >= batch:
                    rows = pa.Table.from_batches(pending)
                    seen, written = seen + batch, written + flush(rows.slice(0, batch))
                    pending, buffered = rows.slice(batch).to_batches(), buffered - batch
                    batches += 1
                    if crash_after_batches is not None and batches >= crash_after_batches:
                        raise RuntimeError(f"injected crash after {batches} replay batch(es)")
            if buffered:
                seen, written = seen + buffered, written + flush(pa.Table.from_batches(pending))
        finally:
            store.close()
        yield pa.RecordBatch.from_pydict({"seen": [seen], "written": [written]},
                                         schema=pa.schema([("seen", pa.int64()), ("written", pa.int64())]))
    return run


#: The columns the order check reads (``_stored_flags``): no payload.
ORDER_CHECK_COLUMNS = ("id", "message_id", "headers", "aggregate_type", "aggregate_id")

#: What the order check's task yields for each archived row (``_stored_flags``).
STORED_FLAGS = "id BIGINT, aggregate_type STRING, aggregate_id STRING, new_message_id STRING, stored BOOLEAN"


def _stored_flags(url: str, table: str, schema: str | None) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The order check's task body (``mapInArrow``): each archived row with its new message
    id and whether the target holds it, a record batch out per record batch in, one
    "already stored?" lookup each. Nothing is kept from one batch to the next (the order
    itself is judged by Spark: ``order_clashes``), so the Python worker holds one batch
    whatever its partition's size (docs/pipeline.md, "Replay")."""
    def run(batches_in: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        store = OutboxStore(url, table=table, schema=schema)
        engine = store.engine
        existing_of = EXISTING.get(engine.name, _existing_in_list)

        def stored_of(ids: list[str]) -> Callable[[Any], set[str]]:
            return lambda cursor: existing_of(engine, cursor, ids)
        try:
            for record_batch in batches_in:
                new_ids = [new_message_id(m, h) for m, h in zip(record_batch.column("message_id").to_pylist(),
                                                                 record_batch.column("headers").to_pylist())]
                taken = store._run("replay check", stored_of(new_ids))
                yield pa.RecordBatch.from_arrays(
                    [record_batch.column("id").cast(pa.int64()), record_batch.column("aggregate_type"),
                     record_batch.column("aggregate_id"), pa.array(new_ids, pa.string()),
                     pa.array([new_id in taken for new_id in new_ids], pa.bool_())],
                    names=["id", "aggregate_type", "aggregate_id", "new_message_id", "stored"])
        finally:
            store.close()
    return run


def order_clashes(events: Any, target: OutboxStore, partitions: int = 4) -> list[Any]:
    """The aggregates whose events already in ``target`` do not all come before those not
    yet there (writing these would put them after later events of their aggregate): at most
    ``SAMPLE``, the earliest first, each with ``aggregate_id``, ``missing`` (its first
    archived id not stored) and ``stored`` (``id`` and ``aggregate_type`` of the first
    later one stored). Python only flags each row stored or not (``_stored_flags``); the
    rest is Spark's, grouped by aggregate in the JVM, which spills: no Python worker keeps
    a partition's ids (docs/pipeline.md, "Replay"). At most ``partitions`` tasks ask the
    target, as the write's: one per split of the archive's files asked with every
    executor core at once, a connection each (found in review)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    flags = (events.select(*ORDER_CHECK_COLUMNS).coalesce(partitions)
             .mapInArrow(_stored_flags(target.url, target.engine.table_name, target.engine.schema), STORED_FLAGS))
    id_, stored = F.col("id"), F.col("stored")
    # Per aggregate_id alone, as the write's partitions and the relay's order are
    # (CONTRACT.md: "Per aggregate_id"); by type too, a re-run after an --aggregate-type
    # replay passed (found in review).
    aggregate = Window.partitionBy("aggregate_id")
    # A second archived row of a stored event (its new message id again in the aggregate:
    # the write skips it) does not count, only the first.
    event = Window.partitionBy("aggregate_id", "new_message_id")
    return (flags.withColumn("missing", F.min(F.when(~stored, id_)).over(aggregate))
            .withColumn("first", F.min(id_).over(event))
            .where(stored & (id_ == F.col("first")) & (id_ > F.col("missing")))
            .groupBy("aggregate_id", "missing")
            .agg(F.min(F.struct(id_, F.col("aggregate_type"))).alias("stored"))
            .orderBy("missing").limit(SAMPLE).collect())


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
    events, deduplicated = select_events(spark, archive, topic=topic, aggregate_type=aggregate_type,
                                         aggregate_id=aggregate_id, since=since, until=until)
    if deduplicated:
        events = events.cache()
    try:
        # Sorted here, not by Spark: a topic's row each, and a sort there is a job of its own.
        per_topic = sorted(events.groupBy("topic").count().collect(),
                           key=lambda r: (r["topic"] is not None, r["topic"] or ""))  # as ORDER BY topic
        counts = {r["topic"]: int(r["count"]) for r in per_topic}
        total = sum(counts.values())
        sample = [{"id": r["id"], "topic": r["topic"], "aggregate": f"{r['aggregate_type']}/{r['aggregate_id']}",
                   "message_id": r["message_id"], "new_message_id": new_message_id(r["message_id"], r["headers"])}
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
        clashes = order_clashes(events, target, partitions)
        if clashes:
            first, stored = clashes[0], clashes[0]["stored"]
            more = f", and {len(clashes) - 1} other aggregate(s) at least" if len(clashes) > 1 else ""
            raise PipelineError(
                f"replay would write events after later ones of their aggregate: the target holds the copy of "
                f"{stored['aggregate_type']}/{first['aggregate_id']}'s archived id {stored['id']} but not of its "
                f"earlier archived id {first['missing']}{more} (an earlier replay selected fewer events: another "
                "--topic, a later --since, ...); nothing was written. To replay them anyway, after what is there, select only "
                "the events not replayed yet (e.g. the other --topic)")
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
