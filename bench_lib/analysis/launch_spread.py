"""Whether a case's launches differ by more than their own steps' noise explains.

A case runs in several fresh launches, and its interval resamples them (``stats.
launch_interval``), so a launch-to-launch spread widens the interval without being named.
This test names it. Steps within a launch are correlated (a slow step follows a slow one),
so a one-way analysis of variance on the steps themselves would take a launch's own slow
stretch for a difference between launches. It runs on batches instead (the batch-means
method):

- each launch's log step times are cut into consecutive batches of at least ``m`` steps,
  ``m`` = ``BATCH_CORRELATION_LENGTHS`` times the steps' correlation length (1 + r) / (1 - r)
  (r: the lag-1 autocorrelation pooled within launches), at least ``MIN_BATCH_STEPS``, so
  that neighbouring batches are nearly independent; a batch's level is its median (a lone
  spike moves it little);
- a one-way analysis of variance of the batch levels grouped by launch: F = the between-
  launch mean square over the within-launch one, against F(L - 1, B - L) (L launches, B
  batches), at ``LEVEL``. Within-launch variation is everything a launch's own batches do:
  noise, correlated stretches and drift inside the launch; only what lies beyond it is a
  difference between launches.

``ratio`` = sqrt(F): the spread of the launches' levels over what their batches' spread
predicts for it (about 1 when the launches are alike).

How well it holds its level (seeded simulations, 2 or 3 launches of 25 to 100 steps, log
steps AR(1) with 2% noise, 400 to 2000 cases each): independent steps are flagged at
0.5-1.3%, AR(1) 0.3 and 0.6 at 0.7-2.3%: the batches' residual correlation and the
lag-1 estimate's downward bias over short launches leave it somewhat above 1%, never
above 3%. A launch 10% off is flagged in every case with independent steps, and with AR(1)
0.6 in 94-100% from 40 steps a launch (57-78% at 25: batches of 12 leave few). Where the
steps are too correlated for 2 batches a launch there is no test (``note``).
tests/test_launch_spread.py checks both on 200 cases each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench_lib.analysis.stats import lag1_autocorr_within

LEVEL = 0.01
"""The test's level: launches alike are flagged this often (or less)."""
MIN_BATCH_STEPS = 3
"""The shortest batch: a median of 3 already shrugs off one spike."""
BATCH_CORRELATION_LENGTHS = 3.0
"""A batch spans this many correlation lengths, so that neighbouring batches are nearly
independent (AR(1) with r = 0.6: correlation length 4, batches of 12 steps, neighbouring
batch levels correlated about 0.08)."""
MAX_AUTOCORR = 0.9
"""The lag-1 autocorrelation used for the batch length is capped here (batches of 57 steps
already): steps more correlated than that leave too few batches to tell anything."""
MIN_BATCHES_PER_LAUNCH = 2


@dataclass(frozen=True)
class LaunchSpread:
    """The verdict on one case's launches: do they differ beyond their steps' noise?"""

    differ: bool
    """True where p < ``LEVEL``."""
    ratio: float
    """The spread of the launches' levels over what within-launch noise predicts for it
    (sqrt of F); NaN without a test."""
    p_value: float
    """P(a ratio at least this large | launches alike); NaN without a test."""
    medians_s: tuple[float, ...]
    """Each launch's median step, seconds, in round order."""
    batch_steps: int = 0
    """Steps per batch the test used (0: no test)."""
    note: str = ""
    """Why there is no test (one launch, too few steps)."""

    @property
    def tested(self) -> bool:
        return not math.isnan(self.p_value)


def batch_steps(launches: Sequence[Sequence[float]]) -> int:
    """The batch length for these launches' log steps (module docstring)."""
    logs = [np.log(np.asarray(x, dtype=float)) for x in launches]
    r = lag1_autocorr_within(logs)
    r = 0.0 if math.isnan(r) else min(max(r, 0.0), MAX_AUTOCORR)
    length = (1 + r) / (1 - r)
    return max(MIN_BATCH_STEPS, math.ceil(BATCH_CORRELATION_LENGTHS * length))


def batch_levels(steps: Sequence[float], m: int) -> np.ndarray:
    """The median log step of each of ``len(steps) // m`` consecutive batches (the last
    ones a step longer where ``m`` does not divide the launch)."""
    logs = np.log(np.asarray(steps, dtype=float))
    return np.array([np.median(b) for b in np.array_split(logs, len(logs) // m)])


def f_statistic(groups: Sequence[np.ndarray]) -> tuple[float, int, int]:
    """One-way analysis of variance: (F, between df, within df); F is inf where the
    groups differ and nothing varies within them, NaN where nothing varies at all."""
    values = np.concatenate(groups)
    grand = float(values.mean())
    between = sum(g.size * (float(g.mean()) - grand) ** 2 for g in groups)
    within = sum(float(((g - g.mean()) ** 2).sum()) for g in groups)
    df_b, df_w = len(groups) - 1, int(values.size) - len(groups)
    if within == 0:
        return (float("nan") if between == 0 else float("inf")), df_b, df_w
    return (between / df_b) / (within / df_w), df_b, df_w


def launch_spread(launches: Sequence[Sequence[float]], level: float = LEVEL) -> LaunchSpread:
    """Test whether ``launches`` (each launch's positive step times, in order) differ by
    more than their steps' own noise explains (module docstring)."""
    if any(len(x) == 0 for x in launches):
        raise ValueError("every launch needs at least one timed step")
    if any(t <= 0 or not math.isfinite(t) for x in launches for t in x):
        raise ValueError("step times must be positive and finite")
    medians = tuple(float(np.median(x)) for x in launches)
    nan = float("nan")
    if len(launches) < 2:
        return LaunchSpread(False, nan, nan, medians, note="1 launch: nothing to compare")
    m = batch_steps(launches)
    shortest = min(len(x) for x in launches)
    if shortest < MIN_BATCHES_PER_LAUNCH * m:
        return LaunchSpread(False, nan, nan, medians, note=(
            f"{shortest} step{'s' if shortest != 1 else ''} in a launch: too few for "
            f"{MIN_BATCHES_PER_LAUNCH} batches of {m} (the steps' correlation sets the batch)"))
    f, df_b, df_w = f_statistic([batch_levels(x, m) for x in launches])
    if math.isnan(f):
        return LaunchSpread(False, nan, nan, medians, m, "every batch alike: no spread")
    p = 0.0 if math.isinf(f) else f_survival(f, df_b, df_w)
    return LaunchSpread(p < level, math.sqrt(f), p, medians, m)


def f_survival(f: float, df_between: int, df_within: int) -> float:
    """P(F(df_between, df_within) >= f).

    scipy is imported here, not at the top, as in ``stats.t_quantile``: only the runner and
    the report test launches, and a worker launch should not pay for scipy.stats.
    """
    from scipy import stats as scipy_stats

    return float(scipy_stats.f.sf(f, df_between, df_within))


def describe(spread: LaunchSpread) -> str:
    """The row's words where the launches differ, e.g. ``launch medians 0.117, 0.099 s
    differ more than their steps' spread explains (4.1x, p<0.01)``; empty otherwise."""
    if not spread.differ:
        return ""
    medians = ", ".join(f"{m:.3g}" for m in spread.medians_s)
    p = f"p<{LEVEL:g}" if spread.p_value < LEVEL else f"p={spread.p_value:.2g}"
    return (f"launch medians {medians} s differ more than their steps' spread explains "
            f"({spread.ratio:.1f}x, {p})")


NAME_CHARS = 60
"""A kernel's name in a note is cut here (templated names run to hundreds)."""


def kernels_note(per_launch: Sequence[Sequence[str]]) -> str:
    """Whether the launches ran the same CUDA kernels (each launch's names,
    ``measure.kernels``), each later launch against the first, e.g. ``launches ran the same
    kernels (87)`` or ``launch 2 ran 3 kernels launch 1 did not, launch 1 2 it did not (e.g.
    sm90_xmma_fprop_implicit_gemm...)``; empty where no launch recorded any (cpu rigs)."""
    sets = [set(names) for names in per_launch]
    if len(sets) < 2 or not any(sets):
        return ""
    if not all(sets):
        missing = ", ".join(str(k + 1) for k, s in enumerate(sets) if not s)
        return f"kernels not recorded in launch {missing}"
    first, parts = sets[0], []
    for k, later in enumerate(sets[1:], start=2):
        extra, lost = sorted(later - first), sorted(first - later)
        if extra or lost:
            name = (extra or lost)[0]
            name = name if len(name) <= NAME_CHARS else name[:NAME_CHARS] + "..."
            parts.append(f"launch {k} ran {len(extra)} kernels launch 1 did not, launch 1 "
                         f"{len(lost)} it did not (e.g. {name})")
    return "; ".join(parts) or f"launches ran the same kernels ({len(first)})"
