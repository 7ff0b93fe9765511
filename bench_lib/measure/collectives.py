"""The rig's collectives, measured once per run: time per size, and a latency-bandwidth fit.

Before the sweep (``commands.run_folder``), one fresh process per device, pinned like the workers
(``pinning.pin_worker``), joins a process group of its own (gloo on a cpu rig, NCCL on GPUs,
``process_groups.init_process_group`` with a timeout) and times, at each of ``SIZES_MIB`` (scaled
down to the sweep's largest message: ``sizes_for``)::

    all_reduce                 a buffer of n bytes on every rank
    all_gather_into_tensor     n bytes out (n / world in, per rank)
    reduce_scatter_tensor      n bytes in (n / world out, per rank)
    send_recv                  n bytes from rank 0 to rank 1: half a ping-pong

n is the size as nccl-tests counts it (its ``size`` column). Between GPU slots (the
validation mode, gloo on CUDA devices) gloo is handed pinned host copies of the device
buffers, each op's input copied there before it and its output back after it, inside the
clock (``through_host``): the path DDP's buckets take there, said in env.json
``collectives.path``. One warm-up, then up to
``REPEATS`` repetitions (fewer for a slow size: ``BUDGET_S``), every one started together
(a barrier), the slowest rank's time kept (``all_reduce`` MAX of the times, outside the
clock); the median per size. Each collective is then fitted as t(n) = alpha + n / beta
(``analysis.collective_fits``, where the fits and env.json's record of them live), with
which ``analysis.bound`` prices a case's gradient and activation traffic.

Skipped (with a note in env.json ``collectives``) on a rig of one device, where no case of
the sweep is priced with it, in ``--dry-run``, on a multi-node run's other nodes (node 0
measures its own devices), and under ``--resume`` when env.json already holds it.

    python -m bench_lib.measure.collectives RIG_JSON RANK FOLDER SIZES_MIB REPEATS PARENT_PID

Each rank ties itself to PARENT_PID (the runner's, or the fork server's) before torch's
imports (``lifeline.die_with_parent``): a runner killed with SIGKILL must not leave a rank
holding its device, waiting at the rendezvous for up to ``TIMEOUT_S``.
"""

# ruff: noqa: E402  (the lifeline is armed before torch's imports, as in launch.worker)
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_lib.processes.lifeline import argv_pid, exit_if_orphaned, exit_lightly

if __name__ == "__main__":
    exit_if_orphaned(argv_pid(sys.argv, 6))

import torch

from bench_lib.analysis.collective_fits import MIB, OPS, CollectiveFit, Collectives
from bench_lib.processes.forkserver import ForkServer, parent_pid, start_module
from bench_lib.rig import Rig

SIZES_MIB = (1.0, 8.0, 32.0, 100.0)
REPEATS = 5
BUDGET_S = 0.6
"""Seconds per (collective, size) after the warm-up: a slow size gets fewer repetitions
(at least ``MIN_REPEATS``), so the whole stays under ~10 s on a 2-core cpu rig."""
MIN_REPEATS = 3
TIMEOUT_S = 120.0
"""The whole micro-benchmark, process start included; also the process group's timeout."""


def sizes_for(largest_bytes: int) -> tuple[float, ...]:
    """``SIZES_MIB`` scaled so that the largest is the sweep's largest message (between
    1 and 100 MiB): a sweep of small models is not timed at 100 MiB."""
    top = min(max(largest_bytes / MIB, 1.0), SIZES_MIB[-1])
    return tuple(top * s / SIZES_MIB[-1] for s in SIZES_MIB)


def measure(rig: Rig, sizes_mib: Sequence[float] = SIZES_MIB, repeats: int = REPEATS,
            timeout_s: float = TIMEOUT_S, server: ForkServer | None = None) -> Collectives:
    """Time the collectives on every device of ``rig`` in fresh processes (module
    docstring; forked by the run's ``server`` where given); a rig of one device is skipped,
    a failure recorded as the reason."""
    if rig.num_devices < 2:
        return Collectives(skipped="a rig of one device has no collectives to measure")
    start = time.monotonic()
    sizes = ",".join(f"{s:g}" for s in sizes_mib)
    with tempfile.TemporaryDirectory(prefix="parabench-coll-") as folder:
        logs = [Path(folder) / f"rank{r}.log" for r in range(rig.num_devices)]
        parent = str(parent_pid(server))
        procs = [start_module(server, "bench_lib.measure.collectives",
                              [json.dumps(rig.as_dict()), str(rank), folder, sizes,
                               str(repeats), parent], log_path)
                 for rank, log_path in enumerate(logs)]
        deadline = start + timeout_s
        try:
            while None in (codes := [p.poll() for p in procs]):
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        result = Path(folder) / "result.json"
        if all(p.returncode == 0 for p in procs) and result.is_file():
            found = json.loads(result.read_text())
        else:
            bad = next((r for r, p in enumerate(procs) if p.returncode != 0), 0)
            tail = " | ".join(logs[bad].read_text(errors="replace").strip().splitlines()[-2:])
            why = (f"over {timeout_s:g} s" if time.monotonic() > deadline
                   else f"rank {bad} exited with {procs[bad].returncode}: {tail}")
            return Collectives(skipped=f"collective micro-benchmark failed ({why})")
    world = rig.num_devices
    fits = {op: CollectiveFit.of(op, world, found["sizes_bytes"], found["times_s"][op])
            for op in OPS}
    return Collectives(fits, rig.backend, world, wall_s=time.monotonic() - start,
                       path=path_of(rig))


def through_host(rig: Rig) -> bool:
    """Whether the rig's collectives move host copies of device buffers: gloo between GPU
    slots (the validation mode). gloo's TCP transport reads and writes host memory only
    (handed CUDA memory, a send dies in ``writev``: "Bad address"), and ProcessGroupGloo
    all-reduces DDP's CUDA buckets by copying them to pinned host memory and back
    (``AsyncAllreduceCUDAHostWork``); the micro-benchmark makes those copies itself, for
    every op, inside the clock."""
    return rig.backend == "gloo" and rig.kind == "cuda"


def path_of(rig: Rig) -> str:
    """What the micro-benchmark's times cover on ``rig`` (env.json ``collectives.path``)."""
    if through_host(rig):
        return ("gloo on pinned host copies: each CUDA buffer copied to the host before the "
                "collective and back after it, timed, as ProcessGroupGloo does with DDP's "
                "CUDA buckets")
    return f"{rig.backend} on {'CUDA' if rig.kind == 'cuda' else 'host'} memory"


@dataclass(frozen=True)
class Buffers:
    """One size's buffers of a rank: ``buf`` (n bytes) and ``part`` (n / world), on its
    device, and their pinned host copies where the collectives go ``through_host``."""

    device: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor] | None = None

    @classmethod
    def make(cls, rig: Rig, rank: int, nbytes: int, world: int) -> Buffers:
        device = rig.device(rank)
        sizes = {"buf": nbytes // 4, "part": nbytes // 4 // world}
        on_device = {k: torch.ones(n, dtype=torch.float32, device=device)
                     for k, n in sizes.items()}
        if not through_host(rig):
            return cls(on_device)
        return cls(on_device, {k: torch.empty(n, dtype=torch.float32, pin_memory=True)
                               for k, n in sizes.items()})

    def comm(self, name: str) -> torch.Tensor:
        """The tensor a collective is handed: the host copy where there is one."""
        return (self.host or self.device)[name]

    def to_host(self, name: str) -> None:
        if self.host is not None:
            self.host[name].copy_(self.device[name])

    def to_device(self, name: str) -> None:
        if self.host is not None:
            self.device[name].copy_(self.host[name])


def run_op(op: str, rank: int, b: Buffers) -> None:
    """One ``op`` on this rank's buffers: its input copied to the host first and its output
    back after where the buffers have host copies (``through_host``).
    send_recv is a ping-pong between ranks 0 and 1 (``_time_ops`` halves it)."""
    import torch.distributed as dist

    if op == "all_reduce":
        b.to_host("buf")
        dist.all_reduce(b.comm("buf"))
        b.to_device("buf")
    elif op == "all_gather":
        b.to_host("part")
        dist.all_gather_into_tensor(b.comm("buf"), b.comm("part"))
        b.to_device("buf")
    elif op == "reduce_scatter":
        b.to_host("buf")
        dist.reduce_scatter_tensor(b.comm("part"), b.comm("buf"))
        b.to_device("part")
    elif rank == 0:
        b.to_host("buf")
        dist.send(b.comm("buf"), 1)
        dist.recv(b.comm("buf"), 1)
        b.to_device("buf")
    elif rank == 1:
        dist.recv(b.comm("buf"), 0)
        b.to_device("buf")
        b.to_host("buf")
        dist.send(b.comm("buf"), 0)


def slowest_s(elapsed_s: float, device: torch.device) -> float:
    """The slowest rank's ``elapsed_s`` (a MAX all-reduce, on ``device``, outside the clock)."""
    import torch.distributed as dist

    slowest = torch.tensor([elapsed_s], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _time_ops(rig: Rig, rank: int, sizes_bytes: Sequence[int],
              repeats: int) -> dict[str, list[float]]:
    """This rank's part: the median (slowest rank's) time of each op at each size."""
    import torch.distributed as dist

    from bench_lib.rig import synchronize

    world = dist.get_world_size()
    sync = [rig.device(rank)]
    # The slowest rank's time is reduced where the collectives run: gloo takes host memory.
    clock_device = torch.device("cpu") if rig.backend == "gloo" else rig.device(rank)

    def once(op: str, b: Buffers) -> float:
        dist.barrier()
        synchronize(sync)
        t0 = time.perf_counter()
        run_op(op, rank, b)
        synchronize(sync)
        elapsed = slowest_s(time.perf_counter() - t0, clock_device)
        return elapsed / (2 if op == "send_recv" else 1)

    out: dict[str, list[float]] = {op: [] for op in OPS}
    for op in OPS:
        for nbytes in sizes_bytes:
            b = Buffers.make(rig, rank, nbytes, world)
            first = once(op, b)  # warm-up; its time sets the repetitions
            reps = max(MIN_REPEATS, min(repeats, int(BUDGET_S / max(first, 1e-9))))
            out[op].append(statistics.median(once(op, b) for _ in range(reps)))
    return out


def main(argv: list[str]) -> int:
    """One rank of the micro-benchmark (``measure`` starts them); rank 0 writes the result."""
    from bench_lib.pinning import pin_worker
    from bench_lib.process_groups import destroy_process_group, init_process_group

    rig, rank, folder = Rig.from_dict(json.loads(argv[0])), int(argv[1]), Path(argv[2])
    world = rig.num_devices
    # Every size a whole number of float32 elements per rank (all_gather, reduce_scatter).
    sizes = [max(world, int(float(s) * MIB) // (4 * world) * world) * 4
             for s in argv[3].split(",")]
    pin_worker(rig, rank)
    init_process_group(rig, rank, world, str(folder / "rendezvous"), TIMEOUT_S)
    code = 1
    try:
        times = _time_ops(rig, rank, sizes, int(argv[4]))
        if rank == 0:
            tmp = folder / "result.json.tmp"
            tmp.write_text(json.dumps({"sizes_bytes": sizes, "times_s": times}))
            tmp.rename(folder / "result.json")
        code = 0
    finally:
        # A failed rank runs no other collective and leaves the group without waiting on a
        # peer stuck in one (NCCL); its nonzero exit makes ``measure`` stop the others.
        destroy_process_group(code)
    return 0


if __name__ == "__main__":
    exit_lightly(main(sys.argv[1:]))
