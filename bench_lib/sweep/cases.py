"""Cases: the unit that is measured, expanded from a profile on a rig before anything runs.

A value that no case of the sweep can use is a usage error (``UsageError``: exit 2,
nothing written). A combination that some cases can use and others cannot becomes a
``skipped`` case with its reason; a strategy the rig cannot run becomes ``unsupported``.

Everything later stages need is resolved here, once, and carried on the ``Case``: the
strategy's world size and process count, the note on reading it on this rig, and the
micro-batching (split size, count, evenness).

What torch would refuse is decided here too, from the rig's size alone (no device is asked),
so that a plan for an N-GPU box made anywhere shows the same skipped rows as the box:
data-parallel strategies need a batch divisible by their world size, and the
torch.distributed.pipelining schedules have their own rules (``schedule_refusal``).

So is what a model cannot do (``workload_refusal``, from the model built on the meta device):
a strategy that cuts it into more stages than it has blocks, channels-last without a
convolution, SyncBatchNorm without a BatchNorm. Those cases are ``unsupported``: no split,
batch or image size would make them run. A model that takes no image size (``toy``, ``mlp``)
runs once per batch size at its own recorded size (``ModelSpec.image_size``), and a model
that trains with neither classifier loss (``toy``) with its own (``ModelSpec.loss_for``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bench_lib import strategies
from bench_lib.rig import Rig
from bench_lib.strategies.base import Microbatching
from bench_lib.strategies.ddp import bf16_hook_refusal
from bench_lib.strategies.ddp_knobs import POWERSGD_GLOO_NOTE, POWERSGD_WARMUP_STEPS, DdpKnobs
from bench_lib.sweep.profile import SCALINGS, Measurement, Profile, UsageError
from bench_lib.workloads import blocks, get_model


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

    Build cases with ``new_case`` (or ``expand``), which resolves the rig-dependent facts.
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
    """A point of ``single``'s batch curve (``batch_curve``): the global batch of the
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
        """Images one device computes at once: a data-parallel rank's share of the batch,
        a pipelining or accumulating case's micro-batch, else the whole batch."""
        if strategies.get(self.strategy).data_parallel:
            return self.batch_size // self.world_size
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
    reason = strat.unsupported_reason(rig) or workload_refusal(strat, case)
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


PIPELINING_STAGES_PER_RANK = {
    "gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2}
"""Stages each rank drives in the torch.distributed.pipelining strategies
(``strategies.schedules``): the model is cut into ranks x this many stages."""


@dataclass(frozen=True)
class ModelFacts:
    """What the planning needs to know of a model's structure."""

    blocks: int
    """How many blocks it has (the most stages it can be cut into)."""
    conv: bool
    """True when it has a 2-d convolution (channels-last memory format applies)."""
    batch_norm: bool
    """True when it has BatchNorm (SyncBatchNorm applies)."""


@functools.cache
def model_facts(model: str) -> ModelFacts:
    """The structure of ``model``, built on the meta device, so no memory is filled and no
    device is touched."""
    with torch.device("meta"):
        net = get_model(model).build(1)
    modules = list(net.modules())
    return ModelFacts(len(blocks(net)), any(isinstance(m, nn.Conv2d) for m in modules),
                      any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules))


def model_blocks(model: str) -> int:
    """How many blocks ``model`` has (the most stages it can be cut into)."""
    return model_facts(model).blocks


def cut_stages(strat: strategies.Strategy, world_size: int) -> int:
    """Stages a strategy that cuts the model cuts it into on ``world_size`` devices (0 for
    strategies that do not cut it)."""
    if not strat.uses_partition:
        return 0
    return world_size * PIPELINING_STAGES_PER_RANK.get(strat.name, 1)


def _too_few_blocks(strategy: str, model: str, ranks: int, stages: int) -> str | None:
    have = model_blocks(model)
    if stages <= have:
        return None
    return (f"{strategy} on {ranks} ranks cuts the model into {stages} stages; {model} has "
            f"only {have} blocks to cut")


def workload_refusal(strat: strategies.Strategy, case: Case) -> str | None:
    """Why ``case``'s model cannot be trained with its strategy and options, or None.

    A strategy that cuts the model needs a block per stage (``toy`` has 2, ``mlp`` 3: no
    4-stage interleaved or ZB-V schedule on 2 ranks); channels-last needs a convolution and
    SyncBatchNorm a BatchNorm to act on, else the case would be a relabelled copy of another.
    """
    facts = model_facts(case.model)
    few = _too_few_blocks(strat.name, case.model, case.world_size,
                          cut_stages(strat, case.world_size))
    if few:
        return few
    if case.channels_last and not facts.conv:
        return (f"{case.model} has no convolution: the channels-last memory format does not "
                "apply")
    if case.sync_bn and not facts.batch_norm:
        return f"{case.model} has no BatchNorm: SyncBatchNorm does not apply"
    return None


def schedule_refusal(strategy: str, model: str, ranks: int, microbatches: int) -> str | None:
    """Why torch.distributed.pipelining would refuse ``strategy``'s schedule over ``ranks``
    ranks and ``microbatches`` micro-batches, or None when it builds.

    The rules are those of torch 2.14's schedule constructors (``tests/test_cuda_planning.py``
    builds torch's own schedules to hold them to it):

    - every schedule: the model is cut into ranks x stages-per-rank stages at block edges,
      so it needs that many blocks;
    - ``Schedule1F1B``: at least as many micro-batches as stages (one stage per rank);
    - ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``: the micro-batches run
      in rounds = max(1, m // ranks), and m must be a multiple of the rounds;
    - ``ScheduleGPipe``, ``ScheduleZBVZeroBubble``: any count (ZB-V pads a short one).
    """
    stages = ranks * PIPELINING_STAGES_PER_RANK[strategy]
    few = _too_few_blocks(strategy, model, ranks, stages)
    if few:
        return few
    if strategy == "1f1b" and microbatches < stages:
        return (f"1f1b needs at least as many micro-batches as stages: {microbatches} "
                f"micro-batches on {stages} stages (torch's Schedule1F1B refuses fewer)")
    if strategy in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            return (f"{strategy} runs {microbatches} micro-batches on {ranks} ranks in "
                    f"max(1, {microbatches} // {ranks}) = {rounds} rounds, and torch needs the "
                    f"count to be a multiple of the rounds")
    return None


def validate(profile: Profile, rig: Rig) -> None:
    """Raise ``UsageError`` for values that no case of the sweep can use.

    A batch size that a data-parallel strategy's world size does not divide is an error only
    when nothing else of the sweep could run: otherwise those cases are ``skipped`` rows (a
    sweep for 7 GPUs runs ``single``, ``mp``... and says why ``ddp`` did not).
    """
    strats = [strategies.get(s) for s in profile.strategies]
    used = profile.used_batch_sizes or profile.batch_sizes
    if any(s.uses_split for s in strats):
        biggest = max(used)
        batches = ", ".join(map(str, used))
        if not profile.split_sizes and not profile.microbatches:
            raise UsageError("pipelined strategies need split sizes or micro-batch counts")
        for split in profile.split_sizes:
            if split > biggest:
                raise UsageError(
                    f"split size {split} is larger than every batch size ({batches}); "
                    f"use a split size <= {biggest}"
                )
        for count in profile.microbatches:
            if count > biggest:
                raise UsageError(
                    f"{count} micro-batches is more than every batch size ({batches}) holds; "
                    f"use a count <= {biggest}"
                )
    runnable = [s for s in strats if not s.unsupported_reason(rig)]
    indivisible = [s for s in runnable if s.data_parallel
                   and not any(b % s.num_devices(rig) == 0 for b in used)]
    if indivisible and len(indivisible) == len(runnable):
        world = indivisible[0].num_devices(rig)
        raise UsageError(
            f"no batch size ({', '.join(map(str, used))}) is divisible by "
            f"{indivisible[0].name}'s world size {world}; use a multiple of {world}"
        )


def expand(profile: Profile, rig: Rig) -> list[Case]:
    """The sweep's cases in run order (``baselines_first``), each marked to run, skipped
    or unsupported."""
    validate(profile, rig)
    cases: list[Case] = []
    grid = ((model, precision, image, batch, name)
            for model, precision in itertools.product(profile.models, profile.precisions)
            for image in profile.image_sizes_for(model)
            for batch in profile.batch_sizes_for(image)
            for name in profile.strategies)
    for model, precision, image, batch, name in grid:
        strat = strategies.get(name)
        micro: list[dict[str, int]] = [{}]
        if strat.uses_split and profile.split_search_for(name):
            micro = [{"split_size": s} for s in split_candidates(batch)]
        elif strat.uses_split:
            micro = ([{"split_size": s} for s in profile.split_sizes]
                     + [{"microbatch_count": m} for m in profile.microbatches])
        knob_sets = profile.ddp_knob_sets if strat.ddp_knobs else (None,)
        for scaling, partition, m, knobs in itertools.product(
                profile.scaling, profile.partitions if strat.uses_partition else (None,),
                micro, knob_sets):
            cases.append(new_case(
                rig, name, model, image, batch, precision, profile.loss, **m,
                partition=partition, channels_last=profile.channels_last,
                compile=profile.compile, sync_bn=profile.sync_bn, ddp=knobs,
                measurement=profile.measurement, scaling=scaling))
    unique: dict[str, Case] = {}
    # A split given twice (as a size and as a count) is one case; so is a one-device
    # strategy under both scalings.
    for case in cases:
        unique.setdefault(case.case_id, case)
    swept = list(unique.values())
    if any(profile.split_search_for(s) for s in profile.strategies):
        swept = searched(swept, profile)
    curve = batch_curve(swept) if profile.batch_curve else []
    return baselines_first(swept + curve_searches(swept, curve))


def split_candidates(batch_size: int) -> tuple[int, ...]:
    """The splits a split search predicts for a workload's batch: every one that divides it
    (equal micro-batches, which every pipelined strategy takes; a split that leaves a short
    last micro-batch computes what the nearest divisor does, plus a remainder), short of the
    whole batch: one micro-batch is no micro-batching (pipeline's would be mp's step,
    accum's single's, which those cases measure)."""
    return tuple(s for s in range(1, batch_size) if batch_size % s == 0)


def search_key(case: Case) -> tuple[object, ...]:
    """What a split search's candidates share: everything but the split."""
    return (case.strategy, case.group_key, case.option_suffix)


def searched(cases: list[Case], profile: Profile) -> list[Case]:
    """The cases with each split candidate's ``SplitSearch`` (``Profile.split_search``)."""
    runnable: dict[tuple[object, ...], int] = {}
    for case in cases:
        if case.micro is not None and case.status is None:
            runnable[search_key(case)] = runnable.get(search_key(case), 0) + 1
    out = []
    for case in cases:
        if case.micro is not None and profile.split_search_for(case.strategy):
            anchor = (profile.split_sizes[0] if profile.split_sizes
                      else math.ceil(case.workload_batch / profile.microbatches[0]))
            case = dataclasses.replace(case, split_search=SplitSearch(
                profile.split_search_for(case.strategy), runnable.get(search_key(case), 0),
                anchor))
        out.append(case)
    return out


def curve_users(point: Case, cases: list[Case]) -> list[Case]:
    """The cases to run that compute ``point``'s batch on one device (its model, image size,
    precision and loss): what a batch-curve point is measured for."""
    return [c for c in cases if c.status is None and c.curve_of is None
            and (c.model, c.image_size, c.precision, c.loss)
            == (point.model, point.image_size, point.precision, point.loss)
            and c.device_batch_size == point.batch_size]


def curve_searches(cases: list[Case], points: list[Case]) -> list[Case]:
    """The batch-curve points, each that only split candidates compute carrying the search
    most likely to measure one of them (the largest share measured)."""
    out = []
    for point in points:
        searches = [c.split_search for c in curve_users(point, cases)]
        if searches and all(searches):
            found = [s for s in searches if s is not None]
            best = max(found, key=lambda s: s.measured / max(s.candidates, 1))
            point = dataclasses.replace(point, split_search=best)
        out.append(point)
    return out


def batch_curve(cases: list[Case]) -> list[Case]:
    """``single`` at every per-device batch (``Case.device_batch_size``) that the cases to
    run compute and no ``single`` case among them measures: the points of each workload's
    batch curve, each a copy of that workload's ``single`` case at the smaller batch
    (``curve_of``: the workload's batch). A workload without a ``single`` case to run has
    none. A batch two workloads share is measured once, for the first."""
    singles = {c.workload_key: c for c in cases if c.strategy == "single" and c.status is None}
    points: dict[tuple[str, int, int, str, str], Case] = {}
    for case in cases:
        parent = singles.get(case.workload_key)
        if case.status is not None or parent is None:
            continue
        point = dataclasses.replace(parent, batch_size=case.device_batch_size,
                                    curve_of=parent.batch_size)
        if point.workload_key not in singles:
            points.setdefault(point.workload_key, point)
    return list(points.values())


def baselines_first(cases: list[Case]) -> list[Case]:
    """The run order: each workload's ``single`` case, then its batch-curve points, then its
    other cases, strong before weak; workloads as first seen (``Case.group_key``), else as given.

    The speedup columns are filled as each row is written, against the ``single`` case of
    the same workload measured earlier in the run: a case run before its baseline gets none.
    """
    first: dict[tuple[str, int, int, str, str], int] = {}
    for i, case in enumerate(cases):
        first.setdefault(case.group_key, i)
    return sorted(cases, key=lambda c: (first[c.group_key], c.strategy != "single",
                                        c.curve_of is not None, c.scaling == "weak"))
