"""The relay's logic (``outbox.relay``) without Celery: a real SQLite store in a file, and
a scripted in-memory publisher standing in for the broker (pure logic only; the real
publisher and broker are exercised end to end in test_relay_e2e.py)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from outbox import Status, enqueue
from outbox.errors import ConfigError
from outbox.model import OutboxMessage
from outbox.publisher import ChainResult, FailureKind, PublishFailure
from outbox.relay import (ACK_QUEUE, CLAIM_QUEUE, CLAIM_TASK, PUBLISH_QUEUE, PURGE_QUEUE, PURGE_TASK, FileBreaker,
                          LocalBreaker, RelayOptions, Settler, apply_fallback, handle_chain, handle_claim,
                          handle_publish, message_from_dict, message_to_dict, plan_tasks, retry_delay,
                          still_held)
from outbox.chains import split_chains
from outbox.store import OutboxStore

from services import REDIS_URL, reachable

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path: Path) -> Iterator[OutboxStore]:
    s = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", claim_timeout_ms=60_000, max_attempts=3)
    s.migrate()
    yield s
    s.close()


@pytest.fixture
def conn(tmp_path: Path, store: OutboxStore) -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(tmp_path / "outbox.db", timeout=30)
    yield c
    c.close()


def add(conn: sqlite3.Connection, aggregate: str, count: int = 1, payload: Any = None, **kw: Any) -> list[int]:
    ids = [enqueue(conn, topic="orders.created", aggregate_type="order", aggregate_id=aggregate,
                   payload=payload if payload is not None else {"aggregate": aggregate, "n": i}, **kw)
           for i in range(count)]
    conn.commit()
    return ids


def rows(store: OutboxStore) -> dict[int, dict[str, Any]]:
    with store.transaction() as cursor:
        found = store.engine.execute(
            cursor, f"SELECT id, status, attempts, next_retry_at, last_error, lease_token FROM {store.engine.table}"
        ).fetchall()
    return {int(r[0]): {"status": int(r[1]), "attempts": int(r[2]), "next_retry_at": r[3], "last_error": r[4],
                        "lease": r[5]} for r in found}


def status_of(store: OutboxStore) -> dict[int, int]:
    return {id: r["status"] for id, r in rows(store).items()}


class ScriptedPublisher:
    """Publishes in memory; ``failures`` maps an outbox id to the failure kind it gets
    (once, or every time with ``sticky``)."""

    def __init__(self, failures: dict[int, FailureKind] | None = None, sticky: bool = False,
                 raises: Exception | None = None) -> None:
        self.failures = dict(failures or {})
        self.sticky = sticky
        self.raises = raises
        self.sent: list[OutboxMessage] = []
        self.dead: list[tuple[OutboxMessage, str]] = []

    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        if self.raises is not None:
            raise self.raises
        published: list[int] = []
        for m in messages:
            kind = self.failures.get(m.id)
            if kind is not None:
                if not self.sticky:
                    del self.failures[m.id]
                return ChainResult(tuple(published), m.id, PublishFailure(kind, f"scripted {kind.value}"))
            self.sent.append(m)
            published.append(m.id)
        return ChainResult(tuple(published))

    def publish_dead(self, message: OutboxMessage, error: str) -> None:
        self.dead.append((message, error))
        return None

    def close(self) -> None:
        pass


class Collect:
    """A ``dispatch`` that keeps the publish tasks it is given."""

    def __init__(self) -> None:
        self.tasks: list[tuple[list[list[OutboxMessage]], float]] = []

    def __call__(self, chains: list[list[OutboxMessage]], deadline: float) -> None:
        self.tasks.append((chains, deadline))

    @property
    def chains(self) -> list[list[OutboxMessage]]:
        return [chain for task, _ in self.tasks for chain in task]


def claim_chains(store: OutboxStore, batch: int = 100) -> list[list[OutboxMessage]]:
    return split_chains(store.claim(batch).messages)


# -- claiming ----------------------------------------------------------------------------------

def test_claim_dispatches_every_row_in_per_aggregate_chains(store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3)
    b = add(conn, "b", 2)
    c = add(conn, "c", 1)
    a += add(conn, "a", 2)
    sent = Collect()
    before = time.time()
    outcome = handle_claim(store, sent, batch_size=100, lease_s=60.0, options=RelayOptions(task_rows=4))
    assert outcome.claimed == outcome.dispatched == 8 and outcome.released == 0
    assert not outcome.full and not outcome.more
    chains = {chain[0].aggregate_id: [m.id for m in chain] for chain in sent.chains}
    assert chains == {"a": a, "b": b, "c": c}
    # Chains are packed into tasks of about task_rows rows, oldest chain first, never split.
    assert [sum(len(ch) for ch in task) for task, _ in sent.tasks] == [5, 3]
    assert [ch[0].aggregate_id for ch in sent.tasks[0][0]] == ["a"]
    # The deadline is inside the lease.
    assert all(before + 0.8 * 60 - 1 <= deadline <= time.time() + 0.8 * 60 for _, deadline in sent.tasks)
    assert set(status_of(store).values()) == {Status.CLAIMED}


def test_a_small_claim_is_published_by_the_claim_itself(store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 1)
    sent, here = Collect(), Collect()
    outcome = handle_claim(store, sent, batch_size=100, lease_s=60.0, options=RelayOptions(task_rows=1),
                           publish_inline=here)
    assert outcome.inline and outcome.claimed == outcome.dispatched == 3 and not outcome.more
    assert sent.tasks == []  # no hop through Celery's broker
    assert len(here.tasks) == 1 and [[m.id for m in chain] for chain in here.chains] == [a, b]


def test_a_full_or_larger_claim_still_goes_out_as_publish_tasks(store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    add(conn, "a", 3)
    add(conn, "b", 3)
    for batch_size, options in ((3, RelayOptions()),  # full: a backlog, every process gets work
                                (100, RelayOptions(inline_rows=2)),  # more rows than inline_rows
                                (100, RelayOptions(inline_rows=0))):  # turned off
        sent, here = Collect(), Collect()
        outcome = handle_claim(store, sent, batch_size=batch_size, lease_s=60.0, options=options,
                               publish_inline=here)
        assert not outcome.inline and here.tasks == []
        assert outcome.dispatched == sum(len(c) for c in sent.chains) == outcome.claimed > 0
        for chain in sent.chains:
            store.release([m.id for m in chain], chain[0].lease)


def test_full_batch_asks_for_more(store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 5)
    add(conn, "b", 5)
    sent = Collect()
    first = handle_claim(store, sent, batch_size=6, lease_s=60.0)
    assert first.full and first.more
    second = handle_claim(store, sent, batch_size=6, lease_s=60.0)
    # Only what is not blocked behind a claimed row may come next: nothing, here.
    assert second.claimed == 0 and not second.more


def test_byte_budget_releases_the_rest_of_the_batch(store: OutboxStore, conn: sqlite3.Connection) -> None:
    big = {"blob": "x" * 4000}
    a = add(conn, "a", 3, payload=big)
    b = add(conn, "b", 3, payload=big)
    sent = Collect()
    outcome = handle_claim(store, sent, batch_size=100, lease_s=60.0,
                           options=RelayOptions(max_batch_bytes=3 * 4300, task_rows=100))
    assert outcome.trimmed and outcome.more
    assert [m.id for m in sent.chains[0]] == a and len(sent.chains) == 1
    assert outcome.dispatched == 3 and outcome.released == 3
    state = rows(store)
    assert all(state[i]["status"] == Status.PENDING and state[i]["attempts"] == 0 for i in b)
    # The released aggregate is claimable again at once.
    assert [m.id for m in store.claim(100).messages] == b


def test_byte_budget_cuts_a_chain_and_always_sends_the_first_row(store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3, payload={"blob": "y" * 10_000})
    sent = Collect()
    outcome = handle_claim(store, sent, batch_size=100, lease_s=60.0, options=RelayOptions(max_batch_bytes=1000))
    assert [m.id for m in sent.chains[0]] == a[:1]
    assert outcome.released == 2
    # The tail waits behind its claimed head: nothing of "a" can be claimed now.
    assert store.claim(100).messages == []


def test_plan_tasks_packs_without_splitting_chains() -> None:
    def msgs(agg: str, ids: list[int]) -> list[OutboxMessage]:
        from datetime import datetime, timezone
        return [OutboxMessage(i, f"m{i}", "t", "order", agg, None, "{}", {}, None, 0,
                              datetime.now(timezone.utc), "L") for i in ids]
    chains = [msgs("a", [1, 2, 3]), msgs("b", [4]), msgs("c", [5, 6]), msgs("d", [7])]
    tasks, over = plan_tasks(chains, task_rows=3, max_bytes=10**9)
    assert [[[m.id for m in ch] for ch in t] for t in tasks] == [[[1, 2, 3]], [[4], [5, 6]], [[7]]]
    assert over == []
    tasks, over = plan_tasks(chains, task_rows=1, max_bytes=10**9)
    assert len(tasks) == 4  # task_rows=1: one task per chain


def test_claims_hold_back_while_the_publish_queue_is_full(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    sent = Collect()
    outcome = handle_claim(store, sent, batch_size=100, lease_s=60.0, options=RelayOptions(max_queued_tasks=4),
                           queued=lambda: 4)
    assert outcome.saturated and outcome.claimed == 0 and sent.tasks == []
    assert all(status_of(store)[i] == Status.PENDING for i in ids)
    # An unknown queue length does not stop the relay.
    assert handle_claim(store, sent, batch_size=100, lease_s=60.0, queued=lambda: None).claimed == 2


def test_claims_pause_while_the_breaker_is_open(store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 2)
    breaker = LocalBreaker()
    breaker.trip(30, "backpressure: test")
    outcome = handle_claim(store, Collect(), batch_size=100, lease_s=60.0, breaker=breaker)
    assert outcome.paused > 29 and outcome.claimed == 0
    breaker.reset()
    assert handle_claim(store, Collect(), batch_size=100, lease_s=60.0, breaker=breaker).claimed == 2


def test_failed_dispatch_releases_the_rows_without_spending_attempts(store: OutboxStore,
                                                                     conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 2)
    calls: list[Any] = []

    def dispatch(chains: Any, deadline: float) -> None:
        calls.append(chains)
        if len(calls) == 2:
            raise ConnectionError("Celery's broker is down")

    outcome = handle_claim(store, dispatch, batch_size=100, lease_s=60.0, options=RelayOptions(task_rows=1))
    assert outcome.error and not outcome.more
    assert outcome.dispatched == 2 and outcome.released == 2
    state = rows(store)
    assert [state[i]["status"] for i in a] == [Status.CLAIMED] * 2
    assert [(state[i]["status"], state[i]["attempts"]) for i in b] == [(Status.PENDING, 0)] * 2


# -- publishing a chain ------------------------------------------------------------------------

def test_published_chain_is_done(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    publisher = ScriptedPublisher()
    [chain] = claim_chains(store)
    outcome = handle_chain(store, publisher, chain)
    assert outcome.published == ids and outcome.failed_id is None
    assert [m.id for m in publisher.sent] == ids
    assert all(status_of(store)[i] == Status.DONE for i in ids)


def test_a_publish_task_delivered_again_skips_chains_its_lease_no_longer_holds(
        store: OutboxStore, conn: sqlite3.Connection) -> None:
    """The first run released chain a (a warm shutdown) and published chain b; a new
    claim now holds a. The second delivery must publish neither."""
    a, b, c = add(conn, "a", 2), add(conn, "b", 2), add(conn, "c", 2)
    chains = claim_chains(store)
    by_aggregate = {chain[0].aggregate_id: chain for chain in chains}
    lease = chains[0][0].lease
    store.release(a, lease)
    store.mark_done(b, lease)
    reclaimed = store.claim(100)
    assert sorted(m.id for m in reclaimed.messages) == a
    assert still_held(store, chains) == [by_aggregate["c"]]
    assert store.held(a + b + c, lease) == set(c)
    assert store.held(a, reclaimed.lease) == set(a)


def test_retriable_failure_acks_prefix_fails_k_and_releases_the_rest(store: OutboxStore,
                                                                   conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 4)
    publisher = ScriptedPublisher({ids[1]: FailureKind.RETRIABLE})
    [chain] = claim_chains(store)
    options = RelayOptions(backoff_base_s=10, backoff_max_s=100)
    outcome = handle_chain(store, publisher, chain, options=options, rng=lambda: 1.0)
    assert outcome.published == ids[:1] and outcome.failed_id == ids[1] and outcome.kind == "retriable"
    state = rows(store)
    assert state[ids[0]]["status"] == Status.DONE
    assert (state[ids[1]]["status"], state[ids[1]]["attempts"]) == (Status.FAILED, 1)
    assert "retriable" in state[ids[1]]["last_error"] and state[ids[1]]["next_retry_at"] is not None
    assert [(state[i]["status"], state[i]["attempts"]) for i in ids[2:]] == [(Status.PENDING, 0)] * 2
    # The aggregate waits for the failed event: nothing is claimable until its retry is due.
    assert store.claim(100).messages == []


def test_retry_time_follows_the_back_off(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 1)
    publisher = ScriptedPublisher({ids[0]: FailureKind.RETRIABLE})
    [chain] = claim_chains(store)
    handle_chain(store, publisher, chain, options=RelayOptions(backoff_base_s=0.2, backoff_max_s=0.2))
    assert store.claim(100).messages == []
    time.sleep(0.25)
    [again] = store.claim(100).messages
    assert again.id == ids[0] and again.attempt == 2


def test_poison_goes_dead_at_once_and_the_aggregate_moves_on(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    publisher = ScriptedPublisher({ids[1]: FailureKind.POISON})
    [chain] = claim_chains(store)
    outcome = handle_chain(store, publisher, chain)
    assert outcome.dead and outcome.kind == "poison"
    state = rows(store)
    assert (state[ids[0]]["status"], state[ids[1]]["status"], state[ids[2]]["status"]) == (
        Status.DONE, Status.DEAD, Status.PENDING)
    assert state[ids[2]]["attempts"] == 0
    assert [(m.id, "poison" in err) for m, err in publisher.dead] == [(ids[1], True)]
    [rest] = claim_chains(store)
    assert [m.id for m in rest] == ids[2:]


def test_last_retriable_attempt_goes_dead_and_is_dead_lettered(store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher({ids[0]: FailureKind.RETRIABLE}, sticky=True)
    options = RelayOptions(backoff_base_s=0.01, backoff_max_s=0.01)
    for attempt in range(1, 4):
        time.sleep(0.05)
        [chain] = claim_chains(store)
        assert chain[0].id == ids[0] and chain[0].attempt == attempt
        outcome = handle_chain(store, publisher, chain, options=options)
    assert outcome.dead  # max_attempts=3
    assert status_of(store)[ids[0]] == Status.DEAD
    assert [m.id for m, _ in publisher.dead] == [ids[0]]
    [rest] = claim_chains(store)
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
        outcome = handle_claim(store, sent, batch_size=100, lease_s=0.2, publisher=publisher)
        assert outcome.dead == 1 and outcome.claimed == outcome.dispatched == 1
        assert [(m.id, m.aggregate_id) for m, _ in publisher.dead] == [(a1, "a")]
        [(_, error)] = publisher.dead
        assert error.startswith("lease_expired: lease expired") and "no attempts left" in error
        # The rows behind the dead one wait for the next claim (the store's rule on every
        # engine); other aggregates are dispatched at once.
        assert [[m.id for m in chain] for chain in sent.chains] == [b]
        state = rows(store)
        assert state[a1]["status"] == Status.DEAD and "lease expired" in state[a1]["last_error"]
        assert handle_claim(store, sent, batch_size=100, lease_s=0.2, publisher=publisher).dead == 0
        assert [[m.id for m in chain] for chain in sent.chains] == [b, a_rest]
        assert len(publisher.dead) == 1 and publisher.sent == []  # a claim publishes only dead-letter copies
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
        outcome = handle_claim(store, Collect(), batch_size=10, lease_s=0.1, publisher=publisher)
        assert (outcome.claimed, outcome.dead) == (0, 2)
        assert [m.id for m, _ in publisher.dead] == ids
        # Without a publisher (or with one whose dead-letter publish blows up) the rows are
        # dead in the table all the same, which stays the record of truth.
        ids2 = add(conn, "c", 1)
        store.claim(10)
        time.sleep(0.2)

        class Broken(ScriptedPublisher):
            def publish_dead(self, message: OutboxMessage, error: str) -> None:
                raise ConnectionError("dead-letter broker down")

        assert handle_claim(store, Collect(), batch_size=10, lease_s=0.1, publisher=Broken()).dead == 1
        assert status_of(store)[ids2[0]] == Status.DEAD
        assert handle_claim(store, Collect(), batch_size=10, lease_s=0.1).dead == 0
    finally:
        store.close()


def test_backpressure_releases_without_attempt_and_opens_the_breaker(store: OutboxStore,
                                                                      conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    other = add(conn, "b", 1)
    publisher = ScriptedPublisher({ids[1]: FailureKind.BACKPRESSURE})
    breaker = LocalBreaker()
    chains = claim_chains(store)
    outcome = handle_chain(store, publisher, chains[0], options=RelayOptions(breaker_s=30), breaker=breaker)
    assert outcome.kind == "backpressure" and outcome.released == ids[1:]
    state = rows(store)
    assert state[ids[0]]["status"] == Status.DONE
    assert [(state[i]["status"], state[i]["attempts"]) for i in ids[1:]] == [(Status.PENDING, 0)] * 2
    assert state[ids[1]]["next_retry_at"] is not None  # they wait out the pause
    assert breaker.open_for() > 29 and breaker.reason.startswith("backpressure")
    # Chains already in hand are not even tried while it is open: released, no attempt.
    skipped = handle_chain(store, publisher, chains[1], breaker=breaker)
    assert skipped.skipped and status_of(store)[other[0]] == Status.PENDING
    assert [m.id for m in publisher.sent] == ids[:1]
    # And claims stop.
    assert handle_claim(store, Collect(), batch_size=100, lease_s=60, breaker=breaker).paused > 0


def test_fatal_stops_claims_for_long_with_a_clear_message(store: OutboxStore, conn: sqlite3.Connection,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher({ids[0]: FailureKind.FATAL})
    breaker = LocalBreaker()
    [chain] = claim_chains(store)
    with caplog.at_level(logging.CRITICAL, logger="outbox.relay"):
        outcome = handle_chain(store, publisher, chain, options=RelayOptions(fatal_pause_s=300), breaker=breaker)
    assert outcome.kind == "fatal"
    assert breaker.open_for() > 290 and breaker.reason.startswith("fatal")
    assert any("FATAL" in r.getMessage() and f"outbox_id={ids[0]}" in r.getMessage() for r in caplog.records)
    assert [(r["status"], r["attempts"]) for r in rows(store).values()] == [(Status.PENDING, 0)] * 2
    # A later back-pressure trip never shortens the fatal pause.
    breaker.trip(1, "backpressure: short")
    assert breaker.open_for() > 290 and breaker.reason.startswith("fatal")


def test_a_publisher_that_raises_counts_against_the_head(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    [chain] = claim_chains(store)
    outcome = handle_chain(store, ScriptedPublisher(raises=RuntimeError("boom")), chain)
    assert outcome.failed_id == ids[0] and outcome.kind == "retriable"
    state = rows(store)
    assert (state[ids[0]]["status"], state[ids[0]]["attempts"]) == (Status.FAILED, 1)
    assert "boom" in state[ids[0]]["last_error"]
    assert state[ids[1]]["status"] == Status.PENDING


def test_only_a_true_prefix_is_acked(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)

    class Liar(ScriptedPublisher):
        def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
            return ChainResult((messages[0].id, messages[2].id))  # skips the second: not a prefix

    [chain] = claim_chains(store)
    outcome = handle_chain(store, Liar(), chain)
    assert outcome.published == ids[:1]
    assert [status_of(store)[i] for i in ids] == [Status.DONE, Status.PENDING, Status.PENDING]


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
        handle_chain(short, publisher, chain)
    state = rows(short)
    assert [(state[i]["status"], state[i]["lease"]) for i in a + b] == [(Status.CLAIMED, new[0][0].lease)] * 2
    for chain in new:
        handle_chain(short, ScriptedPublisher(), chain)
    assert [status_of(short)[i] for i in a + b] == [Status.DONE] * 2
    short.close()


def test_publish_task_past_its_deadline_leaves_rows_to_the_lease(store: OutboxStore,
                                                                  conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    publisher = ScriptedPublisher()
    chains = claim_chains(store)
    outcomes = handle_publish(store, publisher, chains, deadline=time.time() - 1)
    assert outcomes[0].skipped and publisher.sent == []
    assert [status_of(store)[i] for i in ids] == [Status.CLAIMED] * 2


def test_publish_task_started_while_stopping_releases_its_chains(store: OutboxStore,
                                                                 conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 1)
    publisher = ScriptedPublisher()
    chains = claim_chains(store)
    outcomes = handle_publish(store, publisher, chains, deadline=time.time() + 60, stopping=lambda: True)
    assert publisher.sent == [] and all(o.skipped for o in outcomes)
    assert {i: (r["status"], r["attempts"]) for i, r in rows(store).items()} == {
        i: (Status.PENDING, 0) for i in a + b}


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


def test_a_publish_task_marks_its_published_prefixes_done_in_one_write(store: OutboxStore,
                                                                       conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3)
    b = add(conn, "b", 2)
    c = add(conn, "c", 1)
    chains = claim_chains(store)
    counting = CountingStore(store)
    publisher = ScriptedPublisher({a[1]: FailureKind.RETRIABLE})
    outcomes = handle_publish(counting, publisher, chains, deadline=time.time() + 60)
    assert counting.done_calls == [[a[0]] + b + c]  # one write for the whole task
    assert [o.published for o in outcomes] == [[a[0]], b, c]
    assert outcomes[0].failed_id == a[1] and outcomes[0].released == [a[2]]
    states = status_of(store)
    assert [states[i] for i in a] == [Status.DONE, Status.FAILED, Status.PENDING]
    assert all(states[i] == Status.DONE for i in b + c)


# -- store writes that fail go to the ack queue's tasks -----------------------------------------

def test_failed_store_writes_are_handed_to_the_fallback(store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 3)
    [chain] = claim_chains(store)

    class DownStore:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any, **kwargs: Any) -> Any:
                raise ConnectionError("database down")
            return fail

    handed: list[tuple[str, dict[str, Any]]] = []
    settler = Settler(DownStore(), lambda op, kwargs: handed.append((op, json.loads(json.dumps(kwargs)))))
    publisher = ScriptedPublisher({ids[1]: FailureKind.POISON})
    handle_chain(store, publisher, chain, settler=settler)
    assert [op for op, _ in handed] == ["done", "failed", "release"]
    assert publisher.dead == []  # dead-lettering waits until the row really is dead
    # The fallback tasks apply them later, on the real store (JSON round trip included).
    for op, kwargs in handed:
        apply_fallback(store, publisher, op, kwargs)
    assert [status_of(store)[i] for i in ids] == [Status.DONE, Status.DEAD, Status.PENDING]
    assert [m.id for m, _ in publisher.dead] == [ids[1]]


# -- small pieces ------------------------------------------------------------------------------

def test_retry_delay_is_exponential_capped_and_jittered() -> None:
    assert retry_delay(1, 1.0, 60, rng=lambda: 0.0) == timedelta(seconds=0.5)
    assert retry_delay(1, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=1)
    assert retry_delay(4, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=8)
    assert retry_delay(30, 1.0, 60, rng=lambda: 1.0) == timedelta(seconds=60)
    assert retry_delay(30, 1.0, 60, rng=lambda: 0.0) == timedelta(seconds=30)


def test_messages_survive_the_trip_through_celery(store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 1, payload={"ü": [1, 2.5, None]}, headers={"tenant": "t1"}, key="pk")
    [message] = store.claim(10).messages
    assert message_from_dict(json.loads(json.dumps(message_to_dict(message)))) == message


def test_relay_options_from_settings_sources() -> None:
    from outbox.publisher import DEFAULT_MAX_MESSAGE_BYTES
    assert RelayOptions().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert RelayOptions.from_sources({"OUTBOX_RELAY_MAX_MESSAGE_BYTES": "2048"}).max_message_bytes == 2048
    options = RelayOptions.from_sources({"OUTBOX_RELAY_TASK_ROWS": 7}, {"OUTBOX_RELAY_TASK_ROWS": "9",
                                                                      "OUTBOX_RELAY_BREAKER_S": "2.5"})
    assert (options.task_rows, options.breaker_s) == (7, 2.5)
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_MAX_QUEUED_TASKS"):
        RelayOptions.from_sources({"OUTBOX_RELAY_MAX_QUEUED_TASKS": "many"})
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_BREAKER_S"):
        RelayOptions.from_sources({"OUTBOX_RELAY_BREAKER_S": "0"})
    assert RelayOptions.from_sources({"OUTBOX_RELAY_INLINE_ROWS": "0"}).inline_rows == 0  # 0 = off
    with pytest.raises(ConfigError, match="OUTBOX_RELAY_INLINE_ROWS.*>= 0"):
        RelayOptions.from_sources({"OUTBOX_RELAY_INLINE_ROWS": "-1"})


def test_file_breaker_is_shared_between_instances(tmp_path: Path) -> None:
    path = str(tmp_path / "breaker.json")
    one, two = FileBreaker(path), FileBreaker(path)
    assert one.open_for() == 0 and two.open_for() == 0
    one.trip(30, "backpressure: down")
    two._checked = 0  # skip the read cache
    assert two.open_for() > 29 and two.reason == "backpressure: down"
    two.reset()
    one._until, one._checked = 0, 0
    assert one.open_for() == 0


def test_redis_breaker_is_shared_and_expires() -> None:
    if not reachable("127.0.0.1", 6379):
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    import uuid

    from outbox.relay import RedisBreaker
    key = f"outbox:breaker:test-{uuid.uuid4().hex}"
    one, two = RedisBreaker(REDIS_URL, key), RedisBreaker(REDIS_URL, key)
    try:
        one.trip(0.5, "backpressure: down")
        assert 0 < two.open_for() <= 0.5 and two.reason == "backpressure: down"
        time.sleep(0.6)
        three = RedisBreaker(REDIS_URL, key)
        assert three.open_for() == 0 and one.client.get(key) is None
    finally:
        one.reset()


# -- the Celery app and the schedule (in a subprocess: a fresh app each time) --------------------

def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    return subprocess.run([PYTHON, "-c", code], cwd=cwd, env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


def test_celery_finds_the_app_from_any_directory_and_beat_uses_the_schedule(tmp_path: Path) -> None:
    code = """
import json
from celery.app.utils import find_app
import beat_schedule
app = find_app("outbox")
import outbox.celery
assert app is outbox.celery.app, app
print(json.dumps({"beat": app.conf.beat_schedule, "queues": [q.name for q in app.conf.task_queues],
                  "routes": app.conf.task_routes, "broker": app.conf.broker_url,
                  "prefetch": app.conf.worker_prefetch_multiplier, "pool": app.conf.worker_pool,
                  "expected": beat_schedule.build_schedule()}))
"""
    done = run_python(code, tmp_path, OUTBOX_CLAIM_INTERVAL_S="0.5", OUTBOX_RELAY_PURGE_INTERVAL_S="120",
                      OUTBOX_CELERY_BROKER_URL="redis://127.0.0.1:6379/14")
    assert done.returncode == 0, done.stderr
    conf = json.loads(done.stdout)
    assert conf["beat"] == conf["expected"]
    assert conf["beat"]["outbox-claim"] == {"task": CLAIM_TASK, "schedule": 0.5,
                                            "options": {"queue": CLAIM_QUEUE, "expires": 0.5}}
    assert conf["beat"]["outbox-purge"]["task"] == PURGE_TASK and conf["beat"]["outbox-purge"]["schedule"] == 120
    assert conf["queues"] == [CLAIM_QUEUE, PUBLISH_QUEUE, ACK_QUEUE, PURGE_QUEUE]
    assert conf["broker"] == "redis://127.0.0.1:6379/14" and conf["prefetch"] == 1
    assert conf["routes"]["outbox.fail"] == {"queue": ACK_QUEUE}


def test_celery_config_keys_override_the_environment(tmp_path: Path) -> None:
    (tmp_path / "relayconf.py").write_text("OUTBOX_BATCH_SIZE = 7\nOUTBOX_RELAY_TASK_ROWS = 3\n")
    code = """
import outbox.celery as c
print(c.relay_settings().batch_size, c.relay_options().task_rows, c.app.conf.worker_pool)
"""
    done = run_python(code, tmp_path, OUTBOX_BATCH_SIZE="5", OUTBOX_RELAY_TASK_ROWS="9",
                      CELERY_CONFIG_MODULE="relayconf", PYTHONPATH=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "3", "threads"]  # memory:// broker next to SQLite: threads


def test_an_invalid_setting_stops_the_worker_with_one_line(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    done = subprocess.run([str(Path(PYTHON).parent / "celery"), "-A", "outbox", "worker"], cwd=tmp_path,
                          env={**clean, "OUTBOX_CLAIM_TIMEOUT_MS": "99999999999"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("outbox: invalid configuration: OUTBOX_CLAIM_TIMEOUT_MS")
    assert "Traceback" not in done.stderr


def test_publish_queue_length_and_coalesced_claim_requests_on_redis(tmp_path: Path) -> None:
    """What bounds rows in flight (the publish queue's length) and what coalesces drain-mode
    claims (one requested claim at a time), against Celery's real Redis broker."""
    if not reachable("127.0.0.1", 6379):
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    import uuid
    prefix = f"outbox-unit-{uuid.uuid4().hex[:8]}:"
    (tmp_path / "qconf.py").write_text(f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    code = f"""
import redis
import outbox.tasks as t
from outbox.relay import PUBLISH_QUEUE, CLAIM_QUEUE
seen = [t.queued_publish_tasks()]
for _ in range(3):
    t.publish.apply_async(kwargs={{"chains": [], "deadline": 0}}, queue=PUBLISH_QUEUE)
seen.append(t.queued_publish_tasks())
requests = [t.request_claim(), t.request_claim(), t.request_claim()]
with t.app.pool.acquire(block=True) as conn:
    claims = conn.default_channel._size(CLAIM_QUEUE)
t.coalescer().clear()
requests.append(t.request_claim())
r = redis.Redis.from_url({REDIS_URL!r})
for key in r.keys({prefix!r} + "*"):
    r.delete(key)
t.coalescer().clear()
print(seen, requests, claims)
"""
    done = run_python(code, tmp_path, OUTBOX_CELERY_BROKER_URL=REDIS_URL, CELERY_CONFIG_MODULE="qconf",
                      PYTHONPATH=str(tmp_path), OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[0, 3] [True, False, False, True] 1"


def test_pool_children_see_the_shutdown_through_the_main_process_marker(tmp_path: Path) -> None:
    """Celery signals a warm shutdown to the main process only; a prefork child learns of
    it from the marker file its parent leaves, and then neither claims nor publishes."""
    code = """
import os, tempfile
from celery import signals
import outbox.tasks as t
tempfile.tempdir = os.environ["TMPDIR_FOR_TEST"]
signals.worker_process_init.send(sender=None)   # as in a pool child: the parent is our parent
before = t.stopping()
marker = t._stopping_marker(os.getppid())
marker.touch()                                   # what the parent's worker_shutting_down leaves
during = (t.stopping(), t.claim(), t.request_claim())
marker.unlink()
print(before, *during, t.stopping())
"""
    done = run_python(code, tmp_path, TMPDIR_FOR_TEST=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "{'stopped':", "True}", "False", "False"]


def test_the_main_process_leaves_and_removes_the_marker(tmp_path: Path) -> None:
    code = """
import os, tempfile
from celery import signals
import outbox.tasks as t
tempfile.tempdir = os.environ["TMPDIR_FOR_TEST"]
marker = t._stopping_marker(os.getpid())
marker.touch()                                   # left by an earlier process with this pid
signals.worker_init.send(sender=None)
started = marker.exists()
signals.worker_shutting_down.send(sender=None, sig="TERM", how="Warm", exitcode=0)
print(started, marker.exists(), t.stopping())
signals.worker_shutdown.send(sender=None)
print(marker.exists())
"""
    done = run_python(code, tmp_path, TMPDIR_FOR_TEST=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "False"]


def test_only_a_claim_after_a_backlog_reads_the_publish_queue_length(tmp_path: Path) -> None:
    """The in-flight bound costs a round trip to Celery's broker; a process reads the
    publish queue's length before a claim only when its previous claim met a backlog (its
    first claim too), so live traffic skips it."""
    code = """
import os, sqlite3
import outbox.tasks as t
from outbox import enqueue
reads = []
def counting():
    reads.append(1)
    return 0
t.queued_publish_tasks = counting
store = t.resources().store
store.migrate()
conn = sqlite3.connect(os.environ["DB_PATH"])
def add(n):
    for i in range(n):
        enqueue(conn, topic="t", aggregate_type="a", aggregate_id=f"a{i}", payload={"i": i})
    conn.commit()
seen = []
for rows in (1, 1, 2, 1, 1):      # batch size 2: the third claim comes back full
    add(rows)
    before = len(reads)
    t.claim()
    seen.append(len(reads) - before)
print(*seen)
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", OUTBOX_BATCH_SIZE="2",
                      DB_PATH=str(tmp_path / "o.db"))
    assert done.returncode == 0, done.stderr
    # first claim: checked (nothing known yet); small claims: not; after the full one: checked once
    assert done.stdout.split() == ["1", "0", "0", "1", "0"]
