"""Masking secrets in anything the project prints or logs: the one helper for it.

Passwords reach text in three ways, and ``redact`` covers each:

* a URL with credentials, ``scheme://user:password@host/...``, quoted whole (a malformed
  setting echoed in an error, a connection error that names its target): the password
  part becomes ``***``;
* an ODBC connection string, ``...;PWD=secret;...`` (or ``Password=``), percent-encoded
  too (``?odbc_connect=...%3BPWD%3Dsecret%3B...``): the value becomes ``***``;
* a URL query's key that ends in ``password``, ``passphrase`` or ``secret``
  (``?ssl_password=...``, a TLS client key's passphrase): the value becomes ``***``;
* a fragment of a URL, quoted by a driver that could not parse it (libpq's
  ``invalid percent-encoded token: "s3cr%t@db/app"`` echoes only the part after the
  user name). No pattern finds those, so every password of a configured URL is
  *registered* (``register_url``, done by ``outbox.core.config`` for every URL setting it
  loads) and replaced wherever it appears, raw or percent-decoded, unless it could be an
  ordinary word or number (``bare_maskable``: a fragment quotes a password a driver could
  not parse, one with a symbol in it).

``RedactingFilter`` applies ``redact`` to every log record (message, arguments and
traceback) that passes the handler it is attached to; the relay's Celery app attaches it
to the worker's and beat's handlers (the application's own too, when it sets up their
logging itself), the CLI masks its error lines directly.

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from types import TracebackType
from urllib.parse import unquote, unquote_plus, urlsplit

MASK = "***"

#: ``scheme://user:password@`` (the user may be empty: ``redis://:pw@host``). The password
#: runs to the last ``@`` before the next whitespace: passwords may contain ``@``, ``:`` or
#: ``/`` when they are not percent-encoded, which is exactly the malformed case, and quotes
#: (libpq reads ``pa'ss``; a quote-free pattern printed it in clear: found in review), nor
#: past the ``;`` before the next URL of a failover list (it once swallowed every broker of
#: the list but the last). A password with a space is left to the registered secrets
#: (``register_url``): no pattern tells where it ends.
_URL_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*:/{0,3}[^\s:/@'\"]*:)"
                              r"(?P<secret>(?:(?!;[A-Za-z][A-Za-z0-9+.\-]*://)\S)*)@")
_SPACES = re.compile(r"(\s+)")
#: ``PWD=...;`` / ``Password=...`` in ODBC connection strings (``{...}`` quoting included),
#: and ``password=`` / ``sslpassword=`` in a URL's query (libpq takes both there; the value
#: then runs to the end of the query).
_ODBC_PASSWORD = re.compile(r"(?i)(?P<head>\b(?:pwd|password|sslpassword)\s*=\s*)(?P<secret>\{[^}]*\}|[^;'\"\s]*)")
#: The same inside a percent-encoded ODBC string, ``?odbc_connect=...%3BPWD%3Dsecret%3B...``
#: (docs/sqlserver.md, "Drivers"): ``%3D`` for ``=``, the value running to ``%3B`` (``;``),
#: ``&`` or the end, ``%7B...%7D`` (``{...}``) quoting included.
#: A URL query's key that ends in ``password``, ``passphrase`` or ``secret`` (kombu's and
#: redis-py's ``ssl_password=``, a client key's passphrase: printed in clear by ``outbox check``,
#: found in review), its value running to the next ``&`` or ``;``.
_QUERY_SECRET = re.compile(r"(?i)(?P<head>\b[\w.\-]*(?:password|passphrase|secret)=)(?P<secret>[^&;'\"\s]*)")
_ENCODED_ODBC_PASSWORD = re.compile(r"(?i)(?P<head>(?:\b|(?<=%3B))(?:pwd|password)(?:\s|\+|%20)*%3D)"
                                    r"(?P<secret>%7B.*?%7D|(?:(?!%3B)[^;&'\"\s])*)")

_lock = threading.Lock()
_secrets: set[str] = set()


def _url_passwords(url: str) -> list[str]:
    found = [m.group("secret") for m in _URL_CREDENTIALS.finditer(url)]
    found += _parsed_passwords(url)
    found += [m.group("secret").strip("{}") for m in _ODBC_PASSWORD.finditer(url)]
    for match in _QUERY_SECRET.finditer(url):  # as written, and as a query parser decodes it
        found += [match.group("secret"), unquote_plus(match.group("secret"))]
    for match in _ENCODED_ODBC_PASSWORD.finditer(url):
        # ?odbc_connect=: the password as written, and as the driver gets it (decoded)
        found.append(re.sub(r"(?i)^%7B(.*)%7D$", r"\1", match.group("secret")))
        decoded = _ODBC_PASSWORD.search(unquote_plus(match.group(0)))
        if decoded:
            found.append(decoded.group("secret").strip("{}"))
    return found


def _parsed_passwords(url: str) -> list[str]:
    """The password as a URL parser reads it, whatever it holds (a quote, a space): of the
    whole value, and of each of Celery's alternate URLs (``amqp://a//;amqp://b//``)."""
    found = []
    for candidate in {url, *url.split(";")}:
        if "://" not in candidate:
            continue
        try:
            password = urlsplit(candidate.strip()).password
        except ValueError:  # an unreadable port: check_host_part refuses the URL, masked
            continue
        if password:
            found.append(password)
    return found


def register_url(url: str | None) -> None:
    """Remember the password of ``url`` (a URL or an ODBC string, percent-encoded in
    ``?odbc_connect=`` too), so that it is masked wherever it shows up later, even in a
    fragment no pattern recognises."""
    if not url:
        return
    for secret in _url_passwords(str(url)):
        register_secret(secret)


#: A registered password is masked as a bare value (wherever it appears, no pattern around
#: it) only when it cannot be an ordinary word or number: this long, or holding a character
#: besides letters and digits. The patterns mask every password in a URL, an ODBC string or a
#: ``password=`` whatever its length (docs/relay.md, "Secrets in output").
MIN_BARE_SECRET = 8
#: Shorter than this, not even one with a symbol (``a@``): it would mask innocent text everywhere.
MIN_SYMBOL_SECRET = 4


def bare_maskable(secret: str) -> bool:
    """Is ``secret`` masked wherever it appears as it is? Not a short run of letters and digits
    (a database password ``poison`` turned every poison row's reason into ``***: ...``: found
    in review), not anything very short."""
    return len(secret) >= MIN_BARE_SECRET or (len(secret) >= MIN_SYMBOL_SECRET and not secret.isalnum())


def register_secret(secret: str) -> None:
    candidates = {secret, unquote(secret)}
    with _lock:
        _secrets.update(s for s in candidates if bare_maskable(s))


def redact(text: object) -> str:
    """``text`` with every password masked: URL credentials, ODBC passwords, and every
    registered secret (raw or percent-decoded)."""
    result = str(text)
    # Run by run of non-spaces with an "@" (a match lies within one): on a whole line the
    # pattern took quadratic time (found in review; docs/relay.md, "Secrets in output").
    result = "".join(_URL_CREDENTIALS.sub(lambda m: m.group("head") + MASK + "@", part) if "@" in part else part
                     for part in _SPACES.split(result))
    result = _ODBC_PASSWORD.sub(lambda m: m.group("head") + MASK, result)
    result = _ENCODED_ODBC_PASSWORD.sub(lambda m: m.group("head") + MASK, result)
    result = _QUERY_SECRET.sub(lambda m: m.group("head") + MASK, result)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        if secret in result:
            result = result.replace(secret, MASK)
    return result


def redact_error(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, passwords masked (``redact``): how an error's text goes into
    a log line, a row's reason or a task's result."""
    return redact(f"{type(exc).__name__}: {exc}")


#: C0 and C1 control characters and DEL: a newline, a tab, ESC (which starts a terminal's
#: escape sequences), a BEL.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``text`` with every control character written as its Python escape (``\\n``,
    ``\\x1b``): an event's own fields (topic, aggregate id, last error, the application's data)
    on a terminal or in a log line, where they could otherwise forge a line or send an escape
    sequence (docs/relay.md, "Secrets in output")."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


class RedactingFilter(logging.Filter):
    """Masks secrets in a record before a handler formats it: the message with its
    arguments, and the traceback text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: let logging report it as usual
            return True
        clean = redact(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_filter(logger: logging.Logger | None = None) -> None:
    """Attach one ``RedactingFilter`` to every handler of ``logger`` (default: the root
    logger), once per handler."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def install_filter_everywhere() -> None:
    """``install_filter`` on the root logger and on every other logger with handlers of its own:
    an application's logging configuration may attach them anywhere (``dictConfig``)."""
    install_filter()
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.handlers:
            install_filter(logger)


def _masked_excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def mask_uncaught() -> None:
    """An exception that ends the process is printed to stderr masked: where logging does not
    take stderr over (Celery does, unless the application sets up its logging itself)."""
    sys.excepthook = _masked_excepthook


__all__ = ["redact", "redact_error", "printable", "register_url", "register_secret", "bare_maskable", "RedactingFilter",
           "install_filter", "install_filter_everywhere", "mask_uncaught", "MASK"]
