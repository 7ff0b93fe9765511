"""The rig: the devices a run may use, their names, and waiting on them.

A ``cuda`` rig is the visible GPUs. A ``cpu`` rig is N workers of T intra-op threads,
each worker a process pinned to its own cores, so that a "device" on a CPU-only machine
is a real, separate compute resource and distributed strategies talk through gloo.

A ``Rig`` is a value: it says which devices a run may use and never asks the machine
anything but the devices' names. Finding the rig this machine offers is
``rig_detection``; the physical cores behind a cpu rig, ``topology``; a worker's pinning
and kept heap, ``pinning``; the fp32 math, ``math_modes``; joining a case's process
group, ``process_groups``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from bench_lib.nvml import cuda_visible_gpus

RIG_KINDS = ("cpu", "cuda")


class RigError(ValueError):
    """A rig that cannot be built from what the user asked for."""


@dataclass(frozen=True)
class Rig:
    """Devices a run may use."""

    kind: str
    """``cuda`` (one device per visible GPU) or ``cpu`` (one device per pinned worker)."""
    num_devices: int
    """How many devices the rig has (GPUs, or CPU workers)."""
    threads_per_worker: int = 1
    """Intra-op threads of each CPU worker (ignored on cuda rigs)."""
    cores: tuple[int, ...] = ()
    """Logical CPUs the rig may use, in hand-out order (siblings of a core together)."""
    physical_cores: tuple[tuple[int, ...], ...] = ()
    """The physical cores of ``cores`` in hand-out order, each as its logical CPUs; worker i
    gets physical cores [i*T, (i+1)*T). Empty: each logical CPU counts as a core."""
    nodes: int = 1
    """Nodes of a multi-node run (``nodes.multinode``), each with this node's devices:
    ``num_devices`` and the cores stay this node's, so device slots index this node."""
    gpu_slots: int = 1
    """Device slots per GPU (cuda only). Above 1 is the validation mode (``--gpu-slots``):
    slot i runs on GPU i // gpu_slots, so two "devices" share one card and the two-device
    code paths run on a one-GPU machine; its numbers are no multi-GPU measurement
    (``validation_note``), and its process groups use gloo (NCCL refuses two ranks on one
    GPU: "Duplicate GPU detected")."""

    def __post_init__(self) -> None:
        if self.kind not in RIG_KINDS:
            raise RigError(f"unknown rig kind {self.kind!r}; valid: {', '.join(RIG_KINDS)}")
        if self.num_devices < 1:
            raise RigError(f"a rig needs at least one device, got {self.num_devices}")
        if self.nodes < 1:
            raise RigError(f"a rig needs at least one node, got {self.nodes}")
        if self.gpu_slots < 1 or (self.gpu_slots > 1 and self.kind != "cuda"):
            raise RigError(f"--gpu-slots {self.gpu_slots}: slots per GPU are >= 1, and above 1 "
                           f"only on a cuda rig (a cpu rig's devices are its workers)")
        if self.kind == "cpu":
            if self.threads_per_worker < 1:
                raise RigError(f"threads per worker must be >= 1, got {self.threads_per_worker}")
            need = self.num_devices * self.threads_per_worker
            if need > len(self.core_groups):
                physical = " physical" if self.physical_cores else ""
                raise RigError(
                    f"a cpu rig of {self.num_devices} workers x {self.threads_per_worker} "
                    f"threads needs {need}{physical} cores; this machine lets us use "
                    f"{len(self.core_groups)}"
                )

    @property
    def core_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rig's physical cores as logical CPU tuples (one per CPU when unknown)."""
        return self.physical_cores or tuple((c,) for c in self.cores)

    @property
    def label(self) -> str:
        """Short rig name used in result rows, e.g. ``cpu:2x1t`` or ``cuda:2``; across nodes
        ``cuda:8@2nodes`` (8 GPUs on each of 2 nodes)."""
        if self.kind == "cpu":
            label = f"cpu:{self.num_devices}x{self.threads_per_worker}t"
        elif self.gpu_slots > 1:  # never mistaken for cuda:N
            label = f"cuda:{self.num_devices}slots-on-{self.num_gpus}gpu-validation"
        else:
            label = f"cuda:{self.num_devices}"
        return label if self.nodes == 1 else f"{label}@{self.nodes}nodes"

    @property
    def num_gpus(self) -> int:
        """GPUs the rig's devices run on (per node); 0 on a cpu rig."""
        if self.kind != "cuda":
            return 0
        return -(-self.num_devices // self.gpu_slots)

    @property
    def validation_note(self) -> str:
        """Empty, or why this rig's numbers are no measurement of its device count."""
        if self.gpu_slots == 1:
            return ""
        return (f"validation run: {self.num_devices} device slots on {self.num_gpus} GPU(s) "
                f"(--gpu-slots {self.gpu_slots}) check the multi-device code paths; the slots "
                f"share each GPU's compute and memory, and ranks talk through gloo, so the "
                f"numbers are not a {self.num_devices}-GPU measurement")

    @property
    def backend(self) -> str:
        """The process groups' backend: NCCL on GPUs, gloo on CPUs and in the validation mode
        (NCCL refuses two ranks on one GPU)."""
        return "nccl" if self.kind == "cuda" and self.gpu_slots == 1 else "gloo"

    def cuda_index(self, index: int) -> int:
        """The CUDA device index (this process's numbering) of device slot ``index``."""
        self._check_index(index)
        return index // self.gpu_slots

    def device(self, index: int) -> torch.device:
        """The torch device of device slot ``index``."""
        self._check_index(index)
        if self.kind == "cuda":
            return torch.device("cuda", self.cuda_index(index))
        return torch.device("cpu")

    def moves_between(self, a: int, b: int) -> bool:
        """Whether one process moving a tensor from device slot ``a`` to ``b`` (``.to()``)
        copies it: between distinct GPUs; not between a cpu rig's workers (one memory) nor
        between the slots of one GPU (``--gpu-slots``)."""
        return self.device(a) != self.device(b)

    def devices(self, count: int | None = None) -> list[torch.device]:
        """The first ``count`` devices (all when None)."""
        return [self.device(i) for i in range(count or self.num_devices)]

    def cores_of(self, index: int) -> list[int]:
        """Logical CPUs owned by worker ``index`` on a cpu rig: its whole physical cores."""
        self._check_index(index)
        t = self.threads_per_worker
        return [c for core in self.core_groups[index * t : (index + 1) * t] for c in core]

    def device_names(self) -> list[str]:
        """Human-readable names of the devices.

        On a cuda rig, read without a CUDA context in this process (the runner's: a context
        would hold memory on a GPU the cases measure): through NVML, else from a child
        process (``cuda_device_names``).
        """
        if self.kind == "cuda":
            gpus = cuda_device_names(self.num_gpus)
            return [gpus[self.cuda_index(i)] for i in range(self.num_devices)]
        return [
            f"cpu worker {i} (cores {','.join(map(str, self.cores_of(i)))})"
            for i in range(self.num_devices)
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_devices": self.num_devices,
            "threads_per_worker": self.threads_per_worker,
            "cores": list(self.cores),
            "physical_cores": [list(c) for c in self.physical_cores],
            "nodes": self.nodes,
            "gpu_slots": self.gpu_slots,
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rig:
        physical = tuple(tuple(c) for c in d.get("physical_cores") or ())
        return cls(d["kind"], d["num_devices"], d["threads_per_worker"], tuple(d["cores"]),
                   physical, int(d.get("nodes", 1)), int(d.get("gpu_slots", 1)))

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_devices:
            raise RigError(f"device {index} does not exist on rig {self.label}")


def cuda_device_names(count: int, nvml: Any = None,
                      child: Callable[[int], list[str]] | None = None) -> list[str]:
    """Names of CUDA devices 0..count-1 in CUDA's numbering, without a CUDA context here.

    NVML first (``nvml.cuda_visible_gpus``: CUDA_VISIBLE_DEVICES and bus order applied);
    where NVML cannot be read, or sees fewer GPUs, a child process asks torch
    (``_names_from_child``) and exits, taking its context with it.
    """
    try:
        gpus = cuda_visible_gpus(nvml)
    except Exception:  # no NVML library or driver: ask CUDA, in a child
        gpus = []
    if len(gpus) >= count:
        return [g.name for g in gpus[:count]]
    return (child or _names_from_child)(count)


def _names_from_child(count: int, timeout_s: float = 120.0) -> list[str]:
    code = ("import json, sys, torch; "
            "print(json.dumps([torch.cuda.get_device_name(i) for i in range(int(sys.argv[1]))]))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(count)], capture_output=True,
                              text=True, timeout=timeout_s, check=True)
        names = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RigError(f"cannot read the names of {count} CUDA device(s) through NVML or "
                       f"torch in a child process: {e}") from e
    return [str(n) for n in names]


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in ``devices`` has finished its queued work.

    One ``torch.cuda.synchronize`` per distinct CUDA device; CPU work is synchronous, so
    CPU devices need nothing. Every clock read in the suite (timed steps, partition
    profiling, the FLOP-peak probe, the traced step) goes through here.
    """
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        torch.cuda.synchronize(device)
