"""The archive's lock (``outbox.pipeline.lock``) on the real databases, without Spark: one
holder at a time, gone with its holder (a SIGKILLed process), kept while its session is
idle past the relay's idle bounds, a lost session reported; its T-SQL parsed by sqlglot.
The archive runs that take it: tests/test_pipeline_archive.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tsql_support import no_sqlglot_fallbacks  # noqa: F401 - a fixture

import outbox
from outbox.pipeline.common import PipelineError
from outbox.pipeline.lock import ArchiveLock, lock_name
from outbox.storage.engines.mssql.schema import session_lock_held_sql, session_lock_sql, session_unlock_sql
from outbox.storage.store import OutboxStore

ARCHIVE = "file:/data/outbox-archive"


@pytest.fixture
def archive(store: OutboxStore) -> str:
    """An archive of this test's own: the lock is the database server's, so two tests (on two
    xdist workers) locking one archive name would wait on each other."""
    return f"{ARCHIVE}-{store.engine.table_name}"

HOLD = """
import sys, time
from outbox.pipeline.lock import ArchiveLock
from outbox.storage.store import OutboxStore
lock = ArchiveLock(OutboxStore(sys.argv[1], table=sys.argv[2]), sys.argv[3])
print("held" if lock.try_acquire() else "refused", flush=True)
time.sleep(600)
"""


def holder_process(store: OutboxStore, archive: str) -> subprocess.Popen[str]:
    """Another process that takes ``archive``'s lock and keeps it until it is killed."""
    src = str(Path(outbox.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, store.url, store.engine.table_name, archive],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_one_holder_at_a_time_and_the_lock_ends_with_its_holder(store: OutboxStore, archive: str) -> None:
    proc = holder_process(store, archive)
    try:
        lock = ArchiveLock(store, archive)
        assert not lock.try_acquire()
        other = ArchiveLock(store, archive + "-another")  # another archive: its own lock
        assert other.try_acquire()
        other.release()
        proc.send_signal(signal.SIGKILL)  # no release, no clean-up: the session (or the process's flock) ends
        proc.wait(30)
        deadline = time.monotonic() + 10
        while not lock.try_acquire():
            assert time.monotonic() < deadline, "the lock outlived its SIGKILLed holder"
            time.sleep(0.2)
        again = ArchiveLock(store, archive)
        assert not again.try_acquire()  # in one process too: two sessions, two open files
        lock.release()
        assert again.try_acquire()
        again.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_the_lock_outlasts_the_relays_idle_bounds_and_a_lost_session_is_reported(store: OutboxStore,
                                                                                 archive: str) -> None:
    """The lock's session is the relay's (ended by the server when idle in a transaction
    5 s; on MySQL when idle at all): it commits every statement and is pinged, so an idle
    hold of 7 s keeps it. When the server ends that session, ``check`` says so."""
    lock = ArchiveLock(store, archive)
    assert lock.try_acquire()
    try:
        if store.engine.name == "mysql":  # a vanished holder's session ends within the TCP bound
            with lock._guard:
                cursor = lock._conn.cursor()
                cursor.execute("SELECT @@session.wait_timeout")
                assert int(cursor.fetchone()[0]) == 10
                cursor.close()
                lock._conn.commit()
        time.sleep(7)
        lock.check("committing")
        assert not ArchiveLock(store, archive).try_acquire()
        with store.transaction() as cursor:  # the server ends the lock's session
            if store.engine.name == "postgresql":
                store.engine.execute(cursor, "SELECT pg_terminate_backend(?)", [lock._conn.info.backend_pid])
            else:
                store.engine.execute(cursor, f"KILL {int(lock._conn.thread_id())}")
        deadline = time.monotonic() + 10
        with pytest.raises(PipelineError, match=rf"lost the lock of the archive {re.escape(archive)} .*"
                                                r"stopped before committing: run again"):
            while time.monotonic() < deadline:
                lock.check("committing")
                time.sleep(0.2)
    finally:
        lock.release()
    taken = ArchiveLock(store, archive)
    assert taken.try_acquire()
    taken.release()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_the_check_asks_the_database_so_a_lock_lost_a_moment_ago_stops_the_run(store: OutboxStore,
                                                                               archive: str) -> None:
    """``check`` (before the commit, before the delete) asks the lock's session whether it
    still holds the lock, at once: a session the server ended a moment ago, or one that
    no longer holds the lock, stops the run, where a flag the 2 s ping sets missed it."""
    lock = ArchiveLock(store, archive)
    assert lock.try_acquire()
    try:
        lock.check("committing")  # held: no error
        with store.transaction() as cursor:  # the server ends the lock's session
            if store.engine.name == "postgresql":
                store.engine.execute(cursor, "SELECT pg_terminate_backend(?)", [lock._conn.info.backend_pid])
            else:
                store.engine.execute(cursor, f"KILL {int(lock._conn.thread_id())}")
        with pytest.raises(PipelineError, match=rf"lost the lock of the archive {re.escape(archive)} "
                                                r"\(its database session ended: .*stopped before committing: run again"):
            lock.check("committing")
    finally:
        lock.release()

    lock = ArchiveLock(store, archive)
    assert lock.try_acquire()
    try:
        with lock._guard:  # the session lives on, but no longer holds the lock
            lock._statement(lock._conn, store.engine.session_unlock_statement(lock.name))
        with pytest.raises(PipelineError, match=r"\(its database session no longer holds it\); stopped before "
                                                r"deleting"):
            lock.check("deleting")
    finally:
        lock.release()


@pytest.mark.parametrize("kind", ["sqlite"])
def test_on_sqlite_the_check_finds_a_lock_file_removed_and_made_again(store: OutboxStore, archive: str) -> None:
    """SQLite's lock is a flock on a file beside the database: removed, a second run makes
    the file again and takes a lock of its own on it, so ``check`` compares the file this
    run holds open with the one at the path, now."""
    lock = ArchiveLock(store, archive)
    assert lock.try_acquire()
    try:
        lock.check("committing")
        os.remove(lock._lock_path)
        with pytest.raises(PipelineError, match=r"its lock file .* was removed\); stopped before committing"):
            lock.check("committing")
        other = ArchiveLock(store, archive)
        assert other.try_acquire()  # the very overlap the check is there for
        other.release()
        with pytest.raises(PipelineError, match=r"its lock file .* was replaced\); stopped before deleting"):
            lock.check("deleting")
    finally:
        lock.release()


@pytest.mark.usefixtures("no_sqlglot_fallbacks")
def test_the_sql_server_lock_parses_as_tsql() -> None:
    import sqlglot
    from sqlglot import exp

    name = lock_name(ARCHIVE)
    assert len(name) <= 255  # sp_getapplock's @Resource
    take = sqlglot.parse(session_lock_sql(name), read="tsql")
    assert [type(s).__name__ for s in take] == ["Set", "Declare", "Execute", "Select"]
    release = sqlglot.parse(session_unlock_sql(name), read="tsql")
    assert [type(s).__name__ for s in release] == ["Execute"]
    held = sqlglot.parse(session_lock_held_sql(name), read="tsql")
    assert [type(s).__name__ for s in held] == ["Select"]
    assert "APPLOCK_MODE(N'public', N'outbox archive " in session_lock_held_sql(name)
    for statement in [*take, *release, *held]:
        assert statement is not None and not list(statement.find_all(exp.Command))
    assert "@LockOwner = N'Session'" in session_lock_sql(name) and "@LockTimeout = 0" in session_lock_sql(name)
    assert session_lock_sql("it's").count("N'it''s'") == 1
