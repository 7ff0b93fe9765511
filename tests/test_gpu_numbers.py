"""Issue 14 (7, 8, 12): GPU numbers made right on CPU, with fakes where a GPU would be needed.

7. ``dp`` with bf16: DataParallel runs each replica in a thread of its own and re-enters
   autocast there without a dtype; autocast's dtype is thread-local, so a replica thread
   computed in the device type's default (float16 on CUDA). The replica now enters the
   case's autocast itself.
8. The FLOP peak probe computes in the workers' math mode (TF32 flags, cuDNN autotuning),
   refuses a peak when the flags change under it, and records that mode; ``mfu_note`` names it.
12. ``--max-memory-per-device`` on GPUs caps the caching allocator only (documented; no
    context size is made up).
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from bench_lib import math_modes
from bench_lib.commands.parser import build_parser
from bench_lib.measure import flop_peak, flop_probe, memory
from bench_lib.rows.rows import mfu_note
from bench_lib.strategies import dp
from bench_lib.strategies.base import BuildContext
from bench_lib.workloads import Workload

CUDA_THREAD_DEFAULT = torch.float16
"""The autocast dtype a fresh thread gets on CUDA (``torch.get_autocast_dtype("cuda")``)."""


# ---- 7. dp: every replica computes in the case's precision ----------------------------------

class DtypeRecorder(nn.Module):
    """A linear layer that records, per call, autocast's state and the dtype it computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                          out.dtype))
        return out


def run_in_replica_thread(module: nn.Module, x: torch.Tensor, device_type: str = "cpu") -> Any:
    """``module(x)`` the way ``parallel_apply``'s worker runs a replica: in a new thread that
    enters autocast with the caller's enabled flag and no dtype. A new thread's autocast dtype
    is its device type's default: on CUDA float16, which is set here (CPU's default is bf16)."""
    enabled = torch.is_autocast_enabled(device_type)  # read in the caller's thread
    result: dict[str, Any] = {}

    def worker() -> None:
        try:
            torch.set_autocast_dtype(device_type, CUDA_THREAD_DEFAULT)
            with torch.amp.autocast(device_type, enabled=enabled):
                result["out"] = module(x)
        except Exception as e:  # re-raised in the test's thread
            result["error"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["out"]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataParallel without visible GPUs keeps the module and calls it directly: the same
    build on any host (with GPUs it would scatter the CPU test tensors to them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def build_dp(precision: str) -> tuple[Any, DtypeRecorder]:
    recorder = DtypeRecorder()
    ctx = BuildContext(Workload("resnet-tiny", 32, batch_size=4, precision=precision))
    trainer = dp.build(recorder, [torch.device("cpu")] * 2, ctx)
    assert isinstance(trainer.module, nn.DataParallel)
    return trainer, recorder


def test_autocast_dtype_is_thread_local():
    """The premise: a thread does not inherit the dtype of the autocast its parent is in."""
    seen: list[torch.dtype] = []
    with torch.autocast("cpu", dtype=torch.float16):
        thread = threading.Thread(target=lambda: seen.append(torch.get_autocast_dtype("cpu")))
        thread.start()
        thread.join()
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert seen == [torch.bfloat16]  # CPU's default, not the parent's float16


def test_dp_replica_thread_computes_in_bf16(no_cuda):
    trainer, recorder = build_dp("bf16")
    replica = trainer.module.module  # what DataParallel replicates and runs per device
    x = torch.randn(4, 8)
    with trainer.ctx.workload.autocast(trainer.output_device):  # as forward_backward does
        out = run_in_replica_thread(replica, x)
    assert recorder.seen == [(True, torch.bfloat16, torch.bfloat16)]
    assert out.dtype == torch.bfloat16


def test_dp_replicas_are_shallow_copies_that_keep_the_autocast(no_cuda):
    trainer, recorder = build_dp("bf16")
    # nn.parallel.replicate makes each replica with this (parameters are re-attached there).
    copy = trainer.module.module._replicate_for_data_parallel()
    with trainer.ctx.workload.autocast(trainer.output_device):
        run_in_replica_thread(copy, torch.randn(2, 8))
    assert recorder.seen == [(True, torch.bfloat16, torch.bfloat16)]


def test_dp_fp32_replica_stays_fp32_even_where_the_thread_enabled_autocast(no_cuda):
    trainer, recorder = build_dp("fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller that left autocast on
        out = run_in_replica_thread(trainer.module.module, torch.randn(4, 8))
    assert recorder.seen == [(False, recorder.seen[0][1], torch.float32)]
    assert out.dtype == torch.float32


def test_dp_step_trains_the_model_parameters(no_cuda):
    trainer, recorder = build_dp("bf16")
    before = recorder.lin.weight.detach().clone()
    trainer.step(torch.randn(4, 8), torch.randint(0, 5, (4,)))
    assert recorder.seen[-1] == (True, torch.bfloat16, torch.bfloat16)
    assert not torch.equal(before, recorder.lin.weight)  # the optimizer holds the model's own
    assert trainer.parameters_in_order() == list(recorder.parameters())


# ---- 8. the peak probe computes in the workers' math mode ---------------------------------

def flags_now() -> tuple[bool, bool, bool]:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark)


def fake_probes(monkeypatch: pytest.MonkeyPatch, op_of: Any) -> None:
    """Replace the three probes by ``op_of(name)`` (1 FLOP each) and leave this process
    unpinned."""
    monkeypatch.setattr(flop_probe, "pin_worker", lambda rig, index: None)
    monkeypatch.setattr(flop_probe, "gemm_probe", lambda device, dtype, n: (op_of("gemm"), 1))
    monkeypatch.setattr(flop_probe, "conv_probe", lambda device, dtype, shape, channels_last=False:
                        (op_of("conv-cl" if channels_last else "conv"), 1))


def test_probe_computes_under_the_training_flags(monkeypatch, cpu_rig, restore_math_flags):
    # Training's mode: IEEE fp32 (the run's math mode), no cuDNN autotuning...
    monkeypatch.setattr(math_modes, "CUDNN_BENCHMARK", False)
    # ...and the probe process starting in the opposite one.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    seen: list[tuple[str, tuple[bool, bool, bool]]] = []

    def op_of(name: str) -> Any:
        def op() -> None:
            seen.append((name, flags_now()))
            torch.ones(16).sum()
        return op

    fake_probes(monkeypatch, op_of)
    shape = flop_probe.ConvShape(1, 4, 4)
    result = flop_probe.probe_device(cpu_rig, 0, ["fp32"], 8, shape, 0.0, mode="ieee")
    assert {name for name, _ in seen} == set(flop_probe.PROBES)
    assert {flags for _, flags in seen} == {(False, False, False)}  # every call, every probe
    worker_mode = math_modes.set_math_mode("ieee")  # a worker's, before it builds its model
    assert result["math_mode"] == worker_mode
    peak = flop_peak.AttainablePeak.of_probes({"0": result, "1": result}, 8, shape)
    recorded = json.loads(json.dumps(peak.as_dict()))
    assert recorded["math_mode"]["cudnn_allow_tf32"] is False
    assert recorded["math"]["fp32"].startswith(
        "IEEE fp32 (TF32 off in cuBLAS matmuls and cuDNN convolutions)")


def test_probe_refuses_a_peak_whose_flags_changed_under_it(monkeypatch, cpu_rig,
                                                           restore_math_flags):
    def op_of(name: str) -> Any:
        def op() -> None:
            if name == "conv":
                torch.backends.cudnn.allow_tf32 = True  # a library turning TF32 on mid-probe
            torch.ones(16).sum()
        return op

    fake_probes(monkeypatch, op_of)
    with pytest.raises(RuntimeError, match="math flags changed while probing fp32 .*"
                                           "cudnn_allow_tf32"):
        flop_probe.probe_device(cpu_rig, 0, ["fp32"], 8, flop_probe.ConvShape(1, 4, 4), 0.0,
                                mode="ieee")


def test_math_mode_in_words():
    ieee = {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False,
            "fp32_precision": {"cuda_matmul": "ieee", "mkldnn_matmul": "none"}}
    assert flop_peak.math_mode_label(ieee) == ("IEEE fp32 (TF32 off in cuBLAS matmuls and cuDNN "
                                               "convolutions)")
    ampere_default = {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": True}
    assert flop_peak.math_mode_label(ampere_default) == ("fp32 with IEEE cuBLAS matmuls and TF32 "
                                                         "cuDNN convolutions")
    amx = ieee | {"fp32_precision": {"mkldnn_matmul": "bf16", "mkldnn_conv": "ieee"}}
    assert flop_peak.math_mode_label(amx).endswith(", oneDNN matmul in bf16")
    assert flop_peak.math_mode_label(ieee, env={"NVIDIA_TF32_OVERRIDE": "0"}).endswith(
        ", with NVIDIA_TF32_OVERRIDE=0")
    assert flop_peak.math_mode_label(ieee, "bf16").startswith("bf16")
    assert flop_peak.math_mode_label({}) == "fp32 in an unrecorded math mode"
    assert flop_probe.tf32_env({"NVIDIA_TF32_OVERRIDE": "0", "PATH": "/bin"}) == {
        "NVIDIA_TF32_OVERRIDE": "0"}


def test_env_json_peak_records_its_math_mode_and_reads_it_back():
    mode = {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False}
    peak = flop_peak.AttainablePeak({"fp32": {"0": 1.0}, "bf16": {"0": 2.0}}, math_mode=mode,
                                    math_env={"NVIDIA_TF32_OVERRIDE": "0"})
    recorded = json.loads(json.dumps(peak.as_dict()))
    assert recorded["math_env"] == {"NVIDIA_TF32_OVERRIDE": "0"}
    assert recorded["math"]["fp32"].startswith("IEEE fp32")
    assert recorded["math"]["bf16"].startswith("bf16")
    again = flop_peak.AttainablePeak.from_dict(recorded)
    assert again.math_mode == mode and again.math_env == peak.math_env
    assert again.math_of("fp32") == peak.math_of("fp32")


def test_mfu_note_names_the_math_mode_of_the_peak():
    mode = {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False}
    peak = flop_peak.AttainablePeak({"fp32": {"0": 1.0}}, probe={"fp32": {"0": "conv"}},
                                    math_mode=mode)
    note = mfu_note(130.0, peak, "fp32", 1)
    assert note.startswith("over 100%: the case beat the measured peak (conv probe)")
    assert "peak measured in IEEE fp32 (TF32 off in cuBLAS matmuls and cuDNN convolutions)" in note
    unrecorded = flop_peak.AttainablePeak({"fp32": {"0": 1.0}})
    assert mfu_note(130.0, unrecorded, "fp32", 1).endswith("math mode of the peak is not recorded")
    assert mfu_note(50.0, peak, "fp32", 1) == ""


# ---- 12. the GPU memory cap is the caching allocator's --------------------------------------

def test_gpu_cap_is_the_allocator_fraction_of_each_gpu(monkeypatch):
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, d: calls.append((fraction, d)))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    memory.cap_cuda_memory(gpus, 12 * 1024)
    assert calls == [(pytest.approx(12 / 80), gpus[0]), (pytest.approx(12 / 80), gpus[1])]
    calls.clear()
    memory.cap_cuda_memory(gpus[:1], 200 * 1024)  # over the card: the whole card
    memory.cap_cuda_memory(gpus, 0)  # no cap
    memory.cap_cuda_memory([torch.device("cpu")], 12 * 1024)  # the runner caps CPU workers
    assert calls == [(1.0, gpus[0])]


def test_cap_help_says_what_it_leaves_out(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "caching allocator's limit only" in help_text
    assert "CUDA context and NCCL buffers" in help_text
    assert "outside the allocator" in " ".join((memory.cap_cuda_memory.__doc__ or "").split())
