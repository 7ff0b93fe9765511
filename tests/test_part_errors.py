"""Where the model of a step is wrong, part by part (report/part_errors.py), and the
waterfall figure's bars of the step's parts (report/waterfall_figure.py), from hand-made
cases.csv rows."""

from __future__ import annotations

import pandas as pd
import pytest

from bench_lib.analysis.step_parts import PARTS, WORDS
from bench_lib.report.part_errors import PartError, part_error_lines, part_errors


def _row(strategy: str, image: int, step_s: float, split: float | None = None,
         **parts: tuple[float, float]) -> dict:
    """A case with ``part=(predicted_s, measured_s)`` for each part given."""
    row = {"status": "ok", "strategy": strategy, "model": "resnet50", "image_size": image,
           "batch_size": 16, "precision": "fp32", "split_size": split,
           "step_time_s_median": step_s, "world_size": 1 if strategy == "single" else 2,
           "scaling": "strong"}
    for part, (predicted, measured) in parts.items():
        row[f"predicted_{part}_s"] = predicted
        row[f"waterfall_{part}_s"] = measured
    return row


# predicted - measured, % of each step:      batch   own
ROWS = [_row("ddp", 64, 0.5, batch=(0.11, 0.09), own=(0.02, 0.05)),         # +4    -6
        _row("fsdp", 96, 1.0, batch=(0.2, 0.2), own=(0.10, 0.20))            # 0     -10
        | {"scaling": "weak"},
        _row("1f1b", 64, 0.4, 4.0, batch=(0.05, 0.062), own=(0.03, 0.02)),   # -3    +2.5
        _row("gpipe", 64, 0.5, 2.0, batch=(0.13, 0.10)),                     # +6    (none)
        # Left out: single, a case that did not finish, a row of a run before the columns.
        _row("single", 64, 0.3, batch=(0.3, 0.0), own=(0.3, 0.0)),
        _row("mp", 64, 0.5, batch=(0.5, 0.0)) | {"status": "error"},
        _row("dp", 64, 0.5)]


def test_each_part_median_and_worst_by_hand():
    batch, own = part_errors(ROWS)
    # batch: +4, 0, -3, +6 -> median of (0, 4) = 2; |.|: 0, 3, 4, 6 -> 3.5; worst gpipe +6.
    assert batch == PartError("batch", 4, pytest.approx(2.0), pytest.approx(3.5),
                              "gpipe s2 64 px", pytest.approx(6.0))
    # own: -6, -10, +2.5 -> median -6; |.| 6, 10, 2.5 -> 6; worst the weak fsdp, -10.
    assert own == PartError("own", 3, pytest.approx(-6.0), pytest.approx(6.0),
                            "fsdp 96 px weak", pytest.approx(-10.0))


def test_the_line_names_a_worst_case_beyond_five_percent_and_fewer_cases():
    (line,) = part_error_lines(ROWS)
    assert line == ("parts, predicted - measured, % of the step (median, and median "
                    "|difference|, over 4 cases): batch +2.0% |3.5%| (worst gpipe s2 64 px: "
                    "+6%), own -6.0% |6.0%| over 3 (worst fsdp 96 px weak: -10%)")
    # Within 5% everywhere: no case named.
    (calm,) = part_error_lines(ROWS[:3])
    assert "worst" not in calm.split("own")[0] and "over 3 cases): batch +0.0%" in calm


def test_rows_without_both_columns_give_nothing():
    old = [{k: v for k, v in r.items() if not k.startswith("predicted_")} for r in ROWS]
    assert part_errors(old) == [] and part_error_lines(old) == []
    assert part_error_lines([]) == []
    # A DataFrame's missing cells (NaN) count as absent, not as numbers.
    nan = [r | {"predicted_batch_s": float("nan"), "predicted_own_s": float("nan")}
           for r in ROWS]
    assert part_error_lines(nan) == []


def test_the_score_html_carries_the_parts_line():
    from bench_lib.report.time_prediction import score_html

    rows = [r | {"case_id": f"c{i}", "step_time_s_predicted": r["step_time_s_median"] * 1.05,
                 "prediction_error_pct": 5.0} for i, r in enumerate(ROWS[:4])]
    page = score_html(pd.DataFrame(rows))
    assert "step time predicted before launch" in page
    assert "(goal: 7% and 15%)" in page
    assert "own -6.0% |6.0%| over 3 (worst fsdp 96 px weak: -10%)" in page
    bare = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("predicted_")}
                         for r in rows])
    assert "parts, predicted - measured" not in score_html(bare)


WORKLOAD = {"run_label": "r", "model": "resnet50", "image_size": 64, "batch_size": 16,
            "precision": "fp32", "status": "ok", "world_size": 2, "scaling": "strong"}


def _waterfall_row(strategy: str, step_s: float, split: float, **parts_s: float) -> dict:
    cols = {f"waterfall_{p}_s": s for p, s in parts_s.items()}
    rest = step_s - sum(parts_s.values())
    return WORKLOAD | {"strategy": strategy, "split_size": split, "step_time_s_median": step_s,
                       "waterfall_ideal_pct": 100 * parts_s["ideal"] / step_s,
                       "waterfall_remainder_s": rest,
                       "waterfall_remainder_pct": 100 * rest / step_s} | cols


NEW = _waterfall_row("ddp", 0.5, float("nan"), ideal=0.15, batch=0.1, optimizer=0.03,
                     corun=0.02, imbalance=0.0, bubble=0.0, comm=0.05, own=0.08)
OLD = _waterfall_row("gpipe", 0.6, 4.0, ideal=0.15, batch=0.12, corun=0.03, imbalance=0.02,
                     bubble=0.1, comm=0.01)  # a run before the optimizer and own parts


def _bar_widths(ax: object, bars: int) -> list[list[float]]:
    patches = ax.patches  # type: ignore[attr-defined]
    per = len(PARTS) + 1  # the parts and the remainder, drawn bar by bar
    assert len(patches) == per * bars
    return [[p.get_width() for p in patches[i * per:(i + 1) * per]] for i in range(bars)]


def test_the_figure_draws_the_new_parts_and_an_old_row_without_them():
    from bench_lib.report.waterfall_figure import PARTS as DRAWN
    from bench_lib.report.waterfall_figure import fig_waterfall

    assert [p for p, _, _ in DRAWN] == list(PARTS)
    fig = fig_waterfall(pd.DataFrame([NEW, OLD]))  # OLD's missing cells: NaN
    assert fig is not None
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ddp", "gpipe s4"]
    new, old = _bar_widths(ax, 2)
    assert new == pytest.approx([0.15, 0.1, 0.03, 0.02, 0.0, 0.0, 0.05, 0.08, 0.07])
    assert old == pytest.approx([0.15, 0.12, 0.0, 0.03, 0.02, 0.1, 0.01, 0.0, 0.17])
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [WORDS[p] for p in PARTS] + ["unexplained (remainder)"]
    assert len({c for _, _, c in DRAWN}) == len(PARTS)  # each part its own colour
    # A run folder from before the columns: they are absent altogether.
    alone = fig_waterfall(pd.DataFrame([OLD]))
    assert alone is not None
    (only,) = _bar_widths(alone.axes[0], 1)
    assert only == pytest.approx([0.15, 0.12, 0.0, 0.03, 0.02, 0.1, 0.01, 0.0, 0.17])
