"""The measured pipeline timeline: when each stage runs each micro-batch's forward and backward.

One extra step runs after the timed steps (so those stay undisturbed) with hooks on the
stage modules a trainer drives (``Trainer.timeline_modules()``):

    forward  start/end  forward pre-hook / forward hook of the stage module
    backward start      hook on the stage's output tensor: its gradient has arrived
    backward end        hook on the stage's input tensor: its gradient is computed

Tensor hooks rather than module backward hooks, because each forward call registers its
own, so a backward stamp knows its micro-batch whatever order autograd runs them in. A
first stage whose input needs no gradient gets a detached copy that does: the only change
the traced step sees is one extra input-gradient of its first layer.

Stamps are ``time.perf_counter`` on CPU and CUDA events on GPUs (resolved after a
synchronize against an event recorded at the step's start), in seconds on the host's
monotonic clock: one clock for every rank on a host, so the runner can put the ranks of a
case on one time axis (``align``). The report draws the rows as a Gantt chart and reads the
idle (bubble) fraction off them (``bench_lib.report.gantt``)::

    stage 0 |F0|F1|F2|F3|          |B3|B2|B1|B0|
    stage 1    |F0|F1|F2|F3|B3|B2|B1|B0|
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from bench_lib.rig import synchronize

TimelineRow = dict[str, Any]
"""One timeline.csv row: stage, device, microbatch, phase, start_s, end_s (and rank)."""

PHASES = ("fwd", "bwd")
Stamp = float | tuple[torch.device, torch.cuda.Event]


class _Clock:
    """Stamps on the monotonic clock: perf_counter on CPU, CUDA events on GPUs."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._refs: dict[torch.device, torch.cuda.Event] = {}
        for d in {d for d in devices if d.type == "cuda"}:
            self._refs[d] = torch.cuda.Event(enable_timing=True)
            self._refs[d].record(torch.cuda.current_stream(d))
        self._t0 = time.perf_counter()

    def stamp(self, device: torch.device) -> Stamp:
        if device.type == "cuda":
            # Recorded on the stream the hook's work was queued on: stamps are stream-ordered.
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
    """Hooks that stamp start and end of every (stage, micro-batch, phase)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.stamps: dict[tuple[int, int, str], dict[str, Any]] = {}
        self.forwards: dict[int, int] = defaultdict(int)

    def _mark(self, stage: int, mb: int, phase: str, edge: str, device: torch.device) -> None:
        entry = self.stamps.setdefault((stage, mb, phase), {"device": str(device)})
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

    def events(self) -> list[TimelineRow]:
        """Completed intervals, sorted by start."""
        rows = [
            {"stage": stage, "device": e["device"], "microbatch": mb, "phase": phase,
             "start_s": self.clock.seconds(e["start"]), "end_s": self.clock.seconds(e["end"])}
            for (stage, mb, phase), e in self.stamps.items() if "start" in e and "end" in e
        ]
        return sorted(rows, key=lambda r: (r["start_s"], r["stage"]))


def trace_step(step: Callable[[], None], modules: list[tuple[int, nn.Module]],
               devices: list[torch.device]) -> list[TimelineRow]:
    """Run ``step`` once with timeline hooks on ``modules``; returns one row per interval."""
    synchronize(devices)
    recorder = _Recorder(_Clock(devices))
    handles = [h for stage, module in modules for h in recorder.attach(stage, module)]
    try:
        step()
        synchronize(devices)  # every CUDA event has completed before it is read
    finally:
        for handle in handles:
            handle.remove()
    return recorder.events()


def align(events: list[TimelineRow]) -> list[TimelineRow]:
    """Shift a case's events (all ranks) so that the first start is at 0 s."""
    t0 = min((e["start_s"] for e in events), default=0.0)
    return [e | {"start_s": e["start_s"] - t0, "end_s": e["end_s"] - t0} for e in events]
