"""Pre-flight checks before a cuda sweep: what breaks multi-GPU boxes, found in seconds
instead of hours into a sweep.

    preflight.check(rig)        # prints warnings; raises PreflightError (exit 2) on a failure

- ``dev_shm``: NCCL's shared-memory transport lives in /dev/shm, and Docker gives a container
  64 MiB unless run with ``--shm-size`` or ``--ipc=host``: with more than one GPU, under
  ``SHM_MIN_MIB`` fails (a warning where ``NCCL_SHM_DISABLE=1`` keeps NCCL off it).
- ``nvml``: the sampler's view of the GPUs (their bus ids, without a CUDA context): without
  NVML the GPU utilisation and energy columns would be empty; on a machine of mixed GPUs
  without ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` the sampler may read other GPUs than the workers'.
- ``all_reduce``: one process per device, joined through the workers' own
  ``rig.init_process_group`` (NCCL on GPUs, gloo on a cpu rig), a short all-reduce checked
  against its expected sum, a barrier, under a timeout: a hang (P2P broken by ACS or an
  IOMMU, a blocked interface) or a crash stops the run before any case.
- ``peer_access``: which GPU pairs reach each other directly (CUDA, in those processes):
  a pair without is a warning (NCCL then goes through host memory: slower, not wrong).

The ranks run in child processes, one process group, killed whole on timeout; the runner
itself never touches CUDA. ``command`` replaces the child's command line (tests hang it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_lib.rig import Rig, RigError

SHM_MIN_MIB = 512.0
"""/dev/shm smaller than this fails the pre-flight of a multi-GPU rig."""
TIMEOUT_S = 120.0
"""How long the all-reduce's processes get, torch's import and NCCL's setup included."""
ELEMENTS = 2**22
"""fp32 elements all-reduced (16 MiB: past NCCL's small-message paths)."""
SETTLE_S = 5.0
"""Wait after the all-reduce, so that the idle power measured next sees idle GPUs."""
POLL_S = 0.1
GRACE_S = 10.0
"""After one rank fails, how long its peers get to exit on their own."""
LOG_TAIL_LINES = 3


class PreflightError(RigError):
    """The rig failed its pre-flight: the sweep would fail or hang (exit 2)."""


@dataclass(frozen=True)
class Check:
    """One pre-flight check's verdict."""

    name: str
    status: str
    """``ok``, ``warn`` (the run goes on) or ``fail`` (the run stops)."""
    detail: str


def shm_check(world_size: int, shm: Mapping[str, Any],
              environ: Mapping[str, str] | None = None) -> Check:
    """Whether /dev/shm (``shm``: ``environment.shm_size``'s record) is big enough for NCCL
    between ``world_size`` GPUs."""
    env = os.environ if environ is None else environ
    path = shm.get("path", "/dev/shm")
    if world_size < 2:
        return Check("dev_shm", "ok", "one GPU: NCCL does not use shared memory")
    if "total_mib" not in shm:
        return Check("dev_shm", "warn", f"{path} cannot be read ({shm.get('unsupported')}): "
                     "NCCL's shared-memory transport may fail")
    total = float(shm["total_mib"])
    if total >= SHM_MIN_MIB:
        return Check("dev_shm", "ok", f"{path} is {total:.0f} MiB")
    small = (f"{path} is {total:.0f} MiB, under {SHM_MIN_MIB:.0f} MiB (Docker's default is "
             "64 MiB)")
    if env.get("NCCL_SHM_DISABLE") == "1":
        return Check("dev_shm", "warn", f"{small}; NCCL_SHM_DISABLE=1 keeps NCCL off it")
    return Check("dev_shm", "fail",
                 f"{small}: NCCL's shared-memory transport between the {world_size} GPUs can "
                 "fail or hang there. Give the container more (docker run --shm-size=1g, or "
                 "--ipc=host), or set NCCL_SHM_DISABLE=1 to keep NCCL off /dev/shm (slower "
                 "where GPUs have no peer access)")


def nvml_check(rig: Rig, nvml: Any = None, environ: Mapping[str, str] | None = None) -> Check:
    """Whether the runner's sampler can read the rig's GPUs through NVML (a warning if not)."""
    from bench_lib.nvml import cuda_visible_gpus

    env = os.environ if environ is None else environ
    try:
        gpus = cuda_visible_gpus(nvml, env)
    except Exception as e:
        return Check("nvml", "warn", f"NVML unavailable ({type(e).__name__}: {e}): GPU "
                     "utilisation, power and energy will be empty")
    if len(gpus) < rig.num_devices:
        return Check("nvml", "warn", f"NVML sees {len(gpus)} of the rig's {rig.num_devices} "
                     "GPUs: the others' utilisation and energy will be empty")
    mine = gpus[:rig.num_devices]
    buses = ", ".join(f"{g.cuda_index}: {g.bus_id}" for g in mine)
    if len({g.name for g in mine}) > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return Check("nvml", "warn", f"mixed GPUs ({', '.join(sorted({g.name for g in mine}))})"
                     " without CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA may number them otherwise "
                     f"than the sampler assumes ({buses}); set it for a run")
    return Check("nvml", "ok", f"bus ids {buses}")


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-LOG_TAIL_LINES:])


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """Wait for every process; False when the timeout came first. Kills the whole process
    group whatever happens (hung peers, their children), and reaps every process."""
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return True
            now = time.monotonic()
            if now > deadline:
                return False
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > GRACE_S:
                return True  # a rank failed and its peers hang on it: its error says why
            time.sleep(POLL_S)
    finally:
        try:
            os.killpg(procs[0].pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs:
            p.wait()


def all_reduce(rig: Rig, timeout_s: float = TIMEOUT_S,
               command: Sequence[str] | None = None) -> list[Check]:
    """All-reduce across the rig's devices in child processes (``all_reduce``), and on a
    cuda rig which GPU pairs have peer access (``peer_access``)."""
    world = rig.num_devices
    backend = rig.backend
    what = (f"{backend} all-reduce between the {world} "
            f"{'workers' if rig.kind != 'cuda' else 'GPUs' if rig.gpu_slots == 1 else 'GPU slots'}")
    base = list(command or [sys.executable, "-m", "bench_lib.measure.preflight"])
    with tempfile.TemporaryDirectory(prefix="parabench-preflight-") as tmp:
        folder = Path(tmp)
        log_path = folder / "ranks.log"
        procs: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        try:
            with log_path.open("ab") as log:
                for rank in range(world):
                    # The rank ties itself to this process as it starts (no preexec_fn: see
                    # processes.lifeline.die_with_parent), so no rank outlives an interrupted check.
                    args = [json.dumps(rig.as_dict()), str(rank), str(world),
                            str(folder / "rendezvous"), str(folder / f"rank{rank}.json"),
                            str(timeout_s), str(os.getpid())]
                    procs.append(subprocess.Popen(
                        [*base, *args], stdout=log, stderr=subprocess.STDOUT,
                        env=dict(os.environ, PYTHONUNBUFFERED="1"),
                        process_group=procs[0].pid if procs else 0))
        except BaseException:  # a rank could not start: the started ones go too
            if procs:
                _wait(procs, 0.0)
            raise
        finished = _wait(procs, timeout_s)
        seconds = time.monotonic() - start
        tail = _tail(log_path)
        results: dict[int, dict[str, Any]] = {}
        for rank in range(world):
            try:
                results[rank] = json.loads((folder / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                pass
    hint = ("; rerun with NCCL_DEBUG=INFO to see where NCCL stops (NCCL_P2P_DISABLE=1 or "
            "NCCL_SHM_DISABLE=1 tell a broken transport)" if backend == "nccl" else "")
    if not finished:
        return [Check("all_reduce", "fail",
                      f"{what} did not finish within {timeout_s:g} s: a hang, killed"
                      f"{f' (log: {tail})' if tail else ''}{hint}")]
    errors = []
    for rank, proc in enumerate(procs):
        result = results.get(rank)
        if result is None:
            code = proc.returncode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            errors.append(f"rank {rank} {how} without a result")
        elif not result.get("ok"):
            why = result.get("error") or (f"wrong sum {result.get('value')} (expected "
                                          f"{world * (world + 1) / 2:g})")
            errors.append(f"rank {rank}: {why}")
    if errors:
        return [Check("all_reduce", "fail", f"{what} failed: {'; '.join(errors)}"
                      f"{f' (log: {tail})' if tail else ''}{hint}")]
    checks = [Check("all_reduce", "ok", f"{what}: {4 * ELEMENTS / 2**20:.0f} MiB in "
                    f"{seconds:.1f} s, process start included")]
    peers: dict[str, bool] = results[0].get("peer_access") or {}
    if peers:
        without = sorted(pair for pair, ok in peers.items() if not ok)
        checks.append(Check(
            "peer_access", "warn" if without else "ok",
            f"no peer access between GPUs {', '.join(without)}: NCCL goes through host memory "
            "(slower; an ACS/IOMMU setting or GPUs under different CPUs)" if without
            else f"every pair ({', '.join(sorted(peers))})"))
    return checks


def run(rig: Rig, timeout_s: float = TIMEOUT_S, environ: Mapping[str, str] | None = None,
        shm: Mapping[str, Any] | None = None, nvml: Any = None,
        command: Sequence[str] | None = None) -> list[Check]:
    """Every check for ``rig`` (``shm``: /dev/shm's record, default measured)."""
    from bench_lib.measure.environment import shm_size

    checks = [shm_check(rig.num_devices, shm_size() if shm is None else shm, environ)]
    if rig.kind == "cuda":
        checks.append(nvml_check(rig, nvml, environ))
    if rig.num_devices > 1:
        checks += all_reduce(rig, timeout_s, command)
    return checks


def check(rig: Rig, quiet: bool = False, **kwargs: Any) -> list[Check]:
    """``run``'s checks, warnings printed (unless ``quiet``); raises ``PreflightError``
    naming every failure (the command line exits 2 before the run folder exists)."""
    if not quiet:
        print(f"pre-flight of rig {rig.label} ...", file=sys.stderr)
    checks = run(rig, **kwargs)
    for c in checks:
        if c.status == "warn" and not quiet:
            print(f"pre-flight warning: {c.name}: {c.detail}", file=sys.stderr)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightError(f"pre-flight of rig {rig.label} failed; no case was run: "
                             + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    if rig.kind == "cuda" and any(c.name == "all_reduce" for c in checks):
        time.sleep(SETTLE_S)  # the GPUs' clocks and power back to idle before idle power
    return checks


def _rank(argv: Sequence[str]) -> int:
    """One rank of ``all_reduce`` (``python -m bench_lib.measure.preflight RIG RANK WORLD
    INIT_FILE RESULT_FILE TIMEOUT_S [PARENT_PID]``): writes its result as JSON, exits 0 when
    right; with PARENT_PID, first asks to die with that process (exit 4 if it is gone)."""
    from bench_lib.processes.lifeline import EXIT_ORPHANED, die_with_parent

    if len(argv) > 6 and not die_with_parent(int(argv[6])):
        return EXIT_ORPHANED
    import torch
    import torch.distributed as dist

    from bench_lib.rig import init_process_group, synchronize

    rig = Rig.from_dict(json.loads(argv[0]))
    rank, world, init_file, result_path = int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    out: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        init_process_group(rig, rank, world, init_file, float(argv[5]))
        device = rig.device(rank)
        x = torch.full((ELEMENTS,), float(rank + 1), device=device)
        dist.all_reduce(x)
        synchronize([device])
        expected = world * (world + 1) / 2
        out |= {"value": float(x[0]), "ok": bool((x == expected).all())}
        dist.barrier()
        if rig.kind == "cuda" and rank == 0:
            gpus = rig.num_gpus  # with --gpu-slots, slots on one GPU need no peer access
            try:
                out["peer_access"] = {f"{i}-{j}": bool(torch.cuda.can_device_access_peer(i, j))
                                      for i in range(gpus) for j in range(gpus) if i != j}
            except Exception as e:  # not the all-reduce's failure: no peer figure, and why
                out["peer_access_error"] = f"{type(e).__name__}: {e}"
        dist.destroy_process_group()
    except Exception as e:
        out |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(result_path)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    from bench_lib.processes.lifeline import exit_lightly

    exit_lightly(_rank(sys.argv[1:]))
