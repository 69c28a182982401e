"""The relay's logic, free of Celery: what a claim tick and a publish task do.

``outbox.tasks`` wraps these functions in Celery tasks; everything here takes its
collaborators as arguments (a store, a publisher, a ``dispatch`` callable, a circuit
breaker) so it runs, and is tested, without a worker.

How a row travels
-----------------
1. ``handle_claim`` leases a batch (``OutboxStore.claim``), splits it into
   per-aggregate chains (``split_chains``), trims it to a byte budget and hands the
   chains to ``dispatch`` packed into publish tasks (several short chains per task,
   never one chain across two tasks).
2. ``handle_publish`` runs each chain through ``Publisher.publish_chain``. What
   reached the broker is always a prefix of the chain: that prefix is marked done,
   the event that stopped the chain is failed according to its failure kind, and the
   rest of the chain is released (no attempt spent), so the aggregate waits for it.
3. Every store write is fenced by the claim's lease. Anything lost on the way (a
   killed worker, a lost Celery message, an ack that never landed) leaves rows
   claimed under a lease that expires; the next claim takes them again. Nothing else
   is needed for recovery.

Why the ordering rule holds whatever runs when: a row stays *open* (pending, claimed
or failed) until it is done or dead, and the store never claims a row while an
earlier open row of its aggregate is outside the same claim. So acks, fails and
releases may land in any order, late, twice or never.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from .chains import split_chains
from .engines.base import LEASE_EXPIRED_ERROR
from .config import MAX_OPTION_S, RelayOptions  # noqa: F401  (re-exported: ``outbox.relay.RelayOptions``)
from .model import FailResult, FenceResult, OutboxMessage
from . import metrics
from .publisher import FailureKind, PublisherLike
from .names import (ACK_QUEUE, ACK_TASK, CLAIM_QUEUE, CLAIM_TASK, FAIL_TASK, PUBLISH_QUEUE, PUBLISH_TASK,  # noqa: F401
                    PURGE_QUEUE, PURGE_TASK, QUEUES, RELEASE_TASK)  # re-exported: ``outbox.relay`` keeps them

log = logging.getLogger("outbox.relay")

#: The failure kinds, kept importable here; they are ``FailureKind`` members.
RETRIABLE, BACKPRESSURE, POISON, FATAL = (FailureKind.RETRIABLE, FailureKind.BACKPRESSURE, FailureKind.POISON,
                                          FailureKind.FATAL)
#: The error kind recorded on a dead-letter copy of a row that went dead on lease expiry.
LEASE_EXPIRED = "lease_expired"


#: ``OutboxStore.mark_failed`` accepts retry times up to a day.
MAX_RETRY_S = 86_400.0


def retry_delay(attempt: int, base_s: float, max_s: float, rng: Callable[[], float] = random.random) -> timedelta:
    """Exponential back-off with "equal jitter": half the step is fixed, half random,
    so retries of many rows that failed together spread out but never come back at once."""
    step = min(max_s, MAX_RETRY_S, base_s * math.pow(2, min(64, max(0, attempt - 1))))
    return timedelta(seconds=step / 2 + rng() * step / 2)


# -- messages across Celery ------------------------------------------------------------------

def message_to_dict(message: OutboxMessage) -> dict[str, Any]:
    """JSON-safe form of a claimed message, as publish tasks carry it (lease included)."""
    return {
        "id": message.id, "message_id": message.message_id, "topic": message.topic,
        "aggregate_type": message.aggregate_type, "aggregate_id": message.aggregate_id,
        "partition_key": message.partition_key, "payload": message.payload, "headers": message.headers,
        "trace_id": message.trace_id, "attempts": message.attempts,
        "created_at": message.created_at.isoformat() if message.created_at else None,
        "lease": message.lease,
    }


def message_from_dict(data: Mapping[str, Any]) -> OutboxMessage:
    created = data.get("created_at")
    return OutboxMessage(
        id=int(data["id"]), message_id=data["message_id"], topic=data["topic"],
        aggregate_type=data["aggregate_type"], aggregate_id=data["aggregate_id"],
        partition_key=data.get("partition_key"), payload=data["payload"], headers=dict(data.get("headers") or {}),
        trace_id=data.get("trace_id"), attempts=int(data.get("attempts") or 0),
        created_at=datetime.fromisoformat(created) if isinstance(created, str) else created,  # type: ignore[arg-type]
        lease=data["lease"],
    )


def _fields(message: OutboxMessage) -> str:
    return (f"outbox_id={message.id} message_id={message.message_id} "
            f"aggregate_id={message.aggregate_id} topic={message.topic} lease={message.lease}")


def _extra(message: OutboxMessage, event: str) -> dict[str, Any]:
    """``extra`` for log records, so a JSON formatter gets the ids as fields too."""
    return {"outbox_event": event, "outbox_id": message.id, "message_id": message.message_id,
            "aggregate_id": message.aggregate_id, "lease": message.lease}


# -- circuit breaker -------------------------------------------------------------------------

class Breaker:
    """Pauses claiming while the destination broker is down or misconfigured.

    The state is "open until <time>, because <reason>". ``trip`` only ever extends it,
    so a short back-pressure pause never shortens a fatal one. Subclasses share the
    state between processes; this base class keeps it in the process and caches the
    shared state for ``cache_s`` so checking it on every chain stays cheap.
    """

    cache_s = 0.25

    def __init__(self) -> None:
        self._until = 0.0
        self._reason = ""
        self._checked = 0.0
        self._lock = threading.Lock()

    # shared-state hooks ------------------------------------------------------------------
    def _read(self) -> tuple[float, str] | None:
        return None

    def _write(self, until: float, reason: str) -> None:
        pass

    def _clear(self) -> None:
        pass

    # public --------------------------------------------------------------------------------
    def open_for(self, now: float | None = None) -> float:
        """Seconds until claims may resume; 0 when closed."""
        now = time.time() if now is None else now
        with self._lock:
            if self._until <= now and now - self._checked >= self.cache_s:
                self._checked = now
                try:
                    shared = self._read()
                except Exception as exc:  # the shared store is down: decide locally
                    log.debug("outbox breaker: cannot read shared state: %s", exc)
                    shared = None
                if shared is not None and shared[0] > self._until:
                    self._until, self._reason = shared
            return max(0.0, self._until - now)

    @property
    def reason(self) -> str:
        return self._reason

    def trip(self, seconds: float, reason: str, now: float | None = None) -> float:
        now = time.time() if now is None else now
        until = now + seconds
        with self._lock:
            if until > self._until:
                self._until, self._reason = until, reason
            until, reason = self._until, self._reason
        try:
            shared = self._read()
            if shared is None or shared[0] < until:
                self._write(until, reason)
        except Exception as exc:
            log.warning("outbox breaker: cannot share state (this process pauses alone): %s", exc)
        return until

    def reset(self) -> None:
        with self._lock:
            self._until, self._reason, self._checked = 0.0, "", 0.0
        try:
            self._clear()
        except Exception as exc:
            log.warning("outbox breaker: cannot clear shared state: %s", exc)


class LocalBreaker(Breaker):
    """State in this process only (tests; the in-memory Celery broker runs in one process)."""


class RedisBreaker(Breaker):
    """State in a key of Celery's Redis broker, with a TTL: every worker on every host
    sees it, and it closes by itself when the key expires."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__()
        import redis  # the redis extra; Celery's Redis transport needs it anyway

        self.key = key
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _read(self) -> tuple[float, str] | None:
        raw = self.client.get(self.key)
        if not raw:
            return None
        data = json.loads(raw)
        return float(data["until"]), str(data.get("reason", ""))

    def _write(self, until: float, reason: str) -> None:
        ttl_ms = max(1, int((until - time.time()) * 1000))
        self.client.set(self.key, json.dumps({"until": until, "reason": reason}), px=ttl_ms)

    def _clear(self) -> None:
        self.client.delete(self.key)


class FileBreaker(Breaker):
    """State in a small file: shared by the worker processes of one host. Used when
    Celery's broker is not Redis; other hosts find out when their own publishes fail
    (and the rows they release wait out the pause anyway)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def _read(self) -> tuple[float, str] | None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return None
        except ValueError:  # caught mid-replace or damaged: ignore
            return None
        return float(data["until"]), str(data.get("reason", ""))

    def _write(self, until: float, reason: str) -> None:
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"until": until, "reason": reason}, fh)
        os.replace(tmp, self.path)

    def _clear(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def breaker_key(database_url: str, table: str, publish_url: str, exchange: str) -> str:
    """One breaker per (outbox table, destination): relays of other outboxes are unaffected."""
    digest = hashlib.sha1(f"{database_url}|{table}|{publish_url}|{exchange}".encode()).hexdigest()[:16]
    return f"outbox:breaker:{digest}"


def make_breaker(celery_broker_url: str, key: str) -> Breaker:
    """Redis when Celery's broker is Redis, else a file in the temp directory, else local."""
    if celery_broker_url.startswith(("redis://", "rediss://")):
        try:
            return RedisBreaker(celery_broker_url, key)
        except ImportError:
            pass
    if celery_broker_url.startswith("memory://"):
        return LocalBreaker()
    return FileBreaker(os.path.join(tempfile.gettempdir(), key.replace(":", "-") + ".json"))


# -- per-route back-pressure -------------------------------------------------------------------

class RouteGate:
    """Pauses one routing key (topic) whose queue refuses messages, while the others flow.

    A ``basic.nack`` means a queue bound for that routing key refused the message
    (``x-overflow: reject-publish`` on a full queue, a quorum queue without a quorum): the
    broker is fine, one route is not. ``refuse(route)`` pauses the route for
    ``route_pause_s``, doubled (up to ``route_pause_max_s``) each time the route is refused
    again within one pause length of resuming, and back to the base after a quiet spell. A
    route already paused is not extended: every chain nacked during one pause counts once.
    ``paused(route)`` says how long it still waits; the relay releases (no attempt spent) the
    rows of a paused route with that delay, without sending them.

    The state is a map route -> (until, step). Subclasses share it between processes (one
    Redis hash, a file); each process caches the shared map for ``cache_s``.
    """

    cache_s = 0.25

    def __init__(self) -> None:
        self._routes: dict[str, tuple[float, float]] = {}
        self._checked = 0.0
        self._lock = threading.Lock()

    # shared-state hooks ------------------------------------------------------------------
    def _read(self) -> dict[str, tuple[float, float]] | None:
        return None

    def _write(self, route: str, until: float, step: float, keep_s: float) -> None:
        pass

    # public --------------------------------------------------------------------------------
    def _current(self, now: float) -> dict[str, tuple[float, float]]:
        with self._lock:
            if now - self._checked >= self.cache_s:
                self._checked = now
                try:
                    shared = self._read()
                except Exception as exc:  # the shared store is down: decide locally
                    log.debug("outbox route gate: cannot read shared state: %s", exc)
                    shared = None
                for route, (until, step) in (shared or {}).items():
                    if until > self._routes.get(route, (0.0, 0.0))[0]:
                        self._routes[route] = (until, step)
            return self._routes

    def paused(self, route: str, now: float | None = None) -> float:
        """Seconds until ``route`` may be published to again; 0 when it is open."""
        now = time.time() if now is None else now
        until = self._current(now).get(route, (0.0, 0.0))[0]
        return max(0.0, until - now)

    def any_paused(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return any(until > now for until, _ in self._current(now).values())

    def refuse(self, route: str, base_s: float, max_s: float, now: float | None = None) -> tuple[float, bool]:
        """Record a refusal of ``route``; returns (seconds it pauses from now, whether this
        call started the pause)."""
        now = time.time() if now is None else now
        current = self._current(now)
        with self._lock:
            until, step = current.get(route, (0.0, 0.0))
            if until > now:
                return until - now, False
            # Refused again soon after a pause ended: the queue is still full, wait longer.
            step = min(max_s, step * 2) if step and now - until < step else base_s
            until = now + step
            self._routes[route] = (until, step)
            # Drop routes long forgotten, so a process's map stays small.
            for old in [r for r, (u, st) in self._routes.items() if u + 2 * st < now]:
                del self._routes[old]
        try:
            self._write(route, until, step, keep_s=3 * max_s)
        except Exception as exc:
            log.warning("outbox route gate: cannot share state (this process pauses the route alone): %s", exc)
        return step, True


class RedisRouteGate(RouteGate):
    """One Redis hash (route -> [until, step]) next to the breaker's key, with a TTL that
    every refusal extends: all workers on all hosts pause a refused route together."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__()
        import redis

        self.key = key
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _read(self) -> dict[str, tuple[float, float]] | None:
        raw = self.client.hgetall(self.key)
        found = {}
        for route, value in raw.items():
            until, step = json.loads(value)
            found[route.decode("utf-8", "replace")] = (float(until), float(step))
        return found

    def _write(self, route: str, until: float, step: float, keep_s: float) -> None:
        pipe = self.client.pipeline()
        pipe.hset(self.key, route, json.dumps([until, step]))
        pipe.pexpire(self.key, max(1, int((until - time.time() + keep_s) * 1000)))
        pipe.execute()


class FileRouteGate(RouteGate):
    """The map in a small JSON file: the worker processes of one host."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def _read(self) -> dict[str, tuple[float, float]] | None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (FileNotFoundError, ValueError):
            return None
        return {route: (float(v[0]), float(v[1])) for route, v in data.items()}

    def _write(self, route: str, until: float, step: float, keep_s: float) -> None:
        data = {r: [u, st] for r, (u, st) in (self._read() or {}).items() if u + keep_s > time.time()}
        data[route] = [until, step]
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.path)


def make_route_gate(celery_broker_url: str, key: str) -> RouteGate:
    """Shared like the breaker: Redis when Celery's broker is Redis, else a file, else local."""
    key = key + ":routes"
    if celery_broker_url.startswith(("redis://", "rediss://")):
        try:
            return RedisRouteGate(celery_broker_url, key)
        except ImportError:
            pass
    if celery_broker_url.startswith("memory://"):
        return RouteGate()
    return FileRouteGate(os.path.join(tempfile.gettempdir(), key.replace(":", "-") + ".json"))


# -- outages, logged like an operator wants ----------------------------------------------------

class Outage:
    """Logs an outage of one dependency (the database, the destination broker) once.

    ``failed(error)``: the first failure of an outage logs one WARNING saying what is down,
    where, and what the relay does meanwhile; every later failure logs at DEBUG only (with
    the traceback when there is one). ``ok()`` after failures logs one INFO line with how long
    it lasted. ``ok()`` costs nothing while there is no outage.

    Workers share the announcement (subclasses): only the process that first sees the
    outage warns, and only the first to see it end says so. The shared flag expires after
    ``remind_s``, so an outage that goes on is announced again that often.
    """

    remind_s = 600.0

    def __init__(self, what: str, where: str, meanwhile: str, logger: logging.Logger | None = None) -> None:
        self.what, self.where, self.meanwhile = what, where, meanwhile
        self.log = logger or log
        self._since: float | None = None
        self._failures = 0
        self._lock = threading.Lock()

    # shared-state hooks ------------------------------------------------------------------
    def _begin(self) -> bool:
        """True when this process is the first to report the outage."""
        return True

    def _end(self) -> bool:
        """True when this process is the first to report its end."""
        return True

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: BaseException | str) -> None:
        from .redact import redact

        detail = redact(f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error)
        detail = " ".join(detail.split())
        with self._lock:
            first = self._since is None
            if first:
                self._since = time.monotonic()
            self._failures += 1
        announce = False
        if first:
            try:
                announce = self._begin()
            except Exception:  # the shared flag is unreachable: say it here
                announce = True
        if announce:
            self.log.warning("outbox: %s unreachable (%s): %s. %s", self.what, self.where, detail, self.meanwhile)
        else:
            self.log.debug("outbox: %s still unreachable (%s): %s", self.what, self.where, detail,
                           exc_info=error if isinstance(error, BaseException) else None)

    def ok(self) -> None:
        if self._since is None:
            return
        with self._lock:
            since, failures = self._since, self._failures
            self._since, self._failures = None, 0
        if since is None:
            return
        try:
            announce = self._end()
        except Exception:
            announce = True
        if announce:
            self.log.info("outbox: %s reachable again (%s) after %.1f s", self.what, self.where,
                          time.monotonic() - since)
        else:
            self.log.debug("outbox: %s reachable again from this process after %d failures", self.what, failures)


class RedisOutage(Outage):
    def __init__(self, url: str, key: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import redis

        self.key = key
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _begin(self) -> bool:
        return bool(self.client.set(self.key, b"1", nx=True, px=int(self.remind_s * 1000)))

    def _end(self) -> bool:
        return bool(self.client.delete(self.key))


class FileOutage(Outage):
    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path

    def _begin(self) -> bool:
        try:
            if time.time() - os.path.getmtime(self.path) > self.remind_s:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            return False

    def _end(self) -> bool:
        try:
            os.unlink(self.path)
            return True
        except FileNotFoundError:
            return False


def make_outage(celery_broker_url: str, key: str, what: str, where: str, meanwhile: str,
                logger: logging.Logger | None = None) -> Outage:
    """Shared like the breaker: Redis when Celery's broker is Redis, else a file, else local."""
    key = f"{key}:outage:{what.replace(' ', '-')}"
    if celery_broker_url.startswith(("redis://", "rediss://")):
        try:
            return RedisOutage(celery_broker_url, key, what, where, meanwhile, logger)
        except ImportError:
            pass
    if celery_broker_url.startswith("memory://"):
        return Outage(what, where, meanwhile, logger)
    return FileOutage(os.path.join(tempfile.gettempdir(), key.replace(":", "-")), what, where, meanwhile, logger)


# -- coalesced claim requests ----------------------------------------------------------------

class Coalescer:
    """At most one claim *requested* at a time, however many ask.

    Whoever wants a claim soon (a publish task that just freed its aggregates, a claim
    that came back full, a post-commit wake-up) calls ``acquire``; only the first caller
    gets True and sends the claim task, which calls ``clear`` as it starts, so requests
    made while it runs lead to exactly one more claim. The token expires after ``ttl_s``
    in case that claim task is lost; beat's ticks carry on regardless.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._held_until = 0.0

    def acquire(self) -> bool:
        with self._lock:
            now = time.time()
            if self._held_until > now:
                return False
            self._held_until = now + self.ttl_s
            return True

    def clear(self) -> None:
        with self._lock:
            self._held_until = 0.0


class RedisCoalescer(Coalescer):
    def __init__(self, url: str, key: str, ttl_s: float) -> None:
        super().__init__(ttl_s)
        import redis

        self.key = key
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def acquire(self) -> bool:
        try:
            return bool(self.client.set(self.key, b"1", nx=True, px=max(1, int(self.ttl_s * 1000))))
        except Exception as exc:  # Redis is Celery's broker: if it is down, sending fails anyway
            log.debug("outbox: claim request token unavailable (%s); requesting anyway", exc)
            return True

    def clear(self) -> None:
        try:
            self.client.delete(self.key)
        except Exception as exc:
            log.debug("outbox: cannot clear the claim request token: %s", exc)


class FileCoalescer(Coalescer):
    """The token is a file created exclusively; one older than ``ttl_s`` is stale."""

    def __init__(self, path: str, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.path = path

    def acquire(self) -> bool:
        for _ in range(2):
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                return True
            except FileExistsError:
                try:
                    if time.time() - os.path.getmtime(self.path) < self.ttl_s:
                        return False
                    os.unlink(self.path)  # stale: its claim was lost
                except FileNotFoundError:
                    pass
            except OSError as exc:
                log.debug("outbox: claim request token unavailable (%s); requesting anyway", exc)
                return True
        return False

    def clear(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def make_coalescer(celery_broker_url: str, key: str, ttl_s: float) -> Coalescer:
    """Shared like the breaker: Redis when Celery's broker is Redis, else a file, else local."""
    key = key + ":claim-requested"
    if celery_broker_url.startswith(("redis://", "rediss://")):
        try:
            return RedisCoalescer(celery_broker_url, key, ttl_s)
        except ImportError:
            pass
    if celery_broker_url.startswith("memory://"):
        return Coalescer(ttl_s)
    return FileCoalescer(os.path.join(tempfile.gettempdir(), key.replace(":", "-")), ttl_s)


# -- store writes, with a fallback ------------------------------------------------------------

class StoreLike(Protocol):
    def claim(self, batch: int) -> Any: ...
    def mark_done(self, ids: Sequence[int], lease: str) -> FenceResult: ...
    def mark_failed(self, id: int, lease: str, error: str, retry_in: timedelta | None = None,
                    *, dead: bool = False) -> FailResult: ...
    def release(self, ids: Sequence[int], lease: str, delay: timedelta | None = None) -> FenceResult: ...


#: ``fallback(operation, kwargs)`` hands a store write that failed to someone who will
#: retry it later (the ack queue's tasks). Operations: "done", "failed", "release".
Fallback = Callable[[str, dict[str, Any]], None]


class Settler:
    """Applies a chain's outcome to the store: ``mark_done``, ``mark_failed``, ``release``.

    The publish task writes to the store directly: it is one short transaction per
    outcome, and the next chain of the aggregate cannot be claimed until it lands, so a
    hop through Celery would add latency to every aggregate and a task per chain. Only
    when the write fails (the database is down even after the store's own retries) is it
    handed to ``fallback``, normally the ack/fail/release tasks on the ack queue, which
    retry with back-off without holding up the publish worker. If even that fails the
    lease is the last line: the rows are claimed again once it expires.
    """

    def __init__(self, store: StoreLike, fallback: Fallback | None = None) -> None:
        self.store = store
        self.fallback = fallback

    def _run(self, operation: str, kwargs: dict[str, Any], call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            log.error("outbox %s failed (%s: %s); %s", operation, type(exc).__name__, exc,
                      "handing it to the ack queue" if self.fallback else "the lease will recover the rows")
            if self.fallback is not None:
                try:
                    self.fallback(operation, kwargs)
                except Exception as again:
                    log.error("outbox %s: fallback failed too (%s); the lease will recover the rows",
                              operation, again)
            return None

    def done(self, ids: Sequence[int], lease: str) -> FenceResult | None:
        ids = list(ids)
        if not ids:
            return FenceResult(0, 0)
        return self._run("done", {"ids": ids, "lease": lease}, lambda: self.store.mark_done(ids, lease))

    def failed(self, message: OutboxMessage, error: str, retry_in: timedelta | None,
               dead: bool = False) -> FailResult | None:
        kwargs = {"message": message_to_dict(message), "error": error,
                  "retry_in_s": retry_in.total_seconds() if retry_in is not None else None, "dead": dead}
        return self._run("failed", kwargs, lambda: self.store.mark_failed(
            message.id, message.lease, error, retry_in, dead=dead))

    def release(self, messages: Sequence[OutboxMessage], delay: timedelta | None = None) -> FenceResult | None:
        if not messages:
            return FenceResult(0, 0)
        lease = messages[0].lease
        ids = [m.id for m in messages]
        kwargs = {"ids": ids, "lease": lease, "delay_s": delay.total_seconds() if delay else None}
        return self._run("release", kwargs, lambda: self.store.release(ids, lease, delay))


# -- publishing one chain --------------------------------------------------------------------

@dataclass
class ChainOutcome:
    published: list[int] = field(default_factory=list)
    failed_id: int | None = None
    kind: FailureKind | None = None
    reason: str | None = None
    dead: bool = False
    released: list[int] = field(default_factory=list)
    skipped: bool = False  # breaker open or lease too old: nothing was attempted


def _kind_of(kind: Any) -> FailureKind:
    """The publisher's failure kind as the enum; a kind nobody knows is treated as retriable."""
    try:
        return FailureKind(str(getattr(kind, "value", kind)).lower())
    except ValueError:
        log.error("outbox publisher reported an unknown failure kind %r; treating it as retriable", kind)
        return FailureKind.RETRIABLE


def send_dead(publisher: PublisherLike, message: OutboxMessage, error: str) -> None:
    """Best effort: the dead row in the table stays the record of truth."""
    try:
        problem = publisher.publish_dead(message, error)
    except Exception as exc:
        problem = exc
    if problem is not None:
        log.error("outbox dead-letter publish failed %s error=%r", _fields(message),
                  getattr(problem, "reason", str(problem)), extra=_extra(message, "dead_letter_failed"))


def handle_chain(store: StoreLike, publisher: PublisherLike, messages: Sequence[OutboxMessage], *,
                 options: RelayOptions = RelayOptions(), breaker: Breaker | None = None,
                 settler: Settler | None = None, rng: Callable[[], float] = random.random,
                 routes: RouteGate | None = None) -> ChainOutcome:
    """Publish one chain (one aggregate, id order, one lease) and settle its rows: a publish
    task of one chain (see ``handle_publish``)."""
    outcomes = handle_publish(store, publisher, [messages], options=options, breaker=breaker,
                              settler=settler, rng=rng, routes=routes)
    return outcomes[0] if outcomes else ChainOutcome()


@dataclass
class _Report:
    """What the publisher said about one chain."""
    published: list[int]
    failed_id: int | None = None
    kind: FailureKind | None = None
    reason: str | None = None
    route: str | None = None  # BACKPRESSURE from this routing key only


def _publish_all(publisher: PublisherLike, chains: list[list[OutboxMessage]]) -> list[_Report]:
    """One report per chain. A publisher that raises instead of reporting (a bug, or
    something nobody foresaw) counts against the head of every chain."""
    try:
        if hasattr(publisher, "publish_chains"):
            results = list(publisher.publish_chains(chains))
        else:  # a publisher with only the one-chain method
            results = [publisher.publish_chain(chain) for chain in chains]
    except Exception as exc:
        log.exception("outbox publisher raised instead of reporting %s", _fields(chains[0][0]))
        return [_Report([], chain[0].id, RETRIABLE, f"{type(exc).__name__}: {exc}") for chain in chains]
    if len(results) != len(chains):
        log.error("outbox publisher returned %d results for %d chains; settling none of the extra or "
                  "missing ones", len(results), len(chains))
    reports = []
    for index in range(len(chains)):
        if index >= len(results):
            reports.append(_Report([]))  # said nothing: released below
            continue
        result = results[index]
        failure = result.failure
        if failure is None:
            reports.append(_Report(list(result.published), result.failed_id))
        else:
            reports.append(_Report(list(result.published), result.failed_id, _kind_of(failure.kind),
                                   failure.reason, getattr(failure, "route", None)))
    return reports


def _hold_paused_routes(chains: list[list[OutboxMessage]], routes: RouteGate | None,
                        now: float) -> list[tuple[list[OutboxMessage], list[OutboxMessage], float]]:
    """Split each chain at its first event whose route is paused: (to publish, held back,
    the held event's remaining pause). Without a paused route nothing is held."""
    if routes is None or not routes.any_paused(now):
        return [(chain, [], 0.0) for chain in chains]
    split = []
    for chain in chains:
        for position, message in enumerate(chain):
            wait = routes.paused(message.topic, now)
            if wait > 0:
                split.append((chain[:position], chain[position:], wait))
                break
        else:
            split.append((chain, [], 0.0))
    return split


def handle_publish(store: StoreLike, publisher: PublisherLike, chains: Iterable[Sequence[OutboxMessage]], *,
                   deadline: float | None = None, options: RelayOptions = RelayOptions(),
                   breaker: Breaker | None = None, settler: Settler | None = None,
                   stopping: Callable[[], bool] = lambda: False,
                   now: Callable[[], float] = time.time,
                   rng: Callable[[], float] = random.random,
                   routes: RouteGate | None = None,
                   outage: Outage | None = None) -> list[ChainOutcome]:
    """Publish the chains of one publish task together (``Publisher.publish_chains``) and
    settle their rows: every published prefix is marked done in one ``mark_done`` per lease,
    then each chain that stopped early is settled by the kind of its failure.

    The event that stopped a chain, by failure kind:

    * RETRIABLE: failed with back-off (an attempt spent; dead after OUTBOX_MAX_ATTEMPTS,
      then sent to the dead-letter exchange when there is one);
    * POISON: dead at once, and sent to the dead-letter exchange;
    * BACKPRESSURE of one route (a ``basic.nack``: a queue bound for its routing key refused
      it): released with the rest (no attempt spent), not due before the route's pause ends;
      the route pauses (``routes``), other routes and claims go on;
    * BACKPRESSURE of the broker (unreachable, blocked): released likewise, and the breaker
      opens so claims stop hammering a broker that is down;
    * FATAL: the same, with a long pause and a critical log line: an operator must act.

    Events after the failed one are released (no attempt spent): they are blocked behind
    it by the claim rule until it is done or dead. Events whose route is paused are not sent:
    the chain is published up to the first of them, which is released with the rest, due when
    the route's pause ends.

    Nothing is published when the breaker is open or the worker is stopping (the rows are
    released, no attempt spent), nor after ``deadline``, the wall-clock time after which
    the lease is about to expire (or has) and another claim may already hold the rows. Those
    rows are left exactly as they are, for lease recovery, which spends an attempt;
    releasing them instead would let a message that crashes every worker retry for ever.

    ``outage`` (the destination broker's) hears of every broker-wide failure and of every
    publish that went through, so an outage logs one warning and one line when it ends.
    """
    settler = settler or Settler(store)
    chains = [list(chain) for chain in chains if chain]
    if not chains:
        return []
    if deadline is not None and now() > deadline:
        log.warning("outbox publish task started too late (lease nearly expired); leaving %d rows to lease "
                    "recovery, first %s", sum(map(len, chains)), _fields(chains[0][0]))
        return [ChainOutcome(skipped=True) for _ in chains]
    pause = breaker.open_for() if breaker is not None else 0.0
    if pause > 0 or stopping():
        # The broker is down, or this worker is shutting down: hand the rows straight back.
        for chain in chains:
            settler.release(chain, timedelta(seconds=pause) if pause > 0 else None)
        return [ChainOutcome(skipped=True, released=[m.id for m in chain]) for chain in chains]

    split = _hold_paused_routes(chains, routes, now())
    sending = [(index, part) for index, (part, _, _) in enumerate(split) if part]
    started = time.perf_counter()
    reports: list[_Report | None] = [None] * len(chains)
    if sending:
        for (index, _), report in zip(sending, _publish_all(publisher, [part for _, part in sending])):
            reports[index] = report
    elapsed = time.perf_counter() - started

    outcomes: list[ChainOutcome] = []
    done: dict[str, list[int]] = {}
    for chain, (part, held, _), report in zip(chains, split, reports):
        published = report.published if report is not None else []
        # Trust only a true prefix of the part sent.
        ids = [m.id for m in part]
        prefix = 0
        while prefix < len(published) and prefix < len(ids) and published[prefix] == ids[prefix]:
            prefix += 1
        if prefix != len(published):
            log.error("outbox publisher reported %s, which is not a prefix of chain %s; acking only %s",
                      published, ids, ids[:prefix])
        outcomes.append(ChainOutcome(published=ids[:prefix], skipped=not part))
        if part:
            metrics.chain(chain[:prefix], elapsed, report.kind.value if report is not None and report.kind is not None and prefix < len(ids) else None)
        for message in chain[:prefix]:
            log.debug("outbox published %s", _fields(message), extra=_extra(message, "published"))
        if prefix:
            done.setdefault(chain[0].lease, []).extend(ids[:prefix])
    for lease, ids in done.items():
        settler.done(ids, lease)

    broker_down = any(r is not None and r.kind == BACKPRESSURE and r.route is None for r in reports)
    if outage is not None and done and not broker_down:
        outage.ok()
    refused: dict[str, float] = {}  # routes refused by this task: each paused once
    for chain, (part, held, wait), report, outcome in zip(chains, split, reports, outcomes):
        if len(outcome.published) < len(part):
            rest = chain[len(outcome.published):]
            assert report is not None
            _settle_stopped(publisher, rest, report, outcome, options=options, breaker=breaker,
                            settler=settler, rng=rng, routes=routes, refused=refused, outage=outage)
        elif held:
            # Published up to an event whose route is paused: the rest waits for the route.
            log.debug("outbox route %r paused for %.1f s more: releasing %d rows %s", held[0].topic, wait,
                      len(held), _fields(held[0]))
            settler.release(held, timedelta(seconds=wait))
            outcome.released = [m.id for m in held]
    return outcomes


def _settle_stopped(publisher: PublisherLike, rest: list[OutboxMessage], report: _Report, outcome: ChainOutcome, *,
                    options: RelayOptions, breaker: Breaker | None, settler: Settler,
                    rng: Callable[[], float], routes: RouteGate | None = None,
                    refused: dict[str, float] | None = None, outage: Outage | None = None) -> None:
    """Settle the unpublished ``rest`` of a chain: its head by the failure kind, the others
    released behind it."""
    failed_id, kind, reason = report.failed_id, report.kind, report.reason
    if failed_id is None or kind is None:
        # Stopped early without saying why: give the rest back untouched.
        log.error("outbox publisher stopped before %s without a failure; releasing %s",
                  rest[0].id, [m.id for m in rest])
        outcome.released = [m.id for m in rest]
        settler.release(rest)
        return
    if failed_id != rest[0].id:
        log.error("outbox publisher failed id %s but the next unpublished event is %s; treating it as failed",
                  failed_id, rest[0].id)
    failing, after = rest[0], rest[1:]
    outcome.failed_id, outcome.kind, outcome.reason = failing.id, kind, reason
    error = f"{kind}: {reason}"

    if kind == POISON:
        log.error("outbox poison event goes dead %s error=%r", _fields(failing), reason,
                  extra=_extra(failing, "dead"))
        result = settler.failed(failing, error, None, dead=True)
        outcome.dead = True
        if result is not None and result.applied:
            metrics.dead()
            send_dead(publisher, failing, error)
        settler.release(after)
        outcome.released = [m.id for m in after]
    elif kind == BACKPRESSURE and report.route is not None:
        # One route's queue refuses messages: pause that route only; claims and every other
        # route go on. The rows wait (released, no attempt spent) until the route's pause ends.
        route = report.route
        refused = {} if refused is None else refused
        if route not in refused:
            if routes is not None:
                pause, started = routes.refuse(route, options.route_pause_s, options.route_pause_max_s)
            else:
                pause, started = options.route_pause_s, True
            refused[route] = pause
            (log.warning if started else log.debug)(
                "outbox route %r refuses messages, pausing it for %.1f s (other routes keep flowing; its rows "
                "are released with no attempt spent): %s %s", route, pause, reason, _fields(failing),
                extra=_extra(failing, "route_backpressure"))
        settler.release(rest, timedelta(seconds=refused[route]))
        outcome.released = [m.id for m in rest]
    elif kind in (BACKPRESSURE, FATAL):
        if kind == FATAL:
            pause = options.fatal_pause_s
            log.critical("outbox FATAL publishing error: %s. Claims stop for %.0f s on every worker sharing "
                         "this breaker; fix the destination broker settings (OUTBOX_PUBLISH_URL, "
                         "OUTBOX_EXCHANGE, credentials, permissions) and restart the workers. %s",
                         reason, pause, _fields(failing), extra=_extra(failing, "fatal"))
        else:
            pause = options.breaker_s
            if outage is not None:
                outage.failed(reason or "back-pressure")
            else:
                log.warning("outbox broker back-pressure, pausing claims for %.1f s: %s %s", pause, reason,
                            _fields(failing), extra=_extra(failing, "backpressure"))
        if breaker is not None:
            breaker.trip(pause, f"{kind}: {reason}")
        settler.release(rest, timedelta(seconds=pause))
        outcome.released = [m.id for m in rest]
    else:  # RETRIABLE
        retry_in = retry_delay(failing.attempt, options.backoff_base_s, options.backoff_max_s, rng)
        result = settler.failed(failing, error, retry_in)
        outcome.dead = bool(result and result.dead)
        if outcome.dead:
            metrics.dead()
            log.error("outbox event goes dead after its last attempt %s attempt=%d error=%r", _fields(failing),
                      failing.attempt, reason, extra=_extra(failing, "dead"))
            send_dead(publisher, failing, error)
        else:
            log.warning("outbox publish failed, retry in %.1f s %s attempt=%d error=%r",
                        retry_in.total_seconds(), _fields(failing), failing.attempt, reason,
                        extra=_extra(failing, "retry"))
        settler.release(after)
        outcome.released = [m.id for m in after]


# -- claiming ------------------------------------------------------------------------------

@dataclass
class ClaimOutcome:
    claimed: int = 0
    dispatched: int = 0  # rows sent on in publish tasks
    tasks: int = 0
    released: int = 0  # rows given back (byte budget, failed dispatch)
    full: bool = False  # the batch came back full: more rows are likely waiting
    trimmed: bool = False  # the byte budget cut the batch
    saturated: bool = False  # too many publish tasks queued: nothing claimed
    paused: float = 0.0  # the breaker is open for this long: nothing claimed
    error: str | None = None  # dispatching failed (Celery's broker)
    dead: int = 0  # rows the claim found with an expired lease and no attempts left (went dead)
    inline: bool = False  # the claim was small: its rows went to ``publish_inline``, not to a publish task

    @property
    def more(self) -> bool:
        """More rows are probably claimable right now: claim again at once (drain mode)."""
        return (self.full or self.trimmed) and self.error is None

    @property
    def backlog(self) -> bool:
        """The claim met a backlog (full, cut, or held back by the in-flight bound): the
        next claim should check the publish queue's length before claiming."""
        return self.full or self.trimmed or self.saturated


def plan_tasks(chains: Sequence[Sequence[OutboxMessage]], task_rows: int,
               max_bytes: int) -> tuple[list[list[list[OutboxMessage]]], list[OutboxMessage]]:
    """Pack chains into publish tasks of about ``task_rows`` rows, within ``max_bytes``
    for the whole batch. Returns (tasks, rows to release). Rows over the budget are
    released from the first one that does not fit to the end of the batch: cutting a
    chain is safe (its released tail waits behind its claimed head)."""
    tasks: list[list[list[OutboxMessage]]] = []
    current: list[list[OutboxMessage]] = []
    rows_in_current = 0
    used = 0
    over: list[OutboxMessage] = []
    for chain in chains:
        if over:
            over.extend(chain)
            continue
        take: list[OutboxMessage] = []
        for position, message in enumerate(chain):
            if used and used + message.size > max_bytes:
                over.extend(chain[position:])
                break
            take.append(message)
            used += message.size
        if take:
            current.append(take)
            rows_in_current += len(take)
            if rows_in_current >= task_rows:
                tasks.append(current)
                current, rows_in_current = [], 0
    if current:
        tasks.append(current)
    return tasks, over


#: ``dispatch(chains, deadline)`` sends one publish task.
Dispatch = Callable[[list[list[OutboxMessage]], float], None]


def handle_claim(store: StoreLike, dispatch: Dispatch, *, batch_size: int, lease_s: float,
                 options: RelayOptions = RelayOptions(), breaker: Breaker | None = None,
                 queued: Callable[[], int | None] | None = None,
                 settler: Settler | None = None, now: Callable[[], float] = time.time,
                 publisher: PublisherLike | None = None, publish_inline: Dispatch | None = None) -> ClaimOutcome:
    """One claim: lease a batch and dispatch its chains as publish tasks.

    A small claim (not full, at most ``options.inline_rows`` rows, within the byte budget)
    goes to ``publish_inline(chains, deadline)`` instead, when given: the claim task
    publishes it itself, which saves live traffic a hop through Celery's broker. A
    backlog (a full claim) is always dispatched, so every publish process gets work.

    Rows the claim turned dead (an expired lease with no attempts left: the row keeps
    killing or losing its workers) are sent to the dead-letter exchange through
    ``publisher.publish_dead`` (a no-op unless one is configured), after the batch has
    been dispatched so the live rows do not wait on it.

    Nothing is claimed while the breaker is open, or while ``queued()`` (publish tasks
    waiting in Celery's broker) is at ``options.max_queued_tasks``: that is what bounds
    the rows in flight however large the backlog. ``ClaimOutcome.more`` tells the caller
    to claim again at once (drain mode); ``ClaimOutcome.backlog`` whether the next claim
    needs ``queued`` (the caller may pass None after a small claim: live traffic then
    saves that round trip to Celery's broker).
    """
    outcome = ClaimOutcome()
    metrics.refresh(store)  # the in-flight and lag gauges, at most every few seconds
    if breaker is not None:
        outcome.paused = breaker.open_for()
        if outcome.paused > 0:
            # DEBUG: an outage is announced once (``Outage``), not on every tick.
            log.debug("outbox claims paused for %.1f s more (%s)", outcome.paused, breaker.reason)
            return outcome
    if queued is not None:
        depth = queued()
        if depth is not None and depth >= options.max_queued_tasks:
            outcome.saturated = True
            log.debug("outbox claim held back: %d publish tasks queued (max %d)", depth, options.max_queued_tasks)
            return outcome

    claimed_at, started = now(), time.perf_counter()
    try:
        claim = store.claim(batch_size)
    except Exception as exc:
        raise ClaimFailed(exc) from exc
    metrics.claimed(claim, time.perf_counter() - started)
    outcome.claimed = len(claim.messages)
    outcome.full = outcome.claimed >= batch_size
    outcome.dead = len(claim.dead)
    if not claim.messages:
        _dead_letter_expired(publisher, claim.dead, claim.dead_errors)
        return outcome
    settler = settler or Settler(store)
    deadline = claimed_at + lease_s * options.lease_safety
    tasks, over = plan_tasks(split_chains(claim.messages), options.task_rows, options.max_batch_bytes)
    outcome.trimmed = bool(over)
    if (publish_inline is not None and not outcome.full and not over
            and outcome.claimed <= options.inline_rows):
        chains = [chain for task in tasks for chain in task]
        log.info("outbox claimed %d rows lease=%s: publishing them here", outcome.claimed, claim.lease)
        outcome.inline = True
        outcome.dispatched = outcome.claimed
        publish_inline(chains, deadline)
        _dead_letter_expired(publisher, claim.dead, claim.dead_errors)
        return outcome
    for index, task in enumerate(tasks):
        try:
            dispatch(task, deadline)
        except Exception as exc:
            # Celery's broker refused the task: give back its rows and every later one.
            unsent = [m for pending in tasks[index:] for chain in pending for m in chain]
            log.error("outbox cannot dispatch publish tasks (%s: %s); releasing %d rows",
                      type(exc).__name__, exc, len(unsent))
            outcome.error = f"{type(exc).__name__}: {exc}"
            over = unsent + over
            break
        outcome.tasks += 1
        outcome.dispatched += sum(len(chain) for chain in task)
    if over:
        settler.release(over)
        outcome.released = len(over)
    log.info("outbox claimed %d rows lease=%s: %d in %d publish tasks, %d released",
             outcome.claimed, claim.lease, outcome.dispatched, outcome.tasks, outcome.released)
    _dead_letter_expired(publisher, claim.dead, claim.dead_errors)
    return outcome


class ClaimFailed(Exception):
    """``store.claim`` raised (the database is down or refusing, after the store's own
    retries): the caller reports it as a database outage instead of a task traceback."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _dead_letter_expired(publisher: PublisherLike, dead: Sequence[OutboxMessage],
                         errors: Mapping[int, str] | None = None) -> None:
    """Best effort, like every dead-letter copy: the dead row in the table stays the record.
    ``errors`` holds the reason of rows that went dead for another cause than their lease
    (undecodable rows: the copy carries what could be decoded)."""
    if publisher is None:
        return
    for message in dead:
        error = (errors or {}).get(message.id) or (f"{LEASE_EXPIRED}: {LEASE_EXPIRED_ERROR} "
                                                   f"(attempts: {message.attempts}, no attempts left)")
        send_dead(publisher, message, error)


# -- failed writes handed to the ack queue ---------------------------------------------------

def apply_fallback(store: StoreLike, publisher: PublisherLike, operation: str, kwargs: Mapping[str, Any]) -> Any:
    """What the ack/fail/release tasks do with a write the publish task could not make.
    Raises on failure, so the task retries."""
    if operation == "done":
        return store.mark_done(kwargs["ids"], kwargs["lease"])
    if operation == "release":
        delay = kwargs.get("delay_s")
        return store.release(kwargs["ids"], kwargs["lease"], timedelta(seconds=delay) if delay else None)
    if operation == "failed":
        message = message_from_dict(kwargs["message"])
        retry = kwargs.get("retry_in_s")
        result = store.mark_failed(message.id, message.lease, kwargs["error"],
                                   timedelta(seconds=retry) if retry is not None else None,
                                   dead=bool(kwargs.get("dead")))
        if result.applied and result.dead:
            metrics.dead()
        if result.applied and result.dead and publisher is not None:
            send_dead(publisher, message, kwargs["error"])
        return result
    raise ValueError(f"unknown operation {operation!r}")


__all__ = [
    "RelayOptions", "retry_delay", "message_to_dict", "message_from_dict",
    "Breaker", "LocalBreaker", "RedisBreaker", "FileBreaker", "breaker_key", "make_breaker",
    "RouteGate", "RedisRouteGate", "FileRouteGate", "make_route_gate",
    "Outage", "RedisOutage", "FileOutage", "make_outage", "ClaimFailed",
    "Coalescer", "RedisCoalescer", "FileCoalescer", "make_coalescer",
    "Settler", "ChainOutcome", "handle_chain", "handle_publish", "ClaimOutcome", "plan_tasks",
    "handle_claim", "apply_fallback", "send_dead",
    "CLAIM_TASK", "PUBLISH_TASK", "ACK_TASK", "FAIL_TASK", "RELEASE_TASK", "PURGE_TASK",
    "CLAIM_QUEUE", "PUBLISH_QUEUE", "ACK_QUEUE", "PURGE_QUEUE", "QUEUES",
]
