"""Parity data: a real dataset that ships inside a package (or the user's own MNIST or
CIFAR-10), and loaders that give every strategy the same global batches.

Digits (the default): scikit-learn's 1,797 handwritten 8x8 digits (10 classes; nothing is
downloaded), split once by a permutation seeded with the run's split seed into
``DIGITS_TEST`` test images and the rest for training, scaled to [0, 1] and resized to what
the model takes (bilinear: 28x28 for ``mlp``, 3x``IMAGE_SIZE``x``IMAGE_SIZE`` for a ResNet,
its one channel repeated). ``toy`` regresses: its inputs are seeded standard normal vectors
and its targets a fixed random linear teacher's outputs plus a little noise, so its loss can
fall, which random targets would not let it.

``--data-root DIR``: a folder the user already has in torchvision's on-disk format, read by
torchvision's own classes with ``download=False`` (nothing is fetched): MNIST
(``DIR/MNIST/raw/train-images-idx3-ubyte`` ...) for a model that takes 1x28x28 images
(``mlp``), CIFAR-10 (``DIR/cifar-10-batches-py/``, checked against its MD5 sums by
torchvision) for one that takes 3x32x32 (the ResNets). Their own train/test split is kept,
pixels are scaled to [0, 1] as the digits are, nothing is resized. ``toy`` keeps its teacher.

Same batches: every process draws its order from a ``DistributedSampler`` seeded with the
run's seed and set to the epoch (one permutation of the training set per epoch, the same in
every process). A data-parallel rank r of w takes every w-th index from r, in batches of
B/w, so its batch k and the other ranks' together are exactly images k*B .. (k+1)*B-1 of
the permutation: the batch ``single`` (w = 1) trains on at step k. A pipeline's ranks all
read the whole batch (the first stage its images, the last its targets). The last partial
batch is dropped everywhere, so every process runs the same number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bench_lib.sweep.profile import UsageError
from bench_lib.workloads import MODELS, Workload
from bench_lib.workloads.models import LOSS_TARGETS

DIGITS_TEST = 360
"""Test images held out of the 1,797 digits (a fifth)."""
TEACHER_TRAIN, TEACHER_TEST, TEACHER_NOISE = 1280, 256, 0.1
"""``toy``'s regression: training and test samples, and the noise on the teacher's outputs."""
IMAGE_SIZE = 32
"""Pixels of a ResNet's parity images: CIFAR-10's size, and the smallest a ResNet takes (it
downsamples 32x, so its last stage sees 1x1 maps: BatchNorm there normalises over the batch
alone)."""
CLASSES = 10
"""Classes of every parity dataset (digits, MNIST, CIFAR-10): the classifiers' outputs."""


@dataclass(frozen=True)
class Split:
    """A dataset split once for every strategy: training and test inputs and targets."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def classes(self) -> bool:
        """True when the targets are class indices (accuracy applies)."""
        return not self.y_test.is_floating_point()


def parity_workload(model: str, batch_size: int) -> Workload:
    """``model`` as parity trains it: at ``IMAGE_SIZE`` px where it takes an image size, with
    ``CLASSES`` outputs where it classifies (``toy`` keeps its 5 regression outputs)."""
    classes = CLASSES if LOSS_TARGETS[MODELS[model].losses[0]] == "classes" else 0
    return Workload(model, image_size=IMAGE_SIZE, batch_size=batch_size, num_classes=classes)


def digits(shape: tuple[int, ...], seed: int) -> Split:
    """The handwritten digits as ``shape`` images (channels, height, width), split by a
    permutation seeded with ``seed``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels 0..16
    y = torch.tensor(data.target, dtype=torch.long)
    channels, height, width = shape
    x = torch.nn.functional.interpolate(x, size=(height, width), mode="bilinear",
                                        align_corners=False).repeat(1, channels, 1, 1)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:DIGITS_TEST], order[DIGITS_TEST:]
    return Split(x[train], y[train], x[test], y[test])


def teacher(features: int, outputs: int, seed: int) -> Split:
    """``toy``'s regression: seeded normal inputs through a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TEACHER_TRAIN + TEACHER_TEST, features, generator=g)
    weight = torch.randn(outputs, features, generator=g) / features**0.5
    y = x @ weight.T + TEACHER_NOISE * torch.randn(len(x), outputs, generator=g)
    return Split(x[:TEACHER_TRAIN], y[:TEACHER_TRAIN], x[TEACHER_TRAIN:], y[TEACHER_TRAIN:])


REAL_DATASETS: dict[tuple[int, ...], str] = {(1, 28, 28): "MNIST", (3, 32, 32): "CIFAR-10"}
"""The ``--data-root`` dataset of each model input shape."""
EXPECTED = {"MNIST": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
            "CIFAR-10": "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"}
"""What torchvision expects under the root, for the error message."""


def real_dataset_name(workload: Workload) -> str:
    """The ``--data-root`` dataset ``workload``'s model trains on (UsageError: none fits)."""
    name = REAL_DATASETS.get(workload.input_shape)
    if name is None:
        fits = ", ".join(f"{n} for {'x'.join(map(str, s))} inputs"
                         for s, n in REAL_DATASETS.items())
        raise UsageError(f"--data-root has no dataset for {workload.model} (input "
                         f"{'x'.join(map(str, workload.input_shape))}); it reads {fits}")
    return name


def _scaled(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (N, H, W) or (N, H, W, C) as float32 (N, C, H, W) in [0, 1]."""
    x = images.float() / 255.0
    return x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2).contiguous()


def real(name: str, root: Path) -> Split:
    """The user's MNIST or CIFAR-10 under ``root``, its own train/test split (UsageError when
    torchvision does not find it there in its format)."""
    from torchvision import datasets

    cls = {"MNIST": datasets.MNIST, "CIFAR-10": datasets.CIFAR10}[name]
    try:
        train, test = (cls(str(root), train=t, download=False) for t in (True, False))
    except (RuntimeError, OSError, ValueError, EOFError) as e:
        raise UsageError(f"--data-root {root}: no {name} in torchvision's format there "
                         f"(expected {root}/{EXPECTED[name]}; nothing is downloaded): "
                         f"{e}") from None
    parts = [(_scaled(torch.as_tensor(d.data)), torch.as_tensor(d.targets, dtype=torch.long))
             for d in (train, test)]
    return Split(parts[0][0], parts[0][1], parts[1][0], parts[1][1])


def dataset(workload: Workload, split_seed: int, data_root: Path | None = None) -> Split:
    """The parity dataset of ``workload``'s model: the teacher for real-valued targets
    (``toy``), else the user's MNIST or CIFAR-10 under ``data_root``, else the digits in the
    model's input shape."""
    if LOSS_TARGETS[workload.loss] == "values":
        (features,) = workload.input_shape
        return teacher(features, workload.num_classes, split_seed)
    if data_root is not None:
        return real(real_dataset_name(workload), data_root)
    return digits(workload.input_shape, split_seed)


def loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, replicas: int, rank: int,
           seed: int, epoch: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    """This process's batches of an epoch: ``rank``'s share (1/``replicas`` of each global
    batch of ``batch_size``) of the epoch's seeded permutation (module docstring)."""
    if batch_size % replicas:
        raise ValueError(f"batch size {batch_size} is not divisible by {replicas} replicas")
    data = TensorDataset(x, y)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(data, batch_size=batch_size // replicas, sampler=sampler, drop_last=True)
