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


def workers_transport_options() -> dict[str, Any]:
    """The options a relay worker's database broker runs with, read without the Celery app:
    the relay's, then its Celery config module's ``broker_transport_options``, key by key
    (as ``outbox.celery.application`` merges them). ``outbox migrate`` makes the queue tables
    they name; the Alembic filter (``outbox.contrib.alembic``) leaves them out."""
    import os

    from ..core.sources import module_setting

    return {**transport_options(visibility_timeout=1.0), **(module_setting(os.environ, "broker_transport_options") or {})}


__all__ = ["transport_options", "workers_transport_options", "SCHEME"]
