"""Flask: enqueue on the request's database session and wake the relay after commit.

With a SQLAlchemy session (Flask-SQLAlchemy's ``db.session``, any ``scoped_session``
or ``Session``)::

    from outbox.contrib.flask import Outbox

    outbox = Outbox(app, session=db.session)      # or outbox.init_app(app) later

    @app.post("/orders")
    def create_order():
        db.session.add(order)
        outbox.enqueue(topic="orders.created", aggregate_type="order", aggregate_id=order.id,
                       payload={"orderId": order.id})
        db.session.commit()                        # the relay is woken right after this
        ...

The wake-up hangs on the session's ``after_commit`` event, once per transaction, and is
dropped on rollback. ``enqueue(conn, ...)`` (the module function) does the same for a
session passed explicitly.

With a plain DB-API connection there is no commit hook: inside a request the wake-up
runs when the view has returned (``after_this_request``), so commit in the view; outside
a request call ``outbox.wake.request_claim()`` after your commit, or use
``with outbox.transaction(conn): ...``. Wake-ups never raise into the request.
Flask-SQLAlchemy is not required: anything SQLAlchemy works.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import wake as _wake
from ..enqueue import enqueue as _enqueue
from .databases import sqlalchemy_database

log = logging.getLogger("outbox.flask")

_REQUEST_FLAG = "_outbox_wake_after_request"


def _wake_after_request(response: Any) -> Any:
    try:
        _wake._call_request_claim()
    except Exception:  # request_claim does not raise; belt and braces inside a request
        log.exception("outbox: wake-up after the request failed")
    return response


def wake_after_commit(conn: Any) -> bool:
    """Arrange a wake-up after ``conn`` commits: on the session's commit for SQLAlchemy
    sessions, after the view returns for other connections inside a request. False when
    neither applies (call ``outbox.wake.request_claim()`` after your commit)."""
    if _wake.register_after_commit(conn):
        return True
    try:
        from flask import after_this_request, has_request_context, request
    except ImportError:
        return False
    if not has_request_context():
        return False
    # Marked on the request itself: ``g`` lives as long as the app context, which one
    # ``with app.app_context():`` can stretch over several requests, and the later ones
    # then registered no wake-up (found in review).
    if not request.environ.get(_REQUEST_FLAG):
        request.environ[_REQUEST_FLAG] = True
        after_this_request(_wake_after_request)
    return True


def enqueue(conn: Any, *, wake: bool = True, **event: Any) -> int:
    """``outbox.enqueue(conn, **event)``, then a wake-up after commit (see
    ``wake_after_commit``)."""
    outbox_id = _enqueue(conn, **event)
    if _is_sqlalchemy(conn):
        sqlalchemy_database(conn)  # a bind other than the relay's database: said once
    if wake and not wake_after_commit(conn):
        log.debug("outbox: no commit hook for %s outside a request; call outbox.wake.request_claim() after "
                  "commit", type(conn).__name__)
    return outbox_id


class Outbox:
    """Flask extension: ``Outbox(app, session=db.session)``.

    ``session``: a SQLAlchemy ``Session`` or ``scoped_session``, or a callable returning
    the request's session or DB-API connection (called on every ``enqueue``).
    """

    def __init__(self, app: Any = None, *, session: Any = None) -> None:
        self.session = session
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Any) -> None:
        app.extensions["outbox"] = self
        # What enqueue reads, read now: an invalid value stops the app here, naming the setting,
        # as it stops a Django project's set-up (docs/flask.md, "Settings").
        from ..core.config import get_settings, reset_settings, wake_options
        from .startup import warn_if_wake_cannot_work

        try:
            get_settings()
            wake_options()
            # Without the workers' Celery broker settings a web process cannot wake the relay:
            # say so once at start-up (``outbox.contrib.startup``).
            warn_if_wake_cannot_work("Flask")
        finally:
            # Read for the check, then forgotten: an app built before a test points the settings
            # at its own database kept the earlier ones cached (docs/flask.md, "Settings").
            reset_settings()

    def connection(self) -> Any:
        source = self.session
        if source is None:
            raise RuntimeError("outbox.contrib.flask.Outbox has no session: pass session= or a connection")
        if callable(source) and not _is_sqlalchemy(source):
            return source()
        return source

    def enqueue(self, conn: Any = None, *, wake: bool = True, **event: Any) -> int:
        """Enqueue on ``conn`` (default: this extension's session) and wake after commit."""
        return enqueue(conn if conn is not None else self.connection(), wake=wake, **event)


def _is_sqlalchemy(obj: Any) -> bool:
    # A scoped_session is callable (it returns the current Session): use it as is.
    return type(obj).__module__.startswith("sqlalchemy")


def current() -> Outbox:
    """The ``Outbox`` extension of the current Flask app."""
    from flask import current_app

    return current_app.extensions["outbox"]


__all__ = ["Outbox", "enqueue", "wake_after_commit", "current"]
