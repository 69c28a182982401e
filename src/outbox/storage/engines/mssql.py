"""SQL Server 2012+ (compatibility level 110 and up) and Azure SQL, through pyodbc
(the default) or Microsoft's ``mssql-python`` driver. docs/sqlserver.md is the
operator's view of everything below.

The claim is one batch on the relay's connection: lock the oldest eligible rows
with ``READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK`` into a table variable,
keep the per-aggregate chains the ordering rule allows (see ``outbox.domain.chains``; one
probe per aggregate, its plan pinned: docs/sqlserver.md, "The claim's statements and
their plans"), update them and hand them back through ``OUTPUT ... INTO`` a table variable (a
bare ``OUTPUT`` fails on tables with triggers). The batch never opens or commits a
transaction itself: the driver runs with autocommit off, so its implicit
transaction holds the locks until the store commits.

Every relay connection gets the session options the engine relies on at connect
(``session_sql``): ``NOCOUNT OFF`` (fences, the dead-letter hand-off and purge
read ``rowcount``, which a server-wide NOCOUNT would turn into -1), ``XACT_ABORT
ON`` (an error or a client timeout never leaves a transaction open holding
locks), a ``LOCK_TIMEOUT``, ``DEADLOCK_PRIORITY LOW`` (the relay, which retries,
is the deadlock victim rather than the application) and the ANSI options that
filtered indexes need. The same round trip reads what the server offers
(``read_server``): the database's compatibility level (below 130 there is no
OPENJSON, so id lists become chunked parameter lists) and the server's version
(ISJSON exists at every level from SQL Server 2016 and on Azure SQL; without it the
migration leaves the JSON checks out). Connections the engine does not open (the
Django migration and admin, Alembic) are probed the same way before any SQL that
depends on it is built.

A batch that changes rows before its result set starts with ``SET NOCOUNT ON``
(after saving the session's setting), so the first result set the driver sees is
the one we want, and restores the setting before that final SELECT.

Id-like columns (``message_id``, ``aggregate_id``) use a binary collation, so
``Order-1`` and ``order-1`` are two aggregates and two message ids, as on the other
engines (SQL Server's default collations are case-insensitive). A table made by
another script may have them in the database collation; the claim declares its
table variable in the column's own collation (read once from the catalog), so any
collation works, and start-up logs what that changes.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from ...core.errors import StoreError, install_hint
from ...core.model import NewEvent
from .base import LEASE_EXPIRED_ERROR, MESSAGE_COLUMNS, Engine

log = logging.getLogger("outbox.storage.engines.mssql")

DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"
#: Exact, case-sensitive comparison for id-like columns (and index seeks on them).
ID_COLLATION = "Latin1_General_100_BIN2"

#: OPENJSON needs this database compatibility level (SQL Server 2016's). ISJSON does not:
#: it exists at every level from SQL Server 2016 on (JSON_VERSION), and on Azure SQL.
JSON_LEVEL = 130
#: The first major version with ISJSON (SQL Server 2016 is 13).
JSON_VERSION = 13
#: SERVERPROPERTY('EngineEdition') of Azure SQL Database (5), Managed Instance (8) and
#: Azure SQL Edge (9): they have ISJSON, but the first two report ProductVersion 12.
AZURE_EDITIONS = frozenset({5, 8, 9})
#: One round trip: what the connection's database and server offer (``read_server``).
SERVER_SQL = ("SELECT compatibility_level, "
              "CAST(PARSENAME(CAST(SERVERPROPERTY('ProductVersion') AS NVARCHAR(128)), 4) AS INT), "
              "CAST(SERVERPROPERTY('EngineEdition') AS INT) FROM sys.databases WHERE name = DB_NAME();")
#: The oldest level the engine supports: SQL Server 2012 (OFFSET/FETCH, THROW-free T-SQL).
MIN_LEVEL = 110
#: Ids per statement when OPENJSON is missing: below SQL Server's 2,100 parameters
#: per statement, with room for the statement's own (lease, delay).
ID_PARAMS_PER_STATEMENT = 2000
#: Without OPENJSON each id-list length is a statement text, so a plan, of its own: the
#: lists are padded to the next of these sizes (at most four times the ids, seven
#: plans per statement kind); docs/sqlserver.md, "Versions and compatibility levels".
ID_LIST_SIZES = (1, 4, 16, 64, 256, 1024, ID_PARAMS_PER_STATEMENT)

#: Session defaults, overridable per URL (``?lock_timeout_ms=...&query_timeout_s=...``).
DEFAULT_LOCK_TIMEOUT_MS = 30_000
DEFAULT_QUERY_TIMEOUT_S = 300
#: How long a second ``outbox migrate`` waits for the first one (sp_getapplock).
MIGRATE_LOCK_TIMEOUT_MS = 600_000
#: URL query parameters the engine reads itself; never passed on to the driver.
ENGINE_OPTIONS = ("lock_timeout_ms", "query_timeout_s")

#: URL scheme suffix -> driver module. ``mssql://`` and raw ODBC strings use pyodbc.
DRIVERS = {"": "pyodbc", "pyodbc": "pyodbc", "mssqlpython": "mssql_python", "mssql_python": "mssql_python"}

#: SQLSTATEs of a lost or unusable connection, and the other transient ones
#: (40001 = deadlock victim; HYT00/HYT01 = query/connection timeout).
_DISCONNECT_STATES = frozenset({"08S01", "08001", "08003", "08004"})
_TRANSIENT_STATES = _DISCONNECT_STATES | {"40001", "HYT00", "HYT01"}

#: SQL Server / Azure SQL error numbers worth a retry, and why.
TRANSIENT_ERRORS = {
    1205: "deadlock victim",
    1222: "lock request timeout (LOCK_TIMEOUT)",
    4060: "cannot open database (Azure SQL failover or database in transition)",
    4221: "login to a readable secondary failed while it changes role",
    10053: "transport-level error (connection aborted)",
    10054: "transport-level error (connection reset)",
    10060: "network timeout",
    10928: "Azure SQL resource limit reached (workers, sessions)",
    10929: "Azure SQL resource guarantee: server too busy",
    40143: "Azure SQL could not initialize the connection",
    40197: "Azure SQL error processing the request (reconfiguration, failover)",
    40501: "Azure SQL service busy",
    40613: "Azure SQL database not currently available",
    49918: "Azure SQL: not enough resources to process the request",
    49919: "Azure SQL: too many create or update operations in progress",
    49920: "Azure SQL: too many operations in progress",
    233: "no process on the other end of the pipe (connection dropped)",
    64: "network name no longer available (connection dropped)",
}
#: Error numbers after which the connection itself is gone or unusable.
DISCONNECT_ERRORS = frozenset({4060, 10053, 10054, 10060, 40143, 40197, 40613, 233, 64})

#: mssql-python reports no native error number, only the message text: these phrases
#: identify the errors above in SQL Server's message catalogue.
_TRANSIENT_PHRASES = (
    "deadlock victim", "lock request time out period exceeded", "is not currently available",
    "the service is currently busy", "the service has encountered an error processing your request",
    "not enough resources to process request", "too many create or update operations in progress",
    "too many operations in progress", "cannot open database", "transport-level error",
    "limit for the database is", "the server is currently too busy",
)
#: The phrases among those whose connection is gone (their numbers are in DISCONNECT_ERRORS).
_DISCONNECT_PHRASES = ("is not currently available", "the service has encountered an error processing your request",
                       "cannot open database", "transport-level error")
#: mssql-python names an exception's SQLSTATE in words (its driver_error); back to codes.
_MSSQL_PYTHON_STATES = {
    "Serialization failure": "40001", "Timeout expired": "HYT00", "Connection timeout expired": "HYT01",
    "Communication link failure": "08S01", "Client unable to establish connection": "08001",
    "Connection not open": "08003", "Server rejected the connection": "08004",
}

#: Modifying or indexing a table with a filtered index needs these (error 1934 otherwise).
#: ODBC drivers set most of them; tools that run the migration elsewhere may not.
FILTERED_INDEX_OPTIONS = ("SET QUOTED_IDENTIFIER ON; SET ANSI_NULLS ON; SET ANSI_PADDING ON; "
                          "SET ANSI_WARNINGS ON; SET ARITHABORT ON; SET CONCAT_NULL_YIELDS_NULL ON; "
                          "SET NUMERIC_ROUNDABORT OFF;")

#: The predicate of every index over open rows, written exactly as the claim scan,
#: the ordering probe and the stats queries write it, so the optimizer matches them.
OPEN_ROWS = "status IN (0, 1, 3)"
#: Characters dropped from a filter before comparing it: SQL Server stores the filter
#: as ``([status]=(0) OR [status]=(1) OR [status]=(3))``.
FILTER_NOISE = ("[", "]", "(", ")", " ")
#: The forms ``OPEN_ROWS`` may take in sys.indexes.filter_definition, normalized.
OPEN_ROWS_NORMALIZED = ("status=0orstatus=1orstatus=3", "statusin0,1,3")


def normalize_filter(definition: str) -> str:
    """A filter definition without brackets, parentheses and spaces, lower case:
    what ``filter_sql`` computes in T-SQL."""
    for noise in FILTER_NOISE:
        definition = definition.replace(noise, "")
    return definition.lower()


def filter_sql(column: str) -> str:
    """``normalize_filter`` as a T-SQL expression over ``column``."""
    for noise in FILTER_NOISE:
        column = f"REPLACE({column}, {_nstr(noise)}, N'')"
    return f"LOWER({column})"

#: ODBC SQL types for setinputsizes (the same numbers in pyodbc and mssql-python).
SQL_WVARCHAR, SQL_WLONGVARCHAR, SQL_INTEGER, SQL_BIGINT = -9, -10, 4, -5
#: Strings up to this many UTF-16 units bind as NVARCHAR(4000), longer ones as
#: NVARCHAR(MAX): each driver's own switch to streaming (pyodbc streams past 4000
#: bytes, mssql-python past 4000 units), so the declared size never changes how the
#: driver sends the value.
INLINE_UNITS = {"pyodbc": 2000, "mssql_python": 4000}

#: The result columns' types, for the claim's table variable (payload/headers as text
#: whether the columns are NVARCHAR(MAX) or the native json type).
_MESSAGE_TYPES = {
    "id": "BIGINT NOT NULL PRIMARY KEY", "message_id": "NVARCHAR(64)", "topic": "NVARCHAR(255)",
    "aggregate_type": "NVARCHAR(255)", "aggregate_id": "NVARCHAR(255)", "partition_key": "NVARCHAR(255)",
    "payload": "NVARCHAR(MAX)", "headers": "NVARCHAR(MAX)", "trace_id": "NVARCHAR(255)", "attempts": "INT",
    "created_at": "DATETIME2(3)", "status": "TINYINT",
}


@dataclass(frozen=True)
class IndexSpec:
    """One index the engine relies on, as data: the migration creates it from this,
    and the definition check compares the catalog against it (keys in order,
    included columns, filter, uniqueness), not only its name."""

    suffix: str
    keys: tuple[str, ...]
    include: tuple[str, ...] = ()
    filtered: bool = False  # WHERE OPEN_ROWS
    unique: bool = False
    why: str = ""

    def ddl(self, name: str, table: str) -> str:
        text = (f"CREATE {'UNIQUE ' if self.unique else ''}NONCLUSTERED INDEX {name} ON {table} "
                f"({', '.join(self.keys)})")
        if self.include:
            text += f" INCLUDE ({', '.join(self.include)})"
        if self.filtered:
            text += f" WHERE {OPEN_ROWS}"
        return text


INDEXES = (
    IndexSpec("message_id", ("message_id",), unique=True,
              why="one row per message_id; the enqueue's duplicate probe seeks it"),
    IndexSpec("agg_open", ("aggregate_id", "id"), filtered=True,
              why="the ordering probe: earlier open rows of an aggregate, never its done history; "
                  "status is not included, so a claim (0 -> 1) does not write to it"),
    IndexSpec("claim_ready", ("id",), ("aggregate_id", "status", "attempts", "claimed_at", "next_retry_at"),
              filtered=True, why="the claim scan over open rows only, covering eligible()"),
    IndexSpec("done_processed_at", ("status", "processed_at"), why="purge: oldest done rows first"),
    IndexSpec("open_created_at", ("created_at",), ("status",), filtered=True,
              why="outbox status and the metrics gauges: oldest open row and counts of open rows"),
)
#: Indexes of earlier releases that a migration drops (their job moved to another index).
RETIRED_INDEXES = ("agg_id_id",)


@dataclass(frozen=True)
class Target:
    """Where and how to connect: the driver module, its connection string, and the
    engine's own session options."""

    driver: str
    connection_string: str
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
    query_timeout_s: int = DEFAULT_QUERY_TIMEOUT_S


def _odbc_value(value: str) -> str:
    """Brace a value that ODBC would otherwise split or trim (``}`` doubles inside)."""
    if any(ch in value for ch in ";{}=") or value != value.strip():
        return "{" + value.replace("}", "}}") + "}"
    return value


def driver_of_url(url: str) -> str:
    """The driver module a SQL Server URL asks for: ``mssql+pyodbc://`` (and plain
    ``mssql://``, raw ODBC strings) -> pyodbc, ``mssql+mssqlpython://`` -> mssql_python."""
    if "://" not in url:
        return "pyodbc"
    scheme = url.split("://", 1)[0].lower()
    suffix = scheme.split("+", 1)[1] if "+" in scheme else ""
    if suffix not in DRIVERS:
        raise ValueError(f"unsupported SQL Server driver {suffix!r} in {scheme}:// "
                         "(use mssql+pyodbc:// or mssql+mssqlpython://)")
    return DRIVERS[suffix]


def _int_option(name: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"OUTBOX_DATABASE_URL: {name} must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"OUTBOX_DATABASE_URL: {name} must be between {low} and {high}, got {number}")
    return number


def parse_target(url: str) -> Target:
    """Turn ``OUTBOX_DATABASE_URL`` into a ``Target``.

    Accepts ``mssql+pyodbc://user:pass@host:1433/db?driver=...&Encrypt=yes`` (user,
    password and query are URL-decoded; every query parameter but ``driver`` and the
    engine's own ``lock_timeout_ms`` / ``query_timeout_s`` is passed on as a
    connection-string keyword), ``mssql+pyodbc:///?odbc_connect=<urlencoded>``, a raw
    ODBC connection string (returned unchanged), and ``mssql+mssqlpython://...``,
    whose connection string has no DRIVER (mssql-python bundles its own).
    """
    if "://" not in url:
        if "=" in url and ";" in url:
            return Target("pyodbc", url)
        raise ValueError("not a SQL Server URL or ODBC connection string "
                         "(expected mssql+pyodbc://user:pass@host:1433/db?driver=...)")
    parts = urlsplit(url)
    if parts.scheme.split("+", 1)[0].lower() not in ("mssql", "sqlserver"):
        raise ValueError(f"not a SQL Server URL: scheme {parts.scheme!r}")
    driver = driver_of_url(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    options = {k.lower(): v for k, v in query if k.lower() in ENGINE_OPTIONS}
    lock_ms = _int_option("lock_timeout_ms", options["lock_timeout_ms"], -1, 86_400_000) \
        if "lock_timeout_ms" in options else DEFAULT_LOCK_TIMEOUT_MS
    query_s = _int_option("query_timeout_s", options["query_timeout_s"], 0, 86_400) \
        if "query_timeout_s" in options else DEFAULT_QUERY_TIMEOUT_S
    query = [(k, v) for k, v in query if k.lower() not in ENGINE_OPTIONS]

    def target(connection_string: str) -> Target:
        return Target(driver, connection_string, lock_ms, query_s)

    for key, value in query:
        if key.lower() == "odbc_connect":
            return target(value)  # parse_qsl has already decoded it
    keywords: dict[str, tuple[str, str]] = {}  # upper-cased keyword -> (keyword, value)

    def put(key: str, value: str) -> None:
        keywords[key.upper()] = (key, value)

    if driver == "pyodbc":
        odbc_driver = next((v for k, v in query if k.lower() == "driver"), DEFAULT_DRIVER)
        put("DRIVER", "{" + odbc_driver.strip("{}").replace("}", "}}") + "}")
    elif any(k.lower() == "driver" for k, _ in query):
        raise ValueError("OUTBOX_DATABASE_URL: mssql+mssqlpython:// takes no driver= "
                         "(mssql-python bundles its own ODBC driver)")
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
    return target(";".join(f"{key}={value if key.upper() == 'DRIVER' else _odbc_value(value)}"
                           for key, value in keywords.values()) + ";")


def odbc_connection_string(url: str) -> str:
    """The connection string of ``parse_target`` (kept for callers that only need it)."""
    return parse_target(url).connection_string


def _nstr(text: str) -> str:
    """A T-SQL Unicode string literal."""
    return "N'" + text.replace("'", "''") + "'"


def _if(condition: str, statement: str) -> str:
    """``IF ... BEGIN ... END``: the block makes the end of the guarded statement
    explicit for readers and for parsers (sqlglot reads a bare ``IF c SET ...`` wrong)."""
    return f"IF {condition}\nBEGIN\n    {statement};\nEND;"


def _error_fields(exc: BaseException) -> tuple[str | None, str]:
    """(SQLSTATE, message) of a pyodbc or mssql-python error, recognised by class
    module so this works (and is testable) where a driver cannot load; (None, '')
    for anything else."""
    modules = {cls.__module__.split(".", 1)[0] for cls in type(exc).__mro__}
    if "pyodbc" in modules:
        args = exc.args
        state = args[0] if args and isinstance(args[0], str) else None
        return state, " ".join(str(a) for a in args)
    if "mssql_python" in modules:
        described = str(getattr(exc, "driver_error", "") or "")
        state = _MSSQL_PYTHON_STATES.get(described)
        if state is None:
            found = re.search(r"SQLSTATE code: (\w{5})", described)
            state = found.group(1) if found else None
        return state, f"{described} {getattr(exc, 'ddbc_error', '') or ''} {exc}"
    return None, ""


def error_numbers(message: str) -> set[int]:
    """Native error numbers in a pyodbc message: each diagnostic record ends with its
    number in parentheses, followed by the ODBC function, the next record or the end
    (``... deadlock victim. (1205) (SQLExecDirectW)``); a number inside the text, as
    in ``nvarchar(64)``, is not one."""
    return {int(n) for n in re.findall(r"\((\d{1,6})\)(?=\s*(?:\(SQL\w*\)|;|$))", message)}


def _result_rows(cursor: Any) -> list[tuple]:
    """Rows of the batch's first result set. The batches set NOCOUNT ON, but stepping
    over anything before it guards against "No results. Previous SQL was not a query"."""
    while cursor.description is None:
        if not cursor.nextset():
            raise StoreError("SQL Server batch returned no result set")
    return [tuple(row) for row in cursor.fetchall()]


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, the unit NVARCHAR(n) counts."""
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


def input_sizes(params: Sequence[Any], inline_units: int = 2000) -> list[tuple[int, int, int]] | None:
    """Declared types for ``cursor.setinputsizes``: every string as NVARCHAR(4000), or
    NVARCHAR(MAX) past ``inline_units`` UTF-16 units, and None as NVARCHAR(4000) (pyodbc would
    otherwise declare each string by its own length, and mssql-python an ASCII one
    as VARCHAR(length): a plan per length); integers as INT or BIGINT by range.
    None when a parameter of another type leaves the decision to the driver."""
    sizes: list[tuple[int, int, int]] = []
    for value in params:
        if isinstance(value, bool):
            return None
        if value is None:
            sizes.append((SQL_WVARCHAR, 4000, 0))
        elif isinstance(value, str):
            sizes.append((SQL_WVARCHAR, 4000, 0) if utf16_len(value) <= inline_units else (SQL_WLONGVARCHAR, 0, 0))
        elif isinstance(value, int):
            sizes.append((SQL_INTEGER, 0, 0) if -2**31 <= value < 2**31 else (SQL_BIGINT, 0, 0))
        else:
            return None
    return sizes


def _is_ddl(text: str) -> bool:
    """Migration batches (they all start with the filtered-index options): they run
    without the query timeout, bounded by the lock timeout and the migration lock."""
    return text.startswith(FILTERED_INDEX_OPTIONS)


def migration_lock_statements(resource: str, table_literal: str, table: str) -> list[str]:
    """The first batch of a migration: an exclusive ``sp_getapplock`` on ``resource``, so two
    migrations of the same tables (two deploy jobs, workers creating the broker's queue
    tables at start-up) run one after the other; the second waits for the first to commit
    and then finds everything in place. The lock belongs to the migration's transaction
    when one is open (released at commit); a driver in implicit-transaction mode may not
    have opened it yet, and then the session owns the lock until the last batch
    (``migration_unlock_statements``) releases it."""
    return [
        "DECLARE @lock_owner NVARCHAR(32), @lock_result INT;",
        # A SELECT from a table opens the driver's implicit transaction (EXEC does not).
        f"SELECT @lock_result = COUNT(*) FROM sys.objects WHERE object_id = OBJECT_ID({table_literal});",
        "SET @lock_owner = CASE WHEN @@TRANCOUNT > 0 THEN N'Transaction' ELSE N'Session' END;",
        f"EXEC @lock_result = sp_getapplock @Resource = {_nstr(resource)}, "
        f"@LockMode = N'Exclusive', @LockOwner = @lock_owner, @LockTimeout = {MIGRATE_LOCK_TIMEOUT_MS};",
        _if("@lock_result < 0", "RAISERROR(N'outbox migrate: another outbox migrate of %s held the migration "
            "lock for too long (sp_getapplock returned %d); run it again when that one has finished', 16, 1, "
            f"{_nstr(table)}, @lock_result)"),
    ]


def migration_unlock_statements(resource: str) -> list[str]:
    """The last batch of a migration: release a session-owned migration lock (a
    transaction-owned one goes with the commit)."""
    return [_if(f"APPLOCK_MODE(N'public', {_nstr(resource)}, N'Session') <> N'NoLock'",
                f"EXEC sp_releaseapplock @Resource = {_nstr(resource)}, @LockOwner = N'Session'")]


def lock_escalation_off(table: str, table_literal: str) -> str:
    """Turn lock escalation off (docs/sqlserver.md, "Lock escalation"), guarded by the catalog."""
    return _if(f"EXISTS (SELECT 1 FROM sys.tables WHERE object_id = OBJECT_ID({table_literal}) "
               "AND lock_escalation_desc <> N'DISABLE')", f"ALTER TABLE {table} SET (LOCK_ESCALATION = DISABLE)")


def add_json_check_sql(table: str, constraint: str, column: str) -> str:
    """Add an ISJSON check to an existing table without checking its rows (WITH NOCHECK):
    new and updated values are checked, the constraint is marked not trusted."""
    return f"ALTER TABLE {table} WITH NOCHECK ADD CONSTRAINT {constraint} CHECK (ISJSON({column}) = 1)"


class MssqlEngine(Engine):
    name = "mssql"
    placeholder = "?"
    default_schema: ClassVar[str | None] = "dbo"
    now: ClassVar[str] = "SYSUTCDATETIME()"
    #: With RCSI off a plain read waits for every uncommitted enqueue (issue 20, item 10);
    #: the gauges may count a row that then rolls back.
    unlocked_read: ClassVar[str] = " WITH (READUNCOMMITTED)"

    def __init__(self, table: str = "outbox", schema: str | None = None) -> None:
        super().__init__(table=table, schema=schema)
        #: The database's compatibility level, the server's major version and engine
        #: edition, read from a connection (``read_server``); None until then, and SQL
        #: built before then uses neither OPENJSON nor ISJSON.
        self.compat_level: int | None = None
        self.server_version: int | None = None
        self.engine_edition: int | None = None
        #: The aggregate_id column's collation, read at the first claim.
        self.id_collation: str | None = None
        #: Whether the ordering probe's index is there as defined, read at the first claim;
        #: None until then (SQL text built before assumes it is). Without it the probe is
        #: still a seek, of whatever index the optimizer picks, rather than an error.
        self.probe_index: bool | None = None
        self._checked = False

    @property
    def has_json(self) -> bool:
        """OPENJSON is there: the database's compatibility level, as read from a
        connection, is 130 or later."""
        return self.compat_level is not None and self.compat_level >= JSON_LEVEL

    @property
    def has_isjson(self) -> bool:
        """ISJSON is there: SQL Server 2016 or later (at any compatibility level) or Azure
        SQL, as read from a connection."""
        return ((self.server_version is not None and self.server_version >= JSON_VERSION)
                or self.engine_edition in AZURE_EDITIONS)

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

    def id_chunks(self, ids: Sequence[int]) -> list[list[int]]:
        """One list with OPENJSON; otherwise lists of at most ID_PARAMS_PER_STATEMENT,
        so no statement passes SQL Server's 2,100-parameter limit."""
        ids = [int(i) for i in ids]
        if self.has_json or len(ids) <= ID_PARAMS_PER_STATEMENT:
            return [ids]
        return [ids[i:i + ID_PARAMS_PER_STATEMENT] for i in range(0, len(ids), ID_PARAMS_PER_STATEMENT)]

    def ids_in(self, ids: Sequence[int]) -> tuple[str, list[Any]]:
        """``id IN (...)``: one JSON parameter expanded by OPENJSON at level 130 and
        later (any count); below, one parameter per id (see ``id_chunks``), the list
        padded to the next of ``ID_LIST_SIZES`` by repeating its last id. A repeated
        value changes nothing an ``IN`` list matches (or a row count), and unlike a
        "never matching" pad value it needs no assumption about which ids exist."""
        if not ids:
            return "1 = 0", []
        ids = [int(i) for i in ids]
        if self.has_json:
            return "id IN (SELECT CAST([value] AS BIGINT) FROM OPENJSON(?))", [json.dumps(ids)]
        if len(ids) > ID_PARAMS_PER_STATEMENT:
            raise StoreError(f"{len(ids)} ids in one statement: split them with id_chunks() "
                             f"(compatibility level {self.compat_level} has no OPENJSON)")
        size = next(size for size in ID_LIST_SIZES if size >= len(ids))
        padded = ids + [ids[-1]] * (size - len(ids))
        return f"id IN ({', '.join('?' * size)})", padded

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
    @staticmethod
    def session_sql(lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> str:
        """The session options the engine relies on, then the compatibility level.
        The isolation level is left alone on purpose: the claim's table hints give the
        locking it needs on locking and RCSI databases."""
        return (f"SET NOCOUNT OFF; SET XACT_ABORT ON; SET LOCK_TIMEOUT {int(lock_timeout_ms)}; "
                f"SET DEADLOCK_PRIORITY LOW; {FILTERED_INDEX_OPTIONS}\n{SERVER_SQL}")

    def connect(self, url: str) -> Any:
        target = parse_target(url)
        if target.driver == "mssql_python":
            try:
                import mssql_python
            except ImportError:
                raise StoreError("OUTBOX_DATABASE_URL asks for mssql-python: "
                                 + install_hint("mssql-python")) from None
            conn = mssql_python.connect(target.connection_string, autocommit=False)
        else:
            import pyodbc  # imported here: importing it needs unixODBC installed
            # Autocommit off: the driver opens a transaction at the first statement
            # and the store commits it.
            conn = pyodbc.connect(target.connection_string, autocommit=False)
        try:
            conn.timeout = target.query_timeout_s
            self.setup_session(conn, target.lock_timeout_ms)
        except BaseException:
            conn.close()
            raise
        return conn

    def setup_session(self, conn: Any, lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
        """Set the session options, read what the server offers (once per connection)
        and, once per engine, check the table and log what is wrong with it."""
        cursor = conn.cursor()
        try:
            rows = _result_rows(cursor.execute(self.session_sql(lock_timeout_ms)))
            self._learn_server(rows[0] if rows else None)
            if not self._checked:
                self._checked = True
                for problem in self.schema_problems(cursor):
                    log.warning("outbox table %s: %s", self.table, problem)
        finally:
            cursor.close()
        conn.commit()  # the catalog reads opened a transaction; SET options outlive it

    #: The claim is one batch that, run alone, opens and commits its own transaction
    #: (``claim_statements(own_transaction=True)``): one round trip, and its locks never
    #: wait for the client's COMMIT (docs/relay.md, "A network cut").
    one_statement_claim: ClassVar[bool] = True

    @contextmanager
    def statement_alone(self, conn: Any) -> Iterator[None]:
        """Autocommit for the block (pyodbc and mssql-python both take ``conn.autocommit``).
        The store runs it with no transaction of its own open, so the switch commits
        nothing; a connection already in autocommit is left as it is."""
        if getattr(conn, "autocommit", False) is True:
            yield
            return
        with self.autocommit(conn):
            yield

    def read_server(self, cursor: Any) -> None:
        """Probe the connection ``cursor`` runs on (one the engine did not open: a Django
        or Alembic migration, the Django admin) for what the SQL built next may use:
        OPENJSON (the compatibility level) and ISJSON (the version)."""
        self._learn_server(self.execute(cursor, SERVER_SQL).fetchone())

    def _learn_server(self, row: Sequence[Any] | None) -> None:
        if row is None:  # no answer: keep what is known (unknown means neither function)
            return
        level, version, edition = (None if v is None else int(v) for v in row[:3])
        if level is not None and level < MIN_LEVEL:
            raise StoreError(f"SQL Server database compatibility level {level} is not supported "
                             f"(the engine needs {MIN_LEVEL}, SQL Server 2012, or later)")
        known = (self.compat_level, self.server_version, self.engine_edition)
        self.compat_level, self.server_version, self.engine_edition = level, version, edition
        if known == (level, version, edition):
            return
        if not self.has_json:
            log.info("SQL Server compatibility level %s has no OPENJSON: id lists are sent as parameter lists "
                     "of at most %d ids per statement", level, ID_PARAMS_PER_STATEMENT)
        if not self.has_isjson:
            log.info("SQL Server %s (engine edition %s) has no ISJSON: the table is made without its JSON checks "
                     "(enqueue validates the JSON in any case)", version, edition)

    def execute(self, cursor: Any, text: str, params: Sequence[Any] = ()) -> Any:
        """Bind parameters with stable declared types (one plan per statement, not per
        string length), and run migration batches without the query timeout."""
        params = tuple(params)
        if hasattr(cursor, "setinputsizes"):
            driver = type(cursor).__module__.split(".", 1)[0]
            sizes = input_sizes(params, INLINE_UNITS.get(driver, 2000)) if params else None
            # pyodbc keeps sizes until they are replaced: clear them for other statements.
            if sizes is not None or driver == "pyodbc":
                cursor.setinputsizes(sizes)
        if not _is_ddl(text):
            cursor.execute(text, params)
            return cursor
        conn = getattr(cursor, "connection", None)
        saved = getattr(conn, "timeout", None)
        if saved:
            conn.timeout = 0
        try:
            cursor.execute(text, params)
        finally:
            if saved:
                conn.timeout = saved
        return cursor

    def is_transient(self, exc: BaseException) -> bool:
        state, message = _error_fields(exc)
        if state is None and not message:
            return False
        lowered = message.lower()
        return (state in _TRANSIENT_STATES or bool(error_numbers(message) & TRANSIENT_ERRORS.keys())
                or any(phrase in lowered for phrase in _TRANSIENT_PHRASES))

    def is_disconnect(self, exc: BaseException) -> bool:
        state, message = _error_fields(exc)
        lowered = message.lower()
        return (state in _DISCONNECT_STATES or bool(error_numbers(message) & DISCONNECT_ERRORS)
                or any(phrase in lowered for phrase in _DISCONNECT_PHRASES))

    # -- schema ----------------------------------------------------------------------
    def _table_literal(self) -> str:
        return _nstr(self.table)

    def index_matches(self, spec: IndexSpec) -> str:
        """A query returning a row when the index exists with exactly ``spec``'s
        definition: uniqueness, filter, key columns in order (ascending), the included
        columns, and nothing else."""
        t = self._table_literal()
        name = _nstr(self.index_name(spec.suffix))
        filter_normalized = filter_sql("i.filter_definition")
        if spec.filtered:
            filter_ok = (f"i.has_filter = 1 AND {filter_normalized} IN "
                         f"({', '.join(_nstr(f) for f in OPEN_ROWS_NORMALIZED)})")
        else:
            filter_ok = "i.has_filter = 0"

        def column(condition: str) -> str:
            return ("EXISTS (SELECT 1 FROM sys.index_columns AS ic INNER JOIN sys.columns AS c "
                    "ON c.object_id = ic.object_id AND c.column_id = ic.column_id "
                    f"WHERE ic.object_id = i.object_id AND ic.index_id = i.index_id AND {condition})")

        checks = [f"i.is_unique = {1 if spec.unique else 0}", filter_ok,
                  "(SELECT COUNT(*) FROM sys.index_columns AS n WHERE n.object_id = i.object_id "
                  f"AND n.index_id = i.index_id) = {len(spec.keys) + len(spec.include)}"]
        checks += [column(f"ic.key_ordinal = {position} AND ic.is_descending_key = 0 AND c.name = {_nstr(key)}")
                   for position, key in enumerate(spec.keys, start=1)]
        checks += [column(f"ic.is_included_column = 1 AND c.name = {_nstr(col)}") for col in spec.include]
        return (f"SELECT 1 FROM sys.indexes AS i WHERE i.object_id = OBJECT_ID({t}) AND i.name = {name} AND "
                + " AND ".join(checks))

    def _index_exists(self, suffix: str) -> str:
        return (f"EXISTS (SELECT 1 FROM sys.indexes WHERE name = {_nstr(self.index_name(suffix))} "
                f"AND object_id = OBJECT_ID({self._table_literal()}))")

    def migration_lock_resource(self) -> str:
        return f"outbox migrate {self.table}"

    def migration_steps(self, native_json: bool = False) -> list[Any]:
        """The migration as items of statements: a list of statements (run as one
        batch), or ``((probe, params), statements)`` run only when the probe finds no
        row. ``migration()`` joins each into the batch that is sent."""
        t, q, name = self.table, self.quote, self.table_name
        table_literal = self._table_literal()
        schema = self.schema or "dbo"
        checked_json = not native_json and self.has_isjson

        def constraint(kind: str, column: str = "") -> str:
            return "CONSTRAINT " + q("_".join(filter(None, (kind, name, column))))

        def json_column(column: str, default: str = "") -> str:
            if native_json:  # SQL Server 2025 / Azure SQL: the type itself validates
                return f"{column} JSON NOT NULL{default}"
            check = f" {constraint('ck', column + '_json')} CHECK (ISJSON({column}) = 1)" if checked_json else ""
            return f"{column} NVARCHAR(MAX) NOT NULL{default}{check}"

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
        lock = migration_lock_statements(self.migration_lock_resource(), table_literal, t)
        unlock = migration_unlock_statements(self.migration_lock_resource())
        steps: list[Any] = [
            lock,
            # CREATE SCHEMA must be the only statement of its batch, hence dynamic SQL.
            [_if(f"SCHEMA_ID({_nstr(schema)}) IS NULL", f"EXEC sp_executesql {_nstr('CREATE SCHEMA ' + q(schema))}")],
            [_if(f"OBJECT_ID({table_literal}, N'U') IS NULL", create_table)],
            # Columns added after the first release: repaired on tables an older script made.
            *([_if(f"COL_LENGTH({table_literal}, {_nstr(column)}) IS NULL", f"ALTER TABLE {t} ADD {column} {ddl}")]
              for column, ddl in (("last_error", "NVARCHAR(4000) NULL"), ("lease_token", "CHAR(32) NULL"))),
        ]
        if checked_json:
            # A table made before the server had ISJSON (or by another script) gets its
            # JSON checks now, WITH NOCHECK: checking the existing rows would scan the
            # whole table under a schema lock that stops every enqueuer, and one bad row
            # would abort the migration (docs/sqlserver.md, "JSON checks on an existing
            # table"). Sent through sp_executesql like CREATE SCHEMA: the T-SQL parser the
            # tests check every statement with does not know the WITH NOCHECK form, so
            # they check its text.
            for column in ("payload", "headers"):
                ck = q(f"ck_{name}_{column}_json")
                steps.append([_if(
                    f"OBJECT_ID({_nstr((self.quote(schema) + '.' + ck))}, N'C') IS NULL AND EXISTS (SELECT 1 FROM "
                    f"sys.columns WHERE object_id = OBJECT_ID({table_literal}) AND name = {_nstr(column)} "
                    "AND system_type_id = 231)",
                    f"EXEC sp_executesql {_nstr(add_json_check_sql(t, ck, column))}")])
        for suffix in RETIRED_INDEXES:
            steps.append([_if(self._index_exists(suffix), f"DROP INDEX {q(self.index_name(suffix))} ON {t}")])
        for spec in INDEXES:
            index = q(self.index_name(spec.suffix))
            # An index whose definition differs is dropped here and made again by the
            # next step, inside the migration's transaction: nobody sees the gap.
            steps.append(((self.index_matches(spec), []),
                          [_if(self._index_exists(spec.suffix), f"DROP INDEX {index} ON {t}")]))
            steps.append([_if(f"NOT {self._index_exists(spec.suffix)}", spec.ddl(index, t))])
        # Claims, purge chunks and requeue-all may lock more than 5,000 rows; escalation
        # to a table lock would stop every enqueuer until they commit.
        steps.append([lock_escalation_off(t, table_literal)])
        steps.append([_if(f"OBJECT_ID({_nstr(self.holders)}, N'U') IS NULL",
                          f"CREATE TABLE {self.holders} ({self.holders_columns()})")])
        steps.append(unlock)
        return steps

    def holders_columns(self) -> str:
        return (f"holder_id CHAR(16) COLLATE {ID_COLLATION} NOT NULL "
                f"CONSTRAINT {self.quote('pk_' + self.holders_name)} PRIMARY KEY, "
                "host NVARCHAR(255) NOT NULL, pid INT NOT NULL, "
                "started_at DATETIME2(3) NOT NULL, beat_at DATETIME2(3) NOT NULL")

    def is_missing_table(self, exc: BaseException) -> bool:
        state, message = _error_fields(exc)
        return state == "42S02" or 208 in error_numbers(message)  # Invalid object name

    def migration(self, native_json: bool = False) -> list[Any]:
        """One batch per object, each guarded on its own, so re-running repairs a partial
        deployment. Each batch starts with the SET options filtered indexes need."""
        def batch(statements: list[str]) -> str:
            return FILTERED_INDEX_OPTIONS + "\n" + "\n".join(statements)
        return [((step[0], batch(step[1])) if isinstance(step, tuple) else batch(step))
                for step in self.migration_steps(native_json)]

    def schema_problems(self, cursor: Any) -> list[str]:
        """What start-up finds wrong with an existing table, each with what to do:
        id columns that compare case-insensitively, and indexes that are missing,
        retired or defined differently (``outbox migrate`` repairs those)."""
        t = self._table_literal()
        exists = self.execute(cursor, f"SELECT OBJECT_ID({t}, N'U')").fetchone()
        if not exists or exists[0] is None:
            return []
        problems = []
        rows = self.execute(cursor, f"SELECT name, collation_name FROM sys.columns WHERE object_id = OBJECT_ID({t}) "
                            "AND name IN (N'message_id', N'aggregate_id')").fetchall()
        for column, collation in rows:
            if collation and not (collation.upper().endswith(("_BIN", "_BIN2")) or "_CS" in collation.upper()):
                problems.append(
                    f"column {column} uses the case-insensitive collation {collation}: ids that differ only in case "
                    f"are one {'message' if column == 'message_id' else 'aggregate'}. The relay works with it; "
                    f"to match the other engines convert it to {ID_COLLATION} (docs/sqlserver.md)")
        for spec in INDEXES:
            if self.execute(cursor, self.index_matches(spec)).fetchone() is None:
                problems.append(f"index {self.index_name(spec.suffix)} is missing or defined differently "
                                f"({spec.why}): run `outbox migrate`")
        for suffix in RETIRED_INDEXES:
            if self.execute(cursor, f"SELECT 1 WHERE {self._index_exists(suffix)}").fetchone() is not None:
                problems.append(f"index {self.index_name(suffix)} is retired (it makes every claim and ack write "
                                "to an index of the whole history): run `outbox migrate`")
        return problems

    # -- write side (the caller's transaction: never commit it, never raise on a duplicate) --
    #: A shared application lock the insert batch takes only in a transaction it opened
    #: itself (the caller had none): its presence tells ``insert_event``'s clean-up that
    #: the open transaction is the batch's own, never the caller's.
    OWN_TRANSACTION_LOCK = "outbox enqueue: own transaction"

    def insert_statements(self) -> list[str]:
        """Insert unless the message_id is stored, then return the row's id
        (docs/sqlserver.md, "Enqueue: no key-range locks").

        No key-range locks: the duplicate probe is a plain seek of the unique
        message_id index. Two enqueues of the *same* message_id are serialized by an
        application lock owned by a transaction, so the second waits for the first to
        commit and then finds its row; enqueues of different ids never wait for each
        other, whatever the gap between their keys. The lock's key is a CHECKSUM of the
        message id in the column's own collation, which is equal for every two ids the
        unique index finds equal (trailing spaces; case on a case-insensitive column).

        Both reads of the table use READCOMMITTEDLOCK, so a caller at READ UNCOMMITTED
        waits for an uncommitted row instead of returning its id, and one at SNAPSHOT
        sees a row committed after its snapshot instead of inserting a duplicate.

        The lock is never owned by the session: with no transaction open (an autocommit
        connection) the batch opens its own around the lock and the insert, and commits
        it. So no duplicate-key error can reach the caller's transaction, no lock can
        outlive it, and XACT_ABORT is left as the caller set it. Values go into typed
        variables first, so a None binds without a type guess, and long payloads reach
        NVARCHAR(MAX) variables. The result is (id, lock result); the id is NULL only
        when the lock was refused.
        """
        t = self.table
        values = ", ".join(f"@{c.strip()}" for c in self.INSERT_COLUMNS.split(","))
        inserted = (f"INSERT INTO {t} ({self.INSERT_COLUMNS})\n    OUTPUT inserted.id INTO @ids\n    SELECT {values}\n"
                    f"    WHERE NOT EXISTS (SELECT 1 FROM {t} WITH (READCOMMITTEDLOCK) "
                    "WHERE message_id = @message_id)")
        own_lock = _nstr(self.OWN_TRANSACTION_LOCK)
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512;",
            "SET NOCOUNT ON;",
            "DECLARE @message_id NVARCHAR(64) = ?, @topic NVARCHAR(255) = ?, @aggregate_type NVARCHAR(255) = ?, "
            "@aggregate_id NVARCHAR(255) = ?, @partition_key NVARCHAR(255) = ?, @payload NVARCHAR(MAX) = ?, "
            "@headers NVARCHAR(MAX) = ?, @trace_id NVARCHAR(255) = ?;",
            "DECLARE @id BIGINT, @lock_key INT, @lock_result INT = 0, @own_transaction BIT = 0, "
            "@lock_resource NVARCHAR(255);",
            "DECLARE @ids TABLE (id BIGINT NOT NULL);",
            # The common case, a new id: one seek, no application lock. The same statement
            # computes the lock's key: COALESCE with the column gives @message_id the
            # column's collation, and CHECKSUM is equal for values that compare equal in
            # it. Reading the table also opens the driver's implicit transaction (autocommit
            # off), so @@TRANCOUNT below is the truth.
            f"SELECT @id = o.id, @lock_key = CHECKSUM(COALESCE(o.message_id, @message_id))\n"
            f"FROM (SELECT 1 AS one) AS d LEFT JOIN {t} AS o WITH (READCOMMITTEDLOCK) ON o.message_id = @message_id;",
            f"SET @lock_resource = N'outbox:' + CONVERT(NVARCHAR(64), HASHBYTES('SHA2_256', {_nstr(t + '|')} "
            "+ CONVERT(NVARCHAR(11), @lock_key)), 2);",
            # No transaction open (an autocommit connection): open one, so the lock below is
            # owned by a transaction that ends with this batch, however the batch ends.
            f"IF @id IS NULL AND @@TRANCOUNT = 0\nBEGIN\n    SET @own_transaction = 1;\n    BEGIN TRANSACTION;\n"
            f"    EXEC sp_getapplock @Resource = {own_lock}, @LockMode = N'Shared', @LockOwner = N'Transaction';\nEND;",
            _if("@id IS NULL", "EXEC @lock_result = sp_getapplock @Resource = @lock_resource, "
                "@LockMode = N'Exclusive', @LockOwner = N'Transaction'"),
            _if("@id IS NULL AND @lock_result >= 0", inserted),
            _if("@own_transaction = 1", "COMMIT TRANSACTION"),
            "SET @id = COALESCE(@id, (SELECT TOP (1) id FROM @ids), "
            f"(SELECT id FROM {t} WITH (READCOMMITTEDLOCK) WHERE message_id = @message_id));",
            _if("@nocount = 0", "SET NOCOUNT OFF"),
            "SELECT @id AS id, @lock_result AS lock_result;",
        ]

    def insert_batch(self) -> str:
        return "\n".join(self.insert_statements())

    def end_own_transaction_sql(self) -> str:
        """Roll back the transaction the insert batch opened for itself, if the batch was
        cut short before its COMMIT (a client timeout, with XACT_ABORT off); never the
        caller's transaction, which never holds ``OWN_TRANSACTION_LOCK``."""
        return ("IF @@TRANCOUNT > 0\nBEGIN\n"
                f"    IF APPLOCK_MODE(N'public', {_nstr(self.OWN_TRANSACTION_LOCK)}, N'Transaction') <> N'NoLock'\n"
                "    BEGIN\n        ROLLBACK TRANSACTION;\n    END;\nEND;")

    #: What sp_getapplock's negative results mean.
    LOCK_RESULTS = {-1: "timed out (the session's LOCK_TIMEOUT)", -2: "was cancelled",
                    -3: "was chosen as a deadlock victim", -999: "failed (parameter or call error)"}

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        try:
            self.execute(cursor, self.insert_batch(), self.event_params(event))
            outbox_id, lock_result = _result_rows(cursor)[0]
        except BaseException:
            try:
                self.execute(cursor, self.end_own_transaction_sql())
            except Exception:  # the connection is gone: so is the transaction
                pass
            raise
        if outbox_id is None:
            reason = self.LOCK_RESULTS.get(int(lock_result or -999), f"returned {lock_result}")
            raise StoreError(f"enqueue of message_id {event.message_id!r}: the lock that serializes enqueues of "
                             f"the same message_id {reason}; the caller's transaction is unchanged")
        return int(outbox_id)

    # -- claim -------------------------------------------------------------------------
    #: The ordering probe's index, which the probe is pinned to (``FORCESEEK``).
    PROBE_INDEX = next(spec for spec in INDEXES if spec.suffix == "agg_open")

    def probe_select(self) -> str:
        """One row per aggregate of ``@cand``: its first candidate (``head``) and its
        *blocker*, the first open row of the aggregate before its last candidate that is
        not a candidate (NULL: none). Rule 1 of ``chain_select`` needs nothing else, as in
        ``outbox.domain.chains.plan_claim`` (its ``first_blocker``) and the PostgreSQL claim.

        One probe per aggregate, a ``TOP (1)`` walk of the agg_open index in id order
        that stops at the first row outside ``@cand``: linear in the window, where a probe
        per candidate read k-1 rows for the k-th candidate of a hot aggregate. The walk
        is pinned to a seek of agg_open (``FORCESEEK``; docs/sqlserver.md, "The claim's
        plans"), and its ``status IN (0, 1, 3)`` is written exactly as that index's
        filter, so it never reads an aggregate's done history.

        The probe reads with READCOMMITTEDLOCK and never READPAST. A competitor's U lock
        is compatible with S, so the probe sees the competitor's locked earlier rows
        (still pending, or claimed once it commits) and they block; READPAST would skip
        them and let a later row overtake them (docs/design.md, "Why the probe treats
        every non-candidate open row as blocking"). The probe runs in a statement of its
        own, while this claim holds only U locks, so a probe waiting on a competitor's
        UPDATE can never close a deadlock cycle.
        """
        index = self.quote(self.index_name(self.PROBE_INDEX.suffix))
        seek = f"FORCESEEK ({index} ({self.PROBE_INDEX.keys[0]}))" if self.probe_index is not False else "FORCESEEK"
        return f"""SELECT g.aggregate_id, g.head, (
        SELECT TOP (1) e.id FROM {self.table} AS e WITH (READCOMMITTEDLOCK, {seek})
        WHERE e.aggregate_id = g.aggregate_id AND e.id < g.last_id AND e.{OPEN_ROWS}
          AND NOT EXISTS (SELECT 1 FROM @cand AS k WHERE k.id = e.id)
        ORDER BY e.id)
FROM (SELECT aggregate_id, MIN(id) AS head, MAX(id) AS last_id FROM @cand GROUP BY aggregate_id) AS g"""

    def chain_select(self) -> str:
        """``(id, head, dead)`` of the candidates in ``@cand`` this claim takes, given
        ``@agg`` (``probe_select``): exactly the rule of ``outbox.domain.chains.plan_claim``.
        A candidate is taken when

        1. its aggregate has no blocker before it (an open row outside ``@cand``: held by
           another claimer, not yet due, a live lease: each blocks what follows);
        2. no candidate of its aggregate up to and including it is other than pending,
           except the aggregate's first (an expired lease or a due retry may start a
           chain; one further along ends the chain there);
        3. no earlier candidate of its aggregate goes dead (an expired lease out of
           attempts goes dead instead, and the rows behind it wait for the next claim).

        Rules 2 and 3 are running sums per aggregate in id order (``ROWS UNBOUNDED
        PRECEDING``: one pass), not self-joins of ``@cand`` that compared every candidate
        with every earlier one.
        """
        goes_dead = "c.status = 1 AND c.attempts + 1 >= @max_attempts"
        return f"""SELECT r.id, r.head, r.dead
FROM (
    SELECT f.id, f.head, f.blocker, f.dead,
           SUM(f.late) OVER (PARTITION BY f.head ORDER BY f.id ROWS UNBOUNDED PRECEDING) AS cut,
           SUM(f.dead) OVER (PARTITION BY f.head ORDER BY f.id ROWS UNBOUNDED PRECEDING) - f.dead AS dead_before
    FROM (
        SELECT c.id, a.head, a.blocker,
               CASE WHEN {goes_dead} THEN 1 ELSE 0 END AS dead,
               CASE WHEN c.status <> 0 AND c.id > a.head THEN 1 ELSE 0 END AS late
        FROM @cand AS c INNER JOIN @agg AS a ON a.aggregate_id = c.aggregate_id
    ) AS f
) AS r
WHERE (r.blocker IS NULL OR r.id < r.blocker) AND r.cut = 0 AND r.dead_before = 0"""

    def claim_statements(self, own_transaction: bool = False) -> list[str]:
        """The claim, one statement per item; run as one batch. Parameters: ``claim_params``.

        ``own_transaction`` (the relay's claim, run on an autocommit connection by
        ``statement_alone``): the batch opens its transaction and commits it right after the
        UPDATE, so claim and COMMIT are one round trip and no moment exists when the
        claim's locks wait for the client (docs/relay.md, "A network cut"). Without it (a
        caller's open transaction) there is no BEGIN TRAN/COMMIT: the driver has a
        transaction open already (an explicit one would nest) and the caller commits.
        Either way XACT_ABORT makes any error roll the whole claim back.
        ``@cand.aggregate_id`` and ``@agg.aggregate_id`` take the table column's
        collation: two different column collations in one comparison fail with error 468.
        """
        t = self.table
        out_columns = ", ".join(MESSAGE_COLUMNS)
        output = ", ".join(f"CAST(inserted.{c} AS NVARCHAR(MAX))" if c in ("payload", "headers")
                           else f"inserted.{c}" for c in MESSAGE_COLUMNS)
        collation = self.id_collation or ID_COLLATION
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512, @xact_abort INT = @@OPTIONS & 16384;",
            "SET NOCOUNT ON;",
            "SET XACT_ABORT ON;",
            *(["BEGIN TRANSACTION;"] if own_transaction else []),
            "DECLARE @batch INT = ?, @window INT = ?, @max_attempts INT = ?, @lease CHAR(32) = ?, "
            "@lease_error NVARCHAR(4000) = ?;",
            f"DECLARE @cand TABLE (id BIGINT NOT NULL PRIMARY KEY, aggregate_id NVARCHAR(255) COLLATE {collation} "
            "NOT NULL, status TINYINT NOT NULL, attempts INT NOT NULL, UNIQUE (aggregate_id, id));",
            f"DECLARE @agg TABLE (aggregate_id NVARCHAR(255) COLLATE {collation} NOT NULL PRIMARY KEY, "
            "head BIGINT NOT NULL, blocker BIGINT NULL);",
            "DECLARE @chain TABLE (id BIGINT NOT NULL PRIMARY KEY, head BIGINT NOT NULL, dead BIT NOT NULL);",
            # Declared in MESSAGE_COLUMNS order: OUTPUT ... INTO @out fills it by position.
            "DECLARE @out TABLE (" + ", ".join(f"{c} {_MESSAGE_TYPES[c]}" for c in MESSAGE_COLUMNS) + ");",
            f"INSERT INTO @cand (id, aggregate_id, status, attempts)\n"
            f"SELECT TOP (@window) id, aggregate_id, status, attempts\n"
            f"FROM {t} WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK)\n"
            f"WHERE {self.eligible()}\nORDER BY id;",
            f"INSERT INTO @agg (aggregate_id, head, blocker)\n{self.probe_select()};",
            f"INSERT INTO @chain (id, head, dead)\n{self.chain_select()};",
            # Keep @batch rows of the window's chains: whole chains, oldest chain first
            # (Engine.claim_window; a chain's first row is its aggregate's head); the other
            # candidates' U locks go with the transaction. One numbering pass, no join.
            "WITH ranked AS (SELECT id, ROW_NUMBER() OVER (ORDER BY head, id) AS n FROM @chain)\n"
            "DELETE FROM ranked WHERE n > @batch;",
            # SET expressions read the row as it was before this UPDATE, so every CASE
            # sees the old status and attempts. FORCESEEK: one clustered seek per chosen
            # row, whatever row count the plan was compiled for.
            f"""UPDATE o SET
    attempts = o.attempts + CASE WHEN o.status = 1 THEN 1 ELSE 0 END,
    status = CASE WHEN ch.dead = 1 THEN 4 ELSE 1 END,
    processed_at = CASE WHEN ch.dead = 1 THEN SYSUTCDATETIME() ELSE NULL END,
    last_error = CASE WHEN o.status = 1 THEN @lease_error ELSE o.last_error END,
    claimed_at = SYSUTCDATETIME(),
    next_retry_at = NULL,
    lease_token = CASE WHEN ch.dead = 1 THEN NULL ELSE @lease END
OUTPUT {output} INTO @out
FROM {t} AS o WITH (FORCESEEK) INNER JOIN @chain AS ch ON ch.id = o.id;""",
            *(["COMMIT TRANSACTION;"] if own_transaction else []),
            _if("@xact_abort = 0", "SET XACT_ABORT OFF"),
            _if("@nocount = 0", "SET NOCOUNT OFF"),
            f"SELECT {out_columns} FROM @out ORDER BY id;",
        ]

    def claim_batch(self, own_transaction: bool = False) -> str:
        return "\n".join(self.claim_statements(own_transaction))

    def claim_params(self, batch: int, lease: str, timeout_ms: int, max_attempts: int) -> list[Any]:
        # The DECLARE's five, then eligible()'s lease cutoff (the only other ?).
        return [batch, self.claim_window(batch), max_attempts, lease, LEASE_EXPIRED_ERROR, -timeout_ms]

    def collation_sql(self) -> str:
        return (f"SELECT collation_name FROM sys.columns WHERE object_id = OBJECT_ID({self._table_literal()}) "
                "AND name = N'aggregate_id'")

    def claim(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int) -> list[tuple]:
        """Lease up to ``batch`` rows in the open transaction (the store commits);
        rows whose status is 4 went dead instead."""
        if self.id_collation is None:
            row = self.execute(cursor, self.collation_sql()).fetchone()
            if row and row[0]:
                self.id_collation = str(row[0])
        if self.probe_index is None:
            self.probe_index = self.execute(cursor, self.index_matches(self.PROBE_INDEX)).fetchone() is not None
        own = getattr(getattr(cursor, "connection", None), "autocommit", False) is True  # statement_alone
        try:
            self.execute(cursor, self.claim_batch(own), self.claim_params(batch, lease, timeout_ms, max_attempts))
            return _result_rows(cursor)
        except BaseException:
            # An error can end the batch before it restores the session options; put
            # back the relay connection's own (see session_sql). On an autocommit
            # connection the driver's rollback does nothing: a transaction the batch opened
            # and an interrupt left behind is rolled back here.
            try:
                cursor.execute(("IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION; " if own else "")
                               + "SET XACT_ABORT ON; SET NOCOUNT OFF;")
            except Exception:
                pass
            raise
