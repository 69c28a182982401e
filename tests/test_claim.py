"""Claiming (``outbox.relay.handle_claim`` and what sizes it), without Celery: per-aggregate
chains packed into publish tasks, the inline publish of small and backlog claims, the byte
budget and claim sizing, and what holds claims back (the publish queue's length, the breaker,
a failed dispatch), and the drain slice a claim task runs on every runner. Helpers and
fixtures: tests/relay_support.py."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from relay_support import Collect, ScriptedPublisher, add, rows, run_python, status_of
from services import REDIS_URL, reachable

from outbox import Status
from outbox.core.model import OutboxMessage
from outbox.relay import (
    Backlog,
    Breaker,
    ClaimOutcome,
    ClaimSizer,
    Drain,
    Outage,
    RelayContext,
    RelayOptions,
    drain_slice,
    handle_claim,
    handle_publish,
    plan_tasks,
)
from outbox.storage.store import OutboxStore


def test_claim_dispatches_every_row_in_per_aggregate_chains(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3)
    b = add(conn, "b", 2)
    c = add(conn, "c", 1)
    a += add(conn, "a", 2)
    sent = Collect()
    before = time.time()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(task_rows=4)), sent, batch_size=100, lease_s=60.0)
    assert outcome.claimed == outcome.dispatched == 8 and outcome.released == 0
    assert not outcome.full and not outcome.more
    chains = {chain[0].aggregate_id: [m.id for m in chain] for chain in sent.chains}
    assert chains == {"a": a, "b": b, "c": c}
    # Chains are packed into tasks of about task_rows rows, oldest chain first, never split.
    assert [sum(len(ch) for ch in task) for task, _ in sent.tasks] == [5, 3]
    assert [ch[0].aggregate_id for ch in sent.tasks[0][0]] == ["a"]
    # The deadline is inside the lease.
    assert all(before + 0.8 * 60 - 1 <= deadline <= time.time() + 0.8 * 60 for _, deadline in sent.tasks)
    assert set(status_of(sqlite_store).values()) == {Status.CLAIMED}


def test_a_small_claim_is_published_by_the_claim_itself(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 1)
    sent, here = Collect(), Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(task_rows=1)), sent, batch_size=100, lease_s=60.0,
                           publish_inline=here)
    assert outcome.inline and outcome.claimed == outcome.dispatched == 3 and not outcome.more
    assert sent.tasks == []  # no hop through Celery's broker
    assert len(here.tasks) == 1 and [[m.id for m in chain] for chain in here.chains] == [a, b]


def test_a_full_or_larger_claim_still_goes_out_as_publish_tasks(sqlite_store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    add(conn, "a", 3)
    add(conn, "b", 3)
    for batch_size, options in ((3, RelayOptions()),  # full: a backlog, every process gets work
                                (100, RelayOptions(inline_rows=2)),  # more rows than inline_rows
                                (100, RelayOptions(inline_rows=0))):  # turned off
        sent, here = Collect(), Collect()
        outcome = handle_claim(RelayContext(sqlite_store, options=options), sent, batch_size=batch_size, lease_s=60.0,
                               publish_inline=here)
        assert not outcome.inline and here.tasks == []
        assert outcome.dispatched == sum(len(c) for c in sent.chains) == outcome.claimed > 0
        for chain in sent.chains:
            sqlite_store.release([m.id for m in chain], chain[0].lease)


def test_a_backlog_claim_publishes_its_first_share_itself_after_asking_for_the_next_claim(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    for name in "abcdef":
        add(conn, name, 1)
    events: list[str] = []
    sent, here = Collect(), Collect()

    def inline(chains: list[list[OutboxMessage]], deadline: float) -> None:
        events.append("publish here")
        here(chains, deadline)

    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(task_rows=2)), sent, batch_size=6, lease_s=60.0,
                           publish_inline=inline, claim_again=lambda: events.append("claim again"))
    assert outcome.full and outcome.more and outcome.inline
    # The next claim is asked for once this one has committed and dispatched, before its own publish.
    assert events == ["claim again", "publish here"]
    assert len(here.tasks) == 1 and sum(len(c) for c in here.chains) == 2  # the first task's share
    assert len(sent.tasks) == 2 and outcome.tasks == 2  # the rest goes out as publish tasks
    assert outcome.dispatched == outcome.claimed == 6
    assert [c[0].aggregate_id for c in here.chains + sent.chains] == list("abcdef")  # oldest work first

    # A claim that is not full asks for nothing before publishing; inline rows 0 turns it all off.
    add(conn, "g", 1)
    events.clear()
    small = handle_claim(RelayContext(sqlite_store), Collect(), batch_size=6, lease_s=60.0, publish_inline=inline,
                         claim_again=lambda: events.append("claim again"))
    assert small.inline and not small.more and events == ["publish here"]
    add(conn, "h", 1)
    off = Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(inline_rows=0)), off, batch_size=6, lease_s=60.0,
                           publish_inline=inline, claim_again=lambda: events.append("claim again"))
    assert not outcome.inline and len(off.tasks) == 1


def test_full_batch_asks_for_more(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 5)
    add(conn, "b", 5)
    sent = Collect()
    first = handle_claim(RelayContext(sqlite_store), sent, batch_size=6, lease_s=60.0)
    assert first.full and first.more
    second = handle_claim(RelayContext(sqlite_store), sent, batch_size=6, lease_s=60.0)
    # Only what is not blocked behind a claimed row may come next: nothing, here.
    assert second.claimed == 0 and not second.more


# -- the byte budget and claim sizing ----------------------------------------------------------

def test_byte_budget_releases_the_rest_of_the_batch(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    big = {"blob": "x" * 4000}
    a = add(conn, "a", 3, payload=big)
    b = add(conn, "b", 3, payload=big)
    sent = Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(max_batch_bytes=3 * 4300, task_rows=100)), sent,
                           batch_size=100, lease_s=60.0)
    assert outcome.trimmed and outcome.more
    assert [m.id for m in sent.chains[0]] == a and len(sent.chains) == 1
    assert outcome.dispatched == 3 and outcome.released == 3
    state = rows(sqlite_store)
    assert all(state[i]["status"] == Status.PENDING and state[i]["attempts"] == 0 for i in b)
    # The released aggregate is claimable again at once.
    assert [m.id for m in sqlite_store.claim(100).messages] == b


def test_byte_budget_cuts_a_chain_and_always_sends_the_first_row(sqlite_store: OutboxStore,
                                                                conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3, payload={"blob": "y" * 10_000})
    sent = Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(max_batch_bytes=1000)), sent, batch_size=100,
                           lease_s=60.0)
    assert [m.id for m in sent.chains[0]] == a[:1]
    assert outcome.released == 2
    # The tail waits behind its claimed head: nothing of "a" can be claimed now.
    assert sqlite_store.claim(100).messages == []


def test_claims_after_large_rows_ask_for_what_fits_the_byte_budget(sqlite_store: OutboxStore,
                                                                    conn: sqlite3.Connection) -> None:
    # Without sizing, every claim would read 100 large rows to send 3 on and release the
    # rest: memory and reads grow with the batch, not the budget (docs/relay.md, "Memory").
    big = {"blob": "x" * 4000}
    for k in range(10):
        add(conn, f"a{k}", 1, payload=big)
    options = RelayOptions(max_batch_bytes=3 * 4300, task_rows=100)
    sizer = ClaimSizer()
    sent = Collect()
    first = handle_claim(RelayContext(sqlite_store, options=options, sizer=sizer), sent, batch_size=100, lease_s=60.0)
    assert first.claimed == 10 and first.released == 7 and first.more  # nothing known yet: the whole batch
    assert sizer.rows(100, options.max_batch_bytes) == 3
    second = handle_claim(RelayContext(sqlite_store, options=options, sizer=sizer), sent, batch_size=100, lease_s=60.0)
    # Asked for the 3 rows that fit: none released, and "full" against what was asked, so drain mode goes on.
    assert second.claimed == second.dispatched == 3 and second.released == 0 and second.more


def test_claim_sizer_follows_large_rows_at_once_and_small_rows_by_halves() -> None:
    def msgs(size: int, n: int) -> list[OutboxMessage]:
        from datetime import datetime
        return [OutboxMessage(i, f"m{i}", "t", "order", "a", None, "x" * size, {}, None, 0,
                              datetime.now(UTC), "L") for i in range(n)]

    sizer = ClaimSizer()
    assert sizer.rows(100, 8_000_000) == 100
    sizer.observe(msgs(1_000_000 - 256, 4))
    assert sizer.rows(100, 8_000_000) == 8
    sizer.observe([])  # an empty claim teaches nothing
    assert sizer.rows(100, 8_000_000) == 8
    sizer.observe(msgs(0, 8))  # 256 bytes a row: half way back
    assert sizer.rows(100, 8_000_000) == 15
    for _ in range(10):
        sizer.observe(msgs(0, 15))
    assert sizer.rows(100, 8_000_000) == 100
    sizer.observe(msgs(100_000_000, 1))
    assert sizer.rows(100, 8_000_000) == 1  # the first row always goes


def test_a_process_first_claims_as_if_rows_were_as_large_as_allowed() -> None:
    sizer = ClaimSizer.at_start(1_048_576)
    from datetime import datetime

    def rows(size: int, n: int) -> list[OutboxMessage]:
        return [OutboxMessage(1, "m", "t", "order", "a", None, "x" * size, {}, None, 0, datetime.now(UTC), "L")] * n

    assert sizer.rows(100, 8 * 1024 * 1024) == 7
    sizer.observe([])  # a claim that found nothing teaches nothing
    assert sizer.rows(100, 8 * 1024 * 1024) == 7
    sizer.observe(rows(2, 7))  # the first rows read replace the assumption: the full batch next
    assert sizer.rows(100, 8 * 1024 * 1024) == 100
    sizer.observe(rows(1_000_000 - 256, 2))  # then as before: large rows followed at once,
    assert sizer.rows(100, 8 * 1024 * 1024) == 8
    sizer.observe(rows(2, 8))  # small ones by halves
    assert sizer.rows(100, 8 * 1024 * 1024) == 16
    # A worker started on large rows keeps its claims small.
    large = ClaimSizer.at_start(1_048_576)
    large.observe(rows(1_000_000, 7))
    assert large.rows(100, 8 * 1024 * 1024) == 8


def test_plan_tasks_packs_without_splitting_chains() -> None:
    def msgs(agg: str, ids: list[int]) -> list[OutboxMessage]:
        from datetime import datetime
        return [OutboxMessage(i, f"m{i}", "t", "order", agg, None, "{}", {}, None, 0,
                              datetime.now(UTC), "L") for i in ids]
    chains = [msgs("a", [1, 2, 3]), msgs("b", [4]), msgs("c", [5, 6]), msgs("d", [7])]
    tasks, over = plan_tasks(chains, task_rows=3, max_bytes=10**9)
    assert [[[m.id for m in ch] for ch in t] for t in tasks] == [[[1, 2, 3]], [[4], [5, 6]], [[7]]]
    assert over == []
    tasks, over = plan_tasks(chains, task_rows=1, max_bytes=10**9)
    assert len(tasks) == 4  # task_rows=1: one task per chain


def test_rows_tried_twice_before_are_sent_each_alone_after_the_rest(sqlite_store: OutboxStore,
                                                               conn: sqlite3.Connection) -> None:
    """An event that kills its worker process is charged its attempts alone (docs/relay.md,
    "An event that kills its worker"): a chain that starts with a row tried twice before goes
    as that row alone, in a task of its own, dispatched after the others and never published
    in the claiming process; a chain with such a row further on is cut before it; what
    follows is released with no attempt spent. A row tried once goes as usual."""
    a = add(conn, "a", 3)
    b = add(conn, "b", 3)
    c = add(conn, "c", 2)
    conn.execute(f"UPDATE {sqlite_store.engine.table} SET attempts = 2 WHERE id IN (?, ?)", (a[0], b[1]))
    conn.execute(f"UPDATE {sqlite_store.engine.table} SET attempts = 1 WHERE id IN (?, ?)", (b[0], c[1]))
    conn.commit()
    sent, here = Collect(), Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(task_rows=100)), sent, batch_size=100,
                           lease_s=60.0, publish_inline=here)
    assert here.tasks == []  # small, yet not published by the claiming process
    assert [[[m.id for m in chain] for chain in task] for task, _ in sent.tasks] == [[[b[0]], c], [[a[0]]]]
    assert outcome.alone == 1 and outcome.claimed == 8 and outcome.dispatched == 4 and outcome.released == 4
    state = rows(sqlite_store)
    assert [(state[i]["status"], state[i]["attempts"]) for i in (a[1], a[2], b[1], b[2])] == [
        (Status.PENDING, 0), (Status.PENDING, 0), (Status.PENDING, 2), (Status.PENDING, 0)]  # none spent


def test_isolate_retried_cuts_each_chain_before_its_first_row_tried_before() -> None:
    from datetime import datetime

    from outbox.relay.claim import isolate_retried

    def msgs(agg: str, attempts: list[int], first: int) -> list[OutboxMessage]:
        return [OutboxMessage(first + n, f"m{first + n}", "t", "order", agg, None, "{}", {}, None, tried,
                              datetime.now(UTC), "L") for n, tried in enumerate(attempts)]

    chains = [msgs("a", [0, 1], 1), msgs("b", [2, 0, 1], 3), msgs("c", [1, 3, 0], 6)]
    kept, alone, release = isolate_retried(chains)
    assert [[m.id for m in chain] for chain in kept] == [[1, 2], [6]]
    assert [[[m.id for m in chain] for chain in task] for task in alone] == [[[3]]]
    assert [m.id for m in release] == [4, 5, 7, 8]
    assert isolate_retried([]) == ([], [], [])


# -- what holds claims back --------------------------------------------------------------------

def test_claims_hold_back_while_the_publish_queue_is_full(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    ids = add(conn, "a", 2)
    sent = Collect()
    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(max_queued_tasks=4)), sent, batch_size=100,
                           lease_s=60.0, queued=lambda: 4)
    assert outcome.saturated and outcome.claimed == 0 and sent.tasks == []
    assert all(status_of(sqlite_store)[i] == Status.PENDING for i in ids)
    # An unknown queue length does not stop the relay.
    assert handle_claim(RelayContext(sqlite_store), sent, batch_size=100, lease_s=60.0, queued=lambda: None).claimed == 2


def test_claims_pause_while_the_breaker_is_open(sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    add(conn, "a", 2)
    breaker = Breaker()
    breaker.trip(30, "backpressure: test")
    outcome = handle_claim(RelayContext(sqlite_store, breaker=breaker), Collect(), batch_size=100, lease_s=60.0)
    assert outcome.paused > 29 and outcome.claimed == 0
    breaker.reset()
    assert handle_claim(RelayContext(sqlite_store, breaker=breaker), Collect(), batch_size=100, lease_s=60.0).claimed == 2


def test_failed_dispatch_releases_the_rows_without_spending_attempts(sqlite_store: OutboxStore,
                                                                     conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 2)
    b = add(conn, "b", 2)
    calls: list[Any] = []

    def dispatch(chains: Any, deadline: float) -> None:
        calls.append(chains)
        if len(calls) == 2:
            raise ConnectionError("Celery's broker is down")

    outcome = handle_claim(RelayContext(sqlite_store, options=RelayOptions(task_rows=1)), dispatch, batch_size=100,
                           lease_s=60.0)
    assert outcome.error and not outcome.more
    assert outcome.dispatched == 2 and outcome.released == 2
    state = rows(sqlite_store)
    assert [state[i]["status"] for i in a] == [Status.CLAIMED] * 2
    assert [(state[i]["status"], state[i]["attempts"]) for i in b] == [(Status.PENDING, 0)] * 2


def test_a_failed_dispatchs_error_is_masked_at_its_source(sqlite_store: OutboxStore, conn: sqlite3.Connection,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: the runner's broker's error naming its URL was logged as it was, and
    returned in the claim's outcome (a task's result), masked only by the handlers a worker
    attaches: any other handler (pytest's here, an application's own logging, a result
    backend) got the password in clear. Masked where it is taken now (docs/relay.md, "Secrets
    in output")."""
    add(conn, "a", 2)

    def dispatch(chains: Any, deadline: float) -> None:
        raise ConnectionError("cannot reach redis://:Hunter2Secret@127.0.0.1:1/0")

    with caplog.at_level(logging.ERROR, logger="outbox.relay"):
        outcome = handle_claim(RelayContext(sqlite_store), dispatch, batch_size=100, lease_s=60.0)
    assert outcome.released == 2
    assert outcome.error == "ConnectionError: cannot reach redis://:***@127.0.0.1:1/0"
    said = [r.getMessage() for r in caplog.records if "cannot dispatch publish tasks" in r.getMessage()]
    assert len(said) == 1 and "redis://:***@127.0.0.1:1/0" in said[0] and "Hunter2Secret" not in caplog.text, said


# -- drain slices (relay.drain_slice, the claim task's body on Celery and on Dramatiq) ------------

class Slice:
    """What a runner gives ``drain_slice``: a publish here that settles through the real store
    (``handle_publish`` with a scripted publisher), a "claim soon" request, and their order."""

    def __init__(self, store: OutboxStore) -> None:
        self.store, self.publisher, self.sent = store, ScriptedPublisher(), Collect()
        self.events: list[Any] = []
        self.outage = Outage("the database", "sqlite", "claims wait")
        self.backlog = Backlog()

    def publish_here(self, chains: list[list[OutboxMessage]], deadline: float) -> None:
        self.events.append([m.id for chain in chains for m in chain])
        handle_publish(RelayContext(self.store, self.publisher), chains, deadline=deadline)

    def request_claim(self) -> bool:
        self.events.append("claim soon")
        return True

    def follow_up(self) -> None:
        self.events.append("claim here again")

    def run(self, batch_size: int = 2, breaker: Breaker | None = None, stopping: Any = lambda: False,
            publish_here: Any = None, options: RelayOptions | None = None, queued: Any = None,
            follow_up: bool = False, **kw: Any) -> ClaimOutcome | None:
        relay = RelayContext(self.store, self.publisher, options=options or RelayOptions(), breaker=breaker,
                             stopping=stopping)
        drain = Drain(self.sent, publish_here or self.publish_here, self.request_claim, self.outage, self.backlog,
                      queued=queued, follow_up=self.follow_up if follow_up else None)
        return drain_slice(relay, drain, batch_size=batch_size, lease_s=60.0, **kw)


def test_a_drain_slice_publishes_each_full_claims_share_here_and_claims_again(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """One claim task drains a backlog batch after batch, in order, with no publish task and
    one "claim soon" at its start (before its first publish) and one after its last."""
    a = add(conn, "a", 7)
    here = Slice(sqlite_store)
    outcome = here.run()
    assert outcome is not None and outcome.inline and outcome.claimed == 1 and not outcome.more
    assert here.events == ["claim soon", a[0:2], a[2:4], a[4:6], a[6:], "claim soon"]
    assert here.sent.tasks == []  # every batch was published here
    assert [m.id for m in here.publisher.sent] == a  # in order
    assert len({m.lease for m in here.publisher.sent}) == 4  # four claims in one slice
    assert set(status_of(sqlite_store).values()) == {Status.DONE}
    assert not here.backlog.met  # the last claim was small: the next one skips the queue's length


def test_over_several_aggregates_every_full_claim_of_a_slice_asks_for_the_next_claim(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """A backlog spread over aggregates: each full claim asks for a claim before its publish
    (coalesced by the runner), so another process whose slice ended early, on a claim that
    lost its chains to a concurrent one, gets work again before this slice ends. Over one
    aggregate only the slice's first claim asks (the test above): nobody else could take
    the chain this process holds."""
    ids = {name: [] for name in "abcd"}
    for _ in range(2):
        for name in "abcd":
            ids[name] += add(conn, name)
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=4)
    assert outcome is not None and outcome.claimed == 0 and not outcome.more  # the backlog is gone
    assert here.events == ["claim soon", ids["a"] + ids["b"], "claim soon", ids["c"] + ids["d"]]
    assert set(status_of(sqlite_store).values()) == {Status.DONE}


def test_after_finding_a_claim_requested_already_a_slice_skips_asking_for_a_moment(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """A request that found a claim requested and not started yet (the coalescer said no)
    means every process is busy: the slice's next claims skip the round trip for
    ``ASK_QUIET_S`` instead of asking again at every claim."""
    for _ in range(3):
        for name in "abcd":
            add(conn, name)

    class Busy(Slice):
        def request_claim(self) -> bool:
            self.events.append("claim soon")
            return False  # a requested claim still waits

    now = [100.0]
    here = Busy(sqlite_store)
    outcome = here.run(batch_size=4, clock=lambda: now[0])  # the clock stands still: always within the quiet
    assert outcome is not None and outcome.claimed == 0
    shares = [e for e in here.events if e != "claim soon"]
    assert len(shares) >= 3, here.events  # several full claims of several chains each
    # The first claim asked and heard "requested already"; the later ones did not ask; the
    # slice's end asks once more, as after any publish (``after_publish``).
    assert here.events[0] == "claim soon" and "claim soon" not in here.events[1:-1], here.events

    def ticking() -> float:  # every reading 1 s later: never within the quiet
        now[0] += 1.0
        return now[0]

    for _ in range(3):
        for name in "abcd":
            add(conn, name)
    again = Busy(sqlite_store)
    again.run(batch_size=4, clock=ticking, slice_s=1_000.0)
    asks = again.events.count("claim soon")
    assert asks >= len(again.events) - asks  # one per full claim


def test_a_drain_slice_ends_with_its_time_when_stopping_or_when_the_breaker_opens(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 8)
    for kw, share in (({"slice_s": 0.0}, a[0:2]), ({"stopping": lambda: True}, a[2:4])):
        here = Slice(sqlite_store)
        assert here.run(**kw) is not None
        # One claim, its share published here; then the next claim soon, as after any publish.
        assert here.events == ["claim soon", share, "claim soon"]
        # That claim was full, but published here whole: it added nothing to the publish
        # queue, so the next claim skips reading its length.
        assert not here.backlog.met
    # The breaker opens during a share: the next claim of the slice claims nothing, and
    # nobody asks for a claim while the breaker is open.
    breaker, here = Breaker(), Slice(sqlite_store)

    def publish_then_trip(chains: list[list[OutboxMessage]], deadline: float) -> None:
        Slice.publish_here(here, chains, deadline)
        breaker.trip(30, "backpressure: test")

    outcome = here.run(breaker=breaker, publish_here=publish_then_trip)
    assert outcome is not None and outcome.paused > 0 and outcome.claimed == 0
    assert here.events == ["claim soon", a[4:6]]


def test_only_a_claim_that_sent_publish_tasks_on_makes_the_next_read_the_publish_queue(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """The in-flight bound is the publish queue's length, a round trip to Celery's broker: read
    before a claim only when the last one sent publish tasks on (or was held back). A full
    claim published here whole added nothing to that queue."""
    for _ in range(3):
        for name in "abcd":
            add(conn, name)
    reads: list[int] = []

    def queued() -> int:
        reads.append(1)
        return 0

    here = Slice(sqlite_store)
    # Publish tasks of one row: a full claim of two chains keeps one here, sends one on.
    options = RelayOptions(task_rows=1, inline_rows=1)
    here.backlog.met = False
    outcome = here.run(batch_size=4, options=options, queued=queued, slice_s=0.0)
    assert outcome is not None and outcome.full and outcome.tasks == 1
    assert reads == [] and here.backlog.met  # not read before it; read before the next one
    here.run(batch_size=4, options=options, queued=queued, slice_s=0.0)
    assert len(reads) == 1
    # The same backlog's claims published here whole (a share holds the whole claim):
    # the queue is never read again.
    reads.clear()
    here.backlog.met = False
    outcome = here.run(batch_size=4, queued=queued)
    assert outcome is not None and here.sent.tasks and reads == []


def test_in_the_main_process_a_backlog_claim_is_a_small_one_published_there_and_sends_no_publish_task(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """The in-process claim takes at most ``inline_rows`` rows and publishes them itself, full
    or not, in no slice: a publish task of its rows, taken by a worker that then died, would
    hold them for the whole lease (the main process lives on, so nobody takes them over:
    docs/waking-and-metrics.md, "The in-process claim")."""
    a = add(conn, "a", 8)
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=3), in_main=True)
    assert outcome is not None and outcome.more and outcome.inline and outcome.claimed == 3
    assert here.sent.tasks == []  # no publish task
    assert here.events == [a[0:3], "claim soon"]  # the rest goes to the pool through the token
    assert [status_of(sqlite_store)[i] for i in a] == [Status.DONE] * 3 + [Status.PENDING] * 5


def test_in_the_main_process_a_small_claim_asks_for_its_next_claim_there_and_a_full_one_asks_the_pool(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """Live traffic: an in-process claim that published its rows and was not full asks for the
    next claim in the main process itself (``Drain.follow_up``), not through a claim message
    (half the worker's CPU at 200 events/s: docs/waking-and-metrics.md, "The in-process
    claim"). A full one is a backlog's head, and the pool's work: through the token. With
    the breaker open, neither. Outside the main process ``follow_up`` is not used."""
    a = add(conn, "a", 2)
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=3), in_main=True, follow_up=True)
    assert outcome is not None and not outcome.more and outcome.inline
    assert here.events == [a, "claim here again"]
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=3), in_main=True, follow_up=True)
    assert outcome is not None and outcome.claimed == 0 and here.events == []  # found nothing: asks nothing
    b = add(conn, "b", 4)
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=3), in_main=True, follow_up=True)
    assert outcome is not None and outcome.more
    assert here.events == [b[0:3], "claim soon"]
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, follow_up=True)  # a pool process: its slice, as before
    assert outcome is not None and here.events == [b[3:], "claim soon"]
    c = add(conn, "c", 1)
    breaker, here = Breaker(), Slice(sqlite_store)

    def publish_then_trip(chains: list[list[OutboxMessage]], deadline: float) -> None:
        Slice.publish_here(here, chains, deadline)
        breaker.trip(30, "backpressure: test")

    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=3), in_main=True, follow_up=True,
                       breaker=breaker, publish_here=publish_then_trip)
    assert outcome is not None and here.events == [c]


def test_in_the_main_process_only_a_row_tried_twice_goes_out_in_a_publish_task(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """A row tried twice is sent alone, never published by the claiming process, the main one
    included; the claim's other chains are published there."""
    a = add(conn, "a", 2)
    b = add(conn, "b", 2)
    conn.execute(f"UPDATE {sqlite_store.engine.table} SET attempts = 2 WHERE id = ?", (a[0],))
    conn.commit()
    here = Slice(sqlite_store)
    outcome = here.run(batch_size=100, options=RelayOptions(inline_rows=4), in_main=True)
    assert outcome is not None and outcome.alone == 1 and outcome.released == 1
    assert [[[m.id for m in chain] for chain in task] for task, _ in here.sent.tasks] == [[[a[0]]]]
    assert here.events == [b, "claim soon"]


def test_in_the_main_process_with_inline_publishing_off_a_claim_still_goes_out_in_publish_tasks(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 8)
    here = Slice(sqlite_store)
    outcome = here.run(options=RelayOptions(inline_rows=0), in_main=True)
    assert outcome is not None and outcome.more and not outcome.inline
    assert [[m.id for m in chain] for chain in here.sent.chains] == [a[0:2]]  # a publish task
    assert here.events == ["claim soon"]


def test_a_drain_slice_reports_a_refused_claim_as_a_database_outage(sqlite_store: OutboxStore,
                                                                   conn: sqlite3.Connection) -> None:
    a = add(conn, "a", 3)
    here = Slice(sqlite_store)
    here.backlog.met = True
    assert here.run(slice_s=0.0) is not None and not here.backlog.met
    here.backlog.met = True
    conn.execute(f"DROP TABLE {sqlite_store.engine.table}")
    conn.commit()
    assert here.run() is None  # no traceback: the outage says it once
    assert here.outage.down and here.backlog.met  # a claim that did not run changes nothing
    assert here.events == ["claim soon", a[0:2], "claim soon"]  # the failed claim asked for nothing


# -- the publish queue's length (in a subprocess: a fresh app each time) -----------------------

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
import outbox.celery.tasks as t
from outbox.core.config import relay_settings
queues = relay_settings().queues
seen = [t.queued_publish_tasks()]
for _ in range(3):
    t.publish.apply_async(kwargs={{"chains": [], "deadline": 0}}, queue=queues.publish)
seen.append(t.queued_publish_tasks())
requests = [t.request_claim(), t.request_claim(), t.request_claim()]
with t.app.pool.acquire(block=True) as conn:
    claims = conn.default_channel._size(queues.claim)
t.coalescer().clear()
requests.append(t.request_claim())
r = redis.Redis.from_url({REDIS_URL!r})
for key in r.keys({prefix!r} + "*"):
    r.delete(key)
t.coalescer().clear()
print(seen, requests, claims)
"""
    done = run_python(code, tmp_path, OUTBOX_CELERY_BROKER_URL=REDIS_URL, CELERY_CONFIG_MODULE="qconf",
                      PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
                      OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[0, 3] [True, False, False, True] 1"


def test_an_unreadable_publish_queue_length_masks_the_password_its_error_quotes(tmp_path: Path) -> None:
    """Found in review: a claim that could not read the publish queue's length logged the
    broker's error as raised, and the database transport's names a password psycopg cannot
    decode (``invalid percent-encoded token: "<password>"``), so a handler without the
    worker's filter printed it. Masked where it is taken now."""
    pytest.importorskip("psycopg")
    secret = "Hunt%zzer2"  # psycopg refuses it before it connects: no PostgreSQL needed
    code = """
import logging
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
import outbox.celery.tasks as t
print(t.queued_publish_tasks())
"""
    done = run_python(code, tmp_path, OUTBOX_CELERY_BROKER_URL=f"outboxdb+postgresql://postgres:{secret}@127.0.0.1:1/x",
                      OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr
    said = [line for line in done.stderr.splitlines() if "cannot read the publish queue's length" in line]
    assert said and all('invalid percent-encoded token: "***"' in line for line in said), done.stderr
    assert secret not in done.stderr, done.stderr


CLAIM_REQUESTS_BROKER_DOWN = """
import json, logging, time
import outbox.celery.tasks as t
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.name.startswith("outbox"):
            warnings.append(record.getMessage())
logging.getLogger().addHandler(Keep(logging.WARNING))
took = []
for _ in range(20):  # drain mode: a request after every in-process claim that published
    began = time.monotonic()
    t.request_claim()
    took.append(time.monotonic() - began)
print(json.dumps({"warnings": warnings, "took": took}))
"""


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:1/0", "amqp://guest:guest@127.0.0.1:1//"])
def test_claim_requests_to_an_unreachable_celery_broker_warn_once_and_wait_little(tmp_path: Path, broker: str) -> None:
    """Found in review: while Celery's broker was down each claim request (drain mode asks after
    every in-process claim that published) logged a WARNING, saying "the next tick will claim",
    which cannot arrive either, and waited about 0.6 s for a send that could not succeed. Now
    the outage is one WARNING, and a failed request bounds its own wait and pauses the next."""
    import json
    done = run_python(CLAIM_REQUESTS_BROKER_DOWN, tmp_path, OUTBOX_CELERY_BROKER_URL=broker,
                      OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "task runner's broker unreachable" in out["warnings"][0] and "next tick" not in out["warnings"][0]
    # The first request tries one bounded send (it also pays the Celery app's first use: 0.51 s
    # seen on a loaded machine); the other 19 are paused, no send at all. Before, each waited
    # about 0.6 s for the send, 12 s in all.
    assert out["took"][0] < 2.0 and sum(out["took"][1:]) < 0.1, out["took"]


def test_a_failed_claim_request_is_one_outage_and_pauses_requests(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The logic of the test above with a stand-in runner: 100 requests in a second while its
    broker refuses them are one WARNING and one send; the first request that goes through
    after the pause ends the outage in one INFO line."""
    import logging

    from outbox.core.config import load_settings
    from outbox.relay.service import Relay

    class Runner:
        broker_url, claim_key, down, sent = "memory://", "k", True, 0

        def send(self, task: str, kwargs: dict[str, Any], expires_s: float | None = None) -> None:
            self.sent += 1
            if self.down:
                raise ConnectionRefusedError(111, "Connection refused")

        def stopping(self) -> bool:
            return False

    runner = Runner()
    relay = Relay(load_settings(environ={"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}), RelayOptions(),
                  runner, logging.getLogger("outbox.test-requests"))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, "outbox.test-requests"):
        assert not any(relay.request_claim() for _ in range(100))
        assert runner.sent == 1
        relay.requests_paused_until = 0.0  # the pause is over; the broker is back
        runner.down = False
        assert relay.request_claim() and runner.sent == 2
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "outbox.test-requests"]
    assert [level for level, _ in lines if level >= logging.INFO] == [logging.WARNING, logging.INFO], lines
    assert lines[0][1].startswith("outbox: task runner's broker unreachable (memory://): ConnectionRefusedError")
    assert "reachable again" in lines[-1][1]


def test_only_a_claim_after_a_backlog_reads_the_publish_queue_length(tmp_path: Path) -> None:
    """The in-flight bound costs a round trip to Celery's broker; a process reads the
    publish queue's length before a claim only when its previous claim met a backlog and sent
    publish tasks on (its first claim too), so live traffic skips it."""
    code = """
import os, sqlite3
import outbox.celery.tasks as t
from outbox import enqueue
reads = []
def counting():
    reads.append(1)
    return 0
t.relay().runner.queued_publish_tasks = counting
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
    # first claim: checked (nothing known yet); small claims: not; the full one published its
    # batch itself (one share: it sent no publish task on), so the claim its slice makes next
    # is not checked either (docs/internals.md, "Drain slices"); a claim that sends publish
    # tasks on: test_only_a_claim_that_sent_publish_tasks_on_makes_the_next_read_the_publish_queue
    assert done.stdout.split() == ["1", "0", "0", "0", "0"]


def test_a_relay_process_claims_with_the_window_of_outbox_relay_claim_window(tmp_path: Path) -> None:
    """``OUTBOX_RELAY_CLAIM_WINDOW`` reaches the store a relay process claims through, and its
    default is the engines' own (docs/internals.md, "Claim windows")."""
    from outbox.core.config import RelayOptions
    from outbox.storage.engines.base import Engine

    assert RelayOptions().claim_window == Engine.CLAIM_WINDOW
    code = """
import outbox.celery.tasks as t
store = t.resources().store
print(store.engine.window, store.engine.claim_window(10))
"""
    for env, expected in (({}, f"{Engine.CLAIM_WINDOW} {Engine.CLAIM_WINDOW * 10}"),
                          ({"OUTBOX_RELAY_CLAIM_WINDOW": "5"}, "5 50")):
        done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", **env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected
    refused = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                         OUTBOX_RELAY_CLAIM_WINDOW="0")
    assert refused.returncode != 0 and "OUTBOX_RELAY_CLAIM_WINDOW" in refused.stderr


def test_whole_here_with_a_share_kept_publishes_that_share_too(
        sqlite_store: OutboxStore, conn: sqlite3.Connection) -> None:
    """``hand_on(whole_here=True)`` publishes every chain here but the rows tried twice; with
    a ``claim_again`` too (a backlog's share kept here), the share popped first must not be
    dropped when the rest of the tasks join it: its rows were neither published nor released
    and waited for their lease."""
    from outbox.relay.claim import hand_on, take_claim

    a, b, c = add(conn, "a", 1), add(conn, "b", 1), add(conn, "c", 1)
    relay = RelayContext(sqlite_store, ScriptedPublisher(), options=RelayOptions(task_rows=1, inline_rows=2))
    here: list[list[int]] = []
    sent = Collect()
    claimed = take_claim(relay, batch_size=3, lease_s=60.0)
    outcome = hand_on(relay, claimed, sent, publish_inline=lambda chains, deadline: here.append(
        [m.id for chain in chains for m in chain]), claim_again=lambda: None, whole_here=True)
    assert sent.tasks == []
    assert sorted(i for ids in here for i in ids) == a + b + c
    assert outcome.dispatched == 3


def test_a_sqlite_claim_over_more_aggregates_than_sqlites_parameter_limit(sqlite_store: OutboxStore,
                                                                           conn: sqlite3.Connection) -> None:
    """Found in review: the claim's ordering probe bound every aggregate of its window and
    every candidate id, one parameter each, past SQLite's limit (32,766 by default, 999
    before 3.32; Debian's build allows more, so the limit is lowered here as a default
    build has it) and every claim failed with "too many SQL variables". Long lists now go
    as one JSON parameter."""
    for n in range(1200):
        conn.execute("INSERT INTO outbox (message_id, topic, aggregate_type, aggregate_id, payload) "
                     "VALUES (?, 't', 'a', ?, '{}')", (f"m{n}", f"agg-{n}"))
    conn.execute("INSERT INTO outbox (message_id, topic, aggregate_type, aggregate_id, payload) "
                 "VALUES ('m-late', 't', 'a', 'agg-0', '{}')")  # a second row of agg-0: its chain
    conn.commit()
    sqlite_store.connection().setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
    first = sqlite_store.claim(1000)  # agg-0's whole chain (two rows), then agg-1 .. agg-998
    assert sorted(m.aggregate_id for m in first.messages) == sorted(["agg-0", *(f"agg-{n}" for n in range(999))])
    second = sqlite_store.claim(1000)
    assert sorted(m.aggregate_id for m in second.messages) == sorted(f"agg-{n}" for n in range(999, 1200))
    assert sqlite_store.mark_done([m.id for m in first.messages], first.lease).applied == 1000


def test_live_traffics_small_claims_log_one_info_line_a_minute_counting_the_others(
        sqlite_store: OutboxStore, conn: sqlite3.Connection, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every commit's wake makes a small claim, published where it was claimed, and each logged
    an INFO line: one line per event, 165,000 an hour at 50 events/s from one Dramatiq worker,
    whose command line cannot lower the level (found in review). One INFO line per minute and
    process now, counting the claims since the last; each claim at DEBUG."""
    from outbox.relay import claim as claim_module

    caplog.set_level(logging.INFO, logger="outbox.relay")
    now = [1000.0]
    aggregates = iter(range(1000))

    def small_claims(count: int) -> list[str]:
        caplog.clear()
        for _ in range(count):
            add(conn, f"live-{next(aggregates)}")
            outcome = handle_claim(RelayContext(sqlite_store), Collect(), batch_size=100, lease_s=60.0,
                                   publish_inline=Collect())
            assert outcome.inline and outcome.claimed == 1
            now[0] += 0.5
        return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "outbox claimed" in r.getMessage()]

    assert len(small_claims(50)) <= 1  # the process's own: at most its first claim's line
    monkeypatch.setattr(claim_module, "small_claims_log", claim_module.SmallClaimsLog(clock=lambda: now[0]))
    first = small_claims(50)  # 25 s of traffic
    assert len(first) == 1 and first[0].endswith("publishing them here"), first
    now[0] += 60.0
    later = small_claims(3)
    assert len(later) == 1 and "(50 rows in 50 small claims since the last such line" in later[0], later
