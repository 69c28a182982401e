"""Transactional send: a Celery task that exists if and only if the caller's transaction
commits.

``send_task(conn, app, "proj.tasks.charge", args=(42,))`` builds the message with
Celery's own protocol (``app.amqp.as_task_v2`` and the app's serializer, so an ordinary
worker on the ``outboxdb`` broker runs it), and inserts it into the broker's queue table
on ``conn``, inside the caller's open transaction. It never commits or rolls back. The
queue tables must exist already (``outbox migrate`` with OUTBOX_CELERY_BROKER_URL set, or
any worker having started): DDL inside the caller's transaction would commit it on MySQL.

A task routed by exchange and routing key (no queue) goes to every queue bound to them in
the bindings table, matched as kombu matches direct, topic and fanout exchanges.

Bad input (arguments the serializer cannot encode, a route to an exchange no queue is bound
to for its key, a task name that is empty) raises ``SendError`` (a ``ValueError``) before
anything is written, so the caller's transaction stays usable.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..storage.engines import engine_class, unwrap_connection
from .messages import eta_delay_ms
from .tables import queue_tables
from .tables.base import DEFAULT_QUEUE_TABLE


class SendError(ValueError):
    """The task cannot be sent; nothing was written."""


def send_task(conn: Any, app: Any, name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              *, queue: str | None = None, countdown: float | None = None, eta: datetime | None = None,
              expires: float | datetime | None = None, task_id: str | None = None,
              queue_table: str | None = None, schema: str | None = None) -> str:
    """Insert task ``name`` for ``app``'s workers in the caller's transaction on ``conn``
    (a DB-API connection of any supported engine, a Django connection, or a SQLAlchemy
    Connection/Session); return the task id. ``queue`` defaults to the app's route for
    the task; ``queue_table``/``schema`` to the app's ``broker_transport_options``."""
    if not isinstance(name, str) or not name.strip():
        raise SendError("send_task: the task name must be a non-empty string")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise SendError(f"send_task: kwargs must be a mapping, got {type(kwargs).__name__}")
    options = dict(app.conf.broker_transport_options or {})
    table = queue_table or options.get("queue_table") or DEFAULT_QUEUE_TABLE
    kind, dbapi = unwrap_connection(conn)
    engine = engine_class(kind)(schema=schema or options.get("queue_schema"))
    tables = queue_tables(engine, table)

    route = app.amqp.router.route({"queue": queue} if queue else {}, name, args, kwargs)
    target = route.get("queue")
    if target is not None:
        queue_name: str | None = getattr(target, "name", None) or str(target)
        exchange = getattr(getattr(target, "exchange", None), "name", None) or ""
        routing_key = str(getattr(target, "routing_key", None) or queue_name)
    else:  # routed by exchange and routing key: to the queues bound for them, as kombu routes it
        named = route.get("exchange")
        exchange = str(named.name if hasattr(named, "name") else named or "")
        routing_key = str(route.get("routing_key") or "")
        queue_name = None if exchange else routing_key or None  # the default exchange: the key names the queue
    task_id = task_id or str(uuid.uuid4())
    message = app.amqp.as_task_v2(task_id, name, tuple(args), dict(kwargs or {}), countdown=countdown, eta=eta,
                                  expires=expires)
    envelope, body = _envelope(app, message, exchange, routing_key)
    cursor = engine.cursor_for(dbapi)
    queues = [queue_name] if queue_name else _bound_queues(tables, cursor, route, exchange, routing_key)
    for target_queue in queues:
        tables.put(cursor, target_queue, json.dumps(envelope), body, delay_ms=eta_delay_ms(envelope["headers"]))
    return task_id


def _bound_queues(tables: Any, cursor: Any, route: Mapping[str, Any], exchange: str, routing_key: str) -> list[str]:
    """The queues bound to ``exchange`` for ``routing_key`` in the bindings table, matched as
    kombu matches them (direct, topic, fanout); SendError when there is none, before anything
    is written (kombu would drop such a message)."""
    from kombu.transport.virtual.exchange import STANDARD_EXCHANGE_TYPES

    kind = route.get("exchange_type") or getattr(route.get("exchange"), "type", None) or "direct"
    exchange_type = STANDARD_EXCHANGE_TYPES.get(kind)
    if not exchange or exchange_type is None:
        raise SendError(f"send_task: the task's route names no queue and no exchange of type direct, topic or "
                        f"fanout ({dict(route)!r}): pass queue=")
    table = [(b.routing_key, b.pattern or None, b.queue) for b in tables.table_bindings(cursor, exchange)]
    queues = sorted(exchange_type(None).lookup(table, exchange, routing_key, None))
    if not queues:
        raise SendError(f"send_task: no queue is bound to exchange {exchange!r} for routing key {routing_key!r} "
                        "(a worker binds its queues when it starts); pass queue=")
    return queues


def _envelope(app: Any, message: Any, exchange: str, routing_key: str) -> tuple[dict[str, Any], str]:
    """The row kombu's virtual channel would have stored for this task: body serialized
    with the app's task serializer, base64-encoded as the channel encodes bodies."""
    from kombu.exceptions import EncodeError
    from kombu.serialization import dumps

    try:
        content_type, content_encoding, data = dumps(message.body, serializer=app.conf.task_serializer)
        json.dumps(message.headers)  # headers travel as JSON whatever the body's serializer
    except (EncodeError, TypeError, ValueError) as exc:
        raise SendError(f"send_task: cannot serialize the task's arguments: {exc}") from None
    raw = data if isinstance(data, bytes) else data.encode(content_encoding or "utf-8")
    properties = {**message.properties, "delivery_mode": 2, "priority": 0, "body_encoding": "base64",
                  "delivery_tag": str(uuid.uuid4()),
                  "delivery_info": {"exchange": exchange, "routing_key": routing_key}}
    envelope = {"content-type": content_type, "content-encoding": content_encoding, "headers": message.headers,
                "properties": properties}
    return envelope, base64.b64encode(raw).decode("ascii")


__all__ = ["send_task", "SendError"]
