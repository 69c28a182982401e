"""Celery's broker on Redis over TLS (``rediss://``): the relay's Redis transport
(``outbox.celery.redis_transport``) serves it as it serves ``redis://``, reading the URL as
kombu's own transport does. Against a Redis server of the module's own that speaks TLS only
(the machine's ``redis-server``, built with TLS on Debian, and a throwaway CA made with
``trustme``): a message there and back, garbage dropped, a certificate that does not verify
refused, and a real worker and beat relaying through it. The relay's own Redis clients (shared
state, wake, wake subscriber) and ``outbox check`` connect as Celery's broker does: with
``broker_use_ssl``, Celery's ``CERT_REQUIRED`` spelling, a bare ``rediss://``. Skipped (failed under
OUTBOX_REQUIRE_SERVICES) without ``redis-server`` or when it cannot speak TLS."""

from __future__ import annotations

import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError
from relay_e2e_support import Destination, Outbox, check_order, relay_env, wait_until
from services import free_port, stop, unavailable
from tls_support import Pki

from outbox.celery.application import REDIS_TRANSPORT, Connection, celery_config
from outbox.core.config import RelayOptions, load_settings
from outbox.core.names import wake_channel
from outbox.storage.engines.sqlite import sqlite_path
from outbox.storage.store import OutboxStore


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
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed")
    where = tmp_path_factory.mktemp("tls-redis")
    pki = Pki(where)
    server_cert, server_key = pki.issue("server", "127.0.0.1")
    port = free_port()
    log = where / "redis.log"
    proc = subprocess.Popen(
        [str(binary), "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
         "--tls-cert-file", str(server_cert), "--tls-key-file", str(server_key),
         "--tls-ca-cert-file", str(pki.ca_file), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(where), "--logfile", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    server = TlsRedis(port, pki.ca_file)
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


# -- the relay's own Redis clients on the TLS broker (shared state, wake, wake subscriber) -------
# Found in review: they were built from the URL alone, so Celery's broker worked while they
# failed with CERTIFICATE_VERIFY_FAILED (broker_use_ssl, a bare rediss://) or RedisError
# (Celery's ssl_cert_reqs=CERT_REQUIRED spelling, which redis-py refuses).

@pytest.fixture
def celery_conf() -> Iterator[Callable[[dict[str, Any]], None]]:
    """Register a Celery configuration as the one the relay reads (``sources.use_conf``, as the
    relay's Celery app does); the app's own again afterwards."""
    from outbox.celery.application import app
    from outbox.core import sources

    yield lambda conf: sources.use_conf(lambda: conf)
    sources.use_conf(lambda: app.conf)


def test_the_relays_redis_options_are_kombus(tmp_path: Path) -> None:
    """The TLS options of the relay's Redis clients, as kombu's Redis transport connects Celery's
    broker: the URL's ssl_* parameters win over broker_use_ssl, CERT_* spellings are translated,
    a bare rediss:// is kombu's unverified TLS, redis:// stays plain."""
    from outbox.relay.redis_clients import redis_connect_options

    url, options = redis_connect_options(
        "rediss://:pw@h:6380/2?socket_timeout=3&ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs=/ca.pem"
        "&ssl_check_hostname=false", {"ssl_ca_certs": "/other.pem"})
    assert url == "rediss://:pw@h:6380/2?socket_timeout=3"
    assert {k: v for k, v in options.items() if k != "connection_class"} == {
        "ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem", "ssl_check_hostname": False}  # redis-py's word
    assert options["connection_class"] is redis.SSLConnection
    for spelling, mode in (("CERT_OPTIONAL", "optional"), ("none", "none"), ("required", "required")):
        assert redis_connect_options("rediss://h/0", {"ssl_cert_reqs": spelling})[1]["ssl_cert_reqs"] == mode
    _, given = redis_connect_options("redis://h/0", {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_certfile": "/c.pem"})
    assert given["connection_class"] is redis.SSLConnection and given["ssl_certfile"] == "/c.pem"
    assert redis_connect_options("rediss://h/0", None)[1]["ssl_cert_reqs"] == ssl.CERT_NONE
    assert redis_connect_options("redis://h/0?db=1", None) == ("redis://h/0?db=1", {})
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        redis_connect_options("rediss://h/0?ssl_cert_reqs=maybe", None)


def tls_broker(tls_redis: TlsRedis, celery_conf: Callable[[dict[str, Any]], None], case: str) -> str:
    """Celery's broker URL on the TLS Redis, configured as ``case`` says: (A) ``broker_use_ssl``,
    (B) Celery's CERT_REQUIRED spelling in the URL, (C) a bare rediss:// (kombu's unverified TLS)."""
    base = f"rediss://127.0.0.1:{tls_redis.port}"
    url = {"broker_use_ssl": f"{base}/4", "CERT_REQUIRED": tls_redis.url(db=5, ssl_cert_reqs="CERT_REQUIRED"),
           "bare": f"{base}/6"}[case]
    celery_conf({"broker_url": url, "broker_use_ssl": {"ssl_cert_reqs": ssl.CERT_REQUIRED,
                                                       "ssl_ca_certs": str(tls_redis.ca)}}
                if case == "broker_use_ssl" else {"broker_url": url})
    return url


@pytest.mark.parametrize("case", ["broker_use_ssl", "CERT_REQUIRED", "bare"])
def test_the_relays_own_redis_clients_connect_as_celerys_broker_does(
        tls_redis: TlsRedis, celery_conf: Callable[[dict[str, Any]], None], case: str) -> None:
    """The shared state (breaker, route gate, coalescer), the writer's wake and the worker's wake
    subscriber on a TLS broker given (A) by broker_use_ssl, (B) in Celery's CERT_REQUIRED
    spelling, (C) as a bare rediss:// (kombu's unverified TLS)."""
    from outbox.relay import listen, waker
    from outbox.relay.state import RedisState, open_shared_state

    url = tls_broker(tls_redis, celery_conf, case)
    key = f"tls-test-{uuid.uuid4().hex[:8]}"
    state = open_shared_state(url)
    assert isinstance(state, RedisState)
    assert state.set_if_absent(key, "1", 30)
    assert waker.redis_client(url).get(key) == b"1"
    subscription = listen._Subscription(url, f"{key}:notify")
    try:
        assert waker.redis_client(url).publish(f"{key}:notify", b"") == 1
        assert list(subscription.notifies(5))
    finally:
        subscription.close()
        state.delete(key)


@pytest.mark.parametrize("case", ["broker_use_ssl", "CERT_REQUIRED", "bare"])
def test_beats_purge_record_is_kept_on_a_tls_broker(
        tls_redis: TlsRedis, celery_conf: Callable[[dict[str, Any]], None], tmp_path: Path,
        caplog: pytest.LogCaptureFixture, case: str) -> None:
    """Beat's record of the purge's last send (``Scheduler.sent_record``) on a TLS broker given
    as the other relay clients' test gives it. Found in review: beat built its client from the
    URL alone, so every read and write failed (at DEBUG) and a beat restarted more often than
    the purge interval never purged again."""
    from celery import Celery

    from outbox.celery.beat import Scheduler

    url = tls_broker(tls_redis, celery_conf, case)
    app = Celery("beat-tls", set_as_current=False)
    app.conf.broker_url = url
    namespace = f"beattls-{uuid.uuid4().hex[:8]}"
    record = Scheduler(app=app, schedule_filename=str(tmp_path / "schedule"), lazy=True).sent_record(namespace)
    try:
        with caplog.at_level(logging.DEBUG, "outbox.relay"):
            assert record is not None
            record.record_sent("outbox.purge", 1234.5, 60)
            assert record.last_sent(["outbox.purge"]) == {"outbox.purge": 1234.5}
        assert not [r for r in caplog.records if "last sent" in r.getMessage() or "was sent" in r.getMessage()]
    finally:
        tls_redis.client().delete(f"outbox:beat:{namespace}:sent:outbox.purge")


def test_a_purge_record_that_cannot_be_read_or_written_says_so_once(
        tls_redis: TlsRedis, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """A record that fails (here a CA that did not sign the server's certificate) is read as
    never sent, which puts the purge off an interval: the first failure is a WARNING, the next
    ones DEBUG."""
    import trustme

    from outbox.relay.redis_clients import connect_redis
    from outbox.relay.sent_record import RedisSentRecord

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    client = connect_redis(tls_redis.url(ssl_ca_certs=str(other)), socket_timeout=2.0, socket_connect_timeout=2.0)
    record = RedisSentRecord(client, "outbox:beat:never:sent:")
    with caplog.at_level(logging.DEBUG, "outbox.relay"):
        assert record.last_sent(["outbox.purge"]) == {}
        record.record_sent("outbox.purge", 1.0, 60)
        assert record.last_sent(["outbox.purge"]) == {}
    failures = [r for r in caplog.records if "certificate verify failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING, logging.DEBUG, logging.DEBUG], failures
    assert "put off" in failures[0].getMessage()


def test_broker_use_ssl_is_celerys_broker_only(celery_conf: Callable[[dict[str, Any]], None]) -> None:
    """Dramatiq's Redis (another URL) is not given Celery's broker_use_ssl."""
    from outbox.relay.redis_clients import celery_use_ssl

    use_ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.pem"}
    celery_conf({"broker_url": "rediss://celery.example:6380/0", "broker_use_ssl": use_ssl})
    assert celery_use_ssl("rediss://celery.example:6380/0") == use_ssl
    assert celery_use_ssl("rediss://dramatiq.example:6380/0") is None


def _check(env: dict[str, str], cwd: Path) -> str:
    """`outbox check`'s line for Celery's broker."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DJANGO_", "CELERY_"))}
    done = subprocess.run([sys.executable, "-m", "outbox.cli", "check"], capture_output=True, text=True, cwd=cwd,
                          env={**clean, **env}, timeout=120)
    return next(line for line in done.stdout.splitlines() if "celery broker:" in line)


def test_outbox_check_connects_to_celerys_redis_as_the_workers_do(tls_redis: TlsRedis, tmp_path: Path) -> None:
    """broker_use_ssl in the Celery config module, the CERT_REQUIRED spelling, a wrong CA, a bare
    rediss:// (reachable, but its certificate is not checked: a warning)."""
    import trustme

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    db = f"sqlite:///{tmp_path / 'o.db'}"
    OutboxStore(db).migrate()
    base = f"rediss://127.0.0.1:{tls_redis.port}/0"

    def with_module(ca: Path) -> dict[str, str]:
        name = f"tlsconf_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(
            f"import ssl\nbroker_use_ssl = {{'ssl_cert_reqs': ssl.CERT_REQUIRED, 'ssl_ca_certs': {str(ca)!r}}}\n")
        return {"OUTBOX_DATABASE_URL": db, "OUTBOX_CELERY_BROKER_URL": base, "CELERY_CONFIG_MODULE": name}

    assert _check(with_module(tls_redis.ca), tmp_path).startswith("[ok  ] celery broker:")
    wrong = _check(with_module(other), tmp_path)
    assert wrong.startswith("[FAIL] celery broker:") and "certificate verify failed" in wrong, wrong
    spelled = {"OUTBOX_DATABASE_URL": db, "OUTBOX_CELERY_BROKER_URL": tls_redis.url(ssl_cert_reqs="CERT_REQUIRED")}
    assert _check(spelled, tmp_path).startswith("[ok  ] celery broker:")
    spelled_wrong = {**spelled, "OUTBOX_CELERY_BROKER_URL": tls_redis.url(ssl_cert_reqs="CERT_REQUIRED",
                                                                           ssl_ca_certs=str(other))}
    assert _check(spelled_wrong, tmp_path).startswith("[FAIL] celery broker:")
    bare = _check({"OUTBOX_DATABASE_URL": db, "OUTBOX_CELERY_BROKER_URL": base}, tmp_path)
    assert bare.startswith("[warn] celery broker:") and "not verified" in bare, bare


@pytest.mark.parametrize(("query", "use_ssl", "verdict"), [
    ({}, None, "warn"),  # a bare rediss://: kombu's unverified TLS
    ({"ssl_cert_reqs": "none"}, None, "warn"),
    ({"ssl_cert_reqs": "CERT_NONE"}, None, "warn"),
    ({}, {"ssl_cert_reqs": "CERT_NONE"}, "warn"),
    ({}, {"ssl_cert_reqs": ssl.CERT_NONE}, "warn"),
    ({}, {"ssl_cert_reqs": None}, "warn"),
    ({"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": "CA"}, None, "ok"),
    ({"ssl_cert_reqs": "optional", "ssl_ca_certs": "CA"}, None, "ok"),
    ({}, {"ssl_cert_reqs": "required", "ssl_ca_certs": "CA"}, "ok"),
    ({}, {"ssl_ca_certs": "CA"}, "ok"),  # redis-py's default: required
])
def test_outbox_check_warns_for_each_spelling_of_an_unverified_certificate(
        tls_redis: TlsRedis, celery_conf: Callable[[dict[str, Any]], None], query: dict[str, str],
        use_ssl: dict[str, Any] | None, verdict: str) -> None:
    """``outbox check`` on Celery's TLS Redis: a certificate not verified is a warning however it
    is spelled (the docs' promise), and broker_use_ssl is read as the relay's clients read it (the
    registered Celery configuration: ``redis_clients.broker_use_ssl``). Found in review: only a
    bare rediss:// warned, as the check compared the translated "none" with ssl.CERT_NONE; and
    it read broker_use_ssl from the config module alone."""
    from outbox.commands.doctor import check_celery_broker

    ca = str(tls_redis.ca)
    url = f"rediss://127.0.0.1:{tls_redis.port}/0"
    if query:
        url += "?" + "&".join(f"{k}={ca if v == 'CA' else v}" for k, v in query.items())
    conf: dict[str, Any] = {"broker_url": url}
    if use_ssl is not None:
        conf["broker_use_ssl"] = {k: ca if v == "CA" else v for k, v in use_ssl.items()}
    celery_conf(conf)
    settings = load_settings(environ={"OUTBOX_CELERY_BROKER_URL": url, "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
    result = check_celery_broker(settings)
    assert result.state == verdict, result
    if verdict == "warn":
        assert "not verified" in result.detail, result


def test_verifies_reads_redis_pys_options() -> None:
    from outbox.relay.redis_clients import redis_connect_options, verifies

    for url, use_ssl, expected in (("rediss://h/0", None, False),
                                   ("rediss://h/0?ssl_cert_reqs=none", None, False),
                                   ("rediss://h/0?ssl_cert_reqs=CERT_NONE", None, False),
                                   ("rediss://h/0", {"ssl_cert_reqs": "CERT_NONE"}, False),
                                   ("rediss://h/0", {"ssl_cert_reqs": ssl.CERT_NONE}, False),
                                   ("rediss://h/0", True, True),
                                   ("rediss://h/0?ssl_cert_reqs=CERT_REQUIRED", None, True),
                                   ("rediss://h/0", {"ssl_cert_reqs": ssl.CERT_OPTIONAL}, True)):
        assert verifies(redis_connect_options(url, use_ssl)[1]) is expected, (url, use_ssl)


WRITER = r"""
import sqlite3, sys
import outbox
conn = sqlite3.connect(sys.argv[1], timeout=30)
with outbox.transaction(conn):
    print(outbox.enqueue(conn, topic="orders.tls.changed", aggregate_type="order", aggregate_id="tls",
                         payload={"n": int(sys.argv[2])}))
"""


@pytest.mark.timeout(150)
def test_a_worker_and_beat_with_broker_use_ssl_hear_wakes_and_share_the_breaker(
        tls_redis: TlsRedis, tmp_path: Path, destination: Destination, sqlite_outbox: Outbox,
        procs_factory: Any) -> None:
    """Celery's broker on TLS through broker_use_ssl in the Celery config module, beat ticking
    once an hour: the worker's wake subscriber listens, a post-commit wake reaches it, and a
    breaker pause another worker shares through the TLS Redis holds its claims back."""
    from outbox.relay.shared import breaker_key

    url = f"rediss://127.0.0.1:{tls_redis.port}/7"
    env = relay_env(tmp_path, destination, sqlite_outbox, OUTBOX_CELERY_BROKER_URL=url,
                    OUTBOX_CLAIM_INTERVAL_S="3600", OUTBOX_RELAY_CLAIM_REQUEST_TTL_S="30")
    module = tmp_path / "relayconf.py"
    module.write_text(module.read_text() + "import ssl\nbroker_use_ssl = {'ssl_cert_reqs': ssl.CERT_REQUIRED, "
                      f"'ssl_ca_certs': {str(tls_redis.ca)!r}}}\n")
    procs = procs_factory(env)
    procs.worker("w1")
    procs.beat()
    assert wait_until(lambda: "outbox listen: listening on" in procs.log("w1"), 60), procs.log("w1")[-3000:]
    settings = load_settings(environ=env)
    channel = wake_channel(url, env["OUTBOX_TEST_REDIS_PREFIX"], settings.outbox_namespace)
    assert tls_redis.client().pubsub_numsub(channel) == [(channel.encode(), 1)]  # the worker's subscriber
    db = sqlite_path(sqlite_outbox.url)

    def commit(n: int) -> int:
        done = subprocess.run([sys.executable, "-c", WRITER, db, str(n)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.strip().splitlines()[-1])

    first = commit(1)
    assert destination.wait_for(lambda: first in destination.arrived(), timeout=15, procs=procs), \
        procs.log("w1")[-3000:]
    # Another worker's pause, shared through the TLS Redis: this worker claims nothing meanwhile.
    key = breaker_key(settings.outbox_namespace, settings.publish_url, settings.exchange)
    pause_s = 6.0
    tls_redis.client().set(key, json.dumps({"until": time.time() + pause_s, "reason": "backpressure: test",
                                            "seconds": pause_s}), px=int(pause_s * 1000))
    paused = commit(2)
    time.sleep(3.0)
    assert paused not in destination.arrived()
    assert wait_until(lambda: not tls_redis.client().exists(key), 10)
    last = commit(3)
    assert destination.wait_for(lambda: {paused, last} <= destination.arrived(), timeout=15, procs=procs), \
        procs.log("w1")[-3000:]
    for name in ("w1", "beat"):
        log = procs.log(name)
        assert "CERTIFICATE_VERIFY_FAILED" not in log and "broker unreachable" not in log, log[-3000:]
        assert "cannot share state" not in log and "Unrecoverable error" not in log, log[-3000:]


def test_unknown_tls_parameters_of_a_redis_url_are_refused_at_start_up() -> None:
    """An ``ssl_*`` parameter redis-py does not take (``ssl_ca_file`` for ``ssl_ca_certs``),
    or an ``ssl_cert_reqs`` it cannot read, in any Redis URL the settings hold: a
    configuration error naming the setting and the parameter. Before, the settings took it and
    kombu and redis-py passed it to the connection as a keyword argument: a TypeError at every
    connect, in a worker's log, long after start-up (found in review)."""
    from outbox.core.config import dramatiq_settings
    from outbox.core.errors import ConfigError

    base = "rediss://:Secret123@cache.example:6380/0"
    ok = (f"{base}?ssl_ca_certs=/ca.pem&ssl_cert_reqs=CERT_REQUIRED&ssl_check_hostname=true&socket_timeout=3"
          "&ssl_ca_data=PEM")  # a certificate written in the URL, as redis-py reads it
    assert load_settings(environ={"OUTBOX_PUBLISH_URL": ok}).publish_url == ok
    assert load_settings(environ={"OUTBOX_CELERY_BROKER_URL": ok}).celery_broker_url == ok
    assert dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": ok}).broker_url == ok
    refused = {f"{base}?ssl_ca_file=/ca.pem": "unknown TLS parameter 'ssl_ca_file'",
               "redis://cache.example/0?ssl_verify=no": "unknown TLS parameter 'ssl_verify'",
               f"{base}?ssl_cert_reqs=maybe": "ssl_cert_reqs='maybe'"}
    readers = {"OUTBOX_PUBLISH_URL": lambda u: load_settings(environ={"OUTBOX_PUBLISH_URL": u}),
               "OUTBOX_CELERY_BROKER_URL": lambda u: load_settings(environ={"OUTBOX_CELERY_BROKER_URL": u}),
               "OUTBOX_DRAMATIQ_BROKER_URL": lambda u: dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": u})}
    for url, why in refused.items():
        for name, read in readers.items():
            with pytest.raises(ConfigError) as caught:
                read(url)
            message = str(caught.value)
            assert name in message and why in message and "Secret123" not in message, (url, message)
            if "unknown" in why:
                assert "accepted: ssl_ca_certs" in message


def test_a_redis_failover_list_is_read_one_url_at_a_time() -> None:
    """Celery's failover list (``;``: kombu reads each alternate's ``ssl_*``) with TLS
    parameters on each URL: the settings take it, and check every alternate's parameters,
    not only the first's; the relay's own Redis clients connect to the first alternate with its
    options. Found in review: the check read the rest of the list as the value of the first
    URL's last parameter (``ssl_cert_reqs='required;rediss://h2...'`` refused at start-up, an
    unknown name in the second URL let through), and the relay's clients took
    ``/ca.pem;rediss://...`` as the CA file."""
    from outbox.core.config import dramatiq_settings
    from outbox.core.errors import ConfigError
    from outbox.relay.redis_clients import redis_connect_options

    one = "rediss://:Secret123@h{n}.example:6380/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
    listed = f"{one.format(n=1)};{one.format(n=2)}"
    assert load_settings(environ={"OUTBOX_CELERY_BROKER_URL": listed}).celery_broker_url == listed
    assert load_settings(environ={"OUTBOX_PUBLISH_URL": listed}).publish_url == listed
    assert dramatiq_settings(environ={"OUTBOX_DRAMATIQ_BROKER_URL": listed}).broker_url == listed
    for name in ("OUTBOX_CELERY_BROKER_URL", "OUTBOX_PUBLISH_URL"):
        with pytest.raises(ConfigError, match="unknown TLS parameter 'ssl_verify'"):
            load_settings(environ={name: f"{one.format(n=1)};rediss://h2.example:6380/0?ssl_verify=no"})
    url, options = redis_connect_options(listed)
    assert url == "rediss://:Secret123@h1.example:6380/0"
    assert options["ssl_ca_certs"] == "/ca.pem" and options["ssl_cert_reqs"] == "required"
    alone = "rediss://h{n}.example:6380/0?ssl_cert_reqs=CERT_REQUIRED"
    assert load_settings(environ={"OUTBOX_CELERY_BROKER_URL": f"{alone.format(n=1)};{alone.format(n=2)}"})
    assert redis_connect_options(f"{alone.format(n=1)};{alone.format(n=2)}") == (
        "rediss://h1.example:6380/0", {"connection_class": redis.SSLConnection, "ssl_cert_reqs": "required"})


def test_outbox_check_warns_for_a_destination_whose_certificate_is_not_verified(tls_redis: TlsRedis) -> None:
    """A bare ``rediss://`` destination gets kombu's unverified TLS: a warning, as for Celery's
    broker (found in review: "reachable", ok)."""
    from outbox.commands.doctor import check_destination

    for url, verdict in ((f"rediss://127.0.0.1:{tls_redis.port}/0", "warn"), (tls_redis.url(), "ok")):
        settings = load_settings(environ={"OUTBOX_PUBLISH_URL": url, "OUTBOX_DATABASE_URL": "sqlite:///o.db"})
        result = check_destination(settings)[0]
        assert result.state == verdict, result.line()
