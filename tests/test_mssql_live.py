"""SQL Server, for real, wherever one is reachable: what only a server can prove.

Set ``OUTBOX_TEST_MSSQL_URL`` to a login that may create databases (for example
``mssql+pyodbc://sa:Passw0rd!@127.0.0.1:1433/master?driver=ODBC+Driver+18+for+SQL+Server&TrustServerCertificate=yes``;
where a Docker engine answers, ``tests/engine_support.py`` starts a container instead).
Without either, every test here skips, saying why.

The module creates databases of its own, never tempdb:

- ``rcsi`` and ``locking``: READ_COMMITTED_SNAPSHOT ON (Azure SQL's default) and
  OFF. The shared store conformance suite (``tests/test_store_conformance.py``),
  the racing claimers of ``tests/test_concurrency.py`` (``claimers.race_claimers``,
  which that module runs without SQL Server) and the SQL Server checks below run in both,
  through this module's ``url`` fixture, which overrides tests/engine_support.py's.
- ``levels``: its compatibility level is switched between 110, 120 and 130 to
  prove acks, requeues and the migration work without OPENJSON (ISJSON exists at
  every level from SQL Server 2016: issue 20 item 4).
- ``outage``: taken offline and back by the broker-outage check (issue 20 item 6).

Everything is dropped at the end of the module.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import test_store_conformance as _conformance
from claimers import race_claimers
from engine_support import mssql_python_url, mssql_url

from outbox import enqueue
from outbox.core.errors import EnqueueError
from outbox.domain.events import prepare_event
from outbox.storage.engines.mssql import INDEXES, MssqlEngine, parse_target
from outbox.storage.store import OutboxStore
from outbox.transport import drop_queue_tables


#: The store conformance suite, collected here a second time so it runs in this
#: module's databases (RCSI on and off) with this module's ``url`` and ``kind``; but for the
#: tests pinned to other engines (``@pytest.mark.parametrize("kind", [...])``).
def _pinned_elsewhere(test: Any) -> bool:
    return any(mark.name == "parametrize" and mark.args[0] == "kind" for mark in getattr(test, "pytestmark", []))


globals().update({name: getattr(_conformance, name) for name in dir(_conformance)
                  if name.startswith("test_") and not _pinned_elsewhere(getattr(_conformance, name))})

RUN = uuid.uuid4().hex[:8]
DATABASES = {"rcsi": f"outbox_live_rcsi_{RUN}", "locking": f"outbox_live_lock_{RUN}",
             "levels": f"outbox_live_levels_{RUN}"}


# -- databases of our own --------------------------------------------------------------------

def url_for_database(url: str, database: str) -> str:
    """The same server and login, another database (URL path, odbc_connect or raw ODBC)."""
    if "://" in url and "odbc_connect=" not in url:
        head, _, tail = url.partition("://")
        rest, query = (tail.split("?", 1) + [""])[:2]
        authority = rest.split("/", 1)[0]
        return f"{head}://{authority}/{database}" + (f"?{query}" if query else "")
    target = parse_target(url)
    odbc = re.sub(r"(?i)(^|;)\s*database=[^;]*;?", r"\1", target.connection_string)
    return odbc.rstrip(";") + f";DATABASE={database};"


def admin_connection(url: str) -> Any:
    """An autocommit connection (CREATE/ALTER DATABASE refuse to run in a transaction)."""
    target = parse_target(url)
    if target.driver == "mssql_python":
        import mssql_python
        return mssql_python.connect(target.connection_string, autocommit=True)
    import pyodbc
    return pyodbc.connect(target.connection_string, autocommit=True)


def run_admin(url: str, *statements: str) -> None:
    conn = admin_connection(url)
    try:
        cursor = conn.cursor()
        for statement in statements:
            cursor.execute(statement)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def databases() -> Iterator[dict[str, str]]:
    base = mssql_url()
    made: list[str] = []
    try:
        for key, name in DATABASES.items():
            run_admin(base, f"CREATE DATABASE [{name}]")
            made.append(name)
            rcsi = "OFF" if key == "locking" else "ON"
            run_admin(base, f"ALTER DATABASE [{name}] SET READ_COMMITTED_SNAPSHOT {rcsi} WITH ROLLBACK IMMEDIATE")
    except Exception as exc:  # a login without CREATE DATABASE, Azure SQL's logical master...
        for name in made:
            run_admin(base, f"DROP DATABASE [{name}]")
        pytest.skip(f"the live SQL Server suite needs databases of its own and could not make them: {exc}")
    yield {key: url_for_database(base, name) for key, name in DATABASES.items()}
    for name in made:
        try:
            run_admin(base, f"ALTER DATABASE [{name}] SET SINGLE_USER WITH ROLLBACK IMMEDIATE",
                      f"DROP DATABASE [{name}]")
        except Exception as exc:  # leave the rest to the DBA, but say so
            logging.getLogger(__name__).warning("could not drop test database %s: %s", name, exc)


@contextlib.contextmanager
def own_database(purpose: str, options: str, unavailable: str) -> Iterator[tuple[str, str]]:
    """A database made for one test (``CREATE DATABASE ... {options}``; skipped with
    ``unavailable`` when it cannot be made), dropped after it, online or not: (its URL, its name)."""
    base = mssql_url()
    name = f"outbox_live_{purpose}_{uuid.uuid4().hex[:8]}"
    try:
        run_admin(base, f"CREATE DATABASE [{name}] {options}".rstrip())
    except Exception as exc:
        pytest.skip(f"{unavailable}: {exc}")
    try:
        yield url_for_database(base, name), name
    finally:
        try:
            run_admin(base, f"ALTER DATABASE [{name}] SET ONLINE", f"ALTER DATABASE [{name}] SET SINGLE_USER WITH "
                      "ROLLBACK IMMEDIATE", f"DROP DATABASE [{name}]")
        except Exception as exc:
            logging.getLogger(__name__).warning("could not drop test database %s: %s", name, exc)


@pytest.fixture
def kind() -> str:
    return "mssql"


@pytest.fixture(params=["rcsi", "locking"], ids=["rcsi-on", "rcsi-off"])
def url(request: pytest.FixtureRequest, databases: dict[str, str]) -> str:
    return databases[request.param]


def scalar(store: OutboxStore, sql: str, params: list[Any] | None = None) -> Any:
    with store.transaction() as cursor:
        row = store.engine.execute(cursor, sql, params or []).fetchone()
    return row[0] if row else None


def add(conn: Any, store: OutboxStore, aggregate: str, message_id: str | None = None, **kw: Any) -> int:
    return enqueue(conn, topic="t", aggregate_type="order", aggregate_id=aggregate, payload=kw.pop("payload", {"n": 1}),
                   message_id=message_id, table=store.engine.table_name, **kw)


# -- the round trip and the database's own settings ------------------------------------------------

def test_the_databases_have_the_row_versioning_they_claim(url: str, store: OutboxStore) -> None:
    rcsi = scalar(store, "SELECT is_read_committed_snapshot_on FROM sys.databases WHERE name = DB_NAME()")
    assert scalar(store, "SELECT DB_NAME()") != "tempdb"
    assert bool(rcsi) is ("_rcsi_" in scalar(store, "SELECT DB_NAME()"))


def test_migrate_enqueue_claim_and_mark_done_round_trip(store: OutboxStore, writer: Any) -> None:
    store.migrate()  # idempotent
    first = add(writer, store, "a", "live-1")
    again = add(writer, store, "a", "live-1")
    big = add(writer, store, "a", payload={"text": "x" * 9000})
    writer.commit()
    assert again == first and big > first
    claim = store.claim(10)
    assert [m.id for m in claim.messages] == [first, big]
    assert len(claim.messages[1].payload) > 9000
    assert store.claim(10).messages == []  # leased
    assert store.mark_done([first, big], claim.lease).ok
    assert store.stats().counts["done"] == 2


def test_long_strings_and_long_id_lists_go_as_nvarchar_max_in_a_utf8_database() -> None:
    """Found in review: strings past the inline limit were declared SQL_WLONGVARCHAR, which
    the driver sends as ntext, and a UTF-8 (or _SC) collation refuses ntext (error 4189):
    a long payload's enqueue, and a mark_done of a few hundred ids (one JSON list for
    OPENJSON), failed there. Needs SQL Server 2019 or later (UTF-8 collations)."""
    with own_database("utf8", "COLLATE Latin1_General_100_CI_AS_SC_UTF8",
                      "no UTF-8 collated database could be made (SQL Server 2019+ and CREATE DATABASE)") as (url, _):
        store = OutboxStore(url, table="outbox", claim_timeout_ms=60_000)
        store.migrate()
        writer = store.engine.connect(url)
        try:
            ids = [add(writer, store, f"a{n}", payload={"text": "é" * 5000} if n == 0 else {"n": n})
                   for n in range(600)]
            writer.commit()
        finally:
            writer.close()
        claim = store.claim(600)
        assert sorted(m.id for m in claim.messages) == sorted(ids)
        assert store.mark_done(ids, claim.lease).ok
        assert store.stats().counts["done"] == 600
        store.close()


def test_relay_sessions_have_the_options_the_engine_relies_on(store: OutboxStore) -> None:
    """Fault 4: NOCOUNT off (rowcount works whatever the server default), XACT_ABORT on,
    a lock timeout, deadlock priority low; the isolation level is left at READ COMMITTED."""
    with store.transaction() as cursor:
        options, lock_timeout, priority, isolation = store.engine.execute(cursor, (
            "SELECT @@OPTIONS, @@LOCK_TIMEOUT, (SELECT deadlock_priority FROM sys.dm_exec_sessions "
            "WHERE session_id = @@SPID), (SELECT transaction_isolation_level FROM sys.dm_exec_sessions "
            "WHERE session_id = @@SPID)")).fetchone()
    assert options & 512 == 0 and options & 16384 == 16384
    assert lock_timeout == parse_target(store.url).lock_timeout_ms and priority == -5 and isolation == 2


def test_fences_and_purge_count_rows_whatever_nocount_the_session_started_with(store: OutboxStore, writer: Any,
                                                                                  url: str) -> None:
    """Fault 4: under NOCOUNT ON (a common server-wide default) rowcount is -1; the
    relay's connections switch it off at connect, so a stale ack is reported and purge
    runs chunk after chunk instead of stopping after the first."""
    probe = admin_connection(url)
    try:
        cursor = probe.cursor()
        cursor.execute("SET NOCOUNT ON")
        cursor.execute(f"UPDATE {store.engine.table} SET attempts = attempts WHERE 1 = 1")
        assert cursor.rowcount == -1  # what the engine would read without its session options
    finally:
        probe.close()
    ids = [add(writer, store, f"p{i}") for i in range(7)]
    writer.commit()
    claim = store.claim(10)
    assert store.mark_done(ids, claim.lease).applied == 7
    stale = store.mark_done(ids[:2], claim.lease)
    assert stale.applied == 0 and stale.stale == 2
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET processed_at = DATEADD(DAY, -30, processed_at)")
    store.close()  # the next connection gets the session options again
    assert store.purge_done(timedelta(days=7), batch=2) == 7  # four chunks: rowcount never -1


# -- the enqueue: no key-range locks, no duplicate-key errors (fault 6) --------------------------------

def test_concurrent_enqueues_of_neighbouring_ids_never_wait_for_each_other(store: OutboxStore, url: str) -> None:
    first, second = store.engine.connect(url), store.engine.connect(url)
    try:
        add(first, store, "a", "0001-uuidv7-like")  # uncommitted
        second.cursor().execute("SET LOCK_TIMEOUT 2000")
        started = time.monotonic()
        add(second, store, "b", "0002-uuidv7-like")  # the next key in the same gap
        add(second, store, "b", "0000-uuidv7-like")  # and the one before it
        assert time.monotonic() - started < 2.0
        second.commit()
        first.commit()
    finally:
        first.close()
        second.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table}") == 3


def test_racing_enqueues_of_one_message_id_store_one_row_and_raise_nothing(store: OutboxStore, url: str) -> None:
    first, second = store.engine.connect(url), store.engine.connect(url)
    results: list[Any] = []
    try:
        second.cursor().execute("SET XACT_ABORT ON")  # a caller with XACT_ABORT on keeps its transaction too
        held = add(first, store, "a", "same-id")  # uncommitted: the second waits for it

        def racer() -> None:
            try:
                results.append(add(second, store, "a", "same-id"))
                results.append(add(second, store, "a", "other-id"))
                second.commit()
            except BaseException as exc:  # surfaced below
                results.append(exc)

        thread = threading.Thread(target=racer)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not results  # waiting for the first transaction
        first.commit()
        thread.join(timeout=30)
        assert results[0] == held and isinstance(results[1], int), results
    finally:
        first.close()
        second.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table}") == 2


def test_a_rolled_back_enqueue_lets_the_waiting_one_insert(store: OutboxStore, url: str) -> None:
    first, second = store.engine.connect(url), store.engine.connect(url)
    results: list[Any] = []
    try:
        add(first, store, "a", "rolled-back")
        thread = threading.Thread(target=lambda: results.append(add(second, store, "a", "rolled-back")))
        thread.start()
        time.sleep(0.3)
        first.rollback()
        thread.join(timeout=30)
        second.commit()
    finally:
        first.close()
        second.close()
    assert isinstance(results[0], int)
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table} WHERE message_id = N'rolled-back'") == 1


def test_an_autocommit_enqueue_releases_its_lock(store: OutboxStore, url: str) -> None:
    """Without a transaction the session owns the application lock; the batch must
    release it, or every later enqueue of that message_id elsewhere would wait."""
    conn = admin_connection(url)
    try:
        made = add(conn, store, "a", "autocommit-1")
        cursor = conn.cursor()
        cursor.execute("SELECT COUNT(*) FROM sys.dm_tran_locks WHERE request_session_id = @@SPID "
                       "AND resource_type = N'APPLICATION'")
        assert cursor.fetchone()[0] == 0
        assert add(conn, store, "a", "autocommit-1") == made
    finally:
        conn.close()


def test_the_gauges_read_through_an_open_enqueue_transaction(store: OutboxStore, url: str, writer: Any) -> None:
    """Issue 20, item 10: with RCSI off a plain read of the open rows waits for an
    uncommitted enqueue (up to the session's lock timeout, 30 s); the metrics' gauges read
    WITH (READUNCOMMITTED) and never wait. A lock timeout of 1 s on the gauges' session
    would turn any wait into error 1222, which ``gauges`` (no retry) raises."""
    add(writer, store, "committed")
    writer.commit()
    open_conn = store.engine.connect(url)
    try:
        add(open_conn, store, "uncommitted")  # its transaction stays open
        cursor = store.connection().cursor()
        cursor.execute("SET LOCK_TIMEOUT 1000")
        cursor.close()
        in_flight, backlog, lag = store.gauges()
    finally:
        open_conn.rollback()
        open_conn.close()
    assert in_flight == 0 and backlog in (1, 2) and lag >= 0  # the uncommitted row may be counted


# -- the enqueue at any isolation, its lock's key, never a session lock (issue 20 items 1-3) ------------

def outcome(call: Any) -> Any:
    """The call's result, or the exception it raised (for threads)."""
    try:
        return call()
    except BaseException as exc:  # surfaced by the test
        return exc


def test_a_read_uncommitted_caller_waits_for_an_uncommitted_row_and_inserts_after_its_rollback(
        store: OutboxStore, url: str) -> None:
    """Issue 20 item 1: at READ UNCOMMITTED the lookup returned another transaction's
    uncommitted row and inserted nothing; when that transaction rolled back, the event was lost."""
    holder, caller = store.engine.connect(url), store.engine.connect(url)
    results: list[Any] = []
    try:
        caller.cursor().execute("SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
        add(holder, store, "a", "ru-1")  # uncommitted
        thread = threading.Thread(target=lambda: results.append(outcome(lambda: add(caller, store, "b", "ru-1"))))
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not results, results  # waits instead of taking the holder's row
        holder.rollback()
        thread.join(timeout=30)
        assert results and isinstance(results[0], int), results
        caller.commit()
    finally:
        holder.close()
        caller.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table} WHERE message_id = N'ru-1' AND id = ?",
                  [results[0]]) == 1


def test_a_snapshot_caller_finds_a_row_committed_after_its_snapshot_began(store: OutboxStore, url: str) -> None:
    """Issue 20 item 1: at SNAPSHOT the lookups missed a row committed after the snapshot
    began (a duplicate-key error, or no id); READCOMMITTEDLOCK reads the committed row."""
    run_admin(url, "ALTER DATABASE CURRENT SET ALLOW_SNAPSHOT_ISOLATION ON")
    caller, other = store.engine.connect(url), store.engine.connect(url)
    try:
        cursor = caller.cursor()
        cursor.execute("SET TRANSACTION ISOLATION LEVEL SNAPSHOT")
        cursor.execute(f"SELECT COUNT(*) FROM {store.engine.table}").fetchall()  # the snapshot starts here
        first = add(other, store, "a", "snap-1")
        other.commit()
        assert add(caller, store, "b", "snap-1") == first
        caller.commit()
    finally:
        caller.close()
        other.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table} WHERE message_id = N'snap-1'") == 1


def lock_resource(store: OutboxStore, conn: Any, message_id: str) -> str:
    """The application lock resource the enqueue batch computes for ``message_id``: the
    batch's own statements up to the resource, then a SELECT of it."""
    engine: MssqlEngine = store.engine  # type: ignore[assignment]
    statements = engine.insert_statements()
    upto = next(i for i, s in enumerate(statements) if s.startswith("SET @lock_resource"))
    event = replace(prepare_event(topic="t", aggregate_type="o", aggregate_id="a", payload={}), message_id=message_id)
    cursor = conn.cursor()
    engine.execute(cursor, "\n".join(statements[:upto + 1] + ["SELECT @lock_resource;"]), engine.event_params(event))
    while cursor.description is None:
        assert cursor.nextset()
    resource = cursor.fetchone()[0]
    conn.rollback()
    return str(resource)


def test_the_lock_key_is_equal_for_ids_the_unique_index_finds_equal(store: OutboxStore, url: str,
                                                                     make_store: Any) -> None:
    """Issue 20 item 2: the key hashed the exact bytes, so `m1` and `m1 ` (equal to the
    index) took two locks. Now: equal under the column's collation, equal key."""
    conn = store.engine.connect(url)
    try:
        assert lock_resource(store, conn, "m1") == lock_resource(store, conn, "m1 ")
        assert lock_resource(store, conn, "m1") != lock_resource(store, conn, "M1")  # BIN2: two ids
        assert lock_resource(store, conn, "m1") != lock_resource(store, conn, "m2")
    finally:
        conn.close()
    name = f"outbox_ci_{uuid.uuid4().hex[:8]}"
    seed = OutboxStore(url, table=name)
    with seed.transaction() as cursor:
        seed.engine.execute(cursor, f"CREATE TABLE [dbo].[{name}] (id BIGINT IDENTITY(1,1) NOT NULL PRIMARY KEY, "
                            "message_id NVARCHAR(64) COLLATE SQL_Latin1_General_CP1_CI_AS NOT NULL, topic NVARCHAR(255) "
                            "NOT NULL, aggregate_type NVARCHAR(255) NOT NULL, aggregate_id NVARCHAR(255) NOT NULL, "
                            "partition_key NVARCHAR(255) NULL, payload NVARCHAR(MAX) NOT NULL, headers NVARCHAR(MAX) "
                            "NOT NULL DEFAULT N'{}', trace_id NVARCHAR(255) NULL, status TINYINT NOT NULL DEFAULT 0, "
                            "attempts INT NOT NULL DEFAULT 0, claimed_at DATETIME2(3) NULL, next_retry_at DATETIME2(3) "
                            "NULL, created_at DATETIME2(3) NOT NULL DEFAULT SYSUTCDATETIME(), processed_at "
                            "DATETIME2(3) NULL)")
    seed.close()
    ci = make_store(table=name)
    conn = ci.engine.connect(url)
    try:
        assert lock_resource(ci, conn, "Order-1") == lock_resource(ci, conn, "order-1 ")
    finally:
        conn.close()


def test_m1_and_m1_with_a_trailing_space_at_once_store_one_row_and_raise_nothing(store: OutboxStore,
                                                                                  url: str) -> None:
    """Issue 20 item 2: `enqueue` refuses `m1 `; the engine, given it anyway, serializes it
    with `m1` (one lock) and returns the first one's row instead of raising 2601."""
    first, second = store.engine.connect(url), store.engine.connect(url)
    with pytest.raises(EnqueueError, match="whitespace"):
        add(first, store, "a", "m1 ")
    results: list[Any] = []
    padded = replace(prepare_event(topic="t", aggregate_type="o", aggregate_id="b", payload={}), message_id="m1 ")
    try:
        held = add(first, store, "a", "m1")  # uncommitted

        def racer() -> None:
            cursor = second.cursor()
            results.append(outcome(lambda: store.engine.insert_event(cursor, padded)))
            second.commit()

        thread = threading.Thread(target=racer)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not results
        first.commit()
        thread.join(timeout=30)
        assert results == [held], results
    finally:
        first.close()
        second.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {store.engine.table}") == 1


@pytest.mark.parametrize("xact_abort", ["OFF", "ON"])
@pytest.mark.parametrize("how", ["error", "client timeout"])
def test_no_application_lock_outlives_an_aborted_autocommit_enqueue(store: OutboxStore, url: str,
                                                                     xact_abort: str, how: str) -> None:
    """Issue 20 item 3: on an autocommit connection the lock was the session's, released by
    a later statement of the batch; a batch cut short between the two (here a trigger that
    throws, or one that outlasts the client's query timeout) leaked it for the life of the
    connection, and every later enqueue of that id waited. Now it is a transaction's."""
    t = store.engine.table
    trigger = f"[dbo].[tr_{store.engine.table_name}_abort]"
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"CREATE TRIGGER {trigger} ON {t} AFTER INSERT AS BEGIN SET NOCOUNT ON; "
                             "IF EXISTS (SELECT 1 FROM inserted WHERE message_id LIKE N'boom%') "
                             "THROW 50000, N'boom', 1; "
                             "IF EXISTS (SELECT 1 FROM inserted WHERE message_id LIKE N'slow%') "
                             "WAITFOR DELAY '00:00:05'; END")
    conn = admin_connection(url)  # autocommit: no transaction open when the batch starts
    try:
        cursor = conn.cursor()
        cursor.execute(f"SET XACT_ABORT {xact_abort}")
        if how == "client timeout":
            conn.timeout = 1
        with pytest.raises(Exception):  # noqa: B017 - an error or a client timeout: the driver raises either
            add(conn, store, "a", "boom-1" if how == "error" else "slow-1")
        conn.timeout = 0
        cursor.execute("SELECT @@TRANCOUNT, (SELECT COUNT(*) FROM sys.dm_tran_locks WHERE request_session_id = @@SPID "
                       "AND resource_type = N'APPLICATION')")
        assert tuple(cursor.fetchone()) == (0, 0)
        cursor.execute("SELECT @@OPTIONS & 16384")
        assert bool(cursor.fetchone()[0]) is (xact_abort == "ON")  # the caller's setting, untouched
        assert add(conn, store, "a", "fine-1") > 0
    finally:
        conn.close()
    assert scalar(store, f"SELECT COUNT(*) FROM {t} WHERE message_id LIKE N'boom%' OR message_id LIKE N'slow%'") == 0


# -- schema: filtered probe index, definitions, collation, escalation, concurrent migrate -------------

def test_indexes_match_their_definitions_and_escalation_is_off(store: OutboxStore) -> None:
    with store.transaction() as cursor:
        for spec in INDEXES:
            assert store.engine.execute(cursor, store.engine.index_matches(spec)).fetchone(), spec.suffix
        assert store.engine.schema_problems(cursor) == []
    assert scalar(store, "SELECT lock_escalation_desc FROM sys.tables WHERE object_id = OBJECT_ID(?)",
                  [store.engine.table]) == "DISABLE"


def test_the_ordering_probe_seeks_the_filtered_index(store: OutboxStore, writer: Any) -> None:
    """Fault 2: with an aggregate's history done, the probe's plan uses agg_open."""
    for i in range(300):
        add(writer, store, "hot" if i % 3 else f"cold-{i}")
    writer.commit()
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 2 WHERE id % 2 = 0")
    conn = store.engine.connect(store.url)
    try:
        cursor = conn.cursor()
        cursor.execute("SET SHOWPLAN_XML ON")
        cursor.execute(f"SELECT 1 FROM {store.engine.table} AS e WITH (READCOMMITTEDLOCK) "
                       "WHERE e.aggregate_id = ? AND e.id < ? AND e.status IN (0, 1, 3)", ("hot", 250))
        plan = str(cursor.fetchone()[0])
        cursor.execute("SET SHOWPLAN_XML OFF")
    finally:
        conn.rollback()
        conn.close()
    assert store.engine.index_name("agg_open") in plan


def make_older_table(url: str, name: str, *, message_id: str = "NVARCHAR(64)",
                     aggregate_id: str = "NVARCHAR(255)") -> None:
    """``[dbo].[name]`` as a release before last_error and lease_token made it (or another
    script, with the id columns' types given), no index."""
    ddl = (f"CREATE TABLE [dbo].[{name}] (id BIGINT IDENTITY(1,1) NOT NULL PRIMARY KEY, message_id {message_id} "
           f"NOT NULL, topic NVARCHAR(255) NOT NULL, aggregate_type NVARCHAR(255) NOT NULL, aggregate_id {aggregate_id} "
           "NOT NULL, partition_key NVARCHAR(255) NULL, payload NVARCHAR(MAX) NOT NULL, headers NVARCHAR(MAX) NOT "
           "NULL DEFAULT N'{}', trace_id NVARCHAR(255) NULL, status TINYINT NOT NULL DEFAULT 0, attempts INT NOT "
           "NULL DEFAULT 0, claimed_at DATETIME2(3) NULL, next_retry_at DATETIME2(3) NULL, created_at DATETIME2(3) "
           "NOT NULL DEFAULT SYSUTCDATETIME(), processed_at DATETIME2(3) NULL)")
    seed = OutboxStore(url, table=name)
    with seed.transaction() as cursor:
        seed.engine.execute(cursor, ddl)
    seed.close()


def test_migrate_repairs_an_old_deployment(make_store: Any) -> None:
    """Fault 2 and 5: the retired unfiltered probe index goes, an index of the right
    name and the wrong definition is made again; re-running changes nothing."""
    store = make_store()
    engine: MssqlEngine = store.engine  # type: ignore[assignment]
    t = engine.table
    with store.transaction() as cursor:
        engine.execute(cursor, f"DROP INDEX [{engine.index_name('agg_open')}] ON {t}")
        engine.execute(cursor, f"CREATE NONCLUSTERED INDEX [{engine.index_name('agg_id_id')}] ON {t} "
                       "(aggregate_id, id) INCLUDE (status)")
        engine.execute(cursor, f"DROP INDEX [{engine.index_name('claim_ready')}] ON {t}")
        engine.execute(cursor, f"CREATE NONCLUSTERED INDEX [{engine.index_name('claim_ready')}] ON {t} (id)")
        assert len(engine.schema_problems(cursor)) == 3
    store.migrate()
    store.migrate()
    with store.transaction() as cursor:
        assert engine.schema_problems(cursor) == []


def test_a_table_made_by_another_script_in_the_database_collation_works(make_store: Any, url: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Fault 5: id columns in the database's (case-insensitive) collation: claims used
    to fail with error 468; now they work and start-up says what that changes."""
    name = f"outbox_seed_{uuid.uuid4().hex[:8]}"
    make_older_table(url, name)
    store = make_store(table=name)  # migrate adds last_error, lease_token and the indexes
    writer = store.engine.connect(url)
    try:
        ids = [add(writer, store, "Order-1"), add(writer, store, "Order-1")]
        writer.commit()
    finally:
        writer.close()
    collation = scalar(store, "SELECT collation_name FROM sys.columns WHERE object_id = OBJECT_ID(?) "
                       "AND name = N'aggregate_id'", [store.engine.table])
    claim = store.claim(10)  # error 468 before the fix
    assert [m.id for m in claim.messages] == ids
    assert store.mark_done(ids, claim.lease).ok
    fresh = OutboxStore(url, table=name)
    with caplog.at_level(logging.WARNING, logger="outbox.storage.engines.mssql"):
        fresh.connection()
    fresh.close()
    if "_BIN" not in collation.upper() and "_CS" not in collation.upper():
        assert any("case-insensitive collation" in r.getMessage() for r in caplog.records)


def test_varchar_id_columns_are_reported_with_the_alter_column_that_fixes_them(make_store: Any, url: str) -> None:
    """Found in review (6 December): VARCHAR ids in a SQL collation (a table made by another
    script). Compared with the claim's NVARCHAR table variables the column is converted, and
    no seek goes through that conversion in a SQL collation: the probes' FORCESEEK fails every
    claim (error 8622, not run here). The start-up check names the ALTER COLUMN; after it (the
    indexes on the columns dropped first, then `outbox migrate`) the relay works."""
    name = f"outbox_varchar_{uuid.uuid4().hex[:8]}"
    ci = "COLLATE SQL_Latin1_General_CP1_CI_AS"
    make_older_table(url, name, message_id=f"VARCHAR(64) {ci}", aggregate_id=f"VARCHAR(255) {ci}")
    store = make_store(table=name)  # migrate adds last_error, lease_token and the indexes, not the types
    engine: MssqlEngine = store.engine  # type: ignore[assignment]
    with store.transaction() as cursor:
        problems = [p for p in engine.schema_problems(cursor) if "not NVARCHAR" in p]
    assert len(problems) == 2 and "varchar" in problems[0], problems
    with store.transaction() as cursor:
        for suffix in ("message_id", "agg_open", "claim_ready"):
            engine.execute(cursor, f"DROP INDEX [{engine.index_name(suffix)}] ON {engine.table}")
        for column in ("message_id", "aggregate_id"):
            statement = engine.id_column_sql(column, False)
            assert any(f"`{statement}`" in p for p in problems), (statement, problems)
            engine.execute(cursor, statement)
    store.migrate()
    with store.transaction() as cursor:
        assert engine.schema_problems(cursor) == []
    writer = engine.connect(url)
    try:
        ids = [add(writer, store, "Order-1"), add(writer, store, "Order-1")]
        writer.commit()
    finally:
        writer.close()
    claim = store.claim(10)
    assert [m.id for m in claim.messages] == ids and store.mark_done(ids, claim.lease).ok


def test_two_migrations_at_once_both_succeed(url: str) -> None:
    """Fault 7: the second `outbox migrate` waits for the first (sp_getapplock)."""
    table = f"outbox_mig_{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []

    def migrate() -> None:
        store = OutboxStore(url, table=table)
        try:
            store.migrate()
        except BaseException as exc:
            errors.append(exc)
        finally:
            store.close()

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    store = OutboxStore(url, table=table)
    try:
        assert errors == []
        with store.transaction() as cursor:
            assert store.engine.schema_problems(cursor) == []
    finally:
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE {store.engine.table}")
        store.close()


# -- compatibility levels (fault 1) ----------------------------------------------------------------------

@pytest.mark.parametrize("level", [110, 120, 130])
def test_every_compatibility_level_from_110(databases: dict[str, str], level: int) -> None:
    url = databases["levels"]
    name = DATABASES["levels"]
    run_admin(url, f"ALTER DATABASE [{name}] SET COMPATIBILITY_LEVEL = {level}")
    table = f"outbox_lvl{level}_{uuid.uuid4().hex[:6]}"
    store = OutboxStore(url, table=table, max_attempts=3)
    try:
        store.migrate()
        store.migrate()
        assert store.engine.compat_level == level  # type: ignore[attr-defined]
        version = scalar(store, "SELECT CAST(PARSENAME(CAST(SERVERPROPERTY('ProductVersion') AS NVARCHAR(128)), 4) "
                         "AS INT)")
        edition = scalar(store, "SELECT CAST(SERVERPROPERTY('EngineEdition') AS INT)")
        # Issue 20 item 4: ISJSON follows the server (2016+, Azure SQL), not the level.
        assert store.engine.has_isjson is (version >= 13 or edition in (5, 8, 9))  # type: ignore[attr-defined]
        assert store.engine.has_json is (level >= 130)  # type: ignore[attr-defined]
        checks = scalar(store, "SELECT COUNT(*) FROM sys.check_constraints WHERE parent_object_id = OBJECT_ID(?) "
                        "AND definition LIKE N'%isjson%'", [store.engine.table])
        assert checks == (2 if store.engine.has_isjson else 0)  # type: ignore[attr-defined]
        writer = store.engine.connect(url)
        try:
            ids = [add(writer, store, f"agg-{i % 50}") for i in range(2500)]
            writer.commit()
        finally:
            writer.close()
        claimed: list[int] = []
        while True:
            claim = store.claim(1000)
            if not claim.messages:
                break
            assert store.mark_done([m.id for m in claim.messages], claim.lease).ok
            claimed += [m.id for m in claim.messages]
        assert sorted(claimed) == ids
        # 2,500 ids in one call: chunked below 130, one OPENJSON statement from 130.
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4")
        assert store.requeue_dead(ids) == 2500
        assert store.stats().counts["pending"] == 2500
    finally:
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE {store.engine.table}")
        store.close()


# -- concurrency, which tests/test_concurrency.py runs on PostgreSQL and MariaDB only ------------------------

@pytest.mark.slow
def test_racing_claimers_keep_order_and_never_double_claim_on_sql_server(make_store: Any, url: str) -> None:
    race_claimers(make_store, url)


# -- the claim over a hot aggregate: linear, and its plans pinned (issue 20 item 9) ----------------------

def load_hot_aggregate(store: OutboxStore, count: int, aggregate: str = "hot", first: int = 0) -> None:
    """``count`` pending rows of one aggregate in one set-based INSERT (enqueue one by one
    would take minutes)."""
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"INSERT INTO {store.engine.table} (message_id, topic, aggregate_type, "
                             "aggregate_id, payload, headers) SELECT CONCAT(?, N'-', n), N't', N'o', ?, N'{\"n\":1}', "
                             "N'{}' FROM (SELECT TOP (?) ? + ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS n "
                             "FROM sys.all_columns AS a CROSS JOIN sys.all_columns AS b) AS numbers ORDER BY n",
                             [aggregate, aggregate, count, first])


@pytest.mark.slow
def test_racing_claimers_on_one_hot_aggregate_of_40000_rows_at_batch_10000(make_store: Any) -> None:
    """Issue 20 item 9: the probe read k-1 rows for the k-th candidate of a hot aggregate,
    so a claim at batch 10,000 over a 40,000-row aggregate passed the 300 s query timeout.
    Three claimers race over it: each claim takes the next 10,000 rows in order, none twice,
    and the claims' times are printed (no timed assertion: the query timeout is the bound)."""
    store = make_store(claim_timeout_ms=600_000)
    load_hot_aggregate(store, 40_000)
    lock = threading.Lock()
    claims: list[tuple[float, list[int]]] = []  # (seconds, ids) in commit order
    errors: list[BaseException] = []

    def claimer() -> None:
        mine = OutboxStore(store.url, table=store.engine.table_name, claim_timeout_ms=600_000)
        deadline = time.monotonic() + 1500  # liveness only: each claim is bounded by the query timeout
        try:
            while time.monotonic() < deadline:
                started = time.monotonic()
                claim = mine.claim(10_000)
                took = time.monotonic() - started
                if claim.messages:
                    with lock:  # before mark_done: no other claim can take the next rows until then
                        claims.append((took, [m.id for m in claim.messages]))
                    assert mine.mark_done([m.id for m in claim.messages], claim.lease).ok
                elif scalar(mine, f"SELECT COUNT(*) FROM {mine.engine.table} WHERE status <> 2") == 0:
                    return
                else:
                    time.sleep(0.05)  # another claimer holds the aggregate's head
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            mine.close()

    threads = [threading.Thread(target=claimer) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=1800)
    assert errors == [] and not any(thread.is_alive() for thread in threads), errors
    print("\nclaims of a 40,000-row hot aggregate at batch 10,000: "
          + ", ".join(f"{len(ids)} rows in {took:.2f} s" for took, ids in claims))
    every = [int(r[0]) for r in store_rows(store, "SELECT id FROM {t} ORDER BY id")]
    # Every row once, and in claim order each claim is the aggregate's next rows in id order.
    assert [i for _, ids in claims for i in ids] == every and len(every) == 40_000
    assert all(len(ids) == 10_000 for _, ids in claims)


def store_rows(store: OutboxStore, sql: str) -> list[tuple]:
    with store.transaction() as cursor:
        return [tuple(r) for r in store.engine.execute(cursor, sql.format(t=store.engine.table)).fetchall()]


SHOWPLAN = "{http://schemas.microsoft.com/sqlserver/2004/07/showplan}"


def cached_plans(store: OutboxStore, marker: str) -> list[tuple[int, str]]:
    """(execution count, plan XML) of each cached statement of this table's claim batch
    that starts with ``marker``."""
    name = store.engine.table
    try:
        with store.transaction() as cursor:
            rows = store.engine.execute(
                cursor, "SELECT qs.execution_count, qp.query_plan, SUBSTRING(st.text, "
                "qs.statement_start_offset / 2 + 1, 200) FROM sys.dm_exec_query_stats AS qs "
                "CROSS APPLY sys.dm_exec_sql_text(qs.sql_handle) AS st "
                "CROSS APPLY sys.dm_exec_text_query_plan(qs.plan_handle, qs.statement_start_offset, "
                "qs.statement_end_offset) AS qp WHERE st.text LIKE ? AND st.text LIKE N'%DECLARE @cand%'",
                [f"%{name.replace('[', '[[]')}%"]).fetchall()
    except Exception as exc:  # the login may lack VIEW SERVER STATE
        pytest.skip(f"cannot read the plan cache: {exc}")
    return [(int(count), str(plan)) for count, plan, text in rows if str(text).lstrip().startswith(marker)]


def table_operators(plan_xml: str, table: str) -> list[tuple[str, str]]:
    """(physical operator, index) of every plan operator that reads or writes ``table``."""
    import xml.etree.ElementTree as ElementTree
    root = ElementTree.fromstring(plan_xml)
    parents = {child: parent for parent in root.iter() for child in parent}
    found = []
    for obj in root.iter(f"{SHOWPLAN}Object"):
        if obj.get("Table") != f"[{table}]":
            continue
        node = parents.get(obj)
        while node is not None and node.tag != f"{SHOWPLAN}RelOp":
            node = parents.get(node)
        if node is not None:
            found.append((node.get("PhysicalOp", ""), obj.get("Index", "")))
    return found


def test_the_probe_plan_stays_a_seek_of_agg_open_after_a_large_then_a_one_row_claim(make_store: Any) -> None:
    """Issue 20 item 9: with table variable deferred compilation the first claim's row
    count decides the cached plan of every later claim. After a claim of 5,000 rows and
    one of a single row, the cached probe reads the table only by seeks of agg_open, and
    the update only by clustered seeks (never a scan of the history)."""
    store = make_store()
    load_hot_aggregate(store, 5_000)
    load_hot_aggregate(store, 2_000, aggregate="done-history", first=10_000)
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 2, processed_at = SYSUTCDATETIME() "
                             "WHERE aggregate_id = N'done-history'")
    table = store.engine.table_name
    index = f"[{store.engine.index_name('agg_open')}]"

    def check_cached_plans() -> None:
        probes = cached_plans(store, "INSERT INTO @agg")
        assert probes, "the probe's plan is not in the cache"
        for _, plan in probes:
            operators = table_operators(plan, table)
            assert operators and all(op == ("Index Seek", index) for op in operators), operators
        for _, plan in cached_plans(store, "UPDATE o SET"):
            reads = [op for op, _ in table_operators(plan, table)
                     if not any(word in op for word in ("Update", "Insert", "Delete"))]
            assert reads and all(op == "Clustered Index Seek" for op in reads), reads

    large = store.claim(5_000)  # compiles the batch for 5,000 candidates
    assert len(large.messages) == 5_000
    assert store.mark_done([m.id for m in large.messages], large.lease).ok
    check_cached_plans()
    load_hot_aggregate(store, 1, aggregate="single", first=20_000)
    small = store.claim(1)  # runs the cached plans (or a recompiled one) for one candidate
    assert len(small.messages) == 1
    check_cached_plans()

def test_the_claims_window_walks_claim_ready_by_two_seeks_and_reads_no_waiting_row(make_store: Any) -> None:
    """docs/sqlserver.md, "The claim's two walks": claim_ready is (next_retry_at, id), filtered on
    the open rows, and the window's two walks (next_retry_at IS NULL, next_retry_at <= now) must
    each be a seek of it, whatever the parameters the batch was sent with (its filter is matched
    by the literal status IN (0, 1, 3)): no scan of the clustered index, no read of the failed
    rows whose retry is an hour away. Checked in the cached plan, next to what was claimed."""
    store = make_store()
    t = store.engine.table
    load_hot_aggregate(store, 3_000, aggregate="waiting")
    load_hot_aggregate(store, 100, aggregate="ready", first=10_000)
    load_hot_aggregate(store, 50, aggregate="due", first=20_000)
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {t} SET status = 3, attempts = 1, next_retry_at = "
                             "DATEADD(HOUR, 1, SYSUTCDATETIME()) WHERE aggregate_id = N'waiting'")
        store.engine.execute(cursor, f"UPDATE {t} SET status = 3, attempts = 1, next_retry_at = "
                             "DATEADD(SECOND, -1, SYSUTCDATETIME()), aggregate_id = CONCAT(N'due-', id) "
                             "WHERE aggregate_id = N'due'")
    claim = store.claim(500)
    claimed = {m.aggregate_id for m in claim.messages}
    assert len(claim.messages) == 150 and "waiting" not in claimed and "ready" in claimed, claimed
    ready = f"[{store.engine.index_name('claim_ready')}]"
    plans = cached_plans(store, "INSERT INTO @win")
    assert plans, "the window's plan is not in the cache"
    for _, plan in plans:
        operators = table_operators(plan, store.engine.table_name)
        assert [op for op in operators if op[1] == ready] == [("Index Seek", ready)] * 2, operators


# -- the other driver ---------------------------------------------------------------------------------------

def test_mssql_python_driver_round_trip(databases: dict[str, str]) -> None:
    url = mssql_python_url(databases["rcsi"])
    store = OutboxStore(url, table=f"outbox_mp_{uuid.uuid4().hex[:8]}")
    try:
        try:
            store.migrate()
        except Exception as exc:
            if "Failed to load the driver" in str(exc) or type(exc).__name__ == "ConnectionStringParseError":
                pytest.skip(f"mssql-python cannot connect with this URL here: {exc}")
            raise
        writer = store.engine.connect(url)
        try:
            first = add(writer, store, "a", "mp-1")
            assert add(writer, store, "a", "mp-1") == first
            writer.commit()
        finally:
            writer.close()
        claim = store.claim(5)
        assert [m.id for m in claim.messages] == [first]
        assert store.mark_done([first], claim.lease).ok
    finally:
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"IF OBJECT_ID(N'{store.engine.table}', N'U') IS NOT NULL "
                                 f"DROP TABLE {store.engine.table}")
        store.close()


# -- issue 20 items 4, 5, 6, 7, 8, 12: deployments -----------------------------------------------------------

def start_broker_worker(broker_url: str, table: str, start: Any, errors: Any) -> None:
    """What a worker process does first with the database broker: connect, which creates
    the queue tables."""
    from kombu import Connection

    import outbox.transport  # noqa: F401  (registers the outboxdb scheme)
    try:
        start.wait()
        with Connection(broker_url, transport_options={"queue_table": table}) as conn:
            conn.connect()
            conn.default_channel  # noqa: B018 - opens the channel, as a consumer does
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def test_three_broker_workers_starting_at_once_on_an_empty_database(url: str) -> None:
    """Item 5: every worker creates the queue tables at start-up; three at once on an empty
    database raced to CREATE TABLE / INDEX (2714, 1913) before the migration applock."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    for _round in range(3):
        table = f"kq_{uuid.uuid4().hex[:10]}"
        start, errors = ctx.Barrier(3), ctx.Queue()
        workers = [ctx.Process(target=start_broker_worker, args=(f"outboxdb+{url}", table, start, errors))
                   for _ in range(3)]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join(120)
            failures = []
            while not errors.empty():
                failures.append(errors.get())
            assert not failures and [w.exitcode for w in workers] == [0, 0, 0], failures
            store = OutboxStore(url)
            try:
                # Item 5 too: no escalation to a table lock that would block send_task.
                assert scalar(store, "SELECT lock_escalation_desc FROM sys.tables WHERE object_id = OBJECT_ID(?)",
                              [f"[dbo].[{table}]"]) == "DISABLE"
                assert scalar(store, "SELECT COUNT(*) FROM sys.indexes WHERE object_id = OBJECT_ID(?) AND name = ?",
                              [f"[dbo].[{table}]", f"ix_{table}_ready"]) == 1
            finally:
                store.close()
        finally:
            drop_queue_tables(url, table)


def test_the_lease_seeks_visible_rows_past_a_head_of_delayed_ones(url: str) -> None:
    """Item 12: 2,000 delayed rows (Celery retries) at the head of a queue: the lease's plan
    seeks the ready index, with no sort, and takes the one visible row."""
    from outbox.transport.database import Database
    table = f"kq_{uuid.uuid4().hex[:10]}"
    db = Database(url, table, None, create=True)
    try:
        def fill(qt: Any, cursor: Any) -> None:
            for _ in range(2000):
                qt.put(cursor, "q", "{}", "b", delay_ms=3_600_000)
            qt.put(cursor, "q", "{}", "visible")
        db.run(fill)
        rows = db.run(lambda qt, c: qt.lease(c, "q", 10, 60_000, "r" * 32))
        assert [r.body for r in rows] == ["visible"]
        conn = db.engine.connect(url)
        try:
            cursor = conn.cursor()
            cursor.execute("SET SHOWPLAN_XML ON")
            cursor.execute(f"SELECT TOP (10) id FROM {db.qt.table} WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, "
                           f"ROWLOCK) WHERE queue = ? AND {db.qt.visible()} ORDER BY visible_at, id", ("q",))
            plan = str(cursor.fetchone()[0])
            cursor.execute("SET SHOWPLAN_XML OFF")
        finally:
            conn.rollback()
            conn.close()
        assert db.qt.index_name("ready") in plan and 'PhysicalOp="Sort"' not in plan
    finally:
        db.close()
        drop_queue_tables(url, table)


@pytest.fixture
def outage_database() -> Iterator[tuple[str, str]]:
    """A database of its own that a test may take offline: (its pyodbc URL, its name)."""
    with own_database("outage", "", "cannot create a database for the outage check") as made:
        yield made


def test_a_mssql_python_broker_reconnects_after_its_session_is_killed_and_its_database_is_down(
        outage_database: tuple[str, str]) -> None:
    """Item 6: with ``outboxdb+mssql+mssqlpython://``, a killed session and a database that is
    down for a while are connection errors kombu and Celery recognise (reconnect), never
    an error that stops the worker; once the database is back, messages flow again."""
    from kombu import Connection
    from kombu.exceptions import OperationalError as KombuOperationalError

    import outbox.transport  # noqa: F401
    pyodbc_url, name = outage_database
    url = mssql_python_url(pyodbc_url)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    conn = Connection(f"outboxdb+{url}", transport_options={"queue_table": table, "polling_interval": 0.2})
    try:
        q = conn.SimpleQueue("outage")
        q.put(1)
        db = conn.default_channel.db
        spid = db.run(lambda qt, c: qt.run(c, "SELECT @@SPID").fetchone()[0])
        run_admin(mssql_url(), f"KILL {int(spid)}")  # the server ends the broker's session
        q.put(2)
        got = [q.get(block=True, timeout=20), q.get(block=True, timeout=20)]
        assert [m.payload for m in got] == [1, 2]
        for m in got:
            m.ack()
        run_admin(mssql_url(), f"ALTER DATABASE [{name}] SET OFFLINE WITH ROLLBACK IMMEDIATE")
        with pytest.raises(Exception) as raised:
            q.put(3)
        # What Celery's consumer reconnects on (kombu wraps its connection errors as its own).
        assert isinstance(raised.value, (*conn.recoverable_connection_errors, KombuOperationalError)), raised.value
        run_admin(mssql_url(), f"ALTER DATABASE [{name}] SET ONLINE")
        deadline = time.monotonic() + 60
        while True:  # reconnect as the worker does, until the database is back
            try:
                q.put(4)
                break
            except Exception as exc:
                assert isinstance(exc, (*conn.recoverable_connection_errors, KombuOperationalError)), exc
                assert time.monotonic() < deadline, f"the database did not come back: {exc}"
                time.sleep(1)
        assert q.get(block=True, timeout=20).payload == 4
        q.close()
    finally:
        conn.release()
        with contextlib.suppress(Exception):
            drop_queue_tables(pyodbc_url, table)


def test_contrib_migrations_and_admin_requeue_probe_their_connection(databases: dict[str, str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 4: Alembic's create_outbox_table and the Django admin's requeue run on a caller's
    connection: at level 120 on a 2016+ server the table gets its ISJSON checks (the
    function exists at every level) and a requeue of 2,500 ids goes without OPENJSON."""
    from outbox.contrib.alembic import create_outbox_table
    from outbox.contrib.django.schema import store_on
    url = databases["levels"]
    run_admin(url, f"ALTER DATABASE [{DATABASES['levels']}] SET COMPATIBILITY_LEVEL = 120")
    table = f"outbox_contrib_{uuid.uuid4().hex[:6]}"
    raw = MssqlEngine().connect(url)

    class Op:  # what create_outbox_table uses of Alembic's op, online
        def get_context(self) -> Any:
            from types import SimpleNamespace

            return SimpleNamespace(as_sql=False)

        def get_bind(self) -> Any:
            return raw

    class DjangoConnection:
        vendor = "microsoft"
        connection = raw

        def ensure_connection(self) -> None:
            pass

    store = OutboxStore(url, table=table)
    try:
        create_outbox_table(Op(), table=table)
        raw.commit()
        version = scalar(store, "SELECT CAST(PARSENAME(CAST(SERVERPROPERTY('ProductVersion') AS NVARCHAR(128)), 4) "
                         "AS INT)")
        checks = scalar(store, "SELECT COUNT(*) FROM sys.check_constraints WHERE parent_object_id = OBJECT_ID(?) "
                        "AND definition LIKE N'%isjson%'", [store.engine.table])
        assert checks == (2 if version >= 13 else 0)
        writer = store.engine.connect(url)
        try:
            ids = [add(writer, store, f"a{i % 9}") for i in range(2500)]
            writer.commit()
        finally:
            writer.close()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, processed_at = SYSUTCDATETIME()")
        from outbox.core.config import reset_settings
        monkeypatch.setenv("OUTBOX_TABLE", table)  # the admin's table comes from the settings
        reset_settings()
        # the admin action's store call, in Django's place a transaction left to the test
        assert store_on(DjangoConnection(), contextlib.nullcontext).requeue(ids, all_or_nothing=False).count == 2500
        raw.commit()
        assert store.stats().counts["pending"] == 2500
    finally:
        raw.close()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"IF OBJECT_ID(N'{store.engine.table}', N'U') IS NOT NULL "
                                 f"DROP TABLE {store.engine.table}")
        store.close()
        run_admin(url, f"ALTER DATABASE [{DATABASES['levels']}] SET COMPATIBILITY_LEVEL = 130")


def test_json_checks_join_a_table_with_a_bad_row_without_checking_it(make_store: Any, url: str) -> None:
    """Item 8: the checks are added WITH NOCHECK (not trusted): a non-JSON row already in the
    table neither aborts the migration nor blocks it for a scan, and the claim still takes
    that row (its UPDATE sets no JSON column, so the check is not evaluated) and buries it."""
    store = make_store()
    if not store.engine.has_isjson:
        pytest.skip("this server has no ISJSON")
    t, name = store.engine.table, store.engine.table_name
    with store.transaction() as cursor:
        for column in ("payload", "headers"):
            store.engine.execute(cursor, f"ALTER TABLE {t} DROP CONSTRAINT [ck_{name}_{column}_json]")
        store.engine.execute(cursor, f"INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload) "
                             "VALUES (N'bad-1', N't', N'o', N'a', N'not json')")
    store.migrate()
    assert scalar(store, "SELECT COUNT(*) FROM sys.check_constraints WHERE parent_object_id = OBJECT_ID(?) "
                  "AND definition LIKE N'%isjson%' AND is_not_trusted = 1", [t]) == 2
    claim = store.claim(10)
    assert [m.message_id for m in claim.dead] == ["bad-1"] and claim.messages == []
    with pytest.raises(Exception, match="(?i)check constraint"), store.transaction() as cursor:
        store.engine.execute(cursor, f"INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload) "
                             "VALUES (N'bad-2', N't', N'o', N'a', N'still not json')")


def test_requeue_all_runs_in_short_chunks_on_sql_server(store: OutboxStore, writer: Any) -> None:
    """Item 7: 2,500 dead rows requeued 1,000 per transaction; no transaction ever holds more
    than a chunk's row locks on the table (its clustered keys, counted in sys.dm_tran_locks
    from inside each chunk)."""
    for i in range(2500):
        add(writer, store, f"d{i % 13}")
    writer.commit()
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, processed_at = SYSUTCDATETIME()")
    locks: list[int] = []
    execute = store.engine.execute

    def counting(cursor: Any, text: str, params: Any = ()) -> Any:
        result = execute(cursor, text, params)
        if text.startswith("UPDATE") and "status = 0, attempts = 0" in text:
            locks.append(int(execute(cursor, "SELECT COUNT(*) FROM sys.dm_tran_locks WHERE request_session_id = "
                                     "@@SPID AND resource_type = N'KEY' AND resource_associated_entity_id IN "
                                     "(SELECT hobt_id FROM sys.partitions WHERE object_id = OBJECT_ID(?) "
                                     "AND index_id = 1)", [store.engine.table]).fetchone()[0]))
        return result

    store.engine.execute = counting  # type: ignore[method-assign]
    try:
        assert store.requeue(None).requeued == {"t": 2500}
    finally:
        store.engine.execute = execute  # type: ignore[method-assign]
    assert len(locks) == 3 and max(locks) <= 1000 and locks[-1] <= 500
    assert store.stats().counts["pending"] == 2500


def test_a_requeue_stopped_right_after_its_update_holds_no_claim_back(make_store: Any, url: str) -> None:
    """Found in review (6 December): `outbox dead requeue` ran its look at the rows and its
    UPDATE as one transaction. A client stopped after the UPDATE (Ctrl-Z, a paused job, a cut)
    kept the requeued row's new key in agg_open locked until the server dropped the session,
    and every claim's probe of a later row of that aggregate waited on it and failed with
    1222, every other aggregate's rows with it. Now each UPDATE commits as it runs."""
    store = make_store()
    writer = store.engine.connect(url)
    try:
        dead = add(writer, store, "A")
        writer.commit()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, processed_at = "
                                 "SYSUTCDATETIME(), last_error = N'retriable: no queue' WHERE id = ?", [dead])
        requeuer = OutboxStore(store.url, table=store.engine.table_name)
        updated, resume, outcomes = threading.Event(), threading.Event(), []
        execute = requeuer.engine.execute

        def stopping(cursor: Any, text: str, params: Any = ()) -> Any:
            result = execute(cursor, text, params)
            if text.startswith("UPDATE") and "status = 0, attempts = 0" in text:
                updated.set()
                resume.wait(60)  # the client stops here: nothing more reaches the server
            return result

        requeuer.engine.execute = stopping  # type: ignore[method-assign]
        thread = threading.Thread(target=lambda: outcomes.append(outcome(lambda: requeuer.requeue([dead]))))
        thread.start()
        try:
            assert updated.wait(30)
            later, other = add(writer, store, "A"), add(writer, store, "B")
            writer.commit()
            cursor = store.connection().cursor()
            cursor.execute("SET LOCK_TIMEOUT 2000")  # a wait would fail in 2 s, not 30
            cursor.close()
            claim = store.claim(10)  # raised 1222 (after its retries) before the fix
        finally:
            resume.set()
            thread.join(60)
            requeuer.close()
    finally:
        writer.close()
    assert sorted(m.id for m in claim.messages) == [dead, later, other]
    assert [getattr(o, "requeued", o) for o in outcomes] == [{"t": 1}]


def test_late_acks_of_expired_leases_wait_for_a_claim_held_open_and_never_deadlock(make_store: Any,
                                                                                   url: str) -> None:
    """Issue 20: a claim that holds its transaction open (a caller's transaction here; the
    relay's own claim commits inside its batch) while late acknowledgements of the expired
    leases it took over retry: they wait for its locks and are refused once it commits,
    none is chosen as a deadlock victim (1205), and the claim's lease keeps every row."""
    store = make_store(claim_timeout_ms=1000)
    writer = store.engine.connect(url)
    try:
        for n in range(40):
            add(writer, store, f"agg-{n % 8}")
        writer.commit()
    finally:
        writer.close()
    first = store.claim(40)
    ids = [m.id for m in first.messages]
    assert len(ids) == 40
    time.sleep(1.5)  # the lease expires
    holder = store.engine.connect(url)
    lease = uuid.uuid4().hex
    outcomes: list[Any] = []
    lock = threading.Lock()

    def late_acks(part: list[int]) -> None:
        mine = OutboxStore(store.url, table=store.engine.table_name, claim_timeout_ms=1000)
        try:
            for call in (lambda: mine.mark_done(part, first.lease), lambda: mine.release(part, first.lease),
                         lambda: mine.mark_failed(part[0], first.lease, "late", timedelta(seconds=1))):
                result = outcome(call)
                with lock:
                    outcomes.append(result)
        finally:
            mine.close()

    try:
        cursor = holder.cursor()
        taken = store.engine.claim(cursor, 40, lease, 1000, 5)  # held open: not committed yet
        assert len(taken) == 40
        threads = [threading.Thread(target=late_acks, args=(ids[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)  # the acknowledgements wait on the claim's locks
        holder.commit()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        holder.close()
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not [e for e in errors if "1205" in str(e) or "deadlock" in str(e).lower()], errors
    assert errors == [] and len(outcomes) == 12, outcomes
    assert all(not getattr(o, "ok", getattr(o, "applied", False)) for o in outcomes), outcomes  # all refused
    held = scalar(store, f"SELECT COUNT(*) FROM {store.engine.table} WHERE status = 1 AND lease_token = ?", [lease])
    assert held == 40
