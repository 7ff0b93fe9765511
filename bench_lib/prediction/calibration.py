"""The runner's side of a workload's calibration: which batch sizes to time, one launch of
``prediction.calibration_worker`` on every device of the rig (forked by the run's fork server, with
a timeout, its ranks killed as a group), its ranks' files combined into one
``prediction.calibration_data.Calibration``, and the line that says what it measured
(``describe_calibration``). The run's predictions from it: ``prediction.predictor``.

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
(``calibration_timing.CUDA_RULE``, which states what a calibration should cost on an H100).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_lib.math_modes import DEFAULT_MATH_MODE
from bench_lib.prediction.calibration_data import BatchCosts, Calibration, Sizes
from bench_lib.prediction.step_time import calibration_sizes
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig

if TYPE_CHECKING:
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.sweep.cases import Case

CALIBRATION_MODULE = "bench_lib.prediction.calibration_worker"
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
    from bench_lib.prediction.case_shape import shape_of

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
    from bench_lib.launch.ranks import launch_ranks, log_tail
    from bench_lib.processes.supervision import kill_group, supervise

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
    cal = calibration_from_ranks(ranks, ended - start)
    shutil.rmtree(workdir, ignore_errors=True)
    return replace(cal, parts_s=parts_of(ranks[0], start, ended))


def calibration_from_ranks(ranks: list[Mapping[str, Any]], wall_s: float) -> Calibration:
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
