"""Stats and the across-launch summaries against hand-computed numbers."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from bench_lib.analysis.stats import (
    MIN_LAUNCHES_FOR_CI,
    Stats,
    bootstrap_median_ci,
    geometric_mean,
    lag1_autocorr,
    lag1_autocorr_within,
    launch_interval,
    paired_ratio_interval,
    percentile,
    t_quantile,
    welch_log_change,
)


def test_stats_of_hand_computed_sample():
    s = Stats.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.n == 5
    assert s.median == 3.0
    assert s.mean == 4.0
    # sample variance: (9 + 4 + 1 + 0 + 36) / 4 = 12.5
    assert s.stdev == pytest.approx(math.sqrt(12.5))
    # numpy linear percentiles: p10 at rank 0.4 -> 1.4; p90 at rank 3.6 -> 4 + 0.6 * 6 = 7.6
    assert s.p10 == pytest.approx(1.4)
    assert s.p90 == pytest.approx(7.6)
    assert s.iqr == pytest.approx(4.0 - 2.0)
    # 5 values: no pair of order statistics is a 95% interval (tests/test_ci_coverage.py)
    assert math.isnan(s.ci_low) and s.ci_note.startswith("5 steps: too few")
    assert s.as_dict("t_")["t_median"] == 3.0


def test_constant_sample_has_zero_spread_and_tight_ci():
    s = Stats.of([0.5] * 10)
    assert (s.stdev, s.iqr, s.ci_low, s.ci_high) == (0.0, 0.0, 0.5, 0.5)
    assert s.ci_half_width_rel == 0.0


def test_single_value_and_empty_sample():
    s = Stats.of([2.0])
    assert s.median == 2.0 and s.stdev == 0.0 and math.isnan(s.ci_low)
    assert s.ci_half_width_rel == math.inf
    with pytest.raises(ValueError, match="empty"):
        Stats.of([])


def test_percentile_and_bootstrap_are_deterministic():
    assert percentile([0, 10], 25) == 2.5
    assert bootstrap_median_ci([1, 2, 3, 4]) == bootstrap_median_ci([1, 2, 3, 4])


def test_one_launch_has_no_interval_and_says_why():
    one = launch_interval([0.25])
    assert one.point == pytest.approx(0.25) and one.n == 1 and one.method == ""
    assert math.isnan(one.low) and math.isnan(one.high)
    assert one.note == "launches measured: 1; an interval across them needs 2 (--launches)"
    assert one.half_width_rel == math.inf and not one.covers(0.25)
    assert launch_interval([2.0], "rounds").note.startswith("rounds measured: 1;")
    assert MIN_LAUNCHES_FOR_CI == 2


def test_launch_interval_by_hand():
    # logs -0.1, 0, 0.1: mean 0, sd 0.1, t(0.975, 2) = 4.302653: half 0.1 * 4.302653 / sqrt 3
    li = launch_interval([math.exp(-0.1), 1.0, math.exp(0.1)])
    half = 0.1 * 4.302652729749464 / math.sqrt(3)
    assert li.point == pytest.approx(1.0)
    assert (li.low, li.high) == pytest.approx((math.exp(-half), math.exp(half)))
    assert li.method == "t over 3 launches" and li.note == "" and li.n == 3
    assert li.half_width_rel == pytest.approx(math.sinh(half))
    assert li.covers(1.0) and not li.covers(2.0)
    assert t_quantile(0.95, 2) == pytest.approx(4.302652729749464)
    # The geometric mean, and an interval symmetric in ratios: scaling scales it.
    scaled = launch_interval([3 * math.exp(-0.1), 3.0, 3 * math.exp(0.1)])
    assert (scaled.low, scaled.point, scaled.high) == pytest.approx(
        (3 * li.low, 3 * li.point, 3 * li.high))
    assert launch_interval([0.5, 0.5, 0.5]).low == launch_interval([0.5] * 3).high == 0.5


@pytest.mark.parametrize("bad", [[1.0, 0.0], [1.0, -0.5], [], [1.0, math.nan], [math.inf]])
def test_launch_figures_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="positive and finite"):
        launch_interval(bad)


def test_paired_ratio_interval():
    same = [0.4, 0.5, 0.45]
    r = paired_ratio_interval(same, same)
    assert (r.low, r.point, r.high) == (1.0, 1.0, 1.0) and r.method == "t over 3 rounds"
    # A drift shared by a round's two launches cancels: 2x in every round is exactly 2.
    r = paired_ratio_interval([0.4, 0.8, 0.6], [0.2, 0.4, 0.3])
    assert (r.low, r.point, r.high) == pytest.approx((2.0, 2.0, 2.0))
    # The ratios' own interval: numerator over denominator, round by round.
    r = paired_ratio_interval([1.0, 1.1, 0.9], [0.5, 0.5, 0.5])
    assert r == launch_interval([2.0, 2.2, 1.8], "rounds")
    one = paired_ratio_interval([1.0], [0.5])
    assert one.point == 2.0 and math.isnan(one.low) and one.note.startswith("rounds measured: 1")
    with pytest.raises(ValueError, match="unpaired"):
        paired_ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio_interval([1.0, -1.0], [1.0, 1.0])


def test_welch_log_change_by_hand():
    # The same value on both sides of 3: no change, no spread, a zero-width interval.
    assert welch_log_change([2.0] * 3, [2.0] * 3) == (0.0, 0.0, 0.0)
    point, low, high = welch_log_change([1.0], [1.1, 1.2])
    assert point == pytest.approx(math.sqrt(1.1 * 1.2) - 1) and math.isnan(low)
    assert math.isnan(welch_log_change([1.0, 1.1], [1.2])[2])
    # Against scipy's Welch t test on the logs (its interval of the difference of means).
    base, cand = [1.0, 1.05, 0.97], [1.2, 1.1, 1.18, 1.25]
    point, low, high = welch_log_change(base, cand)
    lb, lc = np.log(base), np.log(cand)
    ref = scipy_stats.ttest_ind(lc, lb, equal_var=False).confidence_interval(0.95)
    assert point == pytest.approx(math.expm1(lc.mean() - lb.mean()))
    assert (low, high) == pytest.approx((math.expm1(ref.low), math.expm1(ref.high)))
    assert 0 < low < point < high  # a clear +15%
    # Swapping the runs mirrors the change in log: 1 + x becomes 1 / (1 + x).
    back = welch_log_change(cand, base)
    assert back == pytest.approx((1 / (1 + point) - 1, 1 / (1 + high) - 1, 1 / (1 + low) - 1))


def test_lag1_autocorr_within_pools_launches():
    # Under 10 values in all: none, however they are split; one series: the plain estimator.
    assert math.isnan(lag1_autocorr_within([[1.0, 2.0, 1.5], [1.0, 2.0, 1.2], [3.0, 1.0, 2.0]]))
    assert math.isnan(lag1_autocorr_within([[], [1.0] * 5]))
    assert math.isnan(lag1_autocorr_within([[1.0] * 6, [2.0] * 6]))  # no spread in a launch
    alternating = [1.0, 2.0] * 5
    assert lag1_autocorr_within([alternating]) == pytest.approx(lag1_autocorr(alternating))
    # Each launch about its own mean, neighbours within a launch only: a launch offset is
    # no autocorrelation (concatenated, the jump between launches would read as one).
    a, b = [1.0, 2.0] * 3, [11.0, 12.0] * 3
    # Deviations +-0.5 about each launch's own mean: 10 neighbour products of -0.25 over
    # 12 squares of 0.25.
    assert lag1_autocorr_within([a, b]) == pytest.approx(-2.5 / 3)
    assert lag1_autocorr_within([a, b]) == pytest.approx(lag1_autocorr_within([a, a]))
    assert lag1_autocorr(a + b) > 0.5
    # Three launches of an AR(1) recover its coefficient (standard error ~0.015 at 3 x 1500).
    rng = np.random.default_rng(3)
    for phi in (0.0, 0.3, 0.6):
        launches = []
        for offset in (0.0, 0.1, -0.05):  # launches at different levels
            noise = rng.standard_normal(1500)
            x = np.empty(1500)
            x[0] = noise[0] / math.sqrt(1 - phi**2)
            for t in range(1, 1500):
                x[t] = phi * x[t - 1] + noise[t]
            launches.append((1.0 + offset + 0.02 * x).tolist())
        assert lag1_autocorr_within(launches) == pytest.approx(phi, abs=0.05)
        assert lag1_autocorr(sum(launches, [])) > phi + 0.3  # the offsets, pooled naively


def test_geometric_mean_is_a_hand_count_and_refuses_non_positive_figures():
    assert geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([0.5, 2.0, 8.0]) == pytest.approx(2.0)
    assert launch_interval([0.5, 2.0, 8.0]).point == geometric_mean([0.5, 2.0, 8.0])
    for bad in ([], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="positive and finite"):
            geometric_mean(bad)
