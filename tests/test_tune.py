"""tune: the race on synthetic candidates whose true step times are known, the space and its
reproducing command, the run folder (fake launches and one real tiny run), bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench_lib.commands import main
from bench_lib.commands.parser import build_parser
from bench_lib.commands.plan import plan_new
from bench_lib.commands.tune import plan_of as tune_plan_of
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.prediction.admission import Admission, DeviceMemory
from bench_lib.prediction.memory import Prediction
from bench_lib.results.read import run_dirs_in
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case
from bench_lib.sweep.profile import Profile, UsageError, load_profile, profile_path
from bench_lib.tune.plan import TunePlan
from bench_lib.tune.race import LaunchResult, Measure, RaceSettings, race
from bench_lib.tune.search import BUDGET_FRACTION, execute, settings_of
from bench_lib.tune.space import build_space, race_launch, reproduce_command
from tests.conftest import in_process

RIG = Rig("cpu", 2, 1, cores=(0, 1))
# The default-cpu sweep's measured step times at 64 px (results of 9955541's make bench):
# single, ddp, fsdp, mp, pipeline s2/s4, accum s2/s4, gpipe s2/s4, 1f1b s2/s4.
MEASURED = [0.49, 0.41, 0.77, 0.50, 1.27, 0.81, 1.20, 0.80, 0.80, 0.54, 0.81, 0.54]


SWEEP_OVER_RACE = 1.29  # the estimate's for default-cpu at 64 px (tune.search.settings_of)


def synthetic(means: list[float], seed: int, launch_sd: float = 0.08,
              drift_sd: float = 0.05) -> Measure:
    """Launch medians around known means: lognormal launch noise (8%: more than the 2-9%
    launch-to-launch spread of default-cpu's 5-step launches, as the race's are shorter)
    and a drift per rung that hits every candidate of the rung alike. A launch costs the
    candidate's step time over the best's, in seconds."""
    rng = random.Random(seed)
    drift: dict[int, float] = {}

    def measure(i: int, rung: int) -> LaunchResult:
        d = drift.setdefault(rung, rng.gauss(0, drift_sd))
        median = means[i] * math.exp(d + rng.gauss(0, launch_sd))
        return LaunchResult("ok", median, 2, means[i] / min(means))

    return measure


def within(result_winner: int | None, means: list[float], pct: float = 5.0) -> bool:
    return result_winner is not None and means[result_winner] <= min(means) * (1 + pct / 100)


def test_the_race_finds_the_best_of_the_measured_field_within_the_default_budget():
    """The default-cpu field at 64 px and the default budget (0.3 of the sweep's launch
    time as predicted from rung 0): the winner is within 5% of the best in >= 90% of 200
    seeded races, every race re-measures the leaders in a second rung, and none spends more
    than the budget."""
    settings = RaceSettings(budget_fraction=BUDGET_FRACTION, sweep_launches=3,
                            sweep_over_race=SWEEP_OVER_RACE)
    sweep = sum(SWEEP_OVER_RACE * 3 * m / min(MEASURED) for m in MEASURED)
    hits = 0
    for trial in range(200):
        result = race(len(MEASURED), 0, synthetic(MEASURED, trial), settings, seed=trial)
        hits += within(result.winner, MEASURED)
        assert len(result.rungs) >= 2
        assert result.spent_s <= BUDGET_FRACTION * sweep + 1e-9
    assert hits >= 180, hits


def test_the_race_picks_a_close_best_and_uses_far_fewer_launches_than_the_sweep():
    """No time budget, a closer field (the best 10% ahead of the next): the best in >= 90%
    of 200 races, with under three quarters of a 3-launch sweep's launches (12 + 6 + 3 + 2
    and the reference's where it was dropped)."""
    means = [1.0, 1.1, 1.12, 1.15, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0, 2.2]
    hits, launches = 0, []
    for trial in range(200):
        result = race(len(means), 5, synthetic(means, 1000 + trial), RaceSettings(),
                      seed=trial)
        hits += within(result.winner, means)
        launches.append(len(result.records))
    assert hits >= 180, hits
    assert max(launches) < 0.75 * 3 * len(means), max(launches)


def test_two_equal_candidates_are_called_a_tie():
    means = [1.0, 1.0, 1.5, 1.6, 1.7, 1.8]
    ties = 0
    for trial in range(200):
        result = race(len(means), 2, synthetic(means, 5000 + trial), RaceSettings(),
                      seed=trial)
        assert result.winner in (0, 1)
        if result.verdict == "tie":
            ties += 1
            assert set(result.tie) >= {0, 1}
    # Bonferroni over the looks keeps a false separation at <= 5% overall.
    assert ties >= 180, ties


def test_a_clear_winner_separates_from_the_runner_up():
    result = race(4, 3, synthetic([0.5, 1.0, 1.2, 1.4], 7, launch_sd=0.01, drift_sd=0.01),
                  RaceSettings(), seed=3)
    assert result.verdict == "separated" and result.winner == 0 and result.runner_up == 1
    speedup = result.speedup(0, 1)
    assert speedup is not None and speedup.low > 1.8


def test_halving_keeps_the_better_half_and_launches_the_reference_every_rung():
    means = [float(m) for m in (3, 8, 1, 6, 2, 7, 4, 5)]  # the reference, 7, is the slowest

    def exact(i: int, rung: int) -> LaunchResult:
        return LaunchResult("ok", means[i] * (1.01 if rung % 2 else 0.99) ** (i % 3), 3, 1.0)

    result = race(len(means), 1, exact, RaceSettings(max_rungs=3), seed=0)
    assert sorted(result.rungs[0]) == list(range(8))
    best_half = sorted(range(8), key=lambda i: means[i])[:4]
    assert sorted(result.rungs[1]) == sorted([*best_half, 1])
    assert result.winner == 2


def test_a_failed_launch_drops_its_candidate_for_good():
    def measure(i: int, rung: int) -> LaunchResult:
        if i == 1:
            return LaunchResult("oom", None, 0, 1.0, "out of memory")
        return LaunchResult("ok", [1.0, 0.1, 1.1, 1.2][i] * (1 + 0.01 * rung), 3, 1.0)

    result = race(4, 0, measure, RaceSettings(max_rungs=3), seed=1)
    assert [r.candidate for r in result.records].count(1) == 1
    assert 1 not in result.ranking and result.winner == 0


def test_the_time_budget_cuts_later_rungs_to_the_best_that_fit():
    means = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]
    # Rung 0 costs sum(means) (each launch its mean over the best); the best two (2.1 s)
    # fit in 2.5 s more, a third (1.2 s more) does not.
    result = race(len(means), 0, synthetic(means, 11, 0.03, 0.0),
                  RaceSettings(budget_s=sum(means) + 2.5), seed=0)
    assert len(result.rungs) >= 2 and len(result.rungs[1]) == 2
    assert result.spent_s <= result.budget_s
    tight = race(len(means), 0, synthetic(means, 11), RaceSettings(budget_s=1.0), seed=0)
    assert len(tight.rungs) == 1 and len(tight.records) == len(means)
    assert tight.stop_reason.startswith("time budget") and tight.verdict == "tie"
    assert 2 <= len(tight.tie) <= 4  # after rung 0 alone: among the half halving keeps


def _space(*flags: str) -> tuple[TunePlan, Rig, Profile]:
    args = build_parser().parse_args(["tune", *flags])
    rig, profile, _ = plan_new(args)
    return tune_plan_of(args), rig, profile


def test_the_reproducing_command_parses_and_yields_the_same_case():
    _, rig, profile = _space("--profile", "default", "--image-sizes", "64", "--rig", "cpu",
                             "--devices", "2", "--threads-per-worker", "1")
    space = build_space(profile, rig)
    assert [c.strategy for c in space.candidates][0] == "single"
    # dp on a cpu rig (the split search's candidates stop short of one micro-batch, which
    # torch's Schedule1F1B would refuse on 2 stages)
    assert {c.status for c in space.not_run} == {"unsupported"}
    for case in space.candidates:
        cmd = reproduce_command(case, "default", space.profile, rig, ["--timed-steps", "4"])
        assert cmd[:4] == ["python", "-m", "bench_lib", "run"]
        again = build_parser().parse_args(cmd[3:])
        _, _, cases = plan_new(again)
        assert case.case_id in {c.case_id for c in cases}, (case.case_id, cmd)
        assert again.timed_steps == 4


def test_rung_zero_is_short_and_keeps_a_strategy_s_own_warm_up():
    # 64 px is a size of the cpu rig's default profile: the rig is asked for, not detected.
    _, rig, profile = _space("--profile", "default", "--image-sizes", "64", "--rig", "cpu")
    case = build_space(profile, rig).candidates[1]
    short = race_launch(case, profile.measurement)
    assert short.case_id == case.case_id
    assert short.measurement.timed_steps < case.measurement.timed_steps
    assert short.measurement.warmup_steps == 1


def _fake_launch(step_s: dict[str, float]):
    def launch(case: Case, rung: int, cut: str) -> CaseOutcome:
        times = [step_s[case.strategy] * (1 + 0.01 * k) for k in range(3)]
        return CaseOutcome("ok", step_times_s=times, rank_step_times_s={0: times},
                           rank_step_cpu_times_s={0: times}, peak_mem_mib={"0": 50.0},
                           warmup_steps=1, wall_time_s=0.01)
    return launch


def _mlp_race(tmp_path: Path, visible_gpus: Callable[[int], None]):
    """mlp's single, ddp, mp and pipeline on the smoke profile on a 2-worker cpu rig, and a
    fake launch that records each case id it launches. The machine seems to have a GPU:
    the race asks for the cpu rig (a GPU box detects cuda:1 by default, where mp and
    pipeline cannot run and the race would lose the candidates these tests are about)."""
    visible_gpus(1)
    plan, rig, profile = _space("--profile", "smoke", "--models", "mlp", "--strategies",
                                "single,ddp,mp,pipeline", "--rig", "cpu", "--devices", "2",
                                "--out", str(tmp_path / "r"))
    assert rig.kind == "cpu" and rig.num_devices == 2
    launched: list[str] = []
    base = _fake_launch({"single": 0.4, "ddp": 0.3, "mp": 0.5, "pipeline": 0.6})

    def launch(case: Case, rung: int, cut: str) -> CaseOutcome:
        launched.append(case.case_id)
        return base(case, rung, cut)

    return plan, rig, build_space(profile, rig), launched, launch


def test_predicted_oom_is_never_launched_and_the_folder_is_complete(
        tmp_path: Path, visible_gpus: Callable[[int], None]):
    plan, rig, space, launched, launch = _mlp_race(tmp_path, visible_gpus)

    def predictor(case: Case, rig: Rig, cut: str) -> Prediction:
        return Prediction({"0": 900.0 if case.strategy == "mp" else 10.0})

    admission = Admission(rig, DeviceMemory((100.0, 100.0), "test cap"), predictor)
    code = execute(plan, space, rig, settings_of(plan, space, rig), time.time(), launch,
                   admission)
    assert code == 0
    assert not any(i.startswith("mp_") for i in launched)
    (run_dir,) = run_dirs_in(tmp_path / "r")
    assert run_dir.name.endswith("_tune-smoke")  # what made it, and from which profile
    assert os.readlink(tmp_path / "r" / "latest-tune") == run_dir.name
    env = json.loads((run_dir / "env.json").read_text())
    assert any(k.startswith("mp_") for k in env["tune"]["predicted_oom"])
    rows = list(csv.DictReader((run_dir / "tune.csv").open()))
    assert len(rows) == len(launched) and {r["status"] for r in rows} == {"ok"}
    cases = {r["case_id"]: r for r in csv.DictReader((run_dir / "cases.csv").open())}
    assert {c.case_id for c in space.cases} == set(cases)
    mp = next(r for k, r in cases.items() if k.startswith("mp_"))
    assert mp["status"] == "oom" and mp["reason"].startswith("predicted")
    summary = json.loads((run_dir / "tune.json").read_text())
    assert summary["winner"].startswith("ddp_")
    assert summary["speedup_vs_single"]["point"] == pytest.approx(0.4 / 0.3, rel=0.05)
    assert summary["launches"] == len(launched)


@pytest.mark.integration
def test_a_tiny_real_tune_writes_a_valid_run_folder(tmp_path: Path, capsys):
    out = tmp_path / "results"
    proc = in_process(capsys, "tune", "--profile", "smoke", "--models", "mlp", "--strategies",
                      "single,accum", "--split-sizes", "4", "--warmup-steps", "1",
                      "--timed-steps", "3", "--out", str(out), "--rig", "cpu", "--devices", "2")
    assert proc.returncode == 0, proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert run_dir.parent == out and (run_dir / "env.json").is_file()
    summary = json.loads((run_dir / "tune.json").read_text())
    rows = list(csv.DictReader((run_dir / "tune.csv").open()))
    assert len(rows) == summary["launches"] >= 2
    assert all(float(r["launch_median_s"]) > 0 for r in rows if r["status"] == "ok")
    assert summary["winner"] in {r["case_id"] for r in rows}
    assert "recommendation:" in proc.stderr and "reproduce: python -m bench_lib run" in \
        proc.stderr
    assert len(list(csv.DictReader((run_dir / "cases.csv").open()))) == 2


@pytest.mark.parametrize("flags", [
    ["--profile", "default"],  # two image sizes: not one workload
    ["--profile", "default", "--image-sizes", "64", "--max-rungs", "0"],
    ["--profile", "default", "--image-sizes", "64", "--budget-fraction", "-1"],
    ["--profile", "smoke", "--strategies", "nope"],
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, flags: list[str],
                                             capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert main(["tune", *flags, "--out", str(out)]) == 2
    assert not out.exists()
    assert "error:" in capsys.readouterr().err


def test_several_workloads_name_the_flag_to_pick_one():
    profile = load_profile(profile_path("default", RIG.kind))
    with pytest.raises(UsageError, match="--image-sizes one of 64, 96"):
        build_space(profile, RIG)


def _folder(path: Path, medians: dict[str, float], summary: dict[str, object] | None) -> Path:
    path.mkdir(parents=True)
    with (path / "cases.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["case_id", "status", "step_time_s_median"])
        w.writeheader()
        w.writerows({"case_id": k, "status": "ok", "step_time_s_median": v}
                    for k, v in medians.items())
        w.writerow({"case_id": "dp_x", "status": "unsupported", "step_time_s_median": ""})
    if summary is not None:
        (path / "tune.json").write_text(json.dumps(summary))
    return path


def test_versus_judges_the_pick_on_the_sweep_s_own_numbers(tmp_path: Path):
    from bench_lib.tune.versus import judge, summary_lines

    # single_b4: a point of single's batch curve, the shortest step of all but of another
    # batch: the best is the fastest of the configurations tune chose from.
    sweep = _folder(tmp_path / "s", {"single_x": 0.49, "ddp_x": 0.41, "mp_x": 0.42,
                                     "single_b4": 0.18}, None)
    space = {"single_x": 0.5, "ddp_x": 0.5, "mp_x": 0.5}  # tune's own cases
    near = _folder(tmp_path / "t1", space, {"winner": "mp_x", "verdict": "tie"})
    far = _folder(tmp_path / "t2", space, {"winner": "single_x", "verdict": "separated"})
    ok = judge(near, sweep, 100.0, 400.0, True)
    assert ok.sweep_best == "ddp_x" and ok.pick_over_best_pct == pytest.approx(100 / 41)
    assert ok.goals_met
    assert not judge(far, sweep, 100.0, 400.0, False).goals_met  # 19.5% slower
    assert not judge(near, sweep, 150.0, 400.0, True).goals_met  # 0.375 of the time
    assert "met in 1 of 3 rounds" in summary_lines(
        [ok, judge(far, sweep, 100.0, 400.0, False), judge(near, sweep, 150.0, 400.0, True)]
    )[-1]


def test_where_the_reference_does_not_fit_the_best_two_race_on_alone():
    means = [1.0, 1.1, 1.2, 1.3, 1.4, 2.0]  # the reference, 5, is the slowest
    result = race(len(means), 5, synthetic(means, 3, 0.02, 0.0),
                  RaceSettings(budget_s=sum(means) + 2.2), seed=0)
    assert sorted(result.rungs[1]) == [0, 1]  # 2.1 s fits; with the reference's 2 s not
    assert result.speedup(0, 5) is not None and result.speedup(0, 5).n == 1


def test_a_candidate_predicted_too_slow_is_skipped_and_the_rest_race_in_predicted_order(
        tmp_path: Path, visible_gpus: Callable[[int], None]):
    """Skipped only where even the predictor's worst error both ways leaves it slower than
    the predicted best (``PREDICTION_MARGIN``); single always races; each row keeps its
    prediction."""
    from bench_lib.analysis.bound import Bound
    from bench_lib.tune.search import PREDICTION_MARGIN, by_prediction, skipped_by_prediction

    plan, rig, space, launched_ids, launch = _mlp_race(tmp_path, visible_gpus)
    limit = (1 + PREDICTION_MARGIN) / (1 - PREDICTION_MARGIN)  # 1.67x the best
    steps = {"single": 0.4, "ddp": 0.3, "mp": 0.3 * limit * 0.99, "pipeline": 0.3 * limit * 1.01}

    def predict(cases: list[Case]) -> dict[str, Bound | str]:
        return {c.case_id: Bound(c.strategy, steps[c.strategy], 0, 0, 0) for c in cases}

    predicted = predict(space.candidates)
    slow = skipped_by_prediction(space.candidates, predicted)
    pipelines = {c.case_id for c in space.candidates if c.strategy == "pipeline"}
    assert set(slow) == pipelines  # each of its splits; mp, at 0.99 of the limit, races
    assert "slower even were both predictions 25% off" in next(iter(slow.values()))
    order = [c.strategy for c in by_prediction(space.candidates, predicted)]
    assert order == ["single", "ddp", "mp"] + ["pipeline"] * len(pipelines)
    code = execute(plan, space, rig, settings_of(plan, space, rig), time.time(), launch,
                   predict=predict)
    assert code == 0
    launched = {i.split("_")[0] for i in launched_ids}
    assert "pipeline" not in launched and {"single", "ddp", "mp"} <= launched
    (run_dir,) = run_dirs_in(tmp_path / "r")
    env = json.loads((run_dir / "env.json").read_text())
    assert set(env["tune"]["predicted_slow"]) == pipelines
    cases = {r["case_id"]: r for r in csv.DictReader((run_dir / "cases.csv").open())}
    pipe = next(r for k, r in cases.items() if k.startswith("pipeline_"))
    assert pipe["status"] == "skipped" and "predicted" in pipe["reason"]
    ddp = next(r for k, r in cases.items() if k.startswith("ddp_"))
    assert float(ddp["step_time_s_predicted"]) == 0.3 and ddp["prediction_error_pct"]

