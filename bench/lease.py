"""The store's lease-and-settle cycle on PostgreSQL, without publishing: one process claims
``--batch`` rows and marks them done until a backlog of ``--events`` rows is drained, over
each spread of aggregates. Prints events/s, WAL bytes per event and the share of updates
that were HOT (docs/internals.md, "The lease is a HOT update on PostgreSQL").

``python -m bench.lease`` measures the code it imports; to compare two versions, run it
once with each on ``PYTHONPATH`` (the table is made by the imported ``outbox migrate``).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from .common import POSTGRES_URL, log


def run_cycle(events: int, aggregates: int, batch: int = 100) -> dict[str, Any]:
    import psycopg

    from outbox.storage.store import OutboxStore

    table = f"bench_lease_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        store = OutboxStore(POSTGRES_URL, table=table)
        try:
            store.migrate()
            admin.execute(f"""INSERT INTO "{table}" (message_id, topic, aggregate_type, aggregate_id, payload)
                SELECT 'm' || g, 'orders.created', 'order', 'a' || (g %% %s), '{{"n": 1, "note": "{'x' * 40}"}}'::jsonb
                FROM generate_series(1, %s) g""", [aggregates, events])
            admin.execute(f'VACUUM ANALYZE "{table}"')
            admin.execute("CHECKPOINT")  # full-page images then count alike in every run
            start_lsn = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
            started, done = time.perf_counter(), 0
            while True:
                claim = store.claim(batch)
                if not claim.messages:
                    break
                store.mark_done([m.id for m in claim.messages], claim.lease)
                done += len(claim.messages)
            elapsed = time.perf_counter() - started
            wal = float(admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [start_lsn]).fetchone()[0])
            store.close()  # its backend reports its statistics as it ends
            time.sleep(1.5)
            updated, hot = admin.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                                         "WHERE relid = %s::regclass", [table]).fetchone()
        finally:
            admin.execute(f"DROP TABLE IF EXISTS {store.engine.table}, {store.engine.holders}")  # migrate made both
    result = {"aggregates": aggregates, "events": done, "events_per_s": round(done / elapsed),
              "wal_bytes_per_event": round(wal / max(1, done)), "updates": updated, "hot_updates": hot,
              "hot_share": round(hot / max(1, updated), 2)}
    log(f"lease cycle over {aggregates} aggregates: {result['events_per_s']} ev/s, "
        f"WAL {result['wal_bytes_per_event']} B/event, HOT {hot}/{updated} updates")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lease", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--spreads", default="100,10000", help="aggregates in the backlog, comma-separated")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="runs per spread (the median is kept)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for spread in (int(s) for s in args.spreads.split(",")):
        runs = sorted((run_cycle(args.events, spread, args.batch) for _ in range(args.rounds)),
                      key=lambda r: r["events_per_s"])
        out[str(spread)] = {**runs[len(runs) // 2], "rounds_events_per_s": [r["events_per_s"] for r in runs]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
