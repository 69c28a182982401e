"""SQL Server's schema: T-SQL text helpers, the indexes the engine relies on as data
(``IndexSpec``), and ``MssqlSchema``, the migration (guarded batches that repair a partial
deployment under one migration lock) and the start-up check of an existing table. The
package's docstring is the overview; docs/sqlserver.md the operator's view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base import Engine, IndexShape
from . import driver

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
#: How long a second ``outbox migrate`` waits for the first one (sp_getapplock).
MIGRATE_LOCK_TIMEOUT_MS = 600_000
#: How long a migration's DDL step waits for a table's lock (SET LOCK_TIMEOUT), as on
#: PostgreSQL and MariaDB: while it waits, every enqueue and claim waits behind it
#: (``MssqlEngine.ddl_bounds``; README, "The table").
DDL_LOCK_TIMEOUT_MS = 10_000

#: Modifying or indexing a table with a filtered index needs these (error 1934 otherwise).
#: ODBC drivers set most of them; tools that run the migration elsewhere may not.
FILTERED_INDEX_OPTIONS = ("SET QUOTED_IDENTIFIER ON; SET ANSI_NULLS ON; SET ANSI_PADDING ON; "
                          "SET ANSI_WARNINGS ON; SET ARITHABORT ON; SET CONCAT_NULL_YIELDS_NULL ON; "
                          "SET NUMERIC_ROUNDABORT OFF;")

#: The predicate of every index over open rows, written exactly as the claim scan,
#: the ordering probe and the stats queries write it, so the optimizer matches them.
OPEN_ROWS = "status IN (0, 1, 3)"
#: The kind (``sys.indexes.type_desc``) of every index the migration makes (``IndexSpec.ddl``).
INDEX_KIND = "NONCLUSTERED"
#: The kinds of an index that is the table's storage: one under a name of the migration's is not
#: rebuilt by it (``clustered_refusal``; docs/sqlserver.md, "Indexes, and why").
CLUSTERED_KINDS = ("CLUSTERED", "CLUSTERED COLUMNSTORE")
#: Characters dropped from a filter before comparing it: SQL Server stores the filter
#: as ``([status]=(0) OR [status]=(1) OR [status]=(3))``.
FILTER_NOISE = ("[", "]", "(", ")", " ")
#: The forms ``OPEN_ROWS`` may take in sys.indexes.filter_definition, normalized.
OPEN_ROWS_NORMALIZED = ("status=0orstatus=1orstatus=3", "statusin0,1,3")
#: What ``outbox check``'s catalog query (``describe.INDEX_COLUMNS_SQL``) gives for a filter it
#: may not read: sys.indexes.filter_definition is NULL for a login without VIEW DEFINITION on
#: the table (the relay's, docs/sqlserver.md "Permissions"), has_filter is not.
UNREADABLE_FILTER = "(a filter, whose text needs VIEW DEFINITION on the table)"


def nstr(text: str) -> str:
    """A T-SQL Unicode string literal."""
    return "N'" + text.replace("'", "''") + "'"


def bracket(identifier: str) -> str:
    """A T-SQL delimited identifier (a ``]`` inside is doubled)."""
    return "[" + identifier.replace("]", "]]") + "]"


def if_(condition: str, statement: str) -> str:
    """``IF ... BEGIN ... END``: the block makes the end of the guarded statement
    explicit for readers and for parsers (sqlglot reads a bare ``IF c SET ...`` wrong)."""
    return f"IF {condition}\nBEGIN\n    {statement};\nEND;"


def normalize_filter(definition: str) -> str:
    """A filter definition without brackets, parentheses and spaces, lower case:
    what ``filter_sql`` computes in T-SQL."""
    for noise in FILTER_NOISE:
        definition = definition.replace(noise, "")
    return definition.lower()


def filter_sql(column: str) -> str:
    """``normalize_filter`` as a T-SQL expression over ``column``."""
    for noise in FILTER_NOISE:
        column = f"REPLACE({column}, {nstr(noise)}, N'')"
    return f"LOWER({column})"


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
        text = (f"CREATE {'UNIQUE ' if self.unique else ''}{INDEX_KIND} INDEX {name} ON {table} "
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
    IndexSpec("claim_ready", ("next_retry_at", "id"), ("aggregate_id", "status", "attempts", "claimed_at"),
              filtered=True, why="the claim scan over open rows only, covering eligible(); the due time first, so "
                                 "rows waiting for a later time are never read"),
    IndexSpec("done_processed_at", ("status", "processed_at"), why="purge: oldest done rows first"),
    IndexSpec("open_created_at", ("created_at",), ("status",), filtered=True,
              why="outbox status and the metrics gauges: oldest open row and counts of open rows"),
)
#: Indexes of earlier releases that a migration drops (their job moved to another index).
RETIRED_INDEXES = ("agg_id_id",)

#: ``SERVERPROPERTY('EngineEdition')`` of the servers that build an index with ``ONLINE = ON``:
#: 3 Enterprise (Developer and Evaluation report 3 too), 5 Azure SQL Database, 8 Azure SQL
#: Managed Instance. Standard, Express and the rest build it offline.
ONLINE_INDEX_EDITIONS = (3, 5, 8)
ENGINE_EDITION = "CAST(SERVERPROPERTY('EngineEdition') AS INT)"


def rebuild_index_statements(spec: IndexSpec, index: str, table: str, exists: str) -> list[str]:
    """The index ``index`` (where ``exists``) built again with ``spec``'s definition in one
    statement that replaces it (``DROP_EXISTING = ON``: never missing, no ``DROP INDEX`` holding
    the table until the commit), with ``ONLINE = ON`` on an edition that has it, where writers go
    on during the build (docs/internals.md, "Index builds that hold no writer back"). Each through
    ``sp_executesql``: a server of another edition never compiles ``ONLINE = ON``, and sqlglot,
    which the tests parse every statement with, does not know ``WITH`` after a filter."""
    editions = ", ".join(str(edition) for edition in ONLINE_INDEX_EDITIONS)
    ddl = spec.ddl(index, table)
    return [if_(f"{exists} AND {ENGINE_EDITION} IN ({editions})",
                f"EXEC sp_executesql {nstr(ddl + ' WITH (DROP_EXISTING = ON, ONLINE = ON)')}"),
            if_(f"{exists} AND {ENGINE_EDITION} NOT IN ({editions})",
                f"EXEC sp_executesql {nstr(ddl + ' WITH (DROP_EXISTING = ON)')}")]


def clustered_refusal(index: str, table: str) -> str:
    """What to do about the index ``index`` of ``table`` that is the table's clustered index
    (``CLUSTERED_KINDS``), which `outbox check` fails and `outbox migrate` fails on: ``DROP_EXISTING``
    cannot make a clustered index nonclustered, and dropping it rewrites the whole table and every
    other index, a maintenance window's work (docs/sqlserver.md, "Indexes, and why")."""
    return (f"it is the table's clustered index: drop it first (DROP INDEX {index} ON {table}, which rewrites the "
            "table and every other index: in a maintenance window, the relay stopped), make the primary key on id "
            "clustered (docs/sqlserver.md, \"Indexes, and why\"), then run `outbox migrate`, which makes it nonclustered")


#: The table's clustered indexes that are disabled (``ALTER INDEX ... DISABLE``), each as (name,
#: is it the primary key): one parameter, the qualified table name for ``OBJECT_ID``. Such a table
#: cannot be read (error 8655), and every other index of it is disabled with it (Microsoft's
#: "Disable indexes and constraints"): ``MssqlSchema.unreadable_table``.
DISABLED_CLUSTERED_SQL = ("SELECT name, is_primary_key FROM sys.indexes WHERE object_id = OBJECT_ID(?) "
                          "AND is_disabled = 1 AND type_desc IN (N'CLUSTERED', N'CLUSTERED COLUMNSTORE')")


def rebuild_all_statement(table: str) -> str:
    """The rebuild that makes a table whose clustered index is disabled readable again: every
    index of it rebuilt and enabled (``ALTER INDEX ALL``: rebuilding the clustered index alone
    leaves the nonclustered ones disabled), offline, as SQL Server rebuilds a disabled clustered
    index (Microsoft's "Enable indexes and constraints"; docs/sqlserver.md, "A disabled clustered
    index"). Through ``sp_executesql``: sqlglot, which the tests parse every statement with, does
    not know ``ALTER INDEX``, so they check its text."""
    return f"EXEC sp_executesql {nstr(f'ALTER INDEX ALL ON {table} REBUILD')}"


#: The disabled FOREIGN KEY constraints to and from a table, each as (schema, table, name) of the
#: table that has it: two parameters, the qualified table name for ``OBJECT_ID``. Disabling the
#: clustered index disabled them all, and no index rebuild enables them (Microsoft's "Disable
#: indexes and constraints", "Enable indexes and constraints"): ``unreadable_problem`` names them.
DISABLED_FOREIGN_KEYS_SQL = ("SELECT OBJECT_SCHEMA_NAME(parent_object_id), OBJECT_NAME(parent_object_id), name "
                             "FROM sys.foreign_keys WHERE is_disabled = 1 "
                             "AND (parent_object_id = OBJECT_ID(?) OR referenced_object_id = OBJECT_ID(?))")


def unreadable_problem(table: str, rows: list[tuple[Any, ...]],
                       foreign_keys: list[tuple[Any, ...]] | None = None) -> str | None:
    """What `outbox check` (and a command that failed on the table) says about ``table`` whose
    disabled clustered indexes are ``rows`` (``DISABLED_CLUSTERED_SQL``'s), or None when there
    is none: it said "table missing: run `outbox migrate`" (found in review). The disabled FOREIGN
    KEY constraints to and from it (``DISABLED_FOREIGN_KEYS_SQL``'s: those of the tables the login
    has a permission on, as SQL Server shows metadata), which the migration leaves disabled, each
    with the statement that enables it: they went unsaid (found in review)."""
    if not rows:
        return None
    name, primary = rows[0][0], bool(rows[0][1])
    enable = "; ".join(f"ALTER TABLE {bracket(str(schema))}.{bracket(str(owner))} WITH CHECK CHECK CONSTRAINT "
                       f"{bracket(str(fk))}" for schema, owner, fk in foreign_keys or ())
    return (f"table {table} cannot be read: its clustered index {bracket(str(name))}"
            f"{' (its primary key)' if primary else ''} is disabled (ALTER INDEX ... DISABLE), and every other index "
            f"of the table with it; run `outbox migrate`, which rebuilds them all (ALTER INDEX ALL ON {table} REBUILD, "
            "offline: a disabled clustered index is never rebuilt online; docs/sqlserver.md, \"A disabled clustered "
            "index\"); then enable the FOREIGN KEY constraints to and from the table, which SQL Server disabled with "
            "it and the migration leaves disabled: " + (enable or "none this login can see (sys.foreign_keys shows "
                                                          "it those of the tables it has a permission on)"))


#: The key columns of the index named by the second parameter, of the table named by the first, in
#: key order, each with the index's filter (NULL: none): what a rebuild that met duplicate keys
#: (error 1505) is told to look for (``duplicate_keys_problem``).
INDEX_KEYS_SQL = ("SELECT c.name, i.filter_definition FROM sys.indexes AS i "
                  "INNER JOIN sys.index_columns AS ic ON ic.object_id = i.object_id AND ic.index_id = i.index_id "
                  "INNER JOIN sys.columns AS c ON c.object_id = ic.object_id AND c.column_id = ic.column_id "
                  "WHERE i.object_id = OBJECT_ID(?) AND i.name = ? AND ic.key_ordinal > 0 ORDER BY ic.key_ordinal")
#: The table's disabled unique indexes (one parameter, the qualified table name): which index error
#: 1505 is about when its words, in another language, are not read.
#: Not a clustered one: no row is written while it is disabled, so none can share its key.
DISABLED_UNIQUE_SQL = ("SELECT name FROM sys.indexes WHERE object_id = OBJECT_ID(?) AND is_unique = 1 "
                       "AND is_disabled = 1 AND type_desc = N'NONCLUSTERED' ORDER BY index_id")


def duplicate_keys_sql(table: str, keys: list[str], filter_definition: str | None = None) -> str:
    """The rows of ``table`` that share a key of a unique index on ``keys`` (over the rows its
    ``filter_definition`` keeps), one row per key: the key, how many rows hold it, the lowest and
    the highest id. NULLs are one key to a unique index and to GROUP BY alike (Microsoft's
    MSSQLSERVER_1505, which finds "all duplicate rows" with GROUP BY and HAVING)."""
    columns = ", ".join(bracket(key) for key in keys)
    where = f" WHERE {filter_definition}" if filter_definition else ""
    return (f"SELECT {columns}, COUNT(*) AS copies, MIN(id) AS first_id, MAX(id) AS last_id FROM {table}{where} "
            f"GROUP BY {columns} HAVING COUNT(*) > 1 ORDER BY {columns}")


def duplicate_keys_problem(table: str, index: str, value: str, keys: list[str], filter_definition: str | None,
                           clustered: str | None, own: bool) -> str:
    """What `outbox migrate` says when its rebuild of the unique index ``index`` of ``table`` found
    rows that share a key (error 1505: the first such key, ``value``): which index, why, and how to
    find them (``duplicate_keys_sql`` on ``keys``). With the table's clustered index ``clustered``
    disabled the table cannot be read, and the rebuild of that index alone comes first. It said the
    driver's error alone (found in review; docs/sqlserver.md, "A disabled clustered index")."""
    first = f"; the first found: {value}" if value else ""
    find = (f"find them with {duplicate_keys_sql(table, keys, filter_definition)}" if keys else
            "find the rows that share a key of the index (GROUP BY its key columns HAVING COUNT(*) > 1)")
    readable = (f"the table cannot be read while its clustered index {bracket(clustered)} is disabled: rebuild that "
                f"index alone first (ALTER INDEX {bracket(clustered)} ON {table} REBUILD, offline; the table's other "
                "indexes stay disabled), then " if clustered else "")
    again = ("run `outbox migrate` again" if own else
             f"run `outbox migrate` again and rebuild this index, which is not one of its own (ALTER INDEX "
             f"{bracket(index)} ON {table} REBUILD)")
    return (f"outbox migrate cannot rebuild index {bracket(index)} of {table}: it is UNIQUE, and rows of the table share "
            f"a key of it (error 1505{first}), written while nothing enforced that key: while the index was disabled "
            "(SQL Server neither maintains a disabled index nor enforces its uniqueness), or not unique. To fix it: "
            f"{readable}{find}, keep one row of each key (delete the "
            f"others, or give them a key of their own), then {again}")


def storage_problem(table: str, refusal: driver.StorageRefusal) -> str:
    """What `outbox migrate` says when a step failed because the database, or a filegroup the table or
    an index of it is on, is read-only or offline (``driver.storage_refusal_of``): which, and what to
    do. SQL Server builds, rebuilds or enables an index only where every filegroup it is on is online,
    and changes nothing in a read-only database or filegroup (docs/sqlserver.md, "A disabled clustered
    index"); the migration said the driver's error alone."""
    error = f"error {refusal.number}"
    if refusal.number == 3906:
        database = bracket(refusal.name) if refusal.name else "CURRENT"
        where = f"database {bracket(refusal.name)}" if refusal.name else "the database"
        return (f"outbox migrate cannot change table {table}: {where} is read-only ({error}; so is a readable "
                "secondary replica of an availability group, and a connection made with ApplicationIntent=ReadOnly). "
                f"Make it writable (ALTER DATABASE {database} SET READ_WRITE, which needs the database to itself) or "
                "run it against the primary replica, then run `outbox migrate` again")
    filegroup = f"filegroup {bracket(refusal.name)}" if refusal.name else "a filegroup"
    if refusal.number in driver.OFFLINE_ERRORS:
        files = (f" ({files_of_filegroup_sql(refusal.name)} shows its files' state)" if refusal.name else
                 " (sys.database_files shows each file's state)")
        return (f"outbox migrate cannot change table {table}: {filegroup}, which holds the table or one of its "
                f"indexes, is offline ({error}), and SQL Server builds or enables an index only where every "
                f"filegroup it is on is online. Bring its files back online{files}: an offline file is restored "
                "from a backup; then run `outbox migrate` again")
    name = bracket(refusal.name) if refusal.name else "<the filegroup>"
    return (f"outbox migrate cannot change table {table}: {filegroup}, which holds the table or one of its indexes, "
            f"is read-only ({error}). Make it writable (ALTER DATABASE CURRENT MODIFY FILEGROUP {name} READ_WRITE, "
            "which needs the database to itself), run `outbox migrate` again, then make it read-only again if it was "
            "so on purpose")


def files_of_filegroup_sql(filegroup: str) -> str:
    """The files of ``filegroup`` of the current database, each with its state (ONLINE, OFFLINE, ...)."""
    return ("SELECT f.name, f.physical_name, f.state_desc FROM sys.database_files AS f INNER JOIN sys.filegroups AS g "
            f"ON g.data_space_id = f.data_space_id WHERE g.name = {nstr(filegroup)}")


#: Whether the index named by the second parameter, of the table named by the first, enforces a
#: constraint: one row (is_primary_key, is_unique_constraint) when it exists (``index_refusal``).
INDEX_CONSTRAINT_SQL = ("SELECT is_primary_key, is_unique_constraint FROM sys.indexes "
                        "WHERE object_id = OBJECT_ID(?) AND name = ?")
#: The constraints an index may enforce, as ``sys.indexes`` flags them, by the word T-SQL names them with.
CONSTRAINT_FLAGS = {"PRIMARY KEY": "is_primary_key", "UNIQUE": "is_unique_constraint"}


def constraint_refusal(index: str, table: str, kind: str) -> str:
    """What to do about the index ``index`` of ``table`` that enforces a ``kind`` constraint
    (``CONSTRAINT_FLAGS``) and is not defined as the migration defines it, which `outbox check`
    fails and `outbox migrate` refuses: SQL Server changes no such index in place (``CREATE
    INDEX ... DROP_EXISTING`` fails on an altered definition, ``DROP INDEX`` is refused, error
    3723), and dropping the constraint is the DBA's call (docs/sqlserver.md, "Indexes, and why")."""
    return (f"it enforces the {kind} constraint {index}, which SQL Server does not let an index build change: "
            f"drop the constraint first (ALTER TABLE {table} DROP CONSTRAINT {index}, at a quiet moment: it holds the "
            "table until its transaction ends, and a FOREIGN KEY that references it must be dropped before it), then run "
            "`outbox migrate`, which makes it an index as it defines it")


def migration_lock_statements(resource: str, table_literal: str, table: str) -> list[str]:
    """The first batch of a migration: an exclusive ``sp_getapplock`` on ``resource``, so two
    migrations of the same tables (two deploy jobs, workers creating the broker's queue
    tables at start-up) run one after the other; the second waits for the first to commit
    and then finds everything in place. The lock belongs to the migration's transaction
    when one is open (released at commit); a driver in implicit-transaction mode may not
    have opened it yet, and then the session owns the lock until the last batch
    (``migration_unlock_statements``) releases it.

    The SELECT and the EXEC run under NOCOUNT ON (the session's setting is restored before
    the refusal): with the relay's NOCOUNT OFF each sent a row count first, and the
    driver's ``execute`` returned at that count without the RAISERROR behind it, so a
    migration that could not get the lock went on without it (docs/sqlserver.md,
    "`outbox migrate`")."""
    return [
        "DECLARE @lock_owner NVARCHAR(32), @lock_result INT, @nocount INT = @@OPTIONS & 512;",
        "SET NOCOUNT ON;",
        # A SELECT from a table opens the driver's implicit transaction (EXEC does not).
        f"SELECT @lock_result = COUNT(*) FROM sys.objects WHERE object_id = OBJECT_ID({table_literal});",
        "SET @lock_owner = CASE WHEN @@TRANCOUNT > 0 THEN N'Transaction' ELSE N'Session' END;",
        f"EXEC @lock_result = sp_getapplock @Resource = {nstr(resource)}, "
        f"@LockMode = N'Exclusive', @LockOwner = @lock_owner, @LockTimeout = {MIGRATE_LOCK_TIMEOUT_MS};",
        if_("@nocount = 0", "SET NOCOUNT OFF"),
        if_("@lock_result < 0", "RAISERROR(N'outbox migrate: another outbox migrate of %s held the migration "
            "lock for too long (sp_getapplock returned %d); run it again when that one has finished', 16, 1, "
            f"{nstr(table)}, @lock_result)"),
    ]


def migration_unlock_statements(resource: str) -> list[str]:
    """The last batch of a migration: release a session-owned migration lock (a
    transaction-owned one goes with the commit)."""
    return [if_(f"APPLOCK_MODE(N'public', {nstr(resource)}, N'Session') <> N'NoLock'",
                f"EXEC sp_releaseapplock @Resource = {nstr(resource)}, @LockOwner = N'Session'")]


def lock_holders_sql(tables: int) -> str:
    """The sessions holding a granted lock on any of ``tables`` objects (one ``OBJECT_ID(?)``
    parameter each: qualified names), oldest transaction first, for the error of a migration
    whose DDL step gave up waiting (``MssqlEngine.lock_holders``). A transaction that wrote
    to a table holds its IX lock until it ends, and a migration's Sch-M request waits for it.
    Reading the DMVs takes VIEW SERVER STATE (VIEW DATABASE STATE on Azure SQL).

    One SELECT, so no row count comes before its rows and no SET NOCOUNT ON is needed; one
    would have to be put back after it, which an error under the relay's XACT_ABORT ON (a
    denied DMV) would skip, leaving the session without the row counts the relay reads."""
    objects = ", ".join(["OBJECT_ID(?)"] * tables)
    return ("SELECT TOP (3) s.session_id, s.login_name, s.host_name, s.program_name, s.status, "
            "DATEDIFF(SECOND, MIN(t.transaction_begin_time), GETDATE()) "
            "FROM sys.dm_tran_locks AS l "
            "JOIN sys.dm_exec_sessions AS s ON s.session_id = l.request_session_id "
            "LEFT JOIN sys.dm_tran_session_transactions AS st ON st.session_id = s.session_id "
            "LEFT JOIN sys.dm_tran_active_transactions AS t ON t.transaction_id = st.transaction_id "
            "WHERE l.resource_type = N'OBJECT' AND l.resource_database_id = DB_ID() "
            "AND l.request_status = N'GRANT' AND l.request_session_id <> @@SPID "
            f"AND l.resource_associated_entity_id IN ({objects}) "
            "GROUP BY s.session_id, s.login_name, s.host_name, s.program_name, s.status "
            "ORDER BY MIN(t.transaction_begin_time)")


def lock_escalation_off(table: str, table_literal: str) -> str:
    """Turn lock escalation off (docs/sqlserver.md, "Lock escalation"), guarded by the catalog."""
    return if_(f"EXISTS (SELECT 1 FROM sys.tables WHERE object_id = OBJECT_ID({table_literal}) "
               "AND lock_escalation_desc <> N'DISABLE')", f"ALTER TABLE {table} SET (LOCK_ESCALATION = DISABLE)")


def add_json_check_sql(table: str, constraint: str, column: str) -> str:
    """Add an ISJSON check to an existing table without checking its rows (WITH NOCHECK):
    new and updated values are checked, the constraint is marked not trusted."""
    return f"ALTER TABLE {table} WITH NOCHECK ADD CONSTRAINT {constraint} CHECK (ISJSON({column}) = 1)"


class MssqlSchema(Engine):
    """The table, its indexes and the holders table on SQL Server; what the SQL built next
    may use (``has_json``, ``has_isjson``), as read from a connection."""

    index_suffixes = tuple(spec.suffix for spec in INDEXES)

    #: The migration's first batch takes its lock (``migration_lock_statements``).
    migration_lock_step = True

    def table_exists(self, cursor: Any, table: str) -> bool:
        # A read of a missing table would doom the transaction (XACT_ABORT ON).
        return self.execute(cursor, "SELECT 1 WHERE OBJECT_ID(?, N'U') IS NOT NULL", [table]).fetchone() is not None

    def table_columns(self, cursor: Any) -> frozenset[str]:
        # From the catalog: a read of a table whose clustered index is disabled fails (error 8655),
        # and dooms the transaction (XACT_ABORT ON).
        return frozenset(str(row[0]).lower() for row in self.execute(
            cursor, "SELECT name FROM sys.columns WHERE object_id = OBJECT_ID(?)", [self.table]).fetchall())

    def unreadable_table(self, cursor: Any) -> str | None:
        rows = self.execute(cursor, DISABLED_CLUSTERED_SQL, [self.table]).fetchall()
        if not rows:
            return None
        return unreadable_problem(self.table, rows, self.execute(cursor, DISABLED_FOREIGN_KEYS_SQL,
                                                                 [self.table, self.table]).fetchall())

    def names_table(self, named: str) -> bool:
        """Whether ``named``, a table as an error names it (``outbox``, ``dbo.outbox``; ``""``: none,
        the failed statement's own, which is this table), is this table."""
        parts = [part.strip('[]"').lower() for part in named.split(".")] if named else []
        if not parts:
            return True
        return parts[-1] == self.table_name.lower() and (len(parts) < 2 or parts[-2] == (self.schema or "dbo").lower())

    def migration_error_hint(self, cursor: Any, exc: BaseException) -> str | None:
        refusal = driver.storage_refusal_of(exc)
        if refusal is not None and self.names_table(refusal.table):
            return storage_problem(self.table, refusal)
        duplicate = driver.duplicate_key_of(exc)
        if duplicate is None or not self.names_table(duplicate.table):
            return None
        index = duplicate.index
        if not index:  # its words in another language: the catalog's disabled unique index, else the one
            row = self.execute(cursor, DISABLED_UNIQUE_SQL, [self.table]).fetchone()  # the migration builds
            index = str(row[0]) if row else next(self.index_name(spec.suffix) for spec in INDEXES if spec.unique)
        rows = self.execute(cursor, INDEX_KEYS_SQL, [self.table, index]).fetchall()
        own = {self.index_name(spec.suffix): spec for spec in INDEXES}
        keys = [str(row[0]) for row in rows] or list(own[index].keys if index in own else ())
        clustered = self.execute(cursor, DISABLED_CLUSTERED_SQL, [self.table]).fetchone()
        return duplicate_keys_problem(self.table, index, duplicate.value, keys, rows[0][1] if rows else None,
                                      str(clustered[0]) if clustered else None, index in own)

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
        return bracket(identifier)

    # -- schema ----------------------------------------------------------------------
    def _table_literal(self) -> str:
        return nstr(self.table)

    def expected_indexes(self) -> dict[str, IndexShape]:
        return {self.index_name(spec.suffix): IndexShape(spec.keys, unique=spec.unique,
                                                         where=OPEN_ROWS if spec.filtered else None,
                                                         include=spec.include, method=INDEX_KIND)
                for spec in INDEXES}

    def same_predicate(self, live: str | None, expected: str | None) -> bool:
        # The catalog writes OPEN_ROWS as ``([status]=(0) OR [status]=(1) OR [status]=(3))``;
        # to a login without VIEW DEFINITION it writes nothing, and only that there is a filter
        # is compared (UNREADABLE_FILTER; the check failed on every table: found in review).
        if live == UNREADABLE_FILTER:
            return expected is not None
        if live and expected == OPEN_ROWS:
            return normalize_filter(live) in OPEN_ROWS_NORMALIZED
        return super().same_predicate(live, expected)

    def index_refusal(self, cursor: Any, name: str, live: IndexShape) -> str | None:
        flags = self.execute(cursor, INDEX_CONSTRAINT_SQL, [self.table, name]).fetchone()
        kinds = [kind for kind, flag in zip(CONSTRAINT_FLAGS, flags or (), strict=False) if flag]
        if kinds:  # before the clustered one's: DROP INDEX would fail on it (error 3723)
            return constraint_refusal(self.quote(name), self.table, kinds[0])
        if (live.method or "").upper() in CLUSTERED_KINDS:
            return clustered_refusal(self.quote(name), self.table)
        return None

    def index_matches(self, spec: IndexSpec, *, enabled: bool = True) -> str:
        """A query returning a row when the index exists with exactly ``spec``'s
        definition: its kind (``INDEX_KIND``), enabled (a disabled index serves no query,
        and a hint naming it fails; not asked with ``enabled`` False), uniqueness, filter, key
        columns in order (ascending), the included columns, and nothing else; what `outbox check`
        compares (``describe.same_shape``), in SQL. The rebuild of one that differs
        (``_rebuild_steps``) enables a disabled one."""
        t = self._table_literal()
        name = nstr(self.index_name(spec.suffix))
        filter_normalized = filter_sql("i.filter_definition")
        if spec.filtered:
            filter_ok = (f"i.has_filter = 1 AND {filter_normalized} IN "
                         f"({', '.join(nstr(f) for f in OPEN_ROWS_NORMALIZED)})")
        else:
            filter_ok = "i.has_filter = 0"

        def column(condition: str) -> str:
            return ("EXISTS (SELECT 1 FROM sys.index_columns AS ic INNER JOIN sys.columns AS c "
                    "ON c.object_id = ic.object_id AND c.column_id = ic.column_id "
                    f"WHERE ic.object_id = i.object_id AND ic.index_id = i.index_id AND {condition})")

        checks = [f"i.type_desc = {nstr(INDEX_KIND)}", *(["i.is_disabled = 0"] if enabled else []),
                  f"i.is_unique = {1 if spec.unique else 0}",
                  filter_ok,
                  "(SELECT COUNT(*) FROM sys.index_columns AS n WHERE n.object_id = i.object_id "
                  f"AND n.index_id = i.index_id) = {len(spec.keys) + len(spec.include)}"]
        checks += [column(f"ic.key_ordinal = {position} AND ic.is_descending_key = 0 AND c.name = {nstr(key)}")
                   for position, key in enumerate(spec.keys, start=1)]
        checks += [column(f"ic.is_included_column = 1 AND c.name = {nstr(col)}") for col in spec.include]
        return (f"SELECT 1 FROM sys.indexes AS i WHERE i.object_id = OBJECT_ID({t}) AND i.name = {name} AND "
                + " AND ".join(checks))

    def _index_exists(self, suffix: str, condition: str = "") -> str:
        """Whether the index of ``suffix`` exists (and its row of sys.indexes meets ``condition``)."""
        return self._named_index_exists(self.index_name(suffix), condition)

    def _named_index_exists(self, index: str, condition: str = "") -> str:
        return (f"EXISTS (SELECT 1 FROM sys.indexes WHERE name = {nstr(index)} "
                f"AND object_id = OBJECT_ID({self._table_literal()}){' AND ' + condition if condition else ''})")

    def _rebuild_steps(self, spec: IndexSpec) -> list[str]:
        """The statements that make the index of ``spec``, which exists and is not defined as
        ``spec`` (``index_matches``), what ``spec`` defines, by its kind: built again in place
        (``rebuild_index_statements``) when it is of the migration's (``INDEX_KIND``); refused,
        naming it, when it enforces a constraint and differs in more than being disabled
        (``constraint_refusal``: SQL Server's own error said it, 1907 or 3723) or is the table's
        clustered index (``clustered_refusal``); dropped, for the next step to make it, when it is
        of another nonclustered kind (a columnstore index, which ``DROP_EXISTING`` does not make a
        rowstore one). A disabled one that is otherwise as defined is built again in place, its
        constraint kept (Microsoft's CREATE INDEX, "DROP_EXISTING")."""
        index, t = self.quote(self.index_name(spec.suffix)), self.table
        clustered = ", ".join(nstr(kind) for kind in CLUSTERED_KINDS)
        refusal = nstr(f"outbox migrate will not make index %s of %s {INDEX_KIND.lower()} itself: "
                       + clustered_refusal("%s", "%s"))
        as_defined = f"EXISTS ({self.index_matches(spec, enabled=False)})"
        constraints = [if_(f"{self._index_exists(spec.suffix, f'{flag} = 1')} AND NOT {as_defined}",
                           f"RAISERROR({nstr('outbox migrate will not build index %s of %s again itself: ' + constraint_refusal('%s', '%s', kind))}, "
                           f"16, 1, {nstr(self.index_name(spec.suffix))}, {nstr(t)}, {nstr(index)}, {nstr(t)}, {nstr(index)})")
                       for kind, flag in CONSTRAINT_FLAGS.items()]
        # A RAISERROR does not end its batch (under XACT_ABORT ON either: THROW honors it, RAISERROR
        # does not), so no guard below holds where a refusal's does: after the constraint's
        # refusal, the clustered one's and the DROP_EXISTING build ran too (found in review). An
        # index that enforces a constraint is built again only as defined, disabled alone.
        unconstrained = " AND ".join(f"{flag} = 0" for flag in CONSTRAINT_FLAGS.values())
        return [*constraints,
                if_(self._index_exists(spec.suffix, f"type_desc IN ({clustered}) AND {unconstrained}"),
                    f"RAISERROR({refusal}, 16, 1, {nstr(self.index_name(spec.suffix))}, {nstr(t)}, "
                    f"{nstr(index)}, {nstr(t)})"),
                if_(self._index_exists(spec.suffix, f"type_desc NOT IN ({nstr(INDEX_KIND)}, {clustered})"),
                    f"DROP INDEX {index} ON {t}"),
                *rebuild_index_statements(spec, index, t, f"{self._index_exists(spec.suffix, f'type_desc = {nstr(INDEX_KIND)}')} "
                                          f"AND NOT ({self._index_exists(spec.suffix, f'NOT ({unconstrained})')} "
                                          f"AND NOT {as_defined})")]

    def _rename_legacy_indexes(self) -> list[Any]:
        """An index an earlier release named in full (``Engine.legacy_name``) takes today's name
        where that is free (``sp_rename``: the catalog only), before the steps below look for
        it by that name; they built a second copy beside it (found in the upgrade review)."""
        steps: list[Any] = []
        for suffix in (*RETIRED_INDEXES, *self.index_suffixes):
            old, new = self.legacy_index_name(suffix), self.index_name(suffix)
            if old:
                steps.append([if_(f"{self._named_index_exists(old)} AND NOT {self._named_index_exists(new)}",
                                  f"EXEC sp_rename {nstr(f'{self.table}.{self.quote(old)}')}, {nstr(new)}, N'INDEX'")])
        return steps

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
            [if_(f"SCHEMA_ID({nstr(schema)}) IS NULL",
                 f"EXEC sp_executesql {nstr('CREATE SCHEMA ' + q(schema))}")],
            [if_(f"OBJECT_ID({table_literal}, N'U') IS NULL", create_table)],
            # A disabled clustered index makes the table unreadable, and every step below that
            # reads it fails (error 8655): rebuilt first, with every index disabled with it
            # (rebuild_all_statement; docs/sqlserver.md, "A disabled clustered index").
            [if_(f"EXISTS ({DISABLED_CLUSTERED_SQL.replace('?', table_literal)})", rebuild_all_statement(t))],
            # Every column of the contract but the id, repaired on a table an older release or
            # another script made (README, "The table"):
            # the table's types and defaults, NULL allowed where the writer gives the value.
            *([if_(f"COL_LENGTH({table_literal}, {nstr(column)}) IS NULL", f"ALTER TABLE {t} ADD {column} {ddl}")]
              for column, ddl in (
                  ("message_id", f"NVARCHAR(64) COLLATE {ID_COLLATION} NULL"),
                  *((column, "NVARCHAR(255) NULL") for column in ("topic", "aggregate_type")),
                  ("aggregate_id", f"NVARCHAR(255) COLLATE {ID_COLLATION} NULL"),
                  ("partition_key", "NVARCHAR(255) NULL"),
                  ("payload", ("JSON" if native_json else "NVARCHAR(MAX)") + " NULL"),
                  ("headers", ("JSON" if native_json else "NVARCHAR(MAX)") + f" NOT NULL{headers_default}"),
                  ("trace_id", "NVARCHAR(255) NULL"),
                  ("status", f"TINYINT NOT NULL {constraint('df', 'status')} DEFAULT 0 "
                             f"{constraint('ck', 'status')} CHECK (status BETWEEN 0 AND 4)"),
                  ("attempts", f"INT NOT NULL {constraint('df', 'attempts')} DEFAULT 0"),
                  *((column, "DATETIME2(3) NULL") for column in ("claimed_at", "next_retry_at")),
                  ("created_at", f"DATETIME2(3) NOT NULL {constraint('df', 'created_at')} DEFAULT SYSUTCDATETIME()"),
                  ("processed_at", "DATETIME2(3) NULL"),
                  ("last_error", "NVARCHAR(4000) NULL"),
                  ("lease_token", "CHAR(32) NULL"))),
            # The rows of a table that had no message_id: SQL Server's unique index takes one
            # NULL only, so two such rows failed the index, and the whole migration, every
            # run (found in review). Each gets one of its own, which no enqueue makes.
            [if_(f"EXISTS (SELECT 1 FROM {t} WHERE message_id IS NULL)",
                 f"UPDATE {t} SET message_id = CONCAT(N'legacy-', id) WHERE message_id IS NULL")],
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
                steps.append([if_(
                    f"OBJECT_ID({nstr(self.quote(schema) + '.' + ck)}, N'C') IS NULL AND EXISTS (SELECT 1 FROM "
                    f"sys.columns WHERE object_id = OBJECT_ID({table_literal}) AND name = {nstr(column)} "
                    "AND system_type_id = 231)",
                    f"EXEC sp_executesql {nstr(add_json_check_sql(t, ck, column))}")])
        steps += self._rename_legacy_indexes()
        for suffix in RETIRED_INDEXES:
            steps.append([if_(self._index_exists(suffix), f"DROP INDEX {q(self.index_name(suffix))} ON {t}")])
        for spec in INDEXES:
            # An index whose definition differs is built again in place, online where the edition
            # can (_rebuild_steps); a missing one is made by the next step.
            steps.append(((self.index_matches(spec), []), self._rebuild_steps(spec)))
            steps.append([if_(f"NOT {self._index_exists(spec.suffix)}", spec.ddl(q(self.index_name(spec.suffix)), t))])
        # Claims, purge chunks and requeue-all may lock more than 5,000 rows; escalation
        # to a table lock would stop every enqueuer until they commit.
        steps.append([lock_escalation_off(t, table_literal)])
        steps.append([if_(f"OBJECT_ID({nstr(self.holders)}, N'U') IS NULL",
                          f"CREATE TABLE {self.holders} ({self.holders_columns()})")])
        steps.append(unlock)
        return steps

    def holders_columns(self) -> str:
        return (f"holder_id CHAR(16) COLLATE {ID_COLLATION} NOT NULL "
                f"CONSTRAINT {self.quote('pk_' + self.holders_name)} PRIMARY KEY, "
                "host NVARCHAR(255) NOT NULL, pid INT NOT NULL, "
                "started_at DATETIME2(3) NOT NULL, beat_at DATETIME2(3) NOT NULL")

    def migration(self, native_json: bool = False) -> list[Any]:
        """One batch per object, each guarded on its own, so re-running repairs a partial
        deployment. Each batch starts with the SET options filtered indexes need."""
        def batch(statements: list[str]) -> str:
            return FILTERED_INDEX_OPTIONS + "\n" + "\n".join(statements)
        return [((step[0], batch(step[1])) if isinstance(step, tuple) else batch(step))
                for step in self.migration_steps(native_json)]

    def id_column_sql(self, column: str, nullable: bool) -> str:
        """The ALTER COLUMN that gives an id column (``message_id``, ``aggregate_id``) of a
        table made by another script the type and collation the engine creates it with."""
        size = 64 if column == "message_id" else 255
        return (f"ALTER TABLE {self.table} ALTER COLUMN {self.quote(column)} NVARCHAR({size}) COLLATE {ID_COLLATION} "
                f"{'NULL' if nullable else 'NOT NULL'}")

    def schema_problems(self, cursor: Any) -> list[str]:
        """What start-up finds wrong with an existing table, each with what to do:
        id columns that are not NVARCHAR or compare case-insensitively, and indexes that
        are missing, retired or defined differently (``outbox migrate`` repairs those)."""
        t = self._table_literal()
        exists = self.execute(cursor, f"SELECT OBJECT_ID({t}, N'U')").fetchone()
        if not exists or exists[0] is None:
            return []
        problems = []
        rows = self.execute(cursor, "SELECT name, collation_name, TYPE_NAME(system_type_id), is_nullable FROM "
                            f"sys.columns WHERE object_id = OBJECT_ID({t}) AND name IN (N'message_id', "
                            "N'aggregate_id')").fetchall()
        for column, collation, type_name, nullable in rows:
            if str(type_name).lower() != "nvarchar":
                # Compared with NVARCHAR (the claim's table variables, the enqueue's @message_id),
                # the column is converted: no FORCESEEK plan with a SQL collation (docs/sqlserver.md,
                # "Collations"; found in review).
                harm = ("every claim fails (error 8622: no plan for its seeks)" if column == "aggregate_id" else
                        "each enqueue scans the message-id index, and concurrent enqueues wait for each other")
                problems.append(
                    f"column {column} is {type_name}, not NVARCHAR: it is converted to be compared with NVARCHAR, "
                    f"and in a SQL collation {harm}. In a maintenance window drop the indexes on it, run "
                    f"`{self.id_column_sql(column, bool(nullable))}`, then `outbox migrate` "
                    "(docs/sqlserver.md, \"Collations\")")
            if collation and not (collation.upper().endswith(("_BIN", "_BIN2")) or "_CS" in collation.upper()):
                problems.append(
                    f"column {column} uses the case-insensitive collation {collation}: " + (
                        "message ids that differ only in case are one event" if column == "message_id" else
                        "aggregate ids that differ only in case hold each other back in the claim, yet are "
                        "published as two chains, ordered within each id only")
                    + f". The relay works with it; to match the other engines convert it to {ID_COLLATION} "
                    "(docs/sqlserver.md, \"Collations\")")
        for spec in INDEXES:
            if self.execute(cursor, self.index_matches(spec)).fetchone() is None:
                problems.append(f"index {self.index_name(spec.suffix)} is missing or defined differently "
                                f"({spec.why}): run `outbox migrate`")
        for suffix in RETIRED_INDEXES:
            if self.execute(cursor, f"SELECT 1 WHERE {self._index_exists(suffix)}").fetchone() is not None:
                problems.append(f"index {self.index_name(suffix)} is retired (it makes every claim and ack write "
                                "to an index of the whole history): run `outbox migrate`")
        return problems


def session_lock_sql(name: str) -> str:
    """Take the session's exclusive applock ``name`` without waiting; one row, the result
    (0 granted, negative not)."""
    return ("SET NOCOUNT ON; DECLARE @lock_result INT; "
            f"EXEC @lock_result = sp_getapplock @Resource = {nstr(name)}, @LockMode = N'Exclusive', "
            "@LockOwner = N'Session', @LockTimeout = 0; SELECT @lock_result")


def session_unlock_sql(name: str) -> str:
    return f"EXEC sp_releaseapplock @Resource = {nstr(name)}, @LockOwner = N'Session'"


def session_lock_held_sql(name: str) -> str:
    """One row: 1 while this session holds the applock ``name`` (``session_lock_sql``:
    sp_getapplock's default principal, public), else 0."""
    return (f"SELECT CASE WHEN APPLOCK_MODE(N'public', {nstr(name)}, N'Session') = N'Exclusive' "
            "THEN 1 ELSE 0 END")
