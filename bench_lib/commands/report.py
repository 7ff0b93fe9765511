"""``report``: figures and report.html from run folders."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_lib.exit_codes import EXIT_OK

HELP = "write figures and report.html into the first run folder"
EXAMPLES = """\
  python -m bench_lib report results/RUN_DIR
  python -m bench_lib report results/RUN_A results/RUN_B   # two runs side by side"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="run folder(s); several are compared side by side")


def command(args: argparse.Namespace) -> int:
    from bench_lib.report.build import write_report

    print(write_report(args.run_dirs))
    return EXIT_OK
