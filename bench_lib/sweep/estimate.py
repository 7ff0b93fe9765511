"""Rough estimates of cases: duration, for --dry-run and the progress bar's first ETA, and
the memory one device needs to train a whole batch, for choosing a profile's batch sizes.

The duration figures are deliberately simple: forward+backward seconds per image at 64 px on
one CPU thread (from runs on a 2-core machine), scaled by pixel count and threads; a model
that takes no image size (``toy``, ``mlp``) has a figure per sample, not scaled; each launch
adds its start (``start_seconds``: on GPUs CUDA's, NCCL's and cuDNN's too). The progress
bar corrects them with the pace it measures as the sweep goes.
"""

from __future__ import annotations

import functools

import torch

from bench_lib.measure.timing import MIN_STEPS_UNDER_TIME_CAP
from bench_lib.rig import CUDNN_BENCHMARK, Rig
from bench_lib.sweep.cases import Case, model_facts
from bench_lib.workloads import get_model

CPU_S_PER_IMAGE_64PX = {"resnet50": 0.035, "resnet18": 0.012, "resnet-tiny": 0.004,
                        "resnet101": 0.067, "resnet152": 0.098, "toy": 2e-6, "mlp": 2e-5}
"""Seconds per image at 64 px (per sample for fixed-shape models) on one CPU thread. The
ResNet101/152 figures scale ResNet50's by their FLOPs (7.8 and 11.5 against 4.1 GFLOP at
224 px); toy's and mlp's are a few microseconds of tiny matrix products."""
# A data-centre GPU trains ResNet50 a few hundred times faster than one CPU thread.
GPU_SPEEDUP_OVER_ONE_THREAD = 300.0
PROCESS_START_S = 1.0
"""A launch's cost beyond its steps: its ranks forked by the run's fork server, model build,
process group, teardown (default-cpu on 2 cores, AMD EPYC: 75 s over 72 launches; a fresh
interpreter's imports alone are ~2.3 s)."""
# What a launch on a cuda rig pays beyond PROCESS_START_S before its steps are steady: each
# an estimate, from commonly reported figures (none measured here: no GPU has been lent to
# this project), taken at the high end so that a GPU sweep's duration is not understated.
CUDA_START_S = 1.0
"""CUDA's start in every rank (driver, context, the first kernels loaded; the ranks start at
once, so once per launch): commonly 0.3-1 s with CUDA 12/13's lazy module loading, more on
a GPU without persistence mode (``nvidia-smi -pm 1``), whose driver state is set up anew."""
NCCL_START_S = 3.0
"""A multi-process case's NCCL communicator (topology detection, connections and buffers set
up, mostly on the first collective): commonly 1-3 s for a few GPUs of one node. gloo (the
slots of ``--gpu-slots``) is counted in PROCESS_START_S, as on a cpu rig."""
CUDNN_AUTOTUNE_S = 3.0
"""cuDNN autotuning (``rig.CUDNN_BENCHMARK``): on first use of each convolution shape it
times the candidate algorithms of the forward and both backward passes (ResNet50: about 20
shapes per input size, more with a pipeline's micro-batches), in the first warm-up step:
commonly 1-5 s."""


def start_seconds(case: Case, rig: Rig) -> float:
    """Estimated seconds of one launch of ``case`` beyond its steps: the processes' start
    (``PROCESS_START_S``), and on a cuda rig CUDA's, NCCL's and cuDNN's (each where it
    applies)."""
    seconds = PROCESS_START_S
    if rig.kind == "cuda":
        seconds += CUDA_START_S
        if case.process_group and rig.backend == "nccl":
            seconds += NCCL_START_S
        if CUDNN_BENCHMARK and model_facts(case.model).conv:
            seconds += CUDNN_AUTOTUNE_S
    return seconds


def step_seconds(case: Case, rig: Rig) -> float:
    """Estimated seconds of one training step of ``case`` on ``rig``."""
    per_image = CPU_S_PER_IMAGE_64PX.get(case.model, 0.035)
    if get_model(case.model).sized:
        per_image *= (case.image_size / 64) ** 2
    if rig.kind == "cuda":
        per_image /= GPU_SPEEDUP_OVER_ONE_THREAD
    else:
        per_image /= rig.threads_per_worker
    return per_image * case.batch_size


def case_seconds(case: Case, rig: Rig) -> float:
    """Estimated wall time of a case, all its launches, each from process start to its end
    (0 when it won't run)."""
    if case.status is not None:
        return 0.0
    step = step_seconds(case, rig)
    m = case.measurement
    # The step cap, or the minimum where it needs more; the time cap over both.
    timed = min(max(m.timed_steps * step, m.min_time_s or 0.0),
                max(m.max_time_s, MIN_STEPS_UNDER_TIME_CAP * step))
    launch = start_seconds(case, rig) + m.warmup_steps * step + timed
    return m.launches * min(launch, m.case_timeout_s)


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
