"""The database broker's queue tables (docs/transport.md, "Table layout"): the contract every
engine shares (``base``), one module per engine with only what differs (``sqlite``,
``postgres``, ``mysql``, ``mssql``), and ``queue_tables``, which picks one. The engine modules
are imported here lazily, so they import the contract and the contract never imports them."""

from __future__ import annotations

import re

from ...core.errors import ConfigError
from ...storage.engines.base import Engine
from .base import DEFAULT_QUEUE_TABLE, QueueTables

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")


def queue_tables(engine: Engine, table: str = DEFAULT_QUEUE_TABLE) -> QueueTables:
    """The queue-table SQL for ``engine``."""
    if not _NAME.match(table):
        raise ConfigError(f"queue table name {table!r} is not a plain identifier "
                          "(letters, digits, underscores; at most 41 characters)")
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
