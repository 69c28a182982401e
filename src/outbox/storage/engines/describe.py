"""What the command line says about a database, per engine: its URL with the password
masked (every ``outbox`` command names the database it used), the package to install when
a driver is missing, and the indexes a table has (``outbox check``).

Kept apart from the engine classes because none of it is on the relay's hot path; it is
engine-specific, so it lives under ``outbox.storage.engines`` like everything else that is.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import replace
from typing import Any

from ...core.errors import install_hint
from ...core.redact import redact
from . import DRIVER_MODULES, kind_of_url, mssql_driver
from .base import Engine, IndexShape
from .mssql.schema import UNREADABLE_FILTER, nstr
from .mysql import MysqlEngine
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
    """The names of the indexes on the engine's table, read from the catalog, whatever their
    state (on PostgreSQL an INVALID one too, a CONCURRENTLY build or drop interrupted, which
    serves no query and `outbox migrate` builds again; docs/internals.md, "Index builds that
    hold no writer back"): ``index_shapes``' names."""
    return set(index_shapes(engine, cursor))


#: Per engine, the catalog's rows of the table's indexes, one per column: (index, unique,
#: method, predicate, column, position, descending, included, prefix length, state). PostgreSQL's
#: included columns come after its keys; its key column is written as its whole index definition
#: writes it (pg_get_indexdef's column alone gives the name only): a collation other than the
#: column's, an operator class other than the default, the direction and a NULLS order other than
#: the direction's (docs/operations.md, "Is it set up right? `outbox check`"). SQL Server's
#: filter_definition is NULL to a login without VIEW DEFINITION on the table (Microsoft's
#: sys.indexes reference), which the relay's needs not have: has_filter says there is one. The
#: state names an index the optimizer passes over (``IndexShape.state``): PostgreSQL's INVALID ones
#: (it read the valid ones only, and an INVALID one was "missing" to `outbox check` and unnamed in
#: `outbox migrate`'s report: found in review); SQL Server's disabled ones; MySQL's and MariaDB's,
#: whose catalogs name it in two columns, ``MysqlEngine.index_state_sql``.
INDEX_COLUMNS_SQL = {
    "postgresql": (
        "SELECT c.relname, i.indisunique, am.amname, pg_get_expr(i.indpred, i.indrelid, true), "
        "pg_get_indexdef(i.indexrelid, k, true) || CASE WHEN k <= i.indnkeyatts THEN "
        "CASE WHEN i.indcollation[k - 1] NOT IN (0, COALESCE(a.attcollation, 0)) "
        "THEN ' COLLATE ' || (SELECT quote_ident(collname) FROM pg_collation WHERE oid = i.indcollation[k - 1]) "
        "ELSE '' END "
        "|| CASE WHEN NOT o.opcdefault THEN ' ' || quote_ident(o.opcname) ELSE '' END "
        "|| CASE i.indoption[k - 1] & 3 WHEN 1 THEN ' DESC NULLS LAST' WHEN 2 THEN ' NULLS FIRST' "
        "WHEN 3 THEN ' DESC' ELSE '' END ELSE '' END, "
        "k, FALSE, k > i.indnkeyatts, NULL, CASE WHEN NOT i.indisvalid THEN 'INVALID' END "
        "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam "
        "CROSS JOIN generate_series(1, i.indnatts) AS k "
        "LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[k - 1] "
        "LEFT JOIN pg_opclass o ON o.oid = i.indclass[k - 1] WHERE i.indrelid = to_regclass(?) "
        "ORDER BY c.relname, k"),
    "mysql": (
        "SELECT index_name, non_unique = 0, index_type, NULL, column_name, seq_in_index, collation = 'D', 0, "
        "sub_part, {state} FROM information_schema.statistics WHERE table_name = ? AND table_schema = {schema} "
        "ORDER BY index_name, seq_in_index"),
    "mssql": (
        "SELECT i.name, i.is_unique, i.type_desc, CASE WHEN i.has_filter = 1 THEN COALESCE(i.filter_definition, "
        f"{nstr(UNREADABLE_FILTER)}) END, c.name, ic.key_ordinal, "
        "ic.is_descending_key, ic.is_included_column, NULL, CASE WHEN i.is_disabled = 1 THEN N'DISABLED' END "
        "FROM sys.indexes AS i "
        "INNER JOIN sys.index_columns AS ic ON ic.object_id = i.object_id AND ic.index_id = i.index_id "
        "INNER JOIN sys.columns AS c ON c.object_id = ic.object_id AND c.column_id = ic.column_id "
        "WHERE i.object_id = OBJECT_ID(?) AND i.name IS NOT NULL "
        "ORDER BY i.name, ic.is_included_column, ic.key_ordinal, ic.index_column_id"),
}


def shapes_of(rows: list[tuple[Any, ...]]) -> dict[str, IndexShape]:
    """``INDEX_COLUMNS_SQL``'s rows as one ``IndexShape`` per index, in their order."""
    columns: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        columns.setdefault(str(row[0]), []).append(row)
    shapes = {}
    for name, own in columns.items():
        _, unique, method, where, *_, state = own[0]
        keys = tuple(f"{column}" + (f"({prefix})" if prefix else "") + (" DESC" if desc else "")
                     for _, _, _, _, column, _, desc, included, prefix, _ in own if not included)
        include = tuple(str(column) for _, _, _, _, column, _, _, included, _, _ in own if included)
        shapes[name] = IndexShape(keys, unique=bool(unique), where=str(where) if where else None, include=include,
                                  method=str(method) if method else None, state=str(state) if state else None)
    return shapes


#: SQLite's tokens as its tokenizer reads a statement: blanks and comments, string literals,
#: quoted identifiers (its four quotings), words, any other character alone.
_SQLITE_TOKEN = re.compile(r"""(?P<blank>\s+|--[^\n]*|/\*.*?(?:\*/|$))|(?P<string>'(?:[^']|'')*'?)
    |(?P<quoted>"(?:[^"]|"")*"?|`(?:[^`]|``)*`?|\[[^\]]*\]?)|(?P<word>[\w$]+)|(?P<other>.)""",
                           re.VERBOSE | re.DOTALL)
#: A table constraint's first word, where a column's name would be (a column so named is quoted).
_TABLE_CONSTRAINTS = {"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN"}


def _sqlite_name(token: str) -> str:
    """An identifier or collation name as SQLite reads it: its quotes, if any, taken off."""
    if token[:1] == "[":
        return token[1:-1]
    if token[:1] in "\"`'":
        return token[1:-1].replace(token[0] * 2, token[0])
    return token


def sqlite_column_collations(table_sql: str) -> dict[str, str]:
    """Each column's declared collation, by its name in lower case, read from the table's CREATE
    text (``sqlite_master.sql``), BINARY where it declares none. SQLite has no pragma that says
    it: the text is read token by token, and a column's COLLATE is one outside any parenthesis
    of its definition, its last one as SQLite takes it. It was read up to the next comma after
    the column's name, which a COLLATE in a CHECK, a comment or another column's quoted name
    fooled, and a comma in a DEFAULT hid (docs/operations.md, "Is it set up right? `outbox check`")."""
    tokens = [(found.lastgroup, found.group()) for found in _SQLITE_TOKEN.finditer(table_sql)
              if found.lastgroup != "blank"]
    definitions: list[list[tuple[str | None, str]]] = []
    depth = 0
    for kind, text in tokens:
        if kind == "other" and text == "(":
            depth += 1
            if depth == 1:
                definitions.append([])
                continue
        elif kind == "other" and text == ")":
            depth -= 1
            if depth == 0:
                break
        elif kind == "other" and text == "," and depth == 1:
            definitions.append([])
            continue
        if depth >= 1:
            definitions[-1].append((kind if depth == 1 else None, text))  # None: inside a parenthesis
    collations = {}
    for definition in definitions:
        if not definition or (definition[0][0] == "word" and definition[0][1].upper() in _TABLE_CONSTRAINTS):
            continue
        collation = "BINARY"
        for (kind, text), (after, name) in zip(definition, definition[1:], strict=False):
            if kind == "word" and text.upper() == "COLLATE" and after is not None:
                collation = _sqlite_name(name)
        collations[_sqlite_name(definition[0][1]).lower()] = collation
    return collations


def sqlite_key(collations: dict[str, str], column: str | None, collation: str) -> str:
    """An SQLite index's key column as its definition writes it: `` COLLATE`` after one in another
    collation than the column's own (``collations``: ``sqlite_column_collations``), which the
    claim's lookups in the column's cannot use (docs/operations.md, "Is it set up right?
    `outbox check`")."""
    if column is None:
        return "(expression)"
    declared = collations.get(column.lower(), "BINARY")
    return column if collation.upper() == declared.upper() else f"{column} COLLATE {collation}"


def index_shapes(engine: Engine, cursor: Any) -> dict[str, IndexShape]:
    """The definitions of the indexes on the engine's table, read from the catalog, by name."""
    table, schema = engine.table_name, engine.schema
    if isinstance(engine, SqliteEngine):
        prefix, rows = engine.schema_prefix(), []
        made = engine.execute(cursor, f"SELECT sql FROM {engine.master()} WHERE type = 'table' AND name = ?",
                              [table]).fetchone()
        collations = sqlite_column_collations(str(made[0] if made else ""))
        for _, name, unique, _, partial in engine.execute(
                cursor, f"PRAGMA {prefix}index_list({engine.quote(table)})").fetchall():
            info = engine.execute(cursor, f"PRAGMA {prefix}index_xinfo({engine.quote(name)})").fetchall()
            where = None
            if partial:
                sql = engine.execute(cursor, f"SELECT sql FROM {engine.master()} WHERE type = 'index' AND name = ?",
                                     [name]).fetchone()
                found = re.search(r"\)\s*WHERE\s+(.*?)\s*;?\s*$", str(sql[0] if sql else ""), re.IGNORECASE | re.DOTALL)
                where = found.group(1) if found else "(unreadable)"
            rows += [(name, unique, None, where, sqlite_key(collations, column, collation), seq, desc, 0, None,
                      None) for seq, _, column, desc, collation, key in info if key]
        return shapes_of(rows)
    sql = INDEX_COLUMNS_SQL[engine.name]
    if engine.name == "postgresql":
        params = [engine.table]
    elif isinstance(engine, MysqlEngine):
        if engine.server_version is None:
            engine.read_server(cursor)
        params = [table, *([schema] if schema else [])]
        sql = sql.replace("{schema}", "?" if schema else "DATABASE()").replace("{state}", engine.index_state_sql())
    else:
        params = [f"{engine.quote(schema or 'dbo')}.{engine.quote(table)}"]
    return shapes_of(engine.execute(cursor, sql, params).fetchall())


def same_shape(engine: Engine, live: IndexShape, expected: IndexShape) -> bool:
    """Whether the index ``live`` is defined as ``expected``: keys in order, uniqueness,
    predicate (``Engine.same_predicate``), included columns (in any order), method, and usable
    (``IndexShape.state``: a disabled or ignored index serves no query, and `outbox migrate`
    makes it usable again)."""
    def lower(names: tuple[str, ...]) -> list[str]:
        return [name.lower() for name in names]

    return (lower(live.keys) == lower(expected.keys) and live.unique == expected.unique
            and engine.same_predicate(live.where, expected.where)
            and sorted(lower(live.include)) == sorted(lower(expected.include))
            and (expected.method is None or (live.method or "").lower() == expected.method.lower())
            and live.state == expected.state)


def index_differs(engine: Engine, cursor: Any, name: str) -> bool:
    """Whether the index ``name`` exists and is defined otherwise than ``Engine.expected_indexes``
    says (``same_shape``): what ``outbox migrate`` builds again (``base.IndexDiffers``) and
    ``outbox check`` fails on (``index_problems``)."""
    live = index_shapes(engine, cursor).get(name)
    return live is not None and not same_shape(engine, live, engine.expected_indexes()[name])


def index_problems(engine: Engine, cursor: Any) -> list[str]:
    """What is wrong with the indexes ``outbox migrate`` leaves, read from the catalog: each
    one missing, or defined otherwise than the migration
    defines it (``Engine.expected_indexes``), with the two definitions and, where the migration
    will not build it again itself, what to do first (``Engine.index_refusal``). Empty when all
    are right."""
    live = index_shapes(engine, cursor)
    problems = []
    for name, expected in sorted(engine.expected_indexes().items()):
        found = live.get(name)
        if found is None:
            problems.append(f"missing {name}")
        elif not same_shape(engine, found, expected):
            # One that differs in its state alone is made usable, never refused.
            usable_only = found.state is not None and same_shape(engine, replace(found, state=None), expected)
            refusal = None if usable_only else engine.index_refusal(cursor, name, found)
            problems.append(f"{name} is {found.text()}, not {expected.text()}" + (f" ({refusal})" if refusal else ""))
    return problems


def expected_index_names(engine: Engine) -> set[str]:
    """The indexes ``outbox migrate`` leaves on the engine's table (``Engine.index_suffixes``)."""
    return {engine.index_name(suffix) for suffix in engine.index_suffixes}


__all__ = ["describe_database", "missing_driver_hint", "driver_problem", "index_names", "expected_index_names",
           "index_shapes", "index_differs", "sqlite_column_collations", "index_problems", "shapes_of", "same_shape", "INDEX_COLUMNS_SQL", "DRIVER_EXTRAS"]
