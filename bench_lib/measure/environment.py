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
from bench_lib.rig import Rig, available_cores

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


def hardware_fingerprint(rig: Rig) -> dict[str, Any]:
    """What must match for two runs' absolute numbers to be comparable."""
    return {
        "rig": rig.label,
        "device_names": rig.device_names(),
        "cpu_model": cpu_model(),
        "cpu_cores": len(available_cores()),
        "driver": nvidia_driver() if rig.kind == "cuda" else None,
        "torch": torch.__version__,
    }


def collect(rig: Rig, profile: dict[str, Any], argv: list[str],
            attainable_peak: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything env.json holds; ``attainable_peak`` is the measured FLOP peak (flops.py)."""
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
        "profile": profile,
        "command_line": argv,
        "test_hooks": {k: v for k, v in os.environ.items() if k in TEST_HOOK_VARIABLES and v},
    }
    if attainable_peak is not None:
        env["attainable_peak"] = attainable_peak
    return env
