"""The run folders a report compares, read and checked into one ``Runs`` (``load_runs``),
and the one-line description of each (``caption``). Reads files only (env.json, cases.csv,
steps.csv, and samples.csv / timeline.csv where present); ``build`` draws and writes from
it, ``html`` renders it, and a notebook can load it on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from bench_lib.results.read import devices_label, read_cases, read_env, read_table
from bench_lib.results.schema import TIMELINE_COLUMNS, ResultsError


@dataclass
class Runs:
    """Every compared run's files, concatenated; ``case_key`` is ``<run label>/<case id>``."""

    envs: dict[str, dict[str, Any]]
    """Run label -> env.json. One run: its folder's name; several: A, B, ... (see names)."""
    names: dict[str, str]
    """Run label -> run folder name."""
    cases: pd.DataFrame
    """The sweep's strong-scaling cases (the batch curve's rows and the weak-scaling cases
    apart, in ``curve`` and ``weak``)."""
    samples: pd.DataFrame | None
    timeline: pd.DataFrame | None
    curve: pd.DataFrame
    """single's batch-curve rows (``batch_curve_of`` set): a figure of their own."""
    weak: pd.DataFrame
    """The weak-scaling cases (``scaling`` weak): compared with single at their per-device
    batch, in the scaling figure and the headlines."""

    @property
    def swept(self) -> pd.DataFrame:
        """The sweep's cases, strong and weak (the batch curve left out)."""
        return pd.concat([self.cases, self.weak], ignore_index=True)

    @property
    def every(self) -> pd.DataFrame:
        """Every row of every run: the cases, the batch curve and the weak cases."""
        return pd.concat([self.cases, self.curve, self.weak], ignore_index=True)


def _read_optional(path: Path, required: list[str]) -> pd.DataFrame | None:
    """A CSV that a run may lack; present but unreadable or missing columns is an error."""
    return read_table(path, required) if path.exists() else None


def _keyed(df: pd.DataFrame, label: str) -> pd.DataFrame:
    """``df`` with the run's label and a ``case_key`` unique across runs."""
    return df.assign(run_label=label, case_key=label + "/" + df["case_id"].astype(str))


def load_runs(run_dirs: list[Path]) -> Runs:
    """Read and check every run folder (raises ResultsError on an unusable one)."""
    envs: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    cases: list[pd.DataFrame] = []
    samples: list[pd.DataFrame] = []
    timelines: list[pd.DataFrame] = []
    for i, run_dir in enumerate(run_dirs):
        if not run_dir.is_dir():
            raise ResultsError(f"{run_dir} is not a folder")
        # Run ids are long: compared runs get letters, which fit under a bar.
        label = run_dir.resolve().name if len(run_dirs) == 1 else chr(ord("A") + i % 26) * (
            1 + i // 26)
        names[label] = run_dir.resolve().name
        envs[label] = read_env(run_dir)
        run_cases = read_cases(run_dir)
        if run_cases.empty:
            raise ResultsError(f"{run_dir} holds no case yet: nothing to report")
        cases.append(_keyed(run_cases, label))
        _read_optional(run_dir / "steps.csv", ["case_id", "rank", "step", "step_time_s"])
        sampled = _read_optional(run_dir / "samples.csv", ["case_id", "device"])
        if sampled is not None:
            samples.append(_keyed(sampled, label))
        traced = _read_optional(run_dir / "timeline.csv", TIMELINE_COLUMNS)
        if traced is not None:
            timelines.append(_keyed(traced, label))
    every = pd.concat(cases, ignore_index=True)
    on_curve = every.batch_curve_of.notna()
    weak = every.scaling.eq("weak")
    return Runs(envs, names, every[~on_curve & ~weak].reset_index(drop=True),
                _concat(samples), _concat(timelines), every[on_curve].reset_index(drop=True),
                every[weak].reset_index(drop=True))


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame | None:
    """The runs' frames as one; None when no run has the file."""
    return pd.concat(frames, ignore_index=True) if frames else None


def caption(label: str, env: dict[str, Any], name: str | None = None) -> str:
    """One line naming the rig, devices and versions a run was measured with; on two GPUs
    or more, how they reach each other (env.json ``multi_gpu.summary``) and any NCCL
    fallback the pre-flight chose (``preflight.nccl_fallback``)."""
    v, git = env.get("versions", {}), env.get("git", {})
    cuda = f"CUDA {v['cuda']}" if v.get("cuda") else "no CUDA"
    sha = (git.get("sha") or "nogit")[:7] + ("+dirty" if git.get("dirty") else "")
    head = label if name in (None, label) else f"{label} = {name}"
    links = (env.get("multi_gpu") or {}).get("summary")
    fallback = (env.get("preflight") or {}).get("nccl_fallback")
    return (f"{head}: rig {env.get('rig', {}).get('label', '?')} on {devices_label(env)}; "
            + (f"{links}; " if links else "") + (f"{fallback}; " if fallback else "")
            + f"CPU {env.get('cpu_model', '?')}; torch {v.get('torch')}, torchvision "
            f"{v.get('torchvision')}, {cuda}; git {sha}")
