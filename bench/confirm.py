"""Publisher micro-benchmark: what publisher-confirm round trips cost.

Within a chain ``KombuPublisher`` waits for event k's ``basic.ack`` before it sends event
k+1 (stop-and-wait), because that is the only AMQP scheme that keeps "what reached the broker
is a prefix of the chain" when an event is unroutable or nacked (see ``outbox.publisher``);
across the chains of a publish task it shares the round trip (waves). This measures, on the
same exchange and durable queue as the drain, with the bench consumer draining the queue as a
real consumer would:

* ``kombu_stop_and_wait``  ``KombuPublisher.publish_chain`` on chains of one event, one call
  per event: a round trip per event (mandatory, confirms, headers built per event).
* ``kombu_waves_task25``   ``KombuPublisher.publish_chains`` on 25 chains of one event: the
  relay's real path for a publish task of a backlog spread over many aggregates.
* ``raw_stop_and_wait``    py-amqp ``basic_publish`` + wait for the ack, per event, with
  pre-built messages: the round trip alone, without kombu's and the publisher's overhead.
* ``kombu_stop_and_wait_x2`` two publishers on two connections in two threads (the worker
  has two processes): does the broker scale with channels?
* ``pipelined_confirm_chain`` confirm mode, a chain of ``chain`` events published back to
  back, then one wait for all their acks (what "confirm the whole chain at once" costs).
* ``tx_chain``             one AMQP transaction per chain (tx.select / publishes / tx.commit).
* ``no_confirm``           plain ``basic_publish``, one synchronous round trip at the end only.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable

from .common import Destination, Run, _amqp_connection, log, make_event


def _messages(count: int, aggregates: int = 100) -> list[Any]:
    from outbox.model import OutboxMessage

    now = datetime.now(timezone.utc)
    out = []
    for n in range(count):
        e = make_event(n, f"agg-{n % aggregates:03d}")
        out.append(OutboxMessage(id=n + 1, message_id=e.message_id, topic=e.topic, aggregate_type=e.aggregate_type,
                                 aggregate_id=e.aggregate_id, partition_key=e.partition_key, payload=e.payload_json,
                                 headers=json.loads(e.headers_json), trace_id=None, attempts=0, created_at=now,
                                 lease=uuid.uuid4().hex))
    return out


def _amqp_messages(messages: list[Any]) -> list[Any]:
    import amqp
    from outbox.publisher import build_headers, encode_body

    return [amqp.Message(encode_body(m), application_headers=build_headers(m), delivery_mode=2,
                         content_type="application/json", content_encoding="utf-8", message_id=m.message_id)
            for m in messages]


def kombu_stop_and_wait(run: Run, messages: list[Any]) -> tuple[int, float]:
    from outbox.publisher import KombuPublisher

    publisher = KombuPublisher(run.amqp_url, run.exchange)
    try:
        publisher.publish_chain(messages[:1])  # connect and declare outside the clock
        sent = 0
        t0 = time.perf_counter()
        for m in messages[1:]:
            result = publisher.publish_chain([m])
            if not result.ok:
                raise RuntimeError(f"publish failed: {result.failure}")
            sent += 1
        return sent, time.perf_counter() - t0
    finally:
        publisher.close()


def kombu_waves(run: Run, messages: list[Any], chains: int) -> tuple[int, float]:
    from outbox.publisher import KombuPublisher

    publisher = KombuPublisher(run.amqp_url, run.exchange)
    try:
        publisher.publish_chain(messages[:1])  # connect and declare outside the clock
        sent = 0
        t0 = time.perf_counter()
        rest = messages[1:]
        for start in range(0, len(rest), chains):
            results = publisher.publish_chains([[m] for m in rest[start:start + chains]])
            failed = [r.failure for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"publish failed: {failed[0]}")
            sent += len(results)
        return sent, time.perf_counter() - t0
    finally:
        publisher.close()


def kombu_stop_and_wait_parallel(run: Run, messages: list[Any], threads: int = 2) -> tuple[int, float]:
    from outbox.publisher import KombuPublisher

    publishers = [KombuPublisher(run.amqp_url, run.exchange) for _ in range(threads)]
    for p, m in zip(publishers, messages):
        p.publish_chain([m])
    parts = [messages[threads + i::threads] for i in range(threads)]
    errors: list[Any] = []
    barrier = threading.Barrier(threads + 1)

    def work(p: Any, part: list[Any]) -> None:
        barrier.wait()
        for m in part:
            r = p.publish_chain([m])
            if not r.ok:
                errors.append(r.failure)
                return

    workers = [threading.Thread(target=work, args=(p, part)) for p, part in zip(publishers, parts)]
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    for p in publishers:
        p.close()
    if errors:
        raise RuntimeError(f"publish failed: {errors[0]}")
    return sum(len(p) for p in parts), elapsed


def raw_stop_and_wait(run: Run, messages: list[Any]) -> tuple[int, float]:
    conn = _amqp_connection(run.amqp_url)
    try:
        ch = conn.channel()
        ch.confirm_select()
        acks: list[int] = []
        ch.events["basic_ack"].add(lambda tag, multiple: acks.append(tag))
        from amqp import spec

        msgs = _amqp_messages(messages)
        t0 = time.perf_counter()
        for m in msgs:
            ch.basic_publish(m, run.exchange, "orders.changed", mandatory=True)
            ch.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=15)
        return len(msgs), time.perf_counter() - t0
    finally:
        conn.close()


def pipelined_confirm_chain(run: Run, messages: list[Any], chain: int) -> tuple[int, float]:
    conn = _amqp_connection(run.amqp_url)
    try:
        ch = conn.channel()
        ch.confirm_select()
        state = {"acked": 0, "nacked": 0}

        def on_ack(tag: int, multiple: bool) -> None:
            state["acked"] = max(state["acked"], tag)

        def on_nack(tag: int, multiple: bool) -> None:
            state["nacked"] += 1
            state["acked"] = max(state["acked"], tag)

        ch.events["basic_ack"].add(on_ack)
        ch.events["basic_nack"].add(on_nack)
        msgs = _amqp_messages(messages)
        tag = 0
        t0 = time.perf_counter()
        for start in range(0, len(msgs), chain):
            for m in msgs[start:start + chain]:
                ch.basic_publish(m, run.exchange, "orders.changed", mandatory=True)
                tag += 1
            while state["acked"] < tag:
                conn.drain_events(timeout=15)
        elapsed = time.perf_counter() - t0
        if state["nacked"]:
            raise RuntimeError(f"{state['nacked']} nacks")
        return len(msgs), elapsed
    finally:
        conn.close()


def tx_chain(run: Run, messages: list[Any], chain: int) -> tuple[int, float]:
    conn = _amqp_connection(run.amqp_url)
    try:
        ch = conn.channel()
        ch.tx_select()
        msgs = _amqp_messages(messages)
        t0 = time.perf_counter()
        for start in range(0, len(msgs), chain):
            for m in msgs[start:start + chain]:
                ch.basic_publish(m, run.exchange, "orders.changed", mandatory=True)
            ch.tx_commit()
        return len(msgs), time.perf_counter() - t0
    finally:
        conn.close()


def no_confirm(run: Run, messages: list[Any]) -> tuple[int, float]:
    conn = _amqp_connection(run.amqp_url)
    try:
        ch = conn.channel()
        msgs = _amqp_messages(messages)
        t0 = time.perf_counter()
        for m in msgs:
            ch.basic_publish(m, run.exchange, "orders.changed", mandatory=True)
        ch.exchange_declare(run.exchange, "topic", passive=True)  # one round trip: all were sent
        return len(msgs), time.perf_counter() - t0
    finally:
        conn.close()


def run_confirm_bench(run: Run, destination: Destination, count: int, chain: int = 25) -> dict[str, Any]:
    """Each variant publishes ``count`` events; the first is the baseline of the ratios."""
    messages = _messages(count + 2)
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("kombu_stop_and_wait", lambda: kombu_stop_and_wait(run, messages)),
        (f"kombu_waves_task{chain}", lambda: kombu_waves(run, messages, chain)),
        ("raw_stop_and_wait", lambda: raw_stop_and_wait(run, messages[:count])),
        ("kombu_stop_and_wait_x2", lambda: kombu_stop_and_wait_parallel(run, messages)),
        (f"pipelined_confirm_chain{chain}", lambda: pipelined_confirm_chain(run, messages[:count], chain)),
        ("pipelined_confirm_window100", lambda: pipelined_confirm_chain(run, messages[:count], 100)),
        (f"tx_chain{chain}", lambda: tx_chain(run, messages[:count], chain)),
        ("no_confirm", lambda: no_confirm(run, messages[:count])),
    ]
    results: dict[str, Any] = {}
    base: float | None = None
    for name, fn in variants:
        destination.reset()
        sent, elapsed = fn()
        rate = sent / elapsed if elapsed > 0 else float("inf")
        base = base or rate
        results[name] = {"events": sent, "seconds": round(elapsed, 3), "events_per_s": round(rate),
                         "us_per_event": round(1e6 * elapsed / max(1, sent), 1), "ratio": round(rate / base, 2)}
        log(f"confirm micro {name:28s} {rate:9.0f} ev/s  {1e6 * elapsed / max(1, sent):7.1f} us/event  "
            f"x{rate / base:.2f}")
        destination.wait_for(sent, timeout=10, idle_timeout=2)
    destination.reset()
    return results
