"""Events enqueued into a database other than the relay's (Django ``enqueue(using=...)``
with several DATABASES, a SQLAlchemy bind): one WARNING per database, naming it and saying
that a relay must run with OUTBOX_DATABASE_URL pointing there (docs/django.md, "Several
databases"). Django runs in a subprocess (its settings are process-wide), on a SQLite
default database and a PostgreSQL second one."""

from __future__ import annotations

import json
import logging
import subprocess
import uuid
from pathlib import Path

import pytest
from services import MYSQL_URL, POSTGRES_URL, require
from wake_support import PYTHON, clean_env, pythonpath

from outbox.storage.store import OutboxStore

DJANGO_SCRIPT = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("outbox").addHandler(Keep())

import django
django.setup()
from django.db import transaction
import outbox.wake
from outbox.contrib.django import enqueue

outbox.wake.request_claim = lambda: True
table = sys.argv[1]
for alias in ("default", "orders", "orders", "same_as_default"):
    with transaction.atomic(using=alias):
        enqueue(using=alias, topic="t", aggregate_type="order", aggregate_id="1", payload={}, table=table)
print(json.dumps([m for m in records if "No relay reads" in m]))
"""



def run_django(script: str, table: str, settings_module: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run by a new Python with ``settings_module`` (in ``tmp_path``) as Django's settings."""
    done = subprocess.run([PYTHON, "-c", script, table], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=clean_env(DJANGO_SETTINGS_MODULE=settings_module, PYTHONPATH=pythonpath(tmp_path)))
    assert done.returncode == 0, done.stderr[-4000:]
    return done

def test_enqueue_into_a_second_django_database_warns_once(tmp_path: Path) -> None:
    """Found in review: the event committed in ``orders``, the relay read only
    ``DATABASES["default"]``, and nothing said so: the event stayed pending forever."""
    pytest.importorskip("django")
    require("PostgreSQL", "127.0.0.1", 5432)
    from urllib.parse import urlsplit

    table = f"outbox_db{uuid.uuid4().hex[:8]}"
    default_db = tmp_path / "default.db"
    pg = urlsplit(POSTGRES_URL)
    (tmp_path / "dbsettings.py").write_text(
        "SECRET_KEY = 'x'\nUSE_TZ = True\nINSTALLED_APPS = []\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {str(default_db)!r}}},\n"
        # Another alias for the same file: the same database, no warning.
        f"             'same_as_default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {str(default_db)!r}}},\n"
        f"             'orders': {{'ENGINE': 'django.db.backends.postgresql', 'NAME': {pg.path[1:]!r},\n"
        f"                         'USER': {pg.username or ''!r}, 'PASSWORD': {pg.password or ''!r},\n"
        f"                         'HOST': {pg.hostname or ''!r}, 'PORT': {str(pg.port or '')!r}}}}}\n")
    stores = [OutboxStore(f"sqlite:///{default_db}", table=table), OutboxStore(POSTGRES_URL, table=table)]
    for store in stores:
        store.migrate()
    try:
        done = run_django(DJANGO_SCRIPT, table, "dbsettings", tmp_path)
        [warning] = json.loads(done.stdout.strip().splitlines()[-1])  # once, for orders only
        assert "enqueue(using='orders')" in warning and f"/{pg.path[1:]}" in warning and str(default_db) in warning
        assert "OUTBOX_DATABASE_URL pointing at that database" in warning
    finally:
        for store in stores:
            with store.transaction() as cursor:
                store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
                store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.holders}")
            store.close()


LEGACY_SCRIPT = r"""
import json, sys
import pymysql
pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL, whether or not mysqlclient is installed
import django
django.setup()
from django.db import connections, transaction
import outbox.wake
from outbox.contrib.django import enqueue

outbox.wake.request_claim = lambda: True
table, errors = sys.argv[1], []
for _ in range(2):
    try:
        with transaction.atomic(using="legacy"):
            enqueue(using="legacy", topic="t", aggregate_type="order", aggregate_id="1", payload={}, table=table)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
with connections["legacy"].cursor() as cursor:
    cursor.execute(f"SELECT COUNT(*) FROM {table}")
    print(json.dumps({"rows": cursor.fetchone()[0], "errors": errors}))
"""


def test_an_alias_whose_options_the_relay_cannot_carry_still_enqueues(tmp_path: Path) -> None:
    """Found in review: the check built the alias' URL outside its own guard, so a second
    database's OPTIONS the relay cannot carry (here ``OPTIONS['ssl']`` with a key only the
    driver reads: ConfigError) made every ``enqueue(using=...)`` into it raise after the insert,
    rolling the caller's transaction back, where it had enqueued before. The check never fails
    an enqueue: at worst it cannot tell, and says so at DEBUG."""
    pytest.importorskip("django")
    pytest.importorskip("pymysql")
    require("MariaDB", "127.0.0.1", 3306)
    from urllib.parse import urlsplit

    table = f"outbox_db{uuid.uuid4().hex[:8]}"
    my = urlsplit(MYSQL_URL)
    (tmp_path / "legacysettings.py").write_text(
        "SECRET_KEY = 'x'\nUSE_TZ = True\nINSTALLED_APPS = []\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {str(tmp_path / 'd.db')!r}}},\n"
        f"             'legacy': {{'ENGINE': 'django.db.backends.mysql', 'NAME': {my.path[1:]!r},\n"
        f"                         'USER': {my.username or ''!r}, 'PASSWORD': {my.password or ''!r},\n"
        f"                         'HOST': {my.hostname or ''!r}, 'PORT': {str(my.port or '')!r},\n"
        "                         'OPTIONS': {'ssl': {'ssl-mode': 'PREFERRED'}, 'ssl_disabled': True}}}\n")
    store = OutboxStore(MYSQL_URL, table=table)
    store.migrate()
    try:
        done = run_django(LEGACY_SCRIPT, table, "legacysettings", tmp_path)
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"rows": 2, "errors": []}
    finally:
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
            store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.holders}")
        store.close()


def test_enqueue_on_a_sqlalchemy_bind_of_another_database_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Flask-SQLAlchemy binds: the docs have the bind's connection passed, so the event
    commits with the rows; a relay must read that database too."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from outbox.contrib import databases
    from outbox.contrib.flask import enqueue
    from outbox.core.config import reset_settings

    relay_db, bind_db = tmp_path / "relay.db", tmp_path / "bind.db"
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{relay_db}")
    reset_settings()
    databases._reset_for_tests()
    for db in (relay_db, bind_db):
        OutboxStore(f"sqlite:///{db}").migrate()
    relay_engine = sqlalchemy.create_engine(f"sqlite:///{relay_db}")
    bind_engine = sqlalchemy.create_engine(f"sqlite:///{bind_db}")
    try:
        with caplog.at_level(logging.WARNING, logger="outbox"):
            for engine in (relay_engine, bind_engine, bind_engine):
                with engine.begin() as conn:
                    enqueue(conn, wake=False, topic="t", aggregate_type="order", aggregate_id="1", payload={})
        [warning] = [r.getMessage() for r in caplog.records if "No relay reads" in r.getMessage()]
        assert str(bind_db) in warning and str(relay_db) in warning
    finally:
        relay_engine.dispose()
        bind_engine.dispose()
        databases._reset_for_tests()
        monkeypatch.delenv("OUTBOX_DATABASE_URL")
        reset_settings()


def test_the_relays_own_database_written_with_and_without_its_default_port_says_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: OUTBOX_DATABASE_URL with ``:5432`` and the app's SQLAlchemy URL (or
    Django's empty PORT) without it name one database, yet the first enqueue warned that no
    relay reads its events. The default port is the port: the same database, nothing said."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    require("PostgreSQL", "127.0.0.1", 5432)
    from urllib.parse import urlsplit

    from outbox.contrib import databases
    from outbox.contrib.flask import enqueue
    from outbox.core.config import reset_settings

    pg = urlsplit(POSTGRES_URL)
    if (pg.port or 5432) != 5432:
        pytest.skip("the test database is not on PostgreSQL's default port")
    auth = f"{pg.username}@" if pg.username else ""
    table = f"outbox_db{uuid.uuid4().hex[:8]}"
    with_port, without_port = (f"postgresql://{auth}{pg.hostname}:5432{pg.path}",
                               f"postgresql+psycopg://{auth}{pg.hostname}{pg.path}")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", with_port)
    monkeypatch.setenv("OUTBOX_TABLE", table)
    reset_settings()
    databases._reset_for_tests()
    store = OutboxStore(with_port, table=table)
    store.migrate()
    engine = sqlalchemy.create_engine(without_port)
    try:
        with caplog.at_level(logging.WARNING, logger="outbox"), engine.begin() as conn:
            enqueue(conn, wake=False, topic="t", aggregate_type="order", aggregate_id="1", payload={})
        assert [r.getMessage() for r in caplog.records if "No relay reads" in r.getMessage()] == []
    finally:
        engine.dispose()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
            store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.holders}")
        store.close()
        databases._reset_for_tests()
        monkeypatch.delenv("OUTBOX_DATABASE_URL")
        monkeypatch.delenv("OUTBOX_TABLE")
        reset_settings()
