"""The RabbitMQ destination of the benchmarks: a unique exchange and queue with a consumer
thread that records every arrival (``Arrivals``, shared with ``bench.kafka``), and the
ordering rule checked on the arrival order."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .services import Run, log


def amqp_connection(url: str) -> Any:
    import amqp
    from kombu.utils.url import url_to_parts

    scheme, host, port, user, password, path, _ = url_to_parts(url)
    conn = amqp.Connection(host=f"{host or '127.0.0.1'}:{port or 5672}", userid=user or "guest",
                           password=password or "guest", virtual_host=path or "/", connect_timeout=5)
    conn.connect()
    return conn


def confirm_channel(conn: Any) -> tuple[Any, dict[str, int]]:
    """A channel in confirm mode and what the broker confirmed on it: ``acked`` (the highest
    delivery tag settled, by ack or nack) and ``nacked`` (how many nacks)."""
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
    return ch, state


class Arrivals:
    """What a bench consumer thread records: ``(perf_counter, outbox_id, aggregate_id)`` of
    every message as it arrives (``Destination`` on RabbitMQ, ``bench.kafka.KafkaDestination``)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"bench consumer failed: {self._error!r}")

    def reset(self) -> None:
        self.arrivals.clear()

    def unique(self) -> int:
        return len({a[1] for a in self.arrivals})

    def wait_for(self, count: int, timeout: float, idle_timeout: float | None = None,
                 alive: Any = None) -> bool:
        """Wait until ``count`` distinct outbox ids arrived, ``timeout`` passed, or nothing
        new arrived for ``idle_timeout`` seconds. Returns whether the count was reached."""
        deadline = time.monotonic() + timeout
        seen_len, seen_at = -1, time.monotonic()
        ids: set[int] = set()
        scanned = 0
        while True:
            self.check()
            current = len(self.arrivals)
            for entry in self.arrivals[scanned:current]:
                ids.add(entry[1])
            scanned = current
            if len(ids) >= count:
                return True
            now = time.monotonic()
            if current != seen_len:
                seen_len, seen_at = current, now
            if now > deadline or (idle_timeout is not None and now - seen_at > idle_timeout):
                return False
            if alive is not None:
                alive()
            time.sleep(0.02)

    # -- the consumer thread, for subclasses: they define ``_consume``, which calls ``_serve``.

    def _start_consumer(self, name: str, ready_timeout: float) -> None:
        """Start the thread running ``self._consume`` and wait until it consumes."""
        self._thread = threading.Thread(target=self._consume, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(ready_timeout):
            raise RuntimeError(f"{name} did not start: {self._error}")

    def _consume(self) -> None:
        raise NotImplementedError

    def _serve(self, open_consumer: Callable[[], Any], poll: Callable[[Any], None],
               close: Callable[[Any], None]) -> None:
        """The consumer thread's run loop: open the consumer (a failure is reported by the
        constructor), poll it until ``_stop_consumer`` (a failure is reported by ``check``),
        then close it."""
        try:
            consumer = open_consumer()
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                poll(consumer)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self._error = exc
        finally:
            close(consumer)

    def _stop_consumer(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Destination(Arrivals):
    """A unique durable topic exchange with one durable queue bound to ``#``, and a consumer
    thread (raw py-amqp, no-ack, so it costs as little CPU as possible)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        admin = amqp_connection(run.amqp_url)
        try:
            ch = admin.channel()
            ch.exchange_declare(run.exchange, "topic", durable=True, auto_delete=False)
            ch.queue_declare(run.queue, durable=True, auto_delete=False)
            ch.queue_bind(run.queue, run.exchange, routing_key="#")
            ch.queue_purge(run.queue)
        finally:
            admin.close()
        self._start_consumer("bench-consumer", ready_timeout=10)

    def _consume(self) -> None:
        arrivals = self.arrivals
        clock = time.perf_counter

        def on_message(message: Any) -> None:
            h = message.properties.get("application_headers") or {}
            arrivals.append((clock(), int(h.get("outbox_id", -1)), str(h.get("aggregate_id"))))

        def open_consumer() -> Any:
            conn = amqp_connection(self.run.amqp_url)
            conn.channel().basic_consume(self.run.queue, callback=on_message, no_ack=True)
            return conn

        def poll(conn: Any) -> None:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)

        def close(conn: Any) -> None:
            with contextlib.suppress(Exception):  # best effort: the consumer is done
                conn.close()

        self._serve(open_consumer, poll, close)

    def close(self) -> None:
        self._stop_consumer()
        try:
            admin = amqp_connection(self.run.amqp_url)
            try:
                ch = admin.channel()
                ch.queue_delete(self.run.queue)
                ch.exchange_delete(self.run.exchange)
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - best effort
            log(f"could not delete {self.run.exchange}/{self.run.queue}: {exc}")


def check_order(arrivals: Sequence[tuple[float, int, str]], expected: dict[str, list[int]]) -> dict[str, Any]:
    """The ordering rule from the arrival order: per aggregate, the *first* arrival of each
    id comes in id order, and every expected id arrived. Duplicates (at-least-once) are
    counted, not failed."""
    first: dict[str, list[int]] = {}
    seen: set[int] = set()
    duplicates = 0
    for _, outbox_id, aggregate in arrivals:
        if outbox_id in seen:
            duplicates += 1
            continue
        seen.add(outbox_id)
        first.setdefault(aggregate, []).append(outbox_id)
    violations: list[str] = []
    missing = 0
    for aggregate, ids in expected.items():
        got = first.get(aggregate, [])
        want = set(ids)
        inversions = sum(1 for a, b in zip(got, got[1:]) if b < a)
        if inversions:
            violations.append(f"{aggregate}: {inversions} out-of-order arrivals")
        missing += len(want - set(got))
    strays = seen - {i for ids in expected.values() for i in ids}
    return {"ok": not violations and missing == 0 and not strays, "violations": violations[:5],
            "violating_aggregates": len(violations), "missing": missing, "unexpected": len(strays),
            "unexpected_ids": (min(strays), max(strays)) if strays else None, "duplicates": duplicates}
