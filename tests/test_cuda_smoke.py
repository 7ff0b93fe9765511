"""The pre-flight's CUDA smoke test (#28 item 3): a one-GPU box checks that CUDA works
before any case. Without a GPU the child is faked (its result, or its command line), its
own code runs on the CPU, and the real child meets this machine's missing driver."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench_lib import commands, exit_codes
from bench_lib.commands import plan as run_plan
from bench_lib.measure import cuda_smoke, preflight, preflight_probes
from bench_lib.rig import Rig
from tests.conftest import PYTHON, REPO
from tests.test_gpu_env import GPUS, OK_RANK, topo_nvml
from tests.test_preflight_faults import QUIET_HOST

BIG_SHM = {"path": "/dev/shm", "total_mib": 16384.0}
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
NO_KERNEL = ("RuntimeError: CUDA error: no kernel image is available for execution on the "
             "device")
OLD_DRIVER = ("RuntimeError: The NVIDIA driver on your system is too old (found version "
              "12020). Please update your GPU driver by downloading and installing a new "
              "version from the URL: http://www.nvidia.com/Download/index.aspx")
INSUFFICIENT = ("RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA "
                "runtime version")


def smoke_run(*results: dict[str, object], finished: bool = True) -> object:
    """What ``preflight_probes.smoke_results`` returns (a ``SmokeProcesses``): one result per
    GPU."""
    return SimpleNamespace(finished=finished, results=dict(enumerate(results)),
                           codes=[0 if r.get("ok") else 1 for r in results], tail="",
                           seconds=2.5)


def gpu(index: int = 0, ok: bool = True, error: str = "", **extra: object) -> dict[str, object]:
    result = {"device": f"cuda:{index}", "ok": ok, "name": "Tesla V100-SXM2-32GB",
              "capability": "sm_70", "torch": "2.14.1+cu130", "torch_cuda": "13.0",
              "arch_list": ARCHS, "warnings": []} | extra
    return result | ({"error": error} if error else {})


@pytest.fixture
def no_settle(monkeypatch):
    monkeypatch.setattr(preflight, "SETTLE_S", 0.0)


def fake_smoke(monkeypatch, found) -> list[Rig]:
    """``preflight_probes.smoke_results`` replaced by ``found``; returns the rigs it was
    asked for."""
    asked: list[Rig] = []

    def results(rig, *args, **kwargs):
        asked.append(rig)
        return found

    monkeypatch.setattr(preflight_probes, "smoke_results", results, raising=False)
    return asked


@pytest.mark.parametrize("error, warning, advice", [
    (NO_KERNEL, "Tesla V100-SXM2-32GB with CUDA capability sm_70 is not compatible with the "
                "current PyTorch installation.", "no kernels for the GPU"),
    (OLD_DRIVER, "", "the NVIDIA driver is older than this torch's CUDA runtime needs"),
    (INSUFFICIENT, "", "update the driver"),
    ("RuntimeError: Found no NVIDIA driver on your system.", "", "docker run --gpus all"),
])
def test_a_one_gpu_box_whose_cuda_fails_stops_in_the_preflight(monkeypatch, no_settle, error,
                                                              warning, advice):
    asked = fake_smoke(monkeypatch, smoke_run(gpu(ok=False, error=error,
                                                  warnings=[warning] if warning else [])))
    one = Rig("cuda", 1)
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(one, quiet=True, shm=BIG_SHM, environ={},
                        nvml=topo_nvml(gpus=GPUS[:1]))
    text = str(e.value)
    assert asked == [one]  # it ran, though the rig has one device
    assert "cuda_smoke: CUDA does not work here" in text and advice in text
    assert error in text and "cuda:0 (Tesla V100-SXM2-32GB, sm_70)" in text
    assert "kernels for sm_75 sm_80" in text  # what the wheel has, beside what the GPU is


def test_the_command_line_exits_2_when_cuda_fails_on_one_gpu(monkeypatch, tmp_path, capsys,
                                                             no_settle):
    fake_smoke(monkeypatch, smoke_run(gpu(ok=False, error=NO_KERNEL)))
    from bench_lib.sweep.profile import Profile

    monkeypatch.setattr(run_plan, "plan_new", lambda args: (Rig("cuda", 1), Profile(), []))
    out = tmp_path / "out"
    assert commands.main(["run", "--out", str(out)]) == exit_codes.EXIT_USAGE
    err = capsys.readouterr().err
    assert "cuda_smoke" in err and "no kernels for the GPU" in err
    assert not out.exists()  # stopped before the run folder


@pytest.mark.integration
def test_a_working_gpu_passes_and_every_gpu_is_smoked_once(monkeypatch, no_settle):
    asked = fake_smoke(monkeypatch, smoke_run(gpu(0, name="NVIDIA H100", capability="sm_90")))
    checks = preflight.check(Rig("cuda", 1), quiet=True, shm=BIG_SHM, environ={},
                             nvml=topo_nvml(gpus=GPUS[:1]))
    smoke = next(c for c in checks if c.name == "cuda_smoke")
    assert smoke.status == "ok" and "cuda:0 (NVIDIA H100, sm_90)" in smoke.detail
    # Slots: the smoke test runs (on the one GPU), then the all-reduce between the slots.
    slots = Rig("cuda", 2, gpu_slots=2)
    checks = preflight.check(slots, quiet=True, shm=BIG_SHM, environ={},
                             nvml=topo_nvml(gpus=GPUS[:1]),
                             command=[sys.executable, "-c", OK_RANK])
    assert [c.name for c in checks][:5] == ["dev_shm", "nvml", "topology", "cuda_smoke",
                                            "all_reduce"]  # no copies between slots of one GPU
    assert asked[-1] == slots


def test_a_failed_smoke_test_skips_the_all_reduce(monkeypatch):
    fake_smoke(monkeypatch, smoke_run(gpu(0), gpu(1, ok=False, error=NO_KERNEL)))
    checks = preflight.run_checks(Rig("cuda", 2), shm=BIG_SHM, environ={}, nvml=topo_nvml(),
                           command=["/nonexistent/never-started"], host=QUIET_HOST,
                           copy_command=["/nonexistent/never-started"])
    assert [(c.name, c.status) for c in checks] == [
        ("dev_shm", "ok"), ("nvml", "ok"), ("topology", "ok"), ("cuda_smoke", "fail")]


# --- the processes: one per physical GPU, faked by their command line -------------------

FAKE_CHILD = ("import json, sys; open(sys.argv[2], 'w').write(json.dumps({'ok': True, "
              "'device': sys.argv[1], 'argv': sys.argv[1:], 'name': 'Fake GPU'}))")


@pytest.mark.integration
def test_one_process_per_physical_gpu_tied_to_the_runner():
    import os

    found = preflight_probes.smoke_results(Rig("cuda", 4, gpu_slots=2), timeout_s=60,
                                           command=[sys.executable, "-c", FAKE_CHILD])
    assert found.finished and found.codes == [0, 0]
    assert [r["device"] for r in found.results.values()] == ["cuda:0", "cuda:1"]
    assert all(r["argv"][-1] == str(os.getpid()) for r in found.results.values())
    check = preflight_probes.cuda_smoke(Rig("cuda", 4, gpu_slots=2), 60,
                                        [sys.executable, "-c", FAKE_CHILD])
    assert check.status == "ok" and "cuda:0 (Fake GPU), cuda:1 (Fake GPU)" in check.detail


@pytest.mark.integration  # starts processes or waits on real time
def test_a_child_that_dies_or_hangs_fails_the_check():
    died = preflight_probes.cuda_smoke(Rig("cuda", 1), 60, [sys.executable, "-c",
                                                            "import sys; print('Segfault-ish'); "
                                                            "sys.exit(139)"])
    assert died.status == "fail"
    assert "cuda:0: the process exited with code 139 without a result" in died.detail
    assert "log: Segfault-ish" in died.detail
    hung = preflight_probes.cuda_smoke(Rig("cuda", 1), 1, [sys.executable, "-c",
                                                           "import time; time.sleep(60)"])
    assert hung.status == "fail" and "did not finish within 1 s" in hung.detail


# --- the child's own code -------------------------------------------------------------

def test_the_childs_work_runs_on_the_cpu(tmp_path):
    result = cuda_smoke.smoke_device("cpu")
    assert result["ok"] and result["device"] == "cpu" and "error" not in result
    path = tmp_path / "gpu0.json"
    assert cuda_smoke.main(["cpu", str(path)]) == 0
    assert json.loads(path.read_text())["ok"] is True


def test_a_child_whose_results_are_wrong_says_so(monkeypatch):
    real = torch.nn.functional.conv2d
    calls = []

    def off_on_the_device(*args, **kwargs):  # the first call is the "device's"
        calls.append(1)
        out = real(*args, **kwargs)
        return out + 1.0 if len(calls) == 1 else out

    monkeypatch.setattr(torch.nn.functional, "conv2d", off_on_the_device)
    result = cuda_smoke.smoke_device("cpu")
    assert not result["ok"] and "wrong results (convolution differ" in result["error"]


@pytest.mark.parametrize("text, expected", [
    (NO_KERNEL, "no kernels"), (OLD_DRIVER, "older than"), (INSUFFICIENT, "older than"),
    ("CUDA error: all CUDA-capable devices are busy or unavailable", "exclusive-process"),
    ("CUDA error: system not yet initialized", "fabricmanager"),
    ("CUDA error: out of memory", "holds the GPU's memory"),
    ("something else entirely", ""),
])
def test_advice_names_the_known_failures(text, expected):
    assert (expected in cuda_smoke.advice(text)) if expected else cuda_smoke.advice(text) == ""


@pytest.mark.integration
def test_the_real_child_on_this_machine(tmp_path):
    """The child as the pre-flight starts it: on a machine without a GPU, CUDA's real
    failure and its advice; on one with, a pass."""
    import subprocess

    path = tmp_path / "gpu0.json"
    proc = subprocess.run([PYTHON, "-m", "bench_lib.measure.cuda_smoke", "cuda:0", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    result = json.loads(Path(path).read_text())
    if torch.cuda.is_available():
        assert proc.returncode == 0 and result["ok"], result
        return
    assert proc.returncode == 1 and not result["ok"]
    assert cuda_smoke.advice(result["error"]), result["error"]  # a known failure, advised
    check = preflight_probes.cuda_smoke(Rig("cuda", 1))
    assert check.status == "fail" and result["error"] in check.detail


@pytest.mark.integration
def test_a_smoke_child_whose_runner_is_gone_does_not_start(tmp_path):
    import subprocess

    proc = subprocess.run([PYTHON, "-m", "bench_lib.measure.cuda_smoke", "cpu",
                           str(tmp_path / "r.json"), "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert not (tmp_path / "r.json").exists()
