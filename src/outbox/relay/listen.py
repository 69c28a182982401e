"""The worker's listeners, which start its in-process claim: PostgreSQL LISTEN (opt-in
with ``OUTBOX_RELAY_LISTEN=1`` on writers and workers; writers' ``enqueue`` adds a
``pg_notify`` in the caller's transaction) and the Redis pub/sub wake channel writers
``PUBLISH`` on. One thread class (``Listener``): reconnects with backoff, fires once after
each (re)connect. What each costs and guarantees: docs/waking-and-metrics.md,
"PostgreSQL LISTEN/NOTIFY" and "The in-process claim".
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..core.config import wake_options
from ..core.names import is_redis_url

log = logging.getLogger("outbox.relay.listen")

#: Longest PostgreSQL identifier (NAMEDATALEN - 1).
MAX_CHANNEL = 63


def channel_for(table: str, schema: str | None = None, override: Any = None) -> str:
    """The channel of an outbox table: OUTBOX_RELAY_LISTEN_CHANNEL, else derived from
    the table's name."""
    override = override if override is not None else wake_options().listen_channel
    if override:
        from ..core.config import validate_identifier

        return validate_identifier(str(override).strip(), "OUTBOX_RELAY_LISTEN_CHANNEL")
    name = f"outbox_{schema}_{table}" if schema else f"outbox_{table}"
    if len(name.encode()) > MAX_CHANNEL:
        name = "outbox_" + hashlib.sha1(name.encode()).hexdigest()[:32]
    return name


def listen_enabled() -> bool:
    return wake_options().listen


# -- the writer side: NOTIFY in enqueue ----------------------------------------------------------

def notify_channel(kind: str, table: str, schema: str | None) -> str | None:
    """The channel ``enqueue`` notifies on, or None (not PostgreSQL, or LISTEN off). The
    options are read once (``outbox.core.config.wake_options``, again after ``reset_settings``)."""
    from ..storage.engines import engine_class

    if not engine_class(kind).supports_notify:
        return None
    options = wake_options()
    return channel_for(table, schema, options.listen_channel or "") if options.listen else None


def notify(engine: Any, cursor: Any, channel: str) -> None:
    """Queue a notification in the caller's transaction (delivered at commit)."""
    engine.notify(cursor, channel)


# -- the worker side: the listener thread ------------------------------------------------------

class Listener(threading.Thread):
    """LISTEN on ``channel`` over a dedicated autocommit connection; call ``on_notify``
    (which must be cheap and must not raise; errors are logged) for every notification,
    and once after each (re)connect. Reconnects with exponential backoff and jitter."""

    def __init__(self, url: str, channel: str, on_notify: Callable[[], Any], *, poll_s: float = 1.0,
                 backoff_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        super().__init__(name="outbox-listen", daemon=True)
        self.url = url
        self.channel = channel
        self.on_notify = on_notify
        self.poll_s = poll_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.ready = threading.Event()  # set while LISTEN is active
        self.backend_pid: int | None = None
        self.notifications = 0
        self.connects = 0
        self._stop_event = threading.Event()
        self._conn: Any = None

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def _fire(self) -> None:
        try:
            self.on_notify()
        except Exception:
            log.exception("outbox listen: wake-up callback failed")

    def _connect(self) -> Any:
        from ..storage.engines import engine_class, kind_of_url

        return engine_class(kind_of_url(self.url)).listen_connection(self.url, self.channel)

    def run(self) -> None:
        delay = self.backoff_s
        failures = 0
        down_since: float | None = None  # when the connection was lost (the line on return says how long ago)
        while not self._stop_event.is_set():
            try:
                self._conn = self._connect()
            except Exception as exc:  # noqa: BLE001 - the listener thread retries whatever the connect raised
                failures += 1
                (log.warning if failures == 1 else log.debug)(
                    "outbox listen: cannot LISTEN on %s (%s: %s); retrying in %.1f s",
                    self.channel, type(exc).__name__, exc, delay)
                self._stop_event.wait(delay * (0.5 + random.random() / 2))
                delay = min(self.backoff_max_s, delay * 2)
                continue
            self.connects += 1
            self.backend_pid = getattr(getattr(self._conn, "info", None), "backend_pid", None)
            if down_since is not None:
                log.info("outbox listen: listening on %s again after %.1f s", self.channel,
                         time.monotonic() - down_since)
            elif failures:
                log.info("outbox listen: listening on %s after %d failed attempts", self.channel, failures)
            else:
                log.info("outbox listen: listening on %s", self.channel)
            delay, failures, down_since = self.backoff_s, 0, None
            self.ready.set()
            self._fire()  # commits made while we were not listening
            try:
                while not self._stop_event.is_set():
                    for _ in self._conn.notifies(timeout=self.poll_s):
                        self.notifications += 1
                        self._fire()
                        if self._stop_event.is_set():
                            break
            except Exception as exc:  # noqa: BLE001 - the listener thread must survive a lost connection: it reconnects
                if not self._stop_event.is_set():
                    failures, down_since = 1, time.monotonic()  # 1: the reconnects' failures are not logged again
                    log.warning("outbox listen: connection on %s lost (%s: %s); reconnecting", self.channel,
                                type(exc).__name__, exc)
            finally:
                self.ready.clear()
                self.backend_pid = None
                with contextlib.suppress(Exception):  # best effort: the connection is being dropped
                    self._conn.close()
                self._conn = None


#: The wake subscriber's bounds (docs/waking-and-metrics.md, "A wake channel that stops answering"):
#: after this long without a word from Redis it sends a PING, and a PING (or the SUBSCRIBE) not
#: answered within ``ANSWER_WITHIN_S`` ends the connection; the thread subscribes again.
PING_AFTER_S = 10.0
ANSWER_WITHIN_S = 5.0
#: TCP keepalive on its socket (seconds idle, between probes, probes): the kernel finds a dead peer too.
KEEPALIVE = (10, 5, 3)


def _keepalive_options() -> dict[int, int]:
    import socket

    names = ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")  # Linux; others keep the system's timings
    return {getattr(socket, name): value for name, value in zip(names, KEEPALIVE) if hasattr(socket, name)}


class _Subscription:
    """A Redis pub/sub subscription behind the interface ``Listener`` uses (``notifies``,
    ``close``), so the same thread, backoff and fire-after-connect serve both sources.

    Bounded: it is made once Redis confirmed the SUBSCRIBE, and ``notifies`` raises
    ``ConnectionError`` when a PING it sent after ``ping_after_s`` of silence is not answered
    within ``answer_within_s``. A connection whose path went silent (a host gone without a
    reset, a NAT's idle timeout) was waited on for good: redis-py's ``health_check_interval``
    sends a PING but never waits for its answer (found in review)."""

    def __init__(self, url: str, channel: str, *, ping_after_s: float = PING_AFTER_S,
                 answer_within_s: float = ANSWER_WITHIN_S) -> None:
        from .redis_clients import relay_redis  # TLS as Celery's broker connects

        self.ping_after_s = ping_after_s
        self.answer_within_s = answer_within_s
        self.client = relay_redis(url, socket_connect_timeout=answer_within_s, socket_timeout=answer_within_s,
                                  socket_keepalive=True, socket_keepalive_options=_keepalive_options())
        self.pubsub = self.client.pubsub()
        self._last_heard = time.monotonic()
        self._asked_at: float | None = None  # when the question not answered yet was sent
        try:
            self.pubsub.subscribe(channel)
            self._asked_at = time.monotonic()
            self._await_subscribed()
        except BaseException:
            self.close()
            raise

    def _await_subscribed(self) -> None:
        while self._asked_at is not None:
            left = self._asked_at + self.answer_within_s - time.monotonic()
            if left <= 0:
                raise ConnectionError(f"no answer to SUBSCRIBE within {self.answer_within_s:g} s")
            message = self.pubsub.get_message(timeout=left)
            if message is not None:
                self._heard()
                if message["type"] != "subscribe":
                    raise ConnectionError(f"unexpected answer to SUBSCRIBE: {message!r}")

    def _heard(self) -> None:
        self._asked_at = None
        self._last_heard = time.monotonic()

    def _check_alive(self) -> None:
        now = time.monotonic()
        if self._asked_at is not None:
            if now - self._asked_at > self.answer_within_s:
                raise ConnectionError(f"no answer to PING within {self.answer_within_s:g} s")
        elif now - self._last_heard >= self.ping_after_s:
            self.pubsub.ping()
            self._asked_at = now

    def notifies(self, timeout: float) -> Iterator[Any]:
        self._check_alive()
        message = self.pubsub.get_message(timeout=timeout)
        while message is not None:
            self._heard()  # a notification, or the PING's answer: the connection lives
            if message["type"] == "message":
                yield message
            message = self.pubsub.get_message(timeout=0)

    def close(self) -> None:
        try:
            self.pubsub.close()
        finally:
            self.client.close()


class Subscriber(Listener):
    """The worker's ear for writers' wake-ups on a Redis Celery broker: SUBSCRIBE on the
    claim queue's wake channel (``outbox.core.names.wake_channel``); writers PUBLISH there and
    fall back to a claim message when nobody listens (docs/waking-and-metrics.md).
    ``ping_after_s``, ``answer_within_s``: its bounds on a silent connection (``_Subscription``)."""

    def __init__(self, url: str, channel: str, on_notify: Callable[[], Any], *, ping_after_s: float = PING_AFTER_S,
                 answer_within_s: float = ANSWER_WITHIN_S, **kwargs: Any) -> None:
        super().__init__(url, channel, on_notify, **kwargs)
        self.name = "outbox-subscribe"
        self.ping_after_s = ping_after_s
        self.answer_within_s = answer_within_s

    def _connect(self) -> Any:
        return _Subscription(self.url, self.channel, ping_after_s=self.ping_after_s,
                             answer_within_s=self.answer_within_s)


# -- the worker's listeners (started and stopped by ``outbox.celery.worker``) ------------------------

#: The running listeners of this process: "listen" (PostgreSQL) and "subscribe" (Redis).
_running: dict[str, Listener] = {}


def _start(which: str, make: Callable[[], Listener]) -> Listener:
    listener = _running.get(which)
    if listener is None or not listener.is_alive():
        listener = _running[which] = make()
        listener.start()
    return listener


def _stop(which: str, wait: bool) -> None:
    listener = _running.get(which)
    if listener is not None:
        listener.stop(5.0 if wait else 0)
        if wait:
            _running.pop(which, None)


def start_subscriber(broker_url: str, channel: str, on_notify: Callable[[], Any]) -> Listener | None:
    """Start this worker's wake-up subscriber when Celery's broker is Redis; return it (or None)."""
    if not is_redis_url(broker_url):
        return None
    return _start("subscribe", lambda: Subscriber(broker_url, channel, on_notify))


def stop_subscriber(wait: bool = True) -> None:
    _stop("subscribe", wait)


def start_listener(settings: Any, on_notify: Callable[[], Any]) -> Listener | None:
    """Start this worker's listener when OUTBOX_RELAY_LISTEN is on and the outbox of
    ``settings`` is on PostgreSQL; return it (or None). ``on_notify``: the worker's
    in-process claim (or its coalesced ``request_claim``)."""
    from ..storage.engines import engine_class, kind_of_url

    if not listen_enabled():
        return None
    if not engine_class(kind_of_url(settings.database_url)).supports_notify:
        log.warning("outbox listen: OUTBOX_RELAY_LISTEN is set but the outbox is not on PostgreSQL; ignored")
        return None
    return _start("listen", lambda: Listener(settings.database_url, channel_for(settings.table, settings.schema),
                                             on_notify))


def stop_listener(wait: bool = True) -> None:
    _stop("listen", wait)


__all__ = ["Listener", "Subscriber", "channel_for", "listen_enabled", "notify_channel", "notify", "start_listener",
           "stop_listener", "start_subscriber", "stop_subscriber", "MAX_CHANNEL"]
