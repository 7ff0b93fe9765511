"""Peak memory of the devices this process drives, read after the timed steps."""

from __future__ import annotations

import resource

import torch

MIB = 2**20


def peak_allocated_mib(devices: list[torch.device], labels: list[str]) -> dict[str, float]:
    """Peak memory per device: allocator peak on CUDA, this process's peak RSS on CPU.

    On a cpu rig one process may drive several worker "devices" (mp, pipeline); its peak
    cannot be split between them, so it is recorded once under the joined labels ("0+1").
    """
    if devices[0].type == "cuda":
        return {label: torch.cuda.max_memory_allocated(d) / MIB
                for label, d in zip(labels, devices)}
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"+".join(labels): rss_kib / 1024}


def peak_reserved_mib(devices: list[torch.device], labels: list[str]) -> dict[str, float]:
    """Peak memory the CUDA caching allocator reserved per device (empty on CPU)."""
    if devices[0].type != "cuda":
        return {}
    return {label: torch.cuda.max_memory_reserved(d) / MIB for label, d in zip(labels, devices)}


def cap_cuda_memory(devices: list[torch.device], cap_mib: float) -> None:
    """``--max-memory-per-device`` on GPUs: past the cap the allocator raises OutOfMemoryError.

    It caps the caching allocator only; the CUDA context and NCCL's buffers sit outside it.
    """
    if not cap_mib:
        return
    for d in devices:
        if d.type == "cuda":
            total = torch.cuda.get_device_properties(d).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), d)
