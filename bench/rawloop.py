"""The raw unordered loop of issue 11: the speed the machine can durably move a backlog at,
with nothing of the product in the way. ``processes`` OS processes, each looping:

    BEGIN;
    SELECT the ``batch`` oldest pending rows FOR UPDATE SKIP LOCKED;
    publish them as ONE wave of persistent messages, publisher confirms on (py-amqp);
    wait for every ack;
    UPDATE them done;
    COMMIT

until a SELECT comes back empty. No ordering rule (two processes may interleave an
aggregate's rows), no lease, no Celery: the ceiling the ordered relay is compared with.
On PostgreSQL and MariaDB/MySQL alike; on SQLite the transaction is ``BEGIN IMMEDIATE``
and the SELECT locks nothing (the one write lock is the process's until COMMIT, so the
processes take turns). The engine follows the database URL (``bench.engines``).

``run_raw_loop`` (called by ``bench.drain`` and ``python -m bench``) starts the processes
(``python -m bench.rawloop child ...``), starts them all at once, and returns events/s and
the CPU every process group used while they ran (``common.CpuWindow``), per event, plus each
loop process's busy fraction (its own CPU over its wall time). ``python -m bench.rawloop``
runs it alone on a fresh table and backlog.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from .common import CpuWindow, amqp_connection, confirm_channel, cpu_summary, log, service_groups
from .engines import ENGINES, engine_of_url


def _child(database_url: str, amqp_url: str, table: str, exchange: str, batch: int) -> int:
    """One loop process: prints ``ready``, waits for a line on stdin, drains, prints its
    result as JSON, then waits for another line (so the caller can read the CPU of this
    process and its database backend before they go away)."""
    import amqp

    conn = amqp_connection(amqp_url)
    ch, state = confirm_channel(conn)
    spec = engine_of_url(database_url)
    db = spec.connect(database_url)
    select = spec.raw_select(table)
    print("ready", flush=True)
    sys.stdin.readline()
    tag = published = waves = 0
    t_select = t_publish = t_ack = t_done = 0.0
    cpu0, t0 = os.times(), time.perf_counter()
    while True:
        a = time.perf_counter()
        spec.begin(db)
        cur = db.cursor()
        try:
            cur.execute(select, (batch,))
            rows = cur.fetchall()
            b = time.perf_counter()
            t_select += b - a
            if not rows:
                db.commit()
                break
            for oid, message_id, topic, agg_type, agg_id, partition_key, payload, headers in rows:
                h = json.loads(headers) if headers else {}
                h.update({"message_id": message_id, "outbox_id": oid, "topic": topic, "aggregate_type": agg_type,
                          "aggregate_id": agg_id, "partition_key": partition_key or agg_id, "attempt": 1})
                ch.basic_publish(amqp.Message(payload.encode("utf-8"), application_headers=h, delivery_mode=2,
                                              content_type="application/json", message_id=message_id),
                                 exchange, topic, mandatory=True)
                tag += 1
            c = time.perf_counter()
            t_publish += c - b
            while state["acked"] < tag:
                conn.drain_events(timeout=15)
            d = time.perf_counter()
            t_ack += d - c
            cur.execute(*spec.raw_done(table, [r[0] for r in rows]))
        finally:
            cur.close()
        db.commit()
        t_done += time.perf_counter() - d
        published += len(rows)
        waves += 1
    elapsed = time.perf_counter() - t0
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(json.dumps({"published": published, "waves": waves, "seconds": elapsed, "cpu_s": cpu,
                      "busy": cpu / elapsed if elapsed > 0 else 0.0, "nacked": state["nacked"],
                      "select_s": t_select, "publish_s": t_publish, "ack_s": t_ack, "done_s": t_done}), flush=True)
    sys.stdin.readline()
    db.close()
    conn.close()
    return 0 if not state["nacked"] else 1


def run_raw_loop(database_url: str, amqp_url: str, table: str, exchange: str, processes: int = 2,
                 batch: int = 100, timeout: float = 600.0) -> dict[str, Any]:
    """Drain ``table``'s pending rows with the raw loop in ``processes`` processes, on the
    database of ``database_url`` (PostgreSQL, MariaDB/MySQL or SQLite).

    Returns ``events_per_s`` (rows published over the wall time from "go" to the last
    process done), ``per_process`` (each process's own result, with ``busy`` = its CPU
    over its wall time), ``cpu`` (``CpuWindow.stop()``, groups: ``raw loop`` and the
    services) and ``cpu_us_per_event`` per group."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "bench.rawloop", "child", "--database-url", database_url, "--amqp-url", amqp_url,
           "--table", table, "--exchange", exchange, "--batch", str(batch)]
    procs = [subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(processes)]
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"raw loop process did not start: {line}{p.stderr.read() if p.stderr else ''}")
        pids = {p.pid for p in procs}
        window = CpuWindow({"raw loop": lambda pid, comm: pid in pids, **service_groups()})
        window.start()
        started = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        deadline = time.monotonic() + timeout
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if not line.strip():
                raise RuntimeError(f"raw loop process failed: {p.stderr.read() if p.stderr else ''}")
            results.append(json.loads(line))
            if time.monotonic() > deadline:
                raise RuntimeError("raw loop timed out")
        wall = time.perf_counter() - started
        cpu = window.stop()  # before the processes (and their database backends) go away
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("bye\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    published = sum(r["published"] for r in results)
    per_event = {k: round(1e6 * v * cpu["elapsed_s"] / max(1, published), 1) for k, v in cpu["cores_used"].items()}
    result = {"events": published, "seconds": wall, "events_per_s": published / wall if wall > 0 else 0.0,
              "processes": processes, "batch": batch, "per_process": results,
              "busy": [round(r["busy"], 3) for r in results], "cpu": cpu, "cpu_us_per_event": per_event,
              "loop_cpu_us_per_event": per_event.get("raw loop", 0.0)}
    log(f"raw loop ({processes} processes, waves of {batch}): {published} events in {wall:.2f}s = "
        f"{result['events_per_s']:.0f} ev/s; loop CPU {result['loop_cpu_us_per_event']:.0f} us/event; "
        f"busy {result['busy']}")
    log(f"raw loop: {cpu_summary(cpu, per_event)}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rawloop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("child", help="one loop process (started by run_raw_loop)")
    for p in (child,):
        p.add_argument("--database-url", required=True)
        p.add_argument("--amqp-url", required=True)
        p.add_argument("--table", required=True)
        p.add_argument("--exchange", required=True)
        p.add_argument("--batch", type=int, default=100)
    alone = sub.add_parser("run", help="load a backlog in a fresh table and drain it with the raw loop")
    alone.add_argument("--events", type=int, default=20_000)
    alone.add_argument("--aggregates", type=int, default=100)
    alone.add_argument("--processes", type=int, default=2)
    alone.add_argument("--batch", type=int, default=100)
    alone.add_argument("--engine", default="postgresql", choices=sorted(ENGINES),
                       help="the database (bench.engines; default postgresql)")
    args = parser.parse_args(argv)
    if args.command == "child":
        return _child(args.database_url, args.amqp_url, args.table, args.exchange, args.batch)
    if args.command == "run":
        import shutil
        import tempfile
        from pathlib import Path

        from .common import Destination, Run, create_table, drop_table, load_backlog, to_json

        run = Run(engine=args.engine, workdir=Path(tempfile.mkdtemp(prefix="outbox-rawloop-")))
        create_table(run)
        destination = Destination(run)
        try:
            load_backlog(run, args.events, args.aggregates)
            result = run_raw_loop(run.database_url, run.amqp_url, run.table, run.exchange, args.processes, args.batch)
            destination.wait_for(args.events, timeout=30, idle_timeout=5)
            result["arrived"] = destination.unique()
            print(to_json({k: v for k, v in result.items() if k != "cpu"}))
        finally:
            destination.close()
            drop_table(run)
            shutil.rmtree(run.workdir, ignore_errors=True)
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
