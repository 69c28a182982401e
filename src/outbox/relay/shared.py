"""State the relay's processes share: the circuit breaker, the paused routes, the outage
log and the claim-request coalescer, each in Redis (Celery's broker is Redis) or in a
file (one host), or local to the process. Why each exists: docs/relay.md."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from typing import Any


log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


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
        from ..redact import redact

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


def make_relay_outage(which: str, settings: Any, options: Any, shared_url: str,
                      logger: logging.Logger | None = None) -> Outage:
    """The outage log of ``which`` ("database" or "destination broker") for ``settings``,
    shared through ``shared_url`` (the task runner's broker) like the breaker; every task
    runner (outbox.worker for Celery, outbox.dramatiq) makes its outage logs here."""
    from ..redact import redact

    key = breaker_key(settings.database_url, settings.table, settings.publish_url, settings.exchange)
    if which == "database":
        where = redact(settings.database_url)
        meanwhile = ("Claims fail and are retried every tick; nothing is lost (rows in flight finish or "
                     "come back with their lease).")
    else:
        where = f"{redact(settings.publish_url)} exchange {settings.exchange!r}"
        meanwhile = (f"Claims pause (probing every {options.breaker_s:g} s); rows in hand are released "
                     "with no attempt spent.")
    return make_outage(shared_url, key, which, where, meanwhile, logger)
