"""A case's step time, predicted before it runs, from its workload's calibration.

The calibration (``run.calibration``; ``Calibration`` below) is measured once per workload
(model, image size, precision, loss, memory format) before its cases launch, in a few
seconds: on one device alone, and on every device at once with no communication
("together": what data-parallel ranks and pipeline stages do side by side), at each batch
size the sweep's cases compute on a device (``calibration_sizes``), the whole training
step (forward, loss, backward, optimizer step) and, where a pipelining schedule cuts the
model, each block's forward and backward; and the optimizer step alone. The collective
micro-benchmark's fits (``analysis.collective_fits``) price the communication.

The prediction is the bound's arithmetic (``analysis.bound``) fed with calibrated parts
instead of the case's own (B the batch, s the split size, N the devices, O the optimizer
step, T_a(b) and T_t(b) the calibrated step alone and together)::

    single                T_a(B)
    accum, pipeline (cpu) B/s (T_a(s) - O) + O        one process, micro-batches in turn
    mp                    T_a(B) (+ on GPUs each boundary's activation, forward and back)
    ddp                   T_t(B/N) + all-reduce of every gradient byte in DDP's buckets:
                          on a cpu rig added (the collectives run on the cores that compute),
                          on GPUs overlapped (max: ``data_parallel_bound``)
    ddp-1                 T_a(B)
    fsdp                  T_t(B/N) - O + O/N + FSDP2's all-gathers and reduce-scatters
                          (added on a cpu rig, overlapped on GPUs) + its copies into fresh
                          buffers around them (``fsdp_copies_s``, calibrated)
    gpipe, 1f1b,          torch's action lists replayed (``bound.simulate``) with each
    interleaved-*, zbv    stage's forward and backward: the sum of its blocks' together
                          times at s, scaled so that the blocks add up to T_t(s) - O (a
                          block timed alone misses the step's glue: loss, the graph's own
                          overhead); the cut the balanced partition picks from the same
                          block times (``balanced-flops`` and ``tutorial``: their own cut);
                          transfers at the send/recv fit; plus O / N (each rank steps its
                          stages' parameters). Zero-bubble schedules split a backward into
                          its input and weight gradients: half each (said in the formula).

The predicted step is also cut into the step's parts (``predicted_parts``: the
``analysis.step_parts`` list the waterfall measures), which add up to it: where a part's
predicted and measured values disagree is where this model is wrong.

Each prediction is a ``analysis.bound.Bound`` (its parts say where the time goes) or the
reason there is none (``dp``: no model of its scatter and gather; no calibration; a
batch the calibration lacks). ``speedup`` turns two predictions into a speedup the way
``run.speedup_table.SpeedupTable`` turns two measurements into one.

Pure arithmetic: no torch (the schedules' action lists and the cut's boundary bytes are
passed in, or computed on demand by the modules that need torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from bench_lib.analysis import step_parts
from bench_lib.analysis.bound import (
    PIPELINED,
    Action,
    Bound,
    data_parallel_bound,
    ddp_comm_s,
    fsdp_comm_s,
    pipeline_bound,
    placement_of,
)
from bench_lib.analysis.collective_fits import Collectives
from bench_lib.analysis.step_parts import Figures, StepParts

if TYPE_CHECKING:
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case

ZERO_BUBBLE = ("interleaved-zb", "zbv")
"""Schedules that split a backward into input and weight gradients (actions I and W)."""


@dataclass(frozen=True)
class BatchCosts:
    """One batch size's calibrated costs, seconds (medians over repeats)."""

    step_s: float
    """The whole training step: forward, loss, backward, optimizer step."""
    forward_s: tuple[float, ...] = ()
    """Each block's forward (``workloads.blocks``); empty where not measured."""
    backward_s: tuple[float, ...] = ()
    """Each block's backward (input and weight gradients)."""

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "forward_s": list(self.forward_s),
                "backward_s": list(self.backward_s)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchCosts:
        return cls(float(d["step_s"]), tuple(float(v) for v in d.get("forward_s") or ()),
                   tuple(float(v) for v in d.get("backward_s") or ()))


@dataclass(frozen=True)
class Calibration:
    """A workload's calibrated costs (module docstring)."""

    optimizer_s: float
    """The whole model's optimizer step, alone."""
    alone: Mapping[int, BatchCosts] = field(default_factory=dict)
    """Batch -> its costs on one device, the others idle."""
    together: Mapping[int, BatchCosts] = field(default_factory=dict)
    """Batch -> its costs on each device while every device computes (the slowest device's
    step; each block's mean over the devices)."""
    devices: int = 1
    """How many devices computed together."""
    wall_s: float = 0.0
    """How long the calibration took, process start included."""
    copies: Mapping[int, float] = field(default_factory=dict)
    """Bytes -> seconds to copy them into a freshly allocated buffer, every device at once
    (the slowest): the rate of FSDP2's copies around its collectives (``fsdp_copies_s``)."""
    parts_s: Mapping[str, float] = field(default_factory=dict)
    """Where ``wall_s`` went, part by part in the order they ran (``run.calibration.parts_of``:
    ``process_start_s``, ``cuda_context_s``, ``process_group_s``, ``model_build_s``, each
    size's ``alone_B_warmup_s`` and ``alone_B_timed_s``, ``optimizer_passes_s``,
    ``together_B_*``, ``blocks_B_s``, ``copies_s``, ``finish_s``, ``teardown_s``), seconds;
    they add up to ``wall_s``. In calibration.json, ``[name, seconds]`` pairs; none in one
    written before they were recorded."""
    steps: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Each timed size's warm-up and timed passes (``alone_B``, ``together_B``)."""

    def as_dict(self) -> dict[str, Any]:
        return {"optimizer_s": self.optimizer_s, "devices": self.devices,
                "wall_s": round(self.wall_s, 3),
                "alone": {str(b): c.as_dict() for b, c in sorted(self.alone.items())},
                "together": {str(b): c.as_dict() for b, c in sorted(self.together.items())},
                "copies": {str(b): s for b, s in sorted(self.copies.items())},
                # Pairs, not an object: the file's keys are written sorted.
                "parts_s": [[name, s] for name, s in self.parts_s.items()],
                "steps": {k: list(v) for k, v in self.steps.items()}}

    def covers(self, sizes: Sizes) -> bool:
        """Whether this calibration measured every size in ``sizes`` (a calibration taken
        from another run serves only a sweep whose sizes it measured)."""
        blocks = {b for b, c in self.together.items() if c.forward_s}
        return (sizes.alone <= set(self.alone) and sizes.together <= set(self.together)
                and sizes.blocks <= blocks and sizes.copies <= set(self.copies))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        return cls(float(d["optimizer_s"]),
                   {int(b): BatchCosts.from_dict(c) for b, c in (d.get("alone") or {}).items()},
                   {int(b): BatchCosts.from_dict(c)
                    for b, c in (d.get("together") or {}).items()},
                   int(d.get("devices") or 1), float(d.get("wall_s") or 0.0),
                   {int(b): float(v) for b, v in (d.get("copies") or {}).items()},
                   {str(k): float(v) for k, v in d.get("parts_s") or ()},
                   {str(k): (int(v[0]), int(v[1])) for k, v in (d.get("steps") or {}).items()})


@dataclass(frozen=True)
class Sizes:
    """The batch sizes a calibration measures: alone, together, and with block times."""

    alone: frozenset[int] = frozenset()
    together: frozenset[int] = frozenset()
    blocks: frozenset[int] = frozenset()
    copies: frozenset[int] = frozenset()
    """Byte counts whose copy into a fresh buffer is timed (fsdp's: ``FRESH_COPY_BYTES``)."""

    def __or__(self, other: Sizes) -> Sizes:
        return Sizes(self.alone | other.alone, self.together | other.together,
                     self.blocks | other.blocks, self.copies | other.copies)


@dataclass(frozen=True)
class Shape:
    """What the predictor needs of a case (``shape_of`` builds it from a
    ``sweep.cases.Case``): kept small so the arithmetic is tested without torch."""

    strategy: str
    batch: int
    devices: int = 1
    split: int | None = None
    """Micro-batch size (pipelines, accum); None: the whole batch at once."""
    workload_batch: int | None = None
    """Single's batch this case is compared with (weak scaling: the per-device batch)."""
    serial: bool = False
    """One process runs every stage in turn (mp; ``pipeline`` on a cpu rig)."""
    overlap: bool = False
    """Collectives overlap compute (GPUs); on a cpu rig they share the cores: added."""
    hook: str = "none"
    """DDP's communication hook."""
    bucket_cap_mb: float | None = None
    optimizer_share: float = 1.0
    """The share of the optimizer step one device runs (``Case.optimizer_share``)."""

    @property
    def device_batch(self) -> int:
        """Images one device computes at once."""
        if self.strategy in ("ddp", "fsdp", "dp"):
            return self.batch // self.devices
        return self.split or self.batch

    @property
    def microbatches(self) -> int:
        return self.batch // self.split if self.split else 1


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


Cutter = Callable[[Sequence[float], Sequence[int]], Sequence[int]]
"""(per-block costs, each stage's rank) -> the cut's block indices (``partition``'s)."""


@dataclass(frozen=True)
class PipelineParts:
    """What a pipelined prediction needs besides the calibration: torch's action list per
    rank, how the cut is chosen, and the transfer time of one micro-batch at each cut."""

    orders: Sequence[Sequence[Action]]
    cutter: Cutter
    edge_s: Callable[[Sequence[int]], Sequence[float]] = lambda cuts: ()
    """The cut -> each boundary's transfer time for one micro-batch (none: free)."""


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
            return _pipelined(shape, cal, pipeline)
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


def stage_passes(costs: BatchCosts, cuts: Sequence[int], optimizer_s: float,
                 zero_bubble: bool = False) -> dict[tuple[int, str] | tuple[int, str, int], float]:
    """Each stage's forward and backward (and, ``zero_bubble``, weight gradient) from its
    blocks' times, scaled so that every block adds up to the step less the optimizer's."""
    blocks = sum(costs.forward_s) + sum(costs.backward_s)
    glue = (costs.step_s - optimizer_s) / blocks if blocks > 0 else 1.0
    bounds = [0, *cuts, len(costs.forward_s)]
    times: dict[tuple[int, str] | tuple[int, str, int], float] = {}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        f, bwd = sum(costs.forward_s[a:b]) * glue, sum(costs.backward_s[a:b]) * glue
        times[s, "fwd"] = f
        if zero_bubble:
            times[s, "bwd"] = times[s, "wgt"] = bwd / 2
        else:
            times[s, "bwd"] = bwd
    return times


def _pipelined(shape: Shape, cal: Calibration, parts: PipelineParts) -> Bound | str:
    """A pipelining schedule replayed with calibrated stage passes; ``pipeline`` on GPUs
    as GPipe's order."""
    b = shape.device_batch
    costs = cal.together.get(b)
    if costs is None or not costs.forward_s:
        raise KeyError(f"block times at batch {b}")
    cuts = list(parts.cutter(block_costs(costs), stage_ranks(parts.orders)))
    zero_bubble = shape.strategy in ZERO_BUBBLE
    times = stage_passes(costs, cuts, cal.optimizer_s, zero_bubble)
    found = pipeline_bound(shape.strategy, parts.orders, times, parts.edge_s(cuts),
                           cal.optimizer_s / shape.devices)
    if zero_bubble:
        found = replace(found, formula=f"{found.formula} (backward split half input, half "
                                       "weight gradient)")
    return replace(found, formula=f"{found.formula} cut {','.join(map(str, cuts))}")


def block_costs(costs: BatchCosts) -> list[float]:
    """Each block's forward + backward: what the balanced partition weighs."""
    return [f + b for f, b in zip(costs.forward_s, costs.backward_s)]


def stage_ranks(orders: Sequence[Sequence[Action]]) -> list[int]:
    """The rank of each stage, in stage order."""
    placement = placement_of(orders)
    return [placement[s] for s in sorted(placement)]


def speedup(case_s: float, case_batch: int, single_s: float, workload_batch: int) -> float:
    """A predicted speedup: the case's images per second over single's at its workload's
    batch (strong scaling: single's step over the case's)."""
    return (case_batch / case_s) / (workload_batch / single_s)


def error_pct(predicted_s: float, measured_s: float) -> float:
    """Signed prediction error: 100 x (predicted / measured - 1)."""
    return 100 * (predicted_s / measured_s - 1)


def shape_of(case: Case, rig: Rig) -> Shape:
    """The predictor's view of ``case`` on ``rig``."""
    knobs = case.ddp
    return Shape(case.strategy, case.batch_size, case.world_size, case.split_size,
                 case.workload_batch,
                 serial=case.strategy == "mp" or (case.strategy == "pipeline"
                                                 and rig.kind == "cpu"),
                 overlap=rig.kind == "cuda",
                 hook=knobs.comm_hook if knobs is not None else "none",
                 bucket_cap_mb=knobs.bucket_cap_mb if knobs is not None else None,
                 optimizer_share=case.optimizer_share)


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
    transfer = 0.0
    if case.strategy == "mp" and rig.moves_between(0, 1) and collectives is not None:
        send = collectives.fit("send_recv")
        cut = tuple(_fixed_cuts(case))
        if send is not None:
            transfer = 2 * sum(send.time_s(b) for b in boundary_bytes(
                case.model, case.image_size, case.batch_size, cut))
    return predict(shape, cal, collectives, grads, units, parts, transfer)


def pipeline_parts(case: Case, rig: Rig, collectives: Collectives | None) -> PipelineParts:
    """torch's action lists for ``case``'s schedule (``pipeline`` on GPUs: GPipe's), the
    cut its partition picks from block costs (``balanced``; ``balanced-flops`` and
    ``tutorial``: the cut they choose without timing), and the send/recv fit's transfer
    time of one micro-batch at each boundary."""
    from bench_lib.strategies.partition import min_max_cuts, min_max_rank_cuts
    from bench_lib.sweep.predict_memory import schedule_actions
    from bench_lib.workloads.sizes import boundary_bytes

    name = "gpipe" if case.strategy == "pipeline" else case.strategy
    orders = schedule_actions(name, case.world_size, case.num_microbatches or 1)
    method, _, given = (case.partition or "tutorial").partition(":")

    def cutter(costs: Sequence[float], stages: Sequence[int]) -> Sequence[int]:
        if method != "balanced" or given:
            return _fixed_cuts(case)
        if len(set(stages)) < len(stages):
            return min_max_rank_cuts(list(costs), stages)
        return min_max_cuts(list(costs), len(stages))

    send = collectives.fit("send_recv") if collectives is not None else None
    micro = case.split_size or case.batch_size
    # ``pipeline``, one process: a boundary between two slots of one GPU moves nothing.
    moves = case.process_group or rig.moves_between(0, 1)

    def edges(cuts: Sequence[int]) -> Sequence[float]:
        if send is None:
            return ()
        return [send.time_s(b) if moves else 0.0
                for b in boundary_bytes(case.model, case.image_size, micro, tuple(cuts))]

    return PipelineParts(orders, cutter, edges)


def _fixed_cuts(case: Case) -> Sequence[int]:
    """The cut a case runs where no block is timed to choose it: a given cut
    (``balanced:6,12``), ``tutorial``'s or ``balanced-flops``' (``sweep.predict_memory``'s choice,
    the one the memory prediction uses; for ``balanced``, too, where only that is known)."""
    from bench_lib.sweep.predict_memory import cut_label, num_stages
    from bench_lib.workloads import Workload

    w = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                 precision=case.precision)
    label = cut_label(case, w, num_stages(case), "")
    return tuple(int(c) for c in label.partition(":")[2].split(",") if c)


def calibrated_cut(case: Case, rig: Rig, cal: Calibration | None) -> str:
    """The ``balanced`` cut of a pipelined case chosen from the calibration's block times
    at its micro-batch (every device computing, as the case's own first-launch profiling
    measures them), as a ``Partition.label`` for the case to run (``CaseSpec.cut``): its
    first launch then profiles nothing. Empty where the calibration has no such blocks, or
    the case cuts no model, or not by ``balanced``."""
    method, _, given = (case.partition or "").partition(":")
    if cal is None or method != "balanced" or given:
        return ""
    if case.strategy not in PIPELINED:
        return ""
    costs = cal.together.get(case.split_size or case.batch_size)
    if costs is None or not costs.forward_s:
        return ""
    parts = pipeline_parts(case, rig, None)
    cuts = parts.cutter(block_costs(costs), stage_ranks(parts.orders))
    return f"balanced:{','.join(map(str, cuts))}"
