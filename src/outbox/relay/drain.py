"""A claim task's drain slice, written once for every task runner (``outbox.celery.tasks`` for
Celery, ``outbox.dramatiq``): while claims come back full and publish their first share
here, claim again in the same task, for at most a slice (docs/internals.md, "Drain slices")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .claim import ClaimFailed, ClaimOutcome, Dispatch, handle_claim
from .context import RelayContext
from .shared import Breaker, Outage

#: How long one claim task may go on claiming and publishing a backlog itself.
DRAIN_SLICE_S = 1.0


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


@dataclass
class Drain:
    """What a claim task's slice works with besides the context (``RelayContext``): the
    runner's ways of sending work on (``dispatch`` a publish task, ``publish_here``, a
    coalesced ``request_claim``, the publish queue's length ``queued``) and the process's
    ``backlog`` flag and the database's outage log. ``Relay.claim`` makes one per claim task."""

    dispatch: Dispatch
    publish_here: Dispatch
    request_claim: Callable[[], object]
    outage: Outage
    backlog: Backlog
    queued: Callable[[], int | None] | None = None


def drain_slice(relay: RelayContext, drain: Drain, *, batch_size: int, lease_s: float, in_main: bool = False,
                slice_s: float = DRAIN_SLICE_S, clock: Callable[[], float] = time.monotonic) -> ClaimOutcome | None:
    """The claim task's body: one claim (``handle_claim``), then more while each came back
    full and published its share here, until ``slice_s`` has passed, the runner is
    ``relay.stopping()``, or a claim is not full. Then drain mode: after a publish here
    ``after_publish``, else after a full claim ``drain.request_claim()``.

    The slice's first claim asks for the next claim (``claim_again``) before publishing its
    share, so other processes drain alongside; a later one asks too when the claim before it
    took several chains (coalesced: a no-op while a requested claim still waits), so a
    process whose own slice ended early, on a claim that lost its chains to a concurrent
    claim, gets work again (docs/internals.md, "Drain slices"). ``in_main``
    (the Celery worker's main process, the in-process claim): no share and no slice, the
    backlog goes to the pool (docs/waking-and-metrics.md, "The in-process claim").

    ``drain.queued`` is read only while ``drain.backlog`` says the last claim met one. Returns
    the last claim's outcome, or None when the store refused the claim (``ClaimFailed``:
    reported to ``drain.outage``, once per outage, instead of a traceback per tick)."""
    ends, ask = clock() + slice_s, drain.request_claim
    while True:
        try:
            outcome = handle_claim(relay, drain.dispatch, batch_size=batch_size, lease_s=lease_s,
                                   queued=drain.queued if drain.backlog.met else None,
                                   publish_inline=drain.publish_here, claim_again=None if in_main else ask)
        except ClaimFailed as exc:
            drain.outage.failed(exc.cause)
            return None
        drain.outage.ok()
        drain.backlog.met = outcome.backlog
        ask = drain.request_claim if outcome.chains > 1 else _nothing
        if not (outcome.more and outcome.inline) or in_main or relay.stopping() or clock() >= ends:
            break
    if outcome.inline:
        after_publish(relay.breaker, drain.request_claim)
    elif outcome.more:
        drain.request_claim()
    return outcome
