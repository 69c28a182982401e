"""What the relay needs from its task runner, written once: ``Runner``. Celery's
(``outbox.celery.runner``) and Dramatiq's (``outbox.dramatiq.runner``) implement it; the
relay (``outbox.relay.service.Relay``) knows no runner beyond it. The writer side of a runner,
how a committing process asks for a claim, is ``outbox.relay.waker.Waker``."""

from __future__ import annotations

from typing import Any, Protocol


class Runner(Protocol):
    """A task runner as the relay sees it: it sends the relay's tasks, reads its publish queue's
    length and says when its worker is stopping."""

    #: The runner's broker URL: where the state the relay's processes share lives (``relay.state``).
    broker_url: str
    #: The key of the claim queue's one claim-request token (``outbox.core.names.claim_request_key``).
    claim_key: str

    def send(self, task: str, kwargs: dict[str, Any], expires_s: float | None = None) -> None:
        """Send the relay task ``task`` (``outbox.core.names``) to this outbox's queue for it,
        naming the outbox; ``expires_s``: dropped when it has waited longer. Raises when the
        runner's broker refuses it."""

    def queued_publish_tasks(self) -> int | None:
        """Messages waiting in this outbox's publish queue; None when unknown."""

    def stopping(self) -> bool:
        """True once this worker is shutting down: no new claims, no new chains."""

    def clear_token(self, token: str) -> None:
        """Delete a claim-request token named in a claim message (``outbox.relay.waker.clear_token``)."""


__all__ = ["Runner"]
