"""dp (``nn.DataParallel``) on a two-GPU cuda rig, every figure (issue #47): each replica
computes its chunk of the batch (``Case.device_batch_size``, the one figure the row, the
batch curve, the waterfall, the answer and the time prediction read), device 0 holds more
than device 1 (the source of the scatter, the gather and the gradients' reduction), and
both GPUs hold NCCL's buffers. The rig is ``Rig("cuda", 2)`` and the outcomes and rows are
made by hand: nothing here needs a GPU, and the same holds on a machine with one.
"""

from __future__ import annotations

import pytest
import torch
from torch._utils import _take_tensors

from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction import memory
from bench_lib.prediction.admission import (
    NCCL_BUFFERS_MIB,
    NCCL_CHANNEL_PEER_MIB,
    NCCL_MAX_CHANNELS,
    Admission,
    DeviceMemory,
    nccl_mib,
)
from bench_lib.prediction.case_shape import shape_of
from bench_lib.prediction.fake_step import COALESCE_BYTES, Program, simulate
from bench_lib.report.answer import answer_lines
from bench_lib.report.memory_prediction import error_table, prediction_points
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
from bench_lib.rows.waterfall import waterfall_columns
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile
from bench_lib.workloads import Workload

RIG = Rig("cuda", 2)
MIB = 2**20
STEP = (("F", 0, 0), ("B", 0, 0))


def dp_case(batch: int = 120, model: str = "resnet50", image: int = 64):
    return new_case(RIG, "dp", model, image, batch)


def test_a_dp_replica_computes_its_chunk_of_the_batch_in_every_figure():
    dp = dp_case()
    assert dp.status is None and dp.world_size == 2 and not dp.process_group
    assert dp.device_batch_size == 60
    steps = CaseOutcome("ok", step_times_s=[0.2, 0.21, 0.19],
                        peak_mem_mib={"0": 900.0, "1": 700.0})
    assert case_row(dp, RIG, steps)["device_batch_size"] == 60
    assert shape_of(dp, RIG).device_batch == 60  # the time prediction's, carried
    # A batch that does not divide: DataParallel scatters torch.chunk's chunks, the first
    # (device 0's) the largest.
    odd = dp_case(121)
    assert odd.status is None
    assert odd.device_batch_size == len(torch.arange(121).chunk(2)[0]) == 61
    # On one GPU DataParallel runs the module itself, on the whole batch.
    assert new_case(Rig("cuda", 1), "dp", "resnet50", 64, 120).device_batch_size == 120


def test_the_batch_curve_measures_single_at_a_dp_replicas_batch():
    profile = Profile(strategies=("single", "dp"), models=("resnet50",), image_sizes=(64,),
                      batch_sizes=(120,), batch_curve=True)
    cases = expand(profile, RIG)
    assert [(c.strategy, c.batch_size, c.curve_of) for c in cases if c.curve_of] == [
        ("single", 60, 120)]


CURVE = {120: 0.30, 60: 0.18}
"""single's median step (s) at the workload's batch and at a replica's."""
OPT = 0.01


def _dp_waterfall(median_s: float) -> dict:
    return waterfall_columns(dp_case(), RIG, CaseOutcome("ok"),
                             {"step_time_s_median": median_s}, CURVE, optimizer_s=OPT)


def test_dp_s_waterfall_takes_its_batch_part_from_single_s_curve():
    cols = _dp_waterfall(0.25)
    assert cols["waterfall_ideal_s"] == pytest.approx(0.30 / 2)
    # Each device computes 60 of 120 images: T(60) - O against half of T(120) - O.
    assert cols["waterfall_batch_s"] == pytest.approx((0.18 - OPT) - (0.30 - OPT) / 2)
    assert cols["waterfall_batch_s"] > 0
    # The master copy on device 0 steps the whole optimizer: O beyond its half.
    assert cols["waterfall_optimizer_s"] == pytest.approx(OPT / 2)
    assert cols["waterfall_remainder_s"] == pytest.approx(0.25 - 0.15 - 0.025 - 0.005)


def test_the_answer_names_dp_and_the_curve_point_of_its_replicas_batch():
    dp = dp_case()
    workload = {"model": "resnet50", "image_size": 64, "batch_size": 120,
                "precision": "fp32", "status": "ok", "launches": 3, "launch_medians_s": ""}
    single = workload | {"strategy": "single", "case_id": "single", "step_time_s_median": 0.30,
                         "step_time_s_ci_low": 0.29, "step_time_s_ci_high": 0.31,
                         "throughput_img_s": 400.0}
    measured = 0.19
    row = workload | {"strategy": "dp", "case_id": dp.case_id, "step_time_s_median": measured,
                      "step_time_s_ci_low": 0.18, "step_time_s_ci_high": 0.20,
                      "throughput_img_s": 120 / measured,
                      "device_batch_size": dp.device_batch_size} | _dp_waterfall(measured)
    efficiency = (CURVE[120] / 120) / (CURVE[60] / 60)
    point = workload | {"strategy": "single", "case_id": "single60", "batch_size": 60,
                        "batch_curve_of": 120, "step_time_s_median": CURVE[60],
                        "throughput_img_s": 60 / CURVE[60],
                        "per_image_efficiency": efficiency}
    (line,) = answer_lines([single, row, point])
    share = row["waterfall_batch_pct"]  # 0.025 of 0.19 s
    assert share == pytest.approx(100 * 0.025 / 0.19)
    assert (f"lose most to the smaller batch per device (a median {share:.0f}% of their "
            f"step): 60 images per device (dp's) run at {efficiency:.0%} of batch 120's "
            "per-image speed on this rig.") in line


def test_dp_s_source_holds_the_whole_batch_the_gathered_outputs_and_reduced_gradients():
    """toy (Linear(10, 10), ReLU, Linear(10, 5): 660 B of parameters; 40 B of input and 20 B
    of targets an image) as DataParallel's device 0 against a replica of the same chunk."""
    toy = Workload("toy", batch_size=1)
    replica = simulate(Program(toy, (), (0,), (1,), STEP))
    source = simulate(Program(toy, (), (0,), (1,), STEP, source_batch=2))
    # Two images' input and targets; at its peak, after the backward, its replica's
    # gradients, the flat copy of them (one chunk) and the flat sum: three copies.
    assert source.held == 660 + 2 * 60 == replica.held + 60
    assert source.peak == source.held + 3 * 660
    assert source.grads_at_peak == 660
    # Large chunks: the activations' peak comes first; the other 1000 images' input and
    # targets are held throughout, and the gathered output (5 floats an image) joins them
    # before the loss.
    big = simulate(Program(toy, (), (0,), (1000,), STEP))
    big_source = simulate(Program(toy, (), (0,), (1000,), STEP, source_batch=2000))
    assert big_source.peak - big.peak == 1000 * 60
    forward = (("F", 0, 0),)
    slopes = [simulate(Program(toy, (), (0,), (n,), forward, source_batch=2 * n)).peak
              - simulate(Program(toy, (), (0,), (n,), forward)).peak for n in (1000, 3000)]
    assert slopes[1] - slopes[0] == 2000 * (60 + 20)


def test_dp_s_device_0_is_predicted_above_device_1_by_the_source_s_parts():
    dp = dp_case(16, "resnet-tiny", 32)
    w = Workload(dp.model, dp.image_size, dp.batch_size, loss=dp.loss, precision=dp.precision)
    replica = simulate(Program(w, (), (0,), (8,), STEP))
    source = simulate(Program(w, (), (0,), (8,), STEP, source_batch=16))
    assert memory.counted_mib(dp, RIG) == {"0": source.peak / MIB,
                                                   "1": replica.peak / MIB}
    # Device 0 holds the other replica's 8 images and their targets too.
    assert source.held - replica.held == 8 * (3 * 32 * 32 * 4 + 8)
    # Its peak is the reduction's: its replica's gradients, the sums so far and the flat
    # copy of the chunk being reduced, chunked as torch's reduce_add_coalesced chunks them.
    with torch.device("meta"):
        model = w.build_model()
    chunks = [sum(g.numel() * g.element_size() for g in c)
              for c in _take_tensors(list(model.parameters()), COALESCE_BYTES)]
    in_flight = max(sum(chunks[:i + 1]) + c for i, c in enumerate(chunks))
    # BatchNorm's step counters, counted from the forward's in-place add that returns them.
    counters = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                   if name.endswith("num_batches_tracked"))
    assert source.peak == source.held + counters + source.params + in_flight
    assert source.peak > replica.peak + source.params  # more than a second copy of the grads
    found = memory.predict(dp, RIG)
    assert found.mib_by_device["0"] > found.mib_by_device["1"]
    assert found.reserved_mib_by_device["0"] > found.reserved_mib_by_device["1"]


class Predicted:
    def __init__(self, mib: dict[str, float]) -> None:
        self.mib = mib

    def __call__(self, case, rig, cut):
        return memory.Prediction(dict(self.mib), cut)


def test_admission_adds_nccl_s_buffers_on_both_gpus_of_dp():
    gpu = 80 * 1024.0
    memory = DeviceMemory((gpu, gpu), "GPU total memory (NVML)", whole_device=True)
    admission = Admission(RIG, memory, Predicted({}))
    beside = {"CUDA context": 770.0, "NCCL buffers": nccl_mib(2)}
    dp = dp_case()
    assert admission.outside_allocator(dp, "0") == beside
    assert admission.outside_allocator(dp, "1") == beside
    # Two ranks: the one-rank communicator's measured figure and one peer's assumed buffers.
    assert nccl_mib(2) == NCCL_BUFFERS_MIB + NCCL_MAX_CHANNELS * NCCL_CHANNEL_PEER_MIB > 600
    assert nccl_mib(1) == NCCL_BUFFERS_MIB
    ddp = new_case(RIG, "ddp", "resnet50", 64, 120)
    assert admission.outside_allocator(ddp, "1") == beside
    single = new_case(RIG, "single", "resnet50", 64, 120)
    assert admission.outside_allocator(single, "0") == {"CUDA context": 770.0}
    one = Rig("cuda", 1)  # DataParallel on one GPU runs the module itself: no NCCL
    alone = Admission(one, DeviceMemory((gpu,), "GPU", whole_device=True), Predicted({}))
    assert alone.outside_allocator(new_case(one, "dp", "resnet50", 64, 120), "0") == {
        "CUDA context": 770.0}
    # What fits beside the context alone does not fit beside NCCL's buffers, on device 1 too.
    fits = gpu - 770.0 - 1
    admission._predictor = Predicted({"0": 1000.0, "1": fits})
    refusal = admission.refusal(dp)
    assert refusal is not None and "device 1" in refusal
    assert f"+ {nccl_mib(2):.0f} MiB NCCL buffers" in refusal


def test_the_memory_table_gives_each_dp_device_its_row():
    import pandas as pd

    cases = pd.DataFrame([{"status": "ok", "strategy": "dp", "image_size": 64, "case_id": "a",
                           "peak_mem_mib_predicted_by_device": "0:130.0;1:90.0",
                           "peak_mem_net_mib_by_device": "0:100.0;1:100.0"}])
    table = error_table(prediction_points(cases)).set_index("variant")
    assert list(table.index) == ["dp device 0", "dp device 1"]
    assert table.loc["dp device 0", "mean_error_pct"] == pytest.approx(30.0)
    assert table.loc["dp device 1", "mean_error_pct"] == pytest.approx(-10.0)
    # dp on one GPU has no source apart from its replica: one row, as before.
    one = cases.assign(peak_mem_mib_predicted_by_device="0:110.0",
                       peak_mem_net_mib_by_device="0:100.0")
    assert list(error_table(prediction_points(one)).variant) == ["dp"]
