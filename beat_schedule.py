"""The relay's schedule: the one place it is defined, and what ``celery -A outbox beat`` uses.

The Celery app (``outbox.celery``) imports this module and installs ``build_schedule``'s
result as its ``beat_schedule``, computed from the OUTBOX_* settings once they are known
(Celery config keys, environment, Django settings: the one order). The module is installed as a top-level module with the
package, so ``import beat_schedule`` works from any directory; a ``beat_schedule.py`` earlier
on ``sys.path`` replaces it, and is refused without ``build_schedule`` (``outbox.schedule``).

Entries:

* ``outbox-claim``: a claim tick every OUTBOX_CLAIM_INTERVAL_S. Each tick expires after one
  interval, but never within 30 s (``message_ttl_s``: workers whose clocks run ahead of
  beat's still claim; docs/relay.md, "Ticks, expiry and clocks"), so when workers are down
  or busy at most the ticks of the last ``max(interval, 30 s)`` are run: a worker drops a
  tick it receives later than that. Expired ticks are still kept until then on Redis (kombu
  drops them only as a worker takes them; RabbitMQ drops them itself), so the relay's beat
  sends no tick while the claim queue holds 100 (``outbox.celery.beat.MAX_QUEUED_CLAIMS``).
  While there is a backlog, claims follow the
  completion of publish tasks at once (drain mode, see ``outbox.celery.tasks.claim``), so the
  interval bounds latency only when the outbox is quiet; the post-commit wake-up
  (``outbox.wake.request_claim``) brings that down too.
* ``outbox-purge``: deletes done rows older than OUTBOX_RETENTION_DAYS, every
  OUTBOX_RELAY_PURGE_INTERVAL_S (an hour by default).

Run exactly one beat per outbox: two beats would send twice the ticks (harmless, since
claims are safe to run concurrently, but wasteful).
"""

from __future__ import annotations

from typing import Any

CLAIM_ENTRY = "outbox-claim"
PURGE_ENTRY = "outbox-purge"


def build_schedule(settings: Any = None, options: Any = None) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` for ``settings`` (``outbox.core.config.Settings``) and relay
    ``options`` (``outbox.core.config.RelayOptions``); both default to the process's, read in
    the one order (docs/design.md, "Settings")."""
    from outbox.core.config import get_settings, message_ttl_s, relay_options
    from outbox.core.names import CLAIM_TASK, PURGE_TASK, TASK_OUTBOX_ARG, TICK_KWARGS

    settings = settings or get_settings()
    options = options or relay_options()
    claim_every = float(settings.claim_interval_s)
    purge_every = float(options.purge_interval_s)
    # Each tick goes to this outbox's queue and names it (docs/relay.md, "Several outboxes on one broker").
    queues, named = settings.queues, {TASK_OUTBOX_ARG: settings.outbox_namespace}
    return {
        CLAIM_ENTRY: {
            "task": CLAIM_TASK,
            "schedule": claim_every,
            "kwargs": {**TICK_KWARGS, **named},  # a tick, told apart from claim requests by the worker
            "options": {"queue": queues.claim, "expires": message_ttl_s(claim_every)},
        },
        PURGE_ENTRY: {
            "task": PURGE_TASK,
            "schedule": purge_every,
            "kwargs": named,
            "options": {"queue": queues.purge, "expires": message_ttl_s(purge_every)},
        },
    }


__all__ = ["build_schedule", "CLAIM_ENTRY", "PURGE_ENTRY"]
