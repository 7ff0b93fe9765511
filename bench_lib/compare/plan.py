"""What a ``compare`` is asked to do: ``ComparePlan`` (``bench_lib.commands.compare`` builds it
from the flags; ``run --compare-to`` too, on the run folder it wrote), handed to
``compare.output.run_compare``. Never imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench_lib.compare.verdicts import DEFAULT_THRESHOLD_PCT


@dataclass(frozen=True)
class ComparePlan:
    """A ``compare`` as its flags ask for it (``bench_lib.commands.compare`` builds it; ``run
    --compare-to`` too, on the run folder it wrote)."""

    baseline: Path
    """A run folder, its cases.csv, or a baseline store (``compare.baseline``)."""
    candidate: Path
    """A run folder or its cases.csv."""
    threshold_pct: float = DEFAULT_THRESHOLD_PCT
    """The smallest change in percent that counts."""
    metric: str = "auto"
    """What decides a verdict (``verdicts.METRICS``)."""
    allow_different_hardware: bool = False
    """Compare runs whose hardware fingerprints differ."""
    markdown: Path | None = None
    """Where to write the Markdown for a pull-request comment."""
    json_path: Path | None = None
    """Where to write github-action-benchmark's ``customBiggerIsBetter`` JSON."""
