"""``outbox pipeline replay``: order per aggregate, idempotence across re-runs and
crashes, filters, --dry-run, another database as the target, bad arguments."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import pytest
from engine_support import drop_table
from pipeline_support import DAY_MS, Row, invoke, seed
from services import POSTGRES_URL, require

from outbox.pipeline.archive import Archiver
from outbox.pipeline.common import PipelineError
from outbox.pipeline.replay import REPLAY_HEADER, replay_message_id, run_replay
from outbox.storage.store import OutboxStore

pytestmark = pytest.mark.timeout(600)


def history() -> list[Row]:
    """Six aggregates on two topics, their events interleaved by id."""
    rows = []
    for i in range(36):
        agg = f"a{i % 6}"
        topic = "orders.created" if i % 6 < 4 else "payments.settled"
        rows.append(Row(topic, agg, age_ms=9 * DAY_MS - i * 60_000, latency_ms=100,
                        aggregate_type="order" if i % 6 < 4 else "payment"))
    return rows


def archived(spark: Any, store: OutboxStore, tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    """Seed and archive ``history()``; return the archive and each aggregate's
    original message ids in their order."""
    rows = history()
    seed(store, rows)
    with store.transaction() as c:
        original = store.engine.execute(c, f"SELECT aggregate_id, message_id FROM {store.engine.table} "
                                        "ORDER BY id").fetchall()
    per_aggregate: dict[str, list[str]] = {}
    for agg, mid in original:
        per_aggregate.setdefault(agg, []).append(mid)
    root = tmp_path / "archive"
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == len(rows)
    return root, per_aggregate


@pytest.fixture(scope="module")
def history_archive(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    """``archived`` once for the module, from a SQLite outbox of its own: the archive
    the SQLite cases below replay from, each into its own empty table (replay only
    reads an archive)."""
    tmp = tmp_path_factory.mktemp("history")
    source = OutboxStore(f"sqlite:///{tmp / 'source.db'}", table="outbox")
    source.migrate()
    try:
        return archived(spark, source, tmp)
    finally:
        source.close()


def replayed(store: OutboxStore) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Rows now in the table, per aggregate, in id order: (message_id, headers)."""
    with store.transaction() as c:
        rows = store.engine.execute(c, f"SELECT aggregate_id, message_id, {store.engine.headers_column()} "
                                    f"FROM {store.engine.table} ORDER BY id").fetchall()
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for agg, mid, headers in rows:
        out.setdefault(agg, []).append((mid, json.loads(headers) if isinstance(headers, str) else headers))
    return out


def assert_replayed_in_order(store: OutboxStore, per_aggregate: dict[str, list[str]],
                             aggregates: set[str] | None = None) -> None:
    got = replayed(store)
    for agg, originals in per_aggregate.items():
        if aggregates is not None and agg not in aggregates:
            assert agg not in got
            continue
        assert [mid for mid, _ in got[agg]] == [replay_message_id(m) for m in originals]
        assert [h[REPLAY_HEADER] for _, h in got[agg]] == originals


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql", "mssql"])
def test_replay_in_order_and_once(spark: Any, store: OutboxStore, tmp_path: Path,
                                  request: pytest.FixtureRequest) -> None:
    """Into the outbox the archive was made from, empty once archived (SQLite's: the
    module's ``history_archive``, the same ``archived`` of a SQLite outbox, replayed into
    an empty table)."""
    root, per_aggregate = (request.getfixturevalue("history_archive") if store.engine.name == "sqlite"
                           else archived(spark, store, tmp_path))
    # a crash half-way: every task fails after its first committed batch of 2 ...
    with pytest.raises(Exception):  # noqa: B017 - Spark wraps the crash in its own error types
        run_replay(spark, archive=str(root), target=store, batch=2, partitions=3, crash_after_batches=1)
    partial = replayed(store)
    assert 0 < sum(len(v) for v in partial.values()) < 36
    for agg, got in partial.items():  # ... leaves a prefix of each aggregate
        assert [m for m, _ in got] == [replay_message_id(m) for m in per_aggregate[agg]][:len(got)]
    # the re-run completes it, in order, nothing twice
    result = run_replay(spark, archive=str(root), target=store, batch=2, partitions=3)
    assert result["events"] == 36
    # (tasks still running when the failed job was cancelled may have committed a
    # batch after the snapshot: at least the snapshot was already present)
    assert result["written"] + result["already_present"] == 36
    assert result["already_present"] >= sum(len(v) for v in partial.values())
    assert_replayed_in_order(store, per_aggregate)
    again = run_replay(spark, archive=str(root), target=store, batch=5, partitions=2)
    assert (again["written"], again["already_present"]) == (0, 36)
    assert sum(len(v) for v in replayed(store).values()) == 36


@pytest.mark.parametrize("kind", ["sqlite"])
def test_replay_filters_and_dry_run(spark: Any, store: OutboxStore, url: str,
                                   history_archive: tuple[Path, dict[str, list[str]]]) -> None:
    root, per_aggregate = history_archive
    env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": store.engine.table_name}

    out = invoke(["pipeline", "replay", "--from", str(root), "--dry-run"], env)
    assert out.exit_code == 0, out.output
    assert "would replay 36 event(s); nothing was changed" in out.output
    assert "  orders.created: 24\n  payments.settled: 12\n" in out.output  # per topic, by topic
    # the sample: the five lowest archived ids, in order (the source's ids are 1..36, row i
    # of history() is id i + 1, of aggregate a{i % 6})
    in_order = [per_aggregate[f"a{i % 6}"][i // 6] for i in range(36)]
    want = [f"  sample: id={i + 1} {'orders.created' if i % 6 < 4 else 'payments.settled'} "
            f"{'order' if i % 6 < 4 else 'payment'}/a{i % 6} {in_order[i]} -> {replay_message_id(in_order[i])}"
            for i in range(5)]
    assert [line for line in out.output.splitlines() if "sample: " in line] == want
    assert replayed(store) == {}

    out = invoke(["pipeline", "replay", "--from", str(root), "--aggregate-type", "order", "--aggregate-id", "a1",
                  "--json"], env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output.strip().splitlines()[-1])["written"] == 6
    assert_replayed_in_order(store, per_aggregate, {"a1"})

    out = invoke(["pipeline", "replay", "--from", str(root), "--topic", "payments.settled", "--json"], env)
    assert json.loads(out.output.strip().splitlines()[-1])["written"] == 12
    assert_replayed_in_order(store, per_aggregate, {"a1", "a4", "a5"})

    # a time window: created between 9 days ago + 30 min and 9 days ago + 10 min
    got = run_replay(spark, archive=str(root), target=store, dry_run=True,
                     since=_ago(9 * DAY_MS - 10 * 60_000 - 30_000), until=_ago(9 * DAY_MS - 20 * 60_000 - 30_000))
    assert got["events"] == 10 and got["written"] == 0


def _ago(ms: int) -> Any:
    from datetime import datetime
    return datetime.now(UTC) - timedelta(milliseconds=ms)


def test_replay_into_another_database(history_archive: tuple[Path, dict[str, list[str]]]) -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    root, per_aggregate = history_archive
    target = OutboxStore(POSTGRES_URL, table=f"outbox_r{uuid.uuid4().hex[:10]}")
    target.migrate()
    try:
        env = {"OUTBOX_DATABASE_URL": "sqlite:///unused.db", "OUTBOX_TABLE": target.engine.table_name}
        out = invoke(["pipeline", "replay", "--from", str(root), "--to-url", POSTGRES_URL], env)
        assert out.exit_code == 0, out.output
        assert "36 written" in out.output
        assert_replayed_in_order(target, per_aggregate)
    finally:
        drop_table(target)
        target.close()


@pytest.mark.parametrize("kind", ["sqlite"])
def test_replay_refuses_a_bad_row_before_writing(spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """An archived row ``enqueue`` would refuse (here an empty topic, set behind the
    write side's back) fails the replay with the row and the problem named; its batch
    writes nothing."""
    ids = seed(store, history()[:6])
    with store.transaction() as c:
        store.engine.execute(c, f"UPDATE {store.engine.table} SET topic = ' ' WHERE id = ?", [ids[3]])
        bad_message_id = store.engine.execute(c, f"SELECT message_id FROM {store.engine.table} WHERE id = ?",
                                              [ids[3]]).fetchone()[0]
    root = tmp_path / "archive"
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 6
    with pytest.raises(Exception, match=rf"archived event id {ids[3]} \(message_id '{bad_message_id}'\) cannot be "
                                        "replayed: topic must not be empty"):
        run_replay(spark, archive=str(root), target=store, batch=100, partitions=1)
    assert replayed(store) == {}


@pytest.mark.parametrize("kind", ["sqlite"])
@pytest.mark.parametrize(("extra", "message"), [
    (["--topic", "nope"], "unknown topic 'nope': the archive holds orders.created, payments.settled"),
    (["--since", "yesterday"], "--since: 'yesterday' is neither a duration"),
    (["--since", "1d", "--until", "2d"], "must be before --until"),
    # a dry run refuses the --to-url the real run would (found in review: it said it would replay)
    (["--dry-run", "--to-url", "postgress://x@h/db"], "--to-url='postgress://x@h/db': unsupported database"),
])
def test_replay_bad_arguments(spark: Any, store: OutboxStore, url: str, extra: list[str], message: str,
                              history_archive: tuple[Path, dict[str, list[str]]]) -> None:
    root, _ = history_archive
    out = invoke(["pipeline", "replay", "--from", str(root), *extra],
                 {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": store.engine.table_name})
    assert out.exit_code == 1
    assert out.output.strip().splitlines()[-1].startswith("error: ") and message in out.output, out.output
    assert replayed(store) == {}


@pytest.mark.parametrize("kind", ["sqlite"])
def test_replay_from_a_missing_archive(spark: Any, store: OutboxStore, url: str, tmp_path: Path) -> None:
    out = invoke(["pipeline", "replay", "--from", str(tmp_path / "nothing-here")],
                 {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": store.engine.table_name})
    assert out.exit_code == 1 and "no archive at" in out.output and "does not exist" in out.output
    (tmp_path / "plain").mkdir()
    out = invoke(["pipeline", "replay", "--from", str(tmp_path / "plain")],
                 {"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": store.engine.table_name})
    assert out.exit_code == 1 and "not written by `outbox pipeline archive`" in out.output


def _archive_again_as_old_done(spark: Any, store: OutboxStore, root: Path) -> int:
    """Mark every row of the table delivered 8 days ago and archive it into ``root``."""
    with store.transaction() as c:
        store.engine.execute(c, f"UPDATE {store.engine.table} SET status = 2, created_at = {store.engine.now_plus_ms()}, "
                             f"processed_at = {store.engine.now_plus_ms()}", [-8 * DAY_MS, -8 * DAY_MS + 100])
    return Archiver(spark, store, str(root)).run(timedelta(days=7)).archived


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_message_id_archived_under_two_ids_is_replayed_once(spark: Any, store: OutboxStore,
                                                              tmp_path: Path) -> None:
    """A message id enqueued again once its first row had left the table (an idempotency
    key reused after the retention period) is in the archive under two ids. Replay enqueues
    it once, as ``enqueue`` stores one row per message id; the replay used to write both
    in one batch and fail on the unique message id, every run."""
    root = tmp_path / "archive"
    first = seed(store, history()[:1])[0]
    with store.transaction() as c:
        message_id = store.engine.execute(c, f"SELECT message_id FROM {store.engine.table} WHERE id = ?",
                                          [first]).fetchone()[0]
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1
    again = seed(store, history()[:1])[0]
    with store.transaction() as c:
        store.engine.execute(c, f"UPDATE {store.engine.table} SET message_id = ? WHERE id = ?", [message_id, again])
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 1

    result = run_replay(spark, archive=str(root), target=store, partitions=1)
    assert (result["events"], result["written"], result["already_present"]) == (2, 1, 1)
    got = replayed(store)
    assert [(mid, h[REPLAY_HEADER]) for mid, h in got["a0"]] == [(replay_message_id(message_id), message_id)]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_replaying_an_archive_that_holds_earlier_replays_enqueues_each_event_once(
        spark: Any, store: OutboxStore, tmp_path: Path) -> None:
    """The copies a replay enqueued are delivered and archived like any row, so a later
    replay over the same period reads each event twice: the original and its copy. Each
    event is enqueued once, under the copy's message id (consumers that saw the copy
    drop it again), with the original message id in its replay header; the copy used to
    get a copy of its own, uuid5 of the copy's message id, that no consumer had seen."""
    root = tmp_path / "archive"
    seed(store, history()[:12])
    with store.transaction() as c:
        originals = [r[0] for r in store.engine.execute(
            c, f"SELECT message_id FROM {store.engine.table} ORDER BY id").fetchall()]
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 12
    assert run_replay(spark, archive=str(root), target=store, partitions=2)["written"] == 12
    assert _archive_again_as_old_done(spark, store, root) == 12  # the copies, delivered and archived

    result = run_replay(spark, archive=str(root), target=store, partitions=2)
    assert (result["events"], result["written"]) == (24, 12)
    got = replayed(store)
    by_original = {h[REPLAY_HEADER]: mid for rows in got.values() for mid, h in rows}
    assert sum(len(rows) for rows in got.values()) == 12
    assert by_original == {m: replay_message_id(m) for m in originals}
    per_aggregate: dict[str, list[str]] = {}
    for mid, agg in zip(originals, [r.aggregate_id for r in history()[:12]]):
        per_aggregate.setdefault(agg, []).append(mid)
    assert_replayed_in_order(store, per_aggregate)  # still each aggregate's original order


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_wider_replay_after_a_narrower_one_is_refused_before_writing(spark: Any, store: OutboxStore,
                                                                     tmp_path: Path) -> None:
    """An aggregate's events e0 created, e1 paid, e2 created, e3 paid. A replay of
    ``--topic orders.paid`` wrote e1 and e3; a later replay of everything used to append e0
    and e2 after them (e1, e3, e0, e2: paid before created), exit 0 (found in review). The
    stored copies of a selection must come before its missing events, per aggregate, or
    the run stops before writing anything, naming the aggregate; a run that selects only
    what is missing still goes, after what is there."""
    topics = ["orders.created", "orders.paid", "orders.created", "orders.paid"]
    ids = seed(store, [Row(t, "X", age_ms=9 * DAY_MS - i * 1000) for i, t in enumerate(topics)])
    with store.transaction() as c:
        originals = [r[0] for r in store.engine.execute(
            c, f"SELECT message_id FROM {store.engine.table} ORDER BY id").fetchall()]
    root = tmp_path / "archive"
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 4
    assert run_replay(spark, archive=str(root), target=store, topic="orders.paid")["written"] == 2
    with pytest.raises(PipelineError, match=(
            f"replay would write events after later ones of their aggregate: the target holds the copy of "
            f"order/X's archived id {ids[1]} but not of its earlier archived id {ids[0]} .*nothing was written")):
        run_replay(spark, archive=str(root), target=store, partitions=2)
    assert [h[REPLAY_HEADER] for _, h in replayed(store)["X"]] == [originals[1], originals[3]]
    # the rest, asked for as such: written after what is there, in their own order
    assert run_replay(spark, archive=str(root), target=store, topic="orders.created")["written"] == 2
    assert [h[REPLAY_HEADER] for _, h in replayed(store)["X"]] == [originals[i] for i in (1, 3, 0, 2)]
    # everything again: all stored, nothing to write, nothing refused
    again = run_replay(spark, archive=str(root), target=store)
    assert (again["written"], again["already_present"]) == (0, 4)


def test_a_wider_replay_is_refused_when_the_aggregate_id_is_shared_by_two_types(spark: Any, store: OutboxStore,
                                                                                tmp_path: Path) -> None:
    """Order is per aggregate_id (CONTRACT.md), whatever the type: e0 order, e1 payment, e2
    order, all of aggregate id 42. A replay of ``--aggregate-type order`` wrote e0 and e2;
    the check keyed by (type, id) then let a replay of everything append e1 after e2
    (found in review)."""
    ids = seed(store, [Row("orders.created", "42", age_ms=9 * DAY_MS, aggregate_type="order"),
                       Row("payments.taken", "42", age_ms=9 * DAY_MS - 1000, aggregate_type="payment"),
                       Row("orders.paid", "42", age_ms=9 * DAY_MS - 2000, aggregate_type="order")])
    root = tmp_path / "archive"
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 3
    assert run_replay(spark, archive=str(root), target=store, aggregate_type="order")["written"] == 2
    with pytest.raises(PipelineError, match=f"the target holds the copy of order/42's archived id {ids[2]} but not "
                                            f"of its earlier archived id {ids[1]} .*nothing was written"):
        run_replay(spark, archive=str(root), target=store, partitions=2)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_a_batch_another_replay_stored_after_its_check_is_written_again_and_skips_them(
        store: OutboxStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replays of the same events at once (a retried cron job and the original), or one
    message id archived under two ids of two aggregates (two tasks): each task's "already
    stored?" check may run before the other commits, and its write then fails on the unique
    message id. The default ``local[*]`` master never retries a task (found in review), so
    the batch is run once more in the task: its check now sees the rows, and skips them.
    Here the first check answers as if the other task had not committed yet."""
    import pyarrow as pa

    from outbox.pipeline import replay

    originals = [str(uuid.uuid4()) for _ in range(3)]
    rows = pa.RecordBatch.from_pydict({
        "id": [1, 2, 3], "message_id": originals, "topic": ["t"] * 3, "aggregate_type": ["a"] * 3,
        "aggregate_id": ["x"] * 3, "partition_key": [None] * 3, "payload": ['{"n": 1}'] * 3,
        "headers": ["{}"] * 3, "trace_id": [None] * 3})
    task = replay._enqueue_partition(store.url, store.engine.table_name, store.engine.schema, 500, 1_000_000, None)
    assert next(task(iter([rows]))).to_pydict() == {"seen": [3], "written": [3]}  # the other replay's

    real = replay.EXISTING.get(store.engine.name, replay._existing_in_list)
    answers: list[int] = []

    def first_too_early(engine: Any, cursor: Any, ids: list[str]) -> set[str]:
        answers.append(len(answers))
        return set() if len(answers) == 1 else real(engine, cursor, ids)
    monkeypatch.setitem(replay.EXISTING, store.engine.name, first_too_early)
    assert next(task(iter([rows]))).to_pydict() == {"seen": [3], "written": [0]}
    assert len(answers) == 2
    assert [m for m, _ in replayed(store)["x"]] == [replay_message_id(m) for m in originals]


@pytest.mark.parametrize("kind", ["sqlite"])
def test_a_rerun_over_a_mostly_stored_selection_completes_it_in_order(spark: Any, store: OutboxStore,
                                                                    make_store: Any, tmp_path: Path) -> None:
    """A run that crashed after most of its selection (aggregate X's e0, all of Y's), then
    the re-run, over an archive that also holds a copy of e0 (an earlier replay's, delivered
    and archived) after e1 and e2. The copy is e0 again, the same new message id: it does not
    count as a stored event after X's missing e1 (the order check's own rule), so the re-run
    is not refused; it writes e1 and e2 after e0, and nothing twice."""
    rows = [Row("orders.created", "X", age_ms=9 * DAY_MS)]
    rows += [Row("orders.created", "Y", age_ms=9 * DAY_MS - i * 1000) for i in range(1, 7)]
    rows += [Row("orders.paid", "X", age_ms=9 * DAY_MS - i * 1000) for i in range(7, 10)]
    ids = seed(store, rows)
    with store.transaction() as c:
        originals = [r[0] for r in store.engine.execute(
            c, f"SELECT message_id FROM {store.engine.table} ORDER BY id").fetchall()]
        store.engine.execute(c, f"UPDATE {store.engine.table} SET message_id = ?, headers = ? WHERE id = ?",
                             [replay_message_id(originals[0]), json.dumps({REPLAY_HEADER: originals[0]}), ids[9]])
    root = tmp_path / "archive"
    assert Archiver(spark, store, str(root)).run(timedelta(days=7)).archived == 10
    target = make_store()
    with pytest.raises(Exception):  # noqa: B017 - Spark wraps the crash in its own error types
        run_replay(spark, archive=str(root), target=target, batch=1, partitions=1, crash_after_batches=7)
    assert sum(len(v) for v in replayed(target).values()) == 7

    result = run_replay(spark, archive=str(root), target=target, batch=2, partitions=2)
    assert (result["events"], result["written"], result["already_present"]) == (10, 2, 8)
    assert_replayed_in_order(target, {"X": [originals[i] for i in (0, 7, 8)], "Y": originals[1:7]})


def _check_task(store: OutboxStore) -> Any:
    """The order check's Python task body (what runs in a Spark Python worker) on ``store``."""
    from outbox.pipeline import replay

    return replay._stored_flags(store.url, store.engine.table_name, store.engine.schema)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_order_check_holds_one_batch_of_a_mostly_stored_selection(store: OutboxStore) -> None:
    """A re-run over a selection mostly stored already: the order check's Python task used
    to keep every stored message id of its partition in a set (found in review; ~160 bytes
    an id, so a partition of millions of rows took hundreds of MB in the worker). It now only
    flags each row of a batch stored or not, and its memory does not grow with the partition: fed the first 4,000 rows, then all 16,000 (all but the
    last 100 stored), 200 a record batch, its peak grows by far less than a stored id's worth
    a row."""
    import tracemalloc

    import pyarrow as pa

    from outbox.pipeline import replay

    originals = [str(uuid.uuid4()) for _ in range(16_000)]

    def batches(n: int, columns: tuple[str, ...]) -> Iterator[Any]:
        for start in range(0, n, 200):
            part = range(start, min(start + 200, n))
            cols = {"id": list(part), "message_id": originals[start:part.stop], "topic": ["t"] * len(part),
                    "aggregate_type": ["a"] * len(part), "aggregate_id": [f"x{i % 40}" for i in part],
                    "partition_key": [None] * len(part), "payload": ['{"n": 1}'] * len(part),
                    "headers": ["{}"] * len(part), "trace_id": [None] * len(part)}
            yield pa.RecordBatch.from_pydict({name: cols[name] for name in columns})

    write = replay._enqueue_partition(store.url, store.engine.table_name, store.engine.schema, 1000, 1_000_000, None)
    assert next(write(batches(16_000 - 100, tuple(replay.ORDER_CHECK_COLUMNS) + (
        "topic", "partition_key", "payload", "trace_id")))).to_pydict() == {"seen": [15_900], "written": [15_900]}

    def peak(n: int) -> int:
        tracemalloc.start()
        try:
            for _ in _check_task(store)(batches(n, replay.ORDER_CHECK_COLUMNS)):
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    peak(400)  # the first run's imports and statement caches
    small, large = peak(4_000), peak(16_000)
    assert large - small < 12_000 * 40, (small, large)


@pytest.mark.parametrize("kind", ["sqlite"])
def test_the_order_check_runs_no_more_tasks_than_partitions(spark: Any, make_store: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           history_archive: tuple[Path, dict[str, list[str]]]) -> None:
    """``--partitions`` bounds the tasks that talk to the target, and so its connections. The
    order check ran one task per split of the archive's files (review diffc): on a cluster,
    every executor core at once asked the target "already stored?", hundreds of connections
    for a replay given --partitions 4. Here the files are read in 512-byte splits."""
    from outbox.pipeline import replay

    root, _ = history_archive
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    real = replay._stored_flags

    def counted(url: str, table: str, schema: str | None) -> Any:
        body, where = real(url, table, schema), str(tasks)

        def run(batches: Iterator[Any]) -> Iterator[Any]:
            import os
            import uuid as uuid_
            open(os.path.join(where, uuid_.uuid4().hex), "w").close()  # a marker per task
            yield from body(batches)
        return run
    monkeypatch.setattr(replay, "_stored_flags", counted)
    spark.conf.set("spark.sql.files.maxPartitionBytes", "512")
    try:
        assert spark.read.parquet(str(root)).rdd.getNumPartitions() > 2
        result = run_replay(spark, archive=str(root), target=make_store(), partitions=2)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert result["written"] == len(history())
    assert 1 <= len(list(tasks.iterdir())) <= 2
