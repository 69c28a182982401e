"""The ``outbox`` command, run as a user runs it: a subprocess on a SQLite file."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from outbox import enqueue


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_migrate_status_dead_and_purge(tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    assert run("migrate", env=env).returncode == 0
    assert run("migrate", env=env).returncode == 0
    conn = sqlite3.connect(tmp_path / "o.db")
    enqueue(conn, topic="t", aggregate_type="o", aggregate_id="1", payload={"a": 1})
    conn.commit()
    status = run("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["counts"]["pending"] == 1 and data["dead"] == 0 and data["oldest_pending_age_s"] >= 0
    assert "pending: 1" in run("status", env=env).stdout
    assert run("dead", "list", env=env).stdout == ""
    assert "requeued 0" in run("dead", "requeue", "--all", env=env).stdout
    assert "purged 0" in run("purge", env=env).stdout


def test_bad_configuration_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    result = run("status", env={"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                                "OUTBOX_CLAIM_TIMEOUT_MS": "999999999"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: OUTBOX_CLAIM_TIMEOUT_MS=999999999 is above the maximum of 86400000"]


def test_every_command_has_help() -> None:
    for args in [(), ("migrate",), ("status",), ("dead",), ("dead", "list"), ("dead", "requeue"), ("purge",)]:
        result = run(*args, "--help", env={})
        assert result.returncode == 0 and "Usage:" in result.stdout
