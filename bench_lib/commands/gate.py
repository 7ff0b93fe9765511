"""``gate``: a base commit and the working tree measured in one job (compare.same_job)."""

from __future__ import annotations

import argparse

HELP = ("measure a base commit and the head (the working tree) in this job, interleaved in "
        "rounds, and gate the head (exit 1 on a regression)")
EXAMPLES = """\
  python -m bench_lib gate --base origin/main            # this working tree against main
  python -m bench_lib gate --base HEAD~1 --rounds 3 --markdown gate.md"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench_lib.compare import same_job

    same_job.add_arguments(p)


def command(args: argparse.Namespace) -> int:
    from bench_lib.compare import same_job

    return same_job.command(args)
