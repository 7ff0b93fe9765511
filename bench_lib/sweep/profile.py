"""Profiles: a sweep declared as data (TOML parameter lists) plus how each case is measured.

Precedence, stated once: CLI flags > profile file > the defaults of ``Profile`` and
``Measurement``. A profile file, ``Profile.as_dict`` (env.json's ``profile``) and the CLI use
the same flat keys (``Profile.keys``): grid keys and measurement keys side by side.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib import strategies
from bench_lib.math_modes import DEFAULT_MATH_MODE, MATH_MODES
from bench_lib.strategies.ddp_knobs import COMM_HOOKS, KNOB_GRIDS, DdpKnobs, knob_grid
from bench_lib.strategies.partition import PARTITIONS
from bench_lib.workloads import CLASSIFIER_LOSSES, MODELS, PRECISIONS, get_model

PROFILE_DIR = Path(__file__).parent / "profiles"
SCALINGS = ("strong", "weak")
"""How a strategy on several devices is fed (``Profile.scaling``, ``cases.Case.scaling``)."""


class UsageError(ValueError):
    """Bad input from the user: reported with exit code 2 before anything is written."""


MIN_TIME_S_BY_RIG = {"cuda": 3.0, "cpu": 0.0}
"""A launch's minimum timed seconds per rig kind, where the profile gives no ``min_time_s``.
cuda: GPU steps are steady, so the CI target ends a launch after 8 steps, in 0.3-0.6 s for
ResNet50 at 128 px and batch 120 on an A100 or H100 and less for ddp's shares, and a timed
window under 1 s leaves utilisation, power and energy empty (``measure.energy.MIN_WINDOW_S``:
NVML averages over up to 1 s); 3 s gives about 30 samples at the default 100 ms. cpu: a
ResNet50 step on a worker's core takes 0.3 s and more (64 px, batch 16), so the profiles'
windows are seconds long already, and the 15-minute default-cpu budget has none to spare."""


@dataclass(frozen=True)
class Measurement:
    """How every case of a sweep is measured: counts, caps, limits, sampling, math mode."""

    warmup_steps: int = 2
    """Steps run and discarded before timing, at least (per launch)."""
    timed_steps: int = 10
    """Most steps timed per launch."""
    max_time_s: float = 60.0
    """Timing of a launch stops after this many seconds of timed steps (at least 3 steps):
    the hard cap, which ``min_time_s`` never outlasts."""
    min_time_s: float | None = None
    """Timing of a launch goes on until this many seconds of timed steps, past the CI target
    and past ``timed_steps`` (``max_time_s`` still caps it): the sampler's utilisation,
    power and energy need a timed window of at least 1 s, which a GPU's few fast steps
    miss. None (no such key in the file): the rig kind's, ``MIN_TIME_S_BY_RIG`` (3 s on
    cuda, 0 on cpu), never over ``max_time_s``, resolved as a case is made (``for_rig``)."""
    launches: int = 3
    """Fresh process launches per case, interleaved in rounds across the cases of a
    workload (``run.runner``): the case's interval comes from the spread between them, so
    1 gives none."""
    case_timeout_s: float = 600.0
    """A launch still running after this many seconds is killed; the case is recorded as
    ``timeout``."""
    max_memory_per_device_mib: float = 0.0
    """Memory cap per device in MiB (0: none); a case above it is recorded as ``oom``."""
    predict_skip: bool = True
    """A case whose predicted peak memory exceeds a device's memory (the cap above, else a
    GPU's total memory) is recorded ``oom`` without being launched (``prediction.admission``);
    False: it is launched anyway."""
    interval_target_pct: float = 2.0
    """A launch's timing stops once its median's 95% CI half-width (over its own steps) is
    under this % of it (0: off); ``timed_steps`` and ``max_time_s`` stay caps."""
    sample_interval_ms: float = 100.0
    """Interval of the utilisation/memory/power sampler (NVML refreshes every 1/6 s to 1 s)."""
    diagnostics: bool = True
    """After its timed steps each launch runs the compute-only steps (the waterfall's and the
    bound's compute part), and a case's first launch ``single``'s optimizer steps and the
    traced step (the pipeline timeline and its bubble): ``launch.diagnostics``. False where
    only step times are compared (the ci profile's gates): none of these run, the timed
    steps are the same and the columns those fill stay empty (a cuda rig's launch still
    reads its kernels' names, one step)."""
    math_mode: str = DEFAULT_MATH_MODE
    """The fp32 math every case, its calibration and the FLOP peak probe compute in
    (``math_modes.MATH_MODES``): ``torch``, PyTorch's own TF32 flags (cuDNN convolutions in TF32 on
    Ampere and later, cuBLAS matmuls in IEEE fp32), as users train; ``ieee``, TF32 off in
    both. bf16 cases run under autocast either way."""

    def __post_init__(self) -> None:
        if self.launches < 1:
            raise UsageError(f"launches must be >= 1, got {self.launches}")
        if self.warmup_steps < 0 or self.timed_steps < 1:
            raise UsageError(f"warmup_steps must be >= 0 (got {self.warmup_steps}) and "
                             f"timed_steps >= 1 (got {self.timed_steps})")
        if self.case_timeout_s <= 0 or self.max_time_s <= 0:
            raise UsageError(f"case_timeout_s (got {self.case_timeout_s}) and max_time_s "
                             f"(got {self.max_time_s}) must be positive")
        _check_names("math mode", (self.math_mode,), MATH_MODES)
        for key in ("predict_skip", "diagnostics"):
            if not isinstance(getattr(self, key), bool):
                raise UsageError(f"{key} must be true or false, got {getattr(self, key)!r}")
        if self.min_time_s is not None and not 0 <= self.min_time_s <= self.max_time_s:
            raise UsageError(f"min_time_s must be between 0 and max_time_s ({self.max_time_s:g}"
                             f", the hard cap), got {self.min_time_s}")
        if self.max_memory_per_device_mib < 0:
            raise UsageError("max_memory_per_device_mib must be >= 0 (0: no cap), got "
                             f"{self.max_memory_per_device_mib}")
        if self.interval_target_pct < 0 or self.sample_interval_ms <= 0:
            raise UsageError(
                f"interval_target_pct must be >= 0 (got {self.interval_target_pct}) and "
                f"sample_interval_ms > 0 (got {self.sample_interval_ms})"
            )

    def for_rig(self, kind: str) -> Measurement:
        """This measurement on a rig of ``kind``: ``min_time_s`` resolved (where None, the
        kind's ``MIN_TIME_S_BY_RIG``, never over ``max_time_s``)."""
        if self.min_time_s is not None:
            return self
        return dataclasses.replace(
            self, min_time_s=min(MIN_TIME_S_BY_RIG.get(kind, 0.0), self.max_time_s))


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
    """Square image sizes in pixels. A model that takes no image size (``toy``, ``mlp``)
    runs once at its own recorded size instead (``image_sizes_for``)."""
    batch_sizes: tuple[int, ...] = (32,)
    """Global batch sizes."""
    batch_sizes_by_image_size: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Global batch sizes of particular image sizes, swept there instead of ``batch_sizes``
    (a smaller batch where ``batch_sizes`` would not fit one device at that size). In a file
    an inline table, ``batch_sizes_by_image_size = { 512 = [24] }``; here sorted (image size,
    batch sizes) pairs. An entry for an image size the sweep does not use is ignored, and a
    ``--batch-sizes`` given on the command line replaces it as it replaces ``batch_sizes``."""
    split_sizes: tuple[int, ...] = (8,)
    """Micro-batch sizes for strategies that pipeline (ignored by the others)."""
    microbatches: tuple[int, ...] = ()
    """Micro-batch counts, another way to give splits: count m means split ceil(batch / m)."""
    split_search: int = 0
    """0: the pipelined strategies measure ``split_sizes`` (and ``microbatches``). K >= 1:
    a split search instead: every split that divides the workload's batch is a candidate
    case, each predicted from the workload's calibration before its first round, and only
    the predicted fastest and its nearest neighbours in split order, K per strategy,
    partition and scaling, are measured; the others are ``skipped`` rows that keep their
    prediction (``sweep.splits``). Without a prediction, the K candidates nearest the first
    of ``split_sizes`` are measured. ``split_sizes`` or ``microbatches`` given on the
    command line turn the search off (unless this key is given too)."""
    split_search_by_strategy: tuple[tuple[str, int], ...] = ()
    """K of particular strategies, in place of ``split_search`` (0: that strategy measures
    ``split_sizes``). In a file an inline table, ``split_search_by_strategy = { accum = 1 }``;
    here sorted (strategy, K) pairs."""
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
    """``ce`` or ``mse-onehot`` (the tutorial's), for the classifiers; ``toy``, whose targets
    are real values, always trains with ``mse``."""
    ddp_bucket_cap_mb: tuple[float | None, ...] = (None,)
    """DDP bucket caps in MiB; None (``"default"`` in a file): torch's, 25 MiB after a
    first bucket of 1 MiB. This and the next four are the DDP knobs (``strategies.ddp``):
    they apply to the strategies that wrap the model in DDP, combined by ``ddp_knob_grid``."""
    ddp_gradient_as_bucket_view: tuple[bool, ...] = (False,)
    """DDP gradients as views into its buckets, off and/or on."""
    ddp_static_graph: tuple[bool, ...] = (False,)
    """DDP told the graph is static, off and/or on."""
    ddp_comm_hooks: tuple[str, ...] = ("none",)
    """DDP communication hooks (``ddp_knobs.COMM_HOOKS``): none, fp16, bf16, powersgd."""
    ddp_powersgd_rank: tuple[int, ...] = (1,)
    """PowerSGD approximation ranks (each a case where ``powersgd`` is swept)."""
    ddp_knob_grid: str = "product"
    """How the DDP knob lists combine (``ddp_knobs.KNOB_GRIDS``): ``product``, or
    ``one-at-a-time`` (each list's first value, then each other value alone)."""
    batch_curve: bool = False
    """Also measure ``single`` at every per-device batch the other cases compute (a data-
    parallel rank's share, each micro-batch size): ``single``'s batch curve, which says how
    much a device loses with fewer images at once (``sweep.batch_curve``)."""
    rig_figures: bool = True
    """Measure the rig's idle power and FLOP peak before the sweep (a few seconds: the net
    energy and MFU columns); off where only step times matter (the ci profile's gates)."""
    predict_time: bool = False
    """Calibrate each workload before its cases launch (a few seconds: ``prediction.calibration``)
    and predict every case's step time and speedup from it (``prediction.step_time``); after
    the run, each prediction's error (``step_time_s_predicted``, ``speedup_predicted``,
    ``prediction_error_pct``)."""
    scaling: tuple[str, ...] = ("strong",)
    """``strong`` and/or ``weak`` (``SCALINGS``): strong splits each batch size over a
    strategy's devices; weak gives each device the batch size (the strategy's batch is it
    times its devices, through micro-batches of the same sizes) and compares throughput with
    ``single`` at that batch. Strategies on one device run once, as strong."""
    measurement: Measurement = field(default_factory=Measurement)
    """How each case is measured (flat keys in files: ``warmup_steps``, ``timed_steps``...)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes_by_image_size",
                           _image_batches(self.batch_sizes_by_image_size))
        for name in ("image_sizes", "batch_sizes", "split_sizes", "microbatches"):
            for v in getattr(self, name):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise UsageError(f"{name} must hold positive integers, got {v!r}")
        if not self.strategies:
            raise UsageError("no strategy selected")
        _check_names("strategy", self.strategies, sorted(strategies.REGISTRY))
        _check_names("model", self.models, sorted(MODELS))
        _check_names("partition", self.partitions, PARTITIONS)
        _check_names("precision", self.precisions, PRECISIONS)
        _check_names("loss", (self.loss,), CLASSIFIER_LOSSES)
        _check_names("ddp comm hook", self.ddp_comm_hooks, COMM_HOOKS)
        _check_names("ddp knob grid", (self.ddp_knob_grid,), KNOB_GRIDS)
        _check_names("scaling", self.scaling, SCALINGS)
        if not self.scaling:
            raise UsageError("no scaling selected: give strong and/or weak")
        object.__setattr__(self, "split_search_by_strategy",
                           _searches(self.split_search_by_strategy))
        for k in (self.split_search, *dict(self.split_search_by_strategy).values()):
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise UsageError(f"split_search must be a whole number >= 0 (0: measure "
                                 f"split_sizes; K: the predicted best split and its "
                                 f"neighbours, K splits per pipelined strategy), got {k!r}")
        object.__setattr__(self, "ddp_bucket_cap_mb", _bucket_caps(self.ddp_bucket_cap_mb))
        try:  # each knob checked as the cases will build it
            if not self.ddp_knob_sets:
                raise UsageError("no ddp knob combination")
        except ValueError as e:
            raise UsageError(str(e)) from None
        sized = [get_model(m) for m in self.models if get_model(m).sized]
        for size in self.image_sizes:
            # Too small for every model it applies to: no case could use it. Too small for
            # some only: their cases are skipped rows (``cases.new_case``).
            problems = [spec.image_size_problem(size) for spec in sized]
            if problems and all(problems):
                raise UsageError(str(problems[0]))

    def split_search_for(self, strategy: str) -> int:
        """The split search's K for ``strategy`` (0: none)."""
        return dict(self.split_search_by_strategy).get(strategy, self.split_search)

    @property
    def ddp_knob_sets(self) -> tuple[DdpKnobs, ...]:
        """The DDP knob combinations each DDP-wrapped case is run with."""
        return knob_grid(self.ddp_bucket_cap_mb, self.ddp_gradient_as_bucket_view,
                         self.ddp_static_graph, self.ddp_comm_hooks, self.ddp_powersgd_rank,
                         self.ddp_knob_grid)

    def image_sizes_for(self, model: str) -> tuple[int, ...]:
        """The image sizes ``model`` runs at: the sweep's, or where the image size does not
        apply to it, its own recorded size alone."""
        spec = get_model(model)
        return self.image_sizes if spec.sized else (spec.recorded_image_size,)

    def batch_sizes_for(self, image_size: int) -> tuple[int, ...]:
        """The batch sizes swept at ``image_size``."""
        return dict(self.batch_sizes_by_image_size).get(image_size, self.batch_sizes)

    @property
    def used_batch_sizes(self) -> tuple[int, ...]:
        """Every batch size some model and image size of the sweep use, ascending."""
        return tuple(sorted({b for model in self.models for size in self.image_sizes_for(model)
                             for b in self.batch_sizes_for(size)}))

    @staticmethod
    def keys() -> tuple[str, ...]:
        """Every flat key a profile file, env.json or a CLI override may set."""
        return GRID_KEYS + MEASUREMENT_KEYS

    def override(self, **changes: object) -> Profile:
        """A copy with the non-None ``changes`` (flat keys) applied: the CLI's flags.

        New ``batch_sizes`` replace the per-image-size ones too (unless those are given);
        new ``split_sizes`` or ``microbatches`` turn the split search off (unless it is given).
        """
        given = {k: v for k, v in changes.items() if v is not None}
        if "batch_sizes" in given:
            given.setdefault("batch_sizes_by_image_size", ())
        if {"split_sizes", "microbatches"} & set(given):  # the splits asked for, measured
            given.setdefault("split_search", 0)
            given.setdefault("split_search_by_strategy", ())
        return Profile.from_dict(self.as_dict() | given)

    def as_dict(self) -> dict[str, Any]:
        """Flat keys, as in a profile file (``batch_sizes_by_image_size`` as a table with
        string keys, as TOML and JSON write it)."""
        grid = {k: getattr(self, k) for k in GRID_KEYS}
        grid["batch_sizes_by_image_size"] = {
            str(size): list(batches) for size, batches in self.batch_sizes_by_image_size}
        grid["split_search_by_strategy"] = dict(self.split_search_by_strategy)
        grid["ddp_bucket_cap_mb"] = ["default" if c is None else c
                                     for c in self.ddp_bucket_cap_mb]
        return grid | dataclasses.asdict(self.measurement)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The inverse of ``as_dict`` (lists become tuples); unknown keys are a UsageError."""
        unknown = sorted(set(data) - set(cls.keys()))
        if unknown:
            raise UsageError(f"unknown key {unknown[0]!r}; valid keys: "
                             f"{', '.join(sorted(cls.keys()))}")
        grid: dict[str, Any] = {k: tuple(v) if k in _TUPLE_KEYS else v
                                for k, v in data.items() if k in GRID_KEYS}
        measurement = {k: v for k, v in data.items() if k in MEASUREMENT_KEYS}
        return cls(**grid, measurement=Measurement(**measurement))


def _image_batches(value: object) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``batch_sizes_by_image_size`` as sorted (image size, batch sizes) pairs, from a table
    (``{512: [24]}``; keys may be strings, as TOML and JSON give them) or such pairs."""
    example = "like { 512 = [24] } (image size = batch sizes)"
    pairs: list[tuple[object, object]] = []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, tuple | list) and all(
            isinstance(p, tuple | list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise UsageError(f"batch_sizes_by_image_size must be a table {example}, got {value!r}")
    out: dict[int, tuple[int, ...]] = {}
    for key, batches in pairs:
        size = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UsageError(f"batch_sizes_by_image_size: image size {key!r} is not a "
                             f"positive integer; write the table {example}")
        if (not isinstance(batches, tuple | list) or not batches
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                       for b in batches)):
            raise UsageError(f"batch_sizes_by_image_size: image size {size} needs a list of "
                             f"positive batch sizes, got {batches!r}")
        if size in out:
            raise UsageError(f"batch_sizes_by_image_size: image size {size} is given twice")
        out[size] = tuple(batches)
    return tuple(sorted(out.items()))


def _searches(value: object) -> tuple[tuple[str, int], ...]:
    """``split_search_by_strategy`` as sorted (strategy, K) pairs, from a table
    (``{accum = 1}``) or such pairs; the strategies checked against the registry."""
    pairs = (list(value.items()) if isinstance(value, Mapping)
             else list(value) if isinstance(value, tuple | list) else None)
    if pairs is None or not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
        raise UsageError("split_search_by_strategy must be a table like { accum = 1 } "
                         f"(strategy = K), got {value!r}")
    _check_names("strategy", tuple(str(p[0]) for p in pairs),
                 sorted(strategies.REGISTRY))
    return tuple(sorted((str(name), k) for name, k in pairs))


def _bucket_caps(values: tuple[object, ...]) -> tuple[float | None, ...]:
    """``ddp_bucket_cap_mb`` as MiB, None for ``"default"`` (torch's)."""
    out: list[float | None] = []
    for v in values:
        if v is None or v == "default":
            out.append(None)
        elif isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf:
            out.append(float(v))
        else:
            raise UsageError(f"ddp_bucket_cap_mb must hold positive MiB or 'default', got {v!r}")
    return tuple(out)


def _check_names(what: str, given: tuple[str, ...], valid: list[str] | tuple[str, ...]) -> None:
    for name in given:
        if name not in valid:
            raise UsageError(f"unknown {what} {name!r}; valid: {', '.join(valid)}")


GRID_KEYS = tuple(f.name for f in dataclasses.fields(Profile) if f.name != "measurement")
MEASUREMENT_KEYS = tuple(f.name for f in dataclasses.fields(Measurement))
# Keys whose value is a list in a file (a tuple here); batch_sizes_by_image_size is a table.
_TUPLE_KEYS = {f.name for f in dataclasses.fields(Profile)
               if "tuple" in str(f.type)} - {"batch_sizes_by_image_size",
                                             "split_search_by_strategy"}


def profile_path(name_or_path: str, rig_kind: str) -> Path:
    """Resolve a profile name (``default`` picks ``default-<rig kind>``) or a file path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UsageError(f"profile file {path} does not exist")
        return path
    name = f"default-{rig_kind}" if name_or_path == "default" else name_or_path
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
    for key, value in data.items():
        if key in _TUPLE_KEYS and not isinstance(value, list):
            raise UsageError(f"{path}: key {key!r} must be a list, got {value!r}")
    data.setdefault("name", path.stem)
    try:
        return Profile.from_dict(data)
    except UsageError as e:
        raise UsageError(f"{path}: {e}") from None
    except TypeError as e:
        raise UsageError(f"{path}: {e}") from None
