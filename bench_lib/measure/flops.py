"""Training FLOPs, counted: per image of a workload model, forward and backward (MFU's
numerator; its denominator, the rig's attainable peak, is ``measure.flop_peak``'s).

Counts come from ``torch.utils.flop_counter`` (matmuls and convolutions; normalisation and
element-wise work are not counted, as in the usual MFU definition).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench_lib.processes.interrupts import shielded
from bench_lib.workloads import LossFn, Workload


def conv_flops(batch: int, c_in: int, c_out: int, h_out: int, w_out: int, kernel: int) -> int:
    """Forward FLOPs of a dense 2-d convolution (a multiply and an add per weight tap)."""
    return 2 * batch * c_out * h_out * w_out * c_in * kernel * kernel


def count_train_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> int:
    """FLOPs of one forward and backward pass of ``model`` on the batch ``x``."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return int(counter.get_total_flops())


@functools.cache
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def train_flops_per_image(model: str, image_size: int) -> float:
    """Training FLOPs (forward + backward) per image (per sample: ``toy``'s is a vector) of
    a workload model, with its own head, inputs and default loss (cached)."""
    # Two images, not one: BatchNorm in training mode needs more than one value per channel
    # where a small image has shrunk to 1x1. Meta tensors count shapes without computing.
    workload = Workload(model, image_size, batch_size=2)
    meta = torch.device("meta")
    with meta:
        net = workload.build_model()
    x, y = workload.make_batch(2, meta)
    return count_train_flops(net, x, y, workload.loss_fn()) / 2
