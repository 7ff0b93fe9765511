"""``parity``: every strategy trained on real data from the same weights (bench_lib.parity)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import EXIT_OK, add_rig_args, gpu_slots
from bench_lib.rig import Rig, detect_rig

HELP = ("train every strategy on real data from the same weights; exit 1 when one learns "
        "differently from single")
EXAMPLES = """\
  python -m bench_lib parity --dry-run
  python -m bench_lib parity --models mlp --strategies single,ddp,pipeline --epochs 3"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.parity import run

    run.add_arguments(p)
    p.add_argument("--dry-run", action="store_true",
                   help="list each model's training runs and the strategies this rig cannot "
                        "run, with why; train nothing, write nothing")
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.parity import run

    rig = detect_rig(args.rig, args.devices, args.threads_per_worker, plan_only=args.dry_run,
                     gpu_slots=gpu_slots(args))
    return dry_run(args, rig) if args.dry_run else run.command(args, rig)


def dry_run(args: argparse.Namespace, rig: Rig) -> int:
    """The plan of ``parity``: per model its runs (single in float64 and float32, its
    further seeds on a BatchNorm model, every other strategy) and the unsupported ones."""
    from bench_lib.parity import run

    plan = run.plan_of(args)
    total = 0
    print(f"{'model':<12}  {'run':<28}  processes  will")
    for model in plan.models:
        cases, runs = run.model_runs(plan, rig, model)
        for r in runs:
            print(f"{model:<12}  {r.label:<28}  {r.case.processes:>9}  train")
        for case in cases:
            if case.status:
                print(f"{model:<12}  {case.strategy:<28}  {'-':>9}  {case.status}: "
                      f"{case.reason}")
        total += len(runs)
    data = plan.data_root or "scikit-learn's digits"
    print(f"{total} training runs of {plan.epochs} epochs on rig {rig.label} (batch "
          f"{plan.batch_size}, split {plan.split_size}, data: {data}); nothing run")
    return EXIT_OK
