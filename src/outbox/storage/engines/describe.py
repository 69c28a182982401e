"""What the command line says about a database, per engine: its URL with the password
masked (every ``outbox`` command names the database it used), the package to install when
a driver is missing, and the indexes a table has (``outbox check``).

Kept apart from the engine classes because none of it is on the relay's hot path; it is
engine-specific, so it lives under ``outbox.storage.engines`` like everything else that is.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ...core.errors import install_hint
from ...core.redact import redact
from . import DRIVER_MODULES, kind_of_url, mssql_driver
from .base import Engine
from .sqlite import SqliteEngine

#: Driver module -> (engine, the extra that installs it).
DRIVER_EXTRAS = {"psycopg": ("PostgreSQL", "postgres"), "pymysql": ("MySQL/MariaDB", "mysql"),
                 "pyodbc": ("SQL Server", "mssql"), "mssql_python": ("SQL Server", "mssql-python")}

def describe_database(url: str) -> str:
    """One phrase naming the database: the masked URL, and for SQLite the absolute path
    of the file (a relative ``sqlite:///outbox.db`` depends on the current directory)."""
    text = redact(url)
    if kind_of_url(url) == "sqlite":
        from .sqlite import sqlite_path

        path = sqlite_path(url)
        if path != ":memory:":
            text += f" (file {os.path.abspath(path)})"
    return text


def missing_driver_hint(exc: BaseException) -> str | None:
    """For an ImportError of a database driver: what to install, in one line."""
    if not isinstance(exc, ImportError):
        return None
    module = (getattr(exc, "name", None) or "").split(".", 1)[0]
    # Checked first: pyodbc is installed but cannot load the system's ODBC driver manager,
    # which no pip install fixes.
    if "libodbc" in str(exc):
        return ("pyodbc is installed but cannot load libodbc (unixODBC): install the system's unixodbc "
                "(Debian/Ubuntu: apt-get install unixodbc) and an ODBC driver for SQL Server (Microsoft's "
                "ODBC Driver 18, or FreeTDS's tdsodbc with TDS_Version=7.4); "
                "or use mssql+mssqlpython://, which bundles its driver")
    if module in DRIVER_EXTRAS:
        engine, extra = DRIVER_EXTRAS[module]
        return f"the {engine} driver ({module}) is not installed: {install_hint(extra)}"
    return None


def driver_problem(url: str) -> str | None:
    """What to install when the driver the engine of ``url`` connects with cannot be imported
    (``missing_driver_hint``), else None. A relay worker checks it as it starts: it ran, and
    said "database unreachable: ModuleNotFoundError" at every tick (docs/relay.md,
    "Configuration checks")."""
    kind = kind_of_url(url)
    module = mssql_driver(url) if kind == "mssql" else DRIVER_MODULES[kind]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return missing_driver_hint(exc) or f"the driver {module} cannot be imported: {exc}"
    return None


def index_names(engine: Engine, cursor: Any) -> set[str]:
    """The names of the indexes on the engine's table, read from the catalog (on PostgreSQL
    the valid ones)."""
    table, schema = engine.table_name, engine.schema
    if isinstance(engine, SqliteEngine):
        rows = cursor.execute(f"PRAGMA {engine.schema_prefix()}index_list({engine.quote(table)})").fetchall()
        return {str(r[1]) for r in rows}
    if engine.name == "postgresql":
        # Valid ones only: an INVALID index (a CONCURRENTLY build or drop interrupted) serves no
        # query, and `outbox migrate` builds it again (docs/internals.md, "Index builds that
        # hold no writer back"); `outbox check` said ok over it (found in review).
        engine.execute(cursor, "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                       "WHERE i.indrelid = to_regclass(?) AND i.indisvalid", [engine.table])
    elif engine.name == "mysql":
        engine.execute(cursor, "SELECT DISTINCT index_name FROM information_schema.statistics WHERE table_name = ? "
                       "AND table_schema = " + ("?" if schema else "DATABASE()"), [table, *([schema] if schema else [])])
    elif engine.name == "mssql":
        engine.execute(cursor, "SELECT i.name FROM sys.indexes i WHERE i.object_id = OBJECT_ID(?) AND i.name IS NOT NULL",
                       [f"{engine.quote(schema or 'dbo')}.{engine.quote(table)}"])
    else:  # pragma: no cover - every engine is listed above
        raise ValueError(f"no index catalog query for {engine.name}")
    return {str(r[0]) for r in cursor.fetchall()}


def expected_index_names(engine: Engine) -> set[str]:
    """The indexes ``outbox migrate`` leaves on the engine's table (``Engine.index_suffixes``)."""
    return {engine.index_name(suffix) for suffix in engine.index_suffixes}


__all__ = ["describe_database", "missing_driver_hint", "driver_problem", "index_names", "expected_index_names",
           "DRIVER_EXTRAS"]
