"""PROTOTYPES of the two fixes the drain profile points at, kept in bench/ so they can be
measured without touching ``src/``. They are not the product; see docs/benchmarks.md.

1. ``WavePublisher.publish_chains``: publisher confirms pipelined *across* chains, never
   within one. A task's chains belong to different aggregates, so the prefix rule (event
   k+1 of an aggregate never leaves before event k of that aggregate is confirmed and was
   not returned) holds if we send the *first* unsent event of every chain back to back,
   wait for all their acks (one round trip for the whole wave), drop the chains whose event
   was returned or nacked, and repeat with the next event of each remaining chain. Round
   trips per task = the longest chain, not the number of events. RabbitMQ sends a
   message's ``basic.return`` before its ``basic.ack`` on the same channel, so once the
   wave's last ack is in, every return of the wave has been seen.
2. ``handle_publish_batched``: one ``mark_done`` per publish task (all chains of a task share
   the claim's lease) instead of one per chain. With round-robin backlogs chains are one
   event long, so the relay's per-chain settle is one PostgreSQL commit (a WAL fsync) per
   event.

3. ``install_inline_publish``: a small claim publishes its rows itself (no second Celery hop).

``patched_app`` installs them into the real Celery app for ``celery -A bench.patched_app``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence


class WavePublisher:
    """py-amqp only (the prototype needs confirms and returns); same message format as
    ``KombuPublisher`` (body, headers, properties)."""

    def __init__(self, url: str, exchange: str, confirm_timeout: float = 15.0) -> None:
        self.url = url
        self.exchange = exchange
        self.confirm_timeout = confirm_timeout
        self._pid: int | None = None
        self._conn: Any = None
        self._ch: Any = None
        self._tag = 0
        self._acked: dict[int, bool] = {}  # delivery tag -> True (ack) / False (nack)
        self._outstanding: set[int] = set()
        self._returned: set[str] = set()

    @classmethod
    def from_settings(cls, settings: Any, **_: Any) -> "WavePublisher":
        return cls(settings.publish_url, settings.exchange)

    # -- connection ---------------------------------------------------------------------------
    def _ready(self) -> None:
        if self._pid != os.getpid():
            self._conn = self._ch = None
        if self._conn is not None:
            return
        from .common import _amqp_connection

        conn = _amqp_connection(self.url)
        ch = conn.channel()
        ch.exchange_declare(self.exchange, "topic", durable=True, auto_delete=False)
        ch.confirm_select()
        ch.events["basic_ack"].add(lambda tag, multiple: self._settle(tag, multiple, True))
        ch.events["basic_nack"].add(lambda tag, multiple: self._settle(tag, multiple, False))
        ch.events["basic_return"].add(self._on_return)
        self._conn, self._ch, self._pid, self._tag = conn, ch, os.getpid(), 0
        self._acked.clear()
        self._outstanding.clear()

    def _settle(self, tag: int, multiple: bool, ok: bool) -> None:
        tags = [t for t in self._outstanding if t <= tag] if multiple else [tag]
        for t in tags:
            self._outstanding.discard(t)
            self._acked[t] = ok

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        message_id = message.properties.get("message_id")
        if message_id:
            self._returned.add(message_id)

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
        self._conn = self._ch = None

    # -- publishing ------------------------------------------------------------------------------
    def publish_chain(self, messages: Sequence[Any]) -> Any:
        return self.publish_chains([messages])[0]

    def publish_chains(self, chains: Sequence[Sequence[Any]]) -> list[Any]:
        import amqp
        from outbox.publisher import ChainResult, FailureKind, PublishFailure, build_headers, encode_body

        self._ready()
        published: list[list[int]] = [[] for _ in chains]
        failures: dict[int, tuple[int, Any]] = {}
        position = [0] * len(chains)
        active = [i for i, c in enumerate(chains) if c]
        while active:
            wave: list[tuple[int, int, Any]] = []
            for i in active:
                m = chains[i][position[i]]
                self._tag += 1
                self._outstanding.add(self._tag)
                self._ch.basic_publish(
                    amqp.Message(encode_body(m), application_headers=build_headers(m), delivery_mode=2,
                                 content_type="application/json", content_encoding="utf-8",
                                 message_id=m.message_id),
                    self.exchange, m.topic, mandatory=True)
                wave.append((self._tag, i, m))
            deadline = time.monotonic() + self.confirm_timeout
            while self._outstanding:
                self._conn.drain_events(timeout=max(0.01, deadline - time.monotonic()))
            next_active = []
            for tag, i, m in wave:
                if not self._acked.pop(tag, False):
                    failures[i] = (m.id, PublishFailure(FailureKind.BACKPRESSURE, "nacked by the broker"))
                elif m.message_id in self._returned:
                    self._returned.discard(m.message_id)
                    failures[i] = (m.id, PublishFailure(FailureKind.RETRIABLE, f"unroutable: {m.topic!r}"))
                else:
                    published[i].append(m.id)
                    position[i] += 1
                    if position[i] < len(chains[i]):
                        next_active.append(i)
            active = next_active
        return [ChainResult(tuple(published[i]), *(failures[i] if i in failures else (None, None)))
                for i in range(len(chains))]


def handle_publish_batched(store: Any, publisher: Any, chains: Any, *, deadline: float | None = None,
                           options: Any = None, breaker: Any = None, settler: Any = None,
                           stopping: Any = lambda: False, now: Any = time.time, **_: Any) -> list[Any]:
    """``outbox.relay.handle_publish`` with waves and one ``mark_done`` per task (per lease).
    Failure handling is deliberately simple (the failed event is failed with a back-off, the
    rest of its chain released): enough for a benchmark where nothing fails."""
    from outbox.relay import ChainOutcome, RelayOptions, Settler, retry_delay

    options = options or RelayOptions()
    settler = settler or Settler(store)
    chains = [list(c) for c in chains if c]
    if not chains:
        return []
    if (deadline is not None and now() > deadline) or stopping() or (breaker is not None and breaker.open_for() > 0):
        for c in chains:
            settler.release(c)
        return [ChainOutcome(skipped=True, released=[m.id for m in c]) for c in chains]
    if hasattr(publisher, "publish_chains"):
        results = publisher.publish_chains(chains)
    else:  # the shipped KombuPublisher: stop-and-wait, chain after chain
        results = [publisher.publish_chain(c) for c in chains]
    done_by_lease: dict[str, list[int]] = {}
    outcomes = []
    for chain, result in zip(chains, results):
        outcome = ChainOutcome(published=list(result.published))
        done_by_lease.setdefault(chain[0].lease, []).extend(result.published)
        rest = chain[len(result.published):]
        if rest:
            failing = rest[0]
            outcome.failed_id, outcome.kind = failing.id, getattr(result.failure, "kind", None)
            settler.failed(failing, f"{outcome.kind}: {getattr(result.failure, 'reason', '')}",
                           retry_delay(failing.attempt, options.backoff_base_s, options.backoff_max_s))
            settler.release(rest[1:])
            outcome.released = [m.id for m in rest[1:]]
        outcomes.append(outcome)
    for lease, ids in done_by_lease.items():
        settler.done(ids, lease)
    return outcomes


def install_inline_publish() -> None:
    """Prototype 3: a claim that came back small (one publish task's worth, not full) publishes
    it itself instead of sending it through Celery's broker. Live traffic is exactly that
    case: it saves a whole Celery hop (Redis LPUSH, the parent's BRPOP, the pipe to a pool
    process, the task's own overhead) on every event's path. A full claim (a backlog) still
    dispatches all its tasks, so both pool processes keep publishing."""
    import outbox.tasks as tasks
    from outbox.relay import message_to_dict

    original = tasks.handle_claim

    def handle_claim_inline(store: Any, dispatch: Any, **kwargs: Any) -> Any:
        collected: list[tuple[Any, float]] = []
        outcome = original(store, lambda chains, deadline: collected.append((chains, deadline)), **kwargs)
        if len(collected) == 1 and not outcome.more:  # a small (live) claim: publish it here
            chains, deadline = collected[0]
            tasks.publish.run(chains=[[message_to_dict(m) for m in c] for c in chains], deadline=deadline)
        else:  # a backlog: keep every pool process busy
            for chains, deadline in collected:
                dispatch(chains, deadline)  # a failure here leaves the rows to lease recovery (prototype)
        return outcome

    tasks.handle_claim = handle_claim_inline


def install(waves: bool = True, batched_ack: bool = True, inline: bool = False) -> None:
    """Patch the relay's task module in this process (and so in the prefork children)."""
    import outbox.tasks as tasks

    if inline:
        install_inline_publish()
    if waves:
        tasks.make_publisher = lambda settings: WavePublisher.from_settings(settings)
    if batched_ack:
        tasks.handle_publish = handle_publish_batched


__all__ = ["WavePublisher", "handle_publish_batched", "install"]
