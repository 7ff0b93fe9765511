"""The bound of a case from its own parts: how fast its pieces allow it to be.

Beside the measured step time, cases.csv gives the step time the case's own measured
pieces allow (``step_time_s_bound``) and the measured median's distance from it
(``efficiency_vs_bound_pct`` = 100 x bound / median). Parts (``Bound``): *compute*, the
busiest device's work; *bubble*, its idle time the schedule forces with free transfers;
*comm*, what transfers or collectives add; *other*, the step outside the scheduled passes.

Pipelines (gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv). From the traced step's
timeline: each pass's own duration (stage, phase fwd/bwd/wgt, micro-batch; where one is
missing, the median of its stage and phase over micro-batches). Not the medians alone:
passes differ with their place in the step (in a traced 1f1b step on a 2-core cpu rig the
fill's passes, run while the peer idled, were the quick ones: plausibly the two workers'
shared memory bandwidth), and medians then put slow passes on the critical path (that step,
163 ms, replays at 173 ms from medians, at 160 ms pass by pass: tests/test_bound.py).
Replayed pass by pass, the bound is a schedule the traced step could have run: with free
transfers, never over its span. Per stage boundary the transfer time of one micro-batch's
activation (and, backward, its gradient, the same size) at the boundary tensor's bytes in
the dtype that crosses it (``workloads.sizes.boundary_bytes``: bf16 under bf16 autocast),
from the collective micro-benchmark's send/recv fit (``analysis.collective_fits``; the
rig's NCCL between GPUs), counted only where the two stages sit on different ranks.
Chosen over the timeline's gaps because a gap also holds the scheduler's own overhead and
waits for the peer, which is what the bound is to be compared with. The bound is the
makespan of torch's own action list per rank (``prediction.memory``'s replay of the
schedule) run by a list scheduler (``replay_schedule``): an action starts when its rank is free
and its input is there. Exact for unbalanced stages, where closed forms are not. Then
*other* = traced step - timeline span (optimizer step, loss, input split). The traced step
is one step of the first launch: faster or slower as a whole than the case's median step
(noise, launch-to-launch differences, the stamps' own cost), so its pass times and *other*
are scaled by median / traced (``case_bound.traced_parts``): the bound rests on the traced
step's shape at the median's pace, and the note says by how much.

Closed forms with balanced stages (p devices, m micro-batches, v stages per device, per
pass times f, b, w of one stage, transfers free), which tests check the simulator against:

    gpipe       (m+p-1)(f+b)            GPipe (Huang et al., NeurIPS 2019). Exact for any
                                        stage times (a flow shop): sum_s(f_s+b_s)
                                        + (m-1)(max f + max b) + 2(p-1)c, transfer time c
    1f1b        (m+p-1)(f+b)            PipeDream's 1F1B with a flush (Narayanan et al.,
                                        SOSP 2019; ICML 2021). The usual unbalanced
                                        sum_s(f_s+b_s) + (m-1) max_s(f_s+b_s) is only an
                                        upper estimate (the chart below: 19, not 21)
    interleaved (v*m+p-1)(f+b)          Megatron-LM's interleaved 1F1B (Narayanan et al.,
                                        SC 2021): bubble (p-1)(f+b)/v in whole-model
                                        passes; here f, b are one of the v chunks' passes
    zero bubble (3*v*m+p-1) f           Zero Bubble (Qi et al., arXiv 2023, ICLR 2024),
                (f = b = w)             ZB-H1 (torch's interleaved-zb) and ZB-V: each
                                        device idles p-1 chunk passes; ZB-H1's bubble is
                                        (p-1)(f+b-w) in general (analysis.bubble derives both)

    1f1b, p=2, m=3, f=(2,1), b=(4,2) per stage, two characters a unit of time:
        rank0  F0--F1--..B0------F2--B1------B2------   busy 18 + idle 1: makespan 19
        rank1  ....F0B0--F1B1--......F2B2--..........   (the usual estimate says 21)

mp (and ``pipeline`` on a cpu rig, whose one process runs its micro-batches one after
another): the sum of every pass plus, on GPUs, each boundary's transfer forward and back.
``pipeline`` on GPUs: GPipe's order, one stage per device slot. Their hand-off is one
process's ``.to()``, no send between processes: priced with the device-to-device copy
(``transfer_fit``: the rig's measured copy, or ``collective_fits.ASSUMED_DEVICE_COPY``,
which the formula then names). On a cpu rig every slot is the one ``cpu`` device, where
``.to()`` returns the tensor itself, and on one GPU's slots the same: no transfer.

ddp and fsdp: compute = for ddp and ddp-1, the case's own steps with no collective (DDP's
``no_sync``: forward, backward and optimizer step; three after the timed steps of every
launch, every rank starting together so that they share the machine as the timed steps
did; the slowest rank's median, then its median over launches, at most the case's median
step). FSDP2 has no
step without collectives (it all-gathers to compute), so for fsdp: a plain ddp case's of
the same workload and world size (the same local batch through the same model), where the
run has one; else the ``single`` case's measured step x local batch / global batch
(assumed linear in the batch on the same kind of device: a lower bound where per-image cost
rises as the batch shrinks, as it does on CPUs at 64 px: there, on 2 cores, that share is
0.224 s where ddp's no_sync steps take 0.295 s, and read ddp at 56% of its bound where its
own compute reads 75%),
comm = the gradient traffic at the micro-benchmark's fits: ddp all-reduces every gradient
byte in buckets (``DDP_BUCKET_BYTES``), fsdp all-gathers each unit's parameters forward and
again backward (FSDP2 reshards after forward, but not the root) and reduce-scatters its
gradients. On GPUs the collectives overlap the compute: max(compute, comm)
(``step_time_s_bound``); on a cpu rig gloo runs on the cores that compute, so nothing
hides them: the sum (``step_time_s_bound_no_overlap`` either way;
``step_parts.exposed_comm_s``, which the prediction and the waterfall use too). fsdp adds
FSDP2's copies into and out of its gathered buffers at the calibration's copy rate
(``step_parts.fsdp_copies_s``, *other*), where the run calibrated.

The bound, the prediction (``prediction.step_time``) and the waterfall (``rows.waterfall``)
are one model of a step (``analysis.step_parts``): the same parts priced by the same
functions, fed with the case's own figures here, with the calibration's in the prediction.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench_lib.analysis import step_parts
from bench_lib.analysis.collective_fits import CollectiveFit, Collectives, device_copy_fit

Action = tuple[str, int, int]
"""(kind, stage, micro-batch): F forward, B full backward, I input gradient, W weight
gradient (``prediction.memory``'s actions)."""
PHASE_OF = {"F": "fwd", "B": "bwd", "I": "bwd", "W": "wgt"}
"""The timeline phase that stamps each kind of action (``measure.trace``)."""
PIPELINED = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")
PRICED_WITH_COLLECTIVES = frozenset({"ddp", "fsdp", *PIPELINED})
"""Strategies whose bound over 2 devices or more is priced with the collectives' fits; ``mp``
and ``pipeline`` too where their devices are distinct GPUs (``Rig.moves_between``), not one
memory (a cpu rig's workers, the slots of one GPU)."""
MOVING_ACROSS_GPUS = frozenset({"mp", "pipeline"})
"""One process's strategies whose ``.to()`` between distinct GPUs is priced as a device copy
(``transfer_fit``), measured beside the collectives."""
PassTimes = Mapping[tuple[int, str] | tuple[int, str, int], float]
"""Pass durations, seconds: (stage, phase) for every micro-batch, (stage, phase, micro-batch)
for one."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket_cap_mb; its first bucket holds 1 MiB (one more call)."""


@dataclass(frozen=True)
class Bound:
    """A case's bound and its parts, seconds: compute + bubble + comm + other = step_s."""

    formula: str
    """Which bound: the strategy's name, or ``serial`` (one process runs every pass)."""
    step_s: float
    compute_s: float
    """The busiest device's passes (data-parallel: the local batch's compute)."""
    bubble_s: float
    """Idle time the schedule forces on the busiest device, transfers free."""
    comm_s: float
    """What transfers or collectives add (data-parallel: what overlap leaves exposed)."""
    other_s: float = 0.0
    """The step outside the scheduled passes: optimizer step, loss, input split."""
    no_overlap_s: float | None = None
    """Data-parallel: compute + all of comm, nothing overlapped."""
    comm_total_s: float | None = None
    """Data-parallel: the collectives' whole time."""
    scale: float = 1.0
    """Pipelines: the factor the traced pass times were scaled by (``traced_parts``)."""
    busy_s: tuple[float, ...] = ()
    """Pipelines: each rank's passes (the replay's busy time); empty for the others."""
    parts: step_parts.StepParts | None = None
    """A predicted step's parts (``prediction.step_time.predicted_parts``); None otherwise."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def note(self) -> str:
        """``1f1b: compute 0.41 s + bubble 0.12 s + p2p 0.02 s + other 0.03 s``."""
        if self.no_overlap_s is not None:
            total = self.comm_total_s or 0.0
            own = f" + own work {self.other_s:.3g} s" if self.other_s else ""
            if self.comm_s + 1e-12 < total:  # some of it hidden behind the compute
                return (f"{self.formula}: max(compute {self.compute_s:.3g} s, comm "
                        f"{total:.3g} s) with overlap{own}; sum {self.no_overlap_s:.3g} s "
                        "without")
            return (f"{self.formula}: compute {self.compute_s:.3g} s + collectives "
                    f"{total:.3g} s (not overlapped){own}")
        first = self.formula.split()[0]
        link = ("transfers" if first in ("mp", "serial")
                else "collectives" if first in ("ddp", "ddp-1", "fsdp") else "p2p")
        scaled = (f" (traced passes x{self.scale:.2f}: scaled to the median step)"
                  if abs(self.scale - 1) >= 0.005 else "")
        return (f"{self.formula}: compute {self.compute_s:.3g} s + bubble {self.bubble_s:.3g} "
                f"s + {link} {self.comm_s:.3g} s + other {self.other_s:.3g} s{scaled}")


def phase_times(events: Iterable[Mapping[str, Any]]) -> PassTimes:
    """A traced timeline's pass durations: (stage, phase) -> the median over micro-batches,
    and (stage, phase, micro-batch) -> each pass's own."""
    spans: dict[tuple[int, str], list[float]] = {}
    out: dict[tuple[int, str] | tuple[int, str, int], float] = {}
    for e in events:
        took = float(e["end_s"]) - float(e["start_s"])
        spans.setdefault((int(e["stage"]), str(e["phase"])), []).append(took)
        out[int(e["stage"]), str(e["phase"]), int(e["microbatch"])] = took
    return out | {k: statistics.median(v) for k, v in spans.items()}


def action_cost(times: PassTimes, kind: str, stage: int, mb: int) -> float:
    """An action's duration: its own where ``times`` has it, else its stage's and phase's
    (KeyError: neither)."""
    own = times.get((stage, PHASE_OF[kind], mb))
    return own if own is not None else times[stage, PHASE_OF[kind]]


def placement_of(orders: Sequence[Sequence[Action]]) -> dict[int, int]:
    """Stage -> the rank whose action list runs it."""
    return {stage: rank for rank, order in enumerate(orders) for _, stage, _ in order}


def replay_schedule(orders: Sequence[Sequence[Action]], times: PassTimes,
             edge_s: Sequence[float] = ()) -> tuple[float, list[float]]:
    """The makespan of each rank running its actions in order, and each rank's busy time.

    An action starts once its rank is free and its input is ready: F(s) after F(s-1), an
    input gradient (B or I) of s after that of s+1 (the last stage: after its F), W after
    I; ``edge_s[s]`` is added between stages s and s+1 on different ranks. ValueError if
    the lists deadlock.
    """
    rank_of, last = placement_of(orders), max(s for o in orders for _, s, _ in o)
    done: dict[tuple[str, int, int], float] = {}
    free, pos, busy = [0.0] * len(orders), [0] * len(orders), [0.0] * len(orders)

    def ready(kind: str, s: int, mb: int) -> float | None:
        if kind == "F":
            src, key = s - 1, ("F", s - 1, mb)
        elif kind == "W":
            src, key = s, ("G", s, mb)
        else:
            src, key = (s, ("F", s, mb)) if s == last else (s + 1, ("G", s + 1, mb))
        if src < 0:
            return 0.0
        if key not in done:
            return None
        cross = rank_of[src] != rank_of[s] and min(src, s) < len(edge_s)
        return done[key] + (edge_s[min(src, s)] if cross else 0.0)

    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, mb = order[pos[r]]
                at = ready(kind, s, mb)
                if at is None:
                    break
                cost = action_cost(times, kind, s, mb)
                free[r] = max(free[r], at) + cost
                busy[r] += cost
                done["G" if kind in "BI" else kind, s, mb] = free[r]
                pos[r] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise ValueError("the action lists deadlock")
    return max(free), busy


def pipeline_bound(strategy: str, orders: Sequence[Sequence[Action]],
                   times: PassTimes, edge_s: Sequence[float] = (),
                   other_s: float = 0.0) -> Bound:
    """A pipeline schedule's bound: ``replay_schedule`` with and without transfers (module
    docstring); compute is the busiest rank's passes, bubble its forced idle time."""
    free, busy = replay_schedule(orders, times)
    with_p2p = replay_schedule(orders, times, edge_s)[0] if any(edge_s) else free
    compute = max(busy)
    return Bound(strategy, with_p2p + other_s, compute, free - compute, with_p2p - free,
                 other_s, busy_s=tuple(busy))


def serial_bound(formula: str, times: PassTimes, microbatches: int,
                 transfer_s: float = 0.0, other_s: float = 0.0) -> Bound:
    """One process running every stage's passes of every micro-batch in turn, plus
    ``transfer_s`` of transfers: mp, and ``pipeline`` on a cpu rig."""
    own = [v for k, v in times.items() if len(k) == 3]  # each traced pass, where known
    compute = sum(own) if own else microbatches * sum(times.values())
    return Bound(formula, compute + transfer_s + other_s, compute, 0.0, transfer_s, other_s)


def data_parallel_bound(formula: str, compute_s: float, comm_s: float, overlap: bool = True,
                        other_s: float = 0.0) -> Bound:
    """ddp/fsdp: compute + the collectives not hidden (``step_parts.exposed_comm_s``:
    max(compute, comm) with overlap, compute + comm without) + ``other_s`` (the strategy's
    own work: FSDP2's copies)."""
    exposed = step_parts.exposed_comm_s(compute_s, comm_s, overlap)
    return Bound(formula, compute_s + exposed + other_s, compute_s, 0.0, exposed, other_s,
                 compute_s + comm_s + other_s, comm_s)


def ddp_comm_s(grad_bytes: float, all_reduce: CollectiveFit,
               bucket_cap_bytes: float | None = None) -> float:
    """DDP's all-reduce of every gradient byte, one call per bucket (``bucket_cap_bytes``
    None: torch's default, ``DDP_BUCKET_BYTES`` after a first bucket of 1 MiB)."""
    if bucket_cap_bytes is None:
        calls = 1 + math.ceil(max(0.0, grad_bytes - 2**20) / DDP_BUCKET_BYTES)
    else:
        calls = max(1, math.ceil(grad_bytes / bucket_cap_bytes))
    return all_reduce.time_s(grad_bytes, calls)


def fsdp_comm_s(unit_bytes: Sequence[int], root_bytes: int, all_gather: CollectiveFit,
                reduce_scatter: CollectiveFit) -> float:
    """FSDP2's traffic: per unit an all-gather forward and backward and a reduce-scatter;
    the root's parameters gathered once (it stays unsharded after forward)."""
    units = [b for b in unit_bytes if b > 0]
    gathers = 2 * sum(all_gather.time_s(b) for b in units)
    scatters = sum(reduce_scatter.time_s(b) for b in units)
    if root_bytes > 0:
        gathers += all_gather.time_s(root_bytes)
        scatters += reduce_scatter.time_s(root_bytes)
    return gathers + scatters


def transfer_fit(process_group: bool, collectives: Collectives | None
                 ) -> tuple[CollectiveFit | None, str]:
    """The fit a stage boundary's hand-off is priced with, and what the formula must say of
    it: between processes (torch's pipelining schedules) the run's send/recv fit (None where
    not measured: the caller takes the transfers free); inside one process (mp,
    ``pipeline``) the device-to-device copy, measured or assumed (``device_copy_fit``)."""
    if process_group:
        return (collectives.fit("send_recv") if collectives is not None else None), ""
    return device_copy_fit(collectives)


def closed_form(strategy: str, p: int, m: int, f: float, b: float, w: float = 0.0) -> float:
    """The textbook step of a balanced schedule, transfers free (module docstring): f, b,
    w per pass of one stage (for interleaved and zero bubble, one of the v=2 chunks)."""
    if strategy in ("gpipe", "1f1b"):
        return (m + p - 1) * (f + b)
    if strategy == "interleaved-1f1b":
        return (2 * m + p - 1) * (f + b)
    if strategy in ("interleaved-zb", "zbv"):
        if not f == b == w:
            raise ValueError("the zero-bubble closed form holds for f = b = w only")
        return (3 * 2 * m + p - 1) * f
    raise ValueError(f"no closed form for {strategy!r}")
