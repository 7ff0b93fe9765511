"""The code that runs inside a case's fresh process(es).

    python -m bench_lib.launch.worker SPEC_JSON RANK [RUNNER_PID]       (the local launcher)
    python -m bench_lib.launch.worker SPEC_JSON env AGENT_PID           (under torchrun)

Under torchrun (``launch.torchrun``) the rank, world size and local rank come from torchrun's
environment (``RankPlace.from_env``), the process group is joined through ``env://`` (the
store torchrun's rendezvous set up), and the device is the local rank's.

Builds the workload, applies the strategy, measures its steps (``measure.timing``), reads
peak memory (after warm-up, net of the process's footprint before the model was built:
``measure.memory``), writes its timed ``RankResult`` as ``rank<RANK>.json`` next to the spec,
then runs its diagnostics (``launch.diagnostics``: compute-only steps, the optimizer steps, the
kernels, a traced step where the strategy has stages) and rewrites it with them. Any failure
before that becomes a result with a status (and the time it was caught, so the runner can
blame the rank that failed first); the runner turns a missing file into an ``error``.

Around that:

- First, before importing torch, the worker asks to be killed when its parent dies: the
  runner, or torchrun's agent, itself tied to the runner (``launch.agent``); the parent's pid
  closes the race where it died before the worker asked.
- The timed result is on disk before any diagnostic, rewritten before each with a note that
  names it (``diagnostics_note``, or ``trace_note`` for the traced step), so a rank killed in
  one keeps its timing. A diagnostic that fails (out of memory, or a peer's failure
  surfacing as a communication error), or in a process group runs past its time bound (a
  peer that hangs), keeps the timed result, says why, and ends the diagnostics: its peers
  may wait for this rank in a collective, so it exits nonzero (past the bound, at once,
  from the timer) and the runner stops them.
- On every path, failures included, the result file is written first (so the runner sees it
  early), then the process group is destroyed if one is up (never raising, and not waited
  for past ``process_groups.SHUTDOWN_S``).

Exit codes: 0 ok; 1 (``EXIT_FAILED``) the rank failed (its result says why); 3
(``EXIT_DIAGNOSTIC_FAILED``) timed fine but a diagnostic failed, ran past its bound or was
not run, so its peers may be stuck in one: a nonzero code starts the runner's grace period
for them (``processes.supervision.PEER_GRACE_S``); 4 (``EXIT_ORPHANED``) the runner was gone
before the worker started. (Under torchrun any nonzero code makes the agent stop the other
ranks at once.)
"""

from __future__ import annotations

# The worker asks to die with the runner (die_with_parent) before torch's imports below,
# which take seconds: a runner killed meanwhile must not leave a rank behind.
# ruff: noqa: E402
import dataclasses
import functools
import gc
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from bench_lib.launch.agent import RANK_FROM_ENV

# torch-free, imported before torch (see above)
from bench_lib.processes.lifeline import (
    EXIT_ORPHANED,
    argv_pid,
    die_with_parent,
    exit_if_orphaned,
    exit_lightly,
)

EXIT_FAILED = 1
EXIT_DIAGNOSTIC_FAILED = 3


def _runner_pid(argv: list[str]) -> int | None:
    """The parent's pid from the worker's arguments (SPEC_JSON RANK [PARENT_PID]): the
    runner's, or under torchrun the agent's."""
    return argv_pid(argv, 2)


if __name__ == "__main__":
    exit_if_orphaned(_runner_pid(sys.argv[1:]))

import torch

from bench_lib import strategies, turns
from bench_lib.launch import diagnostics, faults
from bench_lib.launch.launch_parts import DONE, MAIN, Stamps, span, stamp
from bench_lib.launch.protocol import CaseSpec, RankResult, baseline_path
from bench_lib.math_modes import set_math_mode
from bench_lib.measure import speed_probe
from bench_lib.measure.memory import PeakMemory, cap_cuda_memory, peak_reserved_mib
from bench_lib.measure.timing import measure_steps
from bench_lib.pinning import pin_worker
from bench_lib.process_groups import destroy_process_group, init_process_group
from bench_lib.results.store import write_json_atomic
from bench_lib.strategies import BuildContext, Trainer
from bench_lib.sweep.cases import Case
from bench_lib.workloads import Workload

PROCESS_GROUP_TIMEOUT_S = 120.0


def result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.json"


@dataclass(frozen=True)
class RankPlace:
    """Where this rank sits, resolved once as the worker starts: from its arguments (the
    local launcher: one node, the rank is its device slot) or from torchrun's environment."""

    rank: int
    """Global rank (names its result file and its device label)."""
    local_rank: int
    """Device slot on this node: the device, the cores it is pinned to."""
    world_size: int | None = None
    """The ranks torchrun started in all (None: the local launcher's, the case's)."""
    node: int | None = None
    """This node's rank in torchrun's rendezvous where the group spans nodes, else None."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RankPlace:
        """The place torchrun gives: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and
        GROUP_RANK (the rendezvous numbers nodes; ours, ``--node-rank``, is the runner's)."""
        try:
            rank, local, world, local_world = (int(environ[k]) for k in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
        except KeyError as e:
            raise RuntimeError(f"{e.args[0]} is not set: the worker was told to read its "
                               "rank from torchrun's environment") from None
        node = int(environ.get("GROUP_RANK", "0")) if world > local_world else None
        return cls(rank, local, world, node)

    @property
    def env_init(self) -> bool:
        """Whether the process group is joined through ``env://`` (torchrun's store)."""
        return self.world_size is not None

    def slot_label(self, kind: str, index: int) -> str:
        """A device's label in the timeline: ``cpu:1``, ``cuda:0``; across nodes prefixed
        with the node (``n1/cuda:0``), since every node has a ``cuda:0``."""
        return f"{kind}:{index}" if self.node is None else f"n{self.node}/{kind}:{index}"


def run_rank(spec: CaseSpec, place: RankPlace, workdir: Path,
             stamps: Stamps | None = None) -> RankResult:
    """Measure this rank's part of one launch (``spec``: with ``trace``, then time single's
    optimizer step alone and trace a step; with ``compute_only``, time a few steps with no
    gradient all-reduce where the strategy has them; ``cut``, the stage cut to use instead
    of choosing one; ``warmup_steps``, a fixed warm-up). ``place``: where this rank sits
    (the local launcher's: rank = device slot; or where torchrun put it); ``workdir``: the
    case folder; ``stamps``: receives the launch's named points as it passes them
    (``launch_parts``).

    Writes the timed result before the diagnostics and as they go (``diagnostics.run_diagnostics``);
    leaves the process group (if any) up: ``main`` destroys it once the final result is
    written. A diagnostic past its time bound ends the process here (``_give_up``).
    """
    case, rig, rank = spec.case, spec.rig, place.rank
    stamps = {} if stamps is None else stamps
    # A rank of a process group drives its own device; a lone process drives them all.
    indices = [place.local_rank] if case.process_group else list(range(case.world_size))
    pin_worker(rig, indices[0])  # a lone process driving several devices: like single
    # Before the model is built; the calibration and the FLOP peak probe use the same mode.
    set_math_mode(case.measurement.math_mode)
    devices = [rig.device(i) for i in indices]
    if rig.kind == "cuda":
        with span(stamps, "cuda_context"):
            init_cuda(devices)
    if case.process_group:
        if place.world_size not in (None, case.world_size):
            raise RuntimeError(f"torchrun started {place.world_size} ranks; the case needs "
                               f"{case.world_size}")
        # NCCL's communicator is counted here: process_groups.init_process_group passes device_id,
        # with which torch creates it eagerly, inside init_process_group. gloo (cpu rigs,
        # --gpu-slots) connects its pairs there too. Where a backend still connected
        # lazily, its first collective (the first warm-up step) would pay for it.
        with span(stamps, "process_group"):
            init_process_group(rig, rank, case.world_size,
                               "" if place.env_init else str(workdir / "rendezvous"),
                               PROCESS_GROUP_TIMEOUT_S, local_rank=place.local_rank,
                               loopback=place.node is None)
    # Ranks are labelled by global rank (unique across nodes; the slot on one node).
    labels = [str(rank)] if case.process_group else [str(i) for i in indices]
    cap_cuda_memory(devices, case.measurement.max_memory_per_device_mib)
    # The footprint before the model is built (torch, pinning, process group): peaks are
    # reported net of it, and the runner's CPU memory cap counts only what comes after it.
    memory = PeakMemory(devices, labels)
    write_json_atomic(baseline_path(workdir, rank), {"rss_mib": memory.baseline_mib})
    with span(stamps, "model_build"):
        trainer, x, y = _build(case, rank, devices, spec.cut)
    faults.inject_test_fault(case.strategy, rank)
    m = case.measurement
    # In a gate that runs both sides at once, this rank steps in turns with the same
    # case's rank on the other side (bench_lib.turns); None otherwise.
    taking_turns = turns.from_env(f"{case.case_id}/{rank}")
    failed = True
    try:
        timed = measure_steps(
            faults.with_injected_slowdown(lambda: trainer.step(x, y), trainer.devices),
            trainer.devices, timed_steps=m.timed_steps,
            max_time_s=m.max_time_s, interval_target_pct=m.interval_target_pct,
            min_time_s=m.min_time_s or 0.0,
            group_device=devices[0] if case.process_group else None,
            after_warmup=memory.reset,
            warmup_steps=m.warmup_steps if spec.warmup_steps is None else spec.warmup_steps,
            warmup_rule=spec.warmup_steps is None,
            probe=speed_probe.make_probe() if rig.kind == "cpu" else None,
            turns=taking_turns,
        )
        failed = False
    finally:
        if taking_turns is not None:
            taking_turns.close(wait=not failed)
    stamp(stamps, "diagnostics_start")  # everything after the timed steps, to the result
    peaks, reserved = memory.read(), peak_reserved_mib(trainer.devices, labels)
    partition = getattr(trainer, "partition", None)  # strategies that cut the model say where
    result = RankResult(
        rank, "ok", step_times_s=tuple(timed.times_s),
        step_cpu_times_s=tuple(timed.cpu_times_s), timed_window_unix_s=timed.window_unix_s,
        probe_times_s=tuple(timed.probe_times_s),
        stop_reason=timed.stop_reason, warmup_steps=timed.warmup_steps,
        warmup_time_s=timed.warmup_time_s, warmup_first_step_s=timed.warmup_first_step_s,
        peak_mem_mib=peaks.gross_mib,
        peak_mem_net_mib=peaks.net_mib, peak_mem_source=peaks.source,
        peak_mem_reserved_mib=reserved,
        partition=partition.label if partition is not None else "",
    )
    # The compute-only steps run in every launch of a run (not tune's short ones): one
    # launch's few steps can fall on a busy moment, and the case's figure is their median
    # over launches. The kernels: every launch, cuda rigs only. The rest: the launch that
    # traces.
    plan = diagnostics.schedule(
        trainer, x, y, case.process_group, compute=spec.compute_only,
        optimizer=spec.trace and case.strategy == "single",
        stages=trainer.timeline_stages() if spec.trace else [],
        slot_labels=[place.slot_label(rig.kind, i) for i in indices],
        rebase=place.node is not None,
        trace_fault=functools.partial(faults.inject_trace_fault, case.strategy, rank))
    path = result_path(workdir, rank)
    slowest = max(timed.times_s, default=0.0)
    return diagnostics.run_diagnostics(
        result, plan, write=lambda r: dataclasses.replace(r, stamps_s=dict(stamps)).write(path),
        give_up=functools.partial(_give_up, path, stamps),
        bound_s=(functools.partial(diagnostics.time_bound_s, slowest_step_s=slowest,
                                   first_step_s=timed.warmup_first_step_s)
                 if case.process_group else None),
        fault=functools.partial(faults.inject_diagnostics_fault, case.strategy, rank))


def _give_up(path: Path, stamps: Stamps, result: RankResult) -> NoReturn:
    """Called from ``diagnostics.run_diagnostics``'s timer where a diagnostic ran past its
    bound (a peer hung, or left this rank waiting in a collective it will not join): write
    ``result`` (its note says which) and exit at once with ``EXIT_DIAGNOSTIC_FAILED``, the
    process group left as it is (destroying it could block on the same peer); the runner
    stops the peers after its grace period."""
    stamp(stamps, DONE)
    dataclasses.replace(result, stamps_s=dict(stamps)).write(path)
    print(f"rank {result.rank}: {result.diagnostics_note or result.trace_note}; exiting",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_DIAGNOSTIC_FAILED)


def init_cuda(devices: Sequence[torch.device]) -> None:
    """Create this process's CUDA context on each GPU it drives, now: one known point
    before the process group, so that its cost is measured apart (``cuda_context_s``)
    rather than falling wherever the first CUDA call happens to be (the process group's
    ``set_device``, the model's move). Leaves the first device current."""
    torch.cuda.init()
    # From CUDA 12 on, cudaSetDevice creates the device's primary context; the synchronize
    # makes sure of it on any runtime, without allocating.
    for index in reversed(list(dict.fromkeys(d.index or 0 for d in devices))):
        torch.cuda.set_device(index)
        torch.cuda.synchronize(index)


def _build(case: Case, rank: int, devices: list[torch.device],
           cut: str) -> tuple[Trainer, torch.Tensor, torch.Tensor]:
    """The rank's trainer (workload built, strategy applied: device moves, wrappers,
    stages) and the batch it trains on."""
    torch.manual_seed(0)
    workload = Workload(case.model, case.image_size, case.batch_size, loss=case.loss,
                        precision=case.precision)
    ctx = BuildContext(workload, case.micro, rank, case.world_size if case.process_group else 1,
                       partition=cut or case.partition or "tutorial", sync_bn=case.sync_bn,
                       ddp=case.ddp)
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
    return trainer, x, y.to(trainer.output_device)




def exit_code(result: RankResult) -> int:
    """The worker's exit code for its final result (module docstring)."""
    if result.status != "ok":
        return EXIT_FAILED
    return EXIT_DIAGNOSTIC_FAILED if result.trace_note or result.diagnostics_note else 0


def main(argv: list[str]) -> int:
    stamps: Stamps = {}
    stamp(stamps, MAIN)  # the runner's request to here: the process start (launch_parts)
    # Absolute: a relative path would make the file:// rendezvous URL name a host, and hang.
    spec_path = Path(argv[0]).resolve()
    place = (RankPlace.from_env(os.environ) if argv[1] == RANK_FROM_ENV
             else RankPlace(int(argv[1]), int(argv[1])))
    rank = place.rank
    # Run as a program, the module asked already, before its imports; asking twice is
    # harmless, and covers a caller that imported it.
    if not die_with_parent(_runner_pid(argv)):
        print(f"rank {rank}: the runner is gone; not starting", file=sys.stderr)
        return EXIT_ORPHANED
    spec = CaseSpec.read(spec_path)
    try:
        result = run_rank(spec, place, spec_path.parent, stamps)
    except Exception as e:  # the case's oom or error row, with the traceback in the log
        result = RankResult.failed(rank, e)
        traceback.print_exc()
    stamp(stamps, DONE)
    result = dataclasses.replace(result, stamps_s=stamps)
    # The result first, so that the runner sees it early; then the process group.
    result.write(result_path(spec_path.parent, rank))
    code = exit_code(result)
    destroy_process_group(code)
    return code


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
