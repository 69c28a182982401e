"""``outbox pipeline archive|report|replay``: the command line of the Spark jobs.

Imported by ``outbox.cli`` whatever is installed; PySpark is imported only when a
job runs, and its absence is reported as one line naming the extra to install.
"""

from __future__ import annotations

import json

import click

from ..commands.oneline import one_line_errors
from ..core.config import get_settings, validate_database_url
from ..core.redact import printable
from ..storage.store import OutboxStore
from .common import DELETE_CHUNK, DELETE_CONNECTIONS, archive_uri, crash_hook_from_env, parse_duration

#: One line per failure, its first line only: Spark's errors run to pages (``outbox.commands.oneline``).
_errors = one_line_errors(first_line=True)


def _progress(message: str) -> None:
    click.echo(message, err=True)


def _store(url: str | None = None) -> OutboxStore:
    """The configured store, or ``--to-url``'s (checked as the setting is, naming the option:
    its errors named OUTBOX_DATABASE_URL, found in review). It makes no SQLite file: it made an
    empty one and said to run `outbox migrate`, which made a second, empty outbox (found in review)."""
    settings = get_settings()
    if url is not None:
        validate_database_url(url, "--to-url")
    return OutboxStore(url or settings.database_url, table=settings.table, schema=settings.schema, existing=True)


def _warn_unless_the_relay_knows(target: str, configured: str | None, retention_days: float) -> None:
    """The relay holds its purge back only while OUTBOX_ARCHIVE_URI is set (docs/pipeline.md,
    "Purge and archive"): an archive given --to without it, or with another location there,
    says on stderr that the purge still deletes done rows no run archived."""
    if configured and archive_uri(configured) == archive_uri(target):
        return
    setting = f"is {configured}, not --to's {target}" if configured else "is not set"
    click.echo(f"warning: OUTBOX_ARCHIVE_URI {setting}: unless the workers and beat have it set, the relay's purge "
               f"(beat's outbox.purge, `outbox purge`) still deletes done rows older than {retention_days:g} days "
               f"(OUTBOX_RETENTION_DAYS) that no run archived; set OUTBOX_ARCHIVE_URI={target} for the workers "
               "and beat", err=True)


master_option = click.option("--master", default=None, metavar="URL",
                             help="Spark master (default: the active session's, else local[*]); "
                                  "e.g. spark://host:7077, yarn, k8s://...")


@click.group()
def pipeline() -> None:
    """The data pipeline on Apache Spark: archive, report and replay the outbox's history.

    Needs the spark extra (PySpark 4; Java 17): pip install "<outbox-relay checkout>[spark]"
    (the package is not on PyPI: install from a checkout or git+URL, README "Install").
    The database is OUTBOX_DATABASE_URL / OUTBOX_TABLE / OUTBOX_SCHEMA. See docs/pipeline.md.
    """


@pipeline.command()
@click.option("--older-than", "older_than", default=None, metavar="DURATION",
              help="Archive rows processed longer ago than this: <n>s|m|h|d (default: OUTBOX_RETENTION_DAYS).")
@click.option("--include-dead", is_flag=True, help="Archive (and delete) dead rows too, not only done ones.")
@click.option("--to", "to", default=None, metavar="DIR_OR_URI",
              help="Archive location: a directory, file://, hdfs://, s3a://... (default: OUTBOX_ARCHIVE_URI).")
@click.option("--delete-chunk", default=DELETE_CHUNK, show_default=True, type=click.IntRange(1, 100_000),
              help="Ids per DELETE statement.")
@click.option("--delete-connections", default=DELETE_CONNECTIONS, show_default=True, type=click.IntRange(1, 64),
              help="Connections deleting chunks at once (SQLite: one, whatever this says).")
@click.option("--partitions", default=4, show_default=True, type=click.IntRange(1, 10_000),
              help="Tasks reading in parallel.")
@click.option("--split", type=click.Choice(["topic", "id"]), default="id", show_default=True,
              help="What a task reads: an id range (a file per task, topic and date) or whole topics "
                   "(fewer files; the database walks the ids once per task).")
@click.option("--writer", type=click.Choice(["auto", "arrow", "spark"]), default="auto", show_default=True,
              help="Who writes the Parquet files: arrow (each task, with pyarrow; a filesystem path only), "
                   "spark (Spark's writer; any URI) or auto (arrow for a path, spark otherwise).")
@click.option("--wait", "wait", default="0s", show_default=True, metavar="DURATION",
              help="When another run holds the archive, wait up to this long for it: <n>s|m|h|d "
                   "(0s: refuse at once, naming that run).")
@master_option
@click.option("--json", "as_json", is_flag=True, help="Print the run's summary as JSON.")
@_errors
def archive(older_than: str | None, include_dead: bool, to: str | None, delete_chunk: int,
            delete_connections: int, partitions: int, split: str, writer: str, wait: str, master: str | None,
            as_json: bool) -> None:
    """Move done (and, with --include-dead, dead) rows older than the cut-off into a
    Parquet archive partitioned by topic and date, then delete exactly those rows.
    Idempotent: a re-run after a crash at any point neither duplicates nor skips.
    One run of an archive at a time: a second is refused, naming the first (or --wait)."""
    settings = get_settings()
    wait_s = parse_duration(wait, "--wait").total_seconds()
    delta = (parse_duration(older_than, "--older-than") if older_than is not None
             else parse_duration(f"{int(settings.retention_days * 86400)}s", "OUTBOX_RETENTION_DAYS"))
    target = to or settings.archive_uri
    if not target:
        raise click.UsageError("give --to DIR_OR_URI (or set OUTBOX_ARCHIVE_URI)")
    from .archive import Archiver, check_table
    from .session import import_pyspark, spark_session
    from .stage import writer_for

    import_pyspark()  # a missing extra first: nothing below can run without it
    writer_for(writer, archive_uri(target))  # a writer that cannot serve the location: refused before Spark starts
    store = _store()
    try:
        check_table(store)  # before Spark starts: the error is then one line (docs/pipeline.md, "Errors")
        _warn_unless_the_relay_knows(target, settings.archive_uri, settings.retention_days)
        spark = spark_session(master, "outbox-archive")
        result = Archiver(spark, store, target, on_step=crash_hook_from_env(), delete_chunk=delete_chunk,
                          delete_connections=delete_connections, partitions=partitions, progress=_progress,
                          source_options={"split": split}, wait_s=wait_s, writer=writer).run(
                              delta, include_dead=include_dead)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True))
    else:
        click.echo(f"archived {result.archived} row(s), deleted {result.deleted} from the outbox"
                   + (f", kept {result.kept} that changed since" if result.kept else "")
                   + (f"; finished {len(result.recovered)} interrupted run(s)" if result.recovered else ""))


@pipeline.command()
@click.option("--since", default=None, metavar="DURATION",
              help="Only events created within this long before now: <n>s|m|h|d (default: everything).")
@click.option("--out", "out", required=True, metavar="DIR", help="Directory for report.json and report.html.")
@click.option("--archive", "archive_location", default=None, metavar="DIR_OR_URI",
              help="The archive to include (default: OUTBOX_ARCHIVE_URI, left out with a warning while no "
                   "run has written it; none when unset). A given one must exist.")
@click.option("--no-live", is_flag=True, help="Report on the archive alone (no database).")
@click.option("--partitions", default=4, show_default=True, type=click.IntRange(1, 10_000),
              help="Id ranges of the live table read in parallel.")
@master_option
@_errors
def report(since: str | None, out: str, archive_location: str | None, no_live: bool, partitions: int,
           master: str | None) -> None:
    """Per topic and day: events, delivered, dead, pending, latency p50/p95/p99,
    attempts histogram and top errors of dead rows, from the archive plus the live
    table. Writes DIR/report.json and a self-contained DIR/report.html with charts."""
    delta = parse_duration(since, "--since") if since is not None else None
    archive_optional = archive_location is None  # the setting's: there before the first archive run
    archive_location = archive_location or get_settings().archive_uri
    if no_live and not archive_location:
        raise click.UsageError("--no-live needs --archive (or OUTBOX_ARCHIVE_URI)")
    from .archive import check_local_archive, check_table
    from .report import check_out, run_report
    from .session import import_pyspark, spark_session

    import_pyspark()  # a missing extra first: nothing below can run without it

    check_out(out)
    if archive_location and (not archive_optional or no_live):  # the checks of run_report, before Spark starts
        check_local_archive(archive_location)
    store = None if no_live else _store()
    try:
        if store is not None:
            check_table(store)
        spark = spark_session(master, "outbox-report")
        result = run_report(spark, store=store, archive=archive_location, out=out, since_delta=delta,
                            partitions=partitions, progress=_progress, archive_optional=archive_optional)
    finally:
        if store is not None:
            store.close()
    t = result["totals"]
    click.echo(f"{t['events']} events ({t['delivered']} delivered, {t['dead']} dead, {t['pending']} pending) "
               f"in {len(result['topics'])} topic(s); wrote {out}/report.json and {out}/report.html")


@pipeline.command()
@click.option("--from", "source", required=True, metavar="DIR_OR_URI", help="The archive to replay from.")
@click.option("--topic", default=None, help="Only this topic (must exist in the archive).")
@click.option("--aggregate-type", default=None, help="Only events of this aggregate type.")
@click.option("--aggregate-id", default=None, help="Only events of this aggregate id.")
@click.option("--since", default=None, metavar="WHEN",
              help="Only events created at or after WHEN: a duration ago (<n>s|m|h|d) or an ISO-8601 time (UTC).")
@click.option("--until", default=None, metavar="WHEN", help="Only events created before WHEN (same forms).")
@click.option("--dry-run", is_flag=True, help="Change nothing: print the counts per topic and a sample.")
@click.option("--to-url", default=None, metavar="URL",
              help="The outbox database to enqueue into (default: OUTBOX_DATABASE_URL; table OUTBOX_TABLE).")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 10_000),
              help="Events per transaction.")
@click.option("--partitions", default=4, show_default=True, type=click.IntRange(1, 10_000),
              help="Parallel tasks (each takes whole aggregates).")
@master_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_errors
def replay(source: str, topic: str | None, aggregate_type: str | None, aggregate_id: str | None,
           since: str | None, until: str | None, dry_run: bool, to_url: str | None, batch: int, partitions: int,
           master: str | None, as_json: bool) -> None:
    """Enqueue archived events again, in their original order per aggregate, with new
    message ids derived from the originals (uuid5), so a re-run enqueues nothing twice."""
    from .common import parse_point_in_time
    from .replay import run_replay, utc_now

    now = utc_now()
    since_dt = parse_point_in_time(since, "--since", now) if since is not None else None
    until_dt = parse_point_in_time(until, "--until", now) if until is not None else None
    from .archive import check_local_archive, check_table
    from .session import import_pyspark, spark_session

    import_pyspark()  # a missing extra first: nothing below can run without it

    if to_url is not None:  # its form, no connection: a dry run refuses what the run would
        validate_database_url(to_url, "--to-url")
    check_local_archive(source)  # this and the table before Spark starts (docs/pipeline.md, "Errors")
    target = None if dry_run else _store(to_url)
    try:
        if target is not None:
            check_table(target)
        spark = spark_session(master, "outbox-replay")
        result = run_replay(spark, archive=source, target=target, topic=topic, aggregate_type=aggregate_type,
                            aggregate_id=aggregate_id, since=since_dt, until=until_dt, dry_run=dry_run,
                            batch=batch, partitions=partitions, progress=_progress)
    finally:
        if target is not None:
            target.close()
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
        return
    if dry_run:
        click.echo(f"dry run: would replay {result['events']} event(s); nothing was changed")
        for name, count in result["per_topic"].items():
            click.echo(f"  {printable(name)}: {count}")
        for s in result["sample"]:
            click.echo(f"  sample: id={s['id']} {printable(s['topic'])} {printable(s['aggregate'])} "
                       f"{printable(s['message_id'])} -> {s['new_message_id']}")
    else:
        click.echo(f"replayed {result['events']} event(s): {result['written']} written, "
                   f"{result['already_present']} already present")
