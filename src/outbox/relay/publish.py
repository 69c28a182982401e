"""Publishing the chains of one publish task: sending them, trusting only a true prefix of
each, settling what was published, and handing the event that stopped a chain to the
failure policy (``relay.policy``; docs/relay.md, "Failure policy")."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import NamedTuple

from ..core.model import FailureKind, OutboxMessage
from ..core.redact import redact, redact_error
from ..publisher import ChainResult, Overtaken, Publisher, overtaken_headers
from .context import RelayContext
from .logfields import describe, log_extra
from .policy import STOP_POLICY, Stopped
from .settle import StoreLike, send_dead
from .shared import RouteGate

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


#: The failure kinds, kept importable from ``outbox.relay``; they are ``FailureKind`` members.
RETRIABLE, BACKPRESSURE, POISON, FATAL = (FailureKind.RETRIABLE, FailureKind.BACKPRESSURE, FailureKind.POISON,
                                          FailureKind.FATAL)


@dataclass
class ChainOutcome:
    published: list[int] = field(default_factory=list)
    failed_id: int | None = None
    kind: FailureKind | None = None
    reason: str | None = None
    dead: bool = False
    released: list[int] = field(default_factory=list)
    skipped: bool = False  # breaker open or lease too old: nothing was attempted
    #: Pipelined chains: events overtaken by later ones, dead at once (docs/relay.md,
    #: "Pipelined chains").
    overtaken: list[int] = field(default_factory=list)


def handle_chain(relay: RelayContext, messages: Sequence[OutboxMessage]) -> ChainOutcome:
    """Publish one chain (one aggregate, id order, one lease) and settle its rows: a publish
    task of one chain (see ``handle_publish``)."""
    outcomes = handle_publish(relay, [messages])
    return outcomes[0] if outcomes else ChainOutcome()


def handle_publish(relay: RelayContext, chains: Iterable[Sequence[OutboxMessage]], *,
                   deadline: float | None = None) -> list[ChainOutcome]:
    """Publish the chains of one publish task together (``Publisher.publish_chains``) and
    settle their rows: every published prefix is marked done in one ``mark_done`` per lease,
    then each chain that stopped early is settled by the kind of its failure (``STOP_POLICY``).

    Events whose route is paused are not sent: the chain is published up to the first of
    them, which is released with the rest, due when the route's pause ends. Nothing is
    published when the breaker is open or the worker is stopping (the rows are released, no
    attempt spent), nor after ``deadline``, the wall-clock time after which the lease is
    about to expire (or has) and another claim may already hold the rows: those rows are
    left to lease recovery, which spends an attempt (docs/relay.md, "Failure policy"). A
    publish begun before ``deadline`` waits on its broker no later than that: what is not
    confirmed by then is released, no attempt spent (docs/relay.md, "The publish's deadline").

    ``relay.outage`` (the destination broker's) hears of every broker-wide failure and of
    every publish that went through, so an outage logs one warning and one line when it ends.
    """
    publisher = relay.publisher
    if publisher is None:
        raise ValueError("handle_publish needs a RelayContext with a publisher")
    batch = [list(chain) for chain in chains if chain]
    if not batch:
        return []
    skipped = _skip_all(relay, batch, deadline)
    if skipped is not None:
        return skipped
    split = _hold_paused_routes(batch, relay.routes, relay.now())
    began = time.monotonic()  # a broker-wide failure of sends begun before an outage ended is its leftover
    late = (deadline is not None and relay.publish_budget_s is not None
            and deadline - relay.now() < relay.publish_budget_s - LATE_START_S)
    reports, elapsed = _send(publisher, relay, [part for part, _, _ in split], deadline)
    chains_sent = sum(1 for report in reports if report is not None)
    if chains_sent:  # the publish's duration, once (relay.metrics.sent)
        relay.hooks.after_send(chains_sent, elapsed)
    done: dict[str, list[int]] = {}
    settled = [_settle_published(relay, chain, part, report, elapsed, done)
               for chain, (part, _, _), report in zip(batch, split, reports)]
    for lease, ids in done.items():
        relay.settler.done(ids, lease)
    # A publish begun late that ran into its deadline was stopped by the time its task had
    # left, not by its broker: its broker-wide back-pressure opens no breaker and starts no
    # outage. One begun on time that its deadline stopped met a broker that did not answer
    # for the lease's whole safe part (docs/relay.md, "The publish's deadline").
    cut = late and deadline is not None and relay.now() >= deadline - DEADLINE_SLACK_S
    broker_down = not cut and any(r is not None and r.kind == BACKPRESSURE and r.route is None for r in reports)
    if relay.outage is not None and done and not broker_down:
        relay.outage.ok()
    refused: dict[str, float] = {}  # routes refused by this task: each paused once
    for chain, (part, held, wait), report, (outcome, prefix) in zip(batch, split, reports, settled):
        if prefix < len(part) and cut and report is not None and report.kind == BACKPRESSURE and report.route is None:
            rest = part[prefix:]
            log.info("outbox publish begun late stopped at its claim's deadline (%s): releasing %d rows, no "
                     "attempt spent, first %s", report.reason, len(rest), describe(rest[0]))
            relay.settler.release(rest)
            if held:  # behind a paused route: due when its pause ends
                relay.settler.release(held, timedelta(seconds=wait))
            outcome.failed_id, outcome.kind, outcome.reason = rest[0].id, report.kind, report.reason
            outcome.released = [m.id for m in rest + held]
        elif prefix < len(part):
            assert report is not None  # a part was sent
            _settle_stopped(relay, chain[prefix:], report, outcome, refused, began)
        elif held:
            # Published up to an event whose route is paused: the rest waits for the route.
            log.debug("outbox route %r paused for %.1f s more: releasing %d rows %s", held[0].topic, wait,
                      len(held), describe(held[0]))
            relay.settler.release(held, timedelta(seconds=wait))
            outcome.released = [m.id for m in held]
    return [outcome for outcome, _ in settled]


def _skip_all(relay: RelayContext, chains: list[list[OutboxMessage]],
              deadline: float | None) -> list[ChainOutcome] | None:
    """The outcomes when nothing may be published (too late, breaker open, stopping), else None."""
    if deadline is not None and relay.now() > deadline:
        log.warning("outbox publish task started too late (lease nearly expired); leaving %d rows to lease "
                    "recovery, first %s", sum(map(len, chains)), describe(chains[0][0]))
        return [ChainOutcome(skipped=True) for _ in chains]
    pause = relay.breaker.open_for() if relay.breaker is not None else 0.0
    if pause > 0 or relay.stopping():
        # The broker is down, or this worker is shutting down: hand the rows straight back
        # (a fatal pause's with no delay: policy._release_rest).
        fatal = relay.breaker is not None and relay.breaker.fatal
        delay = timedelta(seconds=pause) if pause > 0 and not fatal else None
        for chain in chains:
            relay.settler.release(chain, delay)
        return [ChainOutcome(skipped=True, released=[m.id for m in chain]) for chain in chains]
    return None


# -- sending ------------------------------------------------------------------------------------

#: A publish that ends this close to its deadline (or past it) was cut by it: the publisher
#: stops waiting at the deadline as its monotonic clock reads it, the relay's wall clock may
#: read a little earlier.
DEADLINE_SLACK_S = 0.25
#: A publish task that starts with this much less than the lease's safe part left began late.
LATE_START_S = 1.0

@dataclass
class _Report:
    """What the publisher said about one chain."""
    published: list[int]
    failed_id: int | None = None
    kind: FailureKind | None = None
    reason: str | None = None
    route: str | None = None  # BACKPRESSURE from this routing key only
    overtaken: tuple[Overtaken, ...] = ()


def _send(publisher: Publisher, relay: RelayContext, parts: list[list[OutboxMessage]],
          deadline: float | None = None) -> tuple[list[_Report | None], float]:
    """One report per part (None for an empty part: nothing to send), and how long the
    sending took."""
    sending = [part for part in parts if part]
    started = time.perf_counter()
    reports = iter(_publish_all(publisher, relay, sending, deadline) if sending else [])
    elapsed = time.perf_counter() - started
    return [next(reports) if part else None for part in parts], elapsed


def _publish_all(publisher: Publisher, relay: RelayContext, chains: list[list[OutboxMessage]],
                 deadline: float | None = None) -> list[_Report]:
    """One report per chain. A publisher that raises instead of reporting (a bug, or
    something nobody foresaw) counts against the head of every chain. Events that opted
    in to pipelining (``options.pipelined``) are marked as such for the publisher.
    ``deadline`` (wall clock, ``relay.now()``) reaches the publisher as the time left now, on
    its monotonic clock: it waits on its broker no later than that (docs/relay.md, "The
    publish's deadline")."""
    options = relay.options
    pipelined: Callable[[OutboxMessage], bool] | None = None
    if options.pipelines and any(options.pipelined(m.topic, m.aggregate_type) for chain in chains for m in chain):
        pipelined = lambda m: options.pipelined(m.topic, m.aggregate_type)  # noqa: E731
    until = None if deadline is None else time.monotonic() + (deadline - relay.now())
    try:
        results = list(publisher.publish_chains(chains, pipelined=pipelined, deadline=until))
    except Exception as exc:  # noqa: BLE001 - counted against every chain, logged with its traceback
        # Masked here, whoever handles the log (docs/relay.md, "Secrets in output"): the traceback too.
        log.error("outbox publisher raised instead of reporting %s\n%s", describe(chains[0][0]),
                  redact("".join(traceback.format_exception(exc))).rstrip())
        return [_Report([], chain[0].id, RETRIABLE, redact_error(exc)) for chain in chains]
    if len(results) != len(chains):
        log.error("outbox publisher returned %d results for %d chains; settling none of the extra or "
                  "missing ones", len(results), len(chains))
    # A chain the publisher said nothing about gets an empty report: released behind its head.
    return [_report(results[index]) if index < len(results) else _Report([]) for index in range(len(chains))]


def _report(result: ChainResult) -> _Report:
    failure = result.failure
    if failure is None:
        return _Report(list(result.published), result.failed_id, overtaken=tuple(result.overtaken))
    # Masked once here: the reason becomes last_error, the dead-letter copy's x-outbox-error and log
    # lines (docs/relay.md, "Secrets in output").
    reason = None if failure.reason is None else redact(failure.reason)
    return _Report(list(result.published), result.failed_id, _kind_of(failure.kind), reason, failure.route,
                   tuple(result.overtaken))


def _kind_of(kind: FailureKind | str) -> FailureKind:
    """The publisher's failure kind as the enum; a kind nobody knows is treated as retriable."""
    try:
        return FailureKind(kind)
    except ValueError:
        log.error("outbox publisher reported an unknown failure kind %r; treating it as retriable", kind)
        return FailureKind.RETRIABLE


# -- what was published -----------------------------------------------------------------------

def trusted_prefix(ids: Sequence[int], published: Sequence[int], overtaken: Collection[int]) -> tuple[int, int]:
    """How far a chain of ``ids`` got: (events passed, reported ids trusted). Only a true
    prefix of the ids sent is trusted: the reported ``published`` ids in order, passing the
    events the publisher reported ``overtaken`` (pipelined chains)."""
    prefix = taken = 0
    while prefix < len(ids):
        if taken < len(published) and published[taken] == ids[prefix]:
            taken += 1
        elif ids[prefix] not in overtaken:
            break
        prefix += 1
    return prefix, taken


def _settle_published(relay: RelayContext, chain: list[OutboxMessage], part: list[OutboxMessage],
                      report: _Report | None, elapsed: float,
                      done: dict[str, list[int]]) -> tuple[ChainOutcome, int]:
    """The chain's outcome so far and how many of its events are settled: overtaken events
    dead, the trusted prefix added to ``done`` (marked done by the caller, one write per lease)."""
    if report is None:  # nothing was sent
        return ChainOutcome(skipped=True), 0
    published = report.published
    overtaken = {o.id: o for o in report.overtaken}
    ids = [m.id for m in part]
    prefix, taken = trusted_prefix(ids, published, overtaken)
    if taken != len(published):
        log.error("outbox publisher reported %s, which is not a prefix of chain %s; acking only %s",
                  published, ids, published[:taken])
    outcome = ChainOutcome(published=published[:taken])
    failed_kind = report.kind.value if report.kind is not None and prefix < len(ids) else None
    relay.hooks.after_chain([m for m in chain[:prefix] if m.id not in overtaken], elapsed, failed_kind)
    # Overtaken events go dead before the events that overtook them are marked done:
    # should this process die in between, nothing is left to be published again behind them.
    debug = log.isEnabledFor(logging.DEBUG)  # describe() per event costs more than the check
    for message in chain[:prefix]:
        if message.id in overtaken:
            _bury_overtaken(relay, message, overtaken[message.id])
            outcome.overtaken.append(message.id)
        elif debug:
            log.debug("outbox published %s", describe(message), extra=log_extra(message, "published"))
    if taken:
        done.setdefault(chain[0].lease, []).extend(published[:taken])
    return outcome, prefix


def _bury_overtaken(relay: RelayContext, message: OutboxMessage, overtaken: Overtaken) -> None:
    """An event of a pipelined chain the broker did not take while later events were
    confirmed: dead at once, never retried (a retry would arrive after them), and
    dead-lettered with the ids that overtook it. docs/relay.md, "Pipelined chains"."""
    failure = overtaken.failure
    kind = _kind_of(failure.kind)
    after = overtaken.delivered_after
    shown = ", ".join(map(str, after[:10])) + (f", ... ({len(after)} in all)" if len(after) > 10 else "")
    error = (f"{kind}: {failure.reason}; pipelined chain: overtaken by later events already delivered "
             f"(outbox ids {shown}), so it is not retried")
    log.error("outbox pipelined event overtaken, dead at once %s error=%r", describe(message), error,
              extra=log_extra(message, "overtaken"))
    result = relay.settler.failed(message, error, None, dead=True, dead_headers=overtaken_headers(overtaken))
    if result is not None and result.applied:
        relay.hooks.after_dead()
        send_dead(relay.publisher, message, error, overtaken_headers(overtaken))


# -- what was not -------------------------------------------------------------------------------

def _settle_stopped(relay: RelayContext, rest: list[OutboxMessage], report: _Report, outcome: ChainOutcome,
                    refused: dict[str, float], began: float) -> None:
    """Settle the unpublished ``rest`` of a chain: its head by the failure kind
    (``STOP_POLICY``), the others released behind it."""
    failed_id, kind = report.failed_id, report.kind
    if failed_id is None or kind is None:
        # Stopped early without saying why: give the rest back untouched.
        log.error("outbox publisher stopped before %s without a failure; releasing %s",
                  rest[0].id, [m.id for m in rest])
        outcome.released = [m.id for m in rest]
        relay.settler.release(rest)
        return
    if failed_id != rest[0].id:
        log.error("outbox publisher failed id %s but the next unpublished event is %s; treating it as failed",
                  failed_id, rest[0].id)
    outcome.failed_id, outcome.kind, outcome.reason = rest[0].id, kind, report.reason
    settled = STOP_POLICY[kind](relay, Stopped(rest, kind, report.reason, report.route, refused, began))
    outcome.released = [m.id for m in settled.released]
    outcome.dead = settled.dead


# -- before publishing ------------------------------------------------------------------------

def _hold_paused_routes(chains: list[list[OutboxMessage]], routes: RouteGate | None,
                        now: float) -> list[tuple[list[OutboxMessage], list[OutboxMessage], float]]:
    """Split each chain at its first event whose route is paused: (to publish, held back,
    the held event's remaining pause). Without a paused route nothing is held."""
    if routes is None or not routes.any_paused(now):
        return [(chain, [], 0.0) for chain in chains]
    split = []
    for chain in chains:
        for position, message in enumerate(chain):
            wait = routes.paused(message.topic, now)
            if wait > 0:
                split.append((chain[:position], chain[position:], wait))
                break
        else:
            split.append((chain, [], 0.0))
    return split


class Held(NamedTuple):
    """What ``still_held`` found: the chains to publish, and whether their leases were
    adopted, which started them again now (by the database's clock): the publish task's
    deadline, set on the claiming host's clock, then no longer applies."""
    chains: list[Sequence[OutboxMessage]]
    renewed: bool = False


def still_held(store: StoreLike, chains: Sequence[Sequence[OutboxMessage]], *,
               check_own: bool = True, deadline: float | None = None,
               now: Callable[[], float] = time.time, renew: bool = False) -> Held:
    """The chains whose rows their lease still holds, every row of them, ready to publish here.

    Rows leased by another process than this one (the store's ``holder_id``: the claim ran
    elsewhere) are *adopted*: moved to a lease of this process in one fenced statement
    (``OutboxStore.adopt``) and returned under it, so that a process lost after it claimed them
    is not taken for their holder (docs/internals.md, "Lost workers"). Rows of this process's own
    leases are checked (``OutboxStore.held``) when ``check_own``: a publish task delivered a
    second time (its first run released or settled the rows, but its acknowledgement never
    reached the broker) must not publish rows another claim may hold now; that would send
    them twice, and out of order (docs/relay.md, "Graceful shutdown").

    A chain not held in full is skipped; rows of it that were just adopted are released (no
    attempt spent), so they wait behind their aggregate instead of for a lease.

    Past ``deadline`` chains of this process's own leases are returned as they are, and
    ``handle_publish`` leaves them to their lease; another process's are adopted as ever: the
    adoption is fenced by their old lease and starts it again, and ``deadline`` was set on the
    claiming host's clock, which may run ahead of this one's (docs/internals.md, "Lost workers").

    ``renew``: this process's own rows are adopted too, before or past ``deadline``, so that
    their lease starts again now: a row tried twice, which a child process is about to publish,
    is not left with what remains of the lease its claim took for a whole batch (docs/relay.md,
    "An event that kills its worker")."""
    if deadline is not None and now() > deadline and not renew:
        holder = store.holder_id
        others = [chain for chain in chains if holder and not chain[0].lease.startswith(holder)]
        if not others:
            return Held(list(chains))
        chains = others  # this process's own are left to their lease
    held, adopted = _hold_or_adopt(store, chains, check_own, renew)
    kept: list[Sequence[OutboxMessage]] = []
    orphans: dict[str, list[int]] = {}
    for chain in chains:
        if all(m.id in held for m in chain):
            kept.append([replace(m, lease=adopted[m.lease]) if m.lease in adopted else m for m in chain])
            continue
        for m in chain:
            if m.id in held and m.lease in adopted:
                orphans.setdefault(adopted[m.lease], []).append(m.id)
    if len(kept) < len(chains):
        log.info("outbox publish task: %d of %d chains no longer held by their lease (settled, released, or "
                 "taken over), skipped", len(chains) - len(kept), len(chains))
    for lease, ids in orphans.items():
        try:
            store.release(ids, lease)
        except Exception as exc:  # noqa: BLE001 - then they wait for the lease
            log.error("outbox cannot release rows %s of a chain no longer held in full (%s); the lease recovers "
                      "them", ids, exc)
    return Held(kept, renewed=bool(adopted))


#: How often ``still_held_when_reachable`` asks again while the database is away.
HELD_RETRY_S = 0.5


def still_held_when_reachable(store: StoreLike, chains: Sequence[Sequence[OutboxMessage]], *,
                              check_own: bool = True, deadline: float | None = None, renew: bool = False,
                              stopping: Callable[[], bool] = lambda: False,
                              failed: Callable[[BaseException], object] = lambda exc: None,
                              now: Callable[[], float] = time.time,
                              sleep: Callable[[float], object] = time.sleep) -> Held:
    """``still_held``, asked again every ``HELD_RETRY_S`` while the database refuses (each
    failure to ``failed``, the outage log) until ``deadline`` is near or the worker stops.
    Raising at once left every row of the task leased to this live process, so its
    aggregates stood still until the lease ran out, long after a short outage had ended
    (docs/relay.md, "Outages in the log")."""
    while True:
        try:
            return still_held(store, chains, check_own=check_own, deadline=deadline, now=now, renew=renew)
        except Exception as exc:
            failed(exc)
            if deadline is None or now() + HELD_RETRY_S >= deadline or stopping():
                raise
            sleep(HELD_RETRY_S)


def _hold_or_adopt(store: StoreLike, chains: Sequence[Sequence[OutboxMessage]],
                   check_own: bool, renew: bool = False) -> tuple[set[int], dict[str, str]]:
    """The ids still held, this process's leases checked (when ``check_own``; adopted when
    ``renew``) and other processes' adopted; and each adopted lease's new lease."""
    by_lease: dict[str, list[int]] = {}
    for chain in chains:
        for message in chain:
            by_lease.setdefault(message.lease, []).append(message.id)
    held: set[int] = set()
    adopted: dict[str, str] = {}  # old lease -> this process's new lease
    holder = store.holder_id
    for lease, ids in by_lease.items():
        if renew or (holder and not lease.startswith(holder)):
            adopted[lease] = store.new_lease()
            held |= store.adopt(ids, lease, adopted[lease])
        elif check_own:
            held |= store.held(ids, lease)
        else:
            held.update(ids)
    return held, adopted
