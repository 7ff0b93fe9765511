"""``parity --data-root``: a user's MNIST or CIFAR-10 in torchvision's on-disk format, read
without downloading; a folder that is not there, or not in that format, exits 2."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bench_lib import commands, exit_codes
from bench_lib.parity.data import dataset, parity_workload
from bench_lib.results.read import run_dirs_in
from bench_lib.sweep.profile import UsageError
from tests.conftest import in_process


def fake_mnist(root: Path, train: int = 96, test: int = 40) -> Path:
    """MNIST as torchvision keeps it (``root/MNIST/raw``, uncompressed idx files), with
    images a classifier can learn: class c lights rows 2c..2c+2."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28), dtype=np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 * c:2 * c + 3] = 255
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, n) + labels.tobytes())
    return root


def fake_cifar(root: Path, per_file: int = 8) -> tuple[Path, np.ndarray]:
    """CIFAR-10's python batches (``root/cifar-10-batches-py``): real layout, fake pixels
    (so their MD5 sums are not CIFAR-10's). Returns the root and the first training row."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    first = None
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        first = data[0] if first is None else first
        with (folder / name).open("wb") as f:
            pickle.dump({"data": data, "labels": [i % 10 for i in range(per_file)]}, f)
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    assert first is not None
    return root, first


def test_a_users_mnist_is_read_as_it_is(tmp_path):
    split = dataset(parity_workload("mlp", 32), 0, fake_mnist(tmp_path))
    assert split.x_train.shape == (96, 1, 28, 28) and split.x_test.shape == (40, 1, 28, 28)
    assert split.x_train.dtype == torch.float32 and split.classes
    assert float(split.x_train.max()) == 1.0 and float(split.x_train.min()) >= 0
    assert split.y_test.tolist() == [i % 10 for i in range(40)]
    assert torch.equal(split.x_train[3, 0, 6], torch.ones(28))  # class 3 lights row 6


def test_a_users_cifar10_is_read_channels_first(tmp_path, monkeypatch):
    root, first = fake_cifar(tmp_path)
    # The fake files fail torchvision's MD5 check (as a corrupt download would) ...
    with pytest.raises(UsageError, match="no CIFAR-10 in torchvision's format"):
        dataset(parity_workload("resnet-tiny", 32), 0, root)
    # ... past which torchvision's reader and ours give CIFAR-10's layout: R, G, B planes.
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *a, **k: True)
    split = dataset(parity_workload("resnet-tiny", 32), 0, root)
    assert split.x_train.shape == (40, 3, 32, 32) and split.x_test.shape == (8, 3, 32, 32)
    pixels = (split.x_train[0] * 255).round().to(torch.uint8).flatten().numpy()
    assert np.array_equal(pixels, first)
    assert split.y_train.tolist()[:10] == list(range(8)) + [0, 1]


def test_toy_keeps_its_teacher_under_a_data_root(tmp_path):
    split = dataset(parity_workload("toy", 32), 0, tmp_path)
    assert split.x_train.shape[1:] == (10,) and not split.classes


@pytest.mark.parametrize("models,setup,message", [
    ("mlp", None, "is not a folder"),
    ("mlp", "empty", "no MNIST in torchvision's format there (expected"),
    ("resnet-tiny", "mnist", "no CIFAR-10 in torchvision's format"),
])
def test_a_data_root_without_the_dataset_exits_2_writing_nothing(tmp_path, capsys, models,
                                                                 setup, message):
    root = tmp_path / "data"
    if setup == "empty":
        root.mkdir()
    elif setup == "mnist":
        fake_mnist(root)
    out = tmp_path / "out"
    code = commands.main(["parity", "--rig", "cpu", "--models", models, "--data-root", str(root),
                     "--out", str(out)])
    assert code == exit_codes.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.integration
def test_parity_on_a_users_mnist(tmp_path, capsys):
    out = tmp_path / "out"
    proc = in_process(capsys, "parity", "--rig", "cpu", "--models", "mlp", "--strategies",
                      "single,ddp", "--epochs", "3", "--batch-size", "16", "--data-root",
                      str(fake_mnist(tmp_path / "data", train=400)), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(out)
    epochs = pd.read_csv(run_dir / "parity.csv")
    # 40 test images: every accuracy is a multiple of 1/40, and the lit rows are learnt.
    assert ((epochs.test_accuracy * 40).round(9) % 1 == 0).all()
    assert epochs.groupby("strategy").test_accuracy.last().min() > 0.5
    verdicts = pd.read_csv(run_dir / "parity_verdicts.csv").set_index("strategy")
    assert verdicts.loc["ddp", "verdict"] == "match"
