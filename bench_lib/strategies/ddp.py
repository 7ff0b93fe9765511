"""``ddp``: DistributedDataParallel, one process per device, the global batch split over ranks.

``ddp-1`` is the same wrapper on one device (a process group of one, as PyTorch's own DDP
benchmark runs it): beside ``single`` its speedup is the wrapper's own cost (the reducer's
autograd hooks, the copies into its buckets, a one-rank all-reduce), with no peer to talk to.

The knobs people tune (``DdpKnobs``: bucket size, gradients as bucket views, static graph,
a communication hook) are carried on the case and applied here. What a hook does to the
arithmetic, and so to the transparency claim, is said in ``DdpKnobs.arithmetic_note``:

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
import itertools
import math
from collections.abc import Sequence
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

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
"""The communication hooks a case may register (``DdpKnobs.comm_hook``)."""
KNOB_GRIDS = ("product", "one-at-a-time")
"""How a sweep combines its knob lists (``knob_grid``)."""
TORCH_BUCKET_CAP_MB = 25.0
"""DDP's bucket cap when none is given (its first bucket is then 1 MiB)."""
POWERSGD_START_ITER = 2
"""Backward passes PowerSGD all-reduces uncompressed before it compresses: the least torch
allows with error feedback or warm start (DDP rebuilds its buckets after the first)."""
POWERSGD_MIN_COMPRESSION_RATE = 2.0
"""Torch's default: a matrix is compressed only where (rows + cols) x rank x 2 < rows x cols;
the others (biases, BatchNorm, small layers) are all-reduced uncompressed."""
POWERSGD_WARMUP_STEPS = POWERSGD_START_ITER + 1
"""Least warm-up of a PowerSGD case, so that every timed step is compressed and the first
compressed step (which allocates P, Q and the error memory) is discarded with the warm-up."""
POWERSGD_GLOO_NOTE = ("on gloo each bucket's PowerSGD all-reduces start once the previous "
                      "bucket's are done (torch's hook issues them from callbacks, in an order "
                      "gloo does not keep across ranks), so less of them hides behind backward")
"""The row's note on a PowerSGD case over gloo (``powersgd_in_order``)."""
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
"""Unit roundoff of each compressing hook's format (half its machine epsilon)."""


@dataclass(frozen=True)
class DdpKnobs:
    """The DistributedDataParallel settings of a case (defaults: torch's own)."""

    bucket_cap_mb: float | None = None
    """Bucket size cap in MiB; None: torch's default, 25 MiB after a first bucket of 1 MiB
    (an explicit 25 makes the first bucket 25 MiB too, so it is not the default)."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into the all-reduce buckets (no copy into them, no second copy of
    the gradients). The trainer then zeroes gradients in place instead of setting them to
    None, without which torch allocates and copies each step anyway."""
    static_graph: bool = False
    """DDP is told the graph never changes (it stops searching it for unused parameters and
    may reorder its buckets after the first step)."""
    comm_hook: str = "none"
    """Communication hook (``COMM_HOOKS``): ``none`` (DDP's all-reduce), ``fp16``/``bf16``
    (gradients compressed to that format for the all-reduce), ``powersgd`` (rank-
    ``powersgd_rank`` approximation of each gradient matrix)."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank (read only when ``comm_hook`` is ``powersgd``)."""

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)
                                or not math.isfinite(cap) or cap <= 0):
            raise ValueError(f"ddp bucket_cap_mb must be a positive number of MiB or "
                             f"'default' (torch's), got {cap!r}")
        for name in ("gradient_as_bucket_view", "static_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ddp {name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"unknown ddp comm hook {self.comm_hook!r}; valid: "
                             f"{', '.join(COMM_HOOKS)}")
        rank = self.powersgd_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"ddp powersgd_rank must be a positive integer, got {rank!r}")

    @property
    def hook_label(self) -> str:
        """The hook as rows record it: ``none``, ``fp16``, ``bf16``, ``powersgd-r1``..."""
        if self.comm_hook == "powersgd":
            return f"powersgd-r{self.powersgd_rank}"
        return self.comm_hook

    @property
    def id_suffix(self) -> str:
        """Case-id suffix of the knobs that differ from torch's defaults (empty for those)."""
        cap = self.bucket_cap_mb
        return "".join([
            "" if cap is None else f"_bucket{cap:g}",
            "_gradview" if self.gradient_as_bucket_view else "",
            "_static" if self.static_graph else "",
            "" if self.comm_hook == "none" else f"_{self.hook_label}",
        ])

    @property
    def arithmetic_note(self) -> str:
        """How the hook changes the gradients, for the row's note (empty: it does not)."""
        if self.comm_hook in UNIT_ROUNDOFF:
            return (f"{self.comm_hook}-compressed gradient all-reduce: gradients not equal to "
                    f"single's (each rank's share rounded to {self.comm_hook}, summed in it; "
                    f"unit roundoff {UNIT_ROUNDOFF[self.comm_hook]:.3g})")
        if self.comm_hook == "powersgd":
            return (f"PowerSGD rank {self.powersgd_rank}: gradients not equal to single's "
                    f"(rank-{self.powersgd_rank} approximation with error feedback and warm "
                    f"start; compressed from step {POWERSGD_START_ITER + 1}, min compression "
                    f"rate {POWERSGD_MIN_COMPRESSION_RATE:g}; at least "
                    f"{POWERSGD_WARMUP_STEPS} warm-up steps, so every timed step is "
                    "compressed)")
        return ""


def knob_grid(bucket_cap_mb: Sequence[float | None] = (None,),
              gradient_as_bucket_view: Sequence[bool] = (False,),
              static_graph: Sequence[bool] = (False,), comm_hooks: Sequence[str] = ("none",),
              powersgd_rank: Sequence[int] = (1,), grid: str = "product",
              ) -> tuple[DdpKnobs, ...]:
    """The knob combinations a sweep runs, from one list per knob (duplicates dropped).

    ``product``: every combination (PowerSGD once per rank, the other hooks once).
    ``one-at-a-time``: the combination of each list's first value, then each other value of
    each list with the rest at those first values (the hook and PowerSGD rank are one
    dimension: ``powersgd`` once per rank).
    """
    if grid not in KNOB_GRIDS:
        raise ValueError(f"unknown ddp knob grid {grid!r}; valid: {', '.join(KNOB_GRIDS)}")
    lists = {"bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": gradient_as_bucket_view,
             "static_graph": static_graph, "comm_hooks": comm_hooks,
             "powersgd_rank": powersgd_rank}
    empty = [name for name, values in lists.items() if not values]
    if empty:
        raise ValueError(f"ddp {empty[0]} needs at least one value")
    for r in powersgd_rank:  # checked even where no powersgd is swept (it would be unused)
        DdpKnobs(powersgd_rank=r)
    hooks = [(h, r) for h in comm_hooks for r in (powersgd_rank if h == "powersgd" else (1,))]
    dims: list[list[dict[str, object]]] = [
        [{"bucket_cap_mb": v} for v in bucket_cap_mb],
        [{"gradient_as_bucket_view": v} for v in gradient_as_bucket_view],
        [{"static_graph": v} for v in static_graph],
        [{"comm_hook": h, "powersgd_rank": r} for h, r in hooks],
    ]
    if grid == "product":
        combos = [{k: v for part in parts for k, v in part.items()}
                  for parts in itertools.product(*dims)]
    else:
        base = {k: v for dim in dims for k, v in dim[0].items()}
        combos = [base] + [base | value for dim in dims for value in dim[1:]]
    return tuple(dict.fromkeys(DdpKnobs(**c) for c in combos))  # type: ignore[arg-type]


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


def register_hook(model: DistributedDataParallel, knobs: DdpKnobs) -> None:
    """Register ``knobs``' communication hook on the wrapped model (none: DDP's own).

    PowerSGD over gloo runs in bucket order (``powersgd_in_order``); over NCCL as torch's.
    """
    if knobs.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif knobs.comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif knobs.comm_hook == "powersgd":
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

    def without_communication(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync``: the reducer's hooks run but no bucket is all-reduced (nor
        hooked); gradients stay local."""
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
