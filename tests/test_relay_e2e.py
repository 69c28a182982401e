"""End to end with real ``celery -A outbox worker`` / ``beat`` processes: Redis as Celery's
broker, RabbitMQ as the destination, and the outbox on SQLite (a file), PostgreSQL and
MariaDB/MySQL. Each test gets its own outbox table (dropped afterwards), its own exchange
and queues on RabbitMQ and its own key prefix on Redis, so runs never see each other.

Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set. The
in-memory test needs no service at all.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest

from outbox import Status, enqueue
from outbox.engines.sqlite import sqlite_path
from outbox.store import OutboxStore

from services import AMQP_URL, MYSQL_URL, POSTGRES_URL, REDIS_URL, require

CELERY = str(Path(sys.executable).parent / "celery")

#: The engines the relay is run against end to end (SQL Server: tests/test_mssql_live.py).
DB_KINDS = ["sqlite", "postgresql", "mysql"]


# -- processes ---------------------------------------------------------------------------------

class Procs:
    """Relay processes of one test: every one is killed (with its children) at teardown."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # stopped on purpose: their exit is not a failure

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen([CELERY, "-A", "outbox", *args], cwd=self.tmp_path, env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def worker(self, name: str, concurrency: int = 2, queues: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        """``queues``: the worker's ``-Q`` (default: every relay queue)."""
        args = ["-Q", queues] if queues else []
        return self.start(name, "worker", "-c", str(concurrency), "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
                          "--loglevel=INFO", "--without-mingle", "--without-gossip", "--without-heartbeat", *args,
                          env=env)

    def tasks_in_hand(self, name: str, task: str = "outbox.publish") -> set[str]:
        """Ids of ``task`` the worker has received (reserved or running) and not finished."""
        received, finished = set(), set()
        for line in self.log(name).splitlines():
            if f"Task {task}[" not in line:
                continue
            task_id = line.split(f"Task {task}[", 1)[1].split("]", 1)[0]
            (received if line.endswith("] received") else finished).add(task_id)
        return received - finished

    def beat(self) -> subprocess.Popen[bytes]:
        return self.start("beat", "beat", "--loglevel=INFO", "-s", str(self.tmp_path / "beat-schedule"))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, name: str, timeout: float = 30.0) -> int:
        """A warm shutdown: SIGTERM to the main process only, as a supervisor or
        ``celery multi stop`` sends it; returns the exit code."""
        proc = self.procs[name]
        self.stopped.add(name)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL and name not in self.stopped:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-4000:]}")

    def stop_all(self) -> None:
        """At teardown the test has made its checks: no need for a graceful (and slower)
        warm shutdown. Kill every process group (pool children too) and reap them."""
        for name in self.procs:
            self.kill(name, signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass



def base_env(outbox: "Outbox", **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env.update({**outbox.env(), "PYTHONUNBUFFERED": "1"})
    env.update(settings)
    return env


@pytest.fixture
def procs_factory(tmp_path: Path) -> Iterator[Any]:
    """List it after the outbox fixture, so the relay stops before the table is dropped."""
    made: list[Procs] = []

    def make(env: dict[str, str]) -> Procs:
        p = Procs(tmp_path, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop_all()
    prefixes = {p.env.get("OUTBOX_TEST_REDIS_PREFIX") for p in made} - {None}
    if prefixes:
        import redis
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        for prefix in prefixes:
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)


# -- RabbitMQ ------------------------------------------------------------------------------------

class Destination:
    """A unique topic exchange with one queue bound to ``bindings`` (default: everything),
    and what arrived on it. With ``dead_letter=True`` also a unique dead-letter exchange
    with a queue bound to everything; what arrives there is in ``dead``."""

    def __init__(self, bindings: tuple[str, ...] = ("#",), dead_letter: bool = False) -> None:
        from kombu import Connection, Exchange, Queue, binding

        tag = uuid.uuid4().hex[:10]
        self.exchange_name = f"outbox-test-{tag}"
        self.conn = Connection(AMQP_URL, connect_timeout=5)
        self.channel = self.conn.channel()
        self.exchange = Exchange(self.exchange_name, type="topic", durable=True)
        self.queue = Queue(f"outbox-test-q-{tag}", bindings=[binding(self.exchange, routing_key=key)
                                                             for key in bindings],
                           durable=False, auto_delete=False)
        self.exchange(self.channel).declare()
        self.queue(self.channel).declare()
        self.messages: list[Any] = []
        self.dead: list[Any] = []
        self.consumers = [self.conn.Consumer(self.queue, callbacks=[self._on_message], accept=None, no_ack=False)]
        self.dead_exchange_name: str | None = None
        self.dead_exchange = self.dead_queue = None
        if dead_letter:
            self.dead_exchange_name = f"outbox-test-dlx-{tag}"
            self.dead_exchange = Exchange(self.dead_exchange_name, type="topic", durable=True)
            self.dead_queue = Queue(f"outbox-test-dlq-{tag}", self.dead_exchange, routing_key="#", durable=False,
                                    auto_delete=False)
            self.dead_exchange(self.channel).declare()
            self.dead_queue(self.channel).declare()
            self.consumers.append(self.conn.Consumer(self.dead_queue, callbacks=[self._on_dead], accept=None,
                                                     no_ack=False))
        for consumer in self.consumers:
            consumer.consume()

    def _on_message(self, body: Any, message: Any) -> None:
        self.messages.append(message)
        message.ack()

    def _on_dead(self, body: Any, message: Any) -> None:
        self.dead.append(message)
        message.ack()

    def wait_for(self, predicate: Any, timeout: float, procs: Procs | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            if procs is not None:
                procs.check_alive()
            try:
                self.conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            except OSError:  # socket.timeout on older Pythons
                pass
        return True

    def arrivals(self) -> list[tuple[int, str, Any]]:
        return [(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"]), m) for m in self.messages]

    def arrived(self) -> set[int]:
        return {int(m.headers["outbox_id"]) for m in self.messages}

    def close(self) -> None:
        try:
            for consumer in self.consumers:
                consumer.cancel()
            self.queue(self.channel).delete()
            self.exchange(self.channel).delete()
            if self.dead_exchange is not None:
                self.dead_queue(self.channel).delete()
                self.dead_exchange(self.channel).delete()
        finally:
            self.conn.release()


def require_relay_services() -> None:
    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)


@pytest.fixture
def destination() -> Iterator[Destination]:
    require_relay_services()
    d = Destination()
    yield d
    d.close()


def relay_env(tmp_path: Path, destination: Destination, outbox: "Outbox", **settings: str) -> dict[str, str]:
    """Settings for workers and beat: Redis (db of REDIS_URL, a key prefix of our own) as
    Celery's broker, set through a Celery config module as users would."""
    prefix = f"outbox-test-{uuid.uuid4().hex[:10]}:"
    (tmp_path / "relayconf.py").write_text(
        f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    return base_env(outbox, **{"OUTBOX_PUBLISH_URL": AMQP_URL, "OUTBOX_EXCHANGE": destination.exchange_name,
                               "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "CELERY_CONFIG_MODULE": "relayconf",
                               "OUTBOX_TEST_REDIS_PREFIX": prefix,
                               "PYTHONPATH": str(tmp_path), **settings})


# -- the outbox ----------------------------------------------------------------------------------

class Outbox:
    """The outbox of one test: a table of its own on one engine, dropped at teardown."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        if kind == "sqlite":
            self.url = f"sqlite:///{tmp_path / 'outbox.db'}"
        elif kind == "postgresql":
            require("PostgreSQL", "127.0.0.1", 5432)
            self.url = POSTGRES_URL
        elif kind == "mysql":
            require("MariaDB/MySQL", "127.0.0.1", 3306)
            self.url = MYSQL_URL
        else:
            raise ValueError(kind)
        self.kind = kind
        self.table = f"outbox_e2e_{uuid.uuid4().hex[:10]}"
        self.store = OutboxStore(self.url, table=self.table)
        self.store.migrate()

    def env(self) -> dict[str, str]:
        return {"OUTBOX_DATABASE_URL": self.url, "OUTBOX_TABLE": self.table}

    @contextmanager
    def writer(self) -> Iterator[Any]:
        """A plain DB-API connection playing the application that enqueues."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(sqlite_path(self.url), timeout=30)
        else:
            conn = self.store.engine.connect(self.url)
        try:
            yield conn
        finally:
            try:
                conn.rollback()
            finally:
                conn.close()

    def add(self, conn: Any, aggregate: str, n: int, *, topic: str | None = None, payload: Any = None,
            **kw: Any) -> int:
        return enqueue(conn, topic=topic or f"orders.{aggregate}.changed", aggregate_type="order",
                       aggregate_id=aggregate, table=self.table,
                       payload=payload if payload is not None else {"aggregate": aggregate, "n": n, "text": "grüße"},
                       **kw)

    def rows(self) -> dict[int, dict[str, Any]]:
        with self.store.transaction() as cursor:
            found = self.store.engine.execute(
                cursor, f"SELECT id, status, attempts, last_error, processed_at FROM {self.store.engine.table}"
            ).fetchall()
        return {int(r[0]): {"status": int(r[1]), "attempts": int(r[2]), "last_error": r[3],
                            "processed_at": self.store.engine.to_datetime(r[4])} for r in found}

    def statuses(self) -> dict[int, int]:
        return {id: row["status"] for id, row in self.rows().items()}

    def status_counts(self) -> dict[str, int]:
        values = list(self.statuses().values())
        return {Status(s).name: values.count(s) for s in set(values)}

    def max_attempts(self) -> int:
        with self.store.transaction() as cursor:
            found = self.store.engine.execute(cursor, f"SELECT MAX(attempts) FROM {self.store.engine.table}")
            return int(found.fetchone()[0] or 0)

    def drop(self) -> None:
        try:
            with self.store.transaction() as cursor:
                self.store.engine.execute(cursor, f"DROP TABLE IF EXISTS {self.store.engine.table}")
        finally:
            self.store.close()


@pytest.fixture(params=DB_KINDS)
def outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outbox]:
    o = Outbox(request.param, tmp_path)
    yield o
    o.drop()


@pytest.fixture
def sqlite_outbox(tmp_path: Path) -> Iterator[Outbox]:
    o = Outbox("sqlite", tmp_path)
    yield o
    o.drop()


def wait_until(predicate: Any, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def check_order(arrivals: list[tuple[int, str, Any]], expected: dict[str, list[int]]) -> None:
    """Per aggregate, the first arrivals come in id order, and every event arrived: no
    event before its predecessors, none missing, none from an aggregate not expected
    (rolled-back events use aggregates of their own)."""
    first: dict[str, list[int]] = {}
    seen: set[int] = set()
    for outbox_id, aggregate, _ in arrivals:
        if outbox_id in seen:
            continue  # at-least-once: a duplicate after a crash is allowed
        seen.add(outbox_id)
        first.setdefault(aggregate, []).append(outbox_id)
    for aggregate, ids in expected.items():
        assert first.get(aggregate) == ids, f"aggregate {aggregate}: arrived {first.get(aggregate)}, expected {ids}"
    assert set(first) == set(expected), f"unexpected aggregates arrived: {set(first) - set(expected)}"


def check_contract(message: Any, outbox_id: int, aggregate: str, body: Any, headers: dict[str, Any], key: str,
                   attempt: int = 1) -> None:
    """Body and headers of one published message, as the contract says."""
    assert message.content_type == "application/json"
    assert message.properties.get("delivery_mode") == 2
    assert json.loads(message.body) == body
    h = message.headers
    assert h["outbox_id"] == outbox_id and h["aggregate_id"] == aggregate
    assert h["topic"] == f"orders.{aggregate}.changed" == message.delivery_info["routing_key"]
    assert h["aggregate_type"] == "order" and h["attempt"] == attempt
    assert h["partition_key"] == key
    assert isinstance(h["message_id"], str) and h["message_id"] == message.properties.get("message_id")
    assert h["created_at"].endswith("Z")
    for name, value in headers.items():
        assert h[name] == value


# -- tests ---------------------------------------------------------------------------------------

def test_worker_and_beat_relay_every_event_in_order(tmp_path: Path, destination: Destination, outbox: Outbox,
                                                     procs_factory: Any) -> None:
    """A backlog, then live writers, some of whose transactions roll back: every committed
    event arrives once, in order per aggregate, none rolled back does, and the messages
    are what the contract says."""
    expected: dict[str, list[int]] = {}
    rows: dict[int, dict[str, Any]] = {}
    aggregates = [f"agg-{i}" for i in range(6)]
    with outbox.writer() as conn:
        for n in range(12):  # a backlog before the relay starts: drain mode, several claims
            for aggregate in aggregates:
                headers = {"tenant": "acme", "n": n}
                outbox_id = outbox.add(conn, aggregate, n, headers=headers, key=f"pk-{aggregate}")
                expected.setdefault(aggregate, []).append(outbox_id)
                rows[outbox_id] = {"aggregate": aggregate, "n": n, "headers": headers}
        conn.commit()
        outbox.add(conn, "rolled-back", 0)
        conn.rollback()

    procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_BATCH_SIZE="25",
                                    OUTBOX_CLAIM_INTERVAL_S="0.3"))
    procs.worker("w1")
    procs.beat()

    # Live writes while the relay runs, each commit followed by a rolled-back transaction.
    with outbox.writer() as conn:
        for n in range(12, 20):
            for aggregate in aggregates[:3]:
                outbox_id = outbox.add(conn, aggregate, n)
                expected[aggregate].append(outbox_id)
                rows[outbox_id] = {"aggregate": aggregate, "n": n, "headers": {}}
            conn.commit()
            outbox.add(conn, "rolled-back", n)
            outbox.add(conn, aggregates[0], n)  # rolled back with it: never published
            conn.rollback()
            time.sleep(0.05)

    total = sum(len(ids) for ids in expected.values())
    destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=40, procs=procs)
    arrivals = destination.arrivals()
    assert len(destination.arrived()) == total, (
        f"{len(destination.arrived())} of {total} arrived\n{procs.log('w1')[-3000:]}")
    check_order(arrivals, expected)
    assert len(arrivals) == total  # no crash here: no duplicates either

    for outbox_id, aggregate, message in arrivals:
        row = rows[outbox_id]
        check_contract(message, outbox_id, aggregate, {"aggregate": aggregate, "n": row["n"], "text": "grüße"},
                       row["headers"], f"pk-{aggregate}" if row["headers"] else aggregate)

    # Every row is acknowledged in the table, and only the committed rows exist.
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()
    assert sorted(outbox.statuses()) == sorted(rows)


def test_a_worker_killed_mid_run_loses_nothing(tmp_path: Path, destination: Destination, outbox: Outbox,
                                               procs_factory: Any) -> None:
    """Two workers (four processes) relay while writers commit (and roll back); one worker
    is SIGKILLed with its pool while it holds publish tasks, like a machine that died.
    Every committed event arrives, in order per aggregate (duplicates allowed), none rolled
    back does, and the rows it held come back through the lease (attempt 2).

    w1 reaches RabbitMQ through a proxy that delays every reply by 15 ms, so each wave of
    confirms of its publish tasks takes that long and the kill lands while it holds leased
    rows rather than between two tasks. Batches of 10 over 8 aggregates come back full, so
    they go out as publish tasks (not published inline by the claim)."""
    proxy = Proxy(delay=0.015)
    try:
        procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_BATCH_SIZE="10",
                                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="2000"))
        procs.worker("w1", OUTBOX_PUBLISH_URL=f"amqp://guest:guest@127.0.0.1:{proxy.port}//")
        procs.worker("w2")
        procs.beat()
        aggregates = [f"k-{i}" for i in range(8)]
        expected: dict[str, list[int]] = {a: [] for a in aggregates}
        stop = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                with outbox.writer() as conn:
                    n = 0
                    while not stop.is_set():
                        ids = [outbox.add(conn, aggregate, n) for aggregate in aggregates]
                        conn.commit()
                        for aggregate, outbox_id in zip(aggregates, ids):
                            expected[aggregate].append(outbox_id)
                        if n % 3 == 0:
                            outbox.add(conn, "rolled-back", n)
                            outbox.add(conn, aggregates[n % len(aggregates)], n)
                            conn.rollback()
                        n += 1
                        time.sleep(0.03)
            except BaseException as exc:  # reported by the test, not lost in the thread
                errors.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        try:
            destination.wait_for(lambda: len(destination.messages) >= 50, timeout=20, procs=procs)
            assert len(destination.messages) >= 50, procs.log("w1")[-3000:]
            # Kill w1 (main process and pool children) while it holds publish tasks.
            assert wait_until(lambda: bool(procs.tasks_in_hand("w1")), timeout=10, interval=0.005), (
                procs.log("w1")[-3000:])
            procs.kill("w1")
            destination.wait_for(lambda: False, timeout=1.0)  # writers go on after the kill
        finally:
            stop.set()
            thread.join(timeout=10)
        assert not errors, errors
        total = sum(len(ids) for ids in expected.values())
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=30)
        arrivals = destination.arrivals()
        assert len(destination.arrived()) == total, (
            f"{len(destination.arrived())} of {total} arrived\n{procs.log('w2')[-3000:]}")
        check_order(arrivals, expected)
        # The rows w1 held were recovered by their lease alone, an attempt counted.
        assert max(m.headers["attempt"] for _, _, m in arrivals) >= 2, "w1 held nothing when it was killed"
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), (
            outbox.status_counts())
        assert len(outbox.statuses()) == total  # nothing rolled back was ever stored
    finally:
        proxy.close()


def test_rows_of_a_lost_claim_come_back_with_the_lease(tmp_path: Path, destination: Destination, outbox: Outbox,
                                                        procs_factory: Any) -> None:
    """A claimer that leased rows and vanished (its task lost, its worker gone): the rows
    wait for the lease, hold back their aggregate meanwhile, and are then relayed in order
    with the attempt counted; other aggregates are never held up."""
    with outbox.writer() as conn:
        x1, x2 = outbox.add(conn, "x", 1), outbox.add(conn, "x", 2)
        y1 = outbox.add(conn, "y", 1)
        x3 = outbox.add(conn, "x", 3)
        conn.commit()
    lost = outbox.store.claim(2)  # the lease of a worker that will never acknowledge
    assert [m.id for m in lost.messages] == [x1, x2]
    leased_at = time.monotonic()
    procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2",
                                    OUTBOX_CLAIM_TIMEOUT_MS="6000"))
    procs.worker("w1")
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 4, timeout=30, procs=procs)
    arrivals = [(outbox_id, m.headers["attempt"]) for outbox_id, _, m in destination.arrivals()]
    assert [a[0] for a in arrivals] == [y1, x1, x2, x3], procs.log("w1")[-3000:]
    assert dict(arrivals) == {y1: 1, x1: 2, x2: 2, x3: 1}
    assert time.monotonic() - leased_at >= 6.0
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)


@pytest.fixture
def dead_letter_destination() -> Iterator[Destination]:
    """A destination whose queue is bound only for ``orders.#``, plus a dead-letter exchange."""
    require_relay_services()
    d = Destination(bindings=("orders.#",), dead_letter=True)
    yield d
    d.close()


def test_poison_and_retriable_events_go_dead_while_everything_else_flows(
        tmp_path: Path, dead_letter_destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    """(a) An event the publisher classifies POISON (larger than
    OUTBOX_RELAY_MAX_MESSAGE_BYTES) goes dead at once, on its first attempt, and a stub of
    it reaches the dead-letter exchange; the event of its aggregate before it arrived, the
    ones after it arrive. (b) An event that keeps failing as RETRIABLE (unroutable: no queue
    is bound for its topic, and the unroutable policy is "fail") goes dead after
    OUTBOX_MAX_ATTEMPTS=2 and is dead-lettered; while it waits for its retry, events of
    other aggregates committed meanwhile arrive, and the rest of its own aggregate follows
    only once it is dead."""
    destination = dead_letter_destination
    others = [f"o-{i}" for i in range(3)]
    expected: dict[str, list[int]] = {a: [] for a in [*others, "p", "u"]}
    with outbox.writer() as conn:
        for n in range(3):
            for aggregate in others:
                expected[aggregate].append(outbox.add(conn, aggregate, n))
        p1 = outbox.add(conn, "p", 1)
        p2 = outbox.add(conn, "p", 2, payload={"blob": "x" * 6000})  # above the 4096-byte limit
        p3, p4 = outbox.add(conn, "p", 3), outbox.add(conn, "p", 4)
        u1 = outbox.add(conn, "u", 1)
        u2 = outbox.add(conn, "u", 2, topic="unbound.u.changed")  # no queue is bound for it
        u3, u4 = outbox.add(conn, "u", 3), outbox.add(conn, "u", 4)
        conn.commit()
    expected["p"] += [p1, p3, p4]
    expected["u"] += [u1, u3, u4]

    # Backoff 4 s: u2's retry comes 2 to 4 s after its first failure (equal jitter).
    procs = procs_factory(relay_env(
        tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_MAX_ATTEMPTS="2",
        OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or "", OUTBOX_RELAY_MAX_MESSAGE_BYTES="4096",
        OUTBOX_RELAY_BACKOFF_BASE_S="4", OUTBOX_RELAY_BACKOFF_MAX_S="4"))
    procs.worker("w1")
    procs.beat()

    def u2_state() -> tuple[int, int]:
        row = outbox.rows()[u2]
        return row["status"], row["attempts"]

    # (a) poison: dead at once, on the dead-letter exchange; p1 before, p3 and p4 after.
    assert destination.wait_for(lambda: {p1, p3, p4} <= destination.arrived() and len(destination.dead) >= 1,
                                timeout=20, procs=procs), procs.log("w1")[-3000:]
    assert p2 not in destination.arrived()
    rows = outbox.rows()
    assert (rows[p2]["status"], rows[p2]["attempts"]) == (Status.DEAD, 1)
    assert rows[p2]["last_error"].startswith("poison: message size") and "4096" in rows[p2]["last_error"]
    [dead_p2] = [m for m in destination.dead if m.headers["outbox_id"] == p2]
    assert dead_p2.body in (b"", "") and dead_p2.headers["aggregate_id"] == "p"
    assert dead_p2.headers["x-outbox-error"].startswith("poison: message size")
    assert "above the maximum of 4096 bytes" in dead_p2.headers["x-outbox-omitted"]
    assert dead_p2.headers["attempt"] == 1 and dead_p2.delivery_info["routing_key"] == "orders.p.changed"

    # (b) u2 failed once (unroutable: retriable, an attempt spent) and waits for its retry;
    # u1 went before it, u3 and u4 wait behind it.
    assert wait_until(lambda: u2_state() == (Status.FAILED, 1), timeout=10), (u2_state(), procs.log("w1")[-3000:])
    assert "unroutable" in outbox.rows()[u2]["last_error"]
    assert destination.wait_for(lambda: u1 in destination.arrived(), timeout=5)
    assert not {u3, u4} & destination.arrived()
    # Meanwhile everything else flows: a burst committed now arrives while u2 still waits.
    with outbox.writer() as conn:
        burst = {aggregate: outbox.add(conn, aggregate, 10) for aggregate in [*others, "p"]}
        conn.commit()
    for aggregate, outbox_id in burst.items():
        expected[aggregate].append(outbox_id)
    assert destination.wait_for(lambda: set(burst.values()) <= destination.arrived(), timeout=10, procs=procs)
    assert u2_state() == (Status.FAILED, 1), "u2 went dead before the burst arrived: the test proves nothing"
    assert not {u3, u4} & destination.arrived()

    # Its second failure is its last (OUTBOX_MAX_ATTEMPTS=2): dead, dead-lettered, and u3, u4 follow.
    assert destination.wait_for(lambda: {u3, u4} <= destination.arrived() and len(destination.dead) >= 2,
                                timeout=20, procs=procs), (u2_state(), procs.log("w1")[-3000:])
    assert wait_until(lambda: outbox.statuses()[u3] == Status.DONE, timeout=10)  # its ack follows its arrival
    rows = outbox.rows()
    assert (rows[u2]["status"], rows[u2]["attempts"]) == (Status.DEAD, 2)
    assert rows[u2]["last_error"].startswith("retriable: unroutable: no queue bound for routing key 'unbound.u.changed'")
    assert rows[u3]["processed_at"] >= rows[u2]["processed_at"]  # u3 was done only after u2 was dead
    [dead_u2] = [m for m in destination.dead if m.headers["outbox_id"] == u2]
    assert json.loads(dead_u2.body) == {"aggregate": "u", "n": 2, "text": "grüße"}  # a whole copy
    assert dead_u2.headers["attempt"] == 2 and dead_u2.headers["x-outbox-error"].startswith("retriable: unroutable")
    assert dead_u2.delivery_info["routing_key"] == "unbound.u.changed"
    assert u2 not in destination.arrived()

    check_order(destination.arrivals(), expected)
    arrivals = destination.arrivals()
    assert len(arrivals) == len(destination.arrived())  # no duplicates
    attempts = {outbox_id: m.headers["attempt"] for outbox_id, _, m in arrivals}
    assert set(attempts.values()) == {1}  # released rows (p3, p4, u3, u4) spent no attempt
    assert sorted(m.headers["outbox_id"] for m in destination.dead) == sorted([p2, u2])
    assert wait_until(lambda: sorted(outbox.statuses().values()).count(Status.DONE) == len(arrivals), timeout=10)
    assert outbox.status_counts() == {"DONE": len(arrivals), "DEAD": 2}


def test_worker_alone_relays_the_embedded_default(tmp_path: Path, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """No service at all: SQLite, in-memory Celery broker and destination. The worker runs
    a thread pool and the schedule itself, and every row ends up done."""
    outbox = sqlite_outbox
    with outbox.writer() as conn:
        ids = [outbox.add(conn, f"m-{i % 3}", i) for i in range(30)]
        conn.commit()
    procs = procs_factory(base_env(outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_BATCH_SIZE="8"))
    procs.start("solo", "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                "--without-heartbeat")

    def done() -> bool:
        procs.check_alive()
        return [outbox.statuses().get(i) for i in ids] == [Status.DONE] * len(ids)

    assert wait_until(done, timeout=30), f"{outbox.statuses()}\n{procs.log('solo')[-3000:]}"
    assert "runs the schedule itself" in procs.log("solo")


class Proxy:
    """A TCP proxy in front of RabbitMQ that the test can cut (every connection dropped,
    new ones closed at once) and restore."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5672), delay: float = 0.0) -> None:
        import socket

        self.target = target
        self.delay = delay  # added to everything the broker sends back: a slow network path
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.closed = False
        self.sockets: list[Any] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets += [client, upstream]
            for a, b, delay in ((client, upstream, 0.0), (upstream, client, self.delay)):
                threading.Thread(target=self._pump, args=(a, b, delay), daemon=True).start()

    def _pump(self, src: Any, dst: Any, delay: float = 0.0) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        import socket

        self.up = False
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.sockets.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()


def test_broker_outage_pauses_claims_and_loses_nothing(tmp_path: Path, destination: Destination,
                                                       sqlite_outbox: Outbox, procs_factory: Any) -> None:
    outbox = sqlite_outbox
    proxy = Proxy()
    try:
        procs = procs_factory(relay_env(
            tmp_path, destination, outbox, OUTBOX_PUBLISH_URL=f"amqp://guest:guest@127.0.0.1:{proxy.port}//",
            OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_RELAY_BREAKER_S="1.0"))
        procs.worker("w1")
        procs.beat()
        aggregates = [f"o-{i}" for i in range(4)]
        expected: dict[str, list[int]] = {a: [] for a in aggregates}

        def write(rounds: range) -> None:
            with outbox.writer() as conn:
                for n in rounds:
                    for aggregate in aggregates:
                        expected[aggregate].append(outbox.add(conn, aggregate, n))
                    conn.commit()

        write(range(5))
        destination.wait_for(lambda: len(destination.messages) >= 20, timeout=20, procs=procs)
        assert len(destination.messages) == 20, procs.log("w1")[-3000:]

        proxy.cut()
        write(range(5, 10))
        time.sleep(3.0)  # the relay tries, fails, pauses, probes again...
        destination.wait_for(lambda: False, timeout=0.2)
        assert len(destination.messages) == 20  # nothing got through the cut
        during = outbox.statuses()
        assert Status.FAILED not in during.values() and Status.DEAD not in during.values(), during
        log = procs.log("w1")
        # One warning for the outage (docs/relay.md, "Outages in the log"), not one per probe.
        assert log.count("destination broker unreachable") == 1, log[-3000:]

        proxy.restore()
        total = sum(len(ids) for ids in expected.values())
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=20, procs=procs)
        arrivals = destination.arrivals()
        assert len(destination.arrived()) == total, procs.log("w1")[-3000:]
        check_order(arrivals, expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)
        assert outbox.max_attempts() == 0  # the outage spent no attempt
    finally:
        proxy.close()


# -- lost Celery messages: the lease recovers them ------------------------------------------------

@functools.lru_cache(maxsize=1)
def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


def celery_queue_keys(env: dict[str, str], queue: str) -> list[bytes]:
    """The Redis lists holding ``queue``'s messages for the relay run with ``env`` (its
    key prefix; kombu keeps a list per priority step, the plain name for the default)."""
    client = redis_client()
    prefix = env["OUTBOX_TEST_REDIS_PREFIX"]
    return [k for k in client.scan_iter(match=f"{prefix}{queue}*") if client.type(k) == b"list"]


def queued_celery_messages(env: dict[str, str], queue: str) -> int:
    return sum(redis_client().llen(key) for key in celery_queue_keys(env, queue))


def lose_celery_messages(env: dict[str, str], queue: str) -> int:
    """Delete every message waiting in ``queue`` of Celery's broker (a broker that lost
    them: a Redis failover, a flushed key); returns how many there were."""
    client, lost = redis_client(), 0
    for key in celery_queue_keys(env, queue):
        lost += client.llen(key)
        client.delete(key)
    return lost


def test_publish_tasks_lost_in_celerys_broker_come_back_with_the_lease(
        tmp_path: Path, destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    """A claim dispatched publish tasks and Celery's broker lost them before any worker
    took them. Nothing else knows about those rows: they stay claimed until the lease
    expires, then the next claim relays them in order, the lost delivery counted."""
    with outbox.writer() as conn:
        expected = {"a": [outbox.add(conn, "a", n) for n in range(3)],
                    "b": [outbox.add(conn, "b", n) for n in range(2)]}
        conn.commit()
    # Inline publishing off: the claim must send its rows on as publish tasks.
    env = relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_CLAIM_TIMEOUT_MS="3000",
                    OUTBOX_RELAY_INLINE_ROWS="0")
    procs = procs_factory(env)
    procs.worker("claimer", concurrency=1, queues="outbox.claim")  # nobody consumes outbox.publish yet
    procs.beat()
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.CLAIMED}, timeout=20), (
        outbox.status_counts(), procs.log("claimer")[-3000:])
    assert wait_until(lambda: queued_celery_messages(env, "outbox.publish") > 0, timeout=10)
    leased_at = time.monotonic()
    assert lose_celery_messages(env, "outbox.publish") >= 1
    procs.worker("w1")
    destination.wait_for(lambda: len(destination.messages) >= 5, timeout=30, procs=procs)
    assert time.monotonic() - leased_at >= 2.0, "rows came back before their lease expired"
    arrivals = destination.arrivals()
    check_order(arrivals, expected)
    assert len(arrivals) == 5, [a[0] for a in arrivals]
    # Rows behind a recovered head start chains of their own (one lost delivery each).
    assert {m.headers["attempt"] for _, _, m in arrivals} == {2}
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()


REFUSE_DONE_TRIGGER = {
    "sqlite": ["CREATE TRIGGER {name} BEFORE UPDATE OF status ON {table} WHEN NEW.status = 2 "
               "BEGIN SELECT RAISE(ABORT, 'test: mark_done refused'); END"],
    "postgresql": ["CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN RAISE EXCEPTION 'test: mark_done refused'; END $$",
                   "CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW WHEN (NEW.status = 2) "
                   "EXECUTE FUNCTION {name}()"],
    "mysql": ["CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW BEGIN IF NEW.status = 2 THEN "
              "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'test: mark_done refused'; END IF; END"],
}
DROP_DONE_TRIGGER = {
    "sqlite": ["DROP TRIGGER {name}"],
    "postgresql": ["DROP TRIGGER {name} ON {table}", "DROP FUNCTION {name}()"],
    "mysql": ["DROP TRIGGER {name}"],
}


def run_ddl(outbox: Outbox, statements: list[str]) -> None:
    name = f"{outbox.table}_refuse_done"
    with outbox.store.transaction() as cursor:
        for sql in statements:
            outbox.store.engine.execute(cursor, sql.format(name=name, table=outbox.store.engine.table))


def test_acks_that_never_land_are_recovered_by_the_lease_and_fenced_when_late(
        tmp_path: Path, destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    """The database refuses ``mark_done`` (a trigger) after the events were published, so
    the publish task hands its acks to the ``outbox.ack`` queue, which nobody consumes in
    time. The rows are recovered by the lease alone: claimed again, published again
    (duplicates, attempt 2, in order) and done. When the old acks finally run, their lease
    is gone: they change nothing and say so."""
    with outbox.writer() as conn:
        expected = {"a": [outbox.add(conn, "a", n) for n in range(3)], "b": [outbox.add(conn, "b", 0)]}
        conn.commit()
    run_ddl(outbox, REFUSE_DONE_TRIGGER[outbox.kind])
    env = relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_CLAIM_TIMEOUT_MS="3000")
    procs = procs_factory(env)
    procs.worker("w1", queues="outbox.claim,outbox.publish")  # the acks wait: nobody consumes outbox.ack
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 4, timeout=30, procs=procs)
    assert wait_until(lambda: queued_celery_messages(env, "outbox.ack") >= 1, timeout=10), procs.log("w1")[-3000:]
    assert "handing it to the ack queue" in procs.log("w1")
    assert set(outbox.statuses().values()) == {Status.CLAIMED}
    run_ddl(outbox, DROP_DONE_TRIGGER[outbox.kind])

    destination.wait_for(lambda: len(destination.messages) >= 8, timeout=30, procs=procs)
    arrivals = destination.arrivals()
    check_order(arrivals, expected)
    first, again = arrivals[:4], arrivals[4:]
    assert {m.headers["attempt"] for _, _, m in first} == {1}
    assert {m.headers["attempt"] for _, _, m in again} == {2}
    assert sorted(a[0] for a in again) == sorted(a[0] for a in first)
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()
    done_at = {id: row["processed_at"] for id, row in outbox.rows().items()}

    procs.worker("acks", concurrency=1, queues="outbox.ack")  # the late acks run now
    assert wait_until(lambda: queued_celery_messages(env, "outbox.ack") == 0
                      and "no longer holds" in procs.log("acks"), timeout=20), procs.log("acks")[-3000:]
    assert {id: row["processed_at"] for id, row in outbox.rows().items()} == done_at
    assert len(destination.messages) == 8


def test_a_warm_shutdown_finishes_the_tasks_in_hand_and_leaves_nothing_to_the_lease(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """SIGTERM to a worker's main process (what a deploy does): it stops claiming, the
    publish tasks it holds finish and settle their rows, and it exits cleanly. Another
    worker relays the rest at once: nothing waits for a lease, no attempt is spent, no
    event is sent twice.

    w1 reaches RabbitMQ through a proxy that delays every reply by 50 ms, so a task of one
    10-event chain takes about half a second and the signal lands while it is running."""
    outbox = sqlite_outbox
    with outbox.writer() as conn:
        expected = {f"k-{i}": [outbox.add(conn, f"k-{i}", n) for n in range(10)] for i in range(8)}
        conn.commit()
    proxy = Proxy(delay=0.05)
    try:
        procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_BATCH_SIZE="10",
                                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="300000"))
        procs.worker("w1", OUTBOX_PUBLISH_URL=f"amqp://guest:guest@127.0.0.1:{proxy.port}//")
        procs.beat()
        assert wait_until(lambda: bool(procs.tasks_in_hand("w1")), timeout=20, interval=0.01), (
            procs.log("w1")[-3000:])
        in_hand = procs.tasks_in_hand("w1")
        # Up to 30 s more than the tasks in hand: billiard's wait for unread results
        # (docs/relay.md, "Graceful shutdown").
        returncode = procs.stop("w1", timeout=90)
        log_w1 = procs.log("w1")
        assert returncode == 0, log_w1[-3000:]
        assert "claims stop" in log_w1
        for task_id in in_hand:
            assert f"Task outbox.publish[{task_id}] succeeded" in log_w1, log_w1[-3000:]

        procs.worker("w2")
        total = sum(len(ids) for ids in expected.values())
        # Well inside the 300 s lease: anything left to it would time this out.
        destination.wait_for(lambda: len(destination.messages) >= total, timeout=60, procs=procs)
        arrivals = destination.arrivals()
        check_order(arrivals, expected)
        assert len(arrivals) == total, "an event was sent twice"
        assert {m.headers["attempt"] for _, _, m in arrivals} == {1}
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)
    finally:
        proxy.close()
