"""Successive halving over launches: the racing rule of ``tune``, pure logic.

Given candidates (one of them the ``single`` reference) and a function that measures one
fresh launch of one candidate, ``race`` runs rungs:

- rung 0: every candidate one launch (the caller makes every launch short, and alike, so
  that rungs pair);
- after each rung the candidates still in are ranked by their step time so far (the
  geometric mean of their launches' medians: ``analysis.stats.launch_interval``'s point);
- if the best one's speedup over the runner-up, paired by rung (each rung is a round: every
  candidate in it is launched once, in a seeded shuffled order, so drift hits them alike),
  has an interval that excludes 1, the winner has separated: stop;
- else the better half is kept (``ceil(n / eta)``, at least ``min_keep``), and the next
  rung launches each of them once more (the reference too, whether kept or not: it is what
  every speedup is paired with; where the budget fits the best two but not the reference
  as well, the two alone), until ``max_rungs`` rungs or the time budget is spent:
  then the verdict is a tie between the best and every survivor whose interval against it
  still holds 1 (after rung 0 alone, when no interval exists yet: the half the halving
  would keep), and the best median is recommended as a tie.

The time budget, in the launches' own measured seconds, is ``RaceSettings.budget_s`` or
``budget_fraction`` of what the exhaustive sweep would spend launching, predicted from
rung 0's measured launches (so it follows the machine's pace), whichever is smaller. It
shrinks the halving where the next rung would not fit: the next rung's cost is predicted
from each survivor's last launch, and only the best that fit go on (never fewer than 2;
none fit: stop). Rung
0 always runs whole, whatever the budget: every candidate gets its measurement. Where a
launch's fixed cost (process start, imports, process group) dominates, rung 0 alone is
most of a third of the sweep, and the budget leaves room for a rung of two or three more
launches at most: the verdict is then usually a tie, with the best median recommended.

What it guarantees: every candidate is measured at least once, and a failed launch drops
its candidate (never launched again); a separation is called only on an interval that
excludes 1 at ``confidence`` over all the looks together (Bonferroni: each look uses
1 - (1 - confidence) / looks, looks = ``max_rungs`` - 1), so two equal candidates are
called separated with probability at most 1 - confidence under the t interval's
assumptions (log launch medians roughly normal, rounds independent). What it does not:
halving on one short launch can drop the true best when it is within rung 0's noise of
the others (``tests/test_tune.py`` measures how often on synthetic candidates), and a tie
says the race could not tell the survivors apart within its budget, not that they are
equal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench_lib.analysis.stats import CI_CONFIDENCE, LaunchInterval, paired_ratio_interval


@dataclass(frozen=True)
class LaunchResult:
    """One launch of one candidate, as the race needs it."""

    status: str
    """``ok``, or why the candidate stops (``oom``, ``error``, ``timeout``)."""
    median_s: float | None
    """Median of the launch's timed step times, seconds (None unless ok)."""
    steps: int = 0
    """Timed steps behind the median."""
    wall_s: float = 0.0
    """What the launch cost, seconds from start to end (the budget counts these)."""
    reason: str = ""
    """Why it did not end ok."""


Measure = Callable[[int, int], LaunchResult]
"""(candidate index, rung) -> one fresh launch of it in that rung."""


@dataclass(frozen=True)
class LaunchRecord:
    """A launch the race made, in the order made."""

    candidate: int
    rung: int
    launch: int
    """Index of the launch in the whole race, from 0."""
    result: LaunchResult


@dataclass(frozen=True)
class RaceSettings:
    """How hard the race cuts and how long it may go on."""

    eta: int = 2
    """Each rung keeps ceil(n / eta) of its n candidates (2: halving)."""
    min_keep: int = 2
    """Never fewer survivors than this (a winner needs a runner-up to separate from)."""
    max_rungs: int = 4
    """Rungs at most, rung 0 included; a race that has not separated by then is a tie."""
    budget_s: float = math.inf
    """Launch seconds the race may spend; a rung that would not fit is cut to the best
    candidates that fit (rung 0 always runs whole)."""
    budget_fraction: float | None = None
    """Else, or as well (the smaller applies): this share of what the exhaustive sweep of
    the candidates would take, predicted from rung 0's launches (``sweep_seconds``), so the
    budget follows the machine's actual pace."""
    sweep_launches: int = 3
    """Launches per case in the exhaustive sweep (the profile's ``launches``)."""
    sweep_over_race: float = 1.0
    """A launch of the exhaustive sweep over a race launch of the same case, in time (the
    race's launches are shorter)."""
    confidence: float = CI_CONFIDENCE
    """Of the separation call over all looks together (module docstring)."""

    def __post_init__(self) -> None:
        if self.eta < 2 or self.min_keep < 2 or self.max_rungs < 1:
            raise ValueError(f"race needs eta >= 2 (got {self.eta}), min_keep >= 2 (got "
                             f"{self.min_keep}) and max_rungs >= 1 (got {self.max_rungs})")
        if (not 0 < self.confidence < 1 or self.budget_s <= 0 or self.sweep_over_race <= 0
                or self.sweep_launches < 1
                or (self.budget_fraction is not None and self.budget_fraction <= 0)):
            raise ValueError(f"bad race settings: confidence {self.confidence}, budget "
                             f"{self.budget_s} s or {self.budget_fraction} of the sweep, "
                             f"{self.sweep_launches} sweep launches, sweep/race "
                             f"{self.sweep_over_race}")

    def sweep_seconds(self, first: Sequence[LaunchRecord]) -> float:
        """The exhaustive sweep's predicted launch seconds from rung 0's launches: each
        candidate that ran ok ``sweep_launches`` full launches (``sweep_over_race`` times
        its rung-0 launch), each that failed its one launch (a sweep stops a failed case)."""
        return sum(r.result.wall_s * (self.sweep_launches * self.sweep_over_race
                                      if r.result.status == "ok" else 1.0)
                   for r in first if r.rung == 0)

    def budget_after_first(self, first: Sequence[LaunchRecord]) -> float:
        """The budget in launch seconds, once rung 0 has run."""
        if self.budget_fraction is None:
            return self.budget_s
        return min(self.budget_s, self.budget_fraction * self.sweep_seconds(first))

    @property
    def look_confidence(self) -> float:
        """The confidence of each look's interval (Bonferroni over ``max_rungs - 1``)."""
        looks = max(1, self.max_rungs - 1)
        return 1 - (1 - self.confidence) / looks

    def keep(self, n: int) -> int:
        """How many of ``n`` ranked candidates the halving keeps."""
        return min(n, max(self.min_keep, math.ceil(n / self.eta)))


VERDICTS = ("separated", "tie", "alone", "none")
"""separated: the winner's interval against the runner-up excludes 1; tie: it does not
within the budget; alone: one candidate measured ok; none: no candidate did."""


@dataclass
class RaceResult:
    """What the race measured and decided."""

    records: list[LaunchRecord] = field(default_factory=list)
    rungs: list[list[int]] = field(default_factory=list)
    """The candidates launched in each rung (the reference included), in launch order."""
    ranking: list[int] = field(default_factory=list)
    """Candidates measured ok, best first: the last rung's by step time, then those dropped
    earlier (later rungs first, each by step time)."""
    verdict: str = "none"
    """One of ``VERDICTS``."""
    tie: list[int] = field(default_factory=list)
    """On a tie, the candidates the winner could not be told from (the winner first)."""
    stop_reason: str = ""
    spent_s: float = 0.0
    """Launch seconds spent."""
    budget_s: float = math.inf
    """The budget the race kept to (``RaceSettings.budget_after_first``)."""

    @property
    def winner(self) -> int | None:
        return self.ranking[0] if self.ranking else None

    @property
    def runner_up(self) -> int | None:
        return self.ranking[1] if len(self.ranking) > 1 else None

    def medians(self, candidate: int) -> dict[int, float]:
        """The candidate's ok launch medians by rung."""
        return {r.rung: r.result.median_s for r in self.records
                if r.candidate == candidate and r.result.median_s is not None
                and r.result.status == "ok"}

    def step_time_s(self, candidate: int) -> float:
        """Geometric mean of the candidate's launch medians (inf without any)."""
        values = list(self.medians(candidate).values())
        if not values:
            return math.inf
        return math.exp(sum(math.log(v) for v in values) / len(values))

    def speedup(self, candidate: int, over: int,
                confidence: float = CI_CONFIDENCE) -> LaunchInterval | None:
        """``over``'s step time over ``candidate``'s, paired by the rungs both ran ok in,
        with its interval (``paired_ratio_interval``); None where they share no rung."""
        mine, theirs = self.medians(candidate), self.medians(over)
        common = sorted(set(mine) & set(theirs))
        if not common:
            return None
        return paired_ratio_interval([theirs[r] for r in common], [mine[r] for r in common],
                                     confidence)


def rung_order(candidates: Sequence[int], seed: int, rung: int) -> list[int]:
    """The launch order of a rung: a shuffle seeded by the race's seed and the rung."""
    order = list(candidates)
    random.Random(seed * 1_000_003 + rung).shuffle(order)
    return order


def race(count: int, reference: int | None, measure: Measure,
         settings: RaceSettings = RaceSettings(), seed: int = 0) -> RaceResult:
    """Race candidates 0..count-1 (module docstring); ``reference`` (``single``) is
    launched in every rung."""
    result = RaceResult()
    alive = list(range(count))
    failed: set[int] = set()
    dropped: list[list[int]] = []  # per rung, the candidates the halving dropped after it
    rung, with_reference = 0, True
    result.verdict = "tie"  # unless the race ends otherwise below
    while True:
        batch = alive + ([reference] if with_reference and reference is not None
                         and reference not in alive and reference not in failed else [])
        result.rungs.append(rung_order(batch, seed, rung))
        for i in result.rungs[-1]:
            outcome = measure(i, rung)
            result.records.append(LaunchRecord(i, rung, len(result.records), outcome))
            result.spent_s += outcome.wall_s
            if outcome.status != "ok" or outcome.median_s is None:
                failed.add(i)
        if rung == 0:
            result.budget_s = settings.budget_after_first(result.records)
        ranked = sorted((i for i in alive if i not in failed), key=result.step_time_s)
        if len(ranked) < 2:
            result.verdict, result.stop_reason = ("alone", "one candidate measured ok") \
                if ranked else ("none", "no candidate measured ok")
            break
        duel = result.speedup(ranked[0], ranked[1], settings.look_confidence)
        if duel is not None and not math.isnan(duel.low) and duel.low > 1:
            result.verdict, result.stop_reason = "separated", (
                f"the winner separated from the runner-up after rung {rung}")
            break
        if rung + 1 >= settings.max_rungs:
            result.stop_reason = f"{settings.max_rungs} rungs run without a separation"
            break
        survivors, with_reference = _fit(ranked[:settings.keep(len(ranked))],
                                         None if reference in failed else reference, result)
        if len(survivors) < 2:
            result.stop_reason = (f"time budget: {result.spent_s:.0f} of "
                                  f"{result.budget_s:.0f} s spent, the next rung would "
                                  "not fit")
            break
        dropped.append([i for i in ranked if i not in survivors])
        alive = survivors
        rung += 1
    ranked = sorted((i for i in alive if i not in failed), key=result.step_time_s)
    result.ranking = ranked + [i for out in reversed(dropped)
                               for i in sorted(out, key=result.step_time_s)]
    if result.verdict == "tie":
        # Stopped after rung 0 (one launch each, no interval): the tie is among the half
        # the halving would have kept, not the whole field.
        pool = ranked if rung > 0 else ranked[:settings.keep(len(ranked))]
        result.tie = [pool[0]] + [i for i in pool[1:] if _holds_one(
            result.speedup(pool[0], i, settings.look_confidence))]
    return result


def _holds_one(speedup: LaunchInterval | None) -> bool:
    """True where an interval cannot tell the two apart (none at all included)."""
    return speedup is None or math.isnan(speedup.low) or speedup.low <= 1


def _fit(kept: list[int], reference: int | None,
         result: RaceResult) -> tuple[list[int], bool]:
    """The best of ``kept`` whose next launches, the reference's too, fit the budget (each
    costs what its last launch did), and whether the reference is launched; where not even
    two fit with it, the best two alone; else none."""
    last = {r.candidate: r.result.wall_s for r in result.records}
    left = result.budget_s - result.spent_s
    extra = last[reference] if reference is not None and reference in last else 0.0
    for n in range(len(kept), 1, -1):
        ref = extra if reference not in kept[:n] else 0.0
        if sum(last[i] for i in kept[:n]) + ref <= left:
            return kept[:n], True
    if len(kept) >= 2 and last[kept[0]] + last[kept[1]] <= left:
        return kept[:2], False
    return [], False
