"""The relay's Celery tasks. The logic lives in ``outbox.relay``; this module wires it to
Celery: per-process resources, the queues, and when Celery acknowledges a task.

Tasks and their queues
----------------------
==================  ==============  =====================================================
task                queue           does
==================  ==============  =====================================================
``outbox.claim``    outbox.claim    lease a batch, send its chains on as publish tasks
                                    (a small batch it publishes itself); drain mode:
                                    claims follow completions (see ``claim``)
``outbox.publish``  outbox.publish  publish chains; mark done / fail / release the rows
``outbox.ack``      outbox.ack      ``mark_done`` a publish task could not write itself
``outbox.fail``     outbox.ack      ``mark_failed`` (+ dead-letter) likewise
``outbox.release``  outbox.ack      ``release`` likewise
``outbox.purge``    outbox.purge    ``purge_done`` on OUTBOX_RETENTION_DAYS
==================  ==============  =====================================================

Acknowledgement choices (a lost task is always recovered by the lease alone)
----------------------------------------------------------------------------
* claim: acked early (the default). A claim that dies is replaced by the next tick;
  redelivering a stale tick is pointless. Ticks carry an expiry, so they never pile up.
* publish: ``acks_late=True``: a task reserved by a worker that stops or loses its broker
  connection before running it goes back to the queue and runs elsewhere, still inside
  its lease, so no attempt is spent. ``reject_on_worker_lost=False``: when the process
  running it dies (SIGKILL, OOM, a crashing driver) the message is *not* redelivered;
  the rows' lease expires and the next claim takes them again, counting an attempt. That
  count is what eventually dead-letters an event that kills every worker that touches
  it; redelivering would loop on it for ever. A publish task that starts after most of
  its lease has gone (a redelivery after the Redis visibility timeout, a long queue)
  publishes nothing and leaves the rows to the lease.
* ack / fail / release: ``acks_late=True, reject_on_worker_lost=True``: they are
  idempotent and fenced by the lease, so running one twice is harmless and losing one
  only delays recovery; they retry with back-off while the database is down.
* purge: acked early; the next run does the work.

Per-process resources
---------------------
The store and the publisher are created lazily in the process (and thread) that uses
them, so prefork children never share a connection inherited from the parent; they are
dropped on ``worker_process_init`` and closed on ``worker_process_shutdown`` /
``worker_shutdown``. Shutdown: once the worker is shutting down (``stopping()``, in the
main process and in every pool child), claims stop and chains of a publish task that
have not started are released.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from celery import signals

from .celery import app, relay_options, relay_settings
from .relay import (ACK_QUEUE, ACK_TASK, CLAIM_QUEUE, CLAIM_TASK, FAIL_TASK, PUBLISH_QUEUE, PUBLISH_TASK,
                    PURGE_TASK, RELEASE_TASK, Breaker, ClaimFailed, Coalescer, Outage, RouteGate, Settler,
                    apply_fallback, breaker_key, handle_claim, handle_publish, make_breaker, make_coalescer,
                    make_relay_outage, make_route_gate, purge_expired, still_held, message_from_dict,
                    message_to_dict)
from .store import OutboxStore
from . import listen as _listen, metrics as _metrics, wake as _wake

log = logging.getLogger("outbox.tasks")

#: Set when this worker starts shutting down: no new claims, no new chains.
STOPPING = threading.Event()
#: In a prefork pool child: the pid of the worker's main process, which is the one that
#: receives the shutdown signal and tells its children through a marker file.
_parent_pid: int | None = None


def _stopping_marker(main_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"outbox-worker-stopping-{main_pid}"


def stopping() -> bool:
    """True once this worker is shutting down. Celery signals only the main process; pool
    children see the marker file it leaves (one ``stat`` per task)."""
    if STOPPING.is_set():
        return True
    return _parent_pid is not None and _stopping_marker(_parent_pid).exists()

# Worker-side services: in-process worker flag (wake-ups), the PostgreSQL LISTEN thread and the
# metrics endpoint (each a no-op unless enabled; see their modules).
_wake.install_worker_hooks()
_listen.install_worker_hooks()
_metrics.install_worker_hooks()


# -- per-process, per-thread resources -----------------------------------------------------

@dataclass
class _Resources:
    pid: int
    store: OutboxStore
    publisher: Any
    settler: Settler


_local = threading.local()
_made: list[_Resources] = []
_made_lock = threading.Lock()
_breaker: tuple[int, Breaker] | None = None
_coalescer: tuple[int, Coalescer] | None = None
_route_gate: tuple[int, RouteGate] | None = None
_outages: dict[str, tuple[int, Outage]] = {}
#: Did this process's last claim meet a backlog? Only then does its next claim read the
#: publish queue's length first (a round trip to Celery's broker): a backlog is bounded
#: by that check, and live traffic, which never fills the queue, skips it.
_backlog = True


def make_publisher(settings: Any) -> Any:
    from .publisher import KombuPublisher

    return KombuPublisher.from_settings(settings, max_message_bytes=relay_options().max_message_bytes)


def breaker() -> Breaker:
    """One breaker per process (shared beyond it through Redis or a file)."""
    global _breaker
    with _made_lock:
        if _breaker is None or _breaker[0] != os.getpid():
            s = relay_settings()
            key = breaker_key(s.database_url, s.table, s.publish_url, s.exchange)
            _breaker = (os.getpid(), make_breaker(str(app.conf.broker_url or s.broker_url), key))
        return _breaker[1]


def coalescer() -> Coalescer:
    """One claim-request token per process object (shared beyond it like the breaker)."""
    global _coalescer
    with _made_lock:
        if _coalescer is None or _coalescer[0] != os.getpid():
            s = relay_settings()
            key = breaker_key(s.database_url, s.table, s.publish_url, s.exchange)
            _coalescer = (os.getpid(), make_coalescer(str(app.conf.broker_url or s.broker_url), key,
                                                      relay_options().claim_request_ttl_s))
        return _coalescer[1]


def route_gate() -> RouteGate:
    """The paused routes (per-route back-pressure), shared beyond the process like the breaker."""
    global _route_gate
    with _made_lock:
        if _route_gate is None or _route_gate[0] != os.getpid():
            s = relay_settings()
            key = breaker_key(s.database_url, s.table, s.publish_url, s.exchange)
            _route_gate = (os.getpid(), make_route_gate(str(app.conf.broker_url or s.broker_url), key))
        return _route_gate[1]


def outage(which: str) -> Outage:
    """The outage log of ``which`` ("database" or "destination broker"): one warning when it
    starts, one line when it ends, announced by one process of all the workers."""
    with _made_lock:
        made = _outages.get(which)
        if made is None or made[0] != os.getpid():
            s = relay_settings()
            made = (os.getpid(), make_relay_outage(which, s, relay_options(), str(app.conf.broker_url or s.broker_url),
                                                   log))
            _outages[which] = made
        return made[1]


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


def _remove_stopping_marker() -> None:
    try:
        _stopping_marker(os.getpid()).unlink(missing_ok=True)
    except OSError:
        pass


@signals.worker_init.connect
def _init(**_: Any) -> None:
    _remove_stopping_marker()  # one left by an earlier process with this pid


@signals.worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    _remove_stopping_marker()
    close_resources()


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    """A restarted worker lifts a fatal pause: the operator has presumably fixed the
    configuration, and if not, the first chain trips it again."""
    try:
        b = breaker()
        if b.open_for() > 0 and b.reason.startswith("fatal"):
            log.warning("outbox: lifting the fatal pause left by an earlier run (%s)", b.reason)
            b.reset()
    except Exception as exc:  # never keep a worker from starting over this
        log.warning("outbox: cannot check the circuit breaker at start-up: %s", exc)


# -- Celery plumbing used by the relay logic -------------------------------------------------

def _fallback(operation: str, kwargs: dict[str, Any]) -> None:
    task = {"done": ack, "failed": fail, "release": release}[operation]
    task.apply_async(kwargs=kwargs, queue=ACK_QUEUE)


def _dispatch(chains: list[list[Any]], deadline: float) -> None:
    publish.apply_async(
        kwargs={"chains": [[message_to_dict(m) for m in chain] for chain in chains], "deadline": deadline},
        queue=PUBLISH_QUEUE,
        retry=True, retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
    )


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


# -- tasks -------------------------------------------------------------------------------

def request_claim() -> bool:
    """Ask for a claim soon, coalesced: while one requested claim has not started yet,
    further requests are no-ops. Used by drain mode and usable as a wake-up call."""
    if stopping():
        return False
    gate = coalescer()
    if not gate.acquire():
        return False
    try:
        claim.apply_async(kwargs={"requested": True}, queue=CLAIM_QUEUE, expires=relay_options().claim_request_ttl_s)
    except Exception as exc:
        gate.clear()
        log.warning("outbox: cannot request a claim (%s); the next tick will claim", exc)
        return False
    return True


wake = request_claim


@app.task(name=CLAIM_TASK, ignore_result=True, acks_late=False)
def claim(requested: bool = False, token: str | None = None) -> dict[str, Any]:
    """Claim a batch and dispatch it as publish tasks.

    Drain mode: a claim that came back full (or was cut by the byte budget) requests
    another one at once, and every publish task requests one as it finishes, since it
    has just unblocked its aggregates. Requests are coalesced (at most one requested
    claim waits at a time), so a backlog is drained as fast as publish tasks complete
    without a storm of claims, and a quiet outbox costs one empty claim per burst. A
    claim that finds the publish queue full claims nothing: the completions of those
    queued tasks will request the next one. Beat's tick is the safety net."""
    if requested:
        coalescer().clear()
    if token:  # a post-commit wake-up (outbox.wake): the next commit may ask again
        _wake.clear_token(token)
    if stopping():
        return {"stopped": True}
    global _backlog
    settings, options = relay_settings(), relay_options()
    r = resources()
    try:
        outcome = handle_claim(r.store, _dispatch, batch_size=settings.batch_size,
                               lease_s=settings.claim_timeout_ms / 1000.0, options=options, breaker=breaker(),
                               queued=queued_publish_tasks if _backlog else None, settler=r.settler,
                               publisher=r.publisher, publish_inline=_publish_chains)
    except ClaimFailed as exc:
        # The database is down or refusing: one warning per outage, not a traceback per tick.
        outage("database").failed(exc.cause)
        return {"database_unavailable": True}  # the error is in the outage's log lines, once
    outage("database").ok()
    _backlog = outcome.backlog
    if outcome.more:
        request_claim()
    return asdict(outcome)


def _publish_chains(chains: list[list[Any]], deadline: float | None) -> list[Any]:
    """Publish chains in this process: the publish task's work, and a small claim's."""
    r = resources()
    outcomes = handle_publish(r.store, r.publisher, chains, deadline=deadline, options=relay_options(),
                              breaker=breaker(), settler=r.settler, stopping=stopping, routes=route_gate(),
                              outage=outage("destination broker"))
    if breaker().open_for() == 0:
        request_claim()  # drain mode: these aggregates may have more rows now
    return outcomes


@app.task(name=PUBLISH_TASK, bind=True, ignore_result=True, acks_late=True, reject_on_worker_lost=False)
def publish(self: Any, chains: list[list[dict[str, Any]]], deadline: float | None = None) -> dict[str, Any]:
    messages = [[message_from_dict(d) for d in chain] for chain in chains]
    if (self.request.delivery_info or {}).get("redelivered"):
        messages = still_held(resources().store, messages)  # a second delivery: docs/relay.md
    outcomes = _publish_chains(messages, deadline)
    return {"published": sum(len(o.published) for o in outcomes),
            "failed": [o.failed_id for o in outcomes if o.failed_id is not None]}


_SETTLE = dict(ignore_result=True, acks_late=True, reject_on_worker_lost=True, autoretry_for=(Exception,),
               retry_backoff=0.5, retry_backoff_max=30, retry_jitter=True, max_retries=10)


@app.task(name=ACK_TASK, **_SETTLE)
def ack(ids: list[int], lease: str) -> int:
    return apply_fallback(resources().store, None, "done", {"ids": ids, "lease": lease}).applied


@app.task(name=FAIL_TASK, **_SETTLE)
def fail(message: dict[str, Any], error: str, retry_in_s: float | None = None, dead: bool = False) -> bool:
    r = resources()
    return apply_fallback(r.store, r.publisher, "failed",
                          {"message": message, "error": error, "retry_in_s": retry_in_s, "dead": dead}).applied


@app.task(name=RELEASE_TASK, **_SETTLE)
def release(ids: list[int], lease: str, delay_s: float | None = None) -> int:
    return apply_fallback(resources().store, None, "release", {"ids": ids, "lease": lease, "delay_s": delay_s}).applied


@app.task(name=PURGE_TASK, ignore_result=True)
def purge() -> int:
    return purge_expired(resources().store, relay_settings().retention_days, outage("database"), log)


__all__ = ["claim", "publish", "ack", "fail", "release", "purge", "resources", "close_resources", "breaker",
           "route_gate", "outage",
           "coalescer", "request_claim", "wake", "queued_publish_tasks", "STOPPING", "stopping"]
