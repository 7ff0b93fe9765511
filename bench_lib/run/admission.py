"""Before a case launches: its predicted peak memory against each device's memory.

The runner asks ``Admission`` twice per case: ``refusal`` before its first launch (a case
predicted not to fit is recorded ``oom``, reason "predicted: X MiB > Y MiB", and never
launched, unless the sweep says ``predict_skip = false``: ``--no-predict-skip``) and
``columns`` when its row is written (the prediction, made again with the stage cut the
case ran where its ``balanced`` cut was only profiled in its first launch).

A device's memory is ``--max-memory-per-device`` where given (any rig); else, on a cuda
rig, the GPU's total memory read through NVML (never CUDA: the runner holds no CUDA
context), shared by the device slots of ``--gpu-slots``; a cpu rig without a cap has no
limit, and nothing is refused there. A process that drives several devices (``mp``,
``pipeline`` on a cpu rig: label "0+1") gets their memory summed, as the runner's memory
cap gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_lib.nvml import cuda_visible_gpus, nvml_session
from bench_lib.rig import Rig
from bench_lib.run.protocol import CaseOutcome
from bench_lib.run.rows import by_device
from bench_lib.sweep.cases import Case
from bench_lib.sweep.predict import Prediction, predict

MIB = 2**20
Predictor = Callable[[Case, Rig, str], Prediction]
"""(case, rig, the cut it ran or '') -> its prediction: ``sweep.predict.predict``."""


@dataclass(frozen=True)
class DeviceMemory:
    """The memory each device slot of the rig may use, and where that figure comes from."""

    mib: tuple[float, ...]
    """Per device slot of a node, MiB."""
    source: str
    """``--max-memory-per-device``, or the GPUs' total memory (NVML)."""

    def limit_mib(self, label: str) -> float:
        """The memory of the device(s) a peak label names ("1", or "0+1": summed); across
        nodes a rank's slot on its node (nodes alike)."""
        return sum(self.mib[int(i) % len(self.mib)] for i in label.split("+"))


def device_memory(rig: Rig, cap_mib: float, nvml: Any = None) -> DeviceMemory | None:
    """The rig's device memory (module docstring); None where nothing limits it.

    Raises where a cuda rig's NVML cannot be read (the runner then predicts without
    refusing: ``Admission.of``)."""
    if cap_mib:
        return DeviceMemory((cap_mib,) * rig.num_devices, "--max-memory-per-device")
    if rig.kind != "cuda":
        return None
    gpus = cuda_visible_gpus(nvml)
    with nvml_session(nvml) as nv:
        total = [nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(g.nvml_index)).total
                 / MIB for g in gpus]
    if len(total) < rig.num_gpus:
        raise RuntimeError(f"NVML sees {len(total)} GPU(s) visible to CUDA; the rig has "
                           f"{rig.num_gpus}")
    slots = tuple(total[rig.cuda_index(s)] / rig.gpu_slots for s in range(rig.num_devices))
    return DeviceMemory(slots, "GPU total memory (NVML)" + (
        f" over {rig.gpu_slots} slots" if rig.gpu_slots > 1 else ""))


class Admission:
    """Predicts each case's memory (once per stage cut) and refuses what will not fit."""

    def __init__(self, rig: Rig, memory: DeviceMemory | None,
                 predictor: Predictor = predict, note: str = "") -> None:
        self.rig, self.memory, self._predictor = rig, memory, predictor
        self.note = note
        """Why nothing is refused where a limit was wanted (NVML unreadable), or ''."""
        self._made: dict[tuple[str, str], Prediction | str] = {}

    @classmethod
    def of(cls, rig: Rig, cases: list[Case], nvml: Any = None,
           read_devices: bool = True) -> Admission:
        """The admission of a sweep's cases on ``rig`` (their memory cap is the sweep's).
        ``read_devices=False`` (a dry run, which may plan a rig this machine is not): only
        the cap limits; the GPUs' own memory is not read."""
        cap = max((c.measurement.max_memory_per_device_mib for c in cases), default=0.0)
        if not read_devices and not cap:
            note = ("device memory not read in a dry run: only --max-memory-per-device "
                    "refuses" if rig.kind == "cuda" else "")
            return cls(rig, None, note=note)
        try:
            return cls(rig, device_memory(rig, cap, nvml))
        except Exception as e:  # no NVML: predict, but refuse nothing
            return cls(rig, None, note=f"GPU memory unknown ({type(e).__name__}: {e})")

    def prediction(self, case: Case, cut: str = "") -> Prediction | str:
        """The case's prediction with ``cut`` (cached), or why there is none."""
        key = (case.case_id, cut)
        if key not in self._made:
            try:
                self._made[key] = self._predictor(case, self.rig, cut)
            except Exception as e:  # a model the replay cannot run: the case still runs
                self._made[key] = f"memory not predicted: {type(e).__name__}: {e}"[:300]
        return self._made[key]

    def refusal(self, case: Case) -> str | None:
        """Why ``case`` must not launch (predicted over a device's memory), or None."""
        if self.memory is None or not case.measurement.predict_skip:
            return None
        pred = self.prediction(case)
        if isinstance(pred, str):
            return None
        for label, mib in sorted(pred.mib_by_device.items()):
            limit = self.memory.limit_mib(label)
            if mib > limit:
                return (f"predicted: {mib:.0f} MiB > {limit:.0f} MiB (device {label}, "
                        f"{self.memory.source}; --no-predict-skip launches it)")
        return None

    def columns(self, case: Case, launches: list[CaseOutcome]) -> dict[str, Any]:
        """The row's prediction columns, made with the cut the case's first launch ran."""
        ran = next((o.partition for o in launches if o.partition), "")
        pred = self.prediction(case, ran if ran != self._cut_of(case) else "")
        if isinstance(pred, str):
            return {"note": "; ".join(filter(None, [case.note, pred]))}
        return {"peak_mem_mib_predicted_max": round(pred.max_mib, 1),
                "peak_mem_mib_predicted_by_device": by_device(pred.mib_by_device)}

    def _cut_of(self, case: Case) -> str:
        """The cut an earlier prediction of ``case`` assumed ('' where none was made)."""
        made = self._made.get((case.case_id, ""))
        return made.cut if isinstance(made, Prediction) else ""
