"""Learning parity: the shared batches, the data, the tolerance and verdict, and a tiny run
of ``python -m bench_lib parity`` end to end."""

from __future__ import annotations

import argparse
import re
import subprocess

import pandas as pd
import pytest
import torch

from bench_lib import cli
from bench_lib.parity import run as parity_run
from bench_lib.parity.data import DIGITS_TEST, digits, loader, teacher
from bench_lib.parity.train import EpochResult
from bench_lib.parity.verdict import Final, judge, tolerance
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS
from bench_lib.sweep.profile import UsageError
from tests.conftest import PYTHON, REPO


@pytest.mark.parametrize("n,batch", [(100, 8), (1437, 32), (63, 32)])
def test_data_parallel_ranks_together_see_singles_batches(n, batch):
    x, y = torch.arange(n).float().unsqueeze(1), torch.arange(n)
    for epoch in (0, 1):
        whole = [set(b[1].tolist()) for b in loader(x, y, batch, 1, 0, seed=3, epoch=epoch)]
        shares = [list(loader(x, y, batch, 2, rank, seed=3, epoch=epoch)) for rank in (0, 1)]
        assert len(whole) == n // batch == len(shares[0]) == len(shares[1])
        for k, together in enumerate(zip(*shares)):
            assert set().union(*(set(b[1].tolist()) for b in together)) == whole[k]
    # Each epoch has its own order.
    again = [b[1].tolist() for b in loader(x, y, batch, 1, 0, seed=3, epoch=0)]
    other = [b[1].tolist() for b in loader(x, y, batch, 1, 0, seed=3, epoch=1)]
    assert again != other


def test_digits_are_split_once_and_shaped_for_the_model():
    small, big = digits((1, 28, 28), seed=0), digits((3, 32, 32), seed=0)
    assert small.x_test.shape == (DIGITS_TEST, 1, 28, 28)
    assert small.x_train.shape == (1797 - DIGITS_TEST, 1, 28, 28)
    assert big.x_test.shape == (DIGITS_TEST, 3, 32, 32)
    assert torch.equal(small.y_test, big.y_test) and small.classes  # the same split
    assert 0 <= float(small.x_train.min()) and float(small.x_train.max()) <= 1
    assert sorted(set(small.y_train.tolist())) == list(range(10))
    assert not torch.equal(digits((1, 28, 28), seed=1).y_test, small.y_test)
    toy = teacher(10, 5, seed=0)
    assert toy.x_train.shape[1:] == (10,) and toy.y_train.shape[1:] == (5,)
    assert not toy.classes


def test_tolerance_and_verdict_by_hand():
    # The largest float32-to-float64 distance over the epochs sets it, not the last one.
    single = [Final(1.0, 0.5), Final(0.5, 0.9)]
    fp64 = [Final(1.0 + 2e-5, 0.5 - 1 / 360), Final(0.5 + 1e-7, 0.9)]
    tol = tolerance(single, fp64, 360)
    assert tol.loss == pytest.approx(2e-4)  # 10 x 2e-5
    assert tol.accuracy == pytest.approx(10 / 360)  # 1 image flipped: 10 allowed
    assert "10 x 1 flipped" in tol.note
    end = single[-1]
    assert judge(Final(0.5 + 1.9e-4, 0.9 - 10 / 360), end, tol).verdict == "match"
    assert judge(Final(0.5 + 2.1e-4, 0.9), end, tol).verdict == "diverged"
    assert judge(Final(0.5, 0.9 - 11 / 360), end, tol).verdict == "diverged"
    # Identical runs give no distance: the floors hold.
    same = tolerance(single, single, 360)
    assert same.loss == pytest.approx(0.5e-5) and same.accuracy == pytest.approx(1 / 360)
    assert tolerance([Final(0.2, None)], [Final(0.2, None)], 256).accuracy is None


def _args(**changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parity_run.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in changes.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("changes,message", [
    ({"models": "resnet18"}, "BatchNorm-free models so far (resnet18 has BatchNorm)"),
    ({"models": "vgg"}, "unknown model 'vgg'; valid: mlp"),
    ({"strategies": "ddp,gpipe"}, "include it"),
    ({"strategies": "single,warp"}, "unknown strategy 'warp'"),
    ({"split_size": 64}, "split size 64 is larger than batch size 32"),
])
def test_bad_parity_plans_are_usage_errors(changes, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parity_run.plan_of(_args(**changes))


def test_a_strategy_that_ends_elsewhere_diverges_and_fails_the_command(
        tmp_path, monkeypatch, cpu_rig):
    ends = {"fp64": 0.30000001, "single": 0.3, "ddp": 0.3000001, "gpipe": 0.3001}

    def fake_launch(spec, workdir, processes):
        key = "fp64" if spec.precision == "fp64" else spec.strategy
        return [EpochResult(0, 1.0, ends[key], 0.9, 0.1)], ""

    monkeypatch.setattr(parity_run, "_launch", fake_launch)
    code = parity_run.command(_args(models="mlp", strategies="single,ddp,gpipe",
                                    out=tmp_path), cpu_rig)
    assert code == 1
    (run_dir,) = run_dirs_in(tmp_path)
    table = pd.read_csv(run_dir / "parity_verdicts.csv")
    assert list(table.columns) == PARITY_VERDICT_COLUMNS
    verdicts = table.set_index("strategy")
    assert verdicts.verdict.to_dict() == {"single": "reference", "ddp": "match",
                                          "gpipe": "diverged"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_tiny_parity_run_matches_single_for_every_runnable_strategy(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [PYTHON, "-m", "bench_lib", "parity", "--rig", "cpu", "--models", "toy,mlp",
         "--strategies", "single,ddp,gpipe,dp", "--epochs", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(out)
    assert proc.stdout.strip() == str(run_dir)
    epochs = pd.read_csv(run_dir / "parity.csv")
    assert list(epochs.columns) == PARITY_COLUMNS
    # Per model: single in float64 (the reference) and each runnable strategy, 2 epochs each.
    runs = epochs.groupby(["model", "strategy", "precision"]).epoch.apply(list).to_dict()
    assert runs == {(m, s, p): [0, 1] for m in ("mlp", "toy")
                    for s, p in [("single", "fp64"), ("single", "fp32"), ("ddp", "fp32"),
                                 ("gpipe", "fp32")]}
    mlp = epochs[epochs.model == "mlp"]
    assert mlp.test_accuracy.notna().all()
    assert epochs[epochs.model == "toy"].test_accuracy.isna().all()
    assert (mlp.groupby("strategy").test_loss.apply(list).map(lambda v: v[1] < v[0])).all()
    verdicts = pd.read_csv(run_dir / "parity_verdicts.csv").set_index(["model", "strategy"])
    for model in ("mlp", "toy"):
        assert verdicts.loc[(model, "single"), "verdict"] == "reference"
        assert verdicts.loc[(model, "ddp"), "verdict"] == "match"
        assert verdicts.loc[(model, "gpipe"), "verdict"] == "match"
        assert verdicts.loc[(model, "dp"), "verdict"] == "unsupported"
        assert "needs CUDA" in verdicts.loc[(model, "dp"), "reason"]


def test_parity_is_a_command(capsys):
    code = cli.main(["parity", "--rig", "cpu", "--models", "resnet50"])
    assert code == cli.EXIT_USAGE
    assert "BatchNorm-free models so far" in capsys.readouterr().err
