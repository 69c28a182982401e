"""An idle relay is quiet at INFO and logs a heartbeat: a real worker and beat (Redis as
Celery's broker, RabbitMQ as destination, the outbox on SQLite), their INFO lines counted
over an idle window."""

from __future__ import annotations

import logging
import re
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from log_support import logging_as_in_python_313
from relay_e2e_support import Destination, Outbox, relay_env, relay_queue, wait_until

from outbox.celery.worker_logging import NoticeFilter, TickFilter, heartbeat_line
from outbox.core.model import Stats
from outbox.relay import CLAIM_TASK, PUBLISH_TASK

IDLE_WINDOW_S = 10.0
HEARTBEAT_S = 3.0


def info_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "INFO/" in line]


def test_an_idle_worker_and_beat_are_quiet_at_info_and_log_a_heartbeat(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, OUTBOX_CLAIM_INTERVAL_S="0.5",
                                    OUTBOX_RELAY_HEARTBEAT_S=str(HEARTBEAT_S)))
    procs.worker("w1")
    procs.beat()
    assert wait_until(lambda: " ready." in procs.log("w1") and "beat: Starting" in procs.log("beat"), timeout=60), (
        f"worker or beat did not start\n--- worker\n{procs.log('w1')[-3000:]}\n--- beat\n{procs.log('beat')[-3000:]}")
    # The banner names Celery's broker by the URL it was given: no class path of the transport
    # that drops garbage (outbox.celery.redis_transport), no masked password where there is none.
    banner = next((line for line in procs.log("w1").splitlines() if ".> transport:" in line), "")
    assert banner.split("transport:", 1)[-1].strip() == procs.env["OUTBOX_CELERY_BROKER_URL"], banner
    # Beat names the outbox it ticks for at start (its banner names only the broker).
    claim_queue = relay_queue(procs.env, "claim")
    assert f"outbox beat: a claim tick every 0.5 s to queue {claim_queue} (outbox " in procs.log("beat"), (
        procs.log("beat")[-3000:])
    # Let beat send its first ticks, then count what an idle window adds.
    time.sleep(2)
    worker_before, beat_before = len(info_lines(procs.log("w1"))), len(info_lines(procs.log("beat")))
    time.sleep(IDLE_WINDOW_S)
    procs.check_alive()
    worker_new = info_lines(procs.log("w1"))[worker_before:]
    beat_new = info_lines(procs.log("beat"))[beat_before:]
    context = f"\n--- worker\n{procs.log('w1')[-4000:]}\n--- beat\n{procs.log('beat')[-3000:]}"

    heartbeats = [line for line in worker_new if "outbox heartbeat: alive" in line]
    # About IDLE_WINDOW_S / HEARTBEAT_S heartbeats (a loaded machine may delay one), nothing else.
    assert 2 <= len(heartbeats) <= 4, context
    assert len(worker_new) == len(heartbeats), context
    # Beat: its own heartbeat only, counting the ticks it sent (about two a second).
    beat_beats = [line for line in beat_new if "outbox beat heartbeat: alive" in line]
    assert beat_new == beat_beats and 2 <= len(beat_beats) <= 4, context
    sent = [int(m.group(1)) for line in beat_beats if (m := re.search(r"; (\d+) claim ticks sent", line))]
    assert sent and max(sent) >= 2, context
    # The ticks did run (about two a second): the heartbeat counts them.
    ticks = [int(m.group(1)) for line in heartbeats if (m := re.search(r"; (\d+) claim ticks", line))]
    assert ticks and max(ticks) >= 2, context
    assert re.search(r"backlog pending=0 claimed=0 failed=0 dead=0 \(counted \d+ min ago\); oldest undelivered -",
                     heartbeats[-1]), context  # the dead rows counted at the first beat (DEAD_COUNT_EVERY_S)
    first = next(line for line in info_lines(procs.log("w1")) if "outbox heartbeat: alive" in line)
    assert "failed=0 dead=0; oldest undelivered -" in first, context

    # Traffic still shows at INFO: a publish task (or an inline claim) is logged.
    with sqlite_outbox.writer() as conn:
        for n in range(30):
            sqlite_outbox.add(conn, f"agg-{n % 3}", n)
        conn.commit()
    assert destination.wait_for(lambda: len(destination.arrived()) >= 30, timeout=60, procs=procs), context
    # A heartbeat after the delivery reports an empty backlog again.
    assert wait_until(lambda: "backlog pending=0" in [line for line in info_lines(procs.log("w1"))
                                                      if "heartbeat" in line][-1], timeout=30)


#: Claim messages that are not beat's ticks, sent every 0.5 s: a claim request (drain mode, a
#: takeover, a writer's wake with no worker listening) and a writer's wake on a broker other than Redis.
CLAIM_SENDER = r"""
import sys, time
from outbox.celery.application import send_relay_task
from outbox.core.names import CLAIM_TASK
for n in range(200):
    send_relay_task(CLAIM_TASK, {"requested": True}, expires=30)
    send_relay_task(CLAIM_TASK, {}, expires=30)
    print("sent", 2 * (n + 1), flush=True)
    time.sleep(0.5)
"""


def test_a_worker_that_gets_no_claim_tick_says_beat_is_missing(
        tmp_path: Path, destination: Destination, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """Started without beat, a worker on a real Celery broker delivered what was there at
    start and then nothing more, the only hint a heartbeat's `0 claim ticks` 5 minutes
    later. It now says so once, after ten claim intervals (at least 10 s). Claim messages
    that are not beat's ticks (claim requests, wakes) count for neither: they were counted,
    so with traffic the heartbeat showed ticks and the warning never came (found in review)."""
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, OUTBOX_CLAIM_INTERVAL_S="0.5",
                                    OUTBOX_RELAY_HEARTBEAT_S=str(HEARTBEAT_S), OUTBOX_RELAY_IN_PROCESS_CLAIM="0"))
    procs.worker("w1")
    procs.spawn("sender", [sys.executable, "-c", CLAIM_SENDER])
    warning = "outbox: no claim tick has reached this worker in the 10 s since it started: run `celery -A outbox beat`"
    assert wait_until(lambda: warning in procs.log("w1"), timeout=40), (
        f"{procs.log('w1')[-3000:]}\n--- sender\n{procs.log('sender')[-1000:]}")
    assert "sent 10" in procs.log("sender"), procs.log("sender")[-3000:]
    heartbeats = [line for line in info_lines(procs.log("w1")) if "outbox heartbeat: alive" in line]
    ticks = [int(m.group(1)) for line in heartbeats if (m := re.search(r"; (\d+) claim ticks", line))]
    assert ticks and set(ticks) == {0}, heartbeats
    procs.kill("sender")
    procs.beat()  # with beat there, the worker's check sees ticks: nothing is said
    procs.worker("w2")
    assert wait_until(lambda: "outbox heartbeat: alive" in procs.log("w2"), timeout=60), procs.log("w2")[-3000:]
    time.sleep(12)
    procs.check_alive()
    assert "no claim tick has reached" not in procs.log("w2"), procs.log("w2")[-3000:]
    assert procs.log("w1").count("no claim tick has reached") == 1


def _record(name: str, msg: str, args: Any, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_tick_filter_drops_claim_ticks_only_and_keeps_them_at_debug() -> None:
    f = TickFilter()
    received = _record("celery.worker.strategy", "Task %(name)s[%(id)s] received",
                       ({"name": CLAIM_TASK, "id": "1", "kwargs": "{'requested': False, 'outbox': 'o'}"},))
    assert isinstance(received.args, dict) and received.args["id"] == "1"  # LogRecord unwraps a single mapping
    succeeded = _record("celery.app.trace", "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                        ({"name": CLAIM_TASK, "id": "1", "runtime": 0.1, "return_value": None},))
    beat = _record("celery.beat", "Scheduler: Sending due task %s (%s)", ("outbox-claim", CLAIM_TASK))
    publish = _record("celery.app.trace", "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                      ({"name": PUBLISH_TASK, "id": "2", "runtime": 0.1, "return_value": None},))
    warning = _record("celery.app.trace", "Task %(name)s[%(id)s] retry", ({"name": CLAIM_TASK, "id": "3"},),
                      logging.WARNING)
    logging.getLogger("celery.worker.strategy").setLevel(logging.INFO)
    try:
        assert not f.filter(received) and not f.filter(succeeded) and not f.filter(beat)
        assert f.filter(publish) and f.filter(warning)
        assert f.take_ticks() == 1 and f.take_ticks() == 0
        assert f.take_sent() == 1 and f.take_sent() == 0
        logging.getLogger("celery.worker.strategy").setLevel(logging.DEBUG)
        assert f.filter(received)
    finally:
        logging.getLogger("celery.worker.strategy").setLevel(logging.NOTSET)


def test_the_worker_counts_beats_ticks_not_claim_requests() -> None:
    """Found in review: every claim task's "received" line was counted as a tick, so claim
    requests (drain mode, takeovers) and writers' wakes hid a missing beat. Only a claim
    whose kwargs carry the tick's marker counts; every claim line still goes to DEBUG."""
    def received(kwargs: str) -> logging.LogRecord:
        return _record("celery.worker.strategy", "Task %(name)s[%(id)s] received",
                       ({"name": CLAIM_TASK, "id": "1", "args": "()", "kwargs": kwargs},))

    f = TickFilter()
    logging.getLogger("celery.worker.strategy").setLevel(logging.INFO)
    try:
        shown = [f.filter(received(kwargs)) for kwargs in (
            "{'requested': False, 'outbox': 'o'}",  # beat's tick, and one forwarded from another outbox
            "{'requested': True, 'outbox': 'o'}",  # a worker's claim request
            "{'requested': True, 'token': 't', 'outbox': 'o'}",  # a writer's wake with no worker listening
            "{'outbox': 'o'}",  # a writer's wake on a broker other than Redis
            "")]  # no kwargsrepr (an older client's message)
    finally:
        logging.getLogger("celery.worker.strategy").setLevel(logging.NOTSET)
    assert shown == [False] * 5
    assert f.received == 1 and f.take_ticks() == 1


def test_claim_ticks_logged_through_the_logger_show_at_debug_only() -> None:
    """Through a real logging call (the filter on the logger, as ``install_filters`` puts
    it), with Python 3.13's logging on any Python (tests/log_support.py): its ``isEnabledFor``
    says False to every call made while the thread handles a record, so the filter asked it
    and dropped the ticks even at DEBUG there."""
    logger = logging.getLogger("celery.worker.strategy")
    shown: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.append(record.getMessage())

    f, handler = TickFilter(), Keep()
    installed, logger.filters = logger.filters, [f]  # alone: another test may have installed the process's own
    logger.addHandler(handler)
    try:
        for level in (logging.INFO, logging.DEBUG):
            logger.setLevel(level)
            with logging_as_in_python_313():
                logger.info("Task %(name)s[%(id)s] received",
                            {"name": CLAIM_TASK, "id": str(level), "kwargs": "{'requested': False}"})
    finally:
        logger.filters = installed
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert shown == [f"Task {CLAIM_TASK}[{logging.DEBUG}] received"]
    assert f.take_ticks() == 2


def test_celerys_notice_on_a_setting_the_relay_sets_is_dropped_and_no_other_warning() -> None:
    """Celery warns at every loss of its broker (``CANCEL_TASKS_BY_DEFAULT``), whatever
    ``worker_cancel_long_running_tasks_on_connection_loss`` is set to; the relay sets it, so
    the notice goes. The records are made as ``logging.captureWarnings`` makes them."""
    import warnings

    from celery.exceptions import CPendingDeprecationWarning
    from celery.worker.consumer.consumer import CANCEL_TASKS_BY_DEFAULT

    def captured(message: str, category: type[Warning]) -> logging.LogRecord:
        text = warnings.formatwarning(message, category, "consumer.py", 427)
        return _record("py.warnings", "%s", (text,), logging.WARNING)

    f = NoticeFilter()
    assert not f.filter(captured(CANCEL_TASKS_BY_DEFAULT, CPendingDeprecationWarning))
    assert f.filter(captured("The broker_connection_retry configuration setting will no longer determine ...",
                             CPendingDeprecationWarning))
    assert f.filter(captured(CANCEL_TASKS_BY_DEFAULT, UserWarning))  # only Celery's own notice
    assert f.filter(_record("outbox.relay", "%s", ("worker_cancel_long_running_tasks_on_connection_loss",),
                            logging.WARNING))


def test_heartbeat_line() -> None:
    stats = Stats(counts={"pending": 3, "claimed": 1, "done": 9, "failed": 0, "dead": 2},
                  oldest_pending_age_s=12.34, dead=2)
    assert heartbeat_line(stats, 7) == ("outbox heartbeat: alive; backlog pending=3 claimed=1 failed=0 dead=2; "
                                        "oldest undelivered 12.3s; 7 claim ticks since the last heartbeat")


def test_the_heartbeat_counts_the_dead_rows_hourly_and_the_open_ones_each_beat(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the dead rows reads the whole table on PostgreSQL, in every worker at every
    beat (found in review: 218 ms at 1,000,000 rows): they are counted at the first beat and
    then hourly, the line saying how long ago; the open rows at every beat."""
    from outbox.celery import worker_logging
    from outbox.celery.worker_logging import Heartbeat
    from outbox.core.config import Settings
    from outbox.domain.events import prepare_event
    from outbox.storage.store import OutboxStore

    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url)
    store.migrate()
    engine = store.engine
    dead = f"UPDATE {engine.table} SET status = 4, processed_at = {engine.now} WHERE aggregate_id = ?"
    with store.transaction() as cursor:
        for n in range(3):
            engine.insert_event(cursor, prepare_event(topic="t", aggregate_type="a", aggregate_id=f"a{n}", payload={}))
        engine.execute(cursor, dead, ["a0"])
    heartbeat = Heartbeat(300.0, Settings.from_sources({"OUTBOX_DATABASE_URL": url}))

    def beat() -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="outbox.heartbeat"):
            heartbeat.beat_once(None)
        return [r.getMessage() for r in caplog.records if "outbox heartbeat" in r.getMessage()][-1]

    assert "pending=2 claimed=0 failed=0 dead=1;" in beat()
    with store.transaction() as cursor:
        engine.execute(cursor, dead, ["a1"])
    assert "pending=1 claimed=0 failed=0 dead=1 (counted 0 min ago);" in beat()
    monkeypatch.setattr(worker_logging, "DEAD_COUNT_EVERY_S", 0.0)
    assert "pending=1 claimed=0 failed=0 dead=2;" in beat()
    store.close()


@pytest.mark.parametrize("interval", ["0", "-1", "soon"])
def test_a_bad_heartbeat_interval_is_a_configuration_error(interval: str) -> None:
    from outbox.core.errors import ConfigError
    from outbox.relay import RelayOptions

    with pytest.raises(ConfigError, match="OUTBOX_RELAY_HEARTBEAT_S"):
        RelayOptions.from_sources({"OUTBOX_RELAY_HEARTBEAT_S": interval})


def test_the_heartbeat_of_a_worker_without_its_table_says_to_migrate(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It logged the driver's words (`UndefinedTable: relation "x" does not exist LINE 1: ...`);
    it now says what the CLI says for the same problem."""
    from outbox.celery.worker_logging import Heartbeat
    from outbox.core.config import Settings

    settings = Settings.from_sources({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                                      "OUTBOX_TABLE": "never_migrated"})
    sqlite3.connect(tmp_path / "o.db").close()  # the database exists, the table does not
    with caplog.at_level(logging.WARNING, logger="outbox.heartbeat"):
        Heartbeat(300.0, settings).beat_once(None)
    lines = [r.getMessage() for r in caplog.records if "outbox heartbeat" in r.getMessage()]
    assert lines == ['outbox heartbeat: alive, but cannot read the backlog: table "never_migrated" missing: '
                     'run `outbox migrate` (it creates the table and its indexes)'], lines
