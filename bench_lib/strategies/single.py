"""``single``: the whole batch on one device, the baseline every speedup is relative to."""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, one_device


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    return Trainer(model.to(devices[0]), devices[:1], ctx)


STRATEGY = Strategy(
    name="single",
    description="one device, whole batch (baseline)",
    build=build,
    num_devices=one_device,
    cpu_note="one cpu worker's cores and threads, so speedups mean the same as on GPUs",
)
