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
case on one time axis (``align``). An idle fraction per stage row, next to the
schedule's theoretical bubble (S-1)/(M+S-1), turns a Gantt chart into one number::

    stage 0 |F0|F1|F2|F3|          |B3|B2|B1|B0|
    stage 1    |F0|F1|F2|F3|B3|B2|B1|B0|
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the report reads timeline.csv without importing torch
    import pandas as pd
    import torch
    from matplotlib.axes import Axes

PHASES = ("fwd", "bwd")


class _Clock:
    """Stamps on the monotonic clock: perf_counter on CPU, CUDA events on GPUs."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        import torch

        self._torch = torch
        self._refs = {}
        for d in {d for d in devices if d.type == "cuda"}:
            self._refs[d] = torch.cuda.Event(enable_timing=True)
            self._refs[d].record(torch.cuda.current_stream(d))
        self._t0 = time.perf_counter()

    def stamp(self, device: torch.device) -> object:
        if device.type == "cuda":
            # Recorded on the stream the hook's work was queued on: stamps are stream-ordered.
            event = self._torch.cuda.Event(enable_timing=True)
            event.record(self._torch.cuda.current_stream(device))
            return device, event
        return time.perf_counter()

    def seconds(self, stamp: object) -> float:
        """A stamp in perf_counter seconds (CUDA events must have completed)."""
        if isinstance(stamp, float):
            return stamp
        device, event = stamp
        # The reference event was recorded right after a synchronize, i.e. at _t0.
        return self._t0 + self._refs[device].elapsed_time(event) / 1000.0


class _Recorder:
    """Hooks that stamp start and end of every (stage, micro-batch, phase)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.stamps: dict[tuple[int, int, str], dict] = {}
        self.forwards: dict[int, int] = defaultdict(int)

    def _mark(self, stage: int, mb: int, phase: str, edge: str, device: torch.device) -> None:
        entry = self.stamps.setdefault((stage, mb, phase), {"device": str(device)})
        entry.setdefault(edge, self.clock.stamp(device))

    def _grad_hook(self, stage: int, mb: int, edge: str, device: torch.device) -> Callable:
        def hook(grad):
            self._mark(stage, mb, "bwd", edge, device)

        return hook

    def attach(self, stage: int, module: torch.nn.Module) -> list:
        """Install the hooks on one stage module; returns their handles."""
        import torch

        def pre(mod, args):
            x, mb = args[0], self.forwards[stage]
            self.forwards[stage] += 1
            self._mark(stage, mb, "fwd", "start", x.device)
            if torch.is_grad_enabled() and x.is_floating_point() and not x.requires_grad:
                x = x.detach().requires_grad_(True)
            if x.requires_grad:
                x.register_hook(self._grad_hook(stage, mb, "end", x.device))
            return (x, *args[1:])

        def post(mod, args, out):
            mb = self.forwards[stage] - 1
            self._mark(stage, mb, "fwd", "end", out.device)
            if out.requires_grad:
                out.register_hook(self._grad_hook(stage, mb, "start", out.device))

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def events(self) -> list[dict]:
        """Completed intervals, sorted by start."""
        rows = [
            {"stage": stage, "device": e["device"], "microbatch": mb, "phase": phase,
             "start_s": self.clock.seconds(e["start"]), "end_s": self.clock.seconds(e["end"])}
            for (stage, mb, phase), e in self.stamps.items() if "start" in e and "end" in e
        ]
        return sorted(rows, key=lambda r: (r["start_s"], r["stage"]))


def trace_step(step: Callable[[], None], modules: list[tuple[int, torch.nn.Module]],
               devices: list[torch.device]) -> list[dict]:
    """Run ``step`` once with timeline hooks on ``modules``; returns one row per interval."""
    from bench_lib.timing import synchronize

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


def align(events: list[dict]) -> list[dict]:
    """Shift a case's events (all ranks) so that the first start is at 0 s."""
    t0 = min((e["start_s"] for e in events), default=0.0)
    return [e | {"start_s": e["start_s"] - t0, "end_s": e["end_s"] - t0} for e in events]


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """GPipe's idle fraction (S-1)/(M+S-1) for S stages and M micro-batches."""
    return (stages - 1) / (microbatches + stages - 1)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def bubble(events: pd.DataFrame) -> dict:
    """Measured idle fraction of one case's traced step beside the theoretical one.

    Each (rank, stage) row is idle whenever it runs neither a forward nor a backward within
    the step's span (first start to last end over all rows); the figure is their mean.
    """
    lo, hi = events["start_s"].min(), events["end_s"].max()
    rows = events.groupby(["rank", "stage"])
    idle = [1 - _union_length(list(zip(g.start_s, g.end_s, strict=True))) / (hi - lo)
            for _, g in rows]
    stages, microbatches = rows.ngroups, int(events["microbatch"].max()) + 1
    return {"stages": stages, "microbatches": microbatches, "span_s": hi - lo,
            "bubble_measured": sum(idle) / len(idle),
            "bubble_theoretical": theoretical_bubble(stages, microbatches)}


def draw_gantt(ax: Axes, events: pd.DataFrame, title: str) -> dict:
    """One Gantt row per (rank, stage): forward and backward bars labelled by micro-batch."""
    colors = {"fwd": "#4C72B0", "bwd": "#DD8452"}
    keys = sorted({(r, s) for r, s in zip(events["rank"], events["stage"], strict=True)})
    t0 = events["start_s"].min()
    span_ms = (events["end_s"].max() - t0) * 1e3
    for y, (rank, stage) in enumerate(keys):
        rows = events[(events["rank"] == rank) & (events["stage"] == stage)]
        for r in rows.itertuples():
            width_ms = (r.end_s - r.start_s) * 1e3
            ax.barh(y, width_ms, left=(r.start_s - t0) * 1e3, height=0.7,
                    color=colors[r.phase], edgecolor="white", linewidth=0.6)
            if width_ms > 0.015 * span_ms:  # a label wider than its bar is noise
                ax.text((r.start_s - t0) * 1e3 + width_ms / 2, y, str(r.microbatch),
                        ha="center", va="center", fontsize=7, color="white", clip_on=True)
    labels = [f"stage {s}\n{events.loc[events['stage'] == s, 'device'].iloc[0]}"
              + (f" r{r}" if events["rank"].nunique() > 1 else "") for r, s in keys]
    ax.set_yticks(range(len(keys)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time since step start (ms)")
    stats = bubble(events)
    ax.set_title(f"{title}\nidle {stats['bubble_measured']:.0%} measured vs "
                 f"{stats['bubble_theoretical']:.0%} theoretical "
                 f"(S={stats['stages']}, M={stats['microbatches']})", fontsize=10)
    from matplotlib.patches import Patch

    handles = [Patch(color=c) for c in colors.values()]
    ax.legend(handles, ["forward", "backward"], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    return stats
