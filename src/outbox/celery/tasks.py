"""The relay's Celery task bodies: claim, publish, ack, fail, release, purge. The logic is in
``outbox.relay``, the per-process wiring and every signal in ``outbox.celery.worker``. Each task,
its queue and why it is acknowledged when it is: docs/relay.md, "Tasks, queues, and how
to scale and route them".
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from .application import app, send_relay_task
from ..core.config import relay_options, relay_settings
from ..core.names import ACK_TASK, CLAIM_TASK, FAIL_TASK, TASK_OUTBOX_ARG, PUBLISH_TASK, PURGE_TASK, RELEASE_TASK
from ..relay import (DRAIN_SLICE_S, Backlog, ForeignTasks, after_publish, apply_fallback, drain_slice,
                    handle_publish, message_from_dict, message_to_dict, purge_expired, still_held)
from .. import wake as _wake
# The worker's per-process wiring, re-exported: ``outbox.celery.tasks.resources`` and the rest
# keep working. ``claim`` looks ``queued_publish_tasks`` and ``request_claim`` up here.
from .worker import (STOPPING, _stopping_marker, breaker, claiming_in_process, close_resources,  # noqa: F401
                     coalescer, outage, queued_publish_tasks, request_claim, resources, route_gate, stopping)

log = logging.getLogger("outbox.tasks")

#: Did this process's last claim meet a backlog (``relay.Backlog``)?
_backlog = Backlog()


def _dispatch(chains: list[list[Any]], deadline: float) -> None:
    send_relay_task(
        PUBLISH_TASK,
        {"chains": [[message_to_dict(m) for m in chain] for chain in chains], "deadline": deadline},
        retry=True, retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
    )


# -- tasks -------------------------------------------------------------------------------

#: Tasks naming another outbox that reached this process (``relay.ForeignTasks``).
_foreign = ForeignTasks(log)


class RelayTask(app.Task):  # type: ignore[name-defined,misc]
    """Every relay task: it runs only when it names this worker's outbox (``TASK_OUTBOX_ARG``);
    one naming another outbox is forwarded to that outbox's queue, not run (docs/relay.md,
    "Several outboxes on one broker")."""

    #: Celery checks the keyword arguments of a send against the body's signature; ``TASK_OUTBOX_ARG``
    #: is not the body's (``__call__`` takes it off), so that check is off for relay tasks.
    typing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = kwargs.pop(TASK_OUTBOX_ARG, None)
        ours = relay_settings().outbox_namespace
        if _foreign.belongs(named, ours):
            return super().__call__(*args, **kwargs)
        done = _foreign.refuse(self.name, named, ours, lambda other: send_relay_task(
            self.name, kwargs, namespace=other, args=args, expires=self.request.expires))
        return {"refused": named, done: True}


#: ``outbox.celery.tasks.wake()``: the worker's coalesced claim request (``outbox.celery.worker``).
wake = request_claim


@app.task(name=CLAIM_TASK, base=RelayTask, ignore_result=True, acks_late=False)
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
    settings = relay_settings()
    r = resources()
    # Drain slices (docs/relay.md, "Drain slices"), written once in relay.drain. Not in the
    # worker's main process (the in-process claim): a backlog it meets goes to the pool.
    outcome = drain_slice(r.store, _dispatch, batch_size=settings.batch_size,
                          lease_s=settings.claim_timeout_ms / 1000.0, options=relay_options(), breaker=breaker(),
                          queued=queued_publish_tasks, backlog=_backlog, settler=r.settler, publisher=r.publisher,
                          sizer=r.sizer, publish_here=_publish_here, request_claim=request_claim,
                          stopping=stopping, outage=outage("database"), in_main=claiming_in_process(),
                          slice_s=DRAIN_SLICE_S)
    if outcome is None:  # the database is down or refusing: the error is in the outage's log lines, once
        return {"database_unavailable": True}
    return asdict(outcome)


def _publish_here(chains: list[list[Any]], deadline: float | None) -> list[Any]:
    """Publish chains in this process: the publish task's work, and a claim's own share."""
    r = resources()
    return handle_publish(r.store, r.publisher, chains, deadline=deadline, options=relay_options(),
                          breaker=breaker(), settler=r.settler, stopping=stopping, routes=route_gate(),
                          outage=outage("destination broker"))


def _publish_chains(chains: list[list[Any]], deadline: float | None) -> list[Any]:
    """Publish chains, then ask for a claim (their aggregates may have more rows now)."""
    outcomes = _publish_here(chains, deadline)
    after_publish(breaker(), request_claim)
    return outcomes


@app.task(name=PUBLISH_TASK, base=RelayTask, bind=True, ignore_result=True, acks_late=True, reject_on_worker_lost=False)
def publish(self: Any, chains: list[list[dict[str, Any]]], deadline: float | None = None) -> dict[str, Any]:
    messages = [[message_from_dict(d) for d in chain] for chain in chains]
    # Rows another process claimed are adopted first (one fenced statement); rows of this
    # process's own lease are checked only on a second delivery (docs/relay.md, "Lost workers").
    messages = still_held(resources().store, messages, deadline=deadline,
                          check_own=bool((self.request.delivery_info or {}).get("redelivered")))
    outcomes = _publish_chains(messages, deadline)
    return {"published": sum(len(o.published) for o in outcomes),
            "failed": [o.failed_id for o in outcomes if o.failed_id is not None]}


_SETTLE = dict(ignore_result=True, acks_late=True, reject_on_worker_lost=True, autoretry_for=(Exception,),
               retry_backoff=0.5, retry_backoff_max=30, retry_jitter=True, max_retries=10)


@app.task(name=ACK_TASK, base=RelayTask, **_SETTLE)
def ack(ids: list[int], lease: str) -> int:
    return apply_fallback(resources().store, None, "done", {"ids": ids, "lease": lease}).applied


@app.task(name=FAIL_TASK, base=RelayTask, **_SETTLE)
def fail(message: dict[str, Any], error: str, retry_in_s: float | None = None, dead: bool = False) -> bool:
    r = resources()
    return apply_fallback(r.store, r.publisher, "failed",
                          {"message": message, "error": error, "retry_in_s": retry_in_s, "dead": dead}).applied


@app.task(name=RELEASE_TASK, base=RelayTask, **_SETTLE)
def release(ids: list[int], lease: str, delay_s: float | None = None) -> int:
    return apply_fallback(resources().store, None, "release", {"ids": ids, "lease": lease, "delay_s": delay_s}).applied


@app.task(name=PURGE_TASK, base=RelayTask, ignore_result=True)
def purge() -> int:
    return purge_expired(resources().store, relay_settings().retention_days, outage("database"), log)


__all__ = ["claim", "publish", "ack", "fail", "release", "purge", "resources", "close_resources", "breaker",
           "route_gate", "outage",
           "coalescer", "request_claim", "wake", "queued_publish_tasks", "STOPPING", "stopping"]
