"""The writer-side wake through Dramatiq (``outbox.relay.waker.Waker``): a claim message sent on
this process's sending broker (``outbox.dramatiq.brokers``), never Dramatiq's global broker, so a
Django process keeps django-dramatiq's. Dramatiq's workers do not listen on a wake channel.
On RabbitMQ no claim is sent while the claim queue is full (docs/dramatiq.md, "Post-commit wake")."""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..core.config import relay_options, relay_settings
from ..core.names import CLAIM_TASK, TASK_OUTBOX_ARG
from ..relay.shared import MAX_QUEUED_CLAIMS as SHARED_MAX_QUEUED_CLAIMS
from ..relay.shared import ClaimQueueGuard
from ..relay.waker import Waker
from . import brokers as _broker

#: On RabbitMQ, a writer sends no claim while the claim queue holds this many (``ClaimQueueGuard``).
MAX_QUEUED_CLAIMS = SHARED_MAX_QUEUED_CLAIMS


class DramatiqWaker(Waker):
    """Waking Dramatiq workers: ``broker_url`` is Dramatiq's, ``key_prefix`` its Redis key namespace
    (``OUTBOX_DRAMATIQ_NAMESPACE``)."""

    def __init__(self, broker_url: str, key_prefix: str = "", options: Any = None, namespace: str = "") -> None:
        super().__init__(broker_url, key_prefix, options, namespace)
        #: Holds this writer's claims back while the claim queue is full (RabbitMQ: ``send_claim``).
        self.guard = ClaimQueueGuard(logging.getLogger("outbox.wake"), "this writer",
                                     "`dramatiq outbox.dramatiq`, or with --queues naming it")

    def send_claim(self, requested: bool) -> None:
        """Send one claim message. On RabbitMQ (no claim-request token: ``kind`` "other") none while
        the claim queue holds ``MAX_QUEUED_CLAIMS``: Dramatiq's messages carry no broker-side TTL."""
        settings = relay_settings()
        queue = settings.queues.claim
        if self.kind == "other" and self.guard.full(queue, functools.partial(_broker.queued, queue), MAX_QUEUED_CLAIMS):
            return
        kwargs = self.claim_kwargs(requested)
        _broker.send(CLAIM_TASK, queue, {**kwargs, TASK_OUTBOX_ARG: settings.outbox_namespace},
                     max_age_s=relay_options().claim_request_ttl_s)

    def load(self) -> None:
        _broker.sender()
        _broker.message(CLAIM_TASK, relay_settings().queues.claim, {})


__all__ = ["DramatiqWaker", "MAX_QUEUED_CLAIMS"]
