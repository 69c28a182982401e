"""The one configuration reader: the OUTBOX_* settings, the relay's ``RelayOptions`` and
the other OUTBOX_RELAY_* options, read once, validated once, with errors that name the
setting, kept in one cache (``reset_settings`` empties it).

Precedence: explicit overrides (the relay's Celery config keys, which ``outbox.celery_app``
registers with ``use_conf``), the environment, Django settings (when Django is
configured), the defaults of the contract.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from .errors import ConfigError, install_hint
from .names import MAX_NAMESPACE, Queues, default_namespace, valid_namespace
from .redact import redact, register_url

log = logging.getLogger("outbox.core.config")

#: Above this the lease is almost certainly a typo (30 days written as ms), and on
#: SQL Server it would overflow the INT bound to DATEADD(MILLISECOND, ...).
MAX_CLAIM_TIMEOUT_MS = 86_400_000

#: Prefix of the relay's tuning options, which ``load_settings`` leaves to ``RelayOptions``.
RELAY_PREFIX = "OUTBOX_RELAY_"
#: Prefix of the database broker's options (``outbox.transport.options``), read there.
TRANSPORT_PREFIX = "OUTBOX_TRANSPORT_"
#: The database broker's settings: name -> (kombu transport option, type, lower bound,
#: upper bound). Written here, where ``known_names`` sees them; read by ``outbox.transport.options``.
TRANSPORT_SETTINGS: dict[str, tuple[str, type, float, float]] = {
    "OUTBOX_TRANSPORT_VISIBILITY_TIMEOUT_S": ("visibility_timeout", float, 1.0, 30 * 86_400.0),
    "OUTBOX_TRANSPORT_POLLING_INTERVAL_S": ("polling_interval", float, 0.01, 60.0),
    "OUTBOX_TRANSPORT_RECEIVE_BATCH": ("receive_batch", int, 1, 1000),
    "OUTBOX_TRANSPORT_QUEUE_TABLE": ("queue_table", str, 0, 0),
}
#: Prefix of the Kafka destination's settings (``outbox.publisher.kafka``; docs/destinations.md).
KAFKA_PREFIX = "OUTBOX_KAFKA_"
#: The Kafka destination's settings: name -> (librdkafka property, or None for what the
#: publisher does itself; type; default). Declared here, where ``known_names`` sees them;
#: read and validated by ``outbox.publisher.kafka.KafkaOptions``. SASL credentials come
#: from OUTBOX_PUBLISH_URL's user and password (masked like every URL).
KAFKA_SETTINGS: dict[str, tuple[str | None, type, Any]] = {
    # The Kafka topic of an event: a template over {topic} and {aggregate_type}.
    "OUTBOX_KAFKA_TOPIC_TEMPLATE": (None, str, "{topic}"),
    # Off: an event whose Kafka topic does not exist is a FATAL error; on: the broker's
    # auto-creation is left to make it.
    "OUTBOX_KAFKA_AUTO_CREATE_TOPICS": (None, bool, False),
    "OUTBOX_KAFKA_SECURITY_PROTOCOL": ("security.protocol", str, "plaintext"),
    "OUTBOX_KAFKA_SASL_MECHANISM": ("sasl.mechanism", str, None),
    "OUTBOX_KAFKA_SSL_CA_LOCATION": ("ssl.ca.location", str, None),
    "OUTBOX_KAFKA_SSL_CERTIFICATE_LOCATION": ("ssl.certificate.location", str, None),
    "OUTBOX_KAFKA_SSL_KEY_LOCATION": ("ssl.key.location", str, None),
    # Larger messages are POISON (the client refuses them; match the topic's max.message.bytes).
    "OUTBOX_KAFKA_MESSAGE_MAX_BYTES": ("message.max.bytes", int, 1_000_000),
    # How long a message may wait for its delivery report before it counts as not delivered.
    "OUTBOX_KAFKA_DELIVERY_TIMEOUT_S": (None, float, 15.0),
}
#: Bounds on the life of every relay transaction and connection (docs/relay.md, "A network
#: cut"): query parameters of a PostgreSQL or MySQL/MariaDB OUTBOX_DATABASE_URL that the
#: engines read themselves at connect (never passed to the driver): name -> (default, lower
#: bound, upper bound), in seconds. Read through ``session_bounds``.
SESSION_BOUNDS: dict[str, tuple[int, int, int]] = {
    # The server ends a relay session left idle inside a transaction this long (its client
    # stalled or cut off between two statements or before its COMMIT), and its locks with it.
    "idle_transaction_timeout_s": (5, 1, 3_600),
    # A peer that stopped answering is found by TCP (keepalives, unacknowledged data) within
    # about this long: by the server for a session blocked sending, by the client waiting.
    "tcp_timeout_s": (10, 2, 3_600),
}
#: The schemes (before any +driver) whose engines read SESSION_BOUNDS.
SESSION_BOUND_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb")


def session_bounds(url: str) -> dict[str, int]:
    """The SESSION_BOUNDS of a database URL: its query parameters over the defaults. A value
    that is not a whole number of seconds within the bounds is a ``ConfigError`` naming
    OUTBOX_DATABASE_URL and the parameter."""
    given = {k: v for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=True) if k in SESSION_BOUNDS}
    bounds: dict[str, int] = {}
    for name, (default, low, high) in SESSION_BOUNDS.items():
        if name not in given:
            bounds[name] = default
            continue
        try:
            value = int(given[name].strip())
        except ValueError:
            raise ConfigError(f"OUTBOX_DATABASE_URL: {name}={given[name]!r} is not a whole number of seconds") from None
        if not low <= value <= high:
            raise ConfigError(f"OUTBOX_DATABASE_URL: {name}={value} must be between {low} and {high} seconds")
        bounds[name] = value
    return bounds


def without_session_bounds(url: str) -> str:
    """The URL with the SESSION_BOUNDS parameters taken out, for the driver."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if not any(k in SESSION_BOUNDS for k, _ in query):
        return url
    kept = [(k, v) for k, v in query if k not in SESSION_BOUNDS]
    return urlunsplit(parts._replace(query=urlencode(kept, quote_via=quote)))


#: The URL scheme of the package's own database broker (``outboxdb+postgresql://...``):
#: a known transport even before ``outbox.transport`` registers it with kombu.
DATABASE_BROKER_SCHEME = "outboxdb"

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
    #: Where ``outbox pipeline archive`` writes (a directory or a Spark URI). While it is
    #: set, the relay's purge deletes nothing: only the archive job deletes, and only
    #: rows it has archived.
    archive_uri: str | None = None
    #: OUTBOX_NAMESPACE: what names this outbox's queues, claim-request token and wake
    #: channel on a shared broker; None derives it from the table, schema and database
    #: (``names``: docs/relay.md, "Several outboxes on one broker").
    namespace: str | None = None

    def __post_init__(self) -> None:
        for url in (self.database_url, self.publish_url, self.celery_broker_url):
            register_url(url)  # masked wherever it shows up from now on (outbox.core.redact)
        validate_identifier(self.table, "OUTBOX_TABLE")
        if self.schema is not None:
            validate_identifier(self.schema, "OUTBOX_SCHEMA")
        validate_database_url(self.database_url)
        if self.namespace is not None:
            validate_namespace(self.namespace)
        validate_publish_url(self.publish_url)
        if self.celery_broker_url:
            validate_kombu_url(self.celery_broker_url, "OUTBOX_CELERY_BROKER_URL")
        if not self.exchange:
            raise ConfigError("OUTBOX_EXCHANGE must not be empty")
        for setting, name in (("OUTBOX_EXCHANGE", self.exchange), ("OUTBOX_DEAD_LETTER_EXCHANGE",
                                                                   self.dead_letter_exchange)):
            if name is not None:
                validate_exchange(name, setting)
        if self.dead_letter_exchange is not None and self.dead_letter_exchange == self.exchange:
            raise ConfigError(f"OUTBOX_DEAD_LETTER_EXCHANGE={self.dead_letter_exchange!r} must differ from "
                              "OUTBOX_EXCHANGE: dead rows would reach the consumers of live events")
        _positive("OUTBOX_BATCH_SIZE", self.batch_size, upper=10_000)
        _positive("OUTBOX_CLAIM_TIMEOUT_MS", self.claim_timeout_ms, upper=MAX_CLAIM_TIMEOUT_MS)
        _positive("OUTBOX_MAX_ATTEMPTS", self.max_attempts, upper=1_000)
        _positive("OUTBOX_CLAIM_INTERVAL_S", self.claim_interval_s, upper=86_400)
        _positive("OUTBOX_RETENTION_DAYS", self.retention_days, allow_zero=True)
        _positive("OUTBOX_MAX_PAYLOAD_BYTES", self.max_payload_bytes, upper=64 * 1024 * 1024)

    def __repr__(self) -> str:
        """With every password masked: settings end up in logs and tracebacks."""
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__)
        return redact(f"Settings({shown})")

    @property
    def outbox_namespace(self) -> str:
        """OUTBOX_NAMESPACE, else the one derived from the outbox's identity."""
        return self.namespace or default_namespace(self.database_url, self.table, self.schema)

    @property
    def queues(self) -> Queues:
        """This outbox's queues on the task runner's broker."""
        return Queues(self.outbox_namespace)

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
    "OUTBOX_ARCHIVE_URI": ("archive_uri", str),
    "OUTBOX_NAMESPACE": ("namespace", str),
}

SETTING_NAMES = tuple(_SETTINGS)


def _looks_like_odbc(url: str) -> bool:
    return "=" in url and ";" in url


#: Database URL schemes the engines (``outbox.storage.engines.kind_of_url``) accept, before any
#: ``+driver`` suffix. Checked here too so that every process (CLI, worker, beat) refuses
#: an unknown database at start-up, not at its first claim.
DATABASE_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "mssql", "sqlserver")


def validate_database_url(url: str) -> str:
    """A URL of a supported database (``scheme[+driver]://...``) or a raw ODBC connection
    string (``DRIVER=...;SERVER=...``). The value is quoted with its password masked."""
    shown = redact(repr(url))
    if not url or ("://" not in url and not _looks_like_odbc(url)):
        raise ConfigError(f"OUTBOX_DATABASE_URL={shown} is not a database URL "
                          "(expected sqlite:///path, postgresql://..., mysql://... or mssql+pyodbc://...)")
    if "://" in url:
        scheme = url.split("://", 1)[0].lower()
        if scheme.split("+", 1)[0] not in DATABASE_SCHEMES:
            raise ConfigError(f"OUTBOX_DATABASE_URL={shown}: unsupported database {scheme!r} "
                              "(use sqlite:///, postgresql://, mysql:// or mssql+pyodbc://)")
        if scheme.split("+", 1)[0] in SESSION_BOUND_SCHEMES:
            session_bounds(url)
    elif "driver=" not in url.lower():
        raise ConfigError(f"OUTBOX_DATABASE_URL={shown} looks like an ODBC connection string without DRIVER=")
    return url


def validate_namespace(name: str, setting: str = "OUTBOX_NAMESPACE") -> str:
    """What names an outbox's queues (``<namespace>.claim``...): Dramatiq's rule for queue names."""
    if not valid_namespace(name):
        raise ConfigError(f"{setting}={name!r} must be 1 to {MAX_NAMESPACE} letters, digits or _ . -, "
                          "starting with a letter or _")
    return name


def validate_exchange(name: str, setting: str) -> str:
    """AMQP carries an exchange name as a short string (at most 255 bytes), and RabbitMQ
    refuses to declare names starting with ``amq.`` (ACCESS_REFUSED): either would only
    show up at the first publish, as a fatal error."""
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise ConfigError(f"{setting}={name[:40]!r}... is longer than 255 bytes")
    if name.startswith("amq."):
        raise ConfigError(f"{setting}={name!r}: names starting with 'amq.' are reserved by the broker")
    return name


def validate_kombu_url(url: str, setting: str, *, database_broker: bool = True) -> str:
    """A URL whose scheme kombu knows (``amqp://``, ``redis://``, ``memory://``, ...), and for
    Celery's broker (``database_broker``) the package's own ``outboxdb``, which is no
    destination. Otherwise kombu raises ``KeyError`` only when the first connection is made,
    which would look like a broker failure rather than the configuration error it is."""
    from kombu.transport import TRANSPORT_ALIASES  # kombu comes with Celery, a core dependency

    shown = redact(repr(url))
    if "://" not in url:
        raise ConfigError(f"{setting}={shown} is not a broker URL (expected e.g. amqp://user:pass@host//)")
    scheme = url.split("://", 1)[0]
    transport = scheme.split("+", 1)[0]
    known = {k for k in TRANSPORT_ALIASES if k.islower()} - {DATABASE_BROKER_SCHEME}
    if database_broker:
        known.add(DATABASE_BROKER_SCHEME)
    if transport not in known:
        close = difflib.get_close_matches(transport, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = ("is Celery's broker on the database, not a destination"
                if transport == DATABASE_BROKER_SCHEME else f"unknown broker transport {scheme!r}{hint}")
        raise ConfigError(f"{setting}={shown}: {what} (known: {', '.join(sorted(known))})")
    return url


#: The destinations OUTBOX_PUBLISH_URL may name (docs/destinations.md): kombu's AMQP, Redis
#: and in-memory transports, and Kafka (``outbox.publisher.kafka``). Every one works end to
#: end; kombu knows more transports, which are refused because nothing tests them here.
DESTINATION_SCHEMES = ("amqp", "amqps", "pyamqp", "redis", "rediss", "memory", "kafka")


def validate_publish_url(url: str, setting: str = "OUTBOX_PUBLISH_URL") -> str:
    """A URL of a supported destination (``DESTINATION_SCHEMES``); a ``kafka://`` URL lists
    its bootstrap servers as ``host:port[,host:port...]``."""
    shown = redact(repr(url))
    if "://" not in url:
        raise ConfigError(f"{setting}={shown} is not a broker URL (expected e.g. amqp://user:pass@host//)")
    scheme, rest = url.split("://", 1)
    transport = scheme.split("+", 1)[0]
    if transport not in DESTINATION_SCHEMES:
        close = difflib.get_close_matches(transport, DESTINATION_SCHEMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = ("is Celery's broker on the database, not a destination"
                if transport == DATABASE_BROKER_SCHEME else f"unknown broker transport {scheme!r}{hint}")
        raise ConfigError(f"{setting}={shown}: {what} (known: {', '.join(DESTINATION_SCHEMES)})")
    if transport == "kafka":
        servers = rest.rsplit("@", 1)[-1].split("/", 1)[0].split("?", 1)[0]
        for server in servers.split(","):
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{setting}={shown}: {server!r} is not host:port "
                                  "(expected kafka://host:port[,host:port...])")
    return url


#: Dramatiq's broker URL schemes: its Redis broker and its RabbitMQ broker.
DRAMATIQ_SCHEMES = ("redis", "rediss", "amqp", "amqps")


def validate_dramatiq_broker_url(url: str, setting: str = "OUTBOX_DRAMATIQ_BROKER_URL") -> str:
    """OUTBOX_DRAMATIQ_BROKER_URL: ``redis://`` (Dramatiq's RedisBroker) or ``amqp://``
    (its RabbitmqBroker). Checked at start-up, so a typo is a configuration error naming
    the setting rather than a connection failure in a worker thread."""
    shown = redact(repr(url))
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"{setting}={shown} is not a broker URL (expected redis://host:6379/0 or "
                          "amqp://user:pass@host:5672/)")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in DRAMATIQ_SCHEMES:
        close = difflib.get_close_matches(scheme, DRAMATIQ_SCHEMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{setting}={shown}: Dramatiq has no broker for {scheme!r}{hint} "
                          f"(known: {', '.join(DRAMATIQ_SCHEMES)})")
    register_url(url)
    return url


def validate_dramatiq_namespace(name: str, setting: str = "OUTBOX_DRAMATIQ_NAMESPACE") -> str:
    """The Redis key namespace of Dramatiq's queues (RedisBroker ``namespace``)."""
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", name or ""):
        raise ConfigError(f"{setting}={name!r} must be 1 to 100 letters, digits or _ . : -")
    return name


@dataclass(frozen=True)
class DramatiqSettings:
    """The Dramatiq front-end's settings (docs/dramatiq.md)."""

    broker_url: str
    namespace: str = "dramatiq"


def _named_setting(name: str, environ: Mapping[str, str]) -> Any:
    """``name`` from the environment, else from Django settings when Django is set up."""
    value = environ.get(name)
    if value not in (None, ""):
        return value
    try:
        from django.conf import settings as dj  # type: ignore[import-not-found]

        if dj.configured and getattr(dj, name, None) not in (None, ""):
            return getattr(dj, name)
    except Exception:  # Django absent or not set up: not a configuration source
        pass
    return None


def dramatiq_settings(environ: Mapping[str, str] | None = None, *, required: bool = False) -> DramatiqSettings | None:
    """OUTBOX_DRAMATIQ_BROKER_URL and OUTBOX_DRAMATIQ_NAMESPACE, validated; None when the
    URL is unset (Celery is then the runner), or a ``ConfigError`` when ``required``."""
    environ = os.environ if environ is None else environ
    url = _named_setting("OUTBOX_DRAMATIQ_BROKER_URL", environ)
    if url is None:
        if required:
            raise ConfigError("OUTBOX_DRAMATIQ_BROKER_URL is not set: the Dramatiq front-end needs Dramatiq's "
                              "broker (redis://host:6379/0 or amqp://user:pass@host:5672/)")
        return None
    namespace = _named_setting("OUTBOX_DRAMATIQ_NAMESPACE", environ) or "dramatiq"
    return DramatiqSettings(validate_dramatiq_broker_url(str(url).strip()),
                            validate_dramatiq_namespace(str(namespace).strip()))


def _positive(name: str, value: float, *, upper: float | None = None, allow_zero: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} must be a finite number")
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
    """OUTBOX_* from Django's settings: in a Django process, and also in `outbox ...` and
    `celery -A outbox ...` when DJANGO_SETTINGS_MODULE is set (the settings module is then
    imported; Django itself is not set up). Without OUTBOX_DATABASE_URL there, the URL is
    derived from the settings module's ``DATABASES["default"]``, so the relay uses the
    project's database."""
    try:
        from django.conf import settings as dj  # type: ignore[import-not-found]
    except ImportError:
        if os.environ.get("DJANGO_SETTINGS_MODULE"):
            _warn_once("DJANGO_SETTINGS_MODULE is set but Django is not installed: its settings are not read "
                       f"({install_hint('django')})")
        return {}
    try:
        if not dj.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
            return {}
        values = {name: getattr(dj, name) for name in _SETTINGS if hasattr(dj, name)}
        databases = getattr(dj, "DATABASES", None) or {}
    except ImportError as exc:  # DJANGO_SETTINGS_MODULE names a module that does not import
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={os.environ.get('DJANGO_SETTINGS_MODULE')!r} cannot be "
                          f"imported: {exc}") from None
    except Exception:  # Django present but not set up: not our configuration source
        return {}
    # Only for a project's settings module: a process that calls settings.configure() by
    # hand (scripts, tests) keeps the relay's own default unless it sets OUTBOX_DATABASE_URL.
    if not values.get("OUTBOX_DATABASE_URL") and "default" in databases and getattr(dj, "SETTINGS_MODULE", None):
        values["OUTBOX_DATABASE_URL"] = django_database_url(databases["default"])
    return values


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        import logging

        logging.getLogger("outbox.core.config").warning("outbox: %s", message)


#: Django ENGINE (its last dotted part) -> URL scheme of OUTBOX_DATABASE_URL.
_DJANGO_SCHEMES = {"sqlite3": "sqlite", "postgresql": "postgresql", "postgresql_psycopg2": "postgresql",
                   "postgis": "postgresql", "mysql": "mysql", "mssql": "mssql+pyodbc"}


def django_database_url(database: Mapping[str, Any]) -> str | None:
    """OUTBOX_DATABASE_URL for one entry of Django's DATABASES, or None for an engine the
    relay does not support (then the default applies, as without Django)."""
    from urllib.parse import quote

    engine = str(database.get("ENGINE") or "")
    scheme = _DJANGO_SCHEMES.get(engine.rsplit(".", 1)[-1])
    if scheme is None:
        return None
    name = str(database.get("NAME") or "")
    if scheme == "sqlite":
        return f"sqlite:///{name}" if name else None
    user, password = str(database.get("USER") or ""), str(database.get("PASSWORD") or "")
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "") + ("@" if user else "")
    host, port = str(database.get("HOST") or "127.0.0.1"), str(database.get("PORT") or "")
    url = f"{scheme}://{auth}{host}{':' + port if port else ''}/{quote(name, safe='')}"
    if scheme.startswith("mssql"):  # mssql-django: OPTIONS driver and extra_params ("k=v;k=v")
        options = database.get("OPTIONS") or {}
        query = [("driver", str(options.get("driver") or "ODBC Driver 18 for SQL Server"))]
        for item in str(options.get("extra_params") or "").split(";"):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                query.append((key.strip(), value.strip()))
        url += "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query)
    return url


#: Every other OUTBOX_* name the package reads: the relay's tuning options
#: (``outbox.core.config.RelayOptions``) and the wake-up, LISTEN and metrics options. A test
#: checks this list against the source, so a new option cannot be forgotten here.
OTHER_NAMES = (
    "OUTBOX_RELAY_TASK_ROWS", "OUTBOX_RELAY_INLINE_ROWS", "OUTBOX_RELAY_MAX_QUEUED_TASKS",
    "OUTBOX_RELAY_MAX_BATCH_BYTES", "OUTBOX_RELAY_BACKOFF_BASE_S", "OUTBOX_RELAY_BACKOFF_MAX_S",
    "OUTBOX_RELAY_BREAKER_S", "OUTBOX_RELAY_FATAL_PAUSE_S", "OUTBOX_RELAY_ROUTE_PAUSE_S",
    "OUTBOX_RELAY_ROUTE_PAUSE_MAX_S", "OUTBOX_RELAY_CLAIM_REQUEST_TTL_S", "OUTBOX_RELAY_PURGE_INTERVAL_S",
    "OUTBOX_RELAY_LEASE_SAFETY", "OUTBOX_RELAY_MAX_MESSAGE_BYTES",
    "OUTBOX_RELAY_PIPELINED_TOPICS", "OUTBOX_RELAY_PIPELINED_AGGREGATE_TYPES",
    "OUTBOX_RELAY_WAKE", "OUTBOX_RELAY_LISTEN", "OUTBOX_RELAY_LISTEN_CHANNEL", "OUTBOX_RELAY_IN_PROCESS_CLAIM",
    "OUTBOX_RELAY_METRICS_PORT", "OUTBOX_RELAY_METRICS_ADDR", "OUTBOX_RELAY_METRICS_REFRESH_S",
    "OUTBOX_RELAY_HEARTBEAT_S", "OUTBOX_RELAY_HOLDER_TIMEOUT_S",
    "OUTBOX_SPARK_MASTER", "OUTBOX_SPARK_SHUFFLE_PARTITIONS", "OUTBOX_SPARK_LOG_LEVEL", "OUTBOX_SPARK_UI",
    "OUTBOX_PIPELINE_CRASH_AT",
    *TRANSPORT_SETTINGS, *KAFKA_SETTINGS,
    # The Dramatiq front-end (outbox.dramatiq, docs/dramatiq.md).
    "OUTBOX_DRAMATIQ_BROKER_URL", "OUTBOX_DRAMATIQ_NAMESPACE",
)
#: Names that are not the package's settings: the test suite's own.
EXEMPT_NAMES = ("OUTBOX_REQUIRE_SERVICES",)
EXEMPT_PREFIXES = ("OUTBOX_TEST_",)

_warned: set[str] = set()


def known_names() -> tuple[str, ...]:
    return (*_SETTINGS, *OTHER_NAMES)


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for every OUTBOX_* variable in ``environ``
    that nothing reads: most likely a typo, which would otherwise be silently ignored."""
    known = known_names()
    found = []
    for name in sorted(environ):
        if (not name.startswith("OUTBOX_") or name in known or name in EXEMPT_NAMES
                or name.startswith(EXEMPT_PREFIXES)):
            continue
        # Compared without the common prefix, which would make every name look alike.
        close = difflib.get_close_matches(name[len("OUTBOX_"):], [k[len("OUTBOX_"):] for k in known],
                                          n=1, cutoff=0.6)
        found.append((name, "OUTBOX_" + close[0] if close else None))
    return found


def warn_unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning line per unknown OUTBOX_* variable, once per process; returns the
    names warned about this time."""
    warned = []
    for name, close in unknown_environment(os.environ if environ is None else environ):
        if name in _warned:
            continue
        _warned.add(name)
        warned.append(name)
        hint = f"did you mean {close}?" if close else "no setting has a similar name"
        log.warning("outbox: unknown environment variable %s is ignored (%s)", name, hint)
    return warned


#: Settings whose empty value is an error rather than "unset" (``load_settings``).
NOT_EMPTY = ("OUTBOX_EXCHANGE",)


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build validated ``Settings``; raise ``ConfigError`` naming the first bad setting.

    Reading the process environment (``environ`` not given) also warns, once per
    process, about OUTBOX_* variables nothing reads (``warn_unknown_environment``)."""
    if environ is None:
        environ = os.environ
        warn_unknown_environment(environ)
    sources: list[Mapping[str, Any]] = [overrides or {}, environ, _django_settings()]
    values: dict[str, Any] = {}
    for name in NOT_EMPTY:
        # Empty means unset elsewhere; here it would silently mean the default name.
        if any(isinstance(s.get(name), str) and not s[name].strip() for s in sources[:2]):
            raise ConfigError(f"{name} is set but empty: unset it for the default ({Settings.exchange!r}) or name "
                              "an exchange (AMQP's nameless default exchange cannot route by topic)")
    for name, (field, kind) in _SETTINGS.items():
        for source in sources:
            if name in source and source[name] not in (None, ""):
                values[field] = _parse(name, source[name], kind)
                break
    # OUTBOX_RELAY_* keys tune the relay (``RelayOptions`` below, which reads and
    # validates them itself); they may sit next to these settings in the same config.
    # OUTBOX_TRANSPORT_* keys likewise belong to the database broker (``outbox.transport``),
    # OUTBOX_KAFKA_* keys to the Kafka destination (``outbox.publisher.kafka``).
    unknown = [k for k in (overrides or {}) if k.startswith("OUTBOX_") and k not in _SETTINGS
               and not k.startswith((RELAY_PREFIX, TRANSPORT_PREFIX, KAFKA_PREFIX))]
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]} (known: {', '.join(_SETTINGS)})")
    return Settings(**{k: v for k, v in values.items() if v is not None})


#: The one cache of what was read: "settings" (``get_settings``), "relay_settings" and
#: "relay_options" (the relay's, with its Celery config keys on top). ``reset_settings``
#: empties it all.
_cache: dict[str, Any] = {}
_cache_lock = threading.RLock()


def get_settings() -> Settings:
    """The process-wide settings, loaded on first use."""
    with _cache_lock:
        if "settings" not in _cache:
            _cache["settings"] = load_settings()
        return _cache["settings"]


def reset_settings() -> None:
    """Forget everything read (tests, and processes that change their environment)."""
    with _cache_lock:
        _cache.clear()


# -- the relay's tuning options (OUTBOX_RELAY_*) ---------------------------------------------

@dataclass(frozen=True)
class RelayOptions:
    """Tuning of the relay beyond the contract's OUTBOX_* settings.

    Each field is read from ``OUTBOX_RELAY_<FIELD>`` (Celery config key first, then the
    environment); see ``from_sources``.
    """

    #: Short chains are packed into one publish task until it holds this many rows
    #: (a chain is never split across tasks). 1 gives one task per chain. The default
    #: makes a full default claim one task: fuller waves of confirms and fewer Celery
    #: messages per event (docs/benchmarks.md measures 25 against 100).
    task_rows: int = 100
    #: A claim that did not come back full and holds at most this many rows is published
    #: by the claim task itself instead of going through Celery's broker as a publish
    #: task: live traffic saves a whole Celery hop. 0 turns it off.
    inline_rows: int = 25
    #: Claims hold back while this many publish tasks wait in Celery's broker queue.
    #: Rows in flight are then bounded by about (max_queued_tasks + worker processes)
    #: x rows per task (at most OUTBOX_BATCH_SIZE).
    max_queued_tasks: int = 16
    #: Bytes (payload + ~256 per row) one claimed batch may send on as publish tasks;
    #: the rest of the batch is released at once. The first row always goes.
    max_batch_bytes: int = 8 * 1024 * 1024
    #: Retry back-off after a retriable failure: base * 2^(attempt-1), capped, with jitter.
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    #: How long claims pause after the broker pushed back or was unreachable.
    breaker_s: float = 5.0
    #: How long claims stop after a fatal (configuration) error.
    fatal_pause_s: float = 300.0
    #: How long one routing key pauses after a queue bound for it refused a message
    #: (``basic.nack``: full with ``reject-publish``, or unavailable); other routes flow on.
    #: Doubles each time the route is refused again right after its pause, up to
    #: ``route_pause_max_s``.
    route_pause_s: float = 1.0
    route_pause_max_s: float = 30.0
    #: A requested claim (drain mode, wake-up) that never ran stops blocking new
    #: requests after this long. Beat's ticks go on regardless.
    claim_request_ttl_s: float = 2.0
    #: How often beat runs the purge of old done rows.
    purge_interval_s: float = 3600.0
    #: A publish task starts no chain once this fraction of the lease has passed since
    #: the claim: the rows are left to lease recovery rather than risk a second live copy.
    lease_safety: float = 0.8
    #: The publisher refuses (as POISON: dead at once, no broker round trip) a message
    #: body larger than this. The default is ``publisher.DEFAULT_MAX_MESSAGE_BYTES``
    #: (16 MiB, RabbitMQ 4's own limit); set it to your broker's ``max_message_size``.
    max_message_bytes: int = 16 * 1024 * 1024
    #: Every this many seconds a worker logs one INFO line: alive, the backlog per status
    #: and the age of the oldest undelivered row (``outbox.worker_logging``).
    heartbeat_s: float = 300.0
    #: A relay worker process whose liveness record has not been refreshed for this long is
    #: taken for lost: the leases of the rows it holds end at once (docs/relay.md, "Lost
    #: workers"). Each process refreshes its record every third of it.
    holder_timeout_s: float = 3.0
    #: Chains of events whose topic matches one of these ``fnmatch`` patterns (or whose
    #: aggregate type is one of ``pipelined_aggregate_types``) are pipelined: sent without
    #: waiting for each confirm, with a weaker ordering guarantee (docs/relay.md,
    #: "Pipelined chains"). Empty (the default): every chain is strict.
    pipelined_topics: tuple[str, ...] = ()
    pipelined_aggregate_types: tuple[str, ...] = ()

    def pipelined(self, topic: str, aggregate_type: str) -> bool:
        """Whether an event opted in to pipelining (docs/relay.md, "Pipelined chains")."""
        return aggregate_type in self.pipelined_aggregate_types or any(
            fnmatch.fnmatchcase(topic, pattern) for pattern in self.pipelined_topics)

    @property
    def pipelines(self) -> bool:
        """Whether any event can opt in: without it the relay never asks."""
        return bool(self.pipelined_topics or self.pipelined_aggregate_types)

    @classmethod
    def from_sources(cls, *sources: Mapping[str, Any]) -> "RelayOptions":
        """Read ``OUTBOX_RELAY_*`` from the first source that has each name."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f"OUTBOX_RELAY_{f.name.upper()}"
            for source in sources:
                raw = source.get(name) if source is not None else None
                if raw in (None, ""):
                    continue
                if f.name in _LIST_OPTIONS:
                    values[f.name] = _name_list(name, raw)
                    break
                kind = int if f.type in ("int", int) else float
                try:
                    value = kind(str(raw).strip()) if isinstance(raw, str) else kind(raw)
                except (TypeError, ValueError):
                    raise ConfigError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
                if not math.isfinite(value):  # NaN compares false with everything: check first
                    raise ConfigError(f"{name}={raw!r} must be a finite number")
                lowest_ok = 0 if f.name in _ZERO_ALLOWED else None
                if isinstance(raw, bool) or (value < 0 if lowest_ok == 0 else value <= 0) or (
                        f.name == "lease_safety" and value > 1):
                    raise ConfigError(f"{name}={raw!r} must be a number {'>= 0' if lowest_ok == 0 else '> 0'}"
                                      + (" and <= 1" if f.name == "lease_safety" else ""))
                upper = _MAX_SECONDS.get(f.name, MAX_OPTION_S if f.name.endswith("_s") else None)
                if upper is not None and value > upper:
                    raise ConfigError(f"{name}={raw!r} is above the maximum of {upper:g} s")
                values[f.name] = value
                break
        return cls(**values)


#: Options that are comma-separated lists of names (or ``fnmatch`` patterns).
_LIST_OPTIONS = frozenset({"pipelined_topics", "pipelined_aggregate_types"})


def _name_list(name: str, raw: Any) -> tuple[str, ...]:
    """A comma-separated list (or, from a Celery config key, a list or tuple) of names: no
    empty item, no whitespace inside one, each at most 255 bytes (an AMQP short string,
    which is what a topic travels as)."""
    if isinstance(raw, str):
        items = raw.split(",")
    elif isinstance(raw, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in raw):
        items = list(raw)
    else:
        raise ConfigError(f"{name}={raw!r} is not a comma-separated list of names")
    found: list[str] = []
    for item in items:
        item = item.strip()
        if not item or any(c.isspace() for c in item) or len(item.encode("utf-8", "surrogatepass")) > 255:
            raise ConfigError(f"{name}={raw!r}: {item!r} is not a name (comma-separated, no empty item, "
                              "no whitespace, at most 255 bytes each)")
        if item not in found:
            found.append(item)
    return tuple(found)


#: Options where 0 means "off".
_ZERO_ALLOWED = frozenset({"inline_rows"})
#: Durations (options ending in ``_s``) longer than a day are typos (milliseconds written
#: as seconds), and a pause that long could not be written as a retry time anyway.
MAX_OPTION_S = 86_400.0
_MAX_SECONDS = {"purge_interval_s": 30 * 86_400.0}


# -- one reader for the relay's processes ----------------------------------------------------
#
# Precedence, the same for every name: the Celery app's config keys (when the relay's app
# registered them with ``use_conf``), the environment, Django settings, the default. One
# cache holds what was read; ``reset_settings`` empties it.

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

#: Returns the Celery app's configuration (a mapping); registered by ``outbox.celery_app``.
_conf_source: Callable[[], Mapping[str, Any]] | None = None


def use_conf(source: Callable[[], Mapping[str, Any]] | None) -> None:
    """Register where the relay's Celery config keys come from (``outbox.celery_app`` does)."""
    global _conf_source
    with _cache_lock:
        _conf_source = source
        _cache.pop("relay_settings", None)
        _cache.pop("relay_options", None)
        _cache.pop("wake_options", None)


def conf_keys() -> dict[str, Any]:
    """OUTBOX_* keys present in the registered Celery configuration."""
    source = _conf_source
    if source is None:
        return {}
    conf = source()
    return {key: conf[key] for key in list(conf.keys()) if isinstance(key, str) and key.startswith("OUTBOX_")}


def relay_settings() -> Settings:
    """The OUTBOX_* settings of the relay: Celery config keys over the environment."""
    with _cache_lock:
        if "relay_settings" not in _cache:
            overrides = {k: v for k, v in conf_keys().items() if not k.startswith(RELAY_PREFIX)}
            _cache["relay_settings"] = load_settings(overrides=overrides)
        return _cache["relay_settings"]


def relay_options() -> RelayOptions:
    """The relay's tuning options: Celery config keys over the environment."""
    with _cache_lock:
        if "relay_options" not in _cache:
            _cache["relay_options"] = RelayOptions.from_sources(conf_keys(), os.environ)
        return _cache["relay_options"]


def extra_setting(name: str, default: Any = None) -> Any:
    """An ``OUTBOX_RELAY_*`` option of wake-ups, LISTEN/NOTIFY and metrics, read with the
    precedence above (these are prefixed OUTBOX_RELAY_ because ``load_settings`` rejects
    unknown OUTBOX_* Celery config keys). Read on each call: callers cache what they need."""
    try:
        value = conf_keys().get(name)
        if value not in (None, ""):
            return value
    except Exception:  # an invalid configuration is reported by the relay itself
        pass
    value = os.environ.get(name)
    if value not in (None, ""):
        return value
    try:
        from django.conf import settings as dj  # type: ignore[import-not-found]

        if dj.configured and getattr(dj, name, None) not in (None, ""):
            return getattr(dj, name)
    except Exception:
        pass
    return default


@dataclass(frozen=True)
class MetricsOptions:
    """The relay's Prometheus metrics (``outbox.relay.metrics``; docs/waking-and-metrics.md):
    ``OUTBOX_RELAY_METRICS_<FIELD>``, read like ``extra_setting``."""

    #: Serve ``/metrics`` on this port; None (unset, empty or 0): metrics are off.
    port: int | None = None
    #: The address the endpoint binds.
    addr: str = "0.0.0.0"
    #: Each worker reads the gauges (one query, in its own thread) every this many seconds.
    refresh_s: float = 5.0

    @classmethod
    def from_sources(cls, *sources: Mapping[str, Any]) -> "MetricsOptions":
        """Read ``OUTBOX_RELAY_METRICS_*`` from the first source that has each name."""
        def raw(field: str) -> Any:
            name = f"OUTBOX_RELAY_METRICS_{field.upper()}"
            return next((s[name] for s in sources if s.get(name) not in (None, "")), None)

        port = raw("port")
        if port in (None, 0, "0"):
            port = None
        else:
            try:
                port = int(str(port).strip())
            except ValueError:
                raise ConfigError(f"OUTBOX_RELAY_METRICS_PORT={raw('port')!r} is not a port number") from None
            if not 0 < port < 65536:
                raise ConfigError(f"OUTBOX_RELAY_METRICS_PORT={raw('port')!r} is not a port number")
        refresh_s = _parse("OUTBOX_RELAY_METRICS_REFRESH_S", raw("refresh_s"), float)
        if refresh_s is not None and not 0 < refresh_s < float("inf"):
            raise ConfigError(f"OUTBOX_RELAY_METRICS_REFRESH_S={raw('refresh_s')!r} must be a number of seconds "
                              "above 0")
        return cls(port=port, addr=str(raw("addr") or cls.addr),
                   refresh_s=cls.refresh_s if refresh_s is None else refresh_s)


def metrics_options() -> MetricsOptions:
    """The metrics options, read on each call (``outbox.relay.metrics`` decides once per process)."""
    return MetricsOptions.from_sources({f"OUTBOX_RELAY_METRICS_{f.name.upper()}": extra_setting(
        f"OUTBOX_RELAY_METRICS_{f.name.upper()}") for f in fields(MetricsOptions)})


def _boolean(name: str, raw: Any, default: bool) -> bool:
    if raw is None:
        return default
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def flag(name: str, default: bool = False) -> bool:
    """A boolean ``extra_setting``: 1/true/yes/on or 0/false/no/off."""
    return _boolean(name, extra_setting(name), default)


# -- waking the relay: post-commit wake-ups and LISTEN/NOTIFY (docs/waking-and-metrics.md) -------

@dataclass(frozen=True)
class WakeOptions:
    """The options of ``outbox.wake`` and ``outbox.relay.listen``, read once with the precedence
    above (``extra_setting``) and kept in the one cache."""

    #: OUTBOX_RELAY_WAKE: post-commit wake-ups in this process.
    wake: bool = True
    #: OUTBOX_RELAY_LISTEN: on PostgreSQL, ``enqueue`` notifies and workers LISTEN.
    listen: bool = False
    #: OUTBOX_RELAY_LISTEN_CHANNEL: the NOTIFY channel; None derives it from the table.
    listen_channel: str | None = None
    #: OUTBOX_RELAY_IN_PROCESS_CLAIM: a worker's main process claims itself when a wake-up
    #: (Redis pub/sub) or a notification (LISTEN) reaches it; off, they become claim messages.
    in_process_claim: bool = True

    @classmethod
    def read(cls) -> "WakeOptions":
        channel = extra_setting("OUTBOX_RELAY_LISTEN_CHANNEL")
        if channel not in (None, ""):
            channel = validate_identifier(str(channel).strip(), "OUTBOX_RELAY_LISTEN_CHANNEL")
        return cls(wake=_boolean("OUTBOX_RELAY_WAKE", extra_setting("OUTBOX_RELAY_WAKE"), True),
                   listen=_boolean("OUTBOX_RELAY_LISTEN", extra_setting("OUTBOX_RELAY_LISTEN"), False),
                   listen_channel=channel or None,
                   in_process_claim=_boolean("OUTBOX_RELAY_IN_PROCESS_CLAIM",
                                             extra_setting("OUTBOX_RELAY_IN_PROCESS_CLAIM"), True))


def wake_options() -> WakeOptions:
    """The wake-up and LISTEN options of this process (cached; ``reset_settings`` forgets them)."""
    with _cache_lock:
        options = _cache.get("wake_options")
        if options is None:
            options = _cache["wake_options"] = WakeOptions.read()
        return options


__all__ = ["Settings", "load_settings", "get_settings", "reset_settings", "validate_identifier",
           "validate_database_url", "validate_kombu_url", "validate_publish_url", "validate_namespace", "warn_unknown_environment",
           "unknown_environment",
           "known_names", "MAX_CLAIM_TIMEOUT_MS", "SETTING_NAMES", "RelayOptions", "MAX_OPTION_S",
           "SESSION_BOUNDS", "session_bounds", "without_session_bounds",
           "use_conf", "conf_keys", "relay_settings", "relay_options", "extra_setting",
           "flag", "MetricsOptions", "metrics_options", "WakeOptions", "wake_options"]
