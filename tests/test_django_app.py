"""The Django app ``outbox.contrib.django`` in the example shop (examples/django), run as a
Django user runs it: Django's test runner, ``manage.py migrate`` and the ``outbox_*``
management commands, the ``outbox`` CLI and the Celery worker reading Django's settings,
and an order posted to the view arriving on RabbitMQ. On SQLite and PostgreSQL (Django's test
runner on MariaDB/MySQL with mysqlclient too); each run uses databases of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from app_support import renamed, schema_of
from services import AMQP_URL, REDIS_URL, REQUIRE, ROOT, require
from wake_support import drop_redis_keys, redis_prefix

from outbox.storage.store import OutboxStore

pytest.importorskip("django")

EXAMPLE = ROOT / "examples" / "django"
BIN = Path(sys.executable).parent


def pythonpath(*dirs: Path) -> str:
    """``dirs`` first, then this interpreter's PYTHONPATH (the sources under test)."""
    return os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


def run(args: list[str], env: dict[str, str], cwd: Path = EXAMPLE, timeout: float = 180) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_", "DATABASE_"))}
    result = subprocess.run(args, cwd=cwd, env={**clean, "PYTHONPATH": pythonpath(EXAMPLE), **env}, capture_output=True,
                            text=True, timeout=timeout)
    return result


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (f"{' '.join(map(str, result.args))} exited with {result.returncode}\n"
                                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result.stdout + result.stderr


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run([sys.executable, "manage.py", *args], env=env)


def env_of(database: dict[str, str], **extra: str) -> dict[str, str]:
    return {**{k: v for k, v in database.items() if k != "kind"}, "DJANGO_SETTINGS_MODULE": "shop.settings", **extra}


def outbox_url(database: dict[str, str]) -> str:
    return database["DATABASE_URL"]


@pytest.mark.parametrize("database", ["sqlite", "postgresql", "mysql"], indirect=True)
def test_djangos_test_runner_creates_the_table_and_the_app_works(database: dict[str, str], tmp_path: Path) -> None:
    """On SQLite the run includes the admin in a real browser (orders/tests_browser.py:
    headless Chromium); on PostgreSQL and MariaDB/MySQL the app's tests without the browser.
    MariaDB/MySQL through Django's MySQL backend on mysqlclient, its default driver: the app's
    migrations (0001 to 0004), orders and their events in ``atomic``, a rolled-back order, the
    admin's requeue on Django's connection.

    A ``TransactionTestCase`` commits, and the commit wakes the relay on Celery's broker: on
    PostgreSQL and MariaDB/MySQL the default one, Redis's db 0, where each run left a claim
    request and kombu's bindings of the test database's claim queue (docs/django.md, "Tests of
    your project"). The wake-up goes to the suite's Redis under a key prefix of this test's own,
    deleted afterwards."""
    labels = ["orders"] if database["kind"] == "sqlite" else ["orders.tests"]
    if database["kind"] == "sqlite":  # Celery's broker is memory://: wake-ups stay in the process
        out = ok(manage("test", *labels, "--noinput", "-v", "2", env=env_of(database)))
    else:
        out = run_waking_the_suites_redis(labels, database, tmp_path)
    assert "Applying outbox.0001_initial... OK" in out
    assert "OK" in out.splitlines()[-2:] or "\nOK" in out
    if database["kind"] == "sqlite":
        assert "Ran 9 tests" in out, out
        if REQUIRE:  # CI installs chromium and chromium-driver: the browser test must run
            assert "skipped" not in out, out
    else:
        assert "Ran 8 tests" in out, out


def run_waking_the_suites_redis(labels: list[str], database: dict[str, str], tmp_path: Path) -> str:
    """``manage.py test`` with the suite's Redis as Celery's broker, its keys under a prefix of
    this test's own (tests/wake_support.py's ``wakeconf``); checks the commit's wake-up landed
    there, then deletes them and the claim-request token."""
    import redis

    from outbox.core.config import load_settings
    from outbox.relay.waker import token_for

    require("Redis", "127.0.0.1", 6379)
    prefix = redis_prefix(tmp_path)
    # The relay's outbox in the test run: the test database's (the namespace derives from it).
    test_database = database["DATABASE_URL"].rsplit("/", 1)[0] + "/" + database["DJANGO_TEST_DATABASE_NAME"]
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": test_database})
    env = env_of(database, OUTBOX_CELERY_BROKER_URL=REDIS_URL, CELERY_CONFIG_MODULE="wakeconf",
                 PYTHONPATH=pythonpath(tmp_path, EXAMPLE))
    try:
        out = ok(manage("test", *labels, "--noinput", "-v", "2", env=env))
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            assert client.llen(prefix + settings.queues.claim) >= 1, sorted(client.scan_iter(match=f"{prefix}*"))
        finally:
            client.close()
        return out
    finally:
        drop_redis_keys(prefix, token_for(REDIS_URL, prefix, settings.outbox_namespace))


def test_management_commands_say_usage_errors_in_one_line_and_take_dash_h(tmp_path: Path) -> None:
    """docs/django.md: each ``manage.py outbox_*`` is the ``outbox`` subcommand "with the same
    options, output and exit codes". A usage error printed click's usage, a hint, a blank line
    and ``Error: ...`` where ``outbox`` prints one ``error:`` line, and ``-h`` was refused (found
    in the first-hour review)."""
    env = {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    for args, message in [(("outbox_dead", "requeue"), "error: give the ids to requeue, --topic, or --all"),
                          (("outbox_status", "--bogus"), "error: No such option '--bogus'."),
                          (("outbox_purge", "--batch", "0"),
                           "error: Invalid value for '--batch': 0 is not in the range 1<=x<=100000.")]:
        result = manage(*args, env=env)
        assert result.returncode == 2, result
        assert result.stderr.splitlines() == [message], result.stderr
    for args in (("outbox_dead", "list", "-h"), ("outbox_status", "-h"), ("outbox_dead", "-h")):
        assert "Usage: manage.py outbox_" in ok(manage(*args, env=env)), args


def test_runserver_says_once_that_it_cannot_wake_the_relay(tmp_path: Path) -> None:
    """docs/django.md, "Start-up warning": one warning. Under runserver's autoreloader (its
    default) both the watching parent and the serving child ran the app's ready(): the warning
    came twice (found in the first-hour review)."""
    import socket
    import time
    import urllib.request

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_", "DATABASE_"))}
    env = {**clean, "PYTHONPATH": pythonpath(EXAMPLE), "DJANGO_SETTINGS_MODULE": "shop.settings",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "PYTHONUNBUFFERED": "1"}
    for extra in ([], ["--noreload"]):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = tmp_path / f"runserver{len(extra)}.log"
        with open(log, "w") as out:
            server = subprocess.Popen([sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", *extra],
                                      cwd=EXAMPLE, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=2).close()
                    break
                except OSError:
                    time.sleep(0.2)
            time.sleep(0.5)
        finally:
            os.killpg(server.pid, 15)
            server.wait(30)
        said = log.read_text()
        assert said.count("outbox (Django): Celery's broker is memory://") == 1, (extra, said)


def test_manage_py_migrate_makes_the_stores_table_and_the_cli_uses_djangos_database(
        database: dict[str, str], tmp_path: Path) -> None:
    env = env_of(database)
    ok(manage("migrate", "--noinput", env=env))
    url = outbox_url(database)
    django_schema = schema_of(url, "outbox")
    # The holders table (docs/internals.md, "Lost workers"): 0002 makes it where 0001 ran before it existed.
    holders_schema = schema_of(url, "outbox_holders")
    assert holders_schema
    ok(manage("migrate", "outbox", "0001", "--noinput", env=env))
    drop = OutboxStore(url, table="outbox")
    try:
        with drop.transaction() as cursor:
            cursor.execute('DROP TABLE "outbox_holders"')
    finally:
        drop.close()
    assert "Applying outbox.0002_holders... OK" in ok(manage("migrate", "--noinput", env=env))
    assert schema_of(url, "outbox_holders") == holders_schema
    # The store's own migrate on the same database finds nothing to change ...
    migrated = run([str(BIN / "outbox"), "migrate"], env=env, cwd=tmp_path)
    ok(migrated)
    assert schema_of(url, "outbox") == django_schema
    # ... and the CLI, run anywhere with DJANGO_SETTINGS_MODULE, used Django's database.
    where = url.split("sqlite:///", 1)[1] if url.startswith("sqlite") else url.rsplit("/", 1)[1]
    assert migrated.stderr.startswith("outbox: database ") and where in migrated.stderr, migrated.stderr
    # The store creates the same table from nothing (another table name, same DDL).
    store = OutboxStore(url, table="outbox_store_made")
    try:
        store.migrate()
        store_schema = schema_of(url, "outbox_store_made")
    finally:
        with store.transaction() as cursor:
            cursor.execute('DROP TABLE IF EXISTS "outbox_store_made"')
        store.close()
    assert renamed(store_schema, "outbox_store_made", "outbox") == django_schema
    # The management commands mirror the CLI.
    status = ok(manage("outbox_status", "--json", env=env))
    assert '"pending": 0' in status
    # manage.py's own --settings is manage.py's, not the outbox command's.
    settings_flag = {k: v for k, v in env.items() if k != "DJANGO_SETTINGS_MODULE"}
    assert '"pending": 0' in ok(manage("outbox_status", "--settings=shop.settings", "--json", env=settings_flag))
    # Django's standard options are accepted as by every management command (-v 2 was refused).
    for standard in (["-v", "2"], ["-v2"], ["--verbosity=0"], ["--traceback"], ["--no-color"], ["--skip-checks"]):
        assert '"pending": 0' in ok(manage("outbox_status", *standard, "--json", env=env)), standard
    assert "no dead rows" in ok(manage("outbox_dead", "list", env=env))
    check = manage("outbox_check", env=env)
    assert "[ok  ] table" in check.stdout and "[ok  ] indexes" in check.stdout, check.stdout + check.stderr
    assert "Usage: manage.py outbox_purge [OPTIONS]" in ok(manage("outbox_purge", "--help", env=env))
    assert "Usage: manage.py outbox_dead [OPTIONS] COMMAND" in ok(manage("outbox_dead", "--help", env=env))
    # From code: call_command, output to the command's stdout, failures as CommandError.
    code = ("import io\nfrom django.core.management import call_command, CommandError\n"
            "out = io.StringIO()\ncall_command('outbox_status', '--json', stdout=out)\n"
            "print('status:', out.getvalue().strip())\n"
            "try:\n    call_command('outbox_purge', '--batch', '0', stdout=io.StringIO())\n"
            "except CommandError as exc:\n    print('purge refused:', exc)\n")
    called = ok(manage("shell", "-c", code, env=env))
    assert 'status: {"counts": {' in called and "purge refused:" in called and "--batch" in called, called
    bad = manage("outbox_purge", "--batch", "0", env=env)
    assert bad.returncode == 2 and "--batch" in bad.stderr


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_manage_py_migrate_brings_a_table_of_an_earlier_release_forward(database: dict[str, str]) -> None:
    """docs/operations.md, "Upgrading": a deployment upgraded the Django way runs ``manage.py
    migrate``. 0001 and 0002 run the relay's DDL once, when applied, so a table they made before
    5 December 2026 (no autovacuum thresholds of its own: claims slow down by the hour) kept its
    old shape: migrate said "No migrations to apply" (found in the upgrade review)."""
    env = env_of(database)
    ok(manage("migrate", "--noinput", env=env))
    url = outbox_url(database)
    store = OutboxStore(url, table="outbox")
    try:
        def options() -> set[str]:
            with store.transaction() as cursor:
                return set(store.engine.storage_options(cursor))
        made = options()
        assert any(option.startswith("autovacuum_vacuum_threshold=") for option in made), made
        # The table as the migrations of an earlier release left it: none of the storage parameters.
        with store.transaction() as cursor:
            cursor.execute('ALTER TABLE "outbox" RESET (' + ", ".join(store.engine.STORAGE) + ")")
        assert not options()
        ok(manage("migrate", "outbox", "0002", "--noinput", env=env))  # the migrations that release had
        out = ok(manage("migrate", "--noinput", env=env))
        assert "Applying outbox.0003" in out and "Applying outbox.0004" in out, out
        assert options() == made
    finally:
        store.close()


def test_the_cli_and_the_worker_read_outbox_settings_from_django(tmp_path: Path) -> None:
    (tmp_path / "mysettings.py").write_text(
        "from shop.settings import *  # noqa\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {str(tmp_path / 'd.db')!r}}}}}\n"
        "OUTBOX_EXCHANGE = 'from-django'\nOUTBOX_BATCH_SIZE = 7\n")
    env = {"DJANGO_SETTINGS_MODULE": "mysettings", "PYTHONPATH": pythonpath(tmp_path, EXAMPLE)}
    probe = ("from outbox.celery import app, relay_settings\ns = relay_settings()\n"
             "print(s.database_url, s.exchange, s.batch_size, app.conf.broker_url)\n")
    out = ok(run([sys.executable, "-c", probe], env=env, cwd=tmp_path))
    assert out.split() == [f"sqlite:///{tmp_path / 'd.db'}", "from-django", "7", "memory://"]
    # The environment still wins over Django's settings.
    out = ok(run([sys.executable, "-c", probe], env={**env, "OUTBOX_EXCHANGE": "from-env"}, cwd=tmp_path))
    assert out.split()[1] == "from-env"
    # A settings module that does not import is one clear line.
    bad = run([str(BIN / "outbox"), "status"], env={**env, "DJANGO_SETTINGS_MODULE": "nosuchsettings"}, cwd=tmp_path)
    assert bad.returncode == 1 and "DJANGO_SETTINGS_MODULE='nosuchsettings' cannot be imported" in bad.stderr


def test_a_settings_module_that_raises_stops_the_cli_naming_it(tmp_path: Path) -> None:
    """A settings module that raised anything but ImportError (a KeyError for an unset
    environment variable) was silently ignored: the CLI fell back to ./outbox.db and told
    the user to migrate a stray SQLite file (found in review). Now one line names it."""
    (tmp_path / "brokensettings.py").write_text("import os\nSECRET_KEY = 'x'\nPASSWORD = os.environ['DB_PASSWORD']\n")
    env = {"DJANGO_SETTINGS_MODULE": "brokensettings", "PYTHONPATH": pythonpath(tmp_path)}
    for command in ("status", "check"):
        result = run([str(BIN / "outbox"), command], env=env, cwd=tmp_path, timeout=60)
        assert result.returncode == 1, result.stdout + result.stderr
        assert ("DJANGO_SETTINGS_MODULE='brokensettings' cannot be loaded: KeyError: 'DB_PASSWORD'"
                in result.stdout + result.stderr), result.stdout + result.stderr
        assert "outbox.db" not in result.stdout + result.stderr
    assert not (tmp_path / "outbox.db").exists()


def test_check_validates_the_relay_options_of_djangos_settings(tmp_path: Path) -> None:
    """`outbox check` read the relay's option families from the environment only: a bad
    OUTBOX_RELAY_* in settings.py passed the check and then stopped the worker (found in
    review). It is read from the same sources as every other setting."""
    (tmp_path / "badrelay.py").write_text(
        f"SECRET_KEY = 'x'\nDATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(tmp_path / 'd.db')!r}}}}}\nOUTBOX_RELAY_TASK_ROWS = -5\n")
    env = {"DJANGO_SETTINGS_MODULE": "badrelay", "PYTHONPATH": pythonpath(tmp_path)}
    result = run([str(BIN / "outbox"), "check"], env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("[FAIL] configuration: OUTBOX_RELAY_TASK_ROWS"), result.stdout


def test_an_empty_setting_in_djangos_settings_does_not_block_the_environments(tmp_path: Path) -> None:
    """``OUTBOX_PUBLISH_URL = os.environ.get("SHOP_PUBLISH_URL", "")`` in settings.py, and a
    valid OUTBOX_PUBLISH_URL in the environment, which comes first: every command stopped on
    "OUTBOX_PUBLISH_URL is set but empty" (found in review). Only the first source that holds
    a name decides; an empty value there is still refused."""
    (tmp_path / "emptysettings.py").write_text(
        f"import os\nSECRET_KEY = 'x'\nDATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(tmp_path / 'd.db')!r}}}}}\n"
        "OUTBOX_PUBLISH_URL = os.environ.get('SHOP_PUBLISH_URL', '')\nOUTBOX_EXCHANGE = ''\n")
    env = {"DJANGO_SETTINGS_MODULE": "emptysettings", "PYTHONPATH": pythonpath(tmp_path),
           "OUTBOX_PUBLISH_URL": "memory://", "OUTBOX_EXCHANGE": "shop"}
    assert ok(run([str(BIN / "outbox"), "queues"], env=env, cwd=tmp_path, timeout=60)).startswith("outbox.")
    check = run([str(BIN / "outbox"), "check"], env=env, cwd=tmp_path, timeout=60).stdout  # no table: it fails
    assert "[ok  ] configuration:" in check and "publish to memory://" in check, check
    empty_first = run([str(BIN / "outbox"), "queues"], env={**env, "OUTBOX_PUBLISH_URL": ""}, cwd=tmp_path, timeout=60)
    assert empty_first.returncode == 1 and "OUTBOX_PUBLISH_URL is set but empty" in empty_first.stderr, empty_first


def test_an_order_posted_to_the_django_view_arrives_on_rabbitmq(tmp_path: Path) -> None:
    """The example app end to end: its view enqueues, `celery -A outbox worker` started with
    DJANGO_SETTINGS_MODULE (and nothing else about the database) delivers."""
    require("RabbitMQ", "127.0.0.1", 5672)
    from relay_e2e_support import Destination, wait_until

    destination = Destination()
    db = tmp_path / "shop.db"
    env = {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{db}",
           "OUTBOX_PUBLISH_URL": AMQP_URL, "OUTBOX_EXCHANGE": destination.exchange_name,
           "OUTBOX_CLAIM_INTERVAL_S": "0.3", "PYTHONUNBUFFERED": "1"}
    worker = None
    log = tmp_path / "worker.log"
    try:
        ok(manage("migrate", "--noinput", env=env))
        post = ("import json\nfrom django.test import Client\nc = Client()\n"
                "for i in range(3):\n"
                "    r = c.post('/orders', json.dumps({'customer': f'c{i}', 'total_cents': i}), "
                "content_type='application/json')\n"
                "    assert r.status_code == 201, r.content\n"
                "r = c.post('/orders', json.dumps({'customer': 'x', 'fail': True}), content_type='application/json')\n"
                "assert r.status_code == 409\nprint('posted')\n")
        assert "posted" in ok(manage("shell", "-c", post, env=env))
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
        with open(log, "wb") as out:
            worker = subprocess.Popen([str(BIN / "celery"), "-A", "outbox", "worker", "-c", "1", "--loglevel=INFO",
                                       "--without-mingle", "--without-gossip"],
                                      cwd=tmp_path, env={**clean, "PYTHONPATH": pythonpath(EXAMPLE), **env},
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        arrived = destination.wait_for(lambda: len(destination.messages) >= 3, timeout=60)
        assert arrived, f"{len(destination.messages)} of 3 arrived\n--- worker\n{log.read_text()[-4000:]}"
        customers = sorted(__import__("json").loads(m.body)["customer"] for m in destination.messages)
        assert customers == ["c0", "c1", "c2"]
        assert all(m.headers["topic"] == "orders.created" for m in destination.messages)
        assert wait_until(lambda: "outbox heartbeat: alive" in log.read_text(), timeout=10), log.read_text()[-3000:]
    finally:
        if worker is not None:
            import signal

            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        destination.close()


def test_django_database_url() -> None:
    from outbox.core.config import django_database_url

    assert django_database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/db.sqlite3"}) == (
        "sqlite:////srv/db.sqlite3")
    assert django_database_url({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
                                "PASSWORD": "p@ss:w/rd", "HOST": "db", "PORT": 5432}) == (
        "postgresql://app:p%40ss%3Aw%2Frd@db:5432/shop")
    assert django_database_url({"ENGINE": "mssql", "NAME": "shop", "USER": "sa", "PASSWORD": "pw", "HOST": "sql",
                                "PORT": "1433", "OPTIONS": {"driver": "ODBC Driver 18 for SQL Server",
                                                            "extra_params": "TrustServerCertificate=yes"}}) == (
        "mssql+pyodbc://sa:pw@sql:1433/shop?driver=ODBC%20Driver%2018%20for%20SQL%20Server"
        "&TrustServerCertificate=yes")
    assert django_database_url({"ENGINE": "django.db.backends.oracle", "NAME": "x"}) is None


@pytest.mark.parametrize("database", [
    {"ENGINE": "django.db.backends.postgresql", "NAME": "test", "USER": "postgres", "HOST": "/var/run/postgresql"},
    {"ENGINE": "django.db.backends.postgresql", "NAME": "test", "USER": "postgres", "HOST": ""},
    {"ENGINE": "django.db.backends.postgresql", "NAME": "test", "USER": "postgres", "HOST": "127.0.0.1",
     "OPTIONS": {"sslmode": "disable", "application_name": "shop", "isolation_level": 1}},
    {"ENGINE": "django.db.backends.mysql", "NAME": "test", "USER": "root", "HOST": "/run/mysqld/mysqld.sock"},
], ids=["postgres-socket-directory", "postgres-default-socket", "postgres-options", "mysql-socket-file"])
def test_the_relay_connects_where_django_does(database: dict[str, Any]) -> None:
    """Found in review: a socket path as HOST became part of the database name ("database
    var/run/postgresql/test does not exist"), an empty HOST meant TCP to 127.0.0.1 where
    Django used PostgreSQL's socket, OPTIONS (sslmode, ...) were dropped. Real servers,
    through the URL the relay derives (skipped where this machine has no such socket)."""
    from outbox.core.config import django_database_url
    from outbox.storage.store import OutboxStore

    socket = database["HOST"] if database["HOST"].startswith("/") else "" if database["HOST"] else "/var/run/postgresql"
    if socket and not Path(socket).exists():
        pytest.skip(f"no {socket} on this machine")
    url = django_database_url(database)
    assert url is not None and "isolation_level" not in url
    store = OutboxStore(url)
    try:
        with store.transaction() as cursor:
            assert store.engine.execute(cursor, "SELECT 1").fetchone()[0] == 1
    finally:
        store.close()
    assert django_database_url({**database, "HOST": "::1", "PORT": "5432"}).split("@")[1].startswith("[::1]:5432/")


RACE_SCRIPT = r"""
import sys, threading
from urllib.parse import urlsplit
url, table = sys.argv[1], sys.argv[2]
parts = urlsplit(url)
from django.conf import settings
settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": parts.path[1:],
                                          "USER": parts.username, "HOST": parts.hostname, "PORT": parts.port}},
                   USE_TZ=True, SECRET_KEY="test")
import django
django.setup()
from django.db import connection
from outbox.contrib.django.schema import create_table

start = threading.Barrier(4)
outcomes = []

def migrate():
    start.wait()
    try:
        create_table(connection)  # each thread has its own Django connection, in autocommit as in a migration
        outcomes.append("ok")
    except Exception as exc:
        outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        connection.close()

threads = [threading.Thread(target=migrate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(120)
print("\n".join(outcomes))
"""


def test_the_apps_migrations_run_by_replicas_at_once_on_postgres_all_succeed() -> None:
    """The app's migrations are not atomic (MySQL commits DDL on its own), so Django runs the
    relay's steps in autocommit, where PostgreSQL's migration lock (a transaction's) ended
    with its own statement: replicas running ``manage.py migrate`` at once on an empty
    database failed on a duplicate table or type (found in review: 25 of 30 such races).
    On PostgreSQL the steps now run in one transaction, and all four racers succeed."""
    from services import POSTGRES_URL

    require("PostgreSQL", "127.0.0.1", 5432)
    for round_ in range(3):
        table = f"outbox_dj{round_}{os.getpid()}"
        store = OutboxStore(POSTGRES_URL, table=table)
        try:
            result = run([sys.executable, "-c", RACE_SCRIPT, POSTGRES_URL, table],
                         env={"OUTBOX_DATABASE_URL": POSTGRES_URL, "OUTBOX_TABLE": table}, cwd=ROOT)
            assert result.returncode == 0, result.stderr[-3000:]
            assert result.stdout.split() == ["ok"] * 4, result.stdout
        finally:
            from engine_support import drop_table

            drop_table(store)
            store.close()


ADMIN_IN_SCHEMA = r"""
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from outbox.contrib.django import enqueue
from outbox.contrib.django.models import OutboxEvent
with transaction.atomic():
    enqueue(topic="in.the.schema", aggregate_type="o", aggregate_id="1", payload={}, wake=False)
print("model:", sorted(OutboxEvent.objects.values_list("topic", flat=True)))
client = Client()
client.force_login(User.objects.create_superuser("admin", "admin@example.com", "pw"))
page = client.get("/admin/outbox/outboxevent/")
print("changelist:", page.status_code, "in.the.schema" in page.content.decode(), "elsewhere" in page.content.decode())
"""


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_the_admin_reads_the_outbox_table_of_outbox_schema(database: dict[str, str]) -> None:
    """Found in review: the admin's model named the table alone, in the connection's default
    schema, while the migration, ``enqueue`` and the requeue action used OUTBOX_SCHEMA's: the
    changelist failed (relation does not exist), or, with a table of that name in the default
    schema, listed that table's rows, whose ids "Requeue" then requeued in the other one. The
    model's table is now schema-qualified; a same-named table in ``public`` is left unread."""
    env = env_of(database, OUTBOX_SCHEMA="shop_outbox")
    url = outbox_url(database)
    elsewhere = OutboxStore(url, table="outbox")  # a same-named table in the default schema
    try:
        elsewhere.migrate()
        with elsewhere.transaction() as cursor:
            from outbox import enqueue

            enqueue(cursor.connection, topic="elsewhere", aggregate_type="o", aggregate_id="1", payload={})
    finally:
        elsewhere.close()
    ok(manage("migrate", "--noinput", env=env))
    out = ok(manage("shell", "-c", ADMIN_IN_SCHEMA, env=env))
    assert "model: ['in.the.schema']" in out, out
    assert "changelist: 200 True False" in out, out
    # The migration's state names the same table: no migration to make in the app.
    assert "No changes detected" in ok(manage("makemigrations", "--check", "--dry-run", "outbox", env=env))


UNDER_PYTEST = r"""
import io, sys
sys.argv = ["pytest"]  # pytest-django: Django is set up (AppConfig.ready) before the test database exists
import django
django.setup()
from django.conf import settings
from django.db import connection
test_name = settings.DATABASES["default"]["TEST"]["NAME"]
settings.DATABASES["default"]["NAME"] = connection.settings_dict["NAME"] = test_name  # what create_test_db does
from django.core.management import call_command
from outbox.core.config import get_settings
print("relay database:", get_settings().database_url)
out = io.StringIO()
call_command("outbox_status", "--json", stdout=out)
print("status:", out.getvalue().strip())
"""


def test_under_pytest_django_the_relay_uses_the_test_database(tmp_path: Path) -> None:
    """Found in review: the app's ``ready()`` (run under pytest-django before the test database
    exists; only manage.py's commands skip its wake check) cached the settings, database URL
    included: ``call_command("outbox_purge")``, ``outbox_dead requeue --all`` or an in-process
    relay in a project's tests then acted on the real database. The check now leaves nothing
    cached: the relay reads DATABASES once the test runner has switched them."""
    real, test = tmp_path / "real.db", tmp_path / "test_real.db"
    (tmp_path / "mysettings.py").write_text(
        "SECRET_KEY = 'x'\nUSE_TZ = True\nINSTALLED_APPS = ['outbox.contrib.django']\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', 'NAME': {str(real)!r}, "
        f"'TEST': {{'NAME': {str(test)!r}}}}}}}\n")
    for path, events in ((real, 0), (test, 1)):
        store = OutboxStore(f"sqlite:///{path}")
        try:
            store.migrate()
            with store.transaction() as cursor:
                from outbox import enqueue

                for _ in range(events):
                    enqueue(cursor.connection, topic="t", aggregate_type="o", aggregate_id="1", payload={})
        finally:
            store.close()
    out = ok(run([sys.executable, "-c", UNDER_PYTEST], cwd=tmp_path,
                 env={"DJANGO_SETTINGS_MODULE": "mysettings", "PYTHONPATH": pythonpath(tmp_path)}))
    assert f"relay database: sqlite:///{test}\n" in out, out
    assert '"pending": 1' in out, out
