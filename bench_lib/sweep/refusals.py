"""What torch or a model would refuse, decided before anything runs from the rig's size and
the model's structure alone (no device is asked), so that a plan for an N-GPU box made
anywhere shows the same skipped rows as the box (``cases.new_case`` marks them).

The torch.distributed.pipelining schedules have their own rules (``schedule_refusal``). A
model cannot be cut into more stages than it has blocks, nor trained channels-last without
a convolution or with SyncBatchNorm without a BatchNorm (``workload_refusal``, from the
model built on the meta device): such cases are ``unsupported``, since no split, batch or
image size would make them run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from bench_lib import strategies
from bench_lib.processes.interrupts import shielded
from bench_lib.workloads import blocks, get_model

PIPELINING_STAGES_PER_RANK = {
    "gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2}
"""Stages each rank drives in the torch.distributed.pipelining strategies
(``strategies.schedules``): the model is cut into ranks x this many stages."""


@dataclass(frozen=True)
class ModelFacts:
    """What the planning needs to know of a model's structure."""

    blocks: int
    """How many blocks it has (the most stages it can be cut into)."""
    conv: bool
    """True when it has a 2-d convolution (channels-last memory format applies)."""
    batch_norm: bool
    """True when it has BatchNorm (SyncBatchNorm applies)."""


@functools.cache
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def model_facts(model: str) -> ModelFacts:
    """The structure of ``model``, built on the meta device, so no memory is filled and no
    device is touched."""
    with torch.device("meta"):
        net = get_model(model).build(1)
    modules = list(net.modules())
    return ModelFacts(len(blocks(net)), any(isinstance(m, nn.Conv2d) for m in modules),
                      any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules))


def model_blocks(model: str) -> int:
    """How many blocks ``model`` has (the most stages it can be cut into)."""
    return model_facts(model).blocks


def cut_stages(strat: strategies.Strategy, world_size: int) -> int:
    """Stages a strategy that cuts the model cuts it into on ``world_size`` devices (0 for
    strategies that do not cut it)."""
    if not strat.uses_partition:
        return 0
    return world_size * PIPELINING_STAGES_PER_RANK.get(strat.name, 1)


def _too_few_blocks(strategy: str, model: str, ranks: int, stages: int) -> str | None:
    have = model_blocks(model)
    if stages <= have:
        return None
    return (f"{strategy} on {ranks} ranks cuts the model into {stages} stages; {model} has "
            f"only {have} blocks to cut")


def workload_refusal(strat: strategies.Strategy, model: str, ranks: int, channels_last: bool,
                     sync_bn: bool) -> str | None:
    """Why ``model`` cannot be trained with ``strat`` on ``ranks`` ranks and these options,
    or None.

    A strategy that cuts the model needs a block per stage (``toy`` has 2, ``mlp`` 3: no
    4-stage interleaved or ZB-V schedule on 2 ranks); channels-last needs a convolution and
    SyncBatchNorm a BatchNorm to act on, else the case would be a relabelled copy of another.
    """
    facts = model_facts(model)
    few = _too_few_blocks(strat.name, model, ranks, cut_stages(strat, ranks))
    if few:
        return few
    if channels_last and not facts.conv:
        return (f"{model} has no convolution: the channels-last memory format does not "
                "apply")
    if sync_bn and not facts.batch_norm:
        return f"{model} has no BatchNorm: SyncBatchNorm does not apply"
    return None


def schedule_refusal(strategy: str, model: str, ranks: int, microbatches: int) -> str | None:
    """Why torch.distributed.pipelining would refuse ``strategy``'s schedule over ``ranks``
    ranks and ``microbatches`` micro-batches, or None when it builds.

    The rules are those of torch 2.14's schedule constructors (``tests/test_cuda_planning.py``
    builds torch's own schedules to hold them to it):

    - every schedule: the model is cut into ranks x stages-per-rank stages at block edges,
      so it needs that many blocks;
    - ``Schedule1F1B``: at least as many micro-batches as stages (one stage per rank);
    - ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``: the micro-batches run
      in rounds = max(1, m // ranks), and m must be a multiple of the rounds;
    - ``ScheduleGPipe``, ``ScheduleZBVZeroBubble``: any count (ZB-V pads a short one).
    """
    stages = ranks * PIPELINING_STAGES_PER_RANK[strategy]
    few = _too_few_blocks(strategy, model, ranks, stages)
    if few:
        return few
    if strategy == "1f1b" and microbatches < stages:
        return (f"1f1b needs at least as many micro-batches as stages: {microbatches} "
                f"micro-batches on {stages} stages (torch's Schedule1F1B refuses fewer)")
    if strategy in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            return (f"{strategy} runs {microbatches} micro-batches on {ranks} ranks in "
                    f"max(1, {microbatches} // {ranks}) = {rounds} rounds, and torch needs the "
                    f"count to be a multiple of the rounds")
    return None
