"""T-SQL checked without a server: sqlglot's ``tsql`` dialect must understand every statement
(tests/test_mssql_sql.py, test_mssql_deploy.py, test_transport_mssql_sql.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import sqlglot
from sqlglot import exp


@pytest.fixture
def no_sqlglot_fallbacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """sqlglot logs and returns an opaque Command for syntax it does not understand;
    that would make "parses" meaningless, so any such warning fails the test."""
    with caplog.at_level(logging.WARNING, logger="sqlglot"):
        yield
    fallbacks = [r.getMessage() for r in caplog.records if r.name.startswith("sqlglot")]
    assert not fallbacks, fallbacks


def parse_one(sql: str) -> exp.Expression:
    """Exactly one T-SQL statement, fully understood."""
    parsed = sqlglot.parse(sql, read="tsql")
    assert len(parsed) == 1 and parsed[0] is not None, sql
    assert not list(parsed[0].find_all(exp.Command)), f"sqlglot did not understand part of:\n{sql}"
    return parsed[0]
