"""What the wake tests share (tests/test_wake.py, test_listen.py, test_metrics.py): real
``celery -A outbox worker`` processes with no beat, so only a wake-up (or a notification)
makes them claim, each test with a Redis key prefix of its own, and a RabbitMQ queue whose
messages are counted. A pytest plugin (registered in tests/conftest.py): test modules find
its fixtures (``counting_destination``, ``workers``) by name and import its helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from services import AMQP_URL, REDIS_URL, require

from outbox.core.config import load_settings
from outbox.relay.waker import token_for
from outbox.storage.store import OutboxStore

PYTHON = sys.executable
CELERY = str(Path(sys.executable).parent / "celery")


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OUTBOX_", "CELERY_", "PROMETHEUS_")) or k.startswith("OUTBOX_TEST_")}
    env.update({"PYTHONUNBUFFERED": "1"}, **settings)
    return env


def pythonpath(*dirs: Path | str) -> str:
    """``dirs`` first, then this interpreter's PYTHONPATH (the sources under test)."""
    return os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


def event(n: int = 0, aggregate: str = "a") -> dict[str, Any]:
    return {"topic": "orders.changed", "aggregate_type": "order", "aggregate_id": aggregate, "payload": {"n": n}}


def redis_prefix(tmp_path: Path) -> str:
    prefix = f"outbox-wake-test-{uuid.uuid4().hex[:10]}:"
    (tmp_path / "wakeconf.py").write_text(f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    return prefix


def drop_redis_keys(prefix: str, *keys: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    for key in keys:
        client.delete(key)


# -- real workers, no beat ----------------------------------------------------------------------

class CountingDestination:
    """A unique topic exchange on RabbitMQ with one queue bound to '#', whose messages stay
    queued to be counted (tests/relay_e2e_support.py's ``Destination`` consumes them)."""

    def __init__(self) -> None:
        from kombu import Connection, Exchange, Queue

        tag = uuid.uuid4().hex[:10]
        self.exchange_name = f"outbox-wake-{tag}"
        self.conn = Connection(AMQP_URL, connect_timeout=5)
        self.channel = self.conn.channel()
        self.exchange = Exchange(self.exchange_name, type="topic", durable=True)
        self.queue = Queue(f"outbox-wake-q-{tag}", self.exchange, routing_key="#", durable=False)
        self.exchange(self.channel).declare()
        self.queue(self.channel).declare()

    def count(self) -> int:
        return int(self.queue(self.channel).queue_declare(passive=True).message_count)

    def close(self) -> None:
        try:
            self.queue(self.channel).delete()
            self.exchange(self.channel).delete()
        finally:
            self.conn.release()


@pytest.fixture
def counting_destination() -> Iterator[CountingDestination]:
    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)
    d = CountingDestination()
    yield d
    d.close()


class Workers:
    """``celery -A outbox worker`` processes of one test, killed (with their pools) at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.prefix = redis_prefix(tmp_path)
        self.envs: list[dict[str, str]] = []

    def env(self, destination: CountingDestination, **settings: str) -> dict[str, str]:
        return clean_env(OUTBOX_PUBLISH_URL=AMQP_URL, OUTBOX_EXCHANGE=destination.exchange_name,
                         OUTBOX_CELERY_BROKER_URL=REDIS_URL, CELERY_CONFIG_MODULE="wakeconf",
                         PYTHONPATH=pythonpath(self.tmp_path), **settings)

    def start(self, env: dict[str, str], *args: str) -> Path:
        log = self.tmp_path / f"worker-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([CELERY, "-A", "outbox", "worker", "--loglevel=INFO", "--without-mingle",
                                     "--without-gossip", "--without-heartbeat", "-n",
                                     f"wake-{uuid.uuid4().hex[:6]}@%h", *args],
                                    cwd=self.tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append((proc, log))
        self.envs.append(env)
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "worker not ready:\n" + log.read_text(errors="replace")[-4000:]
            time.sleep(0.1)
        return log

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        namespaces = {load_settings(environ=env).outbox_namespace for env in self.envs}
        drop_redis_keys(self.prefix, *{token_for(REDIS_URL, self.prefix, ns) for ns in namespaces})


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tmp_path)
    yield w
    w.stop()


def wait_done(store: OutboxStore, ids: list[int], timeout: float) -> float:
    """Seconds until every row in ``ids`` is done (or ``timeout`` has passed)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        with store.transaction() as cursor:
            cond, params = store.engine.ids_in(ids)
            done = store.engine.execute(
                cursor, f"SELECT COUNT(*) FROM {store.engine.table} WHERE status = 2 AND {cond}", params).fetchone()[0]
        if int(done) == len(ids):
            return time.monotonic() - start
        time.sleep(0.02)
    return float("inf")
