"""The rig: the devices a run may use, CPU worker pinning, and process groups.

A ``cuda`` rig is the visible GPUs. A ``cpu`` rig is N workers of T intra-op threads,
each worker a process pinned to its own cores, so that a "device" on a CPU-only machine
is a real, separate compute resource and distributed strategies talk through gloo.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

RIG_KINDS = ("cpu", "cuda")


class RigError(ValueError):
    """A rig that cannot be built from what the user asked for."""


def available_cores() -> list[int]:
    """The CPU cores this process may run on (respects taskset/cgroups affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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
    """CPU cores the rig may use; worker i gets cores[i*T:(i+1)*T]."""

    def __post_init__(self) -> None:
        if self.kind not in RIG_KINDS:
            raise RigError(f"unknown rig kind {self.kind!r}; valid: {', '.join(RIG_KINDS)}")
        if self.num_devices < 1:
            raise RigError(f"a rig needs at least one device, got {self.num_devices}")
        if self.kind == "cpu":
            if self.threads_per_worker < 1:
                raise RigError(f"threads per worker must be >= 1, got {self.threads_per_worker}")
            need = self.num_devices * self.threads_per_worker
            if need > len(self.cores):
                raise RigError(
                    f"a cpu rig of {self.num_devices} workers x {self.threads_per_worker} "
                    f"threads needs {need} cores; this machine lets us use {len(self.cores)}"
                )

    @property
    def label(self) -> str:
        """Short rig name used in result rows, e.g. ``cpu:2x1t`` or ``cuda:2``."""
        if self.kind == "cpu":
            return f"cpu:{self.num_devices}x{self.threads_per_worker}t"
        return f"cuda:{self.num_devices}"

    def device(self, index: int) -> torch.device:
        """The torch device of device slot ``index``."""
        self._check_index(index)
        return torch.device("cuda", index) if self.kind == "cuda" else torch.device("cpu")

    def devices(self, count: int | None = None) -> list[torch.device]:
        """The first ``count`` devices (all when None)."""
        return [self.device(i) for i in range(count or self.num_devices)]

    def cores_of(self, index: int) -> list[int]:
        """CPU cores owned by worker ``index`` on a cpu rig."""
        self._check_index(index)
        t = self.threads_per_worker
        return list(self.cores[index * t : (index + 1) * t])

    def device_names(self) -> list[str]:
        """Human-readable names of the devices."""
        if self.kind == "cuda":
            return [torch.cuda.get_device_name(i) for i in range(self.num_devices)]
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
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rig:
        return cls(d["kind"], d["num_devices"], d["threads_per_worker"], tuple(d["cores"]))

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_devices:
            raise RigError(f"device {index} does not exist on rig {self.label}")


def detect_rig(
    kind: str | None = None, num_devices: int | None = None, threads: int | None = None
) -> Rig:
    """Detect the rig, with optional overrides from the CLI.

    Default: every visible GPU when CUDA is available; otherwise two CPU workers
    (one on a 1-core machine) that share the available cores evenly.
    """
    if kind is None:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise RigError("--rig cuda asked for, but no CUDA GPU is visible")
        n = have if num_devices is None else num_devices
        if n > have:
            raise RigError(f"{n} devices asked for, but this cuda rig has {have} GPU(s)")
        return Rig("cuda", n)
    if kind != "cpu":
        raise RigError(f"unknown rig kind {kind!r}; valid: {', '.join(RIG_KINDS)}")
    cores = available_cores()
    n = num_devices if num_devices is not None else min(2, len(cores))
    if n > len(cores):
        raise RigError(f"{n} devices asked for, but this cpu rig has {len(cores)} core(s)")
    t = threads if threads is not None else max(1, len(cores) // max(n, 1))
    return Rig("cpu", n, t, tuple(cores))


def pin_worker(rig: Rig, device_indices: list[int]) -> None:
    """Pin this process to the cores of the given CPU workers, one worker's share of threads.

    A single process that drives several CPU "devices" (``mp``, ``pipeline``) still uses
    one worker's thread count: its stages run one after another, so only one device is
    ever busy, as with naive model parallelism on GPUs.
    """
    if rig.kind != "cpu":
        return
    cores = sorted({c for i in device_indices for c in rig.cores_of(i)})
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(rig.threads_per_worker)
    # Inter-op threads would add parallelism the rig does not promise.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process; harmless
        pass


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in ``devices`` has finished its queued work.

    One ``torch.cuda.synchronize`` per distinct CUDA device; CPU work is synchronous, so
    CPU devices need nothing. Every clock read in the suite (timed steps, partition
    profiling, the FLOP-peak probe, the traced step) goes through here.
    """
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        torch.cuda.synchronize(device)


def init_process_group(
    rig: Rig, rank: int, world_size: int, init_file: str, timeout_s: float
) -> None:
    """Join a process group through a ``file://`` rendezvous (unique per case).

    NCCL on cuda rigs, gloo on cpu rigs; single-node groups talk over loopback only.
    """
    import torch.distributed as dist

    if platform.system() == "Linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    device_id = None
    if rig.kind == "cuda":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        backend="nccl" if rig.kind == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
