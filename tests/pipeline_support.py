"""Shared by the pipeline tests (tests/test_pipeline_*.py): the one Spark session of
the test run and the seeding helpers. Holds no tests itself.

The Spark session is session-scoped and local[2] with one shuffle partition, no
UI and a JVM tuned for short jobs (C1 compiler only, serial GC: the suite's jobs
last seconds, so full JIT compilation never pays back); a pytest plugin (registered
in tests/conftest.py), so every pipeline test module finds the fixture by name, and
``getOrCreate`` hands all of them the same session. The cases that start processes of their own (a cluster, ``spark-submit``,
a killed CLI run) are marked ``slow``: ``pytest -m "not slow"`` leaves them out of a
quick local run, and ``make test`` (CI) runs them all.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outbox import enqueue
from outbox.storage.store import OutboxStore

REQUIRE = bool(os.environ.get("OUTBOX_REQUIRE_SERVICES"))
DAY_MS = 86_400_000

#: The test JVM's options: tiered compilation stopped at C1 and the serial collector,
#: which start and finish the suite's many small jobs with less CPU than the defaults.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

def spark_process_env(tmp_path: Path) -> dict[str, str]:
    """The environment for Spark processes a test starts (a CLI run, ``spark-submit``,
    a standalone master and worker): loopback, this interpreter for the Python
    workers, and a ``SPARK_CONF_DIR`` giving the drivers and executors the suite's JVM
    options and no UI (``SPARK_DAEMON_JAVA_OPTS`` the same to a master and worker)."""
    conf = tmp_path / "spark-conf"
    conf.mkdir(exist_ok=True)
    (conf / "spark-defaults.conf").write_text(
        f"spark.driver.extraJavaOptions {JVM_OPTIONS}\n"
        f"spark.executor.extraJavaOptions {JVM_OPTIONS}\n"
        "spark.ui.enabled false\n"
        "spark.ui.showConsoleProgress false\n")
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
            "SPARK_CONF_DIR": str(conf), "SPARK_DAEMON_JAVA_OPTS": JVM_OPTIONS}


#: The engines the pipeline tests run on (SQL Server joins when OUTBOX_TEST_MSSQL_URL is set).
PIPELINE_ENGINES = ["sqlite", "postgresql", "mysql", "mssql"]


def _unavailable(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason + " and OUTBOX_REQUIRE_SERVICES is set")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        _unavailable(f"PySpark is not installed ({exc}): pip install -e '.[spark]'")
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        _unavailable("no Java runtime (java not on PATH, JAVA_HOME unset)")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from outbox.pipeline.session import spark_session
    active = SparkSession.getActiveSession()
    if active is None:
        (SparkSession.builder.master("local[2]").appName("outbox-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "1")
         .config("spark.default.parallelism", "2")
         .config("spark.driver.memory", "768m")
         .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
         .getOrCreate())
    session = spark_session()  # the jobs' settings on the test session
    yield session


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
