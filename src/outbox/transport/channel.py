"""The kombu transport on queue tables: ``outboxdb+<database URL>`` as Celery's broker.

Built on ``kombu.transport.virtual`` (kombu's base for brokers that are not AMQP),
with the SQL in ``outbox.transport.tables.base`` and its engine modules. What this module
adds to the virtual transport, and why:

- **Leases instead of delete-on-receive.** ``_get``/``drain_events`` lease rows
  (invisible for ``visibility_timeout`` seconds, with a receipt); the QoS deletes a
  row on ack, makes it visible again on reject/requeue and on a warm shutdown, and a
  worker that dies without either leaves the lease to run out: the message comes
  back after the visibility timeout. Delivery is at least once.
- **Shared routing.** Bindings live in a table, so every process routes direct,
  topic and fanout messages the same way; Celery's remote control (a fanout
  exchange plus reply queues) and events work across processes.
- **Native delays.** A message whose Celery ``eta`` header lies ahead is stored
  invisible until then: no worker holds it in memory, none redelivers it early.
  ``expiration`` (per-message TTL) becomes ``expires_at``: never delivered after it,
  purged in chunks by the receive loop, idle or not; except a Celery task's ``expires``, which the
  worker must see to mark the task REVOKED.
- **Prompt remote control.** Where sends wake nobody, the idle back-off stops short
  while kombu's pidbox queues are consumed, and after an idle spell control messages are
  delivered before tasks (a revoke beats the task sent after it).
- **Adaptive polling.** One probe per poll covers every consumed queue; while
  messages flow the loop polls again at once, when idle it backs off (doubling,
  with jitter against herds of workers polling in step) up to ``polling_interval``.
- **Batches.** A poll leases up to what the prefetch window allows (capped by
  ``receive_batch``) in one statement per queue.

The database connection and its retries are ``transport.database``; what a stored message
looks like (envelope, delays, expiry, delivery tags) is ``transport.messages``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from queue import Empty
from typing import Any

from kombu.transport import virtual

from ..core.errors import BrokerDatabaseUnavailable, ConfigError
from .database import Database, database_url_of, driver_errors, is_own_database, split_password, with_password
from .messages import (
    celery_expires,
    check_name,
    encode_envelope,
    eta_delay_ms,
    is_control_queue,
    is_reply_queue,
    make_tag,
    split_tag,
    ttl_ms,
)
from .options import SCHEME
from .tables.base import DEFAULT_QUEUE_TABLE, MessageRow, QueueTables

log = logging.getLogger("outbox.transport")


def _stop_deferred_pools() -> None:
    """Run the pool stops Celery's cold shutdown asked for inside its signal handler, which the
    worker's pool (``outbox.transport.prefork``, loaded only there) left to the main thread
    while it is outside the transport's locks (docs/transport.md, "A cold shutdown ends")."""
    prefork = sys.modules.get("outbox.transport.prefork")
    if prefork is not None and prefork.deferred:
        prefork.stop_deferred_pools()

#: (process, database URL, table, remote-control queue) -> when this process began consuming
#: it. Kept across a close that follows the loss of the database, so the channel Celery
#: reconnects on still runs the commands sent to this live worker meanwhile; forgotten when the
#: last consumer of the queue cancels otherwise (``Channel._sent_to_an_earlier_consumer``).
_consumed_since: dict[tuple[int, str, str, str], float] = {}


class QoS(virtual.QoS):
    """Prefetch accounting from kombu, settlement in the table: ack deletes the row,
    reject deletes it or (requeue) makes it visible again, both fenced by the lease's
    receipt, so a late ack for a lease that ran out changes nothing."""

    # kombu declares these None on the class (mypy infers that type) and sets them in __init__.
    _delivered: OrderedDict[str, Any]  # type: ignore[assignment]
    _dirty: set[str]  # type: ignore[assignment]

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        #: Tags a close left to their lease (``restore_unacked``): their ack or reject still settles.
        self._left_leased: set[str] = set()

    def _unsettled(self, delivery_tag: str) -> bool:
        """Is ``delivery_tag``'s row still ours to settle? Delivered and not acked yet, or
        left to its lease by a close (taken from that set here, so it settles once)."""
        try:
            self._left_leased.remove(delivery_tag)
            return True
        except KeyError:
            return delivery_tag in self._delivered and delivery_tag not in self._dirty

    # The tag leaves the prefetch window whatever the settle's outcome: a settle that fails
    # leaves the row leased, back after the visibility timeout, and a tag kept in the window
    # would hold its slot for the life of the channel (docs/transport.md, "Guarantees").
    def ack(self, delivery_tag: str) -> None:
        try:
            if self._unsettled(delivery_tag):
                self.channel._settle(delivery_tag, requeue=False)
        finally:
            super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            if self._unsettled(delivery_tag):
                self.channel._settle(delivery_tag, requeue=requeue)
        finally:
            self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list:
        """Warm shutdown, channel close: hand every unsettled message back at once (rather
        than leaving it to the visibility timeout); except after the broker's database was
        lost, when the messages are left leased and their late acks still settle them
        (docs/transport.md, "Guarantees"). The loss is the connection's own (``Transport.lost_database``):
        another thread's statement that succeeds in between must not make it a requeue."""
        self._flush()
        left = 0
        while self._delivered:
            tag, _ = self._delivered.popitem()
            if not self.channel.connection.lost_database():
                try:
                    self.channel._settle(tag, requeue=True)
                    continue
                except Exception as exc:  # noqa: BLE001 - the row stays leased either way
                    log.warning("outboxdb: cannot hand back message %s (%s)", split_tag(tag)[0], exc)
            self._left_leased.add(tag)
            left += 1
        if left:
            log.warning("outboxdb: %d unacked message(s) left leased: settled by their ack if it comes, "
                        "else delivered again after visibility_timeout=%ss", left, self.channel.visibility_timeout)
        return []


class Channel(virtual.Channel):
    QoS = QoS
    supports_fanout = True
    do_restore = True

    #: Seconds a received message stays invisible before it is delivered again.
    visibility_timeout: float = 3600.0
    #: Most messages one poll leases from one queue.
    receive_batch: int = 10
    #: Message table (the bindings table is ``<queue_table>_binding``).
    queue_table: str = DEFAULT_QUEUE_TABLE
    #: Schema (SQL Server, PostgreSQL) or database (MySQL) of the tables.
    queue_schema: str | None = None
    #: Create the tables on first use (else only check them and warn).
    create_tables: bool = True
    #: Seconds between two chunks of the expired-message purge (0 turns it off).
    expired_purge_interval: float = 60.0
    #: Rows per purge chunk.
    expired_purge_batch: int = 1000
    #: Seconds a direct/topic exchange's bindings are cached before re-reading them.
    binding_cache_ttl: float = 1.0
    #: Wake idle receivers at once on a send where the engine can (PostgreSQL LISTEN/NOTIFY).
    wake: bool = True

    # kombu's own tuple is inferred as exactly its two names; ours extends it.
    from_transport_options: tuple[str, ...] = virtual.Channel.from_transport_options + (  # type: ignore[assignment]
        "visibility_timeout", "receive_batch", "queue_table", "queue_schema", "create_tables",
        "expired_purge_interval", "expired_purge_batch", "binding_cache_ttl", "wake")

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._no_ack_queues: set[str] = set()
        #: Auto-delete and exclusive queues declared here: deleted when their last consumer here goes.
        self._auto_delete: set[str] = set()
        #: Remote-control queue -> when this channel began consuming it (``_sent_to_an_earlier_consumer``).
        self._consuming_since: dict[str, float] = {}
        self._binding_cache: dict[str, tuple[float, list]] = {}
        #: Queue -> x-message-ttl (ms): from this process's declarations and from bindings read.
        self._queue_ttl: dict[str, int] = {}
        self._start = 0
        self._busy = True
        self._next_purge = time.monotonic() + random.uniform(0, max(self.expired_purge_interval, 0))
        self._validate()
        self.db: Database = connection.database(self.queue_table, self.queue_schema, self.create_tables,
                                                bool(self.wake))

    def _validate(self) -> None:
        if not (0 < float(self.visibility_timeout) <= 86_400 * 30):
            raise ConfigError(f"outboxdb transport option visibility_timeout={self.visibility_timeout!r} "
                              "must be > 0 and at most 30 days (seconds)")
        if not (1 <= int(self.receive_batch) <= 1000):
            raise ConfigError(f"outboxdb transport option receive_batch={self.receive_batch!r} must be 1..1000")

    # -- publishing ----------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.db.run(lambda qt, c: self._insert(qt, c, queue, message), alone=self.db.qt.writes_alone)
        self._wake([queue])

    def _wake(self, queues: list[str]) -> None:
        """After a send's commit: wake idle receivers, in a statement of its own that commits
        without waiting for the disk (PostgreSQL: docs/transport.md, "Receiving and polling").
        Best effort: the message is stored, and a send raised now would be sent again; a
        receiver not woken finds it at its next poll."""
        if not (queues and self.db.qt.wakes_on_send):
            return
        try:
            self.db.connections.run("wake", lambda cursor: self.db.qt.wake(cursor, queues), attempts=1, alone=True)
        except Exception as exc:  # noqa: BLE001 - a wake-up lost: receivers poll
            log.debug("outboxdb: cannot wake receivers of %s (%s)", queues, exc)

    def _insert(self, qt: QueueTables, cursor: Any, queue: str, message: dict[str, Any]) -> None:
        check_name("queue", queue)
        envelope = {k: v for k, v in message.items() if k != "body"}
        headers = envelope.get("headers")
        ttl = None if celery_expires(headers) else ttl_ms(envelope.get("properties") or {})
        if ttl is None:
            ttl = self._queue_ttl.get(queue)
        qt.put(cursor, queue, encode_envelope(envelope), message.get("body"),
               delay_ms=eta_delay_ms(headers), ttl_ms=ttl, wake=False)

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        """A copy for every queue bound to the exchange, in one transaction (begun explicitly:
        SQLite's connection would otherwise commit each copy by itself)."""
        def work(qt: QueueTables, cursor: Any) -> list[str]:
            qt.engine.begin(cursor)
            queues = []
            for binding in qt.table_bindings(cursor, exchange):
                if binding.message_ttl_ms is not None:
                    self._queue_ttl[binding.queue] = binding.message_ttl_ms
                self._insert(qt, cursor, binding.queue, message)
                queues.append(binding.queue)
            return queues
        self._wake(self.db.run(work))

    # -- routing -----------------------------------------------------------------------
    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        for kind, value in (("exchange", exchange), ("routing key", routing_key), ("queue", queue)):
            check_name(kind, value or "")
        ttl = self._queue_ttl.get(queue)
        self.db.run(lambda qt, c: qt.bind(c, exchange, routing_key or "", pattern or "", queue, ttl))
        self._binding_cache.pop(exchange, None)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        self.db.run(lambda qt, c: qt.unbind(c, exchange or "", routing_key or "", queue))
        self._binding_cache.pop(exchange or "", None)

    def get_table(self, exchange: str) -> list[tuple[str, str | None, str]]:
        """The exchange's bindings from the table (shared by every process)."""
        cached = self._binding_cache.get(exchange)
        if cached and time.monotonic() - cached[0] < self.binding_cache_ttl:
            return cached[1]
        rows = self.db.run(lambda qt, c: qt.table_bindings(c, exchange))
        self._queue_ttl.update({b.queue: b.message_ttl_ms for b in rows if b.message_ttl_ms is not None})
        table = [(b.routing_key, b.pattern or None, b.queue) for b in rows]
        self._binding_cache[exchange] = (time.monotonic(), table)
        return table

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        queues = super()._lookup(exchange, routing_key, default)
        if exchange and not queues:
            # A binding made in another process since the cache was filled (a reply
            # queue, a new worker's queue): read once more before dropping the message.
            self._binding_cache.pop(exchange, None)
            queues = super()._lookup(exchange, routing_key, default)
        return queues

    # -- queues ----------------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        """Queues need no DDL: a queue is the rows that carry its name. Its
        ``x-message-ttl`` is remembered and stored with its bindings, so that every
        publisher applies it (Celery's event and gossip queues rely on it to stay
        small after their consumer is gone)."""
        ttl = (kwargs.get("arguments") or {}).get("x-message-ttl")
        if ttl is not None:
            self._queue_ttl[queue] = max(int(float(ttl)), 0)
        if kwargs.get("auto_delete") or kwargs.get("exclusive"):
            self._auto_delete.add(queue)

    def prepare_queue_arguments(self, arguments: dict | None, **kwargs: Any) -> dict:
        """kombu's ``Queue(message_ttl=seconds)`` as AMQP's ``x-message-ttl`` (ms)."""
        args = dict(arguments or {})
        if kwargs.get("message_ttl") is not None:
            args.setdefault("x-message-ttl", int(float(kwargs["message_ttl"]) * 1000))
        return args

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return True

    def _size(self, queue: str) -> int:
        return self.db.run(lambda qt, c: qt.size(c, queue))

    def _purge(self, queue: str) -> int:
        return self.db.run(lambda qt, c: qt.purge(c, queue))

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> None:
        if if_empty and self.db.run(lambda qt, c: qt.holds_any(c, queue)):
            return  # leased messages too: a receiver that dies or requeues hands them back
        self.db.run(lambda qt, c: qt.delete_queue(c, queue))
        self.state.queue_bindings_delete(queue)
        self._binding_cache.clear()

    # -- receiving ---------------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        if is_control_queue(queue):
            since = _consumed_since.setdefault(self._since_key(queue), time.time())
            self._consuming_since.setdefault(queue, since)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _since_key(self, queue: str) -> tuple[int, str, str, str]:
        return os.getpid(), self.db.url, self.db.qt.table, queue

    def basic_cancel(self, consumer_tag: str) -> None:
        """The last consumer of a queue here gone: an auto-delete or exclusive queue declared
        here is deleted, bindings and messages, unless the database is lost (docs/transport.md,
        "Auto-delete and exclusive queues go with their last consumer")."""
        queue = self._tag_to_queue.get(consumer_tag)
        super().basic_cancel(consumer_tag)
        if self.connection is None:
            # A closed channel (kombu unhooks it): its close cancelled every consumer already.
            # Celery cancels its consumers again when it reconnects after a lost database.
            return
        if not any(getattr(ch, "_consumers", None) and getattr(ch, "db", None) is self.db
                   for ch in self.connection.channels):
            # Nothing consumes this table here any more: a LISTEN connection left open and
            # unread would hold the server's notification queue (docs/transport.md,
            # "Receiving and polling").
            self.db.stop_listening()
        if queue is None or queue in self._tag_to_queue.values():
            return
        self._no_ack_queues.discard(queue)
        self._consuming_since.pop(queue, None)
        if not self.connection.lost_database():
            _consumed_since.pop(self._since_key(queue), None)
        if queue in self._auto_delete and not self.connection.lost_database():
            self._auto_delete.discard(queue)
            try:
                self.queue_delete(queue)
            except Exception as exc:  # noqa: BLE001 - a cancel (a close) must not fail on it
                log.warning("outboxdb: cannot delete auto-delete queue %s (%s)", queue, exc)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None and no_ack:
            self._settle(message.delivery_tag, requeue=False)
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        rows = self._lease([queue], 1)
        if not rows:
            raise Empty()
        # A doubtful lease taken back (_lease_queue) may hold a whole batch: the rest is
        # handed back at once, not left leased to nobody for visibility_timeout.
        self._hand_back(rows[1:])
        return rows[0][1]

    def drain_events(self, timeout: float | None = None, callback: Callable | None = None) -> None:
        """Lease what the prefetch window allows from the consumed queues and deliver
        it; ``Empty`` when there is nothing (the transport then backs off)."""
        callback = callback or self.connection._deliver
        if not (self._consumers and self.qos.can_consume()):
            raise Empty()
        allowed = self.qos.can_consume_max_estimate()
        limit = min(allowed, self.receive_batch) if allowed else self.receive_batch
        rows = self._lease(list(self._active_queues), max(limit, 1))
        if not rows:
            raise Empty()
        for index, (queue, payload) in enumerate(rows):
            try:
                callback(payload, queue)
            except BaseException:
                # The rest of the batch would stay leased, unseen, for the visibility timeout.
                self._hand_back(rows[index + 1:])
                raise

    def _hand_back(self, rows: list[tuple[str, dict[str, Any]]]) -> None:
        """Make leased rows that will not be delivered visible again at once (best effort)."""
        for _, payload in rows:
            with contextlib.suppress(Exception):
                self._settle(payload["properties"]["delivery_tag"], requeue=True)

    def _lease(self, queues: list[str], limit: int) -> list[tuple[str, dict[str, Any]]]:
        if not queues:
            return []
        queues = list(OrderedDict.fromkeys(queues))
        if not self._busy and not self.db.run(lambda qt, c: qt.probe(c, queues)):
            return []  # idle: one cheap read for all queues, no locks taken
        # Start at a different queue each time, so a busy queue cannot starve the rest.
        self._start = (self._start + 1) % len(queues)
        order = queues[self._start:] + queues[:self._start]
        visibility_ms = int(float(self.visibility_timeout) * 1000)
        got: list[tuple[str, dict[str, Any]]] = []
        for queue in order:
            if len(got) >= limit:
                break
            try:
                got.extend(self._lease_queue(queue, limit - len(got), visibility_ms))
            except Exception as exc:
                if not got:
                    raise
                # The queues before this one are leased to this channel: deliver them, or they
                # would wait, leased to nobody, for visibility_timeout; the next lease meets
                # the failure again (docs/transport.md, "Guarantees").
                log.warning("outboxdb: cannot lease from queue %s (%s: %s); delivering the %d message(s) "
                            "leased from the others first", queue, type(exc).__name__, exc, len(got))
                break
        self._busy = bool(got)
        return got

    def _lease_queue(self, queue: str, limit: int, visibility_ms: int) -> list[tuple[str, dict[str, Any]]]:
        doubtful = self.db.doubtful(queue)
        receipt = doubtful or uuid.uuid4().hex

        def lease(qt: QueueTables, cursor: Any, attempt: int) -> list[MessageRow]:
            # A retry after a lost connection first takes what the try before leased, in case
            # its COMMIT went through and only the answer was lost (docs/transport.md, "A lease
            # whose COMMIT's answer is lost"): else those rows would wait, leased to nobody, for
            # visibility_timeout. So does the next lease after one whose every try failed.
            held = qt.leased(cursor, queue, receipt) if attempt > 1 or doubtful else []
            if len(held) >= limit:
                return held
            return held + qt.lease(cursor, queue, limit - len(held), visibility_ms, receipt)

        try:
            rows, _ = self.db.run_counting(lease, alone=self.db.qt.writes_alone)
        except BrokerDatabaseUnavailable:
            self.db.doubt(queue, receipt)
            raise
        no_ack = queue in self._no_ack_queues
        if rows and no_ack:
            self.db.run(lambda qt, c: [qt.ack(c, r.id, receipt) for r in rows])  # no_ack: consumed on receipt
        got = []
        for row in rows:
            try:
                payload = self._payload(row, receipt)
            except ValueError as exc:  # not an envelope: no message this transport wrote (docs/transport.md, "Guarantees")
                log.error("outboxdb: message %s of queue %s cannot be decoded (%s: %s; headers %r): deleted, as "
                          "Celery acks a message it cannot decode", row.id, queue, type(exc).__name__, exc,
                          str(row.headers)[:200])
                if not no_ack:
                    self._settle(make_tag(row.id, receipt), requeue=False)
                continue
            if self._sent_to_an_earlier_consumer(queue, payload):
                log.info("outboxdb: dropped a remote-control command sent to %s before this consumer began", queue)
                if not no_ack:
                    self._settle(payload["properties"]["delivery_tag"], requeue=False)
                continue
            got.append((queue, payload))
        return got

    def _sent_to_an_earlier_consumer(self, queue: str, payload: dict[str, Any]) -> bool:
        """A remote-control command whose ``expires`` (the send plus the client's timeout) passed
        before this process began consuming its queue: sent to a consumer gone since, not run
        (docs/transport.md, "Auto-delete and exclusive queues go with their last consumer"). A
        channel Celery reconnects on after a lost database counts from the first consumer's
        start (``_consumed_since``): what was sent meanwhile was meant for this worker. That start
        is no later than now: after the host's clock stepped back, it lay in the future, and every
        command sent to this live worker was dropped for the length of the step (found in review)."""
        since = self._consuming_since.get(queue)
        expires = (payload.get("headers") or {}).get("expires")
        return since is not None and isinstance(expires, int | float) and 0 < expires < min(since, time.time())

    def _payload(self, row: MessageRow, receipt: str) -> dict[str, Any]:
        """The kombu payload of a leased row; ValueError when its headers are not an envelope
        (not JSON, or JSON of another shape): a damaged row (docs/transport.md, "Guarantees")."""
        payload = json.loads(row.headers)
        if not isinstance(payload, dict):
            raise ValueError(f"the envelope is a JSON {type(payload).__name__}, not an object")
        properties = payload.setdefault("properties", {})
        if not isinstance(properties, dict):
            raise ValueError("the envelope's properties are not an object")
        if not isinstance(properties.setdefault("delivery_info", {}), dict):
            raise ValueError("the envelope's delivery_info is not an object")
        if not isinstance(payload.get("headers") or {}, dict):
            raise ValueError("the envelope's headers are not an object")
        payload["body"] = row.body
        properties["delivery_tag"] = make_tag(row.id, receipt)  # ack/reject parse it (split_tag)
        info = properties["delivery_info"]
        info["redelivered"] = row.deliveries > 1
        payload["redelivered"] = row.deliveries > 1
        return payload

    def _settle(self, delivery_tag: str, requeue: bool) -> None:
        row_id, receipt = split_tag(delivery_tag)

        def settle(qt: QueueTables, cursor: Any, attempt: int) -> int:
            return qt.release(cursor, row_id, receipt) if requeue else qt.ack(cursor, row_id, receipt)

        what = "requeue" if requeue else "ack"
        changed, tries = self.db.run_counting(settle, alone=self.db.qt.writes_alone)
        if changed:
            return
        if tries > 1:  # the try before committed and only its answer was lost: done already
            log.debug("outboxdb: %s of message %s was done by a try whose answer was lost", what, row_id)
        else:
            log.warning("outboxdb: %s of message %s changed nothing: its lease ran out (visibility_timeout=%ss) "
                        "and it was delivered again", what, row_id, self.visibility_timeout)

    def _restore(self, message: Any) -> None:
        self._settle(message.delivery_tag, requeue=True)

    def _restore_at_beginning(self, message: Any) -> None:
        self._settle(message.delivery_tag, requeue=True)

    #: Most chunks one purge deletes (it goes on while full chunks come back).
    expired_purge_chunks = 10

    def _maybe_purge_expired(self) -> None:
        """Once per ``expired_purge_interval``: delete expired rows of every queue, chunk after
        chunk while full chunks come back, at most ``expired_purge_chunks`` (the transport's
        poll runs it, idle or not: docs/transport.md, "Delays and expiry")."""
        if self.expired_purge_interval <= 0 or time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + float(self.expired_purge_interval)
        batch = max(int(self.expired_purge_batch), 1)
        total = 0
        for _ in range(self.expired_purge_chunks):
            purged = self.db.run(lambda qt, c: qt.purge_expired(c, batch))
            total += purged
            if purged < batch:
                break
        if total:
            log.info("outboxdb: purged %d expired message(s)", total)


class Transport(virtual.Transport):
    """``outboxdb+<database URL>``: Celery's broker on the database's queue tables."""

    Channel = Channel
    # kombu declares these None on the class (mypy infers that type) and sets them in __init__.
    channels: list[Any]  # type: ignore[assignment]
    cycle: Any  # kombu's FairCycle
    #: kombu's Connection reads these from the CLASS (``get_transport_cls()``), and Celery
    #: decides from them whether a broker error means "reconnect" or "stop the worker".
    #: The driver is known only per URL, so ``Database.run`` raises every lost connection
    #: as BrokerDatabaseUnavailable; the instance adds the URL's driver classes too.
    connection_errors: tuple[Any, ...] = virtual.Transport.connection_errors + (BrokerDatabaseUnavailable,)
    can_parse_url = True
    driver_type = "sql"
    driver_name = SCHEME
    #: The idle ceiling: an idle consumer polls at most this often (seconds).
    polling_interval = 1.0
    #: First back-off step after an empty poll (seconds); it doubles up to polling_interval.
    polling_interval_min = 0.01
    #: The idle ceiling while a remote-control (pidbox) queue is consumed and sends do not
    #: wake receivers (every engine but PostgreSQL): Celery's replies are awaited 1 s.
    control_polling_interval = 0.25
    #: The idle ceiling while a reply queue of remote control is consumed (a client awaiting replies).
    reply_polling_interval = 0.05

    implements = virtual.Transport.implements.extend(
        asynchronous=False, exchange_type=frozenset(["direct", "topic", "fanout"]), heartbeats=False)

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        # The URL's password moves to kombu's password field, which Celery's `inspect stats`
        # leaves out of its reply (the hostname it shows in full); a clone carries both back.
        hostname, password = split_password(client.hostname or "")
        if password is not None:
            client.hostname, client.password = hostname, password
        url = client.hostname
        self.database_url = database_url_of(with_password(url, client.password) if url else url)
        #: ``outboxdb://``: the outbox's own database, whose SQLite file `outbox migrate` alone
        #: makes (``Engine.creates_database``); a broker database of its own is made by the first
        #: worker. The transport made the outbox's, where a worker ran in another directory than
        #: migrate's, and the relay then said to run `outbox migrate` there (found in review).
        self.own_database = is_own_database(url)
        conn_errors, chan_errors = driver_errors(self.database_url)
        self.connection_errors = type(self).connection_errors + conn_errors
        self.channel_errors = virtual.Transport.channel_errors + chan_errors
        options = client.transport_options
        self.polling_interval_min = float(options.get("polling_interval_min", self.polling_interval_min))
        if not (0 < self.polling_interval_min <= float(self.polling_interval) <= 60):
            raise ConfigError("outboxdb transport options: need 0 < polling_interval_min <= polling_interval <= 60 "
                              f"(got {self.polling_interval_min!r} and {self.polling_interval!r})")
        self.control_polling_interval = float(options.get("control_polling_interval",
                                                          self.control_polling_interval))
        if not (0 < self.control_polling_interval <= 60):
            raise ConfigError("outboxdb transport option control_polling_interval="
                              f"{self.control_polling_interval!r} must be > 0 and at most 60 (seconds)")
        self._sleep = self.polling_interval_min
        self._control_first = False
        self._next_poll = 0.0
        #: While the prefetch window stays full, when the database is next polled (its other
        #: channels, remote control): until then only the window is looked at.
        self._full_poll_due = 0.0
        self._databases: dict[tuple[str, str | None], Database] = {}

    def database(self, table: str, schema: str | None, create: bool, wake: bool = True) -> Database:
        key = (table, schema)
        if key not in self._databases:
            db = Database(self.database_url, table, schema, bool(create), wake)
            db.engine.creates_database = not self.own_database
            self._databases[key] = db
        return self._databases[key]

    def _prefetch_full(self) -> bool:
        return any(ch._consumers and not ch.qos.can_consume() for ch in self.channels
                   if getattr(ch, "_consumers", None))

    def _probe_idle_channels(self) -> bool:
        """While every consuming channel is idle, ONE probe covers the queues of all of
        them (a Celery worker consumes its task queues and its control queue on two
        channels): False means nothing is deliverable anywhere. A hit marks the channels
        busy, so each leases without probing again."""
        consuming = [ch for ch in self.channels if getattr(ch, "_consumers", None)]
        if not consuming or any(ch._busy for ch in consuming) or len({id(ch.db) for ch in consuming}) != 1:
            return True
        queues = list(dict.fromkeys(q for ch in consuming for q in ch._active_queues))
        if not consuming[0].db.run(lambda qt, c: qt.probe(c, queues)):
            return False
        for ch in consuming:
            ch._busy = True
        self._control_first = True
        return True

    def _purge_expired(self) -> None:
        """Each consuming channel's purge of expired rows, when due: before the idle probe, so
        an idle worker purges too (expired rows lie in queues nobody consumes: a gone worker's
        pidbox, events)."""
        for channel in self.channels:
            if getattr(channel, "_consumers", None):
                channel._maybe_purge_expired()

    def _consumed_queues(self) -> set[str]:
        return {q for ch in self.channels if getattr(ch, "_consumers", None) for q in ch._active_queues}

    def _ceiling(self) -> float:
        """The idle back-off ceiling: ``polling_interval``, shorter while remote control is
        consumed on a table whose sends wake nobody (docs/transport.md, "Control commands and events")."""
        ceiling = float(self.polling_interval)
        control = [q for q in self._consumed_queues() if is_control_queue(q)]
        if not control or all(db.wakes_on_send() for db in self._databases.values()):
            return ceiling
        if any(is_reply_queue(q) for q in control):
            return min(ceiling, self.reply_polling_interval)
        return min(ceiling, self.control_polling_interval)

    def _drain_control_first(self) -> bool:
        """After an idle spell, deliver what waits in remote-control queues before any task:
        a revoke sent just before its task reaches the worker first. True if one did."""
        if not self._control_first:
            return False
        self._control_first = False
        for channel in self.channels:
            queues = getattr(channel, "_active_queues", None)
            if getattr(channel, "_consumers", None) and queues and all(is_control_queue(q) for q in queues):
                try:
                    channel.drain_events(callback=self._deliver)
                    return True
                except Empty:
                    pass
        return False

    def _idle_wait(self, pause: float) -> bool:
        """Sleep ``pause`` seconds, or less when a send wakes the (single) queue table."""
        if len(self._databases) == 1:
            return next(iter(self._databases.values())).wait(pause)
        time.sleep(pause)
        return False

    def establish_connection(self) -> Transport:
        conn = super().establish_connection()
        for channel in self._avail_channels:
            channel.db.run(lambda qt, c: None)  # connect now: bad URLs and credentials fail at start-up
        for db in self._databases.values():
            db.lost = False  # a failed try of this connection (kombu retries on this transport) is over
        return conn

    def lost_database(self) -> bool:
        """Did a statement of this connection, on any of its queue tables, run out of its
        retries since the connection was established? Then its close is the one Celery makes
        to reconnect, tasks of its unacked messages may still run, and the close leaves them
        leased and deletes nothing. It stays so, whatever succeeds after it on other threads
        (docs/transport.md, "Guarantees")."""
        return any(db.lost for db in self._databases.values())

    def close_connection(self, connection: Any) -> None:
        super().close_connection(connection)
        for db in self._databases.values():
            db.close()

    # kombu's base Transport types it drain_events(connection, **kwargs); this is virtual.Transport's.
    def drain_events(self, connection: Any, timeout: float | None = None) -> None:  # type: ignore[override]
        """Deliver what one poll finds. While nothing comes, wait between polls, the
        wait doubling from ``polling_interval_min`` to ``polling_interval`` with ±25%
        jitter (so workers do not poll in step); a send wakes the wait where the engine
        can. The schedule outlives the call: Celery calls this every 2 s with a timeout,
        and a call that starts mid-wait finishes that wait instead of polling at once.
        ``socket.timeout`` once ``timeout`` has passed."""
        _stop_deferred_pools()
        try:
            self._drain_events(timeout)
        finally:
            _stop_deferred_pools()

    def _drain_events(self, timeout: float | None) -> None:
        started = time.monotonic()
        while True:
            now = time.monotonic()
            ceiling = self._ceiling()
            self._next_poll = min(self._next_poll, now + ceiling * 1.25)  # a consumer that just came needs it
            if now < self._next_poll:
                left = None if timeout is None else started + timeout - now
                if left is not None and left <= 0:
                    raise TimeoutError()
                pause = self._next_poll - now if left is None else min(self._next_poll - now, left)
                if self._idle_wait(pause):
                    # Woken by a send: look now. The back-off stays where it was: every send on
                    # the table wakes every idle consumer of it, and one that finds nothing for
                    # itself waits for the next wake-up, not 10 ms (docs/transport.md,
                    # "Receiving and polling"); a delivery restarts the back-off below.
                    self._next_poll, self._full_poll_due = 0.0, 0.0
                continue
            polled = False
            try:
                if now < self._full_poll_due and self._prefetch_full():
                    raise Empty()  # only an ack can change anything: the database is polled on its schedule
                polled = True
                for db in self._databases.values():
                    db.read_wake_ups()  # a consumer that never waits idle reads them here
                self._purge_expired()
                if not self._probe_idle_channels():
                    raise Empty()
                if not self._drain_control_first():
                    self.cycle.get(self._deliver, timeout=timeout)
            except Empty:
                if self._prefetch_full():
                    # Not idle: the prefetch window is full and acks (from the pool's
                    # threads) will open it soon. Look again shortly, without backing off,
                    # but poll the database (the other channels: remote control) no more
                    # often than an idle consumer would, unless a send wakes it
                    # (docs/transport.md, "Receiving and polling").
                    self._next_poll = time.monotonic() + self.polling_interval_min
                    if polled:
                        self._full_poll_due = time.monotonic() + ceiling
                else:
                    self._next_poll = time.monotonic() + min(self._sleep, ceiling) * random.uniform(0.75, 1.25)
                    self._sleep = min(self._sleep * 2, ceiling)
                if timeout is not None and time.monotonic() - started >= timeout:
                    raise TimeoutError() from None
            else:
                self._sleep, self._next_poll = self.polling_interval_min, 0.0
                return

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"hostname": None, "port": None}
