"""The writer side of a runner: ``Waker``, how a process that commits events asks the relay for a
claim. Each runner subclasses it (``outbox.celery.waker``, ``outbox.dramatiq.waker``) with how it
sends a claim; ``outbox.wake`` chooses one per process and runs it in its hand-off thread.

Written once here: the claim queue's one claim-request token on Redis (the workers' coalescer),
the per-process throttle for other brokers, the Redis clients, and the in-process relay a worker
registers so that a wake in it skips the broker. Why and what a wake costs:
docs/waking-and-metrics.md, "Post-commit wake-up".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.config import relay_options, relay_settings
from ..core.names import CLAIM_REQUEST_PREFIX, claim_request_key, is_redis_url
from .shared import make_coalescer

log = logging.getLogger("outbox.wake")

#: Per-process throttle window for brokers other than Redis (docs/waking-and-metrics.md).
LOCAL_WINDOW_S = 0.05
#: Prefix of the claim-request tokens: a claim deletes only keys that start with it.
TOKEN_PREFIX = CLAIM_REQUEST_PREFIX

#: The coalesced claim request of a relay worker running in this process, set by the worker while
#: it runs (``outbox.celery.worker``): a wake in this process then calls it instead of the broker.
in_process_claim: Callable[[], bool] | None = None

_redis_clients: dict[tuple[int, str], Any] = {}


def redis_client(url: str) -> Any:
    """This process's Redis client for ``url`` (short time-outs: a wake never waits long)."""
    key = (os.getpid(), url)
    client = _redis_clients.get(key)
    if client is None:
        from .redis_clients import relay_redis  # TLS as Celery's broker connects

        client = relay_redis(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        _redis_clients.clear()  # forget clients of a parent process
        _redis_clients[key] = client
    return client


def clear_token(token: str, broker_url: str) -> None:
    """Delete a claim-request token named in a claim message (claims sent by earlier
    versions carried ``token=``; today's carry ``requested=True`` and the worker clears its
    coalescer, which is the same token). ``broker_url``: the Redis holding it."""
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        return
    try:
        redis_client(broker_url).delete(token)
    except Exception as exc:  # noqa: BLE001 - it expires by itself
        log.debug("outbox: cannot clear wake token %s: %s", token, exc)


def token_for(broker_url: str, key_prefix: str, namespace: str) -> str:
    """The Redis key of an outbox's claim queue's one claim-request token (``make_coalescer``
    over ``outbox.core.names.claim_request_key``): the key a wake-up takes and a claim clears."""
    return f"{claim_request_key(broker_url, key_prefix, namespace)}:claim-requested"


class Throttle:
    """At most one ``send`` per window, and one more at the window's end when requests
    arrived during it (so a claim always follows the last request).

    The trailing send is made by the thread that asked for it, which waits for the window's
    end (at most ``window_s``): in a writer that is the wake thread (``outbox.wake``), which sends
    every claim of the process. A ``threading.Timer`` per trailing send left one broker
    connection behind per throttled window on Dramatiq's RabbitmqBroker, which keeps one per
    sending thread (docs/waking-and-metrics.md, "What a wake-up does, and costs")."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._trailing = False  # a thread waits to make the window's trailing send

    def request(self, send: Callable[[], bool]) -> bool:
        trailing_at: float | None = None
        with self._lock:
            if self._trailing:
                return True  # another thread sends at the window's end, after this request
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.window_s
            else:
                self._trailing, trailing_at = True, self._next
        if trailing_at is not None:
            time.sleep(max(0.0, trailing_at - time.monotonic()))
            with self._lock:
                self._trailing = False
                self._next = time.monotonic() + self.window_s
        return send()


#: ``failed(what, exc)``: how a waker reports a failed send (``outbox.wake`` pauses and logs).
Failed = Callable[[str, BaseException], None]


class Waker:
    """How this process wakes the relay through one runner's broker; made once per process and
    options. A runner provides ``send_claim`` and ``load``; ``channel`` is where its workers
    SUBSCRIBE for wake-ups (Redis; None when they do not listen)."""

    channel: str | None = None

    def __init__(self, broker_url: str, key_prefix: str = "", options: Any = None, namespace: str = "") -> None:
        self.broker_url = broker_url
        self.key_prefix = key_prefix
        #: The outbox this process writes to: its queues, token and channel (``outbox.core.names``).
        self.namespace = namespace or relay_settings().outbox_namespace
        #: The wake options it was made for (``outbox.wake`` makes a new one when they change).
        self.options = options
        self.pid = os.getpid()
        self.kind = ("redis" if is_redis_url(broker_url)
                     else "memory" if broker_url.startswith("memory://") else "other")
        self.throttle = Throttle(LOCAL_WINDOW_S)
        self._coalescer: Any = None

    def send_claim(self, requested: bool) -> None:
        """Send one claim message (``claim_kwargs``) to this outbox's claim queue; ``requested``:
        it holds the claim-request token, which the claim clears as it starts. Raises when the
        broker refuses."""
        raise NotImplementedError

    def claim_kwargs(self, requested: bool) -> dict[str, Any]:
        """The claim message's arguments. A requested claim names this writer's token too: the
        worker clears its own coalescer's, which is the same key only when writer and worker
        name Celery's broker by the same URL string. With another (the web's Redis user
        against the workers', ``:6379`` against ``:6379/0``) the writer's token stayed for its
        whole TTL, and every commit meanwhile sent no wake-up (found in review)."""
        if not requested:
            return {}
        return {"requested": True, "token": token_for(self.broker_url, self.key_prefix, self.namespace)}

    def load(self) -> None:
        """Load the runner's modules and client objects a send uses (no connection, no I/O)."""

    def coalescer(self) -> Any:
        """The claim queue's one token (Redis), the same object type and key as the worker's
        coalescer; made on first use, in the hand-off thread."""
        if self._coalescer is None:
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
            redis_client(self.broker_url)
            self.coalescer()
        self.load()

    def _send(self, requested: bool, failed: Failed) -> bool:
        try:
            self.send_claim(requested)
            return True
        except Exception as exc:  # noqa: BLE001 - reported through failed(): a wake-up never raises
            failed("sending a claim", exc)
            return False

    def wake(self, failed: Failed) -> bool:
        """One coalesced wake: True when a claim was sent or is on its way."""
        if self.kind == "redis":
            if self.channel is not None:
                # Workers listening: their main processes claim at once (one round trip, no
                # runner message). Nobody listening: a claim message, coalesced on the token.
                try:
                    if redis_client(self.broker_url).publish(self.channel, b"") > 0:
                        return True
                except Exception as exc:  # noqa: BLE001 - reported through failed(): a wake-up never raises
                    failed("notifying the workers", exc)
                    return False
            gate = self.coalescer()
            if not gate.acquire():
                return True  # a claim is already queued and has not started: it will see this commit
            if self._send(True, failed):
                return True
            gate.clear()
            return False
        if self.kind == "memory":
            return False
        return self.throttle.request(lambda: self._send(False, failed))


__all__ = ["Waker", "Throttle", "Failed", "in_process_claim", "redis_client", "clear_token", "token_for",
           "LOCAL_WINDOW_S", "TOKEN_PREFIX"]
