"""``OutboxStore``: the one store contract the relay talks to, whatever the engine.

The store runs every operation as its own short transaction on its own connections,
retrying transient failures (deadlock victim, lock timeout, dropped connection): the
lifecycle of ``outbox.storage.connections``. Everything engine-specific lives in
``outbox.storage.engines``; nothing here branches on the engine.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

from ..core.config import Settings, get_settings
from ..core.errors import StoreError
from ..core.model import (
    Beat,
    Claim,
    DeadRow,
    FailResult,
    FenceResult,
    Holder,
    OutboxMessage,
    RequeueResult,
    SilentHolder,
    Stats,
    Status,
    Takeover,
)
from ..core.redact import redact
from ..domain.events import MAX_ERROR_UNITS, fit_utf16
from .connections import CallerTransactions, Connections
from .engines import Engine, engine_for_url
from .engines.base import (
    ERROR_KIND_PREFIXES,
    PERMANENT_ERROR_PREFIXES,
    UNDECODABLE_PREFIX,
    IndexDiffers,
    is_permanent_error,
)
from .engines.describe import index_differs, index_shapes

log = logging.getLogger("outbox.storage.store")
T = TypeVar("T")

#: Attempts for one operation when the database reports a transient error.
TRANSIENT_RETRIES = 5
#: Dead rows requeued per short transaction by ``requeue(None)`` / ``requeue_dead(None)``.
REQUEUE_CHUNK = 1000


class MigrationReport:
    """What ``apply_migration`` reads for ``OutboxStore.migrate_reporting`` under the migration's
    lock: ``read(cursor)`` (the table's ``schema_state``) before its first step and after its
    last, and how long the lock made it wait (None: the engine's lock does not say)."""

    def __init__(self, read: Callable[[Any], Any]) -> None:
        self.read = read
        self.before: Any = None
        self.after: Any = None
        self.waited_s: float | None = None


def apply_migration(engine: Engine, cursor: Any, *, native_json: bool = False, steps: list[Any] | None = None,
                    report: MigrationReport | None = None) -> int:
    """Run the engine's guarded migration steps on ``cursor``: ``OutboxStore.migrate``, the
    Django app's migration (on Django's own connection) and Alembic's create the same schema.
    What the steps may use is read from ``cursor``'s own connection first. Returns how many
    guarded steps ran (their probe found the change not yet made). The steps wait for a
    table's lock no longer than the engine's DDL bound on every path, Django's and Alembic's
    connections too (``Engine.ddl_bounds``: SQL Server's session LOCK_TIMEOUT, found in review).
    ``steps``: these instead of ``engine.migration()`` (the first part of ``Engine.online_migration``).
    ``report``: filled under the lock (``MigrationReport``), so that of two runs at once the one
    that waited reports what it did, not what the other did (README, "The table")."""
    engine.read_server(cursor)
    waited = engine.lock_migration(cursor)  # one migration of the table at a time (Engine.lock_migration)
    ran = 0
    try:
        with engine.ddl_bounds(cursor):
            todo = list(engine.migration(native_json=native_json) if steps is None else steps)
            locked_at = 1 if engine.migration_lock_step else 0  # the step after which the lock is held
            for index, step in enumerate(todo):
                if report is not None and index == locked_at:
                    report.before, report.waited_s = report.read(cursor), waited
                if isinstance(step, tuple):
                    probe, step = step
                    if isinstance(probe, IndexDiffers):  # built again where `outbox check` would fail it
                        if not index_differs(engine, cursor, probe.name):
                            continue
                    elif engine.execute(cursor, *probe).fetchone() is not None:
                        continue
                    ran += 1
                engine.execute(cursor, step)
                if report is not None and index == len(todo) - 1 - int(engine.migration_lock_step):
                    report.after = report.read(cursor)  # before the last step's unlock, if it has one
    except BaseException as exc:
        try:
            engine.unlock_migration(cursor)
        except Exception:  # the connection may be gone; the original error tells why
            log.debug("outbox: cannot unlock the migration", exc_info=True)
        hint = _migration_error_hint(engine, cursor, exc) if isinstance(exc, Exception) else None
        if hint is not None:
            raise StoreError(hint) from exc
        raise
    engine.unlock_migration(cursor)
    return ran


def _migration_error_hint(engine: Engine, cursor: Any, exc: Exception) -> str | None:
    """``Engine.migration_error_hint``, or None when asking fails: the original error then says
    what it can."""
    try:
        return engine.migration_error_hint(cursor, exc)
    except Exception:  # explaining must never hide the migration's own error
        log.debug("outbox: cannot explain the migration's error", exc_info=True)
        return None


def apply_online_migration(engine: Engine, cursor: Any, indexes: list[list[Any]]) -> int:
    """Run the second part of ``Engine.online_migration`` on ``cursor``, whose connection is in
    autocommit (no transaction open: ``CREATE INDEX CONCURRENTLY`` refuses to run in one) and
    holds the migration's lock (``online_migration_lock``). Each step runs when its probe finds
    no row. Returns how many indexes it built (docs/internals.md, "Index builds that hold no
    writer back")."""
    built = 0
    with engine.online_build_bounds(cursor):
        for steps in indexes:
            ran = False
            for (probe, params), step in steps:
                if engine.execute(cursor, probe, params).fetchone() is None:
                    engine.execute(cursor, step)
                    ran = True
            built += ran
    return built


@contextmanager
def online_migration_lock(engine: Engine, outside: Callable[[], AbstractContextManager[Any]]) -> Iterator[float]:
    """The migration's lock held by the session for the block (``Engine.lock_online_migration``),
    taken and given back with a cursor of ``outside()``, outside any transaction. Yields the
    seconds it waited for another migration of the table."""
    with outside() as cursor:
        waited = engine.lock_online_migration(cursor)
    try:
        yield waited
    finally:
        try:
            with outside() as cursor:
                engine.unlock_online_migration(cursor)
        except Exception:  # the connection may be gone (the lock with it); the original error tells why
            log.debug("outbox: cannot unlock the migration", exc_info=True)


def migration_lock_refusal(engine: Engine, connections: Connections, tables: Sequence[str],
                           online: bool = False) -> StoreError:
    """The error of a migration whose DDL step gave up waiting for a lock on ``tables``
    (qualified names, the main one first): who holds them and what to do. It is not tried again: while it
    waits, every enqueue and claim waits behind it (README, "The table"). ``online``: a step of
    ``Engine.online_migration``'s second part, which no enqueue or claim waits for; its
    interrupted build is repaired by the next run."""
    try:
        holders = connections.run("migrate", lambda cursor: engine.lock_holders(cursor, tables), attempts=1)
    except Exception:  # the refusal is said whoever holds the table
        log.debug("outbox: cannot read who holds %s", ", ".join(tables), exc_info=True)
        holders = None
    return StoreError(
        f"outbox migrate gave up after waiting {engine.migration_lock_bound()} for a lock on {tables[0]} "
        f"({'building an index; no enqueue or claim waited' if online else 'every enqueue and claim waits while it does'}"
        "), held by "
        f"{holders or 'a transaction still open (the database does not say which to this login)'}: "
        "commit or end that transaction, then run outbox migrate again")


#: Leases that a claim or an adoption may have written although it failed (a COMMIT whose
#: answer was lost, and its retries spent), per database URL and table. Shared by every store
#: of the process: the next claim of any of them, or the heartbeat, releases their rows
#: (``OutboxStore.release_doubtful``; docs/relay.md, "A network cut"). Per store, a lease
#: doubted by a publish-only worker's adoption or by the claim-ahead thread's store was
#: released by nothing but that store's next claim, which might never come (found in review).
_DOUBTFUL: dict[tuple[str, str], list[str]] = {}
_DOUBTFUL_LOCK = threading.Lock()


def _masked_reason(error: str) -> str:
    """``error`` with its passwords masked, its kind (``engines.base.ERROR_KIND_PREFIXES``) kept as written."""
    kind = next((prefix for prefix in ERROR_KIND_PREFIXES if error.startswith(prefix)), "")
    return kind + redact(error[len(kind):])


@dataclass(frozen=True)
class Migration:
    """What ``OutboxStore.migrate_reporting`` did: the guarded steps that ran, the table's
    ``schema_state`` before and after (None before: no table), and the seconds it waited for
    another migration of the table to finish (None: the engine's lock does not say)."""

    ran: int
    before: tuple[frozenset[Any], ...] | None
    after: tuple[frozenset[Any], ...] | None
    waited_s: float | None


class OutboxStore:
    def __init__(self, url: str, *, table: str = "outbox", schema: str | None = None,
                 claim_timeout_ms: int = 60_000, max_attempts: int = 10,
                 archive_uri: str | None = None, engine: Engine | None = None,
                 connections: Connections | None = None, existing: bool = False) -> None:
        """``existing``: the database must exist already, a SQLite file is not made (the relay,
        the commands, the jobs: ``migrate`` alone makes it; ``Engine.creates_database``, README,
        "Install")."""
        self.url = url
        #: OUTBOX_ARCHIVE_URI: while archiving is configured, ``purge_done`` leaves
        #: deleting to the archive job (which deletes only what it archived).
        self.archive_uri = archive_uri
        self.engine: Engine = engine or engine_for_url(url, table=table, schema=schema)
        if existing:
            self.engine.creates_database = False
        self.claim_timeout_ms = claim_timeout_ms
        self.max_attempts = max_attempts
        #: The relay worker process this store leases for (``relay.holders``): its id is the
        #: first half of every lease token the store makes, so the rows say which process
        #: holds them. None: tokens are random (docs/internals.md, "Lost workers").
        self.holder_id: str | None = None
        self._connections = connections or Connections(self.engine, url)
        #: This database table's doubtful leases in this process (``_DOUBTFUL``).
        self._doubtful_key = (url, self.engine.table)

    @classmethod
    def on_caller(cls, engine: Engine, begin: Callable[[], AbstractContextManager[Any]]) -> OutboxStore:
        """The store's calls on a caller's transactions instead of connections of its own:
        ``begin()`` opens one and yields a cursor in it (the Django admin's requeue,
        ``contrib.django.schema.store_on``), so the caller gets the same rules as the
        command line from the same code. Nothing is retried there (``CallerTransactions``)."""
        return cls(f"{engine.name}://(the caller's connection)", engine=engine,
                   connections=CallerTransactions(engine, begin))

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> OutboxStore:
        s = settings or get_settings()
        return cls(s.database_url, table=s.table, schema=s.schema, claim_timeout_ms=s.claim_timeout_ms,
                   max_attempts=s.max_attempts, archive_uri=s.archive_uri, existing=True)

    def __repr__(self) -> str:
        return f"OutboxStore({self.engine.name}, table={self.engine.table})"

    # -- connections (storage.connections: one per thread and process, short transactions,
    # transient retries, dropped on disconnect) -------------------------------------------
    def connection(self) -> Any:
        """This thread's connection, opened on first use and after a fork."""
        return self._connections.get()

    def close(self) -> None:
        self._connections.drop()

    def connect_failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the error of this store's last attempt to connect (not of a
        statement on a connection it had)."""
        return self._connections.connect_error is exc

    def commit_without_waiting(self) -> bool:
        """From now on, each connection this store opens commits without waiting for the
        disk, where the engine can (``Engine.async_commit_sql``): the relay's own writes,
        never an application's (docs/relay.md, "Commits that do not wait for the disk").
        Returns whether the engine can. Call it before the store's first connection."""
        sql = self.engine.async_commit_sql
        if sql is None:
            return False

        def relax(conn: Any) -> None:
            with self._connections.transaction_on(conn) as cursor:
                self.engine.execute(cursor, sql)
        self._connections.on_connect = relax
        return True

    def transaction(self, *, alone: bool = False) -> AbstractContextManager[Any]:
        """A cursor inside one short transaction (``Connections.transaction``)."""
        return self._connections.transaction(alone=alone)

    def _run(self, operation: str, work: Callable[[Any], T], *, alone: bool = False, ddl: bool = False) -> T:
        """Run ``work(cursor)`` in a transaction (``alone``, ``ddl``: see ``Connections.transaction``),
        retrying transient errors."""
        return self._connections.run(operation, work, attempts=TRANSIENT_RETRIES, alone=alone, ddl=ddl)

    # -- schema ----------------------------------------------------------------
    def migrate(self, native_json: bool = False) -> int:
        """Create or repair the table and its indexes. Safe to run any number of times.
        Returns how many guarded repair steps ran (``apply_migration``)."""
        return self._migrate(native_json, report=False).ran

    def migrate_reporting(self, native_json: bool = False) -> Migration:
        """``migrate``, with the table's ``schema_state`` before and after it and how long it
        waited for another migration of the table (``outbox migrate``'s report). The states
        are read under the migration's lock: the session's (PostgreSQL: ``Engine.online_migration``)
        or the transaction's (``MigrationReport``). Read before it, two runs at once both read
        the table before either changed it (or half-made), and both said they made what the
        first one had (README, "The table")."""
        return self._migrate(native_json, report=True)

    def _migrate(self, native_json: bool, *, report: bool) -> Migration:
        self.engine.creates_database = True  # the one call that may make a SQLite file
        online = self.engine.online_migration(native_json)
        try:
            if online is None:
                # The states read under the migration's lock (MigrationReport): read before it,
                # two runs at once on MariaDB said "created the table" and "repaired (added ...)".
                read = MigrationReport(self._schema_state_on) if report else None
                ran = self._run("migrate", lambda cursor: apply_migration(self.engine, cursor, native_json=native_json,
                                                                          report=read), ddl=True)
                return Migration(ran, read.before if read else None, read.after if read else None,
                                 read.waited_s if read else None)
            outside, building = self._connections.outside_transaction, False
            with online_migration_lock(self.engine, outside) as waited:
                before = self.schema_state() if report else None
                ran = self._run("migrate", lambda cursor: apply_migration(self.engine, cursor, steps=online[0]),
                                ddl=True)
                building = True
                with outside() as cursor:
                    ran += apply_online_migration(self.engine, cursor, online[1])
                return Migration(ran, before, self.schema_state() if report else None, waited)
        except Exception as exc:
            if self.engine.is_lock_timeout(exc):
                raise migration_lock_refusal(self.engine, self._connections, [self.engine.table, self.engine.holders],
                                             online=online is not None and building) from exc
            raise

    def unreadable(self) -> str | None:
        """Why the table, which exists, cannot be read, as `outbox check` and a failed command say
        it (``Engine.unreadable_table``: SQL Server's disabled clustered index, where "table missing"
        was said); None when the catalog says nothing stops a read, or cannot be read either."""
        try:
            with self.transaction() as cursor:
                return self.engine.unreadable_table(cursor)
        except Exception:  # noqa: BLE001 - the caller's own probe of the table says what it can
            return None

    def column_problem(self) -> str | None:
        """What is wrong with the table's columns that `outbox migrate` does not change itself
        (``Engine.column_problem``: MySQL/MariaDB columns the relay compares in a collation that
        is not binary), for migrate's report; `outbox check` fails on it."""
        with self.transaction() as cursor:
            return self.engine.column_problem(cursor)

    def schema_state(self) -> tuple[frozenset[Any], ...] | None:
        """The table's columns, its index names with the holders table's name when it exists,
        its storage parameters (``name=value``: PostgreSQL's) and its indexes' and constraints'
        definitions (``Engine.definitions``, else each index as ``outbox check`` reads it:
        ``describe.index_shapes``) and each index's state (``IndexShape.state``, a DISABLED or
        INVALID one's), or None when the table does not exist: what
        ``outbox migrate`` compares before and after to say what it changed (``schema_changes``;
        a holders table it made again, the autovacuum parameters it set, and the indexes it
        rebuilt on a table of the first release went unsaid: found in review)."""
        with self.transaction() as cursor:
            return self._schema_state_on(cursor)

    def _schema_state_on(self, cursor: Any) -> tuple[frozenset[Any], ...] | None:
        """``schema_state`` read on ``cursor``, in its transaction (``apply_migration``'s, under
        the migration's lock), which it leaves going (``Engine.table_exists``)."""
        e = self.engine
        if not e.table_exists(cursor, e.table):
            return None
        columns = e.table_columns(cursor)
        shapes = index_shapes(e, cursor)
        names = set(shapes)
        if e.table_exists(cursor, e.holders):
            names.add(e.holders_name)
        options, definitions = e.storage_options(cursor), e.definitions(cursor)
        # Each index the engine's catalog text does not give, as `outbox check` reads it
        # (describe.index_shapes): MySQL's and SQLite's rebuilds went unnamed, "repaired" alone.
        # Its state apart (IndexShape.state), so that one made usable in place is told from one
        # built again (schema_changes).
        defined = {name for name, _ in definitions}
        definitions |= frozenset((name, replace(shape, state=None).text()) for name, shape in shapes.items()
                                 if name not in defined)
        states = frozenset((name, shape.state) for name, shape in shapes.items() if shape.state)
        return columns, frozenset(names), options, definitions, states

    def schema_changes(self, before: tuple[frozenset[Any], ...], after: tuple[frozenset[Any], ...]) -> list[str]:
        """What ``outbox migrate`` changed between two ``schema_state``s, as the report names it:
        indexes (and constraints) renamed from an earlier release's names (``Engine.legacy_renames``),
        columns, indexes, constraints and the holders table added, indexes rebuilt under their
        name (with the state each was in: ``IndexShape.state``), indexes made usable in place
        (``Engine.usable_again``: MySQL's and MariaDB's flag, not rebuilt), storage parameters set."""
        (columns, names, options, defined, states), (columns_now, names_now, options_now, defined_now, states_now) = (
            before, after)
        definitions, definitions_now = dict(defined), dict(defined_now)
        known, known_now = names | definitions.keys(), names_now | definitions_now.keys()
        renamed = {old: new for old, new in self.engine.legacy_renames()
                   if old in known - known_now and new in known_now - known}
        added = sorted(columns_now - columns) + sorted(known_now - known - set(renamed.values()))
        # The indexes that were in a state the optimizer passes over (INVALID, DISABLED, IGNORED,
        # INVISIBLE) and are usable now: on PostgreSQL an INVALID one went unnamed, and
        # MariaDB's IGNORED one, whose flag alone was turned off, was said "rebuilt" (found in review).
        usable = {name: state for name, state in states - states_now
                  if name in definitions_now and name not in dict(states_now)}
        rebuilt = sorted(name for name in definitions.keys() & definitions_now.keys()
                         if definitions[name] != definitions_now[name]
                         or (name in usable and self.engine.usable_again(usable[name]) is None))
        flagged = sorted(name for name in usable if name not in rebuilt)
        changes = [f"renamed {', '.join(f'{old} to {new}' for old, new in sorted(renamed.items()))}"] if renamed else []
        changes += [f"added {', '.join(added)}"] if added else []
        changes += [f"rebuilt {', '.join(name + (f' (was {usable[name]})' if name in usable else '') for name in rebuilt)}"
                    ] if rebuilt else []
        changes += [f"made {name} {self.engine.usable_again(usable[name])} (was {usable[name]}; not rebuilt)"
                    for name in flagged]
        changes += [f"set {', '.join(sorted(options_now - options))}"] if options_now - options else []
        return changes

    # -- relay operations --------------------------------------------------------
    def use_claim_window(self, factor: int) -> None:
        """Claims read ``factor`` times their batch of eligible rows (``Engine.claim_window``;
        the relay's ``OUTBOX_RELAY_CLAIM_WINDOW``: docs/internals.md, "Claim windows")."""
        if factor <= 0:
            raise ValueError("the claim window must be positive")
        self.engine.window = int(factor)

    def claim(self, batch: int, *, behind: Sequence[int] = ()) -> Claim:
        """Lease up to ``batch`` rows: whole per-aggregate chains, oldest first. ``behind``:
        rows the caller holds and will have published before any row of this claim; they do
        not block the rows after them (``Engine.claim``)."""
        if batch <= 0:
            raise ValueError("batch must be positive")
        self.release_doubtful()
        lease = self.new_lease()

        runs = 0

        def run(cursor: Any) -> list[tuple]:
            # ``_run`` runs this again after a dropped connection, but the run whose answer
            # was lost may have committed (an autocommit claim; a COMMIT whose reply never
            # came): what its lease holds is then the claim (docs/relay.md, "A network cut").
            nonlocal runs
            runs += 1
            if runs > 1:
                taken = self.engine.leased_rows(cursor, lease, self.claim_timeout_ms)
                if taken:
                    return taken
            return self.engine.claim(cursor, batch, lease, self.claim_timeout_ms, self.max_attempts, behind)

        try:
            rows = self._doubting(lease, lambda: self._run("claim", run, alone=self.engine.one_statement_claim))
        except Exception as exc:
            hint = self.engine.schema_error_hint(exc)  # not an outage: an operator must act
            if hint is not None:
                raise StoreError(hint) from exc
            raise
        status_at = len(rows[0]) - 1 if rows else 0
        messages: list[OutboxMessage] = []
        dead: list[OutboxMessage] = []
        undecodable: list[tuple[OutboxMessage, str]] = []
        for r in rows:
            message, problems = self.engine.decode_row(r, lease)
            if int(r[status_at]) == Status.DEAD:
                dead.append(message)  # logged by the relay's claim, with the ids every dead line names
                if problems:
                    log.error("outbox dead row outbox_id=%s is also undecodable (%s); its dead-letter copy carries "
                              "what could be decoded", message.id, "; ".join(problems))
            elif problems:
                undecodable.append((message, UNDECODABLE_PREFIX + "; ".join(problems)))
            else:
                messages.append(message)
        errors: dict[int, str] = {}
        if undecodable:
            messages = self._bury_undecodable(undecodable, messages, dead, errors)
        messages.sort(key=lambda m: m.id)
        dead.sort(key=lambda m: m.id)
        return Claim(lease=lease, messages=messages, dead=dead, dead_errors=errors)

    def _bury_undecodable(self, undecodable: list[tuple[OutboxMessage, str]], messages: list[OutboxMessage],
                          dead: list[OutboxMessage], errors: dict[int, str]) -> list[OutboxMessage]:
        """Turn the claimed rows that cannot be decoded dead, at once and alone, with the
        reason: a lease-fenced ``mark_failed(dead=True)`` right after the claim (attempts + 1,
        like any poison row). They join ``dead`` (with their reason in ``errors``) so the
        relay sends their dead-letter copy, built from what could be decoded.

        The rest of the batch flows, including the rows behind a buried row in its own
        aggregate (it is dead now, so it no longer holds them back). If the dead write fails
        (database down), the bad row stays under this lease and comes back when it expires;
        the rows behind it in its aggregate are then released, not published, so none
        overtakes it. Returns the messages to publish."""
        held: dict[str, int] = {}  # aggregate -> the smallest id of a bad row still claimed
        for message, error in undecodable:
            error = fit_utf16(error, MAX_ERROR_UNITS)
            try:
                result = self.mark_failed(message.id, message.lease, error, dead=True)
            except Exception as exc:  # noqa: BLE001 - the lease recovers the row
                log.error("outbox cannot mark undecodable row outbox_id=%s dead (%s: %s); it comes back when "
                          "its lease expires", message.id, type(exc).__name__, exc)
                result = None
            if result is not None and result.dead:
                dead.append(message)  # logged by the relay's claim, with its reason
                errors[message.id] = error
            elif result is None:
                held[message.aggregate_id] = min(held.get(message.aggregate_id, message.id), message.id)
        if not held:
            return messages
        behind = [m for m in messages if m.aggregate_id in held and m.id > held[m.aggregate_id]]
        if behind:
            try:
                self.release([m.id for m in behind], behind[0].lease)
            except Exception as exc:  # noqa: BLE001
                log.error("outbox cannot release rows %s behind an undecodable row (%s); the lease recovers them",
                          [m.id for m in behind], exc)
        return [m for m in messages if not (m.aggregate_id in held and m.id > held[m.aggregate_id])]

    def _doubting(self, lease: str, call: Callable[[], T]) -> T:
        """``call()``, a claim or an adoption writing ``lease``; when it fails, ``lease`` is
        doubtful: its last run may have committed with its answer lost."""
        try:
            return call()
        except Exception:
            with _DOUBTFUL_LOCK:
                _DOUBTFUL.setdefault(self._doubtful_key, []).append(lease)
            raise

    def release_doubtful(self) -> None:
        """Hand back, as pending and with no attempt spent, the rows of this process's doubtful
        leases on this table (``_doubting``): nobody publishes under them, and this process
        lives on, so neither the takeover nor anything but their lease's expiry would free
        them, and every later row of their aggregates would wait that long (found by
        ``bench.soak --faults``: a database cut held a dozen aggregates back for the lease,
        60 s). Called by every claim and by the heartbeat. One statement per lease, only
        after such a failure; if it fails, the leases stay doubtful."""
        with _DOUBTFUL_LOCK:
            leases = _DOUBTFUL.pop(self._doubtful_key, [])
        if not leases:
            return

        def work(cursor: Any) -> int:
            sql = self.engine.release_lease_sql()
            return sum(self.engine.execute(cursor, sql, [lease]).rowcount for lease in leases)

        try:
            released = self._run("release", work, alone=True)  # one release per lease, each atomic alone
        except Exception:
            with _DOUBTFUL_LOCK:
                _DOUBTFUL.setdefault(self._doubtful_key, [])[:0] = leases
            raise
        if released:
            log.info("outbox: released %d rows that a claim or adoption whose answer was lost had leased", released)

    def new_lease(self) -> str:
        """A lease token: 32 hex characters, the first 16 this store's holder id when it has one."""
        return self.holder_id + secrets.token_hex(8) if self.holder_id else uuid.uuid4().hex

    def adopt(self, ids: Sequence[int], lease: str, new_lease: str) -> set[int]:
        """Move rows from ``lease`` to ``new_lease`` (this process's), in one statement fenced
        by the old lease; their lease starts again now. Returns the ids moved: those ``lease``
        still held. A publish task run by another process than the one that claimed its rows
        adopts them before publishing (docs/internals.md, "Lost workers")."""
        ids = list(ids)
        if not ids:
            return set()

        def work(cursor: Any) -> set[int]:
            moved = sum(self.engine.execute(cursor, self.engine.adopt_sql(cond), [new_lease, *params, lease]).rowcount
                        for cond, params in map(self.engine.ids_in, self.engine.id_chunks(ids)))
            return set(ids) if moved == len(ids) else self._held_by(cursor, ids, new_lease)

        # Alone, as mark_done: each UPDATE commits as it runs, and the read after it checks what moved.
        return self._doubting(new_lease, lambda: self._run("adopt", work, alone=True))

    # -- holders: the relay's worker processes (docs/internals.md, "Lost workers") ------------
    def beat(self, holder: Holder, silent_after_ms: int) -> Beat:
        """One heartbeat of ``holder``: refresh its ``beat_at`` (insert its record if it is
        missing), and list the other holders silent for longer than ``silent_after_ms``, by
        the database clock. Alone (``Connections.transaction``): each statement commits as it
        runs where the engine can, so no cut leaves the holder's record locked for a COMMIT."""
        engine = self.engine

        def work(cursor: Any) -> Beat:
            engine.begin(cursor)
            recreated = engine.beat(cursor, holder.holder_id, holder.host[:255], holder.pid)
            rows = engine.execute(cursor, engine.silent_holders_sql(),
                                  [holder.holder_id, -int(silent_after_ms)]).fetchall()
            return Beat(recreated, [SilentHolder(Holder(str(r[0]).strip(), str(r[1]), int(r[2])),
                                                 self._seconds(r[3], r[4])) for r in rows])

        return self._run("beat", work, alone=True)

    def take_over(self, silent: SilentHolder, silent_after_ms: int) -> Takeover | None:
        """End the leases of a silent holder: delete its record if it is still silent, and only
        then move ``claimed_at`` of the rows it holds back past the lease, so the next claim
        takes them (``attempts + 1``, a new token: the lost holder's late writes are fenced
        off). None when another process took it over first, or it beat again meanwhile.

        One transaction where the server ends an idle one (``Engine.ends_idle_transactions``);
        on SQL Server alone, each statement committed as it runs: a takeover cut off before
        its COMMIT held the lost holder's rows locked, past their lease, until the server
        dropped the session, where a takeover that stops after the delete leaves them to
        their lease."""
        engine, prefix = self.engine, silent.holder.holder_id + "%"

        def work(cursor: Any) -> Takeover | None:
            engine.begin(cursor)
            gone = engine.execute(cursor, engine.drop_silent_holder_sql(),
                                  [silent.holder.holder_id, -int(silent_after_ms)]).rowcount
            if gone != 1:
                return None
            count, oldest, now = engine.execute(cursor, engine.held_by_sql(), [prefix]).fetchone()
            if count:
                engine.execute(cursor, engine.end_leases_sql(), [-(self.claim_timeout_ms + 1000), prefix])
            return Takeover(silent, int(count or 0), self._seconds(oldest, now) if oldest is not None else 0.0)

        return self._run("take_over", work, alone=not engine.ends_idle_transactions)

    def holders(self, silent_after_ms: int) -> tuple[int, list[tuple[SilentHolder, int]]]:
        """The relay's worker processes on record (``outbox check``): how many records, and
        those silent for longer than ``silent_after_ms`` by the database clock, oldest first,
        each with the rows still leased to it. A record outlives its process until a live one
        takes it over, so the count alone says nothing about who runs. Read only."""
        engine = self.engine

        def work(cursor: Any) -> tuple[int, list[tuple[SilentHolder, int]]]:
            total = int(engine.execute(cursor, f"SELECT COUNT(*) FROM {engine.holders}{engine.past_locks_read}")
                        .fetchone()[0] or 0)
            rows = engine.execute(cursor, engine.silent_holders_sql(), ["", -int(silent_after_ms)]).fetchall()
            silent = [SilentHolder(Holder(str(r[0]).strip(), str(r[1]), int(r[2])), self._seconds(r[3], r[4]))
                      for r in rows]
            return total, [(h, int(engine.execute(cursor, engine.held_by_sql(), [h.holder.holder_id + "%"])
                                    .fetchone()[0] or 0)) for h in silent]

        return self._run("holders", work)

    def drop_holder(self, holder_id: str) -> int:
        """Delete a holder's record, its process ending, unless rows are still leased to it:
        returns how many (0: the record is gone). A process that exits while a task of it
        still holds rows (a publish past the shutdown's wait) keeps its record, so the
        others take the rows over once it is silent instead of leaving them for the lease
        (docs/internals.md, "Lost workers"; found in review)."""
        engine = self.engine

        def work(cursor: Any) -> int:
            held = int(engine.execute(cursor, engine.held_by_sql(), [holder_id + "%"]).fetchone()[0] or 0)
            if not held:
                engine.execute(cursor, engine.drop_holder_sql(), [holder_id])
            return held

        return self._run("drop_holder", work)

    def _seconds(self, earlier: Any, later: Any) -> float:
        """Seconds from ``earlier`` to ``later``, two database timestamps (never None), at least 0."""
        start, end = self.engine.to_datetime(earlier), self.engine.to_datetime(later)
        assert start is not None and end is not None
        return max(0.0, (end - start).total_seconds())

    def held(self, ids: Sequence[int], lease: str) -> set[int]:
        """The ids among ``ids`` that ``lease`` still holds (claimed, not yet settled or
        released). A publish task that is delivered again checks this before publishing:
        see docs/relay.md, "Graceful shutdown"."""
        ids = list(ids)
        if not ids:
            return set()
        return self._run("held", lambda cursor: self._held_by(cursor, ids, lease))

    def _held_by(self, cursor: Any, ids: list[int], lease: str) -> set[int]:
        """``held``'s query, in the caller's transaction (``adopt`` reads it after moving rows)."""
        found: set[int] = set()
        for cond, params in map(self.engine.ids_in, self.engine.id_chunks(ids)):
            rows = self.engine.execute(
                cursor, f"SELECT id FROM {self.engine.table} WHERE {cond} AND lease_token = ? AND status = 1",
                [*params, lease]).fetchall()
            found.update(int(r[0]) for r in rows)
        return found

    def mark_done(self, ids: Sequence[int], lease: str) -> FenceResult:
        """Mark published rows done, in one statement per id list (``_each_alone``). Rows no
        longer held by ``lease`` are left alone and counted as stale, but for rows this very
        write already settled: a done row keeps the lease that settled it, so a repeat of a
        ``mark_done`` whose answer was lost (the store's retry, or the ack queue's ``done``
        task) counts them as applied. Before, it logged them as "expired and re-claimed" at
        nearly every database cut (found by ``bench.soak --faults``)."""
        ids = list(ids)
        if not ids:
            return FenceResult(0, 0)

        return self._fenced("mark_done", ids, lease, self._each_alone(
            "mark_done", ids, lambda cond, params: (self.engine.mark_done_sql(cond), [*params, lease]),
            settled=(lease, Status.DONE)))

    def _each_alone(self, operation: str, ids: list[int], statement: Callable[[str, list[Any]], tuple[str, list[Any]]],
                    *, settled: tuple[str, Status] | None = None) -> int:
        """Run ``statement(cond, params)`` (an UPDATE, fenced and idempotent) for each of the id
        lists one statement may carry (``Engine.id_chunks``: one list but on SQL Server below
        level 130), each as a transaction of its own and alone, so a cut before a COMMIT cannot
        leave its rows locked, which on SQL Server held every claim's probe (docs/sqlserver.md,
        "A network cut"). A retry runs its own chunk again, not those committed before it.
        Returns the rows changed. ``settled``: (lease, status) of a write that settles rows
        under that lease: a list it changed only in part is counted again as its rows now at
        that status under that lease, a repeat of this very write whose answer was lost (the
        row keeps the lease that settled it) having applied."""
        def work(cond: str, params: list[Any], count: int, cursor: Any) -> int:
            sql, values = statement(cond, params)
            changed = int(self.engine.execute(cursor, sql, values).rowcount)
            if settled is not None and changed < count:
                lease, status = settled
                changed = int(self.engine.execute(
                    cursor, f"SELECT COUNT(*) FROM {self.engine.table} WHERE {cond} AND lease_token = ? "
                    f"AND status = {int(status)}", [*params, lease]).fetchone()[0])
            return changed

        return sum(self._run(operation, functools.partial(work, *self.engine.ids_in(part), len(part)), alone=True)
                   for part in self.engine.id_chunks(ids))

    def mark_failed(self, id: int, lease: str, error: str, retry_in: timedelta | None = None,
                    *, dead: bool = False) -> FailResult:
        """Record a failed delivery. With ``retry_in`` the row waits that long (on
        the database clock); with ``dead=True``, or once attempts reach the
        maximum, it is dead-lettered. A retry with no retry time is refused: it would
        make the row due at once and hammer the broker."""
        if retry_in is None and not dead:
            raise TypeError("mark_failed needs retry_in unless dead=True: a failed row must have a retry time")
        retry_ms = 0 if retry_in is None else int(retry_in.total_seconds() * 1000)
        if retry_ms < 0 or retry_ms > 86_400_000:
            raise ValueError("retry_in must be between 0 and 24 hours")
        # Passwords masked, whoever called, after the reason's kind (docs/relay.md, "Secrets in
        # output"), then cut in Python to what the column holds in UTF-16 units (SQL Server's
        # NVARCHAR(4000) counts those), never inside a surrogate pair: the database never truncates.
        error = fit_utf16(_masked_reason(error or "unknown error"), MAX_ERROR_UNITS)
        flag = 1 if dead else 0

        def work(cursor: Any) -> tuple[int, int | None]:
            params = [flag, self.max_attempts] * 3
            params.insert(4, retry_ms)  # the retry time sits in the second CASE's ELSE
            changed = self.engine.execute(cursor, self.engine.mark_failed_sql(),
                                          [*params, error, id, lease]).rowcount
            found = self.engine.execute(cursor, f"SELECT status, last_error, lease_token FROM {self.engine.table} "
                                                "WHERE id = ?", [id]).fetchone()
            status = int(found[0]) if found else None
            if not changed and found and status in (Status.FAILED, Status.DEAD) and found[1] == error \
                    and str(found[2] or "").strip() == lease:
                # Written by an earlier try of this very failure whose answer was lost (the
                # store's retry, or the ack queue's fail task): it applied, and a row it buried
                # still gets its dead-letter copy (found in review: the copy was skipped). The
                # row keeps the lease that failed it: the same failure written by the lease that
                # claimed the row again after this one expired is not this write's (found in
                # review: a stale lease was told it applied, and sent a second dead-letter copy).
                changed = 1
            return changed, status

        # Alone: the UPDATE commits as it runs, so a cut before a COMMIT cannot leave the row
        # locked, which on SQL Server held every claim's probe (docs/sqlserver.md, "A network cut").
        changed, status = self._run("mark_failed", work, alone=True)
        self._fenced("mark_failed", [id], lease, changed)
        return FailResult(applied=changed == 1, dead=changed == 1 and status == Status.DEAD)

    def release(self, ids: Sequence[int], lease: str, delay: timedelta | None = None) -> FenceResult:
        """Hand rows back as pending without spending an attempt (a chain's
        unpublished tail, or broker back-pressure). ``delay`` keeps them, and so
        their whole aggregate, waiting that long."""
        ids = list(ids)
        if not ids:
            return FenceResult(0, 0)
        delay_ms = int(delay.total_seconds() * 1000) if delay else 0

        # A released row keeps the lease that released it: a repeat of a release whose answer
        # was lost counts it as applied, not as "expired and re-claimed" (found in review).
        return self._fenced("release", ids, lease, self._each_alone(
            "release", ids, lambda cond, params: (self.engine.release_sql(cond), [delay_ms, delay_ms, *params, lease]),
            settled=(lease, Status.PENDING)))

    def _fenced(self, operation: str, ids: list[int], lease: str, applied: int) -> FenceResult:
        result = FenceResult(requested=len(ids), applied=applied)
        if not result.ok:
            log.warning("outbox %s: lease %s no longer holds %d of rows %s (expired and re-claimed); "
                        "those rows were left unchanged", operation, lease, result.stale, ids)
        return result

    # -- housekeeping ------------------------------------------------------------
    def purge_done(self, older_than: timedelta, batch: int = 1000, max_rows: int | None = 100_000, *,
                   max_seconds: float | None = None, stop: Callable[[], bool] | None = None) -> int:
        """Delete done rows processed longer ago than ``older_than``, ``batch`` rows
        per short transaction, oldest ids first, each chunk starting where the last one
        ended (``Engine.purge_chunk``). ``max_rows`` is a soft cap: the loop stops after
        the chunk that reaches it (None: no cap). ``max_seconds`` bounds the run's time:
        no chunk starts after it, and a run it stops with old done rows left logs a
        warning (the relay's purge: until caught up or its time is up, docs/relay.md,
        "Purge"). ``stop``, asked before each chunk after the first, ends the run when it
        says True (a worker's warm shutdown: docs/relay.md, "Graceful shutdown"). Dead rows are
        never purged.

        While archiving is configured (``archive_uri``) nothing is deleted here: a
        purge cannot know which rows the archive holds, so ``outbox pipeline archive``
        deletes rows itself, once they are committed to the archive."""
        if self.archive_uri:
            log.info("outbox purge skipped: archiving is configured (OUTBOX_ARCHIVE_URI=%s); "
                     "`outbox pipeline archive` deletes rows once they are archived", self.archive_uri)
            return 0
        if batch <= 0:
            raise ValueError("batch must be positive")
        older_ms = int(older_than.total_seconds() * 1000)
        started = time.monotonic()
        total = chunks = 0
        after: int | None = 0  # ids start at 1
        while after is not None and (max_rows is None or total < max_rows):
            if max_seconds is not None and chunks and time.monotonic() - started >= max_seconds:
                log.warning("outbox purge: stopped after %.0f s with done rows older than %s left (%d deleted "
                            "this run); the next run carries on. A purge that stops so every run cannot keep "
                            "up: run it more often (OUTBOX_RELAY_PURGE_INTERVAL_S)", max_seconds, older_than,
                            total)
                break
            if stop is not None and chunks and stop():
                log.info("outbox purge: the worker is stopping; stopped after %d rows deleted this run, "
                         "the next run carries on", total)
                break
            deleted, after = self._run("purge_done", functools.partial(self._purge_chunk, older_ms, batch, after),
                                       alone=True)
            total, chunks = total + deleted, chunks + 1
        return total

    def _purge_chunk(self, older_ms: int, batch: int, after: int, cursor: Any) -> tuple[int, int | None]:
        return self.engine.purge_chunk(cursor, older_ms, batch, after)

    def gauges(self) -> tuple[int, int, float]:
        """``(in_flight, backlog, lag_s)`` over the open rows, in one query on the claim
        index: rows claimed, rows open (pending, claimed, failed), the age of the oldest
        open row by the database clock (0 when there is none). No lock waited for, and one
        retry only (a dropped connection, on a new one): the metrics' refresher thread calls
        it every few seconds on a connection MySQL ends when idle that long, and keeps its
        last values when it fails (docs/waking-and-metrics.md, "Metrics")."""
        engine = self.engine
        in_flight, backlog, oldest, db_now = self._connections.run(
            "gauges", lambda cursor: tuple(engine.execute(cursor, engine.gauges_sql()).fetchone()), attempts=2)
        lag = 0.0
        if oldest is not None:
            lag = self._seconds(oldest, db_now)
        return int(in_flight or 0), int(backlog or 0), lag

    def stats(self, *, closed: bool = True) -> Stats:
        """The rows per status and the age of the oldest open row (``outbox status``, the
        worker's heartbeat). ``closed=False``: the open rows alone (pending, claimed, failed),
        read on the claim's index as the gauges are, done and dead left out (``dead`` None):
        counting those reads every row of the table, and on PostgreSQL no index can hold
        ``status`` (docs/internals.md, "The lease is a HOT update on PostgreSQL")."""
        # Without a lock, as the gauges read (Engine.unlocked_read): with SQL Server's RCSI off,
        # an application transaction keeping an enqueue open made `outbox status` wait for it.
        # The oldest open row is read on the claim's index too (Engine.open_rows_source): on
        # MySQL/MariaDB the planner read every row of the table for it (found in review).
        engine = self.engine
        open_rows = f"{engine.open_rows_source()}{engine.unlocked_read} WHERE {engine.open_rows()}"
        source = f"{engine.table}{engine.unlocked_read}" if closed else open_rows

        def work(cursor: Any) -> tuple[list, Any, Any]:
            counts = self.engine.execute(cursor, f"SELECT status, COUNT(*) FROM {source} GROUP BY status").fetchall()
            oldest = self.engine.execute(cursor, f"SELECT MIN(created_at), {self.engine.now} FROM {open_rows}").fetchone()
            return counts, oldest[0], oldest[1]

        counts, oldest, now = self._run("stats", work)
        by_name = {s.name.lower(): 0 for s in Status if closed or s not in (Status.DONE, Status.DEAD)}
        for status, count in counts:
            by_name[Status(int(status)).name.lower()] = int(count)
        age = None
        if oldest is not None:
            age = self._seconds(oldest, now)
        return Stats(counts=by_name, oldest_pending_age_s=age, dead=by_name["dead"] if closed else None)

    def _topics_in(self, topics: Sequence[str] | None) -> tuple[str, list[Any]]:
        """A condition on the dead rows of ``topics`` (``outbox dead ... --topic``) and its
        parameters; any topic when ``topics`` is None or empty."""
        if not topics:
            return "1 = 1", []
        return self.engine.exact_in("topic", sorted(set(topics)))  # "orders" is not "orders " nor "Orders"

    def dead_list(self, limit: int = 100, after_id: int = 0, topics: Sequence[str] | None = None) -> list[DeadRow]:
        """Dead rows after ``after_id``, oldest first; of ``topics`` only, when given."""
        # Past rows others hold locked (Engine.past_locks_read): a dead row is committed and
        # unlocked, and with SQL Server's RCSI off a scan of the ids after the dead ones waited
        # on any open enqueue (docs/sqlserver.md, "READ_COMMITTED_SNAPSHOT").
        cond, params = self._topics_in(topics)
        sql = self.engine.limit(
            "SELECT id, message_id, topic, aggregate_type, aggregate_id, attempts, last_error, processed_at "
            f"FROM {self.engine.table}{self.engine.past_locks_read} WHERE status = 4 AND id > ? AND {cond} ORDER BY id")
        rows = self._run("dead_list", lambda c: self.engine.execute(c, sql, [after_id, *params, limit]).fetchall())
        return [DeadRow(int(r[0]), r[1], r[2], r[3], r[4], int(r[5]), r[6], self.engine.to_datetime(r[7]))
                for r in rows]

    def requeue_dead(self, ids: Sequence[int] | None = None, *, chunk: int = REQUEUE_CHUNK) -> int:
        """Make dead rows pending again with a fresh attempt budget. ``None`` means all,
        ``chunk`` rows per short transaction (see ``requeue``). Unconditional; ``requeue`` is
        the checked form the command line uses."""
        if ids is None:
            return sum(self._requeue_all("1 = 1", [], chunk).values())
        return self._each_alone("requeue_dead", list(ids), lambda cond, params: (self.engine.requeue_sql(cond), params))

    def _requeue_all(self, cond: str, params: list[Any], chunk: int) -> dict[str, int]:
        """Requeue every dead row matching ``cond``, in id order, ``chunk`` rows per short
        transaction (as ``purge_done`` deletes): one statement over every dead row would
        lock them all at once, past the lock limits of small servers and Azure SQL, while
        blocking the claims of every aggregate it touches (docs/sqlserver.md, "Lock
        escalation"). Returns the rows requeued per topic.

        Each chunk is one UPDATE (so at most what one statement carries: 2,000 ids on SQL
        Server below level 130), as the chunk runs alone there (``_requeue_alone``): a try
        run again finds each row of its chunk requeued or still dead, never half of them."""
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        engine, t = self.engine, self.engine.table
        chunk = len(engine.id_chunks(range(chunk))[0])
        select = engine.limit(f"SELECT id, topic FROM {t}{engine.past_locks_read} WHERE status = 4 AND id > ? "
                              f"AND {cond} ORDER BY id")  # past others' locks, as dead_list reads
        counts: dict[str, int] = {}
        after = 0

        def work(cursor: Any) -> list[tuple[int, str]]:
            rows = [(int(r[0]), str(r[1])) for r in engine.execute(cursor, select, [after, *params, chunk]).fetchall()]
            if rows:
                ids_cond, ids_params = engine.ids_in([r[0] for r in rows])
                engine.execute(cursor, engine.requeue_sql(ids_cond), ids_params)
            return rows

        while True:
            rows = self._run("requeue", work, alone=self._requeue_alone)
            for _, topic in rows:
                counts[topic] = counts.get(topic, 0) + 1
            if len(rows) < chunk:
                return dict(sorted(counts.items()))
            after = rows[-1][0]

    def requeue(self, ids: Sequence[int] | None = None, *, force: bool = False,
                chunk: int = REQUEUE_CHUNK, all_or_nothing: bool = True,
                topics: Sequence[str] | None = None) -> RequeueResult:
        """Make dead rows pending again with a fresh attempt budget, reporting per topic.

        A row whose recorded reason is permanent (``engines.base.PERMANENT_ERROR_PREFIXES``:
        undecodable, poison) would only fail again, so it stays dead unless ``force``.
        ``ids=None`` requeues every other dead row, ``chunk`` rows per short transaction in
        id order, and counts the ones kept. With explicit ids it is all or nothing (the
        command line's ids): an id that does not exist, is not dead, or is permanent
        (without ``force``) is reported and nothing is requeued. With ids and
        ``all_or_nothing=False`` (the Django admin's selection) the ids are taken as
        ``None`` takes every dead row: ``chunk`` ids per short transaction in id order,
        each requeued unless permanent (without ``force``), not dead or gone, which are
        reported (docs/relay.md, "Requeueing dead rows"). ``topics`` (with ``ids=None`` only)
        narrows "every dead row" to the dead rows of those topics (``--topic``)."""
        t = self.engine.table
        permanent = "(" + " OR ".join("last_error LIKE ?" for _ in PERMANENT_ERROR_PREFIXES) + ")"
        permanent_params = [prefix + "%" for prefix in PERMANENT_ERROR_PREFIXES]
        if topics and ids is not None:
            raise ValueError("requeue takes ids or topics, not both")
        of_topics, topic_params = self._topics_in(topics)

        if ids is None:
            if force:
                return RequeueResult(requeued=self._requeue_all(of_topics, topic_params, chunk))
            # Past others' locks, as every read of the dead rows (dead_list, _requeue_all); per
            # exact topic (Engine.exact), as the requeued rows are counted.
            kept = self._run("requeue", lambda cursor: self.engine.execute(
                cursor, f"SELECT MIN(topic), COUNT(*) FROM {t}{self.engine.past_locks_read} WHERE status = 4 "
                f"AND {of_topics} AND {permanent} GROUP BY {self.engine.exact('topic')}",
                [*topic_params, *permanent_params]).fetchall())
            requeued = self._requeue_all(f"{of_topics} AND (last_error IS NULL OR NOT {permanent})",
                                         [*topic_params, *permanent_params], chunk)
            return RequeueResult(requeued=requeued,
                                 permanent={str(r[0]): int(r[1]) for r in sorted(kept, key=lambda r: str(r[0]))})

        wanted = sorted({int(i) for i in ids})
        if all_or_nothing:
            return self._run("requeue", self._requeue_ids(wanted, force, all_or_nothing=True),
                             alone=self._requeue_alone)
        if chunk <= 0:
            raise ValueError("chunk must be positive")

        def requeue_part(part: list[int]) -> RequeueResult:
            return self._run("requeue", self._requeue_ids(part, force, all_or_nothing=False),
                             alone=self._requeue_alone)
        parts = [requeue_part(wanted[i:i + chunk]) for i in range(0, len(wanted), chunk)]
        per_topic = sum((Counter(part.requeued) for part in parts), Counter[str]())
        return RequeueResult(requeued=dict(sorted(per_topic.items())),
                             refused=[row for part in parts for row in part.refused],
                             missing=[i for part in parts for i in part.missing],
                             not_dead={i: s for part in parts for i, s in part.not_dead.items()})

    @property
    def _requeue_alone(self) -> bool:
        """Does a requeue run alone, each statement committed as it runs? Where the server
        ends no idle transaction (``Engine.ends_idle_transactions``: SQL Server), as the
        fenced writes do: a requeue cut before its COMMIT kept the requeued rows' keys in
        ``agg_open`` locked, and every claim's probe waited on them (docs/sqlserver.md, "A
        network cut"; found in review). Elsewhere one transaction, which the server bounds."""
        return not self.engine.ends_idle_transactions

    def _requeue_ids(self, wanted: list[int], force: bool, *, all_or_nothing: bool) -> Callable[[Any], RequeueResult]:
        """``requeue`` of the ids ``wanted``, as the work of one transaction: each is looked
        at, then the dead ones not refused are requeued (none at all when one is refused,
        missing or not dead and ``all_or_nothing``). Run alone (``_requeue_alone``), an UPDATE
        commits as it runs: a try run again after a later one failed takes the ids an
        earlier try requeued as requeued, not as no longer dead."""
        engine, requeued = self.engine, set[int]()

        def work(cursor: Any) -> RequeueResult:
            chunks = [engine.ids_in(part) for part in engine.id_chunks(wanted)]
            rows = [row for cond, params in chunks for row in engine.execute(
                cursor, "SELECT id, message_id, topic, aggregate_type, aggregate_id, attempts, last_error, "
                f"processed_at, status FROM {engine.table} WHERE {cond}", params).fetchall()]
            found = {int(r[0]): r for r in rows}
            missing = [i for i in wanted if i not in found]
            not_dead = {i: int(r[8]) for i, r in found.items() if int(r[8]) != Status.DEAD and i not in requeued}
            refused = [] if force else [
                DeadRow(int(r[0]), r[1], r[2], r[3], r[4], int(r[5]), r[6], engine.to_datetime(r[7]))
                for i, r in sorted(found.items()) if i not in not_dead and is_permanent_error(r[6])]
            if all_or_nothing and (missing or not_dead or refused):
                return RequeueResult(refused=refused, missing=missing, not_dead=not_dead)
            kept = {row.id for row in refused} | set(not_dead)
            requeue = [i for i in sorted(found) if i not in kept]
            counts = Counter(str(found[i][2]) for i in requeue)
            left = [i for i in requeue if i not in requeued]
            for part in engine.id_chunks(left) if left else []:
                cond, params = engine.ids_in(part)
                engine.execute(cursor, engine.requeue_sql(cond), params)
                if self._requeue_alone:
                    requeued.update(part)
            return RequeueResult(requeued=dict(sorted(counts.items())), refused=refused, missing=missing,
                                 not_dead=not_dead)
        return work
