"""``outbox check``: is this deployment able to relay? One readable report.

Each check says ``ok``, ``warn`` (works, but probably not what you meant) or ``FAIL``
(events will not arrive), with the fix in the same line. The checks, in order, each
skipped when an earlier one it depends on failed:

1. configuration: every OUTBOX_* setting parses and validates, with every option family a relay
   process validates at its start-up (``relay_families``: relay tuning, metrics, wake-ups,
   the database broker, Kafka); an OUTBOX_* variable nothing reads is a warning; metrics asked
   for (OUTBOX_RELAY_METRICS_PORT) and prometheus_client missing, a warning;
2. database: a connection opens (a missing driver names the extra to install);
3. table: exists with every column of the contract (on MySQL/MariaDB the columns the relay
   compares in a binary collation); indexes: the ones ``outbox migrate``
   creates are all there, each defined as it defines them (keys in order, uniqueness, partial
   predicate, included columns), not only named so; holders: the worker processes' liveness table is there (a
   warning when not: lost workers are then noticed only when their lease expires);
4. the task runner's broker, the one the runner configured will really use: Dramatiq's
   (``OUTBOX_DRAMATIQ_BROKER_URL``) when it is set, else Celery's, including the database
   as Celery's broker (``outboxdb``: its scheme registered first, then a connection to its
   database and its queue tables); reachable (``memory://`` is in-process only: a warning;
   Celery's Redis with its workers' TLS options, a certificate not verified: a warning);
5. destination broker: reachable (a TLS certificate or host name not checked: a warning,
   ``tls_unchecked``; Dramatiq's broker too), and the exchange exists; on Kafka, the cluster answers and the
   topics the relay needs exist or may be created, and a probe message if asked (``--probe``);
6. a queue bound to the exchange: on Redis the bindings are readable (kombu keeps them in
   a set per exchange); AMQP 0-9-1 cannot list bindings without the management plugin, so
   there the report says what to check by hand. An exchange that does not exist has no
   bindings, which is a failure: the first events would be unroutable and go dead.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.checks import is_sqlite_url
from ..core.config import (
    ConfigError,
    KafkaOptions,
    MetricsOptions,
    RelayOptions,
    Settings,
    celery_broker_named_conflict,
    dramatiq_settings,
    load_settings,
    relay_families,
    sources_of,
    unknown_environment,
)
from ..core.errors import install_hint, transport_hint
from ..core.names import is_redis_url
from ..core.redact import redact
from ..core.tls import AMQP_PLAIN_SCHEMES, AMQP_TLS_SCHEMES, kombu_connection
from ..storage.engines.describe import (
    describe_database,
    expected_index_names,
    index_problems,
    missing_driver_hint,
)
from ..storage.store import OutboxStore

#: The columns of the contract (docs: "The table"), all read by a probe query.
CONTRACT_COLUMNS = ("id", "message_id", "topic", "aggregate_type", "aggregate_id", "partition_key", "payload",
                    "headers", "trace_id", "status", "attempts", "claimed_at", "next_retry_at", "created_at",
                    "processed_at", "last_error", "lease_token")

#: Seconds to wait for a broker before calling it unreachable.
CONNECT_TIMEOUT_S = 5.0

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Result:
    name: str
    state: str
    detail: str

    @classmethod
    def unless_unchecked(cls, name: str, detail: str, unchecked: str | None) -> Result:
        """OK with ``detail``, or WARN with what the connection's TLS leaves ``unchecked`` added."""
        return cls(name, WARN, f"{detail}, {unchecked}") if unchecked else cls(name, OK, detail)

    def line(self) -> str:
        """The report's line, passwords masked: a driver's error may quote one (libpq's
        ``invalid percent-encoded token: "..."``), as every line the CLI prints."""
        return redact(f"[{self.state:<4}] {self.name}: {self.detail}")


def _error(exc: BaseException) -> str:
    return missing_driver_hint(exc) or f"{type(exc).__name__}: {' '.join(str(exc).split()) or '(no message)'}"


def _broker(url: str, setting: str | None = None) -> Any:
    """kombu's connection to ``url``; a ConfigError naming the extra when its transport's
    library is missing. ``setting``: the URL is the relay's own (not Celery's), so an AMQP
    URL's TLS parameters are read as the relay reads them (``core.tls``)."""
    options: dict[str, Any] = {"max_retries": 1}
    if url.split("://", 1)[0] in ("redis", "rediss"):
        # redis-py waits for an answer without a bound unless told: a server that accepts and
        # never answers held the check for good (connect_timeout bounds the TCP connect only).
        options["socket_timeout"] = CONNECT_TIMEOUT_S
    try:
        if setting is None:
            from kombu import Connection

            return Connection(url, connect_timeout=CONNECT_TIMEOUT_S, transport_options=options)
        return kombu_connection(url, setting, connect_timeout=CONNECT_TIMEOUT_S, transport_options=options)
    except Exception as exc:
        hint = transport_hint(url)
        if hint is None and not isinstance(exc, ImportError):
            raise
        raise ConfigError(hint or _error(exc)) from exc


def check_database(settings: Settings, holder_timeout_s: float | None = None) -> list[Result]:
    """The database, the table, its indexes, the holders (``holder_timeout_s``: the relay's
    OUTBOX_RELAY_HOLDER_TIMEOUT_S, its default when None) and, on PostgreSQL, vacuum."""
    results: list[Result] = []
    store = OutboxStore.from_settings(settings)
    where = describe_database(settings.database_url)
    try:
        store.connection()
    except Exception as exc:
        return [Result("database", FAIL, f"cannot connect to {where}: {_error(exc)}")]
    results.append(Result.unless_unchecked("database", f"connected to {where}", _database_tls_unchecked(store)))
    try:
        unreadable = store.unreadable()
        if unreadable is not None:  # it said "table missing" over SQL Server's disabled clustered index
            results.append(Result("table", FAIL, unreadable))
            return results
        try:
            with store.transaction() as cursor:
                store.engine.execute(cursor, f"SELECT {', '.join(CONTRACT_COLUMNS)} FROM {store.engine.table} "
                                     "WHERE 1 = 0")
        except Exception as exc:
            missing = _missing_columns(store)
            what = (f"columns missing: {', '.join(missing)}" if missing and len(missing) < len(CONTRACT_COLUMNS)
                    else "table missing")
            results.append(Result("table", FAIL, f"{store.engine.table}: {what}: run `outbox migrate` "
                                  f"({_error(exc)})"))
            return results
        with store.transaction() as cursor:
            wrong = store.engine.column_problem(cursor)
            problems = index_problems(store.engine, cursor)
        results.append(Result("table", FAIL, f"{store.engine.table}: {wrong}") if wrong else
                       Result("table", OK, f"{store.engine.table} has every column of the contract"))
        if problems:
            # Compared by definition, not by name (docs/operations.md, "Is it set up right? `outbox check`").
            results.append(Result("indexes", FAIL, f"{'; '.join(problems)}: run `outbox migrate`, which builds "
                                  "them again as it defines them"))
        else:
            results.append(Result("indexes", OK, ", ".join(sorted(expected_index_names(store.engine)))))
        results.append(_check_holders(store, RelayOptions().holder_timeout_s if holder_timeout_s is None
                                      else holder_timeout_s))
        if store.engine.UPKEEP is not None:
            results.append(_check_upkeep(store, store.engine.UPKEEP))
        return results
    finally:
        store.close()


def _database_tls_unchecked(store: OutboxStore) -> str | None:
    """What the TLS of the store's session leaves unchecked, read from the session itself: on
    PostgreSQL libpq's sslmode and sslrootcert as the URL, PG* variables and defaults set them
    (``postgres_tls_unchecked``), on MySQL/MariaDB the TLS socket's context
    (``mysql_tls_unchecked``). None on other engines, and without TLS."""
    connection = store.connection()
    pgconn = getattr(connection, "pgconn", None)
    if store.engine.name == "postgresql" and pgconn is not None:
        given = {o.keyword.decode(): o.val.decode() if o.val else None for o in pgconn.info}
        return postgres_tls_unchecked(bool(pgconn.ssl_in_use), given.get("sslmode") or "prefer",
                                      given.get("sslrootcert"), (pgconn.host or b"").decode())
    sock = getattr(connection, "_sock", None)  # PyMySQL's
    if store.engine.name == "mysql" and isinstance(sock, ssl.SSLSocket):
        return mysql_tls_unchecked(sock.context, getattr(connection, "host", None))
    return None


def _loopback(host: str | None) -> bool:
    """``host`` is this machine's loopback: no path for anyone to answer on, nothing for a
    certificate check to add (docs/relay.md, "TLS to the database")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def mysql_tls_unchecked(context: ssl.SSLContext, host: str | None = None) -> str | None:
    """What a MySQL/MariaDB session's TLS ``context`` leaves unchecked, with the fix; None on
    a loopback ``host`` (docs/relay.md, "TLS to the database")."""
    if _loopback(host):
        return None
    fix = "give ssl_mode=VERIFY_IDENTITY and ssl_ca=<the CA> in OUTBOX_DATABASE_URL"
    if context.verify_mode == ssl.CERT_NONE:
        return f"its TLS certificate not verified (ssl_mode REQUIRED, or PREFERRED, PyMySQL's default): {fix}"
    if not context.check_hostname:
        return f"its TLS certificate's host name not checked (ssl_mode=VERIFY_CA): {fix}"
    return None


def postgres_tls_unchecked(ssl_in_use: bool, sslmode: str, rootcert: str | None,
                           host: str | None = None) -> str | None:
    """What a PostgreSQL session's TLS leaves unchecked, with the fix; None for no TLS (nothing
    to verify), ``verify-full``, or a loopback ``host``. libpq checks the certificate under ``verify-ca``, or
    ``require`` with a root certificate, and the host name only under ``verify-full``
    (docs/relay.md, "TLS to the database")."""
    if not ssl_in_use or sslmode == "verify-full" or _loopback(host):
        return None
    fix = "give sslmode=verify-full and sslrootcert=<the CA> in OUTBOX_DATABASE_URL"
    if sslmode == "verify-ca" or (sslmode == "require" and rootcert):
        return f"its TLS certificate's host name not checked (sslmode={sslmode}): {fix}"
    return f"its TLS certificate not verified (sslmode={sslmode}): {fix}"


def _check_holders(store: OutboxStore, timeout_s: float) -> Result:
    """The holders table (docs/internals.md, "Lost workers"): its absence slows recovery, no more.
    Its records: the worker processes that beat within ``timeout_s`` (the database's clock), and
    a warning for the silent ones, whose records stay until a running worker takes them over. The
    count of records alone said `3 relay worker processes recorded` with every worker dead (found
    in review)."""
    holders = store.engine.holders
    try:
        total, silent = store.holders(int(timeout_s * 1000))
    except Exception as exc:
        return Result("holders", WARN, f"{holders} is missing ({_error(exc)}): a lost worker's rows "
                      "wait for their lease (OUTBOX_CLAIM_TIMEOUT_MS) instead of seconds; run `outbox migrate`")
    beating = max(total - len(silent), 0)
    within = f"OUTBOX_RELAY_HOLDER_TIMEOUT_S={timeout_s:g} s"
    if not silent:
        if not total:
            return Result("holders", OK, f"{holders}: no relay worker process is running")
        return Result("holders", OK, f"{holders}: {total} relay worker processes beating (each within {within})")
    held = sum(rows for _, rows in silent)
    named = "; ".join(f"{h.holder.host} pid {h.holder.pid} silent {h.silent_s:.0f} s, {rows} row"
                      f"{'' if rows == 1 else 's'} leased" for h, rows in silent[:3])
    more = f"; and {len(silent) - 3} more" if len(silent) > 3 else ""
    then = (f"{beating} beating, which take them over within seconds" if beating else
            "no relay worker process is beating: nothing is relayed, and their rows wait, until a worker runs")
    return Result("holders", WARN, f"{holders}: {len(silent)} of {total} relay worker processes recorded silent "
                  f"for more than {within} (stopped or lost: {named}{more}; {held} rows in all); {then}")


def _check_upkeep(store: OutboxStore, name: str) -> Result:
    """The database's own housekeeping of the table (PostgreSQL's vacuum): left undone, it slows
    every claim as the months go by, and nothing else says so."""
    try:
        with store.transaction() as cursor:
            found, problems = store.engine.upkeep(cursor)
    except Exception as exc:
        return Result(name, WARN, f"could not be read: {_error(exc)}")
    return Result(name, WARN, "; ".join(problems)) if problems else Result(name, OK, found)


def _missing_columns(store: OutboxStore) -> list[str]:
    missing = []
    for column in CONTRACT_COLUMNS:
        try:
            with store.transaction() as cursor:
                store.engine.execute(cursor, f"SELECT {column} FROM {store.engine.table} WHERE 1 = 0")
        except Exception:
            missing.append(column)
    return missing


def check_celery_broker(settings: Settings, broker_url: str | None = None,
                        environ: Mapping[str, str] | None = None) -> Result:
    """``environ``: where its Celery config module is named (default: the relay's Celery app's
    configuration, else this process's config module, as the workers read it)."""
    url = broker_url or settings.broker_url
    if url.startswith("memory://"):
        detail = "memory:// (in-process: one `celery -A outbox worker` runs the schedule itself; no separate beat)"
        return Result("celery broker", OK if is_sqlite_url(settings.database_url) else WARN, detail)
    if url.startswith("outboxdb"):
        return _check_database_broker(settings, url)
    if is_redis_url(url):
        from ..relay.redis_clients import broker_use_ssl

        return _celery_redis_reachable(url, broker_use_ssl(environ))
    scheme = url.split("://", 1)[0].lower()
    if scheme in AMQP_TLS_SCHEMES + AMQP_PLAIN_SCHEMES:
        from ..celery.application import Connection
        from ..relay.redis_clients import broker_use_ssl

        # As the workers connect: broker_use_ssl (TLS on amqp:// too), each host named
        # (docs/relay.md, "TLS to Celery's RabbitMQ").
        use_ssl = broker_use_ssl(environ) or scheme in AMQP_TLS_SCHEMES
        conn = Connection(url, ssl=use_ssl, connect_timeout=CONNECT_TIMEOUT_S)
        result = _reachable("celery broker", url, "set OUTBOX_CELERY_BROKER_URL", conn)
        if result.state == OK and isinstance(use_ssl, dict) and use_ssl.get("cert_reqs") == ssl.CERT_NONE:
            return Result(result.name, WARN, f"{result.detail}, its TLS certificate not verified (cert_reqs=CERT_NONE "
                          "in broker_use_ssl): give ca_certs and cert_reqs=ssl.CERT_REQUIRED")
        return result
    return _reachable("celery broker", url, "set OUTBOX_CELERY_BROKER_URL")


def _celery_redis_reachable(url: str, use_ssl: Any) -> Result:
    """Celery's Redis broker, connected with the TLS options its workers use (the URL's, else
    ``broker_use_ssl``: ``relay.redis_clients``), by the client the relay's own Redis clients are;
    a certificate not verified is a warning (docs/relay.md, "Garbage in Celery's Redis broker", TLS)."""
    from ..relay.redis_clients import connect_redis, redis_connect_options, verifies

    name, fix = "celery broker", "set OUTBOX_CELERY_BROKER_URL"
    try:
        tls = redis_connect_options(url, use_ssl)[1]
        client = connect_redis(url, use_ssl, socket_timeout=CONNECT_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S)
    except ImportError as exc:
        return Result(name, FAIL, f"{redact(url)}: {transport_hint(url) or _error(exc)}")
    except ValueError as exc:  # ConfigError, or redis-py refusing the URL
        return Result(name, FAIL, f"{redact(url)}: {_error(exc)} ({fix})")
    try:
        client.ping()
    except Exception as exc:
        return Result(name, FAIL, f"{redact(url)} unreachable: {_error(exc)} ({fix})")
    finally:
        client.close()
    if tls and not verifies(tls):
        return Result(name, WARN, f"{redact(url)} reachable, its TLS certificate not verified (a bare rediss:// or "
                      "ssl_cert_reqs=none): give ssl_cert_reqs=required and ssl_ca_certs in the URL or broker_use_ssl")
    return Result(name, OK, f"{redact(url)} reachable")


def check_dramatiq_broker(url: str) -> Result:
    """Dramatiq's broker (its Redis or RabbitMQ broker): reachable as the workers reach it, with
    their library and TLS settings (``brokers.reach``: redis-py or pika, not kombu)."""
    from ..dramatiq.brokers import reach

    name, fix = "dramatiq broker", "set OUTBOX_DRAMATIQ_BROKER_URL"
    try:
        reach(url, CONNECT_TIMEOUT_S)
    except ConfigError as exc:
        return Result(name, FAIL, f"{redact(url)}: {exc}")
    except Exception as exc:
        return Result(name, FAIL, f"{redact(url)} unreachable: {_error(exc)} ({fix})")
    return Result.unless_unchecked(name, f"{redact(url)} reachable",
                                   tls_unchecked(url, "OUTBOX_DRAMATIQ_BROKER_URL", kombu=False))


def _reachable(name: str, url: str, fix: str, conn: Any = None) -> Result:
    try:
        conn = conn or _broker(url)
    except ConfigError as exc:
        return Result(name, FAIL, f"{redact(url)}: {exc}")
    try:
        conn.ensure_connection(max_retries=1, timeout=CONNECT_TIMEOUT_S)
        return Result(name, OK, f"{redact(url)} reachable")
    except Exception as exc:
        return Result(name, FAIL, f"{redact(url)} unreachable: {_error(exc)} ({fix})")
    finally:
        conn.release()


def _check_database_broker(settings: Settings, url: str) -> Result:
    """The database as Celery's broker: the database it names (``outboxdb://`` alone: the
    outbox's own) answers. Its queue tables need no check: every worker creates them."""
    from ..transport import register
    from ..transport.database import database_url_of

    register()
    name = "celery broker"
    rest = url.split("+", 1)[1] if url.startswith("outboxdb+") else ""
    try:
        database_url = database_url_of(rest) if rest else settings.database_url
    except Exception as exc:
        return Result(name, FAIL, f"{redact(url)}: {_error(exc)} (set OUTBOX_CELERY_BROKER_URL)")
    # A probe makes no SQLite file: `outbox migrate` makes it, with the broker's queue tables
    # (it made the outbox's own ./outbox.db, which the database check had just found missing).
    store = OutboxStore(database_url, table=settings.table, schema=settings.schema, existing=True)
    try:
        store.connection()
    except Exception as exc:
        return Result(name, FAIL, f"{redact(url)} unreachable: {_error(exc)} (set OUTBOX_CELERY_BROKER_URL)")
    finally:
        store.close()
    return Result(name, OK, f"{redact(url)}: the database as Celery's broker, "
                  f"{describe_database(database_url)} reachable (the first worker creates its queue tables)")


def check_destination(settings: Settings, kafka: Any = None, probe_topic: str | None = None) -> list[Result]:
    """The destination broker; on Kafka ``kafka`` holds the OUTBOX_KAFKA_* options."""
    url, exchange = settings.publish_url, settings.exchange
    if url.startswith("memory://"):
        return [Result("destination", WARN, "OUTBOX_PUBLISH_URL is memory://, which exists only inside the "
                       "worker process: events reach no consumer. Set it to your broker (amqp://..., redis://...)")]
    if url.startswith("kafka://"):
        return check_kafka(settings, kafka, probe_topic)
    try:
        conn = _broker(url, "OUTBOX_PUBLISH_URL")
    except ConfigError as exc:
        return [Result("destination", FAIL, f"{redact(url)}: {exc}")]
    try:
        try:
            conn.ensure_connection(max_retries=1, timeout=CONNECT_TIMEOUT_S)
        except Exception as exc:
            return [Result("destination", FAIL, f"{redact(url)} unreachable: {_error(exc)}")]
        results = [Result.unless_unchecked("destination", f"{redact(url)} reachable",
                                           tls_unchecked(url, "OUTBOX_PUBLISH_URL"))]
        results.append(_check_binding(conn, exchange))
        if settings.dead_letter_exchange and conn.transport.driver_type == "amqp":
            results.append(_check_dead_letter_exchange(conn, settings.dead_letter_exchange))
        return results
    finally:
        conn.release()


def tls_unchecked(url: str, setting: str, kombu: bool = True) -> str | None:
    """What an AMQP or Redis URL's TLS leaves unchecked, with the fix; None when it checks the
    certificate and its host name, or uses no TLS (docs/destinations.md, "TLS to RabbitMQ").
    A bare ``rediss://`` checks nothing through kombu, everything through redis-py (``kombu=False``:
    Dramatiq's broker)."""
    from ..core.tls import AMQP_PLAIN_SCHEMES, AMQP_TLS_SCHEMES, split_amqp_url
    from ..relay.redis_clients import redis_connect_options, verifies

    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss"):
        tls = redis_connect_options(url)[1]
        if tls and not verifies(tls) and (kombu or "ssl_" in url.partition("?")[2]):
            return ("its TLS certificate not verified (a bare rediss:// or ssl_cert_reqs=none): give "
                    "ssl_cert_reqs=required and ssl_ca_certs in the URL")
        return None
    amqp = split_amqp_url(url, setting)[1] if scheme in AMQP_TLS_SCHEMES + AMQP_PLAIN_SCHEMES else None
    if amqp is not None and not amqp.verify:
        return "its TLS certificate not verified (ssl_cert_reqs=none): not for production"
    if amqp is not None and not amqp.checks_hostname:
        return "its TLS certificate's host name not checked (ssl_check_hostname=false): not for production"
    return None


def check_kafka(settings: Settings, options: Any = None, probe_topic: str | None = None) -> list[Result]:
    """Kafka: the cluster answers; the topics the relay needs exist, or the brokers may create
    them; with ``probe_topic``, one probe message produced there as the relay would."""
    from ..core.config import KafkaOptions
    from ..publisher.kafka import (
        ClusterUnreachable,
        KafkaPublisher,
        cluster_status,
        probe_message,
        size_problem,
        topic_of,
        unreachable_brokers,
    )

    url = settings.publish_url
    options = options or KafkaOptions()
    try:
        brokers, topics = cluster_status(url, options, timeout=CONNECT_TIMEOUT_S)
    except ConfigError as exc:
        return [Result("destination", FAIL, str(exc))]
    except ClusterUnreachable as exc:
        return [Result("destination", FAIL, f"{redact(url)} unreachable: {exc}")]
    except Exception as exc:
        return [Result("destination", FAIL, f"{redact(url)} unreachable: {_error(exc)}")]
    # Every produce goes to the addresses the brokers advertise, not to the URL's.
    hidden = unreachable_brokers(brokers, min(3.0, CONNECT_TIMEOUT_S))
    results = [Result("destination", FAIL, f"{redact(url)} answers, but {len(hidden)} of the {len(brokers)} broker(s) it "
                      f"advertises cannot be reached from here: {'; '.join(hidden)}. The relay produces to these "
                      "addresses: fix the brokers' advertised.listeners, or this host's name resolution or network")
               if hidden else
               Result("destination", OK, f"{redact(url)} reachable: {len(brokers)} broker(s), {len(topics)} topic(s)")]
    name = "kafka topics"
    dead = settings.dead_letter_exchange
    if options.auto_create_topics:
        results.append(Result(name, WARN, "OUTBOX_KAFKA_AUTO_CREATE_TOPICS is on: a missing topic is left to the "
                              "brokers (auto.create.topics.enable), with their default partitions"))
    elif dead is not None and dead not in topics:
        results.append(Result(name, FAIL, f"the dead-letter topic {dead!r} (OUTBOX_DEAD_LETTER_EXCHANGE) does not "
                              "exist: create it"))
    else:
        results.append(Result(name, OK, f"each event goes to the Kafka topic {options.topic_template!r}, which must "
                              "exist: while one is missing, its events wait (that topic pauses, no attempt spent) and the others flow"
                              + (f"; dead-letter topic {dead!r} exists" if dead else "")))
    too_large = size_problem(settings, options)
    results.append(Result("kafka message size", WARN, too_large) if too_large else
                   Result("kafka message size", OK, f"payloads enqueue accepts (OUTBOX_MAX_PAYLOAD_BYTES="
                          f"{settings.max_payload_bytes}) fit Kafka's {options.message_max_bytes}-byte messages"))
    if probe_topic is not None:
        with KafkaPublisher(url, options=options) as publisher:
            result = publisher.publish_chain([probe_message(probe_topic)])
        topic = topic_of(options, probe_message(probe_topic))
        results.append(Result("kafka probe", OK, f"one probe message (header x-outbox-probe) delivered to {topic!r}")
                       if result.ok else
                       Result("kafka probe", FAIL, f"probe to {topic!r} not delivered: {result.failure.reason}"
                              if result.failure else f"probe to {topic!r} not delivered"))
    return results


def _check_binding(conn: Any, exchange: str) -> Result:
    name = "queue bound to the exchange"
    driver = conn.transport.driver_type
    if driver == "redis":
        # kombu's Redis transport keeps an exchange's bindings in one set (its client adds
        # any global_keyprefix itself); members are "routing_key SEP pattern SEP queue".
        channel = conn.default_channel
        queues = sorted(q.decode() if isinstance(q, bytes) else str(q)
                        for q in channel.client.smembers(channel.keyprefix_queue % exchange))
        if not queues:
            return Result(name, FAIL, f"no queue is bound to {exchange!r} on Redis: events would be "
                          "unroutable and go dead; start your consumer (it declares and binds its queue) first")
        bound = sorted({q.split(channel.sep)[-1] for q in queues})
        return Result(name, OK, f"{exchange!r} -> {', '.join(bound)}")
    if driver == "amqp":
        outcome, detail = _declare_as_the_relay(conn, exchange)
        if outcome == "missing":
            return Result(name, FAIL, f"exchange {exchange!r} does not exist, so no queue is bound to it: declare "
                          f"it (durable topic) and bind your consumers' queues before the first event ({detail})")
        if outcome == "refused":
            return Result(name, FAIL, f"exchange {exchange!r}: {detail}")
        return Result(name, WARN, f"exchange {exchange!r} exists (topic{detail}). AMQP cannot list its bindings: "
                      f"check `rabbitmqctl list_bindings source_name routing_key destination_name` or the "
                      f"management UI (Exchanges -> {exchange}); an event no queue is bound for is retried as "
                      "unroutable and goes dead after OUTBOX_MAX_ATTEMPTS")
    return Result(name, WARN, f"cannot check bindings on the {driver} transport")


def _check_dead_letter_exchange(conn: Any, exchange: str) -> Result:
    name = "dead-letter exchange"
    outcome, detail = _declare_as_the_relay(conn, exchange)
    if outcome == "missing":
        return Result(name, WARN, f"{exchange!r} (OUTBOX_DEAD_LETTER_EXCHANGE) does not exist: the relay declares "
                      "it when it connects, which needs configure permission on it; without that nothing is "
                      "published (FATAL). Declare it (durable topic) and bind a queue to it")
    if outcome == "refused":
        return Result(name, FAIL, f"{exchange!r} (OUTBOX_DEAD_LETTER_EXCHANGE): {detail}")
    return Result(name, OK, f"{exchange!r} exists (topic{detail})")


def _declare_as_the_relay(conn: Any, exchange: str) -> tuple[str, str]:
    """What the relay's declare of ``exchange`` meets (``KombuPublisher._declare``), without
    creating it: a passive declare, then, when it exists, the relay's own. ("missing", the
    error), ("refused", why: another type, ...), or ("ok", "" or a note: without configure
    permission the relay declares it passively, and gets by)."""
    from amqp.exceptions import AccessRefused
    from kombu import Exchange

    topic = Exchange(exchange, type="topic", durable=True)
    for passive in (True, False):
        channel = conn.channel()
        try:
            topic(channel).declare(passive=passive)
        except AccessRefused:
            return "ok", "; no configure permission on it, so the relay declares it passively: fine while it exists"
        except Exception as exc:
            if passive:
                return "missing", _error(exc)
            return "refused", f"the relay's declare is refused, so nothing is published (FATAL): {_error(exc)}"
        finally:
            with contextlib.suppress(Exception):  # best effort: the check's result is already decided
                channel.close()
    return "ok", ""


def run_checks(environ: dict[str, str] | None = None, *,
               settings_loader: Callable[[], Settings] | None = None, probe_topic: str | None = None) -> list[Result]:
    """Every check, in order; later checks are skipped when configuration fails.
    ``probe_topic``: on Kafka, also produce one probe message there."""
    given, environ = environ, dict(os.environ if environ is None else environ)
    # What every other command logs once at start-up, said here as report lines.
    unknown = [Result("unknown variable", WARN, f"{name} is ignored, nothing reads it ("
                      + (f"did you mean {close}?)" if close else "no setting has a similar name)"))
               for name, close in unknown_environment(environ)]
    try:
        settings = settings_loader() if settings_loader else load_settings(environ=environ)
        sources = sources_of(environ)  # Django settings too, as load_settings and a relay process read them
        read = {family: family.from_sources(sources) for family in relay_families(settings)}
        kafka = read.get(KafkaOptions)
        dramatiq = dramatiq_settings(environ)
    except ConfigError as exc:
        return [Result("configuration", FAIL, str(exc)), *unknown]
    if settings.broker_url.startswith("outboxdb"):
        from ..transport import register

        register()  # before the URL is shown: kombu parses it by its scheme
    runner = (f"dramatiq broker {redact(dramatiq.url)}" if dramatiq
              else f"celery broker {redact(settings.broker_url)}")
    where = (f"Kafka topics {kafka.topic_template!r}" if isinstance(kafka, KafkaOptions)
             else f"exchange {settings.exchange!r}")  # an exchange means nothing on Kafka
    results = [Result("configuration", OK, f"database {describe_database(settings.database_url)}, "
                      f"{where}, publish to {redact(settings.publish_url)}, {runner}, "
                      f"outbox namespace {settings.outbox_namespace!r} (queues {settings.queues.claim}, ...)"),
               *unknown]
    if settings.database_url == "sqlite:///outbox.db" and "OUTBOX_DATABASE_URL" not in environ:
        results.append(Result("database url", WARN, "OUTBOX_DATABASE_URL is not set: using ./outbox.db "
                              "in the current directory"))
    if not dramatiq and not settings.celery_broker_url and not is_sqlite_url(settings.database_url):
        results.append(Result("celery broker url", WARN, f"OUTBOX_CELERY_BROKER_URL is not set: using "
                              f"{settings.broker_url}; workers, beat and web processes must all use the same one"))
    # What stops the worker and beat (``outbox.celery.application.broker_conflict``), by the same rule.
    conflict = None if dramatiq else celery_broker_named_conflict(settings, environ)
    if conflict:
        results.append(Result("celery broker url", FAIL, conflict.removeprefix("outbox: ")))
    metrics = read.get(MetricsOptions)
    if isinstance(metrics, MetricsOptions) and metrics.port is not None:
        results.append(check_metrics(metrics))
    relay = read.get(RelayOptions)
    results += check_database(settings, relay.holder_timeout_s if isinstance(relay, RelayOptions) else None)
    results.append(check_dramatiq_broker(dramatiq.url) if dramatiq else check_celery_broker(settings, environ=given))
    results += check_destination(settings, kafka, probe_topic)
    if probe_topic and kafka is None:
        results.append(Result("probe", WARN, f"--probe {probe_topic} applies to a Kafka destination only: "
                              "nothing was sent"))
    return results


def check_metrics(options: MetricsOptions) -> Result:
    """OUTBOX_RELAY_METRICS_PORT is set: can this install serve the metrics? Without the
    ``metrics`` extra a worker logs one warning and serves none."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return Result("metrics", WARN, f"OUTBOX_RELAY_METRICS_PORT is set but prometheus_client is not installed "
                      f"({install_hint('metrics')}): the workers serve no /metrics")
    return Result("metrics", OK, f"each worker serves http://{options.addr}:{options.port}/metrics")


def report(results: list[Result]) -> str:
    failed = sum(r.state == FAIL for r in results)
    warned = sum(r.state == WARN for r in results)
    lines = [r.line() for r in results]
    lines.append("all checks passed" if not failed and not warned else
                 f"{failed} failed, {warned} warning(s)")
    return "\n".join(lines)


__all__ = ["Result", "run_checks", "report", "check_database", "check_celery_broker", "check_dramatiq_broker",
           "check_destination", "check_kafka", "check_metrics",
           "CONTRACT_COLUMNS", "OK", "WARN", "FAIL"]
