"""``python -m bench.dramatiq_drain``: the ordered backlog drain on Dramatiq against Celery,
in the same run, on the same backlog, database, destination and Redis.

* Celery: ``celery -A outbox worker -P prefork -c N`` + ``celery -A outbox beat`` (``bench.drain.Relay``).
* Dramatiq: ``dramatiq outbox.dramatiq --processes N --threads T`` + ``outbox-dramatiq-scheduler``,
  Dramatiq's broker on the same Redis under a namespace of the run's own.

Both drains go through ``bench.drain.run_celery_drain`` (load the backlog, start the relay,
time first to last arrival, check the per-aggregate order), so the figures compare the
runners and nothing else. Prints each rate and the ratio Dramatiq / Celery; ``--json``
writes everything. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import Destination, Run, create_table, drop_table, log, require_services, to_json
from .drain import Relay, run_celery_drain

BIN = Path(sys.executable).parent


def dramatiq_env(run: Run) -> dict[str, str]:
    """What points a process at the run's Dramatiq relay: its workers, scheduler, and a writer's
    wake (``outbox.wake`` wakes Dramatiq when ``OUTBOX_DRAMATIQ_BROKER_URL`` is set)."""
    return {"OUTBOX_DRAMATIQ_BROKER_URL": run.redis_url, "OUTBOX_DRAMATIQ_NAMESPACE": f"outbox-bench-{run.tag}"}


class DramatiqRelay(Relay):
    """The same shape as ``bench.drain.Relay`` (worker + scheduler process groups), on Dramatiq."""

    def __init__(self, run: Run, concurrency: int = 2, threads: int = 2, loglevel: str = "WARNING",
                 **env: str) -> None:
        self.run = run
        self.concurrency = concurrency
        self.dir = run.workdir
        self.env = run.child_env(**dramatiq_env(run), **env)
        self.worker = self._spawn("worker", [str(BIN / "dramatiq"), "outbox.dramatiq", "--processes",
                                             str(concurrency), "--threads", str(threads)])
        self.beat = self._spawn("beat", [str(BIN / "outbox-dramatiq-scheduler"), f"--loglevel={loglevel}"])

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.dir / f"dramatiq-{name}.log", "ab") as out:
            return subprocess.Popen(argv, cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def log_tail(self, name: str = "worker", chars: int = 3000) -> str:
        try:
            return (self.dir / f"dramatiq-{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dramatiq_drain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--aggregates", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=2, help="worker processes of each runner")
    p.add_argument("--threads", type=int, default=2, help="threads per Dramatiq worker process")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    require_services()
    run = Run(batch_size=args.batch_size, claim_interval_s=1.0, workdir=Path(tempfile.mkdtemp(prefix="outbox-bench-")))
    create_table(run)
    destination = Destination(run)
    results: dict[str, Any] = {"events": args.events, "aggregates": args.aggregates,
                               "concurrency": args.concurrency, "threads": args.threads}
    try:
        for name, factory in (("celery", lambda: Relay(run, concurrency=args.concurrency)),
                              ("dramatiq", lambda: DramatiqRelay(run, args.concurrency, args.threads))):
            relay = None
            try:
                results[name], relay = run_celery_drain(run, destination, factory, args.events, args.aggregates,
                                                        label=f"{name} drain")
            finally:
                if relay is not None:
                    relay.stop()
        rates = {name: results[name]["events_per_s"] for name in ("celery", "dramatiq")}
        results["ratio_dramatiq_to_celery"] = rates["dramatiq"] / rates["celery"] if rates["celery"] else None
        for name in ("celery", "dramatiq"):
            r = results[name]
            print(f"{name:9s} {r['events_per_s']:8.0f} ev/s  (steady {r.get('steady_events_per_s', 0):.0f}; "
                  f"{r['arrived']}/{args.events} arrived, order ok={r['order']['ok']}, "
                  f"max worker RSS {r['memory']['max_rss_mb']} MB)")
        print(f"ratio dramatiq/celery: {results['ratio_dramatiq_to_celery']:.2f}")
        if args.json:
            args.json.write_text(to_json(results))
    finally:
        destination.close()
        drop_table(run)
    log(f"done (work dir {run.workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
