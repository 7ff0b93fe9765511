"""What a ``distance`` run is asked to do: ``DistancePlan``, validated
(``bench_lib.commands.distance`` builds it from the flags; ``distance.benchmark.run_distance``
measures it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench_lib.distance.spec import DTYPES, METHODS, DistanceCase, Layer, new_case
from bench_lib.rig import Rig
from bench_lib.sweep.profile import Measurement, UsageError


@dataclass(frozen=True)
class DistancePlan:
    """A distance run, validated (``bench_lib.commands.distance`` builds it from the flags)."""

    layers: tuple[Layer, ...]
    methods: tuple[str, ...]
    dtype: str
    """``fp32`` or ``fp64``."""
    block_rows: int
    loop_max_kernels: int
    seed: int
    measurement: Measurement

    def __post_init__(self) -> None:
        if not self.layers or not self.methods:
            raise UsageError("give at least one layer and one method")
        for method in self.methods:
            if method not in METHODS:
                raise UsageError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
        if self.dtype not in DTYPES:
            raise UsageError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.block_rows < 1 or self.loop_max_kernels < 1:
            raise UsageError(f"--block-rows ({self.block_rows}) and --loop-max-kernels "
                             f"({self.loop_max_kernels}) must be >= 1")

    def cases(self, rig: Rig) -> list[DistanceCase]:
        """Every (layer, method) case in layer order, methods in ``METHODS`` order; a
        UsageError where none of them can run."""
        cases = [new_case(rig, layer, m, self.dtype, self.block_rows, self.loop_max_kernels)
                 for layer in dict.fromkeys(self.layers) for m in METHODS if m in self.methods]
        if all(c.status for c in cases):
            raise UsageError("no case can run: " + "; ".join(
                dict.fromkeys(f"{c.method}: {c.reason}" for c in cases)))
        return cases

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"layers": [layer.label for layer in self.layers]}
