"""The same-job gate (``bench_lib.gate``): round order, a side's reused calibration, its
inputs, its git, and the refusals before anything is measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench_lib import exit_codes
from bench_lib.gate import plan, rounds, sides, worktrees
from bench_lib.gate.job import run_gate
from bench_lib.gate.plan import GatePlan
from bench_lib.results.schema import SCHEMA_VERSION

# ---- rounds ---------------------------------------------------------------------------


def test_rounds_alternate_which_side_goes_first_abba() -> None:
    order = [rounds.sides_order(r) for r in range(4)]
    assert order == [("base", "head"), ("head", "base"), ("base", "head"), ("head", "base")]
    # B H H B B H H B: each side runs in every position equally often over an even count
    flat = [s for o in order for s in o]
    assert [i for i, s in enumerate(flat) if s == "base"] == [0, 3, 4, 7]


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

    monkeypatch.setattr(rounds, "run_side", fake_run)
    runs, _ = rounds.measure({"base": {}, "head": {}}, tmp_path / "gate", tmp_path,
                             profile="ci", rounds=3, run_args=["--timed-steps", "6"],
                             python="python", say=lambda line: None)
    first_head = runs["head"][0] / "calibration.json"
    assert calls == [("base", ["--timed-steps", "6"]), ("head", ["--timed-steps", "6"]),
                     ("head", ["--timed-steps", "6", "--calibration", str(first_head)]),
                     ("base", ["--timed-steps", "6"]), ("base", ["--timed-steps", "6"]),
                     ("head", ["--timed-steps", "6", "--calibration", str(first_head)])]
    assert rounds.reusable_calibration(tmp_path / "nowhere") is None
    with pytest.raises(plan.GateError, match="set by the gate"):
        plan.check_run_args(["--calibration", "x"])


class FakeSide:
    """A side's sweep as ``sides.start_side`` returns it, already written."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.proc = self  # ``rounds`` asks its process whether it ended

    def poll(self) -> int | None:
        return None

    def finish(self) -> Path:
        return self.run

    def stop(self) -> None:
        raise AssertionError("nothing failed")


def test_together_both_sides_run_at_once_sharing_a_rounds_turns_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round gives both sides one folder of its own and their side names; in the first
    round the head starts only once a rank of the base waits there (each calibrates
    alone); later rounds start both at once and reuse each side's calibration."""
    import threading
    import time

    started: list[tuple[str, int, dict[str, str], list[str], bool]] = []

    def fake_start(worktree: Path, env: dict[str, str], python: str, out: Path,
                   profile: str, run_args: list[str]) -> FakeSide:
        folder = Path(env["PARABENCH_TURNS_DIR"])
        r = int(out.name.split("-")[1])
        started.append((worktree.name, r, env, list(run_args), any(folder.iterdir())))
        if worktree.name == "base" and r == 1:  # its first rank arrives a moment later
            threading.Timer(0.3, (folder / "x.sock").touch).start()
        run = out / "run"
        run.mkdir(parents=True)
        (run / "calibration.json").write_text(json.dumps({"hardware": "abc"}))
        return FakeSide(run)

    monkeypatch.setattr(rounds, "start_side", fake_start)
    t0 = time.monotonic()
    runs, record = rounds.measure({"base": {"A": "1"}, "head": {"A": "2"}},
                                  tmp_path / "gate", tmp_path, profile="ci", rounds=2,
                                  run_args=[], python="python", say=lambda line: None,
                                  together=True)
    assert time.monotonic() - t0 < 10
    assert [(name, r) for name, r, *_ in started] == [("base", 1), ("head", 1), ("base", 2),
                                                     ("head", 2)]
    (_, _, b1, _, _), (_, _, h1, _, head_saw_base), (_, _, b2, args2, _), _ = started
    assert head_saw_base  # round 1: the head started once the base's rank waited
    assert b1["PARABENCH_TURNS_DIR"] == h1["PARABENCH_TURNS_DIR"] != b2["PARABENCH_TURNS_DIR"]
    assert (b1["PARABENCH_TURNS_SIDE"], h1["PARABENCH_TURNS_SIDE"]) == ("base", "head")
    assert (b1["A"], h1["A"]) == ("1", "2")
    assert args2 == ["--calibration", str(runs["base"][0] / "calibration.json")]
    assert not Path(b1["PARABENCH_TURNS_DIR"]).exists()  # each round's folder removed
    assert [(x["side"], x["round"]) for x in record] == [("base", 1), ("head", 1),
                                                        ("base", 2), ("head", 2)]


# ---- inputs -----------------------------------------------------------------------------


def test_head_env_and_run_flags_are_checked() -> None:
    assert plan.parse_env(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    for bad in ("NOVALUE", "1A=2", "=3", "A B=1"):
        with pytest.raises(plan.GateError, match="NAME=VALUE"):
            plan.parse_env([bad])
    assert plan.check_run_args(["--", "--image-sizes", "96"]) == [*plan.DEFAULT_STEPS,
                                                                  "--image-sizes", "96"]
    assert plan.check_run_args(["--timed-steps", "20"]) == ["--timed-steps", "20"]  # theirs
    for bad in (["--launches", "3"], ["--", "--out=x"], ["--profile", "smoke"]):
        with pytest.raises(plan.GateError, match="set by the gate"):
            plan.check_run_args(bad)


def test_a_side_runs_its_own_checkout_without_the_test_hooks() -> None:
    env = sides.side_env(Path("/w/base"), {"X": "1"},
                         {"PATH": "/bin", "PYTHONPATH": "/elsewhere",
                          "PARABENCH_INJECT_SLOWDOWN": "0.2"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/w/base", "/elsewhere"])
    assert "PARABENCH_INJECT_SLOWDOWN" not in env and env["X"] == "1"
    head = sides.side_env(Path("/w/head"), {"PARABENCH_INJECT_SLOWDOWN": "0.1"}, {})
    assert head["PARABENCH_INJECT_SLOWDOWN"] == "0.1" and head["PYTHONPATH"] == "/w/head"


# ---- git: the working tree, refusals ----------------------------------------------------


def git(repo: Path, *args: str) -> str:
    return worktrees.git(repo, *args, env=dict(os.environ, **worktrees.GIT_IDENTITY))


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "one")
    return path


def fake_package(schema: int, main: str = "import sys; sys.exit(0)\n",
                 init: str = "") -> dict[str, str]:
    """A bench_lib that imports in a blink: its schema and a ``python -m bench_lib``."""
    return {"bench_lib/__init__.py": init, "bench_lib/__main__.py": main,
            "bench_lib/results/__init__.py": "",
            "bench_lib/results/schema.py": f"SCHEMA_VERSION = {schema}\n"}


@pytest.mark.integration
def test_working_tree_commit_holds_the_edits_and_leaves_the_checkout_alone(tmp_path: Path,
                                                                          ) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "one\n", ".gitignore": "ignored/\n"})
    head = git(repo, "rev-parse", "HEAD")
    assert worktrees.working_tree_commit(repo) == (head, "")  # clean: HEAD itself
    (repo / "a.txt").write_text("two\n")
    (repo / "new.txt").write_text("new\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_text("x")
    before = git(repo, "status", "--porcelain")
    sha, note = worktrees.working_tree_commit(repo)
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
    args: dict[str, object] = {"base_ref": "HEAD", "out": out}
    code = run_gate(GatePlan(**(args | kwargs)), cwd=repo,  # type: ignore[arg-type]
                    say=lambda line: None)
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
    code, err = gate_in(repo, tmp_path, capsys, head_env=("SLOW",))
    assert code == 2 and "NAME=VALUE" in err
    code, err = gate_in(repo, tmp_path, capsys, run_args=("--", "--launches", "5"))
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
    assert sides.plan_sides(repo, "HEAD", "HEAD~1", {})["head"].label == "HEAD~1"


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
    code = run_gate(GatePlan(base_ref="HEAD", head_env=("FAKE_SIDE=slow",), rounds=4,
                             out=tmp_path / "gates", markdown=tmp_path / "gate.md",
                             json_path=tmp_path / "bench.json"),
                    cwd=repo, say=lambda line: None)
    printed = capsys.readouterr().out
    assert (tmp_path / "order.log").read_text().split() == [
        "fast", "slow", "slow", "fast", "fast", "slow", "slow", "fast"]
    assert code == exit_codes.EXIT_NOT_OK and "FAIL: 1 regression, 2 unchanged" in printed
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


@pytest.mark.integration
def test_sides_that_can_take_turns_run_at_once_unless_asked_apart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides' packages say ``TAKES_TURNS``: each round runs them at once, each told
    its side and the round's turns folder; ``--apart`` runs them one after the other."""
    from tests.test_compare import make_run

    main = ("import os, shutil, sys\n"
            "from pathlib import Path\n"
            "args = sys.argv[1:]\n"
            "if '--dry-run' in args: sys.exit(0)\n"
            "out = Path(args[args.index('--out') + 1])\n"
            "log = Path(os.environ['FAKE_LOG'])\n"
            "with log.open('a') as f:\n"
            "    f.write(os.environ.get('PARABENCH_TURNS_SIDE', '-') + ' ')\n"
            "shutil.copytree(os.environ['FAKE_RUN'], out / 'run')\n")
    repo = make_repo(tmp_path / "r", fake_package(SCHEMA_VERSION, main, "TAKES_TURNS = 1\n"))
    log = tmp_path / "sides.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_RUN", str(make_run(tmp_path / "t", "fast", seed=1, launches=1)))
    for apart in (False, True):
        log.write_text("")
        out = tmp_path / f"gates-{apart}"
        code = run_gate(GatePlan(base_ref="HEAD", rounds=2, out=out, apart=apart),
                        cwd=repo, say=lambda line: None)
        assert code == 0
        (gate_dir,) = out.iterdir()
        record = json.loads((gate_dir / "gate.json").read_text())
        assert record["together"] is not apart
        told = log.read_text().split()
        assert sorted(told) == (["-"] * 4 if apart else ["base", "base", "head", "head"])
    capsys.readouterr()
