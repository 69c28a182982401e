"""Flask with SQLAlchemy and Alembic (examples/flask): ``alembic upgrade head`` creates the
outbox table with the relay's own DDL (``outbox.contrib.alembic``), the same table
``outbox migrate`` makes, on SQLite and PostgreSQL; and an order posted to the Flask view
arrives on RabbitMQ through a real worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from app_support import renamed, schema_of
from services import AMQP_URL, ROOT, require

from outbox.storage.store import OutboxStore

pytest.importorskip("alembic")
pytest.importorskip("flask")

EXAMPLE = ROOT / "examples" / "flask"
BIN = Path(sys.executable).parent


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_", "DATABASE_"))}
    result = subprocess.run(args, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, (f"{' '.join(map(str, args))} exited with {result.returncode}\n"
                                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result


def sqlalchemy_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)



def assert_the_store_makes(url: str, made: Any) -> None:
    """``outbox migrate`` makes, on a table of its own, the schema ``made`` (``schema_of``)."""
    store = OutboxStore(url, table="outbox_store_made")
    try:
        store.migrate()
        assert renamed(schema_of(url, "outbox_store_made"), "outbox_store_made", "outbox") == made
    finally:
        with store.transaction() as cursor:
            cursor.execute('DROP TABLE IF EXISTS "outbox_store_made"')
        store.close()

def test_alembic_upgrade_creates_the_stores_table(database: dict[str, str], tmp_path: Path) -> None:
    url = database["DATABASE_URL"]
    run([str(BIN / "alembic"), "-c", str(EXAMPLE / "alembic.ini"), "upgrade", "head"],
        env={"DATABASE_URL": sqlalchemy_url(url)}, cwd=tmp_path)
    made_by_alembic = schema_of(url, "outbox")
    assert made_by_alembic, "alembic upgrade made no outbox table"
    assert_the_store_makes(url, made_by_alembic)
    # The relay's own tools find the table as they would have made it.
    again = run([str(BIN / "outbox"), "migrate"], env={"OUTBOX_DATABASE_URL": url}, cwd=tmp_path)
    assert schema_of(url, "outbox") == made_by_alembic
    assert "nothing to change" in again.stdout, again.stdout  # as docs/flask.md promises
    check = subprocess.run([str(BIN / "outbox"), "check"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
                                "OUTBOX_DATABASE_URL": url})
    assert "[ok  ] table" in check.stdout and "[ok  ] indexes" in check.stdout, check.stdout + check.stderr


def test_flask_db_migrate_on_the_example_writes_no_step_for_the_outbox_tables(database: dict[str, str],
                                                                             tmp_path: Path) -> None:
    """``alembic revision --autogenerate`` (what ``flask db migrate`` runs) on the example
    shop, its schema up to date: the revision has no step, where it once dropped the outbox
    table, its indexes and its holders table (examples/flask/migrations/env.py's filter)."""
    example = tmp_path / "shop"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("__pycache__", "*.db"))
    env = {"DATABASE_URL": sqlalchemy_url(database["DATABASE_URL"])}
    alembic = [str(BIN / "alembic"), "-c", str(example / "alembic.ini")]
    run([*alembic, "upgrade", "head"], env=env, cwd=tmp_path)
    run([*alembic, "revision", "--autogenerate", "-m", "nothing"], env=env, cwd=tmp_path)
    written = next(p for p in (example / "migrations" / "versions").glob("*.py") if "nothing" in p.name).read_text()
    upgrade = written.split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    assert "op." not in upgrade, written


def test_an_order_posted_to_the_flask_view_arrives_on_rabbitmq(tmp_path: Path) -> None:
    require("RabbitMQ", "127.0.0.1", 5672)
    from relay_e2e_support import Destination

    db = tmp_path / "shop.db"
    destination = Destination()
    env = {"DATABASE_URL": f"sqlite:///{db}", "OUTBOX_DATABASE_URL": f"sqlite:///{db}",
           "OUTBOX_PUBLISH_URL": AMQP_URL, "OUTBOX_EXCHANGE": destination.exchange_name,
           "OUTBOX_CLAIM_INTERVAL_S": "0.3", "PYTHONUNBUFFERED": "1"}
    worker: Any = None
    log = tmp_path / "worker.log"
    try:
        run([str(BIN / "alembic"), "-c", str(EXAMPLE / "alembic.ini"), "upgrade", "head"], env=env, cwd=tmp_path)
        post = (f"import json, sys\nsys.path.insert(0, {str(EXAMPLE)!r})\nfrom app import app, Order, Session\n"
                "c = app.test_client()\n"
                "for i in range(3):\n"
                "    r = c.post('/orders', json={'customer': f'c{i}', 'total_cents': i})\n"
                "    assert r.status_code == 201, r.data\n"
                "r = c.post('/orders', json={'customer': 'x', 'fail': True})\n"
                "assert r.status_code == 409\n"
                "assert Session().query(Order).count() == 3\nprint('posted')\n")
        assert "posted" in run([sys.executable, "-c", post], env=env, cwd=tmp_path).stdout
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
        with open(log, "wb") as out:
            worker = subprocess.Popen([str(BIN / "celery"), "-A", "outbox", "worker", "-c", "1", "--loglevel=INFO",
                                       "--without-mingle", "--without-gossip"], cwd=tmp_path, env={**clean, **env},
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        arrived = destination.wait_for(lambda: len(destination.messages) >= 3, timeout=60)
        assert arrived, f"{len(destination.messages)} of 3 arrived\n--- worker\n{log.read_text()[-4000:]}"
        assert sorted(json.loads(m.body)["customer"] for m in destination.messages) == ["c0", "c1", "c2"]
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        destination.close()


OFFLINE_ENV = '''
from alembic import context

context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=None, literal_binds=True,
                  dialect_opts={"paramstyle": "named"})  # Alembic's own template for offline mode
with context.begin_transaction():
    context.run_migrations()
'''

OFFLINE_REVISION = '''
revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

from outbox.contrib.alembic import create_outbox_table


def upgrade():
    create_outbox_table()


def downgrade():
    pass
'''


def offline_environment(tmp_path: Path, url: str) -> Path:
    """A scratch Alembic environment, offline mode as ``alembic init`` writes it, whose one
    revision calls ``create_outbox_table``; returns its alembic.ini."""
    (tmp_path / "env" / "versions").mkdir(parents=True)
    (tmp_path / "env" / "env.py").write_text(OFFLINE_ENV)
    (tmp_path / "env" / "versions" / "0001_outbox.py").write_text(OFFLINE_REVISION)
    ini = tmp_path / "alembic.ini"
    ini.write_text(f"[alembic]\nscript_location = {tmp_path / 'env'}\nsqlalchemy.url = {url}\n")
    return ini


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_alembic_offline_sql_makes_the_stores_table_on_postgres(database: dict[str, str], tmp_path: Path) -> None:
    """Found in review: ``alembic upgrade head --sql`` failed in ``create_outbox_table``
    ("enqueue needs an open DB-API connection": offline, Alembic has no connection). On
    PostgreSQL the script now holds the relay's migration, each guarded step a DO block that
    runs it only when its probe finds it not yet made: run on an empty database it makes the
    table ``outbox migrate`` makes, and run again it changes nothing."""
    import psycopg

    url = database["DATABASE_URL"]
    ini = offline_environment(tmp_path, sqlalchemy_url(url))
    script = run([str(BIN / "alembic"), "-c", str(ini), "upgrade", "head", "--sql"], env={}, cwd=tmp_path).stdout
    assert "CREATE TABLE IF NOT EXISTS" in script and "DO $outbox$" in script, script
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script)
    made_offline = schema_of(url, "outbox")
    assert_the_store_makes(url, made_offline)
    with psycopg.connect(url, autocommit=True) as conn:  # the same script on the table it made
        conn.execute("DROP TABLE alembic_version")
        conn.execute(script)
    assert schema_of(url, "outbox") == made_offline
    again = run([str(BIN / "outbox"), "migrate"], env={"OUTBOX_DATABASE_URL": url}, cwd=tmp_path)
    assert "nothing to change" in again.stdout, again.stdout


def test_alembic_offline_sql_on_an_engine_that_cannot_says_so(tmp_path: Path) -> None:
    """Where the migration's guarded steps cannot be written as SQL that guards itself
    (SQLite here; MySQL, SQL Server), ``--sql`` stops with one line naming the limitation
    and what to run instead, not with "enqueue needs an open DB-API connection"."""
    ini = offline_environment(tmp_path, f"sqlite:///{tmp_path / 'shop.db'}")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_", "DATABASE_"))}
    done = subprocess.run([str(BIN / "alembic"), "-c", str(ini), "upgrade", "head", "--sql"], cwd=tmp_path,
                          env=clean, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "offline mode (--sql) is not supported on sqlite" in done.stderr, done.stderr
    assert "DB-API connection" not in done.stderr, done.stderr


def test_autogenerate_with_the_filter_leaves_the_outbox_tables_alone_and_still_sees_yours(
        database: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the outbox tables are not in the application's MetaData, so Alembic's
    autogenerate (``flask db migrate``) wrote a revision dropping the outbox table, its
    indexes and its holders table; applied, it deleted every undelivered event. With
    ``outbox.contrib.alembic``'s ``include_name`` (or ``include_object``) in env.py it leaves
    them out, whatever OUTBOX_TABLE names them, and a change to the application's own
    tables still comes out."""
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    from outbox.contrib import alembic as outbox_alembic
    from outbox.core.config import reset_settings

    monkeypatch.setenv("OUTBOX_TABLE", "shop_events")
    reset_settings()
    made, wanted = sa.MetaData(), sa.MetaData()
    sa.Table("orders", made, sa.Column("id", sa.Integer, primary_key=True))
    sa.Table("orders", wanted, sa.Column("id", sa.Integer, primary_key=True), sa.Column("note", sa.String(50)))
    engine = sa.create_engine(sqlalchemy_url(database["DATABASE_URL"]))

    def diff(**filters: Any) -> list[tuple[str, str]]:
        with engine.connect() as conn:
            found = compare_metadata(MigrationContext.configure(conn, opts=filters), wanted)
        return sorted((step[0], step[1].name if hasattr(step[1], "name") else f"{step[2]}.{step[3].name}")
                      for step in found)

    try:
        with engine.begin() as conn:
            made.create_all(conn)
            outbox_alembic.create_outbox_table(Operations(MigrationContext.configure(conn)))
        unfiltered = diff()
        assert {name for step, name in unfiltered if step == "remove_table"} == {"shop_events", "shop_events_holders"}
        filters = getattr(outbox_alembic, "include_name", None), getattr(outbox_alembic, "include_object", None)
        assert None not in filters, "outbox.contrib.alembic has no include_name / include_object"
        assert diff(include_name=filters[0]) == [("add_column", "orders.note")]
        assert diff(include_object=filters[1]) == [("add_column", "orders.note")]
    finally:
        engine.dispose()


def test_the_filter_also_leaves_out_the_queue_tables_when_the_database_is_celerys_broker(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With the database as Celery's broker (docs/transport.md), its queue tables are the
    relay's too, named as the workers name them (OUTBOX_TRANSPORT_QUEUE_TABLE here)."""
    from outbox.contrib.alembic import include_name, relay_tables
    from outbox.core.config import reset_settings

    url = f"sqlite:///{tmp_path / 'shop.db'}"
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    monkeypatch.setenv("OUTBOX_CELERY_BROKER_URL", f"outboxdb+{url}")
    monkeypatch.setenv("OUTBOX_TRANSPORT_QUEUE_TABLE", "shop_queue")
    reset_settings()
    assert relay_tables() == {(None, "outbox"), (None, "outbox_holders"), (None, "shop_queue"),
                              (None, "shop_queue_binding")}
    assert not include_name("shop_queue_binding", "table", {"schema_name": None})
    assert include_name("orders", "table", {"schema_name": None})
    assert include_name("outbox", "table", {"schema_name": "archive"})  # another schema's, not the relay's
