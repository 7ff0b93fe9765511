"""Throttling: whether a case's GPU clocks were held back while it was timed.

NVML says why a GPU's clocks are where they are (``nvmlDeviceGetCurrentClocksEventReasons``,
"throttle reasons" before NVML 12.535): a bit mask the sampler records with every GPU sample
as names (``samples.csv`` ``clock_event_reasons``: ``sw_power_cap+sync_boost``, or
``none``). Two reasons are no throttling: ``gpu_idle`` (nothing to run: between steps, in a
pipeline's bubble) and ``applications_clocks_setting`` (clocks someone set on purpose). Any
other one (the software power cap, a thermal or hardware slowdown, the power brake, sync
boost holding a GPU to the slowest of its group, the display clock, a board limit) means the
case ran slower than its GPU can, as a co-runner makes a case slower on a CPU
(``measure.contention``). A case is marked when, on some GPU, such reasons held in more
than ``THROTTLED_SHARE`` of its samples inside the timed windows: the sampler ticks evenly,
so a share of the samples is a share of the window.

``throttling`` turns the samples into a row's reason (empty: none seen). Never imports torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

THROTTLED_SHARE = 0.10
"""Clocks held back in over this share of a GPU's samples in the timed windows mark the
case: the regression gate's default threshold is 10% too, and a clock held 10% lower for
the whole window would move a compute-bound step by about as much."""
NOT_THROTTLING = frozenset({"gpu_idle", "applications_clocks_setting", "none"})
"""Clock event reasons that hold no clock back from what the case asked for."""
MIN_SAMPLES = 3
"""Fewest samples of a GPU inside the windows for it to be judged (as for its utilisation:
``measure.energy.MIN_SAMPLES``)."""


def throttling(samples: Iterable[Mapping[str, Any]],
               windows: Sequence[tuple[float, float]]) -> str:
    """Why a case was measured with its GPU clocks held back, or ``""``: over its timed
    ``windows`` [t0, t1] (unix seconds, one per launch), each GPU's share of samples with a
    throttling reason, and each reason's share, where the first is over ``THROTTLED_SHARE``.

    Samples without reasons (cpu rigs, an NVML that cannot say) are not judged.
    """
    seen: Counter[str] = Counter()
    held: Counter[str] = Counter()
    reasons: dict[str, Counter[str]] = {}
    for s in samples:
        names = s.get("clock_event_reasons")
        if not names or not any(t0 <= s["time_unix_s"] <= t1 for t0, t1 in windows):
            continue
        device = str(s["device"])
        seen[device] += 1
        throttled = set(str(names).split("+")) - NOT_THROTTLING
        if throttled:
            held[device] += 1
            reasons.setdefault(device, Counter()).update(throttled)
    parts = []
    for device in sorted(seen):
        n = seen[device]
        if n < MIN_SAMPLES or held[device] / n <= THROTTLED_SHARE:
            continue
        each = ", ".join(f"{name} {count / n:.0%}" for name, count in
                         sorted(reasons[device].items(), key=lambda kv: (-kv[1], kv[0])))
        parts.append(f"GPU {device} {held[device] / n:.0%} ({each})")
    if not parts:
        return ""
    return (f"clocks held back in over {THROTTLED_SHARE:.0%} of the timed window's samples "
            "(NVML clock event reasons): " + "; ".join(parts))
