"""The measured pipeline timeline: when each stage runs each micro-batch's passes.

One extra step runs after the timed steps (so those stay undisturbed), with stamps on the
stages a trainer drives (``Trainer.timeline_stages()``). Phases: ``fwd`` (forward), ``bwd``
(input gradient, or the whole backward where it is not split) and ``wgt`` (the weight
gradient of the zero-bubble schedules). Two ways to stamp:

- torch.distributed.pipelining stages (``gpipe``, ``1f1b``, ``interleaved-*``, ``zbv``):
  the stage's own per-micro-batch methods are wrapped for the step, so each schedule action
  is one interval, with its micro-batch index::

      forward_one_chunk          fwd
      backward_one_chunk         bwd   (full_backward=False: input gradient only)
      backward_weight_one_chunk  wgt

  torch runs the first stage's whole backward in its W pass (its input needs no
  gradient), so there ``bwd`` is a sliver and ``wgt`` holds the work: as it really runs.

- one process over several devices (``mp``, ``pipeline``: autograd runs the backward):
  hooks on the stage module. Forward: forward pre-hook / forward hook. Backward: a hook on
  the stage's output tensor (its gradient has arrived) to a hook on its input tensor (its
  gradient is computed). Tensor hooks rather than module backward hooks, because each
  forward call registers its own, so a backward stamp knows its micro-batch whatever order
  autograd runs them in. A first stage whose input needs no gradient gets a detached copy
  that does: the only change the traced step sees is one extra input-gradient of its first
  layer.

Each interval is labelled with its device: ``slot_labels`` name the trainer's device slots
(the worker passes ``cpu:0``/``cpu:1`` on a cpu rig, where torch calls both "cpu").

Stamps are ``time.perf_counter`` on CPU and CUDA events on GPUs (resolved after a
synchronize against an event recorded at the step's start), in seconds on the host's
monotonic clock: one clock for every rank on a host, so the runner can put the ranks of a
case on one time axis (``align``). ``analysis.bubble`` reads the idle share per device off
the rows; the report draws them as a Gantt chart (``report.gantt``)::

    device 0 |F0|F1|F2|F3|          |B3|B2|B1|B0|
    device 1    |F0|F1|F2|F3|B3|B2|B1|B0|
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from bench_lib.rig import synchronize

if TYPE_CHECKING:
    from bench_lib.strategies.base import TimelineStage

TimelineRow = dict[str, Any]
"""One timeline.csv row: stage, device, microbatch, phase, start_s, end_s (and rank)."""

Stamp = float | tuple[torch.device, torch.cuda.Event]

# The pipelining stage's method per phase (``analysis.bubble.PHASES``); each takes the
# micro-batch index first.
PIPE_METHODS = {"fwd": "forward_one_chunk", "bwd": "backward_one_chunk",
                "wgt": "backward_weight_one_chunk"}


class Clock:
    """Stamps on the monotonic clock: perf_counter on CPU, CUDA events on GPUs."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._refs: dict[torch.device, torch.cuda.Event] = {}
        for d in {d for d in devices if d.type == "cuda"}:
            self._refs[d] = torch.cuda.Event(enable_timing=True)
            self._refs[d].record(torch.cuda.current_stream(d))
        self._t0 = time.perf_counter()

    def stamp(self, device: torch.device) -> Stamp:
        if device.type == "cuda":
            # Recorded on the stream the stamped work was queued on: stamps are stream-ordered.
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return device, event
        return time.perf_counter()

    def seconds(self, stamp: Stamp) -> float:
        """A stamp in perf_counter seconds (CUDA events must have completed)."""
        if isinstance(stamp, float):
            return stamp
        device, event = stamp
        # The reference event was recorded right after a synchronize, i.e. at _t0.
        return self._t0 + float(self._refs[device].elapsed_time(event)) / 1000.0


class _Recorder:
    """Stamps the start and end of every (stage, micro-batch, phase)."""

    def __init__(self, clock: Clock, labels: dict[int, str]) -> None:
        self.clock = clock
        self.labels = labels
        """Stage index -> device label (falls back on the tensor's torch device)."""
        self.stamps: dict[tuple[int, int, str], dict[str, Any]] = {}
        self.forwards: dict[int, int] = defaultdict(int)

    def _mark(self, stage: int, mb: int, phase: str, edge: str, device: torch.device) -> None:
        label = self.labels.get(stage, str(device))
        entry = self.stamps.setdefault((stage, mb, phase), {"device": label})
        entry.setdefault(edge, self.clock.stamp(device))

    def _grad_hook(self, stage: int, mb: int, edge: str,
                   device: torch.device) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._mark(stage, mb, "bwd", edge, device)

        return hook

    def attach(self, stage: int, module: nn.Module) -> list[RemovableHandle]:
        """Install the hooks on one stage module; returns their handles."""

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x, mb = args[0], self.forwards[stage]
            self.forwards[stage] += 1
            self._mark(stage, mb, "fwd", "start", x.device)
            if torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
                x = x.detach().requires_grad_(True)
            if x.requires_grad:
                x.register_hook(self._grad_hook(stage, mb, "end", x.device))
            return (x, *args[1:])

        def post(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            mb = self.forwards[stage] - 1
            self._mark(stage, mb, "fwd", "end", out.device)
            if out.requires_grad:
                out.register_hook(self._grad_hook(stage, mb, "start", out.device))

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def wrap(self, stage: int, pipe_stage: Any) -> Callable[[], None]:
        """Stamp a pipelining stage's per-micro-batch methods; returns the undo."""
        device: torch.device = pipe_stage.device

        def stamped(phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
            def run(mb: int, *args: Any, **kwargs: Any) -> Any:
                self._mark(stage, mb, phase, "start", device)
                try:
                    return method(mb, *args, **kwargs)
                finally:
                    self._mark(stage, mb, phase, "end", device)

            return run

        for phase, name in PIPE_METHODS.items():
            # An instance attribute shadows the class's method; deleting it restores it.
            setattr(pipe_stage, name, stamped(phase, getattr(pipe_stage, name)))

        def undo() -> None:
            for name in PIPE_METHODS.values():
                delattr(pipe_stage, name)

        return undo

    def events(self) -> list[TimelineRow]:
        """Completed intervals, sorted by start."""
        rows = [
            {"stage": stage, "device": e["device"], "microbatch": mb, "phase": phase,
             "start_s": self.clock.seconds(e["start"]), "end_s": self.clock.seconds(e["end"])}
            for (stage, mb, phase), e in self.stamps.items() if "start" in e and "end" in e
        ]
        return sorted(rows, key=lambda r: (r["start_s"], r["stage"]))


@dataclass(frozen=True)
class TracedStep:
    """One traced step: its intervals, and its wall time timed like a timed step."""

    events: list[TimelineRow]
    """One row per (stage, micro-batch, phase) interval, on the host's monotonic clock."""
    step_s: float
    """Wall time of the whole step (optimizer included), devices synchronised, seconds."""


def trace_step(step: Callable[[], None], stages: Sequence[TimelineStage],
               devices: list[torch.device],
               slot_labels: Sequence[str] | None = None) -> TracedStep:
    """Run ``step`` once with stamps on ``stages``; returns its intervals and wall time.

    ``slot_labels`` name the device of each slot of ``devices`` (default: torch's names).
    """
    labels = [str(d) for d in devices] if slot_labels is None else list(slot_labels)
    synchronize(devices)
    recorder = _Recorder(Clock(devices), {s.index: labels[s.slot] for s in stages})
    handles: list[RemovableHandle] = []
    undos: list[Callable[[], None]] = []
    try:
        for s in stages:
            if s.pipe_stage is not None:
                undos.append(recorder.wrap(s.index, s.pipe_stage))
            else:
                handles += recorder.attach(s.index, s.module)
        t0 = time.perf_counter()
        step()
        synchronize(devices)  # every CUDA event has completed before it is read
        step_s = time.perf_counter() - t0
    finally:
        for handle in handles:
            handle.remove()
        for undo in undos:
            undo()
    return TracedStep(recorder.events(), step_s)


def align(events: list[TimelineRow]) -> list[TimelineRow]:
    """Shift a case's events (all ranks) so that the first start is at 0 s."""
    t0 = min((e["start_s"] for e in events), default=0.0)
    return [e | {"start_s": e["start_s"] - t0, "end_s": e["end_s"] - t0} for e in events]
