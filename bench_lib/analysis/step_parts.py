"""One model of a training step: its parts, each defined once, computed two ways.

A case's step on N devices is cut into the parts below, from the ideal (single's step spread
over the N devices) up to what the busiest device waits for. Each part is computed by the
functions of this module from a ``Figures``: the *predicted* column feeds them the workload's
calibration (``prediction.step_time.predicted_parts``, before the case runs), the *measured*
column the case's own figures and the run's (``rows.waterfall``, after it). The waterfall is
the measured column beside the measured step (its ``remainder`` is what no part explains),
the prediction is the predicted column's sum, and the bound (``analysis.bound``) is priced
with the same functions (``exposed_comm_s``, ``fsdp_copies_s``, the schedule's replay).
Where a part's two values disagree is where the model is wrong: the report shows it part by
part (``report.part_errors``).

B the batch, W single's batch it is compared with (strong scaling: B; weak: B / N), b the
images one device computes at once, T(b) single's step alone at b (measured: single's batch
curve; predicted: the calibration's), O the whole model's optimizer step, s the share of it
one device runs (1 for ddp and dp, 1/N where the model or its optimizer state is split)::

    ideal      T(W) B / (W N)
    batch      B/(bN) (T(b) - O) - B/(WN) (T(W) - O)   computing b images at once, not W
    optimizer  s O - B/(WN) O                         a device steps more than its 1/N
               (ideal + batch + optimizer = C, one device's compute, from single's curve)
    corun      S - C      S: one device's compute while the others compute too, no
                          communication (measured: ddp's no_sync steps, a traced step's passes;
                          predicted: the calibration's "together" steps, the replayed passes)
    imbalance  the busiest device's passes over the mean device's
    bubble     the idle time the schedule forces on the busiest device with free transfers
               (``analysis.bound.replay_schedule``'s replay of torch's action lists); a serial case
               (one process runs every stage in turn: mp, ``pipeline`` on a cpu rig) idles
               while the others compute
    comm       collectives and transfers not hidden (``exposed_comm_s``)
    own        the strategy's own work: DDP's around its all-reduce (bucketing, copying
               gradients), FSDP2's copies into and out of its gathered buffers
               (``fsdp_copies_s``), a schedule's work between passes (``schedule_work_s``),
               a serial pipeline's stages running slower than single's curve (its hand-offs)

Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("ideal", "batch", "optimizer", "corun", "imbalance", "bubble", "comm", "own")
"""A step's parts in order (module docstring)."""
WORDS = {"ideal": "the ideal N-fold step", "batch": "the smaller batch per device",
         "optimizer": "each device's optimizer step", "corun": "devices computing together",
         "imbalance": "the busiest device's extra work", "bubble": "the schedule's bubble",
         "comm": "communication not hidden", "own": "the strategy's own work"}
"""Each part in words, for notes and the report."""


@dataclass(frozen=True)
class StepParts:
    """A step cut into ``PARTS``, seconds, and what its ``own`` part is (or why it is 0)."""

    ideal_s: float
    batch_s: float
    optimizer_s: float
    corun_s: float
    imbalance_s: float
    bubble_s: float
    comm_s: float
    own_s: float
    own_what: str = ""

    def part_s(self, part: str) -> float:
        return float(getattr(self, f"{part}_s"))

    @property
    def total_s(self) -> float:
        """The step these parts add up to."""
        return sum(self.part_s(p) for p in PARTS)

    def columns(self, prefix: str) -> dict[str, float]:
        """``<prefix>_<part>_s`` for every part."""
        return {f"{prefix}_{p}_s": self.part_s(p) for p in PARTS}


@dataclass(frozen=True)
class Figures:
    """What one column's parts are computed from (``parts``)."""

    devices: int
    batch: int
    device_batch: int
    workload_batch: int
    curve: Mapping[int, float]
    """Single's step alone per batch size: at least W and b."""
    optimizer_s: float = 0.0
    """O (0: not measured; then counted with every micro-batch)."""
    optimizer_share: float = 1.0
    shared_compute_s: float | None = None
    """S, one device's compute (its optimizer share included), mean over devices; None:
    not measured, or the devices take turns (then C)."""
    busy_s: Sequence[float] = ()
    """Each device's passes in a step (traced, or replayed); empty: all alike."""
    serial: bool = False
    """One process runs every stage in turn."""
    bubble_s: float = 0.0
    """The schedule's forced idle time on the busiest device (not serial)."""
    comm_s: float = 0.0
    """Communication not hidden (``exposed_comm_s``)."""
    own_s: float = 0.0
    own_what: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


def ideal_s(curve: Mapping[int, float], batch: int, workload_batch: int, devices: int) -> float:
    """T(W) B / (W N): single's step spread over the devices."""
    return curve[workload_batch] * batch / (workload_batch * devices)


def curve_compute_s(f: Figures) -> float:
    """C: one device's compute a step from single's curve, B/(bN) (T(b) - O) + s O."""
    return (f.batch / (f.device_batch * f.devices) * (f.curve[f.device_batch] - f.optimizer_s)
            + f.optimizer_share * f.optimizer_s)


def batch_s(f: Figures) -> float:
    """What computing b images at once costs beyond W at once, optimizer step aside."""
    whole = f.batch / (f.workload_batch * f.devices)
    return (f.batch / (f.device_batch * f.devices) * (f.curve[f.device_batch] - f.optimizer_s)
            - whole * (f.curve[f.workload_batch] - f.optimizer_s))


def optimizer_part_s(f: Figures) -> float:
    """s O - B/(WN) O: a device's optimizer step beyond its share of the ideal's."""
    return f.optimizer_s * (f.optimizer_share - f.batch / (f.workload_batch * f.devices))


def imbalance_s(busy_s: Sequence[float]) -> float:
    """The busiest device's passes over the mean device's (0 for one or none)."""
    values = [v for v in busy_s if v > 0]
    return max(values) - statistics.fmean(values) if len(values) >= 2 else 0.0


def serial_bubble_s(busy_s: Sequence[float], compute_s: float, devices: int,
                    optimizer_s: float, share: float) -> float:
    """One process running the stages in turn: the busiest device idles while the others'
    passes and optimizer shares run (equal shares of ``compute_s`` where not traced)."""
    if not busy_s:
        return (devices - 1) * compute_s
    return sum(busy_s) - max(busy_s) + optimizer_s * (1 - share)


def exposed_comm_s(compute_s: float, comm_s: float, overlap: bool) -> float:
    """What collectives of ``comm_s`` add to a step of ``compute_s``: beyond the compute
    where they overlap it (GPUs: NCCL's own streams), all of it where they do not (a cpu
    rig: gloo runs on the cores that compute)."""
    return max(0.0, comm_s - compute_s) if overlap else comm_s


FRESH_COPY_BYTES = 64 * 2**20
"""The copy the calibration times into a buffer allocated for it: above glibc's largest
dynamic mmap threshold (32 MiB), so that where a process's heap is glibc's default its
pages are new each time whatever ran before; in a cpu worker, which keeps its heap
(``pinning.keep_heap``), they are pages the heap kept, as FSDP2's buffers' are."""


def fsdp_copied_bytes(units: Sequence[int], root: int, devices: int) -> float:
    """The bytes FSDP2 copies per step: per unit of b bytes, gathered forward and again
    backward (copy-in of its shard, copy-out of the whole) and its gradient reduce-scattered
    (copy-in of the whole, the shard out): 3 (b + b/N); the root, gathered once: 2 (b + b/N)."""
    return sum(times * (b + b / devices)
               for b, times in [*((u, 3) for u in units), (root, 2)] if b > 0)


def fsdp_copies_s(units: Sequence[int], root: int, devices: int,
                  copies: Mapping[int, float]) -> float:
    """FSDP2's copies per step (``fsdp_copied_bytes``) at the calibrated rate of a copy into
    a buffer allocated for it and freed after, as its all-gather and reduce-scatter buffers
    are. A cpu worker keeps its heap (``pinning.keep_heap``), so these land on pages it used
    before, in the calibration as in the case; before it did, glibc paged them in afresh
    (about 2.6 GB/s against 20 into a reused buffer, 2-core AMD EPYC) or not, as the heap
    happened to be: timing each unit's size gave 75 to 550 ms for the same copies from one
    calibration to the next. KeyError: the rate was not calibrated."""
    if FRESH_COPY_BYTES not in copies:
        raise KeyError("copy into a fresh buffer")
    return fsdp_copied_bytes(units, root, devices) * copies[FRESH_COPY_BYTES] / FRESH_COPY_BYTES


def ddp_own_s(ddp_s: float, without_ddp_s: float) -> float:
    """DDP's own work a step: a step under DDP on one device (``ddp-1``, or a ddp case of
    world size 1) less the same step without it (single's at the same batch, or the case's
    no_sync steps, which skip DDP's gradient hooks); signed (a negative one is noise)."""
    return ddp_s - without_ddp_s


def schedule_work_s(events: Iterable[Mapping[str, Any]]) -> float:
    """A schedule's own work between the passes of a traced step, on the rank with the most:
    per rank, the time between one pass's end and the next one's start once that pass's
    input was there (an input from another rank: the end of the pass that made it), so
    waiting for a peer is not counted. F(s) needs F(s-1); a backward of stage s needs that
    of s+1 (the last stage: its own forward); W needs its stage's backward."""
    rows = sorted(events, key=lambda e: float(e["start_s"]))
    if not rows:
        return 0.0
    ends = {(int(e["stage"]), str(e["phase"]), int(e["microbatch"])): float(e["end_s"])
            for e in rows}
    last = max(s for s, _, _ in ends)
    work: dict[int, float] = {}
    previous: dict[int, float] = {}
    for e in rows:
        rank, s, mb, phase = int(e.get("rank", 0)), int(e["stage"]), int(e["microbatch"]), \
            str(e["phase"])
        needs = (("fwd", s - 1) if phase == "fwd" else ("bwd", s) if phase == "wgt"
                 else ("fwd", s) if s == last else ("bwd", s + 1))
        ready = ends.get((needs[1], needs[0], mb), float("-inf")) if needs[1] >= 0 else \
            float("-inf")
        if rank in previous:
            work[rank] = work.get(rank, 0.0) + max(
                0.0, float(e["start_s"]) - max(previous[rank], ready))
        previous[rank] = max(previous.get(rank, float("-inf")), float(e["end_s"]))
    return max(work.values(), default=0.0)


def parts(f: Figures) -> StepParts | str:
    """``f``'s step cut into ``PARTS`` (module docstring), or why not (a batch the curve
    lacks)."""
    for b in sorted({f.workload_batch, f.device_batch}):
        if b not in f.curve:
            return f"single's step at batch {b} is not known"
    compute = curve_compute_s(f)
    opt, share = f.optimizer_s, f.optimizer_share
    if f.serial and f.devices > 1:
        # Each device's compute S_d = its passes + its optimizer share; what they take
        # beyond single's curve is the serial process's own (its hand-offs between stages).
        own = (statistics.fmean(f.busy_s) + share * opt - compute) if f.busy_s else 0.0
        return StepParts(ideal_s(f.curve, f.batch, f.workload_batch, f.devices), batch_s(f),
                         optimizer_part_s(f), 0.0, imbalance_s(f.busy_s),
                         serial_bubble_s(f.busy_s, compute, f.devices, opt, share),
                         f.comm_s, own + f.own_s, f.own_what)
    shared = compute if f.shared_compute_s is None else f.shared_compute_s
    return StepParts(ideal_s(f.curve, f.batch, f.workload_batch, f.devices), batch_s(f),
                     optimizer_part_s(f), shared - compute, imbalance_s(f.busy_s),
                     f.bubble_s, f.comm_s, f.own_s, f.own_what)
