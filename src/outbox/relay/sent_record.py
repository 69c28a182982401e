"""When a scheduler last sent its entries other than the claim tick (the purge), kept on the
task runner's broker, so that a scheduler restarted, or a new leader, keeps to the entry's
interval rather than putting it off a whole interval from its start: Celery's beat
(``outbox.celery.beat``) and Dramatiq's scheduler (``outbox.dramatiq.scheduler``). The rule
(``first_due``) and the records are written once here (docs/relay.md, "Purge"; docs/dramatiq.md,
"The scheduler")."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

log = logging.getLogger("outbox.relay")

#: A record of when an entry was last sent is kept this many of its intervals (then a
#: scheduler waits one interval from when it finds none).
RECORD_KEEP = 10
#: RabbitMQ deletes a record's queue (``RabbitSentRecord``) after this long unused: an outbox
#: gone. Above twice the longest purge interval (30 days), which a scheduler writes it at least
#: once in. Changing it makes RabbitMQ refuse the declaration of an existing queue.
RECORD_QUEUE_EXPIRES_MS = 61 * 86_400_000


class SentRecord(Protocol):
    def last_sent(self, names: list[str]) -> dict[str, float]:
        """When each of ``names`` was last sent (epoch seconds). Unknown or unreadable: left out."""

    def record_sent(self, name: str, at: float, keep_s: float) -> None:
        """Record that ``name`` was sent at ``at`` (epoch seconds), for ``keep_s``."""


def first_due(record: SentRecord | None, entries: list[tuple[str, float, float]], wall: float) -> dict[str, float]:
    """Seconds from ``wall`` (epoch seconds) until a scheduler that starts (or gains the lead)
    sends each of ``entries`` (``(name, every_s, unknown_at)``): an interval after it was last
    sent (``record.last_sent``), never later than an interval from now, whatever the clocks say.
    An entry with no record is taken as sent at ``unknown_at`` (now, or when a kept schedule file
    says it last ran) and recorded so, so that the schedulers after this one keep to that
    schedule rather than each putting it off by a whole interval as it starts. Without a place
    for the record (``record`` None: a broker that has none), each entry is sent at once."""
    if record is None:
        return {name: 0.0 for name, _, _ in entries}
    last = record.last_sent([name for name, _, _ in entries])
    due = {}
    for name, every_s, unknown_at in entries:
        at = last.get(name)
        if at is None:
            at = unknown_at
            record.record_sent(name, at, RECORD_KEEP * every_s)
        due[name] = min(every_s, max(0.0, at + every_s - wall))
    return due


class _FailuresLogged:
    """A record's failures to read or write: the first one a WARNING (the purge is put off an
    interval from this start: docs/relay.md, "Purge"), the next ones DEBUG."""

    _warned = False

    def _failed(self, what: str, exc: BaseException) -> None:
        if self._warned:
            log.debug("outbox scheduler: cannot %s: %s", what, exc)
            return
        self._warned = True
        log.warning("outbox scheduler: cannot %s: %s. Without the record the purge may be put off an interval "
                    "from this start (later failures of this record are logged at DEBUG)", what, exc)


class RedisSentRecord(_FailuresLogged):
    """A key per entry, ``<prefix><name>``, holding the epoch seconds of its last send."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def last_sent(self, names: list[str]) -> dict[str, float]:
        if not names:
            return {}
        try:
            values = self.client.mget([f"{self.prefix}{name}" for name in names])
        except Exception as exc:  # noqa: BLE001 - read as never sent: one interval from now, as before
            self._failed("read when the entries were last sent", exc)
            return {}
        return {name: float(value) for name, value in zip(names, values, strict=True) if value is not None}

    def record_sent(self, name: str, at: float, keep_s: float) -> None:
        try:
            self.client.set(f"{self.prefix}{name}", repr(at), px=int(keep_s * 1000))
        except Exception as exc:  # noqa: BLE001 - the next scheduler then waits one interval, as before
            self._failed(f"record when {name} was sent", exc)


class RabbitSentRecord(_FailuresLogged):
    """The one message of a durable queue ``queue``, a JSON object of every entry's last send:
    at most one message long (a new one drops the old), deleted by RabbitMQ after
    ``RECORD_QUEUE_EXPIRES_MS`` unused. Read by taking the message and putting it back.
    ``channel()``: a context giving a channel of a connection to RabbitMQ."""

    def __init__(self, queue: str, channel: Callable[[], AbstractContextManager[Any]]) -> None:
        self.queue = queue
        self.channel = channel
        self._sent: dict[str, float] = {}

    def _declared(self, channel: Any) -> Any:
        channel.queue_declare(queue=self.queue, durable=True, auto_delete=False,
                              arguments={"x-max-length": 1, "x-expires": RECORD_QUEUE_EXPIRES_MS})
        return channel

    def last_sent(self, names: list[str]) -> dict[str, float]:
        try:
            with self.channel() as channel:
                got = self._declared(channel).basic_get(queue=self.queue, no_ack=False)
                if got is not None:
                    channel.basic_reject(got.delivery_tag, requeue=True)
                    record = json.loads(got.body)
                    self._sent = {str(k): float(v) for k, v in record.items()} if isinstance(record, dict) else {}
        except Exception as exc:  # noqa: BLE001 - read as never sent: one interval from now, as before
            self._failed("read when the entries were last sent", exc)
        return {name: self._sent[name] for name in names if name in self._sent}

    def record_sent(self, name: str, at: float, keep_s: float) -> None:
        """The record's message is replaced by one holding every entry's time, which RabbitMQ
        drops after ``keep_s``."""
        self._sent[name] = at
        try:
            from amqp import Message

            with self.channel() as channel:
                self._declared(channel).basic_publish(Message(json.dumps(self._sent), delivery_mode=2,
                                                              expiration=str(int(keep_s * 1000))),
                                                      exchange="", routing_key=self.queue)
        except Exception as exc:  # noqa: BLE001 - the next scheduler then waits one interval, as before
            self._failed(f"record when {name} was sent", exc)


@contextmanager
def closing_channel(conn: Any) -> Iterator[Any]:
    """A channel of ``conn`` (a kombu connection), closed after use (``RabbitSentRecord.channel``)."""
    channel = conn.channel()
    try:
        yield channel
    finally:
        channel.close()


__all__ = ["RECORD_KEEP", "RECORD_QUEUE_EXPIRES_MS", "SentRecord", "first_due", "RedisSentRecord",
           "RabbitSentRecord", "closing_channel"]
