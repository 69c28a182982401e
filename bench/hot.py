"""Hot aggregate: N committed events on ONE aggregate on PostgreSQL, drained by a real
``celery -A outbox worker -c 2`` (Redis as Celery's broker, RabbitMQ destination with a
consumer that checks the order), once strict (the default: one confirm round trip per
event) and once pipelined (``OUTBOX_RELAY_PIPELINED_TOPICS``, docs/relay.md "Pipelined
chains"), in the same run as the raw unordered loop (``bench.rawloop``) over the same
backlog. Prints events/s of each, pipelined over the raw loop (issue 25's target: >= 0.9)
and pipelined over strict.

    python -m bench.hot [--events 10000] [--batch-size 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from .common import (
    Destination,
    Run,
    create_table,
    drop_table,
    flush_redis,
    load_backlog,
    log,
    require_services,
    to_json,
    truncate_table,
)
from .drain import Relay, run_celery_drain
from .rawloop import run_raw_loop

#: The topic of ``bench.backlog.make_event``'s events, opted in to pipelining for the second pass.
PIPELINED_TOPICS = "orders.*"
#: Issue 25: the pipelined drain of one hot aggregate against the raw unordered loop. (Issue
#: 11's ">= 5x strict" asked for more than the machine has: 5x strict is 1.9x the raw loop.)
TARGET = 0.9


def _drain(run: Run, destination: Destination, events: int, label: str, timeout: float,
           concurrency: int, **env: str) -> dict[str, Any]:
    """One pass: a fresh relay (worker + beat) on a fresh backlog of one aggregate."""
    flush_redis(run.redis_url)  # nothing of the previous pass left in Celery's queues
    relay: Relay | None = None
    try:
        result, relay = run_celery_drain(run, destination, lambda: Relay(run, concurrency=concurrency, **env),
                                         events, 1, timeout=timeout, label=label)
    finally:
        if relay is not None:
            relay.stop()
    return result


def run_hot(events: int = 10_000, *, batch_size: int | None = None, concurrency: int = 2,
            timeout: float = 600.0, run: Run | None = None) -> dict[str, Any]:
    """Drain ``events`` on one aggregate strict, then pipelined; returns::

        {"events", "batch_size", "strict_events_per_s", "pipelined_events_per_s", "ratio",
         "target", "met", "order_ok", "strict": {...}, "pipelined": {...}}

    ``strict`` / ``pipelined`` are ``bench.drain.run_celery_drain``'s results (events/s,
    order check, CPU, memory, table counts); ``order_ok`` is true when both passes
    delivered every event with first arrivals in id order. ``run`` (its table, exchange,
    Redis db) is created and dropped here when not given."""
    require_services()
    own = run is None
    workdir = Path(tempfile.mkdtemp(prefix="bench-hot-"))
    run = run or Run(workdir=workdir)
    if batch_size is not None:
        run.batch_size = batch_size
    create_table(run)
    destination = Destination(run)
    try:
        truncate_table(run)
        load_backlog(run, events, 1)
        log(f"raw loop: {events} events on one aggregate")
        raw = run_raw_loop(run.postgres_url, run.amqp_url, run.table, run.exchange, concurrency, run.batch_size,
                           timeout=timeout)
        destination.wait_for(events, timeout=30, idle_timeout=5)
        strict = _drain(run, destination, events, "hot aggregate, strict", timeout, concurrency)
        pipelined = _drain(run, destination, events, "hot aggregate, pipelined", timeout, concurrency,
                           OUTBOX_RELAY_PIPELINED_TOPICS=PIPELINED_TOPICS)
    finally:
        destination.close()
        if own:
            drop_table(run)
            flush_redis(run.redis_url)
    ratio = pipelined["events_per_s"] / strict["events_per_s"] if strict["events_per_s"] else 0.0
    to_raw = pipelined["events_per_s"] / raw["events_per_s"] if raw["events_per_s"] else 0.0
    result = {"events": events, "batch_size": run.batch_size, "raw_events_per_s": raw["events_per_s"],
              "strict_events_per_s": strict["events_per_s"], "pipelined_events_per_s": pipelined["events_per_s"],
              "ratio": ratio, "pipelined_to_raw": to_raw, "target": TARGET, "met": to_raw >= TARGET,
              "order_ok": bool(strict["order"]["ok"] and pipelined["order"]["ok"]),
              "raw": raw, "strict": strict, "pipelined": pipelined}
    log(f"hot aggregate ({events} events, batch {run.batch_size}): raw loop {raw['events_per_s']:.0f} ev/s, "
        f"strict {strict['events_per_s']:.0f} ev/s, pipelined {pipelined['events_per_s']:.0f} ev/s: "
        f"pipelined x{to_raw:.2f} of the raw loop (target >= {TARGET:g}), x{ratio:.1f} of strict, "
        f"order ok={result['order_ok']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000, help="events on the one aggregate (10000)")
    parser.add_argument("--batch-size", type=int, default=None, help="OUTBOX_BATCH_SIZE of both passes (100)")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full result here")
    args = parser.parse_args(argv)
    result = run_hot(args.events, batch_size=args.batch_size, concurrency=args.concurrency)
    if args.json is not None:
        args.json.write_text(to_json(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("raw", "strict", "pipelined")}))
    print(f"hot aggregate: raw loop {result['raw_events_per_s']:.0f} ev/s, strict {result['strict_events_per_s']:.0f} "
          f"ev/s, pipelined {result['pipelined_events_per_s']:.0f} ev/s: pipelined x{result['pipelined_to_raw']:.2f} "
          f"of the raw loop (target >= {TARGET:g})")
    return 0 if result["order_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
