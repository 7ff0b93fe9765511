"""The calibration's block times (``prediction.calibration_timing.block_times``): the blocks
timed as a pipelining stage runs them, chained, one forward then one backward, the gradients
accumulating (#41: a block timed alone had priced 1f1b's last stage 20-30 ms a pass short on
a cpu rig, where that stage's gradient buffers are paged in afresh each backward).

The blocks here move a fake clock by known amounts in their forward and backward, so each
block's share must come back exactly: a block's backward measured from its output's
gradient to its input's, the first block's until the backward returns."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from bench_lib.measure import trace
from bench_lib.prediction import calibration_timing
from bench_lib.workloads.models import BlockStack

FORWARD = (0.010, 0.020, 0.040)
BACKWARD = (0.030, 0.005, 0.070)


class Clock:
    now = 0.0


class Tick(torch.autograd.Function):
    """Identity that moves the fake clock on by ``fwd`` in its forward, ``bwd`` in its
    backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        Clock.now += fwd
        ctx.bwd = bwd
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        Clock.now += ctx.bwd
        return grad, None, None


class Timed(nn.Module):
    def __init__(self, fwd: float, bwd: float, seen: list[bool]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.fwd, self.bwd, self.seen = fwd, bwd, seen
        # Whether the weight held a gradient when this block's backward reached it.
        self.linear.weight.register_hook(self._saw)

    def _saw(self, grad: torch.Tensor) -> None:
        self.seen.append(self.linear.weight.grad is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Tick.apply(self.linear(x), self.fwd, self.bwd)


class Inputs:
    """The two things ``block_times`` asks of a workload."""

    def make_batch(self, batch: int, device: torch.device, seed: int = 0,
                   targets: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(batch, 4, device=device), torch.zeros(batch)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture
def model(monkeypatch) -> tuple[BlockStack, list[bool]]:
    monkeypatch.setattr(trace.time, "perf_counter", lambda: Clock.now)
    seen: list[bool] = []
    return BlockStack([Timed(f, b, seen) for f, b in zip(FORWARD, BACKWARD)], 1), seen


def test_each_block_gets_its_own_forward_and_backward(model):
    stack, _ = model
    fwd, bwd = calibration_timing.block_times(stack, Inputs(), 2, torch.device("cpu"))  # type: ignore[arg-type]
    assert fwd == pytest.approx(FORWARD)
    assert bwd == pytest.approx(BACKWARD)


def test_the_gradients_accumulate_across_passes_and_are_cleared_after(model):
    stack, seen = model
    calibration_timing.block_times(stack, Inputs(), 2, torch.device("cpu"),  # type: ignore[arg-type]
                          warmup=1, repeats=2)
    # The first pass finds no gradient (autograd keeps its result), every later one finds
    # the one it adds to, as a stage's backward does from its second micro-batch on.
    assert seen == [False] * 3 + [True] * 6
    assert all(p.grad is None for p in stack.parameters())


def test_the_median_of_the_timed_passes_is_kept(model, monkeypatch):
    stack, _ = model
    # The first (warm-up) pass of the first block 10x slower, then one timed pass 2x.
    slow = iter([10.0, 2.0])
    forward = Tick.forward

    def uneven(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        factor = next(slow, 1.0) if fwd == FORWARD[0] else 1.0
        return forward(ctx, x, fwd * factor, bwd)

    monkeypatch.setattr(Tick, "forward", staticmethod(uneven))
    fwd, _ = calibration_timing.block_times(stack, Inputs(), 2, torch.device("cpu"),  # type: ignore[arg-type]
                                   warmup=1, repeats=3)
    assert fwd[0] == pytest.approx(FORWARD[0])
