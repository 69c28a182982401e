"""The relay worker's process wiring: per-process resources, and every Celery signal.

One module owns what lives as long as a worker process: the store and the publisher
(per process and thread, never inherited over fork), the shared-state objects (breaker,
route gate, outage logs, the claim-request coalescer), the shutdown flag, and the
signal handlers that start and stop the optional services (LISTEN thread, metrics
endpoint, the schedule under the in-memory broker). Task bodies are in ``outbox.tasks``;
the relay's logic in ``outbox.relay``. Why resources are per process and how shutdown
reaches pool children: docs/relay.md, "Worker processes".
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import signals

from .celery_app import app
from .config import relay_options, relay_settings
from .names import ACK_QUEUE, ACK_TASK, CLAIM_QUEUE, CLAIM_TASK, FAIL_TASK, PUBLISH_QUEUE, RELEASE_TASK
from .publisher import Publisher
from .redact import install_filter, redact
from .relay import (Breaker, Coalescer, Outage, RouteGate, Settler, breaker_key, make_breaker, make_coalescer,
                    make_relay_outage, make_route_gate)
from .store import OutboxStore
from . import listen as _listen, metrics as _metrics, worker_logging as _worker_logging

log = logging.getLogger("outbox.tasks")

# -- shutdown ----------------------------------------------------------------------------------

#: Set when this worker starts shutting down: no new claims, no new chains.
STOPPING = threading.Event()
#: In a prefork pool child: the pid of the worker's main process, which is the one that
#: receives the shutdown signal and tells its children through a marker file.
_parent_pid: int | None = None
#: Set while an outbox Celery worker runs in this process (worker_init .. worker_shutdown):
#: a post-commit wake-up in this process then uses ``request_claim`` below.
_in_worker = False


def in_worker() -> bool:
    """True while a relay worker runs in this process."""
    return _in_worker


def _stopping_marker(main_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"outbox-worker-stopping-{main_pid}"


def stopping() -> bool:
    """True once this worker is shutting down. Celery signals only the main process; pool
    children see the marker file it leaves (one ``stat`` per task)."""
    if STOPPING.is_set():
        return True
    return _parent_pid is not None and _stopping_marker(_parent_pid).exists()


# -- per-process, per-thread resources -----------------------------------------------------

@dataclass
class _Resources:
    pid: int
    store: OutboxStore
    publisher: Publisher
    settler: Settler


_local = threading.local()
_made: list[_Resources] = []
_made_lock = threading.Lock()
_breaker: tuple[int, Breaker] | None = None
_coalescer: tuple[int, Coalescer] | None = None
_route_gate: tuple[int, RouteGate] | None = None
_outages: dict[str, tuple[int, Outage]] = {}


def make_publisher(settings: Any) -> Publisher:
    from .publisher import KombuPublisher

    return KombuPublisher.from_settings(settings, max_message_bytes=relay_options().max_message_bytes)


def _shared_key() -> tuple[str, str]:
    """Celery's broker URL (where shared state lives) and the key of this outbox."""
    s = relay_settings()
    return (str(app.conf.broker_url or s.broker_url),
            breaker_key(s.database_url, s.table, s.publish_url, s.exchange))


def breaker() -> Breaker:
    """One breaker per process (shared beyond it through Redis or a file)."""
    global _breaker
    with _made_lock:
        if _breaker is None or _breaker[0] != os.getpid():
            _breaker = (os.getpid(), make_breaker(*_shared_key()))
        return _breaker[1]


def coalescer() -> Coalescer:
    """One claim-request token per process object (shared beyond it like the breaker)."""
    global _coalescer
    with _made_lock:
        if _coalescer is None or _coalescer[0] != os.getpid():
            _coalescer = (os.getpid(), make_coalescer(*_shared_key(), relay_options().claim_request_ttl_s))
        return _coalescer[1]


def route_gate() -> RouteGate:
    """The paused routes (per-route back-pressure), shared beyond the process like the breaker."""
    global _route_gate
    with _made_lock:
        if _route_gate is None or _route_gate[0] != os.getpid():
            _route_gate = (os.getpid(), make_route_gate(*_shared_key()))
        return _route_gate[1]


def outage(which: str) -> Outage:
    """The outage log of ``which`` ("database" or "destination broker"): one warning when it
    starts, one line when it ends, announced by one process of all the workers."""
    with _made_lock:
        made = _outages.get(which)
        if made is None or made[0] != os.getpid():
            s = relay_settings()
            made = (os.getpid(), make_relay_outage(which, s, relay_options(), _shared_key()[0], log))
            _outages[which] = made
        return made[1]


#: The settling task that takes over a store write a publish task could not make.
_FALLBACK_TASKS = {"done": ACK_TASK, "failed": FAIL_TASK, "release": RELEASE_TASK}


def _fallback(operation: str, kwargs: dict[str, Any]) -> None:
    app.send_task(_FALLBACK_TASKS[operation], kwargs=kwargs, queue=ACK_QUEUE)


def resources() -> _Resources:
    r: _Resources | None = getattr(_local, "resources", None)
    if r is None or r.pid != os.getpid():
        settings = relay_settings()
        store = OutboxStore.from_settings(settings)
        r = _Resources(os.getpid(), store, make_publisher(settings), Settler(store, _fallback))
        _local.resources = r
        with _made_lock:
            _made.append(r)
    return r


def close_resources() -> None:
    global _breaker, _coalescer
    with _made_lock:
        mine = [r for r in _made if r.pid == os.getpid()]
        _made.clear()
        _breaker = _coalescer = None
        _outages.clear()
    for r in mine:
        for closable in (r.publisher, r.store):
            try:
                closable.close()
            except Exception:  # closing after a failure may fail again
                log.debug("outbox: error closing %r", closable, exc_info=True)
    _local.__dict__.clear()


# -- Celery's broker, as claims use it ---------------------------------------------------------

def queued_publish_tasks() -> int | None:
    """Messages waiting in the publish queue of Celery's broker; None when unknown."""
    try:
        with app.pool.acquire(block=True, timeout=2.0) as conn:
            channel = conn.default_channel
            size = getattr(channel, "_size", None)
            if callable(size):
                # kombu's virtual transports (Redis, memory, SQS...): their passive
                # queue_declare reports a drained Redis list, or any list under a
                # global_keyprefix, as missing; the size itself is right.
                return int(size(PUBLISH_QUEUE))
            try:
                return int(channel.queue_declare(queue=PUBLISH_QUEUE, passive=True).message_count)
            except Exception as exc:
                conn.close()  # AMQP closes the channel on NOT_FOUND; start afresh next time
                if type(exc).__name__ == "NotFound":
                    return 0
                raise
    except Exception as exc:
        log.debug("outbox: cannot read the publish queue's length: %s", exc)
        return None


def request_claim() -> bool:
    """Ask for a claim soon, coalesced: while one requested claim has not started yet,
    further requests are no-ops. The one "claim soon" of a worker process: drain mode
    (``outbox.tasks``), the LISTEN thread and post-commit wake-ups made in a worker use it."""
    if stopping():
        return False
    gate = coalescer()
    if not gate.acquire():
        return False
    try:
        app.send_task(CLAIM_TASK, kwargs={"requested": True}, queue=CLAIM_QUEUE,
                      expires=relay_options().claim_request_ttl_s)
    except Exception as exc:
        gate.clear()
        log.warning("outbox: cannot request a claim (%s); the next tick will claim", exc)
        return False
    return True


# -- Celery signals: every one the package connects ---------------------------------------------

@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _mask_secrets_in_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Every line the worker and beat log goes through ``outbox.redact``."""
    install_filter(logging.getLogger())
    if logger is not None:
        install_filter(logger)


@signals.worker_process_init.connect
def _process_init(**_: Any) -> None:
    # Forget what was inherited over fork() without closing it: it is the parent's.
    global _breaker, _coalescer, _route_gate, _parent_pid
    with _made_lock:
        _made.clear()
        _breaker = _coalescer = _route_gate = None
        _outages.clear()
    _local.__dict__.clear()
    STOPPING.clear()
    _parent_pid = os.getppid()


@signals.worker_process_shutdown.connect
def _process_shutdown(**_: Any) -> None:
    close_resources()


@signals.worker_shutting_down.connect
def _shutting_down(**_: Any) -> None:
    STOPPING.set()
    try:
        _stopping_marker(os.getpid()).touch()
    except OSError as exc:  # the children then finish what they start, which is safe too
        log.warning("outbox: cannot tell the pool processes to stop (%s)", exc)
    log.info("outbox: worker shutting down, claims stop; publish tasks in hand finish, "
             "tasks not yet started release their rows")
    _listen.stop_listener(wait=False)  # sent from a signal handler: don't block it


def _remove_stopping_marker() -> None:
    try:
        _stopping_marker(os.getpid()).unlink(missing_ok=True)
    except OSError:
        pass


@signals.worker_init.connect
def _init(**_: Any) -> None:
    global _in_worker
    _in_worker = True
    _remove_stopping_marker()  # one left by an earlier process with this pid
    _metrics.on_worker_init()


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    """A restarted worker lifts a fatal pause: the operator has presumably fixed the
    configuration, and if not, the first chain trips it again. Then the optional services
    start: the schedule (in-memory broker), the LISTEN thread, the metrics endpoint."""
    try:
        b = breaker()
        if b.open_for() > 0 and b.reason.startswith("fatal"):
            log.warning("outbox: lifting the fatal pause left by an earlier run (%s)", b.reason)
            b.reset()
    except Exception as exc:  # never keep a worker from starting over this
        log.warning("outbox: cannot check the circuit breaker at start-up: %s", exc)
    _start_embedded_beat()
    try:
        _listen.start_listener(relay_settings(), request_claim)
    except Exception as exc:  # never keep the worker from running: polling still delivers
        log.error("outbox listen: not started (%s: %s); claims rely on beat's ticks", type(exc).__name__, exc)
    _metrics.on_worker_ready()


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    global _in_worker
    _in_worker = False
    _remove_stopping_marker()
    close_resources()
    _stop_embedded_beat()
    _listen.stop_listener()
    _metrics.stop_serving()


# Idle workers and beat are quiet at INFO and log a heartbeat instead (outbox.worker_logging,
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


__all__ = ["STOPPING", "stopping", "in_worker", "resources", "close_resources", "make_publisher", "breaker",
           "coalescer", "route_gate", "outage", "queued_publish_tasks", "request_claim"]
