"""The drain baseline: a plain, single-process loop over the relay's own building blocks.

    claim(batch) -> split_chains -> KombuPublisher.publish_chains -> mark_done

No Celery, no tasks, no second process. Run as a subprocess by ``bench.drain`` (so the bench
process, which consumes the destination queue, does not share its GIL) and prints one JSON
line with what it did. ``--ack batch`` marks the whole batch's published ids done in one
statement after the batch, as the relay's publish task does for its chains; ``--ack chain``
marks each chain done in a statement of its own (what the relay did before it batched).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--publish-url", required=True)
    parser.add_argument("--exchange", required=True)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--ack", choices=("batch", "chain"), default="batch")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--hold", action="store_true",
                        help="after printing the result, keep the connections open until stdin has a line "
                             "(so the caller can read this process's and its PostgreSQL backend's CPU)")
    args = parser.parse_args(argv)

    from outbox.domain.chains import split_chains
    from outbox.publisher import KombuPublisher
    from outbox.storage.store import OutboxStore

    store = OutboxStore(args.database_url, table=args.table)
    publisher = KombuPublisher(args.publish_url, args.exchange)
    published = claims = chains = 0
    t_claim = t_publish = t_ack = 0.0
    t0 = time.perf_counter()
    deadline = t0 + args.max_seconds
    error = None
    try:
        while time.perf_counter() < deadline:
            a = time.perf_counter()
            claim = store.claim(args.batch)
            b = time.perf_counter()
            t_claim += b - a
            if not claim.messages:
                break
            claims += 1
            done: list[int] = []
            batch_chains = split_chains(claim.messages)
            a = time.perf_counter()
            results = publisher.publish_chains(batch_chains)
            b = time.perf_counter()
            t_publish += b - a
            for result in results:
                chains += 1
                b = time.perf_counter()
                if args.ack == "chain":
                    store.mark_done(result.published, claim.lease)
                    t_ack += time.perf_counter() - b
                else:
                    done.extend(result.published)
                published += len(result.published)
                if not result.ok:
                    error = f"{result.failure}"
                    break
            if done:
                a = time.perf_counter()
                store.mark_done(done, claim.lease)
                t_ack += time.perf_counter() - a
            if error:
                break
    finally:
        elapsed = time.perf_counter() - t0
        print(json.dumps({"published": published, "claims": claims, "chains": chains, "seconds": elapsed,
                          "claim_s": t_claim, "publish_s": t_publish, "ack_s": t_ack, "error": error}), flush=True)
        if args.hold:
            sys.stdin.readline()
        publisher.close()
        store.close()
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
