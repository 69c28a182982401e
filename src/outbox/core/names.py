"""The names the relay's processes agree on: Celery task names, and the names of what a relay
puts on a shared broker (queues, the claim-request token, the wake channel), all per outbox.

A leaf module (it imports nothing of the package), so the Celery app, the schedule, the tasks,
the wake-up client and the tests all take the names from one place. Why each task has its
own queue: docs/relay.md, "Tasks, queues, and how to scale and route them"; why every name
carries the outbox's namespace
and how the default is derived: docs/relay.md, "Several outboxes on one broker".
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

CLAIM_TASK = "outbox.claim"
PUBLISH_TASK = "outbox.publish"
ACK_TASK = "outbox.ack"
FAIL_TASK = "outbox.fail"
RELEASE_TASK = "outbox.release"
PURGE_TASK = "outbox.purge"

#: The task keyword argument that names the outbox a task belongs to (its namespace).
TASK_OUTBOX_ARG = "outbox"

#: What marks a claim tick (the schedule's claim entry, ``beat_schedule.build_schedule``):
#: ``requested=False`` said, which no other claim message says (a claim request says True, a
#: wake on a broker other than Redis nothing), so a worker counts beat's ticks apart from the
#: claims that traffic sends (docs/operations.md, "Logging"). Every worker version takes it.
TICK_KWARGS: dict[str, bool] = {"requested": False}

#: Which queue kind each task goes to: ``<namespace>.<kind>``.
KINDS = ("claim", "publish", "ack", "purge")
TASK_KINDS = {
    CLAIM_TASK: "claim",
    PUBLISH_TASK: "publish",
    ACK_TASK: "ack",
    FAIL_TASK: "ack",
    RELEASE_TASK: "ack",
    PURGE_TASK: "purge",
}

#: The namespace whose queues are the names of earlier versions (``outbox.claim``, ...).
LEGACY_NAMESPACE = "outbox"
#: What OUTBOX_NAMESPACE may hold: Dramatiq's rule for queue names (the strictest of the
#: brokers), and short enough that every name made from it fits RabbitMQ's 255 bytes.
NAMESPACE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]*")
MAX_NAMESPACE = 100


def valid_namespace(name: object) -> bool:
    return isinstance(name, str) and len(name) <= MAX_NAMESPACE and NAMESPACE_RE.fullmatch(name) is not None


#: The query parameters that choose the server or database, per scheme (before any +driver):
#: libpq's, and PyMySQL's socket. Other options (sslmode, charset, ...) do not name the database.
ADDRESSING_PARAMETERS = {
    "postgresql": ("host", "hostaddr", "port", "service", "dbname"),
    "postgres": ("host", "hostaddr", "port", "service", "dbname"),
    "mysql": ("unix_socket",),
    "mariadb": ("unix_socket",),
}


def database_identity(database_url: str) -> str:
    """Which database a URL names, without its driver, user, password or options: host, port
    and database name as written (``postgresql+psycopg://u:p@db:5432/app?x=1`` ->
    ``db:5432/app``), every host of libpq's list (``h1:5432,h2:5432/app``), then the query
    parameters that address the server (``/app?host=/run/postgresql``: ``ADDRESSING_PARAMETERS``),
    a SQLite file's absolute path, or an ODBC string's server and database. A URL without
    addressing parameters or a host list keeps the identity it always had (docs/relay.md,
    "Several outboxes on one broker")."""
    if "://" not in database_url:  # a raw ODBC connection string
        return _odbc_identity(database_url)
    parts = urlsplit(database_url)
    scheme = parts.scheme.split("+", 1)[0].lower()
    if scheme == "sqlite":
        path = unquote(database_url.split("://", 1)[1].split("?", 1)[0])
        path = path[1:] if path.startswith("/") else path
        return path if path in ("", ":memory:") else os.path.abspath(path)
    query = parse_qsl(parts.query)
    if not parts.hostname and "odbc_connect" in dict(query):
        return _odbc_identity(dict(query)["odbc_connect"])
    hosts = host_list(database_url)
    addressing = sorted((k, v) for k, v in query if k in ADDRESSING_PARAMETERS.get(scheme, ()))
    where = "&".join(f"{k}={v}" for k, v in addressing)
    return f"{hosts}{parts.path}" + (f"?{where}" if where else "")


#: The relay's own URL parameter (PostgreSQL): the host the default namespace is derived from
#: when the URL's host part names none; libpq never sees it (``checks.without_session_bounds``).
#: Django's empty HOST is written with ``127.0.0.1`` here, the host releases before connected to,
#: so its namespace stays while the relay connects through the socket as Django does
#: (docs/relay.md, "Several outboxes on one broker").
NAMESPACE_HOST = "namespace_host"


def namespace_identity(database_url: str) -> str:
    """``database_identity``, with the URL's ``NAMESPACE_HOST`` standing in for an empty host
    part (``postgresql://app@:5432/shop?namespace_host=127.0.0.1`` -> ``127.0.0.1:5432/shop``)."""
    identity = database_identity(database_url)
    if "://" not in database_url:
        return identity
    parts = urlsplit(database_url)
    stand_in = dict(parse_qsl(parts.query)).get(NAMESPACE_HOST, "").strip().lower()
    named = parts.hostname or "," in parts.netloc.rpartition("@")[2]
    return identity if named or not stand_in else f"{stand_in}{identity}"


def host_list(url: str, default_port: int | None = None) -> str:
    """The hosts of ``url``'s host part as the identity writes them, ``db:5432``, or for libpq's
    list every one, ``h1:5432,h2:5432``; the same as ``hostname`` and ``port`` for one host.
    A port equal to ``default_port`` is left out (``db``)."""
    return ",".join(_host_port(item, default_port) for item in urlsplit(url).netloc.rpartition("@")[2].split(","))


def _host_port(hostinfo: str, default_port: int | None = None) -> str:
    """One ``host[:port]`` as the identity writes it: the host in lower case, IPv6 unbracketed."""
    one = urlsplit(f"//{hostinfo}")
    return f"{one.hostname or ''}" + (f":{one.port}" if one.port and one.port != default_port else "")


def _odbc_identity(odbc: str) -> str:
    fields = {k.strip().lower(): v.strip() for k, _, v in (p.partition("=") for p in odbc.split(";"))}
    server = fields.get("server", "").lower()
    return f"{server}/{fields.get('database', fields.get('initial catalog', ''))}"


def default_namespace(database_url: str, table: str, schema: str | None = None) -> str:
    """The namespace of an outbox when OUTBOX_NAMESPACE is unset: ``outbox.[<schema>.]<table>.<h>``,
    ``h`` a short digest of its database (``namespace_identity``). Two outboxes differing in
    table, schema or database get different names; every process of one outbox (writers,
    workers, beat) gets the same one as long as they name its database alike."""
    digest = hashlib.sha1(namespace_identity(database_url).encode()).hexdigest()[:8]
    where = f"{schema}.{table}" if schema else table
    return f"outbox.{where}.{digest}"


@dataclass(frozen=True)
class Queues:
    """The queues of one outbox on the task runner's broker: ``<namespace>.claim``, ``.publish``,
    ``.ack``, ``.purge``."""

    namespace: str

    @property
    def claim(self) -> str:
        return f"{self.namespace}.claim"

    @property
    def publish(self) -> str:
        return f"{self.namespace}.publish"

    @property
    def ack(self) -> str:
        return f"{self.namespace}.ack"

    @property
    def purge(self) -> str:
        return f"{self.namespace}.purge"

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(f"{self.namespace}.{kind}" for kind in KINDS)

    def for_task(self, task: str) -> str:
        """The queue ``task`` (a task name above) is routed to."""
        return f"{self.namespace}.{TASK_KINDS[task]}"

    @property
    def routes(self) -> dict[str, str]:
        """Task name -> queue."""
        return {task: self.for_task(task) for task in TASK_KINDS}


#: Prefix of the claim-request token (``claim_request_key``): a claim message's token is
#: only deleted when its name starts with it.
CLAIM_REQUEST_PREFIX = "outbox:wake:"


def claim_request_key(broker_url: str, key_prefix: str, namespace: str) -> str:
    """The name of the one coalesced "claim soon" token of an outbox's claim queue, i.e. of a
    task runner's broker URL, key prefix (Celery's ``global_keyprefix``, Dramatiq's
    namespace) and the outbox's namespace. Writers' wake-ups, the LISTEN thread and drain
    mode take the same token (docs/waking-and-metrics.md, "One claim request")."""
    digest = hashlib.sha1(f"{broker_url}|{key_prefix}|{namespace}".encode()).hexdigest()[:16]
    return f"{CLAIM_REQUEST_PREFIX}{digest}"


#: The URL schemes of a Redis server, plain and TLS.
REDIS_URL_PREFIXES = ("redis://", "rediss://")


def is_redis_url(url: str) -> bool:
    """``redis://`` or ``rediss://`` (TLS): a broker, wake channel or state store on Redis."""
    return url.startswith(REDIS_URL_PREFIXES)


def wake_channel(broker_url: str, key_prefix: str, namespace: str) -> str:
    """The Redis pub/sub channel on which writers wake the workers of an outbox's claim queue
    (the workers' main processes SUBSCRIBE; docs/waking-and-metrics.md)."""
    return f"{claim_request_key(broker_url, key_prefix, namespace)}:notify"


__all__ = ["is_redis_url", "REDIS_URL_PREFIXES", "wake_channel", "CLAIM_TASK", "TICK_KWARGS", "PUBLISH_TASK", "ACK_TASK",
           "FAIL_TASK", "RELEASE_TASK", "PURGE_TASK",
           "CLAIM_REQUEST_PREFIX", "claim_request_key", "TASK_OUTBOX_ARG", "KINDS", "TASK_KINDS", "LEGACY_NAMESPACE",
           "NAMESPACE_RE", "MAX_NAMESPACE", "valid_namespace", "ADDRESSING_PARAMETERS", "NAMESPACE_HOST", "namespace_identity", "host_list", "database_identity", "default_namespace", "Queues"]
