"""The adaptive stopping rule on synthetic step-time streams, and across gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench_lib.measure import timing
from bench_lib.measure.timing import MIN_STEPS_FOR_CI, AdaptiveStop, collective_stop, time_steps
from tests.dist_harness import run_ranks


def _steps_until_stop(rule: AdaptiveStop, stream, cap: int) -> int:
    times: list[float] = []
    for t in stream[:cap]:
        times.append(float(t))
        if rule(times):
            break
    return len(times)


def test_constant_stream_stops_on_the_ci_target_as_soon_as_allowed():
    rule = AdaptiveStop(0.02, max_time_s=1e9)
    assert _steps_until_stop(rule, [0.1] * 100, cap=100) == MIN_STEPS_FOR_CI
    assert rule.reason == "ci_target"


def test_quiet_stream_stops_sooner_than_noisy_one():
    rng = np.random.default_rng(1)
    quiet = 0.1 * (1 + 0.01 * rng.standard_normal(200))
    noisy = 0.1 * (1 + 0.30 * rng.standard_normal(200))
    q_rule, n_rule = AdaptiveStop(0.02, 1e9), AdaptiveStop(0.02, 1e9)
    q_steps = _steps_until_stop(q_rule, quiet, cap=200)
    n_steps = _steps_until_stop(n_rule, noisy, cap=200)
    assert q_rule.reason == "ci_target" and q_steps < 20
    assert n_steps > 2 * q_steps


def test_bimodal_stream_hits_the_step_cap_and_says_so():
    rule = AdaptiveStop(0.02, max_time_s=1e9)
    steps = _steps_until_stop(rule, [1.0, 2.0] * 20, cap=40)
    assert steps == 40 and rule.reason is None
    assert rule.final_reason(steps, timed_steps=40) == "step_cap"


def test_time_cap_fires_when_the_budget_is_spent():
    rule = AdaptiveStop(0.02, max_time_s=5.0)
    steps = _steps_until_stop(rule, [1.0, 2.0] * 20, cap=40)
    assert steps == 4 and rule.final_reason(steps, 40) == "time_cap"  # 1+2+1+2 = 6 > 5


def test_zero_target_disables_the_ci_rule():
    rule = AdaptiveStop(0.0, max_time_s=1e9)
    assert _steps_until_stop(rule, [0.1] * 30, cap=30) == 30
    with pytest.raises(ValueError):
        AdaptiveStop(-1, 10)


def test_time_steps_reports_its_wall_clock_window():
    window: list[float] = []
    times = time_steps(lambda: None, [torch.device("cpu")], warmup_steps=1, timed_steps=50,
                       should_stop=AdaptiveStop(0.0, max_time_s=1e9, min_steps=3),
                       on_window=lambda t0, t1: window.extend((t0, t1)))
    assert len(times) == 50 and len(window) == 2 and window[0] <= window[1]


def _rank_stops(rank: int, world: int) -> tuple[int, str]:
    # Rank 1 is quiet, rank 0 noisy: both must judge the slowest rank's times and agree.
    rng = np.random.default_rng(rank)
    spread = 0.3 if rank == 0 else 0.001
    stream = 0.1 * (1 + spread * np.abs(rng.standard_normal(60)))
    rule = AdaptiveStop(0.02, max_time_s=1e9)
    stop = collective_stop(rule, torch.device("cpu"))
    times: list[float] = []
    for t in stream:
        times.append(float(t))
        if stop(times):
            break
    return len(times), rule.final_reason(len(times), 60)


def test_ranks_stop_after_the_same_step_with_the_same_reason():
    (steps0, reason0), (steps1, reason1) = run_ranks(_rank_stops, world_size=2, timeout_s=120)
    assert steps0 == steps1 and reason0 == reason1
    assert steps0 > MIN_STEPS_FOR_CI  # the quiet rank alone would have stopped at the minimum


def test_ci_is_checked_at_geometrically_spaced_counts(monkeypatch):
    checked: list[int] = []
    real = timing.Stats.of

    def spy(values):
        checked.append(len(values))
        return real(values)

    monkeypatch.setattr(timing.Stats, "of", spy)
    rule = AdaptiveStop(0.02, max_time_s=1e9, min_steps=8)
    _steps_until_stop(rule, [1.0, 2.0] * 60, cap=120)
    assert checked[:6] == [8, 9, 10, 11, 13, 15]
    assert len(checked) < 30  # instead of 113 checks, one per step


def test_profile_refuses_a_negative_target_or_interval():
    from bench_lib.sweep.profile import Measurement, Profile, UsageError

    with pytest.raises(UsageError, match="interval_target_pct must be >= 0"):
        Measurement(interval_target_pct=-1)
    with pytest.raises(UsageError, match="sample_interval_ms > 0"):
        Profile.from_dict({"sample_interval_ms": 0})
    m = Profile().measurement
    assert m.interval_target_pct == 2.0 and m.sample_interval_ms == 100.0
