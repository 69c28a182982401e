"""Spark processes of their own. Scale-out proof: ``outbox pipeline archive --master
spark://...`` against a real standalone Spark cluster started from the PySpark
installation itself (a master and one worker on 127.0.0.1). The driver is a separate
``outbox`` process; the executor is a JVM the worker launches, with its own Python
workers, so the job cannot lean on driver-local state: the executors read the
database and write the Parquet files. That process is SIGKILLed right after its
commit, the crash a real deployment can meet, and the next run finishes its job. And
the job under ``spark-submit`` with the package shipped as a wheel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from engine_support import drop_table
from pipeline_support import DAY_MS, mixed_rows, seed, spark_process_env, spark_submit_conf, table_ids
from services import POSTGRES_URL, ROOT, building_the_package, free_port, require

from outbox.pipeline.archive import Archiver, read_archive
from outbox.storage.store import OutboxStore

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # JVMs of their own; CI runs them


def _spark_home() -> Path:
    import pyspark
    return Path(pyspark.__file__).parent


@pytest.fixture
def cluster(tmp_path: Path, spark_jvm_options: str) -> Iterator[str]:
    """A standalone master and one worker (1 core, 1 GB); yields the master URL."""
    spark_class = _spark_home() / "bin" / "spark-class"
    if not spark_class.exists():
        pytest.skip(f"this PySpark installation has no {spark_class}")
    env = {**spark_process_env(spark_jvm_options), "SPARK_HOME": str(_spark_home())}
    port, ui, worker_ui = free_port(), free_port(), free_port()
    logs = tmp_path / "cluster-logs"
    logs.mkdir()
    procs = [subprocess.Popen([str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env, start_new_session=True,
                              stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT)]

    def alive_workers() -> int | None:
        """The master's count of live workers; None while it does not answer yet (or answers,
        starting up, with an empty page: json's ValueError)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as response:
                return int(json.load(response).get("aliveworkers", 0))
        except (OSError, ValueError):
            return None

    def wait_for(ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.skip("the standalone Spark cluster did not start: "
                            + "".join((logs / f"{n}.log").read_text()[-500:] for n in ("master", "worker")
                                      if (logs / f"{n}.log").exists()))
            time.sleep(0.2)

    try:
        master = f"spark://127.0.0.1:{port}"
        # The worker only once the master answers: a worker that finds no master retries
        # its registration after 5-15 s (Spark's fixed, fuzzed interval), not sooner.
        wait_for(lambda: alive_workers() is not None)
        procs.append(subprocess.Popen([str(spark_class), "org.apache.spark.deploy.worker.Worker", "--host",
                                       "127.0.0.1", "--cores", "1", "--memory", "1G", "--webui-port", str(worker_ui),
                                       "--work-dir", str(tmp_path / "work"), master], env=env,
                                      start_new_session=True, stdout=open(logs / "worker.log", "w"),
                                      stderr=subprocess.STDOUT))
        wait_for(lambda: (alive_workers() or 0) >= 1)
        yield master
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def test_archive_on_a_standalone_cluster_killed_after_commit(spark: Any, spark_jvm_options: str, cluster: str,
                                                             tmp_path: Path) -> None:
    """A real ``outbox pipeline archive --master spark://...`` process whose tasks run
    in the worker's executor, killed with SIGKILL right after its commit (its Spark
    JVM dies with it, the cluster ends its executor); the next run finishes the job."""
    require("PostgreSQL", "127.0.0.1", 5432)
    store = OutboxStore(POSTGRES_URL, table=f"outbox_c{uuid.uuid4().hex[:10]}")
    store.migrate()
    try:
        rows = mixed_rows()
        ids = seed(store, rows)
        old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
        root = tmp_path / "archive"
        env = {**spark_process_env(spark_jvm_options), "OUTBOX_DATABASE_URL": POSTGRES_URL,
               "OUTBOX_TABLE": store.engine.table_name, "OUTBOX_PIPELINE_CRASH_AT": "committed"}
        proc = subprocess.run([sys.executable, "-m", "outbox.cli", "pipeline", "archive", "--older-than", "7d",
                               "--to", str(root), "--master", cluster, "--partitions", "3", "--json"],
                              env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        # the tasks ran in the worker's executor, not in the driver
        executor_logs = list((tmp_path / "work").rglob("stderr"))
        assert executor_logs, "the worker launched no executor"
        # killed before the delete: everything still there, the run committed with every old done row
        assert table_ids(store) == set(ids)
        manifests = list((root / "_manifest").glob("*.json"))
        assert len(manifests) == 1 and not list((root / "_manifest").glob("*.deleted"))
        committed = json.loads(manifests[0].read_text())
        assert committed["rows"] == len(old_done) and committed["id_ranges"] == [[min(old_done), max(old_done)]]

        result = Archiver(spark, store, str(root)).run(timedelta(days=7))
        assert len(result.recovered) == 1 and result.archived == 0
        assert Counter(r["id"] for r in read_archive(spark, str(root)).select("id").collect()) == \
            Counter(dict.fromkeys(old_done, 1))
        assert Counter(r["id"] for r in spark.read.parquet(str(root)).select("id").collect()) == \
            Counter(dict.fromkeys(old_done, 1))
        assert table_ids(store) == set(ids) - old_done
    finally:
        drop_table(store)
        store.close()


def test_archive_under_spark_submit(spark: Any, spark_jvm_options: str, tmp_path: Path) -> None:
    """``spark-submit`` with the package as a wheel in ``--py-files`` and the entry
    script ``outbox/pipeline/submit.py``: the command docs/pipeline.md gives."""
    from outbox.pipeline import submit

    wheels = tmp_path / "dist"
    with building_the_package():
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                               capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.skip(f"cannot build the wheel here: {built.stderr.strip()[-300:]}")
    wheel = next(wheels.glob("outbox_relay-*.whl"))
    store = OutboxStore(f"sqlite:///{tmp_path / 'outbox.db'}", table="outbox")
    store.migrate()
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    env = {**spark_process_env(spark_jvm_options), "OUTBOX_DATABASE_URL": store.url}
    proc = subprocess.run([str(_spark_home() / "bin" / "spark-submit"), "--master", "local[1]",
                           *spark_submit_conf(spark_jvm_options),
                           "--py-files", str(wheel), submit.__file__,
                           "archive", "--older-than", "7d", "--to", str(tmp_path / "archive"), "--json"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["archived"] == summary["deleted"] == len(old_done)
    assert table_ids(store) == set(ids) - old_done
    store.close()
