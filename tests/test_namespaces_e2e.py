"""Two outboxes on one broker (docs/relay.md, "Several outboxes on one broker"): two relays of
different tables, A and B, share one Redis key space as Celery's broker (or, a second run,
RabbitMQ's vhost as Celery's broker too; a third, Redis as Dramatiq's broker) and one RabbitMQ vhost, each with its own destination
exchange, while both applications write. Neither waits for the
other, and no event reaches the other's exchange. Then the last line of defence: a task that
names another outbox, put straight into A's queue, is not run by A's worker but handed to B's
queue, where B's worker runs it.

Real processes throughout (``celery -A outbox worker`` and ``beat`` per relay), PostgreSQL for
both tables. Skipped when a service is absent, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relay_e2e_support import (
    CELERY as CELERY_BIN,
)
from relay_e2e_support import (
    Destination,
    Outbox,
    Procs,
    Writer,
    check_order,
    delete_relay_names_on_rabbitmq,
    dramatiq_scheduler_keys,
    queued_celery_messages,
    relay_env,
    require_relay_services,
    wait_until,
)
from runners import CELERY, DRAMATIQ
from services import AMQP_URL, REDIS_URL

from outbox import Status

#: Generous: on one broker with global names B's events waited up to 58 s (issue 19, item 3);
#: with a 1 s tick and post-commit wake-ups an event takes well under a second.
LIVENESS_S = 10.0


class TimedDestination(Destination):
    """A destination that records when each message was taken off its queue."""

    def __init__(self) -> None:
        self.arrived_at: dict[int, float] = {}
        super().__init__()

    def _on_message(self, body: Any, message: Any) -> None:
        self.arrived_at.setdefault(int(message.headers["outbox_id"]), time.time())
        super()._on_message(body, message)


class Relay:
    """One outbox's relay (worker + beat) in a directory of its own, and its destination."""

    def __init__(self, name: str, root: Path, prefix: str, broker: str) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir()
        self.outbox = Outbox("postgresql", self.dir)
        self.destination = TimedDestination()
        # Inline publishing off: every claimed row travels in a publish task through the shared
        # broker (with it on, a small claim publishes its rows itself and never meets the other relay).
        self.runner = DRAMATIQ if broker == "dramatiq" else CELERY
        self.env = relay_env(self.dir, self.destination, self.outbox, self.runner, OUTBOX_CLAIM_INTERVAL_S="1",
                             OUTBOX_RELAY_INLINE_ROWS="0")
        # One Celery key space for both relays, as on one Redis database: the same key prefix.
        (self.dir / "relayconf.py").write_text(f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
        self.env.update({"OUTBOX_TEST_REDIS_PREFIX": prefix, **self.runner.env(REDIS_URL, prefix)})
        if broker == "amqp":  # Celery's broker in the destinations' vhost too
            self.env["OUTBOX_CELERY_BROKER_URL"] = AMQP_URL
        self.procs = Procs(self.dir, self.env, self.runner)

    def aggregates(self, n: int = 4) -> list[str]:
        return [f"{self.name}-{i}" for i in range(n)]

    def start(self, beat: bool = True, concurrency: int = 2) -> None:
        self.procs.worker("worker", concurrency=concurrency)
        if beat:
            self.procs.beat()

    def ready(self) -> bool:
        return (" ready." if self.runner is CELERY else "ready for action") in self.procs.log("worker")

    def close(self) -> None:
        self.procs.stop_all()
        try:
            delete_relay_names_on_rabbitmq(self.env)  # when RabbitMQ is Celery's broker
        finally:
            self.destination.close()
            self.outbox.drop()


@pytest.fixture(params=["redis"])
def two_relays(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Relay, Relay]]:
    """Two relays on one task runner's broker: one Redis key space for Celery (``params``: or
    RabbitMQ, the destinations' vhost, or Redis for Dramatiq, for the test that asks for it
    with ``indirect``)."""
    require_relay_services()
    prefix = f"outbox-test-{uuid.uuid4().hex[:10]}:"
    relays: list[Relay] = []
    try:
        relays = [Relay("a", tmp_path, prefix, request.param), Relay("b", tmp_path, prefix, request.param)]
        if request.param == "dramatiq":
            pytest.importorskip("dramatiq")
        yield relays[0], relays[1]
    finally:
        # Every relay's processes die first, whatever the cleanup of another raises (a relay
        # left running would outlive the test, consuming the shared broker).
        for relay in relays:
            relay.procs.stop_all()
        for relay in relays:
            relay.close()
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        # The Dramatiq schedulers' lock and records are not under the prefix (dramatiq_scheduler_keys).
        for pattern in [f"{prefix}*", *(f"{key}*" for key in dramatiq_scheduler_keys([r.procs for r in relays]))]:
            for key in client.scan_iter(match=pattern):
                client.delete(key)


def drain(*destinations: Destination, seconds: float) -> None:
    """Take what arrives on every destination for ``seconds`` (arrival times are recorded)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for d in destinations:
            d.wait_for(lambda: False, timeout=0.1)


@pytest.mark.parametrize("two_relays", ["redis", "amqp", "dramatiq"], indirect=True)
def test_two_relays_on_one_broker_neither_wait_for_nor_leak_into_each_other(
        two_relays: tuple[Relay, Relay]) -> None:
    a, b = two_relays
    a.start()
    b.start()
    assert wait_until(lambda: a.ready() and b.ready(), timeout=60), (a.procs.log("worker")[-3000:],
                                                                      b.procs.log("worker")[-3000:])
    writers = [Writer(relay.outbox, relay.aggregates(), pace=0.05) for relay in (a, b)]
    with writers[0], writers[1]:
        drain(a.destination, b.destination, seconds=8)
    assert writers[0].written and writers[1].written
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(relay.destination.arrived() >= set(writer.written)
                                                  for relay, writer in zip((a, b), writers)):
        drain(a.destination, b.destination, seconds=0.5)  # both at once: arrival times stay true
        a.procs.check_alive()
        b.procs.check_alive()
    for relay, other, writer in ((a, b, writers[0]), (b, a, writers[1])):
        arrivals = relay.destination.arrivals()
        # No event of the other outbox on this exchange: every aggregate is this outbox's own.
        foreign = sorted({aggregate for _, aggregate, _ in arrivals if not aggregate.startswith(f"{relay.name}-")})
        assert not foreign, f"events of outbox {other.name} reached {relay.name}'s exchange: {foreign}"
        check_order(arrivals, writer.expected)
        waits = {id: relay.destination.arrived_at[id] - w.at for id, w in writer.written.items()}
        slowest = max(waits, key=waits.__getitem__)
        assert waits[slowest] < LIVENESS_S, (
            f"{relay.name}: event {slowest} waited {waits[slowest]:.1f} s "
            f"({sum(1 for s in waits.values() if s >= LIVENESS_S)} of {len(waits)} waited {LIVENESS_S:g} s or more)")
        assert wait_until(lambda relay=relay: set(relay.outbox.statuses().values()) == {Status.DONE}, timeout=10), (
            relay.outbox.status_counts())


def test_a_task_naming_another_outbox_is_handed_to_its_queue_not_run(two_relays: tuple[Relay, Relay]) -> None:
    """B's rows, claimed and packed into a publish task naming B, are put straight into A's
    publish queue (as a misrouted message would be). A's worker does not publish them (nothing
    reaches A's exchange; B's rows stay claimed), says so once for two such tasks, and hands
    them to B's publish queue; B's worker, started later, publishes them to B's exchange."""
    from celery import Celery

    from outbox.core.config import load_settings
    from outbox.core.model import message_to_dict

    a, b = two_relays
    with b.outbox.writer() as conn:
        expected = {"b-0": [b.outbox.add(conn, "b-0", n) for n in range(2)], "b-1": [b.outbox.add(conn, "b-1", 0)]}
        conn.commit()
    ids = set(expected["b-0"] + expected["b-1"])
    claim = b.outbox.store.claim(10)
    assert {m.id for m in claim.messages} == ids
    chains = [[m for m in claim.messages if m.aggregate_id == aggregate] for aggregate in expected]
    a_queues, b_ns = load_settings(environ=a.env).queues, load_settings(environ=b.env).outbox_namespace
    assert b_ns != a_queues.namespace

    a.start(beat=False, concurrency=1)  # one process: a refusal is logged once per process
    assert wait_until(a.ready, timeout=60), a.procs.log("worker")[-3000:]
    sender = Celery(broker=a.env["OUTBOX_CELERY_BROKER_URL"],
                    broker_transport_options={"global_keyprefix": a.env["OUTBOX_TEST_REDIS_PREFIX"]})
    try:
        for chain in chains:  # two tasks, one chain (aggregate) each
            sender.send_task("outbox.publish", kwargs={"chains": [[message_to_dict(m) for m in chain]],
                                                       "deadline": None, "outbox": b_ns}, queue=a_queues.publish)
        b_publish = load_settings(environ=b.env).queues.publish
        assert wait_until(lambda: queued_celery_messages(b.env, b_publish) == 2, timeout=30), a.procs.log("worker")
    finally:
        sender.close()
    def refusals() -> list[str]:
        return [line for line in a.procs.log("worker").splitlines()
                if "refused a outbox.publish task of outbox" in line]

    assert wait_until(lambda: len(refusals()) >= 1 and a.procs.log("worker").count("succeeded") >= 2, timeout=10)
    assert len(refusals()) == 1 and b_ns in refusals()[0], a.procs.log("worker")[-3000:]
    a.destination.wait_for(lambda: False, timeout=1)
    assert a.destination.messages == []
    assert set(b.outbox.statuses().values()) == {Status.CLAIMED}

    b.start(beat=False)
    b.destination.wait_for(lambda: b.destination.arrived() == ids, timeout=30, procs=b.procs)
    check_order(b.destination.arrivals(), expected)
    assert wait_until(lambda: set(b.outbox.statuses().values()) == {Status.DONE}, timeout=10), (
        b.outbox.status_counts())
    a.destination.wait_for(lambda: False, timeout=0.5)
    assert a.destination.messages == []


def test_the_projects_own_celery_app_on_the_same_broker_cannot_remote_control_the_relay(
        tmp_path: Path, procs_factory: Any) -> None:
    """A project's own Celery app on the relay's broker (its default Redis database, no key
    prefix of its own) shared Celery's remote control with the relay: ``celery -A proj control
    shutdown``, meant for the project's workers, stopped the relay's too ("Got shutdown from
    remote"; found in review). The relay's workers answer remote control on their outbox's own
    exchange, which ``celery -A outbox inspect|control`` uses."""
    require_relay_services()
    outbox = Outbox("postgresql", tmp_path)
    try:
        env = relay_env(tmp_path, None, outbox, OUTBOX_PUBLISH_URL="memory://")
        procs = procs_factory(env)
        procs.worker("w1")
        assert wait_until(lambda: " ready." in procs.log("w1"), timeout=30), procs.log("w1")[-3000:]
        from celery import Celery

        proj = Celery("proj", broker=REDIS_URL, set_as_current=False)
        proj.conf.broker_transport_options = {"global_keyprefix": env["OUTBOX_TEST_REDIS_PREFIX"]}
        assert proj.control.ping(timeout=1.5) == []
        proj.control.broadcast("shutdown")
        time.sleep(2)
        procs.check_alive()
        assert "Got shutdown from remote" not in procs.log("w1")
        ping = subprocess.run([CELERY_BIN, "-A", "outbox", "inspect", "ping", "-t", "5"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert "pong" in ping.stdout, ping.stdout + ping.stderr
    finally:
        outbox.drop()
