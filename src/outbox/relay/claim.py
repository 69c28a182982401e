"""Claiming a batch and handing its chains on (docs/design.md, "How a row travels")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..core.model import Claim, OutboxMessage
from ..core.redact import redact_error
from ..domain.chains import split_chains
from ..publisher import Publisher
from ..storage.engines.base import LEASE_EXPIRED_ERROR
from .context import RelayContext
from .logfields import describe, log_extra
from .settle import send_dead_all

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


#: The error kind recorded on a dead-letter copy of a row that went dead on lease expiry.
LEASE_EXPIRED = "lease_expired"

#: Live traffic's small claims (published where they were claimed) log one INFO line per this
#: many seconds per process, counting the others, which log at DEBUG (``SmallClaimsLog``).
SMALL_CLAIMS_LOG_S = 60.0


class SmallClaimsLog:
    """The INFO line of live traffic's small claims, at most one per ``every_s`` in a process: it
    counts the small claims since the last one, each of which logs at DEBUG. Every commit's wake
    makes a claim of its own, and one INFO line per claim was about one line per event: 165,000
    lines (26 MB) an hour at 50 events/s from one Dramatiq worker, whose command line cannot
    lower the level (found in review; docs/operations.md, "Logging"). A backlog's claims keep a
    line each (one per full batch). No lock: a line counted twice or logged twice by threads
    racing is harmless, and a lock held across a fork would stay held in the child."""

    def __init__(self, every_s: float = SMALL_CLAIMS_LOG_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.next_at = 0.0  # the first small claim of a process logs at INFO
        self.claims = 0
        self.rows = 0

    def claimed(self, rows: int, lease: str) -> None:
        self.claims += 1
        self.rows += rows
        now = self.clock()
        if now < self.next_at:
            log.debug("outbox claimed %d rows lease=%s: publishing them here", rows, lease)
            return
        claims, total = self.claims, self.rows
        self.claims = self.rows = 0
        self.next_at = now + self.every_s
        since = (f" ({total} rows in {claims} small claims since the last such line; each is logged at DEBUG, "
                 f"this line once per {self.every_s:g} s)" if claims > 1 else "")
        log.info("outbox claimed %d rows lease=%s: publishing them here%s", rows, lease, since)


#: This process's (``SmallClaimsLog``).
small_claims_log = SmallClaimsLog()


# -- claiming ------------------------------------------------------------------------------

@dataclass
class ClaimOutcome:
    claimed: int = 0
    dispatched: int = 0  # rows sent on in publish tasks
    tasks: int = 0
    released: int = 0  # rows given back (byte budget, failed dispatch)
    full: bool = False  # the batch came back full: more rows are likely waiting
    trimmed: bool = False  # the byte budget cut the batch
    saturated: bool = False  # too many publish tasks queued: nothing claimed
    paused: float = 0.0  # the breaker is open for this long: nothing claimed
    error: str | None = None  # dispatching failed (Celery's broker)
    dead: int = 0  # rows the claim found with an expired lease and no attempts left (went dead)
    inline: bool = False  # the claim was small: its rows went to ``publish_inline``, not to a publish task
    chains: int = 0  # aggregates (chains) in the batch: one means the backlog's head is one aggregate
    alone: int = 0  # rows tried twice before, each sent in a publish task of its own (``isolate_retried``)

    @property
    def more(self) -> bool:
        """More rows are probably claimable right now: claim again at once (drain mode)."""
        return (self.full or self.trimmed) and self.error is None

    @property
    def backlog(self) -> bool:
        """The claim met a backlog and sent publish tasks on (full or cut, with tasks), or was
        held back by the in-flight bound: the next claim should check the publish queue's
        length before claiming. A full claim published here whole added nothing to that queue:
        the next skips the round trip (docs/internals.md, "Drain slices")."""
        return ((self.full or self.trimmed) and self.tasks > 0) or self.saturated


def plan_tasks(chains: Sequence[Sequence[OutboxMessage]], task_rows: int,
               max_bytes: int) -> tuple[list[list[list[OutboxMessage]]], list[OutboxMessage]]:
    """Pack chains into publish tasks of about ``task_rows`` rows, within ``max_bytes``
    for the whole batch. Returns (tasks, rows to release). Rows over the budget are
    released from the first one that does not fit to the end of the batch: cutting a
    chain is safe (its released tail waits behind its claimed head)."""
    tasks: list[list[list[OutboxMessage]]] = []
    current: list[list[OutboxMessage]] = []
    rows_in_current = 0
    used = 0
    over: list[OutboxMessage] = []
    for chain in chains:
        if over:
            over.extend(chain)
            continue
        take: list[OutboxMessage] = []
        for position, message in enumerate(chain):
            if used and used + message.size > max_bytes:
                over.extend(chain[position:])
                break
            take.append(message)
            used += message.size
        if take:
            current.append(take)
            rows_in_current += len(take)
            if rows_in_current >= task_rows:
                tasks.append(current)
                current, rows_in_current = [], 0
    if current:
        tasks.append(current)
    return tasks, over


#: A row that has spent this many attempts (leases lost with their process, or retriable
#: failures) is published alone: docs/relay.md, "An event that kills its worker".
ALONE_FROM_ATTEMPTS = 2


def tried_twice(message: OutboxMessage) -> bool:
    """Is ``message`` a suspect, to publish alone (``ALONE_FROM_ATTEMPTS``)?"""
    return message.attempts >= ALONE_FROM_ATTEMPTS


def isolate_retried(chains: Sequence[Sequence[OutboxMessage]]) -> tuple[
        Sequence[Sequence[OutboxMessage]], list[list[list[OutboxMessage]]], list[OutboxMessage]]:
    """Set apart the rows tried ``ALONE_FROM_ATTEMPTS`` times already, so that an event that
    kills its worker process spends its attempts alone (docs/relay.md, "An event that kills
    its worker"). A chain is cut before its first such row; a chain that starts with one is
    sent as that row alone, in a publish task of its own. Returns (the chains to plan as
    usual, the one-row tasks, the rows to release: the rest of each cut chain, which waits
    behind its head)."""
    if not any(tried_twice(message) for chain in chains for message in chain):
        return chains, [], []  # the usual case: nothing to set apart, nothing copied
    kept: list[Sequence[OutboxMessage]] = []
    alone: list[list[list[OutboxMessage]]] = []
    release: list[OutboxMessage] = []
    for chain in chains:
        cut = next((position for position, message in enumerate(chain) if tried_twice(message)), None)
        if cut is None:
            kept.append(chain)
        elif cut == 0:
            alone.append([[chain[0]]])
            release.extend(chain[1:])
        else:
            kept.append(chain[:cut])
            release.extend(chain[cut:])
    return kept, alone, release


#: ``dispatch(chains, deadline)`` sends one publish task (or publishes here); what it returns is not read.
Dispatch = Callable[[list[list[OutboxMessage]], float], object]


def handle_claim(relay: RelayContext, dispatch: Dispatch, *, batch_size: int, lease_s: float,
                 queued: Callable[[], int | None] | None = None, publish_inline: Dispatch | None = None,
                 claim_again: Callable[[], object] | None = None) -> ClaimOutcome:
    """One claim: lease a batch and dispatch its chains as publish tasks (``take_claim``,
    then ``hand_on``).

    A small claim (not full, at most ``options.inline_rows`` rows, within the byte budget)
    goes to ``publish_inline(chains, deadline)`` instead, when given: the claim task
    publishes it itself, which saves live traffic a hop through Celery's broker. A
    backlog (a full claim) is dispatched, so every publish process gets work; when
    ``claim_again`` is given too, its first publish task is published here instead, and
    ``claim_again()`` (the next claim, drain mode) is asked for as soon as the claim has
    committed and the rest is dispatched, before that publish: docs/internals.md, "Drain mode
    and coalesced claims".

    Rows the claim turned dead (an expired lease with no attempts left: the row keeps
    killing or losing its workers) are sent to the dead-letter exchange through
    ``relay.publisher`` (when there is one), after the batch has been dispatched so the
    live rows do not wait on it.

    Nothing is claimed while the breaker is open, or while ``queued()`` (publish tasks
    waiting in Celery's broker) is at ``options.max_queued_tasks``: that is what bounds
    the rows in flight however large the backlog. ``ClaimOutcome.more`` tells the caller
    to claim again at once (drain mode); ``ClaimOutcome.backlog`` whether the next claim
    needs ``queued`` (the caller may pass None after a small claim: live traffic then
    saves that round trip to Celery's broker).

    With a ``relay.sizer``, the claim asks for fewer rows than ``batch_size`` when recent
    rows were large, so it reads about ``options.max_batch_bytes`` instead of reading a
    whole batch and releasing most of it (docs/relay.md, "Memory").
    """
    claimed = take_claim(relay, batch_size=batch_size, lease_s=lease_s, queued=queued)
    return hand_on(relay, claimed, dispatch, publish_inline=publish_inline, claim_again=claim_again)


@dataclass
class Claimed:
    """A claim made and not handed on yet: what ``take_claim`` returns and ``hand_on``
    takes. ``claim`` is None when nothing was claimed (the breaker or the in-flight bound held
    it back: ``outcome`` says which); ``deadline`` is when publishing its rows must stop."""

    outcome: ClaimOutcome
    claim: Claim | None = None
    deadline: float = 0.0

    @property
    def empty(self) -> bool:
        """The claim ran and leased no row to publish (it may have found rows gone dead)."""
        return self.claim is not None and not self.claim.messages


def take_claim(relay: RelayContext, *, batch_size: int, lease_s: float,
               queued: Callable[[], int | None] | None = None, behind: Sequence[int] = ()) -> Claimed:
    """The first half of ``handle_claim``: unless held back (the breaker, ``queued()``), lease
    a batch through ``relay.store``. Raises ``ClaimFailed`` when the store refuses. A drain
    slice runs it on its claim-ahead thread, with that thread's store, ``behind`` the share it
    is publishing (``OutboxStore.claim``; docs/internals.md, "Drain slices")."""
    outcome = ClaimOutcome()  # the gauges are read by the metrics' own thread, never by a claim
    if _held_back(relay, queued, outcome):
        return Claimed(outcome)
    claimed_at = relay.now()
    claim = _claim(relay, batch_size, outcome, behind)
    return Claimed(outcome, claim, claimed_at + lease_s * relay.options.lease_safety)


#: ``before_share(outcome, share)``: called just before a backlog's first share is published here.
BeforeShare = Callable[[ClaimOutcome, list[list[OutboxMessage]]], object]


def hand_on(relay: RelayContext, claimed: Claimed, dispatch: Dispatch, *, publish_inline: Dispatch | None = None,
            claim_again: Callable[[], object] | None = None,
            before_share: BeforeShare | None = None, whole_here: bool = False) -> ClaimOutcome:
    """The second half of ``handle_claim``: hand a claim's chains on (dispatched, or published
    here through ``publish_inline``) and dead-letter the rows it found dead. ``before_share``
    is called with the outcome and the share just before a backlog's first share is published
    here (after ``claim_again``): where a drain slice starts its next claim ahead.
    ``whole_here``: every chain goes to ``publish_inline``, even when the claim came back
    full, but the rows tried twice, which go out alone as always (the Celery worker's
    in-process claim: docs/waking-and-metrics.md, "The in-process claim")."""
    outcome, claim = claimed.outcome, claimed.claim
    if claim is None:
        return outcome
    if claim.messages:
        _hand_on(relay, claim, claimed.deadline, dispatch, publish_inline, claim_again, outcome, before_share,
                 whole_here)
    publisher = relay.publisher
    if claim.dead and publisher is not None and relay.apart is not None:
        # The copies from a child process: the row's last lease may have ended with its worker.
        # Their wait ends with the claim's publishing (1 s at least), within the task's time limit.
        publisher = relay.apart(claimed.deadline)
    _dead_letter_expired(publisher, claim.dead, claim.dead_errors)
    return outcome


def _held_back(relay: RelayContext, queued: Callable[[], int | None] | None, outcome: ClaimOutcome) -> bool:
    """Whether this claim must not run: the breaker is open, or too many publish tasks wait."""
    if relay.breaker is not None:
        outcome.paused = relay.breaker.open_for()
        if outcome.paused > 0:
            # DEBUG: an outage is announced once (``Outage``), not on every tick.
            log.debug("outbox claims paused for %.1f s more (%s)", outcome.paused, relay.breaker.reason)
            return True
    if queued is not None:
        depth = queued()
        if depth is not None and depth >= relay.options.max_queued_tasks:
            outcome.saturated = True
            log.debug("outbox claim held back: %d publish tasks queued (max %d)", depth,
                      relay.options.max_queued_tasks)
            return True
    return False


def _claim(relay: RelayContext, batch_size: int, outcome: ClaimOutcome, behind: Sequence[int] = ()) -> Claim:
    """Lease a batch (sized by bytes with a sizer) and count it in ``outcome``."""
    started = time.perf_counter()
    rows = relay.sizer.rows(batch_size, relay.options.max_batch_bytes) if relay.sizer is not None else batch_size
    try:
        claim = relay.store.claim(rows, behind=behind)
    except Exception as exc:
        raise ClaimFailed(exc) from exc
    relay.hooks.after_claim(claim, time.perf_counter() - started)
    for message in claim.dead:  # an expired lease with no attempts left, or undecodable
        reason = claim.dead_errors.get(message.id) or "its lease expired with no attempts left"
        log.error("outbox row went dead: %s %s", reason, describe(message), extra=log_extra(message, "dead"))
    if relay.sizer is not None:
        relay.sizer.observe(claim.messages)
    outcome.claimed = len(claim.messages)
    outcome.full = outcome.claimed >= rows
    outcome.dead = len(claim.dead)
    return claim


def _hand_on(relay: RelayContext, claim: Claim, deadline: float, dispatch: Dispatch,
             publish_inline: Dispatch | None, claim_again: Callable[[], object] | None,
             outcome: ClaimOutcome, before_share: BeforeShare | None = None, whole_here: bool = False) -> None:
    """Hand the claimed chains on: all published here (a small claim), or dispatched in
    publish tasks, the first one kept here (a backlog, with ``claim_again``)."""
    options = relay.options
    all_chains = split_chains(claim.messages)
    outcome.chains = len(all_chains)
    chains, alone, behind_retried = isolate_retried(all_chains)
    outcome.alone = len(alone)
    tasks, over = plan_tasks(chains, options.task_rows, options.max_batch_bytes)
    outcome.trimmed = bool(over)
    if (publish_inline is not None and not alone and not behind_retried and not over
            and (whole_here or not outcome.full) and outcome.claimed <= options.inline_rows):
        small_claims_log.claimed(outcome.claimed, claim.lease)
        outcome.inline = True
        outcome.dispatched = outcome.claimed
        publish_inline([chain for task in tasks for chain in task], deadline)
        return
    # A backlog's first share stays here (no hop through Celery's broker), the rest goes out.
    keep_share = publish_inline is not None and claim_again is not None and options.inline_rows > 0
    share = tasks.pop(0) if keep_share and tasks else None
    if whole_here and publish_inline is not None and tasks:
        # Everything but the rows sent alone, the share already kept here included.
        share, tasks = [*(share or []), *(chain for task in tasks for chain in task)], []
    # A row tried twice before goes last, alone, and never in the share published here.
    over = _dispatch_all(dispatch, tasks + alone, deadline, outcome) + over + behind_retried
    if over:
        relay.settler.release(over)
        outcome.released = len(over)
    log.info("outbox claimed %d rows lease=%s: %d in %d publish tasks%s, %d published here, %d released",
             outcome.claimed, claim.lease, outcome.dispatched, outcome.tasks,
             f" ({outcome.alone} tried twice before, each alone)" if outcome.alone else "",
             sum(len(chain) for chain in share or ()), outcome.released)
    if share is not None:
        assert publish_inline is not None
        if outcome.more and claim_again is not None:
            claim_again()  # the next claim runs in another process while this one publishes
            if before_share is not None:
                before_share(outcome, share)  # and this process's next one on its claim-ahead thread
        outcome.inline = True
        outcome.dispatched += sum(len(chain) for chain in share)
        publish_inline(share, deadline)


def _dispatch_all(dispatch: Dispatch, tasks: list[list[list[OutboxMessage]]], deadline: float,
                  outcome: ClaimOutcome) -> list[OutboxMessage]:
    """Dispatch the publish tasks in order; the rows of the first one the runner's broker
    refuses and of every later one are returned, to be released."""
    for index, task in enumerate(tasks):
        try:
            dispatch(task, deadline)
        except Exception as exc:  # noqa: BLE001 - whatever the runner's broker raises, the rows are released
            # Masked here, whoever handles the log or the task's result (docs/relay.md, "Secrets in output").
            outcome.error = redact_error(exc)
            log.error("outbox cannot dispatch publish tasks (%s); releasing %d rows",
                      outcome.error, sum(len(chain) for pending in tasks[index:] for chain in pending))
            return [m for pending in tasks[index:] for chain in pending for m in chain]
        outcome.tasks += 1
        outcome.dispatched += sum(len(chain) for chain in task)
    return []


class ClaimFailed(Exception):
    """``store.claim`` raised (the database is down or refusing, after the store's own
    retries): the caller reports it as a database outage instead of a task traceback."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _dead_letter_expired(publisher: Publisher | None, dead: Sequence[OutboxMessage],
                         errors: Mapping[int, str] | None = None) -> None:
    """Best effort, like every dead-letter copy: the dead row in the table stays the record.
    ``errors`` holds the reason of rows that went dead for another cause than their lease
    (undecodable rows: the copy carries what could be decoded)."""
    send_dead_all(publisher, [(message, (errors or {}).get(message.id)
                               or f"{LEASE_EXPIRED}: {LEASE_EXPIRED_ERROR} (attempts: {message.attempts}, no attempts left)",
                               None) for message in dead])
