"""Parity data: a real dataset that ships inside a package, and loaders that give every
strategy the same global batches.

Digits: scikit-learn's 1,797 handwritten 8x8 digits (10 classes; nothing is downloaded),
split once by a seeded permutation into ``DIGITS_TEST`` test images and the rest for
training, scaled to [0, 1] and resized to what the model takes (bilinear: 28x28 for
``mlp``, 3x32x32 for a ResNet, its one channel repeated). ``toy`` regresses: its inputs are
seeded standard normal vectors and its targets a fixed random linear teacher's outputs plus
a little noise, so its loss can fall, which random targets would not let it.

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

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bench_lib.workloads import Workload
from bench_lib.workloads.models import LOSS_TARGETS

DIGITS_TEST = 360
"""Test images held out of the 1,797 digits (a fifth)."""
TEACHER_TRAIN, TEACHER_TEST, TEACHER_NOISE = 1280, 256, 0.1
"""``toy``'s regression: training and test samples, and the noise on the teacher's outputs."""


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


def dataset(workload: Workload, seed: int) -> Split:
    """The parity dataset of ``workload``'s model: the teacher for real-valued targets
    (``toy``), the digits in the model's input shape for a classifier."""
    if LOSS_TARGETS[workload.loss] == "values":
        (features,) = workload.input_shape
        return teacher(features, workload.num_classes, seed)
    return digits(workload.input_shape, seed)


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
