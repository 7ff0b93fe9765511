"""The code that runs inside a case's fresh process(es).

    python -m bench_lib.run.worker SPEC_JSON RANK

Builds the workload, applies the strategy, measures its steps (``measure.timing``), reads
peak memory, traces one pipeline step where the strategy has stages, and writes its
``RankResult`` as ``rank<RANK>.json`` next to the spec. Any failure becomes a result with a
status; the runner turns a missing file into an ``error``.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench_lib import strategies
from bench_lib.measure.memory import cap_cuda_memory, peak_allocated_mib, peak_reserved_mib
from bench_lib.measure.timing import measure_steps
from bench_lib.measure.trace import trace_step
from bench_lib.rig import Rig, init_process_group, pin_worker
from bench_lib.run import faults
from bench_lib.run.protocol import CaseSpec, RankResult
from bench_lib.strategies import BuildContext
from bench_lib.sweep.cases import Case
from bench_lib.workloads import Workload

PROCESS_GROUP_TIMEOUT_S = 120.0


def run_rank(case: Case, rig: Rig, rank: int, workdir: Path) -> RankResult:
    """Measure this rank's part of the case."""
    # A rank of a process group drives its own device; a lone process drives them all.
    indices = [rank] if case.process_group else list(range(case.world_size))
    pin_worker(rig, indices)
    if case.process_group:
        init_process_group(rig, rank, case.world_size, str(workdir / "rendezvous"),
                           PROCESS_GROUP_TIMEOUT_S)
    devices = [rig.device(i) for i in indices]
    cap_cuda_memory(devices, case.measurement.max_memory_per_device_mib)
    torch.manual_seed(0)
    workload = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                        precision=case.precision)
    ctx = BuildContext(workload, case.micro, rank, case.world_size if case.process_group else 1,
                       partition=case.partition or "tutorial", sync_bn=case.sync_bn)
    model = workload.build_model()
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = strategies.get(case.strategy).build(model, devices, ctx)
    if case.compile:
        trainer.compile()  # compiles lazily: the warm-up steps pay for it
    x, y = workload.make_batch(trainer.local_batch_size, trainer.input_device, seed=rank)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = y.to(trainer.output_device)

    faults.inject_test_fault(case.strategy, rank)
    m = case.measurement
    timed = measure_steps(
        faults.with_injected_slowdown(lambda: trainer.step(x, y), trainer.devices),
        trainer.devices, warmup_steps=m.warmup_steps, timed_steps=m.timed_steps,
        max_time_s=m.max_time_s, ci_target_pct=m.ci_target_pct,
        group_device=devices[0] if case.process_group else None,
    )
    labels = [str(i) for i in indices]
    peak, reserved = (peak_allocated_mib(trainer.devices, labels),
                      peak_reserved_mib(trainer.devices, labels))
    stage_modules = trainer.timeline_modules()
    # One extra step, after the timed ones, traced for the pipeline timeline.
    timeline = (trace_step(lambda: trainer.step(x, y), stage_modules, trainer.devices)
                if stage_modules else [])
    if case.process_group:
        dist.destroy_process_group()
    partition = getattr(trainer, "partition", None)  # strategies that cut the model say where
    return RankResult(
        rank, "ok", step_times_s=tuple(timed.times_s), timed_window_unix_s=timed.window_unix_s,
        stop_reason=timed.stop_reason, peak_mem_mib=peak, peak_mem_reserved_mib=reserved,
        partition=partition.label if partition is not None else "", timeline=tuple(timeline),
    )


def main(argv: list[str]) -> int:
    # Absolute: a relative path would make the file:// rendezvous URL name a host, and hang.
    spec_path, rank = Path(argv[0]).resolve(), int(argv[1])
    spec = CaseSpec.read(spec_path)
    try:
        result = run_rank(spec.case, spec.rig, rank, spec_path.parent)
    except torch.OutOfMemoryError as e:
        result = RankResult(rank, "oom", f"out of memory: {str(e)[:300]}")
    except MemoryError as e:
        result = RankResult(rank, "oom", f"host out of memory: {e}")
    except Exception as e:  # recorded as the case's error row, with the traceback in the log
        traceback.print_exc()
        result = RankResult(rank, "error", f"{type(e).__name__}: {e}"[:500])
    result.write(spec_path.parent / f"rank{rank}.json")
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
