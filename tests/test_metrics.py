"""Prometheus metrics (``outbox.relay.metrics``): the relay's hooks and functions against a real SQLite
store, read back from prometheus_client's registry; the HTTP endpoint; and a real prefork
worker serving the sum over its pool processes."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from relay_support import ScriptedPublisher
from services import free_port
from wake_support import PYTHON, CountingDestination, Workers, wait_done

from outbox import enqueue
from outbox.core.model import OutboxMessage
from outbox.publisher import FailureKind
from outbox.relay import RelayContext, RelayOptions, handle_claim, handle_publish, metrics
from outbox.storage.store import OutboxStore

#: The relay reports through its hooks; the runners install these when metrics are on.
HOOKS = metrics.PrometheusHooks()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    reg = CollectorRegistry()
    metrics.enable(reg)
    yield reg
    metrics.reset()


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Any]:
    made: list[OutboxStore] = []

    def make(name: str = "outbox.db", **options: Any) -> OutboxStore:
        s = OutboxStore(f"sqlite:///{tmp_path / name}", **options)
        s.migrate()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def add(db: str, aggregate: str, count: int = 1) -> list[int]:
    conn = sqlite3.connect(db, timeout=30)
    try:
        ids = [enqueue(conn, topic="orders.changed", aggregate_type="order", aggregate_id=aggregate,
                       payload={"n": n}) for n in range(count)]
        conn.commit()
        return ids
    finally:
        conn.close()


class Collect:
    def __init__(self) -> None:
        self.chains: list[list[OutboxMessage]] = []

    def __call__(self, chains: list[list[OutboxMessage]], deadline: float) -> None:
        self.chains.extend(chains)


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    got = reg.get_sample_value(name, labels or None)
    return 0.0 if got is None else got


def open_rows(store: OutboxStore) -> tuple[int, int]:
    with store.transaction() as cursor:
        row = store.engine.execute(cursor, "SELECT COUNT(CASE WHEN status = 1 THEN 1 END), COUNT(*) FROM outbox "
                                           "WHERE status IN (0, 1, 3)").fetchone()
    return int(row[0]), int(row[1])


def test_relay_functions_count_on_a_real_store(tmp_path: Path, registry: CollectorRegistry, make_store: Any) -> None:
    store = make_store(max_attempts=3)
    db = str(tmp_path / "outbox.db")
    _a, b, c = add(db, "a", 3), add(db, "b", 2), add(db, "c", 1)
    sent = Collect()
    outcome = handle_claim(RelayContext(store, options=RelayOptions(task_rows=1), hooks=HOOKS), sent, batch_size=100, lease_s=60.0)
    assert outcome.claimed == 6
    assert value(registry, "outbox_claimed_total") == 6
    assert value(registry, "outbox_claim_seconds_count") == 1
    # A claim never reads the gauges (the refresher thread does): it must not wait on them.
    assert value(registry, "outbox_backlog") == 0 and value(registry, "outbox_gauges_read_timestamp_seconds") == 0

    publisher = ScriptedPublisher({b[0]: FailureKind.RETRIABLE, c[0]: FailureKind.POISON}, sticky=True)
    handle_publish(RelayContext(store, publisher, hooks=HOOKS), sent.chains)
    assert value(registry, "outbox_published_total") == 3  # a's three; b stopped at its head, c is poison
    assert value(registry, "outbox_failed_total", kind="retriable") == 1
    assert value(registry, "outbox_failed_total", kind="poison") == 1
    assert value(registry, "outbox_failed_total", kind="backpressure") == 0
    assert value(registry, "outbox_dead_total") == 1
    assert value(registry, "outbox_publish_seconds_count") == 1  # one observation per publish call
    assert value(registry, "outbox_event_age_seconds_count") == 3  # one per published event
    assert 0 <= value(registry, "outbox_event_age_seconds_sum") < 60

    d = add(db, "d", 1)
    handle_claim(RelayContext(store, hooks=HOOKS), Collect(), batch_size=100, lease_s=60.0)  # leases d; b waits for its retry
    metrics.refresh(store, force=True)
    in_flight, backlog = open_rows(store)
    assert (in_flight, backlog) == (1, 3)  # d leased; b's two rows open
    assert value(registry, "outbox_in_flight") == 1 and value(registry, "outbox_backlog") == 3
    assert value(registry, "outbox_lag_seconds") >= 0
    assert value(registry, "outbox_claimed_total") == 7 and d
    assert value(registry, "outbox_empty_claims_total") == 0
    handle_claim(RelayContext(store, hooks=HOOKS), Collect(), batch_size=100, lease_s=60.0)  # all held or waiting
    assert value(registry, "outbox_empty_claims_total") == 1 and value(registry, "outbox_claim_seconds_count") == 3


def test_rows_that_go_dead_on_lease_expiry_are_counted(registry: CollectorRegistry, make_store: Any,
                                                        tmp_path: Path) -> None:
    store = make_store("expiry.db", max_attempts=1, claim_timeout_ms=50)
    add(str(tmp_path / "expiry.db"), "x", 1)
    assert len(store.claim(10).messages) == 1  # leased, then the worker "dies"
    time.sleep(0.2)
    handle_claim(RelayContext(store, hooks=HOOKS), Collect(), batch_size=10, lease_s=0.05)
    assert value(registry, "outbox_dead_total") == 1


def test_lag_is_the_age_of_the_oldest_open_row(registry: CollectorRegistry, make_store: Any, tmp_path: Path) -> None:
    store = make_store("lag.db")
    metrics.refresh(store, force=True)
    assert value(registry, "outbox_lag_seconds") == 0 and value(registry, "outbox_backlog") == 0
    add(str(tmp_path / "lag.db"), "a", 2)
    time.sleep(1.1)
    metrics.refresh(store, force=True)
    assert 1.0 <= value(registry, "outbox_lag_seconds") < 30
    assert value(registry, "outbox_backlog") == 2


def wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_every_failure_kind_reads_zero_before_its_first_failure(registry: CollectorRegistry) -> None:
    assert set(metrics.FAILURE_KINDS) == {kind.value for kind in FailureKind}
    for kind in FailureKind:
        assert registry.get_sample_value("outbox_failed_total", {"kind": kind.value}) == 0, kind


def test_the_refresher_reads_the_gauges_with_no_claim_and_keeps_them_when_reading_fails(
        registry: CollectorRegistry, make_store: Any, tmp_path: Path) -> None:
    """No claim runs at all: the refresher thread alone moves the gauges. When the table
    cannot be read, the last values stay and the oldest row's age goes on rising."""
    make_store("refresher.db")
    db = str(tmp_path / "refresher.db")
    add(db, "a", 3)
    refresher = metrics.GaugeRefresher(lambda: OutboxStore(f"sqlite:///{db}"), 0.1)
    refresher.start()
    try:
        assert wait_for(lambda: value(registry, "outbox_backlog") == 3, 10)
        first = value(registry, "outbox_oldest_undelivered_age_seconds")
        assert wait_for(lambda: value(registry, "outbox_oldest_undelivered_age_seconds") >= first + 1.0, 10)
        assert value(registry, "outbox_lag_seconds") >= first + 0.9  # read again and again
        assert abs(value(registry, "outbox_gauges_read_timestamp_seconds") - time.time()) < 5

        conn = sqlite3.connect(db, timeout=30)
        conn.execute("ALTER TABLE outbox RENAME TO outbox_away")  # every reading fails from now on
        conn.commit()
        conn.close()
        assert wait_for(lambda: value(registry, "outbox_oldest_undelivered_age_seconds")
                        >= value(registry, "outbox_lag_seconds") + 1.0, 10)
        read_at, lag = value(registry, "outbox_gauges_read_timestamp_seconds"), value(registry, "outbox_lag_seconds")
        time.sleep(0.3)
        assert value(registry, "outbox_backlog") == 3  # the last values stay
        assert (value(registry, "outbox_gauges_read_timestamp_seconds"), value(registry, "outbox_lag_seconds")) == (
            read_at, lag)
    finally:
        refresher.stop()
    assert not refresher._thread.is_alive()


@pytest.mark.parametrize("raw", ["0", "-1", "inf", "soon", "1e-300", "1e12"])
def test_a_refresh_interval_that_is_not_a_positive_number_is_refused(raw: str) -> None:
    """1e-300 read the gauges in a busy loop; 1e12 overflowed the refresher's wait and killed
    its thread (found in review): 0.1 s to a day."""
    from outbox.core.config import MetricsOptions
    from outbox.core.errors import ConfigError

    with pytest.raises(ConfigError, match="OUTBOX_RELAY_METRICS_REFRESH_S="):
        MetricsOptions.from_sources({"OUTBOX_RELAY_METRICS_REFRESH_S": raw})
    assert MetricsOptions.from_sources({"OUTBOX_RELAY_METRICS_REFRESH_S": "0.5"}).refresh_s == 0.5


def test_everything_is_a_no_op_when_metrics_are_off(make_store: Any, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    store = make_store("off.db")
    metrics.reset()
    try:
        assert metrics.active() is None  # OUTBOX_RELAY_METRICS_PORT unset
        metrics.claimed(object(), 0.1)
        metrics.chain([], 0.1, "retriable")
        metrics.dead()
        metrics.refresh(store, force=True)
        handle_claim(RelayContext(store, hooks=HOOKS), Collect(), batch_size=10, lease_s=60.0)

        monkeypatch.setenv("OUTBOX_RELAY_METRICS_PORT", "9999")
        monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)  # not installed
        metrics.reset()
        assert metrics.active() is None
        assert "prometheus_client is not installed" in caplog.text

        monkeypatch.setenv("OUTBOX_RELAY_METRICS_PORT", "not-a-port")
        metrics.reset()
        assert metrics.active() is None
        assert "OUTBOX_RELAY_METRICS_PORT='not-a-port' is not a port number" in caplog.text
    finally:
        metrics.reset()


def test_metrics_never_break_the_relay(registry: CollectorRegistry, make_store: Any,
                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = make_store("broken.db")
    add(str(tmp_path / "broken.db"), "a", 1)
    active = metrics.active()
    assert active is not None

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("metrics backend broke")

    monkeypatch.setattr(active.claimed, "inc", broken)
    monkeypatch.setattr(active.backlog, "set", broken)
    outcome = handle_claim(RelayContext(store, hooks=HOOKS), Collect(), batch_size=10, lease_s=60.0)
    assert outcome.claimed == 1


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


class SlowPublisher(ScriptedPublisher):
    """Publishes every chain whole; the one call for all the task's chains takes 0.2 s."""

    def publish_chains(self, chains: Any, *, pipelined: Any = None, deadline: Any = None) -> Any:
        time.sleep(0.2)
        return super().publish_chains(chains, pipelined=pipelined, deadline=deadline)


def test_publish_seconds_is_observed_once_per_publish_call(
        tmp_path: Path, registry: CollectorRegistry, make_store: Any) -> None:
    """Found in review: every chain of a publish task observed the whole task's sending time,
    so a task of 10 chains that took 0.2 s added 2 s to the sum. One observation per call."""
    store = make_store()
    db = str(tmp_path / "outbox.db")
    for n in range(10):
        add(db, f"agg-{n}")
    sent = Collect()
    handle_claim(RelayContext(store, hooks=HOOKS), sent, batch_size=100, lease_s=60.0)
    assert len(sent.chains) == 10
    began = time.perf_counter()
    handle_publish(RelayContext(store, SlowPublisher(), hooks=HOOKS), sent.chains)
    wall = time.perf_counter() - began
    assert value(registry, "outbox_published_total") == 10
    assert value(registry, "outbox_publish_seconds_count") == 1
    assert 0.2 <= value(registry, "outbox_publish_seconds_sum") <= wall


def samples(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, number = line.rpartition(" ")
            found[name] = float(number)
    return found


def test_http_endpoint(registry: CollectorRegistry) -> None:
    metrics.sent(1, 0.01)
    metrics.chain([], 0.01, "backpressure")
    metrics.dead(2)
    server = metrics.serve(0, "127.0.0.1")
    try:
        text = scrape(server.server_port)
    finally:
        metrics.stop_serving()
    got = samples(text)
    assert got['outbox_failed_total{kind="backpressure"}'] == 1
    assert got["outbox_dead_total"] == 2
    assert got["outbox_publish_seconds_count"] == 1
    assert "# TYPE outbox_lag_seconds gauge" in text


WRITER = r"""
import json, sqlite3, sys
import outbox
conn = sqlite3.connect(sys.argv[1], timeout=30)
ids = []
for n in range(20):
    with outbox.transaction(conn):
        ids.append(outbox.enqueue(conn, topic="orders.changed", aggregate_type="order",
                                  aggregate_id=f"agg-{n % 4}", payload={"n": n}))
print(json.dumps(ids))
"""


def test_a_prefork_worker_serves_the_sum_over_its_pool(tmp_path: Path, counting_destination: CountingDestination,
                                                       workers: Workers) -> None:
    db = tmp_path / "outbox.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    port = free_port()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_RELAY_METRICS_PORT=str(port),
                      OUTBOX_RELAY_METRICS_ADDR="127.0.0.1", OUTBOX_RELAY_METRICS_REFRESH_S="0.1",
                      OUTBOX_CLAIM_INTERVAL_S="3600")
    log = workers.start(env, "-c", "2", "--pool", "prefork")
    done = subprocess.run([PYTHON, "-c", WRITER, str(db)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert wait_done(store, ids, 30) < 30, log.read_text(errors="replace")[-4000:]
    time.sleep(0.5)
    text = scrape(port)
    got = samples(text)
    assert "(multiprocess)" in log.read_text(errors="replace")
    # Tasks ran in the pool's child processes; the main process serves their sum.
    assert got["outbox_published_total"] == 20, text
    assert got["outbox_claimed_total"] >= 20
    assert got["outbox_event_age_seconds_count"] == 20
    assert got["outbox_claim_seconds_count"] >= 1
    assert "outbox_lag_seconds" in got and "outbox_in_flight" in got
    for kind in FailureKind:  # the main process's zeros, summed with the children's
        assert got[f'outbox_failed_total{{kind="{kind.value}"}}'] == 0, text
    store.close()


def test_the_gauges_move_while_no_claim_runs(tmp_path: Path, counting_destination: CountingDestination, workers: Workers) -> None:
    """Beat stopped (no beat process, a one-hour tick) and no wake-up: rows wait and no
    claim runs, yet the worker's endpoint shows them waiting, longer at each scrape (the
    gauges used to be read only by claims, so they read 0 here)."""
    db = tmp_path / "outbox.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    port = free_port()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_RELAY_METRICS_PORT=str(port),
                      OUTBOX_RELAY_METRICS_ADDR="127.0.0.1", OUTBOX_RELAY_METRICS_REFRESH_S="0.2",
                      OUTBOX_CLAIM_INTERVAL_S="3600", OUTBOX_RELAY_WAKE="0",
                      OUTBOX_RELAY_IN_PROCESS_CLAIM="0")  # no wake subscriber, so no claim at start-up
    log = workers.start(env, "-c", "1")
    add(str(db), "waiting", 5)  # committed without a wake-up

    def gauge(name: str) -> float:
        return samples(scrape(port)).get(name, -1.0)

    assert wait_for(lambda: gauge("outbox_backlog") == 5, 20), (scrape(port), log.read_text(errors="replace")[-3000:])
    first = gauge("outbox_oldest_undelivered_age_seconds")
    assert first >= 0
    assert wait_for(lambda: gauge("outbox_oldest_undelivered_age_seconds") >= first + 1.0, 20), scrape(port)
    assert gauge("outbox_in_flight") == 0 and gauge("outbox_claim_seconds_count") == 0  # no claim ran
    assert open_rows(store) == (0, 5)
    store.close()


GONE = r"""
import os
from outbox.relay import metrics
metrics.enable()  # as a pool process does, in the worker's PROMETHEUS_MULTIPROC_DIR
metrics.dead(3)
print(os.getpid())
"""


def test_the_files_of_processes_that_are_gone_are_folded_at_a_scrape(
        tmp_path: Path, counting_destination: CountingDestination, workers: Workers) -> None:
    """Found in review: prometheus_client keeps one file per process in PROMETHEUS_MULTIPROC_DIR,
    and a pool that replaces its processes (--max-tasks-per-child) left those of every dead one
    for ever: at a claim tick a second and 5 tasks a child, 50,000 files (270 MB) a day, and a
    scrape that reads them all took 3 s at 20,000. A scrape folds the files of processes that
    are gone into one per type, their counts kept in the sums."""
    db = tmp_path / "outbox.db"
    store = OutboxStore(f"sqlite:///{db}")
    store.migrate()
    port = free_port()
    prom = tmp_path / "prom"
    prom.mkdir()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"sqlite:///{db}", OUTBOX_RELAY_METRICS_PORT=str(port),
                      OUTBOX_RELAY_METRICS_ADDR="127.0.0.1", OUTBOX_CLAIM_INTERVAL_S="3600",
                      OUTBOX_RELAY_IN_PROCESS_CLAIM="0", PROMETHEUS_MULTIPROC_DIR=str(prom))
    log = workers.start(env, "-c", "2", "--pool", "prefork", "--max-tasks-per-child", "1")
    done = subprocess.run([PYTHON, "-c", WRITER, str(db)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert wait_done(store, ids, 30) < 30, log.read_text(errors="replace")[-4000:]
    gone = subprocess.run([PYTHON, "-c", GONE], env=env, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr[-4000:]
    pid = gone.stdout.strip()
    assert any(name.endswith(f"_{pid}.db") for name in os.listdir(prom))
    time.sleep(1.0)
    first = samples(scrape(port))
    assert not [name for name in os.listdir(prom) if name.endswith(f"_{pid}.db")], sorted(os.listdir(prom))
    again = samples(scrape(port))
    for got in (first, again):  # the pool's children, each gone after a task, and the process above
        assert got["outbox_published_total"] == 20 and got["outbox_event_age_seconds_count"] == 20, got
        assert got["outbox_dead_total"] == 3, got
    assert again["outbox_claim_seconds_count"] == first["outbox_claim_seconds_count"] >= 1
    store.close()


def test_the_gauges_are_served_before_their_first_reading(counting_destination: CountingDestination,
                                                           workers: Workers) -> None:
    """Found in review: in multiprocess mode (prefork) prometheus_client serves a gauge only once
    it is set, so a worker whose database was down from its start served no gauge at all:
    ``OutboxGaugesStale`` (on the reading's timestamp) could not fire, and
    ``OutboxRelayDown`` (``absent(outbox_backlog)``) said no worker was up. The gauges read 0
    until the first reading, its timestamp 0 (never read)."""
    port = free_port()
    env = workers.env(counting_destination, OUTBOX_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{free_port()}/test",
                      OUTBOX_RELAY_METRICS_PORT=str(port), OUTBOX_RELAY_METRICS_ADDR="127.0.0.1",
                      OUTBOX_RELAY_METRICS_REFRESH_S="0.2", OUTBOX_CLAIM_INTERVAL_S="3600")
    log = workers.start(env, "-c", "1", "--pool", "prefork")
    assert wait_for(lambda: "cannot read the gauges" in log.read_text(errors="replace"), 20)
    text = scrape(port)
    got = samples(text)
    assert "(multiprocess)" in log.read_text(errors="replace")
    for name in ("outbox_backlog", "outbox_in_flight", "outbox_oldest_undelivered_age_seconds", "outbox_lag_seconds",
                 "outbox_gauges_read_timestamp_seconds"):
        assert got.get(name) == 0, text


def test_a_port_another_worker_holds_is_said_to_leave_this_workers_counts_out(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: two workers of one host with the same OUTBOX_RELAY_METRICS_PORT (``celery
    multi start w1 w2``, two units of one template): the second logged "cannot serve (OSError:
    Address already in use)", and the scrapes showed the first's counts alone, 86 of 200 events
    published. The line says what is missing and what to do."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        monkeypatch.setenv("OUTBOX_RELAY_METRICS_PORT", str(held.getsockname()[1]))
        monkeypatch.setenv("OUTBOX_RELAY_METRICS_ADDR", "127.0.0.1")
        with caplog.at_level(logging.ERROR, logger="outbox.relay.metrics"):
            metrics.on_worker_ready(None)
    finally:
        held.close()
        metrics.stop_serving()
    [line] = [r.getMessage() for r in caplog.records if "cannot serve" in r.getMessage()]
    assert "in no scrape" in line and "its own OUTBOX_RELAY_METRICS_PORT" in line, line


def test_the_multiprocess_directory_is_in_the_users_own_not_a_name_others_can_foresee(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Dramatiq worker's processes shared ``<tmp>/outbox-metrics-<pid>-<start>``, a name any
    local user can work out from /proc: made first by another user it stopped the sum, and a
    directory of that name was used whatever its mode, files planted in it included (found in
    review). The directory is in the user's own ``outbox-<uid>`` (state.private_dir), mode
    0700, as Celery's fresh one is."""
    import stat
    import sys
    import tempfile

    from outbox.relay.state import private_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")  # unset, as the worker starts; restored afterwards
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    monkeypatch.delitem(sys.modules, "prometheus_client", raising=False)  # not yet imported, as in a worker
    monkeypatch.setattr(metrics, "_own_dir", None)
    monkeypatch.setattr(metrics, "_shared_dir", None)
    parent = os.getpid()
    planted = tmp_path / f"outbox-metrics-{parent}-{metrics._started(parent)}"
    planted.mkdir()
    planted.chmod(0o777)
    (planted / metrics.SERVING).write_text("1")
    (planted / f"counter_{parent}.db").write_bytes(b"planted")
    metrics.prepare_multiprocess(parent=parent)  # a Dramatiq worker's process
    shared = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    assert shared != planted and shared.parent == Path(str(private_dir()))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700 and not any(shared.iterdir())
    metrics.prepare_multiprocess(parent=parent)  # its sibling: the same directory
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(shared)
    monkeypatch.setattr(metrics, "_shared_dir", None)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    metrics.prepare_multiprocess()  # a Celery worker's main process: a fresh one, there too
    own = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    assert own.parent == shared.parent and own != shared and stat.S_IMODE(own.stat().st_mode) == 0o700
    metrics.stop_serving()
    assert not own.exists()
