"""The benchmarks' foundation: the services on 127.0.0.1, the names that belong to one run,
the log line, and small helpers every phase uses."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POSTGRES_URL = os.environ.get("OUTBOX_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("OUTBOX_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
AMQP_URL = os.environ.get("OUTBOX_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: A spare Redis db for Celery's broker: flushed before and after a run.
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")

CELERY = str(Path(sys.executable).parent / "celery")
PY_SPY = str(Path(sys.executable).parent / "py-spy")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A local TCP port nothing listens on now (bound, then released): for a server a test or
    a benchmark starts, or for a URL that must find nothing there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_services(engines: Sequence[str] = ("postgresql",)) -> None:
    """The services a run needs: Redis, RabbitMQ and the database of each of ``engines``
    (``bench.engines``; SQLite needs none)."""
    from .engines import engine

    databases = [engine(name).service for name in engines]
    missing = [name for name, port in (*(s for s in databases if s), ("Redis", 6379), ("RabbitMQ", 5672))
               if not reachable("127.0.0.1", port)]
    if missing:
        raise SystemExit(f"bench: not reachable on 127.0.0.1: {', '.join(missing)}")


# -- per-run names and settings ----------------------------------------------------------------

@dataclass
class Run:
    """Names that belong to one bench run, so runs never see each other."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    postgres_url: str = POSTGRES_URL
    mysql_url: str = MYSQL_URL
    #: The database of the backlog and of the relay under test: "postgresql", "mysql" or
    #: "sqlite" (``bench.engines``; ``database_url``).
    engine: str = "postgresql"
    amqp_url: str = AMQP_URL
    redis_url: str = REDIS_URL
    batch_size: int = 100
    claim_interval_s: float = 1.0
    workdir: Path = field(default_factory=lambda: Path("/tmp"))
    #: The RabbitMQ exchange is ``<prefix>-<tag>``, its queue ``<prefix>-q-<tag>``.
    prefix: str = "outbox-bench"

    @property
    def table(self) -> str:
        return f"bench_outbox_{self.tag}"

    @property
    def exchange(self) -> str:
        return f"{self.prefix}-{self.tag}"

    @property
    def queue(self) -> str:
        return f"{self.prefix}-q-{self.tag}"

    @property
    def database_url(self) -> str:
        """The URL of ``engine``'s database (SQLite: a file in ``workdir``)."""
        from .engines import engine

        return engine(self.engine).database_url(self)

    def outbox_env(self, **extra: str) -> dict[str, str]:
        """The OUTBOX_* settings of the relay under test (worker, beat, and this process's wake)."""
        return {
            "OUTBOX_DATABASE_URL": self.database_url,
            "OUTBOX_TABLE": self.table,
            "OUTBOX_PUBLISH_URL": self.amqp_url,
            "OUTBOX_EXCHANGE": self.exchange,
            "OUTBOX_CELERY_BROKER_URL": self.redis_url,
            "OUTBOX_BATCH_SIZE": str(self.batch_size),
            "OUTBOX_CLAIM_INTERVAL_S": str(self.claim_interval_s),
            **extra,
        }

    def child_env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
        env.update(self.outbox_env())
        env["PYTHONUNBUFFERED"] = "1"
        # bench/ is importable by the children (python -m bench.loop) from any cwd.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(extra)
        return env


def flush_redis(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        size = int(client.dbsize())
        client.flushdb()
        return size
    finally:
        client.close()


def redis_llen(client: Any, key: str) -> int | None:
    try:
        return int(client.llen(key))
    except Exception:  # noqa: BLE001 - a depth the sampler cannot read is None
        return None


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)
