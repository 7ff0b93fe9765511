"""Contention: whether a case had the CPUs it was timed on to itself.

Wall-clock step times double smoothly when a co-runner takes half of a case's core, and the
steps need not spread for that; so beside the clock two things are read:

* per timed step, each rank's CPU time (``time.process_time``: all threads of the process;
  ``measure.timing``). A cpu-rig process pinned to T cores whose CPU time per step is well
  under T x its wall time was waiting: for a peer (distributed ranks do, legitimately) or for
  a core that someone else held. On GPUs it is the host side only.
* over the whole case, the machine's CPU times (``/proc/stat`` through
  ``psutil.cpu_times``) at its start and end: steal (the hypervisor ran another guest on our
  virtual CPUs) and the busy CPU time no process of the case nor the runner used, each as a
  share of the machine's CPU capacity over the case.

``contention`` turns these into a row's reason (empty: none seen). Never imports torch.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OTHER_CPU_PCT_MAX = 10.0
"""Busy CPU of other processes above this share of the machine's capacity flags the case.

A co-runner holding X% of the machine can slow a case that wants all of it by about
X/(100-X): 10% of capacity alone can move a step time by ~11%, as far as the regression
gate's default threshold (10%). A quiet machine's background (kernel threads, daemons)
stays at a few percent. On a machine much larger than the rig the share is diluted (a hog
on the one core a case uses is 1/cores of the machine): the per-step CPU time rule covers
that for single-process cases."""
STEAL_PCT_MAX = 10.0
"""Steal above this share of the machine's capacity flags the case: the same reasoning
(capacity taken from under the case); a healthy VM steals well under 1%."""
CPU_PER_WALL_MIN = 0.80
"""A single-process cpu-rig case whose median per-step CPU time is under this fraction of
its pinned cores x wall time is flagged: it waited for a core. Single-process strategies
have no peer to wait for on a CPU (``synchronize`` is a no-op there); distributed ranks
wait on their peers by design, so their ratio is recorded (steps.csv) but never flags."""

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")
"""The machine's busy CPU time (``user`` includes ``guest`` on Linux, ``nice``
``guest_nice``)."""
CAPACITY_FIELDS = (*BUSY_FIELDS, "idle", "iowait", "steal")
"""Every CPU second the machine had: busy, idle and stolen (guest is inside user/nice)."""


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU time counters at one instant, all in seconds (machine ones summed over CPUs)."""

    machine_busy_s: float
    machine_steal_s: float
    machine_total_s: float
    """Every CPU second since boot: ``CAPACITY_FIELDS`` summed."""
    children_s: float
    """User + system CPU of this process's children that ended and were waited for (their
    own waited-for children included): the case's ranks once the runner has reaped them.
    A grandchild a rank leaves behind un-reaped (killed with the case's process group)
    is not in it, and its CPU reads as other processes'."""
    own_s: float
    """This process's CPU time, every thread (the runner and its sampler)."""

    @classmethod
    def of(cls, cpu_times: Any, children_s: float, own_s: float) -> CpuSnapshot:
        """From ``psutil.cpu_times()`` (or anything with its fields) and process times."""
        def total(fields: Sequence[str]) -> float:
            return float(sum(getattr(cpu_times, f, 0.0) for f in fields))

        return cls(total(BUSY_FIELDS), total(("steal",)), total(CAPACITY_FIELDS),
                   children_s, own_s)

    @classmethod
    def now(cls, reaped_elsewhere_s: float = 0.0) -> CpuSnapshot:
        """The machine's and this process's counters now; ``reaped_elsewhere_s``: the CPU of
        our ranks that another process of ours reaped (the fork server's count), counted
        with our children's."""
        import psutil

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls.of(psutil.cpu_times(), kids.ru_utime + kids.ru_stime + reaped_elsewhere_s,
                      time.process_time())


@dataclass(frozen=True)
class MachineLoad:
    """What the rest of the machine did while a case ran, in % of its CPU capacity."""

    cpu_steal_pct: float
    """Steal over the case: CPU time the hypervisor gave to other guests."""
    other_cpu_pct: float
    """Busy CPU over the case not used by the case's processes nor the runner."""


def machine_load(start: CpuSnapshot, end: CpuSnapshot) -> MachineLoad | None:
    """The load between two snapshots around a case (the case's processes reaped before
    ``end``); None when the machine's counters did not move (no capacity to divide by).

    Capacity is every CPU second between the snapshots (``CAPACITY_FIELDS``: about the
    case's wall time x the machine's logical CPUs). The figures are clamped to 0-100: the
    machine's counters tick at 1/USER_HZ per CPU while process times are exact, so a quiet
    short case can read a little under 0.
    """
    capacity = end.machine_total_s - start.machine_total_s
    if capacity <= 0:
        return None
    busy = end.machine_busy_s - start.machine_busy_s
    ours = (end.children_s - start.children_s) + (end.own_s - start.own_s)

    def pct(seconds: float) -> float:
        return min(100.0, max(0.0, 100.0 * seconds / capacity))

    return MachineLoad(cpu_steal_pct=pct(end.machine_steal_s - start.machine_steal_s),
                       other_cpu_pct=pct(busy - ours))


def cpu_per_wall(cpu_s: Sequence[float], wall_s: Sequence[float], cores: int) -> float | None:
    """Median over steps of CPU time over ``cores`` x wall time (1 = every pinned core busy
    through the step); None without steps."""
    ratios = [c / (cores * w) for c, w in zip(cpu_s, wall_s, strict=True) if w > 0]
    return statistics.median(ratios) if ratios and cores > 0 else None


def contention(load: MachineLoad | None, ratio: float | None = None, cores: int = 1,
               turns: bool = False) -> str:
    """Why a case was measured under contention, or ``""``.

    ``load``: the machine over the case; ``ratio``: the case's ``cpu_per_wall`` where it
    may flag (a single-process case on a cpu rig pinned to ``cores`` cores), else None.
    ``turns``: the case stepped in turns with the gate's other side (``bench_lib.turns``),
    whose steps are other processes' CPU by design: other processes' CPU is not judged
    then (steal and the per-step CPU time still are: a co-runner on the case's core during
    its turn makes it wait).
    """
    reasons = []
    if load is not None and not turns and load.other_cpu_pct > OTHER_CPU_PCT_MAX:
        reasons.append(f"other processes used {load.other_cpu_pct:.0f}% of the machine's CPU "
                       "during the case")
    if load is not None and load.cpu_steal_pct > STEAL_PCT_MAX:
        reasons.append(f"steal {load.cpu_steal_pct:.0f}% (the hypervisor gave the machine's "
                       "CPUs to other guests)")
    if ratio is not None and ratio < CPU_PER_WALL_MIN:
        reasons.append(f"median CPU time per step {ratio:.0%} of its {cores} pinned core"
                       f"{'s' if cores != 1 else ''} x wall time (under "
                       f"{CPU_PER_WALL_MIN:.0%}): it waited for a core")
    return "; ".join(reasons)
