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


def test_requeue_usage_errors(dead: dict[str, Any]) -> None:
    assert run("dead", "requeue", env=dead["env"]).returncode == 2
    both = run("dead", "requeue", "--all", "1", env=dead["env"])
    assert both.returncode == 2 and "not both" in both.stderr
    helped = run("dead", "requeue", "--help", env={})
    assert "--force" in helped.stdout and "per topic" in helped.stdout
