"""``bench.pipeline``'s SQL Server fill, which no server here runs: it parses as T-SQL
(sqlglot's ``tsql`` dialect), inserts the columns it names, and keeps DATEADD's number
an INT (ROW_NUMBER() is a BIGINT, which DATEADD refuses: error 8116)."""

from __future__ import annotations

import sqlglot
from sqlglot import exp

from bench.pipeline import mssql_fill_sql


def test_the_sql_server_fill_parses_as_tsql() -> None:
    sql = mssql_fill_sql("[dbo].[outbox_bp_src_1]")
    assert sql.count("?") == 1
    tree = sqlglot.parse_one(sql.replace("?", "@rows"), read="tsql")
    insert = tree if isinstance(tree, exp.Insert) else tree.find(exp.Insert)
    assert insert is not None and tree.find(exp.CTE) is not None
    columns = [c.name for c in insert.this.expressions]
    select = insert.expression
    assert len(columns) == len(select.expressions) == 10 and "processed_at" in columns
    assert sql.count("DATEADD(MILLISECOND, CAST(g AS INT)") == 2 and "DATEADD(MILLISECOND, g" not in sql
