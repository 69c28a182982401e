"""RabbitMQ over TLS (``amqps://``): the URL's ``ssl_*`` parameters (``outbox.core.tls``) reach
every AMQP client of the relay, and the server's host name is checked by default. Against a TLS
proxy of the module's own in front of the local RabbitMQ, signed by a throwaway CA
(``tls_support``). kombu once passed the parameters to py-amqp as unknown keyword arguments (a
TypeError at every connect) and, with none, checked no host name: a certificate for
``wrong.example`` was accepted for ``localhost`` (found in review)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from publisher_support import make_message
from tls_support import Pki, TlsProxy

from outbox.commands.doctor import FAIL, OK, WARN, check_destination
from outbox.core.config import dramatiq_settings, load_settings
from outbox.core.errors import ConfigError
from outbox.core.model import FailureKind
from outbox.core.tls import AmqpTls
from outbox.publisher.kombu_publisher import KombuPublisher


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("amqp-tls"))


@pytest.fixture
def proxy(pki: Pki, broker: dict[str, Any]) -> Iterator[TlsProxy]:
    """RabbitMQ behind TLS, its certificate for localhost."""
    front = TlsProxy(pki, "localhost")
    yield front
    front.close()


def publish_one(url: str, broker: dict[str, Any]) -> Any:
    with KombuPublisher(url, broker["exchange"], connect_timeout=5, confirm_timeout=5) as publisher:
        return publisher.publish_chain([make_message(1)])


def settings_for(url: str, broker: dict[str, Any]) -> Any:
    return load_settings(environ={"OUTBOX_PUBLISH_URL": url, "OUTBOX_EXCHANGE": broker["exchange"],
                                  "OUTBOX_DATABASE_URL": "sqlite:///tls.db"})


def test_the_ca_in_the_url_verifies_the_broker_and_events_go_through(
        proxy: TlsProxy, pki: Pki, broker: dict[str, Any]) -> None:
    url = proxy.url(ssl_ca_certs=str(pki.ca_file))
    result = publish_one(url, broker)
    assert result.ok, result.failure
    assert len(broker["live"]()) == 1
    report = check_destination(settings_for(url, broker))
    assert report[0].state == OK, report[0].line()
    # Without the CA, the system's CAs do not know the throwaway one: refused, not published.
    refused = publish_one(proxy.url(), broker)
    assert not refused.ok and refused.failure is not None
    assert "certificate verify failed" in refused.failure.reason
    assert broker["live"]() == []


def test_a_certificate_for_another_host_name_is_refused(pki: Pki, broker: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    front = TlsProxy(pki, "wrong.example")
    try:
        # A CA the system trusts (SSL_CERT_FILE), no parameter: py-amqp checked the chain but no
        # host name, and published through it.
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_file))
        bare = publish_one(front.url(), broker)
        assert not bare.ok and bare.failure is not None and bare.failure.kind is FailureKind.FATAL, bare.failure
        assert broker["live"]() == []
        monkeypatch.delenv("SSL_CERT_FILE")
        url = front.url(ssl_ca_certs=str(pki.ca_file))
        result = publish_one(url, broker)
        assert not result.ok and result.failure is not None
        assert result.failure.kind is FailureKind.FATAL, result.failure
        assert "Hostname mismatch" in result.failure.reason or "doesn't match" in result.failure.reason
        assert broker["live"]() == []
        report = check_destination(settings_for(url, broker))
        assert report[0].state == FAIL and "certificate verify failed" in report[0].detail, report[0].line()
        # The name the certificate carries, said on purpose: accepted.
        named = publish_one(front.url(ssl_ca_certs=str(pki.ca_file), ssl_server_hostname="wrong.example"), broker)
        assert named.ok, named.failure
        assert len(broker["live"]()) == 1
    finally:
        front.close()


def test_a_client_certificate_is_presented_when_configured(pki: Pki, broker: dict[str, Any]) -> None:
    front = TlsProxy(pki, "localhost", client_ca=pki.ca_file)
    try:
        anonymous = publish_one(front.url(ssl_ca_certs=str(pki.ca_file)), broker)
        assert not anonymous.ok  # the proxy requires a client certificate
        cert, key = pki.issue("relay-client", "relay.example")
        url = front.url(ssl_ca_certs=str(pki.ca_file), ssl_certfile=str(cert), ssl_keyfile=str(key))
        result = publish_one(url, broker)
        assert result.ok, result.failure
        assert len(broker["live"]()) == 1
        assert front.peers and front.peers[-1] is not None
        assert check_destination(settings_for(url, broker))[0].state == OK
    finally:
        front.close()


def test_tls_parameters_are_read_when_the_settings_are(tmp_path: Path) -> None:
    base = "amqps://u:p@rabbit.example:5671//"
    ok = load_settings(environ={"OUTBOX_PUBLISH_URL": f"{base}?ssl_ca_certs=/ca.pem&ssl_check_hostname=false"})
    assert ok.publish_url.endswith("ssl_check_hostname=false")
    refused = {
        f"{base}?ssl_cafile=/ca.pem": "unknown TLS parameter 'ssl_cafile'",
        f"{base}?ca_certs=/ca.pem": "unknown TLS parameter 'ca_certs'",
        f"{base}?ssl_options={{'ca_certs':'/ca.pem'}}": "unknown TLS parameter 'ssl_options'",
        f"{base}?ssl_password=Secret123": "an encrypted client key cannot be used",
        f"{base}?ssl_cert_reqs=maybe": "ssl_cert_reqs='maybe'",
        f"{base}?ssl_keyfile=/k.pem": "ssl_keyfile needs ssl_certfile",
        "amqp://u:p@rabbit.example//?ssl_ca_certs=/ca.pem": "write amqps://",
    }
    for url, why in refused.items():
        for name, read in (("OUTBOX_PUBLISH_URL", lambda u: load_settings(environ={"OUTBOX_PUBLISH_URL": u})),
                           ("OUTBOX_DRAMATIQ_BROKER_URL",
                            lambda u: dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": u}))):
            with pytest.raises(ConfigError) as caught:
                read(url)
            assert name in str(caught.value) and why in str(caught.value), (url, str(caught.value))
            assert "Secret123" not in str(caught.value)
            if "unknown" in why:
                assert "accepted: ssl_ca_certs" in str(caught.value)
    # A file that cannot be read, or an encrypted key: a configuration error (FATAL), at connect.
    missing = KombuPublisher(f"{base}?ssl_ca_certs={tmp_path / 'none.pem'}", f"x-{uuid.uuid4().hex[:6]}")
    result = missing.publish_chain([make_message(1)])
    assert not result.ok and result.failure is not None and result.failure.kind is FailureKind.FATAL
    assert "ssl_ca_certs" in result.failure.reason


def test_each_broker_of_a_tls_list_is_checked_against_its_own_name(pki: Pki, broker: dict[str, Any]) -> None:
    """A list of RabbitMQ nodes each with a certificate for its own name (cert-manager, per-node
    certificates): no single name fits them all. Found in review: such a list was refused at
    start-up ("give ssl_server_hostname"), the only way out being ssl_check_hostname=false.
    Each node is now checked against its own host: through the first with both up, through the
    second with the first down; a node whose certificate carries the other's name is refused."""
    first, second = TlsProxy(pki, "localhost"), TlsProxy(pki, "127.0.0.1")
    ca = str(pki.ca_file)
    url = f"{first.url('localhost')};{second.url('127.0.0.1', ssl_ca_certs=ca)}"
    swapped = f"{first.url('127.0.0.1')};{second.url('localhost', ssl_ca_certs=ca)}"
    try:
        assert settings_for(url, broker).publish_url == url
        assert check_destination(settings_for(url, broker))[0].state == OK
        both = publish_one(url, broker)
        assert both.ok, both.failure
        assert (len(first.peers), len(second.peers)) == (2, 0)  # the check's connection, the publisher's
        wrong = publish_one(swapped, broker)
        assert not wrong.ok and wrong.failure is not None and wrong.failure.kind is FailureKind.FATAL, wrong.failure
        assert "mismatch" in wrong.failure.reason or "doesn't match" in wrong.failure.reason, wrong.failure.reason
        first.close()
        failover = publish_one(url, broker)
        assert failover.ok, failover.failure
        assert len(second.peers) == 1
        assert len(broker["live"]()) == 2
        assert check_destination(settings_for(url, broker))[0].state == OK
    finally:
        first.close()
        second.close()


def test_a_node_of_a_tls_list_whose_certificate_does_not_verify_is_passed_over(pki: Pki,
                                                                              broker: dict[str, Any]) -> None:
    """Per-node certificates, and one node's stops verifying (expired, reissued for another
    name, a node replaced) while the others are fine. Found in review: the publisher took the
    first node's certificate error as FATAL without trying the next node, so claims paused for
    the fatal pause and every reconnect met the same node first: nothing was published while a
    healthy node was listed. That node is now passed over as an unreachable one is; FATAL only
    when no node of the list could be reached (the ``swapped`` list of the test above)."""
    bad, good = TlsProxy(pki, "wrong.example"), TlsProxy(pki, "127.0.0.1")
    url = f"{bad.url('localhost', ssl_ca_certs=str(pki.ca_file))};{good.url('127.0.0.1')}"
    try:
        with KombuPublisher(url, broker["exchange"], connect_timeout=5, confirm_timeout=5) as publisher:
            result = publisher.publish_chain([make_message(1)])
        assert result.ok, result.failure
        assert len(good.peers) == 1 and bad.handshakes_failed >= 1
        assert len(broker["live"]()) == 1
    finally:
        bad.close()
        good.close()


def test_a_host_only_alternate_keeps_the_first_urls_tls_after_the_first_host_failed(
        proxy: TlsProxy, pki: Pki, broker: dict[str, Any]) -> None:
    """kombu's failover list may name an alternate by its host alone, which takes everything else
    (scheme, TLS, port, user, password, vhost) from the first URL. Found in review of the
    publisher's rotated first host (7 December 2026): once the first host had failed, the next
    connection was built from the list rotated as text, whose first element, the bare host,
    kombu then read alone: no TLS at all (the default port, in clear), guest's credentials,
    vhost '/'. Each connection must reach the same broker with the same parameters."""
    ca = str(pki.ca_file)
    # 127.0.0.2: loopback, nothing listens there on the proxy's port (connection refused)
    url = f"amqps://guest:guest@127.0.0.2:{proxy.port}//?ssl_ca_certs={ca};localhost"
    with KombuPublisher(url, broker["exchange"], connect_timeout=5, confirm_timeout=5) as publisher:
        first = publisher.publish_chain([make_message(1)])
        assert first.ok, first.failure
        assert len(proxy.peers) == 1
        publisher._discard()  # the connection lost: the next begins at the host that worked
        second = publisher.publish_chain([make_message(2)])
        assert second.ok, second.failure
        assert publisher._conn.virtual_host == "/" and publisher._conn.ssl, publisher._conn.info()
    assert len(proxy.peers) == 2  # through TLS again, not in clear to the default port
    assert len(broker["live"]()) == 2


def test_an_encrypted_client_key_is_a_configuration_error_not_a_prompt(pki: Pki) -> None:
    """py-amqp loads the key with no passphrase, and OpenSSL would then ask for one on the
    terminal, holding a worker for good."""
    from cryptography.hazmat.primitives import serialization

    cert, key = pki.issue("encrypted-client", "relay.example")
    plain = serialization.load_pem_private_key(key.read_bytes(), password=None)
    key.write_bytes(plain.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.BestAvailableEncryption(b"Secret123")))
    with pytest.raises(ConfigError, match="the key is encrypted"):
        AmqpTls(certfile=str(cert), keyfile=str(key), server_hostname="rabbit.example").kombu_ssl()


@pytest.mark.parametrize("url", ["amqps://u:p@rabbit-0.example//", "amqps://u:p@rabbit-0.example//;amqps://u:p@rabbit-1.example//"])
def test_the_host_name_is_checked_even_if_kombu_stopped_naming_each_host(
        pki: Pki, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the host name came only from overriding kombu's private
    ``Connection._init_params``, and py-amqp checks a host name only when one is given, so a
    kombu release that stopped calling it would check no name at all. Without the override
    the first broker's name is given (a second broker is refused, never unchecked)."""
    from kombu import Connection

    from outbox.core import tls

    monkeypatch.setattr(tls, "_each_host_named", lambda: Connection)  # as if kombu never called it
    conn = tls.kombu_connection(f"{url.split(';')[0]}?ssl_ca_certs={pki.ca_file}" if ";" not in url else
                                ";".join(f"{u}?ssl_ca_certs={pki.ca_file}" for u in url.split(";")), "OUTBOX_PUBLISH_URL")
    assert conn.ssl["server_hostname"] == "rabbit-0.example"


def test_outbox_check_warns_when_the_certificate_or_its_name_is_not_checked(
        proxy: TlsProxy, pki: Pki, broker: dict[str, Any]) -> None:
    """``ssl_cert_reqs=none`` or ``ssl_check_hostname=false`` connect to anyone who answers: the
    check said "reachable", ok, where it warns for Celery's Redis (found in review)."""
    for query, says in (({"ssl_cert_reqs": "none"}, "certificate not verified"),
                        ({"ssl_ca_certs": str(pki.ca_file), "ssl_check_hostname": "false"}, "host name not checked")):
        report = check_destination(settings_for(proxy.url(**query), broker))
        assert (report[0].state, says in report[0].detail) == (WARN, True), report[0].line()


def test_celerys_own_amqps_broker_checks_the_host_name(pki: Pki, broker: dict[str, Any]) -> None:
    """Celery's broker on ``amqps://`` with ``broker_use_ssl``'s CA: py-amqp checks the host name
    only when given one, so a certificate for ``wrong.example`` was accepted for localhost (found
    in review: the relay's app connected to it). The app's Connection names the host, as the
    publisher's does; ``cert_reqs=CERT_NONE`` still checks nothing."""
    import ssl

    from outbox.celery.application import Connection

    wrong, right = TlsProxy(pki, "wrong.example"), TlsProxy(pki, "localhost")
    use_ssl = {"ca_certs": str(pki.ca_file), "cert_reqs": ssl.CERT_REQUIRED}
    try:
        with Connection(right.url(), ssl=dict(use_ssl), connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
        for ssl_option in (dict(use_ssl), True):
            with Connection(wrong.url(), ssl=ssl_option, connect_timeout=5) as conn, pytest.raises(Exception) as refused:
                conn.ensure_connection(max_retries=1)
            assert "certificate" in str(refused.value).lower() or isinstance(refused.value, ssl.SSLError), refused.value
        with Connection(wrong.url(), ssl={"cert_reqs": ssl.CERT_NONE}, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    finally:
        wrong.close()
        right.close()


def test_outbox_check_reaches_celerys_amqps_broker_as_the_workers_do(
        pki: Pki, broker: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``outbox check`` read Celery's RabbitMQ without ``broker_use_ssl``: with the workers' private
    CA there it said FAIL (certificate verify failed) while they connected, and it checked no host
    name (found in review). It connects as the app does: broker_use_ssl, each host named."""
    from outbox.commands.doctor import check_celery_broker

    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"amqpsconf_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        f"import ssl\nbroker_use_ssl = {{'ca_certs': {str(pki.ca_file)!r}, 'cert_reqs': ssl.CERT_REQUIRED}}\n")
    right, wrong = TlsProxy(pki, "localhost"), TlsProxy(pki, "wrong.example")
    try:
        for proxy, verdict in ((right, OK), (wrong, FAIL)):
            url = proxy.url().split("?")[0]
            settings = load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url, "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
            result = check_celery_broker(settings, environ={"CELERY_CONFIG_MODULE": name})
            assert result.state == verdict, result.line()
        # broker_use_ssl that checks nothing: reachable, with a warning (as for the other brokers).
        unchecked = f"amqpsnone_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{unchecked}.py").write_text("import ssl\nbroker_use_ssl = {'cert_reqs': ssl.CERT_NONE}\n")
        settings = load_settings(environ={"OUTBOX_CELERY_BROKER_URL": wrong.url().split("?")[0],
                                          "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
        result = check_celery_broker(settings, environ={"CELERY_CONFIG_MODULE": unchecked})
        assert (result.state, "not verified" in result.detail) == (WARN, True), result.line()
    finally:
        right.close()
        wrong.close()


def test_outbox_check_reaches_celerys_amqp_broker_over_tls_when_broker_use_ssl_says_so(
        pki: Pki, broker: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery connects to an ``amqp://`` broker over TLS when ``broker_use_ssl`` is set (py-amqp
    takes the ssl options whatever the scheme; so does the relay's app), but ``outbox check``
    read ``broker_use_ssl`` for ``amqps://`` only and spoke plain AMQP to a TLS listener: FAIL
    while the workers connected, and no certificate or name checked (found in review)."""
    import ssl

    from outbox.celery.application import Connection
    from outbox.commands.doctor import check_celery_broker

    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"amqpconf_{uuid.uuid4().hex[:8]}"
    use_ssl = {"ca_certs": str(pki.ca_file), "cert_reqs": ssl.CERT_REQUIRED}
    (tmp_path / f"{name}.py").write_text(
        f"import ssl\nbroker_use_ssl = {{'ca_certs': {str(pki.ca_file)!r}, 'cert_reqs': ssl.CERT_REQUIRED}}\n")
    right, wrong = TlsProxy(pki, "localhost"), TlsProxy(pki, "wrong.example")
    try:
        url = right.url().split("?")[0].replace("amqps://", "amqp://", 1)
        with Connection(url, ssl=dict(use_ssl), connect_timeout=5) as conn:  # as a worker connects
            conn.ensure_connection(max_retries=1)
        for proxy, verdict in ((right, OK), (wrong, FAIL)):
            url = proxy.url().split("?")[0].replace("amqps://", "amqp://", 1)
            settings = load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url, "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
            result = check_celery_broker(settings, environ={"CELERY_CONFIG_MODULE": name})
            assert result.state == verdict, result.line()
    finally:
        right.close()
        wrong.close()


@pytest.mark.parametrize("query", ["ssl_ca_certs=/etc/ca.pem", "ssl_cert_reqs=none&heartbeat=30"])
@pytest.mark.parametrize("scheme", ["amqps", "amqp"])
def test_tls_parameters_in_celerys_amqp_broker_url_stop_start_up(scheme: str, query: str) -> None:
    """OUTBOX_CELERY_BROKER_URL=amqps://...?ssl_ca_certs=... was accepted, and kombu handed the
    parameter to py-amqp: ``TypeError: SSLTransport._wrap_socket_sni() got an unexpected keyword
    argument 'ssl_ca_certs'`` at every connect of the workers and of ``outbox check`` (found in
    review). Refused when the settings are read, naming broker_use_ssl; kombu's ``ssl=1`` stays."""
    url = f"{scheme}://app:S3cret@rabbit.example:5671//?{query}"
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url, "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
    said = str(caught.value)
    assert said.startswith("OUTBOX_CELERY_BROKER_URL=") and query.split("=")[0] in said, said
    assert "broker_use_ssl" in said and "S3cret" not in said, said
    kept = f"{scheme}://app:S3cret@rabbit.example:5671//?ssl=1"
    assert load_settings(environ={"OUTBOX_CELERY_BROKER_URL": kept, "OUTBOX_DATABASE_URL": "sqlite:///o.db"}
                         ).broker_url == kept


def test_celerys_bare_amqps_broker_checks_the_host_name(pki: Pki, broker: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's broker on a bare ``amqps://`` (no ``broker_use_ssl``: Celery gives kombu
    ``ssl=None``, and kombu's TLS transport turns it into ``True`` only after the app's Connection
    named the host): a CA the system trusts signed a certificate for ``wrong.example``, and the
    app connected to it for localhost (found in review). Refused now, as with ``broker_use_ssl``."""
    import ssl

    from outbox.celery.application import Connection

    wrong = TlsProxy(pki, "wrong.example")
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_file))
    try:
        for ssl_option in (None, False):
            with Connection(wrong.url(), ssl=ssl_option, connect_timeout=5) as conn, \
                    pytest.raises(Exception) as refused:
                conn.ensure_connection(max_retries=1)
            assert "certificate" in str(refused.value).lower() or isinstance(refused.value, ssl.SSLError), refused.value
    finally:
        wrong.close()


def test_a_clone_of_celerys_amqps_connection_fails_over_to_a_broker_with_its_own_name(
        pki: Pki, broker: dict[str, Any]) -> None:
    """Celery's broker as a list of nodes with per-node certificates, the first down. kombu's
    connection pools (Celery's producer pool: every task sent, beat's, the post-commit wakes')
    connect with kombu's own class and the app's ``ssl`` (``_info``), as ``clone()`` does, which carried the first node's name the app had set: the second
    node was refused ("Hostname mismatch") where the app's own connection went through (found in
    review). Each clone names the node it connects to."""
    import ssl

    from outbox.celery.application import Connection

    first, second = TlsProxy(pki, "localhost"), TlsProxy(pki, "127.0.0.1")
    url = f"{first.url('localhost')};{second.url('127.0.0.1')}"
    use_ssl = {"ca_certs": str(pki.ca_file), "cert_reqs": ssl.CERT_REQUIRED}
    try:
        first.close()
        with Connection(url, ssl=dict(use_ssl), connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=3)
            with Connection(url, ssl=dict(use_ssl), connect_timeout=5).clone() as clone:
                clone.ensure_connection(max_retries=3)
                assert clone.hostname == "127.0.0.1"
            pool = Connection(url, ssl=dict(use_ssl), connect_timeout=5).Pool(1)
            try:
                with pool.acquire(block=True, timeout=5) as pooled:
                    pooled.ensure_connection(max_retries=3)
                    assert pooled.hostname == "127.0.0.1"
            finally:
                pool.force_close_all()
        assert len(second.peers) == 3
    finally:
        first.close()
        second.close()


def test_celerys_amqps_broker_with_server_hostname_none_checks_each_hosts_own_name(
        pki: Pki, broker: dict[str, Any]) -> None:
    """``server_hostname: None`` in ``broker_use_ssl`` is kombu's "the URL's host": kombu wrote
    it into the app's own dict at the first connect, after turning localhost into 127.0.0.1, so a
    broker at localhost with a certificate for localhost was refused, and every later node of a
    list was checked against the first's name (found in review; the docs said None turned the
    check off). The app names each host itself."""
    import ssl

    from outbox.celery.application import Connection

    first, second = TlsProxy(pki, "localhost"), TlsProxy(pki, "127.0.0.1")
    url = f"{first.url('localhost')};{second.url('127.0.0.1')}"
    use_ssl = {"ca_certs": str(pki.ca_file), "cert_reqs": ssl.CERT_REQUIRED, "server_hostname": None}
    try:
        with Connection(first.url("localhost"), ssl=use_ssl, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
        first.close()
        with Connection(url, ssl=use_ssl, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=3)
            assert conn.hostname == "127.0.0.1"
        assert (len(first.peers), len(second.peers)) == (1, 1)
    finally:
        first.close()
        second.close()
