"""The workload registry: every model's blocks, cuts, inputs, losses and FLOPs; every model
with every strategy a cpu rig runs (one step each, through the worker's own ``run_rank``);
the cut small models compute the uncut model's gradients; planning, validation and the CLI.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from bench_lib import commands, exit_codes, strategies
from bench_lib.launch import worker
from bench_lib.launch.protocol import CaseOutcome, CaseSpec, RankResult
from bench_lib.measure.flop_peak import AttainablePeak
from bench_lib.measure.flops import train_flops_per_image
from bench_lib.results.read import read_cases, run_dirs_in
from bench_lib.rig import Rig
from bench_lib.rows.rows import case_row
from bench_lib.strategies import BuildContext, Microbatching
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import PROFILE_DIR, Measurement, Profile, UsageError, load_profile
from bench_lib.sweep.refusals import cut_stages
from bench_lib.workloads import (
    MODELS,
    Workload,
    WorkloadError,
    blocks,
    get_model,
    shard_units,
    tutorial_cut,
)
from bench_lib.workloads.models import register, toy
from tests.conftest import REPO, in_process
from tests.dist_harness import run_ranks

CPU = torch.device("cpu")
SMALL = ("toy", "mlp")
# Blocks (stem + residual blocks + head) and the tutorial's cut (stem + layer1..2) of each.
STRUCTURE = {
    "resnet18": (1 + 2 + 2 + 2 + 2 + 1, 1 + 2 + 2, BasicBlock),
    "resnet50": (1 + 3 + 4 + 6 + 3 + 1, 1 + 3 + 4, Bottleneck),
    "resnet101": (1 + 3 + 4 + 23 + 3 + 1, 1 + 3 + 4, Bottleneck),
    "resnet152": (1 + 3 + 8 + 36 + 3 + 1, 1 + 3 + 8, Bottleneck),
    "resnet-tiny": (1 + 1 + 1 + 1 + 1 + 1, 1 + 1 + 1, BasicBlock),
    "toy": (2, 1, None),
    "mlp": (3, 1, None),
}


def test_every_registered_model_is_described_here():
    assert set(STRUCTURE) == set(MODELS)
    for name, spec in MODELS.items():
        assert spec.name == name and spec.description


def test_unknown_and_duplicate_models_name_the_known_ones():
    with pytest.raises(WorkloadError, match="unknown model 'vgg'; valid: mlp, resnet-tiny, "
                                            "resnet101, resnet152, resnet18, resnet50, toy"):
        get_model("vgg")
    with pytest.raises(WorkloadError, match="already registered; known: mlp, "):
        register(MODELS["toy"])


@pytest.mark.parametrize("model", sorted(STRUCTURE))
def test_blocks_and_tutorial_cut_of_every_model(model):
    count, cut, block_type = STRUCTURE[model]
    torch.manual_seed(0)
    net = get_model(model).build(7).eval()  # eval: BatchNorm reads no batch statistics
    bs = blocks(net)
    assert len(bs) == count and tutorial_cut(net) == cut
    assert all(any(True for _ in b.parameters()) for b in bs), "every block trains something"
    if block_type is not None:  # BasicBlock or Bottleneck, one per block of layer1..4
        assert all(type(b) is block_type for b in bs[1:-1])
        assert bs[cut - 1] is net.layer2[-1] and bs[cut] is net.layer3[0]
    x = Workload(model, image_size=32, batch_size=2, num_classes=7).make_batch(2, CPU)[0]
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*bs)(x), net(x), rtol=0, atol=0)


def test_toy_is_the_tutorials_model_and_trains_with_mse_on_random_targets():
    torch.manual_seed(0)
    ours = toy(5)
    torch.manual_seed(0)
    # PyTorch's tutorials' ToyModel: net1 = Linear(10, 10), relu, net2 = Linear(10, 5).
    net1, net2 = nn.Linear(10, 10), nn.Linear(10, 5)
    for a, b in zip(ours.parameters(), [*net1.parameters(), *net2.parameters()], strict=True):
        assert torch.equal(a, b)
    w = Workload("toy", image_size=128, batch_size=4)
    assert (w.image_size, w.num_classes, w.loss, w.input_shape) == (0, 5, "mse", (10,))
    x, y = w.make_batch(4, CPU)
    assert x.shape == (4, 10) and y.shape == (4, 5) and y.is_floating_point()
    out = ours(x)
    assert w.loss_fn()(out, y) == nn.functional.mse_loss(out, y)
    with pytest.raises(WorkloadError, match="toy cannot train with loss 'ce'; valid: mse"):
        Workload("toy", loss="ce")


def test_mlp_and_resnet_defaults():
    w = Workload("mlp", image_size=224, batch_size=4)
    assert (w.image_size, w.num_classes, w.loss, w.input_shape) == (28, 10, "ce", (1, 28, 28))
    x, y = w.make_batch(4, CPU)
    assert w.build_model()(x).shape == (4, 10) and y.dtype == torch.long
    r = Workload()  # the defaults every resnet50 case had before the registry
    assert (r.model, r.image_size, r.num_classes, r.loss) == ("resnet50", 128, 1000, "ce")
    assert r.input_shape == (3, 128, 128)
    with pytest.raises(WorkloadError, match="image size 16 is too small for resnet18"):
        Workload("resnet18", image_size=16)


def test_the_make_batch_of_resnets_is_unchanged():
    # The draw order before the registry: images, then class indices, from one generator.
    g = torch.Generator().manual_seed(3)
    x0, y0 = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 1000, (2,), generator=g)
    x, y = Workload("resnet50", image_size=32).make_batch(2, CPU, seed=3)
    assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.integration
def test_flops_per_sample_of_the_small_models_are_hand_counted():
    # A linear layer of n_in x n_out: forward 2*n_in*n_out per sample, the weight gradient as
    # much again, the input gradient as much again except for the first layer (its input is
    # the data, which needs no gradient). Only matmuls count (the usual MFU rule).
    toy_macs, toy_first = 10 * 10 + 10 * 5, 10 * 10
    mlp_macs, mlp_first = 784 * 128 + 128 * 64 + 64 * 10, 784 * 128
    assert train_flops_per_image("toy", 0) == 2 * (3 * toy_macs - toy_first) == 700
    assert train_flops_per_image("mlp", 28) == 2 * (3 * mlp_macs - mlp_first)
    # The image size does not apply to them: any asked size counts the same model.
    assert train_flops_per_image("mlp", 512) == train_flops_per_image("mlp", 28)
    resnets = [train_flops_per_image(m, 64) for m in ("resnet18", "resnet50", "resnet101",
                                                     "resnet152")]
    assert resnets == sorted(resnets) and resnets[0] > 0


def test_fsdp_units_are_resnet_stages_or_small_model_blocks():
    net = get_model("resnet18").build(10)
    assert shard_units(net) == [net.layer1, net.layer2, net.layer3, net.layer4]
    small = get_model("mlp").build(10)
    assert shard_units(small) == blocks(small) and len(blocks(small)) == 3


# Planning -----------------------------------------------------------------------------------


def test_a_sweep_of_several_models_gives_each_its_rows(cpu_rig):
    profile = Profile(strategies=tuple(sorted(strategies.REGISTRY)),
                      models=("resnet50", "toy", "mlp"), image_sizes=(32, 64),
                      batch_sizes=(8,), split_sizes=(2,))
    cases = expand(profile, cpu_rig)
    assert len({c.case_id for c in cases}) == len(cases)
    sizes = {m: sorted({c.image_size for c in cases if c.model == m}) for m in profile.models}
    assert sizes == {"resnet50": [32, 64], "toy": [0], "mlp": [28]}  # one row for toy, mlp
    assert {c.loss for c in cases if c.model == "toy"} == {"mse"}
    assert {c.loss for c in cases if c.model != "toy"} == {"ce"}
    status = {(c.model, c.strategy): (c.status, c.reason) for c in cases if c.image_size < 64}
    assert status["toy", "dp"][0] == status["mlp", "dp"][0] == "unsupported"
    for name in ("interleaved-1f1b", "interleaved-zb", "zbv"):  # 4 stages on 2 ranks
        assert status["toy", name] == (
            "unsupported", f"{name} on 2 ranks cuts the model into 4 stages; toy has only 2 "
            "blocks to cut")
        assert status["mlp", name][0] == "unsupported" and "only 3 blocks" in status["mlp", name][1]
        assert status["resnet50", name] == (None, "")
    runnable = {s for (m, s), (st, _) in status.items() if m == "toy" and st is None}
    assert runnable == {"single", "ddp", "ddp-1", "fsdp", "mp", "pipeline", "accum", "gpipe",
                        "1f1b"}
    # Each model's cases come after its own single baseline.
    for model in profile.models:
        mine = [c.strategy for c in cases if c.model == model]
        assert mine[0] == "single"


def test_resnet50_cases_are_those_of_the_ci_baseline(cpu_rig):
    # Case ids are what a baseline is matched on: the registry must not change resnet50's.
    (folder,) = [p for p in (REPO / "results" / "baseline").iterdir() if p.is_dir()]
    with (folder / "cases.csv").open() as f:
        baseline = [row["case_id"] for row in csv.DictReader(f)]
    planned = [c.case_id for c in expand(load_profile(PROFILE_DIR / "ci.toml"), cpu_rig)]
    assert sorted(planned) == sorted(baseline)


def test_options_a_model_cannot_use_are_unsupported_with_the_reason():
    gpus = Rig("cuda", 4)
    plain = new_case(gpus, "single", "toy", 64, 8, channels_last=True)
    assert plain.status == "unsupported"
    assert plain.reason == "toy has no convolution: the channels-last memory format does not apply"
    assert new_case(gpus, "single", "resnet18", 64, 8, channels_last=True).status is None
    synced = new_case(gpus, "ddp", "mlp", 64, 8, sync_bn=True)
    assert (synced.status, synced.reason) == (
        "unsupported", "mlp has no BatchNorm: SyncBatchNorm does not apply")
    assert new_case(gpus, "ddp", "resnet18", 64, 8, sync_bn=True).status is None
    # Four GPUs: a 4-stage gpipe cannot cut mlp's 3 blocks, nor 8 zbv stages resnet-tiny's 6.
    assert new_case(gpus, "gpipe", "mlp", 64, 8, split_size=2).status == "unsupported"
    assert new_case(gpus, "gpipe", "resnet18", 64, 8, split_size=2).status is None
    assert "only 6 blocks" in new_case(gpus, "zbv", "resnet-tiny", 64, 8, split_size=2).reason


def test_models_are_validated_before_anything_runs():
    with pytest.raises(UsageError, match="unknown model 'vgg'; valid: mlp, resnet-tiny, "):
        Profile(models=("resnet50", "vgg"))
    # An image size too small for every model it applies to is an error; the small models
    # take none, so it is no error for them alone.
    with pytest.raises(UsageError, match="image size 16 is too small for resnet18: it "
                                         "downsamples by 32"):
        Profile(models=("toy", "resnet18"), image_sizes=(16,))
    assert Profile(models=("toy", "mlp"), image_sizes=(16,)).image_sizes_for("mlp") == (28,)
    # The profile's loss is a classifier's; toy's own mse is not one a profile chooses.
    with pytest.raises(UsageError, match="unknown loss 'mse'; valid: ce, mse-onehot"):
        Profile(loss="mse")
    tutorial = Profile(models=("toy", "mlp", "resnet18"), loss="mse-onehot", batch_sizes=(4,),
                       image_sizes=(32,), strategies=("single",))
    assert {c.model: c.loss for c in expand(tutorial, Rig("cuda", 1))} == {
        "toy": "mse", "mlp": "mse-onehot", "resnet18": "mse-onehot"}


def test_unknown_model_on_the_command_line_exits_2_naming_the_known(tmp_path, capsys):
    out = tmp_path / "out"
    code = commands.main(["run", "--rig", "cpu", "--models", "toy,vgg", "--out", str(out)])
    assert code == exit_codes.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'vgg'; valid: mlp, resnet-tiny, resnet101")
    assert not out.exists()


# Every model with every strategy, through the worker ------------------------------------------

ONE_STEP = Measurement(warmup_steps=0, timed_steps=1, max_time_s=30, case_timeout_s=120,
                       launches=1)


DEEPER = {"resnet101": "resnet50", "resnet152": "resnet50"}
"""Models built of a shallower matrix model's blocks (torchvision's Bottleneck), only more of
them: the strategies that cut the model run for them (their cut and stage placement depend
on its depth); every other strategy treats the model as a whole, and it trains the
shallower one with the same code."""


def _matrix(rig: Rig) -> list[Case]:
    """Every registered model with every strategy (a ``DEEPER`` one with those that cut it),
    tiny: 32 px, batch 4, split 2, and the balanced cut (it profiles every block, so each
    model's blocks are timed too)."""
    return [new_case(rig, name, model, 32, 4, split_size=2, partition="balanced",
                     measurement=ONE_STEP)
            for model in sorted(MODELS) for name in sorted(strategies.REGISTRY)
            if model not in DEEPER or strategies.get(name).uses_partition]


def _run_matrix_rank(rank: int, world_size: int, cases: list[Case], rig: Rig, root: str
                     ) -> dict[str, RankResult]:
    """This rank's part of each case, as the worker runs it (``worker.run_rank``); a lone
    process's case runs on rank 0 only. The first case of each stage count profiles the
    blocks for its balanced cut; later ones reuse that cut, as a case's later launches do
    (``cut``)."""
    import torch.distributed as dist

    results: dict[str, RankResult] = {}
    cuts: dict[int, str] = {}  # stage count -> the balanced cut found for it
    for case in cases:
        if case.status is not None or rank >= case.processes:  # ddp-1: a group of one
            continue
        folder = Path(root) / case.case_id
        folder.mkdir(parents=True, exist_ok=True)
        stages = cut_stages(strategies.get(case.strategy), case.world_size)
        try:
            spec = CaseSpec(case, rig, trace=False, cut=cuts.get(stages, ""))
            results[case.case_id] = worker.run_rank(spec, worker.RankPlace(rank, rank), folder)
            if stages and results[case.case_id].partition:
                cuts.setdefault(stages, results[case.case_id].partition)
        except Exception as e:  # recorded, so that one failure shows every other case too
            results[case.case_id] = RankResult(rank, "error", f"{type(e).__name__}: {e}")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return results


def _outcome(per_rank: list[RankResult]) -> CaseOutcome:
    """The ranks' results as one ok outcome (the runner's combination, for ok ranks)."""
    steps = [max(times) for times in zip(*(r.step_times_s for r in per_rank))]
    return CaseOutcome(
        "ok", step_times_s=steps, rank_step_times_s={r.rank: list(r.step_times_s)
                                                     for r in per_rank},
        peak_mem_mib={k: v for r in per_rank for k, v in r.peak_mem_mib.items()},
        peak_mem_net_mib={k: v for r in per_rank for k, v in r.peak_mem_net_mib.items()},
        peak_mem_source=per_rank[0].peak_mem_source, partition=per_rank[0].partition,
        stop_reason=per_rank[0].stop_reason, warmup_steps=per_rank[0].warmup_steps,
        timed_window_unix_s=per_rank[0].timed_window_unix_s)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.integration
@pytest.mark.parametrize("model", sorted(MODELS))  # apart, so that test workers share them
def test_every_model_trains_with_every_strategy_a_cpu_rig_runs(model, cpu_rig, tmp_path):
    cases = [c for c in _matrix(cpu_rig) if c.model == model]
    refused = {c.strategy: c.reason for c in cases if c.status is not None}
    assert all(refused.values()), "every case that does not run says why"
    assert set(refused) == ({"dp", "interleaved-1f1b", "interleaved-zb", "zbv"}
                            if model in SMALL else set() if model in DEEPER else {"dp"})
    if model in DEEPER:  # block for block the shallower one's, which trains every strategy
        assert STRUCTURE[model][2] is STRUCTURE[DEEPER[model]][2]
        assert {c.strategy for c in cases} == {n for n in strategies.REGISTRY
                                               if strategies.get(n).uses_partition}
    rank0, rank1 = run_ranks(_run_matrix_rank, 2, (cases, cpu_rig, str(tmp_path)),
                             timeout_s=840, group=False)
    peak = AttainablePeak(tflop_s={"fp32": {"0": 0.1, "1": 0.1}})
    for case in (c for c in cases if c.status is None):
        per_rank = [rank0[case.case_id]] + ([rank1[case.case_id]] if case.processes > 1 else [])
        bad = [f"rank {r.rank}: {r.reason}" for r in per_rank if r.status != "ok"]
        assert not bad, f"{case.case_id}: {bad}"
        assert all(len(r.step_times_s) == 1 for r in per_rank), case.case_id
        row = case_row(case, cpu_rig, _outcome(per_rank), attainable_peak=peak)
        assert row["status"] == "ok" and row["step_time_s_median"] > 0
        assert row["flops_per_img"] == train_flops_per_image(case.model, case.image_size) > 0
        assert row["mfu_pct"] is not None and row["mfu_pct"] > 0, case.case_id
        assert row["peak_mem_net_mib_max"] is not None, case.case_id
        if strategies.get(case.strategy).uses_partition:
            # The balanced cut's label names its block indices, inside the model's blocks.
            method, cuts = row["partition"].split(":")
            assert method == "balanced", case.case_id
            assert all(0 < int(c) < STRUCTURE[case.model][0] for c in cuts.split(","))


# The cut small models compute the uncut model's gradients ---------------------------------------

BATCH = 8


def _reference(model_name: str) -> tuple[Workload, nn.Module, torch.Tensor, torch.Tensor]:
    """The workload, its seeded model in float64, and a fixed float64 batch."""
    workload = Workload(model_name, batch_size=BATCH)
    torch.manual_seed(0)
    model = workload.build_model().double()
    x, y = workload.make_batch(BATCH, CPU, seed=1)
    return workload, model, x.double(), (y.double() if y.is_floating_point() else y)


def _reference_grads(model_name: str) -> list[torch.Tensor]:
    workload, model, x, y = _reference(model_name)
    workload.loss_fn()(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _assert_same(grads: dict[int, torch.Tensor], reference: list[torch.Tensor], what: str
                 ) -> None:
    assert sorted(grads) == list(range(len(reference))), f"{what}: every parameter has a grad"
    for i, r in enumerate(reference):
        torch.testing.assert_close(grads[i], r, rtol=1e-9, atol=1e-12,
                                   msg=f"{what}: parameter {i}")


@pytest.mark.parametrize("model", SMALL)
@pytest.mark.parametrize("name,split", [("mp", None), ("pipeline", 3), ("accum", 3)])
def test_one_process_strategies_match_the_uncut_model(model, name, split):
    workload, net, x, y = _reference(model)
    micro = None if split is None else Microbatching.of(BATCH, split)
    trainer = strategies.get(name).build(net, [CPU, CPU], BuildContext(workload, micro))
    trainer.forward_backward(x, y)
    grads = dict(enumerate(p.grad for p in trainer.parameters_in_order()))
    _assert_same(grads, _reference_grads(model), f"{name} {model}")


DISTRIBUTED = [("ddp", None, "tutorial"), ("fsdp", None, "tutorial"),
               ("gpipe", 2, "tutorial"), ("1f1b", 4, "balanced-flops")]


def _distributed_grads(rank: int, world_size: int) -> list[dict[int, torch.Tensor]]:
    torch.set_num_threads(1)
    out = []
    for model in SMALL:
        for name, split, partition in DISTRIBUTED:
            workload, net, x, y = _reference(model)
            index = {id(p): i for i, p in enumerate(net.parameters())}
            micro = None if split is None else Microbatching.of(BATCH, split)
            ctx = BuildContext(workload, micro, rank, world_size, partition=partition)
            trainer = strategies.get(name).build(net, [CPU], ctx)
            if strategies.get(name).data_parallel:  # this rank's half of the batch
                half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
                trainer.forward_backward(x[half], y[half])
                params = trainer.parameters_in_order()
                grads = {i: (p.grad.full_tensor() if name == "fsdp" else p.grad.clone())
                         for i, p in enumerate(params)}
            else:
                trainer.forward_backward(x, y)
                grads = {index[id(p)]: p.grad.clone() for s in trainer.timeline_stages()
                         for p in s.module.parameters()}
            out.append(grads)
    return out


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_distributed_strategies_match_the_uncut_model():
    rank0, rank1 = run_ranks(_distributed_grads, 2)
    configs = [(m, c) for m in SMALL for c in DISTRIBUTED]
    for (model, (name, _, _)), grads0, grads1 in zip(configs, rank0, rank1, strict=True):
        reference = _reference_grads(model)
        if strategies.get(name).data_parallel:  # every rank holds every gradient
            _assert_same(grads0, reference, f"{name} {model} rank 0")
            _assert_same(grads1, reference, f"{name} {model} rank 1")
        else:  # each stage's parameters live on one rank
            assert not set(grads0) & set(grads1), f"{name} {model}: a parameter on both ranks"
            _assert_same(grads0 | grads1, reference, f"{name} {model}")


# The command line -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.integration
def test_a_cli_run_of_the_small_models_writes_ok_rows(tmp_path, capsys):
    out = tmp_path / "out"
    proc = in_process(
        capsys, "run", "--profile", "smoke", "--rig", "cpu", "--models", "toy,mlp",
        "--strategies", "single,ddp,gpipe", "--image-sizes", "64,96", "--batch-sizes", "8",
        "--split-sizes", "4", "--launches", "1", "--warmup-steps", "1", "--timed-steps", "2",
        "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(out)
    cases = read_cases(run_dir).set_index("case_id")
    # One row per strategy for each, whatever the image sizes: toy's input is no image (0),
    # mlp's is 28 px.
    assert sorted(cases.index) == [
        "ddp_mlp_img28_b8_s-_fp32", "ddp_toy_img0_b8_s-_fp32", "gpipe_mlp_img28_b8_s4_fp32",
        "gpipe_toy_img0_b8_s4_fp32", "single_mlp_img28_b8_s-_fp32", "single_toy_img0_b8_s-_fp32"]
    assert (cases.status == "ok").all(), cases.reason.to_dict()
    assert dict(zip(cases.model, cases.loss)) == {"toy": "mse", "mlp": "ce"}
    assert set(cases.flops_per_img) == {700, train_flops_per_image("mlp", 28)}
    assert (cases.peak_mem_net_mib_max.notna()).all()
    gpipe = cases.loc["gpipe_toy_img0_b8_s4_fp32"]
    assert gpipe.partition == "tutorial:1"  # toy's cut, after the ReLU
    ddp = cases.loc["ddp_mlp_img28_b8_s-_fp32"]
    assert ddp.world_size == 2 and ddp.speedup_vs_single > 0
