"""The command line end to end: a tiny real sweep, and bad input that writes nothing."""

from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest

from bench_lib.results import CASE_COLUMNS, read_cases
from tests.conftest import PYTHON, REPO

TINY = ["--models", "resnet-tiny", "--image-sizes", "32", "--batch-size", "4",
        "--warmup-steps", "1", "--timed-steps", "2"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "bench_lib", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_run_tiny_sweep_writes_one_row_per_case(tmp_path):
    proc = bench("run", "--profile", "smoke", "--strategies", "single,dp,ddp,pipeline",
                 "--split-sizes", "2,4", *TINY, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / proc.stdout.strip().splitlines()[-1].split("/")[-1]
    assert run_dir.is_dir()
    cases = read_cases(run_dir)
    assert list(cases.columns) == CASE_COLUMNS
    by_strategy = cases.groupby("strategy")["status"].apply(list).to_dict()
    assert by_strategy == {"single": ["ok"], "dp": ["unsupported"], "ddp": ["ok"],
                           "pipeline": ["ok", "ok"]}
    assert cases["case_id"].is_unique
    ok = cases[cases.status == "ok"]
    assert (ok.step_time_s_median > 0).all()
    assert (ok.throughput_img_s == 4 / ok.step_time_s_median).all()
    assert "CUDA" in cases.loc[cases.strategy == "dp", "reason"].item()
    steps = pd.read_csv(run_dir / "steps.csv")
    assert set(steps.case_id) == set(ok.case_id)
    assert len(steps[steps.case_id.str.startswith("ddp")]) == 2 * 2  # 2 ranks x 2 steps
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
        (["--strategies", "ddp", "--batch-size", "3"], "is divisible by ddp's world size 2"),
        (["--image-sizes", "16"], "image size 16 is too small"),
        (["--devices", "64"], "64 devices asked for"),
        (["--profile", "nope"], "unknown profile 'nope'; valid: ci, default"),
        (["--models", "vgg"], "unknown model 'vgg'; valid: resnet-tiny"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "out"
    base = ["run", "--profile", "smoke", *TINY]
    proc = bench(*base, *args, "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.startswith("error: ")
    assert not out.exists(), "bad input must not create a results folder"


def test_env_command_prints_versions():
    proc = bench("env", timeout=120)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["versions"]["torch"] and env["rig"]["kind"] in ("cpu", "cuda")
