"""The run estimate's terms (#39 item 3): each cuda term recomputed from the H100 evidence
(so the terms are measured, not stated), ``from_duty`` on a duty.json with parts, and the
evidence runs' own walls re-estimated from their profiles."""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from bench_lib.prediction import fixed_costs
from bench_lib.prediction.duration import run_estimate
from bench_lib.prediction.fixed_costs import CUDA, from_duty, steady_warmup_s
from bench_lib.rig import Rig
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile

EVIDENCE = Path(__file__).parent / "data" / "h100-2026-11-26"
RUN_224, SMOKE, SLOTS = "resnet50-224-single-accum", "smoke-1gpu", "smoke-2slots"


def read(run: str, name: str) -> Any:
    path = EVIDENCE / run / name
    if name.endswith(".json"):
        return json.loads(path.read_text())
    with path.open() as f:
        return list(csv.DictReader(f))


def terms_of(run: str, sizes: int = 0) -> dict[str, float]:
    """``from_duty`` on an evidence run: its duty.json and its steady warm-up."""
    minimum = read(run, "env.json")["profile"]["warmup_steps"]
    return from_duty(read(run, "duty.json"), steady_warmup_s(read(run, "cases.csv"), minimum),
                     sizes)


def calibrated_sizes(run: str) -> int:
    return sum(len(c["alone"]) + len(c["together"])
               for c in read(run, "calibration.json")["calibrations"])


def beyond_timed_per_launch(run: str) -> dict[str, float]:
    """Each ok case's wall per launch beyond its timed steps (the slowest rank's per step)."""
    slowest: dict[tuple[str, str, str], float] = defaultdict(float)
    for s in read(run, "steps.csv"):
        key = (s["case_id"], s["launch"], s["step"])
        slowest[key] = max(slowest[key], float(s["step_time_s"]))
    timed: dict[str, float] = defaultdict(float)
    for (case_id, _, _), seconds in slowest.items():
        timed[case_id] += seconds
    return {r["case_id"]: (float(r["case_wall_time_s"]) - timed[r["case_id"]])
            / int(r["launches"]) for r in read(run, "cases.csv") if r["status"] == "ok"}


def test_every_cuda_term_is_what_the_h100_evidence_says():
    big, smoke, slots = terms_of(RUN_224, calibrated_sizes(RUN_224)), terms_of(SMOKE), \
        terms_of(SLOTS)
    assert calibrated_sizes(RUN_224) == 4  # two workloads, alone at 20 and 120 each
    # duty.json's fixed_per_launch_s is the run's total: 13.5 s over 12 launches.
    assert read(RUN_224, "duty.json")["fixed_per_launch_s"] == pytest.approx(13.52, abs=0.01)
    assert CUDA.launch_s == pytest.approx(big["launch_s"], abs=0.005)
    assert CUDA.first_step_s == pytest.approx(big["first_step_s"], abs=0.005)
    assert CUDA.calibration_size_s == pytest.approx(big["calibration_size_s"], abs=0.005)
    # The run's own set-up (pre-flight, fork server, planning, rows): smoke, which measured
    # neither rig figures nor collectives (its env.json says so).
    env = read(SMOKE, "env.json")
    assert "unsupported" in env["idle_power"] and "skipped" in env["collectives"]
    assert CUDA.run_s == pytest.approx(smoke["run_s"], abs=0.005)
    # Rig figures: the 224 px run's per-run cost beyond the set-up (its calibration is out).
    assert "watts" in read(RUN_224, "env.json")["idle_power"]
    assert CUDA.rig_figures_s == pytest.approx(big["run_s"] - smoke["run_s"], abs=0.005)
    # Collectives: the slots' run tried them (and failed) on top of the same set-up.
    assert CUDA.collectives_s == pytest.approx(slots["run_s"] - smoke["run_s"], abs=0.005)
    # NCCL: smoke's ddp launch (a process group on nccl) beyond its one-process cases'.
    beyond = beyond_timed_per_launch(SMOKE)
    one_process = statistics.mean(beyond[c] for c in beyond if not c.startswith("ddp_"))
    ddp = beyond["ddp_resnet50_img64_b8_s-_fp32"]
    assert CUDA.process_group_s == pytest.approx(ddp - one_process, abs=0.005)


def test_the_evidence_runs_are_reestimated_from_their_profiles_near_their_walls():
    """In-sample (the terms come from these runs), but through the whole path: the profile
    expanded, each case's launches, warm-up rule and timed window, the per-run terms that
    apply. Before #39 the estimate was about half of each wall."""
    for run in (RUN_224, SMOKE, SLOTS):
        env = read(run, "env.json")
        profile = Profile.from_dict({k: v for k, v in env["profile"].items()
                                     if k in Profile.keys()})
        rig = Rig.from_dict(env["rig"])
        est = run_estimate(expand(profile, rig), rig, profile.rig_figures, profile.predict_time)
        wall = read(run, "duty.json")["wall_s"]
        assert est.total_s == pytest.approx(wall, rel=0.15), run


def test_from_duty_reads_the_parts_where_the_file_has_them():
    duty = {"launches": 4, "fixed_per_launch_s": 8.0, "warmup_s": 10.0, "calibration_s": 6.0,
            "fixed_per_run_s": 30.0,
            "warmup_parts_s": {"warmup_first_step_s": 6.0, "warmup_steady_s": 4.0},
            "run_parts_s": {"planning_s": 1.0, "idle_power_s": 2.0, "flop_peak_s": 3.0,
                            "collectives_s": 5.0, "calibration_s": 6.0,
                            "between_launches_s": 4.0, "other_s": 9.0}}
    terms = from_duty(duty, steady_warmup=99.0, calibrated_sizes=3)  # the parts win
    assert terms == {"launch_s": (8.0 + 4.0) / 4, "first_step_s": 6.0 / 4,
                     "calibration_size_s": 2.0, "rig_figures_s": 5.0, "collectives_s": 5.0,
                     "run_s": 30.0 - 6.0 - 4.0 - 5.0 - 5.0}
    # Without parts: the warm-up beyond its steady steps, the per-run cost in one term.
    old = {k: v for k, v in duty.items() if not k.endswith("_parts_s")}
    assert from_duty(old, steady_warmup=2.0) == {
        "launch_s": 2.0, "first_step_s": 2.0, "run_s": 24.0, "rig_figures_s": 0.0,
        "collectives_s": 0.0}


def test_steady_warmup_counts_later_launches_reuse():
    rows = [{"status": "ok", "warmup_steps": "3", "launch_medians_s": "1.0;2.0;2.0"},
            {"status": "ok", "warmup_steps": "5", "launch_medians_s": "1.0;1.0"},
            {"status": "oom", "warmup_steps": "", "launch_medians_s": ""}]
    # First case: 2 steady steps at 1.0, later launches 3 - 2 = 1 step: its first only.
    # Second: 4 at 1.0, then 5 - 2 = 3 steps: 2 steady at 1.0.
    assert steady_warmup_s(rows, minimum=1) == pytest.approx(2.0 + 4.0 + 2.0)
    # A minimum of 3 holds later launches at 3 steps: 2 steady each.
    assert steady_warmup_s(rows, minimum=3) == pytest.approx(2.0 + 2 * 2 * 2.0 + 4.0 + 2.0)


def test_each_rig_kind_has_its_terms_and_their_source():
    assert set(fixed_costs.BY_KIND) == {"cpu", "cuda"}
    for terms in fixed_costs.BY_KIND.values():
        assert terms.source and terms.launch_s > 0 and terms.run_s > 0
    assert fixed_costs.CPU.process_group_s == 0.0  # gloo's group is in launch_s
