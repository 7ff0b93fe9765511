"""The parity verdict: does a strategy end where the strategy that computes its mathematics
ends, within a tolerance derived from the run itself?

BatchNorm-free models (``toy``, ``mlp``): every strategy computes the same mathematics as
``single``: the same weights, batches and learning rate, the same mean loss. What differs is
only the order in which float32 sums are taken (gradients all-reduced over ranks, accumulated
over micro-batches, reduced inside a different kernel), a perturbation of each step at the
size of float32 rounding. Training then carries any such perturbation along, and may amplify
it; how much, the run measures rather than guesses: ``single`` also trains in float64 from
the same start, and the largest distance between its float32 and float64 test losses over
the epochs, d, is what rounding alone does to this trajectory (the largest, not the last: one
epoch's distance can be near 0 by chance). A reduction-order change is a rounding
perturbation of the same size, so a strategy matches when its final test loss is within
``TOLERANCE_FACTOR`` x d of ``single``'s, and its test accuracy within ``TOLERANCE_FACTOR`` x
the most images rounding flipped (at least ``MIN_FLIPS``): the *rounding* tolerance. Past
that it ``diverged``: it trains a different model. ``LOSS_FLOOR`` of the loss is for runs
where rounding moves nothing (d = 0): 1e-5 is some 170 float32 roundings (2^-24 each) and far
below what different mathematics does (a gradient scaled wrongly, a micro-batch dropped, a
stale weight move the loss by 1e-3 or more within an epoch).

BatchNorm models (the ResNets) normalise each layer over the images one forward sees, and
keep running statistics (updated at every training forward, used in eval mode) for the
test. So the strategies differ in mathematics, not only in rounding, by what they normalise
over (``bn_statistics``):

- *whole batch*: ``single``, ``mp`` (the whole batch through each stage in turn), and
  ``ddp``/``fsdp`` with ``--sync-bn`` (SyncBatchNorm: mean and variance summed over the
  ranks, i.e. over the global batch; torch runs it on GPU inputs only, so a cpu rig records
  those cases ``unsupported``);
- *per micro-batch*: ``accum``, ``pipeline`` and the pipelining schedules (``gpipe``,
  ``1f1b`` ...) normalise each micro-batch of ``split_size`` images on its own, and update
  the running statistics once per micro-batch, in micro-batch order;
- *per rank*: ``ddp`` and ``fsdp`` normalise each rank's share of the batch, and each rank
  updates its own running statistics (DDP broadcasts rank 0's before every forward, FSDP2
  does not; rank 0's, the ones evaluated, are the same in both);
- *per device chunk*: ``dp`` normalises each GPU's contiguous chunk of the batch.

Two strategies with the same statistics still compute the same mathematics: the
micro-batch strategies feed every BatchNorm the same micro-batches in the same order as
``accum``, ``mp`` the same batches as ``single``, and ``fsdp`` the same shares as ``ddp``.
Each strategy is therefore compared with the first of its kind (``LEADERS``: ``single``,
``accum``, ``ddp``; ``compared_with`` in the verdicts), and a strategy that leads a kind
other than ``single``'s (``accum``, ``ddp``, or one whose leader did not run) with
``single``.

Against ``single``, with other statistics, the difference is real training, not a bug, and
the *seeds* tolerance applies: does the strategy end as near to ``single`` as ``single`` ends
to itself when only its seed changes? ``single`` also trains at ``SEED_RUNS`` further seeds
(other initial weights and shuffles; the same split, so the same test images), and its final
test losses at the K + 1 seeds give a sample standard deviation s (K degrees of freedom).
Were the strategy's final loss one more draw of that distribution, its distance to
``single``'s would have standard deviation sqrt(2) sigma; the two-sided ``SEEDS_CONFIDENCE``
prediction bound is t(K) x sqrt(2) x s. The shared start and shuffle only bring a strategy
nearer to ``single``, so the bound errs loose. A few seeds can agree by chance, though, more
closely than two models that are equally good but err on different test images, whose test
losses differ by the test set's own standard error e = sd / sqrt(n) (sd: the standard
deviation of ``single``'s final per-image losses over the n test images) times sqrt(2); e is
measured on n images, not estimated from a few seeds, so its bound is z x sqrt(2) x e with
the normal quantile z. The tolerance is the larger of the two; for the accuracy alike, with
the binomial sqrt(p (1 - p) / n) at ``single``'s mean error rate p for e. That floor is what
keeps the bound from flagging a real effect of the statistics: measured (resnet-tiny, 1
epoch), three seeds of ``single`` ended within 0.0011 of each other in test loss (t x
sqrt(2) x s = 0.015), ``accum`` and ``ddp`` 0.019 and 0.020 above them, and e = 0.013 (z x
sqrt(2) x e = 0.048).

Against a leader with the same statistics, only rounding differs, and a rounding difference
is bounded twice: by the rounding tolerance, and by the seeds tolerance, since a perturbation
that training amplifies (chaos) ends, at worst, as far as a change of seed; the tighter of
the two applies. It matters on a ResNet: measured on 2 CPU workers (resnet-tiny, 5 epochs,
lr 0.1 decayed), float32 and float64 ``single`` are 0.14 apart in test loss after the first
epoch and end 0.004 apart, as far as two seeds (s = 0.005), while ``mp``, ``fsdp`` and the
pipelining schedules end bit-identical to ``single``, ``ddp`` and ``accum``, and ``pipeline``
8e-4 from ``accum`` (one backward through the whole batch: other sums). The seeds tolerance
tells a strategy that learns differently (a wrong scale, a lost micro-batch, no learning)
from one that learns with other statistics; a subtler bug in ``accum`` or ``ddp`` themselves
shows on ``mlp``, where the rounding tolerance holds them to 1e-5 of the loss.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench_lib.strategies import Strategy

TOLERANCE_FACTOR = 10.0
"""How many times the float32-against-float64 distance a strategy may differ by."""
LOSS_FLOOR = 1e-5
"""The least loss tolerance, relative to ``single``'s final test loss."""
MIN_FLIPS = 1
"""The least accuracy tolerance, in test images."""
SEED_RUNS = 3
"""Further seeds ``single`` trains at on a BatchNorm model, for the seeds tolerance (K)."""
SEEDS_CONFIDENCE = 0.99
"""Two-sided confidence of the seeds tolerance's prediction bound."""
VERDICTS = ("reference", "match", "diverged", "unsupported", "skipped", "error")

NO_BN, BATCH, MICRO, RANK, DEVICE = ("", "whole batch", "per micro-batch", "per rank",
                                     "per device chunk")
"""What BatchNorm normalises over during training (``bn_statistics``); NO_BN: no BatchNorm."""
LEADERS = {NO_BN: "single", BATCH: "single", MICRO: "accum", RANK: "ddp"}
"""The strategy each kind of statistics is compared through (module docstring); a kind
without one (``DEVICE``) is compared with ``single`` under the seeds tolerance."""
OWN_STATISTICS = {"dp": DEVICE}
"""Strategies whose flags do not say it: ``dp``'s replicas normalise their own contiguous
chunk of the batch, not the interleaved share a ``ddp`` rank takes, so ``ddp`` is no twin."""


def bn_statistics(strategy: Strategy, batch_norm: bool, sync_bn: bool) -> str:
    """What a model's BatchNorm normalises over under ``strategy`` (module docstring)."""
    if not batch_norm:
        return NO_BN
    if strategy.data_parallel:
        return BATCH if sync_bn else RANK
    if strategy.uses_split:
        return MICRO
    return OWN_STATISTICS.get(strategy.name, BATCH)


def reference_of(strategy: str, stats: str, finished: Sequence[str]) -> tuple[str, bool]:
    """(the strategy ``strategy`` is compared with, whether that one computes the same
    mathematics): the leader of its statistics when that finished, else ``single``."""
    leader = LEADERS.get(stats)
    if leader is not None and (leader == "single" or (leader in finished
                                                      and leader != strategy)):
        return leader, True
    return "single", False


@dataclass(frozen=True)
class Final:
    """A run's last epoch as the verdict reads it."""

    test_loss: float
    test_accuracy: float | None
    test_loss_sd: float = 0.0
    """Standard deviation of the loss over the test images."""


@dataclass(frozen=True)
class Tolerance:
    """How far a strategy's final test loss and accuracy may be from its reference's."""

    loss: float
    accuracy: float | None
    """As a share of the test set (None for a regression)."""
    note: str
    """How it was derived, with the numbers."""
    kind: str = "rounding"
    """``rounding`` (float32 against float64) or ``seeds`` (``single``'s seed spread)."""


def tolerance(single: Sequence[Final], single_fp64: Sequence[Final], test_size: int
              ) -> Tolerance:
    """The rounding tolerance from ``single``'s float32 and float64 epochs (module
    docstring)."""
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


def prediction_factor(samples: int, confidence: float = SEEDS_CONFIDENCE) -> float:
    """t(samples - 1) x sqrt(2): the bound on one more draw's distance to one of the draws,
    in sample standard deviations; 0 samples: a standard deviation known, not estimated
    (the normal quantile z x sqrt(2))."""
    if samples == 0:
        return statistics.NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(2)
    from bench_lib.analysis.stats import t_quantile

    return t_quantile(confidence, samples - 1) * math.sqrt(2)


def seeds_tolerance(finals: Sequence[Final], test_size: int) -> Tolerance:
    """The seeds tolerance from ``single``'s final figures at its seeds (module docstring);
    ``finals[0]`` is the run's own seed."""
    if len(finals) < 2:
        raise ValueError(f"the seeds tolerance needs 2 or more seeds, got {len(finals)}")
    t, z = prediction_factor(len(finals)), prediction_factor(0)
    spread = statistics.stdev(f.test_loss for f in finals)
    error = finals[0].test_loss_sd / math.sqrt(test_size)
    loss = max(t * spread, z * error, LOSS_FLOOR * abs(finals[0].test_loss))
    note = (f"loss: max(t x sqrt(2) x s over {len(finals)} seeds of single = {t:.3g} x "
            f"{spread:.3g}, z x sqrt(2) x its standard error = {z:.3g} x {error:.3g}) = "
            f"{loss:.3g}")
    accuracies = [f.test_accuracy for f in finals if f.test_accuracy is not None]
    if len(accuracies) < len(finals):
        return Tolerance(loss, None, note, "seeds")
    wrong = 1 - statistics.fmean(accuracies)
    binomial = math.sqrt(wrong * (1 - wrong) / test_size)
    s_acc = statistics.stdev(accuracies)
    accuracy = max(t * s_acc, z * binomial, MIN_FLIPS / test_size)
    return Tolerance(loss, accuracy,
                     note + f"; accuracy: max({t:.3g} x {s_acc:.3g}, {z:.3g} x binomial "
                            f"{binomial:.3g}) = {accuracy:.3g} ({accuracy * test_size:.1f} of "
                            f"{test_size} test images)", "seeds")


def tighter(a: Tolerance, b: Tolerance | None) -> Tolerance:
    """The tighter of two bounds on one difference (by the loss; ``a`` when ``b`` is None)."""
    return a if b is None or a.loss <= b.loss else b


@dataclass(frozen=True)
class Judgement:
    """A strategy's final test figures against its reference's."""

    verdict: str
    """``match`` or ``diverged``."""
    loss_diff: float
    accuracy_diff: float | None


def judge(final: Final, reference: Final, tol: Tolerance) -> Judgement:
    """``match`` when both figures are within the tolerance of the reference's."""
    loss_diff = abs(final.test_loss - reference.test_loss)
    acc_diff = (None if final.test_accuracy is None or reference.test_accuracy is None
                else abs(final.test_accuracy - reference.test_accuracy))
    within = loss_diff <= tol.loss and (
        acc_diff is None or tol.accuracy is None or acc_diff <= tol.accuracy + 1e-12)
    return Judgement("match" if within else "diverged", loss_diff, acc_diff)
