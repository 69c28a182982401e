"""The task runners the end-to-end scenarios run on: one scenario, two runners.

A runner knows how to start the relay's worker and scheduler processes and how to read
what a worker holds from its log; the scenarios in tests/test_relay_e2e.py and
tests/test_recovery_e2e.py take a runner and are otherwise the same for Celery
(``celery -A outbox worker`` + ``beat``) and Dramatiq (``dramatiq outbox.dramatiq`` +
``outbox-dramatiq-scheduler``).
"""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


class CeleryRunner:
    name = "celery"

    def env(self, redis_url: str, prefix: str) -> dict[str, str]:
        """Settings of this runner (Celery's broker is set by ``relay_env`` already)."""
        return {}

    def worker(self, procs: Any, name: str, concurrency: int = 2, queues: str | None = None,
               **env: str) -> Any:
        """``queues``: the worker's ``-Q`` (default: every relay queue)."""
        args = ["-Q", queues] if queues else []
        return procs.start(name, "worker", "-c", str(concurrency), "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
                           "--loglevel=INFO", "--without-mingle", "--without-gossip", "--without-heartbeat", *args,
                           env=env)

    def scheduler(self, procs: Any, name: str = "beat", **env: str) -> Any:
        return procs.start(name, "beat", "--loglevel=INFO", "-s", str(procs.tmp_path / "beat-schedule"), env=env)

    def tasks_in_hand(self, log: str, task: str = "outbox.publish") -> set[str]:
        """Ids of ``task`` the worker has received (reserved or running) and not finished."""
        received, finished = set(), set()
        for line in log.splitlines():
            if f"Task {task}[" not in line:
                continue
            task_id = line.split(f"Task {task}[", 1)[1].split("]", 1)[0]
            (received if line.endswith("] received") else finished).add(task_id)
        return received - finished

    def succeeded(self, log: str, task_id: str, task: str = "outbox.publish") -> bool:
        return f"Task {task}[{task_id}] succeeded" in log


class DramatiqRunner:
    """Dramatiq's broker: the test's Redis, under a namespace of the test's own."""

    name = "dramatiq"
    _LINE = re.compile(r"outbox: (?P<task>[\w.]+)\[(?P<id>[0-9a-f-]+)\] (?P<what>started|succeeded|failed)")

    def env(self, redis_url: str, prefix: str) -> dict[str, str]:
        return {"OUTBOX_DRAMATIQ_BROKER_URL": redis_url, "OUTBOX_DRAMATIQ_NAMESPACE": prefix.rstrip(":")}

    def worker(self, procs: Any, name: str, concurrency: int = 2, queues: str | None = None,
               **env: str) -> Any:
        """``concurrency`` worker processes of 2 threads each; ``queues``: a comma list."""
        args = ["--queues", *queues.split(",")] if queues else []
        return procs.spawn(name, [str(BIN / "dramatiq"), "outbox.dramatiq", "--processes", str(concurrency),
                                  "--threads", "2", *args], env=env)

    def scheduler(self, procs: Any, name: str = "beat", **env: str) -> Any:
        return procs.spawn(name, [str(BIN / "outbox-dramatiq-scheduler")], env=env)

    def tasks_in_hand(self, log: str, task: str = "outbox.publish") -> set[str]:
        started, finished = set(), set()
        for match in self._LINE.finditer(log):
            if match["task"] == task:
                (started if match["what"] == "started" else finished).add(match["id"])
        return started - finished

    def succeeded(self, log: str, task_id: str, task: str = "outbox.publish") -> bool:
        return f"outbox: {task}[{task_id}] succeeded" in log


CELERY = CeleryRunner()
DRAMATIQ = DramatiqRunner()
RUNNERS = {r.name: r for r in (CELERY, DRAMATIQ)}
