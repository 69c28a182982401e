"""A recording DB-API cursor and connection, for tests that check the SQL an engine sends
without a server (the SQL Server engine and its queue tables: tests/test_mssql_sql.py,
tests/test_mssql_deploy.py, tests/test_transport_mssql_sql.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Rows = list[tuple]


class RecordingCursor:
    """Records each (sql, params) in ``log`` and what ``setinputsizes`` declared for it in
    ``sizes``. Answers a statement with the rows of the first ``answers`` needle it contains,
    else with ``default(sql)``. A statement has a result set when it has rows or is a SELECT
    or a batch (DECLARE ...)."""

    def __init__(self, log: list[tuple[str, tuple]] | None = None, sizes: list | None = None,
                 answers: dict[str, Rows] | None = None, default: Callable[[str], Rows] | None = None) -> None:
        self.log = log if log is not None else []
        self.sizes = sizes if sizes is not None else []
        self.answers = answers or {}
        self.default = default or (lambda sql: [])
        self.rows: Rows = []
        self.description: Any = None
        self.rowcount = 1
        self._declared: Any = None

    def setinputsizes(self, sizes: Any) -> None:
        self._declared = sizes

    def execute(self, sql: str, params: Sequence[Any] = ()) -> RecordingCursor:
        self.log.append((sql, tuple(params)))
        self.sizes.append(self._declared)
        found = next((rows for needle, rows in self.answers.items() if needle in sql), None)
        self.rows = found if found is not None else self.default(sql)
        self.description = [("c",)] if self.rows or sql.lstrip().upper().startswith(("SELECT", "DECLARE")) else None
        return self

    def nextset(self) -> bool:
        return False

    def fetchall(self) -> Rows:
        return list(self.rows)

    def fetchone(self) -> tuple | None:
        return self.rows[0] if self.rows else None

    def close(self) -> None:
        pass


class RecordingConnection:
    """A connection whose cursors share one ``log`` (and ``sizes``) and answer alike;
    ``cursor_class`` makes them."""

    cursor_class: type[RecordingCursor] = RecordingCursor

    def __init__(self, answers: dict[str, Rows] | None = None) -> None:
        self.log: list[tuple[str, tuple]] = []
        self.sizes: list[Any] = []
        self.answers = answers or {}
        self.commits = 0
        self.autocommit = False  # the relay's connections: pyodbc and mssql-python take it
        self.timeout = 0

    def cursor(self) -> RecordingCursor:
        cursor = self.cursor_class(self.log, self.sizes, self.answers)
        cursor.connection = self  # type: ignore[attr-defined]
        return cursor

    def commit(self) -> None:
        self.commits += 1

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass
