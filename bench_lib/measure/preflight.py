"""Pre-flight checks before a cuda sweep: what breaks multi-GPU boxes, found in seconds
instead of hours into a sweep.

    preflight.check(rig)        # prints warnings; raises PreflightError (exit 2) on a failure

- ``dev_shm``: NCCL's shared-memory transport lives in /dev/shm, and Docker gives a container
  64 MiB unless run with ``--shm-size`` or ``--ipc=host``: where NCCL runs between more than
  one GPU, under ``SHM_MIN_MIB`` fails (a warning where ``NCCL_SHM_DISABLE=1`` keeps NCCL off
  it). The slots of ``--gpu-slots`` (and a cpu rig's workers) talk gloo: no NCCL, no check.
- ``nvml``: the sampler's view of the GPUs (their bus ids, without a CUDA context): without
  NVML the GPU utilisation and energy columns would be empty; so would they on a machine
  of mixed GPUs under a user's CUDA_DEVICE_ORDER other than ``PCI_BUS_ID`` (which a command
  sets where it is unset: ``nvml.order_cuda_by_bus``), where NVML cannot tell which GPU
  CUDA numbers i.
  It counts physical GPUs (``Rig.num_gpus``: two slots on one GPU need one).
- ``cuda_smoke``: on any cuda rig (one GPU, slots included), one fresh process per physical
  GPU starts CUDA there, runs a small matrix product and a convolution, synchronises and
  checks them against the CPU (``measure.cuda_smoke``), under a timeout: a driver too old
  for this torch's CUDA, a GPU the wheel has no kernels for, a container without its GPUs
  stop the run here, with what to do, instead of making every case an error.
- ``all_reduce`` (more than one device, after a passed smoke test): one process per device,
  joined through the workers' own ``process_groups.init_process_group`` (NCCL on GPUs,
  gloo on a cpu rig), a short all-reduce checked against its expected sum, a barrier, under
  a timeout: a hang (P2P broken by ACS or an IOMMU, a blocked interface) or a crash stops
  the run before any case.
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
SMOKE_TIMEOUT_S = 180.0
"""How long the CUDA smoke test's processes get: torch's import, CUDA's start, and a driver
that JIT-compiles the wheel's PTX for a GPU it has no binary for (slow once, then cached)."""
SMOKE_MODULE = "bench_lib.measure.cuda_smoke"
ELEMENTS = 2**22
"""fp32 elements all-reduced (16 MiB: past NCCL's small-message paths)."""
SETTLE_S = 5.0
"""Wait after the checks that ran on the GPUs, so that the idle power measured next sees
idle GPUs."""
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


def shm_check(rig: Rig, shm: Mapping[str, Any],
              environ: Mapping[str, str] | None = None) -> Check:
    """Whether /dev/shm (``shm``: ``environment.shm_size``'s record) is big enough for NCCL
    between the rig's GPUs: physical GPUs, where NCCL runs (``Rig.backend``)."""
    env = os.environ if environ is None else environ
    path = shm.get("path", "/dev/shm")
    if rig.backend != "nccl":
        between = "GPU slots" if rig.kind == "cuda" else "workers"
        return Check("dev_shm", "ok", f"the {between} talk {rig.backend}: NCCL's shared-memory "
                     "transport is not used")
    world_size = rig.num_gpus
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
    from bench_lib.nvml import CudaOrderUnknown, cuda_visible_gpus

    env = os.environ if environ is None else environ
    try:
        gpus = cuda_visible_gpus(nvml, env)
    except CudaOrderUnknown as e:
        return Check("nvml", "warn", f"{e}: GPU utilisation, power and energy will be empty")
    except Exception as e:
        return Check("nvml", "warn", f"NVML unavailable ({type(e).__name__}: {e}): GPU "
                     "utilisation, power and energy will be empty")
    if len(gpus) < rig.num_gpus:  # GPUs, not slots: two slots on one GPU need one
        return Check("nvml", "warn", f"NVML sees {len(gpus)} of the rig's {rig.num_gpus} "
                     "GPUs: the others' utilisation and energy will be empty")
    buses = ", ".join(f"{g.cuda_index}: {g.bus_id}" for g in gpus[:rig.num_gpus])
    return Check("nvml", "ok", f"bus ids {buses}")


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-LOG_TAIL_LINES:])


def _start(commands: Sequence[Sequence[str]], log_path: Path) -> list[subprocess.Popen[bytes]]:
    """Start ``commands`` in one new process group (the first leads it), output to
    ``log_path``. Each child is given this process's pid and ties itself to it as it starts
    (no preexec_fn: see processes.lifeline.die_with_parent), so none outlives an interrupted
    check; where one cannot start, the started ones are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log_path.open("ab") as log:
            for cmd in commands:
                procs.append(subprocess.Popen(
                    list(cmd), stdout=log, stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    process_group=procs[0].pid if procs else 0))
    except BaseException:
        if procs:
            _wait(procs, 0.0)
        raise
    return procs


def _read_results(paths: Sequence[Path]) -> dict[int, dict[str, Any]]:
    """The JSON results the children wrote, by position (a missing or torn one left out)."""
    results: dict[int, dict[str, Any]] = {}
    for i, path in enumerate(paths):
        try:
            results[i] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return results


def _exit_text(code: int | None) -> str:
    return (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
            else f"exited with code {code}")


def _wait(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float,
          grace_s: float = GRACE_S) -> bool:
    """Wait for every process; False when the timeout came first. After one fails, the
    others get ``grace_s``. Kills the whole process group whatever happens (hung peers,
    their children), and reaps every process."""
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
            if failed_at is not None and now - failed_at > grace_s:
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
        paths = [folder / f"rank{rank}.json" for rank in range(world)]
        start = time.monotonic()
        procs = _start([[*base, json.dumps(rig.as_dict()), str(rank), str(world),
                         str(folder / "rendezvous"), str(paths[rank]), str(timeout_s),
                         str(os.getpid())] for rank in range(world)], log_path)
        finished = _wait(procs, timeout_s)
        seconds = time.monotonic() - start
        tail = _tail(log_path)
        results = _read_results(paths)
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
            errors.append(f"rank {rank} {_exit_text(proc.returncode)} without a result")
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


@dataclass(frozen=True)
class SmokeRun:
    """What the CUDA smoke test's processes left (``smoke_results``)."""

    finished: bool
    """False: the timeout came first (every process was killed)."""
    results: dict[int, dict[str, Any]]
    """GPU index -> the result its process wrote (``cuda_smoke.smoke_device``)."""
    codes: list[int | None]
    """Each GPU's process's exit code (negative: killed by that signal)."""
    tail: str
    """The last lines of their log."""
    seconds: float


def smoke_results(rig: Rig, timeout_s: float = SMOKE_TIMEOUT_S,
                  command: Sequence[str] | None = None) -> SmokeRun:
    """Run ``measure.cuda_smoke`` on each physical GPU of ``rig`` (``Rig.num_gpus``: once
    per GPU however many slots share it), one fresh process each, all at once."""
    base = list(command or [sys.executable, "-m", SMOKE_MODULE])
    gpus = range(rig.num_gpus)
    with tempfile.TemporaryDirectory(prefix="parabench-smoke-") as tmp:
        folder = Path(tmp)
        log_path = folder / "smoke.log"
        paths = [folder / f"gpu{g}.json" for g in gpus]
        start = time.monotonic()
        procs = _start([[*base, f"cuda:{g}", str(paths[g]), str(os.getpid())] for g in gpus],
                       log_path)
        finished = _wait(procs, timeout_s, grace_s=timeout_s)  # each GPU says its own
        return SmokeRun(finished, _read_results(paths), [p.returncode for p in procs],
                        _tail(log_path), time.monotonic() - start)


def cuda_smoke(rig: Rig, timeout_s: float = SMOKE_TIMEOUT_S,
               command: Sequence[str] | None = None) -> Check:
    """``cuda_smoke``: whether CUDA works on every GPU of ``rig`` (``smoke_results``), and
    where not, what failed and what to do about it (``cuda_smoke.advice``)."""
    from bench_lib.measure.cuda_smoke import advice, describe

    found = smoke_results(rig, timeout_s, command)
    log = f" (log: {found.tail})" if found.tail else ""
    if not found.finished:
        return Check("cuda_smoke", "fail", f"CUDA's start on the {rig.num_gpus} GPU(s) did "
                     f"not finish within {timeout_s:g} s: a hang in the driver, or the driver "
                     "JIT-compiling this torch's PTX for a GPU it has no kernels for (slow "
                     f"once, then cached), killed{log}")
    errors, texts = [], [found.tail]
    for g, code in enumerate(found.codes):
        result = found.results.get(g)
        if result is None:
            errors.append(f"cuda:{g}: the process {_exit_text(code)} without a result")
        elif not result.get("ok"):
            errors.append(f"{describe(result)}: {result.get('error')}")
            texts += [str(result.get("error")), *result.get("warnings", [])]
    if errors:
        what = advice(" ".join(texts))
        torch_cuda = next((f" (torch {r['torch']}, CUDA {r['torch_cuda']}, kernels for "
                           f"{' '.join(r['arch_list'])})" for r in found.results.values()
                           if r.get("arch_list")), "")
        return Check("cuda_smoke", "fail", f"CUDA does not work here{torch_cuda}: "
                     f"{'; '.join(errors)}{f'. {what}' if what else ''}{log}")
    gpus = ", ".join(describe(found.results[g]) for g in sorted(found.results))
    return Check("cuda_smoke", "ok", f"a matrix product and a convolution on {gpus} in "
                 f"{found.seconds:.1f} s, process start included")


def run(rig: Rig, timeout_s: float = TIMEOUT_S, environ: Mapping[str, str] | None = None,
        shm: Mapping[str, Any] | None = None, nvml: Any = None,
        command: Sequence[str] | None = None, smoke_timeout_s: float = SMOKE_TIMEOUT_S,
        smoke_command: Sequence[str] | None = None) -> list[Check]:
    """Every check for ``rig`` (``shm``: /dev/shm's record, default measured). The all-reduce
    runs only where CUDA passed its smoke test (it would fail the same way, slower)."""
    from bench_lib.measure.environment import shm_size

    checks = [shm_check(rig, shm_size() if shm is None else shm, environ)]
    if rig.kind == "cuda":
        checks.append(nvml_check(rig, nvml, environ))
        checks.append(cuda_smoke(rig, smoke_timeout_s, smoke_command))
    cuda_broken = any(c.name == "cuda_smoke" and c.status == "fail" for c in checks)
    if rig.num_devices > 1 and not cuda_broken:
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
    if rig.kind == "cuda" and any(c.name in ("cuda_smoke", "all_reduce") for c in checks):
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

    from bench_lib.process_groups import init_process_group
    from bench_lib.rig import synchronize

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
    from bench_lib.results.store import write_json_atomic

    write_json_atomic(result_path, out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    from bench_lib.processes.lifeline import exit_lightly

    exit_lightly(_rank(sys.argv[1:]))
