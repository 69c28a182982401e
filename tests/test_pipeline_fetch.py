"""The ``outbox`` data source's readers on real databases, without Spark: the Arrow
reader of each engine (ADBC on PostgreSQL, connectorx on MySQL/MariaDB and SQLite,
mssql-python's own Arrow fetch on SQL Server) returns exactly what the Python-driver path
returns, with the same time bounds compared by the database, one page per transaction, and
no Python driver cursor."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Any

import pytest
from pipeline_support import DAY_MS, PIPELINE_ENGINES, Row, mixed_rows, seed
from services import MYSQL_URL, POSTGRES_URL, require

from outbox.pipeline.common import encode_native
from outbox.pipeline.fetch import MysqlFetch, PostgresFetch, arrow_fetch
from outbox.pipeline.source import ARROW_SCHEMA, OutboxQuery, OutboxReader
from outbox.storage.engines import engine_for_url
from outbox.storage.store import OutboxStore

pa = pytest.importorskip("pyarrow")


#: SQL Server twice: through pyodbc (its reader is the driver) and mssql-python (its own Arrow fetch).
@pytest.fixture(params=[*PIPELINE_ENGINES, "mssql-python"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def read_all(options: dict[str, str]) -> Any:
    reader = OutboxReader(options)
    batches = [batch for part in reader.partitions() for batch in reader.read(part)]
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA()).sort_by("id")


def row_time(store: OutboxStore, id_: int, column: str) -> Any:
    """A row's timestamp exactly as the driver returns it (the archive's cut-off form)."""
    with store.transaction() as cursor:
        return store.engine.execute(cursor, f"SELECT {column} FROM {store.engine.table} WHERE id = ?",
                                    [id_]).fetchone()[0]


def test_arrow_reader_returns_what_the_driver_returns(store: OutboxStore, url: str) -> None:
    rows = mixed_rows()
    ids = seed(store, rows)
    # Bounds equal to rows' own times (row 3: 8 days old; row 1: 9 days old): those rows
    # are in (<=, >=), as the database compares its own values.
    bound_id = ids[3]
    base = {"url": url, "table": store.engine.table_name, "statuses": "2,4", "partitions": "3", "fetch_size": "4",
            "processed_before": encode_native(row_time(store, bound_id, "processed_at")),
            "created_since": encode_native(row_time(store, ids[1], "created_at"))}
    driver = read_all({**base, "reader": "driver"})
    arrow = read_all({**base, "reader": "arrow"})
    assert {bound_id, ids[1]} <= set(arrow.column("id").to_pylist())
    assert arrow.equals(driver), (arrow.slice(0, 1).to_pylist(), driver.slice(0, 1).to_pylist())
    assert arrow.num_rows < len(ids)  # the filters are applied, not everything read


def test_the_arrow_path_opens_no_driver_connection(store: OutboxStore, url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages come straight into Arrow: the engine's Python driver is never used to read."""
    if store.engine.name == "mssql":
        pytest.skip("SQL Server reads through its Python driver: pyodbc's rows, or mssql-python's own Arrow fetch")
    ids = seed(store, [Row("t", f"a{i}") for i in range(7)])

    def no_driver(self: Any, url: str) -> Any:
        raise AssertionError("the Python driver was used to read a page")
    monkeypatch.setattr(type(store.engine), "connect", no_driver)
    got = read_all({"url": url, "table": store.engine.table_name, "min_id": str(min(ids)),
                    "max_id": str(max(ids)), "fetch_size": "3", "partitions": "2"})
    assert got.column("id").to_pylist() == sorted(ids)


def on_postgresql(sql: str, params: list[Any]) -> list[tuple]:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        return admin.execute(sql, params).fetchall()


def connections_named(name: str) -> list[tuple]:
    """(pid, backend start, transaction start) of the server's connections called ``name``."""
    return on_postgresql("SELECT pid, backend_start, xact_start FROM pg_stat_activity WHERE application_name = %s",
                         [name])


def gone(name: str, pid: int) -> None:
    """Wait (5 s at most) for the backend ``pid`` to leave pg_stat_activity: a backend whose
    connection was closed or ended is listed until its process has exited."""
    deadline = time.monotonic() + 5
    while pid in {row[0] for row in connections_named(name)} and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["postgresql"])
def test_a_process_reads_its_partitions_on_one_kept_connection(store: OutboxStore, url: str) -> None:
    """ADBC's connect reads the type catalogue (about 80 ms): a process (a Spark Python worker,
    reused from task to task) keeps one connection per URL between partitions. It holds no
    transaction while kept, a kept connection the server ended is replaced, and one whose
    partition was abandoned mid-read is closed, not kept."""
    ids = seed(store, [Row("t", f"a{i}") for i in range(9)])
    name = f"outbox-fetch-{uuid.uuid4().hex[:8]}"
    named = f"{url}{'&' if '?' in url else '?'}application_name={name}"
    options = {"url": named, "table": store.engine.table_name, "partitions": "3", "fetch_size": "2",
               "min_id": str(min(ids)), "max_id": str(max(ids))}
    assert read_all(options).column("id").to_pylist() == sorted(ids)
    kept = connections_named(name)
    assert len(kept) == 1 and kept[0][2] is None  # one connection for three partitions, no transaction open
    assert read_all(options).num_rows == len(ids)
    assert connections_named(name) == kept  # the same connection again
    on_postgresql("SELECT pg_terminate_backend(%s)", [kept[0][0]])
    assert read_all(options).num_rows == len(ids)  # the ended one is found out and replaced
    gone(name, kept[0][0])
    again = connections_named(name)
    assert len(again) == 1 and again[0][0] != kept[0][0]
    reader = OutboxReader(options)
    pages = reader.read(reader.partitions()[0])
    assert next(pages).num_rows == 2
    pages.close()  # Spark stopped reading the partition
    gone(name, again[0][0])
    assert connections_named(name) == []


@pytest.mark.parametrize("kind", ["postgresql"])
def test_no_transaction_stays_open_between_pages(store: OutboxStore, url: str) -> None:
    """While a partition waits between pages (Spark busy with the last batch), its
    connection holds no transaction: no snapshot pinned on a busy outbox."""
    ids = seed(store, [Row("t", f"a{i}") for i in range(6)])
    reader = OutboxReader({"url": url, "table": store.engine.table_name, "fetch_size": "2", "partitions": "1",
                           "min_id": str(min(ids)), "max_id": str(max(ids))})
    pages = reader.read(reader.partitions()[0])
    first = next(pages)
    assert first.num_rows == 2
    with store.transaction() as cursor:
        open_tx = store.engine.execute(
            cursor, "SELECT COUNT(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' "
            "AND query LIKE ?", [f"%{store.engine.table_name}%"]).fetchone()[0]
    assert open_tx == 0
    assert sum(batch.num_rows for batch in pages) == 4


def test_split_by_topic_reads_every_row_once(store: OutboxStore, url: str) -> None:
    """``split=topic``: each task reads only its topic pieces (whole topics, a topic cut
    by id where a task is full), and all tasks together read exactly what ``split=id``
    reads, on both readers."""
    rows = [Row("big.topic", f"b{i}") for i in range(14)] + [Row("it's.quoted", "q"), Row("small", "s")]
    rows += [Row(f"t.{i % 3}", f"a{i}") for i in range(9)]
    rows += [Row("pending", "p", status=0, latency_ms=None)]
    ids = seed(store, rows)
    base = {"url": url, "table": store.engine.table_name, "statuses": "2", "partitions": "3", "fetch_size": "4"}
    by_id = read_all(base)
    for reader in ("arrow", "driver"):
        options = {**base, "split": "topic", "reader": reader}
        split = OutboxReader(options)
        parts = split.partitions()
        assert len(parts) == 3 and any(first is not None for p in parts for _, first, _ in p.pieces)  # a cut
        for part in parts:
            got = pa.Table.from_batches(list(split.read(part)), schema=ARROW_SCHEMA())
            for id_, topic in zip(got.column("id").to_pylist(), got.column("topic").to_pylist()):
                assert any(t == topic and (a is None or a <= id_ <= b) for t, a, b in part.pieces), (id_, topic)
        assert read_all(options).equals(by_id), reader
    assert by_id.column("id").to_pylist() == sorted(i for i, r in zip(ids, rows) if r.status == 2)


def test_bad_reader_option_is_named(store: OutboxStore, url: str) -> None:
    with pytest.raises(ValueError, match="'reader' option must be one of arrow, driver, not 'jdbc'"):
        OutboxQuery({"url": url, "table": store.engine.table_name, "reader": "jdbc"})


@pytest.mark.parametrize("kind", ["sqlite"])
def test_sqlite_times_written_by_others_still_parse(store: OutboxStore, url: str) -> None:
    """A time text Arrow's parser refuses (an ISO offset, as another writer may store)
    goes through the engine's own parser: the same instant as on the driver path."""
    ids = seed(store, [Row("t", "a", age_ms=DAY_MS)])
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET claimed_at = ? WHERE id = ?",
                             ["2026-11-14T10:00:00.250+00:00", ids[0]])
    base = {"url": url, "table": store.engine.table_name}
    arrow = read_all({**base, "reader": "arrow"})
    assert arrow.equals(read_all({**base, "reader": "driver"}))
    assert str(arrow.column("claimed_at")[0].as_py()) == "2026-11-14 10:00:00.250000+00:00"


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_missing_arrow_reader_is_named(store: OutboxStore, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "connectorx" else real(name, *a))
    with pytest.raises(ValueError, match=r"reads sqlite with connectorx, which is not installed: .*\[spark\].*reader=driver"):
        OutboxQuery({"url": url, "table": store.engine.table_name})
    assert OutboxQuery({"url": url, "table": store.engine.table_name, "reader": "driver"}).fetch is None


def test_mysql_over_a_unix_socket_reads_through_the_driver() -> None:
    """connectorx speaks TCP only: a socket URL takes the driver path instead of failing."""
    from outbox.storage.engines import engine_for_url

    socket_url = "mysql://app@localhost/app?unix_socket=/run/mysqld/mysqld.sock"
    assert arrow_fetch(socket_url, engine_for_url(socket_url), "arrow") is None
    tcp_url = "mysql://app@db:3306/app"
    assert arrow_fetch(tcp_url, engine_for_url(tcp_url), "arrow") is not None


def test_arrow_pages_are_sized_by_bytes_after_a_small_first_page(store: OutboxStore, url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An Arrow reader's first page is at most ``FIRST_PAGE_ROWS`` (nothing known of the
    rows yet); each next one holds about ``page_bytes`` at the last page's bytes per row,
    at least one row and at most ``fetch_size``: large rows make short pages, and every
    row is read once, in order, whatever the sizes."""
    if arrow_fetch(url, store.engine, "arrow") is None:
        pytest.skip(f"{url.split(':', 1)[0]} reads through its Python driver (docs/pipeline.md)")
    ids = seed(store, [Row("t", f"a{i}") for i in range(11)])
    pages: list[tuple[int, int]] = []  # (rows asked for, rows read)
    page = OutboxQuery.arrow_page

    def counted(self: OutboxQuery, handle: Any, after: int, hi: int, size: int) -> Any:
        table = page(self, handle, after, hi, size)
        pages.append((size, table.num_rows))
        return table

    monkeypatch.setattr(OutboxQuery, "arrow_page", counted)
    base = {"url": url, "table": store.engine.table_name, "partitions": "1", "fetch_size": "4"}
    for page_bytes, asked in (("1", [4, 1, 1, 1, 1, 1, 1, 1, 1]), (None, [4, 4, 4])):
        pages.clear()
        got = read_all({**base, **({"page_bytes": page_bytes} if page_bytes else {})})
        assert got.column("id").to_pylist() == sorted(ids)
        assert [size for size, _ in pages] == asked, pages
        assert sum(rows for _, rows in pages) == len(ids)


def test_the_next_page_holds_about_the_byte_budget() -> None:
    from outbox.pipeline.source import ARROW_PAGE_ROWS, DRIVER_PAGE_ROWS, PAGE_BYTES, next_page_rows

    assert next_page_rows(100 * 1_048_576, 100, ARROW_PAGE_ROWS, PAGE_BYTES) == 32  # 1 MiB rows
    assert next_page_rows(200 * 1000, 1000, ARROW_PAGE_ROWS, PAGE_BYTES) == ARROW_PAGE_ROWS  # small rows: the cap
    assert next_page_rows(64 * 1_048_576, 1, ARROW_PAGE_ROWS, PAGE_BYTES) == 1  # a row over the budget still goes
    # The Python driver's pages stay small (an object per value): for reader=driver and for
    # SQL Server through pyodbc, unless fetch_size says otherwise.
    assert OutboxReader({"url": "sqlite:///x.db"}).page_rows(arrow=True) == ARROW_PAGE_ROWS
    assert OutboxReader({"url": "sqlite:///x.db"}).page_rows(arrow=False) == DRIVER_PAGE_ROWS
    assert OutboxReader({"url": "sqlite:///x.db", "fetch_size": "7"}).page_rows(arrow=False) == 7


# -- the Arrow readers' own connections: the engines' network bounds (docs/relay.md, "A network cut")

def test_the_arrow_readers_connect_with_the_engines_network_bounds() -> None:
    """ADBC and connectorx open their own connections: each carries the keepalives and
    ``TCP_USER_TIMEOUT`` the engine gives its own, so a silent server (a failover, a cut path)
    ends a page within ``tcp_timeout_s`` instead of hanging the job (found in review: 2 h 11 min
    on ADBC, for ever on connectorx). A parameter written in the URL wins, as for the engine."""
    from psycopg.conninfo import conninfo_to_dict

    pg = "postgresql+psycopg://app:secret@db.example:5432/app?tcp_timeout_s=10&idle_transaction_timeout_s=5"
    uri = PostgresFetch(pg, engine_for_url(pg)).uri()
    assert uri.startswith("postgresql://app:secret@db.example:5432/app?")
    assert conninfo_to_dict(uri) == {"user": "app", "password": "secret", "host": "db.example", "port": "5432",
                                     "dbname": "app", "connect_timeout": "10", "keepalives": "1",
                                     "keepalives_idle": "5", "keepalives_interval": "1", "keepalives_count": "3",
                                     "tcp_user_timeout": "10000"}
    own = conninfo_to_dict(PostgresFetch(pg + "&keepalives_idle=60", engine_for_url(pg)).uri())
    assert own["keepalives_idle"] == "60" and own["tcp_user_timeout"] == "10000"

    my = "mysql://app:s%40cret@db.example:3306/app?tcp_timeout_s=4&read_timeout=30"
    bounds = ("prefer_socket=false&tcp_connect_timeout_ms=10000&tcp_keepalive_time_ms=2000"
              "&tcp_keepalive_probe_interval_secs=1&tcp_keepalive_probe_count=2&tcp_user_timeout_ms=4000")
    assert MysqlFetch(my, engine_for_url(my)).cx_url() == f"mysql://app:s%40cret@db.example:3306/app?{bounds}"
    v6 = "mysql://root@[::1]:3306/app?tcp_timeout_s=4"  # an IPv6 literal stays bracketed
    assert MysqlFetch(v6, engine_for_url(v6)).cx_url() == f"mysql://root@[::1]:3306/app?{bounds}"


def tcp_options_to(port: int) -> dict[int, dict[str, int]]:
    """This process's TCP sockets connected to ``port``: fd -> the options that find a silent
    server (read on a duplicate of the descriptor: the socket is the library's own)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            copy = os.dup(int(name))
        except OSError:
            continue  # already closed
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue  # not a socket
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.getpeername()[1] != port:
                continue
            found[int(name)] = {option: sock.getsockopt(level, getattr(socket, option)) for level, option in (
                (socket.SOL_SOCKET, "SO_KEEPALIVE"), (socket.IPPROTO_TCP, "TCP_KEEPIDLE"),
                (socket.IPPROTO_TCP, "TCP_KEEPINTVL"), (socket.IPPROTO_TCP, "TCP_KEEPCNT"),
                (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT"))}
        except OSError:
            continue  # not connected
        finally:
            sock.close()  # the duplicate only
    return found


@pytest.mark.skipif(not (os.path.isdir("/proc/self/fd") and hasattr(socket, "TCP_USER_TIMEOUT")),
                    reason="reads the sockets' options through Linux's /proc")
@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_the_arrow_readers_sockets_find_a_silent_server(server: str) -> None:
    """On the real servers: the socket ADBC (kept between partitions) or connectorx (one per
    page) reads a page on has the keepalive and ``TCP_USER_TIMEOUT`` of ``tcp_timeout_s``,
    the kernel's own means of ending a read from a server that went silent."""
    url, port = {"postgresql": (POSTGRES_URL, 5432), "mysql": (MYSQL_URL, 3306)}[server]
    require(server, "127.0.0.1", port)
    url += ("&" if "?" in url else "?") + "tcp_timeout_s=4"
    fetch = arrow_fetch(url, engine_for_url(url), "arrow")
    assert fetch is not None
    before = set(tcp_options_to(port))
    seen: dict[int, dict[str, int]] = {}
    handle = fetch.open()
    sleep = "SELECT pg_sleep(1.5)::text AS s" if server == "postgresql" else "SELECT SLEEP(1.5) AS s"
    reading = threading.Thread(target=fetch.page, args=(handle, sleep))
    reading.start()
    try:
        while reading.is_alive() or not seen:
            seen.update({fd: o for fd, o in tcp_options_to(port).items() if fd not in before})
            if not reading.is_alive():
                break
            time.sleep(0.1)
    finally:
        reading.join()
        fetch.discard(handle)
    assert seen, "no connection of the reader's was seen"
    for options in seen.values():
        assert options == {"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 2, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 2,
                           "TCP_USER_TIMEOUT": 4000}, options
