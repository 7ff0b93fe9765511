"""``dp``: ``nn.DataParallel`` over the rig's GPUs (one process, scatter/gather per step)."""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, all_devices
from bench_lib.workloads import Workload


class AutocastForward(nn.Module):
    """``model`` whose forward enters the workload's autocast itself, in whatever thread
    runs it: what DataParallel replicates and runs on each device.

    DataParallel runs each replica's forward in a thread of its own (``parallel_apply``),
    and autocast's state is thread-local. ``parallel_apply`` re-enters autocast there with
    the caller's *enabled* flag but no dtype, so a replica thread computes in the device
    type's default autocast dtype (float16 on CUDA), not the case's bf16. PyTorch's AMP
    examples ("DataParallel in a single process") put autocast in the model's forward; this
    wrapper does that without changing the model. fp32 cases enter autocast disabled.
    """

    def __init__(self, model: nn.Module, workload: Workload, device_type: str) -> None:
        super().__init__()
        self.model = model
        # Plain attributes: DataParallel's replicas are shallow copies and keep them.
        self.workload = workload
        self.device_type = device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.workload.autocast(torch.device(self.device_type)):
            out: torch.Tensor = self.model(x)
        return out


class DataParallelTrainer(Trainer):
    @property
    def output_device(self) -> torch.device:
        # Outputs are gathered on device_ids[0], so targets go there.
        return self.devices[0]


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    ids = [d.index for d in devices]
    # DataParallel keeps the master copy (and the gathered outputs) on device_ids[0]:
    # that is the memory imbalance people see on device 0.
    replica = AutocastForward(model.to(devices[0]), ctx.workload, devices[0].type)
    wrapped = nn.DataParallel(replica, device_ids=ids, output_device=ids[0])
    return DataParallelTrainer(wrapped, devices, ctx, params=model.parameters())


STRATEGY = Strategy(
    name="dp",
    description="nn.DataParallel over all GPUs (one process)",
    build=build,
    num_devices=all_devices,
    replicas=True,
    needs_cuda=True,
    shared_gpu_unsupported=("DataParallel replicates the module onto distinct GPUs (its "
                            "device_ids); two replicas on one GPU are not what it does"),
)
