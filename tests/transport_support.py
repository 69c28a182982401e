"""A small Celery app on the ``outboxdb+...`` transport (the database as Celery's broker),
written to a fresh module per test, with its workers as child processes
(tests/test_transport_celery.py, test_transport_deploy.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from engine_support import engine_url
from relay_e2e_support import CELERY

from outbox.storage.engines import engine_for_url
from outbox.transport import drop_queue_tables
from outbox.transport.tables import queue_tables

APP = '''
"""A Celery app on the outboxdb transport, for the tests."""
import os, time
import outbox.transport  # registers outboxdb+...
from celery import Celery

app = Celery(__name__, broker=os.environ["TAPP_BROKER"], backend=os.environ.get("TAPP_BACKEND") or None)
app.conf.update(
    broker_transport_options={"queue_table": os.environ["TAPP_TABLE"], "visibility_timeout": float(os.environ.get("TAPP_VISIBILITY", "4")),
                              "polling_interval": float(os.environ.get("TAPP_POLL", "0.2"))},
    task_acks_late=True, task_reject_on_worker_lost=False, worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True, task_serializer="json", accept_content=["json"],
    worker_hijack_root_logger=False, worker_pool_putlocks=os.environ.get("TAPP_PUTLOCKS", "1") == "1",
    worker_pool=os.environ.get("TAPP_POOL") or "prefork",
    result_backend_transport_options={"global_keyprefix": os.environ["TAPP_KEYPREFIX"]})
OUT = os.environ["TAPP_OUT"]


def note(line):
    with open(OUT, "a") as f:
        f.write(line + "\\n")


@app.task
def record(n):
    note(f"record {n} {os.getpid()} {time.time():.3f}")


@app.task
def nap(seconds):
    time.sleep(seconds)


@app.task
def noted_nap(n, seconds):
    note(f"nap {n} {os.getpid()} {time.time():.3f}")
    time.sleep(seconds)


@app.task
def fail_large(size, go):
    note(f"fail_large {os.getpid()}")
    while not os.path.exists(go):
        time.sleep(0.01)
    raise ValueError("x" * size)  # its exception info, larger than a pipe holds, goes back to the main process


@app.task(bind=True)
def marked(self, n):
    note(f"marked {n} {os.getpid()} {time.time():.3f} {bool(self.request.delivery_info.get('redelivered'))}")


@app.task(bind=True)
def slow(self, n):
    redelivered = bool(self.request.delivery_info.get("redelivered"))
    note(f"start {n} {os.getpid()} {redelivered}")
    if not redelivered:
        time.sleep(60)  # killed in here
    note(f"done {n} {os.getpid()} {redelivered}")
'''


class TaskApp:
    def __init__(self, kind: str, tmp_path: Path, **env: str) -> None:
        self.db_url = engine_url(kind, tmp_path)
        self.table = f"cq_{uuid.uuid4().hex[:10]}"
        self.out = tmp_path / "out.txt"
        self.out.write_text("")
        self.module = f"tapp_{uuid.uuid4().hex[:8]}"  # a fresh module (and task registry) per test
        (tmp_path / f"{self.module}.py").write_text(APP)
        self.tmp_path = tmp_path
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
        self.env.update({"TAPP_BROKER": f"outboxdb+{self.db_url}", "TAPP_TABLE": self.table,
                         "TAPP_OUT": str(self.out), "PYTHONUNBUFFERED": "1",
                         # the app's module first, then the caller's path (a worktree's src/)
                         "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
                         "TAPP_BACKEND": "", "TAPP_POLL": "0.2", "TAPP_PUTLOCKS": "1",
                         # A Redis result backend's keys: under a prefix of the test's own, deleted by close().
                         "TAPP_KEYPREFIX": f"outbox-tapp-{uuid.uuid4().hex[:10]}:", **env})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        sys.path.insert(0, str(tmp_path))
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("TAPP_")})
        import importlib
        self.app = importlib.import_module(self.module).app

    def task(self, name: str) -> Any:
        return self.app.tasks[f"{self.module}.{name}"]

    def worker(self, name: str, concurrency: int = 1, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen([CELERY, "-A", self.module, "worker", "-c", str(concurrency), "-n", f"{name}@%h",
                                 "--loglevel=INFO", "--without-mingle", "--without-gossip", "--without-heartbeat",
                                 *args],
                                cwd=self.tmp_path, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def celery(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CELERY, "-A", self.module, *args], cwd=self.tmp_path, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def lines(self, prefix: str) -> list[list[str]]:
        return [line.split() for line in self.out.read_text().splitlines() if line.startswith(prefix + " ")]

    def kill(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        self.app.close()
        sys.path.remove(str(self.tmp_path))
        sys.modules.pop(self.module, None)
        drop_queue_tables(self.db_url, self.table)
        if self.env["TAPP_BACKEND"].startswith("redis"):  # results, kept a day, and REVOKED marks
            import redis

            client = redis.Redis.from_url(self.env["TAPP_BACKEND"], socket_timeout=5)
            for key in client.scan_iter(match=f"{self.env['TAPP_KEYPREFIX']}*"):
                client.delete(key)
            client.close()

    def queue_rows(self) -> list[tuple]:
        """(receipt, visible in the future?) of every row in the app's default queue."""
        engine = engine_for_url(self.db_url)
        qt = queue_tables(engine, self.table)
        conn = engine.connect(self.db_url)
        try:
            cursor = engine.cursor_for(conn)
            rows = engine.execute(cursor, f"SELECT receipt, CASE WHEN visible_at > {engine.now} THEN 1 ELSE 0 END "
                                  f"FROM {qt.table} WHERE queue = ?", ["celery"]).fetchall()
            conn.commit()
            return [tuple(r) for r in rows]
        finally:
            conn.close()
