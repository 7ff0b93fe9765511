"""The strategy interface: a small builder of a ``Trainer`` from (model, devices)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from bench_lib.rig import Rig
from bench_lib.workloads import Workload

if TYPE_CHECKING:
    from bench_lib.strategies.ddp_knobs import DdpKnobs

LEARNING_RATE = 0.001  # the tutorial's plain SGD; the value does not change step time


@dataclass(frozen=True)
class Microbatching:
    """How a batch is cut into micro-batches: resolved once, when the case is planned."""

    split_size: int | None
    """Images per micro-batch (the last may hold fewer); None when no split exists (a count
    larger than the batch)."""
    count: int
    """Micro-batches per step."""
    even: bool
    """True when every micro-batch holds exactly ``split_size`` images."""

    @classmethod
    def of(cls, batch_size: int, split_size: int) -> Microbatching:
        """Micro-batches of ``split_size`` images over a batch of ``batch_size``."""
        if split_size < 1:
            raise ValueError(f"a split size must be >= 1, got {split_size}")
        return cls(split_size, math.ceil(batch_size / split_size), batch_size % split_size == 0)


@dataclass(frozen=True)
class BuildContext:
    """What a strategy needs besides the model and its devices."""

    workload: Workload
    """The workload being trained (loss, precision, batch size)."""
    micro: Microbatching | None = None
    """Micro-batching of strategies that pipeline or accumulate; None for the others."""
    rank: int = 0
    """This process's rank in a per-device strategy (0 otherwise)."""
    world_size: int = 1
    """Number of processes of a per-device strategy (1 otherwise)."""
    partition: str = "tutorial"
    """How strategies that cut the model into stages choose the cut (``partition.PARTITIONS``)."""
    sync_bn: bool = False
    """Data-parallel strategies: synchronise BatchNorm statistics across ranks."""
    ddp: DdpKnobs | None = None
    """DistributedDataParallel's settings (strategies that wrap the model in it; None:
    torch's defaults)."""

    def require_micro(self, strategy: str, even: bool = False) -> tuple[int, int]:
        """(split size, micro-batch count), for strategies that cannot run without them.

        ``even``: every micro-batch must hold exactly split-size images.
        """
        m = self.micro
        if m is None or m.split_size is None:
            raise ValueError(f"{strategy} needs a split size, got {m}")
        if even and not m.even:
            raise ValueError(f"{strategy} needs equal micro-batches: batch "
                             f"{self.workload.batch_size} is not a multiple of split "
                             f"{m.split_size}")
        return m.split_size, m.count

    @property
    def stage_batch_size(self) -> int:
        """Images a stage processes at once: the split size, else the whole batch."""
        m = self.micro
        return m.split_size if m is not None and m.split_size else self.workload.batch_size


@dataclass(frozen=True)
class TimelineStage:
    """A pipeline stage this process drives, as the traced step's timeline sees it."""

    index: int
    """Global stage index."""
    slot: int
    """Position in the trainer's ``devices`` of the device that runs it (on a cpu rig every
    slot is torch's "cpu": the slot tells the two devices of ``mp`` apart)."""
    module: nn.Module
    """The stage's module (its forward and backward are stamped through hooks on it)."""
    pipe_stage: Any = None
    """A ``torch.distributed.pipelining`` stage: its per-micro-batch methods are stamped
    instead, so that split input- and weight-gradient passes are seen (None: hooks)."""


class Trainer:
    """One training step (zero grads, forward, loss, backward, optimizer step) on some devices.

    ``devices`` lists every device the step touches; timing synchronises all of them.
    ``forward`` runs the wrapped module; strategies that need more override it.
    """

    def __init__(
        self,
        module: nn.Module,
        devices: list[torch.device],
        ctx: BuildContext,
        params: Iterable[nn.Parameter] | None = None,
    ) -> None:
        self.module = module
        self.devices = devices
        self.ctx = ctx
        self.loss_fn = ctx.workload.loss_fn()
        self.optimizer = torch.optim.SGD(
            list(params if params is not None else module.parameters()), lr=LEARNING_RATE
        )

    @property
    def input_device(self) -> torch.device:
        """Where input batches must live before ``step``."""
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        """Where the logits come out, and so where targets must live."""
        return self.devices[-1]

    @property
    def local_batch_size(self) -> int:
        """Images this process feeds per step (the global batch over the ranks)."""
        return self.ctx.workload.batch_size // self.ctx.world_size

    @property
    def needs_images(self) -> bool:
        """Whether ``step`` reads its input images (a pipeline rank without the first stage
        does not, so none are made for it)."""
        return True

    @property
    def needs_targets(self) -> bool:
        """Whether ``step`` reads its targets (only the rank with the last stage does)."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(x)
        return out

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch; returns the loss (gradients accumulate)."""
        with self.ctx.workload.autocast(self.output_device):
            loss = self.loss_fn(self.forward(x), y)
        loss.backward()
        return loss

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One full training step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(x, y)
        self.optimizer.step()

    def without_communication(self) -> contextlib.AbstractContextManager[Any] | None:
        """A context in which ``step`` runs this process's compute and no gradient
        collective (DDP's ``no_sync``; small ones may remain: its buffer broadcast), or None
        where the strategy has no such mode. The worker times a few
        steps in it after the timed ones: the compute part of a data-parallel case's bound
        (``rows.case_bound``)."""
        return None

    def timeline_stages(self) -> list[TimelineStage]:
        """The pipeline stages this process drives, for the traced step; empty when not
        pipelined."""
        return []

    def compile(self) -> None:
        """torch.compile this trainer's modules in place (its ``stages`` when it has them)."""
        for module in getattr(self, "stages", None) or [self.module]:
            module.compile()

    def parameters_in_order(self) -> list[nn.Parameter]:
        """Trained parameters in the model's own order (for transparency tests)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


Builder = Callable[[nn.Module, list[torch.device], "BuildContext"], "Trainer"]
"""A strategy's builder: (model, its devices, context) -> this process's trainer."""


@dataclass(frozen=True)
class Strategy:
    """A registered way to train a workload on a rig."""

    name: str
    """Registry key and CLI name."""
    description: str
    """One line for --help and the report."""
    build: Builder
    """Builds the trainer of this process from the model and its devices."""
    num_devices: Callable[[Rig], int]
    """How many of the rig's devices a case uses."""
    per_device_processes: bool = False
    """True: one process per device (a process group); False: one process drives all."""
    uses_split: bool = False
    """True when the case is parameterised by a micro-batch (split) size."""
    uses_partition: bool = False
    """True when the strategy cuts the model into stages (the case's partition applies)."""
    even_split: bool = False
    """True when every micro-batch must hold exactly split_size images (batch % split == 0)."""
    data_parallel: bool = False
    """True when ranks train replicas (or shards) on parts of the batch: ``sync_bn`` applies."""
    replicas: bool = False
    """True when one process runs a replica of the model on each device, each on its chunk
    of the batch (``nn.DataParallel``): not ``data_parallel``, whose ranks are processes of
    their own (``sync_bn``, parity's per-rank shares)."""
    ddp_knobs: bool = False
    """True when the model is wrapped in DistributedDataParallel: the case carries
    ``ddp_knobs.DdpKnobs`` (the sweep's knob lists apply) and its row records them."""
    compile_unsupported: str = ""
    """Why ``--compile`` cannot work with this strategy (empty when it can)."""
    channels_last_unsupported: str = ""
    """Why ``--channels-last`` cannot work with this strategy (empty when it can)."""
    needs_cuda: bool = False
    """True when the strategy only means something on GPUs."""
    cpu_note: str = ""
    """How to read this strategy's numbers on a cpu rig (written to each case row)."""
    shared_gpu_unsupported: str = ""
    """Why the strategy cannot run with several device slots on one GPU (``--gpu-slots``;
    empty when it can)."""

    @property
    def shares_batch(self) -> bool:
        """True when each device computes its own share of the batch at once: a
        data-parallel rank's, or a replica's (``Case.device_batch_size``)."""
        return self.data_parallel or self.replicas

    def unsupported_reason(self, rig: Rig) -> str | None:
        """Why this strategy cannot run on ``rig``, or None when it can."""
        if self.needs_cuda and rig.kind != "cuda":
            return f"{self.name} needs CUDA devices; on a {rig.kind} rig it would not be parallel"
        if rig.gpu_slots > 1 and self.shared_gpu_unsupported and self.num_devices(rig) > 1:
            return f"--gpu-slots {rig.gpu_slots}: {self.shared_gpu_unsupported}"
        need = self.num_devices(rig)
        if need > rig.num_devices:
            return f"{self.name} needs {need} devices; rig {rig.label} has {rig.num_devices}"
        return None


def all_devices(rig: Rig) -> int:
    return rig.num_devices


def one_device(rig: Rig) -> int:
    return 1


def two_devices(rig: Rig) -> int:
    return 2
