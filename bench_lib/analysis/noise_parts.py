"""What a case's launch-to-launch noise is made of: the machine's speed, which every case of a
run shares, and the case's own launch and steps.

Runs of the same sweep (the same code: an A/A series), each launching every case in K
interleaved rounds (``run --launches K``: round k launches every case once, one after
another, seconds apart). Per run r, round k and case c, y = the log of the launch's median
step time, modelled as

    y[r, k, c] = mu[c] + run[r] + slot[r, k] + own[r, k, c]

- ``run``: the machine's speed over a run's minutes, common to every case of the run;
- ``slot``: its speed over the seconds of one round within a run, common to the round's
  cases;
- ``own``: the case's own launch: its process, placement, allocator, and the noise of its
  steps carried into its median (``step``, estimated apart from the launch's spread within;
  ``launch`` is the rest).

The variances are the nested analysis of variance's moment estimators (balanced: every case
ok in every launch; a negative estimate is reported as 0), in log units, so that their
square roots read as relative spreads (0.02: 2%). The step part is each launch median's
sampling variance from its own steps, (pi / 2) s^2 / n for n steps of variance s^2 (the
median's asymptotic variance under normal noise), inflated by (1 + r) / (1 - r) for the
steps' pooled lag-1 autocorrelation r: an approximation, said as one.

Which lever pays follows from the shares: noise common to a run's cases (``run``, ``slot``)
cancels in a ratio of two cases timed in the same moment, or against a probe of the
machine's speed timed in the same launch; a case's own noise only averages down with more
launches. tests/test_noise_parts.py checks the estimators recover planted parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench_lib.analysis.stats import lag1_autocorr_within

MAX_STEP_AUTOCORR = 0.9
"""The steps' lag-1 autocorrelation used for the step part is capped here."""


@dataclass(frozen=True)
class NoiseParts:
    """The variance parts (log units) of the launch medians of ``cases`` over ``runs`` runs of
    ``rounds`` rounds each."""

    cases: tuple[str, ...]
    runs: int
    rounds: int
    run: float
    """Common to every case of a run, between runs."""
    slot: float
    """Common to every case of one round, between the rounds of a run."""
    own: dict[str, float]
    """Each case's own launch-to-launch variance (launch and step together)."""
    step: dict[str, float]
    """The part of ``own`` its steps' noise explains (the launch median's sampling
    variance)."""

    @property
    def common(self) -> float:
        """Variance every case shares: ``run`` + ``slot``."""
        return self.run + self.slot

    def launch(self, case: str) -> float:
        """The case's own launch part: ``own`` less ``step`` (0 where steps explain it all)."""
        return max(0.0, self.own[case] - self.step[case])

    def total(self, case: str) -> float:
        """The case's launch medians' whole variance: common and own."""
        return self.common + self.own[case]

    def common_share(self, case: str) -> float:
        """The share of the case's launch-to-launch variance that every case shares."""
        total = self.total(case)
        return self.common / total if total > 0 else math.nan

    def rows(self) -> list[dict[str, float | str]]:
        """Per case, each part as a relative spread (standard deviation, %) and the common
        share (%)."""
        def pct(v: float) -> float:
            return round(100 * math.sqrt(v), 2)

        return [{"case": c, "total_pct": pct(self.total(c)), "run_pct": pct(self.run),
                 "slot_pct": pct(self.slot), "launch_pct": pct(self.launch(c)),
                 "step_pct": pct(self.step[c]),
                 "common_share_pct": round(100 * self.common_share(c), 1)}
                for c in self.cases]


def step_variance(steps: Sequence[float], autocorr: float) -> float:
    """A launch median's sampling variance (log units) from its own steps: (pi / 2) s^2 / n,
    times (1 + r) / (1 - r) for lag-1 autocorrelation r (clipped to 0 .. ``MAX_STEP_AUTOCORR``)."""
    x = np.log(np.asarray(steps, dtype=np.float64))
    if x.size < 2:
        return math.nan
    r = min(max(autocorr, 0.0), MAX_STEP_AUTOCORR)
    return float(math.pi / 2 * x.var(ddof=1) / x.size * (1 + r) / (1 - r))


def decompose(medians: npt.ArrayLike, cases: Sequence[str],
              step_vars: npt.ArrayLike | None = None) -> NoiseParts:
    """The parts of ``medians`` (seconds, shape runs x rounds x cases, every cell filled).
    ``step_vars``: each launch median's sampling variance from its steps (same shape; None:
    step parts 0)."""
    y = np.log(np.asarray(medians, dtype=np.float64))
    if y.ndim != 3 or not np.all(np.isfinite(y)):
        raise ValueError("medians: runs x rounds x cases, every one a positive number")
    runs, rounds, n = y.shape
    if n != len(cases) or n < 2 or runs * rounds < 2:
        raise ValueError(f"need at least 2 cases and 2 launches of each; got {y.shape}")
    y = y - y.mean(axis=(0, 1), keepdims=True)  # each case's own level out
    slot_means = y.mean(axis=2, keepdims=True)  # (runs, rounds, 1): the moment's speed
    run_means = slot_means.mean(axis=1, keepdims=True)  # (runs, 1, 1)
    resid = y - slot_means  # each case's own, less the moment's
    ms_resid = float((resid**2).sum()) / ((runs * rounds - 1) * (n - 1))
    run_part = slot_part = 0.0
    if rounds > 1:
        ms_slot = n * float(((slot_means - run_means) ** 2).sum()) / (runs * (rounds - 1))
        slot_part = max(0.0, (ms_slot - ms_resid) / n)
    else:
        ms_slot = ms_resid
    if runs > 1:
        ms_run = rounds * n * float((run_means**2).sum()) / (runs - 1)
        run_part = max(0.0, (ms_run - ms_slot) / (rounds * n))
    # Each case's own variance from its residuals: E[sum e_c^2] = sigma_c^2 (RK - 1)(1 - 2/n)
    # + (RK - 1) / n^2 * sum sigma^2, solved for every case at once.
    cells = runs * rounds - 1
    ss = (resid**2).sum(axis=(0, 1)) / cells  # = sigma_c^2 (1 - 2/n) + mean(sigma^2) / n
    mean_sigma = float(ss.sum()) / (n - 1)  # summing: S (1 - 2/n) + S / n = S (n - 1) / n
    own = np.maximum(0.0, (ss - mean_sigma / n) / (1 - 2 / n)) if n > 2 else \
        np.full(n, mean_sigma / n)
    if step_vars is None:
        steps = np.zeros(n)
    else:
        sv = np.asarray(step_vars, dtype=np.float64)
        steps = np.nanmean(sv.reshape(-1, n), axis=0)
    return NoiseParts(tuple(cases), runs, rounds, run_part, slot_part,
                      {c: float(v) for c, v in zip(cases, own, strict=True)},
                      {c: float(v) for c, v in zip(cases, steps, strict=True)})


def from_launches(runs: Sequence[dict[str, dict[int, Sequence[float]]]],
                  cases: Sequence[str]) -> NoiseParts:
    """The parts from runs' step times: per run, case -> launch round -> its steps' times
    (``bench_lib.compare.runs.Run.launches``). Uses the rounds every run ran every case in."""
    rounds = sorted(set.intersection(*(set(run[c]) for run in runs for c in cases)))
    if not rounds:
        raise ValueError("no round in which every run ran every case")
    series = [run[c][k] for run in runs for c in cases for k in rounds]
    r = lag1_autocorr_within(series)
    r = 0.0 if math.isnan(r) else r
    medians = [[[float(np.median(run[c][k])) for c in cases] for k in rounds] for run in runs]
    step_vars = [[[step_variance(run[c][k], r) for c in cases] for k in rounds] for run in runs]
    return decompose(medians, cases, step_vars)
