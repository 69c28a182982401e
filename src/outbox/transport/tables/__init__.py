"""The database broker's queue tables (docs/transport.md, "Table layout"): the contract every
engine shares (``base``), one module per engine with only what differs (``sqlite``,
``postgres``, ``mysql``, ``mssql``), and ``queue_tables``, which picks one. The engine modules
are imported here lazily, so they import the contract and the contract never imports them."""

from __future__ import annotations

from ...core.checks import validate_queue_table
from ...storage.engines.base import Engine
from .base import DEFAULT_QUEUE_TABLE, QueueTables


def queue_tables(engine: Engine, table: str = DEFAULT_QUEUE_TABLE) -> QueueTables:
    """The queue-table SQL for ``engine``; the name follows OUTBOX_TRANSPORT_QUEUE_TABLE's
    rule, whoever gives it (a Celery app's ``broker_transport_options`` too)."""
    validate_queue_table(table, "queue_table")
    if engine.name == "postgresql":
        from .postgres import PostgresQueueTables as cls
    elif engine.name == "mysql":
        from .mysql import MysqlQueueTables as cls  # type: ignore[assignment]
    elif engine.name == "sqlite":
        from .sqlite import SqliteQueueTables as cls  # type: ignore[assignment]
    elif engine.name == "mssql":
        from .mssql import MssqlQueueTables as cls  # type: ignore[assignment]
    else:  # pragma: no cover - engine_class already refuses unknown engines
        raise ValueError(engine.name)
    return cls(engine, table)


__all__ = ["queue_tables"]
