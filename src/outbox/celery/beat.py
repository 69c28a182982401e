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
back (docs/relay.md, "Ticks, expiry and clocks"); on Redis sends no claim tick while the
claim queue already holds ``MAX_QUEUED_CLAIMS`` (docs/relay.md, "Running worker and beat");
and keeps the purge to its interval across restarts, schedule file kept or not, from when it
was last sent, recorded on Celery's broker (``relay.sent_record``; docs/relay.md, "Purge").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from celery.beat import PersistentScheduler
from celery.schedules import schedule as interval_schedule
from celery.utils.time import maybe_make_aware
from kombu.exceptions import OperationalError

from ..core.names import CLAIM_TASK, PURGE_TASK, TASK_OUTBOX_ARG, is_redis_url
from ..core.redact import redact
from ..relay import Outage
from ..relay.redis_clients import relay_redis
from ..relay.sent_record import RECORD_KEEP, RabbitSentRecord, RedisSentRecord, SentRecord, closing_channel, first_due
from ..relay.shared import MAX_QUEUED_CLAIMS as SHARED_MAX_QUEUED_CLAIMS
from ..relay.shared import ClaimQueueGuard

#: Celery's beat logger: the relay's lines about sending ticks go where Celery's went
#: (``worker_logging.TickFilter`` counts the claim ticks there).
log = logging.getLogger("celery.beat")

#: An entry last run further ahead of beat's clock than this: the clock stepped back.
CLOCK_STEP_S = 1.0
#: On Redis, no claim tick is sent while the claim queue holds this many (``ClaimQueueGuard``).
MAX_QUEUED_CLAIMS = SHARED_MAX_QUEUED_CLAIMS
#: The URL schemes of RabbitMQ as Celery's broker (kombu's AMQP transports).
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")


def recorded(entry: Any) -> bool:
    """Is ``entry`` one whose last send is recorded on the broker: the relay's purge, on an interval."""
    return bool(entry.task == PURGE_TASK and type(entry.schedule) is interval_schedule)


class Scheduler(PersistentScheduler):
    """``PersistentScheduler`` with an outage log for its sends, mending a clock step (module docstring)."""

    #: Where the purge's last send is recorded (``sent_record``; set up with the schedule).
    record: SentRecord | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outage = Outage("Celery's broker", redact(self.app.conf.broker_url or ""),
                             "Beat sends no claim tick or purge until it answers and tries again at every tick; "
                             "nothing is lost (rows wait in the table)", logging.getLogger("outbox.beat"))
        #: Holds claim ticks back while the claim queue is full (``queue_full``).
        self.guard = ClaimQueueGuard(logging.getLogger("outbox.beat"), "beat",
                                     '`celery -A outbox worker -Q "$(outbox queues)"`')

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self.keep_to_last_sends()

    def sent_record(self, namespace: str) -> SentRecord | None:
        """Where the last sends of ``namespace``'s outbox are recorded on Celery's broker: on
        Redis the keys ``[<global_keyprefix>]outbox:beat:<namespace>:sent:<task>``, on RabbitMQ
        the queue ``outbox.beat.<namespace>.sent``; None on any other broker."""
        url = str(self.app.conf.broker_url or "")
        if is_redis_url(url):
            prefix = str((self.app.conf.broker_transport_options or {}).get("global_keyprefix") or "")
            # Connected as Celery's broker is (TLS: relay.redis_clients; docs/relay.md, TLS).
            client = relay_redis(url, socket_timeout=2.0, socket_connect_timeout=2.0)
            return RedisSentRecord(client, f"{prefix}outbox:beat:{namespace}:sent:")
        if url.startswith(AMQP_SCHEMES):
            return RabbitSentRecord(f"outbox.beat.{namespace}.sent", self._record_channel)
        return None

    @contextmanager
    def _record_channel(self) -> Iterator[Any]:
        with self.app.connection_for_write() as conn, closing_channel(conn) as channel:
            yield channel

    def keep_to_last_sends(self) -> None:
        """The purge is due an interval after it was last sent by any beat (``first_due``), not
        an interval after this beat started: a beat restarted more often than the interval,
        with a fresh schedule file each time, never purged (docs/relay.md, "Purge")."""
        entries = [entry for entry in self.schedule.values() if recorded(entry)]
        namespaces = {str((entry.kwargs or {}).get(TASK_OUTBOX_ARG)) for entry in entries}
        self.record = self.sent_record(namespaces.pop()) if len(namespaces) == 1 else None
        if not entries:
            return
        wall = time.time()
        every = {entry.task: entry.schedule.run_every.total_seconds() for entry in entries}
        due = first_due(self.record, [(entry.task, every[entry.task], maybe_make_aware(entry.last_run_at).timestamp())
                                      for entry in entries], wall)
        for entry in entries:
            now = maybe_make_aware(entry.default_now())
            entry.last_run_at = now - timedelta(seconds=every[entry.task] - due[entry.task])
        self._heap = None  # Celery's order of the entries, rebuilt from these times

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
        if self.record is not None and recorded(entry):
            self.record.record_sent(entry.task, time.time(), RECORD_KEEP * entry.schedule.run_every.total_seconds())
        log.debug("%s sent. id->%s", entry.task, getattr(result, "id", None))


__all__ = ["Scheduler"]
