"""What every test gets: settings read afresh (no OUTBOX_* from the caller's environment),
and on failure the logs its child processes wrote. Shared fixtures live in the support
modules registered below as pytest plugins, found by name; their helpers are imported
from them (never from a test module)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The repository's root too: tests use what the benchmarks share with them (``bench.tansu``, ``bench.suites``).
sys.path.insert(1, str(Path(__file__).parent.parent))

from outbox.core.config import reset_settings

pytest_plugins = [
    "engine_support",      # kind, url, make_store, store, writer: a store per test on every engine
    "relay_support",       # sqlite_store, conn: the relay's pure-logic tests on one SQLite file
    "relay_e2e_support",   # destination, procs_factory, outbox, runner, ...: real relay processes
    "kafka_support",       # tansu, kafka_bootstrap: a Kafka-protocol broker
    "tsql_support",        # no_sqlglot_fallbacks: T-SQL checked by sqlglot
    "pipeline_support",    # spark: the pipeline's Spark session
    "publisher_support",   # broker: an exchange and a dead-letter one on RabbitMQ
    "app_support",         # database: the example apps' database of a test's own
    "wake_support",        # counting_destination, workers: Celery workers woken only after commit
]


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("OUTBOX_") and not name.startswith("OUTBOX_TEST_") and name != "OUTBOX_REQUIRE_SERVICES":
            monkeypatch.delenv(name)
    reset_settings()
    yield
    reset_settings()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """When a test fails, show the logs its child processes wrote (``*.log`` in its
    tmp_path: workers, beat, web apps), so a failure under load explains itself."""
    outcome = yield
    report = outcome.get_result()
    if report.passed or report.skipped:
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp, Path) or not tmp.is_dir():
        return
    for log in sorted(tmp.rglob("*.log"))[:10]:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        report.sections.append((f"child log {log.relative_to(tmp)} (last 6000 characters)", text[-6000:]))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups (docs/design.md, "The test suite")
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs three workers, ``--dist loadgroup``), every test
    that runs Spark goes to one worker: one Spark session and one JVM for them all, as in a
    serial run, instead of one per worker (docs/design.md, "The test suite")."""
    for item in items:
        if {"spark", "spark_jvm_options"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("spark"))
