"""The machine's speed control (``measure.speed_probe``): timed before every timed step,
written beside it in steps.csv, read back per launch, and the gate's intervals over steps
divided by it: on synthetic runs they cover what they claim under common-mode noise, a
case-only slowdown and drift, are narrower than without it, and a planted slowdown of the step
itself shows at its full size."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from bench_lib.compare import paired
from bench_lib.compare.runs import Run, probe_samples, step_samples
from bench_lib.measure import speed_probe
from bench_lib.measure.timing import time_steps
from bench_lib.results.schema import STEP_COLUMNS

PROBE_ENV = {"speed_probe": speed_probe.PROBE}
ROW = {"model": "resnet50", "image_size": 64, "batch_size": 16, "precision": "fp32",
       "loss": "ce", "status": "ok"}
CASES = {"single_a": 0.6, "ddp_a": 0.55}
STEPS = 8


def side(rng: np.random.Generator, speed: np.ndarray, slow: dict[str, float],
         own_sd: float = 0.03, step_sd: float = 0.01, probe_sd: float = 0.01,
         env: dict | None = None, follows: float = 1.0) -> Run:
    """One side's rounds: ``speed[r, c, i]`` the machine's speed factor during step i of
    case c's launch in round r (shared by the step and the probe just before it; the step
    follows it to the power ``follows``, the probe wholly), each case launch with its own
    offset (``own_sd``, which no probe sees) and its steps' noise; the case slowed by
    ``slow[case]`` (its step only)."""
    launches, probes = {}, {}
    for c, (cid, level) in enumerate(CASES.items()):
        launches[cid], probes[cid] = {}, {}
        for r in range(speed.shape[0]):
            own = rng.normal(0, own_sd)
            m = speed[r, c]
            launches[cid][r] = level * (1 + slow.get(cid, 0.0)) * m ** follows * np.exp(
                own + rng.normal(0, step_sd, STEPS))
            probes[cid][r] = 0.006 * m * np.exp(rng.normal(0, probe_sd, STEPS))
    cases = {cid: dict(ROW, strategy=cid.split("_")[0], case_id=cid) for cid in CASES}
    return Run(Path("x"), PROBE_ENV if env is None else env, cases, launches, probes)


def machine(rng: np.random.Generator, rounds: int, slot_sd: float = 0.06,
            within_sd: float = 0.03, drift: float = 0.0) -> np.ndarray:
    """The machine's speed for each (round, case, step): a level per launch (``slot_sd``)
    that moves within it (``within_sd``, a random walk over its steps), plus a linear drift
    over the rounds."""
    shape = (rounds, len(CASES))
    level = rng.normal(0, slot_sd, shape)[..., None] + drift * np.arange(rounds)[:, None, None]
    walk = np.cumsum(rng.normal(0, within_sd / math.sqrt(STEPS), (*shape, STEPS)), axis=2)
    return np.exp(level + walk)


SCENARIOS = [
    ({}, 0.0, "single_a", "step_time"),  # A/A: common-mode noise alone
    ({"single_a": 0.03}, 0.0, "single_a", "step_time"),  # a slowdown of the step itself
    ({"ddp_a": 0.03}, 0.0, "ddp_a", "speedup"),  # one case only, judged over single
    ({"single_a": 0.03}, 0.02, "single_a", "step_time"),  # and a machine drifting 2% a round
]
"""What a synthetic gate's interval must cover: (slowdown per case, drift a round, the case
judged, its metric); ``test_turns`` judges the same."""


def changes(base: Run, head: Run, cid: str, metric: str):
    return paired.paired_changes(base, head, cid)[metric]


@pytest.mark.parametrize("slow, drift, cid, metric", SCENARIOS)
def test_the_intervals_over_the_probe_cover_the_true_change(slow, drift, cid, metric):
    rng = np.random.default_rng(17)
    true = 1 + slow.get(cid, 0.0)
    covered, points, widths, raw_widths = 0, [], [], []
    trials = 400
    for _ in range(trials):
        base = side(rng, machine(rng, 5, drift=drift), {})
        head = side(rng, machine(rng, 5, drift=drift), slow)
        ch = changes(base, head, cid, metric)
        assert ch.method == paired.METHOD_CONTROLLED
        covered += ch.ci_low <= true - 1 <= ch.ci_high
        points.append(ch.value)
        widths.append((ch.ci_high - ch.ci_low) / 2)
        raw = paired.paired_change(metric, *_seconds(base, head, cid, metric))
        raw_widths.append((raw.ci_high - raw.ci_low) / 2)
    assert 0.90 <= covered / trials <= 0.99
    assert np.median(points) == pytest.approx(true - 1, abs=0.006)  # not hidden, full size
    assert np.median(widths) < 0.7 * np.median(raw_widths)  # the lever pays


@pytest.mark.parametrize("follows", [0.3, 0.6])
@pytest.mark.parametrize("slow", [{}, {"single_a": 0.03, "ddp_a": 0.03}])
def test_where_steps_follow_the_machine_less_than_the_probe_the_interval_still_covers(
        follows, slow):
    """A step that follows the machine's speed only partly (on 2 Intel Xeon cores, 0.3-0.7
    of what the probe does): the probe to the power the gate measures
    (``probe_coefficient``) keeps the interval's coverage, shows a planted slowdown at its
    full size, and is narrower than dividing by the probe whole and than seconds."""
    rng = np.random.default_rng(29)
    trials, covered, points, coefficients = 400, 0, [], []
    widths: dict[str, list[float]] = {"fitted": [], "whole": [], "seconds": []}
    for _ in range(trials):
        base = side(rng, machine(rng, 5, slot_sd=0.10), {}, follows=follows)
        head = side(rng, machine(rng, 5, slot_sd=0.10), slow, follows=follows)
        coefficients.append(paired.probe_coefficient(base, head))
        for name, power in (("fitted", None), ("whole", 1.0), ("seconds", 0.0)):
            ch = paired.paired_changes(base, head, "single_a", power)["step_time"]
            widths[name].append((ch.ci_high - ch.ci_low) / 2)
            if name == "fitted":
                covered += ch.ci_low <= slow.get("single_a", 0.0) <= ch.ci_high
                points.append(ch.value)
    assert 0.90 <= covered / trials <= 0.99
    assert np.median(points) == pytest.approx(slow.get("single_a", 0.0), abs=0.008)
    assert np.median(coefficients) == pytest.approx(follows, abs=0.1)
    assert np.median(widths["fitted"]) < 0.8 * np.median(widths["whole"])
    assert np.median(widths["fitted"]) < 0.8 * np.median(widths["seconds"])


def test_the_coefficient_is_pooled_over_the_probed_cases_and_clipped_to_0_1():
    """Only cases both sides probed enter it, each side's level taken out (a head 20%
    slower changes nothing), and a slope outside [0, 1] is held at the nearer end."""
    rng = np.random.default_rng(3)
    speed = machine(rng, 5, slot_sd=0.10)
    base = side(rng, speed, {}, follows=0.5, own_sd=0.0, step_sd=0.0, probe_sd=0.0)
    head = side(rng, speed, {"single_a": 0.2}, follows=0.5, own_sd=0.0, step_sd=0.0,
                probe_sd=0.0)
    base.probes.pop("ddp_a")  # probed on one side only: left out
    # within each launch the step is exactly m^0.5 and the probe m, so the launch medians'
    # slope is about 0.5, not exactly (a median of products is not a product of medians)
    assert paired.probe_coefficient(base, head) == pytest.approx(0.5, abs=0.05)
    steep = side(rng, speed, {}, follows=2.0, own_sd=0.0, step_sd=0.0, probe_sd=0.0)
    assert paired.probe_coefficient(steep, steep) == 1.0
    against = side(rng, speed, {}, follows=-1.0, own_sd=0.0, step_sd=0.0, probe_sd=0.0)
    assert paired.probe_coefficient(against, against) == 0.0
    one_round = side(rng, machine(rng, 1), {})
    assert paired.probe_coefficient(one_round, one_round) == 1.0


def _seconds(base: Run, head: Run, cid: str, metric: str) -> tuple[list[float], list[float]]:
    hb, bb = head.launch_medians(cid), base.launch_medians(cid)
    if metric == "step_time":
        return list(hb.values()), list(bb.values())
    hs, bs = head.launch_medians("single_a"), base.launch_medians("single_a")
    return [hb[r] / hs[r] for r in hb], [bb[r] / bs[r] for r in bb]


def test_the_probe_is_used_only_where_both_sides_timed_the_same_one():
    rng = np.random.default_rng(1)
    base = side(rng, machine(rng, 3), {})
    for env in ({"speed_probe": "gemm fp32 512x512 x4"}, {}):
        head = side(rng, machine(rng, 3), {}, env=env)
        ch = changes(base, head, "single_a", "step_time")
        assert ch.method == paired.METHOD_PAIRED  # seconds, as before the probe
    head = side(rng, machine(rng, 3), {})
    head.probes.pop("single_a")
    assert changes(base, head, "single_a", "step_time").method == paired.METHOD_PAIRED
    # ddp keeps its probes, but its speedup over an unprobed single falls back as a whole
    speedup = changes(base, head, "ddp_a", "speedup")
    assert speedup.method == paired.METHOD_PAIRED
    assert changes(base, head, "ddp_a", "step_time").method == paired.METHOD_CONTROLLED


def test_time_steps_times_the_probe_before_each_timed_step_only():
    order: list[str] = []

    def probe() -> float:
        order.append("probe")
        return 0.001 * len(order)

    seen: list[float] = []
    times = time_steps(lambda: order.append("step"), [], warmup_steps=2, timed_steps=3,
                       probe=probe, probe_times=seen)
    assert len(times) == 3
    assert order == ["step", "step"] + ["probe", "step"] * 3  # none in the warm-up
    assert seen == pytest.approx([0.003, 0.005, 0.007])


def test_the_probe_runs_on_this_cpu_and_times_itself():
    probe = speed_probe.make_probe()
    seconds = [probe() for _ in range(3)]
    assert all(0 < s < 5 for s in seconds)


def write_steps(path: Path, rows: list[dict]) -> None:
    columns = [c for c in STEP_COLUMNS if any(c in r for r in rows)]
    with (path / "steps.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(rows)


def test_steps_csv_probes_are_read_per_step_for_one_process_cases(tmp_path):
    rows = [{"run_id": "r", "case_id": "mp_a", "launch": launch, "rank": 0, "step": i,
             "step_time_s": 0.5 + 0.1 * i, "cpu_time_s": 0.5, "probe_s": 0.004 * (1 + i)}
            for launch in (0, 1) for i in range(3)]
    rows += [{"run_id": "r", "case_id": "single_a", "launch": 0, "rank": 0, "step": i,
              "step_time_s": 0.6, "cpu_time_s": 0.6, "probe_s": ""} for i in range(3)]
    rows += [{"run_id": "r", "case_id": "ddp_a", "launch": 0, "rank": rank, "step": i,
              "step_time_s": 0.5, "cpu_time_s": 0.5, "probe_s": 0.004}
             for rank in (0, 1) for i in range(3)]
    write_steps(tmp_path, rows)
    probes = probe_samples(tmp_path)
    # single's steps have none; ddp's two ranks probe out of phase with each other's work
    assert set(probes) == {"mp_a"}
    assert probes["mp_a"][1] == pytest.approx([0.004, 0.008, 0.012])
    assert step_samples(tmp_path)["mp_a"][1] == pytest.approx([0.5, 0.6, 0.7])  # aligned


def test_a_folder_written_before_the_probe_reads_without_it(tmp_path):
    write_steps(tmp_path, [{"run_id": "r", "case_id": "single_a", "launch": 0, "rank": 0,
                            "step": i, "step_time_s": 0.6, "cpu_time_s": 0.6}
                           for i in range(3)])
    assert probe_samples(tmp_path) == {}
    assert step_samples(tmp_path)["single_a"][0] == pytest.approx([0.6] * 3)


def test_steps_rows_carry_each_ranks_probe():
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rows.rows import step_rows

    out = CaseOutcome("ok", step_times_s=[0.1, 0.2], rank_step_times_s={0: [0.1, 0.2]},
                      rank_probe_times_s={0: [0.006, 0.007]})
    assert [r["probe_s"] for r in step_rows(out)] == [0.006, 0.007]
