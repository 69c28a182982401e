"""Picking the queue tables of an engine (``outbox.storage.engines.queues``): a module of its own,
above the engine modules ``queue_<engine>.py``, so that they import the contract and the
contract never imports them back."""

from __future__ import annotations

import re

from ...core.errors import ConfigError
from .base import Engine
from .queues import DEFAULT_QUEUE_TABLE, QueueTables


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")


def queue_tables(engine: Engine, table: str = DEFAULT_QUEUE_TABLE) -> QueueTables:
    """The queue-table SQL for ``engine``."""
    if not _NAME.match(table):
        raise ConfigError(f"queue table name {table!r} is not a plain identifier "
                          "(letters, digits, underscores; at most 41 characters)")
    if engine.name == "postgresql":
        from .queue_postgres import PostgresQueueTables as cls
    elif engine.name == "mysql":
        from .queue_mysql import MysqlQueueTables as cls  # type: ignore[assignment]
    elif engine.name == "sqlite":
        from .queue_sqlite import SqliteQueueTables as cls  # type: ignore[assignment]
    elif engine.name == "mssql":
        from .queue_mssql import MssqlQueueTables as cls  # type: ignore[assignment]
    else:  # pragma: no cover - engine_class already refuses unknown engines
        raise ValueError(engine.name)
    return cls(engine, table)


__all__ = ["queue_tables"]
