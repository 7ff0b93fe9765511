"""Each rank's passes (forward, backward, and the zero-bubble schedules' input and weight
gradients) in the order its torch schedule runs them, as ``(kind, stage, micro-batch)``
actions: what the memory prediction (``prediction.memory``) replays on fake tensors, and
what the step-time prediction (``prediction.pipeline_time``) and a pipelined case's bound
(``rows.case_bound``) replay with pass times.
"""

from __future__ import annotations

import functools

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import _ComputationType

from bench_lib.prediction.fake_step import Action
from bench_lib.strategies.schedules import SCHEDULE_CLASSES
from bench_lib.sweep.refusals import PIPELINING_STAGES_PER_RANK

_KINDS = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
          _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}


@functools.cache
def schedule_actions(strategy: str, world: int, microbatches: int
                      ) -> tuple[tuple[Action, ...], ...]:
    """Each rank's computations in the order its torch schedule runs them.

    GPipe and 1F1B run one stage per rank from code (``_step_microbatches``), mirrored
    here: 1F1B's rank r runs min(m, stages - r) forwards, then alternates a backward and a
    forward, then the remaining backwards. The multi-stage schedules run their own
    ``pipeline_order``, which torch's schedule visualizer returns (its order for 1F1B is
    not the one that runs: it numbers rank 1's micro-batches from 1 in torch 2.14).
    """
    if strategy == "gpipe":
        return tuple(fill_drain(r, microbatches) for r in range(world))
    if strategy == "1f1b":
        return tuple(_one_f_one_b(r, world, microbatches) for r in range(world))
    ops = get_schedule_ops(SCHEDULE_CLASSES[strategy], world, microbatches,
                           PIPELINING_STAGES_PER_RANK[strategy])
    return tuple(tuple((_KINDS[a.computation_type], a.stage_index, int(a.microbatch_index or 0))
                       for a in rank if a is not None and a.computation_type in _KINDS)
                 for rank in ops)


def _one_f_one_b(rank: int, stages: int, count: int) -> tuple[Action, ...]:
    """Torch's ``Schedule1F1B`` on ``rank``: warm-up forwards, then 1B1F, then cool-down."""
    warmup = min(count, stages - rank)
    order: list[Action] = [("F", rank, i) for i in range(warmup)]
    for i in range(count):
        order.append(("B", rank, i))
        if warmup + i < count:
            order.append(("F", rank, warmup + i))
    return tuple(order)


def fill_drain(stage: int, count: int) -> tuple[Action, ...]:
    """Every micro-batch's forward, then every backward (GPipe's order on one stage)."""
    return (tuple(("F", stage, i) for i in range(count))
            + tuple(("B", stage, i) for i in range(count)))
