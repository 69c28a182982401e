"""The writer-side wake through Dramatiq (``outbox.relay.waker.Waker``): a claim message sent on
this process's sending broker (``outbox.dramatiq.brokers``), never Dramatiq's global broker, so a
Django process keeps django-dramatiq's. Dramatiq's workers do not listen on a wake channel."""

from __future__ import annotations

from ..core.config import relay_options, relay_settings
from ..core.names import CLAIM_TASK, TASK_OUTBOX_ARG
from ..relay.waker import Waker
from . import brokers as _broker


class DramatiqWaker(Waker):
    """Waking Dramatiq workers: ``broker_url`` is Dramatiq's, ``key_prefix`` its Redis key namespace
    (``OUTBOX_DRAMATIQ_NAMESPACE``)."""

    def send_claim(self, requested: bool) -> None:
        settings = relay_settings()
        kwargs = self.claim_kwargs(requested)
        _broker.send(CLAIM_TASK, settings.queues.claim, {**kwargs, TASK_OUTBOX_ARG: settings.outbox_namespace},
                     max_age_s=relay_options().claim_request_ttl_s)

    def load(self) -> None:
        _broker.sender()
        _broker.message(CLAIM_TASK, relay_settings().queues.claim, {})


__all__ = ["DramatiqWaker"]
