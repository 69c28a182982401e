"""``outbox demo`` is the README's first command: it must run and pass its own checks
on a machine with nothing but the package, and leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def demo(tmp_path: Path, *args: str, **outbox_env: str) -> subprocess.CompletedProcess:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run([sys.executable, "-m", "outbox.cli", "demo", *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, **outbox_env, "TMPDIR": str(scratch)}, timeout=120)


def test_demo_runs_the_whole_pipeline_and_passes_its_checks(tmp_path: Path) -> None:
    result = demo(tmp_path)
    log = f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, log
    for check in ("every committed event arrived", "in order per order id",
                  "the rolled-back event never arrived", "every row is done"):
        assert f"[ok] {check}" in result.stdout, log
    assert result.stdout.count("broker <- ") == 12, log
    assert "orders.cancelled" not in result.stdout.split("relay:")[1], log
    # Nothing left behind: no temporary folder, no outbox.db in the current directory.
    assert list((tmp_path / "tmp").iterdir()) == [], log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"], log


def test_demo_keep_leaves_its_outbox_for_inspection(tmp_path: Path) -> None:
    result = demo(tmp_path, "--keep", "--timeout", "60")
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    kept = list((tmp_path / "tmp").glob("outbox-demo-*/outbox.db"))
    assert len(kept) == 1 and f"sqlite:///{kept[0]}" in result.stdout


def test_demo_runs_on_the_embedded_default_whatever_the_shell_has_set(tmp_path: Path) -> None:
    """Found in review: a deployment's OUTBOX_SCHEMA left in the shell made the demo's SQLite
    look for a database "app"; the demo drops every OUTBOX_* setting for its own."""
    result = demo(tmp_path, OUTBOX_SCHEMA="app", OUTBOX_TABLE="events_out", OUTBOX_EXCHANGE="elsewhere")
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert "[ok] every row is done" in result.stdout


def test_demo_ignores_the_shells_django_settings(tmp_path: Path) -> None:
    """Found in review: the demo dropped the shell's OUTBOX_* variables but kept its
    DJANGO_SETTINGS_MODULE, whose OUTBOX_* settings (read after the environment) took the
    demo's SQLite to a schema "app" and its events to another exchange."""
    (tmp_path / "shellsettings.py").write_text("SECRET_KEY = 'x'\nOUTBOX_SCHEMA = 'app'\n"
                                               "OUTBOX_EXCHANGE = 'elsewhere'\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = demo(tmp_path, DJANGO_SETTINGS_MODULE="shellsettings", PYTHONPATH=pythonpath)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert "[ok] every row is done" in result.stdout
