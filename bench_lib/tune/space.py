"""The space ``tune`` searches: every case of ONE workload that a profile (with the CLI's
overrides) expands to, and the command that reproduces one of them with ``run``.

The candidates are ``sweep.expansion.expand``'s cases of the workload, so every dimension a
sweep has is a dimension of the space, with the same validation and the same case ids:
strategies x split sizes or micro-batch counts x partitions, and the DDP knobs
(``--ddp-comm-hooks``, ``--ddp-bucket-caps-mib``... on the strategies that wrap the model in
DDP). A new dimension added to ``expand`` (a ``new_case`` keyword and a profile key) joins
the space without a change here; only ``reproduce_command`` must learn its flag.

``single`` is always in the space (added where the profile leaves it out): it is the
reference of every speedup. Skipped and unsupported cases are kept, to be recorded with
their reason, and never launched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Measurement, Profile, UsageError

RACE_WARMUP_STEPS = 1
"""A race launch's warm-up minimum (the warm-up rule still extends it, to 2 at least and on
while steps get faster: ``measure.timing.WarmupRule``)."""
RACE_TIMED_STEPS = 2
"""A race launch's timed steps. A launch's fixed cost (process start, imports, process
group: about 5 s of a ResNet50 launch on 2 cores) dominates it; the steps saved here pay
for the later rungs, which measure again the candidates that matter."""
RACE_MAX_TIME_S = 2.0
"""A race launch's time cap on timed steps."""


@dataclass(frozen=True)
class Space:
    """The cases of one workload, ``single`` first (``expand``'s run order)."""

    profile: Profile
    """The profile the space was expanded from (``single`` added where it lacked it)."""
    cases: tuple[Case, ...]
    """Every case of the workload: those to run and those skipped or unsupported."""

    @property
    def candidates(self) -> list[Case]:
        """The cases to measure (status None)."""
        return [c for c in self.cases if c.status is None]

    @property
    def not_run(self) -> list[Case]:
        """Skipped and unsupported cases, with their reasons."""
        return [c for c in self.cases if c.status is not None]

    @property
    def reference(self) -> int | None:
        """The index of ``single`` among ``candidates`` (None where it cannot run)."""
        return next((i for i, c in enumerate(self.candidates) if c.strategy == "single"), None)

    def describe(self) -> str:
        model, image, batch, precision, loss = self.cases[0].workload_key
        return f"{model} img={image} batch={batch} {precision} loss={loss}"


def build_space(profile: Profile, rig: Rig) -> Space:
    """The space of the one workload ``profile`` describes on ``rig`` (``UsageError`` when
    it describes several, or when no case of it can run)."""
    if "single" not in profile.strategies:
        profile = profile.override(strategies=("single", *profile.strategies))
    # A race compares configurations of one workload at its batch: single's batch curve is
    # not one, nor a weak-scaling case (more images a step).
    cases = expand(profile.override(batch_curve=False, scaling=("strong",)), rig)
    keys = list(dict.fromkeys(c.workload_key for c in cases))
    if len(keys) > 1:
        raise UsageError("tune searches one workload; this sweep has "
                         f"{len(keys)}: {_varying(keys)}")
    if not any(c.status is None for c in cases):
        reasons = "; ".join(f"{c.strategy}: {c.reason}" for c in cases[:4])
        raise UsageError(f"nothing to tune: every case is skipped or unsupported ({reasons})")
    return Space(profile, tuple(cases))


def _varying(keys: Sequence[tuple[str, int, int, str, str]]) -> str:
    """Which workload flags take several values, and the values: the user picks one."""
    flags = ("--models", "--image-sizes", "--batch-sizes", "--precisions", "--loss")
    parts = []
    for pos, flag in enumerate(flags):
        values = list(dict.fromkeys(str(k[pos]) for k in keys))
        if len(values) > 1:
            parts.append(f"give {flag} one of {', '.join(values)}")
    return "; ".join(parts)


def race_launch(case: Case, profile: Measurement) -> Case:
    """``case`` as every launch of the race measures it: short (``RACE_*``), keeping any
    warm-up its strategy adds beyond the profile's (PowerSGD's). No minimum timed duration:
    a race compares step times, not the sampler's columns that the minimum is for."""
    m = case.measurement
    warmup = m.warmup_steps - profile.warmup_steps + min(profile.warmup_steps,
                                                         RACE_WARMUP_STEPS)
    return dataclasses.replace(case, measurement=dataclasses.replace(
        m, warmup_steps=warmup, timed_steps=min(m.timed_steps, RACE_TIMED_STEPS),
        max_time_s=min(m.max_time_s, RACE_MAX_TIME_S), min_time_s=0.0, launches=1))


def rig_flags(rig: Rig) -> list[str]:
    """The ``run`` flags that rebuild ``rig``."""
    flags = ["--rig", rig.kind, "--devices", str(rig.num_devices)]
    if rig.kind == "cpu":
        flags += ["--threads-per-worker", str(rig.threads_per_worker)]
    if rig.gpu_slots > 1:
        flags += ["--gpu-slots", str(rig.gpu_slots)]
    return flags


def reproduce_command(case: Case, profile_arg: str, profile: Profile, rig: Rig,
                      extra: Sequence[str] = ()) -> list[str]:
    """``python -m bench_lib run ...`` that measures ``case`` (with ``single`` beside it,
    for its speedup) in a sweep of the same profile: the same case id, the profile's
    measurement. ``extra``: further flags (the measurement flags tune was given)."""
    names = ["single"] if case.strategy == "single" else ["single", case.strategy]
    cmd = ["python", "-m", "bench_lib", "run", "--profile", profile_arg,
           "--strategies", ",".join(names), "--models", case.model,
           "--image-sizes", str(case.image_size), "--batch-sizes", str(case.batch_size),
           "--precisions", case.precision, "--loss", profile.loss]
    if case.split_size is not None:
        cmd += ["--split-sizes", str(case.split_size)]
    if case.partition is not None:
        cmd += ["--partitions", case.partition]
    for flag, on in (("--channels-last", case.channels_last), ("--compile", case.compile),
                     ("--sync-bn", case.sync_bn)):
        cmd += [flag] if on else []
    if case.ddp is not None:
        k = case.ddp
        cmd += ["--ddp-bucket-caps-mib", "default" if k.bucket_cap_mb is None
                else f"{k.bucket_cap_mb:g}",
                "--ddp-gradient-as-bucket-view", str(k.gradient_as_bucket_view).lower(),
                "--ddp-static-graph", str(k.static_graph).lower(),
                "--ddp-comm-hooks", k.comm_hook, "--ddp-powersgd-ranks", str(k.powersgd_rank)]
    return cmd + rig_flags(rig) + list(extra)
