"""Partitions: where a model's blocks are cut into pipeline / model-parallel stages.

``tutorial`` is the tutorial's fixed cut the model declares (``workloads.tutorial_cut``: a
ResNet after layer2, ``toy`` after its ReLU, ``mlp`` after its first layer; even blocks for
3+ stages).
``balanced`` profiles each block's forward+backward time on this process's own device and
cores, at the micro-batch size the strategy will run, and picks the contiguous cut that
minimises the slowest stage, or, where a rank drives several stages (interleaved and ZB-V
schedules), the most loaded rank: the sum of its stages' costs. ``balanced-flops`` does the
same with counted FLOPs: cheaper, deterministic, but blind to how well each kernel runs on
the rig. Blocks are the units (``workloads.blocks``), so a cut never crosses a residual skip
connection.

Profiling goes block by block: each block moves to the device, is profiled on the input it
sees there, computes the next block's input and goes back where it was, so the device holds
one block and one input at a time (not the whole model and every block's input). The first
block (the stem) is profiled without an input gradient: its input is the image batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bench_lib.rig import synchronize
from bench_lib.workloads import Workload, WorkloadError, blocks, default_cuts

PARTITIONS = ("tutorial", "balanced", "balanced-flops")
PROFILE_REPEATS = 3  # timed passes per block after one warm-up; the fastest is kept


@dataclass(frozen=True)
class Partition:
    """A chosen cut: its method, the cut block indices and each block's measured cost."""

    name: str
    """One of ``PARTITIONS``."""
    cuts: tuple[int, ...]
    """Block indices where stages start (stage i is blocks[cuts[i-1]:cuts[i]])."""
    block_costs: tuple[float, ...] = ()
    """Per-block cost used to choose the cut (seconds or FLOPs); empty for ``tutorial``."""
    placement: tuple[int, ...] = ()
    """Rank of each stage where ranks drive several stages; empty: stage i on device i."""

    @property
    def label(self) -> str:
        """The case row's ``partition`` value, e.g. ``balanced:6,12``."""
        return f"{self.name}:{','.join(map(str, self.cuts))}"

    def stage_costs(self) -> list[float]:
        """Summed block cost of each stage (empty when no costs were measured)."""
        if not self.block_costs:
            return []
        bounds = [0, *self.cuts, len(self.block_costs)]
        return [sum(self.block_costs[a:b]) for a, b in zip(bounds, bounds[1:])]

    def rank_costs(self) -> list[float]:
        """Summed cost of each rank's stages (the stage costs where no placement is set)."""
        stages = self.stage_costs()
        return rank_loads(stages, self.placement) if self.placement and stages else stages


def rank_loads(stage_costs: Sequence[float], placement: Sequence[int]) -> list[float]:
    """Each rank's load: the sum of the costs of the stages placed on it."""
    loads = [0.0] * (max(placement) + 1)
    for cost, rank in zip(stage_costs, placement, strict=True):
        loads[rank] += cost
    return loads


def min_max_cuts(costs: list[float], num_stages: int) -> list[int]:
    """Cut points splitting ``costs`` into contiguous non-empty stages with the least maximum.

    Exact dynamic programme, O(stages * blocks^2); ties go to the earliest cut.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise WorkloadError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: least max stage cost putting the first j blocks into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], choice[k][j] = value, i
    cuts, j = [], n
    for k in range(num_stages, 1, -1):
        j = choice[k][j]
        cuts.append(j)
    return sorted(cuts)


def min_max_rank_cuts(costs: list[float], placement: Sequence[int]) -> list[int]:
    """Cut points splitting ``costs`` into ``len(placement)`` contiguous non-empty stages,
    stage s on rank ``placement[s]``, with the least load on the most loaded rank (a rank's
    load is the sum of its stages' costs).

    Exact: a depth-first search over the cuts (costs are non-negative, so a stage that
    already overloads its rank cuts off every longer one), bounded from the start by the
    min-max stage cut; ties (within float rounding) keep that cut, then the earliest found.
    """
    n, num_stages = len(costs), len(placement)
    best_cuts = min_max_cuts(costs, num_stages)  # also checks the stage count
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def worst_rank(cuts: Sequence[int]) -> float:
        bounds = [0, *cuts, n]
        return max(rank_loads([prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])],
                              placement))

    best = worst_rank(best_cuts)
    slack = 1e-9 * prefix[n]  # a better cut must beat the best by more than rounding
    loads = [0.0] * (max(placement) + 1)
    cuts: list[int] = []

    def search(stage: int, start: int) -> None:
        nonlocal best, best_cuts
        rank = placement[stage]
        if stage == num_stages - 1:
            value = max(max(loads), loads[rank] + prefix[n] - prefix[start])
            if value < best - slack:
                best, best_cuts = value, list(cuts)
            return
        for end in range(start + 1, n - (num_stages - 1 - stage) + 1):
            add = prefix[end] - prefix[start]
            if loads[rank] + add >= best - slack:
                break
            loads[rank] += add
            cuts.append(end)
            search(stage + 1, end)
            cuts.pop()
            loads[rank] -= add

    search(0, 0)
    return best_cuts


def _time_block(block: nn.Module, x: torch.Tensor, workload: Workload,
                input_grad: bool = True) -> float:
    """Least seconds of one forward+backward of ``block`` on input ``x``.

    The minimum, not the median: on a shared machine interference only ever adds time.
    ``input_grad``: compute the gradient of the input too (every block but the stem).
    """
    times = []
    for i in range(PROFILE_REPEATS + 1):
        inp = x.detach().requires_grad_(input_grad and x.is_floating_point())
        synchronize([x.device])
        t0 = time.perf_counter()
        with workload.autocast(x.device):
            out = block(inp)
        out.backward(torch.ones_like(out))
        synchronize([x.device])
        if i:  # the first pass warms up allocators and kernels
            times.append(time.perf_counter() - t0)
    block.zero_grad(set_to_none=True)
    return min(times)


def block_flops(block: nn.Module, x: torch.Tensor, input_grad: bool = True) -> float:
    """Forward+backward FLOPs of ``block`` on input ``x`` (counted, not timed)."""
    from torch.utils.flop_counter import FlopCounterMode

    inp = x.detach().requires_grad_(input_grad and x.is_floating_point())
    with FlopCounterMode(display=False) as counter:
        out = block(inp)
        out.backward(torch.ones_like(out))
    block.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def block_costs(
    model: nn.Module, workload: Workload, micro_batch: int, device: torch.device, method: str
) -> list[float]:
    """Per-block cost of one micro-batch on ``device``: seconds (``time``) or FLOPs (``flops``).

    Block by block (the module docstring says why); each block is left where it was.
    """
    bs = blocks(model)
    param = next(model.parameters())
    x = workload.make_batch(micro_batch, device, seed=123, targets=False)[0].to(param.dtype)
    if param.dim() == 4 and param.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    costs = []
    for i, block in enumerate(bs):
        home = next(block.parameters(), x).device
        block.to(device)
        if method == "flops":
            costs.append(block_flops(block, x, input_grad=i > 0))
        else:
            costs.append(_time_block(block, x, workload, input_grad=i > 0))
        if i + 1 < len(bs):
            with torch.no_grad(), workload.autocast(device):
                x = block(x)  # the next block's input; this block's is freed here
        block.to(home)
    return costs


def _agree(costs: list[float], device: torch.device) -> list[float]:
    """Average the costs over the ranks, so every rank of a process group picks the same cut."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return costs
    t = torch.tensor(costs, dtype=torch.float64, device=device)  # NCCL reduces only on GPUs
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def choose(
    name: str, model: nn.Module, num_stages: int, workload: Workload,
    micro_batch: int | None, device: torch.device, placement: Sequence[int] | None = None,
) -> Partition:
    """The partition ``name`` of ``model`` into ``num_stages`` stages, profiled on ``device``.

    ``placement``: the rank of each stage, where a rank drives several (the balanced cut
    then minimises the most loaded rank); None: one stage per device. Collective when a
    process group is up: every rank gets the same cut. ``name`` may also be a chosen cut's
    label (``Partition.label``, e.g. ``balanced:6,12``): that cut is used as it is, without
    profiling (a case's later launches reuse its first launch's cut).
    """
    name, _, given = name.partition(":")
    if name not in PARTITIONS:
        raise WorkloadError(f"unknown partition {name!r}; valid: {', '.join(PARTITIONS)}")
    if given:
        try:
            cuts = tuple(int(c) for c in given.split(","))
        except ValueError:
            raise WorkloadError(f"bad cut {given!r}: block indices, e.g. 6,12") from None
        if len(cuts) != num_stages - 1 or list(cuts) != sorted(set(cuts)) or cuts[0] < 1:
            raise WorkloadError(f"cut {given!r} does not make {num_stages} stages")
        shared = placement is not None and len(set(placement)) < len(placement)
        return Partition(name, cuts, (), tuple(placement) if shared and placement else ())
    if name == "tutorial":
        return Partition(name, tuple(default_cuts(model, num_stages)))
    method = "flops" if name == "balanced-flops" else "time"
    mb = micro_batch or workload.batch_size
    costs = _agree(block_costs(model, workload, mb, device, method), device)
    if placement is not None and len(set(placement)) < len(placement):
        if len(placement) != num_stages:
            raise WorkloadError(f"placement {list(placement)} does not place {num_stages} "
                                "stages")
        return Partition(name, tuple(min_max_rank_cuts(costs, placement)), tuple(costs),
                         tuple(placement))
    return Partition(name, tuple(min_max_cuts(costs, num_stages)), tuple(costs))
