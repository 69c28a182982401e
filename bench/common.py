"""Shared pieces of the benchmarks: services, per-run names, the RabbitMQ destination, the
PostgreSQL table, process sampling and facts about the machine.

Everything here talks to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POSTGRES_URL = os.environ.get("OUTBOX_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
AMQP_URL = os.environ.get("OUTBOX_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: A spare Redis db for Celery's broker: flushed before and after a run.
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")

CELERY = str(Path(sys.executable).parent / "celery")
PY_SPY = str(Path(sys.executable).parent / "py-spy")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_services() -> None:
    missing = [name for name, port in (("PostgreSQL", 5432), ("Redis", 6379), ("RabbitMQ", 5672))
               if not reachable("127.0.0.1", port)]
    if missing:
        raise SystemExit(f"bench: not reachable on 127.0.0.1: {', '.join(missing)}")


# -- per-run names and settings ----------------------------------------------------------------

@dataclass
class Run:
    """Names that belong to one bench run, so runs never see each other."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    postgres_url: str = POSTGRES_URL
    amqp_url: str = AMQP_URL
    redis_url: str = REDIS_URL
    batch_size: int = 100
    claim_interval_s: float = 1.0
    workdir: Path = field(default_factory=lambda: Path("/tmp"))

    @property
    def table(self) -> str:
        return f"bench_outbox_{self.tag}"

    @property
    def exchange(self) -> str:
        return f"outbox-bench-{self.tag}"

    @property
    def queue(self) -> str:
        return f"outbox-bench-q-{self.tag}"

    def outbox_env(self, **extra: str) -> dict[str, str]:
        """The OUTBOX_* settings of the relay under test (worker, beat, and this process's wake)."""
        return {
            "OUTBOX_DATABASE_URL": self.postgres_url,
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


# -- RabbitMQ: the destination ------------------------------------------------------------------

def _amqp_connection(url: str) -> Any:
    import amqp
    from kombu.utils.url import url_to_parts

    scheme, host, port, user, password, path, _ = url_to_parts(url)
    conn = amqp.Connection(host=f"{host or '127.0.0.1'}:{port or 5672}", userid=user or "guest",
                           password=password or "guest", virtual_host=path or "/", connect_timeout=5)
    conn.connect()
    return conn


def confirm_channel(conn: Any) -> tuple[Any, dict[str, int]]:
    """A channel in confirm mode and what the broker confirmed on it: ``acked`` (the highest
    delivery tag settled, by ack or nack) and ``nacked`` (how many nacks)."""
    ch = conn.channel()
    ch.confirm_select()
    state = {"acked": 0, "nacked": 0}

    def on_ack(tag: int, multiple: bool) -> None:
        state["acked"] = max(state["acked"], tag)

    def on_nack(tag: int, multiple: bool) -> None:
        state["nacked"] += 1
        state["acked"] = max(state["acked"], tag)

    ch.events["basic_ack"].add(on_ack)
    ch.events["basic_nack"].add(on_nack)
    return ch, state


def teardown(run: Run, destination: Any, relay: Any | None) -> None:
    """After a phase: stop its relay, close its consumer, drop its table, empty its Redis db."""
    if relay is not None:
        relay.stop()
    destination.close()
    drop_table(run)
    flush_redis(run.redis_url)


class Arrivals:
    """What a bench consumer thread records: ``(perf_counter, outbox_id, aggregate_id)`` of
    every message as it arrives (``Destination`` on RabbitMQ, ``bench.kafka.KafkaDestination``)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"bench consumer failed: {self._error!r}")

    def reset(self) -> None:
        self.arrivals.clear()

    def unique(self) -> int:
        return len({a[1] for a in self.arrivals})

    def wait_for(self, count: int, timeout: float, idle_timeout: float | None = None,
                 alive: Any = None) -> bool:
        """Wait until ``count`` distinct outbox ids arrived, ``timeout`` passed, or nothing
        new arrived for ``idle_timeout`` seconds. Returns whether the count was reached."""
        deadline = time.monotonic() + timeout
        seen_len, seen_at = -1, time.monotonic()
        ids: set[int] = set()
        scanned = 0
        while True:
            self.check()
            current = len(self.arrivals)
            for entry in self.arrivals[scanned:current]:
                ids.add(entry[1])
            scanned = current
            if len(ids) >= count:
                return True
            now = time.monotonic()
            if current != seen_len:
                seen_len, seen_at = current, now
            if now > deadline or (idle_timeout is not None and now - seen_at > idle_timeout):
                return False
            if alive is not None:
                alive()
            time.sleep(0.02)


class Destination(Arrivals):
    """A unique durable topic exchange with one durable queue bound to ``#``, and a consumer
    thread (raw py-amqp, no-ack, so it costs as little CPU as possible)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        admin = _amqp_connection(run.amqp_url)
        try:
            ch = admin.channel()
            ch.exchange_declare(run.exchange, "topic", durable=True, auto_delete=False)
            ch.queue_declare(run.queue, durable=True, auto_delete=False)
            ch.queue_bind(run.queue, run.exchange, routing_key="#")
            ch.queue_purge(run.queue)
        finally:
            admin.close()
        self._thread = threading.Thread(target=self._consume, name="bench-consumer", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"bench consumer did not start: {self._error}")

    def _consume(self) -> None:
        arrivals = self.arrivals
        clock = time.perf_counter

        def on_message(message: Any) -> None:
            h = message.properties.get("application_headers") or {}
            arrivals.append((clock(), int(h.get("outbox_id", -1)), str(h.get("aggregate_id"))))

        try:
            conn = _amqp_connection(self.run.amqp_url)
            ch = conn.channel()
            ch.basic_consume(self.run.queue, callback=on_message, no_ack=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.2)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self._error = exc
        finally:
            with contextlib.suppress(Exception):  # best effort: the consumer is done
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            admin = _amqp_connection(self.run.amqp_url)
            try:
                ch = admin.channel()
                ch.queue_delete(self.run.queue)
                ch.exchange_delete(self.run.exchange)
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - best effort
            log(f"could not delete {self.run.exchange}/{self.run.queue}: {exc}")


def check_order(arrivals: Sequence[tuple[float, int, str]], expected: dict[str, list[int]]) -> dict[str, Any]:
    """The ordering rule from the arrival order: per aggregate, the *first* arrival of each
    id comes in id order, and every expected id arrived. Duplicates (at-least-once) are
    counted, not failed."""
    first: dict[str, list[int]] = {}
    seen: set[int] = set()
    duplicates = 0
    for _, outbox_id, aggregate in arrivals:
        if outbox_id in seen:
            duplicates += 1
            continue
        seen.add(outbox_id)
        first.setdefault(aggregate, []).append(outbox_id)
    violations: list[str] = []
    missing = 0
    for aggregate, ids in expected.items():
        got = first.get(aggregate, [])
        want = set(ids)
        inversions = sum(1 for a, b in zip(got, got[1:]) if b < a)
        if inversions:
            violations.append(f"{aggregate}: {inversions} out-of-order arrivals")
        missing += len(want - set(got))
    unexpected = len(seen - {i for ids in expected.values() for i in ids})
    return {"ok": not violations and missing == 0 and unexpected == 0, "violations": violations[:5],
            "violating_aggregates": len(violations), "missing": missing, "unexpected": unexpected,
            "duplicates": duplicates}


# -- PostgreSQL: the outbox table -----------------------------------------------------------------

def pg_connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=False)


def create_table(run: Run) -> None:
    from outbox.storage.store import OutboxStore

    store = OutboxStore(run.postgres_url, table=run.table)
    try:
        store.migrate()
    finally:
        store.close()


def drop_table(run: Run) -> None:
    with pg_connect(run.postgres_url) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {run.table}")
        conn.execute(f"DROP TABLE IF EXISTS {run.table}_holders")  # docs/internals.md, "Lost workers"
        conn.commit()


def truncate_table(run: Run) -> None:
    with pg_connect(run.postgres_url) as conn:
        conn.execute(f"TRUNCATE {run.table}")
        conn.commit()


def aggregate_name(i: int) -> str:
    return f"agg-{i:03d}"


def make_event(n: int, aggregate: str, blob: str | None = None) -> Any:
    """A realistic event: ~200 bytes of JSON payload, two caller headers; with ``blob``, the
    payload also carries that string (the memory phase's large events)."""
    from outbox.domain.events import prepare_event

    payload = {"orderId": aggregate, "n": n, "state": "confirmed", "amount": "129.90",
               "currency": "EUR", "lines": [{"sku": f"SKU-{n % 97:05d}", "qty": 1 + n % 3}],
               "note": "benchmark event with a payload of typical size"}
    if blob is not None:
        payload["attachment"] = blob
    return prepare_event(topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                         payload=payload, headers={"x-tenant": "acme", "x-source": "bench"})


def random_blob(size: int) -> str:
    """``size`` characters of base64 text from random bytes: JSON needs no escaping for it and
    PostgreSQL's TOAST compression gains little, like a real attachment."""
    import base64

    return base64.b64encode(os.urandom(size * 3 // 4 + 3)).decode("ascii")[:size]


def load_backlog(run: Run, events: int, aggregates: int, big_every: int = 0,
                 big_bytes: int = 0) -> dict[str, list[int]]:
    """Insert ``events`` rows round-robin over ``aggregates`` in ONE transaction (COPY), so the
    whole backlog becomes visible at once. Returns the expected per-aggregate id order.
    With ``big_every`` > 0, every ``big_every``-th event carries a payload of about
    ``big_bytes`` bytes (the rest stay ~200 bytes)."""
    cols = "message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers, trace_id"
    blob = random_blob(max(0, big_bytes - 300)) if big_every > 0 else None
    with pg_connect(run.postgres_url) as conn:
        with conn.cursor() as cur, cur.copy(f"COPY {run.table} ({cols}) FROM STDIN") as copy:
            for n in range(events):
                big = blob if big_every > 0 and n % big_every == big_every - 1 else None
                e = make_event(n, aggregate_name(n % aggregates), big)
                copy.write_row((e.message_id, e.topic, e.aggregate_type, e.aggregate_id, e.partition_key,
                                e.payload_json, e.headers_json, e.trace_id))
        # Read before the commit: a relay already running claims rows as soon as they are
        # visible, and those would be missing from the expected order (then reported as
        # "unexpected" arrivals although nothing was out of order).
        rows = conn.execute(f"SELECT id, aggregate_id FROM {run.table} ORDER BY id").fetchall()
        conn.commit()
        conn.execute(f"ANALYZE {run.table}")
        conn.commit()
        try:  # flush the load now, so its writeback does not land in the measurement
            conn.execute("CHECKPOINT")
            conn.commit()
        except Exception:  # noqa: BLE001 - needs a superuser; only a noise reduction
            conn.rollback()
    os.sync()
    expected: dict[str, list[int]] = {}
    for outbox_id, aggregate in rows:
        expected.setdefault(aggregate, []).append(int(outbox_id))
    return expected


def status_counts(run: Run) -> dict[int, int]:
    with pg_connect(run.postgres_url) as conn:
        rows = conn.execute(f"SELECT status, COUNT(*) FROM {run.table} GROUP BY status").fetchall()
        conn.commit()
    return {int(s): int(c) for s, c in rows}


def lease_recovered(run: Run) -> int:
    """Rows that needed a second delivery (attempts > 0): a lost task, recovered by the lease."""
    with pg_connect(run.postgres_url) as conn:
        n = conn.execute(f"SELECT COUNT(*) FROM {run.table} WHERE attempts > 0").fetchone()[0]
        conn.commit()
    return int(n)


def wait_all_done(run: Run, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = status_counts(run)
        if set(counts) <= {2} or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


# -- processes ------------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            except OSError:
                continue
            out.extend(int(x) for x in text.split())
    except OSError:
        pass
    return out


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children(p))
    return tree


def rss_kb(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident set (``VmRSS``) or its peak so far (``VmHWM``), in kB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process, in seconds."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """(comm, cpu seconds) of every process on the machine."""
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        cpu = cpu_seconds(pid)
        if cpu is not None:
            out[pid] = (comm, cpu)
    return out


def system_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return float(total - idle), float(total)


class CpuWindow:
    """CPU used by each group of processes between ``start`` and ``stop``."""

    def __init__(self, groups: dict[str, Any]) -> None:
        #: name -> callable(pid, comm) -> bool; first match wins, the rest is "other".
        self.groups = groups

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._procs0 = cpu_by_process()
        self._sys0 = system_cpu()

    def stop(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._t0
        procs1 = cpu_by_process()
        sys1 = system_cpu()
        used: dict[str, float] = dict.fromkeys(self.groups, 0.0)
        used["other"] = 0.0
        other: dict[str, float] = {}
        for pid, (comm, cpu) in procs1.items():
            before = self._procs0.get(pid)
            delta = cpu - (before[1] if before and before[0] == comm else 0.0)
            for name, match in self.groups.items():
                if match(pid, comm):
                    used[name] += delta
                    break
            else:
                used["other"] += delta
                other[comm] = other.get(comm, 0.0) + delta
        busy = (sys1[0] - self._sys0[0]) / max(1.0, sys1[1] - self._sys0[1])
        cores = os.cpu_count() or 1
        # CPU of processes that started and ended inside the window is not seen per process.
        seen = sum(used.values())
        unattributed = max(0.0, (sys1[0] - self._sys0[0]) / CLK_TCK - seen)
        top_other = sorted(other.items(), key=lambda kv: -kv[1])[:5]
        return {"elapsed_s": elapsed, "machine_busy": busy, "cores": cores,
                "cores_used": {k: v / elapsed for k, v in used.items() if elapsed > 0},
                "other_top": {k: round(v / elapsed, 3) for k, v in top_other if elapsed > 0},
                "unattributed_cores": round(unattributed / elapsed, 3) if elapsed > 0 else 0.0}


def parent_pid(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])


def service_groups() -> dict[str, Any]:
    """CPU groups for the services and this process (with its direct children, e.g. the
    baseline loop). Python processes that are none of ours (other sessions' tests on a
    shared machine) get their own group, so a contaminated measurement shows."""
    me = os.getpid()
    return {
        "bench (consumer, writers, loop)": lambda pid, comm: pid == me or parent_pid(pid) == me,
        "postgres": lambda pid, comm: comm.startswith("postgres"),
        "rabbitmq": lambda pid, comm: comm.startswith(("beam", "erl", "epmd", "inet_gethost", "1_scheduler",
                                                       "2_scheduler", "dirty")),
        "redis": lambda pid, comm: comm.startswith("redis"),
        "other python (not this bench)": lambda pid, comm: comm.startswith(("python", "celery", "pytest", "py-spy")),
        # Mostly page writeback and block I/O (WAL, RabbitMQ's message store): on this VM I/O costs CPU.
        "kernel threads (writeback, I/O)": lambda pid, comm: comm.startswith(("kworker", "ksoftirqd", "kdamond",
                                                                              "kswapd", "jbd2", "kthreadd")),
    }


def wait_quiet(max_busy: float = 0.25, window: float = 1.0, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the machine is mostly idle (busy fraction over ``window`` below
    ``max_busy``), at most ``timeout`` seconds. On a shared machine other sessions may be
    running tests; a benchmark started in their middle measures them too."""
    started = time.monotonic()
    busy = 1.0
    while True:
        b0 = system_cpu()
        time.sleep(window)
        b1 = system_cpu()
        busy = (b1[0] - b0[0]) / max(1.0, b1[1] - b0[1])
        waited = time.monotonic() - started
        if busy <= max_busy or waited >= timeout:
            if busy > max_busy:
                log(f"machine still {100 * busy:.0f}% busy after {waited:.0f}s (other load); measuring anyway")
            return {"busy_before": round(busy, 3), "waited_s": round(waited, 1), "quiet": busy <= max_busy}


def stop_process_group(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM the process group we started, then SIGKILL what is left of it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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
        conn = _amqp_connection(run.amqp_url)
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


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
