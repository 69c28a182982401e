"""What every engine shares. An engine module subclasses ``Engine`` and supplies only
what differs: SQL text (DDL, the claim, id lists, clock arithmetic) and driver
quirks (connecting, placeholders, error codes, value types).

SQL here is written with ``?`` placeholders; engines whose driver wants ``%s``
set ``placeholder`` and ``sql()`` rewrites the text once.
"""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

from ...core.config import validate_identifier
from ...core.model import FailureKind, NewEvent, OutboxMessage, Status
from ...domain.chains import Candidate, ClaimPlan, chain_key, keep_locked, plan_claim
from . import rows

log = logging.getLogger("outbox.storage.engines")

#: Columns handed to the relay, in this order, by every claim implementation.
MESSAGE_COLUMNS = ("id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
                   "payload", "headers", "trace_id", "attempts", "created_at", "status")

_ATTEMPTS, _STATUS = MESSAGE_COLUMNS.index("attempts"), MESSAGE_COLUMNS.index("status")


def leased_or_full(rows: list[tuple]) -> tuple[list[tuple], bool]:
    """A one-statement claim pass's answer as ``Engine.claim_pass`` returns it: the statement
    answers the rows it leased or, having leased nothing, one row of NULLs when its window
    was full and no row when it was not (PostgreSQL's statement, SQL Server's batch)."""
    full = bool(rows) and rows[0][0] is None
    return ([] if full else rows), full


def claimed_rows(read: dict[int, tuple], plan: ClaimPlan) -> list[tuple]:
    """The rows ``plan`` took, as the claim's updates left them, from their locking read
    (``read``: MESSAGE_COLUMNS, locked by this transaction, so nothing else changed them):
    a claimed row is status 1 with an attempt more when it was re-claimed from status 1
    (an expired lease), a dead one status 4 with an attempt more. In id order."""
    out = []
    dead = set(plan.dead_ids)
    for i in sorted(plan.claim_ids + plan.dead_ids):
        row = list(read[i])
        row[_ATTEMPTS] = int(row[_ATTEMPTS]) + (1 if i in dead or int(row[_STATUS]) == Status.CLAIMED else 0)
        row[_STATUS] = int(Status.DEAD if i in dead else Status.CLAIMED)
        out.append(tuple(row))
    return out


LEASE_EXPIRED_ERROR = "lease expired: the worker holding this row was lost before it acknowledged"

#: ``last_error`` of a row the claim could not decode (a NULL or malformed column, JSON
#: that is not JSON): it goes dead at once, alone (``OutboxStore.claim``).
UNDECODABLE_PREFIX = "undecodable row: "
#: ``last_error`` of a row the publisher refused as POISON (not encodable, over AMQP's or
#: the broker's limits): the relay records ``"<kind>: <reason>"``.
POISON_PREFIX = f"{FailureKind.POISON}: "
#: The one definition of a *permanent* reason: a dead row whose ``last_error`` starts with
#: one of these fails again the same way when requeued as it is, so ``outbox dead
#: requeue`` refuses it unless forced (after the row or the limit was fixed).
PERMANENT_ERROR_PREFIXES = (UNDECODABLE_PREFIX, POISON_PREFIX)
#: What a ``last_error`` begins with to say its kind: ``OutboxStore.mark_failed`` masks the
#: passwords of what follows only, so that no password equal to a kind's word turns a permanent
#: reason into another (docs/relay.md, "Secrets in output").
ERROR_KIND_PREFIXES = (UNDECODABLE_PREFIX, *(f"{kind}: " for kind in FailureKind))


def is_permanent_error(error: str | None) -> bool:
    """Does this ``last_error`` say that a requeue alone cannot help?"""
    return bool(error) and str(error).startswith(PERMANENT_ERROR_PREFIXES)


def duration(seconds: float) -> str:
    """``seconds`` as an operator reads it: ``42 s``, ``3 min 12 s``, ``2 h 5 min``."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


def tcp_keepalive(tcp_timeout_s: int) -> tuple[int, int, int]:
    """``(idle, interval, count)`` in seconds: TCP keepalive probes that find a silent peer
    in at most ``tcp_timeout_s`` (idle + interval * count), for the PostgreSQL and MySQL
    engines' sockets (``config.SESSION_BOUNDS``)."""
    idle = max(1, tcp_timeout_s // 2)
    rest = max(1, tcp_timeout_s - idle)
    count = min(3, rest)
    return idle, rest // count, count


#: Characters of a holder id (a relay worker process: docs/internals.md, "Lost workers"): 16 hex
#: characters, the first half of every lease token that process makes.
HOLDER_ID_CHARS = 16


#: The longest identifier every engine takes (PostgreSQL's 63; MySQL's 64, SQL Server's 128).
MAX_IDENTIFIER = 63


def derived_name(prefix: str, table: str, suffix: str) -> str:
    """``<prefix><table><suffix>`` (an index, a constraint, the holders table), shortened with
    a hash of the table's name when that would pass ``MAX_IDENTIFIER``. A table name may
    take 63 characters; its index names did not fit: PostgreSQL cut them (two collided, and
    ``outbox check`` found them missing for ever) and MariaDB refused them, half-way through
    the migration (found in review). A name that fits is unchanged."""
    name = f"{prefix}{table}{suffix}"
    if len(name) <= MAX_IDENTIFIER:
        return name
    keep = MAX_IDENTIFIER - len(prefix) - len(suffix) - 9
    return f"{prefix}{table[:keep]}_{hashlib.sha1(table.encode()).hexdigest()[:8]}{suffix}"


@dataclass(frozen=True)
class IndexShape:
    """An index's definition as ``outbox check`` compares it (docs/operations.md, "Is it set up
    right? `outbox check`"): its key columns in order (`` DESC`` after a descending one; PostgreSQL's
    and SQLite's with a collation other than the column's, PostgreSQL's with an operator class and
    NULLS order other than the defaults), uniqueness, its
    partial predicate (the engine's text; compared through ``Engine.same_predicate``), its
    included columns, where the engine has several, its access method, and the catalog's word
    for an index the engine keeps but its optimizer passes over (``state``: PostgreSQL's INVALID,
    SQL Server's DISABLED, MariaDB's IGNORED, MySQL's INVISIBLE; None for a usable one: docs/operations.md,
    same section)."""

    keys: tuple[str, ...]
    unique: bool = False
    where: str | None = None
    include: tuple[str, ...] = ()
    method: str | None = None
    state: str | None = None

    def text(self) -> str:
        """``UNIQUE (a, b) INCLUDE (c) WHERE p USING m STATE``, for a report line."""
        text = ("UNIQUE " if self.unique else "") + f"({', '.join(self.keys)})"
        text += f" INCLUDE ({', '.join(self.include)})" if self.include else ""
        text += f" WHERE {self.where}" if self.where else ""
        text += f" USING {self.method}" if self.method else ""
        return text + (f" {self.state}" if self.state else "")


@dataclass(frozen=True)
class IndexDiffers:
    """A migration step's probe (``Engine.migration``) for the step that builds index ``name``
    again: the step runs when the index exists and is not defined as ``Engine.expected_indexes``
    says, compared as ``outbox check`` compares it (``describe.index_differs``: one comparison
    for both; docs/operations.md, "Is it set up right? `outbox check`"). ``apply_migration``
    reads it."""

    name: str


def normalize_predicate(text: str) -> str:
    """A predicate without brackets, parentheses, spaces and case: catalogs write the text the
    migration gave back with their own parentheses (``(processed_at IS NULL)``)."""
    for noise in ("[", "]", "(", ")", " ", '"', "`"):
        text = text.replace(noise, "")
    return text.lower()


def holders_table_name(table: str) -> str:
    """The holders table of an outbox table: ``<table>_holders`` (``derived_name``)."""
    return derived_name("", table, "_holders")


def sql_literal(value: Any) -> str:
    """``value`` as an SQL literal (None, a number, a string: what migration probes take)."""
    if value is None:
        return "NULL"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def inline_params(sql: str, params: Sequence[Any]) -> str:
    """``sql`` with each ``?`` placeholder replaced by its parameter as a literal."""
    parts = sql.split("?")
    if len(parts) != len(params) + 1:
        raise ValueError(f"{len(parts) - 1} placeholders for {len(params)} parameters: {sql}")
    return "".join(part + (sql_literal(value) if i < len(params) else "")
                   for i, (part, value) in enumerate(zip(parts, [*params, None], strict=True)))


@contextmanager
def committing(conn: Any) -> Iterator[None]:
    """Commit ``conn`` when the block ends, roll it back when it raises (a DB-API connection,
    a SQLAlchemy Connection or Session: ``outbox.transaction``)."""
    try:
        yield
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


class Engine(ABC):
    """One database engine. Instances are cheap; they hold names, not connections."""

    name: ClassVar[str]
    #: The driver's positional placeholder.
    placeholder: ClassVar[str] = "?"
    #: Appended to the candidate scan of the generic claim (row locks, skip locked).
    lock_candidates: ClassVar[str] = ""
    default_schema: ClassVar[str | None] = None
    #: ``migration(native_json=True)`` makes the payload a native JSON column (SQL Server
    #: 2025+ and Azure SQL); elsewhere the table keeps its own JSON type and check.
    native_json: ClassVar[bool] = False
    #: The table hint of a read that takes no shared lock, for an engine whose plain read
    #: can wait on a writer's lock (the metrics' gauges, ``gauges_sql``, and ``outbox status``).
    unlocked_read: ClassVar[str] = ""
    #: The table hints of the statements that count and end a lost holder's leases
    #: (``held_by_sql``, ``end_leases_sql``) and hand back a doubtful lease's rows
    #: (``release_lease_sql``), for an engine whose reads and updates would wait on locks
    #: others hold on rows that lease or holder does not: read past them.
    past_locks_read: ClassVar[str] = ""
    past_locks_update: ClassVar[str] = ""
    #: The indexes ``migrate`` leaves on the table, by suffix of ``index_name`` (what
    #: ``outbox check`` looks for).
    index_suffixes: ClassVar[tuple[str, ...]] = ("message_id", "agg_id_id", "claim_ready", "done_processed_at")

    def __init__(self, table: str = "outbox", schema: str | None = None) -> None:
        # Names reach SQL text: only plain identifiers, on every path (settings, enqueue's
        # table=/schema=, a store built by hand), so quoting never meets a quote character.
        validate_identifier(table, "table")
        if schema is not None:
            validate_identifier(schema, "schema")
        self.table_name = table
        self.schema = schema or self.default_schema
        self.table = self.qualify(table)
        #: The liveness records of the relay's worker processes (docs/internals.md, "Lost workers").
        self.holders_name = holders_table_name(table)
        self.holders = self.qualify(self.holders_name)

    # -- names ---------------------------------------------------------------
    def quote(self, identifier: str) -> str:
        """A delimited identifier (SQL standard: a ``"`` inside is doubled)."""
        return '"' + identifier.replace('"', '""') + '"'

    def qualify(self, name: str) -> str:
        return f"{self.quote(self.schema)}.{self.quote(name)}" if self.schema else self.quote(name)

    def index_name(self, suffix: str) -> str:
        return derived_name("ix_", self.table_name, f"_{suffix}")

    #: What the engine did with a name longer than ``MAX_IDENTIFIER``, as releases before
    #: ``derived_name`` wrote them: (its limit, True if it cut the name there, False if it refused it).
    identifier_limit: ClassVar[tuple[int, bool]] = (128, False)

    def legacy_name(self, prefix: str, suffix: str) -> str | None:
        """The name releases before ``derived_name`` gave an index or constraint, ``<prefix><table>
        <suffix>`` as the engine kept it (PostgreSQL cut it at 63 characters), where it differs from
        today's; None otherwise, or where the engine refused it. ``outbox migrate`` renames what it
        finds under that name rather than build a second copy beside it (docs/internals.md, "Index
        names of long tables")."""
        limit, cut = self.identifier_limit
        name = f"{prefix}{self.table_name}{suffix}"
        kept = name[:limit] if cut else name if len(name) <= limit else None
        return kept if kept != derived_name(prefix, self.table_name, suffix) else None

    def table_exists(self, cursor: Any, table: str) -> bool:
        """Whether ``table`` (as the engine's SQL names it: ``self.table``, ``self.holders``)
        exists, asked inside a transaction that goes on after it (``OutboxStore.schema_state``,
        read under the migration's lock). Here: a read that fails, which ends no transaction
        (MySQL, SQLite); PostgreSQL and SQL Server, where it would, ask the catalog."""
        try:
            self.execute(cursor, f"SELECT 1 FROM {table} WHERE 1 = 0").fetchall()
        except Exception as exc:
            if self.is_missing_table(exc):
                return False
            raise
        return True

    def table_columns(self, cursor: Any) -> frozenset[str]:
        """The names of the table's columns, lower case (``OutboxStore.schema_state``). Here: a
        read of no row; SQL Server asks its catalog (``MssqlSchema.table_columns``)."""
        self.execute(cursor, f"SELECT * FROM {self.table} WHERE 1 = 0")
        return frozenset(str(d[0]).lower() for d in cursor.description)

    def unreadable_table(self, cursor: Any) -> str | None:
        """Why the table, which exists, cannot be read, with what to do, as `outbox check` says it;
        None when nothing in the catalog stops a read. Here: nothing does; SQL Server's disabled
        clustered index does (``MssqlSchema.unreadable_table``; docs/sqlserver.md, "A disabled
        clustered index")."""
        return None

    def column_problem(self, cursor: Any) -> str | None:
        """What is wrong with the table's columns beyond their presence, with what to do, as `outbox
        check`'s table line says it and `outbox migrate`, which leaves it, reports it; None when
        nothing is. Here: nothing; MySQL/MariaDB's compared columns in a collation that is not
        binary (``MysqlEngine.column_problem``; docs/operations.md, "Is it set up right? `outbox
        check`")."""
        return None

    def migration_error_hint(self, cursor: Any, exc: BaseException) -> str | None:
        """What to do about ``exc``, the error a migration step failed with, in the operator's terms
        (``apply_migration`` raises it as a ``StoreError`` whose cause is ``exc``), read from the error
        and, through ``cursor``, the catalog; None when the error says it all. Here: None. SQL Server
        explains a unique index whose rebuild finds duplicate keys, and a read-only or offline database
        or filegroup (``MssqlSchema.migration_error_hint``; docs/sqlserver.md, "A disabled clustered
        index")."""
        return None

    def storage_options(self, cursor: Any) -> frozenset[str]:
        """The table's own storage parameters as ``name=value`` (PostgreSQL's reloptions; none
        elsewhere): ``outbox migrate`` names those it set."""
        return frozenset()

    def definitions(self, cursor: Any) -> frozenset[tuple[str, str]]:
        """``(name, definition)`` of the table's indexes and CHECK constraints as the catalog
        writes them (PostgreSQL's; none elsewhere): ``outbox migrate`` names those it rebuilt
        or added (an index that keeps its name but not its definition, a constraint)."""
        return frozenset()

    @abstractmethod
    def expected_indexes(self) -> dict[str, IndexShape]:
        """The definition of each index ``migrate`` leaves (``index_suffixes``), by name: what
        ``outbox check`` compares the catalog's with (``describe.index_problems``)."""

    def same_predicate(self, live: str | None, expected: str | None) -> bool:
        """Whether the catalog's predicate ``live`` is ``expected`` (``normalize_predicate``)."""
        return normalize_predicate(live or "") == normalize_predicate(expected or "")

    def index_refusal(self, cursor: Any, name: str, live: IndexShape) -> str | None:
        """What to do first about the index ``name``, defined as ``live`` (not as
        ``expected_indexes`` says, and not in its state alone), when `outbox migrate` refuses to
        build it again itself (its migration fails naming it), for `outbox check`'s line
        (``describe.index_problems``; ``cursor``: the catalog's, where the shape does not say
        it); None when the migration builds it again. Here: it always does."""
        return None

    def usable_again(self, state: str) -> str | None:
        """The word of the statement that makes an index in ``state`` (``IndexShape.state``)
        usable without building it again, as `outbox migrate`'s report names it; None where the
        migration builds it again. Here: it does (SQL Server's DISABLED, PostgreSQL's INVALID)."""
        return None

    def legacy_index_name(self, suffix: str) -> str | None:
        return self.legacy_name("ix_", f"_{suffix}")

    def legacy_renames(self) -> list[tuple[str, str]]:
        """``(an earlier release's name, today's)`` of what ``outbox migrate`` renames in place."""
        return [(old, self.index_name(suffix)) for suffix in self.index_suffixes
                if (old := self.legacy_index_name(suffix))]

    def exact(self, column: str) -> str:
        """``column`` as a ``GROUP BY`` that tells apart every two different values, as the
        relay's Python does: an engine whose collation compares ``'x'`` and ``'x '`` equal
        (MySQL's PAD SPACE) groups by the bytes (docs/internals.md, "Aggregate ids compare
        exactly")."""
        return column

    def exact_in(self, column: str, values: Sequence[str]) -> tuple[str, list[Any]]:
        """A condition that ``column`` is exactly one of ``values`` (text), and its parameters:
        ``column IN (...)`` where the column's equality is exact (PostgreSQL's deterministic
        collations, SQLite's BINARY); an engine whose equality ignores trailing spaces or case
        compares bytes: ``exact`` (MySQL's binary string against a text parameter compares
        bytes; SQL Server says it its own way) (``outbox dead ... --topic``: docs/relay.md,
        "Requeueing dead rows")."""
        listed, params = self.in_list(values)
        return f"{self.exact(column)} IN {listed}", params

    # -- notifications (docs/waking-and-metrics.md, "LISTEN/NOTIFY") -----------
    #: Can the engine deliver a notification at commit (NOTIFY) to a listener?
    supports_notify: ClassVar[bool] = False

    def notify(self, cursor: Any, channel: str) -> None:
        """Queue a notification on ``channel`` in the cursor's transaction."""
        raise NotImplementedError(f"{self.name} has no NOTIFY")

    @classmethod
    def listen_connection(cls, url: str, channel: str) -> Any:
        """A dedicated autocommit connection LISTENing on ``channel``; its ``notifies``
        yields notifications (psycopg's interface)."""
        raise NotImplementedError(f"{cls.name} has no LISTEN")

    # -- SQL text ------------------------------------------------------------
    now: ClassVar[str] = "CURRENT_TIMESTAMP"
    #: A function giving a text's length, at least its number of characters (MySQL's LENGTH
    #: counts bytes, SQL Server's DATALENGTH too: more, never fewer).
    text_length: ClassVar[str] = "LENGTH"

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

    def in_list(self, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """``(?, ?, ...)`` for ``values``, the list an ``IN`` tests, and its parameters. An
        engine whose statements have a parameter limit passes a long list another way."""
        return f"({', '.join('?' * len(values))})", list(values)

    def ids_in(self, ids: Sequence[int]) -> tuple[str, list[Any]]:
        """A condition ``id IN (...)`` and its parameters."""
        if not ids:
            return "1 = 0", []
        listed, params = self.in_list(ids)
        return f"id IN {listed}", params

    def sql(self, text: str) -> str:
        return text if self.placeholder == "?" else text.replace("%", "%%").replace("?", self.placeholder)

    def execute(self, cursor: Any, text: str, params: Sequence[Any] = ()) -> Any:
        cursor.execute(self.sql(text), tuple(params))
        return cursor

    def executemany(self, cursor: Any, text: str, rows: Sequence[Sequence[Any]]) -> Any:
        """``text`` once per row of ``rows`` (the driver's ``executemany``)."""
        cursor.executemany(self.sql(text), rows)
        return cursor

    def open_rows(self, alias: str = "") -> str:
        """The open rows (pending, claimed, failed): what the claim's partial indexes hold.
        An engine whose indexes say it another way returns their predicate too, so that
        every query on open rows can use them (PostgreSQL: docs/internals.md, "The lease is a
        HOT update on PostgreSQL")."""
        return f"{alias}status IN (0, 1, 3)"

    def gauges_sql(self) -> str:
        """The metrics' gauges in one query on the open rows: rows claimed, rows open, the
        oldest open row's ``created_at``, the database clock. It never waits for a lock (an
        uncommitted enqueue must not stall it): docs/waking-and-metrics.md, "Metrics"."""
        return (f"SELECT COUNT(CASE WHEN status = 1 THEN 1 END), COUNT(*), MIN(created_at), {self.now} "
                f"FROM {self.open_rows_source()}{self.unlocked_read} WHERE {self.open_rows()}")

    def eligible_branches(self) -> list[tuple[int, str]]:
        """``eligible()`` per status: (status, the condition on the row's other columns);
        only the claimed rows' condition takes the parameter (the lease length in ms, negated)."""
        return [(0, f"(next_retry_at IS NULL OR next_retry_at <= {self.now})"),
                (3, f"next_retry_at <= {self.now}"),
                (1, f"claimed_at < {self.now_plus_ms()}")]

    def eligible(self) -> str:
        """Rows a claim may take: pending and due, failed and due, or claimed with an
        expired lease. Takes one parameter: the lease length in ms (negated)."""
        branches = " OR ".join(f"(status = {status} AND {cond})" for status, cond in self.eligible_branches())
        return f"{self.open_rows()} AND ({branches})"

    def open_rows_source(self) -> str:
        """The table as the generic claim's reads of open rows name it (``FROM ...``): an
        engine whose planner must be told to read them through the open rows' index adds
        its hint here."""
        return self.table

    def window_source(self) -> str:
        """The table as the claim window's walks of ``claim_ready`` name it (``window_sql``):
        ``open_rows_source`` unless the engine's planner must be told that index."""
        return self.open_rows_source()

    def chains_source(self) -> str:
        """The table as the claim's reads of the window's aggregates' open rows name it (the
        first open row of each: ``_first_blockers``, ``unblocked_rows``): ``open_rows_source``
        unless the engine's planner must be told to read them per aggregate, so that the rows
        of other aggregates (failed rows waiting for their time) are not read."""
        return self.open_rows_source()

    def id_range_source(self) -> str:
        """The table as statements that walk a range of ids name it (``FROM ...``): the
        pipeline's pages, the archive's deletes and the purge's chunks. An engine whose
        planner would walk another index over every matching row instead adds its hint here."""
        return self.table

    #: How far past a window of blocked rows a claim reads (``claim_pass``'s ``read_past``): this many
    #: windows' worth of eligible rows at most, so its cost stays bounded however many rows
    #: wait behind waiting heads (docs/internals.md, "Claim windows").
    BLOCKED_SCAN = 64

    def message_select(self) -> str:
        cols = [c if c not in ("payload", "headers") else
                (self.payload_column() if c == "payload" else self.headers_column()) for c in MESSAGE_COLUMNS]
        return ", ".join(cols)

    # -- connections and errors ----------------------------------------------
    #: May ``connect`` create the database it names when it does not exist (SQLite's file; a
    #: server's database is never created)? The relay's and the command line's stores turn it
    #: off but for ``outbox migrate`` (``OutboxStore(existing=True)``, ``OutboxStore.migrate``).
    creates_database: bool = True

    @abstractmethod
    def connect(self, url: str) -> Any:
        """Open a DB-API connection for the relay's own, short transactions, with the
        bounds on their life the engine can set (docs/relay.md, "A network cut")."""

    #: Is the claim one statement, which the server can run as a transaction of its own
    #: (``statement_alone``)? Then claim and COMMIT are one round trip, and no moment exists
    #: when the claim's locks wait for the client's COMMIT (docs/relay.md, "A network cut").
    one_statement_claim: ClassVar[bool] = False
    #: Does the server end a session left idle inside a transaction, and its locks with it
    #: (PostgreSQL's ``idle_in_transaction_session_timeout``, MariaDB's
    #: ``idle_transaction_timeout``, MySQL's ``wait_timeout``, all set at connect; SQLite has
    #: no network)? Where it does not (SQL Server), work whose locks would wait for the
    #: client's COMMIT runs alone instead, each statement committed as it runs, even where
    #: that gives up atomicity across its statements (docs/relay.md, "A network cut").
    ends_idle_transactions: ClassVar[bool] = True

    @staticmethod
    @contextmanager
    def autocommit(conn: Any) -> Iterator[None]:
        """``conn.autocommit`` on for the block and off again after it (a client-side
        attribute of psycopg 3, pyodbc and mssql-python): what ``statement_alone`` uses."""
        conn.autocommit = True
        try:
            yield
        finally:
            try:
                conn.autocommit = False
            except Exception:  # a broken connection: the store drops it
                log.debug("outbox: cannot restore autocommit off", exc_info=True)

    def in_use(self) -> AbstractContextManager[None]:
        """Around every use of the engine's own connections (connecting, a transaction, a
        statement outside one): ``storage.connections`` enters it before its own lock. Here:
        nothing; SQLite's makes a fork of the process wait for no use in flight
        (docs/internals.md, "Worker processes")."""
        return nullcontext()

    @contextmanager
    def statement_alone(self, conn: Any) -> Iterator[None]:
        """Each statement the block runs on ``conn`` is a transaction of its own, committed
        by the server as it ends (autocommit), where the driver can do it for free; the
        caller runs only single statements that must be atomic alone. Here: unchanged (the
        block's statements share the caller's transaction)."""
        yield

    def read_server(self, cursor: Any) -> None:  # noqa: B027 - a hook: most engines learn nothing
        """Learn, from the connection ``cursor`` runs on, what the SQL built next may use
        (SQL Server: OPENJSON and ISJSON). The engine's own connections do this at connect;
        a caller's connection (a Django or Alembic migration, the Django admin) is probed
        here first. Nothing to learn on most engines."""

    def cursor_for(self, conn: Any) -> Any:
        """A cursor on the caller's connection that yields plain tuples."""
        return conn.cursor()

    def ddl_cursor(self, conn: Any) -> Any:
        """A cursor for a migration on one of the engine's own connections: ``cursor_for``
        here; an engine whose connections bound each statement's time makes it without
        that bound (SQL Server: docs/sqlserver.md, "Drivers")."""
        return self.cursor_for(conn)

    @contextmanager
    def ddl_bounds(self, cursor: Any) -> Iterator[None]:
        """How long a migration's DDL steps on one of the engine's own connections wait for a
        table's lock, for the block (``Connections.transaction(ddl=True)``). Here: unchanged;
        PostgreSQL and MariaDB bound them in ``lock_migration``, SQL Server here, where the
        bound is the session's (SET LOCK_TIMEOUT) and is put back after the block."""
        yield

    def commits_each_statement(self, conn: Any) -> bool:
        """Is the connection in autocommit mode (psycopg, pyodbc, mssql-python: ``autocommit``)?
        ``enqueue`` asks it of the caller's connection before the insert (the event then
        commits by itself, not with the caller's transaction); SQL Server's claim and lease
        batches ask it of their own, run alone by ``statement_alone``, to open and commit
        their own transaction."""
        return getattr(conn, "autocommit", False) is True

    def begin(self, cursor: Any) -> None:  # noqa: B027 - a hook: most drivers open the transaction themselves
        """Start a write transaction (drivers that open one implicitly need nothing)."""

    # -- outbox.transaction on the caller's connection (docs/waking-and-metrics.md, "outbox.transaction")
    def in_callers_transaction(self, conn: Any) -> bool:
        """Is the caller's own transaction open on ``conn``, a connection in autocommit mode
        (its BEGIN)? ``outbox.transaction`` cannot end it. False where the driver cannot
        tell (pyodbc, mssql-python)."""
        return False

    @contextmanager
    def own_transaction(self, conn: Any) -> Iterator[None]:
        """The outermost ``outbox.transaction`` block's transaction on the caller's DB-API
        connection: begun even in autocommit mode (``begun``), committed when the block
        ends, rolled back when it raises. A transaction the driver opened by itself
        (autocommit off, a statement ran before the block) is the one the block ends, as the
        driver's own ``commit()`` would."""
        with self.begun(conn), committing(conn):
            yield

    @contextmanager
    def begun(self, conn: Any) -> Iterator[None]:
        """A transaction open on ``conn`` for ``own_transaction``'s block. Here (pyodbc,
        mssql-python): autocommit, a client-side switch, is off for the block, then on again;
        with it off the driver begins the transaction itself."""
        if not self.commits_each_statement(conn):
            yield
            return
        conn.autocommit = False
        try:
            yield
        finally:
            try:
                conn.autocommit = True
            except Exception:  # a broken connection: the caller's to drop
                log.debug("outbox: cannot restore autocommit on", exc_info=True)

    @contextmanager
    def savepoint(self, conn: Any, name: str, lost: Callable[[], None]) -> Iterator[None]:
        """An ``outbox.transaction`` block nested in another on ``conn``: rolled back alone
        when it raises (``roll_back_block``), committed with the outer block. ``lost()`` is
        called when the savepoint is gone with the whole transaction (a deadlock): the outer
        block must not commit what follows (docs/waking-and-metrics.md, "outbox.transaction")."""
        self._run(conn, f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            if not self.roll_back_block(conn, name, f"ROLLBACK TO SAVEPOINT {name}", f"RELEASE SAVEPOINT {name}"):
                lost()
            raise
        self._run(conn, f"RELEASE SAVEPOINT {name}")

    def roll_back_block(self, conn: Any, name: str, *statements: str) -> bool:
        """Run ``statements``, which roll a nested block that raised back to its savepoint
        ``name``; False when they fail (the savepoint is gone), logged, never raised: the
        block's error is what the caller sees. A deadlock (InnoDB, SQL Server) rolls the
        whole transaction back, and the savepoint with it: the rollback's "savepoint does not
        exist" replaced the deadlock, which a caller retries on (found in review)."""
        try:
            for statement in statements:
                self._run(conn, statement)
        except Exception:
            log.debug("outbox: cannot roll back to savepoint %s (the transaction may be gone)", name, exc_info=True)
            return False
        return True

    def _run(self, conn: Any, statement: str) -> None:
        cursor = self.cursor_for(conn)
        try:
            self.execute(cursor, statement)
        finally:
            cursor.close()

    @abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Deadlock victim, lock timeout, serialization failure, dropped connection."""

    def is_disconnect(self, exc: BaseException) -> bool:
        return False

    def is_lock_timeout(self, exc: BaseException) -> bool:
        """A statement gave up waiting for a lock (``lock_timeout``, ``lock_wait_timeout``):
        transient for the relay's work, but a migration's DDL is not tried again
        (``Connections.run``; README, "The table")."""
        return False

    def migration_lock_bound(self) -> str:
        """How long a migration's DDL step waits for a table's lock, in words."""
        return "the lock timeout"

    def lock_holders(self, cursor: Any, tables: Sequence[str]) -> str | None:
        """Who holds ``tables`` (qualified names) locked, in words, for the error of a
        migration that gave up waiting (``storage.store.migration_lock_refusal``); None
        where the engine cannot tell."""
        return None

    def is_missing_table(self, exc: BaseException) -> bool:
        """The statement named a table that does not exist (the holders table of a deployment
        that was not migrated since it came: docs/internals.md, "Lost workers")."""
        return False

    def missing_table_hint(self) -> str:
        """What to do when the outbox table is missing: what ``enqueue`` and the CLI say."""
        return f"table {self.table} missing: run `outbox migrate` (it creates the table and its indexes)"

    def is_missing_column(self, exc: BaseException) -> bool:
        """The statement named a column the table lacks: a table made by an older release
        (or another script) that ``outbox migrate`` has not brought up to date."""
        return False

    def schema_error_hint(self, exc: BaseException) -> str | None:
        """What to do about ``exc`` when it says the schema is not this release's (a table
        or a column missing), or None for any other error: what ``enqueue`` and the
        relay's claim raise as a ``StoreError``, the driver's error as its cause."""
        if self.is_missing_table(exc):
            return self.missing_table_hint()
        if self.is_missing_column(exc):
            return (f"table {self.table} lacks a column this release uses (made by an older release or another "
                    "script): run `outbox migrate`, which adds every column of the contract it lacks; `outbox check` names "
                    f"what is missing ({type(exc).__name__}: {' '.join(str(exc).split())})")
        return None

    def to_datetime(self, value: Any) -> datetime | None:
        """Database timestamps are UTC; return them as aware datetimes."""
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    # -- schema --------------------------------------------------------------
    @abstractmethod
    def migration(self, native_json: bool = False) -> list[Any]:
        """Statements that create or repair the schema, each guarded on its own.

        An item is either SQL that guards itself (IF NOT EXISTS) or a pair
        ``((probe_sql, probe_params), sql)``: ``sql`` runs only when the probe finds
        no row, for engines whose DDL has no IF NOT EXISTS form; or ``(IndexDiffers(name),
        sql)``: ``sql`` runs only when the index is there and defined otherwise."""

    def online_migration(self, native_json: bool = False) -> tuple[list[Any], list[list[Any]]] | None:
        """``migration()`` in two parts where the engine can build an index without holding the
        table's writers back (PostgreSQL's ``CONCURRENTLY``, which no transaction may hold): the
        steps ``apply_migration`` runs in the migration's transaction, and the steps
        ``apply_online_migration`` runs after its commit, on the same connection outside any
        transaction, one list per index. None here: ``migration()`` runs whole in the
        transaction (docs/internals.md, "Index builds that hold no writer back")."""
        return None

    def lock_online_migration(self, cursor: Any) -> float:
        """``lock_migration``'s lock for the session, taken outside a transaction before the
        migration's transaction and held through ``online_migration``'s second part, until
        ``unlock_online_migration``. Returns the seconds it waited for another migration of
        the table to give it back (0: it was free). Here: no lock (only online_migration's engines)."""
        return 0.0

    def unlock_online_migration(self, cursor: Any) -> None:  # noqa: B027 - a hook: only online_migration's engines
        """Release what ``lock_online_migration`` took."""

    @contextmanager
    def online_build_bounds(self, cursor: Any) -> Iterator[None]:
        """The session's settings for ``online_migration``'s second part, put back after it
        (``apply_online_migration``). Here: unchanged."""
        yield

    def migration_script(self, native_json: bool = False) -> list[str] | None:
        """``migration()`` as SQL text that needs no connection (Alembic's offline mode,
        ``alembic upgrade --sql``): every step guarding itself, so the script does what
        ``apply_migration`` does on a new table and on one made before. None where the
        engine's SQL cannot guard a step without a probe run first (docs/flask.md,
        "Offline SQL")."""
        return None

    def migration_lock_resource(self) -> str:
        """The name of the lock that lets one migration of this table run at a time."""
        return f"outbox migrate {self.table}"

    def lock_migration(self, cursor: Any) -> float | None:
        """Wait until no other migration of this table runs, before ``migration()``'s first
        step. Two at once (every replica's start-up, a deploy job beside ``manage.py
        migrate``) would both find a step not yet made and both make it; the second then
        fails (a duplicate table, column or constraint). The lock lasts until
        ``unlock_migration`` or the commit. SQLite's writer lock serializes them already;
        SQL Server's migration takes its lock in its first batch (``migration_lock_step``).
        Returns the seconds it waited for another migration (0: none), None where it does
        not say (here: no lock)."""
        return None

    #: Whether ``migration()``'s first step takes the migration's lock (SQL Server's
    #: ``sp_getapplock`` batch), not ``lock_migration``: ``apply_migration`` reads what it
    #: reports after that step.
    migration_lock_step: ClassVar[bool] = False

    #: Whether ``lock_migration``'s lock lasts only as long as the transaction, so that a
    #: migration on an autocommit connection must run its steps in one.
    migration_in_transaction: ClassVar[bool] = False

    #: Whether a migration on an autocommit connection (a Django migration) must run its steps
    #: under one writer lock (``own_transaction``), so that no other connection sees a step's
    #: half: SQLite's claim names its indexes (``INDEXED BY``) and failed with "no such index"
    #: between a rebuild's ``DROP INDEX`` and its ``CREATE INDEX`` (docs/internals.md, "Rows
    #: waiting for a later time are not read").
    migration_under_writer_lock: ClassVar[bool] = False

    def unlock_migration(self, cursor: Any) -> None:  # noqa: B027 - a hook: most locks go with the commit
        """Release what ``lock_migration`` took, where the commit does not."""

    # -- a session's own lock (the pipeline's archive lock: docs/pipeline.md, "One run at a time")
    def session_lock_statements(self, name: str, idle_s: int) -> list[tuple[str, list[Any]]] | None:
        """Statements that take the exclusive lock ``name`` for this session, without
        waiting, on a connection in autocommit; the last returns one row whose first value
        says whether it was granted (``session_lock_granted``). The lock ends with the
        session. ``idle_s``: how long the session may stay silent before the server ends it,
        for an engine that would otherwise keep a vanished holder's session (and lock) for
        hours. None: the engine has no server session to hold one (SQLite)."""
        return None

    def session_unlock_statement(self, name: str) -> tuple[str, list[Any]]:
        """The statement that gives back what ``session_lock_statements`` took."""
        raise NotImplementedError(f"{self.name} has no session locks")

    def session_lock_granted(self, value: Any) -> bool:
        return bool(value)

    def session_lock_held_statement(self, name: str) -> tuple[str, list[Any]]:
        """A statement, on the session that took ``name`` (``session_lock_statements``),
        returning one row whose first value is true while that session holds it: a live
        answer, not the last ping's (docs/pipeline.md, "One run at a time")."""
        raise NotImplementedError(f"{self.name} has no session locks")

    def holders_migration(self) -> list[Any]:
        """The holders table (docs/internals.md, "Lost workers"), as ``migration`` items; each
        engine's ``migration`` ends with them. This form suits engines with
        ``CREATE TABLE IF NOT EXISTS``; ``holders_columns`` gives the types."""
        return [f"CREATE TABLE IF NOT EXISTS {self.holders} ({self.holders_columns()})"]

    def holders_columns(self) -> str:
        return ("holder_id CHAR(16) NOT NULL PRIMARY KEY, host VARCHAR(255) NOT NULL, pid INTEGER NOT NULL, "
                "started_at TIMESTAMP NOT NULL, beat_at TIMESTAMP NOT NULL")

    #: What ``upkeep`` looks at, named in `outbox check`'s report; None: this engine's own
    #: housekeeping needs nothing of the operator, and it has no ``upkeep``.
    UPKEEP: ClassVar[str | None] = None

    def upkeep(self, cursor: Any) -> tuple[str, list[str]]:
        """The database's own housekeeping of the outbox table, for `outbox check`: what it
        found, and what would let the relay slow down as the months go by, in words."""
        raise NotImplementedError(f"{self.name} has no upkeep to check")

    # -- write side (runs in the caller's transaction: never commit here) -------
    @abstractmethod
    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        """Insert one event, or find the row already stored under its message_id."""

    def insert_event_and_notify(self, cursor: Any, event: NewEvent, channel: str) -> int:
        """``insert_event`` and ``notify(channel)`` in the cursor's transaction (LISTEN/NOTIFY
        on: ``outbox.relay.listen``). Engines that can, do both in one statement."""
        outbox_id = self.insert_event(cursor, event)
        self.notify(cursor, channel)
        return outbox_id

    def event_params(self, event: NewEvent) -> list[Any]:
        return [event.message_id, event.topic, event.aggregate_type, event.aggregate_id,
                event.partition_key, event.payload_json, event.headers_json, event.trace_id]

    INSERT_COLUMNS = "message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers, trace_id"

    #: Whether several connections can write the table at once without waiting for each
    #: other (the archive deletes disjoint id ranges on several: docs/pipeline.md, step 7).
    concurrent_writes: ClassVar[bool] = True
    #: A statement after which this session's commits return before they are durable (the
    #: relay's own writes: docs/relay.md, "Commits that do not wait for the disk"), or None
    #: where the engine has no such setting for one session.
    async_commit_sql: ClassVar[str | None] = None

    # -- claim ---------------------------------------------------------------
    #: A claim reads this many times ``batch`` candidates and keeps ``batch`` rows of them,
    #: whole chains, oldest chain first: over few aggregates it takes several rows of some
    #: aggregates and leaves the others to a concurrent claimer (docs/internals.md, "Claim
    #: windows"). The default of ``window``, which the relay sets from
    #: ``OUTBOX_RELAY_CLAIM_WINDOW`` (``OutboxStore.use_claim_window``).
    CLAIM_WINDOW: ClassVar[int] = 2
    window: int = CLAIM_WINDOW

    def claim_window(self, batch: int) -> int:
        """How many candidates a claim of ``batch`` rows reads."""
        return batch * self.window

    def claim(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int,
              behind: Sequence[int] = ()) -> list[tuple]:
        """Lease up to ``batch`` rows inside the open transaction; return rows shaped
        like MESSAGE_COLUMNS (rows whose status is not 1 went dead instead).

        ``behind``: rows the caller holds and publishes before this claim's rows (a drain
        slice's share being published while its next claim is made): they do not block a
        chain, so the claim may take the rows that follow them in their aggregates
        (docs/internals.md, "Claims that continue a chain"). Every other open row blocks.

        One pass (``claim_pass``) over a window of eligible rows; when it took nothing from a
        full window, a second one reads past the window's blocked rows (docs/internals.md,
        "Claim windows")."""
        rows, window_full = self.claim_pass(cursor, batch, lease, timeout_ms, max_attempts, behind, read_past=False)
        if not rows and window_full:
            rows, _ = self.claim_pass(cursor, batch, lease, timeout_ms, max_attempts, behind, read_past=True)
        return rows

    def claim_pass(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int,
                   behind: Sequence[int], *, read_past: bool) -> tuple[list[tuple], bool]:
        """One pass of ``claim``: the rows it leased (or buried), and whether its window was
        full (``claim_window(batch)`` eligible rows; only then can a claimable row wait past
        it). ``read_past``: the window is read from ``BLOCKED_SCAN`` windows of eligible rows,
        keeping only the rows of unblocked aggregates (``unblocked_rows``).

        This generic version reads a window of candidates, plans the chains in Python
        (``outbox.domain.chains``) and, where claims can overlap, locks what it planned
        (``_lock_chains``), reading the rows it locks whole, so that their final read is
        not a statement of its own (``claimed_rows``; docs/internals.md, "The generic claim
        reads its rows where it locks them"); engines with a one-statement form override it."""
        self.begin(cursor)
        size = self.claim_window(batch)
        rows = self.window_rows(cursor, timeout_ms, size, behind if read_past else None)
        return self._claim_window_rows(cursor, rows, batch, lease, timeout_ms, max_attempts, behind), len(rows) >= size

    def _claim_window_rows(self, cursor: Any, rows: list[tuple], batch: int, lease: str, timeout_ms: int,
                           max_attempts: int, behind: Sequence[int]) -> list[tuple]:
        candidates = [Candidate(int(r[0]), r[1], int(r[2]), _count(r[3])) for r in rows]
        if not candidates:
            return []
        blockers = self._first_blockers(cursor, candidates, behind)
        locked: dict[int, tuple] | None = None
        if self.lock_candidates:
            plan, locked = self._lock_chains(cursor, candidates, blockers, max_attempts, batch, timeout_ms)
        else:  # one writer at a time (SQLite): claims cannot overlap, the plan is final
            plan = plan_claim(candidates, blockers, max_attempts, limit=batch)
        if plan.dead_ids:
            cond, params = self.ids_in(plan.dead_ids)
            # The claim's lease stays on the rows it buries: a retry of a claim whose answer
            # was lost finds them (``leased_rows``). Nothing is fenced on a dead row.
            self.execute(cursor, f"UPDATE {self.table} SET status = 4, processed_at = {self.now}, "
                         f"last_error = ?, lease_token = ?, attempts = attempts + 1 WHERE {cond}",
                         [LEASE_EXPIRED_ERROR, lease, *params])
        if plan.claim_ids:
            cond, params = self.ids_in(plan.claim_ids)
            self.execute(cursor, f"UPDATE {self.table} SET "
                         "attempts = attempts + CASE WHEN status = 1 THEN 1 ELSE 0 END, "
                         "last_error = CASE WHEN status = 1 THEN ? ELSE last_error END, "
                         f"status = 1, claimed_at = {self.now}, next_retry_at = NULL, lease_token = ? "
                         f"WHERE {cond}", [LEASE_EXPIRED_ERROR, lease, *params])
        if locked is not None:  # the rows as the lock read them, as the updates above left them
            return claimed_rows(locked, plan)
        cond, params = self.ids_in(sorted(plan.claim_ids + plan.dead_ids))
        return self.execute(cursor, f"SELECT {self.message_select()} FROM {self.table} WHERE {cond} ORDER BY id",
                            params).fetchall()

    def leased_rows(self, cursor: Any, lease: str, timeout_ms: int) -> list[tuple]:
        """The rows ``lease`` holds, and those it buried, shaped like a claim's (MESSAGE_COLUMNS):
        what a claim whose answer was lost after it committed took (``OutboxStore.claim``;
        docs/relay.md, "A network cut"). Buried rows are looked for among those that went dead
        within the lease's length (``timeout_ms``), so the read stays on the index's recent end
        on every engine (PostgreSQL's holds done rows too)."""
        held = self.execute(
            cursor, f"SELECT {self.message_select()} FROM {self.table}{self.past_locks_read} "
            f"WHERE {self.open_rows()} AND status = 1 AND lease_token = ?", [lease]).fetchall()
        buried = self.execute(
            cursor, f"SELECT {self.message_select()} FROM {self.table}{self.past_locks_read} "
            f"WHERE status = 4 AND processed_at >= {self.now_plus_ms()} AND lease_token = ?",
            [-timeout_ms, lease]).fetchall()
        return sorted([*held, *buried], key=lambda r: int(r[0]))

    def window_rows(self, cursor: Any, timeout_ms: int, size: int,
                    unblocked_behind: Sequence[int] | None = None) -> list[tuple]:
        """The generic claim's window: ``size`` eligible rows (``window_sql``), as (id, aggregate_id,
        status, attempts); with ``unblocked_behind`` (a claim's ``behind``, for
        ``read_past``) the first ``size`` of ``unblocked_rows`` in ``BLOCKED_SCAN`` windows."""
        scan = size if unblocked_behind is None else size * self.BLOCKED_SCAN
        rows = list(self.execute(cursor, *self.window_statement(timeout_ms, scan)).fetchall())
        if unblocked_behind is None:
            return rows
        return self.unblocked_rows(cursor, rows, timeout_ms, unblocked_behind)[:size]

    def window_statement(self, timeout_ms: int, size: int) -> tuple[str, list[Any]]:
        """The claim's window of ``size`` eligible rows (``window_sql``) and its parameters."""
        return self.window_sql(), [-timeout_ms, size, -timeout_ms, size, size]

    def window_sql(self) -> str:
        """A window of ``?`` (the second and fourth parameter, and the last) eligible rows as
        (id, aggregate_id, status, attempts), read as two walks of ``claim_ready``
        (``next_retry_at, id``), so that rows waiting for a later time are never read: the rows
        without a time (pending, claimed) in id order, and the rows whose time has come (a due
        retry, a delayed release) in the order of that time, each stopped after ``?`` rows, then
        the oldest of both. A walk
        of the open rows in id order read every failed row not yet due before the first it could
        take (docs/internals.md, "Rows waiting for a later time are not read"). The first and
        third parameter: the lease length in ms, negated."""
        return self.window_walks(self.window_source(), self.eligible(), self.limit)

    def window_walks(self, source: str, eligible: str, limit: Callable[[str], str]) -> str:
        """``window_sql``'s two walks of ``source`` over the ``eligible`` rows, each and their
        union cut by ``limit`` (a ``?`` parameter, or PostgreSQL's one-statement claim's size)."""
        columns = f"SELECT id, aggregate_id, status, attempts FROM {source} WHERE {eligible}"
        # ORDER BY next_retry_at, id: the index's own order (all NULL in the first walk), which
        # a planner that does not take IS NULL as an equality then follows without a sort.
        ready = limit(f"{columns} AND next_retry_at IS NULL ORDER BY next_retry_at, id")
        # The due rows in the order of their time, not of their ids: a range sorted by id is read
        # whole, every due row at every claim after an outage (docs/internals.md, as above).
        due = limit(f"{columns} AND next_retry_at <= {self.now} ORDER BY next_retry_at, id")
        return limit(f"SELECT * FROM ({ready}) ready UNION ALL SELECT * FROM ({due}) due ORDER BY id")

    def unblocked_rows(self, cursor: Any, rows: list[tuple], timeout_ms: int, behind: Sequence[int]) -> list[tuple]:
        """Of window ``rows`` (id, aggregate_id, ...), those of *unblocked* aggregates: whose
        first open row, ``behind`` left out, a claim may take now (it is the row itself, or
        an older row of its chain). A claim whose window found nothing to take reads it again
        keeping only those (``claim_pass``'s ``read_past``), so rows queued behind heads
        that wait (a retry not due yet, a row released with a delay, another worker's live
        lease) cannot fill the window and hide every other aggregate (docs/internals.md,
        "Claim windows"). A row without an aggregate is a chain of its own. One statement
        finds each aggregate's first open row, one more which of those are eligible."""
        aggregates = sorted({r[1] for r in rows if r[1] is not None and _bindable(r[1])})
        if not aggregates:
            return rows
        last = max(int(r[0]) for r in rows)  # a first open row is at most its aggregate's row read
        in_aggregates, aggregate_params = self.in_list(aggregates)
        not_behind, behind_params = self.in_list([int(i) for i in behind])
        first = self.execute(
            cursor, f"SELECT MIN(id) FROM {self.chains_source()} WHERE {self.open_rows()} AND id <= ? "
            f"AND aggregate_id IN {in_aggregates}"
            + (f" AND id NOT IN {not_behind}" if behind else "")
            + f" GROUP BY {self.exact('aggregate_id')}",
            [last, *aggregate_params, *(behind_params if behind else [])]).fetchall()
        heads = [int(r[0]) for r in first]
        in_heads, head_params = self.in_list(heads)
        ready = {r[0] for r in self.execute(
            cursor, f"SELECT aggregate_id FROM {self.table} WHERE id IN {in_heads} "
            f"AND {self.eligible()}", [*head_params, -timeout_ms]).fetchall()} if heads else set()
        return [r for r in rows if r[1] is None or r[1] in ready or not _bindable(r[1])]

    def _lock_chains(self, cursor: Any, candidates: Sequence[Candidate], blockers: dict[str, int],
                     max_attempts: int, batch: int, timeout_ms: int) -> tuple[ClaimPlan, dict[int, tuple]]:
        """Lock the planned chains (``lock_candidates``: SKIP LOCKED) and keep what this
        claim locked (``keep_locked``); returns the plan and the rows the locking reads
        returned (MESSAGE_COLUMNS), by id. Chains another claim holds are left to it and the
        plan is made once more over the window's other aggregates, so two claims that
        overlap in time take disjoint chains instead of the later one coming back empty
        (docs/internals.md, "Claim windows")."""
        taken, pool = ClaimPlan(), list(candidates)
        read: dict[int, tuple] = {}
        for _ in range(2):
            plan = plan_claim(pool, blockers, max_attempts, limit=batch - len(taken.claim_ids) - len(taken.dead_ids))
            planned = plan.claim_ids + plan.dead_ids
            if not planned:
                break
            status = {c.id: c.status for c in pool}
            cond, params = self.ids_in(planned)
            rows = self.execute(cursor, f"SELECT {self.message_select()} FROM {self.table} WHERE {cond} "
                                f"AND {self.eligible()}" + self.lock_candidates, [*params, -timeout_ms]).fetchall()
            locked = {int(r[0]) for r in rows if int(r[_STATUS]) == status[int(r[0])]}  # unchanged since the window
            read.update((int(r[0]), r) for r in rows)
            kept = keep_locked(plan, pool, locked)
            taken.claim_ids += kept.claim_ids
            taken.dead_ids += kept.dead_ids
            if len(locked) == len(planned):
                break
            planned_ids = set(planned)
            tried = {chain_key(c) for c in pool if c.id in planned_ids}
            pool = [c for c in pool if chain_key(c) not in tried]
        taken.claim_ids.sort()
        return taken, read

    def _first_blockers(self, cursor: Any, candidates: Sequence[Candidate],
                        behind: Sequence[int] = ()) -> dict[str, int]:
        # A NULL aggregate_id (only on a table whose column allows it) equals nothing in
        # SQL, so such a row has no earlier rows; it is claimed, then found undecodable. So
        # is one that cannot be sent back as a parameter (``_bindable``).
        aggregates = sorted({c.aggregate_id for c in candidates if c.aggregate_id is not None
                             and _bindable(c.aggregate_id)})
        if not aggregates:
            return {}
        last = max(c.id for c in candidates)
        ids = [c.id for c in candidates] + [int(i) for i in behind if int(i) < last]  # neither blocks
        in_aggregates, aggregate_params = self.in_list(aggregates)
        not_in, id_params = self.in_list(ids)
        sql = (f"SELECT MIN(aggregate_id), MIN(id) FROM {self.chains_source()} WHERE {self.open_rows()} "
               f"AND aggregate_id IN {in_aggregates} AND id < ? "
               f"AND id NOT IN {not_in} GROUP BY {self.exact('aggregate_id')}")
        rows = self.execute(cursor, sql, [*aggregate_params, last, *id_params]).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def to_message(self, row: Sequence[Any], lease: str) -> OutboxMessage:
        """The claimed row as a message; ``UndecodableRow`` says why it cannot be one."""
        return rows.to_message(row, lease, self.to_datetime)

    def decode_row(self, row: Sequence[Any], lease: str) -> tuple[OutboxMessage, list[str]]:
        """The claimed row, leniently: the message and the problems found (``rows.decode_row``)."""
        return rows.decode_row(row, lease, self.to_datetime)

    # -- acknowledgements (each fenced by the lease token) -----------------------
    def mark_done_sql(self, cond: str) -> str:
        # The row keeps the lease that settled it (it holds nothing: fenced writes need status
        # 1): a repeat of this very write whose answer was lost knows it (``OutboxStore.mark_done``).
        return (f"UPDATE {self.table} SET status = 2, processed_at = {self.now} "
                f"WHERE {cond} AND lease_token = ? AND status = 1")

    def mark_failed_sql(self) -> str:
        # Assignments reference only columns assigned after them: MySQL applies SET
        # left to right, every other engine uses the old row; this order suits both.
        # The row keeps the lease that failed it (fenced writes need status 1, so it holds
        # nothing): a repeat of this very write knows it by that (``OutboxStore.mark_failed``).
        dead = "(? = 1 OR attempts + 1 >= ?)"
        return (f"UPDATE {self.table} SET "
                f"status = CASE WHEN {dead} THEN 4 ELSE 3 END, "
                f"next_retry_at = CASE WHEN {dead} THEN NULL ELSE {self.now_plus_ms()} END, "
                f"processed_at = CASE WHEN {dead} THEN {self.now} ELSE NULL END, "
                "last_error = ?, attempts = attempts + 1 "
                "WHERE id = ? AND lease_token = ? AND status = 1")

    def release_sql(self, cond: str) -> str:
        # The row keeps the lease that released it (a pending row is held by nobody: fenced
        # writes need status 1): a repeat of this very write knows it (``OutboxStore.release``).
        return (f"UPDATE {self.table} SET status = 0, claimed_at = NULL, "
                f"next_retry_at = CASE WHEN ? > 0 THEN {self.now_plus_ms()} ELSE NULL END "
                f"WHERE {cond} AND lease_token = ? AND status = 1")

    def release_lease_sql(self) -> str:
        """Hand back every row held under lease ``?``, due at once: a doubtful lease's rows
        (``OutboxStore.release_doubtful``). No index holds ``lease_token``, so the UPDATE
        examines every open row: it reads past rows others lock (``past_locks_update``)
        instead of waiting behind an application's open enqueue for the lock timeout (found
        in review); a row skipped so keeps its lease until it expires."""
        return (f"UPDATE {self.table}{self.past_locks_update} SET status = 0, claimed_at = NULL, "
                f"lease_token = NULL, next_retry_at = NULL WHERE {self.open_rows()} AND status = 1 AND lease_token = ?")

    # -- housekeeping ----------------------------------------------------------
    #: Ids one purge statement reads at most (``purge_chunk``; docs/relay.md, "Purge").
    purge_window: ClassVar[int] = 100_000

    def purge_chunk(self, cursor: Any, older_than_ms: int, batch: int, after: int) -> tuple[int, int | None]:
        """Delete the next chunk of the purge: the first ``batch`` done rows after id ``after``
        (in id order) processed before now minus ``older_than_ms``, among the next
        ``purge_window`` ids. Returns the rows deleted and the id the next chunk starts
        after, or None when no such row can be left.

        Each statement is atomic alone and short: the chunk's id range within the window,
        then a DELETE of that range that tests status and age again, so it never takes a row
        that is not done and old. Each chunk starts where the last one ended (keyset), so a
        purge reads the rows it keeps (dead rows, which are never purged; recent done rows)
        once per run instead of once per chunk. A window that holds less than a chunk is
        followed past only while the first row after it was created before the cut-off: a
        row is processed after it is created, so none created later can be old enough. The
        run's last chunk read every row to the end of the table before (docs/relay.md, "Purge")."""
        upper = after + self.purge_window
        first, last, found = self.execute(cursor, self.purge_range_sql(),
                                          [-older_than_ms, after, upper, batch]).fetchone()
        deleted = 0
        if found:
            deleted = max(int(self.execute(cursor, self.purge_delete_sql(),
                                           [int(first), int(last), -older_than_ms]).rowcount), 0)
            if int(found) >= batch:
                return deleted, int(last)
        (following,) = self.execute(cursor, self.purge_next_sql(), [upper, -older_than_ms]).fetchone()
        return deleted, None if following is None else int(following) - 1

    def purge_range_sql(self) -> str:
        """The first and last id and the count of the next ``?`` (last) done rows after id ``?``
        and up to id ``?`` processed before now plus ``?`` ms (negative; the first): one purge chunk."""
        return (f"SELECT MIN(id), MAX(id), COUNT(*) FROM (SELECT id FROM {self.id_range_source()} WHERE status = 2 "
                f"AND processed_at < {self.now_plus_ms()} AND id > ? AND id <= ? ORDER BY id LIMIT ?) doomed")

    def purge_next_sql(self) -> str:
        """The id of the first row after id ``?`` when it was created before now plus ``?`` ms
        (negative), else NULL: where a purge run goes on after a window (``purge_chunk``)."""
        return (f"SELECT MIN(id) FROM (SELECT id, created_at FROM {self.id_range_source()} WHERE id > ? "
                f"ORDER BY id LIMIT 1) after_window WHERE created_at IS NULL OR created_at < {self.now_plus_ms()}")

    def purge_delete_sql(self) -> str:
        """Delete the done rows with ids ``?`` to ``?`` processed before now plus ``?`` ms (negative)."""
        return (f"DELETE FROM {self.id_range_source()} WHERE id >= ? AND id <= ? AND status = 2 "
                f"AND processed_at < {self.now_plus_ms()}")

    # -- holders: liveness of the relay's worker processes (docs/internals.md, "Lost workers") --
    def beat(self, cursor: Any, holder_id: str, host: str, pid: int) -> bool:
        """Refresh a holder's ``beat_at``, inserting its record if it is missing (then True)."""
        if self.execute(cursor, f"UPDATE {self.holders} SET beat_at = {self.now} WHERE holder_id = ?",
                        [holder_id]).rowcount:
            return False
        self.execute(cursor, f"INSERT INTO {self.holders} (holder_id, host, pid, started_at, beat_at) "
                     f"VALUES (?, ?, ?, {self.now}, {self.now})", [holder_id, host, pid])
        return True

    def silent_holders_sql(self) -> str:
        """Holders other than ``?`` whose last beat is older than ``?`` ms (negated), with
        the database clock: (holder_id, host, pid, beat_at, now). A holder whose record is
        locked is beating right now, so not silent: read past it (``past_locks_read``),
        never wait for it (SQL Server with RCSI off: a beat cut off before its COMMIT made
        every process's beat wait ``LOCK_TIMEOUT`` and fail until the server dropped the
        session)."""
        return (f"SELECT holder_id, host, pid, beat_at, {self.now} FROM {self.holders}{self.past_locks_read} "
                f"WHERE holder_id <> ? AND beat_at < {self.now_plus_ms()} ORDER BY beat_at")

    def drop_silent_holder_sql(self) -> str:
        """Delete holder ``?`` if its last beat is still older than ``?`` ms (negated): of
        several processes that found it silent, one deletes it and takes its rows over."""
        return f"DELETE FROM {self.holders} WHERE holder_id = ? AND beat_at < {self.now_plus_ms()}"

    def held_by_sql(self) -> str:
        """Count and oldest ``claimed_at`` of the open rows held under a lease of holder
        ``?`` (a LIKE prefix), with the database clock."""
        return (f"SELECT COUNT(*), MIN(claimed_at), {self.now} FROM {self.table}{self.past_locks_read} "
                f"WHERE {self.open_rows()} AND status = 1 AND lease_token LIKE ?")

    def end_leases_sql(self) -> str:
        """Move ``claimed_at`` of the rows held under a lease of holder ``?`` (a LIKE prefix)
        to now plus ``?`` ms (negated, past the lease): the claim sees their lease expired.
        The first parameter is the milliseconds."""
        return (f"UPDATE {self.table}{self.past_locks_update} SET claimed_at = {self.now_plus_ms()} "
                f"WHERE {self.open_rows()} AND status = 1 AND lease_token LIKE ?")

    def drop_holder_sql(self) -> str:
        return f"DELETE FROM {self.holders} WHERE holder_id = ?"

    def adopt_sql(self, cond: str) -> str:
        """Re-token rows to a new lease (the adopting process's), fenced by the old one; the
        lease starts again now. Parameters: the new token, the ids, the old token."""
        return (f"UPDATE {self.table} SET lease_token = ?, claimed_at = {self.now} "
                f"WHERE {cond} AND lease_token = ? AND status = 1")

    def requeue_sql(self, cond: str) -> str:
        return (f"UPDATE {self.table} SET status = 0, attempts = 0, next_retry_at = NULL, claimed_at = NULL, "
                f"processed_at = NULL, lease_token = NULL WHERE status = 4 AND {cond}")


def first(rows: Iterable[Sequence[Any]]) -> Any:
    for row in rows:
        return row[0]
    return None


def _count(value: Any) -> int:
    """A window row's ``attempts``: SQLite's columns hold any type, and a row whose
    ``attempts`` is not an integer must not fail every claim (the claim's UPDATE stores
    ``attempts + 0``, which SQLite makes an integer, 0 for text)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _bindable(text: str) -> bool:
    """Can ``text`` go back to the database as a parameter? Not with a lone surrogate,
    which is how a value that is not UTF-8 reads on SQLite (``SqliteEngine.connect``): such
    a row is claimed without its aggregate's ordering check and found undecodable."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
