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


def import_publisher(url: str) -> None:
    """Import the publisher of ``url`` and its client library (kombu's transport for the scheme,
    or confluent-kafka), connecting nothing: a worker's main process before its pool forks
    (docs/internals.md, "Worker processes"). A missing library is left to the first publish."""
    scheme = url.split("://", 1)[0].lower()
    try:
        if scheme == "kafka":
            import confluent_kafka  # noqa: F401

            from . import kafka  # noqa: F401
        else:
            from kombu.transport import resolve_transport

            from . import kombu_publisher  # noqa: F401
            resolve_transport(scheme)
    except (ImportError, KeyError):
        pass


__all__ = ["publisher_for", "import_publisher"]
