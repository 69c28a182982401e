"""The relay worker's process wiring: its relay (``relay.service.Relay``), the
shutdown flag, and every Celery signal the package connects (docs/internals.md, "Worker processes").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from celery import signals
from celery.utils.time import maybe_iso8601, maybe_make_aware

from ..core.config import relay_options, relay_settings, wake_options, warn_memory_destination
from ..core.errors import ConfigError
from ..core.handoff import HandOff
from ..core.names import CLAIM_TASK, claim_request_key, is_redis_url, wake_channel
from ..core.redact import install_filter, install_filter_everywhere, mask_uncaught, redact
from ..relay import Breaker, Coalescer, Outage, Resources, RouteGate
from ..relay import listen as _listen
from ..relay import metrics as _metrics
from ..relay import waker as _waker
from ..relay.resources import missing_library
from ..relay.service import Relay
from ..relay.state import private_dir
from . import worker_logging as _worker_logging
from .application import app, configured, publish_time_limit
from .runner import CeleryRunner
from .waker import claim_queue

log = logging.getLogger("outbox.tasks")

# -- shutdown ----------------------------------------------------------------------------------

#: Set when this worker starts shutting down: no new claims, no new chains.
STOPPING = threading.Event()
#: In a prefork pool child: the pid of the worker's main process, which is the one that
#: receives the shutdown signal and tells its children through a marker file.
_parent_pid: int | None = None


def in_worker() -> bool:
    """True while a relay worker runs in this process (worker_init .. worker_shutdown): a
    post-commit wake-up in this process then uses ``request_claim`` below (``outbox.relay.waker``)."""
    return _waker.in_process_claim is not None


def _stopping_marker(main_pid: int, create: bool = False) -> Path | None:
    """In this user's own directory (``state.private_dir``, made when ``create``): in the temp
    directory itself, any local user could stop a worker's pool with ``touch``."""
    directory = private_dir(create)
    return None if directory is None else Path(directory) / f"outbox-worker-stopping-{main_pid}"


def stopping() -> bool:
    """True once this worker is shutting down. Celery signals only the main process; pool
    children see the marker file it leaves (one ``stat`` per task)."""
    if STOPPING.is_set():
        return True
    marker = None if _parent_pid is None else _stopping_marker(_parent_pid)
    return marker is not None and marker.exists()


# -- the process's relay (outbox.relay.service.Relay) -------------------------------------------

_relay: Relay | None = None
_relay_lock = threading.Lock()


def relay() -> Relay:
    """This process's relay, built on first use from the settings and options Celery's app reads."""
    global _relay
    with _relay_lock:
        if _relay is None:
            _relay = Relay(relay_settings(), relay_options(), CeleryRunner(stopping), log, _metrics.relay_hooks())
        return _relay


def claim_queue_key() -> tuple[str, str]:
    """Celery's broker URL and the name of this outbox's claim queue's one "claim soon" token
    (the key writers' wake-ups take too: ``outbox.core.names.claim_request_key``)."""
    url, prefix = claim_queue()
    return url, claim_request_key(url, prefix, relay_settings().outbox_namespace)


def resources() -> Resources:
    """This thread's store, publisher and settler."""
    return relay().resources()


def breaker() -> Breaker:
    """One breaker per process (shared beyond it through Redis or a file)."""
    return relay().breaker()


def coalescer() -> Coalescer:
    """The claim queue's one claim-request token, as this process holds it (shared beyond it
    like the breaker, and with the writers that wake the relay)."""
    return relay().shared().coalescer


def route_gate() -> RouteGate:
    """The paused routes (per-route back-pressure), shared beyond the process like the breaker."""
    return relay().shared().routes


def outage(which: str) -> Outage:
    """The outage log of ``which`` ("database" or "destination broker"): one warning when it
    starts, one line when it ends, announced by one process of all the workers."""
    return relay().outage(which)


def close_resources() -> None:
    if _relay is not None:
        _relay.close()


def queued_publish_tasks() -> int | None:
    """Messages waiting in this outbox's publish queue on Celery's broker; None when unknown."""
    return relay().runner.queued_publish_tasks()


def request_claim() -> bool:
    """Ask for a claim soon, coalesced (``Relay.request_claim``). Asked from inside the
    in-process claim, the next claim runs in-process too (docs/waking-and-metrics.md, "The
    in-process claim")."""
    return relay().request_claim()


#: Set in the thread while the in-process claim runs.
_claiming_here = threading.local()


def claiming_in_process() -> bool:
    """True in the thread that runs the in-process claim (the worker's main process): a
    backlog it meets goes to the pool (docs/waking-and-metrics.md, "The in-process claim")."""
    return bool(getattr(_claiming_here, "active", False))


def _claim_in_process() -> None:
    """The claim task's body, run in this process without a trip through Celery's broker
    (docs/waking-and-metrics.md, "The in-process claim")."""
    if stopping():
        return
    _claiming_here.active = True
    try:
        app.tasks[CLAIM_TASK]()  # looked up by name: the task bodies sit above this module
    finally:
        _claiming_here.active = False


#: The worker's main process claims here when a notification reaches it (the LISTEN thread,
#: the Redis wake subscriber): one claim at a time, one more for everything notified while it ran.
claim_runner = HandOff(_claim_in_process, "outbox-claim")


# -- Celery signals: every one the package connects ---------------------------------------------

@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _mask_secrets_in_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Every line the worker and beat log goes through ``outbox.core.redact``."""
    install_filter(logging.getLogger())
    if logger is not None:
        install_filter(logger)


@signals.celeryd_after_setup.connect
@signals.beat_init.connect
def _mask_secrets_in_the_applications_logging(**_: Any) -> None:
    """An application that sets up the worker's or beat's logging itself (Celery's
    ``setup_logging`` signal) gets no ``after_setup_logger``: its handlers, wherever it attached
    them, are given the filter here, after its set-up, and an exception that ends the process
    is printed masked: stderr is then not Celery's logger (docs/relay.md, "Secrets in output")."""
    install_filter_everywhere()
    mask_uncaught()


@signals.worker_process_init.connect
def _process_init(**_: Any) -> None:
    # Stop using what was inherited over fork() (the main process's in-process claim made
    # it), without closing it: it is the parent's. A thread of the parent may have held the
    # lock as it forked, and none releases it here (docs/internals.md, "Worker processes").
    global _parent_pid, _relay_lock
    _relay_lock = threading.Lock()
    if _relay is not None:
        _relay.forget()
    STOPPING.clear()
    _parent_pid = os.getppid()
    relay().start()  # this pool process's liveness record (docs/internals.md, "Lost workers")


@signals.worker_process_shutdown.connect
def _process_shutdown(**_: Any) -> None:
    close_resources()


@signals.worker_shutting_down.connect
def _shutting_down(**_: Any) -> None:
    STOPPING.set()
    marker = _stopping_marker(os.getpid(), create=True)
    try:
        if marker is not None:
            marker.touch()
    except OSError as exc:  # the children then finish what they start, which is safe too
        log.warning("outbox: cannot tell the pool processes to stop (%s)", exc)
    log.info("outbox: worker shutting down, claims stop; publish tasks in hand finish, "
             "tasks not yet started release their rows")
    _listen.stop_listener(wait=False)  # sent from a signal handler: don't block it
    _listen.stop_subscriber(wait=False)


@signals.task_received.connect
def _claim_in_time(request: Any = None, **_: Any) -> None:
    """A claim tick or request reached this worker before its expiry (``Relay.late_claims``)."""
    if getattr(request, "name", None) == CLAIM_TASK:
        relay().late_claims.in_time()


@signals.task_revoked.connect
def _claim_late(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery dropped a claim tick or request that arrived after its ``expires``, before the
    task ran (``Relay.late_claims``: a clock ahead of beat's; docs/relay.md, "Ticks, expiry and clocks")."""
    if not expired or getattr(sender, "name", None) != CLAIM_TASK:
        return
    expires = maybe_iso8601(getattr(request, "expires", None))
    late_s = 0.0 if expires is None else (app.now() - maybe_make_aware(expires)).total_seconds()
    relay().late_claims.dropped(late_s)


def _remove_stopping_marker(tidy: bool = False) -> None:
    """Remove this process's stop marker; ``tidy`` (the worker's end): its directory too when
    nothing else is in it, so that a worker leaves nothing in the temp directory (another
    worker's next write makes it again)."""
    marker = _stopping_marker(os.getpid())
    with contextlib.suppress(OSError):
        if marker is not None:
            marker.unlink(missing_ok=True)
            if tidy:
                marker.parent.rmdir()


#: The worker's prefork pool (billiard's), kept from worker_ready for ``_free_pool_read_lock``:
#: Celery drops its reference to the pool when it has stopped it.
_prefork_pool: Any = None


def _free_pool_read_lock() -> None:
    """After the pool has stopped, free the read lock of its task queue when a pool process
    died holding it (a SIGTERM to the whole process group): billiard's exit hook waits for that
    lock, and the worker never exited (docs/relay.md, "Signal the main process only"). Only
    billiard's own lock: ``outbox.transport.prefork``'s dies with its holder."""
    pool, inqueue = _prefork_pool, getattr(_prefork_pool, "_inqueue", None)
    lock = getattr(inqueue, "_rlock", None)  # None: not the blocking pool (Celery's AsynPool, threads, solo)
    if lock is None or any(process.exitcode is None for process in getattr(pool, "_pool", ())):
        return  # a live pool process may hold it
    from ..transport.prefork import ProcessLock
    if isinstance(lock, ProcessLock):
        return
    if lock.acquire(False):
        lock.release()
        return
    lock.release()  # a semaphore: any process may release it
    log.warning("outbox: a pool process died holding the pool's task queue lock (the stop signal reached the "
                "pool processes too: send it to the main process only, docs/relay.md, \"Signal the main "
                "process only\"); released it so that the worker exits")


#: Celery's pools whose tasks run in greenlets (docs/internals.md, "Worker processes").
GREEN_POOLS = ("gevent", "eventlet")


def refuse_green_pool(pool: Any) -> None:
    """Stop a worker started with a greenlet pool (``-P gevent``/``eventlet``), saying so
    in one line. Each greenlet is a thread to the relay: it would make its own database
    connection and publisher, never closed, one more per task."""
    name = pool if isinstance(pool, str) else f"{getattr(pool, '__module__', '')}".rsplit(".", 1)[-1]
    if name in GREEN_POOLS:
        raise SystemExit(f"outbox: the {name} pool is not supported: every greenlet would hold a database "
                         "connection and a publisher of its own, never closed; run the worker with the "
                         "prefork (default), threads or solo pool")


def import_ahead() -> None:
    """Import, in the worker's main process before its pool starts, what the relay's threads
    there import on first use: a pool process forked later (``--autoscale``,
    ``--max-tasks-per-child``, a child replaced) while one of them was importing would wait for
    that module's import lock for good (docs/internals.md, "Worker processes")."""
    from ..publisher.select import import_publisher
    from ..relay import redis_clients  # noqa: F401  (Redis wake-ups and shared state)
    from ..storage import store  # noqa: F401
    from ..storage.engines import import_engine

    settings = relay_settings()
    import_engine(settings.database_url)
    import_publisher(settings.publish_url)


def warn_short_visibility() -> None:
    """A config module's ``visibility_timeout`` (which wins over the relay's) shorter than a
    publish task may run: the broker would deliver a running task again (docs/relay.md, "Tasks,
    queues, and how to scale and route them")."""
    url = str(app.conf.broker_url or "")
    if not (is_redis_url(url) or url.startswith("outboxdb")):  # RabbitMQ has no visibility timeout
        return
    visibility = (app.conf.broker_transport_options or {}).get("visibility_timeout")
    limit = publish_time_limit(relay_settings())
    if visibility is not None and float(visibility) < limit:
        # The config module's key wins; else, on the database broker, the relay's own setting.
        source = ("broker_transport_options" if "visibility_timeout" in (configured("broker_transport_options") or {})
                  else "OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S")
        log.warning("outbox: Celery's broker delivers a task again once it has gone unacknowledged for its "
                    "visibility_timeout (%g s, %s), which is shorter than a publish task may run (%g s, its time "
                    "limit: the lease): a publish task still running would run twice, its events published twice; "
                    "raise it above %g s or leave it to the relay (docs/relay.md, \"Tasks, queues, and how to scale "
                    "and route them\")", float(visibility), source, limit, limit)


@signals.worker_init.connect
def _init(sender: Any = None, **_: Any) -> None:
    refuse_green_pool(getattr(sender, "pool_cls", None))  # SystemExit: not caught by Celery's signal
    if sender is not None and not sender.use_eventloop:  # billiard's blocking pool (docs/transport.md,
        from ..transport.prefork import robust_prefork  # "A pool process killed by SIGKILL")
        sender.pool_cls = robust_prefork(sender.pool_cls, sender.use_eventloop)
    settings = relay_settings()
    try:
        missing = missing_library(settings)
    except ConfigError as exc:  # Celery's signal logs an Exception and starts the worker anyway
        raise SystemExit(redact(f"outbox: invalid configuration: {exc}")) from None
    if missing:
        raise SystemExit(f"outbox: {missing}")
    import_ahead()
    warn_short_visibility()
    _waker.in_process_claim = lambda: request_claim()  # post-commit wakes here skip the broker
    _remove_stopping_marker()  # one left by an earlier process with this pid
    _metrics.on_worker_init()


def _warn_foreign_queues(settings: Any) -> None:
    """A worker started with ``-Q`` naming none of its outbox's queues relays nothing: the
    classic case is a deployment upgraded from the fixed ``outbox.*`` names (README,
    "Upgrade note"). Said once, at start, as an error."""
    selected = app.amqp.queues.consume_from  # -Q's selection; without -Q every queue of the app
    if not selected or set(selected) & set(settings.queues.all):
        return
    log.error("outbox: this worker consumes %s, none of outbox %s's queues (%s): it relays nothing. Use "
              "`-Q \"$(outbox queues)\"` (or no -Q); after an upgrade from the fixed outbox.* names, "
              "OUTBOX_NAMESPACE=outbox keeps them (README, \"Upgrade note\")", ", ".join(sorted(selected)),
              settings.outbox_namespace, ", ".join(settings.queues.all))


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    """A restarted worker lifts a fatal pause (``Relay.lift_fatal_pause``). Then the optional
    services start: the schedule (in-memory broker), the LISTEN thread, the metrics endpoint."""
    global _prefork_pool
    _prefork_pool = getattr(getattr(sender, "pool", None), "_pool", None)  # the consumer's TaskPool's pool
    relay().lift_fatal_pause()
    settings = relay_settings()
    log.info("outbox: relaying outbox %s (table %s) on queues %s", settings.outbox_namespace, settings.table,
             ", ".join(settings.queues.all))
    _warn_foreign_queues(settings)
    warn_memory_destination(settings, log)
    _start_embedded_beat()
    try:
        in_process = wake_options().in_process_claim
    except ConfigError as exc:  # an invalid option: say so, and wake through claim messages
        log.error("outbox: %s; notifications become claim messages", exc)
        in_process = False
    try:
        _listen.start_listener(relay_settings(), claim_runner.request if in_process else request_claim)
    except Exception as exc:  # noqa: BLE001 - never keep the worker from running: polling still delivers
        log.error("outbox listen: not started (%s: %s); claims rely on beat's ticks", type(exc).__name__, exc)
    try:
        if in_process:
            url, prefix = claim_queue()
            _listen.start_subscriber(url, wake_channel(url, prefix, relay_settings().outbox_namespace),
                                     claim_runner.request)
    except Exception as exc:  # noqa: BLE001 - writers then send claim messages, as when no worker listens
        log.error("outbox: wake-up subscriber not started (%s: %s)", type(exc).__name__, exc)
    _metrics.on_worker_ready(_gauge_store)


def _gauge_store() -> Any:
    """The metrics refresher's own store (``outbox.relay.metrics.GaugeRefresher``)."""
    from ..storage.store import OutboxStore

    return OutboxStore.from_settings(relay_settings())


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    _free_pool_read_lock()  # sent once the pool has stopped
    _waker.in_process_claim = None
    _listen.stop_listener()
    _listen.stop_subscriber()
    claim_runner.stop()
    close_resources()
    _stop_embedded_beat()
    _metrics.stop_serving()  # its directory is in the user's own, which the next line removes when empty
    _remove_stopping_marker(tidy=True)


# Idle workers and beat are quiet at INFO and log a heartbeat instead (outbox.celery.worker_logging,
# which connects its own worker_ready / worker_shutdown / beat_init handlers here).
_worker_logging.install(relay_settings, relay_options)


# -- the in-memory broker: run the schedule inside the worker --------------------------------

_embedded_beat: Any = None


def _in_memory() -> bool:
    return str(app.conf.broker_url or "").startswith("memory://")


def _start_embedded_beat() -> None:
    global _embedded_beat
    if not _in_memory() or _embedded_beat is not None:
        return
    from celery.beat import EmbeddedService

    _embedded_beat = EmbeddedService(app, thread=True, scheduler_cls="celery.beat:Scheduler")
    _embedded_beat.start()
    log.info("outbox: Celery's broker is in memory; this worker runs the schedule itself")


@signals.beat_init.connect
def _warn_beat_in_memory(**_: Any) -> None:
    if _embedded_beat is None and _in_memory():
        log.warning("outbox: Celery's broker is memory://, which a separate beat process cannot share with the "
                    "workers; the worker runs the schedule itself. Set OUTBOX_CELERY_BROKER_URL (Redis) to run beat.")


def _stop_embedded_beat() -> None:
    global _embedded_beat
    if _embedded_beat is not None:
        _embedded_beat.stop()
        _embedded_beat = None


__all__ = ["STOPPING", "stopping", "in_worker", "relay", "resources", "close_resources", "breaker",
           "coalescer", "claim_queue_key", "claim_runner", "claiming_in_process", "route_gate", "outage", "queued_publish_tasks",
           "request_claim"]
