"""Backlog drain: N committed events over A aggregates on PostgreSQL (``--engine``: or
MariaDB/MySQL or SQLite, ``bench.engines``), relayed to RabbitMQ.

* ``run_baseline``: the plain in-process loop (``bench.loop``) in a subprocess.
* ``Relay``: one real ``celery -A outbox worker --concurrency 2`` (prefork) and one
  ``celery -A outbox beat``, Redis (a spare db) as Celery's broker.
* ``run_celery_drain``: load the backlog, let the relay drain it, measure events/s from the
  first to the last arrival at the bench consumer, check the ordering rule from the arrival
  order, and sample every worker process's RSS (``/proc/<pid>/status`` VmRSS), the publish
  queue's depth in Redis, the rows in flight, and who used the CPU.
* ``compare_with_raw_loop`` (``python -m bench.drain``): issue 11's figures in one run: the
  raw unordered loop (``bench.rawloop``) and the relay on a 100- and a 10,000-aggregate
  backlog, the ratio, relay-worker CPU per event and each worker process's busy fraction
  (docs/benchmarks.md, "Issue 11").

The same drain with py-spy attached: ``bench.profiling``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .backlog import claimable, connect, id_range, rows_claimed
from .common import (
    CELERY,
    CpuWindow,
    Destination,
    Run,
    check_order,
    cpu_seconds,
    cpu_summary,
    lease_recovered,
    load_backlog,
    log,
    process_tree,
    redis_llen,
    rss_kb,
    service_groups,
    status_counts,
    stop_process_group,
    truncate_table,
    wait_all_done,
)
from .rawloop import run_raw_loop
from .services import free_port


def arrival_rate(arrivals: list[tuple[float, int, str]], events: int) -> dict[str, Any]:
    """events/s from the first to the last *first* arrival of the expected events."""
    firsts: dict[int, float] = {}
    for t, outbox_id, _ in arrivals:
        firsts.setdefault(outbox_id, t)
    if len(firsts) < 2:
        return {"events_per_s": 0.0, "seconds": 0.0, "arrived": len(firsts)}
    times = sorted(firsts.values())
    span = times[-1] - times[0]
    # Steady state too: the middle 80% of arrivals, free of start-up and tail effects.
    lo, hi = times[len(times) // 10], times[(len(times) * 9) // 10]
    mid = ((len(times) * 9) // 10 - len(times) // 10) / (hi - lo) if hi > lo else 0.0
    return {"events_per_s": (len(times) - 1) / span if span > 0 else float("inf"), "seconds": span,
            "arrived": len(firsts), "steady_events_per_s": mid}


# -- the baseline ------------------------------------------------------------------------------

def cpu_per_event(cpu: dict[str, Any], events: int) -> dict[str, float]:
    """CPU microseconds per relayed event, by process group (and in total)."""
    per = {k: round(1e6 * v * cpu["elapsed_s"] / max(1, events), 1) for k, v in cpu["cores_used"].items()}
    per["total (relay, services, bench)"] = round(sum(v for k, v in per.items() if k not in (
        "other python (not this bench)", "other", "kernel threads (writeback, I/O)")), 1)
    return per


def run_baseline(run: Run, destination: Destination, events: int, aggregates: int, ack: str = "batch",
                 timeout: float = 300.0) -> dict[str, Any]:
    truncate_table(run)
    expected = load_backlog(run, events, aggregates)
    destination.reset()
    cmd = [sys.executable, "-m", "bench.loop", "--database-url", run.database_url, "--table", run.table,
           "--publish-url", run.amqp_url, "--exchange", run.exchange, "--batch", str(run.batch_size),
           "--ack", ack, "--max-seconds", str(timeout), "--hold"]
    log(f"baseline loop (ack per {ack}): {events} events over {aggregates} aggregates")
    window = CpuWindow(service_groups())
    window.start()
    proc = subprocess.Popen(cmd, env=run.child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        # The loop holds its connections open until we have read the CPU of it and its backend.
        cpu = window.stop()
        out, err = proc.communicate("\n", timeout=30)
    except BaseException:
        proc.kill()
        raise
    if proc.returncode != 0 or not line.strip():
        raise RuntimeError(f"baseline loop failed ({proc.returncode}):\n{err[-3000:]}\n{line}{out}")
    own = json.loads(line)
    destination.wait_for(events, timeout=30, idle_timeout=5)
    arrivals = list(destination.arrivals)
    result = {"ack": ack, "loop": own, "cpu_us_per_event": cpu_per_event(cpu, events), "loop_events_per_s": own["published"] / own["seconds"],
              **arrival_rate(arrivals, events), "order": check_order(arrivals, expected),
              "cpu": cpu, "table": status_counts(run)}
    log(f"baseline loop: {result['events_per_s']:.0f} ev/s first-to-last arrival "
        f"({result['arrived']}/{events} arrived, order ok={result['order']['ok']}); loop split: "
        f"claim {own['claim_s']:.1f}s publish {own['publish_s']:.1f}s ack {own['ack_s']:.1f}s")
    return result


# -- the relay under test -------------------------------------------------------------------------

class Relay:
    """One worker (prefork, ``concurrency`` processes) and one beat, as separate process groups."""

    def __init__(self, run: Run, concurrency: int = 2, loglevel: str = "WARNING", beat: bool = True,
                 **env: str) -> None:
        self.run = run
        self.concurrency = concurrency
        self.dir = run.workdir
        #: The worker serves its metrics here: ``claims()`` reads how many claims came back empty.
        self.metrics_port = int(env.pop("OUTBOX_RELAY_METRICS_PORT", 0) or free_port())
        self.env = run.child_env(**env, OUTBOX_RELAY_METRICS_PORT=str(self.metrics_port))
        self.worker = self._start("worker", "worker", "-P", "prefork", "-c", str(concurrency),
                                  "-n", f"bench-{run.tag}@%h", f"--loglevel={loglevel}", "--without-mingle",
                                  "--without-gossip", "--without-heartbeat")
        self.beat = self._start("beat", "beat", f"--loglevel={loglevel}", "-s",
                                str(self.dir / "beat-schedule")) if beat else None

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as out:
            return subprocess.Popen([CELERY, "-A", "outbox", *args], cwd=self.dir, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, name: str = "worker", chars: int = 3000) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def claims(self) -> dict[str, float]:
        """The worker's claims so far and how many of them leased no row (its metrics:
        ``outbox_claim_seconds_count``, ``outbox_empty_claims_total``); {} if unreadable."""
        import urllib.request

        wanted = {"outbox_claim_seconds_count": "claims", "outbox_empty_claims_total": "empty"}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as page:
                text = page.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, number = line.partition(" ")
            if name in wanted:
                out[wanted[name]] = float(number)
        return out

    def check_alive(self) -> None:
        for name, proc in (("worker", self.worker), ("beat", self.beat)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def worker_pids(self) -> list[int]:
        return process_tree(self.worker.pid)

    def wait_ready(self, concurrency: int | None = None, timeout: float = 30.0) -> None:
        concurrency = concurrency or self.concurrency
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if len(self.worker_pids()) >= concurrency + 1:
                time.sleep(1.0)  # the pool is forked; give it a moment to start consuming
                return
            time.sleep(0.1)
        raise RuntimeError(f"worker did not start its pool in {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        for proc in (self.beat, self.worker):
            if proc is not None:
                stop_process_group(proc)


class Sampler(threading.Thread):
    """Samples RSS of every worker process, the publish queue's depth and the rows claimed."""

    def __init__(self, relay: Relay, interval: float = 0.25, db_every: int = 4) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        import redis

        self.relay = relay
        self.interval = interval
        self.db_every = db_every
        self.redis = redis.Redis.from_url(relay.run.redis_url, socket_timeout=2)
        from outbox.core.config import load_settings

        self.publish_queue = load_settings(environ=relay.run.outbox_env()).queues.publish
        self.stop_event = threading.Event()
        self.rss_max: dict[int, int] = {}
        self.rss_last: dict[int, int] = {}
        self.role: dict[int, str] = {}
        self.queue_max = 0
        self.claimed_max = 0
        self.samples = 0
        #: (claims, empty claims, whether a chain was claimable) at each database sample.
        self.claim_samples: list[tuple[float, float, bool]] = []

    def run(self) -> None:
        conn = connect(self.relay.run)
        try:
            while not self.stop_event.is_set():
                parent = self.relay.worker.pid
                for pid in self.relay.worker_pids():
                    kb = rss_kb(pid)
                    if kb is None:
                        continue
                    self.role.setdefault(pid, "parent" if pid == parent else "child")
                    self.rss_last[pid] = kb
                    self.rss_max[pid] = max(kb, self.rss_max.get(pid, 0))
                depth = redis_llen(self.redis, self.publish_queue)
                if depth is not None:
                    self.queue_max = max(self.queue_max, depth)
                if self.samples % self.db_every == 0:
                    with contextlib.suppress(Exception):  # a sample lost is no failure
                        self.claimed_max = max(self.claimed_max, rows_claimed(conn, self.relay.run))
                if self.samples % 2 == 0:
                    with contextlib.suppress(Exception):
                        counts = self.relay.claims()
                        if "empty" in counts:
                            self.claim_samples.append((counts["claims"], counts["empty"],
                                                       claimable(conn, self.relay.run)))
                self.samples += 1
                self.stop_event.wait(self.interval)
        finally:
            conn.close()
            self.redis.close()

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        self.join(timeout=5)
        per_process = [{"pid": pid, "role": self.role.get(pid, "?"), "max_rss_mb": round(kb / 1024, 1),
                        "last_rss_mb": round(self.rss_last.get(pid, 0) / 1024, 1)}
                       for pid, kb in sorted(self.rss_max.items())]
        # Empty claims between two samples that both found a claimable chain: claims that came
        # back empty while a chain was free (issue 25's target: 0).
        pairs = zip(self.claim_samples, self.claim_samples[1:])
        empty_while_claimable = sum(b[1] - a[1] for a, b in pairs if a[2] and b[2])
        return {"per_process": per_process, "empty_while_claimable": empty_while_claimable,
                "max_rss_mb": max((p["max_rss_mb"] for p in per_process), default=0.0),
                "publish_queue_max": self.queue_max, "rows_claimed_max": self.claimed_max,
                "samples": self.samples}


def cpu_groups(relay: Relay) -> dict[str, Any]:
    worker = set(relay.worker_pids())
    beat = set(process_tree(relay.beat.pid)) if relay.beat is not None else set()
    return {"worker": lambda pid, comm: pid in worker, "beat": lambda pid, comm: pid in beat, **service_groups()}


def run_celery_drain(run: Run, destination: Destination, relay_factory: Any, events: int, aggregates: int,
                     timeout: float = 300.0, relay: Relay | None = None,
                     label: str = "celery drain") -> tuple[dict[str, Any], Relay]:
    """Load the backlog, then start the relay (unless one is given) and measure its drain."""
    truncate_table(run)
    destination.reset()  # before the load: a relay already running publishes the rows as they commit
    # The relay starts (and is ready) before the backlog appears, all at once (one COPY
    # transaction), so its CPU and busy figures cover the whole drain: started after the
    # load, a worker could drain part of it before it reports ready. The services' CPU
    # window then includes the load's own work (COPY, ANALYZE, CHECKPOINT).
    if relay is None:
        relay = relay_factory()
        relay.wait_ready()
    log(f"{label}: {events} events over {aggregates} aggregates, worker pid {relay.worker.pid} "
        f"(pool {relay.worker_pids()[1:]})")
    sampler = Sampler(relay)
    sampler.start()
    window = CpuWindow(cpu_groups(relay))
    window.start()
    pids = relay.worker_pids()
    cpu0 = {pid: cpu_seconds(pid) for pid in pids}
    claims0 = relay.claims()
    started = time.monotonic()
    started_perf = time.perf_counter()
    expected = load_backlog(run, events, aggregates)
    reached = destination.wait_for(events, timeout=timeout, idle_timeout=30, alive=relay.check_alive)
    cpu = window.stop()
    busy = process_busy(relay, cpu0, time.monotonic() - started)
    memory = sampler.stop()
    claims = {k: v - claims0.get(k, 0) for k, v in relay.claims().items()}
    arrivals = list(destination.arrivals)
    counts = wait_all_done(run, timeout=30 if reached else 75)
    if not reached:  # late rows (a lost task comes back with its lease): did they get there?
        arrivals = list(destination.arrivals)
    result = {"events": events, "aggregates": aggregates, "complete": reached, "lease_recovered": lease_recovered(run),
              "all_arrived_s": (max(t for t, _, _ in arrivals) - started_perf) if arrivals else None,
              **arrival_rate(arrivals, events),
              "wall_s_from_load": time.monotonic() - started, "order": check_order(arrivals, expected),
              "memory": memory, "cpu": cpu, "cpu_us_per_event": cpu_per_event(cpu, events), "table": counts,
              "busy": busy, "worker_cpu_us_per_event": cpu_per_event(cpu, events).get("worker"),
              "claims": claims.get("claims"), "empty_claims": claims.get("empty"),
              "empty_claim_share": claims["empty"] / claims["claims"] if claims.get("claims") and "empty" in claims else None,
              "empty_while_claimable": memory["empty_while_claimable"] if "empty" in claims else None}
    if not reached:
        result["worker_log_tail"] = relay.log_tail()
    if result["order"]["unexpected"]:
        log(f"{label}: {result['order']['unexpected']} unexpected ids arrived, from {result['order']['unexpected_ids']} "
            f"(this load: {id_range(expected)})")
    if not reached:
        log(f"{label}: INCOMPLETE: {result['arrived']}/{events} within the wait; table {counts}, "
            f"{result['lease_recovered']} rows recovered by lease expiry; order {result['order']}")
    log(f"{label}: {result['events_per_s']:.0f} ev/s first-to-last arrival, steady "
        f"{result.get('steady_events_per_s', 0):.0f} ev/s ({result['arrived']}/{events} arrived, "
        f"order ok={result['order']['ok']}, dups={result['order']['duplicates']}); max worker RSS "
        f"{memory['max_rss_mb']} MB; publish queue max {memory['publish_queue_max']}, "
        f"rows claimed max {memory['rows_claimed_max']}")
    log(f"{label}: {cpu_summary(cpu, result['cpu_us_per_event'])}")
    log(f"{label}: busy (CPU / drain wall time) " + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()))
    if result["empty_claim_share"] is not None:
        log(f"{label}: {result['claims']:.0f} claims, {result['empty_claims']:.0f} empty "
            f"(share {result['empty_claim_share']:.3f}); empty while a chain was claimable (sampled every "
            f"0.5 s): {result['empty_while_claimable']:.0f} (target 0)")
    return result, relay


def process_busy(relay: Relay, cpu0: dict[int, float | None], wall: float) -> dict[str, float]:
    """Each worker process's CPU over the drain's wall time: ``parent`` and ``child 1..n``
    (children in pid order). A child that stays near 0 while another is near 1 is idle
    for want of claimable work, not for want of CPU."""
    out: dict[str, float] = {}
    children = 0
    for pid, before in sorted(cpu0.items()):
        after = cpu_seconds(pid)
        if before is None or after is None or wall <= 0:
            continue
        if pid == relay.worker.pid:
            name = "parent"
        else:
            children += 1
            name = f"child {children}"
        out[name] = round((after - before) / wall, 3)
    return out


# -- issue 11: the relay against the raw unordered loop, same run ------------------------------------

def compare_with_raw_loop(run: Run, destination: Destination, relay_factory: Any, events: int,
                          spreads: tuple[int, ...] = (100, 10_000), processes: int = 2,
                          timeout: float = 300.0, others: dict[str, Any] | None = None) -> tuple[dict[str, Any], None]:
    """For each spread (aggregates in the backlog): drain ``events`` rows with the raw loop
    (``bench.rawloop``, ``processes`` processes, waves of ``run.batch_size``), then the same
    backlog with a relay started for it (and stopped after). Returns ``{"<spread>": {"raw": ..., "relay": ..., "ratio": relay
    events/s over raw events/s, "worker_cpu_us_per_event": ..., "busy": ...}}``. ``others``
    (label -> relay factory, e.g. another version of the relay) are drained too, after the
    relay, each on a fresh copy of the backlog: ``out[spread]["others"][label]``."""
    out: dict[str, Any] = {}
    relay: Relay | None = None
    for aggregates in spreads:
        truncate_table(run)
        loaded = id_range(load_backlog(run, events, aggregates))
        log(f"raw loop: {events} events over {aggregates} aggregates (ids {loaded})")
        # The arrivals of the relay's pass before are still recorded: without this reset the
        # wait below counts them and returns at once, and the raw loop's messages that the
        # consumer has not read yet arrive in the next pass as unexpected ids.
        destination.reset()
        raw = run_raw_loop(run.database_url, run.amqp_url, run.table, run.exchange, processes, run.batch_size,
                           timeout=timeout)
        destination.wait_for(events, timeout=30, idle_timeout=5)
        raw["arrived"] = destination.unique()
        raw["arrival"] = arrival_rate(list(destination.arrivals), events)
        log(f"raw loop, at the consumer: {raw['arrival']['events_per_s']:.0f} ev/s first-to-last arrival")
        drained, relay = run_celery_drain(run, destination, relay_factory, events, aggregates, timeout=timeout,
                                          relay=relay, label=f"relay, {aggregates} aggregates")
        relay.stop()  # a running relay (beat ticks) would claim the next raw loop's rows
        relay = None
        other_results: dict[str, Any] = {}
        for label, factory in (others or {}).items():
            other, other_relay = run_celery_drain(run, destination, factory, events, aggregates, timeout=timeout,
                                                  label=f"{label}, {aggregates} aggregates")
            other_relay.stop()
            other_results[label] = {"events_per_s": other["events_per_s"],
                                    "ratio": other["events_per_s"] / raw["events_per_s"] if raw["events_per_s"]
                                    else float("nan"),
                                    "worker_cpu_us_per_event": other["worker_cpu_us_per_event"],
                                    "busy": other["busy"], "order_ok": other["order"]["ok"], "result": other}
        ratio = drained["events_per_s"] / raw["events_per_s"] if raw["events_per_s"] else float("nan")
        out[str(aggregates)] = {"engine": run.engine, "aggregates": aggregates, "raw": raw, "relay": drained, "ratio": ratio,
                                "raw_events_per_s": raw["events_per_s"], "relay_events_per_s": drained["events_per_s"],
                                "worker_cpu_us_per_event": drained["worker_cpu_us_per_event"],
                                "raw_loop_cpu_us_per_event": raw["loop_cpu_us_per_event"], "busy": drained["busy"],
                                "others": other_results}
    for aggregates, r in out.items():
        log(f"ordered drain on {run.engine} over {aggregates} aggregates: relay {r['relay_events_per_s']:.0f} ev/s, raw loop "
            f"{r['raw_events_per_s']:.0f} ev/s: x{r['ratio']:.2f} (target >= 1.0, issue 25); relay-worker CPU "
            f"{r['worker_cpu_us_per_event']} us/event (target <= 150; raw loop {r['raw_loop_cpu_us_per_event']}); "
            f"busy " + ", ".join(f"{k} {v:.2f}" for k, v in r["busy"].items())
            + f"; order ok={r['relay']['order']['ok']}")
        for label, o in r["others"].items():
            log(f"  {label}: {o['events_per_s']:.0f} ev/s: x{o['ratio']:.2f} of the raw loop; worker CPU "
                f"{o['worker_cpu_us_per_event']} us/event; busy " + ", ".join(f"{k} {v:.2f}" for k, v in o["busy"].items())
                + f"; order ok={o['order_ok']}")
    return out, relay


def log_medians(engine: str, rounds: list[dict[str, Any]]) -> None:
    """Each spread's relay / raw loop ratio (and every other relay's) over ``rounds`` of
    ``compare_with_raw_loop``: every round's, then the median."""
    for spread in rounds[0]:
        ratios = {"relay": [r[spread]["ratio"] for r in rounds]}
        for label in rounds[0][spread]["others"]:
            ratios[label] = [r[spread]["others"][label]["ratio"] for r in rounds]
        for label, values in ratios.items():
            log(f"{engine}, {spread} aggregates, {label} / raw loop over {len(values)} rounds: "
                + ", ".join(f"x{v:.2f}" for v in values) + f"; median x{statistics.median(values):.2f}")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.drain``: the relay against the raw loop on two spreads, same run."""
    import argparse
    import shutil
    import tempfile

    from .common import create_table, flush_redis, require_services, teardown, to_json
    from .engines import engine_names

    p = argparse.ArgumentParser(prog="python -m bench.drain", description=compare_with_raw_loop.__doc__)
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--spreads", default="100,10000", help="aggregates in the backlog, comma-separated")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--redis-url", default=os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))
    p.add_argument("--prefix", default="outbox-bench", help="RabbitMQ exchange/queue name prefix")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the worker (repeatable)")
    p.add_argument("--json", type=Path)
    p.add_argument("--loglevel", default="WARNING", help="the worker's log level")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker and beat logs)")
    p.add_argument("--engine", default="postgresql",
                   help="the database of the backlog, the raw loop and the relay: postgresql, mysql or sqlite, "
                        "or a comma-separated list, drained one after the other (bench.engines; --json FILE then "
                        "writes FILE-<engine>.json per engine)")
    p.add_argument("--compare-src", action="append", default=[], metavar="LABEL=DIR",
                   help="also drain with the relay imported from DIR (e.g. before=/work/main/src), same run")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="a round trip of this many ms to the database and RabbitMQ for everyone (bench.latency's "
                        "proxies): the relay where round trips, not cores, bound a worker")
    p.add_argument("--compare-env", action="append", default=[], metavar="LABEL=NAME=VALUE",
                   help="also drain with this run's relay and NAME=VALUE in its environment (e.g. "
                        "off=OUTBOX_RELAY_CLAIM_AHEAD=false), same run; repeat a label to set several")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole comparison this many times and print each ratio's median (on a shared "
                        "machine one pass can swing by a third; --json then holds every round)")
    args = p.parse_args(argv)
    try:
        engines = engine_names(args.engine)
    except ValueError as exc:
        p.error(str(exc))
    require_services(engines)
    if len(engines) > 1:  # one engine after the other, each a run of its own (the last option given wins)
        rest, status = list(sys.argv[1:] if argv is None else argv), 0
        for name in engines:
            json_file = ["--json", str(args.json.with_name(f"{args.json.stem}-{name}{args.json.suffix}"))] \
                if args.json else []
            status = max(status, main([*rest, "--engine", name, *json_file]))
        return status
    run = Run(redis_url=args.redis_url, batch_size=args.batch_size, prefix=args.prefix, engine=engines[0],
              workdir=Path(tempfile.mkdtemp(prefix="outbox-drain-")))
    proxies = None
    if args.rtt_ms > 0:
        from .latency import ProxyProcess

        proxies = ProxyProcess(args.rtt_ms, [run.postgres_url, run.mysql_url, run.amqp_url])
        run.postgres_url, run.mysql_url, run.amqp_url = (proxies.url(u) for u in (run.postgres_url, run.mysql_url,
                                                                                    run.amqp_url))
        log(f"round trip to the database and RabbitMQ: +{args.rtt_ms:g} ms (proxies: {run.postgres_url}, "
            f"{run.amqp_url})")
    env = dict(item.split("=", 1) for item in args.env)
    flush_redis(run.redis_url)
    create_table(run)
    destination = Destination(run)
    relay = None
    try:
        def other(src: str) -> Any:
            path = src + os.pathsep + os.environ.get("PYTHONPATH", "")
            return lambda: Relay(run, concurrency=args.concurrency, loglevel=args.loglevel,
                                 **{**env, "PYTHONPATH": path})

        others = {label: other(src) for label, src in (item.split("=", 1) for item in args.compare_src)}
        variants: dict[str, dict[str, str]] = {}
        for label, name, value in (item.split("=", 2) for item in args.compare_env):
            variants.setdefault(label, {})[name] = value
        for label, extra in variants.items():
            others[label] = lambda extra=extra: Relay(run, concurrency=args.concurrency, loglevel=args.loglevel,
                                                      **{**env, **extra})
        rounds: list[dict[str, Any]] = []
        for number in range(1, args.rounds + 1):
            if args.rounds > 1:
                log(f"round {number} of {args.rounds}")
            results, relay = compare_with_raw_loop(
                run, destination, lambda: Relay(run, concurrency=args.concurrency, loglevel=args.loglevel, **env),
                args.events, tuple(int(x) for x in args.spreads.split(",")), processes=args.concurrency,
                others=others)
            rounds.append(results)
        if args.rounds > 1:
            log_medians(run.engine, rounds)
        if args.json:
            args.json.write_text(to_json(results if args.rounds == 1 else {"rounds": rounds}))
    finally:
        teardown(run, destination, relay)
        if proxies is not None:
            proxies.close()
        if args.keep:
            log(f"logs kept in {run.workdir}")
        else:
            shutil.rmtree(run.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
