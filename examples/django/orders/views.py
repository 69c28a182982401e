"""POST /orders: the order row and its event in one transaction; the relay is woken
after commit (``outbox.contrib.django.enqueue``)."""

import json

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from outbox.contrib.django import enqueue

from .models import Order


@csrf_exempt  # an API endpoint of the example; use your own authentication
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body or b"{}")
    with transaction.atomic():
        order = Order.objects.create(customer=str(data.get("customer", "anonymous")),
                                     total_cents=int(data.get("total_cents", 0)))
        outbox_id = enqueue(topic="orders.created", aggregate_type="order", aggregate_id=str(order.pk),
                            payload={"orderId": order.pk, "customer": order.customer,
                                     "totalCents": order.total_cents})
        if data.get("fail"):  # lets the example show a rolled-back order: no event either
            transaction.set_rollback(True)
            return JsonResponse({"error": "rolled back"}, status=409)
    return JsonResponse({"order": order.pk, "outbox_id": outbox_id}, status=201)
