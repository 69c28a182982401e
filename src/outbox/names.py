"""The names the relay's processes agree on: Celery task names and queue names.

A leaf module (it imports nothing of the package), so the Celery app, the schedule, the tasks, the
wake-up client and the tests all take the names from one place. Why each task has its
own queue: docs/relay.md, "Tasks and queues".
"""

from __future__ import annotations

import hashlib

CLAIM_TASK = "outbox.claim"
PUBLISH_TASK = "outbox.publish"
ACK_TASK = "outbox.ack"
FAIL_TASK = "outbox.fail"
RELEASE_TASK = "outbox.release"
PURGE_TASK = "outbox.purge"

CLAIM_QUEUE = "outbox.claim"
PUBLISH_QUEUE = "outbox.publish"
ACK_QUEUE = "outbox.ack"
PURGE_QUEUE = "outbox.purge"
QUEUES = (CLAIM_QUEUE, PUBLISH_QUEUE, ACK_QUEUE, PURGE_QUEUE)

#: Which queue each task is routed to.
ROUTES = {
    CLAIM_TASK: CLAIM_QUEUE,
    PUBLISH_TASK: PUBLISH_QUEUE,
    ACK_TASK: ACK_QUEUE,
    FAIL_TASK: ACK_QUEUE,
    RELEASE_TASK: ACK_QUEUE,
    PURGE_TASK: PURGE_QUEUE,
}

#: Prefix of the claim-request token (``claim_request_key``): a claim message's token is
#: only deleted when its name starts with it.
CLAIM_REQUEST_PREFIX = "outbox:wake:"


def claim_request_key(broker_url: str, key_prefix: str = "") -> str:
    """The name of the one coalesced "claim soon" token of a claim queue, i.e. of a task
    runner's broker URL and key prefix (Celery's ``global_keyprefix``, Dramatiq's namespace).
    Writers' wake-ups, the LISTEN thread and drain mode take the same token
    (docs/waking-and-metrics.md, "One claim request")."""
    digest = hashlib.sha1(f"{broker_url}|{key_prefix}".encode()).hexdigest()[:16]
    return f"{CLAIM_REQUEST_PREFIX}{digest}"


def wake_channel(broker_url: str, key_prefix: str = "") -> str:
    """The Redis pub/sub channel on which writers wake the workers of a claim queue (the
    workers' main processes SUBSCRIBE; docs/waking-and-metrics.md)."""
    return f"{claim_request_key(broker_url, key_prefix)}:notify"


__all__ = ["wake_channel", "CLAIM_TASK", "PUBLISH_TASK", "ACK_TASK", "FAIL_TASK", "RELEASE_TASK", "PURGE_TASK",
           "CLAIM_REQUEST_PREFIX", "claim_request_key", "CLAIM_QUEUE", "PUBLISH_QUEUE", "ACK_QUEUE", "PURGE_QUEUE", "QUEUES", "ROUTES"]
