"""``outbox check``: one report, exit 1 on a failure, against real databases and brokers.
Each test uses its own table and a unique exchange, so parallel runs never see each other."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from cli_support import silent_server
from engine_support import add, drop_table
from services import AMQP_URL, POSTGRES_URL, REDIS_URL, require

from outbox.core.config import MetricsOptions, RelayOptions
from outbox.storage.store import OutboxStore


def check(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    return subprocess.run([sys.executable, "-m", "outbox.cli", "check"], capture_output=True, text=True,
                          cwd=cwd, env={**clean, **env}, timeout=120)


def lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """{check name: its state} from the report."""
    out = {}
    for line in result.stdout.splitlines():
        if line.startswith("["):
            state, rest = line[1:].split("]", 1)
            out[rest.strip().split(":", 1)[0]] = state.strip()
    return out


def test_check_on_the_embedded_default_fails_before_migrate_and_passes_after(tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    before = check(env, tmp_path)
    assert before.returncode == 1, before.stdout + before.stderr
    states = lines(before)
    # No file yet: the check makes none (it made an empty one and said "connected").
    assert states["configuration"] == "ok" and states["database"] == "FAIL" and "table" not in states
    assert "does not exist (nothing was created)" in before.stdout and "`outbox migrate` creates it" in before.stdout
    assert not (tmp_path / "o.db").exists()
    OutboxStore(env["OUTBOX_DATABASE_URL"]).migrate()
    after = check(env, tmp_path)
    assert after.returncode == 0, after.stdout + after.stderr
    states = lines(after)
    assert states["table"] == "ok" and states["indexes"] == "ok" and states["celery broker"] == "ok"
    assert states["holders"] == "ok"
    assert states["destination"] == "warn"  # memory:// reaches no consumer outside the worker


def test_check_warns_when_the_holders_table_is_missing(tmp_path: Path) -> None:
    """An upgrade not migrated yet: the relay works on the lease alone, which the check says."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url)
    store.migrate()
    with store.transaction() as cursor:
        cursor.execute('DROP TABLE "outbox_holders"')
    store.close()
    result = check({"OUTBOX_DATABASE_URL": url}, tmp_path)
    assert result.returncode == 0 and lines(result)["holders"] == "warn", result.stdout
    assert "outbox_holders" in result.stdout and "run `outbox migrate`" in result.stdout


def test_check_reports_a_bad_setting_and_a_missing_index(tmp_path: Path) -> None:
    bad = check({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_BATCH_SIZE": "lots"}, tmp_path)
    assert bad.returncode == 1 and lines(bad) == {"configuration": "FAIL"}
    assert "OUTBOX_BATCH_SIZE='lots' is not an integer" in bad.stdout
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = OutboxStore(url)
    store.migrate()
    with store.transaction() as cursor:
        cursor.execute('DROP INDEX "ix_outbox_claim_ready"')
    store.close()
    result = check({"OUTBOX_DATABASE_URL": url}, tmp_path)
    assert result.returncode == 1 and lines(result)["indexes"] == "FAIL"
    assert "missing ix_outbox_claim_ready" in result.stdout


def test_a_probe_asked_of_a_destination_that_is_not_kafka_is_said_to_do_nothing(tmp_path: Path) -> None:
    """`--probe` was silently ignored on AMQP and Redis."""
    from outbox.commands.doctor import run_checks

    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": "memory://"}
    [probe] = [r for r in run_checks(env, probe_topic="orders.created") if r.name == "probe"]
    assert probe.state == "warn" and "--probe orders.created applies to a Kafka destination only" in probe.detail
    assert not [r for r in run_checks(env) if r.name == "probe"]


def test_check_warns_when_metrics_are_asked_for_and_prometheus_client_is_missing(tmp_path: Path) -> None:
    """Found in review: with OUTBOX_RELAY_METRICS_PORT set and no `metrics` extra the check said
    nothing, while every worker logs one warning at start and serves no /metrics (Prometheus
    then reports `OutboxRelayDown`, no worker up)."""
    code = """
import sys
sys.modules["prometheus_client"] = None  # a base install without the extra
from outbox.commands.doctor import run_checks
for r in run_checks():
    if r.name == "metrics":
        print(r.line())
"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_", "PROMETHEUS_"))}
    env = {**clean, "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_PUBLISH_URL": "memory://"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**env, "OUTBOX_RELAY_METRICS_PORT": "9108"})
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = done.stdout.splitlines()
    assert line.startswith("[warn] metrics:") and "prometheus_client" in line and '[metrics]"' in line, line
    from outbox.commands.doctor import run_checks

    [served] = [r for r in run_checks({**env, "OUTBOX_RELAY_METRICS_PORT": "9108"}) if r.name == "metrics"]
    assert served.state == "ok" and ":9108/metrics" in served.detail
    assert not [r for r in run_checks(env) if r.name == "metrics"]  # metrics off: no line


@pytest.mark.parametrize("setting,value,message", [
    ("OUTBOX_KAFKA_SECURITY_PROTOCOL", "bogus", "OUTBOX_KAFKA_SECURITY_PROTOCOL='bogus': expected one of"),
    ("OUTBOX_RELAY_METRICS_PORT", "notaport", "OUTBOX_RELAY_METRICS_PORT='notaport' is not a port number"),
], ids=["kafka", "metrics"])
def test_check_reports_what_would_stop_a_relays_start_up(tmp_path: Path, setting: str, value: str,
                                                          message: str) -> None:
    """The metrics port once passed the check (the worker only logged "metrics: off")."""
    result = check({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                    "OUTBOX_PUBLISH_URL": "kafka://127.0.0.1:9", setting: value}, tmp_path)
    assert result.returncode == 1 and lines(result) == {"configuration": "FAIL"}, result.stdout
    assert message in result.stdout


@pytest.mark.parametrize("settings,message", [
    ({"OUTBOX_RELAY_LISTEN": "maybe"}, "OUTBOX_RELAY_LISTEN='maybe' is not a boolean"),
    ({"OUTBOX_CELERY_BROKER_URL": "outboxdb://", "OUTBOX_TRANSPORT_QUEUE_TABLE": "bad-name"},
     "OUTBOX_TRANSPORT_QUEUE_TABLE='bad-name' is not a valid queue table name"),
    ({"OUTBOX_CELERY_BROKER_URL": "outboxdb://", "OUTBOX_TRANSPORT_QUEUE_TABLE": "q" * 42},
     "is not a valid queue table name (letters, digits and underscores, not starting with a digit, at most 41"),
    ({"OUTBOX_CELERY_BROKER_URL": "outboxdb://", "OUTBOX_TRANSPORT_POLLING_INTERVAL_S": "0"},
     "OUTBOX_TRANSPORT_POLLING_INTERVAL_S='0' must be >= 0.01"),
], ids=["listen", "queue-table", "queue-table-length", "polling-interval"])
def test_check_reports_the_wake_and_database_broker_options_a_relay_reads(tmp_path: Path, settings: dict[str, str],
                                                                          message: str) -> None:
    """These passed the check (all ok, exit 0) and then stopped the worker, or failed every
    enqueue on PostgreSQL (OUTBOX_RELAY_LISTEN; found in review)."""
    result = check({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", **settings}, tmp_path)
    assert result.returncode == 1 and lines(result) == {"configuration": "FAIL"}, result.stdout
    assert message in result.stdout


def test_check_warns_about_an_outbox_variable_nothing_reads(tmp_path: Path) -> None:
    """Every other command warns about a misspelt OUTBOX_* variable; `outbox check`, the one
    meant to find such mistakes, said nothing (found in review)."""
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_BATCHSIZE": "5"}
    OutboxStore(env["OUTBOX_DATABASE_URL"]).migrate()
    result = check(env, tmp_path)
    assert result.returncode == 0 and lines(result)["unknown variable"] == "warn", result.stdout
    assert ("[warn] unknown variable: OUTBOX_BATCHSIZE is ignored, nothing reads it (did you mean "
            "OUTBOX_BATCH_SIZE?)") in result.stdout
    # Also beside a configuration that fails: the typo may be why.
    bad = check({**env, "OUTBOX_BATCH_SIZE": "lots"}, tmp_path)
    assert lines(bad) == {"configuration": "FAIL", "unknown variable": "warn"}, bad.stdout


def test_the_database_brokers_options_are_read_only_when_it_is_celerys_broker() -> None:
    from outbox.core.config import TransportOptions, WakeOptions, load_settings, relay_families

    assert relay_families(load_settings(environ={})) == (RelayOptions, MetricsOptions, WakeOptions)
    assert TransportOptions in relay_families(load_settings(environ={"OUTBOX_CELERY_BROKER_URL": "outboxdb://"}))


def test_check_against_an_unreachable_kafka_is_one_report_line(tmp_path: Path) -> None:
    """librdkafka once wrote ~100 raw lines (one per reconnect) on stderr while the check waited."""
    pytest.importorskip("confluent_kafka")
    result = check({"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                    "OUTBOX_PUBLISH_URL": "kafka://127.0.0.1:9"}, tmp_path)
    assert result.returncode == 1 and lines(result)["destination"] == "FAIL"
    assert "kafka://127.0.0.1:9 unreachable" in result.stdout
    assert "rdkafka" not in result.stderr and "rdkafka" not in result.stdout, result.stderr[-2000:]


def test_check_on_postgres_rabbitmq_and_redis(tmp_path: Path) -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)
    from kombu import Connection, Exchange, Queue

    tag = uuid.uuid4().hex[:8]
    table, exchange = f"check_{tag}", f"outbox-check-{tag}"
    env = {"OUTBOX_DATABASE_URL": POSTGRES_URL, "OUTBOX_TABLE": table, "OUTBOX_PUBLISH_URL": AMQP_URL,
           "OUTBOX_EXCHANGE": exchange, "OUTBOX_CELERY_BROKER_URL": REDIS_URL}
    store = OutboxStore(POSTGRES_URL, table=table)
    try:
        first = check(env, tmp_path)
        assert first.returncode == 1
        states = lines(first)
        assert states["table"] == "FAIL" and states["celery broker"] == "ok" and states["destination"] == "ok"
        assert states["queue bound to the exchange"] == "FAIL" and f"exchange {exchange!r} does not exist" in first.stdout
        store.migrate()
        with Connection(AMQP_URL) as conn:
            ex = Exchange(exchange, type="topic", durable=True)
            ex(conn.default_channel).declare()
            try:
                ready = check(env, tmp_path)
            finally:
                ex(conn.default_channel).delete()
        assert ready.returncode == 0, ready.stdout
        states = lines(ready)
        assert states["table"] == "ok" and states["indexes"] == "ok"
        with store.transaction() as cursor:  # the vacuum line warns where the server's autovacuum is off
            server_on = store.engine.execute(cursor, "SELECT current_setting('autovacuum')").fetchone()[0] == "on"
        assert states["vacuum"] == ("ok" if server_on else "warn")
        assert ("autovacuum is off on this server" in ready.stdout) is not server_on
        # AMQP cannot list bindings: the report says how to look.
        assert states["queue bound to the exchange"] == "warn" and "rabbitmqctl list_bindings" in ready.stdout
        # A Redis destination keeps its bindings where they can be read.
        redis_env = {**env, "OUTBOX_PUBLISH_URL": REDIS_URL}
        unbound = check(redis_env, tmp_path)
        assert unbound.returncode == 1 and lines(unbound)["queue bound to the exchange"] == "FAIL"
        queue = Queue(f"check-q-{tag}", Exchange(exchange, type="topic"), routing_key="orders.#")
        with Connection(REDIS_URL) as conn:
            queue(conn.default_channel).declare()
            try:
                bound = check(redis_env, tmp_path)
            finally:
                queue(conn.default_channel).delete()
        assert bound.returncode == 0, bound.stdout
        assert lines(bound)["queue bound to the exchange"] == "ok" and f"check-q-{tag}" in bound.stdout
        # No Celery broker configured next to a server database: the implied default is named.
        implied = check({k: v for k, v in env.items() if k != "OUTBOX_CELERY_BROKER_URL"}, tmp_path)
        assert lines(implied)["celery broker url"] == "warn" and "redis://127.0.0.1:6379/0" in implied.stdout
        # Unreachable brokers fail with the masked URL.
        down = check({**env, "OUTBOX_CELERY_BROKER_URL": "redis://:pw@127.0.0.1:1/0",
                      "OUTBOX_PUBLISH_URL": "amqp://guest:pw@127.0.0.1:1//"}, tmp_path)
        assert down.returncode == 1
        assert lines(down)["celery broker"] == "FAIL" and lines(down)["destination"] == "FAIL"
        assert ":pw@" not in down.stdout
    finally:
        drop_table(store)
        store.close()


@pytest.mark.parametrize("module", ["psycopg"])
def test_hint_for_a_missing_driver_in_the_check(module: str) -> None:
    from outbox.commands.doctor import _error

    assert 'pip install "<outbox-relay checkout>[postgres]"' in _error(ModuleNotFoundError(f"No module named {module!r}",
                                                                                 name=module))


def test_a_redis_url_without_the_redis_extra_names_the_extra_in_the_report_and_the_worker(tmp_path: Path) -> None:
    """Without the `redis` extra, kombu's Redis transport fails to import: the check aborted
    with a bare `ModuleNotFoundError`, and the worker's CRITICAL line named no extra."""
    code = """
import sys
sys.modules["redis"] = None  # what a base install without the extra has: no redis package
from outbox.commands.doctor import report, run_checks
from outbox.core.errors import ConfigError
from outbox.publisher.kombu_publisher import KombuPublisher
print(report(run_checks()))
try:
    KombuPublisher("redis://127.0.0.1:6379/5", "outbox")._ready()
except ConfigError as exc:
    print("publisher:", exc)
"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**clean, "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}",
                               "OUTBOX_PUBLISH_URL": "redis://127.0.0.1:6379/5"})
    assert done.returncode == 0, done.stderr[-2000:]
    hint = 'the redis extra is not installed'
    [destination] = [line for line in done.stdout.splitlines() if line.startswith("[FAIL] destination:")]
    assert hint in destination and '[redis]"' in destination
    [publisher] = [line for line in done.stdout.splitlines() if line.startswith("publisher:")]
    assert "OUTBOX_PUBLISH_URL=" in publisher and hint in publisher


def test_check_tests_the_database_broker_it_will_really_use(tmp_path: Path) -> None:
    """The documented database broker (``outboxdb://``, ``outboxdb+<URL>``) is checked as
    the worker would use it: once printed ``KeyError: 'No such transport: outboxdb'``."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    own = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_CELERY_BROKER_URL": "outboxdb://"}, tmp_path)
    assert "KeyError" not in own.stdout + own.stderr
    assert lines(own)["celery broker"] == "ok" and "the database as Celery's broker" in own.stdout
    named = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_CELERY_BROKER_URL": f"outboxdb+{url}"}, tmp_path)
    assert lines(named)["celery broker"] == "ok", named.stdout
    require("PostgreSQL", "127.0.0.1", 5432)
    down = check({"OUTBOX_DATABASE_URL": url,
                  "OUTBOX_CELERY_BROKER_URL": "outboxdb+postgresql://u:pw@127.0.0.1:1/test"}, tmp_path)
    assert down.returncode == 1 and lines(down)["celery broker"] == "FAIL"
    assert "unreachable" in down.stdout and ":pw@" not in down.stdout


def test_check_of_the_database_broker_creates_no_sqlite_file(tmp_path: Path) -> None:
    """Found in review: with the database as Celery's broker (``outboxdb://``, or
    ``outboxdb+sqlite`` naming a file) and no database file yet, the check said
    ``[FAIL] database: ... does not exist (nothing was created)`` and then, probing the broker,
    created that very file and said ``[ok] celery broker: ... reachable``; every command after it
    found the empty file and said to run `outbox migrate`, which made a second, empty outbox
    (the default ``./outbox.db`` run from another directory)."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    for broker in ("outboxdb://", f"outboxdb+sqlite:///{tmp_path / 'broker.db'}"):
        before = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_CELERY_BROKER_URL": broker}, tmp_path)
        states = lines(before)
        assert before.returncode == 1 and states["database"] == "FAIL", before.stdout
        assert states["celery broker"] == "FAIL", before.stdout
        assert "does not exist (nothing was created" in before.stdout.split("celery broker:", 1)[1], before.stdout
        assert sorted(p.name for p in tmp_path.iterdir()) == [], before.stdout
    migrated = subprocess.run([sys.executable, "-m", "outbox.cli", "migrate"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env={**{k: v for k, v in os.environ.items()
                                                                 if not k.startswith(("OUTBOX_", "DJANGO_"))},
                                                              "OUTBOX_DATABASE_URL": url,
                                                              "OUTBOX_CELERY_BROKER_URL": "outboxdb://"})
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    after = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_CELERY_BROKER_URL": "outboxdb://"}, tmp_path)
    assert lines(after)["celery broker"] == "ok", after.stdout


def test_check_tests_dramatiqs_broker_when_dramatiq_is_the_runner(tmp_path: Path) -> None:
    """With OUTBOX_DRAMATIQ_BROKER_URL set, the report checks Dramatiq's broker, not
    Celery's Redis (which a Dramatiq deployment may not have)."""
    require("Redis", "127.0.0.1", 6379)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    up = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL}, tmp_path)
    states = lines(up)
    assert states["dramatiq broker"] == "ok" and "celery broker" not in states, up.stdout
    down = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": "redis://:pw@127.0.0.1:1/0"}, tmp_path)
    assert down.returncode == 1 and lines(down)["dramatiq broker"] == "FAIL"
    assert "OUTBOX_DRAMATIQ_BROKER_URL" in down.stdout and ":pw@" not in down.stdout


def test_check_on_an_unreachable_rabbitmq_dramatiq_broker_is_one_line_naming_the_cause(tmp_path: Path) -> None:
    """pika logged seven ERROR lines and a traceback to stderr, and wraps its cause so that the
    report said `AMQPConnectionError: (no message)` for a refused connection (found in review):
    now the report line names the refusal and stderr stays clean."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(url).migrate()
    down = check({"OUTBOX_DATABASE_URL": url, "OUTBOX_DRAMATIQ_BROKER_URL": "amqp://u:pw@127.0.0.1:1//"}, tmp_path)
    assert down.returncode == 1 and lines(down)["dramatiq broker"] == "FAIL", down.stdout
    line = next(line for line in down.stdout.splitlines() if line.startswith("[FAIL] dramatiq broker"))
    assert "Connection refused" in line and "(no message)" not in line and ":pw@" not in line, line
    assert "Traceback" not in down.stderr and "ERROR" not in down.stderr, down.stderr


def test_check_expects_on_sql_server_the_indexes_its_migration_leaves_not_a_retired_one() -> None:
    """SQL Server's migration drops ``agg_id_id`` (retired: docs/sqlserver.md) and makes
    ``agg_open`` and ``open_created_at`` instead; the check looked for the other engines'
    four, so it failed on every migrated SQL Server table, with advice (migrate) that could
    not fix it (found in review)."""
    from outbox.storage.engines.describe import expected_index_names
    from outbox.storage.engines.mssql.engine import MssqlEngine
    from outbox.storage.engines.mssql.schema import INDEXES, RETIRED_INDEXES

    engine = MssqlEngine()
    expected = expected_index_names(engine)
    assert expected == {engine.index_name(spec.suffix) for spec in INDEXES}
    assert not expected & {engine.index_name(suffix) for suffix in RETIRED_INDEXES}


_CHECK_WITH_A_SHORT_BOUND = """
import outbox.commands.doctor as doctor
doctor.CONNECT_TIMEOUT_S = 1.0  # 5 in production: each probe of a silent server fails after 1 s here
from outbox.cli import main
main(["check"], prog_name="outbox")
"""


def test_a_redis_broker_that_never_answers_fails_the_check_instead_of_hanging(tmp_path: Path) -> None:
    """The Redis client of the check waited for an answer without any bound: against a
    port that accepts and never speaks, `outbox check` hung for good (found in review).
    Celery's broker and the destination each fail within the check's timeout,
    CONNECT_TIMEOUT_S: 1 s in the child instead of 5 (a child that hangs fails the test
    on the subprocess's timeout)."""
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_"))}
    with silent_server() as port:
        result = subprocess.run([sys.executable, "-c", _CHECK_WITH_A_SHORT_BOUND], capture_output=True, text=True,
                                cwd=tmp_path, timeout=60,
                                env={**clean, **env, "OUTBOX_CELERY_BROKER_URL": f"redis://127.0.0.1:{port}/0",
                                     "OUTBOX_PUBLISH_URL": f"redis://127.0.0.1:{port}/1"})
    assert result.returncode == 1, result.stdout + result.stderr
    states = lines(result)
    assert states["celery broker"] == "FAIL" and states["destination"] == "FAIL", result.stdout


def test_check_fails_on_a_celery_broker_url_other_than_outboxs(tmp_path: Path) -> None:
    """CELERY_BROKER_URL replaces OUTBOX_CELERY_BROKER_URL for Celery, and the worker and beat refuse
    to start with it; the check reported the OUTBOX one reachable (found in review)."""
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_CELERY_BROKER_URL": "redis://127.0.0.1:9/0"}
    OutboxStore(env["OUTBOX_DATABASE_URL"]).migrate()
    result = check({**env, "CELERY_BROKER_URL": "amqp://guest:pw@127.0.0.1:9//"}, tmp_path)
    assert result.returncode == 1 and lines(result)["celery broker url"] == "FAIL", result.stdout
    assert ("[FAIL] celery broker url: CELERY_BROKER_URL (or celery -b) names Celery's broker "
            "amqp://guest:***@127.0.0.1:9//, not "
            "OUTBOX_CELERY_BROKER_URL's redis://127.0.0.1:9/0: every worker, beat and writer") in result.stdout, \
        result.stdout
    same = check({**env, "CELERY_BROKER_URL": env["OUTBOX_CELERY_BROKER_URL"]}, tmp_path)
    assert "celery broker url" not in lines(same), same.stdout


def test_check_fails_on_a_broker_url_in_the_celery_config_module(tmp_path: Path) -> None:
    """A ``broker_url`` in the module CELERY_CONFIG_MODULE names (`celery --config`) stops the
    worker and beat as CELERY_BROKER_URL does; the check compared only the variable and exited 0
    (found in review). Both now ask ``config.celery_broker_named_conflict``."""
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_CELERY_BROKER_URL": "redis://127.0.0.1:9/0",
           "CELERY_CONFIG_MODULE": "relay_celeryconfig",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    OutboxStore(env["OUTBOX_DATABASE_URL"]).migrate()
    (tmp_path / "relay_celeryconfig.py").write_text("broker_url = 'redis://127.0.0.1:9/5'\n")
    result = check(env, tmp_path)
    assert result.returncode == 1 and lines(result)["celery broker url"] == "FAIL", result.stdout
    assert ("[FAIL] celery broker url: broker_url in Celery's configuration names Celery's broker "
            "redis://127.0.0.1:9/5, not OUTBOX_CELERY_BROKER_URL's redis://127.0.0.1:9/0") in result.stdout, \
        result.stdout
    (tmp_path / "relay_celeryconfig.py").write_text("BROKER_URL = 'redis://127.0.0.1:9/0'\n")
    same = check(env, tmp_path)
    assert "celery broker url" not in lines(same), same.stdout


def test_check_tells_the_relay_processes_that_beat_from_records_gone_silent(store: OutboxStore, url: str,
                                                                             writer: Any) -> None:
    """Found in review: with every worker killed the check said `[ok] holders: 3 relay worker
    processes recorded`, counting the records their processes left, which stay until a live worker
    takes them over (with none running, for ever). Now it tells the processes that beat within
    OUTBOX_RELAY_HOLDER_TIMEOUT_S (by the database clock) from the silent ones, and warns about
    those, with the rows they still hold."""
    from outbox.commands.doctor import OK, WARN, check_database
    from outbox.core.config import load_settings
    from outbox.core.model import Holder

    engine = store.engine
    settings = load_settings(environ={"OUTBOX_DATABASE_URL": url, "OUTBOX_TABLE": engine.table_name})

    def holders() -> Any:
        [result] = [r for r in check_database(settings, holder_timeout_s=3.0) if r.name == "holders"]
        return result

    first = holders()
    assert first.state == OK and "no relay worker process is running" in first.detail, first.detail
    running, lost = Holder("a" * 16, "host-a", 11), Holder("b" * 16, "host-b", 22)
    store.beat(running, 3000)
    store.beat(lost, 3000)
    [row] = add(writer, store, "1")
    with store.transaction() as cursor:  # `lost` holds a row and last beat 10 s ago
        engine.execute(cursor, f"UPDATE {engine.holders} SET beat_at = {engine.now_plus_ms()} WHERE holder_id = ?",
                       [-10_000, lost.holder_id])
        engine.execute(cursor, f"UPDATE {engine.table} SET status = 1, claimed_at = {engine.now}, lease_token = ? "
                       "WHERE id = ?", [lost.holder_id + "0" * 16, row])
    result = holders()
    assert result.state == WARN, result.detail
    assert "1 of 2 relay worker processes recorded silent" in result.detail, result.detail
    assert "host-b pid 22" in result.detail and "1 row leased" in result.detail, result.detail
    assert "1 beating" in result.detail, result.detail
    with store.transaction() as cursor:
        engine.execute(cursor, f"UPDATE {engine.holders} SET beat_at = {engine.now_plus_ms()}", [-10_000])
    result = holders()
    assert result.state == WARN and "no relay worker process is beating" in result.detail, result.detail


@pytest.mark.parametrize(("ssl_in_use", "sslmode", "rootcert", "says"), [
    (True, "require", None, "certificate not verified (sslmode=require)"),
    (True, "prefer", None, "certificate not verified (sslmode=prefer)"),  # libpq's default
    (True, "verify-ca", "/ca.pem", "host name not checked (sslmode=verify-ca)"),
    (True, "require", "/ca.pem", "host name not checked (sslmode=require)"),  # libpq: a root cert makes it verify-ca
    (True, "verify-full", "/ca.pem", None),
    (False, "prefer", None, None),  # no TLS at all: nothing to verify (the server offers none)
])
def test_outbox_check_says_when_postgresqls_tls_verifies_nothing(ssl_in_use: bool, sslmode: str, rootcert: str | None,
                                                                 says: str | None) -> None:
    """A TLS session to PostgreSQL under sslmode=require (or libpq's default, prefer) checks no
    certificate: anyone on the path may answer. ``outbox check`` said "connected", ok (found in
    review against a TLS server of its own: sslmode=require and no sslmode alike), where it
    warns for the brokers' TLS."""
    from outbox.commands.doctor import postgres_tls_unchecked

    found = postgres_tls_unchecked(ssl_in_use, sslmode, rootcert)
    assert (found is None) if says is None else (found is not None and says in found), found


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.1.1"])
def test_outbox_check_does_not_warn_about_the_tls_of_a_loopback_postgresql(host: str) -> None:
    """A server on this host with ssl=on (Debian's and Ubuntu's packages, a snake-oil certificate)
    and the default URL (postgresql://...@127.0.0.1/...): libpq's prefer takes TLS, and every
    such install was warned "certificate not verified: give sslmode=verify-full", with no path
    for anyone to answer on, where the same server without TLS is not warned about (found in
    review against a TLS server of its own). Another host still is."""
    from outbox.commands.doctor import postgres_tls_unchecked

    assert postgres_tls_unchecked(True, "prefer", None, host) is None
    assert postgres_tls_unchecked(True, "require", None, host) is None
    assert "not verified" in (postgres_tls_unchecked(True, "prefer", None, "db.example") or "")
    assert "not verified" in (postgres_tls_unchecked(True, "prefer", None, "10.0.0.5") or "")


def test_outbox_check_says_when_mysqls_tls_verifies_nothing() -> None:
    """PyMySQL's session under ssl_mode=REQUIRED, or its default PREFERRED against a server that
    offers TLS, checks no certificate; VERIFY_CA no host name. ``outbox check`` said "connected",
    ok (found in review against a TLS MariaDB of its own). Read from the session's own context."""
    import ssl

    from outbox.commands.doctor import mysql_tls_unchecked
    from outbox.storage.engines.mysql import pymysql_kwargs

    def context(query: str) -> ssl.SSLContext:
        made = pymysql_kwargs(f"mysql://u@127.0.0.1/db?{query}")["ssl"]
        return made if isinstance(made, ssl.SSLContext) else ssl.create_default_context()

    assert "not verified" in (mysql_tls_unchecked(context("ssl_mode=REQUIRED")) or "")
    assert "host name not checked" in (mysql_tls_unchecked(context("ssl_mode=VERIFY_CA")) or "")
    assert mysql_tls_unchecked(context("ssl_mode=VERIFY_IDENTITY")) is None
