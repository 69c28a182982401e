"""The Redis destination when Redis refuses or stops answering: a Redis of this module's own
(the machine's ``redis-server`` on a free port, nothing on disk), so its memory limit,
replication and replies can be changed without touching the shared one. Found in review:
a full or read-only Redis spent every row's attempts, and a Redis that stopped answering
held the publisher for good (docs/destinations.md, "Redis")."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


#: How long after its deadline a publish may return in these tests: scheduling and the
#: proxy's own pace, not a bound of the publisher.
MARGIN_S = 1.0


def test_a_redis_that_stops_answering_is_given_up_on_by_the_deadline(own_redis: int) -> None:
    """Found in review: the socket timeout of a Redis publish was the confirm timeout (10 s
    here), whatever the deadline the relay passes (docs/relay.md, "The publish's deadline"),
    so a publish that began a second before it outlived its lease by 9 s while another
    worker could take the same rows. Now each command waits at most the time left: the
    publish returns by the deadline, as back-pressure, and publishes again once Redis answers."""
    proxy = Proxy(("127.0.0.1", own_redis))
    publisher = KombuPublisher(proxy.url_for(f"redis://127.0.0.1:{own_redis}/0"), EXCHANGE, confirm_timeout=10.0)
    try:
        assert publisher.publish_chains([[make_message(21, aggregate_id="d")]]) == [ChainResult(published=(21,))]
        proxy.hold_replies()  # the connection stays up; nothing comes back (packets dropped)
        given_up_by_the_deadline_then_delivered(publisher, proxy, 22, "d")
    finally:
        proxy.release_replies()
        publisher.close()
        proxy.close()


def given_up_by_the_deadline_then_delivered(publisher: KombuPublisher, proxy: Proxy, id_: int, aggregate: str) -> None:
    """With the proxy holding Redis's replies: a publish with a deadline 1 s away fails as
    back-pressure by then; once the replies flow again, the next event (``id_ + 1``) goes."""
    began = time.monotonic()
    [result] = publisher.publish_chains([[make_message(id_, aggregate_id=aggregate)]], deadline=began + 1.0)
    took = time.monotonic() - began
    assert result.failed_id == id_ and result.failure is not None, result
    assert result.failure.kind is FailureKind.BACKPRESSURE, result.failure
    assert took < 1.0 + MARGIN_S, f"the publish took {took:.1f} s for a deadline 1 s away"
    proxy.release_replies()
    assert publisher.publish_chains([[make_message(id_ + 1, aggregate_id=aggregate)]],
                                    deadline=time.monotonic() + 5.0) == [ChainResult(published=(id_ + 1,))]


def test_a_new_redis_connection_that_gets_no_answer_is_given_up_on_by_the_deadline(own_redis: int) -> None:
    """The first publish of a process (or the one after a lost connection) makes a new
    connection: the TCP connect succeeds and Redis never answers. Its connect and first
    command waited the connect and socket timeouts (3 s, then the confirm timeout, 10 s
    here), twice with kombu's retry; now the time left bounds both."""
    proxy = Proxy(("127.0.0.1", own_redis))
    publisher = KombuPublisher(proxy.url_for(f"redis://127.0.0.1:{own_redis}/0"), EXCHANGE, confirm_timeout=10.0)
    try:
        proxy.hold_replies()
        given_up_by_the_deadline_then_delivered(publisher, proxy, 31, "e")
    finally:
        proxy.release_replies()
        publisher.close()
        proxy.close()


@pytest.fixture
def wrong_type_queue(own_redis: int) -> Iterator[tuple[str, str]]:
    """An exchange of its own with two bound queues, ``orders.#`` and ``audit.#``, where the
    application keeps a string under the orders queue's name (a shared Redis database):
    every LPUSH to it fails with WRONGTYPE, a refusal of that queue alone. Yields the URL
    and the exchange."""
    url = f"redis://127.0.0.1:{own_redis}/0"
    exchange = f"wrongtype-{uuid.uuid4().hex[:8]}"
    with Connection(url) as conn:
        for name, key in (("orders", "orders.#"), ("audit", "audit.#")):
            Queue(f"{exchange}-{name}", Exchange(exchange, type="topic"), routing_key=key)(conn.default_channel).declare()
    client = redis.Redis(port=own_redis)
    client.set(f"{exchange}-orders", "not a list")
    try:
        yield url, exchange
    finally:
        client.delete(f"{exchange}-orders", f"{exchange}-audit", f"_kombu.binding.{exchange}")


def audit_ids(own_redis: int, exchange: str) -> list[int]:
    return [json.loads(raw)["headers"]["outbox_id"]
            for raw in reversed(redis.Redis(port=own_redis).lrange(f"{exchange}-audit", 0, -1))]


def test_an_event_redis_refuses_alone_fails_its_own_chain_only(own_redis: int,
                                                               wrong_type_queue: tuple[str, str]) -> None:
    """One queue's refusal (WRONGTYPE) was charged to every later chain of the wave, and to
    every chain when it came first: a broker-wide RETRIABLE failure, an attempt spent by
    events never tried, dead after OUTBOX_MAX_ATTEMPTS (found in review). Now it fails its
    own chain; the other chains' events are sent. In a pipelined window the events after it
    are not sent (they would overtake it)."""
    url, exchange = wrong_type_queue
    bad = [make_message(1, "orders.created", aggregate_id="b")]
    window = [make_message(10, "audit.x", aggregate_id="w"), make_message(11, "orders.paid", aggregate_id="w"),
              make_message(12, "audit.y", aggregate_id="w")]
    good = [make_message(20, "audit.z", aggregate_id="g"), make_message(21, "audit.q", aggregate_id="g")]
    with KombuPublisher(url, exchange) as publisher:
        results = publisher.publish_chains([bad, window, good], pipelined=lambda m: m.aggregate_id == "w")
    assert [(r.published, r.failed_id, r.overtaken) for r in results] == [((), 1, ()), ((10,), 11, ()), ((20, 21), None, ())]
    for result in results[:2]:
        assert result.failure is not None and result.failure.kind is FailureKind.RETRIABLE, result
        assert "WRONGTYPE" in result.failure.reason
    assert audit_ids(own_redis, exchange) == [10, 20, 21]  # 12 was not sent past 11


def test_a_connection_lost_after_an_event_redis_refused_alone_is_still_back_pressure(
        own_redis: int, wrong_type_queue: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection dies after one event's own refusal: the events not yet sent fail as
    back-pressure (no attempt spent), not with that event's failure."""
    url, exchange = wrong_type_queue
    publisher = KombuPublisher(url, exchange)
    sent = 0
    send = publisher._send

    def send_then_lose(*args: Any, **kwargs: Any) -> int:
        nonlocal sent
        sent += 1
        if sent == 3:
            raise redis.ConnectionError("Connection reset by peer")
        return send(*args, **kwargs)

    monkeypatch.setattr(publisher, "_send", send_then_lose)
    try:
        results = publisher.publish_chains([[make_message(1, "audit.x", aggregate_id="a")],
                                            [make_message(2, "orders.created", aggregate_id="b")],
                                            [make_message(3, "audit.y", aggregate_id="c")],
                                            [make_message(4, "audit.z", aggregate_id="d")]])
    finally:
        publisher.close()
    assert [(r.published, r.failed_id) for r in results] == [((1,), None), ((), 2), ((), 3), ((), 4)]
    assert results[1].failure is not None and results[1].failure.kind is FailureKind.RETRIABLE
    for result in results[2:]:
        assert result.failure is not None and result.failure.kind is FailureKind.BACKPRESSURE, result
    assert audit_ids(own_redis, exchange) == [1]
