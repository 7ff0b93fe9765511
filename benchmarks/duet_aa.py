"""Would duet benchmarking narrow a gate on this machine? An A/A test of it.

    python benchmarks/duet_aa.py [--rounds 12] [--json FILE]

Duet benchmarking (Bulej et al., "Duet benchmarking") runs base and head at the same moment
on disjoint halves of the machine, so that both meet the same neighbour; it narrows a
comparison only where the halves' speeds move together. This measures that here, on a cpu
rig's first two cores: two processes of the same code (ResNet50 at 64 px, batch 16, one
thread, pinned to one core each, 2 warm-up and 6 timed steps, a launch's median), in each
round once **at the same time** on cores 0 and 1 (the cores swapped every round) and once
**one after the other** on one core, as a gate runs them. Both pairs are A/A: their log
ratio's spread over rounds is what a gate's per-round ratio would spread by, with duet and
without it. Runs alone: never beside other work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_lib.measure.environment import cpu_model

WORKER = r"""
import os, statistics, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import torch, torchvision
torch.set_num_threads(1)
torch.manual_seed(0)
model = torchvision.models.resnet50(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
times = []
for _ in range(8):
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - t)
print(statistics.median(times[2:]))
"""


def start(core: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WORKER, str(core)], stdout=subprocess.PIPE,
                            text=True)


def median_of(proc: subprocess.Popen[str]) -> float:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"error: a worker exited with {proc.returncode}")
    return float(out.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", type=Path, help="write every round's medians here")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or args.rounds < 2:
        print("error: needs two cores and at least 2 rounds", file=sys.stderr)
        return 2
    rounds = []
    for r in range(args.rounds):
        a, b = (cores[0], cores[1]) if r % 2 == 0 else (cores[1], cores[0])
        first, second = start(a), start(b)  # duet: at the same time, on disjoint cores
        duet = (median_of(first), median_of(second))
        alone = (median_of(start(a)), median_of(start(a)))  # one after the other
        rounds.append({"round": r + 1, "duet_s": duet, "sequential_s": alone})
        print(f"round {r + 1}/{args.rounds}: duet {duet[0]:.3f} {duet[1]:.3f} s, one after "
              f"the other {alone[0]:.3f} {alone[1]:.3f} s", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2) + "\n")
    print(f"{args.rounds} rounds on {cpu_model()}; spread (SD) of the rounds' A/A log ratios:")
    for key, label in (("duet_s", "at the same time (duet)"),
                       ("sequential_s", "one after the other")):
        ratios = [100 * math.log(x[key][1] / x[key][0]) for x in rounds]
        print(f"  {label}: {statistics.stdev(ratios):.1f}% (mean {statistics.mean(ratios):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
