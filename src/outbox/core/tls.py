"""TLS to RabbitMQ (``amqps://``): the URL's ``ssl_*`` parameters read once, checked, and handed to
each AMQP library in its own form (docs/destinations.md, "TLS to RabbitMQ").

One URL form serves every AMQP client of the relay: kombu's py-amqp (the publisher, ``outbox
check``, the Dramatiq scheduler's leader lock) takes a dict of ``ssl.wrap_socket``-style keys as
``ssl=``, pika (Dramatiq's RabbitmqBroker and ``outbox check`` of it) an ``SSLOptions``. On
Redis, redis-py reads the same ``ssl_*`` names from the URL itself; ``redis_py_url`` only
rewrites kombu's spelling of ``ssl_cert_reqs``. Neither reads these parameters
from the URL itself: kombu passed them to py-amqp as unknown keyword arguments (a TypeError at
every connect), and with none py-amqp checked the certificate but not the host name, so any
certificate a system CA signed, for any name, was accepted (found in review).

The parameters, the same names as kombu's and redis-py's for ``rediss://``:

* ``ssl_ca_certs``: the CA file (PEM) the server's certificate must chain to (default: the
  system's CAs);
* ``ssl_certfile`` / ``ssl_keyfile``: the client's certificate and key (mutual TLS); the key
  must not be encrypted, py-amqp has no way to take its passphrase;
* ``ssl_cert_reqs``: ``required`` (default) or ``none`` (no check at all: tests only);
* ``ssl_check_hostname``: ``true`` (default) or ``false`` (the chain is still checked);
* ``ssl_server_hostname``: the name the certificate must carry (default: the host of the URL
  connected to; for a list of URLs, each broker's own: ``kombu_connection``).

This module imports nothing of the package but its errors and redaction.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import ConfigError
from .redact import redact

#: The schemes that speak TLS to RabbitMQ (kombu's ``amqps``; pika reads it too).
AMQP_TLS_SCHEMES = ("amqps",)
#: The schemes of RabbitMQ without TLS, where ``ssl_*`` parameters are refused.
AMQP_PLAIN_SCHEMES = ("amqp", "pyamqp")

#: Every parameter read, with what it means (the refusal of an unknown one lists them).
TLS_PARAMETERS = {
    "ssl_ca_certs": "CA file (PEM) the server's certificate must chain to",
    "ssl_certfile": "client certificate (PEM)",
    "ssl_keyfile": "client key (PEM, not encrypted)",
    "ssl_cert_reqs": "required (default) or none",
    "ssl_check_hostname": "true (default) or false",
    "ssl_server_hostname": "the name every broker's certificate must carry (default: each broker's host)",
}
_CERT_REQS = {"required": True, "cert_required": True, "none": False, "cert_none": False}
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


@dataclass(frozen=True)
class AmqpTls:
    """What an ``amqps://`` URL asks of TLS (the parameters above)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    verify: bool = True
    check_hostname: bool = True
    #: The name the certificate must carry: ``ssl_server_hostname``; None: the host connected to.
    server_hostname: str | None = None

    @property
    def checks_hostname(self) -> bool:
        return self.verify and self.check_hostname

    def context(self, setting: str = "OUTBOX_PUBLISH_URL") -> ssl.SSLContext:
        """The client's ``SSLContext``: the CA (or the system's), the client certificate, and the
        checks asked for (certificate and host name by default). Files that cannot be read, or
        an encrypted key, are a ConfigError naming ``setting`` (never a passphrase prompt on the
        terminal, which OpenSSL would otherwise show)."""
        try:
            context = ssl.create_default_context(cafile=self.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{setting}: the CA file ssl_ca_certs={self.ca_certs!r} cannot be used: "
                              f"{_why(exc)}") from None
        context.check_hostname = self.checks_hostname
        context.verify_mode = ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE
        if self.certfile:
            try:
                context.load_cert_chain(self.certfile, self.keyfile, password=_no_passphrase)
            except (OSError, ssl.SSLError, _Encrypted) as exc:
                raise ConfigError(f"{setting}: the client certificate ssl_certfile={self.certfile!r} "
                                  f"(ssl_keyfile={self.keyfile!r}) cannot be used: {_why(exc)}") from None
        return context

    def kombu_ssl(self, setting: str = "OUTBOX_PUBLISH_URL") -> dict[str, Any]:
        """kombu's ``Connection(ssl=...)`` for py-amqp: the keys of its ``_wrap_socket_sni``.
        py-amqp 5.4 takes no ``SSLContext`` (it ignores one and uses its defaults); it checks the
        host name exactly when ``server_hostname`` is given: None here (no ``ssl_server_hostname``)
        is filled in with the host connected to by ``kombu_connection``'s connection. The files
        are loaded once here first (``context``), so a bad one is a ConfigError rather than a
        connection failure."""
        self.context(setting)
        options: dict[str, Any] = {"cert_reqs": ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE}
        if self.ca_certs:
            options["ca_certs"] = self.ca_certs
        if self.certfile:
            options["certfile"] = self.certfile
            options["keyfile"] = self.keyfile
        if self.checks_hostname:
            options["server_hostname"] = self.server_hostname
        return options


    def pika_ssl_options(self, host: str | None, setting: str = "OUTBOX_DRAMATIQ_BROKER_URL") -> Any:
        """pika's ``SSLOptions`` for a connection to ``host`` (one URL of a list). pika would read
        only its own ``?ssl_options={...}`` (a Python literal) that kombu refuses; one URL form
        serves both this way (docs/dramatiq.md, "TLS")."""
        import pika  # type: ignore[import-untyped]

        return pika.SSLOptions(self.context(setting), server_hostname=self.server_hostname or host)


class _Encrypted(Exception):
    pass


def _no_passphrase() -> bytes:
    raise _Encrypted("the key is encrypted: give a key without a passphrase (openssl pkey -in key.pem -out "
                     "plain.pem), readable by the relay's user only")


def _why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, _Encrypted) else f"{type(exc).__name__}: {exc}"


def split_amqp_url(url: str, setting: str) -> tuple[str, AmqpTls | None]:
    """``url`` without its TLS parameters, and what they ask (None: no TLS, an ``amqp://`` URL).
    A list of URLs (``;``, kombu's and Dramatiq's failover) is read one by one: the TLS
    parameters may be written in any of them and must not differ; each broker's certificate is
    checked against its own host name unless ``ssl_server_hostname`` names one for all (per-node
    certificates: ``kombu_connection``, ``pika_ssl_options``). Raises ConfigError naming
    ``setting`` for a parameter it does not know, a value it cannot read, or TLS parameters on
    ``amqp://``."""
    shown = redact(repr(url))
    given: dict[str, str] = {}
    kept: list[str] = []
    schemes: set[str] = set()
    for one in url.split(";"):
        one = one.strip()
        scheme = one.split("://", 1)[0].lower()
        schemes.add(scheme)
        base, _, query = one.partition("?")
        others = []
        for piece in query.split("&") if query else []:
            key = unquote(piece.partition("=")[0])
            if _is_tls_key(key):
                value = parse_qsl(piece, keep_blank_values=True)[0][1] if "=" in piece else ""
                if given.get(key, value) != value:
                    raise ConfigError(f"{setting}={shown}: {key} differs between the URLs of the list; give it once")
                given[key] = value
            else:
                others.append(piece)  # kept byte for byte: kombu and pika read the rest as before
        kept.append(base + ("?" + "&".join(others) if others else ""))
    tls_scheme = schemes & set(AMQP_TLS_SCHEMES)
    if given and not tls_scheme:
        raise ConfigError(f"{setting}={shown}: {', '.join(sorted(given))} asks for TLS, which this URL's scheme does "
                          "not use: write amqps:// (port 5671 by default)")
    if not tls_scheme:
        return url, None
    return ";".join(kept), _read(given, setting, shown)


def refuse_kombu_url_tls(url: str, setting: str) -> str:
    """``url`` (Celery's AMQP broker, whose TLS is Celery's ``broker_use_ssl``), refused when it
    carries ``ssl_*`` parameters: kombu hands them to py-amqp as unknown keyword arguments, a
    TypeError at every connect of the workers and of ``outbox check`` (docs/relay.md, "TLS to
    Celery's RabbitMQ"). kombu's own ``ssl=1`` is left to it."""
    keys = sorted({unquote(piece.partition("=")[0]) for one in url.split(";")
                   for piece in one.partition("?")[2].split("&") if piece.lower().startswith("ssl_")})
    if keys:
        raise ConfigError(f"{setting}={redact(repr(url))}: {', '.join(keys)} cannot be read from Celery's broker URL "
                          "(kombu passes them to py-amqp, which refuses them at every connect): give Celery's "
                          "broker_use_ssl in its config module instead, e.g. {'ca_certs': '/path/ca.pem', "
                          "'cert_reqs': ssl.CERT_REQUIRED}")
    return url


def check_url_tls(url: str, setting: str) -> str:
    """``url``, after its TLS parameters have been read: an AMQP URL's by ``split_amqp_url``, a
    Redis URL's by ``check_redis_tls`` (the settings' check)."""
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in AMQP_TLS_SCHEMES + AMQP_PLAIN_SCHEMES:
        split_amqp_url(url, setting)
    elif scheme in ("redis", "rediss"):
        check_redis_tls(url, setting)
    return url


#: The ``ssl_*`` parameters a Redis URL may carry: redis-py's ``SSLConnection`` arguments that
#: a URL can spell. kombu (Celery's broker) and redis-py (Dramatiq's, the relay's own clients)
#: hand every ``ssl_*`` parameter to that class as a keyword argument, so any other name was a
#: TypeError at every connect, in a worker's log, long after start-up (found in review).
REDIS_TLS_PARAMETERS = ("ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile", "ssl_password",
                        "ssl_cert_reqs", "ssl_check_hostname", "ssl_ciphers")


def check_redis_tls(url: str, setting: str) -> None:
    """Refuse a Redis URL's ``ssl_*`` parameter redis-py does not take, and an ``ssl_cert_reqs``
    neither kombu nor redis-py reads (``REDIS_CERT_REQS``). A list of URLs (``;``, kombu's
    failover) is read one by one, as kombu does: read whole, the rest of the list was the
    value of the first URL's last parameter (found in review)."""
    given = [pair for one in url.split(";")
             for pair in parse_qsl(one.partition("?")[2].partition("#")[0], keep_blank_values=True)]
    for key, value in given:
        if not key.lower().startswith("ssl"):
            continue
        shown = redact(repr(url))
        if key not in REDIS_TLS_PARAMETERS:
            raise ConfigError(f"{setting}={shown}: unknown TLS parameter {key!r} of a Redis URL "
                              f"(accepted: {', '.join(REDIS_TLS_PARAMETERS)})")
        if key == "ssl_cert_reqs":
            redis_cert_reqs(value, f"{setting}={shown}")


def kombu_connection(url: str, setting: str, **options: Any) -> Any:
    """kombu's ``Connection`` for ``url``, with kombu's other ``options`` (``connect_timeout``,
    ``heartbeat``, ...). An AMQP URL over TLS is given its ``ssl=`` (``AmqpTls.kombu_ssl``), each
    broker's certificate checked against that broker's host name unless ``ssl_server_hostname``
    names one (``_each_host_named``); other URLs as they are (kombu reads a ``rediss://`` URL's
    ``ssl_*`` itself). Raises ConfigError naming ``setting`` for TLS parameters it cannot use."""
    from kombu import Connection

    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in AMQP_TLS_SCHEMES + AMQP_PLAIN_SCHEMES:
        return Connection(url, **options)
    clean, tls = split_amqp_url(url, setting)
    if tls is None:
        return Connection(clean, **options)
    sslopts = tls.kombu_ssl(setting)
    named = tls.checks_hostname and tls.server_hostname is None
    if named:
        # The first broker's name until the connection names the one it connects to: should a
        # kombu release stop calling ``_init_params`` (``_each_host_named``), every broker is
        # checked against this name and another refused, never none checked (py-amqp checks
        # the host name only when ``server_hostname`` is given: found in review).
        sslopts["server_hostname"] = urlsplit(clean.split(";", 1)[0].strip()).hostname or "localhost"
    return (_each_host_named() if named else Connection)(clean, ssl=sslopts, **options)


@functools.cache
def _each_host_named() -> type:
    """kombu's ``Connection`` whose ``ssl=`` names the host it connects to, so that over a list
    of URLs each broker's certificate is checked against its own name (per-node certificates;
    docs/destinations.md, "TLS to RabbitMQ"). kombu keeps one ``ssl=`` for the whole list: its
    ``switch`` to the next alternate (the publisher's ``maybe_switch_next``, kombu's own retry)
    sets the parameters again through ``_init_params``, and the name is set there each time."""
    from kombu import Connection

    class EachHostNamed(Connection):
        def _init_params(self, *args: Any, **kwargs: Any) -> None:
            super()._init_params(*args, **kwargs)
            if isinstance(self.ssl, dict):
                self.ssl = {**self.ssl, "server_hostname": self.hostname or "localhost"}

    return EachHostNamed


#: ``ssl_cert_reqs`` in kombu's and Celery's spellings (any case) and redis-py's, in redis-py's
#: words (redis-py refuses ``CERT_REQUIRED``: "Invalid SSL Certificate Requirements Flag").
REDIS_CERT_REQS = {"cert_required": "required", "cert_optional": "optional", "cert_none": "none",
                   "required": "required", "optional": "optional", "none": "none"}


def redis_cert_reqs(value: str, where: str) -> str:
    """``ssl_cert_reqs`` in redis-py's word (``REDIS_CERT_REQS``): the settings' check of a Redis
    URL and the relay's own Redis clients read it alike. A ConfigError naming ``where`` for one
    neither kombu nor redis-py reads."""
    try:
        return REDIS_CERT_REQS[value.lower()]
    except KeyError:
        raise ConfigError(f"{where}: ssl_cert_reqs={value!r}: give one of CERT_REQUIRED, CERT_OPTIONAL, CERT_NONE "
                          "(or required, optional, none)") from None


def redis_py_url(url: str) -> str:
    """``url`` (``redis://`` or ``rediss://``) as redis-py must read it to mean what kombu reads
    in it: ``ssl_cert_reqs=CERT_REQUIRED`` (kombu's and Celery's spelling) written ``required``.
    Every other parameter, ``ssl_ca_certs`` included, redis-py reads as kombu does."""
    base, sep, query = url.partition("?")
    if not sep:
        return url
    pieces = []
    for piece in query.split("&"):
        key, eq, value = piece.partition("=")
        if key == "ssl_cert_reqs" and value.lower() in REDIS_CERT_REQS:
            piece = f"{key}{eq}{REDIS_CERT_REQS[value.lower()]}"
        pieces.append(piece)
    return f"{base}?{'&'.join(pieces)}"


def _is_tls_key(key: str) -> bool:
    """A TLS parameter (``ssl_*``), or one written as py-amqp or pika name it (``ca_certs``,
    ``ssl``, ``ssl_options``): kombu passed those on as unknown keyword arguments, and a
    TypeError at every connect was the only word of it (found in review)."""
    lowered = key.lower()
    return (lowered.startswith("ssl") or lowered in {name.removeprefix("ssl_") for name in TLS_PARAMETERS}
            or lowered in {"cert_reqs", "keyfile", "certfile", "ca_certs", "cafile", "check_hostname"})


def _read(given: dict[str, str], setting: str, shown: str) -> AmqpTls:
    accepted = ", ".join(f"{name} ({what})" for name, what in TLS_PARAMETERS.items())
    for key in given:
        if key not in TLS_PARAMETERS:
            hint = ("; an encrypted client key cannot be used by py-amqp: decrypt it (openssl pkey) and keep the file "
                    "readable by the relay's user only" if "password" in key or "passphrase" in key else "")
            raise ConfigError(f"{setting}={shown}: unknown TLS parameter {key!r}{hint} (accepted: {accepted})")
    reqs = given.get("ssl_cert_reqs", "required").strip().lower()
    hostname = given.get("ssl_check_hostname", "true").strip().lower()
    if reqs not in _CERT_REQS:
        raise ConfigError(f"{setting}={shown}: ssl_cert_reqs={reqs!r}: expected required or none")
    if hostname not in _BOOLEANS:
        raise ConfigError(f"{setting}={shown}: ssl_check_hostname={hostname!r}: expected true or false")
    if given.get("ssl_keyfile") and not given.get("ssl_certfile"):
        raise ConfigError(f"{setting}={shown}: ssl_keyfile needs ssl_certfile (the client certificate)")
    return AmqpTls(ca_certs=given.get("ssl_ca_certs") or None, certfile=given.get("ssl_certfile") or None,
                   keyfile=given.get("ssl_keyfile") or None, verify=_CERT_REQS[reqs],
                   check_hostname=_BOOLEANS[hostname], server_hostname=given.get("ssl_server_hostname") or None)


__all__ = ["AmqpTls", "split_amqp_url", "check_url_tls", "refuse_kombu_url_tls", "check_redis_tls", "REDIS_TLS_PARAMETERS", "kombu_connection", "redis_py_url", "redis_cert_reqs", "REDIS_CERT_REQS",
           "TLS_PARAMETERS", "AMQP_TLS_SCHEMES", "AMQP_PLAIN_SCHEMES"]
