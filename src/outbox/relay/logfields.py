"""How the relay names a message in its log lines: the same fields in the text and, for a
JSON formatter, in ``extra``."""

from __future__ import annotations

from typing import Any

from ..core.model import OutboxMessage
from ..core.redact import printable


def describe(message: OutboxMessage) -> str:
    """The ids of a message, as every relay log line names it; the application's own text with
    its control characters escaped (``redact.printable``: a newline in an aggregate id forged
    a log line)."""
    return (f"outbox_id={message.id} message_id={printable(message.message_id)} "
            f"aggregate_id={printable(message.aggregate_id)} topic={printable(message.topic)} lease={message.lease}")


def log_extra(message: OutboxMessage, event: str) -> dict[str, Any]:
    """``extra`` for log records, so a JSON formatter gets the ids as fields too."""
    return {"outbox_event": event, "outbox_id": message.id, "message_id": message.message_id,
            "aggregate_id": message.aggregate_id, "lease": message.lease}
