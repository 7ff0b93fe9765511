"""Partitions: min-max cut points, the tutorial/balanced choices, and their sweep options."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench_lib import cli
from bench_lib.rig import Rig
from bench_lib.strategies.partition import PARTITIONS, Partition, choose, min_max_cuts
from bench_lib.sweep.cases import expand
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
    code = cli.main(["run", "--profile", "smoke", "--partition", "even", "--out", str(tmp_path)])
    assert code == cli.EXIT_USAGE
    assert "unknown partition 'even'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
