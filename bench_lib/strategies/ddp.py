"""``ddp``: DistributedDataParallel, one process per device, the global batch split over ranks.

``ddp-1`` is the same wrapper on one device (a process group of one, as PyTorch's own DDP
benchmark runs it): beside ``single`` its speedup is the wrapper's own cost (the reducer's
autograd hooks, the copies into its buckets, a one-rank all-reduce), with no peer to talk to.

The knobs people tune (``ddp_knobs.DdpKnobs``: bucket size, gradients as bucket views,
static graph, a communication hook) are carried on the case and applied here. What a hook
does to the arithmetic, and so to the transparency claim, is said in
``DdpKnobs.arithmetic_note``:

- ``fp16`` / ``bf16`` (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``): each
  rank's gradient bucket is rounded to fp16 / bf16 and divided by the world size, summed in
  that format, and cast back. Each element of the average is off by at most about
  2 u x mean over ranks of |that rank's gradient| (u = 2^-11 fp16, 2^-8 bf16: one rounding
  of each rank's share, one of their sum; fp16 adds an absolute 2^-24 per rank where a share
  falls below its normal range), which ``tests/test_ddp_knobs.py`` checks.
- ``powersgd`` (``powerSGD_hook.powerSGD_hook``): each bucket's matrices are replaced by a
  rank-r approximation P Q^T (error feedback and warm start on, torch's defaults). Its
  gradients are not equal to single's and no tolerance is claimed: the tests check what does
  hold (exact before compression starts, identical on every rank, rank <= r where compressed,
  training still lowers the loss).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, which mypy cannot see
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bench_lib.strategies.base import (
    BuildContext,
    Strategy,
    Trainer,
    all_devices,
    one_device,
)
from bench_lib.strategies.ddp_knobs import (
    POWERSGD_MIN_COMPRESSION_RATE,
    POWERSGD_START_ITER,
    DdpKnobs,
)


def bf16_hook_refusal() -> str | None:
    """Why DDP would refuse the bf16 hook with this torch build, or None: torch registers it
    only with CUDA and NCCL 2.10+ (or XPU and XCCL) built in, whatever the backend used."""
    cuda = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (
        2, 10)
    xccl = dist.is_available() and dist.is_xccl_available() and torch.xpu.is_available()
    if (cuda and nccl) or xccl:
        return None
    return ("torch's bf16_compress_hook needs a torch built with CUDA and NCCL 2.10+ (or XPU "
            f"and XCCL); this one ({torch.__version__}) has neither")


@dataclass
class InOrder:
    """PowerSGD's state, and the future of the bucket hooked last (``powersgd_in_order``)."""

    state: powerSGD_hook.PowerSGDState
    last: torch.futures.Future[torch.Tensor] | None = None


def powersgd_in_order(state: InOrder, bucket: GradBucket,
                      ) -> torch.futures.Future[torch.Tensor]:
    """Torch's PowerSGD hook, each bucket's started once the previous bucket's is done.

    The hook issues its later all-reduces (of P, then of Q) from its futures' callbacks, so
    over several buckets their order on the process group depends on timing; gloo pairs
    collectives by order, and ranks that issue them in different orders hang or mix
    buckets (seen on 2 cpu ranks of resnet-tiny with 0.5 MiB buckets). Waiting here keeps
    the order on every rank; the backward pass overlaps each bucket's reduction only until
    the next bucket is ready (``POWERSGD_GLOO_NOTE``).
    """
    if state.last is not None:
        state.last.wait()
    state.last = powerSGD_hook.powerSGD_hook(state.state, bucket)
    return state.last


# DDP checks a hook's annotations against the classes themselves (this module's are strings).
powersgd_in_order.__annotations__ = {
    "state": InOrder, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]}


_CUDA_SYNCHRONIZE = torch.cuda.synchronize


def _synchronize_cuda_only(device: torch.device | int | str | None = None) -> None:
    """``torch.cuda.synchronize``, a no-op for a CPU device (``tolerate_powersgd_on_cpu``)."""
    if isinstance(device, torch.device) and device.type == "cpu":
        return
    _CUDA_SYNCHRONIZE(device)


def tolerate_powersgd_on_cpu(device: torch.device) -> None:
    """Let torch's PowerSGD hook reduce CPU buckets in a process that sees a GPU.

    Its ``decompress`` calls ``torch.cuda.synchronize(device)`` whenever
    ``torch.cuda.is_available()``, whatever the bucket's device (torch 2.11 through 2.15.0,
    the newest checked), so a cpu rig's PowerSGD case on a GPU box dies with "Expected a
    cuda device, but got: cpu". The call runs in an all-reduce future's callback, after any
    scope of ours has closed, so from here on this process's ``torch.cuda.synchronize``
    skips CPU devices (and does the same as before for everything else). Only a rank that
    reduces on the CPU while CUDA is visible installs it: a cpu rig's rank, which
    synchronizes no GPU.
    """
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize = _synchronize_cuda_only


def register_hook(model: DistributedDataParallel, knobs: DdpKnobs) -> None:
    """Register ``knobs``' communication hook on the wrapped model (none: DDP's own).

    PowerSGD over gloo runs in bucket order (``powersgd_in_order``); over NCCL as torch's.
    """
    if knobs.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif knobs.comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif knobs.comm_hook == "powersgd":
        tolerate_powersgd_on_cpu(next(model.module.parameters()).device)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=knobs.powersgd_rank,
            start_powerSGD_iter=POWERSGD_START_ITER,
            min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
            use_error_feedback=True, warm_start=True, random_seed=0)
        if dist.get_backend() == "gloo":
            model.register_comm_hook(InOrder(state), powersgd_in_order)
        else:
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


class DdpTrainer(Trainer):
    """A DDP rank's trainer: with gradients as bucket views it zeroes them in place, so that
    they stay views (set to None, torch would allocate and copy them every step)."""

    def __init__(self, module: nn.Module, devices: list[torch.device], ctx: BuildContext,
                 params: list[nn.Parameter], knobs: DdpKnobs) -> None:
        super().__init__(module, devices, ctx, params=params)
        self.knobs = knobs

    def without_communication(self) -> contextlib.AbstractContextManager[Any] | None:
        """DDP's ``no_sync``: the reducer's hooks run but no bucket is all-reduced (nor
        hooked); gradients stay local. Not free of collectives: each forward still
        broadcasts the BatchNorm buffers from rank 0 (``broadcast_buffers``, on), a small
        part of the step but one a failed peer leaves this rank waiting in
        (``launch.diagnostics``). None with SyncBatchNorm: its forward all-gathers every
        layer's statistics whatever ``no_sync`` says, a large part of the step."""
        if any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules()):
            return None
        assert isinstance(self.module, DistributedDataParallel)
        return self.module.no_sync()

    def zero_grad(self) -> None:
        """Clear the gradients: in place where they are bucket views, else set to None."""
        self.optimizer.zero_grad(set_to_none=not self.knobs.gradient_as_bucket_view)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.zero_grad()
        self.forward_backward(x, y)
        self.optimizer.step()


def build(model: nn.Module, devices: list[torch.device], ctx: BuildContext) -> Trainer:
    """Wrap the model for this rank; the process group must already be initialised."""
    (device,) = devices
    model = model.to(device)
    if ctx.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    knobs = ctx.ddp or DdpKnobs()
    ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(
        model, device_ids=ids, bucket_cap_mb=knobs.bucket_cap_mb,
        gradient_as_bucket_view=knobs.gradient_as_bucket_view, static_graph=knobs.static_graph)
    register_hook(wrapped, knobs)
    return DdpTrainer(wrapped, devices, ctx, list(model.parameters()), knobs)


STRATEGY = Strategy(
    name="ddp",
    description="DistributedDataParallel, one process per device (NCCL on GPUs, gloo on CPUs)",
    build=build,
    num_devices=all_devices,
    per_device_processes=True,
    data_parallel=True,
    ddp_knobs=True,
    cpu_note="one process per cpu worker, gradients all-reduced through gloo over loopback",
)

ONE_DEVICE = Strategy(
    name="ddp-1",
    description="DistributedDataParallel on one device, a process group of one: beside "
                "single, the wrapper's own overhead",
    build=build,
    num_devices=one_device,
    per_device_processes=True,
    data_parallel=True,
    ddp_knobs=True,
    cpu_note="one cpu worker's cores in a gloo group of one: its speedup vs single is DDP's "
             "own cost (reducer hooks, bucket copies, a one-rank all-reduce), no peer",
)
