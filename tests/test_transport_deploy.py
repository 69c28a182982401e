"""The ``outboxdb`` broker when a deployment starts or its database goes away (issue 20
items 5, 6, 12), on live SQLite, PostgreSQL and MariaDB:

- a lost database is one of the Transport CLASS's connection errors, since kombu and
  Celery read them from the class and stop a worker on any other error;
- the driver's own error classes follow the URL's driver (mssql-python's, not pyodbc's);
- workers creating the queue tables at the same moment on an empty database all start;
- the receive statement skips delayed and leased rows at a queue's head through its
  index, and a requeued message keeps its place.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from engine_support import engine_url
from kombu import Connection, Queue
from kombu.exceptions import OperationalError as KombuOperationalError
from services import free_port

import outbox.transport  # noqa: F401  (registers the outboxdb scheme)
from outbox.core.errors import BrokerDatabaseUnavailable
from outbox.storage.engines import engine_for_url
from outbox.transport import drop_queue_tables
from outbox.transport.channel import Transport
from outbox.transport.database import Database
from outbox.transport.tables import queue_tables


def test_a_lost_database_is_a_connection_error_of_the_transport_class() -> None:
    """Celery's consumer restarts the broker connection only for ``conninfo.connection_errors``,
    which kombu reads from the transport class: a driver error raised as itself (the
    instance-level list) stopped the worker at the first database restart."""
    url = f"outboxdb+postgresql://postgres@127.0.0.1:{free_port()}/test"  # nothing listens there
    conn = Connection(url, transport_options={"queue_table": "kq_unused"})
    assert BrokerDatabaseUnavailable in conn.connection_errors
    transport = conn.transport
    db = transport.database("kq_unused", None, create=True)
    with pytest.raises(Exception) as raised:
        db.run(lambda qt, c: None)
    assert isinstance(raised.value, conn.recoverable_connection_errors)
    assert isinstance(raised.value, BrokerDatabaseUnavailable)
    assert type(raised.value.__cause__).__module__.startswith("psycopg")
    # kombu itself: a recoverable error, raised as its own OperationalError after retrying.
    with pytest.raises(KombuOperationalError, match="broker's database is unavailable"):
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    conn.release()


def test_driver_error_classes_follow_the_urls_driver() -> None:
    mssql_python = pytest.importorskip("mssql_python")
    transport = Connection("outboxdb+mssql+mssqlpython://u:p@127.0.0.1:1/db").transport
    assert isinstance(transport, Transport)
    assert mssql_python.OperationalError in transport.connection_errors
    assert mssql_python.InterfaceError in transport.connection_errors
    assert mssql_python.DatabaseError in transport.channel_errors
    assert BrokerDatabaseUnavailable in transport.connection_errors


def test_a_statement_the_server_cancels_is_a_connection_error(tmp_path: Path) -> None:
    """PostgreSQL cancels the lease (a ``statement_timeout`` set for the broker's role, or
    ``pg_cancel_backend``) while another session holds the table's lock: the receive fails
    with a connection error, which Celery recovers from by reconnecting, and once the lock
    goes the same connection receives. Before, QueryCanceled came out as itself, no
    connection error of the transport class: Celery stopped the worker."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url

    direct = engine_url("postgresql", tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    bounded = f"{direct}?options=-c%20statement_timeout%3D200"
    with Connection(f"outboxdb+{direct}", transport_options={"queue_table": table}) as setup:
        setup.SimpleQueue("cancelled").put("m")
    holder = psycopg.connect(make_conninfo(libpq_url(direct)))
    try:
        with Connection(f"outboxdb+{bounded}", transport_options={"queue_table": table}) as conn:
            channel = conn.default_channel
            channel.db.run(lambda qt, c: None)  # connected (the session set-up takes no table lock)
            holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(conn.connection_errors) as raised:
                Queue("cancelled")(channel).get()
            assert isinstance(raised.value, BrokerDatabaseUnavailable)
            assert isinstance(raised.value.__cause__, psycopg.errors.QueryCanceled)
            holder.rollback()
            message = Queue("cancelled")(channel).get()
            assert message is not None and message.payload == "m"
            message.ack()
    finally:
        holder.close()
        drop_queue_tables(direct, table)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_connection_to_a_server_turned_read_only_is_replaced(kind: str, tmp_path: Path) -> None:
    """After a failover the transport's connection may still reach the old primary, now
    read-only (PostgreSQL 25006, MySQL/MariaDB 1290 or 1792): the send is retried on a new
    connection, which finds the primary (here: a session set read-only, which the new
    connection is not), and goes through. Before, the driver's error came out as itself,
    no connection error of the transport class: Celery stopped the worker."""
    direct = engine_url(kind, tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    read_only = ("SET SESSION default_transaction_read_only = on" if kind == "postgresql"
                 else "SET SESSION TRANSACTION READ ONLY")
    try:
        with Connection(f"outboxdb+{direct}", transport_options={"queue_table": table}) as conn:
            q = conn.SimpleQueue("read-only")
            q.put("before")
            q.channel.db.run(lambda qt, c: qt.run(c, read_only))
            q.put("after")
            assert [q.get(timeout=10).payload for _ in range(2)] == ["before", "after"]
            q.close()
    finally:
        drop_queue_tables(direct, table)


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return engine_url(request.param, tmp_path)


def start_worker(db_url: str, table: str, start: Any, errors: Any) -> None:
    """What a worker process does first: connect, which creates the queue tables."""
    db = Database(db_url, table, None, create=True)
    try:
        start.wait()
        db.run(lambda qt, c: None)
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        db.close()


def test_workers_starting_together_on_an_empty_database_all_create_the_tables(db_url: str) -> None:
    """Every worker creates the queue tables at start-up: six processes racing on an empty
    database must all start (PostgreSQL's concurrent CREATE TABLE IF NOT EXISTS fails with a
    unique violation on pg_type unless the migrations are serialized)."""
    ctx = multiprocessing.get_context("fork")
    for _round in range(3):
        table = f"kq_{uuid.uuid4().hex[:10]}"
        start, errors = ctx.Barrier(6), ctx.Queue()
        workers = [ctx.Process(target=start_worker, args=(db_url, table, start, errors)) for _ in range(6)]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            assert [w.exitcode for w in workers] == [0] * 6
            failures = []
            while not errors.empty():
                failures.append(errors.get())
            assert not failures, failures
        finally:
            drop_queue_tables(db_url, table)


def test_a_process_starting_on_postgresql_does_not_stall_the_sends_of_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new process migrates the queue tables on its first connection. On PostgreSQL
    ``CREATE INDEX IF NOT EXISTS`` takes its SHARE lock even when the index exists: behind a
    business transaction that called ``send_task`` and is still open, it waited, and every
    send, lease and ack of every other process queued behind it until that transaction
    ended. Now the migration reads the catalogs and runs no DDL when nothing is missing: a
    send by a running process finishes while the business transaction is still open."""
    import threading

    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url
    from outbox.transport import database, migrate_queue_tables

    direct = engine_url("postgresql", tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    migrate_queue_tables(f"outboxdb+{direct}", table=table)
    business = psycopg.connect(make_conninfo(libpq_url(direct)))
    admin = psycopg.connect(make_conninfo(libpq_url(direct)), autocommit=True)
    threads: list[threading.Thread] = []
    try:
        with Connection(f"outboxdb+{direct}", transport_options={"queue_table": table}) as running:
            q = running.SimpleQueue("stall")
            q.put("warm-up")  # this process's tables are prepared
            business.execute(f"INSERT INTO {table} (queue, headers, body) VALUES ('stall', '{{}}', NULL)")
            monkeypatch.setattr(database, "_prepared", set())  # as in a process starting now
            starting = Database(direct, table, None, create=True)
            threads.append(threading.Thread(target=lambda: starting.run(lambda qt, c: None), daemon=True))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while threads[-1].is_alive() and time.monotonic() < deadline:  # done, or waiting for a lock
                waiting = admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                                        "to_regclass(%s)", [table]).fetchone()
                if waiting and waiting[0]:
                    break
                time.sleep(0.05)
            threads.append(threading.Thread(target=lambda: q.put("from a running process"), daemon=True))
            threads[-1].start()
            threads[-1].join(5)
            sent_while_open = not threads[-1].is_alive()
            business.rollback()  # before the close, which waits for the send's connection
            for thread in threads:
                thread.join(20)
            starting.close()
            q.close()
        assert sent_while_open, "the send waited for the business transaction"
    finally:
        business.rollback()
        business.close()
        admin.close()
        drop_queue_tables(direct, table)


def _business_session(direct: str) -> Any:
    """An application's connection: none of the relay's own bounds on idling."""
    engine = engine_for_url(direct)
    business = engine.connect(direct)
    with business.cursor() as cursor:
        cursor.execute("SET idle_in_transaction_session_timeout = 0" if engine.name == "postgresql"
                       else "SET SESSION idle_transaction_timeout = 0, SESSION wait_timeout = 28800")
    business.commit()
    return business


def _drop_index_and_hold_the_table(direct: str, table: str, qt: Any) -> Any:
    """The queue table without its ``expires`` index (an upgrade that adds one) and a
    business transaction, left open, that sent to it."""
    business = _business_session(direct)
    with business.cursor() as cursor:
        on = f" ON {qt.table}" if qt.engine.name == "mysql" else ""
        cursor.execute(f"DROP INDEX {qt.engine.quote(qt.index_name('expires'))}{on}")
        business.commit()
        cursor.execute(f"INSERT INTO {qt.table} (queue, headers, body, visible_at) "
                       f"VALUES ('q', '{{}}', NULL, {qt.engine.now})")
    return business


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_start_up_migration_that_waits_for_a_lock_gives_up_with_a_warning(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An index is missing (an upgrade that adds one) and a business transaction that sent
    to the table is open: the start-up migration's CREATE INDEX waits for it, and every
    send of every process queues behind that wait. It gives up after 1 s (PostgreSQL's
    ``lock_timeout``, MySQL/MariaDB's ``lock_wait_timeout``: there it waited a day, this
    server's default, found in review), warns, and the process starts; the next one, or
    ``outbox migrate``, makes it."""
    import threading

    from outbox.transport import database, migrate_queue_tables

    direct = engine_url(kind, tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    qt = migrate_queue_tables(f"outboxdb+{direct}", table=table)
    business = _drop_index_and_hold_the_table(direct, table, qt)
    try:
        monkeypatch.setattr(database, "_prepared", set())
        starting = Database(direct, table, None, create=True)
        with caplog.at_level(logging.WARNING, logger="outbox.transport"):
            start = threading.Thread(target=lambda: starting.run(lambda qt, c: None), daemon=True)
            start.start()
            start.join(10)
            started_while_open = not start.is_alive()
            business.rollback()
            start.join(20)
        starting.close()
        assert started_while_open, "the start-up waited for the business transaction"
        said = [r.getMessage() for r in caplog.records]
        assert any("waited too long for a lock" in line for line in said), said
        assert any(f"index {qt.index_name('expires')} on" in line for line in said), said
    finally:
        business.rollback()
        business.close()
        drop_queue_tables(direct, table)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_outbox_migrate_of_the_queue_tables_gives_up_in_bounded_time_behind_an_open_transaction(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``outbox migrate`` repairs a missing index while a business transaction that sent to
    the queue table stays open: its CREATE INDEX waits, and every send, lease and ack queues
    behind it. It gives up after one bound (10 s; 3 s here), as the outbox table's migration
    does, and names the transaction's session. On MySQL/MariaDB it waited as long as the
    transaction, then each of four tries waited the bound and the error said "the broker's
    database is unavailable" (found in review)."""
    import threading
    import time

    from outbox.core.errors import StoreError
    from outbox.storage.engines import mysql, postgres
    from outbox.transport import migrate_queue_tables

    monkeypatch.setattr(postgres.PostgresEngine, "MIGRATION_LOCK_TIMEOUT", "3s")
    monkeypatch.setattr(mysql, "MIGRATION_LOCK_WAIT_S", 3)
    direct = engine_url(kind, tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    qt = migrate_queue_tables(f"outboxdb+{direct}", table=table)
    business = _drop_index_and_hold_the_table(direct, table, qt)
    with business.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if kind == "postgresql" else "SELECT CONNECTION_ID()")
        holder = cursor.fetchone()[0]
    outcome: list[Any] = []

    def migrate() -> None:
        try:
            outcome.append(migrate_queue_tables(f"outboxdb+{direct}", table=table))
        except Exception as exc:  # what the migration met is the assertion
            outcome.append(exc)
    thread = threading.Thread(target=migrate, daemon=True)
    try:
        started = time.monotonic()
        thread.start()
        thread.join(120)
        took = time.monotonic() - started
        assert outcome, "the migration still waits behind the open transaction"
        assert isinstance(outcome[0], StoreError), outcome
        assert took < 6, f"the migration held every send back {took:.1f} s"
        assert f" {holder} " in str(outcome[0]) and "outbox migrate again" in str(outcome[0]), outcome
        business.rollback()
        migrate_queue_tables(f"outboxdb+{direct}", table=table)  # once nothing holds the table
        with business.cursor() as cursor:
            cursor.execute(qt.existing_indexes_sql()[0].replace("?", "%s"), qt.existing_indexes_sql()[1])
            assert qt.index_name("expires").lower() in {str(r[0]).lower() for r in cursor.fetchall()}
    finally:
        business.rollback()
        business.close()
        thread.join(60)
        drop_queue_tables(direct, table)


def send_and_receive_one(broker_url: str, table: str) -> None:
    """A message sent and received through ``broker_url`` on the queue table ``table``."""
    with Connection(broker_url, transport_options={"queue_table": table}) as conn:
        q = conn.SimpleQueue("least-privilege")
        q.put("m")
        message = q.get(timeout=10)
        assert message.payload == "m"
        message.ack()
        q.close()


def test_a_role_without_ddl_privileges_starts_on_postgresql_tables_made_for_it(tmp_path: Path) -> None:
    """A least-privilege runtime role (SELECT, INSERT, UPDATE, DELETE on the queue tables,
    made by ``outbox migrate`` as their owner) starts with ``create_tables`` left on, sends
    and receives. Before, ``CREATE TABLE IF NOT EXISTS`` checks the privilege before it looks
    for the table: every start failed with "permission denied"."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg
    from psycopg.conninfo import make_conninfo

    from outbox.storage.engines.postgres import libpq_url
    from outbox.transport import migrate_queue_tables

    direct = engine_url("postgresql", tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    role = f"kr_{uuid.uuid4().hex[:10]}"
    migrate_queue_tables(f"outboxdb+{direct}", table=table)
    admin = psycopg.connect(make_conninfo(libpq_url(direct)), autocommit=True)
    parts = urlsplit(direct)
    as_role = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}"))
    try:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_binding TO {role}")
        send_and_receive_one(f"outboxdb+{as_role}", table)
    finally:
        drop_queue_tables(direct, table)
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.close()


def test_a_role_without_ddl_privileges_starts_on_mysql_tables_made_for_it(tmp_path: Path) -> None:
    """The same on MySQL/MariaDB: ``CREATE TABLE IF NOT EXISTS`` checks the privilege first
    (error 1142), so a user with only SELECT, INSERT, UPDATE and DELETE on the queue tables
    failed every start. Each table is now looked for in the catalog first."""
    from urllib.parse import urlsplit, urlunsplit

    import pymysql

    from outbox.transport import migrate_queue_tables

    direct = engine_url("mysql", tmp_path)
    table = f"kq_{uuid.uuid4().hex[:10]}"
    user = f"kr_{uuid.uuid4().hex[:10]}"
    migrate_queue_tables(f"outboxdb+{direct}", table=table)
    parts = urlsplit(direct)
    admin = pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username or "root",
                            password=parts.password or "", database=parts.path.lstrip("/"), autocommit=True)
    as_user = urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port or 3306}"))
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE USER '{user}'@'%'")
            for name in (table, f"{table}_binding"):
                cursor.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {parts.path.lstrip('/')}.{name} "
                               f"TO '{user}'@'%'")
        send_and_receive_one(f"outboxdb+{as_user}", table)
    finally:
        drop_queue_tables(direct, table)
        with admin.cursor() as cursor:
            cursor.execute(f"DROP USER IF EXISTS '{user}'@'%'")
        admin.close()


def lease_ids(db: Database, queue: str, limit: int) -> list[int]:
    return [r.id for r in db.run(lambda qt, c: qt.lease(c, queue, limit, 60_000, uuid.uuid4().hex))]


def test_receive_orders_by_visibility_and_a_requeued_message_keeps_its_place(db_url: str) -> None:
    table = f"kq_{uuid.uuid4().hex[:10]}"
    db = Database(db_url, table, None, create=True)
    try:
        def put(delay_ms: int = 0) -> int:
            def work(qt: Any, c: Any) -> int:
                qt.put(c, "q", "{}", "b", delay_ms=delay_ms)
                return int(qt.run(c, f"SELECT MAX(id) FROM {qt.table}").fetchone()[0])
            return db.run(work)

        delayed = [put(3_600_000) for _ in range(3)]  # a head of delayed rows (Celery retries)
        first, second, third = put(), put(), put()
        assert lease_ids(db, "q", 1) == [first]
        rows = db.run(lambda qt, c: qt.lease(c, "q", 1, 60_000, "r" * 32))
        assert [r.id for r in rows] == [second]
        assert db.run(lambda qt, c: qt.release(c, second, "r" * 32)) == 1
        assert lease_ids(db, "q", 5) == [second, third]  # back in its place, ahead of third
        assert not set(delayed) & set(lease_ids(db, "q", 5))
        names = {str(r[0]).lower() for r in db.run(lambda qt, c: qt.run(c, *qt.existing_indexes_sql()).fetchall())}
        assert db.qt.index_name("ready").lower() in names
        assert db.qt.index_name("receive").lower() not in names
        assert db.run(lambda qt, c: qt.missing_indexes(c)) == []
    finally:
        db.close()
        drop_queue_tables(db_url, table)


def test_migrate_replaces_the_id_keyed_receive_index(db_url: str) -> None:
    """A table made by an earlier release has ``ix_<table>_receive`` on (queue, id): migrate
    drops it and creates the visibility-keyed index."""
    table = f"kq_{uuid.uuid4().hex[:10]}"
    engine = engine_for_url(db_url)
    qt = queue_tables(engine, table)
    conn = engine.connect(db_url)
    try:
        cursor = engine.cursor_for(conn)
        qt.migrate(cursor)
        conn.commit()
        ready = engine.quote(qt.index_name("ready"))
        on = "" if engine.name == "postgresql" or engine.name == "sqlite" else f" ON {qt.table}"
        engine.execute(cursor, f"DROP INDEX {ready}{on}")
        engine.execute(cursor, f"CREATE INDEX {engine.quote(qt.index_name('receive'))} ON {qt.table} (queue, id)")
        conn.commit()
        assert qt.missing_indexes(cursor) == [qt.index_name("ready")]
        conn.commit()
        qt.migrate(cursor)
        conn.commit()
        sql, params = qt.existing_indexes_sql()
        names = {str(r[0]).lower() for r in engine.execute(cursor, sql, params).fetchall()}
        assert qt.index_name("ready").lower() in names and qt.index_name("receive").lower() not in names
        conn.commit()
    finally:
        conn.close()
        drop_queue_tables(db_url, table)


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_worker_survives_its_broker_database_going_away(kind: str, tmp_path: Path) -> None:
    """A real ``celery worker`` on the database broker, its database reached through a TCP
    proxy that the test cuts for a few seconds (a restart, a failover): the worker must
    reconnect and run the next task. Before, the driver's error (not among the transport
    CLASS's connection_errors, which is where Celery's consumer looks) stopped the worker."""
    from urllib.parse import urlsplit, urlunsplit

    from relay_e2e_support import Proxy, wait_until
    from transport_support import TaskApp

    app = TaskApp(kind, tmp_path)
    direct = urlsplit(app.db_url)
    proxy = Proxy(target=(direct.hostname or "127.0.0.1", direct.port or (5432 if kind == "postgresql" else 3306)))
    try:
        proxied = urlunsplit(direct._replace(netloc=direct.netloc.replace(f":{direct.port}", f":{proxy.port}")))
        app.env["TAPP_BROKER"] = f"outboxdb+{proxied}"  # the worker's broker goes through the proxy
        record = app.task("record")  # this process sends directly
        worker = app.worker("w1")
        record.delay(1)
        assert wait_until(lambda: len(app.lines("record")) == 1, timeout=60), app.log("w1")[-3000:]
        # Acked too: a cut between the task's line and its ack failed the ack, and the task ran
        # again after the visibility timeout (a third line, seen once in a full run here).
        assert wait_until(lambda: app.queue_rows() == [], timeout=30), app.log("w1")[-3000:]
        proxy.cut()
        time.sleep(4)  # several idle polls fail, past the transport's own retries
        assert worker.poll() is None, app.log("w1")[-3000:]
        proxy.restore()
        record.delay(2)
        assert wait_until(lambda: len(app.lines("record")) == 2, timeout=90), app.log("w1")[-3000:]
        assert worker.poll() is None, app.log("w1")[-3000:]
        assert "Unrecoverable error" not in app.log("w1")
    finally:
        proxy.close()
        app.close()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_an_acks_late_task_running_through_a_database_outage_runs_once(kind: str, tmp_path: Path) -> None:
    """A real worker's broker database goes away (a TCP proxy cut) while its acks_late task
    runs: the worker's polls fail past the transport's retries, Celery closes the connection
    and reconnects. The task's ack, when it finishes, must still delete its message; before,
    the close forgot the message, the ack skipped the table, and the task ran again after the
    visibility timeout (4 s here)."""
    from relay_e2e_support import Proxy, wait_until
    from transport_support import TaskApp

    app = TaskApp(kind, tmp_path)
    proxy = Proxy(target=("127.0.0.1", 5432 if kind == "postgresql" else 3306))
    try:
        app.env["TAPP_BROKER"] = f"outboxdb+{proxy.url_for(app.db_url)}"  # the worker's broker goes through the proxy
        app.worker("w1")
        app.task("noted_nap").delay(1, 3.0)
        assert wait_until(lambda: app.lines("nap"), timeout=60), app.log("w1")[-3000:]
        proxy.cut()
        time.sleep(1.5)  # the idle polls fail past the transport's retries: Celery reconnects
        proxy.restore()
        time.sleep(8.0)  # the task ends at 3 s, its lease at 4 s: a lost ack runs it again by now
        assert len(app.lines("nap")) == 1, app.log("w1")[-3000:]
        assert app.queue_rows() == [], app.log("w1")[-3000:]
    finally:
        proxy.close()
        app.close()



def test_migrate_of_an_empty_database_does_not_warn_of_the_indexes_it_is_about_to_make(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """``outbox migrate`` connected as a check-only client first, whose first connection
    warned of every index missing ("run `outbox migrate` to create it") before the migration
    made them (found in review)."""
    from outbox.transport import drop_queue_tables, migrate_queue_tables

    table = f"kq_{uuid.uuid4().hex[:10]}"
    caplog.set_level(logging.WARNING, logger="outbox")
    try:
        qt = migrate_queue_tables(f"outboxdb+{db_url}", table=table)
        assert qt.table_name == table
        assert [r.getMessage() for r in caplog.records if "is missing" in r.getMessage()] == []
    finally:
        drop_queue_tables(db_url, table)


def test_outbox_migrate_makes_the_queue_table_a_celery_config_module_names(tmp_path: Path) -> None:
    """Workers take ``queue_table`` (and ``queue_schema``) from their Celery config module's
    ``broker_transport_options``; ``outbox migrate`` made the default table instead, and a
    worker role without DDL rights then failed at start (found in review)."""
    import os
    import subprocess
    import sys

    from outbox.storage.store import OutboxStore

    direct = engine_url("postgresql", tmp_path)
    queue, outbox_table = f"kq_{uuid.uuid4().hex[:10]}", f"outbox_m{uuid.uuid4().hex[:10]}"
    (tmp_path / "queueconf.py").write_text(f"broker_transport_options = {{'queue_table': {queue!r}}}\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))},
           "CELERY_CONFIG_MODULE": "queueconf", "OUTBOX_DATABASE_URL": direct, "OUTBOX_TABLE": outbox_table,
           "OUTBOX_CELERY_BROKER_URL": "outboxdb://"}
    try:
        done = subprocess.run([sys.executable, "-m", "outbox.cli", "migrate"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f'migrated "{queue}" and' in done.stdout, done.stdout
        engine = engine_for_url(direct)
        qt = queue_tables(engine, queue)
        conn = engine.connect(direct)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT to_regclass(%s) IS NOT NULL", (qt.table,))
                assert cursor.fetchone()[0]
        finally:
            conn.close()
    finally:
        drop_queue_tables(direct, queue)
        store = OutboxStore(direct, table=outbox_table)
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}, {store.engine.holders}")
        store.close()


def test_the_outboxs_own_sqlite_database_is_not_created_by_the_transport(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: with ``outboxdb://`` (the outbox's own database) on SQLite, a worker started
    where the file is not (the default ./outbox.db, another directory than `outbox migrate`'s) had
    the transport create it, with its queue tables; the relay then said `table "outbox" missing:
    run `outbox migrate``, which made a second, empty outbox. The file is `outbox migrate`'s to
    make, as for every command: the transport refuses it, as a lost database (kombu retries)."""
    from outbox.core.config import reset_settings

    db = tmp_path / "outbox.db"
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{db}")
    reset_settings()
    try:
        with Connection("outboxdb://") as conn, pytest.raises(BrokerDatabaseUnavailable, match="does not exist"):
            Queue("rev_q")(conn.channel()).declare()
    finally:
        reset_settings()
    assert not db.exists()
    own = tmp_path / "broker.db"  # a broker database of its own: the first worker makes it
    with Connection(f"outboxdb+sqlite:///{own}") as conn:
        Queue("rev_q")(conn.channel()).declare()
    assert own.exists()
