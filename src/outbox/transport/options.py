"""``OUTBOX_TRANSPORT_*``: the database broker's options for the relay's own Celery
app (``outbox.celery``), read from Celery config keys and the environment like
every OUTBOX_* setting, and turned into kombu ``broker_transport_options``.
Other Celery apps pass ``broker_transport_options`` directly."""

from __future__ import annotations

from typing import Any, Mapping

from ..core.config import DATABASE_BROKER_SCHEME as SCHEME  # the URL scheme prefix: ``outboxdb+postgresql://...``
from ..core.config import TRANSPORT_PREFIX, TRANSPORT_SETTINGS
from ..core.errors import ConfigError


def transport_options(*sources: Mapping[str, Any], visibility_timeout: float) -> dict[str, Any]:
    """kombu transport options from the first source that sets each OUTBOX_TRANSPORT_*
    name; ``visibility_timeout`` is the default when none does."""
    unknown = [k for source in sources for k in source
               if k.startswith(TRANSPORT_PREFIX) and k not in TRANSPORT_SETTINGS]
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]} (known: {', '.join(TRANSPORT_SETTINGS)})")
    options: dict[str, Any] = {"visibility_timeout": visibility_timeout, "polling_interval": 1.0}
    for name, (option, kind, low, high) in TRANSPORT_SETTINGS.items():
        raw = next((s[name] for s in sources if s.get(name) not in (None, "")), None)
        if raw is None:
            continue
        try:
            value = kind(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
        if kind is not str and not (low <= value <= high):
            raise ConfigError(f"{name}={raw!r} must be between {low:g} and {high:g}")
        options[option] = value
    return options
