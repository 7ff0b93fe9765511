"""``dp``: ``nn.DataParallel`` over the rig's GPUs (one process, scatter/gather per step)."""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, all_devices


class DataParallelTrainer(Trainer):
    @property
    def output_device(self) -> torch.device:
        # Outputs are gathered on device_ids[0], so targets go there.
        return self.devices[0]


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    ids = [d.index for d in devices]
    # DataParallel keeps the master copy (and the gathered outputs) on device_ids[0]:
    # that is the memory imbalance people see on device 0.
    wrapped = nn.DataParallel(model.to(devices[0]), device_ids=ids, output_device=ids[0])
    return DataParallelTrainer(wrapped, devices, ctx, params=model.parameters())


STRATEGY = Strategy(
    name="dp",
    description="nn.DataParallel over all GPUs (one process)",
    build=build,
    num_devices=all_devices,
    needs_cuda=True,
)
