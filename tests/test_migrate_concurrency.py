"""Migrations of one outbox table that run at the same time (every replica's start-up runs
``outbox migrate``; a deploy job beside ``manage.py migrate`` or ``alembic upgrade``) all
succeed: one at a time (``Engine.lock_migration``). Before, on PostgreSQL all but one failed
on a unique violation in pg_type or pg_class (concurrent CREATE TABLE IF NOT EXISTS), and on
MariaDB on "Duplicate column name 'last_error'" (both found the column missing)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from engine_support import drop_table

from outbox.storage.store import OutboxStore

RACERS = 4


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
@pytest.mark.parametrize("round_", range(3))
def test_concurrent_migrations_of_an_empty_database_all_succeed(url: str, round_: int) -> None:
    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    stores = [OutboxStore(url, table=table) for _ in range(RACERS)]
    for store in stores:
        store.connection()  # connected before the start: the race is the DDL's
    start = threading.Barrier(RACERS)
    outcomes: list[Any] = [None] * RACERS

    def migrate(i: int) -> None:
        start.wait()
        try:
            stores[i].migrate()
            outcomes[i] = "ok"
        except Exception as exc:  # what each racer met is the assertion
            outcomes[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=migrate, args=(i,)) for i in range(RACERS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert outcomes == ["ok"] * RACERS
        assert stores[0].migrate() == 0  # complete: nothing left to repair
        columns, _ = stores[0].schema_state() or (frozenset(), frozenset())
        assert {"last_error", "lease_token"} <= columns
    finally:
        drop_table(stores[0])
        for store in stores:
            store.close()
