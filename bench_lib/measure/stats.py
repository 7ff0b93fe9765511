"""Summary statistics of per-step times: a tiny pure object."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def bootstrap_median_ci(
    values: Sequence[float], confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median (deterministic seed)."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    resamples = rng.choice(data, size=(BOOTSTRAP_RESAMPLES, data.size), replace=True)
    medians = np.median(resamples, axis=1)
    alpha = (1 - confidence) / 2
    return float(np.quantile(medians, alpha)), float(np.quantile(medians, 1 - alpha))


@dataclass(frozen=True)
class Stats:
    """Summary of a sample of step times, in seconds."""

    n: int
    median: float
    mean: float
    stdev: float
    p10: float
    p90: float
    iqr: float
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Summarise ``values`` (at least one)."""
        if len(values) == 0:
            raise ValueError("cannot summarise an empty sample")
        ci_low, ci_high = bootstrap_median_ci(values)
        return cls(
            n=len(values),
            median=statistics.median(values),
            mean=statistics.fmean(values),
            stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
            p10=percentile(values, 10),
            p90=percentile(values, 90),
            iqr=percentile(values, 75) - percentile(values, 25),
            ci_low=ci_low,
            ci_high=ci_high,
        )

    @property
    def ci_half_width_rel(self) -> float:
        """Half-width of the median's confidence interval relative to the median."""
        if math.isnan(self.ci_low) or self.median == 0:
            return float("inf")
        return (self.ci_high - self.ci_low) / 2 / self.median

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}
