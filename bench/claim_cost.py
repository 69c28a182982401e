"""What one claim statement costs PostgreSQL: ``EXPLAIN (ANALYZE)`` of ``PostgresEngine.claim_pass``
on a fresh backlog (``--events`` rows written round-robin over each of ``--spreads``
aggregates), after a few claims have been made and marked done, repeated ``--repeat`` times
inside a transaction that is rolled back (the backlog stays the same): the execution time's
minimum and median, and the planning time of the last run.

``--compare-src LABEL=DIR`` measures the claim of another version of the relay (``DIR`` put
first on ``PYTHONPATH`` of a child process) on the same kind of backlog, in the same run,
so the ratio new / old is read on one machine state (docs/benchmarks.md, "The claim's cost on
PostgreSQL"). Talks only to the ``--database-url`` given (127.0.0.1 by default).

    python -m bench.claim_cost --compare-src before=/tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def measure(url: str, table: str, events: int, aggregates: int, batch: int, repeat: int) -> dict[str, Any]:
    """Load the backlog, claim and mark done ``5`` batches, then EXPLAIN ANALYZE the next claim."""
    import psycopg

    from outbox.storage.store import OutboxStore

    from .backlog import backlog_rows
    from .engines import engine

    store = OutboxStore(url, table=table)
    store.migrate()
    spec = engine("postgresql")
    with psycopg.connect(url) as conn:  # the drain benchmarks' backlog, loaded as they load it
        conn.execute(spec.truncate(table))
        spec.load(conn, table, backlog_rows(events, aggregates))
        conn.commit()
        for statement in spec.analyze(table):
            conn.execute(statement)
        conn.commit()
    for _ in range(5):
        claim = store.claim(batch)
        store.mark_done([m.id for m in claim.messages], claim.lease)
    statement: dict[str, Any] = {}
    engine = store.engine
    # The claim's statement as the engine sends it: through ``execute_native`` ($n placeholders,
    # this tree) or ``execute`` (? placeholders: a tree of --compare-src from before it).
    hooks = [name for name in ("execute_native", "execute") if hasattr(engine, name)]
    saved = {name: getattr(engine, name) for name in hooks}

    def capturing(native: bool) -> Any:
        def capture(cursor: Any, sql: str, params: Any = ()) -> Any:
            statement.update(sql=sql, params=list(params), native=native)
            raise LookupError("captured")
        return capture

    for name in hooks:
        setattr(engine, name, capturing(name == "execute_native"))
    try:
        store.claim(batch)
    except LookupError:
        pass
    finally:
        for name, method in saved.items():
            setattr(engine, name, method)
    store.close()
    sql = statement["sql"] if statement["native"] else statement["sql"].replace("?", "%s")
    executions, planning, rows = [], 0.0, 0
    with psycopg.connect(url, cursor_factory=psycopg.RawCursor if statement["native"] else psycopg.Cursor) as conn:
        for _ in range(repeat):
            lines = [r[0] for r in conn.execute("EXPLAIN (ANALYZE, TIMING off) " + sql, statement["params"])]
            conn.rollback()
            executions.append(float(next(x for x in lines if x.startswith("Execution Time")).split()[2]))
            planning = float(next(x for x in lines if x.startswith("Planning Time")).split()[2])
            rows = int(lines[0].split("rows=")[-1].split()[0])
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_holders")
        conn.commit()
    return {"aggregates": aggregates, "rows_claimed": rows, "execution_ms_min": min(executions),
            "execution_ms_median": statistics.median(executions), "planning_ms": planning}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.claim_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--spreads", default="100,10000", help="aggregates in the backlog, comma-separated")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--compare-src", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    spreads = [int(s) for s in args.spreads.split(",")]
    if args.child:
        for aggregates in spreads:
            table = f"bench_claim_cost_{os.getpid()}"
            print(json.dumps(measure(args.database_url, table, args.events, aggregates, args.batch, args.repeat)))
        return 0
    versions = [("this", None)] + [tuple(item.split("=", 1)) for item in args.compare_src]
    results: dict[str, list[dict[str, Any]]] = {}
    for label, src in versions:
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, "-m", "bench.claim_cost", "--child", "--database-url",
                              args.database_url, "--events", str(args.events), "--spreads", args.spreads,
                              "--batch", str(args.batch), "--repeat", str(args.repeat)],
                             env=env, check=True, capture_output=True, text=True).stdout
        results[label] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for index, aggregates in enumerate(spreads):
        base = results["this"][index]
        line = (f"claim of {args.batch} over {args.events} events, {aggregates} aggregates: this "
                f"{base['execution_ms_min']:.2f} ms (median {base['execution_ms_median']:.2f}, "
                f"{base['rows_claimed']} rows, planning {base['planning_ms']:.2f} ms)")
        for label, _ in versions[1:]:
            other = results[label][index]
            line += (f"; {label} {other['execution_ms_min']:.2f} ms (median {other['execution_ms_median']:.2f}): "
                     f"this / {label} x{base['execution_ms_min'] / other['execution_ms_min']:.2f}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
