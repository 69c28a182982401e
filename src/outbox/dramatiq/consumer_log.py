"""Dramatiq's consumers through an outage of its broker, told once (docs/dramatiq.md, "When
Dramatiq's broker is away").

Each of a worker's consumers (one per queue: four per outbox, in every worker process)
reconnects every 3 s while the broker is away and logs each try at CRITICAL ("Consumer
encountered a connection error: ...", then "Restarting consumer in 3.00 seconds."): a
5-minute Redis restart gave hundreds of CRITICAL lines, each a page for an alert on
CRITICAL. ``ConsumerOutageFilter``, on the process's log handlers, turns them into the
relay's outage log (``relay.shared.Outage``): one WARNING when the first consumer loses the
broker, the rest at DEBUG, and one INFO line when the broker takes an ack again
(``OutboxMiddleware.after_ack`` calls ``back``; not when a message is processed, since
messages fetched before the outage are processed during it).

An ack that cannot be sent is retried every 5 s, each time with a WARNING that prints the
whole message (payloads included): those are the outage's too. On RabbitMQ the retry of an
ack whose connection is gone "succeeds" without reaching the broker (the consumer forgot its
delivery tag, and RabbitMQ requeued the message when the connection closed): the consumer
says so ("not in known tags") just before Dramatiq reports the ack, so ``back`` does not take
that ack for the broker's answer (it had ended a 6 s outage 1 s early, and the next failure
announced a second one).

Nor does an ack within Dramatiq's consumer restart delay (3 s) of the outage's start end it:
no consumer that lost the broker is back before then, and on RabbitMQ an ack only queues a
callback for its consumer's connection, so a worker thread "acks" on a connection that is
gone and not yet noticed (a cut logged "unreachable", "reachable again after 0.0 s" and
"unreachable" within a millisecond).
"""

from __future__ import annotations

import logging
import threading

from dramatiq.worker import CONSUMER_RESTART_DELAY_SECS

from ..core.logs import shows
from ..relay.shared import Outage

#: What Dramatiq's consumer threads log, from loggers under ``dramatiq.worker``.
CONNECTION_ERROR = "Consumer encountered a connection error: "
RESTARTING = "Restarting consumer in "
ACK_RETRIED = "Failed to post_process_message("
ACK_RETRIED_ERROR = " due to a connection error: "
#: What Dramatiq's RabbitMQ consumer logs, from ``dramatiq.brokers.rabbitmq``, when it drops
#: an ack or nack of a delivery from a connection that is gone.
TAG_FORGOTTEN = "message: not in known tags."


class ConsumerOutageFilter(logging.Filter):
    """A handler filter: a consumer's connection error, and an ack that waits for the broker,
    count towards ``outage`` and become its line (the first its WARNING, the rest DEBUG);
    "Restarting consumer" is dropped while the outage lasts; an ack dropped for a forgotten
    delivery tag is dropped from the log and marks its thread, so that ``back`` does not
    count it."""

    def __init__(self, outage: Outage, settle_s: float = CONSUMER_RESTART_DELAY_SECS) -> None:
        super().__init__()
        self.outage = outage
        self.settle_s = settle_s  # an ack this soon after the outage began proves nothing
        self._unsent = threading.local()  # this thread's last ack was dropped, not sent
        self._seen = threading.local()  # this thread's last record and what was decided for it

    def filter(self, record: logging.LogRecord) -> bool:
        # On every handler of the process: a record is looked at once, however many handlers.
        seen = self._seen
        if getattr(seen, "record", None) is record:
            return bool(seen.keep)
        keep = self._keep(record)
        seen.record, seen.keep = record, keep
        return keep

    def _keep(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("dramatiq.brokers.rabbitmq"):
            message = record.getMessage()
            if message.endswith(TAG_FORGOTTEN):
                if message.startswith("Failed to ack"):
                    self._unsent.ack = True  # logged in the thread that reports the ack next
                return False
            return True
        if not record.name.startswith("dramatiq.worker"):
            return True
        message = record.getMessage()
        if message.startswith(CONNECTION_ERROR):
            return self._told(record, message[len(CONNECTION_ERROR):])
        if message.startswith(ACK_RETRIED) and ACK_RETRIED_ERROR in message:
            return self._told(record, message.partition("\n")[0].rpartition(ACK_RETRIED_ERROR)[2])
        return not (message.startswith(RESTARTING) and self.outage.down)

    def _told(self, record: logging.LogRecord, error: str) -> bool:
        """Count ``error`` towards the outage, and make ``record`` the outage's own line (the
        announcement, or a DEBUG line when the outage's logger shows DEBUG); else drop it.
        The record is rewritten rather than a line logged from here: Python 3.13 ignores
        every logging call a thread makes while it handles a record, so the announcement
        logged from a filter was lost there (``outbox.core.logs``)."""
        _counted, line = self.outage.judge(error)
        log = self.outage.log
        if not shows(log, line.level):
            return False
        record.name, record.levelno, record.levelname = log.name, line.level, logging.getLevelName(line.level)
        record.msg, record.args, record.exc_info, record.exc_text = line.msg, line.args, None, None
        return True

    def back(self) -> None:
        """Dramatiq reports an ack in this thread: unless the consumer dropped it, or the outage
        began less than ``settle_s`` ago, the broker took it and answers (one INFO line after
        an outage)."""
        if getattr(self._unsent, "ack", False):
            self._unsent.ack = False
            return
        if self.outage.down and self.outage.age() < self.settle_s:
            return
        self.outage.ok()


def install(outage: Outage, logger: logging.Logger | None = None) -> ConsumerOutageFilter:
    """Attach one ``ConsumerOutageFilter`` to every handler of ``logger`` (default: the root
    logger, where Dramatiq's worker processes log), once; returns the one attached."""
    handlers = (logger or logging.getLogger()).handlers
    for handler in handlers:
        for existing in handler.filters:
            if isinstance(existing, ConsumerOutageFilter):
                return existing
    attached = ConsumerOutageFilter(outage)
    for handler in handlers:
        handler.addFilter(attached)
    return attached


__all__ = ["ConsumerOutageFilter", "install"]
