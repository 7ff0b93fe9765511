"""The median's interval checked by its coverage, not its arithmetic; the lag-1
autocorrelation checked by what it recovers from series of known correlation.

Coverage: the share of many seeded synthetic samples of independent step times whose
interval holds the true median. Step times are skewed and heavy on the slow side, so the
samples are lognormal (median 1) and a shifted exponential (median 1 + 0.1 ln 2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench_lib.measure.stats import (
    MIN_SAMPLES_FOR_AUTOCORR,
    MIN_SAMPLES_FOR_BOOTSTRAP,
    MIN_SAMPLES_FOR_EXACT_CI,
    Stats,
    bootstrap_median_ci,
    lag1_autocorr,
    median_ci,
    order_statistic_median_ci,
)
from bench_lib.rig import Rig
from bench_lib.run.protocol import CaseOutcome
from bench_lib.run.rows import case_row
from bench_lib.sweep.cases import new_case

TRIALS = 400
DISTRIBUTIONS = {
    "lognormal": (lambda rng, n: np.exp(0.3 * rng.standard_normal(n)), 1.0),
    "shifted-exponential": (lambda rng, n: 1 + rng.exponential(0.1, n), 1 + 0.1 * math.log(2)),
}


def _coverage(interval, n: int, dist: str, seed: int = 0) -> float:
    draw, true_median = DISTRIBUTIONS[dist]
    rng = np.random.default_rng(seed)
    hits = 0
    for trial in range(TRIALS):
        low, high = interval(draw(rng, n).tolist(), trial)
        hits += low <= true_median <= high
    return hits / TRIALS


def _exact(values, _trial):
    result = order_statistic_median_ci(values)
    assert result is not None
    return result[:2]


def _bootstrap(values, trial):
    return bootstrap_median_ci(values, seed=trial)


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("n", [6, 7, 10])
def test_order_statistic_interval_covers_the_median_as_guaranteed(n, dist):
    achieved = order_statistic_median_ci(list(range(n)))[2]
    assert achieved >= 0.95
    coverage = _coverage(_exact, n, dist, seed=n)
    # At least its guarantee (with 400 trials' sampling error: 3 sd), and not the
    # uselessly wide interval a 99.9% one would be.
    sd = math.sqrt(achieved * (1 - achieved) / TRIALS)
    assert coverage >= 0.95 - 0.005, coverage
    assert abs(coverage - achieved) <= 3 * sd, (coverage, achieved)
    assert coverage <= 0.995, coverage


def test_order_statistic_confidences_are_the_binomial_ones():
    # [min, max]: 1 - 2/2^n; n = 10 uses [x_(2), x_(9)]: 1 - 2 * 11/1024.
    assert order_statistic_median_ci([3.0, 1, 2, 6, 5, 4]) == (1.0, 6.0, 1 - 2 / 64)
    assert order_statistic_median_ci(list(range(7)))[2] == 1 - 2 / 128
    assert order_statistic_median_ci(list(range(10)))[:2] == (1.0, 8.0)
    assert order_statistic_median_ci(list(range(10)))[2] == pytest.approx(1 - 22 / 1024)
    assert order_statistic_median_ci(list(range(5))) is None  # [min, max] is 93.75%
    assert MIN_SAMPLES_FOR_EXACT_CI == 6


def test_small_sample_bootstrap_undercovers_which_is_why_it_is_not_used():
    # At n = 3 the bootstrap's "95%" interval is [min, max]: it covers 1 - 2/8 = 75%.
    coverage = _coverage(_bootstrap, 3, "lognormal")
    assert 0.70 <= coverage <= 0.80, coverage
    rng = np.random.default_rng(5)
    x = rng.lognormal(size=3).tolist()
    assert bootstrap_median_ci(x) == (min(x), max(x))
    # At 6 and 7 steps it is narrower than the exact interval and falls short of 95%, where
    # the order statistics keep their guarantee on the same samples.
    for n in (6, 7):
        boot = _coverage(_bootstrap, n, "lognormal")
        exact = _coverage(_exact, n, "lognormal")
        assert boot < 0.95 <= exact, (n, boot, exact)


def test_stats_and_rows_say_which_interval_they_give_or_why_none():
    three = Stats.of([1.0, 1.2, 1.1])
    assert math.isnan(three.ci_low) and math.isnan(three.ci_high)
    assert three.ci_method == "" and three.ci_half_width_rel == math.inf
    assert three.ci_note == "3 steps: too few for a 95% interval (needs 6)"
    seven = Stats.of([1.0, 1.3, 1.1, 0.9, 1.2, 1.05, 1.15])
    assert (seven.ci_low, seven.ci_high) == (0.9, 1.3)
    assert seven.ci_method == "order statistics (98.4%)" and seven.ci_note == ""
    assert Stats.of([1.0] * 6).ci_method == "order statistics (96.8%)"  # floored: 96.875%
    many = Stats.of(list(np.linspace(1, 2, MIN_SAMPLES_FOR_BOOTSTRAP)))
    assert many.ci_method == "bootstrap"
    assert (many.ci_low, many.ci_high) == bootstrap_median_ci(list(np.linspace(1, 2, 8)))

    rig = Rig("cpu", 2, 1, (0, 1))
    case = new_case(rig, "single", "resnet-tiny", 32, 4)
    row = case_row(case, rig, CaseOutcome("ok", step_times_s=[0.1, 0.12, 0.11],
                                          stop_reason="time_cap", warmup_steps=4,
                                          peak_mem_mib={"0": 100.0}))
    assert row["step_time_s_ci_low"] is None and row["step_time_s_ci_high"] is None
    assert row["step_time_ci_method"] == ""
    assert row["step_time_ci_note"].startswith("3 steps: too few")
    assert row["step_time_lag1_autocorr"] is None  # under 10 steps
    assert row["warmup_steps"] == 4  # the warm-up run, not the profile's minimum
    steps = [0.1, 0.12, 0.11, 0.1, 0.13, 0.1, 0.12, 0.11, 0.1, 0.12]
    row = case_row(case, rig, CaseOutcome("ok", step_times_s=steps, stop_reason="step_cap",
                                          warmup_steps=2, peak_mem_mib={"0": 100.0}))
    assert row["step_time_ci_method"] == "bootstrap" and row["step_time_ci_note"] == ""
    assert row["step_time_lag1_autocorr"] == pytest.approx(lag1_autocorr(steps))
    assert case_row(case, rig, CaseOutcome("error", "boom"))["warmup_steps"] == ""


def _ar1(phi: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(n)
    x = np.empty(n)
    x[0] = noise[0] / math.sqrt(1 - phi**2)  # start in the stationary distribution
    for t in range(1, n):
        x[t] = phi * x[t - 1] + noise[t]
    return 1.0 + 0.02 * x  # step times around 1 s, 2% spread


@pytest.mark.parametrize("phi", [0.3, 0.6])
def test_lag1_autocorrelation_recovers_an_ar1_coefficient(phi):
    # Standard error about sqrt((1 - phi^2) / n): 0.012 at n = 5000.
    for seed in range(3):
        assert lag1_autocorr(_ar1(phi, 5000, seed)) == pytest.approx(phi, abs=0.05)


def test_lag1_autocorrelation_of_independent_steps_is_near_zero_and_needs_enough_steps():
    rng = np.random.default_rng(2)
    assert abs(lag1_autocorr(rng.lognormal(0, 0.1, 5000))) < 0.05
    assert math.isnan(lag1_autocorr([1.0, 2.0] * 4 + [1.0]))  # 9 steps: too few
    assert lag1_autocorr([1.0, 2.0] * 5) == pytest.approx(-0.9)  # alternating, 10 steps
    assert math.isnan(lag1_autocorr([1.0] * 20))  # no variance: undefined
    assert MIN_SAMPLES_FOR_AUTOCORR == 10
    assert median_ci([1.0])[3] == "1 step: too few for a 95% interval (needs 6)"
