"""Pipelined chains (docs/relay.md, "Pipelined chains"): the opt-in settings, and the
weaker guarantee against a real RabbitMQ and a real store: an unroutable event and a
nacked event in the middle of a pipelined chain are overtaken, go dead at once and are
dead-lettered with the ids that overtook them; the strict default is unchanged."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue
from publisher_support import amqp_hostport
from relay_e2e_support import Destination, Outbox, check_order, relay_env, require_relay_services
from services import AMQP_URL, require

from outbox import Status, enqueue
from outbox.core.config import RelayOptions, load_settings
from outbox.core.errors import ConfigError
from outbox.domain.chains import split_chains
from outbox.publisher import OVERTAKEN_BY_HEADER, OVERTAKEN_COUNT_HEADER, FailureKind, KombuPublisher
from outbox.relay import RelayContext, handle_publish
from outbox.storage.store import OutboxStore

PIPELINED = RelayOptions(pipelined_topics=("orders.*", "nobody.*"))


# -- settings ------------------------------------------------------------------------------------

def test_pipelining_is_off_by_default() -> None:
    options = RelayOptions.from_sources({})
    assert not options.pipelines
    assert not options.pipelined("orders.created", "order")


def test_pipelined_topics_and_aggregate_types_are_read_and_matched() -> None:
    options = RelayOptions.from_sources({"OUTBOX_RELAY_PIPELINED_TOPICS": " orders.* , metrics.cpu,orders.*",
                                         "OUTBOX_RELAY_PIPELINED_AGGREGATE_TYPES": "sensor"})
    assert options.pipelined_topics == ("orders.*", "metrics.cpu")
    assert options.pipelined_aggregate_types == ("sensor",)
    assert options.pipelines
    assert options.pipelined("orders.created", "order")
    assert options.pipelined("metrics.cpu", "host")
    assert not options.pipelined("metrics.cpu.total", "host")  # fnmatch: the whole topic
    assert not options.pipelined("Orders.created", "order")  # case-sensitive, like routing keys
    assert options.pipelined("billing.paid", "sensor")
    assert not options.pipelined("billing.paid", "Sensor")
    # A Celery config key may hold a list; the first source that has the name wins.
    listed = RelayOptions.from_sources({"OUTBOX_RELAY_PIPELINED_TOPICS": ["a.#", "b.*"]},
                                       {"OUTBOX_RELAY_PIPELINED_TOPICS": "ignored"})
    assert listed.pipelined_topics == ("a.#", "b.*")
    # Celery config keys of the relay pass the settings reader (they are OUTBOX_RELAY_*).
    assert load_settings(overrides={"OUTBOX_RELAY_PIPELINED_TOPICS": "orders.*"}).exchange == "outbox"


@pytest.mark.parametrize("value", ["orders.*,,billing.*", "orders.*,", "orders created", ",", "x" * 256,
                                   ["orders.*", 3], 42])
def test_bad_pipelined_values_name_the_setting(value: Any) -> None:
    for name in ("OUTBOX_RELAY_PIPELINED_TOPICS", "OUTBOX_RELAY_PIPELINED_AGGREGATE_TYPES"):
        with pytest.raises(ConfigError, match=name):
            RelayOptions.from_sources({name: value})


# -- a real RabbitMQ and a real store --------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def kind(request: pytest.FixtureRequest) -> str:
    """The store (engine_support's ``store`` and ``writer``, a table per test) on these engines."""
    return request.param


@pytest.fixture
def rabbit() -> Iterator[dict[str, Any]]:
    """A unique exchange with a queue bound for ``orders.created`` only (the consumer that
    checks the order) and one for ``audit.#``, a dead-letter exchange with a queue, and ``orders.full``: a queue
    already full with ``x-overflow: reject-publish``, so the broker nacks what goes there."""
    require("RabbitMQ", *amqp_hostport())
    name = f"pipelined-test-{uuid.uuid4().hex[:10]}"
    # Confirmed, so the filler is queued before the relay publishes.
    conn = Connection(AMQP_URL, connect_timeout=3, transport_options={"confirm_publish": True})
    channel = conn.channel()
    exchange = Exchange(name, type="topic", durable=True)
    dead_exchange = Exchange(f"{name}-dead", type="topic", durable=True)
    exchange(channel).declare()
    dead_exchange(channel).declare()
    queues = {
        "main": Queue(f"{name}-q", exchange=exchange, routing_key="orders.created", exclusive=True, auto_delete=True),
        "audit": Queue(f"{name}-audit", exchange=exchange, routing_key="audit.#", exclusive=True, auto_delete=True),
        "dead": Queue(f"{name}-dead-q", exchange=dead_exchange, routing_key="#", exclusive=True, auto_delete=True),
        "full": Queue(f"{name}-full", exchange=exchange, routing_key="orders.full", exclusive=True,
                      auto_delete=True, queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"}),
    }
    bound = {key: queue(channel) for key, queue in queues.items()}
    for queue in bound.values():
        queue.declare()
    producer = conn.Producer(channel)
    producer.publish({"filler": True}, exchange=exchange, routing_key="orders.full")  # now full

    def drain(key: str) -> list[Any]:
        got = []
        while (message := bound[key].get(no_ack=True)) is not None:
            got.append(message)
        return got

    yield {"exchange": name, "dead_exchange": f"{name}-dead", "drain": drain}
    try:
        exchange(channel).delete()
        dead_exchange(channel).delete()
    finally:
        conn.release()


def enqueue_chain(writer: Any, store: OutboxStore, topics: list[str], aggregate_type: str = "order") -> list[int]:
    ids = [enqueue(writer, topic=topic, aggregate_type=aggregate_type, aggregate_id="hot", payload={"n": n},
                   table=store.engine.table_name)
           for n, topic in enumerate(topics)]
    writer.commit()
    return ids


def rows(store: OutboxStore, ids: list[int]) -> dict[int, tuple[int, int, str | None]]:
    """id -> (status, attempts, last_error)."""
    with store.transaction() as cursor:
        found = store.engine.execute(cursor, f"SELECT id, status, attempts, last_error FROM {store.engine.table}")
        return {r[0]: (r[1], r[2], r[3]) for r in found.fetchall() if r[0] in ids}


class CountingPublisher(KombuPublisher):
    """The real publisher, recording how many events each wave carried."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waves: list[int] = []

    def _send_wave(self, messages: Any, headers: Any, deadline: float | None = None, **options: Any) -> list[Any]:
        self.waves.append(len(messages))
        return super()._send_wave(messages, headers, deadline, **options)


def publish(store: OutboxStore, rabbit: dict[str, Any], options: RelayOptions) -> tuple[Any, CountingPublisher]:
    publisher = CountingPublisher(AMQP_URL, rabbit["exchange"], dead_letter_exchange=rabbit["dead_exchange"])
    try:
        outcomes = handle_publish(RelayContext(store, publisher, options=options),
                                  split_chains(store.claim(100).messages))
    finally:
        publisher.close()
    assert len(outcomes) == 1
    return outcomes[0], publisher


@pytest.mark.parametrize("bad_topic,failure_kind", [("nobody.listens", FailureKind.RETRIABLE),
                                            ("orders.full", FailureKind.BACKPRESSURE)])
def test_a_refused_event_in_the_middle_of_a_pipelined_chain_is_overtaken_and_dead_lettered(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any], caplog: pytest.LogCaptureFixture,
        bad_topic: str, failure_kind: FailureKind) -> None:
    """Unroutable (a mandatory publish nobody is bound for) or nacked (a full queue with
    reject-publish) in the middle of a pipelined window: the events after it were already
    confirmed, so it is dead at once (no retry, which would arrive after them) and its
    dead-letter copy names the ids delivered after it."""
    ids = enqueue_chain(writer, store, ["orders.created", "orders.created", bad_topic, "orders.created", "orders.created"])
    with caplog.at_level(logging.ERROR, logger="outbox.relay"):
        outcome, publisher = publish(store, rabbit, PIPELINED)
    assert publisher.waves == [5]  # one window, one round trip
    assert outcome.published == [ids[0], ids[1], ids[3], ids[4]]
    assert outcome.overtaken == [ids[2]] and outcome.failed_id is None
    # The consumer sees the gap: the events around the refused one, in order.
    assert [m.headers["outbox_id"] for m in rabbit["drain"]("main")] == [ids[0], ids[1], ids[3], ids[4]]
    state = rows(store, ids)
    assert [state[i][0] for i in ids] == [Status.DONE, Status.DONE, Status.DEAD, Status.DONE, Status.DONE]
    status, attempts, error = state[ids[2]]
    assert attempts == 1 and error is not None
    assert error.startswith(f"{failure_kind}: ") and "pipelined chain: overtaken by later events already delivered" in error
    assert f"outbox ids {ids[3]}, {ids[4]})" in error
    dead = rabbit["drain"]("dead")
    assert [m.headers["outbox_id"] for m in dead] == [ids[2]]
    assert dead[0].headers[OVERTAKEN_BY_HEADER] == f"{ids[3]},{ids[4]}"
    assert dead[0].headers[OVERTAKEN_COUNT_HEADER] == 2
    assert dead[0].headers["x-outbox-error"] == error
    logged = [r for r in caplog.records if getattr(r, "outbox_event", None) == "overtaken"]
    assert [r.outbox_id for r in logged] == [ids[2]]  # type: ignore[attr-defined]
    assert logged[0].levelno == logging.ERROR and "pipelined event overtaken, dead at once" in logged[0].getMessage()


def test_every_refused_event_before_the_last_confirmed_one_is_overtaken(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    ids = enqueue_chain(writer, store, ["orders.created", "nobody.listens", "orders.full", "orders.created"])
    outcome, _ = publish(store, rabbit, PIPELINED)
    assert outcome.published == [ids[0], ids[3]] and outcome.overtaken == [ids[1], ids[2]]
    assert [rows(store, ids)[i][0] for i in ids] == [Status.DONE, Status.DEAD, Status.DEAD, Status.DONE]
    dead = {m.headers["outbox_id"]: m.headers for m in rabbit["drain"]("dead")}
    assert sorted(dead) == [ids[1], ids[2]]
    # A nacked event may still sit in another queue bound for its routing key: it counts
    # among those that overtook the events before it.
    assert dead[ids[1]][OVERTAKEN_BY_HEADER] == f"{ids[2]},{ids[3]}"
    assert dead[ids[2]][OVERTAKEN_BY_HEADER] == str(ids[3])


def test_a_nacked_event_at_the_end_of_the_window_overtakes_a_returned_one(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    """Returned (no queue took it), then nacked (some queue refused it, others may hold
    it): the returned one is overtaken, dead at once; the nacked one, last of the window,
    is released behind its paused route as in a strict chain."""
    ids = enqueue_chain(writer, store, ["orders.created", "nobody.listens", "orders.full"])
    outcome, publisher = publish(store, rabbit, PIPELINED)
    assert publisher.waves == [3]
    assert outcome.published == [ids[0]] and outcome.overtaken == [ids[1]]
    assert outcome.failed_id == ids[2] and outcome.kind is FailureKind.BACKPRESSURE and not outcome.dead
    assert [rows(store, ids)[i][0] for i in ids] == [Status.DONE, Status.DEAD, Status.PENDING]
    dead = rabbit["drain"]("dead")
    assert [m.headers["outbox_id"] for m in dead] == [ids[1]] and dead[0].headers[OVERTAKEN_BY_HEADER] == str(ids[2])


def test_a_refused_event_nothing_overtook_follows_the_normal_policy(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    """Refused at the end of the window (every later event refused too): nothing after it
    reached the broker, so no reorder; the first is failed by its kind (retry with back-off
    for unroutable), the rest released behind it, as in a strict chain."""
    ids = enqueue_chain(writer, store, ["orders.created", "orders.created", "nobody.listens", "nobody.listens"])
    outcome, publisher = publish(store, rabbit, PIPELINED)
    assert publisher.waves == [4]
    assert outcome.published == [ids[0], ids[1]] and outcome.overtaken == []
    assert outcome.failed_id == ids[2] and outcome.kind is FailureKind.RETRIABLE and not outcome.dead
    assert outcome.released == [ids[3]]
    state = rows(store, ids)
    assert [state[i][0] for i in ids] == [Status.DONE, Status.DONE, Status.FAILED, Status.PENDING]
    assert rabbit["drain"]("dead") == []


def test_a_mixed_chain_pipelines_only_its_opted_in_runs(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    """A strict event (here: a topic no pattern matches) is sent alone, once everything
    before it is confirmed; the opted-in events after it form the next window."""
    topics = ["orders.created", "orders.created", "audit.created", "orders.created", "orders.created"]
    ids = enqueue_chain(writer, store, topics)
    outcome, publisher = publish(store, rabbit, RelayOptions(pipelined_topics=("orders.*",)))
    assert publisher.waves == [2, 1, 2]
    assert outcome.published == ids
    assert [m.headers["outbox_id"] for m in rabbit["drain"]("main")] == [ids[0], ids[1], ids[3], ids[4]]
    assert [m.headers["outbox_id"] for m in rabbit["drain"]("audit")] == [ids[2]]


def test_aggregate_types_opt_in_too(store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    ids = enqueue_chain(writer, store, ["orders.created"] * 4, aggregate_type="sensor")
    outcome, publisher = publish(store, rabbit, RelayOptions(pipelined_aggregate_types=("sensor",)))
    assert publisher.waves == [4] and outcome.published == ids


def test_strict_by_default_a_refused_event_stops_the_chain(
        store: OutboxStore, writer: Any, rabbit: dict[str, Any]) -> None:
    """Without the settings nothing changes: one event per wave, nothing sent behind a
    refused event, which is retried (unroutable) or released behind its paused route
    (nacked), never dead at once."""
    ids = enqueue_chain(writer, store, ["orders.created", "orders.created", "nobody.listens", "orders.created"])
    outcome, publisher = publish(store, rabbit, RelayOptions())
    assert publisher.waves == [1, 1, 1]
    assert outcome.published == [ids[0], ids[1]] and outcome.overtaken == []
    assert outcome.failed_id == ids[2] and outcome.kind is FailureKind.RETRIABLE and not outcome.dead
    state = rows(store, ids)
    assert [state[i][0] for i in ids] == [Status.DONE, Status.DONE, Status.FAILED, Status.PENDING]
    assert [m.headers["outbox_id"] for m in rabbit["drain"]("main")] == [ids[0], ids[1]]
    assert rabbit["drain"]("dead") == []


# -- a real worker ----------------------------------------------------------------------------------

@pytest.fixture
def pg_outbox(tmp_path: Path) -> Iterator[Outbox]:
    o = Outbox("postgresql", tmp_path)
    yield o
    o.drop()


def test_a_worker_pipelines_a_hot_aggregate_and_dead_letters_the_event_overtaken(
        tmp_path: Path, pg_outbox: Outbox, procs_factory: Any) -> None:
    """``celery -A outbox worker`` and beat with OUTBOX_RELAY_PIPELINED_AGGREGATE_TYPES:
    60 events of one aggregate in one claim, the 21st unroutable. The consumer sees the
    other 59 in order, once each, and the gap; the 21st is dead on its first attempt and
    on the dead-letter exchange with the ids that overtook it; the worker logs it."""
    require_relay_services()
    destination = Destination(bindings=("orders.#",), dead_letter=True)
    try:
        with pg_outbox.writer() as conn:
            ids = [pg_outbox.add(conn, "hot", n, topic="unbound.hot.changed" if n == 20 else None) for n in range(60)]
            conn.commit()
        bad, good = ids[20], [i for i in ids if i != ids[20]]
        procs = procs_factory(relay_env(tmp_path, destination, pg_outbox, OUTBOX_CLAIM_INTERVAL_S="0.3",
                                        OUTBOX_DEAD_LETTER_EXCHANGE=destination.dead_exchange_name or "",
                                        OUTBOX_RELAY_PIPELINED_AGGREGATE_TYPES="order",
                                        # Small payload limit: the worker's first claim is not
                                        # sized for 1 MiB rows, so it takes all 60 events at once
                                        # (docs/relay.md, "Memory: claims sized by bytes").
                                        OUTBOX_MAX_PAYLOAD_BYTES="4096",
                                        # and the worker's in-process claim, which takes at most
                                        # this many rows, takes them all too (docs/waking-and-
                                        # metrics.md, "The in-process claim").
                                        OUTBOX_RELAY_INLINE_ROWS="100",
                                        # this checkout's sources first, as in the test process
                                        PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path])))
        procs.worker("w1")
        procs.beat()
        assert destination.wait_for(lambda: set(good) <= destination.arrived() and len(destination.dead) >= 1,
                                    timeout=30, procs=procs), procs.log("w1")[-3000:]
        check_order(destination.arrivals(), {"hot": good})
        assert len(destination.arrivals()) == len(good)  # no duplicates
        [dead] = destination.dead
        assert dead.headers["outbox_id"] == bad
        assert dead.headers[OVERTAKEN_BY_HEADER] == ",".join(map(str, ids[21:]))
        assert dead.headers[OVERTAKEN_COUNT_HEADER] == 39
        row = pg_outbox.rows()[bad]
        assert (row["status"], row["attempts"]) == (Status.DEAD, 1)
        assert row["last_error"].startswith("retriable: unroutable") and "overtaken" in row["last_error"]
        assert "pipelined event overtaken, dead at once" in procs.log("w1")
    finally:
        destination.close()
