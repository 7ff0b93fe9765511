"""One training step of one process's share of a model, run on fake tensors to count memory.

A ``Program`` says what one process holds (some stages of the model's blocks, its inputs,
persistent buffers) and the order in which it runs forwards and backwards of its
micro-batches. ``simulate`` builds the model under PyTorch's ``FakeTensorMode`` (tensors
with shapes, dtypes and strides but no data: nothing is computed, no memory is filled, no
device is touched) and runs the step under ``LiveBytes``, a dispatch mode that adds up the
bytes of every live tensor storage as autograd allocates and frees them: the method of
``torch.distributed._tools.MemTracker``, without its per-module bookkeeping, which refuses
a module run twice in a step (as every micro-batch runs its stage). What it reports is the
step's peak of live tensor bytes, with the parameters and gradients live at that moment,
and the step's allocations and frees in order, where its convolutions ran and which of its
threads ran a matmul (``Footprint.trace``, ``matmul_threads``): what ``prediction.cuda_memory``
runs through a GPU's caching allocator and its libraries' workspaces.

The step is the strategies' own: ``zero_grad(set_to_none=True)`` (so no gradient is live
as it starts), forwards and backwards in the program's order (gradients accumulate),
then ``torch.optim.SGD.step`` (plain SGD, as ``strategies.base.Trainer`` builds it:
no optimizer state). Ops are dispatched as on the CPU (autocast included), so kernels
that keep workspaces outside tensors (oneDNN's scratchpads, cuDNN's workspaces) are not
seen; ``prediction.memory`` and ``prediction.cuda_memory`` say how that is accounted for.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench_lib.prediction.allocator import Event
from bench_lib.prediction.kept_counts import kept
from bench_lib.processes.interrupts import shielded
from bench_lib.strategies.base import LEARNING_RATE
from bench_lib.strategies.schedules import StageBoundary
from bench_lib.workloads import Workload, split_stages

Action = tuple[str, int, int]
"""(kind, stage, micro-batch). Kinds: ``F`` forward, ``B`` full backward, ``I`` input
gradient and ``W`` weight gradient (zero-bubble schedules split the backward in two: the
activations are counted held until ``W``, which runs the whole backward, an upper bound).
``stage`` is a global stage index, one of the program's ``stages``."""
CPU = torch.device("cpu")
aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                     aten.baddbmm.default})
"""Ops that run in cuBLAS on a GPU (a linear layer's forward and backward are these)."""
CONVOLUTIONS = frozenset({aten.convolution.default, aten.convolution_backward.default})
"""Ops that run in cuDNN on a GPU, each with a workspace of its own."""
COALESCE_BYTES = 10 * 2**20
"""The chunk ``torch.cuda.comm.reduce_add_coalesced`` flattens gradients in (its default
``buffer_size``, which ``nn.DataParallel``'s backward takes)."""


@dataclass(frozen=True)
class Program:
    """What one process holds and runs in one training step."""

    workload: Workload
    """The model, image size, loss and precision (its ``batch_size`` is not read)."""
    cuts: tuple[int, ...]
    """Block indices where the model's stages start (empty: one stage, the whole model)."""
    stages: tuple[int, ...]
    """Global indices of the stages this process holds, in order."""
    micro_batches: tuple[int, ...]
    """Images of each micro-batch this process runs (one entry: no split)."""
    actions: tuple[Action, ...]
    """What it runs, in order; the optimizer step follows."""
    channels_last: bool = False
    """Model and inputs in channels-last memory format."""
    pipelining: bool = False
    """A torch.distributed.pipelining rank: each stage is wrapped in the contiguity boundary,
    keeps a receive buffer per micro-batch for its input (all but the first stage) and for
    its output's gradient (all but the last), allocated once and held from step to step,
    and the last stage's loss is divided by the micro-batch count."""
    extra_bytes: int = 0
    """Bytes held from step to step besides these tensors (DDP's gradient buckets)."""
    source_batch: int = 0
    """The whole batch where this is ``nn.DataParallel``'s source (``device_ids[0]``; 0: it
    is not): it holds the batch's input and targets, gathers every replica's output before
    the loss and reduces their gradients onto it (``reduce_to_source``)."""


@dataclass(frozen=True)
class Footprint:
    """A program's counted memory, bytes."""

    peak: int
    """Peak of live tensor bytes over the step, everything held included."""
    params: int
    """Parameters held (also live at the peak: they always are)."""
    grads_at_peak: int
    """Parameter gradients live at the peak."""
    held: int
    """Bytes live as the step starts and after it: parameters, inputs, buffers, allocated
    once before the first step; the rest of ``peak`` is allocated and freed by each step."""
    held_sizes: tuple[int, ...] = ()
    """The bytes of each storage in ``held``."""
    trace: tuple[Event, ...] = ()
    """The step's allocations and frees in order, and where a convolution ran (what
    ``prediction.allocator.replay`` runs through a GPU's caching allocator)."""
    matmul_threads: int = 0
    """Threads that run a matmul in the step, of two: the forward's and, on a GPU, the
    autograd engine's device thread that runs the backward (cuBLAS keeps a workspace per
    thread's handle)."""


class LiveBytes(TorchDispatchMode):
    """Bytes of the live tensor storages, and their peak, as ops run under it.

    A storage counts from the op that first returns it (or from ``hold``) until it is freed
    (a weak reference's callback). At each new peak the gradients of ``params`` then live
    are noted.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.params = params
        self.live = self.peak = self.grads_at_peak = 0
        self._seen: dict[int, int] = {}  # storage id -> its size
        # Kept: a weak reference that is itself collected never calls back.
        self._refs: list[weakref.ref[torch.UntypedStorage]] = []
        self.trace: list[Event] = []
        """From ``start_trace`` on: allocations, frees and convolutions, in order."""
        self._index: dict[int, int] | None = None  # storage id -> its allocation's index
        self._allocations = 0
        self.phase = "F"
        """The action running: "F" forward, else a backward (set by the step)."""
        self.matmul_phases: set[str] = set()

    def start_trace(self) -> tuple[int, ...]:
        """Record the step's events from now on; returns the sizes of the storages live."""
        self._index = {}
        return tuple(self._seen.values())

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s storages (once each) until they are freed."""
        for st in get_untyped_storages(t):
            key = id(st)
            if key in self._seen:
                continue
            size = st.nbytes()
            self._seen[key] = size
            self.live += size
            if self._index is not None:
                self._index[key] = self._allocations
                self._allocations += 1
                self.trace.append(("alloc", size))
            self._refs.append(weakref.ref(st, functools.partial(self._free, key, size)))
        if self.live > self.peak:
            self.peak = self.live
            self.grads_at_peak = sum(p.grad.untyped_storage().nbytes() for p in self.params
                                     if p.grad is not None)

    def _free(self, key: int, size: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        self._seen.pop(key, None)
        self.live -= size
        if self._index is not None and key in self._index:
            self.trace.append(("free", self._index.pop(key)))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.hold(t)
        if func in MATMULS:
            self.matmul_phases.add("F" if self.phase == "F" else "B")
        if func in CONVOLUTIONS and self._index is not None:
            self.trace.append(("conv", 0))  # its workspace comes after its outputs
        return out


def _stage_inputs(stages: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Size]:
    """Each stage's input shape for input ``x`` (and the last one's output shape after)."""
    shapes = [x.shape]
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
            shapes.append(x.shape)
    return shapes


def _batch(w: Workload, images: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A (fake) input batch and its targets, as ``Workload.make_batch`` makes them."""
    x = torch.empty(images, *w.input_shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if w.loss == "mse":
        return x, torch.empty(images, w.num_classes)
    return x, torch.zeros(images, dtype=torch.long)


def gathered(out: torch.Tensor, source_batch: int) -> torch.Tensor:
    """``out`` as the loss sees it: on DataParallel's source, every replica's output
    gathered into one tensor of ``source_batch`` rows (the others' rows a view of ``out``:
    the gather copies them straight into its result); elsewhere ``out`` itself."""
    if not source_batch or source_batch == len(out):
        return out
    return torch.cat([out, out[:1].expand(source_batch - len(out), *out.shape[1:])])


def reduce_to_source(params: Sequence[nn.Parameter]) -> None:
    """DataParallel's backward's end on its source: the replicas' gradients summed onto it
    by ``reduce_add_coalesced`` in chunks (``COALESCE_BYTES``, grouped as torch's
    ``_take_tensors`` groups them), each a flat copy of its own replica's (freed) and the
    flat sum (kept). Then its replica's gradients are freed and the sums become the
    parameters': counted as the sums freed instead, the same bytes."""
    sums, chunk = [], 0
    sizes = [q.grad.untyped_storage().nbytes() for q in params if q.grad is not None]
    for i, size in enumerate(sizes):
        chunk += size
        if i + 1 < len(sizes) and chunk + sizes[i + 1] <= COALESCE_BYTES:
            continue
        flat = torch.empty(chunk, dtype=torch.uint8)
        sums.append(torch.empty(chunk, dtype=torch.uint8))
        del flat
        chunk = 0
    del sums


def _footprint(kept: dict[str, Any]) -> Footprint:
    """A footprint from its JSON (``kept_counts``); raises on a field missing or odd."""
    return Footprint(int(kept["peak"]), int(kept["params"]), int(kept["grads_at_peak"]),
                     int(kept["held"]), tuple(int(n) for n in kept["held_sizes"]),
                     tuple((str(kind), int(n)) for kind, n in kept["trace"]),
                     int(kept["matmul_threads"]))


@functools.cache
@kept("footprints", dataclasses.asdict, _footprint)
@shielded()  # torch calls back into Python here: a Ctrl-C waits (processes.interrupts)
def simulate(p: Program) -> Footprint:
    """Count ``p``'s memory over one training step (module docstring); cached per program,
    in this process and on disk (``prediction.kept_counts``)."""
    with FakeTensorMode():
        model = p.workload.build_model()
        if p.channels_last:
            model = model.to(memory_format=torch.channels_last)
        every = list(split_stages(model, list(p.cuts)))
        # Two images: BatchNorm in training refuses one of 1x1 pixels (a ResNet at 32 px).
        shapes = _stage_inputs(every, _batch(p.workload, 2, p.channels_last)[0])
        modules: dict[int, nn.Module] = {
            s: StageBoundary(every[s]) if p.pipelining else every[s] for s in p.stages}
        params = [q for m in modules.values() for q in m.parameters()]
        optimizer = torch.optim.SGD(params, lr=LEARNING_RATE)
        return _run(p, modules, shapes, len(every), params, optimizer)


def _run(p: Program, modules: dict[int, nn.Module], shapes: list[torch.Size], n: int,
         params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> Footprint:
    """Run the program's step under the tracker (already inside the fake mode)."""
    w, mbs = p.workload, list(p.micro_batches)
    first, last = 0 in p.stages, n - 1 in p.stages
    whole = p.source_batch or sum(mbs)
    x = _batch(w, whole if first else 0, p.channels_last)[0]  # only what it reads
    y = _batch(w, whole if last else 0, p.channels_last)[1]
    xs = x[:sum(mbs)].split(mbs) if first else ()
    ys = (y,) if p.source_batch else y.split(mbs) if last else ()
    recv: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> its input's buffer
    grad_recv: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> output grad's
    if p.pipelining:
        for s in p.stages:
            for i, b in enumerate(mbs):
                if s > 0:
                    recv[s, i] = torch.empty(b, *shapes[s][1:], requires_grad=True)
                if s < n - 1:
                    grad_recv[s, i] = torch.empty(b, *shapes[s + 1][1:])
    held = [x, y, torch.empty(p.extra_bytes, dtype=torch.uint8), *recv.values(),
            *grad_recv.values()]
    loss_fn, scale = w.loss_fn(), 1 / len(mbs)
    pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    tracker = LiveBytes(params)
    for t in [*params, *held]:
        tracker.hold(t)
    start, held_sizes = tracker.live, tracker.start_trace()
    with tracker:
        for kind, s, i in p.actions:
            tracker.phase = kind
            if kind == "F":
                inp = xs[i] if s == 0 else recv.get((s, i))
                if inp is None:  # sent by another device: held until its backward
                    inp = torch.empty(mbs[i], *shapes[s][1:], requires_grad=True)
                with w.autocast(CPU):
                    out = modules[s](inp)
                    if s == n - 1:
                        out = loss_fn(gathered(out, p.source_batch), ys[i]) * scale
                pending[s, i] = (out, inp)
            elif kind in ("B", "W"):
                out, inp = pending.pop((s, i))
                grad = None
                if s < n - 1:  # the gradient of the output, from the next stage
                    grad = grad_recv[s, i] if (s, i) in grad_recv else torch.empty_like(out)
                out.backward(grad)
                if inp.requires_grad:
                    inp.grad = None  # sent to the previous stage, then let go
                del out, inp, grad
        if p.source_batch:
            reduce_to_source(params)
        optimizer.step()
        trace = tuple(tracker.trace)  # before the locals' storages go at return
    return Footprint(tracker.peak, sum(q.numel() * q.element_size() for q in params),
                     tracker.grads_at_peak, start, held_sizes, trace,
                     len(tracker.matmul_phases))
