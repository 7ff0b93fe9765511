"""The code that runs inside a case's fresh process(es).

    python -m bench_lib.run.worker SPEC_JSON RANK

Builds the workload, applies the strategy, measures its steps (``measure.timing``), reads
peak memory (after warm-up, net of the process's footprint before the model was built:
``measure.memory``), traces one pipeline step where the strategy has stages, and writes its
``RankResult`` as ``rank<RANK>.json`` next to the spec. Any failure becomes a result with a
status; the runner turns a missing file into an ``error``.
"""

from __future__ import annotations

import gc
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench_lib import strategies
from bench_lib.measure.memory import PeakMemory, cap_cuda_memory, peak_reserved_mib
from bench_lib.measure.timing import measure_steps
from bench_lib.measure.trace import TracedStep, trace_step
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig, init_process_group, pin_worker, set_math_mode
from bench_lib.run import faults
from bench_lib.run.protocol import CaseSpec, RankResult, baseline_path
from bench_lib.strategies import BuildContext, Trainer
from bench_lib.sweep.cases import Case
from bench_lib.workloads import Workload

PROCESS_GROUP_TIMEOUT_S = 120.0


def run_rank(case: Case, rig: Rig, rank: int, workdir: Path, trace: bool = True) -> RankResult:
    """Measure this rank's part of one launch of the case (``trace``: then trace a step)."""
    # A rank of a process group drives its own device; a lone process drives them all.
    indices = [rank] if case.process_group else list(range(case.world_size))
    pin_worker(rig, indices[0])  # a lone process driving several devices: like single
    set_math_mode()  # before the model is built: the FLOP peak probe uses the same mode
    if case.process_group:
        init_process_group(rig, rank, case.world_size, str(workdir / "rendezvous"),
                           PROCESS_GROUP_TIMEOUT_S)
    devices = [rig.device(i) for i in indices]
    labels = [str(i) for i in indices]
    cap_cuda_memory(devices, case.measurement.max_memory_per_device_mib)
    # The footprint before the model is built (torch, pinning, process group): peaks are
    # reported net of it, and the runner's CPU memory cap counts only what comes after it.
    memory = PeakMemory(devices, labels)
    write_json_atomic(baseline_path(workdir, rank), {"rss_mib": memory.baseline_mib})
    torch.manual_seed(0)
    workload = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                        precision=case.precision)
    ctx = BuildContext(workload, case.micro, rank, case.world_size if case.process_group else 1,
                       partition=case.partition or "tutorial", sync_bn=case.sync_bn)
    model = workload.build_model()
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = strategies.get(case.strategy).build(model, devices, ctx)
    del model  # a pipelining rank keeps only its own stages: let the rest of the model go
    gc.collect()
    if case.compile:
        trainer.compile()  # compiles lazily: the warm-up steps pay for it
    # Only a process that reads them gets inputs (pipelining: first stage x, last stage y).
    x, y = workload.make_batch(trainer.local_batch_size, trainer.input_device, seed=rank,
                               images=trainer.needs_images, targets=trainer.needs_targets)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = y.to(trainer.output_device)

    faults.inject_test_fault(case.strategy, rank)
    m = case.measurement
    timed = measure_steps(
        faults.with_injected_slowdown(lambda: trainer.step(x, y), trainer.devices),
        trainer.devices, warmup_steps=m.warmup_steps, timed_steps=m.timed_steps,
        max_time_s=m.max_time_s, ci_target_pct=m.ci_target_pct,
        group_device=devices[0] if case.process_group else None, after_warmup=memory.reset,
    )
    peaks, reserved = memory.read(), peak_reserved_mib(trainer.devices, labels)
    traced = (_trace(trainer, x, y, [f"{rig.kind}:{i}" for i in indices], case.process_group)
              if trace else None)
    if case.process_group:
        dist.destroy_process_group()
    partition = getattr(trainer, "partition", None)  # strategies that cut the model say where
    return RankResult(
        rank, "ok", step_times_s=tuple(timed.times_s),
        step_cpu_times_s=tuple(timed.cpu_times_s), timed_window_unix_s=timed.window_unix_s,
        stop_reason=timed.stop_reason, warmup_steps=timed.warmup_steps,
        peak_mem_mib=peaks.gross_mib,
        peak_mem_net_mib=peaks.net_mib, peak_mem_source=peaks.source,
        peak_mem_reserved_mib=reserved,
        partition=partition.label if partition is not None else "",
        timeline=tuple(traced.events) if traced else (),
        traced_step_s=traced.step_s if traced else None,
    )


def _trace(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, slot_labels: list[str],
           process_group: bool) -> TracedStep | None:
    """One extra step after the timed ones, traced for the pipeline timeline (None when the
    strategy has no stages). Devices are labelled by rig slot (``cpu:1``, ``cuda:1``)."""
    stages = trainer.timeline_stages()
    if not stages:
        return None
    if process_group:
        dist.barrier()  # the ranks start it together, as they start the timed window
    return trace_step(lambda: trainer.step(x, y), stages, trainer.devices, slot_labels)


def main(argv: list[str]) -> int:
    # Absolute: a relative path would make the file:// rendezvous URL name a host, and hang.
    spec_path, rank = Path(argv[0]).resolve(), int(argv[1])
    spec = CaseSpec.read(spec_path)
    try:
        result = run_rank(spec.case, spec.rig, rank, spec_path.parent, spec.trace)
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
