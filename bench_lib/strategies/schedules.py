"""torch.distributed.pipelining schedules: ``gpipe``, ``1f1b``, ``interleaved-*``, ``zbv``.

One process per device; the model's blocks are cut into stages (the case's partition) and
each process drives its stage(s) with one of PyTorch's pipeline schedules, sending
activations and gradients point-to-point (gloo on CPUs, NCCL on GPUs). With 2 ranks and
4 micro-batches (F/B = forward/backward of micro-batch n; the bubble is the blanks):

    gpipe   rank0  F0 F1 F2 F3             B0 B1 B2 B3
            rank1     F0 F1 F2 F3 B0 B1 B2 B3
    1f1b    rank0  F0 F1    F2 B0 F3 B1    B2    B3
            rank1     F0 B0 F1 B1 F2 B2 F3 B3

The interleaved and zero-bubble schedules run two stages per rank (4 stages on 2 ranks):
``interleaved-*`` place stage s on rank s mod world, ``zbv`` folds them in a V (rank r holds
stages r and 2*world-1-r) and splits backward into input- and weight-gradient parts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pp

from bench_lib.strategies.base import (
    BuildContext,
    Builder,
    Strategy,
    TimelineStage,
    Trainer,
    all_devices,
)
from bench_lib.strategies.partition import choose
from bench_lib.workloads import split_stages


def stage_indices(rank: int, world: int, stages_per_rank: int, style: str) -> list[int]:
    """Global stage indices this rank drives (``loop``: s mod world; ``v``: folded)."""
    if stages_per_rank == 1:
        return [rank]
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(stages_per_rank)]


def stage_placement(world: int, stages_per_rank: int, style: str) -> list[int]:
    """The rank of each global stage (the inverse of ``stage_indices``)."""
    placement = [0] * (world * stages_per_rank)
    for rank in range(world):
        for stage in stage_indices(rank, world, stages_per_rank, style):
            placement[stage] = rank
    return placement


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageBoundary(nn.Module):
    """Stage edge: point-to-point sends need contiguous tensors, channels-last ones are not."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(_ContiguousGrad.apply(x))
        return out.contiguous()


def step_arguments(step: Callable[..., Any], x: torch.Tensor | None, y: torch.Tensor | None,
                   split: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of ``schedule.step`` for this torch.

    ``x``: the batch's images where this rank drives the first stage, else None; ``y``: its
    targets where it drives the last. torch 2.14 and newer take micro-batches already split
    (``arg_mbs``, ``target_mbs``). Before (2.10 to 2.13), ``step`` hands keywords it does
    not know on to the stage's module, so it gets the whole batch and splits it itself,
    with ``tensor_split`` into ``n_microbatches`` chunks: the same equal micro-batches, as
    the case's split divides the batch (``require_micro(even=True)``). Detected on the
    signature; deleting the older path is one edit once the floor reaches 2.14.
    """
    kwargs: dict[str, Any] = {"return_outputs": False}  # the last stage merges no logits
    if "arg_mbs" in inspect.signature(step).parameters:
        if x is not None:
            kwargs["arg_mbs"] = [(mb,) for mb in x.split(split)]
        if y is not None:
            kwargs["target_mbs"] = list(y.split(split))
        return (), kwargs
    if y is not None:
        kwargs["target"] = y
    return ((x,) if x is not None else ()), kwargs


def skip_warmup_sends_to_self(stage: pp.PipelineStage) -> None:
    """Drop the warm-up messages ``stage`` would address to its own rank.

    Before its first step a schedule sends a dummy tensor to each stage's neighbours
    (``_get_init_p2p_neighbors_ops``), also where the neighbour lives on the same rank
    (``zbv``'s V: stages 1 and 2 on rank 1 of 2), and gloo cannot send to its own rank
    ("Pair is not connected"): torch 2.10 and 2.11. torch 2.14 checks ``_is_same_rank``
    first and warms neighbours up with a vote instead (the method is not called for a
    ``PipelineStage``), and 2.15 has no such method: there this changes nothing. A
    message to oneself warms nothing up.
    """
    if not hasattr(stage, "_get_init_p2p_neighbors_ops"):
        return  # torch 2.15 and newer: nothing to drop
    own = stage.group_rank
    ops = stage._get_init_p2p_neighbors_ops

    def to_other_ranks() -> list[dist.P2POp]:
        return [op for op in ops() if op.group_peer != own]

    setattr(stage, "_get_init_p2p_neighbors_ops", to_other_ranks)  # noqa: B010


class PipeliningTrainer(Trainer):
    """This rank's stage(s) of a torch.distributed.pipelining schedule.

    It holds its own stages only: the others, and the whole model, are left to the caller
    (which drops them), and only the device-side copies of its own stages are made.
    """

    def __init__(self, model: nn.Module, devices: list[torch.device], ctx: BuildContext,
                 schedule_cls: type, stages_per_rank: int, style: str) -> None:
        (device,) = devices
        self.split_size, self.num_microbatches = ctx.require_micro("pipelining", even=True)
        num_stages = ctx.world_size * stages_per_rank
        placement = stage_placement(ctx.world_size, stages_per_rank, style)
        # A balanced partition profiles the blocks on this rank's device, one at a time;
        # with 2 stages per rank it balances each rank's summed load.
        self.partition = choose(ctx.partition, model, num_stages, ctx.workload,
                                ctx.stage_batch_size, device,
                                placement=placement if stages_per_rank > 1 else None)
        stages = [StageBoundary(s) for s in split_stages(model, list(self.partition.cuts))]
        self.stage_ids = stage_indices(ctx.rank, ctx.world_size, stages_per_rank, style)
        self.stages = [stages[i].to(device) for i in self.stage_ids]
        self.pipe_stages = [
            pp.PipelineStage(stages[i], i, num_stages, device) for i in self.stage_ids
        ]
        for stage in self.pipe_stages:
            skip_warmup_sends_to_self(stage)
        self.owns_first, self.owns_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        base_loss, n = ctx.workload.loss_fn(), self.num_microbatches

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Equal micro-batches: the mean of their mean losses is the batch's mean loss.
            return base_loss(logits, target) / n

        single = stages_per_rank == 1
        self.schedule = schedule_cls(
            self.pipe_stages[0] if single else self.pipe_stages, self.num_microbatches,
            loss_fn=loss_fn, scale_grads=False,
        )
        super().__init__(nn.ModuleList(self.stages), devices, ctx)

    @property
    def local_batch_size(self) -> int:
        # Every rank of a pipeline sees the whole batch's micro-batches (or none of them).
        return self.ctx.workload.batch_size

    @property
    def needs_images(self) -> bool:
        return self.owns_first

    @property
    def needs_targets(self) -> bool:
        return self.owns_last

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Run the schedule over the batch's micro-batches; returns the loss (last stage)."""
        losses: list[torch.Tensor] = []
        args, kwargs = step_arguments(self.schedule.step, x if self.owns_first else None,
                                      y if self.owns_last else None, self.split_size)
        with self.ctx.workload.autocast(self.devices[0]):
            self.schedule.step(*args, losses=losses, **kwargs)
        if losses:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros(())

    def compile(self) -> None:
        """Compile each stage's blocks; the boundary stays eager (Inductor drops .contiguous())."""
        for stage in self.stages:
            stage.body.compile()

    def timeline_stages(self) -> list[TimelineStage]:
        """Each stage this process drives, all on its one device; the traced step stamps
        the pipelining stage's own F, B (input gradient) and W (weight gradient) passes."""
        return [TimelineStage(i, 0, stage, pipe) for i, stage, pipe
                in zip(self.stage_ids, self.stages, self.pipe_stages)]


def _builder(schedule_cls: type, stages_per_rank: int, style: str) -> Builder:
    def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
        """Build this rank's stages; the process group must already be initialised."""
        return PipeliningTrainer(model, devices, ctx, schedule_cls, stages_per_rank, style)

    return build


_CPU_NOTE = ("one process per cpu worker running its stage(s); activations and gradients "
             "cross between workers through gloo point-to-point over loopback")


_NO_COMPILE_ZB = ("zero-bubble schedules split backward into input- and weight-gradient "
                  "passes, which torch.distributed.pipelining does not support for "
                  "torch.compile'd stages")


def _strategy(name: str, description: str, schedule_cls: type, spr: int, style: str) -> Strategy:
    zero_bubble = "ZeroBubble" in schedule_cls.__name__
    return Strategy(
        name=name, description=description, build=_builder(schedule_cls, spr, style),
        num_devices=all_devices, per_device_processes=True, uses_split=True,
        uses_partition=True, even_split=True, cpu_note=_CPU_NOTE,
        compile_unsupported=_NO_COMPILE_ZB if zero_bubble else "",
        shared_gpu_unsupported=("ranks sharing a GPU talk through gloo (NCCL refuses two "
                                "ranks on one GPU), and gloo has no send/recv of CUDA "
                                "tensors, which the pipeline stages exchange"),
    )


SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
    "interleaved-1f1b": pp.ScheduleInterleaved1F1B,
    "interleaved-zb": pp.ScheduleInterleavedZeroBubble, "zbv": pp.ScheduleZBVZeroBubble,
}
"""Each strategy's torch schedule (``prediction.memory`` replays its order of actions)."""

STRATEGIES = [
    _strategy("gpipe", "torch.distributed.pipelining GPipe: all forwards, then all backwards",
              SCHEDULE_CLASSES["gpipe"], 1, "loop"),
    _strategy("1f1b", "torch.distributed.pipelining 1F1B: one forward, one backward in "
              "steady state",
              SCHEDULE_CLASSES["1f1b"], 1, "loop"),
    _strategy("interleaved-1f1b", "torch.distributed.pipelining interleaved 1F1B, 2 stages per "
              "rank",
              SCHEDULE_CLASSES["interleaved-1f1b"], 2, "loop"),
    _strategy("interleaved-zb", "torch.distributed.pipelining interleaved zero bubble, 2 "
              "stages/rank",
              SCHEDULE_CLASSES["interleaved-zb"], 2, "loop"),
    _strategy("zbv", "torch.distributed.pipelining ZB-V zero bubble, 2 stages per rank in a V",
              SCHEDULE_CLASSES["zbv"], 2, "v"),
]
