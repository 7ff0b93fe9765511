"""The regression gate on synthetic run folders: verdicts, thresholds, exit codes, hardware."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench_lib import exit_codes
from bench_lib.commands import main
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.baseline import resolve_baseline, save_baseline
from bench_lib.compare.output import run_compare
from bench_lib.compare.plan import ComparePlan
from bench_lib.compare.runs import check_fingerprints, load_run, software_differences, step_samples
from bench_lib.results.fingerprint import fingerprint_id
from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.results.store import RunWriter, write_json_atomic

FINGERPRINT = {"rig": "cpu:2x1t", "device_names": ["cpu", "cpu"], "cpu_model": "Test CPU",
               "cpu_cores": 2}
VERSIONS = {"python": "3.11.9", "torch": "2.14.1", "torchvision": "0.29.1", "cuda": "12.8",
            "cudnn": 91002, "nccl": "2.27.3", "driver": "570.124.06", "cuda_available": True}
# Median step time of each strategy on the synthetic machine, in seconds.
BASE_S = {"single": 0.30, "ddp": 0.50, "mp": 0.35}
STEPS = 20  # per launch
LAUNCHES = 3  # the runner's default
NOISE = 0.05  # lognormal sigma: ~5% step-to-step spread, like a quiet CPU
LAUNCH_NOISE = 0.02  # each launch's own offset (placement, allocation), per case
ROUND_NOISE = 0.02  # drift shared by every case of a round (they run back to back)


def make_run(root: Path, name: str, seed: int, slowdown: dict | None = None,
             machine: float = 1.0, fingerprint: dict | None = None,
             status: dict | None = None, model: str = "resnet-tiny",
             noise: float = NOISE, versions: dict | None = None,
             launches: int = LAUNCHES, launch_noise: float = LAUNCH_NOISE,
             round_noise: float = ROUND_NOISE) -> Path:
    """A run folder of three cases measured in ``launches`` interleaved rounds, as the
    runner writes it; ``slowdown`` multiplies a strategy's times, ``machine`` all of them."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "env.json", {"schema_version": SCHEMA_VERSION,
                                             "fingerprint": fingerprint or FINGERPRINT,
                                             "versions": versions or VERSIONS})
    rng = np.random.default_rng(seed)
    steps: dict[str, list[dict]] = {s: [] for s in BASE_S}
    for launch in range(launches):  # round by round, every case once per round
        drift = rng.lognormal(0, round_noise)
        for strategy, median in BASE_S.items():
            scale = (median * machine * drift * (1 + (slowdown or {}).get(strategy, 0.0))
                     * rng.lognormal(0, launch_noise))
            ranks = 2 if strategy == "ddp" else 1
            steps[strategy] += [{"launch": launch, "rank": r, "step": i,
                                 "step_time_s": scale * rng.lognormal(0, noise)}
                                for r in range(ranks) for i in range(STEPS)]
    with RunWriter(run_dir) as w:
        for strategy in BASE_S:
            case_id = f"{strategy}_{model}_img32_b8_s-_fp32"
            row = {"case_id": case_id, "strategy": strategy, "model": model,
                   "image_size": 32, "batch_size": 8, "precision": "fp32", "loss": "ce",
                   "status": (status or {}).get(strategy, "ok")}
            if row["status"] != "ok":
                w.write_case(row)
                continue
            medians = [float(np.median([max(s["step_time_s"] for s in steps[strategy]
                                            if s["launch"] == k and s["step"] == i)
                                        for i in range(STEPS)])) for k in range(launches)]
            median = float(np.exp(np.mean(np.log(medians))))
            w.write_case(row | {"step_time_s_median": median, "throughput_img_s": 8 / median,
                                "launches": launches,
                                "steps_per_launch": ";".join([str(STEPS)] * launches),
                                "launch_medians_s": ";".join(f"{m:.6g}" for m in medians)},
                         steps[strategy])
    return run_dir


def verdicts(results: list[cmp.CaseResult]) -> dict[str, tuple[str, str]]:
    return {r.strategy: (r.verdict, r.by) for r in results}


def test_a_a_runs_from_one_distribution_are_unchanged(tmp_path):
    for seed in range(5):
        base = load_run(make_run(tmp_path, f"a{seed}", seed))
        cand = load_run(make_run(tmp_path, f"b{seed}", seed + 100))
        results = cmp.compare_runs(base, cand)
        assert {v for v, _ in verdicts(results).values()} == {"unchanged"}
        assert cmp.exit_code(results) == exit_codes.EXIT_OK


@pytest.mark.integration
def test_a_a_with_launch_to_launch_noise_passes(tmp_path):
    """Launches that differ by ~5% each (step noise 2%): Welch over launches holds that
    spread, so A/A runs pass; the same machine measured in 1 launch a run is judged on its
    steps alone, whose interval leaves the launch offset out, and fails A/A runs."""
    for seed in range(5):
        base = load_run(make_run(tmp_path, f"a{seed}", seed, noise=0.02, launch_noise=0.05))
        cand = load_run(make_run(tmp_path, f"b{seed}", seed + 100, noise=0.02,
                                     launch_noise=0.05))
        results = cmp.compare_runs(base, cand)
        assert {v for v, _ in verdicts(results).values()} == {"unchanged"}
        assert {(ch.method, ch.n_base, ch.n_cand) for r in results
                for ch in r.changes.values()} == {(cmp.METHOD_WELCH, LAUNCHES, LAUNCHES)}
    one = [cmp.exit_code(cmp.compare_runs(
        load_run(make_run(tmp_path, f"c{seed}", seed, noise=0.02, launch_noise=0.05,
                              launches=1)),
        load_run(make_run(tmp_path, f"d{seed}", seed + 100, noise=0.02, launch_noise=0.05,
                              launches=1)))) for seed in range(5)]
    assert exit_codes.EXIT_NOT_OK in one  # what the gate said before it had launches


def test_planted_15pct_slowdown_of_one_strategy_regresses_on_speedup(tmp_path):
    for seed in range(3):
        base = load_run(make_run(tmp_path, f"base{seed}", seed))
        cand = load_run(make_run(tmp_path, f"cand{seed}", seed + 100,
                                     slowdown={"mp": 0.15}))
        results = cmp.compare_runs(base, cand)
        assert verdicts(results) == {"single": ("unchanged", "step_time"),
                                     "ddp": ("unchanged", "speedup"),
                                     "mp": ("regression", "speedup")}
        mp = next(r for r in results if r.strategy == "mp").changes["speedup"]
        assert mp.method == cmp.METHOD_WELCH and mp.ci_low > 0
        assert mp.ci_low < 0.15 < mp.ci_high  # the interval holds the planted change
        assert cmp.exit_code(results) == exit_codes.EXIT_NOT_OK


def test_uniform_15pct_slowdown_regresses_single_on_step_time_only(tmp_path):
    # step_time keeps each launch's offset and each round's drift (speedup cancels the
    # drift): at 2% of each, 3 launches a side get this exact verdict in ~9 of 10 seeded pairs
    # (the point lands under the 10% threshold in the rest); at 1% of each, in 150 of 150.
    quiet = {"launch_noise": 0.01, "round_noise": 0.01}
    for seed in range(3):
        base = load_run(make_run(tmp_path, f"base{seed}", seed, **quiet))
        cand = load_run(make_run(tmp_path, f"cand{seed}", seed + 100, **quiet,
                                     slowdown={s: 0.15 for s in BASE_S}))
        results = cmp.compare_runs(base, cand)
        assert verdicts(results) == {"single": ("regression", "step_time"),
                                     "ddp": ("unchanged", "speedup"),
                                     "mp": ("unchanged", "speedup")}
        # every strategy is slower in absolute time; only single reports it
        assert all(r.changes["step_time"].value > 0.1 for r in results)


def test_one_launch_runs_fall_back_to_the_bootstrap_over_steps_and_say_so(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1, launches=1)
    cand = make_run(tmp_path, "cand", 2, launches=1, slowdown={"ddp": 0.15})
    results = cmp.compare_runs(load_run(base), load_run(cand))
    assert {(ch.method, ch.n_base, ch.n_cand) for r in results
            for ch in r.changes.values()} == {(cmp.METHOD_BOOTSTRAP, 1, 1)}
    assert verdicts(results)["ddp"] == ("regression", "speedup")
    md = tmp_path / "gate.md"
    assert run_compare(ComparePlan(base, cand, markdown=md)) == exit_codes.EXIT_NOT_OK
    out = capsys.readouterr().out
    assert out.count(cmp.METHOD_BOOTSTRAP) == 1 and cmp.METHOD_WELCH not in out
    assert "1 vs 1 launches" in out and "note: a run measured in 1 launch" in out
    assert md.read_text().count(cmp.METHOD_BOOTSTRAP) == 1
    # One side with launches, the other without: still the fallback, said with the counts.
    three = make_run(tmp_path, "three", 3)
    results = cmp.compare_runs(load_run(three), load_run(cand))
    assert {ch.method for r in results for ch in r.changes.values()} == {cmp.METHOD_BOOTSTRAP}
    assert run_compare(ComparePlan(three, cand)) == exit_codes.EXIT_NOT_OK
    assert "3 vs 1 launches" in capsys.readouterr().out


def test_one_strategy_slower_is_caught_through_speedup_despite_machine_drift(tmp_path):
    base = load_run(make_run(tmp_path, "base", 1))
    # the whole machine is 20% faster now, yet ddp got 15% slower relative to it
    cand = load_run(make_run(tmp_path, "cand", 2, slowdown={"ddp": 0.15}, machine=0.8))
    results = cmp.compare_runs(base, cand)
    v = verdicts(results)
    assert v["ddp"] == ("regression", "speedup")
    ddp = next(r for r in results if r.strategy == "ddp")
    assert ddp.changes["step_time"].value < 0  # absolute time alone would call it faster
    assert v["mp"] == ("unchanged", "speedup")


def test_machine_drift_alone_is_not_a_regression_on_the_speedup_metric(tmp_path):
    base = load_run(make_run(tmp_path, "base", 1))
    cand = load_run(make_run(tmp_path, "cand", 2, machine=1.3))
    v = verdicts(cmp.compare_runs(base, cand, metric="speedup"))
    assert v["ddp"][0] == "unchanged" and v["mp"][0] == "unchanged"
    assert v["single"][0] == "n/a"
    assert verdicts(cmp.compare_runs(base, cand, metric="step_time"))["ddp"][0] == "regression"


def test_threshold_is_respected(tmp_path):
    base = load_run(make_run(tmp_path, "base", 1))
    cand = load_run(make_run(tmp_path, "cand", 2, slowdown={"single": 0.15}))
    assert verdicts(cmp.compare_runs(base, cand, 10))["single"][0] == "regression"
    assert verdicts(cmp.compare_runs(base, cand, 20))["single"][0] == "unchanged"


def test_improvement_needs_threshold_and_significance(tmp_path):
    base = load_run(make_run(tmp_path, "base", 1))
    cand = load_run(make_run(tmp_path, "cand", 2, slowdown={"single": -0.2}))
    assert verdicts(cmp.compare_runs(base, cand))["single"] == ("improvement", "step_time")


def test_multi_rank_steps_take_the_slowest_rank_per_launch(tmp_path):
    run = make_run(tmp_path, "r", 1)
    samples = step_samples(run)
    import pandas as pd

    steps = pd.read_csv(run / "steps.csv")
    ddp = steps[steps.case_id.str.startswith("ddp")]
    launches = samples["ddp_resnet-tiny_img32_b8_s-_fp32"]
    assert list(launches) == list(range(LAUNCHES))  # round order
    for k, times in launches.items():
        expected = ddp[ddp.launch == k].groupby("step").step_time_s.max().to_numpy()
        np.testing.assert_allclose(times, expected)
        assert len(expected) == STEPS
    # The run's launch medians are the ones cases.csv recorded.
    loaded = load_run(run)
    cases = pd.read_csv(run / "cases.csv").set_index("case_id")
    for cid in loaded.launches:
        recorded = [float(v) for v in cases.loc[cid, "launch_medians_s"].split(";")]
        np.testing.assert_allclose(list(loaded.launch_medians(cid).values()), recorded,
                                   rtol=1e-5)
        assert loaded.median_s(cid) == pytest.approx(cases.loc[cid, "step_time_s_median"])


def test_cli_exit_codes_and_outputs(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    same = make_run(tmp_path, "same", 2)
    slow = make_run(tmp_path, "slow", 3, slowdown={s: 0.15 for s in BASE_S})
    md, js = tmp_path / "gate.md", tmp_path / "gate.json"
    assert main(["compare", str(base), str(same / "cases.csv")]) == 0
    capsys.readouterr()
    assert main(["compare", str(base), str(slow), "--markdown", str(md), "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 1 regression, 2 unchanged" in out and "no strategy lost speedup" in out
    assert out.count(cmp.METHOD_WELCH) == 1 and "3 vs 3 launches" in out
    assert cmp.METHOD_BOOTSTRAP not in out and "1 launch" not in out
    assert md.read_text().startswith("### parabench regression gate: FAIL")
    assert md.read_text().count(cmp.METHOD_WELCH) == 1
    entries = json.loads(js.read_text())
    names = {e["name"] for e in entries}
    assert "single_resnet-tiny_img32_b8_s-_fp32 throughput" in names
    assert "ddp_resnet-tiny_img32_b8_s-_fp32 speedup over single" in names
    assert all(set(e) >= {"name", "unit", "value", "range"} for e in entries)
    assert all(cmp.METHOD_WELCH in e["extra"] for e in entries)


def test_run_compare_is_the_compare_command_as_a_function(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    slow = make_run(tmp_path, "slow", 3, slowdown={s: 0.15 for s in BASE_S})
    md, js = tmp_path / "gate.md", tmp_path / "gate.json"
    assert run_compare(ComparePlan(base, make_run(tmp_path, "same", 2))) == exit_codes.EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: ")
    assert run_compare(ComparePlan(base, slow, markdown=md, json_path=js)) == (
        exit_codes.EXIT_NOT_OK)
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL: 1 regression, 2 unchanged"
    assert md.read_text().startswith("### parabench regression gate: FAIL") and js.exists()
    assert run_compare(ComparePlan(base, slow, threshold_pct=20)) == exit_codes.EXIT_OK
    # single: n/a; others held
    assert run_compare(ComparePlan(base, slow, metric="speedup")) == exit_codes.EXIT_OK
    md.unlink()
    assert run_compare(ComparePlan(tmp_path / "nowhere", slow, markdown=md)) == (
        exit_codes.EXIT_USAGE)
    assert "does not exist" in capsys.readouterr().err and not md.exists()


def test_a_case_that_ran_before_and_fails_now_fails_the_gate(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    cand = make_run(tmp_path, "cand", 2, status={"mp": "error"})
    assert main(["compare", str(base), str(cand)]) == 1
    assert "broken (candidate status error)" in capsys.readouterr().out


@pytest.mark.parametrize("breakage, message", [
    ("missing", "does not exist"),
    ("schema", "schema version"),
    ("steps", "lacks columns"),
    ("nomatch", "no matching cases"),
    ("ranks", "ranks timed different numbers of steps"),
    ("launch", "without its launch index"),
])
def test_unusable_input_exits_2(tmp_path, capsys, breakage, message):
    base = make_run(tmp_path, "base", 1)
    cand = make_run(tmp_path, "cand", 2, model="resnet18" if breakage == "nomatch" else
                    "resnet-tiny")
    if breakage == "missing":
        cand = tmp_path / "nowhere"
    elif breakage == "schema":
        write_json_atomic(cand / "env.json", {"schema_version": 99, "fingerprint": FINGERPRINT})
    elif breakage == "steps":
        (cand / "steps.csv").write_text("case_id,seconds\nx,1\n")
    elif breakage == "launch":  # a step row with its launch left empty
        lines = (cand / "steps.csv").read_text().splitlines(keepends=True)
        cells = lines[5].split(",")
        lines[5] = ",".join(cells[:2] + [""] + cells[3:])
        (cand / "steps.csv").write_text("".join(lines))
    elif breakage == "ranks":  # ddp's rank 1 lost the last step of its second launch
        lines = (cand / "steps.csv").read_text().splitlines(keepends=True)
        last = max(i for i, ln in enumerate(lines) if ln.split(",")[1:4] == [
            "ddp_resnet-tiny_img32_b8_s-_fp32", "1", "1"])
        (cand / "steps.csv").write_text("".join(lines[:last] + lines[last + 1:]))
    md = tmp_path / "gate.md"
    assert main(["compare", str(base), str(cand), "--markdown", str(md)]) == 2
    assert message in capsys.readouterr().err
    assert not md.exists()


def test_different_hardware_is_refused_unless_allowed(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    cand = make_run(tmp_path, "cand", 2, fingerprint=FINGERPRINT | {"cpu_model": "Other"})
    assert main(["compare", str(base), str(cand)]) == 2
    err = capsys.readouterr().err
    assert "different hardware" in err and "cpu_model: 'Test CPU' vs 'Other'" in err
    assert main(["compare", str(base), str(cand), "--allow-different-hardware"]) == 0
    assert "different hardware: cpu_model" in capsys.readouterr().out


def test_baseline_store_picks_this_hardware_or_says_there_is_none(tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    assert main(["compare", str(store), str(make_run(tmp_path, "first", 3))]) == 2
    assert "make baseline" in capsys.readouterr().err
    saved = save_baseline(make_run(tmp_path, "base", 1), store)
    assert saved.name == fingerprint_id(FINGERPRINT)
    assert main(["compare", str(store), str(make_run(tmp_path, "cand", 2))]) == 0
    other = make_run(tmp_path, "other", 2, fingerprint=FINGERPRINT | {"cpu_cores": 64})
    assert main(["compare", str(store), str(other)]) == 2
    assert "no baseline for this hardware" in capsys.readouterr().err


UPGRADED = VERSIONS | {"torch": "2.15.0", "driver": "575.51.03"}


def test_a_torch_and_driver_upgrade_gets_a_verdict_with_a_note(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    same = make_run(tmp_path, "same", 2, versions=UPGRADED)
    slow = make_run(tmp_path, "slow", 3, versions=UPGRADED,
                    slowdown={s: 0.15 for s in BASE_S})
    assert check_fingerprints(load_run(base), load_run(same), False) == []
    assert software_differences(load_run(base), load_run(same)) == [
        "torch 2.14.1 -> 2.15.0", "driver 570.124.06 -> 575.51.03"]
    md, js = tmp_path / "gate.md", tmp_path / "gate.json"
    assert main(["compare", str(base), str(same)]) == 0
    out = capsys.readouterr().out
    note = next(ln for ln in out.splitlines() if ln.startswith("note: software differs"))
    assert "torch 2.14.1 -> 2.15.0" in note and "driver 570.124.06 -> 575.51.03" in note
    assert out.splitlines()[-1].startswith("PASS: ")
    # The verdict decides the exit code: a torch upgrade that slows everything fails single.
    assert main(["compare", str(base), str(slow), "--markdown", str(md), "--json", str(js)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAIL: 1 regression, 2 unchanged"
    assert "- software differs" in md.read_text() and "torch 2.14.1 -> 2.15.0" in md.read_text()
    extras = [e["extra"] for e in json.loads(js.read_text())]
    assert extras and all("torch 2.14.1 -> 2.15.0" in x and "driver 570.124.06 -> 575.51.03"
                          in x for x in extras)
    assert main(["compare", str(base), str(make_run(tmp_path, "plain", 4))]) == 0
    assert "software differs" not in capsys.readouterr().out


def test_the_store_holds_one_baseline_per_hardware_whatever_the_software(tmp_path, capsys):
    store = tmp_path / "store"
    saved = save_baseline(make_run(tmp_path, "base", 1), store)
    upgraded = make_run(tmp_path, "upgraded", 2, versions=UPGRADED)
    assert resolve_baseline(store, load_run(upgraded), False) == saved
    assert saved.name == fingerprint_id(FINGERPRINT | {"torch": "2.15.0", "driver": "x"})
    assert main(["compare", str(store), str(upgraded)]) == 0
    assert "torch 2.14.1 -> 2.15.0" in capsys.readouterr().out
    # A candidate whose env.json predates hardware-only fingerprints (torch and driver in it)
    old_style = make_run(tmp_path, "old", 3, versions=UPGRADED,
                         fingerprint=FINGERPRINT | {"torch": "2.15.0", "driver": "575.51.03"})
    assert resolve_baseline(store, load_run(old_style), False) == saved
    # A baseline filed under an older id is found through its env.json's hardware.
    moved = saved.rename(store / "0123456789ab")
    assert resolve_baseline(store, load_run(upgraded), False) == moved
    # Other hardware is still refused, in the store and between two run folders.
    other = make_run(tmp_path, "other", 4, versions=UPGRADED,
                     fingerprint=FINGERPRINT | {"cpu_model": "Other CPU"})
    assert main(["compare", str(store), str(other)]) == 2
    assert "no baseline for this hardware" in capsys.readouterr().err
    assert main(["compare", str(moved), str(other)]) == 2
    err = capsys.readouterr().err
    assert "cpu_model: 'Test CPU' vs 'Other CPU'" in err and "torch" not in err
    assert main(["compare", str(moved), str(other), "--allow-different-hardware"]) == 0
    out = capsys.readouterr().out
    assert "different hardware: cpu_model" in out and "torch 2.14.1 -> 2.15.0" in out
    # Storing this hardware's baseline again replaces the one under the older id.
    assert save_baseline(upgraded, store) == saved and not moved.exists()
    assert sorted(p.name for p in store.iterdir()) == [saved.name]


def test_a_run_from_a_busy_machine_is_flagged(tmp_path, capsys):
    base = make_run(tmp_path, "base", 1)
    busy = make_run(tmp_path, "busy", 2, noise=0.4)
    main(["compare", str(base), str(busy)])
    out = capsys.readouterr().out
    assert "candidate ran on a busy machine" in out and "baseline ran on a busy" not in out


def test_the_test_only_slowdown_hook_adds_its_fraction_of_each_step(monkeypatch):
    import time

    from bench_lib.launch import faults

    now = [10.0]  # a fake clock: the step takes 0.4 s, every later reading 1 ms

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    monkeypatch.setattr(time, "perf_counter", clock)
    calls = []

    def step() -> None:
        calls.append(1)
        now[0] += 0.4

    monkeypatch.delenv(faults.INJECT_SLOWDOWN_ENV, raising=False)
    assert faults.with_injected_slowdown(step, []) is step
    monkeypatch.setenv(faults.INJECT_SLOWDOWN_ENV, "0.15")
    start = now[0]
    faults.with_injected_slowdown(step, [])()
    assert calls == [1]
    # 0.4 s of step, then busy work for 15% of it (0.06 s), to within the fake clock's ticks
    assert now[0] - start == pytest.approx(0.4 + 0.06, abs=0.005)
