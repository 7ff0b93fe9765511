"""A case's bound from what its run recorded: which formula of ``analysis.bound`` applies,
the traced step's pass times, and the byte sizes the transfers and collectives move.

``rows.bound_columns.bound_columns`` calls ``case_bound`` for each ok case. Byte sizes come
from the model built on meta tensors (``workloads.sizes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from bench_lib.analysis import step_parts
from bench_lib.analysis.bound import (
    PIPELINED,
    Bound,
    PassTimes,
    data_parallel_bound,
    ddp_comm_s,
    fsdp_comm_s,
    phase_times,
    pipeline_bound,
    serial_bound,
    transfer_fit,
)
from bench_lib.analysis.bubble import span
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.workloads.sizes import boundary_bytes, parameter_bytes

if TYPE_CHECKING:
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case


def case_bound(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float,
               single_s: float | None = None,
               collectives: Collectives | None = None,
               ddp_compute_s: float | None = None,
               copies: Mapping[int, float] | None = None) -> Bound | str | None:
    """An ok case's bound (``analysis.bound`` states each formula), why it has none, or None
    for a strategy without one (single, dp, accum). ``median_s``: its median step;
    ``single_s``: the same workload's ``single`` median step; ``collectives``: the run's
    micro-benchmark; ``ddp_compute_s``: for fsdp, a ddp case's measured compute of the same
    local batch (``rows.workload_rows.ddp_compute_s``); ``copies``: the workload's calibrated
    copy rate (``Calibration.copies``), which prices FSDP2's copies."""
    name = case.strategy
    if case.spans_nodes(rig):  # the micro-benchmark's fits are node 0's, not the network's
        return (f"no bound: the case's ranks span {rig.nodes} nodes, and the collective "
                "micro-benchmark measured node 0's devices only")
    if name in ("ddp", "ddp-1", "fsdp"):
        return _data_parallel(case, rig, outcome, median_s, single_s, collectives,
                              ddp_compute_s, copies)
    if name not in (*PIPELINED, "mp", "pipeline"):
        return None
    if not outcome.timeline:
        return f"no bound: no timeline{f' ({outcome.trace_note})' if outcome.trace_note else ''}"
    times, other, scale = traced_parts(outcome, median_s)
    m = 1 if name == "mp" else case.num_microbatches or 1
    micro = case.batch_size if name == "mp" else case.split_size or case.batch_size
    fit, assumed = transfer_fit(case.process_group, collectives)
    cuts = tuple(int(c) for c in outcome.partition.partition(":")[2].split(",") if c)
    edges = ([fit.time_s(b) if case.process_group or rig.moves_between(k, k + 1) else 0.0
              for k, b in enumerate(boundary_bytes(case.model, case.image_size, micro, cuts,
                                                   case.precision))]
             if fit is not None and cuts else [])
    serial = name == "mp" or (name == "pipeline" and rig.kind == "cpu")
    try:
        if serial:
            # One process: each boundary's .to() costs a copy there and back (none where
            # both stages are in one memory: a cpu rig's workers, one GPU's slots).
            found = serial_bound("mp" if name == "mp" else "serial", times, m, 2 * sum(edges),
                                 other)
        else:
            from bench_lib.prediction.schedule_orders import schedule_actions

            found = pipeline_bound(name, schedule_actions(
                "gpipe" if name == "pipeline" else name, case.world_size, m), times, edges, other)
    except (KeyError, ValueError) as e:  # a pass the timeline lacks, a deadlock
        return f"no bound: {type(e).__name__}: {e}"
    if not edges and (rig.kind == "cuda" or not serial):
        found = replace(found, formula=f"{found.formula} (transfers not measured, taken free)")
    elif assumed and any(edges):
        found = replace(found, formula=f"{found.formula} ({assumed})")
    return replace(found, scale=scale)


def traced_parts(outcome: CaseOutcome, median_s: float) -> tuple[PassTimes, float, float]:
    """The traced step's pass times (``phase_times``) and its time outside the passes,
    scaled by ``median_s`` / traced step (one step: noise, and the stamps' own cost, make it
    faster or slower as a whole than the median the bound is compared with), and that
    scale."""
    times = phase_times(outcome.timeline)
    lo, hi = span(outcome.timeline)
    traced = outcome.traced_step_s
    other = max(0.0, traced - (hi - lo)) if traced else 0.0
    scale = traced_scale(outcome, median_s)
    return {k: v * scale for k, v in times.items()}, other * scale, scale


def traced_scale(outcome: CaseOutcome, median_s: float) -> float:
    """``median_s`` over the traced step (``traced_parts``): the traced step is one step of
    one launch, its shares are the case's, its pace the median step's; 1 without one."""
    traced = outcome.traced_step_s
    return median_s / traced if traced and median_s > 0 else 1.0


def _data_parallel(case: Case, rig: Rig, outcome: CaseOutcome, median_s: float,
                   single_s: float | None, collectives: Collectives | None,
                   ddp_compute_s: float | None = None,
                   copies: Mapping[int, float] | None = None) -> Bound | str:
    """ddp's (ddp-1's: no peer) or fsdp's bound, or why there is none. Compute: the case's
    own steps with no collective (``outcome.compute_step_s``: ddp, ddp-1), or for fsdp
    those of a ddp case of the same local batch, at most its median step; else
    ``single``'s step times the local share of the batch. Collectives overlap the compute
    on GPUs, not on a cpu rig (``step_parts.exposed_comm_s``); fsdp adds its copies at
    ``copies``' rate (``step_parts.fsdp_copies_s``) where the calibration timed it."""
    if outcome.compute_step_s is not None:
        compute = min(outcome.compute_step_s, median_s)
        formula = f"{case.strategy} (compute: its no_sync steps)"
    elif ddp_compute_s is not None:
        compute = min(ddp_compute_s, median_s)
        formula = f"{case.strategy} (compute: ddp's no_sync steps, the same local batch)"
    elif single_s is not None:  # single's step at the workload's batch (weak: the local one)
        local = case.batch_size // case.world_size
        compute = single_s * local / case.workload_batch
        formula = (f"{case.strategy} (compute: single's step x {local}/{case.workload_batch})")
    else:
        return "no bound: no ok single case of this workload in the run"
    grads, units = parameter_bytes(case.model, case.image_size)
    if case.world_size < 2:
        return data_parallel_bound(formula, compute, 0.0)
    ddp = case.strategy != "fsdp"
    hook = case.ddp.comm_hook if case.ddp is not None else "none"
    if hook == "powersgd":
        return "no bound: PowerSGD's compressed traffic is not modelled"
    ops = ("all_reduce",) if ddp else ("all_gather", "reduce_scatter")
    fits = [collectives.fit(op) for op in ops] if collectives is not None else []
    if collectives is None or None in fits:
        why = collectives.skipped if collectives is not None else "not measured"
        return f"no bound: no collective micro-benchmark ({why or 'incomplete'})"
    if ddp:  # the fp16 and bf16 hooks all-reduce half the bytes
        cap_mb = case.ddp.bucket_cap_mb if case.ddp is not None else None
        comm = ddp_comm_s(grads / 2 if hook in ("fp16", "bf16") else grads,
                          collectives.fits["all_reduce"],
                          None if cap_mb is None else cap_mb * 2**20)
        own = 0.0
    else:
        comm = fsdp_comm_s(units, grads - sum(units), collectives.fits["all_gather"],
                           collectives.fits["reduce_scatter"])
        try:
            own = step_parts.fsdp_copies_s(units, grads - sum(units), case.world_size,
                                           copies or {})
        except KeyError:  # no calibration: the bound leaves the copies out, as before
            own = 0.0
    return data_parallel_bound(formula, compute, comm, rig.kind == "cuda", own)
