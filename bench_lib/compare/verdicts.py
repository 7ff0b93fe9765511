"""Baseline vs candidate: per-case verdicts that stay right on a noisy, shared machine.

Two metrics per case, both as a relative change where + means slower:

* ``step_time``: the candidate's step time over the baseline's. A step's time is the
  slowest rank's; a launch's is the median of its steps; a run's is the geometric mean of
  its launches' (cases.csv's ``step_time_s_median``). Sensitive to everything, machine
  drift included.
* ``speedup``: the case's step time relative to the ``single`` case of the same workload in
  the same run, candidate over baseline (the inverse change of its speedup over ``single``).
  Per round r (every case of a workload is launched once per round, interleaved) the ratio
  case_r / single_r of their launch medians, over the rounds both ran; a run's ratio is the
  geometric mean over those rounds. A machine that got uniformly slower between the two runs
  cancels out, and so does drift within a run that slows a round's launches alike.

Each change has a 95% interval, by ``method``:

* ``welch over launches`` (2 launches or more on both sides; the runner's default is 3):
  the launches (for ``speedup``, the rounds' ratios) are the independent units, so the
  interval holds each launch's step-to-step noise, correlated or not, and the spread
  between launches of one run both. The change is that of the geometric means and the
  interval Welch's t interval of the difference of the mean logs
  (``bench_lib.analysis.stats.welch_log_change``: unequal variances, Welch-Satterthwaite
  degrees of freedom), mapped back.
* ``bootstrap over steps`` (a side measured in 1 launch, e.g. ``--launches 1``): the
  percentile bootstrap of the same change, each launch's steps resampled independently
  (RESAMPLES times). It covers step-to-step noise only: how much a fresh launch would have
  moved the figure is not in it, so it is too narrow wherever launches differ. The output
  says which method each interval had.

A metric says *regression* only when its change is beyond the threshold AND its interval
lies wholly above zero (asv's rule: a factor and a significant difference); *improvement*
likewise below; otherwise *unchanged*.

The rule that turns metrics into a case's verdict (``metric="auto"``):

* ``single`` cases (and cases whose run lacks a ``single``) are judged on ``step_time``: a
  slowdown that hits every strategy alike shows there, once, however it came about.
* every other case is judged on ``speedup``: a change that hits one strategy shows there even
  when the machine drifted, and a uniform slowdown is not reported N times over.

One pair of runs cannot tell a uniformly slower machine from code that made every strategy
uniformly slower (a torch upgrade): both fail ``single``'s step time. The table says so.

Limits: the intervals cover the noise within each run, between its launches included, not a
change of load that holds through a whole run: a machine busier for all of the candidate's
launches than for all of the baseline's reads as a ``step_time`` change (``speedup`` cancels
what slows a round's cases alike, not load that hits one case's launches and spares
``single``'s). With 2 or 3 launches a side the t quantile is large (12.7 at 1 degree of
freedom, about 2.8 at 4), so the intervals are wide and only a change well beyond the
launch-to-launch spread is called; 1-launch runs get the narrower, over-confident bootstrap
interval. On a CPU shared with other jobs, wall-clock step times swing several-fold; the
output flags a run whose steps spread widely as measured on a busy machine. Per-step CPU
time, which contention barely moves, is the metric that would make the gate hold there
(recorded in steps.csv's ``cpu_time_s``, not gated on yet); a case whose row names
``contention`` is flagged too.

Reads run folders through ``bench_lib.compare.runs`` (which also refuses two runs from
different hardware); the store of baselines by hardware is
``bench_lib.compare.baseline``, the command's output ``bench_lib.compare.output``; the
same-job gate's verdicts, paired by round, ``bench_lib.compare.paired``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from bench_lib.analysis.stats import welch_log_change
from bench_lib.compare.runs import CompareError, Launches, Run, Samples
from bench_lib.exit_codes import EXIT_NOT_OK, EXIT_OK

DEFAULT_THRESHOLD_PCT = 10.0
CONFIDENCE = 0.95
RESAMPLES = 4000
MIN_LAUNCHES_FOR_WELCH = 2
METHOD_WELCH = "welch over launches"
METHOD_BOOTSTRAP = "bootstrap over steps (1 launch: launch-to-launch spread not included)"
METRICS = ("auto", "step_time", "speedup")


# ---- statistics -------------------------------------------------------------------------


def boot_medians(values: Samples, rng: np.random.Generator) -> Samples:
    """RESAMPLES bootstrap medians of ``values``."""
    idx = rng.integers(0, values.size, size=(RESAMPLES, values.size))
    return np.median(values[idx], axis=1)


def boot_mean_log_median(launches: Launches, rounds: list[int],
                         rng: np.random.Generator) -> Samples:
    """RESAMPLES bootstrap values of the mean over ``rounds`` of the log launch median,
    each launch's steps resampled on their own (the fallback's statistic)."""
    logs = [np.log(boot_medians(launches[r], rng)) for r in rounds]
    return np.asarray(np.mean(logs, axis=0), dtype=np.float64)


@dataclass(frozen=True)
class Change:
    """A relative change (+0.15 = 15% slower) with its confidence interval and its method."""

    metric: str
    value: float
    ci_low: float
    ci_high: float
    method: str = METHOD_WELCH
    """METHOD_WELCH or METHOD_BOOTSTRAP: what the interval covers."""
    n_base: int = 0
    """Launches (step_time) or rounds (speedup) behind the baseline's side."""
    n_cand: int = 0
    """The same on the candidate's side."""

    @classmethod
    def of(cls, metric: str, point: float, boot: Samples, n_base: int = 1,
           n_cand: int = 1) -> Change:
        """The change ``point`` with the central CONFIDENCE interval of its bootstrap."""
        alpha = (1 - CONFIDENCE) / 2
        low, high = np.quantile(boot, [alpha, 1 - alpha])
        return cls(metric, float(point), float(low), float(high), METHOD_BOOTSTRAP,
                   n_base, n_cand)

    @classmethod
    def welch(cls, metric: str, base: list[float], cand: list[float]) -> Change:
        """The change of geometric means of per-launch (per-round) figures, Welch on logs."""
        point, low, high = welch_log_change(base, cand, CONFIDENCE)
        return cls(metric, point, low, high, METHOD_WELCH, len(base), len(cand))

    @property
    def half_width(self) -> float:
        """Half the interval's width, in the change's units (0.05 = 5 points)."""
        return (self.ci_high - self.ci_low) / 2

    def verdict(self, threshold: float) -> str:
        """regression / improvement only when beyond the threshold and significant."""
        if self.value > threshold and self.ci_low > 0:
            return "regression"
        if self.value < -threshold and self.ci_high < 0:
            return "improvement"
        return "unchanged"


def _log_medians(run: Run, case_id: str, rounds: list[int]) -> npt.NDArray[np.float64]:
    """The log launch medians of ``case_id`` in ``rounds``."""
    medians = run.launch_medians(case_id)
    return np.log(np.asarray([medians[r] for r in rounds], dtype=np.float64))


def step_time_change(base: Run, cand: Run, case_id: str, rng: np.random.Generator) -> Change:
    """The case's step time, candidate over baseline: Welch over launches, or the bootstrap
    over steps where a side has 1 launch."""
    rb, rc = list(base.launches[case_id]), list(cand.launches[case_id])
    lb, lc = _log_medians(base, case_id, rb), _log_medians(cand, case_id, rc)
    if min(len(rb), len(rc)) >= MIN_LAUNCHES_FOR_WELCH:
        return Change.welch("step_time", np.exp(lb).tolist(), np.exp(lc).tolist())
    point = math.expm1(float(lc.mean() - lb.mean()))
    boot = np.expm1(boot_mean_log_median(cand.launches[case_id], rc, rng)
                    - boot_mean_log_median(base.launches[case_id], rb, rng))
    return Change.of("step_time", point, boot, len(rb), len(rc))


def speedup_change(base: Run, cand: Run, case_id: str, single: str,
                   rng: np.random.Generator) -> Change | None:
    """The case's time over its run's ``single``, candidate over baseline, per round r the
    ratio case_r / single_r of launch medians (rounds both ran): Welch over the two runs'
    rounds, or the bootstrap over steps where a side has 1 round. None without a common
    round on a side."""
    rb, rc = base.common_rounds(case_id, single), cand.common_rounds(case_id, single)
    if not rb or not rc:
        return None
    xb = _log_medians(base, case_id, rb) - _log_medians(base, single, rb)
    xc = _log_medians(cand, case_id, rc) - _log_medians(cand, single, rc)
    if min(len(rb), len(rc)) >= MIN_LAUNCHES_FOR_WELCH:
        return Change.welch("speedup", np.exp(xb).tolist(), np.exp(xc).tolist())
    point = math.expm1(float(xc.mean() - xb.mean()))
    boot_b = (boot_mean_log_median(base.launches[case_id], rb, rng)
              - boot_mean_log_median(base.launches[single], rb, rng))
    boot_c = (boot_mean_log_median(cand.launches[case_id], rc, rng)
              - boot_mean_log_median(cand.launches[single], rc, rng))
    return Change.of("speedup", point, np.expm1(boot_c - boot_b), len(rb), len(rc))


def changes(base: Run, cand: Run, case_id: str, seed: int = 0) -> dict[str, Change]:
    """The case's step_time change and, where both runs have a ``single``, its speedup change."""
    rng = np.random.default_rng(seed)
    out = {"step_time": step_time_change(base, cand, case_id, rng)}
    bs, cs = base.single_of(case_id), cand.single_of(case_id)
    if bs and cs and bs != case_id and bs == cs:
        speedup = speedup_change(base, cand, case_id, bs, rng)
        if speedup is not None:
            out["speedup"] = speedup
    return out


# ---- verdicts ---------------------------------------------------------------------------


@dataclass
class CaseResult:
    """One matched case: its medians, its changes and the verdict with the metric behind it."""

    case_id: str
    strategy: str
    base_median_s: float | None
    cand_median_s: float | None
    changes: dict[str, Change] = field(default_factory=dict)
    verdict: str = "unchanged"
    """regression, improvement, unchanged, broken (ran in baseline, failed now), or n/a."""
    by: str = ""
    """The metric that gave the verdict, or why there is none."""


def judge(changes_: dict[str, Change], metric: str, threshold: float) -> tuple[str, str]:
    """The case's verdict and the metric behind it, by the rule in the module docstring."""
    if metric == "auto":
        metric = "speedup" if "speedup" in changes_ else "step_time"
    if metric not in changes_:
        return "n/a", "no speedup: single itself, or no single in both runs"
    return changes_[metric].verdict(threshold), metric


def compare_runs(base: Run, cand: Run, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                 metric: str = "auto") -> list[CaseResult]:
    """Verdicts for every case the two runs share."""
    if metric not in METRICS:
        raise CompareError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
    if not threshold_pct >= 0:
        raise CompareError(f"threshold must be a percentage >= 0, got {threshold_pct}")
    shared = [cid for cid in cand.cases if cid in base.cases]  # the run's order: single first
    results = []
    for cid in shared:
        strategy = str(cand.cases[cid]["strategy"])
        in_b, in_c = cid in base.launches, cid in cand.launches
        if in_b and in_c:
            ch = changes(base, cand, cid)
            verdict, by = judge(ch, metric, threshold_pct / 100)
            results.append(CaseResult(cid, strategy, base.median_s(cid), cand.median_s(cid),
                                      ch, verdict, by))
        elif in_b:
            status = cand.cases[cid]["status"]
            results.append(CaseResult(cid, strategy, base.median_s(cid), None,
                                      verdict="broken", by=f"candidate status {status}"))
    if not results:
        raise CompareError(
            f"no matching cases: {base.path} and {cand.path} share no case that ran in both "
            f"(baseline cases: {', '.join(sorted(base.cases)) or 'none'})")
    return results


def exit_code(results: list[CaseResult]) -> int:
    """1 when any case regressed or broke, else 0."""
    return EXIT_NOT_OK if any(r.verdict in ("regression", "broken")
                              for r in results) else EXIT_OK
