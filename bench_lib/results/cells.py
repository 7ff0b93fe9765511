"""A cases.csv row as the runner builds it (``Row``: column -> cell) and the two ways of
writing a cell that the modules making its columns share: a per-device figure
(``by_device``) and a figure that could not be had (``finite``: an empty cell)."""

from __future__ import annotations

import math
from typing import Any

Row = dict[str, Any]


def by_device(values: dict[str, float]) -> str:
    """``0:812.3;1:790.1``: a per-device column's text."""
    return ";".join(f"{k}:{v:.1f}" for k, v in sorted(values.items()))


def finite(x: float) -> float | None:
    """``x``, or None (an empty cell) where it is NaN: a figure that could not be had."""
    return None if math.isnan(x) else x
