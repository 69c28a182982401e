"""Queue tables on SQLite: one writer at a time, so the lease is a single
``UPDATE ... RETURNING`` (SQLite 3.35+) that no other process can interleave with;
it waits on the busy timeout rather than failing while another process writes."""

from __future__ import annotations

from typing import Any

from ...storage.engines.sqlite import _NOW
from .base import READY_INDEX, RETIRED_RECEIVE_INDEX, QueueTables


class SqliteQueueTables(QueueTables):
    def index_ref(self, suffix: str) -> str:
        name = self.engine.quote(self.index_name(suffix))
        schema = self.engine.schema
        return name if schema in (None, "main") else f"{self.engine.quote(schema)}.{name}"

    def migration(self) -> list[Any]:
        q = self.engine.quote
        table, bindings = q(self.table_name), q(self.binding_name)
        return [
            f"""CREATE TABLE IF NOT EXISTS {self.table} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                queue TEXT NOT NULL,
                headers TEXT NOT NULL,
                body TEXT NULL,
                visible_at TEXT NOT NULL DEFAULT ({_NOW}),
                expires_at TEXT NULL,
                receipt TEXT NULL,
                deliveries INTEGER NOT NULL DEFAULT 0,
                created_at TEXT NOT NULL DEFAULT ({_NOW})
            )""",
            f"CREATE INDEX IF NOT EXISTS {self.index_ref(READY_INDEX)} ON {table} (queue, visible_at, id)",
            f"DROP INDEX IF EXISTS {self.index_ref(RETIRED_RECEIVE_INDEX)}",
            f"CREATE INDEX IF NOT EXISTS {self.index_ref('expires')} ON {table} (expires_at) "
            "WHERE expires_at IS NOT NULL",
            f"""CREATE TABLE IF NOT EXISTS {self.bindings} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                exchange TEXT NOT NULL,
                routing_key TEXT NOT NULL,
                pattern TEXT NOT NULL,
                queue TEXT NOT NULL,
                message_ttl_ms INTEGER NULL
            )""",
            f"CREATE UNIQUE INDEX IF NOT EXISTS {self.index_ref('binding')} ON {bindings} "
            "(exchange, routing_key, queue)",
        ]

    def existing_indexes_sql(self) -> tuple[str, list[Any]]:
        schema = self.engine.schema if self.engine.schema not in (None, "main") else "main"
        return (f"SELECT name FROM {self.engine.quote(schema)}.sqlite_master WHERE type = 'index' AND tbl_name = ?",
                [self.table_name])
