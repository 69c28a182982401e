from django.contrib import admin
from django.urls import path

from orders import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders", views.create_order, name="create-order"),
]
