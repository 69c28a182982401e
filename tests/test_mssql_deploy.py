"""SQL Server deployment fixes of issue 20 (items 4, 5, 8, 12), checked where no SQL
Server runs: the T-SQL is parsed with sqlglot's T-SQL dialect and driven through a
recording cursor; the live checks are in test_mssql_live.py.

- item 4: OPENJSON (compatibility level 130+) and ISJSON (SQL Server 2016+, Azure SQL, at
  every level) are decided by probing the connection that runs the SQL: the store's, the
  Django migration's and admin's, Alembic's;
- item 5: the broker's queue tables are migrated under the migration applock, and their
  lock escalation is off;
- item 8: the JSON checks are added to an existing table WITH NOCHECK;
- item 12: the receive index is keyed on visibility.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from fake_dbapi import RecordingCursor
from sqlglot import exp
from tsql_support import parse_one

from outbox.storage.engines.mssql import FILTERED_INDEX_OPTIONS, MIGRATE_LOCK_TIMEOUT_MS, MssqlEngine
from outbox.transport.tables import queue_tables
from outbox.transport.tables.mssql import MssqlQueueTables


def parse_batch(batch: str, statements: Sequence[str]) -> None:
    """A batch as sent: the filtered-index options, then ``statements``, each parsed alone
    (sqlglot's IF swallows what follows it)."""
    assert batch == FILTERED_INDEX_OPTIONS + "\n" + "\n".join(statements)
    for option in FILTERED_INDEX_OPTIONS.split(";"):
        if option.strip():
            parse_one(option.strip() + ";")
    for statement in statements:
        parse_one(statement)


# -- item 5: the queue tables' migration ---------------------------------------------------------

@pytest.fixture(params=[None, "messaging"], ids=["dbo", "messaging"])
def qt(request: pytest.FixtureRequest) -> MssqlQueueTables:
    tables = queue_tables(MssqlEngine(schema=request.param), "celery_q")
    assert isinstance(tables, MssqlQueueTables)
    return tables


def test_queue_migration_runs_under_the_migration_applock(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """Workers starting together on an empty database each create the queue tables: the
    first batch takes the same exclusive applock `outbox migrate` takes for the outbox
    table (on the queue table's own resource), the last releases a session-owned one."""
    cursor = RecordingCursor()
    qt.migrate(cursor)
    sent = [sql for sql, _ in cursor.log]
    assert sent[0] == qt.migration_lock_batch() and sent[-1] == qt.migration_unlock_batch()
    assert sent[1:-1] == qt.migration()
    resource = f"N'outbox migrate {qt.table}'"
    lock = sent[0]
    assert (f"EXEC @lock_result = sp_getapplock @Resource = {resource}, @LockMode = N'Exclusive', "
            f"@LockOwner = @lock_owner, @LockTimeout = {MIGRATE_LOCK_TIMEOUT_MS};") in lock
    # The SELECT opens the driver's implicit transaction before the owner is chosen, so the
    # lock is the transaction's and goes with the commit.
    assert lock.index("SELECT @lock_result = COUNT(*) FROM sys.objects") < lock.index("WHEN @@TRANCOUNT > 0")
    assert "RAISERROR(N'outbox migrate: another outbox migrate" in lock
    assert f"EXEC sp_releaseapplock @Resource = {resource}, @LockOwner = N'Session'" in sent[-1]
    for batch in (qt.migration_lock_batch(), qt.migration_unlock_batch()):
        statements = batch[len(FILTERED_INDEX_OPTIONS) + 1:].split("\n")
        joined: list[str] = []
        for line in statements:  # an IF block spans lines: rejoin statements per top-level line
            if joined and not line.startswith(("DECLARE", "SELECT", "SET", "EXEC", "IF")):
                joined[-1] += "\n" + line
            else:
                joined.append(line)
        parse_batch(batch, joined)


def test_a_failed_queue_migration_still_releases_the_lock(qt: MssqlQueueTables) -> None:
    cursor = RecordingCursor()
    original = cursor.execute

    def failing(sql: str, params: Sequence[Any] = ()) -> RecordingCursor:
        if "CREATE TABLE" in sql:
            original(sql, params)
            raise RuntimeError("2714: There is already an object named ...")
        return original(sql, params)

    cursor.execute = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="2714"):
        qt.migrate(cursor)
    assert cursor.log[-1][0] == qt.migration_unlock_batch()


def test_queue_table_has_lock_escalation_off(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """An unbounded purge of a queue must not escalate to a table lock that blocks send_task
    in the application's transactions."""
    step = next(s for s in qt.migration() if "LOCK_ESCALATION" in s)
    assert f"ALTER TABLE {qt.table} SET (LOCK_ESCALATION = DISABLE)" in step
    assert f"OBJECT_ID(N'{qt.table}')" in step and "lock_escalation_desc <> N'DISABLE'" in step
    tree = parse_one(step[len(FILTERED_INDEX_OPTIONS):].strip())
    assert isinstance(tree, exp.IfBlock)


# -- item 12: the receive index is keyed on visibility ----------------------------------------------

def test_receive_index_is_keyed_on_visibility_and_replaces_the_id_keyed_one(
        qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """The lease and the idle probe read a queue's visible rows only: (queue, visible_at, id),
    the lease ordered the same way (no sort), and the (queue, id) index that made every
    receive read past the delayed and leased rows at the queue's head is dropped."""
    text = "\n".join(qt.migration())
    ready, old = qt.index_name("ready"), qt.index_name("receive")
    assert f"CREATE NONCLUSTERED INDEX [{ready}] ON {qt.table} (queue, visible_at, id) INCLUDE (expires_at)" in text
    assert f"DROP INDEX [{old}] ON {qt.table}" in text
    assert text.index(f"[{ready}]") < text.index(f"DROP INDEX [{old}]")  # never without a receive index
    assert "(queue, id)" not in text
    assert qt.required_indexes() == [ready, qt.index_name("expires")]
    lease = next(s for s in qt.lease_statements() if s.startswith("WITH leased"))
    select = parse_one(lease).find(exp.Select)
    assert select is not None
    order = select.args["order"]
    assert [o.this.name for o in order.expressions] == ["visible_at", "id"]
    assert f"WHERE queue = @queue AND visible_at <= {qt.now()}" in lease


def test_a_requeued_message_keeps_its_place(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    cursor = RecordingCursor()
    qt.release(cursor, 7, "r" * 32)
    qt.release(cursor, 7, "r" * 32, delay_ms=1500)
    (at_once, p1), (delayed, p2) = cursor.log
    assert at_once == f"UPDATE {qt.table} SET visible_at = created_at, receipt = NULL WHERE id = ? AND receipt = ?"
    assert p1 == (7, "r" * 32)
    assert "DATEADD(MILLISECOND, ?, DATEADD(SECOND, ?, SYSUTCDATETIME()))" in delayed and p2 == (500, 1, 7, "r" * 32)
    for sql in (at_once, delayed):
        assert isinstance(parse_one(sql), exp.Update)


# -- item 4: OPENJSON and ISJSON, probed on the connection that runs the SQL ---------------------

URL = "mssql+pyodbc://relay:secret@db.example:1433/app?driver=ODBC+Driver+18+for+SQL+Server"
SERVER_ANSWER = "SELECT compatibility_level, "


class RawConnection:
    """A pyodbc-like connection (``enqueue``-style detection reads the class's module)."""

    __module__ = "pyodbc.fake"

    def __init__(self, answers: dict[str, list[tuple]]) -> None:
        self.answers = answers
        self.cursors: list[RecordingCursor] = []

    def cursor(self) -> RecordingCursor:
        self.cursors.append(RecordingCursor(answers=self.answers))
        return self.cursors[-1]

    @property
    def log(self) -> list[tuple[str, tuple]]:
        return [entry for c in self.cursors for entry in c.log]

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass


class DjangoConnection:
    """What ``unwrap_connection`` sees of a Django DatabaseWrapper on mssql-django."""

    vendor = "microsoft"

    def __init__(self, raw: RawConnection) -> None:
        self.connection = raw

    def ensure_connection(self) -> None:
        pass


@pytest.mark.parametrize("row, openjson, isjson", [
    ((110, 16, 3), False, True),    # SQL Server 2022, database left at level 110: ISJSON, no OPENJSON
    ((120, 12, 3), False, False),   # SQL Server 2014: neither
    ((130, 13, 2), True, True),     # SQL Server 2016 at 130: both
    ((150, 12, 5), True, True),     # Azure SQL Database reports ProductVersion 12: both
    ((120, 12, 8), False, True),    # Managed Instance at level 120
])
def test_openjson_follows_the_level_and_isjson_the_version(row: tuple, openjson: bool, isjson: bool) -> None:
    engine = MssqlEngine()
    assert not engine.has_json and not engine.has_isjson  # unknown: neither is assumed
    cursor = RecordingCursor(answers={SERVER_ANSWER: [row]})
    engine.read_server(cursor)
    assert (engine.has_json, engine.has_isjson) == (openjson, isjson)
    assert (engine.compat_level, engine.server_version, engine.engine_edition) == row


def test_the_server_probe_parses_and_rides_on_the_session_batch(no_sqlglot_fallbacks: None) -> None:
    from outbox.storage.engines.mssql import SERVER_SQL
    tree = parse_one(SERVER_SQL)
    assert isinstance(tree, exp.Select) and len(tree.expressions) == 3
    assert "SERVERPROPERTY('ProductVersion')" in SERVER_SQL and "SERVERPROPERTY('EngineEdition')" in SERVER_SQL
    assert MssqlEngine.session_sql().endswith(SERVER_SQL)


def migration_text(log: list[tuple[str, tuple]]) -> str:
    return "\n".join(sql for sql, _ in log if sql.startswith(FILTERED_INDEX_OPTIONS))


@pytest.mark.parametrize("row, isjson", [((120, 12, 3), False), ((110, 16, 3), True)])
def test_alembic_and_django_migrations_probe_their_connection_for_isjson(row: tuple, isjson: bool) -> None:
    """Both always emitted ISJSON (an engine that never read the server assumed it): SQL
    Server 2014 refused the migration. A 2016+ server at a low level does get the checks."""
    from outbox.contrib.alembic import create_outbox_table
    from outbox.contrib.django.schema import create_table

    class Op:
        """What ``create_outbox_table`` uses of Alembic's ``op``, online."""

        def __init__(self, raw: RawConnection) -> None:
            self.raw = raw

        def get_context(self) -> Any:
            from types import SimpleNamespace

            return SimpleNamespace(as_sql=False)

        def get_bind(self) -> RawConnection:
            return self.raw

    alembic = RawConnection({SERVER_ANSWER: [row]})
    create_outbox_table(Op(alembic))
    django = RawConnection({SERVER_ANSWER: [row]})
    create_table(DjangoConnection(django))
    for raw in (alembic, django):
        assert raw.log[0][0].startswith(SERVER_ANSWER)  # probed before any DDL was built
        text = migration_text(raw.log)
        assert "CREATE TABLE" in text
        assert ("ISJSON" in text) is isjson


class DeadRowsCursor(RecordingCursor):
    """Answers the requeue's look-up (``OutboxStore._requeue_ids``) with a dead row for each
    id it names: a list of parameters, or one OPENJSON array."""

    def execute(self, sql: str, params: Any = ()) -> RecordingCursor:
        super().execute(sql, params)
        if "processed_at, status FROM" in sql:
            ids = json.loads(params[0]) if len(params) == 1 and isinstance(params[0], str) else params
            self.rows = [(int(i), f"m-{i}", "t", "o", "a", 3, "retriable: x", None, 4) for i in dict.fromkeys(ids)]
        return self


class DeadRowsConnection(RawConnection):
    def cursor(self) -> RecordingCursor:
        self.cursors.append(DeadRowsCursor(answers=self.answers))
        return self.cursors[-1]


def test_django_admin_requeue_probes_its_connection_and_chunks_below_130() -> None:
    """The admin's requeue built its engine without reading the level and sent OPENJSON,
    which a database below level 130 refuses; and one statement may carry 2,000 ids. Now
    the admin's store call (``schema.store_on``, the selection mode of ``OutboxStore.requeue``)
    probes first, then looks up and requeues 1,000 ids per transaction."""
    from contextlib import nullcontext

    from outbox.contrib.django.schema import store_on
    raw = DeadRowsConnection({SERVER_ANSWER: [(120, 16, 3)]})
    result = store_on(DjangoConnection(raw), nullcontext).requeue(list(range(1, 4501)), all_or_nothing=False)
    assert result.count == 4500 and not (result.refused or result.missing or result.not_dead)
    probe, *sent = raw.log
    assert probe[0].startswith(SERVER_ANSWER)
    updates = [(sql, params) for sql, params in sent if sql.startswith("UPDATE")]
    assert len(updates) == 5 == len(sent) - 5  # one look-up and one update per 1,000 ids
    assert set().union(*(params for _, params in updates)) == set(range(1, 4501))
    for sql, params in sent:
        assert "OPENJSON" not in sql and len(params) <= 2000
        parse_one(sql)
    at_130 = DeadRowsConnection({SERVER_ANSWER: [(130, 16, 3)]})
    store_on(DjangoConnection(at_130), nullcontext).requeue(list(range(1, 4501)), all_or_nothing=False)
    assert len(at_130.log) == 11 and all("OPENJSON(?)" in sql for sql, _ in at_130.log[1:])


def test_requeue_of_explicit_ids_over_2000_below_level_130() -> None:
    """`outbox dead requeue IDS` with 3,000 ids put them all in one statement and failed
    below level 130 (no OPENJSON, 2,100 parameters at most)."""
    from datetime import datetime

    from outbox.storage.store import OutboxStore
    ids = list(range(1, 3001))
    rows = [(i, f"m-{i}", "t.a" if i % 2 else "t.b", "o", "a", 3, "retriable: x", datetime(2024, 1, 1), 4)
            for i in ids]
    raw = RawConnection({"processed_at, status FROM": rows, SERVER_ANSWER: [(120, 12, 3)]})
    store = OutboxStore(URL)
    store.engine.connect = lambda url: raw  # type: ignore[method-assign]
    store.engine.read_server(raw.cursor())
    result = store.requeue(ids)
    assert result.requeued == {"t.a": 1500, "t.b": 1500} and not (result.missing or result.not_dead)
    sent = raw.log[1:]
    assert len(sent) == 4  # two selects, two updates
    for sql, params in sent:
        assert "OPENJSON" not in sql and len(params) <= 2000
        parse_one(sql)


# -- item 8: the JSON checks on an existing table, WITH NOCHECK -------------------------------------

def test_json_checks_are_added_to_an_existing_table_with_nocheck(no_sqlglot_fallbacks: None) -> None:
    """Checking every existing row would scan the table under a schema lock (every enqueuer
    waits) and one bad row would abort the migration: the checks are added WITH NOCHECK."""
    from outbox.storage.engines.mssql import add_json_check_sql
    engine = MssqlEngine(table="events_out", schema="messaging")
    engine.read_server(RecordingCursor(answers={SERVER_ANSWER: [(110, 15, 3)]}))
    steps = [s for s in engine.migration_steps() if not isinstance(s, tuple) and "ck_events_out_payload_json" in
             "".join(s) and "sp_executesql" in "".join(s)]
    assert len(steps) == 1
    (statement,) = steps[0]
    inner = add_json_check_sql("[messaging].[events_out]", "[ck_events_out_payload_json]", "payload")
    assert inner == ("ALTER TABLE [messaging].[events_out] WITH NOCHECK ADD CONSTRAINT [ck_events_out_payload_json] "
                     "CHECK (ISJSON(payload) = 1)")
    assert f"EXEC sp_executesql N'{inner}'" in statement
    tree = parse_one(statement)
    assert isinstance(tree, exp.IfBlock)
    # sqlglot does not know the WITH NOCHECK form (T-SQL: ALTER TABLE t WITH { CHECK | NOCHECK } ADD ...);
    # without it, the rest is a plain ADD CONSTRAINT ... CHECK.
    assert isinstance(parse_one(inner.replace(" WITH NOCHECK", "")), exp.Alter)
    # A new table gets its checks in CREATE TABLE (nothing to validate there).
    create = next(s for s in engine.migration_steps() if not isinstance(s, tuple) and "CREATE TABLE" in "".join(s))
    assert "CHECK (ISJSON(payload) = 1)" in "".join(create) and "NOCHECK" not in "".join(create)


def test_the_dead_rows_are_read_past_others_locks() -> None:
    """``outbox dead list`` and ``dead requeue --all`` read the dead rows with a plain read:
    with RCSI off, a scan past the last dead ids met an uncommitted enqueue and waited the
    lock timeout on each of five attempts (found in review). A dead row is committed and
    nobody locks it: they read past others' locks, as the lost holder's count does."""
    from collections.abc import Iterator
    from contextlib import contextmanager

    from outbox.storage.store import OutboxStore

    log: list[tuple[str, tuple]] = []
    engine = MssqlEngine()

    @contextmanager
    def begin() -> Iterator[Any]:
        yield RecordingCursor(log=log)

    store = OutboxStore.on_caller(engine, begin)
    store.dead_list()
    store.requeue_dead(None)
    reads = [sql for sql, _ in log if sql.lstrip().upper().startswith("SELECT")]
    assert len(reads) == 2, log
    for sql in reads:
        assert "WITH (READCOMMITTEDLOCK, READPAST)" in sql, sql
        parse_one(sql)


@pytest.mark.parametrize("topics", [None, ["orders.paid"]])
def test_requeue_without_force_counts_the_kept_dead_rows_past_others_locks(topics: list[str] | None) -> None:
    """``outbox dead requeue --all`` and ``--topic`` without ``--force`` first count, per topic,
    the dead rows they keep (a permanent reason). That count read with a plain read, when the
    6 December fix gave the two other reads of the dead rows READPAST: with RCSI off, a scan
    of the table (the plan for many dead rows: topic and last_error are in no index) met any
    uncommitted enqueue and waited the lock timeout on each of five attempts, so the command
    failed while an application held an enqueue open (found in review, 7 December). Every
    read of the dead rows now reads past others' locks."""
    from collections.abc import Iterator
    from contextlib import contextmanager

    from outbox.storage.store import OutboxStore

    log: list[tuple[str, tuple]] = []
    engine = MssqlEngine()

    @contextmanager
    def begin() -> Iterator[Any]:
        yield RecordingCursor(log=log)

    OutboxStore.on_caller(engine, begin).requeue(None, topics=topics)
    reads = [sql for sql, _ in log if sql.lstrip().upper().startswith("SELECT")]
    assert len(reads) == 2 and any("COUNT(*)" in sql for sql in reads), log  # the count, then a chunk
    for sql in reads:
        assert f"FROM {engine.table} WITH (READCOMMITTEDLOCK, READPAST) WHERE status = 4" in sql, sql
        parse_one(sql)
