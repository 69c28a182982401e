"""``outbox demo``: the whole pipeline on the embedded default, in one process.

Nothing to install beyond the package: the outbox is a SQLite file in a temporary
folder, Celery's broker and the destination broker are kombu's in-memory
transport, and a real Celery worker (the relay's own tasks, on a thread pool) runs
in this process. The demo writes events the way an application does (business row
and event in one transaction, and one transaction that rolls back), lets the relay
deliver them, consumes them from the destination exchange, and checks what a user
of the relay relies on: every committed event arrives, in order per aggregate, and
the rolled-back one never does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.config import Settings

ORDERS = ("order-1", "order-2", "order-3")
STEPS = ("created", "paid", "packed", "shipped")


def _write_events(db: Path, say: Callable[[str], None]) -> list[tuple[str, int]]:
    from outbox import enqueue

    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, state TEXT)")
    expected = []
    for step in STEPS:
        for order in ORDERS:
            with conn:  # one transaction: the business change and its event commit together
                conn.execute("INSERT INTO orders VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET state = excluded.state",
                             (order, step))
                enqueue(conn, topic=f"orders.{step}", aggregate_type="order", aggregate_id=order,
                        payload={"orderId": order, "state": step})
            expected.append((order, STEPS.index(step)))
    try:
        with conn:
            enqueue(conn, topic="orders.cancelled", aggregate_type="order", aggregate_id="order-1",
                    payload={"orderId": "order-1", "state": "cancelled"})
            raise RuntimeError("the business transaction failed")
    except RuntimeError:
        say("  one transaction rolled back: its event (orders.cancelled) must never be published")
    conn.close()
    return expected


def run_demo(say: Callable[[str], None] = print, timeout_s: float = 30.0, keep: bool = False) -> bool:
    """Run the demo; return True when every check passed. Its temporary folder (the SQLite
    file) is removed afterwards unless ``keep``, so runs leave nothing behind."""
    workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    try:
        return _run(workdir, say, timeout_s)
    finally:
        if keep:
            say(f"kept the demo's outbox: OUTBOX_DATABASE_URL=sqlite:///{workdir / 'outbox.db'} outbox status")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


#: Environment names the relay or Celery reads a database or a broker from, which the demo
#: drops for its own (``_own_environment``).
_FOREIGN_PREFIXES = ("OUTBOX_", "CELERY_")


def _own_environment(db: Path) -> None:
    """The embedded default and nothing else, whatever the shell has set (docs/operations.md,
    "Leftovers"): a deployment's
    OUTBOX_SCHEMA (say) made the demo's SQLite look for a database "app", and so did one in
    the Django settings DJANGO_SETTINGS_MODULE names (read after the environment); the
    module CELERY_CONFIG_MODULE names (`celery --config` sets it) is read before the
    environment, and its OUTBOX_* keys took the demo's migration to a real PostgreSQL
    database and its events to a real RabbitMQ exchange; CELERY_BROKER_URL would be the
    demo worker's broker (all found in review)."""
    for name in [name for name in os.environ if name.startswith(_FOREIGN_PREFIXES)
                 or name == "DJANGO_SETTINGS_MODULE"]:
        del os.environ[name]
    os.environ.update({"OUTBOX_DATABASE_URL": f"sqlite:///{db}", "OUTBOX_PUBLISH_URL": "memory://",
                       "OUTBOX_CELERY_BROKER_URL": "memory://", "OUTBOX_CLAIM_INTERVAL_S": "0.2"})


def _check_confined(db: Path, settings: Settings, celery_broker: str | None) -> None:
    """Refuse to run unless the database, the destination and Celery's broker are the demo's
    own: a process that configured the relay's Celery app before the demo (a caller of
    ``run_demo``) keeps that configuration whatever the environment now says."""
    from ..core.errors import ConfigError
    from ..core.redact import redact

    own = {"database": (settings.database_url, f"sqlite:///{db}"),
           "destination broker": (settings.publish_url, "memory://"),
           "Celery broker": (settings.broker_url, "memory://"),
           "Celery app's broker": (celery_broker or "", "memory://")}
    for what, (value, expected) in own.items():
        if not value.startswith(expected):
            raise ConfigError(redact(f"outbox demo: the {what} would be {value}, not the demo's own {expected}: "
                                     "this process was configured before the demo; run `outbox demo` on its own"))


def _run(workdir: Path, say: Callable[[str], None], timeout_s: float) -> bool:
    # kombu warns that memory:// has no hostname on every connection; harmless here.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    db = workdir / "outbox.db"
    _own_environment(db)
    from kombu import Connection, Exchange, Queue

    from ..celery import app
    from ..core.config import get_settings, reset_settings
    from ..storage.store import OutboxStore

    reset_settings()
    _check_confined(db, get_settings(), app.conf.broker_url)
    store = OutboxStore.from_settings()
    store.migrate()
    say(f"outbox table ready in {db}")

    destination = Connection("memory://")
    queue = Queue("demo-consumer", Exchange("outbox", type="topic", durable=True), routing_key="#")
    queue(destination.channel()).declare()

    say("application: writing 12 events for 3 orders, one transaction per event")
    expected = _write_events(db, say)

    from celery.contrib.testing.worker import start_worker

    from ..celery import tasks

    arrivals: list[tuple[str, dict]] = []
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"):
        say("relay: a Celery worker is running; asking it to claim")
        tasks.request_claim()
        deadline = time.monotonic() + timeout_s
        simple = destination.SimpleQueue(queue)
        while len(arrivals) < len(expected) and time.monotonic() < deadline:
            try:
                message = simple.get(timeout=0.5)
            except simple.Empty:
                tasks.request_claim()
                continue
            body = message.body if isinstance(message.body, str) else message.body.decode()
            arrivals.append((message.headers["aggregate_id"], {**json.loads(body), 
                "topic": message.headers["topic"], "attempt": message.headers["attempt"]}))
            say(f"  broker <- {message.headers['topic']:<16} {message.headers['aggregate_id']} "
                f"outbox_id={message.headers['outbox_id']} attempt={message.headers['attempt']}")
            message.ack()
        simple.close()
        time.sleep(0.3)  # let the last acks land before the worker stops

    per_order: dict[str, list[int]] = defaultdict(list)
    for order, body in arrivals:
        per_order[order].append(STEPS.index(body["state"]) if body["state"] in STEPS else -1)
    stats = store.stats()
    store.close()
    checks = {
        "every committed event arrived": len(arrivals) == len(expected),
        "in order per order id": all(steps == sorted(steps) for steps in per_order.values()),
        "the rolled-back event never arrived": all(body["state"] != "cancelled" for _, body in arrivals),
        "every row is done": stats.counts["done"] == len(expected) and stats.counts["pending"] == 0,
    }
    say(f"outbox status: {json.dumps(stats.counts)}")
    for name, ok in checks.items():
        say(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return all(checks.values())
