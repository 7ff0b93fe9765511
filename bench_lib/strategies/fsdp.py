"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one process per device.

Each ResNet stage (layer1..layer4) is its own FSDP unit and the root module holds the rest
(stem and head), so a stage's parameters are all-gathered just before it runs and its
gradients reduce-scattered as soon as its backward is done. The global batch is split over
the ranks as in ``ddp``; parameters, gradients and optimizer state are sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, all_devices


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units before the root: the ResNet stages."""
    return [getattr(model, name) for name in ("layer1", "layer2", "layer3", "layer4")]


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
    description="FSDP2 fully_shard per ResNet stage, one process per device, batch split "
    "over ranks",
    build=build,
    num_devices=all_devices,
    per_device_processes=True,
    data_parallel=True,
    compile_unsupported=("torch.compile of FSDP2 ResNet stages fails in Inductor with torch 2.14 "
                         "('Cannot convert expression to float', seen on cpu; not tried on GPUs)"),
    channels_last_unsupported=("FSDP2 (fully_shard) does not shard non-contiguous "
                               "parameters, and channels-last conv weights are not contiguous"),
    cpu_note=("one process per cpu worker; parameters all-gathered and gradients "
              "reduce-scattered per ResNet stage through gloo over loopback"),
)
