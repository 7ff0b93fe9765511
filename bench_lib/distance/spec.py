"""What a distance case is, decided before anything runs, and what its processes are told.

A case is one method on one layer shape in one precision on the rig. Where it runs:

- ``loop`` and ``blocked``: one process on the rig's first device;
- ``split`` on a cpu rig: one process per worker (each pinned to its own cores), in a gloo
  process group; on a cuda rig: one process driving every GPU.

A case that cannot run is decided here, with its reason: ``loop`` above ``loop_max_kernels``
kernels is ``skipped`` (n^2 Python iterations), ``split`` on a one-device rig
``unsupported``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig
from bench_lib.sweep.profile import Measurement, UsageError

METHODS = ("loop", "blocked", "split")
"""In the order cases of a layer are listed."""
DTYPES = ("fp32", "fp64")
LAYER_FORM = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)$")


@dataclass(frozen=True)
class Layer:
    """A conv layer's weight shape: (out, in, kh, kw), as ``nn.Conv2d`` holds it."""

    out_channels: int
    """Output channels: the number of kernels."""
    in_channels: int
    kernel_h: int
    kernel_w: int

    def __post_init__(self) -> None:
        if min(self.out_channels, self.in_channels, self.kernel_h, self.kernel_w) < 1:
            raise UsageError(f"layer {self.label}: every dimension must be >= 1")

    @classmethod
    def parse(cls, text: str) -> Layer:
        """``OUTxINxKHxKW``, e.g. ``512x512x3x3``."""
        match = LAYER_FORM.match(text.strip())
        if match is None:
            raise UsageError(f"layer {text!r}: expected OUTxINxKHxKW, e.g. 512x512x3x3")
        out, inp, kh, kw = (int(g) for g in match.groups())
        return cls(out, inp, kh, kw)

    @property
    def label(self) -> str:
        return f"{self.out_channels}x{self.in_channels}x{self.kernel_h}x{self.kernel_w}"

    @property
    def kernels(self) -> int:
        """Kernels compared: one per output channel."""
        return self.out_channels

    @property
    def kernel_numel(self) -> int:
        """Numbers in one kernel: in x kh x kw."""
        return self.in_channels * self.kernel_h * self.kernel_w


@dataclass(frozen=True)
class DistanceCase:
    """One method on one layer: the unit that is measured."""

    layer: Layer
    method: str
    """One of ``METHODS``."""
    dtype: str
    """``fp32`` or ``fp64``: the weight's and the computation's precision."""
    block_rows: int
    """Rows of each ``torch.cdist`` block (``blocked``, ``split``; ignored by ``loop``)."""
    world_size: int
    """Devices the case computes on."""
    processes: int
    """Processes of a launch: ``world_size`` for a cpu rig's ``split`` (a process group),
    else 1."""
    status: str | None = None
    """``skipped`` or ``unsupported`` when decided before running, else None."""
    reason: str = ""

    @property
    def case_id(self) -> str:
        return f"{self.method}_{self.layer.label}_{self.dtype}"

    @property
    def process_group(self) -> bool:
        """Whether its processes form a process group (one per device)."""
        return self.processes > 1

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistanceCase:
        return cls(**(d | {"layer": Layer(**d["layer"])}))


def new_case(rig: Rig, layer: Layer, method: str, dtype: str, block_rows: int,
             loop_max_kernels: int) -> DistanceCase:
    """The case of ``method`` on ``layer`` on ``rig``, with its status where it cannot run."""
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if method != "split":
        case = DistanceCase(layer, method, dtype, block_rows, 1, 1)
        if method == "loop" and layer.kernels > loop_max_kernels:
            return dataclasses.replace(case, status="skipped", reason=(
                f"the Python loop runs n^2 = {layer.kernels**2} norms; run only up to "
                f"{loop_max_kernels} kernels (--loop-max-kernels)"))
        return case
    devices = rig.num_devices
    case = DistanceCase(layer, method, dtype, block_rows, devices,
                        devices if rig.kind == "cpu" else 1)
    if devices < 2:
        return dataclasses.replace(case, status="unsupported", reason=(
            f"split needs 2 or more devices; rig {rig.label} has {devices}"))
    return case


@dataclass(frozen=True)
class DistanceSpec:
    """What every process of a launch is told (``spec.json`` in the case's work folder)."""

    case: DistanceCase
    rig: Rig
    seed: int
    """Seeds the weight (``methods.make_weight``)."""
    measurement: Measurement

    def write(self, path: Path) -> None:
        write_json_atomic(path, {"case": self.case.as_dict(), "rig": self.rig.as_dict(),
                                 "seed": self.seed,
                                 "measurement": dataclasses.asdict(self.measurement)})

    @classmethod
    def read(cls, path: Path) -> DistanceSpec:
        data = json.loads(path.read_text())
        return cls(DistanceCase.from_dict(data["case"]), Rig.from_dict(data["rig"]),
                   int(data["seed"]), Measurement(**data["measurement"]))


def result_file(workdir: Path) -> Path:
    """Where rank 0 saves the value and gradient of its last step (``torch.save``)."""
    return workdir / "value.pt"
