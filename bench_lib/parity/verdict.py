"""The parity verdict: does a strategy end where ``single`` ends, within a tolerance derived
from float32 rounding?

For a model without BatchNorm (``toy``, ``mlp``) every strategy computes the same
mathematics as ``single``: the same weights, batches and learning rate, the same mean loss.
What differs is only the order in which float32 sums are taken (gradients all-reduced over
ranks, accumulated over micro-batches, reduced inside a different kernel), a perturbation
of each step at the size of float32 rounding. Training then carries any such perturbation
along, and may amplify it; how much, the run measures rather than guesses: ``single`` also
trains in float64 from the same start, and the largest distance between its float32 and
float64 test losses over the epochs, d, is what rounding alone does to this trajectory (the
largest, not the last: one epoch's distance can be near 0 by chance). A reduction-order
change is a rounding perturbation of the same size, so a strategy matches when its final
test loss is within ``TOLERANCE_FACTOR`` x d of ``single``'s, and its test accuracy within
``TOLERANCE_FACTOR`` x the most images rounding flipped (at least ``MIN_FLIPS``). Past that
it ``diverged``: it trains a different model.

The floor, ``LOSS_FLOOR`` of the loss, is for runs where rounding moves nothing (d = 0):
1e-5 is some 170 float32 roundings (2^-24 each) and far below what different mathematics
does (a gradient scaled wrongly, a micro-batch dropped, a stale weight move the loss by 1e-3
or more within an epoch). Measured on 2 CPU workers (mlp, toy; 10 epochs): strategies end
within 4.5e-8 of single's test loss (0.125), fp32 and fp64 within 1.3e-8.

Models with BatchNorm compute per-rank or per-micro-batch statistics, which is other
mathematics, not rounding; they need a looser, stated tolerance and are not judged here yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TOLERANCE_FACTOR = 10.0
"""How many times the float32-against-float64 distance a strategy may differ by."""
LOSS_FLOOR = 1e-5
"""The least loss tolerance, relative to ``single``'s final test loss."""
MIN_FLIPS = 1
"""The least accuracy tolerance, in test images."""
VERDICTS = ("reference", "match", "diverged", "unsupported", "skipped", "error")


@dataclass(frozen=True)
class Final:
    """A run's last epoch as the verdict reads it."""

    test_loss: float
    test_accuracy: float | None


@dataclass(frozen=True)
class Tolerance:
    """How far a strategy's final test loss and accuracy may be from ``single``'s."""

    loss: float
    accuracy: float | None
    """As a share of the test set (None for a regression)."""
    note: str
    """How it was derived, with the numbers."""


def tolerance(single: Sequence[Final], single_fp64: Sequence[Final], test_size: int
              ) -> Tolerance:
    """The tolerance from ``single``'s float32 and float64 epochs (module docstring)."""
    pairs = list(zip(single, single_fp64, strict=True))
    d = max(abs(a.test_loss - b.test_loss) for a, b in pairs)
    end = single[-1]
    loss = max(TOLERANCE_FACTOR * d, LOSS_FLOOR * abs(end.test_loss))
    note = (f"loss: max({TOLERANCE_FACTOR:g} x max |fp32 - fp64| = {TOLERANCE_FACTOR * d:.3g}, "
            f"{LOSS_FLOOR:g} x loss)")
    accuracies = [(a.test_accuracy, b.test_accuracy) for a, b in pairs]
    if any(x is None or y is None for x, y in accuracies):
        return Tolerance(loss, None, note)
    flips = max(round(abs(x - y) * test_size) for x, y in accuracies
                if x is not None and y is not None)
    allowed = max(MIN_FLIPS, TOLERANCE_FACTOR * flips)
    return Tolerance(loss, allowed / test_size,
                     note + f"; accuracy: max({MIN_FLIPS}, {TOLERANCE_FACTOR:g} x {flips} "
                            f"flipped) = {allowed:g} of {test_size} test images")


@dataclass(frozen=True)
class Judgement:
    """A strategy's final test figures against ``single``'s."""

    verdict: str
    """``match`` or ``diverged``."""
    loss_diff: float
    accuracy_diff: float | None


def judge(final: Final, single: Final, tol: Tolerance) -> Judgement:
    """``match`` when both figures are within the tolerance of ``single``'s."""
    loss_diff = abs(final.test_loss - single.test_loss)
    acc_diff = (None if final.test_accuracy is None or single.test_accuracy is None
                else abs(final.test_accuracy - single.test_accuracy))
    within = loss_diff <= tol.loss and (
        acc_diff is None or tol.accuracy is None or acc_diff <= tol.accuracy + 1e-12)
    return Judgement("match" if within else "diverged", loss_diff, acc_diff)
