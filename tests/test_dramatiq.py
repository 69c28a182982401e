"""The Dramatiq front-end's own parts (the relay end to end on Dramatiq runs in
tests/test_relay_e2e.py and tests/test_recovery_e2e.py, on both runners): its settings, the post-commit wake sending
a Dramatiq message, the claim actor's drain slice, and the scheduler's leader lock on real Redis and RabbitMQ."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dramatiq")

from log_support import logging_as_in_python_313
from services import AMQP_URL, REDIS_URL, free_port, require

import outbox
from outbox import wake
from outbox.core.config import (
    CLOCK_SKEW_MARGIN_S,
    dramatiq_settings,
    known_names,
    relay_settings,
    validate_dramatiq_broker_url,
    validate_dramatiq_namespace,
)
from outbox.core.errors import ConfigError
from outbox.core.names import Queues, default_namespace
from outbox.dramatiq.brokers import configured, expired, make_broker, message, pika_url
from outbox.dramatiq.scheduler import LOCK_TTL_S, RabbitLock, RedisLock, lock_name, run
from outbox.relay import CLAIM_TASK, PURGE_TASK
from outbox.relay.waker import token_for
from outbox.storage.store import OutboxStore

BIN = Path(sys.executable).parent


# -- settings ----------------------------------------------------------------------------------

def test_the_dramatiq_settings_are_known_names() -> None:
    assert {"OUTBOX_DRAMATIQ_BROKER_URL", "OUTBOX_DRAMATIQ_NAMESPACE"} <= set(known_names())


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://h/1", "amqp://u:p@h:5672/", "amqps://h//"])
def test_redis_and_amqp_urls_are_dramatiq_brokers(url: str) -> None:
    assert validate_dramatiq_broker_url(url) == url


@pytest.mark.parametrize("url", ["amqp://u:p@h:5672//", "amqp://u:p@h:5672//?heartbeat=5", "amqp://u:p@h:5672/",
                                 "amqp://h/%2F", "amqp://h//staging", "amqps://h:5671/staging", "amqp://h"])
def test_pika_is_given_the_virtual_host_kombu_reads_in_the_url(url: str) -> None:
    """The same OUTBOX_*_URL means one virtual host to Celery (kombu) and Dramatiq (pika)."""
    import pika
    from kombu import Connection

    assert pika.URLParameters(pika_url(url)).virtual_host == Connection(url).virtual_host
    assert pika_url(f"{url};{url}") == f"{pika_url(url)};{pika_url(url)}"  # Dramatiq's list of hosts


def test_a_dramatiq_broker_on_kombus_default_vhost_url_connects() -> None:
    """``amqp://...//``, as the Celery settings write RabbitMQ's default virtual host: before,
    pika read an empty virtual host there and never connected (NOT_ALLOWED)."""
    require("RabbitMQ", "127.0.0.1", 5672)
    pytest.importorskip("dramatiq")
    assert AMQP_URL.endswith("//"), AMQP_URL
    broker = make_broker(AMQP_URL, "unused", middleware=[])
    queue = f"outbox-test-{uuid.uuid4().hex[:10]}"
    try:
        broker.declare_queue(queue)
        assert broker.get_queue_message_counts(queue)[0] == 0
    finally:
        for suffix in ("", ".DQ", ".XQ"):  # the message counts declared Dramatiq's two companions
            broker.channel.queue_delete(f"{queue}{suffix}")
        broker.close()


def test_dramatiqs_dead_letters_are_kept_seven_days_as_documented() -> None:
    """docs/dramatiq.md, "Dead-lettered messages": the relay's brokers keep a queue's dead
    letters (``<queue>.XQ``) 7 days. On RabbitMQ the figure is the ``.XQ`` queue's
    ``x-message-ttl`` argument: declaring the queue again with it is accepted, with another
    value refused (PRECONDITION_FAILED), as the docs say of a changed value."""
    import pika.exceptions

    seven_days_ms = 7 * 24 * 3600 * 1000
    redis_broker = make_broker(REDIS_URL, "unused", middleware=[])  # no connection made
    assert redis_broker.dead_message_ttl == seven_days_ms
    require("RabbitMQ", "127.0.0.1", 5672)
    broker = make_broker(AMQP_URL, "unused", middleware=[])
    queue = f"outbox-test-{uuid.uuid4().hex[:10]}"
    try:
        broker.declare_queue(queue)
        assert broker.get_queue_message_counts(queue) == (0, 0, 0)  # declares the .DQ and .XQ queues
        channel = broker.channel
        channel.queue_declare(queue=f"{queue}.XQ", durable=True, arguments={"x-message-ttl": seven_days_ms})
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.queue_declare(queue=f"{queue}.XQ", durable=True, arguments={"x-message-ttl": 1000})
        assert refused.value.reply_code == 406 and "x-message-ttl" in refused.value.reply_text
    finally:
        broker.close()
        cleanup = make_broker(AMQP_URL, "unused", middleware=[])
        try:
            for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                cleanup.channel.queue_delete(name)
        finally:
            cleanup.close()


@pytest.mark.parametrize("url, words", [("rdis://h:6379/0", "did you mean 'redis'"),
                                         ("sqs://h", "Dramatiq has no broker for 'sqs'"),
                                         ("localhost:6379", "is not a broker URL")])
def test_a_bad_dramatiq_url_names_the_setting(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_dramatiq_broker_url(url)
    assert "OUTBOX_DRAMATIQ_BROKER_URL" in str(info.value) and words in str(info.value)


def test_a_bad_namespace_names_the_setting() -> None:
    assert validate_dramatiq_namespace("outbox-test:1") == "outbox-test:1"
    with pytest.raises(ConfigError, match="OUTBOX_DRAMATIQ_NAMESPACE"):
        validate_dramatiq_namespace("has space")


def test_dramatiq_is_the_runner_only_when_its_broker_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not configured() and dramatiq_settings() is None
    with pytest.raises(ConfigError, match="OUTBOX_DRAMATIQ_BROKER_URL is not set"):
        dramatiq_settings(required=True)
    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", "redis://127.0.0.1:6379/0")
    found = dramatiq_settings()
    assert configured() and found is not None
    assert (found.broker_url, found.namespace) == ("redis://127.0.0.1:6379/0", "dramatiq")
    monkeypatch.setenv("OUTBOX_DRAMATIQ_NAMESPACE", "bad space")
    with pytest.raises(ConfigError, match="OUTBOX_DRAMATIQ_NAMESPACE"):
        dramatiq_settings()


def test_a_message_expires_after_its_max_age_and_never_within_the_clock_skew_margin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a tick expired one interval (1 s) after beat sent it, by beat's clock,
    and a worker checked that on its own: a worker whose clock ran a second ahead dropped
    every tick, silently. Now no claim message expires sooner than CLOCK_SKEW_MARGIN_S."""
    m = message(CLAIM_TASK, "ns.claim", {"token": "t"}, max_age_s=0.2)
    assert (m.actor_name, m.queue_name, m.kwargs["token"]) == (CLAIM_TASK, "ns.claim", "t")
    sent = time.time()
    monkeypatch.setattr(time, "time", lambda: sent + 5.0)  # a worker whose clock runs 5 s ahead
    assert not expired(m.kwargs["expires_at"])
    monkeypatch.setattr(time, "time", lambda: sent + CLOCK_SKEW_MARGIN_S + 1)
    assert expired(m.kwargs["expires_at"]) and not expired(None)
    long_ = message(CLAIM_TASK, "ns.claim", {}, max_age_s=3600.0)  # a longer max age is kept as it is
    assert long_.kwargs["expires_at"] > sent + 3590


@pytest.mark.parametrize("env, words", [({}, "OUTBOX_DRAMATIQ_BROKER_URL is not set"),
                                         ({"OUTBOX_DRAMATIQ_BROKER_URL": "rdis://h"}, "did you mean 'redis'")])
def test_the_worker_and_scheduler_refuse_a_bad_configuration(tmp_path: Path, env: dict[str, str],
                                                             words: str) -> None:
    base = {"PATH": str(BIN), "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", **env}
    worker = subprocess.run([str(BIN / "dramatiq"), "outbox.dramatiq", "-p", "1", "-t", "1"], env=base,
                            capture_output=True, text=True, timeout=60)
    assert worker.returncode != 0 and words in worker.stdout + worker.stderr, worker.stderr[-2000:]
    scheduler = subprocess.run([str(BIN / "outbox-dramatiq-scheduler")], env=base, capture_output=True, text=True,
                               timeout=60)
    assert scheduler.returncode == 2 and words in scheduler.stderr


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_sigterm_to_the_worker_processes_and_their_main_process_is_one_warm_shutdown(
        tmp_path: Path, stop: signal.Signals) -> None:
    """systemd's default KillMode (control-group), `kill -- -PGID` and supervisord's stopasgroup
    send SIGTERM to every process of the worker; the main process then sends each worker process
    its own, which Dramatiq took for a second SIGTERM, "kill now": `Killing worker process...`,
    the messages in hand abandoned and their rows left to the takeover with an attempt counted
    (found in review). A repeat within ``REPEATED_SIGTERM_S`` of the first is now the same stop.
    So is a SIGHUP, Dramatiq's reload, sent to the group (a terminal that hangs up, `kill -HUP
    -- -PGID`): it was a kill too, and a reload mid-drain sent 101 of 800 events twice with an
    attempt counted (found in review). The reload then starts new worker processes, stopped here."""
    require("Redis", "127.0.0.1", 6379)
    import redis

    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    env = {"PATH": str(BIN), "OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL,
           "OUTBOX_DRAMATIQ_NAMESPACE": ns}
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as out:
        worker = subprocess.Popen([str(BIN / "dramatiq"), "outbox.dramatiq", "-p", "2", "-t", "1"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: log_path.read_text().count("Worker process is ready for action") == 2, 60), (
            log_path.read_text()[-3000:])
        children = subprocess.run(["pgrep", "-P", str(worker.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children
        for child in children:  # the order of a control-group kill: every process, then the main one re-sends
            os.kill(int(child), stop)
        time.sleep(0.05)
        os.kill(worker.pid, stop)
        if stop == signal.SIGHUP:  # a reload: the main process starts new worker processes
            assert wait_until(lambda: log_path.read_text().count("Worker process is ready for action") == 4, 60), (
                log_path.read_text()[-3000:])
            os.kill(worker.pid, signal.SIGTERM)
        returncode = worker.wait(timeout=60)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{ns}*"):
            client.delete(key)
    text = log_path.read_text()
    assert "Killing worker process" not in text and returncode == 0, text[-3000:]
    assert text.count("Worker has been shut down") == (4 if stop == signal.SIGHUP else 2), text[-3000:]


def _worker_log_until_ready(tmp_path: Path, runs: dict[str, list[str]], ready: str = "Worker process is ready",
                            extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Start ``dramatiq <argv>`` for each run at once (SQLite, the test's Redis namespace), wait
    until each logged ``ready``, stop them, and return each run's log."""
    require("Redis", "127.0.0.1", 6379)
    import redis

    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    env = {"PATH": str(BIN), "OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL,
           "OUTBOX_DRAMATIQ_NAMESPACE": ns, **(extra_env or {})}
    workers = {}
    for name, argv in runs.items():
        with (tmp_path / f"{name}.log").open("w") as out:
            workers[name] = subprocess.Popen([str(BIN / "dramatiq"), *argv, "-p", "1", "-t", "1"], env=env,
                                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for name in runs:
            assert wait_until(lambda name=name: ready in (tmp_path / f"{name}.log").read_text(), 60), (
                (tmp_path / f"{name}.log").read_text()[-3000:])
    finally:
        for worker in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGTERM)
        for worker in workers.values():
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{ns}*"):
            client.delete(key)
    return {name: (tmp_path / f"{name}.log").read_text() for name in runs}


def test_a_dramatiq_worker_whose_queues_are_none_of_its_outboxs_says_it_relays_nothing(tmp_path: Path) -> None:
    """``--queues outbox.publish`` (the fixed names before namespaces: README, "Upgrade note", or
    the actors' names) made a worker that consumed nothing, without a word (found in review);
    the Celery worker says so for ``-Q`` (test_namespaces.py). Its own queues: nothing to say."""
    queues = Queues(default_namespace(f"sqlite:///{tmp_path / 'o.db'}", "outbox"))
    logs = _worker_log_until_ready(tmp_path, {"foreign": ["outbox.dramatiq", "--queues", "outbox.publish"],
                                              "own": ["outbox.dramatiq", "--queues", queues.publish]})
    assert "this worker consumes outbox.publish, none of outbox" in logs["foreign"], logs["foreign"][-3000:]
    assert "OUTBOX_NAMESPACE=outbox" in logs["foreign"]
    assert "none of outbox" not in logs["own"], logs["own"][-3000:]


def test_the_relays_actors_named_after_another_brokers_module_refuse_to_start(tmp_path: Path) -> None:
    """``dramatiq myapp outbox.dramatiq``: the worker consumes the broker of its first argument,
    the user's, and the relay's actors were declared on their own broker, which nobody consumed:
    a worker that relayed nothing without a word, whose stop was a kill (found in review). Now its
    worker process stops at start with one line, and the command with it."""
    require("Redis", "127.0.0.1", 6379)
    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    (tmp_path / "myapp.py").write_text(
        "import dramatiq\nfrom dramatiq.brokers.redis import RedisBroker\n"
        f"dramatiq.set_broker(RedisBroker(url={REDIS_URL!r}, namespace={ns + '-app'!r}))\n")
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    env = {"PATH": str(BIN), "OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL,
           "OUTBOX_DRAMATIQ_NAMESPACE": ns, "PYTHONPATH": str(tmp_path)}
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as out:
        worker = subprocess.Popen([str(BIN / "dramatiq"), "myapp", "outbox.dramatiq", "-p", "1", "-t", "1"], env=env,
                                  cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = worker.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    text = log_path.read_text()
    assert returncode != 0 and "this worker's broker is myapp, which would relay nothing" in text, text[-3000:]


# -- the post-commit wake sends a Dramatiq message ------------------------------------------------

@pytest.fixture
def redis_namespace(monkeypatch: pytest.MonkeyPatch) -> Any:
    require("Redis", "127.0.0.1", 6379)
    import redis

    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", REDIS_URL)
    monkeypatch.setenv("OUTBOX_DRAMATIQ_NAMESPACE", ns)
    wake._reset_for_tests()
    client = redis.Redis.from_url(REDIS_URL)
    yield ns, client
    wake._reset_for_tests()
    for key in client.scan_iter(match=f"{ns}*"):
        client.delete(key)
    client.delete(token_for(REDIS_URL, ns, relay_settings().outbox_namespace))


def test_a_commit_wakes_the_relay_with_one_dramatiq_claim_message(tmp_path: Path, redis_namespace: Any) -> None:
    ns, client = redis_namespace
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url, table="outbox_wake")
    store.migrate()
    conn = sqlite3.connect(tmp_path / "o.db")
    for n in range(3):  # a burst of commits: one claim message, holding the claim-request token
        with outbox.transaction(conn):
            outbox.enqueue(conn, topic="t.x", aggregate_type="a", aggregate_id="1", payload={"n": n},
                           table="outbox_wake")
        wake.flush()
    settings = relay_settings()  # the outbox this process writes to: its queue, named in the message
    claim_queue = settings.queues.claim
    assert client.llen(f"{ns}:{claim_queue}") == 1
    [encoded] = client.hvals(f"{ns}:{claim_queue}.msgs")
    sent = json.loads(encoded)
    assert sent["actor_name"] == CLAIM_TASK and sent["queue_name"] == claim_queue
    assert sent["kwargs"]["requested"] is True and sent["kwargs"]["outbox"] == settings.outbox_namespace
    assert sent["kwargs"]["expires_at"] > time.time()
    token = token_for(REDIS_URL, ns, settings.outbox_namespace)
    assert client.exists(token)  # the one token, which the worker's claim clears as it starts
    client.delete(token)
    with outbox.transaction(conn):
        outbox.enqueue(conn, topic="t.x", aggregate_type="a", aggregate_id="1", payload={}, table="outbox_wake")
    wake.flush()
    assert client.llen(f"{ns}:{claim_queue}") == 2
    # A rolled-back transaction wakes nobody.
    with pytest.raises(RuntimeError), outbox.transaction(conn):
        client.delete(token)
        raise RuntimeError("rolled back")
    wake.flush()
    assert client.llen(f"{ns}:{claim_queue}") == 2
    conn.close()
    store.close()


@pytest.mark.parametrize("url", ["amqp://guest:guest@127.0.0.1:5672//",
                                 "amqp://guest:guest@127.0.0.1:5672//;amqp://guest:guest@127.0.0.2:5672//"])
def test_the_sending_broker_gives_up_on_a_rabbitmq_connection_it_blocks(monkeypatch: pytest.MonkeyPatch,
                                                                         url: str) -> None:
    """A RabbitMQ memory or disk alarm blocks every connection that publishes. The scheduler's
    ticks and the writers' wakes (``brokers.sender``) waited on it for the whole alarm, without a
    word: 30 s of alarm, no claim tick, no line in any log, and the scheduler's lock connection,
    not serviced meanwhile, dropped by RabbitMQ (found in review, a private RabbitMQ node with
    ``set_vm_memory_high_watermark``). pika now gives a blocked connection up after
    ``RABBITMQ_BLOCKED_S``: the send fails and the scheduler's outage line says so."""
    from outbox.dramatiq import brokers

    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", url)
    brokers._senders.clear()
    try:
        parameters = brokers._parameters(brokers.sender())
        assert len(parameters) == url.count(";") + 1
        assert all(p.blocked_connection_timeout is not None and 0 < p.blocked_connection_timeout <= 5
                   for p in parameters), [p.blocked_connection_timeout for p in parameters]
    finally:
        brokers._senders.clear()


def test_throttled_wakes_on_a_rabbitmq_dramatiq_broker_keep_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A web process committing ~100 times a second on a RabbitMQ Dramatiq broker: its wakes are
    throttled (one claim per window, one more at its end), and Dramatiq's RabbitmqBroker keeps one
    connection per thread that sends until it is closed. The trailing claim went from a new
    ``threading.Timer`` thread each time, so every throttled window left a connection (and its
    socket) behind: ~40 in 2 s here, 99 in 5 s in review. It now goes from the wake thread, the
    one that sends every other claim, and it still follows the last request."""
    require("RabbitMQ", "127.0.0.1", 5672)
    from outbox.dramatiq import brokers

    namespace = f"outbox-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", AMQP_URL)
    monkeypatch.setenv("OUTBOX_NAMESPACE", namespace)
    wake._reset_for_tests()
    sender = brokers.sender()
    claim_queue = relay_settings().queues.claim
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert wake.request_claim()
            time.sleep(0.01)
        assert wake.flush(5.0)
        assert len(sender.connections) <= 2, f"{len(sender.connections)} connections held"
        sent = brokers.queue_length(sender, claim_queue)
        assert sent is not None and 20 <= sent <= 45, sent  # one per 50 ms window, not one per commit
        wake.request_claim()  # a lone request a quiet window later: sent at once, by the same thread
        assert wake.flush(5.0) and brokers.queue_length(sender, claim_queue) == sent + 1
        assert len(sender.connections) <= 2
    finally:
        wake._reset_for_tests()
        channel = sender.channel
        for suffix in ("", ".DQ", ".XQ"):
            channel.queue_delete(queue=f"{claim_queue}{suffix}")
        sender.close()
        brokers._senders.clear()


_WRITER = """
import json, os, sys, time
from outbox import wake
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and not os.path.exists(sys.argv[2]):  # ~100 commits a second, each a wake
    wake.request_claim()
    time.sleep(0.01)
print(json.dumps({"flushed": wake.flush(10.0)}))
"""


def test_a_burst_of_writers_on_a_rabbitmq_dramatiq_broker_queues_a_bounded_number_of_claims(tmp_path: Path) -> None:
    """Writers' wakes on a RabbitMQ Dramatiq broker were throttled per process only (Redis holds
    one claim request per outbox, its token): eight writer processes committing for 3 s with no
    worker taking the claim queue put ~500 claim messages in it, each a claim query once workers
    come back, and Dramatiq's messages carry no broker-side TTL. A writer now sends no claim while
    the queue holds ``MAX_QUEUED_CLAIMS`` (100), as the scheduler does with its ticks
    (``relay.shared.ClaimQueueGuard``), and says so once. The real RabbitMQ, real writer processes."""
    require("RabbitMQ", "127.0.0.1", 5672)
    from outbox.dramatiq import brokers
    from outbox.dramatiq.waker import MAX_QUEUED_CLAIMS

    namespace = f"outbox-test-{uuid.uuid4().hex[:10]}"
    claim_queue = f"{namespace}.claim"
    writers = 8
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(OUTBOX_DRAMATIQ_BROKER_URL=AMQP_URL, OUTBOX_NAMESPACE=namespace,
               OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    stop = tmp_path / "stop"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, "30.0", str(stop)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(writers)]
    sender = brokers.make_broker(AMQP_URL, "dramatiq", middleware=[])
    try:
        # The writers run until the queue has reached the cap and 2 s more (at most 30 s: a
        # loaded machine starts them slowly), so the cap, not the writers' pace, bounds it.
        reached = time.monotonic() + 30.0
        while time.monotonic() < reached and (brokers.queue_length(sender, claim_queue) or 0) < MAX_QUEUED_CLAIMS:
            time.sleep(0.1)
        time.sleep(2.0)
        stop.touch()
        outs = [proc.communicate(timeout=60) for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
        assert all(json.loads(out.splitlines()[-1])["flushed"] for out, _ in outs), outs
        queued = brokers.queue_length(sender, claim_queue)
        # Each writer reads the length before its send: at most one send each past the cap.
        assert queued is not None and MAX_QUEUED_CLAIMS <= queued < MAX_QUEUED_CLAIMS + writers, queued
        told = [line for _, err in outs for line in err.splitlines() if f"{claim_queue} holds" in line]
        assert 1 <= len(told) <= writers, told  # once per writer at most (Python's last-resort handler)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        channel = sender.channel
        for suffix in ("", ".DQ", ".XQ"):
            channel.queue_delete(queue=f"{claim_queue}{suffix}")
        sender.close()


# -- the claim actor's drain slice -----------------------------------------------------------------

_DRAIN = """
import json, os, sqlite3
import outbox.dramatiq as d
from outbox import enqueue
from outbox.dramatiq.brokers import queue_length
from relay_support import ScriptedPublisher
r = d.resources()
r.store.migrate()
r.publisher = ScriptedPublisher()
conn = sqlite3.connect(os.environ["DB_PATH"])
ids = [enqueue(conn, topic="t.x", aggregate_type="a", aggregate_id="1", payload={"n": n}) for n in range(7)]
conn.commit()
d.claim()
sent = r.publisher.sent
print(json.dumps({"ids": ids, "sent": [m.id for m in sent], "claims": len({m.lease for m in sent}),
                  "publish": queue_length(d.broker, d.QUEUES.publish),
                  "claim": queue_length(d.broker, d.QUEUES.claim)}))
"""


def test_a_dramatiq_claim_publishes_its_share_here_and_claims_again_within_its_slice(
        tmp_path: Path, redis_namespace: Any) -> None:
    """The claim actor runs the Celery task's drain slice (``relay.drain_slice``): a backlog
    of one aggregate, batch 2, is drained by one claim message, four claims each publishing
    its batch itself, in order, with no publish message and one coalesced claim request."""
    from relay_support import run_python

    ns, client = redis_namespace
    tests = str(Path(__file__).resolve().parent)
    done = run_python(_DRAIN, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}", OUTBOX_BATCH_SIZE="2",
                      OUTBOX_DRAMATIQ_BROKER_URL=REDIS_URL, OUTBOX_DRAMATIQ_NAMESPACE=ns, DB_PATH=str(tmp_path / "o.db"),
                      PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["sent"] == out["ids"] and out["claims"] == 4
    assert out["publish"] == 0 and out["claim"] == 1


# -- the ack queue through a database outage ----------------------------------------------------

_ACK_OUTAGE = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
import dramatiq
import outbox.dramatiq as d
worker = dramatiq.Worker(d.broker, worker_threads=1, worker_timeout=100)
worker.start()
d.ack.send(ids=[1, 2, 3], lease="f" * 32)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 6.0)
worker.stop(timeout=5000)
"""


def test_an_ack_retried_through_a_database_outage_is_the_outages_not_an_error_per_try(
        tmp_path: Path, redis_namespace: Any) -> None:
    """Found by ``bench.soak --faults --runner dramatiq``: a done mark that a publish could not
    make goes to the ack queue (``outbox.ack``), and while the database is still away every
    try of it failed, and Dramatiq logged each as "Failed to process message outbox.ack(...)
    with unhandled exception." at ERROR with a 70-line traceback (three per ack in a 5 s
    database cut; one every back-off, up to 10 a message, in a longer outage), while the
    outage itself is told once (docs/relay.md, "Outages in the log"). Now a settle actor that
    fails counts towards the database outage (its WARNING once, then DEBUG) and asks Dramatiq
    for the retry (``dramatiq.Retry``), which it does not log as an error."""
    from relay_support import run_python

    ns, _client = redis_namespace
    port = free_port()  # nothing listens there: the database refuses every connection
    done = run_python(_ACK_OUTAGE, tmp_path, OUTBOX_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/test",
                      OUTBOX_DRAMATIQ_BROKER_URL=REDIS_URL, OUTBOX_DRAMATIQ_NAMESPACE=ns)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("Retrying message") >= 2, out[-3000:]  # the ack was tried, and retried, during the outage
    assert "Failed to process message" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count("outbox: database unreachable") == 1, out[-3000:]


# -- the scheduler's leader lock -------------------------------------------------------------------

def _locks(kind: str, name: str) -> tuple[Any, Any]:
    if kind == "redis":
        require("Redis", "127.0.0.1", 6379)
        return RedisLock(REDIS_URL, name), RedisLock(REDIS_URL, name)
    require("RabbitMQ", "127.0.0.1", 5672)
    return RabbitLock(AMQP_URL, name), RabbitLock(AMQP_URL, name)


def test_schedulers_that_write_their_brokers_url_differently_take_one_lock() -> None:
    """The lock's name hashed the broker URL as written, password included: two schedulers of
    one outbox, one given a rotated password (or ``//`` against ``%2F``, a host name against
    its address, RabbitMQ's hosts in another order), took two locks and both ticked. The lock
    lives in the broker itself (a key of its Redis database, a queue of its virtual host), so
    its name is the outbox's alone: Dramatiq's key namespace on Redis (the queues' prefix) and
    the outbox namespace."""
    redis_urls = ["redis://:old@h:6379/0", "redis://:rotated@h:6379/0", "redis://user:pw@H:6379/0",
                  "rediss://:pw@h:6379/0?ssl_cert_reqs=none"]
    assert len({lock_name(url, "dramatiq", "outbox.t.1") for url in redis_urls}) == 1
    amqp_urls = ["amqp://u:old@h:5672//", "amqp://u:rotated@h:5672/%2F", "amqps://u:pw@h:5671//",
                 "amqp://u:pw@h1:5672//;amqp://u:pw@h2:5672//", "amqp://u:pw@h2:5672//;amqp://u:pw@h1:5672//"]
    # Dramatiq's key namespace is ignored by RabbitMQ: the queues, and so the lock, are the same.
    assert len({lock_name(url, ns, "outbox.t.1") for url in amqp_urls for ns in ("dramatiq", "other")}) == 1
    # Another outbox, or on Redis another key namespace (other queues): another lock.
    assert lock_name(redis_urls[0], "dramatiq", "outbox.t.2") != lock_name(redis_urls[0], "dramatiq", "outbox.t.1")
    assert lock_name(redis_urls[0], "other", "outbox.t.1") != lock_name(redis_urls[0], "dramatiq", "outbox.t.1")
    assert lock_name(amqp_urls[0], "dramatiq", "outbox.t.2") != lock_name(amqp_urls[0], "dramatiq", "outbox.t.1")


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_one_scheduler_holds_the_lock_and_a_standby_takes_over(kind: str) -> None:
    first, second = _locks(kind, f"test-{uuid.uuid4().hex[:10]}")
    try:
        assert first.hold() and not second.hold()
        assert first.hold() and not second.hold()  # renewed, still refused
        first.release()
        assert second.hold() and not first.hold()
    finally:
        first.release()
        second.release()


def test_a_dead_schedulers_redis_lock_expires() -> None:
    require("Redis", "127.0.0.1", 6379)
    name = f"test-{uuid.uuid4().hex[:10]}"
    gone, standby = RedisLock(REDIS_URL, name, ttl_s=0.5), RedisLock(REDIS_URL, name)
    try:
        assert gone.hold() and not standby.hold()
        time.sleep(0.7)  # the holder stopped renewing (crashed)
        assert standby.hold()
    finally:
        standby.release()
    assert LOCK_TTL_S > 1


@contextlib.contextmanager
def leading_scheduler(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``outbox-dramatiq-scheduler`` on Redis in a session of its own, once it leads: the process
    and its log; killed if still running at the end, its namespace's keys deleted."""
    require("Redis", "127.0.0.1", 6379)
    import redis

    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path / 'o.db'}"
    env = {"PATH": str(BIN), "OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL,
           "OUTBOX_DRAMATIQ_NAMESPACE": ns}
    log_path = tmp_path / "scheduler.log"
    with log_path.open("w") as out:
        scheduler = subprocess.Popen([str(BIN / "outbox-dramatiq-scheduler")], env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: "leading;" in log_path.read_text(), 30), log_path.read_text()
        yield scheduler, log_path
    finally:
        if scheduler.poll() is None:
            os.killpg(scheduler.pid, signal.SIGKILL)
            scheduler.wait()
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{ns}*"):
            client.delete(key)
        client.delete(f"outbox:scheduler:{lock_name(REDIS_URL, ns, default_namespace(url, 'outbox'))}:sent:{PURGE_TASK}")


def test_a_sighup_reloads_the_scheduler_which_hands_its_lock_to_itself(tmp_path: Path) -> None:
    """A SIGHUP (a terminal that hangs up, `kill -HUP -- -PGID` to reload the Dramatiq worker started
    beside it) killed the scheduler without a line, its lock kept until the TTL ran out: started
    again, it waited ~10 s for the lead, no tick sent (found in review). Now it reloads as Dramatiq's
    worker does: it releases the lock, starts again in the same process and leads at once."""
    with leading_scheduler(tmp_path) as (scheduler, log_path):
        scheduler.send_signal(signal.SIGHUP)
        # Well inside the lock's TTL: a lock left to expire would take all of it.
        assert wait_until(lambda: log_path.read_text().count("leading;") == 2 or scheduler.poll() is not None,
                          LOCK_TTL_S * 0.7), log_path.read_text()
        assert scheduler.poll() is None, log_path.read_text()
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=30) == 0


def test_sighups_in_a_burst_reload_the_scheduler_and_do_not_kill_it(tmp_path: Path) -> None:
    """A terminal that hangs up sends SIGHUP twice (the kernel to the foreground group, the shell
    to its jobs): the second, landing while the re-executed scheduler started and had no handler
    yet, killed it without a line, exit code 129 (found in review). SIGHUP is ignored across the
    re-execution until the handler is back."""
    with leading_scheduler(tmp_path) as (scheduler, log_path):
        for _ in range(10):  # one of them lands while the scheduler starts again
            scheduler.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        assert wait_until(lambda: log_path.read_text().endswith("every 3600 s\n") or scheduler.poll() is not None,
                          30), log_path.read_text()
        assert scheduler.poll() is None, log_path.read_text()
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=30) == 0


def test_a_sighup_after_a_stop_signal_does_not_turn_the_stop_into_a_reload(tmp_path: Path) -> None:
    """SIGTERM then SIGHUP (systemd's SendSIGHUP=yes sends both at a stop; Ctrl-C then a terminal
    that hangs up): the scheduler re-executed itself and ran on, a stop turned into a restart
    (found in review). A SIGHUP once a stop is under way is part of that stop."""
    with leading_scheduler(tmp_path) as (scheduler, log_path):
        scheduler.send_signal(signal.SIGTERM)
        scheduler.send_signal(signal.SIGHUP)
        # 0, or killed by the SIGHUP when this process was held up between the two sends long
        # enough for the scheduler to stop first (Python puts SIGHUP back to its default as it exits).
        assert scheduler.wait(timeout=30) in (0, -signal.SIGHUP), log_path.read_text()
        assert "stopped" in log_path.read_text() and "reloading" not in log_path.read_text()


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_two_schedulers_send_the_ticks_of_one(kind: str) -> None:
    """Two schedulers run side by side for 2.5 s with a 0.25 s claim tick: the ticks sent
    are those of one scheduler, not twice as many."""
    name = lock_name("url", "ns", f"outbox.t.{uuid.uuid4().hex[:8]}")
    locks = _locks(kind, name)
    sent: list[tuple[int, str]] = []
    stop = threading.Event()
    entries = [(CLAIM_TASK, "ns.claim", 0.25, 0.25, {"outbox": "ns"}), (PURGE_TASK, "ns.purge", 3600.0, 3600.0, {})]
    threads = [threading.Thread(target=run, args=(stop, entries, lock),
                                kwargs={"send": lambda actor, queue, kwargs, max_age_s, i=i: sent.append((i, actor))})
               for i, lock in enumerate(locks)]
    for t in threads:
        t.start()
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    _forget_schedule(kind, name)
    senders = {i for i, _ in sent}
    assert len(senders) == 1, sent
    assert 8 <= len(sent) <= 12 and {actor for _, actor in sent} == {CLAIM_TASK}, sent



def _flapping_lock(kind: str, name: str, every: int) -> Any:
    """A leader lock whose every ``every``-th check fails, as one Redis time-out does in
    ``RedisLock.hold`` (the key stays; the next check renews it) or a dropped connection in
    ``RabbitLock`` (the exclusive queue goes with it; the next check declares it again)."""
    base = RedisLock if kind == "redis" else RabbitLock

    class Flapping(base):  # type: ignore[valid-type,misc]
        checks = 0

        def hold(self) -> bool:
            self.checks += 1
            if self.checks % every:
                return bool(super().hold())
            if kind == "redis":
                self.held = False
            else:
                self.release()
            return False

    return Flapping(REDIS_URL if kind == "redis" else AMQP_URL, name)


def _forget_schedule(kind: str, name: str) -> None:
    """Delete what a scheduler's lock ``name`` leaves on the broker: its record of the entries sent."""
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"outbox:scheduler:{name}*"):
            client.delete(key)
        return
    from kombu import Connection

    with Connection(AMQP_URL) as conn:
        conn.default_channel.queue_delete(queue=f"outbox.scheduler.{name}.sent")


def _run_scheduler(lock: Any, entries: list[Any], seconds: float, sent: list[str]) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop, entries, lock),
                              kwargs={"send": lambda actor, queue, kwargs, max_age_s: sent.append(actor)})
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join(timeout=10)


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_a_scheduler_whose_lock_check_fails_now_and_then_still_purges(kind: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader whose lock check fails once in a while (one Redis time-out counts as losing the
    lead) gains it again a moment later. Each time, the purge was put off a whole interval from
    then: with a check failing every ~2 s and the hourly purge, no purge ever (review: one check
    in 20 failing, a 3 s purge interval, 0 purges in 12 s). The purge is now scheduled from when
    it was last sent, recorded beside the lock: here about one a second, as configured."""
    require("Redis", "127.0.0.1", 6379) if kind == "redis" else require("RabbitMQ", "127.0.0.1", 5672)
    monkeypatch.setattr("outbox.dramatiq.scheduler.LOCK_CHECK_S", 0.1)
    name = f"test-{uuid.uuid4().hex[:10]}"
    lock = _flapping_lock(kind, name, every=6)  # the lead lost every 0.6 s, taken again 0.1 s later
    entries = [(CLAIM_TASK, "ns.claim", 0.25, 0.25, {}), (PURGE_TASK, "ns.purge", 1.0, 1.0, {})]
    sent: list[str] = []
    try:
        _run_scheduler(lock, entries, 3.6, sent)
    finally:
        lock.release()
        _forget_schedule(kind, name)
    assert lock.checks >= 24 and sent.count(CLAIM_TASK) >= 8, (lock.checks, sent)
    assert 2 <= sent.count(PURGE_TASK) <= 4, sent  # on its interval: neither put off nor sent at every regain


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_schedulers_restarted_more_often_than_the_purge_interval_still_purge(kind: str) -> None:
    """Schedulers restarted (or handing over) more often than the purge interval: each new
    leader used to wait a whole interval before its first purge, so none was ever sent. It now
    reads when the purge was last sent (or first scheduled) from beside the lock, and sends it
    when that is an interval ago."""
    require("Redis", "127.0.0.1", 6379) if kind == "redis" else require("RabbitMQ", "127.0.0.1", 5672)
    name = f"test-{uuid.uuid4().hex[:10]}"
    entries = [(CLAIM_TASK, "ns.claim", 0.25, 0.25, {}), (PURGE_TASK, "ns.purge", 1.5, 1.5, {})]
    sent: list[str] = []
    try:
        for _ in range(4):  # four schedulers one after the other, 0.8 s each
            lock = _locks(kind, name)[0]
            _run_scheduler(lock, entries, 0.8, sent)
    finally:
        _forget_schedule(kind, name)
    assert sent.count(CLAIM_TASK) >= 8, sent
    assert 1 <= sent.count(PURGE_TASK) <= 2, sent


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_the_dramatiq_scheduler_stops_adding_claim_ticks_to_a_claim_queue_nobody_takes(
        kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No worker consumes the claim queue (workers stopped, only publish workers up): the
    scheduler's ticks piled up in Dramatiq's broker, which keeps them until a worker takes
    them (``expires_at`` is read by the actor), and after downtime every claim waited behind
    them (found in review: ~35 MB a day on Redis). No tick is sent while the queue holds
    ``MAX_QUEUED_CLAIMS`` (5 here), said once; once, too, when the queue takes ticks again.
    The real broker, real sends, ticks every 0.05 s."""
    from outbox.dramatiq import brokers

    require("Redis", "127.0.0.1", 6379) if kind == "redis" else require("RabbitMQ", "127.0.0.1", 5672)
    monkeypatch.setattr("outbox.dramatiq.scheduler.MAX_QUEUED_CLAIMS", 5)
    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", REDIS_URL if kind == "redis" else AMQP_URL)
    monkeypatch.setenv("OUTBOX_DRAMATIQ_NAMESPACE", ns)
    queue, name = f"{ns}.claim", f"test-{uuid.uuid4().hex[:10]}"
    lock = _locks(kind, name)[0]
    entries = [(CLAIM_TASK, queue, 0.05, 0.05, {"outbox": ns}), (PURGE_TASK, f"{ns}.purge", 3600.0, 3600.0, {})]
    stop = threading.Event()
    thread = threading.Thread(target=run, args=(stop, entries, lock))
    lengths: list[int | None] = []
    try:
        with caplog.at_level("INFO", logger="outbox.dramatiq.scheduler"):
            thread.start()
            time.sleep(2.0)  # about 40 ticks due
            lengths.append(brokers.queue_length(brokers.sender(), queue))
            brokers.sender().flush(queue)  # a worker takes them
            assert wait_until(lambda: (brokers.queue_length(brokers.sender(), queue) or 0) > 0, timeout=5)
            stop.set()
            thread.join(timeout=10)
    finally:
        stop.set()
        thread.join(timeout=10)
        lock.release()
        _forget_schedule(kind, name)
        sender = brokers.sender()
        if kind == "redis":
            for key in sender.client.scan_iter(match=f"{ns}*"):
                sender.client.delete(key)
        else:
            for q in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                sender.channel.queue_delete(q)
        sender.close()
        brokers._senders.clear()
    told = [r.getMessage() for r in caplog.records if queue in r.getMessage()]
    assert lengths == [5], (lengths, told)
    assert [r.levelname for r in caplog.records if queue in r.getMessage()] == ["WARNING", "INFO"], told
    assert f"{queue} holds 5 claim ticks" in told[0], told


def test_a_full_redis_is_an_outage_of_dramatiqs_broker_told_once(caplog: pytest.LogCaptureFixture) -> None:
    """A Redis that refuses writes (maxmemory reached with noeviction: `OOM ...`; a replica after
    a failover: `READONLY ...`) refused every fetch, ack and send with a ``ResponseError``, which
    Dramatiq's consumer logs at CRITICAL with a traceback, every 3 s per consumer (113 tracebacks,
    5,887 log lines, in a 20 s OOM with two worker processes); and the scheduler, whose lock
    renewal still worked while its sends failed, logged "unreachable" and "reachable again"
    every second (found in review, a private Redis with `CONFIG SET maxmemory 1`). Both errors
    are now the broker's outage: a connection error for Dramatiq (one outage line,
    ``consumer_log``), and a lock check that works does not end an outage its sends are in."""
    import redis

    require("Redis", "127.0.0.1", 6379)
    broker = make_broker(REDIS_URL, f"outbox-test-{uuid.uuid4().hex[:10]}", middleware=[])
    for reply in ("OOM command not allowed when used memory > 'maxmemory'.",
                  "READONLY You can't write against a read only replica."):
        with pytest.raises(redis.ConnectionError):  # the errors redis-py makes of those replies
            broker.client.eval(f"return redis.error_reply({json.dumps(reply)})", 0)

    name = f"test-{uuid.uuid4().hex[:10]}"
    lock = RedisLock(REDIS_URL, name)

    def full(actor: str, queue: str, kwargs: dict[str, Any], max_age_s: float) -> None:
        raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    stop = threading.Event()
    caplog.set_level(logging.INFO, logger="outbox.dramatiq.scheduler")
    thread = threading.Thread(target=run, args=(stop, [(CLAIM_TASK, "ns.claim", 0.5, 0.5, {})], lock),
                              kwargs={"send": full})
    try:
        thread.start()
        time.sleep(3.5)
    finally:
        stop.set()
        thread.join(timeout=10)
        _forget_schedule("redis", name)
    told = [r.getMessage() for r in caplog.records if "reachable" in r.getMessage()]
    assert len(told) == 1 and "unreachable" in told[0] and "OutOfMemoryError" in told[0], told


def test_dramatiqs_redis_broker_gives_up_on_a_redis_that_stops_answering_as_a_connection_error() -> None:
    """Dramatiq's Redis broker was built from the URL alone: no socket timeout or keepalive,
    so with redis-py before 8 a Redis that stops answering (a paused VM, a host gone without
    a reset, a black hole) held every send and consumer for good; with redis-py 8 (5 s) each
    consumer's fetch raised ``redis.TimeoutError``, which Dramatiq logs at CRITICAL with a
    traceback every 3 s per consumer, past the outage filter (found in review). The broker's
    pool now has bounds of its own, and a time-out is a connection error: the consumer
    raises ``ConnectionClosed`` (one outage line, ``consumer_log``), a send fails in bounded
    time, and both work again once Redis answers. Redis behind a proxy holding its replies."""
    import redis
    from dramatiq.errors import ConnectionClosed
    from relay_e2e_support import Proxy

    from outbox.dramatiq.brokers import REDIS_SOCKET_TIMEOUT_S

    require("Redis", "127.0.0.1", 6379)
    proxy = Proxy(("127.0.0.1", 6379))
    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    queue = f"{ns}.claim"
    broker = make_broker(proxy.url_for(REDIS_URL), ns, middleware=[])
    try:
        kwargs = broker.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == REDIS_SOCKET_TIMEOUT_S, kwargs
        assert kwargs["socket_keepalive"] is True, kwargs
        consumer = broker.consume(queue)
        assert next(consumer) is None  # nothing queued: Redis answers
        proxy.hold_replies()
        started = time.monotonic()
        with pytest.raises(ConnectionClosed):
            next(consumer)
        with pytest.raises(redis.ConnectionError):
            broker.enqueue(message(CLAIM_TASK, queue, {}))
        took = time.monotonic() - started
        assert took < 6 * REDIS_SOCKET_TIMEOUT_S, f"{took:.1f} s for a fetch and a send to a Redis that did not answer"
        proxy.release_replies()
        broker.enqueue(message(CLAIM_TASK, queue, {}))
        assert broker.client.llen(f"{ns}:{queue}") == 1
    finally:
        proxy.release_replies()
        for key in broker.client.scan_iter(match=f"{ns}*"):
            broker.client.delete(key)
        broker.close()
        proxy.close()


def private_redis(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server of the test's own on a free port (a failover turns it into a replica),
    and its port; the test is skipped without the machine's Redis or redis-server."""
    import shutil

    require("Redis", "127.0.0.1", 6379)
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    server = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return server, port


def test_after_a_redis_failover_the_broker_reconnects_instead_of_writing_to_the_old_primary_for_ever(
        tmp_path: Path) -> None:
    """A failover behind one address (a DNS name, a cloud endpoint, a proxy): the old primary is a
    replica now and answers every write ``READONLY``, the address leads to the new primary, and
    the connections already open stay on the old one. Found in review (7 December 2026): the
    broker raised READONLY as a connection error ("Its consumers reconnect every 3 s") but
    gave the connection back to its pool, so every send and fetch after it went to the old
    primary again, for as long as the process lived. A READONLY now drops the pool's
    connections: the next command connects again, to the new primary."""

    import redis
    from dramatiq.errors import ConnectionClosed
    from relay_e2e_support import Proxy
    from services import stop

    old, port = private_redis(tmp_path)
    proxy = Proxy(("127.0.0.1", port))
    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    queue = f"{ns}.claim"
    try:
        assert wait_until(lambda: _answers(port), timeout=15)
        broker = make_broker(REDIS_URL.replace(":6379/", f":{proxy.port}/", 1), ns, middleware=[])
        broker.enqueue(message(CLAIM_TASK, queue, {}))
        consumer = broker.consume(queue)
        # The failover: the old primary a replica (of a primary it cannot reach: read-only all
        # the same), the address leading to the new one (the machine's Redis) from now on.
        redis.Redis(port=port).replicaof("127.0.0.1", "1")
        proxy.target = ("127.0.0.1", 6379)
        with pytest.raises(ConnectionClosed):  # the outage, told once
            next(consumer)
        sent = []
        for _ in range(3):
            try:
                broker.enqueue(message(CLAIM_TASK, queue, {}))
                sent.append(True)
                break
            except redis.ConnectionError as exc:
                sent.append(str(exc))
                time.sleep(0.2)
        assert sent[-1] is True, sent
        assert redis.Redis.from_url(REDIS_URL).llen(f"{ns}:{queue}") == 1  # on the new primary
        assert next(broker.consume(queue)) is not None  # a consumer made again fetches from it too
    finally:
        for key in redis.Redis.from_url(REDIS_URL).scan_iter(match=f"{ns}*"):
            redis.Redis.from_url(REDIS_URL).delete(key)
        proxy.close()
        stop(old)


def test_after_a_redis_failover_the_schedulers_lock_is_taken_on_the_new_primary(tmp_path: Path) -> None:
    """The scheduler's leader lock has a Redis client of its own (``RedisLock``): after a failover
    behind one address its renewal met READONLY on the old primary at every check, for as long
    as the scheduler lived, so no tick was ever sent again (found in review, 7 December 2026,
    with the broker's case above). A READONLY now drops its connections: the next check takes
    the lock on the new primary."""
    import redis
    from relay_e2e_support import Proxy
    from services import stop

    old, port = private_redis(tmp_path)
    proxy = Proxy(("127.0.0.1", port))
    name = f"test-{uuid.uuid4().hex[:10]}"
    try:
        assert wait_until(lambda: _answers(port), timeout=15)
        lock = RedisLock(REDIS_URL.replace(":6379/", f":{proxy.port}/", 1), name)
        assert lock.hold()
        redis.Redis(port=port).replicaof("127.0.0.1", "1")
        proxy.target = ("127.0.0.1", 6379)
        held = [lock.hold() for _ in range(3)]
        assert held[-1] is True, held
        assert redis.Redis.from_url(REDIS_URL).get(lock.key) == lock.me.encode()
    finally:
        redis.Redis.from_url(REDIS_URL).delete(f"outbox:scheduler:{name}")
        proxy.close()
        stop(old)


def _answers(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except (redis.ConnectionError, OSError):
        return False


def test_the_relays_redis_broker_overrides_nothing_private_of_dramatiqs() -> None:
    """The time-out translation (previous test) overrode Dramatiq's private
    ``RedisBroker._dispatch`` (checked against Dramatiq 2.2.1): a Dramatiq that renamed or
    reshaped it would have dropped the translation without a word, and every consumer's time-out
    would have been a CRITICAL traceback again (found in review). It is now the Redis client's,
    given through RedisBroker's public ``client=`` (docs/dramatiq.md, "When Dramatiq's broker is
    away"): the broker's class overrides no private member of Dramatiq's."""
    from dramatiq.brokers.redis import RedisBroker

    broker = make_broker(REDIS_URL, f"outbox-test-{uuid.uuid4().hex[:10]}", middleware=[])  # no connection made
    ours = [cls for cls in type(broker).__mro__ if issubclass(cls, RedisBroker) and cls is not RedisBroker]
    private = sorted(name for cls in ours for name in vars(cls)
                     if name.startswith("_") and not name.endswith("__") and hasattr(RedisBroker, name))
    assert private == [], f"{type(broker).__name__} overrides Dramatiq's private {private}"


# -- the relay's metrics from a Dramatiq worker ---------------------------------------------------

from relay_e2e_support import relay_env, wait_until  # noqa: E402
from runners import DRAMATIQ  # noqa: E402


def test_a_dramatiq_worker_serves_the_relays_metrics(tmp_path: Path, destination: Any, sqlite_outbox: Any,
                                                      procs_factory: Any) -> None:
    """MetricsMiddleware: with OUTBOX_RELAY_METRICS_PORT the worker serves the same
    metrics as the Celery worker, counting what it relayed, and reads the gauges."""
    import urllib.request

    port = free_port()
    with sqlite_outbox.writer() as conn:
        ids = [sqlite_outbox.add(conn, "m", n) for n in range(5)]
        conn.commit()
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, DRAMATIQ, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_RELAY_METRICS_PORT=str(port), OUTBOX_RELAY_METRICS_ADDR="127.0.0.1"),
                          DRAMATIQ)
    procs.worker("w1", concurrency=1)
    procs.beat()
    assert destination.wait_for(lambda: set(ids) <= destination.arrived(), timeout=30, procs=procs), (
        procs.log("w1")[-3000:])

    def sample(name: str) -> float:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return -1.0
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[1]) if lines else -1.0

    def published() -> float:
        return sample("outbox_published_total")

    assert wait_until(lambda: published() == 5.0, timeout=15), (published(), procs.log("w1")[-3000:])
    # The gauges are read on their own schedule (every 5 s by default), not by claims.
    assert wait_until(lambda: sample("outbox_gauges_read_timestamp_seconds") > 0
                      and sample("outbox_backlog") == 0, timeout=15), procs.log("w1")[-3000:]
    assert "outbox metrics: serving" in procs.log("w1")
    procs.stop("w1")  # removes the metrics' directory, which a kill leaves


def test_a_dramatiq_worker_of_two_processes_serves_the_sum_over_both(tmp_path: Path, destination: Any,
                                                                      sqlite_outbox: Any, procs_factory: Any) -> None:
    """Found in review: with --processes 2 (Dramatiq's default is one per CPU) and no
    PROMETHEUS_MULTIPROC_DIR, the process that bound the port served its own counts only: 133
    of 200 events published. The worker's processes now share a directory of their parent's
    (docs/dramatiq.md, "Middleware"), and the serving one sums them all."""
    import urllib.request

    port = free_port()
    with sqlite_outbox.writer() as conn:
        ids = [sqlite_outbox.add(conn, f"m{n}", n) for n in range(60)]
        conn.commit()
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, DRAMATIQ, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                    OUTBOX_BATCH_SIZE="2", OUTBOX_RELAY_METRICS_PORT=str(port),
                                    OUTBOX_RELAY_METRICS_ADDR="127.0.0.1"), DRAMATIQ)
    worker = procs.worker("w1", concurrency=2)
    procs.beat()
    assert destination.wait_for(lambda: set(ids) <= destination.arrived(), timeout=60, procs=procs), (
        procs.log("w1")[-3000:])

    def published() -> float:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            return -1.0
        lines = [line for line in text.splitlines() if line.startswith("outbox_published_total ")]
        return float(lines[0].split()[1]) if lines else -1.0

    assert wait_until(lambda: published() == 60.0, timeout=15), (published(), procs.log("w1")[-3000:])
    assert wait_until(lambda: "another process serves" in procs.log("w1"), timeout=15)  # both ran, one serves
    [shared] = glob.glob(os.path.join(tempfile.gettempdir(), f"outbox-{os.getuid()}", f"metrics-{worker.pid}-*"))
    procs.stop("w1")
    assert not os.path.exists(shared)  # removed by the process that served it


def test_a_port_another_dramatiq_worker_holds_is_an_error_not_a_sibling_serving(
        tmp_path: Path, destination: Any, sqlite_outbox: Any, procs_factory: Any) -> None:
    """Found in review: a second Dramatiq worker of one host with the same
    OUTBOX_RELAY_METRICS_PORT said at INFO "port ... is taken; another process serves", as a
    process whose sibling serves does, while its counts were in no scrape. A process whose
    sibling serves finds that sibling's mark in their shared directory; without one, ERROR."""
    port = free_port()
    env = relay_env(tmp_path, destination, sqlite_outbox, DRAMATIQ, OUTBOX_CLAIM_INTERVAL_S="0.3",
                    OUTBOX_RELAY_METRICS_PORT=str(port), OUTBOX_RELAY_METRICS_ADDR="127.0.0.1")
    procs = procs_factory(env, DRAMATIQ)
    procs.worker("w1", concurrency=1)
    assert wait_until(lambda: "outbox metrics: serving" in procs.log("w1"), timeout=30), procs.log("w1")[-3000:]
    second = procs.worker("w2", concurrency=1)
    assert wait_until(lambda: "cannot serve" in procs.log("w2"), timeout=30), procs.log("w2")[-3000:]
    assert "in no scrape" in procs.log("w2") and "another process serves" not in procs.log("w2")
    [shared] = glob.glob(os.path.join(tempfile.gettempdir(), f"outbox-{os.getuid()}", f"metrics-{second.pid}-*"))
    procs.stop("w2")
    assert not os.path.exists(shared)  # no process of w2 served it: the last to stop removes it
    procs.stop("w1")


def test_no_wake_warning_when_dramatiq_is_the_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded default's warning (Celery's memory:// broker reaches no worker) is not
    given when wakes go to Dramatiq's broker."""
    from outbox.contrib.startup import wake_problem

    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"sqlite:///{tmp_path / 'o.db'}")
    assert wake_problem() is not None and "memory://" in wake_problem()
    monkeypatch.setenv("OUTBOX_DRAMATIQ_BROKER_URL", "redis://127.0.0.1:6379/0")
    assert wake_problem() is None


@pytest.fixture
def python_313_logging() -> Iterator[None]:
    """Python 3.13's logging (no line logged while a record is handled), on the Python this
    runs on: the filter's announcement was lost there (tests/log_support.py)."""
    with logging_as_in_python_313():
        yield


def consumer_outage_log(told: list[str], settle_s: float) -> tuple[Any, type[logging.Handler]]:
    """A ``ConsumerOutageFilter`` whose outage logs into ``told``, and the handler class that
    captures there too (``level message``)."""
    from outbox.dramatiq.consumer_log import ConsumerOutageFilter
    from outbox.relay.shared import Outage

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            told.append(f"{record.levelname} {record.getMessage()}")

    relay_log = logging.getLogger(f"test.outbox.{uuid.uuid4().hex}")
    relay_log.propagate, relay_log.level = False, logging.DEBUG
    relay_log.addHandler(Capture())
    outage = Outage("Dramatiq's broker", "amqp://host/", "They reconnect.", relay_log)
    return ConsumerOutageFilter(outage, settle_s=settle_s), Capture


@pytest.mark.usefixtures("python_313_logging")
def test_a_consumers_outage_is_told_once_and_a_dropped_ack_does_not_end_it() -> None:
    """Dramatiq's consumer log through an outage, as a RabbitMQ cut gives it (seen in CI, 28
    November): connection errors and an ack that waits for the broker (its WARNING prints
    the whole message) become one WARNING; the ack retried 5 s later "succeeds" without
    reaching the broker (RabbitMQ's consumer forgot the delivery tag), which had ended the
    outage a second before the broker was back; only an ack that is sent ends it."""
    told: list[str] = []
    consumers, Capture = consumer_outage_log(told, settle_s=0.0)
    handlers = [Capture(), Capture()]  # a process with two handlers (a console and a file, say)
    for handler in handlers:
        handler.addFilter(consumers)
    worker = logging.getLogger("dramatiq.worker.ConsumerThread(q.claim)")
    rabbit = logging.getLogger("dramatiq.brokers.rabbitmq._RabbitmqConsumer")
    for logger in (worker, rabbit):
        for handler in handlers:
            logger.addHandler(handler)
    try:
        worker.critical("Consumer encountered a connection error: %s", "Transport indicated EOF")
        worker.info("Restarting consumer in %0.2f seconds.", 3.0)
        worker.warning("Failed to post_process_message(%s) due to a connection error: %s\nThe operation will be "
                       "retried in %s seconds until the connection recovers.", "outbox.publish(chains=[{'p': 1}])",
                       "BlockingConnection wrong state", 5)
        rabbit.warning("Failed to ack message: not in known tags.")
        assert consumers.outage._failures == 2  # the error and the ack's retry, each once for both handlers
        consumers.back()  # Dramatiq reports the dropped ack
        assert consumers.outage.down
        consumers.back()  # an ack that was sent
        assert not consumers.outage.down
        worker.warning("Something else")
    finally:
        for logger in (worker, rabbit):
            for handler in handlers:
                logger.removeHandler(handler)
    warnings = [line for line in told if line.startswith("WARNING")]
    # The consumer's record became the outage's announcement, which each of the process's
    # handlers shows once, as it showed Dramatiq's line (rewritten, not logged again from the
    # filter: Python 3.13 drops a line logged while a record is handled); the other line too.
    assert len(warnings) == 4 and all("Dramatiq's broker unreachable" in w for w in warnings[:2]), told
    assert warnings[0] == warnings[1] and warnings[2:] == ["WARNING Something else"] * 2, told
    # Each failure counted once, not once per handler: the ack retry's, after the first, is
    # one DEBUG line in each handler.
    assert sum("still unreachable" in line for line in told) == 2, told
    assert sum("reachable again" in line for line in told) == 1, told
    assert not any("chains" in line or "Restarting" in line or "known tags" in line for line in told), told


@pytest.mark.usefixtures("python_313_logging")
def test_an_ack_within_the_consumers_restart_delay_does_not_end_their_outage() -> None:
    """On RabbitMQ an ack only queues a callback for its consumer's connection, so a worker
    thread "acks" on a connection that is cut and not yet noticed: in CI (5 December) a cut
    logged "unreachable", "reachable again after 0.0 s" and "unreachable" within a
    millisecond. No consumer is back before Dramatiq's restart delay: an ack that soon after
    the outage began leaves it on; one after it ends it, with one INFO line."""
    told: list[str] = []
    consumers, Capture = consumer_outage_log(told, settle_s=0.3)
    worker = logging.getLogger("dramatiq.worker.ConsumerThread(q.publish)")
    handler = Capture()
    handler.addFilter(consumers)
    worker.addHandler(handler)
    try:
        worker.critical("Consumer encountered a connection error: %s", "Transport indicated EOF")
        consumers.back()  # a worker thread's ack on a connection not yet seen cut
        assert consumers.outage.down
        worker.critical("Consumer encountered a connection error: %s", "Transport indicated EOF")  # another consumer
        time.sleep(0.35)
        consumers.back()  # an ack after the restart delay: the broker answers
        assert not consumers.outage.down
    finally:
        worker.removeHandler(handler)
    assert sum("Dramatiq's broker unreachable" in line for line in told) == 1, told
    assert [line for line in told if "reachable again" in line and line.startswith("INFO")], told
    assert not any(line.startswith("CRITICAL") for line in told), told
