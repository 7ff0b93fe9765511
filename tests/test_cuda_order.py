"""CUDA numbers the GPUs as NVML and the sampler do (#28, item 12): in PCI bus order. CUDA's
default (FASTEST_FIRST) puts the fastest GPU first, so on a machine of mixed GPUs the
sampler would read another GPU than the worker's. A command sets CUDA_DEVICE_ORDER=PCI_BUS_ID
in its own environment as it starts, before any child (the fork server, its ranks, torchrun's
agents, the pre-flight, the FLOP probe, the collectives, the calibration) and before CUDA;
a user's own value is kept, and then NVML does not guess CUDA's numbering of mixed GPUs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench_lib.launch import sampling
from bench_lib.launch.agent import WARM_MODULES
from bench_lib.measure import preflight_static
from bench_lib.nvml import CudaOrderUnknown, cuda_visible_gpus
from bench_lib.processes import forkserver
from bench_lib.rig import Rig
from tests.conftest import PYTHON, REPO, in_process
from tests.test_gpu_env import GPUS, no_cuda_calls, topo_nvml  # noqa: F401 (a fixture)

MIXED = (GPUS[0], ("00000000:3B:00.0", "GPU-aaaa-1111", "NVIDIA L4"))
"""NVML's 0 is an H100 at 5E, its 1 an L4 at 3B: PCI order is L4, H100."""


def _without_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_DEVICE_ORDER unset for the test, and as it was afterwards."""
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "")
    monkeypatch.delenv("CUDA_DEVICE_ORDER")


def test_a_command_orders_cuda_by_bus_for_itself_and_its_children(monkeypatch, capsys):
    _without_order(monkeypatch)
    proc = in_process(capsys, "env", "--rig", "cpu", "--devices", "1")
    assert proc.returncode == 0, proc.stderr
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert json.loads(proc.stdout)["multi_gpu"]["cuda_device_order"] == "PCI_BUS_ID"  # env.json
    # What every child inherits: a fork server's environment (its ranks, the probes).
    assert forkserver.ForkServer(WARM_MODULES)._env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_users_own_order_is_kept(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    proc = in_process(capsys, "env", "--rig", "cpu", "--devices", "1")
    assert proc.returncode == 0, proc.stderr
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    assert json.loads(proc.stdout)["multi_gpu"]["cuda_device_order"] == "FASTEST_FIRST"


ENTRY = """\
import runpy, sys
from bench_lib.processes import forkserver
forkserver.ForkServer.start = lambda self: print("server:", self._env.get("CUDA_DEVICE_ORDER"))
sys.argv = ["bench_lib", "run", "--help"]
runpy.run_module("bench_lib", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("user,expected", [(None, "PCI_BUS_ID"),
                                           ("FASTEST_FIRST", "FASTEST_FIRST")])
@pytest.mark.integration
def test_the_entry_point_orders_cuda_before_it_prestarts_the_fork_server(user, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    if user is not None:
        env["CUDA_DEVICE_ORDER"] = user
    proc = subprocess.run([PYTHON, "-c", ENTRY], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert f"server: {expected}" in proc.stdout.splitlines()


def test_nvml_maps_cuda_indices_in_the_order_cuda_uses(no_cuda_calls):  # noqa: F811
    ordered = cuda_visible_gpus(topo_nvml(gpus=MIXED), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [(g.cuda_index, g.name) for g in ordered] == [(0, "NVIDIA L4"),
                                                          (1, "NVIDIA H100 80GB HBM3")]
    # Any other order (or none: FASTEST_FIRST) numbers mixed GPUs as NVML cannot tell.
    for env in ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, {}):
        with pytest.raises(CudaOrderUnknown, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
            cuda_visible_gpus(topo_nvml(gpus=MIXED), env)
    # Identical GPUs: every order is the bus order.
    same = cuda_visible_gpus(topo_nvml(), {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert [g.bus_id for g in same] == ["00000000:3B:00.0", "00000000:5E:00.0"]


def test_the_sampler_reads_no_gpu_it_cannot_place(monkeypatch, no_cuda_calls):  # noqa: F811
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    with pytest.raises(CudaOrderUnknown):  # the case's sampler_note says why
        sampling._cuda_bus_ids(2, topo_nvml(gpus=MIXED))
    warn = preflight_static.nvml_check(Rig("cuda", 2), topo_nvml(gpus=MIXED), dict(os.environ))
    assert warn.status == "warn" and "FASTEST_FIRST" in warn.detail, warn.detail
