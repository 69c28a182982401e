"""``RelayContext``: the collaborators a claim and a publish share, handed to ``handle_claim``
and ``handle_publish`` as one argument. A worker's ``Relay`` builds one per task from what its
thread holds (the thread's store and publisher, the process's breaker and route gate): a
few references, no I/O (docs/design.md, "How a row travels")."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.config import RelayOptions
from ..publisher import Publisher
from .hooks import RelayHooks
from .settle import Settler, StoreLike
from .shared import Breaker, Outage, RouteGate
from .sizing import ClaimSizer


def _never() -> bool:
    return False


@dataclass
class RelayContext:
    """What the relay works with. Only ``store`` is required: the rest is off or a default
    when not given (no breaker, no route pauses, no outage log, no claim sizing, never
    stopping, no hooks). ``publisher`` is needed to publish; a claim without one dead-letters
    nothing. ``settler`` defaults to one on ``store`` with no fallback."""

    store: StoreLike
    publisher: Publisher | None = None
    options: RelayOptions = field(default_factory=RelayOptions)
    settler: Settler = None  # type: ignore[assignment]  # set in __post_init__ when not given
    breaker: Breaker | None = None
    routes: RouteGate | None = None  # paused routes (per-route back-pressure)
    outage: Outage | None = None  # the destination broker's outage log
    sizer: ClaimSizer | None = None  # claims sized by bytes, one per process
    stopping: Callable[[], bool] = _never  # the worker is shutting down: publish nothing
    now: Callable[[], float] = time.time  # wall clock, for deadlines and route pauses
    rng: Callable[[], float] = random.random  # the back-off's jitter
    hooks: RelayHooks = field(default_factory=RelayHooks)  # what the relay reports (``relay.hooks``)
    #: The time a publish begun at its claim has until its deadline (the lease's safe part),
    #: when known: a publish begun much later that its deadline cut was the task's lateness,
    #: not the broker's (docs/relay.md, "The publish's deadline").
    publish_budget_s: float | None = None
    #: ``apart(deadline)``: a publisher that sends each call from a child process of its own
    #: (``ApartPublisher``), waiting for it until ``deadline`` (wall clock) at most, made on
    #: demand: how a claim sends the dead-letter copies of the rows it found dead on an expired
    #: lease, suspects all (docs/relay.md, "An event that kills its worker"). None: through
    #: ``publisher``.
    apart: Callable[[float | None], Publisher] | None = None

    def __post_init__(self) -> None:
        if self.settler is None:
            self.settler = Settler(self.store)

