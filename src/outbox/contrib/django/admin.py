"""The outbox in Django's admin: rows by status, dead rows with their error, and a
"requeue" action for dead rows (the relay's own requeue statement, then a wake-up after
commit). Rows are read-only: the relay owns them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import router, transaction

from .models import OutboxEvent, Status


@admin.register(OutboxEvent)
class OutboxEventAdmin(admin.ModelAdmin):
    list_display = ("id", "topic", "aggregate_type", "aggregate_id", "status", "attempts", "created_at",
                    "processed_at", "error")
    list_filter = ("status", "topic")
    search_fields = ("=message_id", "=aggregate_id", "topic")
    ordering = ("-id",)
    actions = ["requeue_dead"]
    list_per_page = 100

    def get_fields(self, request: Any, obj: Any = None) -> list[str]:
        # The stored partition_key is empty when the event had no key: it is then the
        # aggregate id (the published partition_key header), which the page says.
        return ["partition" if f.name == "partition_key" else f.name for f in OutboxEvent._meta.fields]

    def get_readonly_fields(self, request: Any, obj: Any = None) -> list[str]:
        return self.get_fields(request, obj)

    @admin.display(description="partition key")
    def partition(self, obj: OutboxEvent) -> str:
        if obj.partition_key is not None:
            return obj.partition_key
        return f"{obj.aggregate_id} (the aggregate id: no key given)"

    @admin.display(description="last error")
    def error(self, obj: OutboxEvent) -> str:
        text = obj.last_error or ""
        return text if len(text) <= 200 else text[:200] + "…"

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False  # the detail page is read-only

    def has_requeue_permission(self, request: Any) -> bool:
        return request.user.has_perm("outbox.change_outboxevent")

    @admin.action(description="Requeue selected dead events", permissions=["requeue"])
    def requeue_dead(self, request: Any, queryset: Any) -> None:
        dead = list(queryset.filter(status=Status.DEAD).values_list("id", flat=True))
        skipped = queryset.count() - len(dead)
        if dead:
            from . import schema, wake_on_commit

            using = router.db_for_write(OutboxEvent)
            with transaction.atomic(using=using):
                from django.db import connections

                count = schema.requeue_dead(connections[using], dead)
                wake_on_commit(using)
            self.message_user(request, f"Requeued {count} dead event(s).", messages.SUCCESS)
        if skipped:
            self.message_user(request, f"{skipped} selected event(s) were not dead and were left alone.",
                              messages.WARNING)
