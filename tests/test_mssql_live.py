"""SQL Server, for real, when one is reachable.

Set ``OUTBOX_TEST_MSSQL_URL`` (or run where a Docker engine answers: the suite then
starts SQL Server with testcontainers) (for example
``mssql+pyodbc://sa:Passw0rd!@127.0.0.1:1433/master?driver=ODBC+Driver+18+for+SQL+Server&TrustServerCertificate=yes``)
and the shared conformance suite (``tests/test_store_conformance.py``) runs on
SQL Server as well, through the ``mssql`` engine of ``tests/conftest.py``. This
module is the quick smoke check: migrate twice, enqueue through a plain pyodbc
connection (including a duplicate message_id and a payload past 4000 characters),
claim, acknowledge. Without either it skips, saying why.
"""

from __future__ import annotations

import uuid

from outbox import enqueue
from outbox.store import OutboxStore

from conftest import mssql_url


def test_migrate_enqueue_claim_and_mark_done_round_trip() -> None:
    MSSQL_URL = mssql_url()
    store = OutboxStore(MSSQL_URL, table=f"outbox_live_{uuid.uuid4().hex[:10]}", max_attempts=3)
    try:
        store.migrate()
        store.migrate()  # idempotent
        writer = store.engine.connect(MSSQL_URL)
        try:
            table = store.engine.table_name
            first = enqueue(writer, topic="orders.created", aggregate_type="order", aggregate_id="a",
                            payload={"n": 1}, message_id="live-1", table=table)
            again = enqueue(writer, topic="orders.created", aggregate_type="order", aggregate_id="a",
                            payload={"n": 1}, message_id="live-1", table=table)
            big = enqueue(writer, topic="orders.created", aggregate_type="order", aggregate_id="a",
                          payload={"text": "x" * 9000}, table=table)
            writer.commit()
        finally:
            writer.close()
        assert again == first and big > first

        claim = store.claim(10)
        assert [m.id for m in claim.messages] == [first, big]
        assert len(claim.messages[1].payload) > 9000
        assert store.claim(10).messages == []  # leased
        assert store.mark_done([first, big], claim.lease).ok
        assert store.stats().counts["done"] == 2
    finally:
        try:
            with store.transaction() as cursor:
                store.engine.execute(cursor, f"DROP TABLE IF EXISTS {store.engine.table}")
        finally:
            store.close()
