"""What a GPU launch costs beside its steps and its tensors (#28 item 14): the duration
estimate's CUDA, NCCL and cuDNN start-up per launch, and the admission's CUDA context, NCCL
buffers and MIG instances, through fake NVML objects (no GPU, no CUDA call)."""

from __future__ import annotations

import types

import pytest

from bench_lib.prediction import duration
from bench_lib.prediction.admission import CUDA_CONTEXT_MIB, Admission, device_memory
from bench_lib.prediction.fixed_costs import CPU, CUDA
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.profile import Measurement
from tests.test_monitor import FakeNvmlError
from tests.test_predict_memory import FakePredictor, fake_nvml

MIB = 2**20
LONG = Measurement(case_timeout_s=10_000.0)


def beyond_steps(case: Case, rig: Rig) -> float:
    """A launch's estimated seconds beside its steps: its start-up and first warm-up step
    (``prediction.fixed_costs``; the launches' diagnostics are steps: left out)."""
    est, step = duration.case_estimate(case, rig), duration.step_seconds(case, rig)
    m = case.measurement
    steady = duration.steady_warmup_steps(m.warmup_steps, m.launches) * step
    diagnostics = duration.diagnostic_steps(case, m.launches) * step
    return (est.startup_s - diagnostics + est.warmup_s - steady) / m.launches


def test_a_cuda_launch_pays_cudas_nccls_and_cudnns_start_up():
    two, slots, one = Rig("cuda", 2), Rig("cuda", 2, gpu_slots=2), Rig("cuda", 1)
    ddp = beyond_steps(new_case(two, "ddp", "resnet50", 64, 32, measurement=LONG), two)
    gloo = beyond_steps(new_case(slots, "ddp", "resnet50", 64, 32, measurement=LONG), slots)
    single = beyond_steps(new_case(one, "single", "resnet50", 64, 32, measurement=LONG), one)
    toy = beyond_steps(new_case(one, "single", "toy", 64, 32, measurement=LONG), one)
    assert ddp == pytest.approx(CUDA.launch_s + CUDA.process_group_s + CUDA.first_step_s)
    assert gloo < ddp and single < ddp  # no NCCL communicator (gloo; one process)
    assert toy < single  # no convolution to autotune
    assert toy == pytest.approx(CUDA.launch_s)  # a CUDA context all the same
    cpu = Rig("cpu", 2, 1, (0, 1))
    cpu_ddp = beyond_steps(new_case(cpu, "ddp", "resnet50", 64, 32, measurement=LONG), cpu)
    assert cpu_ddp == pytest.approx(CPU.launch_s + CPU.first_step_s)  # gloo's in launch_s


def test_a_gpus_total_must_hold_the_cuda_context_and_nccls_buffers(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    two = Rig("cuda", 2)
    memory = device_memory(two, 0.0, nvml=fake_nvml((40.0, 40.0)))
    assert memory is not None
    limit = 40 * 1024
    ddp = new_case(two, "ddp", "resnet50", 128, 32)
    room = limit - CUDA_CONTEXT_MIB - 10  # a case's tensors and its context fit, no more
    tight = Admission(two, memory, FakePredictor({"0": room, "1": room}))
    reason = tight.refusal(ddp)  # the tensors alone fit; with the context and NCCL they don't
    assert reason is not None
    assert reason.startswith(f"predicted: {room:.0f} MiB reserved + ")
    assert "CUDA context" in reason and "NCCL buffers" in reason and f"> {limit} MiB" in reason
    # One process per GPU, no process group: the context alone comes on top.
    mp = new_case(two, "mp", "resnet50", 128, 32)
    assert tight.refusal(mp) is None
    over = Admission(two, memory, FakePredictor({"0": limit - 100, "1": 10.0}))
    mp_reason = over.refusal(mp)
    assert mp_reason is not None and "CUDA context" in mp_reason
    assert "NCCL" not in mp_reason
    # Slots talk gloo: no NCCL buffers on the card; each slot's process has its context.
    slots = Rig("cuda", 2, gpu_slots=2)
    shared = device_memory(slots, 0.0, nvml=fake_nvml((80.0,)))
    assert shared is not None
    gloo = Admission(slots, shared, FakePredictor({"0": room, "1": room}))
    assert gloo.refusal(new_case(slots, "ddp", "resnet50", 128, 32)) is None
    # A cap bounds the caching allocator alone (the context and NCCL are outside it).
    capped = device_memory(two, 1024.0, nvml=fake_nvml((40.0, 40.0)))
    assert Admission(two, capped, FakePredictor({"0": 1000, "1": 1000})).refusal(ddp) is None


def mig_nvml(mig_mode: int = 1, instance_gib: float = 10.0) -> types.SimpleNamespace:
    """One 80 GiB GPU in MIG mode (``mig_mode`` 1) with one 10 GiB instance, MIG-cccc-3333."""
    nvml = fake_nvml((80.0,))

    def by_uuid(uuid: bytes) -> str:
        if uuid != b"MIG-cccc-3333":
            raise FakeNvmlError("not found")
        return "mig-0"

    def parent_of(handle: object) -> int:
        if handle != "mig-0":
            raise FakeNvmlError("not a MIG device")
        return 0

    whole = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = parent_of
    nvml.nvmlDeviceGetUUID = lambda h: "GPU-0"
    nvml.nvmlDeviceGetMigMode = lambda h: [mig_mode, mig_mode]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (types.SimpleNamespace(
        total=int(instance_gib * 2**30), used=0) if h == "mig-0" else whole(h))
    return nvml


def test_a_mig_instance_is_limited_by_its_own_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cccc-3333")
    memory = device_memory(Rig("cuda", 1), 0.0, nvml=mig_nvml())
    assert memory is not None and memory.mib == (10 * 1024,)  # not the parent's 80 GiB
    assert "MIG" in memory.source


def test_mig_without_an_instance_named_refuses_the_parents_total(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match="MIG"):
        device_memory(Rig("cuda", 1), 0.0, nvml=mig_nvml())
    admission = Admission.of(Rig("cuda", 1), [], nvml=mig_nvml())
    assert admission.memory is None  # predicted, nothing refused, and why
    assert "MIG" in admission.note and "CUDA_VISIBLE_DEVICES=MIG-" in admission.note
    # MIG off (or an NVML that cannot tell): the GPU's own total, as before.
    plain = device_memory(Rig("cuda", 1), 0.0, nvml=mig_nvml(mig_mode=0))
    assert plain is not None and plain.mib == (80 * 1024,)
