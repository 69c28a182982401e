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
"""

from __future__ import annotations

import logging

from ..relay.shared import Outage

#: What Dramatiq's consumer threads log, from loggers under ``dramatiq.worker``.
CONNECTION_ERROR = "Consumer encountered a connection error: "
RESTARTING = "Restarting consumer in "


class ConsumerOutageFilter(logging.Filter):
    """A handler filter: a consumer's connection error goes to ``outage`` instead of the log,
    and its "Restarting consumer" line is dropped while the outage lasts."""

    def __init__(self, outage: Outage) -> None:
        super().__init__()
        self.outage = outage

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("dramatiq.worker"):
            return True
        message = record.getMessage()
        if message.startswith(CONNECTION_ERROR):
            self.outage.failed(message[len(CONNECTION_ERROR):])
            return False
        return not (message.startswith(RESTARTING) and self.outage.down)

    def back(self) -> None:
        """The broker took an ack: it answers (one INFO line after an outage)."""
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
