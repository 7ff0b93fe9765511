"""``mp``: naive model parallelism, the tutorial's ``ModelParallelResNet50``.

The model's blocks are cut in two (by default the tutorial's cut: a ResNet after layer2,
``toy`` after its ReLU, ``mlp`` after its first layer); stage 0 lives on device 0, stage 1
on device 1, and one process runs them one after another.
"""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import (
    BuildContext,
    Strategy,
    TimelineStage,
    Trainer,
    two_devices,
)
from bench_lib.strategies.partition import choose
from bench_lib.workloads import split_stages


class ModelParallelTrainer(Trainer):
    def __init__(self, model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> None:
        # The case's partition (tutorial: after layer2); balanced profiles on device 0,
        # block by block, then each stage moves to its own device.
        self.partition = choose(ctx.partition, model, len(devices), ctx.workload,
                                ctx.stage_batch_size, devices[0])
        stages = split_stages(model, list(self.partition.cuts))
        self.stages = [s.to(d) for s, d in zip(stages, devices)]
        super().__init__(nn.Sequential(*self.stages), devices, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x

    def timeline_stages(self) -> list[TimelineStage]:
        # Stage i runs on devices[i]: one process, one device slot per stage.
        return [TimelineStage(i, i, stage) for i, stage in enumerate(self.stages)]


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    return ModelParallelTrainer(model, devices, ctx)


STRATEGY = Strategy(
    name="mp",
    description="naive model parallel: the model cut in two (ResNet: conv1..layer2 on device 0, "
    "layer3..fc on device 1)",
    build=build,
    num_devices=two_devices,
    uses_partition=True,
    cpu_note=(
        "cpu rig: one process, pinned to one worker's cores and threads like single, runs "
        "the two stages one after another; as with naive model parallelism on GPUs, one "
        "device is busy at a time"
    ),
)
