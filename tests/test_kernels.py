"""The launches' CUDA kernels, tested without a GPU: the profiler's events read through
fakes, the worker's diagnostic with the profiler faked, and the names carried from a rank's
result to its launch's outcome."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import torch

from bench_lib.launch import diagnostics
from bench_lib.launch.protocol import RankResult
from bench_lib.launch.ranks import combine
from bench_lib.measure import kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def test_kernel_names_are_the_cuda_events_less_copies_and_fills():
    events = [SimpleNamespace(name="aten::conv2d", device_type=CPU),
              SimpleNamespace(name="sm90_xmma_fprop", device_type=CUDA),
              SimpleNamespace(name="Memcpy HtoD (Pageable -> Device)", device_type=CUDA),
              SimpleNamespace(name="Memset (Device)", device_type=CUDA),
              SimpleNamespace(name="ampere_sgemm", device_type=CUDA),
              SimpleNamespace(name="sm90_xmma_fprop", device_type=CUDA)]
    assert kernels.names_of(events) == ("ampere_sgemm", "sm90_xmma_fprop")


def test_nothing_is_profiled_without_a_cuda_device():
    ran = []
    assert kernels.kernel_names(lambda: ran.append(1), [torch.device("cpu")]) == ()
    assert ran == []


class FakeTrainer:
    def __init__(self, device: str) -> None:
        self.devices = [torch.device(device)]
        self.steps = 0

    def step(self, x: object, y: object) -> None:
        self.steps += 1


def test_the_worker_records_a_cuda_launchs_kernels_through_the_profiler(monkeypatch):
    seen = []

    def fake_profile(step, devices):
        seen.append(devices)
        step()
        return ("conv_b", "gemm")

    monkeypatch.setattr(diagnostics, "kernel_names", fake_profile)
    trainer = FakeTrainer("cuda:0")
    assert diagnostics.kernels(trainer, None, None, False) == ("conv_b", "gemm")
    assert trainer.steps == 1 and seen == [trainer.devices]
    cpu = FakeTrainer("cpu")
    assert diagnostics.kernels(cpu, None, None, False) == () and cpu.steps == 0
    assert len(seen) == 1  # a cpu rig is never profiled


def test_a_failed_kernel_step_costs_only_the_names(monkeypatch, capsys):
    def broken(step, devices):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    monkeypatch.setattr(diagnostics, "kernel_names", broken)
    trainer = FakeTrainer("cuda:0")
    plan = diagnostics.schedule(trainer, None, None, False, compute=False, optimizer=False,
                                stages=[], slot_labels=["cuda:0"])
    assert [d.what for d in plan] == [diagnostics.KERNELS]
    timed = RankResult(0, "ok", step_times_s=(0.1,), step_cpu_times_s=(0.1,), warmup_steps=1)
    written: list[RankResult] = []
    out = diagnostics.run_diagnostics(timed, plan, write=written.append, give_up=_no_give_up)
    assert out.status == "ok" and out.step_times_s == (0.1,) and out.kernel_names == ()
    assert out.diagnostics_note == ("the kernel-names step failed: RuntimeError: "
                                    "CUPTI_ERROR_NOT_INITIALIZED")
    assert [w.diagnostics_note for w in written] == ["the kernel-names step did not finish"]
    assert "CUPTI_ERROR_NOT_INITIALIZED" in capsys.readouterr().err  # the traceback


def _no_give_up(result: RankResult) -> NoReturn:
    raise AssertionError(f"gave up: {result}")


def test_a_launchs_kernels_are_every_ranks(tmp_path: Path):
    for rank, names in ((0, ("gemm", "conv_a")), (1, ("gemm", "conv_c"))):
        RankResult(rank, "ok", step_times_s=(0.1,), step_cpu_times_s=(0.1,), warmup_steps=1,
                   kernel_names=names).write(tmp_path / f"rank{rank}.json")
    assert RankResult.read(tmp_path / "rank1.json").kernel_names == ("gemm", "conv_c")
    procs = [SimpleNamespace(returncode=0), SimpleNamespace(returncode=0)]
    out = combine(tmp_path, procs, tmp_path / "worker.log")
    assert out.status == "ok" and out.kernel_names == ("conv_a", "conv_c", "gemm")
