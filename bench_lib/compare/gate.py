"""Baseline vs candidate: per-case verdicts that stay right on a noisy, shared machine.

Two metrics per case, both as a relative change where + means slower:

* ``step_time``: the candidate's median step time over the baseline's. A step's time is the
  slowest rank's. Sensitive to everything, machine drift included.
* ``speedup``: the case's step time relative to the ``single`` case of the same workload in
  the same run, candidate over baseline (the inverse change of its speedup over ``single``).
  A machine that got uniformly slower between the two runs cancels out.

Each change has a percentile-bootstrap confidence interval of the ratio of medians (every
sample resampled independently). A metric says *regression* only when its change is beyond
the threshold AND its interval lies wholly above zero (asv's rule: a factor and a significant
difference); *improvement* likewise below; otherwise *unchanged*.

The rule that turns metrics into a case's verdict (``metric="auto"``):

* ``single`` cases (and cases whose run lacks a ``single``) are judged on ``step_time``: a
  slowdown that hits every strategy alike shows there, once, however it came about.
* every other case is judged on ``speedup``: a change that hits one strategy shows there even
  when the machine drifted, and a uniform slowdown is not reported N times over.

One pair of runs cannot tell a uniformly slower machine from code that made every strategy
uniformly slower (a torch upgrade): both fail ``single``'s step time. The table says so.

Runs are compared on the same hardware only (env.json's ``fingerprint``: rig, device names,
CPU model, cores, CPU topology), unless allowed otherwise. Software (torch, torchvision,
CUDA, cuDNN, NCCL, driver, python: env.json's ``versions``) may differ: the verdict is still
given, and the differences are noted beside it.

Limits: the intervals cover step-to-step noise within each run, not a change of load between
runs. On a CPU shared with other jobs, wall-clock step times swing several-fold between runs
(and between cases of one run, which the speedup metric cannot cancel); the output flags a run
whose steps spread widely as measured on a busy machine. Per-step CPU time, which contention
barely moves, is the metric that would make the gate hold there (recorded in steps.csv's
``cpu_time_s``, not gated on yet); a case whose row names ``contention`` is flagged too.

Reads run folders through ``bench_lib.results.read``; the store of baselines by hardware is
``bench_lib.compare.baseline``, the command's output ``bench_lib.compare.output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench_lib.measure.timing import slowest_per_step
from bench_lib.results.read import read_cases, read_env, read_steps
from bench_lib.results.schema import ResultsError

DEFAULT_THRESHOLD_PCT = 10.0
CONFIDENCE = 0.95
RESAMPLES = 4000
METRICS = ("auto", "step_time", "speedup")
WORKLOAD_KEYS = ["model", "image_size", "batch_size", "precision", "loss"]
EXIT_OK, EXIT_REGRESSION, EXIT_UNUSABLE = 0, 1, 2
SOFTWARE_KEYS = ("torch", "torchvision", "cuda", "cudnn", "nccl", "driver", "python")
"""env.json ``versions`` that differ between runs without making them different hardware:
reported beside the verdict, never a reason to refuse one."""

Samples = npt.NDArray[np.float64]
"""One case's step times in seconds, a step's time being its slowest rank's."""


class CompareError(ValueError):
    """Input that cannot be compared: reported with exit code 2."""


@dataclass(frozen=True)
class Run:
    """A run folder's ok cases and their per-step samples (slowest rank per step)."""

    path: Path
    env: dict[str, Any]
    cases: dict[str, dict[str, Any]]
    """case_id -> its cases.csv row, every status."""
    samples: dict[str, Samples]
    """case_id -> step times in seconds, for ok cases."""

    def single_of(self, case_id: str) -> str | None:
        """The ``single`` case of the same workload, if this run has one that ran."""
        row = self.cases[case_id]
        for cid, other in self.cases.items():
            if (other["strategy"] == "single" and cid in self.samples
                    and all(other[k] == row[k] for k in WORKLOAD_KEYS)):
                return cid
        return None


def run_dir_of(path: Path) -> Path:
    """A run folder from a folder or a file inside it (cases.csv)."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path} does not exist")
    return path if path.is_dir() else path.parent


def step_samples(run_dir: Path) -> dict[str, Samples]:
    """Per case, the time of each timed step from steps.csv: the slowest rank's.

    The rule is ``bench_lib.measure.timing.slowest_per_step``, the one the runner applies;
    ranks that timed different numbers of steps make the run unusable (``CompareError``).
    """
    try:
        steps = read_steps(run_dir)
    except ResultsError as e:
        raise CompareError(str(e)) from None
    out: dict[str, Samples] = {}
    for case_id, case in steps.groupby("case_id", sort=True):
        per_rank: dict[int, list[float]] = {}
        try:
            ordered = case.sort_values(["rank", "step"], kind="stable")
            for rank, seconds in zip(ordered["rank"].astype(int).tolist(),
                                     ordered["step_time_s"].astype(float).tolist(), strict=True):
                per_rank.setdefault(rank, []).append(seconds)
            out[str(case_id)] = np.asarray(slowest_per_step(per_rank), dtype=np.float64)
        except (ValueError, TypeError) as e:  # unequal ranks, or a word where a number goes
            raise CompareError(f"{run_dir / 'steps.csv'}, case {case_id}: {e}") from None
    return out


def load_run(path: Path) -> Run:
    """Read a run folder (or its cases.csv) for comparison."""
    run_dir = run_dir_of(path)
    try:
        env = read_env(run_dir)
        df = read_cases(run_dir)
    except ResultsError as e:
        raise CompareError(str(e)) from None
    cases = {str(r["case_id"]): {str(k): v for k, v in r.items()}
             for r in df.astype(object).to_dict("records")}
    samples = step_samples(run_dir)
    ok = {cid: samples[cid] for cid, r in cases.items()
          if r["status"] == "ok" and len(samples.get(cid, ())) >= 2}
    return Run(run_dir, env, cases, ok)


# ---- statistics -------------------------------------------------------------------------


def boot_medians(values: Samples, rng: np.random.Generator) -> Samples:
    """RESAMPLES bootstrap medians of ``values``."""
    idx = rng.integers(0, values.size, size=(RESAMPLES, values.size))
    return np.median(values[idx], axis=1)


@dataclass(frozen=True)
class Change:
    """A relative change (+0.15 = 15% slower) with its bootstrap confidence interval."""

    metric: str
    value: float
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, metric: str, point: float, boot: Samples) -> Change:
        """The change ``point`` with the central CONFIDENCE interval of its bootstrap."""
        alpha = (1 - CONFIDENCE) / 2
        low, high = np.quantile(boot, [alpha, 1 - alpha])
        return cls(metric, float(point), float(low), float(high))

    def verdict(self, threshold: float) -> str:
        """regression / improvement only when beyond the threshold and significant."""
        if self.value > threshold and self.ci_low > 0:
            return "regression"
        if self.value < -threshold and self.ci_high < 0:
            return "improvement"
        return "unchanged"


def changes(base: Run, cand: Run, case_id: str, seed: int = 0) -> dict[str, Change]:
    """The case's step_time change and, where both runs have a ``single``, its speedup change."""
    rng = np.random.default_rng(seed)
    b, c = base.samples[case_id], cand.samples[case_id]
    bb, cb = boot_medians(b, rng), boot_medians(c, rng)
    out = {"step_time": Change.of("step_time", float(np.median(c) / np.median(b) - 1),
                                  cb / bb - 1)}
    bs, cs = base.single_of(case_id), cand.single_of(case_id)
    if bs and cs and bs != case_id and bs == cs:
        b1, c1 = base.samples[bs], cand.samples[cs]
        point = float((np.median(c) / np.median(c1)) / (np.median(b) / np.median(b1)) - 1)
        boot = (cb / boot_medians(c1, rng)) / (bb / boot_medians(b1, rng)) - 1
        out["speedup"] = Change.of("speedup", point, boot)
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


def hardware_of(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint's hardware keys: without the software ones that env.json files written
    before the fingerprint named hardware only still carry (torch, driver)."""
    return {k: v for k, v in fingerprint.items() if k not in SOFTWARE_KEYS}


def software_of(env: dict[str, Any]) -> dict[str, Any]:
    """env.json's software versions (``versions``; an older fingerprint's torch and driver
    where ``versions`` lacks them). A key neither holds is left out, never guessed."""
    versions, fingerprint = env.get("versions") or {}, env.get("fingerprint") or {}
    return {k: versions[k] if k in versions else fingerprint[k]
            for k in SOFTWARE_KEYS if k in versions or k in fingerprint}


def software_differences(base: Run, cand: Run) -> list[str]:
    """``torch 2.14.1 -> 2.15.0`` (baseline -> candidate) per software version that differs;
    a version only one run recorded is not compared."""
    sb, sc = software_of(base.env), software_of(cand.env)
    return [f"{k} {sb[k] if sb[k] is not None else 'none'} -> "
            f"{sc[k] if sc[k] is not None else 'none'}"
            for k in SOFTWARE_KEYS if k in sb and k in sc and str(sb[k]) != str(sc[k])]


def check_fingerprints(base: Run, cand: Run, allow_different: bool) -> list[str]:
    """Differences between the two hardware fingerprints; refused unless allowed.

    Software versions are not compared here (``software_differences``): a torch upgrade
    still gets a verdict, with a note beside it.
    """
    fb = hardware_of(base.env.get("fingerprint") or {})
    fc = hardware_of(cand.env.get("fingerprint") or {})
    diffs = [f"{k}: {fb.get(k)!r} vs {fc.get(k)!r}"
             for k in sorted(set(fb) | set(fc)) if fb.get(k) != fc.get(k)]
    if diffs and not allow_different:
        raise CompareError(
            "the two runs come from different hardware, so their absolute times are "
            "not comparable (" + "; ".join(diffs) + "); pass --allow-different-hardware to "
            "compare anyway")
    return diffs


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
        in_b, in_c = cid in base.samples, cid in cand.samples
        if in_b and in_c:
            ch = changes(base, cand, cid)
            verdict, by = judge(ch, metric, threshold_pct / 100)
            results.append(CaseResult(cid, strategy, float(np.median(base.samples[cid])),
                                      float(np.median(cand.samples[cid])), ch, verdict, by))
        elif in_b:
            status = cand.cases[cid]["status"]
            results.append(CaseResult(cid, strategy, float(np.median(base.samples[cid])), None,
                                      verdict="broken", by=f"candidate status {status}"))
    if not results:
        raise CompareError(
            f"no matching cases: {base.path} and {cand.path} share no case that ran in both "
            f"(baseline cases: {', '.join(sorted(base.cases)) or 'none'})")
    return results


def exit_code(results: list[CaseResult]) -> int:
    """1 when any case regressed or broke, else 0."""
    return EXIT_REGRESSION if any(r.verdict in ("regression", "broken")
                                  for r in results) else EXIT_OK
