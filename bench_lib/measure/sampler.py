"""Sampling devices while a case runs: the ``Sampler`` reads its sources (NVML on GPUs:
``measure.nvml_source``; psutil and RAPL on CPU rigs: ``measure.cpu_sources``) on a
background thread.

    with Sampler([ProcessSource({"0": pid0, "1": pid1}), RaplSource()], interval_s=0.1) as s:
        ...                      # the case runs
    s.samples                    # one dict per (tick, device), columns of samples.csv

A metric a source cannot read is ``None`` (an empty CSV cell), never zero. A source that
cannot be opened (no NVML library or driver) is an ``UnavailableSource`` and one that fails
while read is dropped: either way ``Sampler.note`` says why its columns are empty. Sources
are read from a background thread in the runner (parent) process, so the sampler never runs
inside the processes it measures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from bench_lib.results.schema import SAMPLE_METRIC_NAMES

MIB = 2**20
Reading = dict[str, Any]
"""One device's metrics at one tick: ``device`` and some of SAMPLE_METRIC_NAMES."""


class Source(Protocol):
    """Something the sampler reads every tick."""

    def read(self) -> list[Reading]: ...

    def close(self) -> None: ...


class UnavailableSource:
    """Stands in for a source that could not be opened: reads nothing, and says why
    (``note``, which reaches ``Sampler.note``) instead of its columns going empty silently."""

    def __init__(self, what: str, error: BaseException | str) -> None:
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.note = f"{what} unavailable ({why}): its columns are empty"

    def read(self) -> list[Reading]:
        return []

    def close(self) -> None:
        pass


class Sampler:
    """Context manager: reads every source each ``interval_s`` on a background thread.

    A source whose ``read`` raises is not read again (its columns stay empty from then on)
    and the sampler goes on with the others; ``note`` says why a source gave nothing.
    """

    def __init__(self, sources: Sequence[Source], interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be positive, got {interval_s}")
        self.sources = list(sources)
        self.interval_s = interval_s
        self.samples: list[Reading] = []
        self._failed: dict[int, str] = {}  # index in sources -> why it is no longer read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    @property
    def note(self) -> str:
        """Why some source's columns are empty ("" when every source was read): one that
        could not be opened (``UnavailableSource``), or one whose read failed."""
        notes = [n for s in self.sources if (n := str(getattr(s, "note", "") or ""))]
        return "; ".join(notes + list(self._failed.values()))

    def __enter__(self) -> Sampler:
        self._tick()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._tick()  # a last sample, so the end of the case is covered
        for i, source in enumerate(self.sources):
            try:
                source.close()
            except Exception as e:  # a broken source must not break the case's outcome
                self._failed.setdefault(i, f"{type(source).__name__} failed to close "
                                           f"({type(e).__name__}: {e})")

    def _loop(self) -> None:
        next_t = time.monotonic() + self.interval_s
        # Event.wait sleeps, so the thread costs nothing between ticks.
        while not self._stop.wait(max(0.0, next_t - time.monotonic())):
            self._tick()
            next_t += self.interval_s

    def _tick(self) -> None:
        t = time.time()  # wall clock: comparable with the ranks' timed windows
        for i, source in enumerate(self.sources):
            if i in self._failed:
                continue
            try:
                rows = source.read()
            except Exception as e:
                self._failed[i] = (f"{type(source).__name__} read failed at "
                                   f"{time.strftime('%H:%M:%S', time.gmtime(t))} UTC and was "
                                   f"not read again ({type(e).__name__}: {e})")
                continue
            for row in rows:
                self.samples.append({"time_unix_s": t, **dict.fromkeys(SAMPLE_METRIC_NAMES), **row})
