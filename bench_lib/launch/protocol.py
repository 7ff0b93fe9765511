"""The runner <-> worker protocol, typed on both sides.

The runner writes a ``CaseSpec`` as ``spec.json`` into the case's work folder and starts
the ranks (``python -m bench_lib.launch.worker SPEC_JSON RANK``, or through torchrun with the
rank in its environment: ``launch.torchrun``); each rank writes its
``RankResult`` as ``rank<RANK>.json`` beside it. The runner combines the rank results (and
what it saw itself: exit codes, timeouts, the sampler) into one ``CaseOutcome``. Before it
builds the model, each rank records its resident memory in ``baseline_path`` (the runner's
CPU memory cap counts only what the case adds beyond it).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib.measure.contention import MachineLoad
from bench_lib.measure.timing import WARMUP_EXTRA_MAX
from bench_lib.results.store import write_json_atomic
from bench_lib.rig import Rig
from bench_lib.sweep.cases import Case

TimelineRow = dict[str, Any]
"""One timeline.csv row: rank, stage, device, microbatch, phase, start_s, end_s."""
SampleRow = dict[str, Any]
"""One samples.csv row: time_unix_s, device and the sampler's metrics."""
RANK_STATUSES = ("ok", "oom", "error")
OOM_MARKS = ("out of memory", "outofmemoryerror", "_alloc_failed")
"""What an out-of-memory error says (lower-cased), however it surfaced: torch's allocator
(``torch.OutOfMemoryError: CUDA out of memory``), a CUDA call inside NCCL
(``DistBackendError ... Cuda failure 2 'out of memory'``, ``CUDA error: out of memory``),
cuDNN, cuBLAS, cuSOLVER or cuSPARSE (``CUDNN_STATUS_ALLOC_FAILED``,
``CUBLAS_STATUS_ALLOC_FAILED``...), cuFFT (``CUFFT_ALLOC_FAILED``)."""
REASON_CHARS = 500
"""The longest reason a failed rank writes (the traceback goes to its log)."""


def is_oom(failure: BaseException | str) -> bool:
    """Whether ``failure`` (an exception, or a rank's error text read after the fact) says a
    device or the host ran out of memory: by its message, not only its type (``OOM_MARKS``:
    only torch's own allocator raises ``torch.OutOfMemoryError``). The one rule every
    status is decided by."""
    if isinstance(failure, MemoryError):
        return True
    text = (failure if isinstance(failure, str)
            else f"{type(failure).__name__}: {failure}").lower()
    return any(mark in text for mark in OOM_MARKS)


def baseline_path(case_dir: Path, rank: int) -> Path:
    """Where a rank records, as ``{"rss_mib": ...}``, its resident memory (MiB) before the
    model was built: its runtime (torch, libraries, process group)."""
    return case_dir / f"rank{rank}.baseline.json"


@dataclass(frozen=True)
class CaseSpec:
    """One launch of a case: what every rank of it is told. The runner makes one per launch
    (the facts its earlier launches decided), ``run.case_launch.run_case`` writes it as
    spec.json, and each rank's worker reads it back."""

    case: Case
    rig: Rig
    trace: bool = True
    """Trace a step for the pipeline timeline after the timed ones (the first launch only)."""
    cut: str = ""
    """The stage cut to use instead of choosing one: the first launch's, e.g.
    ``balanced:6,12``, so that every launch measures the same cut; empty: choose it."""
    warmup_steps: int | None = None
    """The warm-up to run as a fixed count: what the first launch found (``reused_warmup``);
    None: the profile's minimum, then ``timing.WarmupRule``."""
    compute_only: bool = True
    """Time the compute-only steps after the timed ones: every launch of a run, so that
    ``CaseOutcome.compute_step_s`` is a median over launches; not tune's short launches."""

    def write(self, path: Path) -> None:
        write_json_atomic(path, {"case": self.case.as_dict(), "rig": self.rig.as_dict(),
                                 "trace": self.trace, "cut": self.cut,
                                 "warmup_steps": self.warmup_steps,
                                 "compute_only": self.compute_only})

    @classmethod
    def read(cls, path: Path) -> CaseSpec:
        data = json.loads(path.read_text())
        warmup = data.get("warmup_steps")
        trace = bool(data.get("trace", True))
        # A spec written before ``compute_only`` existed ran those steps where it traced.
        return cls(Case.from_dict(data["case"]), Rig.from_dict(data["rig"]), trace,
                   str(data.get("cut", "")), None if warmup is None else int(warmup),
                   bool(data.get("compute_only", trace)))


def reused_warmup(first: CaseOutcome, minimum: int) -> int | None:
    """The warm-up a case's later launches run as a fixed count, from its first launch's
    (``warmup_steps``: W steps under ``timing.WarmupRule``; ``minimum``: the profile's).

    The rule stopped after step W because it was no new low; past the minimum, it had gone
    on after step W-1 because that step was one (the fastest so far, by over the
    tolerance). So steps W-1 and W were both at the level the steps settled to: a later
    launch (a fresh process warming up as the first did) times from step W-1 on, after
    W-2 warm-up steps. On a CPU the first step alone is slow (allocation): W = 3, and later
    launches discard only that step. Never fewer than ``minimum``; a first launch that ran
    into the rule's cap (still falling) is reused whole. None: nothing to reuse (no
    warm-up asked, or the first launch did not time).
    """
    ran = first.warmup_steps
    if ran is None or minimum == 0:
        return None
    capped = ran >= minimum + WARMUP_EXTRA_MAX
    return max(minimum, ran if capped else ran - 2)


@dataclass(frozen=True)
class RankResult:
    """What one rank measured, or why it could not."""

    rank: int
    status: str
    """``ok``, ``oom`` or ``error`` (one of ``RANK_STATUSES``)."""
    reason: str = ""
    """Why the rank did not end ok."""
    step_times_s: tuple[float, ...] = ()
    """This rank's time of each timed step."""
    step_cpu_times_s: tuple[float, ...] = ()
    """This rank's process CPU time (all threads) in each timed step, seconds."""
    probe_times_s: tuple[float, ...] = ()
    """The speed probe's seconds before each timed step (``measure.speed_probe``; empty
    where none ran: GPUs)."""
    timed_window_unix_s: tuple[float, float] | None = None
    """Wall-clock start and end of this rank's timed window."""
    stop_reason: str = ""
    """What ended timing (``timing.STOP_REASONS``); every rank stops after the same step."""
    warmup_steps: int = 0
    """Warm-up steps run before the timed ones (``timing.WarmupRule``; equal on every rank)."""
    warmup_time_s: float = 0.0
    """The warm-up steps' time, all of them together, seconds."""
    warmup_first_step_s: float = 0.0
    """The first warm-up step's time, part of ``warmup_time_s`` (``timing.TimedSteps``)."""
    stamps_s: dict[str, float] = field(default_factory=dict)
    """Named points of this rank's launch on the host's ``time.monotonic()`` clock (process
    start, CUDA context, process group, model build, steps, diagnostics, done): the
    launch's parts (``launch_parts.worker_parts``). A failed rank keeps those it reached."""
    peak_mem_mib: dict[str, float] = field(default_factory=dict)
    """Peak memory per device label over the timed steps, runtime included (gross)."""
    peak_mem_net_mib: dict[str, float] = field(default_factory=dict)
    """The same net of the footprint before the model was built (``measure.memory``)."""
    peak_mem_source: str = ""
    """How the peaks were read (``measure.memory.SOURCES``)."""
    peak_mem_reserved_mib: dict[str, float] = field(default_factory=dict)
    """CUDA caching allocator's peak per device label (empty on CPU)."""
    partition: str = ""
    """The stage cut used, e.g. ``balanced:8`` (strategies that cut the model)."""
    timeline: tuple[TimelineRow, ...] = ()
    """The traced step's intervals on this host's monotonic clock (pipelined strategies)."""
    traced_step_s: float | None = None
    """Wall time of this rank's traced step, timed like a timed step (None: no trace)."""
    compute_step_s: float | None = None
    """Median of the steps this rank ran with no collective after the timed ones, in every
    launch of a run (``CaseSpec.compute_only``; ``Trainer.without_communication``: DDP's
    ``no_sync``), the compute part of its bound; None where the strategy has no such mode
    or the launch ran none."""
    optimizer_step_s: float | None = None
    """``single``: median of the optimizer steps timed alone after the timed steps, in the
    launch that traces (the waterfall counts it once per step, not per micro-batch); None
    for other strategies."""
    failed_at_unix_s: float | None = None
    """Wall-clock time (``time.time()``) the rank's exception handler caught its failure
    (``oom``/``error``); the runner blames the rank that failed first. None: it did not."""
    trace_note: str = ""
    """Why an ``ok`` rank has no timeline though it timed fine: its traced step failed (e.g.
    out of memory), or did not finish (the rank writes its timed result before tracing, with
    this saying so, and rewrites it once the traced step is done), or did not run (an
    earlier diagnostic failed). Empty: traced, or no trace was asked for."""
    diagnostics_note: str = ""
    """Why an ``ok`` rank lacks a diagnostic other than the traced step (``launch.diagnostics``:
    the compute-only steps, the optimizer steps, the kernel-names step): it failed (e.g.
    ``out of memory in the compute-only steps after the timed ones: ...``), ran past its
    time bound, or did not finish (the rank writes its timed result before its diagnostics,
    with this naming the one under way, and rewrites it as they go); and those it did not
    run after it. Empty: every diagnostic asked for ran."""
    kernel_names: tuple[str, ...] = ()
    """cuda rigs: the sorted names of the CUDA kernels one step after the timed ones ran
    (``measure.kernels``: cuDNN's benchmark mode picks per process); empty elsewhere."""

    def __post_init__(self) -> None:
        if self.status not in RANK_STATUSES:
            raise ValueError(f"bad rank status {self.status!r}; valid: {', '.join(RANK_STATUSES)}")

    def write(self, path: Path) -> None:
        write_json_atomic(path, dataclasses.asdict(self))

    @classmethod
    def read(cls, path: Path) -> RankResult:
        d = json.loads(path.read_text())
        window = d.get("timed_window_unix_s")
        return cls(**(d | {"step_times_s": tuple(d.get("step_times_s", ())),
                           "step_cpu_times_s": tuple(d.get("step_cpu_times_s", ())),
                           "probe_times_s": tuple(d.get("probe_times_s", ())),
                           "timed_window_unix_s": tuple(window) if window else None,
                           "timeline": tuple(d.get("timeline", ())),
                           "kernel_names": tuple(d.get("kernel_names", ()))}))

    @classmethod
    def failed(cls, rank: int, e: BaseException) -> RankResult:
        """The result of a rank whose run raised ``e``, failed now: ``oom`` where it ran
        out of memory (``is_oom``), else ``error``; the reason names the exception."""
        at = time.time()
        if isinstance(e, MemoryError):
            return cls(rank, "oom", f"host out of memory: {e}"[:REASON_CHARS],
                       failed_at_unix_s=at)
        text = f"{type(e).__name__}: {e}"
        if is_oom(e):  # torch's own "CUDA out of memory. ..." says it without its type
            said = str(e) if type(e).__name__ == "OutOfMemoryError" else text
            return cls(rank, "oom", f"out of memory: {said}"[:REASON_CHARS],
                       failed_at_unix_s=at)
        return cls(rank, "error", text[:REASON_CHARS], failed_at_unix_s=at)


def _median(values: list[float | None]) -> float | None:
    """The median of the values measured (None where none was)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each key's sum over the dicts that have it."""
    out: dict[str, float] = {}
    for p in parts:
        for key, seconds in p.items():
            out[key] = out.get(key, 0.0) + seconds
    return out


@dataclass
class CaseOutcome:
    """What happened to one case, all ranks combined: the runner's view."""

    status: str
    reason: str = ""
    step_times_s: list[float] = field(default_factory=list)
    """Per timed step, the slowest rank's time (``analysis.stats.slowest_per_step``)."""
    rank_step_times_s: dict[int, list[float]] = field(default_factory=dict)
    rank_step_cpu_times_s: dict[int, list[float]] = field(default_factory=dict)
    """Per rank, its process CPU time in each timed step (``timing.TimedSteps``)."""
    rank_probe_times_s: dict[int, list[float]] = field(default_factory=dict)
    """Per rank, the speed probe's seconds before each timed step (empty: none ran)."""
    peak_mem_mib: dict[str, float] = field(default_factory=dict)
    """Peak memory per device over the timed steps, runtime included (gross)."""
    peak_mem_net_mib: dict[str, float] = field(default_factory=dict)
    """Peak memory per device net of each process's footprint before the model was built."""
    peak_mem_source: str = ""
    """How the peaks were read (``measure.memory.SOURCES``; the worst of the ranks')."""
    peak_mem_reserved_mib: dict[str, float] = field(default_factory=dict)
    """CUDA caching allocator's peak reservation per device (empty on CPU)."""
    timed_window_unix_s: tuple[float, float] | None = None
    """Wall-clock start and end of the timed window, over all ranks."""
    stop_reason: str = ""
    warmup_steps: int | None = None
    """Warm-up steps the ranks ran before the timed ones (None: the case did not time)."""
    warmup_time_s: float = 0.0
    """Their time (the slowest rank's), seconds; over launches, the sum."""
    warmup_first_step_s: float = 0.0
    """The first of them (the rank whose warm-up was slowest), part of ``warmup_time_s``;
    over launches, the sum."""
    parts_s: dict[str, float] = field(default_factory=dict)
    """Where the launch's wall time beyond its timed and warm-up steps went
    (``launch_parts.LAUNCH_PARTS``: they add up to it); over launches, each part's sum."""
    partition: str = ""
    """The stage cut the ranks used (strategies that cut the model)."""
    timeline: list[TimelineRow] = field(default_factory=list)
    """Pipeline timeline rows of the traced step, every rank's on one time axis."""
    traced_step_s: float | None = None
    """Wall time of the traced step, the slowest rank's (None: no trace)."""
    compute_step_s: float | None = None
    """The slowest rank's step with no collective (``RankResult.compute_step_s``, timed in
    every launch); over launches, their median, so that one launch's busy moment does not
    decide it. None: not measured."""
    optimizer_step_s: float | None = None
    """``single``'s optimizer step alone (``RankResult.optimizer_step_s``); over launches,
    their median. None: not measured."""
    sampler_note: str = ""
    """Why a sampler source gave nothing (``Sampler.note``): joined into the row's
    ``sampler_note``."""
    trace_note: str = ""
    """Why an ``ok`` case has no timeline although it timed fine: each rank's traced step
    that failed or did not finish, e.g. ``rank 1: out of memory in the traced step ...``
    (the timed steps are kept; a partial timeline is dropped). Empty otherwise."""
    diagnostics_note: str = ""
    """Why an ``ok`` case lacks a diagnostic (``RankResult.diagnostics_note``), each rank's,
    e.g. ``diagnostics incomplete: rank 0: out of memory in the compute-only steps ...;
    rank 1: the compute-only steps did not finish (killed by SIGKILL)``: the figures that
    need every rank's (``compute_step_s``, ``kernel_names``) are left out; over launches,
    each launch's that has one. Empty otherwise."""
    kernel_names: tuple[str, ...] = ()
    """One launch's CUDA kernels, every rank's (``RankResult.kernel_names``); an outcome
    that combines launches leaves it empty and each of its ``launches`` keeps its own."""
    samples: list[SampleRow] = field(default_factory=list)
    """The sampler's rows over the whole case."""
    wall_time_s: float = 0.0
    machine_load: MachineLoad | None = None
    """Steal and other processes' CPU over the whole case (None: the case did not run)."""
    launches: list[CaseOutcome] = field(default_factory=list)
    """The outcome of each launch, in round order, where this one combines several
    (``of_launches``); empty: this outcome is one launch."""

    def parts(self) -> list[CaseOutcome]:
        """The launches behind this outcome (itself when it is one)."""
        return self.launches or [self]

    def launch_step_times_s(self) -> list[list[float]]:
        """Each launch's timed steps (the slowest rank's per step), in round order."""
        return [p.step_times_s for p in self.parts()]

    @classmethod
    def of_launches(cls, launches: list[CaseOutcome]) -> CaseOutcome:
        """One case's outcome from its launches (round order): the first launch that did not
        end ok decides a failed case; otherwise steps are pooled (``launches`` keeps them
        apart), peaks are the largest any launch reached, the timeline (and its trace note)
        is the first launch's (the only one traced), and the load is the busiest launch's."""
        if not launches:
            raise ValueError("a case needs at least one launch")
        if len(launches) == 1:
            return launches[0]
        total = len(launches)
        wall = sum(o.wall_time_s for o in launches)
        samples = [s for o in launches for s in o.samples]
        for k, o in enumerate(launches):
            if o.status != "ok":
                return cls(o.status, f"launch {k + 1} of {total}: {o.reason}", samples=samples,
                           wall_time_s=wall, machine_load=o.machine_load)

        def pooled(get: Callable[[CaseOutcome], dict[int, list[float]]],
                   ) -> dict[int, list[float]]:
            out: dict[int, list[float]] = {}
            for o in launches:
                for rank, times in get(o).items():
                    out.setdefault(rank, []).extend(times)
            return out

        def largest(get: Callable[[CaseOutcome], dict[str, float]]) -> dict[str, float]:
            out: dict[str, float] = {}
            for o in launches:
                for key, mib in get(o).items():
                    out[key] = max(mib, out.get(key, mib))
            return out

        loads = [o.machine_load for o in launches if o.machine_load is not None]
        sources = {o.peak_mem_source for o in launches}
        reasons = [o.stop_reason for o in launches]
        cuts = list(dict.fromkeys(o.partition for o in launches if o.partition))
        first = launches[0]
        return cls(
            "ok", step_times_s=[t for o in launches for t in o.step_times_s],
            rank_step_times_s=pooled(lambda o: o.rank_step_times_s),
            rank_step_cpu_times_s=pooled(lambda o: o.rank_step_cpu_times_s),
            rank_probe_times_s=pooled(lambda o: o.rank_probe_times_s),
            peak_mem_mib=largest(lambda o: o.peak_mem_mib),
            peak_mem_net_mib=largest(lambda o: o.peak_mem_net_mib),
            peak_mem_source="ru_maxrss" if "ru_maxrss" in sources else first.peak_mem_source,
            peak_mem_reserved_mib=largest(lambda o: o.peak_mem_reserved_mib),
            timed_window_unix_s=first.timed_window_unix_s,
            stop_reason=reasons[0] if len(set(reasons)) == 1 else ";".join(reasons),
            # The most warm-up any launch needed; steps.csv has each launch's timed steps.
            warmup_steps=max((o.warmup_steps for o in launches if o.warmup_steps is not None),
                             default=None),
            warmup_time_s=sum(o.warmup_time_s for o in launches),
            warmup_first_step_s=sum(o.warmup_first_step_s for o in launches),
            parts_s=_summed([o.parts_s for o in launches]),
            # Later launches reuse the first launch's cut (CaseSpec.cut): one label; any other
            # would show here.
            partition="|".join(cuts),
            timeline=first.timeline, traced_step_s=first.traced_step_s,
            compute_step_s=_median([o.compute_step_s for o in launches]),
            optimizer_step_s=_median([o.optimizer_step_s for o in launches]),
            trace_note=first.trace_note,
            diagnostics_note="; ".join(f"launch {k + 1}: {o.diagnostics_note}"
                                       for k, o in enumerate(launches) if o.diagnostics_note),
            samples=samples,
            sampler_note="; ".join(dict.fromkeys(o.sampler_note for o in launches
                                                 if o.sampler_note)),
            wall_time_s=wall,
            machine_load=max(loads, key=lambda m: m.other_cpu_pct + m.cpu_steal_pct,
                             default=None),
            launches=list(launches),
        )
