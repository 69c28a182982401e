"""The outbox table on a Django connection, with the relay's own DDL.

The Django migration calls ``create_table``: it runs the same guarded statements as
``outbox migrate`` (``outbox.storage.store.apply_migration``) on the connection being migrated, so
the table, its JSON checks and its filtered indexes are identical whichever created them,
and ``outbox migrate`` afterwards finds nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from ...core.config import get_settings, load_settings
from ...storage.engines import DJANGO_VENDORS, Engine, engine_class, unwrap_connection
from ...storage.store import OutboxStore, apply_migration, apply_online_migration, online_migration_lock


def engine_for(connection: Any) -> tuple[Engine, Any]:
    """(the outbox engine, the raw DB-API connection) of a Django connection."""
    kind, raw = unwrap_connection(connection)
    settings = get_settings()
    return engine_class(kind)(table=settings.table, schema=settings.schema), raw


def create_table(connection: Any) -> None:
    """The relay's migration on a Django connection. The app's migrations are not atomic
    (MySQL commits DDL on its own), so Django runs this in autocommit: where the migration
    lock lasts only as long as a transaction (PostgreSQL), the steps run in one, or two
    replicas' ``migrate`` at once both made the table and one failed (found in review)."""
    from django.db import transaction

    engine, raw = engine_for(connection)
    # PostgreSQL: the indexes of a table holding rows are built CONCURRENTLY after the steps'
    # transaction, in autocommit as 0004 runs (atomic = False), holding no enqueue back
    # (docs/internals.md, "Index builds that hold no writer back"); inside a transaction of the
    # caller's, every step in it, as before.
    online = engine.online_migration()
    if online is not None and not connection.get_autocommit():
        online = None
    one = engine.migration_in_transaction and connection.get_autocommit()
    # SQLite: BEGIN IMMEDIATE (own_transaction), not Django's deferred BEGIN, whose first
    # write fails at once when a relay committed after its reads; one writer lock throughout,
    # as ``outbox migrate`` holds it, so a relay never sees claim_ready dropped and not yet
    # made again (Engine.migration_under_writer_lock).
    whole = (transaction.atomic(using=connection.alias) if one
             else engine.own_transaction(raw) if engine.migration_under_writer_lock and connection.get_autocommit()
             else nullcontext())
    @contextmanager
    def raw_cursor() -> Iterator[Any]:  # outside the atomic block: autocommit, no transaction open
        cursor = engine.cursor_for(raw)
        try:
            yield cursor
        finally:
            cursor.close()

    with online_migration_lock(engine, raw_cursor) if online else nullcontext():
        with whole, raw_cursor() as cursor:
            apply_migration(engine, cursor, steps=online[0] if online else None)
        if online:
            with raw_cursor() as cursor:
                apply_online_migration(engine, cursor, online[1])


def run_relay_ddl(apps: Any, schema_editor: Any) -> None:
    """The app's migrations' one operation on the table (0001 to 0004: ``RunPython``):
    ``create_table`` on the migration's connection, which leaves what exists alone."""
    create_table(schema_editor.connection)


def store_on(connection: Any, atomic: Callable[[], AbstractContextManager[Any]]) -> OutboxStore:
    """The relay's store on a Django connection (the admin's requeue action): each of the
    store's transactions is ``atomic()`` there (``transaction.atomic``, a savepoint inside
    a transaction already open), on the raw DB-API connection with the engine's own cursor,
    what the connection's server offers probed first (``Engine.read_server``). The same
    store calls as the command line's, so the same rules."""
    engine, _ = engine_for(connection)
    probed: list[bool] = []

    @contextmanager
    def begin() -> Iterator[Any]:
        with atomic():
            cursor = engine.cursor_for(unwrap_connection(connection)[1])
            try:
                if not probed:
                    engine.read_server(cursor)
                    probed.append(True)
                yield cursor
            finally:
                cursor.close()
    return OutboxStore.on_caller(engine, begin)


#: How each backend's ``quote_name`` delimits a name. It leaves alone a name already
#: delimited at both ends, so ``schema"."table`` comes out whole as ``"schema"."table"``.
_DELIMITERS = {"postgresql": ('"', '"'), "sqlite": ('"', '"'), "mysql": ("`", "`"), "mssql": ("[", "]")}


def default_vendor() -> str:
    """The ``vendor`` of the default database's backend, read from its class: no connection
    is made. Empty when the backend does not import (its driver missing: nothing in this
    process can query that database anyway)."""
    from django.conf import settings as django
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DEFAULT_DB_ALIAS
    from django.db.utils import load_backend

    try:
        return str(load_backend(django.DATABASES[DEFAULT_DB_ALIAS]["ENGINE"]).DatabaseWrapper.vendor)
    except (KeyError, ImproperlyConfigured):
        return ""


def model_table(vendor: str | None = None) -> str:
    """The model's ``db_table`` on a backend of ``vendor`` (the default database's): the
    table where the relay's engine has it, OUTBOX_SCHEMA's (SQL Server: ``dbo`` unless set)
    included, as the migration, ``enqueue`` and the admin's requeue name it (docs/django.md,
    "Admin"). Read without caching the settings: models.py asks at import time, before
    Django's test runner has switched DATABASES to the test database, and the cached
    settings would keep the database URL of that moment."""
    settings = load_settings()
    kind = DJANGO_VENDORS.get(default_vendor() if vendor is None else vendor)
    if kind is None:
        return settings.table
    schema = settings.schema or engine_class(kind).default_schema
    if not schema or (kind == "sqlite" and schema == "main"):
        return settings.table
    opening, closing = _DELIMITERS[kind]
    return f"{schema}{closing}.{opening}{settings.table}"
