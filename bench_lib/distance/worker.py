"""One process of a distance case's launch.

    python -m bench_lib.distance.worker SPEC_JSON RANK RUNNER_PID

Like a training case's worker (``bench_lib.launch.worker``), whose protocol it speaks: it
asks to die with the runner before importing torch, pins itself to its worker's cores,
joins the case's process group (a cpu rig's ``split``), records its resident memory before
the weight exists (``protocol.baseline_path``: the runner's memory cap counts what comes
after), times its steps by the suite's timing rule (``measure.timing.measure_steps``:
warm-up, synchronised devices, the ranks' common start and stop), reads its peak memory net
of the runtime after warm-up (``measure.memory``), and writes a ``RankResult`` as
``rank<RANK>.json``. Rank 0 also saves the value and gradient of its last step
(``spec.result_file``) for the runner to compare with the float64 reference.

One timed step: forward and backward of D (``methods``), from a cleared gradient; for a
process group, the gradient's all-reduce too, so that every rank ends the step holding the
full gradient.

A case over ``--max-memory-per-device`` is an ``oom``: on GPUs the allocator's cap raises
it; on CPUs the runner kills a process whose resident memory passes the cap, and this
worker checks its own peak after the steps as well (a peak between the runner's polls).
"""

from __future__ import annotations

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 3))

import torch

from bench_lib.distance import methods
from bench_lib.distance.spec import DistanceSpec, result_file
from bench_lib.launch.protocol import RankResult, baseline_path
from bench_lib.launch.worker import (
    EXIT_FAILED,
    PROCESS_GROUP_TIMEOUT_S,
    result_path,
)
from bench_lib.math_modes import set_math_mode
from bench_lib.measure.memory import PeakMemory, cap_cuda_memory
from bench_lib.measure.timing import measure_steps
from bench_lib.pinning import pin_worker
from bench_lib.process_groups import destroy_process_group, init_process_group
from bench_lib.results.store import write_json_atomic


class Step:
    """One timed step of the case's method; keeps the last value computed."""

    def __init__(self, compute: Callable[[], torch.Tensor], weight: torch.Tensor,
                 after_backward: Callable[[], None] = lambda: None) -> None:
        self.compute, self.weight, self.after_backward = compute, weight, after_backward
        self.value = float("nan")

    def __call__(self) -> None:
        self.weight.grad = None
        total = self.compute()
        total.backward()
        self.after_backward()
        self.value = float(total.detach())


def make_step(spec: DistanceSpec, rank: int, devices: list[torch.device]) -> Step:
    """The case's method on a fresh weight on its first device."""
    case = spec.case
    weight = methods.make_weight(case.layer, spec.seed, case.dtype, devices[0])
    if case.method == "loop":
        return Step(lambda: methods.loop(weight), weight)
    if case.method == "blocked":
        return Step(lambda: methods.blocked(weight, case.block_rows), weight)
    if case.process_group:
        return Step(lambda: methods.split_ranks(weight, rank, case.world_size, case.block_rows),
                    weight, lambda: methods.reduce_gradient(weight, case.world_size))
    return Step(lambda: methods.split_devices(weight, devices, case.block_rows), weight)


def run_rank(spec: DistanceSpec, rank: int, workdir: Path) -> RankResult:
    """Measure this rank's part of one launch (module docstring)."""
    case, rig, m = spec.case, spec.rig, spec.measurement
    indices = [rank] if case.process_group else list(range(case.world_size))
    pin_worker(rig, indices[0])
    set_math_mode(m.math_mode)
    if case.process_group:
        init_process_group(rig, rank, case.world_size, str(workdir / "rendezvous"),
                           PROCESS_GROUP_TIMEOUT_S)
    devices = [rig.device(i) for i in indices]
    labels = [str(rank)] if case.process_group else [str(i) for i in indices]
    cap_cuda_memory(devices, m.max_memory_per_device_mib)
    memory = PeakMemory(devices, labels)
    write_json_atomic(baseline_path(workdir, rank), {"rss_mib": memory.baseline_mib})
    step = make_step(spec, rank, devices)
    timed = measure_steps(step, devices, warmup_steps=m.warmup_steps,
                          timed_steps=m.timed_steps, max_time_s=m.max_time_s,
                          interval_target_pct=m.interval_target_pct,
                          group_device=devices[0] if case.process_group else None,
                          after_warmup=memory.reset)
    peaks = memory.read()
    cap = m.max_memory_per_device_mib
    if rig.kind == "cpu" and cap and max(peaks.net_mib.values()) > cap:
        held = max(peaks.net_mib.values())
        return RankResult(rank, "oom", f"peak {held:.0f} MiB resident beyond the runtime over "
                          f"the timed steps, over the {cap:.0f} MiB cap "
                          "(--max-memory-per-device)", failed_at_unix_s=time.time())
    if rank == 0:
        grad = step.weight.grad
        torch.save({"value": step.value,
                    "grad": None if grad is None else grad.detach().cpu()},
                   result_file(workdir))
    return RankResult(rank, "ok", step_times_s=tuple(timed.times_s),
                      step_cpu_times_s=tuple(timed.cpu_times_s),
                      timed_window_unix_s=timed.window_unix_s, stop_reason=timed.stop_reason,
                      warmup_steps=timed.warmup_steps, peak_mem_mib=peaks.gross_mib,
                      peak_mem_net_mib=peaks.net_mib, peak_mem_source=peaks.source)


def main(argv: list[str]) -> int:
    # Absolute: a relative path would make the file:// rendezvous URL name a host.
    spec_path = Path(argv[0]).resolve()
    rank = int(argv[1])
    spec = DistanceSpec.read(spec_path)
    try:
        result = run_rank(spec, rank, spec_path.parent)
    except Exception as e:  # the case's oom or error row; the traceback goes to the log
        result = RankResult.failed(rank, e)
        traceback.print_exc()
    result.write(result_path(spec_path.parent, rank))  # first, so the runner sees it early
    code = 0 if result.status == "ok" else EXIT_FAILED
    destroy_process_group(code)
    return code


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
