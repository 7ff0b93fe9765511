"""FLOP efficiency: training FLOPs per image, and the rig's attainable peak (MFU-style).

Counts come from ``torch.utils.flop_counter`` (matmuls and convolutions; normalisation and
element-wise work are not counted, as in the usual MFU definition). The peak is measured,
not looked up: a large matrix product per device in the workload's precision, on a CPU rig
in a process pinned like a worker with its threads.

    python -m bench_lib.measure.flops RIG_JSON PRECISION[,PRECISION] N MIN_TIME_S  # peak as JSON
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench_lib.rig import Rig, pin_worker, synchronize
from bench_lib.workloads import LossFn, Workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {k: str(v).removeprefix("torch.") for k, v in DTYPES.items()}
# Big enough to reach a device's matmul peak, small enough to measure in about a second.
# (On one EPYC core n=1024 and n=2048 both read 0.111 TFLOP/s; oneDNN's convolutions in
# ResNet50 at 64 px reached ~5% more, so a compute-bound case's MFU can read over 100%.)
PEAK_MATMUL_N = {"cpu": 1024, "cuda": 8192}
PEAK_MIN_TIME_S = 0.5
PEAK_TIMEOUT_S = 300


def count_train_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> int:
    """FLOPs of one forward and backward pass of ``model`` on the batch ``x``."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return int(counter.get_total_flops())


@functools.cache
def train_flops_per_image(model: str, image_size: int) -> float:
    """Training FLOPs (forward + backward) per image of a workload model (cached)."""
    # Two images, not one: BatchNorm in training mode needs more than one value per channel
    # where a small image has shrunk to 1x1. Meta tensors count shapes without computing.
    workload = Workload(model, image_size, batch_size=2)
    with torch.device("meta"):
        net = workload.build_model()
        x = torch.randn(2, 3, image_size, image_size)
        y = torch.randint(0, workload.num_classes, (2,))
    return count_train_flops(net, x, y, workload.loss_fn()) / 2


def matmul_tflop_s(device: torch.device, dtype: torch.dtype, n: int, min_time_s: float) -> float:
    """Best TFLOP/s of an n x n matrix product on ``device``, over at least ``min_time_s``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: kernels picked, memory allocated
    synchronize([device])
    best, spent = float("inf"), 0.0
    while spent < min_time_s or best == float("inf"):
        t0 = time.perf_counter()
        torch.mm(a, b)
        synchronize([device])
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return 2 * n**3 / best / 1e12


def measure_here(rig: Rig, precisions: list[str], n: int | None = None,
                 min_time_s: float = PEAK_MIN_TIME_S) -> dict[str, dict[str, float]]:
    """Attainable TFLOP/s per precision and device, measured in this process."""
    n = n or PEAK_MATMUL_N[rig.kind]
    peaks: dict[str, dict[str, float]] = {}
    for precision in precisions:
        peaks[precision] = {}
        for i in range(rig.num_devices):
            pin_worker(rig, [i])  # on a cpu rig: this worker's cores and threads
            peaks[precision][str(i)] = matmul_tflop_s(rig.device(i), DTYPES[precision], n,
                                                      min_time_s)
    return peaks


@dataclass(frozen=True)
class AttainablePeak:
    """The rig's attainable FLOP/s, measured once per run (env.json ``attainable_peak``)."""

    tflop_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """precision -> device index (as a string) -> TFLOP/s."""
    matmul_n: int = 0
    """Size n of the n x n matrix product that was timed."""
    unsupported: str = ""
    """Why no peak was measured (then ``tflop_s`` is empty)."""

    def of_devices(self, precision: str, world: int) -> float | None:
        """Summed peak of devices 0..world-1 in ``precision``, or None if any is unknown."""
        per_device = self.tflop_s.get(precision, {})
        values = [per_device.get(str(i)) for i in range(world)]
        return sum(v for v in values if v) if values and all(values) else None

    def as_dict(self) -> dict[str, Any]:
        if self.unsupported:
            return {"unsupported": self.unsupported}
        return {"tflop_s": self.tflop_s, "matmul_n": self.matmul_n, "dtype_of": DTYPE_NAMES}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> AttainablePeak:
        if not d:
            return cls(unsupported="not measured")
        return cls(dict(d.get("tflop_s") or {}), int(d.get("matmul_n") or 0),
                   str(d.get("unsupported") or ""))


def measure_peak(rig: Rig, precisions: list[str], n: int | None = None,
                 min_time_s: float = PEAK_MIN_TIME_S) -> AttainablePeak:
    """The rig's attainable peak, measured in a fresh process (so the caller stays unpinned)."""
    n = n or PEAK_MATMUL_N[rig.kind]
    cmd = [sys.executable, "-m", "bench_lib.measure.flops", json.dumps(rig.as_dict()),
           ",".join(precisions), str(n), str(min_time_s)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PEAK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return AttainablePeak(unsupported=f"peak measurement took over {PEAK_TIMEOUT_S} s")
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
        return AttainablePeak(unsupported=f"peak measurement failed: {tail}")
    return AttainablePeak(json.loads(proc.stdout), n)


def main(argv: list[str]) -> int:
    rig = Rig.from_dict(json.loads(argv[0]))
    print(json.dumps(measure_here(rig, argv[1].split(","), int(argv[2]), float(argv[3]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
