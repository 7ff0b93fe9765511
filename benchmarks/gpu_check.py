"""Whether to trust a GPU box's figures, in one command and one verdict.

    .venv/bin/python benchmarks/gpu_check.py                  # sweeps, checks, test suite
    .venv/bin/python benchmarks/gpu_check.py --no-tests       # the sweeps and their checks
    .venv/bin/python benchmarks/gpu_check.py --runs DIR [DIR...]  # check run folders only

1. Two sweeps of the `gpu-check` profile (the smoke grid, with the rig's idle power and FLOP
   peak measured): on every visible GPU, then the validation mode (`--devices 2 --gpu-slots
   2`: two slots sharing GPU 0). About a minute each on one GPU.
2. Each run folder checked for what a GPU row must hold (bench_lib/gpu_check/folders.py):
   every case ok, unsupported or skipped; utilisation from a GPU counter, power, energy gross
   and net, MFU, the allocator's peak, each pipeline's bubble; the FLOP peak, idle power and
   collectives in env.json. A line per case, then each problem.
3. The test suite with the GPU visible, in one shard per 2 cores (each shard one pytest
   process pinned to its own cores, tests dealt by file, the slow files spread): a line as
   each shard ends; logs, JUnit reports and summary.txt under OUT/tests. At most 7 minutes.

Then one verdict: TRUST, or DO NOT TRUST with every problem and failed test listed. About 10
minutes on a one-GPU, 16-core box.

On two GPUs or more it checks what one GPU cannot (bench_lib/gpu_check/plan.py), within 15
minutes by its own estimate (below: the run estimate's terms and the cases it will run; the
sweep measures fewer splits where the estimate passes the budget):
1. the pre-flight on the two GPUs (NCCL, /dev/shm, NVML, CUDA, an all-reduce);
2. every strategy's two-GPU test, its ranks forked by the fork server as a run's are (one
   pytest process; --shards does not apply): logs and JUnit report under OUT/tests;
3. a short sweep of every strategy on the two GPUs (profile gpu-check), checked as in 2.
A failed pre-flight runs nothing more.

Exit 0: trust; 1: problems; 2: no CUDA GPU visible, a sweep that could not start, or a
folder that is not a run folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.gpu_check import folders, plan, sweeps, testsuite  # noqa: E402
from bench_lib.gpu_check.shards import CORES_PER_SHARD, PytestShard, ShardResult  # noqa: E402
from bench_lib.gpu_check.verdict import Verdict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "results" / "gpu-check"


def two_gpu_plan(out: Path) -> plan.TwoGpuPlan:
    """The two-GPU check's plan, priced with this machine's terms where a run under ``out``
    measured them (``dry_run.this_box_terms``), else another machine's."""
    from bench_lib.commands.dry_run import this_box_terms
    from bench_lib.rig import Rig

    return plan.two_gpu_plan(this_box_terms(Rig("cuda", 2), out))


class PlanHelp(argparse.Action):
    """``--help``, with the two-GPU plan's estimate computed as the help is asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        lines = two_gpu_plan(DEFAULT_OUT).lines()
        parser.epilog = (parser.epilog or "") + "\n\nIts estimate now, on two GPUs:\n" + \
            "\n".join(lines)
        parser.print_help()
        parser.exit()


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__
                                     .split("\n\n", 1)[1], add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-h", "--help", action=PlanHelp,
                        help="show this help, with the two-GPU plan's estimate, and exit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder receiving a folder per sweep and tests/ (default: "
                             "%(default)s)")
    parser.add_argument("--runs", type=Path, nargs="+", metavar="DIR",
                        help="check these run folders only: no sweep, no test suite")
    parser.add_argument("--no-sweeps", action="store_true",
                        help="run no sweep: the test suite alone")
    parser.add_argument("--no-tests", action="store_true",
                        help="leave the test suite out: the sweeps and their checks alone")
    parser.add_argument("--shards", type=int, metavar="N",
                        help=f"test shards (default: the usable cores // {CORES_PER_SHARD}, "
                             "at least 1)")
    parser.add_argument("--shard-timeout-s", type=float, default=testsuite.SHARD_TIMEOUT_S,
                        metavar="S", help="stop a shard still running after S seconds "
                                          "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.no_sweeps and args.no_tests:
        parser.error("--no-sweeps with --no-tests leaves nothing to check")
    if args.shards is not None and args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    return args


def run_tests(args: argparse.Namespace) -> tuple[list[ShardResult], tuple[str, ...]]:
    """The suite on this process's cores, in ``--shards`` (or cores // 2) shards."""
    cores = sorted(os.sched_getaffinity(0))
    per_shard = max(1, len(cores) // args.shards) if args.shards else CORES_PER_SHARD
    return testsuite.run_suite(REPO, args.out / "tests", cores, per_shard,
                               args.shard_timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.runs:
        if bad := folders.unreadable(args.runs):
            print("error: " + "; ".join(bad), file=sys.stderr)
            return 2
        verdict = Verdict(tuple(folders.check(args.runs)), len(args.runs))
        print("\n" + "\n".join(verdict.lines()))
        return 0 if verdict.trusted else 1
    if sweeps.gpus_visible() == 0:
        print("error: no CUDA GPU visible (NVML): nothing to check here", file=sys.stderr)
        return 2
    if not args.no_tests and not (REPO / "tests").is_dir():
        print(f"error: no test suite at {REPO / 'tests'} (a source checkout has one); "
              "--no-tests checks the sweeps alone", file=sys.stderr)
        return 2
    if sweeps.gpus_visible() >= 2:
        return check_two_gpus(args)
    dirs = []
    for i, name in enumerate([] if args.no_sweeps else sweeps.SWEEPS, 1):
        print(f"\nsweep {i} of {len(sweeps.SWEEPS)}: {name} (about a minute)", flush=True)
        folder, why = sweeps.run_check_sweep(name, args.out, REPO)
        if folder is None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        dirs.append(folder)
    problems = tuple(folders.check(dirs))
    tests, collection = (None, ()) if args.no_tests else run_tests(args)
    verdict = Verdict(problems, len(dirs), None if tests is None else tuple(tests), collection)
    print("\n" + "\n".join(verdict.lines()))
    return 0 if verdict.trusted else 1


def run_two_gpu_tests(args: argparse.Namespace, tests: int,
                      estimate_s: float) -> list[ShardResult]:
    """Every strategy's two-GPU test in one pytest process on every core of this process
    (each test uses both GPUs: they run one after another), stopped after the larger of
    ``--shard-timeout-s`` and twice its estimate."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    out = args.out / "tests"
    out.mkdir(parents=True, exist_ok=True)
    shard = PytestShard(0, cores, (plan.TWO_GPU_TEST,), estimate_s)
    collection = testsuite.Collection({plan.TWO_GPU_TEST: "gpu"})
    print(f"\n{tests} two-GPU tests (one per strategy) through the fork server; log in "
          f"{out}", flush=True)
    return testsuite.run_shards([shard], collection, REPO, out,
                                max(args.shard_timeout_s, 2 * estimate_s))


def check_two_gpus(args: argparse.Namespace) -> int:
    """The two-GPU check (module docstring): its plan, the pre-flight, the tests, the
    sweep, one verdict."""
    from bench_lib.measure import preflight
    from bench_lib.rig_detection import detect_rig

    planned = two_gpu_plan(args.out)
    print("\n".join(planned.lines()), flush=True)
    failed = ""
    try:
        preflight.check(detect_rig("cuda", 2))
    except preflight.PreflightError as e:
        failed = str(e)
    tests: list[ShardResult] | None = None
    dirs = []
    if not failed and not args.no_tests:
        tests = run_two_gpu_tests(args, planned.tests, planned.tests_s)
    if not failed and not args.no_sweeps:
        print(f"\nsweep: every strategy on two GPUs (~{planned.sweep_s:.0f} s)", flush=True)
        folder, why = sweeps.run_check_sweep("two-gpus", args.out, REPO, planned.sweep_flags)
        if folder is None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        dirs.append(folder)
    verdict = Verdict(tuple(folders.check(dirs)), len(dirs),
                      None if tests is None else tuple(tests),
                      tests_label="every strategy's two-GPU test through the fork server",
                      required_tests=0 if tests is None else planned.tests,
                      preflight=failed)
    print("\n" + "\n".join(verdict.lines()))
    return 0 if verdict.trusted else 1


if __name__ == "__main__":
    sys.exit(main())
