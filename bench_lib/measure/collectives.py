"""The rig's collectives, measured once per run: time per size, and a latency-bandwidth fit.

Before the sweep (``cli.cmd_run``), one fresh process per device, pinned like the workers
(``rig.pin_worker``), joins a process group of its own (gloo on a cpu rig, NCCL on GPUs,
``rig.init_process_group`` with a timeout) and times, at each of ``SIZES_MIB`` (scaled
down to the sweep's largest message: ``sizes_for``)::

    all_reduce                 a buffer of n bytes on every rank
    all_gather_into_tensor     n bytes out (n / world in, per rank)
    reduce_scatter_tensor      n bytes in (n / world out, per rank)
    send_recv                  n bytes from rank 0 to rank 1: half a ping-pong

n is the size as nccl-tests counts it (its ``size`` column). One warm-up, then up to
``REPEATS`` repetitions (fewer for a slow size: ``BUDGET_S``), every one started together
(a barrier), the slowest rank's time kept (``all_reduce`` MAX of the times, outside the
clock); the median per size. Each collective is then fitted as t(n) = alpha + n / beta
(least squares over the sizes, ``fit_alpha_beta``): alpha the latency, beta the algorithm
bandwidth. ``busbw_gb_s`` is nccl-tests' bus bandwidth at the largest size, algbw times
2(w-1)/w for all_reduce, (w-1)/w for all_gather and reduce_scatter, 1 for send_recv.
``measure.bound`` prices a case's gradient and activation traffic with the fits.

Skipped (with a note in env.json ``collectives``) on a rig of one device, where no case of
the sweep is priced with it, in ``--dry-run``, on a multi-node run's other nodes (node 0
measures its own devices), and under ``--resume`` when env.json already holds it.

    python -m bench_lib.measure.collectives RIG_JSON RANK FOLDER SIZES_MIB REPEATS
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.rig import Rig
from bench_lib.run.forkserver import ForkServer, start_module

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
SIZES_MIB = (1.0, 8.0, 32.0, 100.0)
REPEATS = 5
BUDGET_S = 0.6
"""Seconds per (collective, size) after the warm-up: a slow size gets fewer repetitions
(at least ``MIN_REPEATS``), so the whole stays under ~10 s on a 2-core cpu rig."""
MIN_REPEATS = 3
TIMEOUT_S = 120.0
"""The whole micro-benchmark, process start included; also the process group's timeout."""
MIB = 2**20


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``op`` on ``world`` ranks."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of t = alpha + n / beta, least squares; alpha is held at 0
    where the free fit makes it negative (then the fit through the origin)."""
    n = len(sizes)
    if n == 0 or n != len(times):
        raise ValueError(f"need as many times as sizes, got {n} and {len(times)}")
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx if sxx else 0.0
    alpha = my - slope * mx
    if alpha < 0 or slope <= 0:
        alpha = 0.0
        slope = sum(x * y for x, y in zip(sizes, times)) / sum(x * x for x in sizes)
    return alpha, (1.0 / slope if slope > 0 else float("inf"))


@dataclass(frozen=True)
class CollectiveFit:
    """One collective's measured times and its fit t(n) = alpha + n / beta."""

    sizes_bytes: tuple[int, ...]
    """n per measurement, bytes, as nccl-tests' ``size`` (module docstring)."""
    times_s: tuple[float, ...]
    """Median time at each size (the slowest rank's per repetition), seconds."""
    alpha_s: float
    """Fitted latency per call, seconds."""
    beta_bytes_s: float
    """Fitted algorithm bandwidth, bytes per second."""
    busbw_gb_s: float
    """nccl-tests' bus bandwidth at the largest size, GB/s (1e9 bytes)."""

    def time_s(self, nbytes: float, calls: int = 1) -> float:
        """Predicted time of ``calls`` calls moving ``nbytes`` in all, seconds."""
        return calls * self.alpha_s + nbytes / self.beta_bytes_s

    def as_dict(self) -> dict[str, Any]:
        return {"sizes_bytes": list(self.sizes_bytes), "times_s": list(self.times_s),
                "alpha_s": self.alpha_s, "beta_bytes_s": self.beta_bytes_s,
                "busbw_gb_s": self.busbw_gb_s}

    @classmethod
    def of(cls, op: str, world: int, sizes: Sequence[int], times: Sequence[float]
           ) -> CollectiveFit:
        """Fit ``times`` (seconds) at ``sizes`` (bytes)."""
        alpha, beta = fit_alpha_beta([float(s) for s in sizes], times)
        big = max(range(len(sizes)), key=lambda i: sizes[i])
        busbw = sizes[big] / times[big] * bus_factor(op, world) / 1e9
        return cls(tuple(sizes), tuple(times), alpha, beta, busbw)


@dataclass(frozen=True)
class Collectives:
    """The rig's measured collectives (env.json ``collectives``), or why there are none."""

    fits: dict[str, CollectiveFit] = field(default_factory=dict)
    """``OPS`` name -> its fit."""
    backend: str = ""
    world_size: int = 0
    skipped: str = ""
    """Why nothing was measured (then ``fits`` is empty)."""
    wall_s: float = 0.0
    """How long the micro-benchmark took, process start included, seconds."""

    def fit(self, op: str) -> CollectiveFit | None:
        return self.fits.get(op)

    def summary(self) -> str:
        """``all_reduce 0.81 GB/s, ... bus bandwidth at 100 MiB (8.6 s)``, or why skipped."""
        if self.skipped:
            return f"skipped: {self.skipped}"
        rates = ", ".join(f"{op} {f.busbw_gb_s:.2f}" for op, f in self.fits.items())
        big = max((max(f.sizes_bytes) for f in self.fits.values()), default=0) / MIB
        return f"{rates} GB/s bus bandwidth at {big:.0f} MiB ({self.wall_s:.1f} s)"

    def as_dict(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        return {"backend": self.backend, "world_size": self.world_size,
                "wall_s": round(self.wall_s, 3), "model": "t(n) = alpha_s + n / beta_bytes_s",
                "ops": {op: f.as_dict() for op, f in self.fits.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Collectives:
        if not d:
            return cls(skipped="not measured")
        fits = {op: CollectiveFit(tuple(int(s) for s in f["sizes_bytes"]),
                                  tuple(float(t) for t in f["times_s"]), float(f["alpha_s"]),
                                  float(f["beta_bytes_s"]), float(f["busbw_gb_s"]))
                for op, f in (d.get("ops") or {}).items()}
        return cls(fits, str(d.get("backend") or ""), int(d.get("world_size") or 0),
                   str(d.get("skipped") or ""), float(d.get("wall_s") or 0.0))


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
        procs = [start_module(server, "bench_lib.measure.collectives",
                              [json.dumps(rig.as_dict()), str(rank), folder, sizes,
                               str(repeats)], log_path)
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
    return Collectives(fits, rig.backend, world, wall_s=time.monotonic() - start)


def _time_ops(rig: Rig, rank: int, sizes_bytes: Sequence[int],
              repeats: int) -> dict[str, list[float]]:
    """This rank's part: the median (slowest rank's) time of each op at each size."""
    import torch
    import torch.distributed as dist

    from bench_lib.rig import synchronize

    world = dist.get_world_size()
    device = rig.device(rank)
    sync = [device]

    def once(op: str, buf: torch.Tensor, part: torch.Tensor) -> float:
        dist.barrier()
        synchronize(sync)
        t0 = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(buf)
        elif op == "all_gather":
            dist.all_gather_into_tensor(buf, part)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(part, buf)
        elif rank == 0:  # send_recv: a ping-pong between ranks 0 and 1, halved
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        synchronize(sync)
        elapsed = time.perf_counter() - t0
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest.item()) / (2 if op == "send_recv" else 1)

    out: dict[str, list[float]] = {op: [] for op in OPS}
    for op in OPS:
        for nbytes in sizes_bytes:
            numel = nbytes // 4
            buf = torch.ones(numel, dtype=torch.float32, device=device)
            part = torch.ones(numel // world, dtype=torch.float32, device=device)
            first = once(op, buf, part)  # warm-up; its time sets the repetitions
            reps = max(MIN_REPEATS, min(repeats, int(BUDGET_S / max(first, 1e-9))))
            out[op].append(statistics.median(once(op, buf, part) for _ in range(reps)))
    return out


def main(argv: list[str]) -> int:
    """One rank of the micro-benchmark (``measure`` starts them); rank 0 writes the result."""
    from bench_lib.rig import init_process_group, pin_worker

    rig, rank, folder = Rig.from_dict(json.loads(argv[0])), int(argv[1]), Path(argv[2])
    world = rig.num_devices
    # Every size a whole number of float32 elements per rank (all_gather, reduce_scatter).
    sizes = [max(world, int(float(s) * MIB) // (4 * world) * world) * 4
             for s in argv[3].split(",")]
    pin_worker(rig, rank)
    init_process_group(rig, rank, world, str(folder / "rendezvous"), TIMEOUT_S)
    import torch.distributed as dist

    try:
        times = _time_ops(rig, rank, sizes, int(argv[4]))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        tmp = folder / "result.json.tmp"
        tmp.write_text(json.dumps({"sizes_bytes": sizes, "times_s": times}))
        tmp.rename(folder / "result.json")
    return 0


if __name__ == "__main__":
    from bench_lib.run.lifeline import exit_lightly

    exit_lightly(main(sys.argv[1:]))
