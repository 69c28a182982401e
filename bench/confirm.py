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
* ``kombu_waves_task100``  the same with 100 chains of one event: a full default claim (100
  rows over 100 aggregates) is one task and one wave. Its entry also holds ``vs_raw_waves``:
  its rate over ``raw_waves100``'s, measured in the same run (issue 11, speed target 2).
* ``raw_waves100``         raw py-amqp, no kombu, no relay: the same messages (same body,
  properties and header table, built from the same rows inside the clock, as a raw relay loop
  must), persistent, mandatory, confirms, in waves of 100: publish the wave back to back,
  then wait until every message is acked. The baseline of ``vs_raw_waves``.
* ``raw_waves100_prebuilt`` the same with every ``amqp.Message`` built before the clock: the
  socket and the broker alone (``vs_raw_waves_prebuilt``).
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

import threading
import time
from collections.abc import Callable
from typing import Any

from .common import Destination, Run, amqp_connection, claimed_messages, confirm_channel, log


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


def kombu_waves(run: Run, messages: list[Any], chains: int) -> tuple[int, float, float]:
    from outbox.publisher import KombuPublisher

    publisher = KombuPublisher(run.amqp_url, run.exchange)
    try:
        publisher.publish_chain(messages[:1])  # connect and declare outside the clock
        sent = 0
        t0, cpu0 = time.perf_counter(), time.thread_time()
        rest = messages[1:]
        for start in range(0, len(rest), chains):
            results = publisher.publish_chains([[m] for m in rest[start:start + chains]])
            failed = [r.failure for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"publish failed: {failed[0]}")
            sent += len(results)
        return sent, time.perf_counter() - t0, time.thread_time() - cpu0
    finally:
        publisher.close()


def raw_waves(run: Run, messages: list[Any], wave: int, prebuilt: bool = False) -> tuple[int, float, float]:
    """Raw py-amqp waves: ``wave`` messages back to back (persistent, mandatory), then read
    until every one of them is acked. Without ``prebuilt`` each ``amqp.Message`` is built
    from its row inside the clock, as any relay loop has to."""
    conn = amqp_connection(run.amqp_url)
    try:
        ch = conn.channel()
        ch.confirm_select()
        state = {"acked": 0, "nacked": 0, "returned": 0}

        def on_ack(tag: int, multiple: bool) -> None:
            state["acked"] = max(state["acked"], tag)

        def on_nack(tag: int, multiple: bool) -> None:
            state["nacked"] += 1
            on_ack(tag, multiple)

        ch.events["basic_ack"].add(on_ack)
        ch.events["basic_nack"].add(on_nack)
        ch.events["basic_return"].add(lambda *args: state.__setitem__("returned", state["returned"] + 1))
        ready = _amqp_messages(messages) if prebuilt else None
        tag = 0
        t0, cpu0 = time.perf_counter(), time.thread_time()
        for start in range(0, len(messages), wave):
            part = ready[start:start + wave] if ready is not None else _amqp_messages(messages[start:start + wave])
            for m, row in zip(part, messages[start:start + wave]):
                ch.basic_publish(m, run.exchange, row.topic, mandatory=True)
                tag += 1
            while state["acked"] < tag:
                conn.drain_events(timeout=15)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        if state["nacked"] or state["returned"]:
            raise RuntimeError(f"{state['nacked']} nacks, {state['returned']} returns")
        return len(messages), elapsed, cpu
    finally:
        conn.close()


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
    conn = amqp_connection(run.amqp_url)
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
    conn = amqp_connection(run.amqp_url)
    try:
        ch, state = confirm_channel(conn)
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
    conn = amqp_connection(run.amqp_url)
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
    conn = amqp_connection(run.amqp_url)
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


def run_confirm_bench(run: Run, destination: Destination, count: int, chain: int = 25,
                      wave: int = 100, rounds: int = 3) -> dict[str, Any]:
    """Each variant publishes ``count`` events; the first is the baseline of the ratios.

    The relay's waves of ``wave`` and raw py-amqp's (``raw_waves{wave}``, ``..._prebuilt``)
    run ``rounds`` times, interleaved, and each keeps its median round (``rounds_events_per_s``
    lists them all): on a shared machine one round can be slowed by a neighbour. The relay's
    entry ``kombu_waves_task{wave}`` then holds ``vs_raw_waves`` (``vs_raw_waves_prebuilt``):
    its rate over raw py-amqp's, and ``cpu_vs_raw_waves``: its publishing thread's CPU per
    event over raw py-amqp's (issue 11, speed target 2)."""
    messages = claimed_messages(count + 2, 100)
    relay, raw, prebuilt = f"kombu_waves_task{wave}", f"raw_waves{wave}", f"raw_waves{wave}_prebuilt"
    paired: list[tuple[str, Callable[[], Any]]] = [
        (relay, lambda: kombu_waves(run, messages, wave)),
        (raw, lambda: raw_waves(run, messages[:count], wave)),
        (prebuilt, lambda: raw_waves(run, messages[:count], wave, prebuilt=True)),
    ]
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("kombu_stop_and_wait", lambda: kombu_stop_and_wait(run, messages)),
        (f"kombu_waves_task{chain}", lambda: kombu_waves(run, messages, chain)),
        *[(name, fn) for _ in range(rounds) for name, fn in paired],
        ("raw_stop_and_wait", lambda: raw_stop_and_wait(run, messages[:count])),
        ("kombu_stop_and_wait_x2", lambda: kombu_stop_and_wait_parallel(run, messages)),
        (f"pipelined_confirm_chain{chain}", lambda: pipelined_confirm_chain(run, messages[:count], chain)),
        ("pipelined_confirm_window100", lambda: pipelined_confirm_chain(run, messages[:count], 100)),
        (f"tx_chain{chain}", lambda: tx_chain(run, messages[:count], chain)),
        ("no_confirm", lambda: no_confirm(run, messages[:count])),
    ]
    results: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in paired}
    base: float | None = None
    for name, fn in variants:
        destination.reset()
        sent, elapsed, *cpu = fn()
        rate = sent / elapsed if elapsed > 0 else float("inf")
        base = base or rate
        entry = {"events": sent, "seconds": round(elapsed, 3), "events_per_s": round(rate),
                 "us_per_event": round(1e6 * elapsed / max(1, sent), 1), "ratio": round(rate / base, 2)}
        if cpu:  # the publishing thread's own CPU (the bench consumer runs in another thread)
            entry["cpu_us_per_event"] = round(1e6 * cpu[0] / max(1, sent), 1)
        log(f"confirm micro {name:28s} {rate:9.0f} ev/s  {1e6 * elapsed / max(1, sent):7.1f} us/event  "
            f"x{rate / base:.2f}" + (f"  cpu {1e6 * cpu[0] / max(1, sent):6.1f} us/event" if cpu else ""))
        if name in samples:
            samples[name].append(entry)
            if len(samples[name]) == rounds:
                ranked = sorted(samples[name], key=lambda e: e["events_per_s"])
                results[name] = {**ranked[len(ranked) // 2],
                                 "rounds_events_per_s": [e["events_per_s"] for e in samples[name]]}
        else:
            results[name] = entry
        destination.wait_for(sent, timeout=10, idle_timeout=2)
    destination.reset()
    mine = results[relay]
    mine["vs_raw_waves"] = round(mine["events_per_s"] / max(1, results[raw]["events_per_s"]), 2)
    mine["vs_raw_waves_prebuilt"] = round(mine["events_per_s"] / max(1, results[prebuilt]["events_per_s"]), 2)
    mine["cpu_vs_raw_waves"] = round(mine["cpu_us_per_event"] / max(0.1, results[raw]["cpu_us_per_event"]), 2)
    log(f"confirm micro relay waves of {wave} vs raw py-amqp waves of {wave}: x{mine['vs_raw_waves']:.2f} "
        f"(vs prebuilt messages x{mine['vs_raw_waves_prebuilt']:.2f}); CPU per event "
        f"{mine['cpu_us_per_event']:.1f} vs {results[raw]['cpu_us_per_event']:.1f} us")
    return results


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.confirm``: this micro-benchmark alone, on its own exchange and queue."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.confirm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=5000, help="events per variant (default 5,000)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the waves comparison")
    p.add_argument("--tag", help="names this run's exchange and queue (outbox-bench-<tag>); default random")
    args = p.parse_args(argv)
    run = Run(tag=args.tag) if args.tag else Run()
    destination = Destination(run)
    try:
        run_confirm_bench(run, destination, args.events, rounds=args.rounds)
    finally:
        destination.close()


if __name__ == "__main__":
    main()
