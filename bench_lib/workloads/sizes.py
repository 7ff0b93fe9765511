"""A workload's byte sizes, counted on its model built on meta or fake tensors (shapes and
dtypes only: no memory, no compute), cached: the gradients, each FSDP unit's share, and the
activation that crosses each stage cut, at the dtype that crosses it. The bound
(``rows.case_bound``) and the time prediction (``prediction.step_time``,
``prediction.pipeline_time``) price transfers and collectives with them.
"""

from __future__ import annotations

import functools

import torch

from bench_lib.processes.interrupts import shielded
from bench_lib.workloads import Workload, blocks, shard_units


@functools.cache
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def boundary_bytes(model: str, image_size: int, micro_batch: int, cuts: tuple[int, ...],
                   precision: str = "fp32") -> tuple[int, ...]:
    """Bytes of the activation crossing each cut for one micro-batch (its gradient, crossing
    back, is as large), in the dtype the block before the cut outputs at ``precision``.

    The blocks run on fake CPU tensors under the workload's autocast: a meta tensor skips
    autocast (every block would read fp32), a fake CPU one goes through it. Under bf16
    every block of these models ends bf16: a conv or linear outputs bf16, and batch norm,
    ReLU, the residual add and the pools keep their input's dtype on CPU and CUDA alike (no
    autocast list of either names them); tests/test_transfers.py checks this against the
    real tensor crossing the cut.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = Workload(model, image_size, max(micro_batch, 2), precision=precision)
    cpu = torch.device("cpu")
    sizes = []
    with FakeTensorMode(), torch.no_grad():
        net = w.build_model()
        x = w.make_batch(max(micro_batch, 2), cpu)[0]
        with w.autocast(cpu):
            for i, block in enumerate(blocks(net)):
                if i in cuts:
                    sizes.append(x.numel() * x.element_size() * micro_batch // x.shape[0])
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
