"""The queue tables' T-SQL, checked where no SQL Server runs: every statement the
SQL Server queue tables can send is recorded through a fake cursor (driven by the
real methods, so parameters are computed as in production), then its ``?`` count
must match its parameters, sqlglot's T-SQL parser must understand it fully, and the
lease must carry the locking hints it depends on. Live SQL Server runs of the same
code are in test_transport_tables.py and test_transport_kombu.py (OUTBOX_TEST_MSSQL_URL)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlglot
from fake_dbapi import RecordingConnection, RecordingCursor
from sqlglot import exp
from tsql_support import parse_one

from outbox.storage.engines.mssql import FILTERED_INDEX_OPTIONS, MssqlEngine
from outbox.transport.tables import queue_tables
from outbox.transport.tables.mssql import MssqlQueueTables


def lease_answers(sql: str) -> list[tuple]:
    """A leased message for the lease batch and the read of a lease's rows, a row of zeros
    for everything else."""
    leased = "FROM @out" in sql or sql.startswith("SELECT id, queue, headers, body, deliveries")
    return [(1, "q", "{}", "body", 1)] if leased else [(0, "", "", None)]


@pytest.fixture(params=[None, "messaging"], ids=["dbo", "messaging"])
def qt(request: pytest.FixtureRequest) -> MssqlQueueTables:
    tables = queue_tables(MssqlEngine(schema=request.param), "celery_q")
    assert isinstance(tables, MssqlQueueTables)
    return tables


class AnsweringCursor(RecordingCursor):
    def __init__(self, log: list[tuple[str, tuple]] | None = None, sizes: list | None = None,
                 answers: dict[str, list[tuple]] | None = None) -> None:
        super().__init__(log, sizes, answers, default=lease_answers)


class AnsweringConnection(RecordingConnection):
    """Cursors that answer as ``lease_answers`` does; ``autocommit`` as the caller sets it."""

    cursor_class = AnsweringCursor


def record_everything(qt: MssqlQueueTables) -> list[tuple[str, tuple]]:
    c = RecordingCursor(default=lease_answers)
    qt.put(c, "celery", '{"properties": {}}', "Ym9keQ==")
    qt.put(c, "celery", "{}", None, delay_ms=40 * 24 * 3600 * 1000, ttl_ms=5000)  # 40 days: over INT ms
    qt.probe(c, ["celery", "outbox.claim", "w1@host.celery.pidbox"])
    assert [r.body for r in qt.lease(c, "celery", 4, 3_600_000, "r" * 32)] == ["body"]
    alone = AnsweringConnection()  # the channel's lease: run alone, in autocommit
    alone.autocommit, alone.log = True, c.log
    assert [r.body for r in qt.lease(alone.cursor(), "celery", 4, 3_600_000, "r" * 32)] == ["body"]
    qt.leased(c, "celery", "r" * 32)
    qt.ack(c, 1, "r" * 32)
    qt.release(c, 1, "r" * 32)
    qt.release(c, 1, "r" * 32, delay_ms=1500)
    qt.size(c, "celery")
    qt.holds_any(c, "celery")
    qt.purge(c, "celery")
    qt.purge_expired(c, 500)
    qt.delete_queue(c, "celery")
    qt.bind(c, "celery.pidbox", "", "", "w1@host.celery.pidbox")
    qt.bind(c, "celeryev", "worker.#", "^worker\\..*?$", "w1.gossip", 2000)
    qt.unbind(c, "celery.pidbox", "", "w1@host.celery.pidbox")
    qt.table_bindings(c, "celery.pidbox")
    qt.missing_indexes(c)
    return c.log


def placeholders(sql: str) -> int:
    return re.sub(r"N?'(?:[^']|'')*'", "", sql).count("?")


def test_every_statement_binds_its_placeholders_and_parses(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    log = record_everything(qt)
    assert len(log) >= 15
    for sql, params in log:
        assert placeholders(sql) == len(params), sql
        # sqlglot's IF swallows the statements after it, so batches are checked per statement.
        statements = next((qt.lease_statements(own) for own in (False, True) if sql == qt.lease_batch(own)), [sql])
        for statement in statements:
            parse_one(statement)
        assert sqlglot.parse(sql, read="tsql")


def test_delays_split_into_seconds_so_long_countdowns_do_not_overflow(qt: MssqlQueueTables) -> None:
    log = record_everything(qt)
    sql, params = log[1]
    assert "DATEADD(MILLISECOND, ?, DATEADD(SECOND, ?, SYSUTCDATETIME()))" in sql
    assert params[3:5] == (0, 40 * 24 * 3600) and params[5:] == (0, 40 * 24 * 3600 + 5)  # TTL from the due time
    assert max(p for p in params if isinstance(p, int)) < 2**31


def test_lease_skips_held_rows_locks_what_it_takes_and_outputs_into_a_table_variable(
        qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    update = next(s for s in qt.lease_statements() if s.startswith("WITH leased"))
    tree = parse_one(update)
    refs = [t for t in tree.find_all(exp.Table) if t.name == "celery_q"]
    assert len(refs) == 1
    assert {v.name.upper() for h in refs[0].args.get("hints") or [] for v in h.expressions} == {
        "READCOMMITTEDLOCK", "READPAST", "UPDLOCK", "ROWLOCK"}
    assert "ORDER BY visible_at, id" in update and "TOP (@limit)" in update  # the ready index's order
    assert "OUTPUT inserted.id, inserted.queue, inserted.headers, inserted.body, inserted.deliveries INTO @out" \
        in update
    statements = qt.lease_statements()
    assert statements[1] == "SET NOCOUNT ON;" and statements[-1].startswith("SELECT")
    assert not any(re.search(r"\b(BEGIN TRAN|COMMIT|ISOLATION)", s) for s in statements)


def test_the_queue_count_reads_past_an_uncommitted_send(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """kombu's ``queue_declare`` counts the queue (``Channel._size``): every worker at start-up
    and the first ``apply_async`` to a queue on each producer connection (``maybe_declare``).
    It read with shared locks, so with READ_COMMITTED_SNAPSHOT off (SQL Server's default) it
    waited on the row of any open ``send_task`` transaction to that queue: the lock timeout
    (30 s), four tries, then BrokerDatabaseUnavailable (found in review). An uncommitted send is
    not a waiting message: the count reads past it, as the lease's probe does."""
    c = RecordingCursor(default=lease_answers)
    qt.size(c, "celery")
    (sql, params), = c.log
    refs = [t for t in parse_one(sql).find_all(exp.Table) if t.name == "celery_q"]
    assert len(refs) == 1 and params == ("celery",)
    assert {v.name.upper() for h in refs[0].args.get("hints") or [] for v in h.expressions} == {
        "READCOMMITTEDLOCK", "READPAST"}


def test_the_lease_run_alone_commits_in_its_own_batch_before_the_rows_are_sent(
        qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """SQL Server cannot end a session idle in a transaction: a receiver cut off between its
    lease and its COMMIT held the rows' locks for as long as its session lived. Run alone
    (autocommit), the batch opens its transaction after XACT_ABORT is on and commits it right
    after the UPDATE, before the rows are selected (docs/transport.md, "A network cut before
    the COMMIT"); in a caller's transaction it neither begins nor commits one."""
    own, plain = qt.lease_statements(own_transaction=True), qt.lease_statements()
    assert [s for s in own if s not in ("BEGIN TRANSACTION;", "COMMIT TRANSACTION;")] == plain
    begin, commit = own.index("BEGIN TRANSACTION;"), own.index("COMMIT TRANSACTION;")
    update = next(i for i, s in enumerate(own) if s.startswith("WITH leased"))
    assert own.index("SET XACT_ABORT ON;") < begin == update - 1 and commit == update + 1
    assert commit < next(i for i, s in enumerate(own) if "FROM @out" in s) == len(own) - 1
    assert own[commit + 1:-1] == ["IF @xact_abort = 0\nBEGIN\n    SET XACT_ABORT OFF;\nEND;",
                                  "IF @nocount = 0\nBEGIN\n    SET NOCOUNT OFF;\nEND;"], own[commit + 1:-1]
    assert not any(re.search(r"ROLLBACK|ISOLATION", s) for s in own)
    for statement in own:
        parse_one(statement)


def test_only_sql_server_runs_the_send_lease_ack_and_requeue_alone() -> None:
    """The others' servers end a cut-off lease's transaction within idle_transaction_timeout_s,
    sooner than a committed lease whose answer was lost would come back."""
    from outbox.storage.engines import engine_for_url

    assert queue_tables(MssqlEngine(), "celery_q").writes_alone
    for url in ("postgresql://h/d", "mysql://h/d", "sqlite:///x.db"):
        assert not queue_tables(engine_for_url(url), "celery_q").writes_alone, url
        assert engine_for_url(url).ends_idle_transactions, url


def test_the_channels_send_lease_ack_and_requeue_run_alone_and_autocommit_is_put_back(
        monkeypatch: pytest.MonkeyPatch, no_sqlglot_fallbacks: None) -> None:
    """Through the transport's ``Database`` as the channel calls it: the lease batch that
    commits itself, and the send, ack and requeue, each on the connection in autocommit; the
    connection back in manual commit after each."""
    from outbox.transport.database import Database

    conn = AnsweringConnection()
    modes: list[tuple[str, bool]] = []
    execute = conn.cursor_class.execute

    def watched(cursor: RecordingCursor, sql: str, params: Any = ()) -> RecordingCursor:
        modes.append((sql, conn.autocommit))
        return execute(cursor, sql, params)

    monkeypatch.setattr(conn.cursor_class, "execute", watched)
    db = Database("mssql+pyodbc://u:p@h/d?driver=x", "celery_q", None, create=False)
    monkeypatch.setattr(db.engine, "connect", lambda url: conn)
    qt = db.qt
    assert isinstance(qt, MssqlQueueTables)
    rows, tries = db.run_counting(lambda qt, c, n: qt.lease(c, "celery", 4, 60_000, "r" * 32), alone=qt.writes_alone)
    assert [r.body for r in rows] == ["body"] and tries == 1 and conn.autocommit is False
    assert (qt.lease_batch(own_transaction=True), True) in modes
    db.run(lambda qt, c: qt.put(c, "celery", "{}", "Ym9keQ=="), alone=qt.writes_alone)
    assert (qt.put_sql(False), True) in modes
    db.run_counting(lambda qt, c, n: qt.ack(c, 1, "r" * 32), alone=qt.writes_alone)
    db.run_counting(lambda qt, c, n: qt.release(c, 1, "r" * 32), alone=qt.writes_alone)
    assert (qt.ack_sql(), True) in modes and (qt.release_sql(delayed=False), True) in modes
    assert conn.autocommit is False


def test_a_failed_lease_puts_the_session_back_and_ends_its_own_transaction(
        qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    """An error ends the batch before it restores NOCOUNT and XACT_ABORT (ack, release and
    purge read rowcount, which NOCOUNT makes -1); run alone, a transaction an interrupt left
    open is rolled back too, since the driver's rollback does nothing in autocommit."""
    class TimedOut(AnsweringCursor):
        def execute(self, sql: str, params: Any = ()) -> AnsweringCursor:
            super().execute(sql, params)
            if sql.startswith("DECLARE @nocount"):
                raise TimeoutError("query timeout")
            return self

    class TimingOut(AnsweringConnection):
        cursor_class = TimedOut

    for autocommit in (False, True):
        conn = TimingOut()
        conn.autocommit = autocommit
        with pytest.raises(TimeoutError):
            qt.lease(conn.cursor(), "celery", 4, 60_000, "r" * 32)
        reset = conn.log[-1][0]
        assert reset.endswith("SET XACT_ABORT ON; SET NOCOUNT OFF;")
        assert reset.startswith("IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION;") is autocommit, reset
        assert sqlglot.parse(reset, read="tsql")


def test_the_clock_is_compared_at_the_columns_precision(qt: MssqlQueueTables) -> None:
    """DATETIME2(3) rounds SYSUTCDATETIME(): every comparison with a stored time reads the
    clock at that precision (docs/transport.md, "The clock of the tables")."""
    now = "CAST(SYSUTCDATETIME() AS DATETIME2(3))"
    update = next(s for s in qt.lease_statements() if s.startswith("WITH leased"))
    where = update[update.index("WHERE"):update.index("ORDER BY")]
    assert where.count(now) == 2 and where.count("SYSUTCDATETIME()") == 2
    for sql in (qt.probe_sql(2), qt.purge_expired_sql(), qt.leased_sql()):
        assert now in sql and sql.count("SYSUTCDATETIME()") == sql.count(now), sql


def test_migration_steps_are_guarded_one_object_each(qt: MssqlQueueTables, no_sqlglot_fallbacks: None) -> None:
    made = []
    for step in qt.migration():
        assert step.startswith(FILTERED_INDEX_OPTIONS)
        guarded = parse_one(step[len(FILTERED_INDEX_OPTIONS):].strip())
        assert isinstance(guarded, exp.IfBlock), step
        body = [e for e in guarded.args["true"].expressions if not isinstance(e, exp.EndStatement)]
        assert len(body) == 1, step
        made.append(type(body[0]).__name__)
    assert made == ["ExecuteSql", "Create", "Create", "Drop", "Create", "Create", "Create", "Alter"]
    text = "\n".join(qt.migration())
    assert "PRIMARY KEY CLUSTERED (id)" in text and "id BIGINT IDENTITY(1,1) NOT NULL" in text
    assert "(queue, visible_at, id) INCLUDE (expires_at)" in text
    assert f"DROP INDEX [ix_celery_q_receive] ON {qt.table}" in text  # the (queue, id) index it replaced
    assert "(expires_at) WHERE expires_at IS NOT NULL" in text
    assert "UNIQUE NONCLUSTERED INDEX" in text
    assert qt.required_indexes() == ["ix_celery_q_ready", "ix_celery_q_expires"]


class TableLocked(AnsweringCursor):
    """A session whose LOCK_TIMEOUT reads 30 s and whose CREATE TABLE waits out its lock
    timeout (1222): a table another transaction holds."""

    def execute(self, sql: str, params: Any = ()) -> RecordingCursor:
        from outbox.storage.engines.mssql.engine import LOCK_TIMEOUT_SQL

        super().execute(sql, params)
        if sql == LOCK_TIMEOUT_SQL:
            self.rows = [(30_000,)]
        if "CREATE TABLE" in sql:
            raise type("OperationalError", (Exception,), {"__module__": "pyodbc"})(
                "HY000", "[HY000] [SQL Server]Lock request time out period exceeded. (1222) (SQLExecDirectW)")
        return self


def test_the_queue_tables_migration_gives_up_once_and_names_the_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """`outbox migrate`'s queue tables on SQL Server: a step that waited for a table's lock
    (1222) was retried at the session's 30 s LOCK_TIMEOUT like any transient error (review
    diff1, finding 5). Now it waits 10 s once, and the error names who holds the table."""
    from outbox.core.errors import StoreError
    from outbox.transport import migrate_queue_tables

    conn = AnsweringConnection({"FROM sys.dm_tran_locks": [(61, "app", None, None, "sleeping", 3)]})
    conn.cursor_class = TableLocked
    monkeypatch.setattr(MssqlEngine, "connect", lambda self, url: conn)
    with pytest.raises(StoreError, match=r"waiting 10 s for a lock on \[dbo\]\.\[celery_q\].*session 61 "
                                         r"\(login app, sleeping, its transaction open 3 s; KILL 61 ends it\)"):
        migrate_queue_tables("outboxdb+mssql+pyodbc://u:p@h/d?driver=x", table="celery_q")
    sent = [sql for sql, _ in conn.log]
    assert sum("CREATE TABLE" in sql for sql in sent) == 1
    assert sent.index("SET LOCK_TIMEOUT 10000") < next(i for i, s in enumerate(sent) if "CREATE TABLE" in s)
    assert sent[-1] != "SET LOCK_TIMEOUT 10000" and "SET LOCK_TIMEOUT 30000" in sent


def test_a_workers_start_up_migration_waits_one_second_for_a_table_lock(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_sqlglot_fallbacks: None) -> None:
    """A worker's start-up migration of the queue tables (``Database._set_up``) ran its DDL
    under the 10 s of ``outbox migrate`` on SQL Server: behind an open send_task transaction
    every send, lease and ack of every process queued behind each starting worker's wait,
    10 s per worker (they take turns on the migration's sp_getapplock), where PostgreSQL and
    MariaDB bound it at 1 s (found in review). Now 1 s, then the warning, as there; the
    session's own value is put back after."""
    import logging

    from outbox.transport.database import Database

    conn = AnsweringConnection()
    conn.cursor_class = TableLocked
    monkeypatch.setattr(MssqlEngine, "connect", lambda self, url: conn)
    db = Database("mssql+pyodbc://u:p@h/d?driver=x", "celery_q_startup", None, create=True, wake=False)
    with caplog.at_level(logging.WARNING, logger="outbox.transport"):
        db.connection()
    sent = [sql for sql, _ in conn.log]
    create = next(i for i, s in enumerate(sent) if "CREATE TABLE" in s)
    bounds = [i for i, s in enumerate(sent) if s.startswith("SET LOCK_TIMEOUT")]
    assert max(i for i in bounds if i < create) == sent.index("SET LOCK_TIMEOUT 1000"), sent
    assert sent[bounds[-1]] == "SET LOCK_TIMEOUT 30000" and bounds[-1] > create  # the session's own, put back
    assert any("waited too long for a lock" in r.getMessage() for r in caplog.records)
    parse_one(sent[sent.index("SET LOCK_TIMEOUT 1000")])
