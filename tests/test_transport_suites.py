"""Celery's and kombu's OWN integration tests against the ``outboxdb`` transport, on
PostgreSQL, MariaDB and SQLite: a few chosen ones (``bench.suites.QUICK_CELERY`` and
``QUICK_KOMBU``, about 20 s per engine) run here with pytest as a subprocess, from the
sdists of the installed versions (fetched once with pip into ~/.cache/outbox-relay/suites).
Celery's run as Celery runs them against any broker: its test app, its session worker
(prefork), a Redis result backend, no reruns. The full files: ``python -m bench.suites``
(about 20 minutes per engine; docs/transport.md, "What Celery's and kombu's suites show")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import engine_url
from services import REDIS_URL, REQUIRE, require

from bench import suites

#: One pytest-xdist worker for the module: the sdists are fetched into one cache once (``sources``).
pytestmark = pytest.mark.xdist_group("suites")


@pytest.fixture(scope="module")
def sources() -> dict[str, Path]:
    try:
        return suites.sources()
    except Exception as exc:  # no network and nothing cached
        if REQUIRE:
            raise
        pytest.skip(f"Celery's and kombu's sdists are not available: {exc}")


def check(outcome: Any, expected: int) -> None:
    assert outcome.returncode == 0 and not outcome.failed and len(outcome.passed) == expected, (
        f"{outcome.summary()}; failed: {outcome.failed}\n{outcome.output[-4000:]}")


@pytest.mark.parametrize("kind", ["postgresql", "mysql", "sqlite"])
def test_celerys_and_kombus_own_integration_tests_pass_on_the_transport(
        kind: str, sources: dict[str, Path], tmp_path: Path) -> None:
    engine_url(kind, tmp_path)  # skips (or fails under OUTBOX_REQUIRE_SERVICES) without the database
    require("Redis", "127.0.0.1", 6379)
    check(suites.run_kombu(sources["kombu"], kind, suites.QUICK_KOMBU, tmp_path / "kombu", timeout=120),
          len(suites.QUICK_KOMBU))
    check(suites.run_celery(sources["celery"], kind, suites.QUICK_CELERY, REDIS_URL, tmp_path / "celery",
                            timeout=120), len(suites.QUICK_CELERY))
