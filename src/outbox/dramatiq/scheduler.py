"""``outbox-dramatiq-scheduler``: beat's claim ticks and purges for Dramatiq, one leader at a
time (docs/dramatiq.md, "The scheduler": why our own, and the Redis or RabbitMQ leader lock)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from ..core.config import startup_options
from ..core.errors import ConfigError
from ..core.names import CLAIM_TASK, is_redis_url
from ..core.redact import install_filter, redact
from ..core.tls import kombu_connection, redis_py_url
from ..relay import RelayOptions
from ..relay.sent_record import RECORD_KEEP, RabbitSentRecord, RedisSentRecord, closing_channel, first_due
from ..relay.shared import MAX_QUEUED_CLAIMS as SHARED_MAX_QUEUED_CLAIMS
from ..relay.shared import ClaimQueueGuard, Outage
from ..schedule import load_beat_schedule
from . import brokers as _broker

log = logging.getLogger("outbox.dramatiq.scheduler")

#: How long a leader lock outlives its holder's last renewal.
LOCK_TTL_S = 10.0
#: Renewal / take-over attempts this often.
LOCK_CHECK_S = 1.0
#: No claim tick is sent while the claim queue holds this many (``relay.shared.ClaimQueueGuard``).
MAX_QUEUED_CLAIMS = SHARED_MAX_QUEUED_CLAIMS


def lock_name(url: str, namespace: str, outbox_namespace: str) -> str:
    """One leader per outbox relayed on a Dramatiq broker: a digest of Dramatiq's key namespace
    on Redis (its queues' prefix; RabbitMQ ignores it) and the outbox namespace. Not of ``url``:
    the lock lives in that broker (``make_lock``), and a URL written another way (a rotated
    password, ``//`` or ``%2F``) gave two schedulers of one outbox two locks (docs/dramatiq.md,
    "The scheduler")."""
    prefix = namespace if is_redis_url(url) else ""
    return hashlib.sha1(f"{prefix}|{outbox_namespace}".encode()).hexdigest()[:16]


def broker_outage(url: str) -> Outage:
    """The scheduler's outage log of Dramatiq's broker (``relay.shared.Outage``, this process
    only): one WARNING when it becomes unreachable, the sends and lock checks that fail after
    it at DEBUG, one INFO line when it answers again."""
    return Outage("Dramatiq's broker", redact(url),
                  "No claim tick or purge is sent until it answers; the leader keeps its lock "
                  "or takes it again then", log)


class RedisLock:
    """Leader lock in Redis: SET NX PX, renewed by its holder only (compare and extend).
    ``outage``: where an unreachable Redis is reported (default: ``broker_outage``)."""

    _RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
              "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
    _RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
                "return redis.call('del', KEYS[1]) else return 0 end")

    def __init__(self, url: str, name: str, ttl_s: float = LOCK_TTL_S, outage: Outage | None = None) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_py_url(url), socket_timeout=2.0, socket_connect_timeout=2.0)
        self.key = f"outbox:scheduler:{name}"
        self.me = uuid.uuid4().hex
        self.ttl_ms = int(ttl_s * 1000)
        self.held = False
        self.outage = outage or broker_outage(url)
        #: The last check failed: the next that works ends the outage. One that works does not end
        #: an outage the sends are in: a full Redis (``OOM``) still renews the key and refuses
        #: every send, and the scheduler said "unreachable" and "reachable again" every second
        #: (found in review).
        self.failed = False
        #: When each entry was last sent by any leader (``relay.sent_record``).
        self.record = RedisSentRecord(self.client, f"{self.key}:sent:")

    def hold(self) -> bool:
        """Take or renew the lock; True while this scheduler is the leader. The renewal is
        tried first even when the last check failed: a Redis that was unreachable for less
        than the TTL still holds this scheduler's own key, which SET NX would refuse it until
        the key expired (no tick for up to ``LOCK_TTL_S`` after every short outage)."""
        try:
            if self.client.eval(self._RENEW, 1, self.key, self.me, self.ttl_ms):
                self.held = True
            else:
                self.held = bool(self.client.set(self.key, self.me, nx=True, px=self.ttl_ms))
        except Exception as exc:  # noqa: BLE001 - Redis down: nobody ticks, which the workers survive
            from redis.exceptions import ReadOnlyError

            if isinstance(exc, ReadOnlyError):
                # A replica after a failover: the next check connects again, to where the address
                # leads now (the broker's client does the same: brokers._redis_broker).
                self.client.connection_pool.disconnect()
            self.outage.failed(exc)
            self.held, self.failed = False, True
        else:
            if self.failed:
                self.outage.ok()
            self.failed = False
        return self.held

    def last_sent(self, actors: list[str]) -> dict[str, float]:
        """When each of ``actors`` was last sent by any leader (``run``): keys beside the lock's."""
        return self.record.last_sent(actors)

    def record_sent(self, actor: str, at: float, keep_s: float) -> None:
        self.record.record_sent(actor, at, keep_s)

    def release(self) -> None:
        try:
            if self.held:
                self.client.eval(self._RELEASE, 1, self.key, self.me)
        except Exception:
            log.debug("outbox scheduler: cannot release the lock", exc_info=True)
        self.held = False


class RabbitLock:
    """Leader lock in RabbitMQ: an exclusive queue, held by one connection at a time.
    ``outage``: where an unreachable RabbitMQ is reported (default: ``broker_outage``)."""

    def __init__(self, url: str, name: str, outage: Outage | None = None) -> None:
        self.url = url
        self.queue = f"outbox.scheduler.{name}"
        self.conn: Any = None
        self.outage = outage or broker_outage(url)
        #: When each entry was last sent by any leader (``relay.sent_record``): the one message of
        #: the queue ``outbox.scheduler.<name>.sent``, only read or written by the leader.
        self.record = RabbitSentRecord(f"{self.queue}.sent", self._record_channel)

    def hold(self) -> bool:
        if self.conn is not None:
            try:
                self.conn.heartbeat_check()
                self.conn.drain_events(timeout=0.01)
            except TimeoutError:
                pass
            except Exception as exc:  # noqa: BLE001 - any error of the lock's connection gives the lock up
                self.outage.failed(exc)
                self.release()
            else:
                return True
            if self.conn is not None:
                return True
        try:  # amqps://: as the broker's, each node checked against its own name (core.tls)
            conn = kombu_connection(self.url, _broker.URL_SETTING, heartbeat=LOCK_TTL_S)
        except ConfigError as exc:
            self.outage.failed(exc)
            return False
        try:
            conn.connect()
            conn.default_channel.queue_declare(queue=self.queue, exclusive=True, auto_delete=True)
        except Exception as exc:  # noqa: BLE001 - RESOURCE_LOCKED: another scheduler leads; else unreachable
            if type(exc).__name__ == "ResourceLocked":
                log.debug("outbox scheduler: lock held elsewhere (%s)", exc)
                self.outage.ok()
            else:
                self.outage.failed(exc)
            try:
                conn.release()
            except Exception:
                log.debug("outbox scheduler: error releasing a refused connection", exc_info=True)
            return False
        self.outage.ok()
        self.conn = conn
        return True

    def _record_channel(self) -> Any:
        """A channel of the lock's connection: only the leader reads or writes the record."""
        if self.conn is None:
            raise ConnectionError("not leading")
        return closing_channel(self.conn)

    def last_sent(self, actors: list[str]) -> dict[str, float]:
        """When each of ``actors`` was last sent by any leader (``run``)."""
        return self.record.last_sent(actors)

    def record_sent(self, actor: str, at: float, keep_s: float) -> None:
        self.record.record_sent(actor, at, keep_s)

    def release(self) -> None:
        if self.conn is not None:
            try:
                self.conn.release()
            except Exception:
                log.debug("outbox scheduler: error releasing the lock's connection", exc_info=True)
        self.conn = None


def make_lock(url: str, name: str, outage: Outage | None = None) -> Any:
    return RedisLock(url, name, outage=outage) if is_redis_url(url) else RabbitLock(url, name, outage)


def schedule_entries(settings: Any, options: RelayOptions) -> list[tuple[str, str, float, float, dict[str, Any]]]:
    """``(actor, queue, every_s, max_age_s, kwargs)`` of each entry of ``beat_schedule`` (the one
    definition of the relay's schedule, shared with Celery's beat; ``kwargs`` name the outbox)."""
    return [(entry["task"], entry["options"]["queue"], float(entry["schedule"]), float(entry["options"]["expires"]),
             dict(entry.get("kwargs") or {})) for entry in load_beat_schedule(settings, options).values()]


def _first_due(entries: list[tuple[str, str, float, float, dict[str, Any]]], lock: Any, now: float) -> list[float]:
    """When a new leader sends each entry (``time.monotonic`` values from ``now``): the first (the
    claim tick) at once, each other one by ``relay.sent_record.first_due`` from when it was last
    sent by any leader (``lock.last_sent``), an entry never sent taken as sent now."""
    wall = time.time()
    due = first_due(lock, [(actor, every_s, wall) for actor, _, every_s, _, _ in entries[1:]], wall)
    return [now] + [now + due[actor] for actor, _, _, _, _ in entries[1:]]


def run(stop: threading.Event, entries: list[tuple[str, str, float, float, dict[str, Any]]], lock: Any,
        send: Any = None, outage: Outage | None = None, guard: ClaimQueueGuard | None = None) -> None:
    """Send each entry every ``every_s`` until ``stop`` is set, while holding ``lock``.
    ``send(actor, queue, kwargs, max_age_s)`` defaults to ``outbox.dramatiq.brokers.send``.
    A new leader sends the first entry (the claim tick) at once, and each other one (the purge)
    an interval after it was last sent by any leader, recorded beside the lock
    (``lock.last_sent``, ``lock.record_sent``; docs/dramatiq.md, "The scheduler"); one never
    sent is first sent an interval after a leader first saw it. ``outage``: where a send that
    fails is reported (default: the lock's, ``RedisLock.outage`` or ``RabbitLock.outage``), and
    a send that goes through ends the outage. ``guard``: holds the claim tick back while its
    queue is full (default: one of this scheduler's, reading the queue on Dramatiq's broker)."""
    send = send or _broker.send
    outage = outage or lock.outage
    guard = guard or ClaimQueueGuard(log, "the scheduler", "`dramatiq outbox.dramatiq`, or with --queues naming it")
    leading = False
    due = [0.0] * len(entries)
    next_lock = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_lock:
            was, leading = leading, lock.hold()
            next_lock = now + LOCK_CHECK_S
            if leading and not was:
                log.info("outbox scheduler: leading; %s", ", ".join(f"{e[0]} every {e[2]:g} s" for e in entries))
                due = _first_due(entries, lock, now)
            elif was and not leading:
                log.warning("outbox scheduler: lost the lead; standing by")
        wait_until = next_lock
        if leading:
            for i, (actor, queue, every_s, max_age_s, kwargs) in enumerate(entries):
                if now >= due[i] and actor == CLAIM_TASK and guard.full(queue, functools.partial(_broker.queued, queue), MAX_QUEUED_CLAIMS):
                    due[i] = now + every_s
                elif now >= due[i]:
                    try:
                        send(actor, queue, kwargs, max_age_s=max_age_s)
                    except Exception as exc:  # noqa: BLE001 - Dramatiq's broker is down: the next one is sent
                        outage.failed(exc)
                    else:
                        outage.ok()
                        if i:
                            lock.record_sent(actor, time.time(), RECORD_KEEP * every_s)
                    due[i] = now + every_s
                wait_until = min(wait_until, due[i])
        stop.wait(max(0.01, wait_until - time.monotonic()))
    lock.release()


#: What ``--loglevel`` accepts (``logging``'s level names).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="outbox-dramatiq-scheduler",
        description="Send the relay's claim ticks and purges to Dramatiq's broker "
                    "(OUTBOX_DRAMATIQ_BROKER_URL) for `dramatiq outbox.dramatiq` workers. Run one or "
                    "more: a leader lock (Redis key or RabbitMQ exclusive queue) lets only one tick.")
    parser.add_argument("--loglevel", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="logging level, any case (default INFO)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_filter(logging.getLogger())
    # Dramatiq's RabbitMQ client narrates each connect at INFO, and each failed one with ERROR lines
    # and a traceback: while RabbitMQ is down that is a screenful per tick. What failed is in
    # the scheduler's own outage line (broker_outage), once per outage.
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    try:
        settings, options = startup_options()
        dramatiq_settings = _broker.settings(required=True)
        assert dramatiq_settings is not None
        url, ns = dramatiq_settings.url, dramatiq_settings.namespace
        entries = schedule_entries(settings, options)
    except ConfigError as exc:
        print(redact(f"outbox: invalid configuration: {exc}"), file=sys.stderr)
        return 2
    stop, stopped = threading.Event(), threading.Event()

    def on_stop(*_: Any) -> None:
        stopped.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_stop)
    reload = threading.Event()  # SIGHUP: Dramatiq's reload (docs/dramatiq.md, "The scheduler")

    def on_sighup(*_: Any) -> None:
        reload.set()
        stop.set()

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, on_sighup)
    outage = broker_outage(url)
    lock = make_lock(url, lock_name(url, ns, settings.outbox_namespace), outage)
    log.info("outbox scheduler: Dramatiq broker %s, waiting for the lead", redact(url))
    run(stop, entries, lock, outage=outage)
    if reload.is_set() and not stopped.is_set():  # a SIGHUP with a stop (systemd's SendSIGHUP=yes) is that stop
        log.info("outbox scheduler: reloading (SIGHUP)")
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # kept across exec until main() sets its handler again
        os.execv(sys.executable, [sys.executable, "-m", "outbox.dramatiq.scheduler", *sys.argv[1:]])
    log.info("outbox scheduler: stopped")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
