"""An idle relay is quiet at INFO, and still says every few minutes that it is alive.

Celery logs two INFO lines for every task (``Task ... received`` from
``celery.worker.strategy``, ``Task ... succeeded in ...`` from ``celery.app.trace``) and
beat one per entry it sends (``Scheduler: Sending due task ...`` from ``celery.beat``).
The relay's claim tick runs every OUTBOX_CLAIM_INTERVAL_S, so an idle worker and beat
would log about three lines a second with no traffic at all. ``TickFilter`` moves those
lines, for the claim task only, to DEBUG: they are dropped unless the logger is enabled
for DEBUG (``--loglevel=DEBUG`` shows them again). Publish, ack, purge and every warning
or error are untouched, so traffic still shows at INFO.

Celery also warns, at every loss of its broker's connection, that
``worker_cancel_long_running_tasks_on_connection_loss`` will default to True in Celery 6 (a
six-line ``CPendingDeprecationWarning`` through the ``py.warnings`` logger). The relay sets it
to False on purpose (``outbox.celery.application``: a running task finishes its chain), and
Celery warns whatever it is set to, so ``NoticeFilter`` drops that one notice: an outage of
Celery's broker is then Celery's two lines and the relay's one (docs/relay.md, "Outages in the
log").

Instead, the worker's main process logs a heartbeat at INFO every OUTBOX_RELAY_HEARTBEAT_S
(300 s by default), and once at start-up::

    outbox heartbeat: alive; backlog pending=0 claimed=0 failed=0 dead=0; oldest undelivered -;
    312 claim ticks since the last heartbeat

It reads the open rows per status and the oldest one's age at every heartbeat, on the claim's
index, and counts the dead rows once an hour (``DEAD_COUNT_EVERY_S``: on PostgreSQL that reads
the whole table); a failure to read is logged as a warning and the heartbeat goes on. ``celery -A outbox
beat`` logs its own line at the same interval, ``outbox beat heartbeat: alive; N claim
ticks sent since the last heartbeat`` (no database query).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import signals

from ..core.logs import shows
from ..core.names import CLAIM_TASK, TICK_KWARGS

log = logging.getLogger("outbox.heartbeat")

#: The loggers Celery writes its per-task and per-tick INFO lines to.
TICK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.worker.request", "celery.beat")


#: How a tick's keyword arguments read in Celery's "received" line (``kwargsrepr``).
TICK_MARK = repr(TICK_KWARGS)[1:-1]


def _task_name(record: logging.LogRecord) -> str | None:
    args = record.args
    if isinstance(args, dict):  # Task %(name)s[%(id)s] received / succeeded
        return str(args.get("name"))
    if isinstance(args, tuple) and len(args) >= 2:
        if record.msg.startswith("Scheduler: Sending due task"):  # (entry name, task name)
            return str(args[1])
        if record.msg.startswith("Discarding revoked task"):  # (task name, id): an expired tick
            return str(args[0])
    return None


def _is_tick(record: logging.LogRecord) -> bool:
    """A "received" line of a claim tick: its kwargs carry ``TICK_KWARGS``. Claim requests
    (drain mode, takeovers, writers' wakes) are claim tasks too, and counting them hid a
    missing beat while traffic flowed (found in review; docs/operations.md, "Logging")."""
    args = record.args
    return isinstance(args, dict) and TICK_MARK in str(args.get("kwargs") or "")


class TickFilter(logging.Filter):
    """Drops the claim task's per-task INFO lines unless DEBUG is on; counts beat's ticks
    among them (``_is_tick``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0  # beat's, received by this worker
        self.received = 0  # the same, never reset (Heartbeat's check that beat is there)
        self.sent = 0  # sent by this beat
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or _task_name(record) != CLAIM_TASK:
            return True
        if record.name == "celery.beat":
            with self._lock:
                self.sent += 1
        elif record.name == "celery.worker.strategy" and _is_tick(record):
            with self._lock:
                self.ticks += 1
                self.received += 1
        return shows(logging.getLogger(record.name), logging.DEBUG)  # not isEnabledFor: outbox.core.logs

    def take_ticks(self) -> int:
        with self._lock:
            ticks, self.ticks = self.ticks, 0
        return ticks

    def take_sent(self) -> int:
        with self._lock:
            sent, self.sent = self.sent, 0
        return sent


tick_filter = TickFilter()

#: The settings whose notices from Celery the relay has answered by setting them (each
#: notice names its setting; see the module's docstring).
ANSWERED_NOTICES = ("worker_cancel_long_running_tasks_on_connection_loss",)


class NoticeFilter(logging.Filter):
    """Drops Celery's warnings (``py.warnings``) about a setting the relay sets on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "CPendingDeprecationWarning" not in message or not any(n in message for n in ANSWERED_NOTICES)


notice_filter = NoticeFilter()


def install_filters() -> None:
    """Idempotent: a logger keeps one instance of each filter."""
    for name, instance in [*((name, tick_filter) for name in TICK_LOGGERS), ("py.warnings", notice_filter)]:
        logger = logging.getLogger(name)
        if instance not in logger.filters:
            logger.addFilter(instance)


def heartbeat_line(stats: Any, ticks: int | None = None, dead: tuple[int, float] | None = None) -> str:
    """The heartbeat's line; ``dead``: (count, seconds since) of the last count of the dead rows,
    for ``stats`` that left them out (``DEAD_COUNT_EVERY_S``)."""
    counts = stats.counts
    age = "-" if stats.oldest_pending_age_s is None else f"{stats.oldest_pending_age_s:.1f}s"
    if stats.dead is not None:
        dead_part = f"dead={stats.dead}"
    elif dead is not None:
        dead_part = f"dead={dead[0]} (counted {dead[1] / 60:.0f} min ago)"
    else:
        dead_part = "dead=?"
    line = (f"outbox heartbeat: alive; backlog pending={counts.get('pending', 0)} claimed={counts.get('claimed', 0)} "
            f"failed={counts.get('failed', 0)} {dead_part}; oldest undelivered {age}")
    if ticks is not None:
        line += f"; {ticks} claim ticks since the last heartbeat"
    return line


#: A worker that has received no claim tick this many claim intervals (at least
#: ``NO_TICKS_MIN_S``) after it was ready says so, once: beat is not running, or sends to
#: another Celery broker (docs/operations.md).
NO_TICKS_INTERVALS, NO_TICKS_MIN_S = 10, 10.0


#: How often the heartbeat counts the dead rows. The open rows it reads at every beat, on the
#: claim's index; the dead ones only by reading the whole table on PostgreSQL, in every worker
#: (218 ms at 1,000,000 rows, growing with the table: docs/operations.md, "Logging").
DEAD_COUNT_EVERY_S = 3600.0


class Heartbeat:
    """A daemon thread in the worker's main process; ``stop`` ends it at once."""

    def __init__(self, interval_s: float, settings: Any) -> None:
        self.interval_s = interval_s
        self.settings = settings
        self.ticks_due_s = max(NO_TICKS_MIN_S, NO_TICKS_INTERVALS * settings.claim_interval_s)
        self._dead: tuple[int, float] | None = None  # the last count of dead rows, and when (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-heartbeat", daemon=True)
        self._no_ticks = threading.Timer(self.ticks_due_s, self.warn_without_ticks)
        self._no_ticks.daemon = True

    def start(self) -> None:
        self._thread.start()
        self._no_ticks.start()

    def warn_without_ticks(self) -> None:
        # Ticks are counted from Celery's INFO lines: below INFO there is nothing to count.
        if self._stop.is_set() or tick_filter.received or not logging.getLogger(
                "celery.worker.strategy").isEnabledFor(logging.INFO):
            return
        log.warning("outbox: no claim tick has reached this worker in the %.0f s since it started: run "
                    "`celery -A outbox beat` (exactly one per outbox) with this worker's OUTBOX_CELERY_BROKER_URL; "
                    "until then new events wait for a post-commit wake-up (docs/operations.md)", self.ticks_due_s)

    def stop(self) -> None:
        self._stop.set()
        self._no_ticks.cancel()

    def beat_once(self, ticks: int | None) -> None:
        from ..storage.store import OutboxStore

        store = OutboxStore.from_settings(self.settings)
        try:
            count_dead = self._dead is None or time.monotonic() - self._dead[1] >= DEAD_COUNT_EVERY_S
            stats = store.stats(closed=count_dead)
            if stats.dead is not None:
                self._dead = (stats.dead, time.monotonic())
            dead = None if self._dead is None else (self._dead[0], time.monotonic() - self._dead[1])
            log.info(heartbeat_line(stats, ticks, dead))
        except Exception as exc:  # noqa: BLE001 - the heartbeat line goes out whatever the store raises
            # A schema problem says what to do (`outbox migrate`), as the CLI does, not the driver's words.
            log.warning("outbox heartbeat: alive, but cannot read the backlog: %s", store.engine.schema_error_hint(exc)
                        or f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        finally:
            store.close()

    def _run(self) -> None:
        tick_filter.take_ticks()
        self.beat_once(None)
        while not self._stop.wait(self.interval_s):
            self.beat_once(tick_filter.take_ticks())


class BeatHeartbeat:
    """Beat's own heartbeat: alive, and how many claim ticks it sent (no database query)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-beat-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick_filter.take_sent()
        while not self._stop.wait(self.interval_s):
            log.info("outbox beat heartbeat: alive; %d claim ticks sent since the last heartbeat",
                     tick_filter.take_sent())


_beat_heartbeat: BeatHeartbeat | None = None


def _start_beat_heartbeat(**_: Any) -> None:
    global _beat_heartbeat
    if _beat_heartbeat is not None or _sources is None:
        return
    settings = _sources[0]()
    # Beat's only other start-up lines are Celery's banner, which names the broker but not the
    # outbox: a worker whose heartbeat counts "0 claim ticks" is compared with this line.
    if not str(settings.broker_url).startswith("memory://"):  # there beat warns that the worker ticks itself
        log.info("outbox beat: a claim tick every %g s to queue %s (outbox %s, table %s)",
                 settings.claim_interval_s, settings.queues.claim, settings.outbox_namespace, settings.table)
    _beat_heartbeat = BeatHeartbeat(_sources[1]().heartbeat_s)
    _beat_heartbeat.start()


_heartbeat: Heartbeat | None = None
#: (settings getter, relay options getter) given by ``install``.
_sources: tuple[Callable[[], Any], Callable[[], Any]] | None = None


def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    global _heartbeat
    if _heartbeat is not None or _sources is None:
        return
    settings, options = _sources
    _heartbeat = Heartbeat(options().heartbeat_s, settings())
    _heartbeat.start()


def _stop_heartbeat(**_: Any) -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def install(settings: Callable[[], Any], options: Callable[[], Any]) -> None:
    """Called once by ``outbox.celery.worker`` with its getters of the relay's settings and
    options: the filters now (beat and worker), the heartbeat when a worker is ready."""
    global _sources
    _sources = (settings, options)
    install_filters()
    signals.worker_ready.connect(_start_heartbeat, weak=False, dispatch_uid="outbox-heartbeat-start")
    signals.worker_shutdown.connect(_stop_heartbeat, weak=False, dispatch_uid="outbox-heartbeat-stop")
    signals.beat_init.connect(_start_beat_heartbeat, weak=False, dispatch_uid="outbox-beat-heartbeat-start")


__all__ = ["TickFilter", "tick_filter", "NoticeFilter", "notice_filter", "install", "install_filters",
           "heartbeat_line", "Heartbeat", "BeatHeartbeat"]
