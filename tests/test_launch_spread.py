"""Launch-to-launch differences (analysis.launch_spread): the test's arithmetic by hand, its
level and power on seeded synthetic launches, the H100 evidence's accum case, and the row's
columns and words."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from bench_lib.analysis.launch_spread import (
    LEVEL,
    MIN_BATCH_STEPS,
    batch_levels,
    batch_steps,
    describe,
    f_statistic,
    kernels_note,
    launch_spread,
)
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.report.answer import answer_lines
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row, launch_spread_columns
from bench_lib.sweep.cases import new_case
from bench_lib.sweep.profile import Measurement

EVIDENCE = Path(__file__).parent / "data" / "h100-2026-11-26" / "resnet50-224-single-accum"
SIMULATED_CASES = 200


def test_f_statistic_by_hand():
    # grand mean 3.5; between: 3 (2 - 3.5)^2 + 3 (5 - 3.5)^2 = 13.5 on 1 df;
    # within: (1 + 0 + 1) + (1 + 0 + 1) = 4 on 4 df, so F = 13.5 / 1 = 13.5.
    f, df_b, df_w = f_statistic([np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])])
    assert (f, df_b, df_w) == (pytest.approx(13.5), 1, 4)
    flat, _, _ = f_statistic([np.array([1.0, 1.0]), np.array([1.0, 1.0])])
    assert math.isnan(flat)
    apart, _, _ = f_statistic([np.array([1.0, 1.0]), np.array([2.0, 2.0])])
    assert apart == math.inf


def test_batches_are_consecutive_medians_of_log_steps():
    # 5 steps in batches of at least 2: [0, 1, 2] and [3, 4] (logs), medians 1 and 3.5.
    levels = batch_levels(np.exp([0.0, 1.0, 2.0, 3.0, 4.0]), 2)
    assert levels == pytest.approx([1.0, 3.5])


def test_the_batch_grows_with_the_steps_correlation():
    rng = np.random.default_rng(0)
    independent = [np.exp(rng.normal(0, 0.02, 200)) for _ in range(2)]
    assert batch_steps(independent) == MIN_BATCH_STEPS
    slow = [np.exp(ar1(rng, 200, 0.8, 0.02)) for _ in range(2)]
    # r near 0.8: correlation length about 9, batches of about 27 steps.
    assert 18 <= batch_steps(slow) <= 30


def test_no_test_without_two_launches_or_enough_steps():
    one = launch_spread([[0.1, 0.2, 0.3]])
    assert not one.tested and not one.differ and one.note == "1 launch: nothing to compare"
    assert one.medians_s == (0.2,)
    short = launch_spread([[0.1] * 5, [0.2] * 9])
    assert not short.tested and short.note.startswith("5 steps in a launch: too few")
    flat = launch_spread([[0.1] * 6, [0.1] * 6])
    assert not flat.tested and flat.note == "every batch alike: no spread"
    with pytest.raises(ValueError, match="positive"):
        launch_spread([[0.1, 0.0], [0.1, 0.1]])


def ar1(rng: np.random.Generator, n: int, phi: float, sd: float) -> np.ndarray:
    """n steps of a stationary AR(1) process with marginal standard deviation ``sd``."""
    noise = rng.normal(0.0, sd * math.sqrt(1 - phi**2), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + noise[i]
    return x


def flagged_share(phi: float, shift: float, launches: int, steps: int, seed: int) -> float:
    """The share of ``SIMULATED_CASES`` cases flagged: each launch's log steps AR(1) with
    2% noise about 0.1 s, the last launch ``shift`` (relative) slower."""
    rng = np.random.default_rng(seed)
    flagged = 0
    for _ in range(SIMULATED_CASES):
        cases = [0.1 * np.exp(ar1(rng, steps, phi, 0.02)) for _ in range(launches)]
        cases[-1] = cases[-1] * (1 + shift)
        flagged += launch_spread(cases).differ
    return flagged / SIMULATED_CASES


@pytest.mark.parametrize("phi,launches,steps", [(0.0, 3, 30), (0.3, 3, 40), (0.6, 3, 60),
                                                (0.6, 2, 100)])
def test_identical_launches_are_flagged_at_about_the_level(phi, launches, steps):
    # At a 1% level: at most 3% of 200 cases (binomial: 2 by chance, 6 at most).
    assert flagged_share(phi, 0.0, launches, steps, seed=1) <= 0.03


@pytest.mark.parametrize("phi,launches,steps", [(0.0, 3, 30), (0.3, 3, 40), (0.6, 3, 60),
                                                (0.0, 2, 30)])
def test_a_launch_10pct_off_with_2pct_noise_is_flagged(phi, launches, steps):
    assert flagged_share(phi, 0.10, launches, steps, seed=2) >= 0.95


def evidence_launches(case_id: str) -> list[list[float]]:
    with (EVIDENCE / "steps.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["case_id"] == case_id]
    return [[float(r["step_time_s"]) for r in rows if r["launch"] == str(k)]
            for k in sorted({int(r["launch"]) for r in rows})]


def test_the_h100_accum_fp32_launches_are_not_flagged_at_1pct():
    # Launch medians 0.117 and 0.099 s (18% apart), yet launch 2's own steps wander: 0.089 s
    # for a dozen steps, then up to 0.13 s. In batches of 5 steps (r = 0.19), launch 1's
    # batch medians run 0.112-0.123 s and launch 2's 0.090-0.121 s: one of launch 2's
    # batches is as slow as launch 1's. So the gap is suggestive (p about 0.027, ratio 2.7)
    # but not beyond what the launches' own wander explains at 1%.
    launches = evidence_launches("accum_resnet50_img224_b120_s20_fp32")
    spread = launch_spread(launches)
    assert spread.medians_s == pytest.approx((0.116886, 0.0991258), rel=1e-5)
    assert spread.batch_steps == 5 and not spread.differ and describe(spread) == ""
    assert LEVEL < spread.p_value < 0.05 and 2 < spread.ratio < 3
    first, second = (np.exp(batch_levels(x, 5)) for x in launches)
    assert second.max() > first.min()  # launch 2 has a batch inside launch 1's range
    assert second.min() < 0.091 < first.min()


def test_the_h100_single_fp32_launches_do_not_differ():
    # 0.06780 and 0.06786 s: 0.07% apart, well inside the steps' own spread.
    spread = launch_spread(evidence_launches("single_resnet50_img224_b120_s-_fp32"))
    assert spread.tested and not spread.differ and describe(spread) == ""


def test_kernels_note_compares_each_launch_with_the_first():
    same = ("sm90_gemm", "cudnn_conv")
    assert kernels_note([same, same, same]) == "launches ran the same kernels (2)"
    other = kernels_note([same, ("sm90_gemm", "implicit_convolve_sgemm", "winograd")])
    assert other == ("launch 2 ran 2 kernels launch 1 did not, launch 1 1 it did not "
                     "(e.g. implicit_convolve_sgemm)")
    assert kernels_note([(), ()]) == ""  # a cpu rig profiles nothing
    assert kernels_note([same, ()]) == "kernels not recorded in launch 2"
    assert kernels_note([same]) == ""
    long = "x" * 100
    assert kernels_note([same, (*same, long)]).endswith(f"(e.g. {'x' * 60}...)")


def launch(steps: list[float], kernels: tuple[str, ...] = ()) -> CaseOutcome:
    return CaseOutcome("ok", step_times_s=steps, rank_step_times_s={0: steps},
                       peak_mem_mib={"0": 1.0}, stop_reason="step_cap", kernel_names=kernels)


def test_a_cuda_case_whose_launches_ran_other_kernels_says_so_in_its_row():
    rng = np.random.default_rng(3)
    fast = list(0.099 * np.exp(rng.normal(0, 0.01, 30)))
    slow = list(0.117 * np.exp(rng.normal(0, 0.01, 30)))
    both = CaseOutcome.of_launches([launch(slow, ("gemm", "conv_a")),
                                    launch(fast, ("gemm", "conv_b"))])
    assert both.kernel_names == () and [p.kernel_names for p in both.parts()][1] == (
        "gemm", "conv_b")
    m = Measurement(warmup_steps=1, timed_steps=30, max_time_s=60, case_timeout_s=180,
                    interval_target_pct=0)
    rig = Rig("cuda", 1)
    row = case_row(new_case(rig, "single", "resnet-tiny", 32, 4, measurement=m), rig, both)
    assert row["launches_differ"] == 1 and row["launch_spread_ratio"] > 10
    assert row["launch_spread_p"] < LEVEL
    assert row["launch_note"].startswith("launch medians ")
    assert row["launch_note"].endswith("; launch 2 ran 1 kernels launch 1 did not, launch 1 1 "
                                       "it did not (e.g. conv_b)")


def test_a_cpu_case_alike_across_launches_has_an_empty_note():
    rng = np.random.default_rng(4)
    alike = CaseOutcome.of_launches([launch(list(0.1 * np.exp(rng.normal(0, 0.02, 20))))
                                     for _ in range(3)])
    cols = launch_spread_columns(alike)
    assert cols["launches_differ"] == 0 and cols["launch_note"] == ""
    assert 0 < cols["launch_spread_ratio"] < 3 and cols["launch_spread_p"] >= LEVEL
    one = launch_spread_columns(launch([0.1, 0.2, 0.1]))
    assert one == {"launches_differ": None, "launch_spread_ratio": None,
                   "launch_spread_p": None, "launch_note": ""}
    few = launch_spread_columns(CaseOutcome.of_launches([launch([0.1, 0.2]), launch([0.1])]))
    assert few["launches_differ"] is None
    assert few["launch_note"].startswith("1 step in a launch: too few")


ANSWER_ROW = {"model": "resnet50", "image_size": 224, "batch_size": 120, "precision": "fp32",
              "status": "ok", "launches": 2, "step_time_s_ci_low": "",
              "step_time_s_ci_high": "", "launch_medians_s": ""}


def test_the_answer_names_cases_whose_launches_differ_and_only_then():
    single = ANSWER_ROW | {"strategy": "single", "case_id": "single",
                           "step_time_s_median": 0.068, "throughput_img_s": 1765.0,
                           "launches_differ": 0}
    accum = ANSWER_ROW | {"strategy": "accum", "case_id": "accum", "split_size": 20,
                          "step_time_s_median": 0.108, "throughput_img_s": 1111.0,
                          "launches_differ": 1}
    (line,) = answer_lines([single, accum])
    assert line.endswith("The launches of accum s20 differ more than their steps' noise "
                         "explains (launch_note): the intervals, which resample launches, "
                         "carry that spread.")
    (quiet,) = answer_lines([single, accum | {"launches_differ": 0}])
    assert "launches of" not in quiet
