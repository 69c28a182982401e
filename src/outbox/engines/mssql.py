"""SQL Server 2016 SP1+ and Azure SQL through pyodbc.

The claim is one batch on the relay's connection: lock the oldest eligible rows
with ``READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK`` into a table variable,
keep the per-aggregate chains the ordering rule allows (see ``outbox.chains``),
update them and hand them back through ``OUTPUT ... INTO`` a table variable (a
bare ``OUTPUT`` fails on tables with triggers). The batch never opens or commits a
transaction itself: pyodbc runs with autocommit off, so the driver's implicit
transaction holds the locks until the store commits.

A batch that changes rows before its result set starts with ``SET NOCOUNT ON``
(after saving the session's setting), so the first result set pyodbc sees is the
one we want, and restores the setting before that final SELECT: ``rowcount`` of
later statements on the same connection depends on it. (Parameterized batches run
through sp_executesql, which restores SET options on its own; the explicit restore
keeps that true for drivers that send them otherwise.)

Id-like columns (``message_id``, ``aggregate_id``) use a binary collation, so
``Order-1`` and ``order-1`` are two aggregates and two message ids, as on the other
engines (SQL Server's default collations are case-insensitive).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import StoreError
from ..model import NewEvent
from .base import LEASE_EXPIRED_ERROR, MESSAGE_COLUMNS, Engine

DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"
#: Exact, case-sensitive comparison for id-like columns (and index seeks on them).
ID_COLLATION = "Latin1_General_100_BIN2"

#: Deadlock victim (1205 arrives as 40001), timeouts, and the connection states.
_DISCONNECT_STATES = frozenset({"08S01", "08001", "08003"})
_TRANSIENT_STATES = _DISCONNECT_STATES | {"40001", "HYT00", "HYT01"}
#: Deadlock victim and lock request timeout, when the driver reports them under another state.
_TRANSIENT_MESSAGES = ("(1205)", "(1222)")

#: Modifying or indexing a table with a filtered index needs these (error 1934 otherwise).
#: ODBC drivers set most of them; tools that run the migration elsewhere may not.
FILTERED_INDEX_OPTIONS = ("SET QUOTED_IDENTIFIER ON; SET ANSI_NULLS ON; SET ANSI_PADDING ON; "
                          "SET ANSI_WARNINGS ON; SET ARITHABORT ON; SET CONCAT_NULL_YIELDS_NULL ON; "
                          "SET NUMERIC_ROUNDABORT OFF;")

#: The result columns' types, for the claim's table variable (payload/headers as text
#: whether the columns are NVARCHAR(MAX) or the native json type).
_MESSAGE_TYPES = {
    "id": "BIGINT NOT NULL PRIMARY KEY", "message_id": "NVARCHAR(64)", "topic": "NVARCHAR(255)",
    "aggregate_type": "NVARCHAR(255)", "aggregate_id": "NVARCHAR(255)", "partition_key": "NVARCHAR(255)",
    "payload": "NVARCHAR(MAX)", "headers": "NVARCHAR(MAX)", "trace_id": "NVARCHAR(255)", "attempts": "INT",
    "created_at": "DATETIME2(3)", "status": "TINYINT",
}


def _odbc_value(value: str) -> str:
    """Brace a value that ODBC would otherwise split or trim (``}`` doubles inside)."""
    if any(ch in value for ch in ";{}=") or value != value.strip():
        return "{" + value.replace("}", "}}") + "}"
    return value


def odbc_connection_string(url: str) -> str:
    """Turn ``OUTBOX_DATABASE_URL`` into an ODBC connection string.

    Accepts ``mssql+pyodbc://user:pass@host:1433/db?driver=...&Encrypt=yes`` (user,
    password and query are URL-decoded; every query parameter but ``driver`` is
    passed on as an ODBC keyword), ``mssql+pyodbc:///?odbc_connect=<urlencoded>``,
    and a raw ODBC connection string, which is returned unchanged.
    """
    if "://" not in url:
        if "=" in url and ";" in url:
            return url
        raise ValueError("not a SQL Server URL or ODBC connection string "
                         "(expected mssql+pyodbc://user:pass@host:1433/db?driver=...)")
    parts = urlsplit(url)
    if parts.scheme.split("+", 1)[0].lower() not in ("mssql", "sqlserver"):
        raise ValueError(f"not a SQL Server URL: scheme {parts.scheme!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    for key, value in query:
        if key.lower() == "odbc_connect":
            return value  # parse_qsl has already decoded it
    keywords: dict[str, tuple[str, str]] = {}  # upper-cased keyword -> (keyword, value)

    def put(key: str, value: str) -> None:
        keywords[key.upper()] = (key, value)

    driver = next((v for k, v in query if k.lower() == "driver"), DEFAULT_DRIVER)
    put("DRIVER", "{" + driver.strip("{}").replace("}", "}}") + "}")
    if parts.hostname:
        host = unquote(parts.hostname)  # a named instance may come as host%5CINSTANCE
        put("SERVER", f"{host},{parts.port}" if parts.port else host)
    database = unquote(parts.path.lstrip("/"))
    if database:
        put("DATABASE", database)
    if parts.username:
        put("UID", unquote(parts.username))
        put("PWD", unquote(parts.password or ""))
    for key, value in query:
        if key.lower() != "driver":
            put(key, value)
    return ";".join(f"{key}={value if key.upper() == 'DRIVER' else _odbc_value(value)}"
                    for key, value in keywords.values()) + ";"


def _nstr(text: str) -> str:
    """A T-SQL Unicode string literal."""
    return "N'" + text.replace("'", "''") + "'"


def _if(condition: str, statement: str) -> str:
    """``IF ... BEGIN ... END``: the block makes the end of the guarded statement
    explicit for readers and for parsers (sqlglot reads a bare ``IF c SET ...`` wrong)."""
    return f"IF {condition}\nBEGIN\n    {statement};\nEND;"


def _error_fields(exc: BaseException) -> tuple[str | None, str]:
    """(SQLSTATE, message) of a pyodbc error, recognised by class module so this works
    (and is testable) where pyodbc cannot be imported; (None, '') for anything else."""
    if not any(cls.__module__ == "pyodbc" for cls in type(exc).__mro__):
        return None, ""
    args = exc.args
    state = args[0] if args and isinstance(args[0], str) else None
    return state, " ".join(str(a) for a in args)


def _result_rows(cursor: Any) -> list[tuple]:
    """Rows of the batch's first result set. The batches set NOCOUNT ON, but stepping
    over anything before it guards against "No results. Previous SQL was not a query"."""
    while cursor.description is None:
        if not cursor.nextset():
            raise StoreError("SQL Server batch returned no result set")
    return [tuple(row) for row in cursor.fetchall()]


class MssqlEngine(Engine):
    name = "mssql"
    placeholder = "?"
    default_schema: ClassVar[str | None] = "dbo"
    now: ClassVar[str] = "SYSUTCDATETIME()"

    # -- names and SQL text ------------------------------------------------------
    def quote(self, identifier: str) -> str:
        return "[" + identifier.replace("]", "]]") + "]"

    def now_plus_ms(self) -> str:
        # The parameter binds as INT; leases and retry delays are capped at 24 hours.
        return "DATEADD(MILLISECOND, ?, SYSUTCDATETIME())"

    def payload_column(self) -> str:
        return "CAST(payload AS NVARCHAR(MAX))"  # also right for the native json type

    def headers_column(self) -> str:
        return "CAST(headers AS NVARCHAR(MAX))"

    def limit(self, select: str) -> str:
        return f"{select} OFFSET 0 ROWS FETCH NEXT ? ROWS ONLY"

    def ids_in(self, ids: Sequence[int]) -> tuple[str, list[Any]]:
        # One JSON parameter, whatever the count: a statement takes at most 2100 parameters.
        if not ids:
            return "1 = 0", []
        return "id IN (SELECT CAST([value] AS BIGINT) FROM OPENJSON(?))", [json.dumps([int(i) for i in ids])]

    def purge_chunk_sql(self) -> str:
        """Delete at most ``?`` done rows processed more than ``?`` seconds plus ``?``
        milliseconds ago. Seconds and leftover milliseconds, because an INT of
        milliseconds overflows at ~24.8 days and retention is usually 30-90 days.

        The CTE is ``DELETE TOP (?)`` with an order: oldest first, straight off the
        (status, processed_at) index without a sort. READPAST skips rows another
        transaction holds; on READ_COMMITTED_SNAPSHOT databases (Azure SQL's default)
        it is only allowed together with READCOMMITTEDLOCK."""
        return (f"WITH doomed AS (SELECT TOP (?) id FROM {self.table} WITH (READCOMMITTEDLOCK, ROWLOCK, READPAST) "
                "WHERE status = 2 AND processed_at < DATEADD(SECOND, -?, DATEADD(MILLISECOND, -?, SYSUTCDATETIME())) "
                "ORDER BY processed_at) DELETE FROM doomed")

    def purge_params(self, older_than_ms: int, batch: int) -> list[Any]:
        seconds, millis = divmod(max(older_than_ms, 0), 1000)
        return [batch, seconds, millis]

    # -- connections and errors ----------------------------------------------------
    def connect(self, url: str) -> Any:
        import pyodbc  # imported here: importing it needs unixODBC installed
        # Autocommit off: the driver opens a transaction at the first statement and the
        # store commits it. The session isolation level is left alone on purpose; the
        # claim's table hints give the locking it needs on locking and RCSI databases.
        return pyodbc.connect(odbc_connection_string(url), autocommit=False)

    def is_transient(self, exc: BaseException) -> bool:
        state, message = _error_fields(exc)
        return state in _TRANSIENT_STATES or any(code in message for code in _TRANSIENT_MESSAGES)

    def is_disconnect(self, exc: BaseException) -> bool:
        return _error_fields(exc)[0] in _DISCONNECT_STATES

    # -- schema ----------------------------------------------------------------------
    def migration(self, native_json: bool = False) -> list[str]:
        """One batch per object, each guarded on its own, so re-running repairs a partial
        deployment. Each batch starts with the SET options filtered indexes need."""
        t, q, name = self.table, self.quote, self.table_name
        table_literal = _nstr(t)
        schema = self.schema or "dbo"

        def constraint(kind: str, column: str = "") -> str:
            return "CONSTRAINT " + q("_".join(filter(None, (kind, name, column))))

        def json_column(column: str, default: str = "") -> str:
            if native_json:  # SQL Server 2025 / Azure SQL: the type itself validates
                return f"{column} JSON NOT NULL{default}"
            return (f"{column} NVARCHAR(MAX) NOT NULL{default} {constraint('ck', column + '_json')} "
                    f"CHECK (ISJSON({column}) = 1)")

        def index(suffix: str, ddl: str) -> str:
            index_name = self.index_name(suffix)
            return _if(f"NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = {_nstr(index_name)} "
                       f"AND object_id = OBJECT_ID({table_literal}))",
                       "CREATE " + ddl.format(index=q(index_name), t=t))

        headers_default = f" {constraint('df', 'headers')} DEFAULT N'{{}}'"
        create_table = f"""CREATE TABLE {t} (
        id BIGINT IDENTITY(1,1) NOT NULL,
        message_id NVARCHAR(64) COLLATE {ID_COLLATION} NOT NULL,
        topic NVARCHAR(255) NOT NULL,
        aggregate_type NVARCHAR(255) NOT NULL,
        aggregate_id NVARCHAR(255) COLLATE {ID_COLLATION} NOT NULL,
        partition_key NVARCHAR(255) NULL,
        {json_column('payload')},
        {json_column('headers', headers_default)},
        trace_id NVARCHAR(255) NULL,
        status TINYINT NOT NULL {constraint('df', 'status')} DEFAULT 0
            {constraint('ck', 'status')} CHECK (status BETWEEN 0 AND 4),
        attempts INT NOT NULL {constraint('df', 'attempts')} DEFAULT 0,
        claimed_at DATETIME2(3) NULL,
        next_retry_at DATETIME2(3) NULL,
        created_at DATETIME2(3) NOT NULL {constraint('df', 'created_at')} DEFAULT SYSUTCDATETIME(),
        processed_at DATETIME2(3) NULL,
        last_error NVARCHAR(4000) NULL,
        lease_token CHAR(32) NULL,
        {constraint('pk')} PRIMARY KEY CLUSTERED (id)
    )"""
        steps = [
            # CREATE SCHEMA must be the only statement of its batch, hence dynamic SQL.
            _if(f"SCHEMA_ID({_nstr(schema)}) IS NULL",
                f"EXEC sp_executesql {_nstr('CREATE SCHEMA ' + q(schema))}"),
            _if(f"OBJECT_ID({table_literal}, N'U') IS NULL", create_table),
            # Columns added after the first release: repaired on tables an older script made.
            *(_if(f"COL_LENGTH({table_literal}, {_nstr(column)}) IS NULL", f"ALTER TABLE {t} ADD {column} {ddl}")
              for column, ddl in (("last_error", "NVARCHAR(4000) NULL"), ("lease_token", "CHAR(32) NULL"))),
            index("message_id", "UNIQUE NONCLUSTERED INDEX {index} ON {t} (message_id)"),
            # The ordering probe: earlier rows of one aggregate, with their status.
            index("agg_id_id", "NONCLUSTERED INDEX {index} ON {t} (aggregate_id, id) INCLUDE (status)"),
            # The claim scan over open rows only. It covers eligible(), so every claimer
            # scans (and U-locks) the same index keys, which READPAST then skips.
            index("claim_ready", "NONCLUSTERED INDEX {index} ON {t} (id) "
                  "INCLUDE (aggregate_id, status, attempts, claimed_at, next_retry_at) WHERE status IN (0, 1, 3)"),
            index("done_processed_at", "NONCLUSTERED INDEX {index} ON {t} (status, processed_at)"),
        ]
        return [f"{FILTERED_INDEX_OPTIONS}\n{step}" for step in steps]

    # -- write side (the caller's transaction: never commit, never raise on a duplicate) --
    def insert_statements(self) -> list[str]:
        """Insert unless the message_id is stored, then return the row's id.

        ``UPDLOCK, HOLDLOCK`` on the existence probe takes a key-range lock on the
        message_id, so a concurrent enqueue of the same id waits for this transaction
        instead of both inserting and one failing with a duplicate key: an error
        inside the caller's transaction that it never asked for. XACT_ABORT is left as
        the caller set it. Values go into typed variables first, so a None binds
        without a type guess, and payload/headers over 4000 characters (pyodbc binds a
        long str as NVARCHAR(MAX)) reach NVARCHAR(MAX) variables untruncated.
        """
        t = self.table
        values = ", ".join(f"@{c.strip()}" for c in self.INSERT_COLUMNS.split(","))
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512;",
            "SET NOCOUNT ON;",
            "DECLARE @message_id NVARCHAR(64) = ?, @topic NVARCHAR(255) = ?, @aggregate_type NVARCHAR(255) = ?, "
            "@aggregate_id NVARCHAR(255) = ?, @partition_key NVARCHAR(255) = ?, @payload NVARCHAR(MAX) = ?, "
            "@headers NVARCHAR(MAX) = ?, @trace_id NVARCHAR(255) = ?;",
            "DECLARE @ids TABLE (id BIGINT NOT NULL);",
            f"INSERT INTO {t} ({self.INSERT_COLUMNS})\nOUTPUT inserted.id INTO @ids\nSELECT {values}\n"
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} WITH (UPDLOCK, HOLDLOCK) WHERE message_id = @message_id);",
            f"DECLARE @id BIGINT = COALESCE((SELECT TOP (1) id FROM @ids), "
            f"(SELECT id FROM {t} WHERE message_id = @message_id));",
            _if("@nocount = 0", "SET NOCOUNT OFF"),
            "SELECT @id AS id;",
        ]

    def insert_batch(self) -> str:
        return "\n".join(self.insert_statements())

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        self.execute(cursor, self.insert_batch(), self.event_params(event))
        return int(_result_rows(cursor)[0][0])

    # -- claim -------------------------------------------------------------------------
    def chain_select(self) -> str:
        """``(id, dead)`` of the candidates in ``@cand`` this claim takes: exactly the
        rule of ``outbox.chains.plan_claim``. A candidate is taken when

        1. no open row of its aggregate before it is outside ``@cand`` (held by another
           claimer, not yet due, a live lease: each blocks what follows);
        2. every candidate of its aggregate up to and including it is pending, except
           the aggregate's first candidate (an expired lease or a due retry may start a
           chain; one further along ends the chain there);
        3. no earlier candidate of its aggregate goes dead (an expired lease out of
           attempts goes dead instead, and the rows behind it wait for the next claim).

        The table probe reads with READCOMMITTEDLOCK and never READPAST. A competitor's
        U lock is compatible with S, so the probe sees the competitor's locked earlier
        rows (still pending, or claimed once it commits) and rule 1 treats them as
        blockers; READPAST would skip them and let a later row overtake them. The
        probes run in a statement of their own, while this claim holds only U locks,
        so a probe waiting on a competitor's UPDATE can never close a deadlock cycle.
        """
        goes_dead = "{0}.status = 1 AND {0}.attempts + 1 >= @max_attempts"
        return f"""SELECT c.id, CASE WHEN {goes_dead.format('c')} THEN 1 ELSE 0 END
FROM @cand AS c
WHERE NOT EXISTS (
        SELECT 1 FROM {self.table} AS e WITH (READCOMMITTEDLOCK)
        WHERE e.aggregate_id = c.aggregate_id AND e.id < c.id AND e.status IN (0, 1, 3)
          AND NOT EXISTS (SELECT 1 FROM @cand AS k WHERE k.id = e.id))
  AND NOT EXISTS (
        SELECT 1 FROM @cand AS d
        WHERE d.aggregate_id = c.aggregate_id AND d.id <= c.id AND d.status <> 0
          AND EXISTS (SELECT 1 FROM @cand AS f WHERE f.aggregate_id = c.aggregate_id AND f.id < d.id))
  AND NOT EXISTS (
        SELECT 1 FROM @cand AS d
        WHERE d.aggregate_id = c.aggregate_id AND d.id < c.id AND {goes_dead.format('d')})"""

    def claim_statements(self) -> list[str]:
        """The claim, one statement per item; run as one batch. Parameters: ``claim_params``.

        No BEGIN TRAN/COMMIT here: with autocommit off the driver has a transaction
        open already (an explicit one would nest), the U locks live until the store
        commits it, and XACT_ABORT makes any error roll the whole claim back.
        """
        t = self.table
        out_columns = ", ".join(MESSAGE_COLUMNS)
        output = ", ".join(f"CAST(inserted.{c} AS NVARCHAR(MAX))" if c in ("payload", "headers")
                           else f"inserted.{c}" for c in MESSAGE_COLUMNS)
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512, @xact_abort INT = @@OPTIONS & 16384;",
            "SET NOCOUNT ON;",
            "SET XACT_ABORT ON;",
            "DECLARE @batch INT = ?, @max_attempts INT = ?, @lease CHAR(32) = ?, @lease_error NVARCHAR(4000) = ?;",
            f"DECLARE @cand TABLE (id BIGINT NOT NULL PRIMARY KEY, aggregate_id NVARCHAR(255) COLLATE {ID_COLLATION} "
            "NOT NULL, status TINYINT NOT NULL, attempts INT NOT NULL);",
            "DECLARE @chain TABLE (id BIGINT NOT NULL PRIMARY KEY, dead BIT NOT NULL);",
            # Declared in MESSAGE_COLUMNS order: OUTPUT ... INTO @out fills it by position.
            "DECLARE @out TABLE (" + ", ".join(f"{c} {_MESSAGE_TYPES[c]}" for c in MESSAGE_COLUMNS) + ");",
            f"INSERT INTO @cand (id, aggregate_id, status, attempts)\n"
            f"SELECT TOP (@batch) id, aggregate_id, status, attempts\n"
            f"FROM {t} WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK)\n"
            f"WHERE {self.eligible()}\nORDER BY id;",
            f"INSERT INTO @chain (id, dead)\n{self.chain_select()};",
            # SET expressions read the row as it was before this UPDATE, so every CASE
            # sees the old status and attempts.
            f"""UPDATE o SET
    attempts = o.attempts + CASE WHEN o.status = 1 THEN 1 ELSE 0 END,
    status = CASE WHEN ch.dead = 1 THEN 4 ELSE 1 END,
    processed_at = CASE WHEN ch.dead = 1 THEN SYSUTCDATETIME() ELSE NULL END,
    last_error = CASE WHEN o.status = 1 THEN @lease_error ELSE o.last_error END,
    claimed_at = SYSUTCDATETIME(),
    next_retry_at = NULL,
    lease_token = CASE WHEN ch.dead = 1 THEN NULL ELSE @lease END
OUTPUT {output} INTO @out
FROM {t} AS o INNER JOIN @chain AS ch ON ch.id = o.id;""",
            _if("@xact_abort = 0", "SET XACT_ABORT OFF"),
            _if("@nocount = 0", "SET NOCOUNT OFF"),
            f"SELECT {out_columns} FROM @out ORDER BY id;",
        ]

    def claim_batch(self) -> str:
        return "\n".join(self.claim_statements())

    def claim_params(self, batch: int, lease: str, timeout_ms: int, max_attempts: int) -> list[Any]:
        # The DECLARE's four, then eligible()'s lease cutoff (the only other ?).
        return [batch, max_attempts, lease, LEASE_EXPIRED_ERROR, -timeout_ms]

    def claim(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int) -> list[tuple]:
        """Lease up to ``batch`` rows in the open transaction (the store commits);
        rows whose status is 4 went dead instead."""
        try:
            self.execute(cursor, self.claim_batch(), self.claim_params(batch, lease, timeout_ms, max_attempts))
            return _result_rows(cursor)
        except BaseException:
            # An error ends the batch before it restores the session options; this is
            # the relay's own connection, where both are off.
            try:
                cursor.execute("SET XACT_ABORT OFF; SET NOCOUNT OFF;")
            except Exception:
                pass
            raise
