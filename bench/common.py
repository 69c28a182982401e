"""The shared pieces of the benchmarks in one import: the services and per-run names
(``bench.services``), the RabbitMQ destination (``bench.destination``), the outbox table
(``bench.backlog``, on the run's engine), process sampling (``bench.procs``), plus the end of a phase
(``teardown``) and the facts about the machine and versions a report starts with.

Everything here talks to 127.0.0.1 only.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from .backlog import (
    aggregate_name,
    claimed_messages,
    create_table,
    drop_table,
    lease_recovered,
    load_backlog,
    make_event,
    pg_connect,
    random_blob,
    status_counts,
    truncate_table,
    wait_all_done,
)
from .destination import Arrivals, Destination, amqp_connection, check_order, confirm_channel
from .procs import (
    CLK_TCK,
    CpuWindow,
    children,
    cpu_by_process,
    cpu_seconds,
    cpu_summary,
    parent_pid,
    process_tree,
    rss_kb,
    service_groups,
    stop_process_group,
    system_cpu,
    wait_quiet,
)
from .services import (
    AMQP_URL,
    CELERY,
    POSTGRES_URL,
    PY_SPY,
    REDIS_URL,
    Run,
    flush_redis,
    log,
    percentile,
    reachable,
    redis_llen,
    require_services,
    to_json,
)

__all__ = [
    "AMQP_URL", "CELERY", "CLK_TCK", "POSTGRES_URL", "PY_SPY", "REDIS_URL", "Arrivals", "CpuWindow",
    "Destination", "Run", "aggregate_name", "amqp_connection", "check_order", "children", "claimed_messages",
    "confirm_channel", "cpu_by_process", "cpu_seconds", "cpu_summary", "create_table", "drop_table", "flush_redis",
    "lease_recovered", "load_backlog", "log", "machine_facts", "make_event", "parent_pid", "percentile",
    "pg_connect", "process_tree", "random_blob", "reachable", "redis_llen", "require_services", "rss_kb",
    "service_groups", "status_counts", "stop_process_group", "system_cpu", "teardown", "to_json",
    "truncate_table", "wait_all_done", "wait_quiet",
]


def teardown(run: Run, destination: Any, relay: Any | None) -> None:
    """After a phase: stop its relay, close its consumer, drop its table, empty its Redis db."""
    if relay is not None:
        relay.stop()
    destination.close()
    drop_table(run)
    flush_redis(run.redis_url)


# -- facts about the machine and versions ----------------------------------------------------------

def machine_facts(run: Run) -> dict[str, Any]:
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nproc": os.cpu_count(),
                             "kernel": platform.release(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["memory_mb"] = int(line.split()[1]) // 1024
                break
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for package in ("outbox-relay", "celery", "kombu", "amqp", "psycopg", "redis"):
        try:
            facts[package] = version(package)
        except PackageNotFoundError:
            facts[package] = None
    try:
        with pg_connect(run.postgres_url) as conn:
            facts["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
            facts["pg_synchronous_commit"] = conn.execute("SHOW synchronous_commit").fetchone()[0]
            facts["pg_fsync"] = conn.execute("SHOW fsync").fetchone()[0]
    except Exception as exc:  # noqa: BLE001
        facts["postgresql"] = f"? ({exc})"
    try:
        conn = amqp_connection(run.amqp_url)
        facts["rabbitmq"] = (conn.server_properties or {}).get("version")
        conn.close()
    except Exception as exc:  # noqa: BLE001
        facts["rabbitmq"] = f"? ({exc})"
    try:
        import redis

        client = redis.Redis.from_url(run.redis_url, socket_timeout=5)
        facts["redis_server"] = client.info("server").get("redis_version")
        client.close()
    except Exception as exc:  # noqa: BLE001
        facts["redis_server"] = f"? ({exc})"
    return facts
