"""Sweeps as data: a profile (TOML) of parameter lists, expanded into cases.

Precedence, stated once: CLI flags > profile file > the defaults of ``Profile``.

A value that no case of the sweep can use is a usage error (``UsageError``: exit 2,
nothing written). A combination that some cases can use and others cannot becomes a
``skipped`` case with its reason; a strategy the rig cannot run becomes ``unsupported``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bench_lib import strategies
from bench_lib.rig import Rig
from bench_lib.workloads import LOSSES, MIN_IMAGE_SIZE, MODELS, PRECISIONS

PROFILE_DIR = Path(__file__).parent / "profiles"


class UsageError(ValueError):
    """Bad input from the user: reported with exit code 2 before anything is written."""


@dataclass(frozen=True)
class Profile:
    """A sweep declared as data: parameter lists whose cartesian product is the sweep."""

    name: str = "custom"
    """Profile name (file stem), recorded in env.json."""
    description: str = ""
    """One line saying what the profile is for."""
    strategies: tuple[str, ...] = ("single", "dp", "ddp", "mp", "pipeline")
    """Strategy names (keys of the strategy registry)."""
    models: tuple[str, ...] = ("resnet50",)
    """Model names (keys of ``workloads.MODELS``)."""
    image_sizes: tuple[int, ...] = (128,)
    """Square image sizes in pixels."""
    batch_sizes: tuple[int, ...] = (32,)
    """Global batch sizes."""
    split_sizes: tuple[int, ...] = (8,)
    """Micro-batch sizes for strategies that pipeline (ignored by the others)."""
    precisions: tuple[str, ...] = ("fp32",)
    """``fp32`` and/or ``bf16``."""
    loss: str = "ce"
    """``ce`` or ``mse-onehot`` (the tutorial's)."""
    warmup_steps: int = 2
    """Steps run and discarded before timing."""
    timed_steps: int = 10
    """Most steps timed per case."""
    max_time_s: float = 60.0
    """Timing of a case stops after this many seconds of timed steps (at least 3 steps)."""
    case_timeout_s: float = 600.0
    """A case still running after this many seconds is killed and recorded as ``timeout``."""
    ci_target_pct: float = 2.0
    """Timing stops once the median's 95% CI half-width is under this % of it (0: off);
    ``timed_steps`` and ``max_time_s`` stay caps."""
    sample_interval_ms: float = 100.0
    """Interval of the utilisation/memory/power sampler (NVML refreshes every 1/6 s to 1 s)."""

    def __post_init__(self) -> None:
        for name in ("image_sizes", "batch_sizes", "split_sizes"):
            for v in getattr(self, name):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise UsageError(f"{name} must hold positive integers, got {v!r}")
        if not self.strategies:
            raise UsageError("no strategy selected")
        for s in self.strategies:
            if s not in strategies.REGISTRY:
                raise UsageError(
                    f"unknown strategy {s!r}; valid: {', '.join(sorted(strategies.REGISTRY))}"
                )
        for m in self.models:
            if m not in MODELS:
                raise UsageError(f"unknown model {m!r}; valid: {', '.join(sorted(MODELS))}")
        for p in self.precisions:
            if p not in PRECISIONS:
                raise UsageError(f"unknown precision {p!r}; valid: {', '.join(PRECISIONS)}")
        if self.loss not in LOSSES:
            raise UsageError(f"unknown loss {self.loss!r}; valid: {', '.join(LOSSES)}")
        for size in self.image_sizes:
            if size < MIN_IMAGE_SIZE:
                raise UsageError(
                    f"image size {size} is too small for ResNets (they downsample by 32); "
                    f"use {MIN_IMAGE_SIZE} or more"
                )
        if self.warmup_steps < 0 or self.timed_steps < 1:
            raise UsageError("warmup_steps must be >= 0 and timed_steps >= 1")
        if self.case_timeout_s <= 0 or self.max_time_s <= 0:
            raise UsageError("case_timeout_s and max_time_s must be positive")
        if self.ci_target_pct < 0 or self.sample_interval_ms <= 0:
            raise UsageError(
                f"ci_target_pct must be >= 0 (got {self.ci_target_pct}) and "
                f"sample_interval_ms > 0 (got {self.sample_interval_ms})"
            )

    def override(self, **changes: object) -> Profile:
        """A copy with the non-None ``changes`` applied (CLI flags)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_TUPLE_FIELDS = {f.name for f in dataclasses.fields(Profile) if "tuple" in str(f.type)}


def profile_path(name_or_path: str, rig: Rig) -> Path:
    """Resolve a profile name (``default`` picks ``default-<rig kind>``) or a file path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UsageError(f"profile file {path} does not exist")
        return path
    name = f"default-{rig.kind}" if name_or_path == "default" else name_or_path
    path = PROFILE_DIR / f"{name}.toml"
    if not path.is_file():
        raise UsageError(f"unknown profile {name_or_path!r}; valid: {', '.join(profile_names())}")
    return path


def profile_names() -> list[str]:
    """Names of the profiles shipped with the library (plus ``default``)."""
    return sorted({"default", *(p.stem for p in PROFILE_DIR.glob("*.toml"))})


def load_profile(path: Path) -> Profile:
    """Read a profile file; errors name the file and the offending key."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML: {e}") from None
    known = {f.name for f in dataclasses.fields(Profile)}
    for key, value in data.items():
        if key not in known:
            raise UsageError(f"{path}: unknown key {key!r}; valid keys: {', '.join(sorted(known))}")
        if key in _TUPLE_FIELDS and not isinstance(value, list):
            raise UsageError(f"{path}: key {key!r} must be a list, got {value!r}")
    values = {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in data.items()}
    values.setdefault("name", path.stem)
    try:
        return Profile(**values)
    except UsageError as e:
        raise UsageError(f"{path}: {e}") from None
    except TypeError as e:
        raise UsageError(f"{path}: {e}") from None


@dataclass(frozen=True)
class Case:
    """One strategy on one workload with one split size: the unit that is measured."""

    strategy: str
    model: str
    image_size: int
    batch_size: int
    split_size: int | None
    precision: str
    loss: str
    status: str | None = None
    """None when the case is to run; ``skipped`` or ``unsupported`` when it is not."""
    reason: str = ""
    """Why the case is skipped or unsupported."""
    settings: dict = field(default_factory=dict, compare=False, hash=False)
    """Sweep-level settings: warmup_steps, timed_steps, max_time_s, case_timeout_s."""

    @property
    def case_id(self) -> str:
        split = "-" if self.split_size is None else self.split_size
        return (
            f"{self.strategy}_{self.model}_img{self.image_size}_b{self.batch_size}"
            f"_s{split}_{self.precision}"
        )

    @property
    def num_microbatches(self) -> int | None:
        if self.split_size is None:
            return None
        return math.ceil(self.batch_size / self.split_size)

    def describe(self) -> str:
        split = "" if self.split_size is None else f" split={self.split_size}"
        return f"{self.strategy} {self.model} img={self.image_size} batch={self.batch_size}{split}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        return cls(**d)


def validate(profile: Profile, rig: Rig) -> None:
    """Raise ``UsageError`` for values that no case of the sweep can use."""
    specs = [strategies.get(s) for s in profile.strategies]
    if any(s.uses_split for s in specs):
        for split in profile.split_sizes:
            if split > max(profile.batch_sizes):
                raise UsageError(
                    f"split size {split} is larger than every batch size "
                    f"({', '.join(map(str, profile.batch_sizes))}); use a split size <= "
                    f"{max(profile.batch_sizes)}"
                )
    for spec in specs:
        if not spec.per_device_processes or spec.unsupported_reason(rig):
            continue
        world = spec.num_devices(rig)
        if not any(b % world == 0 for b in profile.batch_sizes):
            raise UsageError(
                f"no batch size ({', '.join(map(str, profile.batch_sizes))}) is divisible by "
                f"{spec.name}'s world size {world}; use a multiple of {world}"
            )


def expand(profile: Profile, rig: Rig) -> list[Case]:
    """The sweep's cases in run order, each marked to run, skipped or unsupported."""
    validate(profile, rig)
    settings = {
        "warmup_steps": profile.warmup_steps,
        "timed_steps": profile.timed_steps,
        "max_time_s": profile.max_time_s,
        "case_timeout_s": profile.case_timeout_s,
        "ci_target_pct": profile.ci_target_pct,
        "sample_interval_ms": profile.sample_interval_ms,
    }
    cases: list[Case] = []
    # `single` first in each workload group: every speedup is relative to it, so it is
    # known by the time the other strategies' rows are written.
    ordered = sorted(profile.strategies, key=lambda s: s != "single")
    grid = itertools.product(
        profile.models, profile.precisions, profile.image_sizes, profile.batch_sizes, ordered
    )
    for model, precision, image, batch, name in grid:
        spec = strategies.get(name)
        splits: tuple[int | None, ...] = profile.split_sizes if spec.uses_split else (None,)
        for split in splits:
            status, reason = _check_case(spec, rig, batch, split)
            cases.append(
                Case(name, model, image, batch, split, precision, profile.loss, status, reason,
                     settings)
            )
    return cases


def _check_case(
    spec: strategies.Strategy, rig: Rig, batch: int, split: int | None
) -> tuple[str | None, str]:
    reason = spec.unsupported_reason(rig)
    if reason:
        return "unsupported", reason
    if split is not None and split > batch:
        return "skipped", f"split size {split} is larger than batch size {batch}"
    if spec.per_device_processes:
        world = spec.num_devices(rig)
        if batch % world:
            return "skipped", f"batch size {batch} is not divisible by world size {world}"
    return None, ""
