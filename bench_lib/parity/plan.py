"""What a ``parity`` run is asked to do: ``ParityPlan``, validated (``bench_lib.commands.parity``
builds it from the flags; ``parity.check.run_parity`` trains it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench_lib import strategies
from bench_lib.math_modes import DEFAULT_MATH_MODE, MATH_MODES
from bench_lib.parity.data import dataset, parity_workload
from bench_lib.sweep.profile import UsageError
from bench_lib.sweep.refusals import model_facts
from bench_lib.workloads import MODELS


@dataclass(frozen=True)
class ParityPlan:
    """A parity run, validated: its models, strategies and training settings
    (``bench_lib.commands.parity`` builds it from the flags)."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    epochs: int
    batch_size: int
    split_size: int
    lr: float
    seed: int
    """Seeds the weights, the shuffles and the split (``single``'s seed runs add 1, 2 ...
    to it for their weights and shuffles only)."""
    seed_runs: int = 3
    """Further seeds of ``single`` on a BatchNorm model (``verdict.SEED_RUNS``)."""
    sync_bn: bool = False
    """SyncBatchNorm in ``ddp`` and ``fsdp`` (GPU rigs)."""
    data_root: Path | None = None
    """The user's MNIST / CIFAR-10 folder (``parity.data``); None: the digits."""
    math_mode: str = DEFAULT_MATH_MODE
    """The fp32 math every run computes in (``math_modes.MATH_MODES``; env.json records its
    flags)."""

    def __post_init__(self) -> None:
        if self.math_mode not in MATH_MODES:
            raise UsageError(f"unknown math mode {self.math_mode!r}; valid: "
                             f"{', '.join(MATH_MODES)}")
        for model in self.models:
            if model not in MODELS:
                raise UsageError(f"unknown model {model!r}; valid: {', '.join(sorted(MODELS))}")
        for name in self.strategies:
            strategies.get(name)  # a ValueError naming the known ones
        if "single" not in self.strategies:
            raise UsageError("parity compares every strategy with single: include it")
        if min(self.epochs, self.batch_size, self.split_size) < 1 or self.lr <= 0:
            raise UsageError("epochs, batch size and split size must be >= 1 and lr > 0")
        if self.split_size > self.batch_size:
            raise UsageError(f"split size {self.split_size} is larger than batch size "
                             f"{self.batch_size}")
        if self.seed_runs < 2 and any(model_facts(m).batch_norm for m in self.models):
            raise UsageError(f"--seed-runs {self.seed_runs}: a BatchNorm model's tolerance "
                             "needs single at 2 or more further seeds")
        if self.data_root is not None:
            if not self.data_root.is_dir():
                raise UsageError(f"--data-root {self.data_root} is not a folder")
            for model in self.models:  # exit 2 before anything is written
                dataset(parity_workload(model, self.batch_size), self.seed, self.data_root)
