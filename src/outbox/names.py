"""The names the relay's processes agree on: Celery task names and queue names.

A leaf module (it imports nothing), so the Celery app, the schedule, the tasks, the
wake-up client and the tests all take the names from one place. Why each task has its
own queue: docs/relay.md, "Tasks and queues".
"""

from __future__ import annotations

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

__all__ = ["CLAIM_TASK", "PUBLISH_TASK", "ACK_TASK", "FAIL_TASK", "RELEASE_TASK", "PURGE_TASK",
           "CLAIM_QUEUE", "PUBLISH_QUEUE", "ACK_QUEUE", "PURGE_QUEUE", "QUEUES", "ROUTES"]
