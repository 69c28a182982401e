"""End to end, relaying: every committed event arrives in order per aggregate with the
contract's fields, poison and exhausted events go dead while everything else flows, and a
worker alone relays the embedded default. Real ``celery -A outbox worker`` / ``beat``
processes (and Dramatiq's, tests/runners.py) on SQLite, PostgreSQL and MariaDB/MySQL;
helpers and fixtures: tests/relay_e2e_support.py. What is lost when things fail and how it
comes back: tests/test_recovery_e2e.py.

Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set. The
in-memory test needs no service at all.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from relay_e2e_support import Destination, Outbox, Writer, base_env, check_contract, check_order, relay_env, wait_until

from outbox import Status


def test_worker_and_beat_relay_every_event_in_order(tmp_path: Path, destination: Destination, outbox: Outbox, runner: Any,
                                                     procs_factory: Any) -> None:
    """A backlog, then live writers, some of whose transactions roll back: every committed
    event arrives once, in order per aggregate, none rolled back does, and the messages
    are what the contract says."""
    expected: dict[str, list[int]] = {}
    rows: dict[int, dict[str, Any]] = {}
    aggregates = [f"agg-{i}" for i in range(6)]
    with outbox.writer() as conn:
        for n in range(12):  # a backlog before the relay starts: drain mode, several claims
            for aggregate in aggregates:
                headers = {"tenant": "acme", "n": n}
                outbox_id = outbox.add(conn, aggregate, n, headers=headers, key=f"pk-{aggregate}")
                expected.setdefault(aggregate, []).append(outbox_id)
                rows[outbox_id] = {"aggregate": aggregate, "n": n, "headers": headers}
        conn.commit()
        outbox.add(conn, "rolled-back", 0)
        conn.rollback()

    procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_BATCH_SIZE="25",
                                    OUTBOX_CLAIM_INTERVAL_S="0.3"), runner)
    procs.worker("w1")
    procs.beat()

    # Live writes while the relay runs, each commit followed by a rolled-back transaction.
    writer = Writer(outbox, aggregates[:3], rollback_every=1, pace=0.05, expected=expected)
    writer.write(range(12, 20))
    rows.update({i: {"aggregate": w.aggregate, "n": w.n, "headers": {}} for i, w in writer.written.items()})

    total = sum(len(ids) for ids in expected.values())
    destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=40, procs=procs)
    arrivals = destination.arrivals()
    assert len(destination.arrived()) == total, (
        f"{len(destination.arrived())} of {total} arrived\n{procs.log('w1')[-3000:]}")
    check_order(arrivals, expected)
    assert len(arrivals) == total  # no crash here: no duplicates either
    # The backlog's full claims published their first share themselves, on either runner
    # (docs/internals.md, "A backlog claim publishes its first share itself", "Drain slices").
    # Dramatiq's worker processes hand their log lines to the main process through a pipe: the
    # line may reach the log file a moment after the events reached the broker.
    shared_line = r"outbox claimed \d+ rows lease=\S+: \d+ in \d+ publish tasks, [1-9]\d* published here"
    assert wait_until(lambda: re.search(shared_line, procs.log("w1")), timeout=10), procs.log("w1")[-3000:]

    for outbox_id, aggregate, message in arrivals:
        row = rows[outbox_id]
        check_contract(message, outbox_id, aggregate, {"aggregate": aggregate, "n": row["n"], "text": "grüße"},
                       row["headers"], f"pk-{aggregate}" if row["headers"] else aggregate)

    # Every row is acknowledged in the table, and only the committed rows exist.
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()
    assert sorted(outbox.statuses()) == sorted(rows)


def test_poison_and_retriable_events_go_dead_while_everything_else_flows(
        tmp_path: Path, dead_letter_destination: Destination, outbox: Outbox, runner: Any, procs_factory: Any) -> None:
    """(a) An event the publisher classifies POISON (larger than
    OUTBOX_RELAY_MAX_MESSAGE_BYTES) goes dead at once, on its first attempt, and a stub of
    it reaches the dead-letter exchange; the event of its aggregate before it arrived, the
    ones after it arrive. (b) An event that keeps failing as RETRIABLE (unroutable: no queue
    is bound for its topic, and the unroutable policy is "fail") goes dead after
    OUTBOX_MAX_ATTEMPTS=2 and is dead-lettered; while it waits for its retry, events of
    other aggregates committed meanwhile arrive, and the rest of its own aggregate follows
    only once it is dead."""
    destination = dead_letter_destination
    others = [f"o-{i}" for i in range(3)]
    expected: dict[str, list[int]] = {a: [] for a in [*others, "p", "u"]}
    with outbox.writer() as conn:
        for n in range(3):
            for aggregate in others:
                expected[aggregate].append(outbox.add(conn, aggregate, n))
        p1 = outbox.add(conn, "p", 1)
        p2 = outbox.add(conn, "p", 2, payload={"blob": "x" * 6000})  # above the 4096-byte limit
        p3, p4 = outbox.add(conn, "p", 3), outbox.add(conn, "p", 4)
        u1 = outbox.add(conn, "u", 1)
        u2 = outbox.add(conn, "u", 2, topic="unbound.u.changed")  # no queue is bound for it
        u3, u4 = outbox.add(conn, "u", 3), outbox.add(conn, "u", 4)
        conn.commit()
    expected["p"] += [p1, p3, p4]
    expected["u"] += [u1, u3, u4]

    # Backoff 4 s: u2's retry comes 2 to 4 s after its first failure (equal jitter).
    procs = procs_factory(relay_env(
        tmp_path, destination, outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_MAX_ATTEMPTS="2",
        OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or "", OUTBOX_RELAY_MAX_MESSAGE_BYTES="4096",
        OUTBOX_RELAY_BACKOFF_BASE_S="4", OUTBOX_RELAY_BACKOFF_MAX_S="4"), runner)
    procs.worker("w1")
    procs.beat()

    def u2_state() -> tuple[int, int]:
        row = outbox.rows()[u2]
        return row["status"], row["attempts"]

    # (a) poison: dead at once, on the dead-letter exchange; p1 before, p3 and p4 after.
    assert destination.wait_for(lambda: {p1, p3, p4} <= destination.arrived() and len(destination.dead) >= 1,
                                timeout=20, procs=procs), procs.log("w1")[-3000:]
    assert p2 not in destination.arrived()
    rows = outbox.rows()
    assert (rows[p2]["status"], rows[p2]["attempts"]) == (Status.DEAD, 1)
    assert rows[p2]["last_error"].startswith("poison: message size") and "4096" in rows[p2]["last_error"]
    [dead_p2] = [m for m in destination.dead if m.headers["outbox_id"] == p2]
    assert dead_p2.body in (b"", "") and dead_p2.headers["aggregate_id"] == "p"
    assert dead_p2.headers["x-outbox-error"].startswith("poison: message size")
    assert "above the maximum of 4096 bytes" in dead_p2.headers["x-outbox-omitted"]
    assert dead_p2.headers["attempt"] == 1 and dead_p2.delivery_info["routing_key"] == "orders.p.changed"

    # (b) u2 failed once (unroutable: retriable, an attempt spent) and waits for its retry;
    # u1 went before it, u3 and u4 wait behind it.
    assert wait_until(lambda: u2_state() == (Status.FAILED, 1), timeout=10), (u2_state(), procs.log("w1")[-3000:])
    assert "unroutable" in outbox.rows()[u2]["last_error"]
    assert destination.wait_for(lambda: u1 in destination.arrived(), timeout=5)
    assert not {u3, u4} & destination.arrived()
    # Meanwhile everything else flows: a burst committed now arrives while u2 still waits.
    with outbox.writer() as conn:
        burst = {aggregate: outbox.add(conn, aggregate, 10) for aggregate in [*others, "p"]}
        conn.commit()
    for aggregate, outbox_id in burst.items():
        expected[aggregate].append(outbox_id)
    assert destination.wait_for(lambda: set(burst.values()) <= destination.arrived(), timeout=10, procs=procs)
    assert u2_state() == (Status.FAILED, 1), "u2 went dead before the burst arrived: the test proves nothing"
    assert not {u3, u4} & destination.arrived()

    # Its second failure is its last (OUTBOX_MAX_ATTEMPTS=2): dead, dead-lettered, and u3, u4 follow.
    assert destination.wait_for(lambda: {u3, u4} <= destination.arrived() and len(destination.dead) >= 2,
                                timeout=20, procs=procs), (u2_state(), procs.log("w1")[-3000:])
    assert wait_until(lambda: outbox.statuses()[u3] == Status.DONE, timeout=10)  # its ack follows its arrival
    rows = outbox.rows()
    assert (rows[u2]["status"], rows[u2]["attempts"]) == (Status.DEAD, 2)
    assert rows[u2]["last_error"].startswith("retriable: unroutable: no queue bound for routing key 'unbound.u.changed'")
    assert rows[u3]["processed_at"] >= rows[u2]["processed_at"]  # u3 was done only after u2 was dead
    [dead_u2] = [m for m in destination.dead if m.headers["outbox_id"] == u2]
    assert json.loads(dead_u2.body) == {"aggregate": "u", "n": 2, "text": "grüße"}  # a whole copy
    assert dead_u2.headers["attempt"] == 2 and dead_u2.headers["x-outbox-error"].startswith("retriable: unroutable")
    assert dead_u2.delivery_info["routing_key"] == "unbound.u.changed"
    assert u2 not in destination.arrived()

    check_order(destination.arrivals(), expected)
    arrivals = destination.arrivals()
    assert len(arrivals) == len(destination.arrived())  # no duplicates
    attempts = {outbox_id: m.headers["attempt"] for outbox_id, _, m in arrivals}
    assert set(attempts.values()) == {1}  # released rows (p3, p4, u3, u4) spent no attempt
    assert sorted(m.headers["outbox_id"] for m in destination.dead) == sorted([p2, u2])
    assert wait_until(lambda: sorted(outbox.statuses().values()).count(Status.DONE) == len(arrivals), timeout=10)
    assert outbox.status_counts() == {"DONE": len(arrivals), "DEAD": 2}


def test_worker_alone_relays_the_embedded_default(tmp_path: Path, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """No service at all: SQLite, in-memory Celery broker and destination. The worker runs
    a thread pool and the schedule itself, and every row ends up done."""
    outbox = sqlite_outbox
    with outbox.writer() as conn:
        ids = [outbox.add(conn, f"m-{i % 3}", i) for i in range(30)]
        conn.commit()
    procs = procs_factory(base_env(outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_BATCH_SIZE="8"))
    procs.start("solo", "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                "--without-heartbeat")

    def done() -> bool:
        procs.check_alive()
        return [outbox.statuses().get(i) for i in ids] == [Status.DONE] * len(ids)

    assert wait_until(done, timeout=30), f"{outbox.statuses()}\n{procs.log('solo')[-3000:]}"
    assert "runs the schedule itself" in procs.log("solo")


#: Beat's claim ticks as a worker whose clock runs two minutes ahead of the scheduler's sees
#: them, each 90 s past its expiry (a tick expires 30 s after it is sent), until the file
#: ``argv[2]`` exists; then ticks in time. ``argv[1]``: the runner.
LATE_TICKS = r"""
import os, sys, time
from datetime import UTC, datetime, timedelta

if sys.argv[1] == "celery":
    from outbox.celery.application import send_relay_task
    from outbox.core.names import CLAIM_TASK, TICK_KWARGS

    def tick(offset_s):
        send_relay_task(CLAIM_TASK, dict(TICK_KWARGS), expires=datetime.now(UTC) + timedelta(seconds=offset_s))
else:
    from outbox.core.config import startup_options
    from outbox.dramatiq import brokers
    from outbox.dramatiq.scheduler import schedule_entries

    actor, queue, _, _, kwargs = schedule_entries(*startup_options())[0]

    def tick(offset_s):
        brokers.sender().enqueue(brokers.message(actor, queue, {**kwargs, "expires_at": time.time() + offset_s}))
for n in range(400):
    tick(30 if os.path.exists(sys.argv[2]) else -90)
    print("sent", n + 1, flush=True)
    time.sleep(0.5)
"""


def test_a_worker_whose_clock_runs_ahead_of_the_schedulers_says_why_it_claims_nothing(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, runner: Any, procs_factory: Any) -> None:
    """A tick's expiry is reckoned on the scheduler's clock and checked on the worker's: a worker
    host two minutes ahead dropped every tick, each a DEBUG line, and its rows waited for ever
    while the Celery heartbeat counted the ticks as received (on Dramatiq nothing at all). Now one
    WARNING after ten claim intervals (at least 10 s) of expired claims, naming the clocks; and one
    INFO line when ticks arrive in time again, which then deliver."""
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.5",
                                    OUTBOX_RELAY_WAKE="0"), runner)
    procs.worker("w1")
    assert wait_until(lambda: "ready" in procs.log("w1"), timeout=60), procs.log("w1")[-3000:]
    in_time = tmp_path / "in-time"
    procs.spawn("ticks", [sys.executable, "-c", LATE_TICKS, runner.name, str(in_time)])
    warning = "outbox: every claim tick and claim request that reached this worker for"
    assert wait_until(lambda: warning in procs.log("w1"), timeout=60), (
        f"{procs.log('w1')[-3000:]}\n--- ticks\n{procs.log('ticks')[-1000:]}")
    assert re.search(r"had expired \(the last (8\d|9\d) s past its expiry, by this host's clock\).*synchronise the "
                     r"clocks \(NTP\)", procs.log("w1")), procs.log("w1")[-3000:]
    with sqlite_outbox.writer() as conn:
        outbox_id = sqlite_outbox.add(conn, "late", 0)
        conn.commit()
    time.sleep(2)
    assert sqlite_outbox.statuses() == {outbox_id: Status.PENDING}  # no claim runs on expired ticks

    in_time.touch()
    assert destination.wait_for(lambda: len(destination.arrived()) == 1, timeout=30, procs=procs), \
        procs.log("w1")[-3000:]
    assert wait_until(lambda: "claim ticks reach this worker before their expiry again" in procs.log("w1"),
                      timeout=10), procs.log("w1")[-3000:]
    # Once per run of expired claims in each worker process that dropped them (Celery's main
    # process; each of Dramatiq's processes).
    assert 1 <= procs.log("w1").count(warning) <= 2, procs.log("w1")[-3000:]
