"""``parity``: every strategy trained on real data from the same weights (bench_lib.parity):
its flags, and the ``ParityPlan`` they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from bench_lib.commands.common import add_math_mode, add_out, add_rig_args, rig_of, str_list
from bench_lib.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from bench_lib.parity.plan import ParityPlan
    from bench_lib.rig import Rig

HELP = ("train every strategy on real data from the same weights; exit 1 when one learns "
        "differently from single")
EXAMPLES = """\
  python -m bench_lib parity --dry-run
  python -m bench_lib parity --models mlp --strategies single,ddp,pipeline --epochs 3"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.parity import check

    p.add_argument("--models", default=",".join(check.DEFAULT_MODELS),
                   help=f"comma-separated (default: {','.join(check.DEFAULT_MODELS)})")
    p.add_argument("--strategies", default=",".join(check.DEFAULT_STRATEGIES),
                   help="comma-separated, with single (default: "
                        f"{','.join(check.DEFAULT_STRATEGIES)})")
    p.add_argument("--epochs", type=int, default=check.DEFAULTS["epochs"],
                   help=f"training epochs (default {check.DEFAULTS['epochs']})")
    p.add_argument("--batch-size", type=int, default=32,
                   help="the global batch size, one (default 32)")
    p.add_argument("--split-size", type=int, default=8,
                   help="the micro-batch size of the strategies that split the batch, one "
                        "(default 8)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the split and the shuffles (default 0)")
    p.add_argument("--seed-runs", type=int, default=check.DEFAULTS["seed_runs"], metavar="K",
                   help="further seeds single trains at on a BatchNorm model, for its looser "
                        f"tolerance (default {check.DEFAULTS['seed_runs']})")
    p.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm in ddp and fsdp (GPU rigs only; on a cpu rig they "
                        "are then recorded unsupported)")
    p.add_argument("--data-root", type=Path, metavar="DIR",
                   help="train on your MNIST (mlp) or CIFAR-10 (ResNets) in torchvision's "
                        "format under DIR (DIR/MNIST/raw/..., DIR/cifar-10-batches-py/); "
                        "nothing is downloaded (default: scikit-learn's digits)")
    add_math_mode(p, "every float32 training run")
    add_out(p, "parity")
    p.add_argument("--dry-run", action="store_true",
                   help="list each model's training runs and the strategies this rig cannot "
                        "run, with why; train nothing, write nothing")
    add_rig_args(p)


def command(args: argparse.Namespace) -> int:
    """The ``parity`` subcommand: its flags as a ``ParityPlan``, trained (``parity.check``)
    or, with ``--dry-run``, listed."""
    from bench_lib.parity import check

    rig = rig_of(args, plan_only=args.dry_run)
    plan = plan_of(args)
    return dry_run(plan, rig) if args.dry_run else check.run_parity(plan, rig, args.out)


def plan_of(args: argparse.Namespace) -> ParityPlan:
    """The validated plan of the flags (UsageError: exit 2, nothing written)."""
    from bench_lib.parity.plan import ParityPlan
    from bench_lib.sweep.profile import UsageError

    try:
        return ParityPlan(str_list(args.models), str_list(args.strategies), args.epochs,
                          args.batch_size, args.split_size, args.lr, args.seed, args.seed_runs,
                          args.sync_bn, args.data_root, args.math_mode)
    except ValueError as e:  # strategies.get's too, naming the known ones
        raise UsageError(str(e)) from None


def dry_run(plan: ParityPlan, rig: Rig) -> int:
    """The plan of ``parity``: per model its runs (single in float64 and float32, its
    further seeds on a BatchNorm model, every other strategy) and the unsupported ones."""
    from bench_lib.parity import check

    total = 0
    print(f"{'model':<12}  {'run':<28}  processes  will")
    for model in plan.models:
        cases, runs = check.model_runs(plan, rig, model)
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
