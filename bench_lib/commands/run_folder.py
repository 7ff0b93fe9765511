"""A run's folder started before its first case: a new one, with the rig figures measured
once (idle power, the FLOP peak, the collectives: those of ``run --calibration``'s file where
they were measured for this sweep) and its env.json written, or a resumed one, its figures
read back."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from bench_lib.analysis.collective_fits import Collectives
    from bench_lib.measure.energy import IdlePower
    from bench_lib.measure.flop_peak import AttainablePeak
    from bench_lib.nodes.coordination import Coordinator
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.run.duty import DutyMeter
    from bench_lib.run.plan import RunPlan


class RigFigures(NamedTuple):
    """What a run measures once, before its cases (or reads back from a resumed folder)."""

    peak: AttainablePeak
    idle: IdlePower
    collectives: Collectives


def start_folder(args: argparse.Namespace, plan: RunPlan, server: ForkServer,
                 coordinator: Coordinator | None,
                 duty: DutyMeter | None = None,
                 preflight: dict[str, Any] | None = None) -> tuple[Path, RigFigures]:
    """The run folder (new, with its env.json, or the resumed one) and its rig figures;
    ``duty`` times each of them as a part of the run (``DutyMeter.part``); ``preflight``:
    env.json's record of the pre-flight (``measure.preflight.record``), where it ran."""
    from bench_lib.launch.sampling import measure_idle_power
    from bench_lib.measure import environment
    from bench_lib.measure.energy import IdlePower
    from bench_lib.measure.flop_peak import AttainablePeak, measure_peak
    from bench_lib.nodes.multinode import cluster_env
    from bench_lib.prediction.calibration_file import given_collectives
    from bench_lib.prediction.collectives import reusable_collectives, sweep_collectives
    from bench_lib.results.read import read_env
    from bench_lib.results.store import start_run_dir, write_json_atomic
    from bench_lib.run.shard import record as sweep_record

    rig, profile, cases = plan.rig, plan.profile, plan.cases

    def part(name: str) -> contextlib.AbstractContextManager[None]:
        return duty.part(name) if duty is not None else contextlib.nullcontext()

    if args.resume:
        recorded = read_env(args.resume)
        with part("collectives"):
            collectives = sweep_collectives(rig, args.quiet, cases, server,
                                            recorded.get("collectives"))
        if "collectives" not in recorded:  # a folder from before they were measured
            write_json_atomic(args.resume / "env.json",
                              recorded | {"collectives": collectives.as_dict()})
        return args.resume, RigFigures(
            AttainablePeak.from_dict(recorded.get("attainable_peak")),
            IdlePower.from_dict(recorded.get("idle_power")), collectives)
    run_dir = start_run_dir(args.out, environment.git_info()["sha"], "run", profile.name)
    # Measured once per run, before any case: idle power first, with nothing of ours
    # running (for net energy), then the FLOP peak (for the MFU columns).
    if profile.rig_figures:
        with part("idle_power"):
            idle = measure_idle_power(rig)
        with part("flop_peak"):
            peak = measure_peak(rig, list(profile.precisions), server=server,
                                math_mode=profile.measurement.math_mode)
    else:
        off = "not measured: the profile's rig_figures is off"
        idle, peak = IdlePower(unsupported=off), AttainablePeak(unsupported=off)
    with part("collectives"):  # ddp/fsdp, p2p bounds: measured, or reused with --calibration
        reused = reusable_collectives(rig, cases, given_collectives(plan.given))
        reused_from = str(plan.given[0]) if reused is not None and plan.given else ""
        if reused is None:
            collectives = sweep_collectives(rig, args.quiet, cases, server)
        else:
            collectives = reused
            if not args.quiet:
                print(f"collectives: {reused.bandwidth_line()}, reused from {reused_from}",
                      file=sys.stderr)
    with part("environment"):  # versions, devices, git: subprocesses and NVML reads
        env = environment.collect(rig, profile.as_dict(), sys.argv, peak.as_dict(),
                                  idle.as_dict(), profile.measurement.math_mode, preflight)
    env["sweep"] = (plan.sweep or sweep_record(profile, rig, cases)[0]).as_dict()
    env["launcher"] = plan.launcher.as_dict()
    env["collectives"] = collectives.as_dict()
    if reused_from:
        env["collectives_reused_from"] = reused_from
    if coordinator is not None:
        env = cluster_env(env, coordinator.infos)
    write_json_atomic(run_dir / "env.json", env)
    if coordinator is not None:
        coordinator.welcome(run_dir.name)
    return run_dir, RigFigures(peak, idle, collectives)
