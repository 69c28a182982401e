"""The database as Celery's broker: a kombu transport on queue tables.

Select it with a broker URL ``outboxdb+<database URL>``::

    outboxdb+postgresql://user:pass@host:5432/db
    outboxdb+mysql://user:pass@host:3306/db            (MySQL 8, MariaDB 10.6+)
    outboxdb+mssql+pyodbc://user:pass@host:1433/db?driver=ODBC+Driver+18+for+SQL+Server
    outboxdb+sqlite:///path/to/file.db
    outboxdb://                                        (the outbox's own OUTBOX_DATABASE_URL)

kombu has no plugin mechanism for transports (no entry-point group): it resolves
the scheme before ``+`` through the ``kombu.transport.TRANSPORT_ALIASES`` dict.
Importing this package adds ``outboxdb`` there; ``outbox.celery`` does so when
OUTBOX_CELERY_BROKER_URL starts with ``outboxdb`` (before Celery connects), so ``celery -A
outbox`` needs nothing more. Your own Celery app needs
``import outbox.transport`` before it connects (or ``register()``).
"""

from __future__ import annotations

from typing import Any

from .options import SCHEME  # the URL scheme prefix that selects this transport

TRANSPORT_PATH = "outbox.transport.channel:Transport"

#: Names served lazily: importing this package (``outbox migrate``, ``outbox.celery`` on the
#: outboxdb broker) stays cheap and imports nothing of kombu's virtual transport until a
#: connection needs it, as kombu's own transports are loaded.
_LAZY = {"Transport": "channel", "Channel": "channel", "QoS": "channel", "database_url_of": "database",
         "send_task": "send", "SendError": "send"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def register() -> None:
    """Make ``outboxdb+...`` URLs select this transport in this process (idempotent)."""
    from kombu.transport import TRANSPORT_ALIASES
    TRANSPORT_ALIASES.setdefault(SCHEME, TRANSPORT_PATH)


def is_transport_url(url: str | None) -> bool:
    """True for broker URLs that select this transport."""
    return bool(url) and (url.startswith((f"{SCHEME}+", f"{SCHEME}://")))  # type: ignore[union-attr]


def migrate_queue_tables(broker_url: str, *, table: str | None = None, schema: str | None = None) -> Any:
    """Create or repair the queue tables behind ``broker_url`` (``outbox migrate``). A step
    that gives up waiting for a table's lock is not tried again and the error names who holds
    it (``storage.store.migration_lock_refusal``)."""
    from ..storage.store import migration_lock_refusal
    from .database import BrokerDatabaseUnavailable, Database, database_url_of
    from .tables.base import DEFAULT_QUEUE_TABLE
    url = database_url_of(broker_url.split("+", 1)[1] if broker_url.startswith(f"{SCHEME}+") else None)
    db = Database(url, table or DEFAULT_QUEUE_TABLE, schema, create=False, check=False)
    try:
        try:
            db.run(lambda qt, cursor: qt.migrate(cursor), ddl=True)
        except BrokerDatabaseUnavailable as exc:
            if exc.__cause__ is not None and db.engine.is_lock_timeout(exc.__cause__):
                raise migration_lock_refusal(db.engine, db.connections, [db.qt.table, db.qt.bindings]) from exc
            raise
        return db.qt
    finally:
        db.close()


def drop_queue_tables(database_url: str, table: str | None = None, *, schema: str | None = None) -> None:
    """Drop the queue tables (messages and bindings) in ``database_url`` if they exist: the
    tests and benchmarks clean up with it."""
    from ..storage.connections import Connections
    from ..storage.engines import engine_for_url
    from .tables import queue_tables
    from .tables.base import DEFAULT_QUEUE_TABLE
    engine = engine_for_url(database_url, schema=schema)
    qt = queue_tables(engine, table or DEFAULT_QUEUE_TABLE)
    connections = Connections(engine, database_url)
    try:
        connections.run("drop queue tables", qt.drop, attempts=1)
    finally:
        connections.drop()


register()

__all__ = ["Transport", "Channel", "QoS", "send_task", "SendError", "register", "is_transport_url",
           "migrate_queue_tables", "drop_queue_tables", "SCHEME",
           "TRANSPORT_PATH"]
