"""kombu's Redis transport for Celery's own broker, made to survive garbage in a queue.

kombu's Redis channel pops a message with ``BRPOP`` and decodes its JSON envelope inside
the worker's event loop. Bytes that are not a kombu envelope (anything ``LPUSH``ed onto
a relay queue (``<namespace>.claim``) by hand, a stray producer, a truncated write) raise ``JSONDecodeError``
(or ``KeyError`` for JSON that is not an envelope) out of that loop, and Celery stops the
worker: "Unrecoverable error". Celery's own ``on_decode_error`` only covers a bad *body*
inside a good envelope, which is decoded later.

``Channel._brpop_read`` here catches those decoding errors, logs the dropped message on
one line and carries on. The message is already off the list (``BRPOP`` removed it) and
was never handed to Celery, so nothing is acknowledged or redelivered: it is dropped,
which is all garbage deserves. The relay never loses work this way: a claim tick or a
publish task is recovered by the next tick or by the rows' lease.

``outbox.celery`` selects this transport (``broker_transport``) when Celery's broker URL is
``redis://``; the URL and every Redis transport option work as with kombu's own (the
app shows it as that URL: ``outbox.celery.application.Connection``).
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger("outbox.celery")

#: What decoding a message that is not a kombu envelope raises: JSONDecodeError and
#: binascii.Error are ValueErrors; JSON of the wrong shape gives KeyError/TypeError/
#: AttributeError when kombu reads the envelope's fields.
DECODE_ERRORS = (ValueError, KeyError, TypeError, AttributeError)


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options: Any) -> bool:
        try:
            return super()._brpop_read(**options)
        except DECODE_ERRORS as exc:
            log.error("outbox: dropped an undecodable message from Celery's Redis broker (%s: %s); "
                      "the worker carries on", type(exc).__name__, " ".join(str(exc).split())[:300])
            return True


class Transport(kombu_redis.Transport):
    Channel = Channel


__all__ = ["Transport", "Channel", "DECODE_ERRORS"]
