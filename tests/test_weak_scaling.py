"""Weak scaling (the ``scaling`` dimension): each device keeps the workload's batch, the
speedup is a throughput ratio over single at that batch; its cases, speedup, interval,
waterfall, headlines and sentence."""

from __future__ import annotations

import math
import random

import pytest

from bench_lib.analysis.stats import paired_ratio_interval
from bench_lib.analysis.step_parts import Figures
from bench_lib.report.answer import answer_lines
from bench_lib.report.headlines import headline_lines
from bench_lib.report.ranking import headline_groups
from bench_lib.rows import waterfall
from bench_lib.rows.speedup_table import SpeedupTable
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile, UsageError

PROFILE = Profile(strategies=("single", "ddp", "mp", "gpipe", "accum"), models=("resnet50",),
                  image_sizes=(64,), batch_sizes=(16,), split_sizes=(4,),
                  partitions=("balanced",), scaling=("strong", "weak"), batch_curve=True)


def test_each_device_keeps_the_batch_and_one_device_strategies_run_once(cpu_rig):
    cases = expand(PROFILE, cpu_rig)
    by_id = {c.case_id: c for c in cases}
    weak = [c for c in cases if c.scaling == "weak"]
    # single and accum compute on one device: the same case either way, listed once.
    assert sorted(c.strategy for c in weak) == ["ddp", "gpipe", "mp"]
    assert sorted(c.strategy for c in cases if c.scaling == "strong"
                  and c.curve_of is None) == ["accum", "ddp", "gpipe", "mp", "single"]
    ddp = by_id["ddp_resnet50_img64_b32_s-_fp32_weak"]
    assert (ddp.batch_size, ddp.device_batch_size, ddp.workload_batch) == (32, 16, 16)
    gpipe = by_id["gpipe_resnet50_img64_b32_s4_fp32_pbalanced_weak"]
    assert (gpipe.split_size, gpipe.num_microbatches, gpipe.device_batch_size) == (4, 8, 4)
    mp = by_id["mp_resnet50_img64_b32_s-_fp32_pbalanced_weak"]
    assert mp.device_batch_size == 32  # one device computes the whole batch on its stage
    # Compared with single at 16 and measured in its rounds: one workload, one group.
    single = by_id["single_resnet50_img64_b16_s-_fp32"]
    assert {c.workload_key for c in weak} == {single.workload_key}
    assert {c.group_key for c in cases} == {single.group_key}
    # The batch curve takes the batches the weak cases compute per device (mp's 32), as
    # points of the workload's curve (of 16).
    assert {c.batch_size: c.curve_of for c in cases if c.curve_of} == {8: 16, 4: 16, 32: 16}
    # Run order: single, its curve, the strong cases, then the weak ones.
    rest = [c.scaling for c in cases if c.strategy != "single"]
    assert rest == sorted(rest) and rest[-1] == "weak"
    assert "(weak scaling)" in ddp.describe()


def test_a_count_gives_the_split_it_gives_the_workloads_batch(cpu_rig):
    by_count = new_case(cpu_rig, "gpipe", "resnet50", 64, 16, microbatch_count=4,
                        partition="balanced", scaling="weak")
    assert (by_count.batch_size, by_count.split_size, by_count.num_microbatches) == (32, 4, 8)
    assert new_case(cpu_rig, "single", "resnet50", 64, 16, scaling="weak") == new_case(
        cpu_rig, "single", "resnet50", 64, 16)


def test_bad_scalings_are_usage_errors():
    with pytest.raises(UsageError, match="unknown scaling 'medium'; valid: strong, weak"):
        Profile(scaling=("medium",))
    with pytest.raises(UsageError, match="no scaling selected"):
        Profile(scaling=())


def _ok(medians: list[float]) -> dict:
    return {"status": "ok", "launch_medians_s": ";".join(f"{m:.6f}" for m in medians)}


def test_the_weak_speedup_is_single_s_throughput_ratio_paired_by_round(cpu_rig):
    table = SpeedupTable()
    single = new_case(cpu_rig, "single", "resnet50", 64, 16)
    table.fill(single, _ok([0.30, 0.33, 0.31]))
    ddp = new_case(cpu_rig, "ddp", "resnet50", 64, 16, scaling="weak")
    row = _ok([0.36, 0.40, 0.38])  # 32 images a step against single's 16
    table.fill(ddp, row)
    plain = paired_ratio_interval([0.30, 0.33, 0.31], [0.36, 0.40, 0.38])
    assert row["speedup_vs_single"] == pytest.approx(2 * plain.point)
    assert (row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx(
        (2 * plain.low, 2 * plain.high))
    assert row["scaling_efficiency"] == pytest.approx(plain.point)  # over 2 devices
    strong = new_case(cpu_rig, "ddp", "resnet50", 64, 16)
    row = _ok([0.36, 0.40, 0.38])
    table.fill(strong, row)
    assert row["speedup_vs_single"] == pytest.approx(plain.point)


def test_the_weak_speedup_interval_covers_the_true_throughput_ratio():
    """Synthetic rounds: single's and the weak case's launch medians with 4% launch noise
    and a drift shared by each round; the interval should hold the true ratio (1.6x) about
    95% of the time."""
    rng = random.Random(7)
    true, trials, covered = 1.6, 2000, 0
    for _ in range(trials):
        drifts = [math.exp(rng.gauss(0, 0.05)) for _ in range(3)]
        single = [0.30 * d * math.exp(rng.gauss(0, 0.04)) for d in drifts]
        weak = [0.30 * 2 / true * d * math.exp(rng.gauss(0, 0.04)) for d in drifts]
        ratio = paired_ratio_interval(single, weak)
        covered += 2 * ratio.low <= true <= 2 * ratio.high
    assert 0.93 <= covered / trials <= 0.97


def test_the_weak_waterfall_starts_from_single_at_the_devices_batch():
    # ddp, 16 per device on 2: the ideal is single's step at 16, the batch costs nothing.
    found = waterfall.waterfall(Figures(2, 32, 16, 16, {16: 0.30}), 0.36)
    assert not isinstance(found, str)
    assert (found.parts.ideal_s, found.parts.batch_s) == pytest.approx((0.30, 0.0))
    assert found.remainder_s == pytest.approx(0.06)
    # gpipe, micro-batches of 4: 8 a step over 2 devices, 4 each at T1(4) = 0.1 s. The
    # bound's bubble for p=2, m=8 idles 1/9 of the span: 0.40 s busy, 0.45 s span, 0.05 s.
    found = waterfall.waterfall(Figures(2, 32, 4, 16, {16: 0.30, 4: 0.10}, bubble_s=0.05),
                                0.50)
    assert not isinstance(found, str)
    assert found.parts.ideal_s == pytest.approx(0.30)
    assert found.parts.batch_s == pytest.approx(0.40 - 0.30)
    assert found.remainder_s == pytest.approx(0.50 - 0.40 - 0.05)
    assert waterfall.waterfall(Figures(2, 32, 16, 16, {8: 0.2}), 0.4) \
        == "no waterfall: single's step at batch 16 is not known"


W = {"model": "resnet50", "image_size": 64, "precision": "fp32", "status": "ok",
     "launches": 3, "launch_medians_s": ""}


def _row(strategy: str, batch: int, step: float, scaling: str = "strong", **more: object
         ) -> dict:
    return W | {"strategy": strategy, "case_id": f"{strategy}{batch}{scaling}",
                "batch_size": batch, "world_size": 1 if strategy == "single" else 2,
                "scaling": scaling, "step_time_s_median": step,
                "step_time_s_ci_low": step * 0.95, "step_time_s_ci_high": step * 1.05,
                "throughput_img_s": batch / step} | more


def _weak_rows(ddp_speedup: tuple[float, float, float]) -> list[dict]:
    point, low, high = ddp_speedup
    return [_row("single", 16, 0.32), _row("ddp", 16, 0.48, speedup_vs_single=0.67),
            _row("ddp", 32, 0.64 / point, "weak", speedup_vs_single=point,
                 speedup_ci_low=low, speedup_ci_high=high),
            _row("mp", 32, 0.66, "weak", split_size=None, speedup_vs_single=0.97,
                 speedup_ci_low=0.9, speedup_ci_high=1.05)]


def test_the_weak_sentence_follows_the_numbers():
    (line,) = answer_lines(_weak_rows((1.62, 1.50, 1.75)))
    assert line.startswith("64 px, batch 16: single is fastest")
    assert line.endswith("With 16 images per device (weak scaling), ddp gains most: 1.62x "
                         "[1.50, 1.75] single's throughput on 2 devices (81% scaling "
                         "efficiency).")
    (line,) = answer_lines(_weak_rows((0.91, 0.85, 0.97)))  # mp the best now, holding 1
    assert line.endswith("the best, mp, reaches 0.97x [0.90, 1.05] single's throughput on 2 "
                         "devices (48% scaling efficiency): not clear of single.")
    rows = [r for r in _weak_rows((0.91, 0.85, 0.97)) if r["strategy"] != "mp"]
    (line,) = answer_lines(rows)
    assert line.endswith("no strategy beats single: the best, ddp, reaches 0.91x [0.85, "
                         "0.97] single's throughput on 2 devices (46% scaling efficiency).")
    strong_only = [r for r in rows if r["scaling"] == "strong"]
    assert "weak scaling" not in answer_lines(strong_only)[0]


def test_headlines_rank_weak_cases_against_single_at_their_per_device_batch():
    rows = _weak_rows((1.62, 1.50, 1.75))
    groups = headline_groups(rows)
    weak = groups[("resnet50", 64, 16, "fp32", "weak")]
    assert [r["case_id"] for r in weak] == ["single16strong", "ddp32weak", "mp32weak"]
    assert [r["case_id"] for r in groups[("resnet50", 64, 16, "fp32", "strong")]] == [
        "single16strong", "ddp16strong"]
    header, strong, weak_line = headline_lines(rows)[:3]
    assert header.split()[:5] == ["model", "image", "batch", "prec", "scaling"]
    assert strong.split()[:6] == ["resnet50", "64", "16", "fp32", "strong", "single"]
    assert weak_line.split()[:6] == ["resnet50", "64", "16", "fp32", "weak", "ddp"]
    assert "1.62x [1.50, 1.75]" in weak_line
    # A run without weak cases keeps the table it had: no scaling column.
    assert "scaling" not in headline_lines(rows[:2])[0]
