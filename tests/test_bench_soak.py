"""``bench.soak``'s pure part: the least-squares slope, the floor, and the verdict on a series of
samples (GROWS, STEP, flat), on made-up series; and ``--faults``' schedule, the samples its
verdicts keep, the recovery after each cut, and the connections counted through the proxy."""

from __future__ import annotations

import math
import os

import pytest

from bench.services import Run
from bench.soak import (
    MEASURES,
    Fault,
    Measure,
    analyse,
    assess,
    by_peer,
    commit_arrivals,
    duplicates_by_cut,
    fault_schedule,
    fault_urls,
    floors,
    longest_gap,
    missing_by_aggregate,
    proxied,
    recovered,
    recovery,
    service_ports,
    settled,
    slope,
    verdict_line,
    wake_env,
)

RSS = next(m for m in MEASURES if m.key == "rss_mb")
FDS = next(m for m in MEASURES if m.key == "fds")


def every(seconds: float, values: list[float]) -> list[tuple[float, float]]:
    return [(k * seconds, v) for k, v in enumerate(values)]


def test_the_slope_of_a_line_is_exact_and_of_too_little_is_zero() -> None:
    assert slope([(t, 3.0 + 0.5 * t) for t in range(10)]) == pytest.approx(0.5)
    assert slope([(0.0, 1.0)]) == 0.0
    assert slope([(5.0, 1.0), (5.0, 9.0)]) == 0.0


def test_a_floor_ignores_a_spike_that_went_away() -> None:
    assert floors([10, 14, 10, 11, 12]) == [10, 10, 10, 11, 12]


def test_a_steady_rss_leak_grows() -> None:
    # 60 MB + 30 MB/h, a sample every 15 s for 10 minutes, a little jitter.
    values = [60.0 + 30.0 * k * 15 / 3600 + (0.2 if k % 3 == 0 else 0.0) for k in range(41)]
    a = assess(every(15, values), warmup_s=120, measure=RSS)
    assert a["verdict"] == "GROWS"
    assert a["slope_per_hour"] == pytest.approx(30.0, rel=0.05)
    assert a["warm"] == values[8] and a["end"] == values[-1]
    assert a["resolution_per_hour"] == pytest.approx(1.0 / (480 / 3600))


def test_growth_in_the_warm_up_only_is_flat() -> None:
    values = [50.0 + k for k in range(9)] + [58.0] * 32
    assert assess(every(15, values), warmup_s=120, measure=RSS)["verdict"] == "flat"


def test_rss_jitter_with_a_slope_within_the_noise_is_flat_with_a_note() -> None:
    values = [60.0] * 20 + [60.8] * 21  # 0.8 MB: under one allocator step
    a = assess(every(15, values), warmup_s=0, measure=RSS)
    assert a["verdict"] == "flat"
    assert a["slope_per_hour"] > RSS.per_hour and "noise" in a["note"]


def test_counts_one_lasting_rise_is_a_step_and_rises_in_both_halves_grow() -> None:
    step = [40.0] * 10 + [41.0] * 10
    assert assess(every(15, step), warmup_s=0, measure=FDS)["verdict"] == "STEP"
    climbing = [40.0 + k // 4 for k in range(20)]
    assert assess(every(15, climbing), warmup_s=0, measure=FDS)["verdict"] == "GROWS"


def test_one_allocator_step_with_a_creep_around_it_is_a_step() -> None:
    # A pool child in a 2-minute run: +0.9 MB at once in the second half, +0.15 MB creeping in the first.
    values = [65.0 + 0.01 * k for k in range(15)] + [66.0 + 0.01 * k for k in range(15)]
    assert assess(every(5, values), warmup_s=0, measure=RSS)["verdict"] == "STEP"


def test_counts_that_spike_and_come_back_are_flat() -> None:
    spiky = [12.0, 13.0, 12.0, 12.0, 15.0, 12.0, 12.0, 13.0, 12.0, 12.0]
    a = assess(every(15, spiky), warmup_s=0, measure=FDS)
    assert a["verdict"] == "flat" and a["rise"] == 0


def test_too_few_samples_after_the_warm_up() -> None:
    a = assess(every(15, [1.0, 2.0, 3.0]), warmup_s=20, measure=FDS)
    assert a["verdict"] == "too few samples"


def test_analyse_and_the_verdict_line_name_the_process_that_grows() -> None:
    samples = [{"t": 15.0 * k, "sessions": 3,
                "procs": {"worker": {"pid": 1, "rss_mb": 60.0, "fds": 30, "threads": 5, "db": 1, "amqp": 1, "redis": 2},
                          "child 1": {"pid": 2, "rss_mb": 60.0 + k, "fds": 30 + k // 5, "threads": 3, "db": 1,
                                      "amqp": 1, "redis": 1}}}
               for k in range(41)]
    analysis = analyse(samples, warmup_s=120)
    assert analysis["rss_mb"]["worker"]["verdict"] == "flat"
    assert analysis["rss_mb"]["child 1"]["verdict"] == "GROWS"
    assert analysis["sessions"]["database"]["verdict"] == "flat"
    line = verdict_line(RSS, analysis["rss_mb"])
    assert line.startswith("RSS: GROWS in child 1;") and "+240.00 MB/h" in line
    assert verdict_line(FDS, analysis["fds"]).startswith("open fds: GROWS in child 1")
    threads = next(m for m in MEASURES if m.key == "threads")
    assert verdict_line(threads, analysis["threads"]).startswith("threads: flat in every process")


def test_a_measure_without_noise_has_no_resolution() -> None:
    a = assess(every(15, [1.0] * 10), warmup_s=0, measure=Measure("x", "x", "", 0.0, 0.0))
    assert a["resolution_per_hour"] == 0.0 and not math.isnan(a["slope_per_hour"])


def test_this_process_rss_split_by_mapping_adds_up_to_its_vmrss() -> None:
    from bench.procs import rss_by_mapping, rss_kb

    before = rss_kb(os.getpid()) or 0
    kinds = rss_by_mapping(os.getpid())
    after = rss_kb(os.getpid()) or 0
    assert kinds is not None and set(kinds) == {"heap", "arenas", "anon", "file"}
    assert kinds["file"] > 0  # the interpreter's own code
    # Reads moments apart while other threads allocate, and the kernel's VmRSS counters lag by up
    # to 64 pages per thread: within 3 % of the two reads either side (a lost kind of mapping
    # would be off by far more; CI once saw 2,120 kB of 225,552 with a fixed 2 MB bound).
    slack = max(2048, 0.03 * max(before, after))
    assert min(before, after) - slack <= sum(kinds.values()) <= max(before, after) + slack


# -- --faults -------------------------------------------------------------------------------------

def test_the_cuts_take_turns_from_the_warm_up_on_and_all_settle_before_the_end() -> None:
    targets = ["database", "RabbitMQ", "Redis"]
    schedule = fault_schedule(targets, start=24, every=20, seconds=5, settle_s=10, duration=120)
    assert [(f.target, f.at) for f in schedule] == [("database", 24), ("RabbitMQ", 44), ("Redis", 64),
                                                    ("database", 84), ("RabbitMQ", 104)]
    assert schedule[-1].end + 10 <= 120
    assert fault_schedule(targets, start=24, every=20, seconds=5, settle_s=10, duration=30) == []
    assert fault_schedule([], start=0, every=20, seconds=5, settle_s=10, duration=120) == []


def test_the_verdicts_keep_only_the_samples_taken_settled() -> None:
    samples = [{"t": 5.0 * k} for k in range(25)]
    faults = [Fault("database", 24, 5), Fault("RabbitMQ", 44, 5), Fault("Redis", 64, 5)]
    kept = [s["t"] for s in settled(samples, faults, settle_s=10)]
    # 20 is 4 s before the first cut; 40 is 11 s after its end; 43..59 and 63..79 are out.
    assert kept == [0, 5, 10, 15, 20, 40, 60, 80, 85, 90, 95, 100, 105, 110, 115, 120]
    assert [s["t"] for s in settled(samples, [Fault("x", 25, 5)], settle_s=0)] == \
        [t for t in kept if t < 24] + [t for t in (5.0 * k for k in range(25)) if t >= 30]


def test_a_lost_connection_in_one_sample_during_a_cut_makes_no_step_once_left_out() -> None:
    # Redis connections of a process: 8, but 1 in the samples taken during or just after cuts.
    faults = [Fault("Redis", 30, 5), Fault("Redis", 60, 5)]
    samples = [{"t": 5.0 * k, "procs": {"worker": {"pid": 1, "rss_mb": 60.0, "fds": 40, "threads": 7, "db": 3,
                                                  "amqp": 1, "redis": 1 if 30 <= 5 * k <= 35 or 60 <= 5 * k <= 65
                                                  else 8}}} for k in range(19)]
    fds = next(m for m in MEASURES if m.key == "redis")
    assert assess([(s["t"], s["procs"]["worker"]["redis"]) for s in samples], 20, fds)["verdict"] == "STEP"
    assert analyse(settled(samples, faults, settle_s=10), 20)["redis"]["worker"]["verdict"] == "flat"


def test_an_events_arrival_is_its_commit_and_its_latency() -> None:
    events = [{"at_s": 1.5, "ms": 250.0}, {"at_s": 2.5, "ms": None}]
    assert commit_arrivals(events) == [(1.5, 1.75), (2.5, None)]


def test_the_longest_gap_counts_the_edges() -> None:
    assert longest_gap([1.0, 2.0, 2.5], 0.0, 10.0) == 7.5
    assert longest_gap([], 3.0, 5.0) == 2.0
    assert longest_gap([4.0, 9.0, 20.0], 5.0, 10.0) == 4.0


def test_recovery_after_each_cut() -> None:
    # An event every 0.1 s from 0 to 60 s, each arriving 0.01 s later, except: a database cut at
    # 20-25 s holds everything committed in it until 26 s; after a Redis cut at 40-45 s nothing
    # arrives any more (a relay stuck after it) and the events committed from then on are lost.
    commits: list[tuple[float, float | None]] = []
    for k in range(600):
        c = k / 10
        if 20 <= c < 25:
            commits.append((c, 26.0 + k / 1000))
        elif c >= 40:
            commits.append((c, None))
        else:
            commits.append((c, c + 0.01))
    faults = [Fault("database", 20, 5), Fault("Redis", 40, 5)]
    first, second = recovery(commits, faults, end=59.9)
    assert first["arrived_during"] == 0 and first["first_after_s"] == pytest.approx(0.01)
    assert first["caught_up_s"] == pytest.approx(1.249) and first["missing"] == 0
    assert first["resumed"] and first["caught_up"]
    assert first["longest_gap_s"] == pytest.approx(0.1)  # arrivals every 0.1 s from 25.01 s on
    assert second["first_after_s"] is None and second["caught_up_s"] is None
    assert second["missing"] == 200 and not second["resumed"] and not second["caught_up"]
    assert second["longest_gap_s"] == pytest.approx(14.9)
    assert [recovered(r) for r in (first, second)] == ["resumed, caught up", "STUCK: nothing arrived after the cut"]
    lagging = recovery([(0.0, 0.5), (10.0, 30.0), (12.0, 12.5)], [Fault("database", 9, 2)], end=20)[0]
    assert lagging["resumed"] and not lagging["caught_up"] and recovered(lagging).startswith("resumed, NOT")


def test_each_repeated_arrival_is_charged_to_the_last_cut_begun_before_it() -> None:
    faults = [Fault("database", 20, 5), Fault("RabbitMQ", 50, 5)]
    repeats = [{"id": 1, "aggregate": "a", "first_s": 3.0, "again_s": 4.0},     # before any cut
               {"id": 2, "aggregate": "a", "first_s": 19.9, "again_s": 26.0},   # after the database cut
               {"id": 3, "aggregate": "b", "first_s": 49.0, "again_s": 50.0},   # as the RabbitMQ cut began
               {"id": 4, "aggregate": "b", "first_s": 49.0, "again_s": 80.0}]   # long after it: still its
    assert duplicates_by_cut(repeats, faults) == (1, [1, 2])
    assert duplicates_by_cut([], faults) == (0, [0, 0])


def test_connections_through_the_proxy_count_for_the_server_behind_it() -> None:
    run = Run(tag="t")

    class Proxies:
        def url(self, original: str) -> str:
            for port, local in ((":5432/", ":40001/"), (":5672/", ":40002/"), (":6379/", ":40003/")):
                original = original.replace(port, local)
            return original

    relay_run = proxied(run, Proxies())
    assert relay_run.tag == run.tag and relay_run.table == run.table
    assert service_ports(run) == {"amqp": 5672, "redis": 6379, "db": 5432}
    assert service_ports(relay_run) == {"amqp": 40002, "redis": 40003, "db": 40001}
    conns = [(50001, 40001), (50002, 40001), (50003, 40003), (50004, 5432), (50005, 40002)]
    assert by_peer(conns, service_ports(relay_run)) == {"db": 2, "amqp": 1, "redis": 1}
    assert by_peer(conns, {"amqp": 40002, "redis": 40003}) == {"db": 0, "amqp": 1, "redis": 1}
    assert list(fault_urls(run)) == ["database", "RabbitMQ", "Redis"]
    assert list(fault_urls(Run(tag="t", engine="sqlite"))) == ["RabbitMQ", "Redis"]


def test_the_missing_events_by_aggregate_most_first() -> None:
    events = [{"aggregate": "a", "at_s": 5.0, "ms": None}, {"aggregate": "b", "at_s": 3.0, "ms": None},
              {"aggregate": "b", "at_s": 4.0, "ms": None}, {"aggregate": "c", "at_s": 1.0, "ms": 10.0},
              {"aggregate": "d", "at_s": 2.0, "ms": None}]
    assert missing_by_aggregate(events) == [{"aggregate": "b", "missing": 2, "first_at": 3.0},
                                            {"aggregate": "d", "missing": 1, "first_at": 2.0},
                                            {"aggregate": "a", "missing": 1, "first_at": 5.0}]
    assert missing_by_aggregate(events, top=1)[1] == {"aggregate": "2 more", "missing": 2, "first_at": 2.0}
    assert missing_by_aggregate([]) == []


@pytest.mark.parametrize("runner", ["celery", "dramatiq"])
def test_with_faults_the_writers_wake_the_namespace_and_channel_the_relay_listens_on(runner: str) -> None:
    """Found in a soak run: with --faults the relay's URLs go through the proxy and the writers'
    did not, so the writers' namespace (the database's host:port in it) and wake channel (the
    Redis URL's) were ones no worker listened on, and no wake-up crossed a cut."""
    from outbox.core.config import load_settings
    from outbox.core.names import wake_channel

    class Proxies:
        def url(self, url: str) -> str:
            return url.replace(":5432/", ":15432/").replace(":6379/", ":16379/").replace(":5672/", ":15672/")

    run = Run(engine="postgresql")
    relay_run = proxied(run, Proxies())
    writer, relay = load_settings(environ=wake_env(relay_run, runner)), load_settings(environ=relay_run.outbox_env())
    assert writer.outbox_namespace == relay.outbox_namespace
    assert wake_channel(writer.broker_url, "", writer.outbox_namespace) == wake_channel(
        relay.broker_url, "", relay.outbox_namespace)
    assert load_settings(environ=run.outbox_env()).outbox_namespace != relay.outbox_namespace  # what went wrong
