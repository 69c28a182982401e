"""Replay's per-engine bulk writers on real databases, without Spark: COPY on
PostgreSQL and one multi-row INSERT on MySQL/MariaDB write exactly the rows, in
exactly the order, that ``executemany`` of the engine's INSERT writes."""

from __future__ import annotations

from typing import Any

import pytest
from pipeline_support import PIPELINE_ENGINES

from outbox.domain.events import prepare_event
from outbox.pipeline import replay
from outbox.pipeline.replay import BULK_WRITERS, _executemany
from outbox.storage.store import OutboxStore


@pytest.fixture(params=PIPELINE_ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


AWKWARD = ["tab\there", "line\nbreak", "back\\slash", "quote ' and \"", "ünïcødé ✓", "%s and %(x)s", "\\N", ""]


def events(engine: Any, n: int) -> list[list[Any]]:
    """``n`` event rows as the engine's INSERT takes them, with the values COPY and
    hand-built SQL get wrong first: tabs, newlines, backslashes, quotes, ``%``, NULLs."""
    rows = []
    for i in range(n):
        odd = AWKWARD[i % len(AWKWARD)]
        event = prepare_event(topic=f"t{i % 3}", aggregate_type="order", aggregate_id=f"agg {odd}",
                              payload={"n": i, "text": odd}, headers={"h": odd},
                              key=None if i % 2 else f"key {odd}", message_id=f"m-{i}",
                              trace_id=None if i % 3 else f"trace-{i}", max_payload_bytes=1 << 20)
        rows.append(engine.event_params(event))
    return rows


def stored(store: OutboxStore) -> list[tuple]:
    e = store.engine
    with store.transaction() as cursor:
        rows = e.execute(cursor, f"SELECT message_id, topic, aggregate_type, aggregate_id, partition_key, "
                         f"{e.payload_column()}, {e.headers_column()}, trace_id, status, created_at "
                         f"FROM {e.table} ORDER BY id").fetchall()
    assert all(r[9] is not None for r in rows)  # created_at from the database clock
    return [tuple(r[:9]) for r in rows]


def write(store: OutboxStore, writer: Any, rows: list[list[Any]]) -> None:
    def work(cursor: Any) -> None:
        store.engine.begin(cursor)
        writer(store.engine, cursor, rows)
    store._run("bulk", work)


def test_bulk_writer_matches_executemany(make_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bulk, plain = make_store(), make_store()
    writer = BULK_WRITERS.get(bulk.engine.name, _executemany)
    monkeypatch.setattr(replay, "MULTI_ROW_BYTES", 600)  # MySQL: several INSERTs per batch
    rows = events(bulk.engine, 40)
    write(bulk, writer, rows)
    write(plain, _executemany, rows)
    got = stored(bulk)
    assert [r[0] for r in got] == [f"m-{i}" for i in range(40)]  # ids follow the batch's order
    assert got == stored(plain)


@pytest.mark.parametrize("kind", ["mysql"])
def test_mysql_batch_is_one_statement(store: OutboxStore) -> None:
    """PyMySQL's executemany cannot fold an INSERT whose VALUES hold UTC_TIMESTAMP(3):
    it sent one statement per row. The bulk writer sends one."""
    rows = events(store.engine, 50)
    counts = []

    def work(cursor: Any) -> None:
        store.engine.begin(cursor)
        cursor.execute("SHOW SESSION STATUS LIKE 'Com_insert'")
        counts.append(int(cursor.fetchone()[1]))
        BULK_WRITERS["mysql"](store.engine, cursor, rows)
        cursor.execute("SHOW SESSION STATUS LIKE 'Com_insert'")
        counts.append(int(cursor.fetchone()[1]))
    store._run("bulk", work)
    assert counts[1] - counts[0] == 1


class _CountingCursor:
    """A real cursor that also counts the placeholders of each statement it runs."""

    def __init__(self, cursor: Any, counts: list[int]) -> None:
        self._cursor, self._counts = cursor, counts

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._counts.append(len(params))
        self._cursor.execute(sql, params)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


def test_the_already_stored_check_asks_at_most_a_thousand_ids_a_statement(store: OutboxStore) -> None:
    """Replay's check of a batch's message ids (``--batch`` up to 10,000): an ``IN`` list
    of one parameter per id is cut into statements of ``EXISTING_CHUNK`` ids (SQL Server
    takes at most 2,100 parameters), and still finds every stored id."""
    rows = events(store.engine, 3)
    write(store, _executemany, rows)
    ids = [f"absent-{i}" for i in range(2500)]
    ids[10], ids[1500], ids[2499] = "m-0", "m-1", "m-2"
    counts: list[int] = []

    def work(cursor: Any) -> set[str]:
        return replay._existing_in_list(store.engine, _CountingCursor(cursor, counts), ids)
    assert store._run("check", work) == {"m-0", "m-1", "m-2"}
    assert counts == [1000, 1000, 500]
