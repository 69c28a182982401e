"""The store contract, run for real on every engine (SQLite, PostgreSQL, MariaDB,
and SQL Server when one is reachable). Each rule of the claim is pinned here."""

from __future__ import annotations

import importlib
import json
import random
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from engine_support import ENGINES, MYSQLCLIENT, add, row, statuses

from outbox import EnqueueError, Status, enqueue
from outbox.core.model import FailResult
from outbox.domain.chains import Candidate, plan_claim
from outbox.storage.store import OutboxStore


@pytest.fixture(params=[*ENGINES, MYSQLCLIENT])
def kind(request: pytest.FixtureRequest) -> str:
    """Every engine, and MariaDB/MySQL once more on mysqlclient (``engine_support.MYSQLCLIENT``)."""
    return request.param


def claimed_ids(store: OutboxStore, batch: int = 100) -> list[int]:
    return [m.id for m in store.claim(batch).messages]


# -- schema ---------------------------------------------------------------------

def test_migrate_is_idempotent_and_repairs_a_partial_schema(store: OutboxStore, writer: Any) -> None:
    store.migrate()
    # Drop one index as a half-finished deployment would leave it, then repair.
    index = store.engine.index_name("claim_ready")
    with store.transaction() as cursor:
        drop = {"mysql": f"DROP INDEX `{index}` ON {store.engine.table}",
                "mssql": f"DROP INDEX [{index}] ON {store.engine.table}"}.get(
            store.engine.name, f"DROP INDEX {store.engine.qualify(index)}")
        store.engine.execute(cursor, drop)
    store.migrate()
    store.migrate()
    add(writer, store, "a", 2)
    assert claimed_ids(store) == sorted(statuses(store))


# -- enqueue ----------------------------------------------------------------------

def test_enqueue_commits_and_rolls_back_with_the_caller(store: OutboxStore, writer: Any) -> None:
    kept = add(writer, store, "a", commit=True)
    add(writer, store, "b", commit=False)
    writer.rollback()
    assert list(statuses(store)) == kept
    assert claimed_ids(store) == kept


def test_enqueue_is_idempotent_by_message_id_and_keeps_the_transaction_usable(store: OutboxStore,
                                                                              writer: Any) -> None:
    first = add(writer, store, "a", message_id="m-1", commit=False)
    again = add(writer, store, "a", message_id="m-1", commit=False)
    after = add(writer, store, "a", message_id="m-2", commit=False)
    writer.commit()
    assert first == again
    assert sorted(statuses(store)) == sorted(first + after)
    # And across transactions, after commit.
    assert add(writer, store, "z", message_id="m-1") == first
    assert len(statuses(store)) == 2


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_a_racing_enqueue_of_one_message_id_waits_for_the_first_and_raises_nothing(
        store: OutboxStore, writer: Any, url: str, first_ends: str) -> None:
    """The second transaction waits for the first: then it has the first's row (committed) or
    writes its own (rolled back), and its transaction goes on (README, "Write side"; SQL
    Server's: tests/test_mssql_live.py)."""
    second, results = store.engine.connect(url), []
    try:
        (held,) = add(writer, store, "a", message_id="same-id", commit=False)

        def racer() -> None:
            try:
                results.append(add(second, store, "a", message_id="same-id", commit=False)[0])
                results.append(add(second, store, "a", message_id="other-id")[0])
            except BaseException as exc:  # surfaced below
                results.append(exc)

        thread = threading.Thread(target=racer)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not results  # waiting for the first transaction
        writer.commit() if first_ends == "commit" else writer.rollback()
        thread.join(timeout=30)
        assert all(isinstance(r, int) for r in results) and len(results) == 2, results
        assert (results[0] == held) == (first_ends == "commit")
    finally:
        second.close()
    assert sorted(statuses(store)) == sorted({held, *results} if first_ends == "commit" else results)

@pytest.mark.parametrize("kind", ["postgresql"])
@pytest.mark.parametrize("listen", [False, True], ids=["plain", "notify"])
def test_a_stored_message_id_purged_during_its_enqueue_is_written_anew(store: OutboxStore, writer: Any,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       listen: bool) -> None:
    """The insert finds the message_id stored (ON CONFLICT DO NOTHING), then the purge deletes
    that done row before enqueue looks its id up: the look-up found nothing and the caller
    got ``TypeError: 'NoneType' object is not subscriptable`` (a producer's retry of an id at
    the retention's edge; a stress run of writers reusing ids beside a purge met it every
    second). Now the insert runs again and writes the event anew, as after any purge."""
    from outbox.core.config import get_settings

    writing = importlib.import_module("outbox.enqueue")  # the module (``outbox.enqueue`` is the function)
    (first,) = add(writer, store, "a", message_id="m-1")
    if listen:
        monkeypatch.setattr(writing, "notify_channel", lambda *args: "outbox_test_purge_race")
    engine = writing._engine("postgresql", store.engine.table_name, get_settings().schema)
    real_execute, statements = engine.execute, []

    def execute(cursor: Any, text: str, params: Any = ()) -> Any:
        result = real_execute(cursor, text, params)
        statements.append(text)
        if len(statements) == 1:  # the insert found the row: the purge takes it now
            with store.transaction() as other:
                store.engine.execute(other, f"DELETE FROM {store.engine.table} WHERE id = ?", [first])
        return result

    monkeypatch.setattr(engine, "execute", execute)
    again = add(writer, store, "a", message_id="m-1")
    assert len(statements) > 2  # the insert, the look-up that found nothing, the insert again
    assert again != [first]
    assert list(statuses(store)) == again

BAD_INPUT = [
    ({"payload": {"x": float("nan")}}, "not valid JSON"),
    ({"payload": {"x": float("inf")}}, "not valid JSON"),
    ({"payload": {"x": object()}}, "not valid JSON"),
    ({"payload": "just a string"}, "object or array"),
    ({"payload": 42}, "object or array"),
    ({"payload": {"x": "\udc00"}}, "not valid JSON"),
    ({"payload": {"x": "nul\x00"}}, "NUL"),
    ({"topic": ""}, "topic must not be empty"),
    ({"topic": "   "}, "topic must not be empty"),
    ({"topic": "t" * 256}, "topic is 256 characters"),
    ({"aggregate_id": "a" * 256}, "aggregate_id is 256"),
    ({"aggregate_type": ""}, "aggregate_type must not be empty"),
    ({"message_id": "m" * 65}, "message_id is 65"),
    ({"message_id": "m1 "}, "message_id 'm1 ' starts or ends with whitespace"),  # issue 20 item 2
    ({"key": "k" * 256}, "key is 256"),
    ({"headers": {"h": {"nested": 1}}}, "header 'h'"),
    ({"headers": ["not", "a", "mapping"]}, "headers must be a mapping"),
    # Issue 14 items 2-3, issue 10 item 3: what AMQP or a column cannot hold, caught before
    # the driver (a NUL in a header used to abort PostgreSQL's transaction; a lone
    # surrogate raised the driver's UnicodeEncodeError; SQL Server truncated silently).
    ({"headers": {"h": "nul\x00"}}, "header 'h': its value contains a NUL character"),
    ({"headers": {"h\x00": "v"}}, "header name .* contains a NUL character"),
    ({"headers": {"h": "\udc00"}}, "header 'h': its value contains a lone surrogate"),
    ({"topic": "t\udc00"}, "topic contains a lone surrogate"),
    ({"aggregate_id": "\ud800"}, "aggregate_id contains a lone surrogate"),
    ({"key": "\udc00"}, "key contains a lone surrogate"),
    ({"message_id": "m\udc00"}, "message_id contains a lone surrogate"),
    ({"topic": "é" * 255}, "topic is 510 bytes in UTF-8"),
    ({"headers": {"h" * 256: 1}}, "header name .* is 256 bytes"),
    ({"message_id": "😀" * 64}, "message_id is 64 characters but 128 UTF-16 code units"),
    ({"aggregate_id": "😀" * 128}, "aggregate_id is 128 characters but 256 UTF-16 code units"),
    ({"headers": {"big": 2 ** 64}}, "outside the signed 64-bit range"),
]


@pytest.mark.parametrize("override,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_raises_before_anything_is_written(store: OutboxStore, writer: Any,
                                                     override: dict, message: str) -> None:
    payload: dict[str, Any] = {"topic": "orders.created", "aggregate_type": "order", "aggregate_id": "1",
                               "payload": {"ok": True}}
    payload.update(override)
    with pytest.raises(EnqueueError, match=message) as caught:
        enqueue(writer, table=store.engine.table_name, **payload)
    assert isinstance(caught.value, ValueError)
    # The caller's transaction is untouched and still usable.
    good = add(writer, store, "1")
    assert list(statuses(store)) == good


def test_unicode_and_one_megabyte_payloads_round_trip(store: OutboxStore, writer: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    text = "zażółć gęślą jaźń – 東京 – 🚀 – \u202e"
    limit = 1_048_576
    skeleton = len(json.dumps({"blob": ""}, separators=(",", ":")).encode())
    big = {"blob": "x" * (limit - skeleton)}
    ids = [add(writer, store, "ü-1", payload={"text": text}, headers={"x-note": text}, key="clé")[0],
           add(writer, store, "ü-2", payload=big)[0]]
    with pytest.raises(EnqueueError, match="OUTBOX_MAX_PAYLOAD_BYTES"):
        add(writer, store, "ü-3", payload={"blob": "x" * (limit - skeleton + 1)})
    messages = {m.id: m for m in store.claim(10).messages}
    assert sorted(messages) == ids
    first = messages[ids[0]]
    assert json.loads(first.payload) == {"text": text}
    assert first.headers == {"x-note": text}
    assert first.aggregate_id == "ü-1" and first.partition_key == "clé"
    assert json.loads(messages[ids[1]].payload) == big



def test_payload_floats_with_an_exponent_come_back_as_the_same_floats(store: OutboxStore, writer: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL's jsonb writes a number out in full and keeps only the fraction it was
    given: ``1e+20`` came back as 100000000000000000000, an integer to Python's json (and to
    any typed reader), and a payload of such numbers came back many times larger than the
    size enqueue had checked (it then went dead at publish, over the broker's limit). Floats
    are now written out with a fraction before the size check, on every engine."""
    payload = {"big": 1e20, "neg": -2.5e17, "max": 1.7976931348623157e308, "small": 1e-7, "text": "1e+20",
               "list": [1e16, 3, "x\\\"e+5"], "key e+1": 1.5}
    (id_,) = add(writer, store, "a", payload=payload)
    (message,) = store.claim(1).messages
    got = json.loads(message.payload)
    assert got == payload and json.dumps(got, sort_keys=True) == json.dumps(payload, sort_keys=True)  # floats stay floats
    assert message.id == id_
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_BYTES", "1000")
    from outbox.core.config import reset_settings
    reset_settings()
    try:
        with pytest.raises(EnqueueError, match=r"payload is 3\d{3} bytes; OUTBOX_MAX_PAYLOAD_BYTES allows 1000"):
            add(writer, store, "b", payload=[1e300] * 10)  # 68 bytes as Python writes it
    finally:
        monkeypatch.delenv("OUTBOX_MAX_PAYLOAD_BYTES")
        reset_settings()


def test_payload_floats_with_a_negative_exponent_are_checked_at_the_size_they_come_back(
        store: OutboxStore, writer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonb writes a negative exponent out in full too: 700,001 bytes of ``[5e-324, ...]``
    came back as 32,800,000 (326 characters each), far past the size enqueue had checked."""
    payload = {"tiny": 5e-324, "small": -1.5e-10, "seven": 1e-07}
    (id_,) = add(writer, store, "a", payload=payload)
    (message,) = store.claim(1).messages
    assert json.loads(message.payload) == payload and message.id == id_
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_BYTES", "1000")
    from outbox.core.config import reset_settings
    reset_settings()
    try:
        with pytest.raises(EnqueueError, match=r"payload is 3\d{3} bytes; OUTBOX_MAX_PAYLOAD_BYTES allows 1000"):
            add(writer, store, "b", payload=[5e-324] * 10)  # 71 bytes as Python writes it
    finally:
        monkeypatch.delenv("OUTBOX_MAX_PAYLOAD_BYTES")
        reset_settings()

# -- claim: chains, fairness, blocking ---------------------------------------------------

def test_claim_takes_whole_chains_in_id_order(store: OutboxStore, writer: Any) -> None:
    hot = add(writer, store, "hot", 6)
    cold = add(writer, store, "cold", 1)
    claim = store.claim(100)
    assert [m.id for m in claim.messages] == sorted(hot + cold)
    assert {m.lease for m in claim.messages} == {claim.lease}
    assert all(m.attempt == 1 for m in claim.messages)
    assert claimed_ids(store) == []  # everything is leased now


def test_claim_is_oldest_first_across_aggregates_and_honours_the_batch(store: OutboxStore, writer: Any) -> None:
    a1 = add(writer, store, "a")
    b1 = add(writer, store, "b")
    a2 = add(writer, store, "a")
    c1 = add(writer, store, "c")
    # The oldest row comes first, with its chain: a claim scans a window of candidates
    # wider than its batch and keeps whole chains, oldest chain first (docs/internals.md,
    # "Claim windows"), so over few aggregates it leaves the others to a concurrent claimer.
    assert claimed_ids(store, 2) == a1 + a2
    assert claimed_ids(store, 2) == b1 + c1
    a3 = add(writer, store, "a")
    assert claimed_ids(store, 2) == []  # a3 waits behind a1's and a2's live lease
    assert statuses(store)[a3[0]] == Status.PENDING


def test_a_claim_window_leaves_blocked_aggregates_to_their_holder(store: OutboxStore, writer: Any) -> None:
    ids = {name: [] for name in "abcd"}
    for _ in range(3):
        for name in "abcd":
            ids[name] += add(writer, store, name)
    first = claimed_ids(store, 6)  # the two oldest aggregates, whole
    assert first == sorted(ids["a"] + ids["b"])
    second = claimed_ids(store, 6)  # a concurrent claimer gets the other two
    assert second == sorted(ids["c"] + ids["d"])


def test_a_claim_running_beside_another_takes_other_chains(make_store: Any, writer: Any, kind: str) -> None:
    """Two claims that overlap in time take disjoint chains, and the later one is not empty
    while other aggregates wait: it skips the chains the other claim holds instead of
    colliding on their heads (docs/internals.md, "Claim windows")."""
    if kind == "sqlite":
        pytest.skip("SQLite has one writer: its claims run one after the other and cannot overlap")
    table = f"outbox_overlap{uuid.uuid4().hex[:8]}"  # of this test's own: the mysql and mysqlclient runs share a server
    first, second = make_store(table=table), make_store(table=table)
    for store in (first, second):
        store.use_claim_window(4)  # windows of 24 rows: every aggregate's three rows in them
    ids: dict[str, list[int]] = {name: [] for name in "abcdefgh"}
    for _ in range(3):
        for name in ids:
            ids[name] += add(writer, first, name)
    with first.transaction() as cursor:  # the first claim's statement has not committed yet
        held = sorted(int(r[0]) for r in first.engine.claim(cursor, 6, first.new_lease(), 60_000, 3))
        assert held == sorted(ids["a"] + ids["b"])
        beside = claimed_ids(second, 6)
        assert beside == sorted(ids["c"] + ids["d"])
    assert claimed_ids(second, 6) == sorted(ids["e"] + ids["f"])


#: (status, how the row stands) of the random outboxes below: eligible or not, open or not.
STATES = {"pending": (0, None), "expired": (1, "claimed_at = {past}"), "live": (1, "claimed_at = {now}"),
          "done": (2, "processed_at = {now}"), "due": (3, "next_retry_at = {past}"),
          "not due": (3, "next_retry_at = {future}"), "dead": (4, "processed_at = {now}")}


def watch_passes(engine: Any) -> list[bool]:
    """The ``read_past`` of each ``Engine.claim_pass`` the store runs from now on, in order:
    False for a claim's first read of its window, True for its read past it."""
    passes: list[bool] = []
    claim_pass = engine.claim_pass

    def watched(*args: Any, read_past: bool) -> tuple[list[tuple], bool]:
        passes.append(read_past)
        return claim_pass(*args, read_past=read_past)

    engine.claim_pass = watched
    return passes


def test_the_claim_takes_what_plan_claim_takes_over_its_window_on_random_outboxes(make_store: Any,
                                                                                   writer: Any) -> None:
    """The claim's statement (one per engine) against the rule in Python, on random tables:
    pending rows, expired and live leases, due and not-due retries, done and dead rows, over
    few or many aggregates; the claim takes ``plan_claim`` over its window (the oldest
    ``CLAIM_WINDOW * batch`` eligible rows), whole chains, oldest first, the rows that go
    dead included (docs/internals.md, "Claim windows"). In half the rounds the claim names
    rows ``behind`` (a drain slice's own rows, published before the claim's: docs/internals.md,
    "Claims that continue a chain"): those are no blockers. A claim that takes nothing reads
    past its window exactly when the window was full (``Engine.claim_pass``), and the model
    checks that reading past a window that was not full would have taken nothing."""
    rng = random.Random(2026_11_25)
    for round_ in range(90):
        store = make_store(max_attempts=3, claim_timeout_ms=60_000)
        store.use_claim_window(rng.choice([1, 2, 4]))  # OUTBOX_RELAY_CLAIM_WINDOW
        e = store.engine
        aggregates = rng.choice(["ab", "abcdefgh"])
        states: dict[int, tuple[str, str, int]] = {}
        for _ in range(rng.randint(5, 30)):
            aggregate = rng.choice(aggregates)
            (new_id,) = add(writer, store, aggregate)
            # The last rounds mostly heads that wait: windows, full or not, with nothing to take.
            state = rng.choice(["pending"] * 5 + list(STATES) if round_ < 60 else [*STATES, "live", "not due"] * 2)
            states[new_id] = (aggregate, state, rng.randint(0, 3))
        with store.transaction() as cursor:
            for id_, (_, state, attempts) in states.items():
                status, also = STATES[state]
                times = {"past": e.now_plus_ms().replace("?", "-3600000"), "now": e.now,
                         "future": e.now_plus_ms().replace("?", "3600000")}
                extra = ", " + also.format(**times) if also else ""
                e.execute(cursor, f"UPDATE {e.table} SET status = ?, attempts = ?{extra} WHERE id = ?",
                          [status, attempts, id_])
        eligible = [i for i in sorted(states) if states[i][1] in ("pending", "expired", "due")]
        batch = rng.randint(1, 8)
        window = eligible[:e.claim_window(batch)]
        behind = sorted(i for i in states if rng.random() < 0.4) if round_ % 2 else []
        blockers: dict[str, int] = {}
        for i in sorted(states):
            if states[i][1] in ("pending", "expired", "live", "due", "not due") and i not in window + behind:
                blockers.setdefault(states[i][0], i)
        expected = plan_claim([Candidate(i, states[i][0], STATES[states[i][1]][0], states[i][2]) for i in window],
                              blockers, 3, limit=batch)
        full = len(eligible) >= e.claim_window(batch)  # what Engine.claim_pass says
        reads_past = not expected.claim_ids and not expected.dead_ids and full
        if not expected.claim_ids and not expected.dead_ids:
            # Nothing to take in the window: the claim reads past the rows of aggregates whose
            # first open row (``behind`` left out) it may not take (Engine.unblocked_rows), up to
            # BLOCKED_SCAN windows of eligible rows; only when the window was full, since a
            # window that held fewer held every eligible row: reading past it takes nothing
            # (asserted below on the model, and by the claim's passes on the engine).
            first: dict[str, str] = {}
            for i in sorted(states):
                if states[i][1] in ("pending", "expired", "live", "due", "not due") and i not in behind:
                    first.setdefault(states[i][0], states[i][1])
            scanned = eligible[:e.claim_window(batch) * e.BLOCKED_SCAN]
            window = [i for i in scanned if first[states[i][0]] in ("pending", "expired", "due")][
                :e.claim_window(batch)]
            blockers = {}
            for i in sorted(states):
                if states[i][1] in ("pending", "expired", "live", "due", "not due") and i not in window + behind:
                    blockers.setdefault(states[i][0], i)
            expected = plan_claim([Candidate(i, states[i][0], STATES[states[i][1]][0], states[i][2])
                                   for i in window], blockers, 3, limit=batch)
            assert full or not (expected.claim_ids or expected.dead_ids), repr((round_, states, batch))
        passes = watch_passes(e)
        claim = store.claim(batch, behind=behind)
        got = (sorted(m.id for m in claim.messages), sorted(m.id for m in claim.dead))
        assert got == (sorted(expected.claim_ids), sorted(expected.dead_ids)), repr((round_, states, batch))
        assert (True in passes) == reads_past, repr((round_, states, batch, passes))  # a retry runs a pass again
        # What the claim returns is what it wrote: status and attempts as the table now has them
        # (MySQL's claim builds its rows from its locking read: Engine.claim, claimed_rows).
        with store.transaction() as cursor:
            table = {int(i): (int(st), int(a)) for i, st, a in e.execute(
                cursor, f"SELECT id, status, attempts FROM {e.table}").fetchall()}
        assert [(m.id, Status.CLAIMED, m.attempts) for m in claim.messages] == \
            [(m.id, *table[m.id]) for m in claim.messages], repr((round_, states, batch))
        assert [(m.id, Status.DEAD, m.attempts) for m in claim.dead] == \
            [(m.id, *table[m.id]) for m in claim.dead], repr((round_, states, batch))
        store.close()  # its connection until the teardown drops its table: 90 of PostgreSQL's 100 held at once


def test_a_claim_continues_the_chains_of_the_rows_it_is_behind(store: OutboxStore, writer: Any) -> None:
    """``behind``: the rows a drain slice publishes before its next claim's (docs/internals.md,
    "Claims that continue a chain"). They do not block the rows after them; every other open
    row still does, this claimer's own included when not named."""
    ids = add(writer, store, "a", 9)
    first = store.claim(3)
    assert [m.id for m in first.messages] == ids[:3]
    assert claimed_ids(store) == []  # held by a live lease
    assert [m.id for m in store.claim(3, behind=ids[:2]).messages] == []  # ids[2] still blocks
    second = store.claim(3, behind=ids[:3])
    assert [m.id for m in second.messages] == ids[3:6]
    assert {m.lease for m in second.messages} == {second.lease} != {first.lease}
    # Behind both leases: the rest; behind the second only: nothing, the first blocks.
    assert [m.id for m in store.claim(9, behind=ids[3:6]).messages] == []
    assert [m.id for m in store.claim(9, behind=ids[:6]).messages] == ids[6:]


def test_a_live_lease_blocks_the_rest_of_its_aggregate(store: OutboxStore, writer: Any) -> None:
    head = add(writer, store, "a")
    assert claimed_ids(store) == head
    tail = add(writer, store, "a", 2)
    other = add(writer, store, "b")
    assert claimed_ids(store) == other
    assert statuses(store)[tail[0]] == Status.PENDING


def test_an_open_row_in_the_middle_of_an_aggregate_ends_the_chain_before_it(store: OutboxStore,
                                                                          writer: Any) -> None:
    """Rows after the head that no claim may take yet (a live lease, a retry not yet due)
    stop the chain there, however many claimable rows follow them."""
    held = add(writer, store, "held", 4)
    late = add(writer, store, "late", 4)
    claim = store.claim(100)
    assert [m.id for m in claim.messages] == sorted(held + late)
    assert store.release([held[0]], claim.lease).ok  # held[1:] keep their live lease
    assert store.release([late[1]], claim.lease, delay=timedelta(hours=1)).ok
    assert store.release([late[0], *late[2:]], claim.lease).ok
    assert claimed_ids(store) == [held[0], late[0]]
    state = statuses(store)
    assert [state[i] for i in late[1:]] == [Status.PENDING] * 3


def test_head_blocked_by_a_failed_row_until_its_retry_is_due(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 3)
    other = add(writer, store, "b")
    claim = store.claim(1)
    assert [m.id for m in claim.messages] == ids[:1]
    result = store.mark_failed(ids[0], claim.lease, "broker said no", timedelta(hours=1))
    assert result.applied and not result.dead
    assert claimed_ids(store) == other  # a's tail waits behind the failed head
    assert statuses(store)[ids[0]] == Status.FAILED


def test_rows_queued_behind_a_waiting_head_do_not_hide_the_other_aggregates(make_store: Any, writer: Any) -> None:
    """More rows than a claim window queued behind one head that waits (a retry not due
    yet; another worker's live lease) must not stall every other aggregate: a claim whose
    window held nothing it could take reads past them (docs/internals.md, "Claim
    windows"). Before, every claim came back empty until the retry was due."""
    table = f"outbox_stall{uuid.uuid4().hex[:8]}"  # of this test's own (a server shared with the mysqlclient run)
    store = make_store(table=table)
    batch = 2
    window = store.engine.claim_window(batch)
    (a1,) = add(writer, store, "a")
    claim = store.claim(1)
    assert store.mark_failed(a1, claim.lease, "broker said no", timedelta(hours=1)).applied
    add(writer, store, "a", 2 * window)
    (b1,) = add(writer, store, "b")
    assert claimed_ids(store, batch) == [b1]
    # A hot aggregate whose head another worker holds, with a window's worth and more behind.
    (c1,) = add(writer, store, "c")
    holder = make_store(table=table)
    assert [m.id for m in holder.claim(1).messages] == [c1]
    add(writer, store, "c", 2 * window)
    d = add(writer, store, "d", 2)
    assert claimed_ids(store, batch) == d
    assert statuses(store)[a1] == Status.FAILED and statuses(store)[c1] == Status.CLAIMED


def test_an_empty_claim_reads_past_its_window_only_when_the_window_was_full(make_store: Any, writer: Any) -> None:
    """A claim that took nothing reads past its window only when that window held as many
    eligible rows as it reads (``Engine.claim_pass``): one that held fewer held every
    eligible row, and nothing can wait past it (docs/internals.md, "Claim windows"). Before,
    every empty claim read past, and a relay keeping up with a trickle of events, whose
    claims mostly come back empty, paid for each of them twice. Rows waiting for a later
    time and rows under a live lease are not eligible, so they do not fill the window."""
    table = f"outbox_full{uuid.uuid4().hex[:8]}"
    store, holder = make_store(table=table), make_store(table=table)
    batch = 2
    window = store.engine.claim_window(batch)
    (a1,) = add(writer, store, "a")
    assert [m.id for m in holder.claim(1).messages] == [a1]  # a live lease: a1 is not eligible
    (b1,) = add(writer, store, "b")
    assert holder.mark_failed(b1, holder.claim(1).lease, "broker said no", timedelta(hours=1)).applied
    add(writer, store, "a", window - 1)  # eligible, each behind a1: a window all but full
    passes = watch_passes(store.engine)
    assert claimed_ids(store, batch) == []
    assert passes == [False]
    add(writer, store, "a")  # now the window is full of rows blocked behind a1
    (c1,) = add(writer, store, "c")
    assert claimed_ids(store, batch) == [c1]  # found past the full window
    assert passes == [False, False, True]
    assert statuses(store)[a1] == Status.CLAIMED and statuses(store)[b1] == Status.FAILED


def test_aggregate_ids_that_differ_by_trailing_spaces_are_two_aggregates(make_store: Any, writer: Any) -> None:
    """The relay tells aggregates apart by their exact ids; an engine whose collation
    compares 'x' and 'x ' equal (MySQL's PAD SPACE) must not let one stand in for the
    other: a row of 'x' is never claimed while an earlier row of 'x' is open
    (docs/internals.md, "Aggregate ids compare exactly"). Before, MariaDB's claim took x3
    while x2 was in flight under another lease."""
    table = f"outbox_pad{uuid.uuid4().hex[:8]}"  # of this test's own (a server shared with the mysqlclient run)
    store, other = make_store(table=table), make_store(table=table)
    (p1,) = add(writer, store, "x ")
    x2, x3 = add(writer, store, "x", 2)
    first = store.claim(2)
    assert [(m.id, m.aggregate_id) for m in first.messages] == [(p1, "x "), (x2, "x")]
    assert claimed_ids(other, 10) == []
    assert store.mark_done([p1], first.lease).ok
    assert claimed_ids(other, 10) == []  # x2 is still open
    assert store.mark_done([x2], first.lease).ok
    assert claimed_ids(other, 10) == [x3]


def test_a_paused_routes_tails_do_not_hide_the_other_aggregates(store: OutboxStore, writer: Any) -> None:
    """Many aggregates whose heads were released with a delay (a paused route's), each with
    rows queued behind, nearly ``BLOCKED_SCAN`` windows of them, older than one row of
    another aggregate: a claim takes that row, and only it."""
    batch = 2
    window = store.engine.claim_window(batch)
    heads = [add(writer, store, f"r{k}")[0] for k in range(4)]
    claim = store.claim(4)
    assert sorted(m.id for m in claim.messages) == heads
    assert store.release(heads, claim.lease, timedelta(hours=1)).applied == 4
    per = (store.engine.BLOCKED_SCAN - 1) * window // 4
    for k in range(4):
        add(writer, store, f"r{k}", per)
    (other,) = add(writer, store, "s")
    assert claimed_ids(store, batch) == [other]
    assert claimed_ids(store, batch) == []  # the paused heads still wait


def test_a_due_retry_starts_a_chain_with_attempts_counted(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 3)
    claim = store.claim(1)
    result = store.mark_failed(ids[0], claim.lease, "transient", timedelta(0))
    assert result.applied and not result.dead
    again = store.claim(10)
    assert [m.id for m in again.messages] == ids
    assert [m.attempt for m in again.messages] == [2, 1, 1]
    assert row(store, ids[0], "last_error") == ("transient",)


def test_head_blocked_by_a_row_released_with_a_delay(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 2)
    claim = store.claim(10)
    assert store.release(ids, claim.lease, delay=timedelta(hours=1)).ok
    assert claimed_ids(store) == []  # pending but not yet due: the aggregate waits
    claim = store.claim(10)
    assert claim.messages == []


def test_release_spends_no_attempt(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 2)
    claim = store.claim(10)
    assert store.release(ids, claim.lease).ok
    again = store.claim(10)
    assert [m.id for m in again.messages] == ids
    assert [m.attempt for m in again.messages] == [1, 1]


# -- leases -----------------------------------------------------------------------------

def test_expired_lease_is_reclaimed_head_first_with_attempts_plus_one(make_store: Any, writer: Any) -> None:
    store = make_store(claim_timeout_ms=300, max_attempts=5)
    ids = add(writer, store, "a", 3)
    first = store.claim(10)
    assert [m.id for m in first.messages] == ids
    assert claimed_ids(store) == []
    time.sleep(0.6)
    # Only the head comes back: a row that may have killed its worker is retried
    # alone, so it cannot take the rest of its aggregate down with it again.
    second = store.claim(10)
    assert [m.id for m in second.messages] == ids[:1]
    assert second.messages[0].attempt == 2
    assert second.lease != first.lease
    assert store.mark_done(ids[:1], second.lease).ok
    time.sleep(0.6)
    third = store.claim(10)
    assert [m.id for m in third.messages] == ids[1:2]


def test_an_expired_row_behind_the_head_ends_the_chain(make_store: Any, writer: Any) -> None:
    # a1 and a2 were leased by a worker that died; a3 arrived meanwhile. a3 must not
    # overtake a2: the claim takes a1 alone.
    store = make_store(claim_timeout_ms=300, max_attempts=5)
    a1, a2 = add(writer, store, "a", 2)
    assert claimed_ids(store) == [a1, a2]
    a3 = add(writer, store, "a")[0]
    time.sleep(0.6)
    claim = store.claim(10)
    assert [m.id for m in claim.messages] == [a1]
    assert store.mark_done([a1], claim.lease).ok
    # a2 is now the head: an expired row may start a chain, and pending a3 follows it.
    assert claimed_ids(store) == [a2, a3]


def test_a_row_that_keeps_losing_its_lease_ends_dead_and_unblocks_its_aggregate(make_store: Any,
                                                                                 writer: Any) -> None:
    store = make_store(claim_timeout_ms=200, max_attempts=3)
    poison, after = add(writer, store, "a", 2)
    assert claimed_ids(store, 1) == [poison]
    time.sleep(0.4)
    assert claimed_ids(store, 1) == [poison]  # attempts 1
    time.sleep(0.4)
    assert claimed_ids(store, 1) == [poison]  # attempts 2
    time.sleep(0.4)
    claim = store.claim(10)                   # attempts would reach 3: dead instead
    assert claim.messages == []
    assert [(m.id, m.attempts) for m in claim.dead] == [(poison, 3)]
    assert statuses(store)[poison] == Status.DEAD
    assert "lease expired" in row(store, poison, "last_error")[0]
    assert claimed_ids(store, 10) == [after]


def test_acks_are_fenced_by_the_lease(make_store: Any, writer: Any) -> None:
    store = make_store(claim_timeout_ms=200, max_attempts=5)
    ids = add(writer, store, "a", 1) + add(writer, store, "b", 1) + add(writer, store, "c", 1)
    old = store.claim(10)
    time.sleep(0.4)
    new = store.claim(10)
    assert sorted(m.id for m in new.messages) == ids
    done = store.mark_done(ids, old.lease)
    assert (done.applied, done.stale) == (0, 3)
    assert not store.mark_failed(ids[0], old.lease, "late", timedelta(seconds=1)).applied
    assert store.release(ids, old.lease).applied == 0
    assert set(statuses(store).values()) == {Status.CLAIMED}
    assert store.mark_done(ids, new.lease).ok
    assert set(statuses(store).values()) == {Status.DONE}


# -- failures -----------------------------------------------------------------------------

def test_failed_with_no_retry_time_is_rejected(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a")
    claim = store.claim(1)
    with pytest.raises(TypeError, match="retry_in"):
        store.mark_failed(ids[0], claim.lease, "no retry time")
    assert statuses(store)[ids[0]] == Status.CLAIMED


def test_poison_goes_dead_at_once_and_max_attempts_ends_dead(store: OutboxStore, writer: Any) -> None:
    poison = add(writer, store, "p")[0]
    flaky = add(writer, store, "f")[0]
    claim = store.claim(10)
    assert store.mark_failed(poison, claim.lease, "payload too large", dead=True).dead
    for attempt in range(1, 4):  # max_attempts = 3
        result = store.mark_failed(flaky, claim.lease, f"attempt {attempt}", timedelta(0))
        assert result.applied
        if attempt < 3:
            assert not result.dead
            claim = store.claim(10)
            assert [m.id for m in claim.messages] == [flaky]
    assert result.dead
    assert statuses(store) == {poison: Status.DEAD, flaky: Status.DEAD}
    assert claimed_ids(store) == []


def test_a_failure_recorded_again_after_its_answer_was_lost_counts_as_applied(store: OutboxStore,
                                                                              writer: Any) -> None:
    """Found in review: when mark_failed's UPDATE committed and its answer was lost, the
    store's retry (or the ack queue's fail task) found nothing under the lease and said "not
    applied", so a row it had buried got no dead-letter copy. The same failure recorded
    again is now taken as applied; a different one, or the same text after the row moved on,
    is not."""
    poison, flaky = add(writer, store, "p")[0], add(writer, store, "f")[0]
    claim = store.claim(10)
    assert store.mark_failed(poison, claim.lease, "payload too large", dead=True) == FailResult(True, True)
    assert store.mark_failed(poison, claim.lease, "payload too large", dead=True) == FailResult(True, True)
    assert store.mark_failed(poison, claim.lease, "another reason", dead=True) == FailResult(False, False)
    assert store.mark_failed(flaky, claim.lease, "broker said no", timedelta(0)) == FailResult(True, False)
    assert store.mark_failed(flaky, claim.lease, "broker said no", timedelta(0)) == FailResult(True, False)
    again = store.claim(10)  # due at once: claimed again, under a new lease
    assert [m.id for m in again.messages] == [flaky]
    assert store.mark_failed(flaky, claim.lease, "broker said no", timedelta(0)) == FailResult(False, False)
    assert int(row(store, flaky, "attempts")[0]) == 1  # the repeats wrote nothing


def test_a_stale_lease_failing_the_same_way_as_the_new_holder_is_refused(make_store: Any, writer: Any) -> None:
    """Found in review: the check above took any failed or dead row with no lease and the same
    error for its own earlier try, so a worker whose lease expired and was claimed again,
    failing an event the way its new holder had (the same broker error), was told its write
    applied: no stale warning, and when the new holder's failure buried the row, a second
    dead-letter copy and a second dead event counted. Only the lease that failed it repeats."""
    store = make_store(claim_timeout_ms=200, max_attempts=5)
    flaky, poison = add(writer, store, "f")[0], add(writer, store, "p")[0]
    old = store.claim(10)
    time.sleep(0.4)
    new = store.claim(10)  # the leases expired: claimed again, under a new lease
    assert sorted(m.id for m in new.messages) == [flaky, poison]
    error = "retriable: [Errno 111] Connection refused"
    assert store.mark_failed(flaky, new.lease, error, timedelta(seconds=30)) == FailResult(True, False)
    assert store.mark_failed(poison, new.lease, "poison: too large", dead=True) == FailResult(True, True)
    assert store.mark_failed(flaky, old.lease, error, timedelta(seconds=30)) == FailResult(False, False)
    assert store.mark_failed(poison, old.lease, "poison: too large", dead=True) == FailResult(False, False)
    # The new holder's own repeats (an answer lost) still count as applied.
    assert store.mark_failed(flaky, new.lease, error, timedelta(seconds=30)) == FailResult(True, False)
    assert store.mark_failed(poison, new.lease, "poison: too large", dead=True) == FailResult(True, True)
    assert [int(row(store, i, "attempts")[0]) for i in (flaky, poison)] == [2, 2]


def test_a_password_in_a_failures_text_is_stored_masked(store: OutboxStore, writer: Any) -> None:
    """A broker's or driver's error may quote a URL or connection string, password and all:
    whoever calls mark_failed, last_error keeps it masked (docs/relay.md, "Secrets in output"),
    and the repeat of that very write is still known for one (it compares the masked text)."""
    [event] = add(writer, store, "s")
    claim = store.claim(10)
    error = "retriable: cannot reach amqp://relay:s3cretpw@rabbit:5672// nor Server=db;UID=sa;PWD=0dbcpass;"
    assert store.mark_failed(event, claim.lease, error, dead=True) == FailResult(True, True)
    stored = str(row(store, event, "last_error")[0])
    assert stored == "retriable: cannot reach amqp://relay:***@rabbit:5672// nor Server=db;UID=sa;PWD=***;"
    assert store.mark_failed(event, claim.lease, error, dead=True) == FailResult(True, True)


# -- housekeeping ---------------------------------------------------------------------------

def test_purge_deletes_old_done_rows_in_chunks_with_a_soft_cap_and_keeps_dead_rows(
        store: OutboxStore, writer: Any) -> None:
    done = add(writer, store, "d", 25)
    dead = add(writer, store, "x")
    pending = add(writer, store, "p")
    claim = store.claim(100)
    assert store.mark_done(done, claim.lease).ok
    store.mark_failed(dead[0], claim.lease, "poison", dead=True)
    store.release(pending, claim.lease)
    assert store.purge_done(timedelta(hours=1)) == 0  # nothing old enough
    time.sleep(0.05)
    # Soft cap: stops after the chunk that reaches 15, so 20 go (2 chunks of 10).
    assert store.purge_done(timedelta(0), batch=10, max_rows=15) == 20
    assert store.purge_done(timedelta(0), batch=10, max_rows=1000) == 5
    assert statuses(store) == {dead[0]: Status.DEAD, pending[0]: Status.PENDING}


def test_stats_dead_list_and_requeue(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 2) + add(writer, store, "b", 1)
    claim = store.claim(100)
    store.mark_done(ids[:1], claim.lease)
    store.mark_failed(ids[1], claim.lease, "boom", dead=True)
    stats = store.stats()
    assert stats.counts == {"pending": 0, "claimed": 1, "done": 1, "failed": 0, "dead": 1}
    assert stats.dead == 1
    assert stats.oldest_pending_age_s is not None and 0 <= stats.oldest_pending_age_s < 600
    dead = store.dead_list()
    assert [(d.id, d.last_error, d.attempts) for d in dead] == [(ids[1], "boom", 1)]
    assert store.requeue_dead([ids[1]]) == 1
    assert store.requeue_dead() == 0
    again = store.claim(10)
    assert [m.id for m in again.messages] == [ids[1]]
    assert again.messages[0].attempt == 1


def test_dead_rows_of_a_topic_are_those_of_that_exact_topic(store: OutboxStore, writer: Any) -> None:
    """``outbox dead list/requeue --topic orders`` takes the dead rows of ``orders`` alone: not
    ``orders `` (MySQL's and MariaDB's PAD SPACE collation compares them equal, as SQL Server
    does) nor ``Orders`` (a case-insensitive collation: SQL Server's default, which its topic
    column gets). Topics are exact strings to every destination (docs/relay.md, "Requeueing
    dead rows")."""
    ids = {topic: add(writer, store, f"t{n}", topic=topic)[0] for n, topic in enumerate(("orders", "orders ", "Orders"))}
    claim = store.claim(10)
    for event in ids.values():
        store.mark_failed(event, claim.lease, "retriable: unroutable", dead=True)
    assert [d.topic for d in store.dead_list(topics=["orders"])] == ["orders"]
    assert store.requeue(topics=["orders"]).requeued == {"orders": 1}
    assert statuses(store) == {ids["orders"]: Status.PENDING, ids["orders "]: Status.DEAD, ids["Orders"]: Status.DEAD}
    assert store.requeue(topics=["orders ", "Orders"], force=True).requeued == {"Orders": 1, "orders ": 1}


def test_the_dead_rows_a_requeue_keeps_are_counted_per_exact_topic(store: OutboxStore, writer: Any) -> None:
    """``outbox dead requeue --all`` (and ``--topic``) without ``--force`` reports the dead rows it
    keeps (a permanent reason) per topic. It counted them ``GROUP BY topic``, in the column's
    collation: ``orders`` and ``orders `` were one line on MySQL/MariaDB (PAD SPACE) and, with
    ``Orders`` too, on SQL Server, under whichever of the values the server picked, while the
    requeued rows beside them are reported per exact topic (found in review, 7 December)."""
    topics = ("orders", "orders ", "Orders")
    ids = [add(writer, store, f"t{n}", topic=topic)[0] for n, topic in enumerate(topics)]
    claim = store.claim(10)
    for event in ids:
        store.mark_failed(event, claim.lease, "poison: larger than the broker takes", dead=True)
    expected = {"Orders": 1, "orders": 1, "orders ": 1}
    assert store.requeue(topics=list(topics)).permanent == expected
    result = store.requeue()
    assert result.permanent == expected and result.requeued == {}


def test_stats_on_an_empty_table(store: OutboxStore) -> None:
    stats = store.stats()
    assert stats.oldest_pending_age_s is None
    assert sum(stats.counts.values()) == 0
