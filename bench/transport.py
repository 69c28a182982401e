"""``python -m bench.transport``: the database as Celery's broker (``outboxdb+...``) against
Redis and kombu's SQLAlchemy transport, measured in the same run. Nothing asserts a time.

Phases (``--skip`` any of them):

1. ``kombu``  send N messages, then receive+ack them, through kombu's API (one process):
              messages/s for each broker and the ratio to Redis.
2. ``celery`` a real ``celery worker -c 2`` (prefork) per broker, no-op tasks:
              tasks/s draining a backlog of N tasks sent before the worker started
              (first to last task start, from the tasks' own timestamps), then the
              enqueue-to-start latency of single tasks sent every 0.3 s to an idle worker,
              then (outboxdb on PostgreSQL only) the idle cost: transactions per second
              the worker runs against its own database after 10 s without messages.

PostgreSQL runs in a database of its own, created and dropped by the run (so the idle
cost counts nothing but this worker); Redis uses a key prefix of its own, deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import CELERY, POSTGRES_URL, REDIS_URL, log, pg_connect, reachable

TARGETS = {"tasks_per_s_vs_redis": 0.5, "idle_queries_per_s": 2.0, "idle_p50_latency_ms": 20.0}
PHASES = ("kombu", "celery")

APP = '''
import os, time
import outbox.transport
from celery import Celery
app = Celery("bapp", broker=os.environ["BENCH_BROKER"])
app.conf.update(broker_transport_options=__import__("json").loads(os.environ["BENCH_OPTIONS"]),
                task_ignore_result=True, worker_prefetch_multiplier=4, task_serializer="json",
                accept_content=["json"], broker_connection_retry_on_startup=True)
OUT = os.environ["BENCH_OUT"]

@app.task
def noop(sent):
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{sent} {time.time()}\\n".encode())
    os.close(fd)
'''


def admin_url(database: str) -> str:
    base, _, _ = POSTGRES_URL.rpartition("/")
    return f"{base}/{database}"


class Brokers:
    """The brokers of one run: a PostgreSQL database of our own, a Redis key prefix."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:8]
        self.database = f"bench_transport_{self.tag}"
        self.redis_prefix = f"bench-transport-{self.tag}:"
        with pg_connect(POSTGRES_URL) as conn:
            conn.autocommit = True
            conn.execute(f'CREATE DATABASE "{self.database}"')
        self.pg_url = admin_url(self.database)

    def variants(self, sqla: bool) -> dict[str, tuple[str, dict[str, Any]]]:
        found = {
            "outboxdb": (f"outboxdb+{self.pg_url}", {"polling_interval": 1.0}),
            "redis": (REDIS_URL, {"global_keyprefix": self.redis_prefix}),
        }
        if sqla:
            found["sqlalchemy"] = (f"sqla+{self.pg_url.replace('postgresql://', 'postgresql+psycopg://')}",
                                   {})  # kombu hands its options to create_engine
        return found

    def xact_count(self) -> int:
        with pg_connect(POSTGRES_URL) as conn:
            row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                               (self.database,)).fetchone()
            return int(row[0])

    def close(self) -> None:
        try:
            import redis
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{self.redis_prefix}*"):
                client.delete(key)
        except Exception as exc:  # noqa: BLE001 - the run's figures are printed already
            log(f"redis cleanup failed: {exc}")
        with pg_connect(POSTGRES_URL) as conn:
            conn.autocommit = True
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


def kombu_phase(url: str, options: dict[str, Any], messages: int) -> dict[str, float]:
    from kombu import Connection

    import outbox.transport  # noqa: F401

    name = f"bench-{uuid.uuid4().hex[:8]}"
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(name)
        body = {"task": "noop", "args": [1, 2, 3], "kwargs": {}}
        started = time.perf_counter()
        for _ in range(messages):
            queue.put(body)
        sent = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(messages):
            queue.get(block=True, timeout=30).ack()
        received = time.perf_counter() - started
        queue.close()
    return {"send_per_s": messages / sent, "receive_ack_per_s": messages / received,
            "round_trip_per_s": messages / (sent + received)}


def celery_phase(name: str, url: str, options: dict[str, Any], tasks: int, latency_samples: int,
                 brokers: Brokers, idle: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    module = f"bapp_{uuid.uuid4().hex[:6]}"
    (workdir / f"{module}.py").write_text(APP.replace('"bapp"', f'"{module}"'))
    out = workdir / "out.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env.update({"BENCH_BROKER": url, "BENCH_OPTIONS": json.dumps(options), "BENCH_OUT": str(out),
                "PYTHONPATH": str(workdir)})
    sys.path.insert(0, str(workdir))
    os.environ.update({k: env[k] for k in ("BENCH_BROKER", "BENCH_OPTIONS", "BENCH_OUT")})
    import importlib
    app = importlib.import_module(module).app
    noop = app.tasks[f"{module}.noop"]
    lines = lambda: out.read_text().splitlines() if out.exists() else []  # noqa: E731
    # The backlog is in the broker before the worker starts: the drain measures the
    # broker's receive+ack path, not this process's send rate.
    started = time.perf_counter()
    for _ in range(tasks):
        noop.delay(0.0)
    result: dict[str, Any] = {"send_per_s": tasks / (time.perf_counter() - started)}
    logf = open(workdir / "worker.log", "wb")  # noqa: SIM115 - closed with the worker, in the finally below
    worker = subprocess.Popen([CELERY, "-A", module, "worker", "-c", "2", "--loglevel=INFO", "--without-mingle",
                               "--without-gossip", "--without-heartbeat"], cwd=workdir, env=env, stdout=logf,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait(lambda: len(lines()) >= tasks, 600, "drain")
        ran = sorted(float(line.split()[1]) for line in lines())
        result["tasks_per_s"] = (tasks - 1) / (ran[-1] - ran[0])
        time.sleep(3.0)  # let the worker go idle and back off
        latencies = []
        for _ in range(latency_samples):
            before = len(lines())
            noop.delay(time.time())
            wait(lambda: len(lines()) > before, 30, "latency sample")  # noqa: B023 - wait() calls it at once, inside this iteration
            sent, ran = map(float, lines()[-1].split())
            latencies.append((ran - sent) * 1000)
            time.sleep(0.3)
        result["latency_ms_p50"] = statistics.median(latencies)
        result["latency_ms_p90"] = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
        if idle:
            time.sleep(10.0)
            first, t0 = brokers.xact_count(), time.monotonic()
            time.sleep(10.0)
            result["idle_xact_per_s"] = (brokers.xact_count() - first) / (time.monotonic() - t0)
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
        logf.close()
        app.close()
        sys.path.remove(str(workdir))
    log(f"{name}: {result}")
    return result


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.transport: timed out waiting for {what}")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=2000, help="messages per broker in the kombu phase")
    p.add_argument("--tasks", type=int, default=2000, help="tasks per broker in the celery burst")
    p.add_argument("--latency-samples", type=int, default=20)
    p.add_argument("--no-sqlalchemy", dest="sqla", action="store_false", help="skip kombu's SQLAlchemy transport")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip: {', '.join(PHASES)}")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    for name, port in (("PostgreSQL", 5432), ("Redis", 6379)):
        if not reachable("127.0.0.1", port):
            raise SystemExit(f"bench.transport: {name} is not reachable on 127.0.0.1:{port}")
    brokers = Brokers()
    figures: dict[str, Any] = {"kombu": {}, "celery": {}}
    try:
        variants = brokers.variants(args.sqla)
        if "kombu" not in skip:
            for name, (url, options) in variants.items():
                figures["kombu"][name] = kombu_phase(url, options, args.messages)
                log(f"kombu {name}: {figures['kombu'][name]}")
        if "celery" not in skip:
            for name, (url, options) in variants.items():
                figures["celery"][name] = celery_phase(name, url, options, args.tasks, args.latency_samples,
                                                       brokers, idle=name == "outboxdb")
    finally:
        brokers.close()
    print(json.dumps(figures, indent=2))
    kombu, celery = figures["kombu"], figures["celery"]
    if "outboxdb" in kombu and "redis" in kombu:
        print(f"kombu send+receive+ack: outboxdb/redis = "
              f"{kombu['outboxdb']['round_trip_per_s'] / kombu['redis']['round_trip_per_s']:.2f}")
        if "sqlalchemy" in kombu:
            print(f"kombu send+receive+ack: outboxdb/sqlalchemy = "
                  f"{kombu['outboxdb']['round_trip_per_s'] / kombu['sqlalchemy']['round_trip_per_s']:.2f}")
    if "outboxdb" in celery and "redis" in celery:
        ratio = celery["outboxdb"]["tasks_per_s"] / celery["redis"]["tasks_per_s"]
        print(f"celery tasks/s: outboxdb/redis = {ratio:.2f} (target >= {TARGETS['tasks_per_s_vs_redis']})")
        if "sqlalchemy" in celery:
            print(f"celery tasks/s: outboxdb/sqlalchemy = "
                  f"{celery['outboxdb']['tasks_per_s'] / celery['sqlalchemy']['tasks_per_s']:.2f}")
        print(f"idle p50 latency: {celery['outboxdb']['latency_ms_p50']:.1f} ms "
              f"(target <= {TARGETS['idle_p50_latency_ms']}); idle transactions/s per worker: "
              f"{celery['outboxdb'].get('idle_xact_per_s', float('nan')):.2f} "
              f"(target <= {TARGETS['idle_queries_per_s']} per process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
