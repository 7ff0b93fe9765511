"""A case as the step-time predictor sees it (``Shape``), and ``shape_of``, which makes it
from a ``sweep.cases.Case`` on a rig: kept small so the prediction's arithmetic
(``prediction.step_time``, ``prediction.pipeline_time``) is tested without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_lib.rig import Rig
    from bench_lib.sweep.cases import Case


@dataclass(frozen=True)
class Shape:
    """What the predictor needs of a case (``shape_of`` builds it from a
    ``sweep.cases.Case``): kept small so the arithmetic is tested without torch."""

    strategy: str
    batch: int
    devices: int = 1
    split: int | None = None
    """Micro-batch size (pipelines, accum); None: the whole batch at once."""
    workload_batch: int | None = None
    """Single's batch this case is compared with (weak scaling: the per-device batch)."""
    serial: bool = False
    """One process runs every stage in turn (mp; ``pipeline`` on a cpu rig)."""
    overlap: bool = False
    """Collectives overlap compute (GPUs); on a cpu rig they share the cores: added."""
    hook: str = "none"
    """DDP's communication hook."""
    bucket_cap_mb: float | None = None
    optimizer_share: float = 1.0
    """The share of the optimizer step one device runs (``Case.optimizer_share``)."""
    device_batch: int = field(kw_only=True)
    """Images one device computes at once: ``Case.device_batch_size``, carried (never
    worked out again here)."""

    @property
    def microbatches(self) -> int:
        return self.batch // self.split if self.split else 1


def shape_of(case: Case, rig: Rig) -> Shape:
    """The predictor's view of ``case`` on ``rig``."""
    knobs = case.ddp
    return Shape(case.strategy, case.batch_size, case.world_size, case.split_size,
                 case.workload_batch,
                 serial=case.strategy == "mp" or (case.strategy == "pipeline"
                                                 and rig.kind == "cpu"),
                 overlap=rig.kind == "cuda",
                 hook=knobs.comm_hook if knobs is not None else "none",
                 bucket_cap_mb=knobs.bucket_cap_mb if knobs is not None else None,
                 optimizer_share=case.optimizer_share, device_batch=case.device_batch_size)
