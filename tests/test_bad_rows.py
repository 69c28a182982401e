"""One bad row must never hurt another (issue 14, items 1, 2, 4, 11; issue 10, item 3).

Rows are tampered with raw SQL, as a careless script or a hostile user would, on every
engine: the claim must bury the bad row alone, at once, with the real reason, and hand
every other row of the batch on, with no attempt charged. The publisher must treat an
event it cannot encode as POISON for that event alone. Requeue must refuse what would
only fail again.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_support import row, statuses, tamper

from outbox import EnqueueError, Status, enqueue
from outbox.core.errors import ConfigError
from outbox.domain.events import MAX_ERROR_UNITS, utf16_units
from outbox.storage.engines import engine_class
from outbox.storage.engines.base import PERMANENT_ERROR_PREFIXES, is_permanent_error
from outbox.storage.engines.rows import UndecodableRow
from outbox.storage.store import OutboxStore

# -- helpers ----------------------------------------------------------------------------------

def add(writer: Any, store: OutboxStore, aggregate: str, count: int = 1, **kw: Any) -> list[int]:
    ids = [enqueue(writer, topic=kw.get("topic", "orders.created"), aggregate_type="order", aggregate_id=aggregate,
                   payload={"n": i}, headers=kw.get("headers"), table=store.engine.table_name)
           for i in range(count)]
    writer.commit()
    return ids


#: (case, column, raw value, the reason recorded, engines whose column type cannot hold it)
TAMPERED = [
    ("headers-invalid-json", "headers", '{"tenant": ', "headers are not valid JSON: ", {"postgresql", "mysql"}),
    ("payload-invalid-json", "payload", "{oops", "payload is not valid JSON: ", {"postgresql", "mysql"}),
    ("headers-not-an-object", "headers", '["a", "b"]', "headers are not a JSON object (a JSON list)", set()),
    ("headers-nested", "headers", '{"h": {"x": 1}}', "header 'h' is not a string, number, boolean or null", set()),
    ("payload-scalar", "payload", "42", "payload is not a JSON object or array (a JSON int)", set()),
    ("aggregate-id-null", "aggregate_id", None, "aggregate_id is NULL", set()),
    ("topic-null", "topic", None, "topic is NULL", set()),
]


# -- item 1: an undecodable row goes dead alone, at once, with the real reason -------------------

@pytest.mark.parametrize("case,column,value,reason,impossible", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_an_undecodable_row_goes_dead_alone_and_the_batch_flows(store: OutboxStore, writer: Any, case: str,
                                                                 column: str, value: str | None, reason: str,
                                                                 impossible: set[str]) -> None:
    if store.engine.name in impossible:
        pytest.skip(f"{store.engine.name}'s JSON column type cannot hold invalid JSON")
    a1, bad, a3 = add(writer, store, "a", 3)
    b1, b2 = add(writer, store, "b", 2)
    tamper(store, bad, column, value)

    claim = store.claim(100)
    # Everything else of the batch flows, the rows behind the bad one in its own aggregate
    # too, each on its first attempt; the bad row went dead at once, alone.
    assert [m.id for m in claim.messages] == [a1, a3, b1, b2]
    assert [m.attempt for m in claim.messages] == [1, 1, 1, 1]
    assert [m.id for m in claim.dead] == [bad]
    error = claim.dead_errors[bad]
    assert error.startswith("undecodable row: " + reason), error
    assert is_permanent_error(error)
    status, attempts, last_error = row(store, bad, "status, attempts, last_error")
    assert (int(status), int(attempts), last_error) == (Status.DEAD, 1, error)
    assert {i: s for i, s in statuses(store).items() if i != bad} == dict.fromkeys((a1, a3, b1, b2), Status.CLAIMED)
    # What could be decoded rides along for the dead-letter copy.
    [dead] = claim.dead
    assert dead.lease == claim.lease and dead.message_id
    assert store.mark_done([a1, a3, b1, b2], claim.lease).ok
    assert store.claim(100).messages == []


@pytest.mark.parametrize("column", ["topic", "aggregate_id"])
def test_sqlite_text_that_is_not_utf8_goes_dead_alone(store: OutboxStore, writer: Any, column: str) -> None:
    """SQLite stores any bytes in a TEXT column; a value that is not UTF-8 failed the
    driver's whole fetch, so every claim failed while the row was among the oldest."""
    if store.engine.name != "sqlite":
        pytest.skip("only SQLite's TEXT holds bytes that are not UTF-8")
    a1, bad, a3 = add(writer, store, "a", 3)
    b1, b2 = add(writer, store, "b", 2)
    with store.transaction() as cursor:
        cursor.execute(f"UPDATE {store.engine.table} SET {column} = CAST(X'6F72646572FF' AS TEXT) WHERE id = ?",
                       (bad,))
    claim = store.claim(100)
    assert [m.id for m in claim.messages] == [a1, a3, b1, b2]
    assert [m.id for m in claim.dead] == [bad]
    assert claim.dead_errors[bad].startswith(f"undecodable row: {column} "), claim.dead_errors[bad]
    assert row(store, bad, "status")[0] == Status.DEAD
    assert store.mark_done([a1, a3, b1, b2], claim.lease).ok
    assert store.claim(100).messages == []


def test_sqlite_attempts_that_are_not_a_number_do_not_fail_the_claim(store: OutboxStore, writer: Any) -> None:
    """SQLite's INTEGER column holds text too; the claim counts it as 0 attempts (its UPDATE
    stores ``attempts + 0``, an integer) instead of failing every claim."""
    if store.engine.name != "sqlite":
        pytest.skip("only SQLite's INTEGER column holds text")
    a1, bad = add(writer, store, "a", 2)
    (b1,) = add(writer, store, "b")
    with store.transaction() as cursor:
        cursor.execute(f"UPDATE {store.engine.table} SET attempts = 'n/a' WHERE id = ?", (bad,))
    claim = store.claim(100)
    assert [(m.id, m.attempt) for m in claim.messages] == [(a1, 1), (bad, 1), (b1, 1)]
    assert claim.dead == []


def test_to_message_names_every_problem_of_a_row(store: OutboxStore) -> None:
    good = (1, "m-1", "t", "order", "a", None, '{"x":1}', '{"h":"v"}', None, 0, "2024-01-01 00:00:00", 1)
    assert store.engine.to_message(good, "lease").headers == {"h": "v"}
    bad = (2, None, "t", "order", "a\x00b", None, "[1,", "{}", None, 0, "2024-01-01 00:00:00", 1)
    with pytest.raises(UndecodableRow) as caught:
        store.engine.to_message(bad, "lease")
    assert str(caught.value) == ("message_id is NULL; aggregate_id contains a NUL character (at index 1); "
                                 "payload is not valid JSON: Expecting value: line 1 column 4 (char 3)")


# -- issue 10 item 3: error text is cut in Python to fit NVARCHAR(4000) in UTF-16 units ----------

def test_a_long_error_is_cut_to_4000_utf16_units_without_splitting_a_pair(store: OutboxStore, writer: Any) -> None:
    ids = add(writer, store, "a", 2)
    claim = store.claim(10)
    # 3,000 emoji are 6,000 UTF-16 code units: a database left to cut would fail or cut a pair.
    assert store.mark_failed(ids[0], claim.lease, "🚀" * 3000, dead=True).dead
    [error] = row(store, ids[0], "last_error")
    assert utf16_units(error) <= MAX_ERROR_UNITS and error.endswith("🚀...")
    assert error == "🚀" * ((MAX_ERROR_UNITS - 3) // 2) + "..."
    # NUL (PostgreSQL's text refuses it) and lone surrogates (no driver encodes them) are replaced.
    assert store.mark_failed(ids[1], claim.lease, "bad\x00byte \udc00", dead=True).dead
    assert row(store, ids[1], "last_error") == ("bad\ufffdbyte \ufffd",)


# -- item 4: identifiers are validated on every path, and quoting escapes --------------------------

CRAFTED = ['outbox" WHERE 1=1; --', "outbox`x", "outbox]x", "a b", "1outbox", "", "x" * 64]


@pytest.mark.parametrize("name", CRAFTED)
def test_enqueue_refuses_a_crafted_table_or_schema(store: OutboxStore, writer: Any, name: str) -> None:
    for argument in ("table", "schema"):
        with pytest.raises(EnqueueError, match=f"enqueue: {argument}=.* is not a valid identifier"):
            enqueue(writer, topic="t", aggregate_type="o", aggregate_id="1", payload={}, **{argument: name})
    good = add(writer, store, "1")  # the caller's transaction is untouched
    assert list(statuses(store)) == good


def test_sqlite_crafted_table_cannot_read_another_table(tmp_path: Any) -> None:
    """The drill's attack: a table argument that smuggles a sub-select into the INSERT."""
    import sqlite3
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    conn.execute("CREATE TABLE secrets (v TEXT)")
    conn.execute("INSERT INTO secrets VALUES ('s3cr3t')")
    crafted = 'outbox" (message_id, topic, aggregate_type, aggregate_id, partition_key, payload, headers, trace_id) ' \
              "SELECT ?, ?, ?, ?, ?, ?, ?, (SELECT v FROM secrets) --"
    with pytest.raises(EnqueueError, match="table="):
        enqueue(conn, topic="t", aggregate_type="o", aggregate_id="1", payload={}, table=crafted)
    assert conn.execute("SELECT COUNT(*) FROM outbox").fetchone() == (0,)


@pytest.mark.parametrize("kind_name", ["sqlite", "postgresql", "mysql", "mssql"])
def test_engines_refuse_bad_identifiers_and_quote_safely(kind_name: str) -> None:
    cls = engine_class(kind_name)
    for name in CRAFTED:
        with pytest.raises(ConfigError, match="table="):
            cls(table=name)
        with pytest.raises(ConfigError, match="schema="):
            cls(table="outbox", schema=name)
    with pytest.raises(ConfigError, match="table="):
        OutboxStore(f"{'sqlite:///x.db' if kind_name == 'sqlite' else kind_name + '://h/db'}", table='a"b')
    engine = cls(table="outbox")
    quoted = engine.quote('we"ird]na`me')
    if kind_name == "sqlite" or kind_name == "postgresql":
        assert quoted == '"we""ird]na`me"'  # a quote inside a quoted name is doubled


# -- item 11: requeue reports per topic and refuses permanent reasons -----------------------------

def dead_rows(store: OutboxStore, writer: Any) -> dict[str, int]:
    """Four dead rows: two on lease/retries (requeueable), two with permanent reasons."""
    ids = {"retried": add(writer, store, "r", topic="orders.retried")[0],
           "retried2": add(writer, store, "r2", topic="orders.retried")[0],
           "lease": add(writer, store, "l", topic="orders.lease")[0],
           "poison": add(writer, store, "p", topic="orders.poison")[0],
           "undecodable": add(writer, store, "u", topic="orders.undecodable")[0]}
    tamper(store, ids["undecodable"], "payload", "7")
    claim = store.claim(100)
    assert [m.id for m in claim.dead] == [ids["undecodable"]]
    store.mark_failed(ids["retried"], claim.lease, "retriable: unroutable", dead=True)
    store.mark_failed(ids["retried2"], claim.lease, "retriable: unroutable", dead=True)
    store.mark_failed(ids["lease"], claim.lease, "lease expired: the worker ...", dead=True)
    store.mark_failed(ids["poison"], claim.lease, "poison: message size 9 bytes is above the maximum", dead=True)
    assert set(statuses(store).values()) == {Status.DEAD}
    return ids


def test_requeue_all_reports_per_topic_and_keeps_permanent_rows(store: OutboxStore, writer: Any) -> None:
    ids = dead_rows(store, writer)
    result = store.requeue()
    assert result.requeued == {"orders.lease": 1, "orders.retried": 2}
    assert result.permanent == {"orders.poison": 1, "orders.undecodable": 1}
    assert result.ok and result.count == 3
    assert statuses(store) == {ids["retried"]: Status.PENDING, ids["retried2"]: Status.PENDING,
                               ids["lease"]: Status.PENDING, ids["poison"]: Status.DEAD,
                               ids["undecodable"]: Status.DEAD}
    forced = store.requeue(force=True)
    assert forced.requeued == {"orders.poison": 1, "orders.undecodable": 1} and forced.permanent == {}
    assert set(statuses(store).values()) == {Status.PENDING}


def test_requeue_and_dead_list_of_topics_leave_every_other_topics_dead_rows(store: OutboxStore,
                                                                            writer: Any) -> None:
    """``outbox dead requeue --topic`` (docs/operations.md's remedy for one unbound topic):
    only ``--all`` existed, which requeued every topic's dead rows with it."""
    ids = dead_rows(store, writer)
    assert [r.id for r in store.dead_list(topics=["orders.retried", "orders.poison"])] == sorted(
        [ids["retried"], ids["retried2"], ids["poison"]])
    assert store.dead_list(topics=["orders.none"]) == []
    result = store.requeue(topics=["orders.retried", "orders.poison"])
    assert result.requeued == {"orders.retried": 2} and result.permanent == {"orders.poison": 1}
    assert statuses(store) == {ids["retried"]: Status.PENDING, ids["retried2"]: Status.PENDING,
                               ids["lease"]: Status.DEAD, ids["poison"]: Status.DEAD,
                               ids["undecodable"]: Status.DEAD}
    forced = store.requeue(topics=["orders.poison"], force=True, chunk=1)
    assert forced.requeued == {"orders.poison": 1} and statuses(store)[ids["undecodable"]] == Status.DEAD
    assert [r.id for r in store.dead_list()] == sorted([ids["lease"], ids["undecodable"]])
    with pytest.raises(ValueError, match="not both"):
        store.requeue([ids["lease"]], topics=["orders.lease"])


def test_requeue_ids_is_all_or_nothing(store: OutboxStore, writer: Any) -> None:
    ids = dead_rows(store, writer)
    pending = add(writer, store, "x")[0]
    result = store.requeue([ids["retried"], ids["poison"], 999_999, pending])
    assert not result.ok and result.requeued == {}
    assert result.missing == [999_999]
    assert result.not_dead == {pending: Status.PENDING}
    assert [(r.id, r.last_error) for r in result.refused] == [
        (ids["poison"], "poison: message size 9 bytes is above the maximum")]
    assert statuses(store)[ids["retried"]] == Status.DEAD  # nothing was requeued
    assert store.requeue([ids["retried"], ids["lease"]]).requeued == {"orders.lease": 1, "orders.retried": 1}
    forced = store.requeue([ids["poison"], ids["undecodable"]], force=True)
    assert forced.ok and forced.requeued == {"orders.poison": 1, "orders.undecodable": 1}
    again = store.claim(100)  # requeued as it is, the undecodable row goes dead again at once
    assert [m.id for m in again.dead] == [ids["undecodable"]]
    assert all(m.attempt == 1 for m in again.messages)


def test_permanent_prefixes_are_what_the_store_and_the_relay_write() -> None:
    from outbox.publisher import FailureKind
    from outbox.relay import POISON
    assert f"{POISON}: x".startswith(PERMANENT_ERROR_PREFIXES)
    assert FailureKind.POISON.value == POISON
    assert not is_permanent_error("retriable: unroutable") and not is_permanent_error(None)
    assert not is_permanent_error("lease expired: the worker holding this row was lost")


def test_if_the_dead_write_fails_the_rows_behind_the_bad_one_wait(store: OutboxStore, writer: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The database refuses the dead write right after the claim: the bad row stays under
    the lease (it is buried when it comes back), the rows behind it in its aggregate are
    released with no attempt spent, never handed on ahead of it; other aggregates flow."""
    a1, bad, a3 = add(writer, store, "a", 3)
    b1 = add(writer, store, "b")[0]
    tamper(store, bad, "payload", "42")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("database went away")

    monkeypatch.setattr(store, "mark_failed", refuse)
    claim = store.claim(100)
    assert [m.id for m in claim.messages] == [a1, b1] and claim.dead == []
    assert statuses(store) == {a1: Status.CLAIMED, bad: Status.CLAIMED, a3: Status.PENDING, b1: Status.CLAIMED}
    assert row(store, a3, "attempts") == (0,)
    assert store.claim(100).messages == []  # a3 waits behind the bad row's lease
