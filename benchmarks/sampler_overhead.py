"""Does the sampler disturb what it measures? Paired, interleaved blocks of training steps
with the sampler on and off, in one process tree: the runner-like parent samples a pinned
worker child that trains, exactly as ``bench_lib.run.case_launch`` does for a case.

    .venv/bin/python benchmarks/sampler_overhead.py [--pairs 12] [--interval-ms 100]

Each pair runs one block with the sampler on and one with it off, in alternating order
(on-off, off-on, ...) so that drift in the machine's load cancels; the figure is the median
of the pairs' relative differences of median step time, with its bootstrap 95% CI.
It also prints the sampler's own CPU cost (this process's CPU time while sampling, its
only work then): an upper bound on what it can take from the workers on a CPU rig.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.analysis.stats import Stats  # noqa: E402
from bench_lib.launch.sampling import case_sampler  # noqa: E402
from bench_lib.rig_detection import detect_rig  # noqa: E402
from bench_lib.sweep.cases import new_case  # noqa: E402
from bench_lib.sweep.profile import Measurement  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """Child: train on device 0 of the rig; time ``N`` steps per line read from stdin."""
    import torch

    from bench_lib import strategies
    from bench_lib.measure.timing import time_steps
    from bench_lib.pinning import pin_worker
    from bench_lib.strategies import BuildContext
    from bench_lib.workloads import Workload

    rig = detect_rig(args.rig)
    pin_worker(rig, 0)
    torch.manual_seed(0)
    workload = Workload(args.model, args.image_size, args.batch_size)
    trainer = strategies.get("single").build(workload.build_model(), [rig.device(0)],
                                             BuildContext(workload))
    x, y = workload.make_batch(args.batch_size, trainer.input_device)
    y = y.to(trainer.output_device)
    step = lambda: trainer.step(x, y)  # noqa: E731
    time_steps(step, trainer.devices, warmup_steps=3, timed_steps=0)
    for line in sys.stdin:
        times = time_steps(step, trainer.devices, warmup_steps=0, timed_steps=int(line))
        print(json.dumps(times), flush=True)


def block(child: subprocess.Popen, steps: int) -> float:
    """Median step time of one block of ``steps`` steps in the child."""
    child.stdin.write(f"{steps}\n")
    child.stdin.flush()
    return statistics.median(json.loads(child.stdout.readline()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--interval-ms", type=float, default=100.0)
    p.add_argument("--model", default="resnet-tiny")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, default=16)
    p.add_argument("--rig", choices=("cpu", "cuda"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.pairs < 2 or args.steps_per_block < 1 or args.interval_ms <= 0:
        print("error: need --pairs >= 2, --steps-per-block >= 1, --interval-ms > 0",
              file=sys.stderr)
        return 2

    rig = detect_rig(args.rig)
    case = new_case(rig, "single", args.model, args.image_size, args.batch_size,
                    measurement=Measurement(sample_interval_ms=args.interval_ms))
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--image-size",
           str(args.image_size), "--batch-sizes", str(args.batch_size), "--rig", rig.kind]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    diffs, samples, cpu_s, wall_s = [], 0, 0.0, 0.0
    try:
        for i in range(args.pairs):
            result = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                if on:
                    cpu0, wall0 = time.process_time(), time.monotonic()
                    with case_sampler(case, rig, [child.pid]) as sampler:
                        result[on] = block(child, args.steps_per_block)
                    cpu_s += time.process_time() - cpu0
                    wall_s += time.monotonic() - wall0
                    samples += len(sampler.samples)
                else:
                    result[on] = block(child, args.steps_per_block)
            diffs.append(100 * (result[True] - result[False]) / result[False])
    finally:
        child.stdin.close()
        child.wait()
    s = Stats.of(diffs)
    verdict = "under 1%" if -1 < s.ci_low and s.ci_high < 1 else "NOT shown under 1%"
    print(f"rig {rig.label}, {args.model} {args.image_size}px batch {args.batch_size}, "
          f"{args.pairs} pairs x {args.steps_per_block} steps, sampler every "
          f"{args.interval_ms:g} ms ({samples} samples taken)")
    print(f"step time with sampler vs without: median {s.median:+.2f}% "
          f"(95% CI {s.ci_low:+.2f}% .. {s.ci_high:+.2f}%; pairs' IQR {s.iqr:.2f} points): "
          f"{verdict}")
    print(f"sampler's own CPU time: {1000 * cpu_s / wall_s:.1f} ms per second sampled "
          f"({100 * cpu_s / wall_s:.2f}% of one core)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
