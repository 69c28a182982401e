"""Every exception the package raises on purpose, in one place."""

from __future__ import annotations

import importlib


def install_hint(extra: str) -> str:
    """How to install an extra, said the same way everywhere. The package is not on PyPI,
    so a bare PyPI requirement for "outbox-relay" would fetch whatever someone registered
    under that name: every hint names a checkout or a Git URL (README, "Install")."""
    return (f'pip install "<outbox-relay checkout>[{extra}]" or "outbox-relay[{extra}] @ git+<repository URL>" '
            "(not on PyPI)")


#: What kombu's transport for a URL scheme imports, and the extra that installs it: redis-py,
#: and the transport module itself, which imports ``packaging`` (kombu's ``redis`` extra): with
#: redis-py alone (the dramatiq extra once) `outbox check` said only "No module named 'packaging'".
TRANSPORT_EXTRAS = {"redis": (("redis", "kombu.transport.redis"), "redis"),
                    "rediss": (("redis", "kombu.transport.redis"), "redis")}


def transport_hint(url: str) -> str | None:
    """When kombu's transport for ``url`` cannot work because its library is missing: the
    extra to install, in one line (kombu then fails with whatever it tripped on first)."""
    modules, extra = TRANSPORT_EXTRAS.get(url.split("://", 1)[0].lower(), ((), None))
    if extra is None:
        return None
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as exc:
        return f"the {extra} extra is not installed ({type(exc).__name__}: {exc}): {install_hint(extra)}"
    return None


class OutboxError(Exception):
    """Base class of every error raised by outbox-relay."""


class ConfigError(OutboxError, ValueError):
    """A setting is missing or invalid. The message always names the setting."""


class EnqueueError(OutboxError, ValueError):
    """``enqueue`` refused its input. Raised before anything is written, so the
    caller's transaction is untouched and the caller decides what happens to it."""


class StoreError(OutboxError):
    """A store operation failed for a reason that retrying will not fix."""


class UnsupportedConnection(OutboxError, TypeError):
    """``enqueue`` was handed an object that is not a connection we know how to use."""


class BrokerDatabaseUnavailable(OutboxError):
    """The database behind the ``outboxdb`` broker cannot be reached (a restart, a failover,
    a dropped connection) after the transport's own retries. It is one of the transport
    class's ``connection_errors``, so kombu and Celery reconnect instead of stopping the
    worker, whichever driver raised the original error (kept as ``__cause__``)."""
