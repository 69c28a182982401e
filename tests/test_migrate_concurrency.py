"""Migrations of one outbox table that run at the same time (every replica's start-up runs
``outbox migrate``; a deploy job beside ``manage.py migrate`` or ``alembic upgrade``) all
succeed: one at a time (``Engine.lock_migration``). Before, on PostgreSQL all but one failed
on a unique violation in pg_type or pg_class (concurrent CREATE TABLE IF NOT EXISTS), and on
MariaDB on "Duplicate column name 'last_error'" (both found the column missing)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from engine_support import drop_table
from services import MYSQL_URL, require
from tsql_support import parse_one

from outbox.storage.engines.mssql.engine import MssqlEngine
from outbox.storage.engines.mysql import MysqlEngine
from outbox.storage.store import OutboxStore

RACERS = 4


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
@pytest.mark.parametrize("round_", range(3))
def test_concurrent_migrations_of_an_empty_database_all_succeed(url: str, round_: int) -> None:
    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    stores = [OutboxStore(url, table=table) for _ in range(RACERS)]
    for store in stores:
        store.connection()  # connected before the start: the race is the DDL's
    start = threading.Barrier(RACERS)
    outcomes: list[Any] = [None] * RACERS

    def migrate(i: int) -> None:
        start.wait()
        try:
            stores[i].migrate()
            outcomes[i] = "ok"
        except Exception as exc:  # what each racer met is the assertion
            outcomes[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=migrate, args=(i,)) for i in range(RACERS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert outcomes == ["ok"] * RACERS
        assert stores[0].migrate() == 0  # complete: nothing left to repair
        columns = (stores[0].schema_state() or (frozenset(),))[0]
        assert {"last_error", "lease_token"} <= columns
    finally:
        drop_table(stores[0])
        for store in stores:
            store.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_a_migration_with_nothing_to_do_takes_no_lock_behind_an_open_transaction(url: str) -> None:
    """Found in review: on PostgreSQL a re-run of ``outbox migrate`` (every replica's start-up)
    ran ADD COLUMN / CREATE INDEX IF NOT EXISTS, which take their locks before they look, so
    behind an application transaction that had enqueued and stayed open it waited, and every
    enqueue and claim after it queued behind that wait. Now each such step is probed first:
    the re-run finishes while the transaction is still open."""
    from outbox import enqueue

    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    store = OutboxStore(url, table=table)
    store.migrate()
    app = store.engine.connect(url)  # the application's transaction, left open
    rerun = OutboxStore(url, table=table)
    try:
        enqueue(app, topic="t", aggregate_type="a", aggregate_id="1", payload={}, table=table)
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(rerun.migrate()), daemon=True)
        thread.start()
        thread.join(5)
        assert done == [0], "the re-run waited behind the open transaction"
    finally:
        app.rollback()
        app.close()
        rerun.close()
        drop_table(store)
        store.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_a_table_name_of_63_characters_gets_every_index_and_relays(url: str) -> None:
    """Found in review: OUTBOX_TABLE may take 63 characters, but ``ix_<table>_<suffix>`` did
    not fit: PostgreSQL cut the names (two collided, so an index was missing and ``outbox
    check`` said so for ever), MariaDB refused them half-way through the migration. Names
    that would not fit are shortened with a hash of the table's name."""
    from outbox import enqueue
    from outbox.storage.engines.describe import expected_index_names, index_names

    table = f"outbox_{uuid.uuid4().hex}".ljust(63, "x")
    store = OutboxStore(url, table=table)
    try:
        store.migrate()
        assert store.migrate() == 0  # complete: nothing left to repair
        with store.transaction() as cursor:
            found = index_names(store.engine, cursor)
            enqueue(cursor.connection, topic="t", aggregate_type="a", aggregate_id="1", payload={}, table=table)
        assert expected_index_names(store.engine) <= found
        assert all(len(name) <= 63 for name in expected_index_names(store.engine))
        claim = store.claim(10)
        assert len(claim.messages) == 1 and store.mark_done([claim.messages[0].id], claim.lease).ok
    finally:
        drop_table(store)
        store.close()


#: The migration's lock bound in the tests below (10 s in production), in seconds.
BOUND_S = 3


def _short_lock_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox.storage.engines import mysql, postgres
    monkeypatch.setattr(postgres.PostgresEngine, "MIGRATION_LOCK_TIMEOUT", f"{BOUND_S}s")
    monkeypatch.setattr(mysql, "MIGRATION_LOCK_WAIT_S", BOUND_S)


def _session_id(engine: Any, conn: Any) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if engine.name == "postgresql" else "SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


class Writer(threading.Thread):
    """An application that enqueues one event per connection, over and over, and times each
    (connect, enqueue, commit): how long the migration held it back."""

    def __init__(self, store: OutboxStore) -> None:
        super().__init__(daemon=True)
        self.store, self.stop = store, threading.Event()
        self.waits: list[float] = []

    def run(self) -> None:
        from outbox import enqueue

        while not self.stop.is_set():
            started = time.monotonic()
            conn = self.store.engine.connect(self.store.url)
            try:
                enqueue(conn, topic="t", aggregate_type="a", aggregate_id="w", payload={},
                        table=self.store.engine.table_name)
                conn.commit()
            finally:
                conn.close()
            self.waits.append(time.monotonic() - started)
            time.sleep(0.05)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_migration_behind_an_open_transaction_holds_writers_back_once_and_names_the_holder(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run that must repair something (an index dropped by hand: an upgrade that adds
    one) waits for the table's lock behind an application transaction that stays open, and
    while it waits every enqueue and claim queues behind it. That wait is bounded (10 s;
    MySQL/MariaDB's lock_wait_timeout was a year until found in review), but the store
    retried the lock timeout as transient: five bounds, writers held back 50 s on PostgreSQL
    and 53 s on MariaDB, then an error that named neither the holder nor the fix (found in
    review). Now the migration waits one bound and fails naming the holder's session."""
    from outbox import enqueue
    from outbox.core.errors import StoreError

    _short_lock_bound(monkeypatch)
    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    store = OutboxStore(url, table=table)
    store.migrate()
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"DROP INDEX {store.engine.quote(store.engine.index_name('claim_ready'))}"
                             + (f" ON {store.engine.table}" if store.engine.name == "mysql" else ""))
    app = store.engine.connect(url)
    with app.cursor() as cursor:  # an application's session: none of the relay's own bounds on idling
        cursor.execute("SET idle_in_transaction_session_timeout = 0" if store.engine.name == "postgresql"
                       else "SET SESSION idle_transaction_timeout = 0, SESSION wait_timeout = 28800")
    app.commit()
    holder = _session_id(store.engine, app)
    rerun = OutboxStore(url, table=table)
    writer = Writer(store)
    try:
        try:
            enqueue(app, topic="t", aggregate_type="a", aggregate_id="1", payload={}, table=table)
            writer.start()
            time.sleep(0.5)
            started = time.monotonic()
            with pytest.raises(StoreError) as refused:
                rerun.migrate()
            took = time.monotonic() - started
            time.sleep(1)
            writer.stop.set()
            writer.join(30)
        finally:
            app.rollback()
            app.close()
            writer.stop.set()
            rerun.close()
        said = str(refused.value)
        assert took < 2 * BOUND_S, f"the migration held writers back {took:.1f} s: {said}"
        assert writer.waits and max(writer.waits) < BOUND_S + 2, writer.waits
        assert f" {holder} " in said and "commit" in said and "outbox migrate again" in said, said
        assert store.migrate() == 1  # the index, once nothing holds the table
    finally:
        drop_table(store)
        store.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_the_migrations_lock_bound_is_the_callers_again_once_it_is_done(url: str) -> None:
    """An Alembic revision runs the relay's migration inside its own transaction and may go
    on with steps of its own: the 10 s bound the migration sets for its DDL steps was left
    in place for them (PostgreSQL: ``SET LOCAL`` lasts to the commit; found in review)."""
    from outbox.storage.store import apply_migration

    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    store = OutboxStore(url, table=table)
    raw = store.engine.connect(url)
    cursor = store.engine.cursor_for(raw)
    setting, read = (("SET lock_timeout = '3min'", "SHOW lock_timeout") if store.engine.name == "postgresql"
                     else ("SET SESSION lock_wait_timeout = 77", "SELECT @@SESSION.lock_wait_timeout"))
    try:
        store.engine.execute(cursor, setting)
        before = store.engine.execute(cursor, read).fetchone()[0]
        apply_migration(store.engine, cursor)
        assert store.engine.execute(cursor, read).fetchone()[0] == before
        raw.commit()
    finally:
        raw.rollback()
        raw.close()
        drop_table(store)
        store.close()


def test_a_migration_on_an_autocommit_postgres_connection_succeeds(tmp_path: Any) -> None:
    """``apply_migration`` on an autocommit connection (an Alembic ``autocommit_block()``, an
    engine with ``isolation_level="AUTOCOMMIT"``): the saved bound lasted one statement, and
    putting it back failed with 'invalid value for parameter "lock_timeout": ""' after the
    DDL had run, at every re-run (found in review)."""
    from engine_support import engine_url

    from outbox.storage.store import apply_migration

    url = engine_url("postgresql", tmp_path)
    table = f"outbox_m{uuid.uuid4().hex[:10]}"
    store = OutboxStore(url, table=table)
    raw = store.engine.connect(url)
    raw.autocommit = True
    try:
        cursor = store.engine.cursor_for(raw)
        assert apply_migration(store.engine, cursor) >= 0
        assert apply_migration(store.engine, cursor) == 0
    finally:
        raw.close()
        drop_table(store)
        store.close()


#: Table names whose index names earlier releases wrote in full, ``ix_<table>_<suffix>`` (before
#: ``derived_name`` shortened them with a hash): on PostgreSQL 58 characters, so every index name
#: and ``ck_<table>_open`` were cut at 63 (apart: ``..._a``, ``_c``, ``_d``, ``_m``, ``_o``); on
#: MySQL/MariaDB 43, the longest name MariaDB took whole (64, ``done_processed_at``); SQLite any.
LEGACY_TABLE_CHARS = {"postgresql": 58, "mysql": 43, "sqlite": 58}


def _old_names(prefix: str, table: str, suffix: str) -> str:
    """``derived_name`` of the releases before e6a62fb: the name in full, whatever its length."""
    return f"{prefix}{table}{suffix}"


def _index_oids(store: OutboxStore) -> dict[str, int]:
    with store.transaction() as cursor:
        store.engine.execute(cursor, "SELECT c.relname, c.oid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                             "WHERE i.indrelid = to_regclass(?) AND NOT i.indisprimary", [store.engine.table])
        return {str(name): int(oid) for name, oid in cursor.fetchall()}


def _check_names(store: OutboxStore) -> set[str]:
    with store.transaction() as cursor:
        store.engine.execute(cursor, "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(?) "
                             "AND contype = 'c'", [store.engine.table])
        return {str(row[0]) for row in cursor.fetchall()}


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_indexes_an_earlier_release_named_in_full_are_renamed_not_built_again(
        url: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in the upgrade review: a table migrated by a release before the hashed names kept
    its indexes under their old names (PostgreSQL had cut them at 63 characters), and the new
    ``outbox migrate`` built a second copy of each beside them (``CREATE INDEX`` on the live
    table: every enqueue and claim waited for the build) and never dropped the first. Now
    the old index is renamed: one index of each kind, the same one (PostgreSQL: the same oid)."""
    from outbox.storage.engines import base, mysql, postgres
    from outbox.storage.engines.describe import expected_index_names, index_names

    table = f"outbox_{uuid.uuid4().hex}".ljust(LEGACY_TABLE_CHARS[kind], "x")
    store = OutboxStore(url, table=table)
    try:
        with monkeypatch.context() as old_release:
            for module in (base, mysql, postgres):
                old_release.setattr(module, "derived_name", _old_names)
            store.migrate()
        with store.transaction() as cursor:
            before = index_names(store.engine, cursor)
        assert not expected_index_names(store.engine) <= before  # the old names are there, not the new
        oids = _index_oids(store) if kind == "postgresql" else {}
        store.migrate()
        with store.transaction() as cursor:
            after = index_names(store.engine, cursor)
        assert {name for name in after if name.startswith("ix_")} == expected_index_names(store.engine)
        if kind == "postgresql":
            assert sorted(_index_oids(store).values()) == sorted(oids.values())  # renamed: no index built
            assert _check_names(store) >= {base.derived_name("ck_", table, "_open")}
            assert not any(name.startswith("ck_") and name != base.derived_name("ck_", table, "_open")
                           for name in _check_names(store))
        assert store.migrate() == 0
    finally:
        drop_table(store)
        store.close()


def _migrate_processes(url: str, table: str, cwd: Path, count: int = 2) -> list[subprocess.Popen[str]]:
    """``count`` `outbox migrate` processes (two: two replicas' start-ups) on ``table``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    env.update(OUTBOX_DATABASE_URL=url, OUTBOX_TABLE=table)
    return [subprocess.Popen([sys.executable, "-m", "outbox.cli", "migrate"], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]


def _reports(processes: list[subprocess.Popen[str]]) -> list[str]:
    done = [(p.communicate(timeout=120), p.returncode) for p in processes]
    assert [code for _, code in done] == [0, 0], done
    return sorted(out.strip() for (out, _), _ in done)


def test_of_two_outbox_migrate_processes_on_a_new_mariadb_table_the_one_that_waited_says_so(tmp_path: Path) -> None:
    """Each read the table for its report before taking the migration's lock (GET_LOCK): the
    one that waited read it while the other was half-way and said `repaired (added last_error,
    lease_token, ix_..., <table>_holders)` beside the other's `created the table` (3 of 3 runs,
    found in review). The states are read under the lock: it says it changed nothing, and that
    it waited. The test holds the lock until both processes wait for it."""
    require("MariaDB/MySQL", "127.0.0.1", 3306)
    table = f"outbox_race{uuid.uuid4().hex[:8]}"
    store = OutboxStore(MYSQL_URL, table=table)
    e = store.engine
    assert isinstance(e, MysqlEngine)
    key = e._migration_lock_key()
    holder = e.connect(MYSQL_URL)
    processes: list[subprocess.Popen[str]] = []
    try:
        cursor = holder.cursor()
        cursor.execute("SELECT GET_LOCK(%s, 10)", [key])
        assert cursor.fetchone()[0] == 1
        processes = _migrate_processes(MYSQL_URL, table, tmp_path)

        def waiting() -> int:
            cursor.execute("SELECT COUNT(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID() "
                           "AND info LIKE %s", [f"%GET_LOCK(%{key}%"])
            return int(cursor.fetchone()[0])

        deadline = time.monotonic() + 60
        while waiting() < 2 and time.monotonic() < deadline and all(p.poll() is None for p in processes):
            time.sleep(0.05)
        assert waiting() == 2, "the two migrations never both waited for the lock"
    finally:
        holder.cursor().execute("SELECT RELEASE_LOCK(%s)", [key])
        holder.close()
        reports = _reports(processes) if processes else []
    try:
        created = [r for r in reports if r.endswith("created the table and its indexes")]
        assert len(created) == 1, reports
        (other,) = [r for r in reports if r not in created]
        assert "nothing to change (waited " in other and "for another migration of the table" in other, other
    finally:
        drop_table(store)
        store.close()


def test_of_two_outbox_migrate_processes_on_a_new_sqlite_table_one_says_it_created_it(tmp_path: Path) -> None:
    """SQLite's migration lock is its writer lock, taken by the migration's BEGIN IMMEDIATE: both
    processes read the table (missing) for their report before it, and both said `created the
    table`. The states are read in the transaction: the second says it changed nothing, and that
    it waited (``SqliteEngine.lock_migration`` asks first without waiting). The test holds the writer lock until both wait for it in
    SQLite's busy handler (their main thread asleep in the kernel's nanosleep, the file open)."""
    path = tmp_path / "o.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")  # as the engine opens it, which then takes no lock to set it
    holder.execute("BEGIN IMMEDIATE")
    processes = _migrate_processes(f"sqlite:///{path}", "outbox", tmp_path)
    try:
        def waiting() -> int:
            return sum(_has_open(p.pid, path) and _wchan(p.pid) == "hrtimer_nanosleep" for p in processes)

        deadline = time.monotonic() + 60
        while waiting() < 2 and time.monotonic() < deadline and all(p.poll() is None for p in processes):
            time.sleep(0.05)
        assert waiting() == 2, "the two migrations never both waited for the writer lock"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        reports = _reports(processes)
    created = [r for r in reports if r.endswith("created the table and its indexes")]
    assert len(created) == 1, reports
    (other,) = [r for r in reports if r not in created]
    assert "nothing to change (waited " in other and "for another migration of the table" in other, other


def test_an_outbox_migrate_on_sqlite_that_waited_for_a_relays_write_does_not_say_another_migration_ran(
        tmp_path: Path) -> None:
    """SQLite's migration lock is the writer lock every writer takes: a relay's claim, an
    enqueue. `outbox migrate` beside a running relay said "nothing to change (waited under 0.1 s
    for another migration of the table to finish first; what that one changed, its own report
    says)" on 3 runs of 8, and "waited 6.4 s" beside a busy writer, with no other migration
    anywhere (found in review). A wait is one for another migration only where the table's
    definition changed meanwhile. The test holds the writer lock, as a relay's write does,
    until the migration waits for it in SQLite's busy handler, then commits a row."""
    path = tmp_path / "o.db"
    url = f"sqlite:///{path}"
    store = OutboxStore(url)
    store.migrate()
    store.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO outbox (message_id, topic, aggregate_type, aggregate_id, payload, headers) "
                   "VALUES ('m1', 't', 'a', '1', '{}', '{}')")
    (process,) = _migrate_processes(url, "outbox", tmp_path, count=1)
    try:
        deadline = time.monotonic() + 60
        while not (_has_open(process.pid, path) and _wchan(process.pid) == "hrtimer_nanosleep") \
                and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, "the migration never waited for the writer lock"
    finally:
        holder.execute("COMMIT")
        holder.close()
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.strip() == 'migrated "outbox" on sqlite: nothing to change', out


def _has_open(pid: int, path: Path) -> bool:
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def _wchan(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/wchan").read_text()
    return None


def test_sql_servers_report_reads_the_table_after_its_lock_batch(no_sqlglot_fallbacks: None) -> None:
    """No SQL Server runs here. Its migration lock is its first batch (sp_getapplock), so the
    report's states are read after that step (``Engine.migration_lock_step``), and the table's
    existence is asked of the catalog (a read of a missing table dooms the transaction under
    XACT_ABORT ON): that query parses as T-SQL, and the first batch is the lock."""
    engine = MssqlEngine()
    assert engine.migration_lock_step
    assert "sp_getapplock" in engine.migration()[0]
    asked: list[tuple[str, tuple]] = []

    class Catalog:  # records the statement, answers as a catalog without the table
        def execute(self, sql: str, params: tuple = ()) -> Catalog:
            asked.append((sql, tuple(params)))
            return self

        def fetchone(self) -> None:
            return None

    assert engine.table_exists(Catalog(), engine.table) is False
    ((sql, params),) = asked
    parse_one(sql.replace("?", "N'" + str(params[0]) + "'"))
