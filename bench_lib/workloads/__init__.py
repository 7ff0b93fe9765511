"""Workloads: a model, its input shape, batch size, loss and precision; and its stage cuts.

- ``models``: the registry (``MODELS``: name -> ``ModelSpec``) and the small models built here;
- ``blocks``: a model as its ordered blocks, the tutorial's cut, FSDP units, stage splits;
- this module: ``Workload``, what one case trains, with its synthetic data and its loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bench_lib.workloads.blocks import (
    blocks,
    default_cuts,
    shard_units,
    split_stages,
    tutorial_cut,
)
from bench_lib.workloads.models import (
    LOSS_TARGETS,
    MODELS,
    BlockStack,
    ModelSpec,
    WorkloadError,
)
from bench_lib.workloads.models import get as get_model

__all__ = ["CLASSIFIER_LOSSES", "LOSSES", "MODELS", "PRECISIONS", "BlockStack", "LossFn",
           "ModelSpec", "Workload", "WorkloadError", "blocks", "default_cuts", "get_model",
           "shard_units", "split_stages", "tutorial_cut"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss taking the model's outputs and the targets (``Workload.make_batch``)."""

LOSSES = tuple(LOSS_TARGETS)
CLASSIFIER_LOSSES = tuple(k for k, v in LOSS_TARGETS.items() if v == "classes")
"""The losses a profile may choose (``toy``, a regression, always trains with ``mse``)."""
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Workload:
    """What is trained: model, input shape, batch size, loss and precision.

    The model's own values fill ``num_classes`` and ``loss`` left at 0 and ''; a model that
    takes no image size (``ModelSpec.sized`` False) records its own whatever is given.
    """

    model: str = "resnet50"
    """Model name, a key of ``MODELS``."""
    image_size: int = 128
    """Height and width of the square input images, in pixels (see the class docstring)."""
    batch_size: int = 32
    """Global batch size of one training step (split across ranks by data parallelism)."""
    num_classes: int = 0
    """Outputs of the head: classes (``toy``: regression outputs); 0: the model's own."""
    loss: str = ""
    """``ce`` (CrossEntropy on class indices), ``mse-onehot`` (the tutorial's MSELoss on
    one-hot classes) or ``mse`` (MSE on real targets: ``toy``); '': the model's first."""
    precision: str = "fp32"
    """``fp32``, or ``bf16`` (autocast)."""

    def __post_init__(self) -> None:
        spec = get_model(self.model)
        # Resolved once here, so that everything downstream reads plain values.
        object.__setattr__(self, "image_size", spec.image_size(self.image_size))
        object.__setattr__(self, "num_classes", self.num_classes or spec.outputs)
        object.__setattr__(self, "loss", self.loss or spec.losses[0])
        problem = spec.image_size_problem(self.image_size)
        if problem:
            raise WorkloadError(problem)
        if self.batch_size < 1:
            raise WorkloadError(f"batch size must be >= 1, got {self.batch_size}")
        if self.num_classes < 1:
            raise WorkloadError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.loss not in spec.losses:
            raise WorkloadError(f"{self.model} cannot train with loss {self.loss!r}; "
                                f"valid: {', '.join(spec.losses)}")
        if self.precision not in PRECISIONS:
            raise WorkloadError(
                f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}"
            )

    @property
    def spec(self) -> ModelSpec:
        """The registered model."""
        return MODELS[self.model]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input sample (an image, or ``toy``'s feature vector)."""
        return self.spec.input_shape(self.image_size)

    def build_model(self) -> nn.Module:
        """A freshly initialised model on the CPU (same seed gives the same weights)."""
        return self.spec.build(self.num_classes)

    def make_batch(
        self, batch_size: int, device: torch.device, seed: int = 0,
        images: bool = True, targets: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Synthetic inputs and targets for ``batch_size`` samples: class indices, or for
        ``mse`` one standard normal value per output.

        ``images`` / ``targets`` False: that tensor is made empty (no input, no target), for
        a process that never reads it (a pipeline rank without the first / last stage).
        """
        g = torch.Generator().manual_seed(seed)
        shape = self.input_shape
        x = (torch.randn(batch_size, *shape, generator=g) if images
             else torch.empty(0, *shape))
        if LOSS_TARGETS[self.loss] == "values":
            y = (torch.randn(batch_size, self.num_classes, generator=g) if targets
                 else torch.empty(0, self.num_classes))
        else:
            y = (torch.randint(0, self.num_classes, (batch_size,), generator=g) if targets
                 else torch.empty(0, dtype=torch.long))
        return x.to(device), y.to(device)

    def loss_fn(self) -> LossFn:
        """The loss, taking the model's outputs and the targets of ``make_batch``."""
        if self.loss == "ce":
            return nn.functional.cross_entropy
        if self.loss == "mse":
            return _mse
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


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE against real targets, in the outputs' dtype (bf16 under autocast)."""
    return nn.functional.mse_loss(out, target.to(out.dtype))
