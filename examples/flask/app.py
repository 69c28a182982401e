"""The example Flask shop: POST /orders writes the order and its event in one SQLAlchemy
session transaction; the relay is woken right after commit. Schema by Alembic
(migrations/, ``alembic upgrade head``), the outbox table included
(``outbox.contrib.alembic.create_outbox_table``).

    DATABASE_URL=postgresql+psycopg://app@db/shop OUTBOX_DATABASE_URL=postgresql://app@db/shop \\
        flask --app app run

On the default SQLite database, the relay must read it too (its own default is ./outbox.db):

    export OUTBOX_DATABASE_URL=sqlite:///shop.db
"""

from __future__ import annotations

import os

from flask import Flask, jsonify, request
from models import Order
from sqlalchemy import create_engine
from sqlalchemy.orm import scoped_session, sessionmaker

from outbox.contrib.flask import Outbox

DATABASE_URL = os.environ.get("DATABASE_URL", "sqlite:///shop.db")

engine = create_engine(DATABASE_URL)
Session = scoped_session(sessionmaker(bind=engine))

app = Flask(__name__)
outbox = Outbox(app, session=Session)


@app.post("/orders")
def create_order():  # type: ignore[no-untyped-def]
    data = request.get_json(force=True, silent=True) or {}
    session = Session()
    try:
        order = Order(customer=str(data.get("customer", "anonymous")), total_cents=int(data.get("total_cents", 0)))
        session.add(order)
        session.flush()  # the order's id, inside the transaction
        outbox_id = outbox.enqueue(topic="orders.created", aggregate_type="order", aggregate_id=str(order.id),
                                   payload={"orderId": order.id, "customer": order.customer,
                                            "totalCents": order.total_cents})
        if data.get("fail"):
            session.rollback()  # the order and its event vanish together
            return jsonify(error="rolled back"), 409
        session.commit()  # the relay is woken right after this
        return jsonify(order=order.id, outbox_id=outbox_id), 201
    finally:
        Session.remove()
