"""The ordering rule as pure logic (used by the MySQL and SQLite claims) and the
split of a claimed batch into chains."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox.core.model import OutboxMessage, Status
from outbox.domain.chains import Candidate, keep_locked, plan_claim, split_chains

P, C, F = Status.PENDING, Status.CLAIMED, Status.FAILED


def cand(id: int, agg: str, status: int = P, attempts: int = 0) -> Candidate:
    return Candidate(id, agg, status, attempts)


def test_whole_chains_are_claimed_when_nothing_blocks() -> None:
    plan = plan_claim([cand(1, "a"), cand(2, "b"), cand(3, "a"), cand(4, "a")], {}, 10)
    assert plan.claim_ids == [1, 2, 3, 4] and plan.dead_ids == []


def test_a_non_candidate_open_row_blocks_everything_behind_it() -> None:
    # Row 2 of "a" is open but not ours (locked elsewhere, or not due): 3 and 5 wait.
    plan = plan_claim([cand(1, "a"), cand(3, "a"), cand(4, "b"), cand(5, "a")], {"a": 2}, 10)
    assert plan.claim_ids == [1, 4]


def test_an_aggregate_id_read_as_bytes_is_blocked_like_any_other() -> None:
    """A binary aggregate_id column (a table made by another script) reads as bytes: its
    blockers were ignored, so a claim took rows behind another claim's (found in review)."""
    rows = [Candidate(3, b"order-1", P, 0), Candidate(4, b"order-1", P, 0), Candidate(5, b"order-2", P, 0)]
    assert plan_claim(rows, {b"order-1": 2}, 10).claim_ids == [5]


def test_blocker_before_the_head_blocks_the_whole_aggregate() -> None:
    assert plan_claim([cand(5, "a"), cand(6, "a")], {"a": 1}, 10).claim_ids == []


def test_expired_and_retried_rows_only_start_chains() -> None:
    plan = plan_claim([cand(1, "a", C, 1), cand(2, "a", C, 1), cand(3, "b", F, 1), cand(4, "b")], {}, 10)
    assert plan.claim_ids == [1, 3, 4]


def test_an_expired_row_at_max_attempts_goes_dead_and_its_tail_waits() -> None:
    plan = plan_claim([cand(1, "a", C, 2), cand(2, "a"), cand(3, "b")], {}, 3)
    assert plan.dead_ids == [1] and plan.claim_ids == [3]


def test_a_limit_keeps_whole_chains_oldest_chain_first_and_cuts_the_last() -> None:
    # A window over three aggregates, round robin: the oldest chains go whole, the
    # last one is cut to a prefix, blocked aggregates take no room.
    window = [cand(i, "abc"[(i - 1) % 3]) for i in range(1, 10)]  # a: 1 4 7, b: 2 5 8, c: 3 6 9
    assert plan_claim(window, {}, 10, limit=5).claim_ids == [1, 2, 4, 5, 7]
    assert plan_claim(window, {"a": 0}, 10, limit=5).claim_ids == [2, 3, 5, 6, 8]
    assert plan_claim(window, {}, 10, limit=100).claim_ids == list(range(1, 10))


def test_a_claim_keeps_of_each_planned_chain_the_prefix_it_locked() -> None:
    # Planned over a window read without locks; then locked with SKIP LOCKED. A chain whose
    # head another claim holds is left whole; a chain whose middle row could not be locked
    # keeps the rows before it; a dead row is kept only if locked.
    window = [cand(1, "a"), cand(2, "b"), cand(3, "c", C, 2), cand(4, "a"), cand(5, "b"), cand(7, "d"),
              cand(8, "b")]
    plan = plan_claim(window, {}, 3)
    assert (plan.claim_ids, plan.dead_ids) == ([1, 2, 4, 5, 7, 8], [3])
    kept = keep_locked(plan, window, locked=[2, 4, 8, 3, 7])  # a's head and b's 5 held elsewhere
    assert (kept.claim_ids, kept.dead_ids) == ([2, 7], [3])
    assert keep_locked(plan, window, locked=[1, 2, 4, 5, 7, 8]).dead_ids == []


def message(id: int, agg: str) -> OutboxMessage:
    return OutboxMessage(id, f"m{id}", "t", "x", agg, None, "{}", {}, None, 0,
                         datetime.now(UTC), "lease")


def test_split_chains_groups_by_aggregate_in_id_order_oldest_chain_first() -> None:
    chains = split_chains([message(i, a) for i, a in [(4, "b"), (1, "a"), (3, "a"), (2, "c"), (5, "b")]])
    assert [[m.id for m in chain] for chain in chains] == [[1, 3], [2], [4, 5]]
