"""The OUTBOX_* settings: read once, validated once, with errors that name the setting.

Settings come from, in order of precedence: explicit keyword arguments, the
environment, Django settings (when Django is configured) and finally the defaults
of the contract. Celery config keys with the same names are merged in by the Celery
app (``outbox.celery``), which passes them as explicit overrides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError

#: Above this the lease is almost certainly a typo (30 days written as ms), and on
#: SQL Server it would overflow the INT bound to DATEADD(MILLISECOND, ...).
MAX_CLAIM_TIMEOUT_MS = 86_400_000

#: Prefix of the relay's tuning options, which ``load_settings`` leaves to ``RelayOptions``.
RELAY_PREFIX = "OUTBOX_RELAY_"
#: Prefix of the database broker's options (``outbox.transport.options``), read there.
TRANSPORT_PREFIX = "OUTBOX_TRANSPORT_"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def validate_identifier(value: str, setting: str) -> str:
    """Table and schema names reach SQL text, so only plain identifiers pass."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ConfigError(
            f"{setting}={value!r} is not a valid identifier "
            "(letters, digits and underscores, not starting with a digit, at most 63 characters)"
        )
    return value


@dataclass(frozen=True)
class Settings:
    database_url: str = "sqlite:///outbox.db"
    table: str = "outbox"
    schema: str | None = None
    publish_url: str = "memory://"
    exchange: str = "outbox"
    #: Durable topic exchange that receives a copy of every row that goes dead (with the
    #: error in ``x-outbox-error``); None (the default) turns dead-letter publishing off.
    dead_letter_exchange: str | None = None
    celery_broker_url: str | None = None
    batch_size: int = 100
    claim_timeout_ms: int = 60_000
    max_attempts: int = 10
    claim_interval_s: float = 1.0
    retention_days: float = 7.0
    max_payload_bytes: int = 1_048_576

    def __post_init__(self) -> None:
        validate_identifier(self.table, "OUTBOX_TABLE")
        if self.schema is not None:
            validate_identifier(self.schema, "OUTBOX_SCHEMA")
        if not self.database_url or "://" not in self.database_url and not _looks_like_odbc(self.database_url):
            raise ConfigError(f"OUTBOX_DATABASE_URL={self.database_url!r} is not a database URL")
        if not self.exchange:
            raise ConfigError("OUTBOX_EXCHANGE must not be empty")
        if self.dead_letter_exchange is not None and self.dead_letter_exchange == self.exchange:
            raise ConfigError(f"OUTBOX_DEAD_LETTER_EXCHANGE={self.dead_letter_exchange!r} must differ from "
                              "OUTBOX_EXCHANGE: dead rows would reach the consumers of live events")
        _positive("OUTBOX_BATCH_SIZE", self.batch_size, upper=10_000)
        _positive("OUTBOX_CLAIM_TIMEOUT_MS", self.claim_timeout_ms, upper=MAX_CLAIM_TIMEOUT_MS)
        _positive("OUTBOX_MAX_ATTEMPTS", self.max_attempts, upper=1_000)
        _positive("OUTBOX_CLAIM_INTERVAL_S", self.claim_interval_s)
        _positive("OUTBOX_RETENTION_DAYS", self.retention_days, allow_zero=True)
        _positive("OUTBOX_MAX_PAYLOAD_BYTES", self.max_payload_bytes, upper=64 * 1024 * 1024)

    @property
    def broker_url(self) -> str:
        """Celery's own broker: in-memory for the embedded SQLite default, Redis otherwise."""
        if self.celery_broker_url:
            return self.celery_broker_url
        if self.database_url.startswith("sqlite"):
            return "memory://"
        return "redis://127.0.0.1:6379/0"


#: Setting name -> (field name, parser).
_SETTINGS: dict[str, tuple[str, type]] = {
    "OUTBOX_DATABASE_URL": ("database_url", str),
    "OUTBOX_TABLE": ("table", str),
    "OUTBOX_SCHEMA": ("schema", str),
    "OUTBOX_PUBLISH_URL": ("publish_url", str),
    "OUTBOX_EXCHANGE": ("exchange", str),
    "OUTBOX_DEAD_LETTER_EXCHANGE": ("dead_letter_exchange", str),
    "OUTBOX_CELERY_BROKER_URL": ("celery_broker_url", str),
    "OUTBOX_BATCH_SIZE": ("batch_size", int),
    "OUTBOX_CLAIM_TIMEOUT_MS": ("claim_timeout_ms", int),
    "OUTBOX_MAX_ATTEMPTS": ("max_attempts", int),
    "OUTBOX_CLAIM_INTERVAL_S": ("claim_interval_s", float),
    "OUTBOX_RETENTION_DAYS": ("retention_days", float),
    "OUTBOX_MAX_PAYLOAD_BYTES": ("max_payload_bytes", int),
}

SETTING_NAMES = tuple(_SETTINGS)


def _looks_like_odbc(url: str) -> bool:
    return "=" in url and ";" in url


def _positive(name: str, value: float, *, upper: float | None = None, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
    if upper is not None and value > upper:
        limit = int(upper) if float(upper).is_integer() else upper
        raise ConfigError(f"{name}={value!r} is above the maximum of {limit}")


def _parse(name: str, raw: Any, kind: type) -> Any:
    if raw is None:
        return None
    if kind is str:
        text = str(raw).strip()
        return text or None
    if isinstance(raw, bool):
        raise ConfigError(f"{name}={raw!r} is not a number")
    try:
        return kind(str(raw).strip()) if isinstance(raw, str) else kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None


def _django_settings() -> Mapping[str, Any]:
    try:
        from django.conf import settings as dj  # type: ignore[import-not-found]
    except ImportError:
        return {}
    try:
        if not dj.configured:
            return {}
        return {name: getattr(dj, name) for name in _SETTINGS if hasattr(dj, name)}
    except Exception:  # Django present but not set up: not our configuration source
        return {}


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build validated ``Settings``; raise ``ConfigError`` naming the first bad setting."""
    environ = os.environ if environ is None else environ
    sources: list[Mapping[str, Any]] = [overrides or {}, environ, _django_settings()]
    values: dict[str, Any] = {}
    for name, (field, kind) in _SETTINGS.items():
        for source in sources:
            if name in source and source[name] not in (None, ""):
                values[field] = _parse(name, source[name], kind)
                break
    # OUTBOX_RELAY_* keys tune the relay (``outbox.relay.RelayOptions``, which reads and
    # validates them itself); they may sit next to these settings in the same config.
    # OUTBOX_TRANSPORT_* keys likewise belong to the database broker (``outbox.transport``).
    unknown = [k for k in (overrides or {}) if k.startswith("OUTBOX_") and k not in _SETTINGS
               and not k.startswith((RELAY_PREFIX, TRANSPORT_PREFIX))]
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]} (known: {', '.join(_SETTINGS)})")
    return Settings(**{k: v for k, v in values.items() if v is not None})


_cached: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, loaded on first use."""
    global _cached
    if _cached is None:
        _cached = load_settings()
    return _cached


def reset_settings() -> None:
    """Forget the cached settings (tests, and processes that change their environment)."""
    global _cached
    _cached = None


__all__ = ["Settings", "load_settings", "get_settings", "reset_settings", "validate_identifier",
           "MAX_CLAIM_TIMEOUT_MS", "SETTING_NAMES"]
