"""The sweeps a GPU check runs: on one GPU, the ``gpu-check`` profile (the smoke grid with
the rig's figures measured, so that each run has the FLOP peak and idle power its rows are
checked for) on every visible GPU, and the same in the validation mode (two slots sharing
GPU 0); on two GPUs or more, the plan's sweep of every strategy (``plan.sweep_flags``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench_lib.fault_hooks import TEST_HOOK_VARIABLES

PROFILE = "gpu-check"
SWEEPS = {"smoke": ["--profile", PROFILE],
          "slots": ["--devices", "2", "--gpu-slots", "2", "--profile", PROFILE]}
"""Run folder name under the check's folder -> the `run` flags that make it."""


def sweep_command(name: str, out: Path, flags: Sequence[str] | None = None) -> list[str]:
    """The ``run`` command of sweep ``name`` (``flags``, default ``SWEEPS[name]``), its run
    folder under ``out``/``name``."""
    flags = SWEEPS[name] if flags is None else flags
    return [sys.executable, "-m", "bench_lib", "run", *flags, "--out", str(out / name)]


def sweep_env() -> dict[str, str]:
    """This process's environment without the test-only hooks: a check's sweeps are real
    measurements (a quick FLOP probe, say, would make every MFU doubtful)."""
    return {k: v for k, v in os.environ.items() if k not in TEST_HOOK_VARIABLES}


def run_check_sweep(name: str, out: Path, repo: Path,
              flags: Sequence[str] | None = None) -> tuple[Path | None, str]:
    """Run sweep ``name`` (``sweep_command``; its progress on this terminal); its run folder,
    or None and why none was written. A nonzero exit with a folder is not an error here:
    the rows say why."""
    command = sweep_command(name, out, flags)
    folder = out / name / "latest-run"
    before = folder.resolve() if folder.exists() else None  # an earlier check's
    print(f"\n$ {' '.join(command)}", flush=True)
    code = subprocess.call(command, cwd=repo, env=sweep_env())
    if not folder.exists() or folder.resolve() == before:
        return None, f"`run` exited {code} and wrote no run folder"
    if code != 0:
        print(f"(`run` exited {code}: the cases below say why)")
    return folder, ""


def gpus_visible() -> int:
    """CUDA GPUs this process would see, through NVML (no CUDA context); 0 where none."""
    from bench_lib.nvml import cuda_visible_gpus

    try:
        return len(cuda_visible_gpus())
    except Exception as e:  # no NVML library or driver: no GPU to check
        print(f"NVML: {type(e).__name__}: {e}", file=sys.stderr)
        return 0
