"""Out of memory is recognised however it surfaced (#28, item 4): torch's allocator raises
``torch.OutOfMemoryError``, but a CUDA allocation that fails inside NCCL comes as a
``DistBackendError`` ("Cuda failure 'out of memory'"), inside cuDNN or cuBLAS as a
``RuntimeError`` naming ``CUDNN_STATUS_ALLOC_FAILED`` / ``CUBLAS_STATUS_ALLOC_FAILED``. Each
is the case's ``oom``, not an ``error`` that fails the run. Exceptions constructed on CPU."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist

from bench_lib.distance import worker as distance_worker
from bench_lib.launch import diagnostics, worker
from bench_lib.launch.protocol import RankResult, is_oom
from bench_lib.launch.ranks import combine

NCCL_OOM = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
            "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.5\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\n"
            "Last error:\nCuda failure 2 'out of memory'")
OOMS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                           "total capacity of 79.10 GiB of which 1.06 GiB is free."),
    dist.DistBackendError(NCCL_OOM),
    dist.DistBackendError("NCCL error: CUDA error: out of memory"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                 "reported at some other API call"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    MemoryError("std::bad_alloc"),
]
NOT_OOMS = [
    RuntimeError("Expected all tensors to be on the same device, but found at least two "
                 "devices, cuda:0 and cpu!"),
    dist.DistBackendError("NCCL communicator was aborted on rank 1."),
    ValueError("bad shape"),
]


@pytest.mark.parametrize("e", OOMS, ids=lambda e: type(e).__name__)
def test_every_way_of_running_out_of_memory_is_an_oom(e):
    assert is_oom(e)


@pytest.mark.parametrize("e", NOT_OOMS, ids=lambda e: type(e).__name__)
def test_other_failures_are_not(e):
    assert not is_oom(e)


def _fake_spec(monkeypatch: Any, module: Any, cls: Any) -> None:
    monkeypatch.setattr(module, "die_with_parent", lambda pid: True, raising=False)
    monkeypatch.setattr(cls, "read", classmethod(lambda c, path: SimpleNamespace(
        case=None, rig=None, trace=True, compute_only=True, cut="", warmup_steps=None)))


def _raising(e: BaseException) -> Any:
    def run_rank(*args: Any) -> RankResult:
        raise e
    return run_rank


@pytest.mark.parametrize("e,status", [(e, "oom") for e in OOMS]
                         + [(e, "error") for e in NOT_OOMS],
                         ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v)
def test_a_case_rank_that_raised_writes_the_right_status(e, status, tmp_path, monkeypatch):
    _fake_spec(monkeypatch, worker, worker.CaseSpec)
    monkeypatch.setattr(worker, "run_rank", _raising(e))
    assert worker.main([str(tmp_path / "spec.json"), "0"]) == worker.EXIT_FAILED
    written = RankResult.read(tmp_path / "rank0.json")
    assert written.status == status, written.reason
    assert written.failed_at_unix_s is not None
    if status == "oom":
        assert "out of memory" in written.reason


@pytest.mark.parametrize("e,status", [(OOMS[1], "oom"), (OOMS[4], "oom"), (NOT_OOMS[0], "error")],
                         ids=["nccl", "cudnn", "other"])
def test_a_distance_rank_that_raised_writes_the_right_status(e, status, tmp_path,
                                                             monkeypatch):
    _fake_spec(monkeypatch, distance_worker, distance_worker.DistanceSpec)
    monkeypatch.setattr(distance_worker, "run_rank", _raising(e))
    distance_worker.main([str(tmp_path / "spec.json"), "0"])
    assert RankResult.read(tmp_path / "rank0.json").status == status


@pytest.mark.parametrize("e,oom", [(OOMS[1], True), (OOMS[5], True), (NOT_OOMS[0], False)],
                         ids=["nccl", "cublas", "other"])
def test_the_traced_steps_note_names_an_oom_however_it_came(e, oom):
    def step() -> None:
        raise e

    trainer = SimpleNamespace(step=lambda x, y: step(), devices=[torch.device("cpu")])

    def traced(result: RankResult) -> RankResult:
        diagnostics.trace(trainer, None, None, [], ["cpu:0"], process_group=False)
        return result

    plan = [diagnostics.Diagnostic(diagnostics.TRACED, 1, traced, traced=True)]
    timed = RankResult(0, "ok", step_times_s=(0.1,), step_cpu_times_s=(0.1,), warmup_steps=1)
    out = diagnostics.run_diagnostics(timed, plan, write=lambda r: None, give_up=_no_give_up)
    assert out.timeline == () and out.diagnostics_note == ""
    assert out.trace_note.startswith("out of memory in the traced step") == oom, out.trace_note


def _no_give_up(result: RankResult) -> NoReturn:
    raise AssertionError(f"gave up: {result}")


def test_a_rank_aborted_by_nccls_watchdog_on_an_oom_is_an_oom(tmp_path: Path):
    # NCCL's watchdog aborts the process on an asynchronous CUDA error: no result file,
    # SIGABRT, and the error's text in the case's log (read after the fact).
    log = tmp_path / "worker.log"
    log.write_text("[rank1]:[E ProcessGroupNCCL.cpp:1896] [PG 0 Rank 1] Process group "
                   "watchdog thread terminated with exception: CUDA error: out of memory\n"
                   "terminate called after throwing an instance of 'c10::DistBackendError'\n")
    ok = RankResult(0, "ok", step_times_s=(0.1,), step_cpu_times_s=(0.1,), warmup_steps=1)
    ok.write(tmp_path / "rank0.json")
    procs = [SimpleNamespace(returncode=0), SimpleNamespace(returncode=-signal.SIGABRT)]
    out = combine(tmp_path, procs, log, exited_at={1: 100.0})
    assert out.status == "oom", out.reason
    assert out.reason.startswith("rank 1 was killed by SIGABRT without a result")
    log.write_text("Segmentation fault\n")
    assert combine(tmp_path, procs, log, exited_at={1: 100.0}).status == "error"
