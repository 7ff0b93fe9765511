"""Transparency: a parallel strategy computes the same gradients as the single-device model.

BatchNorm statistics differ per micro-batch and per rank, so models run with BN in eval
mode (running statistics), in float64, where results agree to ~1e-12.
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


def _assert_same(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(grads) == len(reference)
    for i, (g, r) in enumerate(zip(grads, reference)):
        assert g.shape == r.shape, f"parameter {i}: shape {g.shape} != {r.shape}"
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12, msg=f"parameter {i}")


@pytest.mark.parametrize("model", ["resnet-tiny", "resnet50"])
@pytest.mark.parametrize("loss", ["ce", "mse-onehot"])
@pytest.mark.parametrize("name,split", [("mp", None), ("pipeline", 3), ("pipeline", 8)])
@pytest.mark.integration
def test_single_process_strategies_match_single_device(name, split, model, loss):
    workload = Workload(model, image_size=32, batch_size=BATCH, num_classes=10, loss=loss)
    cpu = torch.device("cpu")
    trainer = strategies.get(name).build(
        reference_model(workload), [cpu, cpu], BuildContext(workload, micro(workload, split))
    )
    x, y = reference_batch(workload)
    trainer.forward_backward(x, y)
    _assert_same([p.grad for p in trainer.parameters_in_order()], reference_grads(workload))


def _ddp_rank_grads(rank: int, world_size: int, workload: Workload) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    trainer = strategies.get("ddp").build(
        reference_model(workload), [torch.device("cpu")],
        BuildContext(workload, rank=rank, world_size=world_size),
    )
    trainer.forward_backward(*reference_shard(workload, rank, world_size))
    return [p.grad.clone() for p in trainer.parameters_in_order()]


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_ddp_matches_single_device():
    workload = Workload("resnet-tiny", image_size=32, batch_size=BATCH, num_classes=10)
    per_rank = run_ranks(_ddp_rank_grads, world_size=2, args=(workload,))
    reference = reference_grads(workload)
    for grads in per_rank:
        _assert_same(grads, reference)
