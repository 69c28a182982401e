"""``bench.soak``'s pure part: the least-squares slope, the floor, and the verdict on a series of
samples (GROWS, STEP, flat), on made-up series."""

from __future__ import annotations

import math
import os

import pytest

from bench.soak import MEASURES, Measure, analyse, assess, floors, slope, verdict_line

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

    kinds = rss_by_mapping(os.getpid())
    assert kinds is not None and set(kinds) == {"heap", "arenas", "anon", "file"}
    assert kinds["file"] > 0  # the interpreter's own code
    assert abs(sum(kinds.values()) - (rss_kb(os.getpid()) or 0)) < 2048  # two reads, moments apart
