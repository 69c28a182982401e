"""MySQL/MariaDB: a claim reads open rows only, however many done rows the table keeps
(docs/internals.md, "Claims on MySQL and MariaDB read open rows only"). Counted with the
server's own handler counters, not timed: the rows a claim reads stay near its window while
the done rows before it grow twentyfold."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from services import MYSQL_URL, require

from outbox.storage.store import OutboxStore

pytest.importorskip("pymysql")


@pytest.fixture
def store() -> Iterator[OutboxStore]:
    require("MariaDB", "127.0.0.1", 3306)
    store = OutboxStore(MYSQL_URL, table=f"open_rows_{uuid.uuid4().hex[:8]}")
    store.migrate()
    yield store
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
        store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.holders}")
    store.close()


DIGITS = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 " \
         "UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)"


def add_rows(store: OutboxStore, done: int, pending: int, aggregates: int) -> None:
    """``done`` rows already relayed, then ``pending`` rows, round-robin over the aggregates
    (at most 10,000 in all)."""
    t = store.engine.table
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"""
            INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload, headers,
                             status, created_at, processed_at)
            SELECT CONCAT('m-', UUID()), 'orders.created', 'order', CONCAT('a', n % ?), '{{}}', '{{}}',
                   CASE WHEN n <= ? THEN 2 ELSE 0 END, UTC_TIMESTAMP(3),
                   CASE WHEN n <= ? THEN UTC_TIMESTAMP(3) END
            FROM (SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS n
                  FROM {DIGITS} a CROSS JOIN {DIGITS} b CROSS JOIN {DIGITS} c CROSS JOIN {DIGITS} e) seq
            WHERE n <= ? ORDER BY n""", [aggregates, done, done, done + pending])
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"ANALYZE TABLE {t}")


def rows_read_by_a_claim(store: OutboxStore) -> int:
    """Index and table rows the server read for one claim of 50, in its own transaction."""
    def reads(cursor: Any) -> int:
        rows = store.engine.execute(cursor, "SHOW SESSION STATUS LIKE 'Handler_read%'").fetchall()
        return sum(int(value) for _, value in rows)

    with store.transaction() as cursor:
        before = reads(cursor)
        claimed = store.engine.claim(cursor, 50, uuid.uuid4().hex, 60_000, 10)
        after = reads(cursor)
        cursor.connection.rollback()
    assert len(claimed) == 50
    return after - before


def test_a_claim_reads_open_rows_however_many_done_rows_are_kept(store: OutboxStore) -> None:
    add_rows(store, done=0, pending=8400, aggregates=20)  # the statistics see only open rows
    fresh = rows_read_by_a_claim(store)
    with store.transaction() as cursor:  # then 8,000 of them are relayed
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 2, processed_at = UTC_TIMESTAMP(3) "
                             "ORDER BY id LIMIT 8000")
    with_history = rows_read_by_a_claim(store)
    # The window (100 rows), the first open row per aggregate, the locks, the lease and the
    # rows read back: about the same with 8,000 done rows before them as with none.
    assert with_history < 2 * fresh + 200, (fresh, with_history)


def rows_read_by(store: OutboxStore, call: Any) -> int:
    """Index and table rows the server read for ``call()`` on this thread's connection."""
    def reads() -> int:
        with store.transaction() as cursor:
            return sum(int(value) for _, value in store.engine.execute(
                cursor, "SHOW SESSION STATUS LIKE 'Handler_read%'").fetchall())

    before = reads()
    call()
    return reads() - before


def test_the_heartbeats_counts_read_open_rows_however_many_done_rows_are_kept(store: OutboxStore) -> None:
    """The heartbeat's counts (``stats(closed=False)``, every worker every 300 s) read the open
    rows on ``claim_ready``, as the gauges do: the age of the oldest open row was read by a
    scan of the whole table, every done row kept for the retention (1,391,059 rows per beat at
    1.4 million rows on MariaDB; found in review)."""
    add_rows(store, done=0, pending=8400, aggregates=20)  # the statistics see only open rows
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 2, processed_at = UTC_TIMESTAMP(3) "
                             "ORDER BY id LIMIT 8000")
    read = rows_read_by(store, lambda: store.stats(closed=False))
    # The 400 open rows, read by each of the two statements (806 here); the table is 8,400 rows.
    assert read < 3 * 400, read
