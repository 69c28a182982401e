"""Queue tables on MySQL 8 and MariaDB 10.6+.

Neither has ``UPDATE ... RETURNING`` (MariaDB only from 11.x on some statements),
so the lease is a locking read of one queue's oldest visible rows (``FOR UPDATE
SKIP LOCKED`` on the ``(queue, id, ...)`` index, in index order: it locks only the
rows it returns) followed by one UPDATE of those ids, in the caller's short READ
COMMITTED transaction. Names use a binary collation: queue ``a`` is not ``A``.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

from ...storage.engines.mysql import MysqlEngine
from .base import MAX_NAME, READY_INDEX, RECEIVE_ORDER, RETIRED_RECEIVE_INDEX, MessageRow, QueueTables, to_rows


class MysqlQueueTables(QueueTables):
    lock_rows = " FOR UPDATE SKIP LOCKED"

    def migration(self) -> list[Any]:
        q, engine = self.engine.quote, self.engine
        schema = "DATABASE()" if not engine.schema else "?"
        schema_params = [engine.schema] if engine.schema else []

        def index_exists(table: str, index: str) -> tuple[str, list[Any]]:
            return (f"SELECT 1 FROM information_schema.statistics WHERE table_schema = {schema} "
                    "AND table_name = ? AND index_name = ?", [*schema_params, table, index])

        def table_exists(table: str) -> tuple[str, list[Any]]:
            return (f"SELECT 1 FROM information_schema.tables WHERE table_schema = {schema} AND table_name = ?",
                    [*schema_params, table])

        # Every step probed first: CREATE ... IF NOT EXISTS checks privileges before it looks,
        # so a role without DDL privileges failed every start on tables made for it
        # (docs/transport.md, "Table layout").
        name = f"VARCHAR({MAX_NAME}) NOT NULL"
        retired = index_exists(self.table_name, self.index_name(RETIRED_RECEIVE_INDEX))
        steps: list[Any] = [(("SELECT 1 FROM information_schema.schemata WHERE schema_name = ?", [engine.schema]),
                             f"CREATE DATABASE IF NOT EXISTS {q(engine.schema)}")] if engine.schema else []
        steps += [
            (table_exists(self.table_name), f"""CREATE TABLE IF NOT EXISTS {self.table} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                queue {name},
                headers LONGTEXT NOT NULL,
                body LONGTEXT NULL,
                visible_at DATETIME(3) NOT NULL,
                expires_at DATETIME(3) NULL,
                receipt VARCHAR(32) NULL,
                deliveries INT NOT NULL DEFAULT 0,
                created_at DATETIME(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)
            ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"""),
            (index_exists(self.table_name, self.index_name(READY_INDEX)),
             f"CREATE INDEX {q(self.index_name(READY_INDEX))} ON {self.table} (queue, visible_at, id)"),
            # The retired receive index: dropped when it exists (the probe finds no row then).
            ((f"SELECT 1 FROM DUAL WHERE NOT EXISTS ({retired[0]})", retired[1]),
             f"DROP INDEX {q(self.index_name(RETIRED_RECEIVE_INDEX))} ON {self.table}"),
            (index_exists(self.table_name, self.index_name("expires")),
             f"CREATE INDEX {q(self.index_name('expires'))} ON {self.table} (expires_at)"),
            (table_exists(self.binding_name), f"""CREATE TABLE IF NOT EXISTS {self.bindings} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                exchange {name},
                routing_key {name},
                pattern {name},
                queue {name},
                message_ttl_ms BIGINT NULL,
                UNIQUE KEY {q(self.index_name('binding'))} (exchange, routing_key, queue)
            ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"""),
        ]
        return steps

    #: Seconds a step of a new process's start-up migration waits for a table's lock
    #: (``outbox migrate`` waits ``mysql.MIGRATION_LOCK_WAIT_S``): while DDL waits, every send,
    #: lease and ack queues behind it. lock_wait_timeout counts whole seconds.
    START_UP_LOCK_WAIT_S = 1

    def migration_lock_key(self) -> str:
        # GET_LOCK names stop at 64 characters: a digest of the table's name.
        return "outbox migrate " + hashlib.sha1(self.table.encode()).hexdigest()

    def lock_migration(self, cursor: Any, start_up: bool = False) -> None:
        # The outbox table's lock and bounds (MysqlEngine.hold_migration_lock); concurrent
        # CREATE INDEX fails with 1061.
        cast(MysqlEngine, self.engine).hold_migration_lock(
            cursor, self.migration_lock_key(), self.table, self.START_UP_LOCK_WAIT_S if start_up else None)

    def unlock_migration(self, cursor: Any) -> None:
        cast(MysqlEngine, self.engine).release_migration_lock(cursor, self.migration_lock_key())

    def existing_indexes_sql(self) -> tuple[str, list[Any]]:
        schema = "DATABASE()" if not self.engine.schema else "?"
        return (f"SELECT DISTINCT index_name FROM information_schema.statistics WHERE table_schema = {schema} "
                "AND table_name = ?", [*([self.engine.schema] if self.engine.schema else []), self.table_name])

    def put_sql(self, with_expiry: bool) -> str:
        # created_at from the same clock as visible_at (UTC), not the session time zone.
        expires = self.after_ms() if with_expiry else "NULL"
        return (f"INSERT INTO {self.table} (queue, headers, body, visible_at, expires_at, created_at) "
                f"VALUES (?, ?, ?, {self.after_ms()}, {expires}, {self.engine.now})")

    def scan_sql(self) -> str:
        return (f"SELECT id, queue, headers, body, deliveries FROM {self.table} "
                f"WHERE queue = ? AND {self.visible()} ORDER BY {RECEIVE_ORDER} LIMIT ?{self.lock_rows}")

    def lease(self, cursor: Any, queue: str, limit: int, visibility_ms: int, receipt: str) -> list[MessageRow]:
        rows = self.run(cursor, self.scan_sql(), [queue, limit]).fetchall()
        if not rows:
            return []
        ids = [int(r[0]) for r in rows]
        self.run(cursor, f"UPDATE {self.table} SET visible_at = {self.after_ms()}, receipt = ?, "
                 f"deliveries = deliveries + 1 WHERE id IN ({', '.join('?' * len(ids))})",
                 [*self.after_params(visibility_ms), receipt, *ids])
        return to_rows([(r[0], r[1], r[2], r[3], int(r[4]) + 1) for r in rows])

    def purge_expired_sql(self) -> str:
        # MySQL rejects LIMIT inside an IN subquery; a single-table DELETE takes it.
        return f"DELETE FROM {self.table} WHERE expires_at <= {self.now()} ORDER BY expires_at LIMIT ?"

    def bind_sql(self) -> str:
        return (f"INSERT IGNORE INTO {self.bindings} (exchange, routing_key, pattern, queue, message_ttl_ms) "
                "VALUES (?, ?, ?, ?, ?)")
