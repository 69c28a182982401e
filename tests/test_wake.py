"""Waking the relay after commit (``outbox.wake``, ``outbox.transaction``, the Django and
Flask helpers): the hand-off to the wake thread and the one claim-request token.
PostgreSQL LISTEN/NOTIFY is in tests/test_listen.py.

The wake must come after the caller's commit (the rows are visible to another
connection when it runs), never after a rollback, once per transaction, and never raise.
Framework tests run on real SQLite files; Django runs in a subprocess because its
settings are process-wide. Coalescing and token clearing run against the real Redis;
the end-to-end tests start real ``celery -A outbox worker`` processes with no beat, so
only a wake-up (or a notification) can make them claim.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from services import REDIS_URL, require
from wake_support import (
    PYTHON,
    CountingDestination,
    Workers,
    clean_env,
    drop_redis_keys,
    event,
    pythonpath,
    redis_prefix,
    wait_done,
)

import outbox
import outbox.wake as wake
from outbox import enqueue
from outbox.core.config import reset_settings
from outbox.core.names import default_namespace
from outbox.relay.holders import Heartbeat, new_holder
from outbox.relay.waker import Throttle, token_for
from outbox.storage.store import OutboxStore

# -- helpers -------------------------------------------------------------------------------------

def run_python(code: str, cwd: Path, *args: str, timeout: float = 120, **settings: str) -> Any:
    """Run ``code`` in a fresh interpreter; return the JSON it printed last."""
    done = subprocess.run([PYTHON, "-c", code, *args], cwd=cwd, env=clean_env(**settings), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def count_rows(db: Path) -> int:
    conn = sqlite3.connect(db, timeout=30)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
    finally:
        conn.close()


class Recorder:
    """Stands in for ``outbox.wake.request_claim``: records, at each call, how many rows
    another connection sees (so a call before the commit would record too few)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.calls: list[int] = []

    def __call__(self) -> bool:
        self.calls.append(count_rows(self.db))
        return True


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Path]:
    db = tmp_path / "app.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    store.close()
    yield db


@pytest.fixture
def recorder(sqlite_db: Path, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    r = Recorder(sqlite_db)
    monkeypatch.setattr(wake, "request_claim", r)
    return r


# -- outbox.transaction on a DB-API connection ----------------------------------------------------

def test_transaction_commits_then_wakes_once(sqlite_db: Path, recorder: Recorder) -> None:
    conn = sqlite3.connect(sqlite_db, timeout=30)
    try:
        with outbox.transaction(conn) as c:
            assert c is conn
            for n in range(3):
                enqueue(conn, **event(n))
            assert recorder.calls == []
        assert recorder.calls == [3]  # one wake, after the commit made all three visible

        with pytest.raises(RuntimeError), outbox.transaction(conn):
            enqueue(conn, **event(9))
            raise RuntimeError("business failure")
        assert recorder.calls == [3] and count_rows(sqlite_db) == 3  # rolled back, no wake
    finally:
        conn.close()


def test_wake_after_commit_refuses_connections_without_a_commit_hook(sqlite_db: Path) -> None:
    conn = sqlite3.connect(sqlite_db)
    try:
        with pytest.raises(TypeError, match="outbox.transaction"):
            wake.wake_after_commit(conn)
    finally:
        conn.close()


def test_transaction_on_sqlite_begins_as_a_writer_so_a_heartbeat_cannot_fail_it(sqlite_db: Path) -> None:
    """The block reads first, then writes. A relay worker's heartbeat commits to the same
    file every ``OUTBOX_RELAY_HOLDER_TIMEOUT_S`` / 3 even when idle; a deferred transaction
    whose snapshot a beat made stale cannot become a writer (SQLITE_BUSY_SNAPSHOT) and fails
    at once with "database is locked", whatever the busy timeout. ``outbox.transaction``
    begins IMMEDIATE on a sqlite3 connection, so its reads are inside the transaction and
    its writes cannot fail so (docs/relay.md, "SQLite: application transactions")."""
    conn = sqlite3.connect(sqlite_db, timeout=30)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, n INTEGER)")
    conn.commit()
    beat = Heartbeat(OutboxStore(f"sqlite:///{sqlite_db}"), new_holder(), timeout_s=0.06)  # a beat every 20 ms
    beat.start()
    failed = []
    try:
        for n in range(30):
            try:
                with outbox.transaction(conn, wake=False):
                    assert conn.in_transaction  # the reads too
                    conn.execute("SELECT COUNT(*) FROM orders").fetchone()
                    time.sleep(0.03)  # beats commit meanwhile
                    conn.execute("INSERT INTO orders (n) VALUES (?)", (n,))
                    enqueue(conn, **event(n))
            except sqlite3.OperationalError as exc:
                failed.append(str(exc))
            time.sleep(0.03)  # the beats wait for the writer's lock, and take it in between
    finally:
        beat.stop()
        conn.close()
    assert beat.beats > 5
    assert failed == []
    assert count_rows(sqlite_db) == 30


DJANGO_HEARTBEAT_SCRIPT = r"""
import json, sys, time
db = sys.argv[1]
from django.conf import settings
settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db}}, USE_TZ=True,
                   SECRET_KEY="test")
import django
django.setup()
from django.db import connection
import outbox
from outbox.relay.holders import Heartbeat, new_holder
from outbox.storage.store import OutboxStore

with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, n INTEGER)")
beat = Heartbeat(OutboxStore("sqlite:///" + db), new_holder(), timeout_s=0.06)  # a beat every 20 ms
beat.start()
failed = []
for n in range(30):
    try:
        with outbox.transaction(connection, wake=False):
            with connection.cursor() as cursor:
                cursor.execute("SELECT COUNT(*) FROM orders")
                cursor.fetchone()
                time.sleep(0.03)  # beats commit meanwhile
                cursor.execute("INSERT INTO orders (n) VALUES (%s)", [n])
            outbox.enqueue(connection, topic="t", aggregate_type="o", aggregate_id="a", payload={})
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
    time.sleep(0.03)  # the beats wait for the writer's lock, and take it in between
beat.stop()
print(json.dumps({"failed": failed, "beats": beat.beats, "mode": getattr(connection, "transaction_mode", "none")}))
"""


def test_transaction_on_a_django_sqlite_connection_begins_immediate(tmp_path: Path) -> None:
    """As above through Django: ``atomic`` begins a deferred transaction on SQLite unless
    ``OPTIONS["transaction_mode"]`` says otherwise, and the view's first write after a read
    failed with "database is locked" whenever a heartbeat had committed in between (found in
    review). ``outbox.transaction`` begins its outermost block IMMEDIATE there (Django 5.1+),
    and leaves the connection's own mode as it was."""
    django = pytest.importorskip("django")
    if django.VERSION < (5, 1):
        pytest.skip("Django before 5.1 has no transaction_mode")
    db = tmp_path / "django.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    store.close()
    out = run_python(DJANGO_HEARTBEAT_SCRIPT, tmp_path, str(db))
    assert out["beats"] > 5
    assert out["failed"] == []
    assert out["mode"] is None


# -- Django (subprocess: settings are process-wide) -------------------------------------------------

DJANGO_SCRIPT = r"""
import json, sqlite3, sys
db = sys.argv[1]
from django.conf import settings
settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db}}, USE_TZ=True,
                   SECRET_KEY="test")  # as every project has: Django 4.2 logs a failing on_commit through mail_admins
import django
django.setup()
from django.db import connection, transaction
import outbox.wake
from outbox.contrib.django import enqueue
from outbox.storage.store import OutboxStore

store = OutboxStore("sqlite:///" + db)
store.migrate()
calls = []

def visible():
    c = sqlite3.connect(db, timeout=30)
    try:
        return c.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    finally:
        c.close()

def recorder():
    calls.append(visible())
    return True

outbox.wake.request_claim = recorder

def add(n=1):
    for _ in range(n):
        enqueue(topic="t", aggregate_type="o", aggregate_id="a", payload={"n": 1})

def take():
    seen = list(calls)
    calls.clear()
    return seen

out = {}
with transaction.atomic():
    add(3)
    out["inside"] = list(calls)
out["commit"] = take()
try:
    with transaction.atomic():
        add(2)
        raise RuntimeError
except RuntimeError:
    pass
out["rollback"] = take()
with transaction.atomic():
    try:
        with transaction.atomic():
            add(1)
            raise RuntimeError
    except RuntimeError:
        pass
    add(1)
out["inner_rollback_outer_commit"] = take()
try:
    with transaction.atomic():
        with transaction.atomic():
            add(1)
        raise RuntimeError
except RuntimeError:
    pass
out["inner_commit_outer_rollback"] = take()
add(1)
out["autocommit"] = take()

def broken():
    raise ConnectionError("broker down")

outbox.wake.request_claim = broken
with transaction.atomic():
    add(1)
out["failing_wake_after_commit"] = visible()
print(json.dumps(out))
"""


def test_django_wakes_after_commit_only(tmp_path: Path) -> None:
    pytest.importorskip("django")
    out = run_python(DJANGO_SCRIPT, tmp_path, str(tmp_path / "django.db"))
    assert out["inside"] == []  # nothing before the commit
    assert out["commit"] == [3]  # one wake for three enqueues, all visible when it runs
    assert out["rollback"] == []
    assert out["inner_rollback_outer_commit"] == [4]  # the savepoint's rows are gone, the outer one woke
    assert out["inner_commit_outer_rollback"] == []
    assert out["autocommit"] == [5]
    assert out["failing_wake_after_commit"] == 6  # the commit stood and nothing was raised


DJANGO_OTHER_BACKEND_SCRIPT = r"""
import json, sqlite3, sys
db = sys.argv[1]
from django.conf import settings
# A backend whose class lives outside the django package (as mssql-django's `mssql.base`,
# django-prometheus's, a pool backend's): a subclass of Django's SQLite wrapper, written by the test.
settings.configure(DATABASES={"default": {"ENGINE": "custombackend.sqlite3", "NAME": db}}, USE_TZ=True,
                   SECRET_KEY="test")
import django
django.setup()
from django.db import connection, connections, transaction
import outbox
import outbox.wake
from outbox.contrib.django import enqueue, wake_on_commit
from outbox.storage.store import OutboxStore

OutboxStore("sqlite:///" + db).migrate()
calls = []
outbox.wake.request_claim = lambda: calls.append(1) or True
conn = connections["default"]
with conn.cursor() as cursor:
    cursor.execute("CREATE TABLE orders (id INTEGER)")

def counts():
    c = sqlite3.connect(db, timeout=30)
    try:
        return [c.execute("SELECT COUNT(*) FROM orders").fetchone()[0],
                c.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]]
    finally:
        c.close()

out = {"module": type(conn).__module__}
try:
    with outbox.transaction(conn):
        with conn.cursor() as cursor:
            cursor.execute("INSERT INTO orders VALUES (1)")
        outbox.enqueue(conn, topic="t", aggregate_type="o", aggregate_id="a", payload={})
        raise RuntimeError("business failure")
except RuntimeError:
    pass
out["after_raise"] = counts()
out["woken_after_raise"] = len(calls)
with transaction.atomic():
    enqueue(topic="t", aggregate_type="o", aggregate_id="a", payload={})
    enqueue(topic="t", aggregate_type="o", aggregate_id="a", payload={})
    out["hooked"] = wake_on_commit()
    out["callbacks"] = len(conn.run_on_commit)
out["woken_after_commit"] = len(calls)
with outbox.transaction(connection):  # django.db.connection: Django's proxy to the default one
    outbox.enqueue(connection, topic="t", aggregate_type="o", aggregate_id="a", payload={})
    out["proxy_in_atomic"] = conn.in_atomic_block
out["woken_after_proxy"] = len(calls)
print(json.dumps(out))
"""


def test_a_django_backend_outside_the_django_package_is_a_django_connection(tmp_path: Path) -> None:
    """Found in review: a connection was taken for Django's only when its class's module
    started with ``django.``; mssql-django (``mssql.base``), django-prometheus and any
    subclass backend were not. ``outbox.transaction`` then took the DB-API path: no
    ``atomic`` block, so a raise inside it left the business row (and the event) committed;
    ``contrib.django.enqueue`` and ``wake_on_commit`` hooked no wake-up. Django's connections
    are now told by their base class, wherever the backend lives."""
    pytest.importorskip("django")
    backend = tmp_path / "custombackend" / "sqlite3"
    backend.mkdir(parents=True)
    (tmp_path / "custombackend" / "__init__.py").write_text("")
    (backend / "__init__.py").write_text("")
    (backend / "base.py").write_text("from django.db.backends.sqlite3 import base\n\n\n"
                                     "class DatabaseWrapper(base.DatabaseWrapper):\n    pass\n")
    out = run_python(DJANGO_OTHER_BACKEND_SCRIPT, tmp_path, str(tmp_path / "django.db"),
                     PYTHONPATH=pythonpath(tmp_path))
    assert out["module"] == "custombackend.sqlite3.base"
    assert out["after_raise"] == [0, 0]  # the order and its event rolled back together
    assert out["woken_after_raise"] == 0
    assert out["hooked"] is True and out["callbacks"] == 1  # one on-commit wake for the transaction
    assert out["woken_after_commit"] == 1
    assert out["proxy_in_atomic"] is True and out["woken_after_proxy"] == 2


DJANGO_REDIS_SCRIPT = r"""
import json, sys
db = sys.argv[1]
from django.conf import settings
settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db}}, USE_TZ=True,
                   SECRET_KEY="test")  # as every project has: Django 4.2 logs a failing on_commit through mail_admins
import django
django.setup()
from django.db import transaction
import outbox.wake
from outbox.celery import app
from outbox.contrib.django import enqueue
from outbox.core.config import relay_settings
from outbox.storage.store import OutboxStore

OutboxStore("sqlite:///" + db).migrate()
CLAIM_QUEUE = relay_settings().queues.claim

def claims():
    outbox.wake.flush()  # the hand-off thread has sent what it was asked to
    with app.pool.acquire(block=True) as conn:
        return conn.default_channel._size(CLAIM_QUEUE)

def add():
    enqueue(topic="t", aggregate_type="o", aggregate_id="a", payload={"n": 1})

out = {}
with transaction.atomic():
    add(); add()
    out["inside"] = claims()
out["after_commit"] = claims()
for _ in range(5):  # a burst while that claim waits: coalesced into it
    with transaction.atomic():
        add()
out["after_burst"] = claims()
try:
    with transaction.atomic():
        add()
        raise RuntimeError
except RuntimeError:
    pass
out["after_rollback"] = claims()
from outbox.celery.worker import coalescer
coalescer().clear()  # what the worker's claim does as it starts (the same token)
with transaction.atomic():
    add()
out["after_claim_started"] = claims()
import base64
with app.pool.acquire(block=True) as conn:
    message = conn.default_channel._get(CLAIM_QUEUE)
out["kwargs"] = json.loads(base64.b64decode(message["body"]))[1]
out["token"] = outbox.wake._current_waker().coalescer().key
out["worker_token"] = coalescer().key
out["task"] = message["headers"]["task"]
print(json.dumps(out))
"""


def token_of(prefix: str, database_url: str, table: str = "outbox") -> str:
    """The claim-request token of the outbox ``table`` of ``database_url`` under Celery key ``prefix``."""
    return token_for(REDIS_URL, prefix, default_namespace(database_url, table))


def test_django_wake_sends_one_claim_per_burst_on_redis(tmp_path: Path) -> None:
    pytest.importorskip("django")
    require("Redis", "127.0.0.1", 6379)
    prefix = redis_prefix(tmp_path)
    try:
        out = run_python(DJANGO_REDIS_SCRIPT, tmp_path, str(tmp_path / "django.db"),
                         OUTBOX_CELERY_BROKER_URL=REDIS_URL, CELERY_CONFIG_MODULE="wakeconf",
                         PYTHONPATH=pythonpath(tmp_path), OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'django.db'}")
    finally:
        drop_redis_keys(prefix, token_of(prefix, f"sqlite:///{tmp_path / 'django.db'}"))
    assert out["inside"] == 0
    assert out["after_commit"] == 1
    assert out["after_burst"] == 1  # coalesced: the claim already queued will see them
    assert out["after_rollback"] == 1
    assert out["after_claim_started"] == 2  # once the claim started, the next commit asks again
    assert out["task"] == "outbox.claim" and out["token"] == token_of(prefix, f"sqlite:///{tmp_path / 'django.db'}")
    assert out["worker_token"] == out["token"]  # one token: the writer's and the worker's
    # The claim clears the worker's coalescer, i.e. that token, and names the writer's too
    # (the same key here); it names its outbox.
    assert out["kwargs"] == {"requested": True, "token": out["token"],
                             "outbox": default_namespace(f"sqlite:///{tmp_path / 'django.db'}", "outbox")}


# -- SQLAlchemy sessions and Flask -----------------------------------------------------------------

def test_sqlalchemy_session_wakes_after_commit_not_on_rollback(sqlite_db: Path, recorder: Recorder) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session, scoped_session, sessionmaker

    from outbox.contrib.flask import enqueue as flask_enqueue

    engine = sqlalchemy.create_engine(f"sqlite:///{sqlite_db}")
    try:
        with Session(engine) as session:
            for n in range(3):
                flask_enqueue(session, **event(n))
            assert recorder.calls == []
            session.commit()
            assert recorder.calls == [3]
            flask_enqueue(session, **event(4))
            session.rollback()
            assert recorder.calls == [3]
            session.commit()  # an empty transaction after the rollback: nothing to wake for
            assert recorder.calls == [3]
            flask_enqueue(session, **event(5))  # the same session, a later transaction
            session.commit()
            assert recorder.calls == [3, 4]
        scoped = scoped_session(sessionmaker(engine))
        flask_enqueue(scoped, **event(6))
        scoped.commit()
        assert recorder.calls == [3, 4, 5]
        scoped.remove()
    finally:
        engine.dispose()


def test_sqlalchemy_savepoints_neither_wake_early_nor_drop_the_wake(sqlite_db: Path, recorder: Recorder) -> None:
    """Found in review: SQLAlchemy sends after_commit when a savepoint is released and
    after_rollback when one rolls back. An event enqueued in a savepoint woke the relay at
    the release, before the real COMMIT (its claim found nothing), and not at the COMMIT;
    a savepoint rolled back after an enqueue cancelled the transaction's wake."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    from outbox.contrib.flask import enqueue as flask_enqueue

    engine = sqlalchemy.create_engine(f"sqlite:///{sqlite_db}")
    try:
        with Session(engine) as session:
            with session.begin_nested():
                flask_enqueue(session, **event(1))
            assert recorder.calls == []  # released, not committed
            session.commit()
            assert recorder.calls == [1]
            flask_enqueue(session, **event(2))
            nested = session.begin_nested()
            flask_enqueue(session, **event(3))
            nested.rollback()  # the savepoint's event goes; the transaction's stays
            session.commit()
            assert recorder.calls == [1, 2]
    finally:
        engine.dispose()


def test_flask_extension_wakes_after_the_request_commits(sqlite_db: Path, recorder: Recorder) -> None:
    flask = pytest.importorskip("flask")
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import scoped_session, sessionmaker

    from outbox.contrib.flask import Outbox, current
    from outbox.contrib.flask import enqueue as flask_enqueue

    engine = sqlalchemy.create_engine(f"sqlite:///{sqlite_db}")
    db_session = scoped_session(sessionmaker(engine))
    app = flask.Flask("wake-test")
    ext = Outbox(app, session=db_session)

    @app.teardown_appcontext
    def remove_session(_: Any) -> None:
        db_session.remove()

    @app.post("/orders/<int:n>")
    def create(n: int) -> Any:
        current().enqueue(**event(n))
        ext.enqueue(**event(n + 100))
        if flask.request.args.get("fail"):
            db_session.rollback()
            return "rolled back", 500
        db_session.commit()
        return "ok"

    @app.post("/raw/<int:n>")
    def raw(n: int) -> Any:  # a plain DB-API connection: woken once the view has returned
        conn = sqlite3.connect(sqlite_db, timeout=30)
        try:
            flask_enqueue(conn, **event(n))
            flask_enqueue(conn, **event(n + 1))
            conn.commit()
        finally:
            conn.close()
        return "ok"

    try:
        client = app.test_client()
        assert client.post("/orders/1").status_code == 200
        assert recorder.calls == [2]
        assert client.post("/orders/2?fail=1").status_code == 500
        assert recorder.calls == [2]
        assert client.post("/raw/3").status_code == 200
        assert recorder.calls == [2, 4]
        # Found in review: the request's mark lived on ``g``, which one app context spans
        # over several requests; the second request then registered no wake-up.
        with app.app_context():
            assert client.post("/raw/5").status_code == 200
            assert client.post("/raw/7").status_code == 200
        assert recorder.calls == [2, 4, 6, 8]
    finally:
        engine.dispose()


# -- request_claim itself ---------------------------------------------------------------------------

def test_request_claim_is_off_when_disabled_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode() -> Any:
        raise AssertionError("must not be reached")

    monkeypatch.setattr(wake, "_current_waker", explode)
    monkeypatch.setenv("OUTBOX_RELAY_WAKE", "0")
    reset_settings()
    assert wake.request_claim() is False
    monkeypatch.setenv("OUTBOX_RELAY_WAKE", "perhaps")  # a bad value is logged, not raised
    reset_settings()
    wake._reset_for_tests()
    assert wake.request_claim() is False
    monkeypatch.delenv("OUTBOX_RELAY_WAKE")
    reset_settings()
    wake._reset_for_tests()
    assert wake.request_claim() is False  # the plan blew up: logged, False, nothing raised
    wake._reset_for_tests()


def test_request_claim_skips_an_in_memory_broker_without_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox.celery.waker import CeleryWaker

    monkeypatch.setattr(wake, "_current_waker", lambda: CeleryWaker("memory://"))
    sent: list[Any] = []
    monkeypatch.setattr(CeleryWaker, "send_claim", lambda self, requested: sent.append(requested))
    runs = wake._handoff.runs
    assert wake.request_claim() is False and wake.flush() and sent == [] and wake._handoff.runs == runs


def test_local_throttle_sends_once_then_once_more_after_the_window() -> None:
    """One send per window, one more at its end when requests arrived during it, all from
    the requesting threads: the trailing send is made by the thread that asked for it, after
    waiting for the window's end, and a request made meanwhile by another thread rides on
    it. No thread of its own (a Timer per window left a broker connection per window on
    Dramatiq's RabbitmqBroker: tests/test_dramatiq.py)."""
    throttle = Throttle(0.1)
    sent: list[tuple[float, threading.Thread]] = []
    start = time.monotonic()

    def send() -> bool:
        sent.append((time.monotonic() - start, threading.current_thread()))
        return True

    me, threads_before = threading.current_thread(), threading.active_count()
    assert throttle.request(send) and len(sent) == 1  # at once
    others = [threading.Thread(target=lambda: throttle.request(send)) for _ in range(5)]
    waiting = threading.Thread(target=lambda: throttle.request(send))
    waiting.start()
    time.sleep(0.03)  # it waits for the window's end; the others ride on its send
    for other in others:
        other.start()
    for other in others:
        other.join(0.02)
        assert not other.is_alive()  # returned at once
    assert len(sent) == 1
    waiting.join(1.0)
    assert len(sent) == 2 and sent[1][0] >= 0.09 and sent[1][1] is waiting  # the trailing claim, after them
    assert throttle.request(send) and len(sent) == 3 and sent[2][0] >= 0.19  # in its window: the next window's end
    time.sleep(0.15)
    assert throttle.request(send) and len(sent) == 4  # a quiet window later: sent at once
    time.sleep(0.2)
    assert len(sent) == 4  # and nothing trails a lone request
    assert {thread for _, thread in sent} == {me, waiting}
    assert threading.active_count() == threads_before


REDIS_COALESCE_SCRIPT = r"""
import json
import outbox.wake as w
from outbox.celery import app
from outbox.core.config import relay_settings
from outbox.celery.worker import coalescer, request_claim
CLAIM_QUEUE = relay_settings().queues.claim

def claims():
    w.flush()
    with app.pool.acquire(block=True) as conn:
        return conn.default_channel._size(CLAIM_QUEUE)

burst = [w.request_claim() for _ in range(10)]
queued = claims()
drain_mode = request_claim()  # the worker's drain mode: the same token is taken, so no second claim
coalescer().clear()  # the claim starts
again = w.request_claim()
print(json.dumps({"burst": burst, "queued": queued, "drain_mode": drain_mode, "after_clear": claims(),
                  "again": again, "runs": w._handoff.runs}))
"""


def test_request_claim_coalesces_a_burst_on_redis(tmp_path: Path) -> None:
    require("Redis", "127.0.0.1", 6379)
    prefix = redis_prefix(tmp_path)
    try:
        out = run_python(REDIS_COALESCE_SCRIPT, tmp_path, OUTBOX_CELERY_BROKER_URL=REDIS_URL,
                         CELERY_CONFIG_MODULE="wakeconf", PYTHONPATH=pythonpath(tmp_path),
                         OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    finally:
        drop_redis_keys(prefix, token_of(prefix, f"sqlite:///{tmp_path / 'o.db'}"))
    runs = out.pop("runs")
    assert out == {"burst": [True] * 10, "queued": 1, "drain_mode": False, "after_clear": 2, "again": True}
    assert 2 <= runs <= 11  # the hand-off thread ran once per batch of requests


def test_request_claim_gives_up_quietly_when_the_broker_is_down(tmp_path: Path) -> None:
    code = r"""
import json, time
import outbox.wake as w
t0 = time.monotonic()
first = w.request_claim()  # handed off: the caller does not wait for the failure
took = time.monotonic() - t0
w.flush()
second = w.request_claim()  # paused after the failure: no second connection attempt
print(json.dumps({"first": first, "second": second, "took": took, "runs": w._handoff.runs}))
"""
    out = run_python(code, tmp_path, OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:1/0",
                     OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert out["first"] is True and out["second"] is False and out["runs"] == 1


def test_a_failed_wake_up_masks_the_password_its_error_quotes_in_the_writers_own_log(tmp_path: Path) -> None:
    """Found in review: the writer's process (a web application, its own logging, none of the
    worker's masking handlers) logged a failed wake-up's error as raised, and psycopg's error for
    the database transport's URL quotes a password it cannot decode (``invalid
    percent-encoded token: "<password>"``). Masked where the wake takes it now."""
    pytest.importorskip("psycopg")
    secret = "Hunt%zzer2"  # psycopg refuses it before it connects: no PostgreSQL needed
    code = r"""
import logging
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
import outbox.wake as w
w.request_claim()
assert w.flush(30)
w._paused_until = 0.0
w.wake_now()  # the second failure, at debug level
"""
    done = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=clean_env(OUTBOX_CELERY_BROKER_URL=f"outboxdb+postgresql://postgres:{secret}@127.0.0.1:1/x",
                                        OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}"))
    assert done.returncode == 0, done.stderr[-4000:]
    said = [line for line in done.stderr.splitlines() if "cannot wake the relay" in line]
    assert len(said) == 2 and all('invalid percent-encoded token: "***"' in line for line in said), done.stderr
    assert secret not in done.stderr, done.stderr


# -- real workers, no beat: only a wake-up or a notification makes them claim -------------------------

WRITER_SCRIPT = r"""
import json, socket, sqlite3, sys, threading, time

# Every socket operation, by thread: the caller's thread must do none while it commits and
# wakes (the wake is handed off to the wake thread). Installed before anything connects.
io_threads = []
class RecordingSocket(socket.socket):
    pass
for name in ("connect", "connect_ex", "send", "sendall", "sendto", "sendmsg", "recv", "recv_into", "recvfrom"):
    def wrap(name=name):
        original = getattr(socket.socket, name)
        def recorded(self, *args, **kwargs):
            io_threads.append(threading.current_thread().name)
            return original(self, *args, **kwargs)
        return recorded
    setattr(RecordingSocket, name, wrap())
socket.socket = RecordingSocket

import outbox
from outbox.storage.store import OutboxStore

db = sys.argv[1]
store = OutboxStore("sqlite:///" + db)
conn = sqlite3.connect(db, timeout=30)

def done(ids):
    with store.transaction() as cursor:
        marks = ",".join("?" * len(ids))
        return store.engine.execute(cursor, f"SELECT COUNT(*) FROM outbox WHERE status = 2 AND id IN ({marks})",
                                    ids).fetchone()[0] == len(ids)

def wait(ids, timeout=10.0):
    start = time.monotonic()
    while not done(ids):
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.005)
    return time.monotonic() - start

caller_io = 0

def commit(n, aggregate):
    global caller_io
    before = io_threads.count("MainThread")
    with outbox.transaction(conn):
        outbox_id = outbox.enqueue(conn, topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                                   payload={"n": n})
    caller_io += io_threads.count("MainThread") - before
    return outbox_id

rounds = []
for n in range(3):  # one commit at a time, each once the claims the previous one caused are over
    time.sleep(1.0)
    rounds.append(wait([commit(n, "solo")]))
time.sleep(1.0)
burst = [commit(10 + n, f"agg-{n % 3}") for n in range(12)]
print(json.dumps({"rounds": rounds, "burst": wait(burst), "count": 15, "caller_io": caller_io,
                  "wake_thread_io": io_threads.count("outbox-wake")}))
"""


@contextmanager
def claim_messages_to(queue: str) -> Iterator[list[int]]:
    """Count the claim messages sent to ``queue`` (Celery's Redis transport: an LPUSH on the
    queue's list, its name after the transport's key prefix) while the block runs, through Redis's MONITOR; the count is in the list
    once the block has ended."""
    import socket

    stop, seen, counted = threading.Event(), bytearray(), [0]
    sock = socket.create_connection(("127.0.0.1", 6379), timeout=5)
    sock.sendall(b"MONITOR\r\n")
    sock.settimeout(0.2)

    def read() -> None:
        while not stop.is_set():
            try:
                seen.extend(sock.recv(1 << 16))
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield counted
    finally:
        stop.set()
        reader.join(5)
        sock.close()
        # The key carries the transport's key prefix, if any, before the queue's name.
        counted[0] = len(re.findall(rb'"LPUSH" "[^"]*' + re.escape(queue.encode()) + rb'"', bytes(seen)))


@pytest.mark.parametrize("in_process", ["1", "0"], ids=["subscribed", "claim-message"])
def test_post_commit_wake_drives_a_real_worker_without_beat(tmp_path: Path, counting_destination: CountingDestination,
                                                            workers: Workers, in_process: str) -> None:
    """No beat and a 30 s token TTL: each commit can only be relayed promptly if its wake
    reaches the worker: through the wake channel its main process subscribes to, or (in-process
    claim off: nobody subscribes) as a claim message whose claim clears the one token as it
    starts. The writer's thread does no socket I/O: the wake thread does. Subscribed, the
    in-process claims of this live traffic (none full) ask for their next claim in the main
    process itself, so no claim message goes through Celery's broker at all (before, every
    in-process claim that published sent one: docs/waking-and-metrics.md, "The in-process
    claim")."""
    db = tmp_path / "outbox.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_RELAY_CLAIM_REQUEST_TTL_S="30",
                      OUTBOX_CLAIM_INTERVAL_S="3600", OUTBOX_RELAY_IN_PROCESS_CLAIM=in_process)
    log = workers.start(env, "-c", "2")
    queue = re.search(r"on queues (\S+\.claim),", log.read_text(errors="replace"))
    assert queue is not None, log.read_text(errors="replace")[-4000:]
    with claim_messages_to(queue.group(1)) as sent:
        done = subprocess.run([PYTHON, "-c", WRITER_SCRIPT, str(db)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("commit-to-done seconds:", out)
    assert all(r is not None and r < 5 for r in out["rounds"]), out
    assert out["burst"] is not None and out["burst"] < 5, out
    assert out["caller_io"] == 0 and out["wake_thread_io"] > 0, out  # the caller only handed the wake off
    deadline = time.monotonic() + 10
    while counting_destination.count() < out["count"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counting_destination.count() == out["count"]
    print("claim messages sent:", sent)
    if in_process == "1":  # 5 before (7 December); one allowed for a wake that met no subscriber
        assert sent[0] <= 1, log.read_text(errors="replace")[-4000:]
    else:
        assert sent[0] >= 4  # each solo commit's wake, and the burst's
    store.close()


EXIT_AT_ONCE_SCRIPT = r"""
import logging, sqlite3, sys
sys.modules["django"] = None  # installed without the django extra (see the test's docstring)
logging.basicConfig(level=logging.WARNING)
import outbox
conn = sqlite3.connect(sys.argv[1], timeout=30)
with outbox.transaction(conn):
    outbox_id = outbox.enqueue(conn, topic="orders.changed", aggregate_type="order", aggregate_id="exit",
                               payload={"n": 1})
print(outbox_id)
"""


@pytest.mark.parametrize("in_process", ["1", "0"], ids=["subscribed", "claim-message"])
def test_a_script_that_exits_right_after_its_commit_still_wakes_the_relay(tmp_path: Path, counting_destination: CountingDestination,
                                                                           workers: Workers, in_process: str) -> None:
    """The wake of a process that ends at once is sent by the at-exit flush, while the
    interpreter is shutting down. The wake thread must then do no first-time work that
    Python refuses at exit: without Django (whose import happened to load it earlier),
    the first wake imported redis, whose import registers an exit hook, and the wake was
    lost with `RuntimeError: can't register atexit after shutdown`. No beat, so only
    that wake can make the worker claim the row."""
    db = tmp_path / "outbox.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_RELAY_CLAIM_REQUEST_TTL_S="30",
                      OUTBOX_CLAIM_INTERVAL_S="3600", OUTBOX_RELAY_IN_PROCESS_CLAIM=in_process)
    workers.start(env, "-c", "1")
    done = subprocess.run([PYTHON, "-c", EXIT_AT_ONCE_SCRIPT, str(db)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "RuntimeError" not in done.stderr and "cannot wake" not in done.stderr, done.stderr[-4000:]
    outbox_id = int(done.stdout.strip().splitlines()[-1])
    assert wait_done(store, [outbox_id], 20) < 20  # the lease and the token's TTL are 30 s: the wake did it
    store.close()


def test_a_requested_claim_names_the_writers_token_which_a_worker_on_another_url_string_clears() -> None:
    """Found in review: the token's key is made from Celery's broker URL as written, and the
    worker's claim cleared only its own. A web process naming the same Redis another way
    (``:6379`` against ``:6379/0``, another Redis user) kept its token for the whole TTL and
    sent no wake-up for any commit meanwhile. The claim message now names the writer's
    token, and the worker clears it through its own URL."""
    import uuid

    from outbox.celery.waker import CeleryWaker
    from outbox.relay.waker import clear_token

    require("Redis", "127.0.0.1", 6379)
    writer = CeleryWaker("redis://127.0.0.1:6379", "", None, f"wake-{uuid.uuid4().hex[:8]}")
    kwargs = writer.claim_kwargs(True)
    assert kwargs["requested"] is True and kwargs["token"] == token_for(writer.broker_url, "", writer.namespace)
    assert writer.claim_kwargs(False) == {}
    gate = writer.coalescer()
    try:
        assert gate.acquire() and not gate.acquire()  # the writer's token is taken: its next wakes wait
        clear_token(kwargs["token"], "redis://127.0.0.1:6379/0")  # the worker's claim, its own URL string
        assert gate.acquire()  # cleared: the next commit's wake-up goes out
    finally:
        gate.clear()


FORK_SCRIPT = r"""
import json, os, socket
import outbox.wake as w
from outbox.celery import app
from outbox.core.config import relay_settings

# The local port of every socket a process sends on, by process: installed before anything connects.
sent_from = set()
plain_sendall = socket.socket.sendall
def sendall(self, *args, **kwargs):
    sent_from.add(self.getsockname()[1])
    return plain_sendall(self, *args, **kwargs)
socket.socket.sendall = sendall

def wake():
    sent_from.clear()
    return w.request_claim() and w.flush(10), sorted(sent_from)

parent = wake()  # the master wakes the relay once before its workers fork (gunicorn --preload)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, json.dumps(wake()).encode())
    os._exit(0)
os.waitpid(pid, 0)
child = json.loads(os.read(read, 10000))
w._waker_made.throttle.window_s = 0  # the parent's next wake goes out now
again = wake()  # the parent's connection still serves it
queue = relay_settings().queues.claim
with app.connection_for_write() as conn:
    queued = conn.default_channel.queue_declare(queue, passive=True).message_count
    conn.default_channel.queue_delete(queue)
    conn.default_channel.exchange_delete(queue)  # Celery's exchange of the queue, named alike
print(json.dumps({"parent": parent, "child": child, "again": again, "queued": queued}))
"""


def test_a_forked_child_wakes_on_a_connection_of_its_own(tmp_path: Path) -> None:
    """Found in review: after a plain ``os.fork`` (gunicorn ``--preload``, uwsgi without
    lazy-apps) the child sent its wakes on the parent's RabbitMQ connection: the same
    socket in two processes, whose frames could interleave. Celery drops its pools only
    in ``multiprocessing``'s after-fork hook, which a plain fork does not run; the wake's
    own at-fork hook now drops them too."""
    from services import AMQP_URL

    require("RabbitMQ", "127.0.0.1", 5672)
    out = run_python(FORK_SCRIPT, tmp_path, OUTBOX_CELERY_BROKER_URL=AMQP_URL,
                     OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                     OUTBOX_TABLE=f"fork_{uuid.uuid4().hex[:8]}")
    (parent_sent, parent_ports), (child_sent, child_ports) = out["parent"], out["child"]
    assert parent_sent and child_sent and parent_ports and child_ports
    assert not set(child_ports) & set(parent_ports)  # a socket of its own
    assert out["again"] == [True, parent_ports]  # the parent's own, untouched by the child
    assert out["queued"] == 3  # and every wake reached the claim queue
