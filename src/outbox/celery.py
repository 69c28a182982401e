"""The relay's Celery app: ``celery -A outbox worker`` and ``celery -A outbox beat``.

``celery -A outbox`` finds this module by itself: ``celery.app.utils.find_app`` looks for
an ``app`` or ``celery`` attribute on the ``outbox`` package and, finding neither, imports
``outbox.celery`` and takes its ``app``. Nothing depends on the current directory.

Configuration
-------------
Everything comes from the OUTBOX_* settings (``outbox.config``). The same names also work
as Celery config keys (a module passed with ``celery -A outbox --config mymodule``, or
``app.conf.update(...)`` before the app is used) and win over the environment there.
Relay tuning that is not (yet) a contract setting is read from ``OUTBOX_RELAY_*`` the
same way (see ``outbox.relay.RelayOptions``). The Celery settings below are *defaults*: a
config module may still set any Celery key, ``broker_url`` included.

The configuration is computed lazily, the first time Celery reads ``app.conf`` (worker or
beat start-up, or the first ``send_task``), so an invalid setting stops start-up with a
``ConfigError`` that names it.

Queues
------
Each task has its own queue, so each can be scaled and routed on its own
(``celery -A outbox worker -Q outbox.publish -c 8``, ``... -Q outbox.claim,outbox.ack,outbox.purge -c 2``).
A worker started without ``-Q`` consumes all four.

Operations
----------
Every log record of the worker and beat passes ``outbox.redact.RedactingFilter`` (no
password is ever logged). With a ``redis://`` Celery broker the transport is
``outbox.celery_redis:Transport``, which drops a message it cannot decode instead of
stopping the worker (docs/relay.md, "Garbage in Celery's Redis broker").

The in-memory Celery broker
---------------------------
``memory://`` (the default next to SQLite) only exists inside one process. The worker then
runs a thread pool instead of prefork and runs the schedule itself (Celery's beat in a
thread, with the same ``beat_schedule``), so ``celery -A outbox worker`` alone relays the
embedded default. A separate ``celery -A outbox beat`` cannot reach it; use Redis for that.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from celery import Celery, signals
from kombu import Exchange, Queue

from .config import Settings, load_settings
from .errors import ConfigError
from .redact import install_filter, redact
from .relay import (ACK_QUEUE, ACK_TASK, CLAIM_QUEUE, CLAIM_TASK, FAIL_TASK, PUBLISH_QUEUE, PUBLISH_TASK,
                    PURGE_QUEUE, PURGE_TASK, QUEUES, RELEASE_TASK, RelayOptions)

log = logging.getLogger("outbox.celery")

app = Celery("outbox", include=["outbox.tasks"])

_lock = threading.RLock()
_settings: Settings | None = None
_options: RelayOptions | None = None


def _conf_keys() -> dict[str, Any]:
    """OUTBOX_* keys present in Celery's configuration."""
    conf = app.conf
    return {key: conf[key] for key in list(conf.keys()) if isinstance(key, str) and key.startswith("OUTBOX_")}


def relay_settings() -> Settings:
    """The OUTBOX_* settings of this app: Celery config keys over the environment."""
    global _settings
    with _lock:
        if _settings is None:
            overrides = {k: v for k, v in _conf_keys().items() if not k.startswith("OUTBOX_RELAY_")}
            _settings = load_settings(overrides=overrides)
        return _settings


def relay_options() -> RelayOptions:
    global _options
    with _lock:
        if _options is None:
            _options = RelayOptions.from_sources(_conf_keys(), os.environ)
        return _options


def reset_relay_settings() -> None:
    """Forget the cached settings (tests)."""
    global _settings, _options
    with _lock:
        _settings = _options = None


def load_beat_schedule(settings: Settings, options: RelayOptions) -> dict[str, Any]:
    """The schedule, from the top-level ``beat_schedule`` module (the one definition)."""
    import beat_schedule

    return beat_schedule.build_schedule(settings, options)


def celery_config(settings: Settings, options: RelayOptions) -> dict[str, Any]:
    broker_url = settings.broker_url
    lease_s = settings.claim_timeout_ms / 1000.0
    in_memory = broker_url.startswith("memory://")
    config: dict[str, Any] = {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        "timezone": "UTC",
        "enable_utc": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # Nobody waits for a relay task's result: the outcome is in the outbox table.
        "task_ignore_result": True,
        "result_backend": None,
        "task_queues": [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES],
        "task_default_queue": CLAIM_QUEUE,
        "task_routes": {
            CLAIM_TASK: {"queue": CLAIM_QUEUE},
            PUBLISH_TASK: {"queue": PUBLISH_QUEUE},
            ACK_TASK: {"queue": ACK_QUEUE},
            FAIL_TASK: {"queue": ACK_QUEUE},
            RELEASE_TASK: {"queue": ACK_QUEUE},
            PURGE_TASK: {"queue": PURGE_QUEUE},
        },
        # Prefetch 1: a publish task carries up to a batch of rows whose lease is already
        # running. Prefetching more would park leased rows in one busy worker's buffer
        # (late, and costing memory) while other processes sit idle.
        "worker_prefetch_multiplier": 1,
        # acks_late and reject_on_worker_lost are set per task in outbox.tasks, where the
        # reasons are given. Correctness never rests on Celery's ack: rows are settled in
        # the table, fenced by the lease. So a task running when the connection to Celery's
        # broker drops is allowed to finish its chain rather than be cancelled halfway.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # A publish task (or a claim publishing a small batch itself) stuck past its lease
        # (a hung broker socket) is killed; the lease brings its rows back. Time limits
        # need the prefork pool.
        "task_annotations": {PUBLISH_TASK: {"time_limit": max(10.0, lease_s)},
                             CLAIM_TASK: {"time_limit": max(10.0, lease_s)}},
        "worker_hijack_root_logger": True,
        "beat_schedule": load_beat_schedule(settings, options),
    }
    if broker_url.startswith("redis://"):
        # kombu's Redis transport, made to drop a message it cannot decode instead of
        # stopping the worker (outbox.celery_redis). The URL is read exactly as before.
        config["broker_transport"] = "outbox.celery_redis:Transport"
    elif broker_url.startswith("outboxdb"):
        # The database as Celery's broker (docs/transport.md). Imported only here, so a
        # worker on any other broker imports nothing of it (this runs before Celery
        # connects, so the outboxdb scheme is registered in time). A publish task may run
        # up to its time limit (the lease) before it is acked: the visibility timeout must
        # outlast that, or the message would be delivered again while it runs.
        from .transport import register
        from .transport.options import transport_options

        register()
        config["broker_transport_options"] = transport_options(
            _conf_keys(), os.environ, visibility_timeout=max(120.0, 2 * lease_s))
    if in_memory:
        # One process: threads share the in-memory broker, prefork children would not.
        config["worker_pool"] = "threads"
        # The in-memory transport polls; its default of once a second would add a second
        # to every hop (tick -> claim -> publish).
        config["broker_transport_options"] = {"polling_interval": 0.05}
    return config


def _defaults() -> dict[str, Any]:
    try:
        return celery_config(relay_settings(), relay_options())
    except ConfigError as exc:
        if os.path.basename(sys.argv[0] or "").startswith("celery"):
            # `celery -A outbox worker|beat`: one clear line and a non-zero exit, no traceback.
            raise SystemExit(redact(f"outbox: invalid configuration: {exc}")) from None
        raise


app.add_defaults(_defaults)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _mask_secrets_in_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Every line the worker and beat log goes through ``outbox.redact``: passwords in
    URLs, in ODBC strings, and in driver errors that quote a fragment of a URL."""
    install_filter(logging.getLogger())
    if logger is not None:
        install_filter(logger)


# -- the in-memory broker: run the schedule inside the worker --------------------------------

_embedded_beat: Any = None


@signals.worker_ready.connect
def _start_embedded_beat(**_: Any) -> None:
    global _embedded_beat
    if not str(app.conf.broker_url or "").startswith("memory://") or _embedded_beat is not None:
        return
    from celery.beat import EmbeddedService

    _embedded_beat = EmbeddedService(app, thread=True, scheduler_cls="celery.beat:Scheduler")
    _embedded_beat.start()
    log.info("outbox: Celery's broker is in memory; this worker runs the schedule itself")


@signals.beat_init.connect
def _warn_beat_in_memory(**_: Any) -> None:
    if _embedded_beat is None and str(app.conf.broker_url or "").startswith("memory://"):
        log.warning("outbox: Celery's broker is memory://, which a separate beat process cannot share with the "
                    "workers; the worker runs the schedule itself. Set OUTBOX_CELERY_BROKER_URL (Redis) to run beat.")


@signals.worker_shutdown.connect
def _stop_embedded_beat(**_: Any) -> None:
    global _embedded_beat
    if _embedded_beat is not None:
        _embedded_beat.stop()
        _embedded_beat = None


# Idle workers and beat are quiet at INFO and log a heartbeat instead (outbox.worker_logging).
from . import worker_logging as _worker_logging  # noqa: E402

_worker_logging.install(relay_settings, relay_options)


__all__ = ["app", "relay_settings", "relay_options", "reset_relay_settings", "celery_config",
           "load_beat_schedule"]
