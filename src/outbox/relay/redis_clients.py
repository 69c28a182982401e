"""The relay's own redis-py clients on the task runner's Redis (the shared state, the wake, the
worker's wake subscriber, ``outbox check``), connected with the TLS options kombu's Redis
transport connects Celery's broker with: the URL's ``ssl_*`` parameters, else Celery's
``broker_use_ssl``, else for a bare ``rediss://`` kombu's unverified TLS. Why:
docs/relay.md, "Garbage in Celery's Redis broker", TLS.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from ..core.checks import take_query_parameters
from ..core.errors import ConfigError
from ..core.tls import redis_cert_reqs


def redis_connect_options(url: str, use_ssl: Any = None) -> tuple[str, dict[str, Any]]:
    """``url`` without its ``ssl_*`` parameters, and redis-py's keyword arguments for TLS (none:
    plain). The TLS options are the URL's ``ssl_*`` parameters when it has any, else ``use_ssl``
    (Celery's ``broker_use_ssl``), else for ``rediss://`` ``ssl_cert_reqs=CERT_NONE``: kombu's
    rules, so these clients connect as Celery's broker does. Raises ConfigError for an
    ``ssl_cert_reqs`` kombu would not read either. Of a list of URLs (``;``, kombu's failover)
    the first, with its own parameters: redis-py reads one URL, and read whole the list's tail
    was the value of the first URL's last parameter (``/ca.pem;rediss://...``, found in review)."""
    plain, options = _without_ssl_parameters(url.split(";", 1)[0].strip())
    if not options and use_ssl:
        options = dict(use_ssl) if isinstance(use_ssl, Mapping) else {}  # True: redis-py's defaults
    elif not options and url.startswith("rediss://"):
        options = {"ssl_cert_reqs": ssl.CERT_NONE}  # kombu's "insecure SSL behaviour"
    elif not options:
        return plain, {}
    import redis

    return plain, {"connection_class": redis.SSLConnection, **_as_redis_py(options)}


def _without_ssl_parameters(url: str) -> tuple[str, dict[str, Any]]:
    """The URL with its ``ssl_*`` query parameters taken out (the rest kept byte for byte), and
    those parameters decoded as kombu decodes them."""
    plain, taken = take_query_parameters(url, lambda key: key.startswith("ssl_"))
    return plain, dict(parse_qsl(taken))


def _as_redis_py(options: Mapping[str, Any]) -> dict[str, Any]:
    """kombu's TLS options in the types redis-py takes."""
    out = dict(options)
    reqs = out.get("ssl_cert_reqs")
    if isinstance(reqs, str):  # one table of spellings with Dramatiq's and the settings' (core.tls)
        out["ssl_cert_reqs"] = redis_cert_reqs(reqs, "Celery's Redis broker")
    if isinstance(out.get("ssl_check_hostname"), str):
        out["ssl_check_hostname"] = out["ssl_check_hostname"].lower() != "false"  # kombu's reading
    return out


def verifies(options: Mapping[str, Any]) -> bool:
    """Do redis-py's TLS ``options`` (``redis_connect_options``: ``ssl_cert_reqs`` already in
    redis-py's words) check the server's certificate? Not for ``none``, ``ssl.CERT_NONE`` or
    None; redis-py's default, ``required``, when ``ssl_cert_reqs`` is not given."""
    return options.get("ssl_cert_reqs", "required") not in (None, ssl.CERT_NONE, "none")


def broker_use_ssl(environ: Mapping[str, str] | None = None) -> Any:
    """Celery's ``broker_use_ssl`` as the relay's Celery app reads it (its configuration, else
    its config module: ``core.sources.app_setting``); with ``environ``, in the config module
    ``environ`` names (``outbox check`` of another environment). The one reader of it."""
    from ..core.sources import app_setting, module_setting

    return app_setting("broker_use_ssl") if environ is None else module_setting(environ, "broker_use_ssl")


def celery_use_ssl(url: str) -> Any:
    """Celery's ``broker_use_ssl`` (``broker_use_ssl``) when ``url`` is Celery's broker; None
    for any other URL (Dramatiq's Redis) or when it is unset."""
    use_ssl = broker_use_ssl()
    if not use_ssl:
        return None
    return use_ssl if url in _celery_broker_urls() else None


def _celery_broker_urls() -> set[str]:
    from ..core.config import relay_settings
    from ..core.sources import app_setting

    urls = {str(app_setting("broker_url") or "")}
    with contextlib.suppress(ConfigError):  # else the Celery configuration's URL alone
        urls.add(relay_settings().broker_url)
    return urls


def connect_redis(url: str, use_ssl: Any = None, **kwargs: Any) -> Any:
    """A redis-py client for ``url`` with ``use_ssl`` as Celery's ``broker_use_ssl``
    (``redis_connect_options``); ``kwargs``: redis-py's other options (time-outs)."""
    import redis

    plain, options = redis_connect_options(url, use_ssl)
    return redis.Redis.from_url(plain, **options, **kwargs)


def relay_redis(url: str, **kwargs: Any) -> Any:
    """The relay's redis-py client for the task runner's broker ``url``: Celery's
    ``broker_use_ssl`` applies when it is Celery's broker (``celery_use_ssl``)."""
    return connect_redis(url, celery_use_ssl(url), **kwargs)


__all__ = ["redis_connect_options", "verifies", "broker_use_ssl", "celery_use_ssl", "connect_redis", "relay_redis"]
