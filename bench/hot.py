"""Hot aggregate: N committed events on ONE aggregate on PostgreSQL, drained by a real
``celery -A outbox worker -c 2`` (Redis as Celery's broker, RabbitMQ destination with a
consumer that checks the order), once strict (the default: one confirm round trip per
event) and once pipelined (``OUTBOX_RELAY_PIPELINED_TOPICS``, docs/relay.md "Pipelined
chains"), in the same run. Prints events/s of each and their ratio (target: >= 5x).

    python -m bench.hot [--events 10000] [--batch-size 100]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from .common import Destination, Run, create_table, drop_table, flush_redis, log, require_services, to_json
from .drain import Relay, run_celery_drain

#: The topic of ``bench.backlog.make_event``'s events, opted in to pipelining for the second pass.
PIPELINED_TOPICS = "orders.*"
TARGET = 5.0


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
        strict = _drain(run, destination, events, "hot aggregate, strict", timeout, concurrency)
        pipelined = _drain(run, destination, events, "hot aggregate, pipelined", timeout, concurrency,
                           OUTBOX_RELAY_PIPELINED_TOPICS=PIPELINED_TOPICS)
    finally:
        destination.close()
        if own:
            drop_table(run)
            flush_redis(run.redis_url)
    ratio = pipelined["events_per_s"] / strict["events_per_s"] if strict["events_per_s"] else 0.0
    result = {"events": events, "batch_size": run.batch_size,
              "strict_events_per_s": strict["events_per_s"], "pipelined_events_per_s": pipelined["events_per_s"],
              "ratio": ratio, "target": TARGET, "met": ratio >= TARGET,
              "order_ok": bool(strict["order"]["ok"] and pipelined["order"]["ok"]),
              "strict": strict, "pipelined": pipelined}
    log(f"hot aggregate ({events} events, batch {run.batch_size}): strict {strict['events_per_s']:.0f} ev/s, "
        f"pipelined {pipelined['events_per_s']:.0f} ev/s, ratio {ratio:.1f}x (target >= {TARGET:g}x), "
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
    print(json.dumps({k: v for k, v in result.items() if k not in ("strict", "pipelined")}))
    print(f"hot aggregate: strict {result['strict_events_per_s']:.0f} ev/s, pipelined "
          f"{result['pipelined_events_per_s']:.0f} ev/s, ratio {result['ratio']:.1f}x (target >= {TARGET:g}x)")
    return 0 if result["order_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
