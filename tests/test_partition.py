"""Partitions: min-max cut points, the tutorial/balanced choices, and their sweep options."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench_lib import commands, exit_codes
from bench_lib.rig import Rig
from bench_lib.strategies import partition
from bench_lib.strategies.partition import (
    PARTITIONS,
    Partition,
    choose,
    min_max_cuts,
    min_max_rank_cuts,
    rank_loads,
)
from bench_lib.strategies.schedules import stage_indices, stage_placement
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile, UsageError
from bench_lib.workloads import Workload, WorkloadError, blocks, tutorial_cut

CPU = torch.device("cpu")


def _brute_force_best(costs: list[float], stages: int) -> float:
    """The least possible slowest stage, by trying every cut."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def _slowest(costs: list[float], cuts: list[int]) -> float:
    return max(Partition("x", tuple(cuts), tuple(costs)).stage_costs())


@pytest.mark.parametrize("costs,stages,cuts", [
    ([1, 2, 3, 4, 5], 2, [3]),        # 6 | 9 beats 10 | 5
    ([1, 2, 3, 4, 5], 3, [3, 4]),     # 6 | 4 | 5
    ([1] * 6, 3, [2, 4]),
    ([9, 1, 1, 1], 2, [1]),           # one heavy block is a stage of its own
    ([5, 5], 1, []),
])
def test_min_max_cuts_hand_computed(costs, stages, cuts):
    assert min_max_cuts(costs, stages) == cuts


def test_min_max_cuts_is_optimal_on_random_costs():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        costs = (torch.rand(9, generator=g) * 10).tolist()
        for stages in (2, 3, 4):
            cuts = min_max_cuts(costs, stages)
            assert len(cuts) == stages - 1 and cuts == sorted(set(cuts))
            assert _slowest(costs, cuts) == pytest.approx(_brute_force_best(costs, stages))


def test_min_max_cuts_rejects_more_stages_than_blocks():
    with pytest.raises(WorkloadError, match="cannot cut 3 blocks into 4"):
        min_max_cuts([1, 1, 1], 4)


def test_partition_label_and_stage_costs():
    p = Partition("balanced", (2, 5), (1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
    assert p.label == "balanced:2,5"
    assert p.stage_costs() == [3.0, 12.0, 6.0]
    assert Partition("tutorial", (8,)).stage_costs() == []


def _tiny() -> tuple[Workload, torch.nn.Module]:
    workload = Workload("resnet-tiny", image_size=32, batch_size=4, num_classes=10)
    torch.manual_seed(0)
    return workload, workload.build_model()


def test_tutorial_partition_is_the_tutorials_cut():
    workload, model = _tiny()
    p = choose("tutorial", model, 2, workload, 2, CPU)
    assert p.cuts == (tutorial_cut(model),) == (3,)
    assert p.label == "tutorial:3"


@pytest.mark.parametrize("name", ["balanced", "balanced-flops"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balanced_partitions_minimise_the_slowest_stage(name, stages):
    workload, model = _tiny()
    p = choose(name, model, stages, workload, 2, CPU)
    assert len(p.block_costs) == len(blocks(model)) and all(c > 0 for c in p.block_costs)
    assert len(p.cuts) == stages - 1
    assert _slowest(list(p.block_costs), list(p.cuts)) == pytest.approx(
        _brute_force_best(list(p.block_costs), stages))


def test_a_chosen_cuts_label_is_reused_without_profiling(monkeypatch):
    workload, model = _tiny()
    first = choose("balanced", model, 3, workload, 2, CPU)
    monkeypatch.setattr("bench_lib.strategies.partition.block_costs",
                        lambda *a, **k: pytest.fail("a given cut must not be profiled"))
    again = choose(first.label, model, 3, workload, 2, CPU)
    assert again.label == first.label and again.block_costs == ()
    for bad, why in (("balanced:2", "does not make 3 stages"), ("balanced:4,2", "does not make"),
                     ("balanced:a,b", "bad cut"), ("even:2,4", "unknown partition 'even'")):
        with pytest.raises(WorkloadError, match=why):
            choose(bad, model, 3, workload, 2, CPU)


def test_flop_costs_are_deterministic_and_grow_with_micro_batch():
    workload, model = _tiny()
    a = choose("balanced-flops", model, 2, workload, 2, CPU)
    b = choose("balanced-flops", model, 2, workload, 2, CPU)
    c = choose("balanced-flops", model, 2, workload, 4, CPU)
    assert a == b
    assert c.block_costs == pytest.approx([2 * x for x in a.block_costs])


def test_unknown_partition_names_the_valid_ones():
    workload, model = _tiny()
    with pytest.raises(WorkloadError, match="unknown partition 'even'; valid: tutorial"):
        choose("even", model, 2, workload, 2, CPU)
    with pytest.raises(UsageError, match="unknown partition 'even'"):
        Profile(partitions=("even",))


def test_sweep_expands_partitions_and_options_into_unique_cases(cpu_rig: Rig):
    profile = Profile(strategies=("single", "1f1b", "mp", "accum", "ddp"), split_sizes=(2, 3),
                      batch_sizes=(8,), partitions=PARTITIONS, channels_last=True, sync_bn=True)
    cases = expand(profile, cpu_rig)
    ids = [c.case_id for c in cases]
    assert len(ids) == len(set(ids))
    assert {c.partition for c in cases if c.strategy == "1f1b"} == set(PARTITIONS)
    assert {c.partition for c in cases if c.strategy in ("single", "accum", "ddp")} == {None}
    assert all(c.channels_last and c.case_id.endswith(("_cl", "_syncbn")) for c in cases)
    odd = [c for c in cases if c.strategy == "1f1b" and c.split_size == 3]
    assert odd and all(c.status == "skipped" and "equal micro-batches" in c.reason for c in odd)
    (ddp,) = [c for c in cases if c.strategy == "ddp"]
    assert ddp.sync_bn and ddp.status == "unsupported" and "SyncBatchNorm" in ddp.reason
    assert not any(c.sync_bn for c in cases if c.strategy != "ddp")
    (balanced,) = [c for c in cases if c.strategy == "mp" and c.partition == "balanced"]
    assert balanced.case_id == "mp_resnet50_img128_b8_s-_fp32_pbalanced_cl"


def test_cli_rejects_an_unknown_partition(tmp_path, capsys):
    code = commands.main(["run", "--profile", "smoke", "--rig", "cpu", "--partitions", "even",
                     "--out", str(tmp_path)])
    assert code == exit_codes.EXIT_USAGE
    assert "unknown partition 'even'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# Per-block costs like ResNet50's 18 blocks at 64 px (stem, 16 bottlenecks, head): counted
# FLOPs in % of the total, and times (ms) measured on a 2-core CPU rig.
RESNET50_FLOPS = [1.9, 5.7, 5.4, 5.4, 9.1, 5.4, 5.4, 5.4, 9.1, 5.4, 5.4, 5.4, 5.4, 5.4, 9.1,
                  5.4, 5.4, 0.6]
RESNET50_TIMES = [4.5, 6.0, 5.3, 4.9, 8.8, 4.5, 4.4, 4.5, 11.8, 7.1, 6.8, 6.5, 7.3, 5.9, 46.9,
                  27.1, 20.6, 2.5]
LOOP, V = [0, 1, 0, 1], [0, 1, 1, 0]  # interleaved-* and zbv on 2 ranks: rank of each stage


def _rank_worst(costs: list[float], cuts, placement) -> float:
    return max(rank_loads(Partition("x", tuple(cuts), tuple(costs)).stage_costs(), placement))


def _brute_force_rank_best(costs: list[float], placement: list[int]) -> float:
    """The least possible load of the most loaded rank, by trying every cut."""
    return min(_rank_worst(costs, cuts, placement)
               for cuts in itertools.combinations(range(1, len(costs)), len(placement) - 1))


def test_stage_placement_inverts_stage_indices():
    for world, spr, style in [(2, 1, "loop"), (2, 2, "loop"), (2, 2, "v"), (4, 2, "v")]:
        placement = stage_placement(world, spr, style)
        assert len(placement) == world * spr
        for rank in range(world):
            assert [s for s, r in enumerate(placement) if r == rank] == sorted(
                stage_indices(rank, world, spr, style))
    assert stage_placement(2, 2, "loop") == LOOP and stage_placement(2, 2, "v") == V


@pytest.mark.parametrize("costs,placement,stage_cut_worst,rank_cut_worst", [
    (RESNET50_TIMES, LOOP, 95.6, 93.7),   # the slowest-stage cut leaves rank 1 with 95.6
    (RESNET50_FLOPS, V, 53.4, 50.6),      # ... and rank 0 of a V with 53.4 of 100
])
def test_interleaved_cut_balances_each_ranks_summed_stages(costs, placement, stage_cut_worst,
                                                           rank_cut_worst):
    by_stage = min_max_cuts(costs, len(placement))
    assert _rank_worst(costs, by_stage, placement) == pytest.approx(stage_cut_worst)
    cuts = min_max_rank_cuts(costs, placement)
    assert len(cuts) == len(placement) - 1 and cuts == sorted(set(cuts))
    assert _rank_worst(costs, cuts, placement) == pytest.approx(rank_cut_worst)
    assert _rank_worst(costs, cuts, placement) == pytest.approx(
        _brute_force_rank_best(costs, placement))


def test_rank_cuts_are_optimal_on_random_costs_and_keep_a_balanced_stage_cut():
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        costs = (torch.rand(10, generator=g) * 10).tolist()
        for placement in (LOOP, V, [0, 1, 2, 0, 1, 2]):
            cuts = min_max_rank_cuts(costs, placement)
            assert _rank_worst(costs, cuts, placement) == pytest.approx(
                _brute_force_rank_best(costs, placement))
    # Where the slowest-stage cut is already rank-balanced (float rounding aside), it is kept.
    assert min_max_rank_cuts(RESNET50_FLOPS, LOOP) == min_max_cuts(RESNET50_FLOPS, 4)
    # One stage per rank: the same objective as the slowest stage.
    assert min_max_rank_cuts([1, 2, 3, 4, 5], [0, 1]) == min_max_cuts([1, 2, 3, 4, 5], 2)


def test_choose_with_a_placement_balances_ranks():
    workload, model = _tiny()
    p = choose("balanced-flops", model, 4, workload, 2, CPU, placement=V)
    assert p.placement == tuple(V) and len(p.rank_costs()) == 2
    assert max(p.rank_costs()) == pytest.approx(
        _brute_force_rank_best(list(p.block_costs), V))
    plain = choose("balanced-flops", model, 4, workload, 2, CPU)
    assert plain.placement == () and plain.rank_costs() == plain.stage_costs()


@pytest.mark.integration
def test_profiling_goes_block_by_block_with_one_live_input(monkeypatch):
    """Only the current block's input is alive while a block is profiled, and the stem is
    profiled without an input gradient (its input is the image batch)."""
    import gc
    import weakref

    seen: list[weakref.ref] = []
    grads: list[bool] = []

    def fake_flops(block, x, input_grad=True):
        gc.collect()
        alive = [r for r in seen if r() is not None]
        assert alive == [], f"{len(alive)} earlier block inputs still alive"
        seen.append(weakref.ref(x))
        grads.append(input_grad)
        return 1.0

    monkeypatch.setattr(partition, "block_flops", fake_flops)
    workload, model = _tiny()
    costs = partition.block_costs(model, workload, 2, CPU, "flops")
    assert costs == [1.0] * len(blocks(model)) == [1.0] * len(grads)
    assert grads == [False] + [True] * (len(grads) - 1)


def test_the_stem_costs_less_without_an_input_gradient():
    workload, model = _tiny()
    stem = blocks(model)[0]
    x, _ = workload.make_batch(2, CPU)
    assert partition.block_flops(stem, x, input_grad=False) < partition.block_flops(stem, x)


def test_profiling_leaves_every_block_where_it_was(monkeypatch):
    """Each block moves to the profiling device and back: the whole model never moves."""
    moves: list[tuple[str, str]] = []
    real_to = torch.nn.Module.to

    def spy_to(self, *args, **kwargs):
        moves.append((type(self).__name__, str(args[0])))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    workload, model = _tiny()
    partition.block_costs(model, workload, 2, CPU, "flops")
    # Each block to the device, then home again; never the whole model.
    assert moves == [(type(b).__name__, "cpu") for b in blocks(model) for _ in (0, 1)]
    assert all(p.device == CPU for p in model.parameters())
