"""The ``outbox`` command run as a user runs it, in a child process (tests/test_cli.py,
test_cli_requeue.py)."""

from __future__ import annotations

import os
import subprocess
import sys


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)
