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

Those intervals cover step-to-step noise within one launch and assume independent steps:
a case's launch-to-launch spread and correlated consecutive steps (``lag1_autocorr``) are
not in them. The adaptive stop uses them inside a launch; the figures a run reports come
from replicated launches instead (``LaunchInterval``):

- a case's step time: per launch the median of its timed steps; across L launches the
  geometric mean of those medians, with the Student t interval (L - 1 degrees of freedom)
  of the mean of their logarithms, mapped back (``launch_interval``). Each launch median
  carries its launch's whole within-launch noise, correlated or not, and its launch's own
  offset (allocation, placement, drift), so treating launches as the independent units
  covers both without modelling either; the t interval is the one whose coverage holds at
  3 units, where a bootstrap over 3 values cannot (it has at most 10 distinct resamples).
- a speedup over ``single``: per round r (every case of a workload is launched once per
  round) the ratio single_r / case_r, and the same t interval over the rounds' log ratios
  (``paired_ratio_interval``): pairing by round cancels drift that hits both alike.
- below 2 launches there is no interval, and the note says why.

tests/test_ci_coverage.py checks that the 95% intervals cover the true value in 90-98% of
400 seeded synthetic sweeps: independent and AR(1) steps (0.3, 0.6), launch offsets, with
the adaptive stop deciding each launch's length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

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


def lag1_autocorr_within(series: Sequence[Sequence[float]]) -> float:
    """The lag-1 autocorrelation of several series (a case's launches) pooled: each
    series' deviations from its own mean, products of neighbours within a series only,
    over the summed squares. NaN under ``MIN_SAMPLES_FOR_AUTOCORR`` values in all or a
    constant whole; one series gives ``lag1_autocorr``."""
    parts = [np.asarray(s, dtype=float) for s in series if len(s) > 0]
    if sum(p.size for p in parts) < MIN_SAMPLES_FOR_AUTOCORR:
        return float("nan")
    devs = [p - p.mean() for p in parts]
    denom = float(sum(np.dot(d, d) for d in devs))
    if denom == 0:
        return float("nan")
    return float(sum(np.dot(d[:-1], d[1:]) for d in devs) / denom)


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


MIN_LAUNCHES_FOR_CI = 2
"""Fewer launches give no interval across launches (a t interval needs 2 units)."""


@dataclass(frozen=True)
class LaunchInterval:
    """A figure measured once per launch (or per round), summarised across launches: the
    geometric mean and the 95% t interval of the mean log (``launch_interval``)."""

    point: float
    low: float
    """NaN when there is no interval (``note`` says why)."""
    high: float
    n: int
    """Launches (or rounds) behind it."""
    method: str = ""
    """``t over N launches`` or empty."""
    note: str = ""

    @property
    def half_width_rel(self) -> float:
        """Half the interval's width over its point (inf without an interval)."""
        if math.isnan(self.low) or self.point == 0:
            return float("inf")
        return (self.high - self.low) / 2 / self.point

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high


def t_quantile(confidence: float, df: float) -> float:
    """The two-sided Student t quantile: P(|T_df| <= q) = confidence.

    scipy is imported here, not at the top: only the runner and the report compute intervals,
    and scipy.stats costs every worker launch about half a second of start-up on 2 cores.
    """
    from scipy import stats as scipy_stats

    return float(scipy_stats.t.ppf(0.5 + confidence / 2, df))


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of positive, finite figures (a case's launch medians)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0 or np.any(~np.isfinite(data)) or np.any(data <= 0):
        raise ValueError(f"per-launch figures must be positive and finite, got {list(values)}")
    return float(np.exp(np.log(data).mean()))


def launch_interval(values: Sequence[float], units: str = "launches",
                    confidence: float = CI_CONFIDENCE) -> LaunchInterval:
    """Geometric mean of positive per-launch figures and the t interval of their mean log.

    Step times are multiplicative (a slower machine scales them), hence logs: the interval
    is symmetric in ratios and never goes below zero. With one value the point is that
    value and the interval is empty, with the reason. ``units`` names what the values are
    per (``launches``, ``rounds``) in the method and note.
    """
    point = geometric_mean(values)
    logs = np.log(np.asarray(values, dtype=float))
    n = int(logs.size)
    mean = math.log(point)
    if n < MIN_LAUNCHES_FOR_CI:
        nan = float("nan")
        return LaunchInterval(point, nan, nan, n, "",
                              f"{units} measured: {n}; an interval across them needs "
                              f"{MIN_LAUNCHES_FOR_CI} (--launches)")
    half = t_quantile(confidence, n - 1) * float(logs.std(ddof=1)) / math.sqrt(n)
    return LaunchInterval(point, float(np.exp(mean - half)),
                          float(np.exp(mean + half)), n, f"t over {n} {units}")


def paired_ratio_interval(numerators: Sequence[float], denominators: Sequence[float],
                          confidence: float = CI_CONFIDENCE) -> LaunchInterval:
    """numerator_r / denominator_r per round r, summarised by ``launch_interval``: e.g. a
    speedup, single's launch median over the case's, paired by the round they ran in."""
    if len(numerators) != len(denominators):
        raise ValueError(f"unpaired rounds: {len(numerators)} vs {len(denominators)}")
    ratios = [a / b for a, b in zip(numerators, denominators)]
    return launch_interval(ratios, "rounds", confidence)


SIGNED_RANK_METHOD = "signed rank"
"""How ``pair_rounds_interval``'s method starts where it pooled the pairs."""
POOLING_TEST_LEVEL = 0.25
"""``pair_rounds_interval`` pools the rounds' step pairs unless a Kruskal-Wallis test tells
their rounds apart at this level: a preliminary test's level, set high so that a round
component too small to be detected is also too small to move the pooled interval much (the
"sometimes pool" rule of Bozivich, Bancroft and Hartley, 1956; its coverage on synthetic
rounds with and without a round component: tests/test_ci_coverage.py)."""


def signed_rank_depth(n: int, confidence: float = CI_CONFIDENCE) -> tuple[int, float] | None:
    """The signed-rank interval's depth for ``n`` values: ``(k, achieved)``, where the
    interval [w_(k), w_(M + 1 - k)] of the M = n (n + 1) / 2 sorted Walsh averages covers
    the centre of any continuous distribution symmetric about it with probability
    ``achieved`` >= ``confidence``, exactly (the null distribution of the signed-rank
    statistic T, counted). None when even [min, max] falls short (n < 6 at 95%)."""
    if n < 1:
        return None
    # T's distribution, each rank i in or out of the sum with probability 1/2: kept as
    # probabilities, not counts, which pass float64's range (2^1024) past 1,000 pairs.
    prob = np.zeros(n * (n + 1) // 2 + 1)
    prob[0] = 1.0
    for i in range(1, n + 1):
        prob[i:] = (prob[i:] + prob[:-i]) / 2
        prob[:i] /= 2
    below = np.cumsum(prob)  # P(T <= t)
    tail = (1 - confidence) / 2
    k = int(np.searchsorted(below, tail, side="right"))  # P(T <= k - 1) <= tail < P(T <= k)
    if k < 1:
        return None
    return k, float(1 - 2 * below[k - 1])


def hodges_lehmann_interval(values: Sequence[float] | np.ndarray,
                            confidence: float = CI_CONFIDENCE
                            ) -> tuple[float, float, float] | None:
    """The Hodges-Lehmann estimate of the centre of a symmetric distribution (the median
    of the Walsh averages (x_i + x_j) / 2, i <= j) and its signed-rank interval
    (``signed_rank_depth``): (point, low, high); None below 6 values at 95%. Robust like a
    median (a few wild values barely move it), and nearly as efficient as the mean where
    the values are normal (0.955)."""
    data = np.asarray(values, dtype=float)
    depth = signed_rank_depth(int(data.size), confidence)
    if depth is None:
        return None
    i, j = np.triu_indices(data.size)
    walsh = np.sort((data[i] + data[j]) / 2)
    k = depth[0]
    return float(np.median(walsh)), float(walsh[k - 1]), float(walsh[walsh.size - k])


def pair_rounds_interval(rounds: Sequence[Sequence[float] | np.ndarray],
                         confidence: float = CI_CONFIDENCE) -> LaunchInterval:
    """A ratio from paired log ratios grouped by round (the gate's sides taking turns: per
    round, log(head step k / base step k)): exp of their Hodges-Lehmann centre with its
    signed-rank interval, every round's pairs pooled (``n``: the pairs), where the rounds
    cannot be told apart (Kruskal-Wallis p >= ``POOLING_TEST_LEVEL``); else, and below 6
    pairs, the rounds are the units: the t interval over the rounds' median log ratios
    (``n``: the rounds; the note says why), as wide as what differs from one round to the
    next demands. Each pair's two steps met the
    machine in the same second, so the pairs of one round are independent as far as the
    machine goes; what could tie them is their round's launches (a process's placement,
    its allocator): the test looks for it."""
    groups = [np.asarray(g, dtype=float) for g in rounds if len(g)]
    if not groups:
        raise ValueError("no pairs")
    pooled = np.concatenate(groups)
    p_rounds = _rounds_differ(groups)
    hl = hodges_lehmann_interval(pooled, confidence)
    if p_rounds < POOLING_TEST_LEVEL or hl is None:
        medians = [math.exp(float(np.median(g))) for g in groups]
        interval = launch_interval(medians, "rounds", confidence)
        why = (f"{pooled.size} pairs: too few for a {confidence:.0%} signed-rank interval"
               if hl is None else f"the rounds differ (Kruskal-Wallis p = {p_rounds:.2f})")
        return replace(interval, note=f"{why}: the rounds are the units"
                       + (f"; {interval.note}" if interval.note else ""))
    point, low, high = hl
    return LaunchInterval(math.exp(point), math.exp(low), math.exp(high), int(pooled.size),
                          f"{SIGNED_RANK_METHOD} over {pooled.size} pairs of {len(groups)} "
                          "rounds")


def _rounds_differ(groups: Sequence[np.ndarray]) -> float:
    """The Kruskal-Wallis p-value that the groups share one distribution (1 where there is
    nothing to test: one group, or every value equal)."""
    if len(groups) < 2 or np.ptp(np.concatenate(groups)) == 0:
        return 1.0
    from scipy import stats as scipy_stats  # see t_quantile

    return float(scipy_stats.kruskal(*groups).pvalue)


def welch_log_change(base: Sequence[float], cand: Sequence[float],
                     confidence: float = CI_CONFIDENCE) -> tuple[float, float, float]:
    """The relative change of candidate over baseline, geometric means of positive values,
    and its Welch t interval (unequal variances) on the logs: (change, low, high), where
    +0.15 means 15% larger. NaN ends with fewer than 2 values on a side."""
    lb, lc = np.log(np.asarray(base, dtype=float)), np.log(np.asarray(cand, dtype=float))
    diff = float(lc.mean() - lb.mean())
    point = math.expm1(diff)
    if lb.size < 2 or lc.size < 2:
        return point, float("nan"), float("nan")
    vb, vc = float(lb.var(ddof=1)) / lb.size, float(lc.var(ddof=1)) / lc.size
    se2 = vb + vc
    if se2 == 0:
        return point, point, point
    df = se2**2 / (vb**2 / (lb.size - 1) + vc**2 / (lc.size - 1))
    half = t_quantile(confidence, df) * math.sqrt(se2)
    return point, math.expm1(diff - half), math.expm1(diff + half)


def slowest_per_step(per_rank: Mapping[int, Sequence[float]]) -> list[float]:
    """The case's time of each step: the slowest rank's. Ranks must have timed equal steps."""
    counts = {len(times) for times in per_rank.values()}
    if len(counts) > 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(counts)}")
    return [max(step) for step in zip(*per_rank.values())]
