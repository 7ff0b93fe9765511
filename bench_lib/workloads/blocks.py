"""Blocks and stage cuts: a model as an ordered list of blocks, and where it is cut.

Running the blocks in order computes exactly the model's forward (a ResNet: its stem, every
residual block, its head; a ``BlockStack``: its children), so a cut between two blocks is a
valid pipeline / model-parallel split, and skip connections never cross a cut. A block
always holds parameters, so every stage has something to train. The balanced cuts from
measured block times live in ``strategies.partition``; the tutorial's cut is declared here.
"""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet

from bench_lib.workloads.models import BlockStack, WorkloadError


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model as an ordered list of blocks whose composition is the model's forward."""
    if isinstance(model, resnet.ResNet):
        # BasicBlock or Bottleneck alike: a block is one child of layer1..layer4.
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        body = [b for layer in _resnet_layers(model) for b in layer]
        head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
        return [stem, *body, head]
    if isinstance(model, BlockStack):
        return list(model)
    raise WorkloadError(f"cannot split {type(model).__name__} into blocks")


def _resnet_layers(model: nn.Module) -> list[nn.Sequential]:
    return [getattr(model, name) for name in ("layer1", "layer2", "layer3", "layer4")]


def tutorial_cut(model: nn.Module) -> int:
    """Block index of the tutorial's 2-stage split: a ResNet's conv1..layer2 | layer3..fc,
    a ``BlockStack``'s declared cut (``toy`` after the ReLU, ``mlp`` after the first layer)."""
    if isinstance(model, resnet.ResNet):
        return 1 + len(model.layer1) + len(model.layer2)
    if isinstance(model, BlockStack):
        return model.tutorial_cut
    raise WorkloadError(f"{type(model).__name__} declares no tutorial cut")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units before the root: a ResNet's stages (layer1..4),
    a ``BlockStack``'s blocks. The root keeps the rest (a ResNet's stem and head)."""
    if isinstance(model, resnet.ResNet):
        return list(_resnet_layers(model))
    if isinstance(model, BlockStack):
        return list(model)
    raise WorkloadError(f"{type(model).__name__} declares no FSDP units")


def split_stages(model: nn.Module, cuts: list[int]) -> list[nn.Sequential]:
    """Split the model's blocks at the given block indices into ``len(cuts)+1`` stages."""
    bs = blocks(model)
    bounds = [0, *cuts, len(bs)]
    if sorted(set(bounds)) != bounds:
        raise WorkloadError(f"cut points {cuts} must be increasing and inside 1..{len(bs) - 1}")
    return [nn.Sequential(*bs[a:b]) for a, b in zip(bounds, bounds[1:])]


def default_cuts(model: nn.Module, num_stages: int) -> list[int]:
    """Cut points for ``num_stages`` stages: the tutorial's cut for 2, even blocks otherwise."""
    if num_stages == 1:
        return []
    n = len(blocks(model))
    if num_stages > n:
        raise WorkloadError(f"{num_stages} stages but the model has only {n} blocks")
    if num_stages == 2:
        return [tutorial_cut(model)]
    return [round(i * n / num_stages) for i in range(1, num_stages)]
