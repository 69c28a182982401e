"""End to end, a lost worker does not freeze the outbox (docs/internals.md, "Lost workers"): two
workers drain a backlog over 30 aggregates while a writer goes on; one worker's whole process
group is SIGKILLed mid-drain (a node lost, no restart). With the default lease of a minute,
the rows it held come back within seconds: every event arrives, in order per aggregate, the
takeover is logged, and no aggregate stands still for long. A slow worker that stays alive
keeps its leases: nothing is taken over, nothing is sent twice.

Real ``celery -A outbox worker`` / ``beat`` processes (and Dramatiq's, tests/runners.py) on
SQLite, PostgreSQL and MariaDB/MySQL; helpers and fixtures: tests/relay_e2e_support.py.
Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from relay_e2e_support import (
    Destination,
    Outbox,
    Proxy,
    Writer,
    check_order,
    longest_stand_still,
    relay_env,
    require_relay_services,
    wait_until,
    where_claims_stopped,
)
from runners import CELERY, DRAMATIQ

from outbox import Status

#: A generous bound on any aggregate's stand-still after the kill: the lease is 60 s, the
#: holder timeout 3 s (docs/relay.md, "What a crash costs, and how to size the lease", has the measured figures).
STAND_STILL_BOUND_S = 20.0
AGGREGATES = [f"agg-{i}" for i in range(30)]


def holders_of_group(outbox: Outbox, pgid: int) -> list[str]:
    """The holder ids of the processes of group ``pgid`` (a worker and its pool)."""
    engine = outbox.store.engine
    with outbox.store.transaction() as cursor:
        rows = engine.execute(cursor, f"SELECT holder_id, pid FROM {engine.holders}").fetchall()
    return [str(h).strip() for h, pid in rows if _group_of(int(pid)) == pgid]


def rows_held_by(outbox: Outbox, holders: list[str]) -> int:
    """Rows leased by these holders (a lease token starts with its holder's id)."""
    if not holders:
        return 0
    engine = outbox.store.engine
    where = " OR ".join("lease_token LIKE ?" for _ in holders)
    with outbox.store.transaction() as cursor:
        return int(engine.execute(cursor, f"SELECT COUNT(*) FROM {engine.table} WHERE status = 1 AND ({where})",
                                  [h + "%" for h in holders]).fetchone()[0])


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture(params=[("celery", "sqlite"), ("celery", "postgresql"), ("celery", "mysql"),
                        ("dramatiq", "postgresql"), ("celery", "postgresql", "claim-ahead")], ids=lambda p: "-".join(p))
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """The runner, the outbox and the workers' extra settings: "claim-ahead" turns on
    OUTBOX_RELAY_CLAIM_AHEAD, so rows claimed ahead are among those the lost worker held."""
    runner_name, kind, *extra = request.param
    if runner_name == "dramatiq":
        pytest.importorskip("dramatiq")
    require_relay_services()
    outbox = Outbox(kind, tmp_path)
    env = {"OUTBOX_RELAY_CLAIM_AHEAD": "true"} if "claim-ahead" in extra else {}
    yield (CELERY if runner_name == "celery" else DRAMATIQ), outbox, env
    outbox.drop()


def kill_while_holding(procs: Any, outbox: Outbox, proxy: Proxy) -> tuple[list[str], float]:
    """SIGKILL w1's process group while a process of it holds leased rows (its holders' pids
    are in the group); return those holders and when. A statement w1 sent just before the kill
    still runs (the server finishes what it received), so a mark-done in flight can settle the
    rows a moment later: they are counted again after a pause, and when none is held any more,
    another w1 is started and killed, up to three times."""
    for attempt in range(3):
        name = "w1" if attempt == 0 else f"w1-{attempt}"
        if attempt:
            procs.worker(name, OUTBOX_PUBLISH_URL=proxy.amqp_url)
        pid = procs.procs[name].pid
        assert wait_until(lambda pid=pid: rows_held_by(outbox, holders_of_group(outbox, pid)) > 0, timeout=30,
                          interval=0.01), f"{name} never held rows\n{procs.log(name)[-3000:]}"
        lost = holders_of_group(outbox, pid)
        procs.kill(name)  # the whole process group: main process and pool
        killed_at = time.monotonic()
        time.sleep(0.5)
        if rows_held_by(outbox, lost) > 0:
            return lost, killed_at
    raise AssertionError("three times, the rows w1 held were settled by statements it sent before the kill")


def test_a_lost_worker_stalls_no_aggregate_for_the_lease(tmp_path: Path, destination: Destination, setup: Any,
                                                         procs_factory: Any, request: pytest.FixtureRequest) -> None:
    runner, outbox, env = setup
    procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, **env), runner)
    writer = Writer(outbox, AGGREGATES, pace=0.05)
    writer.write(range(100))  # the backlog: 3,000 events
    # w1 reaches RabbitMQ through a proxy that delays each reply by 20 ms: a wave of confirms
    # takes that long, so w1 holds its leased rows for a while and the kill finds it holding some.
    proxy = Proxy(delay=0.02)
    request.addfinalizer(proxy.close)
    procs.worker("w1", OUTBOX_PUBLISH_URL=proxy.amqp_url)
    procs.worker("w2")
    procs.beat()
    with writer:  # the application goes on writing, 30 events every 50 ms or so
        destination.wait_for(lambda: len(destination.messages) >= 500, timeout=40, procs=procs)
        assert len(destination.messages) >= 500, procs.log("w1")[-3000:]
        lost, killed_at = kill_while_holding(procs, outbox, proxy)
        destination.wait_for(lambda: False, timeout=3.0)
    total = len(writer.written)
    destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=40, procs=procs)
    assert len(destination.arrived()) == total, (
        f"{len(destination.arrived())} of {total} arrived\n{outbox.open_rows_report(procs)}\n"
        f"w2's last claims:\n{where_claims_stopped(procs.log('w2'))}")
    check_order(destination.arrivals(), writer.expected)
    waited, aggregate = longest_stand_still(destination, killed_at)
    log = procs.log("w2")
    taken = [line for line in log.splitlines() if "of a lost worker process (holder " in line]
    assert taken and all(line.split("(holder ")[1][:16] in lost for line in taken), log[-4000:]
    assert waited < STAND_STILL_BOUND_S, f"{aggregate} stood still for {waited:.1f} s\n{log[-4000:]}"
    assert max(m.headers["attempt"] for _, _, m in destination.arrivals()) >= 2  # taken over: attempt counted
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), (
        outbox.status_counts())


def test_a_slow_worker_keeps_its_leases(tmp_path: Path, destination: Destination, procs_factory: Any) -> None:
    """Publish tasks that take far longer than the holder timeout (each confirm 50 ms late,
    chains of 40 events: 2 s a chain, against a timeout of 0.6 s) on a worker that is alive:
    its heartbeat goes on in its own thread, so nothing is taken over and nothing is sent twice."""
    require_relay_services()
    outbox = Outbox("postgresql", tmp_path)
    proxy = Proxy(delay=0.05)
    try:
        procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_PUBLISH_URL=proxy.amqp_url,
                                        OUTBOX_RELAY_HOLDER_TIMEOUT_S="0.6"))
        writer = Writer(outbox, [f"slow-{i}" for i in range(6)])
        writer.write(range(40))
        procs.worker("w1")
        procs.worker("w2")
        procs.beat()
        total = len(writer.written)
        destination.wait_for(lambda: len(destination.messages) >= total, timeout=50, procs=procs)
        assert len(destination.messages) == total, procs.log("w1")[-3000:]  # nothing twice
        check_order(destination.arrivals(), writer.expected)
        assert {m.headers["attempt"] for _, _, m in destination.arrivals()} == {1}
        for name in ("w1", "w2"):
            assert "took over" not in procs.log(name) and "presumed lost" not in procs.log(name)
    finally:
        proxy.close()
        outbox.drop()
