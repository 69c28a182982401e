"""``ApartPublisher``: each call published by a child process of its own, so that an event
that kills its publisher kills the child alone (docs/relay.md, "An event that kills its
worker"). Real child processes and a real RabbitMQ; the event that kills, hangs or slows
its publisher is ``publisher_support.KILLER_HOOK``'s."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest
from publisher_support import install_killer, make_message, raw_body
from services import AMQP_URL

from outbox.core.config import Settings
from outbox.core.model import FailureKind
from outbox.publisher import ChainResult, PublishFailure
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for


def apart(broker: dict[str, Any], timeout_s: float = 60.0) -> ApartPublisher:
    settings = Settings(publish_url=AMQP_URL, exchange=broker["exchange"], dead_letter_exchange=broker["dead"])
    return ApartPublisher(settings, timeout_s, publisher_for(settings))


@pytest.fixture(scope="module", autouse=True)
def killer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The children of this module's tests run ``KILLER_HOOK``: the fork server they come from
    starts (a fresh interpreter, which inherits PYTHONPATH) with it."""
    hook = tmp_path_factory.mktemp("killer")
    install_killer(hook)
    forkserver._forkserver._stop()  # one started before, without the hook: the next call starts another
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
        yield
    forkserver._forkserver._stop()


def test_chains_and_dead_letter_copies_are_published_by_the_child(broker: dict[str, Any]) -> None:
    first = [make_message(1, aggregate_id="a"), make_message(2, aggregate_id="a")]
    second = [make_message(3, aggregate_id="b")]
    results = apart(broker).publish_chains([first, second])
    assert results == [ChainResult(published=(1, 2)), ChainResult(published=(3,))]
    arrived = [m.headers["outbox_id"] for m in broker["live"]()]
    assert sorted(arrived) == [1, 2, 3] and arrived.index(1) < arrived.index(2)  # chains share waves
    dead = make_message(4, attempts=2)
    assert apart(broker).publish_dead(dead, "retriable: it kept failing") is None
    [copy] = broker["dead_letters"]()
    assert raw_body(copy) == dead.payload.encode() and copy.headers["x-outbox-error"] == "retriable: it kept failing"


def test_a_child_killed_by_its_event_is_a_retriable_failure_of_that_event(broker: dict[str, Any]) -> None:
    """The child dies (SIGKILL); the caller, alive, learns that the head of the chain failed."""
    [result] = apart(broker).publish_chains([[make_message(7, payload='{"KILLER": true}'), make_message(8)]])
    assert result.published == () and result.failed_id == 7
    assert result.failure is not None and result.failure.kind == FailureKind.RETRIABLE
    assert result.failure.reason == "the child process publishing it died (signal SIGKILL)"
    assert broker["live"]() == []
    # The next call has a child of its own.
    assert apart(broker).publish_chains([[make_message(9)]]) == [ChainResult(published=(9,))]


def test_a_child_that_does_not_answer_in_time_is_killed_and_its_event_failed(broker: dict[str, Any]) -> None:
    started = time.monotonic()
    [result] = apart(broker, timeout_s=3.0).publish_chains([[make_message(5, payload='{"HANG": true}')]])
    assert time.monotonic() - started < 10  # 3 s, the start-up of a child on a loaded machine, the kill
    assert result.failed_id == 5 and result.failure is not None and result.failure.kind == FailureKind.RETRIABLE
    assert result.failure.reason == "the child process publishing it did not answer within 3 s"


def test_a_child_whose_broker_hangs_says_so_before_its_parent_gives_up_on_it() -> None:
    """A child's publisher waits its own budget (the lease's safe part) from the child's
    start, and the parent as long from before it (the time a row may still be published):
    with a lease of 25 s or less (Kafka's own wait, the delivery timeout and 5 s, is longer),
    a hung broker made the parent give up first and report a retriable failure, an attempt
    spent on a row that went unsent. The child is now given a deadline a little before the
    parent's, so its own answer, BACKPRESSURE (no attempt spent), comes in
    time; and a deadline given to the call shortens both. The broker here is a Kafka address
    nobody answers at (its metadata is read until the deadline)."""
    settings = Settings(publish_url="kafka://127.0.0.1:1", claim_timeout_ms=20_000, max_payload_bytes=100_000)
    [result] = ApartPublisher(settings, 3.0, publisher_for(settings)).publish_chains([[make_message(17)]])
    assert result.failed_id == 17 and result.failure is not None, result
    assert result.failure.kind == FailureKind.BACKPRESSURE, result.failure  # not "did not answer within 3 s"

    started = time.monotonic()  # the child's publisher alone would wait 16 s (20 s x 0.8), its parent 60 s
    [result] = ApartPublisher(settings, 60.0, publisher_for(settings)).publish_chains(
        [[make_message(18)]], deadline=started + 2.0)
    assert time.monotonic() - started < 10.0
    assert result.failed_id == 18 and result.failure is not None and result.failure.kind == FailureKind.BACKPRESSURE


def test_a_slow_child_start_is_taken_from_the_callers_wait(broker: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent counted its wait, and the child its deadline, from after the child's start,
    so a slow start (the fork server's: a fresh interpreter, seconds on a loaded host) came on
    top of the publish's deadline: the call returned that much past it (3.9 s for a deadline
    2 s away, the server's start alone, on a host loaded 9), past the lease's safe part that the
    deadline is. Both now count from the call: the fork server here starts 3 s late."""
    forkserver._forkserver._stop()
    monkeypatch.setenv("OUTBOX_TEST_SLOW_FORKSERVER_S", "3")
    try:
        started = time.monotonic()
        [hung] = apart(broker).publish_chains([[make_message(19, payload='{"HANG": true}')]], deadline=started + 4.0)
        hung_s = time.monotonic() - started
        # The child's own deadline holds from the call too: its BACKPRESSURE still comes first.
        settings = Settings(publish_url="kafka://127.0.0.1:1", claim_timeout_ms=20_000, max_payload_bytes=100_000)
        forkserver._forkserver._stop()
        started = time.monotonic()
        [hanging_broker] = ApartPublisher(settings, 60.0, publisher_for(settings)).publish_chains(
            [[make_message(20)]], deadline=started + 6.0)
        hanging_broker_s = time.monotonic() - started
    finally:
        forkserver._forkserver._stop()  # the next call's server starts without the delay
    assert hung.failed_id == 19 and hung.failure is not None and hung.failure.kind == FailureKind.RETRIABLE
    assert hung_s < 6.0, hung_s  # 4 s and the kill; it was 7 s and more (the 3 s start on top)
    assert hanging_broker.failure is not None and hanging_broker.failure.kind == FailureKind.BACKPRESSURE, (
        hanging_broker)
    assert hanging_broker_s < 7.5, hanging_broker_s  # its own deadline, 5 s from the call; it was 8 s and more


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_child_told_to_stop_finishes_its_publish_first(broker: dict[str, Any], stop: signal.Signals) -> None:
    """A warm shutdown's SIGTERM (a supervisor signals every process of the worker) does not
    cut the child's one publish short: its row is published, not charged an attempt. Nor does
    Dramatiq's reload, a SIGHUP sent to the group: it killed the child, "died (signal SIGHUP)",
    an attempt charged to its row (found in review)."""
    with ThreadPoolExecutor(1) as pool:
        publishing = pool.submit(apart(broker).publish_chains, [[make_message(6, payload='{"SLOW": true}')]])
        started = time.monotonic()
        while not multiprocessing.active_children() and time.monotonic() - started < 10:
            time.sleep(0.05)
        [child] = multiprocessing.active_children()
        assert child.pid is not None
        os.kill(child.pid, stop)  # as it starts: blocked from its start, then ignored
        assert publishing.result(timeout=30) == [ChainResult(published=(6,))]
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [6]


def test_a_child_outliving_its_fork_server_is_heard_out(broker: dict[str, Any]) -> None:
    """Found in review: with the fork server killed (the OOM killer's pick, an operator's
    kill), multiprocessing reports each of its children dead (exit code 255) although they
    run on. The row was charged an attempt as "died (exit code 255)" while its child went on
    to publish it, so it was delivered twice. Now the pipe's end of file is what says a child
    is gone: the parent hears the child out."""
    with ThreadPoolExecutor(1) as pool:
        publishing = pool.submit(apart(broker).publish_chains, [[make_message(14, payload='{"SLOW": true}')]])
        started = time.monotonic()
        while not multiprocessing.active_children() and time.monotonic() - started < 10:
            time.sleep(0.05)
        server = forkserver._forkserver._forkserver_pid
        assert server is not None and multiprocessing.active_children()
        os.kill(server, signal.SIGKILL)  # the child sleeps 2 s in its publish meanwhile
        assert publishing.result(timeout=30) == [ChainResult(published=(14,))]
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [14]
    # The next call starts a fork server again, and a child of its own.
    assert apart(broker).publish_chains([[make_message(15)]]) == [ChainResult(published=(15,))]


EXITS_WITH_A_CHILD_PUBLISHING = """
import multiprocessing, sys, threading, time
from outbox.core.config import Settings
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for
from publisher_support import make_message

if __name__ == "__main__":
    settings = Settings(publish_url=sys.argv[1], exchange=sys.argv[2])
    chains = [[make_message(16, payload='{"HANG": true}')]]
    threading.Thread(target=ApartPublisher(settings, 60.0, publisher_for(settings)).publish_chains,
                     args=(chains,), daemon=True).start()  # a daemon thread, as Dramatiq's workers are
    while not multiprocessing.active_children():
        time.sleep(0.05)
    print(multiprocessing.active_children()[0].pid, flush=True)
    time.sleep(2)  # the child in its publish (a fork server's start and a child's: 0.3 s here)
    sys.exit(3)  # what Dramatiq's worker process does at its second signal ("Killing worker process...")
"""


def test_a_process_that_exits_kills_its_child_instead_of_waiting_for_it(
        broker: dict[str, Any], tmp_path: Path) -> None:
    """Found in review: multiprocessing's exit hook sends a daemonic child SIGTERM, which ours
    ignores (a warm shutdown must not cut its publish short), and then waits for it. So a
    Dramatiq worker told to stop a second time, which exits at once, waited for its child's
    whole publish, bounded only by the broker's timeouts. Now it kills the child: its row is
    left to the lease or the takeover, as when the worker itself is killed."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH_A_CHILD_PUBLISHING)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), AMQP_URL, broker["exchange"]], env=_with_support(),
                          capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert took < 20, f"the process took {took:.1f} s to exit: it waited for its child"
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "zombie" in _state(child), "the child runs on"
    assert broker["live"]() == []


FORKED_AFTER_ITS_PARENT_STARTED_A_SERVER = """
import os, sys
from outbox.core.config import Settings
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for
from publisher_support import make_message

if __name__ == "__main__":
    settings = Settings(publish_url=sys.argv[1], exchange=sys.argv[2], dead_letter_exchange=sys.argv[3])
    def apart():
        return ApartPublisher(settings, 60.0, publisher_for(settings))
    print("parent:", apart().publish_chains([[make_message(30)]])[0].published, flush=True)  # its fork server runs
    pid = os.fork()  # as a Celery worker's main process forks a pool process
    if pid == 0:
        failure = apart().publish_dead(make_message(31, payload='{"KILLER": true}'), "lease_expired: no attempts left")
        print("forked:", failure and failure.reason, flush=True)
        os._exit(0)
    print("forked process:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    print("parent:", apart().publish_chains([[make_message(32)]])[0].published, flush=True)  # its server serves on
"""


def test_a_process_forked_from_one_with_a_fork_server_starts_children_of_its_own(
        broker: dict[str, Any], tmp_path: Path) -> None:
    """A Celery worker's main process may start a fork server (its in-process claim sends a
    dead row's copy apart), and forks its pool processes (``os.fork``) after that. Such a
    fork inherited the server's record, which multiprocessing checks with ``waitpid``, a
    ChildProcessError in any process but the server's parent: it could start no child, and
    published here, without isolation, so the row that kills its publisher killed it. It now
    starts a server of its own; its parent's serves on."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_AFTER_ITS_PARENT_STARTED_A_SERVER)
    done = subprocess.run([sys.executable, str(script), AMQP_URL, broker["exchange"], broker["dead"]],
                          env=_with_support(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "parent: (30,)", "forked: the child process publishing it died (signal SIGKILL)", "forked process: 0",
        "parent: (32,)"], (done.stdout, done.stderr[-3000:])  # before: "forked process: -9"
    assert "no child process" not in done.stderr, done.stderr[-3000:]


IN_A_CELERY_POOL_PROCESS = """
import sys
import billiard
from outbox.core.config import Settings
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for
from publisher_support import make_message

def pool_process(url, exchange, dead):
    settings = Settings(publish_url=url, exchange=exchange, dead_letter_exchange=dead)
    apart = ApartPublisher(settings, 60.0, publisher_for(settings))
    failure = apart.publish_dead(make_message(33, payload='{"KILLER": true}'), "lease_expired: no attempts left")
    print("killer:", failure and failure.reason, flush=True)
    print("innocent:", apart.publish_dead(make_message(34), "lease_expired: no attempts left"), flush=True)

if __name__ == "__main__":
    process = billiard.Process(target=pool_process, args=tuple(sys.argv[1:4]), daemon=True)  # as Celery's pool makes them
    process.start()
    process.join()
    print("pool process:", process.exitcode, flush=True)
"""


def test_a_celery_pool_process_publishes_apart(broker: dict[str, Any], tmp_path: Path) -> None:
    """Found in review: a Celery pool process (billiard's, daemonic, which billiard makes
    multiprocessing's current process) could start no child ("daemonic processes are not
    allowed to have children", then billiard's key refused to be pickled), so a claim or
    ``outbox.fail`` task there sent every dead-letter copy itself: the killer's copy killed
    the pool process (-9) and the innocent copy behind it was never sent. Now its children
    start (tests/test_recovery_e2e.py has the worker)."""
    script = tmp_path / "pool_process.py"
    script.write_text(IN_A_CELERY_POOL_PROCESS)
    done = subprocess.run([sys.executable, str(script), AMQP_URL, broker["exchange"], broker["dead"]],
                          env=_with_support(), capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == [
        "killer: the child process publishing it died (signal SIGKILL)", "innocent: None", "pool process: 0"], (
        done.stdout, done.stderr[-3000:])  # before: "pool process: -9" and nothing else
    assert "no child process" not in done.stderr, done.stderr[-3000:]
    assert [m.headers["outbox_id"] for m in broker["dead_letters"]()] == [34]


FAIL_TASK = """
import json, logging, sys
from types import SimpleNamespace
from outbox.core.config import RelayOptions, load_settings
from outbox.relay import service

if __name__ == "__main__":
    url, amqp, exchange, dead, messages = sys.argv[1:6]
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": url, "OUTBOX_PUBLISH_URL": amqp, "OUTBOX_EXCHANGE": exchange,
                                      "OUTBOX_DEAD_LETTER_EXCHANGE": dead, "OUTBOX_MAX_ATTEMPTS": "3"})
    relay = service.Relay(settings, RelayOptions(), SimpleNamespace(broker_url="memory://", claim_key="outbox-test-fail"),
                          logging.getLogger("outbox.test-fail"))
    for message in json.loads(messages):  # what an outbox.fail task does with a dead mark handed to it
        print(relay.settle("failed", message=message, error="retriable: it kept failing", retry_in_s=None, dead=True),
              flush=True)
    relay.close()
"""


def test_a_dead_mark_handed_to_the_fail_task_is_dead_lettered_apart(broker: dict[str, Any], tmp_path: Path) -> None:
    """A publish whose dead mark could not be written (the database refused it) hands it to the
    ``outbox.fail`` task, which writes it and sends the dead-letter copy. The task sent it from
    its own worker thread, so a row tried twice whose publish had killed its child killed the
    worker process with the copy (on Dramatiq the whole command). Now the copy is sent apart:
    the process lives, the row is dead, and an innocent row's copy arrives."""
    import json

    from outbox import enqueue
    from outbox.core.model import message_to_dict
    from outbox.storage.store import OutboxStore

    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url, max_attempts=3)
    store.migrate()
    with store.transaction() as cursor:
        for aggregate, payload in (("k", {"KILLER": True}), ("d", {"n": 1})):
            enqueue(cursor.connection, topic="orders.created", aggregate_type="order", aggregate_id=aggregate,
                    payload=payload)
    messages = sorted(store.claim(10).messages, key=lambda m: m.aggregate_id, reverse=True)  # the killer first
    store.close()
    done = subprocess.run([sys.executable, "-c", FAIL_TASK, url, AMQP_URL, broker["exchange"], broker["dead"],
                           json.dumps([message_to_dict(m) for m in messages])], env=_with_support(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])  # before: -9, killed by the copy
    assert "dead-letter publish failed" in done.stderr and "died (signal SIGKILL)" in done.stderr, done.stderr[-3000:]
    [copy] = broker["dead_letters"]()
    assert copy.headers["aggregate_id"] == "d"
    store = OutboxStore(url, max_attempts=3)
    try:
        assert {row.id for row in store.dead_list()} == {m.id for m in messages}
    finally:
        store.close()


FIRST_CHILD_TOLD_TO_STOP = """
import multiprocessing, os, signal, sys, time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_tracker
from outbox.core.config import Settings
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for
from publisher_support import make_message

if __name__ == "__main__":
    assert resource_tracker._resource_tracker._pid is None  # the first use in this process
    settings = Settings(publish_url=sys.argv[1], exchange=sys.argv[2])
    with ThreadPoolExecutor(1) as pool:
        publishing = pool.submit(ApartPublisher(settings, 60.0, publisher_for(settings)).publish_chains,
                                 [[make_message(17, payload='{"SLOW": true}')]])
        while not multiprocessing.active_children():
            time.sleep(0.01)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGTERM)
        print(publishing.result(timeout=30), flush=True)
"""


def test_the_first_child_of_a_process_is_told_to_stop_and_finishes_its_publish(
        broker: dict[str, Any], tmp_path: Path) -> None:
    """Found when CI ran this module's tests in another order: multiprocessing's resource
    tracker, started by a process's first child, unblocks SIGINT and SIGTERM in the thread
    that starts it (``SIG_UNBLOCK``, not the mask it found), and the fork server started
    next in the same call inherited no mask. So in a worker's first publish apart a warm
    shutdown killed the child mid-publish ("died (signal SIGTERM)"), an attempt charged to
    an event that may have gone out. Now the tracker is started before the mask is set."""
    script = tmp_path / "first_child.py"
    script.write_text(FIRST_CHILD_TOLD_TO_STOP)
    done = subprocess.run([sys.executable, str(script), AMQP_URL, broker["exchange"]], env=_with_support(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr([ChainResult(published=(17,))]), done.stdout
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [17]


CHILD_CANNOT_MAKE_ITS_PUBLISHER = """
import sys
from outbox.core.config import Settings
from outbox.publisher.apart import ApartPublisher
from outbox.publisher.select import publisher_for
from publisher_support import make_message

if __name__ == "__main__":
    settings = Settings(publish_url=sys.argv[1], exchange="REFUSED-exchange")
    fallback = publisher_for(Settings(publish_url=sys.argv[1], exchange="unused"))
    print(ApartPublisher(settings, 30.0, fallback).publish_chains([[make_message(18)]]), flush=True)
"""


def test_a_child_that_cannot_make_its_publisher_says_why_with_the_password_masked(tmp_path: Path) -> None:
    """Found in review: an exception raised while the child made its publisher (a client that
    connects when made, its error naming the broker's URL) escaped the child, and
    multiprocessing printed its traceback to the worker's stderr, password in clear; the row's
    reason said only "died (exit code 1)". Now the child answers it as a failure, masked, and
    nothing it prints shows the password."""
    secret = "Hunter2Secret"
    url = f"amqp://guest:{secret}@127.0.0.1:5672//"  # never connected to: the publisher is not made
    script = tmp_path / "cannot_make.py"
    script.write_text(CHILD_CANNOT_MAKE_ITS_PUBLISHER)
    done = subprocess.run([sys.executable, str(script), url], env=_with_support(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout + done.stderr, done.stdout + done.stderr
    reason = "ConnectionError: cannot connect to amqp://guest:***@127.0.0.1:5672//: connection refused"
    assert done.stdout.strip() == repr([ChainResult(failed_id=18, failure=PublishFailure(
        FailureKind.RETRIABLE, reason))]), done.stdout


def _with_support() -> dict[str, str]:
    """This process's environment (the killer hook's PYTHONPATH), and the tests' directory and
    the checkout on PYTHONPATH for a script's ``publisher_support`` and the bench package."""
    tests = Path(__file__).parent
    paths = (os.environ.get("PYTHONPATH"), str(tests), str(tests.parent))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"


def test_with_no_child_to_be_had_the_call_is_published_here_and_spends_no_attempt(
        broker: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: a worker out of file descriptors (or memory, or with its fork server
    gone) could start no child, and the row was charged an attempt each time, so a row tried
    twice went dead for a fault of the host, its dead-letter copy failing the same way. Now the
    call goes to the worker thread's own publisher, with a WARNING."""
    from outbox.publisher import apart as apart_module

    def out_of_descriptors(*args: Any, **kwargs: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(apart_module._CONTEXT, "Pipe", out_of_descriptors)
    publisher = apart(broker)
    with caplog.at_level("WARNING", logger="outbox.publisher"):
        assert publisher.publish_chains([[make_message(11), make_message(12)]]) == [ChainResult(published=(11, 12))]
        assert publisher.publish_dead(make_message(13, attempts=3), "retriable: it kept failing") is None
    assert [m.headers["outbox_id"] for m in broker["live"]()] == [11, 12]
    assert len(broker["dead_letters"]()) == 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2 and all("no child process to publish apart" in m and
                                  "Too many open files" in m for m in said), said


def test_the_fork_server_can_be_started_before_a_lease_is_renewed(broker: dict[str, Any]) -> None:
    """``start_server`` (what ``Relay.publish`` calls before it renews a suspect's lease)
    leaves a fork server running, so the call's child is a fork of it, not a fresh start."""
    from outbox.publisher.apart import start_server
    forkserver._forkserver._stop()
    start_server()
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None and Path(f"/proc/{pid}").exists()
    started = time.monotonic()
    assert apart(broker).publish_chains([[make_message(22)]]) == [ChainResult(published=(22,))]
    assert forkserver._forkserver._forkserver_pid == pid  # the same server served the child
    assert time.monotonic() - started < 5


def test_a_suspects_lease_is_renewed_once_the_fork_server_runs(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A Dramatiq publish message carrying a row tried twice renews its lease, then its
    publisher starts a child; a worker process's first child started the fork server (a
    fresh interpreter: 6 s on a loaded host), all of it taken from the renewed lease of 6 s
    (x 0.8) in test_an_event_that_kills_its_worker_goes_dead_alone: the next claim found
    the row's lease expired with no attempt left and turned it dead while its child
    published it (review, 7 December). The server is now started before the renewal."""
    import logging
    from types import SimpleNamespace

    from outbox.core.config import RelayOptions, load_settings
    from outbox.core.model import message_to_dict
    from outbox.relay import service
    from outbox.relay.publish import Held

    order: list[str] = []
    monkeypatch.setattr(service, "start_server", lambda: order.append("server"))

    def held(store: Any, chains: Any, **kwargs: Any) -> Held:
        order.append("renew" if kwargs.get("renew") else "check")
        return Held([])

    monkeypatch.setattr(service, "still_held_when_reachable", held)
    relay = service.Relay(load_settings(environ={"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}),
                          RelayOptions(), SimpleNamespace(broker_url="memory://", claim_key="outbox-test-apart"),
                          logging.getLogger("outbox.test-apart"))  # type: ignore[arg-type]
    monkeypatch.setattr(relay, "apart_publisher", lambda deadline: None)
    monkeypatch.setattr(relay, "request_claim", lambda: None)
    try:
        relay.publish([[message_to_dict(make_message(1))]], suspects_apart=True)
        assert order == ["check"]  # no suspect: no server, the lease as it is
        relay.publish([[message_to_dict(make_message(2, attempts=2))]], suspects_apart=True)
        assert order == ["check", "server", "renew"]
    finally:
        relay.close()


def test_a_claims_dead_letter_copies_go_from_one_child_and_one_that_kills_it_fails_alone(
        broker: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim's dead-letter copies each had a child of their own, 0.2 s each on a loaded host:
    with 100 rows dead on their leases in one claim, 3 to 11 copies were left unsent when the
    claim's deadline came (found in review, 7 December). One child sends them all, answering
    each as it goes: a copy that kills it fails alone, and a new child sends the rest."""
    from outbox.publisher import apart as module

    started: list[int] = []
    process = module._CONTEXT.Process

    def counted(*args: Any, **kwargs: Any) -> Any:
        started.append(1)
        return process(*args, **kwargs)

    monkeypatch.setattr(module._CONTEXT, "Process", counted)
    copies: list[Any] = [(make_message(60 + n, attempts=3), "lease_expired: no attempts left", None) for n in range(20)]
    copies.insert(7, (make_message(90, payload='{"KILLER": true}', attempts=3), "lease_expired: no attempts left", None))
    results = apart(broker).publish_dead_all(copies)
    assert len(started) == 2, f"{len(started)} children for 21 copies, one of which kills its child"
    assert [n for n, failure in enumerate(results) if failure is not None] == [7]
    assert results[7] is not None and "died (signal SIGKILL)" in results[7].reason
    arrived = sorted(copy.headers["outbox_id"] for copy in broker["dead_letters"]())
    assert arrived == [60 + n for n in range(20)]
