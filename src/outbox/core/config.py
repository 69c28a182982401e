"""The settings, declared once: every option family of the package as data (``Options``
dataclasses whose fields name their setting, type, default, bounds and validator), and the
accessors that read them in the one order, once per process.

The order, the same for every name and every process (docs/design.md, "Settings"): the Celery
app's OUTBOX_* config keys (explicit overrides: the registered app's, else the CELERY_CONFIG_MODULE module's),
the environment, Django settings, the defaults. ``reset_settings`` forgets what was read.
The reader: ``outbox.core.options``; the sources and the cache: ``outbox.core.sources``; the
validators: ``outbox.core.checks``.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .checks import (
    DATABASE_BROKER_SCHEME,
    DATABASE_SCHEMES,
    MAX_CLAIM_TIMEOUT_MS,
    SESSION_BOUNDS,
    is_sqlite_url,
    session_bounds,
    validate_claim_ahead,
    validate_database_url,
    validate_dramatiq_broker_url,
    validate_dramatiq_namespace,
    validate_exchange,
    validate_identifier,
    validate_kafka_sasl_mechanism,
    validate_kafka_security_protocol,
    validate_kafka_topic_template,
    validate_kombu_url,
    validate_namespace,
    validate_publish_url,
    validate_queue_table,
    validate_spark_log_level,
    validate_spark_master,
    without_session_bounds,
)
from .errors import ConfigError
from .names import Queues, default_namespace, is_redis_url
from .options import Options, Sources, option
from .redact import redact, register_url
from .sources import (
    cached,
    conf_keys,
    django_database_url,
    django_outbox_names,
    django_settings,
    module_keys,
    module_setting,
    reset,
    use_conf,
)
from .tls import AMQP_PLAIN_SCHEMES, AMQP_TLS_SCHEMES, check_url_tls, refuse_kombu_url_tls

log = logging.getLogger("outbox.core.config")

#: Durations (options ending in ``_s``) longer than a day are typos (milliseconds written
#: as seconds), and a pause that long could not be written as a retry time anyway.
MAX_OPTION_S = 86_400.0

#: A claim tick or claim request is dropped when it arrives after its expiry, which the
#: sender reckons on its clock and the worker checks on its own: it never expires sooner
#: than this, so workers whose clocks run ahead of beat's still claim (docs/relay.md,
#: "Ticks, expiry and clocks").
CLOCK_SKEW_MARGIN_S = 30.0


def message_ttl_s(ttl_s: float) -> float:
    """How long a relay message that should expire after ``ttl_s`` is kept: ``CLOCK_SKEW_MARGIN_S`` at least."""
    return max(float(ttl_s), CLOCK_SKEW_MARGIN_S)


def _publish_url(url: str, setting: str) -> str:
    """OUTBOX_PUBLISH_URL: a destination's, with the TLS parameters of an AMQP or Redis URL read (``core.tls``)."""
    return check_url_tls(validate_publish_url(url, setting), setting)


def _celery_broker_url(url: str, setting: str) -> str:
    """OUTBOX_CELERY_BROKER_URL: a transport kombu has, with the TLS parameters of a Redis URL read
    (an AMQP broker's TLS is Celery's ``broker_use_ssl``: ``ssl_*`` in its URL are refused)."""
    url = validate_kombu_url(url, setting)
    if url.split("://", 1)[0].lower() in AMQP_TLS_SCHEMES + AMQP_PLAIN_SCHEMES:
        return refuse_kombu_url_tls(url, setting)
    return check_url_tls(url, setting) if is_redis_url(url) else url


def _dramatiq_url(url: str, setting: str) -> str:
    """OUTBOX_DRAMATIQ_BROKER_URL: a broker Dramatiq has, with the TLS parameters of its URL read."""
    return check_url_tls(validate_dramatiq_broker_url(url, setting), setting)


# -- the contract's settings (OUTBOX_*) --------------------------------------------------------

@dataclass(frozen=True)
class Settings(Options):
    """The OUTBOX_* settings of the contract (README, "Configuration")."""

    SHOW_GIVEN: ClassVar[bool] = False  # errors quote the value read: OUTBOX_RETENTION_DAYS=-2.0

    database_url: str = option("sqlite:///outbox.db", "str", check=validate_database_url, empty_error=(
        "unset it for the default (sqlite:///outbox.db, a file in the current directory) or give the "
        "database's URL"))
    table: str = option("outbox", "str", check=validate_identifier)
    schema: str | None = option(None, "str", check=validate_identifier)
    publish_url: str = option("memory://", "str", check=_publish_url, empty_error=(
        "unset it for the default (memory://, in-process: nothing leaves the process) or give the "
        "destination's URL"))
    exchange: str = option("outbox", "str", check=validate_exchange, empty_error=(
        "unset it for the default ('outbox') or name an exchange (AMQP's nameless default exchange cannot "
        "route by topic)"))
    #: Durable topic exchange that receives a copy of every row that goes dead (with the
    #: error in ``x-outbox-error``); None (the default) turns dead-letter publishing off.
    dead_letter_exchange: str | None = option(None, "str", check=validate_exchange)
    celery_broker_url: str | None = option(None, "str", check=_celery_broker_url, empty_error=(
        "unset it for the default (memory:// on SQLite, else redis://127.0.0.1:6379/0) or give Celery's "
        "broker URL"))
    batch_size: int = option(100, "int", above=0, maximum=10_000)
    #: At least 100 ms: a lease of a few ms expires before any publish can come back, and the
    #: row is claimed again meanwhile (a positive bound alone let 5 ms through: found in
    #: review). Not a second: CONTRACT.md bounds only the top, and a short lease (500 ms) is
    #: how a test sees lost tasks recovered quickly.
    claim_timeout_ms: int = option(60_000, "int", minimum=100, maximum=MAX_CLAIM_TIMEOUT_MS)
    max_attempts: int = option(10, "int", above=0, maximum=1_000)
    #: At least 50 ms: beat ticks in a busy loop below that (1e-300 passed "above 0").
    claim_interval_s: float = option(1.0, "float", minimum=0.05, maximum=86_400)
    #: At most 20,000 days (about 55 years): SQL Server's purge counts the age in seconds in an
    #: INT, and PostgreSQL's timestamps end; a larger value failed every purge (found in review).
    retention_days: float = option(7.0, "float", minimum=0, maximum=20_000)
    max_payload_bytes: int = option(1_048_576, "int", above=0, maximum=64 * 1024 * 1024)
    #: Where ``outbox pipeline archive`` writes (a directory or a Spark URI). While it is
    #: set, the relay's purge deletes nothing: only the archive job deletes, and only
    #: rows it has archived.
    archive_uri: str | None = option(None, "str")
    #: OUTBOX_NAMESPACE: what names this outbox's queues, claim-request token and wake
    #: channel on a shared broker; None derives it from the table, schema and database
    #: (``names``: docs/relay.md, "Several outboxes on one broker").
    namespace: str | None = option(None, "str", check=validate_namespace)

    def __post_init__(self) -> None:
        self.register_passwords()
        if self.schema is not None and self.schema.lower() != "main" and is_sqlite_url(self.database_url):
            # SQLite read it as an attached database's name: `outbox migrate` failed on "unknown
            # database" and said to run `outbox migrate` (found in review). ``main`` is SQLite's
            # name of the database the URL opens, which worked and stays (found in review too).
            raise ConfigError(f"OUTBOX_SCHEMA={self.schema!r} is for PostgreSQL, MySQL/MariaDB and SQL Server: a "
                              "SQLite database (OUTBOX_DATABASE_URL=sqlite:///...) has no schemas; unset OUTBOX_SCHEMA")
        if self.dead_letter_exchange is not None and self.dead_letter_exchange == self.exchange:
            raise ConfigError(f"OUTBOX_DEAD_LETTER_EXCHANGE={self.dead_letter_exchange!r} must differ from "
                              "OUTBOX_EXCHANGE: dead rows would reach the consumers of live events")

    def register_passwords(self) -> None:
        """Mask the URLs' passwords wherever they show up from now on (``outbox.core.redact``):
        done when made, and by a process that gets these settings unpickled, which makes none."""
        for url in (self.database_url, self.publish_url, self.celery_broker_url):
            register_url(url)

    def __repr__(self) -> str:
        """With every password masked: settings end up in logs and tracebacks."""
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
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
        if is_sqlite_url(self.database_url):
            return "memory://"
        return "redis://127.0.0.1:6379/0"



def celery_broker_conflict(settings: Settings, celery_url: str | None, source: str) -> str | None:
    """The line that stops a Celery worker or beat (and fails ``outbox check``) when ``source``
    names a broker for Celery, ``celery_url``, that is not ``settings.broker_url``; None when they
    agree or nothing names one. Writers wake the relay on OUTBOX_CELERY_BROKER_URL's broker, and
    the relay's transport is chosen from it (docs/relay.md, "Running worker and beat")."""
    if not celery_url or celery_url == settings.broker_url:
        return None
    ours = "" if settings.celery_broker_url else " (unset: the default)"
    return redact(f"outbox: {source} names Celery's broker {celery_url}, not OUTBOX_CELERY_BROKER_URL's "
                  f"{settings.broker_url}{ours}: every worker, beat and writer of an outbox must use one broker; "
                  f"set OUTBOX_CELERY_BROKER_URL to the one you mean, and remove {source} or give it the same URL")


def celery_broker_named_conflict(settings: Settings, environ: Mapping[str, str], *, app_url: str | None = None,
                                 module_url: Any = None) -> str | None:
    """The line that stops a Celery worker or beat, and fails ``outbox check``: one rule for
    both (``outbox.celery.application.broker_conflict``, ``commands.doctor.run_checks``; the
    check once compared CELERY_BROKER_URL only, found in review). Celery's broker is
    CELERY_BROKER_URL, which ``celery -b`` sets and Celery reads first; else a ``broker_url``
    set on the app (``app_url``: the worker's ``app.conf``) or in its config module
    (``module_url``; default: the module ``environ``'s CELERY_CONFIG_MODULE names)."""
    if environ.get("CELERY_BROKER_URL"):
        return celery_broker_conflict(settings, environ["CELERY_BROKER_URL"], "CELERY_BROKER_URL (or celery -b)")
    named = app_url
    if not named or named == settings.broker_url:  # the relay's own, once its defaults are in
        named = module_url if module_url is not None else module_setting(environ, "broker_url")
    return celery_broker_conflict(settings, named, "broker_url in Celery's configuration")


SETTING_NAMES = Settings.names()


# -- the relay's tuning options (OUTBOX_RELAY_*: docs/relay.md, "`OUTBOX_RELAY_*` options") ---

@dataclass(frozen=True)
class RelayOptions(Options):
    """Tuning of the relay beyond the contract's OUTBOX_* settings: ``OUTBOX_RELAY_<FIELD>``."""

    PREFIX: ClassVar[str] = "OUTBOX_RELAY_"

    #: Short chains are packed into one publish task until it holds this many rows
    #: (a chain is never split across tasks). 1 gives one task per chain. The default
    #: makes a full default claim one task: fuller waves of confirms and fewer Celery
    #: messages per event (docs/benchmarks.md measures 25 against 100).
    task_rows: int = option(100, "int", above=0)
    #: A claim that did not come back full and holds at most this many rows is published
    #: by the claim task itself instead of going through Celery's broker as a publish
    #: task: live traffic saves a whole Celery hop. 0 turns it off.
    inline_rows: int = option(25, "int", minimum=0)
    #: Claims hold back while this many publish tasks wait in Celery's broker queue.
    #: Rows in flight are then bounded by about (max_queued_tasks + worker processes)
    #: x rows per task (at most OUTBOX_BATCH_SIZE).
    max_queued_tasks: int = option(16, "int", above=0)
    #: A drain slice claims its next batch on a helper thread (its own database connection)
    #: while it publishes the current one, behind it, instead of after it (docs/internals.md,
    #: "Drain slices"). auto (the default): after a claim of one chain only (a hot aggregate,
    #: which no other process can help drain); on: after every full claim; off: claim,
    #: publish, settle, then claim again, one after the other.
    claim_ahead: str = option("auto", "str", check=validate_claim_ahead)
    #: A claim reads this many times OUTBOX_BATCH_SIZE eligible rows (its window) and takes
    #: OUTBOX_BATCH_SIZE of them, whole chains, oldest first: over fewer aggregates than the
    #: window, each claim takes this many rows of each of its aggregates and leaves the
    #: rest to others. One confirm round trip per row of a chain: set it to the number of
    #: claims that run at once (docs/internals.md, "Claim windows"). Default: the engines'.
    claim_window: int = option(2, "int", above=0, maximum=16)
    #: The relay's own writes (leases, done marks, failures) commit without waiting for the
    #: disk where the engine allows it for one session (PostgreSQL: ``synchronous_commit``
    #: off). A database crash then loses at most the last fraction of a second of them,
    #: and those rows are delivered again; order holds (docs/relay.md, "Commits that do not
    #: wait for the disk"). false: every relay commit waits for the disk.
    async_commit: bool = option(True, "bool")
    #: Bytes (payload + ~256 per row) one claimed batch may send on as publish tasks;
    #: the rest of the batch is released at once. The first row always goes.
    max_batch_bytes: int = option(8 * 1024 * 1024, "int", above=0)
    #: Retry back-off after a retriable failure: base * 2^(attempt-1), capped, with jitter.
    backoff_base_s: float = option(1.0, "float", above=0, maximum=MAX_OPTION_S)
    backoff_max_s: float = option(300.0, "float", above=0, maximum=MAX_OPTION_S)
    #: How long claims pause after the broker pushed back or was unreachable.
    breaker_s: float = option(5.0, "float", above=0, maximum=MAX_OPTION_S)
    #: How long claims stop after a fatal (configuration) error.
    fatal_pause_s: float = option(300.0, "float", above=0, maximum=MAX_OPTION_S)
    #: How long one routing key pauses after a queue bound for it refused a message
    #: (``basic.nack``: full with ``reject-publish``, or unavailable); other routes flow on.
    #: Doubles each time the route is refused again right after its pause, up to
    #: ``route_pause_max_s``.
    route_pause_s: float = option(1.0, "float", above=0, maximum=MAX_OPTION_S)
    route_pause_max_s: float = option(30.0, "float", above=0, maximum=MAX_OPTION_S)
    #: A requested claim (drain mode, wake-up) that never ran stops blocking new
    #: requests after this long. Beat's ticks go on regardless.
    claim_request_ttl_s: float = option(2.0, "float", above=0, maximum=MAX_OPTION_S)
    #: How often beat runs the purge of old done rows. At least a second: below that beat
    #: floods the purge queue (0.000001 passed "above 0": 11,105 purge tasks in 6 s, found in
    #: review); docs/relay.md, "`OUTBOX_RELAY_*` options", says why not more.
    purge_interval_s: float = option(3600.0, "float", minimum=1.0, maximum=30 * 86_400.0)
    #: A publish task starts no chain once this fraction of the lease has passed since
    #: the claim: the rows are left to lease recovery rather than risk a second live copy.
    lease_safety: float = option(0.8, "float", above=0, maximum=1)
    #: The publisher refuses (as POISON: dead at once, no broker round trip) a message
    #: body larger than this. The default is ``publisher.DEFAULT_MAX_MESSAGE_BYTES``
    #: (16 MiB, RabbitMQ 4's own limit); set it to your broker's ``max_message_size``.
    max_message_bytes: int = option(16 * 1024 * 1024, "int", above=0)
    #: Every this many seconds a worker logs one INFO line: alive, the backlog per status
    #: and the age of the oldest undelivered row (``outbox.worker_logging``).
    heartbeat_s: float = option(300.0, "float", above=0, maximum=MAX_OPTION_S)
    #: A relay worker process whose liveness record has not been refreshed for this long is
    #: taken for lost: the leases of the rows it holds end at once (docs/internals.md, "Lost
    #: workers"). Each process refreshes its record every third of it.
    holder_timeout_s: float = option(3.0, "float", above=0, maximum=MAX_OPTION_S)
    #: Chains of events whose topic matches one of these ``fnmatch`` patterns (or whose
    #: aggregate type is one of ``pipelined_aggregate_types``) are pipelined: sent without
    #: waiting for each confirm, with a weaker ordering guarantee (docs/relay.md,
    #: "Pipelined chains"). Empty (the default): every chain is strict.
    pipelined_topics: tuple[str, ...] = option((), "names")
    pipelined_aggregate_types: tuple[str, ...] = option((), "names")

    def pipelined(self, topic: str, aggregate_type: str) -> bool:
        """Whether an event opted in to pipelining (docs/relay.md, "Pipelined chains")."""
        return aggregate_type in self.pipelined_aggregate_types or any(
            fnmatch.fnmatchcase(topic, pattern) for pattern in self.pipelined_topics)

    @property
    def pipelines(self) -> bool:
        """Whether any event can opt in: without it the relay never asks."""
        return bool(self.pipelined_topics or self.pipelined_aggregate_types)


@dataclass(frozen=True)
class MetricsOptions(Options):
    """The relay's Prometheus metrics (``outbox.relay.metrics``; docs/waking-and-metrics.md)."""

    PREFIX: ClassVar[str] = "OUTBOX_RELAY_METRICS_"

    #: Serve ``/metrics`` on this port; None (unset, empty or 0): metrics are off.
    port: int | None = option(None, "port")
    #: The address the endpoint binds.
    addr: str = option("0.0.0.0", "str")
    #: Each worker reads the gauges (one query, in its own thread) every this many seconds.
    #: 0.1 s to a day: below, a busy loop; far above, the refresher's wait overflowed and its
    #: thread died (threading.TIMEOUT_MAX).
    refresh_s: float = option(5.0, "float", minimum=0.1, maximum=MAX_OPTION_S)


@dataclass(frozen=True)
class WakeOptions(Options):
    """Waking the relay: post-commit wake-ups (``outbox.wake``) and PostgreSQL LISTEN/NOTIFY
    (``outbox.relay.listen``; docs/waking-and-metrics.md)."""

    PREFIX: ClassVar[str] = "OUTBOX_RELAY_"

    #: OUTBOX_RELAY_WAKE: post-commit wake-ups in this process.
    wake: bool = option(True, "bool")
    #: OUTBOX_RELAY_LISTEN: on PostgreSQL, ``enqueue`` notifies and workers LISTEN.
    listen: bool = option(False, "bool")
    #: OUTBOX_RELAY_LISTEN_CHANNEL: the NOTIFY channel; None derives it from the table.
    listen_channel: str | None = option(None, "str", check=validate_identifier)
    #: OUTBOX_RELAY_IN_PROCESS_CLAIM: a worker's main process claims itself when a wake-up
    #: (Redis pub/sub) or a notification (LISTEN) reaches it; off, they become claim messages.
    in_process_claim: bool = option(True, "bool")


@dataclass(frozen=True)
class DramatiqSettings(Options):
    """The Dramatiq front-end's settings (docs/dramatiq.md)."""

    PREFIX: ClassVar[str] = "OUTBOX_DRAMATIQ_"

    #: ``redis://...`` (Dramatiq's RedisBroker) or ``amqp://...`` (its RabbitmqBroker); set,
    #: it makes Dramatiq the configured runner.
    broker_url: str | None = option(None, "str", check=_dramatiq_url)
    #: The Redis key namespace of Dramatiq's queues.
    namespace: str = option("dramatiq", "str", check=validate_dramatiq_namespace)

    @property
    def url(self) -> str:
        """``broker_url``, known to be set: ``dramatiq_settings()`` returns these settings only then."""
        assert self.broker_url is not None
        return self.broker_url


@dataclass(frozen=True)
class TransportOptions(Options):
    """The database broker's options for the relay's own Celery app (docs/transport.md):
    each goes to kombu's ``broker_transport_options`` as its ``key``; None: kombu's default."""

    PREFIX: ClassVar[str] = "OUTBOX_TRANSPORT_"

    visibility_timeout_s: float | None = option(None, "float", minimum=1.0, maximum=30 * 86_400.0,
                                                key="visibility_timeout")
    polling_interval_s: float | None = option(None, "float", minimum=0.01, maximum=60.0, key="polling_interval")
    receive_batch: int | None = option(None, "int", minimum=1, maximum=1000, key="receive_batch")
    queue_table: str | None = option(None, "str", key="queue_table", check=validate_queue_table)

    def kombu(self) -> dict[str, Any]:
        """The options that are set, by their kombu names."""
        return {how.key: getattr(self, f.name) for f, how in self.declared().values()
                if how.key is not None and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class PipelineOptions(Options):
    """The Spark jobs' session (``outbox.pipeline.session``; docs/pipeline.md)."""

    PREFIX: ClassVar[str] = "OUTBOX_SPARK_"

    #: The master when no session is active and ``--master`` is not given (default local[*]).
    master: str | None = option(None, "str", check=validate_spark_master)
    shuffle_partitions: int = option(8, "int", above=0, maximum=100_000)
    log_level: str = option("ERROR", "str", check=validate_spark_log_level)
    #: Spark's web UI.
    ui: bool = option(False, "bool")
    #: A step name (``archive.STEPS``): the process SIGKILLs itself there. How the tests
    #: prove a crash anywhere loses and duplicates nothing.
    crash_at: str | None = option(None, "str", name="OUTBOX_PIPELINE_CRASH_AT")


@dataclass(frozen=True)
class KafkaOptions(Options):
    """The Kafka destination (``outbox.publisher.kafka``; docs/destinations.md): a field with a
    ``key`` is that librdkafka property. SASL credentials come from OUTBOX_PUBLISH_URL's user
    and password (masked like every URL)."""

    PREFIX: ClassVar[str] = "OUTBOX_KAFKA_"

    #: The Kafka topic of an event: a template over {topic} and {aggregate_type}.
    topic_template: str = option("{topic}", "str", check=validate_kafka_topic_template)
    #: Off: an event whose Kafka topic does not exist is FATAL; on: the broker's auto-creation makes it.
    auto_create_topics: bool = option(False, "bool")
    #: Unset: ``sasl_ssl`` with the URL's credentials, else ``ssl`` when any OUTBOX_KAFKA_SSL_* is
    #: set, else ``plaintext``; ``plaintext`` or ``ssl`` with credentials is refused (``security``).
    security_protocol: str | None = option(None, "str", check=validate_kafka_security_protocol)
    sasl_mechanism: str | None = option(None, "str", check=validate_kafka_sasl_mechanism, key="sasl.mechanism")
    ssl_ca_location: str | None = option(None, "str", key="ssl.ca.location")
    ssl_certificate_location: str | None = option(None, "str", key="ssl.certificate.location")
    ssl_key_location: str | None = option(None, "str", key="ssl.key.location")
    #: The passphrase of the client key (masked in every output).
    ssl_key_password: str | None = option(None, "str", key="ssl.key.password", secret=True)
    #: Larger messages are POISON (the client refuses them; match the topic's max.message.bytes).
    message_max_bytes: int = option(1_000_000, "int", minimum=1000, maximum=1_000_000_000, key="message.max.bytes")
    #: How long a message may wait for its delivery report before it counts as not delivered.
    delivery_timeout_s: float = option(15.0, "float", minimum=0.1, maximum=3600.0)

    def __post_init__(self) -> None:
        # TLS settings with a protocol that sends in clear were a plaintext connection (found in review).
        tls = next((name for name, (f, _) in self.declared().items()
                    if f.name.startswith("ssl_") and getattr(self, f.name) is not None), None)
        if tls and self.security_protocol in ("plaintext", "sasl_plaintext"):
            raise ConfigError(f"OUTBOX_KAFKA_SECURITY_PROTOCOL={self.security_protocol!r} sends in clear, but {tls} "
                              "is set: use ssl (sasl_ssl with credentials), or unset it")

    def security(self, credentials: bool) -> str:
        """librdkafka's ``security.protocol`` (docs/destinations.md, "Settings"): the setting,
        else TLS when any OUTBOX_KAFKA_SSL_* is set and SASL with the URL's ``credentials``
        (``sasl_ssl``: never in clear unless asked). A setting that sends no credentials
        (``plaintext``, ``ssl``) with credentials in the URL is a ConfigError: it is never
        replaced by another protocol (docs/destinations.md, "Settings")."""
        if credentials and self.security_protocol in ("plaintext", "ssl"):
            raise ConfigError(
                f"OUTBOX_KAFKA_SECURITY_PROTOCOL={self.security_protocol} sends no user and password (librdkafka's "
                "security.protocol: only sasl_ssl and sasl_plaintext do), but OUTBOX_PUBLISH_URL has them: set "
                f"sasl_ssl to send them over TLS, or take them out of the URL for {self.security_protocol} alone")
        if self.security_protocol is not None:
            return self.security_protocol
        if credentials:
            return "sasl_ssl"
        tls = any(getattr(self, f.name) is not None for f, _ in self.declared().values() if f.name.startswith("ssl_"))
        return "ssl" if tls else "plaintext"

    def librdkafka(self) -> dict[str, Any]:
        """The fields that are librdkafka properties and are set, by their property names."""
        return {how.key: getattr(self, f.name) for f, how in self.declared().values()
                if how.key is not None and getattr(self, f.name) is not None}


#: Every option family, each read by its accessor below.
FAMILIES: tuple[type[Options], ...] = (Settings, RelayOptions, MetricsOptions, WakeOptions, DramatiqSettings,
                                       TransportOptions, PipelineOptions, KafkaOptions)


# -- the one order, read once per process ------------------------------------------------------

#: Every OUTBOX_* name the package reads beyond the contract's settings.
OTHER_NAMES = tuple(name for family in FAMILIES if family is not Settings for name in family.names())


def known_names() -> tuple[str, ...]:
    """Every OUTBOX_* name the package reads: the declarations' names."""
    return (*SETTING_NAMES, *OTHER_NAMES)


#: Names that are not the package's settings: the test suite's and the benchmarks' own.
EXEMPT_NAMES = ("OUTBOX_REQUIRE_SERVICES",)
EXEMPT_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_BENCH_", "OUTBOX_CHAOS_")


def refuse_unknown(overrides: Mapping[str, Any]) -> None:
    """An OUTBOX_* Celery config key nothing reads is a ``ConfigError``: a typo would otherwise
    silently leave the setting at its value from the environment or its default."""
    known = known_names()
    unknown = [k for k in overrides if k.startswith("OUTBOX_") and k not in known]
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]} (known: {', '.join(SETTING_NAMES)})")


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


_warned: set[str] = set()


def warn_unknown_environment(environ: Mapping[str, str] | None = None, what: str = "environment variable") -> list[str]:
    """Log one warning line per unknown OUTBOX_* variable (or ``what``: a Django setting),
    once per process; returns the names warned about this time."""
    warned = []
    for name, close in unknown_environment(os.environ if environ is None else environ):
        if name in _warned:
            continue
        _warned.add(name)
        warned.append(name)
        hint = f"did you mean {close}?" if close else "no setting has a similar name"
        log.warning("outbox: unknown %s %s is ignored (%s)", what, name, hint)
    return warned


def warn_unknown_django_settings() -> list[str]:
    """``warn_unknown_environment`` for Django's settings: a misspelt OUTBOX_* name in settings.py
    was ignored unsaid, where the environment's is warned about and a Celery config key refused."""
    return warn_unknown_environment(dict.fromkeys(django_outbox_names(), ""), what="Django setting")


def current_sources() -> Sources:
    """This process's sources in the one order: Celery config keys, environment, Django
    settings. Built once (``reset_settings`` forgets it); unknown Celery config keys are
    refused and unknown environment variables warned about then."""
    def build() -> Sources:
        overrides = conf_keys()
        refuse_unknown(overrides)
        warn_unknown_environment()
        django = django_settings(known_names())
        warn_unknown_django_settings()
        return Sources(overrides, os.environ, django)
    return cached("sources", build)


def current(family: type[Options]) -> Any:
    """``family`` read from this process's sources, once (``reset_settings`` forgets it)."""
    return cached(family, lambda: family.from_sources(current_sources()))


def get_settings() -> Settings:
    """The process-wide settings."""
    return current(Settings)


#: The same settings: the relay reads them under this name.
relay_settings = get_settings


def relay_options() -> RelayOptions:
    return current(RelayOptions)


def wake_options() -> WakeOptions:
    return current(WakeOptions)


def kafka_options() -> KafkaOptions:
    return current(KafkaOptions)


def pipeline_options() -> PipelineOptions:
    return current(PipelineOptions)


def metrics_options() -> MetricsOptions:
    """Read on each call from the process's sources (``outbox.relay.metrics`` decides once
    per process, and again after its ``reset``)."""
    return MetricsOptions.from_sources(current_sources())


def relay_families(settings: Settings) -> tuple[type[Options], ...]:
    """The option families a relay process reads beyond ``Settings``: what its start-up
    (``startup_options``) and ``outbox check`` validate, so that a bad value stops it there
    instead of failing every task (README, "Configuration"). The OUTBOX_RELAY_* wake-up
    options always (``enqueue`` and the LISTEN thread read them); the OUTBOX_TRANSPORT_*
    options only when Celery's broker is the database, the OUTBOX_KAFKA_* options only when
    the destination is Kafka."""
    transport = (TransportOptions,) if settings.broker_url.startswith(DATABASE_BROKER_SCHEME) else ()
    kafka = (KafkaOptions,) if settings.publish_url.startswith("kafka://") else ()
    return (RelayOptions, MetricsOptions, WakeOptions, *transport, *kafka)


#: A retention shorter than this many days is said at start-up (``warn_short_retention``).
SHORT_RETENTION_DAYS = 1.0
_warned_retention: list[float] = []


def warn_short_retention(settings: Settings) -> None:
    """Once per process: a retention under a day shortens enqueue's ``message_id``
    de-duplication to it (README, "Write side": why a day)."""
    days = settings.retention_days
    if days >= SHORT_RETENTION_DAYS or days in _warned_retention:
        return
    _warned_retention.append(days)
    log.warning("outbox: OUTBOX_RETENTION_DAYS=%g keeps done rows less than a day: enqueue's message_id "
                "de-duplication covers only rows still in the table, so an event enqueued again with the same "
                "message_id after the purge deleted the first is stored and delivered again", days)


def warn_memory_destination(settings: Settings, logger: logging.Logger) -> None:
    """At a relay worker's start, through its ``logger``: it relays to ``memory://``
    (OUTBOX_PUBLISH_URL unset) on a server database, so every event is marked done and reaches
    no broker. The embedded default (SQLite), the demo's and the tests' in-process set-up, is
    left quiet."""
    if settings.publish_url.startswith("memory://") and not is_sqlite_url(settings.database_url):
        logger.warning("outbox: OUTBOX_PUBLISH_URL is memory:// (in-process, the default when unset) on a server "
                       "database: every event this worker publishes is marked done and reaches no broker; set "
                       "OUTBOX_PUBLISH_URL to the destination (amqp://, redis:// or kafka://)")


def startup_options() -> tuple[Settings, RelayOptions]:
    """The settings and relay options of a relay process (worker, beat, the Dramatiq front-end
    and its scheduler), with every family it reads validated now (``relay_families``):
    ``ConfigError`` names the first bad setting."""
    settings = get_settings()
    warn_short_retention(settings)
    for family in relay_families(settings):
        current(family)
    if settings.publish_url.startswith("kafka://"):  # the protocol against the URL's credentials
        current(KafkaOptions).security(credentials=bool(split_kafka_url(settings.publish_url)[0]))
    return settings, relay_options()


def split_kafka_url(url: str) -> tuple[str, str]:
    """A ``kafka://[user:password@]host:port,...`` URL's SASL user and password (``""`` when it
    has none) and what follows them."""
    userinfo, _, rest = url.split("://", 1)[1].rpartition("@")
    return userinfo, rest


def reset_settings() -> None:
    """Forget everything read (tests, and processes that change their environment)."""
    reset()


def load_settings(overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """``Settings`` from explicit sources in the one order (``overrides``, else the Celery
    config keys: this process's, or those of the module ``environ`` names; ``environ`` or the
    process environment; Django settings), not cached; ``ConfigError`` names the first bad
    setting. Reading the process environment also warns about OUTBOX_* names nothing reads."""
    if overrides is None:
        overrides = conf_keys() if environ is None else module_keys(environ)
    if environ is None:
        environ = os.environ
        warn_unknown_environment(environ)
    refuse_unknown(overrides)
    django = django_settings(known_names())
    if environ is os.environ:
        warn_unknown_django_settings()
    return Settings.from_sources(overrides, environ, django)


def sources_of(environ: Mapping[str, str]) -> Sources:
    """The sources ``load_settings(environ=...)`` reads, for any option family: the Celery
    config keys of the module ``environ`` names, ``environ``, then Django settings (so ``outbox
    check`` reads every family as a relay process would)."""
    overrides = module_keys(environ)
    refuse_unknown(overrides)
    return Sources(overrides, environ, django_settings(known_names()))


def dramatiq_settings(environ: Mapping[str, str] | None = None, *, required: bool = False) -> DramatiqSettings | None:
    """The Dramatiq settings, from ``environ`` and Django settings, else from the process's
    sources; read on each call. None when OUTBOX_DRAMATIQ_BROKER_URL is unset (Celery is then
    the runner), or a ``ConfigError`` when ``required``."""
    sources = current_sources() if environ is None else sources_of(environ)
    found = DramatiqSettings.from_sources(sources)
    if found.broker_url is None:
        if required:
            raise ConfigError("OUTBOX_DRAMATIQ_BROKER_URL is not set: the Dramatiq front-end needs Dramatiq's "
                              "broker (redis://host:6379/0 or amqp://user:pass@host:5672/)")
        return None
    return found


__all__ = ["CLOCK_SKEW_MARGIN_S", "message_ttl_s", "Settings", "celery_broker_conflict", "celery_broker_named_conflict", "KafkaOptions", "kafka_options", "split_kafka_url", "validate_publish_url", "RelayOptions", "MetricsOptions", "WakeOptions", "DramatiqSettings", "TransportOptions",
           "PipelineOptions", "FAMILIES", "SETTING_NAMES", "OTHER_NAMES", "MAX_OPTION_S", "MAX_CLAIM_TIMEOUT_MS",
           "load_settings", "get_settings", "relay_settings", "relay_options", "wake_options", "metrics_options",
           "pipeline_options", "dramatiq_settings", "warn_memory_destination", "sources_of", "relay_families", "startup_options", "current_sources", "current", "reset_settings", "use_conf",
           "conf_keys", "known_names", "unknown_environment", "warn_unknown_environment", "warn_unknown_django_settings", "refuse_unknown",
           "SESSION_BOUNDS", "session_bounds", "without_session_bounds", "validate_identifier",
           "validate_database_url", "validate_kombu_url", "validate_namespace", "validate_dramatiq_broker_url",
           "validate_dramatiq_namespace", "django_database_url", "DATABASE_BROKER_SCHEME", "DATABASE_SCHEMES"]
