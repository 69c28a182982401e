"""SQLite, the embedded default: the standard library's sqlite3 in WAL mode.

Several processes may share the file. Every relay write is a short
``BEGIN IMMEDIATE`` transaction (SQLite has one writer at a time, so there is no
claim race to defend against) and waits on the busy timeout instead of failing.
An application's transactions must begin as writers too: a deferred one that reads
first fails at once when a relay's heartbeat commits after its read (docs/relay.md,
"SQLite: application transactions").
Timestamps are ISO-8601 text in UTC, which sorts and compares correctly.
A fork waits for the engine's connections to be out of use in the process's other threads, and
the child never closes what it inherited (``ForkGate``; docs/internals.md, "Worker processes").
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, ClassVar

from ...core.errors import ConfigError
from ...core.model import NewEvent
from ...core.redact import redact
from .base import Engine, IndexDiffers, IndexShape

BUSY_TIMEOUT_S = 30.0
#: How long a fork waits for the engine's connections to be out of use in the process's other
#: threads: a statement waits at most the busy timeout for the file's lock.
FORK_WAIT_S = BUSY_TIMEOUT_S
log = logging.getLogger("outbox.storage.engines.sqlite")
_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

#: What ``outbox migrate`` adds for a missing column: the table's types and defaults, NULL
#: allowed where the writer gives the value (the rows already there have none). SQLite adds
#: created_at, whose default is not a constant, to an empty table only.
_ADDED_COLUMNS = (
    *((column, "TEXT NULL") for column in ("message_id", "topic", "aggregate_type", "aggregate_id",
                                            "partition_key")),
    ("payload", "TEXT NULL CHECK (json_valid(payload))"),
    ("headers", "TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(headers))"),
    ("trace_id", "TEXT NULL"),
    ("status", "INTEGER NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 4)"),
    ("attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("claimed_at", "TEXT NULL"),
    ("next_retry_at", "TEXT NULL"),
    ("created_at", f"TEXT NOT NULL DEFAULT ({_NOW})"),
    *((column, "TEXT NULL") for column in ("processed_at", "last_error", "lease_token")),
)


def sqlite_path(url: str) -> str:
    """``sqlite:///relative.db``, ``sqlite:////abs/path.db`` or ``sqlite://:memory:``; the scheme
    in any case and with a ``+driver`` suffix, as the start-up check takes it (``checks.database_scheme``)."""
    scheme, _, rest = url.partition(":")
    if scheme.lower().split("+", 1)[0] != "sqlite":
        raise ValueError(f"not a sqlite URL: {url!r}")
    if rest.startswith("///"):
        return rest[3:] or ":memory:"
    if rest.startswith("//"):
        return rest[2:] or ":memory:"
    return rest or ":memory:"


class ForkGate:
    """No fork while another thread uses one of the engine's connections (docs/internals.md,
    "Worker processes"). SQLite keeps the locks a process holds on a file in that process's
    memory, shared by all its connections to the file; a child forked while a thread held the
    write lock inherits that record and not the lock, and none of the child's connections could
    ever write: each ``BEGIN IMMEDIATE`` was refused in-process until the busy timeout, again on
    every retry. So a fork waits (at most ``FORK_WAIT_S``) until no other thread is inside
    ``Engine.in_use``, and no new use starts until it has forked. The child keeps every
    connection it inherited, never closing it: a close rolls back through the memory the WAL
    index shares with the parent (https://www.sqlite.org/howtocorrupt.html, 2.6). Where the
    wait ran out, the child refuses to connect (``spoiled``) instead of hanging."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._users: dict[int, int] = {}  # thread -> depth of its uses
        self._forking: int | None = None  # the thread that forks
        self.made = False  # this process has made a connection: only then is there anything to do
        self._at_fork: list[Any] = []  # the connections alive as the process forks
        self._busy_at_fork: str | None = None
        #: In a child: what its parent's threads were doing with SQLite when it forked, if any.
        self.spoiled: str | None = None
        #: In a child: the connections it inherited, kept so that none is ever closed here.
        self.inherited: list[Any] = []

    @contextmanager
    def held(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if me not in self._users and self._forking not in (None, me):
                self._cond.wait_for(lambda: self._forking is None, timeout=FORK_WAIT_S)
            self._users[me] = self._users.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                depth = self._users.pop(me) - 1
                if depth:
                    self._users[me] = depth
                self._cond.notify_all()

    def before_fork(self) -> None:
        if not self.made:
            return
        me = threading.get_ident()
        with self._cond:
            self._forking = me
            self._cond.wait_for(lambda: not self._users.keys() - {me}, timeout=FORK_WAIT_S)
            names = {t.ident: t.name for t in threading.enumerate()}
            self._busy_at_fork = ", ".join(names.get(t, str(t)) for t in self._users) or None
        # Every sqlite3 connection, the application's too (``type``: no ``__class__`` of a lazy proxy).
        self._at_fork = [o for o in gc.get_objects() if issubclass(type(o), sqlite3.Connection)]

    def after_in_parent(self) -> None:
        if not self.made:
            return
        self._at_fork = []
        with self._cond:
            self._forking = None
            self._cond.notify_all()
            busy, self._busy_at_fork = self._busy_at_fork, None
        if busy:
            log.warning("outbox: this process forked while its thread(s) %s used SQLite (the fork waits at most "
                        "%g s for the others): the child cannot use the database (docs/internals.md, \"Worker "
                        "processes\")", busy, FORK_WAIT_S)

    def after_in_child(self) -> None:
        if not self.made:
            return
        self._cond = threading.Condition(threading.Lock())  # another thread may have held it
        self._users, self._forking = {}, None
        # Sticky: a child of a spoiled process inherits the same foreign lock records.
        self.spoiled, self._busy_at_fork = self.spoiled or self._busy_at_fork, None
        for conn in self._at_fork:
            _keep_for_good(conn)
        self.inherited.extend(self._at_fork)
        self._at_fork = []


def _keep_for_good(conn: Any) -> None:
    """One more reference to ``conn`` that is never given back, so that not even the
    interpreter's exit deallocates it (which closes it)."""
    with suppress(AttributeError, OSError):  # not CPython: ``ForkGate.inherited`` keeps it until exit
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))


FORKS = ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=FORKS.before_fork, after_in_parent=FORKS.after_in_parent,
                        after_in_child=FORKS.after_in_child)


def _lenient_text(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


class SqliteEngine(Engine):
    name = "sqlite"
    now: ClassVar[str] = _NOW
    concurrent_writes: ClassVar[bool] = False  # one writer at a time, whatever the connections
    #: A list longer than this goes to ``IN`` as one JSON parameter (``in_list``).
    LONG_LIST = 500

    def in_list(self, values: Sequence[Any]) -> tuple[str, list[Any]]:
        """A long list as one JSON array read by ``json_each``: SQLite allows 32,766
        parameters a statement by default (999 before 3.32), and a claim's window over many
        aggregates bound more (``OUTBOX_BATCH_SIZE`` x the window, twice), failing every
        claim with "too many SQL variables" (found in review)."""
        if len(values) <= self.LONG_LIST or not all(isinstance(v, (int, str)) for v in values):
            return super().in_list(values)
        return "(SELECT value FROM json_each(?))", [json.dumps(list(values))]

    def qualify(self, name: str) -> str:
        # A schema on SQLite is an attached database; "main" is the file itself.
        return self.quote(name) if self.schema in (None, "main") else f"{self.quote(self.schema)}.{self.quote(name)}"

    def now_plus_ms(self) -> str:
        return "strftime('%Y-%m-%d %H:%M:%f', 'now', (? / 1000.0) || ' seconds')"

    # Without statistics (the relay runs no ANALYZE) SQLite read the claim's window and the
    # window's aggregates' first open rows through (status, processed_at), every open row, and
    # with them it scanned the table: told which index (docs/internals.md, "Rows waiting for a
    # later time are not read"), where the table has them (``window_rows`` looks again whenever
    # the database's schema changed): a table another script made without them keeps claiming,
    # unhinted, as before, until `outbox migrate` makes them.
    _indexed: bool | None = None
    _schema_version: int | None = None  # the database's ``PRAGMA schema_version`` at that look

    migration_under_writer_lock = True  # a claim between a rebuild's DROP and CREATE failed (Engine's)

    def lock_migration(self, cursor: Any) -> float | None:
        # The migration's steps in one transaction under the writer lock, first to last
        # (docs/internals.md, "Rows waiting for a later time are not read"): on the engine's own
        # connections (no implicit BEGIN) `outbox migrate` ran each step in a transaction of its
        # own, so a claim between a rebuild's DROP INDEX and CREATE INDEX found no index, and a
        # step that failed left the ones before it (a dropped index) in place (found in review).
        # A caller's open transaction (Django's own_transaction, Alembic's) is the migration's already.
        # Asked first without waiting, so that `outbox migrate` can say it waited for another.
        if cursor.connection.in_transaction:
            return None
        seen = self._own_schema(cursor)
        busy = cursor.execute("PRAGMA busy_timeout").fetchone()[0]
        cursor.execute("PRAGMA busy_timeout = 0")
        try:
            cursor.execute("BEGIN IMMEDIATE")
            return 0.0
        except sqlite3.OperationalError as exc:
            if not self.is_transient(exc):
                raise
        finally:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy)}")
        started = time.monotonic()
        cursor.execute("BEGIN IMMEDIATE")
        waited = time.monotonic() - started
        # The writer lock is every writer's (a relay's claims, enqueues): a wait was for another
        # migration only where the table's definition changed meanwhile. Beside a running relay
        # `outbox migrate` said it had waited for one that never ran (found in review).
        return waited if self._own_schema(cursor) != seen else 0.0

    def _own_schema(self, cursor: Any) -> list[Any]:
        """The outbox table's and holders table's entries in the schema (their indexes too):
        what another migration of the table changes, and a relay's writes do not."""
        return cursor.execute(f"SELECT type, name, sql FROM {self.master()} WHERE tbl_name IN (?, ?) ORDER BY name",
                              [self.table_name, self.holders_name]).fetchall()

    def window_source(self) -> str:
        if not self._indexed:
            return self.table
        return f"{self.table} INDEXED BY {self.quote(self.index_name('claim_ready'))}"

    def chains_source(self) -> str:
        if not self._indexed:
            return self.table
        return f"{self.table} INDEXED BY {self.quote(self.index_name('agg_id_id'))}"

    def window_rows(self, cursor: Any, timeout_ms: int, size: int,
                    unblocked_behind: Sequence[int] | None = None) -> list[tuple]:
        # Looked at once per store until 7 December: a relay started before `outbox migrate`
        # made the indexes claimed unhinted until restarted, and one whose index was dropped
        # failed every claim ("no such index"). The schema's version, a header field, moves
        # with every schema change, and the claim's transaction holds it still.
        version = int(self.execute(cursor, f"PRAGMA {self.schema_prefix()}schema_version").fetchone()[0])
        if version != self._schema_version:
            wanted = [self.index_name("claim_ready"), self.index_name("agg_id_id")]
            found = self.execute(cursor, f"SELECT COUNT(*) FROM {self.master()} WHERE type = 'index' AND name IN (?, ?)",
                                 wanted).fetchone()
            self._indexed = int(found[0]) == len(wanted)
            self._schema_version = version
        return super().window_rows(cursor, timeout_ms, size, unblocked_behind)

    def id_range_source(self) -> str:
        # With no statistics (ANALYZE never ran) SQLite walks the (status, processed_at)
        # index over every done row for each page or delete chunk of an id range: the
        # rowid range instead (docs/pipeline.md, "How the jobs read the outbox").
        return f"{self.table} NOT INDEXED"

    def in_use(self) -> AbstractContextManager[None]:
        return FORKS.held()

    def connect(self, url: str) -> sqlite3.Connection:
        path = sqlite_path(url)
        if FORKS.spoiled is not None:
            raise sqlite3.OperationalError(
                f"this process was forked while its parent's thread(s) {FORKS.spoiled} used SQLite: the lock "
                "records it inherited are not its own, and it could never write the database; start it again "
                "(docs/internals.md, \"Worker processes\")")
        if path == ":memory:":
            # Private to the connection: `outbox migrate` "created the table" in one and exited
            # 0, and a relay on it never saw a row (found in review). A caller's own connection
            # is not made here: ``enqueue`` on an in-memory database of the caller's still works.
            raise ConfigError(f"OUTBOX_DATABASE_URL={redact(url)} is an in-memory SQLite database: each connection "
                              "gets its own, empty, gone when it closes, so what one command or worker writes no "
                              "other sees; give a file (sqlite:///outbox.db)")
        folder = os.path.dirname(os.path.abspath(path))
        if path != ":memory:" and not path.startswith("file:") and not os.path.isdir(folder):
            # sqlite3 says only "unable to open database file", which names neither.
            raise sqlite3.OperationalError(f"unable to open database file {os.path.abspath(path)}: its directory "
                                           f"{folder} does not exist (create it, or fix OUTBOX_DATABASE_URL)")
        if not self.creates_database and not path.startswith("file:") and not os.path.exists(path):
            # sqlite3 would make an empty file, here: a command or worker run from another
            # directory than the database's (./outbox.db by default) then said "table missing:
            # run `outbox migrate`", which made a second, empty outbox there (found in review).
            raise sqlite3.OperationalError(
                f"unable to open database file {os.path.abspath(path)}: it does not exist (nothing was created"
                + (f"; {path} is relative to the current directory" if not os.path.isabs(path) else "")
                + "): run this where the database is, or give its path in OUTBOX_DATABASE_URL "
                "(`outbox migrate` creates it)")
        FORKS.made = True
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        # A TEXT value that is not UTF-8 reads with lone surrogates instead of failing the
        # whole fetch: the claim then buries that row alone (docs/relay.md, "Bad rows").
        conn.text_factory = _lenient_text
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        return conn

    def _created_at_probe(self) -> tuple[str, list[Any]]:
        """A row when ``created_at`` need not or cannot be added: it is there, or the table
        holds rows, which SQLite cannot give a column whose default is not a constant. The
        migration then goes on with its other steps, and ``outbox check`` names the column
        (found in review: the whole migration failed, every run, repairing nothing)."""
        return (f"SELECT 1 WHERE EXISTS (SELECT 1 FROM pragma_table_info(?, ?) WHERE name = 'created_at') "
                f"OR EXISTS (SELECT 1 FROM {self.table})", [self.table_name, self.schema or "main"])

    def commits_each_statement(self, conn: Any) -> bool:
        # No implicit BEGIN (isolation_level None; Python 3.12's autocommit=True, which leaves
        # isolation_level as it was): outside the caller's own BEGIN each statement commits by itself.
        return (conn.isolation_level is None or _explicit_only(conn)) and not conn.in_transaction

    def begin(self, cursor: Any) -> None:
        # IMMEDIATE takes the write lock up front, so the read that plans a claim
        # cannot be overtaken by another process's write.
        if not cursor.connection.in_transaction:
            cursor.execute("BEGIN IMMEDIATE")

    def in_callers_transaction(self, conn: Any) -> bool:
        # No implicit BEGIN (isolation_level None, Python 3.12's autocommit=True): an open
        # transaction is the caller's own BEGIN.
        return conn.in_transaction and (conn.isolation_level is None or _explicit_only(conn))

    @contextmanager
    def own_transaction(self, conn: Any) -> Iterator[None]:
        """Begun IMMEDIATE where this opens it, so the block's reads are inside it and its first
        write cannot fail at once with "database is locked" because a relay's heartbeat
        committed after them (docs/relay.md, "SQLite: application transactions"). Python
        3.12's ``autocommit=True``: ``commit()`` and ``rollback()`` do nothing, so COMMIT and
        ROLLBACK are statements; with ``autocommit=False`` a transaction is always open."""
        explicit = _explicit_only(conn)
        if not conn.in_transaction and (explicit or _legacy(conn)):
            conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            _end(conn, "ROLLBACK", explicit)
            raise
        _end(conn, "COMMIT", explicit)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and (
            "locked" in str(exc) or "busy" in str(exc))

    #: The indexes ``migration`` makes: (suffix, columns, the partial predicate or None);
    #: ``message_id``'s is unique.
    INDEXES: ClassVar[tuple[tuple[str, str, str | None], ...]] = (
        ("message_id", "message_id", None), ("agg_id_id", "aggregate_id, id", "status IN (0, 1, 3)"),
        ("claim_ready", "next_retry_at, id", "status IN (0, 1, 3)"), ("done_processed_at", "status, processed_at", None))

    def expected_indexes(self) -> dict[str, IndexShape]:
        return {self.index_name(suffix): IndexShape(tuple(columns.split(", ")), unique=suffix == "message_id",
                                                    where=where)
                for suffix, columns, where in self.INDEXES}

    def _create_index(self, suffix: str) -> str:
        columns, where = next((c, w) for s, c, w in self.INDEXES if s == suffix)
        return (f"CREATE {'UNIQUE ' if suffix == 'message_id' else ''}INDEX IF NOT EXISTS {self.index_ref(suffix)} "
                f"ON {self.table_name_only()} ({columns})" + (f" WHERE {where}" if where else ""))

    def migration(self, native_json: bool = False) -> list[Any]:
        t = self.table

        def column_exists(column: str) -> tuple[str, list[Any]]:
            return ("SELECT 1 FROM pragma_table_info(?, ?) WHERE name = ?",
                    [self.table_name, self.schema or "main", column])

        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                message_id TEXT NOT NULL,
                topic TEXT NOT NULL,
                aggregate_type TEXT NOT NULL,
                aggregate_id TEXT NOT NULL,
                partition_key TEXT NULL,
                payload TEXT NOT NULL CHECK (json_valid(payload)),
                headers TEXT NOT NULL DEFAULT '{{}}' CHECK (json_valid(headers)),
                trace_id TEXT NULL,
                status INTEGER NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 4),
                attempts INTEGER NOT NULL DEFAULT 0,
                claimed_at TEXT NULL,
                next_retry_at TEXT NULL,
                created_at TEXT NOT NULL DEFAULT ({_NOW}),
                processed_at TEXT NULL,
                last_error TEXT NULL,
                lease_token TEXT NULL
            )""",
            # Every column of the contract but the id, repaired on a table an older release or
            # another script made (README, "The table").
            *((column_exists(column) if column != "created_at" else self._created_at_probe(),
               f"ALTER TABLE {t} ADD COLUMN {column} {ddl}") for column, ddl in _ADDED_COLUMNS),
            # Indexes an earlier release named in full (Engine.legacy_name): SQLite renames no
            # index, so the old one goes and today's is made (one writer at a time anyway).
            *(f"DROP INDEX IF EXISTS {self.index_ref_of(old)}" for old in map(self.legacy_index_name, self.index_suffixes)
              if old),
            # An index defined otherwise than expected_indexes says, as `outbox check` compares
            # it (IndexDiffers), is dropped and made again, under the migration's writer lock: an
            # earlier release's (claim_ready on (id): docs/internals.md, "Rows waiting for a later
            # time are not read") or one changed by hand (docs/operations.md).
            *(step for suffix, _, _ in self.INDEXES
              for step in ((IndexDiffers(self.index_name(suffix)), f"DROP INDEX {self.index_ref(suffix)}"),
                           self._create_index(suffix))),
            *self.holders_migration(),
        ]

    def holders_columns(self) -> str:
        return ("holder_id TEXT NOT NULL PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, "
                "started_at TEXT NOT NULL, beat_at TEXT NOT NULL")

    def is_missing_table(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)

    def is_missing_column(self, exc: BaseException) -> bool:
        # A read or update says "no such column"; an insert "table ... has no column named".
        return isinstance(exc, sqlite3.OperationalError) and (
            "no such column" in str(exc) or "has no column named" in str(exc))

    def table_name_only(self) -> str:
        return self.quote(self.table_name)

    def index_ref(self, suffix: str) -> str:
        return self.index_ref_of(self.index_name(suffix))

    def schema_prefix(self) -> str:
        """What names the database the outbox table is in (an attached one) before a table or a
        pragma: empty for the file itself."""
        return "" if self.schema in (None, "main") else f"{self.quote(self.schema)}."

    def master(self) -> str:
        """The schema table of the database the outbox table is in (an attached one's own)."""
        return f"{self.schema_prefix()}sqlite_master"

    def index_ref_of(self, index: str) -> str:
        # Index names carry the attached database's name; the table they index does not.
        name = self.quote(index)
        return name if self.schema in (None, "main") else f"{self.quote(self.schema)}.{name}"

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        cursor.execute(
            f"INSERT INTO {self.table} ({self.INSERT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (message_id) DO NOTHING", self.event_params(event))
        if cursor.rowcount == 1:
            return int(cursor.lastrowid)
        cursor.execute(f"SELECT id FROM {self.table} WHERE message_id = ?", (event.message_id,))
        return int(cursor.fetchone()[0])


def _legacy(conn: Any) -> bool:
    """The sqlite3 module's own transaction control (``isolation_level``): before Python
    3.12 always, since then unless the connection's ``autocommit`` is True or False."""
    return getattr(conn, "autocommit", -1) == getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)


def _explicit_only(conn: Any) -> bool:
    """Python 3.12's ``autocommit=True``: no implicit BEGIN, and ``commit()`` does nothing."""
    return getattr(conn, "autocommit", None) is True


def _end(conn: Any, statement: str, explicit: bool) -> None:
    if explicit:
        conn.execute(statement)
    elif statement == "COMMIT":
        conn.commit()
    else:
        conn.rollback()
