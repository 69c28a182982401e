"""The relay's worker around the logic: stopping (a warm shutdown seen by publish tasks and,
through the main process's marker file, by pool children), the Celery app and its schedule,
settings from their sources and an invalid one stopping the worker, and messages surviving
the trip through Celery. Helpers and fixtures: tests/relay_support.py."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from relay_support import PYTHON, ScriptedPublisher, add, claim_chains, rows, run_python

from outbox import Status
from outbox.core.errors import ConfigError
from outbox.core.names import Queues, default_namespace
from outbox.relay import (
    CLAIM_TASK,
    PURGE_TASK,
    RelayContext,
    RelayOptions,
    handle_publish,
    message_from_dict,
    message_to_dict,
)
from outbox.storage.store import OutboxStore

# -- stopping ----------------------------------------------------------------------------------

def test_publish_task_started_while_stopping_releases_its_chains(sqlite_store: OutboxStore,
                                                                 conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 1)
    publisher = ScriptedPublisher()
    chains = claim_chains(sqlite_store)
    outcomes = handle_publish(RelayContext(sqlite_store, publisher, stopping=lambda: True), chains, deadline=time.time() + 60)
    assert publisher.sent == [] and all(o.skipped for o in outcomes)
    assert {i: (r["status"], r["attempts"]) for i, r in rows(sqlite_store).items()} == dict.fromkeys(a + b, (Status.PENDING, 0))


def test_pool_children_see_the_shutdown_through_the_main_process_marker(tmp_path: Path) -> None:
    """Celery signals a warm shutdown to the main process only; a prefork child learns of
    it from the marker file its parent leaves, and then neither claims nor publishes."""
    code = """
import os, tempfile
from celery import signals
import outbox.celery.tasks as t
tempfile.tempdir = os.environ["TMPDIR_FOR_TEST"]
signals.worker_process_init.send(sender=None)   # as in a pool child: the parent is our parent
before = t.stopping()
marker = t._stopping_marker(os.getppid(), create=True)
marker.touch()                                   # what the parent's worker_shutting_down leaves
during = (t.stopping(), t.claim(), t.request_claim())
marker.unlink()
print(before, *during, t.stopping())
"""
    done = run_python(code, tmp_path, TMPDIR_FOR_TEST=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "{'stopped':", "True}", "False", "False"]


def test_the_main_process_leaves_and_removes_the_marker(tmp_path: Path) -> None:
    code = """
import os, tempfile
from celery import signals
import outbox.celery.tasks as t
tempfile.tempdir = os.environ["TMPDIR_FOR_TEST"]
marker = t._stopping_marker(os.getpid(), create=True)
marker.touch()                                   # left by an earlier process with this pid
signals.worker_init.send(sender=None)
started = marker.exists()
signals.worker_shutting_down.send(sender=None, sig="TERM", how="Warm", exitcode=0)
print(started, marker.exists(), t.stopping())
signals.worker_shutdown.send(sender=None)
print(marker.exists())
"""
    done = run_python(code, tmp_path, TMPDIR_FOR_TEST=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "False"]


def test_the_main_process_imports_before_its_pool_forks_what_its_threads_import_later(tmp_path: Path) -> None:
    """The worker's main process runs relay threads (the heartbeat line, its holder record, the
    in-process claim, LISTEN) while its pool forks children at run time (``--autoscale``,
    ``--max-tasks-per-child``, a child replaced): a child forked while one of them was first
    importing the database driver waited for that import's lock for good (found in review:
    ``--autoscale 4,1``, the new children hung in ``import psycopg`` until their claim's hard time
    limit, and the warm shutdown waited the lease). So ``worker_init`` imports them first."""
    code = """
import sys
from celery import signals
import outbox.celery.worker
before = [m for m in ("psycopg", "kombu.transport.pyamqp") if m in sys.modules]
signals.worker_init.send(sender=None)
print(before, [m for m in ("psycopg", "kombu.transport.pyamqp", "outbox.storage.engines.postgres",
                           "outbox.publisher.kombu_publisher") if m in sys.modules])
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
                      OUTBOX_PUBLISH_URL="amqp://guest:guest@127.0.0.1:1//",
                      OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:1/0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("[] ['psycopg', 'kombu.transport.pyamqp', 'outbox.storage.engines.postgres', "
                                   "'outbox.publisher.kombu_publisher']"), done.stdout + done.stderr


def test_a_pool_process_forked_while_a_thread_holds_the_relays_locks_starts(tmp_path: Path) -> None:
    """A thread of the main process that holds the relay's locks when the pool forks (building the
    relay, starting its holder record) leaves them held in the child, where no thread will ever
    release them: ``worker_process_init`` must not wait for them."""
    code = """
import faulthandler, os, threading, time
from celery import signals
import outbox.celery.worker as w
holder_lock = w.relay().held._lock
held = threading.Event()
def hold():
    with w._relay_lock, holder_lock:
        held.set()
        time.sleep(3)
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(10, exit=True)   # a child that waits for a lock exits 1
    signals.worker_process_init.send(sender=None)
    w.relay().held.holder()
    w.close_resources()
    os._exit(0)
print(os.waitpid(pid, 0)[1])
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"], done.stdout + done.stderr


def test_a_process_forked_while_a_thread_is_in_a_sqlite_transaction_writes_and_keeps_what_it_inherited(
        tmp_path: Path) -> None:
    """SQLite keeps the locks a process holds on a file in the process's memory: a pool process
    forked while a thread of the worker's main process held the write lock (its holder record's
    beat) inherited that record, never the lock, and each of its ``BEGIN IMMEDIATE`` waited the
    busy timeout, again on every retry, until the claim's time limit (found in review: about one
    worker in four on SQLite with ``--max-tasks-per-child``). The fork now waits for the
    transaction; the child keeps the connections it inherited open, never closing the parent's."""
    code = """
import faulthandler, gc, os, threading
from outbox.core.model import Holder
from outbox.storage.store import OutboxStore
from outbox.storage.engines import sqlite
store = OutboxStore(os.environ["OUTBOX_DATABASE_URL"])
store.migrate()
inherited = id(store.connection())
began = threading.Event()
def hold():
    with store.transaction() as cursor:
        store.engine.begin(cursor)
        began.set()
        threading.Event().wait(0.5)  # the fork comes now, before the commit
threading.Thread(target=hold).start()
began.wait()
committed, tell = os.pipe()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(15, exit=True)  # a child that cannot write exits 1
    os.read(committed, 1)  # the parent's transaction is over
    store.beat(Holder("child", "host", os.getpid()), 60_000)  # BEGIN IMMEDIATE and a write
    gc.collect()
    kept = [c for c in sqlite.FORKS.inherited if id(c) == inherited]
    print("child wrote; inherited kept open:", bool(kept) and kept[0].total_changes >= 0, flush=True)
    os._exit(0)
for thread in threading.enumerate():
    if thread is not threading.main_thread():
        thread.join()
os.write(tell, b"x")
print("child exit status", os.waitpid(pid, 0)[1])
store.beat(Holder("parent", "host", os.getpid()), 60_000)
print("parent wrote")
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["child wrote; inherited kept open: True", "child exit status 0",
                                        "parent wrote"], done.stdout + done.stderr


def test_a_process_forked_after_the_wait_for_a_sqlite_transaction_ran_out_refuses_to_connect(
        tmp_path: Path) -> None:
    """The fork's wait is bounded (``sqlite.FORK_WAIT_S``, the busy timeout; a tenth of a second
    here): a child forked while a thread still held a transaction could never write, so it says
    so at its first connect instead of waiting on the busy timeout for good, and the parent warns."""
    code = """
import os, threading
from outbox.core.model import Holder
from outbox.storage.store import OutboxStore
from outbox.storage.engines import sqlite
sqlite.FORK_WAIT_S = 0.1
store = OutboxStore(os.environ["OUTBOX_DATABASE_URL"])
store.migrate()
began, done = threading.Event(), threading.Event()
def hold():
    with store.transaction() as cursor:
        store.engine.begin(cursor)
        began.set()
        done.wait(10)
threading.Thread(target=hold).start()
began.wait()
pid = os.fork()
if pid == 0:
    try:
        store.beat(Holder("child", "host", os.getpid()), 60_000)
        print("child wrote")
    except Exception as exc:
        print(type(exc).__name__, "forked while" in str(exc), flush=True)
    os._exit(0)
done.set()
print("child exit status", os.waitpid(pid, 0)[1])
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["OperationalError True", "child exit status 0"], done.stdout + done.stderr
    assert "forked while its thread(s) Thread-1 (hold) used SQLite" in done.stderr, done.stderr


# -- settings ----------------------------------------------------------------------------------

def test_relay_options_from_settings_sources() -> None:
    from outbox.publisher import DEFAULT_MAX_MESSAGE_BYTES
    assert RelayOptions().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert RelayOptions.from_sources({"OUTBOX_RELAY_MAX_MESSAGE_BYTES": "2048"}).max_message_bytes == 2048
    options = RelayOptions.from_sources({"OUTBOX_RELAY_TASK_ROWS": 7}, {"OUTBOX_RELAY_TASK_ROWS": "9",
                                                                      "OUTBOX_RELAY_BREAKER_S": "2.5"})
    assert (options.task_rows, options.breaker_s) == (7, 2.5)
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_MAX_QUEUED_TASKS"):
        RelayOptions.from_sources({"OUTBOX_RELAY_MAX_QUEUED_TASKS": "many"})
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_BREAKER_S"):
        RelayOptions.from_sources({"OUTBOX_RELAY_BREAKER_S": "0"})
    assert RelayOptions.from_sources({"OUTBOX_RELAY_INLINE_ROWS": "0"}).inline_rows == 0  # 0 = off
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_INLINE_ROWS.*>= 0"):
        RelayOptions.from_sources({"OUTBOX_RELAY_INLINE_ROWS": "-1"})


# -- the Celery app and the schedule (in a subprocess: a fresh app each time) ------------------

def test_celery_finds_the_app_from_any_directory_and_beat_uses_the_schedule(tmp_path: Path) -> None:
    code = """
import json
from celery.app.utils import find_app
import beat_schedule
app = find_app("outbox")
import outbox.celery
assert app is outbox.celery.app, app
print(json.dumps({"beat": app.conf.beat_schedule, "queues": [q.name for q in app.conf.task_queues],
                  "routes": app.conf.task_routes, "broker": app.conf.broker_url,
                  "prefetch": app.conf.worker_prefetch_multiplier, "pool": app.conf.worker_pool,
                  "expected": beat_schedule.build_schedule(),
                  "namespace": outbox.celery.application.relay_settings().outbox_namespace}))
"""
    done = run_python(code, tmp_path, OUTBOX_CLAIM_INTERVAL_S="0.5", OUTBOX_RELAY_PURGE_INTERVAL_S="120",
                      OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert done.returncode == 0, done.stderr
    conf = json.loads(done.stdout)
    assert conf["beat"] == conf["expected"]
    queues = Queues(conf["namespace"])  # this outbox's (outbox.core.names)
    assert conf["namespace"] == default_namespace(f"sqlite:///{tmp_path / 'outbox.db'}", "outbox")
    assert conf["beat"]["outbox-claim"] == {"task": CLAIM_TASK, "schedule": 0.5,
                                            "kwargs": {"requested": False, "outbox": queues.namespace},  # a tick
                                            "options": {"queue": queues.claim, "expires": 30.0}}  # the skew margin
    assert conf["beat"]["outbox-purge"]["task"] == PURGE_TASK and conf["beat"]["outbox-purge"]["schedule"] == 120
    assert conf["queues"] == [queues.claim, queues.publish, queues.ack, queues.purge]
    assert conf["broker"] == "redis://127.0.0.1:6379/14" and conf["prefetch"] == 1
    assert conf["routes"]["outbox.fail"] == {"queue": queues.ack}


def test_celery_config_keys_override_the_environment(tmp_path: Path) -> None:
    (tmp_path / "relayconf.py").write_text("OUTBOX_BATCH_SIZE = 7\nOUTBOX_RELAY_TASK_ROWS = 3\n")
    code = """
import outbox.celery as c
print(c.relay_settings().batch_size, c.relay_options().task_rows, c.app.conf.worker_pool)
"""
    done = run_python(code, tmp_path, OUTBOX_BATCH_SIZE="5", OUTBOX_RELAY_TASK_ROWS="9",
                      CELERY_CONFIG_MODULE="relayconf",
                      PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "3", "threads"]  # memory:// broker next to SQLite: threads


def test_a_config_modules_task_always_eager_does_not_make_beat_run_the_relays_tasks(tmp_path: Path) -> None:
    """``task_always_eager = True`` in the Celery config module (a project's test or dev settings)
    made beat run every claim tick itself: beat claimed and published batches in its scheduler
    loop, held leases as a holder of its own, and every send logged ``AlwaysEagerIgnored`` (found
    in review). The relay's tasks are always sent to its queues."""
    (tmp_path / "relayconf.py").write_text("task_always_eager = True\n")
    code = """
from celery.result import EagerResult
import outbox.celery as c
sent = c.app.tasks["outbox.claim"].apply_async(kwargs={"outbox": "elsewhere"})
print(c.app.conf.task_always_eager, isinstance(sent, EagerResult))
"""
    done = run_python(code, tmp_path, CELERY_CONFIG_MODULE="relayconf", OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                      PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"], done.stdout + done.stderr


@pytest.mark.parametrize("visibility, warned", [(3, True), (60, False), (None, False)])
def test_a_visibility_timeout_shorter_than_a_publish_task_may_run_is_warned_about(
        tmp_path: Path, visibility: int | None, warned: bool) -> None:
    """A config module's ``visibility_timeout`` wins over the relay's, and one shorter than a
    publish task may run (its time limit, the lease) made Celery's Redis broker deliver running
    publish tasks again: in review, 3 s against tasks of 6 s published 50 of 400 events twice,
    without a word. The worker says so as it starts."""
    options = {"global_keyprefix": "x:"} if visibility is None else {"visibility_timeout": visibility}
    (tmp_path / "relayconf.py").write_text(f"broker_transport_options = {options!r}\n")
    code = """
from celery import signals
import outbox.celery.worker
signals.worker_init.send(sender=None)
"""
    done = run_python(code, tmp_path, CELERY_CONFIG_MODULE="relayconf", OUTBOX_CLAIM_TIMEOUT_MS="60000",
                      OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
                      OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:1/0",
                      PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 0, done.stderr
    line = ("outbox: Celery's broker delivers a task again once it has gone unacknowledged for its "
            "visibility_timeout (3 s, broker_transport_options), which is shorter than a publish task may run "
            "(60 s, its time limit: the lease): a publish task still running would run twice, its events "
            "published twice; raise it above 60 s or leave it to the relay (docs/relay.md, \"Tasks, queues, and "
            "how to scale and route them\")")
    assert (line in done.stderr) is warned, done.stderr


def test_the_visibility_warning_names_the_setting_the_value_came_from(tmp_path: Path) -> None:
    """On the database broker the visibility timeout is also OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S;
    the warning named ``broker_transport_options`` for it too (found in review), which the
    operator then looked for in a Celery config module that had none."""
    code = """
from celery import signals
import outbox.celery.worker
signals.worker_init.send(sender=None)
"""
    done = run_python(code, tmp_path, OUTBOX_CLAIM_TIMEOUT_MS="30000", OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S="5",
                      OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                      OUTBOX_CELERY_BROKER_URL=f"outboxdb+sqlite:///{tmp_path / 'b.db'}")
    assert done.returncode == 0, done.stderr
    assert "visibility_timeout (5 s, OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S), which is shorter" in done.stderr, done.stderr


def test_an_invalid_setting_stops_the_worker_with_one_line(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    done = subprocess.run([str(Path(PYTHON).parent / "celery"), "-A", "outbox", "worker"], cwd=tmp_path,
                          env={**clean, "OUTBOX_CLAIM_TIMEOUT_MS": "99999999999"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("outbox: invalid configuration: OUTBOX_CLAIM_TIMEOUT_MS")
    assert "Traceback" not in done.stderr


def test_messages_survive_the_trip_through_celery(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 1, payload={"ü": [1, 2.5, None]}, headers={"tenant": "t1"}, key="pk")
    [message] = sqlite_store.claim(10).messages
    assert message_from_dict(json.loads(json.dumps(message_to_dict(message)))) == message


KEEPS_TRYING_ITS_BROKER = """
import os, threading, time
import outbox.celery.application as application
application.RECONNECT_EVERY_S = 0.001  # 150 attempts in about a second instead of five minutes
attempts = []
failed = application._ConnectOutage._failed
def counting(self, exc, interval):
    attempts.append(exc)
    failed(self, exc, interval)
application._ConnectOutage._failed = counting
from outbox.celery import app
def watch():
    deadline = time.monotonic() + 40
    while len(attempts) < 150 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.write(1, f"trying {len(attempts)}".encode())  # not print: the worker sends stdout to its log
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
app.Worker(pool="solo", loglevel="ERROR", without_heartbeat=True, without_mingle=True, without_gossip=True).start()
os.write(1, f"stopped {len(attempts)}".encode())
"""


def test_a_worker_keeps_trying_its_broker_while_the_outage_lasts(tmp_path: Path) -> None:
    """Found in review: Celery gives up on its broker after ``broker_connection_max_retries``
    attempts (100 by default) and the worker exits ("Unrecoverable error"); at the relay's
    attempt every 2 s that was a broker outage of 200 s. A real worker against a closed port,
    its attempts made quick: past 150 it is still trying (docs/relay.md, "Outages in the log")."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = run_python(KEEPS_TRYING_ITS_BROKER, tmp_path, OUTBOX_CELERY_BROKER_URL=f"redis://127.0.0.1:{port}/0",
                      OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'outbox.db'}")
    last = done.stdout.split()[-2:]  # after the worker's banner
    assert last[0] == "trying" and int(last[1]) >= 150, done.stdout[-500:] + done.stderr[-2000:]
    assert "Unrecoverable error" not in done.stderr


def test_a_worker_without_its_databases_driver_is_refused_in_one_line_naming_the_extra(tmp_path: Path) -> None:
    """It started, and said at every tick "database unreachable: ModuleNotFoundError: No module
    named 'psycopg' ... retried every tick", with no word of what to install (found in review)."""
    result = run_python("import sys\nsys.modules['psycopg'] = None  # not installed\n"
                        "from outbox.celery.application import app\nimport outbox.celery.worker\n"
                        "app.WorkController(pool='solo')\nprint('started')", tmp_path,
                        OUTBOX_DATABASE_URL="postgresql://app@db.invalid/app", OUTBOX_CELERY_BROKER_URL="memory://")
    assert result.returncode == 1 and "started" not in result.stdout, result
    assert result.stderr.strip().splitlines()[-1].startswith(
        "outbox: the PostgreSQL driver (psycopg) is not installed: pip install"), result.stderr


def test_a_worker_publishing_to_kafka_without_its_client_is_refused_in_one_line(tmp_path: Path) -> None:
    """It started, and its first publish was FATAL (claims paused 300 s on every worker)."""
    result = run_python("import sys\nsys.modules['confluent_kafka'] = None  # not installed\n"
                        "from outbox.celery.application import app\nimport outbox.celery.worker\n"
                        "app.WorkController(pool='solo')\nprint('started')", tmp_path,
                        OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", OUTBOX_PUBLISH_URL="kafka://127.0.0.1:9092")
    assert result.returncode == 1 and "started" not in result.stdout, result
    assert result.stderr.strip().splitlines()[-1].startswith(
        "outbox: OUTBOX_PUBLISH_URL is kafka:// but confluent-kafka is not installed: pip install"), result.stderr


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_worker_with_a_greenlet_pool_is_refused_in_one_line(tmp_path: Path, pool: str) -> None:
    """Each greenlet is a thread to the relay: under ``-P gevent`` every task's greenlet made
    a database connection and a publisher that nothing closed (found in review). The worker
    is refused as it starts (Celery's ``worker_init``, before the pool is even imported),
    saying which pools to use."""
    result = run_python("from outbox.celery.application import app\nimport outbox.celery.worker\n"
                        f"app.WorkController(pool={pool!r})\nprint('started')", tmp_path,
                        OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert result.returncode == 1 and "started" not in result.stdout, result
    assert result.stderr.strip().splitlines()[-1] == (
        f"outbox: the {pool} pool is not supported: every greenlet would hold a database connection and a "
        "publisher of its own, never closed; run the worker with the prefork (default), threads or solo pool")
