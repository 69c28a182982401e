"""One drain slice in one process, without Celery: ``relay.drain_slice`` run over and over on
``--events`` rows of one aggregate (PostgreSQL, RabbitMQ with confirms, the chain pipelined),
once per ``OUTBOX_RELAY_CLAIM_AHEAD`` mode in ``--modes``, interleaved over ``--rounds``.
What it isolates: the slice's own timeline (claim, publish, confirms, done mark) with nothing
else in the process, so the overlap that claim-ahead buys a hot aggregate shows apart from
the bench's consumer, Celery's broker and the other pool process (docs/benchmarks.md, "Hot
aggregate"). Prints events/s per mode and round, the claims made here and ahead, the
median publish of a share, and each mode's median over the first mode's.

    python -m bench.slice --events 10000 --modes off,auto --rounds 3

Talks only to the URLs given (127.0.0.1 by default); its table and exchange are its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from typing import Any

DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
AHEAD_THREAD = "outbox-claim-ahead"


def drain_once(mode: str, events: int, batch: int, database_url: str, amqp_url: str) -> dict[str, Any]:
    """Load ``events`` rows of one aggregate, drain them with drain slices, return the figures."""
    import kombu
    import psycopg

    from outbox.core.model import Claim
    from outbox.publisher.kombu_publisher import KombuPublisher
    from outbox.relay import (
        Backlog,
        ClaimAhead,
        Drain,
        Outage,
        RelayContext,
        RelayHooks,
        RelayOptions,
        drain_slice,
        handle_publish,
    )
    from outbox.storage.store import OutboxStore

    from .backlog import backlog_rows
    from .engines import engine

    name = f"bench_slice_{uuid.uuid4().hex[:8]}"
    store = OutboxStore(database_url, table=name)
    store.migrate()
    spec = engine("postgresql")
    with psycopg.connect(database_url) as conn:
        spec.load(conn, name, backlog_rows(events, 1))
        conn.commit()
        for statement in spec.analyze(name):
            conn.execute(statement)
        conn.commit()
    exchange = kombu.Exchange(name, "topic", durable=True)
    queue = kombu.Queue(name, exchange, routing_key="#", durable=True)
    with kombu.Connection(amqp_url) as connection:
        queue(connection.default_channel).declare()
    publisher = KombuPublisher(amqp_url, name)

    class Claims(RelayHooks):
        def __init__(self) -> None:
            self.seen: list[tuple[str, float]] = []

        def after_claim(self, claim: Claim, seconds: float) -> None:
            self.seen.append((threading.current_thread().name, seconds))

    claims = Claims()
    context = RelayContext(store, publisher, options=RelayOptions(claim_ahead=mode, pipelined_topics=("orders.*",)),
                           hooks=claims)
    shares: list[float] = []

    def publish_here(chains: Any, deadline: float) -> Any:
        started = time.perf_counter()
        outcomes = handle_publish(context, chains, deadline=deadline)
        shares.append(time.perf_counter() - started)
        return outcomes

    ahead = ClaimAhead(lambda: store)
    drain = Drain(lambda chains, deadline: None, publish_here, lambda: None,
                  Outage("the database", "postgresql", "claims wait"), Backlog(), ahead=ahead)
    try:
        started = time.perf_counter()
        while True:
            outcome = drain_slice(context, drain, batch_size=batch, lease_s=60.0)
            if outcome is None or outcome.claimed == 0:
                break
        elapsed = time.perf_counter() - started
        with psycopg.connect(database_url) as conn:
            left = conn.execute(f"SELECT COUNT(*) FROM {name} WHERE status <> 2").fetchone()[0]
    finally:
        ahead.close()
        publisher.close()
        store.close()
        with kombu.Connection(amqp_url) as connection:
            queue(connection.default_channel).delete()
            exchange(connection.default_channel).delete()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {store.engine.table}, {store.engine.holders}")  # migrate made both
    made_ahead = [s for thread, s in claims.seen if thread.startswith(AHEAD_THREAD)]
    here = [s for thread, s in claims.seen if not thread.startswith(AHEAD_THREAD)]
    return {"mode": mode, "events": events, "events_per_s": events / elapsed, "not_done": left,
            "claims_here": len(here), "claims_ahead": len(made_ahead),
            "share_publish_ms": statistics.median(shares) * 1e3 if shares else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slice", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--modes", default="off,auto", help="OUTBOX_RELAY_CLAIM_AHEAD modes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE)
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP)
    parser.add_argument("--json", help="also write every round's figures here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            got = drain_once(mode, args.events, args.batch_size, args.database_url, args.amqp_url)
            results[mode].append(got)
            print(f"round {round_ + 1}, {mode}: {got['events_per_s']:.0f} ev/s; claims here {got['claims_here']}, "
                  f"ahead {got['claims_ahead']}; a share published in {got['share_publish_ms']:.1f} ms "
                  f"(median); rows not done {got['not_done']}", flush=True)
    first = statistics.median(r["events_per_s"] for r in results[modes[0]])
    for mode in modes:
        median = statistics.median(r["events_per_s"] for r in results[mode])
        print(f"{mode}: median {median:.0f} ev/s over {args.rounds} rounds, x{median / first:.2f} of {modes[0]}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0 if all(r["not_done"] == 0 for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
