"""Real ``celery worker`` / ``beat`` processes with the DATABASE as Celery's broker
(``outboxdb+...``; no Redis anywhere), on SQLite, PostgreSQL and MariaDB (the task-app
tests also on SQL Server when OUTBOX_TEST_MSSQL_URL is set):

- a small Celery app: FIFO with one consumer, countdown stored invisible (no worker
  holds it), ``celery inspect ping`` and ``celery control shutdown``, two workers
  never running the same message, and an ``acks_late`` task whose worker is
  SIGKILLed delivered again after the visibility timeout;
- the outbox relay itself (``celery -A outbox worker`` + ``beat``) relaying events to
  RabbitMQ, with one of two workers SIGKILLed mid-run: nothing lost, order kept.

The process harness (Procs, Outbox, Destination) is the relay's e2e one; the Celery app is
tests/transport_support.py's.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import random
import signal
import subprocess
import termios
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from relay_e2e_support import (
    CELERY,
    DB_KINDS,
    Destination,
    Outbox,
    Procs,
    Writer,
    base_env,
    check_order,
    require,
    wait_until,
)
from services import AMQP_URL, REDIS_URL
from test_transport_prefork import waits_for_a_task
from transport_support import TaskApp

from outbox import Status
from outbox.storage.engines import engine_for_url
from outbox.transport import drop_queue_tables


@pytest.fixture(params=DB_KINDS + ["mssql"])  # SQL Server: with OUTBOX_TEST_MSSQL_URL
def task_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TaskApp]:
    app = TaskApp(request.param, tmp_path)
    yield app
    app.close()


def test_one_worker_fifo_countdown_and_remote_control(task_app: TaskApp) -> None:
    a = task_app
    record = a.task("record")
    for n in range(15):
        record.delay(n)
    a.worker("w1", concurrency=1)
    assert wait_until(lambda: len(a.lines("record")) == 15, timeout=60), a.log("w1")[-3000:]
    assert [int(x[1]) for x in a.lines("record")] == list(range(15))  # FIFO with one consumer

    # countdown: stored not-visible-until-due; the idle worker does not hold it meanwhile.
    sent = time.time()
    record.apply_async((100,), countdown=4)
    time.sleep(1.5)
    assert a.queue_rows() == [(None, 1)], "the delayed task should wait in the table, unleased"
    assert wait_until(lambda: len(a.lines("record")) == 16, timeout=30), a.log("w1")[-3000:]
    ran_at = float(a.lines("record")[-1][3])
    assert ran_at - sent >= 3.5

    ping = a.celery("inspect", "ping", "-t", "10")
    assert ping.returncode == 0 and "pong" in ping.stdout, ping.stdout + ping.stderr
    # The worker stops without replying (Celery's shutdown command sends no reply).
    a.celery("control", "shutdown", "-t", "2")
    assert a.procs["w1"].wait(30) == 0, a.log("w1")[-3000:]
    assert "shutdown" in a.log("w1").lower()


def test_two_workers_share_the_queue_and_a_killed_workers_task_comes_back(task_app: TaskApp) -> None:
    a = task_app
    a.worker("w1", concurrency=2)
    a.worker("w2", concurrency=2)
    record, slow = a.task("record"), a.task("slow")
    for n in range(60):
        record.delay(n)
    assert wait_until(lambda: len(a.lines("record")) >= 60, timeout=90), a.log("w1")[-2000:] + a.log("w2")[-2000:]
    time.sleep(1.0)
    ran = [int(x[1]) for x in a.lines("record")]
    assert sorted(ran) == list(range(60))  # every task once: no message went to two workers
    assert len({x[2] for x in a.lines("record")}) >= 2  # and both workers took part

    slow.delay(1)
    assert wait_until(lambda: a.lines("start"), timeout=60), a.log("w1")[-2000:] + a.log("w2")[-2000:]
    child = a.lines("start")[0][2]  # a pool process; its parent is the worker to kill
    parent = next(line.split()[1] for line in Path(f"/proc/{child}/status").read_text().splitlines()
                  if line.startswith("PPid:"))
    victim = next(name for name, proc in a.procs.items() if str(proc.pid) == parent)
    a.kill(victim)
    killed_at = time.monotonic()
    survivor = next(name for name in a.procs if name != victim)
    assert wait_until(lambda: a.lines("done"), timeout=60), a.log(survivor)[-3000:]
    [done] = a.lines("done")
    assert done[1] == "1" and done[3] == "True"  # delivered again, flagged redelivered
    assert time.monotonic() - killed_at >= 1.0  # after the visibility timeout, not at once


def test_transactional_send_runs_the_task_only_if_the_transaction_commits(task_app: TaskApp) -> None:
    from outbox.transport import SendError, send_task

    a = task_app
    a.worker("w1", concurrency=1)
    assert wait_until(lambda: "ready" in a.log("w1"), timeout=60), a.log("w1")[-3000:]  # tables exist now
    name = f"{a.module}.record"
    engine = engine_for_url(a.db_url)
    if engine.name == "sqlite":  # an application's connection: implicit transactions
        import sqlite3

        from outbox.storage.engines.sqlite import sqlite_path
        conn = sqlite3.connect(sqlite_path(a.db_url), timeout=30)
    else:
        conn = engine.connect(a.db_url)
    try:
        cursor = engine.cursor_for(conn)
        engine.execute(cursor, "CREATE TABLE " + engine.qualify(a.table + "_biz") + " (n INT)")
        conn.commit()
        biz = engine.qualify(a.table + "_biz")
        engine.execute(cursor, f"INSERT INTO {biz} (n) VALUES (?)", [1])
        send_task(conn, a.app, name, args=(1,))
        conn.rollback()  # the business change and the task vanish together
        engine.execute(cursor, f"INSERT INTO {biz} (n) VALUES (?)", [2])
        with pytest.raises(SendError, match="cannot serialize"):
            send_task(conn, a.app, name, args=(object(),))  # refused before anything is written
        with pytest.raises(SendError, match="task name"):
            send_task(conn, a.app, "", args=())
        task_id = send_task(conn, a.app, name, args=(2,))
        send_task(conn, a.app, name, args=(3,), countdown=2)
        conn.commit()  # the transaction was still usable after the refusals
        assert wait_until(lambda: len(a.lines("record")) >= 2, timeout=30), a.log("w1")[-3000:]
        time.sleep(1.0)
        assert [x[1] for x in a.lines("record")] == ["2", "3"]
        assert task_id in a.log("w1")
        assert [tuple(r) for r in engine.execute(cursor, f"SELECT n FROM {biz}").fetchall()] == [(2,)]
        engine.execute(cursor, f"DROP TABLE {biz}")
        conn.commit()
    finally:
        conn.close()


def test_transactional_send_follows_a_route_by_exchange_and_routing_key(task_app: TaskApp) -> None:
    """A task routed by exchange and routing key (Celery's own example: ``{"exchange": "feeds",
    "exchange_type": "topic", "routing_key": "feed.import"}``, no queue) goes where
    ``apply_async`` sends it: to the queues bound to that exchange for that key. Before,
    ``send_task`` failed with a bare ``KeyError: 'queue'`` (found in review); a key that no
    queue is bound for is refused with SendError before anything is written."""
    from kombu import Connection, Exchange, Queue

    from outbox.transport import SendError, send_task

    a = task_app
    a.worker("w1", concurrency=1)
    assert wait_until(lambda: "ready" in a.log("w1"), timeout=60), a.log("w1")[-3000:]  # bound: celery -> celery
    with Connection(a.env["TAPP_BROKER"], transport_options={"queue_table": a.table}) as kombu_conn:
        # The worker's queue bound to a topic exchange too, as a worker declaring it would.
        Queue("celery", Exchange("feeds", type="topic"), routing_key="feed.#")(kombu_conn.default_channel).declare()
    record, noted_nap, nap = (f"{a.module}.{task}" for task in ("record", "noted_nap", "nap"))
    a.app.conf.task_routes = {  # read once, at the router's first use
        record: {"exchange": "feeds", "exchange_type": "topic", "routing_key": "feed.import"},
        noted_nap: {"exchange": "celery", "exchange_type": "direct", "routing_key": "celery"},
        nap: {"exchange": "feeds", "exchange_type": "topic", "routing_key": "news.x"}}
    engine = engine_for_url(a.db_url)
    if engine.name == "sqlite":
        import sqlite3

        from outbox.storage.engines.sqlite import sqlite_path
        conn = sqlite3.connect(sqlite_path(a.db_url), timeout=30)
    else:
        conn = engine.connect(a.db_url)
    try:
        send_task(conn, a.app, record, args=(1,))  # topic: feed.# matches feed.import
        send_task(conn, a.app, noted_nap, args=(2, 0))  # direct: the worker's own binding
        with pytest.raises(SendError, match="no queue is bound to exchange 'feeds'"):
            send_task(conn, a.app, nap, args=(3,))
        conn.commit()  # still usable after the refusal
        assert wait_until(lambda: a.lines("record") and a.lines("nap"), timeout=30), a.log("w1")[-3000:]
        time.sleep(0.5)
        assert [x[1] for x in a.lines("record")] == ["1"] and [x[1] for x in a.lines("nap")] == ["2"]
    finally:
        conn.close()


@pytest.fixture(params=["sqlite", "mysql"])  # the engines without wake-ups (PostgreSQL: tests/test_transport_suites.py)
def backed_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TaskApp]:
    """The test app with a Redis result backend, the transport's default idle ceiling
    (polling_interval 1 s) and put locks off (docs/transport.md, "Remote control")."""
    require("Redis", "127.0.0.1", 6379)
    app = TaskApp(request.param, tmp_path, TAPP_BACKEND=REDIS_URL, TAPP_POLL="1.0", TAPP_PUTLOCKS="0")
    yield app
    app.close()


def test_expiry_remote_control_and_revoke_work_with_celerys_defaults(backed_app: TaskApp) -> None:
    from celery.exceptions import TaskRevokedError

    a = backed_app
    record, nap = a.task("record"), a.task("nap")
    # `expires` (Celery also sends it as the message's expiration): the expired task
    # still reaches the worker, which marks it REVOKED in the result backend.
    expired = record.apply_async((1,), expires=1)
    time.sleep(1.5)
    a.worker("w1", concurrency=1)
    with pytest.raises(TaskRevokedError):
        expired.get(timeout=30)
    assert expired.state == "REVOKED" and not a.lines("record")

    # Remote control within Celery's default 1 s reply timeout, from an idle worker
    # (polling at most every polling_interval = 1 s for tasks) on every engine.
    for attempt in range(4):
        time.sleep(2.0 if attempt == 0 else random.uniform(0.3, 1.2))  # idle: back-off at its ceiling
        replies = a.app.control.inspect(limit=1).ping()  # timeout=1.0, Celery's default
        assert replies and list(replies.values()) == [{"ok": "pong"}], (attempt, a.log("w1")[-2000:])

    # A revoke sent just before its task wins the race with it.
    for n in range(3):
        time.sleep(1.2)
        task_id = uuid.uuid4().hex
        a.app.control.revoke(task_id)
        revoked = record.apply_async((100 + n,), task_id=task_id)
        with pytest.raises(TaskRevokedError):
            revoked.get(timeout=30)
        assert not a.lines("record"), (n, a.log("w1")[-3000:])

    # With worker_pool_putlocks off, a busy pool does not hold up remote control.
    nap.delay(3)
    waiting = record.apply_async((200,))  # received, then waits for the only pool process
    assert wait_until(lambda: "nap" in a.log("w1") and "record" in a.log("w1").split("nap", 1)[-1],
                      timeout=15), a.log("w1")[-2000:]
    replies = a.app.control.inspect(limit=1).ping()
    assert replies and list(replies.values()) == [{"ok": "pong"}], a.log("w1")[-2000:]
    assert waiting.get(timeout=30) is None and [x[1] for x in a.lines("record")] == ["200"]


@pytest.mark.parametrize("stop", ["shutdown", "sigkill"])
def test_a_shutdown_sent_while_a_worker_is_down_is_not_run_by_its_next_start(stop: str, tmp_path: Path) -> None:
    """`celery control shutdown` while the worker w1 is down (stopped cleanly, or killed)
    must not stop the next w1: its control queue goes with a clean stop, and a command that
    expired before the new worker began consuming is not run. Before, the command waited in
    the queue (bound for ever, kept for its 300 s TTL) and the next w1 ran it at start."""
    a = TaskApp("mysql", tmp_path)
    try:
        record = a.task("record")
        a.worker("w1")
        record.delay(1)
        assert wait_until(lambda: len(a.lines("record")) == 1, timeout=60), a.log("w1")[-3000:]
        if stop == "sigkill":
            a.kill("w1")
        else:
            a.celery("control", "shutdown", "-t", "2")
            assert a.procs["w1"].wait(30) == 0, a.log("w1")[-3000:]
        a.celery("control", "shutdown", "-t", "1")  # nobody listens
        a.worker("w1")
        record.delay(2)
        assert wait_until(lambda: len(a.lines("record")) == 2, timeout=60), a.log("w1")[-3000:]
        time.sleep(2.0)  # the control consumer has polled its queue several times by now
        assert a.procs["w1"].poll() is None, a.log("w1")[-3000:]
    finally:
        a.close()


# -- the outbox relay on the database broker --------------------------------------------------------

@pytest.fixture
def destination() -> Iterator[Destination]:
    require("RabbitMQ", "127.0.0.1", 5672)
    d = Destination()
    yield d
    d.close()


def test_celery_turns_events_gossip_and_mingle_off_on_this_transport(tmp_path: Path) -> None:
    """What docs/transport.md says of `-E`, heartbeats, gossip and mingle ("Celery's events
    are off on this transport"), as Celery decides it for this transport's driver_type."""
    from celery import Celery
    from celery.worker.consumer.gossip import Gossip
    from celery.worker.consumer.mingle import Mingle

    app = Celery("events_off", broker=f"outboxdb+sqlite:///{tmp_path / 'broker.db'}")
    try:
        with app.connection_for_write() as conn:
            assert app.events.Dispatcher(conn, enabled=True).enabled is False  # -E, heartbeats
            assert conn.transport.driver_type not in Gossip.compatible_transports | Mingle.compatible_transports
    finally:
        app.close()


def test_relay_with_the_database_as_celerys_broker_survives_a_killed_worker(
        tmp_path: Path, destination: Destination, outbox: Outbox) -> None:
    queue_table = f"rq_{uuid.uuid4().hex[:10]}"
    env = base_env(outbox, OUTBOX_PUBLISH_URL=AMQP_URL, OUTBOX_EXCHANGE=destination.exchange_name,
                   OUTBOX_CELERY_BROKER_URL=f"outboxdb+{outbox.url}", OUTBOX_TRANSPORT_QUEUE_TABLE=queue_table,
                   OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S="10", OUTBOX_TRANSPORT_POLLING_INTERVAL_S="0.2",
                   OUTBOX_BATCH_SIZE="10", OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="3000",
                   # Small publish tasks, so w1 holds some when it is killed (a full claim
                   # otherwise publishes its one task itself).
                   OUTBOX_RELAY_TASK_ROWS="3")
    env.pop("OUTBOX_TEST_REDIS_PREFIX", None)
    procs = Procs(tmp_path, env)
    try:
        migrate = subprocess.run([str(Path(CELERY).parent / "outbox"), "migrate"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert migrate.returncode == 0 and queue_table in migrate.stdout, migrate.stdout + migrate.stderr
        procs.worker("w1")
        procs.worker("w2")
        procs.beat()
        with Writer(outbox, [f"k-{i}" for i in range(6)], rollback_every=4, pace=0.05) as writer:
            destination.wait_for(lambda: len(destination.messages) >= 40, timeout=60, procs=procs)
            assert len(destination.messages) >= 40, procs.log("w1")[-3000:]
            assert wait_until(lambda: any(mark in procs.log("w1") for mark in (
                "Task outbox.publish[", "Task outbox.claim[", "outbox claimed")), timeout=30), procs.log("w1")[-3000:]
            procs.kill("w1")  # main process and pool children, whatever they hold
            destination.wait_for(lambda: False, timeout=2.0)
        expected, total = writer.expected, len(writer.written)
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=60, procs=procs)
        assert len(destination.arrived()) == total, (
            f"{len(destination.arrived())} of {total} arrived\n{procs.log('w2')[-3000:]}")
        check_order(destination.arrivals(), expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=30), (
            outbox.status_counts())
        assert len(outbox.statuses()) == total
        banner = procs.log("w2")
        assert f"transport:   outboxdb+{outbox.url.split(':')[0]}" in banner, banner[:2000]  # no Redis anywhere
        assert "redis" not in (banner + procs.log("beat")).lower()
    finally:
        procs.stop_all()
        drop_queue_tables(outbox.url, queue_table)


@pytest.mark.slow  # about 25 s: four stops of a worker
def test_a_relay_worker_whose_process_group_gets_sigterm_exits(tmp_path: Path) -> None:
    """SIGTERM to the worker's whole process group (systemd's default KillMode=control-group,
    `kill -- -PGID`) also reaches the pool processes, one of which may die holding the prefork
    pool's task-queue lock; billiard's exit hook then waited for that lock for good (3 of 5
    stops in review, on this broker only: on Redis Celery's pool has no such lock). Each stop
    must end (docs/relay.md, "Signal the main process only")."""
    outbox = Outbox("postgresql", tmp_path)
    queue_table = f"rq_{uuid.uuid4().hex[:10]}"
    env = base_env(outbox, OUTBOX_CELERY_BROKER_URL=f"outboxdb+{outbox.url}", OUTBOX_TRANSPORT_QUEUE_TABLE=queue_table)
    procs = Procs(tmp_path, env)
    try:
        migrate = subprocess.run([str(Path(CELERY).parent / "outbox"), "migrate"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        for n in range(4):
            name = f"w{n}"
            worker = procs.worker(name)
            assert wait_until(lambda name=name: " ready." in procs.log(name), timeout=60), procs.log(name)[-3000:]
            time.sleep(0.5)  # the pool processes wait for tasks, one of them on the lock
            procs.stopped.add(name)
            procs.kill(name, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.send_signal(signal.SIGUSR1)  # Celery's thread dump, into the log
                time.sleep(1.0)
                raise AssertionError(f"stop {n + 1}: the worker did not exit within 30 s of its process group's "
                                     f"SIGTERM\n{procs.log(name)[-3000:]}") from None
    finally:
        procs.stop_all()
        drop_queue_tables(outbox.url, queue_table)
        outbox.drop()


def _pool_processes(worker: int) -> list[int]:
    """The worker's live pool processes: its children, forked by any of its threads
    (billiard's supervisor thread forks the replacements)."""
    children = []
    for task in Path(f"/proc/{worker}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(pid) for pid in (task / "children").read_text().split()]
    return [pid for pid in children if _wchan(pid) is not None]


def _wchan(pid: int) -> str | None:
    """Where the process's main thread sleeps in the kernel (None: gone or a zombie)."""
    try:
        if "(zombie)" in Path(f"/proc/{pid}/status").read_text():
            return None
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return None


@pytest.mark.slow  # about 17 s: a worker, beat, and the worker's warm stop
def test_a_pool_process_killed_while_idle_does_not_stall_its_worker(tmp_path: Path, destination: Destination) -> None:
    """On this transport Celery runs billiard's blocking pool, whose idle processes take turns
    at one task pipe: the one whose turn it is waits for a task holding the pipe's lock between
    processes. SIGKILLed there (the OOM killer), it used to leave that lock held: the other pool
    process and the replacement waited on it for good and the worker ran no further task (3 of 3
    in review), nor ended its warm shutdown. Now the lock dies with its holder and events written
    after the kill are relayed (docs/transport.md, "A pool process killed by SIGKILL")."""
    outbox = Outbox("postgresql", tmp_path)
    queue_table = f"rq_{uuid.uuid4().hex[:10]}"
    env = base_env(outbox, OUTBOX_PUBLISH_URL=AMQP_URL, OUTBOX_EXCHANGE=destination.exchange_name,
                   OUTBOX_CELERY_BROKER_URL=f"outboxdb+{outbox.url}", OUTBOX_TRANSPORT_QUEUE_TABLE=queue_table,
                   OUTBOX_CLAIM_INTERVAL_S="0.3")
    procs = Procs(tmp_path, env)
    try:
        migrate = subprocess.run([str(Path(CELERY).parent / "outbox"), "migrate"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        worker = procs.worker("w1", concurrency=2)
        assert wait_until(lambda: " ready." in procs.log("w1"), timeout=60), procs.log("w1")[-3000:]
        # No beat yet, so no task comes: the pool process whose turn it is waits on the empty pipe.

        def reader() -> int | None:
            pool = _pool_processes(worker.pid)
            reading = [pid for pid in pool if waits_for_a_task(_wchan(pid) or "")]
            return reading[0] if len(pool) == 2 and len(reading) == 1 else None

        assert wait_until(lambda: reader() is not None, timeout=30), (
            {pid: _wchan(pid) for pid in _pool_processes(worker.pid)})
        victim = reader()
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: "exited with 'signal 9 (SIGKILL)'" in procs.log("w1"), timeout=30), (
            procs.log("w1")[-3000:])
        killed_at = time.monotonic()
        procs.beat()
        with outbox.writer() as conn:
            ids = {outbox.add(conn, f"k-{n % 2}", n) for n in range(6)}
            conn.commit()
        destination.wait_for(lambda: destination.arrived() >= ids, timeout=30, procs=procs)
        assert destination.arrived() >= ids, (
            f"{len(destination.arrived() & ids)} of {len(ids)} relayed in 30 s after a pool process was killed\n"
            f"{procs.log('w1')[-3000:]}")
        assert time.monotonic() - killed_at < 30
        assert procs.stop("w1", timeout=45) == 0  # the pool's exit hook takes the same lock: it hung too
    finally:
        procs.stop_all()
        drop_queue_tables(outbox.url, queue_table)
        outbox.drop()


@pytest.mark.slow  # about 18 s: a worker, a kill, six tasks, the warm stop (the lost task: 10 s)
def test_a_pool_process_killed_while_writing_a_large_result_does_not_stall_its_worker(tmp_path: Path) -> None:
    """A failed task's exception info larger than the result pipe holds is written in several
    writes; its pool process SIGKILLed between two of them left the start of it in the pipe, and
    the worker's main process read every later result as the rest of it: 2 of 6 tasks sent after
    the kill ran (the two the pool had already taken), none acknowledged, and the warm shutdown
    hung (in review, 2 of 2). Now the unfinished message is dropped and the worker runs on
    (docs/transport.md, "A pool process killed by SIGKILL")."""
    app = TaskApp("postgresql", tmp_path, TAPP_POOL="outbox.transport.prefork:TaskPool")
    try:
        worker, go, victim = _running_a_large_failure(app, tmp_path)
        os.kill(worker.pid, signal.SIGSTOP)  # the reader of results stops: the pool process fills the pipe
        try:
            go.touch()
            assert wait_until(lambda: "pipe_write" in (_wchan(victim) or ""), timeout=10), _wchan(victim)
            os.kill(victim, signal.SIGKILL)
            assert wait_until(lambda: _wchan(victim) is None, timeout=10)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        for n in range(6):
            app.task("record").delay(n)
        assert wait_until(lambda: len(app.lines("record")) >= 6, timeout=30), (
            f"{len(app.lines('record'))} of 6 ran in 30 s after the kill\n{app.log('w1')[-3000:]}")
        assert sorted(int(line[1]) for line in app.lines("record")) == list(range(6))
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, app.log("w1")[-3000:]
        assert "outboxdb: a pool process died writing a message to the pool's pipe" in app.log("w1")
    finally:
        app.close()


@pytest.mark.slow  # about 40 s: five workers stopped cold under a stream of tasks
def test_a_cold_shutdown_under_load_ends(tmp_path: Path) -> None:
    """Celery's cold shutdown (SIGQUIT) stops the pool inside its signal handler and waits there
    for the pool's result handler, which acks finished tasks on the transport's connection; the
    handler had interrupted the main thread inside a statement on that connection, holding its
    lock, so the wait never ended (in review: 3 of 8 and 2 of 6 stops hung with
    --max-tasks-per-child=1). Now the pool's stop runs once the main thread is out of the
    transport (docs/transport.md, "A cold shutdown ends"). Five stops in a row, each within 30 s."""
    app = TaskApp("postgresql", tmp_path, TAPP_POOL="outbox.transport.prefork:TaskPool", TAPP_POLL="0.1")
    try:
        for run in range(5):
            name = f"w{run}"
            worker = app.worker(name, 2, "--max-tasks-per-child=1")
            assert wait_until(lambda: " ready." in app.log(name), timeout=60), app.log(name)[-3000:]  # noqa: B023
            for n in range(40):
                app.task("record").delay(n)
            time.sleep(0.5 + run * 0.3)
            worker.send_signal(signal.SIGQUIT)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"run {run}: the cold shutdown did not end in 30 s\n"
                                     f"{app.log(name)[-3000:]}") from None
            finally:
                app.kill(name)
    finally:
        app.close()


def _bytes_in_pipes(pid: int) -> dict[str, int]:
    """The bytes waiting in each pipe ``pid`` holds (FIONREAD on the pipe, opened through /proc)."""
    waiting = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            pipe = os.readlink(fd)
            if pipe.startswith("pipe:") and pipe not in waiting:
                opened = os.open(fd, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    count = array.array("i", [0])
                    fcntl.ioctl(opened, termios.FIONREAD, count)
                    waiting[pipe] = count[0]
                finally:
                    os.close(opened)
    return waiting


@pytest.mark.slow  # about 15 s: a worker, the kill, the task again, six tasks, the warm stop
def test_a_task_a_killed_pool_process_had_read_but_not_started_runs_at_once(tmp_path: Path) -> None:
    """A pool process SIGKILLed after it read a task from the pool's pipe and before it accepted
    it (billiard's ACK to the main process): the blocking pool did not know which process had
    taken it, so the task was never run nor failed, and its message came back only after the
    visibility timeout (29.2 s of 30 in review), its prefetch slot held for the life of the
    channel (with ``-c 1``: nothing received again, 0 of 6 tasks in 60 s). Now the main process
    hands the message back when it finds the process dead, and the task runs again at once
    (docs/transport.md, "A task a killed pool process had read").

    The window is held open from outside: process A runs ``fail_large`` and, the main process
    stopped, blocks writing its large exception into the result pipe, holding that pipe's write
    lock; process B, stopped while the task ``marked`` is written to the task pipe, then continued,
    reads it and waits for that lock to send its ACK; it is SIGKILLed there."""
    app = TaskApp("postgresql", tmp_path, TAPP_POOL="outbox.transport.prefork:TaskPool", TAPP_VISIBILITY="300")
    try:
        worker, go, a = _running_a_large_failure(app, tmp_path)

        def waiting_reader() -> int | None:
            return next((pid for pid in _pool_processes(worker.pid)
                         if pid != a and waits_for_a_task(_wchan(pid) or "")), None)

        assert wait_until(lambda: waiting_reader() is not None, timeout=30), (
            {pid: _wchan(pid) for pid in _pool_processes(worker.pid)})
        b = waiting_reader()
        assert b is not None
        os.kill(b, signal.SIGSTOP)
        before = _bytes_in_pipes(b)
        app.task("marked").delay(1)
        assert wait_until(lambda: any(n > before.get(p, 0) for p, n in _bytes_in_pipes(b).items()), timeout=30), (
            "the task never reached the pool's pipe\n" + app.log("w1")[-3000:])
        os.kill(worker.pid, signal.SIGSTOP)  # the reader of results stops: A fills the pipe and waits
        try:
            go.touch()
            assert wait_until(lambda: "pipe_write" in (_wchan(a) or ""), timeout=10), _wchan(a)
            os.kill(b, signal.SIGCONT)
            assert wait_until(lambda: "fcntl_setlk" in (_wchan(b) or ""), timeout=10), _wchan(b)  # read, ACK waits
            os.kill(b, signal.SIGKILL)
            assert wait_until(lambda: _wchan(b) is None, timeout=10)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert wait_until(lambda: app.lines("marked"), timeout=30), (
            f"the task B had read did not run again within 30 s of the kill (visibility timeout 300 s)\n"
            f"{app.log('w1')[-3000:]}")
        [marked] = app.lines("marked")
        assert marked[1] == "1" and int(marked[2]) != b and marked[4] == "True"  # again, flagged redelivered
        for n in range(6):
            app.task("record").delay(n)
        assert wait_until(lambda: len(app.lines("record")) >= 6, timeout=30), app.log("w1")[-3000:]
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, app.log("w1")[-3000:]
        log = app.log("w1")
        assert f"its pool process (pid {b}) died before it started it" in log
        assert "changed nothing" not in log, log[-3000:]  # no stale lease left in the prefetch window
        assert app.queue_rows() == []
    finally:
        app.close()


def _running_a_large_failure(app: TaskApp, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, int]:
    """A worker of ``app`` (``-c 2``) running ``fail_large``, whose 1 MB exception, more than the
    result pipe holds, is raised once the file ``go`` exists: (the worker, ``go``, the pool
    process running it)."""
    worker = app.worker("w1", concurrency=2)
    assert wait_until(lambda: " ready." in app.log("w1"), timeout=60), app.log("w1")[-3000:]
    go = tmp_path / "go"
    app.task("fail_large").delay(1_000_000, str(go))
    assert wait_until(lambda: app.lines("fail_large"), timeout=30), app.log("w1")[-3000:]
    return worker, go, int(app.lines("fail_large")[0][1])
