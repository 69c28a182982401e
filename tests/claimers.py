"""A claimer loop for the concurrency tests, importable by spawned processes.

It plays a relay with random delays and injected failures, and records what it
did with a system-wide monotonic clock so the test can check, across processes,
that the ordering rule held and that no row was held by two live leases at once.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

from outbox.domain.chains import split_chains
from outbox.storage.store import OutboxStore


def run_claimer(url: str, table: str, seconds: float, seed: int, batch_max: int = 8,
                fail_rate: float = 0.05) -> dict[str, Any]:
    store = OutboxStore(url, table=table, claim_timeout_ms=120_000, max_attempts=10_000)
    rnd = random.Random(seed)
    deliveries: list[tuple[int, str, int]] = []   # (t, aggregate, id) when "published"
    holds: list[tuple[int, int, int]] = []        # (id, t claimed, t released) of one lease
    stale = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            claim = store.claim(rnd.randint(1, batch_max))
            claimed_at = time.monotonic_ns()
            if not claim.messages:
                time.sleep(0.002)
                continue
            time.sleep(rnd.random() * 0.004)
            for chain in split_chains(claim.messages):
                published: list[int] = []
                failed_at = None
                for index, message in enumerate(chain):
                    if rnd.random() < fail_rate:
                        failed_at = index
                        break
                    deliveries.append((time.monotonic_ns(), message.aggregate_id, message.id))
                    published.append(message.id)
                    if rnd.random() < 0.2:
                        time.sleep(rnd.random() * 0.002)
                released_at = time.monotonic_ns()
                holds.extend((m.id, claimed_at, released_at) for m in chain)
                stale += store.mark_done(published, claim.lease).stale
                if failed_at is not None:
                    stale += 0 if store.mark_failed(chain[failed_at].id, claim.lease, "injected",
                                                    timedelta(0)).applied else 1
                    stale += store.release([m.id for m in chain[failed_at + 1:]], claim.lease).stale
    finally:
        store.close()
    return {"deliveries": deliveries, "holds": holds, "stale": stale}
