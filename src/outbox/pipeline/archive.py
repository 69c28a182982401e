"""``outbox pipeline archive``: finished rows -> Parquet, then out of the outbox.

One run, step by step (each step is safe to crash in; see docs/pipeline.md):

0. **lock** the archive: one run of an archive at a time, a second one is refused
   naming the first (``lock.py``; docs/pipeline.md, "One run at a time");
1. **recover** every earlier run that committed but did not finish (publish its
   files, delete its rows) and drop the staging of runs that never committed;
2. **cut-off** on the database clock, ``now - older_than``, kept as the driver's own
   value so every later comparison is the database's own comparison;
3. **stage**: the executors read the rows with the ``outbox`` data source's reader, each
   task an id range (``split=id``; ``split=topic``: whole topics), and write Parquet, partitioned
   ``topic=/date=``, under ``_staging/<run>/`` (``stage.py``: pyarrow in each task for an
   archive on a filesystem path, Spark's writer for other URIs);
4. **verify**: read the staged ids back and turn them into ``[first, last]`` runs of
   consecutive ids (an id there twice, or outside the bounds, fails the run);
5. **commit**: once the driver sees every staged file (a plain path on a cluster whose
   executors wrote to disks of their own is refused here) and, on a local path, has
   fsynced them, write ``_manifest/<run>.json`` (the id runs, the cut-off, the files).
   This file is the commit point: before it the run never happened, after it the
   run is finished by whoever comes next;
6. **publish**: move the staged files into the archive's ``topic=/date=`` tree;
7. **delete** exactly the committed ids, in chunks (on several connections where the
   engine has concurrent writers), and only rows still done/dead and processed before
   the cut-off (a dead row requeued since is left alone);
8. mark the run finished: ``_manifest/<run>.deleted``.

A re-run after a crash anywhere neither duplicates nor skips: rows are deleted only
after their run committed, a committed run is always finished before new rows are
read, and a run that did not commit leaves no trace in the archive.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import chain, islice, takewhile
from typing import Any
from urllib.parse import urlsplit

from ..core.names import host_list
from ..core.redact import redact
from ..storage.engines import engine_for_url
from ..storage.engines.base import Engine
from ..storage.engines.sqlite import sqlite_path
from ..storage.store import OutboxStore
from .common import (
    ARCHIVE_SCHEMA_DDL,
    COUNT_CHUNK,
    DELETE_CHUNK,
    DELETE_CONNECTIONS,
    PipelineError,
    archive_uri,
    decode_native,
    delete_groups,
    encode_native,
    local_path,
    range_chunks,
)
from .fs import ArchiveFS
from .lock import ArchiveLock
from .stage import MAX_NAME_BYTES, SHORT_TOPIC_CHARS, StageWriter, Written, topic_dir_bytes, writer_for

log = logging.getLogger("outbox.pipeline.archive")

#: The crash-injection points, in the order a run passes them.
STEPS = ("staged", "verified", "committed", "published-one", "published", "deleted-chunk", "deleted")

MANIFEST_DIR = "_manifest"
#: ``_manifest/lock``: who holds the archive's lock, written by its holder (named in a refusal).
HOLDER_NOTE = "lock"
#: ``_manifest/archive-id``: the archive's UUID, written once; its lock's key (``Archiver._archive_id``).
ARCHIVE_ID = "archive-id"
#: ``_manifest/index``: one summary per committed run (``run_summary``), so that a run and
#: the readers load a manifest only where its ids matter (docs/pipeline.md, "The manifest index").
INDEX = "index"
#: Seconds to wait for an archive id another run has just created to be written.
ARCHIVE_ID_WAIT_S = 5.0
#: Seconds between two tries for a lock another run holds (``--wait``).
LOCK_POLL_S = 1.0
STAGING_DIR = "_staging"
#: The archive locations whose names are limited to ``MAX_NAME_BYTES`` (object stores' are not).
NAME_LIMITED_SCHEMES = ("file", "hdfs", "viewfs", "webhdfs", "swebhdfs")
DONE_STATUS, DEAD_STATUS = 2, 4
#: Ids per statement of the check that the outbox's ids did not start again (``Archiver._check_ids``).
CHECK_CHUNK = 100_000
#: Rows compared by message id before finishing a run recorded under another URL (``Archiver._check_own_run``).
OWN_RUN_SAMPLE = 200

Hook = Callable[[str], None]

@dataclass
class ArchiveResult:
    run_id: str | None
    archived: int = 0
    deleted: int = 0
    #: Committed rows left in the outbox because they changed after being read (a dead
    #: row requeued): their archived copy is history, the live row goes on.
    kept: int = 0
    cutoff: datetime | None = None
    recovered: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "archived": self.archived, "deleted": self.deleted, "kept": self.kept,
                "cutoff": self.cutoff.isoformat() if self.cutoff else None, "recovered": self.recovered}


@dataclass
class Candidates:
    """The rows to archive, as ``Archiver._candidates`` counted them."""
    count: int = 0
    lo: int | None = None
    hi: int | None = None
    #: The counted id chunks that hold a topic that may be too long for a directory name.
    long_chunks: list[tuple[int, int]] = field(default_factory=list)


def _noop(step: str) -> None:
    return None


# -- the SQL the archive sends (portable; checked against T-SQL with sqlglot in the tests) --
def check_table_sql(engine: Engine) -> str:
    return f"SELECT COUNT(*) FROM {engine.table} WHERE 1 = 0"


def table_bounds_sql(engine: Engine) -> str:
    """The table's lowest and highest id (either end of its primary key: no row is read)."""
    return f"SELECT MIN(id), MAX(id) FROM {engine.table}"


def candidates_sql(engine: Engine, statuses: list[int]) -> str:
    """Count and id bounds of the rows to archive in ``?``..``?``, and how many of them have
    a topic that may be too long for a directory name (``long_topics_sql``); a third ``?``:
    the cut-off."""
    return (f"SELECT COUNT(*), MIN(id), MAX(id), "
            f"COUNT(CASE WHEN {engine.text_length}(topic) > {SHORT_TOPIC_CHARS} THEN 1 END) "
            f"FROM {engine.id_range_source()} WHERE id >= ? AND id <= ? "
            f"AND status IN ({', '.join(str(int(s)) for s in statuses)}) AND processed_at <= ?")


def long_topics_sql(engine: Engine, statuses: list[int]) -> str:
    """The topics of the rows to archive in ``?``..``?`` that may be too long for a directory
    name (more than ``SHORT_TOPIC_CHARS`` characters); a third ``?``: the cut-off."""
    return (f"SELECT DISTINCT topic FROM {engine.id_range_source()} WHERE id >= ? AND id <= ? "
            f"AND status IN ({', '.join(str(int(s)) for s in statuses)}) AND processed_at <= ? "
            f"AND {engine.text_length}(topic) > {SHORT_TOPIC_CHARS}")


def delete_sql(engine: Engine, statuses: list[int], ranges: int = 1) -> str:
    """Delete ``ranges`` ranges of archived ids (``?`` first, ``?`` last, for each) whose rows
    are still in an archived status and processed before the run's cut-off (``?``)."""
    within = " OR ".join(["(id >= ? AND id <= ?)"] * ranges)
    return (f"DELETE FROM {engine.id_range_source()} WHERE ({within}) "
            f"AND status IN ({', '.join(str(int(s)) for s in statuses)}) AND processed_at <= ?")


def ids_in_span_sql(engine: Engine, statuses: list[int] | None = None) -> str:
    """The ids and message ids of the rows in ``?``..``?``; with ``statuses``, of the rows a
    run would archive (in those statuses, processed before the cut-off: a third ``?``)."""
    sql = f"SELECT id, message_id FROM {engine.id_range_source()} WHERE id >= ? AND id <= ?"
    if statuses is None:
        return sql
    return sql + f" AND status IN ({', '.join(str(int(s)) for s in statuses)}) AND processed_at <= ?"


def outbox_named(database: Any, schema: Any, table: Any) -> str:
    """An outbox as a message names it: ``table 'name' of <database>``."""
    return f"table {(f'{schema}.{table}' if schema else table)!r} of {database}"


def database_of(url: str) -> str:
    """The database ``url`` names, to tell two outboxes' runs apart in one archive: the
    engine, host, port and database, without user, password or options (SQLite: the file's
    absolute path; a URL naming no host, such as an ODBC connection string: the whole URL,
    password masked)."""
    engine = engine_for_url(url)
    if engine.name == "sqlite":
        path = sqlite_path(url)
        return f"sqlite:///{os.path.abspath(path) if path != ':memory:' else path}"
    parts = urlsplit(url)
    if not parts.hostname:
        return redact(url)
    return f"{engine.name}://{host_list(url)}{parts.path.rstrip('/')}"  # libpq's list of hosts too


def check_table(store: OutboxStore) -> None:
    """Fail with one clear line when the outbox table is not there: a missing table (or
    column) says what every command says, ``table ... missing: run `outbox migrate```."""
    try:
        store._run("check table", lambda c: store.engine.execute(c, check_table_sql(store.engine)).fetchall())
    except Exception as exc:  # noqa: BLE001 - any failure to read becomes one PipelineError line
        hint = store.engine.schema_error_hint(exc)
        if hint is not None:
            raise PipelineError(hint) from None
        raise PipelineError(f"cannot read the outbox table {store.engine.table} on {store.engine.name}: "
                            f"{' '.join(str(exc).split())[:200]}") from None


def cutoff_from(now: datetime, older_than: timedelta) -> datetime:
    """``now - older_than`` in absolute time: an aware ``now`` (psycopg gives ``now()`` in
    the session's time zone) is taken to UTC first, as Python subtracts from an aware
    datetime in its wall-clock time (across a DST change 7 days would be 6d23h or 7d1h;
    docs/pipeline.md, step 2). A naive one (UTC by the engines' convention) is unchanged."""
    return (now.astimezone(UTC) if now.tzinfo is not None else now) - older_than


def db_cutoff(store: OutboxStore, older_than: timedelta) -> Any:
    """``now - older_than`` on the database clock, as the driver's own value (an aware one
    in UTC: ``cutoff_from``)."""
    engine = store.engine
    now = store._run("clock", lambda c: engine.execute(c, f"SELECT {engine.now}").fetchone()[0])
    if isinstance(now, datetime):
        return cutoff_from(now, older_than)
    ms = int(older_than.total_seconds() * 1000)
    return store._run("clock", lambda c: engine.execute(c, f"SELECT {engine.now_plus_ms()}", [-ms]).fetchone()[0])


# -- the committed runs: their manifests and the index of them (docs/pipeline.md, "The manifest index") --
def committed_run_ids(names: Sequence[str]) -> list[str]:
    """The runs whose manifest is among ``names`` (a listing of ``_manifest/``), oldest first."""
    return sorted(n[:-len(".json")] for n in names if n.endswith(".json") and not n.startswith("."))


def finished_run_ids(names: Sequence[str]) -> set[str]:
    """The runs marked finished (``.deleted``) among ``names``."""
    return {n[:-len(".deleted")] for n in names if n.endswith(".deleted")}


def read_manifest(fs: ArchiveFS, run_id: str) -> dict[str, Any]:
    return json.loads(fs.read_text(fs.uri(MANIFEST_DIR, f"{run_id}.json")))


def run_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """A run's line in the index: what a run and the readers ask of every run (its id span,
    outbox and cut-off), without its id runs and files (a manifest can be megabytes)."""
    ranges = manifest["id_ranges"]
    return {"run_id": manifest["run_id"], "min_id": min((int(a) for a, _ in ranges), default=None),
            "max_id": max((int(b) for _, b in ranges), default=None), "rows": manifest["rows"],
            "database": manifest.get("database"), "schema": manifest.get("schema"), "table": manifest.get("table"),
            "cutoff": manifest["cutoff"]}


def run_index(fs: ArchiveFS, names: Sequence[str],
              known: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The summary of every committed run (``names``: the listing of ``_manifest/``), oldest
    first, and whether the index was behind. The manifests are the truth: a run the index
    lacks (finished by a run killed before it wrote the index, or the index missing or being
    rewritten) is summarized from its manifest (``known``: a summary at hand, not read
    again), and a run whose manifest is gone is left out."""
    indexed: dict[str, dict[str, Any]] = {}
    if INDEX in names:
        try:
            indexed = {run["run_id"]: run for run in json.loads(fs.read_text(fs.uri(MANIFEST_DIR, INDEX)))["runs"]}
        except Exception:  # replaced under this reader, or damaged: the manifests tell it all
            log.debug("outbox: cannot read the archive's run index; reading the manifests", exc_info=True)
    runs, behind = [], False
    for run_id in committed_run_ids(names):
        run = indexed.get(run_id)
        if run is None:
            run = known if known is not None and known["run_id"] == run_id else run_summary(read_manifest(fs, run_id))
            behind = True
        runs.append(run)
    return runs, behind or len(runs) != len(indexed)


def write_run_index(fs: ArchiveFS, runs: Sequence[dict[str, Any]]) -> None:
    """Write the index (whole, atomically: ``ArchiveFS.write_text``); only the lock's holder does."""
    fs.write_text(fs.uri(MANIFEST_DIR, INDEX), json.dumps({"version": 1, "runs": list(runs)}))


def within_runs(id_ranges: Sequence[Sequence[int]], rows: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """The ``(id, ...)`` of ``rows`` whose id is in one of the ``[first, last]`` runs (not in a gap)."""
    ranges = sorted((int(a), int(b)) for a, b in id_ranges)
    starts = [a for a, _ in ranges]
    for row in rows:
        at = bisect_right(starts, int(row[0])) - 1
        if at >= 0 and ranges[at][1] >= int(row[0]):
            yield row


class Archiver:
    def __init__(self, spark: Any, store: OutboxStore, to: str, *, on_step: Hook | None = None,
                 delete_chunk: int = DELETE_CHUNK, delete_connections: int = DELETE_CONNECTIONS, partitions: int = 4,
                 progress: Callable[[str], None] | None = None, source_options: dict[str, str] | None = None,
                 wait_s: float = 0.0, writer: str = "auto") -> None:
        if delete_chunk < 1:
            raise PipelineError("--delete-chunk must be at least 1")
        if delete_connections < 1:
            raise PipelineError("--delete-connections must be at least 1")
        self.spark = spark
        self.store = store
        self.root = archive_uri(to)
        #: Who writes the staged files (``stage.py``): pyarrow in the tasks for a path, else Spark.
        self.writer: StageWriter = writer_for(writer, self.root)
        self.on_step = on_step or _noop
        self.delete_chunk = delete_chunk
        self.delete_connections = delete_connections
        self.partitions = partitions
        self.progress = progress or (lambda message: log.info("%s", message))
        self.source_options = source_options or {}
        #: How long to wait for another run holding the archive's lock (0: refuse at once).
        self.wait_s = max(0.0, wait_s)
        self._fs: ArchiveFS | None = None
        self._lock: ArchiveLock | None = None

    @property
    def fs(self) -> ArchiveFS:
        if self._fs is None:
            self._fs = ArchiveFS(self.spark, self.root)
        return self._fs

    @property
    def engine(self) -> Engine:
        return self.store.engine

    # -- the run ---------------------------------------------------------------------------
    def run(self, older_than: timedelta, include_dead: bool = False) -> ArchiveResult:
        check_table(self.store)
        self._lock = self._take_lock()
        try:
            try:
                self.fs.check_writable()
            except Exception as exc:  # noqa: BLE001 - any failure to write becomes one PipelineError line
                raise self._unwritable(exc) from None
            self.fs.write_text(self.fs.uri(MANIFEST_DIR, HOLDER_NOTE), json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "since": datetime.now(UTC).isoformat(
                    timespec="seconds"), "database": database_of(self.store.url), "table": self.engine.table_name}))
            return self._run(older_than, include_dead)
        finally:
            try:
                self.fs.delete(self.fs.uri(MANIFEST_DIR, HOLDER_NOTE), recursive=False)
            except Exception:  # a stale note only names a finished run until the next one
                log.debug("outbox: cannot remove the archive's holder note", exc_info=True)
            self._lock.release()
            self._lock = None

    # -- one run at a time (docs/pipeline.md, "One run at a time") ---------------------------
    def _take_lock(self) -> ArchiveLock:
        """The archive's lock, or a PipelineError naming its holder once ``wait_s`` has
        passed (at once by default). The lock is keyed by the archive's id (``_archive_id``),
        not by how its location is spelled."""
        try:
            archive_id = self._archive_id()
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - a location Hadoop cannot name becomes one PipelineError line
            raise self._unwritable(exc) from None
        lock = ArchiveLock(self.store, self.root, key=f"archive id {archive_id}")
        deadline = time.monotonic() + self.wait_s
        while not lock.try_acquire():
            holder = self._holder()
            if time.monotonic() >= deadline:
                after = f"waited {self.wait_s:g} s; " if self.wait_s else ""
                raise PipelineError(f"the archive {self.root} is in use by another archive run ({holder}); "
                                    f"{after}runs of one archive must not overlap: run again when it has finished"
                                    + ("" if self.wait_s else " (or give --wait)"))
            self.progress(f"the archive {self.root} is in use by another archive run ({holder}); waiting")
            time.sleep(max(0.0, min(LOCK_POLL_S, deadline - time.monotonic())))
        return lock

    def _archive_id(self) -> str:
        """The archive's own name, a UUID its first run writes once in ``_manifest/archive-id``
        (create-if-absent): every spelling of its location (a symlink, a ``file:`` URI, an NFS
        export mounted at two paths, ``s3://`` and ``s3a://``) reads the same one, where the
        location's name gave two locks (docs/pipeline.md, "One run at a time")."""
        path = self.fs.uri(MANIFEST_DIR, ARCHIVE_ID)
        if not self.fs.exists(path):
            self.fs.mkdirs(self.fs.uri(MANIFEST_DIR))
            self.fs.create_new(path, uuid.uuid4().hex)
        deadline = time.monotonic() + ARCHIVE_ID_WAIT_S
        while not (text := self.fs.read_text(path).strip()) and time.monotonic() < deadline:
            time.sleep(0.1)  # created a moment ago by a run starting beside this one, not written yet
        if not text:
            raise PipelineError(f"{path} is empty: remove it (no run may be on) and run again")
        return text

    def _unwritable(self, exc: BaseException) -> PipelineError:
        """The one line for an archive location that cannot be named or written to."""
        return PipelineError(f"cannot write to the archive {self.root}: {' '.join(str(exc).split())[:200]}")

    def _holder(self) -> str:
        """Who holds the archive's lock, as its holder recorded it (``_manifest/lock``)."""
        note = self.fs.uri(MANIFEST_DIR, HOLDER_NOTE)
        try:
            held = json.loads(self.fs.read_text(note)) if self.fs.exists(note) else None
        except Exception:  # a note being rewritten: say so rather than fail
            log.debug("outbox: cannot read %s", note, exc_info=True)
            held = None
        if not held:
            return "a run that has not recorded itself yet"
        return f"pid {held.get('pid')} on host {held.get('host')}, since {held.get('since')}"

    def _still_locked(self, before: str) -> None:
        if self._lock is not None:
            self._lock.check(before)

    def _run(self, older_than: timedelta, include_dead: bool) -> ArchiveResult:
        self._check_one_outbox()
        recovered = self.recover()
        statuses = [DONE_STATUS, DEAD_STATUS] if include_dead else [DONE_STATUS]
        cutoff = db_cutoff(self.store, older_than)
        cutoff_dt = self.engine.to_datetime(cutoff)
        assert cutoff_dt is not None  # the database's clock always answers
        found = self._candidates(statuses, cutoff)
        if found.long_chunks:
            self._check_topic_names(statuses, cutoff, found.long_chunks)
        count, lo, hi = found.count, found.lo, found.hi
        result = ArchiveResult(run_id=None, cutoff=cutoff_dt, recovered=recovered)
        if not count or lo is None or hi is None:
            self.progress(f"nothing to archive: no {'done or dead' if include_dead else 'done'} rows "
                          f"processed before {cutoff_dt.isoformat()}")
            return result
        self._check_ids(statuses, cutoff, int(lo), int(hi))
        run_id = f"{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}-{uuid.uuid4().hex[:8]}"
        result.run_id = run_id
        self.progress(f"run {run_id}: archiving {count} row(s) processed before {cutoff_dt.isoformat()} "
                      f"(ids {lo}..{hi}) to {self.root}")
        staging = self.fs.uri(STAGING_DIR, run_id)
        written = self._stage(staging, run_id, statuses, cutoff, int(lo), int(hi))
        self.on_step("staged")
        rows, ranges, files = self._verify(written, staging, int(lo), int(hi))
        if rows > count:
            raise PipelineError(f"run {run_id}: staged {rows} rows but only {count} matched; nothing was committed")
        if rows < count:
            self.progress(f"run {run_id}: {count - rows} row(s) changed while reading (requeued); "
                          "they stay in the outbox")
        self.on_step("verified")
        manifest = {
            "run_id": run_id, "version": 1, "engine": self.engine.name, "database": database_of(self.store.url),
            "table": self.engine.table_name,
            "schema": self.engine.schema, "statuses": statuses, "cutoff": cutoff_dt.isoformat(),
            "cutoff_native": encode_native(cutoff), "rows": rows, "id_ranges": ranges, "files": files,
            "committed_at": datetime.now(UTC).isoformat(),
        }
        self._check_visible(run_id, staging, files)
        self._still_locked(f"committing run {run_id}")
        # A durable manifest must never name a file that is not (docs/pipeline.md, "Durability").
        self.fs.sync(f"{staging}/{rel}" for rel in files)
        self.fs.write_text(self.fs.uri(MANIFEST_DIR, f"{run_id}.json"), json.dumps(manifest))
        self.on_step("committed")
        self.progress(f"run {run_id}: committed {rows} row(s) in {len(files)} file(s)")
        result.archived = rows
        result.deleted = self._finish(manifest)
        result.kept = rows - result.deleted
        return result

    # -- one outbox per archive (docs/pipeline.md, "Guarantees") ---------------------------
    def _check_one_outbox(self) -> None:
        """Warn, once per run, when the archive's finished runs name another outbox (another
        database URL, schema or table): an archive is meant to hold one. Only a warning: the
        URL is compared as written, and a port spelled out, a host alias or a failover to
        another host changes it for the same table (refused at first, every later run was:
        found in review). What would lose events, two events under one id, ``_check_ids``
        refuses by their message ids. Reads the index only (``_index``), not the manifests.
        (An unfinished run of another outbox: ``recover``.)"""
        names = self.fs.list_names(self.fs.uri(MANIFEST_DIR))
        finished = finished_run_ids(names)
        database = database_of(self.store.url)
        mine = outbox_named(database, self.engine.schema, self.engine.table_name)
        others: list[str] = []
        for run in self._index(names=names):
            if run["run_id"] not in finished:
                continue
            # (A manifest written before "database" was recorded is taken as this database's.)
            theirs = outbox_named(run.get("database") or database, run.get("schema"), run.get("table"))
            if theirs != mine and theirs not in others:
                others.append(theirs)
                log.warning("outbox: the archive %s holds runs of %s (run %s) and this run is of %s: the same "
                            "outbox under another URL, or another outbox; an archive holds one outbox (give each "
                            "its own OUTBOX_ARCHIVE_URI): ids met again for other events are refused",
                            self.root, theirs, run["run_id"], mine)

    def _index(self, known: dict[str, Any] | None = None, *,
               names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The committed runs' summaries (``run_index``; ``known``: the run this one has just
        finished), written back when the index was behind: this run holds the lock, so it
        alone writes the index."""
        if names is None:
            names = self.fs.list_names(self.fs.uri(MANIFEST_DIR))
        runs, behind = run_index(self.fs, names, known)
        if behind:
            write_run_index(self.fs, runs)
        return runs

    def _check_own_run(self, manifest: dict[str, Any], database: str) -> bool:
        """A committed run's deletes belong to its own outbox: finished on another one they
        would delete that outbox's rows in the run's id ranges, rows no run archived. A run
        recorded under another URL is finished here only when this outbox's rows in its id
        runs (the first ``OWN_RUN_SAMPLE``) are rows it archived: the same id, the same
        message id. The URL alone refused the same database under another spelling, and then
        every later run (docs/pipeline.md, "Guarantees"). Returns whether any row was found:
        with none, this may be another outbox, so the rows the run left are not known here
        (``_finish``'s ``kept_known``)."""
        run_id = manifest["run_id"]
        here = {id_: str(message_id) for id_, message_id in islice(
            self._rows_within(manifest["id_ranges"], ids_in_span_sql(self.engine), []), OWN_RUN_SAMPLE)}
        archived = self._archived_message_ids(manifest, list(here)) if here else {}
        if any(archived.get(id_) != message_id for id_, message_id in here.items()):
            raise PipelineError(f"the archive {self.root} has an unfinished run {run_id} of table "
                                f"{manifest.get('table')!r} in another database ({manifest['database']}): this "
                                "outbox's rows at its ids are other events; finish it by archiving that outbox "
                                "first (an archive holds one outbox)")
        log.warning("outbox: the archive %s has an unfinished run %s recorded under %s, and this run is on %s; %s, "
                    "so it is finished here", self.root, run_id, manifest["database"], database,
                    f"{len(here)} row(s) at its ids are the events it archived" if here else
                    "no row at its ids is left in this outbox (the rows it left are recorded as not known: "
                    "if it is another outbox's run, that outbox's next run archives them again)")
        return bool(here)

    def _archived_message_ids(self, manifest: dict[str, Any], ids: list[int]) -> dict[int, str]:
        """id -> message id of ``ids`` in a committed run's files (in staging, or published)."""
        from pyspark.sql import functions as F

        staging = self.fs.uri(STAGING_DIR, manifest["run_id"])
        paths = [path for rel in manifest["files"] for path in (f"{staging}/{rel}", self.fs.uri(rel))
                 if self.fs.exists(path)]
        if not paths:
            return {}
        rows = (self.spark.read.schema("id BIGINT, message_id STRING").parquet(*paths)
                .where(F.col("id").isin(ids)).collect())
        return {int(r["id"]): str(r["message_id"]) for r in rows}

    def _check_ids(self, statuses: list[int], cutoff: Any, lo: int, hi: int) -> None:
        """Refuse, before staging, rows to archive whose ids a finished run already archived
        for other events: the outbox's ids started again (its table re-created or moved, its
        sequence reset), and the readers would keep one of the two events of an id. The
        one row a run may meet again is one an earlier run left in the outbox (a dead row
        requeued after it was read: ``kept``), the same event. A run's manifest is read (and
        let go) only when a row to archive lies in its id span (the index's min and max)."""
        sql = ids_in_span_sql(self.engine, statuses)
        names = self.fs.list_names(self.fs.uri(MANIFEST_DIR))
        finished = finished_run_ids(names)
        for run in self._index(names=names):
            if run["run_id"] not in finished or run["min_id"] is None or run["max_id"] < lo or run["min_id"] > hi:
                continue
            met = self._rows_in(sql, [cutoff], max(lo, run["min_id"]), min(hi, run["max_id"]))
            first = next(met, None)
            if first is None:
                continue
            manifest = read_manifest(self.fs, run["run_id"])
            kept = self._kept_of(manifest)
            rows: Iterable[tuple[int, Any]] = within_runs(manifest["id_ranges"], chain([first], met))
            if kept is None:
                # Not recorded: finished before they were, or on an outbox with no row at its ids
                # (``_check_own_run``). The events it archived tell, for a sample of the rows met
                # (an outbox's rows there are all the run's events or none: ids are unique); not
                # checked, another outbox's events, or this one's after its ids started again,
                # were archived beside the run's under the same ids (found in review).
                rows = list(islice(rows, OWN_RUN_SAMPLE))
                kept = self._archived_message_ids(manifest, [id_ for id_, _ in rows])
                if not kept:  # its files are not to be found: nothing to tell by
                    log.debug("outbox: run %s recorded no kept rows; its ids are not checked", manifest["run_id"])
                    continue
                rows = [(id_, str(message_id)) for id_, message_id in rows]
            for id_, message_id in rows:
                if kept.get(id_) != message_id:
                    raise PipelineError(
                        f"the outbox's row {id_} has an id the archive {self.root} already holds for another "
                        f"event (run {manifest['run_id']}; this row's message id is {message_id}): its ids "
                        "started again (the table re-created or moved, its sequence reset), and the archive's "
                        "readers, which tell rows apart by id, would keep one of the two events; archive this "
                        "outbox to an archive of its own (OUTBOX_ARCHIVE_URI); nothing was archived")

    def _rows_within(self, id_ranges: list[list[int]], sql: str, params: list[Any]) -> Iterator[tuple[int, Any]]:
        """(id, message id) of the rows ``sql`` (``ids_in_span_sql``) finds within a run's
        ``[first, last]`` id runs."""
        if not id_ranges:
            return iter(())
        first = min(int(a) for a, _ in id_ranges)
        last = max(int(b) for _, b in id_ranges)
        return within_runs(id_ranges, self._rows_in(sql, params, first, last))

    def _rows_in(self, sql: str, params: list[Any], first: int, last: int) -> Iterator[tuple[int, Any]]:
        """(id, message id) of the rows ``sql`` (``ids_in_span_sql``) finds in ``first..last``,
        read ``CHECK_CHUNK`` ids a statement."""
        for lo, hi in range_chunks([(first, last)], CHECK_CHUNK):
            for id_, message_id in self.store._run("archive check", self._reader(sql, [lo, hi, *params])):
                yield int(id_), message_id

    def _reader(self, sql: str, params: list[Any]) -> Callable[[Any], list[Any]]:
        return lambda cursor: list(self.engine.execute(cursor, sql, params).fetchall())

    def _kept_of(self, manifest: dict[str, Any]) -> dict[int, str] | None:
        """The rows a finished run left in the outbox (id -> message id), as its ``.deleted``
        marker records them; ``{}`` when it deleted every row it archived; None when not known."""
        marker = json.loads(self.fs.read_text(self.fs.uri(MANIFEST_DIR, f"{manifest['run_id']}.deleted")))
        if "kept" in marker:
            return {int(id_): message_id for id_, message_id in marker["kept"]}
        return {} if marker.get("deleted", 0) >= manifest["rows"] else None

    def _candidates(self, statuses: list[int], cutoff: Any) -> Candidates:
        """Count the rows to archive, their id bounds and the id chunks holding a topic that
        may be too long: one short statement (its own transaction) per ``COUNT_CHUNK`` ids of
        the table, never one over the whole backlog, which held back PostgreSQL's vacuum and
        InnoDB's purge on the hot outbox for as long as it ran (docs/pipeline.md, step 2)."""
        first, last = self.store._run("id bounds", self._reader(table_bounds_sql(self.engine), []))[0]
        found = Candidates()
        if first is None:
            return found
        sql = candidates_sql(self.engine, statuses)
        for lo, hi in range_chunks([(int(first), int(last))], COUNT_CHUNK):
            count, low, high, long = self.store._run("count", self._reader(sql, [lo, hi, cutoff]))[0]
            if not count:
                continue
            found.count += int(count)
            found.lo = int(low) if found.lo is None else found.lo
            found.hi = int(high)
            if long:
                found.long_chunks.append((lo, hi))
        return found

    def _check_topic_names(self, statuses: list[int], cutoff: Any, chunks: list[tuple[int, int]]) -> None:
        """Refuse, before staging, a topic whose directory (``topic=<value>``, Spark's
        escapes counted) is longer than a name may be where the archive is (a local path,
        HDFS: ``MAX_NAME_BYTES``): its task would fail on "File name too long", and so
        would every later run (docs/pipeline.md, "Layout"). ``chunks``: the id chunks
        holding a topic that may be too long (``_candidates``), read one at a time."""
        if urlsplit(self.root).scheme.lower() not in NAME_LIMITED_SCHEMES:
            return
        sql = long_topics_sql(self.engine, statuses)
        topics = {topic for lo, hi in chunks for (topic,) in self.store._run(
            "long topics", self._reader(sql, [lo, hi, cutoff]))}
        for topic in sorted(topics):
            if topic_dir_bytes(topic) > MAX_NAME_BYTES:
                raise PipelineError(
                    f"the topic {topic!r} makes an archive directory name (topic=<topic>, Spark's %XX escapes "
                    f"included) of {topic_dir_bytes(topic)} bytes, and a file or directory name holds at most "
                    f"{MAX_NAME_BYTES} on {self.root}: archive to an object store (s3a://...), or move that "
                    "topic's rows out of the outbox; nothing was archived")

    def _stage(self, staging: str, run_id: str, statuses: list[int], cutoff: Any, lo: int, hi: int) -> Written:
        options = {"url": self.store.url, "table": self.engine.table_name, "schema": self.engine.schema or "",
                   "statuses": ",".join(map(str, statuses)), "processed_before": encode_native(cutoff),
                   "min_id": str(lo), "max_id": str(hi), "partitions": str(self.partitions),
                   "split": "id",  # split=topic: fewer files, more database work (docs/pipeline.md, "Layout")
                   **self.source_options}
        return self.writer.write(self.spark, options, staging, run_id)

    def _verify(self, written: Written, staging: str, lo: int, hi: int) -> tuple[int, list[list[int]], list[str]]:
        """The staged ids, read back, as ``[first, last]`` runs of consecutive ids with
        their row count, and the staged files relative to ``staging`` (docs/pipeline.md,
        step 4): an id staged twice or outside ``lo..hi`` fails the run."""
        try:
            rows, ranges, files = written.ids()
        except ValueError as exc:
            raise PipelineError(f"staged archive {staging} {exc}; nothing was committed") from None
        if ranges and (ranges[0][0] < lo or ranges[-1][1] > hi):
            raise PipelineError(f"staged archive {staging} holds ids outside {lo}..{hi}; nothing was committed")
        return rows, ranges, files

    def _check_visible(self, run_id: str, staging: str, files: list[str]) -> None:
        """Refuse to commit files the driver does not see in the staging directory: a
        plain path on a cluster whose executors wrote to disks of their own. Committed,
        the run could never be published, and every later run would fail on it
        (docs/pipeline.md, step 5)."""
        there = set(self.fs.list_files(staging))
        missing = [f for f in files if f not in there]
        if missing:
            raise PipelineError(
                f"run {run_id}: {len(missing)} of the {len(files)} file(s) the tasks wrote (e.g. {missing[0]}) are "
                f"not in {staging} as the driver sees it: the executors wrote to disks of their own; on a "
                "cluster use a shared filesystem or an object store (hdfs://, s3a://...) that every node "
                "sees at that location (or the staging was removed under this run: the archive's files "
                "changed by hand, or by a run that did not take its lock); nothing was committed")

    # -- finishing and recovery ----------------------------------------------------------------
    def _finish(self, manifest: dict[str, Any], *, kept_known: bool = True) -> int:
        """Publish, delete and mark a committed run finished. ``kept_known`` False: the run is
        finished on an outbox where no row at its ids was found (``_check_own_run``), perhaps
        not its own, so its marker records no kept rows (``_kept_of``: not known, its ids are
        not checked); recorded as none kept, the run's own outbox was refused for good
        at its next run, its rows of that run taken for other events (found in review)."""
        self._still_locked(f"finishing run {manifest['run_id']}")
        self._publish(manifest)
        # Every archived row on disk before the first row leaves the outbox: the published
        # files, the manifest, and the directory entries the renames made (docs/pipeline.md,
        # "Durability").
        run_id = manifest["run_id"]
        self.fs.sync([*(self.fs.uri(rel) for rel in manifest["files"]), self.fs.uri(MANIFEST_DIR, f"{run_id}.json")])
        deleted = self._delete(manifest)
        self.on_step("deleted")
        # The rows it left (changed after they were read), for a later run's _check_ids.
        marker: dict[str, Any] = {"run_id": run_id, "deleted": deleted, "at": datetime.now(UTC).isoformat()}
        if kept_known:
            marker["kept"] = ([[id_, message_id] for id_, message_id in self._rows_within(
                manifest["id_ranges"], ids_in_span_sql(self.engine), [])] if deleted < manifest["rows"] else [])
        self.fs.write_text(self.fs.uri(MANIFEST_DIR, f"{run_id}.deleted"), json.dumps(marker))
        self._index(run_summary(manifest))
        self.progress(f"run {run_id}: deleted {deleted} archived row(s) from the outbox")
        return deleted

    def _publish(self, manifest: dict[str, Any]) -> None:
        """Move a committed run's files from staging into the archive tree. Each move
        is skipped when already done, so a crash half-way is finished by the next run.
        On an object store a rename is a copy and then a delete: a run stopped between
        the two left the file in both places, and the staged one is then only removed
        (the archive's copy is the run's own file when it has the staged file's length:
        the names carry the write's unique id)."""
        run_id = manifest["run_id"]
        staging = self.fs.uri(STAGING_DIR, run_id)
        for i, rel in enumerate(manifest["files"]):
            src, dst = f"{staging}/{rel}", self.fs.uri(rel)
            if self.fs.exists(src):
                if self.fs.exists(dst):
                    if self.fs.length(dst) != self.fs.length(src):
                        raise PipelineError(f"run {run_id}: {dst} already exists; the archive was changed by hand")
                    self.fs.delete(src, recursive=False)  # copied by a publish cut short before its delete
                elif not self.fs.rename(src, dst):
                    raise PipelineError(f"run {run_id}: could not move {src} to {dst}")
            elif not self.fs.exists(dst):
                raise PipelineError(f"run {run_id}: committed file {rel} is missing from the archive")
            if i == 0:
                self.on_step("published-one")
        self.fs.delete(staging)
        self.on_step("published")

    def _delete(self, manifest: dict[str, Any]) -> int:
        """Delete the committed ids in chunks of consecutive ids: only rows still in an
        archived status and processed before the run's cut-off (so never a row that
        changed after it was read). The first chunk alone, then the rest on up to
        ``delete_connections`` connections at once where the engine has concurrent
        writers: the chunks are disjoint id ranges, so they never wait for each other
        (docs/pipeline.md, step 7)."""
        engine = self.engine
        cutoff = decode_native(manifest["cutoff_native"])
        chunks = list(delete_groups(manifest["id_ranges"], self.delete_chunk))
        if not chunks:
            return 0
        statuses = manifest["statuses"]
        total = self._delete_chunks(chunks[:1], statuses, cutoff, close=False)
        self.on_step("deleted-chunk")
        rest = chunks[1:]
        lanes = min(self.delete_connections if engine.concurrent_writes else 1, len(rest))
        if lanes <= 1:
            return total + self._delete_chunks(rest, statuses, cutoff, close=False)
        with ThreadPoolExecutor(lanes, thread_name_prefix="outbox-archive-delete") as pool:
            done = [pool.submit(self._delete_chunks, rest[lane::lanes], statuses, cutoff, close=True)
                    for lane in range(lanes)]
            return total + sum(future.result() for future in done)

    def _delete_chunks(self, chunks: Sequence[list[tuple[int, int]]], statuses: list[int], cutoff: Any, *,
                       close: bool) -> int:
        """Delete ``chunks`` (groups of id ranges: ``delete_groups``), one transaction each, on
        this thread's connection (closed at the end when ``close``: a lane's thread is not reused)."""
        engine, total = self.engine, 0
        try:
            for group in chunks:
                sql = delete_sql(engine, statuses, len(group))
                params = [bound for lo_hi in group for bound in lo_hi] + [cutoff]
                deleted = self.store._run("archive delete",  # the lambda runs at once, inside this iteration
                                          lambda c: engine.execute(c, sql, params).rowcount)  # noqa: B023
                total += max(deleted, 0)
        finally:
            if close:
                self.store.close()
        return total

    def recover(self) -> list[str]:
        """Finish committed runs that did not finish; drop staging nobody committed, and staging a
        finished run has again (a task attempt that outlived its run wrote there)."""
        names = self.fs.list_names(self.fs.uri(MANIFEST_DIR))
        committed = set(committed_run_ids(names))
        finished = finished_run_ids(names)
        recovered = []
        database = database_of(self.store.url)
        for run_id in sorted(committed - finished):
            manifest = read_manifest(self.fs, run_id)
            if manifest.get("table") != self.engine.table_name or manifest.get("schema") != self.engine.schema:
                raise PipelineError(f"the archive {self.root} has an unfinished run {run_id} of table "
                                    f"{manifest.get('table')!r}; finish it by archiving that table first")
            # (A manifest written before "database" was recorded is taken as this database's.)
            kept_known = True
            if manifest.get("database", database) != database:
                kept_known = self._check_own_run(manifest, database)
            self.progress(f"run {run_id}: committed earlier but not finished; finishing it")
            self._finish(manifest, kept_known=kept_known)
            recovered.append(run_id)
        for run_id in self.fs.list_names(self.fs.uri(STAGING_DIR)):
            if run_id not in committed:
                self.progress(f"run {run_id}: never committed; removing its staged files")
                self.fs.delete(self.fs.uri(STAGING_DIR, run_id))
            elif run_id in finished:  # made again by a task attempt that ran on after its run
                self.progress(f"run {run_id}: finished earlier; removing the files a task attempt left in its "
                              "staging after it")
                self.fs.delete(self.fs.uri(STAGING_DIR, run_id))
        return recovered


def _no_archive(root: str, found_root: bool) -> PipelineError:
    """What a job says when ``root`` is no archive: the directory is missing, or it has no ``_manifest/``."""
    if not found_root:
        return PipelineError(f"no archive at {root}: the directory does not exist")
    return PipelineError(f"no archive at {root}: no {MANIFEST_DIR}/ directory (not written by "
                         "`outbox pipeline archive`)")


def _archive_names(fs: ArchiveFS, root: str) -> list[str]:
    """The listing of the archive's ``_manifest/``; a ``PipelineError`` naming the location when
    it is no archive (``_no_archive``)."""
    if not fs.exists(root):
        raise _no_archive(root, False)
    names = fs.list_names(fs.uri(MANIFEST_DIR))
    if not names and not fs.exists(fs.uri(MANIFEST_DIR)):
        raise _no_archive(root, True)
    return names


def check_local_archive(location: str) -> None:
    """``check_archive`` for a local directory, without Spark: a command checks before it starts
    Spark, whose JVM writes its start-up lines to stderr ahead of any error (docs/pipeline.md,
    "Errors"). Any other location is checked once Spark runs."""
    root = archive_uri(location)
    path = local_path(root)
    if path is not None and not (path / MANIFEST_DIR).is_dir():
        raise _no_archive(root, path.is_dir())


def check_archive(spark: Any, location: str) -> None:
    """Raise ``read_archive``'s ``PipelineError`` when ``location`` is no archive, reading
    nothing but the listing: a job checks its archive before it reads anything else."""
    root = archive_uri(location)
    _archive_names(ArchiveFS(spark, root), root)


def read_archive(spark: Any, location: str) -> Any:
    """The archive as a DataFrame: committed runs only (files still in staging
    included when a run committed but was not published yet), one row per outbox id
    (when a row was archived twice, e.g. dead, requeued and archived again when done,
    the later copy wins: the later ``processed_at``, then the later run by ``run_order``)."""
    return archive_frame(spark, location)[0]


def archive_frame(spark: Any, location: str) -> tuple[Any, bool]:
    """``read_archive``'s DataFrame, and whether it had to pick one row per id. It does
    only when some id can be there twice: two committed runs whose id runs overlap, or a
    committed run still in staging (a crash mid-publish, where a rename that copies, as
    on object stores, can leave a file in both places). Otherwise every id is in one
    file of one run (each run's verify checked its ids are distinct), and the archive is
    read as is, with no shuffle of every row by id (docs/pipeline.md, "Guarantees")."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    root = archive_uri(location)
    fs = ArchiveFS(spark, root)
    names = _archive_names(fs, root)
    runs, _ = run_index(fs, names)  # a reader does not hold the lock: it never writes the index
    # (base, what to read): the archive tree, and of each committed run still in staging (a
    # crash mid-publish) its committed files only: a task attempt that failed, or ran on
    # after its run had finished, may have left finished files of its own beside them.
    paths: list[tuple[str, list[str]]] = []
    if [f for f in fs.list_files(root, prune="_") if f.endswith(".parquet") and not f.startswith("_")]:
        paths.append((root, [root]))
    staged = set(fs.list_names(fs.uri(STAGING_DIR)))
    for run in runs:
        if run["run_id"] in staged:
            staging = fs.uri(STAGING_DIR, run["run_id"])
            there = set(fs.list_files(staging))
            committed = [f"{staging}/{rel}" for rel in read_manifest(fs, run["run_id"])["files"] if rel in there]
            if committed:
                paths.append((staging, committed))
    frames = [spark.read.schema(ARCHIVE_SCHEMA_DDL).option("basePath", base).parquet(*files) for base, files in paths]
    if not frames:
        return spark.createDataFrame([], ARCHIVE_SCHEMA_DDL), False
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    if len(paths) == 1 and paths[0][0] == root and not runs_overlap(fs, runs):
        return frame, False
    # One row per id is kept; two *events* under one id (two outboxes' runs, or an outbox
    # whose ids started again, archived before the archive refused that) would lose one.
    clash = (frame.groupBy("id").agg(F.countDistinct("message_id").alias("_events")).where("_events > 1")
             .select("id").limit(1).collect())
    if clash:
        raise PipelineError(f"the archive {root} holds two events under id {clash[0]['id']} (two outboxes' runs, or "
                            "an outbox whose ids started again): its readers tell rows apart by id and would drop "
                            "one; move each outbox's runs (their _manifest/<run>.json and files) to an archive of "
                            "its own")
    # The newest copy by the database's clock, never the driver host's (docs/pipeline.md, "Guarantees").
    order = spark.createDataFrame(list(run_order(runs).items()), "archive_run STRING, _run_order INT")
    latest = Window.partitionBy("id").orderBy(F.col("processed_at").desc_nulls_last(),
                                              F.col("_run_order").desc_nulls_last(), F.col("archive_run").desc())
    return (frame.join(F.broadcast(order), "archive_run", "left").withColumn("_n", F.row_number().over(latest))
            .where("_n = 1").drop("_n", "_run_order").select(*frame.columns)), True


def runs_overlap(fs: ArchiveFS, runs: Sequence[dict[str, Any]]) -> bool:
    """Whether two committed runs archived one id. Only runs whose id spans (the index's
    min and max) overlap are looked at, two manifests at a time, each cut to the span the
    two share (docs/pipeline.md, "The manifest index")."""
    spans = sorted((run["min_id"], run["max_id"], run["run_id"]) for run in runs if run["min_id"] is not None)
    for n, (_, a_max, a_id) in enumerate(spans):
        later = list(takewhile(lambda b: b[0] <= a_max, islice(spans, n + 1, None)))  # noqa: B023 - used at once
        if not later:
            continue
        a_ranges = clipped(read_manifest(fs, a_id)["id_ranges"], later[0][0], a_max)
        for b_min, b_max, b_id in later:
            ours = clipped(a_ranges, b_min, b_max)
            if ours and ranges_meet(ours, clipped(read_manifest(fs, b_id)["id_ranges"], b_min, a_max)):
                return True
    return False


def clipped(id_ranges: Sequence[Sequence[int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The ``[first, last]`` runs cut to ``lo..hi``, sorted."""
    return sorted((max(int(a), lo), min(int(b), hi)) for a, b in id_ranges if int(b) >= lo and int(a) <= hi)


def ranges_meet(ours: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of ``[first, last]`` runs share an id."""
    i = j = 0
    while i < len(ours) and j < len(theirs):
        if ours[i][1] >= theirs[j][0] and theirs[j][1] >= ours[i][0]:
            return True
        if ours[i][1] < theirs[j][1]:
            i += 1
        else:
            j += 1
    return False


def run_order(runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Each committed run's place in time, 0 the oldest: by its cut-off (the database's
    clock), the run id (the driver host's clock) breaking ties only. A run id alone put a
    run whose host clock was behind before an earlier one (found in review). ``runs``:
    manifests, or their summaries (``run_summary``)."""
    def key(manifest: dict[str, Any]) -> tuple[datetime, str]:
        cutoff = datetime.fromisoformat(manifest["cutoff"])
        return (cutoff if cutoff.tzinfo else cutoff.replace(tzinfo=UTC)), manifest["run_id"]
    return {m["run_id"]: n for n, m in enumerate(sorted(runs, key=key))}
