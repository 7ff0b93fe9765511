"""The same-job gate (``bench_lib.compare.same_job``): round order, pairing, its interval's
coverage on synthetic data, a side's rounds as one run, and the refusals before anything
is measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench_lib.compare import gate as cmp
from bench_lib.compare import same_job as sj
from bench_lib.results.schema import SCHEMA_VERSION

ROW = {"model": "resnet50", "image_size": 64, "batch_size": 16, "precision": "fp32",
       "loss": "ce", "status": "ok"}


def run_of(medians: dict[str, list[float]], status: dict[str, str] | None = None,
           path: str = "x") -> cmp.Run:
    """A run whose case ``cid`` had, in round r, a launch of 5 steps around medians[cid][r]."""
    cases = {cid: dict(ROW, strategy=cid.split("_")[0], case_id=cid,
                       status=(status or {}).get(cid, "ok")) for cid in medians}
    launches = {cid: {r: np.asarray([m * f for f in (0.99, 1.0, 1.0, 1.01, 1.02)])
                      for r, m in enumerate(ms)} for cid, ms in medians.items()}
    return cmp.Run(Path(path), {}, cases, launches)


# ---- round order and pairing ------------------------------------------------------------


def test_rounds_alternate_which_side_goes_first_abba() -> None:
    order = [sj.round_order(r) for r in range(4)]
    assert order == [("base", "head"), ("head", "base"), ("base", "head"), ("head", "base")]
    # B H H B B H H B: each side runs in every position equally often over an even count
    flat = [s for o in order for s in o]
    assert [i for i, s in enumerate(flat) if s == "base"] == [0, 3, 4, 7]


def test_pairing_cancels_round_drift_that_an_unpaired_comparison_cannot() -> None:
    drift = [1.0, 1.25, 0.9, 1.3]  # the machine's state, shared by both sides of a round
    base = run_of({"single_a": [0.2 * d for d in drift], "ddp_a": [0.3 * d for d in drift]})
    head = run_of({"single_a": [0.2 * d * 1.08 for d in drift],
                   "ddp_a": [0.3 * d for d in drift]})
    results = {r.case_id: r for r in sj.judge_cases(base, head, 5.0, "step_time")}
    single = results["single_a"].changes["step_time"]
    assert single.value == pytest.approx(0.08, abs=1e-9)
    assert single.ci_low == pytest.approx(0.08, abs=1e-9)  # no pair-to-pair spread at all
    assert results["single_a"].verdict == "regression"
    assert results["ddp_a"].verdict == "unchanged"
    assert single.method == sj.METHOD_PAIRED and single.n_base == 4
    # the same data unpaired (compare's Welch over launches) cannot call the 8%
    unpaired = cmp.step_time_change(base, head, "single_a", np.random.default_rng(0))
    assert unpaired.ci_low < 0 < unpaired.ci_high


def test_speedup_metric_pairs_the_case_over_its_rounds_single() -> None:
    base = run_of({"single_a": [0.2, 0.22, 0.21], "ddp_a": [0.3, 0.33, 0.315]})
    head = run_of({"single_a": [0.2, 0.22, 0.21], "ddp_a": [0.36, 0.396, 0.378]})
    results = {r.case_id: r for r in sj.judge_cases(base, head, 5.0, "auto")}
    assert results["ddp_a"].by == "speedup"
    assert results["ddp_a"].changes["speedup"].value == pytest.approx(0.2, abs=1e-9)
    assert results["ddp_a"].verdict == "regression"
    assert results["single_a"].by == "step_time" and results["single_a"].verdict == "unchanged"


def test_a_change_below_the_threshold_or_not_clear_of_zero_passes() -> None:
    base = run_of({"single_a": [0.2, 0.2, 0.2, 0.2]})
    small = run_of({"single_a": [0.206, 0.2062, 0.2058, 0.206]})  # +3%, clear of 0
    noisy = run_of({"single_a": [0.3, 0.17, 0.25, 0.19]})  # +13% but all over the place
    assert sj.judge_cases(base, small, 5.0, "step_time")[0].verdict == "unchanged"
    assert sj.judge_cases(base, small, 2.0, "step_time")[0].verdict == "regression"
    noisy_result = sj.judge_cases(base, noisy, 5.0, "step_time")[0]
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
        change = sj.paired_change("step_time", head.tolist(), base.tolist())
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
    head = sj.side_run(Path("head"), rounds)
    assert head.launch_medians("single_a") == {0: 0.2, 1: 0.21, 2: 0.22}
    assert sorted(head.launches["ddp_a"]) == [0, 2]
    assert head.cases["ddp_a"]["status"] == "error"
    assert head.cases["single_a"]["contention"] == "round 3: other processes held 30% of a core"
    base = sj.side_run(Path("base"), [run_of({"single_a": [0.2], "ddp_a": [0.3]})
                                      for _ in range(3)])
    results = {r.case_id: r for r in sj.judge_cases(base, head, 5.0, "step_time")}
    assert results["ddp_a"].verdict == "broken" and "error" in results["ddp_a"].by
    assert cmp.exit_code(list(results.values())) == cmp.EXIT_REGRESSION
    # broken the other way round (failing in the base, fine in the head) is no verdict
    flipped = {r.case_id: r for r in sj.judge_cases(head, base, 5.0, "step_time")}
    assert flipped["ddp_a"].verdict == "n/a"


def test_the_gate_names_the_rounds_whose_gpu_clocks_were_held_back() -> None:
    """#28: compare named throttled cases, the gate only contended ones."""
    rounds = [run_of({"single_a": [0.2], "ddp_a": [0.3]}) for _ in range(3)]
    rounds[0].cases["ddp_a"]["throttled"] = "power cap 40% of the window"
    rounds[2].cases["ddp_a"]["throttled"] = "thermal 15% of the window"
    rounds[1].cases["single_a"]["contention"] = "other processes held 30% of a core"
    head = sj.side_run(Path("head"), rounds)
    assert head.cases["ddp_a"]["throttled"] == ("round 1: power cap 40% of the window; "
                                                "round 3: thermal 15% of the window")
    assert head.cases["single_a"]["contention"] == "round 2: other processes held 30% of a core"
    assert not head.cases["single_a"].get("throttled")
    base = sj.side_run(Path("base"), [run_of({"single_a": [0.2], "ddp_a": [0.3]})
                                      for _ in range(3)])
    notes = sj.gate_notes(sj.judge_cases(base, head, 5.0, "step_time"), base, head)
    (throttled,) = [n for n in notes if "GPU clocks" in n]
    assert throttled.startswith("the head was measured with GPU clocks held back: ddp_a")
    assert "round 1: power cap" in throttled and "round 3: thermal" in throttled
    assert "single_a" not in throttled
    assert not [n for n in sj.gate_notes([], base, base) if "GPU clocks" in n]


def test_each_sides_prediction_error_is_its_rounds_median_and_a_grown_one_is_noted() -> None:
    def rounds(errors: list[float]) -> list[cmp.Run]:
        runs = [run_of({"single_a": [0.2], "ddp_a": [0.3]}) for _ in errors]
        for run, error in zip(runs, errors):
            run.cases["ddp_a"]["prediction_error_pct"] = error
            run.cases["single_a"]["prediction_error_pct"] = ""  # not predicted
        return runs

    base = sj.side_run(Path("base"), rounds([2.0, -3.0, 4.0]))
    head = sj.side_run(Path("head"), rounds([20.0, -18.0, 25.0]))
    assert base.cases["ddp_a"]["prediction_error_pct"] == 2.0
    assert head.cases["ddp_a"]["prediction_error_pct"] == 20.0
    results = sj.judge_cases(base, head, 5.0, "step_time")
    cases = {c["case_id"]: c for c in sj.verdicts_json(results, base, head)}
    assert cases["ddp_a"]["prediction_error_pct"] == {"base": 2.0, "head": 20.0}
    assert cases["single_a"]["prediction_error_pct"] == {"base": None, "head": None}
    (note,) = [n for n in sj.gate_notes(results, base, head) if "prediction" in n]
    assert "ddp_a: +2.0% -> +20.0%" in note and "not of the code measured" in note
    assert not [n for n in sj.gate_notes(results, base, base) if "prediction" in n]


def test_later_rounds_reuse_each_sides_first_calibration_where_it_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's first round left a calibration.json naming its hardware: its later rounds
    pass it to ``run --calibration``; the base's names none (a side older than the flag)."""
    calls: list[tuple[str, list[str]]] = []

    def fake_run(worktree: Path, env: object, python: str, out: Path, profile: str,
                 run_args: list[str]) -> Path:
        calls.append((worktree.name, list(run_args)))
        run = out / "run"
        run.mkdir(parents=True)
        stamp = {"hardware": "abc"} if worktree.name == "head" else {}
        (run / "calibration.json").write_text(json.dumps({**stamp, "calibrations": []}))
        return run

    monkeypatch.setattr(sj, "run_side", fake_run)
    runs, _ = sj.measure({"base": {}, "head": {}}, tmp_path / "gate", tmp_path, profile="ci",
                         rounds=3, run_args=["--timed-steps", "6"], python="python",
                         say=lambda line: None)
    first_head = runs["head"][0] / "calibration.json"
    assert calls == [("base", ["--timed-steps", "6"]), ("head", ["--timed-steps", "6"]),
                     ("head", ["--timed-steps", "6", "--calibration", str(first_head)]),
                     ("base", ["--timed-steps", "6"]), ("base", ["--timed-steps", "6"]),
                     ("head", ["--timed-steps", "6", "--calibration", str(first_head)])]
    assert sj.reusable_calibration(tmp_path / "nowhere") is None
    with pytest.raises(sj.GateError, match="set by the gate"):
        sj.check_run_args(["--calibration", "x"])


# ---- inputs -----------------------------------------------------------------------------


def test_head_env_and_run_flags_are_checked() -> None:
    assert sj.parse_env(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    for bad in ("NOVALUE", "1A=2", "=3", "A B=1"):
        with pytest.raises(sj.GateError, match="NAME=VALUE"):
            sj.parse_env([bad])
    assert sj.check_run_args(["--", "--image-sizes", "96"]) == [*sj.DEFAULT_STEPS,
                                                                "--image-sizes", "96"]
    assert sj.check_run_args(["--timed-steps", "20"]) == ["--timed-steps", "20"]  # theirs
    for bad in (["--launches", "3"], ["--", "--out=x"], ["--profile", "smoke"]):
        with pytest.raises(sj.GateError, match="set by the gate"):
            sj.check_run_args(bad)


def test_a_side_runs_its_own_checkout_without_the_test_hooks() -> None:
    env = sj.side_env(Path("/w/base"), {"X": "1"},
                      {"PATH": "/bin", "PYTHONPATH": "/elsewhere",
                       "PARABENCH_INJECT_SLOWDOWN": "0.2"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/w/base", "/elsewhere"])
    assert "PARABENCH_INJECT_SLOWDOWN" not in env and env["X"] == "1"
    head = sj.side_env(Path("/w/head"), {"PARABENCH_INJECT_SLOWDOWN": "0.1"}, {})
    assert head["PARABENCH_INJECT_SLOWDOWN"] == "0.1" and head["PYTHONPATH"] == "/w/head"


# ---- git: the working tree, refusals ----------------------------------------------------


def git(repo: Path, *args: str) -> str:
    return sj.git(repo, *args, env=dict(os.environ, **sj.GIT_IDENTITY))


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "one")
    return path


def fake_package(schema: int, main: str = "import sys; sys.exit(0)\n") -> dict[str, str]:
    """A bench_lib that imports in a blink: its schema and a ``python -m bench_lib``."""
    return {"bench_lib/__init__.py": "", "bench_lib/__main__.py": main,
            "bench_lib/results/__init__.py": "",
            "bench_lib/results/schema.py": f"SCHEMA_VERSION = {schema}\n"}


@pytest.mark.integration
def test_working_tree_commit_holds_the_edits_and_leaves_the_checkout_alone(tmp_path: Path,
                                                                          ) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "one\n", ".gitignore": "ignored/\n"})
    head = git(repo, "rev-parse", "HEAD")
    assert sj.working_tree_commit(repo) == (head, "")  # clean: HEAD itself
    (repo / "a.txt").write_text("two\n")
    (repo / "new.txt").write_text("new\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_text("x")
    before = git(repo, "status", "--porcelain")
    sha, note = sj.working_tree_commit(repo)
    assert note == f"HEAD {head[:12]} + 2 changed files"
    assert git(repo, "show", f"{sha}:a.txt") == "two"
    assert git(repo, "show", f"{sha}:new.txt") == "new"
    assert "ignored/big.bin" not in git(repo, "ls-tree", "-r", "--name-only", sha)
    assert git(repo, "rev-parse", f"{sha}^") == head
    assert git(repo, "status", "--porcelain") == before  # index and files untouched
    assert git(repo, "rev-parse", "HEAD") == head


def gate_in(repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
            **kwargs: object) -> tuple[int, str]:
    out = tmp_path / "gates"
    args: dict[str, object] = {"base_ref": "HEAD", "out": out, "cwd": repo,
                               "say": lambda line: None}
    code = sj.run_gate(**(args | kwargs))  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert not out.exists(), "a refused gate writes nothing"
    if (repo / ".git").exists():
        assert git(repo, "worktree", "list").count("\n") == 0, "its worktrees are gone"
    return code, err


@pytest.mark.integration
def test_refusals_exit_2_before_anything_runs(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    repo = make_repo(tmp_path / "r", fake_package(SCHEMA_VERSION))
    code, err = gate_in(repo, tmp_path, capsys, base_ref="no-such-branch")
    assert code == 2 and "--base 'no-such-branch' names no commit" in err
    code, err = gate_in(repo, tmp_path, capsys, head_ref="v9")
    assert code == 2 and "--head 'v9' names no commit" in err
    code, err = gate_in(repo, tmp_path, capsys, rounds=1)
    assert code == 2 and "--rounds must be at least 2" in err
    code, err = gate_in(repo, tmp_path, capsys, head_env=["SLOW"])
    assert code == 2 and "NAME=VALUE" in err
    code, err = gate_in(repo, tmp_path, capsys, run_args=["--", "--launches", "5"])
    assert code == 2 and "--launches is set by the gate" in err
    code, err = gate_in(repo, tmp_path, capsys, markdown=tmp_path / "no" / "gate.md")
    assert code == 2 and "--markdown" in err and "does not exist" in err
    plain = tmp_path / "plain"
    plain.mkdir()
    code, err = gate_in(plain, tmp_path, capsys)
    assert code == 2 and "not inside a git checkout" in err


@pytest.mark.integration
def test_an_unmerged_working_tree_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "one\n"})
    git(repo, "checkout", "-q", "-b", "other")
    (repo / "a.txt").write_text("other\n")
    git(repo, "commit", "-qam", "other")
    git(repo, "checkout", "-q", "main")
    (repo / "a.txt").write_text("main\n")
    git(repo, "commit", "-qam", "main")
    subprocess.run(["git", "merge", "-q", "other"], cwd=repo, capture_output=True, check=False)
    code, err = gate_in(repo, tmp_path, capsys)
    assert code == 2 and "unmerged files" in err
    # naming the head as a commit measures no working tree: that refusal does not apply
    assert sj.plan_sides(repo, "HEAD", "HEAD~1", {})["head"].label == "HEAD~1"


@pytest.mark.integration
def test_a_side_that_cannot_be_measured_is_refused_with_its_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = make_repo(tmp_path / "old", fake_package(SCHEMA_VERSION - 1))
    code, err = gate_in(old, tmp_path, capsys)
    assert code == 2 and f"writes results schema {SCHEMA_VERSION - 1}" in err
    none = make_repo(tmp_path / "none", {"README.md": "no package here\n"})
    code, err = gate_in(none, tmp_path, capsys)
    assert code == 2 and "not from its checkout" in err
    refusing = make_repo(tmp_path / "refusing", fake_package(
        SCHEMA_VERSION, "import sys; print('error: unknown profile', file=sys.stderr); "
                        "sys.exit(2)\n"))
    code, err = gate_in(refusing, tmp_path, capsys, profile="nope")
    assert code == 2 and "its run refuses the sweep" in err and "unknown profile" in err


@pytest.mark.integration
def test_a_gate_of_fake_sides_pairs_rounds_and_writes_its_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sides whose ``run`` copies a prepared run folder (the head's, through a variable,
    with single 30% slower): the gate runs them in ABBA rounds, pairs, fails, writes."""
    from tests.test_compare import make_run

    main = ("import os, shutil, sys\n"
            "from pathlib import Path\n"
            "args = sys.argv[1:]\n"
            "if '--dry-run' in args: sys.exit(0)\n"
            "out = Path(args[args.index('--out') + 1])\n"
            "which = os.environ.get('FAKE_SIDE', 'fast')\n"
            "log = Path(os.environ['FAKE_LOG'])\n"
            "log.write_text(log.read_text() + which + ' ')\n"
            "shutil.copytree(os.environ['FAKE_' + which.upper()], out / ('run_' + which))\n")
    repo = make_repo(tmp_path / "r", fake_package(SCHEMA_VERSION, main))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "order.log"))
    (tmp_path / "order.log").write_text("")
    monkeypatch.setenv("FAKE_FAST", str(make_run(tmp_path / "t", "fast", seed=1, launches=1)))
    monkeypatch.setenv("FAKE_SLOW", str(make_run(tmp_path / "t", "slow", seed=1, launches=1,
                                                 slowdown={"single": 0.3})))
    code = sj.run_gate(base_ref="HEAD", head_env=["FAKE_SIDE=slow"], rounds=4,
                       out=tmp_path / "gates", cwd=repo, say=lambda line: None,
                       markdown=tmp_path / "gate.md", json_path=tmp_path / "bench.json")
    printed = capsys.readouterr().out
    assert (tmp_path / "order.log").read_text().split() == [
        "fast", "slow", "slow", "fast", "fast", "slow", "slow", "fast"]
    assert code == cmp.EXIT_REGRESSION and "FAIL: 1 regression, 2 unchanged" in printed
    (gate_dir,) = (tmp_path / "gates").iterdir()
    record = json.loads((gate_dir / "gate.json").read_text())
    verdicts = {c["strategy"]: c for c in record["cases"]}
    assert verdicts["single"]["verdict"] == "regression"
    assert verdicts["single"]["changes"]["step_time"]["value"] == pytest.approx(0.3)
    assert verdicts["single"]["changes"]["step_time"]["rounds"] == 4
    assert verdicts["ddp"]["verdict"] == "unchanged"
    assert [r["side"] for r in record["runs"]][:4] == ["base", "head", "head", "base"]
    assert record["sides"]["head"]["env"] == {"FAKE_SIDE": "slow"}
    assert (gate_dir / "base" / "round-4").is_dir()
    assert (tmp_path / "gate.md").read_text().startswith("### parabench same-job gate: FAIL")
    assert json.loads((tmp_path / "bench.json").read_text())[0]["unit"] == "img/s"
    assert git(repo, "worktree", "list").count("\n") == 0
