"""Learning parity: the shared batches, the data (digits, a user's MNIST / CIFAR-10 folder),
the tolerances and verdicts (BatchNorm statistics included), and tiny runs of ``python -m
bench_lib parity`` end to end."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import threading

import pandas as pd
import pytest
import torch

from bench_lib import commands, exit_codes
from bench_lib.commands.parity import plan_of as parity_plan_of
from bench_lib.commands.parser import build_parser
from bench_lib.parity import check as parity_check
from bench_lib.parity import launch as parity_launch
from bench_lib.parity import train as parity_train
from bench_lib.parity.data import DIGITS_TEST, Split, digits, loader, parity_workload, teacher
from bench_lib.parity.train import EpochResult, merged
from bench_lib.parity.verdict import (
    BATCH,
    MICRO,
    NO_BN,
    RANK,
    Final,
    bn_statistics,
    judge,
    prediction_factor,
    reference_of,
    seeds_tolerance,
    tighter,
    tolerance,
)
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS
from bench_lib.rig import Rig
from bench_lib.strategies import get as get_strategy
from bench_lib.sweep.profile import UsageError
from tests.conftest import in_process


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


def test_parity_trains_resnets_at_32_px_with_ten_classes():
    resnet, mlp, toy = (parity_workload(m, 32) for m in ("resnet-tiny", "mlp", "toy"))
    assert (resnet.input_shape, resnet.num_classes) == ((3, 32, 32), 10)
    assert (mlp.input_shape, mlp.num_classes) == ((1, 28, 28), 10)
    assert (toy.input_shape, toy.num_classes, toy.loss) == ((10,), 5, "mse")


def test_seeds_tolerance_by_hand():
    # Losses 0.10..0.13: s = 0.012910; t(0.995, 3 dof) = 5.8409, x sqrt(2) = 8.2603.
    assert prediction_factor(4) == pytest.approx(8.2603, abs=1e-3)
    finals = [Final(0.10, 0.95), Final(0.12, 0.96), Final(0.11, 0.95), Final(0.13, 0.96)]
    tol = seeds_tolerance(finals, 100_000)
    assert tol.kind == "seeds"
    assert tol.loss == pytest.approx(8.2603 * 0.012910, rel=1e-3)  # 0.1066
    # Accuracies 0.95, 0.96, 0.95, 0.96: s = 0.0057735 (its binomial floor, 3.6428 x
    # sqrt(0.045 x 0.955 / 100,000), is 0.0024).
    assert tol.accuracy == pytest.approx(8.2603 * 0.0057735, rel=1e-3)  # 0.0477
    assert "over 4 seeds" in tol.note
    # Seeds that agree exactly leave the test set's standard error, with the normal z:
    # 2.5758 x sqrt(2) = 3.6428; the accuracy's binomial sqrt(0.05 x 0.95 / 360) = 0.011487.
    assert prediction_factor(0) == pytest.approx(3.6428, abs=1e-3)
    same = seeds_tolerance([Final(0.1, 0.95, 0.3)] + [Final(0.1, 0.95)] * 3, 360)
    assert same.loss == pytest.approx(3.6428 * 0.3 / 360**0.5, rel=1e-3)  # 0.0576
    assert same.accuracy == pytest.approx(3.6428 * 0.011487, rel=1e-3)  # 0.0418
    # Without a spread over the test images, the floor of the loss.
    assert seeds_tolerance([Final(0.1, 0.95)] * 3, 360).loss == pytest.approx(1e-6)
    assert seeds_tolerance([Final(0.2, None), Final(0.3, None)], 256).accuracy is None
    with pytest.raises(ValueError, match="2 or more seeds"):
        seeds_tolerance(finals[:1], 360)


def test_the_same_mathematics_takes_the_tighter_bound():
    rounding = tolerance([Final(0.1, 0.9)], [Final(0.1 + 1e-6, 0.9)], 360)  # loss 1e-5
    seeds = seeds_tolerance([Final(0.10, 0.9), Final(0.11, 0.9)], 360)
    assert tighter(rounding, seeds) is rounding and tighter(seeds, rounding) is rounding
    chaotic = tolerance([Final(0.1, 0.9)], [Final(0.3, 0.8)], 360)  # rounding amplified
    assert tighter(chaotic, seeds) is seeds and tighter(chaotic, None) is chaotic


@pytest.mark.parametrize("name,batch_norm,sync_bn,stats", [
    ("single", True, False, BATCH), ("mp", True, False, BATCH), ("accum", True, False, MICRO),
    ("pipeline", True, False, MICRO), ("gpipe", True, False, MICRO),
    ("1f1b", True, False, MICRO), ("ddp", True, False, RANK), ("fsdp", True, False, RANK),
    ("ddp", True, True, BATCH), ("fsdp", True, True, BATCH), ("gpipe", False, False, NO_BN),
    ("ddp", False, False, NO_BN),
])
def test_what_batch_norm_normalises_over(name, batch_norm, sync_bn, stats):
    assert bn_statistics(get_strategy(name), batch_norm, sync_bn) == stats


def test_dp_normalises_per_device_and_has_no_twin():
    stats = bn_statistics(get_strategy("dp"), True, False)
    assert stats not in (BATCH, MICRO, RANK, NO_BN)
    assert reference_of("dp", stats, ["single", "ddp", "dp"]) == ("single", False)


ALL = ["single", "accum", "gpipe", "ddp", "fsdp", "mp"]


@pytest.mark.parametrize("name,stats,finished,expected", [
    ("gpipe", MICRO, ALL, ("accum", True)),  # the same micro-batches as accum
    ("gpipe", MICRO, ["single", "gpipe"], ("single", False)),  # no accum to compare with
    ("accum", MICRO, ALL, ("single", False)),
    ("fsdp", RANK, ALL, ("ddp", True)),
    ("ddp", RANK, ALL, ("single", False)),
    ("mp", BATCH, ALL, ("single", True)),
    ("ddp", BATCH, ALL, ("single", True)),  # SyncBatchNorm: the whole batch
    ("gpipe", NO_BN, ALL, ("single", True)),
])
def test_each_strategy_is_compared_with_the_first_of_its_statistics(name, stats, finished,
                                                                    expected):
    assert reference_of(name, stats, finished) == expected


def test_rank_zero_holds_the_evaluated_copy():
    a0, a1, b, c = (torch.full((1,), float(v)) for v in range(4))
    state = merged([{"a": a0, "b": b}, {"a": a1, "c": c}])
    assert state["a"] is a0 and state["b"] is b and state["c"] is c


@pytest.mark.parametrize("strategy", ["single", "mp", "pipeline"])
def test_state_survives_a_move_that_replaces_buffers(strategy, monkeypatch, cpu_rig):
    """``Module.to("cuda")`` keeps the parameter objects but replaces every buffer; a dtype
    round trip does the same on a CPU (docs/DESIGN: testing GPU paths without a GPU). The
    rank's state must still map back to the model's names: BatchNorm's running statistics
    included, or the strict ``load_state_dict`` of the evaluation raises."""
    real = get_strategy(strategy)

    def moving_build(model, devices, ctx):
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        before = bn.running_mean
        model.to(torch.float64).to(torch.float32)  # the device move's stand-in
        assert bn.running_mean is not before  # ... replaced the buffer, as .to(cuda) does
        trainer = real.build(model, devices, ctx)
        model.to(torch.float64).to(torch.float32)  # and once more after the build
        return trainer

    monkeypatch.setattr(parity_train.strategies, "get",
                        lambda name: dataclasses.replace(real, build=moving_build))
    x, y = torch.rand(16, 3, 32, 32), torch.arange(16) % 10
    monkeypatch.setattr(parity_train, "dataset", lambda *a: Split(x, y, x[:4], y[:4]))
    spec = parity_train.ParitySpec("resnet-tiny", strategy, cpu_rig, 1, 1, 8, 4, 0.01, 0, 0)
    (epoch,) = parity_train.train(spec, 0)
    assert math.isfinite(epoch.test_loss)


def _args(**changes: object) -> argparse.Namespace:
    args = build_parser().parse_args(["parity"])
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def _command(rig: Rig, **changes: object) -> int:
    """``parity`` run on ``rig`` as its flags changed by ``changes`` ask."""
    args = _args(**changes)
    return parity_check.run_parity(parity_plan_of(args), rig, args.out)


def test_defaults_include_mlp_a_resnet_and_fsdp():
    plan = parity_plan_of(_args())
    assert {"mlp", "resnet-tiny"} <= set(plan.models)
    assert "fsdp" in plan.strategies and plan.seed_runs >= 2


@pytest.mark.parametrize("changes,message", [
    ({"models": "vgg"}, "unknown model 'vgg'; valid: mlp"),
    ({"strategies": "ddp,gpipe"}, "include it"),
    ({"strategies": "single,warp"}, "unknown strategy 'warp'"),
    ({"split_size": 64}, "split size 64 is larger than batch size 32"),
    ({"models": "resnet-tiny", "seed_runs": 1}, "needs single at 2 or more further seeds"),
])
def test_bad_parity_plans_are_usage_errors(changes, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parity_plan_of(_args(**changes))


def test_a_strategy_that_ends_elsewhere_diverges_and_fails_the_command(
        tmp_path, monkeypatch, cpu_rig):
    ends = {"fp64": 0.30000001, "single": 0.3, "ddp": 0.3000001, "gpipe": 0.3001}

    def fake_launch(spec, workdir, processes, server=None):
        key = "fp64" if spec.precision == "fp64" else spec.strategy
        return [EpochResult(0, 1.0, ends[key], 0.9, 0.1)], ""

    monkeypatch.setattr(parity_launch, "launch", fake_launch)
    code = _command(cpu_rig, models="mlp", strategies="single,ddp,gpipe", out=tmp_path)
    assert code == 1
    (run_dir,) = run_dirs_in(tmp_path)
    assert run_dir.name.endswith("_parity")
    assert os.readlink(tmp_path / "latest-parity") == run_dir.name
    table = pd.read_csv(run_dir / "parity_verdicts.csv")
    assert list(table.columns) == PARITY_VERDICT_COLUMNS
    verdicts = table.set_index("strategy")
    assert verdicts.verdict.to_dict() == {"single": "reference", "ddp": "match",
                                          "gpipe": "diverged"}
    # A BatchNorm-free model: no further seeds of single, every strategy against single.
    assert set(pd.read_csv(run_dir / "parity.csv").seed) == {0}
    assert set(verdicts.compared_with.dropna()) == {"single"}
    assert set(verdicts.tolerance_kind.dropna()) == {"rounding"}


def test_batch_norm_strategies_are_judged_against_their_own_statistics(
        tmp_path, monkeypatch, cpu_rig):
    # Rounding tolerance: 10 x 1e-8 < 1e-5 x 0.3 = 3e-6. Seeds tolerance: single ends at
    # 0.30, 0.32, 0.31, 0.33 over seeds 0..3 (s = 0.0129): 8.26 x s = 0.107. The same
    # mathematics takes the tighter, rounding; other statistics the seeds.
    seeds = {0: 0.30, 1: 0.32, 2: 0.31, 3: 0.33}
    ends = {"accum": 0.35, "gpipe": 0.35 + 1e-7, "1f1b": 0.36, "ddp": 0.25,
            "fsdp": 0.25 + 1e-7, "mp": 0.30 + 5e-7}
    calls = []

    def fake_launch(spec, workdir, processes, server=None):
        calls.append((spec.strategy, spec.precision, spec.seed, spec.split_seed))
        if spec.precision == "fp64":
            end = 0.30 + 1e-8
        else:
            end = seeds[spec.seed] if spec.strategy == "single" else ends[spec.strategy]
        accuracy = 0.90 + 0.01 * (spec.seed % 2)
        return [EpochResult(0, 1.0, 0.5, 0.5, 0.1), EpochResult(1, 0.5, end, accuracy, 0.1)], ""

    monkeypatch.setattr(parity_launch, "launch", fake_launch)
    code = _command(cpu_rig, models="resnet-tiny", out=tmp_path,
                    strategies="single,accum,gpipe,1f1b,ddp,fsdp,mp")
    assert code == 1
    assert sorted(c for c in calls if c[0] == "single") == [
        ("single", "fp32", 0, 0), ("single", "fp32", 1, 0), ("single", "fp32", 2, 0),
        ("single", "fp32", 3, 0), ("single", "fp64", 0, 0)]  # one split for every seed
    (run_dir,) = run_dirs_in(tmp_path)
    v = pd.read_csv(run_dir / "parity_verdicts.csv").set_index("strategy")
    got = {s: (r.verdict, r.compared_with, r.tolerance_kind, r.bn_statistics)
           for s, r in v.iterrows() if s != "single"}
    assert got == {
        "accum": ("match", "single", "seeds", MICRO),
        "gpipe": ("match", "accum", "rounding", MICRO),
        # Within single's seed spread, but not what accum computes: a pipelining bug.
        "1f1b": ("diverged", "accum", "rounding", MICRO),
        "ddp": ("match", "single", "seeds", RANK),
        "fsdp": ("match", "ddp", "rounding", RANK),
        "mp": ("match", "single", "rounding", BATCH),
    }
    assert v.loc["accum", "loss_tolerance"] == pytest.approx(8.2603 * 0.012910, rel=1e-3)
    assert v.loc["1f1b", "test_loss_diff"] == pytest.approx(0.01)
    epochs = pd.read_csv(run_dir / "parity.csv")
    assert list(epochs.columns) == PARITY_COLUMNS
    assert sorted(set(epochs[epochs.strategy == "single"].seed)) == [0, 1, 2, 3]


def test_sync_bn_is_unsupported_on_a_cpu_rig_and_moot_without_batch_norm(
        tmp_path, monkeypatch, cpu_rig):
    ran = []

    def fake_launch(spec, workdir, processes, server=None):
        ran.append((spec.model, spec.strategy, spec.sync_bn))
        return [EpochResult(0, 1.0, 0.3, 0.9, 0.1)], ""

    monkeypatch.setattr(parity_launch, "launch", fake_launch)
    code = _command(cpu_rig, models="mlp,resnet-tiny", strategies="single,ddp,fsdp",
                    sync_bn=True, out=tmp_path)
    assert code == 0
    (run_dir,) = run_dirs_in(tmp_path)
    v = pd.read_csv(run_dir / "parity_verdicts.csv").set_index(["model", "strategy"])
    for name in ("ddp", "fsdp"):
        assert v.loc[("resnet-tiny", name), "verdict"] == "unsupported"
        assert "SyncBatchNorm only runs on GPU inputs" in v.loc[("resnet-tiny", name), "reason"]
        assert v.loc[("mlp", name), "verdict"] == "match"  # no BatchNorm to synchronise
    assert not any(sync for _, _, sync in ran)


def test_one_process_runs_go_side_by_side_on_a_cpu_rig(tmp_path, monkeypatch, cpu_rig):
    both = threading.Barrier(2, timeout=60)
    seen = []

    def fake_launch(spec, workdir, processes, server=None):
        if spec.strategy == "single":
            both.wait()  # single in fp64 and in fp32 run at once, or this breaks
        seen.append((spec.strategy, spec.worker, processes))
        return [EpochResult(0, 1.0, 0.3, 0.9, 0.1)], ""

    monkeypatch.setattr(parity_launch, "launch", fake_launch)
    code = _command(cpu_rig, models="mlp", strategies="single,accum,ddp", out=tmp_path)
    assert code == 0
    assert {w for s, w, _ in seen if s == "single"} == {0, 1}  # a worker each
    assert seen[-1] == ("ddp", 0, 2)  # a process group: after them, on every worker


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.integration
def test_a_tiny_parity_run_matches_single_for_every_runnable_strategy(tmp_path, capsys):
    out = tmp_path / "out"
    proc = in_process(capsys, "parity", "--rig", "cpu", "--models", "toy,mlp", "--strategies",
                      "single,ddp,fsdp,gpipe,dp", "--epochs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(out)
    assert proc.stdout.strip() == str(run_dir)
    # Progress on stderr: each model's plan, then a line per run as it ends.
    assert "parity mlp: 5 runs (2 epochs each)" in proc.stderr
    assert "[5/5] mlp_" in proc.stderr and "2 epochs, test loss" in proc.stderr
    epochs = pd.read_csv(run_dir / "parity.csv")
    assert list(epochs.columns) == PARITY_COLUMNS
    # Per model: single in float64 (the reference) and each runnable strategy, 2 epochs each.
    runs = epochs.groupby(["model", "strategy", "precision"]).epoch.apply(list).to_dict()
    assert runs == {(m, s, p): [0, 1] for m in ("mlp", "toy")
                    for s, p in [("single", "fp64"), ("single", "fp32"), ("ddp", "fp32"),
                                 ("fsdp", "fp32"), ("gpipe", "fp32")]}
    mlp = epochs[epochs.model == "mlp"]
    assert mlp.test_accuracy.notna().all()
    assert epochs[epochs.model == "toy"].test_accuracy.isna().all()
    assert (mlp.groupby("strategy").test_loss.apply(list).map(lambda v: v[1] < v[0])).all()
    verdicts = pd.read_csv(run_dir / "parity_verdicts.csv").set_index(["model", "strategy"])
    for model in ("mlp", "toy"):
        assert verdicts.loc[(model, "single"), "verdict"] == "reference"
        for name in ("ddp", "fsdp", "gpipe"):  # fsdp: its shards gathered for the test
            assert verdicts.loc[(model, name), "verdict"] == "match", name
        assert verdicts.loc[(model, "dp"), "verdict"] == "unsupported"
        assert "needs CUDA" in verdicts.loc[(model, "dp"), "reason"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.integration
def test_a_tiny_resnet_parity_run_judges_each_batch_norm_statistics(tmp_path, capsys):
    out = tmp_path / "out"
    proc = in_process(capsys, "parity", "--rig", "cpu", "--models", "resnet-tiny",
                      "--strategies", "single,accum,gpipe,ddp,fsdp,mp", "--epochs", "1",
                      "--seed-runs", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(out)
    v = pd.read_csv(run_dir / "parity_verdicts.csv").set_index("strategy")
    assert v.verdict.to_dict() == {"single": "reference", "accum": "match", "gpipe": "match",
                                   "ddp": "match", "fsdp": "match", "mp": "match"}
    assert v.compared_with.dropna().to_dict() == {"accum": "single", "gpipe": "accum",
                                                  "ddp": "single", "fsdp": "ddp",
                                                  "mp": "single"}
    # It learnt: a tenth is chance on ten classes.
    assert (v.test_accuracy > 0.5).all()


def test_parity_is_a_command(capsys):
    code = commands.main(["parity", "--rig", "cpu", "--models", "resnet9000"])
    assert code == exit_codes.EXIT_USAGE
    assert "unknown model 'resnet9000'" in capsys.readouterr().err
