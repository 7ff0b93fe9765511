"""Where should a gate's two sides run? An A/A test of three placements on this machine.

    python benchmarks/duet_aa.py [--rounds 12] [--steps 6] [--json FILE]

Two processes of the same code (ResNet50 at 64 px, batch 16, one thread, 2 warm-up steps
and ``--steps`` timed ones each, a launch's median), in each round in three placements:

* **one after the other** on one core, as a gate's sides ran before they took turns;
* **at the same time on cores 0 and 1** (duet benchmarking, Bulej et al.: the cores
  swapped every round), which narrows a comparison only where the two cores' speeds move
  together;
* **taking turns on one core**, step by step in the order A B B A A B B A ...
  (``bench_lib.turns``, what ``gate`` does): each pair of steps meets the core in
  the same second.

All three are A/A: the spread over rounds of their log ratio (of the launch medians; for
turns also the median of the step pairs' log ratios, the gate's figure) is what a gate's
per-round ratio would spread by. Runs alone: never beside other work.
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
from bench_lib.turns import owner

WARMUP = 2
WORKER = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import torch, torchvision
torch.set_num_threads(1)
torch.manual_seed(0)
model = torchvision.models.resnet50(num_classes=10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
print("ready", flush=True)
for line in sys.stdin:  # one step a line, its seconds back
    t = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    print(time.perf_counter() - t, flush=True)
"""


class Worker:
    """A process pinned to ``core`` that takes a step when told and says its seconds."""

    def __init__(self, core: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(core)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if self.stdout.readline().strip() != "ready":
            raise SystemExit("error: a worker did not start")

    def ask(self) -> None:
        self.stdin.write("step\n")
        self.stdin.flush()

    def answer(self) -> float:
        return float(self.stdout.readline())

    def step(self) -> float:
        self.ask()
        return self.answer()

    def close(self) -> None:
        self.stdin.close()
        if self.proc.wait() != 0:
            raise SystemExit(f"error: a worker exited with {self.proc.returncode}")


def alone(core: int, steps: int) -> list[float]:
    w = Worker(core)
    times = [w.step() for _ in range(WARMUP + steps)][WARMUP:]
    w.close()
    return times


def at_once(cores: tuple[int, int], steps: int) -> tuple[list[float], list[float]]:
    a, b = Worker(cores[0]), Worker(cores[1])
    ta, tb = [], []
    for _ in range(WARMUP + steps):
        a.ask()
        b.ask()
        ta.append(a.answer())
        tb.append(b.answer())
    a.close()
    b.close()
    return ta[WARMUP:], tb[WARMUP:]


def in_turns(core: int, steps: int) -> tuple[list[float], list[float]]:
    a, b = Worker(core), Worker(core)
    times: dict[str, list[float]] = {"base": [], "head": []}
    for turn in range(2 * (WARMUP + steps)):
        side = owner(turn)
        times[side].append((a if side == "base" else b).step())
    a.close()
    b.close()
    return times["base"][WARMUP:], times["head"][WARMUP:]


def log_ratio(a: list[float], b: list[float]) -> float:
    return 100 * math.log(statistics.median(b) / statistics.median(a))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6, help="timed steps a launch")
    parser.add_argument("--json", type=Path, help="write every round's steps here")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or args.rounds < 2 or args.steps < 1:
        print("error: needs two cores, at least 2 rounds and 1 step", file=sys.stderr)
        return 2
    rounds = []
    for r in range(args.rounds):
        pair = (cores[0], cores[1]) if r % 2 == 0 else (cores[1], cores[0])
        one_core = pair[0]
        record = {"round": r + 1,
                  "sequential_s": (alone(one_core, args.steps), alone(one_core, args.steps)),
                  "duet_s": at_once(pair, args.steps),
                  "turns_s": in_turns(one_core, args.steps)}
        rounds.append(record)
        said = ", ".join(f"{k[:-2]} {log_ratio(*record[k]):+.1f}%"
                         for k in ("sequential_s", "duet_s", "turns_s"))
        print(f"round {r + 1}/{args.rounds}: A/A log ratios {said}", file=sys.stderr,
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2) + "\n")
    print(f"{args.rounds} rounds of {args.steps} timed steps on {cpu_model()}; spread (SD) "
          "of the rounds' A/A log ratios:")
    figures = {
        "one after the other, one core": [log_ratio(*x["sequential_s"]) for x in rounds],
        "at the same time, two cores (duet)": [log_ratio(*x["duet_s"]) for x in rounds],
        "taking turns, one core (medians)": [log_ratio(*x["turns_s"]) for x in rounds],
        "taking turns, one core (median of the step pairs: the gate's)": [
            100 * statistics.median(math.log(h / b) for b, h in zip(*x["turns_s"]))
            for x in rounds],
    }
    for label, values in figures.items():
        print(f"  {label}: {statistics.stdev(values):.1f}% "
              f"(mean {statistics.mean(values):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
