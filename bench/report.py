"""The report of ``python -m bench``: the targets of issue 11 (``TARGETS``), each turned
into a figure, the same-run baseline, the ratio and a verdict (``target_rows``), and the
printed summary of every phase (``summary``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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
    Target("drain_100", "1, 25", "ordered drain, 100 aggregates / raw loop", 1.0, True, "x"),
    Target("drain_10000", "1, 25", "ordered drain, 10,000 aggregates / raw loop", 1.0, True, "x"),
    Target("publish", "2", "publishing path / raw py-amqp waves", 0.9, True, "x"),
    Target("cpu", "3", "relay-worker CPU per event (us)", 150.0, False, "us"),
    Target("busy", "4", "least busy / busiest pool child", 0.8, True, "x"),
    Target("hot", "5, 25", "hot aggregate, pipelined / raw loop", 0.9, True, "x"),
    Target("live_p50", "6", "live 200 ev/s, wake, commit-to-arrival p50 (ms)", 5.0, False, "ms"),
    Target("live_p99", "6", "live 200 ev/s, wake, commit-to-arrival p99 (ms)", 25.0, False, "ms"),
    Target("wake_tax", "6", "wake's cost to the writer's enqueue+commit p50 (ms)", 0.3, False, "ms"),
    Target("rss", "7", "max RSS of a worker process, 1 MB payloads mixed in (MB)", 256.0, False, "MB"),
)


def rate(result: dict[str, Any] | None) -> float | None:
    return (result or {}).get("events_per_s")


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
    raw, piped = hot.get("raw_events_per_s"), hot.get("pipelined_events_per_s")
    h_ratio = hot.get("pipelined_to_raw") or (piped / raw if piped and raw else None)
    put("hot", f"{fmt(piped)} ev/s", f"raw loop {fmt(raw)} ev/s", h_ratio, h_ratio,
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
        lines += ["", f"hot aggregate ({hot.get('events')} events on one aggregate): raw loop "
                      f"{fmt(hot.get('raw_events_per_s'))} ev/s, strict {fmt(hot.get('strict_events_per_s'))} ev/s, "
                      f"pipelined {fmt(hot.get('pipelined_events_per_s'))} ev/s (x{fmt(hot.get('ratio'), 1)} of strict), "
                      f"order ok={hot.get('order_ok')}"]
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
