"""The intervals checked by their coverage, not their arithmetic; the lag-1
autocorrelation checked by what it recovers from series of known correlation.

Coverage: the share of many seeded synthetic samples whose interval holds the true value.
Within one launch (the adaptive stop's interval of the median): independent step times,
skewed and heavy on the slow side, so lognormal (median 1) and a shifted exponential
(median 1 + 0.1 ln 2). Across launches (the figures a run reports: a case's step time, a
speedup, a change between two runs): synthetic sweeps with launch offsets, round drift and
independent, AR(1) and skewed steps, each launch's length decided by ``AdaptiveStop``.
The gate's step pairs taken in turns (``pair_rounds_interval``): rounds of paired log
ratios, normal, heavy-tailed or with one pair in ten hit on one side, with and without a
component that each round's launches share.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np
import pytest

from bench_lib.analysis.stats import (
    MIN_SAMPLES_FOR_AUTOCORR,
    MIN_SAMPLES_FOR_BOOTSTRAP,
    MIN_SAMPLES_FOR_EXACT_CI,
    Stats,
    bootstrap_median_ci,
    lag1_autocorr,
    lag1_autocorr_within,
    launch_interval,
    median_ci,
    order_statistic_median_ci,
    pair_rounds_interval,
    paired_ratio_interval,
    signed_rank_depth,
    welch_log_change,
)
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.timing import AdaptiveStop
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
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

    # A case row's step time comes from its launches (the steps' own intervals stay inside
    # a launch, for the adaptive stop): one launch gives no interval and says why.
    rig = Rig("cpu", 2, 1, (0, 1))
    case = new_case(rig, "single", "resnet-tiny", 32, 4)
    row = case_row(case, rig, CaseOutcome("ok", step_times_s=[0.1, 0.12, 0.11],
                                          stop_reason="time_cap", warmup_steps=4,
                                          peak_mem_mib={"0": 100.0}))
    assert row["step_time_s_ci_low"] is None and row["step_time_s_ci_high"] is None
    assert row["step_time_ci_method"] == ""
    assert row["step_time_ci_note"] == (
        "launches measured: 1; an interval across them needs 2 (--launches)")
    assert row["launches"] == 1 and row["steps_per_launch"] == "3"
    assert row["launch_medians_s"] == "0.11" and row["step_time_s_median"] == pytest.approx(0.11)
    assert row["step_time_lag1_autocorr"] is None  # under 10 steps
    assert row["warmup_steps"] == 4  # the warm-up run, not the profile's minimum

    # Three launches: the geometric mean of their medians and the t interval (2 df).
    launch_steps = [[0.1, 0.12, 0.11, 0.1, 0.13, 0.1, 0.12, 0.11, 0.1, 0.12],
                    [0.105, 0.11, 0.1, 0.12],
                    [0.12, 0.125, 0.118, 0.13, 0.121]]
    launches = [CaseOutcome("ok", step_times_s=steps, stop_reason=reason, warmup_steps=w,
                            peak_mem_mib={"0": 100.0 + w})
                for steps, reason, w in zip(launch_steps, ["step_cap", "time_cap", "ci_target"],
                                            [2, 3, 2])]
    row = case_row(case, rig, CaseOutcome.of_launches(launches))
    medians = [statistics.median(steps) for steps in launch_steps]  # 0.11, 0.1075, 0.121
    expected = launch_interval(medians)
    assert row["step_time_ci_method"] == "t over 3 launches" and row["step_time_ci_note"] == ""
    assert row["launches"] == 3 and row["steps_per_launch"] == "10;4;5"
    assert row["launch_medians_s"] == "0.11;0.1075;0.121"
    assert row["timed_steps"] == 19  # the spread columns pool every launch's steps
    assert row["step_time_s_median"] == pytest.approx(math.prod(medians) ** (1 / 3))
    assert (row["step_time_s_ci_low"], row["step_time_s_ci_high"]) == pytest.approx(
        (expected.low, expected.high))
    assert row["step_time_s_ci_low"] < min(medians) and row["step_time_s_ci_high"] > max(medians)
    assert row["step_time_lag1_autocorr"] == pytest.approx(lag1_autocorr_within(launch_steps))
    assert row["warmup_steps"] == 3  # the most any launch needed
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


# Across launches: the intervals a run reports, checked on synthetic sweeps measured the way
# the runner measures them. Per launch, a step's log time is log(step_s) + the launch's
# offset (normal, sd OFFSET_SD: allocation, placement, clocks) + noise_t, a stationary AR(1)
# in the log with normal innovations or right-skewed ones (shifted exponential: the odd slow
# step); AdaptiveStop, asked after every step as in timing.time_steps, decides the launch's
# length (CI target 2%, a time cap, the timed_steps cap), and the launch's figure is the
# median of its steps. "short" launches get a time cap of 3 step times, so 3 or 4 steps (a
# slow case on a 2-core machine): no within-launch interval at all, the t interval across
# launches alone.

NOISE_SD = 0.03  # stationary sd of a step's log-noise
OFFSET_SD = 0.025  # launch to launch, in log
DRIFT_SD = 0.05  # per round, shared by every launch of the round (speedup sweeps)
STEP_S = 0.2  # single's step time: exp(mu)
SPEEDUP = 1.8  # single's step time over the other case's: exp(mu_single - mu_case)
BURN_IN = 40  # steps discarded so that a skewed AR(1) starts stationary (0.6^40 ~ 1e-9)


@dataclass(frozen=True)
class Sweep:
    phi: float
    skewed: bool = False
    short: bool = False

    @property
    def timed_steps(self) -> int:
        return 20 if self.short else 10

    def max_time_s(self, step_s: float) -> float:
        return (3.0 if self.short else 9.5) * step_s


SWEEPS = {
    "independent": Sweep(0.0),
    "ar1-0.3": Sweep(0.3),
    "ar1-0.6": Sweep(0.6),
    "ar1-0.3-skewed": Sweep(0.3, skewed=True),
    "short-ar1-0.6": Sweep(0.6, short=True),
    "short-ar1-0.3-skewed": Sweep(0.3, skewed=True, short=True),
}


def _log_noise(rng: np.random.Generator, shape: tuple[int, ...], sweep: Sweep) -> np.ndarray:
    """Stationary AR(1) log-noise of sd NOISE_SD, ``shape + (timed_steps,)``."""
    steps, phi = BURN_IN + sweep.timed_steps, sweep.phi
    if sweep.skewed:
        z = rng.exponential(1.0, (*shape, steps)) - 1.0  # mean 0, sd 1, skew 2
    else:
        z = rng.standard_normal((*shape, steps))
    z *= NOISE_SD * math.sqrt(1 - phi**2)
    e = np.empty_like(z)
    e[..., 0] = z[..., 0] / math.sqrt(1 - phi**2)
    for t in range(1, steps):
        e[..., t] = phi * e[..., t - 1] + z[..., t]
    return e[..., BURN_IN:]


def _launch_medians(rng: np.random.Generator, sweep: Sweep, log_step_s: np.ndarray,
                    max_time_s: float) -> np.ndarray:
    """Each launch's median step time; ``log_step_s`` is per launch its log step time
    (mu + offset + drift), ``max_time_s`` the stop rule's time cap."""
    series = np.exp(log_step_s[..., None] + _log_noise(rng, log_step_s.shape, sweep))
    medians = np.empty(log_step_s.shape)
    for index in np.ndindex(log_step_s.shape):
        stop = AdaptiveStop(0.02, max_time_s)
        times: list[float] = []
        for t in series[index].tolist():  # at most timed_steps
            times.append(t)
            if stop(times):
                break
        medians[index] = statistics.median(times)
    return medians


@functools.cache
def _sweep_medians(name: str, launches: int, seed: int, slower: float = 1.0) -> np.ndarray:
    """TRIALS sweeps of one case, ``launches`` launch medians each: (TRIALS, launches)."""
    sweep = SWEEPS[name]
    rng = np.random.default_rng(seed)
    log_step_s = math.log(STEP_S * slower) + OFFSET_SD * rng.standard_normal((TRIALS, launches))
    # The same time cap whatever the case's speed, as a run gives every case.
    return _launch_medians(rng, sweep, log_step_s, sweep.max_time_s(STEP_S))


@functools.cache
def _true_median(name: str) -> float:
    """The value the geometric mean of launch medians estimates: exp(E[log launch median]).

    With symmetric noise that is exp(mu) = STEP_S: for a given number of steps n the median
    of n values of a symmetric stationary Gaussian process is symmetric about 0 (negate the
    process), so E[log median] = mu + E[offset] = mu (an even n's median averages the two
    middle steps in seconds, above their mean log by ~(spread / 2)^2 / 2: ~1e-4 here). The
    adaptive stop makes n depend on the values (slow steps reach the time cap sooner), which
    breaks the symmetry slightly: over 10000 simulated launches of each symmetric sweep here
    E[log median] - mu was within 0.04% of 0 (standard error 0.03%), against interval
    half-widths of 3-10%; ``test_launch_interval_covers_the_median_step_time`` checks it on
    its own launches. Skewed noise has no closed form: its median is below its mean (-0.7%
    in log with 8-10 steps, -0.3% with 3-4), so the true value is estimated from 1200
    launches of an independent seed (standard error 0.08%).
    """
    if not SWEEPS[name].skewed:
        return STEP_S
    medians = _sweep_medians(name, 3, seed=999)  # 400 x 3 launches, not the trials' seeds
    return float(np.exp(np.log(medians).mean()))


def _coverage_of(intervals, true_value: float) -> float:
    return sum(i.covers(true_value) for i in intervals) / len(intervals)


@pytest.mark.parametrize("name,launches", [(name, 3) for name in SWEEPS] + [("ar1-0.3", 5)])
@pytest.mark.integration
def test_launch_interval_covers_the_median_step_time(name, launches):
    # The ar1-0.3 sweeps have 6 launches each (the Welch tests use them as two runs of 3):
    # 3 launches take the first 3, 5 the first 5.
    stored = 6 if name == "ar1-0.3" else launches
    medians = _sweep_medians(name, stored, seed=11 + list(SWEEPS).index(name))[:, :launches]
    intervals = [launch_interval(m) for m in medians]
    assert all(i.method == f"t over {launches} launches" for i in intervals)
    true_value = _true_median(name)
    coverage = _coverage_of(intervals, true_value)
    assert 0.90 <= coverage <= 0.98, (name, launches, coverage)
    if not SWEEPS[name].skewed:  # the stop's bias on the true value is negligible
        assert abs(np.log(medians / STEP_S).mean()) < 0.003


@pytest.mark.parametrize("name,rounds", [("independent", 3), ("ar1-0.6", 3),
                                         ("short-ar1-0.6", 3), ("short-ar1-0.6", 5)])
@pytest.mark.integration
def test_paired_speedup_interval_covers_the_true_speedup(name, rounds):
    # Single and the case each launched once per round; a round's drift slows both alike,
    # and pairing by round cancels it. Both get single's time cap, so the faster case runs
    # more steps (to the CI target or the step cap where single hits the time cap). With
    # symmetric noise each case's E[log launch median] is its own mu (``_true_median``),
    # so the true speedup is exp(mu_single - mu_case).
    sweep = SWEEPS[name]
    rng = np.random.default_rng(101 + rounds + 7 * list(SWEEPS).index(name))
    drift = DRIFT_SD * rng.standard_normal((TRIALS, rounds))
    cap = sweep.max_time_s(STEP_S)
    single = _launch_medians(
        rng, sweep, math.log(STEP_S) + drift + OFFSET_SD * rng.standard_normal(drift.shape), cap)
    case = _launch_medians(
        rng, sweep,
        math.log(STEP_S / SPEEDUP) + drift + OFFSET_SD * rng.standard_normal(drift.shape), cap)
    intervals = [paired_ratio_interval(s, c) for s, c in zip(single, case)]
    assert all(i.method == f"t over {rounds} rounds" for i in intervals)
    coverage = _coverage_of(intervals, SPEEDUP)
    # Unpaired, the drift would stay in: the interval of the same ratio from the two cases'
    # launches taken apart (Welch) is wider.
    paired = statistics.median(math.log(i.high / i.low) / 2 for i in intervals)
    unpaired = statistics.median(
        (math.log1p(high) - math.log1p(low)) / 2
        for _, low, high in (welch_log_change(c, s) for s, c in zip(single, case)))
    assert 0.90 <= coverage <= 0.98, (name, rounds, coverage)
    assert paired < unpaired, (paired, unpaired)


def _welch(base: np.ndarray, cand: np.ndarray) -> list[tuple[float, float, float]]:
    return [welch_log_change(b, c) for b, c in zip(base, cand)]


@pytest.mark.integration
def test_welch_change_interval_covers_no_change_and_a_planted_one():
    # Two runs of 3 launches each, the regression gate's comparison of per-launch medians.
    pool = _sweep_medians("ar1-0.3", 6, seed=11 + list(SWEEPS).index("ar1-0.3"))
    base, same = pool[:, :3], pool[:, 3:]
    slower = _sweep_medians("ar1-0.3", 3, seed=77, slower=1.15)  # symmetric: true +15%
    a_a = _welch(base, same)
    planted = _welch(base, slower)
    covered_0 = sum(low <= 0 <= high for _, low, high in a_a) / TRIALS
    covered_15 = sum(low <= 0.15 <= high for _, low, high in planted) / TRIALS
    detected = sum(low > 0 and point > 0.10 for point, low, _ in planted) / TRIALS
    spread = float(np.log(pool).std(ddof=1))  # all 2400 launches alike: one distribution
    assert 0.025 <= spread <= 0.035, spread  # 3% launch spread: offset and median together
    assert 0.90 <= covered_0 <= 0.98, covered_0
    assert 0.90 <= covered_15 <= 0.98, covered_15
    assert detected >= 0.90, detected


# ---- the gate's step pairs taken in turns ------------------------------------------------

PAIR_SD = 0.04
"""A pair's log ratio spread (robust SD) in turns gates on 2 Intel Xeon cores: about 4%."""


def _pair_rounds(rng: np.random.Generator, noise: str, round_sd: float, rounds: int = 5,
                 pairs: int = 6, change: float = 0.03) -> list[np.ndarray]:
    """``rounds`` rounds of ``pairs`` log ratios around log(1 + change): normal, Student t
    with 3 degrees of freedom (heavy tails), or a narrower normal with one pair in ten 25%
    off (a step a neighbour hit on one side only); each round shifted by its launches'
    own offset (``round_sd``, in units of the SD of a round's mean)."""
    out = []
    for _ in range(rounds):
        if noise == "normal":
            e = rng.normal(0, PAIR_SD, pairs)
        elif noise == "t3":
            e = rng.standard_t(3, pairs) * PAIR_SD / math.sqrt(3)
        else:
            e = rng.normal(0, PAIR_SD / 2, pairs)
            hit = rng.random(pairs) < 0.1
            e[hit] += rng.choice([-0.25, 0.25], int(hit.sum()))
        offset = rng.normal(0, round_sd * PAIR_SD / math.sqrt(pairs))
        out.append(math.log1p(change) + offset + e)
    return out


def test_signed_rank_depths_are_the_tables():
    # Two-sided 5% critical values of the signed-rank statistic (T <= 8, 52, 137 reject at
    # n = 10, 20, 30): the interval's ends are the next Walsh averages in.
    assert [signed_rank_depth(n)[0] for n in (6, 10, 20, 30)] == [1, 9, 53, 138]
    assert signed_rank_depth(6)[1] == 1 - 2 / 64  # [min, max]
    assert all(signed_rank_depth(n)[1] >= 0.95 for n in range(6, 80))
    assert signed_rank_depth(5) is None
    # Past 1,024 pairs the counts pass float64's range (a gate of 5 rounds of 206 steps):
    # the depth is still had, where the normal approximation puts it.
    n = 1030
    k, achieved = signed_rank_depth(n)
    normal = n * (n + 1) / 4 - 1.959964 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    assert abs(k - normal) < 10 and 0.95 <= achieved < 0.9501


def test_pair_rounds_interval_takes_the_rounds_below_six_pairs_and_says_why():
    few = pair_rounds_interval([[0.01, 0.03], [0.0, 0.02]])
    assert few.method == "t over 2 rounds" and few.n == 2
    assert few.note == "4 pairs: too few for a 95% signed-rank interval: the rounds are the units"
    assert few.point == pytest.approx(math.exp(0.015))
    same = pair_rounds_interval([[0.02] * 3, [0.02] * 3])  # nothing to tell apart: pooled
    assert same.method == "signed rank over 6 pairs of 2 rounds"
    assert same.low == same.high == pytest.approx(math.exp(0.02))


@pytest.mark.parametrize("noise,round_sd", [("normal", 0.0), ("t3", 0.0), ("hits", 0.0),
                                            ("normal", 0.5), ("normal", 1.0),
                                            ("normal", 3.0)])
def test_pair_rounds_interval_covers_the_change_with_or_without_a_round_component(
        noise, round_sd):
    # Without a round component the pairs are pooled (the Kruskal-Wallis test keeps them
    # together 75% of the time, its level) and the exact signed-rank interval covers at
    # least its 95%. With one, pooling past an undetected component costs a little coverage
    # (worst near a component as large as a round mean's own noise: about 93%), and a
    # large one is told apart and answered by the rounds' t.
    rng = np.random.default_rng(31 + int(10 * round_sd) + len(noise))
    intervals = [pair_rounds_interval(_pair_rounds(rng, noise, round_sd))
                 for _ in range(TRIALS)]
    coverage = _coverage_of(intervals, 1.03)
    pooled = sum(i.method.startswith("signed rank over 30 pairs of 5 rounds")
                 for i in intervals) / TRIALS
    assert 0.90 <= coverage <= 0.99, (noise, round_sd, coverage)
    if round_sd == 0:
        assert coverage >= 0.93 and pooled >= 0.65, (coverage, pooled)
    if round_sd >= 3:
        assert pooled < 0.3, pooled
        assert all(i.method == "t over 5 rounds" and "Kruskal-Wallis" in i.note
                   for i in intervals if not i.method.startswith("signed rank"))


def test_pooled_pairs_are_narrower_than_the_rounds_t_on_the_same_pairs():
    # The same 30 pairs, judged by the rounds (t over 5 round medians, 4 degrees of freedom)
    # or pooled: the pooled interval is about a quarter narrower; the test keeps it so.
    rng = np.random.default_rng(37)
    pooled, rounds = [], []
    for _ in range(TRIALS):
        groups = _pair_rounds(rng, "normal", 0.0)
        interval = pair_rounds_interval(groups)
        if interval.method.startswith("signed rank"):
            pooled.append(interval.half_width_rel)
            medians = [math.exp(float(np.median(g))) for g in groups]
            rounds.append(launch_interval(medians, "rounds").half_width_rel)
    assert np.median(pooled) < 0.85 * np.median(rounds)
