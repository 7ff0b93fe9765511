"""The split search (``Profile.split_search``): which of a workload's candidate splits are
measured, decided from their predicted step times before the workload's first round.

Every split that divides the batch is a candidate case (``split_candidates``), marked with
its search as the sweep is expanded (``searched``); the runner predicts them all from the
workload's calibration, and ``settle`` keeps, per strategy, partition and scaling
(``search_key``), the predicted fastest and its nearest neighbours in split order, K in all
(at an edge: the next ones inward). The others
become ``skipped`` rows that keep their prediction, so the split trade-off figure draws the
predicted curve through every candidate beside the measured points::

    splits     1     2     4     8    16
    predicted 2.31  1.02  0.81  0.86  1.40     K = 3: 2, 4, 8 measured; 1, 16 skipped

Without a prediction (no calibration, or it failed) the K candidates nearest the profile's
first split size are measured, and the skipped rows say so. A batch-curve point that only
skipped candidates compute is skipped too: the curve does not grow with splits nobody
measures. Pure logic: cases and predictions in, decisions out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench_lib.sweep.batch_curve import curve_users
from bench_lib.sweep.cases import Case, SplitSearch
from bench_lib.sweep.profile import Profile

if TYPE_CHECKING:
    from bench_lib.analysis.bound import Bound

Prediction = tuple["Bound | str", "Bound | str"]
"""``prediction.predictor.Predictor.predict``'s answer: the case's step, and its single's."""


@dataclass(frozen=True)
class Choice:
    """The splits a search measures, and why."""

    measured: tuple[int, ...]
    """The measured splits, ascending."""
    best: int | None
    """The predicted fastest split; None where some candidate has no prediction."""
    why: str
    """How they were chosen, for the skipped candidates' reason."""


def split_candidates(batch_size: int) -> tuple[int, ...]:
    """The splits a split search predicts for a workload's batch: every one that divides it
    (equal micro-batches, which every pipelined strategy takes; a split that leaves a short
    last micro-batch computes what the nearest divisor does, plus a remainder), short of the
    whole batch: one micro-batch is no micro-batching (pipeline's would be mp's step,
    accum's single's, which those cases measure)."""
    return tuple(s for s in range(1, batch_size) if batch_size % s == 0)


def search_key(case: Case) -> tuple[object, ...]:
    """What a split search's candidates share: everything but the split."""
    return (case.strategy, case.group_key, case.option_suffix)


def searched(cases: list[Case], profile: Profile) -> list[Case]:
    """The cases with each split candidate's ``SplitSearch`` (``Profile.split_search``)."""
    runnable: dict[tuple[object, ...], int] = {}
    for case in cases:
        if case.micro is not None and case.status is None:
            runnable[search_key(case)] = runnable.get(search_key(case), 0) + 1
    out = []
    for case in cases:
        if case.micro is not None and profile.split_search_for(case.strategy):
            anchor = (profile.split_sizes[0] if profile.split_sizes
                      else math.ceil(case.workload_batch / profile.microbatches[0]))
            case = dataclasses.replace(case, split_search=SplitSearch(
                profile.split_search_for(case.strategy), runnable.get(search_key(case), 0),
                anchor))
        out.append(case)
    return out



def window(splits: Sequence[int], centre: int, k: int) -> tuple[int, ...]:
    """The ``k`` consecutive entries of ascending ``splits`` around index ``centre`` (an
    even ``k`` takes one more above it), moved inward at an edge (all where there are
    fewer)."""
    start = min(max(0, centre - (k - 1) // 2), max(0, len(splits) - k))
    return tuple(splits[start:start + k])


def choose(predicted_s: Mapping[int, float | None], k: int, anchor: int,
           no_prediction: str = "no prediction") -> Choice:
    """The ``k`` splits to measure of candidates ``split -> predicted seconds`` (None: no
    prediction): the fastest and its neighbours; a tie goes to the split nearer ``anchor``,
    then the smaller. Without every prediction, the ``k`` nearest ``anchor``."""
    splits = sorted(predicted_s)
    times = {s: t for s, t in predicted_s.items() if t is not None}
    if len(times) < len(splits):
        near = min(range(len(splits)), key=lambda i: (abs(splits[i] - anchor), splits[i]))
        measured = window(splits, near, k)
        return Choice(measured, None, f"measures the {len(measured)} splits nearest the "
                      f"profile's split {anchor} ({_listed(measured)}), for want of a "
                      f"prediction ({no_prediction})")
    best = min(splits, key=lambda s: (times[s], abs(s - anchor), s))
    measured = window(splits, splits.index(best), k)
    others = [s for s in measured if s != best]
    return Choice(measured, best, f"measures the predicted best, split {best} at "
                  f"{times[best]:.3g} s, and its neighbours ({_listed(others) or 'none'})")


def _listed(splits: Sequence[int]) -> str:
    return ", ".join(map(str, splits))


def _search_title(case: Case) -> str:
    partition = f", {case.partition} cut" if case.partition not in (None, "tutorial") else ""
    weak = ", weak scaling" if case.scaling == "weak" else ""
    image = f"{case.image_size} px, " if case.image_size else ""  # toy, mlp: no image size
    return (f"{case.strategy} at {image}batch {case.batch_size}, "
            f"{case.precision}{partition}{weak}")


def _step_s(prediction: Prediction | None) -> float | None:
    step = None if prediction is None else prediction[0]
    return None if step is None or isinstance(step, str) else step.step_s


def _missing(group: Sequence[int], predicted: Mapping[int, Prediction]) -> str:
    """Why a search went without predictions: the first case's own reason, else none ran."""
    for i in group:
        step = predicted[i][0] if i in predicted else None
        if isinstance(step, str):
            return step
    return "no prediction: the run does not calibrate (predict_time off)"


def unmeasured(cases: Sequence[Case], group: Sequence[int],
               predicted: Mapping[int, Prediction]) -> dict[int, str]:
    """Index -> reason of each candidate (and batch-curve point) of the workload ``group``
    (indices into ``cases``) that is not measured."""
    searches: dict[tuple[object, ...], list[int]] = {}
    for i in group:
        case = cases[i]
        if case.split_search is not None and case.curve_of is None and case.status is None:
            searches.setdefault(search_key(case), []).append(i)
    skipped: dict[int, str] = {}
    for members in searches.values():
        first = cases[members[0]]
        assert first.split_search is not None  # a search's members carry it
        by_split = {cases[i].split_size or 0: i for i in members}
        choice = choose({s: _step_s(predicted.get(i)) for s, i in by_split.items()},
                        first.split_search.measured, first.split_search.anchor,
                        _missing(members, predicted))
        for split, i in by_split.items():
            if split not in choice.measured:
                time_s = _step_s(predicted.get(i))
                said = f" predicted {time_s:.3g} s" if time_s is not None else ""
                skipped[i] = (f"split {split}{said}, not measured: {_search_title(first)} "
                              f"{choice.why}")
    return skipped | _unused_points(cases, group, skipped)


def _unused_points(cases: Sequence[Case], group: Sequence[int],
                   skipped: Mapping[int, str]) -> dict[int, str]:
    """The group's batch-curve points whose batch only skipped candidates compute."""
    left = [c for j, c in enumerate(cases) if j not in skipped]
    out = {}
    for i in group:
        point = cases[i]
        if point.curve_of is None or point.status is not None or point.split_search is None:
            continue
        if not curve_users(point, left):
            images = f"{point.batch_size} image" + ("s" if point.batch_size > 1 else "")
            out[i] = (f"batch-curve point not measured: only split candidates that are not "
                      f"measured compute {images} at once")
    return out


def settle(cases: list[Case], group: Sequence[int],
           predicted: Mapping[int, Prediction]) -> list[Case]:
    """``cases`` with the workload ``group``'s unmeasured candidates and batch-curve points
    marked ``skipped`` with their reason (``unmeasured``); the same list where none are."""
    skipped = unmeasured(cases, group, predicted)
    if not skipped:
        return cases
    return [dataclasses.replace(c, status="skipped", reason=skipped[i]) if i in skipped
            else c for i, c in enumerate(cases)]


def measured_share(case: Case) -> float:
    """The share of ``case`` expected to be measured, for a duration estimate: K / n for a
    split candidate (K of its search's n runnable candidates are measured), the same for a
    batch-curve point that only candidates compute; 1.0 for every other case."""
    search = case.split_search
    if search is None or search.candidates <= 0:
        return 1.0
    return min(search.measured, search.candidates) / search.candidates
