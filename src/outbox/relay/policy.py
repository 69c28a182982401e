"""The failure policy: what a publish does with the event that stopped a chain and the rest
behind it, one rule per ``FailureKind`` in ``STOP_POLICY`` (docs/relay.md, "Failure policy")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

from ..core.model import FailureKind, OutboxMessage
from .context import RelayContext
from .logfields import describe, log_extra
from .settle import retry_delay, send_dead

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


@dataclass
class Stopped:
    """A chain that stopped early: its unpublished ``rest`` (the failing event first) and
    why. ``refused`` is shared by the chains of one publish task: the routes it paused,
    each paused once, and for how long."""

    rest: list[OutboxMessage]
    kind: FailureKind
    reason: str | None
    route: str | None = None  # BACKPRESSURE from this routing key only
    refused: dict[str, float] = field(default_factory=dict)
    began: float | None = None  # when the publish began (time.monotonic())

    @property
    def failing(self) -> OutboxMessage:
        return self.rest[0]

    @property
    def after(self) -> list[OutboxMessage]:
        return self.rest[1:]

    @property
    def error(self) -> str:
        """What ``last_error`` records: ``"<kind>: <reason>"``."""
        return f"{self.kind}: {self.reason}"


class Settled(NamedTuple):
    """What a rule did: the rows it released (no attempt spent) and whether the failing
    event went dead."""

    released: list[OutboxMessage]
    dead: bool = False


def _poison(relay: RelayContext, stop: Stopped) -> Settled:
    """Dead at once, and sent to the dead-letter exchange; the rest released behind it."""
    failing = stop.failing
    log.error("outbox poison event goes dead %s error=%r", describe(failing), stop.reason,
              extra=log_extra(failing, "dead"))
    result = relay.settler.failed(failing, stop.error, None, dead=True)
    if result is not None and result.applied:
        relay.hooks.after_dead()
        send_dead(relay.publisher, failing, stop.error)
    relay.settler.release(stop.after)
    return Settled(stop.after, dead=True)


def _retriable(relay: RelayContext, stop: Stopped) -> Settled:
    """Failed with back-off, an attempt spent: dead after OUTBOX_MAX_ATTEMPTS, then sent to
    the dead-letter exchange. The rest released behind it."""
    failing, options = stop.failing, relay.options
    retry_in = retry_delay(failing.attempt, options.backoff_base_s, options.backoff_max_s, relay.rng)
    result = relay.settler.failed(failing, stop.error, retry_in)
    dead = bool(result and result.dead)
    if dead:
        relay.hooks.after_dead()
        log.error("outbox event goes dead after its last attempt %s attempt=%d error=%r", describe(failing),
                  failing.attempt, stop.reason, extra=log_extra(failing, "dead"))
        send_dead(relay.publisher, failing, stop.error)
    else:
        log.warning("outbox publish failed, retry in %.1f s %s attempt=%d error=%r",
                    retry_in.total_seconds(), describe(failing), failing.attempt, stop.reason,
                    extra=log_extra(failing, "retry"))
    relay.settler.release(stop.after)
    return Settled(stop.after, dead)


def _backpressure(relay: RelayContext, stop: Stopped) -> Settled:
    """Of one route (a ``basic.nack``): that route pauses. Of the broker (unreachable,
    blocked): the breaker opens, so claims stop hammering a broker that is down. Either
    way the whole rest is released, no attempt spent, not due before the pause ends."""
    if stop.route is not None:
        return _pause_route(relay, stop, stop.route)
    pause = relay.options.breaker_s
    if relay.outage is not None:
        if not relay.outage.failed(stop.reason or "back-pressure", stop.began):
            # Begun before the broker was back, which it still is: no new outage, no pause.
            relay.settler.release(stop.rest)
            return Settled(stop.rest)
    else:
        log.warning("outbox broker back-pressure, pausing claims for %.1f s: %s %s", pause, stop.reason,
                    describe(stop.failing), extra=log_extra(stop.failing, "backpressure"))
    if relay.breaker is not None:
        relay.breaker.trip(pause, stop.error)
    return _release_rest(relay, stop, pause)


def _fatal(relay: RelayContext, stop: Stopped) -> Settled:
    """As the broker's back-pressure, with a long pause and a critical log line: an
    operator must act. One critical line per pause: the other chains of the task (or of
    tasks running beside it, in this process or, through the shared breaker, another) that
    meet the same error while the fatal pause is open log it at DEBUG. Before, every chain
    of a backlog logged it (a line per aggregate of every publish in flight). Of one route
    (a Kafka topic missing or not permitted): that route pauses alone (docs/relay.md,
    "Failure policy")."""
    if stop.route is not None:
        return _pause_route(relay, stop, stop.route, fatal=True)
    pause = relay.options.fatal_pause_s
    opened = relay.breaker.opens(pause, stop.error) if relay.breaker is not None else True
    (log.critical if opened else log.debug)(
        "outbox FATAL publishing error: %s. Claims stop for %.0f s on every worker sharing "
        "this breaker; fix the destination broker settings (OUTBOX_PUBLISH_URL, "
        "OUTBOX_EXCHANGE, credentials, permissions) and restart the workers. %s",
        stop.reason, pause, describe(stop.failing), extra=log_extra(stop.failing, "fatal"))
    return _release_rest(relay, stop, pause, hold_rows=False)


def _release_rest(relay: RelayContext, stop: Stopped, pause: float, hold_rows: bool = True) -> Settled:
    """Release the rest of a chain stopped by a pause of the breaker (which the caller
    opened), due when the pause ends. Rows of a fatal pause (``hold_rows`` False) are
    released with no delay when a breaker stops the claims: a restart lifts the pause once
    the settings are fixed, and must find them claimable (docs/relay.md, "Circuit breaker")."""
    held = hold_rows or relay.breaker is None
    relay.settler.release(stop.rest, timedelta(seconds=pause) if held else None)
    return Settled(stop.rest)


def _pause_route(relay: RelayContext, stop: Stopped, route: str, fatal: bool = False) -> Settled:
    """One route's queue refuses messages (or, ``fatal``, the route fails until an operator
    acts: an ERROR line per pause): pause that route only; claims and every other route go
    on. The rows wait (released, no attempt spent) until the route's pause ends."""
    if route not in stop.refused:
        options = relay.options
        if relay.routes is not None:
            pause, started = relay.routes.refuse(route, options.route_pause_s, options.route_pause_max_s)
        else:
            pause, started = options.route_pause_s, True
        stop.refused[route] = pause
        if fatal:
            (log.error if started else log.debug)(
                "outbox FATAL publishing error: %s. Route %r pauses for %.1f s and is tried again then (other "
                "routes keep flowing; its rows are released with no attempt spent). %s", stop.reason, route,
                pause, describe(stop.failing), extra=log_extra(stop.failing, "route_fatal"))
        else:
            (log.warning if started else log.debug)(
                "outbox route %r refuses messages, pausing it for %.1f s (other routes keep flowing; its rows "
                "are released with no attempt spent): %s %s", route, pause, stop.reason, describe(stop.failing),
                extra=log_extra(stop.failing, "route_backpressure"))
    relay.settler.release(stop.rest, timedelta(seconds=stop.refused[route]))
    return Settled(stop.rest)


#: The rule for each failure kind. Events after the failed one are always released (no
#: attempt spent): the claim rule blocks them behind it until it is done or dead.
STOP_POLICY: dict[FailureKind, Callable[[RelayContext, Stopped], Settled]] = {
    FailureKind.RETRIABLE: _retriable,
    FailureKind.BACKPRESSURE: _backpressure,
    FailureKind.POISON: _poison,
    FailureKind.FATAL: _fatal,
}
