"""kombu's Redis transport for Celery's own broker, made to survive garbage in a queue.

kombu's Redis channel pops a message with ``BRPOP`` and decodes its JSON envelope inside
the worker's event loop. Bytes that are not a kombu envelope (anything ``LPUSH``ed onto
a relay queue (``<namespace>.claim``) by hand, a stray producer, a truncated write) raise ``JSONDecodeError``
(or ``KeyError`` for JSON that is not an envelope) out of that loop, and Celery stops the
worker: "Unrecoverable error". Celery's own ``on_decode_error`` only covers a bad *body*
inside a good envelope, which is decoded later.

Here a message whose envelope cannot be read (``Message`` raises ``UndecodableMessage``)
or whose bytes are not JSON is logged on one line and dropped, and the worker carries on.
The message is already off the list (``BRPOP`` removed it) and was never handed to
Celery, so nothing is acknowledged or redelivered: it is dropped, which is all garbage
deserves. The relay never loses work this way: a claim tick or a publish task is
recovered by the next tick or by the rows' lease. Only those two errors are caught: an
error of the Redis connection or of Celery's own handling of a good message goes on to
Celery as before (a lost connection is reconnected; it is no garbage to drop).

It also mends two faults of kombu 5.7 at a loss of Celery's broker, where a worker leaked
a transport per Redis outage and could stop (``Channel.close``, ``Transport``).

``outbox.celery`` selects this transport (``broker_transport``) when Celery's broker URL is
``redis://`` or ``rediss://``; the URL, TLS included, and every Redis transport option work as
with kombu's own (the app reads and shows it as that URL: ``outbox.celery.application.Connection``).
"""

from __future__ import annotations

import json
import logging
from queue import Empty
from typing import Any, ClassVar

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger("outbox.celery")


class UndecodableMessage(Exception):
    """A message whose kombu envelope cannot be read (JSON of the wrong shape, a body
    that is not in its stated encoding)."""


class Message(virtual.Message):
    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # binascii.Error is a ValueError
            raise UndecodableMessage(f"{type(exc).__name__}: {exc}") from exc
        # What kombu's QoS reads of the envelope next, outside this guard: a delivery_info
        # that is no mapping of exchange and routing key, or a tag that cannot be a sorted-set
        # member, stopped the worker ("Unrecoverable error") or cost it its connection (found in review).
        info = self.delivery_info
        if not isinstance(info, dict) or not {"exchange", "routing_key"} <= info.keys():
            raise UndecodableMessage(f"delivery_info is not a mapping of exchange and routing_key: {info!r}"[:300])
        if not isinstance(self.delivery_tag, (str, int)) or isinstance(self.delivery_tag, bool):
            raise UndecodableMessage(f"delivery_tag is not a string or an integer: {self.delivery_tag!r}"[:300])


class Channel(kombu_redis.Channel):
    Message = Message

    def close(self) -> None:
        """kombu's, except that a connection error reading the reply of a ``BRPOP`` still in
        flight (the broker is gone: there is no reply) does not leave the channel open. Left
        open, Celery's second close of the connection failed with an ``AttributeError`` and
        the worker stopped (docs/benchmarks.md, "Celery through cuts", item 2)."""
        if self._in_poll and not self.closed:
            try:
                self._brpop_read()
            except Empty:
                pass
            except self.connection_errors as exc:
                log.debug("outbox: Celery's Redis broker is gone; closing the channel without its last reply (%s)",
                          exc)
        super().close()

    def _brpop_read(self, **options: Any) -> bool:
        try:
            return super()._brpop_read(**options)
        except (json.JSONDecodeError, UnicodeDecodeError, UndecodableMessage) as exc:
            log.error("outbox: dropped an undecodable message from Celery's Redis broker (%s: %s); "
                      "the worker carries on", type(exc).__name__, " ".join(str(exc).split())[:300])
            return True


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the channel above. When it registers with an event
    loop it first takes out the ``on_tick`` callbacks that transports registered there
    before left behind once their connection was closed (kombu sets their ``client`` to
    None): kombu keeps them for good, and Celery's consumer makes a new connection after
    every loss of its broker, so each outage left one more, run on every turn of the loop
    and holding its dead transport (docs/benchmarks.md, "Celery through cuts", item 1).
    Taken out at the next registration, not as the connection closes, which made the
    worker's stop of item 2 come at the first cut."""

    Channel = Channel

    #: (transport, loop, the callbacks it added to the loop's on_tick), per registration.
    registered: ClassVar[list[tuple[Any, Any, set[Any]]]] = []

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        for entry in list(Transport.registered):
            transport, its_loop, added = entry
            if its_loop is loop and transport.client is None:
                loop.on_tick.difference_update(added)
                Transport.registered.remove(entry)
        before = set(loop.on_tick)
        super().register_with_event_loop(connection, loop)
        Transport.registered.append((self, loop, set(loop.on_tick) - before))


__all__ = ["Transport", "Channel", "Message", "UndecodableMessage"]
