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


@pytest.mark.integration
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


# A minimum timed duration (#28 item 7) -----------------------------------------------------
# GPU steps are stable: the CI target ends a launch after 8 steps, and a fast case's timed
# window (8 x 62.5 ms here, a binary fraction so that sums are exact) is under the
# sampler's 1 s, which empties utilisation and energy.


class FastClock:
    """Stands in for the ``time`` module in ``timing``: every step takes ``step_s`` on the
    monotonic and the wall clock alike (so the timed window is the steps' sum)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.steps = 1024.0, step_s, 0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def process_time(self) -> float:
        return 0.0

    def step(self) -> None:
        self.now += self.step_s
        self.steps += 1


def _gpu_samples(t0: float, t1: float, interval_s: float = 0.1) -> list[dict]:
    """What the runner's NVML sampler reads of one busy GPU over [t0, t1]: 90% busy, 300 W."""
    from bench_lib.results.schema import SAMPLE_METRIC_NAMES

    n = int((t1 - t0) / interval_s) + 1
    return [{"time_unix_s": t0 + i * interval_s, "device": "0",
             **dict.fromkeys(SAMPLE_METRIC_NAMES), "util_gpu_pct": 90.0,
             "energy_j": 300.0 * i * interval_s} for i in range(n)]


def _measure(clock: FastClock, m, monkeypatch) -> timing.TimedSteps:
    """One launch timed as ``launch.worker`` times it, under ``m`` (a case's measurement)."""
    monkeypatch.setattr(timing, "time", clock)
    return timing.measure_steps(clock.step, [torch.device("cpu")], warmup_steps=1,
                                timed_steps=m.timed_steps, max_time_s=m.max_time_s,
                                interval_target_pct=m.interval_target_pct,
                                min_time_s=m.min_time_s or 0.0, warmup_rule=False)


def test_a_fast_gpu_case_times_until_the_minimum_and_fills_the_sampler_columns(monkeypatch):
    from bench_lib.rig import Rig
    from bench_lib.rows.sampler_columns import window_columns
    from bench_lib.sweep.cases import new_case
    from bench_lib.sweep.profile import MIN_TIME_S_BY_RIG, Measurement

    m = new_case(Rig("cuda", 1), "single", "resnet50", 128, 120,
                 measurement=Measurement(timed_steps=20, max_time_s=60)).measurement
    assert m.min_time_s == MIN_TIME_S_BY_RIG["cuda"] == 3.0  # the rig's, resolved
    clock = FastClock(0.0625)
    timed = _measure(clock, m, monkeypatch)
    # The CI target was met at step 8 (0.5 s); timing went on to the minimum, past the
    # timed_steps cap (20), and stopped at the first step that reached it.
    assert len(timed.times_s) == 48 and sum(timed.times_s) == 3.0
    assert timed.stop_reason == "min_time"
    t0, t1 = timed.window_unix_s
    assert t1 - t0 == pytest.approx(3.0)
    cols = window_columns(_gpu_samples(t0 - 1, t1 + 1), [(t0, t1)], images=48 * 120,
                          idle_w={"0": 50.0})
    assert cols["util_pct_mean"] == pytest.approx(90.0)
    assert cols["power_w_mean"] == pytest.approx(300.0)
    assert cols["energy_j_per_img"] == pytest.approx(300.0 * 3.0 / (48 * 120))
    assert cols["energy_j_per_img_net"] == pytest.approx(250.0 * 3.0 / (48 * 120))
    assert cols["sampler_note"] == ""


def test_without_a_minimum_the_fast_case_stops_at_the_ci_target_and_its_columns_are_empty(
        monkeypatch):
    from bench_lib.rig import Rig
    from bench_lib.rows.sampler_columns import window_columns
    from bench_lib.sweep.cases import new_case
    from bench_lib.sweep.profile import Measurement
    from bench_lib.topology import available_cores

    cpu = new_case(Rig("cpu", 1, 1, tuple(available_cores()[:1])), "single", "resnet50", 128, 120,
                   measurement=Measurement(timed_steps=20, max_time_s=60)).measurement
    assert cpu.min_time_s == 0.0  # a cpu rig's default: its steps are long
    off = Measurement(timed_steps=20, max_time_s=60, min_time_s=0)  # the user's choice
    assert new_case(Rig("cuda", 1), "single", "resnet50", 128, 120,
                    measurement=off).measurement.min_time_s == 0.0
    timed = _measure(FastClock(0.0625), off, monkeypatch)
    assert len(timed.times_s) == MIN_STEPS_FOR_CI and timed.stop_reason == "ci_target"
    t0, t1 = timed.window_unix_s
    cols = window_columns(_gpu_samples(t0 - 1, t1 + 1), [(t0, t1)], images=8 * 120)
    assert cols["util_pct_mean"] is None and "under 1 s" in cols["sampler_note"]


def test_the_minimum_outlasts_the_step_cap_but_never_the_time_cap():
    # Noisy steps (no CI): the step cap (5) is held back until 1 s of steps is timed.
    rule = AdaptiveStop(0.02, max_time_s=10.0, min_time_s=1.0, max_steps=5)
    assert _steps_until_stop(rule, [0.1, 0.3] * 20, cap=40) == 6  # 0.1+0.3+... = 1.2 s
    assert rule.reason == "min_time"
    # Slow steps reach the minimum before the step cap: the step cap ends it, as before.
    rule = AdaptiveStop(0.0, max_time_s=100.0, min_time_s=1.0, max_steps=5)
    assert _steps_until_stop(rule, [1.0, 2.0] * 10, cap=20) == 5 and rule.reason == "step_cap"
    # max_time_s stays the hard cap: a minimum over it is refused, an equal one stops there.
    with pytest.raises(ValueError, match="minimum"):
        AdaptiveStop(0.02, max_time_s=2.0, min_time_s=3.0)
    rule = AdaptiveStop(0.0, max_time_s=2.0, min_time_s=2.0, max_steps=1000)
    assert _steps_until_stop(rule, [0.5] * 10, cap=10) == 5 and rule.reason == "time_cap"


def test_the_minimum_is_checked_and_capped_by_max_time_s():
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import new_case
    from bench_lib.sweep.profile import Measurement, Profile, UsageError

    with pytest.raises(UsageError, match="min_time_s"):
        Measurement(min_time_s=-1)
    with pytest.raises(UsageError, match="min_time_s"):
        Profile.from_dict({"min_time_s": 5, "max_time_s": 4})
    # The rig's default never exceeds the profile's hard cap (ddp-knobs' 4 s, tune's races).
    short = Measurement(max_time_s=2.0)
    assert new_case(Rig("cuda", 1), "single", "resnet50", 128, 120,
                    measurement=short).measurement.min_time_s == 2.0


def test_the_worker_times_a_case_under_its_minimum(monkeypatch, tmp_path):
    from bench_lib.launch import worker
    from bench_lib.launch.protocol import CaseSpec
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import new_case
    from bench_lib.sweep.profile import Measurement
    from bench_lib.topology import available_cores

    class Timed(Exception):
        pass

    seen: dict = {}

    def spy(step, devices, **kwargs):
        seen.update(kwargs)
        raise Timed

    monkeypatch.setattr(worker, "measure_steps", spy)
    monkeypatch.setattr(worker, "pin_worker", lambda rig, index: None)  # the test's process
    monkeypatch.setattr(worker, "set_math_mode", lambda *mode: {})
    rig = Rig("cpu", 1, 1, tuple(available_cores()[:1]))
    case = new_case(rig, "single", "toy", 0, 8,
                    measurement=Measurement(min_time_s=1.5, max_time_s=5.0))
    with pytest.raises(Timed):
        worker.run_rank(CaseSpec(case, rig, trace=False), worker.RankPlace(0, 0), tmp_path)
    assert seen["min_time_s"] == 1.5 and seen["timed_steps"] == case.measurement.timed_steps
