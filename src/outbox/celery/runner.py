"""The relay's runner on Celery (``outbox.relay.runner.Runner``): relay tasks sent with
``send_relay_task``, the publish queue's length read on Celery's broker, the claim-request token
named from Celery's broker URL and key prefix."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.config import relay_settings
from ..core.names import CLAIM_TASK, PUBLISH_TASK, claim_request_key
from ..core.redact import redact
from ..relay.waker import clear_token
from .application import app, send_relay_task
from .waker import RETRY_POLICY, claim_queue

log = logging.getLogger("outbox.tasks")

#: Send options per task beyond the queue: a publish task carries leased rows, so its send is retried;
#: a claim request (``Relay.request_claim``, which an in-process claim waits on) is retried once at
#: once, as a writer's wake is: Celery's default waited about 0.6 s on a broker that refused it.
SEND_OPTIONS: dict[str, dict[str, Any]] = {
    PUBLISH_TASK: {"retry": True,
                   "retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}},
    CLAIM_TASK: {"retry": True, "retry_policy": RETRY_POLICY},
}


class CeleryRunner:
    """Celery as the relay's runner; ``stopping`` is the worker's shutdown flag (``outbox.celery.worker``)."""

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self.stopping = stopping
        self.broker_url, self.key_prefix = claim_queue()
        self.claim_key = claim_request_key(self.broker_url, self.key_prefix, relay_settings().outbox_namespace)

    def send(self, task: str, kwargs: dict[str, Any], expires_s: float | None = None) -> None:
        options = dict(SEND_OPTIONS.get(task, {}))
        if expires_s is not None:
            options["expires"] = expires_s
        send_relay_task(task, kwargs, **options)

    def queued_publish_tasks(self) -> int | None:
        queue = relay_settings().queues.publish
        try:
            with app.pool.acquire(block=True, timeout=2.0) as conn:
                channel = conn.default_channel
                size = getattr(channel, "_size", None)
                if callable(size):
                    # kombu's virtual transports (Redis, memory, SQS...): their passive
                    # queue_declare reports a drained Redis list, or any list under a
                    # global_keyprefix, as missing; the size itself is right.
                    return int(size(queue))
                try:
                    return int(channel.queue_declare(queue=queue, passive=True).message_count)
                except Exception as exc:
                    conn.close()  # AMQP closes the channel on NOT_FOUND; start afresh next time
                    if type(exc).__name__ == "NotFound":
                        return 0
                    raise
        except Exception as exc:  # noqa: BLE001 - a best-effort reading: None means unknown
            # Masked here, whoever handles the log (docs/relay.md, "Secrets in output").
            log.debug("outbox: cannot read the publish queue's length: %s", redact(exc))
            return None

    def clear_token(self, token: str) -> None:
        clear_token(token, self.broker_url)


__all__ = ["CeleryRunner", "SEND_OPTIONS"]
