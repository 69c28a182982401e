"""End to end, a network cut between a claim and its COMMIT (docs/relay.md, "A network cut").

One worker reaches the database through a proxy that stalls its connection right after the
server answered the claim (PostgreSQL: the claim statement; MariaDB/MySQL: the claim's last
statement, before its COMMIT), deterministically: the proxy reads the statement's text and
holds the client's next packet, and everything the server sends, for the whole cut. The
other worker, connected directly, must keep every aggregate moving within seconds; after the
cut nothing is lost and the order holds. Before the bounds, the stalled session's row locks
(an uncommitted claim: not a lease) held the aggregates of its claim for the whole cut.

Real ``celery -A outbox worker`` / ``beat`` processes; helpers: tests/relay_e2e_support.py.
Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from relay_e2e_support import Destination, Outbox, Proxy, Writer, Written, check_order, relay_env, wait_until

from outbox import Status

#: How long the cut lasts.
CUT_S = 30.0
#: The longest an aggregate may go without a delivery during the cut (the bounds give about
#: 5 s: the idle-transaction timeout, or the test's 4 s lease; this leaves room for a busy machine).
STAND_STILL_BOUND_S = 15.0
#: The text of the statement the cut follows (the claim's last one), per engine.
MARKERS = {
    "postgresql": b"FOR UPDATE OF c SKIP LOCKED",  # the claim: one statement
    "mysql": b"trace_id, attempts, created_at, status FROM",  # the claim's last read, before COMMIT
}
PORTS = {"postgresql": 5432, "mysql": 3306}
AGGREGATES = [f"cut-{i}" for i in range(20)]


@pytest.fixture(params=sorted(MARKERS))
def server_outbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outbox]:
    o = Outbox(request.param, tmp_path)
    yield o
    o.drop()


def longest_stand_still(arrived_at: Mapping[int, float], written: Mapping[int, Written], start: float,
                        end: float) -> tuple[float, str]:
    """The longest time, within ``[start, end]``, that an aggregate went without a first
    arrival, and which aggregate: the writer commits an event on every aggregate every round,
    so each one always has events waiting."""
    times: dict[str, list[float]] = defaultdict(list)
    for outbox_id, event in written.items():
        at = arrived_at.get(outbox_id)
        if at is not None and start <= at <= end:
            times[event.aggregate].append(at)
    worst = (0.0, "")
    for aggregate in sorted({event.aggregate for event in written.values()}):
        points = [start, *sorted(times[aggregate]), end]
        worst = max(worst, (max(b - a for a, b in zip(points, points[1:])), aggregate))
    return worst


def test_a_cut_between_the_claim_and_its_commit_holds_no_aggregate_for_long(
        tmp_path: Path, destination: Destination, server_outbox: Outbox, procs_factory: Any) -> None:
    outbox = server_outbox
    proxy = Proxy(target=("127.0.0.1", PORTS[outbox.kind]))
    try:
        backlog = Writer(outbox, AGGREGATES)
        backlog.write(range(30))  # 600 rows: the stalled worker's first claim takes 100 of them
        # A short lease: the rows of a claim that did commit come back within seconds (the
        # lease's own length is the business of docs/relay.md, "What a crash costs, and how to size the lease").
        procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_TIMEOUT_MS="4000"))
        stall = proxy.stall_after(MARKERS[outbox.kind], CUT_S)
        with Writer(outbox, AGGREGATES, pace=0.2, expected=backlog.expected) as live:
            procs.worker("cut", concurrency=1, OUTBOX_DATABASE_URL=proxy.url_for(outbox.url))
            procs.beat()
            assert stall.began.wait(60), f"the stalled worker never claimed\n{procs.log('cut')[-3000:]}"
            procs.worker("direct", concurrency=2)
            assert wait_until(lambda: " ready." in procs.log("direct"), timeout=60), procs.log("direct")[-3000:]
            start, end = time.time(), stall.began_at + CUT_S
            assert end - start > 2 * STAND_STILL_BOUND_S / 3, "the direct worker took most of the cut to start"
            destination.wait_for(lambda: time.time() > end, timeout=CUT_S + 5, procs=procs)
        written = {**backlog.written, **live.written}
        worst, aggregate = longest_stand_still(destination.arrived_at, written, start, end)
        print(f"\n{outbox.kind}: longest stand-still of an aggregate during the cut: {worst:.1f} s ({aggregate}), "
              f"over {end - start:.1f} s with the direct worker live")
        assert worst < STAND_STILL_BOUND_S, (
            f"{aggregate} had no delivery for {worst:.1f} s of the {end - start:.1f} s cut\n"
            f"{procs.log('direct')[-3000:]}")
        # After the cut: nothing lost, the order held (duplicates allowed), every row done.
        destination.wait_for(lambda: destination.arrived() >= set(written), timeout=90, procs=procs)
        assert destination.arrived() >= set(written), f"{len(set(written) - destination.arrived())} never arrived"
        check_order(destination.arrivals(), live.expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=30), (
            outbox.status_counts())
    finally:
        proxy.close()
