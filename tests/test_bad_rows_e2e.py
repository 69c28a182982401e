"""Issue 14 item 1 end to end: real ``celery -A outbox worker`` and ``beat``, Redis as
Celery's broker, RabbitMQ as the destination, on SQLite, PostgreSQL and MariaDB. A row
tampered in the table among innocent ones goes dead alone, at once, with the real reason,
and reaches the dead-letter exchange; every other row is delivered on its first attempt,
in order per aggregate, exactly once. (Before the fix, the claim task crashed after its
claim committed, so the whole batch stayed leased and came back with the bad row each
time: innocent rows were charged attempts and went dead undelivered.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_support import tamper
from relay_e2e_support import Destination, Outbox, check_order, relay_env, wait_until

from outbox import Status


def test_a_tampered_row_goes_dead_alone_and_the_rest_is_delivered_on_the_first_attempt(
        tmp_path: Path, dead_letter_destination: Destination, outbox: Outbox, procs_factory: Any) -> None:
    destination = dead_letter_destination
    aggregates = [f"agg-{i}" for i in range(6)]
    expected: dict[str, list[int]] = {a: [] for a in aggregates}
    with outbox.writer() as conn:
        for n in range(4):
            for aggregate in aggregates:
                expected[aggregate].append(outbox.add(conn, aggregate, n, headers={"tenant": "acme"}))
        conn.commit()
    bad = expected["agg-2"].pop(1)  # in the middle of its aggregate: the rows behind it must flow too
    # Invalid JSON where the column allows it (SQLite's CHECK is bypassed); PostgreSQL's jsonb
    # and MariaDB's JSON refuse invalid JSON, so there the headers are JSON but not an object.
    tampered = '{"tenant": ' if outbox.kind == "sqlite" else '["tenant", "acme"]'
    reason = ("undecodable row: headers are not valid JSON: " if outbox.kind == "sqlite"
              else "undecodable row: headers are not a JSON object (a JSON list)")
    tamper(outbox.store, bad, "headers", tampered)
    total = sum(len(ids) for ids in expected.values())

    procs = procs_factory(relay_env(tmp_path, destination, outbox, OUTBOX_BATCH_SIZE="10",
                                    OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or ""))
    procs.worker("w1")
    procs.beat()

    assert destination.wait_for(lambda: len(destination.arrived()) >= total and len(destination.dead) >= 1,
                                timeout=40, procs=procs), (
        f"{len(destination.arrived())} of {total} arrived, {len(destination.dead)} dead-lettered\n"
        + procs.log("w1")[-4000:])
    arrivals = destination.arrivals()
    assert bad not in destination.arrived()
    assert len(arrivals) == total  # exactly once: nothing came back through a lease
    check_order(arrivals, expected)
    assert {m.headers["attempt"] for _, _, m in arrivals} == {1}  # no attempt charged to an innocent row

    rows = outbox.rows()
    assert (rows[bad]["status"], rows[bad]["attempts"]) == (Status.DEAD, 1)
    assert rows[bad]["last_error"].startswith(reason), rows[bad]["last_error"]
    [copy] = destination.dead
    assert copy.headers["outbox_id"] == bad and copy.headers["aggregate_id"] == "agg-2"
    assert copy.headers["x-outbox-error"] == rows[bad]["last_error"]
    assert copy.delivery_info["routing_key"] == "orders.agg-2.changed"
    assert wait_until(lambda: outbox.status_counts() == {"DONE": total, "DEAD": 1}, timeout=15), (
        outbox.status_counts())
    assert all(row["attempts"] == 0 for id, row in outbox.rows().items() if id != bad)
    assert "Traceback" not in procs.log("w1")
