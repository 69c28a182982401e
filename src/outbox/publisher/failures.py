"""Classifying a publishing error into a ``FailureKind`` (docs/publisher.md, "Failure kinds")."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from typing import Any

from ..core.errors import ConfigError
from ..core.redact import redact_error
from .contract import MAX_ERROR_HEADER_CHARS, FailureKind, PublishFailure

log = logging.getLogger("outbox.publisher")  # one logger for the whole publisher package

# -- error classification (pure) -------------------------------------------------------------

def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from (kombu wraps transport errors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _specific(exc: BaseException) -> FailureKind | None:
    """Errors whose class (and text) say exactly what happened."""
    from amqp import exceptions as amqp_exc

    text = str(exc).lower()
    if isinstance(exc, ConfigError):  # the URL names no transport kombu has: nothing can be published
        return FailureKind.FATAL
    if isinstance(exc, ssl.SSLCertVerificationError):
        # The broker's certificate does not verify (another CA, another host name): a
        # configuration to fix, or someone in the middle; never retried as an outage.
        return FailureKind.FATAL
    if isinstance(exc, amqp_exc.PreconditionFailed):
        # RabbitMQ refuses an oversized body with 406 "message size N is larger than configured
        # max size M"; every other 406 is a declaration that does not match the broker's.
        return FailureKind.POISON if "message size" in text or "max size" in text else FailureKind.FATAL
    if isinstance(exc, (amqp_exc.ContentTooLarge, amqp_exc.FrameError, amqp_exc.FrameSyntaxError)):
        return FailureKind.POISON
    if isinstance(exc, (amqp_exc.AccessRefused, amqp_exc.NotAllowed, amqp_exc.InvalidPath,
                        amqp_exc.AMQPNotImplementedError)):
        return FailureKind.FATAL
    if isinstance(exc, (amqp_exc.ResourceLocked, amqp_exc.ResourceError, amqp_exc.MessageNacked,
                        amqp_exc.RecoverableConnectionError)):
        # includes Blocked (connection.blocked) and ConnectionForced (broker shutting down)
        return FailureKind.BACKPRESSURE
    if isinstance(exc, amqp_exc.AMQPError):
        return FailureKind.RETRIABLE  # NotFound (exchange deleted: redeclared on reconnect), 541, ...
    if isinstance(exc, UnicodeError):
        return FailureKind.POISON
    try:
        from kombu.exceptions import SerializationError
    except ImportError:  # pragma: no cover
        SerializationError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, SerializationError):
        return FailureKind.POISON
    return _redis_kind(exc, text)


def _redis_kind(exc: BaseException, text: str) -> FailureKind | None:
    """By class first: redis-py raises its own class for most refusals and strips the code
    from the message (``OOM ...`` becomes ``OutOfMemoryError("command not allowed ...")``),
    so a full or read-only Redis was classified by a message that no longer said so, as
    RETRIABLE, and an outage spent every row's attempts (found in review). The codes are
    still matched in the text of a plain ``ResponseError`` (those redis-py has no class for)."""
    try:
        from redis import exceptions as redis_exc
    except ImportError:
        return None
    if isinstance(exc, _present(redis_exc, "AuthenticationError", "AuthorizationError", "NoPermissionError")):
        return FailureKind.FATAL
    if isinstance(exc, redis_exc.DataError):
        return FailureKind.POISON
    if isinstance(exc, (redis_exc.ConnectionError, redis_exc.TimeoutError)):  # BusyLoadingError too
        return FailureKind.BACKPRESSURE
    if isinstance(exc, _present(redis_exc, "OutOfMemoryError", "ReadOnlyError", "MasterDownError", "TryAgainError",
                                "ClusterDownError")):
        return FailureKind.BACKPRESSURE
    if isinstance(exc, redis_exc.ResponseError):
        if text.startswith(("noauth", "wrongpass", "noperm")):
            return FailureKind.FATAL
        if text.startswith(("oom", "busy", "loading", "tryagain", "masterdown", "readonly", "misconf", "noreplicas",
                            "clusterdown")):
            return FailureKind.BACKPRESSURE
        return FailureKind.RETRIABLE
    return None


def _present(module: Any, *names: str) -> tuple[type, ...]:
    """The classes of ``module`` among ``names`` (an older redis-py lacks some)."""
    return tuple(getattr(module, name) for name in names if hasattr(module, name))


def _generic(exc: BaseException) -> FailureKind | None:
    """Errors that only say "the broker could not be talked to"."""
    from kombu.exceptions import OperationalError

    if isinstance(exc, (OSError, OperationalError)):  # refused, reset, broken pipe, timeouts, DNS
        return FailureKind.BACKPRESSURE
    return None


def classify(exc: BaseException) -> FailureKind:
    """Map an exception raised while connecting or publishing to a ``FailureKind``.

    The exception and its causes are examined together: a specific cause (say, an
    ``AccessRefused`` wrapped in kombu's ``OperationalError``) decides over a generic
    connection error; anything unknown is RETRIABLE, so it is retried and, if it never goes
    away, dead-lettered after the maximum number of attempts.
    """
    chain = list(_causes(exc))
    for rule in (_specific, _generic):
        for cause in chain:
            kind = rule(cause)
            if kind is not None:
                return kind
    return FailureKind.RETRIABLE


def _connection_lost(exc: BaseException) -> bool:
    """The socket died under us (reset, broken pipe, closed by the peer). Not a timeout: that
    already cost the full confirm timeout and may mean the broker hangs. Not a nack either."""
    from amqp import exceptions as amqp_exc

    causes = list(_causes(exc))
    if any(isinstance(cause, TimeoutError) for cause in causes):  # socket.timeout is TimeoutError
        return False
    return any(isinstance(cause, (ConnectionError, amqp_exc.RecoverableConnectionError))
               or type(cause) is OSError for cause in causes)


def failure_from(exc: BaseException) -> PublishFailure:
    reason = redact_error(exc)
    if len(reason) > MAX_ERROR_HEADER_CHARS:
        reason = reason[: MAX_ERROR_HEADER_CHARS - 3] + "..."
    return PublishFailure(classify(exc), reason, exc)
