"""PostgreSQL LISTEN/NOTIFY: committed enqueues wake the relay's workers.

Opt-in with ``OUTBOX_RELAY_LISTEN=1`` on both sides:

* **writers**: ``enqueue`` on a PostgreSQL connection also runs
  ``SELECT pg_notify(<channel>, '')`` in the caller's transaction. PostgreSQL delivers
  a notification only when (and if) that transaction commits, and folds identical
  notifications of one transaction into one. The cost: one more round trip per
  enqueue, and at commit PostgreSQL serializes the commits of notifying transactions
  on a global queue lock, which shows at thousands of commits per second.
* **workers**: the main process of each ``celery -A outbox worker`` runs a listener
  thread (started on ``worker_ready``, stopped on ``worker_shutdown``) on a dedicated
  autocommit psycopg connection. A notification asks for a claim through the relay's
  coalesced request (``outbox.worker.request_claim``), so a burst of commits sends one
  claim. The listener reconnects with backoff when its connection drops and asks for
  one claim after each (re)connect, for commits it may have missed meanwhile. Beat's
  tick remains the safety net.

The channel is ``outbox_<table>`` (``outbox_<schema>_<table>`` with OUTBOX_SCHEMA;
hashed when longer than PostgreSQL's 63 bytes), or ``OUTBOX_RELAY_LISTEN_CHANNEL``.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from typing import Any, Callable

from .config import extra_setting, flag

log = logging.getLogger("outbox.listen")

#: Longest PostgreSQL identifier (NAMEDATALEN - 1).
MAX_CHANNEL = 63


def channel_for(table: str, schema: str | None = None, override: Any = None) -> str:
    """The channel of an outbox table: OUTBOX_RELAY_LISTEN_CHANNEL, else derived from
    the table's name."""
    override = override if override is not None else extra_setting("OUTBOX_RELAY_LISTEN_CHANNEL")
    if override:
        from .config import validate_identifier

        return validate_identifier(str(override).strip(), "OUTBOX_RELAY_LISTEN_CHANNEL")
    name = f"outbox_{schema}_{table}" if schema else f"outbox_{table}"
    if len(name.encode()) > MAX_CHANNEL:
        name = "outbox_" + hashlib.sha1(name.encode()).hexdigest()[:32]
    return name


def listen_enabled() -> bool:
    return flag("OUTBOX_RELAY_LISTEN", False)


# -- the writer side: NOTIFY in enqueue ----------------------------------------------------------

_notify_cache: tuple[Any, bool, Any] | None = None


def notify_channel(kind: str, table: str, schema: str | None) -> str | None:
    """The channel ``enqueue`` notifies on, or None (not PostgreSQL, or LISTEN off).
    The on/off decision is cached with the process's settings object, so it is read
    once (and again after ``outbox.config.reset_settings``)."""
    global _notify_cache
    from .engines import engine_class

    if not engine_class(kind).supports_notify:
        return None
    from .config import get_settings

    settings = get_settings()
    cached = _notify_cache
    if cached is None or cached[0] is not settings:
        cached = _notify_cache = (settings, listen_enabled(), extra_setting("OUTBOX_RELAY_LISTEN_CHANNEL", ""))
    return channel_for(table, schema, cached[2]) if cached[1] else None


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
        from .engines import engine_class, kind_of_url

        return engine_class(kind_of_url(self.url)).listen_connection(self.url, self.channel)

    def run(self) -> None:
        delay = self.backoff_s
        failures = 0
        while not self._stop_event.is_set():
            try:
                self._conn = self._connect()
            except Exception as exc:
                failures += 1
                (log.warning if failures == 1 else log.debug)(
                    "outbox listen: cannot LISTEN on %s (%s: %s); retrying in %.1f s",
                    self.channel, type(exc).__name__, exc, delay)
                self._stop_event.wait(delay * (0.5 + random.random() / 2))
                delay = min(self.backoff_max_s, delay * 2)
                continue
            self.connects += 1
            self.backend_pid = self._conn.info.backend_pid
            if failures:
                log.info("outbox listen: listening on %s again after %d failed attempts", self.channel, failures)
            else:
                log.info("outbox listen: listening on %s", self.channel)
            delay, failures = self.backoff_s, 0
            self.ready.set()
            self._fire()  # commits made while we were not listening
            try:
                while not self._stop_event.is_set():
                    for _ in self._conn.notifies(timeout=self.poll_s):
                        self.notifications += 1
                        self._fire()
                        if self._stop_event.is_set():
                            break
            except Exception as exc:
                if not self._stop_event.is_set():
                    failures = 1
                    log.warning("outbox listen: connection lost (%s: %s); reconnecting", type(exc).__name__, exc)
            finally:
                self.ready.clear()
                self.backend_pid = None
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None


# -- the worker's listener (started and stopped by ``outbox.worker``) -------------------------

_listener: Listener | None = None


def start_listener(settings: Any, on_notify: Callable[[], Any]) -> Listener | None:
    """Start this worker's listener when OUTBOX_RELAY_LISTEN is on and the outbox of
    ``settings`` is on PostgreSQL; return it (or None). ``on_notify``: the worker's
    coalesced ``request_claim``."""
    global _listener
    from .engines import engine_class, kind_of_url

    if not listen_enabled():
        return None
    if not engine_class(kind_of_url(settings.database_url)).supports_notify:
        log.warning("outbox listen: OUTBOX_RELAY_LISTEN is set but the outbox is not on PostgreSQL; ignored")
        return None
    if _listener is not None and _listener.is_alive():
        return _listener
    _listener = Listener(settings.database_url, channel_for(settings.table, settings.schema), on_notify)
    _listener.start()
    return _listener


def stop_listener(wait: bool = True) -> None:
    global _listener
    listener = _listener
    if listener is not None:
        listener.stop(5.0 if wait else 0)
        if wait:
            _listener = None


__all__ = ["Listener", "channel_for", "listen_enabled", "notify_channel", "notify", "start_listener",
           "stop_listener", "MAX_CHANNEL"]
