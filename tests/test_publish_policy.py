"""What a publish task does with each outcome (``outbox.relay.handle_chain``,
``handle_publish``), without Celery: published prefixes done, retriable failures backed off,
poison and exhausted rows dead and dead-lettered, back-pressure and fatal failures opening the
breaker, late writes fenced by the lease, deadlines, and store writes handed to the fallback.
Helpers and fixtures: tests/relay_support.py."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import pytest
from relay_support import Collect, ScriptedPublisher, add, claim_chains, rows, run_python, status_of
from services import free_port

from outbox import Status
from outbox.core.model import OutboxMessage
from outbox.publisher import ChainResult, FailureKind, PublishFailure
from outbox.relay import (
    Breaker,
    RelayContext,
    RelayOptions,
    Settler,
    apply_fallback,
    handle_chain,
    handle_claim,
    handle_publish,
    retry_delay,
    still_held,
    still_held_when_reachable,
)
from outbox.storage.store import OutboxStore

# -- publishing a chain ------------------------------------------------------------------------

def test_published_chain_is_done(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    publisher = ScriptedPublisher()
    [chain] = claim_chains(sqlite_store)
    outcome = handle_chain(RelayContext(sqlite_store, publisher), chain)
    assert outcome.published == ids and outcome.failed_id is None
    assert [m.id for m in publisher.sent] == ids
    assert all(status_of(sqlite_store)[i] == Status.DONE for i in ids)


def test_a_publish_task_delivered_again_skips_chains_its_lease_no_longer_holds(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """The first run released chain a (a warm shutdown) and published chain b; a new
    claim now holds a. The second delivery must publish neither."""
    a, b, c = add(conn, "a", 2), add(conn, "b", 2), add(conn, "c", 2)
    chains = claim_chains(sqlite_store)
    by_aggregate = {chain[0].aggregate_id: chain for chain in chains}
    lease = chains[0][0].lease
    sqlite_store.release(a, lease)
    sqlite_store.mark_done(b, lease)
    reclaimed = sqlite_store.claim(100)
    assert sorted(m.id for m in reclaimed.messages) == a
    assert still_held(sqlite_store, chains).chains == [by_aggregate["c"]]
    assert sqlite_store.held(a + b + c, lease) == set(c)
    assert sqlite_store.held(a, reclaimed.lease) == set(a)


def test_retriable_failure_acks_prefix_fails_k_and_releases_the_rest(sqlite_store: OutboxStore,
                                                                   conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 4)
    publisher = ScriptedPublisher({ids[1]: FailureKind.RETRIABLE})
    [chain] = claim_chains(sqlite_store)
    options = RelayOptions(backoff_base_s=10, backoff_max_s=100)
    outcome = handle_chain(RelayContext(sqlite_store, publisher, options=options, rng=lambda: 1.0), chain)
    assert outcome.published == ids[:1] and outcome.failed_id == ids[1] and outcome.kind == "retriable"
    state = rows(sqlite_store)
    assert state[ids[0]]["status"] == Status.DONE
    assert (state[ids[1]]["status"], state[ids[1]]["attempts"]) == (Status.FAILED, 1)
    assert "retriable" in state[ids[1]]["last_error"] and state[ids[1]]["next_retry_at"] is not None
    assert [(state[i]["status"], state[i]["attempts"]) for i in ids[2:]] == [(Status.PENDING, 0)] * 2
    # The aggregate waits for the failed event: nothing is claimable until its retry is due.
    assert sqlite_store.claim(100).messages == []


def test_retry_time_follows_the_back_off(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 1)
    publisher = ScriptedPublisher({ids[0]: FailureKind.RETRIABLE})
    [chain] = claim_chains(sqlite_store)
    handle_chain(RelayContext(sqlite_store, publisher, options=RelayOptions(backoff_base_s=0.2, backoff_max_s=0.2)), chain)
    assert sqlite_store.claim(100).messages == []
    time.sleep(0.25)
    [again] = sqlite_store.claim(100).messages
    assert again.id == ids[0] and again.attempt == 2


def test_poison_goes_dead_at_once_and_the_aggregate_moves_on(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    publisher = ScriptedPublisher({ids[1]: FailureKind.POISON})
    [chain] = claim_chains(sqlite_store)
    outcome = handle_chain(RelayContext(sqlite_store, publisher), chain)
    assert outcome.dead and outcome.kind == "poison"
    state = rows(sqlite_store)
    assert (state[ids[0]]["status"], state[ids[1]]["status"], state[ids[2]]["status"]) == (
        Status.DONE, Status.DEAD, Status.PENDING)
    assert state[ids[2]]["attempts"] == 0
    assert [(m.id, "poison" in err) for m, err in publisher.dead] == [(ids[1], True)]
    [rest] = claim_chains(sqlite_store)
    assert [m.id for m in rest] == ids[2:]


def test_last_retriable_attempt_goes_dead_and_is_dead_lettered(sqlite_store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher({ids[0]: FailureKind.RETRIABLE}, sticky=True)
    options = RelayOptions(backoff_base_s=0.01, backoff_max_s=0.01)
    for attempt in range(1, 4):
        time.sleep(0.05)
        [chain] = claim_chains(sqlite_store)
        assert chain[0].id == ids[0] and chain[0].attempt == attempt
        outcome = handle_chain(RelayContext(sqlite_store, publisher, options=options), chain)
    assert outcome.dead  # max_attempts=3
    assert status_of(sqlite_store)[ids[0]] == Status.DEAD
    assert [m.id for m, _ in publisher.dead] == [ids[0]]
    [rest] = claim_chains(sqlite_store)
    assert [m.id for m in rest] == ids[1:]


def test_rows_dead_on_lease_expiry_go_to_the_dead_letter_exchange(tmp_path: Path,
                                                                   conn: sqlite3.Connection) -> None:
    """A row whose lease expires with no attempts left goes dead inside ``store.claim``
    (``Claim.dead``): the claim path sends it to the dead-letter exchange, and still
    dispatches the live rows; the rest of that row's aggregate follows on the next claim."""
    store = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=200, max_attempts=1)
    try:
        [a1] = add(conn, "a", 1)
        lost = store.claim(1)  # a worker that took a1 and died
        assert [m.id for m in lost.messages] == [a1]
        a_rest = add(conn, "a", 2)
        b = add(conn, "b", 1)
        time.sleep(0.3)
        publisher, sent = ScriptedPublisher(), Collect()
        outcome = handle_claim(RelayContext(store, publisher=publisher), sent, batch_size=100, lease_s=0.2)
        assert outcome.dead == 1 and outcome.claimed == outcome.dispatched == 1
        assert [(m.id, m.aggregate_id) for m, _ in publisher.dead] == [(a1, "a")]
        [(_, error)] = publisher.dead
        assert error.startswith("lease_expired: lease expired") and "no attempts left" in error
        # The rows behind the dead one wait for the next claim (the store's rule on every
        # engine); other aggregates are dispatched at once.
        assert [[m.id for m in chain] for chain in sent.chains] == [b]
        state = rows(store)
        assert state[a1]["status"] == Status.DEAD and "lease expired" in state[a1]["last_error"]
        assert handle_claim(RelayContext(store, publisher=publisher), sent, batch_size=100, lease_s=0.2).dead == 0
        assert [[m.id for m in chain] for chain in sent.chains] == [b, a_rest]
        assert len(publisher.dead) == 1 and publisher.sent == []  # a claim publishes only dead-letter copies
    finally:
        store.close()


def test_a_row_dead_on_lease_expiry_is_logged_with_the_ids_of_every_dead_line(
        tmp_path: Path, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: every other dead row's line names ``outbox_id message_id aggregate_id
    topic lease``, in the text and as ``extra`` fields (docs/waking-and-metrics.md, "Logs");
    a row dead on lease expiry logged its outbox and message ids only, with no fields, so
    neither a search by aggregate nor a JSON formatter's ``outbox_event=dead`` found it."""
    store = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=200, max_attempts=1)
    try:
        [a1] = add(conn, "agg-lost", 1)
        store.claim(1)  # a worker that took it and died
        time.sleep(0.3)
        with caplog.at_level(logging.ERROR):
            outcome = handle_claim(RelayContext(store, publisher=ScriptedPublisher()), Collect(), batch_size=10,
                                   lease_s=0.2)
        assert outcome.dead == 1
        [line] = [r for r in caplog.records if "went dead" in r.getMessage()]
        assert f"outbox_id={a1} " in line.getMessage() and "aggregate_id=agg-lost " in line.getMessage()
        assert getattr(line, "outbox_event", None) == "dead" and getattr(line, "aggregate_id", None) == "agg-lost"
        # An undecodable row goes dead in the claim too: one line, with its own reason.
        [bad] = add(conn, "agg-bad", 1)
        conn.execute("UPDATE outbox SET payload = '42' WHERE id = ?", (bad,))
        conn.commit()
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert handle_claim(RelayContext(store, publisher=ScriptedPublisher()), Collect(), batch_size=10,
                                lease_s=0.2).dead == 1
        [line] = [r for r in caplog.records if "went dead" in r.getMessage()]
        assert "undecodable row: payload is not a JSON object" in line.getMessage(), line.getMessage()
        assert "lease expired" not in line.getMessage() and getattr(line, "aggregate_id", None) == "agg-bad"
    finally:
        store.close()


def test_a_claim_of_only_dead_rows_still_dead_letters_them_best_effort(tmp_path: Path,
                                                                       conn: sqlite3.Connection) -> None:
    store = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=100, max_attempts=1)
    try:
        ids = add(conn, "a", 1) + add(conn, "b", 1)
        store.claim(10)
        time.sleep(0.2)
        publisher = ScriptedPublisher()
        outcome = handle_claim(RelayContext(store, publisher=publisher), Collect(), batch_size=10, lease_s=0.1)
        assert (outcome.claimed, outcome.dead) == (0, 2)
        assert [m.id for m, _ in publisher.dead] == ids
        # Without a publisher (or with one whose dead-letter publish blows up) the rows are
        # dead in the table all the same, which stays the record of truth.
        ids2 = add(conn, "c", 1)
        store.claim(10)
        time.sleep(0.2)

        class Broken(ScriptedPublisher):
            def publish_dead(self, message: OutboxMessage, error: str, *,
                             headers: Mapping[str, Any] | None = None) -> None:
                raise ConnectionError("dead-letter broker down")

        assert handle_claim(RelayContext(store, publisher=Broken()), Collect(), batch_size=10, lease_s=0.1).dead == 1
        assert status_of(store)[ids2[0]] == Status.DEAD
        assert handle_claim(RelayContext(store), Collect(), batch_size=10, lease_s=0.1).dead == 0
    finally:
        store.close()


def test_backpressure_releases_without_attempt_and_opens_the_breaker(sqlite_store: OutboxStore,
                                                                      conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    other = add(conn, "b", 1)
    publisher = ScriptedPublisher({ids[1]: FailureKind.BACKPRESSURE})
    breaker = Breaker()
    chains = claim_chains(sqlite_store)
    outcome = handle_chain(RelayContext(sqlite_store, publisher, options=RelayOptions(breaker_s=30), breaker=breaker),
                           chains[0])
    assert outcome.kind == "backpressure" and outcome.released == ids[1:]
    state = rows(sqlite_store)
    assert state[ids[0]]["status"] == Status.DONE
    assert [(state[i]["status"], state[i]["attempts"]) for i in ids[1:]] == [(Status.PENDING, 0)] * 2
    assert state[ids[1]]["next_retry_at"] is not None  # they wait out the pause
    assert breaker.open_for() > 29 and breaker.reason.startswith("backpressure")
    # Chains already in hand are not even tried while it is open: released, no attempt.
    skipped = handle_chain(RelayContext(sqlite_store, publisher, breaker=breaker), chains[1])
    assert skipped.skipped and status_of(sqlite_store)[other[0]] == Status.PENDING
    assert [m.id for m in publisher.sent] == ids[:1]
    # And claims stop.
    assert handle_claim(RelayContext(sqlite_store, breaker=breaker), Collect(), batch_size=100, lease_s=60).paused > 0


def test_a_failure_of_a_publish_begun_before_the_broker_was_back_starts_no_new_outage(
        sqlite_store: OutboxStore, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture) -> None:
    """A publish that began during a broker outage and failed after another task's publish
    went through (a Kafka delivery report of an event produced during the cut timed out 0.5 s
    after the broker was back, seen in CI) announced a second outage and paused claims. It is
    a leftover of the outage that ended: logged at DEBUG, the rest released with no pause and
    no attempt spent, the breaker left closed. A failure of a publish begun after that is a
    new outage, as before."""
    from outbox.relay.shared import Outage

    ids = add(conn, "a", 2)
    outage = Outage("destination broker", "amqp://host//", "Claims pause.", logging.getLogger("outbox.test.stale"))
    outage.failed(ConnectionRefusedError("refused"))  # the outage, announced

    class BackDuringTheSend(ScriptedPublisher):
        def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *, pipelined: Any = None,
                           deadline: float | None = None) -> Any:
            outage.ok()  # another task's publish went through meanwhile
            return super().publish_chains(chains, pipelined=pipelined, deadline=deadline)

    breaker = Breaker()
    relay = RelayContext(sqlite_store, BackDuringTheSend({ids[0]: FailureKind.BACKPRESSURE}),
                         options=RelayOptions(breaker_s=30), breaker=breaker, outage=outage)
    with caplog.at_level(logging.DEBUG, logger="outbox.test.stale"):
        outcome = handle_chain(relay, claim_chains(sqlite_store)[0])
    assert outcome.kind == "backpressure" and outcome.released == ids
    assert breaker.open_for() == 0 and not outage.down
    assert [(r["status"], r["attempts"], r["next_retry_at"]) for r in rows(sqlite_store).values()] == [
        (Status.PENDING, 0, None)] * 2
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    # The outage, its end, then the leftover.
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO, logging.DEBUG], said
    assert "work begun before it was back" in said[2][1], said
    # Sent after the broker was back: a new outage.
    relay.publisher = ScriptedPublisher({ids[0]: FailureKind.BACKPRESSURE})
    with caplog.at_level(logging.DEBUG, logger="outbox.test.stale"):
        handle_chain(relay, claim_chains(sqlite_store)[0])
    assert outage.down and breaker.open_for() > 29
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 2


def test_fatal_stops_claims_for_long_with_a_clear_message(sqlite_store: OutboxStore, conn: sqlite3.Connection,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher({ids[0]: FailureKind.FATAL})
    breaker = Breaker()
    [chain] = claim_chains(sqlite_store)
    with caplog.at_level(logging.CRITICAL, logger="outbox.relay"):
        outcome = handle_chain(RelayContext(sqlite_store, publisher, options=RelayOptions(fatal_pause_s=300), breaker=breaker),
                               chain)
    assert outcome.kind == "fatal"
    assert breaker.open_for() > 290 and breaker.reason.startswith("fatal")
    assert any("FATAL" in r.getMessage() and f"outbox_id={ids[0]}" in r.getMessage() for r in caplog.records)
    # Released with no delay: the breaker stops the claims, and once a restart lifts the
    # pause (the settings fixed) the rows are claimable at once, not 300 s later.
    assert [(r["status"], r["attempts"], r["next_retry_at"]) for r in rows(sqlite_store).values()] == [
        (Status.PENDING, 0, None)] * 2
    # A later back-pressure trip never shortens the fatal pause.
    breaker.trip(1, "backpressure: short")
    assert breaker.open_for() > 290 and breaker.reason.startswith("fatal")
    # Publish tasks already queued when it opened hand their rows back the same way.
    [chain] = claim_chains(sqlite_store)
    skipped = handle_publish(RelayContext(sqlite_store, publisher, breaker=breaker), [chain])
    assert [o.released for o in skipped] == [ids]
    assert [r["next_retry_at"] for r in rows(sqlite_store).values()] == [None, None]
    breaker.reset()  # what a restarted worker does (Relay.lift_fatal_pause)
    assert [m.id for m in sqlite_store.claim(10).messages] == ids


def test_a_fatal_error_every_chain_meets_is_logged_once_per_pause(sqlite_store: OutboxStore, conn: sqlite3.Connection,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Every chain of a task meets the same FATAL error (a missing Kafka topic, bad
    credentials): one CRITICAL line for the pause, the other chains at DEBUG; all the rows
    released, no attempt spent. tests/test_runner_faults_e2e.py runs it with real workers."""
    ids = add(conn, "a") + add(conn, "b") + add(conn, "c")
    publisher = ScriptedPublisher(dict.fromkeys(ids, FailureKind.FATAL))
    breaker = Breaker()
    with caplog.at_level(logging.DEBUG, logger="outbox.relay"):
        handle_publish(RelayContext(sqlite_store, publisher, options=RelayOptions(fatal_pause_s=300), breaker=breaker),
                       claim_chains(sqlite_store))
    fatal = [r.levelno for r in caplog.records if "FATAL publishing error" in r.getMessage()]
    assert fatal == [logging.CRITICAL, logging.DEBUG, logging.DEBUG]
    assert breaker.open_for() > 290 and breaker.fatal
    assert [(r["status"], r["attempts"]) for r in rows(sqlite_store).values()] == [(Status.PENDING, 0)] * 3
    assert breaker.opens(300, "fatal: again") is False and breaker.opens(5, "backpressure: other") is True


def test_backpressure_pauses_hold_the_rows_until_the_pause_ends(sqlite_store: OutboxStore,
                                                               conn: sqlite3.Connection) -> None:
    """Unlike a fatal pause, a broker's back-pressure releases the rows not due before the
    pause ends, so workers that do not share the breaker do not hammer the broker."""
    ids = add(conn, "a", 2)
    breaker = Breaker()
    breaker.trip(30, "backpressure: broker blocked")
    [chain] = claim_chains(sqlite_store)
    skipped = handle_publish(RelayContext(sqlite_store, ScriptedPublisher(), breaker=breaker), [chain])
    assert [o.released for o in skipped] == [ids]
    assert all(r["next_retry_at"] is not None for r in rows(sqlite_store).values())
    assert sqlite_store.claim(10).messages == []


def test_a_publisher_that_raises_counts_against_the_head(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    [chain] = claim_chains(sqlite_store)
    outcome = handle_chain(RelayContext(sqlite_store, ScriptedPublisher(raises=RuntimeError("boom"))), chain)
    assert outcome.failed_id == ids[0] and outcome.kind == "retriable"
    state = rows(sqlite_store)
    assert (state[ids[0]]["status"], state[ids[0]]["attempts"]) == (Status.FAILED, 1)
    assert "boom" in state[ids[0]]["last_error"]
    assert state[ids[1]]["status"] == Status.PENDING


class _Webhook(ScriptedPublisher):
    """A destination of the application's own, over HTTP to a URL with credentials: nothing
    listens on its port, and its error names the URL, password and all, as clients' errors
    often do. It raises that error, or reports it as a poison failure."""

    def __init__(self, port: int, raises: bool) -> None:
        super().__init__()
        self.url, self.port, self.raising = f"http://hook:s3cretpw@127.0.0.1:{port}/in", port, raises

    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
        except OSError as exc:
            text = f"POST {self.url} failed: {exc}"
            if self.raising:
                raise ConnectionError(text) from exc
            return ChainResult((), messages[0].id, PublishFailure(FailureKind.POISON, text))
        raise AssertionError(f"something listens on port {self.port}")


@pytest.mark.parametrize("raises", [True, False], ids=["raised", "reported"])
def test_a_failures_password_is_masked_in_last_error_the_dead_letter_copy_and_the_log(
        raises: bool, sqlite_store: OutboxStore, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: what a publisher raised (or a child publishing apart sent back) was
    stored in last_error as it was, and a reason it reported went on as it was to last_error,
    the dead-letter copy's x-outbox-error and the relay's log lines, masked only by a worker's
    log handlers: a URL with a password in a client's error reached the table, `outbox dead
    list`, the admin and the dead-letter queue. A real refused connection here, its error
    naming the URL with its password; no handler of the relay's masks caplog's records."""
    [event] = add(conn, "w")
    publisher = _Webhook(free_port(), raises)
    [chain] = claim_chains(sqlite_store)
    with caplog.at_level(logging.INFO):
        handle_chain(RelayContext(sqlite_store, publisher), chain)
    stored = rows(sqlite_store)[event]
    assert stored["status"] == (Status.FAILED if raises else Status.DEAD), stored
    assert "http://hook:***@127.0.0.1" in stored["last_error"] and "s3cretpw" not in stored["last_error"]
    assert "Connection refused" in stored["last_error"]
    assert [error for _, error in publisher.dead] == ([] if raises else [stored["last_error"]])
    assert "http://hook:***@127.0.0.1" in caplog.text and "s3cretpw" not in caplog.text


def test_only_a_true_prefix_is_acked(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)

    class Liar(ScriptedPublisher):
        def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
            return ChainResult((messages[0].id, messages[2].id))  # skips the second: not a prefix

    [chain] = claim_chains(sqlite_store)
    outcome = handle_chain(RelayContext(sqlite_store, Liar()), chain)
    assert outcome.published == ids[:1]
    assert [status_of(sqlite_store)[i] for i in ids] == [Status.DONE, Status.PENDING, Status.PENDING]


def test_late_acks_are_fenced_by_the_lease(tmp_path: Path, conn: sqlite3.Connection) -> None:
    short = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=100, max_attempts=5)
    a = add(conn, "a", 1)
    b = add(conn, "b", 1)
    old = claim_chains(short)
    time.sleep(0.25)
    new = claim_chains(short)  # the lease expired: another worker took the rows
    assert [c[0].id for c in new] == a + b and new[0][0].lease != old[0][0].lease and new[0][0].attempt == 2
    publisher = ScriptedPublisher({b[0]: FailureKind.RETRIABLE})
    for chain in old:  # the first worker was only slow: its writes are refused
        handle_chain(RelayContext(short, publisher), chain)
    state = rows(short)
    assert [(state[i]["status"], state[i]["lease"]) for i in a + b] == [(Status.CLAIMED, new[0][0].lease)] * 2
    for chain in new:
        handle_chain(RelayContext(short, ScriptedPublisher()), chain)
    assert [status_of(short)[i] for i in a + b] == [Status.DONE] * 2
    short.close()


def test_publish_task_past_its_deadline_leaves_rows_to_the_lease(sqlite_store: OutboxStore,
                                                                  conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher()
    chains = claim_chains(sqlite_store)
    outcomes = handle_publish(RelayContext(sqlite_store, publisher), chains, deadline=time.time() - 1)
    assert outcomes[0].skipped and publisher.sent == []
    assert [status_of(sqlite_store)[i] for i in ids] == [Status.CLAIMED] * 2


class Hung(ScriptedPublisher):
    """A broker that takes the events and never confirms them, behind a publisher that does
    what the real ones do: wait its own budget (``budget_s``) or until the ``deadline`` it is
    given, whichever comes first, then report BACKPRESSURE for every chain. ``deadlines``
    holds the deadlines it was given."""

    budget_s = 8.0

    def __init__(self) -> None:
        super().__init__()
        self.deadlines: list[float | None] = []

    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *, pipelined: Any = None,
                       deadline: float | None = None) -> list[ChainResult]:
        self.deadlines.append(deadline)
        end = time.monotonic() + self.budget_s
        if deadline is not None:
            end = min(end, deadline)
        time.sleep(max(0.0, end - time.monotonic()))
        failure = PublishFailure(FailureKind.BACKPRESSURE, "no publisher confirm in time")
        return [ChainResult(failed_id=chain[0].id, failure=failure) for chain in chains]


def test_a_publish_task_begun_just_before_its_deadline_releases_its_rows_by_that_deadline(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """A publish task that starts 1 s before its claim's deadline (the lease's safe part) and
    meets a hung broker. The relay only skipped tasks starting after the deadline; the
    publisher then waited its own budget (the lease's whole safe part) from its start, so the
    publish outlived the lease: lease recovery took the rows again with an attempt spent while
    the first publish still waited. The deadline now reaches the publisher (as the time left,
    monotonic), which gives up by then: the rows are released with no attempt spent, by about
    the deadline, under the lease they were claimed with. The time was the task's, not the
    broker's: the breaker stays closed (a healthy broker with a task begun late would
    otherwise pause every claim)."""
    ids = add(conn, "a", 2) + add(conn, "b", 1)
    chains = claim_chains(sqlite_store)
    publisher = Hung()
    deadline = time.time() + 1.0
    began = time.monotonic()
    breaker = Breaker()  # the lease's safe part is 8 s: the task began 7 s after its claim
    outcomes = handle_publish(RelayContext(sqlite_store, publisher, breaker=breaker, publish_budget_s=8.0), chains,
                              deadline=deadline)
    elapsed = time.monotonic() - began
    assert elapsed < 5.0, f"the publish ended {elapsed:.1f} s after it began, its deadline 1 s away"
    [given] = publisher.deadlines
    assert given is not None and given == pytest.approx(began + 1.0, abs=0.5)
    assert [(o.kind, o.released) for o in outcomes] == [(FailureKind.BACKPRESSURE, ids[:2]),
                                                        (FailureKind.BACKPRESSURE, ids[2:])]
    state = rows(sqlite_store)
    assert [(state[i]["status"], state[i]["attempts"]) for i in ids] == [(Status.PENDING, 0)] * 3
    assert breaker.open_for() == 0


def test_a_publish_task_begun_on_time_that_its_deadline_stops_opens_the_breaker(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """A task begun at its claim whose broker does not answer for the whole safe part of the
    lease (a short lease, the publisher's own budget as long): the deadline ends the publish,
    but the time was the broker's. Counted as the task's (found in review), a broker outage
    opened no breaker and logged no outage, and every claim took the rows again at once."""
    ids = add(conn, "a", 1)
    chains = claim_chains(sqlite_store)
    breaker = Breaker()
    outcomes = handle_publish(RelayContext(sqlite_store, Hung(), breaker=breaker, publish_budget_s=1.0), chains,
                              deadline=time.time() + 1.0)
    assert [(o.kind, o.released) for o in outcomes] == [(FailureKind.BACKPRESSURE, ids)]
    assert breaker.open_for() > 0
    assert rows(sqlite_store)[ids[0]]["attempts"] == 0


class CountingStore:
    """Passes every call to the store, counting the ``mark_done`` calls."""

    def __init__(self, store: OutboxStore) -> None:
        self.store = store
        self.done_calls: list[list[int]] = []

    def mark_done(self, ids: Sequence[int], lease: str) -> Any:
        self.done_calls.append(list(ids))
        return self.store.mark_done(ids, lease)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_publish_task_marks_its_published_prefixes_done_in_one_write(sqlite_store: OutboxStore,
                                                                       conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3)
    b = add(conn, "b", 2)
    c = add(conn, "c", 1)
    chains = claim_chains(sqlite_store)
    counting = CountingStore(sqlite_store)
    publisher = ScriptedPublisher({a[1]: FailureKind.RETRIABLE})
    outcomes = handle_publish(RelayContext(counting, publisher), chains, deadline=time.time() + 60)
    assert counting.done_calls == [[a[0]] + b + c]  # one write for the whole task
    assert [o.published for o in outcomes] == [[a[0]], b, c]
    assert outcomes[0].failed_id == a[1] and outcomes[0].released == [a[2]]
    states = status_of(sqlite_store)
    assert [states[i] for i in a] == [Status.DONE, Status.FAILED, Status.PENDING]
    assert all(states[i] == Status.DONE for i in b + c)


def test_a_publish_task_asks_again_through_a_short_database_outage(sqlite_store: OutboxStore,
                                                                   conn: sqlite3.Connection) -> None:
    """A publish task whose "still held?" read failed raised at once, leaving its rows leased
    to this live process until the lease ran out; it now asks again until its deadline
    is near, or the worker stops."""
    ids = add(conn, "a", 2)
    [chain] = claim_chains(sqlite_store)

    class Away:
        def __init__(self, failures: int) -> None:
            self.failures, self.holder_id = failures, sqlite_store.holder_id

        def held(self, ids: Any, lease: str) -> set[int]:
            if self.failures:
                self.failures -= 1
                raise ConnectionError("database restarting")
            return sqlite_store.held(ids, lease)

    failed: list[BaseException] = []
    slept: list[float] = []
    held = still_held_when_reachable(Away(2), [chain], deadline=time.time() + 60, failed=failed.append,
                                     sleep=slept.append)
    assert [[m.id for m in c] for c in held.chains] == [ids] and len(failed) == 2 and slept == [0.5, 0.5]
    with pytest.raises(ConnectionError):  # too close to the deadline: the lease recovers the rows
        still_held_when_reachable(Away(99), [chain], deadline=time.time() + 0.2, sleep=slept.append)
    with pytest.raises(ConnectionError):  # stopping: nothing to wait for
        still_held_when_reachable(Away(99), [chain], deadline=time.time() + 60, stopping=lambda: True,
                                  sleep=slept.append)
    assert slept == [0.5, 0.5]


# -- store writes that fail go to the ack queue's tasks ----------------------------------------

class DownStore:
    """A store whose every write fails as a database that is down."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("database down")
        return fail


def test_failed_store_writes_are_handed_to_the_fallback(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    [chain] = claim_chains(sqlite_store)

    handed: list[tuple[str, dict[str, Any]]] = []
    settler = Settler(DownStore(), lambda op, kwargs: handed.append((op, json.loads(json.dumps(kwargs)))))
    publisher = ScriptedPublisher({ids[1]: FailureKind.POISON})
    handle_chain(RelayContext(sqlite_store, publisher, settler=settler), chain)
    assert [op for op, _ in handed] == ["done", "failed", "release"]
    assert publisher.dead == []  # dead-lettering waits until the row really is dead
    # The fallback tasks apply them later, on the real store (JSON round trip included).
    for op, kwargs in handed:
        apply_fallback(sqlite_store, publisher, op, kwargs)
    assert [status_of(sqlite_store)[i] for i in ids] == [Status.DONE, Status.DEAD, Status.PENDING]
    assert [m.id for m, _ in publisher.dead] == [ids[1]]


def test_a_failed_store_write_is_logged_with_the_rows_it_was_for(sqlite_store: OutboxStore, conn: sqlite3.Connection,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: "outbox done failed (...); handing it to the ack queue" and "fallback
    failed too (...); the lease will recover the rows" named no row, while a done mark that
    never lands means the rows go out again: an operator tracing a duplicate could not tie it
    to these lines. They name the rows' ids and lease, in the text and as ``extra`` fields."""
    ids = add(conn, "a", 3)
    [chain] = claim_chains(sqlite_store)

    def fallback_down(op: str, kwargs: Any) -> None:
        raise ConnectionError("broker down")

    publisher = ScriptedPublisher({ids[1]: FailureKind.POISON})
    with caplog.at_level(logging.ERROR):
        handle_chain(RelayContext(sqlite_store, publisher, settler=Settler(DownStore(), fallback_down)), chain)
    lease = chain[0].lease
    for op, written in (("done", [ids[0]]), ("failed", [ids[1]]), ("release", [ids[2]])):
        mine = [r for r in caplog.records if r.getMessage().startswith((f"outbox {op} failed", f"outbox {op}: fallback"))]
        assert len(mine) == 2, [r.getMessage() for r in caplog.records]  # the write's, then the fallback's
        for record in mine:
            assert f"outbox_ids={written} lease={lease}" in record.getMessage(), record.getMessage()
            assert getattr(record, "outbox_ids", None) == written and getattr(record, "lease", None) == lease


_FALLBACK_TASKS_RUN = """
import json, os, sqlite3, sys
sys.path.insert(0, os.environ["TESTS"])
from relay_support import add, claim_chains, status_of
from outbox.relay.settle import Settler
from outbox.storage.store import OutboxStore

store = OutboxStore(os.environ["OUTBOX_DATABASE_URL"], claim_timeout_ms=60_000)
store.migrate()
ids = add(sqlite3.connect(os.environ["DB"], timeout=30), "a", 3)
[chain] = claim_chains(store)

class DownStore:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError("database down")
        return fail

handed = []
settler = Settler(DownStore(), lambda op, kwargs: handed.append((op, json.loads(json.dumps(kwargs)))))
settler.done([chain[0].id], chain[0].lease)
# What publish.py hands on for an event of a pipelined chain that later events overtook.
settler.failed(chain[1], "overtaken", None, dead=True, dead_headers={"x-outbox-overtaken-by": [chain[2].id]})
settler.release([chain[2]])
if os.environ["RUNNER"] == "celery":
    import outbox.celery.tasks as t
    tasks = {"done": t.ack, "failed": t.fail, "release": t.release}
    for op, kwargs in handed:
        tasks[op].apply(kwargs=kwargs, throw=True)
else:
    import outbox.dramatiq.actors as a
    actors = {"done": a.ack, "failed": a.fail, "release": a.release}
    for op, kwargs in handed:
        actors[op].fn(**kwargs)
states = status_of(store)
print(json.dumps({"handed": [[op, sorted(kwargs)] for op, kwargs in handed], "states": [states[i] for i in ids]}))
"""


@pytest.mark.parametrize("runner", ["celery", "dramatiq"])
def test_every_write_handed_to_the_ack_queue_runs_as_its_task(tmp_path: Path, runner: str) -> None:
    """The kwargs the Settler hands on (dead_headers included) are what each runner's ack,
    fail and release task bodies take: the task runs and the row gets its mark."""
    if runner == "dramatiq":
        pytest.importorskip("dramatiq")
    db = tmp_path / "outbox.db"
    done = run_python(_FALLBACK_TASKS_RUN, tmp_path, RUNNER=runner, DB=str(db), TESTS=str(Path(__file__).parent),
                      OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_DRAMATIQ_BROKER_URL="redis://127.0.0.1:6379/15")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["handed"] == [["done", ["ids", "lease"]],
                             ["failed", ["dead", "error", "message", "retry_in_s"]],
                             ["release", ["delay_s", "ids", "lease"]]]
    assert out["states"] == [Status.DONE, Status.DEAD, Status.PENDING]


# The fail task's signature in the previous release (757df6b: celery/tasks.py and dramatiq/actors.py,
# the same parameters), as a stand-in: a worker of that release runs what the new one sends.
def _fail_of_757df6b(message: dict[str, Any], error: str, retry_in_s: float | None = None,
                     dead: bool = False) -> None:
    """The body there: ``relay.settle("failed", message=..., error=..., retry_in_s=..., dead=...)``."""


class _DeadStore:
    """A store whose ``mark_failed`` buries the row; nothing else is asked of it."""

    def mark_failed(self, *args: Any, **kwargs: Any) -> Any:
        from outbox.core.model import FailResult
        return FailResult(applied=True, dead=True)


class _DeadLetters:
    def __init__(self) -> None:
        self.headers: list[Any] = []

    def publish_dead(self, message: OutboxMessage, error: str, headers: Any = None) -> None:
        self.headers.append(headers)


def _handed_burial() -> tuple[str, dict[str, Any]]:
    from datetime import datetime

    from outbox.relay.settle import Settler

    class DownStore:
        def mark_failed(self, *args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("database down")

    handed: list[tuple[str, dict[str, Any]]] = []
    message = OutboxMessage(id=7, message_id="m7", topic="t", aggregate_type="a", aggregate_id="1", partition_key=None,
                            payload="{}", headers={}, trace_id=None, attempts=0,
                            created_at=datetime.now(UTC), lease="L" * 32)
    Settler(DownStore(), lambda op, kwargs: handed.append((op, json.loads(json.dumps(kwargs))))).failed(
        message, "overtaken", None, dead=True, dead_headers={"x-outbox-overtaken-by": [8, 9]})
    [(operation, kwargs)] = handed
    return operation, kwargs


def test_a_burial_handed_to_the_ack_queue_runs_on_a_worker_of_the_previous_release() -> None:
    """Found in the upgrade review: the fail task's message gained a ``dead_headers`` keyword that
    the previous release's task refuses (TypeError, retried, then lost during a rolling deploy:
    the overtaken event was claimed again and published after the events that overtook it).
    The headers travel inside the message dict, whose unknown keys every release ignores."""
    import inspect

    from outbox.core.model import message_from_dict
    from outbox.relay.settle import apply_fallback

    operation, kwargs = _handed_burial()
    assert operation == "failed"
    inspect.signature(_fail_of_757df6b).bind(**kwargs)  # the previous release takes the message
    assert message_from_dict(kwargs["message"]).id == 7  # and reads its row out of it
    dead_letters = _DeadLetters()
    assert apply_fallback(_DeadStore(), dead_letters, operation, kwargs).dead  # type: ignore[arg-type]
    assert dead_letters.headers == [{"x-outbox-overtaken-by": [8, 9]}]  # this release still sends them


def test_a_burial_the_previous_release_handed_on_runs_here() -> None:
    """Its message, without any dead-letter headers, and the current task signatures take it."""
    import inspect

    from outbox.relay.settle import apply_fallback

    _, kwargs = _handed_burial()
    old = {"message": {k: v for k, v in kwargs["message"].items() if k != "dead_headers"}, "error": kwargs["error"],
           "retry_in_s": None, "dead": True}
    from outbox.celery.tasks import fail as celery_fail
    inspect.signature(celery_fail.run).bind(**old)
    dead_letters = _DeadLetters()
    assert apply_fallback(_DeadStore(), dead_letters, "failed", old).dead  # type: ignore[arg-type]
    assert dead_letters.headers == [None]


# -- the back-off ------------------------------------------------------------------------------

def test_retry_delay_is_exponential_capped_and_jittered() -> None:
    assert retry_delay(1, 1.0, 60, rng=lambda: 0.0) == timedelta(seconds=0.5)
    assert retry_delay(1, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=1)
    assert retry_delay(4, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=8)
    assert retry_delay(30, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=60)
    assert retry_delay(30, 1.0, 60, rng=lambda: 0.0) == timedelta(seconds=30)
