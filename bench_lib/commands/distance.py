"""``distance``: the pairwise distance of a conv weight's kernels (bench_lib.distance): its
flags, and the ``DistancePlan`` they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from bench_lib.commands.common import (
    add_math_mode,
    add_out,
    add_rig_args,
    memory_mib,
    rig_of,
    str_list,
)
from bench_lib.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from bench_lib.distance.plan import DistancePlan
    from bench_lib.rig import Rig

HELP = ("time the pairwise distance of a conv weight's kernels (a loop, blocked cdist, split "
        "over devices); exit 1 when one disagrees")
EXAMPLES = """\
  python -m bench_lib distance --dry-run
  python -m bench_lib distance --layers 512x512x3x3 --methods blocked,split --launches 1"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.distance import benchmark, spec

    p.add_argument("--layers", default=",".join(benchmark.DEFAULT_LAYERS),
                   help="conv weight shapes OUTxINxKHxKW, comma-separated (default: "
                        f"{','.join(benchmark.DEFAULT_LAYERS)})")
    p.add_argument("--methods", default=",".join(spec.METHODS),
                   help=f"comma-separated, from: {', '.join(spec.METHODS)} (default: all)")
    p.add_argument("--precision", default="fp32",
                   help=f"one of {', '.join(spec.DTYPES)} (default fp32)")
    p.add_argument("--block-rows", type=int, default=benchmark.DEFAULT_BLOCK_ROWS,
                   help=f"rows per torch.cdist block (default {benchmark.DEFAULT_BLOCK_ROWS})")
    p.add_argument("--loop-max-kernels", type=int, default=benchmark.DEFAULT_LOOP_MAX_KERNELS,
                   help="largest kernel count the Python loop runs at; above it the loop is "
                        f"skipped (default {benchmark.DEFAULT_LOOP_MAX_KERNELS})")
    p.add_argument("--launches", type=int, default=benchmark.MEASUREMENT.launches,
                   help="fresh launches per case, in rounds (default "
                        f"{benchmark.MEASUREMENT.launches})")
    p.add_argument("--max-memory-per-device", type=memory_mib, metavar="SIZE",
                   dest="max_memory_per_device_mib",
                   help="memory cap per device, e.g. 1GiB: a case above it is an oom "
                        f"(default on a cpu rig {benchmark.DEFAULT_CPU_CAP_MIB:.0f}MiB of resident "
                        "memory beyond the runtime; on GPUs none)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights (default 0)")
    add_math_mode(p, "the fp32 cases")
    add_out(p, "distance")
    p.add_argument("--dry-run", action="store_true",
                   help="list the cases (layer x method) and what will happen to each; run "
                        "nothing, write nothing")
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    """The ``distance`` subcommand: its flags as a ``DistancePlan``, measured
    (``distance.benchmark``) or, with ``--dry-run``, listed."""
    from bench_lib.distance import benchmark

    rig = rig_of(args, plan_only=args.dry_run)
    plan = plan_of(args, rig)
    return dry_run(plan, rig) if args.dry_run else benchmark.run_distance(plan, rig, args.out)


def plan_of(args: argparse.Namespace, rig: Rig) -> DistancePlan:
    """The validated plan of the flags on ``rig`` (UsageError: exit 2, nothing written)."""
    from bench_lib.distance.benchmark import measurement_of
    from bench_lib.distance.plan import DistancePlan
    from bench_lib.distance.spec import Layer

    measurement = measurement_of(args.launches, args.max_memory_per_device_mib,
                                 args.math_mode, rig)
    return DistancePlan(tuple(Layer.parse(t) for t in str_list(args.layers)),
                        str_list(args.methods), args.precision, args.block_rows,
                        args.loop_max_kernels, args.seed, measurement)


def dry_run(plan: DistancePlan, rig: Rig) -> int:
    """The plan of ``distance``: each case, its devices and processes, run or why not."""
    cases = plan.cases(rig)
    width = max(len(c.case_id) for c in cases)
    print(f"{'case':<{width}}  devices  processes  will")
    for c in cases:
        will = f"{c.status}: {c.reason}" if c.status else "run"
        print(f"{c.case_id:<{width}}  {c.world_size:>7}  {c.processes:>9}  {will}")
    runs = sum(1 for c in cases if not c.status)
    print(f"{len(cases)} cases ({runs} to run, {plan.measurement.launches} launches each) on "
          f"rig {rig.label}; nothing run")
    return EXIT_OK
