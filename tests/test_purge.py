"""The purge of done rows (``OutboxStore.purge_done``, the relay's ``purge_expired``): it keeps
up with any steady load, its chunks walk the table once per run, and it never takes a row
that is not done and past the retention (docs/relay.md, "Purge")."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from relay_support import run_python

from outbox.domain.events import prepare_event
from outbox.relay.settle import PURGE_RUN_S, purge_budget, purge_expired
from outbox.storage.store import OutboxStore

DAY_MS = 86_400_000


def rows_aged(store: OutboxStore, statuses: list[int], days: float = 10) -> list[int]:
    """One row per status given, in order, each created ``days`` ago; done and dead ones also
    processed then (a row is processed after it is created, by the same database clock)."""
    engine, ids = store.engine, []
    with store.transaction() as cursor:
        for n, _ in enumerate(statuses):
            event = prepare_event(topic="t", aggregate_type="o", aggregate_id=f"a{n % 3}", payload={"n": n})
            ids.append(engine.insert_event(cursor, event))
    with store.transaction() as cursor:
        engine.execute(cursor, f"UPDATE {engine.table} SET created_at = {engine.now_plus_ms()} WHERE id >= ? AND id <= ?",
                       [-int(days * DAY_MS), ids[0], ids[-1]])
        for id_, status in zip(ids, statuses):
            if status in (2, 4):
                engine.execute(cursor, f"UPDATE {engine.table} SET status = ?, processed_at = {engine.now_plus_ms()} "
                               "WHERE id = ?", [status, -int(days * DAY_MS), id_])
            elif status:
                engine.execute(cursor, f"UPDATE {engine.table} SET status = ? WHERE id = ?", [status, id_])
    return ids


def left(store: OutboxStore) -> dict[int, int]:
    with store.transaction() as cursor:
        return {int(r[0]): int(r[1]) for r in store.engine.execute(
            cursor, f"SELECT id, status FROM {store.engine.table}").fetchall()}


def test_a_purge_chunk_starts_where_the_last_ended_and_takes_only_old_done_rows(store: OutboxStore) -> None:
    """Old done rows between dead, pending, claimed, failed and recent done rows, purged two
    at a time: exactly the old done rows go, and each chunk starts after the last id the
    one before it reached (never again from the lowest id, past every dead row)."""
    statuses = [4, 4, 2, 0, 2, 2, 4, 3, 2, 1, 2, 4, 2]
    ids = rows_aged(store, statuses)
    recent = rows_aged(store, [2, 2], days=1)
    starts: list[int] = []
    chunk = store.engine.purge_chunk

    def noting(cursor: Any, older_than_ms: int, batch: int, after: int) -> Any:
        starts.append(after)
        return chunk(cursor, older_than_ms, batch, after)
    store.engine.purge_chunk = noting  # type: ignore[method-assign]

    assert store.purge_done(timedelta(days=7), batch=2) == statuses.count(2)
    kept = {i: s for i, s in zip(ids, statuses) if s != 2} | dict.fromkeys(recent, 2)
    assert left(store) == kept
    if store.engine.name != "mssql":  # one statement there, a seek on (status, processed_at)
        done = [i for i, s in zip(ids, statuses) if s == 2]
        assert starts == [0, *done[1::2]]  # each chunk after the last id of the one before


def test_the_relays_purge_takes_every_row_past_the_retention_however_many(tmp_path: Path) -> None:
    """The relay's purge ran 100 chunks of 1,000 rows and stopped: at the default hourly
    interval, an outbox done at more than about 28 events a second grew for ever. Now it
    deletes until no row past the retention is left (or its time is up)."""
    store = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}")
    store.migrate()
    conn = store.connection()
    conn.execute("BEGIN")
    conn.executemany(f"INSERT INTO {store.engine.table} (message_id, topic, aggregate_type, aggregate_id, payload, "
                     "status, created_at, processed_at) VALUES (?, 't', 'o', 'a', '{}', 2, "
                     "strftime('%Y-%m-%d %H:%M:%f', 'now', '-8 days'), strftime('%Y-%m-%d %H:%M:%f', 'now', '-8 days'))",
                     [(f"m{i}",) for i in range(150_000)])
    conn.execute("COMMIT")
    kept = rows_aged(store, [4, 0, 3]) + rows_aged(store, [2], days=1)
    try:
        assert purge_expired(store, 7.0) == 150_000
        assert sorted(left(store)) == kept
    finally:
        store.close()


def test_a_purge_stops_when_its_time_is_up_and_says_so(store: OutboxStore, caplog: pytest.LogCaptureFixture) -> None:
    ids = rows_aged(store, [2] * 5)
    with caplog.at_level(logging.WARNING, logger="outbox.storage.store"):
        assert store.purge_done(timedelta(days=7), batch=2, max_rows=None, max_seconds=0) == 2  # one chunk
    assert "stopped after 0 s with done rows older than 7 days, 0:00:00 left" in caplog.text
    assert sorted(left(store)) == ids[2:]
    assert store.purge_done(timedelta(days=7), batch=2, max_rows=None, max_seconds=60) == 3
    assert left(store) == {}


def test_the_relays_purge_budget_is_half_its_interval_at_most_five_minutes() -> None:
    assert purge_budget(3600.0) == PURGE_RUN_S == 300.0
    assert purge_budget(60.0) == 30.0


def test_a_purge_chunk_on_sqlite_walks_ids_not_every_old_done_row(tmp_path: Path) -> None:
    """With no statistics SQLite planned each chunk on the (status, processed_at) index: every
    old done row read and sorted by id per chunk, so a purge run cost the square of the
    backlog while holding the writer lock (measured in review at 1,000,000 old rows: 218-278
    ms a chunk, against 11-25 ms on the id range). Both statements name the table as the
    pipeline's range walks do (``Engine.id_range_source``)."""
    store = OutboxStore(f"sqlite:///{tmp_path / 'o.db'}")
    store.migrate()
    rows_aged(store, [2] * 50)
    engine = store.engine
    with store.transaction() as cursor:
        plans = [" ".join(str(r[-1]) for r in engine.execute(cursor, "EXPLAIN QUERY PLAN " + sql, params))
                 for sql, params in ((engine.purge_range_sql(), [-DAY_MS, 0, 100, 10]),
                                     (engine.purge_delete_sql(), [1, 10, -DAY_MS]))]
    store.close()
    for plan in plans:
        assert "TEMP B-TREE" not in plan and "done_processed_at" not in plan, plans


def test_no_purge_statement_reads_past_its_window_of_ids(store: OutboxStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a run's last chunk (fewer old done rows left than a chunk, or none)
    read every row after it to the end of the table, the rows the purge keeps: 1.65 s on
    2.1M rows on PostgreSQL, 6.6 s on MariaDB, longer with every day of retention, holding
    back vacuum (InnoDB's purge) all that time. Each range statement now reads a window of
    ``Engine.purge_window`` ids at most, and a run ends at the first row created after the
    cut-off (docs/relay.md, "Purge")."""
    if store.engine.name == "mssql":
        pytest.skip("one statement there, a seek on (status, processed_at)")
    monkeypatch.setattr(type(store.engine), "purge_window", 10, raising=False)
    old = rows_aged(store, [2, 4, 2, 0, 2] * 5)  # 25 old rows: 15 done, 5 dead, 5 pending
    recent = rows_aged(store, [2, 0, 1] * 20, days=1)  # 60 rows the purge keeps, after them
    ranges: list[list[Any]] = []
    execute = store.engine.execute

    def noting(cursor: Any, sql: str, params: Any = ()) -> Any:
        if sql == store.engine.purge_range_sql():
            ranges.append(list(params))
        return execute(cursor, sql, params)
    monkeypatch.setattr(store.engine, "execute", noting)

    assert store.purge_done(timedelta(days=7), batch=4) == 15
    assert sorted(left(store)) == sorted([i for n, i in enumerate(old) if n % 5 in (1, 3)] + recent)
    assert ranges and all(upper - after <= 10 for _, after, upper, _ in ranges), ranges
    assert max(upper for _, _, upper, _ in ranges) < recent[0] + 10, ranges  # stopped at the first recent row


def test_a_purge_stops_between_chunks_once_the_worker_is_stopping(store: OutboxStore,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The first chunk runs (a purge task begun as the worker is told to stop is one short
    statement), then the run ends before the next one."""
    ids = rows_aged(store, [2] * 5)
    with caplog.at_level(logging.INFO, logger="outbox.storage.store"):
        assert store.purge_done(timedelta(days=7), batch=2, max_rows=None, stop=lambda: True) == 2
    assert "the worker is stopping" in caplog.text and "the next run carries on" in caplog.text
    assert sorted(left(store)) == ids[2:]


def test_a_purge_task_in_a_worker_told_to_stop_ends_after_its_chunk(tmp_path: Path) -> None:
    """Found in review: the relay's purge ignored a warm shutdown, so a SIGTERM during a purge of
    a backlog (874,000 old rows on MariaDB) waited for the whole purge, up to its budget of five
    minutes, past a supervisor's stop timeout (docs/relay.md, "Graceful shutdown"). Now the purge
    task stops between chunks once the worker is stopping; the next run carries on."""
    code = """
import json, sqlite3, os
import outbox.celery.tasks as t
import outbox.celery.worker as w
from outbox.storage.store import OutboxStore
store = OutboxStore(os.environ["OUTBOX_DATABASE_URL"])
store.migrate()
conn = sqlite3.connect(os.environ["DB_PATH"])
conn.executemany("INSERT INTO outbox (message_id, topic, aggregate_type, aggregate_id, payload, status, created_at, "
                 "processed_at) VALUES (?, 't', 'o', 'a', '{}', 2, strftime('%Y-%m-%d %H:%M:%f', 'now', '-8 days'), "
                 "strftime('%Y-%m-%d %H:%M:%f', 'now', '-8 days'))", [(f"m{i}",) for i in range(3000)])
conn.commit()
w.STOPPING.set()
deleted = t.purge(outbox=t.relay_settings().outbox_namespace)
left = conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
print(json.dumps({"deleted": deleted, "left": left}))
"""
    db = tmp_path / "o.db"
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{db}", DB_PATH=str(db))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"deleted": 1000, "left": 2000}
