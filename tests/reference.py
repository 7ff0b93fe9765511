"""The single-device reference that transparency tests compare strategies against.

Float64 with BatchNorm in eval mode (running statistics): micro-batches and ranks then
compute exactly what the whole batch does, to ~1e-12.
"""

from __future__ import annotations

import functools

import torch

from bench_lib.strategies import Microbatching
from bench_lib.workloads import Workload

BATCH = 8


def reference_model(workload: Workload) -> torch.nn.Module:
    """The workload's model, seeded, in float64 and BN eval mode."""
    torch.manual_seed(0)
    return workload.build_model().double().eval()


def reference_batch(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed float64 batch of ``BATCH`` images and their targets."""
    x, y = workload.make_batch(BATCH, torch.device("cpu"), seed=1)
    return x.double(), y


def reference_shard(
    workload: Workload, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of the reference batch (data-parallel strategies)."""
    x, y = reference_batch(workload)
    shard = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    return x[shard], y[shard]


def reference_grads(workload: Workload) -> list[torch.Tensor]:
    """Gradients of one whole-batch forward and backward, in parameter order."""
    return list(_reference_grads(workload))


# Once per workload and test process: ResNet50's in float64 takes 5-15 s on 2 cores, and
# test_transparency compares three strategies with each loss against the same gradients.
# Callers only read them. A few workloads at most, to bound what a worker holds (200 MB each).
@functools.lru_cache(maxsize=4)
def _reference_grads(workload: Workload) -> tuple[torch.Tensor, ...]:
    model = reference_model(workload)
    x, y = reference_batch(workload)
    workload.loss_fn()(model(x), y).backward()
    return tuple(p.grad.clone() for p in model.parameters())


def micro(workload: Workload, split: int | None) -> Microbatching | None:
    """The micro-batching of a split size over the workload's batch (None: no split)."""
    return None if split is None else Microbatching.of(workload.batch_size, split)
