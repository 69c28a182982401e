"""A drain slice's claim made ahead (``relay.drain_slice`` with ``Drain.ahead``, docs/internals.md,
"Drain slices"), on real PostgreSQL and RabbitMQ: the next claim runs on the claim-ahead thread,
with its own connection, while the slice publishes the current batch, behind that batch's
share (it may continue the share's chains: "Claims that continue a chain"); its rows are
published in order, or released when the share before them was not published whole, the
slice stops, the breaker opens or the slice raises, never left to their lease."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from engine_support import drop_table
from services import AMQP_URL, POSTGRES_URL, require

from outbox import Status, enqueue
from outbox.core.model import Claim, OutboxMessage
from outbox.publisher.kombu_publisher import KombuPublisher
from outbox.relay import (
    Backlog,
    Breaker,
    ChainOutcome,
    ClaimAhead,
    Claimed,
    ClaimOutcome,
    Drain,
    Outage,
    RelayContext,
    RelayHooks,
    RelayOptions,
    drain_slice,
    handle_publish,
)
from outbox.relay.settle import StoreLike
from outbox.storage.store import OutboxStore

psycopg = pytest.importorskip("psycopg")

AHEAD_THREAD = "outbox-claim-ahead"


@pytest.fixture
def store() -> Iterator[OutboxStore]:
    require("PostgreSQL", "127.0.0.1", 5432)
    table = f"claim_ahead_{uuid.uuid4().hex[:8]}"
    store = OutboxStore(POSTGRES_URL, table=table)
    store.migrate()
    yield store
    drop_table(store)
    store.close()


def add(store: OutboxStore, aggregates: int, per_aggregate: int) -> dict[str, list[int]]:
    """Rows written round-robin over ``aggregates``, as a busy service would: ids per aggregate."""
    ids: dict[str, list[int]] = {f"a{a}": [] for a in range(aggregates)}
    with psycopg.connect(POSTGRES_URL) as conn:
        for n in range(per_aggregate):
            for name in ids:
                ids[name].append(enqueue(conn, topic="orders.created", aggregate_type="order", aggregate_id=name,
                                         payload={"n": n}, table=store.engine.table_name))
    return ids


def table_rows(store: OutboxStore) -> dict[int, tuple[int, int]]:
    """id -> (status, attempts)."""
    with psycopg.connect(POSTGRES_URL) as conn:
        got = conn.execute(f"SELECT id, status, attempts FROM {store.engine.table}").fetchall()
    return {row[0]: (row[1], row[2]) for row in got}


class Claims(RelayHooks):
    """Every claim of the slice: the thread it ran on and the aggregates it took."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[OutboxMessage]]] = []

    def after_claim(self, claim: Claim, seconds: float) -> None:
        self.seen.append((threading.current_thread().name, list(claim.messages)))

    def ahead(self) -> list[list[OutboxMessage]]:
        return [messages for thread, messages in self.seen if thread.startswith(AHEAD_THREAD)]


class Slice:
    """What a worker process gives ``drain_slice``, over the real store and RabbitMQ: a
    publish here that first waits for the claim made ahead to return (so it surely ran while
    this batch was leased and unpublished), a "claim soon" request, and what happened, in order."""

    def __init__(self, store: OutboxStore, broker: dict[str, Any]) -> None:
        self.store = store
        self.publisher = KombuPublisher(AMQP_URL, broker["exchange"])
        self.claims = Claims()
        self.events: list[Any] = []
        self.stopping = False
        self.breaker = Breaker()
        self.made: list[Future[Claimed]] = []
        self.runs_ahead = ClaimAhead(lambda: store)  # a store keeps one connection per thread
        self.on_publish: Callable[[list[int]], None] = lambda ids: None
        self.claim_ahead = "on"  # OUTBOX_RELAY_CLAIM_AHEAD
        #: Rows the next publish leaves out and releases, as a chain stopped by a failure does.
        self.cut: set[int] = set()

    def ahead(self, work: Callable[[StoreLike], Claimed]) -> Future[Claimed]:
        future = self.runs_ahead(work)
        self.made.append(future)
        return future

    def context(self) -> RelayContext:
        return RelayContext(self.store, self.publisher, options=RelayOptions(claim_ahead=self.claim_ahead),
                            breaker=self.breaker,
                            stopping=lambda: self.stopping, hooks=self.claims)

    def publish_here(self, chains: list[list[OutboxMessage]], deadline: float) -> list[ChainOutcome]:
        for future in self.made:
            future.exception()  # wait for it
        ids = [m.id for chain in chains for m in chain]
        self.events.append(ids)
        cut, self.cut = [m for chain in chains for m in chain if m.id in self.cut], set()
        outcomes = handle_publish(self.context(), [[m for m in chain if m not in cut] for chain in chains],
                                  deadline=deadline)
        if cut:
            self.store.release([m.id for m in cut], cut[0].lease)
        self.on_publish(ids)
        return outcomes

    def request_claim(self) -> None:
        self.events.append("claim soon")

    def run(self, batch_size: int, **kw: Any) -> ClaimOutcome | None:
        drain = Drain(lambda chains, deadline: pytest.fail("no publish task expected"), self.publish_here,
                      self.request_claim, Outage("the database", "postgresql", "claims wait"), Backlog(),
                      ahead=self.ahead)
        try:
            return drain_slice(self.context(), drain, batch_size=batch_size, lease_s=60.0, **kw)
        finally:
            self.runs_ahead.close()
            self.publisher.close()


def arrived(broker: dict[str, Any]) -> dict[str, list[int]]:
    """The events RabbitMQ holds, per aggregate, in arrival order (outbox ids)."""
    per: dict[str, list[int]] = {}
    for message in broker["live"]():
        body = json.loads(message.body)
        per.setdefault(message.headers["aggregate_id"], []).append(int(message.headers["outbox_id"]))
        assert body["n"] == len(per[message.headers["aggregate_id"]]) - 1
    return per


def test_the_next_claim_runs_ahead_on_its_own_thread_and_every_row_arrives_in_order(
        store: OutboxStore, broker: dict[str, Any]) -> None:
    """6 aggregates x 4 rows, batches of 4: a claim takes the oldest chain whole and the next one
    cut, so the claim made ahead finds the cut chain's head leased and must skip that chain."""
    ids = add(store, aggregates=6, per_aggregate=4)
    here = Slice(store, broker)
    outcome = here.run(batch_size=4, slice_s=30.0)
    assert outcome is not None and not outcome.more
    assert arrived(broker) == ids  # every row once, in order per aggregate
    assert {status for status, _ in table_rows(store).values()} == {Status.DONE}
    ahead = here.claims.ahead()
    assert ahead and any(messages for messages in ahead)  # claims made ahead took rows
    # Each claim made ahead ran while the claim before it was leased and not yet published
    # (publish_here waited for it): of an aggregate that claim held, it took only later rows.
    for (_, before), (thread, after) in zip(here.claims.seen, here.claims.seen[1:]):
        if thread.startswith(AHEAD_THREAD):
            for name in {m.aggregate_id for m in before} & {m.aggregate_id for m in after}:
                assert max(m.id for m in before if m.aggregate_id == name) < min(
                    m.id for m in after if m.aggregate_id == name), (before, after)
    assert all(len({m.lease for m in messages}) <= 1 for _, messages in here.claims.seen)


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_hot_aggregate_is_claimed_ahead_behind_the_batch_being_published(
        store: OutboxStore, broker: dict[str, Any], mode: str) -> None:
    """A claim of one chain: the claim made ahead takes the chain's next rows while this batch
    is published (behind it), so the slice never waits for a claim, and order holds."""
    ids = add(store, aggregates=1, per_aggregate=13)
    here = Slice(store, broker)
    here.claim_ahead = mode
    assert here.run(batch_size=4, slice_s=30.0) is not None
    assert arrived(broker) == ids
    ahead = here.claims.ahead()
    assert [[m.id for m in messages] for messages in ahead[:2]] == [ids["a0"][4:8], ids["a0"][8:12]]
    assert {status for status, _ in table_rows(store).values()} == {Status.DONE}


def test_rows_claimed_behind_a_chain_that_was_not_published_whole_are_released(
        store: OutboxStore, broker: dict[str, Any]) -> None:
    """The share's chain of a0 stops early (its last row released, as a failure does): the
    claim made ahead behind it holds a0's next rows, which must not overtake the released one.
    They are released too, no attempt spent; a1's rows claimed ahead go out; then a0 resumes
    in order."""
    ids = add(store, aggregates=2, per_aggregate=6)
    store.use_claim_window(1)  # a claim of 6 reads 6 rows: a0's and a1's next 3 each
    here = Slice(store, broker)
    here.cut = {ids["a0"][2]}  # the first share holds a0's and a1's first 3 rows each
    assert here.run(batch_size=6, slice_s=30.0) is not None
    first, ahead = here.claims.seen[0][1], here.claims.ahead()
    assert sorted(m.id for m in first) == sorted(ids["a0"][:3] + ids["a1"][:3])
    assert sorted(m.id for m in ahead[0]) == sorted(ids["a0"][3:] + ids["a1"][3:])  # behind the share
    published_second = here.events[3]  # "claim soon", share 1, "claim soon", share 2
    assert sorted(published_second) == ids["a1"][3:]  # a0's rows claimed ahead were released
    assert arrived(broker) == ids  # a0 resumed from its released row: every row once, in order
    assert {status for status, _ in table_rows(store).values()} == {Status.DONE}
    assert {attempts for _, attempts in table_rows(store).values()} == {0}, table_rows(store)  # releases spent none


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_off_or_auto_over_several_chains_the_slice_claims_after_each_batch(
        store: OutboxStore, broker: dict[str, Any], mode: str) -> None:
    """Off, or auto (the default) when claims take several chains: other processes claim
    alongside, no claim is made ahead."""
    ids = add(store, aggregates=6, per_aggregate=4)
    here = Slice(store, broker)
    here.claim_ahead = mode
    assert here.run(batch_size=4, slice_s=30.0) is not None
    assert here.made == [] and here.claims.ahead() == []
    sent = arrived(broker)
    assert all(sent[name] == ids[name][:len(sent[name])] for name in sent)


@pytest.mark.parametrize("how", ["stopping", "breaker"])
def test_a_claim_made_ahead_is_released_when_the_worker_stops_or_the_breaker_opens(
        store: OutboxStore, broker: dict[str, Any], how: str) -> None:
    """The worker starts stopping (or the destination broker pushes back) while the first batch
    is published: the claim made ahead meanwhile is handed back, no attempt spent, nothing of
    it published, nothing left claimed."""
    add(store, aggregates=8, per_aggregate=2)
    here = Slice(store, broker)

    def trip(published: list[int]) -> None:
        if how == "stopping":
            here.stopping = True
        else:
            here.breaker.trip(30, "backpressure: test")

    here.on_publish = trip
    here.run(batch_size=4, slice_s=30.0)
    first, ahead = here.claims.seen[0][1], here.claims.ahead()
    assert len(ahead) == 1 and len(ahead[0]) == 4  # one claim made ahead, full
    sent = [i for ids in arrived(broker).values() for i in ids]
    assert sorted(sent) == sorted(m.id for m in first)  # only the first batch went out
    state = table_rows(store)
    for m in first:
        assert state[m.id][0] == Status.DONE
    for m in ahead[0]:
        assert state[m.id] == (Status.PENDING, 0)  # released, no attempt spent
    assert Status.CLAIMED not in {status for status, _ in state.values()}
    # Handed on to the publish, which released it (stopping, or the breaker open) and sent nothing.
    assert sorted(m.id for m in ahead[0]) in [sorted(e) for e in here.events if isinstance(e, list)]


def test_a_slice_whose_time_is_up_publishes_its_claim_made_ahead_before_it_returns(
        store: OutboxStore, broker: dict[str, Any]) -> None:
    ids = add(store, aggregates=8, per_aggregate=2)
    here = Slice(store, broker)
    now = [0.0]
    here.on_publish = lambda published: now.__setitem__(0, 10.0)  # the slice's time is up after a share
    outcome = here.run(batch_size=4, slice_s=1.0, clock=lambda: now[0])
    first, ahead = here.claims.seen[0][1], here.claims.ahead()
    assert len(here.claims.seen) == 2 and len(ahead) == 1
    assert [sorted(e) if isinstance(e, list) else e for e in here.events] == [
        "claim soon", sorted(m.id for m in first), "claim soon", sorted(m.id for m in ahead[0]), "claim soon"]
    assert outcome is not None and outcome.inline
    state = table_rows(store)
    published = {m.id for m in first + ahead[0]}
    assert {i for i, (status, _) in state.items() if status == Status.DONE} == published
    assert {i for i, (status, _) in state.items() if status == Status.PENDING} == set(state) - published
    sent = arrived(broker)
    assert all(sent[name] == ids[name][:len(sent[name])] for name in sent)  # a prefix of each aggregate


def test_a_slice_that_raises_releases_its_claim_made_ahead(store: OutboxStore, broker: dict[str, Any]) -> None:
    add(store, aggregates=8, per_aggregate=2)
    here = Slice(store, broker)

    def boom(published: list[int]) -> None:
        raise RuntimeError("a bug in the runner's publish")

    here.on_publish = boom
    with pytest.raises(RuntimeError):
        here.run(batch_size=4, slice_s=30.0)
    first, ahead = here.claims.seen[0][1], here.claims.ahead()
    state = table_rows(store)
    assert len(ahead) == 1 and ahead[0]
    for m in ahead[0]:
        assert state[m.id] == (Status.PENDING, 0)  # released at once, not left to the lease
    for m in first:
        assert state[m.id][0] == Status.DONE  # published and settled before the runner raised
