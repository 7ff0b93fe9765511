"""How much do today's pipeline schedules gain over ``single``, and what bounds the gain?

    .venv/bin/python benchmarks/modern_speedup.py [--split-sizes 4,8] [--timed-steps 5]

First it profiles every block's forward+backward on one cpu worker, on the whole batch and
at each split size, and prints the per-stage times of the balanced and tutorial 2-stage cuts
with the speedup they allow 1F1B: single time / ((micro-batches + 1) x slowest stage), which
counts both the bubble and what small micro-batches cost per image. Then it runs a real
sweep (fresh processes per case, like ``make bench``) of ``single``, ``accum`` and the
pipelining schedules on both cuts, and prints each case's throughput relative to ``single``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib import commands, exit_codes  # noqa: E402
from bench_lib.pinning import pin_worker  # noqa: E402
from bench_lib.results.read import read_cases, run_dirs_in  # noqa: E402
from bench_lib.rig_detection import detect_rig  # noqa: E402
from bench_lib.strategies.partition import Partition, block_costs, choose  # noqa: E402
from bench_lib.workloads import Workload, default_cuts  # noqa: E402

STRATEGIES = "single,accum,gpipe,1f1b,interleaved-1f1b"


def _stage_lines(p: Partition, batch: int, split: int, single_s: float) -> str:
    """One cut's per-stage times and what they allow a 2-stage 1F1B pipeline."""
    stages = p.stage_costs()
    ms = " + ".join(f"{t * 1e3:.0f}" for t in stages)
    m = batch // split
    # 1F1B on 2 stages: m + 1 slots of the slowest stage's forward+backward (one bubble).
    bound = single_s / ((m + 1) * max(stages))
    return f"  {p.label:<14} stages {ms} ms per micro-batch -> 1F1B bound {bound:.2f}x single"


def stage_times(model_name: str, image: int, batch: int, splits: list[int]) -> list[str]:
    """Per-stage forward+backward times of the balanced and tutorial 2-stage cuts, and the
    1F1B speedup they allow against the blocks' time on the whole batch (``single``)."""
    import torch

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_worker(detect_rig("cpu"), 0)  # one worker's cores and threads, as a stage gets
    torch.manual_seed(0)
    workload = Workload(model_name, image, batch)
    model = workload.build_model()
    cpu = torch.device("cpu")
    single_s = sum(block_costs(model, workload, batch, cpu, "time"))
    lines = [f"single: blocks' forward+backward on the whole batch {single_s:.3f} s"]
    for split in splits:
        balanced = choose("balanced", model, 2, workload, split, cpu)
        tutorial = Partition("tutorial", tuple(default_cuts(model, 2)), balanced.block_costs)
        per_img = sum(balanced.block_costs) * batch / split / single_s
        lines.append(f"split {split} ({batch // split} micro-batches; micro-batching costs "
                     f"{per_img:.2f}x per image):")
        lines += [_stage_lines(p, batch, split, single_s) for p in (balanced, tutorial)]
    # Unpin: the sweep detects its rig from this process's cores.
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    return lines


def run_sweep(args: argparse.Namespace) -> Path:
    """Run the sweep through the CLI into a fresh folder; returns the run folder."""
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="modern-speedup-", dir=args.out))
    argv = ["run", "--profile", "smoke", "--strategies", args.strategies,
            "--models", args.model, "--image-sizes", str(args.image_size),
            "--batch-sizes", str(args.batch_size), "--split-sizes", args.split_sizes,
            "--partitions", args.partitions, "--warmup-steps", "2",
            "--timed-steps", str(args.timed_steps), "--case-timeout-s", "900",
            "--out", str(out)]
    code = commands.main(argv)
    runs = run_dirs_in(out)
    if code == exit_codes.EXIT_USAGE or len(runs) != 1:
        raise SystemExit(code or 2)
    return runs[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, default=32)
    p.add_argument("--split-sizes", default="4,8")
    p.add_argument("--strategies", default=STRATEGIES)
    p.add_argument("--partitions", default="tutorial,balanced")
    p.add_argument("--timed-steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args()
    splits = [int(s) for s in args.split_sizes.split(",")]
    print("\n".join(stage_times(args.model, args.image_size, args.batch_size, splits)))
    df = read_cases(run_sweep(args))
    ok = df[df["status"] == "ok"]
    single = ok[ok["strategy"] == "single"]["throughput_img_s"]
    base = float(single.iloc[0]) if len(single) else float("nan")
    print(f"\n{'case':<52} {'partition':<14} {'img/s':>7} {'x single':>8}")
    for _, r in df.iterrows():
        if r["status"] != "ok":
            print(f"{r['case_id']:<52} {r['status']}: {str(r['reason'])[:60]}")
            continue
        part = "" if str(r["partition"]) == "nan" else r["partition"]
        print(f"{r['case_id']:<52} {part:<14} {r['throughput_img_s']:>7.2f} "
              f"{r['throughput_img_s'] / base:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
