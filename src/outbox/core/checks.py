"""The validators of setting values: each checks one value and raises a ``ConfigError`` that
names the setting. The declarations (``outbox.core.config``) point at them; the reader
(``outbox.core.options``) calls them."""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import ConfigError
from .names import MAX_NAMESPACE, NAMESPACE_HOST, valid_namespace
from .redact import redact, register_secret, register_url

log = logging.getLogger("outbox.config")

#: Above this the lease is almost certainly a typo (30 days written as ms), and on
#: SQL Server it would overflow the INT bound to DATEADD(MILLISECOND, ...).
MAX_CLAIM_TIMEOUT_MS = 86_400_000

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
    """The URL with the relay's own parameters (SESSION_BOUNDS, ``names.NAMESPACE_HOST``) taken
    out, for the driver (``take_query_parameters``)."""
    return take_query_parameters(url, lambda key: key in (*SESSION_BOUNDS, NAMESPACE_HOST))[0]


def take_query_parameters(url: str, taken: Callable[[str], bool]) -> tuple[str, str]:
    """The URL without the query parameters whose decoded name ``taken`` accepts, every other
    part byte for byte, and those parameters as a query string. Decoded and encoded again, a
    query lost its ``+``, which libpq keeps (``parse_qsl`` reads it as a space: a key's
    passphrase ``Ab+9`` became ``Ab 9``; found in review)."""
    head, mark, query = url.partition("?")
    query, hash_mark, fragment = query.partition("#")
    pieces = query.split("&")
    out = [piece for piece in pieces if taken(unquote(piece.partition("=")[0]))]
    if not out:
        return url, ""
    kept = [piece for piece in pieces if piece not in out]
    rest = "&".join(kept) if any(kept) else ""
    return head + (mark if rest else "") + rest + hash_mark + fragment, "&".join(out)


#: TLS parameters of a MySQL/MariaDB URL: PyMySQL's names, and ``ssl_mode`` as MySQL's clients
#: spell it (docs/relay.md, "TLS to the database"). Read by ``mysql_tls``.
MYSQL_TLS_PARAMETERS = ("ssl_mode", "ssl_disabled", "ssl_ca", "ssl_capath", "ssl_cert", "ssl_key",
                        "ssl_key_password", "ssl_cipher", "ssl_verify_cert", "ssl_verify_identity")
#: Other names of TLS parameters, read as the parameter they name (``mysql_tls``): SQLAlchemy's
#: pymysql and mysqldb dialects document ``ssl_check_hostname`` (docs/relay.md, "TLS to the database").
MYSQL_TLS_ALIASES = {"ssl_check_hostname": "ssl_verify_identity"}
#: Every query parameter a MySQL/MariaDB URL may carry. Any other that looks like a TLS one
#: (``ssl``/``tls`` in its name) is refused: a misspelt TLS parameter was silently dropped, and
#: the relay connected in cleartext (found in review). Any other is ignored, as it always was,
#: with one warning: refusing it would stop, at an upgrade, a deployment that carried it.
MYSQL_URL_PARAMETERS = ("charset", "unix_socket", "read_timeout", "write_timeout", *MYSQL_TLS_PARAMETERS,
                        *MYSQL_TLS_ALIASES, *SESSION_BOUNDS)
MYSQL_SSL_MODES = ("DISABLED", "PREFERRED", "REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def mysql_url_options(url: str) -> dict[str, str]:
    """The query parameters of a MySQL/MariaDB URL (the last of a repeated one), decoded as
    libpq decodes its own (``%XX`` only: a ``+`` stays a plus). A parameter outside
    ``MYSQL_URL_PARAMETERS`` is a ``ConfigError`` listing the accepted ones."""
    options: dict[str, str] = {}
    for piece in urlsplit(url).query.split("&"):
        if piece:
            key, _, value = piece.partition("=")
            options[unquote(key)] = unquote(value)
    unknown = sorted(set(options) - set(MYSQL_URL_PARAMETERS))
    # Only names are quoted: anything else may be part of a password (an unencoded '?').
    named = [key if re.fullmatch(r"\w{1,64}", key) else "(a part that is no name)" for key in unknown]
    tls = [name for name in named if "ssl" in name.lower() or "tls" in name.lower()]
    if tls:
        raise ConfigError(f"OUTBOX_DATABASE_URL: unknown MySQL/MariaDB URL parameter {', '.join(tls)} "
                          f"(accepted: {', '.join(MYSQL_URL_PARAMETERS)})")
    if named and tuple(named) not in _warned:
        _warned.add(tuple(named))
        log.warning("outbox: OUTBOX_DATABASE_URL: MySQL/MariaDB URL parameter %s is ignored: the relay reads only "
                    "%s", ", ".join(named), ", ".join(MYSQL_URL_PARAMETERS))
    return options


_warned: set[tuple[str, ...]] = set()  # the ignored parameters said once per process


def _register_mysql_secrets(url: str) -> None:
    """Mask the client key's passphrase wherever it shows up (``outbox.core.redact``): as
    written in the URL and decoded."""
    for piece in urlsplit(url).query.split("&"):
        key, _, value = piece.partition("=")
        if unquote(key) == "ssl_key_password" and value:
            register_secret(value)


@dataclass(frozen=True)
class MysqlTls:
    """A MySQL/MariaDB connection's TLS as its URL asks for it (``mysql_tls``): required, with
    these files and checks. A connection to a server that offers no TLS fails."""

    ca: str | None = None
    capath: str | None = None
    cert: str | None = None
    key: str | None = None
    key_password: str | None = None
    cipher: str | None = None
    verify_cert: bool = False
    verify_identity: bool = False


def _mysql_flag(options: dict[str, str], name: str) -> bool | None:
    if name not in options:
        return None
    value = options[name].strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"OUTBOX_DATABASE_URL: {name}={options[name]!r} is not true or false")
    return value in _TRUE


def _mysql_tls_given(options: dict[str, str]) -> dict[str, str]:
    """The TLS parameters of ``options``, an alias (``MYSQL_TLS_ALIASES``, each a true/false
    flag) read as the parameter it names; the two saying different things is a ``ConfigError``."""
    given = {name: options[name] for name in MYSQL_TLS_PARAMETERS if name in options}
    for alias, name in MYSQL_TLS_ALIASES.items():
        if alias in options:
            flag = _mysql_flag(options, alias)
            if name in given and _mysql_flag(given, name) != flag:
                raise ConfigError(f"OUTBOX_DATABASE_URL: {alias}={options[alias]} contradicts {name}={options[name]}")
            given.setdefault(name, options[alias])
    return given


def _spelled(options: dict[str, str], name: str) -> str:
    """``name`` as the URL spells it: its alias when only that is given (for errors)."""
    aliases = [alias for alias, of in MYSQL_TLS_ALIASES.items() if of == name and alias in options]
    return aliases[0] if aliases and name not in options else name


def mysql_tls(options: dict[str, str]) -> MysqlTls | str | None:
    """What a MySQL/MariaDB URL's TLS parameters (``mysql_url_options``) ask for: None when it
    gives none (PyMySQL's own default: TLS when the server offers it, unverified), ``"disabled"``
    (``ssl_mode=DISABLED``, ``ssl_disabled=true``), or a required ``MysqlTls`` (docs/relay.md,
    "TLS to the database", has the rules). Contradictory parameters are a ``ConfigError``."""
    given = _mysql_tls_given(options)
    mode = given.pop("ssl_mode", "").strip().upper() or None
    if mode is not None and mode not in MYSQL_SSL_MODES:
        raise ConfigError(f"OUTBOX_DATABASE_URL: ssl_mode={options['ssl_mode']!r}: expected one of "
                          f"{', '.join(MYSQL_SSL_MODES)}")
    disabled = _mysql_flag(given, "ssl_disabled")
    given.pop("ssl_disabled", None)
    if disabled and mode not in (None, "DISABLED"):
        raise ConfigError(f"OUTBOX_DATABASE_URL: ssl_disabled=true contradicts ssl_mode={mode}")
    if disabled or mode in ("DISABLED", "PREFERRED"):
        if given:
            raise ConfigError(f"OUTBOX_DATABASE_URL: {', '.join(sorted(given))} with TLS "
                              f"{'disabled' if mode != 'PREFERRED' else 'PREFERRED (which checks nothing)'}: "
                              "set ssl_mode=REQUIRED, VERIFY_CA or VERIFY_IDENTITY, or drop them")
        return None if mode == "PREFERRED" else "disabled"
    if mode is None and not given:
        return None
    has_ca = "ssl_ca" in given or "ssl_capath" in given
    verify_cert, verify_identity = _mysql_flag(given, "ssl_verify_cert"), _mysql_flag(given, "ssl_verify_identity")
    # The mode's checks, else a CA's (PyMySQL's rule: a CA given checks the certificate and the host).
    cert = mode in ("VERIFY_CA", "VERIFY_IDENTITY") or (mode is None and has_ca)
    identity = mode == "VERIFY_IDENTITY" or (mode is None and has_ca)
    for name, flag, by_mode in (("ssl_verify_cert", verify_cert, mode in ("VERIFY_CA", "VERIFY_IDENTITY")),
                                ("ssl_verify_identity", verify_identity, mode == "VERIFY_IDENTITY")):
        if flag is False and by_mode:
            raise ConfigError(f"OUTBOX_DATABASE_URL: {_spelled(options, name)}=false contradicts ssl_mode={mode}")
    cert = cert if verify_cert is None else verify_cert
    identity = (identity and cert) if verify_identity is None else verify_identity
    if identity and verify_cert is False:
        raise ConfigError(f"OUTBOX_DATABASE_URL: {_spelled(options, 'ssl_verify_identity')}=true needs the "
                          "certificate checked, not ssl_verify_cert=false")
    if ("ssl_key" in given or "ssl_key_password" in given) and "ssl_cert" not in given:
        raise ConfigError("OUTBOX_DATABASE_URL: ssl_key and ssl_key_password need ssl_cert (the client certificate)")
    return MysqlTls(ca=given.get("ssl_ca"), capath=given.get("ssl_capath"), cert=given.get("ssl_cert"),
                    key=given.get("ssl_key"), key_password=given.get("ssl_key_password"),
                    cipher=given.get("ssl_cipher"), verify_cert=cert or identity, verify_identity=identity)


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


#: The longest name of the database broker's queue table: its bindings table and indexes
#: add suffixes to it (``<name>_binding``, ...) that must still fit PostgreSQL's 63 bytes.
MAX_QUEUE_TABLE = 41
_QUEUE_TABLE = re.compile(rf"^[A-Za-z_][A-Za-z0-9_]{{0,{MAX_QUEUE_TABLE - 1}}}$")


def validate_queue_table(value: str, setting: str = "OUTBOX_TRANSPORT_QUEUE_TABLE") -> str:
    """The database broker's queue table (docs/transport.md): a plain identifier, short enough
    for the names derived from it. Checked at start-up; the worker used to meet it first."""
    if not isinstance(value, str) or not _QUEUE_TABLE.match(value):
        raise ConfigError(f"{setting}={value!r} is not a valid queue table name (letters, digits and "
                          f"underscores, not starting with a digit, at most {MAX_QUEUE_TABLE} characters)")
    return value


def check_host_part(url: str, setting: str) -> None:
    """The host part of ``url`` as every client reads it, or a ``ConfigError`` naming the
    setting, password masked. An unencoded ``/ ? # @`` in a password moves part of it into
    the port (``Port could not be cast to integer value as '<fragment>'``, raised by the
    first reader) or the host (a driver naming it in its error), where no masking finds it
    (docs/relay.md, "Configuration checks"). A URL libpq reads (``postgresql://``, and the
    database broker's ``outboxdb+postgresql://``) may list hosts, ``host1:port1,host2:port2``:
    each is read on its own."""
    shown = redact(repr(url))
    fix = "percent-encode / ? # @ in a password as %2F %3F %23 %40"
    head = re.split(r"[?#]", url.split("://", 1)[1], maxsplit=1)[0]  # the authority and the path
    hosts = head.split("/", 1)[0].rpartition("@")[2].split(",")
    libpq = url.split("://", 1)[0].lower().split("+")[-1].startswith("postgres")
    try:
        parts = urlsplit(url)
        for server in [urlsplit(f"//{host}") for host in hosts] if libpq else [parts]:
            server.port  # noqa: B018 - read for its ValueError
    except ValueError:
        if len(hosts) > 1 and not libpq:
            fix = f"a list of hosts is read in only a PostgreSQL URL; or {fix}"
        raise ConfigError(f"{setting}={shown}: the host part cannot be read (the port is not a number from 0 "
                          f"to 65535, or a bracket is unbalanced): {fix}") from None
    # Python's parser (MySQL, kombu, Redis) takes the last '@'; libpq the first, so a second
    # '@' in a PostgreSQL password put part of it in the host name (and in libpq's error).
    if (libpq and head.count("@") > 1) or ("@" in head and parts.netloc and "@" not in parts.netloc):
        raise ConfigError(f"{setting}={shown}: more than one '@', or an '@' after the host: {fix}")
    if url.split("://", 1)[0].lower() in ("redis", "rediss"):
        check_redis_database(url, setting)


def check_redis_database(url: str, setting: str) -> None:
    """A Redis URL's path: none, ``/`` or ``/<database number>``, each URL of a ``;`` list.
    kombu and redis-py read it only when they connect (docs/relay.md, "Configuration checks")."""
    for one in url.split(";"):
        path = urlsplit(one.strip()).path
        if path not in ("", "/") and not re.fullmatch(r"/[0-9]+", path):
            raise ConfigError(f"{setting}={redact(repr(url))}: the Redis database {path!r} is not a number "
                              "(redis://host:6379/0)")


def _looks_like_odbc(url: str) -> bool:
    return "=" in url and ";" in url


#: Database URL schemes the engines (``outbox.storage.engines.kind_of_url``) accept, before any
#: ``+driver`` suffix. Checked here too so that every process (CLI, worker, beat) refuses
#: an unknown database at start-up, not at its first claim.
DATABASE_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "mssql", "sqlserver")


def database_scheme(url: str) -> str:
    """The database a URL names: its scheme in lower case without a ``+driver`` suffix
    (``SQLite+pysqlite:///x`` is ``sqlite``); '' without ``://`` (an ODBC string). The one rule
    of the start-up check, the engine's choice (``kind_of_url``, ``sqlite_path``) and the default
    Celery broker: the check took forms the engine refused (found in review)."""
    return url.split("://", 1)[0].lower().split("+", 1)[0] if "://" in url else ""


def is_sqlite_url(url: str) -> bool:
    return database_scheme(url) == "sqlite"


def validate_database_url(url: str, setting: str = "OUTBOX_DATABASE_URL") -> str:
    """A URL of a supported database (``scheme[+driver]://...``) or a raw ODBC connection
    string (``DRIVER=...;SERVER=...``). The value is quoted with its password masked."""
    shown = redact(repr(url))
    if not url or ("://" not in url and not _looks_like_odbc(url)):
        raise ConfigError(f"{setting}={shown} is not a database URL "
                          "(expected sqlite:///path, postgresql://..., mysql://... or mssql+pyodbc://...)")
    if "://" in url:
        scheme, base = url.split("://", 1)[0].lower(), database_scheme(url)
        if base not in DATABASE_SCHEMES:
            raise ConfigError(f"{setting}={shown}: unsupported database {scheme!r} "
                              "(use sqlite:///, postgresql://, mysql:// or mssql+pyodbc://)")
        if base != "sqlite":  # a path, whatever it holds
            check_host_part(url, setting)
        if base in SESSION_BOUND_SCHEMES:
            session_bounds(url)
        if base in ("mysql", "mariadb"):
            mysql_tls(mysql_url_options(url))
            _register_mysql_secrets(url)
    elif "driver=" not in url.lower():
        raise ConfigError(f"{setting}={shown} looks like an ODBC connection string without DRIVER=")
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
    if transport == DATABASE_BROKER_SCHEME and ";" in url:
        # kombu switches to an alternate by parsing it without its transport+ prefix, so a
        # failover would die on "No such transport"; the database's own failover is the way.
        raise ConfigError(f"{setting}={shown}: alternate broker URLs (';') are not supported by outboxdb; name "
                          "one database endpoint that fails over itself (docs/transport.md, \"Failover\")")
    for alternate in url.split(";"):  # Celery's failover list: each is a URL of its own
        if "://" in alternate:
            check_host_part(alternate.strip(), setting)
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
    if transport != "kafka":  # kafka:// lists its servers, after a password that may hold '@'
        check_host_part(url, setting)
    if transport == "kafka":
        servers = rest.rsplit("@", 1)[-1]
        # Nothing but the servers: a query or path was dropped unsaid, so `?security.protocol=ssl`
        # or amqps://'s `?ssl_ca_certs=...` gave a client in clear (found in review, 7 December 2026).
        servers, mark, query = servers.partition("?")
        servers, _, path = servers.partition("/")
        if mark:
            raise ConfigError(f"{setting}={shown}: a Kafka URL takes no parameters ({redact(repr(query))} would be ignored): "
                              "set them as OUTBOX_KAFKA_* settings (docs/destinations.md, \"Settings\")")
        if path:
            raise ConfigError(f"{setting}={shown}: a Kafka URL takes no path ('/{path}'): "
                              "kafka://[user:password@]host:port[,host:port...], and OUTBOX_KAFKA_* settings")
        for server in servers.split(","):
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{setting}={shown}: {server!r} is not host:port "
                                  "(expected kafka://host:port[,host:port...])")
    return url


#: The fields an OUTBOX_KAFKA_TOPIC_TEMPLATE may use.
KAFKA_TEMPLATE_FIELDS = ("topic", "aggregate_type")
KAFKA_SECURITY_PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def validate_kafka_topic_template(template: str, setting: str = "OUTBOX_KAFKA_TOPIC_TEMPLATE") -> str:
    try:
        template.format(topic="t", aggregate_type="a")
        unknown = {m.group(1) for m in re.finditer(r"\{([^{}]*)\}", template)} - set(KAFKA_TEMPLATE_FIELDS)
    except (KeyError, IndexError, ValueError) as exc:
        unknown = {str(exc)}
    if unknown:
        raise ConfigError(f"{setting}={template!r}: only {{topic}} and {{aggregate_type}} may be used "
                          "(e.g. 'prod.{topic}')")
    return template


def validate_kafka_security_protocol(value: str, setting: str = "OUTBOX_KAFKA_SECURITY_PROTOCOL") -> str:
    if value.lower() not in KAFKA_SECURITY_PROTOCOLS:
        raise ConfigError(f"{setting}={value!r}: expected one of {', '.join(KAFKA_SECURITY_PROTOCOLS)}")
    return value.lower()


def validate_kafka_sasl_mechanism(value: str, setting: str = "OUTBOX_KAFKA_SASL_MECHANISM") -> str:
    if value.upper() not in KAFKA_SASL_MECHANISMS:
        raise ConfigError(f"{setting}={value!r}: expected one of {', '.join(KAFKA_SASL_MECHANISMS)}")
    return value.upper()


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
    check_host_part(url, setting)
    register_url(url)
    return url


def validate_dramatiq_namespace(name: str, setting: str = "OUTBOX_DRAMATIQ_NAMESPACE") -> str:
    """The Redis key namespace of Dramatiq's queues (RedisBroker ``namespace``)."""
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,100}", name or ""):
        raise ConfigError(f"{setting}={name!r} must be 1 to 100 letters, digits or _ . : -")
    return name


_SPARK_MASTER = re.compile(r"^(local(\[(\*|\d+)(,\s*\d+)?\])?|yarn|(spark|k8s|mesos)://\S+)$")


def valid_spark_master(master: str) -> bool:
    """Spark's master URL forms: local[*], local[N], spark://host:port, yarn, k8s://..., mesos://..."""
    return bool(_SPARK_MASTER.match(master))


def validate_spark_master(master: str, setting: str = "OUTBOX_SPARK_MASTER") -> str:
    if not valid_spark_master(master):
        raise ConfigError(f"{setting}={master!r} is not a Spark master URL "
                          "(local[*], local[N], spark://host:port, yarn, k8s://https://host:port)")
    return master


#: Spark's log levels (``SparkContext.setLogLevel``).
SPARK_LOG_LEVELS = ("ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN")


#: OUTBOX_RELAY_CLAIM_AHEAD's modes, and the boolean spellings each one also takes.
CLAIM_AHEAD_MODES = {"auto": ("auto",), "on": ("on", "1", "true", "yes", "always"),
                     "off": ("off", "0", "false", "no", "never")}


def validate_claim_ahead(value: str, setting: str = "OUTBOX_RELAY_CLAIM_AHEAD") -> str:
    text = value.strip().lower()
    mode = next((mode for mode, spellings in CLAIM_AHEAD_MODES.items() if text in spellings), None)
    if mode is None:
        raise ConfigError(f"{setting}={value!r}: expected auto, on (or true) or off (or false)")
    return mode


def validate_spark_log_level(level: str, setting: str = "OUTBOX_SPARK_LOG_LEVEL") -> str:
    if level.upper() not in SPARK_LOG_LEVELS:
        raise ConfigError(f"{setting}={level!r} is not a Spark log level (one of {', '.join(SPARK_LOG_LEVELS)})")
    return level.upper()
