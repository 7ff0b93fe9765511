"""The model registry: one explicit dict, ``MODELS``, from a name to its ``ModelSpec``.

A spec says how to build the model (freshly initialised on the CPU: the same seed gives the
same weights), the shape of one input sample for an image size (or the fixed shape that makes
the image size not apply), the losses it can train with, and the smallest image it takes.
Where it can be cut into stages is the model's own structure (``workloads.blocks``): a
torchvision ResNet by its residual blocks, the small models here by the ``BlockStack`` they
are built as, so a cut never crosses a skip connection.

Fixed-shape models (``toy``, ``mlp``) take no image size: a sweep over image sizes gives
them one row per batch size, recorded at the size of what they do take (``mlp`` its 28 px
digits, ``toy`` 0: its input is a vector of 10 features, not an image), so that their rows
keep a number in every column a reader groups by.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn
from torchvision.models import resnet
from torchvision.models.resnet import BasicBlock


class WorkloadError(ValueError):
    """A workload that cannot be built, or a model the registry does not know."""


class BlockStack(nn.Sequential):
    """A model built as its blocks in order: running them in turn is the model's forward.

    ``tutorial_cut``: index of the block where the tutorial's second stage starts.
    """

    def __init__(self, blocks: Sequence[nn.Module], tutorial_cut: int) -> None:
        super().__init__(*blocks)
        if not 1 <= tutorial_cut < len(blocks):
            raise WorkloadError(f"tutorial cut {tutorial_cut} is not inside 1..{len(blocks) - 1}")
        self.tutorial_cut = tutorial_cut


def toy(outputs: int) -> nn.Module:
    """The ``ToyModel`` of PyTorch's model-parallel and DDP tutorials, in two blocks cut after
    the ReLU: Linear(10, 10), ReLU | Linear(10, outputs). Its parameters are made in the
    tutorial's order, so a seed gives the tutorial's weights."""
    return BlockStack([nn.Sequential(nn.Linear(10, 10), nn.ReLU()), nn.Linear(10, outputs)],
                      tutorial_cut=1)


def mlp(classes: int) -> nn.Module:
    """The digit classifier of common pipeline tutorials, 784 -> 128 -> 64 -> classes with
    ReLU, on flattened 28x28 images: three blocks, one per linear layer (each block holds
    parameters, so every stage has something to train), cut after the first."""
    return BlockStack([nn.Sequential(nn.Flatten(1), nn.Linear(28 * 28, 128), nn.ReLU()),
                       nn.Sequential(nn.Linear(128, 64), nn.ReLU()),
                       nn.Linear(64, classes)], tutorial_cut=1)


def _tiny_resnet(num_classes: int) -> nn.Module:
    """A ResNet of one BasicBlock per stage: same structure as ResNet50, ~50x cheaper (tests)."""
    model: nn.Module = resnet.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    return model


def _torchvision(builder: Callable[..., nn.Module]) -> Callable[[int], nn.Module]:
    """A torchvision ResNet builder as ``outputs -> model``, randomly initialised."""

    def build(num_classes: int) -> nn.Module:
        model: nn.Module = builder(weights=None, num_classes=num_classes)
        return model

    return build


LOSS_TARGETS = {"ce": "classes", "mse-onehot": "classes", "mse": "values"}
"""What each loss compares the model's outputs with: class indices, or real values (one per
output, ``toy``'s random targets)."""


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it and what its inputs, targets and losses are."""

    name: str
    """Registry key and ``--models`` name."""
    description: str
    """One line: what it is and where its tutorial cut lies."""
    build: Callable[[int], nn.Module]
    """``outputs -> model``: a freshly initialised model with that many outputs."""
    outputs: int = 1000
    """Outputs of the head by default: classes, or ``toy``'s regression outputs."""
    channels: int = 3
    """Channels of an input image (where the image size applies)."""
    fixed_input: tuple[int, ...] = ()
    """Shape of one input sample where the image size does not apply; empty: it does, and a
    sample is ``channels`` x size x size."""
    downsampling: int = 1
    """How much the model shrinks an image (ResNets 32): smaller images are refused, since
    BatchNorm would then see no more than one value per channel."""
    losses: tuple[str, ...] = ("ce", "mse-onehot")
    """Losses it trains with (keys of ``LOSS_TARGETS``), its default first."""

    def __post_init__(self) -> None:
        unknown = [loss for loss in self.losses if loss not in LOSS_TARGETS]
        if not self.losses or unknown:
            raise WorkloadError(f"{self.name}: losses {list(self.losses)} must be some of "
                                f"{', '.join(LOSS_TARGETS)}")

    @property
    def sized(self) -> bool:
        """True when the image size applies (the model takes square images of any size)."""
        return not self.fixed_input

    @property
    def recorded_image_size(self) -> int:
        """A fixed-shape model's image size in results: the side of its square images, or 0
        where its input is not an image."""
        shape = self.fixed_input
        return shape[-1] if len(shape) == 3 and shape[-1] == shape[-2] else 0

    def image_size(self, asked: int) -> int:
        """The image size a case of this model runs at when the sweep asks for ``asked``."""
        return asked if self.sized else self.recorded_image_size

    def loss_for(self, asked: str) -> str:
        """The loss a case trains with when the sweep asks for ``asked``: that one, unless
        it compares with another kind of target than the model's (a classifier loss for
        ``toy``'s real-valued targets): then the model's own. A loss of the right kind that
        the model does not know stays, and ``Workload`` refuses it."""
        own = self.losses[0]
        return asked if LOSS_TARGETS.get(asked) == LOSS_TARGETS[own] else own

    def input_shape(self, image_size: int) -> tuple[int, ...]:
        """The shape of one input sample at ``image_size``."""
        return self.fixed_input or (self.channels, image_size, image_size)

    def image_size_problem(self, size: int) -> str | None:
        """Why this model cannot take ``size`` px images, or None when it can."""
        if self.sized and size < self.downsampling:
            return (f"image size {size} is too small for {self.name}: it downsamples by "
                    f"{self.downsampling}, so use {self.downsampling} or more")
        return None


MODELS: dict[str, ModelSpec] = {}
"""Every model a workload may name, by name (``register``; the CLI lists ``sorted(MODELS)``)."""


def register(spec: ModelSpec) -> ModelSpec:
    """Add a model; a duplicate name is a WorkloadError naming the known ones."""
    if spec.name in MODELS:
        raise WorkloadError(f"model {spec.name!r} is already registered; "
                            f"known: {', '.join(sorted(MODELS))}")
    MODELS[spec.name] = spec
    return spec


def get(name: str) -> ModelSpec:
    """Look a model up; an unknown name is a WorkloadError naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise WorkloadError(f"unknown model {name!r}; valid: {', '.join(sorted(MODELS))}"
                            ) from None


_RESNET_CUT = "stem + layer1..2 | layer3..4 + head"
for _spec in (
    ModelSpec("resnet50", f"torchvision ResNet50 (Bottleneck blocks), cut {_RESNET_CUT}",
              _torchvision(resnet.resnet50), downsampling=32),
    ModelSpec("resnet18", f"torchvision ResNet18 (BasicBlocks), cut {_RESNET_CUT}",
              _torchvision(resnet.resnet18), downsampling=32),
    ModelSpec("resnet101", f"torchvision ResNet101 (Bottleneck blocks), cut {_RESNET_CUT}",
              _torchvision(resnet.resnet101), downsampling=32),
    ModelSpec("resnet152", f"torchvision ResNet152 (Bottleneck blocks), cut {_RESNET_CUT}",
              _torchvision(resnet.resnet152), downsampling=32),
    ModelSpec("resnet-tiny", f"one BasicBlock per ResNet stage, for tests; cut {_RESNET_CUT}",
              _tiny_resnet, downsampling=32),
    ModelSpec("toy", "the model-parallel/DDP tutorials' Linear(10, 10), ReLU | Linear(10, 5), "
              "MSE on random targets", toy, outputs=5, fixed_input=(10,), losses=("mse",)),
    ModelSpec("mlp", "the pipeline tutorials' digit classifier 784 -> 128 | 64 -> 10 on "
              "28x28 single-channel images", mlp, outputs=10, channels=1,
              fixed_input=(1, 28, 28)),
):
    register(_spec)
