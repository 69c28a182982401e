"""The bounds on every relay transaction's life (docs/relay.md, "A network cut"): the URL
parameters and what each engine makes of them at connect (pure), then, on the real servers,
that a relay session carries them and that the server ends a transaction left idle.
The network cut itself, end to end: tests/test_network_cut_e2e.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from engine_support import drop_table
from relay_e2e_support import Proxy
from relay_support import run_python
from services import MYSQL_URL, POSTGRES_URL, require

from outbox.core.config import SESSION_BOUNDS, load_settings, session_bounds, without_session_bounds
from outbox.core.errors import ConfigError
from outbox.storage.engines import engine_for_url
from outbox.storage.engines.base import tcp_keepalive
from outbox.storage.engines.mysql import MysqlEngine, session_sql, socket_options
from outbox.storage.engines.postgres import PostgresEngine, connect_params, libpq_url, session_settings
from outbox.storage.store import OutboxStore

PG = "postgresql://app:secret@db.example:5432/app"


# -- the URL parameters ------------------------------------------------------------------------

def test_the_bounds_default_to_seconds_and_the_url_overrides_them() -> None:
    assert session_bounds(PG) == {"idle_transaction_timeout_s": 5, "tcp_timeout_s": 10}
    assert session_bounds(PG + "?idle_transaction_timeout_s=30&sslmode=require") == {
        "idle_transaction_timeout_s": 30, "tcp_timeout_s": 10}
    assert {name: default for name, (default, _, _) in SESSION_BOUNDS.items()} == session_bounds(PG)


@pytest.mark.parametrize("query, problem", [
    ("idle_transaction_timeout_s=abc", "idle_transaction_timeout_s='abc' is not a whole number of seconds"),
    ("idle_transaction_timeout_s=0", "idle_transaction_timeout_s=0 must be between 1 and 3600 seconds"),
    ("tcp_timeout_s=1", "tcp_timeout_s=1 must be between 2 and 3600 seconds"),
    ("tcp_timeout_s=99999", "tcp_timeout_s=99999 must be between 2 and 3600 seconds"),
])
def test_a_bad_bound_stops_start_up_naming_the_setting_and_the_parameter(query: str, problem: str) -> None:
    for url in (f"{PG}?{query}", f"mysql://root@db/app?{query}"):
        with pytest.raises(ConfigError) as info:
            load_settings(environ={"OUTBOX_DATABASE_URL": url})
        assert str(info.value) == f"OUTBOX_DATABASE_URL: {problem}"


def test_the_driver_never_sees_the_engines_own_parameters() -> None:
    url = PG + "?idle_transaction_timeout_s=7&options=-c%20search_path%3Dapp&tcp_timeout_s=4"
    assert without_session_bounds(url) == PG + "?options=-c%20search_path%3Dapp"
    assert without_session_bounds(PG + "?sslmode=require") == PG + "?sslmode=require"  # untouched
    assert libpq_url("postgresql+psycopg://app@db/app?tcp_timeout_s=4") == "postgresql://app@db/app"


@pytest.mark.parametrize("seconds", range(2, 121))
def test_keepalive_probes_find_a_silent_peer_within_the_tcp_timeout(seconds: int) -> None:
    idle, interval, count = tcp_keepalive(seconds)
    assert min(idle, interval, count) >= 1
    assert seconds * 0.7 <= idle + interval * count <= seconds


# -- PostgreSQL ---------------------------------------------------------------------------------

def test_postgres_connections_carry_client_side_tcp_bounds_unless_the_url_sets_them() -> None:
    params = connect_params(PG + "?tcp_timeout_s=10&idle_transaction_timeout_s=5")
    assert params == {"user": "app", "password": "secret", "host": "db.example", "port": "5432", "dbname": "app",
                      "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 1,
                      "keepalives_count": 3, "tcp_user_timeout": 10000}
    own = connect_params(PG + "?keepalives_idle=60&connect_timeout=3")
    assert own["keepalives_idle"] == "60" and own["connect_timeout"] == "3" and own["keepalives_count"] == 3


def test_postgres_sessions_end_idle_transactions_and_silent_clients_on_the_server() -> None:
    assert session_settings(PG, 150000) == {
        "idle_in_transaction_session_timeout": "5000", "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "1", "tcp_keepalives_count": "3", "tcp_user_timeout": "10000"}
    # tcp_user_timeout came with PostgreSQL 12: not asked of an older server.
    assert "tcp_user_timeout" not in session_settings(PG + "?idle_transaction_timeout_s=2", 110000)
    assert session_settings(PG + "?idle_transaction_timeout_s=2", 110000)[
        "idle_in_transaction_session_timeout"] == "2000"


def test_the_postgres_claim_alone_commits_itself_and_an_ended_session_is_retried() -> None:
    import psycopg

    engine = PostgresEngine()
    assert engine.one_statement_claim and not MysqlEngine().one_statement_claim
    ended = psycopg.errors.IdleInTransactionSessionTimeout("terminating connection due to idle-in-transaction timeout")
    assert engine.is_transient(ended) and engine.is_disconnect(ended)


# -- MySQL and MariaDB ---------------------------------------------------------------------------

def test_mysql_and_mariadb_sessions_end_idle_transactions_each_their_way() -> None:
    assert session_sql("10.11.19-MariaDB-0+deb12u1", 5, 10) == (
        "SET SESSION idle_transaction_timeout = 5, SESSION net_read_timeout = 10, "
        "SESSION net_write_timeout = 10, SESSION innodb_lock_wait_timeout = 10")
    # MySQL has no idle-transaction timeout: an idle session ends, the store reconnects.
    assert session_sql("8.0.36", 5, 10).startswith("SET SESSION wait_timeout = 5, ")


def test_mysql_sockets_find_a_silent_server_within_the_tcp_timeout() -> None:
    options = {option: value for _, option, value in socket_options(10)}
    assert options[socket.SO_KEEPALIVE] == 1 and options[socket.TCP_NODELAY] == 1
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
        assert options[socket.TCP_USER_TIMEOUT] == 10000
        assert (options[socket.TCP_KEEPIDLE], options[socket.TCP_KEEPINTVL], options[socket.TCP_KEEPCNT]) == (5, 1, 3)


def test_pymysql_read_and_write_timeouts_come_from_the_url_only_when_asked() -> None:
    from outbox.storage.engines.mysql import pymysql_kwargs

    assert "read_timeout" not in pymysql_kwargs("mysql://root@db/app")
    kwargs = pymysql_kwargs("mysql://root@db/app?read_timeout=30&write_timeout=20&tcp_timeout_s=4")
    assert (kwargs["read_timeout"], kwargs["write_timeout"]) == (30, 20)
    with pytest.raises(ValueError, match="OUTBOX_DATABASE_URL: read_timeout='soon' is not a whole number"):
        pymysql_kwargs("mysql://root@db/app?read_timeout=soon")
    with pytest.raises(ValueError, match="write_timeout=0 must be at least 1 second"):
        pymysql_kwargs("mysql://root@db/app?write_timeout=0")


def test_a_connection_the_mysql_server_ended_for_inactivity_is_retried() -> None:
    import pymysql

    ended = pymysql.err.OperationalError(4031, "The client was disconnected by the server because of inactivity.")
    assert MysqlEngine().is_transient(ended) and MysqlEngine().is_disconnect(ended)


# -- on the servers ----------------------------------------------------------------------------

SERVERS = {"postgresql": (POSTGRES_URL, 5432), "mysql": (MYSQL_URL, 3306)}


def with_bounds(url: str, **bounds: int) -> str:
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in bounds.items())


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_the_server_ends_a_relay_transaction_left_idle_and_its_locks_with_it(kind: str) -> None:
    """A relay connection that stops in the middle of a transaction holding a row lock (its
    client stalled, or the network cut) loses the transaction after idle_transaction_timeout_s;
    the lock is free again, and the store's next operation runs on a new connection."""
    url, port = SERVERS[kind]
    require(kind, "127.0.0.1", port)
    table = f"bounds_{int(time.time() * 1000) % 10**9}"
    store = OutboxStore(with_bounds(url, idle_transaction_timeout_s=1), table=table)
    store.migrate()
    other = OutboxStore(url, table=table)
    try:
        from outbox import enqueue

        with store.transaction() as cursor:
            enqueue(cursor.connection, topic="t", aggregate_type="a", aggregate_id="1", payload={}, table=table)
        lock = f"SELECT id FROM {store.engine.table} WHERE id = 1 FOR UPDATE"
        conn = store.connection()
        cursor = store.engine.cursor_for(conn)
        store.engine.execute(cursor, lock).fetchall()  # a transaction left open, holding row 1
        time.sleep(2.5)
        nowait = lock + (" NOWAIT" if kind == "postgresql" else " SKIP LOCKED")
        with other.transaction() as free:
            assert [tuple(r) for r in store.engine.execute(free, nowait).fetchall()] == [(1,)], (
                "the idle transaction still holds row 1")
        assert store.stats().counts["pending"] == 1  # the store reconnects by itself
    finally:
        other.close()
        drop_table(store)
        store.close()


#: The statement after which a claim is committed on the server, per engine: PostgreSQL's
#: claim is one statement run alone; the generic claim's COMMIT (PyMySQL's COM_QUERY).
CLAIM_COMMITS = {"postgresql": b"FOR UPDATE OF c SKIP LOCKED", "mysql": b"\x03COMMIT"}


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_the_gauges_read_again_on_a_new_connection_when_the_server_ended_the_idle_one(kind: str) -> None:
    """MySQL ends a relay session idle for ``wait_timeout`` (5 s: ``session_sql``), and the
    metrics' refresher reads the gauges every 5 s on a connection of its own: the read
    after an idle spell failed ("MySQL server has gone away"), a WARNING every minute and
    gauges a refresh behind (found in review). ``gauges`` now tries once more on a new
    connection after a disconnect. The session is ended here from another one, at once."""
    url, port = SERVERS[kind]
    require(kind, "127.0.0.1", port)
    table = f"gauges_{int(time.time() * 1000) % 10**9}"
    store = OutboxStore(url, table=table)
    store.migrate()
    other = OutboxStore(url, table=table)
    mine, end = (("SELECT pg_backend_pid()", "SELECT pg_terminate_backend(?)") if kind == "postgresql"
                 else ("SELECT CONNECTION_ID()", "KILL ?"))
    try:
        assert store.gauges() == (0, 0, 0.0)
        with store.transaction() as cursor:
            session = store.engine.execute(cursor, mine).fetchone()[0]
        with other.transaction() as cursor:
            other.engine.execute(cursor, end, [session])
        time.sleep(0.2)
        assert store.gauges() == (0, 0, 0.0)
    finally:
        other.close()
        drop_table(store)
        store.close()


@contextmanager
def behind_a_proxy(kind: str) -> Iterator[tuple[Proxy, OutboxStore, OutboxStore]]:
    """A table holding chains ``a`` (ids 1-3) and ``b`` (4); a store reaching it through a
    proxy, with a claim timeout of 10 minutes, and another store reaching it directly."""
    from outbox import enqueue

    url, port = SERVERS[kind]
    require(kind, "127.0.0.1", port)
    table = f"lost_{int(time.time() * 1000) % 10**9}"
    proxy = Proxy(("127.0.0.1", port))
    store = OutboxStore(proxy.url_for(url), table=table, claim_timeout_ms=600_000)
    store.migrate()
    other = OutboxStore(url, table=table)
    try:
        with other.transaction() as cursor:
            for aggregate in ("a", "a", "a", "b"):
                enqueue(cursor.connection, topic="t", aggregate_type="x", aggregate_id=aggregate, payload={},
                        table=table)
        yield proxy, store, other
    finally:
        other.close()
        proxy.restore()
        drop_table(store)
        store.close()
        proxy.close()


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_claim_whose_answer_was_lost_after_it_committed_returns_what_it_took(kind: str) -> None:
    """The connection drops after the server committed a claim and before its answer
    arrived: the store runs the claim again on a new connection, and that run returns the
    rows the first one leased instead of claiming others and leaving those held by a lease
    nobody knows for the whole claim timeout (docs/relay.md, "A network cut")."""
    with behind_a_proxy(kind) as (proxy, store, other):
        cut = proxy.drop_answer_after(CLAIM_COMMITS[kind])
        claim = store.claim(10)
        assert cut.began.is_set(), "the claim's answer was not cut"
        assert [m.id for m in claim.messages] == [1, 2, 3, 4]
        assert other.claim(10).messages == []  # nothing left held by another lease
        assert store.mark_done([1, 2, 3, 4], claim.lease).applied == 4


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_claim_whose_answer_was_lost_after_it_committed_returns_the_rows_it_buried(kind: str) -> None:
    """As above, with row 4 an expired lease on its last attempt: the claim that was cut
    buried it (dead) and leased 1-3. Its retry found only the leased rows, so row 4 got no
    dead-letter copy, no ERROR line and no metric, and nothing would ever send one (found
    in review). The claim's lease now stays on the rows it buries, and the retry finds them."""
    with behind_a_proxy(kind) as (proxy, store, other):
        with other.transaction() as cursor:
            other.engine.execute(cursor, f"UPDATE {other.engine.table} SET status = 1, attempts = ?, "
                                 f"claimed_at = {other.engine.now_plus_ms()}, lease_token = ? WHERE id = 4",
                                 [store.max_attempts - 1, -3_600_000, "f" * 32])
        cut = proxy.drop_answer_after(CLAIM_COMMITS[kind])
        claim = store.claim(10)
        assert cut.began.is_set(), "the claim's answer was not cut"
        assert [m.id for m in claim.messages] == [1, 2, 3]
        assert [m.id for m in claim.dead] == [4]
        assert store.mark_done([1, 2, 3], claim.lease).applied == 3


#: What commits a ``mark_done``: on PostgreSQL its UPDATE itself, run alone (autocommit).
DONE_COMMITS = {"postgresql": b"SET status = 2, processed_at", "mysql": b"\x03COMMIT"}


def settled_after_a_lost_answer(proxy: Any, store: OutboxStore, commits: bytes, then_cut: bool,
                                caplog: pytest.LogCaptureFixture, settle: Callable[[list[int], str], Any]) -> tuple[Any, list[int]]:
    """Claim the rows and ``settle`` them (``mark_done``, ``release``) with the answer of the
    statement that commits it (``commits``) lost, then run again (with ``then_cut``: after the
    store's own retries all failed, as the ack queue's task does): the repeat counts every row
    applied, with no "no longer holds" WARNING. Returns the claim and its ids."""
    claim = store.claim(10)
    ids = [m.id for m in claim.messages]
    cut = proxy.drop_answer_after(commits, then_cut=then_cut)
    with caplog.at_level("WARNING", logger="outbox"):
        if then_cut:
            fails_on_the_cut(store, lambda: settle(ids, claim.lease))
            proxy.restore()
        result = settle(ids, claim.lease)
    assert cut.began.is_set(), "the settling write's answer was not cut"
    assert (result.requested, result.applied) == (4, 4)
    assert not [r for r in caplog.records if "no longer holds" in r.getMessage()]
    return claim, ids


@pytest.mark.parametrize("then_cut", [False, True])
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_done_whose_answer_was_lost_after_it_committed_counts_as_applied(
        kind: str, then_cut: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Found by ``bench.soak --faults`` (MariaDB and PostgreSQL, Celery and Dramatiq): at
    nearly every database cut a ``mark_done`` committed and lost its answer; its retry (the
    store's own, or with ``then_cut`` the ack queue's ``done`` task after the store's retries
    all failed) found the rows no longer held, counted them stale and logged ``lease ... no
    longer holds ... (expired and re-claimed)``, a WARNING saying the lease was too short
    when nothing had expired. The done row now keeps the lease that settled it (a done row
    is held by nobody: every fenced write needs status 1), so a repeat of that very write
    knows it applied."""
    with behind_a_proxy(kind) as (proxy, store, other):
        claim, ids = settled_after_a_lost_answer(proxy, store, DONE_COMMITS[kind], then_cut, caplog, store.mark_done)
        # A lease that is not this row's settling one is still refused.
        assert store.mark_done(ids, store.new_lease()).applied == 0
        with other.transaction() as cursor:
            statuses = dict(other.engine.execute(cursor, f"SELECT id, status FROM {other.engine.table}").fetchall())
        assert statuses == {1: 2, 2: 2, 3: 2, 4: 2}


#: What commits a release: on PostgreSQL its UPDATE itself, run alone (autocommit).
RELEASE_COMMITS = {"postgresql": b"SET status = 0, claimed_at = NULL", "mysql": b"\x03COMMIT"}


@pytest.mark.parametrize("then_cut", [False, True])
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_release_whose_answer_was_lost_after_it_committed_counts_as_applied(
        kind: str, then_cut: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review, as for ``mark_done``: a release (a chain's unpublished tail, broker
    back-pressure, a worker's shutdown) that committed and lost its answer was run again (the
    store's retry, or the ack queue's ``release`` task), found the rows no longer held and logged
    ``lease ... no longer holds ... (expired and re-claimed)`` when nothing had expired. A
    released row now keeps the lease that released it (a pending row is held by nobody), so
    a repeat of that very write knows it applied."""
    with behind_a_proxy(kind) as (proxy, store, other):
        claim, ids = settled_after_a_lost_answer(proxy, store, RELEASE_COMMITS[kind], then_cut, caplog, store.release)
        assert store.release(ids, store.new_lease()).applied == 0  # another lease's is still refused
        again = store.claim(10)  # the released rows are claimed again, under a new lease
        assert sorted(m.id for m in again.messages) == ids
        assert store.release(ids, claim.lease).applied == 0  # the old lease's repeat is stale now


#: The statement after which an adoption is committed on the server: its COMMIT.
#: What commits an adoption: on PostgreSQL its UPDATE itself, run alone (autocommit).
ADOPT_COMMITS = {"postgresql": b"SET lease_token = $1, claimed_at", "mysql": b"\x03COMMIT"}


@pytest.mark.parametrize("step", ["claim", "adopt"])
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_rows_leased_by_a_lost_answer_whose_retries_all_failed_come_back_at_the_next_claim(
        kind: str, step: str) -> None:
    """As above, but the database stays unreachable while the store retries, so the claim
    (or a publish task's adoption) fails although the server committed it. Found by
    ``bench.soak --faults``: its rows were held by a lease nobody knew, and this process,
    alive, was never taken over, so their aggregates waited for the claim timeout (a
    dozen aggregates for 60 s after a 5 s database cut). Now the next claim hands them back
    first, with no attempt spent, and claims them."""
    with behind_a_proxy(kind) as (proxy, store, other):
        if step == "claim":
            cut = proxy.drop_answer_after(CLAIM_COMMITS[kind], then_cut=True)
            fails_on_the_cut(store, lambda: store.claim(10))
        else:
            theirs = other.claim(10)
            cut = proxy.drop_answer_after(ADOPT_COMMITS[kind], then_cut=True)
            fails_on_the_cut(store, lambda: store.adopt([m.id for m in theirs.messages], theirs.lease,
                                                        store.new_lease()))
        assert cut.began.is_set(), f"the {step}'s answer was not cut"
        with other.transaction() as cursor:  # leased on the server, to the lease of the call that failed
            statuses = dict(other.engine.execute(cursor, f"SELECT id, status FROM {other.engine.table}").fetchall())
        assert statuses == {1: 1, 2: 1, 3: 1, 4: 1}
        proxy.restore()
        claim = store.claim(10)
        assert [m.id for m in claim.messages] == [1, 2, 3, 4]
        assert [m.attempts for m in claim.messages] == [0, 0, 0, 0]  # handed back, not expired
        assert store.mark_done([1, 2, 3, 4], claim.lease).applied == 4


@pytest.mark.parametrize("releaser", ["claim", "heartbeat"])
@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_doubtful_lease_is_released_by_any_store_of_the_process_and_by_the_heartbeat(
        kind: str, releaser: str) -> None:
    """Found in review: the doubtful leases were kept per store, so a publish-only worker
    (which never claims) left the rows of an adoption whose answer was lost leased to itself
    for the whole claim timeout, then charged them an attempt; a claim-ahead thread's store
    left them to its own next claim. Now any store of the process on the same table
    releases them at its next claim, and so does the heartbeat's next beat."""
    from outbox.relay.holders import Heartbeat, new_holder

    with behind_a_proxy(kind) as (proxy, store, other):
        theirs = other.claim(10)
        cut = proxy.drop_answer_after(ADOPT_COMMITS[kind], then_cut=True)
        fails_on_the_cut(store, lambda: store.adopt([m.id for m in theirs.messages], theirs.lease,
                                                    store.new_lease()))
        assert cut.began.is_set(), "the adoption's answer was not cut"
        proxy.restore()
        sibling = OutboxStore(store.url, table=store.engine.table_name)  # another thread's store
        try:
            if releaser == "claim":
                claim = sibling.claim(10)
            else:
                Heartbeat(sibling, new_holder(), 3.0).tick()
                claim = other.claim(10)
        finally:
            sibling.close()
        assert [m.id for m in claim.messages] == [1, 2, 3, 4]
        assert [m.attempts for m in claim.messages] == [0, 0, 0, 0]  # handed back, not expired


def fails_on_the_cut(store: OutboxStore, call: Callable[[], object]) -> None:
    """``call()`` raises what a database out of reach raises, its retries spent."""
    try:
        call()
    except Exception as exc:  # the driver's own class, asked of the engine below
        assert store.engine.is_disconnect(exc) or store.engine.is_transient(exc), repr(exc)
    else:
        pytest.fail("it went through the cut")


def test_a_postgres_relay_session_carries_its_bounds_on_the_server() -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    engine = engine_for_url(POSTGRES_URL)
    conn = engine.connect(with_bounds(POSTGRES_URL, idle_transaction_timeout_s=7, tcp_timeout_s=4))
    try:
        rows = conn.execute("SELECT name, setting FROM pg_settings WHERE name IN ('idle_in_transaction_session_"
                            "timeout', 'tcp_user_timeout', 'tcp_keepalives_idle')").fetchall()
        assert dict(rows) == {"idle_in_transaction_session_timeout": "7000", "tcp_user_timeout": "4000",
                              "tcp_keepalives_idle": "2"}
        assert not conn.autocommit  # the relay's transactions stay explicit; the claim runs alone
    finally:
        conn.close()


def test_a_mariadb_relay_session_carries_its_bounds_on_the_server() -> None:
    require("MariaDB/MySQL", "127.0.0.1", 3306)
    engine = engine_for_url(MYSQL_URL)
    conn = engine.connect(with_bounds(MYSQL_URL, idle_transaction_timeout_s=7, tcp_timeout_s=4))
    try:
        cursor = conn.cursor()
        cursor.execute("SHOW SESSION VARIABLES WHERE variable_name IN ('idle_transaction_timeout', 'wait_timeout', "
                       "'net_write_timeout', 'innodb_lock_wait_timeout')")
        found = dict(cursor.fetchall())
        mariadb = "mariadb" in conn.get_server_info().lower()
        assert found[("idle_transaction_timeout" if mariadb else "wait_timeout")] == "7"
        assert found["net_write_timeout"] == found["innodb_lock_wait_timeout"] == "4"
        sock = conn._sock  # the keepalive socket the engine made
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 4000
    finally:
        conn.close()


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_pipeline_read_goes_on_when_the_server_ended_its_connection_between_pages(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MySQL ends a relay session idle for idle_transaction_timeout_s (it has no idle-transaction
    timeout), which can fall while Spark takes a page: the next page is read on a new connection.
    Here the reader's session is ended from outside between two pages."""
    pytest.importorskip("pyspark")
    from outbox import enqueue
    from outbox.pipeline.source import IdRange, OutboxReader

    url, port = SERVERS[kind]
    require(kind, "127.0.0.1", port)
    table = f"bounds_read_{int(time.time() * 1000) % 10**9}"
    store = OutboxStore(url, table=table)
    store.migrate()
    engine_class = type(store.engine)
    opened: list = []
    connect = engine_class.connect
    monkeypatch.setattr(engine_class, "connect", lambda self, u: opened.append(connect(self, u)) or opened[-1])
    try:
        with store.transaction() as cursor:
            for n in range(5):
                enqueue(cursor.connection, topic="t", aggregate_type="a", aggregate_id="1", payload={"n": n},
                        table=table)
        # The driver path: its connections carry the session bounds (the Arrow readers open
        # their own, with the client-side ones only: docs/pipeline.md).
        pages = OutboxReader({"url": url, "table": table, "fetch_size": "2", "reader": "driver"}).read(IdRange(1, 5))
        first = next(pages)
        reader = opened[-1]
        with store.transaction() as cursor:  # end the reader's session
            if kind == "postgresql":
                store.engine.execute(cursor, "SELECT pg_terminate_backend(?)", [reader.info.backend_pid]).fetchall()
            else:
                store.engine.execute(cursor, f"KILL CONNECTION {int(reader.thread_id())}")
        rest = list(pages)
        assert [first.num_rows, *(batch.num_rows for batch in rest)] == [2, 2, 1]
        assert len(opened) >= 2 and opened[-1] is not reader
    finally:
        drop_table(store)
        store.close()


def test_the_postgres_claim_commits_by_itself_and_leaves_the_connection_as_it_found_it() -> None:
    """The claim runs alone (autocommit): committed when it returns, with no transaction left
    open and autocommit off again; inside a transaction left open it joins that instead."""
    from psycopg.pq import TransactionStatus

    from outbox import enqueue

    require("PostgreSQL", "127.0.0.1", 5432)
    table = f"bounds_alone_{int(time.time() * 1000) % 10**9}"
    store, other = OutboxStore(POSTGRES_URL, table=table), OutboxStore(POSTGRES_URL, table=table)
    store.migrate()
    try:
        with store.transaction() as cursor:
            for n in range(2):
                enqueue(cursor.connection, topic="t", aggregate_type="a", aggregate_id=str(n), payload={}, table=table)
        conn = store.connection()
        assert len(store.claim(1).messages) == 1
        assert not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
        assert other.stats().counts["claimed"] == 1
        conn.execute("SELECT 1")  # a transaction someone left open
        assert len(store.claim(1).messages) == 1  # joined it, then the store committed it
        assert conn.info.transaction_status == TransactionStatus.IDLE and other.stats().counts["claimed"] == 2
    finally:
        other.close()
        drop_table(store)
        store.close()


def test_a_mysql_server_that_refuses_the_connection_is_the_drivers_transient_error() -> None:
    import pymysql

    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    engine = MysqlEngine()
    with pytest.raises(pymysql.err.OperationalError) as info:
        engine.connect(f"mysql://root@127.0.0.1:{port}/app")
    assert info.value.args[0] == 2003 and engine.is_transient(info.value)


# -- commits that do not wait for the disk (docs/relay.md) --------------------------------------

def test_the_relays_own_postgresql_sessions_commit_without_waiting_and_no_other_does(tmp_path: Path) -> None:
    """A relay process's store (``OUTBOX_RELAY_ASYNC_COMMIT``, default true) runs its sessions
    with ``synchronous_commit`` off; a plain store (the CLI's, an application's) keeps the
    server's setting, and so does the relay with the option false."""
    require("PostgreSQL", "127.0.0.1", 5432)
    code = """
import os
import outbox.celery.tasks as t
from outbox.storage.store import OutboxStore
def setting(store):
    with store.transaction() as c:
        return store.engine.execute(c, "SHOW synchronous_commit").fetchone()[0]
relay = t.resources().store
plain = OutboxStore(os.environ["OUTBOX_DATABASE_URL"])
print(setting(relay), setting(plain))
"""
    for env, expected in (({}, "off on"), ({"OUTBOX_RELAY_ASYNC_COMMIT": "false"}, "on on")):
        done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=POSTGRES_URL, **env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, env


def test_engines_without_a_session_setting_commit_as_before(tmp_path: Path) -> None:
    sqlite = OutboxStore(f"sqlite:///{tmp_path / 'o.db'}")
    assert sqlite.commit_without_waiting() is False
    assert MysqlEngine.async_commit_sql is None and PostgresEngine.async_commit_sql is not None


def test_a_mysql_connection_reads_without_a_bound_once_connected_unless_the_url_sets_one() -> None:
    """The greeting is read with a bound (a server that accepts and never speaks held the
    connect forever); a statement of the relay's may take as long as it takes, so the bound
    is gone once the connection is made, and a read_timeout of the URL's is kept."""
    require("MariaDB", "127.0.0.1", 3306)
    engine = MysqlEngine()
    for url, expected in ((MYSQL_URL, None), (f"{MYSQL_URL}?read_timeout=42", 42)):
        conn = engine.connect(url)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT 1")
            assert conn._read_timeout == expected and conn._sock.gettimeout() == expected
        finally:
            conn.close()
