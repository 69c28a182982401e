"""A claimer loop for the concurrency tests, importable by spawned processes, and the race
that runs it (tests/test_concurrency.py on PostgreSQL and MariaDB, test_mssql_live.py on
SQL Server).

It plays a relay with random delays and injected failures, and records what it
did with a system-wide monotonic clock so the test can check, across processes,
that the ordering rule held and that no row was held by two live leases at once.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from outbox import Status, enqueue
from outbox.domain.chains import split_chains
from outbox.storage.store import OutboxStore

SECONDS = float(os.environ.get("OUTBOX_TEST_RACE_SECONDS", "8"))
HOT = [f"hot-{i}" for i in range(4)]
COLD = [f"cold-{i}" for i in range(150)]


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


def race_claimers(make_store: Any, url: str) -> None:
    """Claimers in threads and spawned processes race over a backlog while a writer commits;
    then every row is done, delivered in order per aggregate, never held by two live leases."""
    store = make_store()
    conn = store.engine.connect(url)
    for round_ in range(3):  # a backlog: hot aggregates deep, cold aggregates shallow
        for aggregate in HOT + COLD[round_ * 50:]:
            enqueue(conn, topic="race", aggregate_type="t", aggregate_id=aggregate, payload={"r": round_},
                    table=store.engine.table_name)
        conn.commit()
    conn.close()

    stop, written = threading.Event(), []
    writer = threading.Thread(target=write_events, args=(url, store, stop, written))
    writer.start()
    table = store.engine.table_name
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as processes, ThreadPoolExecutor(4) as threads:
        remote = [processes.apply_async(run_claimer, (url, table, SECONDS, seed)) for seed in range(4)]
        local = [threads.submit(run_claimer, url, table, SECONDS, 100 + seed) for seed in range(4)]
        time.sleep(SECONDS * 0.75)
        stop.set()
        writer.join(timeout=30)
        results = [r.get(timeout=SECONDS + 120) for r in remote] + [f.result(timeout=SECONDS + 120) for f in local]
    # Drain what is left with one claimer, so every row must end done.
    results.append(run_claimer(url, table, 3.0, 999, batch_max=200, fail_rate=0.0))

    with store.transaction() as cursor:
        rows = store.engine.execute(cursor, f"SELECT id, aggregate_id, status FROM {store.engine.table}").fetchall()
    ids_by_aggregate: dict[str, list[int]] = defaultdict(list)
    for id, aggregate, _ in rows:
        ids_by_aggregate[aggregate].append(int(id))
    deliveries = [d for r in results for d in r["deliveries"]]
    checked = check_ordering(deliveries, ids_by_aggregate)
    check_no_double_hold([h for r in results for h in r["holds"]])
    assert sum(r["stale"] for r in results) == 0  # no lease expired, so nothing may be fenced
    assert {int(r[2]) for r in rows} == {Status.DONE}, "rows left undelivered"
    assert checked >= len(rows)
    assert written and written[0] > 50, "the writer should have committed while claims ran"


def write_events(url: str, store: OutboxStore, stop: threading.Event, count: list[int]) -> None:
    """Commit small transactions to hot aggregates while the claimers run."""
    conn = store.engine.connect(url)
    try:
        n = 0
        while not stop.is_set() and n < 3000:
            for aggregate in HOT[n % 2::2]:
                enqueue(conn, topic="race", aggregate_type="t", aggregate_id=aggregate, payload={"n": n},
                        table=store.engine.table_name)
            conn.commit()
            n += 1
            time.sleep(0.002)
        count.append(n)
    finally:
        conn.close()


def check_ordering(deliveries: list[tuple[int, str, int]], ids_by_aggregate: dict[str, list[int]]) -> int:
    """Every delivery of id x of an aggregate comes after every smaller id of that
    aggregate was delivered at least once. Returns how many deliveries were checked."""
    seen: dict[str, set[int]] = defaultdict(set)
    for _, aggregate, id in sorted(deliveries):
        missing = [earlier for earlier in ids_by_aggregate[aggregate] if earlier < id and earlier not in seen[aggregate]]
        assert not missing, f"{aggregate}: {id} delivered before {missing[:5]}"
        seen[aggregate].add(id)
    return len(deliveries)


def check_no_double_hold(holds: list[tuple[int, int, int]]) -> None:
    by_id: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for id, start, end in holds:
        by_id[id].append((start, end))
    for id, spans in by_id.items():
        spans.sort()
        for (_s1, e1), (s2, _) in zip(spans, spans[1:]):
            assert s2 >= e1, f"row {id} was held by two live leases at once"
