"""A run planned from the flags: the launcher, the rig, the profile with the flags over it,
the cases (new, resumed, or one shard of them) and a reused calibration, validated before
anything runs (``plan_run``: the ``run.plan.RunPlan``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from bench_lib.commands.after_run import check_after_run_targets
from bench_lib.commands.common import rig_of
from bench_lib.run.plan import RunPlan

if TYPE_CHECKING:
    from bench_lib.launch.torchrun import Launcher
    from bench_lib.rig import Rig
    from bench_lib.run.shard import ShardPlan, SweepRecord
    from bench_lib.sweep.cases import Case
    from bench_lib.sweep.profile import Profile


def profile_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The sweep flags given, by ``Profile`` key."""
    from bench_lib.sweep.profile import Profile

    keys = set(Profile.keys())
    given = {f.dest: getattr(args, f.dest) for f in args.sweep_flags if f.dest in keys}
    if args.microbatches is not None and args.split_sizes is None:
        given["split_sizes"] = ()  # counts given alone replace the profile's split sizes
    if args.split_sizes is not None and args.microbatches is None:
        given["microbatches"] = ()  # and sizes given alone the profile's counts
    return given


def plan_new(args: argparse.Namespace) -> tuple[Rig, Profile, list[Case]]:
    """The rig, profile and cases of a new sweep, validated (raises on bad input).

    A dry run only plans: ``--rig cuda --devices N`` then plans for N GPUs without asking
    CUDA anything, so a sweep for another box can be planned (and timed) on any machine.
    """
    from bench_lib.sweep.expansion import expand
    from bench_lib.sweep.profile import load_profile, profile_path

    rig = rig_of(args, plan_only=args.dry_run)
    profile = load_profile(profile_path(args.profile_flag or "default", rig.kind))
    profile = profile.override(**profile_overrides(args))
    return rig, profile, expand(profile, rig)


def plan_resume(args: argparse.Namespace) -> tuple[Rig, Profile, list[Case]]:
    """The rig, profile and remaining cases of an interrupted run folder.

    Checks the folder can be read as this schema before anything; repairs what the
    interruption left behind (``prepare_resume``) unless it is a dry run.
    """
    from bench_lib.results.read import done_case_ids, read_env
    from bench_lib.results.store import check_resumable, prepare_resume
    from bench_lib.rig import Rig
    from bench_lib.sweep.expansion import expand
    from bench_lib.sweep.profile import Profile, UsageError

    given = [f.flag for f in args.sweep_flags if getattr(args, f.dest) is not None]
    if given:
        raise UsageError("--resume takes the sweep from the run folder's env.json; drop "
                         + ", ".join(given))
    env = read_env(args.resume)
    # A folder from before the math mode was recorded computed in IEEE fp32: it goes on so.
    rig, profile = Rig.from_dict(env["rig"]), Profile.from_dict({"math_mode": "ieee"}
                                                               | env["profile"])
    cases = expand(profile, rig)
    check_resumable(args.resume)
    done = done_case_ids(args.resume) if args.dry_run else prepare_resume(args.resume)
    return rig, profile, [c for c in cases if c.case_id not in done]


def plan_shard(args: argparse.Namespace, rig: Rig, profile: Profile, cases: list[Case],
               ) -> tuple[list[Case], SweepRecord | None, ShardPlan | None]:
    """The cases of the shard to run (``--shard``, or the resumed folder's own: a resumed
    shard stays that shard), its env.json record, and the cut of the whole sweep."""
    from bench_lib.run import shard
    from bench_lib.sweep.profile import UsageError

    if args.resume:
        from bench_lib.results.read import read_env

        recorded = shard.SweepRecord.of_env(read_env(args.resume))
        mine = recorded.shard if recorded else None
        if args.shard is not None and args.shard != mine:
            ran = f"shard {mine.label}" if mine else "the whole sweep"
            raise UsageError(f"{args.resume} ran {ran}; drop --shard {args.shard.label}")
        return (shard.select(cases, recorded) if recorded else cases), recorded, None
    if args.shard is None:
        return cases, None, None
    sweep, cut = shard.record(profile, rig, cases, args.shard)
    return shard.select(cases, sweep), sweep, cut


def resolve_launcher(args: argparse.Namespace) -> Launcher:
    """The run's launcher (exit 2 on bad input); ``--nproc-per-node`` fills ``--devices``."""
    from bench_lib.launch.torchrun import resolve
    from bench_lib.sweep.profile import UsageError

    launcher = resolve(args.launcher, args.nnodes, args.node_rank, args.rdzv_endpoint,
                       args.coord_port, rdzv_timeout_s=args.rdzv_timeout_s)
    if args.nproc_per_node is not None:
        if launcher.kind != "torchrun":
            raise UsageError("--nproc-per-node needs --launcher torchrun")
        if args.devices not in (None, args.nproc_per_node):
            raise UsageError(f"--nproc-per-node {args.nproc_per_node} and --devices "
                             f"{args.devices} disagree: each node runs one rank per device")
        args.devices = args.nproc_per_node
    if launcher.multi_node and args.resume:
        raise UsageError("--resume of a multi-node run is not supported: run it again")
    return launcher


def plan_run(args: argparse.Namespace) -> RunPlan:
    """Every check before the run folder exists (UsageError and the like: exit 2, nothing
    written): the flags that go together, the launcher, the sweep (new, resumed, a node's
    share, a shard), a reused calibration, the post-sweep targets."""
    from bench_lib.nodes.multinode import plan_nodes
    from bench_lib.sweep.profile import UsageError

    if args.predict_memory and not args.dry_run:
        raise UsageError("--predict-memory goes with --dry-run (a run predicts every case "
                         "before launching it anyway: peak_mem_mib_predicted_by_device)")
    if args.resume and (args.predict or args.calibration is not None):
        raise UsageError("--resume predicts as the run folder's profile says (and reads its "
                         "calibration.json); drop --predict and --calibration")
    launcher = resolve_launcher(args)
    rig, profile, cases = plan_resume(args) if args.resume else plan_new(args)
    if args.predict or args.calibration is not None:
        profile = profile.override(predict_time=True)
    given = None
    if args.calibration is not None:
        from bench_lib.prediction.calibration_file import given_calibrations

        try:
            given = given_calibrations(args.calibration, rig)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if launcher.multi_node:  # planned again, on every node's devices
        rig, cases = plan_nodes(profile, rig, launcher.nnodes)
    cases, sweep, cut = plan_shard(args, rig, profile, cases)
    check_after_run_targets(args, rig, launcher.multi_node)
    return RunPlan(launcher, rig, profile, cases, sweep, cut, given)
