"""``accum``: one device, gradient accumulation over the micro-batches a pipeline would use.

The batch is cut into micro-batches of ``split_size`` images and each one runs forward and
backward in turn before the single optimizer step. It costs what small micro-batches cost,
without any overlap: a pipeline's gain over ``accum`` is what pipelining buys, and
``accum``'s loss against ``single`` is what micro-batching costs.
"""

from __future__ import annotations

import torch
from torch import nn

from bench_lib.strategies.base import BuildContext, Strategy, Trainer, one_device


class AccumulationTrainer(Trainer):
    def __init__(self, module: nn.Module, devices: list[torch.device],
                 ctx: BuildContext) -> None:
        super().__init__(module, devices, ctx)
        self.split_size, _ = ctx.require_micro("accum")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward+backward each micro-batch; gradients sum to the full batch's."""
        batch, total = x.shape[0], torch.zeros((), device=self.output_device)
        for xs, ys in zip(x.split(self.split_size), y.split(self.split_size)):
            with self.ctx.workload.autocast(self.output_device):
                # A micro-batch's mean loss weighted by its share gives the batch's mean loss,
                # also when the last micro-batch is smaller.
                loss = self.loss_fn(self.forward(xs), ys) * (xs.shape[0] / batch)
            loss.backward()
            total += loss.detach()
        return total


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    return AccumulationTrainer(model.to(devices[0]), devices[:1], ctx)


STRATEGY = Strategy(
    name="accum",
    description="one device, gradient accumulation over split-size micro-batches (baseline)",
    build=build,
    num_devices=one_device,
    uses_split=True,
    cpu_note="one cpu worker's cores, micro-batches one after another: the cost of micro-batching",
)
