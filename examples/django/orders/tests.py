"""Run by Django's test runner (``manage.py test``), which creates the outbox table from
the app's migration on the test database: the view enqueues in its transaction, and the
admin shows rows by status, dead rows with their error, and requeues them."""

import json

from django.contrib.auth.models import User
from django.db import connection
from django.test import TestCase, TransactionTestCase
from django.utils import timezone

from outbox.contrib.django.models import OutboxEvent, Status

from .models import Order


class OrderViewTests(TransactionTestCase):
    def test_an_order_and_its_event_commit_together(self):
        response = self.client.post("/orders", json.dumps({"customer": "ada", "total_cents": 4200}),
                                    content_type="application/json")
        self.assertEqual(response.status_code, 201, response.content)
        body = response.json()
        event = OutboxEvent.objects.get(id=body["outbox_id"])
        self.assertEqual(event.topic, "orders.created")
        self.assertEqual(event.aggregate_id, str(body["order"]))
        self.assertEqual(event.payload, {"orderId": body["order"], "customer": "ada", "totalCents": 4200})
        self.assertEqual(event.status, Status.PENDING)

    def test_a_rolled_back_order_leaves_no_event(self):
        response = self.client.post("/orders", json.dumps({"customer": "bob", "fail": True}),
                                    content_type="application/json")
        self.assertEqual(response.status_code, 409)
        self.assertFalse(Order.objects.exists())
        self.assertFalse(OutboxEvent.objects.exists())


def make_row(status, error=None, attempts=0):
    from outbox import enqueue

    outbox_id = enqueue(connection, topic="orders.created", aggregate_type="order", aggregate_id=f"a{status}",
                        payload={"status": status})
    # A done or dead row has its processed_at: the table's CHECK holds the two together
    # (docs/internals.md, "The lease is a HOT update on PostgreSQL").
    settled = status in (Status.DONE, Status.DEAD)
    OutboxEvent.objects.filter(id=outbox_id).update(status=status, last_error=error, attempts=attempts,
                                                    processed_at=timezone.now() if settled else None)
    return outbox_id


class AdminTests(TestCase):
    def setUp(self):
        self.admin = User.objects.create_superuser("admin", "admin@example.com", "pw")
        self.client.force_login(self.admin)
        self.pending = make_row(Status.PENDING)
        self.dead = make_row(Status.DEAD, error="unroutable: no queue bound for routing key 'orders.created'",
                             attempts=10)
        self.done = make_row(Status.DONE)

    def test_rows_by_status_and_dead_rows_with_their_error(self):
        page = self.client.get("/admin/outbox/outboxevent/")
        self.assertEqual(page.status_code, 200)
        for outbox_id in (self.pending, self.dead, self.done):
            self.assertContains(page, f"/admin/outbox/outboxevent/{outbox_id}/")
        dead = self.client.get("/admin/outbox/outboxevent/", {"status__exact": Status.DEAD})
        self.assertContains(dead, "unroutable: no queue bound for routing key")
        self.assertContains(dead, f"/admin/outbox/outboxevent/{self.dead}/")
        self.assertNotContains(dead, f"/admin/outbox/outboxevent/{self.pending}/")
        detail = self.client.get(f"/admin/outbox/outboxevent/{self.dead}/change/")
        self.assertEqual(detail.status_code, 200)
        self.assertContains(detail, "unroutable")
        # No key was given: the partition key is the aggregate id, and the page says so (not "-").
        self.assertContains(detail, f"a{Status.DEAD} (the aggregate id: no key given)")

    def test_requeue_action_makes_dead_rows_pending_and_leaves_others(self):
        response = self.client.post("/admin/outbox/outboxevent/", {
            "action": "requeue_dead", "_selected_action": [self.dead, self.done]}, follow=True)
        self.assertEqual(response.status_code, 200)
        self.assertContains(response, "Requeued 1 dead event(s).")
        self.assertContains(response, "1 selected event(s) were not dead")
        dead = OutboxEvent.objects.get(id=self.dead)
        self.assertEqual((dead.status, dead.attempts), (Status.PENDING, 0))
        self.assertEqual(OutboxEvent.objects.get(id=self.done).status, Status.DONE)

    def test_rows_are_read_only_and_requeue_needs_the_permission(self):
        self.assertEqual(self.client.get("/admin/outbox/outboxevent/add/").status_code, 403)
        staff = User.objects.create_user("viewer", password="pw", is_staff=True)
        from django.contrib.auth.models import Permission

        staff.user_permissions.add(Permission.objects.get(codename="view_outboxevent"))
        self.client.force_login(staff)
        page = self.client.get("/admin/outbox/outboxevent/")
        self.assertEqual(page.status_code, 200)
        self.assertNotContains(page, "requeue_dead")
