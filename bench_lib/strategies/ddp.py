"""``ddp``: DistributedDataParallel, one process per device, the global batch split over ranks."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, all_devices


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    """Wrap the model for this rank; the process group must already be initialised."""
    (device,) = devices
    model = model.to(device)
    if ctx.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids)
    return Trainer(wrapped, devices, ctx, params=model.parameters())


STRATEGY = Strategy(
    name="ddp",
    description="DistributedDataParallel, one process per device (NCCL on GPUs, gloo on CPUs)",
    build=build,
    num_devices=all_devices,
    per_device_processes=True,
    data_parallel=True,
    cpu_note="one process per cpu worker, gradients all-reduced through gloo over loopback",
)
