"""A case's achieved TFLOP/s and its percentage of the attainable peak (MFU,
``efficiency``), and why MFU is empty or suspect (``mfu_note``)."""

from __future__ import annotations

from bench_lib.measure.flop_peak import AttainablePeak


def efficiency(flops_per_img: float, throughput_img_s: float,
               peak_tflop_s: float | None) -> tuple[float, float | None]:
    """Achieved TFLOP/s and its percentage of ``peak_tflop_s`` (None without a peak)."""
    achieved = flops_per_img * throughput_img_s / 1e12
    if not peak_tflop_s:
        return achieved, None
    return achieved, 100 * achieved / peak_tflop_s


def mfu_note(mfu: float | None, peak: AttainablePeak | None, precision: str,
             devices: int) -> str:
    """Why ``mfu_pct`` is empty, or a flag where it is over 100% (the case beat the peak
    probe, so the probe is not the attainable peak here: read the figure as suspect). The
    flag names the math mode the peak was measured in (``AttainablePeak.math_of``), the
    one the workers train in: a TF32 case against an IEEE peak is not the reason."""
    if mfu is None:
        why = peak.unsupported if peak is not None else ""
        return f"no attainable peak: {why or f'none measured for {precision} on these devices'}"
    if mfu > 100:
        probes = "/".join(peak.probes_of(precision, devices) if peak else []) or "peak"
        mode = (f"; peak measured in {peak.math_of(precision)}, the workers' math mode"
                if peak is not None and peak.math_mode else
                "; the math mode of the peak is not recorded")
        return (f"over 100%: the case beat the measured peak ({probes} probe), so that "
                f"probe is not the attainable peak here{mode}")
    return ""
