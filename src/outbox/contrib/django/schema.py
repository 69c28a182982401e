"""The outbox table on a Django connection, with the relay's own DDL.

The Django migration calls ``create_table``: it runs the same guarded statements as
``outbox migrate`` (``outbox.storage.store.apply_migration``) on the connection being migrated, so
the table, its JSON checks and its filtered indexes are identical whichever created them,
and ``outbox migrate`` afterwards finds nothing to do.
"""

from __future__ import annotations

from typing import Any

from ...core.config import get_settings, load_settings
from ...storage.engines import Engine, engine_class, unwrap_connection
from ...storage.store import apply_migration


def engine_for(connection: Any) -> tuple[Engine, Any]:
    """(the outbox engine, the raw DB-API connection) of a Django connection."""
    kind, raw = unwrap_connection(connection)
    settings = get_settings()
    return engine_class(kind)(table=settings.table, schema=settings.schema), raw


def create_table(connection: Any) -> None:
    engine, raw = engine_for(connection)
    cursor = engine.cursor_for(raw)
    try:
        apply_migration(engine, cursor)
    finally:
        cursor.close()


def requeue_dead(connection: Any, ids: list[int]) -> int:
    """The store's requeue statement on Django's connection (the admin action): id lists
    as that connection's server takes them (probed first), as many statements as needed."""
    engine, raw = engine_for(connection)
    cursor = engine.cursor_for(raw)
    try:
        engine.read_server(cursor)
        return sum(int(engine.execute(cursor, engine.requeue_sql(cond), params).rowcount)
                   for cond, params in map(engine.ids_in, engine.id_chunks(ids)))
    finally:
        cursor.close()


def table_name() -> str:
    """OUTBOX_TABLE, read without caching the settings: models.py asks at import time, before
    Django's test runner has switched DATABASES to the test database, and the cached
    settings would keep the database URL of that moment."""
    return load_settings().table
