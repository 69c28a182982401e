"""A claim task's drain slice, written once for every task runner (``outbox.celery.tasks`` for
Celery, ``outbox.dramatiq``): while claims come back full and publish their first share
here, claim again in the same task, for at most a slice (docs/internals.md, "Drain slices")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..core.config import RelayOptions
from ..publisher import PublisherLike
from .claim import ClaimFailed, ClaimOutcome, Dispatch, handle_claim
from .settle import Settler, StoreLike
from .shared import Breaker, Outage
from .sizing import ClaimSizer

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


def drain_slice(store: StoreLike, dispatch: Dispatch, *, batch_size: int, lease_s: float, options: RelayOptions,
                breaker: Breaker | None, queued: Callable[[], int | None] | None, backlog: Backlog,
                settler: Settler | None, publisher: PublisherLike | None, sizer: ClaimSizer | None,
                publish_here: Dispatch, request_claim: Callable[[], object], stopping: Callable[[], bool],
                outage: Outage, in_main: bool = False, slice_s: float = DRAIN_SLICE_S,
                clock: Callable[[], float] = time.monotonic) -> ClaimOutcome | None:
    """The claim task's body: one claim (``handle_claim``), then more while each came back
    full and published its share here, until ``slice_s`` has passed, the runner is
    ``stopping()``, or a claim is not full. Then drain mode: after a publish here
    ``after_publish``, else after a full claim ``request_claim()``.

    The slice's first claim asks for the next claim (``claim_again``) before publishing its
    share, so other processes drain alongside; a later one asks too when the claim before it
    took several chains (coalesced: a no-op while a requested claim still waits), so a
    process whose own slice ended early, on a claim that lost its chains to a concurrent
    claim, gets work again (docs/internals.md, "Drain slices"). ``in_main``
    (the Celery worker's main process, the in-process claim): no share and no slice, the
    backlog goes to the pool (docs/waking-and-metrics.md, "The in-process claim").

    ``queued`` is read only while ``backlog`` says the last claim met one. Returns the last
    claim's outcome, or None when the store refused the claim (``ClaimFailed``: reported to
    ``outage``, once per outage, instead of a traceback per tick)."""
    ends, ask = clock() + slice_s, request_claim
    while True:
        try:
            outcome = handle_claim(store, dispatch, batch_size=batch_size, lease_s=lease_s, options=options,
                                   breaker=breaker, queued=queued if backlog.met else None, settler=settler,
                                   publisher=publisher, publish_inline=publish_here,
                                   claim_again=None if in_main else ask,
                                   sizer=sizer)
        except ClaimFailed as exc:
            outage.failed(exc.cause)
            return None
        outage.ok()
        backlog.met = outcome.backlog
        ask = request_claim if outcome.chains > 1 else _nothing
        if not (outcome.more and outcome.inline) or in_main or stopping() or clock() >= ends:
            break
    if outcome.inline:
        after_publish(breaker, request_claim)
    elif outcome.more:
        request_claim()
    return outcome
