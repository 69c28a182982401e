"""SQL Server's drivers: reading the URL into what to connect to (``parse_target``), opening a
connection with pyodbc or mssql-python (``open_connection``), what their errors mean
(``is_transient``, ``is_disconnect``, ``is_missing_table``), and the types parameters bind as
(``input_sizes``). No SQL text: that is ``schema`` and ``sql``; the package's docstring is the
overview."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ....core.errors import StoreError, install_hint

DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"

log = logging.getLogger("outbox.storage.engines.mssql")

#: Session defaults, overridable per URL (``?lock_timeout_ms=...&query_timeout_s=...``).
DEFAULT_LOCK_TIMEOUT_MS = 30_000
DEFAULT_QUERY_TIMEOUT_S = 300
#: URL query parameters the engine reads itself; never passed on to the driver.
ENGINE_OPTIONS = ("lock_timeout_ms", "query_timeout_s")

#: URL scheme suffix -> driver module. ``mssql://`` and raw ODBC strings use pyodbc.
DRIVERS = {"": "pyodbc", "pyodbc": "pyodbc", "mssqlpython": "mssql_python", "mssql_python": "mssql_python"}

#: SQLSTATEs of a lost or unusable connection, and the other transient ones
#: (40001 = deadlock victim; HYT00/HYT01 = query/connection timeout). 08007: the connection
#: failed during the transaction (an SQLEndTran whose outcome is unknown). IMC01-IMC06:
#: Microsoft's ODBC driver (pyodbc's, and the one mssql-python bundles) found the connection
#: broken and could not recover it (its idle connection resiliency, "Connection resiliency
#: in the ODBC driver"); pyodbc raises them as its base ``Error`` class, mssql-python as
#: ``DatabaseError``, so only the SQLSTATE says the connection is gone.
_DISCONNECT_STATES = frozenset({"08S01", "08001", "08003", "08004", "08007",
                                "IMC01", "IMC02", "IMC03", "IMC04", "IMC05", "IMC06"})
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
    "Connection failure during transaction": "08007",
    # Invalid object name (208) and invalid column name (207): what is_missing_table and
    # is_missing_column read (mssql-python's messages carry no error numbers).
    "Base table or view not found": "42S02", "Column not found": "42S22",
}

#: ODBC SQL types for setinputsizes (the same numbers in pyodbc and mssql-python).
SQL_WVARCHAR, SQL_INTEGER, SQL_BIGINT = -9, 4, -5
#: Strings up to this many UTF-16 units bind as NVARCHAR(4000), longer ones as
#: NVARCHAR(MAX): each driver's own switch to streaming (pyodbc streams past 4000
#: bytes, mssql-python past 4000 units), so the declared size never changes how the
#: driver sends the value.
INLINE_UNITS = {"pyodbc": 2000, "mssql_python": 4000}


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


def mssql_python_url(url: str) -> str:
    """A SQL Server URL for mssql-python: the same server, login, database and options,
    without pyodbc's ``driver`` (mssql-python bundles its own ODBC driver): a URL the
    pipeline reads through mssql-python's Arrow fetch (docs/pipeline.md), as
    ``bench.pipeline --engines mssql`` and the tests make one from a pyodbc URL. A raw
    ODBC string has no URL to rewrite: ValueError."""
    if "://" not in url:
        raise ValueError("a raw ODBC connection string has no mssql-python URL: write it as "
                         "mssql+mssqlpython://user:pass@host:1433/db?...")
    _scheme, rest = url.split("://", 1)
    path, _, query = rest.partition("?")
    kept = "&".join(p for p in query.split("&") if p and not p.lower().startswith("driver="))
    return f"mssql+mssqlpython://{path}" + (f"?{kept}" if kept else "")


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


def reset_session(cursor: Any, own_transaction: bool) -> None:
    """After a batch that failed: an error can end it before it restores the session's
    options, so put back the relay connection's own (``MssqlEngine.session_sql``: XACT_ABORT
    on, NOCOUNT off); and, for a batch run alone that opened its own transaction, roll back
    what an interrupt left open (in autocommit the driver's rollback does nothing)."""
    try:
        cursor.execute(("IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION; " if own_transaction else "")
                       + "SET XACT_ABORT ON; SET NOCOUNT OFF;")
    except Exception:  # the connection is gone: so is the transaction
        log.debug("outbox: cannot reset the session after an error", exc_info=True)


def result_rows(cursor: Any) -> list[tuple]:
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
    NVARCHAR(MAX) past ``inline_units`` UTF-16 units (SQL_WVARCHAR of size 0; not
    SQL_WLONGVARCHAR, which the driver sends as ntext: docs/sqlserver.md), and None as NVARCHAR(4000) (pyodbc would
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
            sizes.append((SQL_WVARCHAR, 4000, 0) if utf16_len(value) <= inline_units else (SQL_WVARCHAR, 0, 0))
        elif isinstance(value, int):
            sizes.append((SQL_INTEGER, 0, 0) if -2**31 <= value < 2**31 else (SQL_BIGINT, 0, 0))
        else:
            return None
    return sizes


def rows_input_sizes(rows: Sequence[Sequence[Any]], inline_units: int = 2000) -> list[tuple[int, int, int]] | None:
    """``input_sizes`` for ``executemany``: one declared type per column that fits every row
    (NVARCHAR(MAX) where any row's string is past ``inline_units``, BIGINT where any row's
    integer is past INT; a column of NULLs only as NVARCHAR(4000)). None when the rows differ
    in length, a column holds two kinds of value, or one ``input_sizes`` leaves to the driver.
    Without declared types pyodbc binds a string past 4,000 bytes as SQL_WLONGVARCHAR, which
    the ODBC driver sends as ``ntext``, refused by a ``_SC`` or ``_UTF8`` collation (4189)."""
    if not rows or len({len(row) for row in rows}) != 1:
        return None
    sizes: list[tuple[int, int, int]] = []
    for column in zip(*rows, strict=True):
        declared = set()
        for value in column:
            size = input_sizes((value,), inline_units)
            if size is None:
                return None
            if value is not None:
                declared.add(size[0])
        kinds = {sql_type for sql_type, _, _ in declared}
        if not declared:
            sizes.append((SQL_WVARCHAR, 4000, 0))
        elif kinds == {SQL_WVARCHAR}:
            sizes.append(min(declared, key=lambda size: size[1]))  # size 0 (MAX) sorts first
        elif kinds <= {SQL_INTEGER, SQL_BIGINT}:
            sizes.append((SQL_BIGINT, 0, 0) if SQL_BIGINT in kinds else (SQL_INTEGER, 0, 0))
        else:
            return None
    return sizes


def open_connection(target: Target) -> Any:
    """A DB-API connection to ``target`` with autocommit off: the driver opens a transaction
    at the first statement and the store commits it."""
    if target.driver == "mssql_python":
        try:
            import mssql_python
        except ImportError:
            raise StoreError("OUTBOX_DATABASE_URL asks for mssql-python: "
                             + install_hint("mssql-python")) from None
        return mssql_python.connect(target.connection_string, autocommit=False)
    import pyodbc  # imported here: importing it needs unixODBC installed
    return pyodbc.connect(target.connection_string, autocommit=False)


def is_transient(exc: BaseException) -> bool:
    state, message = _error_fields(exc)
    if state is None and not message:
        return False
    lowered = message.lower()
    return (state in _TRANSIENT_STATES or bool(error_numbers(message) & TRANSIENT_ERRORS.keys())
            or any(phrase in lowered for phrase in _TRANSIENT_PHRASES))


def is_lock_timeout(exc: BaseException) -> bool:
    """Error 1222: a statement waited LOCK_TIMEOUT for a lock and gave up (mssql-python
    says it in words only)."""
    _, message = _error_fields(exc)
    return 1222 in error_numbers(message) or "lock request time out period exceeded" in message.lower()


def is_disconnect(exc: BaseException) -> bool:
    state, message = _error_fields(exc)
    lowered = message.lower()
    return (state in _DISCONNECT_STATES or bool(error_numbers(message) & DISCONNECT_ERRORS)
            or any(phrase in lowered for phrase in _DISCONNECT_PHRASES))


def is_missing_table(exc: BaseException) -> bool:
    state, message = _error_fields(exc)
    return state == "42S02" or 208 in error_numbers(message)  # Invalid object name


@dataclass(frozen=True)
class DisabledIndex:
    """An error a statement met because an index of a table is disabled (``disabled_index_of``):
    its number, and the index and the table as the error names them (``""`` where it does not)."""

    number: int
    index: str = ""
    table: str = ""


#: The errors a statement meets on a table one of whose indexes is disabled, by number, with their
#: words (mssql-python's errors carry no number) and what they name (docs/sqlserver.md, "A disabled
#: clustered index"): 8655, no plan, the table's clustered index (or an index a hint forces) disabled,
#: naming both; 315 and 316, an index a hint names (by name, by id) disabled or in a filegroup that is
#: not online, naming the table as the statement wrote it (``dbo.outbox``); 8622, no plan with the
#: statement's hints (a FORCESEEK with no enabled index to seek), naming nothing.
_DISABLED_INDEX_WORDS = {
    8655: re.compile(r"unable to produce a plan because the index '(?P<index>[^']*)'"
                     r"(?: on table or view '(?P<table>[^']*)')?", re.IGNORECASE),
    315: re.compile(r'Index "(?P<index>[^"]*)" on table "(?P<table>[^"]*)" \(specified in the FROM clause\) is '
                    r'disabled', re.IGNORECASE),
    316: re.compile(r'index ID (?P<index>\d+) on table "(?P<table>[^"]*)" \(specified in the FROM clause\) is '
                    r'disabled', re.IGNORECASE),
    8622: re.compile(r"could not produce a query plan because of the hints defined in this query", re.IGNORECASE),
}


def disabled_index_of(exc: BaseException) -> DisabledIndex | None:
    """What ``exc`` says when it is one of the errors a statement meets on a table with a disabled
    index (``_DISABLED_INDEX_WORDS``), else None. By its words where the message is in English, by
    its number alone otherwise (naming nothing). Only 8655 was read, and the claim, whose hints name
    indexes, may meet 315 or 8622 instead (found in review)."""
    known = _known_error(exc, _DISABLED_INDEX_WORDS)
    if known is None:
        return None
    number, named = known
    return DisabledIndex(number, named.get("index", ""), named.get("table", ""))


def _known_error(exc: BaseException, errors: dict[int, re.Pattern[str]]) -> tuple[int, dict[str, str]] | None:
    """Which of ``errors`` (number: its words) ``exc`` is, with what its words name (their named
    groups; none matched leave no key): by its words, or by its number alone (naming nothing) where
    the message is in another language; None when it is none of them."""
    _, message = _error_fields(exc)
    for number, words in errors.items():
        found = words.search(message)
        if found is not None:
            return number, {name: value for name, value in found.groupdict().items() if value}
    numbers = error_numbers(message) & errors.keys()
    return (min(numbers), {}) if numbers else None


#: Error 1505's words: a unique index built (``CREATE UNIQUE INDEX``, ``ALTER INDEX ... REBUILD``, a
#: ``DROP_EXISTING`` build) over rows that share a key; SQL Server writes "The CREATE UNIQUE INDEX
#: statement terminated because a duplicate key was found for the object name '%.*ls' and the index
#: name '%.*ls'. The duplicate key value is %ls." (Microsoft's MSSQLSERVER_1505 leaves out the "the"s).
_DUPLICATE_KEY = re.compile(r"CREATE UNIQUE INDEX (?:statement )?terminated because a duplicate key was found for "
                            r"(?:the )?object name '(?P<table>[^']*)' and (?:the )?index name '(?P<index>[^']*)'\."
                            r"(?:\s*The duplicate key value is (?P<value>\(.*?\))(?=\.?(?:\s|$)))?", re.IGNORECASE)


@dataclass(frozen=True)
class DuplicateKey:
    """Error 1505 (``duplicate_key_of``): the table and the unique index as it names them, and the
    first duplicate key it found (``""`` where it does not say: a message in another language)."""

    table: str = ""
    index: str = ""
    value: str = ""


def duplicate_key_of(exc: BaseException) -> DuplicateKey | None:
    """What ``exc`` says when it is error 1505, else None."""
    _, message = _error_fields(exc)
    found = _DUPLICATE_KEY.search(message)
    if found is not None:
        return DuplicateKey(found.group("table"), found.group("index"), found.group("value") or "")
    return DuplicateKey() if 1505 in error_numbers(message) else None


@dataclass(frozen=True)
class StorageRefusal:
    """An error a write met because where it writes is read-only or offline (``storage_refusal_of``):
    its number, the database or filegroup it names and the table (``""`` where it names none)."""

    number: int
    name: str = ""
    table: str = ""


#: The errors a write (an index rebuild, any step of a migration) meets where the database or a
#: filegroup the table or an index of it is on is read-only or offline, with their words, from
#: Microsoft's list of the Database Engine's errors: 3906 the database is read-only (a readable
#: secondary replica too), 1924 and 652 a read-only filegroup (the second naming the index, the
#: table and the filegroup), 1931 an offline filegroup, 8653 a table on a filegroup not online.
_STORAGE_REFUSAL_WORDS = {
    3906: re.compile(r'Failed to update database "(?P<name>[^"]*)" because the database is read-only', re.IGNORECASE),
    1924: re.compile(r"Filegroup '(?P<name>[^']*)' is read-only", re.IGNORECASE),
    652: re.compile(r'for table "(?P<table>[^"]*)" \(RowsetId \d+\) resides on a read-only filegroup '
                    r'\("(?P<name>[^"]*)"\)', re.IGNORECASE),
    1931: re.compile(r"cannot be executed because filegroup '(?P<name>[^']*)' is offline", re.IGNORECASE),
    8653: re.compile(r"unable to produce a plan for the table or view '(?P<table>[^']*)' because the table resides "
                     r"in a filegroup which is not online", re.IGNORECASE),
}
#: Those whose filegroup is offline (the rest: read-only).
OFFLINE_ERRORS = frozenset({1931, 8653})


def storage_refusal_of(exc: BaseException) -> StorageRefusal | None:
    """What ``exc`` says when it is one of ``_STORAGE_REFUSAL_WORDS``' errors, else None: by its
    words, or by its number alone (naming nothing) in another language."""
    known = _known_error(exc, _STORAGE_REFUSAL_WORDS)
    if known is None:
        return None
    number, named = known
    return StorageRefusal(number, named.get("name", ""), named.get("table", ""))


def is_missing_column(exc: BaseException) -> bool:
    state, message = _error_fields(exc)
    return state == "42S22" or 207 in error_numbers(message)  # Invalid column name
