"""Queue tables on SQL Server 2016 SP1+ and Azure SQL.

The lease is one batch: a CTE takes the queue's oldest visible rows with
``READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK`` (skip rows other receivers hold,
lock only what is read, and READCOMMITTEDLOCK so READPAST is allowed on
READ_COMMITTED_SNAPSHOT databases such as Azure SQL), updates them, and hands them
back through ``OUTPUT ... INTO`` a table variable (a bare OUTPUT fails on tables
with triggers). The batch saves and restores NOCOUNT as ``outbox.storage.engines.mssql`` explains.

The message table is clustered on ``id``, the seeds' 2016 design: inserts go to
the end, the receive index is ``(queue, visible_at, id)`` (``base.READY_INDEX``).
The 2024 design moved hot queues to
a heap with a non-clustered index against last-page latch contention; that is a
measured trade-off we could not measure here (no SQL Server), and heaps do not
give back pages emptied by singleton DELETEs, which a queue does all day. See
docs/transport.md for the heap variant and when to use OPTIMIZE_FOR_SEQUENTIAL_KEY.

Times: DATEADD takes an INT, so delays are split into seconds and milliseconds
(an INT of milliseconds overflows after ~24.8 days; a countdown may be longer).
"""

from __future__ import annotations

from typing import Any

from ...storage.engines.mssql.driver import reset_session, result_rows
from ...storage.engines.mssql.schema import (
    FILTERED_INDEX_OPTIONS,
    if_,
    lock_escalation_off,
    migration_lock_statements,
    migration_unlock_statements,
    nstr,
)
from .base import MAX_NAME, READY_INDEX, RECEIVE_ORDER, RETIRED_RECEIVE_INDEX, MessageRow, QueueTables, to_rows

#: Names compare exactly, as on the other engines (default collations ignore case).
NAME_COLLATION = "Latin1_General_100_BIN2"


class MssqlQueueTables(QueueTables):
    def after_ms(self) -> str:
        return "DATEADD(MILLISECOND, ?, DATEADD(SECOND, ?, SYSUTCDATETIME()))"

    def now(self) -> str:
        # DATETIME2(3) columns round SYSUTCDATETIME()'s 100 ns: compared at the same precision
        # (docs/transport.md, "The clock of the tables").
        return "CAST(SYSUTCDATETIME() AS DATETIME2(3))"

    def after_params(self, ms: int) -> list[Any]:
        seconds, millis = divmod(max(int(ms), 0), 1000)
        return [millis, seconds]

    def drop_table_sql(self, table: str) -> str:
        # DROP TABLE IF EXISTS needs SQL Server 2016; the engine supports 2012.
        return if_(f"OBJECT_ID({nstr(table)}, N'U') IS NOT NULL", f"DROP TABLE {table}")

    def migration(self) -> list[str]:
        q, schema = self.engine.quote, self.engine.schema or "dbo"
        name = f"NVARCHAR({MAX_NAME}) COLLATE {NAME_COLLATION} NOT NULL"

        def index(table: str, suffix: str, ddl: str) -> str:
            index_name = self.index_name(suffix)
            return if_(f"NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = {nstr(index_name)} "
                       f"AND object_id = OBJECT_ID({nstr(table)}))",
                       f"CREATE {ddl.format(index=q(index_name), t=table)}")

        def constraint(kind: str, table: str, column: str = "") -> str:
            return "CONSTRAINT " + q("_".join(filter(None, (kind, table, column))))

        t, b = self.table, self.bindings
        steps = [
            if_(f"SCHEMA_ID({nstr(schema)}) IS NULL", f"EXEC sp_executesql {nstr('CREATE SCHEMA ' + q(schema))}"),
            if_(f"OBJECT_ID({nstr(t)}, N'U') IS NULL", f"""CREATE TABLE {t} (
        id BIGINT IDENTITY(1,1) NOT NULL,
        queue {name},
        headers NVARCHAR(MAX) NOT NULL,
        body NVARCHAR(MAX) NULL,
        visible_at DATETIME2(3) NOT NULL {constraint('df', self.table_name, 'visible_at')} DEFAULT SYSUTCDATETIME(),
        expires_at DATETIME2(3) NULL,
        receipt CHAR(32) NULL,
        deliveries INT NOT NULL {constraint('df', self.table_name, 'deliveries')} DEFAULT 0,
        created_at DATETIME2(3) NOT NULL {constraint('df', self.table_name, 'created_at')} DEFAULT SYSUTCDATETIME(),
        {constraint('pk', self.table_name)} PRIMARY KEY CLUSTERED (id)
    )"""),
            # The receive index (base.READY_INDEX): seeks a queue's visible rows, in lease order.
            index(t, READY_INDEX, "NONCLUSTERED INDEX {index} ON {t} (queue, visible_at, id) INCLUDE (expires_at)"),
            if_(f"EXISTS (SELECT 1 FROM sys.indexes WHERE name = {nstr(self.index_name(RETIRED_RECEIVE_INDEX))} "
                f"AND object_id = OBJECT_ID({nstr(t)}))",
                f"DROP INDEX {q(self.index_name(RETIRED_RECEIVE_INDEX))} ON {t}"),
            index(t, "expires", "NONCLUSTERED INDEX {index} ON {t} (expires_at) WHERE expires_at IS NOT NULL"),
            if_(f"OBJECT_ID({nstr(b)}, N'U') IS NULL", f"""CREATE TABLE {b} (
        id BIGINT IDENTITY(1,1) NOT NULL,
        exchange {name},
        routing_key {name},
        pattern {name},
        queue {name},
        message_ttl_ms BIGINT NULL,
        {constraint('pk', self.binding_name)} PRIMARY KEY CLUSTERED (id)
    )"""),
            index(b, "binding", "UNIQUE NONCLUSTERED INDEX {index} ON {t} (exchange, routing_key, queue)"),
            # An unbounded purge (or a deep lease) must not escalate to a table lock that
            # blocks send_task in business transactions, as on the outbox table.
            lock_escalation_off(t, nstr(t)),
        ]
        return [f"{FILTERED_INDEX_OPTIONS}\n{step}" for step in steps]

    def migration_lock_batch(self) -> str:
        return FILTERED_INDEX_OPTIONS + "\n" + "\n".join(
            migration_lock_statements(self.migration_lock_name(), nstr(self.table), self.table))

    def migration_unlock_batch(self) -> str:
        return FILTERED_INDEX_OPTIONS + "\n" + "\n".join(migration_unlock_statements(self.migration_lock_name()))

    #: How long a step of a worker's start-up migration waits for a table's lock (``SET
    #: LOCK_TIMEOUT``, after the migration lock, whose sp_getapplock has a timeout of its own):
    #: while it waits every send, lease and ack queues behind it, as on PostgreSQL and MariaDB
    #: (their START_UP_LOCK_TIMEOUT, START_UP_LOCK_WAIT_S). ``outbox migrate`` waits
    #: ``DDL_LOCK_TIMEOUT_MS`` (``MssqlEngine.ddl_bounds``, which puts the session's value back).
    START_UP_LOCK_TIMEOUT_MS = 1000

    def lock_migration(self, cursor: Any, start_up: bool = False) -> None:
        # Workers starting together on an empty database would otherwise race to CREATE
        # TABLE / INDEX (errors 2714, 1913): serialized as `outbox migrate` serializes the
        # outbox table (mssql.migration_lock_statements).
        self.run(cursor, self.migration_lock_batch())
        if start_up:
            self.run(cursor, f"SET LOCK_TIMEOUT {self.START_UP_LOCK_TIMEOUT_MS}")

    def unlock_migration(self, cursor: Any) -> None:
        self.run(cursor, self.migration_unlock_batch())

    def existing_indexes_sql(self) -> tuple[str, list[Any]]:
        return ("SELECT name FROM sys.indexes WHERE object_id = OBJECT_ID(?) AND name IS NOT NULL", [self.table])

    def lease_statements(self, own_transaction: bool = False) -> list[str]:
        """The lease, one statement per item; run as one batch. Parameters: those of ``lease``.

        ``own_transaction`` (the channel's lease, run on an autocommit connection by
        ``Engine.statement_alone``): the batch opens its transaction and commits it right
        after the UPDATE, before the rows are sent, so lease and COMMIT are one round trip
        and a cut connection never leaves the leased rows locked until the server drops the
        session (docs/transport.md, "A network cut"). Without it (a caller's transaction)
        the caller commits. Either way XACT_ABORT rolls the whole lease back on any error."""
        t = self.table
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512, @xact_abort INT = @@OPTIONS & 16384;",
            "SET NOCOUNT ON;",
            "SET XACT_ABORT ON;",
            f"DECLARE @limit INT = ?, @queue NVARCHAR({MAX_NAME}) = ?, @receipt CHAR(32) = ?, "
            "@vis_ms INT = ?, @vis_s INT = ?;",
            f"DECLARE @out TABLE (id BIGINT NOT NULL PRIMARY KEY, queue NVARCHAR({MAX_NAME}) NOT NULL, "
            "headers NVARCHAR(MAX) NOT NULL, body NVARCHAR(MAX) NULL, deliveries INT NOT NULL);",
            *(["BEGIN TRANSACTION;"] if own_transaction else []),
            f"""WITH leased AS (
    SELECT TOP (@limit) id, queue, headers, body, visible_at, receipt, deliveries
    FROM {t} WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK)
    WHERE queue = @queue AND {self.visible()}
    ORDER BY {RECEIVE_ORDER})
UPDATE leased SET
    visible_at = DATEADD(MILLISECOND, @vis_ms, DATEADD(SECOND, @vis_s, SYSUTCDATETIME())),
    receipt = @receipt,
    deliveries = deliveries + 1
OUTPUT inserted.id, inserted.queue, inserted.headers, inserted.body, inserted.deliveries INTO @out;""",
            *(["COMMIT TRANSACTION;"] if own_transaction else []),
            if_("@xact_abort = 0", "SET XACT_ABORT OFF"),
            if_("@nocount = 0", "SET NOCOUNT OFF"),
            "SELECT id, queue, headers, body, deliveries FROM @out ORDER BY id;",
        ]

    def lease_batch(self, own_transaction: bool = False) -> str:
        return "\n".join(self.lease_statements(own_transaction))

    def lease(self, cursor: Any, queue: str, limit: int, visibility_ms: int, receipt: str) -> list[MessageRow]:
        params = [limit, queue, receipt, *self.after_params(visibility_ms)]
        own = self.engine.commits_each_statement(getattr(cursor, "connection", None))  # run alone: statement_alone
        try:
            self.run(cursor, self.lease_batch(own), params)
            return to_rows(result_rows(cursor))
        except BaseException:
            reset_session(cursor, own)  # ack, release and purge read rowcount, which NOCOUNT makes -1
            raise

    def leased_sql(self) -> str:
        # READPAST: rows other receivers are leasing right now are not ours; ours are committed.
        return (f"SELECT id, queue, headers, body, deliveries FROM {self.table} WITH (READCOMMITTEDLOCK, READPAST) "
                f"WHERE queue = ? AND visible_at > {self.now()} AND receipt = ? ORDER BY id")

    def size(self, cursor: Any, queue: str) -> int:
        # READPAST: kombu counts a queue at every queue_declare (a worker's start, the first
        # apply_async to it on each connection); with RCSI off a plain read waited on the row
        # of any open send_task transaction to it. Uncommitted, it is no waiting message yet.
        return int(self.run(cursor, f"SELECT COUNT(*) FROM {self.table} WITH (READCOMMITTEDLOCK, READPAST) "
                            f"WHERE queue = ? AND {self.waiting()}", [queue]).fetchone()[0])

    def probe_sql(self, count: int) -> str:
        # READPAST: a row another receiver is leasing right now is not news to this one.
        names = ", ".join("?" * count)
        return (f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {self.table} WITH (READCOMMITTEDLOCK, READPAST) "
                f"WHERE queue IN ({names}) AND {self.visible()}) THEN 1 ELSE 0 END")

    def purge_expired_sql(self) -> str:
        return (f"DELETE TOP (?) FROM {self.table} WITH (READCOMMITTEDLOCK, READPAST, ROWLOCK) "
                f"WHERE expires_at <= {self.now()}")

    def bind_sql(self) -> str:
        b = self.bindings
        return (f"INSERT INTO {b} (exchange, routing_key, pattern, queue, message_ttl_ms) SELECT ?, ?, ?, ?, ? "
                f"WHERE NOT EXISTS (SELECT 1 FROM {b} WITH (UPDLOCK, HOLDLOCK) "
                "WHERE exchange = ? AND routing_key = ? AND queue = ?)")

    def bind(self, cursor: Any, exchange: str, routing_key: str, pattern: str, queue: str,
             message_ttl_ms: int | None = None) -> None:
        self.run(cursor, self.bind_sql(),
                 [exchange, routing_key, pattern, queue, message_ttl_ms, exchange, routing_key, queue])
