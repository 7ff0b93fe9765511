"""The calibration's clocks: a training step, each block's forward and backward, the
optimizer step, timed on this process's device (``prediction.calibration_worker`` runs them;
``prediction.step_time`` says what they feed).

Every figure is the median of ``REPEATS`` timed passes after ``WARMUP`` untimed ones (on
CPUs the first pass at a new batch size builds its kernels' primitives and is several times
slower), each between synchronised device clocks; a cuda rig's training steps, by the rule
below. Medians, not minima (``partition``'s
profiling keeps the fastest pass, which is right for choosing a cut): a prediction is of the
typical step.

Blocks are timed as a pipelining stage runs them (``block_times``): one forward through
every block in turn, then one backward from a gradient of ones through all of them, the
parameters' gradients accumulating into the last pass's (as a stage's do from its second
micro-batch on), each block's share stamped at its boundaries (``measure.trace``'s clock:
CUDA events on GPUs). Not one block at a time (``strategies.partition.block_costs``'
profiling, which keeps the fastest pass to choose a cut): a stage runs its blocks back to
back, and what one block leaves behind (freed buffers, caches) is what the next one finds.
Before a cpu worker kept its heap (``pinning.keep_heap``), a block timed alone had priced
1f1b's last stage 20-30 ms a pass short: its 45 MiB of layer4's and fc's gradients were
paged in afresh every backward, which the chained passes showed and a lone block did not
(ResNet50, 64 px, 2 images, 2-core AMD EPYC; #41).

A training step is timed by the rig's ``PassRule`` (``pass_rule``): on a cpu rig the fixed
``WARMUP`` + ``REPEATS`` above; on a cuda rig by ``measure.timing``'s rules, since a GPU step
is cheap and its shape's first step is not (cuDNN autotunes it: seconds): a count sized for
CPUs times too few GPU steps for a settled median, and may stop its warm-up too soon
(``CUDA_RULE``, with what a calibration should cost on an H100).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from bench_lib.measure.timing import measure_steps
from bench_lib.measure.trace import Clock, Stamp
from bench_lib.rig import synchronize
from bench_lib.workloads import Workload, blocks

WARMUP = 2
REPEATS = 3


@dataclass(frozen=True)
class PassRule:
    """How many passes a calibrated training step takes."""

    warmup: int = WARMUP
    """Untimed passes first (with ``settle``: the least of them)."""
    repeats: int = REPEATS
    """Timed passes (with ``settle``: the most of them)."""
    settle: bool = False
    """Warm up while the passes still get faster (``timing.WarmupRule``) and time until the
    median's 95% interval is within ``target_pct`` or ``max_time_s`` of timed passes is
    spent, at least 3 (``timing.AdaptiveStop``): a case's own rules, with a small budget."""
    target_pct: float = 2.0
    """The median's interval half-width aimed at, percent (the profiles' default)."""
    max_time_s: float = 0.5
    """Timed seconds a size may spend (whatever the passes' count)."""


CPU_RULE = PassRule()
"""Fixed counts: a 2-core cpu rig's step takes 0.1-1 s, and 2 + 3 of them per size is what
the prediction's error figures were measured with (docs/prediction.md)."""

CUDA_RULE = PassRule(warmup=1, repeats=50, settle=True, max_time_s=0.3)
"""A shape's first pass autotunes cuDNN (counted as warm-up), the later ones run until
steady; then 0.3 s of timed passes, or 8 where their median has settled sooner.

What a calibration should cost on one H100 with it, from the evidence run
(``resnet50-224-single-accum``: "alone at 20, 120", fp32), part by part:

- process start, CUDA context, model build and move, teardown: at most the 1.1 s of a
  case launch's fixed cost there (13.5 s over 12 launches; a launch adds a sampler and a
  traced step, which the calibration has not);
- each size's first pass: at most 3.5 s (a launch's warm-up, 46.8 s over 12 launches, is
  3.9 s for its one shape, of which its 2-4 later warm-up steps take 0.04-0.5 s): 2 x 3.5
  = 7 s, less where part of it is paid once per process (libraries, kernels loaded);
- later warm-up passes, 1-3 a size: 2 x 0.020 + 2 x 0.068 = 0.2 s;
- timed passes: batch 20, 8 x 0.020 = 0.16 s (the interval is first judged at 8); batch
  120, until 0.3 s is spent, 5 x 0.068 = 0.34 s; the optimizer, 5 x 0.0005 s;
- in all, at most 1.1 + 7 + 0.2 + 0.5 = 8.8 s; 8 s where a second shape's first pass costs
  0.8 s less than the first's.

The rule before (2 + 3 passes a size, and 5 more at the smallest size to give the
optimizer its gradients, which the alone sizes now give it) spent 0.45 s on steady passes
where this one spends 0.7 s, for medians of 5-8 passes instead of 3. So the pass counts
were not what made the evidence's calibrations take 27.8 s and 21.0 s: 13-19 s of them
lie outside every part above, and ``Calibration.parts_s`` (calibration.json, and the
"calibrated ... in" line) names where they go on the next GPU run."""


def pass_rule(kind: str) -> PassRule:
    """The pass rule of a rig of ``kind`` (``cuda`` or ``cpu``)."""
    return CUDA_RULE if kind == "cuda" else CPU_RULE


@dataclass(frozen=True)
class Passes:
    """A step's calibrated figure and what it cost."""

    median_s: float
    """The median timed pass, seconds."""
    warmup: int
    """Warm-up passes run (the first of a new shape among them)."""
    warmup_s: float
    """The warm-up passes, all together, seconds."""
    repeats: int
    """Timed passes run."""
    timed_s: float
    """The timed passes, all together, seconds."""


def step_passes(fn: Callable[[], object], devices: Sequence[torch.device],
                rule: PassRule = CPU_RULE,
                group_device: torch.device | None = None) -> Passes:
    """``fn`` timed by ``rule``, each pass between synchronised device clocks.
    ``group_device``: where a process group is up, the device on which its ranks agree a
    settling rule's warm-up and stop, so that every rank runs the same passes side by side
    (a fixed count needs no agreement)."""
    if rule.settle:
        def call() -> None:
            fn()

        found = measure_steps(call, devices, warmup_steps=rule.warmup,
                              timed_steps=rule.repeats, max_time_s=rule.max_time_s,
                              interval_target_pct=rule.target_pct, group_device=group_device)
        times = found.times_s
        return Passes(statistics.median(times), found.warmup_steps, found.warmup_time_s,
                      len(times), sum(times))
    passes = [_pass_s(fn, devices) for _ in range(rule.warmup + rule.repeats)]
    warm, times = passes[:rule.warmup], passes[rule.warmup:]
    return Passes(statistics.median(times), len(warm), sum(warm), len(times), sum(times))


def _pass_s(fn: Callable[[], object], devices: Sequence[torch.device]) -> float:
    synchronize(devices)
    t0 = time.perf_counter()
    fn()
    synchronize(devices)
    return time.perf_counter() - t0


def timed(fn: Callable[[], object], devices: Sequence[torch.device],
          warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """The median seconds of ``fn`` over ``repeats`` passes after ``warmup`` untimed ones."""
    return step_passes(fn, devices, PassRule(warmup, repeats)).median_s


COPY_REPEATS = 11
"""Timed copies into a fresh buffer: a 64 MiB one takes about 30 ms on a cpu rig, and the
median of 3 priced the same model's FSDP2 copies at 0.23 and 0.30 s in the two workloads of
one run (2-core AMD EPYC)."""


def fresh_copy_s(nbytes: int, device: torch.device, warmup: int = WARMUP,
                 repeats: int = COPY_REPEATS) -> float:
    """Seconds to copy ``nbytes`` of fp32 into a buffer allocated for the copy and freed
    after it, as FSDP2's copy-in and copy-out do each step (in a cpu worker, on pages its
    heap kept: ``pinning.keep_heap``): the median of ``repeats``."""
    source = torch.ones(max(1, nbytes // 4), device=device)
    return timed(lambda: torch.empty_like(source).copy_(source), [device], warmup, repeats)


def block_times(model: nn.Module, workload: Workload, batch: int, device: torch.device,
                warmup: int = WARMUP, repeats: int = REPEATS,
                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each block's forward and backward seconds at ``batch`` images, the medians of
    ``repeats`` chained passes after ``warmup`` (module docstring); the model's blocks stay
    on ``device`` (the caller put the model there) and its gradients are None after.

    A block's forward runs from the stamp before it to the stamp after it; its backward
    from the moment its output's gradient is ready (a tensor hook) to the moment its
    input's is, the stem's until the backward returns (its input, the image batch, needs
    no gradient); the parameters' gradients accumulate inside the block that computes them
    (autograd runs a gradient's accumulation as soon as it is ready)."""
    chain = blocks(model)
    param = next(model.parameters())
    x = workload.make_batch(batch, device, seed=123, targets=False)[0].to(param.dtype)
    if param.dim() == 4 and param.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    passes: list[tuple[list[float], list[float]]] = []
    for k in range(warmup + repeats):
        synchronize([device])
        clock = Clock([device])
        fwd_marks: list[Stamp] = []
        bwd_marks: dict[int, Stamp] = {}  # block i: its output's gradient ready
        out = x
        with workload.autocast(device):
            for i, block in enumerate(chain):
                fwd_marks.append(clock.stamp(device))
                out = block(out)
                if out.requires_grad:
                    out.register_hook(_stamp_hook(bwd_marks, i, clock, device))
        fwd_marks.append(clock.stamp(device))
        out.backward(torch.ones_like(out))
        done = clock.stamp(device)
        synchronize([device])
        del out
        if k < warmup:
            continue
        fwd = [clock.seconds(b) - clock.seconds(a) for a, b in zip(fwd_marks, fwd_marks[1:])]
        # Block i's backward ends where block i-1's begins (its input is that one's output).
        ends = [bwd_marks.get(i - 1, done) if i else done for i in range(len(chain))]
        bwd = [clock.seconds(e) - clock.seconds(bwd_marks[i]) if i in bwd_marks else 0.0
               for i, e in enumerate(ends)]
        passes.append((fwd, bwd))
    model.zero_grad(set_to_none=True)
    forward = tuple(statistics.median(p[0][i] for p in passes) for i in range(len(chain)))
    backward = tuple(statistics.median(p[1][i] for p in passes) for i in range(len(chain)))
    return forward, backward


def _stamp_hook(marks: dict[int, Stamp], i: int, clock: Clock,
                device: torch.device) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        marks[i] = clock.stamp(device)

    return hook
