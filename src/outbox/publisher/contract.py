"""The publisher's contract: ``Publisher`` (what a destination implements), its results,
the limits (docs/publisher.md). ``FailureKind`` lives in ``core.model``."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..core.config import Settings, relay_options
from ..core.model import FailureKind, OutboxMessage

log = logging.getLogger("outbox.publisher")  # one logger for the whole publisher package


#: The default refusal threshold for one message body. RabbitMQ 4.x refuses bodies above
#: 16 MiB by default (``max_message_size``; it was 128 MiB in 3.8-3.13), so this is the
#: largest size every supported broker accepts out of the box.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: The header table travels in one AMQP content-header frame, which must fit in the
#: negotiated ``frame_max`` (128 KiB by default on RabbitMQ and py-amqp). Past this the
#: broker closes the whole connection with FRAME_ERROR, so we refuse earlier, per event.
MAX_HEADER_BYTES = 64 * 1024

#: AMQP short strings (routing key, ``message_id``, header names) hold at most this many bytes.
MAX_SHORTSTR_BYTES = 255

#: ``x-outbox-error`` is cut to this many characters on dead-lettered messages.
MAX_ERROR_HEADER_CHARS = 1000

RESERVED_HEADERS = frozenset({
    "message_id", "outbox_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
    "attempt", "created_at",
})

UNROUTABLE_POLICIES = ("fail", "drop")


def publish_budget_s(settings: Settings) -> float:
    """The part of the lease one publish may spend waiting on its broker
    (``OUTBOX_CLAIM_TIMEOUT_MS`` x ``OUTBOX_RELAY_LEASE_SAFETY``). Waiting longer leaves the
    rows of a hung broker to lease recovery instead of releasing them without an attempt
    spent (docs/destinations.md, "Failures")."""
    return settings.claim_timeout_ms / 1000.0 * relay_options().lease_safety


@dataclass(frozen=True)
class PublishFailure:
    kind: FailureKind
    reason: str
    #: The exception behind the failure, if any (for logs; not part of equality).
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    #: BACKPRESSURE from one routing key only (a queue bound for it refused the message,
    #: ``basic.nack``); None when the broker as a whole is down or pushing back.
    route: str | None = None


@dataclass(frozen=True)
class Overtaken:
    """An event of a pipelined chain that the broker did not take (returned unroutable,
    nacked, refused by the encoder) while later events of its chain, sent in the same
    window, were confirmed: they are delivered ahead of it, so it must not be retried
    (docs/relay.md, "Pipelined chains")."""

    id: int
    failure: PublishFailure
    #: The ids of the later events of its window that may sit in a queue ahead of it
    #: (confirmed, or nacked: another queue may have taken a nacked one), in order.
    delivered_after: tuple[int, ...]


#: Dead-letter headers of an overtaken event: the ids of the events of its chain delivered
#: after it (comma-separated, cut to ``MAX_ERROR_HEADER_CHARS`` ending in ",...") and how many.
OVERTAKEN_BY_HEADER = "x-outbox-overtaken-by"
OVERTAKEN_COUNT_HEADER = "x-outbox-overtaken-count"


def overtaken_headers(overtaken: Overtaken) -> dict[str, Any]:
    """The headers that mark the dead-letter copy of an overtaken event."""
    ids = ",".join(map(str, overtaken.delivered_after))
    if len(ids) > MAX_ERROR_HEADER_CHARS:
        ids = ids[:MAX_ERROR_HEADER_CHARS - 4].rsplit(",", 1)[0] + ",..."
    return {OVERTAKEN_BY_HEADER: ids, OVERTAKEN_COUNT_HEADER: len(overtaken.delivered_after)}


#: A predicate over events: whether an event opted in to pipelining.
Pipelined = Callable[[OutboxMessage], bool]

#: A dead row's dead-letter copy to send: the row, the reason it went dead, the headers added
#: to it (``Publisher.publish_dead``).
DeadCopy = tuple[OutboxMessage, str, "Mapping[str, Any] | None"]


@dataclass(frozen=True)
class ChainResult:
    """The outcome of one chain of a ``publish_chains`` call.

    ``published`` is always a prefix of the chain's ids, in order. When the chain stopped
    early, ``failed_id`` is the id of the first event that was not published (the one right
    after that prefix) and ``failure`` says why; everything after it was not sent either.
    """

    published: tuple[int, ...] = ()
    failed_id: int | None = None
    failure: PublishFailure | None = None
    #: Ids in ``published`` that the broker reported unroutable (``unroutable="drop"``).
    unroutable: tuple[int, ...] = ()
    #: Pipelined chains only: events the broker did not take although later events were
    #: confirmed. ``published`` then lists the confirmed events around them, in order: the
    #: chain's ids up to ``failed_id`` (or all of them) minus these.
    overtaken: tuple[Overtaken, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None


class Publisher(ABC):
    """What a destination implements, and all the relay calls on it (docs/publisher.md,
    "The contract"): ``publish_chains`` and ``close``; ``publish_dead`` when the
    destination has a dead-letter place.

    Implementations never raise for a publishing problem: they report it in the result so
    the relay always learns exactly which prefix reached the broker.
    """

    @abstractmethod
    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *,
                       pipelined: Pipelined | None = None, deadline: float | None = None) -> list[ChainResult]:
        """Publish several chains (of different aggregates), one result per chain, in order.

        Each chain (one aggregate, id order) reaches the broker as a prefix; chains are
        independent of each other, so an implementation may interleave them to share broker
        round trips. Events for which ``pipelined`` is true may be sent without waiting for
        the confirms of the events before them (docs/relay.md, "Pipelined chains"); an
        implementation may ignore it (strict is always allowed).

        ``deadline`` (a ``time.monotonic()`` value, or None: no cap beyond the publisher's own
        budget): when the lease's safe part runs out. The publisher waits on its broker no
        later than that, and reports what is not confirmed by then as when its own budget
        runs out, BACKPRESSURE (no attempt spent); nothing is sent once it has passed
        (docs/relay.md, "The publish's deadline")."""

    def publish_chain(self, messages: Sequence[OutboxMessage]) -> ChainResult:
        """Publish one chain: ``publish_chains`` of that chain alone."""
        return self.publish_chains([messages])[0]

    def publish_dead(self, message: OutboxMessage, error: str, *,
                     headers: Mapping[str, Any] | None = None) -> PublishFailure | None:
        """Send a copy of a dead row to the dead-letter exchange, if the publisher has one,
        with ``headers`` added to it (the pipelined ``x-outbox-overtaken-*`` ones).

        Returns ``None`` on success and when dead-letter publishing is not configured (this
        default). It is best effort: the dead row in the table stays the record of truth.
        """
        return None

    def publish_dead_all(self, copies: Sequence[DeadCopy]) -> list[PublishFailure | None]:
        """``publish_dead`` of each copy, in order: one result each, a copy that raised
        failing alone (``ApartPublisher`` sends them from one child process)."""
        results: list[PublishFailure | None] = []
        for message, error, headers in copies:
            try:
                results.append(self.publish_dead(message, error, headers=headers))
            except Exception as exc:  # noqa: BLE001 - best effort, as each copy: the dead row is the record
                results.append(PublishFailure(FailureKind.RETRIABLE, f"{type(exc).__name__}: {exc}", exception=exc))
        return results

    @abstractmethod
    def close(self) -> None:
        """Release the broker connection. The publisher reconnects if used again."""

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

