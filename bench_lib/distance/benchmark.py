"""``python -m bench_lib distance``: the pairwise-distance workload, each method on each layer
a case, measured like the training cases, into ``distance.csv`` of a new run folder.

Layer by layer: the float64 reference value and gradient first (``methods.reference``, in
this process), then the layer's cases in ``launches`` rounds, each case once per round in
the runner's seeded shuffled order (``runner.round_order``), each launch fresh processes
(``distance.launch``). A case whose launch fails is not launched again; the layer's rows
are written once its last round ends, one line of progress per case.

Each row has the case's step time (forward and backward of D: geometric mean of the
launches' medians, t interval across launches: ``analysis.stats.launch_interval``), its
speedup over ``blocked`` paired by round, its peak memory per device net of the runtime,
and the value and gradient it computed beside the reference, with ``agrees`` saying whether
they are within the precision's tolerance (``AGREE_RTOL``). Exits 1 when a case failed
(error, timeout) or disagrees.

The defaults (``DEFAULT_LAYERS``, ``DEFAULT_CPU_CAP_MIB``) run every method from a small
layer, where the loop is timed too, to ResNet50's largest (``2048x512x1x1``), and on to
``16384x64x1x1``, whose 16384^2 distances autograd keeps for the backward (1 GiB in
float32): over the cpu rig's default cap of 1 GiB on one device (``blocked`` is an ``oom``;
it peaks near 1.25 GiB), under it split over two (about 0.7 GiB each).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bench_lib.analysis.stats import launch_interval, paired_ratio_interval
from bench_lib.distance import methods
from bench_lib.distance.launch import Computed, launch
from bench_lib.distance.plan import DistancePlan
from bench_lib.distance.spec import DistanceCase, DistanceSpec
from bench_lib.exit_codes import EXIT_NOT_OK, EXIT_OK
from bench_lib.launch.agent import WARM_MODULES
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.processes.forkserver import ForkServer
from bench_lib.results.cells import by_device
from bench_lib.results.schema import DISTANCE_COLUMNS
from bench_lib.rig import Rig
from bench_lib.run.case_launch import memory_true_forks
from bench_lib.run.runner import round_order
from bench_lib.sweep.profile import Measurement, UsageError

DEFAULT_LAYERS = ("64x64x3x3", "128x128x3x3", "512x512x3x3", "2048x512x1x1", "16384x64x1x1")
DEFAULT_CPU_CAP_MIB = 1024.0
"""The cpu rig's memory cap per device when none is given (GPUs: none, their own memory)."""
DEFAULT_BLOCK_ROWS = 512
DEFAULT_LOOP_MAX_KERNELS = 128
MEASUREMENT = Measurement(warmup_steps=1, timed_steps=30, max_time_s=5.0, launches=3,
                          case_timeout_s=300.0, interval_target_pct=2.0)
"""How each launch is timed (``launches`` and the cap come from the flags)."""
AGREE_RTOL = {"fp32": 1e-4, "fp64": 1e-10}
"""A case agrees when its value is within this of the float64 reference, relatively, and
its gradient within this of the reference gradient's largest magnitude."""
Row = dict[str, Any]


def _agreement(computed: Computed | None, ref_value: float, ref_grad: torch.Tensor,
               dtype: str) -> Row:
    """The value and gradient columns of an ok case (empty without a computed value)."""
    if computed is None:
        return {}
    abs_diff = abs(computed.value - ref_value)
    row: Row = {"value": computed.value, "value_ref": ref_value, "value_abs_diff": abs_diff,
                "value_rel_diff": abs_diff / abs(ref_value) if ref_value else abs_diff,
                "agree_rtol": AGREE_RTOL[dtype]}
    if computed.grad is not None:
        grad_diff = float((computed.grad.to(torch.float64) - ref_grad).abs().max())
        scale = float(ref_grad.abs().max())
        row |= {"grad_max_abs_diff": grad_diff,
                "grad_rel_diff": grad_diff / scale if scale else grad_diff}
    rtol = AGREE_RTOL[dtype]
    row["agrees"] = int(row["value_rel_diff"] <= rtol
                        and row.get("grad_rel_diff", math.inf) <= rtol)
    return row


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def distance_row(case: DistanceCase, rig: Rig, outcome: CaseOutcome, agreement: Row,
             blocked_medians: Sequence[float], cap_mib: float) -> Row:
    """The distance.csv row of a case (``schema.DISTANCE``)."""
    layer = case.layer
    row: Row = {"case_id": case.case_id, "method": case.method, "layer": layer.label,
                "kernels": layer.kernels, "kernel_numel": layer.kernel_numel,
                "dtype": case.dtype, "block_rows": case.block_rows if case.method != "loop"
                else "", "rig": rig.label, "world_size": case.world_size,
                "threads_per_worker": rig.threads_per_worker if rig.kind == "cpu" else "",
                "max_memory_per_device_mib": cap_mib or "", "status": outcome.status,
                "reason": outcome.reason}
    if outcome.wall_time_s:
        row["case_wall_time_s"] = round(outcome.wall_time_s, 3)
    if outcome.status != "ok":
        return row
    per_launch = outcome.launch_step_times_s()
    medians = [statistics.median(times) for times in per_launch]
    step = launch_interval(medians)
    row |= {"launches": len(per_launch),
            "steps_per_launch": ";".join(str(len(t)) for t in per_launch),
            "launch_medians_s": ";".join(f"{m:.6g}" for m in medians),
            "timed_steps": sum(len(t) for t in per_launch),
            "warmup_steps": outcome.warmup_steps, "step_time_s_median": step.point,
            "step_time_s_ci_low": _finite(step.low), "step_time_s_ci_high": _finite(step.high),
            "step_time_ci_method": step.method, "step_time_ci_note": step.note,
            "peak_mem_mib_max": max(outcome.peak_mem_mib.values()),
            "peak_mem_net_mib_max": max(outcome.peak_mem_net_mib.values()),
            "peak_mem_net_mib_by_device": by_device(outcome.peak_mem_net_mib),
            "peak_mem_source": outcome.peak_mem_source} | agreement
    rounds = min(len(blocked_medians), len(medians))
    if rounds:
        speedup = paired_ratio_interval(blocked_medians[:rounds], medians[:rounds])
        row |= {"speedup_vs_blocked": speedup.point, "speedup_ci_low": _finite(speedup.low),
                "speedup_ci_high": _finite(speedup.high)}
    return row


def _append(path: Path, row: Mapping[str, Any]) -> None:
    """One whole row, flushed and synced (``results.store``'s rule: a crash leaves every
    finished case readable)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=DISTANCE_COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
        f.flush()
        os.fsync(f.fileno())


def progress_line(index: int, total: int, row: Row) -> str:
    """``[3/13] blocked_512x512x3x3_fp32   ok  0.0812 s [0.079, 0.084]  peak 145 MiB ...``"""
    head = f"[{index}/{total}] {row['case_id']:<28} {row['status']:<11}"
    if row["status"] != "ok":
        return f"{head} {row['reason']}"
    low, high = row.get("step_time_s_ci_low"), row.get("step_time_s_ci_high")
    interval = f" [{low:.4g}, {high:.4g}]" if low is not None and high is not None else ""
    grad = row.get("grad_rel_diff")
    return (f"{head} {row['step_time_s_median']:.4g} s{interval}  peak "
            f"{row['peak_mem_net_mib_by_device']} MiB  value rel diff "
            f"{row['value_rel_diff']:.1e}, grad {'-' if grad is None else f'{grad:.1e}'}"
            f"{'' if row['agrees'] else '  DISAGREES'}")


def run_layer(plan: DistancePlan, rig: Rig, cases: list[DistanceCase], run_dir: Path,
              done: int, total: int, server: ForkServer | None = None) -> list[Row]:
    """Every case of one layer (module docstring); their rows, written and printed
    (``server``: forks the launches' ranks)."""
    layer = cases[0].layer
    with torch.no_grad():
        ref_value, ref_grad = methods.reference(
            methods.make_weight(layer, plan.seed, "fp64", torch.device("cpu")), plan.block_rows)
    outcomes: dict[int, list[CaseOutcome]] = {i: [] for i in range(len(cases))}
    computed: dict[int, Computed | None] = {}
    work_root = run_dir / ".work"
    for r in range(plan.measurement.launches):
        for i in round_order(len(cases), r):
            case, done_launches = cases[i], outcomes[i]
            if case.status or any(o.status != "ok" for o in done_launches):
                continue
            spec = DistanceSpec(case, rig, plan.seed, plan.measurement)
            outcome, value = launch(spec, work_root, server)
            done_launches.append(outcome)
            computed.setdefault(i, value)
    results = {i: CaseOutcome(c.status, c.reason) if c.status
               else CaseOutcome.of_launches(outcomes[i]) for i, c in enumerate(cases)}
    blocked = [statistics.median(t) for i, c in enumerate(cases)
               if c.method == "blocked" and results[i].status == "ok"
               for t in results[i].launch_step_times_s()]
    cap = plan.measurement.max_memory_per_device_mib
    rows = []
    for i, case in enumerate(cases):
        agreement = (_agreement(computed.get(i), ref_value, ref_grad, case.dtype)
                     if results[i].status == "ok" else {})
        row = {"run_id": run_dir.name} | distance_row(case, rig, results[i], agreement, blocked,
                                                  cap)
        _append(run_dir / "distance.csv", row)
        print(progress_line(done + i + 1, total, row), file=sys.stderr, flush=True)
        rows.append(row)
    if work_root.exists() and not any(work_root.iterdir()):
        work_root.rmdir()
    return rows


def measurement_of(launches: int, cap_mib: float | None, math_mode: str, rig: Rig
                   ) -> Measurement:
    """``MEASUREMENT`` with the flags' launches, memory cap and math mode (no cap given:
    ``DEFAULT_CPU_CAP_MIB`` on a cpu rig, none on GPUs); UsageError on a bad value."""
    if cap_mib is None:
        cap_mib = DEFAULT_CPU_CAP_MIB if rig.kind == "cpu" else 0.0
    try:
        return dataclasses.replace(MEASUREMENT, launches=launches,
                                   max_memory_per_device_mib=cap_mib, math_mode=math_mode)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_distance(plan: DistancePlan, rig: Rig, out: Path) -> int:
    """Run the plan on ``rig`` into a new run folder under ``out``; 1 when a case failed
    or disagrees."""
    from bench_lib.measure import environment
    from bench_lib.results.store import start_run_dir, write_json_atomic

    cases = plan.cases(rig)  # every check before the run folder exists
    run_dir = start_run_dir(out, environment.git_info()["sha"], "distance")
    write_json_atomic(run_dir / "env.json", environment.collect(
        rig, {"distance": plan.as_dict()}, sys.argv, math_mode=plan.measurement.math_mode))
    print(f"distance {run_dir.name}: {len(cases)} cases x {plan.measurement.launches} "
          f"launches on rig {rig.label}", file=sys.stderr, flush=True)
    rows: list[Row] = []
    with ForkServer.take(WARM_MODULES) as server:  # every launch's ranks forked by one server
        forks = memory_true_forks(server)  # this command's cap and peaks are resident memory
        for layer in dict.fromkeys(c.layer for c in cases):
            rows += run_layer(plan, rig, [c for c in cases if c.layer == layer], run_dir,
                              len(rows), len(cases), forks)
    print(run_dir)
    failed = any(r["status"] in ("error", "timeout") or r.get("agrees") == 0 for r in rows)
    return EXIT_NOT_OK if failed else EXIT_OK
