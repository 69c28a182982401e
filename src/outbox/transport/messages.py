"""The messages the database broker stores: a kombu message's envelope as JSON, its delay
(Celery's ``eta``) and expiry (``expiration``, except a Celery task's ``expires``), the names
the tables can hold, the delivery tags that carry a lease's receipt, and which queues are
Celery's remote control (docs/transport.md, "Delays and expiry", "Control commands and
events")."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

from .tables.base import MAX_NAME

log = logging.getLogger("outbox.transport")


def eta_delay_ms(headers: dict[str, Any] | None) -> int:
    """Milliseconds until a Celery message's ``eta`` (protocol 2 header), 0 if none."""
    eta = (headers or {}).get("eta")
    if not eta:
        return 0
    try:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    except (TypeError, ValueError):
        log.warning("outboxdb: ignoring unparseable eta %r", eta)
        return 0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(int((when - datetime.now(UTC)).total_seconds() * 1000), 0)


def ttl_ms(properties: dict[str, Any]) -> int | None:
    expiration = properties.get("expiration")
    if expiration in (None, ""):
        return None
    try:
        return max(int(float(expiration)), 0)
    except (TypeError, ValueError):
        raise ValueError(f"message expiration must be milliseconds, got {expiration!r}") from None


def celery_expires(headers: dict[str, Any] | None) -> bool:
    """A Celery task message with ``expires``: Celery 5.7 also sends it as the message's
    ``expiration``, but such a task must reach a worker, which marks it REVOKED in the
    result backend (as on Redis, which ignores ``expiration``). docs/transport.md, "Delays
    and expiry"."""
    return headers is not None and bool(headers.get("task")) and headers.get("expires") not in (None, "")


def encode_envelope(envelope: dict[str, Any]) -> str:
    """The envelope as JSON. Properties JSON cannot encode (unknown publish keyword
    arguments that kombu turns into properties, such as a Signal) are dropped with a
    debug line, as py-amqp drops properties it does not know; headers must encode."""
    try:
        return json.dumps(envelope)
    except (TypeError, ValueError):
        pass
    properties = {}
    for key, value in (envelope.get("properties") or {}).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            log.debug("outboxdb: dropping message property %r: not JSON-encodable (%s)", key, type(value).__name__)
            continue
        properties[key] = value
    return json.dumps({**envelope, "properties": properties})


def check_name(kind: str, name: str) -> None:
    """Names are stored in VARCHAR(MAX_NAME) columns: refuse longer ones clearly."""
    if len(name) > MAX_NAME:
        raise ValueError(f"outboxdb: {kind} name is {len(name)} characters, the queue tables hold at most "
                         f"{MAX_NAME}: {name[:40]!r}...")


def is_control_queue(queue: str) -> bool:
    """kombu's pidbox queues (Celery's remote control): ``<node>.<app>.pidbox`` on a
    worker, ``<id>.reply.<app>.pidbox`` on a client awaiting replies."""
    return queue.endswith(".pidbox")


#: kombu's reply queue: the client's id (a UUID, ``kombu.common.oid_from``), then ``.reply.``.
_REPLY_QUEUE = re.compile(r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}\.reply\..+\.pidbox")


def is_reply_queue(queue: str) -> bool:
    """A client's reply queue, told apart from a worker's by its leading id (docs/transport.md,
    "Remote control within Celery's 1 s")."""
    return _REPLY_QUEUE.fullmatch(queue) is not None


def make_tag(row_id: int, receipt: str) -> str:
    """A message's delivery tag: its row and the lease's receipt (unique per lease)."""
    return f"{row_id}.{receipt}"


def split_tag(delivery_tag: str) -> tuple[int, str]:
    row_id, _, receipt = str(delivery_tag).partition(".")
    return int(row_id), receipt
