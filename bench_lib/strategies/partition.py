"""Partitions: where a model's blocks are cut into pipeline / model-parallel stages.

``tutorial`` is the PyTorch tutorial's fixed cut after layer2 (even blocks for 3+ stages).
``balanced`` profiles each block's forward+backward time on this process's own device and
cores, at the micro-batch size the strategy will run, and picks the contiguous cut that
minimises the slowest stage. ``balanced-flops`` does the same with counted FLOPs: cheaper,
deterministic, but blind to how well each kernel runs on the rig. Blocks are the units
(``workloads.blocks``), so a cut never crosses a residual skip connection.
"""

from __future__ import annotations

import time
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


def _block_inputs(bs: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """The input each block sees, from one no-grad forward pass."""
    inputs = []
    with torch.no_grad():
        for b in bs:
            inputs.append(x)
            x = b(x)
    return inputs


def _time_block(block: nn.Module, x: torch.Tensor, workload: Workload) -> float:
    """Least seconds of one forward+backward of ``block`` on input ``x``.

    The minimum, not the median: on a shared machine interference only ever adds time.
    """
    times = []
    for i in range(PROFILE_REPEATS + 1):
        inp = x.detach().requires_grad_(x.is_floating_point())
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


def _block_flops(block: nn.Module, x: torch.Tensor) -> float:
    """Forward+backward FLOPs of ``block`` on input ``x`` (counted, not timed)."""
    from torch.utils.flop_counter import FlopCounterMode

    inp = x.detach().requires_grad_(x.is_floating_point())
    with FlopCounterMode(display=False) as counter:
        out = block(inp)
        out.backward(torch.ones_like(out))
    block.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def block_costs(
    model: nn.Module, workload: Workload, micro_batch: int, device: torch.device, method: str
) -> list[float]:
    """Per-block cost of one micro-batch: seconds (``time``) or FLOPs (``flops``)."""
    bs = blocks(model)
    x, _ = workload.make_batch(micro_batch, device, seed=123)
    param = next(model.parameters())
    x = x.to(dtype=param.dtype)
    if param.dim() == 4 and param.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    inputs = _block_inputs(bs, x)
    if method == "flops":
        return [_block_flops(b, i) for b, i in zip(bs, inputs)]
    return [_time_block(b, i, workload) for b, i in zip(bs, inputs)]


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
    micro_batch: int | None, device: torch.device,
) -> Partition:
    """The partition ``name`` of ``model`` into ``num_stages`` stages.

    Collective when a process group is up: every rank gets the same cut.
    """
    if name not in PARTITIONS:
        raise WorkloadError(f"unknown partition {name!r}; valid: {', '.join(PARTITIONS)}")
    if name == "tutorial":
        return Partition(name, tuple(default_cuts(model, num_stages)))
    method = "flops" if name == "balanced-flops" else "time"
    mb = micro_batch or workload.batch_size
    costs = _agree(block_costs(model, workload, mb, device, method), device)
    return Partition(name, tuple(min_max_cuts(costs, num_stages)), tuple(costs))
