"""What the end-to-end tests share (tests/test_relay_e2e.py, tests/test_recovery_e2e.py and
the other ``*_e2e`` tests): real ``celery -A outbox worker`` / ``beat`` processes (or the
Dramatiq runner, tests/runners.py), Redis as Celery's broker, RabbitMQ as the destination,
and the outbox on SQLite (a file), PostgreSQL and MariaDB/MySQL. Each test gets its own
outbox table (dropped afterwards), its own exchange and queues on RabbitMQ and its own key
prefix on Redis, so runs never see each other. A pytest plugin (registered in
tests/conftest.py): test modules find its fixtures by name and import its helpers.

Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from runners import CELERY as CELERY_RUNNER
from runners import RUNNERS
from services import AMQP_URL, MYSQL_URL, POSTGRES_URL, REDIS_URL, require

from outbox import Status, enqueue
from outbox.storage.engines.sqlite import sqlite_path
from outbox.storage.store import OutboxStore

CELERY = str(Path(sys.executable).parent / "celery")


#: The engines the relay is run against end to end (SQL Server: tests/test_mssql_live.py).
DB_KINDS = ["sqlite", "postgresql", "mysql"]


# -- processes ---------------------------------------------------------------------------------

def why_it_stopped(log: str) -> str:
    """The part of a process's log that tells why it stopped: from the first fatal line
    (Celery's "Unrecoverable error", a CRITICAL line, an uncaught traceback of the main
    process) on, up to 6,000 characters, then the log's last 3,000 characters."""
    marks = [i for i in (log.find("Unrecoverable error"), log.find("CRITICAL/"), log.find("Worker shutdown"))
             if i >= 0]
    start = log.rfind("\n", 0, min(marks)) + 1 if marks else len(log)
    head = log[start:start + 6000]
    return f"{head}\n...\n{log[-3000:]}" if head else log[-4000:]


class Procs:
    """Relay processes of one test: every one is killed (with its children) at teardown."""

    def __init__(self, tmp_path: Path, env: dict[str, str], runner: Any = CELERY_RUNNER) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.runner = runner  # tests/runners.py: Celery or Dramatiq
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # stopped on purpose: their exit is not a failure

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``celery -A outbox <args>``."""
        return self.spawn(name, [CELERY, "-A", "outbox", *args], env=env)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, cwd=self.tmp_path, env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def worker(self, name: str, concurrency: int = 2, queues: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        """A worker of this test's runner; ``queues``: the relay queues it consumes (default: all)."""
        return self.runner.worker(self, name, concurrency, queues, **env)

    def tasks_in_hand(self, name: str, task: str = "outbox.publish") -> set[str]:
        """Ids of ``task`` the worker has received (reserved or running) and not finished."""
        return self.runner.tasks_in_hand(self.log(name), task)

    def beat(self, name: str = "beat", **env: str) -> subprocess.Popen[bytes]:
        """The runner's scheduler: Celery's beat, or outbox-dramatiq-scheduler."""
        return self.runner.scheduler(self, name, **env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

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
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{why_it_stopped(self.log(name))}")

    def stop_all(self) -> None:
        """At teardown the test has made its checks: no need for a graceful (and slower)
        warm shutdown. Kill every process group (pool children too) and reap them."""
        for name in self.procs:
            self.kill(name, signal.SIGKILL)
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def base_env(outbox: Outbox, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env.update({**outbox.env(), "PYTHONUNBUFFERED": "1"})
    env.update(settings)
    return env


@pytest.fixture
def procs_factory(tmp_path: Path) -> Iterator[Any]:
    """List it after the outbox fixture, so the relay stops before the table is dropped."""
    made: list[Procs] = []

    def make(env: dict[str, str], runner: Any = CELERY_RUNNER) -> Procs:
        p = Procs(tmp_path, env, runner)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop_all()
    for p in made:
        delete_relay_names_on_rabbitmq(p.env)
    prefixes = {p.env.get("OUTBOX_TEST_REDIS_PREFIX") for p in made} - {None}
    patterns = {f"{prefix}*" for prefix in prefixes} | {f"{key}*" for key in dramatiq_scheduler_keys(made)}
    if patterns:
        import redis
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        for pattern in patterns:
            for key in client.scan_iter(match=pattern):
                client.delete(key)


def dramatiq_scheduler_keys(made: list[Procs]) -> set[str]:
    """The Redis keys (lock, and record of the entries sent, ``<key>:sent:<task>``, kept for
    hours) of the Dramatiq schedulers these relays would run: named for the Dramatiq namespace
    and the outbox, not under the namespace's prefix: deleting the prefix left them (docs/design.md,
    "The test suite")."""
    from outbox.core.config import load_settings
    from outbox.core.names import is_redis_url
    from outbox.dramatiq.scheduler import lock_name

    keys = set()
    for p in made:
        url = p.env.get("OUTBOX_DRAMATIQ_BROKER_URL", "")
        if is_redis_url(url):
            namespace = p.env.get("OUTBOX_DRAMATIQ_NAMESPACE") or "dramatiq"
            keys.add(f"outbox:scheduler:{lock_name(url, namespace, load_settings(environ=p.env).outbox_namespace)}")
    return keys


def delete_relay_names_on_rabbitmq(env: dict[str, str]) -> None:
    """What the relay of ``env`` declared on RabbitMQ when it is the task runner's broker
    (Celery's or Dramatiq's, directly or through a Proxy): the outbox's durable queues (with
    Dramatiq's delay and dead-letter queues), their exchanges and Celery's remote-control
    exchange, and the sent records of beat and of the Dramatiq scheduler (durable, kept 61
    days unused: ``outbox.relay.sent_record``). Deleted through AMQP_URL, the proxy being
    closed by then; left, they piled up on a CI machine, a few per run of the suite."""
    celery, dramatiq = (env.get(name, "").startswith("amqp")
                        for name in ("OUTBOX_CELERY_BROKER_URL", "OUTBOX_DRAMATIQ_BROKER_URL"))
    if not (celery or dramatiq):
        return
    from kombu import Connection

    from outbox.core.config import load_settings

    settings = load_settings(environ=env)
    namespace = settings.outbox_namespace
    queues = [name for queue in settings.queues.all for name in (queue, f"{queue}.DQ", f"{queue}.XQ")]
    queues.append(f"outbox.beat.{namespace}.sent")
    if dramatiq:
        from outbox.dramatiq.scheduler import lock_name

        queues.append(f"outbox.scheduler.{lock_name(AMQP_URL, '', namespace)}.sent")
    exchanges = [*settings.queues.all, f"{namespace}.pidbox"]
    with Connection(AMQP_URL, connect_timeout=5) as conn:
        for kind, names in (("queue", queues), ("exchange", exchanges)):
            for name in names:
                channel = conn.channel()  # one each: an error closes its channel
                try:
                    getattr(channel, f"{kind}_delete")(name)
                except Exception:  # best effort: one that is not there is not an error
                    pass
                finally:
                    with suppress(Exception):
                        channel.close()


# -- RabbitMQ ----------------------------------------------------------------------------------

class Destination:
    """A unique topic exchange with one queue bound to ``bindings`` (default: everything),
    and what arrived on it. With ``dead_letter=True`` also a unique dead-letter exchange
    with a queue bound to everything; what arrives there is in ``dead``."""

    #: At most this many messages delivered and not yet acknowledged: RabbitMQ pushes no
    #: more, so a test busy elsewhere for a while does not leave RabbitMQ blocked writing to
    #: this consumer's socket (after its send timeout RabbitMQ closes such a connection).
    PREFETCH = 500

    def __init__(self, bindings: tuple[str, ...] = ("#",), dead_letter: bool = False) -> None:
        from kombu import Exchange, Queue, binding

        tag = uuid.uuid4().hex[:10]
        self.exchange_name = f"outbox-test-{tag}"
        self.exchange = Exchange(self.exchange_name, type="topic", durable=True)
        self.queue = Queue(f"outbox-test-q-{tag}", bindings=[binding(self.exchange, routing_key=key)
                                                             for key in bindings],
                           durable=False, auto_delete=False)
        self.messages: list[Any] = []
        #: outbox_id -> when it first arrived (``time.time()``).
        self.arrived_at: dict[int, float] = {}
        self.received_at: list[float] = []  # time.monotonic() of each message's arrival here
        self.dead: list[Any] = []
        self.dead_exchange_name: str | None = None
        self.dead_exchange = self.dead_queue = None
        if dead_letter:
            self.dead_exchange_name = f"outbox-test-dlx-{tag}"
            self.dead_exchange = Exchange(self.dead_exchange_name, type="topic", durable=True)
            self.dead_queue = Queue(f"outbox-test-dlq-{tag}", self.dead_exchange, routing_key="#", durable=False,
                                    auto_delete=False)
        #: How often the consumer's connection failed and was made again (what it held
        #: unacknowledged comes again: duplicates, which the checks allow).
        self.reconnects = 0
        #: How often the consumer received nothing for ``STALL_S`` while RabbitMQ counted
        #: messages delivered to it and not acknowledged, and was made again (``_unstick``).
        self.unstuck = 0
        self._consume()

    #: A wait that received nothing for this long asks RabbitMQ whether this consumer holds
    #: deliveries it never read (``_unstick``).
    STALL_S = 10.0

    def _consume(self) -> None:
        """A connection and channel of its own, the exchanges and queues declared (again,
        harmlessly), and the consumers started."""
        from kombu import Connection

        self.conn = Connection(AMQP_URL, connect_timeout=5)
        self.channel = self.conn.channel()
        self.channel.basic_qos(0, self.PREFETCH, False)
        self.exchange(self.channel).declare()
        self.queue(self.channel).declare()
        self.consumers = [self.conn.Consumer(self.queue, callbacks=[self._on_message], accept=None, no_ack=False,
                                             channel=self.channel)]
        if self.dead_exchange is not None:
            self.dead_exchange(self.channel).declare()
            self.dead_queue(self.channel).declare()
            self.consumers.append(self.conn.Consumer(self.dead_queue, callbacks=[self._on_dead], accept=None,
                                                     no_ack=False, channel=self.channel))
        for consumer in self.consumers:
            consumer.consume()

    def _on_message(self, body: Any, message: Any) -> None:
        self.messages.append(message)
        if "outbox_id" in (message.headers or {}):
            self.arrived_at.setdefault(int(message.headers["outbox_id"]), time.time())
        self.received_at.append(time.monotonic())
        message.ack()

    def _on_dead(self, body: Any, message: Any) -> None:
        self.dead.append(message)
        message.ack()

    def wait_for(self, predicate: Any, timeout: float, procs: Procs | None = None) -> bool:
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        while not predicate():
            if time.monotonic() > deadline:
                return False
            if procs is not None:
                procs.check_alive()
            try:
                self.conn.drain_events(timeout=0.2)
                quiet_since = time.monotonic()
            except TimeoutError:
                if time.monotonic() - quiet_since >= self.STALL_S:
                    quiet_since = time.monotonic()
                    self._unstick()
            except Exception as exc:  # the connection failed: consume on a new one
                if not self.conn.connection_errors or not isinstance(exc, (*self.conn.connection_errors, OSError)):
                    raise
                print(f"test destination: consumer connection lost ({type(exc).__name__}: {exc}); reconnecting")
                with suppress(Exception):
                    self.conn.release()
                self.reconnects += 1
                self._consume()
        return True

    def rabbitmq_counts(self) -> dict[str, int] | None:
        """What RabbitMQ counts for this destination's queue (``rabbitmqctl list_queues``):
        messages ``ready``, messages delivered and not yet acknowledged (``unacknowledged``),
        and ``consumers``. None where rabbitmqctl cannot be run (a remote RabbitMQ) or does not
        list the queue."""
        names = ("ready", "unacknowledged", "consumers")
        try:
            listed = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name", "messages_ready",
                                     "messages_unacknowledged", "consumers"], capture_output=True, text=True,
                                    timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        for line in listed.stdout.splitlines():
            fields = line.split()
            if fields[:1] == [self.queue.name] and len(fields) == 4:
                return dict(zip(names, map(int, fields[1:]), strict=True))
        return None

    def _unstick(self) -> None:
        """After ``STALL_S`` without a delivery: when RabbitMQ counts messages delivered to
        this consumer and not acknowledged, this connection receives nothing it was sent (seen
        in the chaos run: 500 unacknowledged for minutes, none read). Print what the socket
        and py-amqp hold, then consume on a new connection; closing this one puts what it was
        sent back in the queue (nothing here acknowledged it, so no duplicate)."""
        counts = self.rabbitmq_counts()
        if not counts or not counts["unacknowledged"]:
            return
        transport = getattr(self.conn.connection, "transport", None)
        socket_state = "no socket"
        with suppress(OSError, AttributeError, subprocess.SubprocessError):
            port = transport.sock.getsockname()[1]  # no transport or no socket: AttributeError
            socket_state = subprocess.run(["ss", "-tni", f"sport = :{port}"], capture_output=True, text=True,
                                          timeout=10).stdout
        print(f"test destination: nothing received for {self.STALL_S:.0f} s while RabbitMQ counts {counts}; "
              f"py-amqp buffer {len(getattr(transport, '_read_buffer', b''))} bytes; socket:\n{socket_state}"
              f"reconnecting")
        with suppress(Exception):
            self.conn.release()
        self.unstuck += 1
        self._consume()

    def queued(self) -> int:
        """How many messages wait in the queue, as a new connection sees it: more than 0 after
        a wait means the consumer above stopped receiving, not that they were never sent."""
        from kombu import Connection

        with Connection(AMQP_URL, connect_timeout=5) as conn:
            return int(self.queue(conn.channel()).queue_declare(passive=True).message_count)

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


@pytest.fixture
def dead_letter_destination() -> Iterator[Destination]:
    """A destination whose queue is bound only for ``orders.#``, plus a dead-letter exchange."""
    require_relay_services()
    d = Destination(bindings=("orders.#",), dead_letter=True)
    yield d
    d.close()


def relay_env(tmp_path: Path, destination: Destination | None, outbox: Outbox, runner: Any = CELERY_RUNNER,
              **settings: str) -> dict[str, str]:
    """Settings for workers and beat: Redis (db of REDIS_URL, a key prefix of our own) as
    Celery's broker, set through a Celery config module as users would, and as Dramatiq's
    broker (the prefix as its namespace) for the Dramatiq runner. ``destination`` None: the
    caller's ``OUTBOX_PUBLISH_URL`` names another destination (Kafka)."""
    prefix = f"outbox-test-{uuid.uuid4().hex[:10]}:"
    (tmp_path / "relayconf.py").write_text(
        f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    return base_env(outbox, **{**runner.env(REDIS_URL, prefix), "OUTBOX_PUBLISH_URL": AMQP_URL,
                               **({"OUTBOX_EXCHANGE": destination.exchange_name} if destination else {}),
                               "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "CELERY_CONFIG_MODULE": "relayconf",
                               "OUTBOX_TEST_REDIS_PREFIX": prefix,
                               # The caller's PYTHONPATH after the config module's: the relay
                               # under test is the one the test process imports.
                               "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path),
                                                                        os.environ.get("PYTHONPATH")) if p),
                               **settings})


# -- the outbox --------------------------------------------------------------------------------

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

    def open_rows_report(self, procs: Procs | None = None) -> str:
        """What holds the open rows back, for a failure message: the count per status, then the
        open rows grouped by status and lease holder (a lease token starts with its holder's id)
        with their aggregates, oldest id, attempts, lease age and retry time, and the holders'
        records (pid, the relay process it belongs to when ``procs`` started it, alive or not,
        seconds since its last beat). Ages are by the database's clock."""
        engine = self.store.engine
        with self.store.transaction() as cursor:
            now = engine.to_datetime(engine.execute(cursor, f"SELECT {engine.now}").fetchone()[0])
            rows = engine.execute(cursor, f"SELECT id, aggregate_id, status, attempts, claimed_at, next_retry_at, "
                                          f"lease_token FROM {engine.table} WHERE status IN (0, 1, 3)").fetchall()
            holders = engine.execute(cursor, f"SELECT holder_id, pid, beat_at FROM {engine.holders}").fetchall()
        assert now is not None

        def age(value: Any) -> float | None:
            at = engine.to_datetime(value)
            return None if at is None else (now - at).total_seconds()

        lines = [f"status counts: {self.status_counts()}"]
        groups: dict[tuple[int, str], list[Any]] = {}
        for row in rows:
            groups.setdefault((int(row[2]), str(row[6] or "")[:16]), []).append(row)
        for (status, holder), group in sorted(groups.items()):
            retry = sorted(engine.to_datetime(r[5]) for r in group if r[5] is not None)
            lines.append(f"  {Status(status).name} holder={holder or '-'}: {len(group)} rows over "
                         f"{len({r[1] for r in group})} aggregates, oldest id {min(int(r[0]) for r in group)}, "
                         f"attempts up to {max(int(r[3]) for r in group)}, lease age up to "
                         f"{max((a for a in map(age, (r[4] for r in group)) if a is not None), default=0.0):.1f} s, "
                         f"next retry {retry[0].isoformat() if retry else '-'}")
        for holder_id, pid, beat_at in holders:
            lines.append(f"  holder {str(holder_id).strip()}: pid {pid} ({_process_of(int(pid), procs)}), "
                         f"last beat {age(beat_at) or 0.0:.1f} s ago")
        return "\n".join(lines)

    def drop(self) -> None:
        try:
            with self.store.transaction() as cursor:
                self.store.engine.execute(cursor, f"DROP TABLE IF EXISTS {self.store.engine.table}")
                self.store.engine.execute(cursor, f"DROP TABLE IF EXISTS {self.store.engine.holders}")
        finally:
            self.store.close()


def _process_of(pid: int, procs: Procs | None) -> str:
    """Which relay process of ``procs`` ``pid`` is (by its process group), and whether it lives."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return "gone"
    names = [name for name, proc in (procs.procs.items() if procs else ()) if proc.pid == group]
    if not names:
        return "alive, not a relay process of this test"
    return f"alive, {names[0]}'s {'main process' if pid == group else 'pool process'}"


def where_claims_stopped(log: str, last: int = 5, after: int = 40) -> str:
    """A worker's last ``last`` claim lines (a claim that leased rows, or a takeover) and the
    first ``after`` lines logged after them: where a worker that stopped claiming stopped."""
    lines = log.splitlines()
    marks = [i for i, line in enumerate(lines) if "outbox claimed " in line or "outbox: took over " in line]
    if not marks:
        return "no claim in the log\n" + "\n".join(lines[-after:])
    tail = lines[marks[-1] + 1:]
    return "\n".join([*(lines[i] for i in marks[-last:]), f"-- {len(tail)} lines after the last claim:",
                      *tail[:after]])


class Written(NamedTuple):
    """One committed event of a Writer: its aggregate, its round and when it was committed."""

    aggregate: str
    n: int
    at: float


class Writer:
    """The application writing while the relay runs, round after round on one connection of
    ``outbox``: round ``n`` commits one event (payload ``n``) on each of its aggregates in one
    transaction, then, every ``rollback_every``-th round, writes one event on an aggregate of
    its own ("rolled-back") and one on a live aggregate and rolls them back, then sleeps
    ``pace`` seconds. What it committed is in ``expected`` (ids per aggregate, in commit
    order, after the ids of a backlog passed in) and ``written`` (by id).

    ``aggregates``: the same every round, or a function of the round. ``topic``: the topic of
    an aggregate's events (default: ``Outbox.add``'s). ``write(rounds)`` writes in the calling
    thread; as a context manager it writes in a thread of its own (up to ``rounds`` rounds,
    default until the block ends), stops and joins it on exit and asserts it raised nothing.
    """

    def __init__(self, outbox: Outbox, aggregates: Sequence[str] | Callable[[int], Sequence[str]], *,
                 rollback_every: int = 0, pace: float = 0.0, rounds: int | None = None,
                 topic: Callable[[str], str] | None = None,
                 expected: dict[str, list[int]] | None = None) -> None:
        self.outbox = outbox
        self.aggregates = aggregates if callable(aggregates) else (lambda n: aggregates)
        self.rollback_every = rollback_every
        self.pace = pace
        self.rounds = rounds
        self.topic = topic
        self.expected: dict[str, list[int]] = expected if expected is not None else {}
        if not callable(aggregates):
            for aggregate in aggregates:
                self.expected.setdefault(aggregate, [])
        self.written: dict[int, Written] = {}
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread: threading.Thread | None = None

    def write(self, rounds: Iterable[int]) -> None:
        """Rounds ``rounds`` (their numbers are the payloads), until the writer is stopped."""
        with self.outbox.writer() as conn:
            for n in rounds:
                if self.stop.is_set():
                    break
                live = self.aggregates(n)
                ids = [self.outbox.add(conn, aggregate, n, topic=self.topic(aggregate) if self.topic else None)
                       for aggregate in live]
                conn.commit()
                at = time.time()
                for aggregate, outbox_id in zip(live, ids):
                    self.expected.setdefault(aggregate, []).append(outbox_id)
                    self.written[outbox_id] = Written(aggregate, n, at)
                if self.rollback_every and n % self.rollback_every == 0:
                    self.outbox.add(conn, "rolled-back", n)
                    self.outbox.add(conn, live[n % len(live)], n)  # never published either
                    conn.rollback()
                if self.pace:
                    time.sleep(self.pace)

    def _run(self) -> None:
        try:
            self.write(range(self.rounds) if self.rounds is not None else itertools.count())
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.errors.append(exc)

    def __enter__(self) -> Writer:
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=10)
        if exc_info[0] is None:
            assert not self.errors, self.errors


@pytest.fixture(params=sorted(RUNNERS))
def runner(request: pytest.FixtureRequest) -> Any:
    """The task runner of a shared scenario (tests/runners.py): each runs on both."""
    if request.param == "dramatiq":
        pytest.importorskip("dramatiq")
    return RUNNERS[request.param]


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


def longest_stand_still(destination: Destination, since: float) -> tuple[float, str]:
    """The longest time any aggregate waited (by ``time.monotonic()``) between two first
    arrivals of its events, or from ``since`` to its first arrival after it, over the
    aggregates with events arriving after ``since``; with the aggregate that waited it.
    Meaningful once every event arrived."""
    first: dict[int, float] = {}
    times: dict[str, list[float]] = {}
    for (outbox_id, aggregate, _), at in zip(destination.arrivals(), destination.received_at):
        if outbox_id not in first:
            first[outbox_id] = at
            times.setdefault(aggregate, []).append(at)
    longest, which = 0.0, ""
    for aggregate, ats in times.items():
        later = [t for t in ats if t >= since]
        if not later:
            continue  # done before ``since``
        points = [since, *later]
        gap = max(b - a for a, b in zip(points, points[1:]))
        if gap > longest:
            longest, which = gap, aggregate
    return longest, which


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


# -- a proxy the test cuts or stalls ----------------------------------------------------------

def postgres_answer_end(answer: bytes) -> int | None:
    """Where the server's answer to one query ends in ``answer`` (PostgreSQL's protocol: a
    message is a type byte and a 4-byte length; an answer ends with ReadyForQuery, ``Z``),
    or None while it goes on."""
    at = 0
    while at + 5 <= len(answer):
        end = at + 1 + int.from_bytes(answer[at + 1:at + 5], "big")
        if end > len(answer):
            return None
        if answer[at:at + 1] == b"Z":
            return end
        at = end
    return None


def mysql_answer_end(answer: bytes) -> int | None:
    """The same for MySQL/MariaDB's protocol (a packet is a 3-byte length, a sequence byte
    and the payload): an OK or error packet, or a result set, which ends with its second EOF
    packet (PyMySQL does not ask for CLIENT_DEPRECATE_EOF), or None while it goes on."""
    at, eofs = 0, 0
    while at + 4 <= len(answer):
        size = int.from_bytes(answer[at:at + 3], "little")
        end = at + 4 + size
        if end > len(answer):
            return None
        first = answer[at + 4] if size else None
        if at == 0 and first in (0x00, 0xFF) or first == 0xFF:
            return end
        if first == 0xFE and size < 9:
            eofs += 1
            if eofs == 2:
                return end
        at = end
    return None


#: A database's wire protocol for ``Proxy.stall_after``, by the port it listens on.
ANSWER_ENDS: dict[int, Callable[[bytes], int | None]] = {5432: postgres_answer_end, 3306: mysql_answer_end}


class Stall:
    """A one-shot stall of ``Proxy.stall_after``: which connection it took, when it began."""

    def __init__(self, marker: bytes, seconds: float, answer_end: Callable[[bytes], int | None],
                 drop_answer: bool = False, then_cut: bool = False) -> None:
        self.marker = marker
        self.seconds = seconds
        self.drop_answer = drop_answer  # Proxy.drop_answer_after
        self.then_cut = then_cut  # and the proxy cut when it drops the answer
        self.answer_end = answer_end
        self.link: Link | None = None
        self.began = threading.Event()
        self.began_at = 0.0
        self.until = 0.0


class Link:
    """One proxied connection: where it stands in a stall (``Proxy.stall_after``)."""

    def __init__(self) -> None:
        #: "" (not the stalled one), "sent" (the marker went out), "frozen" (the server's
        #: answer passed: nothing passes now, either way), "over".
        self.phase = ""
        self.tail = b""  # the end of the client's last chunk: a marker cut in two is still found
        self.answer = b""  # what the server sent since the marker
        #: Black-holed (``Proxy.black_hole``): what either side sends is dropped, nothing closes.
        self.dead = False


class Proxy:
    """A TCP proxy in front of RabbitMQ, Redis or a database that the test can cut (every
    connection dropped, new ones closed at once) and restore, stall at an exact step of the
    protocol (``stall_after``), or turn into a black hole (``black_hole``, ``recover``)."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5672), delay: float = 0.0) -> None:
        import socket

        self.target = target
        self.delay = delay  # added to everything the broker sends back: a slow network path
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        #: RabbitMQ's URL through this proxy (the target must be RabbitMQ for it to mean anything).
        self.amqp_url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.up = True
        self.closed = False
        self.sockets: list[Any] = []
        self.lock = threading.Lock()
        self.stall: Stall | None = None
        #: Set: nothing the target sends reaches the clients (``hold_replies``).
        self.holding = threading.Event()
        self.links: list[Link] = []
        self.black_holing = False  # new connections are black-holed too (``black_hole``)
        self.hold_marker: bytes | None = None  # ``hold_replies_after``
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_replies(self) -> None:
        """From now on keep back everything the target sends (RabbitMQ's confirms, say), on
        every connection, while what the clients send still goes through: a client that waits
        for an answer waits until the proxy is closed."""
        self.holding.set()

    def hold_replies_after(self, marker: bytes) -> None:
        """``hold_replies`` from the moment a client sends ``marker`` (one AMQP frame, say):
        the target's answer to it, and everything after, is kept back; what went before
        passes (a handshake that completes, then a broker that stops answering)."""
        self.hold_marker = marker

    def release_replies(self) -> None:
        """Let what ``hold_replies`` kept back go on."""
        self.holding.clear()

    def black_hole(self) -> None:
        """A path that stops answering without a reset (a host gone, a NAT's idle timeout):
        from now on nothing passes either way on the connections open now, which stay open
        (the kernel still answers TCP keepalive probes, as a NAT box or a half-dead host may),
        and new connections are accepted but pass nothing either, until ``recover``. The
        connections black-holed stay so: their path is gone."""
        with self.lock:
            self.black_holing = True
            for link in self.links:
                link.dead = True

    def recover(self) -> None:
        """New connections pass again (those ``black_hole`` took stay dead)."""
        self.black_holing = False

    def url_for(self, url: str) -> str:
        """``url`` (a database URL naming the target's port) through this proxy."""
        port = f":{self.target[1]}/"
        assert port in url, f"{url} does not name port {self.target[1]}"
        return url.replace(port, f":{self.port}/", 1)

    def stall_after(self, marker: bytes, seconds: float) -> Stall:
        """Arm a one-shot stall, a network cut at an exact step: on the first connection whose
        client sends ``marker`` (the text of a statement), the server's whole answer to it
        passes, then nothing more either way (not even the server closing the connection)
        for ``seconds``; then what was held goes on. The proxy reads the database's protocol
        (``ANSWER_ENDS``) to find where the answer ends. The returned ``Stall`` says when the
        stall began (``began``, ``began_at``)."""
        self.stall = Stall(marker, seconds, ANSWER_ENDS[self.target[1]])
        return self.stall

    def drop_answer_after(self, marker: bytes, *, then_cut: bool = False) -> Stall:
        """Arm a one-shot cut that loses an answer: on the first connection whose client
        sends ``marker``, the statement reaches the server, which runs it (and commits it, in
        autocommit or for a COMMIT), but none of its answer reaches the client: once the
        answer is complete the connection is closed both ways, and with ``then_cut`` the
        proxy is cut from that moment (the client's retries fail until ``restore``)."""
        self.stall = Stall(marker, 0.0, ANSWER_ENDS[self.target[1]], drop_answer=True, then_cut=then_cut)
        return self.stall

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
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                if not self.up:  # cut while this one was connecting: it must not outlive the cut
                    for s in (client, upstream):
                        with suppress(OSError):
                            s.close()
                    continue
                self.sockets += [client, upstream]
            link = Link()
            link.dead = self.black_holing
            with self.lock:
                self.links.append(link)
            for a, b, delay, upward in ((client, upstream, 0.0, True), (upstream, client, self.delay, False)):
                threading.Thread(target=self._pump, args=(a, b, delay, link, upward), daemon=True).start()

    def _passing(self, link: Link, data: bytes, upward: bool) -> int:
        """How many bytes of ``data`` (going up, client to server, or down) pass before the
        stall; ``len(data)`` where none applies. Moves ``link`` along its stall."""
        stall = self.stall
        if stall is None:
            return len(data)
        with self.lock:
            if link.phase in ("frozen", "dropped"):
                return 0
            if upward:
                if stall.link is None and stall.marker in link.tail + data:
                    stall.link, link.phase = link, "sent"
                link.tail = data[-len(stall.marker):]
                return len(data)
            if link.phase != "sent":
                return len(data)
            before = len(link.answer)
            link.answer += data
            end = stall.answer_end(link.answer)
            if stall.drop_answer:
                if end is not None:
                    link.phase = "dropped"  # _pump closes the connection
                    if stall.then_cut:
                        self.up = False  # new connections are closed at once
                    stall.began_at = time.time()
                    stall.began.set()
                return 0
            if end is None:
                return len(data)
            link.phase = "frozen"
            stall.began_at, stall.until = time.time(), time.monotonic() + stall.seconds
            stall.began.set()
            return end - before

    def _hold(self, link: Link) -> None:
        """While ``link`` is frozen, wait for its stall to end."""
        stall = self.stall
        if stall is None or link.phase != "frozen":
            return
        while time.monotonic() < stall.until and not self.closed:
            time.sleep(0.05)
        link.phase = "over"

    def _pump(self, src: Any, dst: Any, delay: float = 0.0, link: Link | None = None, upward: bool = True) -> None:
        import socket

        try:
            while True:
                data = src.recv(65536)
                if link is not None and link.dead and data:
                    continue  # black-holed: dropped, and nothing is closed
                if upward and self.hold_marker is not None and self.hold_marker in data:
                    self.hold_marker = None
                    self.holding.set()  # before the data goes up: its answer is held
                passing = len(data) if link is None else self._passing(link, data, upward)
                if delay and data:
                    time.sleep(delay)
                while not upward and self.holding.is_set() and not self.closed:
                    time.sleep(0.01)
                if passing:
                    dst.sendall(data[:passing])
                if link is not None:
                    self._hold(link)  # an end of stream is held too
                if link is not None and link.phase == "dropped":
                    for s in (src, dst):  # shutdown: the other pump, blocked in recv, wakes up
                        with suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                    break
                if not data:
                    break
                if passing < len(data):
                    dst.sendall(data[passing:])
        except OSError:
            pass
        finally:
            # shutdown before close: the other pump may be blocked in recv() on one of these,
            # and Linux sends no FIN for a socket closed under a blocked recv(). The server
            # would then keep that connection (and, on RabbitMQ, its exclusive queues) open
            # until its heartbeat gave up, however the test cut the proxy.
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with suppress(OSError):
                    s.close()

    def cut(self) -> None:
        import socket

        self.up = False
        with self.lock:
            for s in self.sockets:
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.sockets.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()


# -- Celery's Redis queues ---------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(REDIS_URL, socket_timeout=5)


def relay_queue(env: dict[str, str], kind: str) -> str:
    """The name of the relay's ``kind`` queue ("claim", "publish", "ack", "purge") for the outbox
    of ``env`` (each outbox has its own: ``outbox.core.names.Queues``)."""
    from outbox.core.config import load_settings

    return getattr(load_settings(environ=env).queues, kind)


def relay_queues(env: dict[str, str], *kinds: str) -> str:
    """A worker's ``-Q``: the outbox's queues of ``kinds``, comma-separated."""
    return ",".join(relay_queue(env, kind) for kind in kinds)


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
