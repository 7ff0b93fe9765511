"""What the runner reads the devices through: a launch's sampler over the devices its case
uses (``case_sampler``, started as its ranks start, stopped once they are reaped), and the
rig's idle power, read once per run over the same counters (``measure_idle_power``). GPUs
are read through NVML alone, by the CUDA devices' PCI bus ids (``_cuda_bus_ids``), so the
runner never creates a CUDA context; a cpu rig's through its processes and RAPL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from bench_lib.measure.cpu_sources import ProcessSource, RaplSource
from bench_lib.measure.energy import IDLE_SECONDS, IdlePower, idle_power, rig_packages
from bench_lib.measure.nvml_source import NvmlSource
from bench_lib.measure.sampler import Sampler, Source, UnavailableSource
from bench_lib.nvml import cuda_visible_gpus
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case


def case_sampler(case: Case, rig: Rig, pids: Sequence[int],
                 ranks: Mapping[int, int] | None = None) -> Sampler:
    """A sampler over the devices a case uses; device labels match peak_mem_mib's keys.

    ``ranks`` (under torchrun): the global rank of each of ``pids`` -> its device slot on
    this node, for ranks that need not be 0..n-1 here (by default, ``pids`` are ranks
    0..n-1 on slots 0..n-1). Where NVML cannot be opened (no library, no driver, a GPU not
    found) the GPU columns stay empty and the sampler's ``note`` says why (for the row's
    ``sampler_note``).
    """
    sources: list[Source] = []
    interval_s = case.measurement.sample_interval_ms / 1000
    slots = dict(ranks) if ranks is not None else {r: r for r in range(case.world_size)}
    if rig.kind == "cuda":
        try:
            gpu = {r: rig.cuda_index(s) for r, s in slots.items()}  # slots share a GPU with
            bus = _cuda_bus_ids(max(gpu.values()) + 1)  # --gpu-slots: each samples it whole
            # GPM metrics over at least half an interval: none from the first tick, which
            # comes right after opening.
            sources.append(NvmlSource({str(r): bus[str(g)] for r, g in gpu.items()},
                                      gpm_min_span_s=interval_s / 2))
        except Exception as e:  # whatever it was, it is recorded, not swallowed
            sources.append(UnavailableSource("NVML", e))
    else:
        if case.process_group:
            labels = [str(r) for r in (list(slots) if ranks is not None else range(len(pids)))]
        else:  # one process drives every device of the case
            labels = ["+".join(str(i) for i in range(case.world_size))]
        # Each process is pinned to one worker: its CPU % is of that worker's threads.
        threads = dict.fromkeys(labels, rig.threads_per_worker)
        sources.append(ProcessSource(dict(zip(labels, pids)), threads))
        rapl = RaplSource(packages=rig_packages(rig))  # the packages holding the rig's cores
        if rapl.available:
            sources.append(rapl)
    return Sampler(sources, interval_s)


def measure_idle_power(rig: Rig, seconds: float = IDLE_SECONDS) -> IdlePower:
    """The rig's power with nothing of ours running, over the counters cases are read
    through: RAPL of the packages holding a cpu rig's cores, NVML of every GPU of a cuda rig
    (where NVML cannot be opened, ``unsupported`` says why)."""
    sources: list[Source] = []
    described: list[str] = []
    if rig.kind == "cuda":
        try:
            sources.append(NvmlSource(_cuda_bus_ids(rig.num_gpus)))
            described += [f"nvml gpu {i}" for i in range(rig.num_gpus)]
        except Exception as e:  # no NVML library or driver: no idle figure, and why
            return IdlePower(unsupported=f"NVML unavailable ({type(e).__name__}: {e})")
    else:
        rapl = RaplSource(packages=rig_packages(rig))
        if rapl.available:
            sources.append(rapl)
            described += [f"rapl {d}" for d in rapl.domains]
    return idle_power(sources, described, seconds)


def _cuda_bus_ids(count: int, nvml: Any = None) -> dict[str, str | int]:
    """NVML keys of CUDA devices 0..count-1: PCI bus ids, since CUDA and NVML may order
    GPUs differently (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); a MIG instance's UUID
    where CUDA_VISIBLE_DEVICES names one (the process has that instance, not the card:
    ``NvmlSource`` reads it as such).

    Read through NVML alone, so the runner never creates a CUDA context (one would hold
    memory on a GPU the case measures): ``nvml.cuda_visible_gpus`` maps CUDA's visible
    indices to bus ids as CUDA_VISIBLE_DEVICES says, taking CUDA's order as PCI bus order,
    which holds under CUDA_DEVICE_ORDER=PCI_BUS_ID (the command sets it unless the user set
    an order) and on machines of identical GPUs. Raises where NVML cannot be read, sees
    fewer than ``count`` visible GPUs, or cannot tell CUDA's numbering of mixed GPUs
    (``nvml.CudaOrderUnknown``).
    """
    gpus = cuda_visible_gpus(nvml)
    if len(gpus) < count:
        raise RuntimeError(f"NVML sees {len(gpus)} GPU(s) visible to CUDA "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}), "
                           f"the case needs {count}")
    return {str(g.cuda_index): g.mig_uuid or g.bus_id for g in gpus[:count]}
