"""``tune``: race one workload's configurations and recommend one (bench_lib.tune): its
flags, and the ``TunePlan`` they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from bench_lib.commands.common import add_out, add_rig_args, add_sweep_args, sweep_flags
from bench_lib.commands.plan import plan_new

if TYPE_CHECKING:
    from bench_lib.tune.plan import TunePlan

HELP = ("race one workload's configurations (successive halving) and recommend one, with its "
        "interval against single and the runner-up")
EXAMPLES = """\
  python -m bench_lib tune --image-sizes 64
  python -m bench_lib tune --image-sizes 96 --time-budget-s 120 --dry-run"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.tune import search

    p.set_defaults(sweep_flags=sweep_flags(add_sweep_args(p) + add_rig_args(p)))
    g = p.add_argument_group("tune")
    add_out(g, "tune-<profile>")
    g.add_argument("--dry-run", action="store_true",
                   help="print the space and the plan; launch nothing")
    g.add_argument("--quiet", action="store_true", help="print only the run folder")
    g.add_argument("--budget-fraction", type=float, default=search.BUDGET_FRACTION, metavar="F",
                   help="launch time budget as a share of the exhaustive sweep's, predicted "
                        f"from rung 0's measured launches (default {search.BUDGET_FRACTION:g})")
    g.add_argument("--time-budget-s", type=float, metavar="SECONDS",
                   help="launch time budget in seconds (with --budget-fraction: the smaller)")
    g.add_argument("--max-rungs", type=int, default=search.MAX_RUNGS,
                   help=f"rungs at most, rung 0 included (default {search.MAX_RUNGS})")
    g.add_argument("--seed", type=int, default=0, help="seed of each rung's launch order")


def command(args: argparse.Namespace) -> int:
    """The ``tune`` subcommand: the rig and the profile as ``run`` resolves them, the
    rest of its flags as a ``TunePlan``, searched (``tune.search.run_tune``)."""
    from bench_lib.tune import search

    rig, profile, _ = plan_new(args)  # the same flags, profile and validation as run's
    return search.run_tune(plan_of(args), rig, profile)


def plan_of(args: argparse.Namespace) -> TunePlan:
    """The ``TunePlan`` of the flags (``UsageError`` on a bad limit: exit 2, nothing
    written)."""
    from bench_lib.tune.plan import TunePlan

    return TunePlan(out=args.out, budget_fraction=args.budget_fraction,
                    time_budget_s=args.time_budget_s, max_rungs=args.max_rungs,
                    seed=args.seed, quiet=args.quiet, dry_run=args.dry_run,
                    profile=args.profile_flag or "default",
                    measurement_flags=measurement_flags(args))


def measurement_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The measurement flags tune was given, to repeat in the reproducing command."""
    from bench_lib.sweep.profile import MEASUREMENT_KEYS

    out: list[str] = []
    for f in args.sweep_flags:
        value = getattr(args, f.dest)
        if f.dest in MEASUREMENT_KEYS and value is not None:
            out += [f.flag, str(value)] if f.takes_value else [f.flag]
    return tuple(out)
