"""``spark.read.format("outbox")``: the outbox table as a Spark 4 Python data source.

Built on the project's own engine modules and drivers, so every engine reads the
same way (SQL Server included, where no JDBC jar is at hand). The table is split
into id ranges, one Spark partition each; every partition pages through its range
by keyset (``id > last ORDER BY id``, ``fetch_size`` rows per statement), so no
statement holds more than a page and a partition restarts cleanly if Spark retries
it. Status, processing-time and creation-time filters are part of the SQL.

Each page is fetched by the engine's reader (``fetch.py``): straight into Arrow on
PostgreSQL (ADBC), MySQL/MariaDB and SQLite (connectorx) and SQL Server through
mssql-python (its own Arrow fetch), through the engine's Python driver on SQL Server
through pyodbc.

Options: ``url`` (required), ``table`` (default ``outbox``), ``schema``,
``statuses`` (``2,4``), ``processed_before`` / ``created_since`` (a driver-native
timestamp encoded by ``common.encode_native``, so the bound compares exactly as the
database compares its own values), ``min_id`` / ``max_id``, ``partitions``
(default 4), ``split`` (``id``, the default: equal id ranges; ``topic``: tasks of
about equal rows that each read whole topics but for the one it starts and the one it
ends with, see ``common.topic_tasks``), ``fetch_size`` (rows per page at most: 50,000
with an Arrow reader, 5,000 with the Python driver), ``page_bytes`` (an Arrow reader's
pages after the first hold about this many bytes: 32 MiB by default; ``next_page_rows``),
``reader`` (``arrow``, the default, or ``driver``: the engine's Python driver).

Where a JDBC driver is installed, ``spark.read.jdbc`` with ``partitionColumn=id``
is the alternative read path (docs/pipeline.md); the jobs use this source.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from ..storage.engines import Engine, engine_for_url
from .common import COUNT_CHUNK, SOURCE_SCHEMA_DDL, Piece, decode_native, range_chunks, topic_tasks
from .fetch import ArrowFetch, arrow_fetch, read_once_more, to_source_schema

_TIMESTAMP_COLUMNS = ("claimed_at", "next_retry_at", "created_at", "processed_at")
_T = TypeVar("_T")


def ARROW_SCHEMA() -> Any:
    """``SOURCE_SCHEMA_DDL`` as Arrow types."""
    import pyarrow as pa
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema([("id", pa.int64()), ("message_id", pa.string()), ("topic", pa.string()),
                      ("aggregate_type", pa.string()), ("aggregate_id", pa.string()), ("partition_key", pa.string()),
                      ("payload", pa.string()), ("headers", pa.string()), ("trace_id", pa.string()),
                      ("status", pa.int32()), ("attempts", pa.int32()), ("claimed_at", ts), ("next_retry_at", ts),
                      ("created_at", ts), ("processed_at", ts), ("last_error", pa.string())])


class OutboxDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "outbox"

    def schema(self) -> str:
        return SOURCE_SCHEMA_DDL

    def reader(self, schema: Any) -> OutboxReader:
        return OutboxReader(dict(self.options))


class IdRange(InputPartition):
    """The ids ``lo..hi``; with ``pieces`` (``split=topic``), only rows of those topic pieces."""

    def __init__(self, lo: int, hi: int, pieces: tuple[Piece, ...] = ()) -> None:
        super().__init__((lo, hi, pieces))
        self.lo, self.hi, self.pieces = lo, hi, pieces


#: Above this many topics, ``split=topic`` falls back to id ranges (a task's ``IN`` list
#: stays well under SQL Server's 2,100 parameters on the driver path).
MAX_SPLIT_TOPICS = 1000


class OutboxQuery:
    """The SQL of one read, shared by the planner (bounds) and the partitions (pages)."""

    def __init__(self, options: dict[str, str], pieces: tuple[Piece, ...] = ()) -> None:
        if not options.get("url"):
            raise ValueError("the outbox data source needs the 'url' option")
        self.url = options["url"]
        self.engine: Engine = engine_for_url(self.url, table=options.get("table") or "outbox",
                                             schema=options.get("schema") or None)
        self.fetch: ArrowFetch | None = arrow_fetch(self.url, self.engine, options.get("reader") or "arrow")
        conditions, params = [], []
        statuses = [int(s) for s in (options.get("statuses") or "").split(",") if s.strip()]
        if statuses:
            conditions.append(f"status IN ({', '.join(str(s) for s in statuses)})")
        if options.get("processed_before"):
            conditions.append("processed_at <= ?")
            params.append(decode_native(options["processed_before"]))
        if options.get("created_since"):
            conditions.append("created_at >= ?")
            params.append(decode_native(options["created_since"]))
        if pieces:
            whole = [topic for topic, first, _ in pieces if first is None]
            parts = [piece for piece in pieces if piece[1] is not None]
            terms = [f"topic IN ({', '.join('?' for _ in whole)})"] if whole else []
            terms += ["(topic = ? AND id >= ? AND id <= ?)"] * len(parts)
            conditions.append(f"({' OR '.join(terms)})")
            params.extend(whole)
            params.extend(value for piece in parts for value in piece)
        self.where = " AND ".join(conditions) or "1 = 1"
        self.params = params
        e = self.engine
        self.columns = ", ".join(["id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key",
                                  e.payload_column(), e.headers_column(), "trace_id", "status", "attempts",
                                  *_TIMESTAMP_COLUMNS, "last_error"])

    def bounds_sql(self) -> str:
        return f"SELECT MIN(id), MAX(id) FROM {self.engine.table} WHERE {self.where}"

    def page_sql(self) -> str:
        """One page of a partition: ``?`` after-id, ``?`` last id, the filters, ``?`` rows."""
        return self.engine.limit(f"SELECT {self.columns} FROM {self.engine.id_range_source()} "
                                 f"WHERE id > ? AND id <= ? AND {self.where} ORDER BY id")

    def topics_sql(self) -> str:
        """Rows and id bounds per topic; ``?`` first and ``?`` last id after the filters (one
        chunk of the span: ``OutboxReader.topic_groups``)."""
        return (f"SELECT topic, COUNT(*), MIN(id), MAX(id) FROM {self.engine.id_range_source()} "
                f"WHERE {self.where} AND id >= ? AND id <= ? GROUP BY topic")

    def bounds(self, cursor: Any) -> tuple[int | None, int | None]:
        row = self.engine.execute(cursor, self.bounds_sql(), self.params).fetchone()
        return (None, None) if row is None or row[0] is None else (int(row[0]), int(row[1]))

    def page(self, cursor: Any, after: int, hi: int, size: int) -> list[tuple]:
        return self.engine.execute(cursor, self.page_sql(), [after, hi, *self.params, size]).fetchall()

    def inline_page_sql(self, after: int, hi: int, size: int) -> str:
        """``page_sql`` with its values written in as literals, for the Arrow readers
        (which bind none; ``fetch.py`` says why the comparisons stay the database's own)."""
        assert self.fetch is not None
        values = [str(int(after)), str(int(hi)),
                  *(str(v) if isinstance(v, int) else self.fetch.literal(v) for v in self.params), str(int(size))]
        pieces = self.page_sql().split("?")
        if len(pieces) != len(values) + 1:
            raise ValueError(f"the table name {self.engine.table} holds a '?': use reader=driver")
        return "".join(piece + value for piece, value in zip(pieces, values)) + pieces[-1]

    def arrow_page(self, handle: Any, after: int, hi: int, size: int) -> Any:
        """One page as an Arrow table in the source's schema, no Python row objects."""
        assert self.fetch is not None
        if self.fetch.binds:
            table = self.fetch.page(handle, self.page_sql(), [after, hi, *self.params, size])
        else:
            table = self.fetch.page(handle, self.inline_page_sql(after, hi, size))
        return to_source_schema(table, ARROW_SCHEMA(), self.engine.to_datetime)

    def to_batch(self, rows: list[tuple]) -> Any:
        """One page as an Arrow record batch, built column by column: Spark takes it
        as is, which is several times cheaper than handing it Python tuples."""
        import pyarrow as pa

        columns = list(zip(*rows))

        def text(values: tuple) -> Any:
            if not all(v is None or isinstance(v, str) for v in values):
                values = tuple(_json_text(v) for v in values)
            return pa.array(values, pa.string())

        def timestamps(values: tuple) -> Any:
            # Aware datetimes convert to UTC, naive ones are UTC already (the engines'
            # clocks are UTC); text (SQLite) is parsed by the engine.
            if any(isinstance(v, str) for v in values):
                values = tuple(self.engine.to_datetime(v) for v in values)
            return pa.array(values, pa.timestamp("us", tz="UTC"))

        arrays = [pa.array(columns[0], pa.int64()), *(text(columns[i]) for i in range(1, 9)),
                  pa.array(columns[9], pa.int32()), pa.array(columns[10], pa.int32()),
                  *(timestamps(columns[i]) for i in range(11, 15)), text(columns[15])]
        return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA())


def _json_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # a driver that decoded JSON


#: Rows per page at most: an Arrow reader's pages hold no Python row objects, and fewer,
#: larger statements read faster (docs/pipeline.md, "How the jobs read the outbox");
#: the Python driver makes an object per value, so its pages stay small.
ARROW_PAGE_ROWS, DRIVER_PAGE_ROWS = 50_000, 5_000
#: An Arrow reader's first page (nothing is known of the rows' size yet) and its byte budget.
FIRST_PAGE_ROWS, PAGE_BYTES = 1_000, 32 * 1024 * 1024


def next_page_rows(table_bytes: int, table_rows: int, most: int, budget: int) -> int:
    """Rows of the next page: about ``budget`` bytes at the last page's bytes per row,
    at most ``most``, at least one."""
    per_row = max(1.0, table_bytes / max(1, table_rows))
    return max(1, min(most, int(budget // per_row)))


class OutboxReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.partition_count = max(1, int(options.get("partitions") or 4))
        self.fetch_size = max(1, int(options["fetch_size"])) if options.get("fetch_size") else None
        self.page_bytes = max(1, int(options.get("page_bytes") or PAGE_BYTES))
        self.split = options.get("split") or "id"
        if self.split not in ("id", "topic"):
            raise ValueError(f"the outbox data source's split is 'id' or 'topic', not {self.split!r}")

    def partitions(self) -> list[IdRange]:
        """Equal id ranges between the lowest and highest matching id (asked of the
        database once, here, unless ``min_id``/``max_id`` are given); with
        ``split=topic``, ``common.topic_tasks`` of the rows per topic (``topic_groups``)."""
        lo = int(self.options["min_id"]) if self.options.get("min_id") else None
        hi = int(self.options["max_id"]) if self.options.get("max_id") else None
        query: OutboxQuery | None = None  # made only when the database is asked
        if lo is None or hi is None:
            query = OutboxQuery(self.options)
            found_lo, found_hi = self._ask(query, query.bounds)
            if found_lo is None or found_hi is None:
                return [IdRange(1, 0)]  # nothing matches: one empty partition
            lo = found_lo if lo is None else max(lo, found_lo)
            hi = found_hi if hi is None else min(hi, found_hi)
        if hi < lo:
            return [IdRange(1, 0)]
        if self.split == "topic":
            groups = self.topic_groups(query or OutboxQuery(self.options), lo, hi)
            if not groups:
                return [IdRange(1, 0)]
            if len(groups) <= MAX_SPLIT_TOPICS:
                return [IdRange(*task) for task in topic_tasks(groups, self.partition_count)]
        span = hi - lo + 1
        n = min(self.partition_count, span)
        step = -(-span // n)
        return [IdRange(start, min(hi, start + step - 1)) for start in range(lo, hi + 1, step)]

    @staticmethod
    def topic_groups(query: OutboxQuery, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
        """(topic, rows, first id, last id) of the rows in ``lo..hi``, counted one statement
        per ``COUNT_CHUNK`` ids (each its own transaction, on one connection of its own) and
        merged: one GROUP BY over the whole span held a snapshot as long as the backlog
        (docs/pipeline.md, "How the jobs read the outbox"). Past ``MAX_SPLIT_TOPICS`` topics
        it stops (the plan falls back to id ranges)."""
        merged: dict[str, tuple[int, int, int]] = {}
        conn = query.engine.connect(query.url)
        try:
            for first, last in range_chunks([(lo, hi)], COUNT_CHUNK):
                rows = query.engine.execute(conn.cursor(), query.topics_sql(), [*query.params, first, last]).fetchall()
                conn.rollback()
                for topic, n, a, b in rows:
                    had = merged.get(str(topic))
                    merged[str(topic)] = ((int(n), int(a), int(b)) if had is None else
                                          (had[0] + int(n), min(had[1], int(a)), max(had[2], int(b))))
                if len(merged) > MAX_SPLIT_TOPICS:
                    break
        finally:
            conn.close()
        return [(topic, n, a, b) for topic, (n, a, b) in merged.items()]

    @staticmethod
    def _ask(query: OutboxQuery, work: Callable[[Any], _T]) -> _T:
        """``work(cursor)`` on a connection of its own, for planning: read, roll back, close."""
        conn = query.engine.connect(query.url)
        try:
            result = work(conn.cursor())
            conn.rollback()
            return result
        finally:
            conn.close()

    def page_rows(self, arrow: bool) -> int:
        """Rows per page at most: ``fetch_size`` when given, else the reader's own default."""
        return self.fetch_size or (ARROW_PAGE_ROWS if arrow else DRIVER_PAGE_ROWS)

    def read(self, partition: IdRange) -> Iterator[Any]:  # type: ignore[override]
        if partition.hi < partition.lo:
            return
        query = OutboxQuery(self.options, partition.pieces)
        if query.fetch is not None:
            yield from self._read_arrow(query, partition)
            return
        size = self.page_rows(arrow=False)  # the engine's Python driver (no Arrow reader for it)
        conn = query.engine.connect(query.url)
        try:
            after = partition.lo - 1
            while True:
                # MySQL ends idle relay sessions (docs/relay.md, "A network cut"): a page is
                # read once more on a new connection when its session is gone.
                conn, rows = read_once_more(query.engine, query.url, conn, lambda c: query.page(
                    c.cursor(), after, partition.hi, size))  # noqa: B023 - called at once
                conn.rollback()  # end the read transaction between pages: no long snapshot held
                if rows:
                    yield query.to_batch(rows)
                if len(rows) < size:
                    break
                after = int(rows[-1][0])
        finally:
            with contextlib.suppress(Exception):  # closed already when a read once more failed
                conn.close()

    def _read_arrow(self, query: OutboxQuery, partition: IdRange) -> Iterator[Any]:
        """The same keyset pages through the engine's Arrow reader; each page is its
        own statement and transaction, and only one page is held at a time. The first page
        is small; each next one holds about ``page_bytes`` at the last page's bytes per row
        (up to ``fetch_size`` rows), so large payloads make short pages."""
        assert query.fetch is not None
        handle = query.fetch.open()
        try:
            most = self.page_rows(arrow=True)
            after, size = partition.lo - 1, min(most, FIRST_PAGE_ROWS)
            while True:
                table = query.arrow_page(handle, after, partition.hi, size)
                yield from table.to_batches()
                if table.num_rows < size:
                    break
                after = int(table.column("id")[-1].as_py())
                size = next_page_rows(table.nbytes, table.num_rows, most, self.page_bytes)
        except BaseException:  # an error, or Spark stopped reading (GeneratorExit)
            query.fetch.discard(handle)
            raise
        query.fetch.close(handle)
