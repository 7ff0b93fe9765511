"""The estimate honest about what it has not measured (#47 item 6): every fixed term says
where it was measured; the dry run names the terms of another machine and the range they
imply; after a run on this machine the next dry run takes its terms from that run's
duty.json and says so; a run of other hardware (or with test hooks) is ignored."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from bench_lib import commands, strategies
from bench_lib.measure.environment import hardware_fingerprint
from bench_lib.prediction import fixed_costs
from bench_lib.prediction.calibration_file import hardware_id
from bench_lib.prediction.duration import format_duration, run_estimate
from bench_lib.prediction.fixed_costs import CPU, CUDA, TERMS, implied_range, this_box
from bench_lib.rig import Rig
from bench_lib.rig_detection import detect_rig
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import PROFILE_DIR, load_profile

TWO_GPUS = Rig("cuda", 2)
GROUPS = {n for n, s in strategies.REGISTRY.items() if s.per_device_processes}
DUTY = {"wall_s": 100.0, "timed_s": 40.0, "warmup_s": 10.0, "launches_wall_s": 70.0,
        "launches": 10, "calibration_s": 6.0, "fixed_per_launch_s": 20.0,
        "fixed_per_run_s": 30.0,
        "launch_parts_s": {"process_start_s": 4.0, "process_group_s": 6.0,
                           "model_build_s": 10.0},
        "warmup_parts_s": {"warmup_first_step_s": 5.0, "warmup_steady_s": 5.0},
        "run_parts_s": {"planning_s": 1.0, "idle_power_s": 2.0, "flop_peak_s": 3.0,
                        "collectives_s": 4.0, "calibration_s": 6.0,
                        "between_launches_s": 2.0, "other_s": 12.0}}
"""A duty.json with every part: 10 launches, 3 of them ddp's on NCCL (``_write_run``)."""


def _write_run(results: Path, name: str, fingerprint: dict, kind: str = "cuda",
               duty: dict | None = None, hooks: dict | None = None) -> Path:
    """A run folder ``results``/gpu-check/``name`` (nested, as gpu_check writes them): one
    ddp case of 3 launches and one single case of 7, a calibration of 3 sizes."""
    run = results / "gpu-check" / name
    run.mkdir(parents=True)
    env = {"rig": {"kind": kind, "label": fingerprint.get("rig"), "gpu_slots": 1},
           "fingerprint": fingerprint, "profile": {"warmup_steps": 1},
           "test_hooks": hooks or {}}
    (run / "env.json").write_text(json.dumps(env))
    (run / "duty.json").write_text(json.dumps(duty or DUTY))
    (run / "calibration.json").write_text(json.dumps({"calibrations": [
        {"key": {}, "alone": {"8": 0.1, "16": 0.2}, "together": {"8": 0.1}},
        {"key": {}, "failed": "out of memory"}]}))
    with (run / "cases.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["strategy", "world_size", "status", "warmup_steps",
                               "launches", "launch_medians_s"])
        w.writeheader()
        w.writerow({"strategy": "ddp", "world_size": 2, "status": "ok", "warmup_steps": 1,
                    "launches": 3, "launch_medians_s": "0.1;0.1;0.1"})
        w.writerow({"strategy": "single", "world_size": 1, "status": "ok",
                    "warmup_steps": 1, "launches": 7, "launch_medians_s": "0.1"})
    return run


BOX = {"rig": "cuda:2", "device_names": ["NVIDIA A100"] * 2, "cpu_model": "x", "cpu_cores": 16}


def test_every_term_says_where_it_was_measured():
    for terms, where in ((CUDA, "one H100 (one GPU), 2026-11-26"),
                         (CPU, "one 2-core AMD EPYC, 2bfcde0")):
        assert terms.elsewhere == TERMS
        assert {terms.provenance(t) for t in TERMS} == {where}


def test_the_range_rule_each_term_of_another_machine_halved_and_doubled_nccl_from_1_s():
    low, high = CUDA.bounds("cuda")
    assert (low.launch_s, high.launch_s) == (CUDA.launch_s / 2, CUDA.launch_s * 2)
    assert (low.process_group_s, high.process_group_s) == (1.0, CUDA.process_group_s)
    assert (low.run_s, high.collectives_s) == (CUDA.run_s / 2, CUDA.collectives_s * 2)
    # A term measured here is not ranged.
    here = CUDA.with_terms({}, here={"launch_s": "this box's run r"})
    assert here.bounds("cuda")[0].launch_s == here.bounds("cuda")[1].launch_s == CUDA.launch_s
    assert "launch_s" not in here.elsewhere and here.provenance("launch_s") == "this box's run r"


def test_the_two_gpu_dry_run_names_the_terms_of_one_gpu_and_the_range_they_imply(tmp_path,
                                                                                 capsys):
    code = commands.main(["run", "--dry-run", "--rig", "cuda", "--devices", "2", "--profile",
                          "default", "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    profile = load_profile(PROFILE_DIR / "default-cuda.toml")
    cases = expand(profile, TWO_GPUS)

    def total(terms: fixed_costs.FixedCosts) -> float:
        return run_estimate(cases, TWO_GPUS, profile.rig_figures, profile.predict_time,
                            terms).total_s

    low, high = (total(t) for t in CUDA.bounds("cuda"))
    assert low < total(CUDA) < high
    where = out.index("terms from one H100 (one GPU), 2026-11-26, another machine: launch "
                      "start-up, first step, NCCL group, calibration per size, set-up, rig "
                      "figures, collectives")
    assert out[where + 1].startswith(
        f"  they imply {format_duration(low)} to {format_duration(high)}: each from 0.5x to "
        f"2x its figure, NCCL group from 1 s (published: 1-3 s a single-node NCCL start) to "
        f"15.8 s (measured)")
    assert implied_range(CUDA, "cuda", total).low_s == pytest.approx(low)


def test_a_term_the_run_never_pays_is_not_named():
    single = expand(load_profile(PROFILE_DIR / "smoke.toml"), Rig("cuda", 1))
    implied = implied_range(CUDA, "cuda", lambda t: run_estimate(
        single, Rig("cuda", 1), rig_figures=False, terms=t).total_s)
    # One GPU: no collectives (ddp's one rank still forms an NCCL group); smoke: no rig
    # figures, no calibration.
    assert implied.applied == ("launch_s", "first_step_s", "process_group_s", "run_s")


def test_this_boxs_newest_run_gives_its_terms_and_other_hardware_is_ignored(tmp_path):
    mine = "abc"
    older = _write_run(tmp_path, "20261201T000000Z_box_run-gpu-check", BOX)
    os.utime(older / "duty.json", (1, 1))
    _write_run(tmp_path, "20261202T000000Z_box_run-gpu-check", BOX | {"cpu_model": "other"})
    _write_run(tmp_path, "20261203T000000Z_box_run-hooked", BOX, hooks={"X": "1"})
    terms = this_box(tmp_path, "cuda", lambda: mine, GROUPS)
    assert terms == CUDA  # no run of this box: its id is not BOX's
    terms = this_box(tmp_path, "cuda", lambda: fixed_costs.fingerprint_id(BOX), GROUPS)
    words = "this box's run 20261201T000000Z_box_run-gpu-check"
    assert set(terms.here.values()) == {words}
    # from_duty's arithmetic, NCCL's group moved out of every launch into ddp's 3.
    assert terms.process_group_s == pytest.approx(6.0 / 3)
    assert terms.launch_s == pytest.approx((20.0 + 2.0) / 10 - 6.0 / 10)
    assert terms.first_step_s == pytest.approx(5.0 / 10)
    assert terms.calibration_size_s == pytest.approx(6.0 / 3)  # the failed one timed none
    assert terms.rig_figures_s == 5.0 and terms.collectives_s == 4.0
    assert terms.run_s == pytest.approx(30.0 - 6.0 - 2.0 - 5.0 - 4.0)
    assert terms.elsewhere == ()
    # A run without the per-run parts leaves those terms to the other machine's figures.
    bare = {k: v for k, v in DUTY.items() if k != "run_parts_s"}
    _write_run(tmp_path / "later", "20261204T000000Z_box_run-x", BOX, duty=bare)
    terms = this_box(tmp_path / "later", "cuda", lambda: fixed_costs.fingerprint_id(BOX),
                     GROUPS)
    assert terms.elsewhere == ("run_s", "rig_figures_s", "collectives_s")
    assert terms.run_s == CUDA.run_s
    # A machine whose id cannot be read (a plan for GPUs it lacks) has no run of its own.
    def no_gpus() -> str:
        raise ValueError("cannot read the names of 2 CUDA device(s)")
    assert this_box(tmp_path, "cuda", no_gpus, GROUPS) == CUDA
    assert this_box(tmp_path, "cpu", lambda: fixed_costs.fingerprint_id(BOX), GROUPS) == CPU


def _dry_run_cpu(out: Path, capsys) -> list[str]:
    code = commands.main(["run", "--dry-run", "--rig", "cpu", "--devices", "2",
                          "--threads-per-worker", "1", "--profile", "smoke", "--out",
                          str(out)])
    assert code == 0
    return capsys.readouterr().out.splitlines()


def test_after_a_run_here_the_dry_run_takes_its_terms_from_it_and_says_so(tmp_path, capsys):
    rig = detect_rig("cpu", 2, 1)
    here = hardware_fingerprint(rig)
    elsewhere = _dry_run_cpu(tmp_path, capsys)
    assert not any(line.startswith("terms from this box") for line in elsewhere)
    # Another machine's run (another CPU model): still the constants.
    _write_run(tmp_path, "20261201T000000Z_other_run-smoke", here | {"cpu_model": "other"},
               kind="cpu")
    assert _dry_run_cpu(tmp_path, capsys) == elsewhere
    run = _write_run(tmp_path, "20261202T000000Z_box_run-smoke", here, kind="cpu")
    assert fixed_costs.fingerprint_id(here) == hardware_id(rig)
    out = _dry_run_cpu(tmp_path, capsys)
    assert (f"terms from this box's run {run.name}: launch start-up, first step, calibration "
            "per size, set-up, rig figures, collectives") in out
    assert not any("another machine" in line for line in out)  # every term it pays is here
    terms = this_box(tmp_path, "cpu", lambda: hardware_id(rig), GROUPS)
    cases = expand(load_profile(PROFILE_DIR / "smoke.toml"), rig)
    total = run_estimate(cases, rig, rig_figures=False, terms=terms).total_s
    assert total != run_estimate(cases, rig, rig_figures=False).total_s
    assert any(f"estimated duration ~{format_duration(total)}" in line for line in out)
