"""Celery's broker on Redis over TLS (``rediss://``): the relay's Redis transport
(``outbox.celery.redis_transport``) serves it as it serves ``redis://``, reading the URL as
kombu's own transport does. Against a Redis server of the module's own that speaks TLS only
(the machine's ``redis-server``, built with TLS on Debian, and a throwaway CA made with
``trustme``): a message there and back, garbage dropped, a certificate that does not verify
refused, and a real worker and beat relaying through it. Skipped (failed under
OUTBOX_REQUIRE_SERVICES) without ``redis-server`` or when it cannot speak TLS."""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError
from relay_e2e_support import Destination, Outbox, check_order, relay_env
from services import free_port, stop, unavailable

from outbox.celery.application import REDIS_TRANSPORT, Connection, celery_config
from outbox.core.config import RelayOptions, load_settings


class TlsRedis(NamedTuple):
    port: int
    ca: Path  #: the throwaway CA's certificate, which signed the server's

    def url(self, db: int = 0, **query: str) -> str:
        """A ``rediss://`` URL with kombu's and redis-py's ``ssl_*`` parameters (default:
        verify against the module's CA)."""
        params = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.ca), **query}
        return f"rediss://127.0.0.1:{self.port}/{db}?" + "&".join(f"{k}={v}" for k, v in params.items())

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(self.ca), socket_timeout=5)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    """``redis-server`` on a free port, TLS only (no plain port), nothing kept on disk."""
    import trustme

    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    where = tmp_path_factory.mktemp("tls-redis")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(where / "server.pem"))
    cert.private_key_pem.write_to_path(str(where / "server.key"))
    port = free_port()
    log = where / "redis.log"
    proc = subprocess.Popen(
        [str(binary), "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
         "--tls-cert-file", str(where / "server.pem"), "--tls-key-file", str(where / "server.key"),
         "--tls-ca-cert-file", str(where / "ca.pem"), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(where), "--logfile", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = TlsRedis(port, where / "ca.pem")
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                unavailable(f"redis-server did not start with TLS (exit {proc.returncode}): "
                             f"{log.read_text()[-500:] if log.exists() else ''}")
            try:
                server.client().ping()
                break
            except (redis.ConnectionError, OSError):
                if time.monotonic() > deadline:
                    unavailable("redis-server with TLS did not answer within 15 s")
                time.sleep(0.1)
        yield server
    finally:
        stop(proc)


def test_celery_takes_the_relays_transport_for_a_rediss_broker_and_reads_its_url_as_kombu_does(
        caplog: pytest.LogCaptureFixture) -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"):
        config = celery_config(load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url,
                                                      "OUTBOX_DATABASE_URL": "postgresql://h/db"}), RelayOptions())
        assert config["broker_transport"] == REDIS_TRANSPORT, url
    # The URL's ssl_* parameters, as kombu reads them; the password masked; the scheme kept.
    c = Connection("rediss://:s3cret@cache.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
                   transport=REDIS_TRANSPORT)
    assert c.transport_cls == REDIS_TRANSPORT
    assert c.ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca.pem"}
    assert c.as_uri() == "rediss://:**@cache.example:6380/2"
    assert c.clone().ssl == c.ssl and c.clone().as_uri() == c.as_uri()  # Celery clones its connection
    # Options given apart (Celery's broker_use_ssl) are taken as they are.
    given = Connection("rediss://cache.example:6380/0", transport=REDIS_TRANSPORT, ssl={"ssl_ca_certs": "/x.pem"})
    assert given.ssl == {"ssl_ca_certs": "/x.pem"}
    # None at all: kombu's own rule for rediss://, its warning and no certificate check.
    with caplog.at_level(logging.WARNING, "kombu.connection"):
        bare = Connection("rediss://cache.example:6380/0", transport=REDIS_TRANSPORT)
    assert bare.ssl == {"ssl_cert_reqs": ssl.CERT_NONE}
    assert any("rediss" in r.getMessage() and "insecure" in r.getMessage() for r in caplog.records)
    # redis:// stays plain.
    assert Connection("redis://:pw@h:6379/1", transport=REDIS_TRANSPORT).ssl is False


def test_messages_go_there_and_back_over_tls_and_garbage_is_dropped(
        tls_redis: TlsRedis, caplog: pytest.LogCaptureFixture) -> None:
    name = f"q-{uuid.uuid4().hex[:8]}"
    with Connection(tls_redis.url(), transport=REDIS_TRANSPORT) as c:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
        queue(c.default_channel).declare()
        tls_redis.client().lpush(name, b"\x00\xff not json at all")
        c.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key=name, serializer="json")
        got: list[Any] = []
        with caplog.at_level(logging.ERROR, "outbox.celery"), \
                c.Consumer(queue, callbacks=[lambda body, message: (got.append(body), message.ack())], accept=["json"]):
            for _ in range(3):
                if got:
                    break
                c.drain_events(timeout=5)
    assert got == [{"n": 1}]
    assert [r for r in caplog.records if "dropped an undecodable message" in r.getMessage()]


def test_a_certificate_that_does_not_verify_is_refused(tls_redis: TlsRedis, tmp_path: Path) -> None:
    import trustme

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with Connection(tls_redis.url(ssl_ca_certs=str(other)), transport=REDIS_TRANSPORT, connect_timeout=5) as c, \
            pytest.raises(OperationalError, match="certificate verify failed"):
        c.default_channel.client.ping()


@pytest.mark.timeout(120)
def test_a_worker_and_beat_relay_through_a_rediss_broker(
        tls_redis: TlsRedis, tmp_path: Path, destination: Destination, sqlite_outbox: Outbox,
        procs_factory: Any) -> None:
    """Celery's broker, the wake and the worker's wake subscriber all on the TLS server."""
    expected: dict[str, list[int]] = {}
    with sqlite_outbox.writer() as conn:
        for k in range(30):
            expected.setdefault(f"agg-{k % 3}", []).append(sqlite_outbox.add(conn, f"agg-{k % 3}", k))
        conn.commit()
    ids = {i for chain in expected.values() for i in chain}
    url = tls_redis.url(db=3)
    procs = procs_factory(relay_env(tmp_path, destination, sqlite_outbox, OUTBOX_CELERY_BROKER_URL=url,
                                    OUTBOX_CLAIM_INTERVAL_S="0.3"))
    procs.worker("w1")
    procs.beat()
    assert destination.wait_for(lambda: destination.arrived() >= ids, timeout=60, procs=procs), \
        procs.log("w1")[-3000:]
    check_order(destination.arrivals(), expected)
    log = procs.log("w1")
    assert f"rediss://127.0.0.1:{tls_redis.port}/3" in log  # the banner: the scheme as given
    assert "Unrecoverable error" not in log
    assert tls_redis.client().info("stats")["total_connections_received"] > 0
