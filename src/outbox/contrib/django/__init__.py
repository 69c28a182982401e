"""Django: enqueue on a Django database connection and wake the relay after commit.

::

    from django.db import transaction
    from outbox.contrib.django import enqueue

    with transaction.atomic():
        order.save()
        enqueue(topic="orders.created", aggregate_type="order", aggregate_id=order.pk,
                payload={"orderId": order.pk})

The event is written on ``django.db.connections[using]`` (the default database unless
``using`` names another), inside whatever transaction is open there (``atomic``,
``ATOMIC_REQUESTS``), or committed at once in autocommit mode, like any Django query.
The wake-up is a ``transaction.on_commit(..., robust=True)`` callback registered once
per transaction: it runs after the outermost ``atomic`` commits, never after a rollback
(an inner ``atomic`` that rolls back drops it with its savepoint), and it cannot raise
into your code. OUTBOX_* settings may live in Django's settings module.

Add ``"outbox.contrib.django"`` to ``INSTALLED_APPS`` for the rest (``apps.py``): the
table as a Django migration, the ``outbox_*`` management commands, the admin page, and a
start-up warning when this process cannot wake the relay. Importing this package does not
need Django to be set up; the app's modules do.
"""

from __future__ import annotations

from typing import Any

from ... import wake as _wake
from ...enqueue import enqueue as _enqueue
from ..databases import django_database


def enqueue(*, using: str | None = None, wake: bool = True, **event: Any) -> int:
    """``outbox.enqueue`` on ``connections[using]``, then a wake-up after commit.
    ``event``: the keyword arguments of ``outbox.enqueue`` (topic, aggregate_type,
    aggregate_id, payload, headers, key, message_id, table, schema)."""
    from django.db import DEFAULT_DB_ALIAS, connections

    alias = using or DEFAULT_DB_ALIAS
    conn = connections[alias]
    outbox_id = _enqueue(conn, **event)
    django_database(alias, conn)  # a database other than the relay's: said once (docs/django.md, "Several databases")
    if wake:
        _wake.register_after_commit(conn)
    return outbox_id


def wake_on_commit(using: str | None = None) -> bool:
    """Wake the relay when the current transaction of ``connections[using]`` commits
    (for events written with plain ``outbox.enqueue(connection, ...)``)."""
    from django.db import DEFAULT_DB_ALIAS, connections

    return _wake.register_after_commit(connections[using or DEFAULT_DB_ALIAS])


__all__ = ["enqueue", "wake_on_commit"]
