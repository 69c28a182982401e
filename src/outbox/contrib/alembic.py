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
OUTBOX_TABLE / OUTBOX_SCHEMA (or the ``table`` / ``schema`` arguments). Offline
(``alembic upgrade --sql``) it writes the same steps as SQL on PostgreSQL and says it cannot
elsewhere (docs/flask.md, "Offline SQL").
"""

from __future__ import annotations

from typing import Any

from ..core.config import get_settings
from ..core.errors import UnsupportedConnection
from ..storage.engines import engine_class, unwrap_connection
from ..storage.store import apply_migration

#: Alembic's dialect name -> the relay's engine kind.
_DIALECT_KINDS = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql",
                  "mssql": "mssql"}


def create_outbox_table(op: Any = None, *, table: str | None = None, schema: str | None = None,
                        native_json: bool = False) -> None:
    """Create or repair the outbox table on the current Alembic migration's connection, or,
    in offline mode (``alembic upgrade --sql``), write the statements that do (PostgreSQL
    only: docs/flask.md, "Offline SQL")."""
    if op is None:
        from alembic import op as alembic_op

        op = alembic_op
    settings = get_settings()
    table, schema = table or settings.table, schema or settings.schema
    context = op.get_context()
    if getattr(context, "as_sql", False):
        dialect = context.dialect.name
        kind = _DIALECT_KINDS.get(dialect)
        script = engine_class(kind)(table=table, schema=schema).migration_script(native_json) if kind else None
        if script is None:
            raise UnsupportedConnection(
                f"create_outbox_table: Alembic's offline mode (--sql) is not supported on {dialect}: the relay's "
                "migration probes the database before each of its guarded steps, which this database's SQL cannot "
                "write into a script. Run this revision online (alembic upgrade without --sql) or `outbox migrate` "
                "against the database; PostgreSQL's offline SQL is supported")
        for statement in script:
            op.execute(statement)
        return
    kind, raw = unwrap_connection(op.get_bind())
    engine = engine_class(kind)(table=table, schema=schema)
    cursor = engine.cursor_for(raw)
    try:
        apply_migration(engine, cursor, native_json=native_json)
    finally:
        cursor.close()


__all__ = ["create_outbox_table"]
