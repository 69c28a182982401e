"""What a relay worker process holds, for every task runner (``outbox.celery.worker`` for Celery,
``outbox.dramatiq``): why per process and per thread, docs/internals.md, "Worker processes"."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.config import RelayOptions, Settings
from ..core.model import Holder
from ..publisher import Publisher
from ..publisher.select import publisher_for
from ..storage.engines.describe import driver_problem
from ..storage.store import OutboxStore
from .holders import Heartbeat, new_holder
from .settle import Fallback, Settler
from .shared import (
    RELAY_OUTAGES,
    Breaker,
    Coalescer,
    Outage,
    RouteGate,
    breaker_key,
    make_breaker,
    make_coalescer,
    make_relay_outage,
    make_route_gate,
)
from .sizing import ClaimSizer

log = logging.getLogger("outbox.relay")

#: What the holder is made from, read when a process first needs it: the relay's settings,
#: its options, the task runner's broker URL (where the shared state lives) and the key of
#: the claim queue's one claim-request token (``outbox.core.names.claim_request_key``).
Config = Callable[[], "tuple[Settings, RelayOptions, str, str]"]


@dataclass
class Resources:
    """One thread's connections: never shared between threads, never inherited over fork."""

    pid: int
    store: OutboxStore
    publisher: Publisher
    settler: Settler
    #: Claims sized by bytes (docs/relay.md, "Memory: claims sized by bytes").
    sizer: ClaimSizer


@dataclass
class Shared:
    """One process's objects over the shared state (``relay.shared``)."""

    pid: int
    breaker: Breaker
    coalescer: Coalescer
    routes: RouteGate
    outages: dict[str, Outage] = field(default_factory=dict)

    def outage(self, which: str) -> Outage:
        """The outage log of ``which`` (``relay.shared.RELAY_OUTAGES``)."""
        return self.outages[which]


class ResourceHolder:
    """The store, publisher, settler and claim sizer of each thread, and the breaker, claim coalescer,
    route gate and outage logs of the process, and the process's holder id and heartbeat
    (docs/internals.md, "Lost workers"); made on first use, made afresh in a forked child, closed
    together. ``on_takeover`` is called when the heartbeat took rows of a lost process over
    (the runner's coalesced claim request)."""

    def __init__(self, config: Config, fallback: Fallback, logger: logging.Logger | None = None,
                 on_takeover: Callable[[], object] = lambda: None) -> None:
        self._config = config
        self._fallback = fallback
        self._log = logger or log
        self._on_takeover = on_takeover
        self._heartbeat: Heartbeat | None = None
        self._inherited_beats: list[Heartbeat] = []  # kept referenced, like ``_inherited``
        self._local = threading.local()
        self._made: list[Resources] = []
        #: Inherited over fork() (e.g. the main process's in-process claim made them): kept
        #: referenced, never used or closed, so no finalizer closes the parent's connections.
        self._inherited: list[Resources] = []
        self._shared: Shared | None = None
        self._lock = threading.Lock()

    def resources(self) -> Resources:
        """This thread's store, publisher and settler."""
        r: Resources | None = getattr(self._local, "resources", None)
        if r is None or r.pid != os.getpid():
            settings, options, _, _ = self._config()
            store = OutboxStore.from_settings(settings)
            store.holder_id = self.holder().holder_id  # lease tokens name this process
            store.use_claim_window(options.claim_window)
            if options.async_commit:
                store.commit_without_waiting()
            publisher = publisher_for(settings, max_message_bytes=options.max_message_bytes)
            r = Resources(os.getpid(), store, publisher, Settler(store, self._fallback),
                          ClaimSizer.at_start(settings.max_payload_bytes))
            self._local.resources = r
            with self._lock:
                self._made.append(r)
        return r

    def holder(self) -> Holder:
        """This process as a holder; its heartbeat starts on first use (in each process)."""
        with self._lock:
            beat = self._heartbeat
            if beat is None or beat.holder.pid != os.getpid():
                settings, options, _, _ = self._config()
                beat = Heartbeat(OutboxStore.from_settings(settings), new_holder(), options.holder_timeout_s,
                                 self._on_takeover, self._log)
                self._heartbeat = beat
                beat.start()
            return beat.holder

    def start(self) -> None:
        """Start this process's heartbeat now rather than at its first task (a worker
        process that has just started), so it may take lost processes over sooner."""
        try:
            self.holder()
        except Exception as exc:  # noqa: BLE001 - never keep a worker from starting over this: the first task retries
            self._log.warning("outbox: heartbeat not started (%s: %s)", type(exc).__name__, exc)

    def shared(self) -> Shared:
        """This process's breaker, coalescer, route gate and outage logs."""
        with self._lock:
            if self._shared is None or self._shared.pid != os.getpid():
                settings, options, url, claim_key = self._config()
                key = breaker_key(settings.outbox_namespace, settings.publish_url, settings.exchange)
                self._shared = Shared(os.getpid(), make_breaker(url, key),
                                      make_coalescer(url, claim_key, options.claim_request_ttl_s),
                                      make_route_gate(url, key),
                                      {which: make_relay_outage(which, settings, options, url, self._log)
                                       for which in RELAY_OUTAGES})
            return self._shared

    def outage(self, which: str) -> Outage:
        return self.shared().outage(which)

    def close(self) -> None:
        """Close what this process made (every thread's connections) and forget it all."""
        with self._lock:
            mine = [r for r in self._made if r.pid == os.getpid()]
            self._made.clear()
            self._shared = None
            self._local = threading.local()
            beat, self._heartbeat = self._heartbeat, None
        if beat is not None and beat.holder.pid == os.getpid():
            beat.stop()  # a graceful exit: the record goes, nothing is left to take over
        for r in mine:
            for closable in (r.publisher, r.store):
                try:
                    closable.close()
                except Exception:  # noqa: BLE001 - closing after a failure may fail again
                    self._log.debug("outbox: error closing %r", closable, exc_info=True)

    def forget(self) -> None:
        """In a forked child: stop using what was inherited, without closing it (it is the parent's).
        The lock is a new one: a thread of the parent may have held it as it forked."""
        self._lock = threading.Lock()
        with self._lock:
            self._inherited.extend(self._made)
            self._made.clear()
            self._shared = None
            self._local = threading.local()
            if self._heartbeat is not None:  # the parent's: its thread did not come over the fork
                self._inherited_beats.append(self._heartbeat)
            self._heartbeat = None


def missing_library(settings: Settings) -> str | None:
    """What a relay worker cannot run without and lacks, naming the extra to install: its
    database's driver, or confluent-kafka for a ``kafka://`` destination. Both runners check it
    as a worker starts (docs/relay.md, "Configuration checks")."""
    from ..publisher.kafka import client_problem as kafka_client_problem  # a worker's start only

    return driver_problem(settings.database_url) or kafka_client_problem(settings.publish_url)


__all__ = ["ResourceHolder", "Resources", "Shared", "Config", "missing_library"]
