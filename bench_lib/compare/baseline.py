"""The baseline store: ``results/baseline/<fingerprint id>/``, one baseline per hardware.

A stored baseline is a copy of a run folder's env.json, cases.csv and steps.csv, filed under
a short id of its hardware fingerprint (env.json's ``fingerprint``: ``results.fingerprint``),
so ``compare`` given the store picks the baseline measured on the candidate's hardware.
Never imports torch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from bench_lib.compare.runs import CompareError, Run, load_run, run_dir_of
from bench_lib.results.fingerprint import fingerprint_id, hardware_of

STORED_FILES = ("env.json", "cases.csv", "steps.csv")


def stored_hardware(folder: Path) -> dict[str, Any] | None:
    """The hardware fingerprint of a stored baseline's env.json; None where unreadable."""
    try:
        env = json.loads((folder / "env.json").read_text())
    except (OSError, ValueError):
        return None
    fingerprint = env.get("fingerprint") if isinstance(env, dict) else None
    return hardware_of(fingerprint) if isinstance(fingerprint, dict) else None


def resolve_baseline(path: Path, cand: Run, allow_different: bool) -> Path:
    """A run folder itself, or the store's baseline recorded on the candidate's hardware."""
    path = run_dir_of(path)
    if (path / "env.json").exists() or (path / "cases.csv").exists():
        return path
    stored = sorted(p for p in path.iterdir()
                    if not p.is_symlink() and (p / "env.json").is_file())
    if not stored:
        raise CompareError(f"{path} holds no run folder and no stored baseline (no env.json); "
                           "record a baseline with `make baseline`")
    hardware = hardware_of(cand.env.get("fingerprint") or {})
    want = fingerprint_id(hardware)
    for p in stored:
        if p.name == want:
            return p
    # A baseline filed under another id (one stored when the id still hashed software
    # versions too) is still this hardware's when its env.json says so.
    for p in stored:
        if stored_hardware(p) == hardware:
            return p
    if allow_different and len(stored) == 1:
        return stored[0]
    raise CompareError(
        f"no baseline for this hardware in {path}: the candidate's fingerprint is {want} "
        f"({json.dumps(hardware, sort_keys=True)}); stored: "
        f"{', '.join(p.name for p in stored)}. Record one here with `make baseline`"
        + ("" if allow_different else ", or pass --allow-different-hardware with a run folder"))


def save_baseline(run_dir: Path, store: Path) -> Path:
    """Copy a run folder's env.json, cases.csv and steps.csv into the store, by fingerprint.

    The run is read (and checked) first; an unusable one raises ``CompareError`` and
    leaves the store as it was. A baseline of the same hardware filed under another id (an
    id that still hashed software versions) is replaced too: one baseline per hardware.
    Returns the baseline's folder.
    """
    run = load_run(run_dir)
    hardware = hardware_of(run.env.get("fingerprint") or {})
    dest = Path(store) / fingerprint_id(hardware)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in STORED_FILES:
        shutil.copy2(run.path / name, dest / name)
    for old in sorted(Path(store).iterdir()):
        if (old != dest and old.is_dir() and not old.is_symlink()
                and stored_hardware(old) == hardware):
            shutil.rmtree(old)
    return dest
