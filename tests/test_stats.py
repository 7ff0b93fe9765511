"""Stats against hand-computed numbers."""

import math

import pytest

from bench_lib.measure.stats import Stats, bootstrap_median_ci, percentile


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
