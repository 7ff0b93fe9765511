"""A case's step time, predicted before it runs, from its workload's calibration.

The calibration (``prediction.calibration_data``: what it measures; ``prediction.calibration``: its
launch) times each workload's step alone and together at the batch sizes the sweep's
cases compute on a device (``calibration_sizes``), and its blocks where a pipelining
schedule cuts the model. The collective micro-benchmark's fits
(``analysis.collective_fits``) price the communication: NCCL's (gloo's) between processes,
the device copy's for one process's ``.to()`` between two GPUs, assumed where not measured
(the formula then says so). Activations cross a cut at the case's precision
(``workloads.sizes.boundary_bytes``).

The prediction is the bound's arithmetic (``analysis.bound``) fed with calibrated parts
instead of the case's own (B the batch, s the split size, N the devices, O the optimizer
step, T_a(b) and T_t(b) the calibrated step alone and together)::

    single                T_a(B)
    accum, pipeline (cpu) B/s (T_a(s) - O) + O        one process, micro-batches in turn
    mp                    T_a(B) (+ on GPUs each boundary's activation, forward and back,
                          at the device copy's fit: ``collective_fits.device_copy_fit``)
    ddp                   T_t(B/N) + all-reduce of every gradient byte in DDP's buckets:
                          on a cpu rig added (the collectives run on the cores that compute),
                          on GPUs overlapped (max: ``data_parallel_bound``)
    ddp-1                 T_a(B)
    fsdp                  T_t(B/N) - O + O/N + FSDP2's all-gathers and reduce-scatters
                          (added on a cpu rig, overlapped on GPUs) + its copies into fresh
                          buffers around them (``fsdp_copies_s``, calibrated)
    gpipe, 1f1b,          (``prediction.pipeline_time``) torch's action lists replayed
    interleaved-*, zbv    (``bound.replay_schedule``) with each stage's forward and backward: the
                          sum of its blocks' together times at s, scaled so that the
                          blocks add up to T_t(s) - O (a block timed alone misses the
                          step's glue: loss, the graph's own overhead); the cut the
                          balanced partition picks from the same block times
                          (``balanced-flops`` and ``tutorial``: their own cut); transfers
                          at the send/recv fit (``pipeline``: the device copy's); plus O / N
                          (each rank steps its stages' parameters). Zero-bubble schedules
                          split a backward into its input and weight gradients: half each
                          (said in the formula).

The predicted step is also cut into the step's parts (``predicted_parts``: the
``analysis.step_parts`` list the waterfall measures), which add up to it: where a part's
predicted and measured values disagree is where this model is wrong.

Each prediction is a ``analysis.bound.Bound`` (its parts say where the time goes) or the
reason there is none (``dp``: no model of its scatter and gather; no calibration; a
batch the calibration lacks). ``speedup`` turns two predictions into a speedup the way
``rows.speedup_table.SpeedupTable`` turns two measurements into one.

Pure arithmetic: no torch (the schedules' action lists and the cut's boundary bytes are
passed in, or computed on demand by the modules that need torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from bench_lib.analysis import step_parts
from bench_lib.analysis.bound import (
    PIPELINED,
    Bound,
    data_parallel_bound,
    ddp_comm_s,
    fsdp_comm_s,
)
from bench_lib.analysis.collective_fits import Collectives, device_copy_fit
from bench_lib.analysis.step_parts import Figures, StepParts
from bench_lib.prediction.calibration_data import BatchCosts, Calibration, Sizes
from bench_lib.prediction.case_shape import Shape, shape_of
from bench_lib.prediction.pipeline_time import PipelineParts, fixed_cuts, pipeline_parts, pipelined

if TYPE_CHECKING:
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case


def calibration_sizes(shape: Shape) -> Sizes:
    """The batch sizes ``predict`` reads for ``shape`` (and single's at its workload batch,
    for the speedup)."""
    single = frozenset({shape.workload_batch or shape.batch})
    name, b = shape.strategy, shape.device_batch
    if name in ("single", "ddp-1", "mp"):
        return Sizes(single | {shape.batch})
    if name in ("accum", "pipeline") and (name == "accum" or shape.serial):
        return Sizes(single | {b})
    # Alone at b too: the step's parts (``predicted_parts``) price the smaller batch with it.
    if name in ("ddp", "fsdp"):
        return Sizes(single | {b}, frozenset({b}))
    if name in PIPELINED or name == "pipeline":
        return Sizes(single | {b}, frozenset({b}), frozenset({b}))
    return Sizes(single)



def predict(shape: Shape, cal: Calibration | None, collectives: Collectives | None = None,
            grad_bytes: float = 0.0, fsdp_units: Sequence[int] = (),
            pipeline: PipelineParts | None = None, transfer_s: float = 0.0) -> Bound | str:
    """``shape``'s predicted step and its parts (module docstring), or why there is none.

    ``grad_bytes``: the model's gradient bytes (ddp, fsdp); ``fsdp_units``: each FSDP
    unit's parameter bytes (the root's: the rest); ``pipeline``: the pipelined schedules'
    parts; ``transfer_s``: mp's activation transfers on GPUs, forward and back.
    """
    if cal is None:
        return "no prediction: no calibration"
    name, opt = shape.strategy, cal.optimizer_s
    try:
        if name in ("single", "ddp-1"):
            return _serial(name, _step(cal.alone, shape.batch))
        if name == "mp":
            step = _step(cal.alone, shape.batch)
            return Bound("mp", step + transfer_s, step - opt, 0.0, transfer_s, opt)
        if name == "accum" or (name == "pipeline" and shape.serial):
            m = shape.microbatches
            compute = m * (_step(cal.alone, shape.device_batch) - opt)
            return Bound("serial" if name == "pipeline" else name, compute + opt, compute, 0.0,
                         0.0, opt)
        if name in ("ddp", "fsdp"):
            return _data_parallel(shape, cal, collectives, grad_bytes, fsdp_units)
        if name in PIPELINED or name == "pipeline":
            if pipeline is None:
                return f"no prediction: {name} needs its schedule's action lists"
            return pipelined(shape, cal, pipeline)
    except KeyError as e:
        return f"no prediction: the calibration has no {e.args[0]}"
    return f"no prediction: no model of {name}'s step"


def predicted_parts(shape: Shape, cal: Calibration, found: Bound) -> StepParts | str:
    """The predicted column of the step's parts (``analysis.step_parts``) for ``shape``,
    whose predicted step is ``found`` (``predict``'s): they add up to its ``step_s``; each
    device steps ``shape.optimizer_share`` of the optimizer (``shape_of`` sets it). Single's
    curve is the calibration's steps alone; S its steps together (ddp, fsdp) or the mean of
    the replayed passes (pipelines); comm, bubble and own are ``found``'s, priced by the
    same functions the bound uses. DDP's own work and a serial pipeline's hand-offs are not
    calibrated: 0 here, and the report shows what they were measured at."""
    if shape.strategy == "single":
        return "single is the reference"
    n, opt, share = shape.devices, cal.optimizer_s, shape.optimizer_share
    base = Figures(n, shape.batch, shape.device_batch, shape.workload_batch or shape.batch,
                   {b: c.step_s for b, c in cal.alone.items()}, opt, share)
    if found.busy_s:  # a replayed schedule
        mean = sum(found.busy_s) / len(found.busy_s)
        figures = replace(base, shared_compute_s=mean + share * opt, busy_s=found.busy_s,
                          bubble_s=found.bubble_s, comm_s=found.comm_s)
    elif shape.serial or shape.strategy in ("mp", "accum", "ddp-1"):
        figures = replace(base, serial=shape.serial or shape.strategy == "mp",
                          comm_s=found.comm_s)
    else:  # ddp, fsdp: every device's step together, the collectives, FSDP2's copies
        figures = replace(base, shared_compute_s=found.compute_s, comm_s=found.comm_s,
                          own_s=found.other_s,
                          own_what="FSDP2's copies" if found.other_s else
                          "DDP's own work: not calibrated" if shape.strategy == "ddp" else "")
    return step_parts.parts(figures)


def _step(costs: Mapping[int, BatchCosts], batch: int, what: str = "step") -> float:
    if batch not in costs:
        raise KeyError(f"{what} at batch {batch}")
    return costs[batch].step_s


def _serial(formula: str, step: float) -> Bound:
    return Bound(formula, step, step, 0.0, 0.0)


def _data_parallel(shape: Shape, cal: Calibration, collectives: Collectives | None,
                   grad_bytes: float, units: Sequence[int]) -> Bound | str:
    """ddp and fsdp: every device's step together, and the collectives beside it."""
    opt, n = cal.optimizer_s, shape.devices
    compute = _step(cal.together, shape.device_batch, "together-step")
    ddp = shape.strategy == "ddp"
    if not ddp:  # each rank steps its shard of the parameters
        compute = compute - opt + opt / n
    if n < 2:
        return data_parallel_bound(shape.strategy, compute, 0.0)
    if shape.hook == "powersgd":
        return "no prediction: PowerSGD's compressed traffic is not modelled"
    if collectives is None or not collectives.fits:
        why = collectives.skipped if collectives is not None else "not measured"
        return f"no prediction: no collective micro-benchmark ({why or 'incomplete'})"
    if ddp:
        fit = collectives.fit("all_reduce")
        if fit is None:
            return "no prediction: all_reduce was not measured"
        cap = None if shape.bucket_cap_mb is None else shape.bucket_cap_mb * 2**20
        comm = ddp_comm_s(grad_bytes / 2 if shape.hook in ("fp16", "bf16") else grad_bytes,
                          fit, cap)
        copies = 0.0
    else:
        gather, scatter = collectives.fit("all_gather"), collectives.fit("reduce_scatter")
        if gather is None or scatter is None:
            return "no prediction: all_gather or reduce_scatter was not measured"
        root = int(grad_bytes - sum(units))
        comm = fsdp_comm_s(units, root, gather, scatter)
        copies = step_parts.fsdp_copies_s(units, root, n, cal.copies)
    # On a cpu rig the collectives run on the cores that compute: nothing hides them.
    formula = shape.strategy if shape.overlap else \
        f"{shape.strategy} (collectives not overlapped: they share the cores)"
    return data_parallel_bound(formula, compute, comm, shape.overlap, copies)



def speedup(case_s: float, case_batch: int, single_s: float, workload_batch: int) -> float:
    """A predicted speedup: the case's images per second over single's at its workload's
    batch (strong scaling: single's step over the case's)."""
    return (case_batch / case_s) / (workload_batch / single_s)


def error_pct(predicted_s: float, measured_s: float) -> float:
    """Signed prediction error: 100 x (predicted / measured - 1)."""
    return 100 * (predicted_s / measured_s - 1)




def predict_case(case: Case, rig: Rig, cal: Calibration | None,
                 collectives: Collectives | None = None) -> Bound | str:
    """``predict`` for a sweep's case: its shape, and the parts that need the model built
    on meta tensors (gradient and unit bytes, boundary bytes) or torch's schedules."""
    from bench_lib.workloads.sizes import boundary_bytes, parameter_bytes

    shape = shape_of(case, rig)
    if case.compile or case.sync_bn:
        what = "torch.compile" if case.compile else "SyncBatchNorm"
        return f"no prediction: the calibration runs eager without {what}"
    grads, units = (parameter_bytes(case.model, case.image_size)
                    if case.strategy in ("ddp", "fsdp") else (0, ()))
    parts = None
    if case.strategy in PIPELINED or (case.strategy == "pipeline" and not shape.serial):
        parts = pipeline_parts(case, rig, collectives)
    transfer, assumed = 0.0, ""
    if case.strategy == "mp" and rig.moves_between(0, 1):
        copy, assumed = device_copy_fit(collectives)  # one process: its .to() is a copy
        transfer = 2 * sum(copy.time_s(b) for b in boundary_bytes(
            case.model, case.image_size, case.batch_size, tuple(fixed_cuts(case)),
            case.precision))
    found = predict(shape, cal, collectives, grads, units, parts, transfer)
    if assumed and isinstance(found, Bound):
        found = replace(found, formula=f"{found.formula} ({assumed})")
    return found
