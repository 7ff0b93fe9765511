"""The command line end to end: a tiny real sweep, and bad input that writes nothing."""

from __future__ import annotations

import json
import os
import subprocess

import pandas as pd
import pytest

from bench_lib import commands, exit_codes
from bench_lib.commands.common import memory_mib
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.results.read import read_cases, run_dirs_in
from bench_lib.results.schema import CASE_COLUMNS
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile, profile_names
from tests.conftest import PYTHON, REPO, in_process

# Pinned to the cpu rig: the facts asserted here (dp unsupported, 2 workers, loopback) are a
# cpu rig's, and on a GPU box the rig would otherwise be detected as cuda.
TINY = ["--rig", "cpu", "--models", "resnet-tiny", "--image-sizes", "32", "--batch-sizes", "4",
        "--warmup-steps", "1", "--timed-steps", "2", "--launches", "1"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "bench_lib", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_run_tiny_sweep_writes_one_row_per_case(tmp_path, capsys):
    store = tmp_path / "store"
    proc = in_process(capsys, "run", "--profile", "smoke", "--strategies", "single,dp,ddp,pipeline",
                 "--split-sizes", "2,4", *TINY, "--launches", "2", "--out",
                 str(tmp_path / "out"), "--report", "--save-baseline", str(store))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(tmp_path / "out")
    assert proc.stdout.strip() == str(run_dir)  # the folder, for a person reading along
    assert run_dir.name.endswith("_run-smoke")  # what made it, and from which profile
    assert os.readlink(tmp_path / "out" / "latest-run") == run_dir.name
    # The post-sweep actions act on the run folder the sweep wrote.
    assert (run_dir / "report.html").is_file() and f"report: {run_dir}" in proc.stderr
    (stored,) = store.iterdir()
    assert f"baseline: {stored}" in proc.stderr
    gated = in_process(capsys, "run", "--profile", "smoke", "--strategies", "single", *TINY,
                  "--out", str(tmp_path / "again"), "--compare-to", str(store))
    (again,) = run_dirs_in(tmp_path / "again")
    assert gated.returncode in (0, 1), gated.stderr  # pass, or a (noisy) regression
    assert "single_resnet-tiny_img32_b4_s-_fp32" in (again / "compare.md").read_text()
    assert json.loads((again / "compare.json").read_text())
    cases = read_cases(run_dir)
    assert list(cases.columns) == CASE_COLUMNS
    by_strategy = cases.groupby("strategy")["status"].apply(list).to_dict()
    assert by_strategy == {"single": ["ok"], "dp": ["unsupported"], "ddp": ["ok"],
                           "pipeline": ["ok", "ok"]}
    assert cases["case_id"].is_unique
    ok = cases[cases.status == "ok"]
    assert (ok.step_time_s_median > 0).all()
    # Equal as written (both from one float); read back, to the last bit only where the
    # CSV parser rounds correctly: pandas 3.0.6's (the first GPU box's) reads a float one
    # unit in the last place off now and then, 3.1's exactly.
    assert ok.throughput_img_s.tolist() == pytest.approx(
        (4 / ok.step_time_s_median).tolist(), rel=1e-12)
    # Two launches each, in rounds: the interval across them, the speedup's paired one.
    assert (ok.launches == 2).all() and (ok.steps_per_launch == "2;2").all()
    assert (ok.step_time_ci_method == "t over 2 launches").all()
    assert (ok.step_time_s_ci_low <= ok.step_time_s_median).all()
    assert (ok.step_time_s_median <= ok.step_time_s_ci_high).all()
    assert (ok.speedup_ci_low <= ok.speedup_vs_single).all()
    assert (ok.speedup_vs_single <= ok.speedup_ci_high).all()
    assert "launch 2/2" in proc.stderr
    assert "CUDA" in cases.loc[cases.strategy == "dp", "reason"].item()
    steps = pd.read_csv(run_dir / "steps.csv")
    assert set(steps.case_id) == set(ok.case_id)
    ddp = steps[steps.case_id.str.startswith("ddp")]
    assert len(ddp) == 2 * 2 * 2  # 2 launches x 2 ranks x 2 steps
    assert sorted(ddp.groupby(["launch", "rank"]).size().tolist()) == [2, 2, 2, 2]
    env = json.loads((run_dir / "env.json").read_text())
    for key in ("torch", "torchvision", "cuda", "cudnn", "nccl", "driver"):
        assert key in env["versions"]
    assert env["cpu_cores"] >= 1 and env["cpu_model"]
    assert env["profile"]["name"] == "smoke" and "--out" in env["command_line"]
    assert {"sha", "dirty"} <= set(env["git"])
    assert "best" in proc.stderr  # the end-of-run summary


@pytest.mark.parametrize(
    "args,message",
    [
        (["--strategies", "single,warp"], "unknown strategy 'warp'; valid: 1f1b, accum, ddp"),
        (["--strategies", "pipeline", "--split-sizes", "16"],
         "split size 16 is larger than every batch size"),
        (["--strategies", "ddp", "--batch-sizes", "3"], "is divisible by ddp's world size 2"),
        (["--image-sizes", "16"], "image size 16 is too small"),
        (["--devices", "64"], "64 devices asked for"),
        (["--profile", "nope"], "unknown profile 'nope'; valid: ci, ddp-knobs, default"),
        (["--models", "vgg"], "unknown model 'vgg'; valid: mlp, resnet-tiny"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code = commands.main(["run", "--profile", "smoke", *TINY, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == exit_codes.EXIT_USAGE == 2, err
    assert message in err
    assert err.startswith("error: ")
    assert not out.exists(), "bad input must not create a results folder"


@pytest.mark.integration
def test_bad_input_through_the_module_entry_point_exits_2_without_a_traceback(tmp_path):
    """What a user's shell sees (the cases above call ``commands.main`` in this process)."""
    out = tmp_path / "out"
    proc = bench("run", "--profile", "smoke", *TINY, "--strategies", "single,warp",
                 "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: unknown strategy 'warp'; valid: 1f1b, accum, ddp")
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.integration
def test_env_command_prints_versions():
    proc = bench("env", timeout=120)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["versions"]["torch"] and env["rig"]["kind"] in ("cpu", "cuda")


def _sweep_flags() -> list:
    return list(commands.build_parser().parse_args(["run"]).sweep_flags)


def test_every_sweep_flag_reaches_the_profile_or_the_rig():
    rig_dests = {"rig", "devices", "threads_per_worker", "gpu_slots"}
    dests = {f.dest for f in _sweep_flags()} - rig_dests - {"profile_flag"}
    assert dests <= set(Profile.keys()), dests - set(Profile.keys())
    # What a profile file can set and the command line cannot (--batch-sizes replaces the
    # per-image-size batches; batch_curve, predict_time, rig_figures and diagnostics are the
    # profile's choice of what to measure besides the cases; split_search too: --split-sizes or
    # --microbatches name the splits instead, which turns it off):
    assert set(Profile.keys()) - dests == {"name", "description", "max_time_s",
                                           "batch_sizes_by_image_size", "batch_curve",
                                           "predict_time", "rig_figures", "diagnostics",
                                           "split_search", "split_search_by_strategy"}


# A value each flag parses; flags not listed take "1".
SAMPLE_VALUES = {"--profile": "smoke", "--rig": "cpu", "--max-memory-per-device": "1GiB",
                 "--strategies": "single", "--loss": "ce", "--precisions": "fp32"}


@pytest.mark.parametrize("flag", [f for f in _sweep_flags()], ids=lambda f: f.flag)
def test_resume_refuses_each_sweep_flag_given_beside_it(tmp_path, capsys, flag):
    value = [SAMPLE_VALUES.get(flag.flag, "1")] if flag.takes_value else []
    code = commands.main(["run", "--resume", str(tmp_path), flag.flag, *value])
    assert code == exit_codes.EXIT_USAGE
    assert f"drop {flag.flag}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "a refused resume writes nothing"


def test_a_count_with_no_split_is_a_skipped_row_with_an_empty_split_size():
    rig = Rig("cpu", 2, 1, (0, 1))
    profile = Profile(strategies=("pipeline",), batch_sizes=(8, 32), split_sizes=(),
                      microbatches=(2, 16))
    cases = {c.case_id: c for c in expand(profile, rig)}
    skipped = cases["pipeline_resnet50_img128_b8_m16_fp32"]
    assert skipped.status == "skipped"
    assert skipped.reason == "16 micro-batches do not fit in batch size 8"
    row = case_row(skipped, rig, CaseOutcome(skipped.status, skipped.reason))
    assert row["split_size"] == "" and row["num_microbatches"] == 16
    runs = cases["pipeline_resnet50_img128_b32_s2_fp32"]  # 16 micro-batches of 2
    assert runs.status is None and runs.num_microbatches == 16
    assert case_row(runs, rig, CaseOutcome("skipped"))["split_size"] == 2


@pytest.mark.parametrize("out", ["/proc/parabench-results", "FILE/sub"])
def test_an_out_folder_that_cannot_be_created_is_a_usage_error(tmp_path, capsys, out):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = out.replace("FILE", str(blocker))
    code = commands.main(["run", "--profile", "smoke", *TINY, "--strategies", "single",
                     "--out", out])
    err = capsys.readouterr().err
    assert code == exit_codes.EXIT_USAGE, err
    assert err.startswith("error: cannot create") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_baseline_command_stores_a_run_and_refuses_a_non_run(tmp_path, capsys):
    code = commands.main(["baseline", str(tmp_path), "--store", str(tmp_path / "store")])
    assert code == exit_codes.EXIT_USAGE and "env.json" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_compare_to_and_save_baseline_are_checked_before_the_sweep(tmp_path, capsys):
    """A baseline path that is not there, a store without this hardware's baseline, and a
    store that cannot be written: exit 2 before any case runs, dry run or not."""
    from bench_lib.results.fingerprint import fingerprint_id
    from bench_lib.results.store import write_json_atomic

    def refused(*args: str) -> str:
        code = commands.main(["run", "--profile", "ci", "--rig", "cpu", "--out",
                         str(tmp_path / "out"), *args])
        err = capsys.readouterr().err
        assert code == 2, err
        assert not (tmp_path / "out").exists()
        return err

    err = refused("--compare-to", str(tmp_path / "baselin"), "--dry-run")
    assert "does not exist" in err and "make baseline" in err and "make gate" in err
    store = tmp_path / "store"
    other = {"rig": "cpu:2x1t", "device_names": ["x"], "cpu_model": "Some Other CPU",
             "cpu_cores": 64}
    (store / fingerprint_id(other)).mkdir(parents=True)
    write_json_atomic(store / fingerprint_id(other) / "env.json", {"fingerprint": other})
    err = refused("--compare-to", str(store), "--dry-run")
    assert "no baseline of this machine's hardware" in err and "make gate" in err
    err = refused("--compare-to", str(store / fingerprint_id(other)))  # no dry run either
    assert "measured on other hardware" in err and "cpu_model" in err
    (tmp_path / "a-file").write_text("")
    err = refused("--save-baseline", str(tmp_path / "a-file" / "store"), "--dry-run")
    assert "--save-baseline" in err and "not a folder this user can write" in err
    # run takes compare's options, with --compare-to only
    err = refused("--threshold-pct", "5", "--dry-run")
    assert "--threshold-pct go with --compare-to" in err
    assert commands.main(["run", "--profile", "ci", "--rig", "cpu", "--dry-run", "--compare-to",
                     str(store), "--allow-different-hardware", "--threshold-pct", "5"]) == 0


def test_a_memory_size_without_its_unit_is_refused(capsys):
    for bare in ("12", "0.5"):
        with pytest.raises(SystemExit) as e:
            commands.main(["run", "--dry-run", "--max-memory-per-device", bare])
        assert e.value.code == 2
        assert f"give the size's unit: {bare}GiB or {bare}MiB" in capsys.readouterr().err
    assert memory_mib("12GiB") == 12 * 1024 and memory_mib("512m") == 512


def test_version_and_the_profiles_command(capsys):
    with pytest.raises(SystemExit) as e:
        commands.main(["--version"])
    assert e.value.code == 0
    from bench_lib import __version__

    assert capsys.readouterr().out.strip() == f"parabench {__version__}"
    assert commands.main(["profiles", "--rig", "cpu"]) == exit_codes.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("profile") and "default-cpu" in lines[0]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert set(by_name) == {n for n in profile_names() if n != "default"}
    assert "the CI regression gates" in by_name["ci"]
    assert by_name["ci"].split()[1] == "4"  # single, ddp, mp, pipeline
    # The GPU default is planned on GPUs, not estimated as hours of CPU workers.
    assert "(planned on cuda:2) what `make bench` runs on GPUs" in by_name["default-cuda"]
    assert "(planned" not in by_name["default-cpu"]


@pytest.mark.parametrize(("argv", "near"), [
    (["run", "--strategy", "ddp"], "--strategies"),
    (["run", "--image-size", "64"], "--image-sizes"),  # no abbreviation taken silently
    (["gate", "--base", "HEAD", "--treshold-pct", "5"], "--threshold-pct"),
    (["run", "--batch-size", "32"], "--batch-sizes"),  # the old singular names
    (["tune", "--case-timeout", "60"], "--case-timeout-s"),
    (["distance", "--dtype", "fp64"], "--precision"),
])
def test_an_unknown_flag_gets_its_commands_usage_and_the_nearest_flag(argv, near, capsys):
    with pytest.raises(SystemExit) as e:
        commands.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: python -m bench_lib {argv[0]} ")
    assert f"unrecognized arguments: {argv[-2]}" in err and f"(did you mean {near}?)" in err


def test_run_help_shows_the_profile_in_force_examples_and_exit_codes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse folds help lines at the terminal's width
    for argv, name, batches in ((["run", "--rig", "cpu", "--help"], "default-cpu", "16"),
                                (["run", "--profile", "smoke", "--rig", "cpu", "--help"],
                                 "smoke", "8")):
        with pytest.raises(SystemExit) as e:
            commands.main(argv)
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse folds lines anywhere
        assert f"global batch sizes, comma-separated (profile {name}: {batches})" in text
        assert "examples: python -m bench_lib run --profile smoke" in text
        assert "exit codes: 0 success" in text and "2 bad input: nothing was run" in text
    # The reference page names no machine's profile.
    text = " ".join(commands.build_parser().format_help().split())
    run_help = " ".join(commands.build_parser()._subparsers._group_actions[0]  # noqa: SLF001
                        .choices["run"].format_help().split())
    assert "examples:" in text and "(default: the profile's)" in run_help


def test_every_help_example_parses():
    """The examples in each command's --help are commands the parser takes as they stand."""
    import shlex

    from bench_lib.commands.parser import COMMANDS

    parser = commands.build_parser()
    for name, module in COMMANDS.items():
        lines = [line.split("#")[0] for line in module.EXAMPLES.splitlines()]
        assert lines, name
        for line in lines:
            words = shlex.split(line)
            assert words[:3] == ["python", "-m", "bench_lib"] and words[3] == name, line
            parser.parse_args(words[3:])  # exits 2 on an unknown flag or a bad value


@pytest.mark.parametrize(("argv", "shows"), [
    (["parity", "--dry-run", "--models", "mlp,resnet-tiny", "--strategies", "single,dp,ddp"],
     ["mlp_single_fp64", "resnet-tiny_single_fp32_s3", "dp", "unsupported",
      "9 training runs of 5 epochs on rig cpu:2x1t"]),
    (["distance", "--dry-run", "--layers", "64x64x3x3,512x512x3x3", "--launches", "2"],
     ["split_64x64x3x3_fp32", "loop_512x512x3x3_fp32", "skipped",
      "6 cases (5 to run, 2 launches each) on rig cpu:2x1t"]),
])
def test_parity_and_distance_dry_runs_plan_and_write_nothing(argv, shows, tmp_path, capsys):
    out = tmp_path / "results"
    code = commands.main([*argv, "--rig", "cpu", "--devices", "2", "--threads-per-worker",
                          "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == exit_codes.EXIT_OK
    for words in shows:
        assert words in text, (words, text)
    assert not out.exists()
