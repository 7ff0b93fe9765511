"""What a run folder records about the machine and software it ran on (env.json)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torchvision

from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.rig import CpuTopology, Rig, available_cores, read_cpu_topology, set_math_mode

# Test-only hooks (bench_lib.run.faults): a run made with one is not a real measurement.
TEST_FAULT_ENV = "PARABENCH_TEST_FAULT"
INJECT_SLOWDOWN_ENV = "PARABENCH_INJECT_SLOWDOWN"
TEST_HOOK_VARIABLES = (INJECT_SLOWDOWN_ENV, TEST_FAULT_ENV)


def git_info(repo: Path | None = None) -> dict[str, Any]:
    """The git sha and dirty flag of the code that ran (None for both outside a checkout)."""
    cwd = repo or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> str | None:
    """The NVIDIA driver version through NVML, or None without one."""
    try:
        import pynvml  # provided by nvidia-ml-py

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # no driver, no library, no GPU: all mean "none"
        return None


def software_versions() -> dict[str, Any]:
    """Versions of everything that changes what is measured."""
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            nccl = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "driver": nvidia_driver() if cuda else None,
        "cuda_available": cuda,
    }


def hardware_fingerprint(rig: Rig, topology: CpuTopology | None = None) -> dict[str, Any]:
    """The hardware that must match for two runs' absolute numbers to be comparable.

    Hardware only: the rig, its device names, the CPU model and cores, and on a cpu rig the
    topology of the rig's cores (packages, physical cores, logical CPUs, threads per core;
    ``topology`` defaults to sysfs's). Software (torch, the driver, ...) is not part of it:
    it is in ``versions``, and the gate reports its differences beside the verdict.
    """
    fingerprint: dict[str, Any] = {
        "rig": rig.label,
        "device_names": rig.device_names(),
        "cpu_model": cpu_model(),
        "cpu_cores": len(available_cores()),
    }
    if rig.kind == "cpu":
        fingerprint["cpu_topology"] = (topology or read_cpu_topology(rig.cores)).summary()
    return fingerprint


def cpu_topology(rig: Rig, topology: CpuTopology | None = None) -> dict[str, Any] | None:
    """env.json ``cpu_topology``: the rig's cores as physical cores and packages, and which
    whole physical cores each cpu worker holds (None on a cuda rig)."""
    if rig.kind != "cpu":
        return None
    topo = topology or read_cpu_topology(rig.cores)
    by_cpus = {c.cpus: c for c in topo.cores}
    workers = []
    for i in range(rig.num_devices):
        t = rig.threads_per_worker
        mine = [by_cpus.get(g) for g in rig.core_groups[i * t:(i + 1) * t]]
        workers.append({
            "device": i,
            "cpus": rig.cores_of(i),
            "physical_cores": [list(g) for g in rig.core_groups[i * t:(i + 1) * t]],
            "packages": sorted({c.package for c in mine if c is not None}),
        })
    return {
        **topo.summary(),
        "physical_cores_list": [{"package": c.package, "core_id": c.core_id,
                                 "cpus": list(c.cpus)} for c in topo.cores],
        "workers": workers,
        "rule": "each worker holds threads_per_worker whole physical cores (their "
                "hyper-thread siblings too, one thread per physical core); no two workers "
                "share a physical core",
    }


def collect(rig: Rig, profile: dict[str, Any], argv: list[str],
            attainable_peak: dict[str, Any] | None = None,
            idle_power: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything env.json holds; ``attainable_peak`` is the measured FLOP peak (flops.py),
    ``idle_power`` the rig's power with nothing of ours running (energy.py)."""
    env = {
        "schema_version": SCHEMA_VERSION,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "versions": software_versions(),
        "rig": rig.as_dict(),
        "device_names": rig.device_names(),
        "cpu_model": cpu_model(),
        "cpu_cores": len(available_cores()),
        "git": git_info(),
        "fingerprint": hardware_fingerprint(rig),
        "cpu_topology": cpu_topology(rig),
        # What every worker and the peak probe set (rig.set_math_mode), read back here.
        "math_mode": set_math_mode(),
        "profile": profile,
        "command_line": argv,
        "test_hooks": {k: v for k, v in os.environ.items() if k in TEST_HOOK_VARIABLES and v},
    }
    if attainable_peak is not None:
        env["attainable_peak"] = attainable_peak
    if idle_power is not None:
        env["idle_power"] = idle_power
    return env
