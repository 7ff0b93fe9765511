"""One rank of one strategy's parity training run, in a fresh process like a case's rank.

    python -m bench_lib.parity.train SPEC_JSON RANK

Every process seeds torch the same before it builds the model, so every strategy starts
from the same weights; it trains through the strategy's own ``Trainer`` (its
``forward_backward`` and optimizer: the code the benchmarks time) on the shared batches of
``parity.data``, at the run's learning rate. After each epoch the ranks pool the tensors of
the model they hold, and rank 0 loads them into a fresh copy of the model on the CPU and
evaluates the whole test set in eval mode: the same evaluation for every strategy, however
it splits the model. Rank 0 writes the epochs (``EpochResult``) as ``epochs.json`` beside
the spec, or why it failed.

How a rank's tensors map back to the model's state dict: each is matched by the module that
holds it and its attribute name there (``bn1`` and ``running_mean``) to its name in the
unsplit model, read once the strategy has built its trainer, so a pipeline stage's blocks
and a DDP replica alike map back. Not by the tensor's identity: ``Module.to("cuda")`` keeps
the module and parameter objects but replaces every buffer, so BatchNorm's running
statistics would drop out (and a freed buffer's ``id`` can be reused by another tensor);
after the build because ``convert_sync_batchnorm`` puts new SyncBatchNorm modules into the
model in place of its BatchNorm ones. FSDP2 replaces every parameter by a ``DTensor``
shard, which no one rank holds whole: there every rank calls
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict``
(each shard all-gathered into the full tensor, under the model's own names, which
``fully_shard`` leaves unchanged) and ``cpu_offload`` (only rank 0 keeps it).
Where ranks hold copies of one tensor (DDP's replicas; BatchNorm's running statistics,
which each data-parallel rank updates from its own share), rank 0's is the one evaluated:
the copy a checkpoint of the run would save.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from bench_lib import strategies
from bench_lib.math_modes import DEFAULT_MATH_MODE, set_math_mode
from bench_lib.parity.data import Split, dataset, loader, parity_workload
from bench_lib.pinning import pin_worker
from bench_lib.process_groups import destroy_process_group, init_process_group
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig
from bench_lib.strategies import BuildContext, Microbatching, Trainer
from bench_lib.workloads import Workload

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
"""Parity precisions: fp32 trains every strategy; fp64 trains ``single`` once more, the
reference against which float32 rounding is measured (``parity.verdict``)."""
GROUP_TIMEOUT_S = 120.0
EVAL_BATCH = 500
"""Test images per evaluation forward (a real CIFAR-10 test set is 10,000)."""


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
    """Peak SGD learning rate (no momentum, no weight decay), decayed by ``cosine``."""
    seed: int
    """Seeds the weights and every epoch's shuffle."""
    split_seed: int
    """Seeds the dataset's train/test split (the run's seed: every run of a parity run,
    ``single`` at its other seeds included, is tested on the same images)."""
    precision: str = "fp32"
    """``fp32``, or ``fp64`` (the reference run of ``single``)."""
    sync_bn: bool = False
    """SyncBatchNorm in the data-parallel strategies (``BuildContext.sync_bn``)."""
    data_root: str | None = None
    """The user's MNIST / CIFAR-10 folder (``parity.data.real``); None: the digits."""
    worker: int = 0
    """The cpu rig's worker a one-process run is pinned to (``parity.check`` runs such runs
    side by side, one per worker)."""
    math_mode: str = DEFAULT_MATH_MODE
    """The fp32 math the ranks compute in (``math_modes.MATH_MODES``, ``parity --math-mode``)."""

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
    test_loss_sd: float = 0.0
    """Standard deviation of the loss over the test images (``verdict.seeds_tolerance``)."""


Slot = tuple[int, str]
"""Where a state tensor lives: its module's ``id`` and its attribute name there. A device
or dtype move keeps it (module docstring)."""


def _slots(module: nn.Module) -> dict[str, Slot]:
    """Each state-dict key of ``module`` with the slot that holds its tensor."""
    out: dict[str, Slot] = {}
    for key in module.state_dict(keep_vars=True):
        owner, _, attr = key.rpartition(".")
        out[key] = (id(module.get_submodule(owner)), attr)
    return out


def state_names(model: nn.Module) -> dict[Slot, str]:
    """The model's state-dict key of each slot (read after the strategy's build)."""
    return {slot: key for key, slot in _slots(model).items()}


def _state(trainer: Trainer, names: dict[Slot, str]) -> dict[str, torch.Tensor]:
    """The unsplit model's state this process holds, on the CPU, by the tensors' original
    names (FSDP2's shards gathered: a collective, so every rank calls this; module
    docstring)."""
    module = trainer.module
    if any(isinstance(p, DTensor) for p in module.parameters()):
        full = get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu() for k, v in full.items() if isinstance(v, torch.Tensor)}
    held = module.state_dict(keep_vars=True)
    return {names[slot]: held[key].detach().to("cpu", copy=True)
            for key, slot in _slots(module).items() if slot in names}


def merged(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' states as one, a lower rank's tensor winning where ranks hold the same
    name (module docstring: rank 0's copy is evaluated)."""
    out: dict[str, torch.Tensor] = {}
    for part in reversed(states):
        out.update(part)
    return out


def cosine(peak: float, step: int, steps: int) -> float:
    """The learning rate of ``step`` (from 0) of ``steps``: ``peak`` decayed along half a
    cosine to near 0 at the last step. Without a decay the last epoch's model is one sample
    of SGD's noise at full rate, and a ResNet's final test loss swings by several times its
    seed-to-seed spread from one epoch to the next (BatchNorm's running statistics lag the
    moving weights); decayed, every run ends settled, so final figures can be compared."""
    return peak * 0.5 * (1 + math.cos(math.pi * step / steps))


def _pooled(part: Any, world: int) -> list[Any]:
    """Every rank's ``part`` (this process's alone without a process group)."""
    if world == 1:
        return [part]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, part)
    return parts


def evaluate(model: nn.Module, workload: Workload, split: Split
             ) -> tuple[float, float | None, float]:
    """Test loss, accuracy (None for real-valued targets) and the standard deviation of the
    loss over the test images, of ``model`` in eval mode (forwards of ``EVAL_BATCH``
    images; each image's loss on its own, so any mean-reduced loss of the workload works)."""
    model.eval()
    dtype = next(model.parameters()).dtype
    loss_fn = workload.loss_fn()
    losses: list[float] = []
    right = 0
    with torch.no_grad():
        for x, y in zip(split.x_test.split(EVAL_BATCH), split.y_test.split(EVAL_BATCH)):
            out, target = model(x.to(dtype)), y if split.classes else y.to(dtype)
            losses += [float(loss_fn(out[i:i + 1], target[i:i + 1])) for i in range(len(y))]
            right += int((out.argmax(1) == y).sum()) if split.classes else 0
    model.train()
    n = len(losses)
    accuracy = right / n if split.classes else None
    return statistics.fmean(losses), accuracy, statistics.pstdev(losses)


def train(spec: ParitySpec, rank: int) -> list[EpochResult]:
    """This rank's part of the run; rank 0 returns the epochs, the others an empty list."""
    strat = strategies.get(spec.strategy)
    dtype = DTYPES[spec.precision]
    workload = parity_workload(spec.model, spec.batch_size)
    split = dataset(workload, spec.split_seed,
                    Path(spec.data_root) if spec.data_root is not None else None)
    torch.manual_seed(spec.seed)
    model = workload.build_model().to(dtype)
    devices = ([spec.rig.device(rank)] if strat.per_device_processes
               else [spec.rig.device(i) for i in range(strat.num_devices(spec.rig))])
    micro = Microbatching.of(spec.batch_size, spec.split_size) if strat.uses_split else None
    ctx = BuildContext(workload, micro, rank, spec.world_size, sync_bn=spec.sync_bn)
    trainer = strat.build(model, devices, ctx)
    names = state_names(model)  # after the build: its moves and SyncBatchNorm modules seen
    # Data-parallel ranks take a share of each batch; every other process reads it whole.
    replicas, share = (spec.world_size, rank) if strat.data_parallel else (1, 0)
    epochs, step, steps = [], 0, len(split.y_train) // spec.batch_size * spec.epochs
    for epoch in range(spec.epochs):
        losses, t0 = [], time.perf_counter()
        for x, y in loader(split.x_train, split.y_train, spec.batch_size, replicas, share,
                           spec.seed, epoch):
            for group in trainer.optimizer.param_groups:
                group["lr"] = cosine(spec.lr, step, steps)
            step += 1
            trainer.optimizer.zero_grad(set_to_none=True)
            target = y if split.classes else y.to(dtype)
            loss = trainer.forward_backward(x.to(trainer.input_device, dtype),
                                            target.to(trainer.output_device))
            trainer.optimizer.step()
            losses.append(float(loss.detach()))
        wall = time.perf_counter() - t0
        # Whose losses are the batch's: every data-parallel rank's share (averaged), else
        # the process that computes the loss (a pipeline's last stage).
        mine = losses if strat.data_parallel or trainer.needs_targets else None
        pooled = [p for p in _pooled(mine, spec.world_size) if p is not None]
        states = _pooled(_state(trainer, names), spec.world_size)
        if rank:
            continue
        fresh = workload.build_model().to(dtype)
        fresh.load_state_dict(merged(states))
        test_loss, accuracy, spread = evaluate(fresh, workload, split)
        per_batch = [sum(b) / len(b) for b in zip(*pooled)]
        epochs.append(EpochResult(epoch, sum(per_batch) / len(per_batch), test_loss, accuracy,
                                  wall, spread))
    return epochs


def result_path(workdir: Path) -> Path:
    return workdir / "epochs.json"


def main(argv: list[str]) -> int:
    spec_path, rank = Path(argv[0]).resolve(), int(argv[1])
    spec = ParitySpec.read(spec_path)
    strat = strategies.get(spec.strategy)
    code = 0
    try:
        pin_worker(spec.rig, rank if strat.per_device_processes else spec.worker)
        set_math_mode(spec.math_mode)
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
        # Not waited for past its bound (a failed rank's peers may be stuck in a collective:
        # NCCL): its nonzero exit makes the launch stop them (``parity.launch``).
        destroy_process_group(code)
    return code


if __name__ == "__main__":
    from bench_lib.processes.lifeline import exit_lightly

    exit_lightly(main(sys.argv[1:]))
