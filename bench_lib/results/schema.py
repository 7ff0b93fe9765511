"""The results schema: every file of a run folder, each column with its unit and meaning.

A run folder ``results/<run_id>/`` holds::

    env.json     environment, rig, profile, command line, schema version
    cases.csv    exactly one row per case, whatever happened to it
    steps.csv    every timed step of every rank
    timeline.csv pipelined cases only: per stage and micro-batch, forward/backward start and end
    samples.csv  the sampler's readings while each case ran

Version 2 (this one) differs from version 1 in the option columns (``partition``,
``channels_last``, ``compile``, ``sync_bn``), which version 1 files may lack. Readers refuse
any other version rather than guess: re-run the sweep to read an old folder.

This module and the rest of ``bench_lib.results`` never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 2
STATUSES = ("ok", "oom", "unsupported", "skipped", "timeout", "error")


class ResultsError(ValueError):
    """A run folder that cannot be read (missing files, another schema version)."""


@dataclass(frozen=True)
class Column:
    """One CSV column: its name (the unit is part of it) and what it means."""

    name: str
    meaning: str
    numeric: bool = False
    """True when the column holds a number or nothing (checked on reading)."""


def _cols(*specs: tuple[str, str] | tuple[str, str, bool]) -> tuple[Column, ...]:
    return tuple(Column(*s) for s in specs)


N = True  # marks numeric columns below

CASES = _cols(
    ("run_id", "the run folder's name: <UTC time>_<host>_<git sha7>"),
    ("case_id", "strategy, model, image size, batch, split and options, e.g. "
                "ddp_resnet50_img128_b32_s-_fp32"),
    ("strategy", "registry name of the strategy"),
    ("model", "workload model name"),
    ("rig", "rig label, e.g. cpu:2x1t or cuda:2"),
    ("world_size", "devices the case uses", N),
    ("threads_per_worker", "intra-op threads of each CPU worker (empty on GPUs)", N),
    ("image_size", "square input size in pixels", N),
    ("batch_size", "global images per training step", N),
    ("split_size", "images per micro-batch (empty where no split applies)", N),
    ("num_microbatches", "micro-batches per step (empty where no split applies)", N),
    ("precision", "fp32 or bf16 (autocast)"),
    ("loss", "ce or mse-onehot"),
    ("status", "ok, oom, unsupported, skipped, timeout or error"),
    ("reason", "why a case did not end ok"),
    ("warmup_steps", "discarded steps before timing", N),
    ("timed_steps", "steps timed (the slowest rank's per step)", N),
    ("step_time_s_median", "median step time, seconds", N),
    ("step_time_s_mean", "mean step time, seconds", N),
    ("step_time_s_stdev", "standard deviation of step times, seconds", N),
    ("step_time_s_p10", "10th percentile of step times, seconds", N),
    ("step_time_s_p90", "90th percentile of step times, seconds", N),
    ("step_time_s_iqr", "interquartile range of step times, seconds", N),
    ("step_time_s_ci_low", "bootstrap 95% CI of the median, low end, seconds", N),
    ("step_time_s_ci_high", "bootstrap 95% CI of the median, high end, seconds", N),
    ("throughput_img_s", "global batch over the median step time, images per second", N),
    ("peak_mem_mib_max", "largest per-device peak memory, MiB", N),
    ("peak_mem_mib_by_device", "peak memory per device, device:MiB;... (allocator peak per "
                               "GPU; peak resident memory per worker process on CPU)"),
    ("case_wall_time_s", "the case's wall time from launch to its row, seconds", N),
    ("note", "how to read this strategy's numbers on this rig"),
    ("stop_reason", "what ended timing: ci_target, time_cap or step_cap"),
    ("util_pct_mean", "mean utilisation over the timed window, % (GPU util or CPU %)", N),
    ("util_pct_mean_by_device", "mean utilisation per device, device:%;..."),
    ("power_w_mean", "mean power over the timed window, watts", N),
    ("energy_j_per_img", "energy per image over the timed window, joules", N),
    ("energy_source", "rapl-host-packages or nvml-gpus"),
    ("peak_mem_reserved_mib_max", "largest CUDA caching-allocator reservation, MiB", N),
    ("peak_mem_reserved_mib_by_device", "CUDA caching-allocator peak per device, device:MiB;..."),
    ("mem_imbalance_ratio", "max over min peak memory across the devices used", N),
    ("flops_per_img", "training FLOPs (forward + backward) per image", N),
    ("achieved_tflop_s", "flops_per_img x throughput, TFLOP/s", N),
    ("mfu_pct", "achieved over the measured attainable peak of the devices used, %", N),
    ("speedup_vs_single", "throughput over the single case of the same workload and run", N),
    ("scaling_efficiency", "speedup_vs_single over world_size", N),
    ("partition", "stage cut used, method:block indices (strategies that cut the model)"),
    ("channels_last", "1 when model and inputs were channels-last", N),
    ("compile", "1 when modules were torch.compiled", N),
    ("sync_bn", "1 when BatchNorm was synchronised across ranks", N),
)
STEPS = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"), ("rank", "process rank", N),
    ("step", "timed step index from 0", N), ("step_time_s", "this rank's step time, seconds", N),
)
# What the sampler reads per device; a metric a source cannot read is left empty.
SAMPLE_METRICS = _cols(
    ("cpu_pct", "worker CPU percent since the last sample (100 = one core)", N),
    ("rss_mib", "worker resident memory, MiB", N),
    ("util_gpu_pct", "NVML GPU utilisation, %", N),
    ("util_mem_pct", "NVML memory-controller utilisation, %", N),
    ("mem_used_mib", "NVML memory used on the GPU, MiB", N),
    ("power_w", "NVML power draw, watts", N),
    ("sm_clock_mhz", "NVML SM clock, MHz", N),
    ("energy_j", "energy counter since the sampler started (NVML) or RAPL total, joules", N),
    ("sm_util_pct", "GPM SM utilisation, % (Hopper and later)", N),
    ("tensor_active_pct", "GPM tensor-core activity, % (Hopper and later)", N),
)
SAMPLES = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"),
    ("time_unix_s", "wall-clock time of the reading, unix seconds", N),
    ("device", "device label (as in peak_mem_mib_by_device), or host"),
) + SAMPLE_METRICS
TIMELINE = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"), ("rank", "process rank", N),
    ("stage", "global stage index", N), ("device", "torch device of the stage"),
    ("microbatch", "micro-batch index", N), ("phase", "fwd or bwd"),
    ("start_s", "start on the case's aligned clock, seconds", N),
    ("end_s", "end on the case's aligned clock, seconds", N),
)


def names(columns: tuple[Column, ...]) -> list[str]:
    """The column names, in file order."""
    return [c.name for c in columns]


CASE_COLUMNS = names(CASES)
STEP_COLUMNS = names(STEPS)
SAMPLE_METRIC_NAMES = tuple(names(SAMPLE_METRICS))
SAMPLE_COLUMNS = names(SAMPLES)
TIMELINE_COLUMNS = names(TIMELINE)
NUMERIC_CASE_COLUMNS = [c.name for c in CASES if c.numeric]
