"""What every engine shares. An engine module subclasses ``Engine`` and supplies only
what differs: SQL text (DDL, the claim, id lists, clock arithmetic) and driver
quirks (connecting, placeholders, error codes, value types).

SQL here is written with ``?`` placeholders; engines whose driver wants ``%s``
set ``placeholder`` and ``sql()`` rewrites the text once.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from typing import Any, ClassVar, Iterable, Sequence

from ..chains import Candidate, plan_claim
from ..model import NewEvent, OutboxMessage

#: Columns handed to the relay, in this order, by every claim implementation.
MESSAGE_COLUMNS = ("id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
                   "payload", "headers", "trace_id", "attempts", "created_at", "status")

LEASE_EXPIRED_ERROR = "lease expired: the worker holding this row was lost before it acknowledged"


class Engine(ABC):
    """One database engine. Instances are cheap; they hold names, not connections."""

    name: ClassVar[str]
    #: The driver's positional placeholder.
    placeholder: ClassVar[str] = "?"
    #: Appended to the candidate scan of the generic claim (row locks, skip locked).
    lock_candidates: ClassVar[str] = ""
    default_schema: ClassVar[str | None] = None

    def __init__(self, table: str = "outbox", schema: str | None = None) -> None:
        self.table_name = table
        self.schema = schema or self.default_schema
        self.table = self.qualify(table)

    # -- names ---------------------------------------------------------------
    def quote(self, identifier: str) -> str:
        return f'"{identifier}"'

    def qualify(self, name: str) -> str:
        return f"{self.quote(self.schema)}.{self.quote(name)}" if self.schema else self.quote(name)

    def index_name(self, suffix: str) -> str:
        return f"ix_{self.table_name}_{suffix}"

    # -- SQL text ------------------------------------------------------------
    now: ClassVar[str] = "CURRENT_TIMESTAMP"

    @abstractmethod
    def now_plus_ms(self) -> str:
        """An expression: the database clock plus ``?`` milliseconds (may be negative)."""

    def payload_column(self) -> str:
        return "payload"

    def headers_column(self) -> str:
        return "headers"

    def limit(self, select: str) -> str:
        """Add a ``?`` row limit to a SELECT that ends with ORDER BY."""
        return f"{select} LIMIT ?"

    def id_chunks(self, ids: Sequence[int]) -> list[list[int]]:
        """The id lists one statement each may carry through ``ids_in``: one list
        here; an engine whose statements have a parameter limit splits it."""
        return [list(ids)]

    def ids_in(self, ids: Sequence[int]) -> tuple[str, list[Any]]:
        """A condition ``id IN (...)`` and its parameters."""
        if not ids:
            return "1 = 0", []
        return f"id IN ({', '.join('?' * len(ids))})", list(ids)

    def sql(self, text: str) -> str:
        return text if self.placeholder == "?" else text.replace("%", "%%").replace("?", self.placeholder)

    def execute(self, cursor: Any, text: str, params: Sequence[Any] = ()) -> Any:
        cursor.execute(self.sql(text), tuple(params))
        return cursor

    def eligible(self) -> str:
        """Rows a claim may take: pending and due, failed and due, or claimed with an
        expired lease. Takes one parameter: the lease length in ms (negated)."""
        return (
            "status IN (0, 1, 3) AND ("
            f"(status = 0 AND (next_retry_at IS NULL OR next_retry_at <= {self.now}))"
            f" OR (status = 3 AND next_retry_at <= {self.now})"
            f" OR (status = 1 AND claimed_at < {self.now_plus_ms()}))"
        )

    def message_select(self) -> str:
        cols = [c if c not in ("payload", "headers") else
                (self.payload_column() if c == "payload" else self.headers_column()) for c in MESSAGE_COLUMNS]
        return ", ".join(cols)

    # -- connections and errors ----------------------------------------------
    @abstractmethod
    def connect(self, url: str) -> Any:
        """Open a DB-API connection for the relay's own, short transactions."""

    def cursor_for(self, conn: Any) -> Any:
        """A cursor on the caller's connection that yields plain tuples."""
        return conn.cursor()

    def begin(self, cursor: Any) -> None:
        """Start a write transaction (drivers that open one implicitly need nothing)."""

    @abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Deadlock victim, lock timeout, serialization failure, dropped connection."""

    def is_disconnect(self, exc: BaseException) -> bool:
        return False

    def to_datetime(self, value: Any) -> datetime | None:
        """Database timestamps are UTC; return them as aware datetimes."""
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    # -- schema --------------------------------------------------------------
    @abstractmethod
    def migration(self, native_json: bool = False) -> list[Any]:
        """Statements that create or repair the schema, each guarded on its own.

        An item is either SQL that guards itself (IF NOT EXISTS) or a pair
        ``((probe_sql, probe_params), sql)``: ``sql`` runs only when the probe finds
        no row, for engines whose DDL has no IF NOT EXISTS form."""

    # -- write side (runs in the caller's transaction: never commit here) -------
    @abstractmethod
    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        """Insert one event, or find the row already stored under its message_id."""

    def event_params(self, event: NewEvent) -> list[Any]:
        return [event.message_id, event.topic, event.aggregate_type, event.aggregate_id,
                event.partition_key, event.payload_json, event.headers_json, event.trace_id]

    INSERT_COLUMNS = "message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers, trace_id"

    # -- claim ---------------------------------------------------------------
    def claim(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int) -> list[tuple]:
        """Lease up to ``batch`` rows inside the open transaction; return rows shaped
        like MESSAGE_COLUMNS (rows whose status is not 1 went dead instead).

        This generic version plans the chains in Python over a locked candidate set
        (see ``outbox.chains``); engines with a one-statement form override it."""
        self.begin(cursor)
        scan = self.limit(
            f"SELECT id, aggregate_id, status, attempts FROM {self.table} WHERE {self.eligible()} ORDER BY id"
        ) + self.lock_candidates
        rows = self.execute(cursor, scan, [-timeout_ms, batch]).fetchall()
        candidates = [Candidate(int(r[0]), r[1], int(r[2]), int(r[3])) for r in rows]
        if not candidates:
            return []
        plan = plan_claim(candidates, self._first_blockers(cursor, candidates), max_attempts)
        if plan.dead_ids:
            cond, params = self.ids_in(plan.dead_ids)
            self.execute(cursor, f"UPDATE {self.table} SET status = 4, processed_at = {self.now}, "
                         f"last_error = ?, lease_token = NULL, attempts = attempts + 1 WHERE {cond}",
                         [LEASE_EXPIRED_ERROR, *params])
        if plan.claim_ids:
            cond, params = self.ids_in(plan.claim_ids)
            self.execute(cursor, f"UPDATE {self.table} SET "
                         "attempts = attempts + CASE WHEN status = 1 THEN 1 ELSE 0 END, "
                         "last_error = CASE WHEN status = 1 THEN ? ELSE last_error END, "
                         f"status = 1, claimed_at = {self.now}, next_retry_at = NULL, lease_token = ? "
                         f"WHERE {cond}", [LEASE_EXPIRED_ERROR, lease, *params])
        cond, params = self.ids_in(sorted(plan.claim_ids + plan.dead_ids))
        return self.execute(cursor, f"SELECT {self.message_select()} FROM {self.table} WHERE {cond} ORDER BY id",
                            params).fetchall()

    def _first_blockers(self, cursor: Any, candidates: Sequence[Candidate]) -> dict[str, int]:
        aggregates = sorted({c.aggregate_id for c in candidates})
        ids = [c.id for c in candidates]
        sql = (f"SELECT aggregate_id, MIN(id) FROM {self.table} WHERE status IN (0, 1, 3) "
               f"AND aggregate_id IN ({', '.join('?' * len(aggregates))}) AND id < ? "
               f"AND id NOT IN ({', '.join('?' * len(ids))}) GROUP BY aggregate_id")
        rows = self.execute(cursor, sql, [*aggregates, max(ids), *ids]).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def to_message(self, row: Sequence[Any], lease: str) -> OutboxMessage:
        headers = row[7]
        if isinstance(headers, (str, bytes)):
            headers = json.loads(headers) if headers else {}
        payload = row[6]
        if isinstance(payload, bytes):
            payload = payload.decode("utf-8")
        elif not isinstance(payload, str):  # a driver that decoded JSON for us
            payload = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return OutboxMessage(id=int(row[0]), message_id=row[1], topic=row[2], aggregate_type=row[3],
                             aggregate_id=row[4], partition_key=row[5], payload=payload,
                             headers=headers or {}, trace_id=row[8], attempts=int(row[9]),
                             created_at=self.to_datetime(row[10]), lease=lease)  # type: ignore[arg-type]

    # -- acknowledgements (each fenced by the lease token) -----------------------
    def mark_done_sql(self, cond: str) -> str:
        return (f"UPDATE {self.table} SET status = 2, processed_at = {self.now}, lease_token = NULL "
                f"WHERE {cond} AND lease_token = ? AND status = 1")

    def mark_failed_sql(self) -> str:
        # Assignments reference only columns assigned after them: MySQL applies SET
        # left to right, every other engine uses the old row; this order suits both.
        dead = "(? = 1 OR attempts + 1 >= ?)"
        return (f"UPDATE {self.table} SET "
                f"status = CASE WHEN {dead} THEN 4 ELSE 3 END, "
                f"next_retry_at = CASE WHEN {dead} THEN NULL ELSE {self.now_plus_ms()} END, "
                f"processed_at = CASE WHEN {dead} THEN {self.now} ELSE NULL END, "
                "last_error = ?, lease_token = NULL, attempts = attempts + 1 "
                "WHERE id = ? AND lease_token = ? AND status = 1")

    def release_sql(self, cond: str) -> str:
        return (f"UPDATE {self.table} SET status = 0, claimed_at = NULL, lease_token = NULL, "
                f"next_retry_at = CASE WHEN ? > 0 THEN {self.now_plus_ms()} ELSE NULL END "
                f"WHERE {cond} AND lease_token = ? AND status = 1")

    # -- housekeeping ----------------------------------------------------------
    def purge_chunk_sql(self) -> str:
        """Delete at most ``?`` done rows processed before now minus ``?`` ms."""
        return (f"DELETE FROM {self.table} WHERE id IN (SELECT id FROM {self.table} "
                f"WHERE status = 2 AND processed_at < {self.now_plus_ms()} ORDER BY id LIMIT ?)")

    def purge_params(self, older_than_ms: int, batch: int) -> list[Any]:
        return [-older_than_ms, batch]

    def requeue_sql(self, cond: str) -> str:
        return (f"UPDATE {self.table} SET status = 0, attempts = 0, next_retry_at = NULL, claimed_at = NULL, "
                f"processed_at = NULL, lease_token = NULL WHERE status = 4 AND {cond}")


def first(rows: Iterable[Sequence[Any]]) -> Any:
    for row in rows:
        return row[0]
    return None
