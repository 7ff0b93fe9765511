"""The timing rule, all of it: warm-up, synchronisation, the ranks' common start, the stop
rule, the collective stop, and the slowest rank per step.

1. Warm-up steps run, each timed like a timed step, and are discarded: at least
   ``warmup_steps``, then more while step times are still falling (``WarmupRule``: the
   latest warm-up step more than 2% faster than every one before it), at most 8 more. In a
   multi-process case every rank judges the slowest rank's warm-up times and the decision
   is reduced, so all ranks run the same warm-up. A case's later launches run the first
   launch's warm-up as a fixed count, less the two steps that showed it was over
   (``protocol.reused_warmup``); a gate's sides taking turns run ``warmup_steps`` exactly
   (``measure_steps``), so that their timed steps pair in time. Then ``after_warmup``
   runs (the worker resets the peak-memory counters there, so peaks cover the timed steps
   only).
2. Multi-process strategies start the timed window together (a process-group barrier).
3. Every timed step is bracketed by ``rig.synchronize`` of every device the step touches,
   so a step's time is the wall time until its last kernel finished. The process's CPU
   time (``time.process_time``, all threads) is read around it too: contention shows as
   CPU time well under threads x wall time (``measure.contention``).
4. After each step the stop rule is asked (outside the timed window): stop when the
   median's 95% CI half-width is under the target, or the time cap is spent (at least 3
   steps), else go on to the ``timed_steps`` cap. A minimum timed duration
   (``min_time_s``) holds the first two back: a launch that met its CI target or its step
   cap before it goes on, past ``timed_steps``, until its steps add up to it; only the time
   cap (``max_time_s``, never under the minimum) ends a launch sooner. In a multi-process
   case every rank judges the slowest rank's times and the decision is reduced, so all
   ranks stop after one step.
5. A case's figure for each step is the slowest rank's (``analysis.stats.slowest_per_step``,
   which ``compare`` applies too when it re-reads steps.csv).

torch is imported only inside the functions that touch a device: the sweep's planning
(``prediction.duration``) reads this module's counts without it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench_lib.analysis.stats import MIN_SAMPLES_FOR_BOOTSTRAP, Stats
from bench_lib.turns import Turns

if TYPE_CHECKING:
    import torch

StopRule = Callable[[list[float]], bool]

# Fewer steps make the bootstrap interval of the median unreliable: with a handful of
# values its resampled medians take only a few distinct values.
MIN_STEPS_FOR_CI = MIN_SAMPLES_FOR_BOOTSTRAP  # 8
MIN_STEPS_UNDER_TIME_CAP = 3
# Warm-up goes on past its minimum while the latest warm-up step is more than this much
# faster than every earlier one: the default CI target (2%), since a smaller transient
# cannot move the median beyond the precision timing aims for. Judged against the fastest
# earlier step, not the previous one, so that step-to-step noise does not read as a trend.
WARMUP_TOLERANCE = 0.02
# At most this many warm-up steps beyond the minimum: DDP's bucket rebuild (step 2),
# cuDNN autotuning and torch.compile's recompiles end within the first 2-3 steps.
WARMUP_EXTRA_MAX = 8
STOP_REASONS = ("ci_target", "time_cap", "step_cap", "min_time")
COMPUTE_ONLY_STEPS = 3
"""Steps every launch of a run (not tune's) times with no collective after its timed ones
(``launch.diagnostics.compute_only``; the run's estimate counts them: ``prediction.duration``)."""


def time_budget(max_time_s: float, min_steps: int = MIN_STEPS_UNDER_TIME_CAP) -> StopRule:
    """Stop once ``max_time_s`` of timed work is spent (after at least ``min_steps``)."""

    def stop(times: list[float]) -> bool:
        return len(times) >= min_steps and sum(times) > max_time_s

    return stop


class AdaptiveStop:
    """Stop when the median's 95% CI half-width is under ``target_rel`` of the median, or
    ``max_steps`` steps are timed (None: the caller's loop caps the steps), but not before
    ``min_time_s`` of timed work; or once ``max_time_s`` of timed work is spent, whatever
    the minimum. ``reason`` says which fired (None: none): ``ci_target``, ``step_cap``,
    ``min_time`` (one of the first two fired earlier and the minimum held the launch on
    until now) or ``time_cap``.

    ``target_rel`` 0 disables the CI target (fixed step count or time budget only). The
    bootstrap costs O(n) per check, so the CI is checked at geometrically spaced step counts
    (every ~10% more steps): long runs of fast steps do not pay O(n^2) between steps. Once
    met, it is not checked again: more steps of the same launch only narrow it.
    """

    def __init__(self, target_rel: float, max_time_s: float,
                 min_steps: int = MIN_STEPS_FOR_CI, *, min_time_s: float = 0.0,
                 max_steps: int | None = None) -> None:
        if target_rel < 0 or max_time_s <= 0:
            raise ValueError(f"bad stop rule: target {target_rel}, time cap {max_time_s} s")
        if not 0 <= min_time_s <= max_time_s:
            raise ValueError(f"bad stop rule: minimum {min_time_s} s is not within the time "
                             f"cap {max_time_s} s")
        self.target_rel = target_rel
        self.min_steps = min_steps
        self.min_time_s = min_time_s
        self.max_steps = max_steps
        self._budget = time_budget(max_time_s)
        self._next_check = min_steps
        self._ci_met = False
        self._held = False  # a stop was due but the minimum held the launch on
        self.reason: str | None = None

    def __call__(self, times: list[float]) -> bool:
        n = len(times)
        if not self._ci_met and self.target_rel > 0 and n >= self._next_check:
            self._next_check = max(n + 1, math.ceil(n * 1.1))
            self._ci_met = Stats.of(times).ci_half_width_rel < self.target_rel
        due = "ci_target" if self._ci_met else (
            "step_cap" if self.max_steps is not None and n >= self.max_steps else None)
        if due is not None:
            if not self.min_time_s or sum(times) >= self.min_time_s:
                self.reason = "min_time" if self._held else due
                return True
            self._held = True
        if self._budget(times):
            self.reason = "time_cap"
            return True
        return False

    def final_reason(self, steps_done: int, timed_steps: int) -> str:
        """The stop that ended timing: the rule's, else the step cap."""
        if self.reason is None and steps_done >= timed_steps:
            return "step_cap"
        return self.reason or ""


class WarmupRule:
    """When warm-up may end, given the warm-up step times so far (a ``StopRule``).

    At least ``min_steps``; after them, warm-up goes on while the step times still fall: the
    latest warm-up step more than ``tolerance`` faster than the fastest before it (two
    steps at least, so that a trend can be seen), up to ``min_steps + extra_max`` steps.
    ``min_steps`` 0 means no warm-up at all. One-sided and against the fastest earlier step:
    warm-up costs (allocations, autotuning, DDP's bucket rebuild, compilation) make early
    steps slower, a one-off slow step inside the warm-up is already discarded, and flat
    noise rarely beats the best of the steps before it by the tolerance, where it often
    moves that far from the previous step (tests/test_warmup.py).
    """

    def __init__(self, min_steps: int, tolerance: float = WARMUP_TOLERANCE,
                 extra_max: int = WARMUP_EXTRA_MAX) -> None:
        if min_steps < 0 or tolerance < 0 or extra_max < 0:
            raise ValueError(f"bad warm-up rule: minimum {min_steps}, tolerance {tolerance}, "
                             f"extra {extra_max}")
        self.min_steps = min_steps
        self.tolerance = tolerance
        self.max_steps = min_steps + extra_max if min_steps else 0

    def __call__(self, times: list[float]) -> bool:
        n = len(times)
        if n >= self.max_steps:  # the cap (0 when min_steps is 0: no warm-up)
            return True
        if n < max(self.min_steps, 2):
            return False
        return times[-1] >= min(times[:-1]) * (1 - self.tolerance)


def collective_stop(rule: StopRule, device: torch.device) -> StopRule:
    """Make every rank stop after the same step: stop when any rank wants to.

    Every rank judges the slowest rank's step times (the case's figure), so all ranks see
    the same numbers; the flag is still reduced, so a rule that disagrees cannot hang a rank.
    Steps timed since the last call (``time_steps`` asks the warm-up rule only from its
    minimum on) are reduced together.
    """
    import torch
    import torch.distributed as dist

    slowest: list[float] = []

    def stop(times: list[float]) -> bool:
        new = torch.tensor(times[len(slowest):], dtype=torch.float64, device=device)
        dist.all_reduce(new, op=dist.ReduceOp.MAX)
        slowest.extend(float(t) for t in new.tolist())
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
    cpu_times: list[float] | None = None,
    warmup_done: StopRule | None = None,
    warmup_times: list[float] | None = None,
    probe: Callable[[], float] | None = None,
    probe_times: list[float] | None = None,
    turns: Turns | None = None,
) -> list[float]:
    """Run ``warmup_steps`` discarded steps, then time up to ``timed_steps`` steps.

    ``warmup_done``, when given, extends the warm-up: it is asked after each warm-up step
    from the ``warmup_steps``-th on (none when ``warmup_steps`` is 0) with the warm-up step
    times so far, and warm-up ends when it says so (``WarmupRule``; in multi-process
    strategies the same answer on every rank: ``collective_stop``). Each warm-up step is
    timed like a timed step; ``warmup_times``, when given, receives those times.

    ``barrier`` (a process-group barrier in multi-process strategies) makes all ranks start
    the timed window together. ``should_stop`` is asked after each timed step, outside the
    timed window; in multi-process strategies it must give the same answer on every rank
    (``collective_stop``). ``on_window`` receives the wall-clock (``time.time()``) start and
    end of the timed window, so that samples taken outside this process can be matched to it.
    ``after_warmup`` runs once the warm-up steps have finished on every device, before the
    barrier and the timed window (e.g. ``PeakMemory.reset``). ``cpu_times``, when given,
    receives each timed step's CPU time of this process (``time.process_time``: all its
    threads), read just outside the step's wall-clock bracket. ``probe`` (the machine's
    speed control, ``measure.speed_probe``), when given, runs just before each timed step,
    outside its bracket, and ``probe_times`` receives its seconds. ``turns`` (the gate's
    two sides stepping in turns, ``bench_lib.turns``), when given, is waited for before each
    step, warm-up and timed, and handed on after it, outside its bracket.
    """
    from bench_lib.rig import synchronize

    def wait() -> None:
        if turns is not None:
            turns.before()

    def done() -> None:
        if turns is not None:
            turns.after()

    devices = list(devices)
    warm: list[float] = []
    while len(warm) < warmup_steps or (
            warmup_done is not None and warm and not warmup_done(warm)):
        wait()
        t0 = time.perf_counter()
        step()
        synchronize(devices)
        warm.append(time.perf_counter() - t0)
        done()
    if warmup_times is not None:
        warmup_times.extend(warm)
    synchronize(devices)
    if after_warmup is not None:
        after_warmup()
    if barrier is not None:
        barrier()
    times: list[float] = []
    window_start = time.time()
    for _ in range(timed_steps):
        wait()
        if probe is not None:
            seconds = probe()
            if probe_times is not None:
                probe_times.append(seconds)
        c0 = time.process_time() if cpu_times is not None else 0.0
        t0 = time.perf_counter()
        step()
        synchronize(devices)
        times.append(time.perf_counter() - t0)
        if cpu_times is not None:
            cpu_times.append(time.process_time() - c0)
        done()
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
    cpu_times_s: list[float] = field(default_factory=list)
    """This process's CPU time (all threads) in each timed step, seconds: on a cpu rig,
    well under threads x ``times_s`` means it waited (for a peer, or for a core someone
    else held); on GPUs the host side only."""
    warmup_steps: int = 0
    """Warm-up steps run before the timed ones (``WarmupRule``; equal on every rank)."""
    warmup_time_s: float = 0.0
    """Their time, all of them together (this rank's clock), seconds."""
    warmup_first_step_s: float = 0.0
    """The first warm-up step's time, part of ``warmup_time_s``: where a launch pays for its
    lazy starts (cuDNN's autotuning, the allocator's growth, DDP's first buckets); the rest
    are the steady steps. 0 with no warm-up."""
    probe_times_s: list[float] = field(default_factory=list)
    """The speed probe's seconds just before each timed step (``measure.speed_probe``;
    empty where none ran)."""


def measure_steps(step: Callable[[], None], devices: Iterable[torch.device], *,
                  warmup_steps: int, timed_steps: int, max_time_s: float,
                  interval_target_pct: float, min_time_s: float = 0.0,
                  group_device: torch.device | None = None,
                  after_warmup: Callable[[], None] | None = None,
                  warmup_rule: bool = True,
                  probe: Callable[[], float] | None = None,
                  turns: Turns | None = None) -> TimedSteps:
    """Warm up (at least ``warmup_steps``, under ``WarmupRule``; exactly ``warmup_steps``
    with ``warmup_rule`` False: a count an earlier launch found), then time ``step`` under
    the adaptive stop rule: rules 1 to 4 above.

    ``min_time_s``: the launch times at least this many seconds of steps, past
    ``timed_steps`` where it must (the stop rule then caps the steps, so that the ranks of
    a multi-process case decide it together); ``max_time_s`` stays the hard cap.
    ``group_device``: in a multi-process case (a process group is up), the device its
    collectives run on; the ranks then start together and stop after the same step.
    ``after_warmup``: called between the warm-up and the timed steps (``time_steps``).
    ``probe``: the machine's speed control, timed before each timed step (``time_steps``).
    ``turns``: steps taken in turns with the gate's other side (``time_steps``), after
    exactly ``warmup_steps`` warm-up steps (no ``WarmupRule``); the caller closes it.
    """
    rule = AdaptiveStop(interval_target_pct / 100, max_time_s, min_time_s=min_time_s,
                        max_steps=timed_steps)
    # Without a minimum the loop's cap is the step cap; with one, the rule's time cap ends
    # the launch (every step takes time), so the loop itself needs no cap.
    loop_steps = sys.maxsize if min_time_s > 0 else timed_steps
    stop: StopRule = rule
    # Taking turns, both sides run the same fixed warm-up, so that each side's k-th timed
    # step meets the other's k-th in the same turns; a rule that judged each side's own
    # noisy warm-up would end them at different counts and part the pairs by steps.
    warmed: StopRule | None = (WarmupRule(warmup_steps) if warmup_rule and turns is None
                               else None)
    barrier: Callable[[], object] | None = None
    if group_device is not None:
        import torch.distributed as dist

        stop, barrier = collective_stop(rule, group_device), dist.barrier
        if warmed is not None:
            warmed = collective_stop(warmed, group_device)
    warm: list[float] = []
    window: list[float] = []
    cpu: list[float] = []
    probes: list[float] = []
    times = time_steps(step, devices, warmup_steps, loop_steps, should_stop=stop,
                       barrier=barrier, on_window=lambda t0, t1: window.extend((t0, t1)),
                       after_warmup=after_warmup, cpu_times=cpu, warmup_done=warmed,
                       warmup_times=warm, probe=probe, probe_times=probes, turns=turns)
    return TimedSteps(times, (window[0], window[1]), rule.final_reason(len(times), timed_steps),
                      cpu, warmup_steps=len(warm), warmup_time_s=sum(warm),
                      warmup_first_step_s=warm[0] if warm else 0.0, probe_times_s=probes)
