"""The write side: ``enqueue`` adds one event to the outbox inside the caller's
transaction. It never commits, never rolls back, and raises ``EnqueueError`` before
touching the database when the input is bad."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from .core.config import get_settings, validate_identifier
from .core.errors import ConfigError, EnqueueError, StoreError
from .core.model import NewEvent, OutboxMessage
from .core.tracing import current_traceparent
from .domain.events import MAX_HEADERS_BYTES, prepare_event
from .relay.listen import notify_channel
from .storage.engines import Engine, engine_class, unwrap_connection

log = logging.getLogger("outbox.enqueue")


@lru_cache(maxsize=32)
def _engine(kind: str, table: str, schema: str | None) -> Engine:
    return engine_class(kind)(table=table, schema=schema)


#: What the relay's own headers (``message_id``, ``outbox_id``, ``topic``, ... ``traceparent``:
#: docs/publisher.md, "Headers") take at most in the published AMQP header table, with the
#: longest values their columns hold.
RESERVED_HEADERS_MAX_BYTES = 5 * 1024


def published_headers_problem(event: NewEvent) -> str | None:
    """Why the publisher would refuse ``event``'s headers as POISON, every time (the AMQP
    header table of the caller's headers and the relay's own, over 64 KiB), or None.
    Headers whose JSON is well under the limit cannot be (the publisher's own bound, in
    ``publisher.message.checked_headers``); only larger ones are encoded here, exactly as
    the publisher will, with the longest ``outbox_id`` and ``attempt`` they can have."""
    text = event.headers_json
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if 2 * size + 64 + RESERVED_HEADERS_MAX_BYTES <= MAX_HEADERS_BYTES:
        return None
    from .publisher.message import checked_headers  # the publisher's verdict, not a copy of it

    stand_in = OutboxMessage(
        id=2 ** 63 - 1, message_id=event.message_id, topic=event.topic, aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id, partition_key=event.partition_key, payload="", headers=json.loads(text),
        trace_id=event.trace_id, attempts=2 ** 31 - 2, created_at=datetime.now(UTC), lease="")
    failure = checked_headers(stand_in, sys.maxsize)[1]
    if failure is None:
        return None
    return f"headers: {failure.reason} (the relay's own headers included): the publisher would refuse the event"


@lru_cache(maxsize=8)
def _warn_autocommit(connection_type: str) -> None:
    """Once per process and connection type: the event committed on its own."""
    log.warning("outbox enqueue: the %s connection is in autocommit mode, so the event was committed by "
                "itself, not with your business change; enqueue inside a transaction (Django: "
                "transaction.atomic(); SQLAlchemy: a Session or engine.begin()) (README, 'Write side')",
                connection_type)


def enqueue(
    conn: Any,
    *,
    topic: str,
    aggregate_type: str,
    aggregate_id: str | int,
    payload: Any,
    headers: Mapping[str, Any] | None = None,
    key: str | None = None,
    message_id: str | None = None,
    table: str | None = None,
    schema: str | None = None,
) -> int:
    """Write one event row in the caller's open transaction and return its id.

    Enqueueing a ``message_id`` that is already stored writes nothing and returns
    the existing row's id, on every engine without disturbing the transaction.

    Events of one aggregate are relayed in id order. Ids follow insert order, so
    writers of the same aggregate should serialize on it (update or lock the
    aggregate's row first), as any transaction that changes it does anyway.

    ``table`` and ``schema`` (default: ``OUTBOX_TABLE`` / ``OUTBOX_SCHEMA``) are checked
    exactly like those settings: plain identifiers only, since they reach SQL text.

    ``conn`` is a connection, never a cursor (``UnsupportedConnection``). A missing outbox
    table is a ``StoreError`` that says to run ``outbox migrate``, the driver's error as
    its ``__cause__``.
    """
    settings = get_settings()
    try:
        table = settings.table if table is None else validate_identifier(table, "table")
        schema = settings.schema if schema is None else validate_identifier(schema, "schema")
    except ConfigError as exc:
        raise EnqueueError(f"enqueue: {exc}") from None
    event = prepare_event(topic=topic, aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                          payload=payload, headers=headers, key=key, message_id=message_id,
                          trace_id=current_traceparent(), max_payload_bytes=settings.max_payload_bytes)
    problem = published_headers_problem(event)
    if problem:
        raise EnqueueError(problem)
    kind, raw = unwrap_connection(conn)
    engine = _engine(kind, table, schema)
    if engine.commits_each_statement(raw):
        _warn_autocommit(f"{type(raw).__module__}.{type(raw).__name__}")
    cursor = engine.cursor_for(raw)
    try:
        channel = notify_channel(kind, engine.table_name, engine.schema)  # None unless OUTBOX_RELAY_LISTEN
        if channel:  # PostgreSQL delivers the notification at commit, and only then
            return engine.insert_event_and_notify(cursor, event, channel)
        return engine.insert_event(cursor, event)
    except Exception as exc:
        hint = engine.schema_error_hint(exc)  # read from the error alone: no query on the hot path
        if hint is not None:
            raise StoreError(f"enqueue: {hint}") from exc
        raise
    finally:
        cursor.close()
