"""Memory predicted before a case runs: counted on fake tensors against a hand count, its
device labels, the runner's refusal of a case predicted not to fit, and its columns."""

from __future__ import annotations

import csv
import dataclasses
import os
import types

import pytest

from bench_lib import commands
from bench_lib.commands.plan import profile_overrides
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction import memory, schedule_orders
from bench_lib.prediction.admission import Admission, DeviceMemory, device_memory
from bench_lib.prediction.fake_step import Program, simulate
from bench_lib.report.device_figures import parse_by_device
from bench_lib.report.memory_prediction import error_table, fig_prediction, prediction_points
from bench_lib.results.read import read_cases
from bench_lib.results.schema import ADDED_CASE_COLUMNS, CASE_COLUMNS
from bench_lib.results.store import RunWriter, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
from bench_lib.run import runner
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement
from bench_lib.workloads import Workload

MIB = 2**20
TOY = Workload("toy", batch_size=1)
# toy: Linear(10, 10), ReLU | Linear(10, 5), fp32, MSE against 5 real targets per sample.
TOY_PARAM_BYTES = 4 * (10 * 10 + 10 + 10 * 5 + 5)
TOY_GRAD_BYTES = TOY_PARAM_BYTES


def toy_program(images: int, actions: tuple[tuple[str, int, int], ...]) -> Program:
    return Program(TOY, (), (0,), (images,), actions)


def test_toy_params_and_forward_are_a_hand_count():
    """Forward only: the input (40 B a sample) and targets (20 B) are held; the peak comes
    as the ReLU writes its output (40 B) beside the first linear layer's (40 B), which is
    let go after it (the ReLU saves its own output, the linear layer its input)."""
    forward = (("F", 0, 0),)
    small, large = simulate(toy_program(1000, forward)), simulate(toy_program(3000, forward))
    assert small.params == TOY_PARAM_BYTES == 660
    assert large.peak - small.peak == (40 + 20 + 40 + 40) * 2000
    assert small.grads_at_peak == 0


def test_toy_training_step_is_a_hand_count():
    """Forward and backward: the peak comes in the ReLU's backward, where the input (40 B a
    sample), targets (20 B), the ReLU's saved output (40 B), the gradient reaching it (40
    B) and the one it makes (40 B) are live, beside the parameters and the second layer's
    gradients (50 + 5 floats), already made."""
    step = (("F", 0, 0), ("B", 0, 0))
    small, large = simulate(toy_program(1000, step)), simulate(toy_program(3000, step))
    assert large.peak - small.peak == (40 + 20 + 40 + 40 + 40) * 2000
    fixed = small.peak - 180 * 1000
    second_layer_grads = 4 * (10 * 5 + 5)
    assert small.grads_at_peak == second_layer_grads
    # What is left: parameters, those gradients and a few scalars (the loss and its grad).
    assert 0 <= fixed - (TOY_PARAM_BYTES + second_layer_grads) <= 64


# planned only (nothing asks CUDA); memory.counted_mib: the bare count
CUDA2 = Rig("cuda", 2)


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_stages_minus_rank():
    """Rank 0 of 2 with 4 micro-batches: GPipe's peak comes in its last forward, the ReLU
    outputs (40 B a sample) of all four held, no gradient yet; 1F1B's comes with two held,
    after its first backward made the stage's weight gradients (Linear(10, 10): 110
    floats). Everything else (inputs, receive buffers, the transient) is the same."""
    split = 1000
    rank0 = {s: memory.counted_mib(
                 new_case(CUDA2, s, "toy", 0, 4 * split, split_size=split), CUDA2)["0"]
             for s in ("gpipe", "1f1b")}
    assert (rank0["gpipe"] - rank0["1f1b"]) * MIB == pytest.approx(2 * 40 * split - 4 * 110)


def test_1f1b_order_is_torchs_warmup_then_one_backward_one_forward():
    assert schedule_orders.schedule_actions("1f1b", 2, 3) == (
        (("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)),
        (("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("F", 1, 2), ("B", 1, 2)))


@pytest.mark.integration
def test_device_labels_are_those_the_measurement_records():
    rig = Rig("cpu", 2, 1, (0, 1))
    labels = {}
    for strategy in ("single", "ddp", "mp", "pipeline", "gpipe", "1f1b", "accum", "fsdp"):
        case = new_case(rig, strategy, "resnet-tiny", 64, 8, split_size=4)
        p = memory.predict(case, rig)
        labels[strategy] = sorted(p.mib_by_device)
        assert all(v > 0 for v in p.mib_by_device.values())
        assert bool(p.cut) == (case.partition is not None)
    assert labels == {"single": ["0"], "accum": ["0"], "ddp": ["0", "1"], "fsdp": ["0", "1"],
                      "mp": ["0+1"], "pipeline": ["0+1"], "gpipe": ["0", "1"],
                      "1f1b": ["0", "1"]}
    # On GPUs the devices of one process are apart.
    mp = memory.predict(new_case(CUDA2, "mp", "resnet-tiny", 64, 8), CUDA2)
    assert sorted(mp.mib_by_device) == ["0", "1"]


def test_a_cpu_rig_scales_the_count_by_the_heap_factor():
    cpu = Rig("cpu", 2, 1, (0, 1))
    on_cpu = memory.predict(new_case(cpu, "single", "toy", 0, 1000), cpu).max_mib
    counted = memory.counted_mib(new_case(CUDA2, "single", "toy", 0, 1000), CUDA2)["0"]
    assert on_cpu == pytest.approx(memory.CPU_HEAP_FACTOR * counted)
    assert counted * MIB == 660 + 220 + 180 * 1000 + 8  # the hand count above


def test_a_cpu_rig_counts_ddps_buckets_once():
    """Allocated as DDP wraps the model, the buckets are not heap churn: unscaled."""
    cpu = Rig("cpu", 2, 1, (0, 1))
    on_cpu = memory.predict(new_case(cpu, "ddp", "toy", 0, 200), cpu).mib_by_device["0"]
    counted = memory.counted_mib(new_case(CUDA2, "ddp", "toy", 0, 200), CUDA2)["0"]
    buckets = TOY_GRAD_BYTES / MIB
    assert on_cpu == pytest.approx(memory.CPU_HEAP_FACTOR * (counted - buckets) + buckets)


def test_ddp_adds_one_bucket_copy_of_the_gradients():
    ddp = memory.counted_mib(new_case(CUDA2, "ddp", "toy", 0, 200), CUDA2)["0"]
    single = memory.counted_mib(new_case(CUDA2, "single", "toy", 0, 100), CUDA2)["0"]
    assert (ddp - single) * MIB == pytest.approx(TOY_GRAD_BYTES)


# --- the runner: refusal before launch, columns in the row ----------------------------


class FakePredictor:
    def __init__(self, mib: dict[str, float]) -> None:
        self.mib, self.calls = mib, []

    def __call__(self, case, rig, cut):
        self.calls.append(cut)
        return memory.Prediction(dict(self.mib), cut)


def _sweep(tmp_path, monkeypatch, case, admission):
    launched = []

    def fake_run_case(spec, work_root, launch, options):
        launched.append(spec.case.case_id)
        return CaseOutcome("error", "fake launch")

    monkeypatch.setattr(runner, "run_case", fake_run_case)
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": 5})
    with RunWriter(run_dir) as writer:
        rows = runner.run_sweep([case], admission.rig, writer,
                                runner.SweepOptions(admission=admission))
    return rows, launched, run_dir


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.integration
def test_a_case_predicted_over_the_cap_is_oom_unlaunched_unless_told(tmp_path, monkeypatch,
                                                                     skip):
    rig = Rig("cpu", 2, 1, (0, 1))
    m = Measurement(launches=2, max_memory_per_device_mib=1000.0, predict_skip=skip)
    case = new_case(rig, "mp", "toy", 0, 8, measurement=m)
    fake = FakePredictor({"0+1": 2500.0})  # two devices' caps: 2000 MiB
    admission = Admission.of(rig, [case])
    admission._predictor = fake
    (row,), launched, run_dir = _sweep(tmp_path, monkeypatch, case, admission)
    if skip:
        assert row["status"] == "oom" and launched == []
        assert row["reason"].startswith("predicted: 2500 MiB > 2000 MiB (device 0+1, "
                                        "--max-memory-per-device")
    else:
        assert row["status"] == "error" and launched == [case.case_id]
    assert row["peak_mem_mib_predicted_by_device"] == "0+1:2500.0"
    cases = read_cases(run_dir)
    assert cases.loc[0, "peak_mem_mib_predicted_max"] == 2500.0
    assert parse_by_device(cases.loc[0, "peak_mem_mib_predicted_by_device"]) == {"0+1": 2500.0}


@pytest.mark.integration
def test_the_real_prediction_refuses_in_the_runner_and_the_flag_reaches_the_sweep(
        tmp_path, monkeypatch):
    rig = Rig("cpu", 2, 1, (0, 1))
    tiny_cap = Measurement(max_memory_per_device_mib=0.001)  # toy needs a few kB
    case = new_case(rig, "single", "toy", 0, 8, measurement=tiny_cap)
    (row,), launched, _ = _sweep(tmp_path, monkeypatch, case, Admission.of(rig, [case]))
    assert launched == [] and row["reason"].startswith("predicted: ")
    args = commands.build_parser().parse_args(["run", "--no-predict-skip"])
    assert profile_overrides(args)["predict_skip"] is False
    assert profile_overrides(commands.build_parser().parse_args(["run"]))["predict_skip"] is None


@pytest.mark.integration
def test_a_cpu_rig_without_a_cap_refuses_nothing(tmp_path, monkeypatch):
    rig = Rig("cpu", 2, 1, (0, 1))
    case = new_case(rig, "single", "toy", 0, 8)
    admission = Admission.of(rig, [case])
    assert admission.memory is None
    admission._predictor = FakePredictor({"0": 10**9})
    (row,), launched, _ = _sweep(tmp_path, monkeypatch, case, admission)
    assert launched == [case.case_id] and row["status"] == "error"


def test_the_prediction_is_made_again_with_the_cut_the_case_ran(cpu_rig):
    case = new_case(cpu_rig, "gpipe", "resnet-tiny", 64, 8, split_size=4, partition="balanced")
    fake = FakePredictor({"0": 1.0, "1": 1.0})
    admission = Admission(cpu_rig, DeviceMemory((10.0, 10.0), "test"), fake)
    assert admission.refusal(case) is None
    admission.columns(case, [CaseOutcome("ok", partition="balanced:3")])
    assert fake.calls == ["", "balanced:3"]


def test_a_prediction_that_fails_leaves_the_case_running_with_why(cpu_rig):
    def broken(case, rig, cut):
        raise RuntimeError("no replay")

    case = new_case(cpu_rig, "single", "toy", 0, 8)
    admission = Admission(cpu_rig, DeviceMemory((1.0, 1.0), "test"), broken)
    assert admission.refusal(case) is None
    cols = admission.columns(case, [])
    assert "memory not predicted: RuntimeError: no replay" in cols["note"]


def fake_nvml(total_gib: tuple[float, ...]) -> types.SimpleNamespace:
    """A stand-in for pynvml: GPUs on buses 0x3B, 0x5E... with the given total memory."""
    buses = [f"00000000:{0x3B + 0x23 * i:02X}:00.0" for i in range(len(total_gib))]
    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(total_gib), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=buses[h]),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetName=lambda h: "Fake GPU",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=int(total_gib[h] * 2**30), used=0))


def test_cuda_device_memory_is_each_gpus_total_through_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    memory = device_memory(Rig("cuda", 2), 0.0, nvml=fake_nvml((80.0, 40.0)))
    assert memory is not None and memory.mib == (80 * 1024, 40 * 1024)
    admission = Admission(Rig("cuda", 2), memory, FakePredictor({"0": 50_000, "1": 50_000}))
    case = new_case(Rig("cuda", 2), "ddp", "resnet50", 128, 32)
    assert admission.refusal(case) == (
        "predicted: 50000 MiB reserved + 770 MiB CUDA context + 984 MiB NCCL buffers > "
        "40960 MiB (device 1, GPU total memory (NVML); --no-predict-skip launches it)")
    # --gpu-slots 2: two slots share the first GPU's memory.
    slots = device_memory(Rig("cuda", 2, gpu_slots=2), 0.0, nvml=fake_nvml((80.0,)))
    assert slots is not None and slots.mib == (40 * 1024, 40 * 1024)
    # A cap wins over the card, on any rig.
    capped = device_memory(Rig("cuda", 2), 1024.0, nvml=fake_nvml((80.0, 80.0)))
    assert capped == DeviceMemory((1024.0, 1024.0), "--max-memory-per-device")


class ReservedPredictor:
    """A prediction whose allocator reserves 30% above its allocated peak."""

    def __call__(self, case, rig, cut):
        return memory.Prediction({"0": 1000.0}, cut, {"0": 1300.0})


def test_a_cuda_case_is_admitted_by_its_reserved_peak_not_its_allocated_one():
    """A GPU runs out of segments, not of tensors: 1000 MiB allocated fits a 1200 MiB cap,
    the 1300 MiB the allocator reserves for them does not. The row keeps both."""
    one = Rig("cuda", 1)
    case = new_case(one, "single", "resnet50", 64, 8)
    admission = Admission(one, DeviceMemory((1200.0,), "--max-memory-per-device"),
                          ReservedPredictor())
    assert admission.refusal(case) == (
        "predicted: 1300 MiB reserved > 1200 MiB (device 0, --max-memory-per-device; "
        "--no-predict-skip launches it)")
    cols = admission.columns(case, [])
    assert cols["peak_mem_mib_predicted_by_device"] == "0:1000.0"
    assert cols["peak_mem_reserved_mib_predicted_by_device"] == "0:1300.0"
    assert cols["peak_mem_reserved_mib_predicted_max"] == 1300.0
    cpu = Rig("cpu", 2, 1, (0, 1))  # resident memory: one figure, no reserved column
    assert "peak_mem_reserved_mib_predicted_max" not in Admission(
        cpu, None, ReservedPredictor()).columns(new_case(cpu, "single", "toy", 0, 8), [])


def test_one_process_on_two_slots_of_a_gpu_is_one_gpus_context_against_the_whole_gpu(
        monkeypatch):
    """mp on the validation mode's two slots of one 80 GiB GPU: one process, one allocator,
    predicted under the joined label as its measurement reads it; its limit is the GPU (both
    slots' halves) less one CUDA context, not two."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slots = Rig("cuda", 2, gpu_slots=2)
    case = new_case(slots, "mp", "resnet-tiny", 64, 8)
    assert list(memory.predict(case, slots).mib_by_device) == ["0+1"]
    devices = device_memory(slots, 0.0, nvml=fake_nvml((80.0,)))
    assert devices is not None
    admission = Admission(slots, devices)
    assert admission.outside_allocator(case, "0+1") == {"CUDA context": 770.0}
    fits = 80 * 1024 - 770.0 - 1
    admission._predictor = FakePredictor({"0+1": fits})
    assert admission.refusal(case) is None
    admission._predictor, admission._made = FakePredictor({"0+1": fits + 2}), {}
    assert admission.refusal(case) is not None


def test_unreadable_nvml_predicts_but_refuses_nothing():
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(OSError("no lib")))
    admission = Admission.of(Rig("cuda", 1), [], nvml=broken)
    assert admission.memory is None and "no lib" in admission.note


# --- the report -------------------------------------------------------------------------


def test_report_points_pair_prediction_and_measurement_by_device():
    import pandas as pd

    cases = pd.DataFrame([
        {"status": "ok", "strategy": "gpipe", "image_size": 64, "case_id": "a",
         "peak_mem_mib_predicted_by_device": "0:110.0;1:90.0",
         "peak_mem_net_mib_by_device": "0:100.0;1:100.0"},
        {"status": "oom", "strategy": "single", "image_size": 64, "case_id": "b",
         "peak_mem_mib_predicted_by_device": "0:5000.0", "peak_mem_net_mib_by_device": ""},
    ])
    points = prediction_points(cases)
    assert sorted(points.error_pct.round(6)) == [-10.0, 10.0]
    table = error_table(points)
    row = table.iloc[0]
    assert (row.strategy, row.image_size, row.points, row.within_band) == ("gpipe", 64, 2, 2)
    assert row.mean_error_pct == pytest.approx(0.0, abs=1e-9)
    assert row.worst_abs_error_pct == pytest.approx(10.0)
    fig = fig_prediction(cases)
    assert fig is not None and "2 of 2 device peaks within 15%" in fig.axes[0].get_title()


def test_report_table_gives_a_ddp_knob_variant_its_own_row():
    """A knob that changes memory gets its own row: a PowerSGD miss shows as
    ddp+powersgd-r1, not as ddp's worst case."""
    import pandas as pd

    base = {"status": "ok", "strategy": "ddp", "image_size": 64,
            "peak_mem_net_mib_by_device": "0:100.0;1:100.0", "ddp_bucket_cap_mb": "default",
            "ddp_gradient_as_bucket_view": False, "ddp_static_graph": False}
    cases = pd.DataFrame([
        base | {"case_id": "a", "ddp_comm_hook": "none",
                "peak_mem_mib_predicted_by_device": "0:105.0;1:105.0"},
        base | {"case_id": "b", "ddp_comm_hook": "powersgd-r1",
                "peak_mem_mib_predicted_by_device": "0:55.0;1:55.0"},
    ])
    table = error_table(prediction_points(cases)).set_index("variant")
    assert list(table.index) == ["ddp", "ddp+powersgd-r1"]
    assert table.loc["ddp", "worst_abs_error_pct"] == pytest.approx(5.0)
    assert table.loc["ddp+powersgd-r1", "worst_abs_error_pct"] == pytest.approx(45.0)


def test_prediction_figure_leaves_zero_predictions_off_its_log_axes():
    """toy predicts 0.0 MiB (2 KiB of weights): the figure still draws the others and says
    how many it left off, instead of failing on a log axis (it did, in a workloads run)."""
    import pandas as pd

    cases = pd.DataFrame([
        {"status": "ok", "strategy": "single", "image_size": 0, "case_id": "toy",
         "peak_mem_mib_predicted_by_device": "0:0.0", "peak_mem_net_mib_by_device": "0:10.8"},
        {"status": "ok", "strategy": "single", "image_size": 32, "case_id": "r18",
         "peak_mem_mib_predicted_by_device": "0:132.9",
         "peak_mem_net_mib_by_device": "0:144.1"},
    ])
    fig = fig_prediction(cases)
    assert fig is not None
    title = fig.axes[0].get_title()
    assert "1 of 2 device peaks within 15%" in title and "1 predicted at 0 MiB" in title
    only_zero = cases.iloc[:1]
    assert fig_prediction(only_zero) is None
    assert len(prediction_points(only_zero)) == 1  # still in the error table


def test_old_v5_folders_read_without_the_prediction_columns(tmp_path):
    """A run folder written before the columns existed still reads (they come back empty)."""
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": 5})
    rig = Rig("cpu", 2, 1, (0, 1))
    case = new_case(rig, "single", "toy", 0, 8)
    with RunWriter(run_dir) as writer:
        writer.write_case(case_row(case, rig, CaseOutcome("error", "x")))
    with (run_dir / "cases.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    old = [c for c in CASE_COLUMNS if c not in ADDED_CASE_COLUMNS]
    with (run_dir / "cases.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with RunWriter(run_dir) as writer:  # a resumed old folder keeps its header
        writer.write_case(case_row(dataclasses.replace(case, batch_size=16), rig,
                                          CaseOutcome("error", "y")) | {
            "peak_mem_mib_predicted_max": 1.0})
    cases = read_cases(run_dir)
    assert len(cases) == 2 and cases.peak_mem_mib_predicted_max.isna().all()
    assert parse_by_device(cases.loc[0, "peak_mem_mib_predicted_by_device"]) == {}


@pytest.mark.parametrize("strategy", ["gpipe", "zbv"])
def test_the_flops_cut_is_the_one_the_worker_chooses(cpu_rig, strategy):
    """The cut a ``balanced-flops`` case is predicted with is the worker's own, which it
    chooses from FLOPs counted on real tensors (``partition.choose``)."""
    import torch

    from bench_lib.strategies.partition import choose
    from bench_lib.strategies.schedules import stage_placement

    case = new_case(cpu_rig, strategy, "resnet-tiny", 64, 8, split_size=4,
                    partition="balanced-flops")
    w = Workload("resnet-tiny", 64, 8)
    spr = 2 if strategy == "zbv" else 1
    placement = stage_placement(2, 2, "v") if spr == 2 else None
    real = choose("balanced-flops", w.build_model(), 2 * spr, w, 4, torch.device("cpu"),
                  placement)
    assert memory.predict(case, cpu_rig).cut == real.label


def _real_fsdp_live_peak(rank: int, world: int, model: str, image: int, batch: int) -> float:
    """The live tensor peak (bytes) of one real FSDP2 step on this gloo rank."""
    import torch

    from bench_lib import strategies
    from bench_lib.prediction.fake_step import LiveBytes
    from bench_lib.strategies.base import BuildContext

    torch.manual_seed(0)
    w = Workload(model, image, batch)
    trainer = strategies.get("fsdp").build(w.build_model(), [torch.device("cpu")],
                                           BuildContext(w, None, rank, world))
    x, y = w.make_batch(batch // world, torch.device("cpu"))
    trainer.step(x, y)  # FSDP2's lazy init and its buffers happen in the first step
    tracker = LiveBytes([])
    for t in [*trainer.module.parameters(), x, y]:
        tracker.hold(t)
    with tracker:
        trainer.step(x, y)
    return float(tracker.peak)


@pytest.mark.integration
def test_fsdp_prediction_is_near_the_live_tensors_of_a_real_fsdp2_step():
    """The count predicted for fsdp (no FSDP run is replayed) against the live tensors of a
    real FSDP2 step counted the same way: ResNet50, batch 16, at 64-128 px, 2-4% under;
    ResNet18 at 32 px, where the four units in flight are most of it, 9.5% over."""
    from tests.dist_harness import run_ranks

    real = run_ranks(_real_fsdp_live_peak, 2, args=("resnet18", 32, 8))
    counted = memory.counted_mib(new_case(CUDA2, "fsdp", "resnet18", 32, 8), CUDA2)
    for rank, peak in enumerate(real):
        assert counted[str(rank)] * MIB == pytest.approx(peak, rel=0.15)


def test_ddp_1_holds_buckets_and_bucket_views_are_not_counted_twice():
    from bench_lib.strategies.ddp_knobs import DdpKnobs

    single = memory.counted_mib(new_case(CUDA2, "single", "toy", 0, 200), CUDA2)["0"]
    one = memory.counted_mib(new_case(CUDA2, "ddp-1", "toy", 0, 200), CUDA2)
    assert list(one) == ["0"]
    assert (one["0"] - single) * MIB == pytest.approx(TOY_GRAD_BYTES)
    plain = memory.counted_mib(new_case(CUDA2, "ddp", "toy", 0, 200), CUDA2)["0"]
    view = memory.counted_mib(new_case(CUDA2, "ddp", "toy", 0, 200,
                                        ddp=DdpKnobs(gradient_as_bucket_view=True)), CUDA2)["0"]
    # The gradients live at the peak (the second Linear's, made first by backward) are
    # separate tensors without the views and bucket memory with them.
    assert (plain - view) * MIB == pytest.approx(4 * (10 * 5 + 5))


def test_powersgd_adds_its_error_feedback_and_two_copies_of_the_largest_bucket():
    """Measured on 2 cores at 64 px (ResNet50, batch 16): ddp-1 with PowerSGD 677 MiB where
    the hook's state was not counted (487 predicted): it is now."""
    from bench_lib.strategies.ddp_knobs import DdpKnobs

    def case(rig, hook, cap=None):
        knobs = DdpKnobs(bucket_cap_mb=cap, comm_hook=hook)
        return new_case(rig, "ddp-1", "resnet18", 32, 8, ddp=knobs)

    def counted(hook, cap=None):
        return memory.counted_mib(case(CUDA2, hook, cap), CUDA2)["0"]

    grads = 4 * sum(p.numel() for p in Workload("resnet18", 32, 8).build_model().parameters())
    assert grads > memory.DDP_BUCKET_BYTES  # several buckets: the largest is the cap
    added = counted("powersgd") - counted("none")
    assert added * MIB == pytest.approx(grads + 2 * memory.DDP_BUCKET_BYTES, rel=1e-6)
    small = counted("powersgd", cap=1.0) - counted("none", cap=1.0)
    assert small * MIB == pytest.approx(grads + 2 * 2**20, rel=1e-6)
    assert counted("fp16") == counted("none")
    cpu = Rig("cpu", 2, 1, (0, 1))  # heap, scaled like the activations
    on_cpu = {h: memory.predict(case(cpu, h), cpu).max_mib for h in ("powersgd", "none")}
    assert on_cpu["powersgd"] - on_cpu["none"] == pytest.approx(
        memory.CPU_HEAP_FACTOR * added, rel=1e-6)


@pytest.mark.integration
def test_heap_factor_script_counts_live_tensors_and_resident_memory():
    """benchmarks/heap_factor.py (the calibration check memory.py cites) runs and reads
    both figures; resident memory holds at least the live tensors. In its own process, as
    it is run: in pytest's, heap pages earlier tests freed would hold the tensors unseen."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).parents[1]
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "heap_factor.py"), "--order", "gpipe",
         "--stage", "0", "--cut", "14", "--image-size", "32", "--microbatch", "2",
         "--count", "2"], cwd=repo, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr
    live, resident = (float(v) for v in re.findall(r"([\d.]+) MiB", proc.stdout))
    assert 1 < live < resident, proc.stdout
