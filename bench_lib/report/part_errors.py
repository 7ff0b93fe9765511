"""Where the model of a step is wrong, part by part: each part's predicted value (cases.csv
``predicted_<part>_s``, from the calibration before the case ran) against its measured one
(``waterfall_<part>_s``, from the case's own figures after it), as a share of the measured
step (``step_time_s_median``). ``analysis.step_parts`` defines each part once.

    parts, predicted - measured, % of the step (median, and median |difference|, over 24
    cases): ideal +0.8% |1.1%|, batch +0.3% |0.9%|, optimizer -0.2% |0.4%|, corun -4.1%
    |4.5%| (worst pipeline s2 64 px: -12%), ..., own -6.0% |6.0%| (worst fsdp 96 px: -9%)

Over the ok cases other than single (single's parts are its calibration against its own
curve point: nothing of a strategy's to be wrong about) that have both columns; a run
folder from before the columns gives no lines. Plain rows (cases.csv's records); never
imports torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bench_lib.analysis.step_parts import PARTS
from bench_lib.report.row_values import case_name, is_weak
from bench_lib.results.read import number

NAMED_WORST_PCT = 5.0
"""A part's worst case is named where its difference exceeds this share of its step."""


@dataclass(frozen=True)
class PartError:
    """One part's predicted value against its measured one over a run's cases, % of each
    case's measured step."""

    part: str
    cases: int
    median_pct: float
    """The median of (predicted - measured) / measured step x 100: + = predicted larger."""
    median_abs_pct: float
    """The median of its absolute value."""
    worst_case: str
    """The case with the largest |difference|: ``pipeline s2 64 px``."""
    worst_pct: float
    """Its difference, signed."""


def _where(row: Mapping[str, Any]) -> str:
    weak = " weak" if is_weak(row) else ""
    return f"{case_name(row)} {row.get('image_size')} px{weak}"


def _differences_pct(rows: Iterable[Mapping[str, Any]], part: str
                     ) -> list[tuple[float, Mapping[str, Any]]]:
    """(predicted - measured as % of the step, row) of each row that has both values."""
    out = []
    for r in rows:
        predicted = number(r.get(f"predicted_{part}_s"))
        measured = number(r.get(f"waterfall_{part}_s"))
        step_s = number(r.get("step_time_s_median"))
        if predicted is not None and measured is not None and step_s:
            out.append((100 * (predicted - measured) / step_s, r))
    return out


def part_errors(rows: Iterable[Mapping[str, Any]]) -> list[PartError]:
    """Each part's error over the ok non-single cases with both columns, in ``PARTS``
    order; a part no case has is left out."""
    cases = [r for r in rows if r.get("status") == "ok" and r.get("strategy") != "single"]
    out = []
    for part in PARTS:
        found = _differences_pct(cases, part)
        if not found:
            continue
        worst_pct, worst = max(found, key=lambda d: abs(d[0]))
        diffs = [d for d, _ in found]
        out.append(PartError(part, len(found), statistics.median(diffs),
                             statistics.median(abs(d) for d in diffs), _where(worst),
                             worst_pct))
    return out


def part_error_lines(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The parts' errors in one line (module docstring); empty without both columns."""
    errors = part_errors(rows)
    if not errors:
        return []
    most = max(e.cases for e in errors)
    words = []
    for e in errors:
        fewer = f" over {e.cases}" if e.cases < most else ""
        worst = (f" (worst {e.worst_case}: {e.worst_pct:+.0f}%)"
                 if abs(e.worst_pct) > NAMED_WORST_PCT else "")
        words.append(f"{e.part} {e.median_pct:+.1f}% |{e.median_abs_pct:.1f}%|{fewer}{worst}")
    return ["parts, predicted - measured, % of the step (median, and median |difference|, "
            f"over {most} cases): " + ", ".join(words)]
