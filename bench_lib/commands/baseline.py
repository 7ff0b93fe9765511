"""``baseline``: store a run folder as its hardware's baseline."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_lib.exit_codes import EXIT_OK

HELP = "store a run folder as its hardware's baseline (for compare)"
EXAMPLES = """\
  python -m bench_lib baseline results/RUN_DIR
  python -m bench_lib baseline results/RUN_DIR --store ci/baselines"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--store", type=Path, default=Path("results/baseline"),
                   help="baseline store (default: results/baseline)")


def command(args: argparse.Namespace) -> int:
    from bench_lib.compare.baseline import save_baseline
    from bench_lib.compare.runs import CompareError
    from bench_lib.sweep.profile import UsageError

    try:
        print(save_baseline(args.run_dir, args.store))
    except CompareError as e:
        raise UsageError(str(e)) from None
    return EXIT_OK
