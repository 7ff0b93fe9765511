"""Does ``tune`` find a configuration within 5% of the exhaustive sweep's best in at most a
third of its time? (issue #17 part 3)

    python benchmarks/tune_vs_sweep.py [--rounds N] [--out DIR] [-- WORKLOAD FLAGS...]

Exit 0 when every round met both goals, 1 otherwise.

Each round runs ``tune`` and the exhaustive sweep (``run``) of the same workload, in
alternating order, times each command whole and judges tune's pick on the sweep's own
numbers (``bench_lib.tune.versus``). Default workload: the default-cpu profile at 64 px
(~6.5 min of sweep and ~2 min of tune per round on 2 cores): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_lib.tune.versus import one_round, summary_lines

DEFAULT_FLAGS = ["--profile", "default", "--image-sizes", "64"]


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    mine, flags = (raw[:raw.index("--")], raw[raw.index("--") + 1:]) if "--" in raw \
        else (raw, DEFAULT_FLAGS)
    p = argparse.ArgumentParser(
        description="tune against the exhaustive sweep of the same workload, in one window")
    p.add_argument("--rounds", type=int, default=1, help="rounds, order alternating")
    p.add_argument("--out", type=Path, default=Path("results/tune_vs_sweep"),
                   help="folder for both commands' run folders, round<i>/tune and "
                        "round<i>/sweep (default: results/tune_vs_sweep)")
    args = p.parse_args(mine)
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(i, args.out, flags))
        print(summary_lines(rounds)[-2], flush=True)
    for line in summary_lines(rounds):
        print(line)
    return 0 if all(r.goals_met for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
