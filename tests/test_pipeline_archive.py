"""``outbox pipeline archive`` on real databases with the suite's one Spark session:
the round trip, crashes at every step, re-runs, the purge guard and bad arguments.
(A real SIGKILLed archive process: tests/test_pipeline_cluster.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from pipeline_support import (
    DAY_MS,
    PIPELINE_ENGINES,
    Row,
    invoke,
    merged_archive,
    mixed_rows,
    seed,
    table_ids,
    table_rows,
)

import outbox.pipeline.archive as archive_module
from outbox.pipeline.archive import STEPS, Archiver, read_archive
from outbox.pipeline.common import ARCHIVE_SCHEMA_DDL, PipelineError, local_path
from outbox.pipeline.stage import ArrowWriter, ArrowWritten, SparkWritten, file_runs
from outbox.storage.store import OutboxStore

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(params=PIPELINE_ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


class Crash(BaseException):
    """Stands in for a kill -9 at a step: not an Exception, so nothing catches it."""


def crash_at(step: str) -> Any:
    def hook(name: str) -> None:
        if name == step:
            raise Crash(step)
    return hook


def crash_in_its_own_run(step: str) -> Any:
    """``crash_at`` for a run's own steps only, not for the recovery of an earlier run
    it does first (which passes the steps from ``published-one`` on as well)."""
    own: list[str] = []

    def hook(name: str) -> None:
        if name == "staged":
            own.append(name)
        if name == step and own:
            raise Crash(step)
    return hook


def archived_ids(spark: Any, root: Path) -> list[int]:
    return [r["id"] for r in read_archive(spark, str(root)).select("id").collect()]


def plain_parquet_ids(spark: Any, root: Path) -> list[int]:
    """What any Parquet reader sees in the archive tree (no manifest logic at all)."""
    return [r["id"] for r in spark.read.parquet(str(root)).select("id").collect()]


@pytest.mark.parametrize(("kind", "writer"), [*((kind, "arrow") for kind in PIPELINE_ENGINES), ("sqlite", "spark")])
def test_archive_round_trip(spark: Any, store: OutboxStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            writer: str) -> None:
    """The Arrow writer (stage.py: pyarrow in the tasks, the default for a path) on every
    engine, and Spark's writer (the one for other URIs; what it stages does not depend
    on the engine, which only the reader does). Its first run is also the one the cases
    ``the_archive_is_on_disk_before_the_commit_and_before_the_first_delete`` and
    ``the_delete_runs_on_several_connections_where_the_engine_has_concurrent_writers``
    check (one archive run for the three, docs/pipeline.md, "Tests")."""
    rows = mixed_rows()
    ids = seed(store, rows)
    before = table_rows(store)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    old_dead = {i for i, r in zip(ids, rows) if r.status == 4}
    root = tmp_path / "my archive ü%20"  # a plain path, written where it says (not percent-encoded)

    synced, threads = record_fsyncs_and_deletes(monkeypatch), record_delete_threads(monkeypatch, store)
    result = Archiver(spark, store, str(root), delete_chunk=1, delete_connections=3, writer=writer).run(
        timedelta(days=7))
    assert (result.archived, result.deleted, result.kept) == (len(old_done), len(old_done), 0)
    assert table_ids(store) == set(ids) - old_done
    the_archive_is_on_disk_before_the_commit_and_before_the_first_delete(synced, root, result.run_id)
    the_delete_runs_on_several_connections_where_the_engine_has_concurrent_writers(threads, store)
    got = read_archive(spark, str(root)).collect()
    assert sorted(r["id"] for r in got) == sorted(old_done)
    for r in got:  # every archived column as it was in the table
        want = before[r["id"]]
        assert (r["message_id"], r["topic"], r["aggregate_type"], r["aggregate_id"], r["status"], r["attempts"]) == \
            (want["message_id"], want["topic"], want["aggregate_type"], want["aggregate_id"], want["status"],
             want["attempts"])
        assert json.loads(r["payload"]) == json.loads(want["payload"])
        assert abs((r["created_at"].replace(tzinfo=None) - want["created_at"].replace(tzinfo=None))
                   .total_seconds()) < 0.002
        assert r["date"] == want["created_at"].strftime("%Y-%m-%d")
    # hive layout: topic=/date= directories holding Parquet; the manifest marks the run finished
    layout = {(p.parent.parent.name, p.parent.name) for p in root.rglob("*.parquet") if "_staging" not in p.parts}
    assert {t for t, _ in layout} == {"topic=orders.created", "topic=payments.settled"}
    assert all(d.startswith("date=") for _, d in layout)
    assert (root / "_manifest" / f"{result.run_id}.json").exists()
    assert (root / "_manifest" / f"{result.run_id}.deleted").exists()
    assert not list((root / "_staging").glob("*"))
    assert sorted(plain_parquet_ids(spark, root)) == sorted(old_done)

    # a re-run finds nothing; --include-dead then takes the old dead rows as well
    again = Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert again.archived == 0 and again.run_id is None
    dead = Archiver(spark, store, str(root)).run(timedelta(days=7), include_dead=True)
    assert dead.archived == len(old_dead)
    assert sorted(archived_ids(spark, root)) == sorted(old_done | old_dead)
    assert table_ids(store) == set(ids) - old_done - old_dead


@pytest.mark.parametrize("kind", ["sqlite"])
def test_both_writers_stage_the_same_files(spark: Any, make_store: Any, tmp_path: Path) -> None:
    """The Arrow writer names its directories as Spark's writer does (a topic of each
    character Spark escapes, the first and last control characters standing for the
    rest, and of space, a plain and a non-ASCII one), and writes the same columns with
    the same Parquet types: one archive, whichever writer staged a run."""
    import pyarrow.parquet as pq

    rows = [Row(f"t{c}x", "a") for c in "\x01\t\x1f\"#%'*/:=?[\\]^{\x7f .-_~ü"]
    roots = {}
    for writer in ("arrow", "spark"):
        store = make_store()
        seed(store, rows)
        roots[writer] = tmp_path / writer
        result = Archiver(spark, store, str(roots[writer]), partitions=2, writer=writer).run(timedelta(days=7))
        assert result.archived == len(rows)
    dirs = {w: {str(f.parent.relative_to(root)) for f in root.glob("topic=*/date=*/*.parquet")}
            for w, root in roots.items()}
    assert len(dirs["arrow"]) == len(rows) and dirs["arrow"] == dirs["spark"]
    schemas = {w: {pq.read_schema(f).remove_metadata() for f in root.glob("topic=*/date=*/*.parquet")}
               for w, root in roots.items()}
    assert len(schemas["arrow"]) == 1 and schemas["arrow"] == schemas["spark"]
    archived = {w: sorted((r["topic"], r["date"], r["payload"]) for r in read_archive(spark, str(root)).collect())
                for w, root in roots.items()}
    assert archived["arrow"] == archived["spark"]
    assert {t for t, _, _ in archived["arrow"]} == {r.topic for r in rows}


def committed_ids(root: Path) -> set[int]:
    """Every id some committed run of the archive holds (its manifests' id runs)."""
    committed: set[int] = set()
    for manifest in (root / "_manifest").glob("*.json"):
        for first, last in json.loads(manifest.read_text())["id_ranges"]:
            committed |= set(range(first, last + 1))
    return committed


@pytest.mark.parametrize("kind", ["sqlite"])
def test_crash_at_every_step_then_rerun(spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """A crash at each step in turn, one run after another on one outbox: each run
    first recovers what the crash before it left (finishes a committed run, drops an
    uncommitted staging), then archives the rows aged since and crashes at the next
    step; a last clean run finishes everything. After every crash, a row is gone from
    the outbox only if a committed run holds it, and the readers see exactly the
    committed runs; at the end every old done row is archived exactly once."""
    root = tmp_path / "archive"
    all_ids: set[int] = set()
    old_done: set[int] = set()
    for n, step in enumerate(STEPS):
        rows = mixed_rows()  # new rows aged past the cut-off for this run to archive
        ids = seed(store, rows, start=100 * n)
        all_ids |= set(ids)
        old_done |= {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
        archived_before = committed_ids(root)

        with pytest.raises(Crash):
            Archiver(spark, store, str(root), on_step=crash_in_its_own_run(step),
                     delete_chunk=3).run(timedelta(days=7))
        committed = committed_ids(root)
        assert set(all_ids) - table_ids(store) <= committed, step
        if STEPS.index(step) >= STEPS.index("committed"):
            assert committed == old_done, step  # this run committed every row not archived before it
        else:
            assert committed == archived_before, step
        # the run recovered the crash before it: every earlier committed run finished, no
        # staging left but (at most) this run's own
        manifests = sorted(p.stem for p in (root / "_manifest").glob("*.json"))
        finished = {p.stem for p in (root / "_manifest").glob("*.deleted")}
        assert set(manifests[:-1]) <= finished if STEPS.index(step) >= STEPS.index("committed") \
            else set(manifests) <= finished, step
        assert len(list((root / "_staging").glob("*"))) <= 1, step
        # the pipeline's readers see exactly the committed runs, even mid-crash
        assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(committed, 1)), step

    result = Archiver(spark, store, str(root), delete_chunk=3).run(timedelta(days=7))
    assert len(result.recovered) == 1 and result.archived == 0  # the last crash ("deleted") had committed
    assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert table_ids(store) == all_ids - old_done
    assert not list((root / "_staging").glob("*"))


def record_fsyncs_and_deletes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int] | str]:
    """Every fsync from now on, by inode (a rename keeps the file's), and ``"DELETE"`` at
    each delete chunk, in order."""
    synced: list[tuple[int, int] | str] = []
    real_fsync, real_delete = os.fsync, Archiver._delete

    def fsync(fd: int) -> None:
        real_fsync(fd)
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))

    def delete(self: Archiver, manifest: dict[str, Any]) -> int:
        synced.append("DELETE")
        return real_delete(self, manifest)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Archiver, "_delete", delete)
    return synced


def the_archive_is_on_disk_before_the_commit_and_before_the_first_delete(
        synced: list[tuple[int, int] | str], root: Path, run_id: str) -> None:
    """A power loss right after a DELETE commits must not leave rows deleted from the
    outbox and missing from the archive: on a local path the driver fsyncs every staged
    file before it commits (so a durable manifest never names a file that is not), the
    manifest before its rename, and, before the first DELETE, every published file, the
    manifest and each directory from them up to the archive's root (the entries the
    renames made). ``synced``: ``record_fsyncs_and_deletes`` over run ``run_id``
    (checked on both writers and every engine by ``test_archive_round_trip``)."""
    def inode(path: Path) -> tuple[int, int]:
        st = path.stat()
        return st.st_dev, st.st_ino

    def with_directories(path: Path) -> list[Path]:
        return [path, *[parent for parent in path.parents if parent.is_relative_to(root)]]

    manifest_path = root / "_manifest" / f"{run_id}.json"
    published = [root / rel for rel in json.loads(manifest_path.read_text())["files"]]
    assert published and "DELETE" in synced
    before_delete = set(synced[:synced.index("DELETE")])
    for path in [p for f in [*published, manifest_path] for p in with_directories(f)]:
        assert inode(path) in before_delete, f"{path} was not synced before the first DELETE"
    committed_at = synced.index(inode(manifest_path))  # the manifest's own fsync, before its rename
    for path in published:
        assert inode(path) in synced[:committed_at], f"{path} was not synced before the commit"


@pytest.mark.parametrize("kind", ["sqlite"])
def test_files_the_driver_cannot_see_are_refused_before_the_commit(spark: Any, store: OutboxStore,
                                                                  tmp_path: Path) -> None:
    """A plain path on a real cluster: the executors write to disks of their own, which
    the driver does not see (here: the staging moved aside once the tasks reported). The
    run stops before its commit, naming the cause, with no manifest and no row deleted,
    so the next run is not wedged on a committed run whose files are missing: it
    archives every row (before: the manifest was committed, publish found no file, and
    every later run failed with "committed file ... is missing from the archive")."""
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    root = tmp_path / "archive"

    class ExecutorDisks(ArrowWriter):
        def write(self, spark: Any, options: dict[str, str], staging: str, run_id: str) -> Any:
            written = super().write(spark, options, staging, run_id)
            shutil.move(str(local_path(staging)), tmp_path / "executor-disk")
            return written

    archiver = Archiver(spark, store, str(root))
    archiver.writer = ExecutorDisks()
    with pytest.raises(PipelineError, match=r"not in .*_staging/.* as the driver sees it: .*use a shared filesystem "
                                            r"or an object store.*nothing was committed"):
        archiver.run(timedelta(days=7))
    assert not list((root / "_manifest").glob("*.json"))
    assert table_ids(store) == set(ids)

    result = Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert (result.archived, result.deleted) == (len(old_done), len(old_done))
    assert sorted(archived_ids(spark, root)) == sorted(old_done)


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_topic_too_long_for_a_directory_name_is_refused_before_staging_naming_it(
        spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """The write side takes topics up to 255 UTF-8 bytes, but ``topic=<value>`` is a
    directory name, at most 255 bytes on a local filesystem (and HDFS), with Spark's
    escapes (``%XX``) counted: the run stops before staging with one line naming the
    topic, nothing written, no row deleted (before: "File name too long" from a task,
    and the next run the same)."""
    long_topic = "orders." + "x" * 243  # 250 bytes: enqueue takes it; "topic=" makes 256
    fine = "orders/" + "y" * 76  # 83 characters, the "/" escaped as %2F: 255 bytes with "topic="
    ids = seed(store, [Row(long_topic, "a"), Row("orders.created", "b"), Row(fine, "c")])
    root = tmp_path / "archive"
    with pytest.raises(PipelineError, match=rf"the topic '{long_topic}' .*256 bytes.* a file or directory name "
                                            r"holds at most 255.*nothing was archived"):
        Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert table_ids(store) == set(ids)
    assert not list((root / "_manifest").glob("*.json")) and not list((root / "_staging").glob("*"))

    with store.transaction() as c:  # without it, the rest is archived, the 255-byte name too
        store.engine.execute(c, f"DELETE FROM {store.engine.table} WHERE id = ?", [ids[0]])
    result = Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert result.archived == 2
    assert sorted(r["topic"] for r in read_archive(spark, str(root)).collect()) == sorted(["orders.created", fine])


def record_delete_threads(monkeypatch: pytest.MonkeyPatch, store: OutboxStore) -> list[str]:
    """The name of the thread of each delete chunk ``store`` runs from now on."""
    threads: list[str] = []
    run = store._run

    def noting(operation: str, work: Any, **kw: Any) -> Any:
        if operation == "archive delete":
            threads.append(threading.current_thread().name)
        return run(operation, work, **kw)
    monkeypatch.setattr(store, "_run", noting)
    return threads


def the_delete_runs_on_several_connections_where_the_engine_has_concurrent_writers(
        threads: list[str], store: OutboxStore) -> None:
    """After its first chunk alone, the delete spreads the chunks over ``delete_connections``
    threads (3), each on its own connection (the store keeps one per thread), closed at the
    end; SQLite, one writer at a time, deletes on the calling thread only. ``threads``:
    ``record_delete_threads`` over a run of one-row chunks (checked on every engine by
    ``test_archive_round_trip``)."""
    assert threads[0] == threading.current_thread().name  # the first chunk, alone
    lanes = set(threads[1:])
    assert len(lanes) == (1 if store.engine.name == "sqlite" else 3), Counter(threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("outbox-archive-delete")]


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "mssql"])
def test_crash_between_delete_chunks_then_rerun(spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """On the servers, the crash between delete chunks (a committed run half deleted:
    the recovery path every step after the commit goes through)."""
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    root = tmp_path / "archive"

    with pytest.raises(Crash):
        Archiver(spark, store, str(root), on_step=crash_at("deleted-chunk"), delete_chunk=3).run(timedelta(days=7))
    committed = committed_ids(root)
    assert committed == old_done
    assert 0 < len(set(ids) - table_ids(store)) < len(old_done)  # half deleted
    assert set(ids) - table_ids(store) <= committed
    assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(committed, 1))

    result = Archiver(spark, store, str(root), delete_chunk=3).run(timedelta(days=7))
    assert len(result.recovered) == 1 and result.archived == 0
    assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert table_ids(store) == set(ids) - old_done
    assert not list((root / "_staging").glob("*"))


def stage_by_hand(spark: Any, staging: Path, ids_by_topic: dict[str, list[int]], append: bool = False) -> None:
    """Staged files as the stage writes them (``topic=/date=``), one file per topic."""
    fields = [f.split(" ")[0] for f in ARCHIVE_SCHEMA_DDL.split(", ")]
    rows = [tuple({"id": i, "message_id": f"m{i}", "topic": topic, "status": 2, "attempts": 0,
                   "archive_run": "r", "date": "2026-11-15"}.get(name) for name in fields)
            for topic, ids in ids_by_topic.items() for i in ids]
    (spark.createDataFrame(rows, ARCHIVE_SCHEMA_DDL).repartition(len(ids_by_topic), "topic").write
     .partitionBy("topic", "date").mode("append" if append else "errorifexists").parquet(str(staging)))


class Statements:
    """The statements an engine runs in this process (spied on, then run as they were)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine_class: type) -> None:
        self.seen: list[tuple[str, list[Any]]] = []
        real = engine_class.execute

        def execute(engine: Any, cursor: Any, text: str, params: Any = ()) -> Any:
            self.seen.append((text, list(params)))
            return real(engine, cursor, text, params)

        monkeypatch.setattr(engine_class, "execute", execute)

    def spans(self, marker: str) -> list[tuple[int, int]]:
        """The ``id >= ? AND id <= ?`` bounds of the statements holding ``marker``."""
        found = []
        for text, params in self.seen:
            if marker in text:
                assert "id >= ? AND id <= ?" in text, text
                before = text[:text.index("id >= ? AND id <= ?")].count("?")
                found.append((int(params[before]), int(params[before + 1])))
        return found


@pytest.mark.parametrize("kind", ["postgresql"])
def test_the_rows_to_archive_are_counted_a_short_statement_per_id_chunk(
        spark: Any, store: OutboxStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count of the rows to archive (and of those whose topic may be too long for a
    directory name) was one statement over the whole backlog: minutes on hundreds of
    millions of rows, holding back vacuum (PostgreSQL) and purge (InnoDB) on the hot outbox
    all along (found in review). It is now one statement per ``COUNT_CHUNK`` ids, and the
    long topics are read only in the chunks that hold one; what the run archives is unchanged."""
    long_topic = "t." + "x" * 70  # over SHORT_TOPIC_CHARS, short enough for a directory name
    rows = [*mixed_rows(), Row(long_topic, "l1", age_ms=9 * DAY_MS)]
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    monkeypatch.setattr(archive_module, "COUNT_CHUNK", 4)
    statements = Statements(monkeypatch, type(store.engine))
    result = Archiver(spark, store, str(tmp_path / "archive")).run(timedelta(days=7))
    assert (result.archived, result.deleted) == (len(old_done), len(old_done))
    assert table_ids(store) == set(ids) - old_done
    counts = statements.spans("COUNT(CASE WHEN")
    assert counts == [(a, min(a + 3, max(ids))) for a in range(min(ids), max(ids) + 1, 4)], counts
    assert statements.spans("SELECT DISTINCT topic") == [next(c for c in counts if c[0] <= ids[-1] <= c[1])]
    assert any(r["topic"] == long_topic for r in read_archive(spark, str(tmp_path / "archive")).collect())


@pytest.mark.parametrize("kind", ["postgresql"])
def test_the_per_topic_plan_is_read_a_short_statement_per_id_chunk(store: OutboxStore, url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``--split topic``'s planner counted the rows per topic in one GROUP BY over the whole
    id span (found in review): now one statement per ``COUNT_CHUNK`` ids, each its own
    transaction, the counts merged into the same tasks."""
    from outbox.pipeline import source
    from outbox.pipeline.common import encode_native

    rows = [Row(f"t{i % 3}", f"a{i}", age_ms=9 * DAY_MS) for i in range(11)]
    ids = seed(store, rows)
    with store.transaction() as cursor:
        now = store.engine.execute(cursor, "SELECT now()").fetchone()[0]
    options = {"url": url, "table": store.engine.table_name, "statuses": "2", "split": "topic", "partitions": "3",
               "processed_before": encode_native(now), "min_id": str(ids[0]), "max_id": str(ids[-1])}

    def plan() -> list[Any]:
        return [(p.lo, p.hi, p.pieces) for p in source.OutboxReader(options).partitions()]

    whole = plan()
    monkeypatch.setattr(source, "COUNT_CHUNK", 4)
    statements = Statements(monkeypatch, type(store.engine))
    assert plan() == whole
    assert statements.spans("GROUP BY topic") == [(a, min(a + 3, ids[-1])) for a in range(ids[0], ids[-1] + 1, 4)]


@pytest.mark.parametrize("kind", ["postgresql"])
def test_split_by_topic_archives_what_id_ranges_do_in_fewer_files(spark: Any, make_store: Any,
                                                                   tmp_path: Path) -> None:
    """The stage's ``split=topic`` and ``split=id`` (the default) archive the same rows
    once each; with three interleaved topics and two tasks, id ranges write a file per
    task and topic (6), whole topics at most one per topic plus one cut (4)."""
    rows = [Row(f"t.{i % 3}", f"a{i % 5}") for i in range(30)]
    files = {}
    for split in ("topic", "id"):
        store = make_store()
        ids = seed(store, rows)
        root = tmp_path / split
        result = Archiver(spark, store, str(root), partitions=2, source_options={"split": split}).run(
            timedelta(days=7))
        assert (result.archived, result.deleted) == (30, 30) and table_ids(store) == set()
        assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(ids, 1))
        files[split] = len(list(root.glob("topic=*/date=*/*.parquet")))
    assert files == {"topic": 4, "id": 6}


@pytest.mark.parametrize("kind", ["sqlite"])
def test_verify_gives_the_runs_and_refuses_an_id_staged_twice(spark: Any, store: OutboxStore,
                                                              tmp_path: Path) -> None:
    """The verify step on staged files written by hand, read back by Spark (the Spark
    writer's verify) and by pyarrow (the Arrow writer's, file by file): interleaved
    topics with gaps give the ids' runs, and the files it read (the manifest's list) are
    the staged files; the same id in two files, or an id outside the run's bounds, fail
    it (so the run never commits)."""
    archiver = Archiver(spark, store, str(tmp_path / "archive"))
    staging = tmp_path / "staging"
    by_topic = {"t.a": [1, 3, 5, 6, 7, 10], "t/b 50% ü": [2, 4, 8, 12, 13], "t.c": [20]}  # escaped directory names

    def both() -> list[Any]:
        files = sorted(staging.glob("topic=*/date=*/*.parquet"))
        return [SparkWritten(spark, staging.as_uri()),
                ArrowWritten([str(f.relative_to(staging)) for f in files], file_runs(*map(str, files)))]

    stage_by_hand(spark, staging, by_topic)
    for written in both():
        rows, ranges, files = archiver._verify(written, staging.as_uri(), 1, 20)
        assert (rows, ranges) == (12, [[1, 8], [10, 10], [12, 13], [20, 20]])
        assert files == sorted(str(f.relative_to(staging)) for f in staging.glob("topic=*/date=*/*.parquet"))
        with pytest.raises(PipelineError, match="outside 2..20; nothing was committed"):
            archiver._verify(written, staging.as_uri(), 2, 20)
        with pytest.raises(PipelineError, match="outside 1..19; nothing was committed"):
            archiver._verify(written, staging.as_uri(), 1, 19)

    stage_by_hand(spark, staging, {"t.d": [6]}, append=True)  # id 6 again, in another file
    for written in both():
        with pytest.raises(PipelineError, match="holds id 6 twice; nothing was committed"):
            archiver._verify(written, staging.as_uri(), 1, 20)


@pytest.mark.parametrize("kind", ["postgresql"])
@pytest.mark.parametrize("writer", ["arrow", "spark"])
def test_a_run_whose_verify_fails_commits_and_deletes_nothing(spark: Any, store: OutboxStore, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """A stage that wrote an id twice (here: one file added after the real stage): the
    run stops at verify, with no manifest and no row deleted; the next run, with the
    stage as it is, archives every row once."""
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    root = tmp_path / "archive"
    real_stage = Archiver._stage

    def stage_twice(self: Archiver, staging: str, *args: Any) -> Any:
        written = real_stage(self, staging, *args)
        base = Path(staging.removeprefix("file:").removeprefix("//"))
        stage_by_hand(spark, base, {"zz": [min(old_done)]}, append=True)
        if isinstance(written, ArrowWritten):  # its tasks report what they wrote: this file's too
            extra = list(base.glob("topic=zz/date=*/*.parquet"))
            written.files += [str(f.relative_to(base)) for f in extra]
            written.runs += file_runs(*map(str, extra))
        return written

    monkeypatch.setattr(Archiver, "_stage", stage_twice)
    with pytest.raises(PipelineError, match=f"holds id {min(old_done)} twice; nothing was committed"):
        Archiver(spark, store, str(root), writer=writer).run(timedelta(days=7))
    assert not list((root / "_manifest").glob("*.json"))
    assert table_ids(store) == set(ids)
    monkeypatch.undo()

    result = Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert (result.archived, result.deleted) == (len(old_done), len(old_done))
    assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert not list((root / "_staging").glob("*"))


class HostClockBehind(datetime):
    """The driver host's clock an hour behind (a cron job moved to another host, a VM's
    clock stepped back, a cluster-mode driver on any node)."""

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) - timedelta(hours=1)


def _cli_env(store: OutboxStore, url: str, **extra: str) -> dict[str, str]:
    return {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": store.engine.table_name, **extra}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_requeued_dead_row_is_not_deleted(spark: Any, store: OutboxStore, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead row archived, then requeued before the delete: the live row stays; once
    delivered it is archived again, and the archive's readers give its later copy, also
    when the second run's host clock is behind the first's (its run id, from that clock,
    then sorts first: the readers took the dead copy, found in review)."""
    rows = [Row("orders.created", "a", status=4, attempts=2, last_error="boom"),
            Row("orders.created", "b", status=2)]
    dead_id, done_id = seed(store, rows)

    def requeue_after_commit(step: str) -> None:
        if step == "committed":
            assert store.requeue_dead([dead_id]) == 1

    result = Archiver(spark, store, str(tmp_path / "a"), on_step=requeue_after_commit).run(
        timedelta(days=7), include_dead=True)
    assert (result.archived, result.deleted, result.kept) == (2, 1, 1)
    assert table_ids(store) == {dead_id}

    # delivered since, it is archived again: the archive then holds the id in two runs,
    # and its readers give one row, the later run's
    with store.transaction() as c:
        store.engine.execute(c, f"UPDATE {store.engine.table} SET status = 2, processed_at = "
                             f"{store.engine.now_plus_ms()} WHERE id = ?", [-8 * DAY_MS, dead_id])
    monkeypatch.setattr(archive_module, "datetime", HostClockBehind)
    again = Archiver(spark, store, str(tmp_path / "a")).run(timedelta(days=7))
    assert (again.archived, again.deleted) == (1, 1) and table_ids(store) == set()
    assert len(plain_parquet_ids(spark, tmp_path / "a")) == 3
    got = {r["id"]: r["status"] for r in read_archive(spark, str(tmp_path / "a")).collect()}
    assert got == {dead_id: 2, done_id: 2}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_purge_never_deletes_unarchived_rows_while_archiving(spark: Any, make_store: Any, url: str,
                                                             tmp_path: Path) -> None:
    root = tmp_path / "archive"
    store = make_store(archive_uri=str(root))
    ids = seed(store, mixed_rows())
    assert store.purge_done(timedelta(days=7)) == 0
    assert table_ids(store) == set(ids)
    env = _cli_env(store, url, OUTBOX_ARCHIVE_URI=str(root))
    out = invoke(["purge"], env=env)
    assert out.exit_code == 0 and "purged nothing: archiving is configured" in out.output
    assert table_ids(store) == set(ids)

    # the archive job, with its location from the same setting, archives and deletes
    out = invoke(["pipeline", "archive", "--older-than", "7d", "--json"], env=env)
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output.strip().splitlines()[-1])
    remaining = table_ids(store)
    assert summary["deleted"] == len(set(ids) - remaining) > 0
    assert set(archived_ids(spark, root)) == set(ids) - remaining


@pytest.mark.parametrize("kind", ["sqlite"])
def test_an_archive_run_whose_location_the_relay_does_not_know_warns_that_its_purge_still_deletes(
        spark: Any, store: OutboxStore, url: str, tmp_path: Path) -> None:
    """The relay holds its purge back only while OUTBOX_ARCHIVE_URI is set: an archive job
    given --to without it (or with another location there) says on stderr that the purge
    still deletes done rows older than OUTBOX_RETENTION_DAYS unarchived, and how to stop
    it; the job runs all the same. The same location, spelt otherwise, is no warning."""
    root = tmp_path / "archive"
    seed(store, mixed_rows())
    warning = ("the relay's purge (beat's outbox.purge, `outbox purge`) still deletes done rows older than "
               "7 days (OUTBOX_RETENTION_DAYS) that no run archived")
    out = invoke(["pipeline", "archive", "--older-than", "7d", "--to", str(root)], env=_cli_env(store, url))
    assert out.exit_code == 0, out.output
    assert "warning: OUTBOX_ARCHIVE_URI is not set" in out.stderr and warning in out.stderr, out.stderr
    assert f"set OUTBOX_ARCHIVE_URI={root} for the workers and beat" in out.stderr

    other = _cli_env(store, url, OUTBOX_ARCHIVE_URI=str(tmp_path / "elsewhere"))
    out = invoke(["pipeline", "archive", "--older-than", "7d", "--to", str(root)], env=other)
    assert out.exit_code == 0, out.output
    assert f"warning: OUTBOX_ARCHIVE_URI is {tmp_path / 'elsewhere'}, not --to's {root}" in out.stderr
    assert warning in out.stderr

    same = _cli_env(store, url, OUTBOX_ARCHIVE_URI=f"file://{root}/")
    out = invoke(["pipeline", "archive", "--older-than", "7d", "--to", str(root)], env=same)
    assert out.exit_code == 0, out.output
    assert "warning" not in out.stderr, out.stderr


def test_purge_task_respects_archiving(store: OutboxStore, url: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's beat-driven purge task, configured like a deployment."""
    from outbox.celery import tasks
    from outbox.core.config import reset_settings

    ids = seed(store, mixed_rows())
    for name, value in _cli_env(store, url, OUTBOX_ARCHIVE_URI=str(tmp_path / "a")).items():
        monkeypatch.setenv(name, value)
    reset_settings()
    tasks.close_resources()
    try:
        assert tasks.purge() == 0
    finally:
        tasks.close_resources()
    assert table_ids(store) == set(ids)


@pytest.mark.parametrize("kind", ["sqlite"])
@pytest.mark.parametrize(("args", "message"), [
    (["--older-than", "7x"], "--older-than: '7x' is not a duration"),
    (["--older-than", "-1d"], "is not a duration"),
    (["--older-than", "7d", "--to", "/proc/outbox-archive"], "cannot write to the archive"),
    (["--older-than", "7d", "--to", "s3a://bucket/archive", "--writer", "arrow"],
     "the arrow writer writes to a filesystem path (file:), not s3a://bucket/archive: use --writer spark"),
])
def test_bad_arguments_fail_with_one_line(spark: Any, store: OutboxStore, url: str, tmp_path: Path,
                                          args: list[str], message: str) -> None:
    ids = seed(store, mixed_rows())
    full = ["pipeline", "archive", *args] + ([] if "--to" in args else ["--to", str(tmp_path / "a")])
    out = invoke(full, env=_cli_env(store, url))
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], out.output
    assert table_ids(store) == set(ids)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_missing_table_and_missing_target(spark: Any, store: OutboxStore, url: str, tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": "no_such_outbox_table"}
    out = invoke(["pipeline", "archive", "--older-than", "1d", "--to", str(tmp_path / "a")],
                             env=env)
    assert out.exit_code == 1 and "table \"no_such_outbox_table\" missing: run `outbox migrate`" in out.output, out.output
    assert not (tmp_path / "a").exists()  # nothing created for a job that cannot run
    out = invoke(["pipeline", "archive", "--older-than", "1d"], env=_cli_env(store, url))
    assert out.exit_code == 2 and "--to" in out.output


def committed_not_published(spark: Any, store: OutboxStore, rows: list[Row],
                            root: Path) -> tuple[list[int], set[int], dict[str, Any], Path]:
    """Seed ``rows`` and archive them to ``root`` with a crash right after the commit: the
    ids, the old done ones the run took, its manifest and its staging directory."""
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    with pytest.raises(Crash):
        Archiver(spark, store, str(root), on_step=crash_at("committed")).run(timedelta(days=7))
    manifest = json.loads(next((root / "_manifest").glob("*.json")).read_text())
    return ids, old_done, manifest, root / "_staging" / manifest["run_id"]


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_publish_cut_short_after_a_copy_is_finished_by_the_next_run(spark: Any, store: OutboxStore,
                                                                       tmp_path: Path) -> None:
    """On an object store a rename is a copy, then a delete of the source: a run killed
    between the two leaves a committed file both in staging and in the archive tree
    (docs/pipeline.md, "Running on a cluster": the publish step is idempotent and finished
    by the next run). The next run finishes it: the staged copy goes, the rows are deleted,
    every row is in the archive once. It used to stop with "already exists; the archive was
    changed by hand", and so did every run after it."""
    rows = mixed_rows()
    ids, old_done, manifest, staging = committed_not_published(spark, store, rows, root := tmp_path / "archive")
    first = manifest["files"][0]
    (root / first).parent.mkdir(parents=True, exist_ok=True)
    (root / first).write_bytes((staging / first).read_bytes())  # copied, the source not deleted yet

    result = Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert result.recovered == [manifest["run_id"]]
    assert table_ids(store) == set(ids) - old_done
    assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert not staging.exists()

    # a file of another size where the run's file goes is not the run's copy: it is refused
    seed(store, rows[:3], start=500)
    with pytest.raises(Crash):
        Archiver(spark, store, str(root), on_step=crash_at("committed")).run(timedelta(days=7))
    manifest = json.loads(max((root / "_manifest").glob("*.json")).read_text())
    (root / manifest["files"][0]).parent.mkdir(parents=True, exist_ok=True)
    (root / manifest["files"][0]).write_bytes(b"not the staged file")
    with pytest.raises(PipelineError, match="already exists; the archive was changed by hand"):
        Archiver(spark, store, str(root)).run(timedelta(days=7))


def _stray_copy(committed: Path, stray: Path, id_offset: int) -> list[int]:
    """A complete Parquet file beside a run's committed one, as a task attempt that failed
    after completing it (or outlived its run) leaves it: the committed file's rows under
    other ids. Returns those ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(committed, partitioning=None)
    ids = [i + id_offset for i in table.column("id").to_pylist()]
    stray.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.set_column(table.schema.get_field_index("id"), "id", pa.array(ids, pa.int64())), stray)
    return ids


@pytest.mark.parametrize("kind", ["sqlite"])
def test_the_archive_is_read_by_the_manifests_files_and_what_attempts_leave_in_staging_is_not(
        spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """A committed run still in staging (a crash mid-publish) is read by the files its
    manifest lists, not by its directory: a task attempt that failed after completing a
    file, or one that ran on after its run, may have left complete files of its own there,
    with rows the run did not commit (found in review: the readers took them, so a replay
    would have enqueued a row that is still live in the outbox). The staging directory
    such an attempt makes again after its run has finished is removed by the next run."""
    _, old_done, manifest, staging = committed_not_published(spark, store, mixed_rows(), root := tmp_path / "archive")
    first = Path(manifest["files"][0])
    stray = _stray_copy(staging / first, staging / first.parent / "part-99999-stray.parquet", 1_000_000)
    assert sorted(archived_ids(spark, root)) == sorted(old_done)  # the stray rows are not read

    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).recovered == [manifest["run_id"]]
    assert not staging.exists()  # the stray file went with the staging directory
    # an attempt that ran on after the run had finished makes its staging directory again
    _stray_copy(root / first, staging / first.parent / "part-99998-late.parquet", 2_000_000)
    assert sorted(archived_ids(spark, root)) == sorted(old_done)
    assert not set(stray) & set(archived_ids(spark, root))
    Archiver(spark, store, str(root)).run(timedelta(days=7))  # nothing to archive; it tidies up
    assert not staging.exists()
    assert sorted(plain_parquet_ids(spark, root)) == sorted(old_done)


def test_an_unfinished_run_of_another_database_is_not_finished_on_this_one(spark: Any, tmp_path: Path) -> None:
    """Two outboxes with the same table name in two databases, one archive location (one
    OUTBOX_ARCHIVE_URI for every service): a run of the first that committed but did not
    delete must not be finished by the second's next run, which used to delete the second
    database's rows in the first one's id ranges, rows no run had archived."""
    stores = [OutboxStore(f"sqlite:///{tmp_path / name}.db", table="outbox") for name in ("orders", "billing")]
    try:
        for store in stores:
            store.migrate()
        rows = mixed_rows()
        ids = [seed(store, rows) for store in stores]
        old_done = {i for i, r in zip(ids[1], rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
        root = tmp_path / "archive"
        with pytest.raises(Crash):
            Archiver(spark, stores[0], str(root), on_step=crash_at("committed")).run(timedelta(days=7))
        with pytest.raises(PipelineError, match="unfinished run .* of table 'outbox' in another database"):
            Archiver(spark, stores[1], str(root)).run(timedelta(days=7))
        assert table_ids(stores[1]) == set(ids[1])  # nothing of the second database deleted
        # the first finishes its own run; the second, archived elsewhere, keeps its rows apart
        assert Archiver(spark, stores[0], str(root)).run(timedelta(days=7)).recovered
        result = Archiver(spark, stores[1], str(tmp_path / "billing-archive")).run(timedelta(days=7))
        assert result.archived == len(old_done) and table_ids(stores[1]) == set(ids[1]) - old_done
    finally:
        for store in stores:
            store.close()


def test_another_outbox_with_no_row_at_an_unfinished_runs_ids_does_not_leave_its_own_outbox_refused(
        spark: Any, tmp_path: Path) -> None:
    """Two services, one archive location (the documented mistake: an archive holds one
    outbox). The first's run committed but did not delete (killed, or its delete failed); the
    second, whose rows lie below that run's ids, finished it on its own database (no row
    there, the content check passed), deleting nothing, and marked it finished with no rows
    kept (review diffc). The first service's rows of that run then stayed in its outbox, and
    every later run of it was refused as an outbox whose ids started again, its purge off
    for good (OUTBOX_ARCHIVE_URI set)."""
    orders, billing = (OutboxStore(f"sqlite:///{tmp_path / name}.db", table="outbox") for name in ("orders", "billing"))
    root = tmp_path / "archive"
    try:
        for store in (orders, billing):
            store.migrate()
        seed(orders, [Row("t.created", f"a{i}", age_ms=9 * DAY_MS) for i in range(3)])
        assert Archiver(spark, orders, str(root)).run(timedelta(days=7)).archived == 3  # ids 1..3
        later = seed(orders, [Row("t.created", f"b{i}", age_ms=9 * DAY_MS) for i in range(3)], start=3)
        with pytest.raises(Crash):  # ids 4..6 committed, not deleted
            Archiver(spark, orders, str(root), on_step=crash_at("committed")).run(timedelta(days=7))
        seed(billing, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(2)])  # ids 1..2
        with pytest.raises(PipelineError):  # the second outbox is refused, one way or another
            Archiver(spark, billing, str(root)).run(timedelta(days=7))
        assert table_ids(billing) == {1, 2}
        # the first outbox's next run finishes its own run: its rows leave its outbox
        Archiver(spark, orders, str(root)).run(timedelta(days=7))
        assert not table_ids(orders) & set(later)
        assert sorted(set(archived_ids(spark, root))) == [1, 2, 3, *later]
    finally:
        for store in (orders, billing):
            store.close()


def test_a_run_finished_with_its_kept_rows_not_known_still_refuses_other_events_at_its_ids(
        spark: Any, tmp_path: Path) -> None:
    """A run finished on an outbox with no row at its ids records its kept rows as not known
    (99dd69a). Its ids were then never checked again: the other outbox (or the same one under
    another URL, its ids started again) writing other events at those ids had them archived
    beside the run's, and the readers, which tell rows apart by id, kept one of each two (found
    in review). Rows met there are now compared with the events the run archived: the same
    events pass (the run's own outbox archives them again), others are refused."""
    orders, billing = (OutboxStore(f"sqlite:///{tmp_path / name}.db", table="outbox") for name in ("orders", "billing"))
    root = tmp_path / "archive"
    try:
        for store in (orders, billing):
            store.migrate()
        first = seed(orders, [Row("t.created", f"a{i}", age_ms=9 * DAY_MS) for i in range(3)])  # ids 1..3
        with pytest.raises(Crash):  # committed, not deleted
            Archiver(spark, orders, str(root), on_step=crash_at("committed")).run(timedelta(days=7))
        Archiver(spark, billing, str(root)).run(timedelta(days=7))  # nothing of its own: finishes the run
        assert table_ids(orders) == set(first)
        seed(billing, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(3)])  # ids 1..3, other events
        with pytest.raises(PipelineError, match="already holds for another event"):
            Archiver(spark, billing, str(root)).run(timedelta(days=7))
        assert table_ids(billing) == {1, 2, 3}
        # the run's own outbox archives its rows again (the same events) and they leave it
        Archiver(spark, orders, str(root)).run(timedelta(days=7))
        assert not table_ids(orders)
        assert sorted(set(archived_ids(spark, root))) == first
    finally:
        for store in (orders, billing):
            store.close()


def staged_runs(root: Path) -> list[str]:
    staging = root / "_staging"
    return sorted(os.listdir(staging)) if staging.exists() else []


def test_a_second_outbox_archived_into_the_same_archive_is_refused_before_staging(
        spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two outboxes, one archive location (one OUTBOX_ARCHIVE_URI for two services, or two
    OUTBOX_TABLEs): the readers tell rows apart by id alone, so the second outbox's ids
    1..n hid the first's from the report and the replay, silently (found in review). The
    second outbox's run is refused before it stages anything, by its ids met again for
    other events, and a warning names both outboxes."""
    root = tmp_path / "archive"
    first = OutboxStore(f"sqlite:///{tmp_path / 'orders.db'}", table="outbox")
    others = [OutboxStore(f"sqlite:///{tmp_path / 'billing.db'}", table="outbox"),  # another database
              OutboxStore(f"sqlite:///{tmp_path / 'orders.db'}", table="outbox_two")]  # another table
    try:
        for store in (first, *others):
            store.migrate()
            seed(store, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(3)])
        assert Archiver(spark, first, str(root)).run(timedelta(days=7)).archived == 3
        for other, named in zip(others, ["table 'outbox' of sqlite:///.*billing.db", "table 'outbox_two' of"]):
            before = table_ids(other)
            caplog.clear()
            with caplog.at_level("WARNING", logger="outbox.pipeline.archive"), pytest.raises(PipelineError, match=(
                    r"the outbox's row 1 has an id the archive .* already holds for another event .*nothing was "
                    "archived")):
                Archiver(spark, other, str(root)).run(timedelta(days=7))
            assert table_ids(other) == before and staged_runs(root) == []
            assert any(re.search(f"holds runs of table 'outbox' of sqlite:///.*orders.db .*this run is of {named}",
                                 r.getMessage()) for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert sorted(archived_ids(spark, root)) == [1, 2, 3]
    finally:
        for store in (first, *others):
            store.close()


def respelled(url: str) -> str:
    """Another spelling of a PostgreSQL URL on 127.0.0.1 or localhost: the other host name, the port toggled."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(
        parts.hostname or "", "localhost" if parts.hostname == "127.0.0.1" else "127.0.0.1") +
        ("" if parts.port else ":5432")))


@pytest.mark.parametrize("kind", ["postgresql"])
def test_the_same_outbox_under_another_spelling_of_its_url_archives_on(spark: Any, store: OutboxStore,
                                                                        tmp_path: Path) -> None:
    """The port spelled out, or another name for the host: the same table. Its runs were
    refused as another outbox's, and with OUTBOX_ARCHIVE_URI set nothing was purged either
    (found in review)."""
    root = tmp_path / "archive"
    seed(store, [Row("t.created", "x", age_ms=9 * DAY_MS)])
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1
    again = OutboxStore(respelled(store.url), table=store.engine.table_name, schema=store.engine.schema)
    try:
        seed(again, [Row("t.created", "y", age_ms=9 * DAY_MS)])
        assert Archiver(spark, again, str(root)).run(timedelta(days=7)).archived == 1
    finally:
        again.close()
    assert len(archived_ids(spark, root)) == 2


@pytest.mark.parametrize("kind", ["postgresql"])
def test_an_unfinished_run_is_finished_under_another_spelling_of_its_databases_url(
        spark: Any, store: OutboxStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run killed after its commit, the next run reaching the same database as localhost
    instead of 127.0.0.1: it was refused as another database's, and so was every later run
    (found in review). The rows its delete would remove are the run's own (the same message
    ids), so it is finished, with a warning naming both URLs."""
    root = tmp_path / "archive"
    ids = seed(store, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(3)])
    with pytest.raises(Crash):
        Archiver(spark, store, str(root), on_step=crash_at("committed")).run(timedelta(days=7))
    again = OutboxStore(respelled(store.url), table=store.engine.table_name, schema=store.engine.schema)
    try:
        with caplog.at_level("WARNING", logger="outbox.pipeline.archive"):
            result = Archiver(spark, again, str(root)).run(timedelta(days=7))
    finally:
        again.close()
    assert len(result.recovered) == 1 and table_ids(store) == set()
    assert sorted(archived_ids(spark, root)) == ids
    assert any("recorded under" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_an_outbox_whose_ids_started_again_is_refused_before_staging(spark: Any, tmp_path: Path) -> None:
    """The outbox table re-created (or moved, or its sequence reset): its new rows take ids
    the archive already holds for other events, and the readers would keep one row per id.
    A new row inside a finished run's ids that is not one that run left in the outbox (a
    requeued dead row: the same event) is refused before staging."""
    root = tmp_path / "archive"
    store = OutboxStore(f"sqlite:///{tmp_path / 'orders.db'}", table="outbox")
    try:
        store.migrate()
        seed(store, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(3)])
        assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 3
        with store.transaction() as cursor:
            store.engine.execute(cursor, "DROP TABLE outbox")
        store.migrate()
        ids = seed(store, [Row("t.created", f"y{i}", age_ms=9 * DAY_MS) for i in range(2)])
        assert ids == [1, 2]
        with pytest.raises(PipelineError, match=(
                r"the outbox's row 1 has an id the archive .* already holds for another event \(run .*\): its ids "
                r"started again .*nothing was archived")):
            Archiver(spark, store, str(root)).run(timedelta(days=7))
        assert table_ids(store) == {1, 2} and staged_runs(root) == []
    finally:
        store.close()


def test_the_readers_refuse_an_archive_with_two_events_under_one_id(spark: Any, tmp_path: Path,
                                                                    two_outboxes_archives: list[Path]) -> None:
    """An archive written before the archive refused ids met again (two outboxes' runs put
    together): the report and the replay say so rather than keep one of the two events of
    an id. Runs that only name another URL for their outbox read on."""
    roots = two_outboxes_archives
    assert archived_ids(spark, roots[0]) == [1]
    merged = merged_archive(roots, tmp_path)  # the second outbox's runs put into the first one's archive
    with pytest.raises(PipelineError, match="holds two events under id 1 .*would drop one"):
        read_archive(spark, str(merged))


def finished_run(root: Path, run_id: str, store: OutboxStore, id_ranges: list[list[int]]) -> None:
    """A finished run of ``store``'s outbox written into ``_manifest/`` as a run writes one
    (its manifest, then its ``.deleted`` marker), with no files: a past run of a long-lived archive."""
    manifest = {"run_id": run_id, "version": 1, "engine": store.engine.name,
                "database": archive_module.database_of(store.url), "table": store.engine.table_name,
                "schema": store.engine.schema, "statuses": [2], "cutoff": "2026-01-01T00:00:00+00:00",
                "cutoff_native": "", "rows": sum(b - a + 1 for a, b in id_ranges), "id_ranges": id_ranges,
                "files": [], "committed_at": "2026-01-01T00:00:01+00:00"}
    (root / "_manifest" / f"{run_id}.json").write_text(json.dumps(manifest))
    (root / "_manifest" / f"{run_id}.deleted").write_text(json.dumps(
        {"run_id": run_id, "deleted": manifest["rows"], "kept": [], "at": "2026-01-01T00:00:02+00:00"}))


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_run_reads_only_the_manifests_of_the_runs_its_ids_overlap(spark: Any, store: OutboxStore, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run loaded every finished run's manifest (its id runs and files) and kept them
    all: 60 past runs of 100,000 id runs each took a 1-row run 12.4 s and ~1 GB (found in
    review). A run and the readers now read ``_manifest/index``, a line per run, and
    a manifest only where a run's ids may meet theirs; the index is rebuilt from the
    manifests when it is missing or lacks a run (a run finished and not indexed yet)."""
    from outbox.pipeline.fs import ArchiveFS

    root = tmp_path / "archive"
    seed(store, [Row("t.created", f"x{i}", age_ms=9 * DAY_MS) for i in range(3)])
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 3  # ids 1..3
    # 30 past runs far above, each of 5,000 id runs with gaps, and one whose span holds
    # the next rows' ids 4..5 in a gap (its id runs: 0 and 100)
    far = [f"20250101T{n:06d}000000Z-past" for n in range(30)]
    for n, run_id in enumerate(far):
        base = 1_000_000 + n * 100_000
        finished_run(root, run_id, store, [[base + 2 * i, base + 2 * i] for i in range(5_000)])
    near = "20250102T000000000000Z-near"
    finished_run(root, near, store, [[0, 0], [100, 100]])
    reads: list[str] = []
    real_read = ArchiveFS.read_text

    def counted(fs: ArchiveFS, uri: str) -> str:
        reads.append(uri.rsplit("/", 1)[-1])
        return real_read(fs, uri)

    monkeypatch.setattr(ArchiveFS, "read_text", counted)
    seed(store, [Row("t.created", "y0", age_ms=9 * DAY_MS)], start=3)
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1  # id 4: the index is built
    assert (root / "_manifest" / "index").exists()
    reads.clear()
    seed(store, [Row("t.created", "y1", age_ms=9 * DAY_MS)], start=4)
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1  # id 5
    manifests_read = {name for name in reads if name.endswith(".json") and name != "index"}
    assert manifests_read == {f"{near}.json"}, sorted(manifests_read)
    reads.clear()
    assert sorted(archived_ids(spark, root)) == [1, 2, 3, 4, 5]
    assert not {f"{run_id}.json" for run_id in far} & set(reads), sorted(reads)

    # the index missing, or lacking a run (finished, then killed before the index was
    # written): rebuilt from the manifests, and every run's ids are still checked
    index = root / "_manifest" / "index"
    runs = json.loads(index.read_text())["runs"]
    assert len(runs) == 3 + len(far) + 1
    index.write_text(json.dumps({"version": 1, "runs": [r for r in runs if r["run_id"] != near]}))
    seed(store, [Row("t.created", "y2", age_ms=9 * DAY_MS)], start=5)
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1  # id 6
    assert near in {r["run_id"] for r in json.loads(index.read_text())["runs"]}
    index.unlink()
    assert sorted(archived_ids(spark, root)) == [1, 2, 3, 4, 5, 6]
    moved = seed(store, [Row("t.created", "y3", age_ms=9 * DAY_MS)], start=6)[0]
    with store.transaction() as cursor:  # an id the run "near" archived, for another event
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET id = 100 WHERE id = {moved}")
    with pytest.raises(PipelineError, match=r"the outbox's row 100 has an id the archive .* \(run " + near):
        Archiver(spark, store, str(root)).run(timedelta(days=7))
    assert len(json.loads(index.read_text())["runs"]) == 3 + len(far) + 2


def paused_at(step: str, reached: threading.Event, go: threading.Event) -> Any:
    """A hook that holds its run at ``step`` (its own, not a recovery's) until ``go``."""
    own: list[str] = []

    def hook(name: str) -> None:
        if name == "staged":
            own.append(name)
        if name == step and own:
            reached.set()
            go.wait(300)
    return hook


class Running:
    """An archive run in a thread of its own, held at ``step`` until ``resume``."""

    def __init__(self, spark: Any, store: OutboxStore, root: Path, step: str) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        archiver = Archiver(spark, store, str(root), on_step=paused_at(step, self.reached, self.go))
        self.thread = threading.Thread(target=self._run, args=(archiver,), name="first-archive-run")
        self.thread.start()
        assert self.reached.wait(300), self.error

    def _run(self, archiver: Archiver) -> None:
        try:
            self.result = archiver.run(timedelta(days=7))
        except BaseException as exc:
            self.error = exc
            self.reached.set()

    def resume(self) -> Any:
        self.go.set()
        self.thread.join(300)
        assert self.error is None, f"the first run failed: {type(self.error).__name__}: {self.error}"
        return self.result


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("step", ["staged", "verified"])
def test_a_second_run_of_an_archive_in_use_is_refused_at_once_naming_the_first(
        spark: Any, store: OutboxStore, tmp_path: Path, step: str) -> None:
    """Two runs of one archive on one outbox at once (a cron schedule whose previous run is
    slow): the second, started while the first has staged (or verified) its rows, stops at
    once with one line naming the first (pid and host) and changes nothing; the first
    finishes; every row is archived once. Before: the second's recovery took the first's
    staging for a crashed run's and removed it, archived the same rows itself, and the
    first then failed on Spark's "Path does not exist" (held at "staged") or committed a
    run whose files were gone (held at "verified"), which every later run then failed to
    finish: the archive was stuck until repaired by hand."""
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    root = tmp_path / "archive"
    first = Running(spark, store, root, step)
    try:
        staged = sorted(p.name for p in (root / "_staging").iterdir())
        started = time.monotonic()
        with pytest.raises(PipelineError) as refused:
            Archiver(spark, store, f"file://{root}/").run(timedelta(days=7))  # the same archive, written otherwise
        took = time.monotonic() - started
        message = str(refused.value)
        assert "is in use by another archive run" in message and "\n" not in message, message
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message, message
        assert took < 10, took
        assert sorted(p.name for p in (root / "_staging").iterdir()) == staged  # the first's staging untouched
        assert table_ids(store) == set(ids)
    finally:
        result = first.resume()
    assert (result.archived, result.deleted) == (len(old_done), len(old_done))
    assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert Counter(plain_parquet_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert table_ids(store) == set(ids) - old_done
    assert not (root / "_manifest" / "lock").exists()
    # the lock went with the first run: the next one runs
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 0


@pytest.mark.parametrize("kind", ["sqlite"])
def test_one_archive_under_two_spellings_of_its_location_takes_one_lock(spark: Any, store: OutboxStore,
                                                                       tmp_path: Path) -> None:
    """A symlinked path and a file: URI through the symlink (as an NFS export mounted at two
    paths, s3:// and s3a://): the lock was keyed by the spelling, so two runs worked on one
    archive at once, the second deleting the first's staging (found in review). It is keyed by
    the archive's own id, written once in _manifest/archive-id."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    held = Archiver(spark, store, str(tmp_path / "link" / "archive"))._take_lock()
    try:
        with pytest.raises(PipelineError, match="is in use by another archive run"):
            Archiver(spark, store, f"file://{tmp_path / 'link'}/archive")._take_lock()
        Archiver(spark, store, str(tmp_path / "another"))._take_lock().release()  # another archive: its own lock
    finally:
        held.release()
    assert len((tmp_path / "real" / "archive" / "_manifest" / "archive-id").read_text().strip()) == 32


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_run_killed_while_it_writes_the_archive_id_does_not_stop_the_next_one(
        spark: Any, store: OutboxStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run on a new archive killed between creating _manifest/archive-id and
    writing its text (or a power cut before the text reached the disk): the file stayed
    empty, and every later run failed "is empty: remove it" until someone did, the purge off
    meanwhile (review diffc). The id now appears whole or not at all."""
    import types

    import outbox.pipeline.fs as fs_module

    def killed(fd: int, data: bytes) -> int:
        raise Crash("archive-id")
    seed(store, [Row("t.created", "x", age_ms=9 * DAY_MS)])
    root = tmp_path / "archive"
    with monkeypatch.context() as patched:
        patched.setattr(fs_module, "os", types.SimpleNamespace(**{**vars(os), "write": killed}))
        with pytest.raises(Crash):
            Archiver(spark, store, str(root)).run(timedelta(days=7))
    started = time.monotonic()
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1
    assert time.monotonic() - started < 30
    written = (root / "_manifest" / "archive-id").read_text().strip()
    assert len(written) == 32
    fs = Archiver(spark, store, str(root)).fs  # create-if-absent still: an existing id stays
    assert fs.create_new(fs.uri("_manifest", "archive-id"), "another") is False
    assert (root / "_manifest" / "archive-id").read_text().strip() == written
    assert not [name for name in os.listdir(root / "_manifest") if name.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_run_given_a_wait_runs_once_the_run_holding_the_archive_has_finished(
        spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """``--wait``: the second run waits for the first (saying so once a second), then runs
    and finds the rows already archived; and a wait that runs out is the same refusal."""
    rows = mixed_rows()
    ids = seed(store, rows)
    old_done = {i for i, r in zip(ids, rows) if r.status == 2 and r.age_ms > 7 * DAY_MS}
    root = tmp_path / "archive"
    first = Running(spark, store, root, "staged")
    try:
        started = time.monotonic()
        with pytest.raises(PipelineError, match=r"in use by another archive run .*waited 2 s"):
            Archiver(spark, store, str(root), wait_s=2).run(timedelta(days=7))
        assert 2 <= time.monotonic() - started < 10
        said: list[str] = []
        resumed = threading.Timer(1.5, first.go.set)
        resumed.start()
        second = Archiver(spark, store, str(root), wait_s=300, progress=said.append).run(timedelta(days=7))
    finally:
        result = first.resume()
    assert result.archived == len(old_done) and second.archived == 0
    assert any("in use by another archive run" in line and "waiting" in line for line in said), said
    assert Counter(archived_ids(spark, root)) == Counter(dict.fromkeys(old_done, 1))
    assert table_ids(store) == set(ids) - old_done


def test_the_archive_files_are_listed_and_written_as_hadoop_does_on_a_local_path(spark: Any, tmp_path: Path) -> None:
    """On a local path the archive's listing walks ``listStatus`` and its small files are
    written (and, without a checksum file, read) in Python (Hadoop's local filesystem started a process per file listed or
    made: docs/pipeline.md, "Tests"). The listing is the one ``listFiles`` gave (checksum
    files left out, hidden files in; ``prune`` skips the top directories it names), and a
    file Hadoop wrote, with its checksum file beside it, is replaced and read back whole."""
    from outbox.pipeline.fs import ArchiveFS

    root = tmp_path / "arch ü%20"
    fs = ArchiveFS(spark, f"file://{root}")
    fs.mkdirs(fs.uri("topic=a", "date=2026-01-01"))
    for rel in ("topic=a/date=2026-01-01/part-0.parquet", "topic=a/date=2026-01-01/.part-1.parquet",
                "_staging/run/topic=b/part-2.parquet", "_manifest/r.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    hadoop = fs.fs
    out = hadoop.create(fs._p(fs.uri("_manifest", "index")), True)  # as Hadoop writes it: with .index.crc
    out.write(bytearray(b'{"old": true}'))
    out.close()
    assert (root / "_manifest" / ".index.crc").exists()
    assert fs.read_text(fs.uri("_manifest", "index")) == '{"old": true}'  # read by Hadoop, which checks its .crc
    everything = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".crc"))
    listed = []
    iterator = hadoop.listFiles(fs._p(fs.root), True)
    while iterator.hasNext():
        listed.append(iterator.next().getPath().toUri().getPath()[len(str(root)) + 1:])
    assert fs.list_files(fs.root) == sorted(listed) == everything
    assert fs.list_files(fs.root, prune="_") == ["topic=a/date=2026-01-01/.part-1.parquet",
                                                 "topic=a/date=2026-01-01/part-0.parquet"]
    assert fs.list_files(fs.uri("nothing")) == []

    fs.write_text(fs.uri("_manifest", "index"), '{"new": "ü"}')
    assert fs.read_text(fs.uri("_manifest", "index")) == '{"new": "ü"}'
    assert json.loads(spark.read.text(str(root / "_manifest" / "index")).collect()[0][0]) == {"new": "ü"}
    fs.write_text(fs.uri("_new", "deep", "note"), "n")  # its directories made, as Hadoop's create makes them
    assert (root / "_new" / "deep" / "note").read_text() == "n"
    assert not list(root.rglob("*.tmp"))
    assert fs.rename(fs.uri("_manifest", "r.json"), fs.uri("topic=c", "date=2026-01-02", "r.json"))
    assert (root / "topic=c" / "date=2026-01-02" / "r.json").read_text() == "x"
