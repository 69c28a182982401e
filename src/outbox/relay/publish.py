"""Publishing chains and the failure policy keyed on ``FailureKind`` (docs/relay.md,
"Failure kinds")."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

from ..core.config import RelayOptions
from ..core.model import OutboxMessage
from ..publisher import FailureKind, Overtaken, PublisherLike, overtaken_headers
from . import metrics

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package
from .logfields import describe, log_extra
from .settle import Settler, StoreLike, retry_delay, send_dead
from .shared import Breaker, Outage, RouteGate


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


def _kind_of(kind: Any) -> FailureKind:
    """The publisher's failure kind as the enum; a kind nobody knows is treated as retriable."""
    try:
        return FailureKind(str(getattr(kind, "value", kind)).lower())
    except ValueError:
        log.error("outbox publisher reported an unknown failure kind %r; treating it as retriable", kind)
        return FailureKind.RETRIABLE


def handle_chain(store: StoreLike, publisher: PublisherLike, messages: Sequence[OutboxMessage], *,
                 options: RelayOptions = RelayOptions(), breaker: Breaker | None = None,
                 settler: Settler | None = None, rng: Callable[[], float] = random.random,
                 routes: RouteGate | None = None) -> ChainOutcome:
    """Publish one chain (one aggregate, id order, one lease) and settle its rows: a publish
    task of one chain (see ``handle_publish``)."""
    outcomes = handle_publish(store, publisher, [messages], options=options, breaker=breaker,
                              settler=settler, rng=rng, routes=routes)
    return outcomes[0] if outcomes else ChainOutcome()


@dataclass
class _Report:
    """What the publisher said about one chain."""
    published: list[int]
    failed_id: int | None = None
    kind: FailureKind | None = None
    reason: str | None = None
    route: str | None = None  # BACKPRESSURE from this routing key only
    overtaken: tuple[Overtaken, ...] = ()


def _publish_all(publisher: PublisherLike, chains: list[list[OutboxMessage]],
                 options: RelayOptions = RelayOptions()) -> list[_Report]:
    """One report per chain. A publisher that raises instead of reporting (a bug, or
    something nobody foresaw) counts against the head of every chain. Events that opted
    in to pipelining (``options.pipelined``) are marked as such for the publisher."""
    try:
        if hasattr(publisher, "publish_chains") and options.pipelines and any(
                options.pipelined(m.topic, m.aggregate_type) for chain in chains for m in chain):
            results = list(publisher.publish_chains(
                chains, pipelined=lambda m: options.pipelined(m.topic, m.aggregate_type)))
        elif hasattr(publisher, "publish_chains"):
            results = list(publisher.publish_chains(chains))
        else:  # a publisher with only the one-chain method
            results = [publisher.publish_chain(chain) for chain in chains]
    except Exception as exc:
        log.exception("outbox publisher raised instead of reporting %s", describe(chains[0][0]))
        return [_Report([], chain[0].id, RETRIABLE, f"{type(exc).__name__}: {exc}") for chain in chains]
    if len(results) != len(chains):
        log.error("outbox publisher returned %d results for %d chains; settling none of the extra or "
                  "missing ones", len(results), len(chains))
    reports = []
    for index in range(len(chains)):
        if index >= len(results):
            reports.append(_Report([]))  # said nothing: released below
            continue
        result = results[index]
        failure = result.failure
        overtaken = tuple(getattr(result, "overtaken", ()))
        if failure is None:
            reports.append(_Report(list(result.published), result.failed_id, overtaken=overtaken))
        else:
            reports.append(_Report(list(result.published), result.failed_id, _kind_of(failure.kind),
                                   failure.reason, getattr(failure, "route", None), overtaken))
    return reports


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


def still_held(store: StoreLike, chains: Sequence[Sequence[OutboxMessage]], *,
               check_own: bool = True, deadline: float | None = None,
               now: Callable[[], float] = time.time) -> list[Sequence[OutboxMessage]]:
    """The chains whose rows their lease still holds, every row of them, ready to publish here.

    Rows leased by another process than this one (the store's ``holder_id``: the claim ran
    elsewhere) are *adopted*: moved to a lease of this process in one fenced statement
    (``OutboxStore.adopt``) and returned under it, so that a process lost after it claimed them
    is not taken for their holder (docs/relay.md, "Lost workers"). Rows of this process's own
    leases are checked (``OutboxStore.held``) when ``check_own``: a publish task delivered a
    second time (its first run released or settled the rows, but its acknowledgement never
    reached the broker) must not publish rows another claim may hold now; that would send
    them twice, and out of order (docs/relay.md, "Graceful shutdown").

    A chain not held in full is skipped; rows of it that were just adopted are released (no
    attempt spent), so they wait behind their aggregate instead of for a lease.

    Past ``deadline`` nothing is checked or adopted (adopting starts the lease again): the
    chains are returned as they are, and ``handle_publish`` leaves them to their lease."""
    if deadline is not None and now() > deadline:
        return list(chains)
    holder = getattr(store, "holder_id", None)
    by_lease: dict[str, list[int]] = {}
    for chain in chains:
        for message in chain:
            by_lease.setdefault(message.lease, []).append(message.id)
    held: set[int] = set()
    adopted: dict[str, str] = {}  # old lease -> this process's new lease
    for lease, ids in by_lease.items():
        if holder and not lease.startswith(holder):
            adopted[lease] = store.new_lease()
            held |= store.adopt(ids, lease, adopted[lease])
        elif check_own:
            held |= store.held(ids, lease)
        else:
            held.update(ids)
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
    return kept


def handle_publish(store: StoreLike, publisher: PublisherLike, chains: Iterable[Sequence[OutboxMessage]], *,
                   deadline: float | None = None, options: RelayOptions = RelayOptions(),
                   breaker: Breaker | None = None, settler: Settler | None = None,
                   stopping: Callable[[], bool] = lambda: False,
                   now: Callable[[], float] = time.time,
                   rng: Callable[[], float] = random.random,
                   routes: RouteGate | None = None,
                   outage: Outage | None = None) -> list[ChainOutcome]:
    """Publish the chains of one publish task together (``Publisher.publish_chains``) and
    settle their rows: every published prefix is marked done in one ``mark_done`` per lease,
    then each chain that stopped early is settled by the kind of its failure.

    The event that stopped a chain, by failure kind:

    * RETRIABLE: failed with back-off (an attempt spent; dead after OUTBOX_MAX_ATTEMPTS,
      then sent to the dead-letter exchange when there is one);
    * POISON: dead at once, and sent to the dead-letter exchange;
    * BACKPRESSURE of one route (a ``basic.nack``: a queue bound for its routing key refused
      it): released with the rest (no attempt spent), not due before the route's pause ends;
      the route pauses (``routes``), other routes and claims go on;
    * BACKPRESSURE of the broker (unreachable, blocked): released likewise, and the breaker
      opens so claims stop hammering a broker that is down;
    * FATAL: the same, with a long pause and a critical log line: an operator must act.

    Events after the failed one are released (no attempt spent): they are blocked behind
    it by the claim rule until it is done or dead. Events whose route is paused are not sent:
    the chain is published up to the first of them, which is released with the rest, due when
    the route's pause ends.

    Nothing is published when the breaker is open or the worker is stopping (the rows are
    released, no attempt spent), nor after ``deadline``, the wall-clock time after which
    the lease is about to expire (or has) and another claim may already hold the rows. Those
    rows are left exactly as they are, for lease recovery, which spends an attempt;
    releasing them instead would let a message that crashes every worker retry for ever.

    ``outage`` (the destination broker's) hears of every broker-wide failure and of every
    publish that went through, so an outage logs one warning and one line when it ends.
    """
    settler = settler or Settler(store)
    chains = [list(chain) for chain in chains if chain]
    if not chains:
        return []
    if deadline is not None and now() > deadline:
        log.warning("outbox publish task started too late (lease nearly expired); leaving %d rows to lease "
                    "recovery, first %s", sum(map(len, chains)), describe(chains[0][0]))
        return [ChainOutcome(skipped=True) for _ in chains]
    pause = breaker.open_for() if breaker is not None else 0.0
    if pause > 0 or stopping():
        # The broker is down, or this worker is shutting down: hand the rows straight back.
        for chain in chains:
            settler.release(chain, timedelta(seconds=pause) if pause > 0 else None)
        return [ChainOutcome(skipped=True, released=[m.id for m in chain]) for chain in chains]

    split = _hold_paused_routes(chains, routes, now())
    sending = [(index, part) for index, (part, _, _) in enumerate(split) if part]
    started = time.perf_counter()
    reports: list[_Report | None] = [None] * len(chains)
    if sending:
        for (index, _), report in zip(sending, _publish_all(publisher, [part for _, part in sending], options)):
            reports[index] = report
    elapsed = time.perf_counter() - started

    outcomes: list[ChainOutcome] = []
    positions: list[int] = []
    done: dict[str, list[int]] = {}
    for chain, (part, held, _), report in zip(chains, split, reports):
        published = report.published if report is not None else []
        overtaken = {o.id: o for o in report.overtaken} if report is not None else {}
        # Trust only a true prefix of the part sent (passing the events it overtook).
        ids = [m.id for m in part]
        prefix = taken = 0
        while prefix < len(ids):
            if taken < len(published) and published[taken] == ids[prefix]:
                taken += 1
            elif ids[prefix] not in overtaken:
                break
            prefix += 1
        if taken != len(published):
            log.error("outbox publisher reported %s, which is not a prefix of chain %s; acking only %s",
                      published, ids, published[:taken])
        positions.append(prefix)
        outcome = ChainOutcome(published=published[:taken], skipped=not part)
        outcomes.append(outcome)
        if part:
            metrics.chain([m for m in chain[:prefix] if m.id not in overtaken], elapsed, report.kind.value if report is not None and report.kind is not None and prefix < len(ids) else None)
        # Overtaken events go dead before the events that overtook them are marked done:
        # should this process die in between, nothing is left to be published again behind them.
        debug = log.isEnabledFor(logging.DEBUG)  # describe() per event costs more than the check
        for message in chain[:prefix]:
            if message.id in overtaken:
                _bury_overtaken(publisher, message, overtaken[message.id], settler)
                outcome.overtaken.append(message.id)
            elif debug:
                log.debug("outbox published %s", describe(message), extra=log_extra(message, "published"))
        if taken:
            done.setdefault(chain[0].lease, []).extend(published[:taken])
    for lease, ids in done.items():
        settler.done(ids, lease)

    broker_down = any(r is not None and r.kind == BACKPRESSURE and r.route is None for r in reports)
    if outage is not None and done and not broker_down:
        outage.ok()
    refused: dict[str, float] = {}  # routes refused by this task: each paused once
    for chain, (part, held, wait), report, outcome, prefix in zip(chains, split, reports, outcomes, positions):
        if prefix < len(part):
            rest = chain[prefix:]
            assert report is not None
            _settle_stopped(publisher, rest, report, outcome, options=options, breaker=breaker,
                            settler=settler, rng=rng, routes=routes, refused=refused, outage=outage)
        elif held:
            # Published up to an event whose route is paused: the rest waits for the route.
            log.debug("outbox route %r paused for %.1f s more: releasing %d rows %s", held[0].topic, wait,
                      len(held), describe(held[0]))
            settler.release(held, timedelta(seconds=wait))
            outcome.released = [m.id for m in held]
    return outcomes


def _bury_overtaken(publisher: PublisherLike, message: OutboxMessage, overtaken: Overtaken,
                    settler: Settler) -> None:
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
    result = settler.failed(message, error, None, dead=True, dead_headers=overtaken_headers(overtaken))
    if result is not None and result.applied:
        metrics.dead()
        send_dead(publisher, message, error, overtaken_headers(overtaken))


def _settle_stopped(publisher: PublisherLike, rest: list[OutboxMessage], report: _Report, outcome: ChainOutcome, *,
                    options: RelayOptions, breaker: Breaker | None, settler: Settler,
                    rng: Callable[[], float], routes: RouteGate | None = None,
                    refused: dict[str, float] | None = None, outage: Outage | None = None) -> None:
    """Settle the unpublished ``rest`` of a chain: its head by the failure kind, the others
    released behind it."""
    failed_id, kind, reason = report.failed_id, report.kind, report.reason
    if failed_id is None or kind is None:
        # Stopped early without saying why: give the rest back untouched.
        log.error("outbox publisher stopped before %s without a failure; releasing %s",
                  rest[0].id, [m.id for m in rest])
        outcome.released = [m.id for m in rest]
        settler.release(rest)
        return
    if failed_id != rest[0].id:
        log.error("outbox publisher failed id %s but the next unpublished event is %s; treating it as failed",
                  failed_id, rest[0].id)
    failing, after = rest[0], rest[1:]
    outcome.failed_id, outcome.kind, outcome.reason = failing.id, kind, reason
    error = f"{kind}: {reason}"

    if kind == POISON:
        log.error("outbox poison event goes dead %s error=%r", describe(failing), reason,
                  extra=log_extra(failing, "dead"))
        result = settler.failed(failing, error, None, dead=True)
        outcome.dead = True
        if result is not None and result.applied:
            metrics.dead()
            send_dead(publisher, failing, error)
        settler.release(after)
        outcome.released = [m.id for m in after]
    elif kind == BACKPRESSURE and report.route is not None:
        # One route's queue refuses messages: pause that route only; claims and every other
        # route go on. The rows wait (released, no attempt spent) until the route's pause ends.
        route = report.route
        refused = {} if refused is None else refused
        if route not in refused:
            if routes is not None:
                pause, started = routes.refuse(route, options.route_pause_s, options.route_pause_max_s)
            else:
                pause, started = options.route_pause_s, True
            refused[route] = pause
            (log.warning if started else log.debug)(
                "outbox route %r refuses messages, pausing it for %.1f s (other routes keep flowing; its rows "
                "are released with no attempt spent): %s %s", route, pause, reason, describe(failing),
                extra=log_extra(failing, "route_backpressure"))
        settler.release(rest, timedelta(seconds=refused[route]))
        outcome.released = [m.id for m in rest]
    elif kind in (BACKPRESSURE, FATAL):
        if kind == FATAL:
            pause = options.fatal_pause_s
            log.critical("outbox FATAL publishing error: %s. Claims stop for %.0f s on every worker sharing "
                         "this breaker; fix the destination broker settings (OUTBOX_PUBLISH_URL, "
                         "OUTBOX_EXCHANGE, credentials, permissions) and restart the workers. %s",
                         reason, pause, describe(failing), extra=log_extra(failing, "fatal"))
        else:
            pause = options.breaker_s
            if outage is not None:
                outage.failed(reason or "back-pressure")
            else:
                log.warning("outbox broker back-pressure, pausing claims for %.1f s: %s %s", pause, reason,
                            describe(failing), extra=log_extra(failing, "backpressure"))
        if breaker is not None:
            breaker.trip(pause, f"{kind}: {reason}")
        settler.release(rest, timedelta(seconds=pause))
        outcome.released = [m.id for m in rest]
    else:  # RETRIABLE
        retry_in = retry_delay(failing.attempt, options.backoff_base_s, options.backoff_max_s, rng)
        result = settler.failed(failing, error, retry_in)
        outcome.dead = bool(result and result.dead)
        if outcome.dead:
            metrics.dead()
            log.error("outbox event goes dead after its last attempt %s attempt=%d error=%r", describe(failing),
                      failing.attempt, reason, extra=log_extra(failing, "dead"))
            send_dead(publisher, failing, error)
        else:
            log.warning("outbox publish failed, retry in %.1f s %s attempt=%d error=%r",
                        retry_in.total_seconds(), describe(failing), failing.attempt, reason,
                        extra=log_extra(failing, "retry"))
        settler.release(after)
        outcome.released = [m.id for m in after]
