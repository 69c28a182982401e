"""Runs the relay's guarded DDL again (``outbox.contrib.django.schema.create_table``, as 0001 and
0002 and ``outbox migrate`` do), so ``manage.py migrate`` brings a table that 0001 and 0002 made
under an earlier release up to this one: PostgreSQL's autovacuum thresholds, indexes renamed from
an earlier release's names, columns of the contract a table lacks (docs/operations.md,
"Upgrading"). It leaves what exists alone; reversing changes nothing. A release that changes the
schema adds one such migration."""

from django.db import migrations

from outbox.contrib.django.schema import run_relay_ddl


class Migration(migrations.Migration):
    dependencies = [("outbox", "0002_holders")]
    # MySQL commits DDL implicitly and SQL Server's guarded batches run on their own.
    atomic = False

    operations = [
        migrations.RunPython(run_relay_ddl, migrations.RunPython.noop, elidable=False),
    ]
