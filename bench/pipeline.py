"""``python -m bench.pipeline``: the Spark pipeline's throughput on PostgreSQL.

In one run, on one table of ``--rows`` done rows (default 1,000,000):

1. ``python``  the ``outbox`` Python data source -> Parquet (what the archive's stage does);
2. ``jdbc``    Spark's JDBC reader (the PostgreSQL driver jar from Debian's
               ``libpostgresql-jdbc-java``) -> Parquet, same columns, same partitions;
3. ``archive`` the whole ``Archiver`` run (stage, verify, commit, publish, delete);
4. ``replay``  ``run_replay`` of the archive into an empty table, against
5. ``insert``  a plain bulk INSERT of the same rows (psycopg ``executemany``, 1,000 per
               transaction) into another empty table.

Printed: rows/s of each, the ratios python/jdbc (target >= 0.5) and replay/insert
(target >= 0.5), and the peak RSS of the Spark JVM (driver and, in local mode, the
executor) and of the Python workers, sampled from /proc every 0.2 s. Nothing here
asserts a time.
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

JDBC_JAR = os.environ.get("OUTBOX_BENCH_JDBC_JAR", "/usr/share/java/postgresql.jar")
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak RSS of this process's descendants, split into the JVM and Python workers."""

    def __init__(self) -> None:
        self.peak = {"jvm_mb": 0.0, "python_workers_mb": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
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


def fill(store: Any, rows: int) -> None:
    """``rows`` done rows, created 10 days ago, 1,000 aggregates, 5 topics, ~150-byte payloads."""
    t = store.engine.table
    with store.transaction() as c:
        c.execute(f"""INSERT INTO {t} (message_id, topic, aggregate_type, aggregate_id, payload, headers, status,
                      attempts, created_at, processed_at)
                      SELECT md5(g::text), 'topic.' || (g %% 5), 'order', 'a' || (g %% 1000),
                             jsonb_build_object('n', g, 'pad', repeat('x', 120)), '{{"x-seq": "1"}}'::jsonb, 2, 0,
                             now() - interval '10 days' + g * interval '1 ms',
                             now() - interval '10 days' + g * interval '1 ms' + interval '40 ms'
                      FROM generate_series(1, %s) g""", (rows,))


def timed(label: str, rows: int, work: Any, results: dict[str, Any]) -> Any:
    with RssSampler() as sampler:
        start = time.perf_counter()
        value = work()
        elapsed = time.perf_counter() - start
    results[label] = {"rows": rows, "seconds": round(elapsed, 2), "rows_per_s": round(rows / elapsed),
                      **sampler.peak}
    log(f"{label}: {rows} rows in {elapsed:.1f} s = {rows / elapsed:,.0f} rows/s; peak RSS {sampler.peak}")
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if not Path(JDBC_JAR).exists():
        raise SystemExit(f"bench: no PostgreSQL JDBC driver at {JDBC_JAR} (apt-get install libpostgresql-jdbc-java, "
                         "or set OUTBOX_BENCH_JDBC_JAR)")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from outbox.pipeline.archive import Archiver
    from outbox.pipeline.replay import run_replay
    from outbox.pipeline.session import spark_session
    from outbox.store import OutboxStore

    (SparkSession.builder.master(args.master).appName("outbox-bench").config("spark.jars", JDBC_JAR)
     .config("spark.ui.enabled", "false").config("spark.driver.memory", "2g")
     .config("spark.sql.shuffle.partitions", str(args.partitions)).getOrCreate())
    spark = spark_session()
    tag = uuid.uuid4().hex[:8]
    stores = {name: OutboxStore(POSTGRES_URL, table=f"outbox_bp_{name}_{tag}") for name in ("src", "replay", "insert")}
    work = Path(tempfile.mkdtemp(prefix="outbox-bench-pipeline-"))
    results: dict[str, Any] = {"rows": args.rows, "partitions": args.partitions, "master": args.master}
    try:
        for store in stores.values():
            store.migrate()
        src = stores["src"]
        log(f"filling {src.engine.table} with {args.rows} rows")
        fill(src, args.rows)
        with src.transaction() as c:
            lo, hi = c.execute(f"SELECT MIN(id), MAX(id) FROM {src.engine.table}").fetchone()
        columns = ("id, message_id, topic, aggregate_type, aggregate_id, partition_key, payload::text AS payload, "
                   "headers::text AS headers, trace_id, status::int AS status, attempts, claimed_at, next_retry_at, "
                   "created_at, processed_at, last_error")

        def python_path(last: int = int(hi), out: str = "python") -> None:
            (spark.read.format("outbox").options(url=POSTGRES_URL, table=src.engine.table_name, statuses="2",
                                                  partitions=str(args.partitions), max_id=str(last)).load()
             .write.mode("overwrite").parquet(str(work / out)))

        def jdbc_path(last: int = int(hi), out: str = "jdbc") -> None:
            (spark.read.jdbc("jdbc:postgresql://127.0.0.1:5432/test",
                             f"(SELECT {columns} FROM {src.engine.table} WHERE status = 2 AND id <= {last}) q",
                             column="id", lowerBound=int(lo), upperBound=last + 1, numPartitions=args.partitions,
                             properties={"user": "postgres", "driver": "org.postgresql.Driver", "fetchsize": "5000"})
             .write.mode("overwrite").parquet(str(work / out)))

        # Warm both paths up (JIT, Python workers, the driver jar) on a few thousand rows first.
        python_path(int(lo) + 5000, "warm-python")
        jdbc_path(int(lo) + 5000, "warm-jdbc")
        timed("python", args.rows, python_path, results)
        timed("jdbc", args.rows, jdbc_path, results)
        archive = str(work / "archive")
        timed("archive", args.rows, lambda: Archiver(spark, src, archive, partitions=args.partitions,
                                                     delete_chunk=5000).run(timedelta(days=1)), results)
        timed("replay", args.rows, lambda: run_replay(spark, archive=archive, target=stores["replay"], batch=1000,
                                                      partitions=args.partitions), results)

        import pyarrow.parquet as pq
        table = pq.read_table(str(work / "python"), columns=["message_id", "topic", "aggregate_type", "aggregate_id",
                                                              "partition_key", "payload", "headers", "trace_id"])
        rows = list(zip(*(table.column(i).to_pylist() for i in range(table.num_columns))))
        target = stores["insert"]

        def bulk_insert() -> None:
            conn = target.connection()
            sql = (f"INSERT INTO {target.engine.table} (message_id, topic, aggregate_type, aggregate_id, "
                   "partition_key, payload, headers, trace_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)")
            for start in range(0, len(rows), 1000):
                with conn.cursor() as c:
                    c.executemany(sql, rows[start:start + 1000])
                conn.commit()

        timed("insert", len(rows), bulk_insert, results)
        results["python_vs_jdbc"] = round(results["python"]["rows_per_s"] / results["jdbc"]["rows_per_s"], 2)
        results["replay_vs_insert"] = round(results["replay"]["rows_per_s"] / results["insert"]["rows_per_s"], 2)
        log(f"python/jdbc = {results['python_vs_jdbc']} (target >= 0.5); "
            f"replay/insert = {results['replay_vs_insert']} (target >= 0.5)")
        print(json.dumps(results, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for store in stores.values():
            try:
                with store.transaction() as c:
                    c.execute(f"DROP TABLE IF EXISTS {store.engine.table}")
            finally:
                store.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
