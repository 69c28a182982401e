"""``outbox dead requeue`` as a user runs it (issue 14 item 11): per-topic report,
permanent reasons refused unless --force, unknown or live ids an error."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from cli_support import run
from engine_support import tamper

from outbox import Status, enqueue
from outbox.storage.store import OutboxStore


@pytest.fixture
def dead(tmp_path: Path) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url, max_attempts=3)
    store.migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    ids = {name: enqueue(conn, topic=topic, aggregate_type="o", aggregate_id=name, payload={})
           for name, topic in (("r1", "orders.paid"), ("r2", "orders.paid"), ("r3", "orders.created"),
                               ("poison", "orders.big"), ("bad", "orders.bad"), ("live", "orders.live"))}
    conn.commit()
    tamper(store, ids["bad"], "headers", '{"oops": ')
    claim = store.claim(100)
    assert [m.id for m in claim.dead] == [ids["bad"]]
    for name in ("r1", "r2", "r3"):
        store.mark_failed(ids[name], claim.lease, "retriable: unroutable: no queue bound", dead=True)
    store.mark_failed(ids["poison"], claim.lease, "poison: message size 9000 bytes is above the maximum", dead=True)
    store.release([ids["live"]], claim.lease)
    return {"env": {"OUTBOX_DATABASE_URL": url}, "ids": ids, "store": store}


def errors(result: Any) -> list[str]:
    """stderr without the line every command starts with (which database it uses)."""
    return [line for line in result.stderr.splitlines() if not line.startswith("outbox: database ")]


def status(store: OutboxStore, id: int) -> int:
    with store.transaction() as cursor:
        return int(store.engine.execute(cursor, f"SELECT status FROM {store.engine.table} WHERE id = ?",
                                        [id]).fetchone()[0])


def test_requeue_all_reports_per_topic_and_keeps_permanent_rows(dead: dict[str, Any]) -> None:
    ids, store = dead["ids"], dead["store"]
    result = run("dead", "requeue", "--all", env=dead["env"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "requeued 3 row(s)", "  orders.created: 1", "  orders.paid: 2",
        "kept 2 dead row(s) with a permanent reason (use --force to requeue them too)",
        "  orders.bad: 1", "  orders.big: 1"]
    assert status(store, ids["bad"]) == status(store, ids["poison"]) == Status.DEAD
    forced = run("dead", "requeue", "--all", "--force", env=dead["env"])
    assert forced.returncode == 0 and forced.stdout.splitlines() == [
        "requeued 2 row(s)", "  orders.bad: 1", "  orders.big: 1"]


def test_requeue_ids_refuses_unknown_live_and_permanent_rows(dead: dict[str, Any]) -> None:
    ids, store = dead["ids"], dead["store"]
    missing = run("dead", "requeue", "999", env=dead["env"])
    assert missing.returncode == 1
    assert errors(missing) == ["error: nothing was requeued: no row with id 999"]
    live = run("dead", "requeue", str(ids["live"]), str(ids["r1"]), env=dead["env"])
    assert live.returncode == 1
    assert errors(live) == [
        f"error: nothing was requeued: row {ids['live']} is not dead (status pending)"]
    assert status(store, ids["r1"]) == Status.DEAD  # all or nothing
    refused = run("dead", "requeue", str(ids["bad"]), env=dead["env"])
    assert refused.returncode == 1
    [line] = errors(refused)
    assert line.startswith(f"error: nothing was requeued: row {ids['bad']} (orders.bad) has a permanent reason, "
                           "use --force to requeue it: undecodable row: headers are not valid JSON: ")
    ok = run("dead", "requeue", str(ids["r1"]), str(ids["r3"]), env=dead["env"])
    assert ok.returncode == 0 and ok.stdout.splitlines() == [
        "requeued 2 row(s)", "  orders.created: 1", "  orders.paid: 1"]
    forced = run("dead", "requeue", "--force", str(ids["bad"]), env=dead["env"])
    assert forced.returncode == 0 and forced.stdout.splitlines() == ["requeued 1 row(s)", "  orders.bad: 1"]
    assert status(store, ids["bad"]) == Status.PENDING


def test_requeue_of_a_topic_leaves_the_other_topics_dead(dead: dict[str, Any]) -> None:
    """docs/operations.md: events of one topic went dead for want of a bound queue; once it is
    bound, ``--topic`` requeues that topic's rows alone (``--all`` took every topic's)."""
    ids, store = dead["ids"], dead["store"]
    listed = run("dead", "list", "--topic", "orders.paid", "--topic", "orders.big", env=dead["env"])
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == [
        str(ids["r1"]), str(ids["r2"]), str(ids["poison"])]
    none = run("dead", "list", "--topic", "orders.none", env=dead["env"])
    assert none.returncode == 0 and errors(none) == [] and none.stdout.splitlines() == ["no dead rows of topic orders.none"]
    result = run("dead", "requeue", "--topic", "orders.paid", "--topic", "orders.big", env=dead["env"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "requeued 2 row(s)", "  orders.paid: 2",
        "kept 1 dead row(s) with a permanent reason (use --force to requeue them too)", "  orders.big: 1"]
    assert status(store, ids["r3"]) == status(store, ids["poison"]) == Status.DEAD
    assert status(store, ids["r1"]) == status(store, ids["r2"]) == Status.PENDING
    with_all = run("dead", "requeue", "--all", "--topic", "orders.created", env=dead["env"])
    assert with_all.returncode == 0 and with_all.stdout.splitlines() == ["requeued 1 row(s)", "  orders.created: 1"]
    assert status(store, ids["bad"]) == Status.DEAD
    both = run("dead", "requeue", "--topic", "orders.bad", str(ids["bad"]), env=dead["env"])
    assert both.returncode == 2 and "not both" in both.stderr
    helped = run("dead", "requeue", "--help", env={})
    assert "--topic NAME" in helped.stdout
    assert "--topic NAME" in run("dead", "list", "--help", env={}).stdout


def test_requeue_usage_errors(dead: dict[str, Any]) -> None:
    assert run("dead", "requeue", env=dead["env"]).returncode == 2
    both = run("dead", "requeue", "--all", "1", env=dead["env"])
    assert both.returncode == 2 and "not both" in both.stderr
    helped = run("dead", "requeue", "--help", env={})
    assert "--force" in helped.stdout and "per topic" in helped.stdout


def test_a_requeued_row_arrives_after_its_aggregates_later_rows_and_holds_the_rest_back(tmp_path: Path) -> None:
    """What relay.md ("Requeueing dead rows") and ``dead requeue --help`` warn of (found in
    review): row 1 of aggregate A goes dead, row 2 is delivered, row 3 is in flight; row 1,
    requeued, is claimed while row 3 is still in flight (so it reaches consumers after rows 2
    and 3), and row 4 waits behind it until it is done. Its old ``last_error`` stays on the
    row after delivery: the last failure before it, with ``attempts``."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url, max_attempts=3)
    store.migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    rows = [enqueue(conn, topic="orders.paid", aggregate_type="o", aggregate_id="A", payload={"n": n})
            for n in range(1, 5)]
    conn.commit()
    first = store.claim(1)
    store.mark_failed(rows[0], first.lease, "retriable: unroutable: no queue bound", dead=True)
    second = store.claim(1)
    store.mark_done([rows[1]], second.lease)
    in_flight = store.claim(1)
    assert [m.id for m in in_flight.messages] == [rows[2]]
    requeued = run("dead", "requeue", str(rows[0]), env={"OUTBOX_DATABASE_URL": url})
    assert requeued.returncode == 0, requeued.stderr
    again = store.claim(100)
    assert [m.id for m in again.messages] == [rows[0]]  # beside row 3, after row 2
    store.mark_done([rows[2]], in_flight.lease)
    assert store.claim(100).messages == []  # row 4 waits behind the requeued row 1
    store.mark_done([rows[0]], again.lease)
    assert [m.id for m in store.claim(100).messages] == [rows[3]]
    with store.transaction() as cursor:
        [error] = store.engine.execute(cursor, f"SELECT last_error FROM {store.engine.table} WHERE id = ?",
                                       [rows[0]]).fetchone()
    assert error == "retriable: unroutable: no queue bound"
    help_text = " ".join(run("dead", "requeue", "--help", env={"OUTBOX_DATABASE_URL": url}).stdout.split())
    assert "after the later events of its aggregate" in help_text, help_text
    assert "holds back" in help_text, help_text


def test_event_fields_reach_the_terminal_as_text_not_as_control_sequences(tmp_path: Path) -> None:
    """An event's topic, aggregate id and last error are the application's data (an aggregate id
    may come from a web request): ``dead list`` and ``dead requeue`` printed them raw, so a
    newline forged a row of the listing and ESC sequences (an OSC title, a cleared screen) went
    to the operator's terminal (found in review). Control characters are shown escaped."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url, max_attempts=3)
    store.migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    id = enqueue(conn, topic="orders.\x1b]0;pwned\x07paid", aggregate_type="o",
                 aggregate_id="42\n99\torders.paid\to/1\tattempts=0\tforged", payload={})
    conn.commit()
    claim = store.claim(10)
    store.mark_failed(id, claim.lease, "retriable: bad\x1b[2Jthing\r", dead=True)
    listed = run("dead", "list", env={"OUTBOX_DATABASE_URL": url})
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        f"{id}\torders.\\x1b]0;pwned\\x07paid\to/42\\n99\\torders.paid\\to/1\\tattempts=0\\tforged\t"
        "attempts=1\tretriable: bad\\x1b[2Jthing\\r"]
    requeued = run("dead", "requeue", str(id), env={"OUTBOX_DATABASE_URL": url})
    assert requeued.stdout.splitlines() == ["requeued 1 row(s)", "  orders.\\x1b]0;pwned\\x07paid: 1"]


def test_a_database_password_that_is_a_word_of_last_error_leaves_its_reason_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: with the database password ``poison`` every poison row's ``last_error``
    was written ``***: message size ...``, which is no permanent reason: ``outbox dead requeue``
    requeued it, to fail again. Short words are no longer masked bare, and ``mark_failed`` masks
    a reason after its kind (``poison: ``, ``undecodable row: ``), so even a long password
    equal to it (``undecodable``) leaves the kind whole."""
    import outbox.core.redact as redact_module

    monkeypatch.setattr(redact_module, "_secrets", set())  # this test's registrations only
    for password in ("poison", "undecodable"):
        redact_module.register_url(f"postgresql://app:{password}@db/app")
    store = OutboxStore(f"sqlite:///{tmp_path / 'o.db'}", max_attempts=3)
    store.migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    poison, bad = (enqueue(conn, topic=f"orders.{name}", aggregate_type="o", aggregate_id=name, payload={})
                   for name in ("big", "bad"))
    conn.commit()
    tamper(store, bad, "headers", '{"oops": ')
    claim = store.claim(100)
    store.mark_failed(poison, claim.lease, "poison: message size 9000 bytes is above the maximum (undecodable)",
                      dead=True)
    with store.transaction() as cursor:
        errors = dict(store.engine.execute(cursor, "SELECT id, last_error FROM outbox").fetchall())
    assert errors[poison] == "poison: message size 9000 bytes is above the maximum (***)", errors
    assert errors[bad].startswith("undecodable row: "), errors
    result = store.requeue()
    assert result.requeued == {} and result.permanent == {"orders.bad": 1, "orders.big": 1}, result

