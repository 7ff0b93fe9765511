"""The accumulated pairwise distance of a conv weight's kernels, three ways, differentiable.

A kernel is one output filter of a weight ``W`` of shape (out, in, kh, kw): the rows of
``X = W.reshape(out, -1)``. The quantity is ``D = sum_{p,q} ||X_p - X_q||_2`` over every
ordered pair, both orders counted and the diagonal (p == q, distance 0) included: what "sum
over p, q" says, twice the sum over p < q. Every method returns D as a scalar in the
autograd graph of ``W``, so ``D.backward()`` fills ``W.grad``.

The gradient of the Euclidean norm at 0 is undefined; every method here takes it as 0 (the
subgradient torch's norm backward uses) and none yields NaN:

- ``loop``: ``torch.norm(X[p] - X[q])`` at p == q is the norm of a zero vector, whose
  backward torch masks to 0;
- ``blocked``: ``torch.cdist`` computes Euclidean distances of more than 25 rows through a
  matrix product (``|x|^2 + |y|^2 - 2 x.y``), which leaves about 1e-8 |x| on the diagonal in
  float64 (3e-4 |x| in float32) and, through ``1 / distance``, a large gradient there. Each
  block subtracts its diagonal's sum from its sum, so the diagonal's gradient is exactly
  1 - 1 = 0 and its value leaves only rounding (tests/test_distance.py: float64 within 1e-10
  of the loop, where the plain sum is 4e-10 off in value and 1e-9 in gradient).

``split_devices`` and ``split_ranks`` split the rows over devices or ranks
(``row_ranges``) and run ``blocked`` on each share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from bench_lib.distance.spec import Layer

TORCH_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def make_weight(layer: Layer, seed: int, dtype: str, device: torch.device) -> torch.Tensor:
    """The layer's ``nn.Conv2d`` weight as torch initialises it (seeded, float32, on the CPU
    so that every device gets the same numbers), cast and moved: a leaf needing its grad."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(layer.in_channels, layer.out_channels,
                           (layer.kernel_h, layer.kernel_w), bias=False)
    weight = conv.weight.detach().to(device=device, dtype=TORCH_DTYPES[dtype])
    return weight.requires_grad_()


def kernels(weight: torch.Tensor) -> torch.Tensor:
    """The kernels as rows: (out, in * kh * kw), a view of ``weight`` in its graph."""
    return weight.reshape(weight.shape[0], -1)


def loop(weight: torch.Tensor) -> torch.Tensor:
    """D as the question writes it: a Python loop over every (p, q), one norm each.

    n^2 small autograd nodes: seconds from about 128 kernels on, for small layers only.
    """
    x = kernels(weight)
    n = x.shape[0]
    total = weight.new_zeros(())
    for p in range(n):
        for q in range(n):
            total = total + torch.norm(x[p] - x[q])
    return total


def blocked(weight: torch.Tensor, block_rows: int, rows: range | None = None) -> torch.Tensor:
    """D's terms of the kernels in ``rows`` (default: all, hence D) against every kernel,
    ``block_rows`` rows at a time through ``torch.cdist``, the blocks' sums added.

    The forward's working memory is bounded by the block: one (block_rows, n) distance
    matrix and the matrix product's operands. But autograd saves, for each block's
    backward, its distance matrix (cdist's backward needs it), so by the end of the
    forward the saved state is the whole (rows, n) matrix, n^2 numbers for D: memory grows
    with the square of the kernel count, whatever the block (the backward frees it block by
    block). Checkpointing each block (recomputing its distances in the backward) would bound
    that too, at the price of a second forward; splitting the rows over devices
    (``split_devices``, ``split_ranks``) divides it instead.
    """
    x = kernels(weight)
    rows = range(x.shape[0]) if rows is None else rows
    total = weight.new_zeros(())
    for start in range(rows.start, rows.stop, block_rows):
        stop = min(start + block_rows, rows.stop)
        d = torch.cdist(x[start:stop], x)
        # The block's diagonal holds d(p, p) for its rows: subtracted, so that its value is
        # 0 up to rounding and its gradient exactly 0 (module docstring).
        total = total + (d.sum() - d.diagonal(offset=start).sum())
    return total


def row_ranges(n: int, parts: int) -> list[range]:
    """``n`` rows cut into ``parts`` contiguous ranges whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (k < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def split_devices(weight: torch.Tensor, devices: Sequence[torch.device],
                  block_rows: int) -> torch.Tensor:
    """D with the rows spread over ``devices`` by one process (the cuda rig's ``split``).

    Each device gets a differentiable copy of the weight (``Tensor.to``) and computes
    ``blocked`` over its rows; the partial sums come back to the weight's device and are
    added there. CUDA queues each device's kernels without waiting, so the devices compute
    together; autograd runs each device's backward on that device's own thread and sums
    the copies' gradients into ``weight.grad`` on the weight's device. CPU "devices" run
    one after another: the tests' way through this code.
    """
    n = weight.shape[0]
    partials = [blocked(weight.to(device), block_rows, rows).to(weight.device)
                for device, rows in zip(devices, row_ranges(n, len(devices)))]
    return torch.stack(partials).sum()


def split_ranks(weight: torch.Tensor, rank: int, world_size: int,
                block_rows: int) -> torch.Tensor:
    """D on every rank of a process group (the cpu rig's ``split``): each rank holds the
    whole weight, computes ``blocked`` over its share of the rows, and the partial sums are
    added by the differentiable ``torch.distributed.nn.functional.all_reduce``.

    Its backward all-reduces the incoming gradient too: with every rank calling
    ``backward`` on D, each rank's partial gets ``world_size`` as its gradient, so
    ``weight.grad`` is then ``world_size`` times this rank's share. ``reduce_gradient``
    makes it the full gradient on every rank.
    """
    from torch.distributed.nn.functional import all_reduce

    partial = blocked(weight, block_rows, row_ranges(weight.shape[0], world_size)[rank])
    return cast(torch.Tensor, all_reduce(partial))


def reduce_gradient(weight: torch.Tensor, world_size: int) -> None:
    """After ``split_ranks``'s backward: ``weight.grad`` summed over the ranks and divided
    by ``world_size`` (the mean, as DDP takes it: each rank's D is a replica of the same
    scalar), so that every rank holds the full gradient of D."""
    if weight.grad is None:
        raise RuntimeError("reduce_gradient needs the backward first: weight.grad is None")
    dist.all_reduce(weight.grad)
    weight.grad.div_(world_size)


def reference(weight: torch.Tensor, block_rows: int) -> tuple[float, torch.Tensor]:
    """D and its gradient in float64 in closed form, without autograd, a block of rows at a
    time (memory bounded by the block): the figure every case is compared with.

    dD/dX_p = 2 sum_q (X_p - X_q) / ||X_p - X_q|| (p is first in one term of each pair,
    second in the other), with 0 for a zero distance as the methods take it.
    """
    x = kernels(weight.detach()).to(torch.float64)
    n = x.shape[0]
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    grad = torch.empty_like(x)
    for start in range(0, n, block_rows):
        stop = min(start + block_rows, n)
        d = torch.cdist(x[start:stop], x)
        local = torch.arange(stop - start, device=x.device)
        d[local, local + start] = 0.0  # the diagonal: exactly 0 (module docstring)
        total += d.sum()
        inverse = torch.where(d > 0, d.reciprocal(), torch.zeros_like(d))
        grad[start:stop] = 2 * (x[start:stop] * inverse.sum(1, keepdim=True) - inverse @ x)
    return float(total), grad.reshape(weight.shape)
