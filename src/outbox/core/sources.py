"""Where settings come from, and what was read from them: the Celery app's OUTBOX_* config
keys (registered by ``outbox.celery.application`` with ``use_conf``; before that, and in
processes without the app, the CELERY_CONFIG_MODULE module's), the environment, Django's
settings; and the one per-process cache of what was read (``cached``; ``reset`` empties it).
The order itself is built in ``outbox.core.config.current_sources`` (docs/design.md, "Settings")."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote

from .checks import MYSQL_TLS_PARAMETERS
from .errors import ConfigError, install_hint
from .names import NAMESPACE_HOST

log = logging.getLogger("outbox.core.config")

#: Returns the Celery app's configuration (a mapping); registered by ``outbox.celery.application``.
_conf_source: Callable[[], Mapping[str, Any]] | None = None


def use_conf(source: Callable[[], Mapping[str, Any]] | None) -> None:
    """Register where the relay's Celery config keys come from (``outbox.celery.application`` does);
    what was read before is forgotten."""
    global _conf_source
    with _lock:
        _conf_source = source
        _cache.clear()


def conf_keys() -> dict[str, Any]:
    """OUTBOX_* keys present in the registered Celery configuration, else in the module
    CELERY_CONFIG_MODULE names (``module_keys``): the same keys whether or not this process
    has imported the Celery app yet."""
    source = _conf_source
    if source is None:
        return module_keys(os.environ)
    return _outbox_keys(source())


def module_keys(environ: Mapping[str, str]) -> dict[str, Any]:
    """OUTBOX_* names of the module ``environ``'s CELERY_CONFIG_MODULE names (`celery --config`
    sets it), imported as Celery's loader imports it (the current directory first); {} when it
    is unset. Every process reads it, not only one that has imported the Celery app: a writer's
    first enqueue and the `outbox` CLI read the keys the worker reads (docs/design.md, "Settings")."""
    return _outbox_keys(_module_conf(environ))


def module_setting(environ: Mapping[str, str], key: str) -> Any:
    """The CELERY_CONFIG_MODULE module's Celery setting ``key`` (or its old upper-case
    name), or None: what a worker's Celery app reads there, for a command that runs
    without the app (``outbox migrate`` and the queue tables' ``broker_transport_options``)."""
    return celery_setting(_module_conf(environ), key)


def app_setting(key: str) -> Any:
    """Celery's setting ``key`` as the relay's Celery app reads it: in the registered
    configuration (``use_conf``), else in the CELERY_CONFIG_MODULE module (``module_setting``),
    as ``conf_keys`` reads the OUTBOX_* keys; None when unset."""
    source = _conf_source
    return module_setting(os.environ, key) if source is None else celery_setting(source(), key)


def celery_setting(conf: Mapping[str, Any], key: str) -> Any:
    """Celery's setting ``key`` in ``conf``, under its name or its old upper-case one, or None."""
    value = conf.get(key)
    return conf.get(key.upper()) if value is None else value


def _module_conf(environ: Mapping[str, str]) -> dict[str, Any]:
    """The names of the module ``environ``'s CELERY_CONFIG_MODULE names, or {}."""
    name = environ.get("CELERY_CONFIG_MODULE")
    if not name:
        return {}
    from celery.utils.imports import import_from_cwd

    try:
        module = import_from_cwd(name)
    except Exception as exc:  # noqa: BLE001 - any failure of a module written for the workers
        # Not importable here (it lives beside the workers), or it fails here (it reads a
        # variable only the workers have): this process reads no key of it, and says so
        # once. A writer whose enqueue raised for it stopped working where it had worked
        # before, its keys then the workers' only (found in review). Celery itself imports
        # it in a worker or beat, which fails there as before.
        _unimportable(name, f"{type(exc).__name__}: {exc}")
        return {}
    return {key: getattr(module, key) for key in dir(module) if not key.startswith("__")}


@functools.lru_cache(maxsize=8)
def _unimportable(name: str, error: str) -> None:
    log.warning("outbox: CELERY_CONFIG_MODULE=%r cannot be imported in this process (%s): its OUTBOX_* keys are "
                "not read here, and this process's settings may differ from the workers'", name, error)


def _outbox_keys(conf: Mapping[str, Any]) -> dict[str, Any]:
    return {key: conf[key] for key in list(conf.keys()) if isinstance(key, str) and key.startswith("OUTBOX_")}


#: The one cache of what was read, by key (the sources, then each option family).
_cache: dict[Any, Any] = {}
_lock = threading.RLock()


def cached(key: Any, build: Callable[[], Any]) -> Any:
    """What ``build`` returned the first time ``key`` was asked for in this process."""
    with _lock:
        if key not in _cache:
            _cache[key] = build()
        return _cache[key]


def reset() -> None:
    """Forget everything read (tests, and processes that change their environment)."""
    with _lock:
        _cache.clear()


def django_settings(names: Iterable[str]) -> Mapping[str, Any]:
    """The settings ``names`` from Django's settings: in a Django process, and also in `outbox ...` and
    `celery -A outbox ...` when DJANGO_SETTINGS_MODULE is set (the settings module is then
    imported; the relay does not set Django up, though Celery's Django fixup does in `celery -A
    outbox worker|beat`). Without OUTBOX_DATABASE_URL there, the URL is
    derived from the settings module's ``DATABASES["default"]``, so the relay uses the
    project's database."""
    try:
        from django.conf import settings as dj
    except ImportError:
        if os.environ.get("DJANGO_SETTINGS_MODULE"):
            _warn_once("DJANGO_SETTINGS_MODULE is set but Django is not installed: its settings are not read "
                       f"({install_hint('django')})")
        return {}
    try:
        if not dj.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
            return {}
        values = {name: getattr(dj, name) for name in names if hasattr(dj, name)}
        databases = getattr(dj, "DATABASES", None) or {}
    except ImportError as exc:  # DJANGO_SETTINGS_MODULE names a module that does not import
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={os.environ.get('DJANGO_SETTINGS_MODULE')!r} cannot be "
                          f"imported: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the settings module raised while it was loaded
        module = os.environ.get("DJANGO_SETTINGS_MODULE")
        if not module:  # settings.configure() by hand, and they fail: not our configuration source
            return {}
        # Ignored, the relay would fall back to ./outbox.db and its other defaults.
        detail = " ".join(str(exc).split())
        raise ConfigError(f"DJANGO_SETTINGS_MODULE={module!r} cannot be loaded: {type(exc).__name__}"
                          + (f": {detail}" if detail else "")) from None
    # Only for a project's settings module: a process that calls settings.configure() by
    # hand (scripts, tests) keeps the relay's own default unless it sets OUTBOX_DATABASE_URL.
    if not values.get("OUTBOX_DATABASE_URL") and "default" in databases and getattr(dj, "SETTINGS_MODULE", None):
        values["OUTBOX_DATABASE_URL"] = django_database_url(databases["default"])
    return values


def django_outbox_names() -> tuple[str, ...]:
    """Every OUTBOX_* name Django's settings define, read and unread (``outbox.core.config``
    warns about those nothing reads): none where ``django_settings`` reads none, or raises."""
    try:
        from django.conf import settings as dj
    except ImportError:
        return ()
    try:
        if not dj.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
            return ()
        return tuple(name for name in dir(dj) if name.startswith("OUTBOX_"))
    except Exception:  # noqa: BLE001 - django_settings raises the error of these same settings
        return ()


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("outbox: %s", message)


#: Django ENGINE (its last dotted part) -> URL scheme of OUTBOX_DATABASE_URL.
_DJANGO_SCHEMES = {"sqlite3": "sqlite", "postgresql": "postgresql", "postgresql_psycopg2": "postgresql",
                   "postgis": "postgresql", "mysql": "mysql", "mssql": "mssql+pyodbc"}


#: Django OPTIONS carried into the URL: libpq's connection parameters (``libpq_keywords``;
#: psycopg's OPTIONS are those), and MySQL's the relay's driver reads; Django's own keys are not.
#: The ones Django sets from USER, PASSWORD, NAME, HOST and PORT come from those when set.
_DJANGO_CONNECTION = {"user": "USER", "password": "PASSWORD", "dbname": "NAME", "host": "HOST", "port": "PORT"}


@functools.lru_cache(maxsize=1)
def libpq_keywords() -> tuple[str, ...]:
    """Every connection keyword of the libpq psycopg runs on (``PQconndefaults``), so that
    each one Django passes reaches the relay too: a hand-written list dropped sslcrl,
    sslcertmode, ssl_min_protocol_version, require_auth... (found in review). Without
    psycopg, none: the relay's PostgreSQL engine cannot run there either."""
    try:
        from psycopg import pq
    except ImportError:
        return ()
    return tuple(option.keyword.decode() for option in pq.Conninfo.get_defaults())


_MYSQL_OPTIONS = ("unix_socket", "charset", *MYSQL_TLS_PARAMETERS)
#: Django's MySQL ``OPTIONS["ssl"]`` (mysqlclient's keys, and PyMySQL's where it stands in for
#: mysqlclient) -> the URL's TLS parameter (docs/relay.md, "TLS to the database").
_MYSQL_SSL_KEYS = {"ca": "ssl_ca", "capath": "ssl_capath", "cert": "ssl_cert", "key": "ssl_key",
                   "password": "ssl_key_password", "cipher": "ssl_cipher", "check_hostname": "ssl_verify_identity",
                   "verify_mode": "ssl_verify_cert"}


def _option_text(value: Any) -> str | None:
    """An OPTIONS value as URL text: a string or a number as written, a flag as true or
    false; None for anything else (not a connection parameter)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (str, int)) else None


def _mysql_ssl(ssl: Any) -> list[tuple[str, str]]:
    """Django's MySQL ``OPTIONS["ssl"]`` as the URL's TLS parameters. A key the relay cannot
    carry is a ``ConfigError``: dropped, the relay would connect without what Django asked for."""
    if not isinstance(ssl, Mapping):
        return []
    unknown = sorted(str(key) for key in ssl if key not in _MYSQL_SSL_KEYS)
    if unknown:
        raise ConfigError(f"DATABASES OPTIONS['ssl']: the relay cannot carry {', '.join(unknown)} "
                          f"(accepted: {', '.join(_MYSQL_SSL_KEYS)}); set OUTBOX_DATABASE_URL instead")
    carried = []
    for key, value in ssl.items():
        if key == "verify_mode" and not isinstance(value, (bool, str)):  # ssl.CERT_NONE, CERT_REQUIRED...
            value = int(value) != 0
        elif key == "verify_mode":
            value = str(value).strip().lower() not in ("none", "cert_none", "0", "false", "no", "off")
        text = _option_text(value)
        if text is not None:
            carried.append((_MYSQL_SSL_KEYS[key], text))
    return carried


def django_database_url(database: Mapping[str, Any]) -> str | None:
    """OUTBOX_DATABASE_URL for one entry of Django's DATABASES, or None for an engine the
    relay does not support (then the default applies, as without Django)."""
    engine = str(database.get("ENGINE") or "")
    scheme = _DJANGO_SCHEMES.get(engine.rsplit(".", 1)[-1])
    if scheme is None:
        return None
    name = str(database.get("NAME") or "")
    if scheme == "sqlite":
        return f"sqlite:///{name}" if name else None
    user, password = str(database.get("USER") or ""), str(database.get("PASSWORD") or "")
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "") + ("@" if user else "")
    host, port = str(database.get("HOST") or ""), str(database.get("PORT") or "")
    options = database.get("OPTIONS") or {}
    # Where Django connects, the relay connects (found in review: a socket directory as HOST
    # became part of the database name, an empty HOST meant TCP to 127.0.0.1 where Django
    # used the socket, an IPv6 address lost its brackets, OPTIONS were dropped).
    query: list[tuple[str, str]] = []
    if host.startswith("/"):  # a Unix socket: PostgreSQL's directory, MySQL's file
        query.append(("host" if scheme == "postgresql" else "unix_socket", host))
        host = "" if scheme == "postgresql" else "localhost"
    elif not host:  # libpq's default is the socket (or PGHOST), as Django's; MySQL's drivers differ: TCP
        host = "" if scheme == "postgresql" else "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    if scheme == "postgresql":
        carried: tuple[str, ...] = tuple(key for key in libpq_keywords()
                                         if not database.get(_DJANGO_CONNECTION.get(key, "")))
    else:
        carried = _MYSQL_OPTIONS if scheme == "mysql" else ()
    for key in carried:
        if isinstance(options.get(key), (str, int)) and not isinstance(options.get(key), bool):
            query.append((key, str(options[key])))
        elif scheme == "mysql" and isinstance(options.get(key), bool):  # PyMySQL's ssl_disabled=True...
            query.append((key, _option_text(options[key]) or ""))
    if scheme == "mysql":
        query += _mysql_ssl(options.get("ssl"))
    if scheme == "postgresql" and not database.get("HOST") and not {"host", "hostaddr", "service"} & dict(query).keys():
        # Releases wrote an empty HOST as 127.0.0.1: that host still names the namespace, and
        # only that (names.NAMESPACE_HOST; found in the upgrade review: the queues changed).
        query.append((NAMESPACE_HOST, "127.0.0.1"))
    url = f"{scheme}://{auth}{host}{':' + port if port else ''}/{quote(name, safe='')}"
    if query:
        url += "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query)
    if scheme.startswith("mssql"):  # mssql-django: OPTIONS driver and extra_params ("k=v;k=v")
        query = [("driver", str(options.get("driver") or "ODBC Driver 18 for SQL Server"))]
        for item in str(options.get("extra_params") or "").split(";"):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                query.append((key.strip(), value.strip()))
        url += "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query)
    return url



__all__ = ["use_conf", "conf_keys", "module_keys", "module_setting", "app_setting", "celery_setting", "cached", "reset", "django_settings", "django_outbox_names", "django_database_url"]
