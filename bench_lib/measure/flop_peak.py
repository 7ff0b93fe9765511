"""The rig's attainable FLOP peak (the denominator of MFU), measured once per run, and its
record in env.json (``AttainablePeak``).

The peak is measured, not looked up: per device and precision the best of a large matrix
product (``gemm``) and a large ResNet-like 3x3 convolution (``conv``, and ``conv-cl`` in
channels-last), in the math mode the workers train in. On CPUs oneDNN's convolutions beat
its GEMM by half again, and on GPUs cuDNN's convolutions and cuBLAS's GEMMs differ too, so a
GEMM alone is not the attainable peak of a convolutional network.

Every device is probed at once, one process per device (``measure.flop_probe``), pinned as
in a case (a cpu worker's cores and threads), each probe started together through a file
barrier: a CPU worker's peak then carries the frequency, cache and memory-bandwidth sharing
of a real ``ddp`` case.

The math mode: the probe process sets the run's (``Measurement.math_mode``: ``torch`` or
``ieee``) with the workers' own ``math_modes.set_math_mode`` before it builds a probe, refuses to
report a peak if the flags change while it probes, and the record keeps the flags
(``math_mode``), the TF32 environment variables set (``math_env``) and, per precision, the
mode in words (``math``). That matters on Ampere and later, where a TF32 convolution runs
several times faster than an IEEE fp32 GEMM: a peak taken in another mode than training's
would put an fp32 MFU far over (or under) its truth.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.fault_hooks import QUICK_PEAK_ENV
from bench_lib.math_modes import DEFAULT_MATH_MODE
from bench_lib.measure.flop_probe import (
    DTYPE_NAMES,
    PEAK_CONV,
    PEAK_MATMUL_N,
    PEAK_MIN_TIME_S,
    PEAK_TIMEOUT_S,
    ConvShape,
)
from bench_lib.processes.forkserver import ForkServer, parent_pid, start_module
from bench_lib.rig import Rig

QUICK_PEAK_MIN_TIME_S = 0.03
"""The probe's time under the test suite's hook (``fault_hooks.QUICK_PEAK_ENV``)."""


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
        procs = [start_module(server, "bench_lib.measure.flop_probe",
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
