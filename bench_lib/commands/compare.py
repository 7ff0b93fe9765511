"""``compare``: gate a candidate run folder against a baseline (bench_lib.compare): its
flags, and the ``ComparePlan`` they make (``compare.output.run_compare`` does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "gate a candidate run against a baseline (exit 1 on a regression)"
EXAMPLES = """\
  python -m bench_lib compare results/baseline results/RUN_DIR
  python -m bench_lib compare BASE_RUN HEAD_RUN --threshold-pct 5 --markdown compare.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``compare`` subcommand's arguments."""
    from bench_lib.compare.verdicts import DEFAULT_THRESHOLD_PCT, METRICS

    p.add_argument("baseline", type=Path,
                   help="run folder, its cases.csv, or a baseline store (results/baseline)")
    p.add_argument("candidate", type=Path, help="run folder or its cases.csv")
    p.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                   help=f"smallest change in percent that counts (default "
                        f"{DEFAULT_THRESHOLD_PCT:g})")
    p.add_argument("--metric", choices=METRICS, default="auto",
                   help="what decides a verdict: auto (step_time for single, speedup for the "
                        "others), step_time, or speedup")
    p.add_argument("--allow-different-hardware", action="store_true",
                   help="compare runs whose hardware fingerprints differ")
    p.add_argument("--markdown", type=Path, help="write Markdown for a pull-request comment here")
    p.add_argument("--json", type=Path,
                   help="write github-action-benchmark customBiggerIsBetter JSON here")


def command(args: argparse.Namespace) -> int:
    """The ``compare`` subcommand: its flags as a ``ComparePlan``, run."""
    from bench_lib.compare.output import run_compare
    from bench_lib.compare.plan import ComparePlan

    return run_compare(ComparePlan(args.baseline, args.candidate,
                                   threshold_pct=args.threshold_pct, metric=args.metric,
                                   allow_different_hardware=args.allow_different_hardware,
                                   markdown=args.markdown, json_path=args.json))
