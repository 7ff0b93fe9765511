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
minutes on a one-GPU, 16-core box. Exit 0: trust; 1: problems; 2: no CUDA GPU visible, a
sweep that could not start, or a folder that is not a run folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.gpu_check import folders, sweeps, testsuite  # noqa: E402
from bench_lib.gpu_check.shards import CORES_PER_SHARD, ShardResult  # noqa: E402
from bench_lib.gpu_check.verdict import Verdict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__
                                     .split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "gpu-check",
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
    dirs = []
    for i, name in enumerate([] if args.no_sweeps else sweeps.SWEEPS, 1):
        print(f"\nsweep {i} of {len(sweeps.SWEEPS)}: {name} (about a minute)", flush=True)
        folder, why = sweeps.run_sweep(name, args.out, REPO)
        if folder is None:
            print(f"error: {why}", file=sys.stderr)
            return 2
        dirs.append(folder)
    problems = tuple(folders.check(dirs))
    tests, collection = (None, ()) if args.no_tests else run_tests(args)
    verdict = Verdict(problems, len(dirs), None if tests is None else tuple(tests), collection)
    print("\n" + "\n".join(verdict.lines()))
    return 0 if verdict.trusted else 1


if __name__ == "__main__":
    sys.exit(main())
