"""``merge``: the shards of one sweep (``run --shard K/N``) joined into one run folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_lib.exit_codes import EXIT_OK

HELP = "join the shards of one sweep (run --shard K/N) into one run folder"
EXAMPLES = """\
  python -m bench_lib merge results/shards"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="the shards' run folders, or folders holding them (run --out)")
    p.add_argument("--out", type=Path, default=Path("results"), metavar="DIR",
                   help="folder that receives the merged run folder, "
                        "<UTC time>_<host>_<git sha7>_merge-<profile> (default: results)")
    p.add_argument("--allow-partial", action="store_true",
                   help="merge even with shards or cases missing (env.json names them)")


def command(args: argparse.Namespace) -> int:
    from bench_lib.measure import environment
    from bench_lib.run.merge import merge

    print(merge(args.run_dirs, args.out, allow_partial=args.allow_partial,
                sha=environment.git_info()["sha"]))
    return EXIT_OK
