"""Transfers priced as they happen: the activation crossing a cut at the dtype that really
crosses it."""

from __future__ import annotations

import pytest
import torch

from bench_lib.workloads import Workload, split_stages
from bench_lib.workloads.blocks import tutorial_cut
from bench_lib.workloads.sizes import boundary_bytes


@pytest.mark.parametrize("model,image_size", [("resnet-tiny", 32), ("resnet50", 32),
                                              ("toy", 32), ("mlp", 32)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_boundary_bytes_are_the_bytes_of_the_tensor_that_crosses_the_cut(model, image_size,
                                                                          precision):
    """mp's stage 0 run for real on the CPU under the case's autocast, as its forward runs
    it: the tensor handed to stage 1 has the bytes ``boundary_bytes`` counts (bf16 under
    bf16: batch norm keeps a conv's bf16), half of fp32's under bf16."""
    w = Workload(model, image_size, 4, precision=precision)
    net = w.build_model()
    cut = tutorial_cut(net)
    first = split_stages(net, [cut])[0]
    x = w.make_batch(4, torch.device("cpu"))[0]
    with torch.no_grad(), w.autocast(torch.device("cpu")):
        crossing = first(x)
    assert crossing.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    counted = boundary_bytes(model, image_size, 4, (cut,), precision)
    assert counted == (crossing.numel() * crossing.element_size(),)
    if precision == "bf16":
        assert 2 * counted[0] == boundary_bytes(model, image_size, 4, (cut,), "fp32")[0]
