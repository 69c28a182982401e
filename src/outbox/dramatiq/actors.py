"""The relay's actors on Dramatiq, what ``dramatiq outbox.dramatiq`` runs: actors calling the process's
relay (``outbox.relay.service.Relay``) as ``outbox.celery.tasks`` does for Celery, and their middleware
(docs/dramatiq.md: actors, middleware).

Importing it installs Dramatiq's global broker: only relay worker processes load it (``outbox.dramatiq``)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.middleware import Middleware

from ..core.config import RelayOptions, Settings, metrics_options, startup_options, warn_memory_destination
from ..core.errors import ConfigError
from ..core.names import (
    ACK_TASK,
    CLAIM_TASK,
    FAIL_TASK,
    PUBLISH_TASK,
    PURGE_TASK,
    RELEASE_TASK,
    TASK_OUTBOX_ARG,
    Queues,
)
from ..core.redact import install_filter, redact
from ..relay import metrics as _metrics
from ..relay.resources import Resources, Shared, missing_library
from ..relay.service import Relay
from ..relay.settle import SettleFailed
from ..relay.shared import Outage
from ..storage.store import OutboxStore
from . import brokers as _broker
from . import consumer_log
from .runner import DramatiqRunner

log = logging.getLogger("outbox.dramatiq")

# -- configuration, read once at import -------------------------------------------------------

def _load() -> tuple[Settings, RelayOptions, str, str]:
    settings, options = startup_options()
    missing = missing_library(settings)  # as the Celery worker checks it (its worker_init)
    if missing:
        raise ConfigError(missing)
    dramatiq_settings = _broker.settings(required=True)
    assert dramatiq_settings is not None
    return settings, options, dramatiq_settings.url, dramatiq_settings.namespace


def _refuse_another_workers_broker() -> None:
    """In a ``dramatiq`` command, only a worker whose broker argument (its first) is the relay's
    runs the relay's actors: named after another broker (``dramatiq myapp outbox.dramatiq``, or
    imported by a module of such a worker), they were declared on a broker that worker does not
    consume, relayed nothing without a word, and took Dramatiq's global broker from the user's
    modules (found in review). One line and a non-zero exit instead (docs/dramatiq.md, "Set-up")."""
    command = sys.argv[0] or ""
    if "dramatiq.cli" not in sys.modules or not (os.path.basename(command).startswith("dramatiq")
                                                 or command.endswith("/dramatiq/__main__.py")):  # python -m dramatiq
        return
    from dramatiq.cli import make_argument_parser

    args, _ = make_argument_parser().parse_known_args(sys.argv[1:])
    if args.broker.partition(":")[0] not in ("outbox.dramatiq", __name__):
        raise SystemExit(f"outbox: the relay's actors run in a worker of their own broker, `dramatiq outbox.dramatiq "
                         f"...` (the first argument); this worker's broker is {args.broker}, which would relay "
                         f"nothing. Run the relay as its own dramatiq command (docs/dramatiq.md, \"Set-up\")")


_refuse_another_workers_broker()

try:
    SETTINGS, OPTIONS, BROKER_URL, NAMESPACE = _load()
except ConfigError as exc:
    if os.path.basename(sys.argv[0] or "").startswith("dramatiq"):
        # `dramatiq outbox.dramatiq`: one clear line and a non-zero exit, no traceback.
        raise SystemExit(redact(f"outbox: invalid configuration: {exc}")) from None
    raise

#: This outbox's namespace and queues on Dramatiq's broker (docs/dramatiq.md; not to be confused
#: with NAMESPACE, the Redis key prefix of Dramatiq's RedisBroker).
OUTBOX_NAMESPACE = SETTINGS.outbox_namespace
QUEUES = SETTINGS.queues
LEASE_S = SETTINGS.claim_timeout_ms / 1000.0
#: A claim or publish message running past its lease is interrupted (Dramatiq's
#: TimeLimit): its rows come back with the lease anyway.
TIME_LIMIT_MS = int(max(10.0, LEASE_S) * 1000)


# -- the broker and the process's relay (outbox.relay.service.Relay) -----------------------------

broker = _broker.make_broker(BROKER_URL, NAMESPACE)  # Dramatiq's default middleware, plus ours (below)
runner = DramatiqRunner(broker, BROKER_URL, NAMESPACE, OUTBOX_NAMESPACE)
relay = Relay(SETTINGS, OPTIONS, runner, log, _metrics.relay_hooks())  # PrometheusHooks when metrics are on
#: Set when this worker process starts shutting down: no new claims, no new chains.
STOPPING = runner.stopping_flag


def stopping() -> bool:
    return relay.stopping()


def shared() -> Shared:
    """The process's breaker, claim coalescer, route gate and outage logs, shared with the
    other workers through Dramatiq's Redis (or a file when the broker is RabbitMQ)."""
    return relay.shared()


def resources() -> Resources:
    return relay.resources()


def close_resources() -> None:
    relay.close()


def queued_publish_tasks() -> int | None:
    """Messages waiting in this outbox's publish queue on Dramatiq's broker; None when unknown."""
    return relay.runner.queued_publish_tasks()


def request_claim() -> bool:
    """Ask for a claim soon, coalesced (``Relay.request_claim``)."""
    return relay.request_claim()


# -- middleware -----------------------------------------------------------------------------

#: A SIGTERM (or SIGHUP) a worker process receives this soon after its first is the same stop,
#: not Dramatiq's "kill now" (``one_stop_per_sigterm_burst``).
REPEATED_SIGTERM_S = 2.0

#: Dramatiq's stops of a worker process: a SIGTERM, or a SIGHUP (its reload), one handler for both.
STOP_SIGNALS = (signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


def one_stop_per_sigterm_burst(window_s: float = REPEATED_SIGTERM_S) -> None:
    """In a Dramatiq worker process (its main thread, after Dramatiq set its handlers): a SIGTERM
    or SIGHUP within ``window_s`` of the first is ignored. Dramatiq takes a worker process's second
    one for "kill now" (``Killing worker process...``: the messages in hand abandoned, their rows
    left to the takeover with an attempt counted), and its main process sends each worker process
    one of its own: a stop or reload signalled to every process of the worker (systemd's default
    ``KillMode=control-group``, ``kill -- -PGID``, supervisord's ``stopasgroup``, a terminal that
    hangs up) reached each worker process twice within milliseconds, and every such stop was a
    kill (found in review). A second signal sent later still kills (docs/dramatiq.md, "Middleware")."""
    if threading.current_thread() is not threading.main_thread():
        return
    first: list[float] = []

    def once_per_burst(dramatiqs: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
        def on_stop(signum: int, frame: Any) -> None:
            now = time.monotonic()
            if first and now - first[0] < window_s:
                return  # the same stop, sent to this process and again by Dramatiq's main process
            first[:] = [now]
            dramatiqs(signum, frame)
        return on_stop

    for stop in STOP_SIGNALS:
        dramatiqs = signal.getsignal(stop)
        if callable(dramatiqs):
            signal.signal(stop, once_per_burst(dramatiqs))


def warn_foreign_queues(selected: set[str] | None) -> None:
    """A worker whose ``--queues`` (``selected``; None without it) name none of its outbox's queues
    relays nothing, as the Celery worker's ``-Q`` (``outbox.celery.worker._warn_foreign_queues``):
    said at start, as an error. It said nothing until review found it (``--queues outbox.publish``,
    the names before namespaces)."""
    if not selected or set(selected) & set(QUEUES.all):
        return
    log.error("outbox: this worker consumes %s, none of outbox %s's queues (%s): it relays nothing. Use "
              "`--queues $(outbox queues | tr , ' ')` (or no --queues); after an upgrade from the fixed "
              "outbox.* names, OUTBOX_NAMESPACE=outbox keeps them (README, \"Upgrade note\")",
              ", ".join(sorted(selected)), OUTBOX_NAMESPACE, ", ".join(QUEUES.all))


class OutboxMiddleware(Middleware):
    """Start-up and shutdown of the relay in a Dramatiq worker process."""

    consumers: consumer_log.ConsumerOutageFilter | None = None

    def after_process_boot(self, broker: Any) -> None:
        install_filter(logging.getLogger())  # no password in any log line
        one_stop_per_sigterm_burst()  # a stop sent to every process of the worker is warm
        # The consumers' reconnects, told once (docs/dramatiq.md, "When Dramatiq's broker is away").
        self.consumers = consumer_log.install(Outage(
            "Dramatiq's broker", redact(BROKER_URL), "Its consumers reconnect every 3 s; claims that cannot send "
            "their publish messages release the rows, no attempt spent", log))
        STOPPING.clear()
        relay.start()  # this process's liveness record (docs/internals.md, "Lost workers")

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        relay.lift_fatal_pause()
        warn_memory_destination(SETTINGS, log)
        warn_foreign_queues(worker.consumer_whitelist)

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        STOPPING.set()
        log.info("outbox: worker shutting down, claims stop; publish messages in hand finish, "
                 "messages not yet started release their rows or go back to the queue")

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        close_resources()

    # One line as each publish message starts and ends, like Celery's "Task ... received"
    # and "succeeded" lines: what is in hand when a worker stops or dies.
    def after_ack(self, broker: Any, message: Any) -> None:
        if self.consumers is not None:
            self.consumers.back()  # the broker took an ack: it answers again

    def before_process_message(self, broker: Any, message: Any) -> None:
        if message.actor_name == PUBLISH_TASK:
            log.info("outbox: %s[%s] started", message.actor_name, message.message_id)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        if message.actor_name == PUBLISH_TASK:
            log.info("outbox: %s[%s] %s", message.actor_name, message.message_id,
                     "failed" if exception is not None else "succeeded")


class MetricsMiddleware(Middleware):
    """The relay's metrics (``outbox.relay.metrics``): on when OUTBOX_RELAY_METRICS_PORT is set.
    Each worker process records its own; the process that binds the port serves them
    (the sum over all processes when PROMETHEUS_MULTIPROC_DIR is set, see docs/dramatiq.md)."""

    def after_process_boot(self, broker: Any) -> None:
        try:
            options = metrics_options()
            port, addr = options.port, options.addr
            if port is None:
                return
            _metrics.prepare_multiprocess(parent=os.getppid())  # the worker's processes share one directory
            _metrics.reset()
            if _metrics.active() is None:
                return
            try:
                _metrics.serve(port, addr)
            except OSError as exc:  # another process of this worker serves them, or another worker
                if _metrics.sibling_serves():
                    log.info("outbox metrics: port %d is taken (%s); another process serves", port, exc)
                else:
                    log.error("outbox metrics: cannot serve (%s: %s); this worker's counts are in no scrape: give "
                              "each worker of a host its own OUTBOX_RELAY_METRICS_PORT", type(exc).__name__, exc)
                return
            log.info("outbox metrics: serving http://%s:%d/metrics%s", addr, port,
                     " (multiprocess)" if _metrics.multiprocess_mode() else "")
            _metrics.start_refresher(lambda: OutboxStore.from_settings(SETTINGS))  # the gauges' own schedule
        except Exception as exc:  # noqa: BLE001 - metrics must never stop the relay
            log.error("outbox metrics: off (%s: %s)", type(exc).__name__, exc)
            _metrics.disable()

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        _metrics.stop_serving()


# -- the actors --------------------------------------------------------------------------------

broker.add_middleware(OutboxMiddleware())
broker.add_middleware(MetricsMiddleware())
dramatiq.set_broker(broker)

_SETTLE: dict[str, Any] = {"max_retries": 10, "min_backoff": 500, "max_backoff": 30_000}


def _only_ours(task: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """An actor that runs only messages naming this outbox (``TASK_OUTBOX_ARG``); one naming another
    is sent on to that outbox's queue, not run (docs/relay.md, "Several outboxes on one broker").
    Sent through the process's sending broker, not the worker's: a queue the worker's broker
    declares gets a consumer of this worker (docs/dramatiq.md, "Differences and limits")."""
    def wrap(body: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(body)
        def run(*args: Any, **kwargs: Any) -> None:
            named = kwargs.pop(TASK_OUTBOX_ARG, None)
            if relay.foreign.belongs(named, OUTBOX_NAMESPACE):
                return body(*args, **kwargs)
            relay.foreign.refuse(task, named, OUTBOX_NAMESPACE, lambda other: _broker.sender().enqueue(
                _broker.message(task, Queues(other).for_task(task), {**kwargs, TASK_OUTBOX_ARG: other}, args=args)))
            return None
        return run
    return wrap


@dramatiq.actor(actor_name=CLAIM_TASK, queue_name=QUEUES.claim, broker=broker, max_retries=0,
                time_limit=TIME_LIMIT_MS)
@_only_ours(CLAIM_TASK)
def claim(requested: bool = False, token: str | None = None, expires_at: float | None = None) -> None:
    """Claim a batch and send its chains on as publish messages (``Relay.claim``, as on Celery).
    Returns None: nobody reads a relay actor's result (the outcome is in the table)."""
    late_s = _broker.late_s(expires_at)
    relay.claim(requested, token, expired=late_s > 0, late_s=late_s)


@dramatiq.actor(actor_name=PUBLISH_TASK, queue_name=QUEUES.publish, broker=broker, max_retries=0,
                time_limit=TIME_LIMIT_MS)
@_only_ours(PUBLISH_TASK)
def publish(chains: list[list[dict[str, Any]]], deadline: float | None = None) -> None:
    # Every delivery checks that the lease still holds the rows, this process's own included:
    # Dramatiq's Redis broker cannot tell a redelivered message from a first one, and a message
    # delivered again after its first run released or settled the rows must not publish rows
    # another claim may hold now (docs/relay.md, "Graceful shutdown"). A row tried twice is
    # published by a child process of its own: this process's other threads hold rows too
    # (docs/relay.md, "An event that kills its worker").
    relay.publish(chains, deadline, check_own=True, suspects_apart=True)


def _settle(operation: str, **kwargs: Any) -> None:
    """``relay.settle``; a database outage (``SettleFailed``: already told by the outage's
    log) asks Dramatiq for the retry with ``dramatiq.Retry``, which it does not log as an
    error. Before, each try through an outage was an ERROR with a 70-line traceback, three
    per ack in a 5 s database cut (found by ``bench.soak --faults --runner dramatiq``)."""
    try:
        relay.settle(operation, **kwargs)
    except SettleFailed as exc:
        raise dramatiq.Retry(str(exc)) from exc


@dramatiq.actor(actor_name=ACK_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(ACK_TASK)
def ack(ids: list[int], lease: str) -> None:
    _settle("done", ids=ids, lease=lease)


# The dead-letter headers come inside ``message`` (relay.settle.DEAD_HEADERS_KEY), which every
# release's fail task takes; ``dead_headers`` is still taken from builds that sent it as a keyword.
@dramatiq.actor(actor_name=FAIL_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(FAIL_TASK)
def fail(message: dict[str, Any], error: str, retry_in_s: float | None = None, dead: bool = False,
         dead_headers: dict[str, Any] | None = None) -> None:
    _settle("failed", message=message, error=error, retry_in_s=retry_in_s, dead=dead, dead_headers=dead_headers)


@dramatiq.actor(actor_name=RELEASE_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(RELEASE_TASK)
def release(ids: list[int], lease: str, delay_s: float | None = None) -> None:
    _settle("release", ids=ids, lease=lease, delay_s=delay_s)


@dramatiq.actor(actor_name=PURGE_TASK, queue_name=QUEUES.purge, broker=broker, max_retries=0)
@_only_ours(PURGE_TASK)
def purge(expires_at: float | None = None) -> None:
    if not _broker.expired(expires_at):
        relay.purge()


__all__ = ["OUTBOX_NAMESPACE", "QUEUES", "relay",
           "broker", "claim", "publish", "ack", "fail", "release", "purge", "request_claim", "resources",
           "close_resources", "shared", "stopping", "STOPPING", "OutboxMiddleware", "MetricsMiddleware",
           "queued_publish_tasks"]
