"""Transparency of the modern strategies: same gradients as the single-device model.

torch.distributed.pipelining schedules, FSDP2 and gradient accumulation, in float64 with
BatchNorm in eval mode (running statistics), so results agree to ~1e-12. Distributed
strategies run on 2 spawned gloo ranks; each returns the gradients of the parameters it
holds, keyed by their index in the unsplit model.
"""

from __future__ import annotations

import pytest
import torch

from bench_lib import strategies
from bench_lib.strategies import BuildContext
from bench_lib.workloads import Workload
from tests.dist_harness import run_ranks
from tests.reference import (
    BATCH,
    micro,
    reference_batch,
    reference_grads,
    reference_model,
    reference_shard,
)

PIPELINING = ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"]


def _workload(loss: str = "ce") -> Workload:
    return Workload("resnet-tiny", image_size=32, batch_size=BATCH, num_classes=10, loss=loss)


def _assert_same(grads: dict[int, torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert sorted(grads) == list(range(len(reference))), "every parameter got a gradient"
    for i, r in enumerate(reference):
        assert grads[i].shape == r.shape, f"parameter {i}: shape {grads[i].shape} != {r.shape}"
        torch.testing.assert_close(grads[i], r, rtol=1e-9, atol=1e-12, msg=f"parameter {i}")


def _pipelining_grads(rank, world_size, name, split, partition, loss):
    workload = _workload(loss)
    model = reference_model(workload)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ctx = BuildContext(workload, micro(workload, split), rank, world_size, partition=partition)
    trainer = strategies.get(name).build(model, [torch.device("cpu")], ctx)
    x, y = reference_batch(workload)
    trainer.forward_backward(x, y)
    assert trainer.timeline_stages(), "a pipelined trainer names the stages it drives"
    return {index[id(p)]: p.grad.clone() for s in trainer.timeline_stages()
            for p in s.module.parameters()}


def _rank_grads_of_configs(rank, world_size, configs):
    # One spawn runs every config: starting ranks costs more than the tiny model's steps.
    torch.set_num_threads(1)
    return [_pipelining_grads(rank, world_size, *config) for config in configs]


PIPELINING_CONFIGS = [
    (name, split, partition, loss)
    for name in PIPELINING
    for split, partition, loss in [(2, "tutorial", "ce"), (4, "balanced-flops", "mse-onehot")]
]


@pytest.mark.compat
@pytest.mark.timeout(300)
@pytest.mark.integration
def test_pipelining_schedules_match_single_device():
    rank0, rank1 = run_ranks(_rank_grads_of_configs, 2, (PIPELINING_CONFIGS,))
    for config, grads0, grads1 in zip(PIPELINING_CONFIGS, rank0, rank1):
        assert not set(grads0) & set(grads1), f"{config}: a parameter lives on both ranks"
        try:
            _assert_same(grads0 | grads1, reference_grads(_workload(config[3])))
        except AssertionError as e:
            raise AssertionError(f"{config}: {e}") from None


@pytest.mark.parametrize("split", [3, 8])
@pytest.mark.parametrize("loss", ["ce", "mse-onehot"])
def test_accum_matches_single_device(split, loss):
    workload = _workload(loss)
    model = reference_model(workload)
    trainer = strategies.get("accum").build(
        model, [torch.device("cpu")], BuildContext(workload, micro(workload, split))
    )
    x, y = reference_batch(workload)
    trainer.forward_backward(x, y)
    grads = {i: p.grad for i, p in enumerate(trainer.parameters_in_order())}
    _assert_same(grads, reference_grads(workload))


def _fsdp_rank_grads(rank, world_size):
    torch.set_num_threads(1)
    workload = _workload()
    trainer = strategies.get("fsdp").build(
        reference_model(workload), [torch.device("cpu")],
        BuildContext(workload, rank=rank, world_size=world_size),
    )
    trainer.forward_backward(*reference_shard(workload, rank, world_size))
    params = trainer.parameters_in_order()
    local = sum(p.to_local().numel() for p in params)
    # full_tensor() all-gathers each sharded gradient (collective: every rank calls it).
    return local, {i: p.grad.full_tensor() for i, p in enumerate(params)}


@pytest.mark.compat
@pytest.mark.timeout(300)
@pytest.mark.integration
def test_fsdp_matches_single_device_and_shards():
    per_rank = run_ranks(_fsdp_rank_grads, world_size=2)
    reference = reference_grads(_workload())
    total = sum(r.numel() for r in reference)
    for local, grads in per_rank:
        assert local < total, "each rank holds only a shard of the parameters"
        _assert_same(grads, reference)
