"""A web process that cannot wake the relay says so once at start-up (Django app, Flask
extension), in a fresh process each, as a web server would start them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from services import AMQP_URL, POSTGRES_URL, REDIS_URL, ROOT, require

FLASK_APP = """
import logging
logging.basicConfig(level=logging.INFO)
from flask import Flask
from outbox.contrib.flask import Outbox
app = Flask("shop")
Outbox(app, session=lambda: None)
Outbox(Flask("second"), session=lambda: None)  # a second app in the same process: no second warning
print("started")
"""

DJANGO_APP = """
import logging
logging.basicConfig(level=logging.INFO)
import django
django.setup()
print("started")
"""


def start(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**clean, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples" / "django"),
                                                                                  os.environ.get("PYTHONPATH")])), **env})
    assert result.returncode == 0 and "started" in result.stdout, result.stdout + result.stderr
    return result


def test_flask_warns_once_when_the_broker_is_in_memory(tmp_path: Path) -> None:
    warned = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert warned.stderr.count("outbox (Flask): Celery's broker is memory://") == 1, warned.stderr
    assert "set OUTBOX_CELERY_BROKER_URL" in warned.stderr
    quiet = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                  OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert "outbox (Flask)" not in quiet.stderr
    off = start(FLASK_APP, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", OUTBOX_RELAY_WAKE="0")
    assert "outbox (Flask)" not in off.stderr


@pytest.mark.parametrize("app", ["flask", "django"])
def test_an_invalid_setting_stops_a_web_app_at_start_up_naming_it(tmp_path: Path, app: str) -> None:
    """What enqueue reads, read at start-up: the Flask app started, and every request that
    enqueued failed on it; a Django web process started (its models read only the contract's
    settings), and every wake-up failed (found in review)."""
    code = FLASK_APP if app == "flask" else DJANGO_APP
    env = ({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"} if app == "flask" else
           {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}"})
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
    path = os.pathsep.join(filter(None, [str(ROOT / "examples" / "django"), os.environ.get("PYTHONPATH")]))
    for name, value in [("OUTBOX_MAX_PAYLOAD_BYTES", "1MB"), ("OUTBOX_RELAY_LISTEN", "maybe")]:
        result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60, env={**clean, "PYTHONPATH": path, **env, name: value})
        assert result.returncode != 0 and "started" not in result.stdout, result.stdout
        assert f"outbox.core.errors.ConfigError: {name}={value!r}" in result.stderr, result.stderr


def test_django_warns_once_at_start_up(tmp_path: Path) -> None:
    env = {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}"}
    warned = start(DJANGO_APP, tmp_path, **env)
    assert warned.stderr.count("outbox (Django): Celery's broker is memory://") == 1, warned.stderr
    quiet = start(DJANGO_APP, tmp_path, **env, OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert "outbox (Django)" not in quiet.stderr


CELERY = str(Path(sys.executable).parent / "celery")


def first_lines_of_a_worker(tmp_path: Path, cwd: Path, **env: str) -> str:
    """``celery -A outbox worker --loglevel=INFO`` as the README starts it, on the embedded
    default (SQLite, Celery's broker memory://): its log from start-up to a warm shutdown."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([CELERY, "-A", "outbox", "worker", "--loglevel=INFO", "-c", "1"], cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, env={**clean, **env})
        try:
            deadline = time.monotonic() + 60
            while " ready." not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2)  # its first claim ticks and their connections
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert " ready." in text, text
    return text


def test_a_worker_on_the_embedded_default_logs_no_warning_at_start_up(tmp_path: Path) -> None:
    """A first worker on the embedded default logged kombu's "No hostname was supplied.
    Reverting to default 'localhost'" at WARNING three times in its first second (once for
    every connection to memory://), and its banner showed `memory://:**@localhost//`."""
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    migrated = subprocess.run([str(Path(sys.executable).parent / "outbox"), "migrate"], cwd=tmp_path, text=True,
                              capture_output=True, timeout=60, env={**os.environ, "OUTBOX_DATABASE_URL": db})
    assert migrated.returncode == 0, migrated.stderr
    log = first_lines_of_a_worker(tmp_path, tmp_path, OUTBOX_DATABASE_URL=db)
    assert "this worker runs the schedule itself" in log, log
    assert "No hostname was supplied" not in log, log
    assert [line for line in log.splitlines() if "WARNING/" in line] == [], log
    banner = next(line for line in log.splitlines() if ".> transport:" in line)
    assert banner.split("transport:", 1)[1].strip() == "memory://", banner


def test_a_worker_on_a_server_database_without_a_destination_says_its_events_go_nowhere(tmp_path: Path) -> None:
    """OUTBOX_PUBLISH_URL unset is memory://: on PostgreSQL the worker marked every event done
    and sent it nowhere, without a word (found in review). The embedded default stays quiet
    (``test_a_worker_on_the_embedded_default_logs_no_warning_at_start_up``)."""
    from wake_support import drop_redis_keys, redis_prefix

    from outbox.core.config import load_settings
    from outbox.relay.waker import token_for

    require("PostgreSQL", "127.0.0.1", 5432)
    require("Redis", "127.0.0.1", 6379)
    # Celery's broker: the suite's Redis under a key prefix of this test's own (wakeconf.py),
    # deleted afterwards. Unprefixed, the worker's queues left kombu's bindings of them there.
    prefix = redis_prefix(tmp_path)
    env = {"OUTBOX_DATABASE_URL": POSTGRES_URL, "OUTBOX_TABLE": f"outbox_t{uuid.uuid4().hex[:10]}",
           "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "CELERY_CONFIG_MODULE": "wakeconf",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    try:
        log = first_lines_of_a_worker(tmp_path, tmp_path, **env)
        said = [line for line in log.splitlines() if "OUTBOX_PUBLISH_URL is memory://" in line]
        assert len(said) == 1 and "WARNING/" in said[0] and "reaches no broker" in said[0], log
        log = first_lines_of_a_worker(tmp_path, tmp_path, **env, OUTBOX_PUBLISH_URL=AMQP_URL)
        assert "OUTBOX_PUBLISH_URL is memory://" not in log, log
    finally:
        drop_redis_keys(prefix, token_for(REDIS_URL, prefix, load_settings(environ=env).outbox_namespace))


def test_the_django_apps_web_warning_stays_out_of_the_relays_own_worker(tmp_path: Path) -> None:
    """`DJANGO_SETTINGS_MODULE=shop.settings celery -A outbox worker` (examples/django's
    README): Celery sets Django up, so the app's web-process warning ("wake-ups after commit
    reach no worker") went into the worker's log, next to its own "this worker runs the
    schedule itself"."""
    example = ROOT / "examples" / "django"
    log = first_lines_of_a_worker(
        tmp_path, example, DJANGO_SETTINGS_MODULE="shop.settings", DATABASE_URL=f"sqlite:///{tmp_path / 'shop.db'}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(example), os.environ.get("PYTHONPATH")])))
    assert "this worker runs the schedule itself" in log, log
    assert "outbox (Django)" not in log, log


PROJECT_CELERY = """
import json, sys
from celery import Celery, current_app, shared_task
project = Celery("proj", broker="memory://")  # the project's own app (proj/celery.py), made current

@shared_task(name="proj.send_email")
def send_email(to):
    return to

import django
django.setup()                                # the Django app's ready()
from flask import Flask
from outbox.contrib.flask import Outbox
Outbox(Flask("shop"), session=lambda: None)   # the Flask extension's init_app
import outbox.wake
outbox.wake.request_claim()                   # a first wake after commit
assert outbox.wake.flush(10)
send_email.delay("ada@example.com")
with project.connection_for_read() as conn:           # the project's workers' queue, on its broker
    queue = conn.SimpleQueue("celery")
    task = queue.get(timeout=5).headers["task"] if queue.qsize() else None
print(json.dumps({"current": current_app.main, "bound": send_email.app.main, "task": task}))
"""


def test_the_projects_own_celery_app_stays_current_and_its_tasks_go_to_its_broker(tmp_path: Path) -> None:
    """Found in review: the relay's Celery app was made the process's current app when it was
    first imported (Celery's default), which the Django app's ready(), the Flask extension and
    the first wake do in a web process: from then on the project's own ``shared_task``s were
    sent with the relay's configuration, to the relay's broker and its claim queue, where no
    worker of the project's reads them."""
    import json

    import redis
    from services import REDIS_URL
    from wake_support import drop_redis_keys, redis_prefix

    prefix = redis_prefix(tmp_path)  # the relay's broker: keys of this test's own (wakeconf.py)
    env = {"DJANGO_SETTINGS_MODULE": "shop.settings", "DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}",
           "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "CELERY_CONFIG_MODULE": "wakeconf",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(ROOT / "examples" / "django"),
                                                       os.environ.get("PYTHONPATH")]))}
    try:
        ran = start(PROJECT_CELERY + "print('started')\n", tmp_path, **env)
        said = json.loads(ran.stdout.splitlines()[0])
        assert said == {"current": "proj", "bound": "proj", "task": "proj.send_email"}, ran.stdout + ran.stderr
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        sent_there = [key for key in client.scan_iter(match=f"{prefix}*") if client.type(key) == b"list"
                      and any(b"proj.send_email" in m for m in client.lrange(key, 0, -1))]
        assert sent_there == [], sent_there
    finally:
        drop_redis_keys(prefix)


def test_a_flask_app_built_before_the_tests_settings_leaves_them_to_be_read(tmp_path: Path) -> None:
    """A Flask app built at import (``from myapp import app``) before a test points
    OUTBOX_DATABASE_URL at its own database: ``init_app``'s start-up check left the settings it
    read cached, and the commands and an in-process relay of the tests kept the earlier database
    (found in review), as Django's ``ready()`` once did. The check forgets them, as Django's."""
    code = ("import os\nfrom flask import Flask\nfrom outbox.contrib.flask import Outbox\n"
            "from outbox.core.config import get_settings\n"
            "Outbox(Flask('shop'))\n"
            f"os.environ['OUTBOX_DATABASE_URL'] = 'sqlite:///{tmp_path / 'test.db'}'\n"
            "print(get_settings().database_url)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_"))}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env=clean)
    assert result.stdout.strip() == f"sqlite:///{tmp_path / 'test.db'}", (result.stdout, result.stderr)
