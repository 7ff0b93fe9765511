"""``run``: a sweep, its run folder, and what follows it (report, gate, baseline): the
command's flags and its sequence; its plan is ``commands.plan``'s, its run folder
``commands.run_folder``'s, its answers on stderr ``report.answer``'s."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench_lib.commands.after_run import after_run, interim_report, report_due
from bench_lib.commands.common import (
    add_out,
    add_rig_args,
    add_sweep_args,
    shard_part,
    sweep_flags,
)
from bench_lib.commands.dry_run import print_plan, print_predictions
from bench_lib.commands.plan import plan_run
from bench_lib.commands.run_folder import start_folder
from bench_lib.exit_codes import EXIT_INTERRUPTED, EXIT_NOT_OK, EXIT_OK
from bench_lib.processes import interrupts

if TYPE_CHECKING:
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.launch.torchrun import Launcher
    from bench_lib.rig import Rig
    from bench_lib.rows.workload_rows import RoundDone
    from bench_lib.sweep.cases import Case

HELP = "run a sweep and write a run folder under results/"
EXAMPLES = """\
  python -m bench_lib run --profile smoke            # every seed strategy, a tiny grid (minutes)
  python -m bench_lib run --dry-run --predict        # the plan, each case's predicted step time
  python -m bench_lib run --strategies single,ddp --image-sizes 64 --batch-sizes 32
  python -m bench_lib run --profile ci --compare-to results/baseline --threshold-pct 10
  python -m bench_lib run --resume results/RUN_DIR   # finish an interrupted run"""


def add_arguments(run: argparse.ArgumentParser) -> None:
    """``run``'s flags: the sweep's and the rig's (a profile's keys), the run's own, the
    launcher's, and what to do after the sweep."""
    shaping = add_sweep_args(run) + add_rig_args(run)
    # One list: the profile overrides and --resume's refusals both come from it.
    run.set_defaults(sweep_flags=sweep_flags(shaping))
    add_out(run, "run-<profile>")
    run.add_argument("--quiet", action="store_true", help="print only the run folder")
    run.add_argument("--dry-run", action="store_true",
                     help="list the cases and an estimated duration; run nothing")
    run.add_argument("--predict-memory", action="store_true",
                     help="with --dry-run: also predict each case's peak memory per device, "
                          "as the run does before launching it (half a second to seconds a "
                          "case), and show the cases --max-memory-per-device would refuse"),
    run.add_argument("--predict", action="store_true",
                     help="calibrate each workload (seconds each) and predict each case's "
                          "step time and speedup before launching it (the profile key "
                          "predict_time); with --dry-run: print those predictions, peak "
                          "memory and each workload's predicted best, and run nothing")
    run.add_argument("--calibration", type=Path, metavar="PATH",
                     help="with --predict implied: take the calibrations of an earlier run "
                          "on this machine (its folder or calibration.json) instead of "
                          "measuring them again, and its collectives where they were "
                          "measured for the same sweep; a workload it lacks, or lacks a "
                          "size of, is calibrated as usual")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="finish an interrupted run: skip the cases it already recorded")
    run.add_argument("--shard", type=shard_part, metavar="K/N",
                     help="run only the K-th (from 1) of N parts of the sweep, balanced by "
                          "estimated duration, whole workloads each, into its own run folder; "
                          "join them with `merge` (--resume keeps the folder's shard)")
    add_launcher_args(run)
    after = run.add_argument_group("after the sweep (each acts on the run folder it wrote)")
    after.add_argument("--report", action="store_true",
                       help="write report.html and the figures into the run folder")
    after.add_argument("--compare-to", type=Path, metavar="BASELINE",
                       help="gate the run against BASELINE (a run folder or a baseline store), "
                            "writing compare.md and compare.json; exit 1 on a regression")
    after.add_argument("--threshold-pct", type=float, default=None, metavar="PCT",
                       help="with --compare-to: compare's --threshold-pct (default 10)")
    after.add_argument("--metric", choices=("auto", "step_time", "speedup"), default=None,
                       help="with --compare-to: compare's --metric (default auto)")
    after.add_argument("--allow-different-hardware", action="store_true",
                       help="with --compare-to: compare with a baseline of other hardware")
    after.add_argument("--save-baseline", type=Path, metavar="STORE",
                       help="store the run as this hardware's baseline in STORE (after "
                            "--compare-to: a run is gated against the old baseline first)")


def add_launcher_args(run: argparse.ArgumentParser) -> None:
    """How each multi-process case starts its ranks, and the multi-node run (launch.torchrun,
    nodes.multinode, nodes.coordination). Not sweep flags: the same sweep runs under either
    launcher."""
    from bench_lib.launch.torchrun import ENDPOINT_ENV, LAUNCHERS, RDZV_TIMEOUT_S, WAIT_NOTE_S

    g = run.add_argument_group(
        "launcher (multi-node: every node runs the same command, with its own --node-rank; "
        "only ddp, fsdp and the pipelining schedules span nodes, single runs on node 0, "
        "the other strategies are unsupported)")
    g.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: the runner starts each rank (default); torchrun: each "
                        "multi-process case through PyTorch's torchrun (c10d rendezvous, "
                        "--max-restarts 0; --standalone on one node)")
    g.add_argument("--nnodes", type=int, metavar="N",
                   help="nodes of a multi-node run (torchrun; default SLURM_NNODES, else 1)")
    g.add_argument("--node-rank", type=int, metavar="I",
                   help="this node's index, 0 writes the run folder (default SLURM_NODEID)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help=f"node 0's rendezvous address, the same on every node (default "
                        f"${ENDPOINT_ENV}; required with --nnodes > 1, never guessed)")
    g.add_argument("--coord-port", type=int, metavar="PORT",
                   help="node 0's coordination port for the runners (default: the "
                        "rendezvous port + 1)")
    g.add_argument("--rdzv-timeout-s", type=float, default=RDZV_TIMEOUT_S, metavar="S",
                   help="how long a node waits for the others to join (node 0 for every "
                        "node, the others for node 0) before it gives up with exit 2, "
                        f"saying on stderr every {WAIT_NOTE_S:g} s that it waits, even with "
                        f"--quiet (default {RDZV_TIMEOUT_S:g})")
    g.add_argument("--nproc-per-node", type=int, metavar="G",
                   help="ranks per node, torchrun's word for --devices (must match it)")



def follow(args: argparse.Namespace, launcher: Launcher, rig: Rig, cases: list[Case]) -> int:
    """A non-first node of a multi-node run: follow node 0, which writes the run folder."""
    from bench_lib.nodes.coordination import NodeZeroGone
    from bench_lib.run.follower_run import run_follower

    try:
        end = run_follower(cases, rig, launcher, args.out)
    except KeyboardInterrupt:
        print(f"node {launcher.node_rank}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except NodeZeroGone as e:
        print(f"error: node {launcher.node_rank}: {e}", file=sys.stderr)
        return EXIT_NOT_OK
    print(f"node {launcher.node_rank}: node 0 ended the run ({end}); its run folder holds "
          "the results", file=sys.stderr)
    return {"done": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(end, EXIT_NOT_OK)


def command(args: argparse.Namespace) -> int:
    # Ctrl-C from the start, even where the run was started with SIGINT ignored (a
    # background job of a non-interactive shell inherits that, and Python then leaves it
    # ignored); a polite kill (SIGTERM) stops the run like Ctrl-C: finished cases stay
    # recorded. Held while torch runs here (processes.interrupts), never an abort.
    interrupts.catch(signal.SIGINT, signal.SIGTERM)
    with contextlib.ExitStack() as stack:  # the fork server, once the run starts
        return _run(args, stack)


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """``command``'s body; ``stack`` closes what it opens (the fork server) as it returns."""
    from bench_lib.launch.agent import WARM_MODULES
    from bench_lib.nodes.coordination import open_coordinator
    from bench_lib.prediction.calibration import CalibrationKey, describe_calibration
    from bench_lib.prediction.calibration_data import Calibration
    from bench_lib.prediction.duration import case_seconds, run_estimate
    from bench_lib.prediction.predictor import Predictor
    from bench_lib.processes.forkserver import ForkServer
    from bench_lib.report.answer import answer_text, round_answer
    from bench_lib.results.store import RunWriter, make_results_root
    from bench_lib.run.case_launch import LaunchOptions
    from bench_lib.run.duty import DutyMeter, write_duty
    from bench_lib.run.progress import Progress
    from bench_lib.run.runner import SweepCallbacks, SweepOptions, run_sweep
    from bench_lib.run.shard import describe as describe_shard

    duty = DutyMeter()  # the run's wall clock starts with the command
    with duty.part("planning"):
        plan = plan_run(args)  # everything validated before the run folder exists
        launcher, rig, cases, sweep = plan.launcher, plan.rig, plan.cases, plan.sweep
        estimates = [case_seconds(c, rig) for c in cases]
        # The rig figures are measured once: a resumed run reads them from its env.json.
        estimate = run_estimate(cases, rig, plan.profile.rig_figures and not args.resume,
                                plan.profile.predict_time)
    if args.dry_run and (args.predict or plan.given is not None):
        return print_predictions(cases, rig, stack, args.quiet, plan.given)
    if args.dry_run:
        print_plan(cases, rig, args.predict_memory, plan.profile.rig_figures,
                   plan.profile.predict_time, args.out)
        if sweep is not None and sweep.shard is not None:
            print(describe_shard(sweep, plan.cut))
        return EXIT_OK
    duty.set_estimate(estimate.total_s)  # recorded beside the wall time it estimates
    checked = None  # env.json's preflight: a cuda rig's checks, and any NCCL fallback
    if rig.kind == "cuda":  # NCCL, /dev/shm, NVML checked in seconds, not hours in (exit 2)
        from bench_lib.measure import preflight

        with duty.part("preflight"):  # duty.json run_parts_s preflight_s
            began = time.monotonic()
            checks = preflight.check(rig, quiet=args.quiet)  # may set NCCL_P2P_DISABLE=1
            checked = preflight.record(checks or [], time.monotonic() - began)
    if launcher.node_rank > 0:  # node 0 writes the run folder; this node follows it
        return follow(args, launcher, rig, cases)
    # Node 0 of a multi-node run: the nodes admitted before anything is written.
    coordinator = open_coordinator(launcher, rig, cases) if launcher.multi_node else None
    if not args.resume:  # a bad --out: exit 2 before the fork server starts (seconds)
        make_results_root(args.out)
    # Every process the run starts from here on is forked by one server that imported
    # torch once (processes.forkserver): the FLOP probe, the collectives, every case's ranks.
    server = stack.enter_context(ForkServer.take(WARM_MODULES))
    with duty.part("fork_server"):  # its imports, begun beside the command's (prestart)
        server.ensure()
    run_dir, figures = start_folder(args, plan, server, coordinator, duty, checked)
    progress = Progress(estimates, quiet=args.quiet,
                        launches=[c.measurement.launches for c in cases],
                        calibration_s=estimate.calibration_s, calibrations=estimate.workloads)
    verb = "resuming" if args.resume else "run"
    part = f" (shard {sweep.shard.label})" if sweep is not None and sweep.shard else ""
    progress.header(f"{verb} {run_dir.name}: {len(cases)} cases on rig {rig.label}{part}")

    def launch_done(index: int, case: Case, launch: int, outcome: CaseOutcome) -> None:
        duty.add(outcome.step_times_s, outcome.warmup_time_s, outcome.wall_time_s,
                 outcome.parts_s, outcome.warmup_first_step_s)
        progress.launch_done(index, case, launch, outcome)

    def calibrated(key: CalibrationKey, cal: Calibration | str) -> None:
        progress.note(describe_calibration(key, cal))
        progress.calibrated()
        if not isinstance(cal, str):
            duty.add_calibration(cal.wall_s)

    def round_done(done: RoundDone) -> None:
        # Between launches, never beside one: on a cpu rig a report written while a launch
        # runs would take its cores.
        if done.last:
            return  # the run's end prints the whole answer and writes the report
        for line in round_answer(done.label, done.rows, plan.profile.name):
            progress.note(line)
        if args.report and report_due(done):
            progress.note(interim_report(run_dir, f"after round {done.round_done} of "
                                                  f"{done.rounds} of workload {done.workload}"))

    predictor = (Predictor(cases, rig, run_dir, figures.collectives, server, calibrated,
                           plan.given) if plan.profile.predict_time else None)
    if predictor is not None and predictor.reused:
        progress.note(f"calibration: {len(predictor.reused)} workload(s) from "
                      f"{predictor.reused_from}")
    options = SweepOptions(LaunchOptions(launcher, coordinator, server),
                           attainable_peak=figures.peak, idle=figures.idle,
                           collectives=figures.collectives, predictor=predictor)
    callbacks = SweepCallbacks(progress.case_done, progress.launch_start, launch_done,
                               round_done)
    try:
        with RunWriter(run_dir) as writer, duty.sweep():
            rows = run_sweep(cases, rig, writer, options, callbacks)
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted: finished cases are in {run_dir / 'cases.csv'}; the workload that "
              "was running is recorded from its finished rounds (rows marked provisional, "
              "none before its first round ended), and --resume runs it again. Finish "
              f"with:\n  python -m bench_lib run --resume {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    progress.close()
    cycle = write_duty(run_dir, duty.finish())
    if not args.quiet:  # the answer, the duty cycle and where the results are
        for line in [*answer_text(rows, plan.profile.name), cycle.text(),
                     f"results: {run_dir / 'cases.csv'}"]:
            print(line, file=sys.stderr)
    print(run_dir)
    failed = any(r["status"] in ("error", "timeout") for r in rows)
    return after_run(args, run_dir) or (EXIT_NOT_OK if failed else EXIT_OK)
