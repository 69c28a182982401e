"""Lost workers: each relay worker process's liveness record (its *holder*) and the heartbeat
that keeps it fresh and takes over the rows of holders gone silent. Why, and what a crash
costs: docs/internals.md, "Lost workers"."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from ..core.handoff import main_thread_signals
from ..core.model import Holder, SilentHolder
from ..storage.store import OutboxStore

log = logging.getLogger("outbox.relay")


def new_holder(pid: int | None = None) -> Holder:
    """This process as a holder: a fresh id of 16 hex characters, the host name and the pid."""
    return Holder(secrets.token_hex(8), socket.gethostname()[:255] or "?", pid or os.getpid())


class Heartbeat:
    """Every ``timeout_s / 3`` seconds, one short transaction on a connection of its own
    (``OutboxStore.beat``): refresh this holder's ``beat_at`` and list the holders silent for
    longer than ``timeout_s``; then take each over (``OutboxStore.take_over``) and, when rows
    came back, call ``on_takeover`` (a coalesced claim request) so they move at once.

    Guard against false deaths: this process takes nothing over unless its own beats have
    succeeded, each landing within ``timeout_s`` of the one before, for longer than ``timeout_s``.
    After a database outage (or a stall that held every beat up) nobody takes over until
    every live holder has had time to beat again. And a holder is taken over only when it has
    been silent for longer than ``timeout_s`` plus the most this process's own beats landed
    late within the last ``timeout_s`` (``slack_s``): a stall shorter than the timeout held
    the others' beats up as long (docs/internals.md, "Lost workers", the guard).

    ``tick(now)`` is one round, callable without the thread (the tests drive it)."""

    def __init__(self, store: OutboxStore, holder: Holder, timeout_s: float,
                 on_takeover: Callable[[], object] = lambda: None, logger: logging.Logger | None = None) -> None:
        self.store = store
        self.holder = holder
        self.timeout_s = timeout_s
        self.interval_s = timeout_s / 3
        self.on_takeover = on_takeover
        self.log = logger or log
        #: Monotonic time since which every beat succeeded in time; None after a failure.
        self.healthy_since: float | None = None
        self.last_beat: float | None = None
        self.beats = 0
        self.missing_table = False
        #: A beat failed for a reason no retry mends (not an outage, not a missing table),
        #: said once at WARNING until a beat works again.
        self.refused = False
        #: (landed, how late) of this process's beats that landed late, the last ``timeout_s``'s.
        self._late: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def timeout_ms(self) -> int:
        return int(self.timeout_s * 1000)

    # -- one round -------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> int:
        """Beat once; take over the silent holders if this process may. Returns the rows
        taken over."""
        now = time.monotonic() if now is None else now
        began = time.monotonic()
        try:
            beat = self.store.beat(self.holder, self.timeout_ms)
        except Exception as exc:  # noqa: BLE001 - the database's outage is logged by the relay's tasks
            self.healthy_since = None
            engine = self.store.engine
            if engine.is_missing_table(exc):
                if not self.missing_table:
                    self.log.warning(self._missing_table_line())
                self.missing_table = True
            elif not (engine.is_transient(exc) or engine.is_disconnect(exc)):
                # Not an outage, which the relay's tasks log, and no retry mends it: a permission
                # the relay's login lacks on the holders table, most likely (docs/sqlserver.md,
                # "Permissions", listed only the outbox table: found in review). Said once.
                if not self.refused:
                    self.log.warning("outbox: the heartbeat of this worker process (holder %s) fails: %s: %s. "
                                     "Lost worker processes are noticed only when their lease "
                                     "(OUTBOX_CLAIM_TIMEOUT_MS) expires until it works: the relay's login needs "
                                     "SELECT, INSERT, UPDATE and DELETE on %s as on %s (a permission missing?)",
                                     self.holder.holder_id, type(exc).__name__, " ".join(str(exc).split())[:300],
                                     engine.holders, engine.table)
                self.refused = True
            else:
                self.log.debug("outbox heartbeat of holder %s failed: %s: %s", self.holder.holder_id,
                               type(exc).__name__, exc)
            return 0
        if self.missing_table:
            self.log.info("outbox: table %s is there now; lost worker processes are taken over", self.store.engine.holders)
            self.missing_table = False
        if self.refused:
            self.log.info("outbox: the heartbeat of holder %s works again; lost worker processes are taken over",
                          self.holder.holder_id)
            self.refused = False
        try:  # the rows of a claim or adoption whose answer was lost, in a process that may never claim
            self.store.release_doubtful()
        except Exception as exc:  # noqa: BLE001 - they stay doubtful, for the next beat or claim
            self.log.debug("outbox heartbeat cannot release doubtful leases: %s: %s", type(exc).__name__, exc)
        # When this beat landed: a beat held up by a stall of the database (or of this host)
        # and then done is a gap as much as a beat that failed, and the others' beats were
        # held up too (measured from the start of the beat, the first beat back took every
        # process still a moment behind over: found in review).
        ended = now + (time.monotonic() - began)
        if self.healthy_since is None or self.last_beat is None or ended - self.last_beat > self.timeout_s:
            self.healthy_since = ended  # the first beat, or one after a gap: start counting again
        self._note_lateness(ended)
        self.last_beat = ended
        if beat.recreated and self.beats:
            self.log.warning("outbox: this worker process (holder %s, pid %d) was silent for longer than "
                             "OUTBOX_RELAY_HOLDER_TIMEOUT_S=%g and was presumed lost; rows it held were taken over, "
                             "and its late writes to them are refused", self.holder.holder_id, self.holder.pid,
                             self.timeout_s)
        self.beats += 1
        if not beat.silent or ended - self.healthy_since <= self.timeout_s:
            return 0
        slack_s = self.slack_s
        return sum(self._take_over(silent, slack_s) for silent in beat.silent
                   if silent.silent_s > self.timeout_s + slack_s)

    def _note_lateness(self, ended: float) -> None:
        """Remember how late this beat landed (after its interval since the last), for ``slack_s``."""
        late = 0.0 if self.last_beat is None else ended - self.last_beat - self.interval_s
        self._late = [(at, s) for at, s in self._late if ended - at <= self.timeout_s]
        if late > 0:
            self._late.append((ended, late))

    @property
    def slack_s(self) -> float:
        """The most this process's beats landed late within the last ``timeout_s``: a stall that
        held them up held the others' as long (docs/internals.md, "Lost workers", the guard)."""
        return max((late for _, late in self._late), default=0.0)

    def _missing_table_line(self) -> str:
        """The holders table is missing: an upgrade without ``outbox migrate`` (the relay works,
        lost workers are noticed late), or no table at all (a worker whose OUTBOX_TABLE names
        none, not migrated yet or misspelt). The second was told as the first, and was the
        first line a worker logged about it."""
        engine = self.store.engine
        try:
            unmigrated = self.store.schema_state() is None
        except Exception as exc:  # noqa: BLE001 - the connection failed right then: say the likelier case
            self.log.debug("outbox heartbeat cannot read the schema: %s: %s", type(exc).__name__, exc)
            unmigrated = False
        if unmigrated:
            return (f"outbox: {engine.missing_table_hint()}, with this worker's settings (OUTBOX_DATABASE_URL, "
                    f"OUTBOX_TABLE, OUTBOX_SCHEMA); nothing is relayed until then ({engine.holders} is missing too)")
        return (f"outbox: table {engine.holders} is missing: lost worker processes are noticed only when their "
                "lease (OUTBOX_CLAIM_TIMEOUT_MS) expires. Run `outbox migrate` to create it")

    def _take_over(self, silent: SilentHolder, slack_s: float = 0.0) -> int:
        try:
            done = self.store.take_over(silent, self.timeout_ms + int(slack_s * 1000))
        except Exception as exc:  # noqa: BLE001 - the next beat tries again
            self.log.debug("outbox: cannot take over holder %s: %s: %s", silent.holder.holder_id,
                           type(exc).__name__, exc)
            return 0
        if done is None:  # another process did, or it beat again
            return 0
        h = silent.holder
        if not done.rows:
            self.log.info("outbox: worker process lost (holder %s, host %s, pid %d, silent for %.1f s); it held no "
                          "rows", h.holder_id, h.host, h.pid, silent.silent_s)
            return 0
        self.log.warning("outbox: took over %d rows of a lost worker process (holder %s, host %s, pid %d): silent "
                         "for %.1f s, rows held for %.1f s; claimable again now, an attempt counted",
                         done.rows, h.holder_id, h.host, h.pid, silent.silent_s, done.held_s)
        try:
            self.on_takeover()
        except Exception as exc:  # noqa: BLE001 - beat's next tick claims them anyway
            self.log.debug("outbox: claim request after a takeover failed: %s", exc)
        return done.rows

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-heartbeat", daemon=True)
            with main_thread_signals():  # it runs in every pool process
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # one bad round must not end the heartbeat for good
                self.log.warning("outbox heartbeat of holder %s failed; it beats again", self.holder.holder_id,
                                 exc_info=True)
                self.healthy_since = None
            # A deployment not migrated yet: look again now and then, not every second.
            if self._stop.wait(30.0 if self.missing_table else self.interval_s):
                break
        self._finish()

    def stop(self, drop: bool = True) -> None:
        """Stop beating and, with ``drop``, delete this holder's record (a graceful exit:
        nothing left to take over) unless rows are still leased to it; the heartbeat's
        connection is closed."""
        self._drop = drop
        self._stop.set()
        thread = self._thread
        if thread is None:
            self._finish()
        elif thread is not threading.current_thread():
            thread.join(timeout=5.0)

    _drop = True

    def _finish(self) -> None:
        """In the heartbeat's thread (its connection is that thread's): the record, then the connection."""
        if self._drop and self.beats:
            try:
                held = self.store.drop_holder(self.holder.holder_id)
            except Exception as exc:  # noqa: BLE001 - then it is taken over, holding nothing
                self.log.debug("outbox: cannot delete holder %s: %s", self.holder.holder_id, exc)
            else:
                if held:
                    self.log.info("outbox: this worker process exits with %d rows still leased to it (a task still "
                                  "running); another takes them over once it has been silent for "
                                  "OUTBOX_RELAY_HOLDER_TIMEOUT_S=%g", held, self.timeout_s)
        self.store.close()


__all__ = ["Heartbeat", "new_holder"]
