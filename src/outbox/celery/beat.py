"""``celery -A outbox beat``'s scheduler: Celery's own (``PersistentScheduler``), whose sends
that fail because Celery's broker is unreachable are logged as one outage.

Celery's scheduler logs every send it cannot make as an ERROR with the stack and the
traceback, 170 to 250 lines, and beat tries at every claim tick for as long as the broker is
away. Here the first failed send of an outage logs one WARNING
(``relay.Outage``: what is down, where, what beat does meanwhile), the later ones DEBUG, and
the first send that goes through one INFO line with how long it lasted (docs/relay.md,
"Outages in the log"). Any other failure to send (a task Celery cannot serialize, say) is
Celery's ERROR as before. ``application.celery_config`` makes this the default
``beat_scheduler``; ``celery beat -S <another>`` (django-celery-beat's, say) logs as Celery does.

It also runs again from now an entry whose last run is in the future: beat's clock stepped
back (docs/relay.md, "Ticks, expiry and clocks"); and on Redis sends no claim tick while the
claim queue already holds ``MAX_QUEUED_CLAIMS`` (docs/relay.md, "Running worker and beat").
"""

from __future__ import annotations

import logging
from typing import Any

from celery.beat import PersistentScheduler
from celery.utils.time import maybe_make_aware
from kombu.exceptions import OperationalError

from ..core.names import CLAIM_TASK, is_redis_url
from ..core.redact import redact
from ..relay import Outage
from ..relay.shared import MAX_QUEUED_CLAIMS as SHARED_MAX_QUEUED_CLAIMS
from ..relay.shared import ClaimQueueGuard

#: Celery's beat logger: the relay's lines about sending ticks go where Celery's went
#: (``worker_logging.TickFilter`` counts the claim ticks there).
log = logging.getLogger("celery.beat")

#: An entry last run further ahead of beat's clock than this: the clock stepped back.
CLOCK_STEP_S = 1.0
#: On Redis, no claim tick is sent while the claim queue holds this many (``ClaimQueueGuard``).
MAX_QUEUED_CLAIMS = SHARED_MAX_QUEUED_CLAIMS


class Scheduler(PersistentScheduler):
    """``PersistentScheduler`` with an outage log for its sends, mending a clock step (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outage = Outage("Celery's broker", redact(self.app.conf.broker_url or ""),
                             "Beat sends no claim tick or purge until it answers and tries again at every tick; "
                             "nothing is lost (rows wait in the table)", logging.getLogger("outbox.beat"))
        #: Holds claim ticks back while the claim queue is full (``queue_full``).
        self.guard = ClaimQueueGuard(logging.getLogger("outbox.beat"), "beat",
                                     '`celery -A outbox worker -Q "$(outbox queues)"`')

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self.mend_clock_step()
        return float(super().tick(*args, **kwargs))

    def mend_clock_step(self) -> None:
        """Entries last run in the future run again from now, in one WARNING. Celery waits
        until ``last_run_at`` plus the interval, and keeps ``last_run_at`` in the schedule
        file: a clock stepped back an hour sent no claim tick for an hour, restarts included."""
        ahead: list[tuple[str, float]] = []
        for name, entry in self.schedule.items():
            now = maybe_make_aware(entry.default_now())
            step = (maybe_make_aware(entry.last_run_at) - now).total_seconds()
            if step > CLOCK_STEP_S:
                entry.last_run_at = now
                ahead.append((name, step))
        if ahead:
            self._heap = None  # Celery's order of the entries, rebuilt from the mended times
            logging.getLogger("outbox.beat").warning(
                "outbox: beat's clock stepped back %.0f s (%s last ran that far in the future): they run again from "
                "now, not when the clock catches up", max(step for _, step in ahead), ", ".join(sorted(n for n, _ in ahead)))

    def unreachable(self, exc: BaseException) -> BaseException | None:
        """The error in ``exc``'s chain that says the broker is unreachable (kombu's
        ``OperationalError``, the transport's connection errors), or None. Celery raises its
        ``SchedulingError`` around kombu's, which is raised from the transport's."""
        conn = self.connection
        kinds = (OSError, OperationalError, *conn.connection_errors, *conn.channel_errors)
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, kinds):
                return seen
            seen = seen.__cause__ or seen.__context__
        return None

    def queue_full(self, entry: Any, producer: Any) -> bool:
        """Is ``entry`` a claim tick for a claim queue on Redis that holds ``MAX_QUEUED_CLAIMS``
        already (``guard``: ``relay.shared.ClaimQueueGuard``, the length read on ``producer``'s channel)?"""
        queue = (entry.options or {}).get("queue")
        if entry.task != CLAIM_TASK or not queue or not is_redis_url(str(self.app.conf.broker_url or "")):
            return False
        return self.guard.full(queue, lambda: int(producer.channel._size(queue)), MAX_QUEUED_CLAIMS)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Celery's ``apply_entry``, with a send to an unreachable broker logged by ``outage``,
        and no claim tick for a full claim queue (``queue_full``)."""
        if producer is not None and self.queue_full(entry, producer):
            log.debug("Scheduler: not sending %s: its queue is full", entry.name)
            return
        log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        try:
            result = self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:  # beat goes on whatever one send raises, as Celery's does
            cause = self.unreachable(exc)
            if cause is not None:
                self.outage.failed(cause)
            else:
                log.error("Message Error: %s", exc, exc_info=True)
            return
        self.outage.ok()
        log.debug("%s sent. id->%s", entry.task, getattr(result, "id", None))


__all__ = ["Scheduler"]
