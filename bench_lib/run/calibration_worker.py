"""One process of a workload's calibration launch (``run.calibrate`` starts it).

    python -m bench_lib.run.calibration_worker SPEC_JSON RANK RUNNER_PID

Like a case's worker (``bench_lib.run.worker``): it asks to die with the runner before
importing torch, pins itself to its device's cores (a cpu rig), joins the launch's process
group (only for its barriers: no collective is timed), builds the workload's model as
``single`` trains it, and times (``measure.calibrate``):

1. rank 0 alone, the others waiting at a barrier: the optimizer step, and the training step
   at each "alone" batch size;
2. every rank at once: the training step at each "together" size, then each block's
   forward and backward at each "blocks" size; then each "copies" byte count copied into a
   freshly allocated buffer (fsdp's copy-in and copy-out); a barrier before each size, so
   the ranks compute side by side as a case's ranks do.

Writes ``calibration<RANK>.json`` (``run.calibrate.result_file``) and exits 0; on a failure
the traceback goes to its log, and it exits 1 without a file.
"""

from __future__ import annotations

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in run.worker)
import sys
import time
import traceback
from pathlib import Path

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 3))

import torch
import torch.distributed as dist

from bench_lib import strategies
from bench_lib.measure.calibrate import block_times, fresh_copy_s, timed
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import init_process_group, pin_worker, set_math_mode
from bench_lib.run.calibrate import CalibrationSpec, result_file
from bench_lib.run.worker import EXIT_FAILED, PROCESS_GROUP_TIMEOUT_S, destroy_process_group
from bench_lib.strategies import BuildContext
from bench_lib.sweep.predict_time import BatchCosts
from bench_lib.workloads import Workload


def run_rank(spec: CalibrationSpec, rank: int, workdir: Path) -> dict[str, object]:
    """This rank's calibration (module docstring), as its file's content."""
    key, rig = spec.key, spec.rig
    pin_worker(rig, rank)
    set_math_mode(key.math_mode)  # its cases' mode
    group = spec.devices > 1
    if group:
        init_process_group(rig, rank, spec.devices, str(workdir / "rendezvous"),
                           PROCESS_GROUP_TIMEOUT_S)

    def barrier() -> None:
        if group:
            dist.barrier()

    device = rig.device(rank)
    torch.manual_seed(0)
    biggest = max(spec.sizes.alone | spec.sizes.together | spec.sizes.blocks)
    workload = Workload(key.model, key.image_size, biggest, loss=key.loss,
                        precision=key.precision)
    model = workload.build_model()
    if key.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = strategies.get("single").build(model, [device], BuildContext(workload))

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = workload.make_batch(b, device, seed=rank)
        if key.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def step_s(b: int) -> float:
        x, y = batch(b)
        return timed(lambda: trainer.step(x, y), [device])

    out: dict[str, object] = {"rank": rank, "alone": {}, "together": {}}
    if rank == 0:
        step_s(min(spec.sizes.alone or {biggest}))  # gradients for the optimizer to step
        out["optimizer_s"] = timed(trainer.optimizer.step, [device])
        out["alone"] = {str(b): BatchCosts(step_s(b)).as_dict()
                        for b in sorted(spec.sizes.alone)}
    barrier()
    together: dict[str, dict[str, object]] = {}
    for b in sorted(spec.sizes.together | spec.sizes.blocks):
        barrier()
        step = step_s(b)
        fwd: tuple[float, ...] = ()
        bwd: tuple[float, ...] = ()
        if b in spec.sizes.blocks:
            barrier()
            fwd, bwd = block_times(trainer.module, workload, b, device)
        together[str(b)] = BatchCosts(step, fwd, bwd).as_dict()
    out["together"] = together
    copies: dict[str, float] = {}
    for nbytes in sorted(spec.sizes.copies):
        barrier()
        copies[str(nbytes)] = fresh_copy_s(nbytes, device)
    out["copies"] = copies
    barrier()
    return out


def main(argv: list[str]) -> int:
    spec_path = Path(argv[0]).resolve()  # absolute: the file:// rendezvous names no host
    rank = int(argv[1])
    spec = CalibrationSpec.read(spec_path)
    t0 = time.monotonic()
    try:
        found = run_rank(spec, rank, spec_path.parent)
    except Exception:  # the runner reads the log's tail as the reason
        traceback.print_exc()
        destroy_process_group(EXIT_FAILED)
        return EXIT_FAILED
    found["wall_s"] = time.monotonic() - t0
    write_json_atomic(result_file(spec_path.parent, rank), found)
    destroy_process_group(0)
    return 0


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
