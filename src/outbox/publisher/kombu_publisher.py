"""``KombuPublisher``: confirms in waves over kombu (docs/publisher.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError, transport_hint
from ..core.model import OutboxMessage
from ..core.redact import redact
from ..core.tls import kombu_connection

if TYPE_CHECKING:
    from ..core.config import Settings

from .contract import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_ERROR_HEADER_CHARS,
    UNROUTABLE_POLICIES,
    ChainResult,
    FailureKind,
    Pipelined,
    Publisher,
    PublishFailure,
    publish_budget_s,
)
from .failures import _connection_lost, failure_from
from .frames import PublishFrames
from .message import _encoding_problem, build_headers, carriable_ids, encode_body, poison_check
from .waves import RETURNED, ChainProgress, Refused, Wave, next_wave, settle_wave

log = logging.getLogger("outbox.publisher")  # one logger for the whole publisher package

# -- the kombu publisher -----------------------------------------------------------------------

#: A wave's frames are written once this much payload is waiting: one write for a wave of
#: ordinary events, and large payloads never held twice for the whole wave (memory bound).
_WRITE_BYTES = 512 * 1024

#: The longest a wave waits for its confirms, unless the lease allows less
#: (``from_settings``): then the wave's rows go back as back-pressure, no attempt spent.
DEFAULT_CONFIRM_TIMEOUT_S = 15.0

#: The least a network step is given, even at its deadline: a zero socket timeout would make
#: the socket non-blocking, which is not a shorter wait (the deadline is checked before each
#: wave and each Redis send, so nothing is begun once it has passed).
MIN_WAIT_S = 0.05

#: The pauses between the attempts to connect: the first, the step it grows by, the longest.
_RECONNECT_PAUSE_S = (0.2, 0.3, 1.0)


def time_left(cap: float, deadline: float | None) -> float:
    """How long one network step may wait: ``cap``, or less when ``deadline`` (monotonic)
    comes sooner; ``MIN_WAIT_S`` at least (docs/relay.md, "The publish's deadline")."""
    if deadline is None:
        return cap
    return max(MIN_WAIT_S, min(cap, deadline - time.monotonic()))


def begin_at(conn: Any, first: int) -> Any:
    """``conn`` (kombu's ``Connection`` of a ``;``-separated list) switched to its alternate at
    ``first`` (modulo their number) as kombu's own failover switches (``maybe_switch_next``):
    where ``KombuPublisher`` begins its next connection. Not the list rotated as text: an
    alternate written as a host alone takes the scheme, TLS, port, user, password and vhost of
    the list's first URL, which kombu reads only when that URL comes first (found in review:
    ``test_a_host_only_alternate_keeps_the_first_urls_tls_after_the_first_host_failed``)."""
    for _ in range(first % max(1, len(conn.alt))):
        conn.maybe_switch_next()
    return conn


def past_deadline() -> PublishFailure:
    """What a chain not sent because its deadline had passed fails with."""
    return PublishFailure(FailureKind.BACKPRESSURE, "not sent: the claim's deadline passed before "
                          "it was (the lease's safe part is spent)")


def cap_redis_pool(pool: Any, seconds: float, connect_seconds: float) -> None:
    """Set the socket timeouts of a redis-py ``ConnectionPool``: of the connections it makes
    from now on (its ``connection_kwargs``) and of those it holds, on their sockets and in
    their parsers, which restore the timeout they were made with after each poll for data
    (``can_read``, on every checkout). redis-py has no per-call timeout and no public way to
    change a live connection's (docs/relay.md, "The publish's deadline"); these attributes
    are the same in redis-py 5 to 8, and each is read with ``getattr``: a redis-py that moved
    one leaves that part uncapped, it never fails a publish."""
    pool.connection_kwargs.update(socket_timeout=seconds, socket_connect_timeout=connect_seconds)
    held = (*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ()))
    for conn in held:
        conn.socket_timeout, conn.socket_connect_timeout = seconds, connect_seconds
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            sock.settimeout(seconds)
        parser: Any = getattr(conn, "_parser", None)
        buffer = getattr(parser, "_buffer", None)  # the pure-Python parsers
        if buffer is not None and hasattr(buffer, "socket_timeout"):
            buffer.socket_timeout = seconds
        if hasattr(parser, "_socket_timeout"):  # hiredis
            parser._socket_timeout = seconds


def refused_by_route(routing_key: str, exchange: str) -> PublishFailure:
    """The failure for a ``basic.nack``: a queue bound for ``routing_key`` refused the
    message (full with ``x-overflow: reject-publish``, or unavailable). Back-pressure of
    that route only."""
    return PublishFailure(FailureKind.BACKPRESSURE,
                          f"the broker refused the message (basic.nack): a queue bound for routing key "
                          f"{routing_key!r} on exchange {exchange!r} is full or unavailable", route=routing_key)


class KombuPublisher(Publisher):
    """``Publisher`` over any kombu transport; the strong guarantees need py-amqp (see the
    module docstring).

    Thread-safe (calls are serialized by a lock), fork-safe (one connection per process).
    """

    def __init__(self, url: str, exchange: str, *, dead_letter_exchange: str | None = None,
                 unroutable: str = "fail", max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 connect_timeout: float = 3.0, connect_retries: int = 1,
                 confirm_timeout: float = DEFAULT_CONFIRM_TIMEOUT_S) -> None:
        if unroutable not in UNROUTABLE_POLICIES:
            raise ValueError(f"unroutable={unroutable!r}: expected one of {', '.join(UNROUTABLE_POLICIES)}")
        if not exchange:
            raise ValueError("exchange must not be empty")
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be > 0")
        self.url = url
        self.exchange = exchange
        self.dead_letter_exchange = dead_letter_exchange or None
        self.unroutable = unroutable
        self.max_message_bytes = max_message_bytes
        self.connect_timeout = connect_timeout
        self.connect_retries = connect_retries
        self.confirm_timeout = confirm_timeout
        self._lock = threading.RLock()
        self._pid: int | None = None
        self._conn: Any = None  # kombu.Connection
        self._channel: Any = None
        self._producer: Any = None  # kombu.Producer
        self._confirms = False  # py-amqp: confirm mode + mandatory + returns
        self._driver = ""  # the kombu transport's driver: "py-amqp", "redis", "memory", ...
        #: Which of the URL's alternates the next connection begins at (``begin_at``): the one
        #: that worked last, or the one after the one that failed last (``_connect``).
        self._first_host = 0
        self._next_tag = 0  # the delivery tag of the last message sent on the channel
        self._unconfirmed: set[int] = set()  # delivery tags the broker has not acked or nacked yet
        self._nacked: set[int] = set()
        self._returned: set[str] = set()  # message ids the broker returned as unroutable
        self._encoders: dict[tuple[str, bool], PublishFrames] = {}  # per channel: (exchange, mandatory)

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> KombuPublisher:
        """Build from ``Settings``; options not (yet) in the settings may be passed in. The
        confirm timeout is at most the publish's part of the lease (``publish_budget_s``)."""
        options.setdefault("confirm_timeout", min(DEFAULT_CONFIRM_TIMEOUT_S, publish_budget_s(settings)))
        options.setdefault("dead_letter_exchange", getattr(settings, "dead_letter_exchange", None))
        options.setdefault("unroutable", getattr(settings, "publish_unroutable", None) or "fail")
        return cls(settings.publish_url, settings.exchange, **options)

    def __repr__(self) -> str:
        from kombu.utils.url import maybe_sanitize_url
        return f"<KombuPublisher {maybe_sanitize_url(self.url)} exchange={self.exchange!r}>"

    # -- public API ----------------------------------------------------------------
    def publish_chains(self, chains: Sequence[Sequence[OutboxMessage]], *,
                       pipelined: Pipelined | None = None, deadline: float | None = None) -> list[ChainResult]:
        """``_publish_waves``; each wave's confirms awaited ``confirm_timeout`` at most, every
        network step (connecting, opening the channel, declaring, writing, each Redis
        command) waiting no later than ``deadline`` (monotonic: the claim's), and nothing
        sent once it has passed (docs/relay.md, "The publish's deadline")."""
        with self._lock:
            return self._publish_waves([list(chain) for chain in chains], pipelined, deadline)

    def publish_dead(self, message: OutboxMessage, error: str, *,
                     headers: Mapping[str, Any] | None = None) -> PublishFailure | None:
        """Publish a dead row to ``dead_letter_exchange`` (durable topic, routing key = topic)
        with the reason in ``x-outbox-error``. Not mandatory: an unbound dead-letter exchange
        just drops it; the dead row stays in the table for ``outbox dead list/requeue``.

        A row that cannot be published itself (a POISON row: too large, headers not
        encodable) is sent as a stub with an empty body (and without the caller's headers
        when those are what cannot be encoded), and ``x-outbox-omitted`` saying why; the
        full row stays in the table. A topic or message id AMQP cannot carry (over 255 bytes)
        is replaced (``message.carriable_ids``: routing key ``outbox.dead.unroutable``), the
        originals kept in the ``topic`` and ``message_id`` headers, ``x-outbox-replaced``
        saying what was replaced."""
        if self.dead_letter_exchange is None:
            return None
        original = message
        message, replaced = carriable_ids(message)
        poisoned = poison_check(message, self.max_message_bytes)
        omitted = None
        if poisoned is not None:
            omitted = poisoned.reason
            for stub in (replace(message, payload=""), replace(message, payload="", headers={})):
                poisoned = poison_check(stub, self.max_message_bytes)
                if poisoned is None:
                    message = stub
                    break
            else:  # even the reserved headers cannot go
                return poisoned
        extra = headers
        headers = build_headers(message)
        headers.update(extra or {})
        headers["x-outbox-error"] = (error or "")[:MAX_ERROR_HEADER_CHARS]
        if omitted is not None:
            headers["x-outbox-omitted"] = omitted[:MAX_ERROR_HEADER_CHARS]
        if replaced is not None:
            headers.update(topic=original.topic, message_id=original.message_id)
            headers["x-outbox-replaced"] = replaced[:MAX_ERROR_HEADER_CHARS]
        with self._lock:
            try:
                self._ready()
                self._send(message, headers, self.dead_letter_exchange, mandatory=False)
                self._await_confirms()
            except Exception as exc:  # noqa: BLE001 - reported, never raised
                self._discard()
                return failure_from(exc)
            nacked = bool(self._nacked)
            self._nacked.clear()
        return PublishFailure(FailureKind.BACKPRESSURE, "the broker refused the message (basic.nack)") if nacked else None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                try:
                    self._conn.release()
                except Exception:
                    log.debug("error closing the publisher connection", exc_info=True)
            self._forget()

    # -- chains, in waves ----------------------------------------------------------------
    def _publish_waves(self, chains: list[list[OutboxMessage]], pipelined: Pipelined | None = None,
                       deadline: float | None = None) -> list[ChainResult]:
        """Publish several chains (different aggregates) in waves: the next unsent event of
        every chain still going (``next_wave``), back to back, then wait until the broker has
        confirmed (or returned, or nacked) every one of them (``_send_wave``), and advance or
        stop each chain by its verdicts (``settle_wave``); repeat. Within a chain this is
        stop-and-wait, so what reaches the broker is a prefix of each chain; across chains the
        round trips are shared, so a task costs as many round trips as its longest chain has
        events. The bookkeeping is in ``outbox.publisher.waves``; this loop does the I/O.

        A chain whose next event opted in to pipelining (``pipelined``) sends a window of
        events in one wave instead (``ChainProgress.window``); an event of the window the
        broker did not take while later ones were confirmed is overtaken
        (``waves.apply_verdicts``): docs/relay.md, "Pipelined chains".

        Past ``deadline`` no wave is sent: every chain still going stops at its next event,
        BACKPRESSURE, as when a wave's confirms do not come by then."""
        progress = [ChainProgress(chain) for chain in chains]
        going = [chain for chain in progress if chain.chain]
        reused = self._usable()  # a connection from an earlier call, maybe dead since
        refused: dict[str, PublishFailure] = {}  # routing key -> its nack
        single = False  # one event a wave, once the broker refused a whole wave as poison
        while going:
            if deadline is not None and time.monotonic() >= deadline:
                late = past_deadline()
                for chain in going:
                    chain.stop(late)
                break
            wave = next_wave(going, pipelined, refused, self.max_message_bytes, single=single)
            if not wave.windows:
                break
            try:
                self._ready(deadline)
                verdicts = self._send_wave(wave.messages, wave.headers, deadline, owners=wave.owners)
            except Exception as exc:  # noqa: BLE001 - nothing of this wave is known to be on the broker
                failure = self._wave_lost(wave, exc)
                if reused and _connection_lost(exc):
                    # Most likely a connection that died while idle: replace it once and send
                    # the wave again (its events may arrive twice: at-least-once, still a prefix).
                    reused = False
                    log.info("publisher connection was lost (%s); reconnecting once", failure.reason)
                    continue
                if failure.kind is FailureKind.POISON and len(wave.messages) > 1:
                    # The broker closed the channel over one message (larger than its
                    # max_message_size, a frame too large) without saying which: stamping
                    # every chain of the wave made them all dead (found in review). Send the
                    # rest of the call one event at a time, so the one it refuses fails alone
                    # (what the wave had delivered may arrive twice: still a prefix).
                    single = True
                    log.warning("outbox publisher: the broker refused a wave of %d events as a whole (%s); sending "
                                "them one at a time to find the one it refuses", len(wave.messages), failure.reason)
                    continue
                wave.stop(failure)
                if single and failure.kind is FailureKind.POISON:
                    going = [chain for chain in going if chain.going]  # that event's chain alone
                    continue
                for chain in going:  # a single wave left the others out (docs/relay.md, OUTBOX_RELAY_MAX_MESSAGE_BYTES)
                    if chain.going:
                        chain.stop(failure)
                break
            reused = False  # the connection just worked: a later error is not staleness
            # A single wave leaves the other chains out: they go on (every other wave holds
            # each chain still going, so it has none to pass on).
            others = [chain for chain in going if chain is not wave.windows[0][0]] if single else None
            going = settle_wave(wave, verdicts, refused, unroutable=self.unroutable, exchange=self.exchange,
                                others=others)
        return [chain.result() for chain in progress]

    def _wave_lost(self, wave: Wave, exc: Exception) -> PublishFailure:
        """The connection failed while ``wave`` was sent or awaited its verdicts: drop the
        connection and return the failure. Logs the one reorder pipelining cannot settle
        when it may have happened (docs/relay.md, "Pipelined chains")."""
        if (self._returned or self._nacked) and wave.pipelined:
            log.error("outbox publisher connection failed while a pipelined window awaited its confirms, "
                      "after the broker had refused %d of its events (returned message ids: %s): their "
                      "retry may arrive after later events of their chain",
                      len(self._returned) + len(self._nacked), sorted(self._returned) or "none")
        self._discard()
        return failure_from(exc)

    def _send_wave(self, messages: list[OutboxMessage], headers: list[dict[str, Any]],
                   deadline: float | None = None, *, owners: Sequence[int] | None = None) -> list[Any]:
        """Send ``messages`` and wait for the broker's verdict on each: ``None`` (confirmed),
        ``RETURNED`` (unroutable) or a ``PublishFailure`` (nacked). Raises when the
        connection fails: then nothing of the wave is known to have arrived. The writes and
        the wait for confirms end by ``deadline`` (monotonic) at the latest.

        Without confirms (virtual transports) each send is its own verdict, and none is made
        once ``deadline`` has passed (the events left fail as back-pressure). An error of the
        connection (BACKPRESSURE, FATAL) stops the wave there, the events sent before it
        counting as published; any other refuses that event alone (``Refused``), and the
        rest of its chain's window (``owners``: each event's window) is not sent, as after
        an unroutable event under ``unroutable="fail"`` (it would overtake it)."""
        if not self._confirms:
            routed = self._routed(deadline)
            verdicts: list[Any] = []
            stopped: dict[int, Refused] = {}  # window -> the verdict of its events not sent
            for index, (message, event_headers) in enumerate(zip(messages, headers)):
                if deadline is not None and time.monotonic() >= deadline:
                    verdicts.extend([past_deadline()] * (len(messages) - len(verdicts)))
                    return verdicts
                owner = owners[index] if owners is not None else index
                if owner in stopped:
                    verdicts.append(stopped[owner])  # not sent: it would overtake the event that ended its window
                    continue
                if not routed(message.topic):
                    verdicts.append(RETURNED)
                    if self.unroutable == "fail":
                        stopped[owner] = Refused(PublishFailure(FailureKind.RETRIABLE, "not sent: an earlier event "
                                                                "of its window is unroutable"))
                    continue
                try:
                    self._send(message, event_headers, self.exchange, mandatory=False, deadline=deadline)
                except Exception as exc:
                    poisoned = self._poisoned(message, event_headers)
                    if poisoned is not None:
                        verdicts.append(poisoned)
                        continue
                    failure = failure_from(exc)
                    if failure.kind not in (FailureKind.BACKPRESSURE, FailureKind.FATAL):
                        stopped[owner] = Refused(failure)
                        verdicts.append(stopped[owner])
                        continue
                    if not verdicts:
                        raise
                    self._discard()
                    verdicts.extend([failure] * (len(messages) - len(verdicts)))
                    return verdicts
                verdicts.append(None)
            return verdicts
        tags = self._send_frames(messages, headers, self.exchange, mandatory=True, deadline=deadline)
        self._await_confirms(deadline)
        verdicts = []
        for message, tag in zip(messages, tags):
            if isinstance(tag, PublishFailure):
                verdicts.append(tag)
            elif tag in self._nacked:
                verdicts.append(refused_by_route(message.topic, self.exchange))
            elif message.message_id in self._returned:
                verdicts.append(RETURNED)
            else:
                verdicts.append(None)
        self._nacked.clear()
        self._returned.clear()
        return verdicts

    def _routed(self, deadline: float | None = None) -> Callable[[str], bool]:
        """Does a binding of the exchange take this routing key? A virtual transport (Redis)
        drops a message no binding routes without a word, where AMQP returns a mandatory
        one; so the exchange's bindings are read once per wave (by ``deadline``) and an event
        they do not route counts as returned (unroutable, docs/destinations.md, "Redis"). Not
        on memory://, whose events never leave the process (the embedded default, the demo)."""
        channel = self._channel
        if self._conn.transport.driver_type == "memory":
            return lambda key: True
        self._cap_redis(deadline)
        table = channel.get_table(self.exchange)
        kind = channel.typeof(self.exchange)
        return lambda key: bool(kind.lookup(table, self.exchange, key, None))

    def _send_frames(self, messages: Sequence[OutboxMessage], headers: Sequence[dict[str, Any]], exchange: str, *,
                     mandatory: bool, deadline: float | None = None) -> list[int | PublishFailure]:
        """Send ``messages`` without waiting (py-amqp): each one's delivery tag, or POISON for
        one that cannot be encoded (nothing of it is written). The frames go in one write, or
        one per ``_WRITE_BYTES`` of payload (docs/publisher.md, "Fast path"). Raises when the
        connection fails."""
        tags: list[int | PublishFailure] = []
        frames: list[bytes | memoryview] = []
        pending = 0
        for m, h in zip(messages, headers):
            try:
                frames += self._frames(m, h, exchange, mandatory=mandatory)
            except Exception:
                poisoned = self._poisoned(m, h)
                if poisoned is None:
                    raise
                tags.append(poisoned)
                continue
            tags.append(self._sent())
            pending += len(m.payload)
            if pending >= _WRITE_BYTES:
                self._write(frames, deadline)
                frames, pending = [], 0
        if frames:
            self._write(frames, deadline)
        return tags

    def _poisoned(self, message: OutboxMessage, headers: dict[str, Any]) -> PublishFailure | None:
        """After a send raised: POISON for this event alone if it cannot be encoded at all."""
        problem = _encoding_problem(message, headers, self.exchange)
        if problem is None:
            return None
        log.error("outbox event %s %s", message.id, problem)
        return PublishFailure(FailureKind.POISON, problem)

    # -- connection management -------------------------------------------------------
    def _usable(self) -> bool:
        return self._conn is not None and self._pid == os.getpid() and self._producer is not None

    def _ready(self, deadline: float | None = None) -> None:
        """Connect (bounded retry), open the channel and declare the exchanges, once per
        connection, each step waiting no later than ``deadline`` (``_connect``, ``_step``).
        Raises whatever went wrong."""
        from kombu import Exchange, Producer

        if self._pid != os.getpid():
            self._forget()  # inherited over fork(): the parent's, not ours; never close it
        if self._conn is None:
            try:
                # amqps://: ssl=, each alternate checked against its own name (core.tls)
                conn = begin_at(kombu_connection(self.url, "OUTBOX_PUBLISH_URL", connect_timeout=self.connect_timeout),
                                self._first_host)
                driver = getattr(conn.transport, "driver_name", "")  # resolves the transport class
            except Exception as exc:
                # kombu raises KeyError for an unknown scheme ("amqpx://"), ImportError (or
                # AttributeError) when the transport's library is missing: configuration
                # errors, not a broker failure.
                hint = transport_hint(self.url)
                if hint is None and not isinstance(exc, (KeyError, ImportError, ValueError)):
                    raise
                raise ConfigError(redact(f"OUTBOX_PUBLISH_URL={self.url!r} cannot be used: "
                                         + (hint or f"{type(exc).__name__}: {exc}"))) from exc
            options: dict[str, Any] = conn.transport_options  # kombu declares None, sets {}
            options.update(self._timeouts(driver))  # read when the transport connects and opens channels
            self._driver, self._confirms = driver, driver == "py-amqp"
            self._conn, self._pid = conn, os.getpid()
        if self._producer is not None and self._conn.connected:
            return
        self._channel = self._producer = None
        self._connect(deadline)
        with self._step(deadline):
            channel = self._conn.channel()
        for name in (self.exchange, self.dead_letter_exchange):
            if name:
                with self._step(deadline):
                    channel = self._declare(channel, name)
        self._next_tag = 0
        self._unconfirmed.clear()
        self._nacked.clear()
        self._returned.clear()
        self._encoders.clear()
        if self._confirms:
            # Confirm mode: the broker acks (or nacks) every message, numbering them from 1
            # on this channel; we send without waiting and collect the verdicts in
            # _await_confirms. A mandatory message that no queue takes comes back as a
            # basic.return, always before its ack.
            with self._step(deadline):
                channel.confirm_select()
            channel.events["basic_ack"].add(self._on_ack)
            channel.events["basic_nack"].add(self._on_nack)
            channel.events["basic_return"].add(self._on_return)
        self._channel = channel
        self._producer = Producer(channel, exchange=Exchange(self.exchange, type="topic", durable=True),
                                  auto_declare=False)

    def _connect(self, deadline: float | None) -> None:
        """Make the connection: ``1 + connect_retries`` rounds over the URL's hosts (its
        ``;``-separated alternates, each tried in turn as kombu's own retry does), with a
        short pause after each round, each attempt's TCP connect and handshake (Redis: its
        first PING) waiting the time left until ``deadline`` at most, and none begun once it
        has passed. Raises the last attempt's error. Only what kombu itself retries is
        retried (a refused login is not). The next connection begins where this one left off
        (``_first_host``): at the host that worked, or after the one that failed last. A host
        whose certificate does not verify is passed
        over for the next host of the list (per-node certificates: one node's gone wrong
        must not stop publishing through the others), said in a WARNING; its error, FATAL, is
        the one raised when no host could be reached (found in review)."""
        from kombu.exceptions import OperationalError

        conn = self._conn
        pause, step, longest = _RECONNECT_PAUSE_S
        hosts = max(1, len(conn.alt))
        attempts = (1 + self.connect_retries) * hosts
        not_verified: OperationalError | None = None  # a host's certificate that did not verify
        for attempt in range(attempts):
            conn.connect_timeout = time_left(self.connect_timeout, deadline)
            conn.transport_options.update(self._timeouts(self._driver, deadline))
            try:
                conn.ensure_connection(max_retries=0)  # one attempt: the retries are ours
                return
            except Exception as exc:
                # Whatever failed, the next attempt or connection begins at the next host, not
                # at this one again: a silent host took the whole deadline of every publish, and
                # one that refuses the login (not retried: AccessRefused, raised as itself) held
                # every later connection, FATAL for good though the others were back (found in
                # review).
                self._first_host += 1
                if not isinstance(exc, OperationalError):  # kombu's wrapping of an error it would retry
                    raise
                round_ends = conn.completes_cycle(attempt)
                certificate = isinstance(exc.__cause__, ssl.SSLCertVerificationError)  # FATAL (failures.py)
                retriable = isinstance(exc.__cause__, conn.recoverable_connection_errors) and (
                    not certificate or hosts > 1)
                if certificate and retriable and not_verified is None:
                    not_verified = exc
                    log.warning("outbox publisher: the certificate of %s does not verify (%s); trying the next "
                                "host of OUTBOX_PUBLISH_URL", redact(conn.as_uri()), exc)
                if not retriable or attempt == attempts - 1 or (
                        deadline is not None and time.monotonic() + (pause if round_ends else 0) >= deadline):
                    if not_verified is not None and retriable:
                        raise not_verified from not_verified.__cause__
                    raise
            conn.maybe_switch_next()  # the next alternate, as kombu's retry does after each failure
            if round_ends:
                time.sleep(pause)
                pause = min(longest, pause + step)

    @contextlib.contextmanager
    def _step(self, deadline: float | None) -> Iterator[None]:
        """One exchange with the broker while a connection is set up (opening the channel, a
        declare, confirm mode): on py-amqp the socket's timeout, for that step, is the time
        left until ``deadline`` (``confirm_timeout`` at most); without it such a step waited
        for the connection's read timeout, the whole confirm timeout. Redis's channel does
        no I/O here: its connection was capped when it was made (``_connect``)."""
        if not self._confirms:
            yield
            return
        with self._conn.connection.transport.having_timeout(time_left(self.confirm_timeout, deadline)):
            yield

    def _cap_redis(self, deadline: float | None) -> None:
        """Redis: the channel's commands from now on wait the time left until ``deadline``
        at most (``confirm_timeout`` without one; ``cap_redis_pool``)."""
        if self._driver == "redis":
            cap_redis_pool(self._channel.pool, time_left(self.confirm_timeout, deadline),
                           time_left(self.connect_timeout, deadline))

    def _declare(self, channel: Any, name: str) -> Any:
        """Declare the exchange ``name`` (durable topic); returns the channel to go on with.
        A user without configure permission is refused (403) even for an exchange that
        exists, and the refusal closes the channel: then a new one declares it passively,
        and the refusal stands only when it is missing (docs/destinations.md, "RabbitMQ permissions")."""
        from amqp.exceptions import AccessRefused, NotFound
        from kombu import Exchange

        exchange = Exchange(name, type="topic", durable=True)
        try:
            exchange(channel).declare()
            return channel
        except AccessRefused as refused:
            with contextlib.suppress(Exception):  # py-amqp reopened it after the refusal
                channel.close()
            channel = self._conn.channel()
            try:
                exchange(channel).declare(passive=True)
            except NotFound:
                raise refused from None
            return channel

    def _timeouts(self, driver: str, deadline: float | None = None) -> dict[str, float]:
        """Every wait on the broker bounded by ``confirm_timeout``; a timeout is back-pressure.
        kombu's Redis transport waits on its socket for ever by default (no ``socket_timeout``)
        and ignores ``connect_timeout``; py-amqp bounds its handshake and our confirm waits,
        but not opening a channel, confirm mode and the declares after the handshake. A broker
        that stopped answering there held the publisher, and every publish of the process
        behind its lock, for good (found in review; docs/destinations.md, "Redis"). Redis's
        are shortened to the time left until ``deadline`` (a connection about to be made);
        py-amqp's read timeout stays the fallback, ``_step`` shortens each step's wait."""
        if driver == "redis":
            return {"socket_timeout": time_left(self.confirm_timeout, deadline),
                    "socket_connect_timeout": time_left(self.connect_timeout, deadline)}
        if driver == "py-amqp":
            return {"read_timeout": self.confirm_timeout}
        return {}

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        message_id = getattr(message, "properties", {}).get("message_id")
        if message_id:
            self._returned.add(message_id)

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        tags = [t for t in self._unconfirmed if t <= tag] if multiple else [tag]
        self._unconfirmed.difference_update(tags)
        return tags

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._nacked.update(self._settle(tag, multiple))

    def _await_confirms(self, deadline: float | None = None) -> None:
        """Read from the broker until every message sent is acked or nacked; raise
        ``TimeoutError`` if that takes longer than ``confirm_timeout``, or lasts past
        ``deadline`` (monotonic: the claim's)."""
        began = time.monotonic()
        end, within = began + self.confirm_timeout, f"within {self.confirm_timeout:g} s"
        if deadline is not None and deadline < end:
            end, within = deadline, f"by the claim's deadline ({max(0.0, deadline - began):.2g} s after the wave went)"
        while self._unconfirmed:
            remaining = end - time.monotonic()
            try:
                # Past the end, confirms already on the socket still count: one read that waits
                # for nothing (a wave written at the deadline's edge was counted lost, and its
                # events sent again, though the broker had confirmed them).
                self._conn.drain_events(timeout=max(0.0, remaining))
            except TimeoutError:  # the socket's own says only "timed out"
                if remaining > 0:
                    continue
                raise TimeoutError(f"no publisher confirm {within} for {len(self._unconfirmed)} messages") from None

    def _send(self, message: OutboxMessage, headers: dict[str, Any], exchange: str, *, mandatory: bool,
              deadline: float | None = None) -> int:
        """Send one message without waiting, by ``deadline`` (Redis: its commands wait the
        time left at most); returns its delivery tag (0 without confirms)."""
        if self._confirms:  # py-amqp: our own frames on its channel (docs/publisher.md, "Fast path")
            self._write(self._frames(message, headers, exchange, mandatory=mandatory), deadline)
            return self._sent()
        self._cap_redis(deadline)
        self._producer.publish(
            encode_body(message),
            exchange=exchange,
            routing_key=message.topic,
            delivery_mode=2,  # persistent
            mandatory=mandatory and self._confirms,
            content_type="application/json",
            content_encoding="utf-8",
            headers=headers,
            message_id=message.message_id,
            timeout=self.confirm_timeout,
            retry=False,
        )
        return 0

    def _frames(self, message: OutboxMessage, headers: dict[str, Any], exchange: str, *,
                mandatory: bool) -> list[bytes | memoryview]:
        """The frames of one message (py-amqp only), from the encoder of its exchange and
        ``mandatory`` flag on the current channel. Raises what py-amqp's encoder would."""
        encoder = self._encoders.get((exchange, mandatory))
        if encoder is None:
            channel = self._channel
            encoder = PublishFrames(channel.channel_id, channel.connection.frame_max, exchange, mandatory)
            self._encoders[(exchange, mandatory)] = encoder
        return encoder.publish(message.topic, headers, message.message_id, encode_body(message))

    def _sent(self) -> int:
        """Count one more message written on the channel: its delivery tag, now awaited."""
        self._next_tag += 1
        self._unconfirmed.add(self._next_tag)
        return self._next_tag

    def _write(self, frames: list[bytes | memoryview], deadline: float | None = None) -> None:
        """Write frames in one go on py-amqp's connection, the way ``Channel.basic_publish``
        does: frames waiting from the broker (``connection.blocked``, a close) are read
        first, and a write timeout (``confirm_timeout``, or sooner by ``deadline``) is a
        ``RecoverableConnectionError``."""
        from amqp.exceptions import RecoverableConnectionError

        connection = self._channel.connection
        if connection is None:
            raise RecoverableConnectionError("basic_publish: connection closed")
        if connection.client_properties.get("capabilities", {}).get("connection.blocked", False):
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=0)
        transport = connection.transport
        try:
            with transport.having_timeout(time_left(self.confirm_timeout, deadline)):
                transport.write(b"".join(frames))
        except TimeoutError as exc:
            raise RecoverableConnectionError("basic_publish: timed out") from exc
        connection.bytes_sent += 1

    def _discard(self) -> None:
        """Drop the connection after an error, without the protocol's closing handshake
        (the peer may be gone); the next call reconnects."""
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.collect()
            except Exception:
                log.debug("error discarding the publisher connection", exc_info=True)
        self._forget()

    def _forget(self) -> None:
        self._conn = self._channel = self._producer = None
        self._pid = None
        self._encoders.clear()
        self._unconfirmed.clear()
        self._nacked.clear()
        self._returned.clear()
