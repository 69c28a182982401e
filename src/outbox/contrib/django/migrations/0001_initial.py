"""Creates the outbox table with the relay's own DDL (``outbox.contrib.django.schema``), so
``manage.py migrate`` and Django's test runner make the same table as ``outbox migrate``
on every backend, mssql-django included. Reversing leaves the table (and its events) in
place: drop it by hand if you mean to."""

from django.db import migrations, models

from outbox.contrib.django.schema import model_table, run_relay_ddl


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    # MySQL commits DDL implicitly and SQL Server's guarded batches run on their own.
    atomic = False

    operations = [
        migrations.RunPython(run_relay_ddl, migrations.RunPython.noop, elidable=False),
        migrations.CreateModel(
            name="OutboxEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("message_id", models.CharField(max_length=64, unique=True)),
                ("topic", models.CharField(max_length=255)),
                ("aggregate_type", models.CharField(max_length=255)),
                ("aggregate_id", models.CharField(max_length=255)),
                ("partition_key", models.CharField(blank=True, max_length=255, null=True)),
                ("payload", models.JSONField()),
                ("headers", models.JSONField(default=dict)),
                ("trace_id", models.CharField(blank=True, max_length=255, null=True)),
                ("status", models.SmallIntegerField(choices=[(0, "pending"), (1, "claimed"), (2, "done"),
                                                             (3, "failed"), (4, "dead")], default=0)),
                ("attempts", models.IntegerField(default=0)),
                ("claimed_at", models.DateTimeField(blank=True, null=True)),
                ("next_retry_at", models.DateTimeField(blank=True, null=True)),
                ("created_at", models.DateTimeField()),
                ("processed_at", models.DateTimeField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True, null=True)),
                ("lease_token", models.CharField(blank=True, max_length=32, null=True)),
            ],
            options={"managed": False, "db_table": model_table(), "ordering": ["-id"],
                     "verbose_name": "outbox event"},
        ),
    ]
