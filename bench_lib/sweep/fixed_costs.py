"""What a run pays beyond its steps, term by term, per rig kind: the start-up and per-run
terms of the duration estimate (``sweep.estimate``), each measured, each with its source.

    per launch    launch_s          process start, CUDA context, model build, the diagnostics'
                                    set-up, teardown, the runner's work between launches
                  first_step_s      a launch's first warm-up step beyond a steady step
                                    (lazy initialisation; cuDNN autotuning on cuda)
                  process_group_s   a launch whose ranks form a process group on NCCL (gloo's,
                                    on a cpu rig or the slots of one GPU, is in launch_s)
    per workload  calibration_size_s  each batch size its calibration times
    per run       run_s             planning, the fork server, pre-flight (cuda), writing rows
                  rig_figures_s     idle power and the FLOP peak (profile key rig_figures)
                  collectives_s     the collectives' micro-benchmark (a case priced with them)

``from_duty`` derives them from a run's ``duty.json`` (and ``steady_warmup_s`` its warm-up's
steady steps from ``cases.csv``): how the constants below were found, and how to renew them
from a fresh run. ``tests/test_estimate_terms.py`` recomputes the cuda constants from the
H100 evidence (``tests/data/h100-2026-11-26``) and fails when one drifts from it. Never
imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SETTLED_AFTER_STEPS = 3
"""Warm-up steps a first launch usually runs (``timing.WarmupRule``): the slow first step, a
new low, then one no lower; later launches run that less 2 (``protocol.reused_warmup``),
never under the profile's ``warmup_steps``."""


@dataclass(frozen=True)
class FixedCosts:
    """A rig kind's terms (module docstring), in seconds, and where they were measured."""

    launch_s: float
    first_step_s: float
    process_group_s: float
    calibration_size_s: float
    run_s: float
    rig_figures_s: float
    collectives_s: float
    source: str
    """The runs the terms come from (and the arithmetic: ``from_duty``)."""


CPU = FixedCosts(
    launch_s=1.526, first_step_s=1.041, process_group_s=0.0, calibration_size_s=2.175,
    run_s=0.06, rig_figures_s=3.27, collectives_s=3.70,
    source="default-cpu on 2 cores, AMD EPYC, at 2bfcde0 on a quiet machine (102 launches, 30 "
           "calibrated sizes, 955 s): from_duty on its duty.json with parts (launch_s holds "
           "the runner's work between launches, 33 s there, most of it the report written "
           "after each workload's first and last round)")
"""The cpu rig's terms (``source``), renewed from a run's duty.json with parts
(``from_duty``)."""

CUDA = FixedCosts(
    launch_s=1.126, first_step_s=3.73, process_group_s=15.81, calibration_size_s=12.21,
    run_s=13.28, rig_figures_s=14.88, collectives_s=12.16,
    source="one H100 80GB, torch 2.11 (tests/data/h100-2026-11-26): launch, first step and "
           "calibration from resnet50-224-single-accum (12 launches, 4 sizes); pre-flight and "
           "the run's own from smoke-1gpu (neither rig figures nor collectives), rig figures "
           "as the 224 px run's per-run cost beyond it and its calibration, collectives as "
           "smoke-2slots' (a failed gloo attempt); NCCL as smoke-1gpu's ddp launch beyond "
           "single's and dp's (the only NCCL launch: one rank; its extra lay in the warm-up, "
           "between the group's buffers and the first timed step)")
"""The cuda rig's terms, from the first GPU run (``source``): every term the runs of that
day lumped together was separated by difference between them, so each stands for whatever
that code did there; a run with ``duty.json``'s parts renews them (``from_duty``)."""

BY_KIND = {"cpu": CPU, "cuda": CUDA}


def steady_warmup_s(rows: Iterable[Mapping[str, Any]], minimum: int) -> float:
    """The steady (not first) warm-up steps of a run's ``cases.csv`` rows, in seconds: each
    ok case's first launch ran its ``warmup_steps`` W, later launches W - 2 (never under
    ``minimum``, the profile's), each at its launch median."""
    total = 0.0
    for row in rows:
        if row.get("status") != "ok" or not row.get("launch_medians_s"):
            continue
        medians = [float(m) for m in str(row["launch_medians_s"]).split(";")]
        first = int(row["warmup_steps"])
        later = max(minimum, first - 2)
        total += (first - 1) * medians[0] + sum(max(0, later - 1) * m for m in medians[1:])
    return total


def from_duty(duty: Mapping[str, Any], steady_warmup: float = 0.0,
              calibrated_sizes: int = 0) -> dict[str, float]:
    """The terms a run's ``duty.json`` gives, in seconds (``process_group_s`` aside: NCCL's
    share needs the count of launches that paid it, from ``cases.csv``).

    Per launch: ``launch_s``, the launches' fixed cost (duty.json's ``fixed_per_launch_s``
    is the run's total, not one launch's) and the runner's work between them
    (``between_launches_s``), over the launches; ``first_step_s``, the first warm-up steps
    (``warmup_parts_s``), else the warm-up beyond ``steady_warmup``, over the launches. Per
    workload: ``calibration_size_s``, the calibration over ``calibrated_sizes``. Per run:
    the rig figures and collectives where ``run_parts_s`` names them, ``run_s`` the rest
    beyond the calibration (all of it, in a file without parts).
    """
    launches = max(1, int(duty["launches"]))
    calibration = float(duty.get("calibration_s") or 0.0)
    run_parts = {k: float(v) for k, v in (duty.get("run_parts_s") or {}).items()}
    between = run_parts.get("between_launches_s", 0.0)
    first = (duty.get("warmup_parts_s") or {}).get("warmup_first_step_s")
    terms = {"launch_s": (float(duty["fixed_per_launch_s"]) + between) / launches,
             "first_step_s": (float(first) if first is not None
                              else float(duty["warmup_s"]) - steady_warmup) / launches}
    if calibrated_sizes:
        terms["calibration_size_s"] = calibration / calibrated_sizes
    rig = sum((v for k, v in run_parts.items() if k in RIG_FIGURE_PARTS), 0.0)
    coll = sum((v for k, v in run_parts.items() if k in COLLECTIVE_PARTS), 0.0)
    per_run = float(duty["fixed_per_run_s"]) - calibration - between
    return terms | {"run_s": per_run - rig - coll, "rig_figures_s": rig, "collectives_s": coll}


RIG_FIGURE_PARTS = frozenset({"idle_power_s", "flop_peak_s"})
"""``duty.json`` ``run_parts_s`` keys that are the rig figures (parts of
``commands.run_folder``'s ``start_folder``)."""
COLLECTIVE_PARTS = frozenset({"collectives_s"})
"""``duty.json`` ``run_parts_s`` keys that are the collectives."""
