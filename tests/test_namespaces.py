"""Each outbox's own names on a shared broker (``outbox.core.names``; docs/relay.md, "Several outboxes
on one broker"): the default namespace and OUTBOX_NAMESPACE (pure), the refusal of a task naming
another outbox (``relay.ForeignTasks``, and the Celery task class over it), the database broker's
queues of two outboxes in one database, and Dramatiq's actors (a real Redis; a worker on RabbitMQ forwarding). The two relays
on one Redis and one vhost, end to end: tests/test_namespaces_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from relay_support import run_python
from services import AMQP_URL, REDIS_URL, require

from outbox.core.config import CLOCK_SKEW_MARGIN_S, RelayOptions, load_settings
from outbox.core.errors import ConfigError
from outbox.core.names import (
    CLAIM_TASK,
    FAIL_TASK,
    LEGACY_NAMESPACE,
    MAX_NAMESPACE,
    PUBLISH_TASK,
    Queues,
    claim_request_key,
    database_identity,
    default_namespace,
    wake_channel,
)
from outbox.relay import ForeignTasks, breaker_key

# -- the default namespace (pure) -------------------------------------------------------------------

def test_the_same_database_written_differently_gives_the_same_namespace() -> None:
    """Driver, user, password and options do not name the database: every process of one outbox
    (a web app as one user, the relay as another) lands on the same queues."""
    same = ["postgresql://app:secret@db:5432/shop", "postgresql+psycopg://relay:other@DB:5432/shop?sslmode=require",
            "postgres://db:5432/shop"]
    assert len({default_namespace(url, "outbox") for url in same}) == 1
    assert database_identity(same[0]) == "db:5432/shop"


@pytest.mark.parametrize("other", [
    ("postgresql://db:5432/shop", "orders", None),       # another table
    ("postgresql://db:5432/shop", "outbox", "billing"),  # another schema
    ("postgresql://db:5432/crm", "outbox", None),        # another database
    ("postgresql://db2:5432/shop", "outbox", None),      # another server
    ("postgresql://db:5433/shop", "outbox", None),       # another port
])
def test_outboxes_that_differ_in_table_schema_or_database_get_different_namespaces(other: tuple[Any, ...]) -> None:
    assert default_namespace("postgresql://db:5432/shop", "outbox") != default_namespace(*other)


@pytest.mark.parametrize("url,namespace", [
    ("postgresql://app:secret@db:5432/shop", "outbox.outbox.f27261ee"),
    ("postgres://db/shop", "outbox.outbox.acf3b164"),
    ("postgresql+psycopg://relay:pw@DB:5432/shop?sslmode=require&application_name=relay"
     "&target_session_attrs=read-write", "outbox.outbox.f27261ee"),
    ("postgresql://app@[::1]:5432/app", "outbox.outbox.9766964b"),
    ("mysql://root@127.0.0.1:3306/test?charset=utf8mb4&read_timeout=30", "outbox.outbox.896e1a25"),
    ("mariadb://u:p@maria/app", "outbox.outbox.192cfcf1"),
    ("mssql+pyodbc://sa:p@sql:1433/app?driver=ODBC+Driver+18+for+SQL+Server", "outbox.outbox.d1eda0e9"),
    ("mssql+pyodbc://sa:p@Sql,1433/app?driver=ODBC+Driver+18+for+SQL+Server", "outbox.outbox.7c2463e0"),
    ("mysql://u:p,w@db:3306/app", "outbox.outbox.2902aea0"),
    ("postgresql://app@/app?sslmode=disable", "outbox.outbox.0c35eebf"),  # the socket, no host named
])
def test_the_namespace_of_a_url_naming_its_host_in_the_host_part_never_changes(url: str, namespace: str) -> None:
    """A deployment's queues are named after it: these are the names every release so far
    gave, and a change of them strands the rows and tasks on the old queues."""
    assert default_namespace(url, "outbox") == namespace


@pytest.mark.parametrize("one,other", [
    # libpq reads the server from the query too; these all were "/app", one namespace (found in review)
    ("postgresql://app@/app?host=db-billing", "postgresql://app@/app?host=db-orders"),
    ("postgresql://app@/app?host=/run/a", "postgresql://app@/app?host=/run/b"),
    ("postgresql://app@/app?service=billing", "postgresql://app@/app?service=orders"),
    ("postgresql://app@/app?host=db&hostaddr=10.0.0.1", "postgresql://app@/app?host=db&hostaddr=10.0.0.2"),
    ("postgresql://app@/app?host=db&port=5432", "postgresql://app@/app?host=db&port=5433"),
    ("postgresql://app@db/?dbname=billing", "postgresql://app@db/?dbname=orders"),
    ("mysql://root@localhost/app?unix_socket=/run/a.sock", "mysql://root@localhost/app?unix_socket=/run/b.sock"),
    # libpq's multi-host form (failover): every host counts
    ("postgresql://app@h1:5432,h2:5432/app", "postgresql://app@h1:5432,h3:5432/app"),
    ("postgresql://app@h1:5432,h2:5432/app", "postgresql://app@h1:5432/app"),
])
def test_the_servers_a_url_names_in_its_query_or_host_list_make_the_namespace(one: str, other: str) -> None:
    assert default_namespace(one, "outbox") != default_namespace(other, "outbox")


def test_djangos_socket_hosts_name_different_outboxes() -> None:
    """Django's HOST as a socket directory becomes ``?host=`` (``sources.django_database_url``)."""
    from outbox.core.sources import django_database_url

    urls = {django_database_url({"ENGINE": f"django.db.backends.{engine}", "NAME": "app", "USER": "app",
                                 "HOST": host})
            for engine in ("postgresql", "mysql") for host in ("/run/billing", "/run/orders")}
    assert len({default_namespace(str(url), "outbox") for url in urls}) == 4, urls


@pytest.mark.parametrize("host,port,namespace", [
    # Django's default: HOST left empty. Releases up to 757df6b wrote it 127.0.0.1 (identity
    # "127.0.0.1/shop", "127.0.0.1:5432/shop"); the relay now connects through the socket as Django
    # does, and the namespace stays (found in the upgrade review: it had become "/shop").
    ("", "", "outbox.outbox.6c7785e3"),
    ("", "5432", "outbox.outbox.bd1e6a19"),
    # A socket directory: releases put it in the database name (dbname "var/run/postgresql/shop",
    # which never connected), so no deployment has a namespace to keep; this is the one the README's
    # upgrade note announces ("?host=", "a Django HOST socket").
    ("/var/run/postgresql", "", "outbox.outbox.3538a964"),
    ("db", "", "outbox.outbox.acf3b164"),
])
def test_a_django_postgresql_entry_keeps_the_namespace_releases_gave_it(host: str, port: str, namespace: str) -> None:
    from outbox.core.sources import django_database_url

    url = str(django_database_url({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
                                   "HOST": host, "PORT": port}))
    assert default_namespace(url, "outbox") == namespace


def test_an_empty_django_host_still_connects_through_the_socket() -> None:
    """The stand-in host names the namespace only: libpq gets no host (its default, the socket,
    or PGHOST, as Django) and never sees the relay's own parameter."""
    from outbox.core.sources import django_database_url
    from outbox.storage.engines.postgres import connect_params

    url = str(django_database_url({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
                                   "HOST": "", "PORT": "5432"}))
    params = connect_params(url)
    assert "host" not in params and "namespace_host" not in params
    assert (params["dbname"], params["user"], params["port"]) == ("shop", "app", "5432")
    # Which database it is (the several-databases warning) does not change with it.
    assert database_identity(url) == database_identity("postgresql://app@:5432/shop")


def test_options_that_do_not_address_the_server_leave_the_namespace_alone() -> None:
    base = default_namespace("postgresql://app@/app?host=db", "outbox")
    assert default_namespace("postgresql://relay:pw@/app?sslmode=require&host=db&application_name=x", "outbox") == base
    assert default_namespace("mysql://u@localhost/app?unix_socket=/run/a.sock&charset=utf8mb4", "outbox") == (
        default_namespace("mysql://v:pw@localhost/app?unix_socket=/run/a.sock", "outbox"))


def test_the_namespace_reads_as_the_outbox_and_fits_every_broker() -> None:
    ns = default_namespace("mssql+pyodbc://u:p@sql:1433/app?driver=ODBC+Driver+18", "o" * 63, "s" * 63)
    assert ns.startswith(f"outbox.{'s' * 63}.{'o' * 63}.") and len(ns) <= 150
    q = Queues(ns)
    assert q.all == (q.claim, q.publish, q.ack, q.purge) == tuple(f"{ns}.{k}" for k in ("claim", "publish", "ack",
                                                                                          "purge"))
    assert all(len(name) <= 255 for name in q.all)  # RabbitMQ's limit; the database broker's column
    assert q.for_task(FAIL_TASK) == q.ack and q.routes[PUBLISH_TASK] == q.publish


def test_sqlite_files_and_odbc_strings_name_their_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert database_identity("sqlite:///outbox.db") == str(tmp_path / "outbox.db")
    assert database_identity(f"sqlite:///{tmp_path / 'outbox.db'}") == str(tmp_path / "outbox.db")
    odbc = "DRIVER={ODBC Driver 18 for SQL Server};SERVER=Sql,1433;DATABASE=app;UID=u;PWD=secret"
    assert database_identity(odbc) == "sql,1433/app" and "secret" not in default_namespace(odbc, "outbox")
    assert database_identity(f"mssql+pyodbc:///?odbc_connect={odbc}") == "sql,1433/app"


def test_outbox_namespace_overrides_the_default_and_can_keep_the_old_names() -> None:
    env = {"OUTBOX_DATABASE_URL": "postgresql://db/shop", "OUTBOX_TABLE": "orders"}
    assert load_settings(environ=env).outbox_namespace == default_namespace("postgresql://db/shop", "orders")
    assert load_settings(environ={**env, "OUTBOX_NAMESPACE": "shop-orders"}).queues.claim == "shop-orders.claim"
    legacy = load_settings(environ={**env, "OUTBOX_NAMESPACE": LEGACY_NAMESPACE}).queues
    assert legacy.all == ("outbox.claim", "outbox.publish", "outbox.ack", "outbox.purge")  # the names before 19


@pytest.mark.parametrize("bad", ["has space", "1starts-with-digit", "colon:s", "x" * (MAX_NAMESPACE + 1), "ünï"])
def test_a_bad_outbox_namespace_is_a_configuration_error_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_NAMESPACE"):
        load_settings(environ={"OUTBOX_NAMESPACE": bad})


def test_token_channel_and_breaker_are_per_outbox() -> None:
    url = "redis://127.0.0.1:6379/0"
    assert claim_request_key(url, "", "a") != claim_request_key(url, "", "b")
    assert wake_channel(url, "", "a") != wake_channel(url, "", "b")
    assert breaker_key("a", "amqp://x//", "events") != breaker_key("b", "amqp://x//", "events")


def test_the_schedule_sends_each_tick_to_its_outboxs_queue_naming_it() -> None:
    import beat_schedule

    settings = load_settings(environ={"OUTBOX_DATABASE_URL": "postgresql://db/shop", "OUTBOX_TABLE": "orders"})
    schedule = beat_schedule.build_schedule(settings, RelayOptions())
    for entry, queue in ((beat_schedule.CLAIM_ENTRY, settings.queues.claim),
                         (beat_schedule.PURGE_ENTRY, settings.queues.purge)):
        assert schedule[entry]["options"]["queue"] == queue
    # The claim tick says requested=False: the worker counts ticks apart from claim requests.
    assert schedule[beat_schedule.CLAIM_ENTRY]["kwargs"] == {"requested": False, "outbox": settings.outbox_namespace}
    assert schedule[beat_schedule.PURGE_ENTRY]["kwargs"] == {"outbox": settings.outbox_namespace}
    # A tick expires after its interval, by beat's clock, but never within the margin for
    # workers whose clocks run ahead of it (found in review: 1 s of skew dropped every tick).
    assert schedule[beat_schedule.CLAIM_ENTRY]["options"]["expires"] == CLOCK_SKEW_MARGIN_S
    assert schedule[beat_schedule.PURGE_ENTRY]["options"]["expires"] == RelayOptions().purge_interval_s


# -- refusing a task of another outbox (pure) -------------------------------------------------------

def test_a_foreign_task_is_forwarded_to_its_outbox_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    foreign, forwarded = ForeignTasks(logging.getLogger("test.foreign")), []
    assert foreign.belongs("mine", "mine") and foreign.belongs(None, "mine")  # None: a task of an earlier version
    assert not foreign.belongs("theirs", "mine")
    with caplog.at_level(logging.WARNING, logger="test.foreign"):
        for _ in range(3):
            assert foreign.refuse(PUBLISH_TASK, "theirs", "mine", forwarded.append) == "forwarded"
        assert foreign.refuse(CLAIM_TASK, "others", "mine", forwarded.append) == "forwarded"
    assert forwarded == ["theirs", "theirs", "theirs", "others"]  # none lost
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "'theirs'" in lines[0] and "'others'" in lines[1]


def test_a_task_naming_no_possible_outbox_is_dropped_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    foreign, forwarded = ForeignTasks(logging.getLogger("test.foreign")), []
    with caplog.at_level(logging.WARNING, logger="test.foreign"):
        assert foreign.refuse(CLAIM_TASK, "no such:name", "mine", forwarded.append) == "dropped"
        assert foreign.refuse(CLAIM_TASK, 42, "mine", forwarded.append) == "dropped"
    assert forwarded == [] and len(caplog.records) == 2


def test_the_celery_task_runs_its_own_outboxs_task_and_forwards_another(tmp_path: Path) -> None:
    """In a worker process's task class (``outbox.celery.tasks.RelayTask``): a purge naming this outbox
    runs; one naming another is sent to that outbox's purge queue and not run."""
    code = """
import json
import outbox.celery.tasks as t
import outbox.relay.service as service
ran, sent = [], []
service.purge_expired = lambda *a, **k: ran.append(1) or 0
t.send_relay_task = lambda task, kwargs, namespace=None, **o: sent.append([task, namespace, o.get("args")])
ours = t.relay_settings().outbox_namespace
mine = t.purge(outbox=ours)
theirs = t.purge(outbox="other-outbox")
print(json.dumps({"ran": len(ran), "sent": sent, "theirs": theirs, "ours": ours}))
"""
    done = run_python(code, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["ran"] == 1 and out["sent"] == [["outbox.purge", "other-outbox", []]]
    assert out["theirs"] == {"refused": "other-outbox", "forwarded": True}
    assert "refused a outbox.purge task of outbox 'other-outbox'" in done.stderr


_FORWARD_EXPIRING = """
import json, logging, os
from datetime import datetime, timedelta, timezone
import outbox.celery.tasks as t
logging.basicConfig(level=logging.DEBUG)
other, now = os.environ["OTHER_OUTBOX"], datetime.now(timezone.utc)
results = []
for left in (60, -5):  # as a worker hands it: request.expires is Celery's ISO-8601 string
    t.claim.push_request(expires=(now + timedelta(seconds=left)).isoformat())
    try:
        results.append(t.claim(outbox=other))
    finally:
        t.claim.pop_request()
print(json.dumps({"results": results, "now": now.timestamp()}))
"""


def test_a_foreign_tick_with_an_expiry_lands_on_its_outboxs_queue(tmp_path: Path) -> None:
    """Claim ticks, claim requests and purges carry an expiry, which a worker holds as an
    ISO-8601 string: forwarding one raised ValueError (float() of that string), so each was
    lost with a traceback, one a second (found in review). Forwarded now with the time it has
    left (the same deadline), on a real Redis as Celery's broker; one already expired is
    dropped with a DEBUG line."""
    import base64

    import redis
    from celery.utils.time import maybe_iso8601

    require("Redis", "127.0.0.1", 6379)
    other = f"fwd-{uuid.uuid4().hex[:10]}"
    queue = Queues(other).claim
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        done = run_python(_FORWARD_EXPIRING, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                          OUTBOX_CELERY_BROKER_URL=REDIS_URL, OTHER_OUTBOX=other)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.splitlines()[-1])
        messages = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        for key in client.scan_iter(match=f"*{other}*"):  # the queue and kombu's bindings of it
            client.delete(key)
        client.close()
    assert out["results"] == [{"refused": other, "forwarded": True}, {"refused": other, "expired": True}], out
    assert len(messages) == 1, messages
    headers = messages[0]["headers"]
    assert headers["task"] == CLAIM_TASK and json.loads(base64.b64decode(messages[0]["body"]))[1]["outbox"] == other
    expires = maybe_iso8601(headers["expires"]).timestamp()
    assert abs(expires - (out["now"] + 60)) < 0.01, headers["expires"]  # the same deadline, not a new one
    assert f"outbox: dropped a {CLAIM_TASK} task of outbox {other!r} that expired" in done.stderr


# -- the database broker: two outboxes in one database ----------------------------------------------

def test_two_outboxes_on_the_database_broker_keep_to_their_own_queues(tmp_path: Path) -> None:
    """Both relays' Celery apps on ``outboxdb+sqlite`` of one file (one set of queue tables):
    each outbox's tasks land in its own queues only, so neither worker can take the other's."""
    from celery import Celery

    from outbox.celery.application import celery_config

    broker = f"outboxdb+sqlite:///{tmp_path / 'broker.db'}"
    apps, settings = {}, {}
    for name in ("a", "b"):
        settings[name] = load_settings(environ={"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'shop.db'}",
                                                "OUTBOX_TABLE": f"outbox_{name}", "OUTBOX_CELERY_BROKER_URL": broker})
        apps[name] = Celery(f"relay_{name}")
        apps[name].conf.update(celery_config(settings[name], RelayOptions()))
    assert set(settings["a"].queues.all).isdisjoint(settings["b"].queues.all)
    for task in (CLAIM_TASK, PUBLISH_TASK, FAIL_TASK):
        apps["a"].send_task(task, kwargs={"outbox": settings["a"].outbox_namespace})
    apps["b"].send_task(CLAIM_TASK, kwargs={"outbox": settings["b"].outbox_namespace})
    with apps["b"].connection_for_read() as conn:
        channel = conn.default_channel
        sizes = {name: {q: channel._size(q) for q in s.queues.all} for name, s in settings.items()}
        message = channel._get(settings["b"].queues.claim)
    a, b = settings["a"].queues, settings["b"].queues
    assert sizes["a"] == {a.claim: 1, a.publish: 1, a.ack: 1, a.purge: 0}
    assert sizes["b"] == {b.claim: 1, b.publish: 0, b.ack: 0, b.purge: 0}
    assert message["headers"]["task"] == CLAIM_TASK


# -- Dramatiq -----------------------------------------------------------------------------------------

_DRAMATIQ = """
import json, os, sqlite3
import outbox.dramatiq as d
from outbox import enqueue
from outbox.dramatiq.brokers import queue_length
from outbox.core.names import Queues
r = d.resources()
r.store.migrate()
conn = sqlite3.connect(os.environ["DB_PATH"])
enqueue(conn, topic="t.x", aggregate_type="a", aggregate_id="1", payload={})
conn.commit()
other = Queues("other-outbox")
d.claim(outbox="other-outbox")  # not ours: sent to the other outbox's claim queue, not run
d.claim(outbox="other-outbox")
pending_after_foreign = r.store.stats().counts["pending"]
requested = d.request_claim()
print(json.dumps({"queues": list(d.QUEUES.all), "namespace": d.OUTBOX_NAMESPACE,
                  "forwarded": queue_length(d.broker, other.claim), "ours": queue_length(d.broker, d.QUEUES.claim),
                  "pending_after_foreign": pending_after_foreign, "requested": requested,
                  "actor_queues": sorted({d.broker.get_actor(a).queue_name for a in d.broker.get_declared_actors()})}))
"""


def test_dramatiq_actors_use_their_outboxs_queues_and_forward_another_outboxs_messages(tmp_path: Path) -> None:
    pytest.importorskip("dramatiq")
    require("Redis", "127.0.0.1", 6379)
    import redis

    ns = f"outbox-test-{uuid.uuid4().hex[:10]}"
    tests = str(Path(__file__).resolve().parent)
    try:
        done = run_python(_DRAMATIQ, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                          OUTBOX_DRAMATIQ_BROKER_URL=REDIS_URL, OUTBOX_DRAMATIQ_NAMESPACE=ns,
                          DB_PATH=str(tmp_path / "o.db"),
                          PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{ns}*"):
            client.delete(key)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    expected = Queues(default_namespace(f"sqlite:///{tmp_path / 'o.db'}", "outbox"))
    assert out["namespace"] == expected.namespace and out["queues"] == list(expected.all)
    assert out["actor_queues"] == sorted(set(expected.all))
    assert out["forwarded"] == 2 and out["pending_after_foreign"] == 1  # handed on, not run
    assert out["requested"] is True and out["ours"] == 1
    assert done.stderr.count("refused a outbox.claim task of outbox 'other-outbox'") == 1


_DRAMATIQ_WORKER = """
import json, os, sqlite3, time
import outbox.dramatiq as d
from dramatiq import Worker
from outbox.core.names import CLAIM_TASK, Queues
from outbox.dramatiq import brokers
d.resources().store.migrate()
other = os.environ["OTHER_OUTBOX"]
forwarded = []
refuse = d.relay.foreign.refuse
d.relay.foreign.refuse = lambda task, named, *rest: forwarded.append(named) or refuse(task, named, *rest)
worker = Worker(d.broker, worker_threads=1, worker_timeout=100)
worker.start()
before = sorted(worker.consumers)
brokers.sender().enqueue(brokers.message(CLAIM_TASK, d.QUEUES.claim, {"outbox": other}))  # on our queue
end = time.monotonic() + 2.0
while time.monotonic() < end and not forwarded:
    time.sleep(0.05)
time.sleep(1.0)  # time enough for thousands of bounces, if the worker consumed the other queue
after = sorted(worker.consumers)
worker.stop()
print(json.dumps({"before": before, "after": after, "forwarded": forwarded,
                  "waiting": brokers.queue_length(brokers.sender(), Queues(other).claim)}))
"""


def test_a_dramatiq_worker_on_rabbitmq_forwards_another_outboxs_message_without_consuming_its_queue(
        tmp_path: Path) -> None:
    """A Dramatiq worker on RabbitMQ gets a message naming another outbox and forwards it to
    that outbox's claim queue, once. It forwarded through its own broker, whose enqueue declares
    the queue, and Dramatiq's worker adds a consumer for every queue its broker declares: it
    then consumed the other outbox's queue, refused the message again and forwarded it again,
    2,212 times in 3 s in review. It now forwards through the process's sending broker
    (``brokers.sender()``, no worker attached): its consumers stay its own outbox's."""
    pytest.importorskip("dramatiq")
    require("RabbitMQ", "127.0.0.1", 5672)
    ours, other = (f"outbox-test-{uuid.uuid4().hex[:10]}" for _ in range(2))
    tests = str(Path(__file__).resolve().parent)
    try:
        done = run_python(_DRAMATIQ_WORKER, tmp_path, OUTBOX_DATABASE_URL=f"sqlite:///{tmp_path / 'o.db'}",
                          OUTBOX_DRAMATIQ_BROKER_URL=AMQP_URL, OUTBOX_NAMESPACE=ours, OTHER_OUTBOX=other,
                          PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    finally:
        from kombu import Connection

        with Connection(AMQP_URL) as conn:
            for namespace in (ours, other):
                for queue in Queues(namespace).all:
                    for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
                        conn.default_channel.queue_delete(queue=name)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["before"] and all(name.startswith(f"{ours}.") for name in out["before"]), out["before"]
    assert out["after"] == out["before"]  # no consumer of the other outbox's queues
    assert out["forwarded"] == [other] and out["waiting"] == 1, out  # forwarded once, waiting for its own relay


def test_outbox_queues_prints_the_names_a_workers_q_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from outbox.cli import main
    from outbox.core.config import reset_settings

    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://db/shop")
    monkeypatch.setenv("OUTBOX_TABLE", "orders")
    reset_settings()
    try:
        q = Queues(default_namespace("postgresql://db/shop", "orders"))
        assert CliRunner().invoke(main, ["queues", "publish"]).output == f"{q.publish}\n"
        assert CliRunner().invoke(main, ["queues", "claim", "ack", "purge"]).output == f"{q.claim},{q.ack},{q.purge}\n"
        assert CliRunner().invoke(main, ["queues"]).output == ",".join(q.all) + "\n"
        monkeypatch.setenv("OUTBOX_NAMESPACE", "bad name")
        reset_settings()
        bad = CliRunner().invoke(main, ["queues"])
        assert bad.exit_code == 1 and "OUTBOX_NAMESPACE='bad name'" in bad.output
    finally:
        reset_settings()


def test_outbox_check_names_the_namespace(tmp_path: Path) -> None:
    from outbox.commands.doctor import run_checks

    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'o.db'}", "OUTBOX_NAMESPACE": "shop-orders"}
    [configuration] = [r for r in run_checks(env) if r.name == "configuration"]
    assert "outbox namespace 'shop-orders' (queues shop-orders.claim, ...)" in configuration.detail


def test_a_worker_consuming_none_of_its_outboxs_queues_says_so(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A deployment upgraded from the fixed ``outbox.*`` names with ``-Q outbox.publish``
    would relay nothing, silently: the worker says so at start, once, as an error."""
    from outbox.celery import worker
    from outbox.celery.application import app
    from outbox.core.config import relay_settings

    settings = relay_settings()
    monkeypatch.setattr(app.amqp.queues, "_consume_from", {"outbox.publish": None})  # what -Q sets
    with caplog.at_level("ERROR", logger="outbox"):
        worker._warn_foreign_queues(settings)
    assert any("consumes outbox.publish, none of outbox" in r.getMessage() and "OUTBOX_NAMESPACE=outbox" in
               r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    monkeypatch.setattr(app.amqp.queues, "_consume_from", {settings.queues.publish: None})
    with caplog.at_level("ERROR", logger="outbox"):
        worker._warn_foreign_queues(settings)
    assert not caplog.records  # one of its own queues: nothing to say
