"""One process of a workload's calibration launch (``prediction.calibration`` starts it).

    python -m bench_lib.prediction.calibration_worker SPEC_JSON RANK RUNNER_PID

Like a case's worker (``bench_lib.launch.worker``): it asks to die with the runner before
importing torch, pins itself to its device's cores (a cpu rig) or creates its CUDA context
(a cuda rig), joins the launch's process group (only for its barriers and a cuda rig's
agreed step counts: no collective is timed), builds the workload's model as ``single``
trains it, once for every size, and times (``calibration_timing``, by the rig's pass
rule):

1. rank 0 alone, the others waiting at a barrier: the training step at each "alone" batch
   size, then the optimizer step (on the gradients the last step left);
2. every rank at once: the training step at each "together" size, then each block's
   forward and backward at each "blocks" size; then each "copies" byte count copied into a
   freshly allocated buffer (fsdp's copy-in and copy-out); a barrier before each size, so
   the ranks compute side by side as a case's ranks do.

Each part's end is stamped on ``time.monotonic()`` (one clock for the whole host on Linux,
so the runner subtracts its own stamps from them: ``prediction.calibration.parts_of``): the CUDA
context, the process group, the model build, each size's warm-up and timed passes, the
optimizer, each size's blocks, the copies, the last barrier. A part that waits at a barrier
counts the wait.

Writes ``calibration<RANK>.json`` (``prediction.calibration.result_file``) and exits 0; on a failure
the traceback goes to its log, and it exits 1 without a file.
"""

from __future__ import annotations

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 3))

import torch
import torch.distributed as dist

from bench_lib import strategies
from bench_lib.launch.worker import (
    EXIT_FAILED,
    PROCESS_GROUP_TIMEOUT_S,
    init_cuda,
)
from bench_lib.math_modes import set_math_mode
from bench_lib.pinning import pin_worker
from bench_lib.prediction.calibration import CalibrationSpec, result_file
from bench_lib.prediction.calibration_data import BatchCosts
from bench_lib.prediction.calibration_timing import (
    Passes,
    block_times,
    fresh_copy_s,
    pass_rule,
    step_passes,
    timed,
)
from bench_lib.process_groups import destroy_process_group, init_process_group
from bench_lib.results.store import write_json_atomic
from bench_lib.strategies import BuildContext, Trainer
from bench_lib.workloads import Workload

Stamps = list[tuple[str, float]]
"""Each part's name and its end on ``time.monotonic()``, in order."""


def stamp(stamps: Stamps, name: str) -> None:
    """End the part ``name`` now (it began at the previous stamp, or at ``main``)."""
    stamps.append((name, time.monotonic()))


def run_rank(spec: CalibrationSpec, rank: int, workdir: Path,
             stamps: Stamps | None = None) -> dict[str, object]:
    """This rank's calibration (module docstring), as its file's content; ``stamps``
    receives each part's end."""
    key, rig = spec.key, spec.rig
    stamps = [] if stamps is None else stamps
    pin_worker(rig, rank)
    set_math_mode(key.math_mode)  # its cases' mode
    device = rig.device(rank)
    if rig.kind == "cuda":
        init_cuda([device])
        stamp(stamps, "cuda_context_s")
    if spec.devices > 1:
        init_process_group(rig, rank, spec.devices, str(workdir / "rendezvous"),
                           PROCESS_GROUP_TIMEOUT_S)
        stamp(stamps, "process_group_s")
    torch.manual_seed(0)
    biggest = max(spec.sizes.alone | spec.sizes.together | spec.sizes.blocks)
    workload = Workload(key.model, key.image_size, biggest, loss=key.loss,
                        precision=key.precision)
    model = workload.build_model()
    if key.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = strategies.get("single").build(model, [device], BuildContext(workload))
    stamp(stamps, "model_build_s")
    me = _Rank(spec, rank, device, workload, trainer, stamps)
    out: dict[str, object] = {"rank": rank, "alone": {}, "together": {}}
    if rank == 0:
        out["alone"], out["optimizer_s"] = me.alone(biggest)
    me.barrier()
    out["together"] = me.together()
    out["copies"] = me.copies()
    me.barrier()
    stamp(stamps, "finish_s")
    out["steps"] = me.steps
    return out


@dataclass
class _Rank:
    """One rank's model and device, timing each part and stamping its end."""

    spec: CalibrationSpec
    rank: int
    device: torch.device
    workload: Workload
    trainer: Trainer
    stamps: Stamps
    steps: dict[str, list[int]] = field(default_factory=dict)
    """Each timed size's warm-up and timed passes, by its parts' name."""

    def barrier(self) -> None:
        if self.spec.devices > 1:
            dist.barrier()

    def step_s(self, phase: str, b: int, agreed: bool = False) -> float:
        """The step at ``b`` images by the rig's pass rule; ``agreed``: every rank runs the
        same passes (a cuda rig's settling rule decides them together)."""
        x, y = self.workload.make_batch(b, self.device, seed=self.rank)
        if self.spec.key.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        group = agreed and self.spec.devices > 1
        passes = step_passes(lambda: self.trainer.step(x, y), [self.device],
                             pass_rule(self.spec.rig.kind), self.device if group else None)
        self._stamp_passes(f"{phase}_{b}", passes)
        return passes.median_s

    def _stamp_passes(self, name: str, passes: Passes) -> None:
        """End two parts now: ``<name>_timed_s``, the timed passes' own seconds, and before
        it ``<name>_warmup_s``, the rest since the previous stamp (the batch made, the
        warm-up passes, the stop rule's checks between passes); count the passes."""
        end = time.monotonic()
        self.stamps += [(f"{name}_warmup_s", end - passes.timed_s), (f"{name}_timed_s", end)]
        self.steps[name] = [passes.warmup, passes.repeats]

    def alone(self, biggest: int) -> tuple[dict[str, object], float]:
        """Each alone size's step, then the optimizer step on the last one's gradients."""
        found: dict[str, object] = {str(b): BatchCosts(self.step_s("alone", b)).as_dict()
                                    for b in sorted(self.spec.sizes.alone)}
        if not found:  # gradients for the optimizer to step
            self.step_s("gradients", biggest)
        optimizer_s = timed(self.trainer.optimizer.step, [self.device])
        stamp(self.stamps, "optimizer_passes_s")
        return found, optimizer_s

    def together(self) -> dict[str, object]:
        """Each together size's step and, where asked, its blocks, every rank at once."""
        sizes = self.spec.sizes
        found: dict[str, object] = {}
        for b in sorted(sizes.together | sizes.blocks):
            self.barrier()
            step = self.step_s("together", b, agreed=True)
            fwd: tuple[float, ...] = ()
            bwd: tuple[float, ...] = ()
            if b in sizes.blocks:
                self.barrier()
                fwd, bwd = block_times(self.trainer.module, self.workload, b, self.device)
                stamp(self.stamps, f"blocks_{b}_s")
            found[str(b)] = BatchCosts(step, fwd, bwd).as_dict()
        return found

    def copies(self) -> dict[str, float]:
        """Each byte count's copy into a fresh buffer, every rank at once."""
        found: dict[str, float] = {}
        for nbytes in sorted(self.spec.sizes.copies):
            self.barrier()
            found[str(nbytes)] = fresh_copy_s(nbytes, self.device)
        if found:
            stamp(self.stamps, "copies_s")
        return found


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    spec_path = Path(argv[0]).resolve()  # absolute: the file:// rendezvous names no host
    rank = int(argv[1])
    spec = CalibrationSpec.read(spec_path)
    stamps: Stamps = []
    try:
        found = run_rank(spec, rank, spec_path.parent, stamps)
    except Exception:  # the runner reads the log's tail as the reason
        traceback.print_exc()
        destroy_process_group(EXIT_FAILED)
        return EXIT_FAILED
    found["wall_s"] = time.monotonic() - t0
    found["main_s"], found["stamps"] = t0, [[name, t] for name, t in stamps]
    write_json_atomic(result_file(spec_path.parent, rank), found)
    destroy_process_group(0)
    return 0


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
