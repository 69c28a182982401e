"""``outbox demo`` is the README's first command: it must run and pass its own checks
on a machine with nothing but the package."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_the_whole_pipeline_and_passes_its_checks(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = subprocess.run([sys.executable, "-m", "outbox.cli", "demo"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for check in ("every committed event arrived", "in order per order id",
                  "the rolled-back event never arrived", "every row is done"):
        assert f"[ok] {check}" in result.stdout
    assert result.stdout.count("broker <- ") == 12
    assert "orders.cancelled" not in result.stdout.split("relay:")[1]
