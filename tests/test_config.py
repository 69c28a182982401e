"""Settings: defaults of the contract, and errors that name the setting."""

from __future__ import annotations

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


@pytest.mark.parametrize("name,value,fragment", [
    ("OUTBOX_BATCH_SIZE", "abc", "OUTBOX_BATCH_SIZE='abc' is not an integer"),
    ("OUTBOX_BATCH_SIZE", "0", "OUTBOX_BATCH_SIZE=0 must be > 0"),
    ("OUTBOX_CLAIM_TIMEOUT_MS", "86400001", "OUTBOX_CLAIM_TIMEOUT_MS=86400001 is above the maximum"),
    ("OUTBOX_MAX_ATTEMPTS", "-1", "OUTBOX_MAX_ATTEMPTS=-1"),
    ("OUTBOX_CLAIM_INTERVAL_S", "fast", "OUTBOX_CLAIM_INTERVAL_S='fast' is not a number"),
    ("OUTBOX_RETENTION_DAYS", "-2", "OUTBOX_RETENTION_DAYS=-2.0 must be >= 0"),
    ("OUTBOX_MAX_PAYLOAD_BYTES", "0", "OUTBOX_MAX_PAYLOAD_BYTES=0"),
    ("OUTBOX_TABLE", "outbox; DROP TABLE x", "OUTBOX_TABLE="),
    ("OUTBOX_SCHEMA", "1bad", "OUTBOX_SCHEMA='1bad' is not a valid identifier"),
    ("OUTBOX_DATABASE_URL", "nonsense", "OUTBOX_DATABASE_URL='nonsense'"),
])
def test_invalid_values_name_the_setting(name: str, value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={name: value})
    assert fragment in str(caught.value)


def test_claim_timeout_at_the_ceiling_is_accepted() -> None:
    assert load_settings(environ={"OUTBOX_CLAIM_TIMEOUT_MS": "86400000"}).claim_timeout_ms == 86_400_000


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
