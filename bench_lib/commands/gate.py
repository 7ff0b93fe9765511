"""``gate``: a base commit and the working tree measured in one job (bench_lib.gate): its
flags, and the ``GatePlan`` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = ("measure a base commit and the head (the working tree) in this job, interleaved in "
        "rounds, and gate the head (exit 1 on a regression)")
EXAMPLES = """\
  python -m bench_lib gate --base origin/main            # this working tree against main
  python -m bench_lib gate --base HEAD~1 --rounds 3 --markdown gate.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gate`` subcommand's arguments."""
    from bench_lib.gate.plan import (
        DEFAULT_OUT,
        DEFAULT_PROFILE,
        DEFAULT_ROUNDS,
        DEFAULT_THRESHOLD_PCT,
        METRICS,
        MIN_ROUNDS,
    )

    p.add_argument("--base", required=True, metavar="REF",
                   help="the commit to compare against (a branch, tag, sha, HEAD~1, ...)")
    p.add_argument("--head", metavar="REF",
                   help="the commit to judge (default: the working tree as it is now, "
                        "uncommitted changes and untracked files included)")
    p.add_argument("--head-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set a variable on the head's side only (repeatable): with --base "
                        "equal to the head, an A/B of settings")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|PATH",
                   help=f"the sweep both sides run (default {DEFAULT_PROFILE})")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"rounds of base and head, one launch per case each (default "
                        f"{DEFAULT_ROUNDS}; at least {MIN_ROUNDS})")
    p.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                   help=f"smallest change in percent that counts (default "
                        f"{DEFAULT_THRESHOLD_PCT:g})")
    p.add_argument("--metric", choices=METRICS, default="step_time",
                   help="what decides a verdict: step_time (default), speedup (time over "
                        "single's in the same round), or auto (speedup except for single)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="folder that receives the gate folder (default: results/gates)")
    p.add_argument("--markdown", type=Path, help="write Markdown for a pull-request comment here")
    p.add_argument("--json", type=Path,
                   help="write github-action-benchmark customBiggerIsBetter JSON here")
    p.add_argument("--apart", action="store_true",
                   help="run base and head one after the other in each round (B H | H B "
                        "...), not at once taking turns step by step on the same devices "
                        "(the default where both sides can: a narrower interval; a side's "
                        "case then shares its devices' memory with the other side's)")
    p.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN FLAGS",
                   help="flags for each side's run after --, e.g. -- --image-sizes 96")


def command(args: argparse.Namespace) -> int:
    """The ``gate`` subcommand: its flags as a ``GatePlan``, run (``gate.job.run_gate``)."""
    from bench_lib.gate.job import run_gate
    from bench_lib.gate.plan import GatePlan

    return run_gate(GatePlan(base_ref=args.base, head_ref=args.head,
                             head_env=tuple(args.head_env), profile=args.profile,
                             rounds=args.rounds, threshold_pct=args.threshold_pct,
                             metric=args.metric, out=args.out, run_args=tuple(args.run_args),
                             markdown=args.markdown, json_path=args.json,
                             apart=args.apart))
