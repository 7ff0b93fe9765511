"""Step timing that synchronises every device a strategy touches before reading the clock."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch

from bench_lib.stats import Stats

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


# Fewer steps make the bootstrap interval of the median unreliable: with a handful of
# values its resampled medians take only a few distinct values.
MIN_STEPS_FOR_CI = 8
STOP_REASONS = ("ci_target", "time_cap", "step_cap")


class AdaptiveStop:
    """Stop when the median's 95% CI half-width is under ``target_rel`` of the median, or
    ``max_time_s`` of timed work is spent; ``reason`` says which fired (None: neither).

    ``target_rel`` 0 disables the CI target (fixed step count or time budget only). The
    bootstrap costs O(n) per check, so the CI is checked at geometrically spaced step counts
    (every ~10% more steps): long runs of fast steps do not pay O(n^2) between steps.
    """

    def __init__(self, target_rel: float, max_time_s: float,
                 min_steps: int = MIN_STEPS_FOR_CI) -> None:
        if target_rel < 0 or max_time_s <= 0:
            raise ValueError(f"bad stop rule: target {target_rel}, time cap {max_time_s} s")
        self.target_rel = target_rel
        self.min_steps = min_steps
        self._budget = time_budget(max_time_s)
        self._next_check = min_steps
        self.reason: str | None = None

    def __call__(self, times: list[float]) -> bool:
        n = len(times)
        if self.target_rel > 0 and n >= self._next_check:
            self._next_check = max(n + 1, math.ceil(n * 1.1))
            if Stats.of(times).ci_half_width_rel < self.target_rel:
                self.reason = "ci_target"
                return True
        if self._budget(times):
            self.reason = "time_cap"
            return True
        return False

    def final_reason(self, steps_done: int, timed_steps: int) -> str:
        """The stop that ended timing: the rule's, else the step cap."""
        if self.reason is None and steps_done >= timed_steps:
            return "step_cap"
        return self.reason or ""


def time_steps(
    step: Callable[[], None],
    devices: Iterable[torch.device],
    warmup_steps: int,
    timed_steps: int,
    should_stop: StopRule | None = None,
    barrier: Callable[[], None] | None = None,
    on_window: Callable[[float, float], None] | None = None,
) -> list[float]:
    """Run ``warmup_steps`` discarded steps, then time up to ``timed_steps`` steps.

    Every step is bracketed by a synchronisation of all ``devices``, so a step's time is
    the wall time until its last kernel finished. ``barrier`` (a process-group barrier in
    multi-process strategies) makes all ranks start the timed window together.
    ``should_stop`` is asked after each timed step, outside the timed window; in
    multi-process strategies it must give the same answer on every rank.
    ``on_window`` receives the wall-clock (``time.time()``) start and end of the timed
    window, so that samples taken outside this process can be matched to it.
    """
    devices = list(devices)
    for _ in range(warmup_steps):
        step()
    synchronize(devices)
    if barrier is not None:
        barrier()
    times: list[float] = []
    window_start = time.time()
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        step()
        synchronize(devices)
        times.append(time.perf_counter() - t0)
        if should_stop is not None and should_stop(times):
            break
    if on_window is not None:
        on_window(window_start, time.time())
    return times
