"""Queue tables: the SQL behind the database as Celery's broker (``outbox.transport``), one
contract for every engine (docs/transport.md, "Table layout": one table, its columns, why).

Receiving is a lease (visible_at, receipt); ack and release are fenced by the receipt. Engine
modules (``outbox.transport.tables.<engine>``) subclass ``QueueTables`` with only what differs;
``outbox.transport.tables.queue_tables`` picks one. Every time is the database's clock (UTC)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...storage.engines.base import Engine, derived_name

log = logging.getLogger("outbox.transport.tables")

DEFAULT_QUEUE_TABLE = "outbox_queue"
#: The receive index (``ix_<table>_ready``): (queue, visible_at, id), so the lease and the
#: idle probe seek a queue's visible rows and never read past its delayed (eta, Celery
#: retries) and leased rows (docs/transport.md, "Table layout"). It replaced
#: ``ix_<table>_receive`` on (queue, id), which migrations drop.
READY_INDEX, RETIRED_RECEIVE_INDEX = "ready", "receive"
#: The lease's order, which the ready index serves without a sort: the longest visible first,
#: which for undelayed sends is the send order (ties by id).
RECEIVE_ORDER = "visible_at, id"
#: Longest queue, exchange and routing key name the tables hold.
MAX_NAME = 255


class MessageRow(NamedTuple):
    id: int
    queue: str
    headers: str
    body: str | None
    deliveries: int


class Binding(NamedTuple):
    routing_key: str
    pattern: str
    queue: str
    #: The queue's message TTL (``x-message-ttl``), applied when a message is routed to it.
    message_ttl_ms: int | None = None


class Waiter:
    """Blocks an idle receive loop until a send wakes it (or the timeout passes)."""

    def wait(self, timeout: float) -> bool:
        """True when woken by a send, False on timeout."""
        raise NotImplementedError

    def drain(self) -> bool:
        """Read the wake-ups already received, without blocking: True if there were any."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def binding_table_name(table: str) -> str:
    """The bindings table of the queue table ``table``."""
    return f"{table}_binding"


class QueueTables:
    """SQL for the queue tables of one engine. Holds names, not connections: every
    method takes a cursor and leaves committing to the caller."""

    #: Appended to the per-queue lease scan (row locks that skip held rows).
    lock_rows: str = ""
    #: True where ``open_waiter`` gives a wake-up on every send (idle receivers need not poll fast).
    wakes_on_send: bool = False

    def __init__(self, engine: Engine, table: str = DEFAULT_QUEUE_TABLE) -> None:
        self.engine = engine
        self.table_name = table
        self.table = engine.qualify(table)
        self.binding_name = binding_table_name(table)
        self.bindings = engine.qualify(self.binding_name)

    @property
    def writes_alone(self) -> bool:
        """Do a send, the lease, an ack and a requeue run alone (``Engine.statement_alone``),
        each committed in the round trip that runs it? Where the server cannot end a session
        idle in a transaction (``Engine.ends_idle_transactions``: SQL Server), a receiver cut
        off before its COMMIT held the rows' locks for as long as its session lived. Elsewhere
        the server frees them within seconds, sooner than a lost answer's lease would run out
        (docs/transport.md, "A network cut before the COMMIT")."""
        return not self.engine.ends_idle_transactions

    # -- names and expressions ------------------------------------------------
    def index_name(self, suffix: str) -> str:
        return derived_name("ix_", self.table_name, f"_{suffix}")

    def required_indexes(self) -> list[str]:
        """Indexes the transport checks for at start-up (a warning names each missing one)."""
        return [self.index_name(READY_INDEX), self.index_name("expires")]

    def now(self) -> str:
        """The database clock as stored times are compared with it: at the columns' precision
        where the engine rounds what it stores (docs/transport.md, "The clock of the tables")."""
        return self.engine.now

    def after_ms(self) -> str:
        """The database clock plus a non-negative number of milliseconds (``after_params``)."""
        return self.engine.now_plus_ms()

    def after_params(self, ms: int) -> list[Any]:
        return [max(int(ms), 0)]

    def visible(self) -> str:
        now = self.now()
        return f"visible_at <= {now} AND (expires_at IS NULL OR expires_at > {now})"

    def run(self, cursor: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        return self.engine.execute(cursor, sql, params)

    # -- schema ----------------------------------------------------------------
    def migration(self) -> list[Any]:
        """Guarded, idempotent steps (see ``Engine.migration`` for the item forms)."""
        raise NotImplementedError

    def drop_table_sql(self, table: str) -> str:
        """Drop ``table`` (qualified) if it exists."""
        return f"DROP TABLE IF EXISTS {table}"

    def drop(self, cursor: Any) -> None:
        """Drop both tables if they exist (``outbox.transport.drop_queue_tables``)."""
        for table in (self.table, self.bindings):
            self.run(cursor, self.drop_table_sql(table))

    def lock_migration(self, cursor: Any, start_up: bool = False) -> None:
        """Wait until no other migration of these tables runs (every worker creates them at
        start-up, so several race on an empty database): engines whose concurrent DDL can
        fail take a lock here that lasts until ``unlock_migration`` or the commit. Engines
        that can bound how long a step waits for a lock on a live table set it here, shorter
        for the ``start_up`` migration of a new process."""

    def unlock_migration(self, cursor: Any) -> None:
        """Release what ``lock_migration`` took, where the commit does not."""

    def migrate(self, cursor: Any, start_up: bool = False) -> None:
        """Run ``migration()``: create or repair both tables and their indexes, one
        migration at a time (``lock_migration``); ``start_up``: a new process's, on its
        first connection (``transport.database.Database``)."""
        self.lock_migration(cursor, start_up)
        try:
            for step in self.migration():
                if isinstance(step, tuple):
                    (probe, params), step = step
                    if self.run(cursor, probe, params).fetchone() is not None:
                        continue
                self.run(cursor, step)
        except BaseException:
            try:
                self.unlock_migration(cursor)
            except Exception:  # the connection may be gone; the original error tells why
                log.debug("outboxdb: cannot unlock the migration", exc_info=True)
            raise
        self.unlock_migration(cursor)

    def migration_lock_name(self) -> str:
        return f"outbox migrate {self.table}"

    def existing_indexes_sql(self) -> tuple[str, list[Any]]:
        """A query listing the names of the message table's indexes."""
        raise NotImplementedError

    def missing_indexes(self, cursor: Any) -> list[str]:
        sql, params = self.existing_indexes_sql()
        present = {str(row[0]).lower() for row in self.run(cursor, sql, params).fetchall()}
        return [name for name in self.required_indexes() if name.lower() not in present]

    # -- messages ----------------------------------------------------------------
    def put_sql(self, with_expiry: bool) -> str:
        expires = self.after_ms() if with_expiry else "NULL"
        return (f"INSERT INTO {self.table} (queue, headers, body, visible_at, expires_at) "
                f"VALUES (?, ?, ?, {self.after_ms()}, {expires})")

    def put_params(self, queue: str, headers: str, body: str | None, delay_ms: int,
                   ttl_ms: int | None) -> list[Any]:
        """``put_sql``'s parameters. The TTL counts from when the message becomes visible, so
        a delayed message outlives its delay (docs/transport.md, "Delays and expiry")."""
        params = [queue, headers, body, *self.after_params(delay_ms)]
        if ttl_ms is not None:
            params += self.after_params(max(int(delay_ms), 0) + ttl_ms)
        return params

    def put(self, cursor: Any, queue: str, headers: str, body: str | None, delay_ms: int = 0,
            ttl_ms: int | None = None, wake: bool = True) -> None:
        """Store a message. ``wake``: the insert itself wakes idle receivers at its commit, where
        the engine can (``wakes_on_send``); the broker's own sends pass False and call ``wake``
        after their commit, the transactional ``send_task`` wakes at the caller's commit."""
        self.run(cursor, self.put_sql(ttl_ms is not None), self.put_params(queue, headers, body, delay_ms, ttl_ms))

    def wake(self, cursor: Any, queues: Sequence[str]) -> None:
        """Wake idle receivers of ``queues`` in a statement of its own (engines with wake-ups)."""

    def session_setup(self, cursor: Any) -> None:
        """Run once on each new connection of the transport (engine-specific tuning)."""

    def open_waiter(self, url: str) -> Waiter | None:
        """Something an idle receiver can block on until a message may have arrived
        (PostgreSQL's LISTEN), or None: the receiver then sleeps between polls."""
        return None

    def probe_sql(self, count: int) -> str:
        """One cheap read: is any of ``count`` queues holding a deliverable row?"""
        names = ", ".join("?" * count)
        return (f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {self.table} WHERE queue IN ({names}) "
                f"AND {self.visible()}) THEN 1 ELSE 0 END")

    def probe(self, cursor: Any, queues: Sequence[str]) -> bool:
        if not queues:
            return False
        return bool(self.run(cursor, self.probe_sql(len(queues)), list(queues)).fetchone()[0])

    def lease_sql(self) -> str:
        """One statement that leases and returns the rows: ``UPDATE ... RETURNING`` over the
        oldest visible rows, locked with ``lock_rows`` where the engine skips locked rows.
        Engines without RETURNING (MySQL, SQL Server) override ``lease``."""
        t = self.table
        return (f"UPDATE {t} SET visible_at = {self.after_ms()}, receipt = ?, deliveries = deliveries + 1 "
                f"WHERE id IN (SELECT id FROM {t} WHERE queue = ? AND {self.visible()} "
                f"ORDER BY {RECEIVE_ORDER} LIMIT ?{self.lock_rows}) "
                "RETURNING id, queue, headers, body, deliveries")

    def lease(self, cursor: Any, queue: str, limit: int, visibility_ms: int, receipt: str) -> list[MessageRow]:
        """Lease up to ``limit`` rows of ``queue``, the longest visible first (``RECEIVE_ORDER``)."""
        params = [*self.after_params(visibility_ms), receipt, queue, limit]
        return to_rows(self.run(cursor, self.lease_sql(), params).fetchall())

    def leased_sql(self) -> str:
        """The rows of queue ``?`` leased under receipt ``?``: leased rows lie ahead of the
        clock, so the receive index reads only the queue's delayed and leased rows."""
        return (f"SELECT id, queue, headers, body, deliveries FROM {self.table} "
                f"WHERE queue = ? AND visible_at > {self.now()} AND receipt = ? ORDER BY id")

    def leased(self, cursor: Any, queue: str, receipt: str) -> list[MessageRow]:
        """What a lease under ``receipt`` took, if it committed (``Channel._lease_queue``)."""
        return to_rows(self.run(cursor, self.leased_sql(), [queue, receipt]).fetchall())

    def ack_sql(self) -> str:
        return f"DELETE FROM {self.table} WHERE id = ? AND receipt = ?"

    def ack(self, cursor: Any, id: int, receipt: str) -> int:
        """Delete a received message; 0 when its lease ran out and someone else holds it."""
        return self.run(cursor, self.ack_sql(), [id, receipt]).rowcount

    def release_sql(self, delayed: bool = True) -> str:
        """Visible again after ``after_ms``, or (not ``delayed``) at once and in its old place:
        ``visible_at`` back to the send time, which is where an undelayed send put it."""
        visible = self.after_ms() if delayed else "created_at"
        return f"UPDATE {self.table} SET visible_at = {visible}, receipt = NULL WHERE id = ? AND receipt = ?"

    def release(self, cursor: Any, id: int, receipt: str, delay_ms: int = 0) -> int:
        """Make a received message deliverable again (after ``delay_ms``; at once, it keeps
        its place in the queue)."""
        if delay_ms > 0:
            return self.run(cursor, self.release_sql(), [*self.after_params(delay_ms), id, receipt]).rowcount
        return self.run(cursor, self.release_sql(delayed=False), [id, receipt]).rowcount

    def waiting(self) -> str:
        """Rows no receiver holds: never leased, or their lease ran out (deliverable again)."""
        return f"(receipt IS NULL OR visible_at <= {self.now()})"

    def size(self, cursor: Any, queue: str) -> int:
        """Messages waiting (delayed ones included, leased ones not: AMQP's message count)."""
        return int(self.run(cursor, f"SELECT COUNT(*) FROM {self.table} WHERE queue = ? AND {self.waiting()}",
                            [queue]).fetchone()[0])

    def holds_any(self, cursor: Any, queue: str) -> bool:
        """Does any row carry ``queue``'s name, leased ones included (``queue_delete(if_empty)``)?"""
        return bool(self.run(cursor, f"SELECT CASE WHEN EXISTS (SELECT 1 FROM {self.table} WHERE queue = ?) "
                             "THEN 1 ELSE 0 END", [queue]).fetchone()[0])

    def purge(self, cursor: Any, queue: str) -> int:
        """Delete the messages waiting in ``queue`` (leased ones stay with their receivers)."""
        return self.run(cursor, f"DELETE FROM {self.table} WHERE queue = ? AND {self.waiting()}",
                        [queue]).rowcount

    def purge_expired_sql(self) -> str:
        """Delete at most ``?`` rows whose expiry passed."""
        return (f"DELETE FROM {self.table} WHERE id IN (SELECT id FROM {self.table} "
                f"WHERE expires_at <= {self.now()} ORDER BY expires_at LIMIT ?)")

    def purge_expired(self, cursor: Any, limit: int) -> int:
        return self.run(cursor, self.purge_expired_sql(), [limit]).rowcount

    def delete_queue(self, cursor: Any, queue: str) -> None:
        """Drop every row and binding of ``queue``."""
        self.run(cursor, f"DELETE FROM {self.table} WHERE queue = ?", [queue])
        self.run(cursor, f"DELETE FROM {self.bindings} WHERE queue = ?", [queue])

    # -- bindings ----------------------------------------------------------------
    def bind_sql(self) -> str:
        """Insert ``(exchange, routing_key, pattern, queue, message_ttl_ms)`` unless
        ``(exchange, routing_key, queue)`` is stored (engines without ON CONFLICT override it)."""
        return (f"INSERT INTO {self.bindings} (exchange, routing_key, pattern, queue, message_ttl_ms) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (exchange, routing_key, queue) DO NOTHING")

    def bind(self, cursor: Any, exchange: str, routing_key: str, pattern: str, queue: str,
             message_ttl_ms: int | None = None) -> None:
        self.run(cursor, self.bind_sql(), [exchange, routing_key, pattern, queue, message_ttl_ms])

    def unbind(self, cursor: Any, exchange: str, routing_key: str, queue: str) -> None:
        self.run(cursor, f"DELETE FROM {self.bindings} WHERE exchange = ? AND routing_key = ? AND queue = ?",
                 [exchange, routing_key, queue])

    def table_bindings(self, cursor: Any, exchange: str) -> list[Binding]:
        rows = self.run(cursor, f"SELECT routing_key, pattern, queue, message_ttl_ms FROM {self.bindings} "
                        "WHERE exchange = ? ORDER BY id", [exchange]).fetchall()
        return [Binding(r[0] or "", r[1] or "", r[2], None if r[3] is None else int(r[3])) for r in rows]


def to_rows(rows: Sequence[Sequence[Any]]) -> list[MessageRow]:
    """Driver rows -> MessageRow, oldest first (RETURNING/OUTPUT promise no order)."""
    out = [MessageRow(int(r[0]), r[1], r[2] if isinstance(r[2], str) else bytes(r[2]).decode("utf-8"),
                      r[3] if r[3] is None or isinstance(r[3], str) else bytes(r[3]).decode("utf-8"),
                      int(r[4])) for r in rows]
    out.sort(key=lambda m: m.id)
    return out


__all__ = ["QueueTables", "binding_table_name", "Waiter", "MessageRow", "Binding", "DEFAULT_QUEUE_TABLE", "MAX_NAME", "READY_INDEX",
           "RETIRED_RECEIVE_INDEX", "RECEIVE_ORDER", "to_rows"]
