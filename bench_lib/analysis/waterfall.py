"""Where the ideal N-fold speedup goes: a case's measured step cut into the step's parts
(``analysis.step_parts``: one list, one definition each), and the remainder that none of
them explains.

The waterfall is the parts' *measured* column (``run.case_parts`` reads its figures off the
case and the run) beside the measured step::

    measured = ideal + batch + optimizer + corun + imbalance + bubble + comm + own + remainder

Every part but three is a figure measured without the case: single's batch curve and its
optimizer step alone, the collective micro-benchmark's fits, the calibration's copy rate,
the schedule's replay (``analysis.bound.simulate``). The devices' compute side by side (S:
ddp's no_sync steps, a traced step's passes), the busiest device's passes and the work
between passes are read off the case's own steps without communication and its traced step
(scaled to its median step, ``run.case_bound.traced_parts``). The remainder is what no
part explains: contention between workers that share a machine, scheduling, what the
parts' own noise hides. A remainder beyond ``UNEXPLAINED`` of the step is said in the note.
Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench_lib.analysis.step_parts import PARTS as STEP_PARTS
from bench_lib.analysis.step_parts import Figures, StepParts, parts

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
