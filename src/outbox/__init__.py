"""outbox-relay: a transactional outbox relayed by Celery.

Write side::

    from outbox import enqueue
    enqueue(conn, topic="orders.created", aggregate_type="order", aggregate_id="42",
            payload={"orderId": "42"})

Relay side: ``celery -A outbox worker`` and ``celery -A outbox beat``.
"""

from .core.errors import ConfigError, EnqueueError, OutboxError, StoreError, UnsupportedConnection
from .core.model import Status
from .enqueue import enqueue
from .storage.store import OutboxStore
from .wake import transaction

__all__ = ["enqueue", "EnqueueError", "ConfigError", "OutboxError", "StoreError", "UnsupportedConnection",
           "Status", "OutboxStore", "transaction"]
__version__ = "0.1.0"
