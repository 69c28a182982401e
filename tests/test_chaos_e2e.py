"""Chaos, end to end: a bounded run of random faults against a relay that works all along
(docs/relay.md, "The chaos run").

Two workers and the scheduler reach the outbox's database, Celery's (or Dramatiq's) Redis
and RabbitMQ through TCP proxies, while a writer commits (and rolls back) events on 24
aggregates. For ``OUTBOX_CHAOS_SECONDS`` (default 30) a seeded random sequence of faults
hits them, one at a time: a worker SIGKILLed with its pool, a worker given a warm shutdown,
the scheduler killed, a connection cut (every link dropped, new ones refused) to the
database, Redis or RabbitMQ, and the database's or RabbitMQ's answers held back (a stalled
network path). Each fault lasts 0.5-4 s; killed and stopped processes are replaced. Then
every fault ends and the test asks what a user would: every committed event arrived, in
order per aggregate (duplicates allowed), none rolled back did, every row is done (none
dead-lettered by faults that were only transient), and every worker told to stop did stop.

`make test` runs it for 30 s (``OUTBOX_CHAOS_SECONDS``; 0 skips it) on PostgreSQL with Celery
and MariaDB with Dramatiq; OUTBOX_CHAOS_MATRIX=full runs all four pairs. The seed is printed
with the faults: ``OUTBOX_CHAOS_SEED=<seed>`` replays the same sequence (the timing of the
processes differs from run to run). Real ``celery -A outbox worker`` / ``beat`` processes
(and Dramatiq's); helpers: tests/relay_e2e_support.py.
Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from relay_e2e_support import Destination, Outbox, Procs, Proxy, Writer, check_order, relay_env, wait_until
from runners import RUNNERS
from services import REDIS_URL

from outbox import Status

#: Seconds of faults: 30 in `make test`; ``OUTBOX_CHAOS_SECONDS=0`` skips the run, a longer one
#: makes a soak.
CHAOS_S = float(os.environ.get("OUTBOX_CHAOS_SECONDS") or 30)
AGGREGATES = [f"chaos-{i}" for i in range(24)]
PORTS = {"postgresql": 5432, "mysql": 3306}
#: How long a worker told to stop (SIGTERM) may take to exit: its tasks in hand are bounded
#: by the lease (4 s here) and the publish timeouts, so a minute is ample even on a busy machine.
STOP_BOUND_S = 60.0
#: At most this many faults at once.
MAX_AT_ONCE = 2


#: (engine, runner) pairs: each engine and each runner once in the suite; all four with
#: OUTBOX_CHAOS_MATRIX=full.
CASES = ([(kind, runner) for kind in sorted(PORTS) for runner in sorted(RUNNERS)]
         if os.environ.get("OUTBOX_CHAOS_MATRIX") == "full" else [("postgresql", "celery"), ("mysql", "dramatiq")])


@pytest.fixture(params=CASES, ids=["-".join(case) for case in CASES])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Outbox, Any]]:
    kind, runner = request.param
    if runner == "dramatiq":
        pytest.importorskip("dramatiq")
    o = Outbox(kind, tmp_path)
    yield o, RUNNERS[runner]
    o.drop()


class Chaos:
    """The relay's processes and the proxies in front of its services, and the faults that
    can befall them. Every fault is a method that breaks something and returns how to
    mend it."""

    def __init__(self, procs: Procs, proxies: dict[str, Proxy], rng: random.Random) -> None:
        self.procs = procs
        self.proxies = proxies
        self.rng = rng
        self.started = 0
        self.workers: list[str] = []
        self.beat = ""
        self.stopped: list[tuple[str, float]] = []  # (worker, when SIGTERM was sent)
        self.log: list[str] = []

    def start_worker(self) -> None:
        self.started += 1
        name = f"w{self.started}"
        self.procs.worker(name)
        self.workers.append(name)

    def start_beat(self) -> None:
        self.started += 1
        self.beat = f"beat{self.started}"
        self.procs.beat(self.beat)

    # -- the faults: each returns how to mend what it broke ----------------------------------

    def kill_worker(self) -> Callable[[], None]:
        name = self.workers.pop(self.rng.randrange(len(self.workers)))
        self.procs.kill(name)
        return self.start_worker

    def stop_worker(self) -> Callable[[], None]:
        name = self.workers.pop(self.rng.randrange(len(self.workers)))
        self.procs.stopped.add(name)
        self.procs.procs[name].send_signal(signal.SIGTERM)  # a warm shutdown; it may take a while
        self.stopped.append((name, time.monotonic()))
        return self.start_worker

    def kill_beat(self) -> Callable[[], None]:
        self.procs.kill(self.beat)
        return self.start_beat

    def cut(self, service: str) -> Callable[[], None]:
        self.proxies[service].cut()
        return self.proxies[service].restore

    def hold(self, service: str) -> Callable[[], None]:
        self.proxies[service].hold_replies()
        return self.proxies[service].release_replies

    def faults(self) -> dict[str, tuple[str | None, Callable[[], Callable[[], None]]]]:
        """Each fault: what it breaks (two faults at once never break the same service or the
        scheduler; None: workers, any number) and how to break it."""
        return {"kill a worker": (None, self.kill_worker), "stop a worker": (None, self.stop_worker),
                "kill the scheduler": ("scheduler", self.kill_beat),
                **{f"cut {s}": (s, lambda s=s: self.cut(s)) for s in self.proxies},
                **{f"hold {s}'s answers": (s, lambda s=s: self.hold(s)) for s in ("database", "rabbitmq")}}

    def run(self, seconds: float, destination: Destination) -> None:
        """Faults for ``seconds``: every 0.5-2 s a new one starts, unless ``MAX_AT_ONCE`` are
        under way, and lasts 0.5-8 s (at times longer than the lease and than the server's
        bound on an idle transaction). Two worker faults at once may leave no worker for a
        while. The destination's consumer is served meanwhile."""
        faults = self.faults()
        began = time.monotonic()
        end = began + seconds
        under_way: list[tuple[float, str | None, Callable[[], None]]] = []  # (when it ends, what, mend)
        next_at = began
        while under_way or time.monotonic() < end:
            now = time.monotonic()
            for fault in [f for f in under_way if now >= f[0]]:
                fault[2]()
                under_way.remove(fault)
            if now >= next_at and now < end and len(under_way) < MAX_AT_ONCE:
                busy = {what for _, what, _ in under_way if what is not None}
                free = [label for label, (what, _) in faults.items()
                        if what not in busy and (what is not None or self.workers)]
                label = free[self.rng.randrange(len(free))]
                what, fault = faults[label]
                lasts = self.rng.uniform(0.5, 8.0)
                self.log.append(f"{now - began:5.1f} s: {label} for {lasts:.1f} s")
                under_way.append((now + lasts, what, fault()))
                next_at = now + self.rng.uniform(0.5, 2.0)
            destination.wait_for(lambda: False, timeout=0.1, procs=self.procs)


def _describe_missing(outbox: Outbox, missing: list[int], tmp_path: Path, destination: Destination) -> None:
    """Print what the table says of some events that never arrived, the log lines that name
    their leases, and what RabbitMQ says of the queue (ready and unacknowledged messages)."""
    print("rabbitmq:", destination.rabbitmq_counts())
    with outbox.store.transaction() as cursor:
        rows = outbox.store.engine.execute(
            cursor, f"SELECT id, aggregate_id, status, attempts, lease_token, processed_at, claimed_at "
                    f"FROM {outbox.store.engine.table} WHERE id IN ({', '.join(map(str, missing[:20]))})").fetchall()
    print(f"\n{len(missing)} missing, from {missing[0]} to {missing[-1]}")
    for row in rows:
        print("  ", row)
    for lease in sorted({str(r[4]) for r in rows if r[4]})[:5]:
        for log in sorted(tmp_path.glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if lease[:12] in line:
                    print(f"   {log.name}: {line[:300]}")


@pytest.mark.slow
@pytest.mark.skipif(not CHAOS_S, reason="OUTBOX_CHAOS_SECONDS=0 (docs/relay.md, 'The chaos run')")
def test_a_relay_under_random_faults_loses_nothing_and_keeps_order(
        tmp_path: Path, destination: Destination, case: tuple[Outbox, Any], procs_factory: Any) -> None:
    outbox, runner = case
    seed = int(os.environ.get("OUTBOX_CHAOS_SEED") or random.SystemRandom().randrange(10**9))
    proxies = {"database": Proxy(target=("127.0.0.1", PORTS[outbox.kind])), "redis": Proxy(target=("127.0.0.1", 6379)),
               "rabbitmq": Proxy()}
    chaos: Chaos | None = None
    try:
        env = relay_env(tmp_path, destination, outbox, runner, OUTBOX_BATCH_SIZE="20", OUTBOX_RELAY_TASK_ROWS="5",
                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="4000",
                        OUTBOX_DATABASE_URL=proxies["database"].url_for(outbox.url),
                        OUTBOX_PUBLISH_URL=proxies["rabbitmq"].amqp_url)
        redis_url = proxies["redis"].url_for(REDIS_URL)
        for name in ("OUTBOX_CELERY_BROKER_URL", "OUTBOX_DRAMATIQ_BROKER_URL"):
            if name in env:
                env[name] = redis_url
        procs = procs_factory(env, runner)
        chaos = Chaos(procs, proxies, random.Random(seed))
        chaos.start_worker()
        chaos.start_worker()
        chaos.start_beat()
        with Writer(outbox, AGGREGATES, rollback_every=5, pace=0.05) as writer:
            destination.wait_for(lambda: len(destination.messages) >= 50, timeout=60, procs=procs)
            assert len(destination.messages) >= 50, procs.log("w1")[-3000:]
            chaos.run(CHAOS_S, destination)
        faults = "\n".join(chaos.log)
        print(f"\n{outbox.kind}, {runner.name}: OUTBOX_CHAOS_SEED={seed}, {len(chaos.log)} faults:\n{faults}")
        # Every fault has ended: whatever was committed arrives, in order, and every row is done.
        total = len(writer.written)
        destination.wait_for(lambda: destination.arrived() >= set(writer.written), timeout=180, procs=procs)
        missing = set(writer.written) - destination.arrived()
        if missing:
            _describe_missing(outbox, sorted(missing), tmp_path, destination)
        assert not missing, (f"seed {seed}: {len(missing)} of {total} never arrived, {outbox.status_counts()}, "
                             f"{destination.queued()} still queued\n"
                             f"{faults}\n{procs.log(chaos.workers[-1])[-3000:]}")
        check_order(destination.arrivals(), writer.expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=60), (
            f"seed {seed}: {outbox.status_counts()}\n{faults}")
        assert len(outbox.statuses()) == total  # nothing rolled back was stored
        for name, since in chaos.stopped:
            left = STOP_BOUND_S - (time.monotonic() - since)
            proc = procs.procs[name]
            assert wait_until(lambda proc=proc: proc.poll() is not None, timeout=max(left, 0.1)), (
                f"seed {seed}: {name} was told to stop and still runs after {STOP_BOUND_S:.0f} s\n"
                f"{procs.log(name)[-3000:]}")
        duplicates = len(destination.messages) - len(destination.arrived())
        print(f"{total} events, {duplicates} duplicates, most attempts {outbox.max_attempts()}")
    finally:
        for proxy in proxies.values():
            proxy.close()


def test_the_destination_consumes_again_when_it_holds_deliveries_it_never_read(destination: Destination) -> None:
    """The consumer's stall watch (``Destination._unstick``), which the chaos run relies on:
    messages RabbitMQ delivered to the consumer and it never read come back on a new
    connection, each once."""
    from kombu import Connection, Producer
    from services import AMQP_URL

    with Connection(AMQP_URL, connect_timeout=5) as conn:
        producer = Producer(conn.channel(), exchange=destination.exchange, routing_key="chaos.unread")
        for i in range(50):
            producer.publish(b"{}", headers={"outbox_id": i, "aggregate_id": "a"})
    if destination.rabbitmq_counts() is None:
        pytest.skip("rabbitmqctl cannot be run here: the stall watch is off")
    # Delivered to the consumer (within its prefetch), not read: nothing drains its connection
    # until then. RabbitMQ's counts are its statistics, refreshed every few seconds.
    assert wait_until(lambda: (destination.rabbitmq_counts() or {}).get("unacknowledged") == 50, timeout=30)
    destination._unstick()
    assert destination.unstuck == 1
    assert destination.wait_for(lambda: len(destination.messages) >= 50, timeout=30)
    assert sorted(destination.arrived()) == list(range(50))
    assert len(destination.messages) == 50  # none came twice
