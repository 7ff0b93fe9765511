"""What a ``tune`` is asked to do beyond its sweep: ``TunePlan`` (``bench_lib.commands.tune``
builds it from the flags; the rig and the profile with the sweep flags over it travel beside
it, resolved as ``run`` resolves them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench_lib.sweep.profile import UsageError


@dataclass(frozen=True)
class TunePlan:
    """The race's limits, where its run folder goes, what it prints, and what the command
    that reproduces the winner repeats; a bad limit is a ``UsageError`` (exit 2, nothing
    written)."""

    out: Path
    """The folder that receives the run folder (``--out``)."""
    budget_fraction: float
    """The launch time budget as a share of the exhaustive sweep's (``RaceSettings``)."""
    time_budget_s: float | None
    """The launch time budget in seconds; None: none (with ``budget_fraction``: the
    smaller)."""
    max_rungs: int
    """Rungs at most, rung 0 included."""
    seed: int
    """Seeds each rung's launch order."""
    quiet: bool = False
    """Print only the run folder."""
    dry_run: bool = False
    """Print the space and the plan; launch nothing."""
    profile: str = "default"
    """``--profile`` as given, a name or a ``.toml`` path: the reproducing command's."""
    measurement_flags: tuple[str, ...] = ()
    """The measurement flags given (``--timed-steps 4`` ...), repeated in the reproducing
    command."""

    def __post_init__(self) -> None:
        if self.max_rungs < 1 or self.budget_fraction <= 0 or (
                self.time_budget_s is not None and self.time_budget_s <= 0):
            raise UsageError(f"--max-rungs must be >= 1 (got {self.max_rungs}), "
                             f"--budget-fraction and --time-budget-s positive (got "
                             f"{self.budget_fraction}, {self.time_budget_s})")
