"""pytest-benchmark modules: one training step of each in-process strategy.

For people who already gate on pytest-benchmark (not collected by ``make test``)::

    pytest benchmarks/test_train_step.py --benchmark-autosave            # record a baseline
    pytest benchmarks/test_train_step.py --benchmark-compare \\
        --benchmark-compare-fail=median:10%                               # fail when 10% slower

Multi-process strategies (``ddp``) cannot be timed inside one pytest process; the suite's own
gate (``python -m bench_lib compare``) covers them. The workload is the ci profile's
(ResNet50, 64 px, batch 16, split 4); PARABENCH_BENCH_MODEL, _IMAGE, _BATCH and _SPLIT change it.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench_lib import strategies
from bench_lib.pinning import pin_worker
from bench_lib.rig import synchronize
from bench_lib.rig_detection import detect_rig
from bench_lib.strategies import BuildContext, Microbatching
from bench_lib.workloads import Workload

MODEL = os.environ.get("PARABENCH_BENCH_MODEL", "resnet50")
IMAGE = int(os.environ.get("PARABENCH_BENCH_IMAGE", "64"))
BATCH = int(os.environ.get("PARABENCH_BENCH_BATCH", "16"))
SPLIT = int(os.environ.get("PARABENCH_BENCH_SPLIT", "4"))
IN_PROCESS = sorted(n for n, s in strategies.REGISTRY.items() if not s.per_device_processes)


@pytest.fixture
def pinned_rig():
    """The detected rig, this process pinned as one case's worker would be (undone after)."""
    rig = detect_rig()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    yield rig
    if affinity is not None:
        os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_train_step(benchmark, pinned_rig, name):
    """Median time of one full training step (forward, loss, backward, optimizer step)."""
    spec = strategies.get(name)
    reason = spec.unsupported_reason(pinned_rig)
    if reason:
        pytest.skip(reason)
    n = spec.num_devices(pinned_rig)
    pin_worker(pinned_rig, 0)  # one worker's cores, as a case is pinned
    torch.manual_seed(0)
    workload = Workload(MODEL, IMAGE, BATCH)
    ctx = BuildContext(workload, Microbatching.of(BATCH, SPLIT) if spec.uses_split else None)
    trainer = spec.build(workload.build_model(), pinned_rig.devices(n), ctx)
    x, y = workload.make_batch(trainer.local_batch_size, trainer.input_device, seed=0)
    y = y.to(trainer.output_device)
    benchmark.extra_info.update(model=MODEL, image_size=IMAGE, batch_size=BATCH,
                                split_size=SPLIT if ctx.micro else None,
                                rig=pinned_rig.label)

    def step() -> None:
        trainer.step(x, y)
        synchronize(trainer.devices)  # the clock must see finished work, not queued work

    benchmark.pedantic(step, rounds=10, warmup_rounds=2, iterations=1)
    assert all(p.grad is not None for p in trainer.parameters_in_order())
