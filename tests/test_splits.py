"""The split search (``Profile.split_search``, ``sweep.splits``): which candidate splits are
measured, the skipped rows that keep their predictions, the batch curve that does not grow,
the profile key, and the default cpu profile's splits per pipelined strategy."""

from __future__ import annotations

import dataclasses
from collections import Counter

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from bench_lib import commands, exit_codes
from bench_lib.analysis.bound import Bound
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.admission import Admission
from bench_lib.report import figures
from bench_lib.results.read import read_cases
from bench_lib.results.store import RunWriter, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.run import runner
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import PROFILE_DIR, Profile, UsageError, load_profile
from bench_lib.sweep.splits import (
    choose,
    measured_share,
    search_key,
    settle,
    split_candidates,
    unmeasured,
    window,
)

RIG = Rig("cpu", 2, 1, (0, 1))
PIPELINED = ("pipeline", "gpipe", "1f1b")


# --- the choice, pure ---------------------------------------------------------------


def test_the_best_in_the_middle_is_measured_with_its_two_neighbours():
    choice = choose({1: 3.0, 2: 1.2, 4: 1.0, 8: 1.1, 16: 2.0}, 3, anchor=16)
    assert (choice.measured, choice.best) == ((2, 4, 8), 4)
    assert "predicted best, split 4 at 1 s, and its neighbours (2, 8)" in choice.why


@pytest.mark.parametrize(("times", "measured"), [
    ({1: 0.5, 2: 1.2, 4: 1.0, 8: 1.1, 16: 0.9}, (1, 2, 4)),  # best at the left edge
    ({1: 3.0, 2: 1.2, 4: 1.0, 8: 1.1, 16: 0.9}, (4, 8, 16)),  # at the right edge
])
def test_at_an_edge_the_next_two_inward_are_measured(times, measured):
    assert choose(times, 3, anchor=4).measured == measured


def test_a_tie_goes_to_the_split_nearer_the_anchor_then_the_smaller():
    assert choose({1: 1.0, 2: 2.0, 4: 3.0, 8: 2.0, 16: 1.0}, 1, anchor=2).best == 1
    assert choose({1: 1.0, 2: 2.0, 4: 3.0, 8: 2.0, 16: 1.0}, 1, anchor=16).best == 16
    assert choose({2: 1.0, 4: 2.0, 6: 1.0}, 1, anchor=4).best == 2  # equally near: smaller


def test_fewer_candidates_than_k_are_all_measured():
    assert choose({8: 1.0, 16: 2.0}, 3, anchor=4).measured == (8, 16)
    assert window([1, 2], 1, 5) == (1, 2)
    assert window([1, 2, 4, 8, 16], 2, 4) == (2, 4, 8, 16)  # even k: one more above


def test_without_every_prediction_the_k_nearest_the_anchor_are_measured():
    choice = choose({1: 0.1, 2: None, 4: 1.0, 8: 1.1, 16: 2.0}, 3, anchor=4,
                    no_prediction="no prediction: the calibration failed")
    assert (choice.measured, choice.best) == ((2, 4, 8), None)
    assert "nearest the profile's split 4 (2, 4, 8)" in choice.why
    assert "the calibration failed" in choice.why
    # An anchor between candidates: the nearest one (the smaller on a tie) is the centre.
    assert choose({1: None, 2: None, 4: None, 8: None}, 3, anchor=3).measured == (1, 2, 4)
    assert choose({1: None, 2: None, 4: None, 8: None}, 1, anchor=7).measured == (8,)


# --- the sweep: candidates, their decisions, the batch curve ---------------------------


def search_profile(**changes) -> Profile:
    return Profile(**{"strategies": ("single", "pipeline", "gpipe", "1f1b"),
                      "models": ("toy",), "batch_sizes": (16,), "split_sizes": (4,),
                      "split_search": 3, "batch_curve": True} | changes)


def bound(step_s: float) -> Bound:
    return Bound("serial", step_s, step_s, 0.0, 0.0)


def predictions(cases, times):
    """Each case to run predicted: candidates from ``times`` (strategy, split) -> s."""
    return {i: (bound(times.get((c.strategy, c.split_size), 1.0)), bound(1.0))
            for i, c in enumerate(cases) if c.status is None}


def test_every_split_that_divides_the_batch_is_a_candidate():
    # Short of the whole batch: one micro-batch is mp's step (pipeline) or single's (accum).
    assert split_candidates(16) == (1, 2, 4, 8)
    assert split_candidates(1) == ()
    cases = expand(search_profile(), RIG)
    splits = {s: sorted(c.split_size for c in cases if c.strategy == s) for s in PIPELINED}
    assert splits == {s: [1, 2, 4, 8] for s in PIPELINED}
    searches = {c.strategy: c.split_search for c in cases if c.split_search and not c.curve_of}
    assert searches["pipeline"].candidates == 4 and searches["1f1b"].candidates == 4
    one = next(c for c in cases if c.strategy == "1f1b" and c.split_size == 8)
    assert measured_share(one) == pytest.approx(3 / 4)  # K=3 of n=4 runnable
    pipe = next(c for c in cases if c.strategy == "pipeline")
    assert measured_share(pipe) == pytest.approx(3 / 4)
    assert measured_share(next(c for c in cases if c.strategy == "single")) == 1.0


def test_the_unchosen_are_skipped_with_their_prediction_in_the_reason():
    cases = expand(search_profile(), RIG)
    times = {("pipeline", 1): 3.0, ("pipeline", 2): 2.0, ("pipeline", 4): 1.5,
             ("pipeline", 8): 1.0, ("gpipe", 1): 0.5, ("gpipe", 2): 0.7}
    skipped = unmeasured(cases, range(len(cases)), predictions(cases, times))
    by = {(cases[i].strategy, cases[i].split_size, cases[i].curve_of): r
          for i, r in skipped.items()}
    # 1f1b's candidates are all predicted alike (1 s): the three nearest split 4.
    assert set(by) == {("pipeline", 1, None), ("gpipe", 8, None), ("1f1b", 1, None)}
    assert by[("pipeline", 1, None)].startswith("split 1 predicted 3 s, not measured: "
                                                "pipeline at ")
    assert "pipeline at batch 16, fp32 measures" in by[("pipeline", 1, None)]  # toy: no px
    assert "measures the predicted best, split 8 at 1 s, and its neighbours (2, 4)" in \
        by[("pipeline", 1, None)]


def test_a_curve_point_only_unmeasured_candidates_compute_is_skipped_too():
    cases = expand(search_profile(strategies=("single", "pipeline")), RIG)
    points = {c.batch_size: c for c in cases if c.curve_of is not None}
    assert sorted(points) == [1, 2, 4, 8]  # pipeline's micro-batches (16 is single's own)
    assert all(p.split_search is not None for p in points.values())
    times = {("pipeline", 1): 3.0, ("pipeline", 2): 2.0, ("pipeline", 4): 1.5,
             ("pipeline", 8): 1.0}
    settled = settle(cases, range(len(cases)), predictions(cases, times))
    status = {(c.strategy, c.batch_size, c.split_size): c.status for c in settled}
    assert status[("single", 1, None)] == "skipped"  # only pipeline s1 computed 1 image
    assert all(status[("single", b, None)] is None for b in (2, 4, 8))
    assert status[("pipeline", 16, 1)] == "skipped"
    assert sum(s == "skipped" for s in status.values()) == 2
    reason = next(c.reason for c in settled if c.curve_of and c.batch_size == 1)
    assert "batch-curve point not measured" in reason


def test_a_curve_point_another_case_computes_is_kept():
    """ddp's share of batch 16 on 2 workers is 8: the point at 8 stays whatever pipeline
    measures, and carries no search (it is measured for ddp)."""
    cases = expand(search_profile(strategies=("single", "ddp", "pipeline")), RIG)
    point8 = next(c for c in cases if c.curve_of and c.batch_size == 8)
    assert point8.split_search is None and measured_share(point8) == 1.0
    times = {("pipeline", 1): 0.5, ("pipeline", 2): 0.6, ("pipeline", 4): 3.0,
             ("pipeline", 8): 4.0}
    settled = settle(cases, range(len(cases)), predictions(cases, times))
    kept = {c.batch_size for c in settled if c.curve_of and c.status is None}
    assert kept == {1, 2, 4, 8}  # pipeline measures 1, 2, 4, not 8: ddp keeps the point at 8


def test_without_predictions_the_splits_nearest_the_profiles_are_measured():
    cases = expand(search_profile(strategies=("single", "pipeline")), RIG)
    settled = settle(cases, range(len(cases)), {})
    measured = sorted(c.split_size for c in settled
                      if c.strategy == "pipeline" and c.status is None)
    assert measured == [2, 4, 8]
    reason = next(c.reason for c in settled if c.strategy == "pipeline" and c.status)
    assert "nearest the profile's split 4" in reason and "predict_time off" in reason


def test_settle_changes_nothing_without_a_search():
    cases = expand(dataclasses.replace(search_profile(), split_search=0), RIG)
    assert settle(cases, range(len(cases)), {}) is cases
    assert all(c.split_search is None for c in cases)


# --- the runner: one row per candidate, predictions kept --------------------------------


class FakeTimes:
    """A predictor whose step times come from a table, with no calibration."""

    def __init__(self, times):
        self.times = times

    def predict(self, case):
        return bound(self.times.get((case.strategy, case.split_size), 1.0)), bound(1.0)

    def cut(self, case):
        return ""

    def copies(self, case):
        return None


@pytest.mark.integration
def test_skipped_candidates_are_rows_with_their_prediction_and_are_never_launched(
        tmp_path, monkeypatch):
    launched = []

    def fake_run_case(spec, work_root, launch, options):
        launched.append(spec.case.case_id)
        return CaseOutcome("error", "fake launch")

    monkeypatch.setattr(runner, "run_case", fake_run_case)
    cases = expand(search_profile(strategies=("single", "pipeline")), RIG)
    times = {("pipeline", 1): 3.0, ("pipeline", 2): 2.0, ("pipeline", 4): 1.5,
             ("pipeline", 8): 1.0}
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": 5})
    with RunWriter(run_dir) as writer:
        rows = runner.run_sweep(cases, RIG, writer, runner.SweepOptions(
            admission=Admission.of(RIG, cases),
            predictor=FakeTimes(times)))  # type: ignore[arg-type]
    assert len(rows) == len(cases)  # every case one row
    written = read_cases(run_dir).set_index("case_id")
    skipped = written[written.status == "skipped"]
    assert sorted(skipped.index) == sorted([
        next(c.case_id for c in cases if c.strategy == "pipeline" and c.split_size == 1),
        next(c.case_id for c in cases if c.curve_of and c.batch_size == 1)])
    pipe1 = skipped[skipped.strategy == "pipeline"].iloc[0]
    assert pipe1.step_time_s_predicted == pytest.approx(3.0)
    assert not set(skipped.index) & set(launched)
    assert Counter(written.status)["error"] == len(set(launched))


# --- the profile key, the default cpu profile ---------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_split_search_is_a_usage_error_naming_the_key(bad):
    with pytest.raises(UsageError, match="split_search must be a whole number >= 0"):
        Profile.from_dict({"split_search": bad})


def test_a_bad_split_search_in_a_profile_file_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('strategies = ["single", "pipeline"]\nsplit_search = -3\n')
    out = tmp_path / "out"
    code = commands.main(["run", "--profile", str(path), "--dry-run", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == exit_codes.EXIT_USAGE == 2
    assert "split_search must be a whole number >= 0" in err and "got -3" in err
    assert not out.exists()


def test_a_strategy_s_own_k_is_a_table_checked_like_the_rest():
    profile = Profile.from_dict({"split_search": 3, "split_search_by_strategy": {"accum": 1}})
    assert (profile.split_search_for("accum"), profile.split_search_for("gpipe")) == (1, 3)
    assert Profile.from_dict(profile.as_dict()) == profile  # env.json's round trip
    with pytest.raises(UsageError, match="unknown strategy 'acum'"):
        Profile.from_dict({"split_search_by_strategy": {"acum": 1}})
    with pytest.raises(UsageError, match="got -1"):
        Profile.from_dict({"split_search_by_strategy": {"accum": -1}})
    with pytest.raises(UsageError, match="must be a table"):
        Profile.from_dict({"split_search_by_strategy": [1]})


def test_split_sizes_given_on_the_command_line_turn_the_search_off():
    profile = load_profile(PROFILE_DIR / "default-cpu.toml")
    assert profile.split_search >= 3
    assert profile.override(split_sizes=(2, 4)).split_search == 0
    assert profile.override(split_sizes=(2, 4)).split_search_for("accum") == 0
    assert profile.override(split_sizes=(2, 4), split_search=5).split_search == 5
    assert profile.override(launches=1).split_search == profile.split_search


def test_the_default_cpu_profile_measures_three_splits_per_pipelined_strategy():
    """``make bench`` on a 2-worker cpu rig: every pipelined strategy's search (the
    tutorial's pipeline and 1f1b), at each image size, has four runnable splits and
    measures three."""
    cases = expand(load_profile(PROFILE_DIR / "default-cpu.toml"), RIG)
    searches: dict[tuple[object, ...], list[int]] = {}
    for c in cases:
        if c.micro is not None and c.status is None:
            searches.setdefault(search_key(c), []).append(c.split_size or 0)
    assert {k[0] for k in searches} == {"pipeline", "1f1b"}
    assert len(searches) == 2 * 2  # two image sizes, strong scaling
    for key, splits in searches.items():
        case = next(c for c in cases if c.status is None and search_key(c) == key)
        assert case.split_search is not None, key
        assert sorted(splits) == [1, 2, 4, 8], key
        assert min(case.split_search.measured, len(splits)) >= 3, (key, splits)


# --- the figure ------------------------------------------------------------------------


def tradeoff_rows() -> pd.DataFrame:
    """pipeline at splits 1-8: 2, 4, 8 measured, 1 skipped with its prediction; an unrelated
    skipped split with no prediction (crossed, as before)."""
    rows = []
    for split, pred, status in [(1, 3.0, "skipped"), (2, 2.0, "ok"), (4, 1.5, "ok"),
                                (8, 1.0, "ok"), (32, None, "skipped")]:
        measured = {2: 1.9, 4: 1.6, 8: 1.2}.get(split)
        rows.append({"run_label": "run", "model": "toy", "image_size": 64, "batch_size": 8,
                     "precision": "fp32", "strategy": "pipeline", "split_size": split,
                     "status": status, "step_time_s_median": measured,
                     "step_time_s_ci_low": measured and measured - 0.1,
                     "step_time_s_ci_high": measured and measured + 0.1,
                     "step_time_s_predicted": pred})
    return pd.DataFrame(rows)


def test_the_figure_draws_the_predicted_line_beside_the_measured_points():
    fig = figures.fig_split_tradeoff(tradeoff_rows())
    (ax,) = fig.axes
    predicted = [ln for ln in ax.lines if ln.get_label() == "_predicted pipeline"]
    assert len(predicted) == 1
    assert list(predicted[0].get_xdata()) == [1, 2, 4, 8]
    assert list(predicted[0].get_ydata()) == [3.0, 2.0, 1.5, 1.0]
    stars = [ln.get_xdata()[0] for ln in ax.lines if ln.get_marker() == "*"]
    assert stars == [8]
    crosses = [ln.get_xdata()[0] for ln in ax.lines if ln.get_marker() == "x"]
    assert crosses == [32]  # the unmeasured candidate sits on the line, not crossed
    assert "dashed line: predicted for every split" in fig.get_suptitle()
    plt.close(fig)


def test_without_predictions_the_figure_draws_no_predicted_line():
    rows = tradeoff_rows().drop(columns=["step_time_s_predicted"])
    fig = figures.fig_split_tradeoff(rows)
    assert not [ln for ax in fig.axes for ln in ax.lines
                if str(ln.get_label()).startswith("_predicted")]
    assert "line: predicted" not in fig.get_suptitle()
    crosses = sorted(ln.get_xdata()[0] for ax in fig.axes for ln in ax.lines
                     if ln.get_marker() == "x")
    assert crosses == [1, 32]
    plt.close(fig)
