"""The runner's side of a workload's calibration: which batch sizes to time, one launch of
``run.calibration_worker`` on every device of the rig (forked by the run's fork server, with
a timeout, its ranks killed as a group), and its ranks' files combined into one
``sweep.calibration_data.Calibration``.

A calibration belongs to a workload's computation (``CalibrationKey``: model, image size,
precision, loss, memory format): the strong and weak workloads of one image size share
one, timed at the union of the sizes their cases need (``sizes_for``). Rank 0 times the
sizes alone while the others wait, then every rank times the "together" sizes at once;
combined, a together step is the slowest rank's (as a data-parallel step waits for its
slowest rank) and a block's time the mean over ranks (as ``partition`` agrees a cut).

Where its wall time goes (``parts_of``, ``Calibration.parts_s``): rank 0 stamps each part's
end (it runs every phase, and waits at the barriers for the others, so its stamps are the
launch's critical path); the runner adds the process start before them and the teardown
after. On a cuda rig each size's passes settle by ``measure.timing``'s rules
(``measure.calibration_timing.CUDA_RULE``, which states what a calibration should cost on an H100).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.analysis.collective_fits import Collectives
from bench_lib.math_modes import DEFAULT_MATH_MODE
from bench_lib.results.schema import CALIBRATION_FILE
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig
from bench_lib.sweep.calibration_data import BatchCosts, Calibration, Sizes
from bench_lib.sweep.predict_time import calibration_sizes

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.sweep.cases import Case

CALIBRATION_MODULE = "bench_lib.run.calibration_worker"
TIMEOUT_S = 300.0
"""A calibration still running after this long is stopped (its cases go unpredicted)."""


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration is of: the computation its cases share."""

    model: str
    image_size: int
    precision: str
    loss: str
    channels_last: bool = False
    math_mode: str = DEFAULT_MATH_MODE
    """The fp32 math mode its steps computed in (``Measurement.math_mode``)."""

    @classmethod
    def of(cls, case: Case) -> CalibrationKey:
        return cls(case.model, case.image_size, case.precision, case.loss, case.channels_last,
                   case.measurement.math_mode)

    def describe(self) -> str:
        cl = ", channels-last" if self.channels_last else ""
        return f"{self.model} {self.image_size} px {self.precision}{cl}"


@dataclass(frozen=True)
class CalibrationSpec:
    """What every rank of a calibration launch is told."""

    key: CalibrationKey
    rig: Rig
    devices: int
    sizes: Sizes

    def write(self, path: Path) -> None:
        write_json_atomic(path, {
            "key": self.key.__dict__, "rig": self.rig.as_dict(), "devices": self.devices,
            "alone": sorted(self.sizes.alone), "together": sorted(self.sizes.together),
            "blocks": sorted(self.sizes.blocks), "copies": sorted(self.sizes.copies)})

    @classmethod
    def read(cls, path: Path) -> CalibrationSpec:
        d = json.loads(path.read_text())
        return cls(CalibrationKey(**d["key"]), Rig.from_dict(d["rig"]), int(d["devices"]),
                   Sizes(frozenset(d["alone"]), frozenset(d["together"]),
                         frozenset(d["blocks"]), frozenset(d.get("copies", ()))))


def result_file(workdir: Path, rank: int) -> Path:
    return workdir / f"calibration{rank}.json"


def sizes_for(cases: Iterable[Case], rig: Rig) -> dict[CalibrationKey, Sizes]:
    """The batch sizes each workload's calibration times: every size its cases to run read
    (``predict_time.calibration_sizes``)."""
    from bench_lib.analysis.step_parts import FRESH_COPY_BYTES
    from bench_lib.sweep.case_shape import shape_of

    out: dict[CalibrationKey, Sizes] = {}
    for case in cases:
        if case.status is not None:
            continue
        key = CalibrationKey.of(case)
        sizes = calibration_sizes(shape_of(case, rig))
        if case.strategy == "fsdp" and case.world_size > 1:
            sizes |= Sizes(copies=frozenset({FRESH_COPY_BYTES}))
        out[key] = out.get(key, Sizes()) | sizes
    return out


def devices_of(rig: Rig) -> int:
    """How many devices compute together in the calibration: every device of the rig (its
    cases use at most that many)."""
    return rig.num_devices


def calibrate(key: CalibrationKey, sizes: Sizes, rig: Rig, work_root: Path,
              server: ForkServer | None = None,
              timeout_s: float = TIMEOUT_S) -> Calibration | str:
    """One calibration launch (module docstring): its ``Calibration``, or why there is
    none (a rank failed, or it ran past ``timeout_s``; its log's last lines)."""
    from bench_lib.processes.supervision import kill_group, supervise
    from bench_lib.run.ranks import launch_ranks, log_tail

    workdir = work_root / (f"calibration_{key.model}_img{key.image_size}_{key.precision}_"
                           f"{key.loss}{'_cl' if key.channels_last else ''}")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    devices = devices_of(rig)
    spec_path = workdir / "spec.json"
    CalibrationSpec(key, rig, devices, sizes).write(spec_path)
    log = workdir / "worker.log"
    start = time.monotonic()
    procs = launch_ranks(spec_path, devices, log, server, module=CALIBRATION_MODULE)
    try:
        stopped = supervise(procs, timeout_s)
    finally:
        kill_group(procs[0].pid)
    files = [result_file(workdir, r) for r in range(devices)]
    if stopped is not None or not all(f.exists() for f in files):
        why = stopped[1] if stopped else (log_tail(log) or "a rank ended without a result")
        return f"calibration of {key.describe()} failed: {why}"
    ranks = [json.loads(f.read_text()) for f in files]
    ended = time.monotonic()
    cal = combine(ranks, ended - start)
    shutil.rmtree(workdir, ignore_errors=True)
    return replace(cal, parts_s=parts_of(ranks[0], start, ended))


def combine(ranks: list[Mapping[str, Any]], wall_s: float) -> Calibration:
    """The ranks' files as one calibration: rank 0's alone; together, the slowest rank's
    step and each block's mean over ranks; each copy the slowest rank's."""
    first = ranks[0]
    together: dict[int, BatchCosts] = {}
    for b in first.get("together", {}):
        costs = [BatchCosts.from_dict(r["together"][b]) for r in ranks]
        n = len(costs)
        together[int(b)] = BatchCosts(
            max(c.step_s for c in costs),
            tuple(sum(v) / n for v in zip(*(c.forward_s for c in costs))),
            tuple(sum(v) / n for v in zip(*(c.backward_s for c in costs))))
    copies = {int(b): max(float(r.get("copies", {})[b]) for r in ranks)
              for b in first.get("copies", {})}
    steps = {str(k): (int(v[0]), int(v[1])) for k, v in first.get("steps", {}).items()}
    return Calibration(float(first["optimizer_s"]),
                       {int(b): BatchCosts.from_dict(c) for b, c in first["alone"].items()},
                       together, len(ranks), wall_s, copies, steps=steps)


def parts_of(rank0: Mapping[str, Any], started_s: float, ended_s: float) -> dict[str, float]:
    """Where a calibration's wall time went, from rank 0's file (its ``main_s`` and each
    part's end, ``stamps``) and the runner's ``time.monotonic()`` as it began (``started_s``:
    its folder made, the ranks requested) and ended (every rank's file read): the process
    start, rank 0's parts, and the teardown; seconds, adding up to the wall time. Empty
    where the rank stamped nothing (a file from before the stamps)."""
    stamps: Sequence[Sequence[Any]] = rank0.get("stamps") or []
    if "main_s" not in rank0 or not stamps:
        return {}
    parts = {"process_start_s": float(rank0["main_s"]) - started_s}
    before = float(rank0["main_s"])
    for name, end in stamps:
        parts[str(name)] = parts.get(str(name), 0.0) + float(end) - before
        before = float(end)
    parts["teardown_s"] = ended_s - before
    return {name: round(s, 4) for name, s in parts.items()}


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
        write_calibrations(self.run_dir / CALIBRATION_FILE, self.found, self.hardware,
                           self.reused_from)

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
        from bench_lib.sweep.predict_pipeline import calibrated_cut

        cal = self.calibration(case)
        try:
            return calibrated_cut(case, self.rig, None if isinstance(cal, str) else cal)
        except Exception:  # the case chooses its own cut, as it would without a predictor
            return ""

    def predict(self, case: Case) -> tuple[Bound | str, Bound | str]:
        """``case``'s predicted step, and its workload's single's (for the speedup)."""
        from bench_lib.sweep.case_shape import Shape, shape_of
        from bench_lib.sweep.predict_time import predict, predict_case, predicted_parts

        cal = self.calibration(case)
        if isinstance(cal, str):
            why = cal if cal.startswith("no prediction") else f"no prediction: {cal}"
            return why, why
        single = predict(Shape("single", case.workload_batch), cal)
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
    from bench_lib.sweep.predict_time import error_pct, speedup

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


def hardware_id(rig: Rig) -> str:
    """This machine's hardware as ``results.fingerprint.fingerprint_id`` names it: what a
    calibration must share with the run that reuses it (``given_calibrations``)."""
    from bench_lib.measure.environment import hardware_fingerprint
    from bench_lib.results.fingerprint import fingerprint_id

    return fingerprint_id(hardware_fingerprint(rig))


def write_calibrations(path: Path, found: Mapping[CalibrationKey, Calibration | str],
                       hardware: str = "", reused_from: str = "") -> None:
    write_json_atomic(path, {
        "hardware": hardware, **({"reused_from": reused_from} if reused_from else {}),
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


def describe_calibration(key: CalibrationKey, cal: Calibration | str) -> str:
    """``calibrated resnet50 64 px fp32 in 11.8 s: alone at 4, 16, 32; together at 4, 8,
    16 (2 devices); blocks at 4``, or why it failed."""
    if isinstance(cal, str):
        return f"{cal}: its cases are not predicted"

    def listed(sizes: Iterable[int]) -> str:
        return ", ".join(map(str, sorted(sizes))) or "-"

    blocks = [b for b, c in cal.together.items() if c.forward_s]
    parts = summary_parts(cal.parts_s)
    where = " (" + ", ".join(f"{name} {s:.1f}" for name, s in parts.items()) + ")" if parts else ""
    return (f"calibrated {key.describe()} in {cal.wall_s:.1f} s{where}: alone at "
            f"{listed(cal.alone)}; together at {listed(cal.together)} ({cal.devices} "
            f"devices); blocks at {listed(blocks)}")


SUMMARY_GROUPS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("start", lambda p: p == "process_start_s"),
    ("CUDA", lambda p: p == "cuda_context_s"),
    ("group", lambda p: p == "process_group_s"),
    ("model", lambda p: p == "model_build_s"),
    ("warm-up", lambda p: p.endswith("_warmup_s")),
    ("timed", lambda p: p.endswith("_timed_s") or p == "optimizer_passes_s"),
    ("blocks", lambda p: p.startswith("blocks_")),
    ("copies", lambda p: p == "copies_s"),
    ("end", lambda p: p in ("finish_s", "teardown_s")),
)
"""The calibration line's groups of ``Calibration.parts_s`` (each part in the first that
takes it; a part none takes, under ``other``)."""


def summary_parts(parts_s: Mapping[str, float]) -> dict[str, float]:
    """``parts_s`` summed into ``SUMMARY_GROUPS``, those present, in their order, seconds."""
    out: dict[str, float] = {}
    for part, seconds in parts_s.items():
        group = next((g for g, takes in SUMMARY_GROUPS if takes(part)), "other")
        out[group] = out.get(group, 0.0) + seconds
    order = [g for g, _ in SUMMARY_GROUPS] + ["other"]
    return {g: out[g] for g in order if g in out}


def sweep_collectives(rig: Rig, quiet: bool, cases: list[Case], server: ForkServer | None,
                      recorded: Mapping[str, Any] | None = None) -> Collectives:
    """The rig's collectives for a sweep's bounds and predictions: as ``recorded`` in
    env.json, else measured now, once per run, up to the largest message of ``cases``
    (``measure.collectives``; skipped where no case is priced with them)."""
    import sys

    from bench_lib.measure import collectives
    from bench_lib.run import case_bound

    if recorded is not None:
        return Collectives.from_dict(recorded)
    largest = case_bound.largest_message(cases, rig)
    if largest is None:
        return Collectives(skipped="no case of the sweep to run is priced with collectives "
                                   "(ddp, fsdp, pipelines)")
    if not quiet:
        print("measuring collectives ...", file=sys.stderr, flush=True)
    found = collectives.measure(rig, collectives.sizes_for(largest), server=server)
    if not quiet:
        print(f"collectives: {found.bandwidth_line()}", file=sys.stderr)
    return found
