"""Summary statistics of per-step times: a tiny pure object.

The median's 95% interval, by sample size n (``median_ci``):

- n >= ``MIN_SAMPLES_FOR_BOOTSTRAP`` (8): percentile bootstrap (``bootstrap_median_ci``);
- 6 <= n < 8: the exact distribution-free order-statistic interval [x_(k), x_(n-k+1)]
  (``order_statistic_median_ci``), whose confidence is a binomial sum, >= 95% for any
  continuous distribution. The bootstrap's resampled medians of so few values take a
  handful of values: at n = 3 to 5 its "95%" interval is [min, max], which covers the
  median with probability 1 - 2 / 2^n (75% at n = 3), and at 6 and 7 it is narrower still
  and under-covers (tests/test_ci_coverage.py);
- n < 6: none (no pair of order statistics reaches 95%), with the reason in ``ci_note``.

Every interval here covers step-to-step noise within one launch and assumes independent
steps: a case's launch-to-launch spread and correlated consecutive steps
(``lag1_autocorr``) are not in it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CI_CONFIDENCE = 0.95
MIN_SAMPLES_FOR_BOOTSTRAP = 8
"""Below this many values the percentile bootstrap of the median is unreliable: its
resampled medians take a few distinct values (at n = 3..5 its 95% interval is [min, max],
covering 75%, 87.5%, 93.75%)."""
MIN_SAMPLES_FOR_EXACT_CI = next(n for n in range(1, 64) if 1 - 2 / 2**n >= CI_CONFIDENCE)
"""Fewer values have no 95% interval of the median at all: [min, max] of n independent
values covers it with probability 1 - 2 / 2^n (6 values: 96.9%; 5: 93.75%)."""
MIN_SAMPLES_FOR_AUTOCORR = 10
"""Fewer values leave the lag-1 autocorrelation empty: under independence its standard
error is about 1/sqrt(n) (0.32 at n = 10) and its bias about -1/n."""
BOOTSTRAP_METHOD = "bootstrap"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def bootstrap_median_ci(
    values: Sequence[float], confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median (deterministic seed)."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    resamples = rng.choice(data, size=(BOOTSTRAP_RESAMPLES, data.size), replace=True)
    medians = np.median(resamples, axis=1)
    alpha = (1 - confidence) / 2
    return float(np.quantile(medians, alpha)), float(np.quantile(medians, 1 - alpha))


def order_statistic_median_ci(
    values: Sequence[float], confidence: float = CI_CONFIDENCE
) -> tuple[float, float, float] | None:
    """The exact distribution-free interval of the median: (low, high, achieved confidence).

    For n independent values of a continuous distribution, the number below the true
    median is Binomial(n, 1/2), so [x_(k), x_(n-k+1)] (1-based order statistics) covers it
    with probability 1 - 2 P(B <= k - 1), whatever the distribution. ``k`` is the largest
    index whose confidence is still >= ``confidence``: the narrowest such pair. None when
    even [min, max] falls short (n < 6 for 95%: 1 - 2 / 2^5 = 93.75%).
    """
    data = np.sort(np.asarray(values, dtype=float))
    n = int(data.size)
    if n == 0:
        return None
    best: tuple[float, float, float] | None = None
    below = 0  # 2^n P(B <= k - 1), B ~ Binomial(n, 1/2): integers, so exact
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1)
        achieved = 1 - 2 * below / 2**n
        if achieved < confidence:
            break
        best = (float(data[k - 1]), float(data[n - k]), achieved)
    return best


def median_ci(values: Sequence[float]) -> tuple[float, float, str, str]:
    """The median's 95% interval as (low, high, method, note); NaN ends when there is none.

    ``method``: ``bootstrap`` (n >= ``MIN_SAMPLES_FOR_BOOTSTRAP``), ``order statistics
    (98.4%)`` (the achieved confidence), or empty; ``note`` says why it is empty.
    """
    n = len(values)
    if n >= MIN_SAMPLES_FOR_BOOTSTRAP:
        low, high = bootstrap_median_ci(values, CI_CONFIDENCE)
        return low, high, BOOTSTRAP_METHOD, ""
    exact = order_statistic_median_ci(values, CI_CONFIDENCE)
    if exact is None:
        nan = float("nan")
        return nan, nan, "", (f"{n} step{'s' if n != 1 else ''}: too few for a "
                              f"{CI_CONFIDENCE:.0%} interval (needs {MIN_SAMPLES_FOR_EXACT_CI})")
    low, high, achieved = exact
    return low, high, f"order statistics ({math.floor(achieved * 1000) / 10:.1f}%)", ""


def lag1_autocorr(values: Sequence[float]) -> float:
    """Lag-1 autocorrelation of a series in its order: sum of (x_t - m)(x_t+1 - m) over the
    sum of (x_t - m)^2 (the standard, ACF estimator; m the mean). NaN for fewer than
    ``MIN_SAMPLES_FOR_AUTOCORR`` values or a constant series."""
    data = np.asarray(values, dtype=float)
    if data.size < MIN_SAMPLES_FOR_AUTOCORR:
        return float("nan")
    dev = data - data.mean()
    denom = float(np.dot(dev, dev))
    if denom == 0:
        return float("nan")
    return float(np.dot(dev[:-1], dev[1:]) / denom)


@dataclass(frozen=True)
class Stats:
    """Summary of a sample of step times, in seconds."""

    n: int
    median: float
    mean: float
    stdev: float
    p10: float
    p90: float
    iqr: float
    ci_low: float
    """The median's 95% interval (``median_ci``), low end; NaN when there is none."""
    ci_high: float
    ci_method: str = ""
    """``bootstrap``, ``order statistics (NN.N%)`` or empty (no interval)."""
    ci_note: str = ""
    """Why there is no interval (too few values)."""
    lag1_autocorr: float = float("nan")
    """Lag-1 autocorrelation of the values in their order (NaN: too few, or constant)."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Summarise ``values`` (at least one), in their order."""
        if len(values) == 0:
            raise ValueError("cannot summarise an empty sample")
        ci_low, ci_high, ci_method, ci_note = median_ci(values)
        return cls(
            n=len(values),
            median=statistics.median(values),
            mean=statistics.fmean(values),
            stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
            p10=percentile(values, 10),
            p90=percentile(values, 90),
            iqr=percentile(values, 75) - percentile(values, 25),
            ci_low=ci_low,
            ci_high=ci_high,
            ci_method=ci_method,
            ci_note=ci_note,
            lag1_autocorr=lag1_autocorr(values),
        )

    @property
    def ci_half_width_rel(self) -> float:
        """Half-width of the median's confidence interval relative to the median."""
        if math.isnan(self.ci_low) or self.median == 0:
            return float("inf")
        return (self.ci_high - self.ci_low) / 2 / self.median

    def as_dict(self, prefix: str = "") -> dict[str, float | str]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}
