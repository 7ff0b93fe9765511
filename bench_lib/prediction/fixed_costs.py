"""What a run pays beyond its steps, term by term, per rig kind: the start-up and per-run
terms of the duration estimate (``prediction.duration``), each measured, each with its source.

    per launch    launch_s          process start, CUDA context, model build, the diagnostics'
                                    set-up, teardown, the runner's work between launches
                  first_step_s      a launch's first warm-up step beyond a steady step
                                    (lazy initialisation; cuDNN autotuning on cuda)
                  process_group_s   a launch whose ranks form a process group on NCCL (gloo's,
                                    on a cpu rig or the slots of one GPU, is in launch_s)
    per workload  calibration_size_s  each batch size its calibration times
    per run       run_s             planning, the fork server, pre-flight (cuda), writing rows
                  rig_figures_s     idle power and the FLOP peak (profile key rig_figures)
                  collectives_s     the collectives' micro-benchmark (a case priced with them)

``from_duty`` derives them from a run's ``duty.json`` (and ``steady_warmup_s`` its warm-up's
steady steps from ``cases.csv``): how the constants below were found, and how to renew them
from a fresh run. ``tests/test_estimate_terms.py`` recomputes the cuda constants from the
H100 evidence (``tests/data/h100-2026-11-26``) and fails when one drifts from it.

Each term carries where it was measured (``FixedCosts.provenance``). The constants come from
one machine each, so on any other they are a guess, and the dry run gives the range they
imply (``bounds``: each term of another machine from half to twice its figure, the rule
``ELSEWHERE_FACTORS`` states; NCCL's group by ``ELSEWHERE_RANGES_S``). After a run on this
machine (same ``hardware_id``), ``this_box`` takes every term its ``duty.json`` gives from
the newest such run folder under ``results/``: "this box's run <id>". Never imports torch.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.results.fingerprint import fingerprint_id

SETTLED_AFTER_STEPS = 3
"""Warm-up steps a first launch usually runs (``timing.WarmupRule``): the slow first step, a
new low, then one no lower; later launches run that less 2 (``protocol.reused_warmup``),
never under the profile's ``warmup_steps``."""


@dataclass(frozen=True)
class FixedCosts:
    """A rig kind's terms (module docstring), in seconds, and where they were measured."""

    launch_s: float
    first_step_s: float
    process_group_s: float
    calibration_size_s: float
    run_s: float
    rig_figures_s: float
    collectives_s: float
    source: str
    """The runs the terms come from (and the arithmetic: ``from_duty``)."""
    measured_on: str = ""
    """The machine every term not in ``here`` was measured on, in a few words."""
    here: Mapping[str, str] = field(default_factory=dict)
    """The terms a run on this machine renewed (``this_box``), each with the words that
    say so: "this box's run <id>"."""

    def provenance(self, term: str) -> str:
        """Where ``term`` (a field name: ``TERMS``) was measured, in a few words."""
        return self.here.get(term) or self.measured_on

    @property
    def elsewhere(self) -> tuple[str, ...]:
        """The terms measured on another machine (every one not renewed here)."""
        return tuple(t for t in TERMS if t not in self.here)

    def bounds(self, kind: str) -> tuple[FixedCosts, FixedCosts]:
        """The low and high ends of the terms measured elsewhere (``ELSEWHERE_RANGES_S``,
        else ``ELSEWHERE_FACTORS``); this machine's own stay as they are."""
        low: dict[str, Any] = {}
        high: dict[str, Any] = {}
        for term in self.elsewhere:
            value = float(getattr(self, term))
            lo_f, hi_f = ELSEWHERE_FACTORS
            low[term], high[term], _ = ELSEWHERE_RANGES_S.get(kind, {}).get(
                term, (value * lo_f, value * hi_f, ""))
        return self.with_terms(low), self.with_terms(high)

    def with_terms(self, values: Mapping[str, float], **other: Any) -> FixedCosts:
        """These terms with ``values`` (by field name) in place, and ``other`` fields."""
        fields: dict[str, Any] = {**values, **other}
        return dataclasses.replace(self, **fields)


@dataclass(frozen=True)
class ImpliedRange:
    """What the terms measured on another machine imply (``implied_range``)."""

    low_s: float
    """The total with each of them at the low end of its range (``FixedCosts.bounds``)."""
    high_s: float
    applied: tuple[str, ...]
    """The terms of another machine the total pays (``TERMS`` order)."""


def implied_range(terms: FixedCosts, kind: str,
                  total: Callable[[FixedCosts], float]) -> ImpliedRange:
    """``total`` (seconds from terms: a run's estimate) with the terms measured elsewhere
    at both ends of their ranges, and which of them it pays (it changes without them)."""
    low, high = terms.bounds(kind)
    whole = total(terms)
    applied = tuple(k for k in terms.elsewhere if getattr(terms, k)
                    and total(terms.with_terms({k: 0.0})) != whole)
    return ImpliedRange(total(low), total(high), applied)


TERMS = ("launch_s", "first_step_s", "process_group_s", "calibration_size_s", "run_s",
         "rig_figures_s", "collectives_s")
"""``FixedCosts``' terms, in the order the module docstring lists them."""
TERM_WORDS = {"launch_s": "launch start-up", "first_step_s": "first step",
              "process_group_s": "NCCL group", "calibration_size_s": "calibration per size",
              "run_s": "set-up", "rig_figures_s": "rig figures", "collectives_s": "collectives"}
"""Each term as the dry run names it."""
ELSEWHERE_FACTORS = (0.5, 2.0)
"""A term measured on another machine is taken as anything from half to twice its figure.
The one comparison there is: the cpu terms of one 2-core AMD EPYC estimated ``make bench``
within 8% there and at 915 s on a second 2-core EPYC, where it took 590 s (-36%)."""


CPU = FixedCosts(
    launch_s=1.526, first_step_s=1.041, process_group_s=0.0, calibration_size_s=2.175,
    run_s=0.06, rig_figures_s=3.27, collectives_s=3.70,
    source="default-cpu on 2 cores, AMD EPYC, at 2bfcde0 on a quiet machine (102 launches, 30 "
           "calibrated sizes, 955 s): from_duty on its duty.json with parts (launch_s holds "
           "the runner's work between launches, 33 s there, most of it the report written "
           "after each workload's first and last round)",
    measured_on="one 2-core AMD EPYC, 2bfcde0")
"""The cpu rig's terms (``source``), renewed from a run's duty.json with parts
(``from_duty``)."""

CUDA = FixedCosts(
    launch_s=1.126, first_step_s=3.73, process_group_s=15.81, calibration_size_s=12.21,
    run_s=13.28, rig_figures_s=14.88, collectives_s=12.16,
    source="one H100 80GB, torch 2.11 (tests/data/h100-2026-11-26): launch, first step and "
           "calibration from resnet50-224-single-accum (12 launches, 4 sizes); pre-flight and "
           "the run's own from smoke-1gpu (neither rig figures nor collectives), rig figures "
           "as the 224 px run's per-run cost beyond it and its calibration, collectives as "
           "smoke-2slots' (a failed gloo attempt); NCCL as smoke-1gpu's ddp launch beyond "
           "single's and dp's (the only NCCL launch: one rank; its extra lay in the warm-up, "
           "between the group's buffers and the first timed step)",
    measured_on="one H100 (one GPU), 2026-11-26")
"""The cuda rig's terms, from the first GPU run (``source``): every term the runs of that
day lumped together was separated by difference between them, so each stands for whatever
that code did there; a run with ``duty.json``'s parts renews them (``from_duty``)."""

BY_KIND = {"cpu": CPU, "cuda": CUDA}
ELSEWHERE_RANGES_S = {"cuda": {"process_group_s": (
    1.0, CUDA.process_group_s, f"from 1 s (published: 1-3 s a single-node NCCL start) to "
                               f"{CUDA.process_group_s:.1f} s (measured)")}}
"""Terms whose range has better grounds than ``ELSEWHERE_FACTORS``: low and high seconds,
and the rule in words. NCCL's
group: public reports put a single-node NCCL initialisation at 1-3 s; the H100's 15.81 s is
what one one-rank ddp launch cost beyond single's in its first steps (a cold cache, cuDNN
autotuning or NCCL: one launch cannot tell), so the range runs from 1 s to it."""


def steady_warmup_s(rows: Iterable[Mapping[str, Any]], minimum: int) -> float:
    """The steady (not first) warm-up steps of a run's ``cases.csv`` rows, in seconds: each
    ok case's first launch ran its ``warmup_steps`` W, later launches W - 2 (never under
    ``minimum``, the profile's), each at its launch median."""
    total = 0.0
    for row in rows:
        if row.get("status") != "ok" or not row.get("launch_medians_s"):
            continue
        medians = [float(m) for m in str(row["launch_medians_s"]).split(";")]
        first = int(row["warmup_steps"])
        later = max(minimum, first - 2)
        total += (first - 1) * medians[0] + sum(max(0, later - 1) * m for m in medians[1:])
    return total


def from_duty(duty: Mapping[str, Any], steady_warmup: float = 0.0,
              calibrated_sizes: int = 0) -> dict[str, float]:
    """The terms a run's ``duty.json`` gives, in seconds (``process_group_s`` aside: NCCL's
    share needs the count of launches that paid it, from ``cases.csv``).

    Per launch: ``launch_s``, the launches' fixed cost (duty.json's ``fixed_per_launch_s``
    is the run's total, not one launch's) and the runner's work between them
    (``between_launches_s``), over the launches; ``first_step_s``, the first warm-up steps
    (``warmup_parts_s``), else the warm-up beyond ``steady_warmup``, over the launches. Per
    workload: ``calibration_size_s``, the calibration over ``calibrated_sizes``. Per run:
    the rig figures and collectives where ``run_parts_s`` names them, ``run_s`` the rest
    beyond the calibration (all of it, in a file without parts).
    """
    launches = max(1, int(duty["launches"]))
    calibration = float(duty.get("calibration_s") or 0.0)
    run_parts = {k: float(v) for k, v in (duty.get("run_parts_s") or {}).items()}
    between = run_parts.get("between_launches_s", 0.0)
    first = (duty.get("warmup_parts_s") or {}).get("warmup_first_step_s")
    terms = {"launch_s": (float(duty["fixed_per_launch_s"]) + between) / launches,
             "first_step_s": (float(first) if first is not None
                              else float(duty["warmup_s"]) - steady_warmup) / launches}
    if calibrated_sizes:
        terms["calibration_size_s"] = calibration / calibrated_sizes
    rig = sum((v for k, v in run_parts.items() if k in RIG_FIGURE_PARTS), 0.0)
    coll = sum((v for k, v in run_parts.items() if k in COLLECTIVE_PARTS), 0.0)
    per_run = float(duty["fixed_per_run_s"]) - calibration - between
    return terms | {"run_s": per_run - rig - coll, "rig_figures_s": rig, "collectives_s": coll}


RIG_FIGURE_PARTS = frozenset({"idle_power_s", "flop_peak_s"})
"""``duty.json`` ``run_parts_s`` keys that are the rig figures (parts of
``commands.run_folder``'s ``start_folder``)."""
COLLECTIVE_PARTS = frozenset({"collectives_s"})
"""``duty.json`` ``run_parts_s`` keys that are the collectives."""


def this_box(results: Path, kind: str, hardware: Callable[[], str],
             group_strategies: Collection[str]) -> FixedCosts:
    """``BY_KIND[kind]`` with the terms the newest run folder under ``results`` made on this
    machine gives (``own_terms``), each said to come from "this box's run <id>"; the
    constants where there is none. A run of this machine: of rig kind ``kind``, no test hook
    set, its env.json's fingerprint this machine's ``hardware()`` id (asked only once a run
    of that kind is found: a machine whose id cannot be read, say a plan for GPUs it does
    not have, has no run of its own)."""
    base = BY_KIND[kind]
    mine: str | None = None
    for duty_file in _newest_first(results):
        run = duty_file.parent
        try:
            env = json.loads((run / "env.json").read_text())
            duty = json.loads(duty_file.read_text())
        except (OSError, ValueError):
            continue  # not a run folder (or one being written): not this machine's figures
        if ((env.get("rig") or {}).get("kind") != kind or env.get("test_hooks")
                or not duty.get("launches")):
            continue
        if mine is None:
            try:
                mine = hardware()
            except (OSError, ValueError, RuntimeError):  # RigError: no GPU names here
                return base
        if fingerprint_id(env.get("fingerprint") or {}) != mine:
            continue
        terms = own_terms(run, env, duty, group_strategies)
        return base.with_terms(terms, here=dict.fromkeys(terms, f"this box's run {run.name}"))
    return base


def _newest_first(results: Path) -> list[Path]:
    """Every run folder's duty.json under ``results``, newest first, each folder once (a
    ``latest-run`` link is the folder it names)."""
    found = {p.resolve() for p in results.rglob("duty.json")} if results.is_dir() else set()
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def own_terms(run: Path, env: Mapping[str, Any], duty: Mapping[str, Any],
              group_strategies: Collection[str]) -> dict[str, float]:
    """The terms run folder ``run`` (its env.json and duty.json read) measured, by
    ``from_duty``: the launch and first-step terms always; the calibration per size where it
    calibrated; the per-run terms where duty.json has its parts (without them set-up, rig
    figures and collectives are one lump), the rig figures and collectives only where it
    measured them; NCCL's group where launches of ``group_strategies`` formed one on NCCL
    (its span moved out of every launch's start-up into theirs)."""
    rows = _rows(run / "cases.csv")
    minimum = int((env.get("profile") or {}).get("warmup_steps") or 0)
    sizes = _calibrated_sizes(run / "calibration.json")
    derived = from_duty(duty, steady_warmup_s(rows, minimum), sizes)
    keep = {"launch_s", "first_step_s"} | ({"calibration_size_s"} if sizes else set())
    parts = duty.get("run_parts_s") or {}
    if parts:
        keep |= {"run_s"} | ({"rig_figures_s"} if RIG_FIGURE_PARTS & set(parts) else set())
        keep |= {"collectives_s"} if COLLECTIVE_PARTS & set(parts) else set()
    terms = {k: v for k, v in derived.items() if k in keep}
    rig = env.get("rig") or {}
    group_s = (duty.get("launch_parts_s") or {}).get("process_group_s")
    nccl = sum(int(r.get("launches") or 0) for r in rows
               if r.get("strategy") in group_strategies and int(r.get("world_size") or 1) > 1)
    if rig.get("kind") == "cuda" and int(rig.get("gpu_slots") or 1) == 1 and nccl and group_s:
        terms["process_group_s"] = float(group_s) / nccl
        terms["launch_s"] -= float(group_s) / max(1, int(duty["launches"]))
    return terms


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _calibrated_sizes(path: Path) -> int:
    """Batch sizes a run's calibration.json timed, alone and together (0: none)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    return sum(len(c.get("alone") or ()) + len(c.get("together") or ())
               for c in data.get("calibrations", []) if "failed" not in c)
