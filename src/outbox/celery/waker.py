"""The writer-side wake through Celery (``outbox.relay.waker.Waker``): a claim task sent with
``send_relay_task`` on Celery's broker, and, on Redis, a notification on the claim queue's wake
channel that listening workers answer at once."""

from __future__ import annotations

from typing import Any

from ..core.config import relay_options, relay_settings
from ..core.names import CLAIM_TASK, wake_channel
from ..relay.waker import Waker
from .application import app, send_relay_task

#: A wake's claim: one quick retry, then the tick delivers.
RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}


def claim_queue() -> tuple[str, str]:
    """Celery's broker URL and its key prefix (``global_keyprefix``)."""
    url = str(app.conf.broker_url or relay_settings().broker_url)
    return url, str((app.conf.broker_transport_options or {}).get("global_keyprefix") or "")


class CeleryWaker(Waker):
    """Waking Celery workers: ``broker_url`` and ``key_prefix`` are Celery's (``claim_queue``)."""

    def __init__(self, broker_url: str, key_prefix: str = "", options: Any = None, namespace: str = "") -> None:
        super().__init__(broker_url, key_prefix, options, namespace)
        #: Where Celery workers SUBSCRIBE for wake-ups (``outbox.relay.listen``).
        self.channel = wake_channel(broker_url, key_prefix, self.namespace)

    @classmethod
    def from_app(cls, options: Any = None) -> CeleryWaker:
        return cls(*claim_queue(), options)

    def send_claim(self, requested: bool) -> None:
        send_relay_task(CLAIM_TASK, self.claim_kwargs(requested),
                        expires=relay_options().claim_request_ttl_s, retry=True, retry_policy=RETRY_POLICY)

    def load(self) -> None:
        for lazy in ("amqp", "producer_pool", "AsyncResult", "backend", "events"):  # built on first use
            getattr(app, lazy)
        app.amqp.router  # noqa: B018
        app.connection_for_write().transport  # noqa: B018


__all__ = ["CeleryWaker", "claim_queue"]
