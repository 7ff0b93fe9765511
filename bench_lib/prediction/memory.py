"""Peak memory per device of a case, predicted before it runs: the suite's model of memory.

What a device holds at its peak is counted, not guessed: each process's share of one
training step is replayed on fake tensors (``prediction.fake_step``: PyTorch's
``FakeTensorMode``, under a dispatch mode that adds up every live tensor storage as
autograd allocates and frees it, as ``torch.distributed._tools.MemTracker`` does). That
counts, per process,

- the parameters of the stages it holds, and their gradients as backward makes them
  (``zero_grad(set_to_none=True)`` frees them as each step starts);
- optimizer state: none, since every strategy steps plain SGD without momentum;
- the activations autograd saves for backward, for as many micro-batches as the schedule
  keeps in flight, and backward's transient tensors (activation gradients);
- its input images and targets, and buffers held from step to step.

Per strategy (B the batch, s the split size, W the world size):

- ``single``: the whole model, one forward and backward of B images; ``accum``: of each
  micro-batch in turn, gradients accumulating.
- ``ddp`` (each rank; ``ddp-1``: W = 1): the whole model on B/W images, plus DDP's
  gradient buckets (one flat copy of every gradient); with ``gradient_as_bucket_view`` the
  gradients are views of the buckets, so they are not counted twice. PowerSGD's hook adds
  its error feedback (one copy of every gradient) and, for the bucket it decompresses, two
  more copies of it (``_powersgd_bytes``; ResNet50 at 64 px, batch 16, 2 cores: ddp-1 695
  MiB predicted, 677 measured; ddp's ranks 634 and 777, 18% under: with a peer, the hook's
  callbacks run on gloo's thread, plausibly allocating from another malloc arena); the
  fp16 and bf16 hooks' compressed copy of one bucket at a time is not counted.
- ``dp`` (one process, ``nn.DataParallel``): each device a replica's step on its chunk of
  B/W images (its parameters broadcast to it, its gradients), and device 0, the source
  (``device_ids[0]``), more (``Program.source_batch``): the whole batch's input and
  targets (it scatters them from there), every replica's output gathered before the loss,
  and at the end of the backward the replicas' gradients reduced onto it, a second copy
  of every gradient beside its own replica's, plus one flat chunk (up to 10 MiB) at a
  time (``fake_step.reduce_to_source``). Its master parameters are the replica it runs;
  SGD without momentum keeps no optimizer state; the broadcast's flat chunks on device 0
  (as the forward starts, with little else live) are not counted.
- ``fsdp`` (each rank): the whole model's step on B/W images, with the parameters and
  gradients live at its peak sharded W ways, plus what FSDP2 holds unsharded in flight in
  the backward of its largest unit, four times that unit's parameter bytes: its parameters
  all-gathered, its gradients, their copy into the reduce-scatter's input, and the next unit
  prefetched (counted as large). The root's own parameters (a ResNet's stem and head) are
  counted with the units'. No FSDP run is replayed; checked against the live tensors of real
  FSDP2 steps (gloo, 2 ranks, ResNet50 batch 16; the same ``LiveBytes`` on real tensors):
  375.1, 439.0 and 528.5 MiB at 64, 96 and 128 px, counted here 366.7, 421.0 and 519.2
  (with three units, as first written, 13-17% under).
- ``mp``: each stage on its device, one forward and backward of B images.
- ``pipeline``: every micro-batch's activations are held until the single backward (the
  tutorial concatenates the outputs before the loss), as GPipe does.
- ``gpipe``, ``1f1b``, ``interleaved-*``, ``zbv`` (each rank): its stages, in the order in
  which its torch schedule runs them (``prediction.schedule_orders``: GPipe holds every
  micro-batch before the first backward, 1F1B at most stages - rank of them), plus the
  receive buffers a pipelining stage keeps per micro-batch (its input's, its output
  gradient's). Zero-bubble schedules hold a micro-batch's activations until its weight
  gradient: an upper bound.

On a cpu rig a process that drives both "devices" (``mp``, ``pipeline``) is one process on
one worker's memory: its prediction is the whole model's, under the joined label ("0+1"),
as ``peak_mem_net_mib_by_device`` records it; so is one driving two slots of one GPU
(``--gpu-slots``), whose one allocator serves both.

Assumptions: eager mode (``--compile`` is predicted as eager); autocast's casts as the
CPU's autocast makes them. ``balanced`` cuts
are chosen in the case's first launch from measured block times: before it, the
prediction uses the ``balanced-flops`` cut, and after it the cut the case ran
(``Prediction.cut`` says which).

Calibration: on a cpu rig the measured figure is the process's resident memory net of its
footprint before the model was built, and resident memory is not live tensors. Replaying
the real CPU step (real kernels, the same counter) gives exactly the fake count (ResNet50,
batch 16: 276.3 MiB at 64 px, 579.5 MiB at 128), while the resident peak is about 1.4x
that (383.8 and 827.9 MiB): glibc's malloc raises its mmap threshold each time it frees
a large mmapped block (up to 32 MiB), so after the first step the activations come from
its heap, which keeps freed pages resident and fragments. With the threshold pinned
(``MALLOC_MMAP_THRESHOLD_=131072``) the same steps hold about 35 MiB over the tensors
(oneDNN's kernels and scratchpads, autograd's graph). The workers run with glibc's
defaults, so the prediction on a cpu rig is the count times ``CPU_HEAP_FACTOR``, except for
DDP's gradient buckets: allocated once as DDP wraps the model, before any step has raised
the threshold, they are mmapped and resident once (scaled, its ranks read 7-17% over at
64 px; counted once, 0-7%: issue #17's note). The factor belongs to the allocation
pattern, not to the count, and one factor cannot fit every pattern: GPipe's first stage
at 128 px, eight micro-batches of two images, holds 402.3 MiB of live tensors (counted
405.5) at 455.7 MiB resident, 1.13x, so it is predicted 22% over (12% over with four
micro-batches of four, 1.22x; 8% at 64 px, 1.31x); 1F1B's last stage at 64 px reads
1.50-1.75x, 12-14% under (``benchmarks/heap_factor.py`` replays a stage on real tensors
in its schedule's order and prints both figures).

On a cuda rig the count is run through the caching allocator, with cuBLAS's and cuDNN's
workspaces beside it (``prediction.cuda_memory``): the allocator's peak (``mib_by_device``) and
the segments it reserves (``reserved_mib_by_device``), what a card must hold, and what
admission compares with it. Checked against the first GPU run (an H100,
``tests/test_predict_memory_gpu_evidence.py``): -0.1% to +3.8% of the allocator's peak over 14
cases, where the bare count was 0.8-39% under.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from bench_lib import strategies
from bench_lib.analysis.bound import DDP_BUCKET_BYTES
from bench_lib.prediction.cuda_memory import cublas_workspace_bytes, on_gpu
from bench_lib.prediction.fake_step import Action, Footprint, Program, simulate
from bench_lib.prediction.kept_counts import kept
from bench_lib.prediction.schedule_orders import fill_drain, schedule_actions
from bench_lib.processes.interrupts import shielded
from bench_lib.rig import Rig
from bench_lib.strategies.partition import (
    block_flops,
    choose,
    min_max_cuts,
    min_max_rank_cuts,
)
from bench_lib.strategies.schedules import SCHEDULE_CLASSES
from bench_lib.sweep.cases import Case
from bench_lib.sweep.refusals import PIPELINING_STAGES_PER_RANK
from bench_lib.workloads import Workload, blocks, shard_units

MIB = 2**20
CPU_HEAP_FACTOR = 1.41
"""A cpu worker's resident peak over its peak of live tensor bytes (module docstring):
fitted on ``single`` alone, ResNet50 at batch 16 on a 2-core cpu rig, where it was 1.396
at 64 px and 1.418 at 128 px, and then held to the other strategies (issue #17's note)."""


@dataclass(frozen=True)
class Prediction:
    """A case's predicted peak memory per device, MiB, and what it was made with."""

    mib_by_device: dict[str, float]
    """Device label (as in ``peak_mem_mib_by_device``) -> predicted peak, MiB: on a cuda
    rig the caching allocator's (``max_memory_allocated``), on a cpu rig resident memory."""
    cut: str = ""
    """The stage cut it assumed (``Partition.label``), '' for strategies that do not cut."""
    reserved_mib_by_device: dict[str, float] = field(default_factory=dict)
    """Device label -> the predicted peak the device must hold, MiB: on a cuda rig the
    caching allocator's segments (``max_memory_reserved``: its blocks' rounding, cache and
    fragmentation), what a card runs out of; on a cpu rig, or left empty, ``mib_by_device``
    (resident memory holds the heap's own)."""

    def __post_init__(self) -> None:
        if not self.reserved_mib_by_device:
            object.__setattr__(self, "reserved_mib_by_device", dict(self.mib_by_device))

    @property
    def max_mib(self) -> float:
        """The largest per-device prediction, MiB."""
        return max(self.mib_by_device.values())

    @property
    def reserved_max_mib(self) -> float:
        """The largest per-device reserved prediction, MiB."""
        return max(self.reserved_mib_by_device.values())

    def per_device_text(self) -> str:
        """``0:390;1:426``: each device's predicted peak, MiB (the dry run's column)."""
        return ";".join(f"{k}:{v:.0f}" for k, v in sorted(self.mib_by_device.items()))


def predict(case: Case, rig: Rig, cut: str = "") -> Prediction:
    """The peak memory of each device of ``case`` on ``rig`` (module docstring).

    ``cut``: the stage cut the case ran (``Partition.label``, e.g. ``balanced:6``); empty:
    the one its partition gives before any launch.
    """
    label, counts = _counts(case, rig, cut)
    mib, reserved = {}, {}
    for device, (counted, once, f) in counts.items():
        if rig.kind == "cpu":
            mib[device] = (CPU_HEAP_FACTOR * (counted - once) + once) / MIB
            continue
        # The allocator's excess over the step's own count, added to the case's count
        # (which shards or shares some of the step's bytes: fsdp, DDP's bucket views).
        peaks = on_gpu(f, cublas_workspace_bytes())
        mib[device] = (counted + peaks.allocated - f.peak) / MIB
        reserved[device] = (counted + peaks.reserved - f.peak) / MIB
    return Prediction(mib, label, reserved if rig.kind == "cuda" else {})


def counted_mib(case: Case, rig: Rig, cut: str = "") -> dict[str, float]:
    """The live tensor bytes each device's process holds at its peak, MiB: the count
    ``predict`` starts from, before the rig's allocator (module docstring)."""
    return {device: c[0] / MIB for device, c in _counts(case, rig, cut)[1].items()}


Count = tuple[float, float, Footprint]
"""A process's counted peak, the part of it held once, and its footprint (``_bytes``)."""


@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def _counts(case: Case, rig: Rig, cut: str) -> tuple[str, dict[str, Count]]:
    """The cut's label, and per device its process's ``Count``."""
    w = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                 precision=case.precision)
    stages = num_stages(case)
    label = cut_label(case, w, stages, cut) if stages > 1 else ""
    cuts = tuple(int(c) for c in label.partition(":")[2].split(",")) if label else ()
    base = Program(w, cuts, (0,), (case.batch_size,), (("F", 0, 0), ("B", 0, 0)),
                   channels_last=case.channels_last)
    programs = _programs(case, rig, base, stages)
    return label, {device: _bytes(case, p) for device, p in programs.items()}


def num_stages(case: Case) -> int:
    """Stages the case's strategy cuts the model into (1 where it does not cut it)."""
    if case.partition is None:
        return 1
    return case.world_size * PIPELINING_STAGES_PER_RANK.get(case.strategy, 1)


def cut_label(case: Case, w: Workload, stages: int, cut: str) -> str:
    """The cut to predict with, as a ``Partition.label``: ``cut`` when given, else the
    case's partition, chosen without data (``balanced``: ``balanced-flops``'s)."""
    if cut:
        return cut
    name = case.partition or "tutorial"
    placement: tuple[int, ...] = ()
    if PIPELINING_STAGES_PER_RANK.get(case.strategy, 1) > 1:  # each rank's stages, as torch
        ops = schedule_actions(case.strategy, case.world_size, len(_splits(case)))
        placement = tuple(r for s in range(stages) for r, a in enumerate(ops)
                          if any(stage == s for _, stage, _ in a))
    method = "tutorial" if name == "tutorial" else "balanced-flops"
    cuts = _chosen_cut(w, stages, case.split_size or case.batch_size, method, placement)
    return f"{name}:{','.join(map(str, cuts))}"


@functools.cache
@kept("cuts", list, lambda cuts: tuple(int(c) for c in cuts))
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def _chosen_cut(w: Workload, stages: int, micro_batch: int, method: str,
                placement: tuple[int, ...]) -> tuple[int, ...]:
    """The cut ``partition.choose`` makes with ``method`` (``tutorial`` or
    ``balanced-flops``), from FLOPs counted on fake tensors as ``block_costs`` counts them
    (which cannot run here: fake parameters refuse its moves of each block)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = w.build_model()
        if method == "tutorial":
            return choose(method, model, stages, w, micro_batch, torch.device("cpu")).cuts
        x = torch.empty(micro_batch, *w.input_shape)
        costs = []
        for i, block in enumerate(blocks(model)):
            costs.append(block_flops(block, x, input_grad=i > 0))
            with torch.no_grad():
                x = block(x)
    if placement and len(set(placement)) < len(placement):
        return tuple(min_max_rank_cuts(costs, placement))
    return tuple(min_max_cuts(costs, stages))


def _programs(case: Case, rig: Rig, base: Program, stages: int) -> dict[str, Program]:
    """What each device's process holds and runs, by device label."""
    b, world = case.batch_size, case.world_size
    splits = _splits(case)
    whole = dataclasses.replace(base, cuts=())
    if strategies.get(case.strategy).shares_batch:
        local = dataclasses.replace(whole, micro_batches=(case.device_batch_size,))
        shares = {str(r): local for r in range(world)}
        if strategies.get(case.strategy).replicas and world > 1:  # dp: its source's extra
            shares["0"] = dataclasses.replace(local, source_batch=b)
        return shares
    if case.strategy == "accum":
        return {"0": dataclasses.replace(whole, micro_batches=splits,
                                         actions=_sequential(0, len(splits)))}
    if case.strategy in ("mp", "pipeline"):
        mbs = splits if case.strategy == "pipeline" else (b,)
        # One process on one worker's memory, or on one GPU's allocator (slots of
        # --gpu-slots share their GPU): the whole model's, under the joined label.
        if rig.kind == "cpu" or rig.gpu_slots >= world:
            return {"+".join(map(str, range(world))): dataclasses.replace(
                whole, micro_batches=mbs, actions=fill_drain(0, len(mbs)))}
        return {str(d): dataclasses.replace(base, stages=(d,), micro_batches=mbs,
                                            actions=fill_drain(d, len(mbs)))
                for d in range(stages)}
    if case.strategy in SCHEDULE_CLASSES:
        ranks = schedule_actions(case.strategy, world, len(splits))
        return {str(r): dataclasses.replace(
            base, stages=tuple(sorted({s for _, s, _ in actions})), micro_batches=splits,
            actions=actions, pipelining=True) for r, actions in enumerate(ranks)}
    return {"0": whole}  # single


def _splits(case: Case) -> tuple[int, ...]:
    """The micro-batch sizes of the case (the whole batch where it has no split)."""
    s = case.split_size
    if not s:
        return (case.batch_size,)
    full, rest = divmod(case.batch_size, s)
    return (s,) * full + ((rest,) if rest else ())


def _sequential(stage: int, count: int) -> tuple[Action, ...]:
    """Forward then backward of each micro-batch in turn (gradient accumulation)."""
    return tuple(a for i in range(count) for a in (("F", stage, i), ("B", stage, i)))


def _bytes(case: Case, p: Program) -> Count:
    """The program's counted peak, with DDP's buckets and FSDP's sharding applied; the
    part of it allocated once before the first step and never freed (DDP's buckets), which
    the heap factor does not scale (module docstring); and the footprint counted."""
    if case.strategy in ("ddp", "ddp-1"):
        buckets = simulate(p).params
        hook = _powersgd_bytes(case, buckets)
        f = simulate(dataclasses.replace(p, extra_bytes=buckets + hook))
        if case.ddp is not None and case.ddp.gradient_as_bucket_view:
            return f.peak - f.grads_at_peak, buckets, f  # the gradients live in the buckets
        return f.peak, buckets, f
    f = simulate(p)
    if case.strategy != "fsdp":
        return f.peak, 0, f
    return _fsdp_bytes(f, case.world_size, _largest_unit_bytes(p.workload)), 0, f


def _powersgd_bytes(case: Case, gradient_bytes: int) -> int:
    """What torch's PowerSGD hook holds beyond DDP's buckets (0 for other hooks): its error
    feedback, one copy of every gradient, kept from step to step, plus, for the bucket
    being decompressed, its input's copy and the new error made beside the old one (two
    copies of the largest bucket). P and Q (rank x the matrices' sides) and the uncompressed
    vectors' concatenation are small and not counted. All allocated after the first steps,
    so heap: scaled like the activations."""
    if case.ddp is None or case.ddp.comm_hook != "powersgd":
        return 0
    cap = case.ddp.bucket_cap_mb
    largest = DDP_BUCKET_BYTES if cap is None else int(cap * 2**20)
    return gradient_bytes + 2 * min(largest, gradient_bytes)


def _fsdp_bytes(f: Footprint, world: int, unit: int) -> float:
    """FSDP2's peak from the unsharded step's: parameters and gradients sharded, plus four
    times the largest unit's parameters in flight (module docstring)."""
    sharded = (f.params + f.grads_at_peak) / world
    return f.peak - f.params - f.grads_at_peak + sharded + 4 * unit


@functools.cache
def _largest_unit_bytes(w: Workload) -> int:
    """Bytes of the parameters of the model's largest FSDP unit (on the meta device)."""
    with torch.device("meta"):
        model = w.build_model()
    return max(sum(p.numel() * p.element_size() for p in u.parameters())
               for u in shard_units(model))
