"""The archive's stage (its step 3) and the ids it staged (step 4): the rows to archive
-> Parquet under ``_staging/<run>/``, partitioned ``topic=/date=``.

Two writers make the same files (the layout, columns, types and directory names of
docs/pipeline.md, "Layout"); docs/pipeline.md, "The stage's two writers", says why
there are two and what each costs:

- ``ArrowWriter``, for an archive on a filesystem path (``file:``, a local or shared
  directory): each Spark task reads its id range with the ``outbox`` data source's
  reader and writes the Parquet files itself with pyarrow, so the rows never cross from
  the Python worker into the JVM; it reads back the ids of every file it wrote and
  reports them, with the files, to the driver.
- ``SparkWriter``, for any other URI Hadoop can write (``hdfs://``, ``s3a://``, ...):
  Spark's Parquet writer over the ``outbox`` data source; Spark reads the staged ids
  back (``EDGES_SQL``).

``write`` gives a ``Written``, whose ``ids()`` are the staged rows' count, their
``[first, last]`` runs of consecutive ids and the staged files (relative to the staging
directory); it raises ValueError when an id was staged twice.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import suppress
from typing import Any, Protocol

from .common import ARCHIVE_SCHEMA_DDL, PipelineError, fsync_path, local_path
from .fs import ArchiveFS

#: Columns whose values are distinct row by row: Parquet's writer would try a dictionary
#: for each of them in every file before falling back to plain values (docs/pipeline.md,
#: "Layout", says what that cost).
UNIQUE_COLUMNS = ("id", "message_id", "payload", "trace_id", "claimed_at", "next_retry_at", "created_at",
                  "processed_at")

#: The ids that begin or end a run of consecutive ids, or repeat the id before them,
#: with their neighbours in id order: one sort of the ids, no grouping.
EDGES_SQL = (
    "SELECT id, prev, next FROM (SELECT id, LAG(id) OVER (ORDER BY id) AS prev, "
    "LEAD(id) OVER (ORDER BY id) AS next FROM {view}) "
    "WHERE prev IS NULL OR next IS NULL OR id <> prev + 1 OR next <> id + 1")

#: The characters Spark (and Hive) write as ``%XX`` in a partition directory's value,
#: and the name it gives an empty one: the Arrow writer names directories the same way,
#: so one topic has one directory whichever writer staged it.
SPARK_ESCAPED = frozenset([chr(c) for c in range(1, 0x20)] + list("\"#%'*/:=?[\\]^{") + ["\x7f"])
DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"

#: Rows per Parquet row group in the Arrow writer's files (at most; fewer when the task's
#: gathered rows pass ``BUFFER_BYTES`` first, or at the end of a file).
ROW_GROUP_ROWS = 128 * 1024
#: Rows a task of the Arrow writer gathers for its open files before writing them, in bytes.
BUFFER_BYTES = 64 * 1024 * 1024
#: Files a task of the Arrow writer keeps open at once (one per topic and date its rows hold).
OPEN_FILES = 64


def partition_value(value: str | None) -> str:
    """``value`` as Spark names a partition directory after it."""
    if not value:
        return DEFAULT_PARTITION
    return "".join(f"%{ord(c):02X}" if c in SPARK_ESCAPED else c for c in value)


#: The longest file or directory name, in bytes, on a local filesystem (Linux's NAME_MAX)
#: and on HDFS (``dfs.namenode.fs-limits.max-component-length``); object stores have none.
MAX_NAME_BYTES = 255
#: A topic of at most this many characters always fits ``topic=<value>`` in ``MAX_NAME_BYTES``:
#: a character takes at most 4 bytes, escaped or not (``%XX``: 3).
SHORT_TOPIC_CHARS = (MAX_NAME_BYTES - len("topic=")) // 4


def topic_dir_bytes(topic: str | None) -> int:
    """The length in bytes of the directory ``topic``'s rows go to: ``topic=<value>``."""
    return len(f"topic={partition_value(topic)}".encode())


def id_runs(edges: Iterable[tuple[int, int | None, int | None]]) -> tuple[int, list[list[int]]]:
    """``EDGES_SQL``'s rows (an id, the ids before and after it in id order) -> the row
    count and the ``[first, last]`` runs of consecutive ids ("gaps and islands": every
    id not right after the one before it starts a run, every id not right before the
    one after it ends one, so the rows strictly inside a run are never read). Raises
    ValueError when an id is there twice (it equals the id before it)."""
    rows, ranges, first = 0, [], None
    for id_, prev, nxt in sorted(edges, key=lambda edge: edge[0]):
        if prev is not None and int(prev) == id_:
            raise ValueError(f"holds id {id_} twice")
        if prev is None or int(prev) != id_ - 1:
            first = id_
        if nxt is None or int(nxt) != id_ + 1:
            if first is None:
                raise ValueError(f"has no start for the run ending at id {id_}")
            ranges.append([first, id_])
            rows += id_ - first + 1
            first = None
    if first is not None:
        raise ValueError(f"has no end for the run starting at id {first}")
    return rows, ranges


def merge_runs(runs: Iterable[tuple[int, int]]) -> tuple[int, list[list[int]]]:
    """``[first, last]`` runs of ids, from any number of files -> the row count and the
    runs of consecutive ids they make together. Raises ValueError when two runs share
    an id (an id staged twice)."""
    ranges: list[list[int]] = []
    rows = 0
    for first, last in sorted((int(a), int(b)) for a, b in runs):
        if ranges and first <= ranges[-1][1]:
            raise ValueError(f"holds id {first} twice")
        if ranges and first == ranges[-1][1] + 1:
            ranges[-1][1] = last
        else:
            ranges.append([first, last])
        rows += last - first + 1
    return rows, ranges


class Written(Protocol):
    def ids(self) -> tuple[int, list[list[int]], list[str]]:
        """The staged rows' count, their runs of consecutive ids and the staged files."""


class StageWriter(Protocol):
    name: str

    def write(self, spark: Any, options: dict[str, str], staging: str, run_id: str) -> Written:
        """Stage the rows ``options`` select (the ``outbox`` data source's options) under
        ``staging`` with ``archive_run`` = ``run_id``."""


def writer_for(name: str, root: str) -> StageWriter:
    """The stage writer ``name`` (``arrow``, ``spark`` or ``auto``: the Arrow writer for an
    archive on a filesystem path, Spark's for any other URI) for the archive ``root``;
    PipelineError for a name or a location it cannot serve."""
    if name == "auto":
        name = "arrow" if local_path(root) is not None else "spark"
    if name == "arrow":
        if local_path(root) is None:
            raise PipelineError(f"the arrow writer writes to a filesystem path (file:), not {root}: "
                             "use --writer spark")
        return ArrowWriter()
    if name == "spark":
        return SparkWriter()
    raise PipelineError(f"the stage writer is auto, arrow or spark, not {name!r}")


# -- Spark's writer ----------------------------------------------------------------------------
class SparkWriter:
    name = "spark"

    def write(self, spark: Any, options: dict[str, str], staging: str, run_id: str) -> Written:
        from pyspark.sql import functions as F

        # ``date`` is a DATE: its directory name is the same yyyy-MM-dd (UTC session) a
        # formatted string would give, but the writer sorts and compares an int per row
        # instead of a string made per row (docs/pipeline.md, "Measured").
        frame = (spark.read.format("outbox").options(**options).load()
                 .withColumn("archive_run", F.lit(run_id))
                 .withColumn("date", F.to_date("created_at")))
        writer = frame.write.partitionBy("topic", "date").mode("errorifexists")
        for column in UNIQUE_COLUMNS:  # no dictionary attempt per file (docs/pipeline.md, "Layout")
            writer = writer.option(f"parquet.enable.dictionary#{column}", "false")
        writer.parquet(staging)
        return SparkWritten(spark, staging)


class SparkWritten:
    def __init__(self, spark: Any, staging: str) -> None:
        self.spark, self.staging = spark, staging

    def ids(self) -> tuple[int, list[list[int]], list[str]]:
        """Read the staged ids back in one pass; the files are the very files whose ids
        were read, as Spark listed them for this read (no second listing)."""
        staged = self.spark.read.schema(ARCHIVE_SCHEMA_DDL).option("basePath", self.staging).parquet(self.staging)
        fs = ArchiveFS(self.spark, self.staging)
        files = [f for f in fs.relative(self.staging, staged.inputFiles()) if f.endswith(".parquet")]
        staged.select("id").createOrReplaceTempView("outbox_staged")
        edges = self.spark.sql(EDGES_SQL.format(view="outbox_staged")).collect()
        rows, ranges = id_runs((int(r["id"]), r["prev"], r["next"]) for r in edges)
        return rows, ranges, files


# -- the Arrow writer --------------------------------------------------------------------------
#: What each of the Arrow writer's tasks reports: a row per file it wrote (``first`` and
#: ``last`` null), and a row per run of consecutive ids its files hold (``file`` null).
REPORT_SCHEMA_DDL = "file STRING, first BIGINT, last BIGINT"


class ArrowWriter:
    name = "arrow"

    def write(self, spark: Any, options: dict[str, str], staging: str, run_id: str) -> Written:
        from .source import OutboxReader

        base = local_path(staging)
        assert base is not None  # writer_for gives this writer file: archives only
        tasks = OutboxReader(options).partitions()  # planned on the driver, as Spark plans the source
        job = _TaskJob(tasks, options, str(base), run_id)
        reports = (spark.range(len(tasks), numPartitions=len(tasks))
                   .mapInArrow(job, REPORT_SCHEMA_DDL).collect())
        return ArrowWritten([r["file"] for r in reports if r["file"] is not None],
                            [(int(r["first"]), int(r["last"])) for r in reports if r["file"] is None])


class ArrowWritten:
    def __init__(self, files: list[str], runs: list[tuple[int, int]]) -> None:
        self.files, self.runs = files, runs

    def ids(self) -> tuple[int, list[list[int]], list[str]]:
        rows, ranges = merge_runs(self.runs)
        return rows, ranges, sorted(self.files)


class _TaskJob:
    """The function each of the Arrow writer's Spark tasks runs (``mapInArrow``): its
    input is the indexes of the tasks it writes, its output their reports (a row per
    file, a row per run of ids: ``REPORT_SCHEMA_DDL``)."""

    def __init__(self, tasks: list[Any], options: dict[str, str], base: str, run_id: str) -> None:
        self.tasks, self.options, self.base, self.run_id = tasks, options, base, run_id

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from .source import OutboxReader

        reader = OutboxReader(self.options)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                files, runs = write_task(reader, self.tasks[index], self.base, self.run_id)
                yield pa.RecordBatch.from_arrays(
                    [pa.array(files + [None] * len(runs), pa.string()),
                     pa.array([None] * len(files) + [first for first, _ in runs], pa.int64()),
                     pa.array([None] * len(files) + [last for _, last in runs], pa.int64())],
                    names=["file", "first", "last"])


def file_schema() -> Any:
    """The Arrow schema of the Arrow writer's files: the source's columns but ``topic``
    (a directory level, as ``date`` is), then ``archive_run`` (never null): the columns Spark's
    writer puts in its files, in its order."""
    import pyarrow as pa

    from .source import ARROW_SCHEMA
    source = ARROW_SCHEMA()
    return source.remove(source.get_field_index("topic")).append(pa.field("archive_run", pa.string(), nullable=False))


def write_task(reader: Any, task: Any, base: str, run_id: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Read one task's rows (``reader.read(task)``, a page at a time) and write them as
    Parquet under ``base``, a file per topic and date (``TaskFiles``); then read the
    ids back from those files. Gives the files (relative to ``base``) and the runs of
    consecutive ids they hold together."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    files = TaskFiles(base, file_schema())
    try:
        for page in reader.read(task):
            if not page.num_rows:
                continue
            topics = pc.dictionary_encode(page.column("topic"))
            days = pc.cast(page.column("created_at"), pa.date32())  # the timestamps are UTC
            day_numbers = pc.cast(days, pa.int32()).to_numpy(zero_copy_only=False).astype(np.int64)
            keys = (topics.indices.to_numpy(zero_copy_only=False).astype(np.int64) << 32) | \
                (day_numbers - day_numbers.min())
            order = np.argsort(keys, kind="stable")  # by topic and day, each group in id order
            ordered = keys[order]
            starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
            rows = pa.RecordBatch.from_arrays(
                [*page.drop_columns(["topic"]).columns, pa.repeat(pa.scalar(run_id, pa.string()), page.num_rows)],
                schema=files.schema)
            for start, end in zip(starts, [*starts[1:], len(order)]):
                first = order[start]
                # A group's own copy (take), not a slice of the page: a buffered group then
                # keeps no page alive.
                files.write(topics.dictionary[topics.indices[first].as_py()].as_py(), days[first].as_py().isoformat(),
                            rows.take(pa.array(order[start:end])))
        paths = files.close()
    except BaseException:
        files.abandon()
        raise
    return [os.path.relpath(path, base) for path in paths], file_runs(*paths)


class TaskFiles:
    """The Parquet files one task of the Arrow writer writes: one open file per topic and
    date (``topic=<value as Spark names it>/date=yyyy-MM-dd/``), each under a hidden name
    (``.part-...``, which Spark's and Arrow's readers skip) until it is complete and
    renamed, so a task that fails, or that Spark runs twice, leaves no partial file that a
    reader of the staging would take.

    A page holds rows of many topics and days, so each file's rows are gathered until
    they make a row group of ``ROW_GROUP_ROWS`` rows, or until the task's gathered rows
    pass ``BUFFER_BYTES`` (then the file holding most is written out): row groups stay
    large with many topics, and memory stays bounded. At most ``OPEN_FILES`` are open at
    once (the least recently written is completed first)."""

    def __init__(self, base: str, schema: Any) -> None:
        self.base, self.schema = base, schema
        self.tag = uuid.uuid4().hex
        #: Open files by (topic, day), the most recently written last: (writer, hidden path).
        self.open: dict[tuple[str, str], tuple[Any, str]] = {}
        #: Rows gathered for each open file, not written yet.
        self.gathered: dict[tuple[str, str], list[Any]] = {}
        self.gathered_bytes = 0
        self.done: list[str] = []
        self.count = 0
        self.dictionary = [c for c in schema.names if c not in UNIQUE_COLUMNS]

    def write(self, topic: str, day: str, rows: Any) -> None:
        import pyarrow.parquet as pq

        key = (topic, day)
        entry = self.open.pop(key, None)
        if entry is None:
            if len(self.open) >= OPEN_FILES:
                self._complete(next(iter(self.open)))
            folder = os.path.join(self.base, f"topic={partition_value(topic)}", f"date={day}")
            os.makedirs(folder, exist_ok=True)
            hidden = os.path.join(folder, f".part-{self.tag}-{self.count}.parquet")
            self.count += 1
            entry = (pq.ParquetWriter(hidden, self.schema, compression="snappy", use_dictionary=self.dictionary),
                     hidden)
        self.open[key] = entry
        batches = self.gathered.setdefault(key, [])
        batches.append(rows)
        self.gathered_bytes += rows.nbytes
        if sum(b.num_rows for b in batches) >= ROW_GROUP_ROWS:
            self._flush(key)
        while self.gathered_bytes > BUFFER_BYTES:
            self._flush(max(self.gathered, key=lambda k: sum(b.nbytes for b in self.gathered[k])))

    def _flush(self, key: tuple[str, str]) -> None:
        """Write the rows gathered for ``key``'s file: row groups of ``ROW_GROUP_ROWS`` rows at most."""
        import pyarrow as pa

        batches = self.gathered.pop(key, [])
        if batches:
            self.gathered_bytes -= sum(b.nbytes for b in batches)
            self.open[key][0].write_table(pa.Table.from_batches(batches, schema=self.schema),
                                          row_group_size=ROW_GROUP_ROWS)

    def _complete(self, key: tuple[str, str]) -> None:
        self._flush(key)
        writer, hidden = self.open[key]
        writer.close()  # should it fail, the file stays open for abandon() to remove
        del self.open[key]
        final = os.path.join(os.path.dirname(hidden), os.path.basename(hidden)[1:])
        # On disk before its name says it is complete; the task's host flushes what it wrote
        # (on a shared filesystem the driver's own fsync may not: docs/pipeline.md, "Durability").
        fsync_path(hidden)
        os.replace(hidden, final)
        self.done.append(final)

    def close(self) -> list[str]:
        """Complete every open file; the paths of all the task's files."""
        while self.open:
            self._complete(next(iter(self.open)))
        return self.done

    def abandon(self) -> None:
        """A failed task: close its open files and remove them (completed ones stay,
        named in no report, and go with the staging directory)."""
        self.gathered.clear()
        for writer, hidden in self.open.values():
            with suppress(Exception):  # the task's own error is the one to report
                writer.close()
            with suppress(OSError):
                os.remove(hidden)
        self.open.clear()


def file_runs(*paths: str) -> list[tuple[int, int]]:
    """The runs of consecutive ids in the Parquet files at ``paths`` together, read back
    from them (an id there twice makes two runs that overlap, which ``merge_runs``
    refuses). A task's files are read together: its rows are interleaved by topic, so
    one file alone holds runs of a row or two."""
    import numpy as np
    import pyarrow.parquet as pq

    parts = [pq.read_table(path, columns=["id"]).column("id").to_numpy() for path in paths]
    ids = np.sort(np.concatenate(parts)) if parts else np.array([], dtype=np.int64)
    if not len(ids):
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1)
    firsts = np.concatenate(([ids[0]], ids[cuts + 1]))
    lasts = np.concatenate((ids[cuts], [ids[-1]]))
    return [(int(a), int(b)) for a, b in zip(firsts, lasts)]
