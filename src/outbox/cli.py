"""The ``outbox`` command. Every subcommand reads the OUTBOX_* settings; errors exit
non-zero with one line that says what went wrong."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import click

from .commands.oneline import one_line_errors as _one_line_errors
from .core.config import Settings, get_settings
from .core.errors import ConfigError
from .core.model import Status
from .core.names import KINDS
from .core.options import Options, coerce
from .core.redact import install_filter, printable
from .storage.engines.describe import describe_database, missing_driver_hint
from .storage.store import OutboxStore

#: The store the running command opened, so an error can be explained (missing table).
_opened: list[OutboxStore] = []


def _store() -> OutboxStore:
    """The configured store. Says on stderr which database and table it uses, every time:
    with no OUTBOX_DATABASE_URL that is ./outbox.db, which should never be a surprise."""
    settings = get_settings()
    store = OutboxStore.from_settings(settings)
    click.echo(f"outbox: database {describe_database(settings.database_url)}, table {store.engine.table}",
               err=True)
    _opened.append(store)
    return store


def _explain(exc: Exception) -> str | None:
    """A driver error of a command, in the user's terms: which of connection, table is wrong.
    Not the missing table for ``outbox migrate``, which makes it: its own error says why it
    could not (it said to run ``outbox migrate``, found in review)."""
    hint = missing_driver_hint(exc)
    if hint is not None or not _opened:
        return hint
    context = click.get_current_context(silent=True)
    migrating = context is not None and context.info_name == "migrate"
    store = _opened[-1]
    if store.connect_failed(exc):  # no new try: against a silent server it waits its bound again
        return _cannot_connect(exc)
    store.close()
    try:
        store.connection()
    except Exception as connect_error:  # noqa: BLE001 - whatever fails to connect is the explanation
        return _cannot_connect(connect_error)
    if migrating:
        store.close()
        return None
    try:
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"SELECT id FROM {store.engine.table} WHERE 1 = 0")
    except Exception:  # noqa: BLE001 - the probe query failing means the table is not there, or cannot be read
        return store.unreadable() or store.engine.missing_table_hint()
    finally:
        store.close()
    return None


def _cannot_connect(error: Exception) -> str:
    detail = " ".join(str(error).split()) or type(error).__name__
    return missing_driver_hint(error) or f"cannot connect to the database: {type(error).__name__}: {detail}"


class SettingValue(click.ParamType):
    """An option that stands in for a setting, read by the setting's own rule (type, bounds,
    validator: ``outbox.core.options.coerce``), so the two accept the same values."""

    def __init__(self, family: type[Options], setting: str) -> None:
        self.setting = setting
        self.how = family.declared()[setting][1]
        self.name = self.how.kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        shown = param.opts[0] if param is not None else self.setting
        try:
            return coerce(self.how, shown, value, show_given=False)
        except ConfigError as exc:
            raise click.UsageError(f"{exc} (the rule of {self.setting})", ctx) from None


#: Every command's failure as one line, driver errors explained (``outbox.commands.oneline``).
one_line_errors = functools.partial(_one_line_errors, explain=_explain)


class OneLineGroup(click.Group):
    """The top-level group: a usage error (a missing argument, a bad option value, an unknown
    command) is one line, ``error: <message>``, exit status 2 as click gives it; click printed
    the usage, a hint and a blank line before it (found in review). ``--help`` shows the usage."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _usage_on_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_on_one_line():  # subcommands and their groups are parsed in here
            return super().invoke(ctx)


@contextlib.contextmanager
def _usage_on_one_line() -> Iterator[None]:
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:  # `outbox`, `outbox pipeline`: the help, as asked
        raise
    except click.UsageError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        raise click.exceptions.Exit(exc.exit_code) from None


#: ``-h`` as well as ``--help``, on every command.
HELP_OPTION_NAMES = ["-h", "--help"]


def run_as_program(command: click.Command, args: list[str], prog_name: str) -> None:
    """Run ``command``, an ``outbox`` subcommand, as a program of its own, as ``outbox`` runs
    it: ``-h``, usage errors as one ``error:`` line with status 2, failures as the command
    says them. ``manage.py outbox_*`` runs so; before, a usage error there was click's usage,
    a hint, a blank line and ``Error: ...``, and ``-h`` was refused (found in review)."""
    try:
        with _usage_on_one_line():
            code = command.main(args=args, prog_name=prog_name, standalone_mode=False,
                                help_option_names=HELP_OPTION_NAMES)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # a group run with no command shows its help
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    if isinstance(code, int) and code:
        sys.exit(code)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": HELP_OPTION_NAMES})
@click.version_option(package_name="outbox-relay")
@click.option("-v", "--verbose", is_flag=True, help="Log retries and progress to stderr.")
def main(verbose: bool) -> None:
    """outbox-relay: relay rows of a transactional outbox table to a message broker.

    Configured by OUTBOX_* settings: CELERY_CONFIG_MODULE's keys first, then the
    environment, then Django settings when DJANGO_SETTINGS_MODULE is set (README,
    "Configuration"); the database is OUTBOX_DATABASE_URL (default sqlite:///outbox.db,
    in the current directory).
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.ERROR, format="%(levelname)s %(message)s")
    install_filter()  # passwords never reach stderr, whatever logs them
    # Configuration warnings (settings that are ignored) are shown even without -v.
    logging.getLogger("outbox.core.config").setLevel(logging.INFO if verbose else logging.WARNING)


@main.command()
@click.option("--native-json", is_flag=True,
              help="SQL Server 2025+ / Azure SQL: use the json column type (other engines: ignored, said so).")
@one_line_errors
def migrate(native_json: bool) -> None:
    """Create the outbox table and indexes, or repair a partial deployment. Idempotent.

    When OUTBOX_CELERY_BROKER_URL selects the database broker (outboxdb+...), its queue
    tables are created or repaired too (docs/transport.md)."""
    store = _store()
    if native_json and not store.engine.native_json:
        click.echo(f"outbox: --native-json is for SQL Server only: ignored on {store.engine.name}, whose table "
                   "keeps its own JSON type and check", err=True)
    done = store.migrate_reporting(native_json=native_json)
    before, after = done.before, done.after
    where = f"{store.engine.table} on {store.engine.name}"
    # Another migration of the table ran first: said, so that nothing it did is claimed here.
    took = f"{done.waited_s:.1f} s" if (done.waited_s or 0) >= 0.05 else "under 0.1 s"  # SQLite's: milliseconds
    waited = (f" (waited {took} for another migration of the table to finish first; what that "
              "one changed, its own report says)") if done.waited_s else ""
    if before is None:
        click.echo(f"migrated {where}: created the table and its indexes")
    elif before != after or done.ran:
        changes = store.schema_changes(before, after) if after else []
        click.echo(f"migrated {where}: repaired" + (f" ({'; '.join(changes)})" if changes else "") + waited)
    else:
        click.echo(f"migrated {where}: nothing to change" + waited)
    left = store.column_problem()
    if left is not None:  # what migrate does not convert itself, said where the operator looks
        click.echo(f"left as it is: {store.engine.table}: {left}")
    broker_url = get_settings().broker_url
    from .transport import is_transport_url, migrate_queue_tables
    if is_transport_url(broker_url):
        from .transport.options import workers_transport_options
        # The worker's options, its Celery config module's included. Only the relay's were
        # read, so a queue_table or queue_schema set there was migrated under the default
        # name, and a worker without DDL rights failed at start (found in review).
        options = workers_transport_options()
        tables = migrate_queue_tables(broker_url, table=options.get("queue_table"),
                                      schema=options.get("queue_schema"))
        click.echo(f"migrated {tables.table} and {tables.bindings} (Celery's broker) on {tables.engine.name}")


@main.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: counts (per status), dead, oldest_pending_age_s (null: none).")
@one_line_errors
def status(as_json: bool) -> None:
    """Counts per status, the age of the oldest undelivered row, and the dead count."""
    stats = _store().stats()
    if as_json:
        click.echo(json.dumps(stats.as_dict(), sort_keys=True))
        return
    for name, count in stats.counts.items():
        click.echo(f"{name:>8}: {count}")
    age = "-" if stats.oldest_pending_age_s is None else f"{stats.oldest_pending_age_s:.1f}s"
    click.echo(f"oldest undelivered: {age}")


@main.command()
@click.argument("kinds", nargs=-1, type=click.Choice(KINDS))
@one_line_errors
def queues(kinds: tuple[str, ...]) -> None:
    """This outbox's queue names on the task runner's broker, comma-separated (for a worker's
    -Q): KINDS of claim, publish, ack, purge, all by default. They derive from OUTBOX_TABLE,
    OUTBOX_SCHEMA and OUTBOX_DATABASE_URL, or OUTBOX_NAMESPACE when set."""
    names = get_settings().queues
    click.echo(",".join(getattr(names, kind) for kind in (kinds or KINDS)))


@main.group()
def dead() -> None:
    """Inspect and requeue dead-lettered rows."""


@dead.command("list")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--after-id", default=0, show_default=True, type=click.IntRange(0), help="Page after this id.")
@click.option("--topic", "topics", metavar="NAME", multiple=True,
              help="Only the dead rows of this topic; repeat it for several.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@one_line_errors
def dead_list(limit: int, after_id: int, topics: tuple[str, ...], as_json: bool) -> None:
    """List dead rows, oldest first, with their last error."""
    rows = _store().dead_list(limit=limit, after_id=after_id, topics=topics)
    if not rows:
        # Say it (on stderr with --json, whose stdout stays one object per line).
        click.echo("no dead rows" + (f" of topic {', '.join(map(printable, sorted(set(topics))))}" if topics else "")
                   + (f" after id {after_id}" if after_id else ""), err=as_json)
    for row in rows:
        if as_json:
            click.echo(json.dumps({**row.__dict__, "processed_at": row.processed_at.isoformat()
                                   if row.processed_at else None}))
        else:
            click.echo(f"{row.id}\t{printable(row.topic)}\t{printable(row.aggregate_type)}/"
                       f"{printable(row.aggregate_id)}\tattempts={row.attempts}\t{printable(row.last_error or '')}")


@dead.command("requeue")
@click.argument("ids", nargs=-1, type=click.IntRange(1))
@click.option("--all", "everything", is_flag=True, help="Requeue every dead row (except permanent ones).")
@click.option("--topic", "topics", metavar="NAME", multiple=True,
              help="Requeue every dead row of this topic (except permanent ones), as --all does for "
                   "every topic; repeat it for several.")
@click.option("--force", is_flag=True,
              help="Also requeue rows whose recorded reason is permanent (undecodable, poison).")
@one_line_errors
def dead_requeue(ids: tuple[int, ...], everything: bool, topics: tuple[str, ...], force: bool) -> None:
    """Make dead rows pending again with a fresh attempt budget (give IDS, --topic or --all).

    Prints what was requeued, per topic. A row whose last_error starts with a permanent
    reason ("undecodable row: ", "poison: ") would only fail again: it is refused unless
    --force (fix the row, or raise the limit, first). With IDS it is all or nothing: an
    id that does not exist, is not dead, or is refused is reported, nothing is requeued,
    and the exit status is 1. --all requeues the rest and reports the rows it kept;
    --topic the same over the dead rows of the topics named (with --all too: --all is
    then those topics' every row).

    Order: a requeued event is delivered after the later events of its aggregate that were
    delivered while it was dead (consumers see an old event after newer ones), and it holds
    back its aggregate's pending events until it is done or dead again. Its last_error
    stays on the row (docs/relay.md, "Requeueing dead rows").
    """
    if not ids and not everything and not topics:
        raise click.UsageError("give the ids to requeue, --topic, or --all")
    if ids and (everything or topics):
        raise click.UsageError("give either ids or --all/--topic, not both")
    result = _store().requeue(list(ids) if ids else None, force=force, topics=topics)
    problems = [f"no row with id {id}" for id in result.missing]
    problems += [f"row {id} is not dead (status {Status(status).name.lower()})"
                 for id, status in sorted(result.not_dead.items())]
    problems += [f"row {row.id} ({printable(row.topic)}) has a permanent reason, use --force to requeue it: "
                 f"{printable(row.last_error)}" for row in result.refused]
    if problems:  # one line, as every error of the command line
        click.echo("error: nothing was requeued: " + "; ".join(" ".join(p.split()) for p in problems), err=True)
        sys.exit(1)
    click.echo(f"requeued {result.count} row(s)")
    for topic, count in result.requeued.items():
        click.echo(f"  {printable(topic)}: {count}")
    if result.permanent:
        click.echo(f"kept {sum(result.permanent.values())} dead row(s) with a permanent reason "
                   "(use --force to requeue them too)")
        for topic, count in result.permanent.items():
            click.echo(f"  {printable(topic)}: {count}")


@main.command()
@click.option("--older-than-days", type=SettingValue(Settings, "OUTBOX_RETENTION_DAYS"), default=None,
              help="Retention in days (default: OUTBOX_RETENTION_DAYS).")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--max-rows", default=100_000, show_default=True, type=click.IntRange(1))
@one_line_errors
def purge(older_than_days: float | None, batch: int, max_rows: int) -> None:
    """Delete done rows older than the retention, in small chunks. Dead rows are kept.

    At most about --max-rows rows per run: a run that reaches it says so, and the next run
    carries on."""
    if get_settings().archive_uri:
        click.echo("purged nothing: archiving is configured (OUTBOX_ARCHIVE_URI), so rows are deleted by "
                   "`outbox pipeline archive` once they are archived")
        return
    days = get_settings().retention_days if older_than_days is None else older_than_days
    count = _store().purge_done(timedelta(days=days), batch=batch, max_rows=max_rows)
    click.echo(f"purged {count} done row(s) older than {days:g} day(s)")
    if count >= max_rows:  # the cap, not the end of the old rows, may have stopped it
        click.echo(f"stopped at --max-rows {max_rows}: older done rows may be left; run it again "
                   "(or raise --max-rows)")


@main.command()
@click.option("--probe", "probe_topic", metavar="TOPIC", default=None,
              help="Kafka only: also produce one probe message to TOPIC (header x-outbox-probe; consumers see it).")
@one_line_errors
def check(probe_topic: str | None) -> None:
    """Check that this deployment can relay, in one report: configuration, database
    reachable, table and indexes as `outbox migrate` makes them (on PostgreSQL, with its
    vacuum), the task runner's broker (Dramatiq's when OUTBOX_DRAMATIQ_BROKER_URL is set,
    else Celery's) and the destination reachable, and a queue bound to the exchange (what
    AMQP lets us see; on Kafka, the topics). Exits 1 when a check fails; warnings alone
    exit 0."""
    from .commands.doctor import FAIL, report, run_checks

    results = run_checks(probe_topic=probe_topic)
    click.echo(report(results))
    if any(r.state == FAIL for r in results):
        sys.exit(1)


def _seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and value > 0):  # NaN passes any range's comparisons
        raise click.BadParameter(f"a finite number of seconds above 0, not {value:g}", ctx, param)
    return value


@main.command()
@click.option("--timeout", default=30.0, show_default=True, callback=_seconds,
              help="Seconds to wait for every event to arrive.")
@click.option("--keep", is_flag=True, help="Keep the demo's SQLite outbox (default: removed at the end).")
@one_line_errors
def demo(timeout: float, keep: bool) -> None:
    """Run the whole pipeline on the embedded default (SQLite, in-memory brokers, an
    in-process Celery worker) and check that every committed event arrives in order.
    Its temporary files are removed at the end (unless --keep)."""
    from .commands.demo import run_demo
    if not run_demo(timeout_s=timeout, keep=keep):
        # One `error:` line, as every failure here (click's own said `Error: ...` and no more).
        click.echo("error: the demo's checks failed (the [FAILED] lines above); on a slow or busy machine give it "
                   f"longer: --timeout (this run: {timeout:g} s)", err=True)
        sys.exit(1)


# The Spark jobs: the group imports no PySpark until one of its commands runs.
from .pipeline.commands import pipeline as _pipeline  # noqa: E402

main.add_command(_pipeline)


if __name__ == "__main__":  # pragma: no cover
    main()
