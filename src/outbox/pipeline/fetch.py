"""How the ``outbox`` data source fetches one keyset page, per engine: straight into
Arrow where a library does that without Python row objects, through the engine's
Python driver where none can be had (docs/pipeline.md, "How the jobs read the outbox").

| engine | reader | why |
| --- | --- | --- |
| PostgreSQL | ADBC (``adbc-driver-postgresql``) | a page is ``COPY (SELECT ...) TO STDOUT`` in binary, decoded in C |
| MySQL/MariaDB | connectorx | the binary protocol decoded in Rust |
| SQLite | connectorx | columns typed by their declaration (ADBC's SQLite driver guesses them from the first rows and fails on a late non-NULL) |
| SQL Server, ``mssql+mssqlpython://`` | mssql-python's own Arrow fetch (``Cursor.arrow``) | the ODBC result set turned into Arrow in the driver's C++ |
| SQL Server, ``mssql+pyodbc://`` | pyodbc, the engine's driver | pyodbc has no Arrow fetch |

ADBC and connectorx take no bound parameters on these paths (COPY has none; connectorx
takes none), so the page's values are written into the SQL as literals, each exactly
as the Python driver itself sends it: psycopg sends a ``datetime`` as its ISO text
typed ``timestamptz`` (aware) or ``timestamp`` (naive), PyMySQL escapes every value
into the statement text, and a SQLite time is a string compared as a string. The
database therefore compares the very same values as on the driver path. mssql-python's
Arrow fetch reads the result of the driver path's own statement, values bound as there
(``binds``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from ..core.errors import install_hint
from ..storage.engines.base import Engine

#: ``reader`` option values: ``arrow`` (the engine's Arrow reader, the default where
#: there is one) and ``driver`` (the engine's Python driver: the fallback, and pyodbc's path).
READERS = ("arrow", "driver")


class ArrowFetch:
    """One engine's Arrow reader: ``open`` a handle for a partition, ``page`` runs one
    statement (its own transaction: nothing is held between pages), ``close``."""

    engine_name = ""
    #: The importable module this reader needs (installed by the ``spark`` extra).
    module = ""
    #: True: ``page`` binds the page's values (``params``) as the driver path does; False:
    #: they are written into ``sql`` as literals (``literal``) and ``params`` is None.
    binds = False

    def __init__(self, url: str, engine: Engine) -> None:
        self.url, self.engine = url, engine

    def usable(self) -> bool:
        """False when this URL needs something the reader cannot do (the driver path reads it)."""
        return True

    def literal(self, value: Any) -> str:
        raise NotImplementedError

    def open(self) -> Any:
        return None

    def page(self, handle: Any, sql: str, params: list[Any] | None = None) -> Any:
        raise NotImplementedError

    def close(self, handle: Any) -> None:
        """The partition was read whole: the handle may be kept for the next."""
        return None

    def discard(self, handle: Any) -> None:
        """The partition's read ended in an error, or was abandoned: never keep the handle."""
        self.close(handle)


#: The ADBC connection each process keeps per URL between the partitions it reads
#: (``PostgresFetch``): (process id, URL) -> connection. A Spark Python worker reads one
#: partition at a time and is reused for the next, so each worker connects once instead of
#: once per partition (docs/pipeline.md, "How the jobs read the outbox").
_KEPT: dict[tuple[int, str], Any] = {}


@atexit.register
def _close_kept() -> None:
    """At exit, close this process's kept connections: a process that ends normally says
    goodbye to the server."""
    for key in [key for key in _KEPT if key[0] == os.getpid()]:
        with contextlib.suppress(Exception):
            _KEPT.pop(key).close()


class PostgresFetch(ArrowFetch):
    """ADBC, one connection kept per process (``_KEPT``): connecting reads the server's type
    catalogue, about 80 ms, more than a small partition's whole read. A kept connection
    holds no transaction (autocommit: each page is its own statement) and is checked with
    one round trip before it is used again; one that fails the check, or whose partition
    ended in an error, is closed, never kept."""

    engine_name = "postgresql"
    module = "adbc_driver_postgresql"

    def literal(self, value: Any) -> str:
        if isinstance(value, datetime):
            return f"'{value.isoformat()}'::{'timestamptz' if value.tzinfo else 'timestamp'}"
        if isinstance(value, str):
            return "'" + value.replace("'", "''") + "'"
        raise TypeError(f"no PostgreSQL literal for a {type(value).__name__}")

    def open(self) -> Any:
        import adbc_driver_postgresql.dbapi as adbc

        kept = _KEPT.pop((os.getpid(), self.url), None)  # taken: no other task of the process shares it
        if kept is not None:
            try:
                with kept.cursor() as cursor:
                    cursor.execute("SELECT 1")
                    cursor.fetchall()
                return kept
            except Exception:  # noqa: BLE001 - a connection the server or the network ended: open another
                self.discard(kept)
        # Autocommit: each page is its own statement and transaction (no snapshot held between pages).
        return adbc.connect(self.uri(), autocommit=True)

    def uri(self) -> str:
        """The libpq URI ADBC connects with: the URL's, plus the client-side bounds of every
        relay connection it does not set itself (``postgres.connect_params``: keepalives,
        ``tcp_user_timeout``, ``connect_timeout``), so that a silent server ends a page
        within ``tcp_timeout_s`` (docs/pipeline.md, "How the jobs read the outbox")."""
        from psycopg.conninfo import conninfo_to_dict

        from ..storage.engines.postgres import connect_params, libpq_url
        url = libpq_url(self.url)
        given = conninfo_to_dict(url)
        added = {name: value for name, value in connect_params(self.url).items() if name not in given}
        return url + ("&" if urlsplit(url).query else "?") + urlencode(added) if added else url

    def page(self, handle: Any, sql: str, params: list[Any] | None = None) -> Any:
        with handle.cursor() as cursor:
            cursor.execute(sql)  # no parameters: the driver reads the result with binary COPY
            return cursor.fetch_arrow_table()

    def close(self, handle: Any) -> None:
        key = (os.getpid(), self.url)
        if key in _KEPT:
            handle.close()
        else:
            _KEPT[key] = handle

    def discard(self, handle: Any) -> None:
        with contextlib.suppress(Exception):  # it may be broken already
            handle.close()


class ConnectorxFetch(ArrowFetch):
    """connectorx opens a connection per ``read_sql`` call: one page, one connection,
    one transaction."""

    module = "connectorx"

    def cx_url(self) -> str:
        raise NotImplementedError

    def page(self, handle: Any, sql: str, params: list[Any] | None = None) -> Any:
        import connectorx

        return connectorx.read_sql(self.cx_url(), sql, return_type="arrow")


class MysqlFetch(ConnectorxFetch):
    engine_name = "mysql"

    def usable(self) -> bool:
        """connectorx speaks TCP only, and its URL carries no TLS file (CA, client certificate):
        a URL with ``unix_socket`` or asking for TLS reads through PyMySQL, which does
        (docs/pipeline.md, "How the jobs read the outbox")."""
        from ..core.checks import MYSQL_TLS_ALIASES, MYSQL_TLS_PARAMETERS, mysql_tls, mysql_url_options

        options = mysql_url_options(self.url)
        tls = (any(name in options for name in (*MYSQL_TLS_PARAMETERS, *MYSQL_TLS_ALIASES))
               and mysql_tls(options) != "disabled")
        return "unix_socket" not in options and not tls

    def literal(self, value: Any) -> str:
        from pymysql.converters import escape_item
        return str(escape_item(value, "utf8mb4"))  # exactly PyMySQL's own rendering of a bound value

    def cx_url(self) -> str:
        """connectorx's URL (the mysql crate's parameters): TCP as the URL says (not the
        crate's switch to a local socket), with the engine's own socket bounds
        (``mysql.socket_options``): keepalives and ``TCP_USER_TIMEOUT`` that end a page
        from a silent server within ``tcp_timeout_s`` (docs/pipeline.md, "How the jobs read
        the outbox"). The crate takes no ``read_timeout``/``write_timeout``."""
        from ..core.config import session_bounds
        from ..storage.engines.base import tcp_keepalive
        from ..storage.engines.mysql import CONNECT_TIMEOUT_S, pymysql_kwargs

        kw = pymysql_kwargs(self.url)
        auth = quote(kw["user"], safe="") + (":" + quote(kw["password"], safe="") if kw["password"] else "")
        host = f"[{kw['host']}]" if ":" in kw["host"] else kw["host"]  # an IPv6 literal
        tcp_timeout_s = session_bounds(self.url)["tcp_timeout_s"]
        idle, interval, count = tcp_keepalive(tcp_timeout_s)
        bounds = urlencode({"prefer_socket": "false", "tcp_connect_timeout_ms": CONNECT_TIMEOUT_S * 1000,
                            "tcp_keepalive_time_ms": idle * 1000, "tcp_keepalive_probe_interval_secs": interval,
                            "tcp_keepalive_probe_count": count, "tcp_user_timeout_ms": tcp_timeout_s * 1000})
        return f"mysql://{auth}@{host}:{kw['port']}/{quote(kw['database'] or '', safe='')}?{bounds}"


class SqliteFetch(ConnectorxFetch):
    engine_name = "sqlite"

    def literal(self, value: Any) -> str:
        if isinstance(value, str):  # SQLite's times are text and compare as text
            return "'" + value.replace("'", "''") + "'"
        raise TypeError(f"no SQLite literal for a {type(value).__name__}")

    def cx_url(self) -> str:
        from pathlib import Path

        from ..storage.engines.sqlite import sqlite_path
        return "sqlite://" + quote(str(Path(sqlite_path(self.url)).resolve()))


#: Rows per record batch of mssql-python's Arrow fetch (its own default is 8,192; a page
#: of up to 50,000 rows then comes as a few batches, put together into one table).
ARROW_BATCH_ROWS = 8192


class MssqlPythonFetch(ArrowFetch):
    """mssql-python's Arrow fetch (``Cursor.arrow``: the ODBC result set turned into Arrow
    in the driver's C++, no Python row objects) on the engine's own connection, with its
    session settings, running the driver path's statement with its values bound. Each page
    ends its transaction (a rollback), as on the driver path. A pyodbc URL, or an
    mssql-python without ``Cursor.arrow`` (before 1.5), reads through the driver."""

    engine_name = "mssql"
    module = "mssql_python"
    binds = True

    def usable(self) -> bool:
        from ..storage.engines.mssql.driver import driver_of_url

        if driver_of_url(self.url) != "mssql_python" or importlib.util.find_spec(self.module) is None:
            return False
        from mssql_python.cursor import Cursor
        return hasattr(Cursor, "arrow")

    def open(self) -> Any:
        return [self.engine.connect(self.url)]  # a list: a page may replace the connection

    def page(self, handle: Any, sql: str, params: list[Any] | None = None) -> Any:
        def read(conn: Any) -> Any:
            cursor = conn.cursor()
            try:
                self.engine.execute(cursor, sql, params or [])
                table = cursor.arrow(batch_size=ARROW_BATCH_ROWS)
            finally:
                cursor.close()
            conn.rollback()  # end the read transaction between pages: no long snapshot held
            return table

        handle[0], table = read_once_more(self.engine, self.url, handle[0], read)
        return table

    def close(self, handle: Any) -> None:
        with contextlib.suppress(Exception):  # it may be broken already
            handle[0].close()


def read_once_more(engine: Engine, url: str, conn: Any, read: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``read(conn)``, or, when the connection was ended or the error is transient (the
    server ended the session while Spark took the last page), ``read`` once more on a new
    connection: pages are keyed by id, so a page read again is the same page. Returns the
    connection used and what ``read`` returned. The driver path and mssql-python's reader
    read their pages through it."""
    try:
        return conn, read(conn)
    except Exception as exc:
        if not (engine.is_disconnect(exc) or engine.is_transient(exc)):
            raise
    with contextlib.suppress(Exception):  # it is broken already
        conn.close()
    conn = engine.connect(url)
    try:
        return conn, read(conn)
    except BaseException:
        with contextlib.suppress(Exception):  # the new one is the caller's no more: closed here
            conn.close()
        raise


#: The per-engine table: engines without an entry read through their Python driver.
ARROW_FETCH: dict[str, Callable[[str, Engine], ArrowFetch]] = {
    "postgresql": PostgresFetch, "mysql": MysqlFetch, "sqlite": SqliteFetch, "mssql": MssqlPythonFetch,
}


def arrow_fetch(url: str, engine: Engine, reader: str) -> ArrowFetch | None:
    """The Arrow reader for ``engine``, or None for the driver path (``reader=driver``,
    or an engine with no Arrow reader)."""
    if reader not in READERS:
        raise ValueError(f"the outbox data source's 'reader' option must be one of {', '.join(READERS)}, "
                         f"not {reader!r}")
    factory = ARROW_FETCH.get(engine.name)
    if factory is None or reader != "arrow":
        return None
    fetch = factory(url, engine)
    if not fetch.usable():
        return None
    if importlib.util.find_spec(fetch.module) is None:
        raise ValueError(f"the outbox data source reads {engine.name} with {fetch.module}, which is not installed: "
                         f"{install_hint('spark')}; or set the option reader=driver")
    return fetch


def to_source_schema(table: Any, schema: Any, to_datetime: Callable[[Any], Any]) -> Any:
    """A fetched page as the source's Arrow schema: columns renamed by position, then
    cast (SMALLINT status to INT, naive UTC timestamps to UTC, SQLite's text times
    parsed; a time text Arrow cannot parse goes through the engine's own parser)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = table.rename_columns(schema.names)
    arrays = []
    for field, column in zip(schema, table.columns):
        if pa.types.is_timestamp(field.type) and (pa.types.is_string(column.type)
                                                   or pa.types.is_large_string(column.type)):
            try:
                column = pc.cast(column, pa.timestamp("us"))
            except pa.ArrowInvalid:
                column = pa.array([to_datetime(v) for v in column.to_pylist()], field.type)
        elif pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            column = pc.cast(column, pa.string())
        arrays.append(pc.cast(column, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)
