"""A run folder's calibration.json: written as each workload is calibrated, read back by a
resumed run, and reused by ``run --calibration`` once it is checked to come from this
machine's hardware and number of devices (``given_calibrations``). Beside the workloads'
calibrations it records the collectives the run measured (``Collectives.as_dict``), which
price ddp's predictions as the calibrations price its compute: a run given the file reuses
them where they were measured for its own sweep (``given_collectives``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench_lib.prediction.calibration import CalibrationKey, devices_of
from bench_lib.prediction.calibration_data import Calibration
from bench_lib.results.schema import CALIBRATION_FILE
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig


def hardware_id(rig: Rig) -> str:
    """This machine's hardware as ``results.fingerprint.fingerprint_id`` names it: what a
    calibration must share with the run that reuses it (``given_calibrations``)."""
    from bench_lib.measure.environment import hardware_fingerprint
    from bench_lib.results.fingerprint import fingerprint_id

    return fingerprint_id(hardware_fingerprint(rig))


def write_calibrations(path: Path, found: Mapping[CalibrationKey, Calibration | str],
                       hardware: str = "", reused_from: str = "",
                       collectives: Mapping[str, Any] | None = None) -> None:
    write_json_atomic(path, {
        "hardware": hardware, **({"reused_from": reused_from} if reused_from else {}),
        **({"collectives": dict(collectives)} if collectives else {}),
        "calibrations": [
            {"key": key.__dict__, **({"failed": cal} if isinstance(cal, str) else cal.as_dict())}
            for key, cal in found.items()]})


def read_calibrations(path: Path) -> dict[CalibrationKey, Calibration | str]:
    """A run folder's calibrations (none where the file is missing)."""
    if not path.is_file():
        return {}
    return _calibrations_of(json.loads(path.read_text()))


def _calibrations_of(data: Mapping[str, Any]) -> dict[CalibrationKey, Calibration | str]:
    """The calibrations of a parsed calibration.json."""
    out: dict[CalibrationKey, Calibration | str] = {}
    for entry in data.get("calibrations", []):
        # A calibration.json from before the mode was recorded was measured in IEEE fp32.
        key = CalibrationKey(**({"math_mode": "ieee"} | entry["key"]))
        out[key] = entry["failed"] if "failed" in entry else Calibration.from_dict(entry)
    return out


GivenCalibrations = tuple[Path, dict[CalibrationKey, Calibration]]
"""``run --calibration``'s file and the calibrations read from it."""


def given_calibrations(path: Path, rig: Rig) -> GivenCalibrations:
    """``run --calibration PATH``: the calibrations of an earlier run on this machine (PATH
    its ``calibration.json`` or its run folder), failed ones left out; ValueError, said for
    the command line, where PATH holds none, cannot be read, or was measured on other
    hardware or on another number of devices (its times would predict nothing here)."""
    file = path / CALIBRATION_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--calibration {path}: no {CALIBRATION_FILE} there (a run whose "
                         "profile sets predict_time, or run --predict, writes one)")
    try:
        data = json.loads(file.read_text())
        found = _calibrations_of(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--calibration {file}: unreadable ({type(e).__name__}: {e})") from e
    here = hardware_id(rig)
    if data.get("hardware") != here:
        raise ValueError(f"--calibration {file}: measured on other hardware ("
                         f"{data.get('hardware') or 'not recorded'}, this machine's rig "
                         f"{rig.label} is {here}); a calibration predicts only the machine it "
                         "timed")
    kept = {k: c for k, c in found.items() if not isinstance(c, str)}
    if other := sorted({c.devices for c in kept.values()} - {devices_of(rig)}):
        raise ValueError(f"--calibration {file}: timed on {other[0]} device(s), this rig has "
                         f"{devices_of(rig)}")
    return file, kept


def given_collectives(given: GivenCalibrations | None) -> dict[str, Any] | None:
    """The collectives recorded beside ``run --calibration``'s calibrations (its file was
    checked by ``given_calibrations``: this hardware, these devices), or None where there
    is no such file or it records none (written before they were, or by a run that
    measured none)."""
    if given is None:
        return None
    try:
        found = json.loads(given[0].read_text()).get("collectives")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) and found.get("ops") else None
