"""Creates the relay's holders table (``<OUTBOX_TABLE>_holders``: one liveness record per relay
worker process, docs/internals.md "Lost workers") on databases whose outbox table 0001 made before
it existed. It runs the same guarded DDL as 0001 and ``outbox migrate``
(``outbox.contrib.django.schema.create_table``), which leaves what exists alone. Reversing
leaves the table in place."""

from django.db import migrations

from outbox.contrib.django.schema import run_relay_ddl


class Migration(migrations.Migration):
    dependencies = [("outbox", "0001_initial")]
    # MySQL commits DDL implicitly and SQL Server's guarded batches run on their own.
    atomic = False

    operations = [
        migrations.RunPython(run_relay_ddl, migrations.RunPython.noop, elidable=False),
    ]
