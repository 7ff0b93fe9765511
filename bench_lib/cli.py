"""Command line: ``python -m bench_lib <command>``.

Exit codes: 0 success, 1 the run ended with failed cases (error/timeout), 2 bad input
(nothing written), 130 interrupted (finished cases kept; finish with --resume).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from bench_lib import strategies
from bench_lib.results import ResultsError
from bench_lib.rig import RIG_KINDS, RigError, detect_rig
from bench_lib.sweep import UsageError, expand, load_profile, profile_names, profile_path
from bench_lib.workloads import WorkloadError

EXIT_OK, EXIT_FAILED_CASES, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


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
    """``12GiB``, ``16G``, ``512MiB`` or ``512m`` -> MiB."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value, unit = (float(t[:-1]), t[-1]) if t and t[-1] in _UNITS_MIB else (float(t), "m")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 12GiB or 512MiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory cap must be positive, got {text!r}")
    return value * _UNITS_MIB[unit]


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _add_rig_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rig (detected; these override)")
    g.add_argument("--rig", choices=RIG_KINDS, help="device kind (default: cuda if available)")
    g.add_argument("--devices", type=int, help="number of devices (GPUs or CPU workers)")
    g.add_argument("--threads-per-worker", type=int, help="intra-op threads per CPU worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench_lib",
        description="Benchmark PyTorch training parallelism strategies.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a sweep and write a run folder under results/")
    run.add_argument("--profile", dest="profile_flag", metavar="NAME|PATH",
                     help=f"profile name ({', '.join(profile_names())}) or a .toml path "
                          "(default: default)")
    run.add_argument("--strategies", type=_str_list,
                     help=f"comma-separated, from: {', '.join(sorted(strategies.REGISTRY))}")
    run.add_argument("--models", type=_str_list, help="comma-separated model names")
    run.add_argument("--image-sizes", type=_int_list, help="comma-separated pixel sizes")
    run.add_argument("--batch-size", type=_int_list, dest="batch_sizes",
                     help="global batch size(s), comma-separated")
    run.add_argument("--split-sizes", type=_int_list, help="micro-batch sizes, comma-separated")
    run.add_argument("--microbatches", type=_int_list,
                     help="micro-batch counts, comma-separated (split = ceil(batch / count))")
    run.add_argument("--precision", type=_str_list, dest="precisions", help="fp32 and/or bf16")
    run.add_argument("--partition", type=_str_list, dest="partitions",
                     help="stage cuts, comma-separated: tutorial, balanced (profiled block "
                          "times), balanced-flops")
    run.add_argument("--channels-last", action="store_true", default=None,
                     help="channels-last memory format for model and inputs")
    run.add_argument("--compile", action="store_true", default=None,
                     help="torch.compile each strategy's modules")
    run.add_argument("--sync-bn", action="store_true", default=None,
                     help="SyncBatchNorm in ddp/fsdp (GPU rigs only)")
    run.add_argument("--loss", help="ce or mse-onehot")
    run.add_argument("--warmup-steps", type=int)
    run.add_argument("--timed-steps", type=int)
    run.add_argument("--case-timeout", type=float, dest="case_timeout_s",
                     help="seconds before a case is killed and recorded as timeout")
    run.add_argument("--ci-target-pct", type=float,
                     help="stop timing once the median's 95%% CI half-width is under this %% "
                          "of it (0: off; default 2)")
    run.add_argument("--sample-interval-ms", type=float,
                     help="utilisation/memory/power sampling interval (default 100)")
    run.add_argument("--out", type=Path, default=Path("results"),
                     help="folder that receives the run folder (default: results)")
    run.add_argument("--quiet", action="store_true", help="print only the run folder")
    run.add_argument("--dry-run", action="store_true",
                     help="list the cases and an estimated duration; run nothing")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR",
                     help="finish an interrupted run: skip the cases it already recorded")
    run.add_argument("--max-memory-per-device", type=_memory_mib,
                     dest="max_memory_per_device_mib", metavar="SIZE",
                     help="memory cap per device, e.g. 12GiB: a case above it is recorded as "
                          "oom (CPU workers: resident memory; GPUs: allocator limit)")
    _add_rig_args(run)

    env = sub.add_parser("env", help="print the environment a run would record (JSON)")
    _add_rig_args(env)

    from bench_lib import compare_report

    compare = sub.add_parser(
        "compare", help="gate a candidate run against a baseline (exit 1 on a regression)")
    compare_report.add_arguments(compare)

    report = sub.add_parser(
        "report", help="write figures and report.html into the first run folder")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folder(s); several are compared side by side")
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    from bench_lib.report import write_report

    print(write_report(args.run_dirs))
    return EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    from bench_lib import environment

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker)
    print(json.dumps(environment.collect(rig, {}, sys.argv), indent=2, default=str))
    return EXIT_OK


# Flags that shape a sweep; --resume takes all of them from the run folder instead.
SWEEP_FLAGS = ("profile_flag", "strategies", "models", "image_sizes", "batch_sizes",
               "split_sizes", "microbatches", "precisions", "loss", "warmup_steps",
               "timed_steps", "case_timeout_s", "max_memory_per_device_mib", "rig", "devices",
               "ci_target_pct", "sample_interval_ms",
               "threads_per_worker")


def _plan(args: argparse.Namespace):
    """The rig, profile and cases of a new sweep, validated (raises on bad input)."""
    rig = detect_rig(args.rig, args.devices, args.threads_per_worker)
    split_sizes = args.split_sizes
    if args.microbatches is not None and split_sizes is None:
        split_sizes = ()  # counts given alone replace the profile's split sizes
    profile = load_profile(profile_path(args.profile_flag or "default", rig)).override(
        strategies=args.strategies, models=args.models, image_sizes=args.image_sizes,
        batch_sizes=args.batch_sizes, split_sizes=split_sizes, microbatches=args.microbatches,
        precisions=args.precisions, loss=args.loss, warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps, case_timeout_s=args.case_timeout_s,
        max_memory_per_device_mib=args.max_memory_per_device_mib,
        ci_target_pct=args.ci_target_pct, sample_interval_ms=args.sample_interval_ms,
        partitions=args.partitions, channels_last=args.channels_last, compile=args.compile,
        sync_bn=args.sync_bn,
    )
    return rig, profile, expand(profile, rig)


def _plan_resume(args: argparse.Namespace):
    """The rig, profile and remaining cases of an interrupted run folder."""
    from bench_lib.results import done_case_ids, prepare_resume, read_env
    from bench_lib.rig import Rig
    from bench_lib.sweep import Profile

    given = [f for f in SWEEP_FLAGS if getattr(args, f) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_flag", "").replace("_", "-") for f in given)
        raise UsageError(f"--resume takes the sweep from the run folder's env.json; drop {flags}")
    env = read_env(args.resume)
    rig = Rig.from_dict(env["rig"])
    profile = Profile.from_dict(env["profile"])
    done = done_case_ids(args.resume) if args.dry_run else prepare_resume(args.resume)
    return rig, profile, [c for c in expand(profile, rig) if c.case_id not in done]


def _print_plan(cases, rig, estimates: list[float]) -> None:
    from bench_lib.estimate import format_duration

    width = max((len(c.case_id) for c in cases), default=10)
    print(f"{'case':<{width}}  {'will':<11}  estimate  reason")
    for case, est in zip(cases, estimates):
        print(f"{case.case_id:<{width}}  {case.status or 'run':<11}  {est:7.0f}s  {case.reason}")
    runs = sum(c.status is None for c in cases)
    print(f"{len(cases)} cases ({runs} to run) on rig {rig.label}; estimated duration "
          f"~{format_duration(sum(estimates))} (rough: the progress bar refines it)")


def cmd_run(args: argparse.Namespace) -> int:
    from bench_lib import environment, flops
    from bench_lib.estimate import case_seconds
    from bench_lib.progress import Progress
    from bench_lib.results import (
        RunWriter,
        create_run_dir,
        git_info,
        new_run_id,
        read_env,
        write_json_atomic,
    )
    from bench_lib.runner import run_sweep
    from bench_lib.summary import summary_lines, tutorial_lines

    # Everything is validated before the run folder exists: bad input writes nothing.
    rig, profile, cases = _plan_resume(args) if args.resume else _plan(args)
    estimates = [case_seconds(c, rig) for c in cases]
    if args.dry_run:
        _print_plan(cases, rig, estimates)
        return EXIT_OK

    if args.resume:
        run_dir = args.resume
        peak = read_env(run_dir).get("attainable_peak")
    else:
        run_dir = create_run_dir(args.out, new_run_id(git_info()["sha"]))
        # Measured once per run, before any case, for the MFU columns (bench_lib/flops.py).
        peak = flops.measure_peak(rig, list(profile.precisions))
        env = environment.collect(rig, profile.as_dict(), sys.argv, peak)
        write_json_atomic(run_dir / "env.json", env)
    # A polite kill (SIGTERM) stops the sweep like Ctrl-C: finished cases stay recorded.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    progress = Progress(estimates, quiet=args.quiet)
    verb = "resuming" if args.resume else "run"
    progress.header(f"{verb} {run_dir.name}: {len(cases)} cases on rig {rig.label}")
    try:
        with RunWriter(run_dir) as writer:
            rows = run_sweep(cases, rig, writer, progress.case_done, progress.case_start,
                             peak=peak)
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted: finished cases are in {run_dir / 'cases.csv'}; the case that was "
              f"running is not recorded. Finish with:\n  python -m bench_lib run --resume "
              f"{run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    progress.close()
    if not args.quiet:
        lines = summary_lines(rows)
        if profile.name == "tutorial":
            lines += tutorial_lines(rows)
        for line in lines:
            print(line, file=sys.stderr)
        print(f"results: {run_dir / 'cases.csv'}", file=sys.stderr)
    print(run_dir)
    failed = [r for r in rows if r["status"] in ("error", "timeout")]
    return EXIT_FAILED_CASES if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "env":
            return cmd_env(args)
        if args.command == "compare":
            from bench_lib import compare_report

            return compare_report.command(args)
        if args.command == "report":
            return cmd_report(args)
        return cmd_run(args)
    except (UsageError, RigError, WorkloadError, ResultsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
