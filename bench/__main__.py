"""``python -m bench`` (``make bench``): the seven speed targets of issue 11, each printed next to
a baseline measured in the same run, with the ratio and the verdict. ``--quick`` for a small
run. Nothing here asserts a time: the figures are printed (and written as JSON with
``--json``); docs/benchmarks.md records them.

Phases, in order (each can be skipped with ``--skip``; optional ones are left out when the
``--max-minutes`` budget would not hold them):

1. ``confirm``  the publisher alone: the relay's publishing path against raw py-amqp waves
                of the same size (target 2), and the schemes the relay does not use;
2. ``drain``    the ordered drain, ``celery -A outbox worker -c 2`` + beat, at 100 and at
                10,000 aggregates, each against the raw unordered 2-process loop
                (``bench.rawloop``) on the same backlog (target 1); the worker's CPU per
                event (target 3) and each pool child's busy fraction (target 4);
3. ``hot``      10,000 events on one aggregate: strict ordering against the opt-in
                pipelined mode (``bench.hot``, target 5);
4. ``live``     commit-to-arrival latency at 200 events/s, each variant of ``bench.live.VARIANTS``
                (the wake, polling only, LISTEN/NOTIFY; claims in the worker's main process
                or through Celery) with its own worker; the wake's cost to the writer (target 6);
5. ``memory``   a backlog with 1 MB payloads mixed in (1 in 20), peak RSS of every worker
                process (``bench.memory``, target 7);
6. ``takeover`` two workers, one SIGKILLed mid-drain: the longest stand-still of any aggregate
                after the kill next to the fault-free drain's (``bench.takeover``, issue 19);
7. ``kafka``    issue 24: the relay's drain to Kafka (Tansu, or OUTBOX_BENCH_KAFKA_URL) against a raw
                idempotent confluent-kafka producer sending the same events, and against the same
                drain to RabbitMQ (``bench.kafka``; skipped when confluent-kafka or Tansu is missing);
8. ``profile``  py-spy on the worker while draining (where the time goes; optional);
9. ``tuning``   the worker with other settings (optional).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import (
    PY_SPY,
    Destination,
    Run,
    create_table,
    drop_table,
    flush_redis,
    log,
    machine_facts,
    require_services,
    to_json,
    wait_quiet,
)

PHASES = ("confirm", "drain", "hot", "live", "memory", "takeover", "kafka", "profile", "tuning")
#: Phases left out of ``--quick`` (and first to go when the time budget is short).
OPTIONAL = ("profile", "tuning")


@dataclass(frozen=True)
class Target:
    """One speed target of issue 11: ``figure`` against ``goal``; ``higher`` says which way is better."""

    key: str
    number: str
    text: str
    goal: float
    higher: bool
    unit: str


#: The seven targets of issue 11 ("Speed to reach"), rows of the summary. A figure of a
#: ``higher`` target is a ratio (or a rate) that must reach ``goal``; the others a cost
#: that must stay at or under it.
TARGETS = (
    Target("drain_100", "1", "ordered drain, 100 aggregates / raw loop", 0.9, True, "x"),
    Target("drain_10000", "1", "ordered drain, 10,000 aggregates / raw loop", 0.9, True, "x"),
    Target("publish", "2", "publishing path / raw py-amqp waves", 0.9, True, "x"),
    Target("cpu", "3", "relay-worker CPU per event (us)", 150.0, False, "us"),
    Target("busy", "4", "least busy / busiest pool child", 0.8, True, "x"),
    Target("hot", "5", "hot aggregate, pipelined / strict", 5.0, True, "x"),
    Target("live_p50", "6", "live 200 ev/s, wake, commit-to-arrival p50 (ms)", 5.0, False, "ms"),
    Target("live_p99", "6", "live 200 ev/s, wake, commit-to-arrival p99 (ms)", 25.0, False, "ms"),
    Target("wake_tax", "6", "wake's cost to the writer's enqueue+commit p50 (ms)", 0.3, False, "ms"),
    Target("rss", "7", "max RSS of a worker process, 1 MB payloads mixed in (MB)", 256.0, False, "MB"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small run (about 4 minutes): 5,000-event drains, 2,000 hot events, 5 s live, "
                        "1,000 memory events, no profile or tuning")
    p.add_argument("--events", type=int, help="backlog of each drain (default 20,000; 5,000 with --quick)")
    p.add_argument("--aggregates", default="100,10000",
                   help="comma-separated aggregate counts of the drains (default 100,10000)")
    p.add_argument("--batch-size", type=int, default=100, help="OUTBOX_BATCH_SIZE of the relay and the raw loop")
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork)")
    p.add_argument("--hot-events", type=int, help="events on the hot aggregate (default 10,000; 2,000 quick)")
    p.add_argument("--memory-events", type=int, help="backlog of the memory phase (default 4,000; 1,000 quick)")
    p.add_argument("--big-every", type=int, default=20, help="memory phase: one event in this many is large")
    p.add_argument("--big-bytes", type=int, default=1_000_000, help="memory phase: payload of a large event")
    p.add_argument("--profile-events", type=int, help="backlog of the py-spy pass (default min(events, 20,000))")
    p.add_argument("--tuning-events", type=int, help="backlog of each tuning drain (default min(events, 20,000))")
    p.add_argument("--live-rate", type=float, default=200.0, help="events/s the writers commit")
    p.add_argument("--live-seconds", type=float, help="how long the writers write (default 20; 5 with --quick)")
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--no-listen", dest="listen", action="store_false",
                   help="skip the PostgreSQL LISTEN/NOTIFY live variants (--quick runs only wake and poll)")
    p.add_argument("--confirm-events", type=int, help="events per publisher variant (default 5,000; 1,000 quick)")
    p.add_argument("--skip", default="", help=f"comma-separated phases to skip: {', '.join(PHASES)}")
    p.add_argument("--worker-loglevel", default="WARNING")
    p.add_argument("--max-minutes", type=float, help="time budget (default 15; 4 with --quick): optional "
                                                     "phases and variants that would not fit are skipped")
    p.add_argument("--no-wait-quiet", action="store_true",
                   help="do not wait for an idle machine before each phase")
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (worker logs, py-spy output)")
    args = p.parse_args(argv)
    args.events = args.events or (5000 if args.quick else 20_000)
    args.aggregate_counts = [int(a) for a in str(args.aggregates).split(",") if a.strip()]
    args.hot_events = args.hot_events or (2000 if args.quick else 10_000)
    args.memory_events = args.memory_events or (1000 if args.quick else 4000)
    args.live_seconds = args.live_seconds or (5.0 if args.quick else 20.0)
    args.confirm_events = args.confirm_events or (1000 if args.quick else 5000)
    args.profile_events = args.profile_events or min(args.events, 20_000)
    args.tuning_events = args.tuning_events or min(args.events, 20_000)
    args.max_minutes = args.max_minutes or (4.0 if args.quick else 15.0)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) to skip: {', '.join(sorted(unknown))}")
    if args.quick:
        args.skip |= set(OPTIONAL)
        args.listen = False
    return args


# -- calling the phases' modules ---------------------------------------------------------------------

def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it accepts: the phases' modules are written by
    several people, and a knob one of them does not take yet must not break the run."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def optional_module(name: str) -> Any | None:
    """``bench.<name>`` if it exists (a phase whose module is not there yet is skipped)."""
    import importlib

    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name in (f"bench.{name}",):
            return None
        raise


def rate(result: dict[str, Any] | None) -> float | None:
    return (result or {}).get("events_per_s")


# -- the summary -----------------------------------------------------------------------------------

def fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, str):
        return value
    return f"{value:,.{digits}f}"


def verdict(target: Target, figure: float | None) -> str:
    """'met', 'MISSED by ...' (how far from the goal, and in percent of it), or 'n/a'."""
    if figure is None or (isinstance(figure, float) and math.isnan(figure)):
        return "n/a (not measured)"
    if (figure >= target.goal) if target.higher else (figure <= target.goal):
        return "met"
    gap = abs(figure - target.goal)
    unit = "" if target.unit == "x" else f" {target.unit}"
    digits = (3 if gap < 0.01 else 2) if target.unit == "x" or gap < 10 else 0
    return f"MISSED by {gap:,.{digits}f}{unit} ({100 * gap / target.goal:.0f}% of the goal)"


def target_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target's figure, the baseline measured in the same run, the ratio, the verdict.

    For a ratio target (1, 2, 4, 5) the figure IS the ratio: ``value`` and ``baseline`` are the
    two rates it divides. For a cost target (3, 6, 7) the figure is the cost, and the ratio
    column compares it with the same-run baseline shown next to it."""
    rows: dict[str, dict[str, Any]] = {}

    def put(key: str, value: Any, baseline: Any, figure: float | None, ratio: float | None, note: str = "") -> None:
        rows[key] = {"value": value, "baseline": baseline, "figure": figure, "ratio": ratio, "note": note}

    drains = results.get("drain") or {}
    for aggregates in ("100", "10000"):
        d = drains.get(aggregates) or {}
        relay, raw = rate(d.get("relay")), rate(d.get("raw"))
        ratio = relay / raw if relay and raw else None
        put(f"drain_{aggregates}", f"{fmt(relay)} ev/s", f"raw loop {fmt(raw)} ev/s", ratio, ratio,
            f"{(d.get('relay') or {}).get('events', '?')} events"
            + ("" if (d.get("relay") or {}).get("order", {}).get("ok", True) else "; ORDER BROKEN"))
    confirm = results.get("confirm") or {}
    relay_key = next((k for k, v in confirm.items() if "vs_raw_waves" in v), None)
    wave = relay_key.replace("kombu_waves_task", "") if relay_key else ""
    relay_path, raw_waves = confirm.get(relay_key or ""), confirm.get(f"raw_waves{wave}")
    p_ratio = (relay_path or {}).get("vs_raw_waves")
    put("publish", f"{fmt(rate(relay_path))} ev/s", f"raw waves {fmt(rate(raw_waves))} ev/s", p_ratio, p_ratio,
        f"waves of {wave}, median of rounds" if relay_key else "no raw-waves variant in bench.confirm")
    main = drains.get("100") or (next(iter(drains.values())) if drains else {})
    cpu, raw_cpu = main.get("worker_cpu_us_per_event"), main.get("raw_loop_cpu_us_per_event")
    put("cpu", f"{fmt(cpu)} us/ev", f"raw loop {fmt(raw_cpu)} us/ev", cpu,
        cpu / raw_cpu if cpu and raw_cpu else None, "100-aggregate drain, parent + children")
    worst: tuple[float, str] | None = None
    for aggregates, d in drains.items():
        busy = {k: v for k, v in (d.get("busy") or {}).items() if k.startswith("child")}
        values = [float(v) for v in busy.values()]
        if len(values) >= 2 and max(values) > 0:
            share = min(values) / max(values)
            text = f"{aggregates} agg: " + "/".join(f"{v:.2f}" for v in values)
            if worst is None or share < worst[0]:
                worst = (share, text)
    put("busy", worst[1] if worst else "n/a", "busiest child", worst[0] if worst else None,
        worst[0] if worst else None, "busy = CPU / drain wall time, worst spread")
    hot = results.get("hot") or {}
    strict, piped = hot.get("strict_events_per_s"), hot.get("pipelined_events_per_s")
    h_ratio = hot.get("ratio") or (piped / strict if piped and strict else None)
    put("hot", f"{fmt(piped)} ev/s", f"strict {fmt(strict)} ev/s", h_ratio, h_ratio,
        f"{hot['events']} events" + ("" if hot.get("order_ok", True) else "; ORDER BROKEN") if hot else "")
    live = results.get("live") or {}
    wake, poll = live.get("wake") or {}, live.get("poll") or {}
    for q, key in (("p50_ms", "live_p50"), ("p99_ms", "live_p99")):
        put(key, f"{fmt(wake.get(q), 1)} ms", f"poll {fmt(poll.get(q), 1)} ms", wake.get(q),
            wake[q] / poll[q] if wake.get(q) and poll.get(q) else None)
    added = wake.get("writer_added_p50_ms")
    put("wake_tax", f"{fmt(added, 2)} ms", f"plain commit {fmt(wake.get('writer_plain_p50_ms'), 2)} ms", added,
        wake["writer_wake_p50_ms"] / wake["writer_plain_p50_ms"] if wake.get("writer_plain_p50_ms") else None,
        f"with the wake {fmt(wake.get('writer_wake_p50_ms'), 2)} ms; 1 commit in {wake.get('plain_every', '?')} "
        "plain, same writers" if wake else "")
    mem = results.get("memory") or {}
    idle = max((p.get("idle_rss_mb") or 0 for p in mem.get("per_process", [])), default=None)
    put("rss", f"{fmt(mem.get('max_rss_mb'), 1)} MB", f"idle worker {fmt(idle, 1)} MB", mem.get("max_rss_mb"),
        mem["max_rss_mb"] / idle if mem.get("max_rss_mb") and idle else None,
        f"{mem.get('events', '?')} events, {mem.get('large_events', '?')} of "
        f"{(mem.get('big_bytes') or 0) / 1e6:.1f} MB" if mem else "")
    out = []
    for t in TARGETS:
        row = rows.get(t.key, {"value": None, "baseline": None, "figure": None, "ratio": None, "note": ""})
        goal = f"{'>=' if t.higher else '<='} {t.goal:g}{'x' if t.unit == 'x' else ' ' + t.unit}"
        out.append({"target": t.number, "key": t.key, "what": t.text, "goal": goal, **row,
                    "verdict": verdict(t, row["figure"])})
    return out


def targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'#':2s} {'target':58s} {'measured':>22s} {'baseline (same run)':>26s} {'ratio':>6s} "
             f"{'goal':>10s}  verdict"]
    for r in rows:
        ratio = f"x{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        lines.append(f"{r['target']:2s} {r['what'][:58]:58s} {fmt(r['value']):>22s} {fmt(r['baseline']):>26s} "
                     f"{ratio:>6s} {r['goal']:>10s}  {r['verdict']}" + (f"  [{r['note']}]" if r["note"] else ""))
    return lines


def summary(results: dict[str, Any]) -> str:
    lines = ["", "=" * 100, "outbox relay benchmark summary (issue 11)", "=" * 100]
    m = results.get("machine", {})
    lines.append(f"machine: {m.get('nproc')} cores, {m.get('memory_mb')} MB, {m.get('cpu')}; {m.get('date')}")
    lines.append(f"versions: python {m.get('python')}, celery {m.get('celery')}, kombu {m.get('kombu')}, "
                 f"amqp {m.get('amqp')}, psycopg {m.get('psycopg')}; PostgreSQL {m.get('postgresql')} "
                 f"(synchronous_commit={m.get('pg_synchronous_commit')}), RabbitMQ {m.get('rabbitmq')}, "
                 f"Redis {m.get('redis_server')}")
    confirm = results.get("confirm")
    if confirm:
        lines += ["", "publisher micro-benchmark (events/s; ratio to the first variant):"]
        for name, r in confirm.items():
            lines.append(f"  {name:32s} {fmt(r.get('events_per_s')):>9s} ev/s  {fmt(r.get('us_per_event'), 1):>8s} "
                         f"us/ev  x{r.get('ratio', float('nan')):.2f}")
    for aggregates, d in (results.get("drain") or {}).items():
        lines += ["", f"ordered drain over {aggregates} aggregates (relay / raw loop x{fmt(d.get('ratio'), 2)}):"]
        for name in ("raw", "relay"):
            r = d.get(name)
            if not r:
                continue
            order = r.get("order") or {}
            lines.append(f"  {name:6s} {fmt(rate(r)):>9s} ev/s  {r.get('events')} events"
                         + (f" (order ok={order.get('ok')}, duplicates {order.get('duplicates')}, "
                            f"complete={r.get('complete')}, max RSS {r['memory']['max_rss_mb']} MB)" if order else ""))
            per = r.get("cpu_us_per_event")
            if per:
                lines.append("         CPU us/event: " + ", ".join(f"{k} {v:.0f}" for k, v in per.items()))
            busy = r.get("busy")
            if busy:
                lines.append("         busy: " + (", ".join(f"{k} {v:.2f}" for k, v in busy.items())
                                                  if isinstance(busy, dict) else ", ".join(f"{v:.2f}" for v in busy)))
    hot = results.get("hot")
    if hot:
        lines += ["", f"hot aggregate ({hot.get('events')} events on one aggregate): strict "
                      f"{fmt(hot.get('strict_events_per_s'))} ev/s, pipelined {fmt(hot.get('pipelined_events_per_s'))} "
                      f"ev/s (x{fmt(hot.get('ratio'), 1)}), order ok={hot.get('order_ok')}"]
    live = results.get("live") or {}
    if live:
        lines += ["", f"live latency, commit -> arrival ({fmt(results.get('live_rate'))} ev/s for "
                      f"{fmt(results.get('live_seconds'))} s):"]
        for name, r in live.items():
            extra = "".join(f", {k} {fmt(r.get(k), 2)} ms" for k in ("writer_wake_p50_ms", "writer_plain_p50_ms",
                                                                     "wake_call_p50_ms") if r.get(k) is not None)
            lines.append(f"  {name:36s} p50 {fmt(r.get('p50_ms'), 1):>6s} ms  p90 {fmt(r.get('p90_ms'), 1):>6s} ms  "
                         f"p99 {fmt(r.get('p99_ms'), 1):>6s} ms  max {fmt(r.get('max_ms'), 1):>6s} ms  "
                         f"({r.get('arrived')}/{r.get('committed')} arrived, order ok={(r.get('order') or {}).get('ok')})"
                         + extra)
    mem = results.get("memory")
    if mem:
        lines += ["", f"memory: {mem['events']} events, 1 in {mem['big_every']} of {mem['big_bytes'] / 1e6:.1f} MB, "
                      f"{fmt(mem.get('events_per_s'))} ev/s, complete={mem['complete']}, order ok={mem['order']['ok']}"]
        lines.append("  peak RSS: " + ", ".join(
            f"{p['role']} {max(p['max_rss_mb'], p['peak_hwm_mb'])} MB (idle {p['idle_rss_mb']})"
            for p in mem["per_process"]))
    lost = results.get("takeover")
    if lost:
        lines += ["", f"lost worker ({lost['events']} events over {lost['aggregates']} aggregates, one of two workers "
                      f"SIGKILLed): longest stand-still {fmt(lost['longest_stand_still_s'], 2)} s (median "
                      f"{fmt(lost['lost_worker']['median_stand_still_s'], 2)} s); fault-free drain: longest "
                      f"{fmt(lost['fault_free_longest_stand_still_s'], 2)} s"]
    if results.get("kafka"):
        from .kafka import summary_lines

        lines += ["", *summary_lines(results["kafka"])]
    prof = results.get("profile")
    if prof:
        lines += ["", f"profile (py-spy --idle, {prof['events']} events, {fmt(prof.get('events_per_s'))} ev/s sampled):"]
        for role, s in prof["profiles"].items():
            if "buckets" in s:
                lines.append(f"  {role}: " + ", ".join(f"{k} {v}%" for k, v in list(s["buckets"].items())[:7]))
    tuning = results.get("tuning")
    if tuning:
        lines += ["", f"the worker with other settings ({results.get('tuning_events')} events, 100 aggregates):"]
        for name, r in tuning.items():
            lines.append(f"  {name:46s} {fmt(rate(r)):>7s} ev/s (order ok={r['order']['ok']})")
    lines += ["", "targets of issue 11 (ratios measured in this run):"]
    lines += targets_table(results.get("targets") or target_rows(results))
    other = []
    for name, r in [*[(f"drain {k}", v.get("relay")) for k, v in (results.get("drain") or {}).items()],
                    *[(f"live {k}", v) for k, v in live.items()]]:
        if r and "cpu" in r:
            cores = r["cpu"]["cores_used"].get("other python (not this bench)", 0.0)
            if cores > 0.1:
                other.append(f"{name} {cores:.2f} cores")
    if other:
        lines += ["", "WARNING: other Python processes (not this bench) used CPU during: " + ", ".join(other)
                  + "; those figures are pessimistic"]
    if results.get("skipped"):
        lines += ["", "skipped: " + "; ".join(results["skipped"])]
    lines.append(f"total {fmt(results.get('total_seconds'))} s")
    lines.append("=" * 100)
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_services()
    started = time.monotonic()
    budget = args.max_minutes * 60.0

    def remaining() -> float:
        return budget - (time.monotonic() - started)

    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    run = Run(batch_size=args.batch_size, claim_interval_s=1.0, workdir=workdir)
    # This process wakes the relay (live phase): it must see the same settings as the worker.
    for key in [k for k in os.environ if k.startswith(("OUTBOX_", "CELERY_"))]:
        del os.environ[key]
    os.environ.update(run.outbox_env())
    sys.path.insert(0, str(workdir))

    results: dict[str, Any] = {"events": args.events, "tuning_events": args.tuning_events,
                               "aggregate_counts": args.aggregate_counts, "live_rate": args.live_rate,
                               "live_seconds": args.live_seconds, "skipped": [], "run": run.tag,
                               "quick": args.quick, "quiet": {}, "live": {}}
    log(f"run {run.tag}: table {run.table}, exchange {run.exchange}, Celery broker {run.redis_url}, "
        f"work dir {workdir}, budget {args.max_minutes:g} min")
    flushed = flush_redis(run.redis_url)
    if flushed:
        log(f"flushed {flushed} keys from {run.redis_url} (the bench's spare db)")
    results["machine"] = machine_facts(run)
    create_table(run)
    destination = Destination(run)
    relay = None
    from . import confirm, drain, kafka, live, memory, profiling, takeover

    def quiet(phase: str) -> None:
        """Other sessions may share this machine: start each phase on an idle machine if
        that happens within a bound, and record how busy it was."""
        if args.no_wait_quiet:
            return
        results["quiet"][phase] = wait_quiet(max_busy=0.25 if relay is None else 0.35,
                                             timeout=min(60.0, max(3.0, remaining() / 20)))

    def relay_factory(**env: str) -> Any:
        return drain.Relay(run, concurrency=args.concurrency, loglevel=args.worker_loglevel, **env)

    def stop_relay() -> None:
        nonlocal relay
        if relay is not None:
            relay.stop()
            relay = None

    def skip(phase: str, why: str) -> None:
        results["skipped"].append(f"{phase} ({why})")
        log(f"skipping {phase}: {why}")

    try:
        if "confirm" not in args.skip:
            quiet("confirm")
            results["confirm"] = confirm.run_confirm_bench(run, destination, args.confirm_events)

        if "drain" not in args.skip:
            stop_relay()
            spreads = tuple(args.aggregate_counts)
            quiet("drain")
            results["drain"], relay = drain.compare_with_raw_loop(
                run, destination, relay_factory, args.events, spreads, processes=args.concurrency,
                timeout=max(60.0, min(300.0, remaining() / (2 * len(spreads) + 2))))

        if "hot" not in args.skip:
            hot = optional_module("hot")
            if hot is None or not hasattr(hot, "run_hot"):
                skip("hot", "no bench/hot.py run_hot yet")
            elif remaining() < 60:
                skip("hot", "time budget")
            else:
                stop_relay()
                quiet("hot")
                # Its own table, exchange and consumer (a second consumer on ours would split the messages).
                results["hot"] = call(hot.run_hot, args.hot_events, batch_size=args.batch_size,
                                      concurrency=args.concurrency, timeout=max(60.0, min(300.0, remaining() / 4)))

        if "live" not in args.skip:
            # bench.live's variants: name -> (run_live's kind, the worker's extra environment).
            variants = dict(getattr(live, "VARIANTS", {"wake": ("wake", {}), "poll": ("poll", {}),
                                                      "listen": ("listen", {"OUTBOX_RELAY_LISTEN": "1"})}))
            if args.quick:  # the two the targets need
                variants = {k: v for k, v in variants.items() if k in ("wake", "poll")}
            elif not args.listen:
                variants = {k: v for k, v in variants.items() if v[0] != "listen"}
            current_env: dict[str, str] | None = None
            for name, (kind, env) in variants.items():
                if remaining() < args.live_seconds + 40:
                    skip(f"live {name}", "time budget")
                    continue
                if relay is None or env != current_env:
                    stop_relay()
                    relay, current_env = relay_factory(**env), env
                    relay.wait_ready(args.concurrency)
                quiet(f"live-{name}")
                live.set_listen(kind == "listen")
                try:
                    results["live"][name] = live.run_live(run, destination, kind, args.live_rate, args.live_seconds,
                                                          100, args.writers, cpu_groups=drain.cpu_groups(relay),
                                                          alive=relay.check_alive)
                finally:
                    live.set_listen(False)

        if "memory" not in args.skip:
            if remaining() < 45:
                skip("memory", "time budget")
            else:
                stop_relay()
                quiet("memory")
                results["memory"] = memory.run_memory(run, destination, relay_factory, args.memory_events, 100,
                                                      big_every=args.big_every, big_bytes=args.big_bytes,
                                                      timeout=max(60.0, min(300.0, remaining() / 2)))

        if "takeover" not in args.skip:
            if remaining() < 60:
                skip("takeover", "time budget")
            else:
                stop_relay()
                quiet("takeover")
                # Its own table, exchange, consumer and workers (two, one of them killed).
                results["takeover"] = takeover.run_takeover(min(args.events, 12_000), 40,
                                                            concurrency=args.concurrency)

        if "kafka" not in args.skip:
            if remaining() < 120:
                skip("kafka", "time budget")
            else:
                stop_relay()
                quiet("kafka")
                try:
                    # Its own table, topics, consumers and workers; a broker of its own unless
                    # OUTBOX_BENCH_KAFKA_URL names one.
                    results["kafka"] = kafka.run_kafka(args.events, 100, batch_size=args.batch_size,
                                                       concurrency=args.concurrency,
                                                       timeout=max(60.0, min(300.0, remaining() / 4)))
                except ImportError as exc:
                    skip("kafka", f"{exc.name} is not installed (the dev extra has confluent-kafka and Tansu)")

        if "profile" not in args.skip:
            if not os.path.exists(PY_SPY):
                skip("profile", f"no py-spy at {PY_SPY}: pip install py-spy")
            elif remaining() < 150:
                skip("profile", "time budget")
            else:
                stop_relay()
                relay = relay_factory()
                relay.wait_ready(args.concurrency)
                quiet("profile")
                results["profile"] = profiling.profile_drain(run, destination, relay, args.profile_events, 100,
                                                             timeout=min(240.0, remaining() / 3))

        if "tuning" not in args.skip:
            results["tuning"] = {}
            variants = [
                ("batch 400, task rows 200", {"OUTBOX_BATCH_SIZE": "400", "OUTBOX_RELAY_TASK_ROWS": "200"}),
                ("synchronous_commit=off", {"PGOPTIONS": "-c synchronous_commit=off"}),
            ]
            for name, env in variants:
                if remaining() < 60:
                    skip(f"tuning {name}", "time budget")
                    continue
                stop_relay()
                relay = relay_factory(**env)
                relay.wait_ready()
                quiet(f"tuning-{name}")
                results["tuning"][f"celery {name}"], relay = drain.run_celery_drain(
                    run, destination, relay_factory, args.tuning_events, 100,
                    timeout=max(60.0, min(300.0, remaining() / 2)), relay=relay, label=f"tuning drain [{name}]")

    finally:
        if relay is not None:
            results["worker_log_tail"] = relay.log_tail(chars=2000)
        stop_relay()
        destination.close()
        try:
            drop_table(run)
        except Exception as exc:  # noqa: BLE001
            log(f"could not drop {run.table}: {exc}")
        try:
            flush_redis(run.redis_url)
        except Exception as exc:  # noqa: BLE001
            log(f"could not flush {run.redis_url}: {exc}")
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        results["total_seconds"] = round(time.monotonic() - started, 1)
        results["targets"] = target_rows(results)
        if args.json:
            args.json.write_text(to_json(results))
            log(f"wrote {args.json}")
    print(summary(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
