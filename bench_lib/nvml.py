"""NVML read without a CUDA context: a session, its strings, and the GPUs this process's
CUDA would see (``cuda_visible_gpus``). The rig names its GPUs with it (``rig``), the sampler
opens them by bus id (``measure.nvml_source``), env.json and the pre-flight check describe them,
the admission reads their memory: all without CUDA, in the runner. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

BUS_ORDER = "PCI_BUS_ID"
"""The CUDA_DEVICE_ORDER that numbers GPUs in PCI bus order, as ``cuda_visible_gpus`` does."""


class CudaOrderUnknown(RuntimeError):
    """CUDA numbers this machine's GPUs in an order NVML cannot reproduce."""


def order_cuda_by_bus(environ: MutableMapping[str, str] | None = None) -> str:
    """Set CUDA_DEVICE_ORDER=PCI_BUS_ID in ``environ`` (default: this process's) unless the
    user set an order; returns the order in force. A command calls it as it starts, before
    any child and before CUDA reads it: every child inherits it (the fork server and its
    ranks, torchrun's agents, the pre-flight, the FLOP probe, the collectives, the
    calibration), so CUDA numbers the GPUs as ``cuda_visible_gpus`` does."""
    env = os.environ if environ is None else environ
    return env.setdefault("CUDA_DEVICE_ORDER", BUS_ORDER)


def _check_order(names: Sequence[str], env: Mapping[str, str]) -> None:
    """Raise ``CudaOrderUnknown`` where CUDA's numbering need not be the bus order: an order
    other than PCI_BUS_ID (unset is CUDA's FASTEST_FIRST: the fastest GPU first, the rest
    unspecified) on a machine whose GPUs are not all alike (``names``: every GPU's)."""
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if order != BUS_ORDER and len(set(names)) > 1:
        raise CudaOrderUnknown(
            f"mixed GPUs ({', '.join(sorted(set(names)))}) under CUDA_DEVICE_ORDER={order}: "
            "CUDA may number them otherwise than NVML's bus order, so no GPU is placed; set "
            f"CUDA_DEVICE_ORDER={BUS_ORDER} (a command sets it where it is unset)")


def load_nvml(nvml: Any = None) -> Any:
    """``nvml``, or the pynvml module (provided by nvidia-ml-py); raises ImportError without."""
    if nvml is not None:
        return nvml
    import pynvml

    return pynvml


@contextmanager
def nvml_session(nvml: Any = None) -> Iterator[Any]:
    """NVML (``nvml``, default pynvml) initialised for the block and shut down after it, also
    when the block raises (NVML counts its inits: sessions nest with an open NvmlSource)."""
    nvml = load_nvml(nvml)
    nvml.nvmlInit()
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def nvml_text(value: Any) -> str:
    """An NVML string (bytes in older pynvml, str in newer) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"), (0x200, "board_limit"), (0x400, "reliability"),
)
"""NVML's clock event reasons (``nvmlClocksEventReason*``, ``nvmlClocksThrottleReason*``
before NVML 12.535): the bits of ``nvmlDeviceGetCurrentClocksEventReasons``'s mask, named
as nvml.h names them, in snake case."""


def clock_event_names(mask: int) -> str:
    """A clock event reasons mask in words: ``sw_power_cap+sync_boost``; ``none`` for 0; a
    bit NVML added later keeps its value (``0x800``)."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    names += [hex(1 << i) for i in range(mask.bit_length()) if mask & ~known & (1 << i)]
    return "+".join(names) or "none"


@dataclass(frozen=True)
class VisibleGpu:
    """A GPU as CUDA numbers it in this process, and as NVML knows it."""

    cuda_index: int
    """Its index in this process's CUDA numbering (after CUDA_VISIBLE_DEVICES)."""
    nvml_index: int
    bus_id: str
    """PCI bus id as NVML writes it, e.g. ``00000000:3B:00.0``: the key NvmlSource opens."""
    uuid: str
    name: str
    mig_uuid: str = ""
    """The MIG instance CUDA_VISIBLE_DEVICES names on this GPU (``MIG-...``), or empty: the
    process then has that instance, not the GPU (its memory, its share of the SMs)."""


def _visible_entry(entry: str, gpus: Sequence[tuple[int, str, str]], nvml: Any) -> int | None:
    """The position in ``gpus`` (NVML index, bus id, uuid; in PCI bus order) of one
    CUDA_VISIBLE_DEVICES entry, or None where CUDA would take it as invalid."""
    if entry.isdigit():
        return int(entry) if int(entry) < len(gpus) else None
    if entry.startswith("MIG-"):  # a MIG instance: its parent GPU's bus id
        try:
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
                nvml.nvmlDeviceGetHandleByUUID(entry.encode()))
            uuid = nvml_text(nvml.nvmlDeviceGetUUID(parent))
        except Exception:  # unknown instance, or an NVML without MIG
            return None
        return next((k for k, g in enumerate(gpus) if g[2] == uuid), None)
    # A GPU UUID, which CUDA takes by any unambiguous prefix (``GPU-5c1b``).
    matches = [k for k, g in enumerate(gpus) if g[2].startswith(entry)] if entry else []
    return matches[0] if len(matches) == 1 else None


def cuda_visible_gpus(nvml: Any = None, environ: Mapping[str, str] | None = None
                      ) -> list[VisibleGpu]:
    """The GPUs this process's CUDA would see, in CUDA's numbering, through NVML alone: no
    CUDA context (nor CUDA call) in the runner.

    CUDA_VISIBLE_DEVICES is read as CUDA reads it: comma-separated indices, GPU UUIDs (or
    unambiguous prefixes) or MIG UUIDs (mapped to their parent GPU), up to the first invalid
    or repeated entry; unset means every GPU. Indices (and the order when unset) are taken
    in PCI bus order, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID (which every
    command sets unless the user set an order: ``order_cuda_by_bus``). CUDA's default
    (FASTEST_FIRST) puts the fastest GPU first and is PCI order only on a machine of
    identical GPUs: under any other order a machine of mixed GPUs raises
    ``CudaOrderUnknown`` rather than name, sample or count another GPU than the workers'.
    """
    env = os.environ if environ is None else environ
    with nvml_session(nvml) as nv:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        gpus = sorted(((i, nvml_text(nv.nvmlDeviceGetPciInfo(h).busId),
                        nvml_text(nv.nvmlDeviceGetUUID(h))) for i, h in enumerate(handles)),
                      key=lambda g: g[1].upper())
        _check_order([nvml_text(nv.nvmlDeviceGetName(h)) for h in handles], env)
        order: list[int] = list(range(len(gpus)))
        migs: list[str] = [""] * len(gpus)
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            order, migs = [], []
            for entry in (e.strip() for e in visible.split(",")):
                k = _visible_entry(entry, gpus, nv)
                if k is None or k in order:  # CUDA stops at an invalid or repeated entry
                    break
                order.append(k)
                migs.append(entry if entry.startswith("MIG-") else "")
        return [VisibleGpu(c, gpus[k][0], gpus[k][1], gpus[k][2],
                           nvml_text(nv.nvmlDeviceGetName(handles[gpus[k][0]])), mig)
                for c, (k, mig) in enumerate(zip(order, migs))]
