"""Command line: ``python -m bench_lib <command>``: parse -> plan -> run | report | compare |
tune.

Exit codes: 0 success, 1 the run ended with failed cases (error/timeout) or a regression,
2 bad input (nothing written), 130 interrupted (finished cases kept; finish with --resume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from bench_lib import strategies
from bench_lib.results.schema import ResultsError
from bench_lib.rig import RIG_KINDS, Rig, RigError, detect_rig
from bench_lib.sweep.cases import Case, expand
from bench_lib.sweep.profile import Profile, UsageError, load_profile, profile_names, profile_path
from bench_lib.workloads import MODELS, WorkloadError

if TYPE_CHECKING:
    from bench_lib.run.calibrate import GivenCalibrations
    from bench_lib.run.launch import Launcher
    from bench_lib.run.protocol import CaseOutcome
    from bench_lib.sweep.shard import Shard, ShardPlan, SweepRecord

EXIT_OK, EXIT_FAILED_CASES, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
SWEEP_GROUP = "sweep (flags > profile file > defaults; --resume takes them from the run folder)"
RIG_GROUP = "rig (detected; these override)"


class SweepFlag(NamedTuple):
    """A run flag that shapes the sweep (a profile key, ``--profile`` or a rig flag)."""

    flag: str
    dest: str
    takes_value: bool


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


_UNITS_MIB = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024**2}


def _memory_mib(text: str) -> float:
    """``12GiB``, ``16G``, ``512MiB`` or ``512m`` -> MiB. A bare number is refused: ``12``
    meant as GiB would cap every case at 12 MiB and turn the sweep into ``oom`` rows."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if not t or t[-1] not in _UNITS_MIB:
            float(t)  # a number without its unit, or no number at all
            raise argparse.ArgumentTypeError(
                f"give the size's unit: {text}GiB or {text}MiB, not {text!r}")
        value, unit = float(t[:-1]), t[-1]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 12GiB or 512MiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory cap must be positive, got {text!r}")
    return value * _UNITS_MIB[unit]


def _gpu_slots(args: argparse.Namespace) -> int:
    """``--gpu-slots``, 1 when not given (None, so that ``--resume`` can refuse it given)."""
    return 1 if args.gpu_slots is None else int(args.gpu_slots)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


_BOOLS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


def _bool_list(text: str) -> tuple[bool, ...]:
    """``false,true`` (or on/off, 1/0) -> (False, True)."""
    try:
        values = tuple(_BOOLS[v.lower()] for v in _str_list(text))
    except KeyError as e:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated true/false, got {e.args[0]!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one of true, false")
    return values


def _bucket_caps(text: str) -> tuple[float | None, ...]:
    """``default,100`` -> (None, 100.0): DDP bucket caps in MiB, None for torch's."""
    try:
        values = tuple(None if v == "default" else float(v) for v in _str_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated MiB or 'default', got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one bucket cap")
    return values


def _shard(text: str) -> Shard:
    """``K/N`` -> ``Shard`` (argparse's type: bad input exits 2 with the form to use)."""
    from bench_lib.sweep.shard import Shard

    try:
        return Shard.parse(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_rig_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    g = p.add_argument_group(RIG_GROUP)
    return [
        g.add_argument("--rig", choices=RIG_KINDS, help="device kind (default: cuda if available)"),
        g.add_argument("--devices", type=int, help="number of devices (GPUs or CPU workers)"),
        g.add_argument("--threads-per-worker", type=int, help="intra-op threads per CPU worker"),
        g.add_argument("--gpu-slots", type=int, metavar="K",
                       help="validation only: K device slots per GPU, so that the multi-device "
                            "code paths run on fewer GPUs (e.g. --devices 2 --gpu-slots 2 on "
                            "one GPU; gloo between ranks; rows say they are no multi-GPU "
                            "measurement)"),
    ]


def _add_sweep_args(run: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags that shape a sweep; every dest but ``profile_flag`` is a ``Profile`` key."""
    g = run.add_argument_group(SWEEP_GROUP)
    add = g.add_argument
    return [
        add("--profile", dest="profile_flag", metavar="NAME|PATH",
            help=f"profile name ({', '.join(profile_names())}) or a .toml path (default: default)"),
        add("--strategies", type=_str_list,
            help=f"comma-separated, from: {', '.join(sorted(strategies.REGISTRY))}"),
        add("--models", type=_str_list,
            help=f"comma-separated, from: {', '.join(sorted(MODELS))}"),
        add("--image-sizes", type=_int_list, help="comma-separated pixel sizes"),
        add("--batch-size", type=_int_list, dest="batch_sizes",
            help="global batch size(s), comma-separated"),
        add("--split-sizes", type=_int_list, help="micro-batch sizes, comma-separated"),
        add("--microbatches", type=_int_list,
            help="micro-batch counts, comma-separated (split = ceil(batch / count))"),
        add("--scaling", type=_str_list, metavar="strong,weak",
            help="strong: each batch size split over a strategy's devices; weak: each "
                 "device gets the batch size (throughput compared with single at it)"),
        add("--precision", type=_str_list, dest="precisions", help="fp32 and/or bf16"),
        add("--partition", type=_str_list, dest="partitions",
            help="stage cuts, comma-separated: tutorial, balanced (profiled block times), "
                 "balanced-flops"),
        add("--channels-last", action="store_true", default=None,
            help="channels-last memory format for model and inputs"),
        add("--compile", action="store_true", default=None,
            help="torch.compile each strategy's modules"),
        add("--sync-bn", action="store_true", default=None,
            help="SyncBatchNorm in ddp/fsdp (GPU rigs only)"),
        add("--loss", help="ce or mse-onehot (toy always trains with mse)"),
        add("--ddp-bucket-cap-mb", type=_bucket_caps, metavar="MIB,...",
            help="DDP bucket caps in MiB, comma-separated; 'default' is torch's (25 MiB after "
                 "a 1 MiB first bucket)"),
        add("--ddp-gradient-as-bucket-view", type=_bool_list, metavar="false,true",
            help="DDP gradients as views into its buckets (zeroed in place), off and/or on"),
        add("--ddp-static-graph", type=_bool_list, metavar="false,true",
            help="DDP static_graph, off and/or on"),
        add("--ddp-comm-hooks", type=_str_list, metavar="HOOK,...",
            help="DDP communication hooks, comma-separated: none, fp16, bf16, powersgd "
                 "(fp16/bf16/powersgd change the gradients; the row's note says so)"),
        add("--ddp-powersgd-rank", type=_int_list, metavar="R,...",
            help="PowerSGD approximation ranks, comma-separated (default 1)"),
        add("--ddp-knob-grid", metavar="product|one-at-a-time",
            help="how the DDP knob lists combine: every combination (default), or each "
                 "list's first value and then each other value alone"),
        add("--launches", type=int,
            help="fresh launches per case, interleaved in rounds (default 3; intervals come "
                 "from their spread, so 1 gives none)"),
        add("--warmup-steps", type=int, help="warm-up steps per launch, at least"),
        add("--timed-steps", type=int, help="most timed steps per launch"),
        add("--case-timeout", type=float, dest="case_timeout_s",
            help="seconds before a case is killed and recorded as timeout"),
        add("--ci-target-pct", type=float,
            help="stop timing a launch once its median's 95%% CI half-width over its own "
                 "steps is under this %% of it (0: off; default 2)"),
        add("--sample-interval-ms", type=float,
            help="utilisation/memory/power sampling interval (default 100)"),
        add("--max-memory-per-device", type=_memory_mib, dest="max_memory_per_device_mib",
            metavar="SIZE",
            help="memory cap per device, e.g. 12GiB: a case above it is recorded as oom "
                 "(CPU workers: resident memory; GPUs: the caching allocator's limit only, "
                 "so the CUDA context and NCCL buffers come on top of it)"),
        add("--no-predict-skip", dest="predict_skip", action="store_false", default=None,
            help="launch a case even where its predicted peak memory exceeds a device's "
                 "memory (--max-memory-per-device, else a GPU's total memory); by default it "
                 "is recorded oom, reason 'predicted: ...', without being launched"),
    ]


def _add_launcher_args(run: argparse.ArgumentParser) -> None:
    """How each multi-process case starts its ranks, and the multi-node run (run.launch,
    run.multinode). Not sweep flags: the same sweep runs under either launcher."""
    from bench_lib.run.launch import ENDPOINT_ENV, LAUNCHERS

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
    g.add_argument("--nproc-per-node", type=int, metavar="G",
                   help="ranks per node, torchrun's word for --devices (must match it)")


def _resolve_launcher(args: argparse.Namespace) -> Launcher:
    """The run's launcher (exit 2 on bad input); ``--nproc-per-node`` fills ``--devices``."""
    from bench_lib.run.launch import resolve

    launcher = resolve(args.launcher, args.nnodes, args.node_rank, args.rdzv_endpoint,
                       args.coord_port)
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


def _follow(args: argparse.Namespace, launcher: Launcher, rig: Rig, cases: list[Case]) -> int:
    """A non-first node of a multi-node run: follow node 0, which writes the run folder."""
    from bench_lib.run.multinode import NodeZeroGone
    from bench_lib.run.runner import run_follower

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        end = run_follower(cases, rig, launcher, args.out)
    except KeyboardInterrupt:
        print(f"node {launcher.node_rank}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except NodeZeroGone as e:
        print(f"error: node {launcher.node_rank}: {e}", file=sys.stderr)
        return EXIT_FAILED_CASES
    print(f"node {launcher.node_rank}: node 0 ended the run ({end}); its run folder holds "
          "the results", file=sys.stderr)
    return {"done": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(end, EXIT_FAILED_CASES)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (argparse keeps them nowhere public); none: {}."""
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--image-size`` is not taken for ``--image-sizes``), and an
    unknown flag answered by its command's usage with the nearest flag it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            import difflib

            command = subcommands(self).get(str(getattr(parsed, "command", "")), self)
            flags = [f for a in command._actions for f in a.option_strings]
            near = difflib.get_close_matches(extras[0].split("=", 1)[0], flags, n=1)
            command.error(f"unrecognized arguments: {' '.join(extras)}"
                          + (f" (did you mean {near[0]}?)" if near else ""))
        return parsed


def build_parser() -> argparse.ArgumentParser:
    from bench_lib import __version__

    parser = Parser(
        prog="python -m bench_lib",
        description="Benchmark PyTorch training parallelism strategies.",
    )
    parser.add_argument("--version", action="version", version=f"parabench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser("run", help="run a sweep and write a run folder under results/")
    shaping = _add_sweep_args(run) + _add_rig_args(run)
    # One list: the profile overrides and --resume's refusals both come from it.
    run.set_defaults(sweep_flags=tuple(SweepFlag(a.option_strings[0], a.dest, a.nargs != 0)
                                       for a in shaping))
    run.add_argument("--out", type=Path, default=Path("results"),
                     help="folder that receives the run folder (default: results)")
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
                          "measuring them again; a workload it lacks, or lacks a size of, "
                          "is calibrated as usual")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="finish an interrupted run: skip the cases it already recorded")
    run.add_argument("--shard", type=_shard, metavar="K/N",
                     help="run only the K-th (from 1) of N parts of the sweep, balanced by "
                          "estimated duration, whole workloads each, into its own run folder; "
                          "join them with `merge` (--resume keeps the folder's shard)")
    _add_launcher_args(run)
    after = run.add_argument_group("after the sweep (each acts on the run folder it wrote)")
    after.add_argument("--report", action="store_true",
                       help="write report.html and the figures into the run folder")
    after.add_argument("--compare-to", type=Path, metavar="BASELINE",
                       help="gate the run against BASELINE (a run folder or a baseline store), "
                            "writing compare.md and compare.json; exit 1 on a regression")
    after.add_argument("--threshold", type=float, default=None, metavar="PCT",
                       help="with --compare-to: compare's --threshold (default 10)")
    after.add_argument("--metric", choices=("auto", "step_time", "speedup"), default=None,
                       help="with --compare-to: compare's --metric (default auto)")
    after.add_argument("--allow-different-hardware", action="store_true",
                       help="with --compare-to: compare with a baseline of other hardware")
    after.add_argument("--save-baseline", type=Path, metavar="STORE",
                       help="store the run as this hardware's baseline in STORE (after "
                            "--compare-to: a run is gated against the old baseline first)")

    env = sub.add_parser("env", help="print the environment a run would record (JSON)")
    _add_rig_args(env)

    profiles = sub.add_parser(
        "profiles", help="list the profiles: name, cases and estimated duration on this rig, "
                         "description")
    _add_rig_args(profiles)

    from bench_lib.compare import output as compare_output

    compare = sub.add_parser(
        "compare", help="gate a candidate run against a baseline (exit 1 on a regression)")
    compare_output.add_arguments(compare)

    from bench_lib.compare import same_job

    gate = sub.add_parser(
        "gate", help="measure a base commit and the head (the working tree) in this job, "
                     "interleaved in rounds, and gate the head (exit 1 on a regression)")
    same_job.add_arguments(gate)

    baseline = sub.add_parser(
        "baseline", help="store a run folder as its hardware's baseline (for compare)")
    baseline.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    baseline.add_argument("--store", type=Path, default=Path("results/baseline"),
                          help="baseline store (default: results/baseline)")

    report = sub.add_parser(
        "report", help="write figures and report.html into the first run folder")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folder(s); several are compared side by side")

    merge = sub.add_parser(
        "merge", help="join the shards of one sweep (run --shard K/N) into one run folder")
    merge.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                       help="the shards' run folders, or folders holding them (run --out)")
    merge.add_argument("--out", type=Path, required=True, metavar="DIR",
                       help="the merged run folder to create (must not exist)")
    merge.add_argument("--allow-partial", action="store_true",
                       help="merge even with shards or cases missing (env.json names them)")

    from bench_lib.parity import run as parity_run

    parity = sub.add_parser(
        "parity", help="train every strategy on real data from the same weights; exit 1 when "
                       "one learns differently from single")
    parity_run.add_arguments(parity)
    _add_rig_args(parity)

    from bench_lib.distance import run as distance_run

    distance = sub.add_parser(
        "distance", help="time the pairwise distance of a conv weight's kernels (a loop, "
                         "blocked cdist, split over devices); exit 1 when one disagrees")
    distance_run.add_arguments(distance)
    _add_rig_args(distance)

    from bench_lib.tune import run as tune_run

    tune = sub.add_parser(
        "tune", help="race one workload's configurations (successive halving) and recommend "
                     "one, with its interval against single and the runner-up")
    shaping = _add_sweep_args(tune) + _add_rig_args(tune)
    tune.set_defaults(sweep_flags=tuple(SweepFlag(a.option_strings[0], a.dest, a.nargs != 0)
                                        for a in shaping))
    tune_run.add_arguments(tune)
    return parser


def _profile_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The sweep flags given, by ``Profile`` key."""
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
    rig = detect_rig(args.rig, args.devices, args.threads_per_worker,
                     plan_only=args.dry_run, gpu_slots=_gpu_slots(args))
    profile = load_profile(profile_path(args.profile_flag or "default", rig))
    profile = profile.override(**_profile_overrides(args))
    return rig, profile, expand(profile, rig)


def plan_resume(args: argparse.Namespace) -> tuple[Rig, Profile, list[Case]]:
    """The rig, profile and remaining cases of an interrupted run folder.

    Checks the folder can be read as this schema before anything; repairs what the
    interruption left behind (``prepare_resume``) unless it is a dry run.
    """
    from bench_lib.results.read import done_case_ids, read_env
    from bench_lib.results.store import check_resumable, prepare_resume

    given = [f.flag for f in args.sweep_flags if getattr(args, f.dest) is not None]
    if given:
        raise UsageError("--resume takes the sweep from the run folder's env.json; drop "
                         + ", ".join(given))
    env = read_env(args.resume)
    rig, profile = Rig.from_dict(env["rig"]), Profile.from_dict(env["profile"])
    cases = expand(profile, rig)
    check_resumable(args.resume)
    done = done_case_ids(args.resume) if args.dry_run else prepare_resume(args.resume)
    return rig, profile, [c for c in cases if c.case_id not in done]


def plan_shard(args: argparse.Namespace, rig: Rig, profile: Profile, cases: list[Case],
               ) -> tuple[list[Case], SweepRecord | None, ShardPlan | None]:
    """The cases of the shard to run (``--shard``, or the resumed folder's own: a resumed
    shard stays that shard), its env.json record, and the cut of the whole sweep."""
    from bench_lib.sweep import shard

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


def _print_plan(cases: list[Case], rig: Rig, estimates: list[float],
                predict_memory: bool = False) -> None:
    """The dry run's table: each case, what will happen to it, its estimated time and
    (``predict_memory``) its peak memory per device predicted as the run would before
    launching it (a case the run would refuse is shown ``oom``, with the reason)."""
    from bench_lib.run.admission import Admission
    from bench_lib.sweep.estimate import format_duration

    admission = Admission.of(rig, cases, read_devices=False)
    runnable = [c for c in cases if c.status is None] if predict_memory else []
    if runnable:
        print(f"predicting the peak memory of {len(runnable)} cases ...", file=sys.stderr,
              flush=True)
    width = max((len(c.case_id) for c in cases), default=10)
    print(f"{'case':<{width}}  {'will':<11}  estimate  {'peak MiB per device':<21}  reason")
    runs, seconds = 0, 0.0
    for case, est in zip(cases, estimates):
        will, reason, peak = case.status or "run", case.reason, ""
        if case.status is None and predict_memory:
            pred = admission.prediction(case)
            if isinstance(pred, str):  # not predicted: the case still runs
                peak, reason = "-", pred
            else:
                peak = pred.per_device_text()
            refusal = admission.refusal(case)
            if refusal:
                will, reason, est = "oom", refusal, 0.0
        if will == "run":
            runs, seconds = runs + 1, seconds + est
        print(f"{case.case_id:<{width}}  {will:<11}  {est:7.0f}s  {peak:<21}  {reason}")
    print(f"{len(cases)} cases ({runs} to run) on rig {rig.label}; estimated duration "
          f"~{format_duration(seconds)} (rough: the progress bar refines it)")
    if predict_memory:
        print("peak MiB: predicted before launch on fake tensors (bench_lib/sweep/predict.py; "
              "'balanced' cuts from counted FLOPs until a launch measures them)"
              + (f"; {admission.note}" if admission.note else ""))
    else:
        print("peak MiB per device: add --predict-memory")


def _print_predictions(cases: list[Case], rig: Rig, stack: contextlib.ExitStack,
                       quiet: bool = False, given: GivenCalibrations | None = None) -> int:
    """``run --dry-run --predict``: every workload calibrated (and the collectives measured)
    as a run would, then each case's predicted step time, speedup and peak memory, and each
    workload's predicted best; nothing written. On a cuda rig this machine cannot drive,
    says what it cannot predict and predicts memory alone."""
    import tempfile
    import time

    from bench_lib.rig import cuda_device_count
    from bench_lib.run.admission import Admission
    from bench_lib.run.calibrate import Predictor, describe_calibration, sweep_collectives
    from bench_lib.run.forkserver import ForkServer
    from bench_lib.sweep.predict_time import speedup

    start = time.monotonic()
    admission = Admission.of(rig, cases, read_devices=False)
    runnable = [c for c in cases if c.status is None]
    predictor = None
    if rig.kind == "cuda" and cuda_device_count() < rig.num_devices:
        print(f"step times not predicted: the calibration times steps on the rig's devices, "
              f"and this machine has {cuda_device_count()} GPU(s) of the {rig.num_devices} "
              "the rig names; peak memory is predicted on fake tensors all the same",
              file=sys.stderr)
    elif runnable:
        server = stack.enter_context(ForkServer.take())
        collectives = sweep_collectives(rig, quiet, runnable, server)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="parabench-")))
        predictor = Predictor(runnable, rig, folder, collectives, server,
                              lambda key, cal: print(describe_calibration(key, cal),
                                                     file=sys.stderr, flush=True), given)
        if not quiet:
            print(f"calibrating {len(predictor.sizes)} workload(s) ...", file=sys.stderr,
                  flush=True)
    width = max((len(c.case_id) for c in cases), default=10)
    print(f"{'case':<{width}}  {'will':<11}  {'step s':>7}  {'speedup':>7}  "
          f"{'peak MiB per device':<21}  note")
    best: dict[tuple[Any, ...], tuple[float, Case]] = {}
    for case in cases:
        will, step, gain, peak, note = case.status or "run", "-", "-", "", case.reason
        if case.status is None:
            memory = admission.prediction(case)
            peak = "-" if isinstance(memory, str) else memory.per_device_text()
            if refusal := admission.refusal(case):
                will, note = "oom", refusal
            elif predictor is not None:
                found, single = predictor.predict(case)
                if isinstance(found, str):
                    note = found
                else:
                    step, note = f"{found.step_s:.3f}", found.note()
                    if not isinstance(single, str) and case.curve_of is None:
                        x = speedup(found.step_s, case.batch_size, single.step_s,
                                    case.workload_batch)
                        gain = f"{x:.2f}x"
                        key = (*case.workload_key, case.scaling)
                        if key not in best or x > best[key][0]:
                            best[key] = (x, case)
        print(f"{case.case_id:<{width}}  {will:<11}  {step:>7}  {gain:>7}  {peak:<21}  {note}")
    for (model, image, batch, _, _, scaling), (x, case) in best.items():
        print(f"predicted best for {model} {image} px batch {batch} ({scaling}): "
              f"{case.strategy} {x:.2f}x single ({case.case_id})")
    print(f"{len(cases)} cases on rig {rig.label}; predicted in "
          f"{time.monotonic() - start:.0f} s (sweep.predict_time states each formula)")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:  # the fork server, once the run starts
        return _run(args, stack)


def _run(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """``cmd_run``'s body; ``stack`` closes what it opens (the fork server) as it returns."""
    from bench_lib.measure import environment, flops
    from bench_lib.measure.energy import IdlePower
    from bench_lib.report.answer import answer_lines
    from bench_lib.report.headlines import NOTE_WIDTH as ANSWER_WIDTH
    from bench_lib.report.headlines import headline_lines, tutorial_lines
    from bench_lib.report.time_prediction import score_lines
    from bench_lib.results.read import read_env
    from bench_lib.results.store import RunWriter, create_run_dir, new_run_id, write_json_atomic
    from bench_lib.run.calibrate import (
        CalibrationKey,
        Predictor,
        describe_calibration,
        sweep_collectives,
    )
    from bench_lib.run.duty import DutyMeter, write_duty
    from bench_lib.run.forkserver import ForkServer
    from bench_lib.run.multinode import cluster_env, open_coordinator
    from bench_lib.run.multinode import plan as plan_nodes
    from bench_lib.run.progress import Progress
    from bench_lib.run.runner import measure_idle_power, run_sweep
    from bench_lib.sweep.estimate import case_seconds
    from bench_lib.sweep.predict_time import Calibration
    from bench_lib.sweep.shard import describe as describe_shard
    from bench_lib.sweep.shard import record as sweep_record

    duty = DutyMeter()  # the run's wall clock starts with the command
    # Everything is validated before the run folder exists: bad input writes nothing.
    if args.predict_memory and not args.dry_run:
        raise UsageError("--predict-memory goes with --dry-run (a run predicts every case "
                         "before launching it anyway: peak_mem_mib_predicted_by_device)")
    if args.resume and (args.predict or args.calibration is not None):
        raise UsageError("--resume predicts as the run folder's profile says (and reads its "
                         "calibration.json); drop --predict and --calibration")
    launcher = _resolve_launcher(args)
    rig, profile, cases = plan_resume(args) if args.resume else plan_new(args)
    if args.predict or args.calibration is not None:
        profile = profile.override(predict_time=True)
    given = None
    if args.calibration is not None:
        from bench_lib.run.calibrate import given_calibrations

        try:
            given = given_calibrations(args.calibration, rig)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if launcher.multi_node:  # planned again, on every node's devices
        rig, cases = plan_nodes(profile, rig, launcher.nnodes)
    cases, sweep, cut = plan_shard(args, rig, profile, cases)
    check_after_run_targets(args, rig, launcher.multi_node)
    estimates = [case_seconds(c, rig) for c in cases]
    if args.dry_run and (args.predict or given is not None):
        return _print_predictions(cases, rig, stack, args.quiet, given)
    if args.dry_run:
        _print_plan(cases, rig, estimates, args.predict_memory)
        if sweep is not None and sweep.shard is not None:
            print(describe_shard(sweep, cut))
        return EXIT_OK
    if rig.kind == "cuda":  # NCCL, /dev/shm, NVML checked in seconds, not hours in (exit 2)
        from bench_lib.measure import preflight

        preflight.check(rig, quiet=args.quiet)
    if launcher.node_rank > 0:  # node 0 writes the run folder; this node follows it
        return _follow(args, launcher, rig, cases)
    # Node 0 of a multi-node run: the nodes admitted before anything is written.
    coordinator = open_coordinator(launcher, rig, cases) if launcher.multi_node else None
    # Every process the run starts from here on is forked by one server that imported
    # torch once (run.forkserver): the FLOP probe, the collectives, every case's ranks.
    server = stack.enter_context(ForkServer.take())

    if args.resume:
        run_dir = args.resume
        recorded = read_env(run_dir)
        peak = flops.AttainablePeak.from_dict(recorded.get("attainable_peak"))
        idle = IdlePower.from_dict(recorded.get("idle_power"))
        collectives = sweep_collectives(rig, args.quiet, cases, server,
                                        recorded.get("collectives"))
        if "collectives" not in recorded:  # a folder from before they were measured
            write_json_atomic(run_dir / "env.json",
                              recorded | {"collectives": collectives.as_dict()})
    else:
        run_dir = create_run_dir(args.out, new_run_id(environment.git_info()["sha"]))
        # Measured once per run, before any case: idle power first, with nothing of ours
        # running (for net energy), then the FLOP peak (for the MFU columns).
        if profile.rig_figures:
            idle = measure_idle_power(rig)
            peak = flops.measure_peak(rig, list(profile.precisions), server=server)
        else:
            off = "not measured: the profile's rig_figures is off"
            idle, peak = IdlePower(unsupported=off), flops.AttainablePeak(unsupported=off)
        # The ddp/fsdp and p2p bounds.
        collectives = sweep_collectives(rig, args.quiet, cases, server)
        env = environment.collect(rig, profile.as_dict(), sys.argv, peak.as_dict(),
                                  idle.as_dict())
        env["sweep"] = (sweep or sweep_record(profile, rig, cases)[0]).as_dict()
        env["launcher"] = launcher.as_dict()
        env["collectives"] = collectives.as_dict()
        if coordinator is not None:
            env = cluster_env(env, coordinator.infos)
        write_json_atomic(run_dir / "env.json", env)
        if coordinator is not None:
            coordinator.welcome(run_dir.name)
    # A polite kill (SIGTERM) stops the sweep like Ctrl-C: finished cases stay recorded.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Ctrl-C too, even where the run was started with SIGINT ignored (a background job of a
    # non-interactive shell inherits that, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    progress = Progress(estimates, quiet=args.quiet,
                        launches=[c.measurement.launches for c in cases])
    verb = "resuming" if args.resume else "run"
    part = f" (shard {sweep.shard.label})" if sweep is not None and sweep.shard else ""
    progress.header(f"{verb} {run_dir.name}: {len(cases)} cases on rig {rig.label}{part}")

    def launch_done(index: int, case: Case, launch: int, outcome: CaseOutcome) -> None:
        duty.add(outcome.step_times_s, outcome.warmup_time_s, outcome.wall_time_s)
        progress.launch_done(index, case, launch, outcome)

    def calibrated(key: CalibrationKey, cal: Calibration | str) -> None:
        progress.note(describe_calibration(key, cal))
        if not isinstance(cal, str):
            duty.add_calibration(cal.wall_s)

    predictor = (Predictor(cases, rig, run_dir, collectives, server, calibrated, given)
                 if profile.predict_time else None)
    if predictor is not None and predictor.reused:
        progress.note(f"calibration: {len(predictor.reused)} workload(s) from "
                      f"{predictor.reused_from}")
    try:
        with RunWriter(run_dir) as writer:
            rows = run_sweep(cases, rig, writer, progress.case_done, progress.launch_start,
                             attainable_peak=peak, idle=idle, on_launch_done=launch_done,
                             launcher=launcher, coordinator=coordinator,
                             collectives=collectives, server=server, predictor=predictor)
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted: finished cases are in {run_dir / 'cases.csv'}; the cases of the "
              "workload that was running are not recorded. Finish with:\n  python -m "
              f"bench_lib run --resume {run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    progress.close()
    cycle = write_duty(run_dir, duty.finish())
    if not args.quiet:
        lines = headline_lines(rows)
        if profile.name == "tutorial":
            lines += tutorial_lines(rows)
        lines += [line for answer in answer_lines(rows) + score_lines(rows)
                  for line in textwrap.wrap(answer, ANSWER_WIDTH)]
        for line in lines:
            print(line, file=sys.stderr)
        print(cycle.summary(), file=sys.stderr)
        print(f"results: {run_dir / 'cases.csv'}", file=sys.stderr)
    print(run_dir)
    failed = any(r["status"] in ("error", "timeout") for r in rows)
    return _after_run(args, run_dir) or (EXIT_FAILED_CASES if failed else EXIT_OK)


def check_after_run_targets(args: argparse.Namespace, rig: Rig, multi_node: bool = False
                            ) -> None:
    """``--compare-to`` and ``--save-baseline`` checked before the sweep (and in a dry run),
    not after it (UsageError: exit 2): a baseline that is not there, a store or run folder
    without this hardware's baseline, and a store that cannot be written. (A dry run that
    plans GPUs it does not have cannot name their hardware, nor one node a cluster's: there,
    only the path is checked.)"""
    import os

    given = [flag for flag, value in (("--threshold", args.threshold), ("--metric", args.metric),
                                      ("--allow-different-hardware",
                                       args.allow_different_hardware or None))
             if value is not None]
    if given and args.compare_to is None:
        raise UsageError(f"{', '.join(given)} go with --compare-to")
    if args.threshold is not None and not args.threshold >= 0:
        raise UsageError(f"--threshold must be a percentage >= 0, got {args.threshold}")
    if args.compare_to is not None:
        from bench_lib.compare.baseline import fingerprint_id, resolve_baseline, stored_hardware
        from bench_lib.compare.gate import CompareError, Run, hardware_of
        from bench_lib.measure.environment import hardware_fingerprint

        path, advice = args.compare_to, ("record one on this machine with `make baseline`, or "
                                         "measure base and head in one job with `make gate`, "
                                         "which needs no stored baseline")
        if not path.exists():
            raise UsageError(f"--compare-to {path} does not exist: {advice}")
        if ((not args.dry_run or rig.kind == "cpu") and not multi_node
                and not args.allow_different_hardware):
            mine = hardware_of(hardware_fingerprint(rig))
            try:
                found = resolve_baseline(path, Run(path, {"fingerprint": mine}, {}, {}), False)
            except CompareError:
                found = None
            theirs = stored_hardware(found) if found is not None else None
            if theirs is None:
                raise UsageError(f"--compare-to {path}: no baseline of this machine's hardware "
                                 f"(fingerprint {fingerprint_id(mine)}: {mine['rig']}, "
                                 f"{mine['cpu_model']}) is there; {advice}")
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if differ:
                raise UsageError(f"--compare-to {path} was measured on other hardware "
                                 f"({', '.join(differ)} differ); {advice}")
    if args.save_baseline is not None:
        target = args.save_baseline.resolve()
        existing = next(p for p in (target, *target.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(f"--save-baseline {args.save_baseline}: {existing} is not a "
                             "folder this user can write")


def _after_run(args: argparse.Namespace, run_dir: Path) -> int:
    """The post-sweep actions asked for, on the run folder just written; their exit code."""
    code = EXIT_OK
    if args.report:
        from bench_lib.report.build import write_report

        print(f"report: {write_report([run_dir])}", file=sys.stderr)
    if args.compare_to:
        from bench_lib.compare.gate import DEFAULT_THRESHOLD_PCT
        from bench_lib.compare.output import gate

        code = gate(args.compare_to, run_dir, markdown=run_dir / "compare.md",
                    json_path=run_dir / "compare.json",
                    threshold_pct=(DEFAULT_THRESHOLD_PCT if args.threshold is None
                                   else args.threshold),
                    metric=args.metric or "auto",
                    allow_different_hardware=args.allow_different_hardware)
    if args.save_baseline:
        from bench_lib.compare.baseline import save_baseline

        print(f"baseline: {save_baseline(run_dir, args.save_baseline)}", file=sys.stderr)
    return code


def cmd_report(args: argparse.Namespace) -> int:
    from bench_lib.report.build import write_report

    print(write_report(args.run_dirs))
    return EXIT_OK


def cmd_merge(args: argparse.Namespace) -> int:
    from bench_lib.run.merge import merge

    print(merge(args.run_dirs, args.out, allow_partial=args.allow_partial))
    return EXIT_OK


def cmd_parity(args: argparse.Namespace) -> int:
    from bench_lib.parity import run as parity_run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, gpu_slots=_gpu_slots(args))
    return parity_run.command(args, rig)


def cmd_distance(args: argparse.Namespace) -> int:
    from bench_lib.distance import run as distance_run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, gpu_slots=_gpu_slots(args))
    return distance_run.command(args, rig)


def cmd_tune(args: argparse.Namespace) -> int:
    from bench_lib.tune import run as tune_run

    rig, profile, _ = plan_new(args)  # the same flags, profile and validation as run's
    return tune_run.command(args, rig, profile)


def cmd_env(args: argparse.Namespace) -> int:
    from bench_lib.measure import environment

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, gpu_slots=_gpu_slots(args))
    print(json.dumps(environment.collect(rig, {}, sys.argv), indent=2, default=str))
    return EXIT_OK


def cmd_profiles(args: argparse.Namespace) -> int:
    """Every shipped profile on this rig (``default``: the one it picks): its cases, the
    estimated duration of a run, its description."""
    from bench_lib.sweep.estimate import case_seconds, format_duration

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, plan_only=True,
                     gpu_slots=_gpu_slots(args))
    names = [n for n in profile_names() if n != "default"]
    width = max(len(n) for n in names)
    print(f"{'profile':<{width}}  cases  estimate  description (rig {rig.label}; `default` "
          f"is default-{rig.kind})")
    for name in names:
        profile = load_profile(profile_path(name, rig))
        cases = expand(profile, rig)
        runs = [c for c in cases if c.status is None]
        seconds = sum(case_seconds(c, rig) for c in runs)
        print(f"{name:<{width}}  {len(runs):>5}  {format_duration(seconds):>8}  "
              f"{profile.description}")
    return EXIT_OK


def cmd_baseline(args: argparse.Namespace) -> int:
    from bench_lib.compare.baseline import save_baseline
    from bench_lib.compare.gate import CompareError

    try:
        print(save_baseline(args.run_dir, args.store))
    except CompareError as e:
        raise UsageError(str(e)) from None
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "env":
            return cmd_env(args)
        if args.command == "profiles":
            return cmd_profiles(args)
        if args.command == "compare":
            from bench_lib.compare import output as compare_output

            return compare_output.command(args)
        if args.command == "gate":
            from bench_lib.compare import same_job

            return same_job.command(args)
        if args.command == "baseline":
            return cmd_baseline(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "merge":
            return cmd_merge(args)
        if args.command == "parity":
            return cmd_parity(args)
        if args.command == "distance":
            return cmd_distance(args)
        if args.command == "tune":
            return cmd_tune(args)
        return cmd_run(args)
    except (UsageError, RigError, WorkloadError, ResultsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
