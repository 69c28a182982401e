"""End to end, nothing lost when things fail: a worker SIGKILLed mid-run, a lost claim,
publish tasks lost in Celery's broker, acks that never land (and are fenced when late), a
broker outage, and a warm shutdown that finishes the tasks in hand. Real ``celery -A outbox
worker`` / ``beat`` processes (and Dramatiq's, tests/runners.py) on SQLite, PostgreSQL and
MariaDB/MySQL; helpers and fixtures: tests/relay_e2e_support.py.

Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from publisher_support import install_killer
from relay_e2e_support import (
    Destination,
    Outbox,
    Proxy,
    Writer,
    check_order,
    lose_celery_messages,
    queued_celery_messages,
    relay_env,
    relay_queue,
    relay_queues,
    wait_until,
)

from outbox import Status

# -- a worker killed, a claim lost -------------------------------------------------------------

def test_a_worker_killed_mid_run_loses_nothing(tmp_path: Path, destination: Destination, outbox: Outbox, runner: Any,
                                               procs_factory: Any) -> None:
    """Two workers (four processes) relay while writers commit (and roll back); one worker
    is SIGKILLed with its pool while it holds publish tasks, like a machine that died.
    Every committed event arrives, in order per aggregate (duplicates allowed), none rolled
    back does, and the rows it held come back through the lease (attempt 2).

    w1 reaches RabbitMQ through a proxy that delays every reply by 15 ms. Once it holds
    publish tasks, the proxy keeps RabbitMQ's replies back, so its publishes wait for their
    confirms: the kill surely lands while it holds leased rows, not between two tasks (on a
    loaded machine 15 ms was not always enough). Batches of 10 over 8 aggregates come back
    full and are packed into 3-row tasks: the claim publishes the first itself and sends the
    others as publish tasks, so the kill finds both kinds in hand."""
    proxy = Proxy(delay=0.015)
    try:
        procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_BATCH_SIZE="10",
                                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="2000",
                                        OUTBOX_RELAY_TASK_ROWS="3"), runner)
        procs.worker("w1", OUTBOX_PUBLISH_URL=proxy.amqp_url)
        procs.worker("w2")
        procs.beat()
        with Writer(outbox, [f"k-{i}" for i in range(8)], rollback_every=3, pace=0.03) as writer:
            destination.wait_for(lambda: len(destination.messages) >= 50, timeout=20, procs=procs)
            assert len(destination.messages) >= 50, procs.log("w1")[-3000:]
            # Kill w1 (main process and pool children) while it holds publish tasks.
            assert wait_until(lambda: bool(procs.tasks_in_hand("w1")), timeout=10, interval=0.005), (
                procs.log("w1")[-3000:])
            proxy.hold_replies()
            time.sleep(0.5)  # more than a claim interval: whatever w1 publishes now waits for its confirms
            procs.kill("w1")
            destination.wait_for(lambda: False, timeout=1.0)  # writers go on after the kill
        expected, total = writer.expected, len(writer.written)
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=30)
        arrivals = destination.arrivals()
        assert len(destination.arrived()) == total, (
            f"{len(destination.arrived())} of {total} arrived\n{procs.log('w2')[-3000:]}")
        check_order(arrivals, expected)
        # The rows w1 held were recovered by their lease alone, an attempt counted.
        assert max(m.headers["attempt"] for _, _, m in arrivals) >= 2, "w1 held nothing when it was killed"
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), (
            outbox.status_counts())
        assert len(outbox.statuses()) == total  # nothing rolled back was ever stored
    finally:
        proxy.close()


def test_rows_of_a_lost_claim_come_back_with_the_lease(tmp_path: Path, destination: Destination, outbox: Outbox,
                                                        procs_factory: Any) -> None:
    """A claimer that leased rows and vanished (its task lost, its worker gone): the rows
    wait for the lease, hold back their aggregate meanwhile, and are then relayed in order
    with the attempt counted; other aggregates are never held up."""
    with outbox.writer() as conn:
        x1, x2 = outbox.add(conn, "x", 1), outbox.add(conn, "x", 2)
        y1 = outbox.add(conn, "y", 1)
        x3 = outbox.add(conn, "x", 3)
        conn.commit()
    lost = outbox.store.claim(2)  # the lease of a worker that will never acknowledge
    assert [m.id for m in lost.messages] == [x1, x2]
    leased_at = time.monotonic()
    # The lease must outlast the worker's start and first claim (5-6 s on a slow machine,
    # where a lease of 6 s ran out first and x1 came before y1).
    procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2",
                                    OUTBOX_CLAIM_TIMEOUT_MS="12000"))
    procs.worker("w1")
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 4, timeout=40, procs=procs)
    arrivals = [(outbox_id, m.headers["attempt"]) for outbox_id, _, m in destination.arrivals()]
    assert [a[0] for a in arrivals] == [y1, x1, x2, x3], procs.log("w1")[-3000:]
    assert dict(arrivals) == {y1: 1, x1: 2, x2: 2, x3: 1}
    assert time.monotonic() - leased_at >= 12.0
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)


# -- a broker outage ---------------------------------------------------------------------------

def test_broker_outage_pauses_claims_and_loses_nothing(tmp_path: Path, destination: Destination,
                                                       sqlite_outbox: Outbox, procs_factory: Any) -> None:
    outbox = sqlite_outbox
    proxy = Proxy()
    try:
        procs = procs_factory(relay_env(
            tmp_path, destination, outbox, OUTBOX_PUBLISH_URL=proxy.amqp_url,
            OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_RELAY_BREAKER_S="1.0"))
        procs.worker("w1")
        procs.beat()
        writer = Writer(outbox, [f"o-{i}" for i in range(4)])
        writer.write(range(5))
        destination.wait_for(lambda: len(destination.messages) >= 20, timeout=20, procs=procs)
        assert len(destination.messages) == 20, procs.log("w1")[-3000:]

        proxy.cut()
        writer.write(range(5, 10))
        time.sleep(3.0)  # the relay tries, fails, pauses, probes again...
        destination.wait_for(lambda: False, timeout=0.2)
        assert len(destination.messages) == 20  # nothing got through the cut
        during = outbox.statuses()
        assert Status.FAILED not in during.values() and Status.DEAD not in during.values(), during
        log = procs.log("w1")
        # One warning for the outage (docs/relay.md, "Outages in the log"), not one per probe.
        assert log.count("destination broker unreachable") == 1, log[-3000:]

        proxy.restore()
        total = len(writer.written)
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=20, procs=procs)
        arrivals = destination.arrivals()
        assert len(destination.arrived()) == total, procs.log("w1")[-3000:]
        check_order(arrivals, writer.expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)
        assert outbox.max_attempts() == 0  # the outage spent no attempt
    finally:
        proxy.close()


# -- lost Celery messages: the lease recovers them ---------------------------------------------

def test_publish_tasks_lost_in_celerys_broker_come_back_with_the_lease(
        tmp_path: Path, destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    """A claim dispatched publish tasks and Celery's broker lost them before any worker
    took them. Nothing else knows about those rows: they stay claimed until the lease
    expires, then the next claim relays them in order, the lost delivery counted."""
    with outbox.writer() as conn:
        expected = {"a": [outbox.add(conn, "a", n) for n in range(3)],
                    "b": [outbox.add(conn, "b", n) for n in range(2)]}
        conn.commit()
    # Inline publishing off: the claim must send its rows on as publish tasks.
    env = relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_CLAIM_TIMEOUT_MS="3000",
                    OUTBOX_RELAY_INLINE_ROWS="0")
    procs = procs_factory(env)
    procs.worker("claimer", concurrency=1, queues=relay_queue(env, "claim"))  # nobody consumes the publish queue yet
    procs.beat()
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.CLAIMED}, timeout=20), (
        outbox.status_counts(), procs.log("claimer")[-3000:])
    assert wait_until(lambda: queued_celery_messages(env, relay_queue(env, "publish")) > 0, timeout=10)
    leased_at = time.monotonic()
    assert lose_celery_messages(env, relay_queue(env, "publish")) >= 1
    procs.worker("w1")
    destination.wait_for(lambda: len(destination.messages) >= 5, timeout=30, procs=procs)
    assert time.monotonic() - leased_at >= 2.0, "rows came back before their lease expired"
    arrivals = destination.arrivals()
    check_order(arrivals, expected)
    assert len(arrivals) == 5, [a[0] for a in arrivals]
    # Rows behind a recovered head start chains of their own (one lost delivery each).
    assert {m.headers["attempt"] for _, _, m in arrivals} == {2}
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()


REFUSE_DONE_TRIGGER = {
    "sqlite": ["CREATE TRIGGER {name} BEFORE UPDATE OF status ON {table} WHEN NEW.status = 2 "
               "BEGIN SELECT RAISE(ABORT, 'test: mark_done refused'); END"],
    "postgresql": ["CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN RAISE EXCEPTION 'test: mark_done refused'; END $$",
                   "CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW WHEN (NEW.status = 2) "
                   "EXECUTE FUNCTION {name}()"],
    "mysql": ["CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW BEGIN IF NEW.status = 2 THEN "
              "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'test: mark_done refused'; END IF; END"],
}


DROP_DONE_TRIGGER = {
    "sqlite": ["DROP TRIGGER {name}"],
    "postgresql": ["DROP TRIGGER {name} ON {table}", "DROP FUNCTION {name}()"],
    "mysql": ["DROP TRIGGER {name}"],
}


def run_ddl(outbox: Outbox, statements: list[str]) -> None:
    name = f"{outbox.table}_refuse_done"
    with outbox.store.transaction() as cursor:
        for sql in statements:
            outbox.store.engine.execute(cursor, sql.format(name=name, table=outbox.store.engine.table))


def test_acks_that_never_land_are_recovered_by_the_lease_and_fenced_when_late(
        tmp_path: Path, destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    """The database refuses ``mark_done`` (a trigger) after the events were published, so
    the publish task hands its acks to the outbox's ack queue, which nobody consumes in
    time. The rows are recovered by the lease alone: claimed again, published again
    (duplicates, attempt 2, in order) and done. When the old acks finally run, their lease
    is gone: they change nothing and say so."""
    with outbox.writer() as conn:
        expected = {"a": [outbox.add(conn, "a", n) for n in range(3)], "b": [outbox.add(conn, "b", 0)]}
        conn.commit()
    run_ddl(outbox, REFUSE_DONE_TRIGGER[outbox.kind])
    env = relay_env(tmp_path, destination, outbox, OUTBOX_CLAIM_INTERVAL_S="0.2", OUTBOX_CLAIM_TIMEOUT_MS="3000")
    procs = procs_factory(env)
    procs.worker("w1", queues=relay_queues(env, "claim", "publish"))  # the acks wait: nobody consumes the ack queue
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 4, timeout=30, procs=procs)
    assert wait_until(lambda: queued_celery_messages(env, relay_queue(env, "ack")) >= 1, timeout=10), (
        procs.log("w1")[-3000:])
    assert "handing it to the ack queue" in procs.log("w1")
    assert set(outbox.statuses().values()) == {Status.CLAIMED}
    run_ddl(outbox, DROP_DONE_TRIGGER[outbox.kind])

    destination.wait_for(lambda: len(destination.messages) >= 8, timeout=30, procs=procs)
    arrivals = destination.arrivals()
    check_order(arrivals, expected)
    first, again = arrivals[:4], arrivals[4:]
    assert {m.headers["attempt"] for _, _, m in first} == {1}
    assert {m.headers["attempt"] for _, _, m in again} == {2}
    assert sorted(a[0] for a in again) == sorted(a[0] for a in first)
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10), outbox.status_counts()
    done_at = {id: row["processed_at"] for id, row in outbox.rows().items()}

    procs.worker("acks", concurrency=1, queues=relay_queue(env, "ack"))  # the late acks run now
    assert wait_until(lambda: queued_celery_messages(env, relay_queue(env, "ack")) == 0
                      and "no longer holds" in procs.log("acks"), timeout=20), procs.log("acks")[-3000:]
    assert {id: row["processed_at"] for id, row in outbox.rows().items()} == done_at
    assert len(destination.messages) == 8


# -- a warm shutdown ---------------------------------------------------------------------------

def test_a_warm_shutdown_finishes_the_tasks_in_hand_and_leaves_nothing_to_the_lease(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, runner: Any, procs_factory: Any) -> None:
    """SIGTERM to a worker's main process (what a deploy does): it stops claiming, the
    publish tasks it holds finish and settle their rows, and it exits cleanly. Another
    worker relays the rest at once: nothing waits for a lease, no attempt is spent, no
    event is sent twice.

    w1 reaches RabbitMQ through a proxy that delays every reply by 50 ms, so a task of one
    10-event chain takes about half a second and the signal lands while it is running."""
    outbox = sqlite_outbox
    with outbox.writer() as conn:
        expected = {f"k-{i}": [outbox.add(conn, f"k-{i}", n) for n in range(10)] for i in range(8)}
        conn.commit()
    proxy = Proxy(delay=0.05)
    try:
        # Inline publishing off: a full claim would publish its share itself, and this test is
        # about publish tasks in hand (a claim task in hand finishes like any running task).
        procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_BATCH_SIZE="10",
                                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="300000",
                                        OUTBOX_RELAY_INLINE_ROWS="0"), runner)
        procs.worker("w1", OUTBOX_PUBLISH_URL=proxy.amqp_url)
        procs.beat()
        assert wait_until(lambda: bool(procs.tasks_in_hand("w1")), timeout=20, interval=0.01), (
            procs.log("w1")[-3000:])
        in_hand = procs.tasks_in_hand("w1")
        # Up to 30 s more than the tasks in hand: billiard's wait for unread results
        # (docs/relay.md, "Graceful shutdown").
        returncode = procs.stop("w1", timeout=90)
        log_w1 = procs.log("w1")
        assert returncode == 0, log_w1[-3000:]
        assert "claims stop" in log_w1
        # A task w1 had received but no pool process had started yet when the signal landed
        # goes back to Celery's queue (the warm shutdown restores it) and w2 runs it.
        restored = [t for t in in_hand if not runner.succeeded(log_w1, t)]
        assert not restored or "Restoring" in log_w1, log_w1[-3000:]

        procs.worker("w2")
        total = sum(len(ids) for ids in expected.values())
        # Well inside the 300 s lease: anything left to it would time this out.
        destination.wait_for(lambda: len(destination.messages) >= total, timeout=60, procs=procs)
        for task_id in restored:
            assert wait_until(lambda task_id=task_id: runner.succeeded(procs.log("w2"), task_id), timeout=10), (
                procs.log("w2")[-3000:])
        arrivals = destination.arrivals()
        check_order(arrivals, expected)
        assert len(arrivals) == total, "an event was sent twice"
        assert {m.headers["attempt"] for _, _, m in arrivals} == {1}
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=10)
    finally:
        proxy.close()


def test_a_workers_own_soft_time_limit_does_not_cut_a_publish_short_within_its_lease(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """A worker started with ``--soft-time-limit`` (a unit file copied from another Celery
    service) raised ``SoftTimeLimitExceeded`` in publish tasks still well within their lease:
    their rows waited for the lease, and were published twice with an attempt counted (found in
    review). The relay's tasks have their own limits (docs/relay.md, "Tasks, queues, and how to
    scale and route them"). Each chain here takes about 2 s to publish, past the worker's 1 s."""
    outbox = sqlite_outbox
    with outbox.writer() as conn:
        expected = {f"k-{i}": [outbox.add(conn, f"k-{i}", n) for n in range(10)] for i in range(3)}
        conn.commit()
    proxy = Proxy(delay=0.2)
    try:
        procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_BATCH_SIZE="10",
                                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_RELAY_INLINE_ROWS="0",
                                        OUTBOX_PUBLISH_URL=proxy.amqp_url))
        procs.start("w1", "worker", "-c", "3", "--soft-time-limit", "1", "--loglevel=INFO", "--without-mingle",
                    "--without-gossip", "--without-heartbeat")
        procs.beat()
        total = sum(len(ids) for ids in expected.values())
        destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=40, procs=procs)
        arrivals = destination.arrivals()
        check_order(arrivals, expected)
        assert "SoftTimeLimitExceeded" not in procs.log("w1"), procs.log("w1")[-3000:]
        assert len(arrivals) == total and {m.headers["attempt"] for _, _, m in arrivals} == {1}
    finally:
        proxy.close()


# -- an event that kills its worker process ---------------------------------------------------

def test_an_event_that_kills_its_worker_goes_dead_alone(tmp_path: Path, destination: Destination,
                                                         sqlite_outbox: Outbox, runner: Any,
                                                         procs_factory: Any) -> None:
    """A backlog of 12 aggregates x 3 events, all claimed in one task with an event (the
    second of aggregate "k") that kills the process publishing it, every time. Its
    batch-mates were charged an attempt by each crash and went dead with it after
    OUTBOX_MAX_ATTEMPTS (3) crashes; now a row tried twice is published alone (docs/relay.md,
    "An event that kills its worker"), so the third crash is the killer's alone: it goes
    dead, and every other event arrives, in order, its row done.

    Celery: the pool process dies and the worker replaces it. Dramatiq: a worker process that
    dies stops the whole ``dramatiq`` command, which the test starts again as a supervisor
    would; a row tried twice is published in a child process of its own, so the third crash
    is the child's and the worker goes on (two restarts, not three). Before, the killer's
    lone publish message died with the rows the process's other threads held, and those went
    dead with it."""
    outbox = sqlite_outbox
    # A crash's rows come back through the takeover (3 s), not the lease. A lease of 6 s ran out
    # under load (8-14 on 2 cores) before the last of 6 rows tried twice, each a publish
    # message of its own, was started: 4 threads were waiting for their process's first child,
    # which starts its fork server (a fresh interpreter, 6 s there), and the next claim turned
    # the waiting rows dead, their last attempt spent by their wait in the queue (review,
    # 7 December). The relay's default lease is 60 s.
    env = relay_env(tmp_path, destination, outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_BATCH_SIZE="50",
                    OUTBOX_RELAY_TASK_ROWS="50", OUTBOX_CLAIM_TIMEOUT_MS="20000", OUTBOX_MAX_ATTEMPTS="3",
                    OUTBOX_RELAY_IN_PROCESS_CLAIM="0")
    install_killer(tmp_path)  # on the relay processes' PYTHONPATH: a child of a worker runs it too
    expected: dict[str, list[int]] = {}
    with outbox.writer() as conn:
        for n in range(3):
            for aggregate in [chr(ord("a") + i) for i in range(12)]:
                payload = {"aggregate": aggregate, "n": n, **({"KILLER": True} if (aggregate, n) == ("k", 1) else {})}
                expected.setdefault(aggregate, []).append(outbox.add(conn, aggregate, n, payload=payload))
        conn.commit()
    killer = expected["k"][1]
    others = {i for ids in expected.values() for i in ids} - {killer}
    procs = procs_factory(env, runner)
    workers: list[str] = []

    def start_worker() -> None:
        workers.append(f"w{len(workers) + 1}")
        procs.worker(workers[-1], concurrency=2)
        procs.stopped.add(workers[-1])  # its exit is the test's to handle: started again, as a supervisor would

    def arrived_or_restarted() -> bool:
        """Every other event arrived; or the worker stopped (Dramatiq), and is started again."""
        if destination.arrived() >= others:
            return True
        if procs.procs[workers[-1]].poll() is not None:
            start_worker()
        return False

    start_worker()
    procs.beat()
    destination.wait_for(arrived_or_restarted, timeout=120, procs=procs)
    logs = "\n".join(procs.log(name) for name in workers)
    assert destination.arrived() == others, (sorted(others - destination.arrived()), outbox.status_counts(),
                                             logs[-3000:])
    assert wait_until(lambda: outbox.rows()[killer]["status"] == Status.DEAD, timeout=60), outbox.rows()[killer]
    # The last event may have arrived a moment before its row is marked done.
    assert wait_until(lambda: {i for i, row in outbox.rows().items() if row["status"] != Status.DONE} == {killer},
                      timeout=30), outbox.status_counts()
    states = outbox.rows()
    assert states[killer]["attempts"] == 3
    check_order(destination.arrivals(), {a: [i for i in ids if i != killer] for a, ids in expected.items()})
    if runner.name == "celery":
        assert "signal 9 (SIGKILL)" in logs  # it did kill (Celery words each loss one of two ways)
        assert workers == ["w1"]
    else:  # the killer's first two tries stopped the worker at most; the third died in a child
        assert len(workers) <= 3, logs[-3000:]
        assert "child process publishing it died (signal SIGKILL)" in states[killer]["last_error"], states[killer]


def test_a_row_gone_dead_on_its_lease_is_dead_lettered_apart(tmp_path: Path, dead_letter_destination: Destination,
                                                             sqlite_outbox: Outbox, runner: Any,
                                                             procs_factory: Any) -> None:
    """A row whose last lease expired (its worker lost while it published it, the killer's
    last try) goes dead at the next claim, and that claim sends its dead-letter copy. The
    claiming process sent it itself, so a copy that kills its publisher (the same body as the
    publish that killed the worker before) took down the claiming worker: a Dramatiq worker
    process, and with it the whole ``dramatiq`` command and its other threads' rows; a Celery
    worker's process (found last session). Now the copy is sent from a child process of its
    own, as a suspect's publish is (docs/relay.md, "An event that kills its worker"): the
    child dies, the worker and every other row go on, and the row, dead, is settled alone. An
    innocent row gone dead the same way has its copy delivered by its child."""
    destination, outbox = dead_letter_destination, sqlite_outbox
    install_killer(tmp_path)  # on the relay processes' PYTHONPATH: a child of a worker runs it too
    with outbox.writer() as conn:
        killer = outbox.add(conn, "k", 0, payload={"KILLER": True, "n": 0})
        innocent = outbox.add(conn, "d", 0)
        behind = [outbox.add(conn, "k", 1), outbox.add(conn, "d", 1)]
        others = [outbox.add(conn, f"o-{i}", 0) for i in range(4)]
        # Both as a lost worker leaves them: claimed, the lease long expired, no attempt left.
        conn.execute(f"UPDATE {outbox.table} SET status = 1, attempts = 2, lease_token = 'lost', "
                     f"claimed_at = '2000-01-01 00:00:00.000' WHERE id IN (?, ?)", (killer, innocent))
        conn.commit()
    procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_MAX_ATTEMPTS="3",
                                    OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or ""), runner)
    procs.worker("w1")
    procs.beat()
    assert destination.wait_for(lambda: destination.arrived() >= {*behind, *others} and bool(destination.dead),
                                timeout=40, procs=procs), (outbox.rows(), procs.log("w1")[-3000:])
    assert procs.procs["w1"].poll() is None, procs.log("w1")[-3000:]
    rows = outbox.rows()
    assert (rows[killer]["status"], rows[innocent]["status"]) == (Status.DEAD, Status.DEAD), rows
    assert killer not in destination.arrived() and innocent not in destination.arrived()
    assert [m.headers["outbox_id"] for m in destination.dead] == [innocent]
    assert destination.dead[0].headers["x-outbox-error"].startswith("lease_expired")
    # The claim's copies go through one call: the killer's failure is logged once it returns.
    assert destination.wait_for(lambda: "child process publishing it died (signal SIGKILL)" in procs.log("w1"),
                                timeout=20, procs=procs), procs.log("w1")[-3000:]
    log = procs.log("w1")
    assert "dead-letter publish failed" in log, log[-3000:]
    if runner.name == "celery":  # no pool process lost either (Celery words each loss one of two ways)
        assert "SIGKILL" not in log.replace("child process publishing it died (signal SIGKILL)", ""), log[-3000:]
    check_order(destination.arrivals(), {"k": behind[:1], "d": behind[1:], **{f"o-{i}": [o] for i, o in
                                                                            enumerate(others)}})


def test_a_celery_pool_process_claim_dead_letters_apart(tmp_path: Path, dead_letter_destination: Destination,
                                                        sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """Found in review: a claim run by a Celery pool process (beat's tick, or any claim with
    the in-process claim off) could start no child: billiard makes its daemonic pool process
    multiprocessing's current one, and multiprocessing refuses a daemonic process children
    ("daemonic processes are not allowed to have children"), so every dead row's copy went
    out of the pool process itself, a WARNING each: the killer's copy SIGKILLed the pool
    process and the innocent row's copy, behind it, was never sent. Now the pool process
    starts its children too: the killer dies alone, the innocent copy arrives."""
    from runners import RUNNERS

    destination, outbox = dead_letter_destination, sqlite_outbox
    install_killer(tmp_path)
    with outbox.writer() as conn:
        killer = outbox.add(conn, "k", 0, payload={"KILLER": True, "n": 0})
        innocent = outbox.add(conn, "d", 0)
        conn.execute(f"UPDATE {outbox.table} SET status = 1, attempts = 2, lease_token = 'lost', "
                     f"claimed_at = '2000-01-01 00:00:00.000' WHERE id IN (?, ?)", (killer, innocent))
        conn.commit()
    runner = RUNNERS["celery"]
    procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_MAX_ATTEMPTS="3", OUTBOX_RELAY_IN_PROCESS_CLAIM="0",
                                    OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or ""), runner)
    procs.worker("w1")
    procs.beat()
    assert destination.wait_for(lambda: bool(destination.dead), timeout=40, procs=procs), (
        outbox.rows(), procs.log("w1")[-3000:])
    assert [m.headers["outbox_id"] for m in destination.dead] == [innocent]
    rows = outbox.rows()
    assert (rows[killer]["status"], rows[innocent]["status"]) == (Status.DEAD, Status.DEAD), rows
    # The claim's copies go through one call: the killer's failure is logged once it returns.
    assert destination.wait_for(lambda: "child process publishing it died (signal SIGKILL)" in procs.log("w1"),
                                timeout=20, procs=procs), procs.log("w1")[-3000:]
    log = procs.log("w1")
    assert "ForkPoolWorker" in log, log[-3000:]
    assert "no child process" not in log and "WorkerLostError" not in log, log[-3000:]


def test_a_claims_dead_letter_copies_end_by_its_deadline(tmp_path: Path, dead_letter_destination: Destination,
                                                          sqlite_outbox: Outbox, runner: Any,
                                                          procs_factory: Any) -> None:
    """Found in review: each dead-letter copy of a claim's dead rows was given a child of its
    own and the whole wait (the time left to the claim's deadline when the first started), so
    a dead-letter broker that hangs held the claim that wait once per row, N times it: past
    its time limit (the lease, 10 s here), where Dramatiq raised TimeLimitExceeded in it and
    Celery's hard limit SIGKILLed its pool process, the copies not yet tried never tried or
    logged. The copies now share the claim's deadline: once it has passed, the rest are not
    sent, each logged, and the claim ends in time."""
    destination, outbox = dead_letter_destination, sqlite_outbox
    install_killer(tmp_path)
    with outbox.writer() as conn:
        stalled = [outbox.add(conn, f"s-{i}", 0, payload={"STALLCOPY": True, "n": i}) for i in range(4)]
        conn.execute(f"UPDATE {outbox.table} SET status = 1, attempts = 2, lease_token = 'lost', "
                     f"claimed_at = '2000-01-01 00:00:00.000' WHERE id IN ({', '.join(map(str, stalled))})")
        conn.commit()
    procs = procs_factory(relay_env(tmp_path, destination, outbox, runner, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_MAX_ATTEMPTS="3", OUTBOX_CLAIM_TIMEOUT_MS="10000",
                                    OUTBOX_RELAY_IN_PROCESS_CLAIM="0",
                                    OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or ""), runner)
    procs.worker("w1")
    procs.beat()
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DEAD}, timeout=40), outbox.rows()
    # Every copy accounted for within the claim's deadline (8 s) and a little: before, one
    # every 8 s at most, and the time limit cut the claim after the first.
    assert wait_until(lambda: procs.log("w1").count("dead-letter publish failed") >= len(stalled), timeout=15), (
        procs.log("w1")[-3000:])
    log = procs.log("w1")
    assert "not sent" in log, log[-3000:]
    assert "TimeLimitExceeded" not in log and "Hard time limit" not in log and "WorkerLostError" not in log, (
        log[-3000:])
    assert not destination.dead
