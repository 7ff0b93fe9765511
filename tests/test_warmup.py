"""The warm-up rule on scripted step-time sequences, through the timing loop, and across
gloo ranks (every rank must run the same warm-up or their collectives mismatch)."""

from __future__ import annotations

import time as _time

import numpy as np
import pytest
import torch

from bench_lib.launch.protocol import CaseOutcome, reused_warmup
from bench_lib.measure import timing
from bench_lib.measure.timing import (
    WARMUP_EXTRA_MAX,
    WARMUP_TOLERANCE,
    WarmupRule,
    measure_steps,
    time_steps,
)
from tests.dist_harness import run_ranks

CPU = torch.device("cpu")
DDP_LIKE = [3.0, 2.0, 1.0, 1.01, 0.99, 1.0, 1.005, 0.995, 1.0, 1.01, 0.99, 1.0, 1.0]


def warmup_length(rule: WarmupRule, durations: list[float]) -> int:
    """How many of ``durations`` the rule runs as warm-up (asked as ``time_steps`` does)."""
    n = 0
    while n < len(durations) and (n < rule.min_steps or (n > 0 and not rule(durations[:n]))):
        n += 1
    return n


@pytest.mark.parametrize("minimum", [1, 2, 3])
def test_a_ddp_like_trend_is_warmed_through(minimum):
    # 3.0, 2.0 (bucket rebuild), 1.0: still falling; 1.01 is no new low: timing starts at 0.99.
    assert warmup_length(WarmupRule(minimum), DDP_LIKE) == 4


def test_a_flat_noisy_sequence_stops_at_the_minimum():
    flat = [1.0, 1.015, 0.99, 1.01, 0.985, 1.0, 1.012, 0.992] * 2  # +-1.5% jitter
    assert warmup_length(WarmupRule(3), flat) == 3
    assert warmup_length(WarmupRule(4), flat) == 4
    assert warmup_length(WarmupRule(1), flat) == 2  # a trend needs two steps to be seen


def test_a_sequence_that_never_settles_stops_at_the_cap():
    falling = [0.9**i for i in range(40)]  # 10% faster every step
    assert warmup_length(WarmupRule(1), falling) == 1 + WARMUP_EXTRA_MAX
    assert warmup_length(WarmupRule(3), falling) == 3 + WARMUP_EXTRA_MAX
    assert warmup_length(WarmupRule(3, extra_max=0), falling) == 3  # the fixed count


def test_zero_minimum_means_no_warmup_and_bad_rules_are_refused():
    assert warmup_length(WarmupRule(0), DDP_LIKE) == 0
    assert WarmupRule(0)([]) is True
    with pytest.raises(ValueError):
        WarmupRule(-1)
    with pytest.raises(ValueError):
        WarmupRule(1, tolerance=-0.1)


def test_noise_rarely_reads_as_a_trend_where_the_previous_step_would():
    # Flat sequences with 5% step-to-step noise, over twice the tolerance. Judged against
    # the fastest earlier step, warm-up mostly stops at its minimum and never runs to the
    # cap; judged against the previous step (within 2% of it), it mostly would not stop.
    rng = np.random.default_rng(0)
    lengths, previous_rule = [], []
    for _ in range(400):
        seq = np.exp(0.05 * rng.standard_normal(20)).tolist()
        lengths.append(warmup_length(WarmupRule(3), seq))
        previous_rule.append(abs(seq[2] / seq[1] - 1) <= WARMUP_TOLERANCE)
    lengths_arr = np.array(lengths)
    assert np.mean(lengths_arr == 3) >= 0.7, np.mean(lengths_arr == 3)
    assert np.mean(lengths_arr - 3) < 0.5 and lengths_arr.max() < 3 + WARMUP_EXTRA_MAX
    assert np.mean(previous_rule) < 0.4, np.mean(previous_rule)


class ScriptedClock:
    """Stands in for the ``time`` module in ``timing``: step k takes ``durations[k]`` seconds
    on ``perf_counter``; wall-clock and CPU time stay real."""

    def __init__(self, durations: list[float]) -> None:
        self._durations = iter(durations)
        self.now = 0.0
        self.steps = 0
        self.time = _time.time
        self.process_time = _time.process_time

    def perf_counter(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += next(self._durations)
        self.steps += 1


def test_measure_steps_warms_through_the_trend_and_records_the_count(monkeypatch):
    clock = ScriptedClock(DDP_LIKE)
    monkeypatch.setattr(timing, "time", clock)
    timed = measure_steps(clock.step, [CPU], warmup_steps=1, timed_steps=5, max_time_s=1e9,
                          interval_target_pct=0)
    assert timed.warmup_steps == 4 and clock.steps == 4 + 5
    assert timed.times_s == pytest.approx(DDP_LIKE[4:9])  # the trend is out of the window


def test_time_steps_keeps_a_fixed_count_without_a_rule_and_reports_warmup_times(monkeypatch):
    clock = ScriptedClock(DDP_LIKE)
    monkeypatch.setattr(timing, "time", clock)
    warm: list[float] = []
    times = time_steps(clock.step, [CPU], warmup_steps=1, timed_steps=2, warmup_times=warm)
    assert warm == pytest.approx([3.0]) and times == pytest.approx([2.0, 1.0])
    warm.clear()
    times = time_steps(clock.step, [CPU], warmup_steps=0, timed_steps=1,
                       warmup_done=WarmupRule(0), warmup_times=warm)
    assert warm == [] and times == pytest.approx([1.01])  # 0: no warm-up, rule or not


# Alone, rank 0 would warm up 3 steps ([3.0, 1.0] falls, then flat) and rank 1 two (its
# second step is no new low); judged on the slowest rank per step, [3.0, 2.0, 1.5, 1.0,
# 1.0] falls until its fifth step, so both ranks must run 5.
RANK_DURATIONS = {0: [3.0, 1.0, 1.0, 1.0, 1.0] + [1.0] * 10,
                  1: [1.0, 2.0, 1.5, 1.0, 1.0] + [1.0] * 10}


def _rank_warmup(rank: int, world: int) -> tuple[int, int, int]:
    alone = warmup_length(WarmupRule(2), RANK_DURATIONS[rank])
    clock = ScriptedClock(RANK_DURATIONS[rank])
    timing.time = clock  # type: ignore[assignment]  # this spawned process only
    timed = measure_steps(clock.step, [CPU], warmup_steps=2, timed_steps=3, max_time_s=1e9,
                          interval_target_pct=0, group_device=CPU)
    return alone, timed.warmup_steps, clock.steps


@pytest.mark.integration
def test_ranks_run_the_same_warmup_judged_on_the_slowest_rank():
    (alone0, warm0, steps0), (alone1, warm1, steps1) = run_ranks(_rank_warmup, world_size=2,
                                                                 timeout_s=120)
    assert (alone0, alone1) == (3, 2)
    assert warm0 == warm1 == 5
    assert steps0 == steps1 == 5 + 3


# A case's later launches: the first launch's warm-up as a fixed count ----------------------


def test_a_later_launch_reuses_the_first_launchs_warmup_less_the_steps_that_ended_it():
    first = CaseOutcome("ok", warmup_steps=warmup_length(WarmupRule(1), DDP_LIKE))
    assert first.warmup_steps == 4  # 3.0, 2.0, 1.0 fall; 1.01 is no new low: the end
    assert reused_warmup(first, 1) == 2  # 1.0 (the last new low) and 1.01 were settled
    # A later launch warmed up that way times from 1.0 on: no trend left in its steps.
    later = DDP_LIKE[2:]
    assert all(t >= min(later[:i]) * (1 - WARMUP_TOLERANCE) for i, t in
               enumerate(later) if i)
    cpu_like = [1.5, 1.0, 1.005, 0.998, 1.0]  # only the first step slow
    assert warmup_length(WarmupRule(1), cpu_like) == 3
    assert reused_warmup(CaseOutcome("ok", warmup_steps=3), 1) == 1  # the slow step alone
    assert reused_warmup(CaseOutcome("ok", warmup_steps=3), 2) == 2  # never under the minimum
    capped = CaseOutcome("ok", warmup_steps=2 + WARMUP_EXTRA_MAX)  # still falling at the cap
    assert reused_warmup(capped, 2) == 2 + WARMUP_EXTRA_MAX
    assert reused_warmup(CaseOutcome("ok", warmup_steps=0), 0) is None  # no warm-up asked
    assert reused_warmup(CaseOutcome("error", "boom"), 2) is None  # it never timed


def test_a_fixed_warmup_runs_exactly_its_count_even_where_steps_still_fall(monkeypatch):
    clock = ScriptedClock(DDP_LIKE)
    monkeypatch.setattr(timing, "time", clock)
    timed = measure_steps(clock.step, [CPU], warmup_steps=2, timed_steps=3, max_time_s=1e9,
                          interval_target_pct=0, warmup_rule=False)
    assert timed.warmup_steps == 2 and clock.steps == 2 + 3
    assert timed.times_s == pytest.approx(DDP_LIKE[2:5])
    assert timed.warmup_time_s == pytest.approx(3.0 + 2.0)


@pytest.mark.integration
def test_later_launches_of_a_sweep_run_the_reused_warmup(tmp_path, cpu_rig, forks):
    """Through the runner: launch 1 under the rule, launches 2 and 3 the reused count."""
    from bench_lib.results.store import RunWriter
    from bench_lib.run.case_launch import LaunchOptions
    from bench_lib.run.runner import SweepCallbacks, SweepOptions, run_sweep
    from bench_lib.sweep.cases import new_case
    from bench_lib.sweep.profile import Measurement

    m = Measurement(warmup_steps=1, timed_steps=2, max_time_s=30, case_timeout_s=120,
                    launches=3, interval_target_pct=0)
    case = new_case(cpu_rig, "single", "resnet-tiny", 32, 4, measurement=m)
    counts: list[int | None] = []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunWriter(run_dir) as writer:
        run_sweep([case], cpu_rig, writer, SweepOptions(LaunchOptions(server=forks)),
                  SweepCallbacks(on_launch_done=lambda i, c, r, o: counts.append(o.warmup_steps)))
    assert len(counts) == 3 and counts[0] is not None and counts[0] >= 2
    expected = reused_warmup(CaseOutcome("ok", warmup_steps=counts[0]), 1)
    assert counts[1:] == [expected, expected]
