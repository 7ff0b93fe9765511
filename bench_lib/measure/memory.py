"""Peak memory of the devices this process drives: what the case adds, after warm-up.

``PeakMemory`` is made right before the model is built and read after the timed steps; the
timing calls its ``reset`` between the warm-up and the timed steps. Per device it gives:

* **gross**: on CPU the process's peak resident memory over the timed steps (``VmHWM``,
  runtime and libraries included); on CUDA the caching allocator's peak of allocated
  memory since the reset, once per GPU (slots of one GPU that the process drives share
  it: their labels joined, "0+1").
* **net**: gross minus the process's footprint before the model was built (CPU: ``VmRSS``
  read after torch's import, core pinning and process-group init). The CUDA allocator
  holds only what the case allocated, so there net equals gross.

The reset: ``torch.cuda.reset_peak_memory_stats`` per CUDA device; on Linux CPUs writing
``5`` to ``/proc/self/clear_refs``, which resets ``VmHWM`` to the current resident size
(proc(5)). Where that file cannot be written (not Linux, a locked-down /proc) the CPU figure
falls back to ``ru_maxrss``, the process's lifetime peak (build, partition profiling and
warm-up included); ``MemoryPeaks.source`` says which (``SOURCES``).
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

MIB = 2**20
PROC_SELF = Path("/proc/self")
SOURCES = ("cuda-allocator", "vmhwm", "ru_maxrss")
"""How a peak was read: the CUDA allocator's peak since the reset after warm-up; /proc's
VmHWM since clear_refs reset it after warm-up; or the process's lifetime ru_maxrss."""


def status_field_mib(status_text: str, field: str) -> float | None:
    """A ``/proc/<pid>/status`` field in kB (``VmHWM:   123456 kB``) as MiB; None if absent."""
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", status_text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def proc_status_mib(field: str, proc: Path = PROC_SELF) -> float | None:
    """This process's ``VmRSS`` / ``VmHWM`` in MiB, or None where /proc cannot tell."""
    try:
        text = (proc / "status").read_text()
    except OSError:
        return None
    return status_field_mib(text, field)


def current_rss_mib(proc: Path = PROC_SELF) -> float:
    """This process's resident memory now, MiB (psutil where /proc is missing)."""
    rss = proc_status_mib("VmRSS", proc)
    if rss is not None:
        return rss
    import psutil

    return float(psutil.Process().memory_info().rss) / MIB


def reset_rss_peak(proc: Path = PROC_SELF) -> bool:
    """Reset ``VmHWM`` to the current resident size; False where that is not possible."""
    try:
        (proc / "clear_refs").write_text("5")
    except OSError:
        return False
    return proc_status_mib("VmHWM", proc) is not None


def lifetime_peak_rss_mib() -> float:
    """The process's lifetime peak resident memory, MiB (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(frozen=True)
class MemoryPeaks:
    """Peak memory per device label, gross and net of the runtime, and how it was read."""

    gross_mib: dict[str, float]
    net_mib: dict[str, float]
    source: str
    """One of ``SOURCES``."""


class PeakMemory:
    """The peak memory of ``devices`` (labelled ``labels``) over the timed steps.

    Make it right before the model is built: on CPU that reads the baseline. On a cpu rig
    one process may drive several worker "devices" (mp, pipeline); its peak cannot be
    split between them, so it is recorded once under the joined labels ("0+1").
    """

    def __init__(self, devices: list[torch.device], labels: list[str],
                 proc: Path = PROC_SELF) -> None:
        self.devices, self.labels, self._proc = devices, labels, proc
        self.cuda = devices[0].type == "cuda"
        self.baseline_mib = 0.0 if self.cuda else current_rss_mib(proc)
        """Resident memory before the model was built, MiB (0 on CUDA: the allocator's)."""
        self.source = "cuda-allocator" if self.cuda else "ru_maxrss"

    def reset(self) -> None:
        """Forget the peaks so far (call after warm-up)."""
        if self.cuda:
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        else:
            self.source = "vmhwm" if reset_rss_peak(self._proc) else "ru_maxrss"

    def read(self) -> MemoryPeaks:
        """The peaks since ``reset`` (since the process started where it could not reset)."""
        if self.cuda:
            peaks = {label: torch.cuda.max_memory_allocated(d) / MIB
                     for d, label in joined_labels(self.devices, self.labels)}
            return MemoryPeaks(peaks, dict(peaks), self.source)
        gross = proc_status_mib("VmHWM", self._proc) if self.source == "vmhwm" else None
        source = "vmhwm"
        if gross is None:
            gross, source = lifetime_peak_rss_mib(), "ru_maxrss"
        label = "+".join(self.labels)
        return MemoryPeaks({label: gross}, {label: gross - self.baseline_mib}, source)


def joined_labels(devices: list[torch.device], labels: list[str]
                  ) -> list[tuple[torch.device, str]]:
    """Each distinct device with the labels it stands for joined ("0+1"): the slots of one
    GPU that one process drives (``--gpu-slots``: mp, pipeline) share one caching
    allocator, whose peak cannot be split between them, as on a cpu rig."""
    by_device: dict[torch.device, list[str]] = {}
    for d, label in zip(devices, labels):
        by_device.setdefault(d, []).append(label)
    return [(d, "+".join(names)) for d, names in by_device.items()]


def peak_reserved_mib(devices: list[torch.device], labels: list[str]) -> dict[str, float]:
    """Peak memory the CUDA caching allocator reserved per device (empty on CPU)."""
    if devices[0].type != "cuda":
        return {}
    return {label: torch.cuda.max_memory_reserved(d) / MIB
            for d, label in joined_labels(devices, labels)}


def cap_cuda_memory(devices: list[torch.device], cap_mib: float) -> None:
    """``--max-memory-per-device`` on GPUs: past the cap the allocator raises OutOfMemoryError.

    ``torch.cuda.set_per_process_memory_fraction`` (cap over the device's total memory)
    limits this process's caching allocator only: what it reserves (its segments: the
    tensors plus free cached and fragmented blocks; it releases the cached ones and retries
    before it raises). Memory taken
    outside the allocator is not capped and not counted: the CUDA context of each device the
    process touches (driver state, loaded kernels, library handles; commonly hundreds of MiB,
    by GPU, driver and CUDA version) and NCCL's communication buffers (ranks of distributed
    strategies). So a case that fits a 12GiB cap can still not fit a real 12 GB card: the
    cap mimics a card whose free memory after those is the cap. The suite does not measure
    the context's size (it would need ``torch.cuda.mem_get_info`` around CUDA's
    initialisation in each worker); NVML's device-wide ``mem_used_mib`` (samples.csv) less
    ``peak_mem_reserved_mib_*`` shows roughly what sits outside the allocator (any other
    process on the GPU included).
    """
    if not cap_mib:
        return
    for d in devices:
        if d.type == "cuda":
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), d)
