"""Shared by the pipeline tests (tests/test_pipeline_*.py): the one Spark session of
the test run and the seeding helpers. Holds no tests itself.

The Spark session is session-scoped and local[2] with one shuffle partition, no
UI and a JVM tuned for short jobs (C1 compiler only, serial GC: the suite's jobs
last seconds, so full JIT compilation never pays back); a pytest plugin (registered
in tests/conftest.py), so every pipeline test module finds the fixture by name, and
``getOrCreate`` hands all of them the same session. The cases that start processes of their own (a cluster, ``spark-submit``,
a killed CLI run) are marked ``slow``: ``pytest -m "not slow"`` leaves them out of a
quick local run, and ``make test`` (CI) runs them all.

Every Spark JVM of the suite (the session, and the drivers, executors, master and
worker the slow cases start) runs Spark's one class path, so all of them can start
from one class-data sharing archive (JDK 17's dynamic AppCDS: the classes a Spark JVM
loads, parsed and verified once, then mapped into each JVM): see ``spark_jvm_options``.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from services import unavailable

from outbox import enqueue
from outbox.storage.store import OutboxStore

DAY_MS = 86_400_000

#: The test JVM's options: tiered compilation stopped at C1 and the serial collector,
#: which start and finish the suite's many small jobs with less CPU than the defaults.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

#: JDK unified logging off for CDS: a JVM that cannot use the archive (another JDK, another
#: class path) would say so on stdout, where the CLI's JSON goes.
CDS_QUIET = "-Xlog:cds*=off -Xlog:class+path=off"


def cds_archive(config: pytest.Config) -> Path | None:
    """Where this Java and PySpark installation's class-data sharing archive lives (it
    may not exist yet): in OUTBOX_TEST_SPARK_CDS_DIR when set (``.ci/run`` keeps it
    outside the clone, so the next CI run on the machine starts from it), else in pytest's
    cache, ``.pytest_cache/d/spark-cds/``. None when the cache is off (``-p
    no:cacheprovider``, and no directory given), when OUTBOX_TEST_SPARK_CDS is ``0``, or
    without PySpark or Java (the ``spark`` fixture then skips on its own)."""
    cache = getattr(config, "cache", None)
    given = os.environ.get("OUTBOX_TEST_SPARK_CDS_DIR")
    if (cache is None and not given) or os.environ.get("OUTBOX_TEST_SPARK_CDS", "1") == "0":
        return None
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else None
    java = java if java is not None and java.exists() else Path(shutil.which("java") or "/nonexistent")
    try:
        import pyspark
        java = java.resolve(strict=True)
        jars = Path(pyspark.__file__).parent / "jars"
        key = "|".join([str(java), str(java.stat().st_mtime_ns), pyspark.__version__, str(jars),
                        str(jars.stat().st_mtime_ns), JVM_OPTIONS])
        if given:
            directory = Path(given)
            directory.mkdir(parents=True, exist_ok=True)
        else:
            directory = Path(cache.mkdir("spark-cds"))
    except (ImportError, OSError):  # no PySpark, no Java, a cache it cannot write to
        return None
    return directory / f"spark-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


@pytest.fixture(scope="session")
def spark_jvm_options(request: pytest.FixtureRequest) -> str:
    """``JVM_OPTIONS`` for every Spark JVM of the run, with the class-data sharing
    archive when one exists (a JVM whose JDK or class path does not match it starts
    without, as if it were not there). The run that finds none has its session's JVM
    write it on exit (the ``spark`` fixture's teardown: 10-20 s, once); Spark JVMs
    start and run their first jobs faster from it (figures: docs/pipeline.md, "Tests")."""
    archive = cds_archive(request.config)
    if archive is None or not archive.is_file():
        return JVM_OPTIONS
    return f"{JVM_OPTIONS} -XX:SharedArchiveFile={archive} {CDS_QUIET}"


def spark_conf(jvm_options: str) -> dict[str, str]:
    """The Spark settings of the processes a test starts: the JVM options for drivers
    and executors, no UI, no progress bar."""
    return {"spark.driver.extraJavaOptions": jvm_options, "spark.executor.extraJavaOptions": jvm_options,
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}


def spark_submit_conf(jvm_options: str) -> list[str]:
    """``spark_conf`` as ``spark-submit`` arguments."""
    return [arg for key, value in spark_conf(jvm_options).items() for arg in ("--conf", f"{key}={value}")]


def spark_process_env(jvm_options: str) -> dict[str, str]:
    """The environment for Spark processes a test starts (a CLI run, ``spark-submit``,
    a standalone master and worker): loopback, this interpreter for the Python
    workers, ``spark_conf`` for a PySpark driver (``PYSPARK_SUBMIT_ARGS``; a
    ``spark-submit`` gets ``spark_submit_conf`` on its command line) and the JVM
    options for a master and worker (``SPARK_DAEMON_JAVA_OPTS``). No ``SPARK_CONF_DIR``:
    a directory of a test's own on the class path would keep the JVMs from the
    class-data sharing archive, which is valid for one class path only."""
    submit_args = " ".join(shlex.quote(arg) for arg in spark_submit_conf(jvm_options))
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_SUBMIT_ARGS": f"{submit_args} pyspark-shell", "SPARK_DAEMON_JAVA_OPTS": jvm_options}


#: The engines the pipeline tests run on (SQL Server joins when OUTBOX_TEST_MSSQL_URL is set).
PIPELINE_ENGINES = ["sqlite", "postgresql", "mysql", "mssql"]


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest, spark_jvm_options: str) -> Iterator[Any]:
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        unavailable(f"PySpark is not installed ({exc}): pip install -e '.[spark]'")
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        unavailable("no Java runtime (java not on PATH, JAVA_HOME unset)")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from outbox.pipeline.session import spark_session
    archive = cds_archive(request.config)
    dump = None  # no archive yet: this session's JVM writes it when it exits
    if archive is not None and spark_jvm_options == JVM_OPTIONS:
        dump = archive.with_name(f"{archive.stem}.{os.getpid()}.tmp")
    active = SparkSession.getActiveSession()
    if active is None:
        options = spark_jvm_options if dump is None else f"{JVM_OPTIONS} -XX:ArchiveClassesAtExit={dump} {CDS_QUIET}"
        (SparkSession.builder.master("local[2]").appName("outbox-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "1")
         .config("spark.default.parallelism", "2")
         .config("spark.driver.memory", "768m")
         .config("spark.driver.extraJavaOptions", options)
         .getOrCreate())
    else:
        dump = None  # not this fixture's JVM
    session = spark_session()  # the jobs' settings on the test session
    yield session
    if archive is not None and dump is not None:
        _write_cds_archive(SparkContext, session, dump, archive)


def _write_cds_archive(context: Any, session: Any, dump: Path, archive: Path) -> None:
    """End the session's JVM the way it ends at exit (its stdin closed), so that it
    writes its classes to ``dump`` now, while pytest waits, and move that into place."""
    gateway = context._gateway
    proc = getattr(gateway, "proc", None)
    session.stop()
    if proc is None or proc.stdin is None:
        return
    proc.stdin.close()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    context._gateway = context._jvm = None
    if dump.is_file() and dump.stat().st_size > 0:
        os.replace(dump, archive)
        for stale in archive.parent.glob("spark-*.jsa"):  # one archive kept (about 200 MB each)
            if stale != archive:
                stale.unlink(missing_ok=True)
    else:
        dump.unlink(missing_ok=True)


@dataclass(frozen=True)
class Row:
    """One seeded outbox row: its state and times relative to the database clock."""

    topic: str
    aggregate_id: str
    status: int = 2
    age_ms: int = 10 * DAY_MS          # created this long ago
    latency_ms: int | None = 1500      # processed this long after creation (None: not processed)
    attempts: int = 0
    last_error: str | None = None
    aggregate_type: str = "order"


def seed(store: OutboxStore, rows: Sequence[Row], *, start: int = 0) -> list[int]:
    """Enqueue ``rows`` through the public write side, then set each one's status and
    times with the engine's own clock arithmetic (so it works on every engine)."""
    engine = store.engine
    ids: list[int] = []
    with store.transaction() as cursor:
        engine.begin(cursor)
        conn = cursor.connection
        for n, row in enumerate(rows, start=start):
            ids.append(enqueue(conn, topic=row.topic, aggregate_type=row.aggregate_type,
                               aggregate_id=row.aggregate_id, payload={"n": n, "aggregate": row.aggregate_id},
                               headers={"x-seq": n}, table=engine.table_name, schema=engine.schema))
    with store.transaction() as cursor:
        for id_, row in zip(ids, rows):
            if row.latency_ms is None:
                engine.execute(cursor, f"UPDATE {engine.table} SET status = ?, attempts = ?, last_error = ?, "
                               f"created_at = {engine.now_plus_ms()} WHERE id = ?",
                               [row.status, row.attempts, row.last_error, -row.age_ms, id_])
            else:
                engine.execute(cursor, f"UPDATE {engine.table} SET status = ?, attempts = ?, last_error = ?, "
                               f"created_at = {engine.now_plus_ms()}, processed_at = {engine.now_plus_ms()} "
                               "WHERE id = ?",
                               [row.status, row.attempts, row.last_error, -row.age_ms,
                                -(row.age_ms - row.latency_ms), id_])
    return ids


def table_ids(store: OutboxStore) -> set[int]:
    with store.transaction() as cursor:
        return {int(r[0]) for r in store.engine.execute(cursor, f"SELECT id FROM {store.engine.table}").fetchall()}


def table_rows(store: OutboxStore) -> dict[int, dict[str, Any]]:
    """Every row of the table, by id, with the columns the archive keeps."""
    engine = store.engine
    cols = ["id", "message_id", "topic", "aggregate_type", "aggregate_id", "status", "attempts", "last_error",
            "created_at", "processed_at", engine.payload_column()]
    with store.transaction() as cursor:
        rows = engine.execute(cursor, f"SELECT {', '.join(cols)} FROM {engine.table}").fetchall()
    out = {}
    for r in rows:
        payload = r[10]
        if isinstance(payload, bytes):
            payload = payload.decode()
        out[int(r[0])] = {"message_id": r[1], "topic": r[2], "aggregate_type": r[3], "aggregate_id": r[4],
                          "status": int(r[5]), "attempts": int(r[6]), "last_error": r[7],
                          "created_at": engine.to_datetime(r[8]), "processed_at": engine.to_datetime(r[9]),
                          "payload": payload}
    return out


def mixed_rows() -> list[Row]:
    """Old done rows on two topics and three days, a recent done row, old dead and
    pending rows: what an outbox looks like after a while."""
    rows = []
    for i in range(12):
        rows.append(Row("orders.created", f"o{i % 4}", age_ms=(8 + i % 3) * DAY_MS + i * 1000,
                        latency_ms=100 * (i + 1), attempts=i % 3))
    for i in range(6):
        rows.append(Row("payments.settled", f"p{i % 2}", age_ms=9 * DAY_MS + i * 1000, latency_ms=2000 + i * 10))
    rows.append(Row("orders.created", "o9", age_ms=DAY_MS // 2, latency_ms=50))        # done, recent
    rows.append(Row("orders.created", "o8", status=4, age_ms=9 * DAY_MS, latency_ms=900, attempts=3,
                    last_error="broker said no"))                                     # dead, old
    rows.append(Row("payments.settled", "p7", status=4, age_ms=8 * DAY_MS, latency_ms=300, attempts=1,
                    last_error="poison: payload rejected"))                            # dead, old
    rows.append(Row("orders.created", "o7", status=0, age_ms=9 * DAY_MS, latency_ms=None))  # pending, old
    return rows


def invoke(args: list[str], env: dict[str, str]) -> Any:
    """Run the ``outbox`` command in-process (on the suite's Spark session) with ``env``."""
    from click.testing import CliRunner

    from outbox.cli import main
    from outbox.core.config import reset_settings

    reset_settings()
    try:
        return CliRunner().invoke(main, args, env=env)
    finally:
        reset_settings()


def archives_of_two_outboxes(spark: Any, tmp_path: Path) -> list[Path]:
    """Two SQLite outboxes' archives, ``tmp_path``/orders and /billing, each of one run of one
    done event: both at id 1 (``merge_runs`` puts them together)."""
    from datetime import timedelta

    from outbox.pipeline.archive import Archiver

    roots = [tmp_path / "orders", tmp_path / "billing"]
    stores = [OutboxStore(f"sqlite:///{tmp_path / f'{name}.db'}") for name in ("orders", "billing")]
    try:
        for store, root in zip(stores, roots):
            store.migrate()
            seed(store, [Row("t.created", "x", age_ms=9 * DAY_MS)])
            Archiver(spark, store, str(root)).run(timedelta(days=7))
    finally:
        for store in stores:
            store.close()
    return roots


@pytest.fixture(scope="session")
def two_outboxes_archives(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """``archives_of_two_outboxes`` once for the run, for the cases that only read them or
    put a copy of them together (``merged_archive``)."""
    return archives_of_two_outboxes(spark, tmp_path_factory.mktemp("two-outboxes"))


def merged_archive(roots: list[Path], tmp_path: Path) -> Path:
    """A copy of the first archive of ``roots``, in ``tmp_path``, with the second's runs put
    into it (``merge_runs``): two outboxes' runs in one archive."""
    merged = tmp_path / "merged"
    shutil.copytree(roots[0], merged)
    merge_runs(roots[1], merged)
    return merged


def merge_runs(source: Path, target: Path) -> None:
    """``source`` archive's runs (manifests and files) copied into the ``target`` archive, as
    two outboxes' runs put together by hand."""
    for item in source.iterdir():
        if item.name.startswith("_manifest"):
            for manifest in item.iterdir():
                shutil.copy(manifest, target / "_manifest" / manifest.name)
        elif not item.name.startswith("_"):
            shutil.copytree(item, target / item.name, dirs_exist_ok=True)
