"""``python -m bench.pipeline``: the Spark pipeline's throughput against Spark's own JDBC.

In one run (default ``--rows 200000``, a few minutes on a shared 2-core machine):

1. per engine (PostgreSQL, MariaDB/MySQL, SQLite), on one table of done rows (every
   path below first warmed up on 5,000 rows):
   ``read``  the ``outbox`` data source -> Parquet (a Spark job's read of the outbox), against
   ``jdbc``  Spark's JDBC reader -> Parquet, same columns and types, same partitions
             (Debian's ``libpostgresql-jdbc-java``, ``libmariadb-java``,
             ``libxerial-sqlite-jdbc-java``), and, on PostgreSQL, ``driver``: the data
             source's Python-driver path (``reader=driver``, the fallback);
   on SQL Server (``--engines mssql``, the pyodbc URL in ``OUTBOX_BENCH_MSSQL_URL``; no JDBC
   driver is at hand), ``read`` is mssql-python's Arrow fetch (the same URL rewritten for
   mssql-python) against ``pyodbc``, the driver path through pyodbc (issue 23's figure for
   SQL Server), and ``mssql-python rows``, the driver path through mssql-python;
2. on PostgreSQL and MariaDB: ``archive`` (the whole ``Archiver`` run: stage, verify,
   commit, publish, delete; ``--writer`` as the archive's, ``auto``: the Arrow writer
   for the bench's directory) against the read alone, alternating ``--repeat`` times, each
   archive run on a table freshly filled with the same rows and read once, untimed, so
   that its pages are as warm as the read's table is (``--cold-archive``: not read
   first); ``replay`` of that archive into an
   empty table against ``insert``, a plain bulk INSERT of the same rows (``executemany``,
   1,000 rows per transaction).

Printed: rows/s of each (the best of ``--repeat`` alternating runs), the
ratios read/jdbc (target >= 1.0), archive/read (>= 0.8; also the archive's own stage
step against its whole run, with the seconds at which it passed each step) and
replay/insert (>= 1.0), the CPU seconds the Spark JVM and its Python workers used in
each run (less swayed by the neighbours' load than the wall time; the database's own
work is not in it), and the peak RSS of the Spark JVM and of the Python workers,
sampled from /proc every 0.2 s. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from .common import POSTGRES_URL, log
from .procs import cpu_seconds, process_tree

MYSQL_URL = os.environ.get("OUTBOX_BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
#: SQL Server, only when given (a mssql+pyodbc:// URL; the bench rewrites it for mssql-python).
MSSQL_URL = os.environ.get("OUTBOX_BENCH_MSSQL_URL", "")
JARS = {"postgresql": "/usr/share/java/postgresql.jar", "mysql": "/usr/share/java/mariadb-java-client.jar",
        "sqlite": "/usr/share/java/sqlite-jdbc.jar"}
#: Debian's xerial driver loads the system's libsqlitejdbc.so from here.
JNI_DIR = "/usr/lib/x86_64-linux-gnu/jni"
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak RSS of this process's descendants, split into the JVM and Python workers."""

    def __init__(self) -> None:
        self.peak = {"jvm_mb": 0.0, "python_workers_mb": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(0.2):
            parents, rss, names = {}, {}, {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    fields = stat[stat.rindex(")") + 2:].split()
                    parents[int(pid)] = int(fields[1])
                    rss[int(pid)] = int(fields[21]) * PAGE / 2**20
                    names[int(pid)] = stat[stat.index("(") + 1:stat.rindex(")")]
                except (OSError, ValueError, IndexError):
                    continue
            jvm = python = 0.0
            for pid in rss:
                p, depth = parents.get(pid), 0
                while p and p != me and depth < 10:
                    p, depth = parents.get(p), depth + 1
                if p != me:
                    continue
                if names[pid] == "java":
                    jvm += rss[pid]
                elif names[pid].startswith("python"):
                    python += rss[pid]
            self.peak["jvm_mb"] = max(self.peak["jvm_mb"], round(jvm, 1))
            self.peak["python_workers_mb"] = max(self.peak["python_workers_mb"], round(python, 1))


#: How ``fill`` writes ``message_id``: in the order of the rows, as ``enqueue``'s default
#: (UUIDv7) does, or at random, as UUIDv4s or ids of the caller's own would
#: (docs/internals.md, "Message ids are time-ordered").
MESSAGE_IDS = {
    "postgresql": {"ordered": "lpad(to_hex(g), 32, '0')", "random": "md5(g::text)"},
    "mysql": {"ordered": "LPAD(HEX(seq), 32, '0')", "random": "md5(seq)"},
    "sqlite": {"ordered": "printf('%032x', n)", "random": "hex(randomblob(16))"},
    "mssql": {"ordered": "RIGHT(CONCAT(REPLICATE(N'0', 32), g), 32)",
              "random": "CONVERT(NVARCHAR(64), HASHBYTES('MD5', CAST(g AS VARCHAR(20))), 2)"},
}


def fill(store: Any, rows: int, ids: str = "ordered") -> None:
    """``rows`` done rows, created 10 days ago, 1,000 aggregates, 5 topics, ~150-byte payloads;
    ``ids``: ``ordered`` or ``random`` message ids (``MESSAGE_IDS``)."""
    t, kind = store.engine.table, store.engine.name
    message_id = MESSAGE_IDS[kind][ids]
    with store.transaction() as c:
        if kind == "postgresql":
            c.execute(f"""INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload, headers, status,
                          attempts, created_at, processed_at)
                          SELECT {message_id}, 'topic.' || (g %% 5), 'order', 'a' || (g %% 1000),
                                 jsonb_build_object('n', g, 'pad', repeat('x', 120)), '{{"x-seq": "1"}}'::jsonb, 2, 0,
                                 now() - interval '10 days' + g * interval '1 ms',
                                 now() - interval '10 days' + g * interval '1 ms' + interval '40 ms'
                          FROM generate_series(1, %s) g""", (rows,))
        elif kind == "mysql":
            c.execute(f"""INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload, headers, status,
                          attempts, created_at, processed_at)
                          SELECT {message_id}, CONCAT('topic.', seq % 5), 'order', CONCAT('a', seq % 1000),
                                 JSON_OBJECT('n', seq, 'pad', REPEAT('x', 120)), '{{"x-seq": "1"}}', 2, 0,
                                 UTC_TIMESTAMP(3) - INTERVAL 10 DAY + INTERVAL seq * 1000 MICROSECOND,
                                 UTC_TIMESTAMP(3) - INTERVAL 10 DAY + INTERVAL seq * 1000 + 40000 MICROSECOND
                          FROM seq_1_to_{int(rows)}""")
        elif kind == "mssql":
            c.execute(mssql_fill_sql(t, ids), (rows,))
        else:
            c.execute(f"""WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)
                          INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload, headers, status,
                          attempts, created_at, processed_at)
                          SELECT {message_id}, 'topic.' || (n % 5), 'order', 'a' || (n % 1000),
                                 json_object('n', n, 'pad', printf('%.120c', 'x')), '{{"x-seq": "1"}}', 2, 0,
                                 strftime('%Y-%m-%d %H:%M:%f', 'now', '-10 days', (n / 1000.0) || ' seconds'),
                                 strftime('%Y-%m-%d %H:%M:%f', 'now', '-10 days', ((n + 40) / 1000.0) || ' seconds')
                          FROM g""", (rows,))


def mssql_fill_sql(table: str, ids: str = "ordered") -> str:
    """``fill``'s rows on SQL Server (``?``: how many): a numbers CTE over two catalog views."""
    return (f"WITH n AS (SELECT TOP (?) ROW_NUMBER() OVER (ORDER BY (SELECT NULL)) AS g "
            f"FROM sys.all_objects AS a CROSS JOIN sys.all_objects AS b) "
            f"INSERT INTO {table} (message_id, topic, aggregate_type, aggregate_id, payload, headers, status, "
            f"attempts, created_at, processed_at) "
            f"SELECT {MESSAGE_IDS['mssql'][ids]}, CONCAT(N'topic.', g % 5), "
            f"N'order', CONCAT(N'a', g % 1000), CONCAT(N'{{\"n\":', g, N',\"pad\":\"', REPLICATE(N'x', 120), N'\"}}'), "
            f"N'{{\"x-seq\": \"1\"}}', 2, 0, DATEADD(MILLISECOND, CAST(g AS INT), DATEADD(DAY, -10, SYSUTCDATETIME())), "
            f"DATEADD(MILLISECOND, CAST(g AS INT) + 40, DATEADD(DAY, -10, SYSUTCDATETIME())) FROM n")


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process's descendants (the Spark JVM and its
    Python workers; a worker that ended counts in its parent's children times)."""
    me = os.getpid()
    return sum(cpu_seconds(pid, reaped=True) or 0.0 for pid in process_tree(me) if pid != me)


def timed(label: str, rows: int, work: Any, results: dict[str, Any]) -> Any:
    with RssSampler() as sampler:
        cpu = tree_cpu_s()
        start = time.perf_counter()
        value = work()
        elapsed = time.perf_counter() - start
        cpu = tree_cpu_s() - cpu
    # Negative when a Spark process that had used CPU ended unreaped during the run (an idle
    # Python worker, typically in a phase without Spark): not measured then.
    spark_cpu = round(cpu, 2) if cpu >= 0 else None
    results[label] = {"rows": rows, "seconds": round(elapsed, 2), "rows_per_s": round(rows / elapsed),
                      "spark_cpu_s": spark_cpu, **sampler.peak}
    log(f"{label}: {rows} rows in {elapsed:.1f} s = {rows / elapsed:,.0f} rows/s; "
        f"Spark CPU {'not measured' if spark_cpu is None else f'{spark_cpu:.2f} s'}; peak RSS {sampler.peak}")
    return value


class StepClock:
    """The seconds since ``start()`` at which an archive run passed each step."""

    def __init__(self) -> None:
        self.steps: dict[str, float] = {}
        self.started = time.perf_counter()

    def start(self) -> None:
        self.started = time.perf_counter()

    def __call__(self, name: str) -> None:
        self.steps[name] = round(time.perf_counter() - self.started, 2)


def keep_best(figures: dict[str, Any], trial: dict[str, Any]) -> None:
    """Keep each label's fastest run in ``figures``, counting the runs."""
    for label, run in trial.items():
        best = figures.get(label)
        if best is None or run["seconds"] < best["seconds"]:
            figures[label] = {**run, "runs": (best or {}).get("runs", 0) + 1}
        else:
            best["runs"] += 1


def jdbc_source(kind: str, store: Any, url: str) -> tuple[str, dict[str, str], str]:
    """Spark's JDBC URL, properties and the SELECT list giving the source's columns and types."""
    if kind == "postgresql":
        return ("jdbc:postgresql://127.0.0.1:5432/test", {"user": "postgres", "driver": "org.postgresql.Driver",
                                                          "fetchsize": "5000"},
                "id, message_id, topic, aggregate_type, aggregate_id, partition_key, payload::text AS payload, "
                "headers::text AS headers, trace_id, status::int AS status, attempts, claimed_at, next_retry_at, "
                "created_at, processed_at, last_error")
    plain = ("id, message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers, trace_id, "
             "status, attempts, claimed_at, next_retry_at, created_at, processed_at, last_error")
    if kind == "mysql":
        # jdbc:mysql: so that Spark picks its MySQL dialect (backquoted names); Connector/J 2.x accepts it.
        return ("jdbc:mysql://127.0.0.1:3306/test", {"user": "root", "driver": "org.mariadb.jdbc.Driver",
                                                       "fetchsize": "5000"}, plain)
    from outbox.storage.engines.sqlite import sqlite_path
    return (f"jdbc:sqlite:{sqlite_path(url)}", {"driver": "org.sqlite.JDBC", "fetchsize": "5000"}, plain)


def bench_engine(spark: Any, kind: str, url: str, args: Any, work: Path, results: dict[str, Any],
                 full: bool) -> None:
    """Read (outbox source vs JDBC) on ``kind``; with ``full``, archive and replay too."""
    from pyspark.sql import functions as F

    from outbox.pipeline.archive import Archiver
    from outbox.pipeline.replay import run_replay
    from outbox.storage.store import OutboxStore

    tag = uuid.uuid4().hex[:8]
    stores = {name: OutboxStore(url, table=f"outbox_bp_{name}_{tag}")
              for name in ("src", "arch", "replay", "insert", "warm", "warmreplay")}
    figures: dict[str, Any] = {}
    results[kind] = figures
    try:
        for store in stores.values():
            store.migrate()
        src = stores["src"]

        def empty(store: Any) -> None:
            with store.transaction() as c:
                store.engine.execute(c, f"{'DELETE FROM' if kind == 'sqlite' else 'TRUNCATE TABLE'} "
                                     f"{store.engine.table}")

        def settle(store: Any) -> None:
            if kind == "postgresql":  # set the hint bits now, or the first reader pays for them
                conn = store.engine.connect(url)
                conn.autocommit = True
                conn.execute(f"VACUUM ANALYZE {store.engine.table}")
                conn.close()

        log(f"{kind}: filling {src.engine.table} with {args.rows} rows")
        fill(src, args.rows, args.ids)
        settle(src)
        with src.transaction() as c:
            lo, hi = src.engine.execute(c, f"SELECT MIN(id), MAX(id) FROM {src.engine.table}").fetchone()

        def source_path(last: int = int(hi), out: str = "read", reader: str = "arrow", source_url: str = url) -> None:
            (spark.read.format("outbox").options(url=source_url, table=src.engine.table_name, statuses="2",
                                                  reader=reader,
                                                  partitions=str(args.partitions), max_id=str(last),
                                                  **({"fetch_size": str(args.fetch_size)} if args.fetch_size else {}),
                                                  **({"page_bytes": str(args.page_bytes)} if args.page_bytes else {}))
             .load()
             .write.mode("overwrite").parquet(str(work / f"{kind}-{out}")))

        def jdbc_path(last: int = int(hi), out: str = "jdbc") -> None:
            jdbc_url, props, columns = jdbc_source(kind, src, url)
            frame = spark.read.jdbc(jdbc_url, f"(SELECT {columns} FROM {src.engine.table_name} "
                                    f"WHERE status = 2 AND id <= {last}) q", column="id", lowerBound=int(lo),
                                    upperBound=last + 1, numPartitions=args.partitions, properties=props)
            for name in ("claimed_at", "next_retry_at", "created_at", "processed_at"):  # SQLite: text -> timestamp
                frame = frame.withColumn(name, F.col(name).cast("timestamp"))
            frame.write.mode("overwrite").parquet(str(work / f"{kind}-{out}"))

        # The paths compared with the source's read: Spark's JDBC reader, or on SQL Server
        # (no JDBC driver here) the driver path through pyodbc; the read itself there is
        # mssql-python's Arrow fetch.
        read_url = url
        if kind == "mssql":
            from outbox.storage.engines.mssql.driver import mssql_python_url

            read_url, baseline = mssql_python_url(url), f"{kind} pyodbc"
            paths: dict[str, Any] = {
                f"{kind} read": lambda: source_path(source_url=read_url),
                baseline: lambda: source_path(out="pyodbc", reader="driver"),
                f"{kind} mssql-python rows": lambda: source_path(out="rows", reader="driver", source_url=read_url)}
        else:
            baseline = f"{kind} jdbc"
            paths = {f"{kind} read": source_path, baseline: jdbc_path}
            if kind == "postgresql":
                paths[f"{kind} driver"] = lambda: source_path(out="driver", reader="driver")
        # Warm every path up (JIT, Python workers, the driver jar) on a few thousand rows first.
        source_path(int(lo) + 5000, "warm-read", source_url=read_url)
        if kind == "mssql":
            source_path(int(lo) + 5000, "warm-pyodbc", reader="driver")
        else:
            jdbc_path(int(lo) + 5000, "warm-jdbc")
        # Alternate the paths --repeat times and keep each one's best run: the machine is
        # shared, and a neighbour's burst should not decide a ratio.
        for _ in range(args.repeat):
            for label, path in paths.items():
                trial: dict[str, Any] = {}
                timed(label, args.rows, path, trial)
                keep_best(figures, trial)
        ratio = "read_vs_pyodbc" if kind == "mssql" else "read_vs_jdbc"
        figures[ratio] = round(figures[f"{kind} read"]["rows_per_s"] / figures[baseline]["rows_per_s"], 2)
        if not full:
            return
        # Warm the archive and replay up too (their queries' first run in the JVM), as the reads were.
        fill(stores["warm"], 5000, args.ids)
        warm_archive = str(work / f"{kind}-warm-archive")
        split = {"split": args.split}
        Archiver(spark, stores["warm"], warm_archive, partitions=args.partitions, source_options=split,
                 writer=args.writer).run(timedelta(days=1))
        run_replay(spark, archive=warm_archive, target=stores["warmreplay"], batch=1000, partitions=args.partitions)
        # The archive alternates with the read --repeat times too, each run on a table
        # freshly filled with the same rows (it deletes what it archived) and read once
        # (unless --cold-archive), and keeps its best run, as the reads do.
        for n in range(args.repeat):
            trial = {}
            timed(f"{kind} read", args.rows, source_path, trial)
            empty(stores["arch"])
            fill(stores["arch"], args.rows, args.ids)
            settle(stores["arch"])
            if not args.cold_archive:  # read once, untimed: the table as warm as src is for its best read
                (spark.read.format("outbox").options(url=url, table=stores["arch"].engine.table_name, statuses="2",
                                                     partitions=str(args.partitions)).load()
                 .write.mode("overwrite").parquet(str(work / f"{kind}-warm-arch")))
            clock = StepClock()
            archiver = Archiver(spark, stores["arch"], str(work / f"{kind}-archive-{n}"), partitions=args.partitions,
                                delete_chunk=5000, delete_connections=args.delete_connections, on_step=clock,
                                source_options=split, writer=args.writer)
            clock.start()
            timed(f"{kind} archive", args.rows, lambda: archiver.run(timedelta(days=1)), trial)  # noqa: B023
            trial[f"{kind} archive"]["steps_s"] = {**clock.steps, "end": trial[f"{kind} archive"]["seconds"]}
            log(f"{kind} archive: seconds at each step {trial[f'{kind} archive']['steps_s']}")
            keep_best(figures, trial)
        archive = str(work / f"{kind}-archive-0")
        import pyarrow.parquet as pq
        table = pq.read_table(str(work / f"{kind}-read"), columns=[
            "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key", "payload", "headers", "trace_id"])
        rows = list(zip(*(table.column(i).to_pylist() for i in range(table.num_columns))))
        target = stores["insert"]
        engine = target.engine

        def bulk_insert() -> None:
            conn = target.connection()
            sql = engine.sql(f"INSERT INTO {engine.table} (message_id, topic, aggregate_type, aggregate_id, "
                             f"partition_key, payload, headers, trace_id, created_at) "
                             f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, {engine.now})")
            for start in range(0, len(rows), 1000):
                cursor = conn.cursor()
                cursor.executemany(sql, rows[start:start + 1000])
                cursor.close()
                conn.commit()

        # Replay and the plain INSERT alternate --repeat times, each into an empty table,
        # and each keeps its best run (as the reads do: a neighbour's burst should not
        # decide the ratio).
        for n in range(args.repeat):
            trial: dict[str, Any] = {}
            timed(f"{kind} replay", args.rows, lambda: run_replay(spark, archive=archive, target=stores["replay"],
                                                                  batch=1000, partitions=args.partitions), trial)
            timed(f"{kind} insert", len(rows), bulk_insert, trial)
            keep_best(figures, trial)
            if n + 1 < args.repeat:
                empty(stores["replay"])
                empty(target)
        figures["archive_vs_read"] = round(figures[f"{kind} archive"]["rows_per_s"]
                                           / figures[f"{kind} read"]["rows_per_s"], 2)
        # The same question inside the best archive run: its own read (stage) against the whole run.
        best_steps = figures[f"{kind} archive"]["steps_s"]
        figures["archive_stage_share"] = round(best_steps["staged"] / best_steps["end"], 2)
        figures["replay_vs_insert"] = round(figures[f"{kind} replay"]["rows_per_s"]
                                            / figures[f"{kind} insert"]["rows_per_s"], 2)
    finally:
        for store in stores.values():
            try:
                with store.transaction() as c:  # the holders table too: store.migrate made it
                    store.engine.execute(c, f"DROP TABLE IF EXISTS {store.engine.table}")
                    store.engine.execute(c, f"DROP TABLE IF EXISTS {store.engine.holders}")
            finally:
                store.close()


def main(argv: list[str] | None = None) -> None:
    from outbox.pipeline.common import DELETE_CONNECTIONS

    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--split", choices=("id", "topic"), default="id",
                   help="what each task of the archive's stage reads (outbox pipeline archive --split)")
    p.add_argument("--writer", choices=("auto", "arrow", "spark"), default="auto",
                   help="who writes the archive's Parquet files (outbox pipeline archive --writer)")
    p.add_argument("--ids", choices=tuple(MESSAGE_IDS["sqlite"]), default="ordered",
                   help="the filled rows' message ids: ordered, as enqueue's default makes them, or random")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--delete-connections", type=int, default=DELETE_CONNECTIONS,
                   help=f"the archive's --delete-connections (the CLI's default: {DELETE_CONNECTIONS})")
    p.add_argument("--engines", default="postgresql,mysql,sqlite", help="comma-separated")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each read path, and of replay and insert, alternating; the best is kept")
    p.add_argument("--fetch-size", type=int, default=None,
                   help="the outbox source's rows per page at most (default: the source's own)")
    p.add_argument("--page-bytes", type=int, default=None,
                   help="the outbox source's bytes per page after the first (default: the source's own)")
    p.add_argument("--full", default="postgresql,mysql",
                   help="engines that also run archive, replay and the bulk INSERT (comma-separated)")
    p.add_argument("--cold-archive", action="store_true",
                   help="run each archive on its freshly filled table without reading it once first")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for kind in engines:
        if kind == "mssql":
            if not MSSQL_URL:
                raise SystemExit("bench: --engines mssql reads OUTBOX_BENCH_MSSQL_URL (a mssql+pyodbc:// URL)")
            continue
        if kind not in JARS:
            raise SystemExit(f"bench: unknown engine {kind!r} (postgresql, mysql, sqlite, mssql)")
        if not Path(JARS[kind]).exists():
            raise SystemExit(f"bench: no JDBC driver at {JARS[kind]} (apt-get install libpostgresql-jdbc-java "
                             "libmariadb-java libxerial-sqlite-jdbc-java)")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from outbox.pipeline.session import spark_session

    (SparkSession.builder.master(args.master).appName("outbox-bench")
     .config("spark.jars", ",".join(JARS[k] for k in engines if k in JARS))
     .config("spark.driver.extraJavaOptions", f"-Djava.library.path={JNI_DIR}")
     .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
     .config("spark.driver.memory", "2g")
     .config("spark.sql.shuffle.partitions", str(args.partitions)).getOrCreate())
    spark = spark_session()
    work = Path(tempfile.mkdtemp(prefix="outbox-bench-pipeline-"))
    results: dict[str, Any] = {"rows": args.rows, "partitions": args.partitions, "master": args.master,
                               "repeat": args.repeat, "writer": args.writer, "fetch_size": args.fetch_size,
                               "page_bytes": args.page_bytes}
    urls = {"postgresql": POSTGRES_URL, "mysql": MYSQL_URL, "sqlite": f"sqlite:///{work / 'bench.db'}",
            "mssql": MSSQL_URL}
    full = {e.strip() for e in args.full.split(",")}
    try:
        for kind in engines:
            bench_engine(spark, kind, urls[kind], args, work, results, kind in full)
        for kind in engines:
            figures = results[kind]
            log(f"{kind}: " + ", ".join(f"{k} = {v}" for k, v in figures.items() if not isinstance(v, dict))
                + " (targets: read/jdbc >= 1.0, archive/read >= 0.8, replay/insert >= 1.0; SQL Server: "
                  "read/pyodbc, no target)")
        print(json.dumps(results, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
