"""The policies over the state the relay's processes share (``relay.state``): the circuit
breaker, the paused routes, the outage log and the claim-request coalescer (docs/relay.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..core.errors import OutboxError
from .state import ProcessState, SharedState, open_shared_state

log = logging.getLogger("outbox.relay")  # one logger for the whole relay package


# -- circuit breaker -------------------------------------------------------------------------

class Breaker:
    """Pauses claiming while the destination broker is down or misconfigured.

    The state is "open until <time>, because <reason>". ``trip`` only ever extends it,
    so a short back-pressure pause never shortens a fatal one. It is shared through
    ``state`` under ``key`` (it expires when the pause ends); each process keeps its own
    copy and reads the shared one at most every ``cache_s``, so checking it on every
    chain stays cheap.
    """

    cache_s = 0.25

    def __init__(self, state: SharedState | None = None, key: str = "outbox:breaker") -> None:
        self.state: SharedState = state if state is not None else ProcessState()
        self.key = key
        self._until = 0.0
        self._seconds = 0.0  # the length of the pause in force, from when it was tripped or read
        self._reason = ""
        self._checked = 0.0
        self._lock = threading.Lock()

    def _mend_step_back(self, now: float) -> None:
        """Under the lock: after this host's clock stepped back, the pause in force ends no
        later than its length from ``now``, and the shared one is read again at once
        (docs/relay.md, "Circuit breaker")."""
        self._until = min(self._until, now + self._seconds)
        if self._checked > now:
            self._checked = 0.0

    def _read(self, now: float) -> tuple[float, str] | None:
        """The shared pause: its end, never further than its length from ``now`` (the host
        that tripped it may have a clock ahead of this one: docs/relay.md, "Circuit breaker")."""
        raw = self.state.get(self.key)
        if not raw:
            return None
        data = json.loads(raw)
        until = float(data["until"])
        if "seconds" in data:
            until = min(until, now + float(data["seconds"]))
        return until, str(data.get("reason", ""))

    def open_for(self, now: float | None = None) -> float:
        """Seconds until claims may resume; 0 when closed."""
        now = time.time() if now is None else now
        with self._lock:
            self._mend_step_back(now)
            if self._until <= now and now - self._checked >= self.cache_s:
                self._checked = now
                try:
                    shared = self._read(now)
                except Exception as exc:  # noqa: BLE001 - the shared store is down: decide locally
                    log.debug("outbox breaker: cannot read shared state: %s", exc)
                    shared = None
                if shared is not None and shared[0] > self._until:
                    (self._until, self._reason), self._seconds = shared, shared[0] - now
            return max(0.0, self._until - now)

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def fatal(self) -> bool:
        """Opened by a fatal publishing error (an operator must act), not by back-pressure."""
        return self._reason.startswith("fatal")

    def trip(self, seconds: float, reason: str, now: float | None = None) -> float:
        return self._trip(seconds, reason, now)[0]

    def opens(self, seconds: float, reason: str, now: float | None = None) -> bool:
        """``trip``, and whether this call opened the pause: False when a pause of the same
        kind (the reason's first word: ``fatal``, ``backpressure``) was open already, tripped
        in this process or, as last read, shared. What says an outage once per pause."""
        self.open_for(now)  # the shared pause, unless read lately
        return self._trip(seconds, reason, now)[1]

    def _trip(self, seconds: float, reason: str, now: float | None) -> tuple[float, bool]:
        now = time.time() if now is None else now
        until = now + seconds
        kind = reason.split(":", 1)[0]
        with self._lock:
            self._mend_step_back(now)
            opened = not (self._until > now and self._reason.split(":", 1)[0] == kind)
            if until > self._until:
                self._until, self._seconds, self._reason = until, seconds, reason
            until, reason = self._until, self._reason
        try:
            shared = self._read(now)
            if shared is None or shared[0] < until:
                self.state.set(self.key, json.dumps({"until": until, "reason": reason, "seconds": until - now}),
                               until - time.time())
        except Exception as exc:  # noqa: BLE001 - any error of the shared store: pause alone
            log.warning("outbox breaker: cannot share state (this process pauses alone): %s", exc)
        return until, opened

    def reset(self) -> None:
        with self._lock:
            self._until, self._seconds, self._reason, self._checked = 0.0, 0.0, "", 0.0
        try:
            self.state.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - any error of the shared store: logged, local state cleared
            log.warning("outbox breaker: cannot clear shared state: %s", exc)


def breaker_key(namespace: str, publish_url: str, exchange: str) -> str:
    """One breaker per (outbox, destination): relays of other outboxes are unaffected. The
    outbox is its namespace (``Settings.outbox_namespace``: table, schema and database)."""
    digest = hashlib.sha1(f"{namespace}|{publish_url}|{exchange}".encode()).hexdigest()[:16]
    return f"outbox:breaker:{digest}"


def make_breaker(celery_broker_url: str, key: str) -> Breaker:
    """Shared through the task runner's broker URL (``open_shared_state``)."""
    return Breaker(open_shared_state(celery_broker_url), key)


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

    The state is a map route -> (until, step), shared through ``state`` as the fields of
    ``key`` (kept while any route was refused recently); each process caches it for ``cache_s``.
    """

    cache_s = 0.25

    def __init__(self, state: SharedState | None = None, key: str = "outbox:routes") -> None:
        self.state: SharedState = state if state is not None else ProcessState()
        self.key = key
        self._routes: dict[str, tuple[float, float]] = {}
        self._checked = 0.0
        self._lock = threading.Lock()

    def _refresh(self, now: float) -> None:
        """Under the lock: bring the map up to date. Every reader and writer of ``_routes``
        holds the lock throughout: a process's threads share the gate (docs/relay.md,
        "Per-route back-pressure")."""
        # This host's clock stepped back: each pause ends no later than its length from now,
        # and the shared state is read again at once (as Breaker._mend_step_back).
        for route, (until, step) in self._routes.items():
            if until > now + step:
                self._routes[route] = (now + step, step)
        if self._checked > now:
            self._checked = 0.0
        if now - self._checked >= self.cache_s:
            self._checked = now
            try:
                shared = {route: json.loads(value) for route, value in self.state.get_fields(self.key).items()}
            except Exception as exc:  # noqa: BLE001 - the shared store is down: decide locally
                log.debug("outbox route gate: cannot read shared state: %s", exc)
                shared = {}
            for route, (until, step) in shared.items():
                until = min(float(until), now + float(step))  # a clock ahead of ours: as Breaker._read
                if until > self._routes.get(route, (0.0, 0.0))[0]:
                    self._routes[route] = (until, float(step))

    def paused(self, route: str, now: float | None = None) -> float:
        """Seconds until ``route`` may be published to again; 0 when it is open."""
        now = time.time() if now is None else now
        with self._lock:
            self._refresh(now)
            until = self._routes.get(route, (0.0, 0.0))[0]
        return max(0.0, until - now)

    def any_paused(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            self._refresh(now)
            return any(until > now for until, _ in self._routes.values())

    def refuse(self, route: str, base_s: float, max_s: float, now: float | None = None) -> tuple[float, bool]:
        """Record a refusal of ``route``; returns (seconds it pauses from now, whether this
        call started the pause)."""
        now = time.time() if now is None else now
        with self._lock:
            self._refresh(now)
            until, step = self._routes.get(route, (0.0, 0.0))
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
            self.state.set_field(self.key, route, json.dumps([until, step]), until - time.time() + 3 * max_s)
        except Exception as exc:  # noqa: BLE001 - any error of the shared store: pause alone
            log.warning("outbox route gate: cannot share state (this process pauses the route alone): %s", exc)
        return step, True


def make_route_gate(celery_broker_url: str, key: str) -> RouteGate:
    """Shared like the breaker, under the breaker's key + ``:routes``."""
    return RouteGate(open_shared_state(celery_broker_url), key + ":routes")


# -- outages, logged like an operator wants ----------------------------------------------------

class OutageLine(NamedTuple):
    """A line ``Outage`` logs: its level, format and arguments, and the exception to show."""

    level: int
    msg: str
    args: tuple[Any, ...]
    exc_info: BaseException | None = None


class Outage:
    """Logs an outage of one dependency (the database, the destination broker) once.

    ``failed(error)``: the first failure of an outage logs one WARNING saying what is down,
    where, and what the relay does meanwhile; every later failure logs at DEBUG only (with
    the traceback when there is one). ``ok()`` after failures logs one INFO line with how long
    it lasted. ``ok()`` costs nothing while there is no outage.

    A failure of work ``began`` (``time.monotonic()``) before the last ``ok()`` of this
    process is a leftover of the outage that ended (a delivery report of an event produced
    during it that timed out after the broker was back): ``stale(began)`` says so, and
    ``failed`` logs it at DEBUG instead of announcing a second outage.

    Workers share the announcement through ``state``: only the process that first sees the
    outage warns (it sets ``key``), and only the first to see it end says so (it deletes
    ``key``). The key expires after ``remind_s``, so an outage that goes on is announced
    again that often.
    """

    remind_s = 600.0

    def __init__(self, what: str, where: str, meanwhile: str, logger: logging.Logger | None = None,
                 state: SharedState | None = None, key: str = "outbox:outage") -> None:
        self.what, self.where, self.meanwhile = what, where, meanwhile
        self.log = logger or log
        self.state: SharedState = state if state is not None else ProcessState()
        self.key = key
        self._since: float | None = None
        self._ended = float("-inf")  # the last ok() that ended an outage (time.monotonic())
        self._failures = 0
        self._lock = threading.Lock()

    def _begin(self) -> bool:
        """True when this process is the first to report the outage."""
        return self.state.set_if_absent(self.key, "1", self.remind_s)

    def _end(self) -> bool:
        """True when this process is the first to report its end."""
        return self.state.delete(self.key)

    @property
    def down(self) -> bool:
        return self._since is not None

    def age(self) -> float:
        """Seconds since this process saw the outage begin; 0 when there is none."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def stale(self, began: float | None) -> bool:
        """True when work begun at ``began`` began before this process saw the last outage end,
        and no new outage has begun since."""
        return began is not None and self._since is None and began < self._ended

    def failed(self, error: BaseException | str, began: float | None = None) -> bool:
        """Count ``error`` towards an outage, or (False) log it at DEBUG as a leftover of the
        last one, when the work began before it ended (``stale``)."""
        counted, line = self.judge(error, began)
        self.log.log(line.level, line.msg, *line.args, exc_info=line.exc_info)
        return counted

    def judge(self, error: BaseException | str, began: float | None = None) -> tuple[bool, OutageLine]:
        """``failed`` without the logging: whether ``error`` counted, and the line to log
        (the announcement at WARNING, or a line at DEBUG). For a caller that must not log
        while a record is being handled (a logging filter: ``outbox.dramatiq.consumer_log``)."""
        from ..core.redact import redact, redact_error

        detail = redact_error(error) if isinstance(error, BaseException) else redact(error)
        detail = " ".join(detail.split())
        if self.stale(began):
            return False, OutageLine(logging.DEBUG, "outbox: %s failed for work begun before it was back (%s): %s",
                                     (self.what, self.where, detail))
        with self._lock:
            first = self._since is None
            if first:
                self._since = time.monotonic()
            self._failures += 1
        announce = False
        if first:
            try:
                announce = self._begin()
            except Exception:  # noqa: BLE001 - the shared flag is unreachable: say it here
                announce = True
        if announce:
            # One of ours (a table missing, say) names its cause: it is not a network failure.
            state = "cannot be used" if isinstance(error, OutboxError) else "unreachable"
            return True, OutageLine(logging.WARNING, "outbox: %s %s (%s): %s. %s",
                                    (self.what, state, self.where, detail, self.meanwhile))
        return True, OutageLine(logging.DEBUG, "outbox: %s still unreachable (%s): %s", (self.what, self.where, detail),
                                error if isinstance(error, BaseException) else None)

    def ok(self) -> None:
        if self._since is None:
            return
        with self._lock:
            since, failures = self._since, self._failures
            self._since, self._failures = None, 0
            if since is not None:
                self._ended = time.monotonic()
        if since is None:
            return
        try:
            announce = self._end()
        except Exception:  # noqa: BLE001 - the shared flag is unreachable: say it here
            announce = True
        if announce:
            self.log.info("outbox: %s reachable again (%s) after %.1f s", self.what, self.where,
                          time.monotonic() - since)
        else:
            self.log.debug("outbox: %s reachable again from this process after %d failures", self.what, failures)


def make_outage(celery_broker_url: str, key: str, what: str, where: str, meanwhile: str,
                logger: logging.Logger | None = None) -> Outage:
    """Shared like the breaker, under the breaker's key + ``:outage:<what>``."""
    return Outage(what, where, meanwhile, logger, open_shared_state(celery_broker_url),
                  f"{key}:outage:{what.replace(' ', '-')}")


# -- claim ticks nobody takes ---------------------------------------------------------------

#: No claim tick is sent while the claim queue holds this many messages: nobody takes them,
#: and a Redis list (Celery's or Dramatiq's broker) or Dramatiq's RabbitMQ queue keeps expired
#: ones until a worker does (docs/relay.md, "Running worker and beat"; docs/dramatiq.md). Dramatiq's
#: writers on RabbitMQ hold their wakes' claims back at the same length.
MAX_QUEUED_CLAIMS = 100


class ClaimQueueGuard:
    """Holds a scheduler's claim ticks back while their queue holds ``limit`` messages.
    Celery's beat, Dramatiq's scheduler and Dramatiq's writers on RabbitMQ (their wakes'
    claims: ``outbox.dramatiq.waker``) each give it their logger and what to say
    (``sender``: who stops sending; ``hint``: how to start a worker on the queue), and at
    each tick how to read the queue's length (``length()``: a count, or None when it cannot
    be read). Said once when the queue fills and once when it takes ticks again; an
    unreadable length is not full (the send then meets whatever is wrong)."""

    def __init__(self, logger: logging.Logger, sender: str, hint: str) -> None:
        self.log, self.sender, self.hint = logger, sender, hint
        self.held = False

    def full(self, queue: str, length: Callable[[], int | None], limit: int = MAX_QUEUED_CLAIMS) -> bool:
        try:
            queued = length()
        except Exception as exc:  # noqa: BLE001 - best effort: send as before
            self.log.debug("outbox: cannot read %s's length: %s", queue, exc)
            return False
        if queued is None:
            return False
        full = queued >= limit
        if full != self.held:
            self.held = full
            if full:
                self.log.warning("outbox: %s holds %d claim ticks that no worker has taken: %s sends no more until it "
                                 "holds fewer (is a worker consuming it? %s)", queue, queued, self.sender, self.hint)
            else:
                self.log.info("outbox: %s is being consumed again; %s sends its claim ticks again", queue,
                              self.sender)
        return full


#: Claims arriving expired this many claim intervals in a row, and for at least
#: ``LATE_CLAIMS_MIN_S``, none in time, are said in one WARNING (``LateClaims``).
LATE_CLAIMS_INTERVALS, LATE_CLAIMS_MIN_S = 10, 10.0


class LateClaims:
    """The claim ticks and requests a worker process drops for arriving after their expiry.

    The expiry is reckoned on the sender's clock and checked on this host's, so a host whose
    clock runs ahead of the scheduler's by more than the expiry drops every tick and claims
    nothing, and each drop was a DEBUG line: the rows waited for ever while the worker looked
    idle (found in review; docs/relay.md, "Ticks, expiry and clocks"). Drops that go on for
    ``window_s`` with no claim arriving in time make one WARNING, with how late the last one
    was; the first claim in time after it one INFO line. Ticks queued while the workers were
    down expire too, but the claim queue holds at most ``MAX_QUEUED_CLAIMS``, taken in a moment."""

    def __init__(self, logger: logging.Logger, claim_interval_s: float) -> None:
        self.log = logger
        self.window_s = max(LATE_CLAIMS_MIN_S, LATE_CLAIMS_INTERVALS * claim_interval_s)
        self._since: float | None = None  # the first drop of the current run (time.monotonic())
        self._warned = False
        self._lock = threading.Lock()

    def dropped(self, late_s: float, now: float | None = None) -> None:
        """A claim arrived ``late_s`` seconds past its expiry (on this host's clock) and was dropped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._since is None:
                self._since = now
            if self._warned or now - self._since < self.window_s:
                return
            self._warned = True
        self.log.warning(
            "outbox: every claim tick and claim request that reached this worker for %.0f s had expired (the last "
            "%.0f s past its expiry, by this host's clock) and was dropped: rows are claimed here on post-commit "
            "wake-ups only. Unless old ticks that waited in the claim queue are being worked off, this host's clock "
            "is ahead of the scheduler's by more than the ticks' expiry (30 s at least): synchronise the clocks "
            "(NTP). Docs: relay.md, \"Ticks, expiry and clocks\"", now - self._since, late_s)

    def in_time(self) -> None:
        """A claim tick or request arrived before its expiry: a run of drops ends."""
        with self._lock:
            warned, self._since, self._warned = self._warned, None, False
        if warned:
            self.log.info("outbox: claim ticks reach this worker before their expiry again")


# -- coalesced claim requests ----------------------------------------------------------------

class Coalescer:
    """At most one claim *requested* at a time, however many ask.

    Whoever wants a claim soon (a publish task that just freed its aggregates, a claim
    that came back full, a post-commit wake-up) calls ``acquire``; only the first caller
    gets True and sends the claim task, which calls ``clear`` as it starts, so requests
    made while it runs lead to exactly one more claim. The token (``key`` in ``state``)
    expires after ``ttl_s`` in case that claim task is lost; beat's ticks carry on regardless.
    """

    def __init__(self, ttl_s: float, state: SharedState | None = None,
                 key: str = "outbox:claim-requested") -> None:
        self.ttl_s = ttl_s
        self.state: SharedState = state if state is not None else ProcessState()
        self.key = key

    def acquire(self, strict: bool = False) -> bool:
        """True for the first caller. The token's store is the runner's broker: when it is
        down, True (request anyway), or with ``strict`` its error, for a caller that would
        send through that broker and can spare the send (``Relay.request_claim``)."""
        try:
            return self.state.set_if_absent(self.key, "1", self.ttl_s)
        except Exception as exc:  # the runner's broker holds the token: if it is down, sending fails too
            if strict:
                raise
            log.debug("outbox: claim request token unavailable (%s); requesting anyway", exc)
            return True

    def clear(self) -> None:
        try:
            self.state.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - any error of the shared store: the token expires by itself
            log.debug("outbox: cannot clear the claim request token: %s", exc)


def make_coalescer(celery_broker_url: str, key: str, ttl_s: float) -> Coalescer:
    """Shared like the breaker, under the breaker's key + ``:claim-requested``."""
    return Coalescer(ttl_s, open_shared_state(celery_broker_url), key + ":claim-requested")


#: The outage of the task runner's broker as the relay's claim requests meet it (``Relay.request_claim``).
RUNNER_BROKER = "task runner's broker"
#: The outage logs each relay process keeps (``make_relay_outage``).
RELAY_OUTAGES = ("database", "destination broker", RUNNER_BROKER)


def make_relay_outage(which: str, settings: Any, options: Any, shared_url: str,
                      logger: logging.Logger | None = None) -> Outage:
    """The outage log of ``which`` (one of ``RELAY_OUTAGES``) for ``settings``, shared through
    ``shared_url`` (the task runner's broker) like the breaker; every task runner
    (outbox.celery.worker for Celery, outbox.dramatiq) makes its outage logs here. That
    broker's own outage is logged per process: the shared flag would live in it."""
    from ..core.redact import redact

    if which == RUNNER_BROKER:
        return Outage(which, redact(shared_url), "Claims are not requested through it until it answers, and claim "
                      "ticks cannot arrive either; nothing is lost (rows wait in the table)", logger, ProcessState())
    key = breaker_key(settings.outbox_namespace, settings.publish_url, settings.exchange)
    if which == "database":
        where = redact(settings.database_url)
        meanwhile = ("Claims fail and are retried every tick; nothing is lost (rows in flight finish or "
                     "come back with their lease).")
    else:
        # OUTBOX_EXCHANGE plays no part on Kafka: each event goes to its topic (docs/destinations.md).
        where = (redact(settings.publish_url) if settings.publish_url.startswith("kafka://")
                 else f"{redact(settings.publish_url)} exchange {settings.exchange!r}")
        meanwhile = (f"Claims pause (probing every {options.breaker_s:g} s); rows in hand are released "
                     "with no attempt spent.")
    return make_outage(shared_url, key, which, where, meanwhile, logger)
