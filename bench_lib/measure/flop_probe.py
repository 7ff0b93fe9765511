"""One device's FLOP peak probe: the process ``flop_peak.measure_peak`` starts per device.

It times every probe, a large matrix product (``gemm``) and a large ResNet-like 3x3
convolution (``conv``, and ``conv-cl`` in channels-last), in every precision, pinned as a
case's rank (a cpu worker's cores and threads), each probe started together with the other
devices' through a file barrier (``FileBarrier``), and prints its figures as JSON.

    python -m bench_lib.measure.flop_probe RIG_JSON PRECISIONS N CONV MIN_TIME_S INDEX \
        BARRIER MODE PARENT_PID

The math mode: the probe sets the run's (MODE, ``Measurement.math_mode``) with the workers'
own ``math_modes.set_math_mode`` before it builds a probe, refuses to report a peak if the
flags change while it probes, and returns the flags and the TF32 environment variables set
(``tf32_env``) with its figures.

Each probe process ties itself to PARENT_PID (the runner's, or the fork server's) before
torch's imports (``lifeline.die_with_parent``): a runner killed with SIGKILL must not leave
a probe holding its device, waiting at the barrier for up to ``PEAK_TIMEOUT_S``.
"""

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 9))

import torch
from torch import nn

from bench_lib.math_modes import DEFAULT_MATH_MODE, math_mode, set_math_mode
from bench_lib.measure.flops import conv_flops
from bench_lib.pinning import pin_worker
from bench_lib.rig import Rig, synchronize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {k: str(v).removeprefix("torch.") for k, v in DTYPES.items()}
# Big enough to reach a device's GEMM peak, small enough to time in about a second.
PEAK_MATMUL_N = {"cpu": 1024, "cuda": 8192}
PEAK_MIN_TIME_S = 0.5
PEAK_TIMEOUT_S = 300
PROBES = ("gemm", "conv", "conv-cl")
TF32_ENV = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
"""Environment variables that act on TF32 beside torch's flags (NVIDIA's libraries use no
TF32 under ``NVIDIA_TF32_OVERRIDE=0``; the other is ATen's cuBLAS override). Workers and the
probe inherit the runner's environment, so they apply to both alike; those set are recorded."""


def tf32_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``TF32_ENV`` variables set in ``environ`` (default: this process's)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in TF32_ENV if k in env}


@dataclass(frozen=True)
class ConvShape:
    """A square stride-1 'same' convolution: ``batch`` x ``channels`` x ``size``^2 images
    through ``channels`` filters of ``kernel`` x ``kernel`` (a ResNet layer's shape)."""

    batch: int
    channels: int
    size: int
    kernel: int = 3

    @property
    def flops(self) -> int:
        """Forward FLOPs: 2*N*Cout*Hout*Wout*Cin*k*k (padding k//2 keeps Hout = size)."""
        return conv_flops(self.batch, self.channels, self.channels, self.size, self.size,
                          self.kernel)

    def as_list(self) -> list[int]:
        return [self.batch, self.channels, self.size, self.kernel]


# CPU: ResNet50 layer3's 3x3 conv (256 channels at 14x14), 15 GFLOP a call (~0.08 s on one
# core). Best of 5 rounds on one Xeon core in fp32: GEMM n=1024 0.19 TFLOP/s, this conv 0.18
# and 0.21 channels-last; 256 channels at 56x56 (more than the caches hold) 0.17 / 0.19.
# CUDA: the same channels at 56x56 and batch 128, 474 GFLOP a call (a few ms).
PEAK_CONV = {"cpu": ConvShape(64, 256, 14), "cuda": ConvShape(128, 256, 56)}


class FileBarrier:
    """``parties`` processes meet at named points through marker files in ``folder``."""

    def __init__(self, folder: Path, parties: int, me: int, timeout_s: float = PEAK_TIMEOUT_S):
        self.folder, self.parties, self.me, self.timeout_s = folder, parties, me, timeout_s

    def post(self, point: str) -> None:
        (self.folder / f"{point}.{self.me}").touch()

    def all_posted(self, point: str) -> bool:
        return all((self.folder / f"{point}.{i}").exists() for i in range(self.parties))

    def wait(self, point: str) -> None:
        """Post ``point`` and wait until every party has (TimeoutError past the timeout)."""
        self.post(point)
        deadline = time.monotonic() + self.timeout_s
        while not self.all_posted(point):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peak probe: not every device reached {point!r}")
            time.sleep(0.001)


def _best_tflop_s(op: Callable[[], object], flops: int, device: torch.device,
                  min_time_s: float, barrier: FileBarrier | None = None,
                  point: str = "") -> float:
    """Best TFLOP/s of ``op`` over at least ``min_time_s``; with a barrier, the timing
    starts with the other devices' and ``op`` keeps running untimed until they are done,
    so no device is ever timed alone."""
    op()  # warm-up: kernels picked (cuDNN autotuning), memory allocated
    synchronize([device])
    if barrier:
        barrier.wait(f"{point}-start")
    best, spent = float("inf"), 0.0
    while spent < min_time_s or best == float("inf"):
        t0 = time.perf_counter()
        op()
        synchronize([device])
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    if barrier:
        barrier.post(f"{point}-done")
        while not barrier.all_posted(f"{point}-done"):
            op()
            synchronize([device])
    return flops / best / 1e12


Probe = tuple[Callable[[], object], int]
"""An operation to time and the FLOPs it does."""


def gemm_probe(device: torch.device, dtype: torch.dtype, n: int) -> Probe:
    """An n x n matrix product."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return (lambda: torch.mm(a, b)), 2 * n**3


def conv_probe(device: torch.device, dtype: torch.dtype, shape: ConvShape,
               channels_last: bool = False) -> Probe:
    """The forward convolution ``shape`` (no bias; inputs need no gradient, so no graph)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape.batch, shape.channels, shape.size, shape.size, device=device,
                    dtype=dtype).contiguous(memory_format=fmt)
    w = torch.randn(shape.channels, shape.channels, shape.kernel, shape.kernel, device=device,
                    dtype=dtype).contiguous(memory_format=fmt)
    pad = shape.kernel // 2
    return (lambda: nn.functional.conv2d(x, w, padding=pad)), shape.flops


PEAK_ROUNDS = 2
"""Each probe is timed in this many rounds, the probes taking turns, so that a slow spell
of a shared machine does not fall on one probe alone; a probe's figure is its best."""


def _check_math_mode(expected: Mapping[str, Any], when: str) -> None:
    """Raise if the math flags now differ from ``expected`` (the workers' mode)."""
    now = math_mode()
    changed = sorted(k for k in expected.keys() | now.keys() if expected.get(k) != now.get(k))
    if changed:
        raise RuntimeError(f"math flags changed {when} ({', '.join(changed)}): the peak would "
                           "not be in the mode the workers train in")


def probe_device(rig: Rig, index: int, precisions: list[str], n: int, conv: ConvShape,
                 min_time_s: float, barrier: FileBarrier | None = None,
                 mode: str = DEFAULT_MATH_MODE) -> dict[str, Any]:
    """Every probe of device ``index`` in every precision, in this process, pinned and in
    the workers' math mode ``mode``; with a barrier, the devices' processes run each probe
    together. Each probe gets ``min_time_s`` in all, over ``PEAK_ROUNDS`` rounds.

    The math mode is set by the workers' own ``set_math_mode`` (TF32 in cuBLAS and cuDNN,
    cuDNN autotuning) before any probe is built; the flags are global to the process, so
    every probe's matmul or convolution computes under them, and they are read back after
    each precision's probes: a change raises instead of giving a peak in another mode."""
    pin_worker(rig, index)  # on a cpu rig: this worker's cores and threads
    if rig.kind == "cuda":
        torch.cuda.set_device(rig.cuda_index(index))
    flags = set_math_mode(mode)
    device = rig.device(index)
    t0 = time.time()
    results: dict[str, dict[str, float]] = {}
    for precision in precisions:
        dtype = DTYPES[precision]
        probes = {"gemm": gemm_probe(device, dtype, n),
                  "conv": conv_probe(device, dtype, conv),
                  "conv-cl": conv_probe(device, dtype, conv, channels_last=True)}
        best = dict.fromkeys(probes, 0.0)
        for r in range(PEAK_ROUNDS):
            for name, (op, flop) in probes.items():
                best[name] = max(best[name], _best_tflop_s(
                    op, flop, device, min_time_s / PEAK_ROUNDS, barrier,
                    f"{precision}-{name}-{r}"))
        _check_math_mode(flags, f"while probing {precision}")
        results[precision] = best
        del probes
    return {"tflop_s": results, "window_unix_s": [t0, time.time()], "math_mode": flags,
            "math_env": tf32_env()}


def measure_here(rig: Rig, precisions: list[str], n: int | None = None,
                 min_time_s: float = PEAK_MIN_TIME_S, conv: ConvShape | None = None,
                 math_mode: str = DEFAULT_MATH_MODE) -> dict[str, dict[str, float]]:
    """Best TFLOP/s per precision and device, each device probed in turn in this process
    (it stays pinned to the last one, in ``math_mode``): for a quick look, not for a run's
    peak."""
    n, conv = n or PEAK_MATMUL_N[rig.kind], conv or PEAK_CONV[rig.kind]
    peaks: dict[str, dict[str, float]] = {p: {} for p in precisions}
    for i in range(rig.num_devices):
        found = probe_device(rig, i, precisions, n, conv, min_time_s,
                             mode=math_mode)["tflop_s"]
        for p in precisions:
            peaks[p][str(i)] = max(found[p].values())
    return peaks


def main(argv: list[str]) -> int:
    rig = Rig.from_dict(json.loads(argv[0]))
    conv = ConvShape(*(int(v) for v in argv[3].split(",")))
    index, folder = int(argv[5]), Path(argv[6])
    barrier = FileBarrier(folder, rig.num_devices, index)
    result = probe_device(rig, index, argv[1].split(","), int(argv[2]), conv, float(argv[4]),
                          barrier, mode=argv[7])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
