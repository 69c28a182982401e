"""``outbox.transaction(conn)`` on a pyodbc or mssql-python connection, checked where no SQL
Server runs (docs/waking-and-metrics.md, "outbox.transaction").

The statements the engine sends are recorded by a fake connection and run through
``Session``, a model of what SQL Server does with a session's transaction count, written
from Microsoft's documentation of the statements involved:

- autocommit off is IMPLICIT_TRANSACTIONS ON (the ODBC driver sets it with
  SQL_AUTOCOMMIT_OFF); then INSERT, UPDATE, DELETE, SELECT from a table and BEGIN
  TRANSACTION, among others, start a transaction when none is open, and an explicit BEGIN
  TRANSACTION then opens two (SET IMPLICIT_TRANSACTIONS);
- SAVE TRANSACTION needs an open transaction (error 628) and starts none;
- COMMIT TRANSACTION at @@TRANCOUNT > 1 only decrements the count;
- ROLLBACK TRANSACTION <savepoint> needs that savepoint (error 6401) and a committable
  transaction (XACT_STATE() = 1, error 3931 otherwise), and keeps the count;
- the driver's ``commit()`` and ``rollback()`` end the transaction. How the driver's commit
  treats @@TRANCOUNT 2 is not documented, so the model refuses it: the engine must never
  leave the count above 1 for the driver.

Every statement is parsed with sqlglot's tsql dialect (``tsql_support.parse_one``), and the
model runs the parsed tree, not the text; the one exception is SAVE TRANSACTION, which
sqlglot cannot read (``test_sqlglot_cannot_read_save_transaction``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlglot
from fake_dbapi import RecordingConnection, RecordingCursor
from sqlglot import exp
from tsql_support import parse_one

import outbox
import outbox.wake as wake

#: SAVE { TRAN | TRANSACTION } savepoint_name: valid T-SQL that sqlglot cannot parse.
SAVE = re.compile(r"^SAVE TRANSACTION (\w+);?$", re.MULTILINE)


class ServerError(Exception):
    """An error SQL Server would raise, by number."""

    def __init__(self, number: int, text: str) -> None:
        super().__init__(f"{text} ({number})")
        self.number = number


class Session:
    """A SQL Server session's transaction state, as the statements here change it."""

    def __init__(self, implicit: bool) -> None:
        self.implicit = implicit  # IMPLICIT_TRANSACTIONS, i.e. autocommit off
        self.trancount = 0
        self.savepoints: list[str] = []
        self.doomed = False  # XACT_STATE() = -1: only a full rollback is allowed
        self.selected: list[tuple[int]] | None = None  # the rows of a SELECT of a value (XACT_STATE())

    def xact_state(self) -> int:
        return 0 if self.trancount == 0 else -1 if self.doomed else 1

    def run_batch(self, batch: str) -> None:
        """Each statement of ``batch`` in order: SAVE TRANSACTION by its text, every other
        one parsed (exactly one statement per piece, nothing sqlglot did not understand)."""
        pieces = SAVE.split(batch)
        for i, piece in enumerate(pieces):
            if i % 2:  # a savepoint name captured by SAVE
                self.save(piece)
            elif piece.strip():
                self.run(parse_one(piece.strip()))

    def save(self, name: str) -> None:
        if self.trancount == 0:
            raise ServerError(628, "Cannot issue SAVE TRANSACTION when there is no active transaction.")
        self.savepoints.append(name)

    def begin(self) -> None:
        self.trancount += 2 if self.implicit and self.trancount == 0 else 1

    def starts_implicitly(self) -> None:
        if self.implicit and self.trancount == 0:
            self.trancount = 1

    def end(self) -> None:
        self.trancount, self.savepoints, self.doomed = 0, [], False

    def run(self, node: exp.Expression) -> None:
        if isinstance(node, exp.IfBlock):
            if self.value(node.this):
                for statement in node.args["true"].expressions:
                    self.run(statement)
        elif isinstance(node, exp.Transaction):
            self.begin()
        elif isinstance(node, exp.Commit):
            if self.trancount == 0:
                raise ServerError(3902, "The COMMIT TRANSACTION request has no corresponding BEGIN TRANSACTION.")
            if self.trancount > 1:
                self.trancount -= 1
            else:
                self.end()
        elif isinstance(node, exp.Rollback):
            name = node.this.name if node.this else None
            if name is None:
                self.end()
            elif self.trancount == 0 or name not in self.savepoints:
                raise ServerError(6401, f"Cannot roll back {name}. No transaction or savepoint of that name was found.")
            elif self.doomed:
                raise ServerError(3931, "The current transaction cannot be committed and cannot be rolled back "
                                        "to a savepoint.")
            else:
                del self.savepoints[self.savepoints.index(name) + 1:]
        elif isinstance(node, (exp.Insert, exp.Update, exp.Delete)):
            self.starts_implicitly()
        elif isinstance(node, exp.Select) and not node.args.get("from") and len(node.expressions) == 1:
            self.selected = [(self.value(node.expressions[0]),)]  # SELECT XACT_STATE(): no transaction starts
        elif not isinstance(node, exp.EndStatement):
            raise AssertionError(f"the model does not know {node.sql('tsql')!r}")

    def value(self, node: exp.Expression) -> int:
        if isinstance(node, exp.Literal):
            return int(node.this)
        if isinstance(node, exp.Parameter) and node.sql("tsql").upper() == "@@TRANCOUNT":
            return self.trancount
        if isinstance(node, exp.Anonymous) and node.name.upper() == "XACT_STATE":
            return self.xact_state()
        if isinstance(node, exp.EQ):
            return int(self.value(node.this) == self.value(node.expression))
        if isinstance(node, exp.GT):
            return int(self.value(node.this) > self.value(node.expression))
        if isinstance(node, exp.And):
            return int(bool(self.value(node.this)) and bool(self.value(node.expression)))
        raise AssertionError(f"the model does not know {node.sql('tsql')!r}")


class SessionCursor(RecordingCursor):
    """A cursor whose statements run on the connection's ``Session``."""

    connection: PyodbcConnection

    def execute(self, sql: str, params: Any = ()) -> SessionCursor:
        super().execute(sql, params)
        session = self.connection.session
        session.selected = None
        session.run_batch(sql)
        if session.selected is not None:
            self.rows = session.selected
        return self


class PyodbcConnection(RecordingConnection):
    """A pyodbc connection as ``outbox.transaction`` sees it: its module says pyodbc, and
    ``autocommit`` is the driver's switch (off: IMPLICIT_TRANSACTIONS ON)."""

    cursor_class = SessionCursor

    def __init__(self, autocommit: bool) -> None:
        super().__init__()
        self.session = Session(implicit=not autocommit)
        self._autocommit = autocommit
        self.ended: list[tuple[str, int]] = []  # (commit or rollback, @@TRANCOUNT then)

    @property  # type: ignore[override]
    def autocommit(self) -> bool:
        return self._autocommit

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        if value and self.session.trancount:  # switching autocommit on commits (ODBC)
            self.commit()
        self._autocommit = value
        if hasattr(self, "session"):
            self.session.implicit = not value

    def commit(self) -> None:
        assert self.session.trancount <= 1, "@@TRANCOUNT 2 at the driver's commit: the work would stay uncommitted"
        self.ended.append(("commit", self.session.trancount))
        self.session.end()

    def rollback(self) -> None:
        self.ended.append(("rollback", self.session.trancount))
        self.session.end()


PyodbcConnection.__module__ = "pyodbc"


@pytest.fixture(autouse=True)
def no_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wake, "request_claim", lambda: True)


@pytest.fixture(params=[False, True], ids=["autocommit off", "autocommit on"])
def conn(request: pytest.FixtureRequest) -> Iterator[PyodbcConnection]:
    yield PyodbcConnection(autocommit=bool(request.param))


def write(conn: PyodbcConnection, order_id: int) -> None:
    cursor = conn.cursor()
    cursor.execute(f"INSERT INTO orders (id) VALUES ({order_id})")
    cursor.close()


def test_sqlglot_cannot_read_save_transaction() -> None:
    """SAVE TRANSACTION is T-SQL's savepoint (SAVE { TRAN | TRANSACTION } savepoint_name), and
    the only way to roll back part of a transaction; sqlglot's tsql dialect raises ParseError
    on it, so it is the one statement here checked by its text (``SAVE``) instead. When this
    test fails, sqlglot has learnt it: parse it like the others."""
    with pytest.raises(sqlglot.errors.ParseError):
        sqlglot.parse("SAVE TRANSACTION outbox_block_1", read="tsql")


@pytest.mark.parametrize("work_first", [False, True], ids=["nested block first", "outer work first"])
def test_a_nested_block_opens_the_transaction_it_saves_a_point_in(
        conn: PyodbcConnection, work_first: bool, no_sqlglot_fallbacks: None) -> None:
    """The outer block only switched autocommit off (IMPLICIT_TRANSACTIONS ON), and SAVE
    TRANSACTION starts no implicit transaction: a helper's block run as the first thing in
    the caller's failed with error 628 (found in review). Now the savepoint's batch opens the
    transaction when none is open, leaving @@TRANCOUNT at 1 for the driver's commit."""
    with outbox.transaction(conn):
        if work_first:
            write(conn, 1)
        with outbox.transaction(conn):
            write(conn, 2)
        assert conn.session.trancount == 1 and conn.session.savepoints == ["outbox_block_1"]
    assert conn.ended == [("commit", 1)] and conn.session.trancount == 0


def test_a_nested_block_that_raises_rolls_back_to_its_savepoint(
        conn: PyodbcConnection, no_sqlglot_fallbacks: None) -> None:
    with outbox.transaction(conn):
        with pytest.raises(ValueError), outbox.transaction(conn):
            write(conn, 1)
            raise ValueError("helper failure")
        assert conn.session.trancount == 1
        with outbox.transaction(conn), outbox.transaction(conn):  # two deep: a savepoint in a savepoint
            write(conn, 2)
        assert conn.session.savepoints == ["outbox_block_1", "outbox_block_1", "outbox_block_2"]
    assert conn.ended == [("commit", 1)]


def test_without_implicit_transactions_the_nested_block_opens_one_transaction(no_sqlglot_fallbacks: None) -> None:
    """A caller that turned IMPLICIT_TRANSACTIONS off itself: BEGIN TRANSACTION opens one
    transaction, and no COMMIT runs."""
    conn = PyodbcConnection(autocommit=False)
    with outbox.transaction(conn):
        conn.session.implicit = False
        with outbox.transaction(conn):
            assert conn.session.trancount == 1
    assert conn.ended == [("commit", 1)]


@pytest.mark.parametrize("after", ["deadlock", "doomed", "deadlock, then more work"])
def test_a_nested_block_whose_transaction_is_gone_raises_its_own_error(
        conn: PyodbcConnection, after: str, no_sqlglot_fallbacks: None) -> None:
    """A deadlock victim's whole transaction is rolled back (1205: XACT_STATE() 0), and an
    error under XACT_ABORT dooms it (-1): ROLLBACK TRANSACTION <savepoint> then raised 6401
    or 3931, which replaced the deadlock a caller retries on (found in review). Now the
    rollback runs only where it can, its own failure is logged, and the block's error is
    what the caller sees."""
    deadlock = ServerError(1205, "Transaction (Process ID 52) was deadlocked on lock resources with another "
                                 "process and has been chosen as the deadlock victim. Rerun the transaction.")
    with pytest.raises(ServerError) as raised, outbox.transaction(conn), outbox.transaction(conn):
        write(conn, 1)
        if after == "doomed":
            conn.session.doomed = True
        else:
            conn.session.end()
        if after == "deadlock, then more work":  # a new implicit transaction, without the savepoint
            write(conn, 2)
        raise deadlock
    assert raised.value is deadlock
    assert conn.ended[-1][0] == "rollback" and conn.session.trancount == 0


def test_a_nested_block_that_lost_the_transaction_makes_the_outer_block_roll_back(conn: PyodbcConnection) -> None:
    """Found in review: a caller that catches the deadlock of a nested block and carries on
    wrote into a new implicit transaction, which the outer block then committed, while the
    outer block's work before the deadlock was gone: half a transaction. The outer block now
    rolls back and says so."""
    from outbox.core.errors import StoreError

    deadlock = ServerError(1205, "Transaction (Process ID 52) was deadlocked on lock resources.")
    with pytest.raises(StoreError, match="lost the transaction"), outbox.transaction(conn):
        write(conn, 1)
        with pytest.raises(ServerError), outbox.transaction(conn):
            conn.session.end()  # the deadlock rolled back the whole transaction
            raise deadlock
        write(conn, 2)  # the caller carries on: a new implicit transaction
    assert conn.ended[-1][0] == "rollback", conn.ended
    assert all(kind != "commit" for kind, _ in conn.ended), conn.ended
