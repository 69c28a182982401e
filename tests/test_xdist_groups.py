"""The suite's own distribution: ``make test`` runs ``--dist loadgroup``, and the tests that must
share one worker (one Spark JVM, one build of the package, one fetch of Celery's suites) carry
an ``xdist_group``, which pytest-xdist appends to the node id (``...@spark``) in each worker
(docs/design.md, "The test suite")."""

from __future__ import annotations

import os
import subprocess
import sys

from services import ROOT


def test_loadgroup_puts_the_spark_tests_and_the_grouped_modules_in_their_groups() -> None:
    """Found measuring the suite: no group reached pytest-xdist, so each of three workers started
    a Spark JVM of its own and built the package again. The conftest hook that marks the Spark
    tests ran after xdist's, which had read the groups already; and pytest 9.2 keeps node ids
    where xdist 3.8's suffix no longer changes them. ``--setup-plan`` runs no fixture."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OUTBOX_"))}
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", "--dist", "loadgroup", "-v",
         "--setup-plan", "tests/test_pipeline_replay.py::test_replay_from_a_missing_archive",
         "tests/test_transport_suites.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    ids = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("tests/")]
    replay = [i for i in ids if i.startswith("tests/test_pipeline_replay.py::")]
    suites = [i for i in ids if i.startswith("tests/test_transport_suites.py::")]
    assert replay and suites, listed.stdout[-3000:] + listed.stderr[-3000:]
    assert all(i.endswith("@spark") for i in replay), replay
    assert all(i.endswith("@suites") for i in suites), suites
