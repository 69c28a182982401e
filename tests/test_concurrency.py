"""Racing claimers on PostgreSQL and MariaDB: threads and processes, hot and cold
aggregates, writers committing while claims run, random delays between claim and
ack, and injected failures. Checks that the ordering rule is never broken and that
no row is ever held by two live leases. (SQLite has a single writer; its claim
cannot race.) The race itself is ``claimers.race_claimers`` (SQL Server runs it in
tests/test_mssql_live.py).

The run is bounded: OUTBOX_TEST_RACE_SECONDS per engine (default 8)."""

from __future__ import annotations

from typing import Any

import pytest
from claimers import race_claimers


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_racing_claimers_keep_order_and_never_double_claim(make_store: Any, url: str, kind: str) -> None:
    race_claimers(make_store, url)
