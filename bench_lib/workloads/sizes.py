"""A workload's byte sizes, counted on its model built on meta tensors (shapes only: no
memory, no compute), cached: the gradients, each FSDP unit's share, and the activation that
crosses each stage cut. The bound (``run.case_bound``) and the time prediction
(``sweep.predict_time``, ``sweep.predict_pipeline``) price transfers and collectives with
them.
"""

from __future__ import annotations

import functools

import torch

from bench_lib.processes.interrupts import shielded
from bench_lib.workloads import Workload, blocks, shard_units


@functools.cache
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def boundary_bytes(model: str, image_size: int, micro_batch: int,
                   cuts: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes of the activation crossing each cut for one micro-batch (fp32: a bf16 case's
    boundary is counted at fp32 size, at most twice its own)."""
    w = Workload(model, image_size, max(micro_batch, 2))
    meta = torch.device("meta")
    with meta:
        net = w.build_model()
    x = w.make_batch(max(micro_batch, 2), meta)[0]
    sizes = []
    with torch.no_grad():
        for i, block in enumerate(blocks(net)):
            if i in cuts:
                sizes.append(x.numel() * 4 * micro_batch // x.shape[0])
            x = block(x)
    return tuple(sizes)


@functools.cache
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def parameter_bytes(model: str, image_size: int) -> tuple[int, tuple[int, ...]]:
    """The model's gradient bytes (fp32), and each FSDP unit's (``workloads.shard_units``);
    the root holds the rest."""
    with torch.device("meta"):
        net = Workload(model, image_size, 2).build_model()

    def size(module: torch.nn.Module) -> int:
        return sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)

    return size(net), tuple(size(u) for u in shard_units(net))
