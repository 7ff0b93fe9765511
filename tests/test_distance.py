"""The pairwise-distance workload (bench_lib.distance): the three methods agree in value and
gradient with each other and with the closed-form float64 reference; the cap makes blocked
an oom where split fits; the command's bad input writes nothing; a run writes a valid
distance.csv and its report."""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest
import torch

from bench_lib import commands, exit_codes
from bench_lib.distance import methods
from bench_lib.distance.benchmark import AGREE_RTOL, _agreement, progress_line
from bench_lib.distance.launch import Computed
from bench_lib.distance.spec import Layer, new_case
from bench_lib.report.build import write_report
from bench_lib.report.distance_report import FIGURE_FILE, read_distance
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import DISTANCE_COLUMNS
from bench_lib.rig import Rig
from bench_lib.sweep.profile import UsageError
from tests.dist_harness import run_ranks

CPU = torch.device("cpu")
SMALL = Layer(41, 6, 3, 3)  # an odd count: rows split unevenly over 2 and 3 ranks
RTOL = 1e-10


def _value_and_grad(fn, layer: Layer = SMALL, zero: tuple[int, ...] = ()):
    weight = methods.make_weight(layer, 0, "fp64", CPU)
    with torch.no_grad():
        weight[list(zero)] = 0.0
    total = fn(weight)
    total.backward()
    return float(total.detach()), weight.grad.clone()


def _close(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> None:
    assert a[0] == pytest.approx(b[0], rel=RTOL)
    scale = float(b[1].abs().max())
    assert float((a[1] - b[1]).abs().max()) <= RTOL * scale


def _reference(layer: Layer = SMALL, zero: tuple[int, ...] = ()) -> tuple[float, torch.Tensor]:
    weight = methods.make_weight(layer, 0, "fp64", CPU)
    with torch.no_grad():
        weight[list(zero)] = 0.0
    return methods.reference(weight, 7)


def test_the_sum_is_over_both_orders_with_a_zero_diagonal():
    # Three kernels on a line at 0, 3 and 4 (a 3x1x1x1 weight): pairs 3, 4, 1, each twice.
    weight = torch.tensor([0.0, 3.0, 4.0], dtype=torch.float64).reshape(3, 1, 1, 1)
    for fn in (methods.loop, lambda w: methods.blocked(w, 2)):
        assert float(fn(weight)) == pytest.approx(16.0, rel=1e-12)
    assert methods.reference(weight, 2)[0] == pytest.approx(16.0, rel=1e-12)


def test_loop_blocked_split_devices_and_the_reference_agree_in_float64():
    loop = _value_and_grad(methods.loop)
    for other in (_value_and_grad(lambda w: methods.blocked(w, 16)),
                  _value_and_grad(lambda w: methods.split_devices(w, [CPU, CPU], 16)),
                  _value_and_grad(lambda w: methods.split_devices(w, [CPU] * 3, 5)),
                  _reference()):
        _close(other, loop)


@pytest.mark.parametrize("block_rows", [1, 7, 25, 26, 40, 41, 1000])
def test_blocked_gives_the_same_at_every_block_size(block_rows):
    _close(_value_and_grad(lambda w: methods.blocked(w, block_rows)), _reference())


def test_zero_distances_give_a_zero_not_a_nan_gradient():
    # Pruned (all-zero) kernels are exactly as far apart as p from itself: 0, where the
    # norm's gradient is undefined. Every method takes 0 there, as the reference does.
    zero = (3, 17, 30)
    ref = _reference(zero=zero)
    for fn in (methods.loop, lambda w: methods.blocked(w, 8),
               lambda w: methods.split_devices(w, [CPU, CPU], 8)):
        value, grad = _value_and_grad(fn, zero=zero)
        assert not torch.isnan(grad).any()
        _close((value, grad), ref)


def test_without_the_diagonal_subtracted_cdist_would_be_off():
    # Why blocked subtracts each block's diagonal: cdist's matrix-product distances leave
    # ~1e-8 |x| on it in float64, and a gradient ~1e-9 off, beyond the tolerance above.
    weight = methods.make_weight(SMALL, 0, "fp64", CPU)
    x = methods.kernels(weight)
    with torch.no_grad():
        plain = float(torch.cdist(x, x).sum())
    ref = _reference()
    assert abs(plain - ref[0]) > RTOL * ref[0]


def test_row_ranges_cover_every_row_once_evenly():
    for n, parts in [(41, 2), (41, 3), (8, 8), (5, 7)]:
        ranges = methods.row_ranges(n, parts)
        assert [r for rng in ranges for r in rng] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError):
        methods.row_ranges(4, 0)


def _split_on_ranks(rank, world_size, block_rows):
    weight = methods.make_weight(SMALL, 0, "fp64", CPU)
    total = methods.split_ranks(weight, rank, world_size, block_rows)
    total.backward()
    methods.reduce_gradient(weight, world_size)
    return float(total), weight.grad.clone()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.integration
def test_split_over_gloo_ranks_gives_every_rank_the_full_value_and_gradient(world_size):
    loop = _value_and_grad(methods.loop)
    for result in run_ranks(_split_on_ranks, world_size, args=(6,)):
        _close(result, loop)


def test_loop_is_skipped_above_its_limit_and_split_needs_two_devices():
    cpu2 = Rig("cpu", 2, 1, (0, 0))
    big = Layer(200, 8, 1, 1)
    assert new_case(cpu2, big, "loop", "fp32", 64, 128).status == "skipped"
    assert new_case(cpu2, SMALL, "loop", "fp32", 64, 128).status is None
    split = new_case(cpu2, big, "split", "fp32", 64, 128)
    assert (split.status, split.world_size, split.processes) == (None, 2, 2)
    lone = new_case(Rig("cpu", 1, 1, (0,)), big, "split", "fp32", 64, 128)
    assert lone.status == "unsupported" and "2 or more devices" in lone.reason
    gpus = new_case(Rig("cuda", 2), big, "split", "fp32", 64, 128)
    assert (gpus.world_size, gpus.processes) == (2, 1)  # one process drives both GPUs
    with pytest.raises(UsageError):
        Layer.parse("64x64x3")


def test_agreement_is_judged_by_the_precisions_tolerance():
    grad = torch.tensor([[2.0, -4.0]], dtype=torch.float64)
    near = _agreement(Computed(100.0 * (1 + 1e-6), grad * (1 + 1e-6)), 100.0, grad, "fp32")
    assert near["agrees"] == 1
    assert near["value_rel_diff"] == pytest.approx(1e-6)
    assert near["grad_max_abs_diff"] == pytest.approx(4e-6)
    assert near["grad_rel_diff"] == pytest.approx(1e-6)
    assert _agreement(Computed(100.0 * (1 + 1e-6), grad), 100.0, grad, "fp64")["agrees"] == 0
    off_grad = _agreement(Computed(100.0, grad + 1e-3), 100.0, grad, "fp32")
    assert off_grad["agrees"] == 0 and off_grad["value_abs_diff"] == 0.0
    assert AGREE_RTOL["fp64"] < AGREE_RTOL["fp32"]


@pytest.mark.parametrize("flags, message", [
    (["--layers", "64x64x3"], "expected OUTxINxKHxKW"),
    (["--layers", "0x64x3x3"], "must be >= 1"),
    (["--methods", "cdist"], "unknown method 'cdist'"),
    (["--precision", "fp16"], "unknown dtype 'fp16'"),
    (["--block-rows", "0"], "--block-rows"),
    (["--launches", "0"], "launches must be >= 1"),
    (["--methods", "loop", "--layers", "4096x8x1x1"], "no case can run"),
    (["--methods", "split", "--devices", "1"], "split needs 2 or more devices"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    code = commands.main(["distance", "--rig", "cpu", "--out", str(out), *flags])
    assert code == exit_codes.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_bad_memory_cap_is_refused_by_the_parser(tmp_path):
    with pytest.raises(SystemExit) as e:
        commands.main(["distance", "--rig", "cpu", "--max-memory-per-device", "lots",
                  "--out", str(tmp_path / "out")])
    assert e.value.code == exit_codes.EXIT_USAGE
    assert not (tmp_path / "out").exists()


def _run(tmp_path, *flags: str) -> tuple[int, pd.DataFrame, object]:
    out = tmp_path / "out"
    code = commands.main(["distance", "--rig", "cpu", "--out", str(out), *flags])
    (run_dir,) = run_dirs_in(out)
    assert run_dir.name.endswith("_distance")
    assert os.readlink(out / "latest-distance") == run_dir.name
    return code, read_distance(run_dir).set_index("case_id"), run_dir


@pytest.mark.timeout(240)
@pytest.mark.integration
def test_a_tiny_run_writes_a_valid_distance_csv_whose_cases_agree(tmp_path, capsys):
    # 30 kernels, rows split 15/15 over 2 ranks, in blocks of 8 (the last one of 6).
    code, df, run_dir = _run(tmp_path, "--layers", "30x4x3x3", "--launches", "2",
                             "--block-rows", "8")
    assert code == 0
    assert list(pd.read_csv(run_dir / "distance.csv").columns) == DISTANCE_COLUMNS
    assert df.status.to_dict() == {"loop_30x4x3x3_fp32": "ok", "blocked_30x4x3x3_fp32": "ok",
                                   "split_30x4x3x3_fp32": "ok"}
    assert (df.agrees == 1).all() and (df.value_rel_diff <= AGREE_RTOL["fp32"]).all()
    # Every case computed the same D, within float32 rounding.
    assert df.value.max() - df.value.min() <= 1e-5 * df.value_ref.iloc[0]
    assert (df.launches == 2).all() and df.step_time_s_ci_low.notna().all()
    assert (df.step_time_s_ci_low <= df.step_time_s_median).all()
    assert (df.step_time_s_median <= df.step_time_s_ci_high).all()
    assert df.world_size.to_dict() == {"loop_30x4x3x3_fp32": 1, "blocked_30x4x3x3_fp32": 1,
                                       "split_30x4x3x3_fp32": 2}
    assert df.loc["split_30x4x3x3_fp32", "peak_mem_net_mib_by_device"].count(":") == 2
    assert df.loc["blocked_30x4x3x3_fp32", "speedup_vs_blocked"] == pytest.approx(1.0)
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert len(progress) == 3 and progress[-1].startswith("[3/3] split_30x4x3x3_fp32")
    page = write_report([run_dir]).read_text()
    assert page.count("<tr") == 1 + 3 and (run_dir / FIGURE_FILE).is_file()


@pytest.mark.timeout(240)
@pytest.mark.integration
def test_under_a_small_cap_blocked_is_an_oom_where_split_over_two_fits(tmp_path):
    # 6144 kernels in float64: blocked keeps 6144^2 distances (288 MiB) for its backward and
    # peaks near 370 MiB; each of 2 ranks keeps half and peaks near 235 MiB.
    code, df, _ = _run(tmp_path, "--layers", "6144x8x1x1", "--methods", "blocked,split",
                       "--precision", "fp64", "--block-rows", "128", "--launches", "1",
                       "--max-memory-per-device", "300MiB")
    assert code == 0
    blocked, split = df.loc["blocked_6144x8x1x1_fp64"], df.loc["split_6144x8x1x1_fp64"]
    assert blocked.status == "oom" and "300 MiB cap" in blocked.reason
    assert math.isnan(blocked.step_time_s_median)  # an oom is never a number
    assert split.status == "ok" and split.peak_mem_net_mib_max <= 300
    assert split.agrees == 1 and split.value_rel_diff <= RTOL


def test_progress_line_shows_the_interval_and_a_disagreement():
    row = {"case_id": "split_8x1x1x1_fp32", "status": "ok", "step_time_s_median": 0.5,
           "step_time_s_ci_low": 0.4, "step_time_s_ci_high": 0.6,
           "peak_mem_net_mib_by_device": "0:10.0;1:11.0", "value_rel_diff": 1e-3,
           "grad_rel_diff": 2e-3, "agrees": 0}
    line = progress_line(2, 5, row)
    assert line.startswith("[2/5] split_8x1x1x1_fp32") and "[0.4, 0.6]" in line
    assert line.endswith("DISAGREES")


@pytest.mark.gpu
def test_blocked_on_a_gpu_matches_the_reference():
    value, grad = _value_and_grad(lambda w: methods.blocked(w.cuda(), 16))
    _close((value, grad), _reference())


@pytest.mark.multi_gpu
def test_split_over_two_gpus_returns_the_gradient_to_the_weights_device():
    weight = methods.make_weight(SMALL, 0, "fp64", torch.device("cuda", 0))
    total = methods.split_devices(weight, [torch.device("cuda", 0), torch.device("cuda", 1)], 16)
    total.backward()
    assert total.device == weight.grad.device == torch.device("cuda", 0)
    _close((float(total), weight.grad.cpu()), _reference())
