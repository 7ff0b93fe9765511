"""The pre-flight's probes, the checks that start processes (``measure.preflight`` runs
them): the CUDA smoke test on each physical GPU (``cuda_smoke``; the child's side is
``measure.cuda_smoke``), the copies between GPUs (``peer_copy``; the child's side is
``cuda_smoke.copy_check``) and the all-reduce across the rig's devices (``all_reduce``; run
with ``-m``, this module is one of its ranks), with the GPU pairs' peer access.

The children run in one process group of their own, killed whole on timeout; the runner
itself never touches CUDA. ``command`` replaces the children's command line (tests hang
it).
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

from bench_lib.measure.preflight_static import Check
from bench_lib.rig import Rig

TIMEOUT_S = 20.0
"""How long the all-reduce gets once every rank has joined its group (a healthy box takes
well under a second): with its one retry, the pre-flight of a box whose all-reduce hangs
stays within a minute."""
JOIN_TIMEOUT_S = 40.0
"""How long the all-reduce's ranks get to start and join their group (torch's import, CUDA's
start, NCCL's communicator: seconds on a healthy box, more where NCCL compiles its kernels
for a GPU its build lacks). Counted apart from ``TIMEOUT_S`` so that a slow start is not
taken for a hang of the all-reduce, which would switch peer-to-peer off for nothing."""
JOINED = ".joined"
"""Suffix of the file a rank creates beside its result file once its group is up."""
COPY_TIMEOUT_S = 20.0
"""How long the copies between GPUs get (``peer_copy``), CUDA's start included."""
SMOKE_TIMEOUT_S = 180.0
"""How long the CUDA smoke test's processes get: torch's import, CUDA's start, and a driver
that JIT-compiles the wheel's PTX for a GPU it has no binary for (slow once, then cached)."""
SMOKE_MODULE = "bench_lib.measure.cuda_smoke"
ELEMENTS = 2**22
"""fp32 elements all-reduced (16 MiB: past NCCL's small-message paths)."""
POLL_S = 0.1
NCCL_HINT = ("; rerun with NCCL_DEBUG=INFO to see where NCCL stops (NCCL_P2P_DISABLE=1 or "
             "NCCL_SHM_DISABLE=1 tell a broken transport)")
GRACE_S = 10.0
"""After one rank fails, how long its peers get to exit on their own."""
LOG_TAIL_LINES = 3


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-LOG_TAIL_LINES:])


def _start(commands: Sequence[Sequence[str]], log_path: Path,
           env: Mapping[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """Start ``commands`` in one new process group (the first leads it), output to
    ``log_path``, with ``env`` added to this process's environment. Each child is given
    this process's pid and ties itself to it as it starts (no preexec_fn: see
    processes.lifeline.die_with_parent), so none outlives an interrupted check; where one
    cannot start, the started ones are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log_path.open("ab") as log:
            for cmd in commands:
                procs.append(subprocess.Popen(
                    list(cmd), stdout=log, stderr=subprocess.STDOUT,
                    env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
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
          grace_s: float = GRACE_S, joined: Sequence[Path] = (),
          join_timeout_s: float = 0.0) -> bool:
    """Wait for every process; False when the timeout came first. After one fails, the
    others get ``grace_s``. With ``joined`` (files the processes create once started), they
    get ``join_timeout_s`` to create them all, then ``timeout_s`` from there. Kills the
    whole process group whatever happens (hung peers, their children), and reaps every
    process."""
    deadline = time.monotonic() + (join_timeout_s if joined else timeout_s)
    waiting_to_join = bool(joined)
    failed_at: float | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return True
            now = time.monotonic()
            if waiting_to_join and all(path.exists() for path in joined):
                waiting_to_join, deadline = False, now + timeout_s
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


def all_reduce(rig: Rig, timeout_s: float = TIMEOUT_S, command: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None,
               join_timeout_s: float | None = None) -> list[Check]:
    """All-reduce across the rig's devices in child processes (``all_reduce``; its
    ``fault``: ``hang``, ``wrong_sum`` or ``error``), and on a cuda rig which GPU pairs have
    peer access (``peer_access``). ``env``: variables the ranks get (``NCCL_P2P_DISABLE``).
    The ranks get ``join_timeout_s`` (default ``JOIN_TIMEOUT_S``) to join their group, then
    ``timeout_s`` for the all-reduce: a hang says in which of the two it was (``fault``
    ``start`` or ``hang``)."""
    join_timeout_s = JOIN_TIMEOUT_S if join_timeout_s is None else join_timeout_s
    world = rig.num_devices
    backend = rig.backend
    what = (f"{backend} all-reduce between the {world} "
            f"{'workers' if rig.kind != 'cuda' else 'GPUs' if rig.gpu_slots == 1 else 'GPU slots'}"
            + "".join(f" with {k}={v}" for k, v in (env or {}).items()))
    base = list(command or [sys.executable, "-m", "bench_lib.measure.preflight_probes"])
    with tempfile.TemporaryDirectory(prefix="parabench-preflight-") as tmp:
        folder = Path(tmp)
        log_path = folder / "ranks.log"
        paths = [folder / f"rank{rank}.json" for rank in range(world)]
        start = time.monotonic()
        procs = _start([[*base, json.dumps(rig.as_dict()), str(rank), str(world),
                         str(folder / "rendezvous"), str(paths[rank]), str(timeout_s),
                         str(os.getpid())] for rank in range(world)], log_path, env)
        joined = [path.with_name(path.name + JOINED) for path in paths]
        finished = _wait(procs, timeout_s, joined=joined, join_timeout_s=join_timeout_s)
        seconds = time.monotonic() - start
        tail = _tail(log_path)
        results = _read_results(paths)
        missing = [rank for rank, path in enumerate(joined) if not path.exists()]
    hint = NCCL_HINT if backend == "nccl" else ""
    if not finished:
        where = (f"did not finish within {timeout_s:g} s of joining its group" if not missing
                 else f"did not start: rank {', '.join(map(str, missing))} had not joined "
                      f"the group within {join_timeout_s:g} s")
        return [Check("all_reduce", "fail", f"{what} {where}: a hang, killed"
                      f"{f' (log: {tail})' if tail else ''}{hint}",
                      "hang" if not missing else "start")]
    errors, faults = [], set()
    for rank, proc in enumerate(procs):
        result = results.get(rank)
        if result is None:
            errors.append(f"rank {rank} {_exit_text(proc.returncode)} without a result")
        elif not result.get("ok"):
            why = result.get("error") or (f"wrong sum {result.get('value')} (expected "
                                          f"{world * (world + 1) / 2:g})")
            errors.append(f"rank {rank}: {why}")
            faults.add("error" if result.get("error") else "wrong_sum")
    if errors:
        return [Check("all_reduce", "fail", f"{what} failed: {'; '.join(errors)}"
                      f"{f' (log: {tail})' if tail else ''}{hint}",
                      "wrong_sum" if faults == {"wrong_sum"} else "error")]
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


def peer_copy(rig: Rig, timeout_s: float = COPY_TIMEOUT_S,
              command: Sequence[str] | None = None) -> Check:
    """``peer_copy``: a known pattern copied between every two GPUs of ``rig``, both ways
    and back, in one child process (``cuda_smoke.copy_check``), every copy checked on the
    host: a silent corruption (``fault`` ``corrupt``) or a copy that hangs stops the run."""
    base = list(command or [sys.executable, "-m", SMOKE_MODULE])
    devices = ",".join(f"cuda:{g}" for g in range(rig.num_gpus))
    with tempfile.TemporaryDirectory(prefix="parabench-copy-") as tmp:
        log_path, path = Path(tmp) / "copy.log", Path(tmp) / "copy.json"
        start = time.monotonic()
        procs = _start([[*base, devices, str(path), str(os.getpid())]], log_path)
        finished = _wait(procs, timeout_s)
        seconds, tail = time.monotonic() - start, _tail(log_path)
        result = _read_results([path]).get(0)
    log = f" (log: {tail})" if tail else ""
    what = f"copies between GPUs {devices}"
    if not finished:
        return Check("peer_copy", "fail", f"{what} did not finish within {timeout_s:g} s: a "
                     f"peer copy that hangs, killed{log}", "hang")
    if result is None or result.get("error"):
        why = (result or {}).get("error") or (f"the process {_exit_text(procs[0].returncode)}"
                                              " without a result")
        return Check("peer_copy", "fail", f"{what} failed: {why}{log}", "error")
    corrupt: list[dict[str, Any]] = result.get("corrupt") or []
    if corrupt:
        first = corrupt[0]
        return Check("peer_copy", "fail", (
            f"{what}: {len(corrupt)} of {result.get('copies')} copies came back wrong, with no "
            f"error (silent corruption): first {first['path']} {first['dtype']} by "
            f"{first['way']}: {first['wrong']:,} of {first['of']:,} elements wrong from "
            f"index {first['first']:,}, checksum {first['checksum']} (expected "
            f"{first['expected']})"), "corrupt")
    return Check("peer_copy", "ok", (
        f"{result.get('copies')} copies of {result.get('mib', 0):g} MiB of known patterns "
        f"between GPUs {devices}, each way and back, by .to() and copy_(non_blocking=True), "
        f"every one right on the host, in {seconds:.1f} s, process start included"))


@dataclass(frozen=True)
class SmokeProcesses:
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
                  command: Sequence[str] | None = None) -> SmokeProcesses:
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
        return SmokeProcesses(finished, _read_results(paths), [p.returncode for p in procs],
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


def _rank(argv: Sequence[str]) -> int:
    """One rank of ``all_reduce`` (``python -m bench_lib.measure.preflight_probes RIG RANK
    WORLD INIT_FILE RESULT_FILE TIMEOUT_S [PARENT_PID]``): writes its result as JSON, exits 0
    when right; with PARENT_PID, first asks to die with that process (exit 4 if it is gone)."""
    from bench_lib.processes.lifeline import EXIT_ORPHANED, die_with_parent

    if len(argv) > 6 and not die_with_parent(int(argv[6])):
        return EXIT_ORPHANED
    import torch
    import torch.distributed as dist

    from bench_lib.process_groups import destroy_process_group, init_process_group
    from bench_lib.rig import synchronize

    rig = Rig.from_dict(json.loads(argv[0]))
    rank, world, init_file, result_path = int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    out: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        init_process_group(rig, rank, world, init_file, float(argv[5]))
        # NCCL's communicator is up (init_process_group creates it eagerly): from here the
        # parent counts the all-reduce's own time (JOIN_TIMEOUT_S, TIMEOUT_S).
        result_path.with_name(result_path.name + JOINED).touch()
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
    except Exception as e:  # no collective follows: the result, then the group left
        out |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
    from bench_lib.results.store import write_json_atomic

    write_json_atomic(result_path, out)
    code = 0 if out["ok"] else 1
    # Not waited for past its bound: a failed rank's peers may be stuck in the all-reduce
    # (NCCL); its exit starts the parent's grace for them (``_wait``).
    destroy_process_group(code)
    return code


if __name__ == "__main__":
    from bench_lib.processes.lifeline import exit_lightly

    exit_lightly(_rank(sys.argv[1:]))
