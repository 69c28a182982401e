"""What every pipeline job shares and that needs no Spark: argument parsing, the
archive's column list, id-range arithmetic and the crash-injection hook."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ..core.config import pipeline_options
from ..core.errors import OutboxError


class PipelineError(OutboxError):
    """Bad arguments or an archive in a state a job cannot work with. The CLI prints
    it as one line and exits non-zero; nothing has been changed when it is raised
    before a job's first write."""


#: Spark DDL of the rows the outbox data source yields: the table's columns as archived
#: (``lease_token`` is the relay's internal fencing state and is not history).
SOURCE_SCHEMA_DDL = (
    "id BIGINT, message_id STRING, topic STRING, aggregate_type STRING, aggregate_id STRING, "
    "partition_key STRING, payload STRING, headers STRING, trace_id STRING, status INT, attempts INT, "
    "claimed_at TIMESTAMP, next_retry_at TIMESTAMP, created_at TIMESTAMP, processed_at TIMESTAMP, "
    "last_error STRING"
)

#: The archive's delete, by default (``outbox pipeline archive --delete-chunk`` and
#: ``--delete-connections``; docs/pipeline.md, step 7): ids per DELETE statement, and
#: connections deleting chunks at once where the engine has concurrent writers.
DELETE_CHUNK = 1000
DELETE_CONNECTIONS = 2

#: The archive's files hold the source columns plus the run that archived each row;
#: ``topic`` and ``date`` come from the directory names.
ARCHIVE_SCHEMA_DDL = SOURCE_SCHEMA_DDL + ", archive_run STRING, date STRING"

_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


#: The longest duration: a point that long ago is still a date (``timedelta`` itself raised
#: OverflowError past 999,999,999 days, and ``now -`` it past year 1: found in review).
MAX_DURATION = timedelta(days=100_000)


def parse_duration(text: str, option: str = "duration") -> timedelta:
    """``<n>s|m|h|d`` -> timedelta; anything else, or more than ``MAX_DURATION``, is a
    PipelineError naming the option."""
    match = _DURATION.match(text or "")
    if not match:
        raise PipelineError(f"{option}: {text!r} is not a duration (use <n>s, <n>m, <n>h or <n>d, e.g. 7d)")
    try:
        delta = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    except OverflowError:
        delta = MAX_DURATION * 2
    if delta > MAX_DURATION:
        raise PipelineError(f"{option}: {text!r} is out of range (at most {MAX_DURATION.days}d)")
    return delta


def parse_point_in_time(text: str, option: str, now: datetime) -> datetime:
    """A duration ago (``7d``) or an ISO-8601 date/time (UTC unless it says otherwise)."""
    if _DURATION.match(text or ""):
        return now - parse_duration(text, option)
    try:
        value = datetime.fromisoformat(text.strip())
    except (AttributeError, ValueError):
        raise PipelineError(f"{option}: {text!r} is neither a duration (<n>s|m|h|d) nor an ISO-8601 "
                            "date/time") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def archive_uri(target: str) -> str:
    """A URI Spark and Hadoop understand: ``scheme://...`` unchanged, a plain path
    made absolute as ``file://`` (a driver-local directory; on a cluster use a shared
    filesystem or an object store), not percent-encoded: Hadoop reads a path string as
    it stands, so ``Path.as_uri()``'s ``my%20dir`` would be a directory named so."""
    if not target or not target.strip():
        raise PipelineError("the archive location is empty")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", target) or target.startswith("file:"):
        return target.rstrip("/")
    return "file://" + str(Path(target).expanduser().resolve())


def local_path(uri: str) -> Path | None:
    """The local directory behind a ``file:`` URI, else None."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if uri.startswith("file:"):
        return Path(uri[len("file:"):])
    return None


def fsync_path(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it, as
    renames and new files left them). A descriptor of its own, read-only: fsync flushes
    the inode, whoever wrote it (docs/pipeline.md, "Durability")."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- id ranges ---------------------------------------------------------------------------
#: Ids per statement of the reads that count over the rows to archive (the archive's count of
#: its candidates, ``split=topic``'s rows per topic): a short statement each, never one over
#: the whole backlog (docs/pipeline.md, "A run, step by step", step 2).
COUNT_CHUNK = 1_000_000


def range_chunks(ranges: Sequence[Sequence[int]], chunk: int) -> Iterator[tuple[int, int]]:
    """Split ``[first, last]`` runs of ids into inclusive sub-ranges of at most ``chunk`` ids."""
    for first, last in ranges:
        lo = int(first)
        while lo <= int(last):
            hi = min(int(last), lo + chunk - 1)
            yield lo, hi
            lo = hi + 1


#: The most id ranges one DELETE of the archive names (two parameters each: SQL Server takes
#: at most 2,100 in a statement).
MAX_RANGES_PER_DELETE = 100


def delete_groups(ranges: Sequence[Sequence[int]], chunk: int,
                  most: int = MAX_RANGES_PER_DELETE) -> Iterator[list[tuple[int, int]]]:
    """The archive's deletes: ``range_chunks``'s sub-ranges packed, in id order, into groups of
    at most ``chunk`` ids and ``most`` ranges, one DELETE each. A run whose ids have gaps (rows
    kept, ids a rolled-back insert used) needed one statement per run of ids, a transaction
    each: 500,000 for 10,000,000 rows with 5 % gaps (docs/pipeline.md, step 7)."""
    group: list[tuple[int, int]] = []
    size = 0
    for lo, hi in range_chunks(ranges, chunk):
        if group and (size + hi - lo + 1 > chunk or len(group) >= most):
            yield group
            group, size = [], 0
        group.append((lo, hi))
        size += hi - lo + 1
    if group:
        yield group


#: One piece of a ``split=topic`` task: a topic, whole (``None, None``) or its ids ``first..last``.
Piece = tuple[str, int | None, int | None]


def topic_tasks(groups: Sequence[tuple[str, int, int, int]], count: int) -> list[tuple[int, int, tuple[Piece, ...]]]:
    """The outbox source's ``split=topic``: ``count`` tasks ``(first id, last id, pieces)``
    of about equal rows, each reading whole topics but for at most one topic it starts
    with and one it ends with (docs/pipeline.md, "How the jobs read the outbox", says
    why). ``groups``: (topic, rows, first id, last id) per topic. The topics, in name
    order, fill the tasks one after the other, each task up to its share of the rows
    (``rows / count``); a topic that overflows a task is cut at the id its share
    reaches, estimated from the topic's id span, and goes on in the next task (so at
    most ``topics + count - 1`` pieces). Every row belongs to exactly one piece: a
    topic's pieces cut its id span into disjoint ranges."""
    share = max(1, -(-sum(n for _, n, _, _ in groups) // max(1, count)))
    tasks: list[tuple[int, int, tuple[Piece, ...]]] = []
    pieces: list[Piece] = []
    load, first, last = 0, 0, 0
    for topic, n, lo, hi in sorted(groups):
        start, left = lo, n
        while left > 0:
            if left <= share - load:
                pieces.append((topic, None, None) if start == lo else (topic, start, hi))
                end, load, left = hi, load + left, 0
            else:
                room = share - load
                end = max(start, min(hi - 1, start + (hi - start + 1) * room // left - 1))
                pieces.append((topic, start, end))
                load, left = share, left - room
            first, last = (start, end) if len(pieces) == 1 else (min(first, start), max(last, end))
            start = end + 1
            if load >= share:
                tasks.append((first, last, tuple(pieces)))
                pieces, load = [], 0
    if pieces:
        tasks.append((first, last, tuple(pieces)))
    return tasks


# -- driver-native values ----------------------------------------------------------------
def encode_native(value: Any) -> str:
    """A database value as the driver returned it (a timestamp: ``str`` on SQLite,
    ``datetime`` naive or aware elsewhere), as JSON that ``decode_native`` turns back
    into the very same Python value. Binding that value again compares exactly the
    way the database compared its own value, on every engine, with no per-engine code."""
    if isinstance(value, datetime):
        return json.dumps({"datetime": value.isoformat()})
    if isinstance(value, str):
        return json.dumps({"str": value})
    raise PipelineError(f"cannot carry a {type(value).__name__} database value between processes")


def decode_native(text: str) -> Any:
    data = json.loads(text)
    if "datetime" in data:
        return datetime.fromisoformat(data["datetime"])
    return data["str"]


# -- crash injection -----------------------------------------------------------------------
def crash_hook_from_env() -> Callable[[str], None] | None:
    """OUTBOX_PIPELINE_CRASH_AT (``config.PipelineOptions.crash_at``) as a hook, or None."""
    wanted = pipeline_options().crash_at
    if not wanted:
        return None

    def hook(step: str) -> None:
        if step == wanted:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook
