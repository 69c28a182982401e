"""The Redis destination when Redis refuses or stops answering: a Redis of this module's own
(the machine's ``redis-server`` on a free port, nothing on disk), so its memory limit,
replication and replies can be changed without touching the shared one. Found in review:
a full or read-only Redis spent every row's attempts, and a Redis that stopped answering
held the publisher for good (docs/destinations.md, "Redis")."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Queue
from publisher_support import make_message
from relay_e2e_support import Proxy
from services import free_port, stop, unavailable

from outbox.core.model import FailureKind
from outbox.publisher import ChainResult, KombuPublisher

EXCHANGE = "redis-faults"


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The port of a ``redis-server`` started for this module, with an exchange bound to a queue."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    where: Path = tmp_path_factory.mktemp("own-redis")
    port = free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(where), "--logfile", str(where / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(port=port, socket_timeout=5)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    unavailable(f"redis-server did not start on port {port}")
                time.sleep(0.1)
        with Connection(f"redis://127.0.0.1:{port}/0") as conn:
            Queue("redis-faults-q", Exchange(EXCHANGE, type="topic"), routing_key="#")(conn.default_channel).declare()
        yield port
    finally:
        stop(proc)


def chains() -> list[list]:
    return [[make_message(1, aggregate_id="a"), make_message(2, aggregate_id="a")], [make_message(3, aggregate_id="b")]]


def refused_as_back_pressure(results: list[ChainResult], words: str) -> None:
    assert [(r.published, r.failed_id) for r in results] == [((), 1), ((), 3)], results
    for result in results:
        assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE, result
        assert words in result.failure.reason, result.failure.reason


def test_a_full_redis_is_back_pressure_not_a_failure_of_each_event(own_redis: int) -> None:
    """``maxmemory`` reached with ``noeviction``: redis-py raises ``OutOfMemoryError`` with the
    OOM code stripped from its message, which was classified RETRIABLE: an attempt spent per
    chain at every claim, the backlog dead-lettered within the outage."""
    client = redis.Redis(port=own_redis)
    publisher = KombuPublisher(f"redis://127.0.0.1:{own_redis}/0", EXCHANGE)
    try:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")
        refused_as_back_pressure(publisher.publish_chains(chains()), "OutOfMemoryError")
    finally:
        client.config_set("maxmemory", "0")
        publisher.close()


def test_a_read_only_redis_is_back_pressure_not_a_failure_of_each_event(own_redis: int) -> None:
    """A Redis that became a replica (a failover in progress) refuses writes with READONLY:
    ``ReadOnlyError``, classified RETRIABLE before, as the full Redis was."""
    client = redis.Redis(port=own_redis)
    publisher = KombuPublisher(f"redis://127.0.0.1:{own_redis}/0", EXCHANGE)
    try:
        client.replicaof("127.0.0.1", str(free_port()))  # a primary nobody runs: read-only from now on
        refused_as_back_pressure(publisher.publish_chains(chains()), "ReadOnlyError")
    finally:
        client.replicaof("NO", "ONE")
        publisher.close()


def test_a_redis_that_stops_answering_is_given_up_on_within_the_confirm_timeout(own_redis: int) -> None:
    """The connection is up, then Redis's replies stop coming (a paused server, a path that
    drops packets): kombu's Redis transport had no socket timeout and the publish waited for
    ever, holding the publisher's lock. Now it gives up after ``confirm_timeout``, as
    back-pressure, and publishes again once Redis answers."""
    proxy = Proxy(("127.0.0.1", own_redis))
    publisher = KombuPublisher(proxy.url_for(f"redis://127.0.0.1:{own_redis}/0"), EXCHANGE, confirm_timeout=2.0)
    try:
        assert publisher.publish_chains([[make_message(9, aggregate_id="c")]]) == [ChainResult(published=(9,))]
        proxy.hold_replies()
        started = time.monotonic()
        [result] = publisher.publish_chains([[make_message(10, aggregate_id="c")]])
        took = time.monotonic() - started
        assert result.failed_id == 10 and result.failure is not None, result
        assert result.failure.kind is FailureKind.BACKPRESSURE, result.failure
        assert took < 15, f"the publish waited {took:.1f} s for a Redis that did not answer"
        proxy.release_replies()
        assert publisher.publish_chains([[make_message(11, aggregate_id="c")]]) == [ChainResult(published=(11,))]
    finally:
        proxy.release_replies()
        publisher.close()
        proxy.close()
