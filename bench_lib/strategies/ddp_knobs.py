"""The DistributedDataParallel settings a case carries (``DdpKnobs``: torch's defaults
unless the sweep's knob lists say otherwise) and how a sweep combines its lists
(``knob_grid``). Plain data, torch-free: the strategy's build context (``base``), the sweep
(``sweep.profile``, ``sweep.cases``) and the runner read them; ``ddp`` applies them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
