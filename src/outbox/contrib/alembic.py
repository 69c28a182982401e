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

Autogenerate (``alembic revision --autogenerate``, ``flask db migrate``) would drop those
tables, which are not in your MetaData: give env.py's ``context.configure`` the filter
``include_name`` (or ``include_object``) below (docs/flask.md, "Autogenerate").
"""

from __future__ import annotations

from typing import Any

from ..core.config import get_settings
from ..core.errors import UnsupportedConnection
from ..storage.engines import engine_class, unwrap_connection
from ..storage.engines.base import holders_table_name
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


def relay_tables() -> set[tuple[str | None, str]]:
    """(schema, table) of each table the relay keeps in a database: the outbox table and its
    holders table (OUTBOX_TABLE in OUTBOX_SCHEMA), and, when Celery's broker is the database
    (``outboxdb+...``, docs/transport.md), the queue tables its workers use."""
    settings = get_settings()
    tables = {(settings.schema, settings.table), (settings.schema, holders_table_name(settings.table))}
    from ..transport import is_transport_url

    if is_transport_url(settings.broker_url):
        from ..transport.options import workers_transport_options
        from ..transport.tables.base import DEFAULT_QUEUE_TABLE, binding_table_name

        options = workers_transport_options()
        queue, schema = options.get("queue_table") or DEFAULT_QUEUE_TABLE, options.get("queue_schema")
        tables |= {(schema, queue), (schema, binding_table_name(queue))}
    return tables


def _relays(table: str | None, schema: str | None) -> bool:
    """Is ``table`` one of ``relay_tables``? A table autogenerate reports without a schema is
    in the default one, which is where a table of no OUTBOX_SCHEMA is."""
    return any(table == name and schema in (None, where) for where, name in relay_tables())


def include_name(name: str | None, type_: str, parent_names: dict[str, Any]) -> bool:
    """Alembic's ``include_name`` hook: False for the relay's tables (``relay_tables``), so
    autogenerate neither reflects them nor writes a revision that drops them."""
    if type_ == "table":
        return not _relays(name, parent_names.get("schema_name"))
    return True


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic's ``include_object`` hook: False for the relay's tables (``relay_tables``) and
    for their indexes, columns and constraints."""
    table = obj if type_ == "table" else getattr(obj, "table", None)
    return table is None or not _relays(table.name, table.schema)


__all__ = ["create_outbox_table", "include_name", "include_object", "relay_tables"]
