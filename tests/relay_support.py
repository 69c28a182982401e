"""What the relay's pure-logic tests share (tests/test_claim.py, tests/test_publish_policy.py,
tests/test_worker_lifecycle.py): a real SQLite store in a file, and a scripted in-memory
publisher standing in for the broker (pure logic only; the real publisher and broker are
exercised end to end in test_relay_e2e.py and test_recovery_e2e.py). A pytest plugin
(tests/conftest.py registers it): its fixtures are found by name, its helpers imported.
``sqlite_store`` is not engine_support's engine-parametrized ``store``: one SQLite file, the
default table, which ``conn`` (the application's connection) writes to."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from outbox import enqueue
from outbox.core.model import OutboxMessage
from outbox.domain.chains import split_chains
from outbox.publisher import ChainResult, FailureKind, Pipelined, Publisher, PublishFailure
from outbox.storage.store import OutboxStore

PYTHON = sys.executable


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[OutboxStore]:
    s = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=60_000, max_attempts=3)
    s.migrate()
    yield s
    s.close()


@pytest.fixture
def conn(tmp_path: Path, sqlite_store: OutboxStore) -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(tmp_path / "outbox.db", timeout=30)
    yield c
    c.close()


def add(conn: sqlite3.Connection, aggregate: str, count: int = 1, payload: Any = None, **kw: Any) -> list[int]:
    ids = [enqueue(conn, topic="orders.created", aggregate_type="order", aggregate_id=aggregate,
                   payload=payload if payload is not None else {"aggregate": aggregate, "n": i}, **kw)
           for i in range(count)]
    conn.commit()
    return ids


def rows(store: OutboxStore) -> dict[int, dict[str, Any]]:
    with store.transaction() as cursor:
        found = store.engine.execute(
            cursor, f"SELECT id, status, attempts, next_retry_at, last_error, lease_token FROM {store.engine.table}"
        ).fetchall()
    return {int(r[0]): {"status": int(r[1]), "attempts": int(r[2]), "next_retry_at": r[3], "last_error": r[4],
                        "lease": r[5]} for r in found}


def status_of(store: OutboxStore) -> dict[int, int]:
    return {id: r["status"] for id, r in rows(store).items()}


class ScriptedPublisher(Publisher):
    """Publishes in memory, chain after chain; ``failures`` maps an outbox id to the failure
    kind it gets (once, or every time with ``sticky``)."""

    def __init__(self, failures: dict[int, FailureKind] | None = None, sticky: bool = False,
                 raises: Exception | None = None) -> None:
        self.failures = dict(failures or {})
        self.sticky = sticky
        self.raises = raises
        self.sent: list[OutboxMessage] = []
        self.dead: list[tuple[OutboxMessage, str]] = []

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *,
                       pipelined: Pipelined | None = None, deadline: float | None = None) -> list[ChainResult]:
        return [self.publish_chain(chain) for chain in chains]

    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        if self.raises is not None:
            raise self.raises
        published: list[int] = []
        for m in messages:
            kind = self.failures.get(m.id)
            if kind is not None:
                if not self.sticky:
                    del self.failures[m.id]
                return ChainResult(tuple(published), m.id, PublishFailure(kind, f"scripted {kind.value}"))
            self.sent.append(m)
            published.append(m.id)
        return ChainResult(tuple(published))

    def publish_dead(self, message: OutboxMessage, error: str, *,
                     headers: Mapping[str, Any] | None = None) -> None:
        self.dead.append((message, error))
        return None

    def close(self) -> None:
        pass


class Collect:
    """A ``dispatch`` that keeps the publish tasks it is given."""

    def __init__(self) -> None:
        self.tasks: list[tuple[list[list[OutboxMessage]], float]] = []

    def __call__(self, chains: list[list[OutboxMessage]], deadline: float) -> None:
        self.tasks.append((chains, deadline))

    @property
    def chains(self) -> list[list[OutboxMessage]]:
        return [chain for task, _ in self.tasks for chain in task]


def claim_chains(store: OutboxStore, batch: int = 100) -> list[list[OutboxMessage]]:
    return split_chains(store.claim(batch).messages)


# -- the Celery app in a subprocess (a fresh app each time) ------------------------------------

def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    return subprocess.run([PYTHON, "-c", code], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)
