"""Prometheus metrics of the relay (opt-in: the ``metrics`` extra): the
metrics, their options and prefork's multiprocess mode, docs/waking-and-metrics.md, "Metrics".

The relay reports through its hooks (``relay.hooks.RelayHooks``); ``PrometheusHooks`` turns
them into these metrics, and the runners install it when metrics are on (``relay_hooks``).
Every call is a no-op while metrics are off."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from ..core.config import metrics_options
from ..core.errors import install_hint
from ..core.model import Claim, FailureKind, OutboxMessage
from .hooks import RelayHooks
from .state import private_dir

log = logging.getLogger("outbox.relay.metrics")

#: Histogram buckets (seconds).
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PUBLISH_BUCKETS = CLAIM_BUCKETS
AGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
#: ``outbox_failed_total{kind}`` starts at 0 for each.
FAILURE_KINDS = tuple(kind.value for kind in FailureKind)
#: A failed reading of the gauges is logged as a warning at most this often.
WARN_EVERY_S = 60.0


class Metrics:
    """The relay's metric objects, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.claimed = Counter("outbox_claimed", "Rows leased by claims", registry=r)
        self.empty_claims = Counter("outbox_empty_claims", "Claims that leased no row", registry=r)
        self.published = Counter("outbox_published", "Events confirmed by the broker", registry=r)
        self.failed = Counter("outbox_failed", "Failed deliveries by failure kind", ["kind"], registry=r)
        for kind in FAILURE_KINDS:  # each kind reads 0, not "no data", before its first failure
            self.failed.labels(kind=kind)
        self.dead = Counter("outbox_dead", "Rows that went dead", registry=r)
        self.in_flight = Gauge("outbox_in_flight", "Rows currently claimed (leased, not settled)",
                               multiprocess_mode="mostrecent", registry=r)
        self.backlog = Gauge("outbox_backlog", "Open rows: pending, claimed or failed",
                             multiprocess_mode="mostrecent", registry=r)
        self.lag = Gauge("outbox_lag_seconds", "Age of the oldest open row at the last reading",
                         multiprocess_mode="mostrecent", registry=r)
        self.oldest_age = Gauge("outbox_oldest_undelivered_age_seconds",
                                "Age of the oldest undelivered (open) row, rising on while readings fail",
                                multiprocess_mode="mostrecent", registry=r)
        self.read_at = Gauge("outbox_gauges_read_timestamp_seconds",
                             "Unix time of the last successful reading of the gauges",
                             multiprocess_mode="mostrecent", registry=r)
        self.claim_seconds = Histogram("outbox_claim_seconds", "Duration of one claim", buckets=CLAIM_BUCKETS,
                                       registry=r)
        self.publish_seconds = Histogram("outbox_publish_seconds", "Duration of one publish call (all its chains), confirmations included",
                                         buckets=PUBLISH_BUCKETS, registry=r)
        self.event_age = Histogram("outbox_event_age_seconds", "Commit to publish confirmation",
                                   buckets=AGE_BUCKETS, registry=r)
        self.refresh_s = metrics_options().refresh_s
        self._refreshed = 0.0
        self._refresh_lock = threading.Lock()
        #: (monotonic time, oldest row's age) of the last successful reading.
        self._last_read: tuple[float, float] | None = None
        self._warned = -WARN_EVERY_S


# -- on / off -----------------------------------------------------------------------------------

#: None: not decided yet in this process; False: off; else the active Metrics.
_state: Any = None
_state_lock = threading.Lock()


def configured_port() -> int | None:
    """OUTBOX_RELAY_METRICS_PORT, or None when metrics are off."""
    return metrics_options().port


def active() -> Metrics | None:
    """The active metrics, deciding on first use from OUTBOX_RELAY_METRICS_PORT."""
    global _state
    state = _state
    if state is None:
        with _state_lock:
            if _state is None:
                try:
                    _state = Metrics() if configured_port() else False
                except ImportError:
                    log.warning("outbox metrics: OUTBOX_RELAY_METRICS_PORT is set but prometheus_client is not "
                                f"installed ({install_hint('metrics')}); metrics are off")
                    _state = False
                except Exception as exc:  # noqa: BLE001 - metrics must never stop the relay
                    log.error("outbox metrics: off (%s: %s)", type(exc).__name__, exc)
                    _state = False
            state = _state
    return state or None


def enable(registry: Any = None) -> Metrics:
    """Turn metrics on in this process (tests, or an embedding application)."""
    global _state
    with _state_lock:
        _state = Metrics(registry)
        return _state


def disable() -> None:
    global _state
    with _state_lock:
        _state = False


def reset() -> None:
    """Forget the decision: the next call reads the setting again."""
    global _state
    with _state_lock:
        _state = None


# -- what the relay reports (all no-ops when off) ---------------------------------------------------

def _guard(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> None:
        m = active()
        if m is None:
            return
        try:
            fn(m, *args, **kwargs)
        except Exception:  # metrics must never break the relay
            log.debug("outbox metrics: %s failed", fn.__name__, exc_info=True)
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_guard
def claimed(m: Metrics, claim: Claim, seconds: float) -> None:
    """A claim returned: its rows, its duration, and the rows it found dead."""
    m.claim_seconds.observe(seconds)
    m.claimed.inc(len(claim.messages))
    if not claim.messages and not claim.dead:
        m.empty_claims.inc()
    dead = len(claim.dead)
    if dead:
        m.dead.inc(dead)


@_guard
def sent(m: Metrics, chains: int, seconds: float) -> None:
    """One publish call (all the chains of a task, or of a claim's own share) and how long it
    took: ``outbox_publish_seconds``. It was observed once per chain, each time with the
    whole call's time, so its sum overstated publishing N times for N chains (found in review;
    docs/waking-and-metrics.md, "Metrics")."""
    m.publish_seconds.observe(seconds)


@_guard
def chain(m: Metrics, published: Iterable[OutboxMessage], seconds: float, failed_kind: str | None) -> None:
    """One chain went through the publisher: its confirmed prefix and the failure kind of the
    event that stopped it (None when the whole chain went). ``seconds``, its call's, is ``sent``'s."""
    now = datetime.now(UTC)
    count = 0
    for message in published:
        count += 1
        created = message.created_at
        if isinstance(created, datetime):
            if created.tzinfo is None:
                created = created.replace(tzinfo=UTC)
            m.event_age.observe(max(0.0, (now - created).total_seconds()))
    if count:
        m.published.inc(count)
    if failed_kind:
        m.failed.labels(kind=failed_kind).inc()


@_guard
def dead(m: Metrics, count: int = 1) -> None:
    m.dead.inc(count)


@_guard
def refresh(m: Metrics, store: Any, force: bool = False) -> None:
    """Read the gauges from the open rows (``store.gauges()``, one query), at most every
    ``refresh_s`` per process unless ``force``. The refresher thread calls it, never a
    claim. A failed reading keeps the last values, except the oldest undelivered row's
    age, which goes on rising from the last reading (docs/waking-and-metrics.md, "Metrics")."""
    now = time.monotonic()
    if not force and now - m._refreshed < m.refresh_s:
        return
    if not m._refresh_lock.acquire(blocking=False):
        return  # another thread of this process is at it
    try:
        m._refreshed = now
        gauges = getattr(store, "gauges", None)  # a stand-in store may have none
        if gauges is None:
            return
        try:
            in_flight, backlog, lag = gauges()
        except Exception as exc:  # noqa: BLE001 - a failed reading is reported, never raised into the relay
            _reading_failed(m, now, exc)
            return
        m._last_read = (now, lag)
        m.in_flight.set(in_flight)
        m.backlog.set(backlog)
        m.lag.set(lag)
        m.oldest_age.set(lag)
        m.read_at.set(time.time())
    finally:
        m._refresh_lock.release()


def _reading_failed(m: Metrics, now: float, exc: Exception) -> None:
    if m._last_read is not None and m._last_read[1] > 0:  # rows were waiting: they still are, older
        read_at, age = m._last_read
        m.oldest_age.set(age + (now - read_at))
    if now - m._warned >= WARN_EVERY_S:
        m._warned = now
        log.warning("outbox metrics: cannot read the gauges (%s: %s); they keep their last values, and "
                    "outbox_oldest_undelivered_age_seconds rises on", type(exc).__name__, " ".join(str(exc).split()))
    else:
        log.debug("outbox metrics: cannot read the gauges (%s: %s)", type(exc).__name__, exc)


# -- the relay's hooks -----------------------------------------------------------------------------

class PrometheusHooks(RelayHooks):
    """The relay's events (``RelayHooks``) as the metrics above: each a no-op while metrics are off."""

    def after_claim(self, claim: Claim, seconds: float) -> None:
        claimed(claim, seconds)

    def after_send(self, chains: int, seconds: float) -> None:
        sent(chains, seconds)

    def after_chain(self, published: Sequence[OutboxMessage], seconds: float, failed_kind: str | None) -> None:
        chain(published, seconds, failed_kind)

    def after_dead(self, count: int = 1) -> None:
        dead(count)


def relay_hooks() -> RelayHooks:
    """The hooks a runner gives its relay: ``PrometheusHooks`` when OUTBOX_RELAY_METRICS_PORT is
    set (an invalid value included: the worker's start-up says why metrics are off), else none."""
    try:
        on = configured_port() is not None
    except Exception:  # noqa: BLE001 - reported by ``active()`` when the worker starts the metrics
        on = True
    return PrometheusHooks() if on else RelayHooks()


# -- the refresher: the gauges on their own schedule ------------------------------------------------

class GaugeRefresher:
    """A daemon thread that reads the gauges every ``interval_s`` with its own store
    (``store_factory()``, made on first use): the gauges move whether or not claims run
    (beat stopped, a breaker open, claims failing), and a claim never waits for them. One
    per worker (the process that serves the metrics): one query per interval per worker."""

    def __init__(self, store_factory: Callable[[], Any], interval_s: float) -> None:
        self.store_factory = store_factory
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-metrics-gauges", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        store = None
        try:
            while not self._stop.is_set():
                if store is None:
                    try:
                        store = self.store_factory()
                    except Exception as exc:  # noqa: BLE001 - e.g. a missing driver: said once per interval at DEBUG
                        log.debug("outbox metrics: no store for the gauges: %s", exc)
                if store is not None:
                    refresh(store, force=True)
                self._stop.wait(self.interval_s)
        finally:
            if store is not None:
                try:
                    store.close()
                except Exception:
                    log.debug("outbox metrics: error closing the gauges' store", exc_info=True)


_refresher: GaugeRefresher | None = None


def start_refresher(store_factory: Callable[[], Any]) -> GaugeRefresher | None:
    """Start this process's refresher (once; None while metrics are off). The worker
    starts it with the endpoint; an embedding application that serves the metrics itself
    calls it with a function returning an ``OutboxStore``."""
    global _refresher
    m = active()
    if m is None:
        return None
    with _state_lock:
        if _refresher is None:
            _refresher = GaugeRefresher(store_factory, m.refresh_s)
            _refresher.start()
        return _refresher


def stop_refresher() -> None:
    global _refresher
    with _state_lock:
        refresher, _refresher = _refresher, None
    if refresher is not None:
        refresher.stop()


# -- serving ---------------------------------------------------------------------------------------

_server: Any = None
_own_dir: str | None = None
#: The directory a Dramatiq worker's processes share (``prepare_multiprocess(parent)``).
_shared_dir: str | None = None


def multiprocess_dir() -> str:
    """PROMETHEUS_MULTIPROC_DIR, or "" when prometheus_client is not in multiprocess mode."""
    return (os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            or os.environ.get("prometheus_multiproc_dir") or "")  # noqa: SIM112 - prometheus_client's older name


def multiprocess_mode() -> bool:
    return bool(multiprocess_dir())


def prepare_multiprocess(parent: int | None = None) -> None:
    """Before prometheus_client is imported in a worker's process: give it a
    PROMETHEUS_MULTIPROC_DIR unless one is set, so the metrics of all the worker's processes
    are summed. A fresh one in a Celery worker's main process (before its pool forks); with
    ``parent``, in each of a Dramatiq worker's processes, the one of that parent's processes
    (docs/dramatiq.md, "Middleware")."""
    global _own_dir, _shared_dir
    if multiprocess_mode():
        return
    if "prometheus_client" in sys.modules:
        log.warning("outbox metrics: prometheus_client was imported before the worker started without "
                    "PROMETHEUS_MULTIPROC_DIR; only this process's metrics are served (fine with --pool threads "
                    "or solo; with prefork set PROMETHEUS_MULTIPROC_DIR to an empty directory)")
        return
    # In this user's own directory (state.private_dir): a name in the temp directory that others
    # can foresee, they could make first or fill (docs/waking-and-metrics.md, "Prefork").
    private = private_dir()
    if private is None:
        log.warning("outbox metrics: no directory of this user's own for the worker's processes (see the warning "
                    "above); only this process's metrics are served (set PROMETHEUS_MULTIPROC_DIR to an empty "
                    "directory)")
        return
    if parent is None:
        _own_dir = tempfile.mkdtemp(prefix="metrics-", dir=private)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _own_dir
        return
    # The parent's start time too: a directory left by a killed worker whose pid came round again is not this one's.
    path = os.path.join(private, f"metrics-{parent}-{_started(parent)}")
    with contextlib.suppress(FileExistsError):  # made by a sibling
        os.mkdir(path, 0o700)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        log.warning("outbox metrics: %s is not a directory of this user's alone; only this process's metrics are "
                    "served (set PROMETHEUS_MULTIPROC_DIR to an empty directory)", path)
        return
    _shared_dir = path
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def _started(pid: int) -> str:
    """When process ``pid`` started, in clock ticks since boot (Linux), else "0"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return "0"


#: The file of each type (``counter_folded.db``) that holds the counts of processes that are gone.
FOLDED = "folded"


def _gone(pid: str) -> bool:
    """Whether no process has this pid (a zombie not yet reaped still counts as there)."""
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's: there
        return False
    return False


def fold_gone(path: str) -> int:
    """Fold the counter and histogram files of processes that are gone into one file per
    type and remove them, with their gauge files (docs/waking-and-metrics.md, "Prefork").
    Returns how many processes were folded. The serving process calls it before each scrape."""
    from prometheus_client.mmap_dict import MmapedDict

    gone: dict[str, list[str]] = {"counter": [], "histogram": [], "gauge": []}
    pids = set()
    for name in os.listdir(path):
        typ = name.partition("_")[0]
        pid = name.removesuffix(".db").rpartition("_")[2]  # counter_<pid>.db, gauge_<mode>_<pid>.db
        if name.endswith(".db") and typ in gone and _gone(pid):
            gone[typ].append(os.path.join(path, name))
            pids.add(pid)
    for f in gone.pop("gauge"):  # a gone process's gauges are not reported
        os.remove(f)
    for typ, files in gone.items():
        if not files:
            continue
        folded = MmapedDict(os.path.join(path, f"{typ}_{FOLDED}.db"))
        try:
            for f in files:
                for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(f):
                    total, _ = folded.read_value(key)
                    folded.write_value(key, total + value, 0.0)
                os.remove(f)  # once its counts are in the folded file (no scrape reads in between)
        finally:
            folded.close()
    return len(pids)


class FoldingCollector:
    """prometheus_client's ``MultiProcessCollector`` over ``path``, which first folds the files of
    processes that are gone (``fold_gone``), one scrape at a time."""

    def __init__(self, path: str) -> None:
        from prometheus_client import multiprocess

        self.path = path
        self._collector = multiprocess.MultiProcessCollector(None, path)
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Any]:
        with self._lock:
            try:
                fold_gone(self.path)
            except Exception:  # the scrape goes on with the files as they are
                log.warning("outbox metrics: cannot fold the files of processes that are gone in %s", self.path,
                            exc_info=True)
            return list(self._collector.collect())


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve /metrics from this process: the sum over every process in multiprocess
    mode, else the active metrics' registry. Returns the HTTP server."""
    global _server
    from prometheus_client import CollectorRegistry, start_http_server

    m = active()
    if multiprocess_mode():
        registry = CollectorRegistry()
        registry.register(FoldingCollector(multiprocess_dir()))
    elif m is not None:
        registry = m.registry
    else:
        raise RuntimeError("metrics are off")
    if m is not None and m._last_read is None:
        # Multiprocess mode serves a gauge only once set: 0 until the first reading, and its
        # timestamp 0, never read (docs/waking-and-metrics.md, "Metrics").
        for gauge in (m.in_flight, m.backlog, m.lag, m.oldest_age, m.read_at):
            gauge.set(0)
    _server, _thread = start_http_server(port, addr, registry=registry)  # prometheus-client 0.20+
    if multiprocess_mode():  # the mark a sibling that cannot bind the port looks for (``sibling_serves``)
        with open(os.path.join(multiprocess_dir(), SERVING), "w") as mark:
            mark.write(str(os.getpid()))
    return _server


#: The file in the multiprocess directory naming the process that serves it.
SERVING = "serving.pid"


def sibling_serves(wait_s: float = 2.0) -> bool:
    """Whether another process of this worker serves its metrics: its mark (``SERVING``) in the
    shared directory names a live process, within ``wait_s`` (it is written just after the
    bind). A port held without one is another worker's or program's: this process's counts
    are then in no scrape."""
    path = multiprocess_dir()
    deadline = time.monotonic() + wait_s
    while path:
        try:
            with open(os.path.join(path, SERVING)) as mark:
                pid = mark.read().strip()
            if pid and not _gone(pid):
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return False


def stop_serving() -> None:
    """Stop the endpoint and the refresher; remove the multiprocess directory this process
    made, or the shared one if this process served it or no live process of the worker does."""
    global _server, _own_dir, _shared_dir
    stop_refresher()
    served, _server = _server, None
    if served is not None:
        try:
            served.shutdown()
            served.server_close()
        except Exception:
            log.debug("outbox metrics: error stopping the metrics server", exc_info=True)
    if served is not None and multiprocess_mode():
        with contextlib.suppress(OSError):
            os.remove(os.path.join(multiprocess_dir(), SERVING))
    if _shared_dir is not None and (served is not None or not sibling_serves(0)):
        _own_dir, _shared_dir = _shared_dir, None  # served here, or by no process of the worker
    if _own_dir is not None:
        shutil.rmtree(_own_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the user's own directory too when nothing else is in it
            os.rmdir(os.path.dirname(_own_dir))
        _own_dir = None


# -- called by ``outbox.celery.worker`` on the worker's signals -----------------------------------------

def on_worker_init() -> None:
    """worker_init (main process, before the pool forks): decide, set up multiprocess
    mode, create the metrics."""
    try:
        if configured_port() is None:
            return
        prepare_multiprocess()
        reset()
        active()
    except Exception as exc:  # noqa: BLE001 - metrics must never stop the relay
        log.error("outbox metrics: off (%s: %s)", type(exc).__name__, exc)
        disable()


def on_worker_ready(store_factory: Callable[[], Any] | None = None) -> None:
    """worker_ready: serve the metrics (a port in use must not stop the relay), and read
    the gauges on their own schedule from ``store_factory()``'s store."""
    try:
        options = metrics_options()
        port, addr = options.port, options.addr
        if port is None or active() is None:
            return
        serve(port, addr)
        log.info("outbox metrics: serving http://%s:%d/metrics%s", addr, port,
                 " (multiprocess)" if multiprocess_mode() else "")
    except Exception as exc:  # noqa: BLE001 - metrics must never stop the relay
        in_use = isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE
        log.error("outbox metrics: cannot serve (%s: %s)%s", type(exc).__name__, exc,
                  "; this worker's counts are in no scrape: give each worker of a host its own "
                  "OUTBOX_RELAY_METRICS_PORT" if in_use else "")
        return
    if store_factory is not None:
        start_refresher(store_factory)


__all__ = ["Metrics", "active", "enable", "disable", "reset", "claimed", "sent", "chain", "dead", "refresh", "serve",
           "stop_serving", "GaugeRefresher", "start_refresher", "stop_refresher", "FAILURE_KINDS",
           "configured_port", "prepare_multiprocess", "multiprocess_mode", "multiprocess_dir", "fold_gone",
           "FoldingCollector", "SERVING", "sibling_serves", "on_worker_init", "on_worker_ready",
           "PrometheusHooks", "relay_hooks"]
