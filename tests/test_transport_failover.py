"""What failover the database broker supports (docs/transport.md, "Failover"): one URL naming
an endpoint that fails over by itself. On PostgreSQL, libpq's multi-host URL with
``target_session_attrs=read-write`` goes to the first host that answers as a primary: here the
first host refuses connections (a failed primary) and the transport carries on on the second."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

from kombu import Connection
from services import POSTGRES_URL, free_port, require

from outbox.transport import drop_queue_tables  # importing it registers the outboxdb scheme


def test_a_multi_host_postgresql_url_fails_over_to_the_host_that_answers() -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    parts = urlsplit(POSTGRES_URL)
    user = f"{parts.username}@" if parts.username else ""
    hosts = f"127.0.0.1:{free_port()},{parts.hostname}:{parts.port or 5432}"
    db_url = f"postgresql://{user}{hosts}{parts.path}?target_session_attrs=read-write"
    table = f"kf_{uuid.uuid4().hex[:10]}"
    try:
        with Connection(f"outboxdb+{db_url}", transport_options={"queue_table": table}) as conn:
            queue = conn.SimpleQueue(f"failover-{table}")
            queue.put({"n": 1})
            message = queue.get(timeout=10)
            assert message.payload == {"n": 1}
            message.ack()
            queue.close()
    finally:
        drop_queue_tables(POSTGRES_URL, table)

