"""The code that runs inside a case's fresh process(es).

    python -m bench_lib.worker SPEC_JSON RANK

Builds the workload, applies the strategy, warms up, times steps (synchronising every
device), reads peak memory and writes ``rank<RANK>.json`` next to the spec. Any failure
becomes a result file with a status; the runner turns a missing file into an ``error``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench_lib import strategies
from bench_lib.results import write_json_atomic
from bench_lib.rig import Rig, init_process_group, pin_worker
from bench_lib.strategies import BuildContext
from bench_lib.sweep import Case
from bench_lib.timeline import trace_step
from bench_lib.timing import AdaptiveStop, StopRule, synchronize, time_steps
from bench_lib.workloads import Workload

MIB = 2**20
PROCESS_GROUP_TIMEOUT_S = 120.0


def _collective_stop(rule: StopRule, device: torch.device) -> StopRule:
    """Make every rank stop after the same step: stop when any rank wants to.

    Every rank judges the slowest rank's step times (the case's figure), so all ranks see
    the same numbers; the flag is still reduced, so a rule that disagrees cannot hang a rank.
    """
    slowest: list[float] = []

    def stop(times: list[float]) -> bool:
        last = torch.tensor([times[-1]], dtype=torch.float64, device=device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX)
        slowest.append(last.item())
        flag = torch.tensor([1.0 if rule(slowest) else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return stop


def _peak_memory_mib(devices: list[torch.device], device_indices: list[int]) -> dict[str, float]:
    """Peak memory per device: allocator peak on CUDA, this process's peak RSS on CPU."""
    if devices[0].type == "cuda":
        return {
            str(i): torch.cuda.max_memory_allocated(d) / MIB
            for i, d in zip(device_indices, devices)
        }
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"+".join(map(str, device_indices)): rss_kib / 1024}


def _peak_reserved_mib(devices: list[torch.device], device_indices: list[int]) -> dict:
    """Peak memory the CUDA caching allocator reserved per device (empty on CPU)."""
    if devices[0].type != "cuda":
        return {}
    return {str(i): torch.cuda.max_memory_reserved(d) / MIB
            for i, d in zip(device_indices, devices)}


INJECT_SLOWDOWN_ENV = "PARABENCH_INJECT_SLOWDOWN"


def _with_injected_slowdown(step, devices: list[torch.device]):
    """TEST-ONLY: with PARABENCH_INJECT_SLOWDOWN=0.15 every step does 15% more work.

    It plants a known slowdown for demonstrating the regression gate
    (benchmarks/regression_gate.py); never set it for a real measurement. The extra work
    is a busy loop on the step's own core, not a sleep: on the shared VMs we measured on,
    a process that sleeps part of each step runs the rest faster, so a planted 15% sleep
    showed up as only +8% to +13%.
    """
    fraction = float(os.environ.get(INJECT_SLOWDOWN_ENV) or 0)
    if fraction <= 0:
        return step

    def slow_step() -> None:
        t0 = time.perf_counter()
        step()
        synchronize(devices)  # extra work in proportion to the finished work, not the queued
        end = time.perf_counter() + fraction * (time.perf_counter() - t0)
        while time.perf_counter() < end:
            pass

    return slow_step


def _cap_cuda_memory(case: Case, rig: Rig, indices: list[int]) -> None:
    """Apply --max-memory-per-device on GPUs: past it the allocator raises OutOfMemoryError."""
    cap_mib = case.settings.get("max_memory_per_device_mib", 0.0)
    if not cap_mib or rig.kind != "cuda":
        return
    for i in indices:
        total = torch.cuda.get_device_properties(i).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), i)


def _inject_test_fault(case: Case, rank: int) -> None:
    """Test-only fault injection, off unless PARABENCH_TEST_FAULT is set.

    ``STRATEGY:RANK:KIND`` makes that rank of that strategy's cases misbehave just before
    timing: ``sigkill`` (dies at once), ``hang`` (sleeps forever, so its peers block in a
    collective), ``alloc`` (keeps allocating resident memory).
    """
    fault = os.environ.get("PARABENCH_TEST_FAULT", "")
    if fault.count(":") != 2:
        return
    strategy, fault_rank, kind = fault.split(":")
    if strategy != case.strategy or int(fault_rank) != rank:
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(1)
    elif kind == "alloc":
        hoard = []
        while True:  # 64 MiB at a time, touched so that it is resident
            hoard.append(b"\x01" * (64 * MIB))
            time.sleep(0.01)


def run_rank(case: Case, rig: Rig, rank: int, workdir: Path) -> dict:
    """Measure this rank's part of the case; returns the result dict."""
    spec = strategies.get(case.strategy)
    n = spec.num_devices(rig)
    distributed = spec.per_device_processes
    indices = [rank] if distributed else list(range(n))
    world = n if distributed else 1
    pin_worker(rig, indices)
    if distributed:
        init_process_group(rig, rank, world, str(workdir / "rendezvous"), PROCESS_GROUP_TIMEOUT_S)

    _cap_cuda_memory(case, rig, indices)
    torch.manual_seed(0)
    workload = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                        precision=case.precision)
    devices = [rig.device(i) for i in indices]
    ctx = BuildContext(workload, case.split_size, rank, world,
                       partition=case.partition or "tutorial", sync_bn=case.sync_bn)
    model = workload.build_model()
    if case.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = spec.build(model, devices, ctx)
    if case.compile:
        trainer.compile()  # compiles lazily: the warm-up steps pay for it
    x, y = workload.make_batch(trainer.local_batch_size, trainer.input_device, seed=rank)
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = y.to(trainer.output_device)

    _inject_test_fault(case, rank)
    settings = case.settings
    rule = AdaptiveStop(settings.get("ci_target_pct", 2.0) / 100, settings["max_time_s"])
    stop: StopRule = rule
    window: list[float] = []
    barrier = None
    if distributed:
        stop = _collective_stop(rule, devices[0])
        barrier = dist.barrier
    timed_step = _with_injected_slowdown(lambda: trainer.step(x, y), trainer.devices)
    times = time_steps(
        timed_step, trainer.devices, settings["warmup_steps"],
        settings["timed_steps"], should_stop=stop, barrier=barrier,
        on_window=lambda t0, t1: window.extend((t0, t1)),
    )
    result = {
        "status": "ok",
        "rank": rank,
        "step_times_s": times,
        "peak_mem_mib": _peak_memory_mib(trainer.devices, indices),
        "peak_mem_reserved_mib": _peak_reserved_mib(trainer.devices, indices),
        "timed_window_unix_s": window,
        "stop_reason": rule.final_reason(len(times), settings["timed_steps"]),
    }
    if hasattr(trainer, "partition"):  # strategies that cut the model say where
        result["partition"] = trainer.partition.label
    stage_modules = trainer.timeline_modules()
    if stage_modules:  # one extra step, after the timed ones, traced for the pipeline timeline
        result["timeline"] = trace_step(lambda: trainer.step(x, y), stage_modules,
                                        trainer.devices)
    if distributed:
        dist.destroy_process_group()
    return result


def main(argv: list[str]) -> int:
    # Absolute: a relative path would make the file:// rendezvous URL name a host, and hang.
    spec_path, rank = Path(argv[0]).resolve(), int(argv[1])
    spec = json.loads(spec_path.read_text())
    case, rig = Case.from_dict(spec["case"]), Rig.from_dict(spec["rig"])
    out = spec_path.parent / f"rank{rank}.json"
    try:
        result = run_rank(case, rig, rank, spec_path.parent)
    except torch.OutOfMemoryError as e:
        result = {"status": "oom", "rank": rank, "reason": f"out of memory: {str(e)[:300]}"}
    except MemoryError as e:
        result = {"status": "oom", "rank": rank, "reason": f"host out of memory: {e}"}
    except Exception as e:  # recorded as the case's error row, with the traceback in the log
        traceback.print_exc()
        result = {"status": "error", "rank": rank, "reason": f"{type(e).__name__}: {e}"[:500]}
    write_json_atomic(out, result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
