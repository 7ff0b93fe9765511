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
from bench_lib.partition import PARTITIONS
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
    microbatches: tuple[int, ...] = ()
    """Micro-batch counts, another way to give splits: count m means split ceil(batch / m)."""
    precisions: tuple[str, ...] = ("fp32",)
    """``fp32`` and/or ``bf16``."""
    partitions: tuple[str, ...] = ("tutorial",)
    """Stage cuts for strategies that cut the model (``partition.PARTITIONS``)."""
    channels_last: bool = False
    """Train in channels-last memory format (model and inputs)."""
    compile: bool = False
    """torch.compile each strategy's modules (in place, before warm-up)."""
    sync_bn: bool = False
    """SyncBatchNorm in data-parallel strategies (ddp, fsdp); it needs GPU inputs."""
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
    max_memory_per_device_mib: float = 0.0
    """Memory cap per device in MiB (0: none); a case above it is recorded as ``oom``."""
    ci_target_pct: float = 2.0
    """Timing stops once the median's 95% CI half-width is under this % of it (0: off);
    ``timed_steps`` and ``max_time_s`` stay caps."""
    sample_interval_ms: float = 100.0
    """Interval of the utilisation/memory/power sampler (NVML refreshes every 1/6 s to 1 s)."""

    def __post_init__(self) -> None:
        for name in ("image_sizes", "batch_sizes", "split_sizes", "microbatches"):
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
        for p in self.partitions:
            if p not in PARTITIONS:
                raise UsageError(f"unknown partition {p!r}; valid: {', '.join(PARTITIONS)}")
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
        if self.max_memory_per_device_mib < 0:
            raise UsageError("max_memory_per_device_mib must be >= 0 (0: no cap)")
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

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """The inverse of ``as_dict`` (lists become tuples)."""
        return cls(**{k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in data.items()})


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
    partition: str | None = None
    """Stage cut of strategies that cut the model (``partition.PARTITIONS``); None otherwise."""
    channels_last: bool = False
    """Model and inputs in channels-last memory format."""
    compile: bool = False
    """Modules torch.compiled in place before warm-up."""
    sync_bn: bool = False
    """SyncBatchNorm across ranks (data-parallel strategies only)."""

    @property
    def case_id(self) -> str:
        split = "-" if self.split_size is None else self.split_size
        return (
            f"{self.strategy}_{self.model}_img{self.image_size}_b{self.batch_size}"
            f"_s{split}_{self.precision}{self.option_suffix}"
        )

    @property
    def option_suffix(self) -> str:
        """Case-id suffix of the non-default options (empty for defaults: ids stay stable)."""
        parts = [f"_p{self.partition}" if self.partition not in (None, "tutorial") else "",
                 "_cl" if self.channels_last else "", "_compile" if self.compile else "",
                 "_syncbn" if self.sync_bn else ""]
        return "".join(parts)

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
        biggest = max(profile.batch_sizes)
        batches = ", ".join(map(str, profile.batch_sizes))
        if not profile.split_sizes and not profile.microbatches:
            raise UsageError("pipelined strategies need split sizes or micro-batch counts")
        for split in profile.split_sizes:
            if split > biggest:
                raise UsageError(
                    f"split size {split} is larger than every batch size ({batches}); "
                    f"use a split size <= {biggest}"
                )
        for count in profile.microbatches:
            if count > biggest:
                raise UsageError(
                    f"{count} micro-batches is more than every batch size ({batches}) holds; "
                    f"use a count <= {biggest}"
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
        "max_memory_per_device_mib": profile.max_memory_per_device_mib,
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
        for split in _splits(profile, batch) if spec.uses_split else [None]:
            status, reason = _check_case(spec, rig, batch, split)
            cases.append(
                Case(name, model, image, batch, split, precision, profile.loss, status, reason,
                     settings)
            )
        if spec.uses_split:
            for count in (m for m in profile.microbatches if m > batch):
                # No split size exists for this count: record it under split = count.
                reason = f"{count} micro-batches do not fit in batch size {batch}"
                cases.append(Case(name, model, image, batch, count, precision, profile.loss,
                                  "skipped", reason, settings))
    cases = [v for case in cases for v in _option_variants(case, profile, rig)]
    unique: dict[str, Case] = {}
    for case in cases:
        unique.setdefault(case.case_id, case)  # first wins: a real split over a count's stand-in
    return list(unique.values())


def _splits(profile: Profile, batch: int) -> list[int]:
    """Split sizes for one batch size: the given sizes, then those of the given counts.

    A count larger than the batch has no split; it is left out here and reported by
    ``_count_skips``.
    """
    from_counts = [math.ceil(batch / m) for m in profile.microbatches if m <= batch]
    return list(dict.fromkeys([*profile.split_sizes, *from_counts]))


def _option_variants(case: Case, profile: Profile, rig: Rig) -> list[Case]:
    """The case once per partition (strategies that cut the model), with the sweep's options."""
    spec = strategies.get(case.strategy)
    partitions = profile.partitions if spec.uses_partition else (None,)
    variants = []
    for partition in partitions:
        v = dataclasses.replace(case, partition=partition, channels_last=profile.channels_last,
                                compile=profile.compile,
                                sync_bn=profile.sync_bn and spec.data_parallel)
        reason = _option_problem(spec, rig, v) if v.status is None else None
        variants.append(dataclasses.replace(v, status=reason[0], reason=reason[1])
                        if reason else v)
    return variants


def _option_problem(spec: strategies.Strategy, rig: Rig, case: Case) -> tuple[str, str] | None:
    """(status, reason) when the case's options cannot run, else None."""
    if spec.even_split and case.split_size and case.batch_size % case.split_size:
        return "skipped", (f"{spec.name} needs equal micro-batches: batch {case.batch_size} "
                           f"is not a multiple of split {case.split_size}")
    if case.sync_bn and rig.kind != "cuda":
        return "unsupported", ("torch.nn.SyncBatchNorm only runs on GPU inputs; "
                               "a cpu rig cannot synchronise BatchNorm")
    if case.compile and spec.compile_unsupported:
        return "unsupported", spec.compile_unsupported
    if case.channels_last and spec.channels_last_unsupported:
        return "unsupported", spec.channels_last_unsupported
    return None


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
