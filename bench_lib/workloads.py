"""Workloads: a model, its input shape, batch size, loss and precision; and its stage split.

Models are flattened into an ordered list of *blocks* (ResNet: the stem, every residual
block, the head). Running the blocks in order computes exactly the torchvision forward,
so a cut between two blocks is a valid pipeline/model-parallel split, and skip
connections never cross a cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchvision.models import resnet
from torchvision.models.resnet import BasicBlock

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss taking logits and class indices."""

LOSSES = ("ce", "mse-onehot")
PRECISIONS = ("fp32", "bf16")


def _tiny_resnet(num_classes: int) -> nn.Module:
    """A ResNet of one BasicBlock per stage: same structure as ResNet50, ~50x cheaper (tests)."""
    model: nn.Module = resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    return model


MODELS: dict[str, Callable[[int], nn.Module]] = {  # name -> builder(num_classes)
    "resnet50": lambda num_classes: resnet.resnet50(weights=None, num_classes=num_classes),
    "resnet18": lambda num_classes: resnet.resnet18(weights=None, num_classes=num_classes),
    "resnet-tiny": _tiny_resnet,
}

# ResNets downsample by 32; below that BatchNorm sees 1x1 maps and the model is meaningless.
MIN_IMAGE_SIZE = 32


class WorkloadError(ValueError):
    """A workload that cannot be built."""


@dataclass(frozen=True)
class Workload:
    """What is trained: model, input shape, batch size, loss and precision."""

    model: str = "resnet50"
    """Model name, a key of ``MODELS``."""
    image_size: int = 128
    """Height and width of the square input images, in pixels."""
    batch_size: int = 32
    """Global batch size of one training step (split across ranks by data parallelism)."""
    num_classes: int = 1000
    """Output classes of the classifier head."""
    loss: str = "ce"
    """``ce`` (CrossEntropy on class indices) or ``mse-onehot`` (the tutorial's MSELoss)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16`` (autocast)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise WorkloadError(f"unknown model {self.model!r}; valid: {', '.join(sorted(MODELS))}")
        if self.image_size < MIN_IMAGE_SIZE:
            raise WorkloadError(
                f"image size {self.image_size} is too small for {self.model}: "
                f"it downsamples by 32, so use {MIN_IMAGE_SIZE} or more"
            )
        if self.batch_size < 1:
            raise WorkloadError(f"batch size must be >= 1, got {self.batch_size}")
        if self.loss not in LOSSES:
            raise WorkloadError(f"unknown loss {self.loss!r}; valid: {', '.join(LOSSES)}")
        if self.precision not in PRECISIONS:
            raise WorkloadError(
                f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}"
            )

    def build_model(self) -> nn.Module:
        """A freshly initialised model on the CPU (same seed gives the same weights)."""
        return MODELS[self.model](self.num_classes)

    def make_batch(
        self, batch_size: int, device: torch.device, seed: int = 0,
        images: bool = True, targets: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Synthetic inputs and targets (class indices) for ``batch_size`` images.

        ``images`` / ``targets`` False: that tensor is made empty (no image, no target), for
        a process that never reads it (a pipeline rank without the first / last stage).
        """
        g = torch.Generator().manual_seed(seed)
        size = self.image_size
        x = (torch.randn(batch_size, 3, size, size, generator=g) if images
             else torch.empty(0, 3, size, size))
        y = (torch.randint(0, self.num_classes, (batch_size,), generator=g) if targets
             else torch.empty(0, dtype=torch.long))
        return x.to(device), y.to(device)

    def loss_fn(self) -> LossFn:
        """The loss, taking logits and class indices."""
        if self.loss == "ce":
            return nn.functional.cross_entropy
        num_classes = self.num_classes

        def mse_onehot(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            onehot = nn.functional.one_hot(target, num_classes).to(logits.dtype)
            return nn.functional.mse_loss(logits, onehot)

        return mse_onehot

    def autocast(self, device: torch.device) -> torch.autocast:
        """The autocast context for this workload's precision on ``device``.

        Autocast's state, its dtype included, is thread-local: a thread the step runs
        work in (DataParallel's replicas) must enter this context itself, or it computes in
        that device type's default autocast dtype (float16 on CUDA); see ``strategies.dp``.
        """
        return torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"
        )


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model as an ordered list of blocks whose composition is the model's forward."""
    if not isinstance(model, resnet.ResNet):
        raise WorkloadError(f"cannot split {type(model).__name__} into blocks")
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    body = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
    return [stem, *body, head]


def tutorial_cut(model: nn.Module) -> int:
    """Block index of the PyTorch tutorial's split: conv1..layer2 | layer3..fc."""
    assert isinstance(model, resnet.ResNet)
    return 1 + len(model.layer1) + len(model.layer2)


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
    if num_stages == 2:
        return [tutorial_cut(model)]
    n = len(blocks(model))
    if num_stages > n:
        raise WorkloadError(f"{num_stages} stages but the model has only {n} blocks")
    return [round(i * n / num_stages) for i in range(1, num_stages)]

