"""``tune``: race one workload's configurations and recommend one (bench_lib.tune)."""

from __future__ import annotations

import argparse

from bench_lib.commands.common import add_rig_args, add_sweep_args, sweep_flags
from bench_lib.commands.plan import plan_new

HELP = ("race one workload's configurations (successive halving) and recommend one, with its "
        "interval against single and the runner-up")
EXAMPLES = """\
  python -m bench_lib tune --image-sizes 64
  python -m bench_lib tune --image-sizes 96 --time-budget-s 120 --dry-run"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.tune import run

    p.set_defaults(sweep_flags=sweep_flags(add_sweep_args(p) + add_rig_args(p)))
    run.add_arguments(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.tune import run

    rig, profile, _ = plan_new(args)  # the same flags, profile and validation as run's
    return run.command(args, rig, profile)
