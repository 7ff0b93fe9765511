"""The same-job gate's verdicts (``bench_lib.compare.paired``): pairing, its interval's
coverage on synthetic data, a side's rounds as one run, and the notes beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench_lib import exit_codes
from bench_lib.compare import paired
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import Run

ROW = {"model": "resnet50", "image_size": 64, "batch_size": 16, "precision": "fp32",
       "loss": "ce", "status": "ok"}


def run_of(medians: dict[str, list[float]], status: dict[str, str] | None = None,
           path: str = "x") -> Run:
    """A run whose case ``cid`` had, in round r, a launch of 5 steps around medians[cid][r]."""
    cases = {cid: dict(ROW, strategy=cid.split("_")[0], case_id=cid,
                       status=(status or {}).get(cid, "ok")) for cid in medians}
    launches = {cid: {r: np.asarray([m * f for f in (0.99, 1.0, 1.0, 1.01, 1.02)])
                      for r, m in enumerate(ms)} for cid, ms in medians.items()}
    return Run(Path(path), {}, cases, launches)


# ---- pairing ----------------------------------------------------------------------------


def test_pairing_cancels_round_drift_that_an_unpaired_comparison_cannot() -> None:
    drift = [1.0, 1.25, 0.9, 1.3]  # the machine's state, shared by both sides of a round
    base = run_of({"single_a": [0.2 * d for d in drift], "ddp_a": [0.3 * d for d in drift]})
    head = run_of({"single_a": [0.2 * d * 1.08 for d in drift],
                   "ddp_a": [0.3 * d for d in drift]})
    results = {r.case_id: r for r in paired.judge_cases(base, head, 5.0, "step_time")}
    single = results["single_a"].changes["step_time"]
    assert single.value == pytest.approx(0.08, abs=1e-9)
    assert single.ci_low == pytest.approx(0.08, abs=1e-9)  # no pair-to-pair spread at all
    assert results["single_a"].verdict == "regression"
    assert results["ddp_a"].verdict == "unchanged"
    assert single.method == paired.METHOD_PAIRED and single.n_base == 4
    # the same data unpaired (compare's Welch over launches) cannot call the 8%
    unpaired = cmp.step_time_change(base, head, "single_a", np.random.default_rng(0))
    assert unpaired.ci_low < 0 < unpaired.ci_high


def test_speedup_metric_pairs_the_case_over_its_rounds_single() -> None:
    base = run_of({"single_a": [0.2, 0.22, 0.21], "ddp_a": [0.3, 0.33, 0.315]})
    head = run_of({"single_a": [0.2, 0.22, 0.21], "ddp_a": [0.36, 0.396, 0.378]})
    results = {r.case_id: r for r in paired.judge_cases(base, head, 5.0, "auto")}
    assert results["ddp_a"].by == "speedup"
    assert results["ddp_a"].changes["speedup"].value == pytest.approx(0.2, abs=1e-9)
    assert results["ddp_a"].verdict == "regression"
    assert results["single_a"].by == "step_time" and results["single_a"].verdict == "unchanged"


def test_a_change_below_the_threshold_or_not_clear_of_zero_passes() -> None:
    base = run_of({"single_a": [0.2, 0.2, 0.2, 0.2]})
    small = run_of({"single_a": [0.206, 0.2062, 0.2058, 0.206]})  # +3%, clear of 0
    noisy = run_of({"single_a": [0.3, 0.17, 0.25, 0.19]})  # +13% but all over the place
    assert paired.judge_cases(base, small, 5.0, "step_time")[0].verdict == "unchanged"
    assert paired.judge_cases(base, small, 2.0, "step_time")[0].verdict == "regression"
    noisy_result = paired.judge_cases(base, noisy, 5.0, "step_time")[0]
    assert noisy_result.changes["step_time"].value > 0.05
    assert noisy_result.verdict == "unchanged"


def test_paired_interval_covers_the_true_ratio_as_often_as_it_claims() -> None:
    """Synthetic gates: 4 rounds, round drift (sd 8%) shared by both sides, launch noise
    (sd 3%) on each; the 95% interval of head over base covers the true 1.10."""
    rng = np.random.default_rng(7)
    trials, covered, caught = 2000, 0, 0
    for _ in range(trials):
        drift = np.exp(rng.normal(0, 0.08, 4))
        base = 0.25 * drift * np.exp(rng.normal(0, 0.03, 4))
        head = 0.25 * 1.10 * drift * np.exp(rng.normal(0, 0.03, 4))
        change = paired.paired_change("step_time", head.tolist(), base.tolist())
        covered += change.ci_low <= 0.10 <= change.ci_high
        caught += change.verdict(0.05) == "regression"
    assert 0.93 <= covered / trials <= 0.97
    assert caught / trials > 0.75  # a 10% slowdown is caught most of the time at this noise


def test_a_sides_rounds_make_one_run_and_a_failure_in_any_round_breaks_the_case() -> None:
    rounds = [run_of({"single_a": [0.2], "ddp_a": [0.3]}),
              run_of({"single_a": [0.21], "ddp_a": [0.3]}, status={"ddp_a": "error"}),
              run_of({"single_a": [0.22], "ddp_a": [0.31]})]
    rounds[1].launches.pop("ddp_a")
    rounds[2].cases["single_a"]["contention"] = "other processes held 30% of a core"
    head = paired.side_run(Path("head"), rounds)
    assert head.launch_medians("single_a") == {0: 0.2, 1: 0.21, 2: 0.22}
    assert sorted(head.launches["ddp_a"]) == [0, 2]
    assert head.cases["ddp_a"]["status"] == "error"
    assert head.cases["single_a"]["contention"] == "round 3: other processes held 30% of a core"
    base = paired.side_run(Path("base"), [run_of({"single_a": [0.2], "ddp_a": [0.3]})
                                      for _ in range(3)])
    results = {r.case_id: r for r in paired.judge_cases(base, head, 5.0, "step_time")}
    assert results["ddp_a"].verdict == "broken" and "error" in results["ddp_a"].by
    assert cmp.exit_code(list(results.values())) == exit_codes.EXIT_NOT_OK
    # broken the other way round (failing in the base, fine in the head) is no verdict
    flipped = {r.case_id: r for r in paired.judge_cases(head, base, 5.0, "step_time")}
    assert flipped["ddp_a"].verdict == "n/a"


def test_the_gate_names_the_rounds_whose_gpu_clocks_were_held_back() -> None:
    """#28: compare named throttled cases, the gate only contended ones."""
    rounds = [run_of({"single_a": [0.2], "ddp_a": [0.3]}) for _ in range(3)]
    rounds[0].cases["ddp_a"]["throttled"] = "power cap 40% of the window"
    rounds[2].cases["ddp_a"]["throttled"] = "thermal 15% of the window"
    rounds[1].cases["single_a"]["contention"] = "other processes held 30% of a core"
    head = paired.side_run(Path("head"), rounds)
    assert head.cases["ddp_a"]["throttled"] == ("round 1: power cap 40% of the window; "
                                                "round 3: thermal 15% of the window")
    assert head.cases["single_a"]["contention"] == "round 2: other processes held 30% of a core"
    assert not head.cases["single_a"].get("throttled")
    base = paired.side_run(Path("base"), [run_of({"single_a": [0.2], "ddp_a": [0.3]})
                                      for _ in range(3)])
    notes = paired.gate_notes(paired.judge_cases(base, head, 5.0, "step_time"), base, head)
    (throttled,) = [n for n in notes if "GPU clocks" in n]
    assert throttled.startswith("the head was measured with GPU clocks held back: ddp_a")
    assert "round 1: power cap" in throttled and "round 3: thermal" in throttled
    assert "single_a" not in throttled
    assert not [n for n in paired.gate_notes([], base, base) if "GPU clocks" in n]


def test_each_sides_prediction_error_is_its_rounds_median_and_a_grown_one_is_noted() -> None:
    def rounds(errors: list[float]) -> list[Run]:
        runs = [run_of({"single_a": [0.2], "ddp_a": [0.3]}) for _ in errors]
        for run, error in zip(runs, errors):
            run.cases["ddp_a"]["prediction_error_pct"] = error
            run.cases["single_a"]["prediction_error_pct"] = ""  # not predicted
        return runs

    base = paired.side_run(Path("base"), rounds([2.0, -3.0, 4.0]))
    head = paired.side_run(Path("head"), rounds([20.0, -18.0, 25.0]))
    assert base.cases["ddp_a"]["prediction_error_pct"] == 2.0
    assert head.cases["ddp_a"]["prediction_error_pct"] == 20.0
    results = paired.judge_cases(base, head, 5.0, "step_time")
    cases = {c["case_id"]: c for c in paired.verdicts_json(results, base, head)}
    assert cases["ddp_a"]["prediction_error_pct"] == {"base": 2.0, "head": 20.0}
    assert cases["single_a"]["prediction_error_pct"] == {"base": None, "head": None}
    (note,) = [n for n in paired.gate_notes(results, base, head) if "prediction" in n]
    assert "ddp_a: +2.0% -> +20.0%" in note and "not of the code measured" in note
    assert not [n for n in paired.gate_notes(results, base, base) if "prediction" in n]

