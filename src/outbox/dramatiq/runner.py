"""The relay's runner on Dramatiq (``outbox.relay.runner.Runner``): relay messages enqueued on
the worker's broker, the publish queue's length read there, and the worker process's shutdown flag."""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..core.names import TASK_OUTBOX_ARG, Queues, claim_request_key
from ..relay.waker import clear_token
from . import brokers as _broker

log = logging.getLogger("outbox.dramatiq")


class DramatiqRunner:
    """Dramatiq as the relay's runner: ``broker`` is the worker's, ``key_prefix`` its Redis key
    namespace (``OUTBOX_DRAMATIQ_NAMESPACE``), ``outbox`` this outbox's namespace."""

    def __init__(self, broker: Any, broker_url: str, key_prefix: str, outbox: str) -> None:
        self.broker = broker
        self.broker_url = broker_url
        self.outbox = outbox
        self.queues = Queues(outbox)
        self.claim_key = claim_request_key(broker_url, key_prefix, outbox)
        #: Set when this worker process starts shutting down (``OutboxMiddleware``).
        self.stopping_flag = threading.Event()

    def send(self, task: str, kwargs: dict[str, Any], expires_s: float | None = None) -> None:
        self.broker.enqueue(_broker.message(task, self.queues.for_task(task), {**kwargs, TASK_OUTBOX_ARG: self.outbox},
                                            expires_s))

    def queued_publish_tasks(self) -> int | None:
        try:
            return _broker.queue_length(self.broker, self.queues.publish)
        except Exception as exc:  # noqa: BLE001 - a best-effort reading: None means unknown
            log.debug("outbox: cannot read the publish queue's length: %s", exc)
            return None

    def stopping(self) -> bool:
        return self.stopping_flag.is_set()

    def clear_token(self, token: str) -> None:
        clear_token(token, self.broker_url)


__all__ = ["DramatiqRunner"]
