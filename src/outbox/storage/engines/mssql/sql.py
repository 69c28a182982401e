"""SQL Server's statements: clock arithmetic, id lists (OPENJSON or padded parameter lists),
purge, the write side's insert batch and the claim batch, on ``MssqlStatements``. The
package's docstring explains the claim and the write side; the T-SQL is checked by sqlglot in
tests/test_mssql_sql.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from ....core.errors import StoreError
from ....core.model import NewEvent
from ..base import LEASE_EXPIRED_ERROR, MESSAGE_COLUMNS, leased_or_full
from .driver import error_numbers, reset_session, result_rows
from .schema import ID_COLLATION, INDEXES, OPEN_ROWS, MssqlSchema, if_, nstr

log = logging.getLogger("outbox.storage.engines.mssql")

#: Ids per statement when OPENJSON is missing: below SQL Server's 2,100 parameters
#: per statement, with room for the statement's own (lease, delay).
ID_PARAMS_PER_STATEMENT = 2000
#: Without OPENJSON each id-list length is a statement text, so a plan, of its own: the
#: lists are padded to the next of these sizes (at most four times the ids, seven
#: plans per statement kind); docs/sqlserver.md, "Versions and compatibility levels".
ID_LIST_SIZES = (1, 4, 16, 64, 256, 1024, ID_PARAMS_PER_STATEMENT)

#: The words of errors 308, 315, 8655 and 8622 (mssql-python's errors carry no number): an index that
#: a hint names is gone, or disabled (``driver.disabled_index_of``: 8655 when a hint forces a disabled
#: index, 8622 when no index is left to seek).
INDEX_GONE = ("(specified in the FROM clause) does not exist", "(specified in the FROM clause) is disabled",
              "unable to produce a plan because the index", "could not produce a query plan because of the hints")
#: Their numbers, in pyodbc's messages.
INDEX_GONE_ERRORS = frozenset({308, 315, 8655, 8622})

#: A transaction open on the session whatever IMPLICIT_TRANSACTIONS says, @@TRANCOUNT 1
#: when none was (``savepoint_statements``).
OPEN_TRANSACTION = ("IF @@TRANCOUNT = 0\n"
                    "BEGIN\n"
                    "    BEGIN TRANSACTION;\n"
                    "    IF @@TRANCOUNT > 1\n"
                    "    BEGIN\n"
                    "        COMMIT TRANSACTION;\n"
                    "    END;\n"
                    "END;")


def savepoint_statements(name: str) -> list[str]:
    """The batch that opens a nested ``outbox.transaction`` block: a transaction first when
    none is open, then the savepoint (docs/waking-and-metrics.md, "outbox.transaction").

    The outer block only switches autocommit off, which the ODBC driver turns into
    IMPLICIT_TRANSACTIONS ON; SAVE TRANSACTION is not one of the statements that start an
    implicit transaction, so a nested block run before any work of the outer one failed
    with error 628 (found in review). BEGIN TRANSACTION is one of them: under
    IMPLICIT_TRANSACTIONS it opens two nested transactions (@@TRANCOUNT 2), and the COMMIT
    takes the count back to 1, committing nothing, so the driver's ``commit()`` ends the one
    transaction left, as it ends one it opened itself. With IMPLICIT_TRANSACTIONS OFF the
    count is 1 and no COMMIT runs. sqlglot cannot read SAVE TRANSACTION (tests/test_mssql_sql.py)."""
    return [OPEN_TRANSACTION, f"SAVE TRANSACTION {name};"]


#: The state of the session's transaction (1 can go on, 0 none, -1 doomed): read after a nested
#: block's rollback to tell whether the outer block still has its transaction.
XACT_STATE_SQL = "SELECT XACT_STATE()"


def rollback_to_savepoint_sql(name: str) -> str:
    """Roll a nested ``outbox.transaction`` block back to its savepoint (T-SQL has no RELEASE:
    the savepoint lasts until the transaction ends), where the transaction still can be:
    after a deadlock (1205) none is open any more (XACT_STATE() 0), and after an error
    that doomed it (XACT_ABORT) only a full rollback is allowed (-1, error 3931). The outer
    block then rolls back, and the block's own error reaches the caller (found in review)."""
    return if_("XACT_STATE() = 1", f"ROLLBACK TRANSACTION {name}")


#: The result columns' types, for the claim's table variable (payload/headers as text
#: whether the columns are NVARCHAR(MAX) or the native json type).
_MESSAGE_TYPES = {
    "id": "BIGINT NOT NULL PRIMARY KEY", "message_id": "NVARCHAR(64)", "topic": "NVARCHAR(255)",
    "aggregate_type": "NVARCHAR(255)", "aggregate_id": "NVARCHAR(255)", "partition_key": "NVARCHAR(255)",
    "payload": "NVARCHAR(MAX)", "headers": "NVARCHAR(MAX)", "trace_id": "NVARCHAR(255)", "attempts": "INT",
    "created_at": "DATETIME2(3)", "status": "TINYINT",
}


class MssqlStatements(MssqlSchema):
    """The SQL text that differs on SQL Server, and the two batches run with it (insert, claim)."""

    def now_plus_ms(self) -> str:
        # The parameter binds as INT; leases and retry delays are capped at 24 hours.
        return "DATEADD(MILLISECOND, ?, SYSUTCDATETIME())"

    def payload_column(self) -> str:
        return "CAST(payload AS NVARCHAR(MAX))"  # also right for the native json type

    def headers_column(self) -> str:
        return "CAST(headers AS NVARCHAR(MAX))"

    def limit(self, select: str) -> str:
        return f"{select} OFFSET 0 ROWS FETCH NEXT ? ROWS ONLY"

    def exact(self, column: str) -> str:
        # SQL Server's equality ignores trailing spaces under every collation, and case under
        # the default one (the topic column's, unless set): the UTF-16 bytes are compared
        # (VARBINARY's equality ignores only trailing zero bytes: a NUL, which enqueue refuses).
        return f"CAST(CAST({column} AS NVARCHAR(4000)) AS VARBINARY(8000))"

    def exact_in(self, column: str, values: Sequence[str]) -> tuple[str, list[Any]]:
        # The parameters stay out of IN's list of constants (one each: few topics are named).
        listed = ", ".join(self.exact("?") for _ in values)
        return f"{self.exact(column)} IN ({listed})", list(values)

    def id_chunks(self, ids: Sequence[int]) -> list[list[int]]:
        """One list with OPENJSON; otherwise lists of at most ID_PARAMS_PER_STATEMENT,
        so no statement passes SQL Server's 2,100-parameter limit."""
        ids = [int(i) for i in ids]
        if self.has_json or len(ids) <= ID_PARAMS_PER_STATEMENT:
            return [ids]
        return [ids[i:i + ID_PARAMS_PER_STATEMENT] for i in range(0, len(ids), ID_PARAMS_PER_STATEMENT)]

    def ids_in(self, ids: Sequence[int]) -> tuple[str, list[Any]]:
        """``id IN (...)``: one JSON parameter expanded by OPENJSON at level 130 and
        later (any count); below, one parameter per id (see ``id_chunks``), the list
        padded to the next of ``ID_LIST_SIZES`` by repeating its last id. A repeated
        value changes nothing an ``IN`` list matches (or a row count), and unlike a
        "never matching" pad value it needs no assumption about which ids exist."""
        if not ids:
            return "1 = 0", []
        ids = [int(i) for i in ids]
        if self.has_json:
            return "id IN (SELECT CAST([value] AS BIGINT) FROM OPENJSON(?))", [json.dumps(ids)]
        if len(ids) > ID_PARAMS_PER_STATEMENT:
            raise StoreError(f"{len(ids)} ids in one statement: split them with id_chunks() "
                             f"(compatibility level {self.compat_level} has no OPENJSON)")
        size = next(size for size in ID_LIST_SIZES if size >= len(ids))
        padded = ids + [ids[-1]] * (size - len(ids))
        return f"id IN ({', '.join('?' * size)})", padded

    def purge_chunk_sql(self) -> str:
        """Delete at most ``?`` done rows processed more than ``?`` seconds plus ``?``
        milliseconds ago. Seconds and leftover milliseconds, because an INT of
        milliseconds overflows at ~24.8 days and retention is usually 30-90 days.

        The CTE is ``DELETE TOP (?)`` with an order: oldest first, straight off the
        (status, processed_at) index without a sort. READPAST skips rows another
        transaction holds; on READ_COMMITTED_SNAPSHOT databases (Azure SQL's default)
        it is only allowed together with READCOMMITTEDLOCK."""
        return (f"WITH doomed AS (SELECT TOP (?) id FROM {self.table} WITH (READCOMMITTEDLOCK, ROWLOCK, READPAST) "
                "WHERE status = 2 AND processed_at < DATEADD(SECOND, -?, DATEADD(MILLISECOND, -?, SYSUTCDATETIME())) "
                "ORDER BY processed_at) DELETE FROM doomed")

    def purge_params(self, older_than_ms: int, batch: int) -> list[Any]:
        seconds, millis = divmod(max(older_than_ms, 0), 1000)
        return [batch, seconds, millis]

    def purge_chunk(self, cursor: Any, older_than_ms: int, batch: int, after: int) -> tuple[int, int | None]:
        """One statement (``purge_chunk_sql``): the seek on (status, processed_at) reads only
        done rows, so no chunk walks the rows the purge keeps and none needs to start after
        the last one (``after`` is handed back while a full chunk says more may be left)."""
        deleted = max(int(self.execute(cursor, self.purge_chunk_sql(), self.purge_params(older_than_ms, batch))
                          .rowcount), 0)
        return deleted, after if deleted >= batch else None

    # -- write side (the caller's transaction: never commit it, never raise on a duplicate) --
    #: A shared application lock the insert batch takes only in a transaction it opened
    #: itself (the caller had none): its presence tells ``insert_event``'s clean-up that
    #: the open transaction is the batch's own, never the caller's.
    OWN_TRANSACTION_LOCK = "outbox enqueue: own transaction"

    def insert_statements(self) -> list[str]:
        """Insert unless the message_id is stored, then return the row's id
        (docs/sqlserver.md, "Enqueue: no key-range locks").

        No key-range locks: the duplicate probe is a plain seek of the unique
        message_id index. Two enqueues of the *same* message_id are serialized by an
        application lock owned by a transaction, so the second waits for the first to
        commit and then finds its row; enqueues of different ids never wait for each
        other, whatever the gap between their keys. The lock's key is a CHECKSUM of the
        message id in the column's own collation, which is equal for every two ids the
        unique index finds equal (trailing spaces; case on a case-insensitive column).

        Both reads of the table use READCOMMITTEDLOCK, so a caller at READ UNCOMMITTED
        waits for an uncommitted row instead of returning its id, and one at SNAPSHOT
        sees a row committed after its snapshot instead of inserting a duplicate.

        The lock is never owned by the session: with no transaction open (an autocommit
        connection) the batch opens its own around the lock and the insert, and commits
        it. So no duplicate-key error can reach the caller's transaction, no lock can
        outlive it, and XACT_ABORT is left as the caller set it. Values go into typed
        variables first, so a None binds without a type guess, and long payloads reach
        NVARCHAR(MAX) variables. The result is (id, lock result); the id is NULL only
        when the lock was refused.
        """
        t = self.table
        values = ", ".join(f"@{c.strip()}" for c in self.INSERT_COLUMNS.split(","))
        inserted = (f"INSERT INTO {t} ({self.INSERT_COLUMNS})\n    OUTPUT inserted.id INTO @ids\n    SELECT {values}\n"
                    f"    WHERE NOT EXISTS (SELECT 1 FROM {t} WITH (READCOMMITTEDLOCK) "
                    "WHERE message_id = @message_id)")
        own_lock = nstr(self.OWN_TRANSACTION_LOCK)
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512;",
            "SET NOCOUNT ON;",
            "DECLARE @message_id NVARCHAR(64) = ?, @topic NVARCHAR(255) = ?, @aggregate_type NVARCHAR(255) = ?, "
            "@aggregate_id NVARCHAR(255) = ?, @partition_key NVARCHAR(255) = ?, @payload NVARCHAR(MAX) = ?, "
            "@headers NVARCHAR(MAX) = ?, @trace_id NVARCHAR(255) = ?;",
            "DECLARE @id BIGINT, @lock_key INT, @lock_result INT = 0, @own_transaction BIT = 0, "
            "@lock_resource NVARCHAR(255);",
            "DECLARE @ids TABLE (id BIGINT NOT NULL);",
            # The common case, a new id: one seek, no application lock. The same statement
            # computes the lock's key: COALESCE with the column gives @message_id the
            # column's collation, and CHECKSUM is equal for values that compare equal in
            # it. Reading the table also opens the driver's implicit transaction (autocommit
            # off), so @@TRANCOUNT below is the truth.
            f"SELECT @id = o.id, @lock_key = CHECKSUM(COALESCE(o.message_id, @message_id))\n"
            f"FROM (SELECT 1 AS one) AS d LEFT JOIN {t} AS o WITH (READCOMMITTEDLOCK) ON o.message_id = @message_id;",
            f"SET @lock_resource = N'outbox:' + CONVERT(NVARCHAR(64), HASHBYTES('SHA2_256', {nstr(t + '|')} "
            "+ CONVERT(NVARCHAR(11), @lock_key)), 2);",
            # No transaction open (an autocommit connection): open one, so the lock below is
            # owned by a transaction that ends with this batch, however the batch ends.
            f"IF @id IS NULL AND @@TRANCOUNT = 0\nBEGIN\n    SET @own_transaction = 1;\n    BEGIN TRANSACTION;\n"
            f"    EXEC sp_getapplock @Resource = {own_lock}, @LockMode = N'Shared', @LockOwner = N'Transaction';\nEND;",
            if_("@id IS NULL", "EXEC @lock_result = sp_getapplock @Resource = @lock_resource, "
                "@LockMode = N'Exclusive', @LockOwner = N'Transaction'"),
            if_("@id IS NULL AND @lock_result >= 0", inserted),
            if_("@own_transaction = 1", "COMMIT TRANSACTION"),
            "SET @id = COALESCE(@id, (SELECT TOP (1) id FROM @ids), "
            f"(SELECT id FROM {t} WITH (READCOMMITTEDLOCK) WHERE message_id = @message_id));",
            if_("@nocount = 0", "SET NOCOUNT OFF"),
            "SELECT @id AS id, @lock_result AS lock_result;",
        ]

    def insert_batch(self) -> str:
        return "\n".join(self.insert_statements())

    def end_own_transaction_sql(self) -> str:
        """Roll back the transaction the insert batch opened for itself, if the batch was
        cut short before its COMMIT (a client timeout, with XACT_ABORT off); never the
        caller's transaction, which never holds ``OWN_TRANSACTION_LOCK``."""
        return ("IF @@TRANCOUNT > 0\nBEGIN\n"
                f"    IF APPLOCK_MODE(N'public', {nstr(self.OWN_TRANSACTION_LOCK)}, N'Transaction') <> N'NoLock'\n"
                "    BEGIN\n        ROLLBACK TRANSACTION;\n    END;\nEND;")

    #: What sp_getapplock's negative results mean.
    LOCK_RESULTS = {-1: "timed out (the session's LOCK_TIMEOUT)", -2: "was cancelled",
                    -3: "was chosen as a deadlock victim", -999: "failed (parameter or call error)"}

    def insert_event(self, cursor: Any, event: NewEvent) -> int:
        try:
            self.execute(cursor, self.insert_batch(), self.event_params(event))
            outbox_id, lock_result = result_rows(cursor)[0]
        except BaseException:
            try:
                self.execute(cursor, self.end_own_transaction_sql())
            except Exception:  # the connection is gone: so is the transaction
                log.debug("outbox: cannot end the insert's own transaction", exc_info=True)
            raise
        if outbox_id is None:
            reason = self.LOCK_RESULTS.get(int(lock_result or -999), f"returned {lock_result}")
            raise StoreError(f"enqueue of message_id {event.message_id!r}: the lock that serializes enqueues of "
                             f"the same message_id {reason}; the caller's transaction is unchanged")
        return int(outbox_id)

    # -- claim -------------------------------------------------------------------------
    #: The ordering probe's index, which the probe is pinned to (``FORCESEEK``).
    PROBE_INDEX = next(spec for spec in INDEXES if spec.suffix == "agg_open")

    def probe_seek(self) -> str:
        """The probes' seek hint: on ``PROBE_INDEX`` by its first key, or any seek when that
        index was found missing (``probe_index`` False)."""
        if self.probe_index is False:
            return "FORCESEEK"
        return f"FORCESEEK ({self.quote(self.index_name(self.PROBE_INDEX.suffix))} ({self.PROBE_INDEX.keys[0]}))"

    @staticmethod
    def chain_key(alias: str = "") -> str:
        """The aggregate a claim's table variables (``aggregate_id ... NOT NULL``) file a row
        under: its ``aggregate_id``, or, where a table made by another script lets that be
        NULL, a key of the row's own, so that it is a chain alone, claimed and then buried as
        undecodable as on every engine. A NULL in those NOT NULL columns failed the whole
        claim (error 515) while the row was among the oldest: every claim, the relay stalled
        (found in review). The key never matches a row of the table, so the probes find
        nothing before it."""
        return f"COALESCE({alias}aggregate_id, N'outbox:null-aggregate_id:' + CAST({alias}id AS NVARCHAR(20)))"

    def probe_select(self, source: str = "@cand") -> str:
        """One row per aggregate of ``@cand``: its first candidate (``head``) and its
        *blocker*, the first open row of the aggregate before its last candidate that is
        not a candidate (NULL: none). Rule 1 of ``chain_select`` needs nothing else, as in
        ``outbox.domain.chains.plan_claim`` (its ``first_blocker``) and the PostgreSQL claim.

        One probe per aggregate, a ``TOP (1)`` walk of the agg_open index in id order
        that stops at the first row outside ``@cand``: linear in the window, where a probe
        per candidate read k-1 rows for the k-th candidate of a hot aggregate. The walk
        is pinned to a seek of agg_open (``FORCESEEK``; docs/sqlserver.md, "The claim's
        statements and their plans"), and its ``status IN (0, 1, 3)`` is written exactly as that index's
        filter, so it never reads an aggregate's done history.

        The probe reads with READCOMMITTEDLOCK and never READPAST. A competitor's U lock
        is compatible with S, so the probe sees the competitor's locked earlier rows
        (still pending, or claimed once it commits) and they block; READPAST would skip
        them and let a later row overtake them (docs/design.md, "Why the probe treats
        every non-candidate open row as blocking"). The probe runs in a statement of its
        own, while this claim holds U locks on its candidates; a competitor that waits for
        one of those and holds a key the probe reads closes a cycle. Only one can: a stale
        lease's ``mark_done`` over rows of one aggregate that took a later row out of agg_open
        and next wants an earlier one this claim re-took (the ids processed out of id order),
        a deadlock the server ends (1205) and the loser retries (docs/sqlserver.md, "The
        claim's two walks"). Claims read past each other, ``release`` and ``adopt`` leave
        agg_open alone, ``mark_failed`` holds one row.

        ``source`` is ``@cand`` (the locked candidates) or, to choose which chains to lock,
        ``@win`` (the window read without update locks: ``claim_statements``). Rows in
        ``@behind`` (the claim's ``behind``: ``Engine.claim``) are no blockers either.
        """
        seek = self.probe_seek()
        return f"""SELECT g.aggregate_id, g.head, (
        SELECT TOP (1) e.id FROM {self.table} AS e WITH (READCOMMITTEDLOCK, {seek})
        WHERE e.aggregate_id = g.aggregate_id AND e.id < g.last_id AND e.{OPEN_ROWS}
          AND NOT EXISTS (SELECT 1 FROM {source} AS k WHERE k.id = e.id)
          AND NOT EXISTS (SELECT 1 FROM @behind AS b WHERE b.id = e.id)
        ORDER BY e.id)
FROM (SELECT aggregate_id, MIN(id) AS head, MAX(id) AS last_id FROM {source} GROUP BY aggregate_id) AS g"""

    def chain_select(self, cand: str = "@cand", agg: str = "@agg") -> str:
        """``(id, head, dead)`` of the candidates in ``@cand`` this claim takes, given
        ``@agg`` (``probe_select``): exactly the rule of ``outbox.domain.chains.plan_claim``.
        A candidate is taken when

        1. its aggregate has no blocker before it (an open row outside ``@cand``: held by
           another claimer, not yet due, a live lease: each blocks what follows);
        2. no candidate of its aggregate up to and including it is other than pending,
           except the aggregate's first (an expired lease or a due retry may start a
           chain; one further along ends the chain there);
        3. no earlier candidate of its aggregate goes dead (an expired lease out of
           attempts goes dead instead, and the rows behind it wait for the next claim).

        Rules 2 and 3 are running sums per aggregate in id order (``ROWS UNBOUNDED
        PRECEDING``: one pass), not self-joins of ``@cand`` that compared every candidate
        with every earlier one.
        """
        goes_dead = "c.status = 1 AND c.attempts + 1 >= @max_attempts"
        return f"""SELECT r.id, r.head, r.dead
FROM (
    SELECT f.id, f.head, f.blocker, f.dead,
           SUM(f.late) OVER (PARTITION BY f.head ORDER BY f.id ROWS UNBOUNDED PRECEDING) AS cut,
           SUM(f.dead) OVER (PARTITION BY f.head ORDER BY f.id ROWS UNBOUNDED PRECEDING) - f.dead AS dead_before
    FROM (
        SELECT c.id, a.head, a.blocker,
               CASE WHEN {goes_dead} THEN 1 ELSE 0 END AS dead,
               CASE WHEN c.status <> 0 AND c.id > a.head THEN 1 ELSE 0 END AS late
        FROM {cand} AS c INNER JOIN {agg} AS a ON a.aggregate_id = c.aggregate_id
    ) AS f
) AS r
WHERE (r.blocker IS NULL OR r.id < r.blocker) AND r.cut = 0 AND r.dead_before = 0"""

    #: Here the read past blocked rows probes each row it reads (one seek each), not each
    #: aggregate once, so it reads fewer windows than the other engines' (Engine.BLOCKED_SCAN).
    BLOCKED_SCAN = 8

    def window_read(self, eligible: str, size: str) -> str:
        """The claim window's read: ``size`` (an expression) ``eligible`` rows as (id,
        aggregate_id, status, attempts), oldest first, skipping rows other claims lock
        (READPAST)."""
        t = self.table
        # Two walks of claim_ready (next_retry_at, id), each stopped after the window, then the
        # oldest of both: the rows without a time in id order (the index's, IS NULL a seek) and
        # the due ones in the order of their time (the index's too); rows waiting for a later
        # time are never read (docs/internals.md, "Rows waiting for a later time are not read").
        # One row per id: the walks read without a snapshot and next_retry_at is a key, so a row
        # another relay claims and releases between the two reads is in both, and @win's
        # PRIMARY KEY refused the second (error 2627; docs/sqlserver.md, "The claim's statements").
        walk = f"FROM {t} WITH (READCOMMITTEDLOCK, READPAST, ROWLOCK)\nWHERE {eligible}"
        columns = f"SELECT TOP ({size}) id, {self.chain_key()} AS aggregate_id, status, attempts"
        return (f"SELECT TOP ({size}) w.id, MIN(w.aggregate_id) AS aggregate_id, MIN(w.status) AS status, "
                "MIN(w.attempts) AS attempts FROM (\n"
                f"SELECT r.* FROM ({columns}\n{walk} AND next_retry_at IS NULL\nORDER BY next_retry_at, id) AS r\n"
                f"UNION ALL\nSELECT d.* FROM ({columns}\n{walk} AND next_retry_at <= SYSUTCDATETIME()\n"
                "ORDER BY next_retry_at, id) AS d) AS w\nGROUP BY w.id\nORDER BY w.id")

    def window_insert(self, eligible: str, read_past: bool = False) -> str:
        """``@win``: a window of ``@window`` eligible rows (``Engine.window_sql``), read without
        update locks, skipping rows other claims lock (READPAST). ``read_past`` (``Engine.claim_pass``): up to
        ``BLOCKED_SCAN`` windows of them, keeping only rows of aggregates whose first open
        row, ``@behind`` left out, may be taken now (``Engine.unblocked_rows``). That probe
        reads past locked rows too: it only chooses the window, and the probes and locks
        after it decide what is claimed (``probe_select``)."""
        t = self.table
        read = self.window_read(eligible, "@window" if not read_past else f"@window * {self.BLOCKED_SCAN}")
        if not read_past:
            return f"INSERT INTO @win (id, aggregate_id, status, attempts)\n{read};"
        seek = self.probe_seek()
        return f"""INSERT INTO @win (id, aggregate_id, status, attempts)
SELECT TOP (@window) s.id, s.aggregate_id, s.status, s.attempts
FROM ({read}) AS s
WHERE NOT EXISTS (
    SELECT 1 FROM (
        SELECT TOP (1) e.status, e.next_retry_at, e.claimed_at
        FROM {t} AS e WITH (READCOMMITTEDLOCK, READPAST, {seek})
        WHERE e.aggregate_id = s.aggregate_id AND e.{OPEN_ROWS}
          AND NOT EXISTS (SELECT 1 FROM @behind AS b WHERE b.id = e.id)
        ORDER BY e.id) AS f
    WHERE NOT ({eligible}))
ORDER BY s.id;"""

    def claim_statements(self, own_transaction: bool = False, read_past: bool = False) -> list[str]:
        """The claim, one statement per item; run as one batch. Parameters: ``claim_params``.

        ``own_transaction`` (the relay's claim, run on an autocommit connection by
        ``statement_alone``): the batch opens its transaction and commits it right after the
        UPDATE, so claim and COMMIT are one round trip and no moment exists when the
        claim's locks wait for the client (docs/relay.md, "A network cut"). Without it (a
        caller's open transaction) there is no BEGIN TRAN/COMMIT: the driver has a
        transaction open already (an explicit one would nest) and the caller commits.
        Either way XACT_ABORT makes any error roll the whole claim back.
        ``@cand.aggregate_id`` and ``@agg.aggregate_id`` take the table column's
        collation: two different column collations in one comparison fail with error 468.
        """
        t = self.table
        eligible = self.eligible().replace("?", "@expired_ms")  # one parameter, three uses
        out_columns = ", ".join(f"o.{c}" for c in MESSAGE_COLUMNS)
        output = ", ".join(f"CAST(inserted.{c} AS NVARCHAR(MAX))" if c in ("payload", "headers")
                           else f"inserted.{c}" for c in MESSAGE_COLUMNS)
        collation = self.id_collation or ID_COLLATION
        return [
            "DECLARE @nocount INT = @@OPTIONS & 512, @xact_abort INT = @@OPTIONS & 16384;",
            "SET NOCOUNT ON;",
            "SET XACT_ABORT ON;",
            *(["BEGIN TRANSACTION;"] if own_transaction else []),
            "DECLARE @batch INT = ?, @window INT = ?, @max_attempts INT = ?, @lease CHAR(32) = ?, "
            "@lease_error NVARCHAR(4000) = ?, @expired_ms INT = ?, @behind_ids NVARCHAR(MAX) = ?, @heads INT;",
            # The claim's ``behind`` rows (a JSON array of ids): no blockers (probe_select).
            # Without OPENJSON (compatibility level below 130) the list stays empty: this
            # process's own rows then block as everyone's do, as before ``behind`` existed.
            "DECLARE @behind TABLE (id BIGINT NOT NULL PRIMARY KEY);",
            *(["INSERT INTO @behind (id) SELECT DISTINCT CAST([value] AS BIGINT) FROM OPENJSON(@behind_ids);"]
              if self.has_json else []),
            *(f"DECLARE {name} TABLE (id BIGINT NOT NULL PRIMARY KEY, aggregate_id NVARCHAR(255) COLLATE {collation} "
              "NOT NULL, status TINYINT NOT NULL, attempts INT NOT NULL, UNIQUE (aggregate_id, id));"
              for name in ("@win", "@cand")),
            # @free is kept in head order (its key) so the heads are locked oldest first, a seek
            # each, and TOP stops at the batch's need without sorting (locking) every head.
            f"DECLARE @free TABLE (head BIGINT NOT NULL PRIMARY KEY, aggregate_id NVARCHAR(255) COLLATE {collation} "
            "NOT NULL UNIQUE, blocker BIGINT NULL);",
            f"DECLARE @agg TABLE (aggregate_id NVARCHAR(255) COLLATE {collation} NOT NULL PRIMARY KEY, "
            "head BIGINT NOT NULL, blocker BIGINT NULL);",
            "DECLARE @held TABLE (id BIGINT NOT NULL PRIMARY KEY);",
            *(f"DECLARE {name} TABLE (id BIGINT NOT NULL PRIMARY KEY, head BIGINT NOT NULL, dead BIT NOT NULL);"
              for name in ("@plan", "@chain")),
            # Declared in MESSAGE_COLUMNS order: OUTPUT ... INTO @out fills it by position.
            "DECLARE @out TABLE (" + ", ".join(f"{c} {_MESSAGE_TYPES[c]}" for c in MESSAGE_COLUMNS) + ");",
            # Choose the chains (docs/sqlserver.md, "The claim's statements and their plans"):
            # the window read without update locks; the rule over it as if every row were
            # ours (@plan); as many of its heads as the batch takes, locked oldest first,
            # skipping heads another claim holds (READPAST), so two claims that overlap take
            # disjoint chains; then the held chains' rows of @plan, locked.
            self.window_insert(eligible, read_past),
            f"INSERT INTO @free (aggregate_id, head, blocker)\n{self.probe_select('@win')};",
            f"INSERT INTO @plan (id, head, dead)\n{self.chain_select('@win', '@free')};",
            "DELETE FROM @free WHERE head NOT IN (SELECT p.head FROM @plan AS p);",
            "SELECT @heads = COUNT(DISTINCT r.head) FROM (\n"
            "    SELECT head, ROW_NUMBER() OVER (ORDER BY head, id) AS n FROM @plan) AS r\n"
            "WHERE r.n <= @batch;",
            f"INSERT INTO @held (id)\n"
            f"SELECT TOP (@heads) o.id FROM @free AS f\n"
            f"INNER JOIN {t} AS o WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK, FORCESEEK) ON o.id = f.head\n"
            f"WHERE {eligible}\n"
            f"ORDER BY f.head;",
            # Lock the held chains' rows; the rule below runs again on what was locked.
            f"INSERT INTO @cand (id, aggregate_id, status, attempts)\n"
            f"SELECT o.id, {self.chain_key('o.')}, o.status, o.attempts\n"
            f"FROM (SELECT TOP (@batch) p.id FROM @plan AS p INNER JOIN @held AS h ON h.id = p.head\n"
            f"      ORDER BY p.head, p.id) AS k\n"
            f"INNER JOIN {t} AS o WITH (READCOMMITTEDLOCK, READPAST, UPDLOCK, ROWLOCK, FORCESEEK) ON o.id = k.id\n"
            f"WHERE {eligible};",
            f"INSERT INTO @agg (aggregate_id, head, blocker)\n{self.probe_select()};",
            f"INSERT INTO @chain (id, head, dead)\n{self.chain_select()};",
            # Keep @batch rows of the window's chains: whole chains, oldest chain first
            # (Engine.claim_window; a chain's first row is its aggregate's head); the other
            # candidates' U locks go with the transaction. One numbering pass, no join.
            "WITH ranked AS (SELECT id, ROW_NUMBER() OVER (ORDER BY head, id) AS n FROM @chain)\n"
            "DELETE FROM ranked WHERE n > @batch;",
            # SET expressions read the row as it was before this UPDATE, so every CASE
            # sees the old status and attempts. FORCESEEK: one clustered seek per chosen
            # row, whatever row count the plan was compiled for.
            f"""UPDATE o SET
    attempts = o.attempts + CASE WHEN o.status = 1 THEN 1 ELSE 0 END,
    status = CASE WHEN ch.dead = 1 THEN 4 ELSE 1 END,
    processed_at = CASE WHEN ch.dead = 1 THEN SYSUTCDATETIME() ELSE NULL END,
    last_error = CASE WHEN o.status = 1 THEN @lease_error ELSE o.last_error END,
    claimed_at = SYSUTCDATETIME(),
    next_retry_at = NULL,
    lease_token = @lease
OUTPUT {output} INTO @out
FROM {t} AS o WITH (FORCESEEK) INNER JOIN @chain AS ch ON ch.id = o.id;""",
            *(["COMMIT TRANSACTION;"] if own_transaction else []),
            if_("@xact_abort = 0", "SET XACT_ABORT OFF"),
            if_("@nocount = 0", "SET NOCOUNT OFF"),
            # Leased nothing: one row of NULLs when the window was full (Engine.claim_pass).
            f"SELECT {out_columns} FROM (VALUES (0)) AS one (n) LEFT JOIN @out AS o ON 1 = 1\n"
            "WHERE o.id IS NOT NULL OR (SELECT COUNT(*) FROM @win) >= @window ORDER BY o.id;",
        ]

    def claim_batch(self, own_transaction: bool = False, read_past: bool = False) -> str:
        return "\n".join(self.claim_statements(own_transaction, read_past))

    def claim_params(self, batch: int, lease: str, timeout_ms: int, max_attempts: int,
                     behind: Sequence[int] = ()) -> list[Any]:
        # The DECLARE's seven: the sixth is eligible()'s lease cutoff, the last ``behind``.
        return [batch, self.claim_window(batch), max_attempts, lease, LEASE_EXPIRED_ERROR, -timeout_ms,
                json.dumps(sorted({int(i) for i in behind}))]

    def collation_sql(self) -> str:
        return (f"SELECT collation_name FROM sys.columns WHERE object_id = OBJECT_ID({self._table_literal()}) "
                "AND name = N'aggregate_id'")

    def claim_pass(self, cursor: Any, batch: int, lease: str, timeout_ms: int, max_attempts: int,
                   behind: Sequence[int], *, read_past: bool) -> tuple[list[tuple], bool]:
        """Lease up to ``batch`` rows in the open transaction (the store commits);
        rows whose status is 4 went dead instead (``Engine.claim_pass``); a batch that leased
        nothing answers one row of NULLs when its window was full."""
        if self.id_collation is None:
            row = self.execute(cursor, self.collation_sql()).fetchone()
            if row and row[0]:
                self.id_collation = str(row[0])
        if self.probe_index is None:
            self.probe_index = self.execute(cursor, self.index_matches(self.PROBE_INDEX)).fetchone() is not None
        own = self.commits_each_statement(getattr(cursor, "connection", None))  # run alone: statement_alone
        try:
            self.execute(cursor, self.claim_batch(own, read_past),
                         self.claim_params(batch, lease, timeout_ms, max_attempts, behind))
            rows = result_rows(cursor)
        except BaseException as exc:
            if any(words in str(exc) for words in INDEX_GONE) or INDEX_GONE_ERRORS & error_numbers(str(exc)):
                # The probe's index was dropped (the procedure under "Collations" in
                # docs/sqlserver.md) or disabled while the relay ran: the next claim asks again for it.
                self.probe_index = None
            reset_session(cursor, own)
            raise
        return leased_or_full(rows)
