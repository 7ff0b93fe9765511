"""``compare``: gate a candidate run folder against a baseline (compare.output does the work)."""

from __future__ import annotations

import argparse

HELP = "gate a candidate run against a baseline (exit 1 on a regression)"
EXAMPLES = """\
  python -m bench_lib compare results/baseline results/RUN_DIR
  python -m bench_lib compare BASE_RUN HEAD_RUN --threshold-pct 5 --markdown compare.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.compare import output

    output.add_arguments(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.compare import output

    return output.command(args)
