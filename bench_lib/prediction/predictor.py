"""A run's step-time predictions (``Predictor``): each workload's calibration obtained once
(launched by ``prediction.calibration``, read back from the run folder's calibration.json, or
reused from ``run --calibration``: ``prediction.calibration_file``), the cases predicted from it
(``prediction.step_time``), and the prediction's columns of a case's row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.analysis.collective_fits import Collectives
from bench_lib.prediction.calibration import CalibrationKey, calibrate, sizes_for
from bench_lib.prediction.calibration_data import Calibration
from bench_lib.prediction.calibration_file import (
    GivenCalibrations,
    hardware_id,
    read_calibrations,
    write_calibrations,
)
from bench_lib.results.schema import CALIBRATION_FILE
from bench_lib.rig import Rig

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.sweep.cases import Case


class Predictor:
    """A run's step-time predictions: each workload calibrated once, as its first case is
    about to be predicted, at the sizes every case of the sweep needs (``sizes_for``), and
    recorded in the run folder's ``calibration.json`` as it is measured (a resumed run
    reads it back instead of measuring again).

    ``on_calibrate``: told (key, seconds, result) after each calibration, for progress.
    """

    def __init__(self, cases: Iterable[Case], rig: Rig, run_dir: Path,
                 collectives: Collectives | None, server: ForkServer | None = None,
                 on_calibrate: Callable[[CalibrationKey, Calibration | str], None] | None = None,
                 given: GivenCalibrations | None = None,
                 ) -> None:
        self.rig, self.run_dir, self.collectives = rig, run_dir, collectives
        self.server, self.on_calibrate = server, on_calibrate
        self.sizes = sizes_for(cases, rig)
        self.hardware = hardware_id(rig)
        self.found: dict[CalibrationKey, Calibration | str] = {}
        self.reused: list[CalibrationKey] = []
        """The workloads whose calibration came from ``--calibration``, not this run."""
        self.reused_from = ""
        if given is not None:  # run --calibration: each workload it measured every size of
            source, calibrations = given
            self.reused = [k for k, c in calibrations.items()
                           if k in self.sizes and c.covers(self.sizes[k])]
            self.found.update({k: calibrations[k] for k in self.reused})
            self.reused_from = str(source)
        self.found.update(read_calibrations(run_dir / CALIBRATION_FILE))
        if self.found:  # the run folder says what its predictions came from from the start
            self._write()

    def _write(self) -> None:
        found = self.collectives  # reused with the calibrations (``given_collectives``)
        write_calibrations(self.run_dir / CALIBRATION_FILE, self.found, self.hardware,
                           self.reused_from,
                           found.as_dict() if found is not None and not found.skipped else None)

    def calibration(self, case: Case) -> Calibration | str:
        key = CalibrationKey.of(case)
        if key not in self.found:
            sizes = self.sizes.get(key)
            if sizes is None:
                return "no prediction: the case was not planned to run"
            self.found[key] = calibrate(key, sizes, self.rig, self.run_dir / ".work",
                                        self.server)
            self._write()
            if self.on_calibrate is not None:
                self.on_calibrate(key, self.found[key])
        return self.found[key]

    def copies(self, case: Case) -> Mapping[int, float] | None:
        """The copy rate ``case``'s workload's calibration timed (``Calibration.copies``),
        or None where it has none; never calibrates (the rows ask after the launches)."""
        cal = self.found.get(CalibrationKey.of(case))
        return None if cal is None or isinstance(cal, str) else cal.copies

    def cut(self, case: Case) -> str:
        """The cut ``case``'s first launch runs (``predict_pipeline.calibrated_cut``), or ""
        (the case profiles its blocks itself)."""
        from bench_lib.prediction.pipeline_time import calibrated_cut

        cal = self.calibration(case)
        try:
            return calibrated_cut(case, self.rig, None if isinstance(cal, str) else cal)
        except Exception:  # the case chooses its own cut, as it would without a predictor
            return ""

    def predict(self, case: Case) -> tuple[Bound | str, Bound | str]:
        """``case``'s predicted step, and its workload's single's (for the speedup)."""
        from bench_lib.prediction.case_shape import Shape, shape_of
        from bench_lib.prediction.step_time import predict, predict_case, predicted_parts

        cal = self.calibration(case)
        if isinstance(cal, str):
            why = cal if cal.startswith("no prediction") else f"no prediction: {cal}"
            return why, why
        single = predict(Shape("single", case.workload_batch, device_batch=case.workload_batch),
                         cal)
        try:
            found = predict_case(case, self.rig, cal, self.collectives)
            if isinstance(found, str):
                return found, single
            parts = predicted_parts(shape_of(case, self.rig), cal, found)
            return replace(found, parts=None if isinstance(parts, str) else parts), single
        except Exception as e:  # a prediction is never worth the case's measurement
            return f"no prediction: {type(e).__name__}: {e}"[:300], single


def prediction_columns(case_batch: int, workload_batch: int, predicted: Bound | str,
                       single: Bound | str, measured_s: float | None) -> dict[str, Any]:
    """``step_time_s_predicted``, ``speedup_predicted``, ``prediction_error_pct`` (where
    the case was measured) and ``prediction_note`` (the prediction's parts, or why there is
    none)."""
    from bench_lib.prediction.step_time import error_pct, speedup

    if isinstance(predicted, str):
        return {"prediction_note": predicted}
    cols: dict[str, Any] = {"step_time_s_predicted": predicted.step_s,
                            "prediction_note": predicted.note()}
    if predicted.parts is not None:
        cols |= predicted.parts.columns("predicted")
    if not isinstance(single, str):
        cols["speedup_predicted"] = speedup(predicted.step_s, case_batch, single.step_s,
                                            workload_batch)
    if measured_s:
        cols["prediction_error_pct"] = error_pct(predicted.step_s, measured_s)
    return cols
