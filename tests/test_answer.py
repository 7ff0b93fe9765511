"""The answer in words (report/answer.py): each sentence follows the run's numbers."""

from __future__ import annotations

from bench_lib.report.answer import answer_lines
from tests.conftest import REPO

GPU_RUN = REPO / "tests" / "data" / "h100-2026-11-26"
"""The first GPU run's folders (one H100): this project's own output, read as test data."""

W = {"model": "resnet50", "image_size": 64, "batch_size": 16, "precision": "fp32",
     "status": "ok", "launches": 3}


def _case(strategy: str, step: float, low: float, high: float, **more: object) -> dict:
    return W | {"strategy": strategy, "case_id": strategy, "step_time_s_median": step,
                "step_time_s_ci_low": low, "step_time_s_ci_high": high,
                "throughput_img_s": 16 / step, "launch_medians_s": ""} | more


def _parts(batch: float, bubble: float, comm: float, remainder: float, own: float = 0.0,
           optimizer: float = 0.0) -> dict:
    ideal = 100 - batch - bubble - comm - remainder - own - optimizer
    return {"waterfall_ideal_pct": ideal, "waterfall_batch_pct": batch,
            "waterfall_optimizer_pct": optimizer, "waterfall_corun_pct": 0.0,
            "waterfall_imbalance_pct": 0.0, "waterfall_bubble_pct": bubble,
            "waterfall_comm_pct": comm, "waterfall_own_pct": own,
            "waterfall_remainder_pct": remainder}


CURVE = W | {"strategy": "single", "case_id": "single8", "batch_size": 8,
             "batch_curve_of": 16, "step_time_s_median": 0.37, "throughput_img_s": 21.6,
             "per_image_efficiency": 0.44, "per_image_efficiency_ci_low": 0.38,
             "per_image_efficiency_ci_high": 0.52}


def test_single_wins_and_the_batch_per_device_is_named_with_the_curve_point():
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("ddp", 0.48, 0.45, 0.51, device_batch_size=8, speedup_vs_single=0.68,
                  **_parts(43, 0, 0, 24)),
            _case("gpipe", 0.69, 0.6, 0.8, device_batch_size=4, split_size=4,
                  **_parts(36, 17, 0.1, 17)),
            _case("fsdp", 0.81, 0.72, 0.9, device_batch_size=8, **_parts(25, 0, 0, 55)),
            CURVE]
    (line,) = answer_lines(rows)
    assert line.startswith("64 px, batch 16: single is fastest (50.0 [47.1, 53.3] img/s).")
    assert ("The other strategies lose most to the smaller batch per device (a median 36% of "
            "their step): 8 images per device (ddp's) run at 44% [38%, 52%] of batch 16's "
            "per-image speed on this rig.") in line
    assert line.endswith("A median 24% of their step is not explained by any part.")


def test_another_winner_and_another_loss_follow_the_numbers():
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("1f1b", 0.20, 0.19, 0.21, device_batch_size=4, speedup_vs_single=1.6,
                  speedup_ci_low=1.5, speedup_ci_high=1.7, **_parts(5, 30, 1, 2)),
            _case("gpipe", 0.25, 0.24, 0.26, device_batch_size=4, **_parts(4, 35, 1, -3))]
    (line,) = answer_lines(rows)
    assert line.startswith("64 px, batch 16: 1f1b is fastest (80.0 [76.2, 84.2] img/s, "
                           "1.60x [1.50, 1.70] single).")
    assert "lose most to the schedule's bubble (a median 32% of their step)." in line
    assert "not explained" not in line  # the median remainder is within 10%


def test_no_waterfall_no_loss_sentence():
    (line,) = answer_lines([_case("single", 0.32, 0.30, 0.34), _case("ddp", 0.48, 0.45, 0.51)])
    assert "lose most" not in line and line.startswith("64 px, batch 16: single is fastest")


def test_the_remainder_is_named_where_it_is_the_largest_share():
    # dp 6%, ddp 30% unexplained, batch 2% and 4%: naming the batch as the main loss would
    # point at a part that costs a tenth of what nothing explains.
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("dp", 0.36, 0.35, 0.37, device_batch_size=8, **_parts(2, 0, 0, 6)),
            _case("ddp", 0.48, 0.45, 0.51, device_batch_size=8, **_parts(4, 0, 0, 30))]
    (line,) = answer_lines(rows)
    assert line.endswith("The other strategies lose most to what no part explains (a median "
                         "18% of their step); the largest part is the smaller batch per device "
                         "(a median 3%).")
    assert line.count("not explained") == 0  # said once, as the main loss


def test_the_losses_are_the_step_parts_but_the_ideal():
    from bench_lib.analysis.step_parts import PARTS
    from bench_lib.report.answer import LOSSES

    assert tuple(LOSSES) == PARTS[1:]


def test_the_strategies_own_work_and_the_optimizer_are_losses_too():
    # ddp 12% and fsdp 20% own work (median 16%) beside 5% and 7% batch (median 6%).
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("ddp", 0.48, 0.45, 0.51, device_batch_size=8, **_parts(5, 0, 2, 1, own=12)),
            _case("fsdp", 0.81, 0.72, 0.9, device_batch_size=8, **_parts(7, 0, 3, 2, own=20))]
    (line,) = answer_lines(rows)
    assert ("The other strategies lose most to the strategies' own work: DDP's bucketing, "
            "FSDP2's copies, a schedule's hand-offs (a median 16% of their step).") in line
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("fsdp", 0.81, 0.72, 0.9, device_batch_size=8,
                  **_parts(2, 0, 0, 1, optimizer=9))]
    (line,) = answer_lines(rows)
    assert ("lose most to each device's optimizer step beyond its share (a median 9% of "
            "their step).") in line


def test_no_part_is_named_as_a_loss_at_zero():
    rows = [_case("single", 0.32, 0.30, 0.34),
            _case("ddp", 0.33, 0.31, 0.35, device_batch_size=16, **_parts(0, 0, 0.2, 0.3))]
    (line,) = answer_lines(rows)
    assert line.endswith("No part costs the other strategies a median 1% of their step or more.")


def test_the_first_gpu_runs_words():
    """The H100 smoke run (dp and ddp on one GPU): every part 0%, a median 18% unexplained;
    its answer once read "lose most to the smaller batch per device (a median 0% ...)"."""
    from bench_lib.report.figure_kit import records
    from bench_lib.report.runs import load_runs

    (line,) = answer_lines(records(load_runs([GPU_RUN / "smoke-1gpu"]).every))
    assert line == ("64 px, batch 8: single is fastest (392.7 img/s). The other strategies lose "
                    "most to what no part explains (a median 18% of their step): each part's "
                    "median is under 1%.")
    (slots,) = answer_lines(records(load_runs([GPU_RUN / "smoke-2slots"]).every))
    assert "lose most to the schedule's bubble (a median 54% of their step)" in slots
