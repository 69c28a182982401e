"""The pipeline's pure logic (no Spark session): durations, id-range chunks,
driver-native values, replay message ids, and its SQL on SQL Server, parsed with
sqlglot's T-SQL dialect (no SQL Server runs here)."""

from __future__ import annotations

import errno
import os
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from outbox.pipeline.archive import run_order
from outbox.pipeline.common import (
    PipelineError,
    archive_uri,
    decode_native,
    encode_native,
    local_path,
    parse_duration,
    parse_point_in_time,
    range_chunks,
    topic_tasks,
)
from outbox.pipeline.stage import DEFAULT_PARTITION, file_runs, id_runs, merge_runs, partition_value
from outbox.storage.engines.mssql import MssqlEngine


@pytest.mark.parametrize(("text", "want"), [("7d", timedelta(days=7)), ("90m", timedelta(minutes=90)),
                                            ("0s", timedelta(0)), (" 12h ", timedelta(hours=12))])
def test_durations(text: str, want: timedelta) -> None:
    assert parse_duration(text) == want


@pytest.mark.parametrize("text", ["7", "d", "7w", "-1d", "1.5h", "", "7 days"])
def test_bad_durations_name_the_option(text: str) -> None:
    with pytest.raises(PipelineError, match=r"^--older-than: .* is not a duration \(use <n>s"):
        parse_duration(text, "--older-than")


def test_points_in_time() -> None:
    now = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
    assert parse_point_in_time("2d", "--since", now) == now - timedelta(days=2)
    assert parse_point_in_time("2026-11-01", "--since", now) == datetime(2026, 11, 1, tzinfo=UTC)
    assert parse_point_in_time("2026-11-01T10:00+02:00", "--since", now) == datetime(2026, 11, 1, 8,
                                                                                   tzinfo=UTC)
    with pytest.raises(PipelineError, match="--until: 'soon' is neither a duration"):
        parse_point_in_time("soon", "--until", now)


@pytest.mark.parametrize("now_utc", [datetime(2026, 4, 1, 10, 0, tzinfo=UTC),      # Berlin went to CEST on 29 March
                                     datetime(2026, 10, 30, 11, 0, tzinfo=UTC)])   # and back to CET on 25 October
def test_a_cutoff_is_its_age_of_absolute_time_across_a_dst_change(now_utc: datetime) -> None:
    """psycopg gives ``now()`` in the session's time zone: a cut-off of 7 days taken from
    a Europe/Berlin datetime across a DST change is 7 days of absolute time, not 6d23h
    or 7d1h of wall-clock time (the cut-off is computed in UTC)."""
    from zoneinfo import ZoneInfo

    from outbox.pipeline.archive import cutoff_from

    now = now_utc.astimezone(ZoneInfo("Europe/Berlin"))
    cutoff = cutoff_from(now, timedelta(days=7))
    assert cutoff.tzinfo is not None
    assert now.astimezone(UTC) - cutoff.astimezone(UTC) == timedelta(days=7)
    naive = datetime(2026, 4, 1, 10, 0)  # MySQL, SQL Server: naive UTC, unchanged
    assert cutoff_from(naive, timedelta(days=7)) == datetime(2026, 3, 25, 10, 0)


def test_range_chunks_cover_each_id_once() -> None:
    ranges = [[1, 7], [10, 10], [12, 15]]
    chunks = list(range_chunks(ranges, 3))
    assert chunks == [(1, 3), (4, 6), (7, 7), (10, 10), (12, 14), (15, 15)]
    covered = [i for lo, hi in chunks for i in range(lo, hi + 1)]
    assert covered == [i for lo, hi in ranges for i in range(lo, hi + 1)]


def test_the_archives_deletes_pack_the_runs_of_ids_of_a_run_with_gaps() -> None:
    """Every other id archived (rows kept between them): one DELETE (a transaction) per run of
    ids was 1,000 statements for these 1,000 rows (found in review); packed, at most
    ``MAX_RANGES_PER_DELETE`` ranges and ``chunk`` ids a statement, each id once, in order."""
    from outbox.pipeline.common import MAX_RANGES_PER_DELETE, delete_groups

    ranges = [[i, i] for i in range(1, 2001, 2)]
    groups = list(delete_groups(ranges, 1000))
    assert len(groups) == 1000 // MAX_RANGES_PER_DELETE
    assert [r for group in groups for r in group] == [(i, i) for i in range(1, 2001, 2)]
    whole = list(delete_groups([[1, 2500], [2600, 2700]], 1000))  # long runs: chunk ids a statement
    assert whole == [[(1, 1000)], [(1001, 2000)], [(2001, 2500), (2600, 2700)]]
    assert all(sum(hi - lo + 1 for lo, hi in g) <= 1000 and len(g) <= MAX_RANGES_PER_DELETE
               for g in groups + whole)


def edges(ids: list[int]) -> list[tuple[int, int | None, int | None]]:
    """What ``stage.EDGES_SQL`` selects from these ids, computed here by its definition."""
    order = sorted(ids)
    rows = [(i, order[n - 1] if n else None, order[n + 1] if n + 1 < len(order) else None)
            for n, i in enumerate(order)]
    return [(i, p, q) for i, p, q in rows if p is None or q is None or i != p + 1 or q != i + 1]


@pytest.mark.parametrize("ids", [[], [5], [1, 2, 3], [3, 1, 2, 7, 9, 10, 11, 20], list(range(100, 200, 2)),
                                 [4, 5, 6, 8, 9, 1000]])
def test_id_runs_are_the_ids_gaps_and_islands(ids: list[int]) -> None:
    rows, ranges = id_runs(edges(ids))
    assert rows == len(ids)
    assert [i for first, last in ranges for i in range(first, last + 1)] == sorted(ids)
    assert all(a[1] + 1 < b[0] for a, b in zip(ranges, ranges[1:]))  # runs are maximal: a gap between two


@pytest.mark.parametrize("ids", [[5, 5], [1, 2, 3, 3, 4], [1, 2, 3, 4, 4], [7, 7, 7, 8], [1, 2, 9, 10, 2]])
def test_id_runs_refuse_an_id_twice(ids: list[int]) -> None:
    with pytest.raises(ValueError, match="twice"):
        id_runs(edges(ids))


def write_ids(path: Path, ids: list[int]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "topic": ["t"] * len(ids)}), path)
    return str(path)


@pytest.mark.parametrize("ids", [[], [5], [1, 2, 3], [3, 1, 2, 7, 9, 10, 11, 20], list(range(100, 200, 2)),
                                 [4, 5, 6, 8, 9, 1000]])
def test_the_arrow_writers_runs_are_the_ids_gaps_and_islands(ids: list[int], tmp_path: Path) -> None:
    """The Arrow writer's read-back (``file_runs``, per file) and the driver's merge
    (``merge_runs``, over every file) give what ``id_runs`` gives for the same ids,
    whichever way the ids are cut into files."""
    whole = id_runs(edges(ids))
    assert merge_runs(file_runs(write_ids(tmp_path / "one.parquet", ids))) == whole
    odd, even = [i for i in ids if i % 2], [i for i in ids if not i % 2]
    apart = file_runs(write_ids(tmp_path / "odd.parquet", odd)) + file_runs(write_ids(tmp_path / "even.parquet", even))
    assert merge_runs(apart) == whole  # two tasks' reports
    assert file_runs(str(tmp_path / "odd.parquet"), str(tmp_path / "even.parquet")) == \
        [tuple(run) for run in whole[1]]  # one task's files read together


@pytest.mark.parametrize("ids", [[5, 5], [1, 2, 3, 3, 4], [1, 2, 3, 4, 4], [7, 7, 7, 8], [1, 2, 9, 10, 2]])
def test_the_arrow_writers_merge_refuses_an_id_twice(ids: list[int], tmp_path: Path) -> None:
    """An id twice in one file, or in two files, fails the merge."""
    with pytest.raises(ValueError, match="twice"):
        merge_runs(file_runs(write_ids(tmp_path / "one.parquet", ids)))
    first, second = ids[:len(ids) // 2], ids[len(ids) // 2:]
    if set(first) & set(second):
        with pytest.raises(ValueError, match="twice"):
            merge_runs(file_runs(write_ids(tmp_path / "a.parquet", first)) +
                       file_runs(write_ids(tmp_path / "b.parquet", second)))


@pytest.mark.parametrize(("value", "name"), [
    ("orders.created", "orders.created"), ("a b", "a b"), ("t/b 50% ü", "t%2Fb 50%25 ü"),
    ("k=v:w?x", "k%3Dv%3Aw%3Fx"), ("tab\tnew\nline", "tab%09new%0Aline"),
    ("", DEFAULT_PARTITION), (None, DEFAULT_PARTITION)])
def test_partition_values_are_named_as_spark_names_them(value: str | None, name: str) -> None:
    """Spark's escaping (read off Spark's own writer for every ASCII character; the two
    writers compared in tests/test_pipeline_archive.py): ``%XX`` for controls and ``"#%'*/:=?[\\]^{`` and DEL."""
    assert partition_value(value) == name


@pytest.mark.parametrize(("spec", "count"), [
    ({"a": 10, "b": 10, "c": 10, "d": 10, "e": 10}, 4),   # even topics, more than tasks
    ({"huge": 90, "x": 3, "y": 4, "z": 3}, 4),             # one topic bigger than a task's share
    ({"only": 50}, 4),
    ({f"t{i}": 1 + i % 7 for i in range(40)}, 3),          # many small topics
    ({"a": 5, "b": 5}, 1),
])
def test_topic_tasks_give_each_row_one_task(spec: dict[str, int], count: int) -> None:
    rows, next_id = [], 100
    for n in range(max(spec.values())):  # topics interleaved by id, as an outbox's are
        for topic, size in spec.items():
            if n < size:
                rows.append((next_id, topic))
                next_id += 3
    groups = [(t, sum(1 for _, x in rows if x == t), min(i for i, x in rows if x == t),
               max(i for i, x in rows if x == t)) for t in spec]
    tasks = topic_tasks(groups, count)

    def holds(task: tuple[int, int, tuple[Any, ...]], id_: int, topic: str) -> bool:
        lo, hi, pieces = task
        return lo <= id_ <= hi and any(t == topic and (a is None or a <= id_ <= b) for t, a, b in pieces)
    for id_, topic in rows:
        assert sum(1 for task in tasks if holds(task, id_, topic)) == 1, (id_, topic)
    assert len(tasks) <= count
    assert all(sum(1 for _, first, _ in pieces if first is not None) <= 2 for _, _, pieces in tasks)
    assert sum(len(pieces) for _, _, pieces in tasks) <= len(spec) + count - 1
    share = -(-len(rows) // count)
    loads = [sum(1 for id_, topic in rows if holds(task, id_, topic)) for task in tasks]
    assert max(loads) <= 2 * share, loads  # cut by id span: about, not exactly, a task's share
    assert topic_tasks([], count) == []


@pytest.mark.parametrize("value", ["2026-11-23 10:56:29.766",
                                   datetime(2026, 11, 23, 10, 56, 29, 756000),
                                   datetime(2026, 11, 23, 10, 56, 29, 718340, tzinfo=UTC)])
def test_native_values_cross_processes_unchanged(value: object) -> None:
    back = decode_native(encode_native(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, datetime):
        assert (back.tzinfo is None) == (value.tzinfo is None)


def test_archive_locations(tmp_path: Path) -> None:
    assert archive_uri("s3a://bucket/outbox/") == "s3a://bucket/outbox"
    assert archive_uri("hdfs://nn:8020/a") == "hdfs://nn:8020/a"
    assert archive_uri("relative/dir").startswith("file:///")
    spaced = tmp_path / "my archive ü%20"
    assert archive_uri(str(spaced)) == f"file://{spaced}"
    assert local_path(archive_uri(str(spaced))) == spaced
    with pytest.raises(PipelineError):
        archive_uri("  ")


def test_runs_are_ordered_by_their_database_cutoff_and_the_host_clock_only_breaks_ties() -> None:
    """Which copy of a row archived twice is the newest: its run's place by the cut-off
    (the database's clock), not by the run id (the driver host's clock, an hour behind here)."""
    manifests = [{"run_id": "20260101T120000000000Z-aaaa", "cutoff": "2025-12-25T12:00:00+00:00"},
                 {"run_id": "20260101T110000000000Z-bbbb", "cutoff": "2025-12-25T13:00:00"},  # naive: UTC
                 {"run_id": "20260101T100000000000Z-cccc", "cutoff": "2025-12-25T13:00:00+00:00"}]
    assert run_order(manifests) == {"20260101T120000000000Z-aaaa": 0, "20260101T100000000000Z-cccc": 1,
                                    "20260101T110000000000Z-bbbb": 2}


def test_replay_ids_are_deterministic_and_short() -> None:
    pytest.importorskip("pyspark")
    from outbox.pipeline.replay import REPLAY_NAMESPACE, replay_message_id
    original = "x" * 64  # the longest message id the table holds
    assert replay_message_id(original) == replay_message_id(original) == str(uuid.uuid5(REPLAY_NAMESPACE, original))
    assert replay_message_id(original) != replay_message_id(original[:-1])
    assert len(replay_message_id(original)) == 36
    for name in ("", "m-1", "ünïcødé ✓ 😀", "tab\tand \\ quote \"", "é" * 64):
        assert replay_message_id(name) == str(uuid.uuid5(REPLAY_NAMESPACE, name))


def _archived(rows: list[dict]) -> dict[str, list]:
    """Archived events (what replay's tasks receive), column by column."""
    columns = ["id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key", "payload",
               "headers", "trace_id"]
    return {c: [r.get(c) for r in rows] for c in columns}


def _row(n: int, **over: object) -> dict:
    row = {"id": n, "message_id": f"m-{n}", "topic": f"orders.t{n % 3}", "aggregate_type": "order",
           "aggregate_id": f"a{n % 4}", "partition_key": None if n % 2 else f"k{n}", "payload": f'{{"n": {n}}}',
           "headers": '{"x-seq": 1}' if n % 3 else None, "trace_id": None if n % 5 else f"t{n}"}
    row.update(over)
    return row


#: Archived rows whose JSON, text or headers take the less common paths.
ODD_ROWS = [
    _row(1, payload='{"b": 1, "a": [1.5, "ü", null, true], "c": {"d": "\\u00e9\\n"}}'),  # spaces, escapes
    _row(2, payload='[1, 2, {"x": "😀"}]', headers='{"a": "b", "c": 2.5, "d": null, "e": false}'),
    _row(3, message_id="ünïcødé-😀", headers="{}"),
    _row(4, headers='{"x-outbox-replay-of": "older", "z": 1}'),  # a replay of a replay
    _row(5, aggregate_id="a b", topic="t" * 255, payload='{"s": "%s"}' % ("x" * 200)),
    _row(6, message_id='quote " and \\ backslash', headers='{"k": "line\\nbreak"}'),
]


def test_prepare_batch_writes_what_prepare_event_writes() -> None:
    """Replay's batch validation gives, event by event, exactly ``prepare_event``'s result."""
    pytest.importorskip("pyspark")
    import json

    from outbox.domain.events import prepare_event
    from outbox.pipeline.replay import REPLAY_HEADER, prepare_batch, replay_message_id

    rows = [_row(n) for n in range(7, 40)] + ODD_ROWS
    got = prepare_batch(_archived(rows), 1 << 20)
    want = []
    for r in rows:
        headers = json.loads(r["headers"]) if r["headers"] else {}
        headers[REPLAY_HEADER] = r["message_id"]
        want.append(prepare_event(topic=r["topic"], aggregate_type=r["aggregate_type"], aggregate_id=r["aggregate_id"],
                                  payload=json.loads(r["payload"]), headers=headers, key=r["partition_key"],
                                  message_id=replay_message_id(r["message_id"]), trace_id=r["trace_id"],
                                  max_payload_bytes=1 << 20))
    assert got == want


@pytest.mark.parametrize(("bad", "problem"), [
    ({"topic": " "}, "topic must not be empty"),
    ({"topic": "t" * 256}, "topic is 256 characters long; the limit is 255"),
    ({"aggregate_id": "a\x00b"}, "aggregate_id contains a NUL character"),
    ({"partition_key": "k" * 200 + "😀" * 55}, "UTF-16 code units long"),
    ({"trace_id": ""}, None),  # optional and empty: accepted, as enqueue accepts it
    ({"payload": '"text"'}, "payload must be a JSON object or array, got str"),
    ({"payload": '{"n": NaN}'}, "payload is not valid JSON"),
    ({"payload": '{"n": '}, "Expecting value"),
    ({"payload": '{"s": "a\\u0000b"}'}, "payload contains a NUL character"),
    ({"payload": '{"s": "%s"}' % ("x" * 100)}, "payload is 108 bytes; OUTBOX_MAX_PAYLOAD_BYTES allows 100"),
    ({"headers": '["a"]'}, "headers must be a mapping, got list"),
    ({"headers": '{"h": {"nested": 1}}'}, "header 'h' must be a string, number, boolean or None"),
    ({"headers": '{"h": "%s"}' % ("x" * 70_000)}, "headers are larger than 65536 bytes"),
    ({"message_id": "m\x00"}, "header 'x-outbox-replay-of': its value contains a NUL character"),
    ({"headers": '{"x-outbox-replay-of": 1, "h": NaN}'}, "NaN and infinity are not JSON"),
    # found in review: the fast path skipped enqueue's depth check, and past Python's own
    # limit json.loads raised RecursionError, not a refusal naming the row
    ({"payload": "[" * 32 + "]" * 32}, "nests arrays and objects more than 31 levels deep"),
    ({"payload": "[" * 5000 + "]" * 5000}, "recursion"),
    ({"payload": "[" * 32 + "]" * 32, "headers": '{"x-outbox-replay-of": "m"}'}, "more than 31 levels deep"),
])
def test_prepare_batch_refuses_a_bad_row_by_name(bad: dict, problem: str | None) -> None:
    pytest.importorskip("pyspark")
    from outbox.pipeline.replay import prepare_batch

    rows = [_row(n) for n in range(1, 6)] + [_row(6, **bad)] + [_row(n) for n in range(7, 9)]
    if problem is None:
        assert len(prepare_batch(_archived(rows), 100)) == 8
        return
    with pytest.raises(PipelineError) as caught:
        prepare_batch(_archived(rows), 100)
    message = str(caught.value)
    assert message.startswith(f"archived event id 6 (message_id {rows[5]['message_id']!r}) cannot be replayed: ")
    assert problem in message, message


def _tsql(sql: str, params: int) -> exp.Expression:
    assert sql.count("?") == params, sql
    parsed = sqlglot.parse_one(sql, read="tsql")
    assert not isinstance(parsed, exp.Command), f"sqlglot fell back to an opaque command: {sql}"
    return parsed


def test_pipeline_sql_parses_as_tsql() -> None:
    pytest.importorskip("pyspark")
    from outbox.pipeline.archive import candidates_sql, check_table_sql, delete_sql, long_topics_sql, table_bounds_sql
    from outbox.pipeline.replay import existing_sql
    from outbox.pipeline.source import OutboxQuery

    engine = MssqlEngine(table="outbox", schema="dbo")
    native = encode_native(datetime(2026, 11, 16, 12, 0))
    query = OutboxQuery({"url": "mssql+pyodbc://u:p@h:1433/db?driver=FreeTDS", "table": "outbox",
                         "schema": "dbo", "statuses": "2,4", "processed_before": native, "created_since": native})
    bounds = _tsql(query.bounds_sql(), len(query.params))
    assert bounds.find(exp.Where) is not None
    page = _tsql(query.page_sql(), 3 + len(query.params))
    assert "FETCH NEXT" in page.sql(dialect="tsql").upper() and "CAST(payload AS NVARCHAR(MAX))" in query.page_sql()
    _tsql(query.topics_sql(), 2 + len(query.params))
    pieces = OutboxQuery({"url": "mssql+pyodbc://u:p@h:1433/db?driver=FreeTDS", "table": "outbox", "schema": "dbo",
                          "statuses": "2"}, (("a", None, None), ("b", None, None), ("c", 10, 20)))
    assert len(pieces.params) == 5
    _tsql(pieces.page_sql(), 3 + len(pieces.params))
    _tsql(check_table_sql(engine), 0)
    _tsql(table_bounds_sql(engine), 0)
    _tsql(candidates_sql(engine, [2, 4]), 3)
    assert "DATALENGTH(topic) > 62" in _tsql(long_topics_sql(engine, [2]), 3).sql(dialect="tsql")
    delete = _tsql(delete_sql(engine, [2]), 3)
    assert isinstance(delete, exp.Delete)
    assert isinstance(_tsql(delete_sql(engine, [2, 4], 100), 201), exp.Delete)  # 2,100 parameters at most
    _tsql(existing_sql(engine.table, 500), 500)
    from outbox.pipeline.replay import insert_sql
    insert = _tsql(insert_sql(engine), 8)
    assert isinstance(insert, exp.Insert) and "SYSUTCDATETIME()" in insert_sql(engine)


@pytest.mark.parametrize("master", ["local", "local[*]", "local[2]", "local[4, 2]", "spark://10.0.0.1:7077", "yarn",
                                    "k8s://https://k8s.example:6443"])
def test_master_urls(master: str) -> None:
    from outbox.pipeline.session import check_master
    assert check_master(master) == master


@pytest.mark.parametrize(("master", "given", "under_spark_submit", "want", "warned"), [
    ("local[2]", None, False, sys.executable, False),
    (None, None, False, sys.executable, False),            # the default, local[*]
    ("spark://10.0.0.1:7077", None, False, None, True),    # the driver's venv path may not exist on the workers
    ("yarn", None, False, None, True),
    ("spark://10.0.0.1:7077", "/opt/job/bin/python", False, "/opt/job/bin/python", False),
    (None, None, True, None, False),                       # spark-submit's own setting (spark.pyspark.python)
])
def test_only_a_local_master_runs_the_drivers_interpreter_in_the_executors(
        master: str | None, given: str | None, under_spark_submit: bool, want: str | None, warned: bool,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """PySpark starts the executors' Python workers with PYSPARK_PYTHON as the session starts.
    It was set to this interpreter for every master, so ``--master spark://...`` sent the
    driver's venv path to workers where it may not exist (found in review)."""
    pytest.importorskip("pyspark")
    from unittest.mock import MagicMock

    from pyspark.sql import SparkSession

    from outbox.pipeline.session import spark_session
    for name, value in (("PYSPARK_PYTHON", given), ("PYSPARK_GATEWAY_PORT", "1" if under_spark_submit else None),
                        ("SPARK_LOCAL_IP", None)):
        monkeypatch.setenv(name, "x")  # restored after the test, whatever the session sets
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", lambda self: MagicMock())  # no JVM
    with caplog.at_level("WARNING", logger="outbox.pipeline"):
        spark_session(master)
    assert os.environ.get("PYSPARK_PYTHON") == want
    assert any("PYSPARK_PYTHON" in r.getMessage() for r in caplog.records) == warned


@pytest.mark.parametrize("master", ["bogus://x", "local[", "spark", ""])
def test_bad_master_urls(master: str) -> None:
    from outbox.pipeline.session import check_master
    with pytest.raises(PipelineError, match="is not a Spark master URL"):
        check_master(master)


def _report(days: list[dict], topics: list[dict]) -> dict:
    figures = {"events": 0, "delivered": 0, "dead": 0, "pending": 0, "latency_p50_s": None,
               "latency_p95_s": None, "latency_p99_s": None}
    return {"generated_at": "2026-11-23T00:00:00+00:00",
            "sources": {"table": "sqlite:outbox", "archive": None, "since": None, "live_rows": 0, "archive_rows": 0},
            "totals": {**figures, "attempts_histogram": []}, "days": days, "topics": topics}


def test_html_report_of_an_empty_outbox_still_renders() -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pyspark")
    from outbox.pipeline.report import render_html
    page = render_html(_report([], []))
    assert page.count("src='data:image/png;base64,") == 3 and page.endswith("</html>")


def test_html_report_escapes_names() -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pyspark")
    from outbox.pipeline.report import render_html
    topic = {"topic": "<script>x</script>", "events": 1, "delivered": 0, "dead": 1, "pending": 0,
             "latency_p50_s": None, "latency_p95_s": None, "latency_p99_s": None, "attempts_histogram": [],
             "top_errors": [{"error": "a < b & c", "rows": 1}]}
    day = {k: v for k, v in topic.items() if k not in ("attempts_histogram", "top_errors")}
    page = render_html(_report([{**day, "day": "2026-11-20"}], [topic]))
    assert "<script>" not in page and "&lt;script&gt;" in page and "a &lt; b &amp; c" in page


def test_html_report_charts_topics_with_dollar_signs_as_text() -> None:
    """A topic between two ``$`` is matplotlib's mathtext: ``orders.$\\x{$`` failed the whole
    report (ParseFatalException: Unknown symbol), and ``a$b$`` was drawn as a formula (found in
    review). The chart's topic labels are plain text."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("pyspark")
    from outbox.pipeline.report import figures, render_html
    topic = {"topic": "orders.$\\x{$", "events": 1, "delivered": 1, "dead": 0, "pending": 0,
             "latency_p50_s": 1.0, "latency_p95_s": 2.0, "latency_p99_s": 3.0, "top_errors": []}
    day = {k: v for k, v in topic.items() if k != "top_errors"}
    report = _report([{**day, "day": "2026-11-20"}], [topic])
    assert render_html(report).count("src='data:image/png;base64,") == 3
    labels = figures(report)["latency"].axes[0].get_xticklabels()
    assert [label.get_text() for label in labels] == [topic["topic"]] and not labels[0].get_parse_math()


def test_cli_without_pyspark(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """The ``outbox`` command works without the spark extra; a pipeline job then
    says which extra to install, in one line."""
    import sys

    from click.testing import CliRunner

    from outbox.cli import main
    from outbox.core.config import reset_settings

    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark -> ImportError
    reset_settings()
    assert CliRunner().invoke(main, ["pipeline", "--help"]).exit_code == 0
    out = CliRunner().invoke(main, ["pipeline", "archive", "--older-than", "1d", "--to", str(tmp_path)],
                             env={"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"})
    assert out.exit_code == 1
    assert out.output.strip().splitlines()[-1].startswith('error: the pipeline needs PySpark 4 and Java 17: '
                                                          'pip install "<outbox-relay checkout>[spark]"')
    reset_settings()


def test_the_reports_legends_never_cover_a_bar() -> None:
    """The legends sat inside the plot, over the tallest bars; they are beside it now."""
    pytest.importorskip("matplotlib")
    from outbox.pipeline.report import figures

    days = [{"day": f"2026-11-{d:02d}", "delivered": 900 + d, "dead": d, "pending": 2} for d in range(1, 15)]
    topics = [{"topic": f"orders.t{n}", "latency_p50_s": 0.5 + n, "latency_p95_s": 2.0 + n, "latency_p99_s": 9.0 + n}
              for n in range(6)]
    report = {"days": days, "topics": topics, "totals": {"attempts_histogram": [{"attempts": 1, "rows": 5}]}}
    checked = 0
    for name, figure in figures(report).items():
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for ax in figure.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            box, plot = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            assert box.x0 >= plot.x1 or box.x1 <= plot.x0 or box.y0 >= plot.y1 or box.y1 <= plot.y0, name
            checked += 1
    assert checked == 2  # events per day and latency carry a legend


# -- SQL Server's Arrow reader: mssql-python's own fetch (no server here: the choice and the cast) -----------

MSSQL_PYTHON_URL = "mssql+mssqlpython://u:p@h:1433/db?TrustServerCertificate=yes"


def test_sql_server_reads_arrow_through_mssql_python_and_rows_through_pyodbc(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mssql_python")
    from mssql_python.cursor import Cursor

    from outbox.pipeline.fetch import MssqlPythonFetch, arrow_fetch

    engine = MssqlEngine(table="outbox", schema="dbo")
    fetch = arrow_fetch(MSSQL_PYTHON_URL, engine, "arrow")
    assert isinstance(fetch, MssqlPythonFetch) and fetch.binds
    assert arrow_fetch(MSSQL_PYTHON_URL, engine, "driver") is None
    assert arrow_fetch("mssql+pyodbc://u:p@h:1433/db?driver=FreeTDS", engine, "arrow") is None
    monkeypatch.delattr(Cursor, "arrow")  # an mssql-python before its Arrow fetch (1.5)
    assert arrow_fetch(MSSQL_PYTHON_URL, engine, "arrow") is None


def test_a_binding_reader_gets_the_driver_paths_statement_and_values() -> None:
    """mssql-python's reader runs the very statement the driver path runs, the page's
    values bound in the order of its ``?`` (no literals written into it)."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    from outbox.pipeline.fetch import ArrowFetch
    from outbox.pipeline.source import ARROW_SCHEMA, OutboxQuery

    native = encode_native(datetime(2026, 11, 16, 12, 0))
    query = OutboxQuery({"url": "mssql+pyodbc://u:p@h:1433/db?driver=FreeTDS", "table": "outbox",
                         "statuses": "2,4", "processed_before": native, "created_since": native},
                        (("a", None, None), ("c", 10, 20)))
    asked: list[tuple[str, Any]] = []

    class Binding(ArrowFetch):
        binds = True

        def page(self, handle: Any, sql: str, params: list[Any] | None = None) -> Any:
            asked.append((sql, params))
            return ARROW_SCHEMA().empty_table()

    query.fetch = Binding(query.url, query.engine)
    assert query.arrow_page(None, 100, 900, 50).num_rows == 0
    sql, params = asked[0]
    assert sql == query.page_sql() and params is not None and sql.count("?") == len(params)
    assert params == [100, 900, *query.params, 50]


def test_mssql_python_arrow_pages_take_the_source_schema_as_its_rows_do() -> None:
    """A page as mssql-python's Arrow fetch gives it (its C++ maps NVARCHAR to large_string,
    TINYINT to uint8, INT to int32, BIGINT to int64, DATETIME2 to a naive timestamp[us]) comes
    out of ``to_source_schema`` equal to the same rows as its ``fetchall`` gives them, through
    the driver path's ``to_batch``."""
    pytest.importorskip("pyspark")
    pa = pytest.importorskip("pyarrow")
    from outbox.pipeline.fetch import to_source_schema
    from outbox.pipeline.source import ARROW_SCHEMA, OutboxQuery

    t1, t2 = datetime(2026, 11, 16, 12, 0, 0, 123000), datetime(2026, 11, 17, 8, 30, 1, 7000)
    rows = [(7, "m-7", "orders.created", "order", "A-1", None, '{"n":1}', "{}", None, 2, 1, t1, None, t1, t2, None),
            (9, "m-9", "orders.paid", "order", "B-2", "k", '{"é":"ü"}', '{"h":"v"}', "tr", 4, 3, t2, t1, t1, t2,
             "retriable: broker gone")]
    text, ts = pa.large_string(), pa.timestamp("us")
    types = [pa.int64(), *[text] * 8, pa.uint8(), pa.int32(), ts, ts, ts, ts, text]
    columns = list(zip(*rows))
    fetched = pa.table([pa.array(list(values), kind) for values, kind in zip(columns, types)],
                       names=["id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key", "", "",
                              "trace_id", "status", "attempts", "claimed_at", "next_retry_at", "created_at",
                              "processed_at", "last_error"])  # the CASTs of payload and headers have no name
    query = OutboxQuery({"url": "mssql+pyodbc://u:p@h:1433/db?driver=FreeTDS", "table": "outbox"})
    got = to_source_schema(fetched, ARROW_SCHEMA(), query.engine.to_datetime)
    want = pa.Table.from_batches([query.to_batch(rows)])
    assert got.schema == ARROW_SCHEMA() and got.equals(want), (got.to_pylist(), want.to_pylist())


class PagesThenFailure:
    """A data source reader whose task yields ``pages`` and then fails (a lost
    connection mid-task), as ``OutboxReader.read`` would raise it."""

    def __init__(self, pages: list[Any], fail: bool) -> None:
        self.pages, self.fail = pages, fail

    def read(self, task: Any) -> Any:
        yield from self.pages
        if self.fail:
            raise ConnectionError("server closed the connection")


def source_page(ids: list[int], topics: list[str], days: list[int]) -> Any:
    """A page in the data source's schema: these ids, topics and creation days (of December 2026, UTC)."""
    import pyarrow as pa

    from outbox.pipeline.source import ARROW_SCHEMA
    schema = ARROW_SCHEMA()
    created = [datetime(2026, 12, day, 23, 59, 59, 999_999, tzinfo=UTC) for day in days]
    values: dict[str, Any] = {"id": ids, "topic": topics, "message_id": [f"m{i}" for i in ids], "status": [2] * len(ids),
                              "attempts": [0] * len(ids), "created_at": created}
    return pa.RecordBatch.from_arrays([pa.array(values.get(f.name, [None] * len(ids)), f.type) for f in schema],
                                      schema=schema)


def test_a_task_of_the_arrow_writer_writes_a_file_per_topic_and_day(tmp_path: Path) -> None:
    """Two pages of interleaved topics and days: one file per topic and UTC day (a row at
    23:59:59.999999 stays on its day), each in id order, named as Spark names the
    directory, and the ids read back as one run."""
    import pyarrow.parquet as pq

    from outbox.pipeline.stage import write_task
    pages = [source_page([1, 2, 3, 4], ["a", "b/c", "a", "b/c"], [1, 1, 2, 1]),
             source_page([5, 6], ["a", "b/c"], [1, 1])]
    files, runs = write_task(PagesThenFailure(pages, fail=False), None, str(tmp_path), "run-1")
    assert runs == [(1, 6)]
    by_dir = {f.rsplit("/", 1)[0]: pq.read_table(tmp_path / f) for f in files}
    assert sorted(by_dir) == ["topic=a/date=2026-12-01", "topic=a/date=2026-12-02", "topic=b%2Fc/date=2026-12-01"]
    assert by_dir["topic=a/date=2026-12-01"].column("id").to_pylist() == [1, 5]
    assert by_dir["topic=b%2Fc/date=2026-12-01"].column("id").to_pylist() == [2, 4, 6]
    assert set(by_dir["topic=a/date=2026-12-02"].column("archive_run").to_pylist()) == {"run-1"}
    assert not list(tmp_path.rglob(".*"))  # nothing left under a hidden name


def test_a_task_of_the_arrow_writer_syncs_each_file_before_its_rename(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file is fsynced under its hidden name before the rename that makes it
    complete, on the task's own host: on a shared filesystem the driver's fsync flushes
    only what the driver wrote (docs/pipeline.md, "Durability")."""
    from outbox.pipeline.stage import write_task
    events: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.fstat(fd).st_ino))

    def replace(src: str, dst: str) -> None:
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    pages = [source_page([1, 2, 3], ["a", "b", "a"], [1, 1, 2])]
    files, _ = write_task(PagesThenFailure(pages, fail=False), None, str(tmp_path), "run-1")
    assert len(files) == 3
    renamed = [ino for what, ino in events if what == "replace"]
    assert sorted(renamed) == sorted((tmp_path / f).stat().st_ino for f in files)
    for ino in renamed:
        assert events.index(("fsync", ino)) < events.index(("replace", ino))


def test_a_task_of_the_arrow_writer_that_fails_leaves_no_file_a_reader_takes(tmp_path: Path) -> None:
    """The reader fails after a page: the error reaches Spark (the run stops before its
    verify) and the task's files, still open, are removed; nothing is left that a
    reader of the staging directory would read."""
    from outbox.pipeline.stage import write_task
    pages = [source_page([1, 2, 3], ["a", "b", "a"], [1, 1, 1])]
    with pytest.raises(ConnectionError, match="server closed"):
        write_task(PagesThenFailure(pages, fail=True), None, str(tmp_path), "run-1")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_task_whose_file_fails_to_complete_removes_its_files_and_reports_that_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Completing a file fails (a full disk while writing its last row group and footer):
    the task's open files are closed and removed, the rest too, and the error that reaches
    Spark is that one (found in review: the completion ran outside the task's cleanup, so
    the other writers stayed open in the reused Python worker)."""
    import pyarrow.parquet as pq

    from outbox.pipeline.stage import write_task
    closed = pq.ParquetWriter.close

    def full_disk(self: Any) -> None:
        closed(self)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "close", full_disk)
    pages = [source_page([1, 2, 3], ["a", "b", "a"], [1, 1, 1])]
    with pytest.raises(OSError, match="No space left"):
        write_task(PagesThenFailure(pages, fail=False), None, str(tmp_path), "run-1")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_task_with_more_topics_and_days_than_open_files_completes_the_least_recent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With two files open at most, three topics in turn: the least recently written
    file is completed (renamed, readable) to open the next, and its topic's later rows
    go to a new file; every row is written once."""
    import pyarrow.parquet as pq

    from outbox.pipeline import stage
    monkeypatch.setattr(stage, "OPEN_FILES", 2)
    pages = [source_page([1, 2, 3], ["a", "b", "c"], [1, 1, 1]), source_page([4, 5, 6], ["a", "b", "c"], [1, 1, 1])]
    files, runs = stage.write_task(PagesThenFailure(pages, fail=False), None, str(tmp_path), "r")
    assert runs == [(1, 6)]
    assert len(files) == 6  # each topic's file completed before its next rows came
    ids = sorted(i for f in files for i in pq.read_table(tmp_path / f).column("id").to_pylist())
    assert ids == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("name", "root", "chosen"), [
    ("auto", "file:///data/archive", "arrow"), ("auto", "s3a://bucket/archive", "spark"),
    ("auto", "hdfs://nn/archive", "spark"), ("spark", "file:///data/archive", "spark"),
    ("arrow", "file:/data/archive", "arrow")])
def test_the_stage_writer_follows_the_archive_location(name: str, root: str, chosen: str) -> None:
    from outbox.pipeline.stage import writer_for
    assert writer_for(name, root).name == chosen


def test_the_arrow_writer_is_refused_for_a_location_it_cannot_write() -> None:
    from outbox.pipeline.common import PipelineError
    from outbox.pipeline.stage import writer_for
    with pytest.raises(PipelineError, match="filesystem path .*not s3a://bucket/archive: use --writer spark"):
        writer_for("arrow", "s3a://bucket/archive")
    with pytest.raises(PipelineError, match="auto, arrow or spark, not 'parquet'"):
        writer_for("parquet", "file:///data/archive")


def test_sqlite_walks_an_id_range_by_rowid(tmp_path: Path) -> None:
    """SQLite keeps no statistics until ANALYZE, and then took the (status,
    processed_at) index for a page or a delete chunk of an id range, reading every
    done row of the table each time (500,000 rows: the archive's delete 15.3 s, by rowid
    10.4 s). Every such statement (the archive's counts per id chunk too) now names the
    rowid range in its plan."""
    from outbox.pipeline.archive import candidates_sql, delete_sql, long_topics_sql
    from outbox.pipeline.common import encode_native
    from outbox.pipeline.source import OutboxQuery
    from outbox.storage.store import OutboxStore

    url = f"sqlite:///{tmp_path / 'plan.db'}"
    store = OutboxStore(url, table="outbox")
    store.migrate()
    engine = store.engine
    try:
        with store.transaction() as cursor:
            cutoff = engine.execute(cursor, f"SELECT {engine.now}").fetchone()[0]
            query = OutboxQuery({"url": url, "table": "outbox", "statuses": "2,4",
                                 "processed_before": encode_native(cutoff)})
            for sql, params in ((query.page_sql(), [0, 5000, *query.params, 1000]),
                                (query.topics_sql(), [*query.params, 1, 5000]),
                                (delete_sql(engine, [2, 4]), [1, 5000, cutoff]),
                                (candidates_sql(engine, [2, 4]), [1, 5000, cutoff]),
                                (long_topics_sql(engine, [2]), [1, 5000, cutoff])):
                plan = " ".join(str(row[-1]) for row in engine.execute(cursor, "EXPLAIN QUERY PLAN " + sql, params))
                assert "INTEGER PRIMARY KEY (rowid>? AND rowid<?)" in plan, (sql, plan)
                assert "INDEX" not in plan.replace("INTEGER PRIMARY KEY", ""), (sql, plan)
            packed = " ".join(str(row[-1]) for row in engine.execute(
                cursor, "EXPLAIN QUERY PLAN " + delete_sql(engine, [2, 4], 2), [1, 5, 9, 12, cutoff]))
            assert packed.count("INTEGER PRIMARY KEY (rowid>? AND rowid<?)") == 2, packed  # a range each
            assert "(status=?" not in packed, packed
    finally:
        store.close()


def test_the_arrow_writer_gathers_a_files_rows_across_pages_into_row_groups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten topics over three pages: each file's rows from the three pages make one row
    group (not one per page); at most ``ROW_GROUP_ROWS`` a group; and past
    ``BUFFER_BYTES`` gathered, rows are written at once, a group per page."""
    import pyarrow.parquet as pq

    from outbox.pipeline import stage

    def groups(path: Path) -> list[list[int]]:
        pages = [source_page(list(range(p * 50 + 1, p * 50 + 51)), [f"t{i % 10}" for i in range(50)], [1] * 50)
                 for p in range(3)]
        files, runs = stage.write_task(PagesThenFailure(pages, fail=False), None, str(path), "r")
        assert runs == [(1, 150)] and len(files) == 10
        metadata = [pq.ParquetFile(path / f).metadata for f in files]
        return [[m.row_group(g).num_rows for g in range(m.num_row_groups)] for m in metadata]

    assert groups(tmp_path / "a") == [[15]] * 10
    monkeypatch.setattr(stage, "ROW_GROUP_ROWS", 10)
    assert groups(tmp_path / "b") == [[10, 5]] * 10
    monkeypatch.setattr(stage, "BUFFER_BYTES", 0)
    assert groups(tmp_path / "c") == [[5, 5, 5]] * 10


def test_a_page_read_once_more_that_fails_closes_its_new_connection_and_keeps_the_error() -> None:
    """Found in review: when the read on the new connection failed too, that connection was
    never closed (left in its failed transaction), and the caller's close of the old, closed
    one (PyMySQL: "Already closed") replaced the real error."""
    from outbox.pipeline.fetch import read_once_more

    class Conn:
        def __init__(self) -> None:
            self.closed = False

        def close(self) -> None:
            if self.closed:
                raise RuntimeError("Already closed")
            self.closed = True

    made: list[Conn] = []

    class Engine:
        def is_disconnect(self, exc: BaseException) -> bool:
            return isinstance(exc, ConnectionError)

        def is_transient(self, exc: BaseException) -> bool:
            return False

        def connect(self, url: str) -> Conn:
            made.append(Conn())
            return made[-1]

    def read(conn: Conn) -> None:
        raise ConnectionError("the server ended the session") if not made else TimeoutError("the real error")

    old = Conn()
    with pytest.raises(TimeoutError, match="the real error"):
        read_once_more(Engine(), "mysql://h/db", old, read)  # type: ignore[arg-type]
    assert old.closed and len(made) == 1 and made[0].closed


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_that_cannot_sync_a_directory_does_not_stop_the_archive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int) -> None:
    """CIFS/SMB, sshfs and many FUSE mounts refuse ``fsync`` on a directory (EINVAL,
    EOPNOTSUPP): raised, every run stopped before its commit, a committed one in its
    recovery (found in review). Files are still synced, and a file's failure still stops it."""
    from outbox.pipeline import fs as fs_module

    synced: list[Path] = []

    def fsync_path(path: Path) -> None:
        if Path(path).is_dir():
            raise OSError(code, os.strerror(code))
        synced.append(Path(path))

    monkeypatch.setattr(fs_module, "fsync_path", fsync_path)
    archive = object.__new__(fs_module.ArchiveFS)
    archive.root = f"file://{tmp_path}"
    (tmp_path / "topic=t").mkdir()
    part = tmp_path / "topic=t" / "part-0.parquet"
    part.write_bytes(b"x")
    archive.sync([f"file://{part}"])
    assert synced == [part]
    assert "cannot sync a directory" in caplog.text or fs_module._warned  # said once a process

    def broken(path: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fs_module, "fsync_path", broken)
    with pytest.raises(OSError):
        archive.sync([f"file://{part}"])


def test_an_archive_names_every_host_of_libpqs_list() -> None:
    """A PostgreSQL URL listing several hosts (libpq's failover form) passes the start-up
    check; the archive's record of its database read one port and raised."""
    from outbox.pipeline.archive import database_of

    assert database_of("postgresql://u:p@DB:5432/app/") == "postgresql://db:5432/app"  # as before
    assert database_of("postgresql://u@h1:5432,H2/app?target_session_attrs=any") == "postgresql://h1:5432,h2/app"
