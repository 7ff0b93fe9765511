"""One rank of one strategy's parity training run, in a fresh process like a case's rank.

    python -m bench_lib.parity.train SPEC_JSON RANK

Every process seeds torch the same before it builds the model, so every strategy starts
from the same weights; it trains through the strategy's own ``Trainer`` (its
``forward_backward`` and optimizer: the code the benchmarks time) on the shared batches of
``parity.data``, at the run's learning rate. After each epoch the ranks pool the tensors of
the model they hold (each tensor is matched to its name in the unsplit model by identity,
so a pipeline stage's blocks and a DDP replica alike map back to the model's state dict),
and rank 0 loads them into a fresh copy of the model and evaluates the whole test set: the
same evaluation for every strategy, however it splits the model. Rank 0 writes the epochs
(``EpochResult``) as ``epochs.json`` beside the spec, or why it failed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench_lib import strategies
from bench_lib.parity.data import Split, dataset, loader
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig, init_process_group, pin_worker, set_math_mode
from bench_lib.strategies import BuildContext, Microbatching, Trainer
from bench_lib.workloads import Workload

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""Parity precisions: fp32 trains every strategy; fp64 trains ``single`` once more, the
reference against which float32 rounding is measured (``parity.verdict``)."""
GROUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParitySpec:
    """What every rank of one strategy's parity run is told."""

    model: str
    strategy: str
    rig: Rig
    world_size: int
    """Processes of the run (1 where one process drives the strategy's devices)."""
    epochs: int
    batch_size: int
    """Global batch size (data-parallel ranks take an equal share each)."""
    split_size: int
    """Micro-batch size of the strategies that split the batch."""
    lr: float
    """SGD learning rate (no momentum, no weight decay)."""
    seed: int
    """Seeds the weights, the dataset's split and every epoch's shuffle."""
    precision: str = "fp32"
    """``fp32``, or ``fp64`` (the reference run of ``single``)."""

    def write(self, path: Path) -> None:
        write_json_atomic(path, dataclasses.asdict(self) | {"rig": self.rig.as_dict()})

    @classmethod
    def read(cls, path: Path) -> ParitySpec:
        data = json.loads(path.read_text())
        return cls(**(data | {"rig": Rig.from_dict(data["rig"])}))


@dataclass(frozen=True)
class EpochResult:
    """One epoch of a strategy's run, as rank 0 evaluated it."""

    epoch: int
    train_loss: float
    """Mean of the epoch's batch losses (the global batch's, however it was split)."""
    test_loss: float
    test_accuracy: float | None
    """Share of test images classified right (None for a regression: ``toy``)."""
    epoch_time_s: float
    """Wall time of the epoch's training steps on rank 0 (evaluation excluded)."""


def _state(trainer: Trainer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The unsplit model's state this process holds: its tensors, by their original name."""
    held = trainer.module.state_dict(keep_vars=True).values()
    return {names[id(t)]: t.detach().clone() for t in held if id(t) in names}


def _pooled(part: Any, world: int) -> list[Any]:
    """Every rank's ``part`` (this process's alone without a process group)."""
    if world == 1:
        return [part]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, part)
    return parts


def evaluate(model: nn.Module, workload: Workload, split: Split) -> tuple[float, float | None]:
    """Test loss and accuracy (None for real-valued targets) of ``model`` in eval mode."""
    model.eval()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        out = model(split.x_test.to(dtype))
        y = split.y_test if split.classes else split.y_test.to(dtype)
        loss = float(workload.loss_fn()(out, y))
        accuracy = float((out.argmax(1) == y).double().mean()) if split.classes else None
    model.train()
    return loss, accuracy


def train(spec: ParitySpec, rank: int) -> list[EpochResult]:
    """This rank's part of the run; rank 0 returns the epochs, the others an empty list."""
    strat = strategies.get(spec.strategy)
    dtype = DTYPES[spec.precision]
    workload = Workload(spec.model, batch_size=spec.batch_size)
    split = dataset(workload, spec.seed)
    torch.manual_seed(spec.seed)
    model = workload.build_model().to(dtype)
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    devices = ([spec.rig.device(rank)] if strat.per_device_processes
               else [spec.rig.device(i) for i in range(strat.num_devices(spec.rig))])
    micro = Microbatching.of(spec.batch_size, spec.split_size) if strat.uses_split else None
    ctx = BuildContext(workload, micro, rank, spec.world_size)
    trainer = strat.build(model, devices, ctx)
    for group in trainer.optimizer.param_groups:
        group["lr"] = spec.lr
    # Data-parallel ranks take a share of each batch; every other process reads it whole.
    replicas, share = (spec.world_size, rank) if strat.data_parallel else (1, 0)
    epochs = []
    for epoch in range(spec.epochs):
        losses, t0 = [], time.perf_counter()
        for x, y in loader(split.x_train, split.y_train, spec.batch_size, replicas, share,
                           spec.seed, epoch):
            trainer.optimizer.zero_grad(set_to_none=True)
            loss = trainer.forward_backward(x.to(dtype), y if split.classes else y.to(dtype))
            trainer.optimizer.step()
            losses.append(float(loss))
        wall = time.perf_counter() - t0
        # Whose losses are the batch's: every data-parallel rank's share (averaged), else
        # the process that computes the loss (a pipeline's last stage).
        mine = losses if strat.data_parallel or trainer.needs_targets else None
        pooled = [p for p in _pooled(mine, spec.world_size) if p is not None]
        states = _pooled(_state(trainer, names), spec.world_size)
        if rank:
            continue
        fresh = workload.build_model().to(dtype)
        fresh.load_state_dict({k: v for part in states for k, v in part.items()})
        test_loss, accuracy = evaluate(fresh, workload, split)
        per_batch = [sum(b) / len(b) for b in zip(*pooled)]
        epochs.append(EpochResult(epoch, sum(per_batch) / len(per_batch), test_loss, accuracy,
                                  wall))
    return epochs


def result_path(workdir: Path) -> Path:
    return workdir / "epochs.json"


def main(argv: list[str]) -> int:
    spec_path, rank = Path(argv[0]).resolve(), int(argv[1])
    spec = ParitySpec.read(spec_path)
    strat = strategies.get(spec.strategy)
    code = 0
    try:
        pin_worker(spec.rig, rank if strat.per_device_processes else 0)
        set_math_mode()
        if spec.world_size > 1:
            init_process_group(spec.rig, rank, spec.world_size,
                               str(spec_path.parent / "rendezvous"), GROUP_TIMEOUT_S)
        epochs = train(spec, rank)
        if rank == 0:
            write_json_atomic(result_path(spec_path.parent),
                              {"epochs": [dataclasses.asdict(e) for e in epochs]})
    except Exception as e:  # recorded for the run's verdict, the traceback in the log
        traceback.print_exc()
        write_json_atomic(spec_path.parent / f"error{rank}.json",
                          {"error": f"{type(e).__name__}: {e}"[:500]})
        code = 1
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
