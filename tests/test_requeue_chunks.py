"""``outbox dead requeue --all`` in id-ordered chunks, one short transaction each (issue 20
item 7), on every engine: the per-topic report and the refusal of permanent rows stay
as they were, and no statement requeues more than one chunk."""

from __future__ import annotations

from typing import Any

from engine_support import statuses

from outbox import Status
from outbox.domain.events import prepare_event
from outbox.storage.store import OutboxStore


def dead_rows(store: OutboxStore, topics: list[str], permanent: frozenset[int] = frozenset()) -> list[int]:
    """One dead row per topic given (in order); the positions in ``permanent`` carry a
    permanent reason (poison)."""
    ids = []
    with store.transaction() as cursor:
        for n, topic in enumerate(topics):
            event = prepare_event(topic=topic, aggregate_type="o", aggregate_id=f"a{n % 7}", payload={"n": n})
            ids.append(store.engine.insert_event(cursor, event))
    with store.transaction() as cursor:
        for n, id in enumerate(ids):
            reason = "poison: too big" if n in permanent else "retriable: no queue bound"
            store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, attempts = 3, "
                                 f"processed_at = {store.engine.now}, last_error = ? WHERE id = ?", [reason, id])
    return ids


def spy(store: OutboxStore) -> list[tuple[str, int]]:
    """(operation, rows changed by each requeue UPDATE) as the store runs them on the real
    database: ``("txn", 0)`` marks each transaction the store opens, ``("txn", 1)`` one run
    alone (``Connections.transaction``)."""
    seen: list[tuple[str, int]] = []
    run, execute = store._run, store.engine.execute

    def counting_run(operation: str, work: Any, **options: Any) -> Any:
        seen.append(("txn", int(options.get("alone", False))))
        return run(operation, work, **options)

    def counting_execute(cursor: Any, text: str, params: Any = ()) -> Any:
        result = execute(cursor, text, params)
        if text.startswith("UPDATE") and "status = 0, attempts = 0" in text:
            seen.append(("requeue", result.rowcount))
        return result

    store._run = counting_run  # type: ignore[method-assign]
    store.engine.execute = counting_execute  # type: ignore[method-assign]
    return seen


def test_requeue_all_runs_in_chunks_and_keeps_the_report(store: OutboxStore) -> None:
    topics = ["orders.paid", "orders.created", "orders.big"] * 9  # 27 rows
    permanent = {2, 5, 8}  # three orders.big rows are poison
    ids = dead_rows(store, topics, frozenset(permanent))
    seen = spy(store)
    result = store.requeue(None, chunk=5)
    assert result.requeued == {"orders.big": 6, "orders.created": 9, "orders.paid": 9}
    assert result.permanent == {"orders.big": 3}
    updates = [n for op, n in seen if op == "requeue"]
    # 24 rows in chunks of 5: 5 full chunks and one of 4, each in its own transaction
    # (plus the one that counts the kept rows).
    assert updates == [5, 5, 5, 5, 4]
    assert sum(1 for op, _ in seen if op == "txn") == 1 + 5
    now = statuses(store)
    assert [now[ids[n]] for n in sorted(permanent)] == [Status.DEAD] * 3
    assert all(now[id] == Status.PENDING for n, id in enumerate(ids) if n not in permanent)


def test_forced_requeue_all_and_requeue_dead_run_in_chunks(store: OutboxStore) -> None:
    ids = dead_rows(store, ["t.a", "t.b"] * 6, permanent=frozenset({0}))
    seen = spy(store)
    assert store.requeue(None, force=True, chunk=4).requeued == {"t.a": 6, "t.b": 6}
    assert [n for op, n in seen if op == "requeue"] == [4, 4, 4]
    assert set(statuses(store).values()) == {Status.PENDING}
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, "
                               f"processed_at = {store.engine.now}")
    seen.clear()
    assert store.requeue_dead(chunk=5) == len(ids)
    assert [n for op, n in seen if op == "requeue"] == [5, 5, 2]
    assert set(statuses(store).values()) == {Status.PENDING}


def test_requeue_all_with_nothing_dead_reports_nothing(store: OutboxStore) -> None:
    assert store.requeue(None).requeued == {}
    assert store.requeue_dead() == 0


def test_a_selection_is_requeued_as_all_is_in_chunks_reporting_what_it_kept(store: OutboxStore) -> None:
    """``requeue(ids, all_or_nothing=False)``, the Django admin's selection: ``chunk`` ids
    per transaction in id order, the permanent rows kept and named, the ids not dead or
    gone reported; everything else requeued. Without ``force`` only; with it every dead row."""
    ids = dead_rows(store, ["t.a", "t.b", "t.c"] * 4, permanent=frozenset({1, 7}))
    with store.transaction() as cursor:  # one row done, one gone
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 2 WHERE id = ?", [ids[4]])
        store.engine.execute(cursor, f"DELETE FROM {store.engine.table} WHERE id = ?", [ids[5]])
    seen = spy(store)
    result = store.requeue([*reversed(ids), ids[0]], chunk=5, all_or_nothing=False)
    assert result.requeued == {"t.a": 4, "t.b": 1, "t.c": 3}
    assert [(row.id, row.topic, row.last_error) for row in result.refused] == [
        (ids[1], "t.b", "poison: too big"), (ids[7], "t.b", "poison: too big")]
    assert result.not_dead == {ids[4]: Status.DONE} and result.missing == [ids[5]]
    assert [n for op, n in seen if op == "requeue"] == [3, 3, 2]  # ids 0-4, 5-9, 10-11: what each may requeue
    assert sum(1 for op, _ in seen if op == "txn") == 3
    now = statuses(store)
    assert [now[ids[1]], now[ids[7]], now[ids[4]]] == [Status.DEAD, Status.DEAD, Status.DONE]
    assert all(now[id] == Status.PENDING for n, id in enumerate(ids) if n not in (1, 4, 5, 7))
    forced = store.requeue(ids, force=True, all_or_nothing=False)
    assert forced.requeued == {"t.b": 2} and not forced.refused


def test_the_command_lines_ids_stay_all_or_nothing(store: OutboxStore) -> None:
    ids = dead_rows(store, ["t.a", "t.b"], permanent=frozenset({1}))
    result = store.requeue(ids)
    assert result.requeued == {} and [row.id for row in result.refused] == [ids[1]]
    assert set(statuses(store).values()) == {Status.DEAD}


def test_a_requeue_runs_alone_only_where_the_server_ends_no_idle_transaction(store: OutboxStore) -> None:
    """Found in review: on SQL Server a requeue cut before its COMMIT kept the requeued rows'
    keys locked, and every claim waited on them; there each statement now commits as it runs
    (``OutboxStore._requeue_alone``). Where the server ends an idle transaction (PostgreSQL,
    MySQL/MariaDB; SQLite has no network) a requeue stays one transaction per chunk."""
    ids = dead_rows(store, ["t.a", "t.b", "t.a"], permanent=frozenset({2}))
    seen = spy(store)
    assert store.requeue(ids[:2]).requeued == {"t.a": 1, "t.b": 1}
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"UPDATE {store.engine.table} SET status = 4, processed_at = {store.engine.now} "
                             "WHERE id IN (?, ?)", ids[:2])
    assert store.requeue(ids, all_or_nothing=False).requeued == {"t.a": 1, "t.b": 1}
    assert store.requeue(None, force=True).requeued == {"t.a": 1}
    alone = int(not store.engine.ends_idle_transactions)
    assert [n for op, n in seen if op == "txn"] == [alone] * 3
    assert set(statuses(store).values()) == {Status.PENDING}
