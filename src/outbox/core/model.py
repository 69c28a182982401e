"""The values that cross the store boundary: status codes, claimed messages, results, and
the failure kinds a publisher reports and the relay settles by."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class Status(enum.IntEnum):
    """Row status codes. They are part of the public contract: never renumber."""

    PENDING = 0
    CLAIMED = 1
    DONE = 2
    FAILED = 3  # waiting for its retry at next_retry_at
    DEAD = 4


class FailureKind(enum.StrEnum):
    """What the relay should do about an event that was not published (docs/relay.md,
    "Failure policy"). A ``StrEnum``: it prints as its value (``poison``), which is what
    ``last_error`` and the metrics record."""

    RETRIABLE = "retriable"
    BACKPRESSURE = "backpressure"
    POISON = "poison"
    FATAL = "fatal"


@dataclass(frozen=True)
class NewEvent:
    """A validated event, ready to be inserted. Built by ``outbox.domain.events.prepare_event``."""

    message_id: str
    topic: str
    aggregate_type: str
    aggregate_id: str
    partition_key: str | None
    payload_json: str
    headers_json: str
    trace_id: str | None


@dataclass(frozen=True)
class OutboxMessage:
    """A row handed to the relay by ``claim``. ``attempt`` counts from 1."""

    id: int
    message_id: str
    topic: str
    aggregate_type: str
    aggregate_id: str
    partition_key: str | None
    payload: str
    headers: dict[str, Any]
    trace_id: str | None
    attempts: int
    created_at: datetime
    lease: str

    @property
    def attempt(self) -> int:
        return self.attempts + 1

    @property
    def size(self) -> int:
        """Approximate bytes this message holds in memory (payload dominates)."""
        return len(self.payload) + 256


@dataclass(frozen=True)
class Claim:
    """One batch leased by one ``claim`` call: every message shares the lease token."""

    lease: str
    messages: list[OutboxMessage] = field(default_factory=list)
    #: Rows this claim found with an expired lease and no attempts left: they went
    #: dead instead of being claimed (their ``lease`` is this claim's, for logging only).
    dead: list[OutboxMessage] = field(default_factory=list)
    #: The recorded reason of each row in ``dead`` that did not go dead on lease expiry
    #: (a row the claim could not decode: ``"undecodable row: ..."``), by id.
    dead_errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.messages)


@dataclass(frozen=True)
class FenceResult:
    """What a lease-fenced write did. ``stale`` > 0 means our lease was lost for
    some rows (it expired and another worker re-claimed them): they were left alone."""

    requested: int
    applied: int

    @property
    def stale(self) -> int:
        return self.requested - self.applied

    @property
    def ok(self) -> bool:
        return self.applied == self.requested


@dataclass(frozen=True)
class FailResult:
    applied: bool
    dead: bool


@dataclass(frozen=True)
class Stats:
    counts: dict[str, int]
    oldest_pending_age_s: float | None
    #: None: not counted (``OutboxStore.stats(closed=False)``).
    dead: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "oldest_pending_age_s": self.oldest_pending_age_s, "dead": self.dead}


@dataclass(frozen=True)
class DeadRow:
    id: int
    message_id: str
    topic: str
    aggregate_type: str
    aggregate_id: str
    attempts: int
    last_error: str | None
    processed_at: datetime | None


@dataclass(frozen=True)
class RequeueResult:
    """What ``OutboxStore.requeue`` did, and what it would not do.

    ``requeued`` counts the rows made pending again, per topic; ``permanent`` the dead
    rows left dead because their recorded reason is permanent (requeue those with
    ``force``), per topic. With explicit ids, ``refused`` holds the permanent rows named,
    ``missing`` the ids that do not exist and ``not_dead`` the ids whose row is not dead
    (with its status); if any id is refused, missing or not dead, nothing is requeued."""

    requeued: dict[str, int] = field(default_factory=dict)
    permanent: dict[str, int] = field(default_factory=dict)
    refused: list[DeadRow] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    not_dead: dict[int, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(self.requeued.values())

    @property
    def ok(self) -> bool:
        """Every id asked for was requeued (always true for "all")."""
        return not (self.refused or self.missing or self.not_dead)


@dataclass(frozen=True)
class Holder:
    """A relay worker process as its liveness record names it (docs/internals.md, "Lost workers")."""

    holder_id: str
    host: str
    pid: int


@dataclass(frozen=True)
class SilentHolder:
    """A holder whose last beat is older than the holder timeout: ``silent_s`` seconds ago."""

    holder: Holder
    silent_s: float


@dataclass(frozen=True)
class Beat:
    """What one heartbeat found: whether this holder's record was missing (it was presumed
    lost and taken over, or never written), and the holders gone silent."""

    recreated: bool
    silent: list[SilentHolder] = field(default_factory=list)


@dataclass(frozen=True)
class Takeover:
    """The rows of a silent holder whose leases ``OutboxStore.take_over`` ended: how many, and
    how long the oldest of them had been held (seconds, database clock; 0 when none)."""

    holder: SilentHolder
    rows: int
    held_s: float


# -- the message codec: a claimed message as JSON-safe data (what publish tasks carry) ----------

def message_to_dict(message: OutboxMessage) -> dict[str, Any]:
    """JSON-safe form of a claimed message, as publish tasks carry it (lease included)."""
    return {
        "id": message.id, "message_id": message.message_id, "topic": message.topic,
        "aggregate_type": message.aggregate_type, "aggregate_id": message.aggregate_id,
        "partition_key": message.partition_key, "payload": message.payload, "headers": message.headers,
        "trace_id": message.trace_id, "attempts": message.attempts,
        "created_at": message.created_at.isoformat() if message.created_at else None,
        "lease": message.lease,
    }


def message_from_dict(data: Mapping[str, Any]) -> OutboxMessage:
    created = data.get("created_at")
    return OutboxMessage(
        id=int(data["id"]), message_id=data["message_id"], topic=data["topic"],
        aggregate_type=data["aggregate_type"], aggregate_id=data["aggregate_id"],
        partition_key=data.get("partition_key"), payload=data["payload"], headers=dict(data.get("headers") or {}),
        trace_id=data.get("trace_id"), attempts=int(data.get("attempts") or 0),
        created_at=datetime.fromisoformat(created) if isinstance(created, str) else created,  # type: ignore[arg-type]
        lease=data["lease"],
    )
