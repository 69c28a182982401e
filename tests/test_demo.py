"""``outbox demo`` is the README's first command: it must run and pass its own checks
on a machine with nothing but the package, and leave nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path


def demo(tmp_path: Path, *args: str, **outbox_env: str) -> subprocess.CompletedProcess:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli", "demo", *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, **outbox_env, "TMPDIR": str(scratch)}, timeout=120)


def test_demo_runs_the_whole_pipeline_and_passes_its_checks(tmp_path: Path) -> None:
    result = demo(tmp_path)
    log = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, log
    for check in ("every committed event arrived", "in order per order id",
                  "the rolled-back event never arrived", "every row is done"):
        assert f"[ok] {check}" in result.stdout, log
    assert result.stdout.count("broker <- ") == 12, log
    assert "orders.cancelled" not in result.stdout.split("relay:")[1], log
    # Nothing left behind: no temporary folder, no outbox.db in the current directory.
    assert list((tmp_path / "tmp").iterdir()) == [], log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"], log


def test_demo_keep_leaves_its_outbox_for_inspection(tmp_path: Path) -> None:
    result = demo(tmp_path, "--keep", "--timeout", "60")
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    kept = list((tmp_path / "tmp").glob("outbox-demo-*/outbox.db"))
    assert len(kept) == 1 and f"sqlite:///{kept[0]}" in result.stdout


def test_demo_runs_on_the_embedded_default_whatever_the_shell_has_set(tmp_path: Path) -> None:
    """Found in review: a deployment's OUTBOX_SCHEMA left in the shell made the demo's SQLite
    look for a database "app"; the demo drops every OUTBOX_* setting for its own."""
    result = demo(tmp_path, OUTBOX_SCHEMA="app", OUTBOX_TABLE="events_out", OUTBOX_EXCHANGE="elsewhere")
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert "[ok] every row is done" in result.stdout


def test_demo_ignores_the_shells_django_settings(tmp_path: Path) -> None:
    """Found in review: the demo dropped the shell's OUTBOX_* variables but kept its
    DJANGO_SETTINGS_MODULE, whose OUTBOX_* settings (read after the environment) took the
    demo's SQLite to a schema "app" and its events to another exchange."""
    (tmp_path / "shellsettings.py").write_text("SECRET_KEY = 'x'\nOUTBOX_SCHEMA = 'app'\n"
                                               "OUTBOX_EXCHANGE = 'elsewhere'\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = demo(tmp_path, DJANGO_SETTINGS_MODULE="shellsettings", PYTHONPATH=pythonpath)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert "[ok] every row is done" in result.stdout


class CountingServer:
    """A local port that closes every connection it accepts and counts them: a broker the
    demo must never reach."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()[0]
            except OSError:  # the listener closed: the test is over
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(5)


def test_demo_ignores_the_shells_celery_configuration(tmp_path: Path) -> None:
    """Found in review: the demo dropped the shell's OUTBOX_* variables but kept its
    CELERY_CONFIG_MODULE (`celery --config` sets it), whose OUTBOX_* keys are read before the
    environment: it ran its migration on the deployment's PostgreSQL database and published
    its fake orders to the deployment's RabbitMQ exchange. Nor may Celery's own broker
    (CELERY_BROKER_URL, a config module's broker_url) be the demo's: it touches nothing
    outside its temporary folder."""
    import psycopg
    from kombu import Connection, Exchange, Queue
    from services import AMQP_URL, POSTGRES_URL, require

    require("PostgreSQL", "127.0.0.1", 5432)
    require("RabbitMQ", "127.0.0.1", 5672)
    tag = uuid.uuid4().hex[:10]
    table, exchange = f"demo_leak_{tag}", Exchange(f"demo-leak-{tag}", type="topic", durable=True)
    watcher = Queue(f"demo-leak-{tag}", exchange, routing_key="#", durable=False, auto_delete=False)
    celery_broker, env_broker = CountingServer(), CountingServer()
    (tmp_path / "deployconfig.py").write_text(
        f"OUTBOX_DATABASE_URL = {POSTGRES_URL!r}\nOUTBOX_TABLE = {table!r}\n"
        f"OUTBOX_PUBLISH_URL = {AMQP_URL!r}\nOUTBOX_EXCHANGE = {exchange.name!r}\n"
        f"OUTBOX_CELERY_BROKER_URL = 'redis://127.0.0.1:{celery_broker.port}/0'\n"
        f"broker_url = 'redis://127.0.0.1:{celery_broker.port}/0'\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    with Connection(AMQP_URL, connect_timeout=5) as amqp:
        watcher(amqp.channel()).declare()
    try:
        result = demo(tmp_path, CELERY_CONFIG_MODULE="deployconfig", PYTHONPATH=pythonpath,
                      CELERY_BROKER_URL=f"redis://127.0.0.1:{env_broker.port}/0")
        log = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        with psycopg.connect(POSTGRES_URL, autocommit=True) as pg:
            made = pg.execute("SELECT to_regclass(%s)", [table]).fetchone()[0]
        with Connection(AMQP_URL, connect_timeout=5) as amqp:
            arrived = watcher(amqp.channel()).queue_declare(passive=True).message_count
        assert made is None, f"the demo created {table} in PostgreSQL\n{log}"
        assert arrived == 0, f"{arrived} demo events reached the deployment's exchange\n{log}"
        assert (celery_broker.accepted, env_broker.accepted) == (0, 0), f"the demo reached a Celery broker\n{log}"
        assert result.returncode == 0, log
        assert "[ok] every row is done" in result.stdout, log
    finally:
        celery_broker.close()
        env_broker.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as pg:
            pg.execute(f'DROP TABLE IF EXISTS "{table}"')
            pg.execute(f'DROP TABLE IF EXISTS "{table}_holders"')
        with Connection(AMQP_URL, connect_timeout=5) as amqp:
            channel = amqp.channel()
            watcher(channel).delete()
            exchange(channel).delete()


def test_demo_refuses_a_process_configured_before_it(tmp_path: Path) -> None:
    """A program that configured the relay's Celery app before calling ``run_demo`` keeps
    that configuration whatever the environment then says: the demo refuses it before it
    touches anything."""
    import pytest

    from outbox.commands.demo import _check_confined
    from outbox.core.config import Settings
    from outbox.core.errors import ConfigError

    db = tmp_path / "outbox.db"
    own = Settings(database_url=f"sqlite:///{db}", publish_url="memory://", celery_broker_url="memory://")
    _check_confined(db, own, "memory://")
    with pytest.raises(ConfigError, match="Celery app's broker would be redis://127.0.0.1:6379/0"):
        _check_confined(db, own, "redis://127.0.0.1:6379/0")
    elsewhere = Settings(database_url="postgresql://app:s3cret@db/app", publish_url="memory://",
                         celery_broker_url="memory://")
    with pytest.raises(ConfigError, match=r"database would be postgresql://app:\*\*\*@db/app") as refused:
        _check_confined(db, elsewhere, "memory://")
    assert "s3cret" not in str(refused.value)


def test_a_failed_demo_says_so_in_one_error_line_and_what_to_try(tmp_path: Path) -> None:
    """It ended `Error: the demo's checks failed` (click's own prefix; every other error of the
    command line is one `error:` line) with nothing to try, and took any --timeout, NaN and
    negative ones too (found in the first-hour review: `make demo` on a busy machine)."""
    failed = demo(tmp_path, "--timeout", "0.001")
    assert failed.returncode == 1, failed
    assert "[FAILED] every committed event arrived" in failed.stdout, failed.stdout
    assert failed.stderr.splitlines() == [
        "error: the demo's checks failed (the [FAILED] lines above); on a slow or busy machine give it longer: "
        "--timeout (this run: 0.001 s)"], failed.stderr
    for bad in ("nan", "-5", "0", "inf"):
        refused = demo(tmp_path, "--timeout", bad)
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert refused.stderr.splitlines() == [
            "error: Invalid value for '--timeout': a finite number of seconds above 0, not " + bad], refused.stderr
