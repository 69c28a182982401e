"""The databases a drain benchmark runs on, and only what differs between them: how to
connect, how to load a backlog fast, how to empty the table, and the raw loop's SQL
(docs/benchmarks.md, "Issue 11: the ordered drain against the raw loop (`python -m bench.drain`)").

* ``postgresql`` (the default): psycopg, the backlog loaded by ``COPY``, the raw loop's
  ``SELECT ... FOR UPDATE SKIP LOCKED``.
* ``mysql`` (MariaDB or MySQL): PyMySQL in ``READ COMMITTED`` (as the relay's connections),
  the backlog loaded by ``executemany`` in chunks (PyMySQL sends each chunk as one
  multi-row ``INSERT``), the raw loop's ``SELECT ... FOR UPDATE SKIP LOCKED``.
* ``sqlite``: a file in the run's work directory, the standard library's sqlite3 in WAL mode
  with ``synchronous=NORMAL`` (the relay's settings), ``executemany``; the raw loop takes the
  one write lock with ``BEGIN IMMEDIATE`` before its ``SELECT`` (SQLite has one writer: the
  loop's processes take turns, and so do the relay's claims).

Every engine's statements are written with ``?`` placeholders; ``sql`` turns them into the
driver's. The relay itself needs nothing from here: it runs on every engine through
``OUTBOX_DATABASE_URL`` (``Run.database_url``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol


class Run(Protocol):
    """What an engine reads of a bench run (``bench.services.Run``, which imports this module)."""

    postgres_url: str
    mysql_url: str
    workdir: Path
    tag: str

#: The columns a backlog row fills (``make_event``'s fields), in this order.
LOAD_COLUMNS = ("message_id", "topic", "aggregate_type", "aggregate_id", "partition_key", "payload", "headers",
                "trace_id")
#: Rows per ``executemany`` where the load is not a ``COPY``.
LOAD_CHUNK = 500


class BenchEngine:
    """One database's specifics. ``connect`` gives a DB-API connection with autocommit off
    (SQLite: the sqlite3 module's autocommit mode, and ``begin`` opens the transaction)."""

    name = ""
    #: What ``require_services`` names and probes, (service, port); None: nothing to probe.
    service: tuple[str, int] | None = None
    placeholder = "%s"
    #: The raw loop's rows to publish: text, whatever the column's type.
    text_columns = "id, message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers"
    #: The raw loop's pending rows (its ``SELECT``'s ``WHERE``), the way the engine's indexes read.
    pending = "status = 0"
    #: The raw loop locks the rows it reads (and skips those another process locked).
    lock = " FOR UPDATE SKIP LOCKED"
    now = "CURRENT_TIMESTAMP"

    def database_url(self, run: Run) -> str:
        raise NotImplementedError

    def connect(self, url: str) -> Any:
        raise NotImplementedError

    def begin(self, conn: Any) -> None:
        """Start a transaction that will write (nothing to do where a statement opens one)."""

    def sql(self, text: str) -> str:
        return text if self.placeholder == "?" else text.replace("?", self.placeholder)

    def truncate(self, table: str) -> str:
        return f"TRUNCATE TABLE {table}"

    def analyze(self, table: str) -> list[str]:
        """After a load, so the relay's first claims are planned on the table's real size."""
        return []

    def flush(self, conn: Any) -> None:
        """After a load: write it out now, so its writeback does not land in the measurement."""

    def load(self, conn: Any, table: str, rows: Iterable[Sequence[Any]]) -> None:
        """Insert ``rows`` (``LOAD_COLUMNS``) in the open transaction."""
        cols = ", ".join(LOAD_COLUMNS)
        insert = self.sql(f"INSERT INTO {table} ({cols}) VALUES ({', '.join('?' * len(LOAD_COLUMNS))})")
        cur = conn.cursor()
        chunk: list[Sequence[Any]] = []
        for row in rows:
            chunk.append(row)
            if len(chunk) >= LOAD_CHUNK:
                cur.executemany(insert, chunk)
                chunk = []
        if chunk:
            cur.executemany(insert, chunk)

    def raw_select(self, table: str) -> str:
        """The raw loop's claim: the ``?`` oldest pending rows."""
        return self.sql(f"SELECT {self.text_columns} FROM {self.raw_source(table)} WHERE {self.pending} "
                        f"ORDER BY id LIMIT ?{self.lock}")

    def raw_source(self, table: str) -> str:
        return table

    def raw_done(self, table: str, ids: Sequence[int]) -> tuple[str, Sequence[Any]]:
        """The raw loop's mark done of ``ids``: statement and parameters."""
        return (self.sql(f"UPDATE {table} SET status = 2, processed_at = {self.now} "
                         f"WHERE id IN ({', '.join('?' * len(ids))})"), list(ids))


class Postgres(BenchEngine):
    name = "postgresql"
    service = ("PostgreSQL", 5432)
    text_columns = "id, message_id, topic, aggregate_type, aggregate_id, partition_key, payload::text, headers::text"
    # The predicate of the table's partial index on open rows, so the loop reads that index as
    # the relay's claim does (docs/internals.md, "The lease is a HOT update on PostgreSQL").
    pending = "status = 0 AND processed_at IS NULL"
    now = "now()"

    def database_url(self, run: Run) -> str:
        return run.postgres_url

    def connect(self, url: str) -> Any:
        import psycopg

        return psycopg.connect(url, autocommit=False)

    def truncate(self, table: str) -> str:
        return f"TRUNCATE {table}"

    def analyze(self, table: str) -> list[str]:
        return [f"ANALYZE {table}"]

    def flush(self, conn: Any) -> None:
        try:
            conn.execute("CHECKPOINT")
            conn.commit()
        except Exception:  # noqa: BLE001 - needs a superuser; only a noise reduction
            conn.rollback()

    def load(self, conn: Any, table: str, rows: Iterable[Sequence[Any]]) -> None:
        with conn.cursor() as cur, cur.copy(f"COPY {table} ({', '.join(LOAD_COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)

    def raw_done(self, table: str, ids: Sequence[int]) -> tuple[str, Sequence[Any]]:
        return f"UPDATE {table} SET status = 2, processed_at = now() WHERE id = ANY(%s)", [list(ids)]


class Mysql(BenchEngine):
    name = "mysql"
    service = ("MariaDB/MySQL", 3306)
    now = "UTC_TIMESTAMP(3)"

    def database_url(self, run: Run) -> str:
        return run.mysql_url

    def connect(self, url: str) -> Any:
        import pymysql

        from outbox.storage.engines.mysql import pymysql_kwargs

        return pymysql.connect(**pymysql_kwargs(url), autocommit=False,
                               init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")

    def analyze(self, table: str) -> list[str]:
        return [f"ANALYZE TABLE {table}"]

    def load(self, conn: Any, table: str, rows: Iterable[Sequence[Any]]) -> None:
        # created_at has no default on MySQL (the relay's insert writes UTC_TIMESTAMP(3)); a
        # parameter rather than the function keeps PyMySQL's multi-row INSERT for executemany.
        now = datetime.now(UTC).replace(tzinfo=None)
        cols = ", ".join(LOAD_COLUMNS)
        insert = f"INSERT INTO {table} ({cols}, created_at) VALUES ({', '.join(['%s'] * (len(LOAD_COLUMNS) + 1))})"
        with conn.cursor() as cur:
            chunk: list[Sequence[Any]] = []
            for row in rows:
                chunk.append((*row, now))
                if len(chunk) >= LOAD_CHUNK:
                    cur.executemany(insert, chunk)
                    chunk = []
            if chunk:
                cur.executemany(insert, chunk)


class Sqlite(BenchEngine):
    name = "sqlite"
    placeholder = "?"
    # The claim's partial index on open rows (status IN (0, 1, 3)) in id order, named: left to
    # itself the planner reads (status, processed_at) and sorts every pending row per SELECT.
    pending = "status IN (0, 1, 3) AND status = 0"
    lock = ""  # BEGIN IMMEDIATE took the one write lock already
    now = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    #: Seconds a connection waits for the write lock (the relay's busy timeout).
    busy_timeout_s = 30.0

    def database_url(self, run: Run) -> str:
        return f"sqlite:///{run.workdir / f'outbox-{run.tag}.db'}"

    def connect(self, url: str) -> Any:
        import sqlite3

        from outbox.storage.engines.sqlite import sqlite_path

        conn = sqlite3.connect(sqlite_path(url), timeout=self.busy_timeout_s, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def raw_source(self, table: str) -> str:
        from outbox.storage.engines.sqlite import SqliteEngine

        return f"{table} INDEXED BY {SqliteEngine(table=table).index_name('claim_ready')}"

    def begin(self, conn: Any) -> None:
        if not conn.in_transaction:
            conn.execute("BEGIN IMMEDIATE")

    def truncate(self, table: str) -> str:
        return f"DELETE FROM {table}"

    # No ANALYZE: SQLite never gathers statistics by itself, so the relay's claims are planned
    # as in an application that never ran it.

    def flush(self, conn: Any) -> None:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


ENGINES: dict[str, BenchEngine] = {e.name: e for e in (Postgres(), Mysql(), Sqlite())}


def engine(name: str) -> BenchEngine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (one of {', '.join(ENGINES)})") from None


def engine_of_url(url: str) -> BenchEngine:
    """The engine of a database URL (the relay's own reading of it)."""
    from outbox.storage.engines import kind_of_url

    return engine(kind_of_url(url))


def engine_names(text: str) -> list[str]:
    """``--engine``'s value: one engine or a comma-separated list, each checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        engine(name)
    return names


def query(conn: Any, text: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows of one statement on any engine's connection (sqlite3 cursors are no context managers)."""
    cur = conn.cursor()
    try:
        if params:
            cur.execute(text, params)
        else:  # no parameters: no placeholder parsing (a literal % stays one)
            cur.execute(text)
        return list(cur.fetchall()) if cur.description else []
    finally:
        cur.close()
