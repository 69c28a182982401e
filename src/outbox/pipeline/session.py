"""The Spark session every job runs in.

``spark_session`` reuses the active session when there is one (``spark-submit``, a
notebook, the test suite's single session) and otherwise builds one for ``master``
(default ``local[*]``). The settings that matter to the jobs are applied either way:
UTC session time (archive dates and report days are UTC days), no partition-type
inference (a topic called ``2024`` stays a string), and few shuffle partitions
(outbox history is modest; ``OUTBOX_SPARK_SHUFFLE_PARTITIONS`` overrides).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..core.checks import valid_spark_master
from ..core.config import pipeline_options
from ..core.errors import install_hint
from .common import PipelineError

log = logging.getLogger("outbox.pipeline.session")

#: Options the jobs rely on, applied to new and existing sessions alike.
JOB_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.sources.partitionColumnTypeInference.enabled": "false",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


def check_master(master: str) -> str:
    """Spark's master URL forms; anything else fails before a JVM is started."""
    if not valid_spark_master(master):
        raise PipelineError(f"--master {master!r} is not a Spark master URL "
                            "(local[*], local[N], spark://host:port, yarn, k8s://https://host:port)")
    return master


def import_pyspark() -> Any:
    try:
        import pyarrow  # noqa: F401  (the Python data source hands rows to the JVM as Arrow)
        import pyspark
    except ImportError as exc:
        raise PipelineError(f"the pipeline needs PySpark 4 and Java 17: {install_hint('spark')} "
                            f"({exc})") from None
    return pyspark


def spark_session(master: str | None = None, app_name: str = "outbox-pipeline") -> Any:
    """The active session, or a new one on ``master`` with the job settings."""
    import_pyspark()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None:
        options = pipeline_options()  # OUTBOX_SPARK_*, validated where they are declared
        master = master or options.master
        if master is not None:
            check_master(master)
        if master is None or master.startswith("local"):
            # A local run binds to loopback (no reverse DNS of the host name).
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        executor_python(master)
        builder = SparkSession.builder.appName(app_name)
        if master:
            builder = builder.master(master)
        builder = (builder.config("spark.ui.enabled", "true" if options.ui else "false")
                   .config("spark.sql.shuffle.partitions", str(options.shuffle_partitions)))
        for key, value in JOB_CONF.items():
            builder = builder.config(key, value)
        try:
            active = builder.getOrCreate()
        except Exception as exc:  # noqa: BLE001 - no Java, a bad master URL
            raise PipelineError(f"cannot start Spark{' on ' + master if master else ''}: "
                                f"{' '.join(str(exc).split())[:300]}") from None
        active.sparkContext.setLogLevel(options.log_level)
    for key, value in JOB_CONF.items():
        active.conf.set(key, value)
    register_source(active)
    return active


def executor_python(master: str | None) -> None:
    """Set which Python the executors start (PySpark reads ``PYSPARK_PYTHON`` as the session
    starts): on a local master this interpreter, where the package is installed; on any other,
    and under ``spark-submit``, what the user and Spark set, with a warning when nothing is set
    for a ``--master`` given (docs/pipeline.md, "Running on a cluster")."""
    if "PYSPARK_PYTHON" in os.environ:
        return
    if master is None:  # local[*], unless spark-submit (which sets the gateway's port) chose the master
        if "PYSPARK_GATEWAY_PORT" not in os.environ:
            os.environ["PYSPARK_PYTHON"] = sys.executable
    elif master.startswith("local"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
    else:
        log.warning("outbox: PYSPARK_PYTHON is not set, so the executors on %s start Spark's default Python "
                    "(python3); set PYSPARK_PYTHON to the workers' interpreter that has the package installed "
                    "(docs/pipeline.md, \"Running on a cluster\")", master)


def register_source(spark: Any) -> None:
    """Make ``spark.read.format("outbox")`` available in this session."""
    from .source import OutboxDataSource
    spark.dataSource.register(OutboxDataSource)
