"""MySQL 8 and MariaDB 10.6+ through PyMySQL.

MySQL has no UPDATE ... RETURNING and will not let an UPDATE read its own table in
a subquery, so the claim is the generic plan from ``Engine.claim``: one plain read of the
window, one probe, one lock of the planned chains (``FOR UPDATE SKIP LOCKED``, which reads
the rows the claim returns), one UPDATE (and one for rows going dead), in a single short
READ COMMITTED transaction. Id-like columns use a binary collation so
``Order-1`` and ``order-1`` stay two aggregates and two message ids. Every session bounds
its transactions' life (``session_sql``, ``bounded_socket``; docs/relay.md, "A network cut").
"""

from __future__ import annotations

import functools
import hashlib
import re
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from ...core.checks import MysqlTls, mysql_tls, mysql_url_options
from ...core.config import session_bounds
from ...core.errors import ConfigError, EnqueueError, StoreError
from ...core.model import NewEvent
from .base import Engine, IndexDiffers, IndexShape, derived_name, duration, tcp_keepalive

#: Deadlock, lock wait timeout, server gone away, lost connection, cannot connect,
#: query interrupted by shutdown, a connection the server ended for inactivity (MySQL 8.0.24+
#: says so, 4031; see ``session_sql``).
_TRANSIENT_CODES = {1213, 1205, 2006, 2013, 2003, 2055, 1053, 4031}
_DISCONNECT_CODES = {2006, 2013, 2003, 2055, 4031}

#: Seconds a connection attempt may take.
CONNECT_TIMEOUT_S = 10
#: Seconds a migration waits for another one (GET_LOCK).
MIGRATION_LOCK_TIMEOUT_S = 600
#: How long a migration's DDL step waits for the table's metadata lock (hold_migration_lock).
MIGRATION_LOCK_WAIT_S = 10

#: A character outside the Basic Multilingual Plane: four bytes in UTF-8, which only a
#: utf8mb4 connection carries (``MysqlEngine.insert_event``).
_ASTRAL = re.compile("[\U00010000-\U0010FFFF]")
#: What makes usable again an index the optimizer passes over, by its state (``index_state_sql``):
#: a flag of the catalog, no rebuild (``migration``; ``Engine.usable_again``).
USABLE_AGAIN = {"IGNORED": "NOT IGNORED", "INVISIBLE": "VISIBLE"}
#: The text columns' character set and collation, as the table's (``migration``).
_BIN = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
#: The text columns the relay's SQL compares (a unique index, WHERE, GROUP BY): the enqueue's
#: idempotency key, the chains' key, the topic filters, the fences' token. In a case-insensitive
#: collation message id 'ABC' after 'abc' was a duplicate and dropped (``MysqlEngine.column_problem``;
#: docs/operations.md, "Is it set up right? `outbox check`").
EXACT_COLUMNS = ("message_id", "topic", "aggregate_id", "lease_token")


def _is_mysqldb(conn: Any) -> bool:
    """A mysqlclient (``MySQLdb``) connection, Django's default MySQL driver, rather than PyMySQL's."""
    return type(conn).__module__.split(".", 1)[0] == "MySQLdb"


def _mysqldb_in_transaction(conn: Any) -> bool:
    """Is a transaction open on the autocommit mysqlclient connection ``conn`` (a BEGIN of the
    caller's, or ``outbox.transaction``'s)? mysqlclient does not show the server's IN_TRANS
    flag, so MariaDB is asked (``@@in_transaction``, one round trip). MySQL has no such
    variable: False there, as before (docs/waking-and-metrics.md, "outbox.transaction")."""
    if "mariadb" not in conn.get_server_info().lower():
        return False
    import MySQLdb.cursors
    cursor = conn.cursor(MySQLdb.cursors.Cursor)
    try:
        cursor.execute("SELECT @@in_transaction")
        row = cursor.fetchone()
    finally:
        cursor.close()
    return bool(row and row[0])


def pymysql_kwargs(url: str) -> dict[str, Any]:
    """``pymysql.connect``'s arguments for a MySQL/MariaDB URL: its server and login, and its
    query parameters (``checks.MYSQL_URL_PARAMETERS``; any other is refused), TLS as an
    ``ssl`` context (``tls_context``; docs/relay.md, "TLS to the database")."""
    parts = urlsplit(url)
    options = mysql_url_options(url)
    kwargs: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": parts.path.lstrip("/") or None,
        "charset": options.pop("charset", "utf8mb4"),
    }
    if "unix_socket" in options:
        kwargs["unix_socket"] = options.pop("unix_socket")
    for name in ("read_timeout", "write_timeout"):  # PyMySQL's client-side timeouts, off unless given
        if name in options:
            try:
                kwargs[name] = int(options[name])
            except ValueError:
                raise ValueError(f"OUTBOX_DATABASE_URL: {name}={options[name]!r} is not a whole number of "
                                 "seconds") from None
            if kwargs[name] <= 0:
                raise ValueError(f"OUTBOX_DATABASE_URL: {name}={kwargs[name]} must be at least 1 second")
    tls = mysql_tls(options)
    if tls == "disabled":
        kwargs["ssl_disabled"] = True
    elif isinstance(tls, MysqlTls):
        kwargs["ssl"] = tls_context(tls)  # PyMySQL then refuses a server that offers no TLS
    return kwargs


@functools.cache
def preferred_context() -> ssl.SSLContext:
    """The process's one context for PyMySQL's PREFERRED mode (no TLS parameter in the URL: TLS
    when the server offers it, nothing checked), made as PyMySQL 2 makes it for each connection."""
    ctx = ssl.create_default_context()
    ctx.verify_flags &= ~ssl.VERIFY_X509_STRICT
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def tls_context(tls: MysqlTls) -> ssl.SSLContext:
    """The ``ssl.SSLContext`` of a required TLS connection: the URL's CA (else the system's),
    client certificate and checks. A file that cannot be read is a ``ConfigError`` naming it."""
    what = " ".join(f"{name}={value!r}" for name, value in (("ssl_ca", tls.ca), ("ssl_capath", tls.capath))
                    if value) or "the system's CA certificates"
    try:
        ctx = ssl.create_default_context(cafile=tls.ca, capath=tls.capath)
        ctx.check_hostname = tls.verify_identity
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.verify_cert else ssl.CERT_NONE
        if tls.cert:
            what = f"ssl_cert={tls.cert!r}" + (f" ssl_key={tls.key!r}" if tls.key else "")
            ctx.load_cert_chain(tls.cert, tls.key, tls.key_password)
        if tls.cipher:
            what = f"ssl_cipher={tls.cipher!r}"
            ctx.set_ciphers(tls.cipher)
    except OSError as exc:  # ssl.SSLError is one
        raise ConfigError(f"OUTBOX_DATABASE_URL: {what} cannot be used: {exc}") from exc
    return ctx


def bounded_socket(host: str, port: int, tcp_timeout_s: int) -> socket.socket:
    """A TCP connection to the server whose keepalives and ``TCP_USER_TIMEOUT`` find a silent
    server within ``tcp_timeout_s`` (where the platform has the options: Linux has all)."""
    sock = socket.create_connection((host, port), CONNECT_TIMEOUT_S)
    try:
        for level, option, value in socket_options(tcp_timeout_s):
            sock.setsockopt(level, option, value)
    except BaseException:
        sock.close()
        raise
    return sock


def socket_options(tcp_timeout_s: int) -> list[tuple[int, int, int]]:
    """``setsockopt`` arguments of ``bounded_socket`` (those this platform knows)."""
    idle, interval, count = tcp_keepalive(tcp_timeout_s)
    wanted = [(socket.IPPROTO_TCP, "TCP_NODELAY", 1), (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
              (socket.IPPROTO_TCP, "TCP_KEEPIDLE", idle), (socket.IPPROTO_TCP, "TCP_KEEPINTVL", interval),
              (socket.IPPROTO_TCP, "TCP_KEEPCNT", count),
              (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", tcp_timeout_s * 1000)]
    return [(level, getattr(socket, name), value) for level, name, value in wanted if hasattr(socket, name)]


def session_sql(server_info: str, idle_transaction_timeout_s: int, tcp_timeout_s: int) -> str:
    """The session bounds of a relay connection (docs/relay.md, "A network cut"). The server
    ends a session left idle inside a transaction after ``idle_transaction_timeout_s``:
    MariaDB has ``idle_transaction_timeout`` (10.3+); MySQL has no such variable, so there
    ``wait_timeout`` ends any session idle that long (the store reconnects at the next use).
    A session stuck reading a statement or sending a result gives up after ``tcp_timeout_s``
    (``net_read_timeout``, ``net_write_timeout``), and so does a wait for a row lock
    (``innodb_lock_wait_timeout``: its holder is either working or ended within the bounds)."""
    idle = int(idle_transaction_timeout_s)
    tcp = int(tcp_timeout_s)
    ended_idle = "idle_transaction_timeout" if "mariadb" in server_info.lower() else "wait_timeout"
    return (f"SET SESSION {ended_idle} = {idle}, SESSION net_read_timeout = {tcp}, "
            f"SESSION net_write_timeout = {tcp}, SESSION innodb_lock_wait_timeout = {tcp}")


@functools.lru_cache(maxsize=8)
def isolation_variable(server_info: str) -> str:
    """The session's isolation level, by ``server_info``'s server: ``@@transaction_isolation``
    on MySQL 5.7.20 and later (8.0 has no other name) and on MariaDB 11.1 and later; before
    those, ``@@tx_isolation``."""
    mariadb = re.search(r"(\d+)\.(\d+)\.(\d+)-MariaDB", server_info, re.IGNORECASE)
    version = mariadb or re.match(r"(\d+)\.(\d+)\.(\d+)", server_info)
    if version is None:
        return "@@transaction_isolation"
    since = (11, 1, 0) if mariadb else (5, 7, 20)
    return "@@tx_isolation" if tuple(int(part) for part in version.groups()) < since else "@@transaction_isolation"


class MysqlEngine(Engine):
    name = "mysql"
    identifier_limit = (64, False)  # a longer name was refused (the migration stopped there)
    placeholder = "%s"
    now: ClassVar[str] = "UTC_TIMESTAMP(3)"
    lock_candidates: ClassVar[str] = " FOR UPDATE SKIP LOCKED"

    #: The server's version as its connection's handshake gave it (``get_server_info``), read by
    #: ``read_server``: MariaDB and MySQL name apart an index the optimizer passes over
    #: (``index_state_sql``).
    server_version: str | None = None

    def quote(self, identifier: str) -> str:
        return f"`{identifier}`"

    def now_plus_ms(self) -> str:
        return "TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3))"

    def read_server(self, cursor: Any) -> None:
        # The handshake's version, as the session bounds and the enqueue's isolation read it
        # (session_sql, isolation_variable): no round trip. Every cursor here is the engine's
        # own (cursor_for) on a PyMySQL or mysqlclient connection, Django's and Alembic's too, and
        # both drivers' cursors have the connection; a SELECT VERSION() was a second way to know.
        self.server_version = str(cursor.connection.get_server_info())

    @property
    def mariadb(self) -> bool:
        return "mariadb" in (self.server_version or "").lower()

    def index_state_sql(self) -> str:
        """The expression of ``information_schema.statistics`` that names an index the optimizer
        passes over (``IndexShape.state``) on the server ``read_server`` read: MariaDB's IGNORED
        (10.6+: ``ALTER TABLE ... ALTER INDEX ... IGNORED``), MySQL's INVISIBLE (8.0). A hint naming
        one fails: every claim failed with error 1176 (its FORCE INDEX names claim_ready) while
        `outbox check` said ok (docs/operations.md, "Is it set up right? `outbox check`")."""
        if self.mariadb:
            return "CASE WHEN ignored = 'YES' THEN 'IGNORED' END"
        return "CASE WHEN is_visible = 'NO' THEN 'INVISIBLE' END"

    def usable_again(self, state: str) -> str | None:
        return USABLE_AGAIN.get(state)

    def exact(self, column: str) -> str:
        return f"CAST({column} AS BINARY)"  # utf8mb4_bin pads: 'x' = 'x ' (Engine.exact)

    # The claim reads open rows through ``claim_ready`` (status, next_retry_at, id) only:
    # without these, its reads walked every done row kept for the retention period, per claim
    # (docs/internals.md, "Claims on MySQL and MariaDB read open rows only").
    def open_rows_source(self) -> str:
        return f"{self.table} FORCE INDEX ({self.quote(self.index_name('claim_ready'))})"

    # The first open row of each of the window's aggregates: read per aggregate through
    # ``agg_id_id`` (aggregate_id, status, id), its open rows only, not every open row before
    # the window's last (docs/internals.md, "Rows waiting for a later time are not read").
    def chains_source(self) -> str:
        return f"{self.table} FORCE INDEX ({self.quote(self.index_name('agg_id_id'))})"

    def window_statement(self, timeout_ms: int, size: int) -> tuple[str, list[Any]]:
        # One branch per status and time, each read in the index's order from its own range
        # and stopped after ``size`` rows; then the oldest ``size`` of them. The rows without a
        # time (pending, claimed) are read in id order; those whose time has come (a due retry, a
        # delayed release) in the order of that time: rows still waiting for their time are never
        # read (docs/internals.md, "Rows waiting for a later time are not read").
        due = f"next_retry_at <= {self.now}"
        branches, params = [], []
        # Without a time ORDER BY id, not (next_retry_at, id): MariaDB sorted every row of the
        # branch for that one, and takes IS NULL as an equality for this one.
        ready, by_time = "id", "next_retry_at, id"
        for status, cond, order in ((0, "next_retry_at IS NULL", ready),
                                    (1, f"next_retry_at IS NULL AND claimed_at < {self.now_plus_ms()}", ready),
                                    (0, due, by_time), (3, due, by_time)):
            branches.append(f"(SELECT id, aggregate_id, status, attempts FROM {self.open_rows_source()} "
                            f"WHERE status = {status} AND {cond} ORDER BY {order} LIMIT ?)")
            params += [-timeout_ms] * cond.count("?") + [size]
        return " UNION ALL ".join(branches) + " ORDER BY id LIMIT ?", [*params, size]

    def connect(self, url: str) -> Any:
        import pymysql
        kwargs = pymysql_kwargs(url)
        bounds = session_bounds(url)
        # PyMySQL's connect_timeout bounds the TCP connect only: it then sets the socket to
        # read_timeout (None unless the URL gives one) before reading the server's greeting,
        # so a server that accepts and never speaks held the connect forever. The handshake
        # and the session's set-up are read with a bound, put back to the URL's afterwards
        # (docs/relay.md, "A network cut").
        asked = kwargs.pop("read_timeout", None)
        # No TLS parameter: PyMySQL 2 (PREFERRED) built a new ssl.create_default_context() in
        # every Connection, the system's CA bundle loaded for a context that checks nothing
        # (~25 ms a connect, and glibc's thread arenas grew by MBs through each database cut:
        # found by bench.soak --faults). Built without it, then given the process's one such
        # context with PyMySQL's own PREFERRED flags; a PyMySQL without that mode keeps none.
        preferred = "ssl" not in kwargs and not kwargs.get("ssl_disabled")
        if preferred:
            kwargs["ssl_disabled"] = True
        conn = pymysql.connect(**kwargs, autocommit=False, connect_timeout=CONNECT_TIMEOUT_S, defer_connect=True,
                               read_timeout=asked or CONNECT_TIMEOUT_S,
                               init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        if preferred and hasattr(conn, "_ssl_required"):
            conn.ssl, conn.ctx = True, preferred_context()  # type: ignore[attr-defined]
            conn._ssl_required = False
        sock = None
        if "unix_socket" not in kwargs:
            # Our own socket, so that a silent server is found by TCP (PyMySQL sets no keepalive
            # times); a refusal is the error PyMySQL itself raises (2003, transient).
            try:
                sock = bounded_socket(kwargs["host"], kwargs["port"], bounds["tcp_timeout_s"])
            except OSError as exc:
                raise pymysql.err.OperationalError(
                    2003, f"Can't connect to MySQL server on {kwargs['host']!r} ({exc})") from exc
        conn.connect(sock)
        try:
            with conn.cursor() as cursor:
                cursor.execute(session_sql(conn.get_server_info(), **bounds))
            conn.commit()
        except BaseException:
            conn.close()
            raise
        # No public setter: PyMySQL reads the attribute before each packet it waits for.
        conn._read_timeout = asked  # type: ignore[attr-defined]
        return conn

    def cursor_for(self, conn: Any) -> Any:
        # Tuples, whatever the caller's default; each driver's own cursor class (a PyMySQL
        # cursor on a mysqlclient connection builds broken SQL).
        if _is_mysqldb(conn):
            import MySQLdb.cursors
            return conn.cursor(MySQLdb.cursors.Cursor)
        import pymysql.cursors
        return conn.cursor(pymysql.cursors.Cursor)

    def commits_each_statement(self, conn: Any) -> bool:
        if _is_mysqldb(conn):
            # mysqlclient shows the server's autocommit flag, which stays on through a BEGIN,
            # but not its IN_TRANS flag: asked of MariaDB (docs/waking-and-metrics.md, "outbox.transaction").
            return bool(conn.get_autocommit()) and not _mysqldb_in_transaction(conn)
        # PyMySQL's mode, unless the caller's own BEGIN is open (the server's IN_TRANS flag).
        return getattr(conn, "autocommit_mode", False) is True and not getattr(conn, "server_status", 0) & 1

    def in_callers_transaction(self, conn: Any) -> bool:
        # The server's IN_TRANS flag on an autocommit connection: PyMySQL's, or asked of MariaDB
        # for mysqlclient (not told on MySQL: commits_each_statement).
        if _is_mysqldb(conn):
            return bool(conn.get_autocommit()) and _mysqldb_in_transaction(conn)
        return getattr(conn, "autocommit_mode", False) is True and bool(getattr(conn, "server_status", 0) & 1)

    @contextmanager
    def begun(self, conn: Any) -> Iterator[None]:
        """START TRANSACTION on an autocommit connection; COMMIT and ROLLBACK end it as they
        end the driver's own (both drivers send them whatever the mode)."""
        if self.commits_each_statement(conn):
            self._run(conn, "START TRANSACTION")
        yield

    def _code(self, exc: BaseException) -> int | None:
        args = getattr(exc, "args", ())
        return args[0] if args and isinstance(args[0], int) else None

    @staticmethod
    def _driver_error(exc: BaseException) -> bool:
        """An error of either driver a caller's connection may be (PyMySQL, mysqlclient)."""
        return type(exc).__module__.split(".", 1)[0] in ("pymysql", "MySQLdb")

    # Either driver's errors, by their codes (mysqlclient's were told by PyMySQL's classes and
    # so were neither: a store on its connections raised where it reconnects and retries).
    # InterfaceError: a connection the driver knows is gone (both drivers have the class).
    def _interface_error(self, exc: BaseException) -> bool:
        return self._driver_error(exc) and any(c.__name__ == "InterfaceError" for c in type(exc).__mro__)

    def is_transient(self, exc: BaseException) -> bool:
        return self._interface_error(exc) or (self._driver_error(exc) and self._code(exc) in _TRANSIENT_CODES)

    def is_disconnect(self, exc: BaseException) -> bool:
        return self._interface_error(exc) or (self._driver_error(exc) and self._code(exc) in _DISCONNECT_CODES)

    def is_lock_timeout(self, exc: BaseException) -> bool:
        return self._driver_error(exc) and self._code(exc) == 1205  # ER_LOCK_WAIT_TIMEOUT

    def migration_lock_bound(self) -> str:
        return f"{MIGRATION_LOCK_WAIT_S} s"

    def lock_holders(self, cursor: Any, tables: Sequence[str]) -> str | None:
        # Which session holds a table's metadata lock is not told without a plugin
        # (metadata_lock_info) or performance_schema, both off by default: the open
        # transactions, oldest first, are the candidates (reading them takes PROCESS).
        rows = self.execute(cursor, (
            "SELECT t.trx_mysql_thread_id, p.USER, p.HOST, p.COMMAND, "
            "TIMESTAMPDIFF(SECOND, t.trx_started, NOW()) FROM information_schema.innodb_trx t "
            "LEFT JOIN information_schema.processlist p ON p.ID = t.trx_mysql_thread_id "
            "WHERE t.trx_mysql_thread_id <> CONNECTION_ID() ORDER BY t.trx_started LIMIT 3")).fetchall()
        if not rows:
            return None
        return "one of the open transactions, oldest first: " + "; ".join(
            f"connection {thread} (user {user}@{host}, {command}, its transaction open {duration(age or 0)}; "
            f"KILL {thread} ends it)" for thread, user, host, command, age in rows)

    #: What ``outbox migrate`` adds for a missing column: the table's types (text in its binary
    #: collation), NULL allowed where the writer gives the value (the rows already there have none),
    #: and a default where the rows already there need one.
    ADDED_COLUMNS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("message_id", f"VARCHAR(64) {_BIN} NULL"),
        *((column, f"VARCHAR(255) {_BIN} NULL") for column in ("topic", "aggregate_type", "aggregate_id",
                                                               "partition_key")),
        ("payload", "JSON NULL"),
        ("headers", "JSON NOT NULL DEFAULT ('{}')"),
        ("trace_id", f"VARCHAR(255) {_BIN} NULL"),
        ("status", "TINYINT NOT NULL DEFAULT 0"),
        ("attempts", "INT NOT NULL DEFAULT 0"),
        ("claimed_at", "DATETIME(3) NULL"),
        ("next_retry_at", "DATETIME(3) NULL"),
        ("created_at", "DATETIME(3) NOT NULL DEFAULT (UTC_TIMESTAMP(3))"),
        ("processed_at", "DATETIME(3) NULL"),
        ("last_error", "TEXT NULL"),
        ("lease_token", f"VARCHAR(32) {_BIN} NULL"),
    )

    #: The indexes ``migration`` makes: (suffix, columns); ``message_id``'s is unique.
    INDEXES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("message_id", "message_id"), ("agg_id_id", "aggregate_id, status, id"),
        ("claim_ready", "status, next_retry_at, id"), ("done_processed_at", "status, processed_at"))

    def expected_indexes(self) -> dict[str, IndexShape]:
        return {self.index_name(suffix): IndexShape(tuple(columns.split(", ")), unique=suffix == "message_id",
                                                    method="BTREE")
                for suffix, columns in self.INDEXES}

    def _in_catalog(self) -> tuple[str, list[Any]]:
        """The condition (and its parameters) that picks this table's rows of an
        ``information_schema`` view: its schema, else the connection's database, and its name."""
        return ("table_schema = ? AND table_name = ?" if self.schema else
                "table_schema = DATABASE() AND table_name = ?"), [*([self.schema] if self.schema else []), self.table_name]

    def migration(self, native_json: bool = False) -> list[Any]:
        t, q = self.table, self.quote
        this_table, params = self._in_catalog()

        def column_exists(column: str) -> tuple[str, list[Any]]:
            return (f"SELECT 1 FROM information_schema.columns WHERE {this_table} AND column_name = ?",
                    [*params, column])

        def index_exists(index: str, condition: str = "") -> tuple[str, list[Any]]:
            return (f"SELECT 1 FROM information_schema.statistics WHERE {this_table} "
                    f"AND index_name = ?{' AND ' + condition if condition else ''}", [*params, index])

        steps: list[Any] = [f"CREATE DATABASE IF NOT EXISTS {q(self.schema)}"] if self.schema else []
        steps.append(f"""CREATE TABLE IF NOT EXISTS {t} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                message_id VARCHAR(64) NOT NULL,
                topic VARCHAR(255) NOT NULL,
                aggregate_type VARCHAR(255) NOT NULL,
                aggregate_id VARCHAR(255) NOT NULL,
                partition_key VARCHAR(255) NULL,
                payload JSON NOT NULL,
                headers JSON NOT NULL,
                trace_id VARCHAR(255) NULL,
                status TINYINT NOT NULL DEFAULT 0,
                attempts INT NOT NULL DEFAULT 0,
                claimed_at DATETIME(3) NULL,
                next_retry_at DATETIME(3) NULL,
                created_at DATETIME(3) NOT NULL,
                processed_at DATETIME(3) NULL,
                CONSTRAINT {q(derived_name('ck_', self.table_name, '_status'))} CHECK (status BETWEEN 0 AND 4)
            ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""")
        # Every column of the contract but the id (README, "The table").
        for column, ddl in self.ADDED_COLUMNS:
            steps.append((column_exists(column), f"ALTER TABLE {t} ADD COLUMN {column} {ddl}"))
        # An index defined otherwise than expected_indexes says, as `outbox check` compares it
        # (IndexDiffers), is built again with InnoDB's online build: an earlier release's
        # (agg_id_id on (aggregate_id, id), claim_ready on (status, id): docs/internals.md, "Rows
        # waiting for a later time are not read") or one changed by hand (docs/operations.md).
        for suffix, columns in self.INDEXES:
            name, old = self.index_name(suffix), self.legacy_index_name(suffix)
            kind = "UNIQUE INDEX" if suffix == "message_id" else "INDEX"
            if old:  # named in full by an earlier release (Engine.legacy_name): renamed in place, not built again
                taken = index_exists(name)
                steps.append(((f"SELECT 1 WHERE NOT EXISTS ({index_exists(old)[0]}) OR EXISTS ({taken[0]})",
                               [*index_exists(old)[1], *taken[1]]), f"ALTER TABLE {t} RENAME INDEX {q(old)} TO {q(name)}"))
            # An index the optimizer passes over is made usable in place, before the rebuild's probe
            # compares it: the rebuild alone (DROP and ADD of the same definition) left it IGNORED.
            unusable = index_exists(name, f"{self.index_state_sql()} IS NOT NULL")
            steps.append(((f"SELECT 1 WHERE NOT EXISTS ({unusable[0]})", unusable[1]),
                          f"ALTER TABLE {t} ALTER INDEX {q(name)} {USABLE_AGAIN['IGNORED' if self.mariadb else 'INVISIBLE']}"))
            steps.append((IndexDiffers(name), f"ALTER TABLE {t} DROP INDEX {q(name)}, ADD {kind} {q(name)} ({columns})"))
            steps.append((index_exists(name), f"CREATE {kind} {q(name)} ON {t} ({columns})"))
        return steps + self.holders_migration()

    def column_problem(self, cursor: Any) -> str | None:
        """Which of ``EXACT_COLUMNS`` are in another collation than a binary one of utf8mb4 (the
        migration's ``utf8mb4_bin``; a table made or altered by hand, a server's default), with the
        statement that converts them, online where the server can (ALGORITHM=INPLACE, LOCK=NONE:
        one refused says so instead of copying the table under a lock); None when all are right.
        `outbox migrate` does not run it (docs/operations.md, "Is it set up right? `outbox check`")."""
        where, params = self._in_catalog()
        rows = self.execute(cursor, "SELECT column_name, collation_name, column_type, is_nullable FROM "
                            f"information_schema.columns WHERE {where}", params).fetchall()
        wrong = {str(name).lower(): (str(collation), str(kind), nullable == "YES")
                 for name, collation, kind, nullable in rows
                 if str(name).lower() in EXACT_COLUMNS and collation is not None
                 and not (str(collation).lower().startswith("utf8mb4_") and str(collation).lower().endswith("_bin"))}
        if not wrong:
            return None
        named = [column for column in EXACT_COLUMNS if column in wrong]
        listed = ", ".join(f"{column} in {wrong[column][0]}" for column in named)
        modify = ", ".join(f"MODIFY {self.quote(column)} {wrong[column][1]} {_BIN} {'NULL' if wrong[column][2] else 'NOT NULL'}"
                           for column in named)
        return (f"{'columns' if len(named) > 1 else 'column'} {listed}, not utf8mb4_bin: values that differ only in case (or accents) compare equal: the "
                "enqueue of message id 'ABC' after 'abc' is taken for a duplicate and its event dropped; "
                f"`outbox migrate` does not convert it: run ALTER TABLE {self.table} {modify}, "
                "ALGORITHM=INPLACE, LOCK=NONE (refused where it would copy the table under a lock: then at a quiet "
                "moment without that clause; docs/operations.md, \"Is it set up right? `outbox check`\")")

    def holders_migration(self) -> list[Any]:
        return [f"CREATE TABLE IF NOT EXISTS {self.holders} ({self.holders_columns()}) "
                "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"]

    def holders_columns(self) -> str:
        return ("holder_id CHAR(16) NOT NULL PRIMARY KEY, host VARCHAR(255) NOT NULL, pid INT NOT NULL, "
                "started_at DATETIME(3) NOT NULL, beat_at DATETIME(3) NOT NULL")

    def beat(self, cursor: Any, holder_id: str, host: str, pid: int) -> bool:
        # An UPDATE that changes nothing (the same millisecond) counts 0 rows on MySQL, so the
        # generic "update, else insert" would insert twice: one upsert, 1 row when inserted.
        return self.execute(cursor, f"INSERT INTO {self.holders} (holder_id, host, pid, started_at, beat_at) "
                            f"VALUES (?, ?, ?, {self.now}, {self.now}) "
                            f"ON DUPLICATE KEY UPDATE beat_at = {self.now}", [holder_id, host, pid]).rowcount == 1

    def is_missing_table(self, exc: BaseException) -> bool:
        return self._driver_error(exc) and self._code(exc) == 1146  # ER_NO_SUCH_TABLE

    def is_missing_column(self, exc: BaseException) -> bool:
        return self._driver_error(exc) and self._code(exc) == 1054  # ER_BAD_FIELD_ERROR

    def lock_migration(self, cursor: Any) -> float | None:
        return self.hold_migration_lock(cursor, self._migration_lock_key(), self.table)

    def unlock_migration(self, cursor: Any) -> None:
        self.release_migration_lock(cursor, self._migration_lock_key())

    def hold_migration_lock(self, cursor: Any, key: str, table: str, lock_wait_s: int | None = None) -> float:
        """One migration of ``table`` at a time, and its DDL steps' waits bounded; the outbox
        table's and the queue tables' (``transport.tables.mysql``) migrations both take it.

        DDL commits on its own in MySQL, so the lock is the session's (GET_LOCK, named by
        ``key``: names stop at 64 characters) and ``release_migration_lock`` releases it.
        A DDL step waits for the table's metadata lock behind any open transaction that has
        read the table, and every later statement on the table queues behind it: by default
        for a year (lock_wait_timeout). Bounded to ``lock_wait_s``, as on PostgreSQL; the
        caller says why (1205: ``storage.store.migration_lock_refusal``), and the release puts
        back the session's own bound (found in review). ``lock_wait_s``: MIGRATION_LOCK_WAIT_S
        by default. Returns the seconds it waited for another migration (0: the lock was free)."""
        waited = 0.0
        got = self.execute(cursor, "SELECT GET_LOCK(?, 0)", [key]).fetchone()
        if not got or got[0] != 1:
            started = time.monotonic()
            got = self.execute(cursor, "SELECT GET_LOCK(?, ?)", [key, MIGRATION_LOCK_TIMEOUT_S]).fetchone()
            waited = time.monotonic() - started
        if not got or got[0] != 1:
            raise StoreError(f"outbox migrate: another migration of {table} held the migration lock for "
                             f"{MIGRATION_LOCK_TIMEOUT_S} s; run it again when that one has finished")
        self.execute(cursor, "SET @outbox_lock_wait_timeout = @@SESSION.lock_wait_timeout, "
                     f"SESSION lock_wait_timeout = {int(lock_wait_s or MIGRATION_LOCK_WAIT_S)}")
        return waited

    def release_migration_lock(self, cursor: Any, key: str) -> None:
        self.execute(cursor, "SET SESSION lock_wait_timeout = COALESCE(@outbox_lock_wait_timeout, "
                     "@@GLOBAL.lock_wait_timeout)")
        self.execute(cursor, "SELECT RELEASE_LOCK(?)", [key]).fetchall()

    def session_lock_statements(self, name: str, idle_s: int) -> list[tuple[str, list[Any]]] | None:
        # MariaDB ends no idle session by itself (wait_timeout: 8 hours): a vanished holder's
        # session, and its lock, would stay that long.
        return [(f"SET SESSION wait_timeout = {int(idle_s)}", []), ("SELECT GET_LOCK(?, 0)", [name])]

    def session_unlock_statement(self, name: str) -> tuple[str, list[Any]]:
        return "SELECT RELEASE_LOCK(?)", [name]  # GET_LOCK: 1, 0, or NULL on an error

    def session_lock_held_statement(self, name: str) -> tuple[str, list[Any]]:
        return "SELECT COALESCE(IS_USED_LOCK(?) = CONNECTION_ID(), 0)", [name]

    def _migration_lock_key(self) -> str:
        return "outbox migrate " + hashlib.sha1(self.migration_lock_resource().encode()).hexdigest()

    def _check_charset(self, cursor: Any, event: NewEvent) -> None:
        """Refuse, before the insert, an event with a character of four UTF-8 bytes (an
        emoji) on a connection whose character set is not utf8mb4 (``charset="utf8"``, which
        is utf8mb3; Django's default before 5.2): the server cannot read it, and refuses the
        row in strict mode or, without it, stores ``?`` for it, so two message ids that
        differ only there become one and the second event is dropped as a duplicate."""
        texts = (event.message_id, event.topic, event.aggregate_type, event.aggregate_id, event.partition_key,
                 event.trace_id, event.headers_json, event.payload_json)
        if not any(text and not text.isascii() and _ASTRAL.search(text) for text in texts):
            return
        charsets = self.execute(cursor, "SELECT @@character_set_client, @@character_set_connection").fetchone()
        wrong = sorted({str(c) for c in charsets if str(c).lower() != "utf8mb4"})
        if wrong:
            raise EnqueueError(f"the event has characters of four UTF-8 bytes (such as emoji), which this MySQL "
                               f"connection's character set {', '.join(wrong)} cannot carry: the server would refuse "
                               "the row or store '?' for them. Connect with charset='utf8mb4' (Django: "
                               "DATABASES OPTIONS {'charset': 'utf8mb4'})")

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        """Insert unless the message_id is stored, and return the row's id (docs/design.md,
        "MySQL/MariaDB specifics"). A stored id is found by a plain consistent read,
        which locks nothing: the insert's duplicate path locks the stored row until the
        caller's transaction ends, and the relay's writes and claims of it waited for that.
        At SERIALIZABLE, where a plain read locks, and at READ UNCOMMITTED, where it sees
        another transaction's uncommitted row, the read's WHERE is false and it reads nothing
        (same section)."""
        self._check_charset(cursor, event)
        isolation = isolation_variable(cursor.connection.get_server_info())
        found = self.execute(cursor, f"SELECT id, message_id FROM {self.table} WHERE message_id = ? "
                             f"AND {isolation} NOT IN ('SERIALIZABLE', 'READ-UNCOMMITTED')",
                             [event.message_id]).fetchone()
        if found:
            if found[1] != event.message_id:  # equal to the column's collation only: not the same event
                raise EnqueueError(f"message id {event.message_id!r} matched the stored {found[1]!r} (row {found[0]}): "
                                   f"the column message_id of {self.table} compares them as equal (a case- or "
                                   "accent-insensitive collation, or trailing spaces), so this event would be "
                                   "dropped as a duplicate. Nothing was written; `outbox check` names the "
                                   "statement that puts the column in utf8mb4_bin")
            return int(found[0])
        # A row committed after the read (a concurrent enqueue, or one outside the caller's
        # REPEATABLE READ snapshot): LAST_INSERT_ID(id) hands back the stored row's id and
        # nothing is written, so no error reaches the caller's transaction.
        self.execute(cursor, f"INSERT INTO {self.table} ({self.INSERT_COLUMNS}, created_at) "
                     f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, {self.now}) "
                     "ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)", self.event_params(event))
        return int(cursor.lastrowid)
