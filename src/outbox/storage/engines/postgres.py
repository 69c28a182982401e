"""PostgreSQL through psycopg 3.

The claim is one statement: lock the window's eligible rows with
``FOR UPDATE SKIP LOCKED``, keep the per-aggregate chains the ordering rule allows
(see ``outbox.domain.chains``), update them and return them. Partial indexes keep the
claim scan and the ordering probe on open rows only, however many done rows the
retention window holds. The claim runs alone (autocommit), so claim and COMMIT are one
round trip, and every session bounds its transactions' life (``connect``; docs/relay.md,
"A network cut").
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from ...core.config import session_bounds, without_session_bounds
from ...core.errors import StoreError
from ...core.model import NewEvent
from .base import (
    LEASE_EXPIRED_ERROR,
    MESSAGE_COLUMNS,
    Engine,
    IndexShape,
    derived_name,
    duration,
    inline_params,
    leased_or_full,
    tcp_keepalive,
)

#: 25P03: the server ended the session, idle in a transaction too long (``session_settings``);
#: 57P05: idle too long outside one (a server's ``idle_session_timeout``). Both end the
#: connection: the transaction was rolled back, the operation starts again on a new one.
_ENDED_SQLSTATES = {"25P03", "57P05"}
#: A statement on rows chosen by their ids (one, or ``ids_in``'s list): ``execute`` sends
#: it unprepared (docs/internals.md, "Statements on rows by id").
_BY_ID = re.compile(r"\bWHERE id = (?:ANY\()?\?")
_TRANSIENT_SQLSTATES = {"40001", "40P01", "55P03", "57P01", "57P02", "57P03", *_ENDED_SQLSTATES}

#: Seconds a connection attempt may take (libpq ``connect_timeout``) unless the URL says.
CONNECT_TIMEOUT_S = 10


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://...`` -> ``postgresql://...`` (libpq knows no driver suffix),
    without the engine's own parameters (``config.SESSION_BOUNDS``), which libpq would refuse."""
    parts = urlsplit(without_session_bounds(url))
    return urlunsplit(("postgresql",) + tuple(parts[1:]))


def connect_params(url: str) -> dict[str, Any]:
    """libpq's connection parameters for a relay connection: the URL's, plus client-side
    bounds it does not set itself (docs/relay.md, "A network cut"): TCP keepalives and
    ``tcp_user_timeout`` that find a silent server within ``tcp_timeout_s``, and a
    connect timeout. A parameter written in the URL wins."""
    from psycopg.conninfo import conninfo_to_dict

    tcp_timeout_s = session_bounds(url)["tcp_timeout_s"]
    idle, interval, count = tcp_keepalive(tcp_timeout_s)
    params: dict[str, Any] = dict(conninfo_to_dict(libpq_url(url)))
    defaults = {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": idle,
                "keepalives_interval": interval, "keepalives_count": count,
                "tcp_user_timeout": tcp_timeout_s * 1000}
    for name, value in defaults.items():
        params.setdefault(name, value)
    return params


def session_settings(url: str, server_version: int) -> dict[str, str]:
    """What each relay session sets on the server (``set_config``): the server ends a
    session idle in a transaction after ``idle_transaction_timeout_s`` (its locks go with
    it), and finds a silent client by TCP within ``tcp_timeout_s`` (keepalives; unacknowledged
    data, from PostgreSQL 12). On a Unix socket the TCP settings are accepted and unused."""
    bounds = session_bounds(url)
    idle, interval, count = tcp_keepalive(bounds["tcp_timeout_s"])
    settings = {"idle_in_transaction_session_timeout": f"{bounds['idle_transaction_timeout_s'] * 1000}",
                "tcp_keepalives_idle": str(idle), "tcp_keepalives_interval": str(interval),
                "tcp_keepalives_count": str(count)}
    if server_version >= 120000:
        settings["tcp_user_timeout"] = str(bounds["tcp_timeout_s"] * 1000)
    return settings


class PostgresEngine(Engine):
    name = "postgresql"
    identifier_limit = (63, True)  # NAMEDATALEN - 1: a longer name was cut, with a NOTICE
    placeholder = "%s"
    now: ClassVar[str] = "now()"
    async_commit_sql: ClassVar[str | None] = "SET synchronous_commit TO off"

    def __init__(self, table: str = "outbox", schema: str | None = None) -> None:
        super().__init__(table, schema)
        self._claim_sql: dict[tuple[int, int, int, int, bool], str] = {}  # claim_sql's

    def now_plus_ms(self) -> str:
        return "(now() + ? * interval '1 millisecond')"

    def payload_column(self) -> str:
        return "payload::text"

    def headers_column(self) -> str:
        return "headers::text"

    def ids_in(self, ids: Any) -> tuple[str, list[Any]]:
        return "id = ANY(?)", [list(ids)]

    def execute(self, cursor: Any, text: str, params: Sequence[Any] = ()) -> Any:
        # Planned for its own ids on every call, never from a generic plan the connection
        # cached while the table was small (docs/internals.md, "Statements on rows by id").
        if _BY_ID.search(text):
            cursor.execute(self.sql(text), tuple(params), prepare=False)
        else:  # as base's: any cursor with DB-API's execute
            cursor.execute(self.sql(text), tuple(params))
        return cursor

    def connect(self, url: str) -> Any:
        import psycopg
        conn = psycopg.connect(**connect_params(url), autocommit=True)
        try:
            settings = session_settings(url, conn.info.server_version)
            conn.execute("SELECT " + ", ".join("set_config(%s, %s, false)" for _ in settings),
                         [v for item in settings.items() for v in item])
            conn.autocommit = False
        except BaseException:
            conn.close()
            raise
        return conn

    #: The claim is one statement (docs/relay.md, "A network cut"): run alone, it commits
    #: as it ends, in one round trip, and its locks never wait for a COMMIT.
    one_statement_claim: ClassVar[bool] = True

    @contextmanager
    def statement_alone(self, conn: Any) -> Iterator[None]:
        from psycopg.pq import TransactionStatus

        if conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE:
            yield  # a transaction the caller left open: the statement joins it
            return
        with self.autocommit(conn):  # a client-side switch in psycopg 3: no round trip
            yield

    def commits_each_statement(self, conn: Any) -> bool:
        from psycopg.pq import TransactionStatus  # IDLE: not inside the caller's conn.transaction()

        return bool(conn.autocommit) and conn.info.transaction_status == TransactionStatus.IDLE

    def in_callers_transaction(self, conn: Any) -> bool:
        from psycopg.pq import TransactionStatus

        return bool(conn.autocommit) and conn.info.transaction_status != TransactionStatus.IDLE

    @contextmanager
    def own_transaction(self, conn: Any) -> Iterator[None]:
        """psycopg's own ``conn.transaction()`` where no transaction is open: it issues the
        BEGIN in autocommit mode too. One the driver opened (autocommit off) is ended as
        ``Engine.own_transaction`` says."""
        from psycopg.pq import TransactionStatus

        if conn.info.transaction_status != TransactionStatus.IDLE:
            with super().own_transaction(conn):
                yield
            return
        with conn.transaction():
            yield

    @contextmanager
    def savepoint(self, conn: Any, name: str, lost: Callable[[], None]) -> Iterator[None]:
        # A failed statement (a deadlock victim included) leaves PostgreSQL's savepoint in
        # place: psycopg rolls back to it, and the transaction goes on (``lost`` never called).
        with conn.transaction(savepoint_name=name):
            yield

    supports_notify: ClassVar[bool] = True

    def notify(self, cursor: Any, channel: str) -> None:
        # Delivered at commit, and only then; identical ones of a transaction fold into one.
        self.execute(cursor, "SELECT pg_notify(?, '')", [channel])
        cursor.fetchall()

    @classmethod
    def listen_connection(cls, url: str, channel: str) -> Any:
        import psycopg
        from psycopg import sql

        conn = psycopg.connect(**{**connect_params(url), "connect_timeout": 5}, autocommit=True)
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            conn.close()
            raise
        return conn

    def cursor_for(self, conn: Any) -> Any:
        from psycopg.rows import tuple_row
        return conn.cursor(row_factory=tuple_row)  # the caller's connection may default to dict rows

    def is_transient(self, exc: BaseException) -> bool:
        import psycopg
        if getattr(exc, "sqlstate", None) in _TRANSIENT_SQLSTATES:
            return True
        return self.is_disconnect(exc) or isinstance(exc, psycopg.errors.LockNotAvailable)

    def is_lock_timeout(self, exc: BaseException) -> bool:
        import psycopg
        return isinstance(exc, psycopg.errors.LockNotAvailable)

    def migration_lock_bound(self) -> str:
        return self.MIGRATION_LOCK_TIMEOUT.replace("s", " s")

    def lock_holders(self, cursor: Any, tables: Sequence[str]) -> str | None:
        rows = self.execute(cursor, (
            "SELECT DISTINCT a.pid, a.usename, a.application_name, host(a.client_addr), a.state, "
            "EXTRACT(EPOCH FROM clock_timestamp() - a.xact_start), a.xact_start "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() "
            "AND l.relation IN (SELECT to_regclass(t) FROM unnest(?::text[]) AS t) "
            "ORDER BY a.xact_start LIMIT 3"), [list(tables)]).fetchall()
        return "; ".join(
            f"session {pid} (user {user}" + (f", application {app}" if app else "") + (f", from {addr}" if addr else "")
            + (f", {state}" if state else "") + (f", its transaction open {duration(age)}" if age is not None else "")
            + f"; SELECT pg_terminate_backend({pid}) ends it)"
            for pid, user, app, addr, state, age, _ in rows) or None

    def is_disconnect(self, exc: BaseException) -> bool:
        import psycopg
        state = getattr(exc, "sqlstate", None)
        if state in _ENDED_SQLSTATES:
            return True
        if isinstance(exc, psycopg.OperationalError) and (state is None or state.startswith("08")):
            return True
        return isinstance(exc, psycopg.InterfaceError)

    # The outbox table's storage parameters, each set by `outbox migrate` only where the table
    # has none of its own (an operator's choice is kept). docs/internals.md: the fill factor in
    # "The lease is a HOT update on PostgreSQL", the autovacuum thresholds in "Vacuum keeps the
    # claim fast".
    STORAGE: ClassVar[dict[str, int]] = {
        "fillfactor": 50,
        "autovacuum_vacuum_scale_factor": 0,
        "autovacuum_vacuum_threshold": 10000,
        "autovacuum_analyze_scale_factor": 0,
        "autovacuum_analyze_threshold": 10000,
    }

    UPKEEP: ClassVar[str | None] = "vacuum"

    def definitions(self, cursor: Any) -> frozenset[tuple[str, str]]:
        rows = self.execute(cursor, (
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = COALESCE(?, current_schema()) "
            "AND tablename = ? UNION ALL SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = to_regclass(?) AND contype = 'c'"),
            [self.schema, self.table_name, self.qualify(self.table_name)]).fetchall()
        return frozenset((str(name), str(definition)) for name, definition in rows)

    def table_exists(self, cursor: Any, table: str) -> bool:
        return bool(self.execute(cursor, "SELECT to_regclass(?) IS NOT NULL", [table]).fetchone()[0])

    def legacy_renames(self) -> list[tuple[str, str]]:
        old_check = self.legacy_name("ck_", "_open")  # the open rows' CHECK, cut by an earlier release
        return super().legacy_renames() + ([(old_check, derived_name("ck_", self.table_name, "_open"))]
                                           if old_check else [])

    def storage_options(self, cursor: Any) -> frozenset[str]:
        row = self.execute(cursor, "SELECT reloptions FROM pg_class WHERE oid = to_regclass(?)",
                           [self.qualify(self.table_name)]).fetchone()
        return frozenset(row[0] or []) if row else frozenset()

    def upkeep(self, cursor: Any) -> tuple[str, list[str]]:
        # docs/internals.md, "Vacuum keeps the claim fast".
        on, options = self.execute(cursor, "SELECT current_setting('autovacuum'), (SELECT reloptions FROM pg_class "
                                   "WHERE oid = to_regclass(?))", [self.qualify(self.table_name)]).fetchone()
        own = dict(option.split("=", 1) for option in options or [])
        problems = []
        if on != "on":
            problems.append("autovacuum is off on this server: dead row versions pile up and every claim gets "
                            f"slower until {self.table} is vacuumed (turn autovacuum on, or VACUUM it every few minutes)")
        if own.get("autovacuum_enabled") == "false":
            problems.append(f"autovacuum is disabled on {self.table} (autovacuum_enabled=false): every claim gets "
                            "slower until it is vacuumed")
        unset = [name for name in self.STORAGE if name.startswith("autovacuum_") and name not in own]
        if unset:
            problems.append(f"{self.table} has no {', '.join(unset)} of its own, so autovacuum waits for a fifth of "
                            "it to be dead row versions: run `outbox migrate` as the table's owner")
        threshold = own.get("autovacuum_vacuum_threshold", "the server's")
        return f"autovacuum {on}; {self.table} vacuumed after {threshold} dead row versions", problems

    def open_rows(self, alias: str = "") -> str:
        # The partial indexes' predicate, which the lease does not change (docs/internals.md,
        # "The lease is a HOT update on PostgreSQL"); a CHECK keeps it equal to the status test.
        return f"{alias}processed_at IS NULL AND {alias}status IN (0, 1, 3)"

    #: What ``outbox migrate`` adds for a missing column: the table's types and defaults,
    #: NULL allowed where the writer gives the value (the rows already there have none).
    ADDED_COLUMNS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("message_id", "VARCHAR(64) NULL"),
        *((column, "VARCHAR(255) NULL") for column in ("topic", "aggregate_type", "aggregate_id", "partition_key")),
        ("payload", "JSONB NULL"),
        ("headers", "JSONB NOT NULL DEFAULT '{}'::jsonb"),
        ("trace_id", "VARCHAR(255) NULL"),
        ("status", "SMALLINT NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 4)"),
        ("attempts", "INTEGER NOT NULL DEFAULT 0"),
        ("claimed_at", "TIMESTAMPTZ(3) NULL"),
        ("next_retry_at", "TIMESTAMPTZ(3) NULL"),
        ("created_at", "TIMESTAMPTZ(3) NOT NULL DEFAULT now()"),
        ("processed_at", "TIMESTAMPTZ(3) NULL"),
        ("last_error", "TEXT NULL"),
        ("lease_token", "VARCHAR(32) NULL"),
    )

    def migration(self, native_json: bool = False) -> list[Any]:
        return self._migration(native_json, online=False)

    def online_migration(self, native_json: bool = False) -> tuple[list[Any], list[list[Any]]]:
        # docs/internals.md, "Index builds that hold no writer back": on a table holding rows
        # the four indexes are built CONCURRENTLY, after the transaction.
        return (self._migration(native_json, online=True),
                [self._online_index_steps(suffix) for suffix in ("message_id", *(i[0] for i in self.PARTIAL_INDEXES))])

    #: The partial indexes: (suffix, an earlier release's columns, the columns now, the filter).
    PARTIAL_INDEXES: ClassVar[tuple[tuple[str, str, str, str], ...]] = (
        ("agg_id_id", "aggregate_id, id", "aggregate_id, id", "processed_at IS NULL"),
        ("claim_ready", "id", "next_retry_at, id", "processed_at IS NULL"),
        ("done_processed_at", "processed_at", "processed_at", "processed_at IS NOT NULL"))

    def expected_indexes(self) -> dict[str, IndexShape]:
        shapes = {self.index_name("message_id"): IndexShape(("message_id",), unique=True, method="btree")}
        for suffix, _, columns, where in self.PARTIAL_INDEXES:
            shapes[self.index_name(suffix)] = IndexShape(tuple(columns.split(", ")), where=where, method="btree")
        return shapes

    def _index_ddl(self, suffix: str, name: str, how: str = "") -> str:
        """``CREATE [UNIQUE] INDEX <how><name>`` of the index ``suffix`` as ``expected_indexes``
        defines it."""
        shape = self.expected_indexes()[self.index_name(suffix)]
        return (f"CREATE {'UNIQUE ' if shape.unique else ''}INDEX {how}{self.quote(name)} ON {self.table} "
                f"({', '.join(shape.keys)})" + (f" WHERE {shape.where}" if shape.where else ""))

    def _indexdef_pattern(self, suffix: str) -> str:
        """``pg_get_indexdef``'s text of the index ``suffix`` as ``expected_indexes`` defines it,
        a POSIX regular expression (any name and table): what the migration's probes compare, in
        SQL so that Alembic's offline script (``migration_script``) runs them too. Another method,
        column order or direction, collation, operator class, NULLS order, uniqueness, predicate or
        included column does not match;
        storage parameters (``WITH (fillfactor=70)``, a DBA's ``ALTER INDEX ... SET``) do, as
        `outbox check` (``describe.same_shape``) compares them: the whole text was compared, and
        `outbox migrate` built a tuned index again, CONCURRENTLY on a big table, and dropped
        the tuning (found in review). Written without backslashes (a bracket per punctuation
        character), which an offline script's string literals keep as they are."""
        shape = self.expected_indexes()[self.index_name(suffix)]

        def literal(text: str) -> str:
            return "".join(c if c.isalnum() or c in " _,=" else f"[{c}]" for c in text)

        return (f"^CREATE {'UNIQUE ' if shape.unique else ''}INDEX .+ USING {literal(str(shape.method))} "
                f"{literal('(' + ', '.join(shape.keys) + ')')}( WITH [(][^()]*[)])?"
                + (f" WHERE {literal('(' + shape.where + ')')}" if shape.where else "") + "$")

    def _differs(self, suffix: str) -> tuple[str, list[Any]]:
        """A probe finding a row unless the index ``suffix`` is there defined otherwise
        (``_indexdef_pattern``): the guard of the step that drops it to make it again."""
        return ("SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = COALESCE(?, current_schema()) "
                "AND indexname = ? AND indexdef !~ ?)",
                [self.schema, self.index_name(suffix), self._indexdef_pattern(suffix)])

    def _migration(self, native_json: bool, online: bool) -> list[Any]:
        t, q = self.table, self.quote
        storage = ", ".join(f"{name} = {value}" for name, value in self.STORAGE.items())
        steps: list[Any] = [f"CREATE SCHEMA IF NOT EXISTS {q(self.schema)}"] if self.schema else []
        steps += [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                message_id VARCHAR(64) NOT NULL,
                topic VARCHAR(255) NOT NULL,
                aggregate_type VARCHAR(255) NOT NULL,
                aggregate_id VARCHAR(255) NOT NULL,
                partition_key VARCHAR(255) NULL,
                payload JSONB NOT NULL,
                headers JSONB NOT NULL DEFAULT '{{}}'::jsonb,
                trace_id VARCHAR(255) NULL,
                status SMALLINT NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 4),
                attempts INTEGER NOT NULL DEFAULT 0,
                claimed_at TIMESTAMPTZ(3) NULL,
                next_retry_at TIMESTAMPTZ(3) NULL,
                created_at TIMESTAMPTZ(3) NOT NULL DEFAULT now(),
                processed_at TIMESTAMPTZ(3) NULL
            ) WITH ({storage})""",
            # Columns added after the first release: repaired on tables an older script made.
            # Each step that would lock the live table is probed first, so a migration with
            # nothing to do takes no lock on it: ADD COLUMN IF NOT EXISTS and CREATE INDEX IF
            # NOT EXISTS take theirs before they look, and a re-run behind a long application
            # transaction queued every enqueue and claim behind it (found in review).
            # Every column of the contract but the id (README, "The table").
            *((self._has_column(column), f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {column} {ddl}")
              for column, ddl in self.ADDED_COLUMNS),
            *self._rename_legacy_index("message_id", "message_id"),
            # Defined otherwise (not unique, on more columns, partial: made by hand), made again
            # as the partial indexes below are (it was left so, and `outbox check` failed it).
            (self._or_holding_rows(self._differs("message_id"), online),
             f"DROP INDEX {self.qualify(self.index_name('message_id'))}"),
            (self._or_holding_rows(self._has_index("message_id"), online),
             self._index_ddl("message_id", self.index_name("message_id"), "IF NOT EXISTS ")),
        ]
        # Tables made before the lease was a HOT update (docs/internals.md, "The lease is a HOT
        # update on PostgreSQL"): the open rows' test written on processed_at and kept equal to
        # the status test by a CHECK (rows that break it are mended first), the three partial
        # indexes rebuilt on processed_at; and each storage parameter set unless the table has its own.
        check = derived_name("ck_", self.table_name, "_open")
        has_check = ("SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass(?) AND conname = ?",
                     [self.qualify(self.table_name), check])
        old_check = self.legacy_name("ck_", "_open")
        if old_check:  # cut by an earlier release: renamed, not checked again over the whole table
            steps.append((("SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass(?) "
                           "AND conname = ?) OR EXISTS (" + has_check[0] + ")",
                           [self.qualify(self.table_name), old_check, *has_check[1]]),
                          f"ALTER TABLE {t} RENAME CONSTRAINT {q(old_check)} TO {q(check)}"))
        steps += [
            (has_check, f"UPDATE {t} SET processed_at = NULL WHERE status IN (0, 1, 3) AND processed_at IS NOT NULL"),
            (has_check, f"UPDATE {t} SET processed_at = COALESCE(claimed_at, created_at) "
                        "WHERE status IN (2, 4) AND processed_at IS NULL"),
            (has_check, f"ALTER TABLE {t} ADD CONSTRAINT {q(check)} "
                        "CHECK ((status IN (0, 1, 3)) = (processed_at IS NULL))"),
        ]
        steps += [(("SELECT 1 FROM pg_class WHERE oid = to_regclass(?) AND EXISTS (SELECT 1 FROM "
                    "unnest(reloptions) AS option WHERE option LIKE ?)", [self.qualify(self.table_name), f"{name}=%"]),
                   f"ALTER TABLE {t} SET ({name} = {value})") for name, value in self.STORAGE.items()]
        # claim_ready was on (id) until the claim's window stopped reading rows that wait for
        # a later time (docs/internals.md, "Rows waiting for a later time are not read"): an index
        # on other columns is made again (``before``: an earlier release's columns, for its rename).
        # Online (``online_migration``), the two steps below run here only on a table whose heap
        # has no page (a new one); elsewhere ``_online_index_steps`` builds them after the commit.
        for suffix, before, columns, _ in self.PARTIAL_INDEXES:
            name = self.index_name(suffix)
            # Any other definition is made again, as `outbox check` compares it (docs/operations.md):
            # only other columns were, not another predicate, included columns or uniqueness.
            steps += [*self._rename_legacy_index(suffix, columns, *{before} - {columns}),
                      (self._or_holding_rows(self._differs(suffix), online), f"DROP INDEX {self.qualify(name)}"),
                      (self._or_holding_rows(self._has_index(suffix), online),
                       self._index_ddl(suffix, name, "IF NOT EXISTS "))]
        return steps + self.holders_migration()

    def _or_holding_rows(self, probe: tuple[str, list[Any]], online: bool) -> tuple[str, list[Any]]:
        """``probe``, which skips a step when it finds a row, skipping it too (``online``) when the
        table's heap has a page: rows, dead ones too (docs/internals.md, "Index builds that hold no
        writer back"; a purged table not yet vacuumed counted as empty)."""
        if not online:
            return probe
        return (f"SELECT 1 WHERE EXISTS ({probe[0]}) OR pg_relation_size(to_regclass(?)) > 0",
                [*probe[1], self.qualify(self.table_name)])

    def _online_index_steps(self, suffix: str) -> list[Any]:
        """The index ``suffix`` built again without holding writers back (docs/internals.md, "Index
        builds that hold no writer back"), each step run only when its probe finds no row, on a
        connection outside any transaction: a stale or INVALID copy under the build name dropped
        (an earlier run interrupted), the copy built CONCURRENTLY, the index dropped CONCURRENTLY,
        the copy renamed to its name. Nothing runs where the index is valid and defined as
        ``expected_indexes`` says (``_indexdef_pattern``)."""
        name, build = self.index_name(suffix), derived_name("ix_", self.table_name, f"_{suffix}_build")
        qname, qbuild, table = self.qualify(name), self.qualify(build), self.qualify(self.table_name)

        def good(index: str) -> tuple[str, list[Any]]:
            return ("EXISTS (SELECT 1 FROM pg_index i WHERE i.indexrelid = to_regclass(?) AND i.indrelid = "
                    "to_regclass(?) AND i.indisvalid AND pg_get_indexdef(i.indexrelid) ~ ?)",
                    [index, table, self._indexdef_pattern(suffix)])

        def probe(*parts: str | tuple[str, list[Any]]) -> tuple[str, list[Any]]:
            sql = " ".join(p if isinstance(p, str) else p[0] for p in parts)
            return f"SELECT 1 WHERE {sql}", [v for p in parts if not isinstance(p, str) for v in p[1]]

        absent = "to_regclass(?) IS NULL"
        return [
            (probe(("to_regclass(?) IS NULL OR (", [qbuild]), good(qbuild), "AND NOT", good(qname), ")"),
             f"DROP INDEX CONCURRENTLY IF EXISTS {qbuild}"),
            (probe(good(qname), ("OR to_regclass(?) IS NOT NULL", [qbuild])),
             self._index_ddl(suffix, build, "CONCURRENTLY ")),
            (probe((f"{absent} OR {absent} OR", [qname, qbuild]), good(qname)),
             f"DROP INDEX CONCURRENTLY {qname}"),
            (probe(("to_regclass(?) IS NOT NULL OR to_regclass(?) IS NULL", [qname, qbuild])),
             f"ALTER INDEX {qbuild} RENAME TO {self.quote(name)}"),
        ]

    def _has_column(self, column: str) -> tuple[str, list[Any]]:
        return ("SELECT 1 FROM information_schema.columns WHERE table_schema = COALESCE(?, current_schema()) "
                "AND table_name = ? AND column_name = ?", [self.schema, self.table_name, column])

    def _rename_legacy_index(self, suffix: str, columns: str, *more: str) -> list[Any]:
        """The step that renames the index an earlier release made under its cut name
        (``Engine.legacy_name``) when it is on this table with these columns, or ``more``'s (cut
        names could collide: the one found may be another index's) and today's name is free: an
        instant rename, where ``CREATE INDEX`` would build a second copy and block writes meanwhile."""
        old = self.legacy_index_name(suffix)
        if old is None:
            return []
        schema = "COALESCE(?, current_schema())"
        matches = " OR ".join(["indexdef LIKE ?"] * (1 + len(more)))
        probe = (f"SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = {schema} AND tablename = ? "
                 f"AND indexname = ? AND ({matches})) OR EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = "
                 f"{schema} AND indexname = ?)")
        params = [self.schema, self.table_name, old, *(f"% USING btree ({c})%" for c in (columns, *more)),
                  self.schema, self.index_name(suffix)]
        return [((probe, params), f"ALTER INDEX {self.qualify(old)} RENAME TO {self.quote(self.index_name(suffix))}")]

    def _has_index(self, suffix: str) -> tuple[str, list[Any]]:
        return ("SELECT 1 FROM pg_indexes WHERE schemaname = COALESCE(?, current_schema()) AND indexname = ?",
                [self.schema, self.index_name(suffix)])

    #: How long a migration step waits for a lock on the live table before it gives up
    #: (everything rolls back and ``outbox migrate`` names the holder, without trying again):
    #: while a DDL statement waits, every enqueue and claim queues behind it.
    MIGRATION_LOCK_TIMEOUT = "10s"

    #: The migration lock and bound last as long as the transaction (``lock_migration``): a
    #: caller on an autocommit connection (a Django migration) runs the steps in one.
    migration_in_transaction = True

    def lock_migration(self, cursor: Any) -> float | None:
        # Concurrent CREATE TABLE / INDEX IF NOT EXISTS fail on PostgreSQL (a unique violation
        # in pg_type or pg_class), as do two ADD CONSTRAINTs: held until the migration commits.
        # Waiting for another migration blocks nobody else, so only the steps are bounded.
        # The bound is the transaction's, and unlock_migration puts back what the caller had:
        # an Alembic revision's own later steps run in the same transaction (found in review).
        for sql, params in self._lock_statements():
            self.execute(cursor, sql, params).fetchall()
        return None  # outbox migrate waits in lock_online_migration, which says how long

    def unlock_migration(self, cursor: Any) -> None:
        self.execute(cursor, self._UNLOCK).fetchall()

    #: How often a migration asks again for the lock another migration of the table holds
    #: (``lock_online_migration``).
    MIGRATION_LOCK_POLL_S = 0.1

    def lock_online_migration(self, cursor: Any) -> float:
        # lock_migration's lock, for the session, taken before the transaction (which then takes
        # it at once) and polled: a session waiting for it inside a transaction or a statement
        # keeps a snapshot, which the holder's CREATE INDEX CONCURRENTLY waits for (found in
        # review: racing migrations waited so until their bound). The steps' lock waits are
        # bounded as the transaction's are.
        started, waited = time.monotonic(), False
        while not self.execute(cursor, "SELECT pg_try_advisory_lock(hashtext(?))",
                               [self.migration_lock_resource()]).fetchone()[0]:
            waited = True
            time.sleep(self.MIGRATION_LOCK_POLL_S)
        self.execute(cursor, "SELECT set_config('outbox.lock_timeout_before', current_setting('lock_timeout'), false), "
                             "set_config('lock_timeout', ?, false)", [self.MIGRATION_LOCK_TIMEOUT]).fetchall()
        return time.monotonic() - started if waited else 0.0

    def unlock_online_migration(self, cursor: Any) -> None:
        self.execute(cursor, "SELECT set_config('lock_timeout', current_setting('outbox.lock_timeout_before'), false), "
                             "pg_advisory_unlock(hashtext(?))", [self.migration_lock_resource()]).fetchall()

    @contextmanager
    def online_build_bounds(self, cursor: Any) -> Iterator[None]:
        # docs/internals.md, "Index builds that hold no writer back": a CREATE INDEX CONCURRENTLY
        # takes as long as the table's size (and the waits for the transactions open on it), and
        # holds no writer back meanwhile; a statement_timeout of the login (ALTER ROLE ... SET,
        # found in review) cancelled every build longer than it, each run alike, leaving its
        # build INVALID. The builds run without it, their lock waits still bounded (lock_timeout).
        self.execute(cursor, "SELECT set_config('outbox.statement_timeout_before', current_setting('statement_timeout'), "
                             "false), set_config('statement_timeout', '0', false)").fetchall()
        restore = ("SELECT set_config('statement_timeout', current_setting('outbox.statement_timeout_before'), false)")
        try:
            yield
        except BaseException:
            with suppress(Exception):  # the connection may be gone: the original error tells why
                self.execute(cursor, restore).fetchall()
            raise
        self.execute(cursor, restore).fetchall()

    # Nothing to put back on an autocommit connection: there the bound lasted one statement.
    _UNLOCK = ("SELECT set_config('lock_timeout', current_setting('outbox.lock_timeout_before', true), true) "
               "WHERE COALESCE(current_setting('outbox.lock_timeout_before', true), '') <> ''")

    def _lock_statements(self) -> list[tuple[str, list[Any]]]:
        return [("SELECT pg_advisory_xact_lock(hashtext(?))", [self.migration_lock_resource()]),
                ("SELECT set_config('outbox.lock_timeout_before', current_setting('lock_timeout'), true), "
                 "set_config('lock_timeout', ?, true)", [self.MIGRATION_LOCK_TIMEOUT])]

    def migration_script(self, native_json: bool = False) -> list[str]:
        # Each guarded step in a DO block that runs it only when its probe finds no row, as
        # apply_migration does, between the same transaction-scoped lock and bound.
        script = [inline_params(sql, params) for sql, params in self._lock_statements()]
        for step in self.migration(native_json=native_json):
            if isinstance(step, tuple):
                (probe, params), ddl = step
                step = (f"DO $outbox$ BEGIN IF NOT EXISTS ({inline_params(probe, params)}) THEN {ddl}; "
                        "END IF; END $outbox$")
            script.append(step)
        return [*script, self._UNLOCK]

    def session_lock_statements(self, name: str, idle_s: int) -> list[tuple[str, list[Any]]] | None:
        return [("SELECT pg_try_advisory_lock(?)", [advisory_key(name)])]

    def session_unlock_statement(self, name: str) -> tuple[str, list[Any]]:
        return "SELECT pg_advisory_unlock(?)", [advisory_key(name)]

    def session_lock_held_statement(self, name: str) -> tuple[str, list[Any]]:
        # pg_locks shows a bigint advisory key as its high and low 32 bits (classid, objid),
        # unsigned, with objsubid 1.
        key = advisory_key(name) & 0xFFFFFFFFFFFFFFFF
        return ("SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted "
                "AND mode = 'ExclusiveLock' AND objsubid = 1 AND classid::bigint = ? AND objid::bigint = ?",
                [key >> 32, key & 0xFFFFFFFF])

    def holders_columns(self) -> str:
        return ("holder_id CHAR(16) NOT NULL PRIMARY KEY, host VARCHAR(255) NOT NULL, pid INTEGER NOT NULL, "
                "started_at TIMESTAMPTZ(3) NOT NULL, beat_at TIMESTAMPTZ(3) NOT NULL")

    def is_missing_table(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "42P01"  # undefined_table

    def is_missing_column(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) == "42703"  # undefined_column

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        return self._insert_or_find(cursor, event, f"INSERT INTO {self.table} ({self.INSERT_COLUMNS}) "
                                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (message_id) DO NOTHING RETURNING id",
                                    self.event_params(event))

    def insert_event_and_notify(self, cursor: Any, event: NewEvent, channel: str) -> int:
        # The notification rides on the insert: no round trip of its own for the writer
        # (docs/waking-and-metrics.md). Nothing inserted (a known message_id): no notification.
        return self._insert_or_find(cursor, event, f"WITH ins AS (INSERT INTO {self.table} ({self.INSERT_COLUMNS}) "
                                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (message_id) DO NOTHING RETURNING id) "
                                    "SELECT ins.id FROM ins CROSS JOIN LATERAL pg_notify(?, '') AS n",
                                    [*self.event_params(event), channel])

    def _insert_or_find(self, cursor: Any, event: NewEvent, insert: str, params: list[Any]) -> int:
        """``insert`` (which returns the new row's id, or nothing when the message_id is
        stored), else the stored row's id. A stored row the purge deletes between the two
        statements is gone when the id is looked up: the insert then runs again and writes
        the event anew, as after any purge (the look-up found nothing and the caller got a
        ``TypeError``: found in review)."""
        for _ in range(5):
            row = self.execute(cursor, insert, params).fetchone()
            if row is None:  # already stored under this message_id: nothing written
                row = self.execute(cursor, f"SELECT id FROM {self.table} WHERE message_id = ?",
                                   [event.message_id]).fetchone()
            if row is not None:
                return int(row[0])
        raise StoreError(f"enqueue of message_id {event.message_id!r}: the row stored under it was deleted each "
                         "time it was looked up (5 times); nothing was written and the transaction is unchanged")

    def claim_pass(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int,
                   behind: Sequence[int], *, read_past: bool) -> tuple[list[tuple], bool]:
        sql = self.claim_sql(batch, timeout_ms, max_attempts, read_past)
        return leased_or_full(self.execute_native(cursor, sql, [[int(i) for i in behind], LEASE_EXPIRED_ERROR, lease]))

    def execute_native(self, cursor: Any, sql: str, params: Sequence[Any]) -> list[tuple]:
        """``sql``, written with PostgreSQL's own ``$n`` placeholders, sent as it is on
        ``cursor``'s connection (psycopg's ``RawCursor``): the driver does not parse a long
        statement for placeholders on every call (docs/internals.md, "Claim windows")."""
        from psycopg import RawCursor
        from psycopg.rows import tuple_row

        with RawCursor(cursor.connection, row_factory=tuple_row) as raw:
            raw.execute(sql, params)
            return raw.fetchall()

    def claim_sql(self, batch: int, timeout_ms: int, max_attempts: int, read_past: bool) -> str:
        """``claim_pass``'s statement, made once per set of its integers (``$1``: the claim's
        ``behind`` ids, ``$2``: the error a lost lease leaves, ``$3``: the lease)."""
        key = (int(self.claim_window(batch)), int(batch), int(timeout_ms), int(max_attempts), read_past)
        sql = self._claim_sql.get(key)
        if sql is None:
            if len(self._claim_sql) >= 64:  # the claim sizer's batches: a few sizes, never many
                self._claim_sql.clear()
            sql = self._claim_sql[key] = self._build_claim_sql(*key)
        return sql

    def _build_claim_sql(self, window: int, batch: int, timeout_ms: int, max_attempts: int, read_past: bool) -> str:
        # The rule of outbox.domain.chains.plan_claim in one statement; its shape and why each step
        # costs what it does: docs/internals.md, "Claim windows" (and "Claims that overlap take
        # disjoint chains"). win: the window, read without locks; free: up to twice the batch
        # of its heads (OFFSET 0 keeps the probe above the sort; a scalar probe, one index
        # descent per head, never a hash join over the table) with no open row before them
        # other than ``behind`` (this process's own, published first: Engine.claim);
        # w_rows/w_chain: the rule over their rows as if every row were ours; plan: that cut to
        # ``batch`` rows, whole chains, oldest first; held: as many heads as the plan has, locked,
        # skipping heads another claim holds; pick: the held chains' rows in w_chain, ``batch``
        # of them; cand: those locked, and the rule again on them (c_chain): what is claimed.
        # lazy: the lease commits without waiting for the WAL flush (docs/internals.md, "The
        # lease commits lazily on PostgreSQL").
        t = self.table
        # A NULL aggregate_id (a hand-made table) equals nothing: each such row is a chain of
        # its own. From ``win`` on, a chain is named by its head (an integer: cheap to sort).
        chain_of = 'aggregate_id COLLATE "C", CASE WHEN aggregate_id IS NULL THEN id END'
        returning = ", ".join(f"o.{c}" + ("::text" if c in ("payload", "headers") else "") for c in MESSAGE_COLUMNS)
        # The integers are written into the text, not bound: one generic plan per connection
        # (docs/internals.md, "Claim windows").
        eligible = self.eligible().replace("?", f"({-timeout_ms})")
        not_behind = "e.id <> ALL ($1::bigint[])"
        scan, past = self._window(eligible, window), ""
        if read_past:  # Engine.unblocked_rows: BLOCKED_SCAN windows read, one probe per aggregate in them
            past = f"""scan AS MATERIALIZED ({self._window(eligible, window * self.BLOCKED_SCAN)}),
            ready AS MATERIALIZED (
                SELECT a.aggregate_id FROM (SELECT DISTINCT aggregate_id FROM scan) a
                WHERE (SELECT {eligible} FROM {t} e WHERE e.aggregate_id = a.aggregate_id AND {self.open_rows("e.")}
                       AND {not_behind} ORDER BY e.aggregate_id, e.id LIMIT 1)
            ),
            """
            scan = ("SELECT * FROM scan WHERE aggregate_id IS NULL OR aggregate_id IN (SELECT aggregate_id FROM ready) "
                    f"ORDER BY id LIMIT {window}")
        sql = f"""
            WITH {past}win AS MATERIALIZED (
                SELECT id, aggregate_id, status, attempts, MIN(id) OVER (PARTITION BY {chain_of}) AS head FROM (
                    {scan}) w
            ),
            free AS MATERIALIZED (
                SELECT h.head FROM (SELECT id AS head, aggregate_id FROM win WHERE id = head ORDER BY id OFFSET 0) h
                WHERE (SELECT e.id FROM {t} e WHERE e.aggregate_id = h.aggregate_id AND e.id < h.head
                       AND {self.open_rows("e.")} AND {not_behind} ORDER BY e.aggregate_id DESC, e.id DESC LIMIT 1) IS NULL
                LIMIT {2 * batch}
            ),
            w_rows AS MATERIALIZED (SELECT w.* FROM win w JOIN free f ON f.head = w.head),
            {self._chain_rule("w", "w_rows", f"NOT ({eligible}) AND {not_behind}", max_attempts)},
            plan AS (SELECT head FROM w_chain ORDER BY head, id LIMIT {batch}),
            held AS MATERIALIZED (
                SELECT h.id FROM (SELECT head FROM free ORDER BY head) f
                CROSS JOIN LATERAL (SELECT id FROM {t} WHERE id = f.head AND {eligible} FOR UPDATE SKIP LOCKED) h
                LIMIT (SELECT COUNT(DISTINCT head) FROM plan)
            ),
            pick AS MATERIALIZED (
                SELECT id, head FROM w_chain WHERE head = ANY (ARRAY(SELECT id FROM held)) ORDER BY head, id LIMIT {batch}
            ),
            cand AS MATERIALIZED (
                SELECT c.id, c.aggregate_id, c.status, c.attempts, p.head FROM pick p JOIN {t} c ON c.id = p.id
                WHERE {eligible} FOR UPDATE OF c SKIP LOCKED
            ),
            {self._chain_rule("c", "cand", f"e.id NOT IN (SELECT id FROM cand) AND {not_behind}", max_attempts)},
            lazy AS (SELECT set_config('synchronous_commit', 'off', true) AS commit_mode),
            leased AS (
                UPDATE {t} o SET
                    attempts = o.attempts + CASE WHEN o.status = 1 THEN 1 ELSE 0 END,
                    status = CASE WHEN chain.dead THEN 4 ELSE 1 END,
                    processed_at = CASE WHEN chain.dead THEN now() ELSE NULL END,
                    last_error = CASE WHEN o.status = 1 THEN $2 ELSE o.last_error END,
                    claimed_at = now(), next_retry_at = NULL,
                    lease_token = $3
                FROM c_chain chain CROSS JOIN lazy WHERE o.id = chain.id
                RETURNING {returning}
            )
            SELECT l.* FROM (VALUES (0)) AS one (n) LEFT JOIN leased l ON true
            WHERE l.id IS NOT NULL OR (SELECT COUNT(*) FROM win) >= {window}"""
        if "?" in sql:
            raise AssertionError("the claim's statement is sent as it is: no ? placeholder may be left in it")
        return sql

    def _window(self, eligible: str, size: int) -> str:
        """A window of ``size`` ``eligible`` rows (id, aggregate_id, status, attempts), as
        ``Engine.window_sql`` reads them (``window_walks``), the size written in."""
        return self.window_walks(self.table, eligible, lambda select: f"{select} LIMIT {size}")

    def _chain_rule(self, prefix: str, rows: str, outside: str, max_attempts: int) -> str:
        """The rule of ``plan_claim`` over ``rows`` (id, aggregate_id, status, attempts, head:
        the chain's first row in ``rows``), as CTEs named ``<prefix>_...``, ending in
        ``<prefix>_chain`` (id, head, dead). A chain ends before the first of: (1) an open row
        between its head and its last row that is not one of ``rows`` (``outside``, a condition
        on ``e``; rows before the head were checked by ``free``, in the same snapshot; a chain
        of one row needs no walk); (2) a non-pending row other than the head; (3) the row after
        one that goes dead. ``<prefix>_cut`` holds only the chains that end early: over a
        plain backlog it is empty, and no row of ``rows`` is sorted for the rule."""
        t, p, dead = self.table, prefix, f"status = 1 AND attempts + 1 >= {max_attempts}"
        return f"""{p}_cut AS MATERIALIZED (
                SELECT head, stop FROM (SELECT head, LEAST(
                    CASE WHEN MAX(id) > head AND MIN(aggregate_id) IS NOT NULL THEN (
                        SELECT e.id FROM {t} e WHERE e.aggregate_id = MIN(r.aggregate_id) AND {self.open_rows("e.")}
                          AND e.id > r.head AND e.id < MAX(r.id) AND {outside}
                        ORDER BY e.aggregate_id, e.id LIMIT 1) END,
                    MIN(id) FILTER (WHERE status <> 0 AND id > head),
                    MIN(id) FILTER (WHERE {dead}) + 1) AS stop
                FROM {rows} r GROUP BY head) s WHERE stop IS NOT NULL
            ),
            {p}_chain AS (
                SELECT id, head, {dead} AS dead FROM {rows} r
                WHERE NOT EXISTS (SELECT 1 FROM {p}_cut c WHERE c.head = r.head AND r.id >= c.stop)
            )"""


def advisory_key(name: str) -> int:
    """PostgreSQL's advisory locks take a signed 64-bit key: the first 8 bytes of a digest."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)
