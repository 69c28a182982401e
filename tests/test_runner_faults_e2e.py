"""The task runners and the Kafka destination under faults, with real processes: Dramatiq's
scheduler while its broker (Redis or RabbitMQ, behind a proxy the test cuts) is unreachable
for a few seconds, and a Kafka topic that does not exist, met by every chain of a backlog at
once while another topic's events flow (Tansu, tests/kafka_support.py). What each must do:
recover by itself as soon as the fault ends, lose nothing, and say what is wrong in one line
(per pause), not one per tick or per chain.

Skipped when a service is not reachable, unless OUTBOX_REQUIRE_SERVICES is set."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from relay_e2e_support import (
    Outbox,
    Proxy,
    Writer,
    base_env,
    relay_env,
    relay_queue,
    wait_until,
)
from runners import RUNNERS
from services import AMQP_URL, REDIS_URL, require

from outbox import Status

BIN = Path(sys.executable).parent


# -- Dramatiq's scheduler while its broker is away ---------------------------------------------------

def _tick_counter(kind: str, env: dict[str, str]) -> tuple[Callable[[], int], Callable[[], None]]:
    """How many claim ticks wait in the claim queue of ``env``'s outbox on Dramatiq's broker
    (nobody consumes it), read directly (not through the proxy); and a clean-up."""
    from outbox.core.config import load_settings
    from outbox.dramatiq.scheduler import lock_name

    queue = relay_queue(env, "claim")
    # The scheduler's lock and record of when it last sent the purge (docs/dramatiq.md, "The scheduler").
    lock = lock_name(env["OUTBOX_DRAMATIQ_BROKER_URL"], env["OUTBOX_DRAMATIQ_NAMESPACE"],
                     load_settings(environ=env).outbox_namespace)
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        ns = env["OUTBOX_DRAMATIQ_NAMESPACE"]

        def clean_redis() -> None:
            for pattern in (f"{ns}*", f"outbox:scheduler:{lock}*"):  # the lock and record are not under ns
                for key in client.scan_iter(match=pattern):
                    client.delete(key)

        return lambda: int(client.hlen(f"{ns}:{queue}.msgs")), clean_redis
    from kombu import Connection

    conn = Connection(AMQP_URL, connect_timeout=5)

    def count() -> int:
        try:
            return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except Exception:
            conn.close()
            return 0

    record = f"outbox.scheduler.{lock}.sent"

    def clean_rabbit() -> None:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ", record):
            try:
                conn.default_channel.queue_delete(queue=name)
            except Exception:
                conn.close()
        conn.release()

    return count, clean_rabbit


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_the_dramatiq_scheduler_ticks_again_as_soon_as_its_broker_is_back_and_says_so_once(
        tmp_path: Path, kind: str) -> None:
    """``outbox-dramatiq-scheduler`` ticking every 0.2 s through a proxy to Dramatiq's broker,
    which the test cuts for 3 s (a broker restart, a network blip) while the scheduler leads.
    The first tick after the cut goes out within a couple of seconds of it: on Redis the
    leader renews its own lock key, still there, where before it waited for the key to
    expire (LOCK_TTL_S, 10 s) because SET NX refused it its own key. The log says once that
    the broker is unreachable and once that it is back: no line per tick or per lock check,
    no pika traceback per tick (before: about ten lines a second on RabbitMQ)."""
    require("Redis" if kind == "redis" else "RabbitMQ", "127.0.0.1", 6379 if kind == "redis" else 5672)
    proxy = Proxy(target=("127.0.0.1", 6379 if kind == "redis" else 5672))
    url = (REDIS_URL.replace(":6379/", f":{proxy.port}/") if kind == "redis"
           else f"amqp://guest:guest@127.0.0.1:{proxy.port}/")
    table = f"outbox_sched_{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env.update({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_TABLE": table,
                "OUTBOX_DRAMATIQ_BROKER_URL": url, "OUTBOX_DRAMATIQ_NAMESPACE": f"outbox-test-{uuid.uuid4().hex[:10]}",
                "OUTBOX_CLAIM_INTERVAL_S": "0.2", "PYTHONUNBUFFERED": "1"})
    ticks, clean = _tick_counter(kind, env)
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "wb") as out:
        scheduler = subprocess.Popen([str(BIN / "outbox-dramatiq-scheduler")], env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert wait_until(lambda: ticks() >= 5, timeout=20), log_path.read_text()
        proxy.cut()
        time.sleep(3.0)
        before = ticks()
        proxy.restore()
        restored = time.monotonic()
        assert wait_until(lambda: ticks() > before, timeout=15, interval=0.05), log_path.read_text()
        waited = time.monotonic() - restored
        assert waited < 3.0, f"the first tick went out {waited:.1f} s after the broker was back\n{log_path.read_text()}"
        time.sleep(1.0)  # ticking again: the outage's end is logged
        assert scheduler.poll() is None, log_path.read_text()
    finally:
        scheduler.terminate()
        scheduler.wait(10)
        proxy.close()
        clean()
    log = log_path.read_text()
    assert log.count("Dramatiq's broker unreachable") == 1, log
    assert log.count("Dramatiq's broker reachable again") == 1, log
    assert "cannot send" not in log and "cannot reach the lock" not in log, log
    assert "Traceback" not in log, log
    assert log.count("WARNING") <= 3, log  # the outage, the lead lost (Redis), the lock's connection (RabbitMQ)


def _log_time(line: str) -> float:
    """The time of a Celery log line (``[2026-11-28 19:47:52,438: INFO/...]``, local time)."""
    from datetime import datetime

    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_a_celery_worker_is_back_within_seconds_of_its_broker_and_says_so_once(
        tmp_path: Path, destination: Any, sqlite_outbox: Outbox, procs_factory: Any, kind: str) -> None:
    """A Celery worker whose broker (Redis or RabbitMQ, behind a proxy) is cut for 14 s
    connects again within about 2 s of the broker's return: kombu's reconnect backs off 2,
    4, 6 ... s up to 30 s, so it came back up to 30 s late (about 6 s late after this cut:
    attempts at 2, 6, 12, 20 s). The outage is one ERROR line from Celery (not one per
    attempt, and no notice of Celery 6's defaults) and one line when it ends (docs/relay.md, "Outages in the log")."""
    proxy = Proxy(target=("127.0.0.1", 6379 if kind == "redis" else 5672))
    try:
        url = proxy.url_for(REDIS_URL) if kind == "redis" else proxy.amqp_url
        env = relay_env(tmp_path, destination, sqlite_outbox, RUNNERS["celery"], OUTBOX_CLAIM_INTERVAL_S="0.5",
                        OUTBOX_CELERY_BROKER_URL=url)
        procs = procs_factory(env, RUNNERS["celery"])
        procs.worker("w1", concurrency=1)
        assert wait_until(lambda: " ready." in procs.log("w1"), timeout=60), procs.log("w1")[-3000:]
        proxy.cut()
        time.sleep(14.0)
        restored = time.time()
        proxy.restore()
        assert wait_until(lambda: "Connected to" in procs.log("w1").partition("broker reachable again")[2],
                          timeout=40), procs.log("w1")[-3000:]
        time.sleep(1.0)  # connected for good: nothing more is logged about the broker
        procs.check_alive()
        log = procs.log("w1")  # before the proxy closes under the worker (its own outage)
    finally:
        proxy.close()
    connected = [line for line in log.splitlines() if "Connected to" in line][-1]
    assert _log_time(connected) - restored < 4.0, f"connected {_log_time(connected) - restored:.1f} s late\n{log[-3000:]}"
    assert log.count("consumer: Cannot connect to") == 1, log[-4000:]
    assert log.count("broker reachable again") == 1, log[-3000:]
    # Nor Celery's notice on a setting the relay sets (outbox.celery.worker_logging.NoticeFilter).
    assert "worker_cancel_long_running_tasks_on_connection_loss" not in log, log[-4000:]


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_celery_beat_says_once_that_its_broker_is_away_and_ticks_again_when_it_is_back(
        tmp_path: Path, sqlite_outbox: Outbox, procs_factory: Any, kind: str) -> None:
    """``celery -A outbox beat`` ticking every 0.2 s through a proxy to Celery's broker, which
    the test cuts for 4 s. Beat says once that the broker is unreachable and once that it is
    back (``outbox.celery.beat.Scheduler``), the ticks it cannot send at DEBUG, where Celery's
    scheduler logged an ERROR with stack and traceback (170 to 250 lines) for every one; and
    its ticks go out again within seconds of the broker's return. Beat runs at DEBUG, where
    it logs each tick it sent (claim ticks expire on RabbitMQ, so its queue cannot count them)."""
    require("Redis" if kind == "redis" else "RabbitMQ", "127.0.0.1", 6379 if kind == "redis" else 5672)
    proxy = Proxy(target=("127.0.0.1", 6379 if kind == "redis" else 5672))
    try:
        env = relay_env(tmp_path, None, sqlite_outbox, RUNNERS["celery"], OUTBOX_PUBLISH_URL=AMQP_URL,
                        OUTBOX_CLAIM_INTERVAL_S="0.2",
                        OUTBOX_CELERY_BROKER_URL=proxy.url_for(REDIS_URL) if kind == "redis" else proxy.amqp_url)
        procs = procs_factory(env, RUNNERS["celery"])
        procs.start("beat", "beat", "--loglevel=DEBUG", "-s", str(tmp_path / "beat-schedule"))
        ticks = lambda: procs.log("beat").count("outbox.claim sent. id->")  # noqa: E731
        assert wait_until(lambda: ticks() >= 5, timeout=60), procs.log("beat")[-3000:]
        proxy.cut()
        time.sleep(4.0)
        before = ticks()
        proxy.restore()
        restored = time.monotonic()
        assert wait_until(lambda: ticks() > before, timeout=20, interval=0.05), procs.log("beat")[-3000:]
        waited = time.monotonic() - restored
        time.sleep(1.0)
        procs.check_alive()
        log = procs.log("beat")
    finally:
        proxy.close()
    assert waited < 5.0, f"the first tick went out {waited:.1f} s after the broker was back\n{log[-3000:]}"
    assert log.count("WARNING/MainProcess] outbox: Celery's broker unreachable") == 1, log[-5000:]
    assert log.count("INFO/MainProcess] outbox: Celery's broker reachable again") == 1, log[-5000:]
    assert "ERROR/" not in log and "Message Error" not in log, log[-5000:]
    assert log.count("outbox: Celery's broker still unreachable") >= 1, log[-5000:]  # the ticks of the cut


def drain_through_a_cut(procs: Any, outbox: Outbox, destination: Any, proxy: Proxy, *, workers: int,
                        after_s: float, arrive_s: float, done_s: float) -> None:
    """A backlog of 240 events over 8 aggregates, ``workers`` workers and the scheduler
    draining it, live writes while ``proxy`` is cut for 6 s (and ``after_s`` after it); then
    every committed event arrives within ``arrive_s``, in order per aggregate, and every row
    is done within ``done_s``."""
    from relay_e2e_support import check_order

    writer = Writer(outbox, [f"k-{i}" for i in range(8)], rollback_every=3, pace=0.02)
    writer.write(range(30))
    for n in range(1, workers + 1):
        procs.worker(f"w{n}")
    procs.beat()
    destination.wait_for(lambda: len(destination.messages) >= 40, timeout=30, procs=procs)
    with writer:
        proxy.cut()
        time.sleep(6.0)
        proxy.restore()
        time.sleep(after_s)
    total = len(writer.written)
    destination.wait_for(lambda: len(destination.arrived()) >= total, timeout=arrive_s, procs=procs)
    assert len(destination.arrived()) == total, f"{len(destination.arrived())} of {total}\n{procs.log('w1')[-3000:]}"
    check_order(destination.arrivals(), writer.expected)
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=done_s), (
        outbox.status_counts())


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_dramatiq_workers_ride_out_their_broker_going_away_mid_drain(
        tmp_path: Path, destination: Any, sqlite_outbox: Outbox, kind: str, procs_factory: Any) -> None:
    """A Dramatiq worker (two processes) and the scheduler drain a backlog with live writes
    while Dramatiq's broker, behind a proxy, is cut for 6 s: Redis (which also holds the
    relay's shared breaker and tokens), or RabbitMQ as Dramatiq's broker and the destination
    at once (one RabbitMQ restarting). Claims that cannot send their publish messages release
    the rows; the consumers reconnect by themselves. Every committed event arrives, in order
    per aggregate, and every row is done: nothing is left leased. Each worker process says
    once that the broker is away and once that it is back, where each consumer logged every
    reconnect at CRITICAL (docs/dramatiq.md, "When Dramatiq's broker is away")."""

    outbox = sqlite_outbox
    proxy = Proxy(target=("127.0.0.1", 6379 if kind == "redis" else 5672))
    env = relay_env(tmp_path, destination, outbox, RUNNERS["dramatiq"], OUTBOX_BATCH_SIZE="10",
                    OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="5000", OUTBOX_RELAY_TASK_ROWS="3",
                    OUTBOX_RELAY_BREAKER_S="1")
    if kind == "redis":
        env["OUTBOX_DRAMATIQ_BROKER_URL"] = REDIS_URL.replace(":6379/", f":{proxy.port}/")
    else:  # pika's URL: the default virtual host is "/" after the port, not kombu's "//"
        env["OUTBOX_DRAMATIQ_BROKER_URL"] = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        env["OUTBOX_PUBLISH_URL"] = proxy.amqp_url
    try:
        procs = procs_factory(env, RUNNERS["dramatiq"])
        drain_through_a_cut(procs, outbox, destination, proxy, workers=1, after_s=1.0, arrive_s=60, done_s=15)
        log = procs.log("w1")  # before the proxy closes under the workers
    finally:
        proxy.close()
    for noise in ("Consumer encountered a connection error", "Restarting consumer", "Failed to post_process_message",
                  "not in known tags"):
        assert noise not in log, log[-3000:]
    told = "\n".join(line for line in log.splitlines() if "Dramatiq's broker" in line or "dramatiq.worker" in line)
    assert 1 <= log.count("Dramatiq's broker unreachable") <= 2, told  # once per worker process
    assert log.count("Dramatiq's broker reachable again") == log.count("Dramatiq's broker unreachable"), told


def test_a_dramatiq_worker_says_once_that_its_redis_stopped_answering(
        tmp_path: Path, destination: Any, sqlite_outbox: Outbox, procs_factory: Any) -> None:
    """Dramatiq's Redis stops answering rather than refusing (a paused VM, a host gone without a
    reset) for 12 s while a worker and the scheduler run through a proxy that holds Redis's
    replies. Each consumer's fetch timed out with ``redis.TimeoutError``, which Dramatiq logged
    as an unexpected error at CRITICAL with a traceback, per consumer every 8 s, and the outage
    was never named (found in review). A time-out is now a connection error: one WARNING, one
    "reachable again" line once the ticks' claims are acked again, no CRITICAL line."""
    proxy = Proxy(target=("127.0.0.1", 6379))
    env = relay_env(tmp_path, destination, sqlite_outbox, RUNNERS["dramatiq"], OUTBOX_CLAIM_INTERVAL_S="0.3")
    env["OUTBOX_DRAMATIQ_BROKER_URL"] = REDIS_URL.replace(":6379/", f":{proxy.port}/")
    try:
        procs = procs_factory(env, RUNNERS["dramatiq"])
        procs.worker("w1", concurrency=2)
        procs.beat()
        time.sleep(6.0)  # the worker is up and takes the ticks
        proxy.hold_replies()
        time.sleep(12.0)
        proxy.release_replies()
        assert wait_until(lambda: 1 <= procs.log("w1").count("Dramatiq's broker reachable again")
                          == procs.log("w1").count("Dramatiq's broker unreachable"), timeout=30), (
            procs.log("w1")[-5000:])  # each worker process that said it was away says it is back
        procs.check_alive()
        log = procs.log("w1")
    finally:
        proxy.release_replies()
        proxy.close()
    told = "\n".join(line for line in log.splitlines() if "Dramatiq's broker" in line or "dramatiq.worker" in line)
    assert "CRITICAL" not in log and "Consumer encountered an unexpected error" not in log, log[-5000:]
    assert 1 <= log.count("Dramatiq's broker unreachable") <= 2, told  # once per worker process
    assert log.count("Dramatiq's broker reachable again") == log.count("Dramatiq's broker unreachable"), told


# -- a Kafka topic that does not exist ------------------------------------------------------------

@pytest.mark.parametrize("runner_name", sorted(RUNNERS))
def test_a_missing_kafka_topic_pauses_that_topic_alone_and_it_resumes_once_made(
        tmp_path: Path, sqlite_outbox: Outbox, tansu: Any, runner_name: str, procs_factory: Any) -> None:
    """A backlog over eight aggregates whose topic does not exist (OUTBOX_KAFKA_AUTO_CREATE_TOPICS
    off, the default) and four whose topic exists: the missing topic's route pauses (FATAL of
    that topic alone: an ERROR line per pause, not one per chain), nothing of it is sent, no
    attempt is spent, its rows stay pending; the other topic's events all arrive and are done
    meanwhile. Once the topic is made, with no restart, everything arrives in order. Before,
    the missing topic opened the breaker: claims stopped for 300 s for every topic, until a
    restart (docs/destinations.md, "Failures of one topic")."""
    from kafka_support import Reader, create_topic
    from relay_e2e_support import check_order

    outbox, runner, topic = sqlite_outbox, RUNNERS[runner_name], "orders.created"
    healthy = create_topic(tansu.bootstrap, "payments.made")
    writer = Writer(outbox, [f"k-{i}" for i in range(8)], topic=lambda _: topic)
    writer.write(range(5))
    others = Writer(outbox, [f"p-{i}" for i in range(4)], topic=lambda _: healthy)
    others.write(range(5))
    settings = {"OUTBOX_PUBLISH_URL": tansu.url, "OUTBOX_CLAIM_INTERVAL_S": "0.2", "OUTBOX_BATCH_SIZE": "20",
                "OUTBOX_RELAY_TASK_ROWS": "5", "OUTBOX_RELAY_ROUTE_PAUSE_MAX_S": "2"}
    procs = _start_kafka_relay(procs_factory, runner, tmp_path, outbox, "w1", concurrency=1, **settings)
    line = "FATAL publishing error: Kafka topic 'orders.created' does not exist"
    assert wait_until(lambda: line in procs.log("w1"), timeout=30), procs.log("w1")[-3000:]

    def statuses(ids: Any) -> set[int]:
        return {status for id_, status in outbox.statuses().items() if id_ in ids}

    assert wait_until(lambda: statuses(others.written) == {Status.DONE}, timeout=30), outbox.status_counts()
    assert statuses(writer.written) <= {Status.PENDING, Status.CLAIMED} and outbox.max_attempts() == 0
    log = procs.log("w1")
    assert "CRITICAL" not in log and "Claims stop" not in log, log[-3000:]

    create_topic(tansu.bootstrap, topic)
    reader = Reader(tansu.bootstrap, topic)
    reader.start()
    total = len(writer.written)
    assert wait_until(lambda: len({a[0] for a in reader.arrivals}) >= total, timeout=40), (
        f"{len(reader.arrivals)} of {total}\n{procs.log('w1')[-3000:]}")
    check_order(reader.stop(), writer.expected)
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), outbox.status_counts()
    assert outbox.max_attempts() == 0


# -- Kafka unreachable, at start-up or mid-drain ------------------------------------------------------

def _start_kafka_relay(procs_factory: Any, runner: Any, tmp_path: Path, outbox: Outbox, name: str = "w1",
                       concurrency: int = 2, **settings: str) -> Any:
    """Celery: one worker of two threads running the schedule itself on its in-memory broker;
    Dramatiq: a worker of ``concurrency`` processes and the scheduler, on Redis."""
    if runner.name == "celery":
        procs = procs_factory(base_env(outbox, **settings))
        procs.start(name, "worker", "--loglevel=INFO", "-c", "2", "--without-mingle", "--without-gossip",
                    "--without-heartbeat")
        return procs
    procs = procs_factory(relay_env(tmp_path, None, outbox, runner, **settings), runner)
    procs.worker(name, concurrency=concurrency)
    procs.beat()
    return procs


@contextmanager
def tansu_behind_a_proxy(tmp_path: Path, topic: str) -> Iterator[tuple[Any, Proxy, int]]:
    """Tansu on a free port with ``topic`` made, advertised to clients through a ``Proxy`` in
    front of it: (Tansu, the proxy, Tansu's own port). Both are stopped when the block ends."""
    from kafka_support import Tansu, create_topic, free_port, tansu_or_skip

    executable, port = tansu_or_skip(), free_port()
    proxy = Proxy(target=("127.0.0.1", port))
    tansu = Tansu(executable, port, tmp_path / "tansu.log", advertised_port=proxy.port)
    tansu.start()
    try:
        create_topic(f"127.0.0.1:{port}", topic)
        yield tansu, proxy, port
    finally:
        tansu.stop()
        proxy.close()


@pytest.mark.parametrize("when", ["at_start", "mid_drain"])
@pytest.mark.parametrize("runner_name", sorted(RUNNERS))
def test_kafka_unreachable_for_a_while_loses_nothing_keeps_order_and_says_so_once(
        tmp_path: Path, sqlite_outbox: Outbox, runner_name: str, when: str, procs_factory: Any) -> None:
    """Tansu behind a proxy the test cuts (every connection dropped, new ones
    accepted and closed at once: what a load balancer in front of a restarting broker does),
    either before the workers start or while they drain a backlog with live writes going on.
    The cut lasts until the relay has met it and 3 s more. Every committed event arrives once
    the proxy is back, per aggregate in commit order on
    one partition, every row is done, no attempt is spent (BACKPRESSURE: the breaker pauses
    the claims), and the log says it in one line for the outage and one when it ends. The
    client's own lines are throttled: librdkafka logs every dropped connection (at INFO,
    several a second, handed over in a burst at the next poll); before, a 5 s cut put about a
    hundred of them in the log, now one per producer."""
    from kafka_support import Reader, explain_missing
    from relay_e2e_support import check_order

    outbox, runner, topic = sqlite_outbox, RUNNERS[runner_name], "orders"
    with tansu_behind_a_proxy(tmp_path, topic) as (tansu, proxy, port):
        writer = Writer(outbox, [f"k-{i}" for i in range(8)], topic=lambda _: topic, pace=0.02)
        writer.write(range(30))
        if when == "at_start":
            proxy.cut()
        procs = _start_kafka_relay(procs_factory, runner, tmp_path, outbox, OUTBOX_PUBLISH_URL=tansu.url,
                                   OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_BATCH_SIZE="20", OUTBOX_RELAY_TASK_ROWS="5",
                                   OUTBOX_KAFKA_DELIVERY_TIMEOUT_S="2", OUTBOX_RELAY_BREAKER_S="1")
        reader = Reader(tansu.bootstrap, topic)
        if when == "mid_drain":
            reader.start()
            assert wait_until(lambda: len(reader.arrivals) >= 60, timeout=30), procs.log("w1")[-3000:]
        with writer:
            if when == "mid_drain":
                proxy.cut()
            assert wait_until(lambda: "destination broker unreachable" in procs.log("w1"), timeout=30), (
                procs.log("w1")[-3000:])
            time.sleep(3.0)  # claims paused, probing every second
            assert outbox.max_attempts() == 0
            proxy.restore()
            time.sleep(1.0)
        if when == "at_start":
            reader.start()
        total = len(writer.written)
        arrived = lambda: {a[0] for a in reader.arrivals}  # noqa: E731
        assert wait_until(lambda: len(arrived()) >= total, timeout=60), (
            f"{len(arrived())} of {total}, "
            f"{explain_missing(tansu.bootstrap, topic, sorted(set(writer.written) - arrived()), outbox.statuses(), reader, tansu)}\n"
            f"{procs.log('w1')[-3000:]}")
        arrivals = reader.stop()
        procs.check_alive()
    check_order(arrivals, writer.expected)
    partitions: dict[str, set[int]] = {}
    for _, aggregate, message in arrivals:
        partitions.setdefault(aggregate, set()).add(message.partition())
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), outbox.status_counts()
    assert outbox.max_attempts() == 0  # the outage spent no attempt
    log = procs.log("w1")
    # One line for the outage and one when it ends. A delivery report of an event produced
    # during the cut that times out just after the broker is back is the outage's leftover
    # (DEBUG: relay.shared.Outage.stale), but a worker process that never saw the outage
    # itself may still start a second, short one: at most once more.
    outages = log.count("destination broker unreachable")
    assert 1 <= outages <= 2, log[-5000:]
    assert log.count("destination broker reachable again") == outages, log[-5000:]
    client_lines = [line for line in log.splitlines() if "FAIL [rdkafka#producer" in line]
    assert len(client_lines) <= 10, "\n".join(client_lines[:40])


@pytest.mark.parametrize("runner_name", sorted(RUNNERS))
def test_a_kafka_broker_that_hangs_for_several_leases_spends_no_attempt(
        tmp_path: Path, sqlite_outbox: Outbox, runner_name: str, procs_factory: Any) -> None:
    """Tansu behind a proxy that, once events flow, keeps back everything Tansu sends (a
    broker that hangs: connections open, no answer) for 20 s, with a lease of 4 s and the
    default delivery timeout (15 s). A publish gives up within its part of the lease (3.2 s,
    ``KafkaPublisher.wait_s``), releases its rows with no attempt spent and opens the breaker.
    Before, it waited 20 s (the delivery timeout and a margin; a topic check as long again):
    its rows' lease ran out first and every claim took them again with an attempt spent, or
    Dramatiq's time limit (10 s) killed the claim mid-publish, so the hang sent events dead
    after OUTBOX_MAX_ATTEMPTS (3 here). Once the broker answers, every event arrives in order."""
    from kafka_support import Reader
    from relay_e2e_support import check_order

    outbox, runner, topic = sqlite_outbox, RUNNERS[runner_name], "orders"
    with tansu_behind_a_proxy(tmp_path, topic) as (tansu, proxy, port):
        writer = Writer(outbox, [f"k-{i}" for i in range(4)], topic=lambda _: topic)
        writer.write(range(5))
        procs = _start_kafka_relay(procs_factory, runner, tmp_path, outbox, OUTBOX_PUBLISH_URL=tansu.url,
                                   OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="4000",
                                   OUTBOX_MAX_ATTEMPTS="3", OUTBOX_RELAY_BREAKER_S="1")
        reader = Reader(f"127.0.0.1:{port}", topic)  # straight to Tansu: the reader is not held
        reader.start()
        assert wait_until(lambda: len(reader.arrivals) >= 20, timeout=30), procs.log("w1")[-3000:]
        proxy.hold_replies()
        writer.write(range(5, 10))
        time.sleep(20.0)
        assert Status.DEAD not in outbox.statuses().values(), outbox.status_counts()
        assert outbox.max_attempts() == 0, outbox.status_counts()
        proxy.release_replies()
        proxy.cut()  # the held connections go; new ones are answered
        proxy.restore()
        total = len(writer.written)
        assert wait_until(lambda: len({a[0] for a in reader.arrivals}) >= total, timeout=60), (
            procs.log("w1")[-3000:])
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=30), (
            outbox.status_counts())
        arrivals = reader.stop()
        procs.check_alive()
    check_order(arrivals, writer.expected)
    assert outbox.max_attempts() == 0
    assert procs.log("w1").count("destination broker unreachable") == 1


# -- Celery on RabbitMQ, and the Redis destination, going away mid-drain ---------------------------------

@pytest.mark.parametrize("destination_too", [False, True], ids=["broker", "broker-and-destination"])
def test_celery_on_rabbitmq_rides_out_rabbitmq_going_away_mid_drain(
        tmp_path: Path, destination: Any, sqlite_outbox: Outbox, destination_too: bool, procs_factory: Any) -> None:
    """Two Celery workers (prefork, two processes each) and beat with RabbitMQ as Celery's
    broker, behind a proxy cut for 6 s while they drain a backlog with live writes (a
    RabbitMQ restart as the clients see it); with ``destination_too`` the destination is
    that RabbitMQ as well. The workers reconnect by themselves (Celery's consumer retries
    every 2 s; publish tasks whose acks were lost come back with ``redelivered`` and
    check their lease first): every committed event arrives, in order per aggregate, every
    row is done, and no worker exits."""

    outbox = sqlite_outbox
    proxy = Proxy()
    try:
        env = relay_env(tmp_path, destination, outbox, RUNNERS["celery"], OUTBOX_BATCH_SIZE="10",
                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="5000", OUTBOX_RELAY_TASK_ROWS="3",
                        OUTBOX_RELAY_BREAKER_S="1", OUTBOX_CELERY_BROKER_URL=proxy.amqp_url)
        if destination_too:
            env["OUTBOX_PUBLISH_URL"] = proxy.amqp_url
        procs = procs_factory(env, RUNNERS["celery"])
        drain_through_a_cut(procs, outbox, destination, proxy, workers=2, after_s=2.0, arrive_s=90, done_s=20)
        procs.check_alive()
    finally:
        proxy.close()


@pytest.mark.parametrize("runner_name", sorted(RUNNERS))
def test_the_redis_destination_going_away_mid_drain_loses_nothing(
        tmp_path: Path, sqlite_outbox: Outbox, runner_name: str, procs_factory: Any) -> None:
    """The destination is Redis (kombu's transport: no confirms, a send that returned counts
    as delivered) behind a proxy cut for 6 s mid-drain with live writes, on both runners
    (their own broker is the test's Redis, not cut). Claims pause on the broker outage and
    resume: every committed event reaches the bound queue, in order per aggregate, every row
    is done, no attempt is spent, and the outage is logged once."""
    from kombu import Connection, Exchange, Queue
    from relay_e2e_support import check_order

    outbox, runner = sqlite_outbox, RUNNERS[runner_name]
    proxy = Proxy(target=("127.0.0.1", 6379))
    tag = uuid.uuid4().hex[:10]
    url = REDIS_URL.rsplit("/", 1)[0] + "/13"  # a database of its own: the runners' broker is REDIS_URL's
    exchange = Exchange(f"outbox-test-{tag}", type="topic")
    queue = Queue(f"outbox-test-q-{tag}", exchange, routing_key="#")
    conn = Connection(url)
    queue(conn.default_channel).declare()
    arrived: list[tuple[int, str, Any]] = []

    def drain() -> int:
        with conn.SimpleQueue(queue) as simple:
            while True:
                try:
                    message = simple.get(block=True, timeout=0.2)
                except simple.Empty:
                    break
                arrived.append((int(message.headers["outbox_id"]), message.headers["aggregate_id"], message))
                message.ack()
        return len({a[0] for a in arrived})

    try:
        env = relay_env(tmp_path, None, outbox, runner, OUTBOX_BATCH_SIZE="10", OUTBOX_EXCHANGE=exchange.name,
                        OUTBOX_CLAIM_INTERVAL_S="0.3", OUTBOX_CLAIM_TIMEOUT_MS="5000", OUTBOX_RELAY_TASK_ROWS="3",
                        OUTBOX_RELAY_BREAKER_S="1", OUTBOX_PUBLISH_URL=url.replace(":6379/", f":{proxy.port}/"))
        procs = procs_factory(env, runner)
        writer = Writer(outbox, [f"k-{i}" for i in range(8)], rollback_every=3, pace=0.02)
        writer.write(range(30))
        procs.worker("w1")
        procs.beat()
        assert wait_until(lambda: drain() >= 40, timeout=30), procs.log("w1")[-3000:]
        with writer:
            proxy.cut()
            assert wait_until(lambda: "destination broker unreachable" in procs.log("w1"), timeout=20), (
                procs.log("w1")[-3000:])
            time.sleep(4.0)
            proxy.restore()
            time.sleep(1.0)
        total = len(writer.written)
        assert wait_until(lambda: drain() >= total, timeout=60), f"{drain()} of {total}\\n{procs.log('w1')[-3000:]}"
        check_order(arrived, writer.expected)
        assert wait_until(lambda: set(outbox.statuses().values()) == {Status.DONE}, timeout=15), (
            outbox.status_counts())
        assert outbox.max_attempts() == 0
        assert procs.log("w1").count("destination broker unreachable") == 1, procs.log("w1")[-5000:]
        procs.check_alive()
    finally:
        proxy.close()
        queue(conn.default_channel).delete()
        conn.release()


# -- Celery beat after its clock stepped back ----------------------------------------------------

def test_celery_beat_resets_an_entry_last_run_in_the_future_and_claims_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A backward step of beat's clock (NTP correcting a host that booted ahead, a restored VM)
    left `outbox-claim`'s last run in the future, kept in celerybeat-schedule across restarts:
    Celery's scheduler sent no claim tick and no purge until the clock caught up, an hour here
    (found in review). The relay's scheduler runs such an entry again from now, saying so once.
    The sends are recorded here instead of reaching a broker: what is under test is when beat
    sends."""
    from datetime import timedelta

    from beat_schedule import CLAIM_ENTRY, PURGE_ENTRY
    from outbox.celery import app
    from outbox.celery.beat import Scheduler

    path = str(tmp_path / "beat-schedule")
    before = Scheduler(app=app, schedule_filename=path)
    ahead = before.app.now() + timedelta(hours=1)
    for entry in before.schedule.values():
        entry.last_run_at = ahead
    before.close()
    beat = Scheduler(app=app, schedule_filename=path)
    sent: list[str] = []
    beat.apply_async = lambda entry, **_: sent.append(entry.name)  # type: ignore[method-assign]
    interval = float(beat.schedule[CLAIM_ENTRY].schedule.run_every.total_seconds())
    deadline = time.monotonic() + interval + 2.0
    with caplog.at_level("WARNING", logger="outbox.beat"):
        while CLAIM_ENTRY not in sent and time.monotonic() < deadline:
            time.sleep(max(0.0, min(beat.tick(), 0.05)))
        beat.tick()
    beat.close()
    assert CLAIM_ENTRY in sent, f"no claim tick within {interval + 2.0:.1f} s"
    after = Scheduler(app=app, schedule_filename=path)  # the mended times were kept in the file
    try:
        assert all(entry.last_run_at <= app.now() for entry in after.schedule.values())
    finally:
        after.close()
    steps = [r.getMessage() for r in caplog.records if "clock stepped back" in r.getMessage()]
    # The purge's last run is taken from when it was last sent, never further than an interval
    # away (``Scheduler.keep_to_last_sends``), so the step is the claim tick's alone.
    assert len(steps) == 1 and f"({CLAIM_ENTRY} last ran" in steps[0] and "3600 s" in steps[0], steps
    assert PURGE_ENTRY not in steps[0], steps


@pytest.mark.parametrize("kind", ["redis", "rabbitmq"])
def test_celery_beats_restarted_more_often_than_the_purge_interval_still_purge(
        tmp_path: Path, sqlite_outbox: Outbox, procs_factory: Any, kind: str) -> None:
    """``celery -A outbox beat`` without a kept schedule file (a pod with no volume, a container
    recreated at each deploy), restarted more often than OUTBOX_RELAY_PURGE_INTERVAL_S: each
    fresh beat put its first purge a whole interval after its start, so none was ever sent
    (found in review: four 5 s beats, a 6 s interval, 0 purges). Beat now reads when the purge
    was last sent from Celery's broker (``outbox.relay.sent_record``) and sends it when that is
    an interval ago. Four beats of 2.5 s each, each with a fresh schedule file, a 4 s interval."""
    require("Redis" if kind == "redis" else "RabbitMQ", "127.0.0.1", 6379 if kind == "redis" else 5672)
    namespace = f"beatpurge-{uuid.uuid4().hex[:10]}"
    env = relay_env(tmp_path, None, sqlite_outbox, RUNNERS["celery"], OUTBOX_PUBLISH_URL=AMQP_URL,
                    OUTBOX_NAMESPACE=namespace, OUTBOX_RELAY_PURGE_INTERVAL_S="4",
                    **({} if kind == "redis" else {"OUTBOX_CELERY_BROKER_URL": AMQP_URL}))
    procs = procs_factory(env, RUNNERS["celery"])  # its teardown deletes the queues and the sent record
    sent = []
    for n in range(4):
        name = f"beat{n}"
        procs.start(name, "beat", "--loglevel=INFO", "-s", str(tmp_path / f"beat-schedule-{n}"))
        assert wait_until(lambda name=name: "beat: Starting" in procs.log(name), timeout=30), procs.log(name)[-3000:]
        time.sleep(2.5)
        assert procs.stop(name) == 0, procs.log(name)[-3000:]
        sent.append(procs.log(name).count("Sending due task outbox-purge"))
    assert 2 <= sum(sent) <= 4, f"purges sent by each beat: {sent}"


_BEAT_WITHOUT_WORKERS = """
import json, os, time
import outbox.celery.beat as beat
from outbox.celery import app
beat.MAX_QUEUED_CLAIMS = 5  # 100 in production: a short run here
scheduler = beat.Scheduler(app=app, schedule_filename=os.environ["SCHEDULE"])
end = time.monotonic() + 2.0
while time.monotonic() < end:
    time.sleep(max(0.0, min(scheduler.tick(), 0.05)))
scheduler.close()
"""


def test_celery_beat_stops_adding_claim_ticks_to_a_claim_queue_nobody_takes(tmp_path: Path) -> None:
    """Kombu's Redis transport ignores a message's expiry until a worker takes it: with no
    consumer on the claim queue (workers stopped, only publish workers up) beat's ticks piled
    up there, about 95 MB a day at one a second, and after downtime every claim request waited
    behind them (found in review). Beat sends no claim tick while the queue holds
    ``MAX_QUEUED_CLAIMS``, and says so once. Redis as Celery's broker, ticks every 0.05 s."""
    import redis

    require("Redis", "127.0.0.1", 6379)
    namespace = f"beatcap-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        done = subprocess.run([sys.executable, "-c", _BEAT_WITHOUT_WORKERS], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env={
                                  **{k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))},
                                  "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                                  "OUTBOX_CELERY_BROKER_URL": REDIS_URL, "OUTBOX_NAMESPACE": namespace,
                                  "OUTBOX_CLAIM_INTERVAL_S": "0.05", "SCHEDULE": str(tmp_path / "beat-schedule")})
        queued = client.llen(f"{namespace}.claim")
    finally:
        for key in client.scan_iter(match=f"*{namespace}*"):
            client.delete(key)
        client.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert queued == 5, f"{queued} claim ticks queued\n{done.stderr[-3000:]}"
    assert done.stderr.count(f"outbox: {namespace}.claim holds 5 claim ticks") == 1, done.stderr[-3000:]
