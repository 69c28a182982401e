"""The outbox table of a bench run, on the run's engine (``Run.engine``; what differs per
engine: ``bench.engines``): create, load (one transaction of realistic events: ``COPY`` on
PostgreSQL), count and drop."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime
from typing import Any

from .engines import engine, query
from .services import Run


def pg_connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=False)


def connect(run: Run) -> Any:
    """A connection to the run's database, autocommit off (``bench.engines``)."""
    return engine(run.engine).connect(run.database_url)


def _write(run: Run, *statements: str) -> None:
    """``statements`` in one transaction on the run's database."""
    spec = engine(run.engine)
    with closing(connect(run)) as conn:
        spec.begin(conn)
        for statement in statements:
            query(conn, statement)
        conn.commit()


def create_table(run: Run) -> None:
    from outbox.storage.store import OutboxStore

    store = OutboxStore(run.database_url, table=run.table)
    try:
        store.migrate()
    finally:
        store.close()


def drop_table(run: Run) -> None:
    # The holders table too: docs/internals.md, "Lost workers".
    _write(run, f"DROP TABLE IF EXISTS {run.table}", f"DROP TABLE IF EXISTS {run.table}_holders")


def truncate_table(run: Run) -> None:
    _write(run, engine(run.engine).truncate(run.table))


def aggregate_name(i: int) -> str:
    return f"agg-{i:03d}"


def make_event(n: int, aggregate: str, blob: str | None = None) -> Any:
    """A realistic event: ~200 bytes of JSON payload, two caller headers; with ``blob``, the
    payload also carries that string (the memory phase's large events)."""
    from outbox.domain.events import prepare_event

    payload = {"orderId": aggregate, "n": n, "state": "confirmed", "amount": "129.90",
               "currency": "EUR", "lines": [{"sku": f"SKU-{n % 97:05d}", "qty": 1 + n % 3}],
               "note": "benchmark event with a payload of typical size"}
    if blob is not None:
        payload["attachment"] = blob
    return prepare_event(topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                         payload=payload, headers={"x-tenant": "acme", "x-source": "bench"})


def claimed_messages(events: int, aggregates: int, topic: str | None = None,
                     lease: str | None = None) -> list[Any]:
    """The events of a backlog (``load_backlog``'s; ids 1..n) as the relay claims them, for
    the publisher benchmarks: ``topic`` instead of ``make_event``'s, ``lease`` on every
    message (default: a fresh one each)."""
    from outbox.core.model import OutboxMessage

    now = datetime.now(UTC)
    out = []
    for n in range(events):
        e = make_event(n, aggregate_name(n % aggregates))
        out.append(OutboxMessage(id=n + 1, message_id=e.message_id, topic=topic or e.topic,
                                 aggregate_type=e.aggregate_type, aggregate_id=e.aggregate_id,
                                 partition_key=e.partition_key, payload=e.payload_json,
                                 headers=json.loads(e.headers_json), trace_id=None, attempts=0, created_at=now,
                                 lease=lease or uuid.uuid4().hex))
    return out


def random_blob(size: int) -> str:
    """``size`` characters of base64 text from random bytes: JSON needs no escaping for it and
    PostgreSQL's TOAST compression gains little, like a real attachment."""
    import base64

    return base64.b64encode(os.urandom(size * 3 // 4 + 3)).decode("ascii")[:size]


def backlog_rows(events: int, aggregates: int, big_every: int = 0, big_bytes: int = 0) -> Iterator[tuple[Any, ...]]:
    """The backlog's rows (``engines.LOAD_COLUMNS``): ``make_event`` round-robin over
    ``aggregates``; with ``big_every`` > 0, every ``big_every``-th payload about ``big_bytes``."""
    blob = random_blob(max(0, big_bytes - 300)) if big_every > 0 else None
    for n in range(events):
        big = blob if big_every > 0 and n % big_every == big_every - 1 else None
        e = make_event(n, aggregate_name(n % aggregates), big)
        yield (e.message_id, e.topic, e.aggregate_type, e.aggregate_id, e.partition_key, e.payload_json,
               e.headers_json, e.trace_id)


def load_backlog(run: Run, events: int, aggregates: int, big_every: int = 0,
                 big_bytes: int = 0) -> dict[str, list[int]]:
    """Insert ``events`` rows round-robin over ``aggregates`` in ONE transaction (PostgreSQL:
    COPY; elsewhere ``executemany`` in chunks), so the
    whole backlog becomes visible at once. Returns the expected per-aggregate id order.
    With ``big_every`` > 0, every ``big_every``-th event carries a payload of about
    ``big_bytes`` bytes (the rest stay ~200 bytes)."""
    spec = engine(run.engine)
    with closing(connect(run)) as conn:
        spec.begin(conn)
        spec.load(conn, run.table, backlog_rows(events, aggregates, big_every, big_bytes))
        # Read before the commit: a relay already running claims rows as soon as they are
        # visible, and those would be missing from the expected order (then reported as
        # "unexpected" arrivals although nothing was out of order).
        ids = query(conn, f"SELECT id, aggregate_id FROM {run.table} ORDER BY id")
        conn.commit()
        for statement in spec.analyze(run.table):
            query(conn, statement)
            conn.commit()
        spec.flush(conn)  # flush the load now, so its writeback does not land in the measurement
    os.sync()
    expected: dict[str, list[int]] = {}
    for outbox_id, aggregate in ids:
        expected.setdefault(aggregate, []).append(int(outbox_id))
    return expected


def id_range(expected: dict[str, list[int]]) -> str:
    """``first..last`` of the ids of a load (``load_backlog``'s expected order), for logs."""
    ids = [i for per_aggregate in expected.values() for i in per_aggregate]
    return f"{min(ids)}..{max(ids)}"


def _read(run: Run, text: str) -> list[tuple[Any, ...]]:
    with closing(connect(run)) as conn:
        rows = query(conn, text)
        conn.commit()
    return rows


def status_counts(run: Run) -> dict[int, int]:
    rows = _read(run, f"SELECT status, COUNT(*) FROM {run.table} GROUP BY status")
    return {int(s): int(c) for s, c in rows}


def rows_claimed(conn: Any, run: Run) -> int:
    """Rows claimed (leased, status 1) now, read on ``conn`` (``connect(run)``) in a
    transaction of its own."""
    try:
        n = query(conn, f"SELECT COUNT(*) FROM {run.table} WHERE status = 1")[0][0]
        conn.commit()
    except BaseException:
        conn.rollback()  # so the next read does not find an aborted transaction
        raise
    return int(n)


def claimable(conn: Any, run: Run) -> bool:
    """Whether a claim could take a chain now: the first open row of some aggregate is pending
    (its head is free). Read on ``conn`` in a transaction of its own.

    The aggregates are walked one index probe each (a recursive "skip scan" over the
    ``(aggregate_id, id)`` index of open rows), stopping at the first free head: the sampler
    runs this every second beside the drain it measures, so it must cost the database next
    to nothing. (A row-by-row NOT EXISTS probe cost PostgreSQL 12 s per sample over one
    aggregate of 20,000 rows: docs/benchmarks.md, "The sampler's own cost".) The backlog has no
    NULL aggregate ids, which this walk would not see."""
    t = run.table
    try:
        rows = query(conn, f"WITH RECURSIVE aggs(a) AS (SELECT MIN(aggregate_id) FROM {t} WHERE processed_at IS NULL "
                           f"UNION ALL SELECT (SELECT MIN(aggregate_id) FROM {t} WHERE processed_at IS NULL "
                           "AND aggregate_id > aggs.a) FROM aggs WHERE aggs.a IS NOT NULL) "
                           f"SELECT 1 FROM aggs WHERE a IS NOT NULL AND (SELECT status FROM {t} WHERE aggregate_id = aggs.a "
                           "AND processed_at IS NULL ORDER BY id LIMIT 1) = 0 LIMIT 1")
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return bool(rows)


def lease_recovered(run: Run) -> int:
    """Rows that needed a second delivery (attempts > 0): a lost task, recovered by the lease."""
    return int(_read(run, f"SELECT COUNT(*) FROM {run.table} WHERE attempts > 0")[0][0])


def wait_all_done(run: Run, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = status_counts(run)
        if set(counts) <= {2} or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)
