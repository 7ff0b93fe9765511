"""The calibration's clocks: a training step, each block's forward and backward, the
optimizer step, timed on this process's device (``run.calibration_worker`` runs them;
``sweep.predict_time`` says what they feed).

Every figure is the median of ``REPEATS`` timed passes after ``WARMUP`` untimed ones (on
CPUs the first pass at a new batch size builds its kernels' primitives and is several times
slower), each between synchronised device clocks. Medians, not minima (``partition``'s
profiling keeps the fastest pass, which is right for choosing a cut): a prediction is of the
typical step.

Blocks go one at a time, as ``strategies.partition.block_costs`` profiles them: each block
on the input it sees in the model, its forward timed, then its backward from a gradient of
ones (the input's gradient too, except for the stem, whose input is the image batch).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from bench_lib.rig import synchronize
from bench_lib.workloads import Workload, blocks

WARMUP = 2
REPEATS = 3


def timed(fn: Callable[[], object], devices: Sequence[torch.device],
          warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """The median seconds of ``fn`` over ``repeats`` passes after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeats):
        synchronize(devices)
        t0 = time.perf_counter()
        fn()
        synchronize(devices)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fresh_copy_s(nbytes: int, device: torch.device, warmup: int = WARMUP,
                 repeats: int = REPEATS) -> float:
    """Seconds to copy ``nbytes`` of fp32 into a buffer allocated for the copy and freed
    after it, as FSDP2's copy-in and copy-out do each step (on a CPU the fresh pages' faults
    cost more than the bytes)."""
    source = torch.ones(max(1, nbytes // 4), device=device)
    return timed(lambda: torch.empty_like(source).copy_(source), [device], warmup, repeats)


def block_times(model: nn.Module, workload: Workload, batch: int, device: torch.device,
                warmup: int = WARMUP, repeats: int = REPEATS,
                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each block's forward and backward seconds at ``batch`` images (module docstring);
    the model's blocks stay on ``device`` (the caller put the model there)."""
    param = next(model.parameters())
    x = workload.make_batch(batch, device, seed=123, targets=False)[0].to(param.dtype)
    if param.dim() == 4 and param.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    forward, backward = [], []
    for i, block in enumerate(blocks(model)):
        grad_in = i > 0 and x.is_floating_point()
        fwd, bwd = [], []
        for k in range(warmup + repeats):
            inp = x.detach().requires_grad_(grad_in)
            synchronize([device])
            t0 = time.perf_counter()
            with workload.autocast(device):
                out = block(inp)
            synchronize([device])
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            synchronize([device])
            if k >= warmup:
                fwd.append(t1 - t0)
                bwd.append(time.perf_counter() - t1)
            del out, inp
        block.zero_grad(set_to_none=True)
        forward.append(statistics.median(fwd))
        backward.append(statistics.median(bwd))
        with torch.no_grad(), workload.autocast(device):
            x = block(x)
    return tuple(forward), tuple(backward)
