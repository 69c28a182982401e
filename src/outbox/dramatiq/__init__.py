"""The relay on Dramatiq: ``dramatiq outbox.dramatiq``, actors wrapping ``outbox.relay`` as
``outbox.celery.tasks`` does for Celery, and their middleware (docs/dramatiq.md: actors, middleware).

Importing it installs Dramatiq's global broker: import it in relay worker processes only."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any, Callable

import dramatiq
from dramatiq.middleware import Middleware

from .. import dramatiq_broker as _broker
from ..relay import metrics as _metrics
from ..core.config import Settings, load_settings, metrics_options
from ..core.errors import ConfigError
from ..core.redact import install_filter, redact
from ..relay import (ACK_TASK, CLAIM_TASK, FAIL_TASK, PUBLISH_TASK, PURGE_TASK, RELEASE_TASK, Backlog,
                    ForeignTasks, Queues, RelayOptions, ResourceHolder, Resources, after_publish, apply_fallback,
                    drain_slice, handle_publish, message_from_dict, message_to_dict, purge_expired, still_held)
from ..core.names import TASK_OUTBOX_ARG, claim_request_key
from ..relay.resources import Shared
from ..storage.store import OutboxStore
from ..wake import clear_token  # the writer-side API sits below this entry point

log = logging.getLogger("outbox.dramatiq")

#: Set when this worker process starts shutting down: no new claims, no new chains.
STOPPING = threading.Event()


def stopping() -> bool:
    return STOPPING.is_set()


# -- configuration, read once at import -------------------------------------------------------

def _load() -> tuple[Settings, RelayOptions, str, str]:
    settings = load_settings()
    options = RelayOptions.from_sources(os.environ)
    dramatiq_settings = _broker.settings(required=True)
    assert dramatiq_settings is not None
    return settings, options, dramatiq_settings.broker_url, dramatiq_settings.namespace


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


# -- per-process, per-thread resources (relay.ResourceHolder) ----------------------------------

# (``_fallback`` sends through the actors declared below.)
_held = ResourceHolder(lambda: (SETTINGS, OPTIONS, BROKER_URL, claim_request_key(BROKER_URL, NAMESPACE,
                                                                                  OUTBOX_NAMESPACE)),
                       lambda op, kwargs: _fallback(op, kwargs), log, on_takeover=lambda: request_claim())
#: Did this process's last claim meet a backlog (``relay.Backlog``)?
_backlog = Backlog()


def shared() -> Shared:
    """The process's breaker, claim coalescer, route gate and outage logs, shared with the
    other workers through Dramatiq's Redis (or a file when the broker is RabbitMQ)."""
    return _held.shared()


def resources() -> Resources:
    return _held.resources()


def close_resources() -> None:
    _held.close()


# -- middleware -----------------------------------------------------------------------------

class OutboxMiddleware(Middleware):
    """Start-up and shutdown of the relay in a Dramatiq worker process."""

    def after_process_boot(self, broker: Any) -> None:
        install_filter(logging.getLogger())  # no password in any log line
        STOPPING.clear()
        _held.start()  # this process's liveness record (docs/relay.md, "Lost workers")

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        """A restarted worker lifts a fatal pause: the operator has presumably fixed the
        configuration, and if not, the first chain trips it again."""
        try:
            b = shared().breaker
            if b.open_for() > 0 and b.reason.startswith("fatal"):
                log.warning("outbox: lifting the fatal pause left by an earlier run (%s)", b.reason)
                b.reset()
        except Exception as exc:  # never keep a worker from starting over this
            log.warning("outbox: cannot check the circuit breaker at start-up: %s", exc)

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        STOPPING.set()
        log.info("outbox: worker shutting down, claims stop; publish messages in hand finish, "
                 "messages not yet started release their rows or go back to the queue")

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        close_resources()

    # One line as each publish message starts and ends, like Celery's "Task ... received"
    # and "succeeded" lines: what is in hand when a worker stops or dies.
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
            _metrics.reset()
            if _metrics.active() is None:
                return
            try:
                _metrics.serve(port, addr)
            except OSError as exc:  # another worker process of this host serves them
                log.info("outbox metrics: port %d is taken (%s); another process serves", port, exc)
                return
            log.info("outbox metrics: serving http://%s:%d/metrics%s", addr, port,
                     " (multiprocess)" if _metrics.multiprocess_mode() else "")
            _metrics.start_refresher(lambda: OutboxStore.from_settings(SETTINGS))  # the gauges' own schedule
        except Exception as exc:  # metrics must never stop the relay
            log.error("outbox metrics: off (%s: %s)", type(exc).__name__, exc)
            _metrics.disable()

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        _metrics.stop_serving()


# -- the broker and the actors --------------------------------------------------------------

broker = _broker.make_broker(BROKER_URL, NAMESPACE)  # Dramatiq's default middleware, plus ours:
broker.add_middleware(OutboxMiddleware())
broker.add_middleware(MetricsMiddleware())
dramatiq.set_broker(broker)

_SETTLE = dict(max_retries=10, min_backoff=500, max_backoff=30_000)


def _fallback(operation: str, kwargs: dict[str, Any]) -> None:
    {"done": ack, "failed": fail, "release": release}[operation].send(**kwargs, **{TASK_OUTBOX_ARG: OUTBOX_NAMESPACE})


def _dispatch(chains: list[list[Any]], deadline: float) -> None:
    publish.send(chains=[[message_to_dict(m) for m in chain] for chain in chains], deadline=deadline,
                 **{TASK_OUTBOX_ARG: OUTBOX_NAMESPACE})


#: Messages naming another outbox that reached this process (``relay.ForeignTasks``).
_foreign = ForeignTasks(log)


def _only_ours(task: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """An actor that runs only messages naming this outbox (``TASK_OUTBOX_ARG``); one naming another
    is sent on to that outbox's queue, not run (docs/relay.md, "Several outboxes on one broker")."""
    def wrap(body: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(body)
        def run(*args: Any, **kwargs: Any) -> None:
            named = kwargs.pop(TASK_OUTBOX_ARG, None)
            if _foreign.belongs(named, OUTBOX_NAMESPACE):
                return body(*args, **kwargs)
            _foreign.refuse(task, named, OUTBOX_NAMESPACE, lambda other: broker.enqueue(_broker.message(
                task, Queues(other).for_task(task), {**kwargs, TASK_OUTBOX_ARG: other}, args=args)))
            return None
        return run
    return wrap


def queued_publish_tasks() -> int | None:
    """Messages waiting in this outbox's publish queue on Dramatiq's broker; None when unknown."""
    try:
        return _broker.queue_length(broker, QUEUES.publish)
    except Exception as exc:
        log.debug("outbox: cannot read the publish queue's length: %s", exc)
        return None


def request_claim() -> bool:
    """Ask for a claim soon, coalesced (drain mode; see ``outbox.celery.tasks.request_claim``)."""
    if stopping():
        return False
    gate = shared().coalescer
    if not gate.acquire():
        return False
    try:
        broker.enqueue(_broker.message(CLAIM_TASK, QUEUES.claim, {"requested": True, TASK_OUTBOX_ARG: OUTBOX_NAMESPACE},
                                       OPTIONS.claim_request_ttl_s))
    except Exception as exc:
        gate.clear()
        log.warning("outbox: cannot request a claim (%s); the next tick will claim", exc)
        return False
    return True


@dramatiq.actor(actor_name=CLAIM_TASK, queue_name=QUEUES.claim, broker=broker, max_retries=0,
                time_limit=TIME_LIMIT_MS)
@_only_ours(CLAIM_TASK)
def claim(requested: bool = False, token: str | None = None, expires_at: float | None = None) -> None:
    """Claim a batch and send its chains on as publish messages, publishing a small batch or
    a backlog's first share here, in drain slices (drain mode as in ``outbox.celery.tasks.claim``: a
    full claim and every finished publish request the next). Returns None: nobody reads a
    relay actor's result (the outcome is in the table)."""
    if requested:
        shared().coalescer.clear()
    if token:  # a post-commit wake-up (outbox.wake): the next commit may ask again
        clear_token(token, BROKER_URL)
    if _broker.expired(expires_at):
        log.debug("outbox: dropped a claim that arrived after it expired")
        return
    if stopping():
        return
    r, s = resources(), shared()
    # Drain slices, as on Celery (docs/relay.md, "Drain slices"): written once in relay.drain.
    drain_slice(r.store, _dispatch, batch_size=SETTINGS.batch_size, lease_s=LEASE_S, options=OPTIONS,
                breaker=s.breaker, queued=queued_publish_tasks, backlog=_backlog, settler=r.settler,
                publisher=r.publisher, sizer=r.sizer, publish_here=_publish_here, request_claim=request_claim,
                stopping=stopping, outage=s.outage("database"))


def _publish_here(chains: list[list[Any]], deadline: float | None) -> list[Any]:
    """Publish chains in this process: the publish message's work, and a claim's own share."""
    r, s = resources(), shared()
    return handle_publish(r.store, r.publisher, chains, deadline=deadline, options=OPTIONS, breaker=s.breaker,
                          settler=r.settler, stopping=stopping, routes=s.routes, outage=s.outage("destination broker"))


@dramatiq.actor(actor_name=PUBLISH_TASK, queue_name=QUEUES.publish, broker=broker, max_retries=0,
                time_limit=TIME_LIMIT_MS)
@_only_ours(PUBLISH_TASK)
def publish(chains: list[list[dict[str, Any]]], deadline: float | None = None) -> None:
    # Every delivery checks that the lease still holds the rows (``still_held``, one query,
    # which adopts rows another process claimed: docs/relay.md, "Lost workers"): Dramatiq's
    # Redis broker cannot tell a redelivered message from a first one, and a message
    # delivered again after its first run released or settled the rows must not publish
    # rows another claim may hold now (docs/relay.md, "Graceful shutdown").
    messages = [[message_from_dict(d) for d in chain] for chain in chains]
    _publish_here(still_held(resources().store, messages, deadline=deadline), deadline)
    after_publish(shared().breaker, request_claim)


@dramatiq.actor(actor_name=ACK_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(ACK_TASK)
def ack(ids: list[int], lease: str) -> None:
    apply_fallback(resources().store, None, "done", {"ids": ids, "lease": lease}).applied


@dramatiq.actor(actor_name=FAIL_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(FAIL_TASK)
def fail(message: dict[str, Any], error: str, retry_in_s: float | None = None, dead: bool = False) -> None:
    r = resources()
    apply_fallback(r.store, r.publisher, "failed",
                   {"message": message, "error": error, "retry_in_s": retry_in_s, "dead": dead})


@dramatiq.actor(actor_name=RELEASE_TASK, queue_name=QUEUES.ack, broker=broker, **_SETTLE)
@_only_ours(RELEASE_TASK)
def release(ids: list[int], lease: str, delay_s: float | None = None) -> None:
    apply_fallback(resources().store, None, "release", {"ids": ids, "lease": lease, "delay_s": delay_s})


@dramatiq.actor(actor_name=PURGE_TASK, queue_name=QUEUES.purge, broker=broker, max_retries=0)
@_only_ours(PURGE_TASK)
def purge(expires_at: float | None = None) -> None:
    if not _broker.expired(expires_at):
        purge_expired(resources().store, SETTINGS.retention_days, shared().outage("database"), log)


__all__ = ["OUTBOX_NAMESPACE", "QUEUES",
           "broker", "claim", "publish", "ack", "fail", "release", "purge", "request_claim", "resources",
           "close_resources", "shared", "stopping", "STOPPING", "OutboxMiddleware", "MetricsMiddleware",
           "queued_publish_tasks"]
