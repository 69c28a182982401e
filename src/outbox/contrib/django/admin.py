"""The outbox in Django's admin: rows by status, dead rows with their error, and a
"requeue" action for dead rows (``outbox dead requeue``'s store call and rules, then a
wake-up after commit). Rows are read-only: the relay owns them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin, messages
from django.db import connections, router
from django.db.models import Count

from ...core.model import RequeueResult
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
        """``outbox dead requeue``'s rules through its own store call (``OutboxStore.requeue``
        on Django's connection): the selection is taken as ``--all`` takes every dead row,
        1,000 rows per transaction, and rows with a permanent reason are kept and named
        (docs/django.md, "Admin")."""
        from ...wake import atomic_on
        from . import schema, wake_on_commit

        using = router.db_for_write(OutboxEvent)
        store = schema.store_on(connections[using], lambda: atomic_on(connections[using]))  # IMMEDIATE on SQLite
        # Only the dead rows' ids are read, the others counted by status in the database: "select
        # all" of the unfiltered list is the whole table (docs/django.md, "Admin").
        selection = queryset.order_by()
        others = Counter({int(status): int(n) for status, n in selection.exclude(status=Status.DEAD)
                          .values_list("status").annotate(n=Count("pk"))})
        dead = list(selection.filter(status=Status.DEAD).values_list("id", flat=True))
        result = store.requeue(dead, all_or_nothing=False)
        if result.count:
            wake_on_commit(using)
            per_topic = ", ".join(f"{topic} {count}" for topic, count in result.requeued.items())
            self.message_user(request, f"Requeued {result.count} dead event(s): {per_topic}.", messages.SUCCESS)
        for line in refusals(result, others):
            self.message_user(request, line, messages.WARNING)


#: Rows named one by one in a message; the rest are counted.
LISTED = 20


def refusals(result: RequeueResult, others: Counter[int] | None = None) -> list[str]:
    """What the admin says about the selected rows ``result`` did not requeue, and why;
    ``others``: the selected rows that were not dead, counted by status."""
    lines = []
    statuses = Counter(Status(status).label for status in result.not_dead.values())
    statuses.update({Status(status).label: n for status, n in (others or Counter()).items()})
    if result.refused:
        ids = " ".join(str(row.id) for row in result.refused[:LISTED])
        rows = "; ".join(f"row {row.id} ({row.topic}): {' '.join((row.last_error or '').split())[:200]}"
                         for row in result.refused[:LISTED])
        more = f"; and {len(result.refused) - LISTED} more" if len(result.refused) > LISTED else ""
        lines.append(f"Not requeued: {len(result.refused)} dead event(s) whose recorded reason is permanent "
                     f"would only fail again; fix the cause, then requeue them with "
                     f"`outbox dead requeue --force {ids}`{' ...' if more else ''}: {rows}{more}.")
    if statuses:
        lines.append(f"Left alone: {sum(statuses.values())} selected event(s) not dead "
                     f"({', '.join(f'{label} {n}' for label, n in sorted(statuses.items()))}).")
    if result.missing:
        lines.append(f"Left alone: {len(result.missing)} selected event(s) no longer exist "
                     "(archived or purged since the page was shown).")
    return lines
