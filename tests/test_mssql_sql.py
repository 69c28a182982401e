"""SQL Server's SQL, checked where no SQL Server runs.

Every statement the engine can send is captured through a recording fake
connection (driven by the real ``OutboxStore``, so parameters are computed exactly
as in production), then: the ``?`` count must equal the parameter count, sqlglot's
T-SQL parser must accept it without falling back to an opaque ``Command``, and the
locking hints the claim depends on must sit on the right table references. The
claim's chain rule is portable SQL, so it also runs on SQLite against
``outbox.domain.chains.plan_claim``, the rule's reference implementation.

One sqlglot limitation shapes these checks: in a multi-statement batch, sqlglot's
``IF`` swallows every statement after it into its block. Batches are therefore
built from statement lists (``insert_statements``, ``claim_statements``) and each
statement is parsed on its own; the whole batch is parsed as well, for syntax only.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlglot
from fake_dbapi import RecordingConnection, RecordingCursor
from sqlglot import exp
from tsql_support import parse_one

from outbox.commands.doctor import CONTRACT_COLUMNS
from outbox.core.errors import ConfigError, StoreError
from outbox.core.model import Holder, SilentHolder
from outbox.domain.chains import Candidate, plan_claim
from outbox.domain.events import prepare_event
from outbox.storage.engines.base import LEASE_EXPIRED_ERROR, MESSAGE_COLUMNS
from outbox.storage.engines.mssql import (
    DDL_LOCK_TIMEOUT_MS,
    FILTERED_INDEX_OPTIONS,
    ID_COLLATION,
    ID_LIST_SIZES,
    ID_PARAMS_PER_STATEMENT,
    INDEXES,
    MIGRATE_LOCK_TIMEOUT_MS,
    ONLINE_INDEX_EDITIONS,
    OPEN_ROWS,
    OPEN_ROWS_NORMALIZED,
    RETIRED_INDEXES,
    SQL_BIGINT,
    SQL_INTEGER,
    SQL_WVARCHAR,
    TRANSIENT_ERRORS,
    MssqlEngine,
    filter_sql,
    input_sizes,
    normalize_filter,
    odbc_connection_string,
    parse_target,
    rebuild_index_statements,
)
from outbox.storage.engines.mssql.engine import LOCK_TIMEOUT_SQL
from outbox.storage.engines.mssql.schema import lock_holders_sql
from outbox.storage.store import _DOUBTFUL, OutboxStore, apply_migration

URL = "mssql+pyodbc://relay:secret@db.example:1433/app?driver=ODBC+Driver+18+for+SQL+Server"
LOCK_HINTS = {"READCOMMITTEDLOCK", "READPAST", "UPDLOCK", "ROWLOCK"}
CLAIMED_ROW = (7, "m-7", "orders.created", "order", "42", None, '{"n":1}', '{"h":"v"}', None, 0,
               datetime(2024, 1, 2, 3, 4, 5), 1)


# -- recording fakes ------------------------------------------------------------------

def store_answer(sql: str) -> list[tuple]:
    """The few reads the store makes, answered."""
    if "LEFT JOIN @out" in sql:  # a claim batch's last SELECT
        return [CLAIMED_ROW]
    if sql.rstrip().endswith("SELECT @id AS id, @lock_result AS lock_result;"):
        return [(42, 0)]
    if sql.startswith("SELECT MIN(created_at)"):
        return [(None, datetime(2024, 1, 1))]
    if sql.startswith("SELECT status FROM"):
        return [(3,)]
    if sql.startswith("SELECT COUNT(*), MIN(claimed_at)"):
        return [(2, datetime(2024, 1, 1), datetime(2024, 1, 1, 0, 0, 5))]
    if sql == LOCK_TIMEOUT_SQL:
        return [(30_000,)]  # the session's, as set at connect
    return []


class StoreCursor(RecordingCursor):
    """Answers the few reads the store makes (``store_answer``), and every fenced write
    "applies" to all its rows, so the store logs no stale leases."""

    def __init__(self, log: list[tuple[str, tuple]] | None = None, sizes: list | None = None,
                 answers: dict[str, list[tuple]] | None = None) -> None:
        super().__init__(log, sizes, answers, default=store_answer)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> StoreCursor:
        super().execute(sql, params)
        id_lists = [json.loads(p) for p in params if isinstance(p, str) and p.startswith("[")]
        if id_lists:
            self.rowcount = len(id_lists[0])
        elif "id IN (?" in sql:  # the parameters inside the list: distinct ids (a padded list repeats one)
            before = sql[:sql.index("id IN (?")].count("?")
            inside = sql[sql.index("id IN (?"):].split(")", 1)[0].count("?")
            self.rowcount = len(set(params[before:before + inside]))
        else:
            self.rowcount = 1
        if "SET beat_at" in sql:
            self.rowcount = 0  # a holder's first beat: its record is inserted
        return self


class StoreConnection(RecordingConnection):
    cursor_class = StoreCursor


def autocommit_per_statement(conn: Any) -> list[tuple[str, bool]]:
    """(statement, whether the connection was in autocommit) for each statement run on
    ``conn`` (a ``recording_store``'s) from now on."""
    modes: list[tuple[str, bool]] = []
    execute = StoreCursor.execute

    class Watched(StoreCursor):
        def execute(self, sql: str, params: Sequence[Any] = ()) -> StoreCursor:
            modes.append((sql, conn.autocommit))
            return execute(self, sql, params)

    conn.cursor_class = Watched
    return modes


def recording_store(schema: str | None, table: str, compat_level: int | None = None,
                    answers: dict[str, list[tuple]] | None = None) -> tuple[OutboxStore, RecordingConnection]:
    store = OutboxStore(URL, table=table, schema=schema, claim_timeout_ms=30_000, max_attempts=5)
    conn = StoreConnection(answers)
    store.engine.connect = lambda url: conn  # type: ignore[method-assign]
    store.engine.compat_level = compat_level  # type: ignore[attr-defined]
    return store, conn


def every_statement(schema: str | None, table: str,
                    compat_level: int | None = None) -> tuple[MssqlEngine, list[tuple[str, tuple]]]:
    """Drive every store operation (and the write side) and return what reached the driver."""
    store, conn = recording_store(schema, table, compat_level)
    engine = store.engine
    assert isinstance(engine, MssqlEngine)
    store.migrate()
    store.migrate(native_json=True)
    event = prepare_event(topic="orders.created", aggregate_type="order", aggregate_id=42,
                          payload={"text": "x" * 5000}, headers={"h": "v"}, key="k", message_id="m-1")
    assert engine.insert_event(conn.cursor(), event) == 42
    claim = store.claim(50)
    engine.leased_rows(conn.cursor(), claim.lease, 60_000)  # a claim run again after its answer was lost
    store.mark_done([1, 2, 3], claim.lease)
    store.mark_done(list(range(1, 3001)), claim.lease)  # far over the 2100-parameter limit
    store.mark_failed(7, claim.lease, "broker said no", timedelta(seconds=5))
    store.mark_failed(7, claim.lease, "poison", dead=True)
    store.release([4, 5], claim.lease, delay=timedelta(seconds=2))
    store.release([4], claim.lease)
    store.purge_done(timedelta(days=90), batch=500)
    store.stats()
    store.dead_list(limit=10, after_id=3)
    store.dead_list(limit=10, topics=["orders.created", "orders.paid"])  # outbox dead list --topic
    store.requeue(topics=["orders.paid"])  # outbox dead requeue --topic, and with --force
    store.requeue(topics=["orders.paid"], force=True)
    store.requeue_dead()
    store.requeue_dead([8, 9])
    # Lost workers (docs/internals.md): a heartbeat, a takeover, an adoption, a graceful exit.
    holder = Holder("0123456789abcdef", "host-1", 42)
    store.holder_id = holder.holder_id
    store.beat(holder, 3000)
    store.take_over(SilentHolder(Holder("fedcba9876543210", "host-2", 7), 4.0), 3000)
    store.adopt([1, 2], claim.lease, store.new_lease())
    _DOUBTFUL[store._doubtful_key] = [claim.lease]  # a claim whose answer was lost and whose retries failed:
    store.claim(50)  # the next claim hands its rows back first (OutboxStore.release_doubtful)
    conn.answers[engine.held_by_sql()] = [(0, None, datetime(2024, 1, 1))]  # nothing left leased to it:
    assert store.drop_holder(holder.holder_id) == 0  # a graceful exit's record goes
    return engine, conn.log


@pytest.fixture(params=[(None, "outbox", 160), ("messaging", "events_out", 160), (None, "outbox", 110)],
                ids=["dbo.outbox", "messaging.events_out", "level-110"])
def recorded(request: pytest.FixtureRequest) -> tuple[MssqlEngine, list[tuple[str, tuple]]]:
    return every_statement(*request.param)


# -- parsing helpers --------------------------------------------------------------------

def placeholders(sql: str) -> int:
    """``?`` outside string literals."""
    return re.sub(r"N?'(?:[^']|'')*'", "", sql).count("?")


def statements_of(engine: MssqlEngine, sql: str) -> list[str]:
    """The statements a batch was built from (a single statement is its own list)."""
    if sql == engine.insert_batch():
        return engine.insert_statements()
    for own in (False, True):
        if sql == engine.claim_batch(own):
            return engine.claim_statements(own)
    if sql.startswith(FILTERED_INDEX_OPTIONS):
        options = [s.strip() + ";" for s in FILTERED_INDEX_OPTIONS.split(";") if s.strip()]
        for native_json in (False, True):
            for step in engine.migration_steps(native_json):
                statements = step[1] if isinstance(step, tuple) else step
                if sql == FILTERED_INDEX_OPTIONS + "\n" + "\n".join(statements):
                    return options + statements
        raise AssertionError(f"not a migration batch:\n{sql}")
    return [sql]


def outbox_refs(tree: exp.Expression, engine: MssqlEngine) -> list[exp.Table]:
    return [t for t in tree.find_all(exp.Table)
            if t.name == engine.table_name and t.db == (engine.schema or "dbo")]


def hints(table: exp.Table) -> set[str]:
    return {v.name.upper() for h in table.args.get("hints") or [] for v in h.expressions}


# -- every statement: parameters and syntax ------------------------------------------------

def test_every_statement_binds_as_many_parameters_as_it_has_placeholders(recorded: Any) -> None:
    engine, log = recorded
    assert len(log) >= 25
    for sql, params in log:
        assert placeholders(sql) == len(params), sql


def test_every_statement_parses_as_tsql(recorded: Any, no_sqlglot_fallbacks: None) -> None:
    engine, log = recorded
    seen = set()
    for sql, _ in log:
        if sql in seen:
            continue
        seen.add(sql)
        assert sqlglot.parse(sql, read="tsql"), sql  # the batch as sent, syntax only
        parts = statements_of(engine, sql)
        assert "\n".join(parts) == sql or sql.startswith(FILTERED_INDEX_OPTIONS)
        for statement in parts:
            parse_one(statement)


def test_the_recording_covers_every_kind_of_statement(recorded: Any) -> None:
    engine, log = recorded
    sent = [sql for sql, _ in log]
    t = engine.table
    for needle in (engine.insert_batch(), engine.claim_batch(own_transaction=True), engine.mark_failed_sql(),
                   engine.purge_chunk_sql(),
                   # requeue_dead(): a chunk of dead rows at a time (issue 20 item 7)
                   engine.limit(f"SELECT id, topic FROM {t} WITH (READCOMMITTEDLOCK, READPAST) WHERE status = 4 "
                                "AND id > ? AND 1 = 1 ORDER BY id"),
                   f"SELECT status, COUNT(*) FROM {t} WITH (READUNCOMMITTED) GROUP BY status"):  # never waits
        assert needle in sent, needle
    assert any(s.startswith(f"UPDATE {t} SET status = 2") for s in sent)  # mark_done
    assert any(s.startswith(f"UPDATE {t} SET status = 0, claimed_at") for s in sent)  # release
    assert any(s.endswith("OFFSET 0 ROWS FETCH NEXT ? ROWS ONLY") for s in sent)  # dead_list
    for needle in (engine.silent_holders_sql(), engine.drop_silent_holder_sql(), engine.held_by_sql(),
                   engine.end_leases_sql(), engine.drop_holder_sql(), engine.release_lease_sql()):
        assert needle in sent, needle
    # A doubtful lease's rows are handed back past rows others lock, as a lost holder's leases end.
    assert "WITH (READCOMMITTEDLOCK, READPAST, ROWLOCK)" in engine.release_lease_sql()
    h = engine.holders
    assert any(s.startswith(f"UPDATE {h} SET beat_at") for s in sent)
    assert any(s.startswith(f"INSERT INTO {h} (holder_id") for s in sent)
    assert any(s.startswith(f"UPDATE {t} SET lease_token = ?, claimed_at") for s in sent)  # adopt
    for native_json in (False, True):
        for step in engine.migration(native_json=native_json):
            if isinstance(step, tuple):  # ((definition probe, params), repair): no row -> repair runs
                (probe, _), step = step
                assert probe in sent
            assert step in sent


def test_no_statement_manages_transactions_or_isolation(recorded: Any) -> None:
    """Only the enqueue batch and the claim run alone begin and commit a transaction, and
    only their own: the enqueue's when the caller has none (issue 20 item 3), the claim's
    when the store runs it alone (issue 19 item 2: ``test_the_claim_commits_in_its_own_batch_
    when_run_alone``). Nothing sets an isolation level or rolls back."""
    engine, log = recorded
    forbidden = re.compile(r"\b(BEGIN\s+TRAN|COMMIT|ROLLBACK|SAVE\s+TRAN|ISOLATION\s+LEVEL)", re.IGNORECASE)
    for sql, _ in log:
        if sql in (engine.insert_batch(), engine.claim_batch(own_transaction=True)):
            continue
        assert not forbidden.search(sql), sql
    assert not re.search(r"ROLLBACK|ISOLATION", engine.claim_batch(own_transaction=True))
    statements = engine.insert_statements()
    managing = [s for s in statements if forbidden.search(s)]
    assert len(managing) == 2, managing
    begin, commit = managing
    assert begin.startswith("IF @id IS NULL AND @@TRANCOUNT = 0\nBEGIN") and "SET @own_transaction = 1;" in begin
    assert "BEGIN TRANSACTION;" in begin and "COMMIT" not in begin
    assert commit.startswith("IF @own_transaction = 1") and "COMMIT TRANSACTION" in commit
    assert "ROLLBACK" not in engine.insert_batch() and "ISOLATION" not in engine.insert_batch()


# -- the claim ------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, table", [(None, "outbox"), ("messaging", "events_out")])
def test_claim_locks_candidates_and_probes_without_readpast(schema: str | None, table: str,
                                                             no_sqlglot_fallbacks: None) -> None:
    engine = MssqlEngine(table=table, schema=schema)
    statements = engine.claim_statements()
    scan = next(s for s in statements if s.startswith("INSERT INTO @cand"))
    probe = next(s for s in statements if s.startswith("INSERT INTO @agg"))
    scan_refs = outbox_refs(parse_one(scan), engine)
    assert len(scan_refs) == 1 and hints(scan_refs[0]) == LOCK_HINTS | {"FORCESEEK"}
    probe_refs = outbox_refs(parse_one(probe), engine)
    assert len(probe_refs) == 1 and hints(probe_refs[0]) == {"READCOMMITTEDLOCK", "FORCESEEK"}
    # The chains are chosen first: the window read without update locks, the free heads
    # locked skipping those another claim holds; READPAST is in those reads only, never in
    # a probe (the window's probe reads as the candidates' does).
    window = next(s for s in statements if s.startswith("INSERT INTO @win"))
    window_refs = outbox_refs(parse_one(window), engine)  # two walks: rows without a time, due rows
    assert len(window_refs) == 2 and all(hints(r) == {"READCOMMITTEDLOCK", "READPAST", "ROWLOCK"} for r in window_refs)
    heads = next(s for s in statements if s.startswith("INSERT INTO @held"))
    (heads_ref,) = outbox_refs(parse_one(heads), engine)
    assert hints(heads_ref) == LOCK_HINTS | {"FORCESEEK"} and "SELECT TOP (@heads) o.id FROM @free" in heads
    assert heads.rstrip(";").endswith("ORDER BY f.head")  # @free's key order: no sort over every head
    free = next(s for s in statements if s.startswith("INSERT INTO @free"))
    (free_ref,) = outbox_refs(parse_one(free), engine)
    assert hints(free_ref) == {"READCOMMITTEDLOCK", "FORCESEEK"} and "FROM @win" in free
    assert engine.claim_batch().count("READPAST") == 4  # the window's two walks, the heads, the candidates
    update = parse_one(next(s for s in statements if s.startswith("UPDATE")))
    assert isinstance(update, exp.Update)
    assert "INTO @out" in update.sql("tsql")  # OUTPUT ... INTO a table variable, never bare OUTPUT


@pytest.mark.parametrize("own_transaction", [False, True])
def test_a_claim_that_reads_past_blocked_rows_binds_alike_and_only_chooses_with_readpast(
        own_transaction: bool, no_sqlglot_fallbacks: None) -> None:
    """``read_past`` (``Engine.claim``): only ``@win`` changes. It reads up to
    ``BLOCKED_SCAN`` windows of eligible rows and keeps those whose aggregate's first open
    row (``@behind`` left out) is eligible, a TOP (1) seek on the ordering probe's index
    that reads past locked rows: it only chooses the window, the probes and locks after it
    are those of every claim. Same parameters as the plain claim."""
    engine = MssqlEngine(table="outbox")
    plain = engine.claim_statements(own_transaction)
    past = engine.claim_statements(own_transaction, read_past=True)
    assert [s for s in past if not s.startswith("INSERT INTO @win")] == [
        s for s in plain if not s.startswith("INSERT INTO @win")]
    params = engine.claim_params(10, "f" * 32, 60_000, 3, [7])
    assert engine.claim_batch(own_transaction, read_past=True).count("?") == len(params)
    window = next(s for s in past if s.startswith("INSERT INTO @win"))
    refs = outbox_refs(parse_one(window), engine)  # the window's two walks, the probe
    assert sorted(sorted(hints(r)) for r in refs) == [["FORCESEEK", "READCOMMITTEDLOCK", "READPAST"]] + [
        ["READCOMMITTEDLOCK", "READPAST", "ROWLOCK"]] * 2
    assert f"TOP (@window * {engine.BLOCKED_SCAN})" in window and "SELECT TOP (1) e.status" in window
    assert "FROM @behind AS b WHERE b.id = e.id" in window and window.rstrip(";").endswith("ORDER BY s.id")


@pytest.mark.parametrize("full", [False, True])
def test_an_empty_claim_reads_past_only_a_window_that_was_full(full: bool, no_sqlglot_fallbacks: None) -> None:
    """``Engine.claim_pass`` (docs/internals.md, "Claim windows"): the batch's last SELECT
    answers the leased rows, or, having leased nothing, one row of NULLs when ``@win`` held a
    whole window (``@window``) and none when it held less. The claim reads past the window
    only after that row, in a second batch (``read_past``), and never hands the row on."""
    nulls = [(None,) * len(CLAIMED_ROW)]
    store, conn = recording_store(None, "outbox", 160, answers={"LEFT JOIN @out": nulls if full else []})
    engine = store.engine
    assert isinstance(engine, MssqlEngine)
    assert store.claim(10).messages == []
    batches = [sql for sql, _ in conn.log if "@out" in sql]
    assert batches == [engine.claim_batch(True), *([engine.claim_batch(True, read_past=True)] if full else [])]
    statement = engine.claim_statements(True)[-1]
    assert statement.endswith("\nWHERE o.id IS NOT NULL OR (SELECT COUNT(*) FROM @win) >= @window ORDER BY o.id;")
    assert [c.alias_or_name for c in parse_one(statement).expressions] == list(MESSAGE_COLUMNS)


@pytest.mark.parametrize("read_past", [False, True])
def test_the_claims_window_reads_no_row_waiting_for_a_later_time(read_past: bool,
                                                                 no_sqlglot_fallbacks: None) -> None:
    """docs/internals.md, "Rows waiting for a later time are not read": the window walked
    claim_ready (id) over every open row, past every failed row whose retry was not due. Now
    claim_ready's keys start with next_retry_at and each of the window's reads of the table
    is one seek of it: the rows without a time (IS NULL, in the index's order) or the due
    ones (a range up to now), each stopped after the window."""
    from outbox.storage.engines.mssql import INDEXES

    engine = MssqlEngine(table="outbox")
    assert next(i for i in INDEXES if i.suffix == "claim_ready").keys == ("next_retry_at", "id")
    window = next(s for s in engine.claim_statements(read_past=read_past) if s.startswith("INSERT INTO @win"))
    sources = [(select, select.args.get("from") or select.args.get("from_")) for select in
               parse_one(window).find_all(exp.Select)]
    walks = [select for select, source in sources if source is not None and isinstance(source.this, exp.Table)
             and source.this in outbox_refs(source, engine)
             and hints(source.this) == {"READCOMMITTEDLOCK", "READPAST", "ROWLOCK"}]
    assert len(walks) == 2
    assert sorted(w.args["where"].this.sql("tsql").split(" AND ")[-1] for w in walks) == [
        "next_retry_at <= SYSUTCDATETIME()", "next_retry_at IS NULL"]
    size = "@window" if not read_past else f"@window * {engine.BLOCKED_SCAN}"
    assert window.count(f"SELECT TOP ({size}) id, ") == 2  # each walk stopped after the window


@pytest.mark.parametrize("read_past", [False, True])
def test_the_claims_window_keeps_one_row_per_id_whatever_both_walks_read(read_past: bool,
                                                                         no_sqlglot_fallbacks: None) -> None:
    """Review of 7 December: the window's two walks read claim_ready (next_retry_at, id) under
    locking READ COMMITTED (READCOMMITTEDLOCK, READPAST: each row's S lock is let go once read),
    and next_retry_at, a key now, changes while they read: a due row read by one walk can be
    claimed and released at once by another relay (next_retry_at NULL, pending) before the
    other walk reaches its id, and is read again there (no snapshot: the lock hint is what
    makes the read see committed rows as they are now). Both reads went into @win, whose
    PRIMARY KEY (id) refused the second: error 2627 failed the whole claim. The rows of both
    walks are now kept once per id (GROUP BY id before the TOP), in either window."""
    engine = MssqlEngine(table="outbox")
    window = next(s for s in engine.claim_statements(read_past=read_past) if s.startswith("INSERT INTO @win"))
    (union,) = list(parse_one(window).find_all(exp.Union))
    assert union.args.get("distinct") is False  # UNION ALL: the walks' rows are not made unique there
    oldest = union.find_ancestor(exp.Select)  # the SELECT TOP (...) ... ORDER BY id over both walks
    group = oldest.args.get("group")
    assert group is not None and [e.sql("tsql") for e in group.expressions] == ["w.id"]
    assert oldest.args["order"].sql("tsql") == "ORDER BY w.id"
    assert [c.alias_or_name for c in oldest.expressions] == ["id", "aggregate_id", "status", "attempts"]


def test_the_claim_is_linear_in_a_hot_aggregates_window(no_sqlglot_fallbacks: None) -> None:
    """Issue 20 item 9: the probe ran per candidate and read the k-1 earlier rows of the
    k-th candidate of a hot aggregate, and rules 2 and 3 were self-joins of @cand doing the
    same (about 8 million probe rows per claim at batch 1,000; past the query timeout at
    10,000). Now: one TOP (1) probe per aggregate of @cand, pinned to a seek of the agg_open
    index; the rules are running sums over one read of @cand (no self-join); the batch cut
    is one numbering pass over @chain (no join)."""
    engine = MssqlEngine()
    statements = engine.claim_statements()
    probe = parse_one(next(s for s in statements if s.startswith("INSERT INTO @agg")))
    (ref,) = outbox_refs(probe, engine)
    (forceseek,) = [h for hint in ref.args["hints"] for h in hint.expressions if h.name.upper() == "FORCESEEK"]
    assert forceseek.sql("tsql").upper() == "FORCESEEK([IX_OUTBOX_AGG_OPEN](AGGREGATE_ID))"
    walk = ref.find_ancestor(exp.Select)  # the correlated scalar subquery: TOP (1) in id order
    assert walk.args["limit"].expression.sql("tsql") == "1" and walk.args["order"].sql("tsql") == "ORDER BY e.id"
    assert "e.aggregate_id = g.aggregate_id AND e.id < g.last_id" in walk.sql("tsql")
    outer = walk.parent.find_ancestor(exp.Select)
    source = outer.args.get("from_") or outer.args["from"]  # the key's name differs across sqlglot versions
    assert source.this.alias == "g"  # over FROM (... GROUP BY aggregate_id) AS g: once per aggregate
    assert source.this.this.args["group"].sql("tsql") == "GROUP BY aggregate_id"
    assert sorted(t.name for t in probe.find_all(exp.Table) if t.name != engine.table_name) == ["agg", "behind", "cand", "cand"]
    chain = parse_one(next(s for s in statements if s.startswith("INSERT INTO @chain")))
    assert sorted(t.name for t in chain.find_all(exp.Table)) == ["agg", "cand", "chain"]  # each once, no self-join
    windows = [w.sql("tsql") for w in chain.find_all(exp.Window)]
    assert len(windows) == 2 and all("ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW" in w for w in windows)
    keep = parse_one(next(s for s in statements if s.startswith("WITH ranked")))
    assert isinstance(keep, exp.Delete) and [t.name for t in keep.find_all(exp.Table)].count("ranked") == 1
    assert "JOIN" not in keep.sql("tsql").upper() and " IN (" not in keep.sql("tsql").upper()


@pytest.mark.parametrize("read_past", [False, True])
def test_a_null_aggregate_id_is_filed_under_a_key_of_its_own_in_the_claims_table_variables(
        read_past: bool, no_sqlglot_fallbacks: None) -> None:
    """Found in review: ``@win`` and ``@cand`` declare aggregate_id NOT NULL, so one row with a
    NULL aggregate_id (a table made by another script) failed every claim while it was among
    the oldest. Each insert into them files such a row under a key of its own, made from its
    id; the probes, which compare with the table, find nothing before it."""
    statements = MssqlEngine().claim_statements(own_transaction=True, read_past=read_past)
    for variable in ("@win", "@cand"):
        insert = parse_one(next(s for s in statements if s.startswith(f"INSERT INTO {variable} ")))
        keys = [c for c in insert.find_all(exp.Coalesce) if c.this.name == "aggregate_id"]
        assert len(keys) == (2 if variable == "@win" else 1), insert.sql("tsql")  # @win: each of its two walks
        fallback = keys[0].expressions[0].sql("tsql")
        assert "outbox:null-aggregate_id:" in fallback and "CAST(" in fallback and "id AS NVARCHAR(20)" in fallback


def test_the_probe_falls_back_to_any_seek_when_its_index_is_missing() -> None:
    """A table that has not been migrated yet (start-up warns) keeps claiming: naming a
    missing index in FORCESEEK would fail every claim (error 308)."""
    store, conn = recording_store(None, "outbox", 160)  # the recording finds no index definition
    store.claim(10)
    engine = store.engine
    assert engine.probe_index is False  # type: ignore[attr-defined]
    claim = next(sql for sql, _ in conn.log if sql.startswith("DECLARE @nocount"))
    assert "WITH (READCOMMITTEDLOCK, FORCESEEK)" in claim and "ix_outbox_agg_open" not in claim
    present, conn = recording_store(None, "outbox", 160, answers={"AND i.name = N'ix_outbox_agg_open'": [(1,)]})
    present.claim(10)
    claim = next(sql for sql, _ in conn.log if sql.startswith("DECLARE @nocount"))
    assert "FORCESEEK ([ix_outbox_agg_open] (aggregate_id))" in claim
    assert sum("AND i.name = N'ix_outbox_agg_open'" in sql for sql, _ in conn.log) == 1  # read once
    present.claim(10)
    assert sum("AND i.name = N'ix_outbox_agg_open'" in sql for sql, _ in conn.log) == 1


def test_claim_returns_message_columns_in_order_and_binds_in_placeholder_order() -> None:
    engine = MssqlEngine()
    statements = engine.claim_statements()
    assert statements[-1].startswith(f"SELECT {', '.join('o.' + c for c in MESSAGE_COLUMNS)} FROM (VALUES (0)) AS one (n) "
                                     "LEFT JOIN @out AS o ON 1 = 1\n")
    declared = re.search(r"DECLARE @out TABLE \((.*)\);", engine.claim_batch()).group(1)
    assert [c.split()[0] for c in re.split(r",\s*(?![^()]*\))", declared)] == list(MESSAGE_COLUMNS)
    params = engine.claim_params(batch=50, lease="L" * 32, timeout_ms=30_000, max_attempts=5)
    assert params == [50, 50 * engine.CLAIM_WINDOW, 5, "L" * 32, LEASE_EXPIRED_ERROR, -30_000, "[]"]
    assert engine.claim_params(50, "L" * 32, 30_000, 5, behind=[9, 3, 9])[-1] == "[3, 9]"
    # The DECLARE binds all seven by name; eligible()'s lease cutoff, the sixth, is used four times.
    batch = engine.claim_batch()
    declare = next(s for s in statements if s.startswith("DECLARE @batch"))
    assert re.findall(r"@(\w+) [A-Z]+(?:\((?:\d+|MAX)\))? = \?", declare) == ["batch", "window", "max_attempts", "lease",
                                                                           "lease_error", "expired_ms",
                                                                           "behind_ids"]
    assert batch.count("DATEADD(MILLISECOND, @expired_ms, SYSUTCDATETIME())") == 4
    assert placeholders(batch) == len(params)


def test_claim_through_the_store_hands_back_messages() -> None:
    store, conn = recording_store(None, "outbox")
    claim = store.claim(10)
    assert [m.id for m in claim.messages] == [7]
    message = claim.messages[0]
    assert message.payload == '{"n":1}' and message.headers == {"h": "v"}
    assert message.created_at.tzinfo is not None  # naive DATETIME2 read as UTC
    sql, params = conn.log[-1]
    # The store runs the claim alone (autocommit): the batch commits its own transaction.
    assert sql == store.engine.claim_batch(own_transaction=True) and params[3] == claim.lease
    assert conn.autocommit is False  # put back after the claim


def test_the_fenced_writes_beat_and_takeover_run_alone_so_no_cut_leaves_a_row_locked_for_its_commit(
        no_sqlglot_fallbacks: None) -> None:
    """docs/sqlserver.md, "Known limit": a relay session cut between a mark_failed UPDATE that
    took a row out of agg_open and its COMMIT left the key locked, and every claim's probe
    waited on it until the server dropped the session. mark_done, release and mark_failed
    now each run on the connection in autocommit (every statement committed as it runs)."""
    store, conn = recording_store(None, "outbox")
    modes = autocommit_per_statement(conn)
    store.mark_done([1, 2], "L" * 32)
    store.release([3], "L" * 32)
    store.mark_failed(4, "L" * 32, "broker said no", timedelta(seconds=5))
    store.mark_failed(5, "L" * 32, "poison", dead=True)
    writes = [(sql, alone) for sql, alone in modes if sql.startswith("UPDATE [dbo].[outbox] SET status")]
    assert len(writes) == 4 and all(alone for _, alone in writes), writes
    del modes[:]
    store.adopt([6, 7], "L" * 32, "M" * 32)  # a publish task run by another process than the claimer
    assert modes and all(alone for _, alone in modes), modes
    # The heartbeat too; and its read of the silent holders reads past a holder's record
    # locked by a beat (one cut off before its COMMIT made every other beat wait and fail).
    store.beat(Holder("h-1", "host", 1), 5000)
    beats = [(sql, alone) for sql, alone in modes if "[dbo].[outbox_holders]" in sql]
    assert beats and all(alone for _, alone in beats), beats
    # A takeover too (SQL Server ends no idle transaction: one cut before its COMMIT held the
    # lost holder's rows locked past their lease); its statements in order, each alone.
    del modes[:]
    assert store.take_over(SilentHolder(Holder("fedcba9876543210", "host-2", 7), 4.0), 3000) is not None
    engine = store.engine
    assert [sql for sql, _ in modes] == [engine.drop_silent_holder_sql(), engine.held_by_sql(), engine.end_leases_sql()]
    assert all(alone for _, alone in modes), modes
    assert "FROM [dbo].[outbox_holders] WITH (READCOMMITTEDLOCK, READPAST) WHERE" in store.engine.silent_holders_sql()
    parse_one(store.engine.silent_holders_sql())
    assert conn.autocommit is False  # put back after each


@pytest.mark.parametrize("level", [120, 160])
def test_chunked_acks_and_every_requeue_run_alone_too(level: int, no_sqlglot_fallbacks: None) -> None:
    """Found in review (6 December): below level 130, ``mark_done`` and ``release`` of more
    than 2,000 ids (two UPDATEs) ran as one transaction, and so did every requeue (its SELECT,
    then its UPDATEs). A session cut or suspended before that COMMIT kept the rows'
    ``agg_open`` keys locked, and every claim's probe waited on them, failed with 1222 and
    tried again until the server dropped the session. Now every UPDATE of the table commits
    as it runs (the connection in autocommit), each chunk of an ack a transaction of its own."""
    ids = list(range(1, 3001))
    dead = [(i, f"m-{i}", "t", "o", "a", 3, "retriable: no queue", None, 4) for i in ids]
    store, conn = recording_store(None, "outbox", level, answers={
        "processed_at, status FROM": dead,  # requeue's look at the ids: all dead
        "SELECT id, topic FROM": [(1, "t"), (2, "t")],  # requeue --all's chunk
        "SELECT topic, COUNT(*) FROM": [("t", 1)]})
    modes = autocommit_per_statement(conn)
    commits = conn.commits
    assert store.mark_done(ids, "L" * 32).ok and store.release(ids, "L" * 32).ok
    chunks = 2 if level < 130 else 1
    assert conn.commits - commits == 2 * chunks  # each chunk its own transaction
    assert store.requeue(ids).requeued == {"t": len(ids)}
    assert store.requeue(ids, all_or_nothing=False, chunk=len(ids)).requeued == {"t": len(ids)}
    assert store.requeue(None).requeued == {"t": 2} and store.requeue(None, force=True).requeued == {"t": 2}
    assert store.requeue_dead(ids) == len(ids) and store.requeue_dead() == 2
    writes = [(sql, alone) for sql, alone in modes if sql.startswith("UPDATE [dbo].[outbox] SET")]
    assert len(writes) == 5 * chunks + 3, writes  # the acks, requeue of ids (twice), --all (twice), requeue_dead
    assert all(alone for _, alone in writes), [sql[:60] for sql, alone in writes if not alone]
    for sql in {sql for sql, _ in writes}:
        parse_one(sql)
    assert conn.autocommit is False  # put back after each


def test_a_requeue_of_ids_retried_after_its_first_update_committed_still_requeues_them_all() -> None:
    """Run alone, the first of two requeue UPDATEs (level 120, 3,000 ids) commits before the
    second fails with a deadlock; the try run again finds those rows pending. It takes them
    as requeued by this call, not as "not dead" (which would have refused the rest)."""
    ids = list(range(1, 3001))
    status = dict.fromkeys(ids, 4)
    failed: list[int] = []

    class Rows(StoreCursor):
        def execute(self, sql: str, params: Sequence[Any] = ()) -> StoreCursor:
            super().execute(sql, params)
            if "processed_at, status FROM" in sql:
                self.rows = [(i, f"m-{i}", "t", "o", "a", 3, "retriable: x", None, status[i])
                             for i in sorted(set(params))]
            elif sql.startswith("UPDATE [dbo].[outbox] SET status = 0"):
                if 3000 in params and not failed:
                    failed.append(1)
                    raise _PyodbcError("40001", "[SQL Server]Transaction (Process ID 52) was deadlocked (1205)")
                status.update(dict.fromkeys(params, 0))
            return self

    store, conn = recording_store(None, "outbox", 120)
    conn.cursor_class = Rows
    result = store.requeue(ids)
    assert failed and result.requeued == {"t": 3000} and not result.not_dead, result.not_dead.keys()
    assert set(status.values()) == {0}


def test_the_claim_commits_in_its_own_batch_when_run_alone(no_sqlglot_fallbacks: None) -> None:
    """Issue 19 item 2: claim and COMMIT in one round trip. Run alone (autocommit), the batch
    opens its transaction after XACT_ABORT is on and commits it right after the UPDATE,
    before the result is sent: a client cut while reading it holds no lock. In a caller's
    transaction it neither begins nor commits one."""
    engine = MssqlEngine()
    own = engine.claim_statements(own_transaction=True)
    plain = engine.claim_statements()
    assert [s for s in own if s not in ("BEGIN TRANSACTION;", "COMMIT TRANSACTION;")] == plain
    assert not any("TRANSACTION" in s and s.startswith(("BEGIN", "COMMIT")) for s in plain)
    begin, commit = own.index("BEGIN TRANSACTION;"), own.index("COMMIT TRANSACTION;")
    assert own.index("SET XACT_ABORT ON;") < begin < own.index(next(s for s in own if s.startswith("INSERT INTO @cand")))
    update = next(i for i, s in enumerate(own) if s.startswith("UPDATE o SET"))
    assert commit == update + 1 and commit < own.index(next(s for s in own if "LEFT JOIN @out" in s))
    for statement in own:
        parse_one(statement) if not statement.startswith("IF ") else None
    assert MssqlEngine.one_statement_claim
    conn = StoreConnection()
    conn.autocommit = False  # type: ignore[attr-defined]
    with engine.statement_alone(conn):
        assert conn.autocommit is True  # type: ignore[attr-defined]
    assert conn.autocommit is False  # type: ignore[attr-defined]


#: What the claim meets when an index its hints name is gone: by number (pyodbc), by words
#: (mssql-python); and another error, after which the index is still known.
CLAIM_ERRORS = {
    "pyodbc": "('42000', \"[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Index "
              "'ix_outbox_agg_open' on table 'dbo.outbox' (specified in the FROM clause) does not exist. "
              "(308) (SQLExecDirectW)\")",
    "mssql-python": "Driver Error: Syntax error or access violation; DDBC Error: [Microsoft][SQL Server]Index "
                    "'ix_outbox_agg_open' on table 'dbo.outbox' (specified in the FROM clause) does not exist.",
    # Error 315: a hint names a disabled index (ALTER INDEX ... DISABLE while the relay ran).
    "pyodbc-disabled": "('42000', '[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Index "
                       "\"ix_outbox_agg_open\" on table \"dbo.outbox\" (specified in the FROM clause) is disabled or "
                       "resides in a filegroup which is not online. (315) (SQLExecDirectW)')",
    "mssql-python-disabled": "Driver Error: Syntax error or access violation; DDBC Error: [Microsoft][SQL Server]Index "
                             "\"ix_outbox_agg_open\" on table \"dbo.outbox\" (specified in the FROM clause) is disabled "
                             "or resides in a filegroup which is not online.",
    # Error 8655 when a hint forces a disabled index (Microsoft's upgrade notes), 8622 when a
    # FORCESEEK finds no enabled index to seek: the claim forgot the index on neither (found in review).
    "pyodbc-forced": "('42000', \"[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]The query processor "
                     "is unable to produce a plan because the index 'ix_outbox_agg_open' on table or view 'outbox' is "
                     "disabled. (8655) (SQLExecDirectW)\")",
    "mssql-python-no-seek": "Driver Error: Syntax error or access violation; DDBC Error: [Microsoft][SQL Server]Query "
                            "processor could not produce a query plan because of the hints defined in this query. "
                            "Resubmit the query without specifying any hints and without using SET FORCEPLAN.",
    "deadlock": "('40001', '[40001] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Transaction (Process "
                "ID 52) was deadlocked on lock resources with another process and has been chosen as the "
                "deadlock victim. Rerun the transaction. (1205) (SQLExecDirectW)')",
}


class RefusingClaims(RecordingCursor):
    """Raises ``error`` (a class attribute) when the claim batch runs."""

    error = ""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> RecordingCursor:
        super().execute(sql, params)
        if "UPDATE o SET" in sql:
            raise RuntimeError(self.error)
        return self


@pytest.mark.parametrize("driver", list(CLAIM_ERRORS))
def test_a_claim_that_finds_the_probes_index_gone_asks_for_it_again_next_time(
        driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Doubtful point 5 of docs/sqlserver.md's second reading: the claim remembers whether
    agg_open exists and names it in a hint, so an index dropped while the relay ran (the
    procedure under "Collations") failed every claim with error 308 until `outbox migrate`.
    Now the claim that meets error 308 forgets what it knew, and the next claim asks again;
    another error leaves it known. The session is put back either way. An index disabled
    while the relay ran failed every claim the same way (error 315; found in review): the
    claim forgets it too, and the next asks again (``index_matches`` finds no disabled index); so
    after 8655 (a hint forcing a disabled index) and 8622 (no index left to seek), which it did not."""
    engine = MssqlEngine()
    engine.probe_index, engine.id_collation = True, "Latin1_General_100_CI_AS"
    monkeypatch.setattr(RefusingClaims, "error", CLAIM_ERRORS[driver])
    conn = RecordingConnection()
    conn.cursor_class = RefusingClaims
    with pytest.raises(RuntimeError):
        engine.claim(conn.cursor(), 10, "L" * 32, 30_000, 5)
    assert engine.probe_index is (True if driver == "deadlock" else None)
    assert conn.log[-1][0] == "SET XACT_ABORT ON; SET NOCOUNT OFF;"
    if driver != "deadlock":
        assert "FORCESEEK ([ix_outbox_agg_open]" in engine.claim_batch()
        engine.claim(RecordingCursor(), 10, "L" * 32, 30_000, 5)  # asks again: the index is gone
        assert engine.probe_index is False and "FORCESEEK ([ix_outbox_agg_open]" not in engine.claim_batch()


def test_batches_with_results_silence_rowcounts_first_and_restore_them_before_the_result(
        no_sqlglot_fallbacks: None) -> None:
    engine = MssqlEngine()
    for statements in (engine.insert_statements(), engine.claim_statements()):
        first_set = statements.index("SET NOCOUNT ON;")
        assert all(s.startswith("DECLARE @nocount INT = @@OPTIONS & 512") for s in statements[:first_set])
        assert first_set == 1
        # Nothing but the restore stands between the last change and the one result set.
        assert isinstance(parse_one(statements[-1]), exp.Select)
        assert statements[-2].startswith("IF @nocount = 0") and "SET NOCOUNT OFF" in statements[-2]
        results = [s for s in statements if isinstance(parse_one(s), exp.Select) and not re.match(r"SELECT @\w+ =", s)]
        assert results == [statements[-1]]


# -- the write side ---------------------------------------------------------------------------

def test_insert_takes_no_key_range_locks_and_serializes_only_the_same_message_id(no_sqlglot_fallbacks: None) -> None:
    """Fault 6: the duplicate probe was UPDLOCK, HOLDLOCK (a key-range lock on the gap,
    held for the caller's whole transaction). Now every read of the table is a plain
    seek, and the same message_id is serialized by an application lock on its hash."""
    engine = MssqlEngine(table="events_out", schema="messaging")
    statements = engine.insert_statements()
    batch = engine.insert_batch()
    for forbidden in ("HOLDLOCK", "UPDLOCK", "SERIALIZABLE", "IGNORE_DUP_KEY", "XACT_ABORT", "BEGIN TRY"):
        assert forbidden not in batch, forbidden
    lookup = next(s for s in statements if s.startswith("SELECT @id = o.id"))
    lock = next(s for s in statements if "@LockMode = N'Exclusive'" in s)
    assert lock.startswith("IF @id IS NULL") and statements.index(lock) > statements.index(lookup)
    resource = next(s for s in statements if s.startswith("SET @lock_resource"))
    assert "HASHBYTES('SHA2_256', N'[messaging].[events_out]|' + CONVERT(NVARCHAR(11), @lock_key))" in resource
    insert = next(s for s in statements if "INSERT INTO" in s)
    assert insert.startswith("IF @id IS NULL AND @lock_result >= 0")
    assert statements.index(insert) > statements.index(lock)
    assert "OUTPUT inserted.id INTO @ids" in insert
    assert placeholders(batch) == len(engine.INSERT_COLUMNS.split(","))


def test_insert_reads_the_table_with_readcommittedlock_whatever_the_callers_isolation(
        no_sqlglot_fallbacks: None) -> None:
    """Issue 20 item 1: the fast-path lookup and the final one read at the caller's level:
    at READ UNCOMMITTED the lookup returned another transaction's uncommitted row (lost
    when it rolled back); at SNAPSHOT it missed a newer committed row and the insert raised
    2601. Every reference to the table now carries READCOMMITTEDLOCK, and nothing else."""
    engine = MssqlEngine(table="events_out", schema="messaging")
    refs = [(statement, ref) for statement in engine.insert_statements()
            for ref in outbox_refs(parse_one(statement), engine)]
    assert len(refs) == 4  # the lookup, the insert's target and its NOT EXISTS, the final lookup
    reads = [(statement, ref) for statement, ref in refs if not isinstance(ref.parent, exp.Schema)]
    assert len(reads) == 3  # all but the INSERT's target
    for statement, ref in reads:
        assert hints(ref) == {"READCOMMITTEDLOCK"}, statement


def test_the_enqueue_lock_key_is_what_the_unique_index_compares(no_sqlglot_fallbacks: None) -> None:
    """Issue 20 item 2: the key was a SHA-256 of the exact message id, but the unique index
    compares with SQL Server's equality (trailing spaces ignored; case too on a hand-made
    case-insensitive column): ``m1`` and ``m1 `` took different locks and the second raised
    2601 into the caller's transaction. The key is now CHECKSUM of the id in the column's
    own collation (COALESCE with the column: the column's implicit collation wins over the
    variable's), which is equal for every two values the ``=`` operator finds equal."""
    engine = MssqlEngine()
    statements = engine.insert_statements()
    lookup = next(s for s in statements if s.startswith("SELECT @id = o.id"))
    tree = parse_one(lookup)
    (checksum,) = [f for f in tree.find_all(exp.Anonymous) if f.name.upper() == "CHECKSUM"]
    (coalesce,) = checksum.expressions
    assert isinstance(coalesce, exp.Coalesce)
    assert [arg.sql("tsql") for arg in (coalesce.this, *coalesce.expressions)] == ["o.message_id", "@message_id"]
    assert checksum.parent.sql("tsql") == "@lock_key = CHECKSUM(COALESCE(o.message_id, @message_id))"
    (ref,) = outbox_refs(tree, engine)
    join = ref.parent
    assert isinstance(join, exp.Join) and join.side == "LEFT" and ref.alias == "o"
    assert "@message_id" not in next(s for s in statements if s.startswith("SET @lock_resource"))
    assert "HASHBYTES('SHA2_256', N'[dbo].[outbox]|' + @message_id)" not in engine.insert_batch()


def test_the_enqueue_lock_is_never_owned_by_the_session(no_sqlglot_fallbacks: None) -> None:
    """Issue 20 item 3: on an autocommit connection the lock was session-owned and released
    by a later statement of the batch; an error or a client timeout in between leaked it for
    the life of a pooled connection. Now every lock is transaction-owned: with no
    transaction open, the batch opens its own around the lock and the insert."""
    engine = MssqlEngine()
    statements = engine.insert_statements()
    batch = engine.insert_batch()
    assert "Session" not in batch and "sp_releaseapplock" not in batch
    locks = [s for s in statements if "sp_getapplock" in s]
    assert len(locks) == 2 and all("@LockOwner = N'Transaction'" in s for s in locks)
    begin = next(s for s in statements if "BEGIN TRANSACTION" in s)
    lock = next(s for s in statements if "@LockMode = N'Exclusive'" in s)
    insert = next(s for s in statements if "INSERT INTO" in s)
    commit = next(s for s in statements if "COMMIT TRANSACTION" in s)
    lookup = next(s for s in statements if s.startswith("SELECT @id = o.id"))
    order = [statements.index(s) for s in (lookup, begin, lock, insert, commit)]
    assert order == sorted(order)
    # The marker that tells insert_event's clean-up the open transaction is the batch's own.
    assert f"@Resource = N'{engine.OWN_TRANSACTION_LOCK}', @LockMode = N'Shared', @LockOwner = N'Transaction'" in begin
    parse_one(engine.end_own_transaction_sql())


class _FailsOn(StoreCursor):
    """Records each statement, then raises ``error`` after the one that contains ``marker``."""

    def __init__(self, marker: str, error: Exception, log: list[tuple[str, tuple]] | None = None) -> None:
        super().__init__(log)
        self.marker, self.error = marker, error

    def execute(self, sql: str, params: Sequence[Any] = ()) -> StoreCursor:
        super().execute(sql, params)
        if self.marker in sql:
            raise self.error
        return self


def test_a_cut_short_enqueue_rolls_back_only_a_transaction_of_its_own() -> None:
    engine = MssqlEngine()
    log: list[tuple[str, tuple]] = []
    event = prepare_event(topic="t", aggregate_type="order", aggregate_id="a", payload={"p": 1}, message_id="m-9")
    with pytest.raises(TimeoutError):
        engine.insert_event(_FailsOn("INSERT INTO", TimeoutError("HYT00 Query timeout expired"), log), event)
    assert [sql for sql, _ in log] == [engine.insert_batch(), engine.end_own_transaction_sql()]
    cleanup = engine.end_own_transaction_sql()
    assert f"APPLOCK_MODE(N'public', N'{engine.OWN_TRANSACTION_LOCK}', N'Transaction') <> N'NoLock'" in cleanup
    assert cleanup.index("IF @@TRANCOUNT > 0") < cleanup.index("APPLOCK_MODE") < cleanup.index("ROLLBACK")


def test_insert_reports_a_refused_lock_clearly() -> None:
    engine = MssqlEngine()
    conn = StoreConnection({"SELECT @id AS id, @lock_result": [(None, -1)]})
    event = prepare_event(topic="t", aggregate_type="order", aggregate_id="a", payload={"p": 1}, message_id="m-9")
    with pytest.raises(StoreError, match=r"message_id 'm-9'.*timed out"):
        engine.insert_event(conn.cursor(), event)


def test_insert_binds_event_params_and_long_payloads_as_nvarchar_max() -> None:
    engine = MssqlEngine()
    conn = StoreConnection()
    event = prepare_event(topic="t", aggregate_type="order", aggregate_id="a", payload={"p": "y" * 9000},
                          message_id="m-2")
    assert engine.insert_event(conn.cursor(), event) == 42
    sql, params = conn.log[0]
    assert list(params) == engine.event_params(event)
    assert "@payload NVARCHAR(MAX) = ?" in sql and "@headers NVARCHAR(MAX) = ?" in sql


def test_taking_over_a_lost_holders_rows_reads_past_other_locks(no_sqlglot_fallbacks: None) -> None:
    """The rows of a lost holder are nobody's locks: counting them and ending their leases
    read past what others lock (an uncommitted enqueue, a claim's UPDATE) instead of
    waiting for it. The UPDATE examines every open row (no index holds ``lease_token``),
    and without READPAST its update locks waited on each lock held there."""
    engine = MssqlEngine()
    (count_ref,) = outbox_refs(parse_one(engine.held_by_sql()), engine)
    assert hints(count_ref) == {"READCOMMITTEDLOCK", "READPAST"}
    (update_ref,) = outbox_refs(parse_one(engine.end_leases_sql()), engine)
    assert hints(update_ref) == {"READCOMMITTEDLOCK", "READPAST", "ROWLOCK"}
    assert engine.end_leases_sql().count("?") == 2 and engine.held_by_sql().count("?") == 1


class _PyodbcLikeCursor(RecordingCursor):
    """A recording cursor the engine takes for pyodbc's, whose declared sizes outlive the
    statement they were declared for; ``executemany`` records the sizes in force."""

    __module__ = "pyodbc"

    def executemany(self, sql: str, rows: Any) -> None:
        self.log.append((sql, tuple(map(tuple, rows))))
        self.sizes.append(self._declared)


def test_replays_rows_bind_their_own_values_not_the_last_statements_sizes() -> None:
    """Replay checks a batch's message ids (``execute``: every id declared NVARCHAR(4000))
    and then writes the rows with ``executemany``: pyodbc applied those declared sizes to
    every row, so a payload past 4,000 UTF-16 units was refused as truncated."""
    engine = MssqlEngine()
    cursor = _PyodbcLikeCursor([], [])
    engine.execute(cursor, "SELECT message_id FROM t WHERE message_id IN (?, ?)", ["a", "b"])
    assert cursor.sizes[-1] is not None
    engine.executemany(cursor, "INSERT INTO t (payload) VALUES (?)", [["x" * 9000], ["y"]])
    assert cursor.sizes[-1] == [(SQL_WVARCHAR, 0, 0)]  # NVARCHAR(MAX) for both rows, not the last statement's
    assert cursor.log[-1][1] == (("x" * 9000,), ("y",))



def test_replay_binds_a_long_payload_as_nvarchar_max_never_as_ntext(no_sqlglot_fallbacks: None) -> None:
    """Replay's bulk insert (``executemany``) cleared the declared sizes, leaving each string
    to pyodbc's default: past its 4,000 bytes (2,000 UTF-16 units) that is SQL_WLONGVARCHAR,
    which Microsoft's ODBC driver sends as the legacy ``ntext``, and a database whose collation
    ends in ``_SC`` or ``_UTF8`` refuses it (error 4189; pyodbc issues 835, 1021, 1401): every
    replay of an event with a longer payload failed there (found in review). Now every
    column is declared for all the rows: NVARCHAR(MAX) where any row's value is long."""
    from outbox.pipeline.replay import insert_sql

    engine = MssqlEngine()
    cursor = _PyodbcLikeCursor([], [])
    long_payload = json.dumps({"text": "x" * 2500})
    rows = [engine.event_params(prepare_event(topic="t", aggregate_type="a", aggregate_id=str(i),
                                              payload=payload, message_id=f"m{i}"))
            for i, payload in enumerate([{"short": 1}, json.loads(long_payload)])]
    rows[1][4] = None  # a partition key on one row only
    rows[0][4] = "k"
    engine.executemany(cursor, insert_sql(engine), rows)
    declared = cursor.sizes[-1]
    assert declared is not None, "no declared types: pyodbc binds the long payload as ntext"
    assert len(declared) == len(rows[0]) == insert_sql(engine).count("?")
    assert declared[5] == (SQL_WVARCHAR, 0, 0)  # payload: NVARCHAR(MAX), one row is long
    assert all(size == (SQL_WVARCHAR, 4000, 0) for i, size in enumerate(declared) if i != 5)
    parse_one(insert_sql(engine))
    mixed = _PyodbcLikeCursor([], [])
    engine.executemany(mixed, "INSERT INTO t (a, b) VALUES (?, ?)", [[1, "x"], [2**40, None], [None, "y"]])
    assert mixed.sizes[-1] == [(SQL_BIGINT, 0, 0), (SQL_WVARCHAR, 4000, 0)]
    odd = _PyodbcLikeCursor([], [])
    engine.executemany(odd, "INSERT INTO t (a) VALUES (?)", [[1], ["x"]])
    assert odd.sizes[-1] is None  # a column of two types: the driver's own choice, per row

# -- acknowledgements and housekeeping ----------------------------------------------------

def test_id_lists_are_one_json_parameter_expanded_by_openjson() -> None:
    engine = MssqlEngine()
    engine.compat_level = 130  # as read from the connection (issue 20 item 4: never assumed)
    cond, params = engine.ids_in(list(range(1, 5001)))
    assert cond == "id IN (SELECT CAST([value] AS BIGINT) FROM OPENJSON(?))"
    assert len(params) == 1 and json.loads(params[0]) == list(range(1, 5001))
    assert engine.ids_in([]) == ("1 = 0", [])


def test_purge_counts_seconds_so_long_retention_does_not_overflow_int(no_sqlglot_fallbacks: None) -> None:
    engine = MssqlEngine()
    ninety_days_ms = 90 * 86_400_000
    assert ninety_days_ms > 2**31 - 1
    assert engine.purge_params(ninety_days_ms + 1234, 1000) == [1000, 90 * 86_400 + 1, 234]
    assert engine.purge_params(0, 10) == [10, 0, 0]
    assert all(abs(v) < 2**31 for v in engine.purge_params(10 * 365 * 86_400_000, 1))
    tree = parse_one(engine.purge_chunk_sql())
    assert isinstance(tree, exp.Delete)
    (ref,) = outbox_refs(tree, engine)
    assert hints(ref) == {"READCOMMITTEDLOCK", "ROWLOCK", "READPAST"}
    assert "DATEADD(SECOND, -?" in engine.purge_chunk_sql()


def test_names_clock_and_paging() -> None:
    assert MssqlEngine().table == "[dbo].[outbox]"
    assert MssqlEngine(table="events_out", schema="messaging").table == "[messaging].[events_out]"
    assert MssqlEngine().quote("a]b") == "[a]]b]"
    assert MssqlEngine.now == "SYSUTCDATETIME()"
    assert MssqlEngine().now_plus_ms() == "DATEADD(MILLISECOND, ?, SYSUTCDATETIME())"
    assert MssqlEngine().limit("SELECT id FROM t ORDER BY id") == \
        "SELECT id FROM t ORDER BY id OFFSET 0 ROWS FETCH NEXT ? ROWS ONLY"

# -- migration ----------------------------------------------------------------------------------

@pytest.mark.parametrize("native_json", [False, True])
@pytest.mark.parametrize("level", [110, 120, 130, 160])
@pytest.mark.parametrize("schema, table", [(None, "outbox"), ("messaging", "events_out")])
def test_every_migration_step_is_guarded_and_sets_filtered_index_options(
        schema: str | None, table: str, level: int, native_json: bool, no_sqlglot_fallbacks: None) -> None:
    engine = MssqlEngine(table=table, schema=schema)
    engine.compat_level = level
    engine.server_version = 16 if level >= 130 else 12  # ISJSON follows the version (issue 20 item 4)
    steps = engine.migration_steps(native_json=native_json)
    batches = engine.migration(native_json=native_json)
    assert len(steps) == len(batches)
    for step, batch in zip(steps, batches):
        statements = step[1] if isinstance(step, tuple) else step
        sent = batch[1] if isinstance(batch, tuple) else batch
        assert sent.startswith(FILTERED_INDEX_OPTIONS)
        assert sent == FILTERED_INDEX_OPTIONS + "\n" + "\n".join(statements)
        for statement in statements:
            parse_one(statement)
        if isinstance(step, tuple):
            assert isinstance(parse_one(step[0][0]), exp.Select) and step[0][1] == []
    text = "\n".join(b[1] if isinstance(b, tuple) else b for b in batches)
    s = schema or "dbo"
    assert f"IF SCHEMA_ID(N'{s}') IS NULL" in text and f"CREATE SCHEMA [{s}]" in text
    assert f"IF OBJECT_ID(N'[{s}].[{table}]', N'U') IS NULL" in text
    for column in CONTRACT_COLUMNS[1:]:  # every column but the id, each parsed above (found in review)
        assert f"IF COL_LENGTH(N'[{s}].[{table}]', N'{column}') IS NULL" in text
        assert f"ALTER TABLE [{s}].[{table}] ADD {column} " in text
    # Rows that had no message_id get one each before the unique index is made: SQL Server's
    # unique index takes one NULL only (found in review).
    fill = f"UPDATE [{s}].[{table}] SET message_id = CONCAT(N'legacy-', id) WHERE message_id IS NULL"
    assert fill in text
    assert text.index(fill) < text.index(f"CREATE UNIQUE NONCLUSTERED INDEX [{engine.index_name('message_id')}]")
    for spec in INDEXES:
        name = engine.index_name(spec.suffix)
        assert (f"IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'{name}' "
                f"AND object_id = OBJECT_ID(N'[{s}].[{table}]'))") in text
    # Fault 1: no ISJSON before SQL Server 2016 (the function does not exist there).
    assert ("ISJSON" in text) is (engine.server_version >= 13 and not native_json)
    assert ("payload JSON NOT NULL" in text) is native_json
    # Fault 6: lock escalation off, guarded by the catalog.
    assert f"ALTER TABLE [{s}].[{table}] SET (LOCK_ESCALATION = DISABLE)" in text
    assert "lock_escalation_desc <> N'DISABLE'" in text


@pytest.mark.parametrize("schema", [None, "messaging"])
def test_indexes_an_earlier_release_named_in_full_are_renamed_before_any_is_made(
        schema: str | None, no_sqlglot_fallbacks: None) -> None:
    """Found in the upgrade review (PostgreSQL, the same here): releases before the hashed names
    (``derived_name``) wrote ``ix_<table>_<suffix>`` in full, which SQL Server took (128); today's
    shorter name was missing, so ``outbox migrate`` built a second copy of each index beside
    the old one. The old one is renamed (``sp_rename``) first, where today's name is free;
    a retired index too, so that its drop finds it."""
    table = "outbox_" + "x" * 51
    engine = MssqlEngine(table=table, schema=schema)
    engine.compat_level, engine.server_version = 160, 16
    text = "\n".join(b[1] if isinstance(b, tuple) else b for b in engine.migration())
    s = schema or "dbo"
    for suffix in (*RETIRED_INDEXES, *(spec.suffix for spec in INDEXES)):
        old, new = f"ix_{table}_{suffix}", engine.index_name(suffix)
        assert old != new
        rename = f"EXEC sp_rename N'[{s}].[{table}].[{old}]', N'{new}', N'INDEX'"
        guard = (f"IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'{old}' AND object_id = OBJECT_ID(N'[{s}].[{table}]'))"
                 f" AND NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'{new}' AND object_id = "
                 f"OBJECT_ID(N'[{s}].[{table}]'))")
        assert f"{guard}\nBEGIN\n    {rename};\nEND;" in text
        parse_one(f"{guard}\nBEGIN\n    {rename};\nEND;")
        assert text.index(rename) < text.index(f"INDEX [{new}]")
    assert "sp_rename" not in "\n".join(str(b) for b in MssqlEngine(table="outbox").migration())


def test_migration_is_serialized_by_an_application_lock() -> None:
    """Fault 7: two `outbox migrate` at once. The first step takes an exclusive
    sp_getapplock for the table (the transaction's when one is open), refuses with
    one clear message when it cannot get it, and the last step releases a
    session-owned lock."""
    engine = MssqlEngine(table="events_out", schema="messaging")
    steps = engine.migration_steps()
    first, last = steps[0], steps[-1]
    resource = "N'outbox migrate [messaging].[events_out]'"
    assert f"EXEC @lock_result = sp_getapplock @Resource = {resource}, @LockMode = N'Exclusive', " \
           f"@LockOwner = @lock_owner, @LockTimeout = {MIGRATE_LOCK_TIMEOUT_MS};" in first
    owner = next(i for i, s in enumerate(first) if "WHEN @@TRANCOUNT > 0 THEN N'Transaction' ELSE N'Session'" in s)
    opener = next(i for i, s in enumerate(first) if s.startswith("SELECT @lock_result = COUNT(*) FROM sys.objects"))
    assert opener < owner  # the SELECT opens the driver's implicit transaction the lock then belongs to
    refusal = next(s for s in first if s.startswith("IF @lock_result < 0"))
    assert "RAISERROR(N'outbox migrate: another outbox migrate" in refusal and ", 16, 1," in refusal
    assert len(last) == 1 and f"APPLOCK_MODE(N'public', {resource}, N'Session') <> N'NoLock'" in last[0]
    assert f"EXEC sp_releaseapplock @Resource = {resource}, @LockOwner = N'Session'" in last[0]


def _nocount_before_each(statements: list[str]) -> list[bool]:
    """NOCOUNT as each statement of a batch starts, on a relay session (``SET NOCOUNT OFF``
    at connect), following the batch's own SETs and its save-and-restore of the setting."""
    on, states = False, []
    for statement in statements:
        states.append(on)
        if statement == "SET NOCOUNT ON;":
            on = True
        elif "SET NOCOUNT OFF" in statement:  # the restore: back to the session's OFF
            on = False
    return states


def test_the_migration_lock_refusal_is_the_first_result_the_driver_sees(no_sqlglot_fallbacks: None) -> None:
    """With NOCOUNT OFF (the relay's sessions) the lock batch's SELECT and its EXEC of
    sp_getapplock each sent a row count, and pyodbc's execute returns at the first result:
    the RAISERROR behind them was only reachable through nextset(), so a migration that
    could not get the lock went on without it (pyodbc issues 277, 739). Now nothing that
    sends a count runs with NOCOUNT OFF before the refusal, and every migration batch is
    stepped through to its end (``MssqlEngine.execute``)."""
    for statements in (MssqlEngine().migration_steps()[0], MssqlEngine("events_out", "messaging").migration_steps()[0]):
        states = _nocount_before_each(statements)
        refusal = next(i for i, s in enumerate(statements) if "RAISERROR" in s)
        for statement, nocount in zip(statements[:refusal], states[:refusal]):
            if re.match(r"(SELECT|EXEC|INSERT|UPDATE|DELETE)\b", statement):
                assert nocount, f"sends a row count before the refusal:\n{statement}"
        assert not states[refusal]  # the session's own NOCOUNT is back before the refusal
        assert statements[0].startswith("DECLARE") and "@nocount INT = @@OPTIONS & 512" in statements[0]
        for statement in statements:
            parse_one(statement)


class _ResultsCursor(RecordingCursor):
    """A cursor with pending results, as the ODBC driver keeps them: ``nextset`` walks
    ``results`` and raises the one that is an error, as pyodbc and mssql-python do."""

    def __init__(self, results: list[Any]) -> None:
        super().__init__()
        self.results = list(results)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _ResultsCursor:
        super().execute(sql, params)
        self.pending = list(self.results)
        return self

    def nextset(self) -> bool:
        if not self.pending:
            return False
        result = self.pending.pop(0)
        if isinstance(result, Exception):
            raise result
        return True


def test_a_migration_batch_is_stepped_through_so_a_later_error_raises() -> None:
    engine = MssqlEngine()
    refused = RuntimeError("outbox migrate: another outbox migrate held the migration lock")
    with pytest.raises(RuntimeError, match="held the migration lock"):
        engine.execute(_ResultsCursor(["row count", refused]), engine.migration()[0])
    cursor = _ResultsCursor(["row count"])
    engine.execute(cursor, "SELECT 1")  # a query's result set is the caller's to read
    assert cursor.pending == ["row count"]


def test_a_failed_migration_releases_a_session_owned_lock() -> None:
    """On an autocommit connection (a Django migration: ``atomic = False``) the migration
    lock belongs to the session, and only the migration's last batch released it: a step
    that failed left the session holding it, and every other migrate waited 10 minutes and
    failed, until that connection closed. ``unlock_migration`` now releases it."""
    engine = MssqlEngine()
    cursor = _FailsOn("CREATE TABLE", RuntimeError("CREATE TABLE permission denied in database"))  # as a permission error
    with pytest.raises(RuntimeError, match="permission denied"):
        apply_migration(engine, cursor)
    sent = [sql for sql, _ in cursor.log]
    assert sent[-2] == "SET LOCK_TIMEOUT 30000"  # the session's own bound put back (Engine.ddl_bounds)
    last = sent[-1]
    assert "CREATE TABLE" in sent[-3]
    assert "EXEC sp_releaseapplock @Resource = N'outbox migrate [dbo].[outbox]', @LockOwner = N'Session'" in last
    assert "APPLOCK_MODE(N'public', N'outbox migrate [dbo].[outbox]', N'Session') <> N'NoLock'" in last


class _DriverConnection(StoreConnection):
    """pyodbc and mssql-python alike: a cursor takes the connection's ``timeout`` as its
    statement's query timeout when it is made (pyodbc's Cursor_New, mssql-python's
    ``Cursor(self, timeout=self._timeout)``) and keeps it; ``execute`` never reads it again.
    ``sent`` is each statement with the query timeout it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def cursor(self) -> RecordingCursor:
        cursor = super().cursor()
        timeout, execute = self.timeout, cursor.execute

        def timed(sql: str, params: Sequence[Any] = ()) -> RecordingCursor:
            self.sent.append((sql, timeout))
            return execute(sql, params)
        cursor.execute = timed  # type: ignore[method-assign]
        return cursor


def test_migrations_run_without_the_query_timeout_and_everything_else_with_it() -> None:
    """``query_timeout_s`` (300 s) bounded `outbox migrate` too: the engine set
    ``conn.timeout = 0`` around ``execute`` on a cursor made before, which neither driver
    reads there. An index build on a large table, or a second migrate waiting (up to 10
    minutes) for the first one's lock, failed with HYT00 after 300 s and was retried. Now
    the migration's cursor is made with no timeout; every other cursor keeps it."""
    store, _ = recording_store(None, "outbox", 160)
    conn = _DriverConnection()
    conn.timeout = 300
    store.engine.connect = lambda url: conn  # type: ignore[method-assign]
    store.engine.compat_level = 160  # type: ignore[attr-defined]
    store.migrate()
    store.claim(10)
    migration = {b[1] if isinstance(b, tuple) else b for b in store.engine.migration()}
    ddl = [timeout for sql, timeout in conn.sent if sql in migration]
    assert len(ddl) >= 10 and set(ddl) == {0}
    assert [timeout for sql, timeout in conn.sent if "UPDATE o SET" in sql] == [300]
    assert conn.timeout == 300


def test_ordering_probe_index_is_filtered_on_open_rows_and_replaces_the_old_one(no_sqlglot_fallbacks: None) -> None:
    """Fault 2: the probe's index was (aggregate_id, id) INCLUDE (status) over the whole
    history. Now it is filtered on open rows with the probe's own literal predicate,
    and the migration drops the old index, guarded."""
    engine = MssqlEngine()
    spec = next(i for i in INDEXES if i.suffix == "agg_open")
    ddl = spec.ddl("[ix]", engine.table)
    assert ddl == f"CREATE NONCLUSTERED INDEX [ix] ON [dbo].[outbox] (aggregate_id, id) WHERE {OPEN_ROWS}"
    assert "INCLUDE" not in ddl  # a claim (status 0 -> 1) does not write to it
    assert f"e.{OPEN_ROWS}" in engine.probe_select()  # the literal predicate the filter must match
    assert engine.eligible().startswith(f"{OPEN_ROWS} AND (")  # the claim scan matches claim_ready's filter
    text = "\n".join(b[1] if isinstance(b, tuple) else b for b in engine.migration())
    assert ("IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'ix_outbox_agg_id_id' "
            "AND object_id = OBJECT_ID(N'[dbo].[outbox]'))\nBEGIN\n    DROP INDEX [ix_outbox_agg_id_id] ON [dbo].[outbox];") in text
    assert text.index("DROP INDEX [ix_outbox_agg_id_id]") < text.index("CREATE NONCLUSTERED INDEX [ix_outbox_agg_open]")
    for spec in INDEXES:
        if spec.filtered:
            assert spec.ddl("[x]", "t").endswith(f"WHERE {OPEN_ROWS}")
    # The stats and metrics queries read open rows by created_at: covered by a filtered index.
    stats = next(i for i in INDEXES if i.suffix == "open_created_at")
    assert stats.keys == ("created_at",) and stats.include == ("status",) and stats.filtered


def test_index_checks_compare_definitions_not_names(no_sqlglot_fallbacks: None) -> None:
    """Fault 5: an index with the right name and the wrong definition was never
    repaired. The probe checks uniqueness, filter, keys in order and included columns."""
    engine = MssqlEngine()
    claim_ready = next(i for i in INDEXES if i.suffix == "claim_ready")
    probe = engine.index_matches(claim_ready)
    tree = parse_one(probe)
    assert isinstance(tree, exp.Select)
    assert "i.name = N'ix_outbox_claim_ready'" in probe and "i.is_unique = 0" in probe
    assert f"AND n.index_id = i.index_id) = {2 + len(claim_ready.include)}" in probe
    assert "ic.key_ordinal = 1 AND ic.is_descending_key = 0 AND c.name = N'next_retry_at'" in probe
    assert "ic.key_ordinal = 2 AND ic.is_descending_key = 0 AND c.name = N'id'" in probe
    assert "i.type_desc = N'NONCLUSTERED'" in probe  # a CLUSTERED one failed the check, not this probe
    for column in claim_ready.include:
        assert f"ic.is_included_column = 1 AND c.name = N'{column}'" in probe
    assert f"i.has_filter = 1 AND {filter_sql('i.filter_definition')} IN (" in probe
    unique = engine.index_matches(next(i for i in INDEXES if i.suffix == "message_id"))
    assert "i.is_unique = 1" in unique and "i.has_filter = 0" in unique
    # Every stored spelling of the filter normalizes to one the probe accepts.
    for stored in ("([status]=(0) OR [status]=(1) OR [status]=(3))", "[status] IN (0, 1, 3)", OPEN_ROWS):
        assert normalize_filter(stored) in OPEN_ROWS_NORMALIZED
    assert normalize_filter("([status]=(0) OR [status]=(3))") not in OPEN_ROWS_NORMALIZED
    # The T-SQL normalization computes exactly what normalize_filter does (run on SQLite).
    db = sqlite3.connect(":memory:")
    for stored in ("([status]=(0) OR [status]=(1) OR [status]=(3))", "([Status] IN (0,1))"):
        sql = "SELECT " + filter_sql("?").replace("N'", "'")
        assert db.execute(sql, (stored,)).fetchone()[0] == normalize_filter(stored)


def test_a_wrong_index_is_built_again_in_place_online_where_the_edition_can(no_sqlglot_fallbacks: None) -> None:
    """Through the store: a definition probe that finds no row runs the guarded rebuild. It was
    a ``DROP INDEX`` then a ``CREATE INDEX`` in the migration's transaction: the drop's schema
    lock held the table until the commit, so every enqueue and claim waited for the whole build
    (an upgrade of ``claim_ready``: docs/internals.md, "Rows waiting for a later time are not
    read"). Now one ``CREATE ... WITH (DROP_EXISTING = ON, ONLINE = ON)`` on the editions that
    build online (``SERVERPROPERTY('EngineEdition')`` 3, 5, 8), the same without ``ONLINE`` on
    the others, exactly one of the two per edition; the index is never missing."""
    store, conn = recording_store(None, "outbox", 160)
    store.migrate()
    sent = [sql for sql, _ in conn.log]
    for spec in INDEXES:
        name = store.engine.index_name(spec.suffix)
        probe = sent.index(store.engine.index_matches(spec))  # type: ignore[attr-defined]
        rebuild = next(i for i, s in enumerate(sent) if f"INDEX [{name}] ON" in s and "DROP_EXISTING = ON" in s)
        assert probe < rebuild
        # Dropped only where it is of another kind, which DROP_EXISTING does not change (test_index_definitions).
        assert all(f"AND type_desc NOT IN (N'NONCLUSTERED', N'CLUSTERED', N'CLUSTERED COLUMNSTORE'))\nBEGIN\n    "
                   f"DROP INDEX [{name}]" in s for s in sent if f"DROP INDEX [{name}]" in s)
    claim_ready = next(i for i in INDEXES if i.suffix == "claim_ready")
    exists = ("EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'ix_outbox_claim_ready' "
              "AND object_id = OBJECT_ID(N'[dbo].[outbox]') AND type_desc = N'NONCLUSTERED') "
              # Not one that enforces a constraint, unless as defined (its refusal's guard holds there).
              "AND NOT (EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'ix_outbox_claim_ready' "
              "AND object_id = OBJECT_ID(N'[dbo].[outbox]') AND NOT (is_primary_key = 0 AND is_unique_constraint = 0)) "
              f"AND NOT EXISTS ({store.engine.index_matches(claim_ready, enabled=False)}))")  # type: ignore[attr-defined]
    statements = rebuild_index_statements(claim_ready, "[ix_outbox_claim_ready]", "[dbo].[outbox]", exists)
    assert "\n".join(statements) in "\n".join(sent)
    db = sqlite3.connect(":memory:")
    online_on: list[set[int]] = []
    for statement, options in zip(statements, ("WITH (DROP_EXISTING = ON, ONLINE = ON)", "WITH (DROP_EXISTING = ON)"),
                                  strict=True):
        parse_one(statement)
        condition, inner = re.fullmatch(r"IF (.*)\nBEGIN\n    EXEC sp_executesql N'(.*)';\nEND;", statement,
                                        re.S).groups()  # type: ignore[union-attr]
        inner = inner.replace("''", "'")
        assert inner.endswith(" " + options)
        create = parse_one(inner.removesuffix(" " + options))  # sqlglot does not know WITH after WHERE
        assert isinstance(create, exp.Create) and create.this.name == "ix_outbox_claim_ready"
        assert create.sql("tsql").endswith(f"(next_retry_at, id) INCLUDE (aggregate_id, status, attempts, claimed_at) "
                                           f"WHERE {OPEN_ROWS}")
        parse_one(f"SELECT 1 WHERE {condition}")
        assert condition.startswith(exists + " AND ")
        edition = condition.removeprefix(exists + " AND ")
        online_on.append({e for e in range(1, 13) if db.execute(
            "SELECT 1 WHERE " + edition.replace("SERVERPROPERTY('EngineEdition')", str(e)).replace("INT)", "INTEGER)")
        ).fetchone()})
    assert online_on[0] == set(ONLINE_INDEX_EDITIONS) == {3, 5, 8}
    assert online_on[1] == set(range(1, 13)) - online_on[0]
    # A matching index (the probe finds its row) is left alone.
    store, conn = recording_store(None, "outbox", 160, answers={"SELECT 1 FROM sys.indexes AS i": [(1,)]})
    store.migrate()
    assert not any("DROP INDEX [ix_outbox_claim_ready]" in sql or "DROP_EXISTING" in sql for sql, _ in conn.log)


def test_table_definition_matches_the_contract() -> None:
    create = next(b for b in MssqlEngine().migration() if isinstance(b, str) and "CREATE TABLE" in b)
    for column in ("id BIGINT IDENTITY(1,1) NOT NULL", "message_id NVARCHAR(64)", "topic NVARCHAR(255) NOT NULL",
                   "aggregate_type NVARCHAR(255) NOT NULL", "aggregate_id NVARCHAR(255)",
                   "partition_key NVARCHAR(255) NULL", "payload NVARCHAR(MAX) NOT NULL", "headers NVARCHAR(MAX)",
                   "trace_id NVARCHAR(255) NULL", "status TINYINT NOT NULL", "CHECK (status BETWEEN 0 AND 4)",
                   "attempts INT NOT NULL", "claimed_at DATETIME2(3) NULL", "next_retry_at DATETIME2(3) NULL",
                   "created_at DATETIME2(3) NOT NULL", "DEFAULT SYSUTCDATETIME()", "processed_at DATETIME2(3) NULL",
                   "last_error NVARCHAR(4000) NULL", "lease_token CHAR(32) NULL", "PRIMARY KEY CLUSTERED (id)"):
        assert column in create, column


# -- the chain rule, run on SQLite against plan_claim --------------------------------------------

def sqlite_text(sql: str) -> str:
    """A claim statement in SQLite's dialect: table variables become tables, the probe's
    hints go (SQLite has no locks to hint and one index choice), ``TOP (1) ... ORDER BY
    e.id`` becomes ``LIMIT 1``; ``@max_attempts`` is a named parameter in SQLite too, and
    ``[dbo].[outbox]`` an attached database's table."""
    for variable in ("@cand", "@agg", "@chain", "@win", "@free", "@plan", "@behind"):
        sql = sql.replace(variable, variable[1:])
    start = sql.find(" WITH (READCOMMITTEDLOCK")
    if start >= 0:
        depth, end = 0, start + len(" WITH ")
        for end in range(end, len(sql)):  # noqa: B020 - ``end`` ends where the hint's parenthesis closes
            depth += {"(": 1, ")": -1}.get(sql[end], 0)
            if depth == 0:
                break
        sql = sql[:start] + sql[end + 1:]
    sql = sql.replace("TOP (1) ", "").replace("ORDER BY e.id)", "ORDER BY e.id LIMIT 1)")
    assert "WITH (" not in sql and "TOP" not in sql, sql
    return sql


def run_claim_rule(engine: MssqlEngine, rows: list[tuple[int, str, int, int]], candidate_ids: set[int],
                   max_attempts: int, batch: int | None = None,
                   behind: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Run the claim's probe and chain statements (and, given ``batch``, its cut to the
    batch) on SQLite over ``rows`` of which ``candidate_ids`` were locked, the claim's
    ``behind`` rows in ``@behind``."""
    statements = engine.claim_statements()
    probe = next(s for s in statements if s.startswith("INSERT INTO @agg"))
    chain = next(s for s in statements if s.startswith("INSERT INTO @chain"))
    keep = next(s for s in statements if s.startswith("WITH ranked AS ("))
    db = sqlite3.connect(":memory:")
    db.execute("ATTACH DATABASE ':memory:' AS dbo")
    db.execute("CREATE TABLE dbo.outbox (id INTEGER PRIMARY KEY, aggregate_id TEXT, status INT, attempts INT)")
    db.execute("CREATE TABLE cand (id INTEGER PRIMARY KEY, aggregate_id TEXT, status INT, attempts INT)")
    db.execute("CREATE TABLE agg (aggregate_id TEXT PRIMARY KEY, head INT NOT NULL, blocker INT)")
    db.execute("CREATE TABLE chain (id INTEGER PRIMARY KEY, head INT NOT NULL, dead INT NOT NULL)")
    db.execute("CREATE TABLE behind (id INTEGER PRIMARY KEY)")
    db.executemany("INSERT INTO dbo.outbox VALUES (?, ?, ?, ?)", rows)
    db.executemany("INSERT INTO cand VALUES (?, ?, ?, ?)", [r for r in rows if r[0] in candidate_ids])
    db.executemany("INSERT INTO behind VALUES (?)", [(i,) for i in behind])
    db.execute(sqlite_text(probe).rstrip(";"))
    db.execute(sqlite_text(chain).rstrip(";"), {"max_attempts": max_attempts})
    if batch is not None:
        # SQLite deletes from tables only: the CTE's numbering, then the same cut by id.
        ranked = keep[len("WITH ranked AS ("):keep.index(")\nDELETE FROM ranked")]
        assert keep.endswith("DELETE FROM ranked WHERE n > @batch;")
        db.execute(f"DELETE FROM chain WHERE id IN (SELECT id FROM ({sqlite_text(ranked)}) WHERE n > :batch)",
                   {"batch": batch})
    chosen = db.execute("SELECT id, dead FROM chain").fetchall()
    return sorted(i for i, dead in chosen if not dead), sorted(i for i, dead in chosen if dead)


def choose_and_claim(engine: MssqlEngine, rows: list[tuple[int, str, int, int]], held_elsewhere: set[int],
                     batch: int) -> tuple[tuple[list[int], list[int]], set[int]]:
    """The claim's first phase on SQLite: ``@win`` (every open row counts as eligible, the
    oldest ``CLAIM_WINDOW * batch``), the probe over it into ``@free``, the DELETE of blocked
    heads and the count ``@heads``, run as written; the two locking reads modelled in Python
    as READPAST makes them behave: rows in ``held_elsewhere`` (another claim's U locks) are
    skipped, ``TOP (@heads)`` counts the heads it got, in head order. Then the rule on what was
    locked (``run_claim_rule``). Returns the claim and the ids it locked."""
    statements = engine.claim_statements()
    free_probe = next(s for s in statements if s.startswith("INSERT INTO @free"))
    would_be = next(s for s in statements if s.startswith("INSERT INTO @plan"))
    drop_unplanned = next(s for s in statements if s.startswith("DELETE FROM @free"))
    count = next(s for s in statements if s.startswith("SELECT @heads = COUNT(DISTINCT r.head) FROM ("))
    window = sorted(r for r in rows if r[2] in (0, 1, 3))[:engine.claim_window(batch)]
    db = sqlite3.connect(":memory:")
    db.execute("ATTACH DATABASE ':memory:' AS dbo")
    db.execute("CREATE TABLE dbo.outbox (id INTEGER PRIMARY KEY, aggregate_id TEXT, status INT, attempts INT)")
    db.execute("CREATE TABLE win (id INTEGER PRIMARY KEY, aggregate_id TEXT, status INT, attempts INT)")
    db.execute("CREATE TABLE free (head INTEGER PRIMARY KEY, aggregate_id TEXT UNIQUE, blocker INT)")
    db.execute("CREATE TABLE plan (id INTEGER PRIMARY KEY, head INT NOT NULL, dead INT NOT NULL)")
    db.execute("CREATE TABLE behind (id INTEGER PRIMARY KEY)")
    db.executemany("INSERT INTO dbo.outbox VALUES (?, ?, ?, ?)", rows)
    db.executemany("INSERT INTO win VALUES (?, ?, ?, ?)", window)
    db.execute(sqlite_text(free_probe).rstrip(";"))
    db.execute(sqlite_text(would_be).rstrip(";"), {"max_attempts": 3})
    db.execute(sqlite_text(drop_unplanned).rstrip(";"))
    (heads,) = db.execute(sqlite_text(count.replace("SELECT @heads = ", "SELECT ")).rstrip(";").replace("@batch", ":batch"),
                          {"batch": batch}).fetchone()
    free = [head for (head,) in db.execute("SELECT head FROM free ORDER BY head")]
    held = [head for head in free if head not in held_elsewhere][:heads]  # TOP (@heads), READPAST
    planned = db.execute("SELECT id, head FROM plan ORDER BY head, id").fetchall()
    picked = [i for i, head in planned if head in held][:batch]  # the IN list's TOP (@batch)
    locked = {i for i in picked if i not in held_elsewhere}  # READPAST
    return run_claim_rule(engine, rows, locked, 3, batch), locked


def test_claims_that_overlap_take_disjoint_chains_and_keep_the_rule() -> None:
    """Another claim holds some chains (U locks on a prefix of each): this claim skips them
    and takes others, never comes back empty while its window has a free chain nobody
    holds, and what it takes is exactly ``plan_claim`` over what it locked. With nothing
    held elsewhere it takes what ``plan_claim`` over the whole window takes, as the claim
    that locked its whole window did."""
    engine = MssqlEngine()
    rng = random.Random(2026_11_25)
    for _ in range(300):
        aggregates = rng.choice(["ab", "abcdef", "abcdefghijkl"])
        rows = [(i, rng.choice(aggregates), rng.choice([0, 0, 0, 0, 0, 1, 2, 3, 4]), rng.randint(0, 4))
                for i in range(1, rng.randint(2, 60))]
        batch = rng.randint(1, 12)
        window = sorted(r for r in rows if r[2] in (0, 1, 3))[:engine.claim_window(batch)]
        whole = plan_claim([Candidate(*r) for r in window], blockers_of(rows, {r[0] for r in window}), 3, limit=batch)
        (claimed, dead), _ = choose_and_claim(engine, rows, set(), batch)
        assert (claimed, dead) == (sorted(whole.claim_ids), sorted(whole.dead_ids)), (rows, batch)
        # Another claim holds a prefix of some window chains.
        held_elsewhere: set[int] = set()
        for aggregate in rng.sample(sorted({r[1] for r in window}), k=rng.randint(0, len({r[1] for r in window}))):
            ids = [r[0] for r in window if r[1] == aggregate]
            held_elsewhere |= set(ids[:rng.randint(1, len(ids))])
        (claimed, dead), locked = choose_and_claim(engine, rows, held_elsewhere, batch)
        assert not (set(claimed) | set(dead)) & held_elsewhere
        rule = plan_claim([Candidate(*r) for r in rows if r[0] in locked], blockers_of(rows, locked), 3, limit=batch)
        assert (claimed, dead) == (sorted(rule.claim_ids), sorted(rule.dead_ids))
        untouched = {r[1] for r in window} - {r[1] for r in window if r[0] in held_elsewhere}
        free_chain = plan_claim([Candidate(*r) for r in window if r[1] in untouched],
                                blockers_of(rows, {r[0] for r in window if r[1] in untouched}), 3, limit=batch)
        if free_chain.claim_ids or free_chain.dead_ids:
            assert claimed or dead, (rows, held_elsewhere, batch)


def run_chain_select(engine: MssqlEngine, rows: list[tuple[int, str, int, int]], candidate_ids: set[int],
                     max_attempts: int) -> tuple[list[int], list[int]]:
    return run_claim_rule(engine, rows, candidate_ids, max_attempts)


def blockers_of(rows: list[tuple[int, str, int, int]], candidate_ids: set[int]) -> dict[str, int]:
    """``plan_claim``'s ``first_blocker``: each aggregate's smallest open id outside the candidates."""
    blockers: dict[str, int] = {}
    for id_, aggregate, status, _ in rows:
        if status in (0, 1, 3) and id_ not in candidate_ids:
            blockers[aggregate] = min(blockers.get(aggregate, id_), id_)
    return blockers


def plan(rows: list[tuple[int, str, int, int]], candidate_ids: set[int], max_attempts: int) -> tuple[list, list]:
    candidates = [Candidate(*r) for r in rows if r[0] in candidate_ids]
    result = plan_claim(candidates, blockers_of(rows, candidate_ids), max_attempts)
    return sorted(result.claim_ids), sorted(result.dead_ids)


def test_chain_rule_matches_plan_claim_on_random_outboxes() -> None:
    engine = MssqlEngine()
    rng = random.Random(20240601)
    for _ in range(400):
        rows = [(i, rng.choice("abc"), rng.choice([0, 0, 0, 1, 2, 3, 4]), rng.randint(0, 4))
                for i in range(1, rng.randint(1, 14))]
        open_ids = [r[0] for r in rows if r[2] in (0, 1, 3)]
        candidate_ids = {i for i in open_ids if rng.random() < 0.8}
        assert run_chain_select(engine, rows, candidate_ids, 3) == plan(rows, candidate_ids, 3), rows


def test_the_claim_keeps_whole_chains_oldest_first_up_to_the_batch_as_plan_claim() -> None:
    """The statement after the chain rule (keep ``@batch`` rows of the window, whole
    chains, oldest first), run on SQLite after the probe and the chain rule, against
    ``plan_claim(limit=batch)``, with rows outside the window blocking too."""
    engine = MssqlEngine()
    rng = random.Random(20261123)
    for _ in range(300):
        rows = [(i, rng.choice("abcd"), rng.choice([0, 0, 0, 0, 1, 2, 3, 4]), rng.randint(0, 4))
                for i in range(1, rng.randint(2, 16))]
        candidate_ids = {r[0] for r in rows if r[2] in (0, 1, 3) and rng.random() < 0.85}
        batch = rng.randint(1, 8)
        candidates = [Candidate(*r) for r in rows if r[0] in candidate_ids]
        result = plan_claim(candidates, blockers_of(rows, candidate_ids), 3, limit=batch)
        assert run_claim_rule(engine, rows, candidate_ids, 3, batch) == (
            sorted(result.claim_ids), sorted(result.dead_ids)), (rows, candidate_ids, batch)


def model_claim(rows: list[tuple[int, str, int, int]], candidate_ids: set[int], max_attempts: int,
                batch: int) -> tuple[tuple[list[int], list[int]], int]:
    """The SQL Server claim's steps in Python, one for one: ``@agg`` (per aggregate its
    head, and the TOP (1) walk of the aggregate's open rows below its last candidate,
    stopping at the first non-candidate), the running sums of ``chain_select``, the cut to
    ``batch`` by (head, id). Returns the (claimed, dead) ids and the rows the walks read."""
    candidates = sorted((r for r in rows if r[0] in candidate_ids), key=lambda r: r[0])
    open_rows = sorted((r for r in rows if r[2] in (0, 1, 3)), key=lambda r: (r[1], r[0]))  # agg_open's order
    agg: dict[str, tuple[int, int | None]] = {}
    read = 0
    for aggregate in {r[1] for r in candidates}:
        ids = [r[0] for r in candidates if r[1] == aggregate]
        head, last = min(ids), max(ids)
        blocker = None
        for id_, _, _, _ in (r for r in open_rows if r[1] == aggregate and r[0] < last):
            read += 1
            if id_ not in candidate_ids:
                blocker = id_
                break
        agg[aggregate] = (head, blocker)
    chain: list[tuple[int, int, int]] = []
    for aggregate, (head, blocker) in agg.items():
        cut = dead_before = 0
        for id_, _, status, attempts in (r for r in candidates if r[1] == aggregate):
            dead = int(status == 1 and attempts + 1 >= max_attempts)
            cut += int(status != 0 and id_ > head)
            if (blocker is None or id_ < blocker) and cut == 0 and dead_before == 0:
                chain.append((head, id_, dead))
            dead_before += dead
    kept = sorted(chain)[:batch]
    return (sorted(i for _, i, d in kept if not d), sorted(i for _, i, d in kept if d)), read


def test_a_python_model_of_the_claim_matches_plan_claim_and_reads_linearly() -> None:
    """Issue 20 item 9: the same steps as the statements, over random outboxes with hot
    aggregates, pick what ``plan_claim`` picks; and the probes read at most one row per
    candidate plus one per aggregate (the blocker), where the old probe read k-1 rows for
    the k-th candidate of an aggregate."""
    rng = random.Random(2026_11_24)
    for _ in range(500):
        aggregates = rng.choice(["a", "ab", "abcdef"])
        rows = [(i, rng.choice(aggregates), rng.choice([0, 0, 0, 0, 0, 1, 2, 3, 4]), rng.randint(0, 4))
                for i in range(1, rng.randint(2, 120))]
        candidate_ids = {r[0] for r in rows if r[2] in (0, 1, 3) and rng.random() < 0.9}
        batch = rng.randint(1, 60)
        picked, read = model_claim(rows, candidate_ids, 3, batch)
        candidates = [Candidate(*r) for r in rows if r[0] in candidate_ids]
        result = plan_claim(candidates, blockers_of(rows, candidate_ids), 3, limit=batch)
        assert picked == (sorted(result.claim_ids), sorted(result.dead_ids)), (rows, candidate_ids, batch)
        assert read <= len(candidate_ids) + len({c.aggregate_id for c in candidates})
    hot = [(i, "hot", 0, 0) for i in range(1, 4001)]
    picked, read = model_claim(hot, set(range(1, 4001)), 3, 1000)
    assert picked == (list(range(1, 1001)), []) and read == 3999  # the old probe: 3999 * 4000 / 2


@pytest.mark.parametrize("rows, expected", [
    # A worker died holding a1, a2; a3 arrived since. a1 restarts alone: a3 must not overtake a2.
    ([(1, "a", 1, 0), (2, "a", 1, 0), (3, "a", 0, 0)], ([1], [])),
    # A due retry behind a pending row ends the chain there, and nothing behind it goes.
    ([(1, "a", 0, 0), (2, "a", 3, 1), (3, "a", 0, 0)], ([1], [])),
    # An expired lease out of attempts goes dead; the rows behind it wait for the next claim.
    ([(1, "a", 1, 2), (2, "a", 0, 0), (3, "b", 0, 0)], ([3], [1])),
])
def test_chain_rule_cases(rows: list[tuple[int, str, int, int]], expected: tuple[list, list]) -> None:
    everything = {r[0] for r in rows}
    assert run_chain_select(MssqlEngine(), rows, everything, 3) == expected == plan(rows, everything, 3)


def test_a_row_held_by_another_claimer_blocks_its_aggregate() -> None:
    rows = [(1, "a", 0, 0), (2, "a", 0, 0), (3, "b", 0, 0)]
    assert run_chain_select(MssqlEngine(), rows, {2, 3}, 3) == ([3], [])  # 1 was skipped by READPAST


def test_rows_the_claim_is_behind_do_not_block_their_aggregate(no_sqlglot_fallbacks: None) -> None:
    """The claim's ``behind`` (``Engine.claim``): a drain slice's own rows, published before
    the claim's, are no blockers; every other open row still is."""
    rows = [(1, "a", 1, 1), (2, "a", 1, 1), (3, "a", 1, 1), (4, "a", 0, 0), (5, "a", 0, 0), (6, "b", 0, 0)]
    engine = MssqlEngine()
    assert run_claim_rule(engine, rows, {4, 5, 6}, 3) == ([6], [])
    assert run_claim_rule(engine, rows, {4, 5, 6}, 3, behind=[1, 2]) == ([6], [])
    assert run_claim_rule(engine, rows, {4, 5, 6}, 3, behind=[1, 2, 3]) == ([4, 5, 6], [])
    # The list arrives as one JSON parameter, expanded by OPENJSON where there is one; below
    # level 130 it stays empty (the claim is as before: its own rows block).
    engine.compat_level = 130
    expand = "INSERT INTO @behind (id) SELECT DISTINCT CAST([value] AS BIGINT) FROM OPENJSON(@behind_ids);"
    assert expand in engine.claim_statements()
    for statement in engine.claim_statements(own_transaction=True):
        parse_one(statement)  # every statement parses as T-SQL, the expansion included
    engine.compat_level = 120
    assert expand not in engine.claim_statements()


# -- connection strings and errors ---------------------------------------------------------------

def test_odbc_connection_string_from_a_url() -> None:
    url = ("mssql+pyodbc://relay:s%40cret@db.example:1433/app"
           "?driver=ODBC+Driver+18+for+SQL+Server&TrustServerCertificate=yes")
    assert odbc_connection_string(url) == (
        "DRIVER={ODBC Driver 18 for SQL Server};SERVER=db.example,1433;DATABASE=app;"
        "UID=relay;PWD=s@cret;TrustServerCertificate=yes;")


def test_odbc_connection_string_escapes_and_defaults() -> None:
    assert odbc_connection_string("mssql+pyodbc://u:p%3Bw%7Dd%20@host/db") == (
        "DRIVER={ODBC Driver 18 for SQL Server};SERVER=host;DATABASE=db;UID=u;PWD={p;w}}d };")
    assert odbc_connection_string("mssql://host%5CSQLEXPRESS/db?Trusted_Connection=yes&Encrypt=no") == (
        "DRIVER={ODBC Driver 18 for SQL Server};SERVER=host\\SQLEXPRESS;DATABASE=db;"
        "Trusted_Connection=yes;Encrypt=no;")
    # A query parameter overrides what the URL's parts set (ODBC keywords ignore case).
    assert odbc_connection_string("mssql+pyodbc://u:p@h/db?database=other") == (
        "DRIVER={ODBC Driver 18 for SQL Server};SERVER=h;database=other;UID=u;PWD=p;")


def test_odbc_connection_string_passes_raw_odbc_strings_through() -> None:
    raw = "DRIVER={ODBC Driver 18 for SQL Server};SERVER=h,1433;UID=u;PWD=p;TrustServerCertificate=yes"
    assert odbc_connection_string(raw) == raw
    from urllib.parse import quote_plus
    assert odbc_connection_string(f"mssql+pyodbc:///?odbc_connect={quote_plus(raw)}") == raw
    for bad in ("postgresql://u@h/db", "just-a-host"):
        with pytest.raises(ValueError):
            odbc_connection_string(bad)


class _PyodbcError(Exception):
    """Stands in for pyodbc.Error: recognised by module, so pyodbc need not import."""


_PyodbcError.__module__ = "pyodbc"
_OperationalError = type("OperationalError", (_PyodbcError,), {"__module__": "pyodbc"})


@pytest.mark.parametrize("exc, transient, disconnect", [
    (_PyodbcError("40001", "[SQL Server]Transaction (Process ID 52) was deadlocked ... (1205) (SQLExecDirectW)"),
     True, False),
    (_PyodbcError("HY000", "[SQL Server]Lock request time out period exceeded. (1222)"), True, False),
    (_OperationalError("HYT00", "[Microsoft][ODBC Driver 18 for SQL Server]Query timeout expired"), True, False),
    (_OperationalError("08S01", "Communication link failure"), True, True),
    (_OperationalError("08001", "TCP Provider: Error code 0x2749"), True, True),
    (_OperationalError("08003", "Connection not open"), True, True),
    (_PyodbcError("23000", "Violation of UNIQUE KEY constraint (2627)"), False, False),
    (_PyodbcError("42S02", "Invalid object name 'outbox'. (208)"), False, False),
    (RuntimeError("40001"), False, False),
    (ValueError("08S01", "(1205)"), False, False),
])
def test_transient_and_disconnect_errors(exc: BaseException, transient: bool, disconnect: bool) -> None:
    engine = MssqlEngine()
    assert engine.is_transient(exc) is transient
    assert engine.is_disconnect(exc) is disconnect


#: SQLSTATEs of a connection Microsoft's ODBC driver found broken and could not recover
#: (IMC01-IMC06: "Connection resiliency in the ODBC driver", returned "by any function that
#: executes a command on the server"), and 08007 (the connection failed during the
#: transaction: SQLEndTran cannot tell whether the COMMIT happened).
BROKEN_CONNECTION_STATES = ("08007", "IMC01", "IMC02", "IMC03", "IMC04", "IMC05", "IMC06")
IMC06_TEXT = ("[Microsoft][ODBC Driver 18 for SQL Server]The connection is broken and recovery is not possible. "
              "The connection is marked by the client driver as unrecoverable. No attempt was made to restore "
              "the connection.")


@pytest.mark.parametrize("state", BROKEN_CONNECTION_STATES)
def test_a_connection_the_odbc_driver_could_not_recover_is_a_disconnect(state: str) -> None:
    """pyodbc raises IMC* as its base ``Error`` class (they are not in its SQLSTATE table) and
    08007 as OperationalError; mssql-python as DatabaseError ("An error occurred with SQLSTATE
    code: IMC06") and OperationalError ("Connection failure during transaction"). Only the
    SQLSTATE says the connection is gone: it must be dropped and the work run again on a new
    one, and the database broker must report it as a connection error kombu reconnects on."""
    engine = MssqlEngine()
    for exc in (_PyodbcError(state, f"[{state}] {IMC06_TEXT} (0) (SQLExecDirectW)"),
                _OperationalError(state, f"[{state}] {IMC06_TEXT} (0) (SQLEndTran)")):
        assert engine.is_disconnect(exc), exc
        assert engine.is_transient(exc), exc
    mp = pytest.importorskip("mssql_python.exceptions")
    with pytest.raises(mp.Exception) as raised:
        mp.raise_exception(state, IMC06_TEXT)  # how mssql-python builds the error from the driver's record
    assert engine.is_disconnect(raised.value), raised.value
    assert engine.is_transient(raised.value), raised.value


def test_work_cut_by_a_broken_connection_runs_again_on_a_new_one() -> None:
    """The store's (and the broker's) retry: an IMC06 drops the connection and the work runs
    again on a fresh one, where it was raised at once and the connection kept before."""
    from outbox.storage.connections import Connections

    broken = _PyodbcError("IMC06", f"[IMC06] {IMC06_TEXT} (0) (SQLExecDirectW)")

    class Conn(RecordingConnection):
        def __init__(self, fails: bool) -> None:
            super().__init__()
            self.fails, self.closed, self.timeout = fails, False, 0

        def commit(self) -> None:
            pass

        def rollback(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    first, second = Conn(fails=True), Conn(fails=False)

    class Engine(MssqlEngine):
        def connect(self, url: str) -> Any:
            return opened.pop(0)

    opened = [first, second]
    connections = Connections(Engine(), "mssql+pyodbc://h/db")
    assert connections.retryable(broken)

    def work(cursor: Any) -> str:
        if cursor.connection.fails:
            raise broken
        return "done"

    assert connections.run("claim", work, attempts=3) == "done"
    assert first.closed and not second.closed

def test_importing_the_engine_does_not_import_pyodbc() -> None:
    code = "import sys, outbox.storage.engines.mssql; sys.exit('pyodbc' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- compatibility levels (fault 1) ---------------------------------------------------------------

def test_id_lists_below_level_130_are_chunked_parameter_lists() -> None:
    engine = MssqlEngine()
    engine.compat_level = 120
    assert not engine.has_json
    chunks = engine.id_chunks(list(range(1, 4502)))
    assert [len(c) for c in chunks] == [ID_PARAMS_PER_STATEMENT, ID_PARAMS_PER_STATEMENT, 501]
    assert sum(chunks, []) == list(range(1, 4502))
    cond, params = engine.ids_in(chunks[0])
    assert "OPENJSON" not in cond and cond.count("?") == len(params) == ID_PARAMS_PER_STATEMENT
    assert ID_PARAMS_PER_STATEMENT + 3 < 2100  # the statement's own parameters fit beside it
    with pytest.raises(StoreError, match="id_chunks"):
        engine.ids_in(list(range(ID_PARAMS_PER_STATEMENT + 1)))
    engine.compat_level = 130
    assert engine.id_chunks(list(range(5000))) == [list(range(5000))]


def test_id_lists_below_level_130_are_padded_to_a_few_sizes() -> None:
    """Issue 20 item 11: below 130 every id-list length was its own statement text, so its
    own plan (up to 2,000 per statement kind). The lists are padded to seven sizes by
    repeating the last id, which matches nothing more and counts no row twice."""
    engine = MssqlEngine()
    engine.compat_level = 110
    texts = set()
    for count in [*range(1, 70), 255, 256, 257, 1023, 1024, 1025, 1999, ID_PARAMS_PER_STATEMENT]:
        ids = list(range(1000, 1000 + count))
        cond, params = engine.ids_in(ids)
        texts.add(cond)
        assert cond.count("?") == len(params) in ID_LIST_SIZES and len(params) < 4 * count + 4
        assert params[:count] == ids and set(params) == set(ids)
    assert len(texts) == len(ID_LIST_SIZES) == 7
    assert engine.ids_in([7, 9, 8]) == ("id IN (?, ?, ?, ?)", [7, 9, 8, 8])
    # Through the store: three acks are one statement of four parameters, and three rows applied.
    store, conn = recording_store(None, "outbox", 110)
    assert store.mark_done([1, 2, 3], "L" * 32).applied == 3
    sql, params = conn.log[-1]
    assert "id IN (?, ?, ?, ?)" in sql and list(params) == [1, 2, 3, 3, "L" * 32]


@pytest.mark.parametrize("level, statements", [(110, 2), (120, 2), (130, 1), (160, 1)])
def test_acks_and_requeues_over_the_parameter_limit_at_every_level(level: int, statements: int) -> None:
    """Through the store: 3,000 ids are one OPENJSON statement at 130+, two parameter
    lists below, every statement under 2,100 parameters, and the fence counts add up."""
    store, conn = recording_store(None, "outbox", level)
    ids = list(range(1, 3001))
    for call in (lambda: store.mark_done(ids, "L" * 32), lambda: store.release(ids, "L" * 32),
                 lambda: store.requeue_dead(ids)):
        conn.log.clear()
        result = call()
        assert len(conn.log) == statements
        assert all(len(params) < 2100 and placeholders(sql) == len(params) for sql, params in conn.log)
        assert ("OPENJSON" in conn.log[0][0]) is (level >= 130)
        if hasattr(result, "applied"):
            assert result.applied == len(ids) and result.ok
        else:
            assert result == len(ids)


class _FakeDriver:
    """A DB-API module standing in for pyodbc at connect: records the session batch
    and answers the compatibility level."""

    def __init__(self, level: int | None) -> None:
        self.level = level
        self.connections: list[RecordingConnection] = []

    def connect(self, connection_string: str, autocommit: bool) -> RecordingConnection:
        assert autocommit is False
        conn = StoreConnection({"SELECT compatibility_level": [(self.level, 16, 3)] if self.level else [],
                                    "SELECT OBJECT_ID(": [(None,)]})
        conn.connection_string = connection_string  # type: ignore[attr-defined]
        self.connections.append(conn)
        return conn


def test_connect_sets_session_options_and_reads_the_level_once_per_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults 1 and 4: at connect, one batch sets NOCOUNT OFF, XACT_ABORT ON, the lock
    timeout (default or from the URL) and reads the compatibility level."""
    driver = _FakeDriver(120)
    monkeypatch.setitem(sys.modules, "pyodbc", driver)
    engine = MssqlEngine()
    conn = engine.connect(URL + "&lock_timeout_ms=5000&query_timeout_s=60")
    session, _ = conn.log[0]
    assert parse_one("SET LOCK_TIMEOUT 5000")  # each piece parses (the batch is checked below)
    for option in ("SET NOCOUNT OFF;", "SET XACT_ABORT ON;", "SET LOCK_TIMEOUT 5000;", "SET DEADLOCK_PRIORITY LOW;",
                   FILTERED_INDEX_OPTIONS, "SELECT compatibility_level, ", "FROM sys.databases WHERE name = DB_NAME();"):
        assert option in session
    assert "ISOLATION" not in session and session.index("SET NOCOUNT OFF") < session.index("SELECT")
    assert engine.compat_level == 120 and not engine.has_json
    assert conn.timeout == 60 and conn.commits == 1  # the catalog read's transaction does not linger
    assert "lock_timeout_ms" not in conn.connection_string and "query_timeout_s" not in conn.connection_string
    default = MssqlEngine().connect(URL)
    assert "SET LOCK_TIMEOUT 30000;" in default.log[0][0] and default.timeout == 300


def test_session_batch_parses(no_sqlglot_fallbacks: None) -> None:
    for statement in MssqlEngine.session_sql(1234).replace("\n", " ").split(";"):
        if statement.strip():
            parse_one(statement.strip() + ";")


def test_a_level_below_110_is_refused_with_one_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyodbc", _FakeDriver(100))
    with pytest.raises(StoreError, match="compatibility level 100 is not supported.*110, SQL Server 2012"):
        MssqlEngine().connect(URL)


# -- collation and start-up checks (fault 5) -----------------------------------------------------

def test_claim_declares_its_table_variable_in_the_columns_collation() -> None:
    """Fault 5: a table made by another script has aggregate_id in the database
    collation; a BIN2 table variable against it fails every claim with error 468."""
    store, conn = recording_store(None, "outbox", 160,
                                  answers={"SELECT collation_name FROM sys.columns": [("SQL_Latin1_General_CP1_CI_AS",)]})
    store.claim(10)
    store.claim(10)
    sent = [sql for sql, _ in conn.log]
    assert sum("SELECT collation_name FROM sys.columns" in s for s in sent) == 1  # read once
    claim = next(s for s in sent if s.startswith("DECLARE @nocount"))
    assert "aggregate_id NVARCHAR(255) COLLATE SQL_Latin1_General_CP1_CI_AS NOT NULL" in claim
    assert f"COLLATE {ID_COLLATION}" in MssqlEngine().claim_batch()  # our own table's collation by default


def test_the_claims_table_variables_are_keyed_for_their_reads(no_sqlglot_fallbacks: None) -> None:
    """@cand: the probe's anti-join seeks its id key, the per-aggregate GROUP BY and the
    rules' running sums read its (aggregate_id, id) key in order; @agg is joined by
    aggregate; @chain is cut by id."""
    statements = MssqlEngine().claim_statements()
    declare = next(s for s in statements if s.startswith("DECLARE @cand"))
    assert "id BIGINT NOT NULL PRIMARY KEY" in declare and "UNIQUE (aggregate_id, id)" in declare
    agg = next(s for s in statements if s.startswith("DECLARE @agg"))
    assert "aggregate_id NVARCHAR(255) COLLATE Latin1_General_100_BIN2 NOT NULL PRIMARY KEY" in agg
    for statement in (declare, agg, next(s for s in statements if s.startswith("DECLARE @chain"))):
        parse_one(statement)
        assert "INDEX " not in statement  # inline INDEX needs SQL Server 2014; UNIQUE works on 2012


def test_start_up_check_explains_collation_and_index_problems(caplog: pytest.LogCaptureFixture) -> None:
    conn = StoreConnection({
        "SELECT compatibility_level": [(150, 16, 3)],
        "SELECT OBJECT_ID(": [(12345,)],
        "FROM sys.columns WHERE object_id": [("message_id", "Latin1_General_100_BIN2", "nvarchar", False),
                                             ("aggregate_id", "SQL_Latin1_General_CP1_CI_AS", "nvarchar", False)],
        "SELECT 1 WHERE EXISTS": [(1,)],  # the retired index is still there
    })
    engine = MssqlEngine()
    with caplog.at_level(logging.WARNING, logger="outbox.storage.engines.mssql"):
        engine.setup_session(conn)
        engine.setup_session(conn)  # checked once per engine
    messages = [r.getMessage() for r in caplog.records]
    assert sum("aggregate_id uses the case-insensitive collation SQL_Latin1_General_CP1_CI_AS" in m
               for m in messages) == 1
    # Found in review: it said such ids "are one aggregate"; the relay's chains compare exactly.
    assert any("published as two chains, ordered within each id only" in m for m in messages), messages
    assert not any("are one aggregate" in m for m in messages), messages
    assert not any("column message_id" in m for m in messages)
    for spec in INDEXES:
        assert any(f"index {engine.index_name(spec.suffix)} is missing or defined differently" in m
                   and "outbox migrate" in m for m in messages)
    assert any("ix_outbox_agg_id_id is retired" in m for m in messages)


def test_start_up_check_names_the_alter_column_for_id_columns_that_are_not_nvarchar(
        caplog: pytest.LogCaptureFixture, no_sqlglot_fallbacks: None) -> None:
    """Found in review (6 December): a table made by another script with VARCHAR ids. The
    claim compares the column with its NVARCHAR table variables, so SQL Server converts the
    column; with a SQL collation it cannot seek through that, and the probes' FORCESEEK fails
    every claim (error 8622); the enqueue's lookup of @message_id scans the unique index.
    Start-up now says so, naming the ALTER COLUMN to run (the indexes on it dropped first)."""
    conn = StoreConnection({
        "SELECT compatibility_level": [(150, 16, 3)],
        "SELECT OBJECT_ID(": [(12345,)],
        "FROM sys.columns WHERE object_id": [("message_id", "SQL_Latin1_General_CP1_CI_AS", "varchar", False),
                                             ("aggregate_id", "SQL_Latin1_General_CP1_CI_AS", "varchar", True)],
        "SELECT 1 WHERE EXISTS": [],
    })
    engine = MssqlEngine()
    with caplog.at_level(logging.WARNING, logger="outbox.storage.engines.mssql"):
        engine.setup_session(conn)
    messages = [r.getMessage() for r in caplog.records]
    for column, size, null in (("message_id", 64, "NOT NULL"), ("aggregate_id", 255, "NULL")):
        alter = (f"ALTER TABLE [dbo].[outbox] ALTER COLUMN [{column}] NVARCHAR({size}) COLLATE {ID_COLLATION} "
                 f"{null}")
        problem = next(m for m in messages if f"column {column} is varchar, not NVARCHAR" in m)
        assert alter in problem and "outbox migrate" in problem, problem
        assert ("error 8622" in problem) is (column == "aggregate_id"), problem
        assert isinstance(parse_one(alter), exp.Alter)
    read = next(sql for sql, _ in conn.log if "FROM sys.columns WHERE object_id" in sql)
    parse_one(read)
    # NVARCHAR in a binary collation, the engine's own table: nothing to say about its id columns.
    conn.answers["FROM sys.columns WHERE object_id"] = [("message_id", ID_COLLATION, "nvarchar", False),
                                                         ("aggregate_id", ID_COLLATION, "nvarchar", False)]
    assert not [p for p in engine.schema_problems(conn.cursor()) if "column" in p]


# -- parameters (fault 7) -----------------------------------------------------------------------

def test_input_sizes_do_not_depend_on_string_length() -> None:
    short, long_ = input_sizes(["a", "b" * 300, None, 5, 2**40], 2000), input_sizes(["x" * 64, "y", None, 7, 2**40], 2000)
    assert short == long_ == [(SQL_WVARCHAR, 4000, 0)] * 3 + [(SQL_INTEGER, 0, 0), (SQL_BIGINT, 0, 0)]
    assert input_sizes(["z" * 2001], 2000) == [(SQL_WVARCHAR, 0, 0)]  # nvarchar(max), not ntext
    assert input_sizes(["z" * 2001], 4000) == [(SQL_WVARCHAR, 4000, 0)]
    assert input_sizes(["\U0001F600" * 1001], 2000) == [(SQL_WVARCHAR, 0, 0)]  # 2,002 UTF-16 units
    assert input_sizes([1.5]) is None and input_sizes([True]) is None


def test_every_statement_declares_stable_parameter_types() -> None:
    """Two enqueues whose strings differ in length bind identically: one plan."""
    engine = MssqlEngine()
    conn = StoreConnection()
    for n in (1, 40):
        event = prepare_event(topic="t" * n, aggregate_type="order", aggregate_id="a" * n, payload={"p": 1},
                              message_id=f"m-{n}")
        engine.insert_event(conn.cursor(), event)
    assert conn.sizes[0] == conn.sizes[1] and len(conn.sizes[0]) == 8
    assert all(size == (SQL_WVARCHAR, 4000, 0) for size in conn.sizes[0])
    store, conn = recording_store(None, "outbox", 160)
    store.claim(5)
    store.mark_done([1, 2], "L" * 32)
    store.purge_done(timedelta(days=1), batch=10)
    for (sql, params), sizes in zip(conn.log, conn.sizes):
        assert (sizes is None) is (not params), sql
        if params:
            assert len(sizes) == len(params)


# -- URLs and drivers --------------------------------------------------------------------------------

def test_engine_options_are_read_from_the_url_and_never_reach_the_driver() -> None:
    target = parse_target(URL + "&lock_timeout_ms=2500&query_timeout_s=0&Encrypt=yes")
    assert (target.driver, target.lock_timeout_ms, target.query_timeout_s) == ("pyodbc", 2500, 0)
    assert target.connection_string == ("DRIVER={ODBC Driver 18 for SQL Server};SERVER=db.example,1433;"
                                        "DATABASE=app;UID=relay;PWD=secret;Encrypt=yes;")
    for bad, message in (("lock_timeout_ms=soon", "lock_timeout_ms must be an integer"),
                         ("query_timeout_s=-1", "query_timeout_s must be between 0 and 86400")):
        with pytest.raises(ValueError, match=message):
            parse_target(URL + "&" + bad)


def test_mssql_python_is_chosen_by_url_and_has_no_driver_keyword() -> None:
    from outbox.storage.engines import engine_for_url, kind_of_url, mssql_driver
    url = "mssql+mssqlpython://relay:s%40cret@db.example:1433/app?TrustServerCertificate=yes&lock_timeout_ms=100"
    target = parse_target(url)
    assert target.driver == "mssql_python" and target.lock_timeout_ms == 100
    assert target.connection_string == "SERVER=db.example,1433;DATABASE=app;UID=relay;PWD=s@cret;" \
                                       "TrustServerCertificate=yes;"
    assert mssql_driver(url) == "mssql_python" and mssql_driver(URL) == "pyodbc"
    assert isinstance(engine_for_url(url), MssqlEngine) and kind_of_url(url) == "mssql"
    with pytest.raises(ValueError, match="takes no driver="):
        parse_target(url + "&driver=ODBC+Driver+18+for+SQL+Server")
    with pytest.raises(ConfigError, match="unsupported SQL Server driver 'pymssql'"):
        kind_of_url("mssql+pymssql://u:p@h/db")


def test_the_mssql_python_connection_string_is_one_the_driver_accepts() -> None:
    """mssql-python validates keywords before connecting; parse with its own parser."""
    parser_module = pytest.importorskip("mssql_python.connection_string_parser")
    target = parse_target("mssql+mssqlpython://relay:p%3Bw@db.example:1433/app?Encrypt=yes&TrustServerCertificate=yes")
    parsed = parser_module._ConnectionStringParser(validate_keywords=True)._parse(target.connection_string)
    assert {k.lower(): v for k, v in parsed.items()} == {
        "server": "db.example,1433", "database": "app", "uid": "relay", "pwd": "p;w", "encrypt": "yes",
        "trustservercertificate": "yes"}


def test_a_pyodbc_url_rewritten_for_mssql_python_keeps_its_server_login_and_options() -> None:
    from outbox.storage.engines.mssql.driver import mssql_python_url
    url = mssql_python_url("mssql+pyodbc://relay:s%40cret@db.example:1433/app?driver=ODBC+Driver+18+for+SQL+Server"
                           "&TrustServerCertificate=yes&lock_timeout_ms=100")
    assert url == "mssql+mssqlpython://relay:s%40cret@db.example:1433/app?TrustServerCertificate=yes&lock_timeout_ms=100"
    target = parse_target(url)
    assert target.driver == "mssql_python" and target.lock_timeout_ms == 100 and "PWD=s@cret;" in target.connection_string
    assert mssql_python_url("mssql://u:p@h/db?DRIVER=FreeTDS") == "mssql+mssqlpython://u:p@h/db"
    with pytest.raises(ValueError, match="raw ODBC connection string"):
        mssql_python_url("DRIVER={ODBC Driver 18 for SQL Server};SERVER=h;UID=u;PWD=p")


def test_enqueue_accepts_an_mssql_python_connection() -> None:
    from outbox.storage.engines import unwrap_connection
    # Named as the driver names it, with a cursor() as it has (a cursor object has none).
    fake = type("Connection", (), {"__module__": "mssql_python.connection", "cursor": lambda self: None})()
    assert unwrap_connection(fake) == ("mssql", fake)


# -- errors (fault 7) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("number", sorted(TRANSIENT_ERRORS))
def test_azure_and_locking_error_numbers_are_transient(number: int) -> None:
    exc = _PyodbcError("42000", f"[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Something. ({number}) "
                                "(SQLExecDirectW)")
    assert MssqlEngine().is_transient(exc)


@pytest.mark.parametrize("number, disconnect", [(40613, True), (40197, True), (10054, True), (4060, True),
                                                (1205, False), (1222, False), (40501, False), (208, False)])
def test_which_error_numbers_drop_the_connection(number: int, disconnect: bool) -> None:
    exc = _PyodbcError("HY000", f"[SQL Server]Message. ({number}) (SQLExecute)")
    assert MssqlEngine().is_disconnect(exc) is disconnect


def test_mssql_python_errors_are_classified_by_sqlstate_and_message() -> None:
    mp = pytest.importorskip("mssql_python.exceptions")
    engine = MssqlEngine()
    cases = [
        (mp.OperationalError("Serialization failure", "Transaction (Process ID 51) was deadlocked on lock resources "
                             "with another process and has been chosen as the deadlock victim."), True, False),
        (mp.OperationalError("Communication link failure", "TCP Provider: Error code 0x68"), True, True),
        (mp.OperationalError("Timeout expired", "Query timeout expired"), True, False),
        (mp.DatabaseError("An error occurred with SQLSTATE code: 42000", "Database 'app' on server 'x' is not "
                          "currently available. Please retry the connection later."), True, True),
        (mp.OperationalError("General error", "Lock request time out period exceeded."), True, False),
        (mp.OperationalError("General error", "The service is currently busy. Retry the request after 10 seconds."),
         True, False),
        (mp.ProgrammingError("Syntax error or access violation", "Invalid object name 'outbox'."), False, False),
        (mp.IntegrityError("Integrity constraint violation", "Cannot insert duplicate key row"), False, False),
    ]
    for exc, transient, disconnect in cases:
        assert engine.is_transient(exc) is transient, exc
        assert engine.is_disconnect(exc) is disconnect, exc


def test_mssql_python_says_a_table_or_column_is_missing_in_words() -> None:
    """Invalid object name (208) comes as SQLSTATE 42S02 and invalid column name (207) as
    42S22; mssql-python raises them as ProgrammingError("Base table or view not found" /
    "Column not found") with no error number. Unrecognised, the relay's heartbeat logged a
    missing holders table at debug level on every tick instead of one warning naming
    `outbox migrate`, and enqueue and the claim raised the driver's error without the hint."""
    mp = pytest.importorskip("mssql_python.exceptions")
    engine = MssqlEngine()
    with pytest.raises(mp.ProgrammingError) as table:
        mp.raise_exception("42S02", "[Microsoft][SQL Server]Invalid object name 'dbo.outbox_holders'.")
    with pytest.raises(mp.ProgrammingError) as column:
        mp.raise_exception("42S22", "[Microsoft][SQL Server]Invalid column name 'lease_token'.")
    assert engine.is_missing_table(table.value) and not engine.is_missing_column(table.value)
    assert engine.is_missing_column(column.value) and not engine.is_missing_table(column.value)
    assert "outbox migrate" in (engine.schema_error_hint(table.value) or "")
    assert "outbox migrate" in (engine.schema_error_hint(column.value) or "")
    for exc in (table.value, column.value):
        assert not engine.is_transient(exc) and not engine.is_disconnect(exc)


def test_error_numbers_are_read_where_pyodbc_puts_them() -> None:
    from outbox.storage.engines.mssql import error_numbers
    assert error_numbers("[40001] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Transaction (Process ID 52) "
                         "was deadlocked. (1205) (SQLExecDirectW)") == {1205}
    assert error_numbers("[HY000] Lock request time out period exceeded. (1222); [01000] Statement terminated. "
                         "(3621)") == {1222, 3621}
    permanent = _PyodbcError("22001", "[SQL Server]String or binary data would be truncated in nvarchar(64) "
                                      "column (2628) (SQLExecDirectW)")
    assert error_numbers(str(permanent.args[1])) == {2628}
    assert not MssqlEngine().is_transient(permanent)


def test_the_gauges_read_without_shared_locks(no_sqlglot_fallbacks: None) -> None:
    """Issue 20, item 10: with RCSI off a plain read waits for every uncommitted enqueue
    (up to the 30 s lock timeout); the metrics' gauges read through them."""
    for engine in (MssqlEngine(), MssqlEngine(table="events_out", schema="messaging")):
        tree = parse_one(engine.gauges_sql())
        assert isinstance(tree, exp.Select)
        (ref,) = outbox_refs(tree, engine)
        assert hints(ref) == {"READUNCOMMITTED"}
        assert "status IN (0, 1, 3)" in engine.gauges_sql()


# -- a migration that gives up waiting for a table's lock (review diff1, finding 5) ----------

LOCK_TIMEOUT_1222 = _OperationalError("HY000", "[HY000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Lock "
                                               "request time out period exceeded. (1222) (SQLExecDirectW)")


def test_a_lock_timeout_is_told_from_other_transient_errors() -> None:
    """1222 is transient for the relay's work but ends a migration at once (Connections.run);
    MssqlEngine said False for every error, so a migration's 1222 was tried five times."""
    from outbox.storage.connections import Connections
    engine = MssqlEngine()
    deadlock = _OperationalError("40001", "[40001] [SQL Server]Transaction (Process ID 52) was deadlocked on lock "
                                          "resources with another process. (1205) (SQLExecDirectW)")
    assert engine.is_lock_timeout(LOCK_TIMEOUT_1222) and engine.is_transient(LOCK_TIMEOUT_1222)
    assert not engine.is_lock_timeout(deadlock) and engine.is_transient(deadlock)
    assert not engine.is_lock_timeout(_OperationalError("HY000", "[SQL Server]Bad thing (12220) (SQLExecDirectW)"))
    connections = Connections(engine, URL)
    assert connections.retryable(LOCK_TIMEOUT_1222) and not connections.retryable(LOCK_TIMEOUT_1222, ddl=True)
    assert connections.retryable(deadlock, ddl=True)
    mp = pytest.importorskip("mssql_python.exceptions")  # no error number there: the words
    assert engine.is_lock_timeout(mp.OperationalError("General error", "Lock request time out period exceeded."))


class _TableLocked(RecordingCursor):
    """A table another transaction holds: the migration step that creates it fails with 1222.
    (Not a StoreCursor: the table names bound as parameters start with "[", not id lists.)"""

    def __init__(self, log: list[tuple[str, tuple]] | None = None, sizes: list | None = None,
                 answers: dict[str, list[tuple]] | None = None) -> None:
        super().__init__(log, sizes, answers, default=store_answer)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> RecordingCursor:
        super().execute(sql, params)
        if "CREATE TABLE" in sql:
            raise LOCK_TIMEOUT_1222
        return self


def test_a_migration_that_gives_up_waiting_is_not_retried_and_names_the_holder(no_sqlglot_fallbacks: None) -> None:
    """A DDL step waited the session's LOCK_TIMEOUT (30 s) and was tried five times, every
    enqueue and claim queued behind its Sch-M request all along (~150 s), then failed naming
    no one. Now the step waits 10 s (SET LOCK_TIMEOUT around the migration, the session's
    put back), once, and the error names who holds the table."""
    holder = (57, "app", "web-1", "orders-api", "sleeping", 125)
    conn = StoreConnection({"FROM sys.dm_tran_locks": [holder]})
    conn.cursor_class = _TableLocked
    store = OutboxStore(URL, table="outbox", claim_timeout_ms=30_000, max_attempts=5)
    store.engine.connect = lambda url: conn  # type: ignore[method-assign]
    store.engine.compat_level = 160  # type: ignore[attr-defined]
    with pytest.raises(StoreError) as refused:
        store.migrate()
    message = str(refused.value)
    assert "gave up after waiting 10 s for a lock on [dbo].[outbox]" in message
    assert "session 57 (login app, from web-1, program orders-api, sleeping, its transaction open 2 min 5 s; " \
           "KILL 57 ends it)" in message
    sent = [sql for sql, _ in conn.log]
    assert sum("CREATE TABLE" in sql for sql in sent) == 1  # not tried again
    failed = next(i for i, sql in enumerate(sent) if "CREATE TABLE" in sql)
    assert sent[:2] == [LOCK_TIMEOUT_SQL, f"SET LOCK_TIMEOUT {DDL_LOCK_TIMEOUT_MS}"]
    assert "SET LOCK_TIMEOUT 30000" in sent[failed + 1:]  # the session's own, put back
    batch, params = next((sql, p) for sql, p in conn.log if "sys.dm_tran_locks" in sql)
    assert params == ("[dbo].[outbox]", "[dbo].[outbox_holders]") and placeholders(batch) == len(params)
    for sql in (LOCK_TIMEOUT_SQL, f"SET LOCK_TIMEOUT {DDL_LOCK_TIMEOUT_MS}", "SET LOCK_TIMEOUT 30000"):
        parse_one(sql)


def test_the_lock_holders_query_parses_and_reads_granted_object_locks(no_sqlglot_fallbacks: None) -> None:
    """One SELECT (no SET NOCOUNT ON to put back: lock_holders_sql says why)."""
    sql = lock_holders_sql(2)
    select = parse_one(sql)
    assert isinstance(select, exp.Select)
    assert {t.name for t in select.find_all(exp.Table)} == {
        "dm_tran_locks", "dm_exec_sessions", "dm_tran_session_transactions", "dm_tran_active_transactions"}
    assert "l.resource_type = N'OBJECT' AND l.resource_database_id = DB_ID()" in sql
    assert "l.request_status = N'GRANT'" in sql and "l.request_session_id <> @@SPID" in sql
    assert "l.resource_associated_entity_id IN (OBJECT_ID(?), OBJECT_ID(?))" in sql and placeholders(sql) == 2
