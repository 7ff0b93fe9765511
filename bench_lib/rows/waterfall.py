"""Where the ideal N-fold speedup goes: a case's measured step cut into the step's parts
(``analysis.step_parts``: one list, one definition each), and the remainder that none of
them explains.

The waterfall is the parts' *measured* column beside the measured step::

    measured = ideal + batch + optimizer + corun + imbalance + bubble + comm + own + remainder

Every part but three is a figure measured without the case: single's batch curve and its
optimizer step alone, the collective micro-benchmark's fits, the calibration's copy rate,
the schedule's replay (``analysis.bound.replay_schedule``). The devices' compute side by side (S:
ddp's no_sync steps, a traced step's passes), the busiest device's passes and the work
between passes are read off the case's own steps without communication and its traced step
(scaled to its median step, ``rows.case_bound.traced_parts``). The remainder is what no
part explains: contention between workers that share a machine, scheduling, what the
parts' own noise hides. A remainder beyond ``UNEXPLAINED`` of the step is said in the note.

This module holds the whole of it: the figures each part is computed from, read off the
case, its run and its bound (``measured_figures``), the arithmetic (``waterfall``) and the
cases.csv columns (``waterfall_columns``); ``report/waterfall_figure.py`` draws them. Where
each measured figure comes from:

- single's curve and optimizer step: the run's ``single`` rows of the same workload;
- S, one device's compute while all compute: ddp's no_sync steps (fsdp: a ddp case's of
  the same local batch), or a traced step's passes per device (the pipelining schedules);
- each device's passes, the schedule's work between them (``step_parts.schedule_work_s``):
  the traced step, scaled to the case's median step (``case_bound.traced_parts``);
- bubble and comm: the case's bound (``rows.case_bound``), priced with the same functions as
  the prediction (the schedule's replay, ``step_parts.exposed_comm_s``);
- own work: FSDP2's copies at the calibration's copy rate (the bound's ``other``), DDP's
  from a ``ddp-1`` case against single (one device: the case's own no_sync steps against
  its full ones), a schedule's from its traced step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bench_lib.analysis import bubble, step_parts
from bench_lib.analysis.bound import PIPELINED, Bound
from bench_lib.analysis.step_parts import PARTS as STEP_PARTS
from bench_lib.analysis.step_parts import Figures, StepParts, parts
from bench_lib.rows.case_bound import traced_scale

if TYPE_CHECKING:
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case

PARTS = (*STEP_PARTS, "remainder")
"""The waterfall's parts in order; ``waterfall_<part>_s`` and ``_pct`` in cases.csv."""
SERIAL_NOTE = "serial: one process runs every stage in turn"
UNEXPLAINED = 0.10
"""A remainder beyond this share of the step is said in the note."""


@dataclass(frozen=True)
class Waterfall:
    """A case's measured step and its measured parts, seconds."""

    measured_s: float
    parts: StepParts
    note: str = ""

    @property
    def remainder_s(self) -> float:
        return self.measured_s - self.parts.total_s

    def part_s(self, part: str) -> float:
        return self.remainder_s if part == "remainder" else self.parts.part_s(part)

    def columns(self) -> dict[str, float | str]:
        """``waterfall_<part>_s`` and ``waterfall_<part>_pct`` (of the measured step), and
        ``waterfall_note``."""
        out: dict[str, float | str] = {}
        for part in PARTS:
            out[f"waterfall_{part}_s"] = self.part_s(part)
            out[f"waterfall_{part}_pct"] = 100 * self.part_s(part) / self.measured_s
        out["waterfall_note"] = self.note
        return out


def waterfall(figures: Figures, measured_s: float) -> Waterfall | str:
    """The measured step cut into ``figures``' parts, with a note: the figures' own notes,
    what the ``own`` part is, and a remainder beyond ``UNEXPLAINED`` of the step; or why
    there is none."""
    found = parts(figures)
    if isinstance(found, str):
        return f"no waterfall: {found}"
    notes = list(figures.notes)
    if found.own_what:
        notes.append(found.own_what)
    share = (measured_s - found.total_s) / measured_s
    if abs(share) > UNEXPLAINED:
        notes.append(f"remainder {share:+.0%} of the step: " + (
            "work no part covers" if share > 0 else "the parts add up to more than the step"))
    return Waterfall(measured_s, found, "; ".join(notes))


NO_DDP1 = "DDP's own work not measured: the run has no ddp-1 case of this workload"


def is_serial(case: Case, rig: Rig) -> bool:
    """One process runs every stage in turn: mp, and ``pipeline`` on a cpu rig."""
    return case.world_size > 1 and (case.strategy == "mp" or (
        case.strategy == "pipeline" and rig.kind == "cpu" and not case.process_group))


def traced_busy_s(outcome: CaseOutcome, median_s: float) -> tuple[float, ...]:
    """Each device's passes in the traced step, scaled to the median step."""
    idle = bubble.idle_by_device(outcome.timeline)
    if not idle:
        return ()
    lo, hi = bubble.span(outcome.timeline)
    scale = traced_scale(outcome, median_s)
    return tuple((1.0 - i) * (hi - lo) * scale for i in idle.values())


def device_compute_s(case: Case, outcome: CaseOutcome, median_s: float, optimizer_s: float,
                     ddp_compute_s: float | None = None) -> float | None:
    """One device's compute a step, mean over devices; None where the case has no such
    measure (no timeline, fsdp without a ddp case). ddp: its no_sync steps; fsdp: a ddp
    case's of the same local batch, less the optimizer step on the parameters it does not
    own; the pipelining schedules: the traced step's passes per device (``traced_busy_s``)
    plus its optimizer share. The waterfall's S and the utilisation check's compute."""
    share = case.optimizer_share
    if case.strategy in ("ddp", "fsdp"):
        measured = outcome.compute_step_s if outcome.compute_step_s is not None \
            else ddp_compute_s if case.strategy == "fsdp" else None
        return None if measured is None else min(measured, median_s) - (1 - share) * optimizer_s
    busy = traced_busy_s(outcome, median_s)
    return statistics.fmean(busy) + share * optimizer_s if busy else None


def measured_figures(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float,
                     curve: Mapping[int, float], optimizer_s: float | None,
                     found: Bound | str | None, ddp_compute_s: float | None = None,
                     ddp_own_s: float | None = None) -> Figures:
    """The figures of ``case``'s measured parts (module docstring). ``found``: its bound
    (or why it has none); ``ddp_own_s``: DDP's own work from the run's ddp-1 case."""
    share, opt = case.optimizer_share, optimizer_s or 0.0
    notes: list[str] = []
    if optimizer_s is None and case.batch_size != case.device_batch_size:
        notes.append("optimizer step not measured: counted with every micro-batch")
    bound = found if isinstance(found, Bound) else None
    if bound is None and isinstance(found, str):
        notes.append(f"bubble, comm and own work unknown ({found})")
    base = Figures(case.world_size, case.batch_size, case.device_batch_size,
                   case.workload_batch, curve, opt, share,
                   comm_s=bound.comm_s if bound else 0.0)
    busy = traced_busy_s(outcome, median_s)
    between = step_parts.schedule_work_s(outcome.timeline) * traced_scale(outcome, median_s)
    if is_serial(case, rig):
        notes.append(f"{SERIAL_NOTE}: the busiest device idles while the others "
                     "compute")
        what = ("the stages' passes beyond single's curve and the work between them: the "
                "serial process's hand-offs" if busy else "")
        return replace(base, serial=True, busy_s=busy, own_s=between, own_what=what,
                       notes=tuple(notes))
    # S: only where every device computes at once in its own process.
    shared = (device_compute_s(case, outcome, median_s, opt, ddp_compute_s)
              if case.process_group and case.world_size > 1 else None)
    if case.strategy in ("ddp", "ddp-1", "fsdp"):
        return _data_parallel(case, outcome, median_s, replace(base, shared_compute_s=shared),
                              bound, ddp_own_s, notes)
    if case.strategy in PIPELINED or (case.strategy == "pipeline" and busy):
        theory = bubble.theory(case.strategy, case.world_size, case.num_microbatches)
        if theory:
            notes.append(f"bubble in theory {theory.describe()}")
        return replace(base, shared_compute_s=shared, busy_s=busy,
                       bubble_s=bound.bubble_s if bound else 0.0, own_s=between,
                       own_what="the schedule's work between passes" if busy else "",
                       notes=tuple(notes))
    return replace(base, notes=tuple(notes))


def _data_parallel(case: Case, outcome: CaseOutcome, median_s: float, base: Figures,
                   bound: Bound | None, ddp_own_s: float | None, notes: list[str]) -> Figures:
    """ddp, ddp-1, fsdp (``base`` has S): own work from ddp-1 or the bound's copies."""
    if case.strategy == "fsdp":
        own = bound.other_s if bound else 0.0
        what = "FSDP2's copies at the calibrated copy rate" if own else \
            "FSDP2's copies not priced: no calibrated copy rate"
    elif case.world_size == 1 and outcome.compute_step_s is not None:
        own = step_parts.ddp_own_s(median_s, outcome.compute_step_s)
        what = "DDP's own work: its full steps over its no_sync steps"
    elif ddp_own_s is not None:
        own, what = ddp_own_s, "DDP's own work: the run's ddp-1 over single"
    else:
        own, what = 0.0, NO_DDP1
    return replace(base, own_s=own, own_what=what, notes=tuple(notes))


def waterfall_columns(case: Case, rig: Rig, outcome: CaseOutcome, row: Mapping[str, Any],
                      curve: Mapping[int, float], optimizer_s: float | None = None,
                      found: Bound | str | None = None, ddp_compute_s: float | None = None,
                      ddp_own_s: float | None = None) -> dict[str, Any]:
    """The case's waterfall (``waterfall``): its measured step cut into the
    measured parts (``measured_figures``); empty for single and a case not ok."""
    median = row.get("step_time_s_median")
    if outcome.status != "ok" or case.strategy == "single" or not median:
        return {}
    figures = measured_figures(case, rig, outcome, float(median), curve, optimizer_s, found,
                               ddp_compute_s, ddp_own_s)
    made = waterfall(figures, float(median))
    return {"waterfall_note": made} if isinstance(made, str) else made.columns()
