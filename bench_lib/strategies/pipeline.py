"""``pipeline``: the tutorial's ``PipelineParallelResNet50(split_size)``.

The batch is cut into micro-batches of ``split_size`` images. While stage 1 runs
micro-batch i on device 1, stage 0 can already run micro-batch i+1 on device 0: this
overlap exists only because CUDA kernels launch asynchronously. One process drives
both devices; the backward pass runs through autograd as one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, two_devices
from bench_lib.strategies.mp import ModelParallelTrainer


class PipelineTrainer(ModelParallelTrainer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (first, second), (d0, d1) = self.stages, self.devices
        split_size, _ = self.ctx.require_micro("pipeline")
        splits = iter(x.split(split_size, dim=0))
        prev = first(next(splits).to(d0)).to(d1)
        outputs = []
        for nxt in splits:
            outputs.append(second(prev))  # device 1 works on micro-batch i ...
            prev = first(nxt.to(d0)).to(d1)  # ... while device 0 starts micro-batch i+1
        outputs.append(second(prev))
        return torch.cat(outputs)


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    ctx.require_micro("pipeline")
    if len(devices) != 2:
        raise ValueError(f"pipeline runs on exactly 2 devices, got {len(devices)}")
    return PipelineTrainer(model, devices, ctx)


STRATEGY = Strategy(
    name="pipeline",
    description="the tutorial's micro-batch pipelining over 2 devices in one process",
    build=build,
    num_devices=two_devices,
    uses_split=True,
    uses_partition=True,
    cpu_note=(
        "cpu rig: one process, pinned to one worker's cores and threads like single, no "
        "asynchronous device work, so micro-batches run one after another: this measures "
        "the cost of micro-batching, not pipeline overlap"
    ),
)
