"""The ``outbox`` command. Every subcommand reads the OUTBOX_* settings; errors exit
non-zero with one line that says what went wrong."""

from __future__ import annotations

import functools
import json
import logging
import sys
from datetime import timedelta
from typing import Any, Callable

import click

from .config import get_settings
from .errors import OutboxError
from .store import OutboxStore


def _store() -> OutboxStore:
    return OutboxStore.from_settings(get_settings())


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn any failure into ``error: ...`` on stderr and exit status 1."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except OutboxError as exc:
            click.echo(f"error: {exc}", err=True)
        except Exception as exc:  # driver errors: name the type, keep it to one line
            detail = " ".join(str(exc).split()) or type(exc).__name__
            click.echo(f"error: {type(exc).__name__}: {detail}", err=True)
        sys.exit(1)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-relay")
@click.option("-v", "--verbose", is_flag=True, help="Log retries and progress to stderr.")
def main(verbose: bool) -> None:
    """outbox-relay: relay rows of a transactional outbox table to a message broker.

    Configured by OUTBOX_* environment variables (see the README); the database is
    OUTBOX_DATABASE_URL (default sqlite:///outbox.db).
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.ERROR, format="%(levelname)s %(message)s")


@main.command()
@click.option("--native-json", is_flag=True, help="SQL Server 2025+ / Azure SQL: use the json column type.")
@one_line_errors
def migrate(native_json: bool) -> None:
    """Create the outbox table and indexes, or repair a partial deployment. Idempotent.

    When OUTBOX_CELERY_BROKER_URL selects the database broker (outboxdb+...), its queue
    tables are created or repaired too (docs/transport.md)."""
    store = _store()
    store.migrate(native_json=native_json)
    click.echo(f"migrated {store.engine.table} on {store.engine.name}")
    broker_url = get_settings().broker_url
    from .transport import is_transport_url, migrate_queue_tables
    if is_transport_url(broker_url):
        import os
        from .transport.options import transport_options
        table = transport_options(os.environ, visibility_timeout=1.0).get("queue_table")
        tables = migrate_queue_tables(broker_url, table=table)
        click.echo(f"migrated {tables.table} and {tables.bindings} (Celery's broker) on {tables.engine.name}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
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


@main.group()
def dead() -> None:
    """Inspect and requeue dead-lettered rows."""


@dead.command("list")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--after-id", default=0, show_default=True, type=click.IntRange(0), help="Page after this id.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@one_line_errors
def dead_list(limit: int, after_id: int, as_json: bool) -> None:
    """List dead rows, oldest first, with their last error."""
    for row in _store().dead_list(limit=limit, after_id=after_id):
        if as_json:
            click.echo(json.dumps({**row.__dict__, "processed_at": row.processed_at.isoformat()
                                   if row.processed_at else None}))
        else:
            click.echo(f"{row.id}\t{row.topic}\t{row.aggregate_type}/{row.aggregate_id}\t"
                       f"attempts={row.attempts}\t{row.last_error or ''}")


@dead.command("requeue")
@click.argument("ids", nargs=-1, type=int)
@click.option("--all", "everything", is_flag=True, help="Requeue every dead row.")
@one_line_errors
def dead_requeue(ids: tuple[int, ...], everything: bool) -> None:
    """Make dead rows pending again with a fresh attempt budget (give IDS or --all)."""
    if not ids and not everything:
        raise click.UsageError("give the ids to requeue, or --all")
    count = _store().requeue_dead(None if everything else list(ids))
    click.echo(f"requeued {count} row(s)")


@main.command()
@click.option("--older-than-days", type=float, default=None,
              help="Retention in days (default: OUTBOX_RETENTION_DAYS).")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--max-rows", default=100_000, show_default=True, type=click.IntRange(1))
@one_line_errors
def purge(older_than_days: float | None, batch: int, max_rows: int) -> None:
    """Delete done rows older than the retention, in small chunks. Dead rows are kept."""
    days = get_settings().retention_days if older_than_days is None else older_than_days
    count = _store().purge_done(timedelta(days=days), batch=batch, max_rows=max_rows)
    click.echo(f"purged {count} done row(s) older than {days:g} day(s)")


@main.command()
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for every event to arrive.")
@one_line_errors
def demo(timeout: float) -> None:
    """Run the whole pipeline on the embedded default (SQLite, in-memory brokers, an
    in-process Celery worker) and check that every committed event arrives in order."""
    from .demo import run_demo
    if not run_demo(timeout_s=timeout):
        raise click.ClickException("the demo's checks failed")


if __name__ == "__main__":  # pragma: no cover
    main()
