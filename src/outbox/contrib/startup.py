"""A warning, once per process, when a web process cannot wake the relay.

The wake-up after commit (``outbox.wake``) sends a claim through Celery's broker. A web
process that lacks the workers' broker settings sends it nowhere: with the embedded
default (SQLite) the broker is ``memory://``, which exists only inside one process, so
the wake silently does nothing and events wait for beat's next claim tick. Nothing is
lost, but latency is a tick instead of milliseconds, and nobody is told why. The Django
app (``AppConfig.ready``) and the Flask extension (``init_app``) call
``warn_if_wake_cannot_work`` once at start-up.
"""

from __future__ import annotations

import logging

log = logging.getLogger("outbox.wake")

_warned = False


def wake_problem() -> str | None:
    """Why wake-ups from this process cannot reach the relay, or None."""
    from ..core.config import get_settings, wake_options

    if not wake_options().wake:
        return None  # turned off on purpose
    settings = get_settings()
    from ..dramatiq import brokers

    if brokers.configured():
        brokers.settings()  # Dramatiq is the runner: wakes go to its (validated) broker
        return None
    from ..celery.application import app

    broker = str(app.conf.broker_url or settings.broker_url)
    if broker.startswith("memory://"):
        return ("Celery's broker is memory:// (no OUTBOX_CELERY_BROKER_URL, and the database is SQLite), which "
                "exists only inside one process: wake-ups after commit reach no worker. Events still go out on "
                "beat's next claim tick (OUTBOX_CLAIM_INTERVAL_S); set OUTBOX_CELERY_BROKER_URL to the workers' "
                "broker (as in the worker's environment) for millisecond latency")
    return None


def warn_if_wake_cannot_work(where: str) -> str | None:
    """Log the problem once per process (``where``: "Django", "Flask"); return it."""
    global _warned
    try:
        problem = wake_problem()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - an invalid configuration is reported where it is used
        log.debug("outbox: cannot tell whether wake-ups work: %s", exc)
        return None
    if problem and not _warned:
        _warned = True
        log.warning("outbox (%s): %s", where, problem)
    return problem


def _reset_for_tests() -> None:
    global _warned
    _warned = False


__all__ = ["wake_problem", "warn_if_wake_cannot_work"]
