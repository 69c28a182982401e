"""``MssqlEngine``: SQL Server's connections. Each relay connection gets the session options
the engine relies on and reads what the server offers in one round trip (the package's
docstring explains both); statements bind with stable declared types; errors are classified
by ``driver``. The SQL itself is ``sql`` and ``schema``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from ....core.errors import StoreError
from ..base import duration
from . import driver
from .driver import (
    DEFAULT_LOCK_TIMEOUT_MS,
    INLINE_UNITS,
    input_sizes,
    open_connection,
    parse_target,
    result_rows,
    rows_input_sizes,
)
from .schema import (
    DDL_LOCK_TIMEOUT_MS,
    FILTERED_INDEX_OPTIONS,
    INDEXES,
    lock_holders_sql,
    migration_unlock_statements,
    session_lock_held_sql,
    session_lock_sql,
    session_unlock_sql,
)
from .sql import (
    ID_PARAMS_PER_STATEMENT,
    XACT_STATE_SQL,
    MssqlStatements,
    rollback_to_savepoint_sql,
    savepoint_statements,
)

log = logging.getLogger("outbox.storage.engines.mssql")

#: One round trip: what the connection's database and server offer (``read_server``).
SERVER_SQL = ("SELECT compatibility_level, "
              "CAST(PARSENAME(CAST(SERVERPROPERTY('ProductVersion') AS NVARCHAR(128)), 4) AS INT), "
              "CAST(SERVERPROPERTY('EngineEdition') AS INT) FROM sys.databases WHERE name = DB_NAME();")
#: The session's lock timeout, read to put it back (``ddl_bounds``).
LOCK_TIMEOUT_SQL = "SELECT @@LOCK_TIMEOUT"
#: The oldest level the engine supports: SQL Server 2012 (OFFSET/FETCH, THROW-free T-SQL).
MIN_LEVEL = 110


def _is_ddl(text: str) -> bool:
    """Migration batches (they all start with the filtered-index options)."""
    return text.startswith(FILTERED_INDEX_OPTIONS)


def _holder(session: int, login: str, host: str | None, program: str | None, status: str | None,
            age: int | None) -> str:
    """One row of ``lock_holders_sql``, in words."""
    facts = [f"login {login}", f"from {host}" if host else "", f"program {program}" if program else "",
             status or "", f"its transaction open {duration(age)}" if age is not None else ""]
    return f"session {session} ({', '.join(f for f in facts if f)}; KILL {session} ends it)"


class MssqlEngine(MssqlStatements):
    name = "mssql"
    placeholder = "?"
    default_schema: ClassVar[str | None] = "dbo"
    native_json: ClassVar[bool] = True
    now: ClassVar[str] = "SYSUTCDATETIME()"
    text_length: ClassVar[str] = "DATALENGTH"  # LEN leaves trailing spaces out
    #: With RCSI off a plain read waits for every uncommitted enqueue (issue 20, item 10);
    #: the gauges may count a row that then rolls back.
    unlocked_read: ClassVar[str] = " WITH (READUNCOMMITTED)"
    #: A lost holder's rows (docs/internals.md, "Lost workers") are nobody's locks: counting
    #: them and ending their leases read past rows others lock (an uncommitted enqueue, a
    #: claim's UPDATE) instead of waiting; READPAST needs READCOMMITTEDLOCK under RCSI. The
    #: UPDATE examines every open row (no index holds lease_token).
    past_locks_read: ClassVar[str] = " WITH (READCOMMITTEDLOCK, READPAST)"
    past_locks_update: ClassVar[str] = " WITH (READCOMMITTEDLOCK, READPAST, ROWLOCK)"

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
        conn = open_connection(target)
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
            rows = result_rows(cursor.execute(self.session_sql(lock_timeout_ms)))
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
    #: Nothing on the server ends a session idle in a transaction (docs/sqlserver.md, "A network cut").
    ends_idle_transactions: ClassVar[bool] = False

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

    @contextmanager
    def savepoint(self, conn: Any, name: str, lost: Callable[[], None]) -> Iterator[None]:
        # A transaction first when none is open (the outer block only switched autocommit
        # off), then SAVE TRANSACTION: sql.savepoint_statements. Nothing to release. After a
        # deadlock (XACT_STATE() 0) or an error that doomed the transaction (-1) the rollback
        # to the savepoint is skipped, and the transaction is lost to the outer block.
        self._run_batch(conn, "\n".join(savepoint_statements(name)))
        try:
            yield
        except BaseException:
            if not self.roll_back_block(conn, name, rollback_to_savepoint_sql(name)) or self._xact_state(conn) != 1:
                lost()
            raise

    def _xact_state(self, conn: Any) -> int | None:
        """``XACT_STATE()`` on ``conn``: 1 a transaction that can go on, 0 none, -1 doomed."""
        cursor = self.cursor_for(conn)
        try:
            row = self.execute(cursor, XACT_STATE_SQL).fetchone()
            return int(row[0]) if row else None
        except Exception:  # a broken connection: lost too
            log.debug("outbox: cannot read XACT_STATE()", exc_info=True)
            return None
        finally:
            cursor.close()

    def _run_batch(self, conn: Any, batch: str) -> None:
        """``_run`` for a batch, stepped through to its end: an error in a statement after a
        row count reaches the client only through ``nextset()`` (``execute`` steps a migration batch alike)."""
        cursor = self.cursor_for(conn)
        try:
            self.execute(cursor, batch)
            while cursor.nextset():
                pass
        finally:
            cursor.close()

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

    def ddl_cursor(self, conn: Any) -> Any:
        """A cursor without the query timeout, for migrations (bounded by the lock timeout
        and the migration lock instead): pyodbc and mssql-python copy ``conn.timeout``
        into a statement when its cursor is made, never at ``execute``, so the
        connection's timeout is 0 while the cursor is made, and restored for the rest
        (docs/sqlserver.md, "Drivers")."""
        saved = getattr(conn, "timeout", 0)
        if not saved:
            return conn.cursor()
        conn.timeout = 0
        try:
            return conn.cursor()
        finally:
            conn.timeout = saved

    def execute(self, cursor: Any, text: str, params: Sequence[Any] = ()) -> Any:
        """Bind parameters with stable declared types (one plan per statement, not per
        string length). A migration batch's results are stepped through to the end: an
        error after a row count reaches the client only through ``nextset()``
        (docs/sqlserver.md, "`outbox migrate`")."""
        params = tuple(params)
        self._declare_sizes(cursor, params)
        cursor.execute(text, params)
        if _is_ddl(text):
            while cursor.nextset():
                pass
        return cursor

    def session_lock_statements(self, name: str, idle_s: int) -> list[tuple[str, list[Any]]] | None:
        return [(session_lock_sql(name), [])]

    def session_unlock_statement(self, name: str) -> tuple[str, list[Any]]:
        return session_unlock_sql(name), []

    def session_lock_granted(self, value: Any) -> bool:
        return value is not None and int(value) >= 0

    def session_lock_held_statement(self, name: str) -> tuple[str, list[Any]]:
        return session_lock_held_sql(name), []

    def unlock_migration(self, cursor: Any) -> None:
        """Release a session-owned migration lock (``migration_unlock_statements``): the
        migration's last batch does it, but a migration that fails before it (on an
        autocommit connection: a Django migration) would leave the session holding it."""
        self.execute(cursor, FILTERED_INDEX_OPTIONS + "\n" + "\n".join(
            migration_unlock_statements(self.migration_lock_resource())))

    def executemany(self, cursor: Any, text: str, rows: Sequence[Sequence[Any]]) -> Any:
        """Every row binds as the types declared for all of them (``rows_input_sizes``):
        pyodbc would apply the sizes the cursor's last ``execute`` declared (``input_sizes``)
        to every row, so a payload past 4,000 UTF-16 units went as NVARCHAR(4000) and was
        refused as truncated; and with none declared it sends a string past 2,000 units as
        ``ntext``, refused by a ``_SC`` or ``_UTF8`` database (error 4189: replay, found in
        review). mssql-python declares its own per batch."""
        rows = [tuple(row) for row in rows]
        if type(cursor).__module__.split(".", 1)[0] == "pyodbc" and hasattr(cursor, "setinputsizes"):
            cursor.setinputsizes(rows_input_sizes(rows, INLINE_UNITS["pyodbc"]))
        else:
            self._declare_sizes(cursor, ())
        cursor.executemany(text, rows)
        return cursor

    @staticmethod
    def _declare_sizes(cursor: Any, params: tuple) -> None:
        """Declare ``params``' types on the cursor (``input_sizes``); with none to declare,
        clear pyodbc's, which it keeps from the last statement until they are replaced."""
        if not hasattr(cursor, "setinputsizes"):
            return
        module = type(cursor).__module__.split(".", 1)[0]
        sizes = input_sizes(params, INLINE_UNITS.get(module, 2000)) if params else None
        if sizes is not None or module == "pyodbc":
            cursor.setinputsizes(sizes)

    def is_transient(self, exc: BaseException) -> bool:
        return driver.is_transient(exc)

    def is_disconnect(self, exc: BaseException) -> bool:
        return driver.is_disconnect(exc)

    def is_lock_timeout(self, exc: BaseException) -> bool:
        return driver.is_lock_timeout(exc)

    def migration_lock_bound(self) -> str:
        return f"{DDL_LOCK_TIMEOUT_MS // 1000} s"

    @contextmanager
    def ddl_bounds(self, cursor: Any) -> Iterator[None]:
        """The migration's DDL steps wait DDL_LOCK_TIMEOUT_MS for a table's lock, not the
        session's LOCK_TIMEOUT (``lock_timeout_ms``, 30 s by default), and the session's is
        put back after them: SET LOCK_TIMEOUT is the session's, neither transactional nor
        ended by the commit (README, "The table")."""
        row = self.execute(cursor, LOCK_TIMEOUT_SQL).fetchone()
        if row is None:  # no answer (not a server): leave the session as it is
            yield
            return
        self.execute(cursor, f"SET LOCK_TIMEOUT {DDL_LOCK_TIMEOUT_MS}")
        try:
            yield
        finally:
            try:
                self.execute(cursor, f"SET LOCK_TIMEOUT {int(row[0])}")
            except Exception:  # a broken connection: the store drops it
                log.debug("outbox: cannot put the session's lock timeout back", exc_info=True)

    def lock_holders(self, cursor: Any, tables: Sequence[str]) -> str | None:
        rows = self.execute(cursor, lock_holders_sql(len(tables)), list(tables)).fetchall()
        return "; ".join(_holder(*row) for row in rows) or None

    def is_missing_table(self, exc: BaseException) -> bool:
        return driver.is_missing_table(exc)

    def is_missing_column(self, exc: BaseException) -> bool:
        return driver.is_missing_column(exc)

    def schema_error_hint(self, exc: BaseException) -> str | None:
        # An index of the table disabled (docs/sqlserver.md, "A disabled clustered index"): what
        # enqueue and the claim raised was the driver's error alone, and only 8655 was read.
        found = driver.disabled_index_of(exc)
        if found is not None and self.names_table(found.table):
            return self.disabled_index_problem(found, f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        return super().schema_error_hint(exc)

    def disabled_index_problem(self, found: driver.DisabledIndex, error: str) -> str:
        """What a statement's error ``found`` (``driver.disabled_index_of``) says about the table, and
        the fix: each error a disabled index raises, whichever statement meets it (enqueue, the claim
        whose hints name ``agg_open`` or ask for a seek), gets it; 8655 alone did (found in review)."""
        own = {self.index_name(spec.suffix).lower() for spec in INDEXES}
        index = f"[{found.index}]" if found.index else ""
        if found.number == 8655 and found.index and found.index.lower() not in own:
            problem = (f"cannot be read: its clustered index {index} is disabled, and every other index of the table "
                       "with it")
        elif found.number == 8655:
            problem = f"has a disabled index{' ' + index if index else ''}, which the statement names in a hint"
        elif found.number in (315, 316):
            which = index if found.number == 315 else f"(index id {found.index})" if found.index else ""
            problem = (f"has an index the statement names in a hint{' ' + which if which else ''} that is disabled, "
                       "or in a filegroup that is not online (bring its files back online: `outbox migrate` "
                       "cannot)")
        else:
            problem = ("gave no plan for the statement's index hints: an index of the table is disabled, or its id "
                       "columns are not NVARCHAR (docs/sqlserver.md, \"Collations\")")
        return (f"table {self.table} {problem} ({error}): run `outbox check`, which names a disabled index of the "
                "table, and `outbox migrate`, which rebuilds it (every index of the table, offline, when its "
                "clustered index is disabled, which disables them all: docs/sqlserver.md, \"A disabled clustered "
                "index\")")
