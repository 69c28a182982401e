"""Chains published in waves, the bookkeeping without the I/O: how far each chain has got
(``ChainProgress``), what the next wave carries (``next_wave``) and what the broker's
verdicts on a wave do to its chains (``settle_wave``: advance, stop, overtake).
``KombuPublisher._publish_waves`` sends the waves and collects the verdicts.

Why waves: docs/publisher.md, "confirms in waves"; windows of pipelined chains and
overtaken events: docs/relay.md, "Pipelined chains"."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.model import OutboxMessage
from .contract import ChainResult, FailureKind, Overtaken, Pipelined, PublishFailure
from .message import checked_headers

log = logging.getLogger("outbox.publisher")  # one logger for the whole publisher package

#: At most this many events of one pipelined chain are sent before their confirms are
#: collected (docs/relay.md, "Pipelined chains").
PIPELINE_WINDOW = 1000

#: A wave verdict: the broker returned the message (no queue bound for its routing key).
#: The others: ``None`` (confirmed) and a ``PublishFailure`` (nacked, or refused at send).
RETURNED = "returned"


@dataclass(frozen=True)
class Refused:
    """A wave verdict: the transport refused this event alone when it was sent (no confirms:
    a Redis error that is not the connection's, such as WRONGTYPE from one queue's key), or
    it was not sent after such a refusal in its window. Like a returned event it stops (or
    is overtaken in) its own chain only; before, it stopped every chain (found in review)."""

    failure: PublishFailure


class ChainProgress:
    """How far one chain of a ``publish_chains`` call has got."""

    def __init__(self, chain: list[OutboxMessage]) -> None:
        self.chain = chain
        self.position = 0
        self.published: list[int] = []
        self.unroutable: list[int] = []
        self.overtaken: list[Overtaken] = []
        self.failure: PublishFailure | None = None

    @property
    def next(self) -> OutboxMessage:
        return self.chain[self.position]

    @property
    def going(self) -> bool:
        return self.failure is None and self.position < len(self.chain)

    def window(self, pipelined: Pipelined | None) -> list[OutboxMessage]:
        """The events this chain sends in the next wave: the next one alone (strict), or,
        when it opted in to pipelining, it and the opted-in events right after it (up to
        ``PIPELINE_WINDOW``); a strict event is sent only once everything before it is
        confirmed."""
        first = self.next
        if pipelined is None or not pipelined(first):
            return [first]
        end, limit = self.position + 1, min(len(self.chain), self.position + PIPELINE_WINDOW)
        while end < limit and pipelined(self.chain[end]):
            end += 1
        return self.chain[self.position:end]

    def advance(self, unroutable: bool = False) -> None:
        self.published.append(self.next.id)
        if unroutable:
            self.unroutable.append(self.next.id)
        self.position += 1

    def overtake(self, failure: PublishFailure, delivered_after: list[int]) -> None:
        """The next event failed but later ones of its window were confirmed: pass it."""
        self.overtaken.append(Overtaken(self.next.id, failure, tuple(delivered_after)))
        self.position += 1

    def stop(self, failure: PublishFailure) -> None:
        self.failure = failure

    def result(self) -> ChainResult:
        failed_id = self.next.id if self.failure is not None else None
        return ChainResult(tuple(self.published), failed_id, self.failure, tuple(self.unroutable),
                           tuple(self.overtaken))


@dataclass
class Wave:
    """What one wave sends: each chain's events in it (``windows``, one event for a strict
    chain), and the same events flat, in sending order, with their checked headers."""

    windows: list[tuple[ChainProgress, list[OutboxMessage]]] = field(default_factory=list)
    messages: list[OutboxMessage] = field(default_factory=list)
    headers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pipelined(self) -> bool:
        """Some chain sends more than one event in this wave."""
        return any(len(sent) > 1 for _, sent in self.windows)

    @property
    def owners(self) -> list[int]:
        """For each event of ``messages``, the index of its chain's window in ``windows``."""
        return [index for index, (_, sent) in enumerate(self.windows) for _ in sent]

    def stop(self, failure: PublishFailure) -> None:
        """Every chain of the wave stops at its next event (the wave was not sent)."""
        for chain, _ in self.windows:
            chain.stop(failure)


# -- building a wave ---------------------------------------------------------------------------
def next_wave(going: list[ChainProgress], pipelined: Pipelined | None, refused: dict[str, PublishFailure],
              max_message_bytes: int, *, single: bool = False) -> Wave:
    """The next wave: what each chain still going sends (``_to_send``), in the chains' order.
    Empty when every chain stopped at a poison next event. ``single``: one event only, the
    first chain's next (after a refusal of a whole wave that named none of its events)."""
    wave = Wave()
    for chain in going:
        sent = _to_send(chain, None if single else pipelined, refused, max_message_bytes, wave.headers)
        if sent:
            wave.windows.append((chain, sent))
            wave.messages.extend(sent)
            if single:
                break
    return wave


def _to_send(chain: ChainProgress, pipelined: Pipelined | None, refused: dict[str, PublishFailure],
             max_message_bytes: int, headers: list[dict[str, Any]]) -> list[OutboxMessage]:
    """The events of ``chain``'s window (``ChainProgress.window``) that go in this wave, each
    one's headers appended to ``headers``. The window ends before an event of a route refused
    earlier in the call or a poison one: either is handled when it is next, alone, as in a
    strict chain. A poison next event stops the chain here, with nothing sent."""
    sent: list[OutboxMessage] = []
    for message in chain.window(pipelined):
        if sent and message.topic in refused:
            break  # sent alone next, where it stops on its refused route
        event_headers, poisoned = checked_headers(message, max_message_bytes)
        if poisoned is not None:
            if not sent:
                chain.stop(poisoned)
            break  # a poison event stops its chain when it is next, never overtaken
        sent.append(message)
        headers.append(event_headers)
    return sent


# -- applying the verdicts ---------------------------------------------------------------------
def settle_wave(wave: Wave, verdicts: list[Any], refused: dict[str, PublishFailure], *,
                unroutable: str, exchange: str, others: list[ChainProgress] | None = None) -> list[ChainProgress]:
    """Apply the broker's verdicts on ``wave`` (one per event, in sending order) to each of its
    chains (``apply_verdicts``); returns the chains still going, the wave's and then
    ``others`` (chains that sat this wave out: a ``single`` wave), which a broker-wide
    failure or a refused route stops as it stops the wave's. Records the routes refused
    in ``refused``."""
    broker_wide: PublishFailure | None = None
    at = 0
    for chain, sent in wave.windows:
        problem = apply_verdicts(chain, sent, verdicts[at:at + len(sent)], refused,
                                 unroutable=unroutable, exchange=exchange)
        at += len(sent)
        broker_wide = broker_wide or problem
    going = [chain for chain, _ in wave.windows if chain.going] + [chain for chain in others or () if chain.going]
    if broker_wide is not None:
        # The connection failed mid-wave (transports without confirms): send nothing more;
        # every chain still going stops at its next event for the same reason.
        for chain in going:
            chain.stop(broker_wide)
        return []
    if refused:
        # A queue of these routes refuses messages: chains whose next event goes the
        # same way stop there (the relay releases them, no attempt spent); chains of
        # other routes carry on.
        for chain in going:
            if chain.next.topic in refused:
                chain.stop(refused[chain.next.topic])
        going = [chain for chain in going if chain.going]
    return going


def apply_verdicts(chain: ChainProgress, sent: list[OutboxMessage], verdicts: list[Any],
                   refused: dict[str, PublishFailure], *, unroutable: str, exchange: str) -> PublishFailure | None:
    """Apply the broker's verdicts on the events ``chain`` sent in one wave, in order: a
    confirmed event advances the chain; a failed one stops it, unless a later event of the
    same window reached a queue (``_reached``), which overtook it (``ChainProgress.overtake``).
    Records refused routes; returns a broker-wide failure, if any."""
    failures = [_failure(message, verdict, unroutable, exchange) for message, verdict in zip(sent, verdicts)]
    reached = _reached(failures, verdicts)
    broker_wide: PublishFailure | None = None
    for index, (_message, failure) in enumerate(zip(sent, failures)):
        if failure is None:
            chain.advance(unroutable=verdicts[index] == RETURNED)
            continue
        if verdicts[index] == RETURNED or isinstance(verdicts[index], Refused) or failure.kind is FailureKind.POISON:
            pass  # an unroutable, refused or poison event stops (or is overtaken in) its own chain only
        elif failure.route is not None:
            # What stops the chains whose next event goes there, never sent: said so, and which
            # event was refused (the relay's WARNING per pause names the first chain it settles).
            refused[failure.route] = replace(failure, reason=f"not sent: a queue of its routing key refused outbox id "
                                             f"{sent[index].id} in this publish: {failure.reason}")
        else:
            broker_wide = failure
        if reached and reached[-1] > index:
            chain.overtake(failure, [sent[i].id for i in reached if i > index])
        else:
            chain.stop(failure)
            break
    return broker_wide


def _failure(message: OutboxMessage, verdict: Any, unroutable: str, exchange: str) -> PublishFailure | None:
    """What one verdict means for its event: ``None`` when it counts as published (confirmed,
    or returned under ``unroutable="drop"``), else the failure."""
    if verdict is None:
        return None
    if isinstance(verdict, Refused):
        return verdict.failure
    if verdict == RETURNED and unroutable == "drop":
        log.warning("outbox event %s (%s) was unroutable and is dropped (unroutable='drop')",
                    message.id, message.topic)
        return None
    if verdict == RETURNED:
        return PublishFailure(
            FailureKind.RETRIABLE,
            f"unroutable: no queue bound for routing key {message.topic!r} on exchange {exchange!r}")
    return verdict


def _reached(failures: list[PublishFailure | None], verdicts: list[Any]) -> list[int]:
    """The indexes of the events that may sit in some queue: confirmed ones, and nacked ones
    (a nack means one queue refused it; others bound for its routing key may have taken it).
    A returned event reached no queue; a poison or refused one was never sent."""
    return [i for i, (failure, verdict) in enumerate(zip(failures, verdicts))
            if (failure is None and verdict != RETURNED)
            or (failure is not None and verdict != RETURNED and failure.route is not None)]
