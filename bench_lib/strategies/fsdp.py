"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one process per device.

Each of the model's FSDP units (``workloads.shard_units``: a ResNet's stages layer1..layer4,
the blocks of ``toy`` and ``mlp``) is sharded on its own and the root module holds the rest
(a ResNet's stem and head), so a unit's parameters are all-gathered just before it runs and
its gradients reduce-scattered as soon as its backward is done. The global batch is split over
the ranks as in ``ddp``; parameters, gradients and optimizer state are sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, all_devices
from bench_lib.workloads import shard_units


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    """Shard the model over the process group's ranks; the group must be initialised."""
    (device,) = devices
    model = model.to(device)
    if ctx.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    mesh = init_device_mesh(device.type, (ctx.world_size,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The optimizer is built after sharding, so it steps the local shards (DTensors).
    return Trainer(model, devices, ctx)


STRATEGY = Strategy(
    name="fsdp",
    description="FSDP2 fully_shard per ResNet stage (per block of toy and mlp), one process "
    "per device, batch split over ranks",
    build=build,
    num_devices=all_devices,
    per_device_processes=True,
    data_parallel=True,
    shared_gpu_unsupported=("ranks sharing a GPU talk through gloo (NCCL refuses two ranks on "
                            "one GPU), and gloo has no all-gather or reduce-scatter of CUDA "
                            "tensors, which FSDP2 needs"),
    compile_unsupported=("torch.compile of FSDP2 ResNet stages fails in Inductor with torch 2.14 "
                         "('Cannot convert expression to float', seen on cpu; not tried on GPUs)"),
    channels_last_unsupported=("FSDP2 (fully_shard) does not shard non-contiguous "
                               "parameters, and channels-last conv weights are not contiguous"),
    cpu_note=("one process per cpu worker; parameters all-gathered and gradients "
              "reduce-scattered per unit (a ResNet stage; a block of toy or mlp) through gloo "
              "over loopback"),
)
