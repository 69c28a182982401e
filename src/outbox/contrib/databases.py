"""A warning, once per database, when a framework helper enqueues into a database other than
the one this process's relay settings read (``OUTBOX_DATABASE_URL``; under Django, by
default ``DATABASES["default"]``): Django's ``enqueue(using="orders")``, a Flask-SQLAlchemy
bind's connection. The event commits there, but no relay reads it unless one runs with
``OUTBOX_DATABASE_URL`` pointing at that database (docs/django.md, "Several databases").
Databases are told apart by ``outbox.core.names.database_identity``: host, port and name, or
a SQLite file's absolute path; never by alias or by the URL as written, and a port left out is
the engine's default one (``comparable_identity``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..core.config import get_settings
from ..core.names import database_identity, host_list
from ..core.redact import redact

log = logging.getLogger("outbox.enqueue")

#: The databases already checked in this process (by the helper's key: an alias, a URL).
_checked: set[str] = set()

#: Each engine's default port (before any ``+driver``): a URL that leaves it out names it.
DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433}


def comparable_identity(url: str) -> str:
    """``database_identity``, with a host's port left out where it is the engine's default:
    ``db/app`` and ``db:5432/app`` are one PostgreSQL database (found in review: the app's
    SQLAlchemy URL without the port, OUTBOX_DATABASE_URL with it, and the warning said that no
    relay read the relay's own database). For this comparison only: the namespace keeps the
    identity as written (docs/relay.md, "Several outboxes on one broker")."""
    identity = database_identity(url)
    default = DEFAULT_PORTS.get(url.split("://", 1)[0].split("+", 1)[0].lower()) if "://" in url else None
    written = host_list(url) if default is not None else ""
    if not written or not identity.startswith(written):
        return identity
    return host_list(url, default_port=default) + identity[len(written):]


def check_database(key: str, url: str | Callable[[], str | None] | None, where: str) -> None:
    """Once per ``key``: warn when ``url`` (the database the helper writes to, or what returns
    it; None: not known) is not the relay's. Never raises: the caller is enqueueing, so an
    error reading either URL is said at DEBUG (found in review: Django OPTIONS the relay cannot
    carry, read outside this guard, failed every ``enqueue(using=...)`` after its insert)."""
    if key in _checked:
        return
    _checked.add(key)
    try:
        if callable(url):
            url = url()
        relay_url = get_settings().database_url
        if url is None or comparable_identity(url) == comparable_identity(relay_url):
            return
        log.warning("outbox: %s writes events into the database %s, but this process's relay settings read %s "
                    "(OUTBOX_DATABASE_URL; Django: DATABASES['default']). No relay reads these events unless one "
                    "runs with OUTBOX_DATABASE_URL pointing at that database (docs/django.md, 'Several databases')",
                    where, redact(url), redact(relay_url))
    except Exception as exc:  # noqa: BLE001 - a check must never fail an enqueue
        log.debug("outbox: cannot tell which database %s writes to: %s", where, exc)


def django_database(alias: str, connection: Any) -> None:
    """``check_database`` for the Django connection of ``alias``."""
    if f"django:{alias}" in _checked:  # the hot path: one set lookup
        return
    from ..core.sources import django_database_url

    check_database(f"django:{alias}", lambda: django_database_url(connection.settings_dict),
                   f"enqueue(using={alias!r})")


def sqlalchemy_database(conn: Any) -> None:
    """``check_database`` for a SQLAlchemy Connection or Session (its bind's URL)."""
    try:
        bind = conn.get_bind() if hasattr(conn, "get_bind") else conn.engine
        if f"sqlalchemy:{id(bind)}" in _checked:  # the hot path: one set lookup per engine
            return
        url = bind.url.render_as_string(hide_password=False)
    except Exception as exc:  # noqa: BLE001 - a Session with several binds, a detached object
        log.debug("outbox: cannot tell which database %r writes to: %s", conn, exc)
        return
    check_database(f"sqlalchemy:{id(bind)}", url, "enqueue on a SQLAlchemy connection")


def _reset_for_tests() -> None:
    _checked.clear()


__all__ = ["comparable_identity", "check_database", "django_database", "sqlalchemy_database"]
