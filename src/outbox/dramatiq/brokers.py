"""Dramatiq's broker for the relay, without side effects: reading the settings, making a
broker, and sending a relay message from a process that is not a Dramatiq worker.

Kept apart from ``outbox.dramatiq.actors`` (which declares the actors and installs its broker
as Dramatiq's global broker) because the senders live in processes that must keep their own
global broker: a Django web process set up by django-dramatiq sends a post-commit wake from
here (``outbox.dramatiq.waker``), and so does the scheduler (``outbox.dramatiq.scheduler``). Sending only needs the actor's and queue's
*names* (``outbox.relay``'s constants), not the actors themselves.

Settings (``outbox.core.config.DramatiqSettings``, read in the one order of README, "Configuration"):

* ``OUTBOX_DRAMATIQ_BROKER_URL``: ``redis://...`` (Dramatiq's RedisBroker) or
  ``amqp://...`` (its RabbitmqBroker). Setting it makes Dramatiq the configured runner:
  post-commit wakes then send a Dramatiq message instead of a Celery task.
* ``OUTBOX_DRAMATIQ_NAMESPACE``: the Redis key namespace of the queues (default
  ``dramatiq``, Dramatiq's own); ignored by RabbitMQ.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..core.config import DramatiqSettings, dramatiq_settings, message_ttl_s
from ..core.errors import ConfigError, install_hint
from ..core.names import is_redis_url
from ..core.tls import redis_py_url, split_amqp_url

URL_SETTING = "OUTBOX_DRAMATIQ_BROKER_URL"


def settings(required: bool = False) -> DramatiqSettings | None:
    """The Dramatiq settings (``outbox.core.config.dramatiq_settings``); None when unset."""
    return dramatiq_settings(required=required)


def configured() -> bool:
    """Is Dramatiq the configured runner (OUTBOX_DRAMATIQ_BROKER_URL set)?"""
    return dramatiq_settings() is not None


#: The longest a worker's consumer of an idle queue sleeps between two polls of Dramatiq's
#: Redis broker. Dramatiq backs off up to the worker's timeout (1 s, not settable from its
#: command line); every hop of the relay (tick -> claim -> publish -> next claim) would
#: pay up to that. At 100 ms an idle worker process polls its eight queues (the outbox's four
#: and their delay queues) about 105 times a second, each a Lua call: ~320 Redis commands a
#: second per idle process, measured (docs/dramatiq.md, "What an idle worker costs Redis").
REDIS_IDLE_POLL_MS = 100
#: Bound on every connect and reply of Dramatiq's Redis broker (redis-py 8's default read
#: time-out; before 8 there was none). Its consumers poll rather than block, so a few seconds is
#: all a reply takes (docs/dramatiq.md, "When Dramatiq's broker is away").
REDIS_SOCKET_TIMEOUT_S = 5.0


def pika_url(url: str) -> str:
    """``url`` as pika must read it to mean what kombu (and the Celery settings) mean by it:
    kombu reads the path ``//`` as the default virtual host ``/`` (and ``//name`` as
    ``/name``), pika as an empty one, which RabbitMQ refuses (``NOT_ALLOWED - vhost  not
    found``) and the workers never connect. Every other URL is the same to both. Dramatiq's
    list of URLs (``;`` between them) is read one by one."""
    if ";" in url:
        return ";".join(pika_url(one) for one in url.split(";"))
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if path.startswith("/"):  # the virtual host's own leading slash, written plainly
        return f"{scheme}{sep}{netloc}{slash}%2F{path[1:]}"
    return url


def _redis_broker(url: str, ns: str, middleware: list[Any] | None = None) -> Any:
    """Dramatiq's RedisBroker for ``url``, with bounds of its own (``REDIS_SOCKET_TIMEOUT_S``)
    and idle consumers that poll at least every ``REDIS_IDLE_POLL_MS``. Its Redis client raises
    a time-out, and a refusal to write (``OOM``, ``READONLY``), as a connection error: Dramatiq's consumer turns only those into
    ``ConnectionClosed`` (one outage line, ``consumer_log``); a time-out was a CRITICAL traceback
    per consumer every 3 s. Through public extension points only, RedisBroker's ``client=`` and
    redis-py's ``Redis.execute_command``, so a Dramatiq upgrade cannot drop it silently
    (docs/dramatiq.md, "When Dramatiq's broker is away")."""
    import redis
    from dramatiq.brokers.redis import RedisBroker

    class _TimeoutIsConnectionError(redis.Redis):
        """Every command the broker sends (its Lua dispatch: enqueue, fetch, ack, nack; LLEN). A
        Redis that refuses writes is away too: full (``OOM``: maxmemory with noeviction) or a
        replica (``READONLY``, after a failover); as ``ResponseError``s they were a CRITICAL
        traceback per consumer every 3 s (found in review)."""

        def execute_command(self, *args: Any, **options: Any) -> Any:
            try:
                return super().execute_command(*args, **options)
            except redis.TimeoutError as exc:
                raise redis.ConnectionError(f"no answer: {exc}") from exc
            except (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError) as exc:
                if isinstance(exc, redis.exceptions.ReadOnlyError):
                    # A replica now: the address (DNS name, endpoint) leads to the new primary, the
                    # connections open stay on the old one. Closed, so the next command connects
                    # again; pooled, every command went there for ever (found in review).
                    self.connection_pool.disconnect()
                raise redis.ConnectionError(f"{type(exc).__name__}: {exc}") from exc

    class _RelayRedisBroker(RedisBroker):
        def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Any:
            return super().consume(queue_name, prefetch=prefetch, timeout=min(timeout, REDIS_IDLE_POLL_MS))

    pool = redis.ConnectionPool.from_url(redis_py_url(url), socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                                         socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
                                         socket_keepalive=True, health_check_interval=30)
    return _RelayRedisBroker(namespace=ns, middleware=middleware, client=_TimeoutIsConnectionError(connection_pool=pool))


def _rabbitmq_broker(url: str, middleware: list[Any] | None = None) -> Any:
    """Dramatiq's RabbitmqBroker for ``url``. Over TLS (``amqps://``) the URL's ``ssl_*``
    parameters, the same as the publisher's (``outbox.core.tls``), become pika's ``SSLOptions``
    on each broker's parameters: pika reads only its own ``?ssl_options={...}``, which kombu
    (the scheduler's lock) cannot read (docs/dramatiq.md, "TLS")."""
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    clean, tls = split_amqp_url(url, URL_SETTING)
    # confirm_delivery: a send (a claim's publish message) returns once RabbitMQ has it.
    broker = RabbitmqBroker(url=pika_url(clean), middleware=middleware, confirm_delivery=True)
    if tls is not None:
        for parameters in _parameters(broker):
            parameters.ssl_options = tls.pika_ssl_options(parameters.host)
    return broker


def _parameters(broker: Any) -> list[Any]:
    """The pika parameters of a RabbitmqBroker: one, or one per URL of a list."""
    parameters = broker.parameters
    return list(parameters) if isinstance(parameters, list) else [parameters]


def make_broker(url: str, ns: str, middleware: list[Any] | None = None) -> Any:
    """A Dramatiq broker for ``url``; ``middleware=None`` gives Dramatiq's defaults."""
    try:
        if is_redis_url(url):
            return _redis_broker(url, ns, middleware)
        return _rabbitmq_broker(url, middleware)
    except ImportError as exc:
        raise ConfigError(f"{URL_SETTING} needs Dramatiq with its broker: {install_hint('dramatiq')} "
                          f"({exc})") from None


def reach(url: str, timeout_s: float) -> None:
    """Open one connection to Dramatiq's broker as the workers do (the same broker, its library,
    TLS and all), waiting ``timeout_s`` at most for each step; raises what went wrong.
    ``outbox check`` reached it through kombu, which reads a ``rediss://`` URL differently
    (no certificate check without parameters): it said "reachable" to workers that could not
    connect (found in review). pika's own log lines are off meanwhile (seven ERROR lines and a
    traceback for a refused connection), and an error of pika's whose text is empty (it wraps
    its cause: ``AMQPConnectionError: (no message)`` in the check) is raised as a
    ``ConnectionError`` naming that cause (found in review)."""
    broker = make_broker(url, "dramatiq", middleware=[])
    pika_log = logging.getLogger("pika")
    level = pika_log.level
    pika_log.setLevel(logging.CRITICAL + 1)
    try:
        if is_redis_url(url):
            broker.client.ping()
            return
        for parameters in _parameters(broker):
            parameters.socket_timeout = parameters.blocked_connection_timeout = timeout_s
            parameters.stack_timeout = 2 * timeout_s
            parameters.connection_attempts = 1
        broker.connection  # noqa: B018 - opens the connection (pika's BlockingConnection)
    except Exception as exc:
        if str(exc).strip():
            raise
        raise ConnectionError(repr(exc)) from exc
    finally:
        pika_log.setLevel(level)
        broker.close()


def queue_length(broker: Any, queue: str) -> int | None:
    """Messages waiting in ``queue`` (not counting those a worker holds); None when unknown."""
    client = getattr(broker, "client", None)
    if client is not None and hasattr(broker, "namespace"):  # RedisBroker: a list per queue
        return int(client.llen(f"{broker.namespace}:{queue}"))
    counts = getattr(broker, "get_queue_message_counts", None)
    if callable(counts):  # RabbitmqBroker: (ready, delayed, dead)
        return int(counts(queue)[0])
    return None


def queued(queue: str) -> int | None:
    """Messages waiting in ``queue`` on this process's sending broker, or None when it cannot say
    (the claim-queue guard's reading: the scheduler's ticks, the writers' wakes on RabbitMQ)."""
    return queue_length(sender(), queue)


def message(actor: str, queue: str, kwargs: dict[str, Any], max_age_s: float | None = None,
            args: tuple[Any, ...] = ()) -> Any:
    """A Dramatiq message for ``actor`` on ``queue``. ``max_age_s``: the message carries
    ``expires_at`` (epoch seconds) and the actor drops it when it arrives later than that
    (a stale tick or claim request). Not Dramatiq's AgeLimit: that logs a warning per
    dropped message, and a late tick is routine while workers are busy."""
    from dramatiq import Message

    if max_age_s:
        kwargs = {**kwargs, "expires_at": time.time() + message_ttl_s(max_age_s)}
    return Message(queue_name=queue, actor_name=actor, args=tuple(args), kwargs=kwargs, options={})


def late_s(expires_at: float | None) -> float:
    """Seconds past ``expires_at`` by this host's clock (0 or less: in time, or no expiry)."""
    return 0.0 if expires_at is None else time.time() - float(expires_at)


def expired(expires_at: float | None) -> bool:
    return late_s(expires_at) > 0


_senders: dict[tuple[int, str, str], Any] = {}
_senders_lock = threading.Lock()

#: How long the sending broker's send waits on a connection RabbitMQ has blocked (a memory or
#: disk alarm) before pika gives it up (``ConnectionBlockedTimeout``). Dramatiq tries a send six
#: times, so a send fails after about 12 s of alarm: the scheduler says so once, and services its
#: lock between two sends (RabbitMQ drops a connection silent for two 10 s heartbeats).
RABBITMQ_BLOCKED_S = 2.0


def sender() -> Any:
    """This process's sending broker (no middleware, never the global broker). On RabbitMQ a send
    on a connection RabbitMQ blocks fails after ``RABBITMQ_BLOCKED_S`` a try: it waited for the
    whole alarm, and the scheduler with it, silent, no tick sent and its lock dropped (found in
    review; docs/dramatiq.md, "When Dramatiq's broker is away"). Not the workers' broker: its
    consumers' connections would be closed and reopened through every alarm."""
    s = settings(required=True)
    assert s is not None
    key = (os.getpid(), s.url, s.namespace)
    with _senders_lock:
        made = _senders.get(key)
        if made is None:
            _senders.clear()  # a parent's, after fork
            made = _senders[key] = make_broker(s.url, s.namespace, middleware=[])
            if not is_redis_url(s.url):
                for parameters in _parameters(made):
                    parameters.blocked_connection_timeout = RABBITMQ_BLOCKED_S
        return made


def send(actor: str, queue: str, kwargs: dict[str, Any], max_age_s: float | None = None) -> None:
    sender().enqueue(message(actor, queue, kwargs, max_age_s))


__all__ = ["settings", "configured", "make_broker", "reach", "queue_length", "message", "late_s", "expired", "sender", "send",
           "URL_SETTING"]
