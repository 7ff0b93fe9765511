"""Where the ideal N-fold speedup goes: a case's step cut into parts, each measured apart
from the case, and the remainder that none of them explains.

From the ideal (``single``'s step at the global batch B over the N devices the case uses;
under weak scaling, where B is N times the workload's batch W, single's step at W: N times
W images in the time of W) down to the measured step, in this order (seconds of the case's
step)::

    ideal      T1(W) x B / (W N)     strong scaling: W = B, so T1(B) / N; weak: T1(W)
    batch      C - ideal          C = B / (b N) x (T1(b) - O) + s O: what one device
                                  spends when it computes b images at once (a data-parallel
                                  rank's share, a micro-batch), from single's batch curve
                                  T1 (the batch curve's rows, ``sweep.cases.batch_curve``),
                                  its optimizer step O (single's, timed alone) counted once
                                  per step, for the share s of the model the device updates
                                  (1 for ddp and dp, 1/N where the model or its optimizer
                                  state is split: the pipelines, mp, fsdp)
    corun      S - C              S: one device's compute a step while the others compute
                                  too, with no communication (ddp: its no_sync steps; fsdp:
                                  those of a ddp case of the same local batch; the pipelining
                                  schedules: the traced step's passes, mean over devices,
                                  plus s O): what computing beside each other costs (shared
                                  caches and memory bandwidth, a schedule's per-pass work);
                                  0 where not measured or one device computes at a time
    imbalance  S x (k - 1)        k: the busiest device's busy time in the traced step over
                                  the mean (pipelines; 1 where every device does the same)
    bubble     S k x f / (1 - f)  f: the schedule's idle share of the span in theory for its
                                  p, m, v (``analysis.bubble.theory``); a serial case (one
                                  process runs every stage in turn: mp, and pipeline on a
                                  cpu rig) idles while the others compute: S N - S k
    comm       what the case's collectives or transfers add to its bound, at the run's
               measured bandwidths (``bound_comm_s``: ddp/fsdp overlapped with compute,
               pipelines' p2p per stage boundary); on a cpu rig a data-parallel case's whole
               collective time (its workers' collectives run on the cores that compute:
               none is hidden)
    remainder  measured - every part above: what no part explains (contention between
               workers that share a machine, scheduling, what the parts' own noise hides)

Each part is a figure measured without the case (single's curve, the collective
micro-benchmark, the schedule's theory), except S and k, read from the case's own steps
without communication and its traced step.
Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench_lib.analysis.bubble import theory

PARTS = ("ideal", "batch", "corun", "imbalance", "bubble", "comm", "remainder")
"""The waterfall's parts in order; ``waterfall_<part>_s`` and ``_pct`` in cases.csv."""
SERIAL_NOTE = "serial: one process runs every stage in turn"
UNEXPLAINED = 0.10
"""A remainder beyond this share of the step is said in the note, with what is missing."""
MISSING = {
    "fsdp": "no part covers FSDP2's work around its collectives (copying parameters into and "
            "out of the gathered buffers, resharding after each unit)",
    "ddp": "no part covers DDP's work around its all-reduce (bucketing, copying gradients "
           "into buckets)",
    "": "no part covers work outside the stamped passes (between stages, in the schedule) "
        "or waits beyond the transfers' fits",
}
"""What no part covers, said where a large positive remainder shows it missing."""


@dataclass(frozen=True)
class Waterfall:
    """A case's measured step, cut into parts (module docstring), seconds."""

    measured_s: float
    ideal_s: float
    batch_s: float
    imbalance_s: float
    bubble_s: float
    comm_s: float
    note: str = ""
    corun_s: float = 0.0

    @property
    def remainder_s(self) -> float:
        return self.measured_s - (self.ideal_s + self.batch_s + self.corun_s
                                  + self.imbalance_s + self.bubble_s + self.comm_s)

    def part_s(self, part: str) -> float:
        return float(getattr(self, f"{part}_s"))

    def columns(self) -> dict[str, float | str]:
        """``waterfall_<part>_s`` and ``waterfall_<part>_pct`` (of the measured step), and
        ``waterfall_note``."""
        out: dict[str, float | str] = {}
        for part in PARTS:
            out[f"waterfall_{part}_s"] = self.part_s(part)
            out[f"waterfall_{part}_pct"] = 100 * self.part_s(part) / self.measured_s
        out["waterfall_note"] = self.note
        return out


def waterfall(strategy: str, devices: int, batch: int, device_batch: int,
              microbatches: int | None, curve: Mapping[int, float], measured_s: float,
              busiest_over_mean: float = 1.0, serial: bool = False,
              comm_s: float = 0.0, optimizer_s: float | None = None,
              optimizer_share: float = 1.0, workload_batch: int | None = None,
              shared_compute_s: float | None = None) -> Waterfall | str:
    """The parts of a case's step (module docstring), or why it has none.

    ``curve``: single's median step per batch size of the same workload (the full batch
    among them); ``device_batch``: the images a device computes at once (``Case.
    device_batch_size``); ``busiest_over_mean``: k; ``serial``: one process runs every
    stage in turn; ``comm_s``: the bound's communication part; ``optimizer_s``: single's
    optimizer step alone (None: not measured, and then counted with every micro-batch);
    ``optimizer_share``: s; ``workload_batch``: W (default ``batch``: strong scaling);
    ``shared_compute_s``: S (None: not measured, corun 0).
    """
    workload = batch if workload_batch is None else workload_batch
    if workload not in curve:
        return f"no waterfall: single at batch {workload} was not measured"
    if device_batch not in curve:
        return (f"no waterfall: single at batch {device_batch} (this case's images per "
                "device) was not measured: the profile's batch_curve is off")
    ideal = curve[workload] * batch / (workload * devices)
    notes = []
    opt = optimizer_s or 0.0
    compute = (batch / (device_batch * devices) * (curve[device_batch] - opt)
               + optimizer_share * opt)
    shared = compute if shared_compute_s is None or serial else shared_compute_s
    if shared != compute:
        notes.append(f"devices computing together {shared / compute:.2f}x alone")
    busiest = shared * busiest_over_mean
    if serial and devices > 1:
        # The busiest device idles while the others compute, one after another: the step is
        # every device's compute in turn, S N.
        bubble = shared * devices - busiest
        others = "the other device computes" if devices == 2 else \
            f"the other {devices - 1} compute"
        notes.append(f"{SERIAL_NOTE}: the busiest device idles while {others}")
    else:
        found = theory(strategy, devices, microbatches)
        bubble = busiest * found.fraction / (1 - found.fraction) if found else 0.0
        if found:
            notes.append(f"bubble {found.describe()}")
    if busiest_over_mean != 1.0:
        notes.append(f"busiest device {busiest_over_mean:.2f}x the mean")
    if optimizer_s is None and batch != device_batch:
        notes.append("optimizer step not measured: counted with every micro-batch")
    found_parts = Waterfall(measured_s, ideal, compute - ideal, busiest - shared, bubble,
                            comm_s, corun_s=shared - compute)
    share = found_parts.remainder_s / measured_s
    if abs(share) > UNEXPLAINED:
        notes.append(f"remainder {share:+.0%} of the step: "
                     + (MISSING.get(strategy, MISSING[""]) if share > 0
                        else "the parts add up to more than the step"))
    return dataclasses.replace(found_parts, note="; ".join(notes))


def busiest_over_mean(busy_s: Mapping[Any, float]) -> float:
    """k: the busiest device's busy time over the mean of all (1 for one or none)."""
    values = [v for v in busy_s.values() if v > 0]
    if len(values) < 2:
        return 1.0
    return max(values) / (sum(values) / len(values))
