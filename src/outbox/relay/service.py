"""One relay per worker process, under either task runner: ``Relay`` is built from the relay's
settings and options, the process's ``Runner`` (``relay.runner``) and its hooks (``relay.hooks``),
owns what the process holds (``relay.resources``: each thread's store, publisher, settler and claim
sizer; the process's breaker, claim coalescer, route gate, outage logs and heartbeat), hands them to
the relay's logic as one ``RelayContext`` and runs the relay tasks' bodies over them.
The task and actor modules (``outbox.celery.tasks``, ``outbox.dramatiq``) are one-line calls into it
(docs/internals.md, "Worker processes")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from ..core.config import RelayOptions, Settings
from ..core.model import OutboxMessage, message_from_dict, message_to_dict
from ..core.names import ACK_TASK, CLAIM_TASK, FAIL_TASK, PUBLISH_TASK, RELEASE_TASK
from ..publisher import Publisher
from ..publisher.apart import MIN_WAIT_S, ApartPublisher, start_server
from .claim import tried_twice
from .context import RelayContext
from .drain import DRAIN_SLICE_S, Backlog, ClaimAhead, Drain, after_publish, drain_slice
from .foreign import ForeignTasks
from .hooks import RelayHooks
from .publish import ChainOutcome, handle_publish, still_held_when_reachable
from .resources import ResourceHolder, Resources, Shared
from .runner import Runner
from .settle import SettleFailed, apply_fallback, purge_budget, purge_expired
from .shared import RUNNER_BROKER, Breaker, LateClaims, Outage

#: The settling task that takes over a store write a publish could not make.
FALLBACK_TASKS = {"done": ACK_TASK, "failed": FAIL_TASK, "release": RELEASE_TASK}

#: After a claim request failed, this process sends none for this long (``Relay.request_claim``).
CLAIM_REQUEST_PAUSE_S = 5.0


class Relay:
    """The relay of one worker process: its collaborators, made on first use (per thread where a
    connection is involved, afresh in a forked child) and closed together, and the bodies of the
    claim, publish, settling and purge tasks."""

    def __init__(self, settings: Settings, options: RelayOptions, runner: Runner, logger: logging.Logger,
                 hooks: RelayHooks | None = None) -> None:
        self.settings = settings
        self.options = options
        self.runner = runner
        self.log = logger
        #: What the relay reports (``relay.hooks``): the runners install ``PrometheusHooks``
        #: when metrics are on.
        self.hooks = hooks if hooks is not None else RelayHooks()
        self.lease_s = settings.claim_timeout_ms / 1000.0
        #: The part of a lease a publish may use (``OUTBOX_RELAY_LEASE_SAFETY``).
        self.safe_lease_s = self.lease_s * options.lease_safety
        #: Did this process's last claim meet a backlog (``relay.drain.Backlog``)?
        self.backlog = Backlog()
        #: Tasks naming another outbox that reached this process (``relay.foreign``).
        self.foreign = ForeignTasks(logger)
        # After a lost worker's rows were taken over, claim soon.
        self.held = ResourceHolder(self._config, self._fallback, logger, on_takeover=self.request_claim)
        #: Where a drain slice's next claim runs while it publishes (``relay.drain.ClaimAhead``).
        self.ahead = ClaimAhead(lambda: self.resources().store)
        #: No claim request before this (``time.monotonic()``): the last one failed.
        self.requests_paused_until = 0.0
        #: Claims dropped for arriving after their expiry (``relay.shared.LateClaims``).
        self.late_claims = LateClaims(logger, settings.claim_interval_s)

    # -- what the process holds -------------------------------------------------------------

    def _config(self) -> tuple[Settings, RelayOptions, str, str]:
        return self.settings, self.options, self.runner.broker_url, self.runner.claim_key

    def resources(self) -> Resources:
        """This thread's store, publisher, settler and claim sizer."""
        return self.held.resources()

    def shared(self) -> Shared:
        """This process's breaker, claim coalescer, route gate and outage logs."""
        return self.held.shared()

    def context(self) -> RelayContext:
        """This thread's collaborators as one argument for the relay's logic: the thread's
        store, publisher, settler and sizer, the process's breaker, route gate and the
        destination broker's outage log, the runner's stopping flag and the hooks."""
        r, s = self.resources(), self.shared()
        return RelayContext(r.store, r.publisher, self.options, r.settler, s.breaker, s.routes,
                            s.outage("destination broker"), r.sizer, self.stopping, hooks=self.hooks,
                            publish_budget_s=self.safe_lease_s, apart=self.claim_copies_publisher)

    def breaker(self) -> Breaker:
        return self.shared().breaker

    def outage(self, which: str) -> Outage:
        """The outage log of ``which`` ("database" or "destination broker")."""
        return self.shared().outage(which)

    def stopping(self) -> bool:
        return self.runner.stopping()

    def start(self) -> None:
        """A worker process starts: its liveness record now (docs/internals.md, "Lost workers")."""
        self.held.start()

    def forget(self) -> None:
        """In a forked child: stop using what was inherited, without closing it (it is the parent's)."""
        self.held.forget()

    def close(self) -> None:
        self.ahead.close()  # its threads' stores are closed with the others'
        self.held.close()

    def lift_fatal_pause(self) -> None:
        """A restarted worker lifts a fatal pause: the operator has presumably fixed the
        configuration, and if not, the first chain trips it again."""
        try:
            breaker = self.breaker()
            if breaker.open_for() > 0 and breaker.fatal:
                self.log.warning("outbox: lifting the fatal pause left by an earlier run (%s)", breaker.reason)
                breaker.reset()
        except Exception as exc:  # noqa: BLE001 - never keep a worker from starting over this
            self.log.warning("outbox: cannot check the circuit breaker at start-up: %s", exc)

    # -- sending through the runner ---------------------------------------------------------

    def _fallback(self, operation: str, kwargs: dict[str, Any]) -> None:
        self.runner.send(FALLBACK_TASKS[operation], kwargs)

    def _dispatch(self, chains: list[list[Any]], deadline: float) -> None:
        self.runner.send(PUBLISH_TASK, {"chains": [[message_to_dict(m) for m in chain] for chain in chains],
                                        "deadline": deadline})

    def request_claim(self) -> bool:
        """Ask for a claim soon, coalesced: while one requested claim has not started yet,
        further requests are no-ops. The one "claim soon" of a worker process: drain mode,
        a takeover, notifications and post-commit wake-ups made in a worker use it. One that
        cannot reach the runner's broker is that broker's outage in the log, and none is
        sent for ``CLAIM_REQUEST_PAUSE_S`` after it (docs/relay.md, "Outages in the log")."""
        if self.stopping() or time.monotonic() < self.requests_paused_until:
            return False
        shared = self.shared()
        gate, outage = shared.coalescer, shared.outage(RUNNER_BROKER)
        try:
            if not gate.acquire(strict=True):
                return False
        except Exception as exc:  # noqa: BLE001 - the token's store is the runner's broker: the send would fail too
            return self._request_failed(outage, exc)
        try:
            self.runner.send(CLAIM_TASK, {"requested": True}, expires_s=self.options.claim_request_ttl_s)
        except Exception as exc:  # noqa: BLE001 - a claim request is best effort
            gate.clear()
            return self._request_failed(outage, exc)
        outage.ok()
        return True

    def _request_failed(self, outage: Outage, exc: BaseException) -> bool:
        self.requests_paused_until = time.monotonic() + CLAIM_REQUEST_PAUSE_S
        outage.failed(exc)
        return False

    # -- the tasks' bodies -------------------------------------------------------------------

    def claim(self, requested: bool = False, token: str | None = None, *, expired: bool = False,
              late_s: float = 0.0, in_main: bool = False,
              follow_up: Callable[[], object] | None = None) -> dict[str, Any]:
        """Claim a batch and dispatch it as publish tasks, in drain slices (``relay.drain``):
        a full claim and every finished publish request the next, coalesced; a claim that finds
        the publish queue full claims nothing; beat's tick is the safety net. ``requested``: it
        held the claim-request token, cleared as it starts; ``expired``: it came too late (by
        ``late_s``) and only clears its token (``late_claims``); ``in_main``: the Celery worker's
        in-process claim, which has no expiry, and ``follow_up`` its own next run (``Drain``)."""
        if requested:
            self.shared().coalescer.clear()
        if token:  # a post-commit wake-up of an earlier version (outbox.wake)
            self.runner.clear_token(token)
        if expired:
            self.log.debug("outbox: dropped a claim that arrived %.1f s after it expired", late_s)
            self.late_claims.dropped(late_s)
            return {"expired": True}
        if not in_main:
            self.late_claims.in_time()
        if self.stopping():
            return {"stopped": True}
        drain = Drain(self._dispatch, self.publish_here, self.request_claim, self.outage("database"), self.backlog,
                      self.runner.queued_publish_tasks, self.ahead, follow_up)
        outcome = drain_slice(self.context(), drain, batch_size=self.settings.batch_size, lease_s=self.lease_s,
                              in_main=in_main, slice_s=DRAIN_SLICE_S)
        if outcome is None:  # the database is down or refusing: the error is in the outage's log lines, once
            return {"database_unavailable": True}
        return asdict(outcome)

    def publish_here(self, chains: Sequence[Sequence[OutboxMessage]], deadline: float | None,
                     publisher: Publisher | None = None) -> list[ChainOutcome]:
        """Publish chains from this process: the publish task's work, and a claim's own share;
        through ``publisher`` instead of the thread's when given."""
        context = self.context()
        if publisher is not None:
            context = replace(context, publisher=publisher)
        return handle_publish(context, chains, deadline=deadline)

    def publish(self, chains: list[list[dict[str, Any]]], deadline: float | None = None,
                check_own: bool = True, suspects_apart: bool = False) -> dict[str, Any]:
        """A publish task: the chains whose rows the lease still holds (rows another process
        claimed are adopted; this process's own are checked when ``check_own``: docs/internals.md,
        "Lost workers"), published here; then a claim soon (their aggregates may have more rows).
        ``suspects_apart``: a task carrying a row tried twice (sent alone: ``relay.claim.tried_twice``)
        is published by a child process of its own, so that a row that kills its publisher
        kills the child alone; for Dramatiq, whose threads share a process (docs/relay.md, "An
        event that kills its worker")."""
        messages = [[message_from_dict(d) for d in chain] for chain in chains]
        apart = suspects_apart and any(tried_twice(m) for chain in messages for m in chain)
        if apart:  # before the lease is renewed: the fork server's start is not taken from it
            start_server()
        # Its own lease renewed too: the child's start is not taken from what the claim left it.
        held = still_held_when_reachable(self.resources().store, messages, deadline=deadline, check_own=check_own,
                                         renew=apart, stopping=self.stopping, failed=self.outage("database").failed)
        if held.renewed:  # adopted: the lease started again now (publish.Held)
            deadline = time.time() + self.safe_lease_s
        outcomes = self.publish_here(held.chains, deadline, self.apart_publisher(deadline) if apart else None)
        after_publish(self.breaker(), self.request_claim)
        return {"published": sum(len(o.published) for o in outcomes),
                "failed": [o.failed_id for o in outcomes if o.failed_id is not None]}

    def apart_publisher(self, deadline: float | None) -> ApartPublisher:
        """A publisher that publishes each call from a child process of its own, waiting for it
        as long as a publish may wait for its broker (the lease's safe part), and not past
        ``deadline``, after which another claim may take the rows. Its child is given a little
        less, so that its own answer comes first (``ApartPublisher.publish_chains``)."""
        wait = self.safe_lease_s
        if deadline is not None:
            wait = max(MIN_WAIT_S, min(wait, deadline - time.time()))
        fallback = self.resources().publisher
        assert fallback is not None  # a relay that publishes has a publisher
        return ApartPublisher(self.settings, wait, fallback, max_message_bytes=self.options.max_message_bytes)

    def claim_copies_publisher(self, deadline: float | None) -> ApartPublisher:
        """``apart_publisher(deadline)`` for a claim's dead-letter copies, which share its wait:
        each copy had it whole, so a dead-letter broker that hangs held the claim that long
        once per dead row, past its time limit (found in review). Once it has passed, the
        copies left are not sent, each logged; the rows stay dead in the table."""
        apart = self.apart_publisher(deadline)
        apart.copies_by = time.monotonic() + apart.timeout_s
        return apart

    def settle(self, operation: str, **kwargs: Any) -> Any:
        """An ack, fail or release task: the store write a publish could not make
        (``relay.settle.apply_fallback``); raises on failure, so the task retries. A database
        that is down or refusing is the database outage's (one WARNING for all of it, the
        retries at DEBUG) and raises ``SettleFailed``, which a runner retries without logging
        an error: Dramatiq logged every try as an ERROR with a traceback (found by
        ``bench.soak --faults``)."""
        r = self.resources()
        outage = self.outage("database")
        # A dead mark's copy from a child process, as a claim's (docs/relay.md, "An event that
        # kills its worker"): the row's publish may have killed its publisher.
        dead_letters = self.apart_publisher(None) if operation == "failed" and r.publisher is not None else None
        try:
            applied = apply_fallback(r.store, dead_letters, operation, kwargs, self.hooks).applied
        except Exception as exc:
            engine = r.store.engine
            if not (engine.is_transient(exc) or engine.is_disconnect(exc)):
                raise
            outage.failed(exc)
            raise SettleFailed(exc) from exc
        outage.ok()
        return applied

    def purge(self) -> int:
        return purge_expired(self.resources().store, self.settings.retention_days, self.outage("database"),
                             self.log, budget_s=purge_budget(self.options.purge_interval_s), stopping=self.stopping)


__all__ = ["Relay", "FALLBACK_TASKS", "CLAIM_REQUEST_PAUSE_S"]
