"""Runs the relay's guarded DDL again (``outbox.contrib.django.schema.create_table``), as 0003
does, so ``manage.py migrate`` rebuilds the claim's indexes of a table an earlier release made:
``claim_ready`` on ``(next_retry_at, id)`` (MySQL/MariaDB: ``(status, next_retry_at, id)``, and
``agg_id_id`` on ``(aggregate_id, status, id)``), so that a claim reads no row still waiting for
its retry (docs/internals.md, "Rows waiting for a later time are not read"). On PostgreSQL a
table holding rows gets them ``CONCURRENTLY`` after the steps' transaction, so the application's
enqueues go on meanwhile (docs/internals.md, "Index builds that hold no writer back"). Reversing
changes nothing."""

from django.db import migrations

from outbox.contrib.django.schema import run_relay_ddl


class Migration(migrations.Migration):
    dependencies = [("outbox", "0003_bring_forward")]
    # MySQL commits DDL implicitly, SQL Server's guarded batches run on their own, and
    # PostgreSQL's CREATE INDEX CONCURRENTLY runs in no transaction.
    atomic = False

    operations = [
        migrations.RunPython(run_relay_ddl, migrations.RunPython.noop, elidable=False),
    ]
