"""Alembic (Flask, or any SQLAlchemy application): the outbox table as a migration.

In a revision of your Alembic environment::

    from outbox.contrib.alembic import create_outbox_table

    def upgrade():
        create_outbox_table()          # or create_outbox_table(op) with the op at hand

    def downgrade():
        pass                           # keep the table (and its events); drop it by hand

It runs the relay's own guarded DDL (``outbox.storage.store.apply_migration``) on the migration's
connection, inside Alembic's transaction where the database allows DDL in one: the table,
its JSON checks and filtered indexes, and its holders table (docs/internals.md, "Lost workers")
are exactly what ``outbox migrate`` makes, on every engine, and ``outbox migrate`` afterwards finds nothing to do. Table and schema are
OUTBOX_TABLE / OUTBOX_SCHEMA (or the ``table`` / ``schema`` arguments).
"""

from __future__ import annotations

from typing import Any

from ..core.config import get_settings
from ..storage.engines import engine_class, unwrap_connection
from ..storage.store import apply_migration


def create_outbox_table(op: Any = None, *, table: str | None = None, schema: str | None = None,
                        native_json: bool = False) -> None:
    """Create or repair the outbox table on the current Alembic migration's connection."""
    if op is None:
        from alembic import op as alembic_op

        op = alembic_op
    kind, raw = unwrap_connection(op.get_bind())
    settings = get_settings()
    engine = engine_class(kind)(table=table or settings.table, schema=schema or settings.schema)
    cursor = engine.cursor_for(raw)
    try:
        apply_migration(engine, cursor, native_json=native_json)
    finally:
        cursor.close()


__all__ = ["create_outbox_table"]
