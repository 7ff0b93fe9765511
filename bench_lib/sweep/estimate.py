"""Rough duration estimates of cases, for --dry-run and the progress bar's first ETA.

The figures are deliberately simple: forward+backward seconds per image at 64 px on one
CPU thread (from runs on a 2-core machine), scaled by pixel count and threads. The
progress bar corrects them with the pace it measures as the sweep goes.
"""

from __future__ import annotations

from bench_lib.measure.timing import MIN_STEPS_UNDER_TIME_CAP
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case

CPU_S_PER_IMAGE_64PX = {"resnet50": 0.035, "resnet18": 0.012, "resnet-tiny": 0.004}
# A data-centre GPU trains ResNet50 a few hundred times faster than one CPU thread.
GPU_SPEEDUP_OVER_ONE_THREAD = 300.0
PROCESS_START_S = 6.0  # python + torch import + model build in a fresh process


def step_seconds(case: Case, rig: Rig) -> float:
    """Estimated seconds of one training step of ``case`` on ``rig``."""
    per_image = CPU_S_PER_IMAGE_64PX.get(case.model, 0.035) * (case.image_size / 64) ** 2
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
    timed = min(m.timed_steps * step, max(m.max_time_s, MIN_STEPS_UNDER_TIME_CAP * step))
    launch = PROCESS_START_S + m.warmup_steps * step + timed
    return m.launches * min(launch, m.case_timeout_s)


def format_duration(seconds: float) -> str:
    """``42 s``, ``7.5 min`` or ``2.1 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
