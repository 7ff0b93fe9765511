"""What ``benchmarks/gpu_check.py`` runs on a box of two GPUs or more, sized by its own
estimate to fit ``BUDGET_S``::

    pre-flight      measure.preflight.check on the two GPUs (NCCL, /dev/shm, NVML, CUDA,
                    an all-reduce)
    two-GPU tests   every strategy's tiny case (``tiny_case``) on two GPUs, its ranks forked
                    by the fork server as a run's are (``TWO_GPU_TEST``: one pytest process,
                    the tests one after another, each on both GPUs)
    sweep           ``run --rig cuda --devices 2 --profile gpu-check`` with every registered
                    strategy, its folder checked as every sweep's (``folders``)

Each part is priced by the run estimate's terms (``prediction.fixed_costs``: this machine's own
after a run here, else another machine's) and the cases it will run: the tests' cases by
``duration.case_seconds``, the sweep by ``duration.run_estimate`` of the cases ``run``
itself plans from the same flags. Where the estimate passes the budget, the sweep measures
fewer splits (``SPLIT_CHOICES``), never fewer strategies.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench_lib import strategies
from bench_lib.prediction.duration import case_seconds, format_duration, run_estimate
from bench_lib.prediction.fixed_costs import TERMS, FixedCosts
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case, new_case
from bench_lib.sweep.profile import Measurement

BUDGET_S = 15 * 60.0
"""The two-GPU check's time budget, its estimate held to it."""
TWO_GPU_TEST = "tests/test_strategies.py::test_strategy_runs_one_case_on_two_gpus"
"""The registry's two-GPU tests (one per strategy), as pytest names them."""
TEST_MEASUREMENT = Measurement(warmup_steps=1, timed_steps=2, max_time_s=30,
                               case_timeout_s=120, launches=1)
"""A smoke test's case: one launch (``run_case``), 2 timed steps at least (a cuda rig's
minimum timed seconds, resolved per rig by ``new_case``, usually ends it)."""
PROFILE = "gpu-check"
SPLIT_CHOICES = ((2, 4), (4,))
"""The sweep's split sizes, fullest first: the first whose plan fits the budget is run."""


def tiny_case(name: str, rig: Rig) -> Case:
    """The case each strategy's smoke test runs (tests/test_strategies.py): a tiny ResNet at
    32 px, batch 4, split 2."""
    return new_case(rig, name, "resnet-tiny", 32, 4, split_size=2,
                    measurement=TEST_MEASUREMENT)


def two_gpu_flags(splits: tuple[int, ...]) -> tuple[str, ...]:
    """The ``run`` flags of the two-GPU sweep: every registered strategy, ``splits``."""
    return ("--rig", "cuda", "--devices", "2", "--profile", PROFILE,
            "--strategies", ",".join(sorted(strategies.REGISTRY)),
            "--split-sizes", ",".join(map(str, splits)))


def sweep_seconds(flags: tuple[str, ...], terms: FixedCosts) -> tuple[float, int]:
    """The estimate of ``run FLAGS`` (the cases ``run --dry-run`` plans from them, priced
    with ``terms``) and its cases to run."""
    from bench_lib.commands.parser import build_parser
    from bench_lib.commands.plan import plan_new

    rig, profile, cases = plan_new(build_parser().parse_args(["run", *flags, "--dry-run"]))
    est = run_estimate(cases, rig, profile.rig_figures, profile.predict_time, terms)
    return est.total_s, sum(c.status is None for c in cases)


@dataclass(frozen=True)
class TwoGpuPlan:
    """The two-GPU check's parts and their estimates, in seconds."""

    preflight_s: float
    """The set-up term (which holds a GPU's pre-flight) and an NCCL group (its all-reduce)."""
    tests: int
    tests_s: float
    """A pytest process's start (its imports and the fork server's: the set-up term) and
    each test's case (``tiny_case``)."""
    sweep_flags: tuple[str, ...]
    sweep_cases: int
    sweep_s: float
    terms: FixedCosts
    budget_s: float = BUDGET_S

    @property
    def total_s(self) -> float:
        return self.preflight_s + self.tests_s + self.sweep_s

    @property
    def fits(self) -> bool:
        return self.total_s <= self.budget_s

    def lines(self) -> list[str]:
        """The plan as gpu_check prints it (and its help states it)."""
        f = format_duration
        splits = self.sweep_flags[self.sweep_flags.index("--split-sizes") + 1]
        within = "within" if self.fits else "OVER"
        return [f"plan on two GPUs: ~{f(self.total_s)} estimated, {within} its "
                f"{f(self.budget_s)} budget",
                f"  pre-flight ~{f(self.preflight_s)}",
                f"  {self.tests} two-GPU tests through the fork server ~{f(self.tests_s)}",
                f"  sweep of {self.tests} strategies ({self.sweep_cases} cases, split sizes "
                f"{splits}) ~{f(self.sweep_s)}",
                "  priced with terms from " + "; ".join(
                    dict.fromkeys(self.terms.provenance(t) for t in TERMS))]


def two_gpu_plan(terms: FixedCosts, budget_s: float = BUDGET_S) -> TwoGpuPlan:
    """The two-GPU check priced with ``terms``: the fullest sweep (``SPLIT_CHOICES``) whose
    plan fits ``budget_s``, else the smallest (its ``fits`` False: the check says so)."""
    rig = Rig("cuda", 2)
    names = sorted(strategies.REGISTRY)
    tests_s = terms.run_s + sum(case_seconds(tiny_case(n, rig), rig, terms) for n in names)
    preflight_s = terms.run_s + terms.process_group_s
    plan = None
    for splits in SPLIT_CHOICES:
        flags = two_gpu_flags(splits)
        sweep_s, cases = sweep_seconds(flags, terms)
        plan = TwoGpuPlan(preflight_s, len(names), tests_s, flags, cases, sweep_s, terms,
                          budget_s)
        if plan.fits:
            break
    assert plan is not None  # SPLIT_CHOICES is not empty
    return plan
