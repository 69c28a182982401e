"""`outbox check` compares each index `outbox migrate` leaves by its definition, not its name
(docs/operations.md, "Is it set up right? `outbox check`"). It compared the names only: on
PostgreSQL a ``claim_ready`` on ``(id)``, the shape before the claim stopped reading rows that
wait for a later time, passed the check while every claim ran without the index it needs
(found in review, 7 December). Each real engine gets an earlier release's shape made by hand;
SQL Server's catalog query is parsed with sqlglot's T-SQL dialect and its rows, as the catalog
writes them, are compared."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import drop_table
from fake_dbapi import RecordingConnection, RecordingCursor
from services import MYSQL_URL, POSTGRES_URL, require
from tsql_support import parse_one

from outbox.commands.doctor import FAIL, OK, check_database
from outbox.core.config import load_settings
from outbox.core.errors import EnqueueError, StoreError
from outbox.storage.engines.describe import INDEX_COLUMNS_SQL, index_problems, same_shape, shapes_of
from outbox.storage.engines.mssql.engine import MssqlEngine
from outbox.storage.engines.mssql.schema import DISABLED_CLUSTERED_SQL, INDEXES, unreadable_problem
from outbox.storage.engines.mysql import MysqlEngine
from outbox.storage.store import OutboxStore


def indexes_line(store: OutboxStore) -> tuple[str, str]:
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": store.url, "OUTBOX_TABLE": store.engine.table_name})
    (result,) = [r for r in check_database(settings) if r.name == "indexes"]
    return result.state, result.detail


def cli(store: OutboxStore, command: str, cwd: Path) -> str:
    """``outbox <command>``'s output, run as an operator runs it, on ``store``'s table."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    done = subprocess.run([sys.executable, "-m", "outbox.cli", command], capture_output=True, text=True, cwd=cwd,
                          env={**clean, "OUTBOX_DATABASE_URL": store.url, "OUTBOX_TABLE": store.engine.table_name},
                          timeout=120)
    assert done.returncode == (1 if command == "check" and "[FAIL]" in done.stdout else 0), done
    return done.stdout


def raw(store: OutboxStore, *statements: str) -> None:
    """``statements`` on a connection of their own, committed."""
    conn = store.engine.connect(store.url)
    try:
        cursor = conn.cursor()
        for statement in statements:
            cursor.execute(statement)
        conn.commit()
    finally:
        conn.close()


@pytest.fixture
def table() -> str:
    return f"outbox_ix{uuid.uuid4().hex[:10]}"


def migrated(server: str, port: int, url: str, table: str) -> Iterator[OutboxStore]:
    """A migrated table of its own on ``url``, dropped afterwards."""
    require(server, "127.0.0.1", port)
    store = OutboxStore(url, table=table)
    store.migrate()
    try:
        yield store
    finally:
        drop_table(store)
        store.close()


@pytest.fixture
def postgres(table: str) -> Iterator[OutboxStore]:
    yield from migrated("PostgreSQL", 5432, POSTGRES_URL, table)


@pytest.fixture
def mysql(table: str) -> Iterator[OutboxStore]:
    yield from migrated("MariaDB/MySQL", 3306, MYSQL_URL, table)


def test_check_fails_on_postgresqls_claim_ready_of_an_earlier_release_until_migrate(postgres: OutboxStore,
                                                                                   tmp_path: Path) -> None:
    """The shape releases before 7 December made, through the command line as an operator runs it."""
    e = postgres.engine
    name = e.index_name("claim_ready")
    raw(postgres, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON {e.table} (id) WHERE processed_at IS NULL')
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    report = subprocess.run([sys.executable, "-m", "outbox.cli", "check"], capture_output=True, text=True, cwd=tmp_path,
                            env={**clean, "OUTBOX_DATABASE_URL": postgres.url, "OUTBOX_TABLE": e.table_name},
                            timeout=120)
    line = next(line for line in report.stdout.splitlines() if line.startswith("[FAIL] indexes"))
    assert f"{name} is (id) WHERE processed_at IS NULL USING btree, not (next_retry_at, id)" in line, line
    assert "run `outbox migrate`" in line, line
    postgres.migrate()
    assert indexes_line(postgres)[0] == OK


@pytest.mark.parametrize(("ddl", "wrong"), [
    ("CREATE INDEX \"{name}\" ON {table} (next_retry_at, id) WHERE status IN (0, 1, 3)", "WHERE status = ANY (ARRAY[0, 1, 3])"),
    ("CREATE INDEX \"{name}\" ON {table} (next_retry_at DESC, id) WHERE processed_at IS NULL", "next_retry_at DESC"),
    ("CREATE INDEX \"{name}\" ON {table} (next_retry_at, id) INCLUDE (status) WHERE processed_at IS NULL",
     "INCLUDE (status)"),
    ("CREATE UNIQUE INDEX \"{name}\" ON {table} (next_retry_at, id) WHERE processed_at IS NULL", "UNIQUE"),
])
def test_check_compares_postgresqls_predicate_order_and_included_columns(postgres: OutboxStore, ddl: str,
                                                                         wrong: str) -> None:
    """The first: claim_ready of the first release, on the status test; the others by hand, which
    `outbox migrate` builds again too (it rebuilt only an index on other columns, or on the status
    test): on an empty table in its transaction, on one holding rows online (``good`` in
    ``PostgresEngine._online_index_steps``)."""
    e = postgres.engine
    name = e.index_name("claim_ready")
    for rows in (0, 100):
        raw(postgres, f"INSERT INTO {e.table} (message_id, topic, aggregate_type, aggregate_id, payload) "
                      f"SELECT 'm' || g, 't', 'a', 'x', '{{}}'::jsonb FROM generate_series(1, {rows}) g",
            f'DROP INDEX "{name}"', ddl.format(name=name, table=e.table))
        state, detail = indexes_line(postgres)
        assert state == FAIL and f"{name} is " in detail and wrong in detail, detail
        assert postgres.migrate() > 0
        assert indexes_line(postgres)[0] == OK


@pytest.mark.parametrize("rows", [0, 100], ids=["empty", "rows"])
@pytest.mark.parametrize(("suffix", "keys"), [
    ("agg_id_id", 'aggregate_id COLLATE "C", id'),
    ("agg_id_id", "aggregate_id varchar_pattern_ops, id"),
    ("claim_ready", "next_retry_at NULLS FIRST, id"),
    ("claim_ready", "next_retry_at DESC NULLS LAST, id"),
])
def test_check_compares_postgresqls_collation_operator_class_and_nulls_order(postgres: OutboxStore, suffix: str,
                                                                           keys: str, rows: int, tmp_path: Path) -> None:
    """A key column in another collation, operator class or NULLS order than the migration's
    (which takes the column's own and the defaults) passed `outbox check` (it read the column's
    name alone), while `outbox migrate`'s probe, pg_get_indexdef's whole text, built the index
    again: the two disagreed. Under another collation the claim's head probes (``free``,
    ``ready``: ``e.aggregate_id = h.aggregate_id``, in the column's collation) cannot use
    ``agg_id_id`` at all; under NULLS FIRST the window's walk (``ORDER BY next_retry_at, id``)
    cannot follow ``claim_ready``'s order (docs/operations.md, "Is it set up right? `outbox
    check`"). The check now names them, as pg_get_indexdef writes them, and the migration's
    rebuild leaves it ok."""
    e = postgres.engine
    name = e.index_name(suffix)
    where = e.expected_indexes()[name].where
    raw(postgres, *(f"INSERT INTO {e.table} (message_id, topic, aggregate_type, aggregate_id, payload) "
                    f"VALUES ('m{n}', 't', 'a', 'x{n % 5}', '{{}}')" for n in range(rows)),
        f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON {e.table} ({keys}) WHERE {where}')
    line = next(line for line in cli(postgres, "check", tmp_path).splitlines() if line.startswith("[FAIL] indexes"))
    assert f"{name} is ({keys}) WHERE {where} USING btree, not " in line, line
    assert f"rebuilt {name}" in cli(postgres, "migrate", tmp_path)
    assert "[ok  ] indexes" in cli(postgres, "check", tmp_path)
    assert cli(postgres, "migrate", tmp_path).strip().endswith("nothing to change")


def test_check_fails_on_mariadbs_indexes_of_an_earlier_release_until_migrate(mysql: OutboxStore) -> None:
    """claim_ready on (status, id) and agg_id_id on (aggregate_id, id): MariaDB's before the claim
    stopped reading rows that wait for a later time."""
    e = mysql.engine
    claim, agg = e.index_name("claim_ready"), e.index_name("agg_id_id")
    raw(mysql, f"ALTER TABLE {e.table} DROP INDEX `{claim}`, ADD INDEX `{claim}` (status, id), "
               f"DROP INDEX `{agg}`, ADD INDEX `{agg}` (aggregate_id, id)")
    state, detail = indexes_line(mysql)
    assert state == FAIL, detail
    assert f"{claim} is (status, id) USING BTREE, not (status, next_retry_at, id)" in detail, detail
    assert f"{agg} is (aggregate_id, id) USING BTREE, not (aggregate_id, status, id)" in detail, detail
    mysql.migrate()
    assert indexes_line(mysql)[0] == OK


def test_mariadbs_migrate_report_names_the_indexes_it_rebuilt(mysql: OutboxStore, tmp_path: Path) -> None:
    """MariaDB's report said `repaired` alone over the two indexes it rebuilt (PostgreSQL's
    named them): it names them now, read as `outbox check` reads them (found in review)."""
    e = mysql.engine
    claim, agg = e.index_name("claim_ready"), e.index_name("agg_id_id")
    raw(mysql, f"ALTER TABLE {e.table} DROP INDEX `{claim}`, ADD INDEX `{claim}` (status, id), "
               f"DROP INDEX `{agg}`, ADD INDEX `{agg}` (aggregate_id, id)")
    report = cli(mysql, "migrate", tmp_path)
    assert f"repaired (rebuilt {agg}, {claim})" in report, report
    assert cli(mysql, "migrate", tmp_path).strip().endswith("nothing to change")


def test_check_fails_on_a_mariadb_column_compared_case_insensitively_and_names_the_statement(
        mysql: OutboxStore, tmp_path: Path) -> None:
    """message_id and aggregate_id altered by hand to utf8mb4_general_ci: the enqueue of 'ABC'
    after 'abc' was taken for a duplicate and dropped (the same id handed back), and `outbox
    check` said ok (found in review). It fails naming each column, its collation and the
    migration's, and the statement that converts them, online (docs/operations.md, "Is it set up
    right? `outbox check`"); after it the two ids are two events."""
    from outbox import enqueue

    e = mysql.engine
    raw(mysql, f"ALTER TABLE {e.table} MODIFY message_id VARCHAR(64) CHARACTER SET utf8mb4 COLLATE "
               "utf8mb4_general_ci NOT NULL, MODIFY aggregate_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE "
               "utf8mb4_general_ci NULL")

    def enqueued(message_id: str) -> int:
        conn = e.connect(mysql.url)
        try:
            made = enqueue(conn, topic="t", aggregate_type="o", aggregate_id=message_id, message_id=message_id,
                           payload={}, table=e.table_name)
            conn.commit()
            return made
        finally:
            conn.close()

    first = enqueued("abc")
    # The second event matched the first in the column's collation: it was dropped as a
    # duplicate of it (the same id handed back); enqueue now refuses it, writing nothing.
    with pytest.raises(EnqueueError, match="message id 'ABC' matched the stored 'abc'.*outbox check"):
        enqueued("ABC")
    assert enqueued("abc") == first  # the same event again is still its duplicate
    line = next(line for line in cli(mysql, "check", tmp_path).splitlines() if line.startswith("[FAIL] table"))
    assert ("columns message_id in utf8mb4_general_ci, aggregate_id in utf8mb4_general_ci, not utf8mb4_bin"
            in line), line
    statement = (f"ALTER TABLE {e.table} MODIFY `message_id` varchar(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
                 "NOT NULL, MODIFY `aggregate_id` varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL, "
                 "ALGORITHM=INPLACE, LOCK=NONE")
    assert statement in line, line
    assert "[ok  ] indexes" in cli(mysql, "check", tmp_path)  # the rest of the report goes on
    # migrate does not convert the columns, and says so with the same statement (it said
    # "nothing to change" alone while check failed).
    report = cli(mysql, "migrate", tmp_path).splitlines()
    assert report[0].endswith("nothing to change") and report[1].startswith(f"left as it is: {e.table}: columns")
    assert statement in report[1], report
    raw(mysql, statement)
    assert "[ok  ] table" in cli(mysql, "check", tmp_path)
    assert len(cli(mysql, "migrate", tmp_path).splitlines()) == 1
    assert enqueued("ABC") != enqueued("abc")


def test_sqlites_migrate_report_names_the_index_it_rebuilt(sqlite_store: OutboxStore, tmp_path: Path) -> None:
    store = sqlite_store
    name = store.engine.index_name("claim_ready")
    raw(store, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON outbox (id) WHERE status IN (0, 1, 3)')
    report = cli(store, "migrate", tmp_path)
    assert f"repaired (rebuilt {name})" in report, report


def test_check_fails_on_a_mariadb_message_id_that_is_not_unique(mysql: OutboxStore) -> None:
    e = mysql.engine
    name = e.index_name("message_id")
    raw(mysql, f"ALTER TABLE {e.table} DROP INDEX `{name}`, ADD INDEX `{name}` (message_id)")
    state, detail = indexes_line(mysql)
    assert state == FAIL and f"{name} is (message_id) USING BTREE, not UNIQUE (message_id)" in detail, detail


def test_check_fails_on_sqlites_claim_ready_of_an_earlier_release_until_migrate(sqlite_store: OutboxStore) -> None:
    store = sqlite_store
    name = store.engine.index_name("claim_ready")
    raw(store, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON outbox (id) WHERE status IN (0, 1, 3)')
    state, detail = indexes_line(store)
    assert state == FAIL and f"{name} is (id) WHERE status IN (0, 1, 3), not (next_retry_at, id)" in detail, detail
    store.migrate()
    assert indexes_line(store) == (OK, ", ".join(sorted(store.engine.expected_indexes())))


def test_sqlites_partial_indexes_are_told_from_whole_ones(sqlite_store: OutboxStore) -> None:
    name = sqlite_store.engine.index_name("agg_id_id")
    raw(sqlite_store, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON outbox (aggregate_id, id)')
    state, detail = indexes_line(sqlite_store)
    assert state == FAIL and f"{name} is (aggregate_id, id), not (aggregate_id, id) WHERE status IN" in detail, detail


def test_check_compares_sqlites_key_collation_and_migrate_builds_it_again(tmp_path: Path) -> None:
    """An index key in another collation than its column's (``aggregate_id COLLATE NOCASE``)
    passed `outbox check`, and `outbox migrate` (which asks the check's comparison) kept it,
    although SQLite's claim lookups (``aggregate_id = ?``, the column's BINARY) cannot use it
    (docs/operations.md, "Is it set up right? `outbox check`"). A table whose column is declared
    in that collation keeps it: its index takes the column's, as the migration builds it."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url)
    store.migrate()
    e = store.engine
    name = e.index_name("agg_id_id")
    raw(store, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON outbox (aggregate_id COLLATE NOCASE, id) '
                                       "WHERE status IN (0, 1, 3)")
    line = next(line for line in cli(store, "check", tmp_path).splitlines() if line.startswith("[FAIL] indexes"))
    assert f"{name} is (aggregate_id COLLATE NOCASE, id) WHERE status IN (0, 1, 3), not (aggregate_id, id)" in line, line
    assert f"repaired (rebuilt {name})" in cli(store, "migrate", tmp_path)
    assert "[ok  ] indexes" in cli(store, "check", tmp_path)
    redeclare_aggregate_id(tmp_path, "aggregate_id TEXT NOT NULL COLLATE NOCASE")
    migrate_then_check_is_stable(store, tmp_path)


def redeclare_aggregate_id(tmp_path: Path, declared: str) -> None:
    """Make the SQLite table of ``tmp_path/o.db`` again, its aggregate_id column declared so."""
    conn = sqlite3.connect(tmp_path / "o.db")
    try:
        table = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'outbox'").fetchone()[0]
        assert "aggregate_id TEXT NOT NULL," in table
        conn.executescript("DROP TABLE outbox; " + table.replace("aggregate_id TEXT NOT NULL,", declared + ",") + ";")
    finally:
        conn.close()


def migrate_then_check_is_stable(store: OutboxStore, tmp_path: Path) -> None:
    """`outbox migrate` leaves the indexes as `outbox check` wants them, and a second one changes nothing."""
    cli(store, "migrate", tmp_path)
    assert "[ok  ] indexes" in cli(store, "check", tmp_path)
    assert cli(store, "migrate", tmp_path).strip().endswith("nothing to change")
    store.close()


@pytest.mark.parametrize("declared", [
    # The column is BINARY; a COLLATE inside its CHECK was read as the column's.
    "aggregate_id TEXT NOT NULL CHECK (aggregate_id <> '' COLLATE NOCASE)",
    # The column is NOCASE; the comma inside its DEFAULT stopped the read before its COLLATE.
    "aggregate_id TEXT NOT NULL DEFAULT (substr('ab', 1, 1)) COLLATE NOCASE",
    # A quoted name holding a comma and the column's name, the column itself BINARY.
    "\"x, aggregate_id\" TEXT NULL COLLATE NOCASE, aggregate_id TEXT NOT NULL",
    # A comment: the column is BINARY.
    "aggregate_id TEXT NOT NULL -- not COLLATE NOCASE, once\n",
])
def test_sqlites_column_collation_is_read_from_the_columns_own_definition(tmp_path: Path, declared: str) -> None:
    """The column's collation was read from the table's text up to the next comma after its name
    (a regular expression): a COLLATE in its CHECK, a comment or another column's quoted name was
    taken for its own, and a comma in its DEFAULT hid it. The migration's own index on it then
    failed `outbox check` and was built again by every `outbox migrate` (found in review). The
    text is read token by token now (``describe.sqlite_column_collations``)."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url)
    store.migrate()
    redeclare_aggregate_id(tmp_path, declared)
    migrate_then_check_is_stable(store, tmp_path)


@pytest.mark.parametrize("columns", [
    "a TEXT COLLATE NOCASE COLLATE RTRIM, b TEXT CONSTRAINT named COLLATE \"nocase\", [c d] TEXT COLLATE [RTRIM]",
    "a TEXT DEFAULT (substr('x,(y', 1, 1)) COLLATE NOCASE, b TEXT CHECK (b <> ')' COLLATE NOCASE), c TEXT",
    "\"a, b\" TEXT COLLATE RTRIM, b TEXT /* COLLATE NOCASE, */ NOT NULL, `c``d` TEXT COLLATE NOCASE",
    "a TEXT, b TEXT AS (a || ',' COLLATE NOCASE), c INTEGER, CONSTRAINT k CHECK (c > 0), UNIQUE (a COLLATE NOCASE)",
])
def test_sqlites_column_collations_read_as_sqlite_reads_them(columns: str) -> None:
    """``sqlite_column_collations`` against SQLite's own answer: the collation of an index made on
    each column without one of its own (``PRAGMA index_xinfo``)."""
    from outbox.storage.engines.describe import sqlite_column_collations

    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(f'CREATE TABLE "t(" ({columns})')
        table = conn.execute("SELECT sql FROM sqlite_master WHERE name = 't('").fetchone()[0]
        names = [row[1] for row in conn.execute("PRAGMA table_xinfo(\"t(\")")]
        expected = {}
        for n, name in enumerate(names):
            quoted = '"' + name.replace('"', '""') + '"'
            conn.execute(f'CREATE INDEX i{n} ON "t(" ({quoted})')
            expected[name.lower()] = conn.execute(f"PRAGMA index_xinfo(i{n})").fetchone()[4]
        assert {k: v.upper() for k, v in sqlite_column_collations(table).items()} == \
            {k: v.upper() for k, v in expected.items()}, table
    finally:
        conn.close()


def sql_server_rows(engine: MssqlEngine, claim_ready_include: tuple[str, ...]) -> list[tuple]:
    """The rows SQL Server's catalog gives ``INDEX_COLUMNS_SQL['mssql']`` for a migrated table, as
    it writes them (a filter in brackets and ORs), ``claim_ready`` with ``claim_ready_include``."""
    rows: list[tuple] = []
    for spec in INDEXES:
        name = engine.index_name(spec.suffix)
        where = "([status]=(0) OR [status]=(1) OR [status]=(3))" if spec.filtered else None
        include = claim_ready_include if spec.suffix == "claim_ready" else spec.include
        rows += [(name, spec.unique, "NONCLUSTERED", where, key, n, False, False, None, None)
                 for n, key in enumerate(spec.keys, 1)]
        rows += [(name, spec.unique, "NONCLUSTERED", where, column, 0, False, True, None, None) for column in include]
    return rows


def test_sql_servers_index_catalog_query_parses_and_its_rows_compare(no_sqlglot_fallbacks: None) -> None:
    """No SQL Server runs here: the query parses as T-SQL, and rows as the catalog writes them
    match the migration's definitions; ``claim_ready`` without its included columns (an index
    made by hand, or another tool) does not."""
    parse_one(INDEX_COLUMNS_SQL["mssql"].replace("?", "N'[dbo].[outbox]'"))
    engine = MssqlEngine()
    expected = engine.expected_indexes()
    spec = next(spec for spec in INDEXES if spec.suffix == "claim_ready")
    live = shapes_of(sql_server_rows(engine, spec.include))
    assert live.keys() == expected.keys()
    assert all(same_shape(engine, live[name], expected[name]) for name in expected)
    short = shapes_of(sql_server_rows(engine, ("aggregate_id",)))
    claim = engine.index_name("claim_ready")
    assert not same_shape(engine, short[claim], expected[claim])
    assert short[claim].text() == (f"({', '.join(spec.keys)}) INCLUDE (aggregate_id) "
                                   "WHERE ([status]=(0) OR [status]=(1) OR [status]=(3)) USING NONCLUSTERED")


def test_the_catalog_queries_of_postgresql_and_mariadb_run(postgres: OutboxStore, mysql: OutboxStore) -> None:
    """A migrated table's indexes are all as the migration defines them, on both."""
    for store in (postgres, mysql):
        assert indexes_line(store)[0] == OK, store


def sql_server_catalog(engine: MssqlEngine, *, readable_filters: bool = True, unfiltered: str = "",
                       kinds: dict[str, str] | None = None, disabled: str = "",
                       primary_key_disabled: bool = False,
                       constraints: dict[str, str] | None = None) -> sqlite3.Connection:
    """A fake SQL Server catalog (``sys.indexes``, ``sys.index_columns``, ``sys.columns``) in
    SQLite, holding a migrated table's indexes as SQL Server keeps them: each filter's text as
    the catalog writes it, or NULL where the login may not read it (``readable_filters``
    False: a login with the table's SELECT, INSERT, UPDATE, DELETE and no VIEW DEFINITION), the
    index of suffix ``unfiltered`` made without its filter, those of ``kinds``' suffixes of that
    kind (``type_desc``: CLUSTERED, ...), that of suffix ``disabled`` disabled. Its clustered primary key
    ``pk_<table>`` on id, disabled with ``primary_key_disabled``, and every other index with it, as SQL
    Server disables them. Those of ``constraints``' suffixes enforce a constraint of that kind
    (PRIMARY KEY, UNIQUE: unique, ``is_primary_key``/``is_unique_constraint``). It runs T-SQL text (``on_catalog``): OBJECT_ID gives
    the table's id, SERVERPROPERTY('EngineEdition') Standard's (2)."""
    conn = sqlite3.connect(":memory:")
    conn.create_function("OBJECT_ID", -1, lambda *name: 1)
    conn.create_function("SERVERPROPERTY", 1, lambda name: 2)
    conn.execute("ATTACH ':memory:' AS sys")
    conn.executescript(
        "CREATE TABLE sys.indexes (object_id, index_id, name, is_unique, type_desc, has_filter, filter_definition, "
        "is_disabled, is_primary_key DEFAULT 0, is_unique_constraint DEFAULT 0);"
        "CREATE TABLE sys.index_columns (object_id, index_id, index_column_id, column_id, key_ordinal, "
        "is_descending_key, is_included_column);"
        "CREATE TABLE sys.columns (object_id, column_id, name);"
        "CREATE TABLE sys.foreign_keys (name, parent_object_id, referenced_object_id, is_disabled);")
    conn.create_function("OBJECT_SCHEMA_NAME", 1, lambda object_id: "dbo")
    conn.create_function("OBJECT_NAME", 1, lambda object_id: engine.table_name if object_id == 1 else f"table_{object_id}")
    columns: dict[str, int] = {"id": 1}
    conn.execute("INSERT INTO sys.indexes VALUES (1, 1, ?, 1, 'CLUSTERED', 0, NULL, ?, 1, 0)",
                 [f"pk_{engine.table_name}", primary_key_disabled])
    conn.execute("INSERT INTO sys.index_columns VALUES (1, 1, 1, 1, 1, 0, 0)")
    for index_id, spec in enumerate(INDEXES, 2):
        filtered = spec.filtered and spec.suffix != unfiltered
        text = "([status]=(0) OR [status]=(1) OR [status]=(3))" if filtered and readable_filters else None
        constraint = (constraints or {}).get(spec.suffix)
        conn.execute("INSERT INTO sys.indexes VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     [index_id, engine.index_name(spec.suffix), spec.unique or constraint is not None,
                      (kinds or {}).get(spec.suffix, "NONCLUSTERED"), filtered, text,
                      spec.suffix == disabled or primary_key_disabled, constraint == "PRIMARY KEY",
                      constraint == "UNIQUE"])
        for n, (column, ordinal) in enumerate([*((k, i) for i, k in enumerate(spec.keys, 1)),
                                               *((c, 0) for c in spec.include)], 1):
            column_id = columns.setdefault(column, len(columns) + 1)
            conn.execute("INSERT INTO sys.index_columns VALUES (1, ?, ?, ?, ?, 0, ?)",
                         [index_id, n, column_id, ordinal, ordinal == 0])
    conn.executemany("INSERT INTO sys.columns VALUES (1, ?, ?)", [(i, c) for c, i in columns.items()])
    return conn


def on_catalog(conn: sqlite3.Connection, tsql: str, params: tuple = ()) -> list[tuple]:
    """T-SQL text run on the fake catalog: SQLite reads it once its N'' literals are plain ones."""
    return conn.execute(tsql.replace("N'", "'"), params).fetchall()


def sql_server_problems(engine: MssqlEngine, conn: sqlite3.Connection) -> list[str]:
    """``INDEX_COLUMNS_SQL['mssql']`` run on the fake catalog, compared as `outbox check` does."""
    live = shapes_of(on_catalog(conn, INDEX_COLUMNS_SQL["mssql"], ("[dbo].[outbox]",)))
    return [name for name, expected in engine.expected_indexes().items()
            if name not in live or not same_shape(engine, live[name], expected)]


def sql_server_rebuilds(engine: MssqlEngine, conn: sqlite3.Connection) -> dict[str, list[str]]:
    """What `outbox migrate` runs on the fake catalog for each index, by name: the statements of
    the step whose probe (``index_matches``) finds no row, those whose ``IF`` holds there: a
    RAISERROR does not end its batch (Microsoft's SET XACT_ABORT: THROW honors XACT_ABORT,
    "RAISERROR does not"), so every statement after it whose ``IF`` holds runs too."""
    ran: dict[str, list[str]] = {}
    for step in engine.migration_steps():
        if isinstance(step, tuple) and not on_catalog(conn, step[0][0]):
            name = re.search(r"i\.name = N'([^']+)'", step[0][0]).group(1)  # type: ignore[union-attr]
            guarded = [re.fullmatch(r"IF (.*)\nBEGIN\n    (.*);\nEND;", s, re.S).groups() for s in step[1]]  # type: ignore[union-attr]
            ran[name] = [statement for condition, statement in guarded if on_catalog(conn, f"SELECT 1 WHERE {condition}")]
    return ran


def test_sql_servers_filters_a_login_may_not_read_do_not_fail_the_check(no_sqlglot_fallbacks: None) -> None:
    """sys.indexes.filter_definition is NULL "for heap, non-filtered index, or insufficient
    permissions on the table" (Microsoft's sys.indexes reference): the relay's login, with the
    SELECT, INSERT, UPDATE, DELETE docs/sqlserver.md ("Permissions") asks for and no VIEW
    DEFINITION, read the three filtered indexes as unfiltered, and `outbox check` failed on a
    table `outbox migrate` had just made (found in review). Whether an index has a filter
    (has_filter) is read instead where its text is not; an index without one still fails."""
    engine = MssqlEngine()
    parse_one(INDEX_COLUMNS_SQL["mssql"].replace("?", "N'[dbo].[outbox]'"))
    assert sql_server_problems(engine, sql_server_catalog(engine, readable_filters=True)) == []
    assert sql_server_problems(engine, sql_server_catalog(engine, readable_filters=False)) == []
    claim = engine.index_name("claim_ready")
    for readable in (True, False):
        catalog = sql_server_catalog(engine, readable_filters=readable, unfiltered="claim_ready")
        assert sql_server_problems(engine, catalog) == [claim], readable


class CatalogCursor:
    """A DB-API cursor over the fake catalog, for ``describe.index_problems`` (`outbox check`'s)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn, self.rows = conn, []

    def execute(self, sql: str, params: tuple = ()) -> CatalogCursor:
        self.rows = on_catalog(self.conn, sql, params)
        return self

    def fetchall(self) -> list:
        return self.rows

    def fetchone(self) -> tuple | None:
        return self.rows[0] if self.rows else None


def test_sql_servers_migrate_rebuilds_or_refuses_every_index_the_check_fails_for_its_kind(
        no_sqlglot_fallbacks: None) -> None:
    """`outbox check` compares an index's kind (``type_desc``) and failed a CLUSTERED index under
    one of the migration's names, but the migration's probe (``index_matches``) did not compare
    it: `outbox migrate` said nothing was to change, the check failing on every run (found in
    review). Each index the check fails, the migration now touches: one of the migration's kind
    built again in place; a clustered one (the table's storage: ``DROP_EXISTING`` cannot make it
    nonclustered, and dropping it rewrites the table) fails the migration naming it and what to
    do, as the check's line says; one of another nonclustered kind dropped, then made."""
    engine = MssqlEngine()
    claim = engine.index_name("claim_ready")
    table = engine.table
    assert sql_server_rebuilds(engine, sql_server_catalog(engine)) == {}
    catalog = sql_server_catalog(engine, unfiltered="claim_ready")
    assert sql_server_problems(engine, catalog) == [claim]
    (rebuild,) = sql_server_rebuilds(engine, catalog)[claim]
    assert rebuild.startswith(f"EXEC sp_executesql N'CREATE NONCLUSTERED INDEX [{claim}]") and "DROP_EXISTING" in rebuild
    for kind in ("CLUSTERED", "CLUSTERED COLUMNSTORE"):
        catalog = sql_server_catalog(engine, kinds={"claim_ready": kind})
        assert sql_server_problems(engine, catalog) == [claim]
        (refusal,) = sql_server_rebuilds(engine, catalog)[claim]
        parse_one(refusal)
        assert refusal.startswith("RAISERROR(N'outbox migrate will not make index %s of %s nonclustered itself: it is "
                                  "the table''s clustered index: drop it first (DROP INDEX %s ON %s"), refusal
        assert refusal.endswith(f"', 16, 1, N'{claim}', N'{table}', N'[{claim}]', N'{table}')"), refusal
        (line,) = index_problems(engine, CatalogCursor(catalog))
        assert line.startswith(f"{claim} is ") and f"USING {kind}, not " in line, line
        assert f"it is the table's clustered index: drop it first (DROP INDEX [{claim}] ON {table}" in line, line
    catalog = sql_server_catalog(engine, kinds={"claim_ready": "NONCLUSTERED COLUMNSTORE"})
    assert sql_server_problems(engine, catalog) == [claim]
    assert sql_server_rebuilds(engine, catalog) == {claim: [f"DROP INDEX [{claim}] ON {table}"]}
    assert "drop it first" not in index_problems(engine, CatalogCursor(catalog))[0]


def test_sql_servers_disabled_index_fails_the_check_and_is_built_again(no_sqlglot_fallbacks: None) -> None:
    """A disabled index (``ALTER INDEX ... DISABLE``: sys.indexes.is_disabled) serves no query, and
    a query whose hint names it fails (the claim's FORCESEEK on ``agg_open``); `outbox check` said ok
    over it and `outbox migrate` left it (found in review). Both fail it now, and the migration builds
    it again in place, which enables it (Microsoft's "Disable indexes and constraints": a CREATE INDEX
    with DROP_EXISTING enables a disabled index); the claim pins no disabled index (``index_matches``)."""
    engine = MssqlEngine()
    probe = engine.index_name("agg_open")
    catalog = sql_server_catalog(engine, disabled="agg_open")
    assert sql_server_problems(engine, catalog) == [probe]
    (line,) = index_problems(engine, CatalogCursor(catalog))
    assert line == f"{probe} is (aggregate_id, id) WHERE ([status]=(0) OR [status]=(1) OR [status]=(3)) USING " \
                   "NONCLUSTERED DISABLED, not (aggregate_id, id) WHERE status IN (0, 1, 3) USING NONCLUSTERED", line
    (rebuild,) = sql_server_rebuilds(engine, catalog)[probe]
    assert rebuild.startswith(f"EXEC sp_executesql N'CREATE NONCLUSTERED INDEX [{probe}]") and "DROP_EXISTING" in rebuild
    assert not on_catalog(catalog, engine.index_matches(engine.PROBE_INDEX))  # the claim's probe_index: False


@pytest.mark.parametrize("kind", ["UNIQUE", "PRIMARY KEY"])
@pytest.mark.parametrize("clustered", [False, True], ids=["nonclustered", "clustered"])
def test_sql_servers_index_that_enforces_a_constraint_is_refused_naming_it(kind: str, clustered: bool,
                                                                           no_sqlglot_fallbacks: None) -> None:
    """An index under one of the migration's names that enforces a constraint (made by another
    script: ``CONSTRAINT ix_outbox_agg_open UNIQUE (aggregate_id, id)``) and is defined otherwise:
    SQL Server changes no such index by an index build (``CREATE INDEX ... DROP_EXISTING`` fails on
    an altered definition, ``DROP INDEX`` is refused, error 3723), so `outbox migrate` failed with
    SQL Server's error, and a clustered one was told to be dropped with ``DROP INDEX`` (found in
    review). The migration refuses first, naming the constraint and the fix (drop the constraint,
    then migrate), and `outbox check`'s line says the same."""
    engine = MssqlEngine()
    table, agg = engine.table, engine.index_name("agg_open")
    catalog = sql_server_catalog(engine, unfiltered="agg_open", constraints={"agg_open": kind},
                                 kinds={"agg_open": "CLUSTERED"} if clustered else None)
    assert sql_server_problems(engine, catalog) == [agg]
    (first,) = sql_server_rebuilds(engine, catalog)[agg]
    parse_one(first)
    assert first.startswith("RAISERROR(N'outbox migrate will not build index %s of %s again itself: it enforces the "
                            f"{kind} constraint %s, which SQL Server does not let an index build change: drop the "
                            "constraint first (ALTER TABLE %s DROP CONSTRAINT %s"), first
    assert first.endswith(f"', 16, 1, N'{agg}', N'{table}', N'[{agg}]', N'{table}', N'[{agg}]')"), first
    (line,) = index_problems(engine, CatalogCursor(catalog))
    assert f"(it enforces the {kind} constraint [{agg}], which SQL Server does not let an index build change: drop " \
           f"the constraint first (ALTER TABLE {table} DROP CONSTRAINT [{agg}], at a quiet moment" in line, line
    assert "DROP INDEX" not in line


@pytest.mark.parametrize("kind", ["UNIQUE", "PRIMARY KEY"])
@pytest.mark.parametrize("clustered", [False, True], ids=["nonclustered", "clustered"])
def test_sql_servers_constraint_refusal_is_the_only_statement_its_batch_runs(kind: str, clustered: bool,
                                                                             no_sqlglot_fallbacks: None) -> None:
    """A refusal (``RAISERROR``) does not end its batch, under XACT_ABORT ON either (Microsoft's
    SET XACT_ABORT: THROW honors it, "RAISERROR does not"), and the guards after the constraint's
    refusal held too: the same batch went on to the clustered one's refusal, which tells to
    ``DROP INDEX`` what error 3723 refuses, and, for a nonclustered index, to ``CREATE INDEX ... WITH
    (DROP_EXISTING = ON)``, which fails with SQL Server's own error (found in review, read against
    Microsoft's RAISERROR, SET XACT_ABORT and CREATE INDEX). No guard after a refusal holds where
    it does: the refusal is the one statement its batch runs."""
    engine = MssqlEngine()
    agg = engine.index_name("agg_open")
    catalog = sql_server_catalog(engine, unfiltered="agg_open", constraints={"agg_open": kind},
                                 kinds={"agg_open": "CLUSTERED"} if clustered else None)
    (refusal,) = sql_server_rebuilds(engine, catalog)[agg]
    assert refusal.startswith("RAISERROR(N'outbox migrate will not build index %s of %s again itself: it enforces the "
                              f"{kind} constraint %s"), refusal
    for statement in engine._rebuild_steps(engine.PROBE_INDEX):
        parse_one(statement)


def test_sql_servers_disabled_index_that_enforces_a_constraint_is_built_again_keeping_it(
        no_sqlglot_fallbacks: None) -> None:
    """A constraint's index defined as the migration defines it but disabled is built again in
    place (``DROP_EXISTING`` keeps the constraint when the definition is not altered), not refused."""
    engine = MssqlEngine()
    name = engine.index_name("message_id")
    catalog = sql_server_catalog(engine, disabled="message_id", constraints={"message_id": "UNIQUE"})
    (rebuild,) = sql_server_rebuilds(engine, catalog)[name]
    assert "DROP_EXISTING" in rebuild and "RAISERROR" not in rebuild
    (line,) = index_problems(engine, CatalogCursor(catalog))
    assert line.endswith("NONCLUSTERED DISABLED, not UNIQUE (message_id) USING NONCLUSTERED"), line


def test_sql_servers_disabled_clustered_primary_key_is_named_by_the_check_and_rebuilt_by_migrate(
        no_sqlglot_fallbacks: None) -> None:
    """A disabled clustered index (the primary key: ``ALTER INDEX pk_outbox ON outbox DISABLE``)
    makes the table unreadable (error 8655) and disables every other index of it: `outbox check`
    said "table missing: run `outbox migrate`", and the migration failed on its first read of the
    table (found in review). The check names the index and the fix from the catalog's rows
    (``DISABLED_CLUSTERED_SQL``), and the migration rebuilds every index of the table first
    (``ALTER INDEX ALL ... REBUILD``: the clustered index alone would leave the others disabled;
    offline, as SQL Server rebuilds a disabled clustered index), its report naming each as it was."""
    engine = MssqlEngine()
    table, pk = engine.table, f"pk_{engine.table_name}"
    parse_one(DISABLED_CLUSTERED_SQL)
    assert unreadable_problem(table, []) is None
    line = unreadable_problem(table, [(pk, True)])
    assert line is not None and line.startswith(
        f"table {table} cannot be read: its clustered index [{pk}] (its primary key) is disabled"), line
    assert f"run `outbox migrate`, which rebuilds them all (ALTER INDEX ALL ON {table} REBUILD, offline" in line, line
    assert "missing" not in line
    healthy, broken = sql_server_catalog(engine), sql_server_catalog(engine, primary_key_disabled=True)
    assert engine.unreadable_table(CatalogCursor(healthy)) is None
    assert engine.unreadable_table(CatalogCursor(broken)) == line
    # The migration: the rebuild where a clustered index is disabled only, before any step reads the table.
    steps = engine.migration_steps()
    (at,) = [i for i, step in enumerate(steps) if not isinstance(step, tuple) and "ALTER INDEX ALL" in "".join(step)]
    (statement,) = steps[at]
    parse_one(statement)
    condition, body = re.fullmatch(r"IF (.*)\nBEGIN\n    (.*);\nEND;", statement, re.S).groups()  # type: ignore[union-attr]
    assert body == f"EXEC sp_executesql N'ALTER INDEX ALL ON {table} REBUILD'"
    assert on_catalog(broken, f"SELECT 1 WHERE {condition}") and not on_catalog(healthy, f"SELECT 1 WHERE {condition}")
    assert not any(f"FROM {table}" in str(step) or f"ALTER TABLE {table}" in str(step) for step in steps[:at])
    # Its report, read from the catalog (a read of the table would fail): every index rebuilt, as it was.
    store = OutboxStore("mssql://relay@db/app", engine=engine)
    before, after = store._schema_state_on(CatalogCursor(broken)), store._schema_state_on(CatalogCursor(healthy))
    assert before is not None and after is not None
    assert store.schema_changes(before, after) == [
        "rebuilt " + ", ".join(f"{name} (was DISABLED)" for name in sorted([pk, *engine.expected_indexes()]))]


def test_sql_servers_unreadable_table_line_names_the_foreign_keys_migrate_leaves_disabled(
        no_sqlglot_fallbacks: None) -> None:
    """Disabling a clustered index disables every FOREIGN KEY constraint to and from its table
    (Microsoft's "Disable indexes and constraints": "all incoming and outgoing FOREIGN KEY
    constraints"), and rebuilding it enables none of them ("Enable indexes and constraints": they
    "must be manually enabled", ALTER TABLE ... CHECK CONSTRAINT). The check's line and
    docs/sqlserver.md said the table's own ones only, which the migration's table has none of: a
    FOREIGN KEY of another table that references it stayed disabled after `outbox migrate`, unsaid
    (found in review). The line names each from the catalog, with the statement that enables it."""
    engine = MssqlEngine()
    from outbox.storage.engines.mssql.schema import DISABLED_FOREIGN_KEYS_SQL
    parse_one(DISABLED_FOREIGN_KEYS_SQL)
    broken = sql_server_catalog(engine, primary_key_disabled=True)
    broken.execute("INSERT INTO sys.foreign_keys VALUES ('fk_orders_outbox', 2, 1, 1), ('fk_on_purpose', 3, 4, 1), "
                   "('fk_enabled', 5, 1, 0)")
    line = engine.unreadable_table(CatalogCursor(broken))
    assert line is not None and line.startswith(f"table {engine.table} cannot be read"), line
    assert ("ALTER TABLE [dbo].[table_2] WITH CHECK CHECK CONSTRAINT [fk_orders_outbox]" in line
            and "fk_on_purpose" not in line and "fk_enabled" not in line), line
    unseen = unreadable_problem(engine.table, [(f"pk_{engine.table_name}", True)], [])
    assert unseen is not None and unseen.endswith("FOREIGN KEY constraints to and from the table, which SQL Server "
                                                  "disabled with it and the migration leaves disabled: none this login "
                                                  "can see (sys.foreign_keys shows it those of the tables it has a "
                                                  "permission on)"), unseen
    healthy = sql_server_catalog(engine)
    healthy.execute("INSERT INTO sys.foreign_keys VALUES ('fk_orders_outbox', 2, 1, 1)")
    assert engine.unreadable_table(CatalogCursor(healthy)) is None


class PyodbcError(Exception):
    """Stands in for pyodbc.Error: recognised by its module (``mssql.driver``)."""


PyodbcError.__module__ = "pyodbc"


def test_sql_servers_unreadable_table_is_said_by_the_check_and_by_every_failing_command() -> None:
    """`outbox check`'s table line (``check_database``) and the error of enqueue and the claim
    (``schema_error_hint``) over a table whose clustered index is disabled: they said "table
    missing" and the driver's error alone (found in review)."""
    engine = MssqlEngine()
    pk = f"pk_{engine.table_name}"
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": "mssql+pyodbc://relay:secret@db.example/app"})
    conn = RecordingConnection({DISABLED_CLUSTERED_SQL: [(pk, True)]})
    store = OutboxStore.from_settings(settings)
    store.engine.connect = lambda url: conn  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OutboxStore, "from_settings", classmethod(lambda cls, settings=None: store))
        results = {r.name: r for r in check_database(settings)}
    assert results["table"].state == FAIL and "indexes" not in results
    assert results["table"].detail.startswith(f"table {engine.table} cannot be read: its clustered index [{pk}]")
    # Any other command that failed on it (cli._explain): its probe of the table fails, the catalog says why.
    class Unreadable(RecordingCursor):
        def execute(self, sql: str, params: Any = ()) -> RecordingCursor:
            if sql.startswith("SELECT id FROM"):
                raise PyodbcError("42000", "The query processor is unable to produce a plan (8655)")
            return super().execute(sql, params)
    conn.cursor_class = Unreadable
    from outbox import cli
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "_opened", [store])
        assert cli._explain(RuntimeError("the command's own error")) == results["table"].detail
    error = PyodbcError("42000", "[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]The query processor "
                        f"is unable to produce a plan because the index '{pk}' on table or view '{engine.table_name}' "
                        "is disabled. (8655) (SQLExecDirectW)")
    hint = engine.schema_error_hint(error)
    assert hint is not None and hint.startswith(f"table {engine.table} cannot be read: its clustered index [{pk}] is "
                                                "disabled") and "`outbox migrate`" in hint, hint
    other = PyodbcError("42000", "The query processor is unable to produce a plan because the index 'pk_x' on table or view "
                        "'another_table' is disabled. (8655)")
    assert engine.schema_error_hint(other) is None


#: What SQL Server says to a statement of the relay on a table with a disabled index, by error number:
#: its words and what they name (index, table). 8655 when the clustered index is disabled or a hint
#: forces a disabled index (Microsoft's upgrade notes: "If the clustered index is disabled, or if a
#: nonclustered index is forced"), 315/316 when a hint names a disabled index, 8622 when a FORCESEEK
#: finds no enabled index to seek (the claim's hints: ``FORCESEEK`` and ``agg_open``'s).
DISABLED_INDEX_ERRORS = [
    (8655, "The query processor is unable to produce a plan because the index 'pk_outbox' on table or view 'outbox' is "
           "disabled.", "pk_outbox"),
    (8655, "The query processor is unable to produce a plan because the index 'ix_outbox_agg_open' on table or view "
           "'outbox' is disabled.", "ix_outbox_agg_open"),
    (315, 'Index "ix_outbox_agg_open" on table "dbo.outbox" (specified in the FROM clause) is disabled or resides in a '
          "filegroup which is not online.", "ix_outbox_agg_open"),
    (316, 'The index ID 3 on table "dbo.outbox" (specified in the FROM clause) is disabled or resides in a filegroup '
          "which is not online.", "index id 3"),
    (8622, "Query processor could not produce a query plan because of the hints defined in this query. Resubmit the "
           "query without specifying any hints and without using SET FORCEPLAN.", ""),
]


@pytest.mark.parametrize("driver", ["pyodbc", "pyodbc-localized", "mssql-python"])
@pytest.mark.parametrize(("number", "words", "named"), DISABLED_INDEX_ERRORS,
                         ids=[f"{n}-{named or 'none'}" for n, _, named in DISABLED_INDEX_ERRORS])
def test_every_error_a_disabled_index_raises_is_explained_as_8655_is(driver: str, number: int, words: str,
                                                                      named: str) -> None:
    """The claim's statements name indexes in hints (``FORCESEEK``, ``agg_open``'s), so on a table
    whose clustered index is disabled it may fail with 315 or 8622, not 8655, and only 8655 was
    explained: the relay logged the driver's error alone, naming no fix (found in review). Each gets
    the explanation, naming the index where the error does, with `outbox check` and `outbox
    migrate`; from pyodbc (the number and the words, or the number alone in another language) and
    from mssql-python (the words alone). The same error about another table is not explained."""
    engine = MssqlEngine()

    def error(text: str) -> BaseException:
        if driver == "mssql-python":
            mp = pytest.importorskip("mssql_python.exceptions")
            try:
                mp.raise_exception("42000", f"[Microsoft][SQL Server]{text}")
            except mp.Error as raised:
                return raised
        return PyodbcError("42000", f"[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]{text} ({number}) "
                                    "(SQLExecDirectW)")

    shown = "Der Abfrageprozessor konnte keinen Abfrageplan erstellen." if driver == "pyodbc-localized" else words
    hint = engine.schema_error_hint(error(shown))
    assert hint is not None and hint.startswith(f"table {engine.table} "), hint
    assert "run `outbox check`, which names a disabled index of the table, and `outbox migrate`, which rebuilds it" in hint
    if driver != "pyodbc-localized" and named:
        assert (f"[{named}]" if not named.startswith("index id") else f"({named})") in hint, hint
    if named == "pk_outbox" and driver != "pyodbc-localized":
        assert "cannot be read: its clustered index [pk_outbox] is disabled" in hint, hint
    elsewhere = words.replace("'outbox'", "'orders'").replace('"dbo.outbox"', '"dbo.orders"')
    if driver != "pyodbc-localized" and elsewhere != words:
        assert engine.schema_error_hint(error(elsewhere)) is None
    if '"dbo.outbox"' in words and driver != "pyodbc-localized":  # [app].[outbox]'s engine, [dbo].[outbox]'s error
        assert MssqlEngine(schema="app").schema_error_hint(error(words)) is None


#: Error 1505 as SQL Server words it for a rebuild of a unique index over rows that share a key.
DUPLICATE_KEY_1505 = ("The CREATE UNIQUE INDEX statement terminated because a duplicate key was found for the object "
                      "name 'dbo.outbox' and the index name 'ix_outbox_message_id'. The duplicate key value is (m-1).")


def driver_error(driver: str, sqlstate: str, number: int, words: str) -> BaseException:
    """``words`` (error ``number``) as pyodbc raises it (its number ends the message), as pyodbc
    raises it in another language (the number alone is read), or as mssql-python does (no number)."""
    if driver == "mssql-python":
        mp = pytest.importorskip("mssql_python.exceptions")
        try:
            mp.raise_exception(sqlstate, f"[Microsoft][SQL Server]{words}")
        except mp.Error as raised:
            return raised
    shown = "Die Anweisung wurde beendet." if driver == "pyodbc-localized" else words
    return PyodbcError(sqlstate, f"[{sqlstate}] [Microsoft][ODBC Driver 18 for SQL Server][SQL Server]{shown} "
                                 f"({number}) (SQLExecDirectW)")


@pytest.mark.parametrize("driver", ["pyodbc", "pyodbc-localized", "mssql-python"])
@pytest.mark.parametrize("clustered", [False, True], ids=["index-disabled", "clustered-disabled"])
def test_sql_servers_migrate_names_the_unique_index_whose_rebuild_meets_duplicates_and_how_to_find_them(
        no_sqlglot_fallbacks: None, clustered: bool, driver: str) -> None:
    """A unique index disabled while rows were written (SQL Server neither maintains a disabled index
    nor enforces its uniqueness) may hold rows that share a key: `outbox migrate`'s rebuild of it
    (``DROP_EXISTING``, or ``ALTER INDEX ALL ... REBUILD`` under a disabled clustered index) fails
    with error 1505, and the migration said the driver's error alone (found in review). It names the
    index, why, the query that finds every duplicate (Microsoft's MSSQLSERVER_1505: the error gives
    the first only), and, while the clustered index is disabled and the table cannot be read, the
    rebuild of that index alone first. Another table's 1505 is left as it is."""
    engine = MssqlEngine()
    name, pk, table = engine.index_name("message_id"), f"pk_{engine.table_name}", engine.table
    catalog = sql_server_catalog(engine, disabled="" if clustered else "message_id", primary_key_disabled=clustered)
    hint = engine.migration_error_hint(CatalogCursor(catalog), driver_error(driver, "23000", 1505, DUPLICATE_KEY_1505))
    assert hint is not None and hint.startswith(f"outbox migrate cannot rebuild index [{name}] of {table}: it is UNIQUE, "
                                                "and rows of the table share a key of it (error 1505"), hint
    assert ("the first found: (m-1)" in hint) is (driver != "pyodbc-localized"), hint
    assert hint.endswith("then run `outbox migrate` again"), hint
    first = f"rebuild that index alone first (ALTER INDEX [{pk}] ON {table} REBUILD"
    assert (first in hint) is clustered, hint
    found = re.search(r"find them with (SELECT .*?), keep one row of each key", hint)
    assert found is not None, hint
    query = found.group(1)
    parse_one(query)
    # The query finds every key held twice or more, NULL included, each once, with its lowest and highest id.
    rows = sqlite3.connect(":memory:")
    rows.execute("ATTACH ':memory:' AS dbo")
    rows.execute("CREATE TABLE dbo.outbox (id INTEGER PRIMARY KEY, message_id TEXT)")
    rows.executemany("INSERT INTO dbo.outbox VALUES (?, ?)",
                     [(1, "m-1"), (2, "m-2"), (3, "m-1"), (4, None), (5, None), (6, "m-1"), (7, "m-3")])
    assert rows.execute(query).fetchall() == [(None, 2, 4, 5), ("m-1", 3, 1, 6)]
    other = DUPLICATE_KEY_1505.replace("'dbo.outbox'", "'dbo.orders'")
    if driver != "pyodbc-localized":
        assert engine.migration_error_hint(CatalogCursor(catalog), driver_error(driver, "23000", 1505, other)) is None
    assert engine.migration_error_hint(CatalogCursor(catalog), PyodbcError("42000", "Incorrect syntax (102)")) is None


def test_sql_servers_migrate_raises_the_explanation_of_its_failure_with_the_drivers_error_as_its_cause() -> None:
    """``apply_migration`` (`outbox migrate`, Django's and Alembic's migrations) asks the engine to
    explain the error a step failed with (``Engine.migration_error_hint``) and raises that, one line,
    the driver's error as its cause; a step that fails otherwise raises its own error, as before."""
    engine = MssqlEngine()
    duplicate = driver_error("pyodbc", "23000", 1505, DUPLICATE_KEY_1505)

    class Rebuild(RecordingCursor):
        error: BaseException = duplicate

        def execute(self, sql: str, params: Any = ()) -> RecordingCursor:
            super().execute(sql, params)
            if "ALTER INDEX ALL" in sql:
                raise self.error
            return self

    conn = RecordingConnection({DISABLED_CLUSTERED_SQL: [(f"pk_{engine.table_name}", True)]})
    conn.cursor_class = Rebuild
    store = OutboxStore("mssql+pyodbc://relay:secret@db.example/app", engine=engine)
    store.engine.connect = lambda url: conn  # type: ignore[method-assign]
    with pytest.raises(StoreError) as refused:
        store.migrate()
    assert str(refused.value).startswith(f"outbox migrate cannot rebuild index [{engine.index_name('message_id')}]")
    assert refused.value.__cause__ is duplicate
    assert f"ALTER INDEX [pk_{engine.table_name}] ON {engine.table} REBUILD" in str(refused.value)
    assert "find them with SELECT [message_id], COUNT(*)" in str(refused.value)  # the engine's own index's key
    Rebuild.error = other = PyodbcError("42000", "[SQL Server]Something else. (50000) (SQLExecDirectW)")
    with pytest.raises(PyodbcError) as raised:
        store.migrate()
    assert raised.value is other


#: What a migration step meets where the database, or a filegroup the table or an index of it is on,
#: is read-only or offline, as Microsoft's list of the Database Engine's errors words each: (number,
#: SQLSTATE, words, offline, the statement or query the explanation gives).
STORAGE_REFUSALS = [
    (3906, "25000", 'Failed to update database "app" because the database is read-only.', False,
     "ALTER DATABASE [app] SET READ_WRITE"),
    (1924, "42000", "Filegroup 'archive' is read-only.", False,
     "ALTER DATABASE CURRENT MODIFY FILEGROUP [archive] READ_WRITE"),
    (652, "HY000", 'The index "ix_outbox_message_id" for table "dbo.outbox" (RowsetId 72057594043432960) resides on a '
                   'read-only filegroup ("archive"), which cannot be modified.', False,
     "ALTER DATABASE CURRENT MODIFY FILEGROUP [archive] READ_WRITE"),
    (1931, "42000", "The SQL statement cannot be executed because filegroup 'archive' is offline. Use the "
                    "sys.database_files or sys.master_files catalog view to determine the state of the files in this "
                    "filegroup and then restore the offline file(s) from backup.", True,
     "SELECT f.name, f.physical_name, f.state_desc FROM sys.database_files AS f INNER JOIN sys.filegroups AS g ON "
     "g.data_space_id = f.data_space_id WHERE g.name = N'archive'"),
    (8653, "42000", "The query processor is unable to produce a plan for the table or view 'outbox' because the table "
                    "resides in a filegroup which is not online.", True, ""),
]


@pytest.mark.parametrize("driver", ["pyodbc", "pyodbc-localized", "mssql-python"])
@pytest.mark.parametrize(("number", "sqlstate", "words", "offline", "statement"), STORAGE_REFUSALS,
                         ids=[str(case[0]) for case in STORAGE_REFUSALS])
def test_sql_servers_migrate_says_a_read_only_or_offline_database_or_filegroup_stops_it(
        no_sqlglot_fallbacks: None, driver: str, number: int, sqlstate: str, words: str, offline: bool,
        statement: str) -> None:
    """``ALTER INDEX ALL ... REBUILD`` (a disabled clustered index), and any step that writes, fails
    where the database or a filegroup the table or an index of it is on is read-only or offline (SQL
    Server builds or enables an index only where every filegroup it is on is online: Microsoft's
    "Index operations with offline filegroups"), and `outbox migrate` said the driver's error alone
    (found in review). It names which, by the error's number, and what to do. ALTER DATABASE, which
    sqlglot does not read, is checked by its text; the query of a filegroup's files is parsed."""
    engine = MssqlEngine()
    catalog = sql_server_catalog(engine, primary_key_disabled=True)
    hint = engine.migration_error_hint(CatalogCursor(catalog), driver_error(driver, sqlstate, number, words))
    assert hint is not None and hint.startswith(f"outbox migrate cannot change table {engine.table}: "), hint
    assert f"(error {number}" in hint and hint.count("then run `outbox migrate` again") + hint.count(
        "run `outbox migrate` again, then") == 1, hint
    assert ("is offline" in hint) is offline and ("is read-only" in hint) is (not offline), hint
    named = driver != "pyodbc-localized"
    if named and statement:
        assert statement in hint, hint
        if statement.startswith("SELECT"):
            parse_one(statement)
    if named and number in (3906, 1924, 652, 1931):
        assert "[archive]" in hint or "[app]" in hint, hint
    if not named:
        assert "[archive]" not in hint and "[app]" not in hint, hint
    if named and number in (652, 8653):  # they name the table: another's is not this migration's
        other = words.replace('"dbo.outbox"', '"dbo.orders"').replace("'outbox'", "'orders'")
        assert engine.migration_error_hint(CatalogCursor(catalog), driver_error(driver, sqlstate, number, other)) is None


def test_mariadbs_ignored_index_fails_the_check_and_migrate_makes_it_usable(mysql: OutboxStore, tmp_path: Path) -> None:
    """MariaDB's IGNORED index (10.6+: ``ALTER TABLE ... ALTER INDEX ... IGNORED``) is one the
    optimizer treats as absent, and a hint naming it fails: every claim failed with error 1176 (its
    FORCE INDEX names claim_ready) while `outbox check` said ok and `outbox migrate` said nothing to
    change (found in review). The check fails naming it, the migration builds it again (usable), and
    the claim runs."""
    e = mysql.engine
    claim = e.index_name("claim_ready")
    raw(mysql, f"ALTER TABLE {e.table} ALTER INDEX `{claim}` IGNORED")
    with pytest.raises(Exception, match="1176"):
        mysql.claim(10)
    check = cli(mysql, "check", tmp_path)
    line = next(line for line in check.splitlines() if line.startswith("[FAIL] indexes"))
    assert f"{claim} is (status, next_retry_at, id) USING BTREE IGNORED, not (status, next_retry_at, id) " \
           "USING BTREE" in line, line
    # Its report names what it was and what was done: the flag turned off, nothing built again
    # (it said "rebuilt", found in review).
    assert f"repaired (made {claim} NOT IGNORED (was IGNORED; not rebuilt))" in cli(mysql, "migrate", tmp_path)
    assert "[ok  ] indexes" in cli(mysql, "check", tmp_path)
    assert mysql.claim(10).messages == []
    # MySQL 8 names it INVISIBLE (STATISTICS.IS_VISIBLE), and makes it VISIBLE (not run here: no MySQL 8).
    mysql8 = MysqlEngine()
    mysql8.server_version = "8.0.36"
    steps = [step for step in mysql8.migration() if isinstance(step, tuple) and "ALTER INDEX" in str(step[1])]
    assert steps[0][1] == f"ALTER TABLE {mysql8.table} ALTER INDEX `{mysql8.index_name('message_id')}` VISIBLE"
    assert "CASE WHEN is_visible = 'NO' THEN 'INVISIBLE' END IS NOT NULL" in steps[0][0][0]


class CountingCursor:
    """A driver's cursor that counts the statements sent through it."""

    def __init__(self, cursor: Any) -> None:
        self.cursor, self.connection, self.sent = cursor, cursor.connection, 0

    def execute(self, *args: Any) -> Any:
        self.sent += 1
        return self.cursor.execute(*args)


@pytest.mark.parametrize("driver", ["pymysql", "MySQLdb"])
def test_mariadb_is_told_from_mysql_by_the_connections_handshake_alone(driver: str) -> None:
    """``MysqlEngine.read_server`` asked ``SELECT VERSION()`` while the session bounds and the
    enqueue's isolation read the connection's ``get_server_info()``: two ways of knowing one
    thing (found in review). It reads the handshake now, on both drivers a caller may hand it
    (PyMySQL; mysqlclient, Django's default, whose cursor the Django migration and admin use)."""
    require("MariaDB/MySQL", "127.0.0.1", 3306)
    module = pytest.importorskip(driver)
    conn = module.connect(host="127.0.0.1", port=3306, user="root", database="test")
    try:
        engine = MysqlEngine()
        cursor = CountingCursor(engine.cursor_for(conn))
        engine.read_server(cursor)
        assert cursor.sent == 0
        version = engine.cursor_for(conn)
        version.execute("SELECT VERSION()")
        assert engine.mariadb is ("mariadb" in str(version.fetchone()[0]).lower()), engine.server_version
    finally:
        conn.close()


def test_mariadbs_report_names_an_ignored_index_built_again_as_rebuilt_and_what_it_was(mysql: OutboxStore,
                                                                                         tmp_path: Path) -> None:
    """An IGNORED index defined otherwise too is made usable, then built again: "rebuilt", with
    the state it was in."""
    e = mysql.engine
    claim = e.index_name("claim_ready")
    raw(mysql, f"ALTER TABLE {e.table} DROP INDEX `{claim}`, ADD INDEX `{claim}` (status, id)",
        f"ALTER TABLE {e.table} ALTER INDEX `{claim}` IGNORED")
    assert f"repaired (rebuilt {claim} (was IGNORED))" in cli(mysql, "migrate", tmp_path)
    assert cli(mysql, "migrate", tmp_path).strip().endswith("nothing to change")


def test_the_report_names_sql_servers_disabled_index_rebuilt() -> None:
    """SQL Server builds a disabled index again (``DROP_EXISTING``, which enables it): "rebuilt",
    with the state it was in; its report read the catalog's text alone, which said "rebuilt"
    whatever the index had been (not run here: no SQL Server; the report's reading of the
    states ``schema_state`` gives)."""
    store = OutboxStore("mssql://sa@localhost/db", engine=MssqlEngine())
    name, other = store.engine.index_name("agg_open"), store.engine.index_name("claim_ready")
    shapes = store.engine.expected_indexes()
    before = (frozenset({"id"}), frozenset({name, other}), frozenset(),
              frozenset({(name, shapes[name].text()), (other, "(id)")}), frozenset({(name, "DISABLED")}))
    after = (frozenset({"id"}), frozenset({name, other}), frozenset(),
             frozenset({(name, shapes[name].text()), (other, shapes[other].text())}), frozenset())
    assert store.schema_changes(before, after) == [f"rebuilt {name} (was DISABLED), {other}"]


#: Per engine, indexes changed by hand in shapes no earlier release made, which `outbox migrate`
#: left as they were (it looked for the earlier releases' shapes only) while `outbox check`
#: failed them on every run: (suffix, the DDL of the hand's index, its definition as the check
#: writes it). Another column order (the second column kept where MariaDB's probe read only it),
#: a partial index made whole, a `message_id` no longer unique.
HAND_MADE = {
    "postgresql": [
        ("claim_ready", 'CREATE INDEX "{name}" ON {table} (id, next_retry_at) WHERE processed_at IS NULL',
         "(id, next_retry_at) WHERE processed_at IS NULL USING btree"),
        ("agg_id_id", 'CREATE INDEX "{name}" ON {table} (aggregate_id, id)', "(aggregate_id, id) USING btree"),
        ("message_id", 'CREATE INDEX "{name}" ON {table} (message_id)', "(message_id) USING btree"),
    ],
    "mysql": [
        ("claim_ready", "ALTER TABLE {table} DROP INDEX `{name}`, ADD INDEX `{name}` (id, next_retry_at, status)",
         "(id, next_retry_at, status) USING BTREE"),
        ("message_id", "ALTER TABLE {table} DROP INDEX `{name}`, ADD INDEX `{name}` (message_id)",
         "(message_id) USING BTREE"),
    ],
    "sqlite": [
        ("claim_ready", 'CREATE INDEX "{name}" ON {table} (id, next_retry_at) WHERE status IN (0, 1, 3)',
         "(id, next_retry_at) WHERE status IN (0, 1, 3)"),
        ("agg_id_id", 'CREATE INDEX "{name}" ON {table} (aggregate_id, id)', "(aggregate_id, id)"),
    ],
}


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[OutboxStore]:
    store = OutboxStore(f"sqlite:///{tmp_path / 'o.db'}")
    store.migrate()
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize("rows", [0, 50], ids=["empty", "rows"])
@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_migrate_builds_again_any_index_changed_by_hand_as_the_check_compares_it(
        request: pytest.FixtureRequest, kind: str, rows: int, tmp_path: Path) -> None:
    """`outbox check` fails naming both definitions, `outbox migrate` names what it rebuilt, and
    `outbox check` then passes; all three through the command line. On a table holding rows
    PostgreSQL builds CONCURRENTLY after its transaction, an empty one in it."""
    store: OutboxStore = request.getfixturevalue({"postgresql": "postgres", "mysql": "mysql",
                                                  "sqlite": "sqlite_store"}[kind])
    e = store.engine
    statements = [f"INSERT INTO {e.table} (message_id, topic, aggregate_type, aggregate_id, payload, headers, "
                  f"created_at) VALUES ('m{n}', 't', 'a', 'x{n % 5}', '{{}}', '{{}}', CURRENT_TIMESTAMP)"
                  for n in range(rows)]
    for suffix, ddl, _ in HAND_MADE[kind]:
        name = e.index_name(suffix)
        if kind != "mysql":
            statements.append(f'DROP INDEX {e.qualify(name) if kind == "postgresql" else e.index_ref(suffix)}')
        statements.append(ddl.format(name=name, table=e.table))
    raw(store, *statements)
    check = cli(store, "check", tmp_path)
    line = next(line for line in check.splitlines() if line.startswith("[FAIL] indexes"))
    expected = e.expected_indexes()
    for suffix, _, live in HAND_MADE[kind]:
        name = e.index_name(suffix)
        assert f"{name} is {live}, not {expected[name].text()}" in line, line
    report = cli(store, "migrate", tmp_path)
    rebuilt = ", ".join(sorted(e.index_name(suffix) for suffix, _, _ in HAND_MADE[kind]))
    assert f"repaired (rebuilt {rebuilt})" in report, report
    assert line.endswith(": run `outbox migrate`, which builds them again as it defines them"), line
    assert "[ok  ] indexes" in cli(store, "check", tmp_path)
    assert cli(store, "migrate", tmp_path).strip().endswith("nothing to change")


def test_a_sqlite_migration_that_fails_half_way_leaves_the_index_it_dropped(sqlite_store: OutboxStore,
                                                                          tmp_path: Path) -> None:
    """`outbox migrate` on SQLite ran each step in a transaction of its own (the engine's
    connections have no implicit BEGIN): a rebuild that failed after its DROP INDEX (a
    `message_id` made unique again over two rows of one id) left the table without the index,
    and a claim between a DROP and its CREATE found none. Its steps run in one transaction
    under the writer lock (``SqliteEngine.lock_migration``): the failure leaves the index as it was."""
    e = sqlite_store.engine
    name = e.index_name("message_id")
    row = ("INSERT INTO outbox (message_id, topic, aggregate_type, aggregate_id, payload) "
           "VALUES ('m', 't', 'a', 'x', '{}')")
    raw(sqlite_store, f'DROP INDEX "{name}"', f'CREATE INDEX "{name}" ON outbox (message_id)', row, row)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    failed = subprocess.run([sys.executable, "-m", "outbox.cli", "migrate"], capture_output=True, text=True,
                            cwd=tmp_path, env={**clean, "OUTBOX_DATABASE_URL": sqlite_store.url}, timeout=120)
    assert failed.returncode == 1 and "UNIQUE constraint failed" in failed.stderr, failed
    state, detail = indexes_line(sqlite_store)
    assert state == FAIL and detail.startswith(f"{name} is (message_id), not UNIQUE (message_id)"), detail


@pytest.mark.parametrize("rows", [0, 50], ids=["empty", "rows"])
def test_postgresqls_migrate_keeps_an_index_whose_storage_parameters_were_tuned(postgres: OutboxStore, rows: int,
                                                                                 tmp_path: Path) -> None:
    """An index tuned by its DBA (``ALTER INDEX ... SET (fillfactor = 70)``, ``deduplicate_items``)
    is defined as the migration defines it, as `outbox check` compares it (which said ok). The
    migration's probes compared pg_get_indexdef's whole text, ``WITH (...)`` included: `outbox
    migrate` said "repaired (rebuilt ix_..._claim_ready)", built the index again CONCURRENTLY
    on a table of a million rows, and dropped the tuning (found in review)."""
    e = postgres.engine
    statements = [f"INSERT INTO {e.table} (message_id, topic, aggregate_type, aggregate_id, payload) "
                  f"VALUES ('m{n}', 't', 'a', 'x{n % 5}', '{{}}')" for n in range(rows)]
    tuned = {suffix: e.qualify(e.index_name(suffix)) for suffix in ("message_id", "claim_ready")}
    raw(postgres, *statements, f"ALTER INDEX {tuned['message_id']} SET (deduplicate_items = off)",
        f"ALTER INDEX {tuned['claim_ready']} SET (fillfactor = 70)")
    assert "[ok  ] indexes" in cli(postgres, "check", tmp_path)
    assert cli(postgres, "migrate", tmp_path).strip().endswith("nothing to change")
    conn = e.connect(postgres.url)
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT c.relname, c.reloptions FROM pg_class c WHERE c.oid IN (to_regclass(%s), to_regclass(%s))",
                       list(tuned.values()))
        options = {str(name): list(opts or []) for name, opts in cursor.fetchall()}
    finally:
        conn.close()
    assert options == {e.index_name("message_id"): ["deduplicate_items=off"],
                       e.index_name("claim_ready"): ["fillfactor=70"]}, options
