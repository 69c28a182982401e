"""The relay's Celery task bodies: claim, publish, ack, fail, release, purge. The logic is in
``outbox.relay``, the per-process wiring and every signal in ``outbox.celery.worker``. Each task,
its queue and why it is acknowledged when it is: docs/relay.md, "Tasks, queues, and how
to scale and route them".
"""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.time import maybe_iso8601, maybe_make_aware

from ..core.config import relay_settings
from ..core.names import ACK_TASK, CLAIM_TASK, FAIL_TASK, PUBLISH_TASK, PURGE_TASK, RELEASE_TASK, TASK_OUTBOX_ARG
from .application import app, send_relay_task

# The worker's per-process wiring, re-exported: ``outbox.celery.tasks.resources`` and the rest keep working.
from .worker import (  # noqa: F401
    STOPPING,
    _stopping_marker,
    breaker,
    claim_runner,
    claiming_in_process,
    close_resources,
    coalescer,
    outage,
    queued_publish_tasks,
    relay,
    request_claim,
    resources,
    route_gate,
    stopping,
)

log = logging.getLogger("outbox.tasks")


class RelayTask(app.Task):
    """Every relay task: it runs only when it names this worker's outbox (``TASK_OUTBOX_ARG``);
    one naming another outbox is forwarded to that outbox's queue, not run (docs/relay.md,
    "Several outboxes on one broker")."""

    #: Celery checks the keyword arguments of a send against the body's signature; ``TASK_OUTBOX_ARG``
    #: is not the body's (``__call__`` takes it off), so that check is off for relay tasks.
    typing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = kwargs.pop(TASK_OUTBOX_ARG, None)
        ours = relay_settings().outbox_namespace
        if relay().foreign.belongs(named, ours):
            return super().__call__(*args, **kwargs)
        # Its deadline, forwarded as is (Celery hands a worker the ISO-8601 header): a tick,
        # claim request or purge keeps the time it has left; one already past is dropped.
        expires = maybe_iso8601(self.request.expires)
        if expires is not None and maybe_make_aware(expires) <= self.app.now():
            log.debug("outbox: dropped a %s task of outbox %r that expired at %s, not forwarded (this worker "
                      "relays %r)", self.name, named, expires.isoformat(), ours)
            return {"refused": named, "expired": True}
        done = relay().foreign.refuse(self.name, named, ours, lambda other: send_relay_task(
            self.name, kwargs, namespace=other, args=args, expires=expires))
        return {"refused": named, done: True}


#: ``outbox.celery.tasks.wake()``: the worker's coalesced claim request (``outbox.celery.worker``).
wake = request_claim


@app.task(name=CLAIM_TASK, base=RelayTask, ignore_result=True, acks_late=False)
def claim(requested: bool = False, token: str | None = None) -> dict[str, Any]:
    """Claim a batch and dispatch it as publish tasks (``Relay.claim``: drain slices, drain mode).
    Not in the worker's main process (the in-process claim): a backlog it meets goes to the pool."""
    in_main = claiming_in_process()
    return relay().claim(requested, token, in_main=in_main, follow_up=claim_runner.request if in_main else None)


@app.task(name=PUBLISH_TASK, base=RelayTask, bind=True, ignore_result=True, acks_late=True, reject_on_worker_lost=False)
def publish(self: Any, chains: list[list[dict[str, Any]]], deadline: float | None = None) -> dict[str, Any]:
    # Rows of this process's own lease are checked only on a second delivery (docs/internals.md, "Lost workers").
    return relay().publish(chains, deadline, check_own=bool((self.request.delivery_info or {}).get("redelivered")))


_SETTLE = {"ignore_result": True, "acks_late": True, "reject_on_worker_lost": True, "autoretry_for": (Exception,),
           "retry_backoff": 1, "retry_backoff_max": 30, "retry_jitter": True, "max_retries": 10}


@app.task(name=ACK_TASK, base=RelayTask, **_SETTLE)
def ack(ids: list[int], lease: str) -> int:
    return relay().settle("done", ids=ids, lease=lease)


# The dead-letter headers come inside ``message`` (relay.settle.DEAD_HEADERS_KEY), which every
# release's fail task takes; ``dead_headers`` is still taken from builds that sent it as a keyword.
@app.task(name=FAIL_TASK, base=RelayTask, **_SETTLE)
def fail(message: dict[str, Any], error: str, retry_in_s: float | None = None, dead: bool = False,
         dead_headers: dict[str, Any] | None = None) -> bool:
    return relay().settle("failed", message=message, error=error, retry_in_s=retry_in_s, dead=dead,
                          dead_headers=dead_headers)


@app.task(name=RELEASE_TASK, base=RelayTask, **_SETTLE)
def release(ids: list[int], lease: str, delay_s: float | None = None) -> int:
    return relay().settle("release", ids=ids, lease=lease, delay_s=delay_s)


@app.task(name=PURGE_TASK, base=RelayTask, ignore_result=True)
def purge() -> int:
    return relay().purge()


__all__ = ["claim", "publish", "ack", "fail", "release", "purge", "relay", "resources", "close_resources", "breaker",
           "route_gate", "outage",
           "coalescer", "request_claim", "wake", "queued_publish_tasks", "STOPPING", "stopping"]
