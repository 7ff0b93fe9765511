"""``tune``: race one workload's configurations and recommend one (bench_lib.tune)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import add_out, add_rig_args, add_sweep_args, sweep_flags
from bench_lib.commands.plan import plan_new

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
    from bench_lib.tune import search

    rig, profile, _ = plan_new(args)  # the same flags, profile and validation as run's
    return search.command(args, rig, profile)
