"""FLOP efficiency: training FLOPs per image, and the rig's attainable peak (MFU-style).

Counts come from ``torch.utils.flop_counter`` (matmuls and convolutions; normalisation and
element-wise work are not counted, as in the usual MFU definition). The peak is measured,
not looked up: per device and precision the best of a large matrix product (``gemm``) and a
large ResNet-like 3x3 convolution (``conv``, and ``conv-cl`` in channels-last), in the math
mode the workers train in. On CPUs oneDNN's convolutions beat its GEMM by half again, and on
GPUs cuDNN's convolutions and cuBLAS's GEMMs differ too, so a GEMM alone is not the
attainable peak of a convolutional network.

The math mode: the probe process sets the run's (``Measurement.math_mode``: ``torch`` or
``ieee``) with the workers' own ``math_modes.set_math_mode`` before it builds a probe, refuses to
report a peak if the flags change while it probes, and records the flags (``math_mode``),
the TF32 environment variables set (``math_env``) and, per precision, the mode in words
(``math``). That matters on Ampere and later, where a TF32 convolution runs several times
faster than an IEEE fp32 GEMM: a peak taken in another mode than training's would put an
fp32 MFU far over (or under) its truth.

Every device is probed at once, one process per device, pinned as in a case (a cpu worker's
cores and threads), each probe started together through a file barrier: a CPU worker's peak
then carries the frequency, cache and memory-bandwidth sharing of a real ``ddp`` case.

    python -m bench_lib.measure.flops RIG_JSON PRECISIONS N CONV MIN_TIME_S INDEX BARRIER MODE \
        PARENT_PID

Each probe process ties itself to PARENT_PID (the runner's, or the fork server's) before
torch's imports (``lifeline.die_with_parent``): a runner killed with SIGKILL must not leave
a probe holding its device, waiting at the barrier for up to ``PEAK_TIMEOUT_S``.
"""

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in run.worker)
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 9))

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench_lib.fault_hooks import QUICK_PEAK_ENV
from bench_lib.math_modes import DEFAULT_MATH_MODE, math_mode, set_math_mode
from bench_lib.pinning import pin_worker
from bench_lib.processes.forkserver import ForkServer, parent_pid, start_module
from bench_lib.rig import Rig, synchronize
from bench_lib.workloads import LossFn, Workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {k: str(v).removeprefix("torch.") for k, v in DTYPES.items()}
# Big enough to reach a device's GEMM peak, small enough to time in about a second.
PEAK_MATMUL_N = {"cpu": 1024, "cuda": 8192}
PEAK_MIN_TIME_S = 0.5
QUICK_PEAK_MIN_TIME_S = 0.03
"""The probe's time under the test suite's hook (``fault_hooks.QUICK_PEAK_ENV``)."""
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


def math_mode_label(mode: Mapping[str, Any], precision: str = "fp32",
                    env: Mapping[str, str] | None = None) -> str:
    """In words, the arithmetic of ``precision`` matmuls and convolutions under the math
    flags ``mode`` (``math_modes.math_mode``) and the TF32 environment ``env``."""
    if precision != "fp32":
        return f"{precision} (the fp32 TF32 flags do not apply)"
    if not mode:
        return "fp32 in an unrecorded math mode"
    matmul = "TF32" if mode.get("cuda_matmul_allow_tf32") else "IEEE"
    conv = "TF32" if mode.get("cudnn_allow_tf32") else "IEEE"
    if matmul == conv == "IEEE":
        label = "IEEE fp32 (TF32 off in cuBLAS matmuls and cuDNN convolutions)"
    elif matmul == conv:
        label = "TF32 (on in cuBLAS matmuls and cuDNN convolutions)"
    else:
        label = f"fp32 with {matmul} cuBLAS matmuls and {conv} cuDNN convolutions"
    onednn = {k: v for k, v in (mode.get("fp32_precision") or {}).items()
              if k.startswith("mkldnn") and v not in (None, "none", "ieee")}
    label += "".join(f", oneDNN {k.removeprefix('mkldnn_')} in {v}"
                     for k, v in sorted(onednn.items()))
    if env:
        label += ", with " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))
    return label


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


def conv_flops(batch: int, c_in: int, c_out: int, h_out: int, w_out: int, kernel: int) -> int:
    """Forward FLOPs of a dense 2-d convolution (a multiply and an add per weight tap)."""
    return 2 * batch * c_out * h_out * w_out * c_in * kernel * kernel


def count_train_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> int:
    """FLOPs of one forward and backward pass of ``model`` on the batch ``x``."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return int(counter.get_total_flops())


@functools.cache
def train_flops_per_image(model: str, image_size: int) -> float:
    """Training FLOPs (forward + backward) per image (per sample: ``toy``'s is a vector) of
    a workload model, with its own head, inputs and default loss (cached)."""
    # Two images, not one: BatchNorm in training mode needs more than one value per channel
    # where a small image has shrunk to 1x1. Meta tensors count shapes without computing.
    workload = Workload(model, image_size, batch_size=2)
    meta = torch.device("meta")
    with meta:
        net = workload.build_model()
    x, y = workload.make_batch(2, meta)
    return count_train_flops(net, x, y, workload.loss_fn()) / 2


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


@dataclass(frozen=True)
class AttainablePeak:
    """The rig's attainable FLOP/s, measured once per run (env.json ``attainable_peak``)."""

    tflop_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """precision -> device index (as a string) -> TFLOP/s: the best probe."""
    matmul_n: int = 0
    """Size n of the n x n matrix product that was timed."""
    unsupported: str = ""
    """Why no peak was measured (then ``tflop_s`` is empty)."""
    probe: dict[str, dict[str, str]] = field(default_factory=dict)
    """precision -> device -> the probe that gave the peak: gemm, conv or conv-cl."""
    by_probe: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """precision -> device -> probe -> TFLOP/s: every probe's figure."""
    conv: tuple[int, ...] = ()
    """The probe convolution: batch, channels, image size, kernel (``ConvShape``)."""
    math_mode: dict[str, Any] = field(default_factory=dict)
    """The math flags the probe ran under (``math_modes.math_mode``): the workers' too."""
    window_unix_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    """device -> wall-clock start and end of its probing (they overlap: probed together)."""
    math_env: dict[str, str] = field(default_factory=dict)
    """The TF32 environment variables (``TF32_ENV``) set while probing: the workers' too."""
    slots_per_gpu: int = 1
    """Above 1 in the validation mode (``Rig.gpu_slots``): that many slots probed each GPU
    at once, so a device's figure is a share of its card's peak, not the card's."""

    @property
    def note(self) -> str:
        """Why the figures are not the cards' peaks, or "" where they are."""
        if self.slots_per_gpu <= 1:
            return ""
        return (f"validation run (--gpu-slots {self.slots_per_gpu}): probed by "
                f"{self.slots_per_gpu} slots sharing each GPU at once, so a device's figure "
                "is a share of its card's peak, not a card's peak (cases.csv leaves MFU empty)")

    def math_of(self, precision: str) -> str:
        """In words, the math mode the peak of ``precision`` was measured in."""
        return math_mode_label(self.math_mode, precision, self.math_env)

    def of_devices(self, precision: str, world: int) -> float | None:
        """Summed peak of devices 0..world-1 in ``precision``, or None if any is unknown."""
        per_device = self.tflop_s.get(precision, {})
        values = [per_device.get(str(i)) for i in range(world)]
        return sum(v for v in values if v) if values and all(values) else None

    def probes_of(self, precision: str, world: int) -> list[str]:
        """The winning probe of each of devices 0..world-1 (distinct, in device order)."""
        won = self.probe.get(precision, {})
        return list(dict.fromkeys(won[str(i)] for i in range(world) if str(i) in won))

    def as_dict(self) -> dict[str, Any]:
        if self.unsupported:
            return {"unsupported": self.unsupported}
        record = {"tflop_s": self.tflop_s, "probe": self.probe, "by_probe": self.by_probe,
                  "matmul_n": self.matmul_n, "conv_batch_channels_size_kernel": list(self.conv),
                  "dtype_of": DTYPE_NAMES, "math_mode": self.math_mode,
                  "math_env": self.math_env,
                  "math": {p: self.math_of(p) for p in self.tflop_s},
                  "probed_together": True,
                  "window_unix_s": {k: list(v) for k, v in self.window_unix_s.items()}}
        if self.slots_per_gpu > 1:  # the validation mode: not the cards' peaks, said so
            record |= {"slots_per_gpu": self.slots_per_gpu, "note": self.note}
        return record

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> AttainablePeak:
        if not d:
            return cls(unsupported="not measured")
        return cls(dict(d.get("tflop_s") or {}), int(d.get("matmul_n") or 0),
                   str(d.get("unsupported") or ""), dict(d.get("probe") or {}),
                   dict(d.get("by_probe") or {}),
                   tuple(d.get("conv_batch_channels_size_kernel") or ()),
                   dict(d.get("math_mode") or {}),
                   {k: (v[0], v[1]) for k, v in (d.get("window_unix_s") or {}).items()},
                   dict(d.get("math_env") or {}), int(d.get("slots_per_gpu") or 1))

    @classmethod
    def of_probes(cls, found: dict[str, dict[str, Any]], n: int, conv: ConvShape,
                  slots_per_gpu: int = 1) -> AttainablePeak:
        """The peak from each device's ``probe_device`` result (device -> result), probed by
        ``slots_per_gpu`` slots on each GPU."""
        by_probe: dict[str, dict[str, dict[str, float]]] = {}
        for dev, result in sorted(found.items()):
            for precision, figures in result["tflop_s"].items():
                by_probe.setdefault(precision, {})[dev] = figures
        best = {p: {d: max(f.values()) for d, f in devs.items()} for p, devs in by_probe.items()}
        won = {p: {d: max(f, key=lambda k: f[k]) for d, f in devs.items()}
               for p, devs in by_probe.items()}
        first = found[min(found)]
        return cls(best, n, "", won, by_probe, tuple(conv.as_list()), first["math_mode"],
                   {d: (r["window_unix_s"][0], r["window_unix_s"][1]) for d, r in found.items()},
                   dict(first.get("math_env") or {}), slots_per_gpu)


def measure_peak(rig: Rig, precisions: list[str], n: int | None = None,
                 min_time_s: float | None = None,
                 conv: ConvShape | None = None, server: ForkServer | None = None,
                 math_mode: str = DEFAULT_MATH_MODE) -> AttainablePeak:
    """The rig's attainable peak: one fresh process per device (so the caller stays
    unpinned; forked by the run's ``server`` where given), all started together and
    meeting at a file barrier before each probe, in the run's ``math_mode`` (the cases').
    ``min_time_s`` per probe: default ``PEAK_MIN_TIME_S`` (the test suite's hook shortens
    it: ``QUICK_PEAK_MIN_TIME_S``)."""
    if min_time_s is None:
        quick = os.environ.get(QUICK_PEAK_ENV)
        min_time_s = QUICK_PEAK_MIN_TIME_S if quick else PEAK_MIN_TIME_S
    n, conv = n or PEAK_MATMUL_N[rig.kind], conv or PEAK_CONV[rig.kind]
    spec = ",".join(map(str, conv.as_list()))
    with tempfile.TemporaryDirectory(prefix="parabench-peak-") as folder:
        # Output to files, not pipes: a chatty probe cannot block on a full pipe.
        logs = [(Path(folder) / f"device{i}.out", Path(folder) / f"device{i}.err")
                for i in range(rig.num_devices)]
        parent = str(parent_pid(server))
        procs = [start_module(server, "bench_lib.measure.flops",
                              [json.dumps(rig.as_dict()), ",".join(precisions), str(n), spec,
                               str(min_time_s), str(i), folder, math_mode, parent],
                              out_path, err_path)
                 for i, (out_path, err_path) in enumerate(logs)]
        deadline = time.monotonic() + PEAK_TIMEOUT_S
        try:
            # Poll all: a device that fails leaves the others waiting at the barrier.
            while (codes := [p.poll() for p in procs]) and None in codes:
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        found: dict[str, dict[str, Any]] = {}
        failure = ""
        for i, (proc, (out_path, err_path)) in enumerate(zip(procs, logs)):
            proc.wait()
            if proc.returncode == 0:
                found[str(i)] = json.loads(out_path.read_text())
            elif not failure:
                tail = " | ".join(err_path.read_text(errors="replace").strip().splitlines()[-2:])
                failure = (f"peak measurement took over {PEAK_TIMEOUT_S} s"
                           if time.monotonic() > deadline
                           else f"peak measurement failed on device {i}: {tail}")
    if failure:
        return AttainablePeak(unsupported=failure)
    return AttainablePeak.of_probes(found, n, conv, rig.gpu_slots)


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
