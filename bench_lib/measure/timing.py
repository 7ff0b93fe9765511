"""The timing rule, all of it: warm-up, synchronisation, the ranks' common start, the stop
rule, the collective stop, and the slowest rank per step.

1. ``warmup_steps`` steps run and are discarded; then ``after_warmup`` runs (the worker
   resets the peak-memory counters there, so peaks cover the timed steps only).
2. Multi-process strategies start the timed window together (a process-group barrier).
3. Every timed step is bracketed by ``rig.synchronize`` of every device the step touches,
   so a step's time is the wall time until its last kernel finished.
4. After each step the stop rule is asked (outside the timed window): stop when the
   median's 95% CI half-width is under the target, or the time cap is spent (at least 3
   steps), else go on to the ``timed_steps`` cap. In a multi-process case every rank judges
   the slowest rank's times and the decision is reduced, so all ranks stop after one step.
5. A case's figure for each step is the slowest rank's (``slowest_per_step``), also when
   ``compare`` re-reads steps.csv.

torch is imported only inside the functions that touch a device, so the file readers
(compare) can apply rule 5 without importing it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench_lib.measure.stats import Stats

if TYPE_CHECKING:
    import torch

StopRule = Callable[[list[float]], bool]

# Fewer steps make the bootstrap interval of the median unreliable: with a handful of
# values its resampled medians take only a few distinct values.
MIN_STEPS_FOR_CI = 8
MIN_STEPS_UNDER_TIME_CAP = 3
STOP_REASONS = ("ci_target", "time_cap", "step_cap")


def time_budget(max_time_s: float, min_steps: int = MIN_STEPS_UNDER_TIME_CAP) -> StopRule:
    """Stop once ``max_time_s`` of timed work is spent (after at least ``min_steps``)."""

    def stop(times: list[float]) -> bool:
        return len(times) >= min_steps and sum(times) > max_time_s

    return stop


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


def collective_stop(rule: StopRule, device: torch.device) -> StopRule:
    """Make every rank stop after the same step: stop when any rank wants to.

    Every rank judges the slowest rank's step times (the case's figure), so all ranks see
    the same numbers; the flag is still reduced, so a rule that disagrees cannot hang a rank.
    """
    import torch
    import torch.distributed as dist

    slowest: list[float] = []

    def stop(times: list[float]) -> bool:
        last = torch.tensor([times[-1]], dtype=torch.float64, device=device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX)
        slowest.append(float(last.item()))
        flag = torch.tensor([1.0 if rule(slowest) else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return stop


def time_steps(
    step: Callable[[], None],
    devices: Iterable[torch.device],
    warmup_steps: int,
    timed_steps: int,
    should_stop: StopRule | None = None,
    barrier: Callable[[], object] | None = None,
    on_window: Callable[[float, float], None] | None = None,
    after_warmup: Callable[[], None] | None = None,
) -> list[float]:
    """Run ``warmup_steps`` discarded steps, then time up to ``timed_steps`` steps.

    ``barrier`` (a process-group barrier in multi-process strategies) makes all ranks start
    the timed window together. ``should_stop`` is asked after each timed step, outside the
    timed window; in multi-process strategies it must give the same answer on every rank
    (``collective_stop``). ``on_window`` receives the wall-clock (``time.time()``) start and
    end of the timed window, so that samples taken outside this process can be matched to it.
    ``after_warmup`` runs once the warm-up steps have finished on every device, before the
    barrier and the timed window (e.g. ``PeakMemory.reset``).
    """
    from bench_lib.rig import synchronize

    devices = list(devices)
    for _ in range(warmup_steps):
        step()
    synchronize(devices)
    if after_warmup is not None:
        after_warmup()
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


@dataclass(frozen=True)
class TimedSteps:
    """One process's timed steps and what ended them."""

    times_s: list[float]
    """Time of each timed step, seconds."""
    window_unix_s: tuple[float, float]
    """Wall-clock (``time.time()``) start and end of the timed window."""
    stop_reason: str
    """``ci_target``, ``time_cap`` or ``step_cap`` (``STOP_REASONS``)."""


def measure_steps(step: Callable[[], None], devices: Iterable[torch.device], *,
                  warmup_steps: int, timed_steps: int, max_time_s: float,
                  ci_target_pct: float, group_device: torch.device | None = None,
                  after_warmup: Callable[[], None] | None = None) -> TimedSteps:
    """Warm up, then time ``step`` under the adaptive stop rule: rules 1 to 4 above.

    ``group_device``: in a multi-process case (a process group is up), the device its
    collectives run on; the ranks then start together and stop after the same step.
    ``after_warmup``: called between the warm-up and the timed steps (``time_steps``).
    """
    rule = AdaptiveStop(ci_target_pct / 100, max_time_s)
    stop: StopRule = rule
    barrier: Callable[[], object] | None = None
    if group_device is not None:
        import torch.distributed as dist

        stop, barrier = collective_stop(rule, group_device), dist.barrier
    window: list[float] = []
    times = time_steps(step, devices, warmup_steps, timed_steps, should_stop=stop,
                       barrier=barrier, on_window=lambda t0, t1: window.extend((t0, t1)),
                       after_warmup=after_warmup)
    return TimedSteps(times, (window[0], window[1]), rule.final_reason(len(times), timed_steps))


def slowest_per_step(per_rank: Mapping[int, Sequence[float]]) -> list[float]:
    """The case's time of each step: the slowest rank's. Ranks must have timed equal steps."""
    counts = {len(times) for times in per_rank.values()}
    if len(counts) > 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(counts)}")
    return [max(step) for step in zip(*per_rank.values())]
