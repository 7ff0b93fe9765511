"""What ``python -m bench_lib compare`` prints and writes: a terminal table, Markdown for a
pull-request comment, and github-action-benchmark's ``customBiggerIsBetter`` JSON.

``run_compare`` is the whole command (read, judge, print, write, exit code), given a
``ComparePlan`` (``compare.plan``): ``compare`` and ``run --compare-to`` both build one.
``compare.paired`` (the same-job gate's verdicts) uses its table, verdict line and notes
too. Never imports torch.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from bench_lib.analysis.stats import (
    MIN_LAUNCHES_FOR_CI,
    bootstrap_median_ci,
    launch_interval,
    paired_ratio_interval,
)
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.baseline import resolve_baseline
from bench_lib.compare.plan import ComparePlan
from bench_lib.compare.runs import (
    CompareError,
    Run,
    check_fingerprints,
    load_run,
    software_differences,
)
from bench_lib.exit_codes import EXIT_USAGE
from bench_lib.results.read import number

HEADER = ["case", "base_ms", "cand_ms", "step_time_change_pct [95% CI]",
          "vs_single_change_pct [95% CI]", "verdict (metric)"]


def _pct(change: cmp.Change | None) -> str:
    """``+12.3% [+8.0%, +16.1%]``: a change and its interval."""
    if change is None:
        return "-"
    return f"{change.value:+.1%} [{change.ci_low:+.1%}, {change.ci_high:+.1%}]"


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds; ``-`` for none."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def interval_methods(results: list[cmp.CaseResult]) -> str:
    """How the intervals were had, said once: ``95% intervals: welch over launches, 3 vs 3
    launches (baseline vs candidate)``; where cases differ, each method with its cases.
    (A speedup counts the rounds its case and ``single`` share: the same, bar a failure.)"""
    by_method: dict[str, dict[str, None]] = {}
    counts: dict[str, dict[tuple[int, int], None]] = {}
    for r in results:
        for ch in r.changes.values():
            by_method.setdefault(ch.method, {})[r.case_id] = None
            counts.setdefault(ch.method, {})[(ch.n_base, ch.n_cand)] = None
    if not by_method:
        return "no intervals: no case ran in both runs"

    def said(method: str) -> str:
        ns = ", ".join(f"{b} vs {c}" for b, c in counts[method])
        return f"{method}, {ns} launches (baseline vs candidate)"

    if len(by_method) == 1:
        return f"{cmp.CONFIDENCE:.0%} intervals: {said(next(iter(by_method)))}"
    parts = [f"{said(m)} for {', '.join(cases)}" for m, cases in by_method.items()]
    return f"{cmp.CONFIDENCE:.0%} intervals: " + "; ".join(parts)


def rows(results: list[cmp.CaseResult]) -> list[list[str]]:
    """One row of strings per case, in HEADER's order."""
    return [[r.case_id, _ms(r.base_median_s), _ms(r.cand_median_s),
             _pct(r.changes.get("step_time")), _pct(r.changes.get("speedup")),
             f"{r.verdict} ({r.by})"] for r in results]


# A run whose steps spread more than this (IQR over median) was measured on a busy machine.
BUSY_SPREAD = 0.10


def busy_cases(run: Run) -> list[str]:
    """``case_id spread`` of each case whose step times spread beyond BUSY_SPREAD within
    the run (by case: two precisions of one strategy would read alike by strategy)."""
    spread = {cid: float(np.subtract(*np.percentile(v, [75, 25])) / np.median(v))
              for cid, v in run.samples.items()}
    return [f"{cid} {s:.0%}" for cid, s in spread.items() if s > BUSY_SPREAD]


def contended_cases(run: Run) -> list[str]:
    """``case_id (reason)`` of each case whose row says it ran under contention (the
    ``contention`` column: other processes' CPU or steal over the case, or a single-process
    cpu case that waited for its core), whose times may have doubled without spreading."""
    return [f"{cid} ({reason.strip()})" for cid, row in run.cases.items()
            if isinstance(reason := row.get("contention"), str) and reason.strip()]


def throttled_cases(run: Run) -> list[str]:
    """``case_id (reason)`` of each case whose row says its GPU clocks were held back (the
    ``throttled`` column: power cap, thermal, sync boost... over 10% of its timed window)."""
    return [f"{cid} ({reason.strip()})" for cid, row in run.cases.items()
            if isinstance(reason := row.get("throttled"), str) and reason.strip()]


def software_note(base: Run, cand: Run) -> str | None:
    """The software versions that differ between the runs, said beside the verdict."""
    diffs = software_differences(base, cand)
    if not diffs:
        return None
    return ("software differs from the baseline's (baseline -> candidate): "
            + ", ".join(diffs) + "; the verdict is given all the same, but a change it reports "
            "may come from this software as well as from the code")


MODEL_REGRESSION_POINTS = 10.0
"""A case whose |prediction_error_pct| grew by more than this many points over the
baseline's is named in a note (issue #26: a regression of the model, not a failure)."""


def prediction_regressions(results: list[cmp.CaseResult], base: Run,
                           cand: Run) -> list[str]:
    """``ddp 64 px: 4.1% -> 18.9%`` for each shared case whose step-time prediction error
    grew by more than ``MODEL_REGRESSION_POINTS`` (both runs predicted it)."""
    out = []
    for r in results:
        errors = [number(run.cases.get(r.case_id, {}).get("prediction_error_pct"))
                  for run in (base, cand)]
        if errors[0] is None or errors[1] is None:
            continue
        if abs(errors[1]) - abs(errors[0]) > MODEL_REGRESSION_POINTS:
            out.append(f"{r.case_id}: {errors[0]:+.1f}% -> {errors[1]:+.1f}%")
    return out


def prediction_note(results: list[cmp.CaseResult], base: Run, cand: Run
                    ) -> str | None:
    """The note for ``prediction_regressions``, or None where there are none."""
    if not (grown := prediction_regressions(results, base, cand)):
        return None
    return ("the step-time prediction got worse (|error| grew by more than "
            f"{MODEL_REGRESSION_POINTS:g} points: {', '.join(grown)}): a regression of "
            "the model (prediction/step_time.py, the calibration), not of the code "
            "measured; the verdicts above do not count it")


def notes(results: list[cmp.CaseResult], base: Run, cand: Run) -> list[str]:
    """Plain-language warnings a reader needs to judge the verdicts."""
    out = []
    if software := software_note(base, cand):
        out.append(software)
    for name, run in (("baseline", base), ("candidate", cand)):
        if busy := busy_cases(run):
            out.append(f"the {name} ran on a busy machine (step-time IQR/median: "
                       f"{', '.join(busy)}); its absolute times may have drifted more between "
                       "runs than the intervals show")
        if contended := contended_cases(run):
            out.append(f"the {name} was measured under contention: {'; '.join(contended)}; "
                       "other work held CPU the case was timed on, so its step times may be "
                       "slower than this code on a quiet machine, however narrow the intervals")
        if throttled := throttled_cases(run):
            out.append(f"the {name} was measured with GPU clocks held back: "
                       f"{'; '.join(throttled)}; its step times may be slower than this code "
                       "on GPUs at their full clocks, however narrow the intervals")
    if any(ch.method == cmp.METHOD_BOOTSTRAP for r in results for ch in r.changes.values()):
        out.append("a run measured in 1 launch (--launches 1) gets intervals from its steps "
                   "alone: they leave out how much a fresh launch moves the figure, so they "
                   "are too narrow wherever launches differ; measure in 3 launches or more")
    if grown := prediction_note(results, base, cand):
        out.append(grown)
    singles = [r for r in results if r.by == "step_time" and r.verdict == "regression"]
    speedups = [r for r in results if "speedup" in r.changes]
    if singles and speedups and all(r.changes["speedup"].verdict(0) != "regression"
                                    for r in speedups):
        out.append("single is slower and no strategy lost speedup over it: either the code "
                   "got slower for every strategy (e.g. a torch upgrade) or this machine was "
                   "slower or busier than when the baseline was recorded; rerun to tell")
    return out


def verdict_line(results: list[cmp.CaseResult]) -> str:
    """``FAIL: 1 regression, 3 unchanged`` or ``PASS: ...``."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    word = "FAIL" if cmp.exit_code(results) else "PASS"
    return f"{word}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))


def table(results: list[cmp.CaseResult]) -> str:
    """The terminal table."""
    body = [HEADER, *rows(results)]
    widths = [max(len(row[i]) for row in body) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in body)


def markdown_text(results: list[cmp.CaseResult], base: Run, cand: Run,
                  threshold_pct: float, diffs: list[str]) -> str:
    """Markdown for a pull-request comment: the verdict line, the table, the notes."""
    lines = [f"### parabench regression gate: {verdict_line(results)}", "",
             f"Baseline `{base.path.name}`, candidate `{cand.path.name}`; threshold "
             f"{threshold_pct:g}% and a {cmp.CONFIDENCE:.0%} interval that excludes 0. "
             "Changes are + when slower.", "", f"{interval_methods(results)}.", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    extra = notes(results, base, cand) + [f"compared across different hardware: {d}" for d in diffs]
    if extra:
        lines += [""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def benchmark_json(results: list[cmp.CaseResult], cand: Run,
                   base: Run | None = None) -> list[dict[str, Any]]:
    """github-action-benchmark ``customBiggerIsBetter`` entries: throughput and speedup.

    The throughput is the batch over the candidate's step time (the geometric mean of its
    launch medians), its ``range`` the t interval across launches (the bootstrap interval of
    the median of its steps with 1 launch); the speedup is single's launch median over the
    case's, paired by round, with the t interval across rounds where there are 2 or more.
    Each entry's ``extra`` is the case's verdict with the deciding change, its interval and
    the interval's method, plus the software note where ``base`` ran other software versions.
    """
    software = software_note(base, cand) if base is not None else None
    out: list[dict[str, Any]] = []
    for r in results:
        if r.cand_median_s is None:
            continue
        change = r.changes.get(r.by)
        extra = (f"{r.verdict} ({r.by})"
                 + (f": {_pct(change)}, {change.method}" if change else "")
                 + (f"; {software}" if software else ""))
        batch = float(cand.cases[r.case_id]["batch_size"])
        medians = cand.launch_medians(r.case_id)
        if len(medians) >= MIN_LAUNCHES_FOR_CI:
            step = launch_interval(list(medians.values()))
            low, high = step.low, step.high
        else:
            low, high = bootstrap_median_ci(cand.samples[r.case_id].tolist())
        value = batch / r.cand_median_s
        entry: dict[str, Any] = {"name": f"{r.case_id} throughput", "unit": "img/s",
                                 "value": round(value, 3), "extra": extra}
        if np.isfinite(low) and np.isfinite(high):
            entry["range"] = f"{batch / high:.3f}..{batch / low:.3f}"
        out.append(entry)
        single = cand.single_of(r.case_id)
        if single and single != r.case_id:
            rounds = cand.common_rounds(r.case_id, single)
            if not rounds:
                continue
            singles = cand.launch_medians(single)
            speedup = paired_ratio_interval([singles[k] for k in rounds],
                                            [medians[k] for k in rounds])
            entry = {"name": f"{r.case_id} speedup over single", "unit": "x",
                     "value": round(speedup.point, 4), "extra": extra}
            if speedup.n >= MIN_LAUNCHES_FOR_CI:
                entry["range"] = f"{speedup.low:.4f}..{speedup.high:.4f}"
            out.append(entry)
    return out


def run_compare(plan: ComparePlan) -> int:
    """Gate the plan's candidate against its baseline (a run folder, its cases.csv, or a
    store).

    Prints the table, the notes and the verdict line, writes the Markdown and the
    benchmark JSON where asked, and returns the exit code: 0 no regression, 1 a regression
    or a case that broke, 2 unusable input (said on stderr; nothing is written). Different
    software versions (a torch upgrade) are a note beside the verdict, not unusable input.
    """
    allow = plan.allow_different_hardware
    try:
        cand = load_run(plan.candidate)
        base_dir = resolve_baseline(plan.baseline, cand, allow)
        base = load_run(base_dir)
        diffs = check_fingerprints(base, cand, allow)
        results = cmp.compare_runs(base, cand, plan.threshold_pct, plan.metric)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(table(results))
    print(interval_methods(results))
    for n in notes(results, base, cand) + [f"different hardware: {d}" for d in diffs]:
        print(f"note: {n}")
    print(verdict_line(results))
    if plan.markdown:
        plan.markdown.write_text(markdown_text(results, base, cand, plan.threshold_pct, diffs))
    if plan.json_path:
        plan.json_path.write_text(json.dumps(benchmark_json(results, cand, base), indent=2)
                                  + "\n")
    return cmp.exit_code(results)
