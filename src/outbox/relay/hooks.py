"""``RelayHooks``: what the relay reports as it works, one method per event, each a no-op here
(in the manner of Dramatiq's middleware hooks). The context carries one (``RelayContext.hooks``);
``claim``, ``publish``, ``policy`` and ``settle`` call it. Prometheus is one implementation
(``relay.metrics.PrometheusHooks``), installed by the runners when metrics are on
(docs/waking-and-metrics.md, "Metrics")."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.model import Claim, OutboxMessage


class RelayHooks:
    """The relay's events. Override the ones you want; a hook must never raise (it runs in the
    middle of a claim or a publish)."""

    def after_claim(self, claim: Claim, seconds: float) -> None:
        """A claim returned ``claim`` (its rows and the rows it found dead) after ``seconds``."""

    def after_send(self, chains: int, seconds: float) -> None:
        """One call of the publisher sent ``chains`` chains (a publish task's, or a claim's
        own share) in ``seconds``, confirmations included: the chains go out together, so
        no chain has a duration of its own."""

    def after_chain(self, published: Sequence[OutboxMessage], seconds: float, failed_kind: str | None) -> None:
        """One chain went through the publisher: its confirmed ``published`` prefix, how long
        the publish task's sending took (all its chains: ``after_send`` has it once), and the
        failure kind of the event that stopped it (None when the whole chain went)."""

    def after_dead(self, count: int = 1) -> None:
        """``count`` rows went dead in a publish (poison, out of attempts, overtaken) or in a
        fallback write of the ack queue."""


__all__ = ["RelayHooks"]
