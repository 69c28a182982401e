"""docker-compose.yml and the relay image, checked without Docker: every service, image,
command, dependency and setting against the package, and the image's entrypoint run here
as the image runs it (an unprivileged user, a read-only working directory)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml
from services import ROOT, building_the_package

from outbox.core.config import known_names, load_settings
from outbox.relay import RelayOptions

COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (ROOT / "worker" / "Dockerfile").read_text()
ENTRYPOINT = ROOT / "worker" / "entrypoint.sh"
RELAY_SERVICES = ("migrate", "worker", "beat")
#: The verbs worker/entrypoint.sh handles itself.
VERBS = {"worker", "beat", "migrate", "check"}


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def known_outbox_names() -> set[str]:
    """Every OUTBOX_* name the package reads: the names its option families declare
    (the contract's settings, the relay's options, wake-ups, LISTEN, metrics, ...)."""
    return set(known_names())


def service_env(name: str) -> dict[str, str]:
    service = SERVICES[name]
    env: dict[str, str] = {}
    for path in service.get("env_file", []):
        env.update(env_file(ROOT / path))
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
    return env


def test_every_service_the_stack_needs_is_there() -> None:
    assert set(SERVICES) >= {"mssql", "mssql-init", "redis", "rabbitmq", "migrate", "worker", "beat", "web"}
    assert SERVICES["mssql"]["image"].startswith("mcr.microsoft.com/mssql/server:2022")
    assert "management" in SERVICES["rabbitmq"]["image"]
    assert SERVICES["redis"]["image"].startswith("redis:")


def test_host_ports_stay_off_a_developers_own_services() -> None:
    """Every published port is on 127.0.0.1, set by a variable, and its default is not the
    service's usual port: the stack once took 1433, 6379, 5672 and 15672 from the host,
    clashing with a developer's own Redis and RabbitMQ."""
    usual = {"1433", "6379", "5672", "15672"}
    for name, service in SERVICES.items():
        for mapping in service.get("ports", []):
            match = re.fullmatch(r"127\.0\.0\.1:\$\{([A-Z_]+_HOST_PORT):-(\d+)\}:(\d+)", mapping)
            assert match, f"{name}: {mapping!r} is not 127.0.0.1:${{NAME_HOST_PORT:-default}}:port"
            assert match.group(2) not in usual, f"{name}: default host port {match.group(2)} clashes"
            assert match.group(1) in COMPOSE_TEXT.split("services:", 1)[0], f"{match.group(1)} is not documented"
    assert "15672" in " ".join(SERVICES["rabbitmq"]["ports"])  # the management UI is still published


def test_the_example_queue_is_bound_before_the_worker_starts() -> None:
    """Nothing bound a queue, so the shop's first event was unroutable: a one-shot binds
    shop.orders to the exchange on the destination broker, and the worker waits for it."""
    bind = SERVICES["bind-queue"]
    code = bind["command"][2]
    assert bind["command"][:2] == ["python", "-c"] and bind["restart"] == "no"
    compile(code, "bind-queue", "exec")
    assert "os.environ['OUTBOX_EXCHANGE']" in code and "os.environ['OUTBOX_PUBLISH_URL']" in code
    assert "routing_key='orders.#'" in code and "durable=True" in code
    assert SERVICES["worker"]["depends_on"]["bind-queue"]["condition"] == "service_completed_successfully"
    assert service_env("bind-queue")["OUTBOX_PUBLISH_URL"].startswith("amqp://")


def test_worker_and_beat_have_healthchecks_that_can_fail() -> None:
    worker = SERVICES["worker"]["healthcheck"]["test"]
    assert worker[0] == "CMD-SHELL" and "celery -A outbox inspect ping" in worker[1] and "$$HOSTNAME" in worker[1]
    beat = SERVICES["beat"]["healthcheck"]["test"]
    # The schedule file is rewritten every 3 minutes while beat ticks; older than 5 fails.
    assert beat[0] == "CMD-SHELL" and "$$BEAT_SCHEDULE_FILE" in beat[1] and "-mmin -5" in beat[1]


def test_dependencies_exist_and_wait_for_health_or_completion() -> None:
    for name, service in SERVICES.items():
        depends = service.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions, not a list"
        for dependency, spec in depends.items():
            assert dependency in SERVICES, f"{name} depends on unknown service {dependency}"
            condition = spec["condition"]
            assert condition in ("service_healthy", "service_completed_successfully", "service_started"), (
                name, dependency)
            if condition == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], f"{dependency} has no healthcheck for {name}"
            elif condition == "service_started":
                assert SERVICES[name].get("profiles") == ["monitoring"], f"{name} must wait for health or completion"
            else:
                assert SERVICES[dependency].get("restart") == "no", f"{dependency} is a one-shot: restart no"
    # The workers wait for the migrate one-shot, which waits for the database.
    for name in ("worker", "beat", "web"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert SERVICES["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert SERVICES["worker"]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert "mssql-init" in SERVICES["migrate"]["depends_on"]
    assert SERVICES["mssql-init"]["depends_on"]["mssql"]["condition"] == "service_healthy"


def test_healthchecks_use_the_tools_the_images_ship() -> None:
    mssql = " ".join(SERVICES["mssql"]["healthcheck"]["test"])
    assert "/opt/mssql-tools18/bin/sqlcmd" in mssql and " -C " in mssql  # tools18: trust the self-signed cert
    assert SERVICES["redis"]["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    assert "rabbitmq-diagnostics" in SERVICES["rabbitmq"]["healthcheck"]["test"]
    init = " ".join(SERVICES["mssql-init"]["command"])
    assert "CREATE DATABASE shop" in init
    url = service_env("migrate")["OUTBOX_DATABASE_URL"]
    assert "/shop?" in url  # the database mssql-init creates


def test_relay_services_run_the_entrypoints_verbs_on_the_relay_image() -> None:
    for name in RELAY_SERVICES:
        service = SERVICES[name]
        assert service["build"] == {"context": ".", "dockerfile": "worker/Dockerfile", "target": "relay"}, name
        command = service["command"]
        assert command[0] in VERBS, f"{name}: {command}"
        assert service.get("read_only") is True, f"{name} should run on a read-only root filesystem"
    beat = SERVICES["beat"]
    schedule = service_env("beat")["BEAT_SCHEDULE_FILE"]
    mount = beat["volumes"][0].split(":")[1]
    assert schedule.startswith(mount + "/"), "beat's schedule must be on its writable volume"
    assert beat["volumes"][0].split(":")[0] in COMPOSE["volumes"]
    assert SERVICES["web"]["build"]["target"] == "web"


def test_every_setting_is_one_the_package_reads_and_is_valid() -> None:
    known = known_outbox_names()
    for name in (*RELAY_SERVICES, "web"):
        env = service_env(name)
        unknown = sorted(k for k in env if k.startswith("OUTBOX_") and k not in known)
        assert not unknown, f"{name}: unknown settings {unknown}"
        settings = load_settings(environ={k: v for k, v in env.items() if k.startswith("OUTBOX_")})
        assert settings.database_url.startswith("mssql+pyodbc://")
        assert settings.broker_url == "redis://redis:6379/0"
        assert settings.publish_url.startswith("amqp://") and "@rabbitmq:5672" in settings.publish_url
        RelayOptions.from_sources(env)
    # The driver the URL names is the one the image installs.
    from outbox.storage.engines.mssql import odbc_connection_string

    odbc = odbc_connection_string(service_env("worker")["OUTBOX_DATABASE_URL"])
    assert "DRIVER={ODBC Driver 18 for SQL Server}" in odbc and "TrustServerCertificate=yes" in odbc
    assert "SERVER=mssql,1433" in odbc and "DATABASE=shop" in odbc
    # SQL Server's password is the one the database container is given.
    assert SERVICES["mssql"]["environment"]["MSSQL_SA_PASSWORD"] in service_env("worker")["OUTBOX_DATABASE_URL"]


def test_the_web_app_uses_the_outbox_database_through_djangos_settings() -> None:
    sys.path.insert(0, str(ROOT / "examples" / "django"))
    try:
        from shop import settings as shop_settings
    finally:
        sys.path.pop(0)
    env = service_env("web")
    db = shop_settings._database(env["DATABASE_URL"])
    assert db["ENGINE"] == "mssql" and db["NAME"] == "shop" and db["HOST"] == "mssql"
    assert db["OPTIONS"] == {"driver": "ODBC Driver 18 for SQL Server", "extra_params": "TrustServerCertificate=yes"}
    from outbox.core.config import django_database_url
    from outbox.storage.engines.mssql import odbc_connection_string

    # Derived from DATABASES or given as OUTBOX_DATABASE_URL: the same connection.
    assert odbc_connection_string(django_database_url(db)) == odbc_connection_string(env["OUTBOX_DATABASE_URL"])
    assert env["DJANGO_SETTINGS_MODULE"] == "shop.settings"
    assert (ROOT / "examples" / "django" / "manage.py").exists()


def test_the_image_installs_the_odbc_driver_the_documented_way_and_no_spark() -> None:
    assert "packages.microsoft.com/config/debian/" in DOCKERFILE and "packages-microsoft-prod.deb" in DOCKERFILE
    assert "ACCEPT_EULA=Y apt-get install -y --no-install-recommends msodbcsql18 unixodbc" in DOCKERFILE
    assert "slim-bookworm" in DOCKERFILE  # the Debian release Microsoft's repository is chosen for
    install = re.search(r'pip install --no-cache-dir "\.\[([a-z,]+)\]"', DOCKERFILE)
    assert install, "the relay stage installs the package with its extras"
    extras = set(install.group(1).split(","))
    assert "spark" not in extras and "all" not in extras
    from importlib.metadata import metadata

    declared = set(metadata("outbox-relay").get_all("Provides-Extra"))
    assert extras <= declared, extras - declared
    assert {"mssql", "redis"} <= extras
    # Every file the image copies exists.
    for source in re.findall(r"^COPY ([^\n]+) \S+$", DOCKERFILE, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: no such file"
    relay_stage = DOCKERFILE.split("AS web")[0]
    assert re.search(r"^USER relay$", relay_stage, re.MULTILINE) and "/var/lib/outbox" in relay_stage
    assert 'ENTRYPOINT ["/usr/local/bin/outbox-entrypoint"]' in relay_stage


def test_the_entrypoints_commands_exist_in_the_package() -> None:
    text = ENTRYPOINT.read_text()
    scripts = {ep.name for ep in entry_points(group="console_scripts")}
    assert "outbox" in scripts and "celery" in scripts
    for verb in VERBS:
        assert re.search(rf"^\s+{verb}\)", text, re.MULTILINE), f"entrypoint.sh does not handle {verb}"
    assert "celery -A outbox worker" in text and "celery -A outbox beat" in text
    assert "outbox migrate" in text and "outbox check" in text


# -- the entrypoint, run as the image runs it ------------------------------------------------------

NOBODY = 65534


@pytest.fixture
def readonly_app() -> Iterator[dict[str, Path]]:
    """A read-only /app-like directory holding the entrypoint, and a writable state
    directory (the volume), both usable by an unprivileged user."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    base = Path(tempfile.mkdtemp(prefix="outbox-image-"))
    app, state = base / "app", base / "state"
    app.mkdir()
    state.mkdir()
    shutil.copy(ENTRYPOINT, app / "entrypoint.sh")
    (app / "entrypoint.sh").chmod(0o555)
    app.chmod(0o555)
    os.chown(state, NOBODY, NOBODY)
    base.chmod(0o755)
    try:
        yield {"app": app, "state": state}
    finally:
        app.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def image_bin() -> Iterator[Path]:
    """The package installed (not editable) into a fresh venv, as the image's ``pip install``
    does, on an interpreter the unprivileged user can run (this machine's own Python may
    live under a home directory only root can enter)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    python = next((p for p in (sys._base_executable, "/usr/bin/python3", "/usr/local/bin/python3")
                   if p and os.path.exists(p) and _runs_as_nobody(p)), None)
    if python is None:
        pytest.skip("no Python 3.11+ that an unprivileged user can run")
    base = Path(tempfile.mkdtemp(prefix="outbox-image-venv-"))
    base.chmod(0o755)
    try:
        subprocess.run([python, "-m", "venv", str(base / "venv")], check=True, timeout=120)
        with building_the_package():  # pip builds the wheel in the tree
            result = subprocess.run([str(base / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
                                     "--disable-pip-version-check", f"{ROOT}[redis]"], capture_output=True,
                                    text=True, timeout=600, cwd=base)
        assert result.returncode == 0, result.stdout + result.stderr
        yield base / "venv" / "bin"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _runs_as_nobody(python: str) -> bool:
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c",
                            f"exec {python} -c 'import sys; assert sys.version_info >= (3, 11)'"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def as_nobody(args: list[str], cwd: Path, env: dict[str, str], bin_dir: Path) -> Any:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OUTBOX_", "CELERY_", "DJANGO_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    full = {**clean, "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(cwd),
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **env}
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args], full


def test_the_entrypoint_runs_migrate_worker_and_beat_unprivileged_in_a_read_only_directory(
        readonly_app: dict[str, Path], image_bin: Path) -> None:
    from services import AMQP_URL, REDIS_URL, require

    require("RabbitMQ", "127.0.0.1", 5672)
    require("Redis", "127.0.0.1", 6379)
    from relay_e2e_support import Destination, wait_until

    from outbox import enqueue

    app, state = readonly_app["app"], readonly_app["state"]
    entry = str(app / "entrypoint.sh")
    destination = Destination()
    prefix = f"outbox-image-{uuid.uuid4().hex[:8]}:"
    (state / "relayconf.py").write_text(f"broker_transport_options = {{'global_keyprefix': {prefix!r}}}\n")
    os.chown(state / "relayconf.py", NOBODY, NOBODY)
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{state / 'outbox.db'}", "OUTBOX_PUBLISH_URL": AMQP_URL,
           "OUTBOX_EXCHANGE": destination.exchange_name, "OUTBOX_CELERY_BROKER_URL": REDIS_URL,
           "OUTBOX_CLAIM_INTERVAL_S": "0.5", "CELERY_CONFIG_MODULE": "relayconf", "PYTHONPATH": str(state),
           "BEAT_SCHEDULE_FILE": str(state / "celerybeat-schedule")}
    procs: list[subprocess.Popen] = []
    logs = {name: state / f"{name}.log" for name in ("worker", "beat")}
    try:
        args, full = as_nobody([entry, "migrate"], app, env, image_bin)
        migrated = subprocess.run(args, cwd=app, env=full, capture_output=True, text=True, timeout=60)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        assert os.listdir(app) == ["entrypoint.sh"]  # nothing written where the image's code is
        for name, extra in (("worker", ["-c", "1", "--without-mingle", "--without-gossip"]), ("beat", [])):
            args, full = as_nobody([entry, name, *extra], app, env, image_bin)
            with open(logs[name], "wb") as out:
                procs.append(subprocess.Popen(args, cwd=app, env=full, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        conn = __import__("sqlite3").connect(state / "outbox.db")
        for n in range(5):
            enqueue(conn, topic="orders.created", aggregate_type="order", aggregate_id="1", payload={"n": n})
        conn.commit()
        conn.close()

        def dump() -> str:
            return "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-3000:]}" for n, p in logs.items()
                             if p.exists())

        assert destination.wait_for(lambda: len(destination.messages) >= 5, timeout=60), dump()
        assert [__import__("json").loads(m.body)["n"] for m in destination.messages] == [0, 1, 2, 3, 4]
        assert wait_until(lambda: (state / "celerybeat-schedule").exists()
                          or any(p.name.startswith("celerybeat-schedule") for p in state.iterdir()), 20), dump()
        assert os.listdir(app) == ["entrypoint.sh"], dump()
        for proc in procs:
            assert proc.poll() is None, dump()
    finally:
        import signal

        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        destination.close()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)


def test_monitoring_scrapes_the_workers_metrics_port_and_the_dashboard_uses_real_metrics() -> None:
    import json

    prometheus = yaml.safe_load((ROOT / "worker" / "monitoring" / "prometheus.yml").read_text())
    target = prometheus["scrape_configs"][0]["dns_sd_configs"][0]
    assert target["names"] == ["worker"] and "worker" in SERVICES
    assert str(target["port"]) == service_env("worker")["OUTBOX_RELAY_METRICS_PORT"]
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"]
        for volume in SERVICES[name]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    dashboard = json.loads((ROOT / "worker" / "monitoring" / "grafana" / "dashboards" / "outbox.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        check_metric_names(expr, "the dashboard")


def declared_metrics() -> dict[str, str]:
    """outbox.relay.metrics' metrics: name -> Counter, Gauge or Histogram."""
    source = (ROOT / "src" / "outbox" / "relay" / "metrics.py").read_text()
    return {metric: kind for kind, metric in re.findall(r'(Counter|Gauge|Histogram)\("(outbox_[a-z_]+)"', source)}


def check_metric_names(expr: str, where: str) -> None:
    """Every metric ``expr`` names is exported, with a suffix its type has; a gauge (a
    database-wide figure every worker reads) is never summed over the workers."""
    kinds = declared_metrics()
    names = re.findall(r"outbox_[a-z_]+", expr)
    assert names, f"{where}: {expr} names no outbox metric"
    for used in names:
        base = re.sub(r"_(total|bucket|sum|count)$", "", used)
        if base not in kinds:
            base = used
        assert base in kinds, f"{where} queries {used}, which outbox.relay.metrics does not export"
        if used.endswith("_total"):
            assert kinds[base] == "Counter", used
        if used.endswith(("_bucket", "_count", "_sum")):
            assert kinds[base] == "Histogram", used
        if kinds[base] == "Gauge":
            assert not re.search(rf"sum\s*(by\s*\([^)]*\)\s*)?\(\s*{used}\b", expr), (
                f"{where}: {expr} multiplies a database-wide gauge by the number of workers (use max)")


def test_the_alert_rules_are_loaded_and_name_only_real_metrics() -> None:
    """promtool is not installed here: the rules' structure as Prometheus reads it, and
    each expression's metrics against outbox.relay.metrics."""
    prometheus = yaml.safe_load((ROOT / "worker" / "monitoring" / "prometheus.yml").read_text())
    (rule_file,) = prometheus["rule_files"]
    mounts = dict(v.split(":")[1::-1] for v in SERVICES["prometheus"]["volumes"])  # container path -> source
    source = ROOT / mounts[rule_file]
    rules = yaml.safe_load(source.read_text())
    assert set(rules) == {"groups"}
    alerts: dict[str, str] = {}
    for group in rules["groups"]:
        assert set(group) == {"name", "rules"} and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"]) and rule["alert"] not in alerts, rule
            assert isinstance(rule["expr"], str) and rule["expr"].count("(") == rule["expr"].count(")"), rule
            assert re.fullmatch(r"\d+[smh]", str(rule.get("for", "0s"))), rule
            assert rule["labels"]["severity"] in ("critical", "warning"), rule
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
            check_metric_names(rule["expr"], f"alert {rule['alert']}")
            alerts[rule["alert"]] = rule["expr"]
    # What an operator needs: the relay stopped, lag over N s, dead events rising.
    assert "outbox_claim_seconds_count" in alerts["OutboxRelayStopped"]
    assert re.search(r"outbox_oldest_undelivered_age_seconds\) > \d+", alerts["OutboxLagHigh"])
    assert "increase(outbox_dead_total" in alerts["OutboxDeadEventsRising"]
