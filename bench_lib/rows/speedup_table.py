"""The speedup columns, filled against the ``single`` case of the same workload in the same
run (``SpeedupTable``): the speedup and scaling efficiency of a case, the per-image
efficiency of a batch-curve point, and the columns each fills."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from bench_lib.analysis.stats import LaunchInterval, launch_interval, paired_ratio_interval
from bench_lib.results.cells import Row, finite
from bench_lib.results.schema import launch_medians
from bench_lib.sweep.cases import Case


class SpeedupTable:
    """Fills the speedup columns from the ``single`` case of the same workload in the same
    run (``sweep.expansion.baselines_first`` puts it first): the speedup is single's launch
    medians over the case's, paired by round (``paired_ratio_interval``), with its interval,
    times the case's images per step over single's (1 under strong scaling, the world size
    under weak: a throughput ratio); scaling efficiency is the speedup over the world size.

    A batch-curve point (``Case.curve_of``) gets no speedup: it is compared with the
    ``single`` case of its workload's full batch, per image (``per_image_efficiency``). It
    is kept as the ``single`` of its own batch, which no case of the sweep has (else there
    would be no point): ``single_steps`` gives the curve to the waterfall.
    """

    def __init__(self) -> None:
        self._single: dict[tuple[str, int, int, str, str], list[float]] = {}
        self._steps: dict[tuple[str, int, int, str, str], float] = {}
        """Each ``single`` row's ``step_time_s_median``, by workload key."""

    def seed(self, cases_csv: Path) -> None:
        """Learn the `single` rows a run folder already holds (a resumed run)."""
        if not cases_csv.is_file():
            return
        with cases_csv.open(newline="") as f:
            for r in csv.DictReader(f):
                if r["strategy"] == "single" and r["status"] == "ok" and r["launch_medians_s"]:
                    key = (r["model"], int(r["image_size"]), int(r["batch_size"]),
                           r["precision"], r["loss"])
                    self._single[key] = launch_medians(r["launch_medians_s"])
                    self._learn_step(key, r.get("step_time_s_median"))

    def fill(self, case: Case, row: Row) -> None:
        if row.get("status") != "ok":
            return
        medians = launch_medians(row["launch_medians_s"])
        if case.strategy == "single":
            self._single[case.workload_key] = medians
            self._learn_step(case.workload_key, row.get("step_time_s_median"))
        if case.curve_of is not None:
            full = self._single.get(case.group_key)
            if full:
                rounds = min(len(full), len(medians))
                row |= efficiency_columns(
                    paired_ratio_interval(full[:rounds], medians[:rounds]),
                    case.batch_size / case.curve_of)
            return
        base = self._single.get(case.workload_key)
        if not base:
            return
        rounds = min(len(base), len(medians))
        # Throughput over single's: under weak scaling the case steps through more images.
        images = case.batch_size / case.workload_batch
        speedup = paired_ratio_interval(base[:rounds], medians[:rounds])
        row |= speedup_columns(dataclasses.replace(
            speedup, point=speedup.point * images, low=speedup.low * images,
            high=speedup.high * images), case.world_size)

    def single_step_s(self, case: Case) -> float | None:
        """The median step of the ``single`` case of ``case``'s workload, if known."""
        base = self._single.get(case.workload_key)
        return launch_interval(base).point if base else None

    def _learn_step(self, key: tuple[str, int, int, str, str], step: object) -> None:
        if step not in (None, ""):
            self._steps[key] = float(step)  # type: ignore[arg-type]

    def single_steps(self, case: Case) -> dict[int, float]:
        """single's median step per batch for ``case``'s model, image size, precision and
        loss: its full batch and its batch curve, as far as measured so far."""
        same = (case.model, case.image_size, case.precision, case.loss)
        return {batch: step for (model, image, batch, precision, loss), step in self._steps.items()
                if (model, image, precision, loss) == same}


SPEEDUP_COLUMNS = ("speedup_vs_single", "speedup_ci_low", "speedup_ci_high",
                   "speedup_ci_note", "scaling_efficiency")
"""The columns ``speedup_columns`` fills (``run.merge`` clears them before filling again)."""


EFFICIENCY_COLUMNS = ("per_image_efficiency", "per_image_efficiency_ci_low",
                      "per_image_efficiency_ci_high")
"""The columns ``efficiency_columns`` fills in a batch-curve row."""


def efficiency_columns(step_ratio: LaunchInterval, batch_ratio: float) -> Row:
    """A batch-curve row's per-image efficiency: full-batch single's step over this row's
    (``step_ratio``, paired by round) times this row's batch over the full one."""
    return {
        "per_image_efficiency": step_ratio.point * batch_ratio,
        "per_image_efficiency_ci_low": finite(step_ratio.low * batch_ratio),
        "per_image_efficiency_ci_high": finite(step_ratio.high * batch_ratio),
    }


def speedup_columns(speedup: LaunchInterval, world_size: int) -> Row:
    """The speedup columns of a row from its paired interval (``SPEEDUP_COLUMNS``)."""
    return {
        "speedup_vs_single": speedup.point,
        "speedup_ci_low": finite(speedup.low),
        "speedup_ci_high": finite(speedup.high),
        "speedup_ci_note": speedup.note,
        "scaling_efficiency": speedup.point / world_size,
    }
