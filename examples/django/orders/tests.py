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
        self.assertContains(response, "Requeued 1 dead event(s): orders.created 1.")
        self.assertContains(response, "Left alone: 1 selected event(s) not dead (done 1).")
        dead = OutboxEvent.objects.get(id=self.dead)
        self.assertEqual((dead.status, dead.attempts), (Status.PENDING, 0))
        self.assertEqual(OutboxEvent.objects.get(id=self.done).status, Status.DONE)

    def test_requeue_action_keeps_rows_with_a_permanent_reason_and_says_why(self):
        """The CLI's rule (``outbox dead requeue`` without --force, ``OutboxStore.requeue``):
        a dead row whose recorded reason is permanent (poison, undecodable) would only fail
        again and stays dead; the page names it with its reason. Before, the admin requeued
        every selected dead row."""
        poison = make_row(Status.DEAD, error="poison: payload rejected by the broker", attempts=1)
        undecodable = make_row(Status.DEAD, error="undecodable row: payload is not JSON", attempts=1)
        response = self.client.post("/admin/outbox/outboxevent/", {
            "action": "requeue_dead", "_selected_action": [self.dead, poison, undecodable, self.done]},
            follow=True)
        self.assertEqual(response.status_code, 200)
        said = [str(m) for m in response.context["messages"]]
        self.assertIn("Requeued 1 dead event(s): orders.created 1.", said)
        refused = [m for m in said if m.startswith("Not requeued: 2 dead event(s)")]
        self.assertEqual(len(refused), 1, said)
        self.assertIn("permanent", refused[0])
        self.assertIn(f"row {poison} (orders.created): poison: payload rejected by the broker", refused[0])
        self.assertIn(f"row {undecodable} (orders.created): undecodable row: payload is not JSON", refused[0])
        self.assertIn(f"outbox dead requeue --force {poison} {undecodable}", refused[0])
        self.assertIn("Left alone: 1 selected event(s) not dead (done 1).", said)
        self.assertEqual(OutboxEvent.objects.get(id=self.dead).status, Status.PENDING)
        for kept in (poison, undecodable):
            row = OutboxEvent.objects.get(id=kept)
            self.assertEqual((row.status, row.attempts), (Status.DEAD, 1))
        self.assertEqual(OutboxEvent.objects.get(id=self.done).status, Status.DONE)

    def test_requeue_action_requeues_a_large_selection_in_short_transactions(self):
        """"Select all" of 2,500 dead rows: requeued 1,000 per transaction in id order, as
        ``outbox dead requeue --all`` does (one statement over every row would lock them all
        at once: docs/relay.md, "Requeueing dead rows"). Each of the store's transactions
        is an ``atomic`` block on Django's connection (a savepoint inside the test's own
        transaction). Before, the whole selection was one transaction."""
        from django.test.utils import CaptureQueriesContext

        from outbox import enqueue

        ids = [enqueue(connection, topic="orders.bulk", aggregate_type="order", aggregate_id=f"b{n % 50}",
                       payload={"n": n}) for n in range(2500)]
        OutboxEvent.objects.filter(id__in=ids).update(status=Status.DEAD, last_error="unroutable: no queue",
                                                      attempts=3, processed_at=timezone.now())
        with CaptureQueriesContext(connection) as queries:
            response = self.client.post(f"/admin/outbox/outboxevent/?status__exact={Status.DEAD}", {
                "action": "requeue_dead", "select_across": "1", "index": "0", "_selected_action": ids[:100]},
                follow=True)
        self.assertEqual(response.status_code, 200)
        said = [str(m) for m in response.context["messages"]]
        self.assertIn("Requeued 2501 dead event(s): orders.bulk 2500, orders.created 1.", said)
        self.assertFalse(OutboxEvent.objects.filter(status=Status.DEAD).exists())
        savepoints = [q["sql"] for q in queries.captured_queries if q["sql"].upper().startswith("SAVEPOINT")]
        self.assertEqual(len(savepoints), 3, savepoints)

    def test_requeue_action_reads_only_the_dead_rows_of_the_selection(self):
        """"Select all" of the unfiltered list is the whole table: the action read every
        selected id into memory and gave each to the requeue, 1,000 a transaction (1.4 million
        rows on PostgreSQL: 296 MB and 23 s; found in review). It reads the dead rows' ids only
        and counts the other rows by status, in the database."""
        from unittest import mock

        from outbox.storage.store import OutboxStore

        for _ in range(30):
            make_row(Status.DONE)
        requeue, asked = OutboxStore.requeue, []

        def recorded(store, ids=None, **kwargs):
            asked.append(sorted(ids))
            return requeue(store, ids, **kwargs)

        with mock.patch.object(OutboxStore, "requeue", recorded):
            response = self.client.post("/admin/outbox/outboxevent/", {
                "action": "requeue_dead", "select_across": "1", "index": "0", "_selected_action": [self.done]},
                follow=True)
        said = [str(m) for m in response.context["messages"]]
        self.assertEqual(asked, [[self.dead]])
        self.assertIn("Requeued 1 dead event(s): orders.created 1.", said)
        self.assertIn("Left alone: 32 selected event(s) not dead (done 31, pending 1).", said)
        self.assertEqual(OutboxEvent.objects.get(id=self.dead).status, Status.PENDING)

    def test_rows_are_read_only_and_requeue_needs_the_permission(self):
        self.assertEqual(self.client.get("/admin/outbox/outboxevent/add/").status_code, 403)
        staff = User.objects.create_user("viewer", password="pw", is_staff=True)
        from django.contrib.auth.models import Permission

        staff.user_permissions.add(Permission.objects.get(codename="view_outboxevent"))
        self.client.force_login(staff)
        page = self.client.get("/admin/outbox/outboxevent/")
        self.assertEqual(page.status_code, 200)
        self.assertNotContains(page, "requeue_dead")
