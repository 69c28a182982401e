from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total_cents = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
