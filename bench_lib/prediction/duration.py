"""Estimates before a run: its duration, part by part (``--dry-run``, the progress bar's
first ETA, the run's own record beside its wall time), and the memory one device needs to
train a whole batch (for choosing a profile's batch sizes).

A run's duration is the sum of terms, each measured (``prediction.fixed_costs``: per rig kind,
with its source), beside the steps' own seconds:

    per run       set-up (pre-flight on cuda) + rig figures + collectives (where they apply)
    per workload  its calibration (``predict_time``): seconds per batch size it times
    per launch    start-up (process, CUDA context, model build, NCCL's group, teardown) +
                  warm-up (the first step, then steady ones) + timed steps + DDP's
                  compute-only steps; the first launch's diagnostics (the traced step)

A step's seconds are simple: forward+backward seconds per image at 64 px on one CPU
thread, scaled by pixel count and threads (a model that takes no image size, ``toy`` and
``mlp``, has a figure per sample, not scaled); on a GPU, the H100's per-pixel pace with the
floor a small batch cannot go under. A case that will not run costs nothing; a split-search
candidate costs its chance of being measured (``splits.measured_share``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from bench_lib import strategies
from bench_lib.analysis.bound import MOVING_ACROSS_GPUS, PRICED_WITH_COLLECTIVES
from bench_lib.measure.timing import COMPUTE_ONLY_STEPS, MIN_STEPS_UNDER_TIME_CAP
from bench_lib.prediction.fixed_costs import BY_KIND, SETTLED_AFTER_STEPS, FixedCosts
from bench_lib.rig import Rig
from bench_lib.sweep import splits
from bench_lib.sweep.cases import Case
from bench_lib.sweep.refusals import model_facts
from bench_lib.workloads import get_model

CPU_S_PER_IMAGE_64PX = {"resnet50": 0.035, "resnet18": 0.012, "resnet-tiny": 0.004,
                        "resnet101": 0.067, "resnet152": 0.098, "toy": 2e-6, "mlp": 2e-5}
"""Seconds per image at 64 px (per sample for fixed-shape models) on one CPU thread. The
ResNet101/152 figures scale ResNet50's by their FLOPs (7.8 and 11.5 against 4.1 GFLOP at
224 px); toy's and mlp's are a few microseconds of tiny matrix products."""
CPU_SMALL_BATCH = 6.4
"""How a CPU's per-image seconds grow at small batches: as 1 + this / batch, the figures
above being batch 16's (the AMD EPYC baseline's batch curve at 64 px, one thread: 0.067,
0.062, 0.034 and 0.031 s per image at batch 4, 8, 16 and 32)."""
GPU_S_PER_IMAGE_64PX = 0.0678 / 120 / (224 / 64) ** 2
"""A GPU's seconds per ResNet50 image at 64 px: the H100's 224 px batch 120 fp32 step
(0.0678 s, tests/data/h100-2026-11-26) over its images and pixels (another model: scaled
by its CPU figure against ResNet50's)."""
GPU_STEP_FLOOR_S = 0.020
"""The least a ResNet50 training step (or a micro-batch's passes) takes on the H100 however
few its images: batch 8 at 64 px and batch 20 at 224 px both took 0.020 s (kernel launches,
not arithmetic, set the pace)."""


def step_seconds(case: Case, rig: Rig) -> float:
    """Estimated seconds of one training step of ``case`` on ``rig``."""
    per_image = CPU_S_PER_IMAGE_64PX.get(case.model, 0.035)
    if get_model(case.model).sized:
        per_image *= (case.image_size / 64) ** 2
    if rig.kind != "cuda":
        return _cpu_step(case, per_image / rig.threads_per_worker)
    per_image *= GPU_S_PER_IMAGE_64PX / CPU_S_PER_IMAGE_64PX["resnet50"]
    passes = case.num_microbatches or 1  # each micro-batch pays the floor
    return passes * max(GPU_STEP_FLOOR_S, per_image * case.batch_size / passes)


def _cpu_step(case: Case, per_image: float) -> float:
    """A step on a cpu rig: the busiest worker's images at its batch's pace (a micro-batch
    pipelined over R ranks: m + R - 1 passes of a stage's share)."""
    batch = case.device_batch_size
    pass_s = per_image * batch * (1 + CPU_SMALL_BATCH / batch) / (1 + CPU_SMALL_BATCH / 16)
    if case.micro is None or strategies.get(case.strategy).data_parallel:
        return pass_s
    ranks = case.world_size if case.process_group else 1
    return pass_s * (case.micro.count + ranks - 1) / ranks


@dataclass(frozen=True)
class Estimate:
    """Seconds of a case's launches (or a run's), by kind: start-up, warm-up, timed."""

    startup_s: float = 0.0
    """Process start, CUDA context, model build, NCCL's group, teardown, and the first
    launch's diagnostics after its timed steps."""
    warmup_s: float = 0.0
    timed_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.startup_s + self.warmup_s + self.timed_s

    def __add__(self, other: Estimate) -> Estimate:
        return Estimate(self.startup_s + other.startup_s, self.warmup_s + other.warmup_s,
                        self.timed_s + other.timed_s)

    def scaled(self, share: float) -> Estimate:
        return Estimate(self.startup_s * share, self.warmup_s * share, self.timed_s * share)


def case_estimate(case: Case, rig: Rig, terms: FixedCosts | None = None) -> Estimate:
    """Estimated seconds of every launch of ``case`` (nothing when it won't run), by kind,
    times its ``splits.measured_share``; ``terms``: the rig kind's constants by default."""
    if case.status is not None:
        return Estimate()
    terms = terms or BY_KIND[rig.kind]
    m, step = case.measurement, step_seconds(case, rig)
    # The step cap, or the minimum where it needs more; the time cap over both.
    timed = min(max(m.timed_steps * step, m.min_time_s or 0.0),
                max(m.max_time_s, MIN_STEPS_UNDER_TIME_CAP * step))
    startup = terms.launch_s
    if rig.kind == "cuda" and case.process_group and rig.backend == "nccl":
        startup += terms.process_group_s
    first = terms.first_step_s
    if rig.kind == "cuda" and not model_facts(case.model).conv:
        first = 0.0  # no convolution for cuDNN to autotune (and no evidence of the rest)
    warmup = first + steady_warmup_steps(m.warmup_steps, m.launches) / m.launches * step
    launch = Estimate(startup, warmup, timed)
    if launch.total_s > m.case_timeout_s:  # killed at the timeout
        launch = launch.scaled(m.case_timeout_s / launch.total_s)
    diagnostics = Estimate(startup_s=diagnostic_steps(case, m.launches) * step)
    return (launch.scaled(m.launches) + diagnostics).scaled(splits.measured_share(case))


def steady_warmup_steps(minimum: int, launches: int) -> int:
    """Warm-up steps beyond each launch's first, over a case's launches: the first launch
    settles after ``SETTLED_AFTER_STEPS`` (at least ``minimum``), later ones run that less
    2, never under ``minimum`` (``protocol.reused_warmup``). None without a warm-up."""
    if minimum == 0:
        return 0
    first = max(minimum, SETTLED_AFTER_STEPS)
    return first - 1 + (launches - 1) * (max(minimum, first - 2) - 1)


def diagnostic_steps(case: Case, launches: int = 1) -> int:
    """Steps a case's ``launches`` run after their timed ones: DDP's compute-only steps in
    every launch, the traced step of a case with stages in the first; none where its
    measurement runs no diagnostics."""
    strat = strategies.get(case.strategy)
    if not case.measurement.diagnostics:
        return 0
    compute_only = COMPUTE_ONLY_STEPS * launches if strat.ddp_knobs else 0
    return compute_only + (1 if strat.uses_partition else 0)


def case_seconds(case: Case, rig: Rig, terms: FixedCosts | None = None) -> float:
    """Estimated wall time of a case, all its launches, each from process start to its end
    (0 when it won't run)."""
    return case_estimate(case, rig, terms).total_s


@dataclass(frozen=True)
class RunEstimate:
    """A run's estimated duration, part by part (module docstring)."""

    launches: Estimate
    """Every case's launches (``case_estimate``), summed."""
    launch_count: float
    """Launches expected (a split-search candidate's counted by its ``measured_share``)."""
    setup_s: float
    """Per run: planning, the fork server, pre-flight on cuda, writing rows."""
    rig_figures_s: float
    collectives_s: float
    calibration_s: float
    workloads: int
    """Workloads calibrated."""
    sizes: int
    """Batch sizes their calibrations time, all together."""
    terms: FixedCosts

    @property
    def per_run_s(self) -> float:
        return self.setup_s + self.rig_figures_s + self.collectives_s

    @property
    def total_s(self) -> float:
        return self.per_run_s + self.calibration_s + self.launches.total_s

    @property
    def duty_cycle(self) -> float:
        """Timed seconds over the whole estimate."""
        return self.launches.timed_s / self.total_s if self.total_s > 0 else 0.0

    def parts_line(self) -> str:
        """``estimated duty cycle 61%: per run 10 s (set-up 2, rig figures 3, collectives
        4); calibration 23 s (1 workload, 8 sizes); 114 launches 11.8 min (start-up 2.1
        min, warm-up 2.5 min, timed 7.2 min)``"""
        f, lo = format_duration, self.launches
        return (f"estimated duty cycle {self.duty_cycle:.0%}: per run {f(self.per_run_s)} "
                f"(set-up {self.setup_s:.0f}, rig figures {self.rig_figures_s:.0f}, "
                f"collectives {self.collectives_s:.0f}); calibration {f(self.calibration_s)}"
                f" ({self.workloads} workloads, {self.sizes} sizes); {self.launch_count:.0f} "
                f"launches {f(lo.total_s)} (start-up {f(lo.startup_s)}, warm-up "
                f"{f(lo.warmup_s)}, timed {f(lo.timed_s)})")


def run_estimate(cases: Iterable[Case], rig: Rig, rig_figures: bool = True,
                 predict_time: bool = False, terms: FixedCosts | None = None) -> RunEstimate:
    """The run's estimate: its cases' launches and the per-run and per-workload terms that
    apply (rig figures where ``rig_figures``, calibrations where ``predict_time``, the
    collectives where a case is priced with them), from ``terms`` (the rig kind's
    constants by default; ``fixed_costs.this_box``: this machine's where a run measured
    them)."""
    runnable = [c for c in cases if c.status is None]
    terms = terms or BY_KIND[rig.kind]
    launches = sum((case_estimate(c, rig, terms) for c in runnable), Estimate())
    count = sum(c.measurement.launches * splits.measured_share(c) for c in runnable)
    sizes = calibrated_sizes(runnable, rig) if predict_time else {}
    return RunEstimate(
        launches, count, terms.run_s, terms.rig_figures_s if rig_figures else 0.0,
        terms.collectives_s if needs_collectives(runnable, rig) else 0.0,
        terms.calibration_size_s * sum(sizes.values()), len(sizes), sum(sizes.values()),
        terms)


def needs_collectives(cases: Iterable[Case], rig: Rig) -> bool:
    """Whether the run measures the collectives: a case to run on 2 devices or more is priced
    with them (``collectives.largest_message``'s rule)."""
    moves = rig.num_devices > 1 and rig.moves_between(0, 1)
    priced = PRICED_WITH_COLLECTIVES | (MOVING_ACROSS_GPUS if moves else set())
    return any(c.status is None and c.world_size > 1 and c.strategy in priced for c in cases)


def calibrated_sizes(cases: Iterable[Case], rig: Rig) -> dict[tuple[object, ...], int]:
    """Batch sizes each workload's calibration times (``prediction.calibration.sizes_for``): alone,
    together and with block times, counted."""
    from bench_lib.prediction.calibration_data import Sizes
    from bench_lib.prediction.case_shape import shape_of
    from bench_lib.prediction.step_time import calibration_sizes

    found: dict[tuple[object, ...], Sizes] = {}
    for case in cases:
        key = (case.model, case.image_size, case.precision, case.loss, case.channels_last,
               case.measurement.math_mode)
        found[key] = found.get(key, Sizes()) | calibration_sizes(shape_of(case, rig))
    return {k: len(s.alone) + len(s.together) + len(s.blocks) for k, s in found.items()}


def format_duration(seconds: float) -> str:
    """``42 s``, ``7.5 min`` or ``2.1 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# Memory of training a whole batch on one device (``single``), fp32.
SAVED_MIB_PER_IMAGE_224PX = {"resnet50": 81.9, "resnet18": 21.2, "resnet-tiny": 15.4,
                             "resnet101": 121.8, "resnet152": 170.4}
"""What autograd keeps for backward per 224 px image, fp32 (bf16 autocast keeps less): the
inputs of every convolution, BatchNorm and linear layer, the ReLU outputs, max-pool
indices. Counted, not guessed: ``tests/test_cuda_planning.py`` sums torch's saved tensors
(``torch.autograd.graph.saved_tensors_hooks``) for one 224 px image and holds these to 2%.
The activations scale with the pixel count (exactly at multiples of 32 px); BatchNorm's
per-channel statistics and the head, well under 1% at 224 px, do not."""
PEAK_OVER_SAVED = 1.35
"""The allocator's peak over the saved activations: backward's activation gradients, cuDNN
workspaces and allocator rounding come on top. From issue #14's single case at batch 120 and
512 px, reported at about 67 GiB against 50 GiB of saved activations and weights (1.33)."""
WEIGHT_COPIES = 2
"""Copies of the weights a step holds: the weights and their gradients (plain SGD keeps no
optimizer state)."""
CARD_RESERVE_MIB = 2048.0
"""What a card's memory loses before our tensors: the CUDA context, cuDNN and cuBLAS
handles and the allocator's fragmentation (a 24 GiB card leaves about 22 GiB to a case)."""


@functools.cache
def parameters(model: str) -> int:
    """Parameter count of ``model`` (built on the meta device: no memory, no device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in get_model(model).build(1000).parameters())


def single_device_mib(model: str, image_size: int, batch_size: int) -> float:
    """Estimated peak MiB of one device training ``batch_size`` images at ``image_size`` px
    in fp32 (``single``; a strategy that spreads the batch or the model needs less per
    device): the saved activations times ``PEAK_OVER_SAVED``, plus weights and gradients.
    For the ResNets of ``SAVED_MIB_PER_IMAGE_224PX`` (``toy`` and ``mlp`` keep well under a
    MiB per sample: no card question arises)."""
    per_image = SAVED_MIB_PER_IMAGE_224PX[model] * (image_size / 224) ** 2 * PEAK_OVER_SAVED
    return batch_size * per_image + WEIGHT_COPIES * parameters(model) * 4 / 2**20


def fits_card(model: str, image_size: int, batch_size: int, card_gib: float) -> bool:
    """True when ``single`` is estimated to fit a card of ``card_gib`` GiB."""
    return single_device_mib(model, image_size, batch_size) <= card_gib * 1024 - CARD_RESERVE_MIB
