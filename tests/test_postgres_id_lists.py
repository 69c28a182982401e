"""PostgreSQL: a statement on rows chosen by id (``mark_done``, ``mark_failed``, a release)
is planned for its own ids on every call (docs/internals.md, "Statements on rows by id").

psycopg prepares a statement on a connection once it has run five times, and the server
then keeps a generic plan of it. Made while the table was a few pages (a new table, the
first minutes of a deployment), that plan was a sequential scan, and the connection kept
it while the table grew: in `bench.live` (200 events/s, a new table) 183 of 310 done marks
read the whole table."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from services import POSTGRES_URL

from outbox import enqueue
from outbox.storage.store import OutboxStore

psycopg = pytest.importorskip("psycopg")


def settle_one(store: OutboxStore, how: str) -> None:
    """One event enqueued, claimed and settled (done, or released) by the store."""
    with psycopg.connect(POSTGRES_URL) as conn:
        enqueue(conn, topic="t", aggregate_type="a", aggregate_id=uuid.uuid4().hex, payload={},
                table=store.engine.table_name)
    claim = store.claim(10)
    ids = [m.id for m in claim.messages]
    assert len(ids) == 1
    settled = store.mark_done(ids, claim.lease) if how == "done" else store.release(
        ids, claim.lease, delay=timedelta(hours=1))  # released, it waits: not claimed again here
    assert settled.applied == 1, settled


def table_reads(store: OutboxStore, wanted_updates: int) -> tuple[int, int]:
    """(rows read by sequential scans, rows updated) of the table, once the statistics
    show at least ``wanted_updates`` updates (a backend reports them as it ends)."""
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        deadline = time.monotonic() + 15
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row: Any = conn.execute("SELECT seq_tup_read, n_tup_upd FROM pg_stat_user_tables "
                                    "WHERE relid = %s::regclass", [store.engine.table]).fetchone()
            if row[1] >= wanted_updates or time.monotonic() > deadline:
                return int(row[0]), int(row[1])
            time.sleep(0.1)


GROWN = 20_000


@pytest.mark.parametrize("kind", ["postgresql"])  # engine_support's store, on PostgreSQL
@pytest.mark.parametrize("how", ["done", "release"])
def test_a_settle_started_on_a_small_table_does_not_scan_it_once_it_has_grown(store: OutboxStore, how: str) -> None:
    for _ in range(12):  # prepared after 5 runs; the server's generic plan after 5 more
        settle_one(store, how)
    with psycopg.connect(POSTGRES_URL) as conn:  # the table grows
        conn.execute(f"INSERT INTO {store.engine.table} (message_id, topic, aggregate_type, aggregate_id, payload, "
                     f"status, processed_at) SELECT 'grown-' || g, 't', 'a', 'g' || g, '{{}}', 2, now() "
                     f"FROM generate_series(1, {GROWN}) AS g")
    for _ in range(6):
        settle_one(store, how)
    store.close()  # its session ends, and reports its counts
    read, updated = table_reads(store, 36)  # 18 leases and 18 settles
    assert updated >= 36, updated
    # Each scan of the small table read a few rows; one of the grown table reads them all.
    assert read < GROWN, f"{read} rows read by sequential scans: a {how} (or a claim) read the whole table"
