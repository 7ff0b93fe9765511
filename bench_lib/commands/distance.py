"""``distance``: the pairwise distance of a conv weight's kernels (bench_lib.distance)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import EXIT_OK, add_rig_args, gpu_slots
from bench_lib.rig import Rig, detect_rig

HELP = ("time the pairwise distance of a conv weight's kernels (a loop, blocked cdist, split "
        "over devices); exit 1 when one disagrees")
EXAMPLES = """\
  python -m bench_lib distance --dry-run
  python -m bench_lib distance --layers 512x512x3x3 --methods blocked,split --launches 1"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.distance import run

    run.add_arguments(p)
    p.add_argument("--dry-run", action="store_true",
                   help="list the cases (layer x method) and what will happen to each; run "
                        "nothing, write nothing")
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.distance import run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, plan_only=args.dry_run,
                     gpu_slots=gpu_slots(args))
    return dry_run(args, rig) if args.dry_run else run.command(args, rig)


def dry_run(args: argparse.Namespace, rig: Rig) -> int:
    """The plan of ``distance``: each case, its devices and processes, run or why not."""
    from bench_lib.distance import run

    plan = run.plan_of(args, rig)
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
