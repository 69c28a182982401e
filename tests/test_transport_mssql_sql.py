"""The queue tables' T-SQL, checked where no SQL Server runs: every statement the
SQL Server queue tables can send is recorded through a fake cursor (driven by the
real methods, so parameters are computed as in production), then its ``?`` count
must match its parameters, sqlglot's T-SQL parser must understand it fully, and the
lease must carry the locking hints it depends on. Live SQL Server runs of the same
code are in test_transport_tables.py and test_transport_kombu.py (OUTBOX_TEST_MSSQL_URL)."""

from __future__ import annotations

import re

import pytest
import sqlglot
from fake_dbapi import RecordingCursor
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


def record_everything(qt: MssqlQueueTables) -> list[tuple[str, tuple]]:
    c = RecordingCursor(default=lease_answers)
    qt.put(c, "celery", '{"properties": {}}', "Ym9keQ==")
    qt.put(c, "celery", "{}", None, delay_ms=40 * 24 * 3600 * 1000, ttl_ms=5000)  # 40 days: over INT ms
    qt.probe(c, ["celery", "outbox.claim", "w1@host.celery.pidbox"])
    assert [r.body for r in qt.lease(c, "celery", 4, 3_600_000, "r" * 32)] == ["body"]
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
        statements = qt.lease_statements() if sql == qt.lease_batch() else [sql]
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
