"""``python -m bench.suites``: Celery's and kombu's own integration suites against the
``outboxdb`` transport (docs/transport.md, "What Celery's and kombu's suites show").

Both suites ship in their sdists (``t/integration``), not in the wheels: the run fetches
the sdists of the installed versions once (``pip download --no-binary :all: --no-deps``)
into ``--cache`` (default ``~/.cache/outbox-relay/suites``) and runs, per engine:

- **Celery** ``t/integration/test_tasks.py``, ``test_inspect.py``, ``test_canvas.py``
  exactly as Celery runs them against other brokers: its test app, its session worker
  (prefork pool), a Redis result backend, its transport defaults; no reruns (the
  ``flaky`` marker of pytest-rerunfailures stays inert: that plugin is not installed);
- **kombu** its transport-agnostic base classes (``t/integration/common.py``) bound to
  this transport by ``bench/suites_kombu.py``, as kombu binds them to its own.

The full run takes about 20 minutes per engine, most of it the canvas file; ``--quick`` runs the
few tests ``tests/test_transport_suites.py`` runs in the project's suite. Each engine's
run has queue tables of its own, dropped afterwards. Nothing here asserts: it prints
passed/failed/skipped per suite and engine, and the failing tests (``--json`` writes them).

Celery's test tasks use Redis database 0 on localhost for a few helpers (its
``t/integration/tasks.py`` hard-codes it); the result backend is ``--redis-url``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_CACHE = Path.home() / ".cache" / "outbox-relay" / "suites"

ENGINES = ("postgresql", "mysql", "sqlite")
#: The baseline: Celery's suite with Redis as its broker, run the same way in the same environment.
BASELINE = "redis"
DATABASE_URLS = {
    "postgresql": os.environ.get("OUTBOX_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("OUTBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}
#: A database that refuses connections, for kombu's failed-connect tests.
INVALID_URLS = {
    "postgresql": "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2",
    "mysql": "mysql://root@127.0.0.1:1/test",
    "sqlite": "sqlite:////nonexistent-directory/outbox.db",
}

CELERY_FILES = ("t/integration/test_tasks.py", "t/integration/test_inspect.py", "t/integration/test_canvas.py")

#: ``--quick``: a few tests of each suite that cover what the transport claims, each
#: a few seconds on every engine (the project's suite runs these).
QUICK_CELERY = (
    "t/integration/test_inspect.py::test_Inspect::test_ping",
    "t/integration/test_inspect.py::test_Inspect::test_active_queues",
    "t/integration/test_tasks.py::test_tasks::test_basic_task",
    "t/integration/test_tasks.py::test_tasks::test_task_retried_once_with_expires",
    "t/integration/test_canvas.py::test_chain::test_simple_chain",
    "t/integration/test_canvas.py::test_chord::test_chord_order",
)
QUICK_KOMBU = (
    "test_OutboxdbBasicFunctionality::test_publish_consume",
    "test_OutboxdbBasicFunctionality::test_failed_connect",
    "test_OutboxdbBaseExchangeTypes::test_fanout",
    "test_OutboxdbBaseExchangeTypes::test_topic",
    "test_OutboxdbBaseTimeToLive::test_publish_consume",
    "test_OutboxdbBaseMessage::test_reject_requeue",
)


@dataclass
class Outcome:
    """One pytest run, read from its JUnit XML."""
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    returncode: int = 0
    seconds: float = 0.0
    output: str = ""

    def summary(self) -> str:
        return f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.skipped)} skipped"


# -- sources ------------------------------------------------------------------------------------------

def sources(cache: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """{"celery": dir, "kombu": dir}: the installed versions' sdists, fetched once."""
    import celery
    import kombu
    cache.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, version in (("celery", celery.__version__), ("kombu", kombu.__version__)):
        top = cache / f"{name}-{version}"
        if not (top / "t" / "integration").is_dir():
            _download(name, version, cache)
        found[name] = top
    return found


def _download(name: str, version: str, cache: Path) -> None:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                               "--disable-pip-version-check", "-q", "-d", tmp, f"{name}=={version}"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {name}=={version} failed: {done.stderr.strip()[-500:]}")
        [archive] = Path(tmp).glob(f"{name}-{version}.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target = cache / f"{name}-{version}"
        if not target.exists():
            os.replace(Path(tmp) / f"{name}-{version}", target)


# -- runs -----------------------------------------------------------------------------------------

def database_url(engine: str, workdir: Path) -> str:
    if engine == "sqlite":
        return f"sqlite:///{workdir / 'broker.db'}"
    return DATABASE_URLS[engine]


def _pytest(args: list[str], cwd: Path, env: dict[str, str], junit: Path, timeout: float) -> Outcome:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_classes=test_*",
               "-o", "timeout=300", f"--junitxml={junit}", *args]
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -1
        output = f"timed out after {timeout:.0f} s\n" + (exc.stdout or b"").decode(errors="replace")[-5000:]
    outcome = _read_junit(junit) if junit.exists() else Outcome()
    outcome.returncode, outcome.output, outcome.seconds = returncode, output, time.monotonic() - started
    return outcome


def _read_junit(path: Path) -> Outcome:
    outcome = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            outcome.failed.append(name)
        elif "skipped" in tags:
            outcome.skipped.append(name)
        else:
            outcome.passed.append(name)
    return outcome


def _base_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_celery(src: Path, engine: str, tests: Iterable[str], redis_url: str, workdir: Path,
               timeout: float = 3600, putlocks: bool = True) -> Outcome:
    """Celery's integration tests ``tests`` (node ids relative to its sdist) with the
    broker ``outboxdb+<engine>`` and a Redis result backend; ``putlocks=False`` sets
    ``worker_pool_putlocks = False`` (docs/transport.md, "Put locks")."""
    table = f"cs_{uuid.uuid4().hex[:10]}"
    workdir.mkdir(parents=True, exist_ok=True)
    # Celery's conftest reads overrides from <rootdir>/integration-tests-config.json. The result
    # backend's keys go under a prefix of this run's own, deleted afterwards (docs/transport.md,
    # "What Celery's and kombu's suites show").
    results = f"outbox-suites-{uuid.uuid4().hex[:10]}:"
    config: dict[str, Any] = {"result_backend_transport_options": {"global_keyprefix": results}}
    if engine == BASELINE:  # Redis as the broker: the next database of the result backend's server
        base, _, db = redis_url.rpartition("/")
        broker = f"{base}/{(int(db or 0) + 1) % 16}"
    else:
        url = database_url(engine, workdir)
        broker = f"outboxdb+{url}"
        config["broker_transport_options"] = {"queue_table": table}
    if not putlocks:
        config["worker_pool_putlocks"] = False
    (workdir / "integration-tests-config.json").write_text(json.dumps(config))
    env = _base_env({"TEST_BROKER": broker, "TEST_BACKEND": redis_url})
    try:
        return _pytest(["-p", "outbox.transport", "-p", "celery.contrib.pytest", f"--rootdir={workdir}", *tests],
                       src, env,
                       workdir / f"celery-{engine}.xml", timeout)
    finally:
        delete_keys(redis_url, results)
        if engine != BASELINE:
            drop_tables(url, table)


def delete_keys(redis_url: str, prefix: str) -> None:
    """Delete the keys under ``prefix`` in ``redis_url``'s database."""
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        try:
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - a Redis that never came up: nothing to delete
        print(f"could not delete the result keys {prefix}* ({exc})", file=sys.stderr)


def run_kombu(src: Path, engine: str, tests: Iterable[str], workdir: Path, timeout: float = 1800) -> Outcome:
    """kombu's base classes (``bench/suites_kombu.py``), ``tests`` as ``Class::test`` ids."""
    table = f"ks_{uuid.uuid4().hex[:10]}"
    workdir.mkdir(parents=True, exist_ok=True)
    url = database_url(engine, workdir)
    module = workdir / "test_outboxdb_kombu.py"
    shutil.copyfile(HERE / "suites_kombu.py", module)
    env = _base_env({"OUTBOXDB_SUITE_URL": url, "OUTBOXDB_SUITE_TABLE": table,
                     "OUTBOXDB_SUITE_INVALID_URL": INVALID_URLS[engine]})
    env["PYTHONPATH"] = os.pathsep.join([str(src), env["PYTHONPATH"]])
    selected = [f"{module}::{t}" for t in tests] or [str(module)]
    try:
        return _pytest([f"--rootdir={workdir}", *selected], workdir, env, workdir / f"kombu-{engine}.xml", timeout)
    finally:
        drop_tables(url, table)


def drop_tables(url: str, table: str) -> None:
    from outbox.transport import drop_queue_tables
    try:
        drop_queue_tables(url, table)
    except Exception as exc:  # noqa: BLE001 - a database that never came up: nothing to drop
        print(f"could not drop the queue tables {table} ({exc})", file=sys.stderr)


# -- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suites", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", nargs="+", choices=(*ENGINES, BASELINE), default=list(ENGINES),
                        help=f"{BASELINE!r}: Celery's suite with Redis as its broker, the baseline")
    parser.add_argument("--suite", nargs="+", choices=("celery", "kombu"), default=["celery", "kombu"])
    parser.add_argument("--quick", action="store_true", help="only the tests the project's suite runs")
    parser.add_argument("--celery-tests", nargs="+", default=None,
                        help=f"Celery node ids (default: the files {', '.join(CELERY_FILES)})")
    parser.add_argument("--no-putlocks", action="store_true", help="Celery's worker with worker_pool_putlocks = False")
    parser.add_argument("--redis-url", default=os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14"),
                        help="Celery's result backend")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, help="write every outcome (with failing test ids) here")
    args = parser.parse_args(argv)

    src = sources(args.cache)
    # One run per Celery file (its own session worker), so each file gets its own line.
    celery_runs = [[t] for t in args.celery_tests] if args.celery_tests else (
        [list(QUICK_CELERY)] if args.quick else [[f] for f in CELERY_FILES])
    kombu_tests = list(QUICK_KOMBU) if args.quick else []
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="outbox-suites-") as tmp:
        for engine in args.engine:
            runs = [("celery", tests) for tests in celery_runs] if "celery" in args.suite else []
            runs += [("kombu", kombu_tests)] if "kombu" in args.suite and engine != BASELINE else []
            for n, (suite, tests) in enumerate(runs):
                workdir = Path(tmp) / f"{suite}-{engine}-{n}"
                if suite == "celery":
                    outcome = run_celery(src["celery"], engine, tests, args.redis_url, workdir,
                                         putlocks=not args.no_putlocks)
                    label = f"celery {Path(tests[0].split('::')[0]).name if len(tests) == 1 else '(quick)'}"
                else:
                    outcome = run_kombu(src["kombu"], engine, tests, workdir)
                    label = "kombu base classes"
                print(f"{label} on {engine}: {outcome.summary()} in {outcome.seconds:.0f} s", flush=True)
                for name in outcome.failed:
                    print(f"    failed: {name}")
                if outcome.returncode not in (0, 1):
                    print(f"    pytest exited {outcome.returncode}:\n{outcome.output[-3000:]}")
                report[f"{label} on {engine}"] = {"passed": len(outcome.passed), "failed": outcome.failed,
                                                  "skipped": outcome.skipped, "seconds": round(outcome.seconds)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
