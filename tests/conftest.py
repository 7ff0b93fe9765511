"""Shared fixtures: small workloads, a CPU rig, GPU skips, and the repo's python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from bench_lib.rig import Rig, available_cores

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs; {gpus} visible")
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def cpu_rig() -> Rig:
    """A 2-worker cpu rig that shares whatever cores exist (tests never need real cores)."""
    cores = available_cores()
    return Rig("cpu", 2, 1, tuple((cores * 2)[:2]))
