"""Cases: the unit that is measured, each made on a rig with its status decided before
anything runs (``new_case``; the sweep's cases come from ``expansion.expand``).

A combination that some cases can use and others cannot becomes a ``skipped`` case with its
reason; a strategy the rig cannot run, or one that torch or the model would refuse
(``refusals``), becomes ``unsupported`` or ``skipped`` as its rule says. A model that takes
no image size (``toy``, ``mlp``) runs once per batch size at its own recorded size
(``ModelSpec.image_size``), and a model that trains with neither classifier loss (``toy``)
with its own (``ModelSpec.loss_for``).

Everything later stages need is resolved here, once, and carried on the ``Case``: the
strategy's world size and process count, the note on reading it on this rig, and the
micro-batching (split size, count, evenness).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from bench_lib import strategies
from bench_lib.rig import Rig
from bench_lib.strategies.base import Microbatching
from bench_lib.strategies.ddp import bf16_hook_refusal
from bench_lib.strategies.ddp_knobs import POWERSGD_GLOO_NOTE, POWERSGD_WARMUP_STEPS, DdpKnobs
from bench_lib.sweep.profile import SCALINGS, Measurement, UsageError
from bench_lib.sweep.refusals import PIPELINING_STAGES_PER_RANK, schedule_refusal, workload_refusal
from bench_lib.workloads import get_model


@dataclass(frozen=True)
class SplitSearch:
    """A case's part in a split search (``Profile.split_search``; ``sweep.splits`` decides
    which candidates are measured, before the workload's first round)."""

    measured: int
    """Splits measured of its strategy's candidates (K): the predicted best and its nearest
    neighbours in split order."""
    candidates: int
    """Candidates of its search that can run (the splits of its strategy, partition and
    scaling on its workload that are not skipped or unsupported as planned)."""
    anchor: int
    """The split the K measured ones are centred on where there is no prediction (the
    profile's first split size)."""


@dataclass(frozen=True)
class Case:
    """One strategy on one workload with one split size on one rig: the unit that is measured.

    Build cases with ``new_case`` (or ``expansion.expand``), which resolves the rig-dependent facts.
    """

    strategy: str
    model: str
    image_size: int
    batch_size: int
    precision: str
    loss: str
    micro: Microbatching | None = None
    """Micro-batching of strategies that pipeline or accumulate; None for the others."""
    partition: str | None = None
    """Stage cut of strategies that cut the model (``partition.PARTITIONS``); None otherwise."""
    channels_last: bool = False
    """Model and inputs in channels-last memory format."""
    compile: bool = False
    """Modules torch.compiled in place before warm-up."""
    sync_bn: bool = False
    """SyncBatchNorm across ranks (data-parallel strategies only)."""
    ddp: DdpKnobs | None = None
    """DistributedDataParallel's settings (strategies that wrap the model in it, else None)."""
    status: str | None = None
    """None when the case is to run; ``skipped`` or ``unsupported`` when it is not."""
    reason: str = ""
    """Why the case is skipped or unsupported."""
    world_size: int = 1
    """Devices the case uses (the strategy's share of the rig)."""
    process_group: bool = False
    """True: one process per device, in a process group; False: one process drives all."""
    note: str = ""
    """How to read this strategy's numbers on this rig (empty where nothing differs)."""
    measurement: Measurement = field(default_factory=Measurement, compare=False)
    """How the case is measured (the sweep's counts, caps and limits)."""
    curve_of: int | None = None
    """A point of ``single``'s batch curve (``sweep.batch_curve``): the global batch of the
    workload whose curve it measures, this case's batch being one that workload's cases
    compute per device; None for a case of the sweep itself."""
    scaling: str = "strong"
    """``strong``: the workload's batch split over the devices; ``weak``: each device keeps
    the workload's batch, so ``batch_size`` is it times ``world_size`` (``SCALINGS``). A
    case on one device is strong: it scales neither way."""
    split_search: SplitSearch | None = None
    """A candidate split of a split search; on a batch-curve point, the search of the
    candidates that alone compute its batch (it is measured when one of them is); None
    for every other case."""

    @property
    def split_size(self) -> int | None:
        return None if self.micro is None else self.micro.split_size

    @property
    def num_microbatches(self) -> int | None:
        return None if self.micro is None else self.micro.count

    @property
    def processes(self) -> int:
        """Worker processes the case starts."""
        return self.world_size if self.process_group else 1

    @property
    def case_id(self) -> str:
        if self.micro is None:
            split = "_s-"
        elif self.micro.split_size is None:  # a count with no split: only ever skipped
            split = f"_m{self.micro.count}"
        else:
            split = f"_s{self.micro.split_size}"
        return (f"{self.strategy}_{self.model}_img{self.image_size}_b{self.batch_size}"
                f"{split}_{self.precision}{self.option_suffix}")

    @property
    def option_suffix(self) -> str:
        """Case-id suffix of the non-default options (empty for defaults: ids stay stable)."""
        parts = [f"_p{self.partition}" if self.partition not in (None, "tutorial") else "",
                 "_cl" if self.channels_last else "", "_compile" if self.compile else "",
                 "_syncbn" if self.sync_bn else "", self.ddp.id_suffix if self.ddp else "",
                 "_weak" if self.scaling == "weak" else ""]
        return "".join(parts)

    @property
    def workload_batch(self) -> int:
        """The batch of the workload the case belongs to: its own under strong scaling,
        each device's (``batch_size`` over ``world_size``) under weak."""
        return self.batch_size // self.world_size if self.scaling == "weak" else self.batch_size

    @property
    def workload_key(self) -> tuple[str, int, int, str, str]:
        """What a speedup compares across strategies: model, image, the workload's batch
        (``workload_batch``), precision, loss. A weak-scaling case is compared with the
        ``single`` case of its per-device batch, by throughput."""
        return (self.model, self.image_size, self.workload_batch, self.precision, self.loss)

    @property
    def group_key(self) -> tuple[str, int, int, str, str]:
        """The workload a case is measured with, in the same rounds (``run.runner``): its
        own (a weak-scaling case's: its per-device batch's), or for a batch-curve point the
        workload whose curve it is."""
        model, image, batch, precision, loss = self.workload_key
        return (model, image, self.curve_of or batch, precision, loss)

    @property
    def device_batch_size(self) -> int:
        """Images one device computes at once: a data-parallel rank's share of the batch
        or a replica's chunk (``Strategy.shares_batch``; DataParallel's scatter cuts
        ``torch.chunk``'s chunks, the first the largest where the batch does not divide),
        a pipelining or accumulating case's micro-batch, else the whole batch. The one
        figure of it: the row, the batch curve, the waterfall and the time prediction
        (``case_shape.Shape``) all read it from here."""
        if strategies.get(self.strategy).shares_batch:
            return -(-self.batch_size // self.world_size)
        if self.micro is not None and self.micro.split_size is not None:
            return self.micro.split_size
        return self.batch_size

    @property
    def optimizer_share(self) -> float:
        """The share of the model's optimizer step one device runs: its own stage's
        parameters (the strategies that cut the model) or shard (fsdp), else all of them."""
        return (1 / self.world_size if strategies.get(self.strategy).uses_partition
                or self.strategy == "fsdp" else 1.0)

    def spans_nodes(self, rig: Rig) -> bool:
        """Whether its ranks run on more than one node of ``rig`` (a multi-node run's rig
        holds one node's devices): then only node 0's share of them is sampled, and node 0's
        collective micro-benchmark does not price its traffic."""
        return rig.nodes > 1 and self.process_group and self.world_size > rig.num_devices

    def describe(self) -> str:
        split = "" if self.split_size is None else f" split={self.split_size}"
        curve = "" if self.curve_of is None else f" (batch curve of {self.curve_of})"
        weak = " (weak scaling)" if self.scaling == "weak" else ""
        return (f"{self.strategy} {self.model} img={self.image_size} batch={self.batch_size}"
                f"{split}{curve}{weak}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        micro, search = d.get("micro"), d.get("split_search")
        return cls(**(d | {"micro": Microbatching(**micro) if micro else None,
                           "ddp": DdpKnobs(**d["ddp"]) if d.get("ddp") else None,
                           "split_search": SplitSearch(**search) if search else None,
                           "measurement": Measurement(**d["measurement"])}))


def new_case(rig: Rig, strategy: str, model: str, image_size: int, batch_size: int,
             precision: str = "fp32", loss: str = "ce", *, split_size: int | None = None,
             microbatch_count: int | None = None, partition: str | None = None,
             channels_last: bool = False, compile: bool = False, sync_bn: bool = False,
             ddp: DdpKnobs | None = None, measurement: Measurement | None = None,
             scaling: str = "strong") -> Case:
    """A case with its rig facts and micro-batching resolved and its status decided.

    ``batch_size`` is the workload's: under ``weak`` scaling each of the strategy's devices
    gets it (the case's batch is it times the devices, through micro-batches of the same
    size: a count gives the split it gives the workload's batch); a strategy on one device
    is strong either way (the same case).
    ``split_size`` or ``microbatch_count`` (a count larger than the batch has no split: the
    case is skipped) apply to strategies that use a split; others ignore them. ``ddp``
    (default: torch's) applies to strategies that wrap the model in DistributedDataParallel;
    a PowerSGD case warms up at least ``POWERSGD_WARMUP_STEPS`` steps, so that its timed
    steps are compressed ones. The measurement's rig-kind defaults are resolved here
    (``Measurement.for_rig``: the minimum timed seconds).
    """
    strat = strategies.get(strategy)
    spec = get_model(model)
    image_size, loss = spec.image_size(image_size), spec.loss_for(loss)
    if scaling not in SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}; valid: {', '.join(SCALINGS)}")
    world = strat.num_devices(rig)
    scaling = scaling if world > 1 else "strong"
    devices_fed = world if scaling == "weak" else 1  # batches of the workload's size a step
    micro = None
    if strat.uses_split:
        if split_size is None and microbatch_count is not None \
                and microbatch_count <= batch_size:
            split_size = math.ceil(batch_size / microbatch_count)
        if split_size is not None:
            micro = Microbatching.of(batch_size * devices_fed, split_size)
        elif microbatch_count is not None:
            micro = Microbatching(None, microbatch_count * devices_fed, False)
        else:
            raise UsageError(f"{strategy} needs a split size or a micro-batch count")
    batch_size *= devices_fed
    knobs = (ddp or DdpKnobs()) if strat.ddp_knobs else None
    measurement = (measurement or Measurement()).for_rig(rig.kind)  # min_time_s resolved
    knob_notes = [knobs.arithmetic_note] if knobs else []
    if knobs is not None and knobs.comm_hook == "powersgd":
        measurement = dataclasses.replace(
            measurement, warmup_steps=max(measurement.warmup_steps, POWERSGD_WARMUP_STEPS))
        knob_notes += [POWERSGD_GLOO_NOTE] if rig.backend == "gloo" else []
    case = Case(
        strategy, model, image_size, batch_size, precision, loss, micro,
        partition=(partition or "tutorial") if strat.uses_partition else None,
        channels_last=channels_last, compile=compile, sync_bn=sync_bn and strat.data_parallel,
        ddp=knobs, world_size=world, process_group=strat.per_device_processes, scaling=scaling,
        note="; ".join(filter(None, [strat.cpu_note if rig.kind == "cpu" else "",
                                     rig.validation_note, *knob_notes])),
        measurement=measurement,
    )
    problem = _problem(strat, rig, case)
    return dataclasses.replace(case, status=problem[0], reason=problem[1]) if problem else case


def _problem(strat: strategies.Strategy, rig: Rig, case: Case) -> tuple[str, str] | None:
    """(status, reason) when the case cannot run, else None."""
    reason = strat.unsupported_reason(rig) or workload_refusal(
        strat, case.model, case.world_size, case.channels_last, case.sync_bn)
    if reason:
        return "unsupported", reason
    too_small = get_model(case.model).image_size_problem(case.image_size)
    if too_small:  # another model of the sweep takes this size (``Profile`` checks that)
        return "skipped", too_small
    micro, batch = case.micro, case.batch_size
    if micro is not None and micro.split_size is None:
        return "skipped", f"{micro.count} micro-batches do not fit in batch size {batch}"
    if micro is not None and micro.split_size is not None and micro.split_size > batch:
        return "skipped", f"split size {micro.split_size} is larger than batch size {batch}"
    if strat.data_parallel and case.batch_size % case.world_size:
        return "skipped", (f"batch size {case.batch_size} is not divisible by world size "
                           f"{case.world_size}")
    if strat.even_split and micro is not None and not micro.even:
        return "skipped", (f"{strat.name} needs equal micro-batches: batch {case.batch_size} "
                           f"is not a multiple of split {micro.split_size}")
    if strat.name in PIPELINING_STAGES_PER_RANK and micro is not None:
        refusal = schedule_refusal(strat.name, case.model, case.world_size, micro.count)
        if refusal:
            return "skipped", refusal
    if case.sync_bn and rig.kind != "cuda":
        return "unsupported", ("torch.nn.SyncBatchNorm only runs on GPU inputs; "
                               "a cpu rig cannot synchronise BatchNorm")
    if case.ddp is not None and case.ddp.comm_hook == "bf16" and bf16_hook_refusal():
        return "unsupported", str(bf16_hook_refusal())
    if case.compile and strat.compile_unsupported:
        return "unsupported", strat.compile_unsupported
    if case.channels_last and strat.channels_last_unsupported:
        return "unsupported", strat.channels_last_unsupported
    return None
