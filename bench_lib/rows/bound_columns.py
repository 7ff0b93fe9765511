"""The columns that set a case's measured step beside what its parts say it could be: its
bound (``rows.case_bound``; ``bound_columns``, or why it has none) and, for a pipeline, the
bubble beside its schedule's theory and the traced step beside the median
(``bubble_columns``)."""

from __future__ import annotations

from collections.abc import Mapping

from bench_lib.analysis import bubble
from bench_lib.analysis.bound import Bound
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.results.cells import Row
from bench_lib.rig import Rig
from bench_lib.rows import case_bound
from bench_lib.sweep.cases import Case


def bubble_columns(case: Case, outcome: CaseOutcome, median_s: float) -> Row:
    """The pipeline bubble per device beside the schedule's theory, and the traced step
    against the median step (``median_s``); empty for strategies that do not pipeline."""
    ideal = bubble.theory(case.strategy, case.world_size, case.num_microbatches)
    if ideal is None:
        return {}
    cols: Row = {"bubble_theory_pct": 100 * ideal.fraction}
    idle = bubble.measured(outcome.timeline)
    if idle is not None:
        lo, hi = bubble.span(outcome.timeline)
        cols |= {"bubble_measured_pct": 100 * idle, "timeline_span_s": hi - lo}
    if outcome.traced_step_s is not None:
        cols |= {"traced_step_s": outcome.traced_step_s,
                 "traced_vs_median_pct": 100 * (outcome.traced_step_s / median_s - 1)}
    return cols


def case_bound_or_why(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float | None,
                      single_s: float | None = None, collectives: Collectives | None = None,
                      ddp_compute_s: float | None = None,
                      copies: Mapping[int, float] | None = None) -> Bound | str | None:
    """The case's bound from its own parts (``rows.case_bound``), why it has none, or None
    (a case not ok, a strategy without a bound). ``single_s``: the same workload's single
    median step (ddp, fsdp); ``collectives``: the run's micro-benchmark;
    ``ddp_compute_s``: for fsdp, a ddp case's measured compute of the same local batch;
    ``copies``: the workload's calibrated copy rate (fsdp's copies)."""
    if outcome.status != "ok" or not median_s:
        return None
    try:
        return case_bound.case_bound(case, rig, outcome, median_s, single_s, collectives,
                                     ddp_compute_s, copies)
    except Exception as e:  # a bound is a derived figure: never worth losing the row for
        return f"no bound: {type(e).__name__}: {e}"


def bound_columns_of(found: Bound | str | None, median_s: float | None) -> Row:
    """``found``'s columns beside the median step: empty for None."""
    if found is None or not median_s:
        return {}
    if isinstance(found, str):
        return {"bound_note": found}
    return {"step_time_s_bound": found.step_s,
            "step_time_s_bound_no_overlap": found.no_overlap_s,
            "efficiency_vs_bound_pct": 100 * found.step_s / median_s,
            "bound_compute_s": found.compute_s, "bound_bubble_s": found.bubble_s,
            "bound_comm_s": found.comm_s, "bound_other_s": found.other_s,
            "bound_note": found.note()}


def bound_columns(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float | None,
                  single_s: float | None = None, collectives: Collectives | None = None,
                  ddp_compute_s: float | None = None,
                  copies: Mapping[int, float] | None = None) -> Row:
    """The bound's columns (``case_bound_or_why``, ``bound_columns_of``)."""
    return bound_columns_of(case_bound_or_why(case, rig, outcome, median_s, single_s,
                                              collectives, ddp_compute_s, copies), median_s)
