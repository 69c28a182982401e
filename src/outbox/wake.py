"""Waking the relay right after the caller's transaction commits: ``request_claim()``
(handed off, coalesced, never raises, no I/O in the caller's thread), ``transaction(conn)``
(also ``outbox.transaction``), ``wake_after_commit(conn)`` and ``register_after_commit(conn)``.
The hand-off thread, the one claim-request token it shares with the workers, and what a
wake costs: docs/waking-and-metrics.md, "Post-commit wake-up". How a claim is sent is the
runner's (``outbox.relay.waker.Waker``): Celery's (``outbox.celery.waker``), or Dramatiq's
(``outbox.dramatiq.waker``) when ``OUTBOX_DRAMATIQ_BROKER_URL`` is set (docs/dramatiq.md);
``_choose_waker`` is the one place that chooses.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from .core.config import dramatiq_settings, wake_options
from .core.errors import StoreError, UnsupportedConnection
from .core.handoff import HandOff
from .core.redact import redact_error
from .relay import waker as _waker
from .relay.waker import Waker
from .storage.engines import engine_class, unwrap_connection
from .storage.engines.base import committing

log = logging.getLogger("outbox.wake")

#: After a failed send, wakes pause this long (the broker is down: don't pay a connect
#: attempt per commit). Beat's tick delivers meanwhile.
FAILURE_PAUSE_S = 1.0
#: A failure is logged as a warning at most this often; otherwise at debug level.
WARN_EVERY_S = 60.0
#: At interpreter exit, a wake still pending gets this long to go out (beat's tick covers
#: one that does not).
EXIT_FLUSH_S = 1.0


def _choose_waker(options: Any) -> Waker:
    """The runner this process wakes: Dramatiq when it is configured (OUTBOX_DRAMATIQ_BROKER_URL),
    else Celery. Imported here, on first need, so that a writer loads only its runner's sender."""
    dramatiq = dramatiq_settings()
    if dramatiq is not None:
        from .dramatiq.waker import DramatiqWaker

        return DramatiqWaker(dramatiq.url, dramatiq.namespace, options)
    from .celery.waker import CeleryWaker

    return CeleryWaker.from_app(options)


_waker_made: Waker | None = None
_waker_lock = threading.Lock()
_paused_until = 0.0
_last_warning = 0.0
_memory_noted = False


def _current_waker() -> Waker:
    """The cached waker; made again in a new process or after ``reset_settings``."""
    global _waker_made
    options = wake_options()
    made = _waker_made
    if made is not None and made.pid == os.getpid() and made.options is options:
        return made
    made = _choose_waker(options)
    made.prepare()
    with _waker_lock:
        _waker_made = made
    return made


def _failed(what: str, exc: BaseException) -> None:
    global _paused_until, _last_warning
    now = time.monotonic()
    _paused_until = now + FAILURE_PAUSE_S
    # Masked here: the writer's process logs through its own handlers (docs/relay.md, "Secrets in output").
    error = redact_error(exc)
    if now - _last_warning >= WARN_EVERY_S:
        _last_warning = now
        log.warning("outbox: cannot wake the relay (%s: %s); the next claim tick delivers. "
                    "Further failures are logged at debug level for %.0f s", what, error, WARN_EVERY_S)
    else:
        log.debug("outbox: cannot wake the relay (%s: %s)", what, error)


def wake_now() -> bool:
    """The coalesced wake itself, in the calling thread (the hand-off thread runs it; so
    can code that wants to wait for it). True when a claim was sent or is on its way."""
    try:
        if time.monotonic() < _paused_until:
            return False
        in_process = _waker.in_process_claim  # a relay worker runs in this process
        if in_process is not None:
            return bool(in_process())
        return _current_waker().wake(_failed)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - never raises
        _failed("sending the request", exc)
        return False


#: This process's hand-off thread (``outbox.core.handoff``): ``request_claim`` only flags it.
_handoff = HandOff(lambda: wake_now(), "outbox-wake")


def _forget_after_fork() -> None:
    global _waker_made, _waker_lock
    _waker_made, _waker_lock = None, threading.Lock()  # a lock held in the parent at fork stays held
    # The Celery app's pools, and kombu's global ones under them, hold the parent's broker
    # sockets; both are dropped (never closed: that would shut the parent's) as Celery and kombu
    # do in multiprocessing's after-fork hook, which a plain os.fork does not run
    # (docs/waking-and-metrics.md, "After a fork").
    application = sys.modules.get("outbox.celery.application")
    if application is not None:
        from kombu import pools

        after_fork = getattr(application.app, "_after_fork", None)  # Celery's own hook (private: maybe gone)
        if after_fork is not None:
            after_fork()
        pools.connections.clear()
        pools.producers.clear()


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
        log.debug("outbox: flushing wake-ups at exit failed", exc_info=True)


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
        if _waker.in_process_claim is None and _current_waker().kind == "memory":
            if not _memory_noted:
                _memory_noted = True
                log.debug("outbox: the runner's broker is memory:// and no worker runs in this process; "
                          "wake-ups are skipped")
            return False
        _handoff.request()
        return True
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - never into the caller, whose transaction has committed
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
    """A Django connection: a backend's ``DatabaseWrapper`` wherever its module lives
    (mssql-django's ``mssql.base``, django-prometheus's, a subclass of your own), or the
    ``django.db.connection`` proxy. Told by type, never by module name (docs/django.md,
    "Backends"); Django is never imported here: a connection of it exists only once it is."""
    base = sys.modules.get("django.db.backends.base.base")
    if base is None:
        return False
    if isinstance(conn, base.BaseDatabaseWrapper):
        return True
    proxies = sys.modules.get("django.utils.connection")
    return proxies is not None and isinstance(conn, proxies.ConnectionProxy)


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
    # SQLAlchemy sends both events for a savepoint too: its release woke the relay before
    # the real COMMIT (then nothing at it), its rollback dropped the outer transaction's
    # wake (found in review). Only the outermost transaction's end counts.
    if session.in_nested_transaction():
        return
    if session.info.pop(_SESSION_PENDING, False):
        _call_request_claim()


def _session_after_rollback(session: Any) -> None:
    if session.in_nested_transaction():
        return
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
        except Exception as exc:  # noqa: BLE001 - manual transaction management: no on-commit hook
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

    On a DB-API connection the block begins a transaction in autocommit mode too, and a
    block inside another on the same connection is a savepoint that the outer block commits
    (docs/waking-and-metrics.md, "outbox.transaction"). On SQLite the transaction begins
    IMMEDIATE where this opens it (a sqlite3 connection not in a transaction; Django 5.1+'s
    outermost block, unless ``transaction_mode`` is set), so its reads are inside it and its
    first write cannot fail at once with "database is locked" because a relay's heartbeat
    committed after them (docs/relay.md, "SQLite: application transactions").
    """
    if _is_django(conn):
        with atomic_on(conn):
            if wake:
                register_after_commit(conn)
            yield conn
        return
    if type(conn).__module__.startswith("sqlalchemy"):
        with committing(conn):
            yield conn
    else:
        with _dbapi_transaction(conn) as outermost:
            yield conn
        if not outermost:
            return  # the outer block commits, then wakes
    if wake:
        _call_request_claim()


#: How deep the ``transaction`` blocks open on each DB-API connection (by ``id``) are: a
#: block inside another is a savepoint (docs/waking-and-metrics.md, "outbox.transaction").
_open_blocks: dict[int, int] = {}
#: The connections whose transaction a nested block lost (its savepoint gone with it): their
#: outermost block rolls back instead of committing.
_lost: set[int] = set()


@contextmanager
def _dbapi_transaction(conn: Any) -> Iterator[bool]:
    """``transaction``'s block on a DB-API connection, the engine's way: its own transaction,
    begun in autocommit mode too, or a savepoint inside an outer block. Yields whether the
    block is the outermost (the one that commits)."""
    kind, raw = unwrap_connection(conn)
    engine = engine_class(kind)()
    key = id(raw)
    depth = _open_blocks.get(key, 0)
    if depth == 0 and engine.in_callers_transaction(raw):
        raise UnsupportedConnection(
            "outbox.transaction(conn): a transaction it did not begin is open on this autocommit connection "
            "(your BEGIN); it can neither end it nor know when it commits: enqueue in it and call "
            "outbox.wake.request_claim() after your commit, or let outbox.transaction begin it")
    _open_blocks[key] = depth + 1
    try:
        with (engine.savepoint(raw, f"outbox_block_{depth}", lambda: _lost.add(key)) if depth
              else engine.own_transaction(raw)):
            yield depth == 0
            if depth == 0 and key in _lost:  # rolled back by its own commit's context (own_transaction)
                raise StoreError("outbox.transaction: a nested block lost the transaction (a deadlock or an error "
                                 "that doomed it rolled it back, this block's work before it too), so this block "
                                 "rolled back what came after instead of committing half of it; run it again")
    finally:
        if depth:
            _open_blocks[key] = depth
        else:
            del _open_blocks[key]
            _lost.discard(key)


@contextmanager
def atomic_on(conn: Any) -> Iterator[None]:
    """``transaction.atomic`` on the Django connection ``conn``; on SQLite its outermost
    block begins IMMEDIATE (``transaction``) unless OPTIONS' ``transaction_mode`` says how."""
    from django.db import transaction as dj_transaction

    with ExitStack() as stack:
        atomic = dj_transaction.atomic(using=conn.alias)
        if _django_sqlite_deferred(conn):
            conn.transaction_mode = "IMMEDIATE"  # read by the BEGIN the outermost atomic runs
            try:
                stack.enter_context(atomic)
            finally:
                conn.transaction_mode = None
        else:
            stack.enter_context(atomic)
        yield


def _django_sqlite_deferred(conn: Any) -> bool:
    """A Django SQLite connection whose next ``atomic`` opens a transaction, and opens it
    deferred: Django 5.1+ (``transaction_mode``), none set in OPTIONS, no block open."""
    if getattr(conn, "vendor", None) != "sqlite" or conn.in_atomic_block or not conn.get_autocommit():
        return False
    conn.ensure_connection()  # connecting reads transaction_mode from OPTIONS
    return hasattr(conn, "transaction_mode") and conn.transaction_mode is None


def _reset_for_tests() -> None:
    global _waker_made, _paused_until, _last_warning, _memory_noted
    flush(1.0)
    _waker_made, _paused_until, _last_warning, _memory_noted = None, 0.0, 0.0, False


__all__ = ["request_claim", "wake", "wake_now", "flush", "wake_after_commit", "register_after_commit", "transaction"]
