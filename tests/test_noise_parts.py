"""The noise decomposition recovers the parts planted in synthetic runs: the machine's speed
per run and per round (common to every case), each case's own launch noise, and its steps'."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench_lib.analysis import noise_parts

CASES = ("single", "ddp", "mp", "pipeline")


def planted(rng: np.random.Generator, runs: int, rounds: int, run_sd: float, slot_sd: float,
            own_sd: dict[str, float], step_sd: float = 0.0, steps: int = 8
            ) -> list[dict[str, dict[int, np.ndarray]]]:
    """Runs of step times: log t = level + run + slot + launch + step, each normal."""
    out = []
    for _ in range(runs):
        run = rng.normal(0, run_sd)
        launches: dict[str, dict[int, np.ndarray]] = {c: {} for c in CASES}
        for k in range(rounds):
            slot = rng.normal(0, slot_sd)
            for i, c in enumerate(CASES):
                level = math.log(0.1 * (i + 1)) + run + slot + rng.normal(0, own_sd[c])
                launches[c][k] = np.exp(level + rng.normal(0, step_sd, steps))
        out.append(launches)
    return out


def test_the_parts_planted_are_recovered_on_average():
    rng = np.random.default_rng(7)
    own = {"single": 0.01, "ddp": 0.03, "mp": 0.015, "pipeline": 0.02}
    found = [noise_parts.from_launches(planted(rng, 6, 3, 0.04, 0.02, own), CASES)
             for _ in range(300)]
    assert np.mean([p.run for p in found]) == pytest.approx(0.04**2, rel=0.2)
    assert np.mean([p.slot for p in found]) == pytest.approx(0.02**2, rel=0.15)
    for c, sd in own.items():
        assert np.mean([p.own[c] for p in found]) == pytest.approx(sd**2, rel=0.15)
        assert np.mean([p.step[c] for p in found]) == 0.0  # no step noise planted: 1 step


def test_a_machine_without_common_noise_reads_no_common_share():
    rng = np.random.default_rng(3)
    own = dict.fromkeys(CASES, 0.02)
    found = [noise_parts.from_launches(planted(rng, 6, 3, 0.0, 0.0, own), CASES)
             for _ in range(200)]
    shares = [p.common_share("ddp") for p in found]
    # Estimates are clipped at 0, so their sampling error reads as a small positive share.
    assert np.nanmedian(shares) < 0.1 and np.nanmean(shares) < 0.12


def test_a_machine_whose_speed_is_all_the_noise_reads_nearly_all_common():
    rng = np.random.default_rng(5)
    found = noise_parts.from_launches(
        planted(rng, 8, 3, 0.05, 0.03, dict.fromkeys(CASES, 0.005)), CASES)
    assert all(found.common_share(c) > 0.85 for c in CASES)


def test_the_step_part_is_the_medians_sampling_variance():
    rng = np.random.default_rng(11)
    step_sd, steps = 0.04, 8
    runs = planted(rng, 6, 3, 0.0, 0.0, dict.fromkeys(CASES, 0.0), step_sd=step_sd,
                   steps=steps)
    found = noise_parts.from_launches(runs, CASES)
    # The launch medians' spread is their steps' alone: own and step agree, launch is ~0.
    medians = np.log([np.median(r["ddp"][k]) for r in runs for k in range(3)])
    assert found.step["ddp"] == pytest.approx(math.pi / 2 * step_sd**2 / steps, rel=0.35)
    assert found.own["ddp"] == pytest.approx(medians.var(ddof=1), rel=0.6)
    assert found.launch("ddp") < 0.5 * found.own["ddp"] or found.launch("ddp") < 1e-4


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="runs x rounds x cases"):
        noise_parts.decompose([[1.0, 2.0]], CASES[:2])
    with pytest.raises(ValueError, match="at least 2 cases"):
        noise_parts.decompose(np.ones((1, 1, 2)), CASES[:2])
    with pytest.raises(ValueError, match="no round"):
        noise_parts.from_launches([{"single": {0: [1.0]}, "ddp": {1: [1.0]}}], CASES[:2])
