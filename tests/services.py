"""Where the test services live, and how a test asks for one.

A test that needs a service it cannot reach is skipped with the reason, unless
``OUTBOX_REQUIRE_SERVICES`` is set (CI sets it), in which case it fails: a CI run
must never turn green by skipping everything.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

# Probing a port is the benchmarks' too: written once there (the repository root is on the
# tests' path, tests/conftest.py).
from bench.services import free_port, reachable  # noqa: F401 - free_port is re-exported for the tests

POSTGRES_URL = os.environ.get("OUTBOX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("OUTBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
MSSQL_URL = os.environ.get("OUTBOX_TEST_MSSQL_URL")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
AMQP_URL = os.environ.get("OUTBOX_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

REQUIRE = bool(os.environ.get("OUTBOX_REQUIRE_SERVICES"))


def unavailable(message: str) -> NoReturn:
    """Skip the test with ``message``; under OUTBOX_REQUIRE_SERVICES (CI) fail it instead."""
    if REQUIRE:
        pytest.fail(message + " and OUTBOX_REQUIRE_SERVICES is set")
    pytest.skip(message)


def stop(proc: subprocess.Popen) -> None:
    """End a server a test started: SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def require(name: str, host: str, port: int) -> None:
    """Skip (or, under OUTBOX_REQUIRE_SERVICES, fail) when ``name`` is not listening."""
    if not reachable(host, port):
        unavailable(f"{name} is not reachable on {host}:{port}")


#: The repository the suite runs from (its docs, examples and sources; what the packaging tests build).
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def building_the_package() -> Iterator[None]:
    """Held while a test builds the package from ``ROOT`` (an sdist, a wheel): setuptools
    writes its ``build/`` and ``*.egg-info`` in the tree, so two builds at once (two
    pytest-xdist workers) break each other. A lock file beside the tree, never in it."""
    tag = hashlib.sha256(bytes(ROOT)).hexdigest()[:12]
    lock = Path(tempfile.gettempdir()) / f"outbox-relay-build-{tag}.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
