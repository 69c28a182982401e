"""Settings: defaults of the contract, and errors that name the setting."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from outbox.core.config import load_settings
from outbox.core.errors import ConfigError


def test_defaults_match_the_contract() -> None:
    s = load_settings(environ={})
    assert (s.database_url, s.table, s.schema, s.publish_url, s.exchange) == (
        "sqlite:///outbox.db", "outbox", None, "memory://", "outbox")
    assert (s.batch_size, s.claim_timeout_ms, s.max_attempts) == (100, 60_000, 10)
    assert (s.claim_interval_s, s.retention_days, s.max_payload_bytes) == (1.0, 7.0, 1_048_576)
    assert s.broker_url == "memory://"


def test_celery_broker_defaults_to_redis_off_sqlite() -> None:
    s = load_settings(environ={"OUTBOX_DATABASE_URL": "postgresql://h/db"})
    assert s.broker_url == "redis://127.0.0.1:6379/0"
    s = load_settings(environ={"OUTBOX_DATABASE_URL": "postgresql://h/db", "OUTBOX_CELERY_BROKER_URL": "amqp://x"})
    assert s.broker_url == "amqp://x"


def test_overrides_win_over_the_environment() -> None:
    s = load_settings(overrides={"OUTBOX_BATCH_SIZE": 7}, environ={"OUTBOX_BATCH_SIZE": "9"})
    assert s.batch_size == 7


def test_an_integer_setting_given_a_fraction_as_a_number_is_refused() -> None:
    """From a Django setting or a Celery config key: 2.5 was cut to 2 unsaid (found in review);
    a whole float (1e4) is still that integer, as the text '2.5' was always refused."""
    with pytest.raises(ConfigError, match=r"^OUTBOX_BATCH_SIZE=2\.5 is not an integer$"):
        load_settings(overrides={"OUTBOX_BATCH_SIZE": 2.5}, environ={})
    assert load_settings(overrides={"OUTBOX_CLAIM_TIMEOUT_MS": 1e4}, environ={}).claim_timeout_ms == 10_000


@pytest.mark.parametrize("name,value,fragment", [
    ("OUTBOX_BATCH_SIZE", "abc", "OUTBOX_BATCH_SIZE='abc' is not an integer"),
    ("OUTBOX_BATCH_SIZE", "0", "OUTBOX_BATCH_SIZE=0 must be > 0"),
    ("OUTBOX_CLAIM_TIMEOUT_MS", "86400001", "OUTBOX_CLAIM_TIMEOUT_MS=86400001 is above the maximum"),
    ("OUTBOX_MAX_ATTEMPTS", "-1", "OUTBOX_MAX_ATTEMPTS=-1"),
    ("OUTBOX_CLAIM_INTERVAL_S", "fast", "OUTBOX_CLAIM_INTERVAL_S='fast' is not a number"),
    ("OUTBOX_RETENTION_DAYS", "-2", "OUTBOX_RETENTION_DAYS=-2.0 must be >= 0"),
    # passed the checks and then failed every purge (timestamp out of range; found in review)
    ("OUTBOX_RETENTION_DAYS", "1e8", "OUTBOX_RETENTION_DAYS=100000000.0 is above the maximum of 20000"),
    ("OUTBOX_MAX_PAYLOAD_BYTES", "0", "OUTBOX_MAX_PAYLOAD_BYTES=0"),
    ("OUTBOX_TABLE", "outbox; DROP TABLE x", "OUTBOX_TABLE="),
    ("OUTBOX_SCHEMA", "1bad", "OUTBOX_SCHEMA='1bad' is not a valid identifier"),
    ("OUTBOX_DATABASE_URL", "nonsense", "OUTBOX_DATABASE_URL='nonsense'"),
])
def test_invalid_values_name_the_setting(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={name: value})
    assert fragment in str(caught.value)


@pytest.mark.parametrize("name", ["OUTBOX_PUBLISH_URL", "OUTBOX_CELERY_BROKER_URL", "OUTBOX_DRAMATIQ_BROKER_URL"])
@pytest.mark.parametrize("database", ["abc", "1/", "0/x", "-1"])
def test_a_redis_database_that_is_not_a_number_names_the_setting(name: str, database: str) -> None:
    """kombu and redis-py read a Redis URL's path as the database number only when they
    connect: a publish URL's burned every event's attempts until it went dead, a Celery
    broker's stopped the worker with a traceback (found in review)."""
    from outbox.core.config import DramatiqSettings, Settings, Sources

    family = DramatiqSettings if name == "OUTBOX_DRAMATIQ_BROKER_URL" else Settings
    with pytest.raises(ConfigError, match=f"^{name}=.*the Redis database '/{re.escape(database)}' is not a number"):
        family.from_sources(Sources({}, {name: f"redis://127.0.0.1:6379/{database}"}, {}))


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://h/15",
                                 "rediss://:pw@h:6380/3?ssl_cert_reqs=required", "redis://h/2;redis://g/2"])
def test_a_redis_url_with_or_without_a_database_number_is_accepted(url: str) -> None:
    assert load_settings(environ={"OUTBOX_PUBLISH_URL": url, "OUTBOX_CELERY_BROKER_URL": url}).publish_url == url


def test_claim_timeout_at_the_ceiling_is_accepted() -> None:
    assert load_settings(environ={"OUTBOX_CLAIM_TIMEOUT_MS": "86400000"}).claim_timeout_ms == 86_400_000


def test_a_short_lease_that_the_contract_allows_is_accepted() -> None:
    """CONTRACT.md bounds the lease only at the top; a test of lost-task recovery sets a
    short one. 1 s was the floor for a while (a lease of 500 ms stopped start-up)."""
    assert load_settings(environ={"OUTBOX_CLAIM_TIMEOUT_MS": "500"}).claim_timeout_ms == 500
    assert load_settings(environ={"OUTBOX_CLAIM_TIMEOUT_MS": "100"}).claim_timeout_ms == 100


def test_unknown_override_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown setting OUTBOX_BATCHSIZE"):
        load_settings(overrides={"OUTBOX_BATCHSIZE": 5}, environ={})


def test_relay_options_are_left_to_the_relay() -> None:
    """OUTBOX_RELAY_* keys tune the relay (``RelayOptions`` reads and validates them):
    they may sit next to the settings in one config without being refused here."""
    s = load_settings(overrides={"OUTBOX_RELAY_TASK_ROWS": 3, "OUTBOX_RELAY_BREAKER_S": "bad",
                                 "OUTBOX_BATCH_SIZE": 7}, environ={})
    assert s.batch_size == 7
    with pytest.raises(ConfigError, match="unknown setting OUTBOX_RELAYX"):
        load_settings(overrides={"OUTBOX_RELAYX": 1}, environ={})


def test_dead_letter_exchange_is_off_by_default_and_reaches_the_publisher() -> None:
    from outbox.publisher import KombuPublisher

    assert load_settings(environ={}).dead_letter_exchange is None
    assert load_settings(environ={"OUTBOX_DEAD_LETTER_EXCHANGE": "  "}).dead_letter_exchange is None
    s = load_settings(overrides={"OUTBOX_DEAD_LETTER_EXCHANGE": "outbox.dead"}, environ={})
    assert s.dead_letter_exchange == "outbox.dead"
    assert load_settings(environ={"OUTBOX_DEAD_LETTER_EXCHANGE": "dlx"}).dead_letter_exchange == "dlx"
    publisher = KombuPublisher.from_settings(s)
    assert publisher.dead_letter_exchange == "outbox.dead" and publisher.exchange == "outbox"
    assert KombuPublisher.from_settings(load_settings(environ={})).dead_letter_exchange is None


def test_dead_letter_exchange_must_differ_from_the_exchange() -> None:
    with pytest.raises(ConfigError, match="OUTBOX_DEAD_LETTER_EXCHANGE='ev' must differ from OUTBOX_EXCHANGE"):
        load_settings(environ={"OUTBOX_EXCHANGE": "ev", "OUTBOX_DEAD_LETTER_EXCHANGE": "ev"})


# -- one declaration, one reader, one order (issue 21) ------------------------------------------

def test_every_family_reads_celery_conf_over_environment_over_django_over_default() -> None:
    from outbox.core.config import FAMILIES

    for family in FAMILIES:
        for name, (f, how) in family.declared().items():
            if how.kind != "int":
                continue
            low = int(max(3, how.minimum or 0, (how.above or 0) + 1))  # three values within the bounds
            conf, env, django = {name: low}, {name: str(low + 1)}, {name: low + 2}
            assert getattr(family.from_sources(conf, env, django), f.name) == low
            assert getattr(family.from_sources({}, env, django), f.name) == low + 1
            assert getattr(family.from_sources({}, {name: ""}, django), f.name) == low + 2  # empty is unset
            assert getattr(family.from_sources({}, {}, {}), f.name) == f.default


def test_the_process_order_is_built_once_with_the_registered_celery_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox.core.config import get_settings, relay_options, relay_settings, reset_settings, use_conf

    monkeypatch.setenv("OUTBOX_RELAY_TASK_ROWS", "9")
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "8")
    try:
        use_conf(lambda: {"OUTBOX_RELAY_TASK_ROWS": 3, "broker_url": "memory://"})
        assert relay_options().task_rows == 3 and get_settings().batch_size == 8
        assert relay_settings() is get_settings()  # one reading, whoever asks
        monkeypatch.setenv("OUTBOX_BATCH_SIZE", "7")
        assert get_settings().batch_size == 8  # read once per process...
        reset_settings()
        assert get_settings().batch_size == 7  # ...until forgotten
        use_conf(None)  # Dramatiq and the CLI: no Celery conf, the same order otherwise
        assert relay_options().task_rows == 9
        use_conf(lambda: {"OUTBOX_RELAY_TASKROWS": 3})
        with pytest.raises(ConfigError, match="unknown setting OUTBOX_RELAY_TASKROWS"):
            relay_options()
    finally:
        use_conf(None)
        reset_settings()


def test_known_names_are_the_declared_names_each_declared_once() -> None:
    from outbox.core.config import FAMILIES, known_names

    declared = [name for family in FAMILIES for name in family.names()]
    assert len(declared) == len(set(declared)) == len(known_names())
    assert set(declared) == set(known_names())
    assert {"OUTBOX_SPARK_MASTER", "OUTBOX_PIPELINE_CRASH_AT", "OUTBOX_TRANSPORT_RECEIVE_BATCH",
            "OUTBOX_RELAY_METRICS_PORT", "OUTBOX_RELAY_WAKE", "OUTBOX_DRAMATIQ_BROKER_URL"} <= set(declared)


@pytest.mark.parametrize("name,value,fragment", [
    ("OUTBOX_SPARK_MASTER", "lokal[*]", "OUTBOX_SPARK_MASTER='lokal[*]' is not a Spark master URL"),
    ("OUTBOX_SPARK_SHUFFLE_PARTITIONS", "many", "OUTBOX_SPARK_SHUFFLE_PARTITIONS='many' is not an integer"),
    ("OUTBOX_SPARK_LOG_LEVEL", "LOUD", "OUTBOX_SPARK_LOG_LEVEL='LOUD' is not a Spark log level"),
    ("OUTBOX_SPARK_UI", "perhaps", "OUTBOX_SPARK_UI='perhaps' is not a boolean"),
])
def test_spark_settings_are_validated_naming_the_setting(name: str, value: str, fragment: str) -> None:
    from outbox.core.config import PipelineOptions

    with pytest.raises(ConfigError) as caught:
        PipelineOptions.from_sources({name: value})
    assert fragment in str(caught.value)
    options = PipelineOptions.from_sources({"OUTBOX_SPARK_MASTER": "local[2]", "OUTBOX_SPARK_LOG_LEVEL": "warn"})
    assert (options.master, options.log_level, options.shuffle_partitions, options.ui) == ("local[2]", "WARN", 8, False)


def test_transport_options_become_kombu_options() -> None:
    from outbox.transport.options import transport_options

    assert transport_options({}, visibility_timeout=120.0) == {"visibility_timeout": 120.0, "polling_interval": 1.0}
    assert transport_options({"OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S": "10", "OUTBOX_TRANSPORT_QUEUE_TABLE": "q"},
                             visibility_timeout=120.0) == {"visibility_timeout": 10.0, "polling_interval": 1.0,
                                                           "queue_table": "q"}
    with pytest.raises(ConfigError, match="OUTBOX_TRANSPORT_RECEIVE_BATCH='0' must be >= 1"):
        transport_options({"OUTBOX_TRANSPORT_RECEIVE_BATCH": "0"}, visibility_timeout=1.0)


def test_database_broker_alternates_are_refused_naming_the_way_to_fail_over() -> None:
    """kombu cannot switch to a ``outboxdb+...`` alternate (issue 26): refused at start-up,
    not at the first failover."""
    url = "outboxdb+postgresql://u:secret@db1/test;outboxdb+postgresql://u:secret@db2/test"
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url})
    text = str(caught.value)
    assert "OUTBOX_CELERY_BROKER_URL" in text and "alternate broker URLs" in text and "Failover" in text
    assert "secret" not in text
    # Alternates of other transports are kombu's own business and stay accepted.
    assert load_settings(environ={"OUTBOX_CELERY_BROKER_URL": "redis://h1:6379/0;redis://h2:6379/0"})


def test_claim_ahead_takes_auto_on_off_and_the_boolean_spellings() -> None:
    """OUTBOX_RELAY_CLAIM_AHEAD was a boolean: its spellings still work (true is on)."""
    from outbox.core.config import RelayOptions

    assert RelayOptions.from_sources({}).claim_ahead == "auto"
    for given, mode in (("auto", "auto"), ("ON", "on"), ("true", "on"), (True, "on"), ("1", "on"),
                        ("off", "off"), ("false", "off"), (False, "off"), ("0", "off")):
        assert RelayOptions.from_sources({"OUTBOX_RELAY_CLAIM_AHEAD": given}).claim_ahead == mode, given
    with pytest.raises(ConfigError, match=r"OUTBOX_RELAY_CLAIM_AHEAD='sometimes': expected auto, on"):
        RelayOptions.from_sources({"OUTBOX_RELAY_CLAIM_AHEAD": "sometimes"})


def test_a_celery_config_module_is_read_from_the_start_by_every_process(tmp_path: Path) -> None:
    """A writer read CELERY_CONFIG_MODULE's keys only once its first post-commit wake-up had
    imported the Celery app: its first event went to table ``outbox``, the later ones to the
    module's table, and the ``outbox`` CLI never read the module (found in review)."""
    (tmp_path / "flipconf.py").write_text('OUTBOX_TABLE = "orders_x"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
           "CELERY_CONFIG_MODULE": "flipconf", "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    env.pop("PYTHONPATH", None)  # found in the current directory, as Celery's loader finds it

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert '"orders_x"' in run("-m", "outbox.cli", "migrate")
    assert "outbox.orders_x." in run("-m", "outbox.cli", "queues")  # the worker's queues
    assert "namespace 'outbox.orders_x." in run("-m", "outbox.cli", "check")
    writer = """
import sqlite3, sys, time
from outbox import enqueue, transaction
from outbox.core.config import get_settings
conn = sqlite3.connect("o.db")
for n in range(2):
    with transaction(conn):  # the commit's wake-up imports the Celery app
        enqueue(conn, topic="t", aggregate_type="a", aggregate_id="1", payload={"n": n})
    time.sleep(0.5)
import outbox.celery.application
print(get_settings().table)
"""
    assert run("-c", writer).split() == ["orders_x"]
    with closing(sqlite3.connect(tmp_path / "o.db")) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "outbox" not in tables
        assert conn.execute("SELECT count(*) FROM orders_x").fetchone() == (2,)


@pytest.mark.parametrize("scheme", ["SQLite", "SQLITE", "sqlite+pysqlite", "SQLite+pysqlite"])
def test_a_sqlite_url_is_one_rule_for_validation_the_engine_and_the_default_broker(scheme: str) -> None:
    """The start-up check took a SQLite URL whatever the case of its scheme, with a ``+driver``
    too, and the engine refused it ("not a sqlite URL") at every claim; the default Celery
    broker became Redis for it (found in review)."""
    from outbox.storage.engines import kind_of_url
    from outbox.storage.engines.sqlite import sqlite_path

    s = load_settings(environ={"OUTBOX_DATABASE_URL": f"{scheme}:////data/outbox.db"})
    assert kind_of_url(s.database_url) == "sqlite"
    assert sqlite_path(s.database_url) == "/data/outbox.db"
    assert s.broker_url == "memory://"


@pytest.mark.parametrize("module,said_in_it", [
    ("no_such_relayconf_module", "'no_such_relayconf_module' cannot be imported"),  # it lives beside the workers
    ("workeronlyconf", "KeyError: 'WORKER_ONLY_BROKER'"),  # it reads a variable only the workers have
])
def test_a_celery_config_module_this_process_cannot_import_is_warned_about_once(
        module: str, said_in_it: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A process that cannot import the module (not there, or it raises here) reads none of
    its keys and says so once: every enqueue of a writer raised, where it had worked before
    writers read the module (found in review)."""
    from outbox.core import sources

    (tmp_path / "workeronlyconf.py").write_text('import os\nbroker_url = os.environ["WORKER_ONLY_BROKER"]\n'
                                                'OUTBOX_TABLE = "orders_x"\n')
    monkeypatch.chdir(tmp_path)
    sources._unimportable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="outbox.core.config"):
        for _ in range(3):
            settings = load_settings(environ={"CELERY_CONFIG_MODULE": module})
    assert settings.table == "outbox"
    said = [r.getMessage() for r in caplog.records if "CELERY_CONFIG_MODULE" in r.getMessage()]
    assert len(said) == 1 and said_in_it in said[0], said


def test_only_the_first_source_that_sets_a_name_can_make_it_set_but_empty() -> None:
    """An empty value in a later source (settings.py's ``os.environ.get("X", "")``) refused
    the valid value of an earlier one, the environment (found in review)."""
    from outbox.core.config import Settings

    later_empty = Settings.from_sources({}, {"OUTBOX_PUBLISH_URL": "memory://", "OUTBOX_EXCHANGE": "shop"},
                                        {"OUTBOX_PUBLISH_URL": "", "OUTBOX_EXCHANGE": " "})
    assert (later_empty.publish_url, later_empty.exchange) == ("memory://", "shop")
    assert Settings.from_sources({"OUTBOX_PUBLISH_URL": None}, {}, {"OUTBOX_PUBLISH_URL": "amqp://h//"}).publish_url \
        == "amqp://h//"  # None is unset, as in every source
    with pytest.raises(ConfigError, match="OUTBOX_PUBLISH_URL is set but empty"):
        Settings.from_sources({}, {"OUTBOX_PUBLISH_URL": " "}, {"OUTBOX_PUBLISH_URL": "amqp://h//"})


@pytest.mark.parametrize("value", ["0.000001", "0.5"])
def test_a_purge_interval_below_a_second_is_refused(value: str) -> None:
    """0.000001 passed "above 0", and beat sent 11,105 purge tasks in 6 s, each run by a worker
    (found in review). The floor is a second (docs/relay.md, "`OUTBOX_RELAY_*` options")."""
    from outbox.core.config import RelayOptions

    with pytest.raises(ConfigError, match=re.escape(f"OUTBOX_RELAY_PURGE_INTERVAL_S='{value}' must be >= 1")):
        RelayOptions.from_sources({"OUTBOX_RELAY_PURGE_INTERVAL_S": value})
    assert RelayOptions.from_sources({"OUTBOX_RELAY_PURGE_INTERVAL_S": "1"}).purge_interval_s == 1.0
