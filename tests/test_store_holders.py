"""Lost workers (docs/internals.md, "Lost workers"), run for real on every engine: lease tokens
name the process that holds them, a holder gone silent has its leases ended at once (the
fence intact), a publish task adopts rows claimed by another process, and the heartbeat's
guard against false deaths. The end-to-end drill: tests/test_takeover_e2e.py."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

import pytest
from engine_support import add, row, statuses

from outbox import Status
from outbox.core.model import Holder
from outbox.relay import still_held
from outbox.relay.holders import Heartbeat, new_holder
from outbox.storage.store import OutboxStore

SILENT_MS = 300  # a holder timeout short enough to wait out in a test


def twin(store: OutboxStore, holder: Holder | None = None) -> OutboxStore:
    """Another process's store on the same table, leasing for ``holder``."""
    other = OutboxStore(store.url, table=store.engine.table_name, schema=store.engine.schema,
                        claim_timeout_ms=store.claim_timeout_ms, max_attempts=store.max_attempts)
    if holder is not None:
        other.holder_id = holder.holder_id
    return other


def holders(store: OutboxStore) -> set[str]:
    with store.transaction() as cursor:
        rows = store.engine.execute(cursor, f"SELECT holder_id FROM {store.engine.holders}").fetchall()
    return {str(r[0]).strip() for r in rows}


def test_lease_tokens_carry_the_holder_id(store: OutboxStore, writer: Any) -> None:
    add(writer, store, "a", 2)
    plain = store.claim(1)
    assert re.fullmatch(r"[0-9a-f]{32}", plain.lease)
    holder = new_holder()
    assert re.fullmatch(r"[0-9a-f]{16}", holder.holder_id)
    store.holder_id = holder.holder_id
    mine = store.claim(5)
    assert [m.id for m in mine.messages] == [] or mine.lease.startswith(holder.holder_id)
    add(writer, store, "b", 1)
    claim = store.claim(5)
    assert claim.lease.startswith(holder.holder_id) and len(claim.lease) == 32
    assert row(store, claim.messages[0].id, "lease_token")[0].strip() == claim.lease


def test_migrate_creates_the_holders_table_and_is_idempotent(store: OutboxStore) -> None:
    store.migrate()
    store.migrate()
    holder = new_holder()
    assert store.beat(holder, SILENT_MS).recreated  # the first beat writes the record
    assert not store.beat(holder, SILENT_MS).recreated
    assert holders(store) == {holder.holder_id}
    store.drop_holder(holder.holder_id)
    assert holders(store) == set()


def test_a_silent_holder_is_taken_over_at_once_and_its_late_writes_are_refused(
        store: OutboxStore, writer: Any) -> None:
    """Lost: a process that claimed rows and stopped beating. Its rows are claimable at once
    (with a lease of a minute), attempts + 1; a live holder's rows stay where they are; the
    lost holder's late mark_done changes nothing."""
    a_ids, b_ids = add(writer, store, "a", 2), add(writer, store, "b", 2)
    lost, live = new_holder(), new_holder()
    lost_store, live_store = twin(store, lost), twin(store, live)
    lost_store.beat(lost, SILENT_MS)
    live_store.beat(live, SILENT_MS)
    lost_claim = lost_store.claim(2)
    assert [m.id for m in lost_claim.messages] == a_ids
    live_claim = live_store.claim(2)
    assert [m.id for m in live_claim.messages] == b_ids
    assert store.claim(10).messages == []  # nothing claimable: both leases run for a minute

    time.sleep(SILENT_MS / 1000 + 0.3)
    beat = live_store.beat(live, SILENT_MS)
    assert [s.holder for s in beat.silent] == [lost]
    assert beat.silent[0].silent_s >= SILENT_MS / 1000
    taken = live_store.take_over(beat.silent[0], SILENT_MS)
    assert taken is not None and taken.rows == 2 and taken.held_s >= SILENT_MS / 1000
    assert live_store.take_over(beat.silent[0], SILENT_MS) is None  # one process takes it over
    assert holders(store) == {live.holder_id}

    # Expired rows come back one at a time per aggregate (the head first), an attempt counted.
    again = store.claim(10)
    assert [m.id for m in again.messages] == a_ids[:1]
    assert again.messages[0].attempts == 1
    assert row(store, a_ids[0], "attempts, status, last_error")[:2] == (1, Status.CLAIMED)
    # The fence: the lost holder's late acknowledgement of a re-claimed row is refused.
    assert lost_store.mark_done(a_ids[:1], lost_claim.lease).applied == 0
    assert statuses(store)[a_ids[0]] == Status.CLAIMED
    # The live holder's rows were never touched.
    assert row(store, b_ids[0], "lease_token")[0].strip() == live_claim.lease
    assert live_store.mark_done(b_ids, live_claim.lease).applied == 2
    for s in (lost_store, live_store):
        s.close()


def test_a_process_exiting_with_rows_still_leased_keeps_its_record_for_the_takeover(
        store: OutboxStore, writer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: a graceful exit deleted the holder's record even when a task of it
    still held rows (a publish the shutdown stopped waiting for), and the takeover, which
    looks at records only, never freed them: they waited for the whole lease. Now the
    record stays while rows are leased to it, and the others take them over; a process
    exiting with nothing leased deletes its record as before."""
    a_ids = add(writer, store, "a", 2)
    leaving, idle, live = new_holder(), new_holder(), new_holder()
    leaving_store, idle_store, live_store = twin(store, leaving), twin(store, idle), twin(store, live)
    for holder, own in ((leaving, leaving_store), (idle, idle_store), (live, live_store)):
        beat = Heartbeat(own, holder, SILENT_MS / 1000)
        beat.tick()
        if holder is leaving:
            claim = leaving_store.claim(10)
            assert [m.id for m in claim.messages] == a_ids
        if holder is not live:
            with caplog.at_level(logging.INFO, logger="outbox"):
                beat.stop()  # the graceful exit's, with no heartbeat thread: in this thread
    assert holders(store) == {leaving.holder_id, live.holder_id}  # the idle one's record went
    assert any("exits with 2 rows still leased to it" in r.getMessage() for r in caplog.records)

    time.sleep(SILENT_MS / 1000 + 0.3)
    [silent] = live_store.beat(live, SILENT_MS).silent
    assert silent.holder == leaving
    taken = live_store.take_over(silent, SILENT_MS)
    assert taken is not None and taken.rows == 2
    assert [m.id for m in store.claim(10).messages] == a_ids[:1]  # at once, not after the lease
    for own in (leaving_store, idle_store, live_store):
        own.close()


def test_a_holder_that_beats_again_is_not_taken_over(store: OutboxStore, writer: Any) -> None:
    add(writer, store, "a", 1)
    slow, other = new_holder(), new_holder()
    slow_store, other_store = twin(store, slow), twin(store, other)
    slow_store.beat(slow, SILENT_MS)
    claim = slow_store.claim(1)
    time.sleep(SILENT_MS / 1000 + 0.3)
    [silent] = other_store.beat(other, SILENT_MS).silent
    slow_store.beat(slow, SILENT_MS)  # alive after all, just before the takeover
    assert other_store.take_over(silent, SILENT_MS) is None
    assert slow_store.mark_done([m.id for m in claim.messages], claim.lease).applied == 1
    for s in (slow_store, other_store):
        s.close()


def test_a_publish_task_in_another_process_adopts_the_rows_it_publishes(store: OutboxStore, writer: Any) -> None:
    """The claimer's lease moves to the publishing process in one fenced statement: the
    claimer's late writes are refused, the adopter's apply, and a chain no longer held in full
    is skipped, the rows of it that were adopted given back (pending, no attempt)."""
    a_ids, b_ids = add(writer, store, "a", 2), add(writer, store, "b", 3)
    claimer, publisher = new_holder(), new_holder()
    claimer_store, publisher_store = twin(store, claimer), twin(store, publisher)
    claim = claimer_store.claim(10)
    chains = {m.aggregate_id: [] for m in claim.messages}
    for m in claim.messages:
        chains[m.aggregate_id].append(m)
    # b's head was settled meanwhile (e.g. a first run of this task): b is not held in full.
    claimer_store.mark_done(b_ids[:1], claim.lease)

    kept, renewed = still_held(publisher_store, [chains["a"], chains["b"]], check_own=False)
    assert [[m.id for m in chain] for chain in kept] == [a_ids] and renewed
    lease = kept[0][0].lease
    assert lease.startswith(publisher.holder_id) and lease != claim.lease and len(lease) == 32
    assert row(store, a_ids[0], "lease_token")[0].strip() == lease
    assert claimer_store.mark_done(a_ids, claim.lease).applied == 0  # fenced off
    assert publisher_store.mark_done(a_ids, lease).applied == 2
    # b's adopted tail went back to pending without spending an attempt.
    assert [statuses(store)[i] for i in b_ids] == [Status.DONE, Status.PENDING, Status.PENDING]
    assert row(store, b_ids[1], "attempts")[0] == 0
    # Adoption refuses rows the old lease no longer holds.
    assert publisher_store.adopt(b_ids, claim.lease, publisher_store.new_lease()) == set()
    # Past its deadline a task leaves its own process's rows to their lease...
    c_ids = add(writer, store, "c", 1)
    late = claimer_store.claim(10)
    c_chain = [m for m in late.messages if m.aggregate_id == "c"]
    assert [m.id for m in c_chain] == c_ids
    assert still_held(claimer_store, [c_chain], deadline=1.0, now=lambda: 2.0) == ([c_chain], False)
    assert row(store, c_ids[0], "lease_token")[0].strip() == late.lease
    # ...but adopts another process's, as ever: the adoption is fenced by the old lease and
    # starts it again, and the deadline was set on the claimer's clock, which may run ahead
    # of this host's (a publishing host 2 s behind skipped every task: each row spent its
    # attempts unpublished and went dead).
    [adopted], renewed = still_held(publisher_store, [c_chain], deadline=1.0, now=lambda: 2.0)
    assert renewed and [m.id for m in adopted] == c_ids and adopted[0].lease.startswith(publisher.holder_id)
    assert row(store, c_ids[0], "lease_token")[0].strip() == adopted[0].lease
    for s in (claimer_store, publisher_store):
        s.close()


def test_a_suspect_renews_its_own_processs_lease_even_past_the_deadline(store: OutboxStore, writer: Any) -> None:
    """``renew`` (a Dramatiq publish of a row tried twice, docs/relay.md, "An event that kills
    its worker"): the claiming process's own rows are adopted under a new lease of its own,
    past the claim's deadline too, and the old lease is fenced off."""
    ids = add(writer, store, "a", 1)
    holder = new_holder()
    own = twin(store, holder)
    claim = own.claim(10)
    [renewed_chain], renewed = still_held(own, [claim.messages], deadline=1.0, now=lambda: 2.0, renew=True)
    lease = renewed_chain[0].lease
    assert renewed and lease.startswith(holder.holder_id) and lease != claim.lease
    assert row(store, ids[0], "lease_token")[0].strip() == lease
    assert own.mark_done(ids, claim.lease).applied == 0  # fenced off
    assert own.mark_done(ids, lease).applied == 1
    own.close()


def test_the_heartbeat_takes_over_only_after_beating_steadily_for_longer_than_the_timeout(
        store: OutboxStore, writer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The guard against false deaths: after its own beats failed or stalled (a database
    outage that silenced everybody), a process takes nobody over until it has beaten, each
    beat within the timeout of the last, for longer than the timeout."""
    add(writer, store, "a", 3)
    lost = new_holder()
    lost_store = twin(store, lost)
    lost_store.beat(lost, SILENT_MS)
    claim = lost_store.claim(10)
    time.sleep(SILENT_MS / 1000 + 0.3)

    requested: list[bool] = []
    me = new_holder()
    beat = Heartbeat(twin(store, me), me, SILENT_MS / 1000, on_takeover=lambda: requested.append(True))
    assert beat.tick(now=100.0) == 0  # the first beat: not steady for long enough yet
    assert beat.tick(now=100.2) == 0
    assert beat.tick(now=100.9) == 0  # 0.7 s since the last: a gap, counting starts again
    assert beat.tick(now=101.0) == 0
    assert beat.tick(now=101.15) == 0  # steady for 0.25 s only
    assert holders(store) == {lost.holder_id, me.holder_id} and not requested
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        assert beat.tick(now=101.3) == 3  # steady for 0.4 s > 0.3 s (the beats' own time counts too)
    assert requested == [True]
    [line] = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert (f"took over 3 rows of a lost worker process (holder {lost.holder_id}, host {lost.host}, "
            f"pid {lost.pid}): silent for") in line and "rows held for" in line
    assert [m.id for m in store.claim(10).messages] == [claim.messages[0].id]
    beat.stop()
    assert holders(store) == set()  # a graceful exit deletes the record
    lost_store.close()


def test_a_beat_held_up_past_the_timeout_takes_nobody_over_when_it_lands(store: OutboxStore, writer: Any) -> None:
    """A stall of the database holds every process's beat up; the first beat back saw the
    others silent. Measured from the start of the beat, the guard saw a steady process and
    that beat took over every live one still a moment behind: their rows charged an
    attempt and delivered twice (found in review). The beat's own time counts now."""
    add(writer, store, "a", 3)
    other = new_holder()
    other_store = twin(store, other)
    other_store.beat(other, SILENT_MS)
    other_store.claim(10)  # a live process publishing its rows
    me = new_holder()
    mine = twin(store, me)
    beat = Heartbeat(mine, me, SILENT_MS / 1000)
    for now in (100.0, 100.1, 100.2, 100.35):  # steady for longer than the timeout
        other_store.beat(other, SILENT_MS)
        assert beat.tick(now=now) == 0
    real_beat = mine.beat

    def stalled(holder: Holder, timeout_ms: int) -> Any:
        time.sleep(SILENT_MS / 1000 + 0.2)  # the stall: the other process's beat is held up as long
        return real_beat(holder, timeout_ms)
    mine.beat = stalled  # type: ignore[method-assign]
    try:
        assert beat.tick(now=100.45) == 0  # landed 0.6 s after the last: a gap, not a steady beat
    finally:
        mine.beat = real_beat  # type: ignore[method-assign]
    assert other.holder_id in holders(store)
    assert other_store.beat(other, SILENT_MS).recreated is False  # not presumed lost
    beat.stop()
    other_store.close()


def test_a_stall_shorter_than_the_timeout_that_held_every_beat_up_takes_nobody_over(
        store: OutboxStore, writer: Any) -> None:
    """A stall of the database (or of a host two processes share) shorter than the holder
    timeout T but longer than two thirds of it holds every beat up. The other process beat a
    third of T before this one, so when the stall ends its record is older than T, while this
    process's own beats landed less than T apart: the guard saw nothing wrong, and this
    process's first beat back took the live one over before its held-up beat landed (two
    relays on one chain, an attempt charged, events sent twice; found in review). This
    process's own beat was held up as long, so it allows as much more silence; a process
    that really stops is still taken over."""
    timeout_s = 1.2  # T: its thirds leave room for the database's round trips
    add(writer, store, "a", 3)
    other = new_holder()
    other_store = twin(store, other)
    other_store.beat(other, int(timeout_s * 1000))
    other_store.claim(10)  # a live process publishing its rows
    me = new_holder()
    mine = twin(store, me)
    beat = Heartbeat(mine, me, timeout_s)
    steady_until = time.monotonic() + timeout_s + 0.2
    while True:  # both beat every third of T, for longer than T; the other a third before this one
        other_store.beat(other, int(timeout_s * 1000))
        time.sleep(timeout_s / 3)
        assert beat.tick() == 0
        if time.monotonic() > steady_until:
            break
        time.sleep(timeout_s / 3 - 0.02)
    real_beat = mine.beat

    def held_up(holder: Holder, timeout_ms: int) -> Any:
        time.sleep(0.5)  # the rest of the stall, which began at this process's last beat
        return real_beat(holder, timeout_ms)
    time.sleep(timeout_s / 3)  # the stall (1 s < T) begins as this process waits for its next beat
    mine.beat = held_up  # type: ignore[method-assign]
    try:
        assert beat.tick() == 0  # landed ~0.9 s after its last (< T: no gap); the other's record is ~1.3 s old
    finally:
        mine.beat = real_beat  # type: ignore[method-assign]
    assert other.holder_id in holders(store)
    assert other_store.beat(other, int(timeout_s * 1000)).recreated is False  # not presumed lost

    deadline = time.monotonic() + 4 * timeout_s  # now the other process stops for good: it is taken over
    while other.holder_id in holders(store):
        assert time.monotonic() < deadline, "a holder silent for good was never taken over"
        time.sleep(timeout_s / 3)
        beat.tick()
    beat.stop()
    other_store.close()


def test_a_round_of_the_heartbeat_that_raises_does_not_end_its_thread(
        store: OutboxStore, caplog: pytest.LogCaptureFixture) -> None:
    """One exception out of a round (here the schema read after a missing holders table,
    on a connection failing right then) ended the heartbeat's thread for the rest of the
    process's life: it never beat again, even once the table was made (found in review)."""
    me = new_holder()
    mine = twin(store, me)
    rounds: list[float] = []
    real_tick = Heartbeat.tick

    class Flaky(Heartbeat):
        def tick(self, now: float | None = None) -> int:
            rounds.append(time.monotonic())
            if len(rounds) == 1:
                raise ConnectionError("cut right then")
            return real_tick(self, now)

    beat = Flaky(mine, me, SILENT_MS / 1000)
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        beat.start()
        try:
            deadline = time.monotonic() + 5
            while len(rounds) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            beat.stop()
    assert len(rounds) >= 3 and beat.beats >= 1, rounds
    assert any("beats again" in r.getMessage() for r in caplog.records)


def test_without_a_holders_table_the_relay_runs_on_the_lease_and_says_so_once(
        store: OutboxStore, writer: Any, caplog: pytest.LogCaptureFixture) -> None:
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"DROP TABLE {store.engine.holders}")
    me = new_holder()
    beat = Heartbeat(twin(store, me), me, SILENT_MS / 1000)
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        for now in (1.0, 1.1, 1.2):
            assert beat.tick(now=now) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "outbox migrate" in warnings[0] and store.engine.holders_name in warnings[0]
    add(writer, store, "a", 1)
    store.holder_id = me.holder_id
    claim = store.claim(10)
    assert len(claim.messages) == 1 and store.mark_done([claim.messages[0].id], claim.lease).applied == 1
    beat.stop()
    store.migrate()  # creates it: the heartbeat goes on from there
    assert store.beat(me, SILENT_MS).recreated


def test_a_heartbeat_refused_by_a_permission_says_so_once_at_warning(
        store: OutboxStore, caplog: pytest.LogCaptureFixture) -> None:
    """A relay login granted what docs/sqlserver.md's "Permissions" listed (DML on the outbox
    table and nothing else) could not write the holders table: every beat failed, logged at
    DEBUG only, so no lost worker was ever taken over (its rows waited for the whole lease)
    and nothing said why (found in the SQL Server review). Run on PostgreSQL: the heartbeat's
    handling is the same on every engine."""
    if store.engine.name != "postgresql":
        pytest.skip("a login with DML on the outbox table alone: made here on PostgreSQL")
    role = f"rev_mssql_relay_{uuid.uuid4().hex[:8]}"
    with store.transaction() as cursor:
        store.engine.execute(cursor, f"CREATE ROLE {role} LOGIN")
        store.engine.execute(cursor, f"GRANT SELECT, INSERT, UPDATE, DELETE ON {store.engine.table} TO {role}")
    limited = OutboxStore(re.sub(r"://[^@/]*@", f"://{role}@", store.url, count=1),
                          table=store.engine.table_name, schema=store.engine.schema)
    me = new_holder()
    beat = Heartbeat(limited, me, SILENT_MS / 1000)
    try:
        with caplog.at_level(logging.WARNING, logger="outbox.relay"):
            for now in (1.0, 1.1, 1.2):
                assert beat.tick(now=now) == 0
    finally:
        beat.stop(drop=False)
        limited.close()
        with store.transaction() as cursor:
            store.engine.execute(cursor, f"REVOKE ALL ON {store.engine.table} FROM {role}")
            store.engine.execute(cursor, f"DROP ROLE {role}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert store.engine.holders in warnings[0] and "lease" in warnings[0] and "permission" in warnings[0], warnings


def test_without_the_outbox_table_the_heartbeat_says_to_migrate_it_not_only_its_holders(
        store: OutboxStore, caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose OUTBOX_TABLE names no table (not migrated, or misspelt) logged first, once
    per process, that the *holders* table was missing and lost workers would be noticed late:
    true, but not what was wrong. It now names the outbox table and `outbox migrate`."""
    unmigrated = OutboxStore(store.url, table=f"never_migrated_{uuid.uuid4().hex[:8]}", schema=store.engine.schema)
    me = new_holder()
    beat = Heartbeat(unmigrated, me, SILENT_MS / 1000)
    try:
        with caplog.at_level(logging.WARNING, logger="outbox.relay"):
            for now in (1.0, 1.1):
                assert beat.tick(now=now) == 0
    finally:
        beat.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"table {unmigrated.engine.table} missing: run `outbox migrate`" in warnings[0], warnings
    assert "nothing is relayed until then" in warnings[0] and "lost worker processes" not in warnings[0], warnings


def test_rows_adopted_by_a_live_process_stay_with_it_when_their_claimer_is_lost(
        store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 2)
    claimer, publisher = new_holder(), new_holder()
    claimer_store, publisher_store = twin(store, claimer), twin(store, publisher)
    claimer_store.beat(claimer, SILENT_MS)
    claim = claimer_store.claim(10)
    [chain] = still_held(publisher_store, [claim.messages], check_own=False).chains
    time.sleep(SILENT_MS / 1000 + 0.3)
    [silent] = publisher_store.beat(publisher, SILENT_MS).silent
    assert silent.holder == claimer
    taken = publisher_store.take_over(silent, SILENT_MS)
    assert taken is not None and taken.rows == 0  # nothing of the claimer's is left to take
    assert store.claim(10).messages == []
    assert publisher_store.mark_done(ids, chain[0].lease).applied == 2
    for s in (claimer_store, publisher_store):
        s.close()
