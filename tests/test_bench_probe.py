"""``bench.backlog.claimable``, the drain benchmarks' probe for "a claim could take a chain
now", against its definition (some pending row has no open row before it in its aggregate),
read row by row, on random outboxes of every engine."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from engine_support import add

from bench.backlog import claimable
from outbox.storage.store import OutboxStore


def free_head_exists(store: OutboxStore) -> bool:
    """The definition, in Python over every row."""
    with store.transaction() as cursor:
        rows = store.engine.execute(cursor, f"SELECT id, aggregate_id, status FROM {store.engine.table}").fetchall()
    first_open: dict[str, tuple[int, int]] = {}
    for id_, aggregate, status in rows:
        if int(status) in (0, 1, 3) and (aggregate not in first_open or id_ < first_open[aggregate][0]):
            first_open[aggregate] = (int(id_), int(status))
    return any(status == 0 for _, status in first_open.values())


def test_the_claimable_probe_agrees_with_its_definition(store: OutboxStore, writer: Any) -> None:
    run = SimpleNamespace(table=store.engine.table, engine=store.engine.name)
    seen = set()
    for seed in range(16):
        rng = random.Random(seed)
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"DELETE FROM {store.engine.table}")
        for n in range(rng.randrange(1, 4)):
            add(writer, store, f"agg-{n}", rng.randrange(1, 6))
        for _ in range(rng.randrange(0, 4)):
            claim = store.claim(rng.choice([1, 2, 3]))
            if rng.random() < 0.5:
                store.mark_done([m.id for m in claim.messages], claim.lease)
        expected = free_head_exists(store)
        assert claimable(writer, run) is expected, f"seed {seed}"
        seen.add(expected)
    assert seen == {True, False}  # both answers were met
