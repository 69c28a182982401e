"""Which publisher OUTBOX_PUBLISH_URL selects: ``KafkaPublisher`` for ``kafka://``, else
``KombuPublisher`` (docs/destinations.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .contract import Publisher

if TYPE_CHECKING:
    from ..core.config import Settings


def publisher_for(settings: Settings, *, size_warning: bool = True, **options: Any) -> Publisher:
    """The publisher of ``settings.publish_url``; ``options`` as both publishers take them
    (``max_message_bytes``). ``size_warning``: on Kafka, warn once per process when payloads
    ``enqueue`` accepts may be too large for it (False in a child publishing apart, whose
    worker said it already)."""
    if settings.publish_url.split("://", 1)[0] == "kafka":
        from .kafka import KafkaPublisher

        return KafkaPublisher.from_settings(settings, size_warning=size_warning, **options)
    from .kombu_publisher import KombuPublisher

    return KombuPublisher.from_settings(settings, **options)


__all__ = ["publisher_for"]
