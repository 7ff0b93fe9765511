"""Command line: ``python -m bench_lib <command>``.

Exit codes: 0 success, 1 the run ended with failed cases (error/timeout), 2 bad input
(nothing written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_lib import strategies
from bench_lib.rig import RIG_KINDS, RigError, detect_rig
from bench_lib.sweep import UsageError, expand, load_profile, profile_names, profile_path
from bench_lib.workloads import WorkloadError

EXIT_OK, EXIT_FAILED_CASES, EXIT_USAGE = 0, 1, 2


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


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
    run.add_argument("--profile", default="default",
                     help=f"profile name ({', '.join(profile_names())}) or a .toml path")
    run.add_argument("--strategies", type=_str_list,
                     help=f"comma-separated, from: {', '.join(sorted(strategies.REGISTRY))}")
    run.add_argument("--models", type=_str_list, help="comma-separated model names")
    run.add_argument("--image-sizes", type=_int_list, help="comma-separated pixel sizes")
    run.add_argument("--batch-size", type=_int_list, dest="batch_sizes",
                     help="global batch size(s), comma-separated")
    run.add_argument("--split-sizes", type=_int_list, help="micro-batch sizes, comma-separated")
    run.add_argument("--precision", type=_str_list, dest="precisions", help="fp32 and/or bf16")
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
    _add_rig_args(run)

    env = sub.add_parser("env", help="print the environment a run would record (JSON)")
    _add_rig_args(env)

    from bench_lib import compare_report

    compare = sub.add_parser(
        "compare", help="gate a candidate run against a baseline (exit 1 on a regression)")
    compare_report.add_arguments(compare)
    return parser


def cmd_env(args: argparse.Namespace) -> int:
    from bench_lib import environment

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker)
    print(json.dumps(environment.collect(rig, {}, sys.argv), indent=2, default=str))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from bench_lib import environment, flops
    from bench_lib.progress import Progress
    from bench_lib.results import RunWriter, create_run_dir, git_info, new_run_id, \
        write_json_atomic
    from bench_lib.runner import run_sweep
    from bench_lib.summary import summary_lines

    # Everything is validated before the run folder exists: bad input writes nothing.
    rig = detect_rig(args.rig, args.devices, args.threads_per_worker)
    profile = load_profile(profile_path(args.profile, rig)).override(
        strategies=args.strategies, models=args.models, image_sizes=args.image_sizes,
        batch_sizes=args.batch_sizes, split_sizes=args.split_sizes,
        precisions=args.precisions, loss=args.loss, warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps, case_timeout_s=args.case_timeout_s,
        ci_target_pct=args.ci_target_pct, sample_interval_ms=args.sample_interval_ms,
    )
    cases = expand(profile, rig)

    run_dir = create_run_dir(args.out, new_run_id(git_info()["sha"]))
    # Measured once per run, before any case, for the MFU columns (bench_lib/flops.py).
    peak = flops.measure_peak(rig, list(profile.precisions))
    write_json_atomic(run_dir / "env.json",
                      environment.collect(rig, profile.as_dict(), sys.argv, peak))
    progress = Progress(len(cases), quiet=args.quiet)
    progress.header(f"run {run_dir.name}: {len(cases)} cases on rig {rig.label}")
    with RunWriter(run_dir) as writer:
        rows = run_sweep(cases, rig, writer, progress.case_done, progress.case_start,
                         peak=peak)
    progress.close()
    if not args.quiet:
        for line in summary_lines(rows):
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
        return cmd_run(args)
    except (UsageError, RigError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
