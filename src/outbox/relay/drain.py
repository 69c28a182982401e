"""A claim task's drain slice, written once for every task runner (``outbox.celery.tasks`` for
Celery, ``outbox.dramatiq``): while claims come back full and publish their first share
here, claim again in the same task, for at most a slice (docs/internals.md, "Drain slices")."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..core.handoff import main_thread_signals
from ..core.model import OutboxMessage
from .claim import Claimed, ClaimFailed, ClaimOutcome, Dispatch, hand_on, take_claim
from .context import RelayContext
from .settle import Settler, StoreLike, done_marks_by
from .shared import Breaker, Outage

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package

#: How long one claim task may go on claiming and publishing a backlog itself.
DRAIN_SLICE_S = 1.0
#: After a slice's request for a claim found one already requested and not started yet, its
#: next claims skip asking (a round trip to the runner's broker) for this long.
ASK_QUIET_S = 0.05


@dataclass
class Backlog:
    """Did this process's last claim meet a backlog? Only then does its next claim read the
    publish queue's length first (a round trip to the runner's broker): a backlog is bounded
    by that check, and live traffic, which never fills the queue, skips it. One per process."""

    met: bool = True


def after_publish(breaker: Breaker | None, request_claim: Callable[[], object]) -> None:
    """What every publish does when it ends, in a publish task or in a claim: ask for a
    claim (drain mode: its aggregates may have more rows now), unless the breaker is open."""
    if breaker is None or breaker.open_for() == 0:
        request_claim()


def _nothing() -> None:
    """``claim_again`` of a slice's later claims after a one-chain claim: the slice's first
    claim asked already, and nobody else can take a chain this process holds."""


#: ``ahead(work)`` runs ``work(store)`` on the calling thread's claim-ahead thread, with
#: that thread's own store, and returns its future (``ClaimAhead``): a claim, or a done mark.
Ahead = Callable[[Callable[[StoreLike], Any]], "Future[Any]"]


@dataclass
class Drain:
    """What a claim task's slice works with besides the context (``RelayContext``): the
    runner's ways of sending work on (``dispatch`` a publish task, ``publish_here``, a
    coalesced ``request_claim``, the publish queue's length ``queued``), the process's
    ``backlog`` flag and the database's outage log, and where the slice's next claim runs
    while it publishes (``ahead``: none, claims one after the other). ``Relay.claim`` makes
    one per claim task."""

    dispatch: Dispatch
    publish_here: Dispatch
    request_claim: Callable[[], object]
    outage: Outage
    backlog: Backlog
    queued: Callable[[], int | None] | None = None
    ahead: Ahead | None = None
    #: The in-process claim's own next run (the Celery worker's main process): asked instead of
    #: ``request_claim`` after an in-process claim that published and was not full, so live
    #: traffic's follow-up claim costs no claim message (docs/waking-and-metrics.md, "The
    #: in-process claim").
    follow_up: Callable[[], object] | None = None


class ClaimAhead:
    """The claim-ahead threads of one process: one per thread that drains (a Celery pool
    process has one; a Dramatiq worker one per worker thread), made on its first claim ahead,
    each claiming through its own store, ``store()`` called on it (the runner's per-thread
    store: ``Relay.resources``). A thread made before a fork is the parent's: the child
    makes its own. docs/internals.md, "Drain slices"."""

    def __init__(self, store: Callable[[], StoreLike]) -> None:
        self._store = store
        self._local = threading.local()
        self._made: list[tuple[int, ThreadPoolExecutor]] = []
        self._lock = threading.Lock()

    def __call__(self, work: Callable[[StoreLike], Any]) -> Future[Any]:
        made: tuple[int, ThreadPoolExecutor] | None = getattr(self._local, "executor", None)
        if made is None or made[0] != os.getpid():
            made = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="outbox-claim-ahead"))
            self._local.executor = made
            with self._lock:
                self._made.append(made)
        with main_thread_signals():  # its thread starts at the first submit
            return made[1].submit(lambda: work(self._store()))

    def _close_store(self) -> None:
        close = getattr(self._store(), "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Stop this process's claim-ahead threads once their claim (if any) has returned,
        each closing its store's connection first (a store keeps one per thread: only the
        thread itself can close its own)."""
        with self._lock:
            mine = [executor for pid, executor in self._made if pid == os.getpid()]
            self._made = [made for made in self._made if made[0] != os.getpid()]
            self._local = threading.local()
        for executor in mine:
            closed = executor.submit(self._close_store)
            executor.shutdown(wait=True)
            if closed.exception() is not None:
                log.debug("outbox: error closing a claim-ahead thread's store", exc_info=closed.exception())


def drain_slice(relay: RelayContext, drain: Drain, *, batch_size: int, lease_s: float, in_main: bool = False,
                slice_s: float = DRAIN_SLICE_S, clock: Callable[[], float] = time.monotonic) -> ClaimOutcome | None:
    """The claim task's body: one claim (``handle_claim``), then more while each came back
    full and published its share here, until ``slice_s`` has passed, the runner is
    ``relay.stopping()``, or a claim is not full. Then drain mode: after a publish here
    ``after_publish``, else after a full claim ``drain.request_claim()``.

    The slice's first claim asks for the next claim (``claim_again``) before publishing its
    share, so other processes drain alongside; a later one asks too when the claim before it
    took several chains (coalesced: a no-op while a requested claim still waits; after such a
    no-op the slice's claims skip asking for ``ASK_QUIET_S``), so a process whose own slice
    ended early, on a claim that lost its chains to a concurrent claim, gets work again
    (docs/internals.md, "Drain slices"). ``in_main``
    (the Celery worker's main process, the in-process claim): one claim of at most
    ``options.inline_rows`` rows, published here whole, and no slice; the backlog goes to the
    pool through the claim it then asks for (docs/waking-and-metrics.md, "The in-process claim").

    With ``drain.ahead`` and ``options.claim_ahead`` (not off; at auto, after a claim of one
    chain only), a full claim starts the slice's next claim on the claim-ahead thread,
    behind its share, before publishing the share, whose done marks then go to that thread
    too; the next turn of the loop hands that claim on instead of claiming (``_Ahead``). A
    claim made ahead that found nothing is followed by a claim here, once the done marks
    are written. A claim made ahead is always handed on before the slice returns:
    published, or released by ``handle_publish`` when the worker is stopping or the breaker
    opened, or, should the slice raise, released here.

    ``drain.queued`` is read only while ``drain.backlog`` says the last claim met one. Returns
    the last claim's outcome, or None when the store refused the claim (``ClaimFailed``:
    reported to ``drain.outage``, once per outage, instead of a traceback per tick)."""
    ends, quiet_until = clock() + slice_s, 0.0
    whole_here = in_main and relay.options.inline_rows > 0
    if whole_here:
        # No row of the main process's lease travels in a publish task but a row tried twice
        # (sent alone on purpose): a task that a worker took and died with would hold its rows
        # for the whole lease (docs/waking-and-metrics.md).
        batch_size = min(batch_size, relay.options.inline_rows)

    def ask_unless_requested() -> None:
        nonlocal quiet_until
        if clock() >= quiet_until and drain.request_claim() is False:
            quiet_until = clock() + ASK_QUIET_S

    ask: Callable[[], object] = ask_unless_requested
    ahead = _Ahead(relay, drain, batch_size, lease_s, ends, clock) if (
        drain.ahead is not None and relay.options.claim_ahead != "off" and not in_main) else None
    publish_here = drain.publish_here if ahead is None else ahead.publishing(drain.publish_here)
    outcome: ClaimOutcome | None = None
    try:
        while True:
            try:
                claimed = ahead.take() if ahead is not None else None
                made_ahead, queued = claimed is not None, drain.queued if drain.backlog.met else None
                if claimed is not None and claimed.empty:
                    hand_on(relay, claimed, drain.dispatch)  # dead-letters the rows it found dead, if any
                    if ahead is not None and ahead.closing:
                        break  # the slice ends on the last claim it handed on
                    # It lost every chain to claims that held them then (this slice's own
                    # included, free now): claim here; the in-flight bound was read for it.
                    claimed, made_ahead, queued = None, False, None
                if claimed is None:
                    if ahead is not None:
                        ahead.settled()  # this slice's done marks first: its chains are free then
                    claimed = take_claim(relay, batch_size=batch_size, lease_s=lease_s, queued=queued)
            except ClaimFailed as exc:
                drain.outage.failed(exc.cause)
                return None
            drain.outage.ok()
            outcome = hand_on(relay, claimed, drain.dispatch, publish_inline=publish_here,
                              claim_again=None if in_main else ask, before_share=None if ahead is None else ahead.start,
                              whole_here=whole_here)
            drain.backlog.met = outcome.backlog
            ask = ask_unless_requested if outcome.chains > 1 else _nothing
            # A claim made ahead that came back short may have met this slice's own chains
            # leased, not the end of the backlog: the next turn claims here to know.
            go_on = outcome.inline and (outcome.more or (made_ahead and outcome.claimed > 0 and outcome.error is None))
            if not go_on or in_main or relay.stopping() or clock() >= ends:
                if ahead is None or not ahead.pending:
                    break
                ahead.closing = True  # hand the claim made ahead on, then end
            elif ahead is not None and ahead.closing:
                break
    finally:
        if ahead is not None:
            ahead.settled()
            ahead.abandon()
    assert outcome is not None  # the loop ran once at least
    if outcome.inline:
        follow_up = drain.follow_up if in_main and not outcome.more else None
        after_publish(relay.breaker, follow_up or drain.request_claim)
    elif outcome.more:
        drain.request_claim()
    return outcome


def unfinished(chains: Sequence[Sequence[OutboxMessage]], results: object) -> set[str]:
    """The aggregates of ``chains`` not published whole, by the outcomes ``results`` (one
    ``ChainOutcome`` per chain, as ``handle_publish`` returns them); all of them when the
    outcomes are not that (nothing is known of them)."""
    aggregates = [chain[0].aggregate_id for chain in chains if chain]
    if not isinstance(results, list) or len(results) != len(chains):
        return set(aggregates)
    return {chain[0].aggregate_id for chain, result in zip(chains, results)
            if chain and not {m.id for m in chain} <= set(getattr(result, "published", ()))}


class _Ahead:
    """A drain slice's next claim, made on the claim-ahead thread while the slice publishes:
    ``behind`` the share being published, so it may continue that share's chains (a hot
    aggregate's next batch included); rows of a chain whose share was not published whole
    are released when it is taken (docs/internals.md, "Claims that continue a chain")."""

    def __init__(self, relay: RelayContext, drain: Drain, batch_size: int, lease_s: float, ends: float,
                 clock: Callable[[], float]) -> None:
        self.relay, self.drain, self.batch_size, self.lease_s = relay, drain, batch_size, lease_s
        self.ends, self.clock = ends, clock
        self.future: Future[Claimed] | None = None
        self.closing = False  # the slice ends once the claim made ahead is handed on
        self.unfinished: set[str] = set()  # aggregates of the share the claim made ahead is behind
        self.marks: list[Future[Any]] = []  # done marks handed to the claim-ahead thread

    @property
    def pending(self) -> bool:
        return self.future is not None

    def start(self, outcome: ClaimOutcome, share: list[list[OutboxMessage]]) -> None:
        """Called before a full claim's share is published: claim the next batch ahead, behind
        that share, unless the slice ends after this share anyway, the in-flight bound holds
        claims back (the breaker is checked by the claim itself, on the thread), or the claim
        took several chains with ``options.claim_ahead`` at auto (other processes claim
        alongside then: docs/internals.md, "Claims that continue a chain")."""
        relay, drain = self.relay, self.drain
        if self.closing or relay.stopping() or self.clock() >= self.ends:
            return
        if relay.options.claim_ahead == "auto" and outcome.chains > 1:
            return
        if drain.queued is not None:
            depth = drain.queued()
            if depth is not None and depth >= relay.options.max_queued_tasks:
                return  # the next turn claims here, and is held back there
        assert drain.ahead is not None
        batch_size, lease_s = self.batch_size, self.lease_s
        behind = [m.id for chain in share for m in chain]
        self.future = drain.ahead(lambda store: take_claim(replace(relay, store=store), batch_size=batch_size,
                                                           lease_s=lease_s, behind=behind))

    def publishing(self, publish_here: Dispatch) -> Dispatch:
        """``publish_here`` that, for the share a claim made ahead is behind, hands its done
        marks to the claim-ahead thread (queued after that claim: the slice publishes the
        claim's rows meanwhile) and notes which of its chains were not published whole."""
        def publish(chains: list[list[OutboxMessage]], deadline: float) -> object:
            if self.future is None:
                return publish_here(chains, deadline)
            with done_marks_by(self._mark_done):
                results = publish_here(chains, deadline)
            self.unfinished = unfinished(chains, results)
            return results
        return publish

    def _mark_done(self, ids: list[int], lease: str) -> None:
        assert self.drain.ahead is not None
        fallback = self.relay.settler.fallback
        self.marks.append(self.drain.ahead(lambda store: Settler(store, fallback).done(ids, lease)))

    def settled(self) -> None:
        """Wait for the done marks handed to the claim-ahead thread (``Settler.done`` never
        raises: a mark that fails goes to the fallback, or is left to the lease)."""
        marks, self.marks = self.marks, []
        for mark in marks:
            mark.exception()

    def take(self) -> Claimed | None:
        """The claim made ahead (waiting for it), or None when none was started, without the
        rows of aggregates whose share before them was not published whole: those are
        released (no attempt spent), to be claimed again after the rows before them. Raises
        ``ClaimFailed`` as a claim here would."""
        future, self.future = self.future, None
        if future is None:
            return None
        claimed = future.result()
        claim = claimed.claim
        stopped, self.unfinished = self.unfinished, set()
        if claim is None or not stopped:
            return claimed
        behind = [m for m in claim.messages if m.aggregate_id in stopped]
        if not behind:
            return claimed
        log.info("outbox claim made ahead: releasing %d rows of %d aggregates whose rows before them were not "
                 "all published", len(behind), len({m.aggregate_id for m in behind}))
        self.relay.settler.release(behind)
        claimed.outcome.released += len(behind)
        kept = [m for m in claim.messages if m.aggregate_id not in stopped]
        return replace(claimed, claim=replace(claim, messages=kept))

    def abandon(self) -> None:
        """The slice is leaving with a claim made ahead still in hand (it raised): release its
        rows, no attempt spent, rather than leave them to their lease."""
        try:
            claimed = self.take()
        except Exception:  # noqa: BLE001 - a claim that failed leased nothing
            return
        if claimed is not None and claimed.claim is not None and claimed.claim.messages:
            log.warning("outbox drain slice ended with a claim made ahead in hand: releasing its %d rows",
                        len(claimed.claim.messages))
            self.relay.settler.release(claimed.claim.messages)
