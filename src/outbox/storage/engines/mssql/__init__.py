"""SQL Server 2012+ (compatibility level 110 and up) and Azure SQL, through pyodbc
(the default) or Microsoft's ``mssql-python`` driver. docs/sqlserver.md is the
operator's view of everything below.

The claim is one batch on the relay's connection: read a window of eligible rows, lock the heads of the chains the batch needs (skipping heads another claim holds) and their rows
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
collation works, and start-up logs what that changes. Their type must be NVARCHAR:
start-up names the ALTER COLUMN for one that is not (docs/sqlserver.md, "Collations").
"""

from __future__ import annotations

# The engine's names keep their ``outbox.storage.engines.mssql`` path: the package is one face
# over its modules (``driver``: connecting and errors; ``schema``: DDL and migration; ``sql``:
# the statements; ``engine``: the engine, its connections and sessions).
from .driver import (
                     DEFAULT_DRIVER,
                     DEFAULT_LOCK_TIMEOUT_MS,
                     DEFAULT_QUERY_TIMEOUT_S,
                     DISCONNECT_ERRORS,
                     DRIVERS,
                     INLINE_UNITS,
                     SQL_BIGINT,
                     SQL_INTEGER,
                     SQL_WVARCHAR,
                     TRANSIENT_ERRORS,
                     Target,
                     driver_of_url,
                     error_numbers,
                     input_sizes,
                     odbc_connection_string,
                     parse_target,
                     result_rows,
                     utf16_len,
)
from .engine import MIN_LEVEL, SERVER_SQL, MssqlEngine
from .schema import (
                     DDL_LOCK_TIMEOUT_MS,
                     FILTERED_INDEX_OPTIONS,
                     ID_COLLATION,
                     INDEXES,
                     MIGRATE_LOCK_TIMEOUT_MS,
                     ONLINE_INDEX_EDITIONS,
                     OPEN_ROWS,
                     OPEN_ROWS_NORMALIZED,
                     RETIRED_INDEXES,
                     IndexSpec,
                     add_json_check_sql,
                     filter_sql,
                     if_,
                     lock_escalation_off,
                     migration_lock_statements,
                     migration_unlock_statements,
                     normalize_filter,
                     nstr,
                     rebuild_index_statements,
)
from .sql import ID_LIST_SIZES, ID_PARAMS_PER_STATEMENT

__all__ = ["DDL_LOCK_TIMEOUT_MS", "DEFAULT_DRIVER", "DEFAULT_LOCK_TIMEOUT_MS", "DEFAULT_QUERY_TIMEOUT_S",
           "DISCONNECT_ERRORS", "DRIVERS",
           "FILTERED_INDEX_OPTIONS", "ID_COLLATION", "ID_LIST_SIZES", "ID_PARAMS_PER_STATEMENT", "INDEXES",
           "INLINE_UNITS", "MIGRATE_LOCK_TIMEOUT_MS", "MIN_LEVEL", "ONLINE_INDEX_EDITIONS", "MssqlEngine", "IndexSpec", "OPEN_ROWS",
           "OPEN_ROWS_NORMALIZED", "RETIRED_INDEXES", "SERVER_SQL", "SQL_BIGINT", "SQL_INTEGER",
           "SQL_WVARCHAR", "TRANSIENT_ERRORS", "Target", "add_json_check_sql", "driver_of_url", "error_numbers",
           "filter_sql", "if_", "input_sizes", "lock_escalation_off", "migration_lock_statements",
           "migration_unlock_statements", "normalize_filter", "nstr", "odbc_connection_string", "parse_target",
           "rebuild_index_statements", "result_rows", "utf16_len"]
