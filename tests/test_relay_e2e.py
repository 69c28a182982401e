"""End to end with real ``celery -A outbox worker`` / ``beat`` processes: SQLite in a file,
Redis as Celery's broker, RabbitMQ as the destination. Each test gets its own exchange and
queue on RabbitMQ and its own key prefix on Redis, so runs never see each other.

Skipped when Redis or RabbitMQ is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
The in-memory test at the end needs no service at all.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any, Iterator

import pytest

from outbox import Status, enqueue
from outbox.store import OutboxStore

from services import AMQP_URL, REDIS_URL, require

CELERY = str(Path(sys.executable).parent / "celery")


# -- processes ---------------------------------------------------------------------------------

class Procs:
    """Relay processes of one test: every one is killed (with its children) at teardown."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen([CELERY, "-A", "outbox", *args], cwd=self.tmp_path, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def worker(self, name: str, concurrency: int = 2) -> subprocess.Popen[bytes]:
        return self.start(name, "worker", "-c", str(concurrency), "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
                          "--loglevel=INFO", "--without-mingle", "--without-gossip", "--without-heartbeat")

    def beat(self) -> subprocess.Popen[bytes]:
        return self.start("beat", "beat", "--loglevel=INFO", "-s", str(self.tmp_path / "beat-schedule"))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode not in (-signal.SIGKILL,):
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-4000:]}")

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill(name, signal.SIGKILL)  # the whole group: pool children too
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def base_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env.update({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'outbox.db'}", "PYTHONUNBUFFERED": "1"})
    env.update(settings)
    return env


@pytest.fixture
def procs_factory(tmp_path: Path) -> Iterator[Any]:
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
    """A unique topic exchange with one queue bound to '#', and what arrived on it."""

    def __init__(self) -> None:
        from kombu import Connection, Exchange, Queue

        tag = uuid.uuid4().hex[:10]
        self.exchange_name = f"outbox-test-{tag}"
        self.conn = Connection(AMQP_URL, connect_timeout=5)
        self.channel = self.conn.channel()
        self.exchange = Exchange(self.exchange_name, type="topic", durable=True)
        self.queue = Queue(f"outbox-test-q-{tag}", self.exchange, routing_key="#", durable=False,
                           auto_delete=False)
        self.exchange(self.channel).declare()
        self.queue(self.channel).declare()
        self.messages: list[Any] = []
        self.consumer = self.conn.Consumer(self.queue, callbacks=[self._on_message], accept=None, no_ack=False)
        self.consumer.consume()

    def _on_message(self, body: Any, message: Any) -> None:
        self.messages.append(message)
        message.ack()

    def wait_for(self, predicate: Any, timeout: float, procs: Procs | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return
            if procs is not None:
                procs.check_alive()
            try:
                self.conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            except OSError:  # socket.timeout on older Pythons
                pass

    def arrivals(self) -> list[tuple[int, str, Any]]:
        return [(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"]), m) for m in self.messages]

    def close(self) -> None:
        try:
            self.consumer.cancel()
            self.queue(self.channel).delete()
            self.exchange(self.channel).delete()
        finally:
            self.conn.release()


@pytest.fixture
def destination() -> Iterator[Destination]:
    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)
    d = Destination()
    yield d
    d.close()


def relay_env(tmp_path: Path, destination: Destination, **settings: str) -> dict[str, str]:
    """Settings for workers and beat: Redis (db of REDIS_URL, a key prefix of our own) as
    Celery's broker, set through a Celery config module as users would."""
    prefix = f"outbox-test-{uuid.uuid4().hex[:10]}:"
    (tmp_path / "relayconf.py").write_text(
        f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    return base_env(tmp_path, **{"OUTBOX_PUBLISH_URL": AMQP_URL, "OUTBOX_EXCHANGE": destination.exchange_name,
                                 "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "CELERY_CONFIG_MODULE": "relayconf",
                                 "OUTBOX_TEST_REDIS_PREFIX": prefix,
                                 "PYTHONPATH": str(tmp_path), **settings})


# -- the outbox ----------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path: Path) -> Iterator[OutboxStore]:
    s = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}")
    s.migrate()
    yield s
    s.close()


@contextmanager
def writer(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(tmp_path / "outbox.db", timeout=30)
    try:
        yield conn
    finally:
        conn.close()


def add(conn: sqlite3.Connection, aggregate: str, n: int, **kw: Any) -> int:
    return enqueue(conn, topic=f"orders.{aggregate}.changed", aggregate_type="order", aggregate_id=aggregate,
                   payload={"aggregate": aggregate, "n": n, "text": "grüße"}, **kw)


def statuses(store: OutboxStore) -> dict[int, int]:
    with store.transaction() as cursor:
        return {int(i): int(s) for i, s in store.engine.execute(
            cursor, f"SELECT id, status FROM {store.engine.table}").fetchall()}


def wait_until(predicate: Any, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def check_order(arrivals: list[tuple[int, str, Any]], expected: dict[str, list[int]]) -> None:
    """Per aggregate, the first arrivals come in id order, and every event arrived."""
    first: dict[str, list[int]] = {}
    seen: set[int] = set()
    for outbox_id, aggregate, _ in arrivals:
        if outbox_id in seen:
            continue  # at-least-once: a duplicate after a crash is allowed
        seen.add(outbox_id)
        first.setdefault(aggregate, []).append(outbox_id)
    for aggregate, ids in expected.items():
        assert first.get(aggregate) == ids, f"aggregate {aggregate}: arrived {first.get(aggregate)}, expected {ids}"
    assert set(first) == set(expected)


# -- tests ---------------------------------------------------------------------------------------

def test_worker_and_beat_relay_every_event_in_order(tmp_path: Path, destination: Destination,
                                                     store: OutboxStore, procs_factory: Any) -> None:
    expected: dict[str, list[int]] = {}
    rows: dict[int, dict[str, Any]] = {}
    aggregates = [f"agg-{i}" for i in range(6)]
    with writer(tmp_path) as conn:
        for n in range(20):  # a backlog before the relay starts: drain mode, several claims
            for aggregate in aggregates:
                headers = {"tenant": "acme", "n": n}
                outbox_id = add(conn, aggregate, n, headers=headers, key=f"pk-{aggregate}")
                expected.setdefault(aggregate, []).append(outbox_id)
                rows[outbox_id] = {"aggregate": aggregate, "n": n, "headers": headers}
        conn.commit()
        add(conn, "rolled-back", 0)
        conn.rollback()

    procs = procs_factory(relay_env(tmp_path, destination, OUTBOX_BATCH_SIZE="25", OUTBOX_CLAIM_INTERVAL_S="0.3"))
    procs.worker("w1")
    procs.beat()

    # Live writes while the relay runs.
    with writer(tmp_path) as conn:
        for n in range(20, 30):
            for aggregate in aggregates[:3]:
                outbox_id = add(conn, aggregate, n)
                expected[aggregate].append(outbox_id)
                rows[outbox_id] = {"aggregate": aggregate, "n": n, "headers": {}}
            conn.commit()
            add(conn, "rolled-back", n)
            conn.rollback()
            time.sleep(0.05)

    total = sum(len(ids) for ids in expected.values())
    destination.wait_for(lambda: len({a[0] for a in destination.arrivals()}) >= total, timeout=40, procs=procs)
    arrivals = destination.arrivals()
    assert len({a[0] for a in arrivals}) == total, (
        f"{len({a[0] for a in arrivals})} of {total} arrived\n{procs.log('w1')[-3000:]}")
    check_order(arrivals, expected)
    assert len(arrivals) == total  # no crash here: no duplicates either

    # Body and headers per the contract.
    for outbox_id, aggregate, message in arrivals:
        row = rows[outbox_id]
        assert message.content_type == "application/json"
        assert message.properties.get("delivery_mode") == 2
        assert json.loads(message.body) == {"aggregate": aggregate, "n": row["n"], "text": "grüße"}
        h = message.headers
        assert h["outbox_id"] == outbox_id and h["aggregate_id"] == aggregate
        assert h["topic"] == f"orders.{aggregate}.changed" == message.delivery_info["routing_key"]
        assert h["aggregate_type"] == "order" and h["attempt"] == 1
        assert h["partition_key"] == (f"pk-{aggregate}" if row["headers"] else aggregate)
        assert isinstance(h["message_id"], str) and h["message_id"] == message.properties.get("message_id")
        assert h["created_at"].endswith("Z")
        for name, value in row["headers"].items():
            assert h[name] == value

    # Every row is acknowledged in the table.
    assert wait_until(lambda: set(statuses(store).values()) == {Status.DONE}, timeout=10), statuses(store)
    assert len(statuses(store)) == total


def test_a_worker_killed_mid_run_loses_nothing(tmp_path: Path, destination: Destination, store: OutboxStore,
                                               procs_factory: Any) -> None:
    procs = procs_factory(relay_env(tmp_path, destination, OUTBOX_BATCH_SIZE="10", OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_CLAIM_TIMEOUT_MS="3000"))
    procs.worker("w1")
    procs.worker("w2")
    procs.beat()
    aggregates = [f"k-{i}" for i in range(10)]
    expected: dict[str, list[int]] = {a: [] for a in aggregates}
    stop = threading.Event()

    def write() -> None:
        with writer(tmp_path) as conn:
            n = 0
            while not stop.is_set():
                for aggregate in aggregates:
                    expected[aggregate].append(add(conn, aggregate, n))
                conn.commit()
                n += 1
                time.sleep(0.02)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        # Kill w1 (main process and pool children: a machine that died) once it is relaying.
        destination.wait_for(lambda: len(destination.messages) >= 100, timeout=20, procs=procs)
        assert len(destination.messages) >= 100, procs.log("w1")[-3000:]
        procs.kill("w1")
        destination.wait_for(lambda: False, timeout=1.5)
    finally:
        stop.set()
        thread.join(timeout=10)
    total = sum(len(ids) for ids in expected.values())
    destination.wait_for(lambda: len({a[0] for a in destination.arrivals()}) >= total, timeout=30)
    arrivals = destination.arrivals()
    assert len({a[0] for a in arrivals}) == total, (
        f"{len({a[0] for a in arrivals})} of {total} arrived\n{procs.log('w2')[-3000:]}")
    check_order(arrivals, expected)
    assert wait_until(lambda: set(statuses(store).values()) == {Status.DONE}, timeout=15), (
        {s: list(statuses(store).values()).count(s) for s in set(statuses(store).values())})


def test_rows_of_a_lost_claim_come_back_with_the_lease(tmp_path: Path, destination: Destination,
                                                        store: OutboxStore, procs_factory: Any) -> None:
    """A claimer that leased rows and vanished (its task lost, its worker gone): the rows
    wait for the lease, hold back their aggregate meanwhile, and are then relayed in order
    with the attempt counted; other aggregates are never held up."""
    with writer(tmp_path) as conn:
        x1, x2 = add(conn, "x", 1), add(conn, "x", 2)
        y1 = add(conn, "y", 1)
        x3 = add(conn, "x", 3)
        conn.commit()
    lost = store.claim(2)  # the lease of a worker that will never acknowledge
    assert [m.id for m in lost.messages] == [x1, x2]
    leased_at = time.monotonic()
    procs = procs_factory(relay_env(tmp_path, destination, OUTBOX_CLAIM_INTERVAL_S="0.2",
                                    OUTBOX_CLAIM_TIMEOUT_MS="2000"))
    procs.worker("w1")
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 4, timeout=20, procs=procs)
    arrivals = [(outbox_id, m.headers["attempt"]) for outbox_id, _, m in destination.arrivals()]
    assert [a[0] for a in arrivals] == [y1, x1, x2, x3], procs.log("w1")[-3000:]
    assert dict(arrivals) == {y1: 1, x1: 2, x2: 2, x3: 1}
    assert time.monotonic() - leased_at >= 2.0
    assert wait_until(lambda: set(statuses(store).values()) == {Status.DONE}, timeout=10)


def test_worker_alone_relays_the_embedded_default(tmp_path: Path, store: OutboxStore, procs_factory: Any) -> None:
    """No service at all: SQLite, in-memory Celery broker and destination. The worker runs
    a thread pool and the schedule itself, and every row ends up done."""
    with writer(tmp_path) as conn:
        ids = [add(conn, f"m-{i % 3}", i) for i in range(30)]
        conn.commit()
    procs = procs_factory(base_env(tmp_path, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_BATCH_SIZE="8"))
    procs.start("solo", "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                "--without-heartbeat")

    def done() -> bool:
        procs.check_alive()
        return [statuses(store).get(i) for i in ids] == [Status.DONE] * len(ids)

    assert wait_until(done, timeout=30), f"{statuses(store)}\n{procs.log('solo')[-3000:]}"
    assert "runs the schedule itself" in procs.log("solo")


class Proxy:
    """A TCP proxy in front of RabbitMQ that the test can cut (every connection dropped,
    new ones closed at once) and restore."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5672)) -> None:
        import socket

        self.target = target
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
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: Any, dst: Any) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
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
                                                       store: OutboxStore, procs_factory: Any) -> None:
    proxy = Proxy()
    try:
        procs = procs_factory(relay_env(
            tmp_path, destination, OUTBOX_PUBLISH_URL=f"amqp://guest:guest@127.0.0.1:{proxy.port}//",
            OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_RELAY_BREAKER_S="1.0"))
        procs.worker("w1")
        procs.beat()
        aggregates = [f"o-{i}" for i in range(4)]
        expected: dict[str, list[int]] = {a: [] for a in aggregates}

        def write(rounds: range) -> None:
            with writer(tmp_path) as conn:
                for n in rounds:
                    for aggregate in aggregates:
                        expected[aggregate].append(add(conn, aggregate, n))
                    conn.commit()

        write(range(5))
        destination.wait_for(lambda: len(destination.messages) >= 20, timeout=20, procs=procs)
        assert len(destination.messages) == 20, procs.log("w1")[-3000:]

        proxy.cut()
        write(range(5, 10))
        time.sleep(3.0)  # the relay tries, fails, pauses, probes again...
        destination.wait_for(lambda: False, timeout=0.2)
        assert len(destination.messages) == 20  # nothing got through the cut
        during = statuses(store)
        assert Status.FAILED not in during.values() and Status.DEAD not in during.values(), during
        log = procs.log("w1")
        assert "back-pressure, pausing claims" in log, log[-3000:]
        assert "claims paused" in log, log[-3000:]

        proxy.restore()
        total = sum(len(ids) for ids in expected.values())
        destination.wait_for(lambda: len({a[0] for a in destination.arrivals()}) >= total, timeout=20, procs=procs)
        arrivals = destination.arrivals()
        assert len({a[0] for a in arrivals}) == total, procs.log("w1")[-3000:]
        check_order(arrivals, expected)
        assert wait_until(lambda: set(statuses(store).values()) == {Status.DONE}, timeout=10)
        with store.transaction() as cursor:
            attempts = store.engine.execute(cursor, f"SELECT MAX(attempts) FROM {store.engine.table}").fetchone()[0]
        assert attempts == 0  # the outage spent no attempt
    finally:
        proxy.close()
