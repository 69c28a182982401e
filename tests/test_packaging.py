"""The package as a user gets it: the sdist and wheel are built from the checkout, the wheel
is installed into fresh virtual environments (no source tree on the path, no test
dependencies that could hide a missing requirement), and the installed commands run.

Marked ``packaging``; it runs in CI with the rest of the suite (about a minute: pip takes
its dependencies from the machine's package index and cache).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from services import REDIS_URL, ROOT, building_the_package, reachable

# One pytest-xdist worker for the module: the sdist and wheel are built once (``dist``).
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600), pytest.mark.xdist_group("packaging")]


def run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run a child and return its output; on failure the assertion shows everything it printed."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(args, cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(args)} exited with {result.returncode}\n"
                                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """sdist and wheel, the wheel built from the sdist (``python -m build``'s default), so a
    file missing from the sdist fails here rather than on a user's machine."""
    out = tmp_path_factory.mktemp("dist")
    with building_the_package():
        run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out)
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def requirements_of(extra: str) -> list[str]:
    """The package's own requirements with ``extra``'s, as pyproject.toml lists them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def fresh_venv(path: Path, requirement: str, *, lowest: str | None = None) -> Path:
    """A new venv with ``requirement`` installed by pip; with ``lowest`` (an extra's name),
    by uv with the package's and that extra's requirements at the lowest versions
    pyproject.toml allows (``--resolution lowest-direct``, as ``make test-lowest`` installs
    the suite's). They are named beside the wheel: uv lowers only what it is asked for."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    python = str(path / "bin" / "python")
    if lowest:
        uv = Path(sys.executable).with_name("uv")
        run([str(uv), "pip", "install", "-q", "--python", python, "--resolution", "lowest-direct", requirement,
             *requirements_of(lowest)], cwd=path)
    else:
        run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement], cwd=path)
    return path / "bin"


def test_the_sdist_and_wheel_hold_the_package_the_schedule_and_the_django_app(dist: dict[str, Path]) -> None:
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    for required in ("beat_schedule.py", "outbox/__init__.py", "outbox/cli.py", "outbox/celery/__init__.py",
                     "outbox/storage/engines/mssql/__init__.py", "outbox/contrib/django/apps.py",
                     "outbox/contrib/django/migrations/0001_initial.py",
                     "outbox/contrib/django/management/commands/outbox_migrate.py"):
        assert required in names, f"{required} missing from the wheel"
    assert not [n for n in names if n.startswith("tests/")], "tests do not belong in the wheel"
    metadata = zipfile.ZipFile(dist["wheel"]).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert 'Requires-Dist: kombu[redis]>=5.7; extra == "redis"' in metadata
    assert 'Requires-Dist: kombu[redis]>=5.7; extra == "postgres"' in metadata
    assert 'Requires-Dist: kombu[redis]>=5.7; extra == "dramatiq"' in metadata  # `outbox check` of its broker
    # The flask extra brings what examples/flask imports and docs/flask.md runs (SQLAlchemy,
    # `alembic upgrade head`, Flask-SQLAlchemy's db.session): it once brought Flask alone.
    for requirement in ("Flask>=3.0", "SQLAlchemy>=2.0", "Flask-SQLAlchemy>=3.1", "alembic>=1.12"):
        assert f'Requires-Dist: {requirement}; extra == "flask"' in metadata, requirement
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "beat_schedule.py", "src/outbox/cli.py"} <= members


def test_the_wheel_alone_runs_the_cli_on_the_embedded_default(dist: dict[str, Path], tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv", str(dist["wheel"]))
    work = tmp_path / "work"
    work.mkdir()
    assert "Usage:" in run([str(bin_dir / "outbox"), "--help"], cwd=work)
    migrated = run([str(bin_dir / "outbox"), "migrate"], cwd=work)
    # No OUTBOX_DATABASE_URL: the default, ./outbox.db, and the command says so.
    assert "sqlite:///outbox.db" in migrated and (work / "outbox.db").exists()
    status = json.loads(run([str(bin_dir / "outbox"), "status", "--json"], cwd=work).splitlines()[0])
    assert status["counts"]["pending"] == 0 and status["dead"] == 0
    # The package imports from the venv, not from the checkout.
    where = run([str(bin_dir / "python"), "-c", "import outbox, beat_schedule; print(outbox.__file__)"], cwd=work)
    assert str(tmp_path / "venv") in where
    assert "Usage:" in run([str(bin_dir / "celery"), "-A", "outbox", "worker", "--help"], cwd=work)
    # `make demo` installs the package alone: the whole demo runs on it (it once failed on
    # an import of kombu's Redis transport, which needs the redis extra).
    demo = run([str(bin_dir / "outbox"), "demo"], cwd=work)
    assert "[ok] every committed event arrived" in demo and "[FAILED]" not in demo, demo
    # DJANGO_SETTINGS_MODULE without Django: said, not silently ignored.
    no_django = run([str(bin_dir / "outbox"), "status"], cwd=work, env={"DJANGO_SETTINGS_MODULE": "shop.settings"})
    assert "DJANGO_SETTINGS_MODULE is set but Django is not installed" in no_django
    # No driver installed for PostgreSQL: the error names the extra to install.
    missing = subprocess.run([str(bin_dir / "outbox"), "status"], cwd=work, capture_output=True, text=True,
                             timeout=60, env={"PATH": os.environ.get("PATH", ""),
                                              "OUTBOX_DATABASE_URL": "postgresql://app:pw@127.0.0.1:5432/app"})
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1].startswith(
        'error: the PostgreSQL driver (psycopg) is not installed: pip install "<outbox-relay checkout>[postgres]"'
    ), missing.stderr


def test_postgres_extra_alone_runs_the_worker_and_beat_on_the_default_redis_broker(
        dist: dict[str, Path], tmp_path: Path) -> None:
    """The database extras bring kombu's Redis transport (the default Celery broker next to a
    server database) with what it imports: the missing `packaging` crashed the worker."""
    bin_dir = fresh_venv(tmp_path / "venv", f"{dist['wheel']}[postgres]")
    work = tmp_path / "work"
    work.mkdir()
    probe = ("import kombu, packaging, psycopg\n"
             "from outbox.celery import app\n"
             "url = app.conf.broker_url\n"
             "assert url.startswith('redis://'), url\n"
             "conn = kombu.Connection(url)\n"
             "print(conn.transport.__module__)\n")
    env = {"OUTBOX_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/test"}
    assert "kombu.transport.redis" in run([str(bin_dir / "python"), "-c", probe], cwd=work, env=env)
    for command in ("worker", "beat"):
        assert "Usage:" in run([str(bin_dir / "celery"), "-A", "outbox", command, "--help"], cwd=work, env=env)
    if reachable("127.0.0.1", 6379):
        # A real round trip through the transport the worker would use.
        ping = (f"import kombu\nc = kombu.Connection({REDIS_URL!r}, connect_timeout=5)\n"
                "c.ensure_connection(max_retries=2)\nc.default_channel.client.ping()\nprint('redis ok')\n")
        assert "redis ok" in run([str(bin_dir / "python"), "-c", ping], cwd=work)


def test_dramatiq_extra_alone_passes_outbox_check_on_a_redis_broker(dist: dict[str, Path], tmp_path: Path) -> None:
    """README: `pip install "./outbox-relay[dramatiq]"`, set OUTBOX_DRAMATIQ_BROKER_URL, run the
    relay. It ran, but `outbox check` failed its broker line with "ModuleNotFoundError: No module
    named 'packaging'" (kombu's Redis transport, which the check uses, without its extra)."""
    from services import require

    require("Redis", "127.0.0.1", 6379)
    bin_dir = fresh_venv(tmp_path / "venv", f"{dist['wheel']}[dramatiq]")
    work = tmp_path / "work"
    work.mkdir()
    env = {"OUTBOX_DRAMATIQ_BROKER_URL": REDIS_URL}
    run([str(bin_dir / "outbox"), "migrate"], cwd=work, env=env)
    report = run([str(bin_dir / "outbox"), "check"], cwd=work, env=env)  # exit 0: no check failed
    assert f"[ok  ] dramatiq broker: {REDIS_URL} reachable" in report, report


@pytest.mark.parametrize("lowest", [False, True], ids=["newest", "lowest"])
def test_following_the_readme_literally_delivers_on_postgres_redis_and_rabbitmq(
        dist: dict[str, Path], tmp_path: Path, lowest: bool) -> None:
    """The README's path in a fresh venv: install with the postgres extra, export the three
    URLs, `outbox migrate`, bind a queue as the README shows, `outbox check`, start
    `celery -A outbox worker` and `beat`, enqueue with the write-side snippet: it arrives.
    Again with Celery, kombu, psycopg and the rest at the lowest versions the package
    allows: under Celery 5.6 a worker took its tasks two at a time, one pair every two seconds.
    Isolation from parallel runs: an own table, exchange and queue, and a Redis key prefix
    (a Celery config module, the only thing the README does not say)."""
    import signal
    import uuid

    from services import AMQP_URL, POSTGRES_URL, require

    require("PostgreSQL", "127.0.0.1", 5432)
    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)
    bin_dir = fresh_venv(tmp_path / "venv", f"{dist['wheel']}[postgres]", lowest="postgres" if lowest else None)
    work = tmp_path / "work"
    work.mkdir()
    if lowest:  # the resolution took the floors: tenacity's, which nothing else raises, says so
        floor = next((r.removeprefix("tenacity>=") for r in requirements_of("postgres") if r.startswith("tenacity>=")),
                     None)
        assert floor, "pyproject.toml lists tenacity with a lower bound"
        got = run([str(bin_dir / "python"), "-c", "import importlib.metadata as m; print(m.version('tenacity'))"],
                  cwd=work).strip()
        assert got in (floor, floor + ".0"), (got, floor)
    tag = uuid.uuid4().hex[:8]
    prefix = f"outbox-readme-{tag}:"
    (work / "relayconf.py").write_text(f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    env = {"OUTBOX_DATABASE_URL": POSTGRES_URL, "OUTBOX_CELERY_BROKER_URL": REDIS_URL,
           "OUTBOX_PUBLISH_URL": AMQP_URL, "OUTBOX_TABLE": f"readme_{tag}", "OUTBOX_EXCHANGE": f"outbox-readme-{tag}",
           "CELERY_CONFIG_MODULE": "relayconf", "PYTHONPATH": str(work), "OUTBOX_CLAIM_INTERVAL_S": "0.5",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    python = str(bin_dir / "python")
    # The README's binding snippet (queue and exchange names made unique).
    bind = (f"from kombu import Connection, Exchange, Queue\n"
            f"exchange = Exchange({env['OUTBOX_EXCHANGE']!r}, type='topic', durable=True)\n"
            f"queue = Queue('billing-{tag}', exchange, routing_key='orders.#', durable=True)\n"
            f"with Connection({AMQP_URL!r}) as conn:\n"
            f"    queue(conn.default_channel).declare()\n")
    # The README's write-side snippet (psycopg 3, %s placeholders).
    write = (f"import psycopg\nfrom outbox import enqueue\n"
             f"with psycopg.connect({POSTGRES_URL!r}) as conn:\n"
             f"    conn.execute('CREATE TABLE IF NOT EXISTS orders_{tag} (id int primary key, state text)')\n"
             f"    conn.execute(\"INSERT INTO orders_{tag} VALUES (%s, 'created')\", (42,))\n"
             f"    outbox_id = enqueue(conn, topic='orders.created', aggregate_type='order', aggregate_id='42',\n"
             f"                        payload={{'orderId': '42'}}, headers={{'x-tenant': 'acme'}})\n"
             f"print(outbox_id)\n")
    consume = (f"from kombu import Connection, Queue\n"
               f"with Connection({AMQP_URL!r}) as conn:\n"
               f"    q = conn.SimpleQueue(Queue('billing-{tag}', no_declare=True))\n"
               f"    m = q.get(timeout=60)\n"
               f"    print(m.headers['topic'], m.body if isinstance(m.body, str) else m.body.decode())\n"
               f"    m.ack()\n")
    procs: list[subprocess.Popen] = []
    try:
        assert "migrated" in run([str(bin_dir / "outbox"), "migrate"], cwd=work, env=env)
        run([python, "-c", bind], cwd=work, env=env)
        run([str(bin_dir / "outbox"), "check"], cwd=work, env=env)
        for name in ("worker", "beat"):
            with open(tmp_path / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([str(bin_dir / "celery"), "-A", "outbox", name, "--loglevel=INFO"],
                                              cwd=work, env={**os.environ, **env}, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        run([python, "-c", write], cwd=work, env=env)
        arrived = run([python, "-c", consume], cwd=work, env=env, timeout=120)
        assert 'orders.created {"orderId": "42"}' in arrived
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        cleanup = (f"import psycopg, redis\nfrom kombu import Connection, Exchange, Queue\n"
                   f"with psycopg.connect({POSTGRES_URL!r}, autocommit=True) as c:\n"
                   f"    c.execute('DROP TABLE IF EXISTS readme_{tag}, readme_{tag}_holders'); c.execute('DROP TABLE IF EXISTS orders_{tag}')\n"
                   f"with Connection({AMQP_URL!r}) as conn:\n"
                   f"    Queue('billing-{tag}')(conn.default_channel).delete()\n"
                   f"    Exchange({env['OUTBOX_EXCHANGE']!r})(conn.default_channel).delete()\n"
                   f"r = redis.Redis.from_url({REDIS_URL!r})\n"
                   f"[r.delete(k) for k in r.scan_iter(match={prefix + '*'!r})]\n")
        subprocess.run([python, "-c", cleanup], cwd=work, timeout=60)
