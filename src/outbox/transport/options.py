"""``OUTBOX_TRANSPORT_*``: the database broker's options for the relay's own Celery
app (``outbox.celery``), declared with every other setting (``config.TransportOptions``),
read in the one order, and turned into kombu ``broker_transport_options``.
Other Celery apps pass ``broker_transport_options`` directly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.config import DATABASE_BROKER_SCHEME as SCHEME  # the URL scheme prefix: ``outboxdb+postgresql://...``
from ..core.config import TransportOptions, current
from ..core.options import Sources


def transport_options(*sources: Mapping[str, Any] | Sources, visibility_timeout: float) -> dict[str, Any]:
    """kombu transport options from ``sources`` (default: the process's, read once);
    ``visibility_timeout`` is the default when no OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S is set."""
    found = TransportOptions.from_sources(*sources) if sources else current(TransportOptions)
    return {"visibility_timeout": visibility_timeout, "polling_interval": 1.0, **found.kombu()}


__all__ = ["transport_options", "SCHEME"]
