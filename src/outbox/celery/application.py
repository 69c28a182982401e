"""The relay's Celery app and its configuration (``celery -A outbox`` loads it through
``outbox.celery``). Why the settings below are what they are: docs/relay.md,
"Tasks, queues, and how to scale and route them"; the queues, one set per outbox: ``outbox.core.names``.

This module defines no task and connects no signal: the tasks are in ``outbox.celery.tasks``,
the per-process wiring in ``outbox.celery.worker``.
"""

from __future__ import annotations

import logging
import os
import ssl
import sys
import time
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP as CeleryAMQP
from kombu import Connection as KombuConnection
from kombu import Exchange, Queue
from kombu.connection import ConnectionPool, PooledConnection
from kombu.utils.url import as_url

from ..core.config import (
    RelayOptions,
    Settings,
    celery_broker_named_conflict,
    message_ttl_s,
    relay_options,
    relay_settings,
    startup_options,
    use_conf,
)
from ..core.errors import ConfigError
from ..core.names import CLAIM_TASK, PUBLISH_TASK, TASK_OUTBOX_ARG, Queues, is_redis_url
from ..core.redact import redact
from ..core.sources import celery_setting
from ..schedule import load_beat_schedule

log = logging.getLogger("outbox.celery")

#: kombu's Redis transport made to drop garbage instead of stopping the worker
#: (``outbox.celery.redis_transport``), Celery's transport for a ``redis://`` or ``rediss://``
#: broker URL.
REDIS_TRANSPORT = "outbox.celery.redis_transport:Transport"


#: kombu's Redis transport's own visibility timeout, the least the relay gives it.
KOMBU_VISIBILITY_S = 3600.0

#: Celery's consumer tries its broker again at least this often during an outage.
RECONNECT_EVERY_S = 2.0
#: During one outage the caller's errback (Celery's ERROR line) runs at most this often.
RECONNECT_LOG_EVERY_S = 60.0


class Connection(KombuConnection):
    """kombu's connection, with two changes. It names a transport given by class path by that
    path (``outbox.celery.redis_transport:Transport://:**@host``, the worker's banner included):
    shown here as the URL the user gave, a password masked only where there is one (and
    ``memory://`` as such). And
    ``ensure_connection`` tries again every ``RECONNECT_EVERY_S``, quietly. A ``memory://``
    connection (the embedded default's broker) is given kombu's default host, ``localhost``,
    itself: kombu did the same but logged "No hostname was supplied. Reverting to default
    'localhost'" at WARNING for every connection, the first lines of a first worker's log."""

    def __init__(self, hostname: Any = "localhost", *args: Any, **kwargs: Any) -> None:
        #: The URL said ``rediss://``, which ``transport_cls`` no longer shows (``_init_params``).
        self.rediss_url = isinstance(hostname, str) and hostname.startswith("rediss://")
        super().__init__(hostname, *args, **kwargs)
        if self.transport_cls == "memory" and not self.hostname:
            self.hostname = "localhost"  # type: ignore[assignment]  # kombu declares it None, sets a str

    def _init_params(self, **params: Any) -> None:  # type: ignore[override]  # kombu passes them by name
        """kombu's. For a ``rediss://`` URL given to ``REDIS_TRANSPORT``, kombu's own rule for
        that scheme first: TLS on, and with no ``ssl`` options (``broker_use_ssl`` or the URL's
        ``ssl_*`` parameters) its warning and no certificate check, exactly as kombu's
        transport would connect. kombu applies it by the scheme name only."""
        ours = self.rediss_url and params.get("transport") == REDIS_TRANSPORT
        if ours:
            params["transport"] = "rediss"
        super()._init_params(**params)
        if ours:
            self.transport_cls = REDIS_TRANSPORT
        # amqps:// without ssl (Celery's None): kombu's TLS transport turns it on later, unnamed.
        if (self.ssl or self.transport_cls == "amqps") and self.transport_cls in ("amqps", "amqp", "pyamqp"):
            self.ssl = _named(self.ssl or True, self.hostname or "localhost")

    def as_uri(self, include_password: bool = False, mask: str = "**", *args: Any, **kwargs: Any) -> str:
        if self.transport_cls == "memory" and self.hostname == "localhost" and not (self.userid or self.password):
            return "memory://"  # as given, not kombu's memory://:**@localhost// (no password to mask)
        if self.transport_cls != REDIS_TRANSPORT:
            return super().as_uri(include_password, mask, *args, **kwargs)
        # kombu's type comment on as_url says str and int where its defaults (and these) may be None.
        user, password = self.userid or None, self.password or None
        scheme = "rediss" if self.ssl else "redis"  # TLS: the URL's scheme, or ssl options (a clone)
        return as_url(scheme, self.hostname or "localhost", self.port, user, password,  # type: ignore[arg-type]
                      self.virtual_host, sanitize=not include_password, mask=mask)

    def Pool(self, limit: int | None = None, **kwargs: Any) -> ConnectionPool:
        """kombu's, whose connections are this class, each host named (``_named``)."""
        return _Pool(self, limit=limit, **kwargs)

    def ensure_connection(self, errback: Any = None, max_retries: int | None = None, *args: Any,
                          **kwargs: Any) -> Connection:
        """kombu's, retrying every ``RECONNECT_EVERY_S`` at most unless the caller says
        otherwise (kombu's default backs off to 30 s, so Celery's consumer came back up to
        30 s after its broker did), and calling ``errback`` (Celery logs an ERROR per
        attempt) for the first failure and then once a minute: docs/relay.md, "Outages in
        the log"."""
        if not args:
            for name in ("interval_start", "interval_step", "interval_max"):
                kwargs.setdefault(name, RECONNECT_EVERY_S)
        outage = _ConnectOutage(self, errback)
        super().ensure_connection(outage.errback, max_retries, *args, **kwargs)
        outage.over()
        return self


def _named(use_ssl: Any, host: str) -> Any:
    """Celery's ``broker_use_ssl`` for an AMQP broker (``True`` for a bare ``amqps://``), naming
    ``host`` as the name its certificate must carry: py-amqp checks the host name only when
    given one, and accepted a certificate for any name (found in review). Set again for each
    host of a failover list (``_init_params``); left alone when it names one already
    (``server_hostname``; ``None`` is kombu's "the URL's host", named here) or checks no
    certificate (docs/relay.md, "TLS to Celery's RabbitMQ")."""
    options = dict(use_ssl) if isinstance(use_ssl, dict) else {}
    if isinstance(use_ssl, _HostNamed):  # named here for another host (a clone, a pool's connection)
        del options["server_hostname"]
    elif options.get("server_hostname") is not None or options.get("cert_reqs") == ssl.CERT_NONE:
        return use_ssl
    return _HostNamed(options, server_hostname=host)


class _HostNamed(dict):
    """``ssl`` options whose ``server_hostname`` ``_named`` set, not the user: a copy of the
    connection (``clone``, a pool's) connecting to another host of the list names that one."""


class _PooledConnection(PooledConnection, Connection):
    """A pool's connection, of the app's class: kombu's own named no host and, given the
    ``ssl`` of a connection to the list's first host, refused the others (found in review)."""


class _Pool(ConnectionPool):
    def new(self) -> Connection:
        return _PooledConnection(self, **dict(self.connection._info(resolve=False)))


class _ConnectOutage:
    """The failed attempts of one ``ensure_connection``: the first and then one a minute
    go to the caller's errback, the rest to DEBUG; a success after failures logs one line."""

    def __init__(self, conn: KombuConnection, errback: Any) -> None:
        self.conn = conn
        self.errback = self._failed if errback is not None else None
        self.inner = errback
        self.failures = 0
        self.began = self.logged = 0.0

    def _failed(self, exc: BaseException, interval: float) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self.began = now
        if self.failures == 1 or now - self.logged >= RECONNECT_LOG_EVERY_S:
            self.logged = now
            self.inner(exc, interval)
        else:
            log.debug("outbox: broker still unreachable (attempt %d): %s", self.failures, exc)

    def over(self) -> None:
        if self.failures:
            log.info("outbox: broker reachable again (%s) after %d failed attempts in %.1f s",
                     redact(self.conn.as_uri()), self.failures, time.monotonic() - self.began)


class AMQP(CeleryAMQP):
    """Celery's connection factory, with the connection above."""

    Connection = Connection
    BrokerConnection = Connection


# Never the process's current app: a web process imports this one to wake the relay, and the
# project's own ``shared_task``s would then go to the relay's broker (docs/relay.md, "Running
# worker and beat"). ``celery -A outbox worker|beat`` makes it current itself.
app = Celery("outbox", include=["outbox.celery.tasks"], amqp=AMQP, set_as_current=False)

# The one configuration reader (``outbox.core.config``) reads this app's OUTBOX_* config keys.
use_conf(lambda: app.conf)


def publish_time_limit(settings: Settings) -> float:
    """The hard (and soft) time limit of publish and claim tasks: the lease, at least 10 s."""
    return max(10.0, settings.claim_timeout_ms / 1000.0)


def celery_config(settings: Settings, options: RelayOptions) -> dict[str, Any]:
    broker_url = settings.broker_url
    lease_s = settings.claim_timeout_ms / 1000.0
    in_memory = broker_url.startswith("memory://")
    queues = settings.queues  # this outbox's own (docs/relay.md, "Several outboxes on one broker")
    config: dict[str, Any] = {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        # Celery's default, 100, stopped the worker ("Unrecoverable error") after a broker
        # outage of 100 attempts, 200 s at RECONNECT_EVERY_S; it tries while the outage lasts.
        "broker_connection_max_retries": None,
        "timezone": "UTC",
        "enable_utc": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # Nobody waits for a relay task's result: the outcome is in the outbox table.
        "task_ignore_result": True,
        "result_backend": None,
        # Relay tasks always go through the relay's queues: a config module's task_always_eager
        # made beat run every claim tick itself (docs/relay.md, "Tasks, queues, and how to scale and route them").
        "task_always_eager": False,
        "task_queues": [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in queues.all],
        "task_default_queue": queues.claim,
        # Remote control of this outbox's workers only (docs/relay.md, "Tasks, queues, and how to
        # scale and route them"): Celery's default exchange, "celery", is every app's on the broker.
        "control_exchange": settings.outbox_namespace,
        "task_routes": {task: {"queue": queue} for task, queue in queues.routes.items()},
        # Prefetch 1: a publish task carries up to a batch of rows whose lease is already
        # running. Prefetching more would park leased rows in one busy worker's buffer
        # (late, and costing memory) while other processes sit idle.
        "worker_prefetch_multiplier": 1,
        # acks_late and reject_on_worker_lost are set per task in outbox.celery.tasks, where the
        # reasons are given. Correctness never rests on Celery's ack: rows are settled in
        # the table, fenced by the lease. So a task running when the connection to Celery's
        # broker drops is allowed to finish its chain rather than be cancelled halfway.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # A publish task (or a claim publishing a small batch itself) stuck past its lease
        # (a hung broker socket) is killed; the lease brings its rows back. Time limits
        # need the prefork pool. Its soft limit is the same, so a worker's --soft-time-limit
        # never cuts a publish short within its lease (docs/relay.md, same section).
        "task_annotations": {task: {"time_limit": publish_time_limit(settings),
                                    "soft_time_limit": publish_time_limit(settings)}
                             for task in (PUBLISH_TASK, CLAIM_TASK)},
        "worker_hijack_root_logger": True,
        # Celery's scheduler, logging an outage of this broker once (outbox.celery.beat).
        "beat_scheduler": "outbox.celery.beat:Scheduler",
        "beat_schedule": load_beat_schedule(settings, options),
    }
    if is_redis_url(broker_url):
        # kombu's Redis transport, made to drop a message it cannot decode instead of
        # stopping the worker (outbox.celery.redis_transport). The URL, TLS included, is
        # read exactly as before (Connection above). An unacked message (a publish task runs
        # up to its time limit, the lease) is delivered again after the visibility timeout:
        # it must outlast the lease, as below (docs/relay.md, "Tasks, queues, and how to scale and route them").
        config["broker_transport"] = REDIS_TRANSPORT
        config["broker_transport_options"] = {"visibility_timeout": max(KOMBU_VISIBILITY_S, 2 * lease_s)}
    elif broker_url.startswith("outboxdb"):
        # The database as Celery's broker (docs/transport.md). Imported only here, so a
        # worker on any other broker imports nothing of it (this runs before Celery
        # connects, so the outboxdb scheme is registered in time). A publish task may run
        # up to its time limit (the lease) before it is acked: the visibility timeout must
        # outlast that, or the message would be delivered again while it runs.
        from ..transport import register
        from ..transport.options import transport_options

        register()
        config["broker_transport_options"] = transport_options(visibility_timeout=max(120.0, 2 * lease_s))
    if in_memory:
        # One process: threads share the in-memory broker, prefork children would not.
        config["worker_pool"] = "threads"
        # The in-memory transport polls; its default of once a second would add a second
        # to every hop (tick -> claim -> publish).
        config["broker_transport_options"] = {"polling_interval": 0.05}
    return config


def configured(key: str) -> Any:
    """What the app's own configuration (a config module: ``--config``, CELERY_CONFIG_MODULE)
    gives ``key`` (or its old upper-case name), else None. Celery puts the defaults above
    ahead of it (``add_defaults``), so a key the relay sets is the relay's unless read here."""
    return celery_setting(app.loader.conf or {}, key)


def broker_conflict(settings: Settings) -> str | None:
    """Why this worker or beat must not start: Celery's broker named otherwise than by
    OUTBOX_CELERY_BROKER_URL (``celery_broker_named_conflict``, the rule ``outbox check``
    applies too), with this app's configuration; None when they agree."""
    return celery_broker_named_conflict(settings, os.environ, app_url=app.conf.broker_url,
                                        module_url=configured("broker_url") or "")  # the loader's module, read


def _defaults() -> dict[str, Any]:
    # `celery -A outbox worker|beat`, and `python -m celery ...`, where argv[0] is celery's
    # __main__.py (found in review: a bad setting printed a traceback there).
    command = os.path.basename(sys.argv[0] or "").startswith("celery") or _main_module() == "celery.__main__"
    try:
        settings, options = startup_options()
        config = celery_config(settings, options)
    except ConfigError as exc:
        if command:  # one clear line and a non-zero exit, no traceback
            raise SystemExit(redact(f"outbox: invalid configuration: {exc}")) from None
        raise
    conflict = broker_conflict(settings) if command else None
    if conflict:
        raise SystemExit(conflict)
    own = configured("broker_transport_options")
    if own and "broker_transport_options" in config:  # the user's keys win, one by one
        config["broker_transport_options"] = {**config["broker_transport_options"], **own}
    return config


def _main_module() -> str:
    """The module ``python -m`` runs, or '' (a script, the interpreter)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return str(getattr(spec, "name", "") or "")


app.add_defaults(_defaults)


def send_relay_task(task: str, kwargs: dict[str, Any] | None = None, namespace: str | None = None,
                    **options: Any) -> Any:
    """Send one of the relay's tasks to its outbox's queue, naming the outbox in the task
    (``TASK_OUTBOX_ARG``: a worker of another outbox refuses it, see ``outbox.celery.tasks``). Every relay
    task is sent through here. ``namespace``: the outbox (default: this process's). ``expires``:
    seconds (``message_ttl_s`` at least), or a deadline (a ``datetime``: a forwarded task's, kept)."""
    namespace = namespace or relay_settings().outbox_namespace
    if isinstance(options.get("expires"), (int, float)):
        options["expires"] = message_ttl_s(options["expires"])
    return app.send_task(task, kwargs={**(kwargs or {}), TASK_OUTBOX_ARG: namespace},
                         queue=Queues(namespace).for_task(task), **options)


__all__ = ["app", "celery_config", "publish_time_limit", "broker_conflict", "configured", "send_relay_task", "load_beat_schedule", "relay_settings", "relay_options"]
