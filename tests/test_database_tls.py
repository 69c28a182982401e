"""TLS to the database (docs/relay.md, "TLS to the database"): what a database URL's TLS
parameters, or Django's OPTIONS, become for the driver. MySQL/MariaDB: PyMySQL's ``ssl``
context, a refusal of any parameter the relay does not read, and a server without TLS
refused when TLS is asked for (the shared MariaDB has TLS off: ``have_ssl`` DISABLED; with
it on, the session is checked to be encrypted instead)."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import MYSQL_URL, POSTGRES_URL, require
from tls_support import Pki

from outbox.core.config import django_database_url, load_settings
from outbox.core.errors import ConfigError
from outbox.storage.engines.mysql import MysqlEngine, pymysql_kwargs

MY = "mysql://app:secret@db.example:3306/app"


@pytest.fixture(scope="module")
def ca_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A throwaway CA and a client certificate it signed (``tls_support.Pki``)."""
    pki = Pki(tmp_path_factory.mktemp("db-tls"))
    cert, key = pki.issue("client", "relay.example")
    yield {"ca": str(pki.ca_file), "cert": str(cert), "key": str(key)}


def mysql_server() -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(MYSQL_URL)
    require("MySQL/MariaDB", parts.hostname or "127.0.0.1", parts.port or 3306)
    return parts.hostname or "127.0.0.1", parts.port or 3306


def server_has_tls() -> bool:
    import pymysql

    conn = pymysql.connect(**pymysql_kwargs(MYSQL_URL))
    try:
        with conn.cursor() as cursor:
            cursor.execute("SHOW VARIABLES LIKE 'have_ssl'")
            row = cursor.fetchone()
    finally:
        conn.close()
    return bool(row) and str(row[1]).upper() == "YES"


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


# -- MySQL/MariaDB: the URL's TLS parameters reach PyMySQL ------------------------------------

def test_a_mysql_ca_that_cannot_be_read_fails_the_connect_instead_of_connecting_in_cleartext() -> None:
    """Found in review: ``ssl_ca`` was dropped, and the relay connected in cleartext."""
    mysql_server()
    with pytest.raises(ConfigError, match=r"OUTBOX_DATABASE_URL: ssl_ca='/nonexistent/ca.pem' cannot be used"):
        MysqlEngine().connect(with_query(MYSQL_URL, "ssl_ca=/nonexistent/ca.pem"))


@pytest.mark.parametrize("query", ["ssl_mode=REQUIRED", "ssl_mode=VERIFY_IDENTITY&ssl_ca={ca}",
                                   "ssl_ca={ca}&ssl_cert={cert}&ssl_key={key}"])
def test_mysql_tls_asked_for_is_tls_or_no_connection(query: str, ca_files: dict[str, str]) -> None:
    """Against a server without TLS the connect fails (CR_SSL_CONNECTION_ERROR, 2026) before
    the login is sent; with TLS, the session is encrypted."""
    import pymysql

    mysql_server()
    url = with_query(MYSQL_URL, query.format(**ca_files))
    if server_has_tls():
        if "ca=" in query:
            pytest.skip("the server's certificate is not signed by the test's CA")
        conn = MysqlEngine().connect(url)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                assert cursor.fetchone()[1]
        finally:
            conn.close()
        return
    with pytest.raises(pymysql.err.OperationalError) as info:
        MysqlEngine().connect(url)
    assert info.value.args[0] == 2026 and "SSL is required" in str(info.value)


def test_mysql_tls_disabled_connects_without_tls() -> None:
    mysql_server()
    for query in ("ssl_mode=DISABLED", "ssl_disabled=true"):
        conn = MysqlEngine().connect(with_query(MYSQL_URL, query))
        try:
            with conn.cursor() as cursor:
                cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                assert cursor.fetchone()[1] == ""
        finally:
            conn.close()


def context(query: str) -> ssl.SSLContext:
    ctx = pymysql_kwargs(f"{MY}?{query}")["ssl"]
    assert isinstance(ctx, ssl.SSLContext)
    return ctx


def test_mysql_tls_modes_set_the_certificate_and_host_checks(ca_files: dict[str, str]) -> None:
    ca = ca_files["ca"]
    checks = {query: (context(query.format(ca=ca)).verify_mode, context(query.format(ca=ca)).check_hostname)
              for query in ("ssl_mode=REQUIRED", "ssl_mode=VERIFY_CA&ssl_ca={ca}", "ssl_mode=VERIFY_IDENTITY&ssl_ca={ca}",
                            "ssl_ca={ca}", "ssl_ca={ca}&ssl_verify_identity=false", "ssl_ca={ca}&ssl_verify_cert=false",
                            "ssl_mode=REQUIRED&ssl_verify_identity=true", "ssl_verify_cert=true")}
    assert checks == {
        "ssl_mode=REQUIRED": (ssl.CERT_NONE, False),
        "ssl_mode=VERIFY_CA&ssl_ca={ca}": (ssl.CERT_REQUIRED, False),
        "ssl_mode=VERIFY_IDENTITY&ssl_ca={ca}": (ssl.CERT_REQUIRED, True),
        "ssl_ca={ca}": (ssl.CERT_REQUIRED, True),  # PyMySQL's rule: a CA checks the certificate and the host
        "ssl_ca={ca}&ssl_verify_identity=false": (ssl.CERT_REQUIRED, False),
        "ssl_ca={ca}&ssl_verify_cert=false": (ssl.CERT_NONE, False),
        "ssl_mode=REQUIRED&ssl_verify_identity=true": (ssl.CERT_REQUIRED, True),
        "ssl_verify_cert=true": (ssl.CERT_REQUIRED, False),  # the system's CAs
    }
    assert "ssl" not in pymysql_kwargs(MY) and "ssl_disabled" not in pymysql_kwargs(MY)  # PyMySQL's default
    assert pymysql_kwargs(f"{MY}?ssl_mode=DISABLED")["ssl_disabled"] is True
    assert "ssl" not in pymysql_kwargs(f"{MY}?ssl_mode=preferred")


def test_a_mysql_client_key_with_a_passphrase_is_loaded(ca_files: dict[str, str], tmp_path: Path) -> None:
    """``ssl_key_password`` keeps a ``+`` (decoded as libpq decodes: ``%XX`` only)."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    cert = trustme.CA().issue_cert("relay.example")
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), password=None)
    (tmp_path / "client.pem").write_bytes(cert.cert_chain_pems[0].bytes())
    (tmp_path / "client.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"Ab+9/x=")))
    files = f"ssl_cert={tmp_path / 'client.pem'}&ssl_key={tmp_path / 'client.key'}"
    assert context(f"ssl_mode=REQUIRED&{files}&ssl_key_password=Ab+9%2Fx%3D")
    with pytest.raises(ConfigError, match=r"OUTBOX_DATABASE_URL: ssl_cert='.*client.pem' ssl_key="):
        context(f"ssl_mode=REQUIRED&{files}&ssl_key_password=Ab%209%2Fx%3D")


def test_sqlalchemys_ssl_check_hostname_is_read_as_ssl_verify_identity(ca_files: dict[str, str]) -> None:
    """SQLAlchemy's pymysql dialect documents ``ssl_check_hostname`` (its example:
    ``mysql+pymysql://...?ssl_ca=/ca.pem&ssl_check_hostname=false``), and a Flask/SQLAlchemy app
    sharing its URL with the relay carries it. Found in review: the relay refused it and stopped."""
    ca = ca_files["ca"]
    url = f"mysql+pymysql://u:p@db.example/app?ssl_ca={ca}&ssl_check_hostname=false"
    assert load_settings(environ={"OUTBOX_DATABASE_URL": url}).database_url == url
    unchecked = pymysql_kwargs(url)["ssl"]
    assert (unchecked.verify_mode, unchecked.check_hostname) == (ssl.CERT_REQUIRED, False)
    checked = context("ssl_mode=REQUIRED&ssl_check_hostname=true")
    assert (checked.verify_mode, checked.check_hostname) == (ssl.CERT_REQUIRED, True)
    # Said twice, the same way: fine; two ways: a contradiction.
    assert context(f"ssl_ca={ca}&ssl_check_hostname=false&ssl_verify_identity=off").check_hostname is False
    with pytest.raises(ConfigError, match="ssl_check_hostname=false contradicts ssl_verify_identity=true"):
        context(f"ssl_ca={ca}&ssl_check_hostname=false&ssl_verify_identity=true")
    with pytest.raises(ConfigError, match="ssl_check_hostname=false contradicts ssl_mode=VERIFY_IDENTITY"):
        context(f"ssl_mode=VERIFY_IDENTITY&ssl_ca={ca}&ssl_check_hostname=false")
    with pytest.raises(ConfigError, match="ssl_check_hostname='maybe' is not true or false"):
        context(f"ssl_ca={ca}&ssl_check_hostname=maybe")
    from outbox.pipeline.fetch import MysqlFetch
    from outbox.storage.engines import engine_for_url

    alone = f"{MY}?ssl_check_hostname=true"  # TLS asked for: read through PyMySQL in the pipeline
    assert not MysqlFetch(alone, engine_for_url(alone)).usable()


def test_a_mysql_key_passphrase_is_masked() -> None:
    from outbox.core.redact import redact

    url = f"{MY}?ssl_mode=REQUIRED&ssl_cert=/c.pem&ssl_key=/c.key&ssl_key_password=Key%2BPass%2F42"
    load_settings(environ={"OUTBOX_DATABASE_URL": url})
    shown = redact(f"cannot connect to {url}: key Key+Pass/42 refused")
    assert "Key%2BPass%2F42" not in shown and "Key+Pass/42" not in shown


@pytest.mark.parametrize("query, problem", [
    ("ssl_verify=true", "unknown MySQL/MariaDB URL parameter ssl_verify (accepted: charset, unix_socket, "
                        "read_timeout, write_timeout, ssl_mode, ssl_disabled, ssl_ca, ssl_capath, ssl_cert, ssl_key, "
                        "ssl_key_password, ssl_cipher, ssl_verify_cert, ssl_verify_identity, "
                        "ssl_check_hostname, idle_transaction_timeout_s, tcp_timeout_s)"),
    ("sslmode=require", "unknown MySQL/MariaDB URL parameter sslmode (accepted: "),
    ("ssl_mode=ON", "ssl_mode='ON': expected one of DISABLED, PREFERRED, REQUIRED, VERIFY_CA, VERIFY_IDENTITY"),
    ("ssl_mode=DISABLED&ssl_ca=/ca.pem", "ssl_ca with TLS disabled"),
    ("ssl_disabled=true&ssl_mode=REQUIRED", "ssl_disabled=true contradicts ssl_mode=REQUIRED"),
    ("ssl_mode=VERIFY_CA&ssl_verify_cert=false", "ssl_verify_cert=false contradicts ssl_mode=VERIFY_CA"),
    ("ssl_verify_identity=true&ssl_verify_cert=false", "ssl_verify_identity=true needs the certificate checked"),
    ("ssl_verify_cert=maybe", "ssl_verify_cert='maybe' is not true or false"),
    ("ssl_mode=REQUIRED&ssl_key=/k.pem", "ssl_key and ssl_key_password need ssl_cert"),
])
def test_a_mysql_url_parameter_the_relay_does_not_read_stops_start_up(query: str, problem: str) -> None:
    """Found in review: any other parameter was dropped, a misspelt TLS one with it."""
    for scheme in ("mysql", "mariadb"):
        with pytest.raises(ConfigError) as info:
            load_settings(environ={"OUTBOX_DATABASE_URL": f"{scheme}://root@db/app?{query}"})
        assert str(info.value).startswith(f"OUTBOX_DATABASE_URL: {problem}")


def test_a_mysql_url_parameter_of_no_tls_the_relay_does_not_read_is_ignored_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not refused, as a misspelt TLS parameter is: such a parameter was always ignored, and
    refusing it now would stop, at an upgrade, a deployment whose URL carried one."""
    url = "mysql://root@db/app?connect_timeout=5&charset=utf8mb4"
    with caplog.at_level(logging.WARNING, logger="outbox.config"):
        assert load_settings(environ={"OUTBOX_DATABASE_URL": url}).database_url == url
        load_settings(environ={"OUTBOX_DATABASE_URL": url})
    said = [r.getMessage() for r in caplog.records if "connect_timeout" in r.getMessage()]
    assert len(said) == 1 and "is ignored" in said[0], said


def test_mysql_tls_reads_through_pymysql_in_the_pipeline() -> None:
    """connectorx's URL carries no TLS file: a URL asking for TLS reads through the driver."""
    from outbox.pipeline.fetch import MysqlFetch
    from outbox.storage.engines import engine_for_url

    def usable(url: str) -> bool:
        return MysqlFetch(url, engine_for_url(url)).usable()

    assert usable(MY) and usable(f"{MY}?ssl_mode=DISABLED&tcp_timeout_s=5")
    for query in ("ssl_mode=REQUIRED", "ssl_ca=/ca.pem", "ssl_mode=PREFERRED", "ssl_verify_cert=true"):
        assert not usable(f"{MY}?{query}"), query


def test_django_mysql_ssl_options_are_carried() -> None:
    """Found in review: ``OPTIONS["ssl"]`` and ``ssl_mode`` were dropped."""
    database = {"ENGINE": "django.db.backends.mysql", "NAME": "app", "USER": "u", "PASSWORD": "p",
                "HOST": "db.example", "PORT": "3306",
                "OPTIONS": {"charset": "utf8mb4", "ssl_mode": "VERIFY_IDENTITY", "isolation_level": "read committed",
                            "ssl": {"ca": "/etc/ca.pem", "cert": "/etc/c.pem", "key": "/etc/c.key",
                                    "check_hostname": True, "verify_mode": ssl.CERT_REQUIRED}}}
    url = django_database_url(database)
    assert url == ("mysql://u:p@db.example:3306/app?charset=utf8mb4&ssl_mode=VERIFY_IDENTITY&ssl_ca=%2Fetc%2Fca.pem"
                   "&ssl_cert=%2Fetc%2Fc.pem&ssl_key=%2Fetc%2Fc.key&ssl_verify_identity=true&ssl_verify_cert=true")
    assert load_settings(environ={"OUTBOX_DATABASE_URL": url}).database_url == url
    with pytest.raises(ConfigError, match=r"OPTIONS\['ssl'\]: the relay cannot carry crl \(accepted: ca, capath"):
        django_database_url({**database, "OPTIONS": {"ssl": {"ca": "/etc/ca.pem", "crl": "/etc/crl.pem"}}})


# -- PostgreSQL: every libpq parameter reaches psycopg as written ------------------------------

PG = "postgresql://app:secret@db.example:5432/app"


@pytest.fixture
def psycopg_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The conninfo each ``psycopg.connect`` is handed (no connection is made)."""
    import psycopg

    calls: list[dict[str, object]] = []

    def connect(*args: object, **kwargs: object) -> None:
        calls.append(dict(psycopg.conninfo.conninfo_to_dict(*args, **kwargs)))
        raise psycopg.OperationalError("stubbed: no connection")

    monkeypatch.setattr(psycopg, "connect", connect)
    return calls


def handed_to_psycopg(url: str, calls: list[dict[str, object]]) -> dict[str, object]:
    import psycopg

    from outbox.storage.engines.postgres import PostgresEngine

    with pytest.raises(psycopg.OperationalError, match="stubbed"):
        PostgresEngine().connect(url)
    return calls.pop()


def test_a_session_bound_leaves_every_other_libpq_parameter_byte_for_byte(
        psycopg_calls: list[dict[str, object]]) -> None:
    """Found in review: with a session bound in the URL the query was decoded and encoded
    again (``parse_qsl``), and a ``+`` became a space: sslpassword ``Ab+9/x=`` reached libpq
    as ``Ab 9/x=``. libpq decodes ``%XX`` only."""
    from outbox.core.config import without_session_bounds
    from outbox.pipeline.fetch import PostgresFetch
    from outbox.storage.engines import engine_for_url

    query = "sslpassword=Ab+9%2Fx%3D&sslrootcert=/etc/pg/ca+1.pem&password=p+w&application_name=a%20b+c"
    expected = {"sslpassword": "Ab+9/x=", "sslrootcert": "/etc/pg/ca+1.pem", "password": "p+w",
                "application_name": "a b+c"}
    for bounds in ("", "tcp_timeout_s=20&", "idle_transaction_timeout_s=7&tcp_timeout_s=20&"):
        url = f"{PG}?{bounds}{query}"
        assert without_session_bounds(url) == f"{PG}?{query}"
        given = handed_to_psycopg(url, psycopg_calls)
        assert {key: given[key] for key in expected} == expected, bounds
        uri = PostgresFetch(url, engine_for_url(url)).uri()  # ADBC's
        assert uri.startswith(f"postgresql://app:secret@db.example:5432/app?{query}&"), bounds
    assert without_session_bounds(f"{PG}?a=1&&tcp_timeout_s=4&b=%2B+") == f"{PG}?a=1&&b=%2B+"


def test_a_plus_in_a_libpq_parameter_reaches_the_server() -> None:
    """On the real server: the session's application_name is the URL's, ``+`` included."""
    from urllib.parse import urlsplit

    from outbox.storage.engines.postgres import PostgresEngine

    parts = urlsplit(POSTGRES_URL)
    require("PostgreSQL", parts.hostname or "127.0.0.1", parts.port or 5432)
    conn = PostgresEngine().connect(with_query(POSTGRES_URL, "tcp_timeout_s=20&application_name=relay+1%2Fa"))
    try:
        assert conn.execute("SELECT current_setting('application_name')").fetchone()[0] == "relay+1/a"
    finally:
        conn.close()


def test_django_postgresql_options_carry_every_libpq_parameter(psycopg_calls: list[dict[str, object]]) -> None:
    """Found in review: a hand-written list dropped sslcrl, sslcrldir, sslcertmode, sslsni,
    ssl_min_protocol_version, ssl_max_protocol_version and require_auth, so the relay took
    what Django refused (a revoked certificate, an older TLS)."""
    from psycopg import pq

    stricter = {"sslmode": "verify-full", "sslrootcert": "/etc/pg/ca.pem", "sslcrl": "/etc/pg/crl.pem",
                "sslcrldir": "/etc/pg/crl.d", "sslcertmode": "require", "sslsni": 1,
                "ssl_min_protocol_version": "TLSv1.3", "ssl_max_protocol_version": "TLSv1.3",
                "require_auth": "scram-sha-256", "sslpassword": "Ab+9/x="}
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "USER": "app", "PASSWORD": "secret",
                "HOST": "db.example", "PORT": "5432",
                "OPTIONS": {**stricter, "isolation_level": 1, "server_side_binding": True, "prepare_threshold": 5,
                            "host": "elsewhere.example"}}
    url = django_database_url(database)
    assert url is not None
    given = handed_to_psycopg(url, psycopg_calls)
    assert {key: given.get(key) for key in stricter} == {key: str(value) for key, value in stricter.items()}
    # Django's own keys and psycopg's are not libpq's; HOST set wins over OPTIONS' host, as in Django.
    assert not {"isolation_level", "server_side_binding", "prepare_threshold"} & set(given)
    assert given["host"] == "db.example"
    libpq = {option.keyword.decode() for option in pq.Conninfo.get_defaults()}
    assert set(stricter) <= libpq


def test_a_mysql_connect_without_tls_parameters_builds_no_tls_context_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by ``bench.soak --faults --engine mysql``: PyMySQL 2's default (PREFERRED: TLS when
    the server offers it, nothing checked) built a new ``ssl.create_default_context()`` in every
    ``Connection``, loading the system's CA bundle for a context that checks nothing: about 25 ms
    a connect on the test machine, and through a database cut, with every thread's retries, the
    Dramatiq children's RSS rose by 1.5-2.3 MB a cut in glibc's thread arenas (55 -> 77 MB over
    12 cuts). The engine now gives every such connection one context of the process's, and
    PyMySQL's PREFERRED rule is kept (MariaDB here offers no TLS: the connection is plain)."""
    require("MariaDB", "127.0.0.1", 3306)
    built: list[object] = []
    real = ssl.create_default_context

    def counting(*args: object, **kwargs: object) -> ssl.SSLContext:
        built.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    engine = MysqlEngine()
    first = engine.connect(MYSQL_URL)
    first.close()
    monkeypatch.setattr(ssl, "create_default_context", counting)
    for _ in range(5):
        conn = engine.connect(MYSQL_URL)
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
        conn.close()
    assert built == []
