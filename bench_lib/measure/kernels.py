"""The CUDA kernels one training step runs, by name: what a launch's libraries chose.

cuDNN's benchmark mode times its candidate algorithms in each fresh process and keeps the
fastest it saw, so two launches of one case can run different convolution kernels (and
cuBLAS its heuristics' picks): a launch-to-launch difference in step time that the
launches' own steps cannot explain may be that. One step after the timed ones runs under
torch's profiler with CUDA activity only; the names of the events on a CUDA device are the
step's kernels (copies and fills, which no library chooses, left out). The runner compares
the launches' sets (``analysis.launch_spread.kernels_note``).

On any other device nothing is profiled: a CPU step has no kernels to choose, and the
profiler would cost the launch time for no answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from bench_lib.rig import synchronize

NOT_KERNELS = ("Memcpy", "Memset")
"""Prefixes of the profiler's CUDA events that are copies and fills, not chosen kernels."""


def kernel_names(step: Callable[[], None], devices: Sequence[torch.device]) -> tuple[str, ...]:
    """Run ``step`` once under torch's profiler (CUDA activity) and return the sorted
    distinct names of the kernels it ran; () without a CUDA device (nothing is run)."""
    if not any(d.type == "cuda" for d in devices):
        return ()
    from torch.profiler import ProfilerActivity, profile

    synchronize(devices)  # the timed steps' kernels finish outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(devices)
    return names_of(prof.events())


def names_of(events: Iterable[Any]) -> tuple[str, ...]:
    """The sorted distinct names of the profiler events on a CUDA device, copies and fills
    left out (``NOT_KERNELS``)."""
    # By the enum's name: torch.autograd re-exports DeviceType without declaring it.
    return tuple(sorted({e.name for e in events if e.device_type.name == "CUDA"
                         and not e.name.startswith(NOT_KERNELS)}))
