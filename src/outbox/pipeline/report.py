"""``outbox pipeline report``: what the outbox did, per topic and day.

Reads the archive (committed runs, one row per id) and the live table (through the
``outbox`` data source, with ``--since`` pushed into the SQL), keeps the live copy of
a row present in both (the same id and message id), and computes with Spark SQL:

* per topic and UTC day of ``created_at``: events, delivered (done), dead, pending
  (pending, claimed or failed), and the created-to-processed latency of delivered
  rows at p50/p95/p99 (exact percentiles, linear interpolation: ``percentile``);
* per topic: the same totals, the histogram of ``attempts`` and the most frequent
  ``last_error`` of dead rows;
* the same over everything.

Output: ``report.json`` (the figures) and ``report.html``, one self-contained file
with the charts as PNG (matplotlib, Agg backend) embedded as base64.
"""

from __future__ import annotations

import base64
import html
import io
import json
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..storage.store import OutboxStore
from .archive import check_archive, check_table, db_cutoff, read_archive
from .common import PipelineError, archive_uri, encode_native, local_path

#: How many of the most frequent dead-row errors each topic lists.
TOP_ERRORS = 5

_FIGURES = """
    COUNT(*) AS events,
    COUNT(CASE WHEN status = 2 THEN 1 END) AS delivered,
    COUNT(CASE WHEN status = 4 THEN 1 END) AS dead,
    COUNT(CASE WHEN status IN (0, 1, 3) THEN 1 END) AS pending,
    percentile(CASE WHEN status = 2 THEN latency_s END, array(0.5, 0.95, 0.99)) AS latency
"""


def _figures(row: Any) -> dict[str, Any]:
    latency = row["latency"] if row["latency"] is not None else [None, None, None]
    return {"events": int(row["events"]), "delivered": int(row["delivered"]), "dead": int(row["dead"]),
            "pending": int(row["pending"]), "latency_p50_s": latency[0], "latency_p95_s": latency[1],
            "latency_p99_s": latency[2]}


def report_frame(spark: Any, store: OutboxStore | None, archive: str | None, since: Any = None,
                 partitions: int = 4, *, archive_optional: bool = False,
                 warn: Callable[[str], None] | None = None) -> tuple[Any, dict[str, Any]]:
    """Archive plus live table as one frame of the columns the report needs. With
    ``archive_optional`` (``run_report``), an archive no run has written yet, once the live
    table is read, is left out (``warn`` says so); any other error of reading it is raised."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    cols = ["id", "message_id", "topic", "status", "attempts", "created_at", "processed_at", "last_error"]
    frames: list[Any] = []
    sources: dict[str, Any] = {"archive": None, "table": None}
    since_dt = None
    if store is not None:
        check_table(store)
        options = {"url": store.url, "table": store.engine.table_name, "schema": store.engine.schema or "",
                   "partitions": str(partitions)}
        if since is not None:
            options["created_since"] = encode_native(since)
            since_dt = store.engine.to_datetime(since)
        live = spark.read.format("outbox").options(**options).load().select(*cols)
        # Read now, before the archive is listed: an archive run that publishes and deletes
        # in between then has its rows here or there (both: counted once, live first). Read
        # at the first action, after the listing, they were in neither (found in review).
        live = live.localCheckpoint(eager=True)
        frames.append(live.withColumn("origin", F.lit(0)))
        sources["table"] = f"{store.engine.name}:{store.engine.table_name}"
    if archive and archive_optional and store is not None:
        # Only an archive that is not there (yet) is left out: any other refusal of its
        # readers (two events under one id) stops the report as it does for --archive. Every
        # error of the read was taken for "not written yet" and the whole archive left out of
        # every figure, exit 0 (found in review).
        try:
            check_archive(spark, archive)
        except PipelineError as exc:
            if warn:
                warn(f"warning: {exc}; reporting on the live table alone (OUTBOX_ARCHIVE_URI names an archive "
                     "no run has written yet)")
            archive = None
    if archive:
        archived = read_archive(spark, archive).select(*cols)
        if since_dt is not None:
            archived = archived.where(F.col("created_at") >= F.lit(since_dt))
        frames.append(archived.withColumn("origin", F.lit(1)))
        sources["archive"] = archive_uri(archive)
    if not frames:
        raise PipelineError("nothing to report on: give a database or an archive")
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    # One row per event: the same id *and* message id (an id the table uses again for another
    # event, e.g. an archive of another outbox or of the table before it was made again, is
    # another row: merged by id alone, the archived events vanished, found in review).
    live_first = Window.partitionBy("id", "message_id").orderBy("origin")
    frame = (frame.withColumn("_n", F.row_number().over(live_first)).where("_n = 1").drop("_n")
             .withColumn("day", F.date_format("created_at", "yyyy-MM-dd"))
             .withColumn("latency_s", (F.unix_micros("processed_at") - F.unix_micros("created_at")) / 1e6))
    sources["since"] = since_dt.isoformat() if since_dt else None
    return frame, sources


def compute_report(spark: Any, frame: Any, sources: dict[str, Any]) -> dict[str, Any]:
    # Several aggregations over the same rows: read the table and the archive once.
    frame = frame.cache()
    try:
        return _compute(spark, frame, sources)
    finally:
        frame.unpersist()


#: The figures with nothing to count (``totals`` of a report with no rows: a grouping set
#: ``()`` gives no row over no rows, where a plain aggregate gives one).
_NO_FIGURES = {"events": 0, "delivered": 0, "dead": 0, "pending": 0, "latency": None}


def _compute(spark: Any, frame: Any, sources: dict[str, Any]) -> dict[str, Any]:
    """The figures in three queries over the cached rows, each a few grouping sets at once
    (a query per figure was seven Spark actions, most of a small report's time;
    docs/pipeline.md, "Report")."""
    frame.createOrReplaceTempView("outbox_report_rows")
    sql = spark.sql
    # per topic and day, per topic, and over everything (GROUPING tells the sets apart)
    figures = sql(f"""SELECT topic, day, GROUPING(topic) AS all_topics, GROUPING(day) AS all_days, {_FIGURES}
                      FROM outbox_report_rows GROUP BY GROUPING SETS ((topic, day), (topic), ())""").collect()
    totals = _figures(next((r for r in figures if r["all_topics"]), _NO_FIGURES))
    days = [{"topic": r["topic"], "day": r["day"], **_figures(r)}
            for r in sorted((r for r in figures if not r["all_days"]), key=lambda r: (r["topic"], r["day"]))]
    topics = {r["topic"]: {"topic": r["topic"], **_figures(r), "attempts_histogram": [], "top_errors": []}
              for r in sorted((r for r in figures if r["all_days"] and not r["all_topics"]),
                              key=lambda r: r["topic"])}
    # rows per origin, per topic and attempts, and per attempts
    counts = sql("""SELECT origin, topic, attempts, GROUPING(origin) AS any_origin, GROUPING(topic) AS all_topics,
                           COUNT(*) AS n
                    FROM outbox_report_rows GROUP BY GROUPING SETS ((origin), (topic, attempts), (attempts))""").collect()
    origin = {r["origin"]: int(r["n"]) for r in counts if not r["any_origin"]}
    for r in sorted((r for r in counts if r["any_origin"] and not r["all_topics"]),
                    key=lambda r: (r["topic"], r["attempts"])):
        topics[r["topic"]]["attempts_histogram"].append({"attempts": int(r["attempts"]), "rows": int(r["n"])})
    histogram = [{"attempts": int(r["attempts"]), "rows": int(r["n"])}
                 for r in sorted((r for r in counts if r["any_origin"] and r["all_topics"]), key=lambda r: r["attempts"])]
    for r in sql(f"""SELECT topic, error, n FROM (
                       SELECT topic, error, n, ROW_NUMBER() OVER (PARTITION BY topic ORDER BY n DESC, error) AS k
                       FROM (SELECT topic, COALESCE(last_error, '(no error recorded)') AS error, COUNT(*) AS n
                             FROM outbox_report_rows WHERE status = 4 GROUP BY 1, 2))
                     WHERE k <= {TOP_ERRORS} ORDER BY topic, k""").collect():
        topics[r["topic"]]["top_errors"].append({"error": r["error"], "rows": int(r["n"])})
    return {
        "generated_at": datetime.now(UTC).isoformat(),
        "sources": {**sources, "live_rows": origin.get(0, 0), "archive_rows": origin.get(1, 0)},
        "totals": {**totals, "attempts_histogram": histogram},
        "days": days,
        "topics": list(topics.values()),
    }


# -- HTML ------------------------------------------------------------------------------------
def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def charts(report: dict[str, Any]) -> dict[str, str]:
    """The report's charts as base64 PNG, drawn off-screen (Agg)."""
    return {name: _png(figure) for name, figure in figures(report).items()}


def _legend_beside(ax: Any) -> Any:
    """The legend to the right of the plot, where it can never cover a bar (the saved
    figure's tight bounding box takes it in)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The report's charts as matplotlib figures (Agg), by name."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, Any] = {}
    per_day: dict[str, dict[str, int]] = {}
    for d in report["days"]:
        slot = per_day.setdefault(d["day"], {"delivered": 0, "dead": 0, "pending": 0})
        for key in slot:
            slot[key] += d[key]
    days = sorted(per_day)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    bottom = [0] * len(days)
    for key, colour in (("delivered", "#2e7d32"), ("dead", "#c62828"), ("pending", "#f9a825")):
        values = [per_day[d][key] for d in days]
        ax.bar(days, values, bottom=bottom, label=key, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("Events per day (UTC) by outcome")
    ax.set_ylabel("events")
    _legend_beside(ax)
    ax.tick_params(axis="x", rotation=45)
    out["events_per_day"] = fig

    topics = [t for t in report["topics"] if t["latency_p50_s"] is not None]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.27
    for n, (key, colour) in enumerate((("latency_p50_s", "#1565c0"), ("latency_p95_s", "#6a1b9a"),
                                       ("latency_p99_s", "#ad1457"))):
        ax.bar([i + (n - 1) * width for i in range(len(topics))], [t[key] for t in topics], width,
               label=key.split("_")[1], color=colour)
    # Plain text: between two "$" a topic was mathtext, drawn as a formula or failing the report.
    ax.set_xticks(range(len(topics)), [t["topic"] for t in topics], parse_math=False)
    ax.set_title("Created-to-processed latency of delivered events")
    ax.set_ylabel("seconds")
    _legend_beside(ax)
    out["latency"] = fig

    fig, ax = plt.subplots(figsize=(9, 3.2))
    hist = report["totals"]["attempts_histogram"]
    ax.bar([str(h["attempts"]) for h in hist], [h["rows"] for h in hist], color="#37474f")
    ax.set_title("Attempts per event")
    ax.set_xlabel("attempts")
    ax.set_ylabel("events")
    out["attempts"] = fig
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_html(report: dict[str, Any]) -> str:
    e = html.escape
    images = charts(report)
    t = report["totals"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>outbox report</title><style>"
        "body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#eee}"
        "td.l{text-align:left}img{display:block;margin:1em 0;max-width:100%}</style></head><body>",
        "<h1>Outbox report</h1>",
        f"<p>Generated {e(report['generated_at'])}; table {e(str(report['sources'].get('table')))} "
        f"({report['sources']['live_rows']} live rows), archive {e(str(report['sources'].get('archive')))} "
        f"({report['sources']['archive_rows']} rows); since {e(str(report['sources'].get('since') or 'the start'))}."
        "</p>",
        f"<p><b>{t['events']}</b> events: {t['delivered']} delivered, {t['dead']} dead, {t['pending']} pending; "
        f"latency p50 {_seconds(t['latency_p50_s'])} s, p95 {_seconds(t['latency_p95_s'])} s, "
        f"p99 {_seconds(t['latency_p99_s'])} s.</p>",
    ]
    for key, alt in (("events_per_day", "events per day"), ("latency", "latency per topic"),
                     ("attempts", "attempts histogram")):
        parts.append(f"<img alt='{alt}' src='data:image/png;base64,{images[key]}'>")
    parts.append("<h2>Topics</h2><table><tr><th>topic</th><th>events</th><th>delivered</th><th>dead</th>"
                 "<th>pending</th><th>p50 s</th><th>p95 s</th><th>p99 s</th><th>top errors of dead rows</th></tr>")
    for topic in report["topics"]:
        errors = "<br>".join(f"{x['rows']} &times; {e(x['error'])}" for x in topic["top_errors"]) or "-"
        parts.append(f"<tr><td class='l'>{e(topic['topic'])}</td><td>{topic['events']}</td>"
                     f"<td>{topic['delivered']}</td><td>{topic['dead']}</td><td>{topic['pending']}</td>"
                     f"<td>{_seconds(topic['latency_p50_s'])}</td><td>{_seconds(topic['latency_p95_s'])}</td>"
                     f"<td>{_seconds(topic['latency_p99_s'])}</td><td class='l'>{errors}</td></tr>")
    parts.append("</table><h2>Per topic and day</h2><table><tr><th>topic</th><th>day</th><th>events</th>"
                 "<th>delivered</th><th>dead</th><th>pending</th><th>p50 s</th><th>p95 s</th><th>p99 s</th></tr>")
    for d in report["days"]:
        parts.append(f"<tr><td class='l'>{e(d['topic'])}</td><td>{d['day']}</td><td>{d['events']}</td>"
                     f"<td>{d['delivered']}</td><td>{d['dead']}</td><td>{d['pending']}</td>"
                     f"<td>{_seconds(d['latency_p50_s'])}</td><td>{_seconds(d['latency_p95_s'])}</td>"
                     f"<td>{_seconds(d['latency_p99_s'])}</td></tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)


def write_report(spark: Any, out: str, report: dict[str, Any]) -> tuple[str, str]:
    """``out/report.json`` and ``out/report.html``; ``out`` is a local directory
    (the report is small and made on the driver)."""
    path = local_path(archive_uri(out))
    if path is None:
        raise PipelineError(f"--out {out}: the report is written on the driver; give a local directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
        (path / "report.html").write_text(render_html(report))
    except OSError as exc:
        raise PipelineError(f"--out {out}: cannot write the report: {exc}") from None
    return str(path / "report.json"), str(path / "report.html")


def check_out(out: str) -> None:
    """``--out``: a local directory, or a path where one can be made, checked before anything
    is read."""
    path = local_path(archive_uri(out))
    if path is None:
        raise PipelineError(f"--out {out}: the report is written on the driver; give a local directory")
    if path.exists() and not path.is_dir():
        raise PipelineError(f"--out {out}: exists and is not a directory")
    # A directory of its own made and removed where the report's would be: one that cannot
    # be made or written to was found only once every figure had been computed.
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        if there is not None:
            tempfile.TemporaryDirectory(prefix=".outbox-report-", dir=there).cleanup()
    except OSError as exc:
        raise PipelineError(f"--out {out}: cannot write the report: {exc}") from None


def run_report(spark: Any, *, store: OutboxStore | None, archive: str | None, out: str,
               since_delta: Any = None, partitions: int = 4,
               progress: Callable[[str], None] | None = None, archive_optional: bool = False) -> dict[str, Any]:
    """The report on the live table (``store``) and ``archive``, written to ``out``. The archive
    is checked before anything is read; one that is not there is an error, unless
    ``archive_optional`` (the location comes from OUTBOX_ARCHIVE_URI, which names it before its
    first run: docs/pipeline.md, "Report") and there is a live table: then it is looked for once
    the live table is read (a first archive run meanwhile has its rows there), and while no run
    has written it the report covers the live table alone and says so."""
    check_out(out)
    if archive and (not archive_optional or store is None):
        check_archive(spark, archive)  # before anything is read
    since = None
    if since_delta is not None:
        if store is None:
            raise PipelineError("--since needs the database (its clock defines 'now')")
        since = db_cutoff(store, since_delta)
    frame, sources = report_frame(spark, store, archive, since, partitions, archive_optional=archive_optional,
                                  warn=progress)
    report = compute_report(spark, frame, sources)
    json_path, html_path = write_report(spark, out, report)
    if progress:
        progress(f"report: {report['totals']['events']} events over {len(report['topics'])} topic(s) -> "
                 f"{json_path}, {html_path}")
    return report
