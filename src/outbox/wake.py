"""Waking the relay right after the caller's transaction commits: ``request_claim()``
(handed off, coalesced, never raises, no I/O in the caller's thread), ``transaction(conn)``
(also ``outbox.transaction``), ``wake_after_commit(conn)`` and ``register_after_commit(conn)``.
The hand-off thread, the one claim-request token it shares with the workers, and what a
wake costs: docs/waking-and-metrics.md, "Post-commit wake-up". With Dramatiq as the runner
(``OUTBOX_DRAMATIQ_BROKER_URL``) the claim is a Dramatiq message sent through
``outbox.dramatiq_broker``, coalesced the same way (docs/dramatiq.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger("outbox.wake")

#: Per-process throttle window for brokers other than Redis (docs/waking-and-metrics.md).
LOCAL_WINDOW_S = 0.05
#: After a failed send, wakes pause this long (the broker is down: don't pay a connect
#: attempt per commit). Beat's tick delivers meanwhile.
FAILURE_PAUSE_S = 1.0
#: A failure is logged as a warning at most this often; otherwise at debug level.
WARN_EVERY_S = 60.0
#: At interpreter exit, a wake still pending gets this long to go out (beat's tick covers
#: one that does not).
EXIT_FLUSH_S = 1.0


from .core.config import relay_options, relay_settings, wake_options  # noqa: E402
from .core.handoff import HandOff  # noqa: E402
from .core.names import CLAIM_REQUEST_PREFIX, CLAIM_TASK, TASK_OUTBOX_ARG, claim_request_key, wake_channel  # noqa: E402

#: Prefix of the claim-request tokens: a claim deletes only keys that start with it.
TOKEN_PREFIX = CLAIM_REQUEST_PREFIX

_redis_clients: dict[tuple[int, str], Any] = {}


def _redis(url: str) -> Any:
    key = (os.getpid(), url)
    client = _redis_clients.get(key)
    if client is None:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        _redis_clients.clear()  # forget clients of a parent process
        _redis_clients[key] = client
    return client


def clear_token(token: str, broker_url: str | None = None) -> None:
    """Delete a claim-request token named in a claim message (claims sent by earlier
    versions carried ``token=``; today's carry ``requested=True`` and the worker clears its
    coalescer, which is the same token). ``broker_url``: the Redis holding it (default:
    Celery's broker)."""
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        return
    try:
        if broker_url is None:
            from .celery.application import app

            broker_url = str(app.conf.broker_url)
        _redis(broker_url).delete(token)
    except Exception as exc:  # it expires by itself
        log.debug("outbox: cannot clear wake token %s: %s", token, exc)


# -- the waking side -----------------------------------------------------------------------------

class _Throttle:
    """At most one ``send`` per window, and one more at the window's end when requests
    arrived during it (so a claim always follows the last request)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._timer: threading.Timer | None = None

    def request(self, send: Callable[[], bool]) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._timer is None and now >= self._next:
                self._next = now + self.window_s
            else:
                if self._timer is None:
                    self._timer = threading.Timer(max(0.0, self._next - now), self._trailing, (send,))
                    self._timer.daemon = True
                    self._timer.start()
                return True
        return send()

    def _trailing(self, send: Callable[[], bool]) -> None:
        with self._lock:
            self._timer = None
            self._next = time.monotonic() + self.window_s
        send()


def token_for(broker_url: str, key_prefix: str, namespace: str) -> str:
    """The Redis key of an outbox's claim queue's one claim-request token (``make_coalescer``
    over ``outbox.core.names.claim_request_key``): the key a wake-up takes and a claim clears."""
    return f"{claim_request_key(broker_url, key_prefix, namespace)}:claim-requested"


class _Plan:
    """How this process wakes the relay; computed once per process and options."""

    def __init__(self, broker_url: str, key_prefix: str = "", options: Any = None, runner: str = "celery",
                 namespace: str = "") -> None:
        self.broker_url = broker_url
        self.runner = runner
        #: The outbox this process writes to: its queues, token and channel (``outbox.core.names``).
        self.namespace = namespace or relay_settings().outbox_namespace
        #: Where Celery workers SUBSCRIBE for wake-ups (Redis; Dramatiq workers do not).
        self.channel = wake_channel(broker_url, key_prefix, self.namespace) if runner == "celery" else None
        self.key_prefix = key_prefix
        self.options = options
        self.pid = os.getpid()
        self.kind = ("redis" if broker_url.startswith(("redis://", "rediss://"))
                     else "memory" if broker_url.startswith("memory://") else "other")
        self.throttle = _Throttle(LOCAL_WINDOW_S)
        self._coalescer: Any = None

    def coalescer(self) -> Any:
        """The claim queue's one token (Redis), the same object type and key as the
        worker's ``outbox.celery.worker.coalescer``; made on first use, in the hand-off thread."""
        if self._coalescer is None:
            from .relay import make_coalescer

            self._coalescer = make_coalescer(self.broker_url,
                                             claim_request_key(self.broker_url, self.key_prefix, self.namespace),
                                             relay_options().claim_request_ttl_s)
        return self._coalescer

    def prepare(self) -> None:
        """Load, in the caller's thread, the modules and client objects the wake thread will
        use (no connection, no socket I/O), so that a process that ends right after its commit
        still sends its wake: once the interpreter is exiting, a first import that registers
        an exit hook fails (``can't register atexit after shutdown``), and a short script's
        wake runs exactly then (docs/waking-and-metrics.md, "Post-commit wake-up")."""
        if self.kind == "memory":
            return
        "localhost".encode("idna")  # the codec a connection to a host name loads
        if self.kind == "redis":
            _redis(self.broker_url)
            self.coalescer()
        if self.runner == "dramatiq":
            from . import dramatiq_broker

            dramatiq_broker.sender()
            dramatiq_broker.message(CLAIM_TASK, relay_settings().queues.claim, {})
            return
        from .celery.application import app

        for lazy in ("amqp", "producer_pool", "AsyncResult", "backend", "events"):  # built on first use
            getattr(app, lazy)
        app.amqp.router  # noqa: B018
        app.connection_for_write().transport  # noqa: B018


_plan: _Plan | None = None
_plan_lock = threading.Lock()
_paused_until = 0.0
_last_warning = 0.0
_memory_noted = False


def _current_plan() -> _Plan:
    """The cached plan; made again in a new process or after ``reset_settings``."""
    global _plan
    options = wake_options()
    plan = _plan
    if plan is not None and plan.pid == os.getpid() and plan.options is options:
        return plan
    from . import dramatiq_broker

    dramatiq = dramatiq_broker.settings()
    if dramatiq is not None:
        # Dramatiq is the configured runner (OUTBOX_DRAMATIQ_BROKER_URL): wake through it.
        url, key_prefix, runner = dramatiq.broker_url, dramatiq.namespace, "dramatiq"
    else:
        from .celery.application import app

        url = str(app.conf.broker_url or "")
        key_prefix = str((app.conf.broker_transport_options or {}).get("global_keyprefix") or "")
        runner = "celery"
    plan = _Plan(url, key_prefix, options, runner)
    plan.prepare()
    with _plan_lock:
        _plan = plan
    return plan


def _failed(what: str, exc: BaseException) -> None:
    global _paused_until, _last_warning
    now = time.monotonic()
    _paused_until = now + FAILURE_PAUSE_S
    if now - _last_warning >= WARN_EVERY_S:
        _last_warning = now
        log.warning("outbox: cannot wake the relay (%s: %s: %s); the next claim tick delivers. "
                    "Further failures are logged at debug level for %.0f s", what, type(exc).__name__, exc,
                    WARN_EVERY_S)
    else:
        log.debug("outbox: cannot wake the relay (%s: %s: %s)", what, type(exc).__name__, exc)


def _send(requested: bool) -> bool:
    """Send one claim message; ``requested``: it holds the claim-request token, which the
    claim clears as it starts."""
    from . import dramatiq_broker

    kwargs = {"requested": True} if requested else {}
    settings = relay_settings()
    if dramatiq_broker.configured():
        try:
            dramatiq_broker.send(CLAIM_TASK, settings.queues.claim,
                                 {**kwargs, TASK_OUTBOX_ARG: settings.outbox_namespace},
                                 max_age_s=relay_options().claim_request_ttl_s)
            return True
        except Exception as exc:
            _failed("sending a claim", exc)
            return False
    from .celery.application import send_relay_task

    try:
        send_relay_task(CLAIM_TASK, kwargs, expires=relay_options().claim_request_ttl_s, retry=True,
                        retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.1,
                                      "interval_max": 0.1})
        return True
    except Exception as exc:
        _failed("sending a claim", exc)
        return False


def wake_now() -> bool:
    """The coalesced wake itself, in the calling thread (the hand-off thread runs it; so
    can code that wants to wait for it). True when a claim was sent or is on its way."""
    try:
        if time.monotonic() < _paused_until:
            return False
        worker = sys.modules.get("outbox.celery.worker")  # loaded only where a worker may run
        if worker is not None and worker.in_worker():
            return bool(worker.request_claim())
        plan = _current_plan()
        if plan.kind == "redis":
            if plan.channel is not None:
                # Workers listening: their main processes claim at once (one round trip, no
                # Celery message). Nobody listening: a claim message, coalesced on the token.
                try:
                    if _redis(plan.broker_url).publish(plan.channel, b"") > 0:
                        return True
                except Exception as exc:
                    _failed("notifying the workers", exc)
                    return False
            gate = plan.coalescer()
            if not gate.acquire():
                return True  # a claim is already queued and has not started: it will see this commit
            if _send(True):
                return True
            gate.clear()
            return False
        if plan.kind == "memory":
            return False
        return plan.throttle.request(lambda: _send(False))
    except (Exception, SystemExit) as exc:  # never raises
        _failed("sending the request", exc)
        return False


#: This process's hand-off thread (``outbox.core.handoff``): ``request_claim`` only flags it.
_handoff = HandOff(lambda: wake_now(), "outbox-wake")


def _forget_after_fork() -> None:
    global _plan, _plan_lock
    _plan, _plan_lock = None, threading.Lock()  # a lock held in the parent at fork stays held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def flush(timeout: float = 5.0) -> bool:
    """Wait until the wake-ups requested in this process so far went out (or failed);
    False on timeout. Tests, and code about to exit that wants its last wake sent."""
    return _handoff.flush(timeout)


@atexit.register
def _flush_at_exit() -> None:
    try:
        flush(EXIT_FLUSH_S)  # best effort: beat's tick delivers what does not go out
    except Exception:
        pass


def request_claim() -> bool:
    """Ask the relay for a claim soon. Call it after your transaction committed.

    Returns at once: the caller's thread only hands the request to this process's wake
    thread (no socket I/O, no database query), which sends it coalesced
    (docs/waking-and-metrics.md). Never raises. True when the request was handed off,
    False when nothing will be done (wakes off, no relay to wake, or wakes paused after a
    broker failure: the tick delivers).
    """
    global _memory_noted
    try:
        if time.monotonic() < _paused_until or not wake_options().wake:
            return False
        worker = sys.modules.get("outbox.celery.worker")
        if not (worker is not None and worker.in_worker()) and _current_plan().kind == "memory":
            if not _memory_noted:
                _memory_noted = True
                log.debug("outbox: Celery's broker is memory:// and no worker runs in this process; "
                          "wake-ups are skipped")
            return False
        _handoff.request()
        return True
    except (Exception, SystemExit) as exc:  # never into the caller, whose transaction has committed
        # (SystemExit: the relay's app exits on an invalid configuration under a `celery` command)
        _failed("preparing the request", exc)
        return False


#: ``outbox.wake.wake()`` reads well in callbacks.
wake = request_claim


def _call_request_claim() -> None:
    # Looked up at call time, so tests (and users) can replace ``request_claim``.
    sys.modules[__name__].request_claim()


# -- after the caller's commit ------------------------------------------------------------------

def _is_django(conn: Any) -> bool:
    return type(conn).__module__.startswith("django.") and hasattr(conn, "on_commit") and hasattr(conn, "alias")


def _session_of(conn: Any) -> Any:
    """A SQLAlchemy Session for ``conn`` (a Session or a scoped_session), else None."""
    if not type(conn).__module__.startswith("sqlalchemy"):
        return None
    try:
        from sqlalchemy.orm import Session, scoped_session
    except ImportError:
        return None
    if isinstance(conn, scoped_session):
        conn = conn()
    return conn if isinstance(conn, Session) else None


_SESSION_PENDING = "outbox_wake_pending"
_SESSION_HOOKED = "outbox_wake_hooked"


def _session_after_commit(session: Any) -> None:
    if session.info.pop(_SESSION_PENDING, False):
        _call_request_claim()


def _session_after_rollback(session: Any) -> None:
    session.info.pop(_SESSION_PENDING, None)


def register_after_commit(conn: Any) -> bool:
    """Arrange a wake-up when ``conn``'s current transaction commits. True when the
    connection has an on-commit hook (Django connection, SQLAlchemy Session), else
    False: then call ``request_claim()`` after your commit, or use ``transaction``.
    One wake per transaction however many times this is called in it."""
    if _is_django(conn):
        if any(entry[1] is _call_request_claim for entry in getattr(conn, "run_on_commit", ())):
            return True
        try:
            conn.on_commit(_call_request_claim, robust=True)
        except Exception as exc:  # manual transaction management: no on-commit hook
            log.debug("outbox: no on-commit hook on Django connection %r (%s)", conn.alias, exc)
            return False
        return True
    session = _session_of(conn)
    if session is not None:
        from sqlalchemy import event

        if not session.info.get(_SESSION_HOOKED):
            event.listen(session, "after_commit", _session_after_commit)
            event.listen(session, "after_rollback", _session_after_rollback)
            session.info[_SESSION_HOOKED] = True
        session.info[_SESSION_PENDING] = True
        return True
    return False


def wake_after_commit(conn: Any) -> None:
    """Wake the relay when ``conn``'s current transaction commits (not on rollback).

    Works on a Django connection (``transaction.on_commit``, robust) and a SQLAlchemy
    Session or scoped_session (its ``after_commit`` event). DB-API connections and
    SQLAlchemy Connections have no after-commit hook: this raises ``TypeError`` for
    them; use ``with outbox.transaction(conn): ...`` or call ``request_claim()`` after
    your commit.
    """
    if not register_after_commit(conn):
        raise TypeError(f"{type(conn).__module__}.{type(conn).__name__} has no after-commit hook: use "
                        "`with outbox.transaction(conn):` or call outbox.wake.request_claim() after commit")


@contextmanager
def transaction(conn: Any, *, wake: bool = True) -> Iterator[Any]:
    """Run the block as one transaction on ``conn``: commit when it succeeds, roll back
    when it raises; after the commit, wake the relay (coalesced, never raises).

    ``conn``: a DB-API connection (sqlite3, psycopg, PyMySQL, pyodbc), a SQLAlchemy
    Connection or Session, or a Django connection (then the block runs in
    ``transaction.atomic(using=conn.alias)`` and the wake is an on-commit callback, so a
    block nested in an outer atomic wakes when the outer transaction commits)::

        with outbox.transaction(conn):
            conn.execute("UPDATE orders SET state = 'paid' WHERE id = ?", (42,))
            outbox.enqueue(conn, topic="orders.paid", aggregate_type="order", aggregate_id="42",
                           payload={"orderId": "42"})
    """
    if _is_django(conn):
        from django.db import transaction as dj_transaction

        with dj_transaction.atomic(using=conn.alias):
            if wake:
                register_after_commit(conn)
            yield conn
        return
    try:
        yield conn
    except BaseException:
        conn.rollback()
        raise
    conn.commit()
    if wake:
        _call_request_claim()


def _reset_for_tests() -> None:
    global _plan, _paused_until, _last_warning, _memory_noted
    flush(1.0)
    _plan, _paused_until, _last_warning, _memory_noted = None, 0.0, 0.0, False


__all__ = ["request_claim", "wake", "wake_now", "flush", "wake_after_commit", "register_after_commit", "transaction",
           "clear_token", "token_for",
           "LOCAL_WINDOW_S", "TOKEN_PREFIX"]
