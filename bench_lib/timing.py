"""Step timing that synchronises every device a strategy touches before reading the clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

StopRule = Callable[[list[float]], bool]


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait until every CUDA device in ``devices`` has finished its queued work.

    CPU work is synchronous, so CPU devices need nothing.
    """
    for device in sorted({d for d in devices if d.type == "cuda"}, key=str):
        torch.cuda.synchronize(device)


def time_budget(max_time_s: float, min_steps: int = 3) -> StopRule:
    """Stop once ``max_time_s`` of timed work is spent (after at least ``min_steps``)."""

    def stop(times: list[float]) -> bool:
        return len(times) >= min_steps and sum(times) > max_time_s

    return stop


def time_steps(
    step: Callable[[], None],
    devices: Iterable[torch.device],
    warmup_steps: int,
    timed_steps: int,
    should_stop: StopRule | None = None,
    barrier: Callable[[], None] | None = None,
) -> list[float]:
    """Run ``warmup_steps`` discarded steps, then time up to ``timed_steps`` steps.

    Every step is bracketed by a synchronisation of all ``devices``, so a step's time is
    the wall time until its last kernel finished. ``barrier`` (a process-group barrier in
    multi-process strategies) makes all ranks start the timed window together.
    ``should_stop`` is asked after each timed step, outside the timed window; in
    multi-process strategies it must give the same answer on every rank.
    """
    devices = list(devices)
    for _ in range(warmup_steps):
        step()
    synchronize(devices)
    if barrier is not None:
        barrier()
    times: list[float] = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        step()
        synchronize(devices)
        times.append(time.perf_counter() - t0)
        if should_stop is not None and should_stop(times):
            break
    return times
