"""What a ``run`` is asked to do: ``RunPlan``, the launcher, the rig, the profile and its
cases, every input checked before the run folder exists (``bench_lib.commands.plan`` builds
it from the flags; ``commands.run`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_lib.launch.torchrun import Launcher
    from bench_lib.prediction.calibration_file import GivenCalibrations
    from bench_lib.rig import Rig
    from bench_lib.run.shard import ShardPlan, SweepRecord
    from bench_lib.sweep.cases import Case
    from bench_lib.sweep.profile import Profile


@dataclass(frozen=True)
class RunPlan:
    """A run's plan, every input checked (nothing written yet)."""

    launcher: Launcher
    rig: Rig
    profile: Profile
    cases: list[Case]
    sweep: SweepRecord | None
    """This shard's record (``--shard``, or a resumed shard's), else None."""
    cut: ShardPlan | None
    given: GivenCalibrations | None
    """The calibrations ``--calibration`` named, else None."""
