"""The two run folders a comparison reads, and whether they can be compared: each run's
cases.csv rows and its ok cases' step times per launch, a step's time being its slowest
rank's (``Run``, ``load_run``), read through ``bench_lib.results.read``.

Runs are compared on the same hardware only (env.json's ``fingerprint``: rig, device names,
CPU model, cores, CPU topology), unless allowed otherwise. Software (torch, torchvision,
CUDA, cuDNN, NCCL, driver, python: env.json's ``versions``) may differ: the verdict is still
given, and the differences are noted beside it (``check_fingerprints``,
``software_differences``). Input that cannot be compared raises ``CompareError`` (exit
code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench_lib.analysis.stats import geometric_mean, slowest_per_step
from bench_lib.results.fingerprint import SOFTWARE_KEYS, hardware_of
from bench_lib.results.read import read_cases, read_env, read_steps
from bench_lib.results.schema import ResultsError

WORKLOAD_KEYS = ["model", "image_size", "batch_size", "precision", "loss"]

Samples = npt.NDArray[np.float64]
"""One launch's step times in seconds, a step's time being its slowest rank's."""
Launches = dict[int, Samples]
"""One case's launches: launch (round) index -> its step times, in round order."""


class CompareError(ValueError):
    """Input that cannot be compared: reported with exit code 2."""


@dataclass(frozen=True)
class Run:
    """A run folder's ok cases and their per-launch step samples (slowest rank per step)."""

    path: Path
    env: dict[str, Any]
    cases: dict[str, dict[str, Any]]
    """case_id -> its cases.csv row, every status."""
    launches: dict[str, Launches]
    """case_id -> its launches' step times in seconds, in round order, for ok cases."""
    probes: dict[str, Launches] = field(default_factory=dict)
    """case_id -> its launches' speed probe before each step, aligned with ``launches``;
    only cases one process timed whose every step has one (``probe_samples``)."""

    @property
    def samples(self) -> dict[str, Samples]:
        """case_id -> every launch's step times pooled, in round order (spread, throughput
        range); the statistics use ``launches``."""
        return {cid: np.concatenate(list(parts.values())) for cid, parts in self.launches.items()}

    def launch_medians(self, case_id: str) -> dict[int, float]:
        """Launch index -> the median of that launch's step times, in round order."""
        return {r: float(np.median(v)) for r, v in self.launches[case_id].items()}

    def controlled_medians(self, case_id: str, coefficient: float = 1.0
                           ) -> dict[int, float] | None:
        """Launch index -> the median of that launch's steps, each over the speed probe
        timed just before it to the power ``coefficient`` (1: a figure in probes, not
        seconds, which loses what the machine's speed did to the probe,
        ``measure.speed_probe``; less: as much of it as the steps followed,
        ``compare.paired.probe_coefficient``); None where the case has no probes."""
        probes = self.probes.get(case_id)
        if probes is None:
            return None
        return {r: float(np.median(v / probes[r] ** coefficient))
                for r, v in self.launches[case_id].items()}

    def median_s(self, case_id: str) -> float:
        """The case's step time: the geometric mean of its launch medians (one launch: its
        median), as cases.csv's ``step_time_s_median``."""
        return geometric_mean(list(self.launch_medians(case_id).values()))

    def single_of(self, case_id: str) -> str | None:
        """The ``single`` case of the same workload, if this run has one that ran."""
        row = self.cases[case_id]
        for cid, other in self.cases.items():
            if (other["strategy"] == "single" and cid in self.launches
                    and all(other[k] == row[k] for k in WORKLOAD_KEYS)):
                return cid
        return None

    def common_rounds(self, case_id: str, other: str) -> list[int]:
        """The rounds (launch indices) in which both cases ran, in order."""
        theirs = self.launches[other]
        return [r for r in self.launches[case_id] if r in theirs]


def run_dir_of(path: Path) -> Path:
    """A run folder from a folder or a file inside it (cases.csv)."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path} does not exist")
    return path if path.is_dir() else path.parent


def step_samples(run_dir: Path) -> dict[str, Launches]:
    """Per case and per launch, the time of each timed step from steps.csv: the slowest rank's.

    Launches are keyed by steps.csv's ``launch`` (the round they ran in), in round order.
    The rule is ``bench_lib.analysis.stats.slowest_per_step``, the one the runner applies,
    within each launch; ranks that timed different numbers of steps in a launch, or a step
    row without its launch, make the run unusable (``CompareError``).
    """
    try:
        steps = read_steps(run_dir)
    except ResultsError as e:
        raise CompareError(str(e)) from None
    out: dict[str, Launches] = {}
    for case_id, case in steps.groupby("case_id", sort=True):
        where = f"{run_dir / 'steps.csv'}, case {case_id}"
        if case["launch"].isna().any():
            raise CompareError(f"{where}: a step row without its launch index (not written by "
                               "this schema's runner?)")
        launches: Launches = {}
        try:
            ordered = case.sort_values(["launch", "rank", "step"], kind="stable")
            launch_of = ordered["launch"].astype(int)
            for launch in sorted(set(launch_of.tolist())):
                part = ordered[launch_of == launch]
                per_rank: dict[int, list[float]] = {}
                for rank, seconds in zip(part["rank"].astype(int).tolist(),
                                         part["step_time_s"].astype(float).tolist(),
                                         strict=True):
                    per_rank.setdefault(rank, []).append(seconds)
                launches[int(launch)] = np.asarray(slowest_per_step(per_rank), dtype=np.float64)
        except (ValueError, TypeError) as e:  # unequal ranks, or a word where a number goes
            raise CompareError(f"{where}: {e}") from None
        if not all(bool(np.all(np.isfinite(v) & (v > 0))) for v in launches.values()):
            raise CompareError(f"{where}: a step time that is not a positive number")
        out[str(case_id)] = launches
    return out


ONE_PROCESS_PROBES = True
"""Probes are used for cases whose steps one process times (single, mp, the tutorial's
pipeline) only. In a case of several ranks, a rank's probe runs while its peer still works
on the step before (ranks are out of phase: a pipelining schedule's last stage ends
later), and on the cores of a small machine it times that work too; over kept gates, ddp
judged over its ranks' probes read a planted slowdown as a speed-up (docs/ci-gate.md,
"Tried and not adopted")."""


def probe_samples(run_dir: Path) -> dict[str, Launches]:
    """Per case and launch, the speed probe before each timed step (steps.csv's
    ``probe_s``), in ``step_samples``' order; only cases whose every step has a positive
    probe (none in a folder written before the column, or on GPUs) and that one process
    timed (``ONE_PROCESS_PROBES``)."""
    steps = read_steps(run_dir)
    if "probe_s" not in steps.columns:
        return {}
    out: dict[str, Launches] = {}
    for case_id, case in steps.groupby("case_id", sort=True):
        probe = case["probe_s"].astype(float)
        if not bool(((probe > 0) & np.isfinite(probe)).all()):
            continue
        if ONE_PROCESS_PROBES and case["rank"].nunique() > 1:
            continue
        logs = case.assign(log_probe=np.log(probe))
        launches: Launches = {}
        for launch in sorted(set(case["launch"].astype(int).tolist())):
            part = logs[logs["launch"].astype(int) == launch]
            per_step = part.groupby("step", sort=True)["log_probe"].mean()
            launches[launch] = np.exp(per_step.to_numpy(dtype=np.float64))
        out[str(case_id)] = launches
    return out


def load_run(path: Path) -> Run:
    """Read a run folder (or its cases.csv) for comparison."""
    run_dir = run_dir_of(path)
    try:
        env = read_env(run_dir)
        df = read_cases(run_dir)
    except ResultsError as e:
        raise CompareError(str(e)) from None
    cases = {str(r["case_id"]): {str(k): v for k, v in r.items()}
             for r in df.astype(object).to_dict("records")}
    samples = step_samples(run_dir)
    ok = {cid: samples[cid] for cid, r in cases.items()
          if r["status"] == "ok" and sum(v.size for v in samples.get(cid, {}).values()) >= 2}
    probes = {cid: parts for cid, parts in probe_samples(run_dir).items()
              if cid in ok and {r: v.size for r, v in parts.items()}
              == {r: v.size for r, v in ok[cid].items()}}
    return Run(run_dir, env, cases, ok, probes)


def software_of(env: dict[str, Any]) -> dict[str, Any]:
    """env.json's software versions (``versions``; an older fingerprint's torch and driver
    where ``versions`` lacks them). A key neither holds is left out, never guessed."""
    versions, fingerprint = env.get("versions") or {}, env.get("fingerprint") or {}
    return {k: versions[k] if k in versions else fingerprint[k]
            for k in SOFTWARE_KEYS if k in versions or k in fingerprint}


def software_differences(base: Run, cand: Run) -> list[str]:
    """``torch 2.14.1 -> 2.15.0`` (baseline -> candidate) per software version that differs;
    a version only one run recorded is not compared."""
    sb, sc = software_of(base.env), software_of(cand.env)
    return [f"{k} {sb[k] if sb[k] is not None else 'none'} -> "
            f"{sc[k] if sc[k] is not None else 'none'}"
            for k in SOFTWARE_KEYS if k in sb and k in sc and str(sb[k]) != str(sc[k])]


def check_fingerprints(base: Run, cand: Run, allow_different: bool) -> list[str]:
    """Differences between the two hardware fingerprints; refused unless allowed.

    Software versions are not compared here (``software_differences``): a torch upgrade
    still gets a verdict, with a note beside it.
    """
    fb = hardware_of(base.env.get("fingerprint") or {})
    fc = hardware_of(cand.env.get("fingerprint") or {})
    diffs = [f"{k}: {fb.get(k)!r} vs {fc.get(k)!r}"
             for k in sorted(set(fb) | set(fc)) if fb.get(k) != fc.get(k)]
    if diffs and not allow_different:
        raise CompareError(
            "the two runs come from different hardware, so their absolute times are "
            "not comparable (" + "; ".join(diffs) + "); pass --allow-different-hardware to "
            "compare anyway")
    return diffs
