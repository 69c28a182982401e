"""``bench.pipeline``'s fills. The SQL Server one, which no server here runs, parses as
T-SQL (sqlglot's ``tsql`` dialect), inserts the columns it names, and keeps DATEADD's number
an INT (ROW_NUMBER() is a BIGINT, which DATEADD refuses: error 8116). The SQLite one, run
for real, writes message ids in the rows' order or at random as asked."""

from __future__ import annotations

import pytest
import sqlglot
from sqlglot import exp

from bench.pipeline import fill, mssql_fill_sql
from outbox.storage.store import OutboxStore


@pytest.mark.parametrize("ids", ["ordered", "random"])
def test_the_sql_server_fill_parses_as_tsql(ids: str) -> None:
    sql = mssql_fill_sql("[dbo].[outbox_bp_src_1]", ids)
    assert sql.count("?") == 1
    tree = sqlglot.parse_one(sql.replace("?", "@rows"), read="tsql")
    insert = tree if isinstance(tree, exp.Insert) else tree.find(exp.Insert)
    assert insert is not None and tree.find(exp.CTE) is not None
    columns = [c.name for c in insert.this.expressions]
    select = insert.expression
    assert len(columns) == len(select.expressions) == 10 and "processed_at" in columns
    assert sql.count("DATEADD(MILLISECOND, CAST(g AS INT)") == 2 and "DATEADD(MILLISECOND, g" not in sql
    assert ("HASHBYTES" in sql) == (ids == "random")


@pytest.mark.parametrize("ids", ["ordered", "random"])
def test_the_fill_orders_message_ids_as_asked(tmp_path, ids: str) -> None:
    store = OutboxStore(f"sqlite:///{tmp_path / 'fill.db'}")
    try:
        store.migrate()
        fill(store, 300, ids)
        with store.transaction() as c:
            c.execute("SELECT message_id FROM outbox ORDER BY id")
            got = [row[0] for row in c.fetchall()]
    finally:
        store.close()
    assert len(got) == len(set(got)) == 300
    assert (got == sorted(got)) == (ids == "ordered")
