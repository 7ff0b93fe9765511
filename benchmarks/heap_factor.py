"""Live tensors against resident memory for one pipeline stage's step on a cpu worker.

The memory prediction (``bench_lib/prediction/memory.py``) counts live tensor bytes on fake
tensors and scales them by one heap factor (``CPU_HEAP_FACTOR``) on a cpu rig. This replays
one stage of ResNet50 on REAL tensors in the order a schedule runs it and prints both
figures, so that the count can be checked (live tensors, by ``LiveBytes``, the counter the
prediction uses) and the heap's share seen (resident peak from ``VmHWM``, net of the
footprint before the model was built):

    python benchmarks/heap_factor.py --order gpipe --stage 0 --cut 11 --image-size 128 \\
        --microbatch 2 --count 8

``--order single``: one forward and backward of ``microbatch x count`` images through the
stage; ``gpipe``: every micro-batch's forward, then every backward; ``1f1b-last``: forward
and backward of each micro-batch in turn (1F1B on the last stage). ``--cut`` is the block
index a ``balanced:N`` partition column records. One process, one thread; about a minute.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_lib.measure.memory import current_rss_mib, proc_status_mib, reset_rss_peak
from bench_lib.prediction.fake_step import LiveBytes
from bench_lib.workloads import Workload, split_stages

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--order", choices=("single", "gpipe", "1f1b-last"), default="gpipe")
    p.add_argument("--stage", type=int, choices=(0, 1), default=0)
    p.add_argument("--cut", type=int, default=11, help="block index of the stage cut")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=2, help="images per micro-batch")
    p.add_argument("--count", type=int, default=8, help="micro-batches per step")
    a = p.parse_args(argv)
    if a.microbatch < 1 or a.count < 1:
        p.error("--microbatch and --count must be positive")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = current_rss_mib()
    work = Workload("resnet50", a.image_size, a.microbatch * a.count)
    stages = split_stages(work.build_model(), [a.cut])
    stage = stages[a.stage]
    first = stages[0]
    params = list(stage.parameters())
    opt = torch.optim.SGD(params, lr=0.001)
    loss_fn = work.loss_fn()
    size = a.microbatch * a.count if a.order == "single" else a.microbatch
    count = 1 if a.order == "single" else a.count
    with torch.no_grad():
        x, y = work.make_batch(size, torch.device("cpu"))
        inp = first(x) if a.stage == 1 else x
    del stages, first

    def finish(out: torch.Tensor) -> None:
        if a.stage == 1:
            (loss_fn(out, y) / count).backward()
        else:
            out.backward(torch.ones_like(out))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        outs = []
        for _ in range(count):
            out = stage(inp.clone().requires_grad_(a.stage == 1))
            if a.order == "1f1b-last":
                finish(out)
            else:
                outs.append(out)
        for out in outs:
            finish(out)
        outs.clear()
        opt.step()

    for i in range(2):
        print(f"warm-up step {i + 1}/2", file=sys.stderr)
        step()
    reset_rss_peak()
    step()
    step()
    resident = proc_status_mib("VmHWM") - base
    live = LiveBytes(params)
    for t in (*params, inp, y):
        live.hold(t)
    with live:
        step()
    tensors = live.peak / MIB
    print(f"{a.order} stage {a.stage} cut {a.cut} at {a.image_size} px, {count} x {size} "
          f"images: live tensors {tensors:.1f} MiB, resident {resident:.1f} MiB net, "
          f"ratio {resident / tensors:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
