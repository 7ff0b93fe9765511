"""A pipelined case's predicted step: the ``gpipe``, ``1f1b``, ``interleaved-*`` and ``zbv``
rows of ``prediction.step_time``'s formulas (and ``pipeline`` on GPUs, as GPipe's order).

torch's action lists (``prediction.schedule_orders.schedule_actions``) are replayed
(``analysis.bound.pipeline_bound``) with each stage's forward and backward: the sum of its
blocks' together times at the micro-batch, scaled so that the blocks add up to the step
less the optimizer's (``stage_passes``; a block timed alone misses the step's glue: loss,
the graph's own overhead). The cut is the one the balanced partition picks from the same
block times (``balanced-flops`` and ``tutorial``: their own cut, ``fixed_cuts``); a
``balanced`` case's first launch then runs that cut (``calibrated_cut``). Transfers are
priced at the send/recv fit between processes, and ``pipeline``'s ``.to()`` in one process
at the device copy's (``analysis.bound.transfer_fit``: measured, or assumed and said so in
the formula), each at the bytes of the activation crossing the cut in the case's precision;
each rank steps its stages' parameters (O / N). Zero-bubble
schedules split a backward into its input and weight gradients: half each.

Pure arithmetic but for ``pipeline_parts`` and ``fixed_cuts``, which import torch's
schedules and the model's sizes on demand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bench_lib.analysis.bound import (
    PIPELINED,
    Action,
    Bound,
    pipeline_bound,
    placement_of,
    transfer_fit,
)
from bench_lib.prediction.calibration_data import BatchCosts, Calibration
from bench_lib.prediction.case_shape import Shape

if TYPE_CHECKING:
    from bench_lib.analysis.collective_fits import Collectives
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case


ZERO_BUBBLE = ("interleaved-zb", "zbv")
"""Schedules that split a backward into input and weight gradients (actions I and W)."""


Cutter = Callable[[Sequence[float], Sequence[int]], Sequence[int]]
"""(per-block costs, each stage's rank) -> the cut's block indices (``partition``'s)."""


@dataclass(frozen=True)
class PipelineParts:
    """What a pipelined prediction needs besides the calibration: torch's action list per
    rank, how the cut is chosen, and the transfer time of one micro-batch at each cut."""

    orders: Sequence[Sequence[Action]]
    cutter: Cutter
    edge_s: Callable[[Sequence[int]], Sequence[float]] = lambda cuts: ()
    """The cut -> each boundary's transfer time for one micro-batch (none: free)."""
    transfer_note: str = ""
    """What the formula says of the transfers' fit (``analysis.bound.transfer_fit``): the
    assumed copy's note, where the transfers were priced with it."""


def stage_passes(costs: BatchCosts, cuts: Sequence[int], optimizer_s: float,
                 zero_bubble: bool = False) -> dict[tuple[int, str] | tuple[int, str, int], float]:
    """Each stage's forward and backward (and, ``zero_bubble``, weight gradient) from its
    blocks' times, scaled so that every block adds up to the step less the optimizer's."""
    blocks = sum(costs.forward_s) + sum(costs.backward_s)
    glue = (costs.step_s - optimizer_s) / blocks if blocks > 0 else 1.0
    bounds = [0, *cuts, len(costs.forward_s)]
    times: dict[tuple[int, str] | tuple[int, str, int], float] = {}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        f, bwd = sum(costs.forward_s[a:b]) * glue, sum(costs.backward_s[a:b]) * glue
        times[s, "fwd"] = f
        if zero_bubble:
            times[s, "bwd"] = times[s, "wgt"] = bwd / 2
        else:
            times[s, "bwd"] = bwd
    return times


def pipelined(shape: Shape, cal: Calibration, parts: PipelineParts) -> Bound | str:
    """A pipelining schedule replayed with calibrated stage passes; ``pipeline`` on GPUs
    as GPipe's order."""
    b = shape.device_batch
    costs = cal.together.get(b)
    if costs is None or not costs.forward_s:
        raise KeyError(f"block times at batch {b}")
    cuts = list(parts.cutter(calibrated_block_costs(costs), stage_ranks(parts.orders)))
    zero_bubble = shape.strategy in ZERO_BUBBLE
    times = stage_passes(costs, cuts, cal.optimizer_s, zero_bubble)
    edges = parts.edge_s(cuts)
    found = pipeline_bound(shape.strategy, parts.orders, times, edges,
                           cal.optimizer_s / shape.devices)
    if parts.transfer_note and any(edges):
        found = replace(found, formula=f"{found.formula} ({parts.transfer_note})")
    if zero_bubble:
        found = replace(found, formula=f"{found.formula} (backward split half input, half "
                                       "weight gradient)")
    return replace(found, formula=f"{found.formula} cut {','.join(map(str, cuts))}")


def calibrated_block_costs(costs: BatchCosts) -> list[float]:
    """Each block's forward + backward: what the balanced partition weighs."""
    return [f + b for f, b in zip(costs.forward_s, costs.backward_s)]


def stage_ranks(orders: Sequence[Sequence[Action]]) -> list[int]:
    """The rank of each stage, in stage order."""
    placement = placement_of(orders)
    return [placement[s] for s in sorted(placement)]


def pipeline_parts(case: Case, rig: Rig, collectives: Collectives | None) -> PipelineParts:
    """torch's action lists for ``case``'s schedule (``pipeline`` on GPUs: GPipe's), the
    cut its partition picks from block costs (``balanced``; ``balanced-flops`` and
    ``tutorial``: the cut they choose without timing), and the transfer time of one
    micro-batch at each boundary: the send/recv fit's between processes, the device copy's
    inside ``pipeline``'s one process (``analysis.bound.transfer_fit``)."""
    from bench_lib.prediction.schedule_orders import schedule_actions
    from bench_lib.strategies.partition import min_max_cuts, min_max_rank_cuts
    from bench_lib.workloads.sizes import boundary_bytes

    name = "gpipe" if case.strategy == "pipeline" else case.strategy
    orders = schedule_actions(name, case.world_size, case.num_microbatches or 1)
    method, _, given = (case.partition or "tutorial").partition(":")

    def cutter(costs: Sequence[float], stages: Sequence[int]) -> Sequence[int]:
        if method != "balanced" or given:
            return fixed_cuts(case)
        if len(set(stages)) < len(stages):
            return min_max_rank_cuts(list(costs), stages)
        return min_max_cuts(list(costs), len(stages))

    fit, note = transfer_fit(case.process_group, collectives)
    micro = case.split_size or case.batch_size
    # ``pipeline``, one process: a boundary between two slots of one GPU moves nothing.
    moves = case.process_group or rig.moves_between(0, 1)

    def edges(cuts: Sequence[int]) -> Sequence[float]:
        if fit is None:
            return ()
        return [fit.time_s(b) if moves else 0.0
                for b in boundary_bytes(case.model, case.image_size, micro, tuple(cuts),
                                        case.precision)]

    return PipelineParts(orders, cutter, edges, note)


def fixed_cuts(case: Case) -> Sequence[int]:
    """The cut a case runs where no block is timed to choose it: a given cut
    (``balanced:6,12``), ``tutorial``'s or ``balanced-flops``' (``prediction.memory``'s choice,
    the one the memory prediction uses; for ``balanced``, too, where only that is known)."""
    from bench_lib.prediction.memory import cut_label, num_stages
    from bench_lib.workloads import Workload

    w = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                 precision=case.precision)
    label = cut_label(case, w, num_stages(case), "")
    return tuple(int(c) for c in label.partition(":")[2].split(",") if c)


def calibrated_cut(case: Case, rig: Rig, cal: Calibration | None) -> str:
    """The ``balanced`` cut of a pipelined case chosen from the calibration's block times
    at its micro-batch (every device computing, as the case's own first-launch profiling
    measures them), as a ``Partition.label`` for the case to run (``CaseSpec.cut``): its
    first launch then profiles nothing. Empty where the calibration has no such blocks, or
    the case cuts no model, or not by ``balanced``."""
    method, _, given = (case.partition or "").partition(":")
    if cal is None or method != "balanced" or given:
        return ""
    if case.strategy not in PIPELINED:
        return ""
    costs = cal.together.get(case.split_size or case.batch_size)
    if costs is None or not costs.forward_s:
        return ""
    parts = pipeline_parts(case, rig, None)
    cuts = parts.cutter(calibrated_block_costs(costs), stage_ranks(parts.orders))
    return f"balanced:{','.join(map(str, cuts))}"
