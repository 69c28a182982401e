"""``OutboxEvent``: the outbox table as a read-mostly Django model, for the admin.

Unmanaged: the table belongs to the relay (created by this app's migration with the
relay's DDL, see ``schema.py``). Rows are written by ``outbox.enqueue`` and changed by the
relay; the admin only reads them and requeues dead ones. The table is OUTBOX_TABLE in
OUTBOX_SCHEMA, as the migration and the relay have it (``schema.model_table``), on the
backend of the default database.
"""

from __future__ import annotations

from django.db import models

from .schema import model_table


class Status(models.IntegerChoices):
    PENDING = 0, "pending"
    CLAIMED = 1, "claimed"
    DONE = 2, "done"
    FAILED = 3, "failed"
    DEAD = 4, "dead"


class OutboxEvent(models.Model):
    id = models.BigAutoField(primary_key=True)
    message_id = models.CharField(max_length=64, unique=True)
    topic = models.CharField(max_length=255)
    aggregate_type = models.CharField(max_length=255)
    aggregate_id = models.CharField(max_length=255)
    partition_key = models.CharField(max_length=255, null=True, blank=True)
    payload = models.JSONField()
    headers = models.JSONField(default=dict)
    trace_id = models.CharField(max_length=255, null=True, blank=True)
    status = models.SmallIntegerField(choices=Status.choices, default=Status.PENDING)
    attempts = models.IntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    next_retry_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    processed_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    lease_token = models.CharField(max_length=32, null=True, blank=True)

    class Meta:
        managed = False
        db_table = model_table()
        ordering = ["-id"]
        verbose_name = "outbox event"

    def __str__(self) -> str:
        return f"{self.topic} {self.aggregate_type}/{self.aggregate_id} #{self.id}"
