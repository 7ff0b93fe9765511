"""The gate's two sides taking turns step by step (``bench_lib.turns``): the order A B B A, a
counterpart that ends early, never comes or dies, the end's wait, the steps' loop that asks for
each turn after a fixed warm-up, contention not judged on the other side's CPU, and the verdict
over each case's step pairs (``compare.paired.turns_change``: every round's pairs pooled unless the
rounds differ): on synthetic gates whose machine moves step by step, it covers what it claims
under common-mode noise, a case-only slowdown and drift, shows a planted slowdown at its full
size, and is narrower than the sides apart; the method line says how each was had."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bench_lib import turns
from bench_lib.compare import paired
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import Run
from bench_lib.measure.contention import MachineLoad, contention
from bench_lib.measure.timing import measure_steps, time_steps
from tests.test_speed_probe import CASES, ROW, SCENARIOS, STEPS
from tests.test_speed_probe import machine as probe_machine

REPO = Path(__file__).resolve().parents[1]


def test_the_order_is_abba_so_a_drift_within_a_launch_hits_both_sides_alike():
    order = [turns.owner(t) for t in range(8)]
    assert order == ["base", "head", "head", "base", "base", "head", "head", "base"]


def side_steps(folder: Path, side: str, steps: int, log: list[str], *,
               key: str = "case/0", delay_s: float = 0.0, **meet: float) -> turns.Turns:
    time.sleep(delay_s)
    t = turns.Turns.meet(folder, side, key, **meet)
    for _ in range(steps):
        t.before()
        log.append(side[0])
        time.sleep(0.005)
        t.after()
    t.close()
    return t


def together(folder: Path, base_steps: int, head_steps: int, head_delay_s: float = 0.0,
             **meet: float) -> tuple[str, dict[str, turns.Turns]]:
    log: list[str] = []
    done: dict[str, turns.Turns] = {}

    def run(side: str, steps: int, delay: float) -> None:
        done[side] = side_steps(folder, side, steps, log, delay_s=delay, **meet)

    threads = [threading.Thread(target=run, args=("base", base_steps, 0.0)),
               threading.Thread(target=run, args=("head", head_steps, head_delay_s))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads)
    return "".join(log), done


def test_two_sides_alternate_and_the_longer_goes_on_alone(tmp_path: Path):
    log, done = together(tmp_path, 5, 8, head_delay_s=0.2)  # the base waits for the head
    assert log == "bhhbbhhbb" + "hhhh"  # A B B A A B B A A, then the head alone
    assert done["base"].met and done["head"].met
    assert not list(tmp_path.iterdir())  # the meeting point is removed once met


def test_a_counterpart_that_never_comes_leaves_the_rank_alone_after_the_wait(tmp_path: Path):
    log: list[str] = []
    t0 = time.monotonic()
    t = side_steps(tmp_path, "head", 3, log, timeout_s=0.5)
    assert log == ["h", "h", "h"] and not t.met
    assert 0.4 < time.monotonic() - t0 < 5


DIES_AFTER_ONE_STEP = """
import os, sys
from pathlib import Path
from bench_lib.turns import Turns
t = Turns.meet(Path(sys.argv[1]), "base", "case/0", timeout_s=20)
t.before(); t.after()
os._exit(0)  # no close: as a rank killed mid-case
"""


def test_a_counterpart_that_dies_mid_case_leaves_the_other_to_go_on(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", DIES_AFTER_ONE_STEP, str(tmp_path)],
                            cwd=REPO)
    log: list[str] = []
    t = side_steps(tmp_path, "head", 4, log, timeout_s=20, turn_timeout_s=20)
    assert proc.wait(timeout=30) == 0
    assert log == ["h"] * 4 and t.met and t.peer_done


def test_a_rank_whose_steps_failed_ends_without_waiting_for_the_other_side(tmp_path: Path):
    """``close(wait=False)``: the failing rank says it is done and goes (its result is not
    held back); the other side, told so, steps on alone."""
    log: list[str] = []
    closing: list[float] = []

    def base() -> None:
        t = turns.Turns.meet(tmp_path, "base", "case/0", timeout_s=5)
        t.before()
        log.append("b")
        t.after()
        t0 = time.monotonic()
        t.close(wait=False)  # as after an exception in its second step
        closing.append(time.monotonic() - t0)
        log.append("closed")

    th = threading.Thread(target=base)
    th.start()
    head = turns.Turns.meet(tmp_path, "head", "case/0", timeout_s=5, turn_timeout_s=20)
    for _ in range(2):
        head.before()
        time.sleep(0.5)  # the head's steps are slow: the base's close must not wait for them
        log.append("h")
        head.after()
    th.join(timeout=30)
    head.close()
    assert log == ["b", "closed", "h", "h"]  # closed before the head's first step ended
    assert closing[0] < 0.4 and head.peer_done


def test_a_silent_counterpart_is_waited_for_the_turn_timeout_only(tmp_path: Path):
    def hang() -> None:  # meets, never steps, never ends
        t = turns.Turns.meet(tmp_path, "base", "case/0", timeout_s=5)
        time.sleep(5.0)
        assert t.conn is not None
        t.conn.close()

    th = threading.Thread(target=hang)
    th.start()
    log: list[str] = []
    t0 = time.monotonic()
    t = side_steps(tmp_path, "head", 2, log, timeout_s=5, turn_timeout_s=0.5)
    waited = time.monotonic() - t0
    th.join()
    assert log == ["h", "h"] and t.met and waited < 4.0  # not the 5 s the other kept silent


def test_each_key_meets_its_own_counterpart(tmp_path: Path):
    """The ranks of a two-rank case each take turns with their own counterpart."""
    logs: dict[str, list[str]] = {"0": [], "1": []}
    threads = [threading.Thread(target=side_steps,
                                args=(tmp_path, side, 4, logs[rank]), kwargs={"key": f"c/{rank}"})
               for side in ("head", "base") for rank in ("0", "1")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert "".join(logs["0"]) == "bhhbbhhb" == "".join(logs["1"])


def test_turns_are_asked_for_only_where_the_gate_set_both_variables(tmp_path: Path):
    assert turns.from_env("c/0", {}) is None and turns.requested_side({}) is None
    only_dir = {turns.TURNS_DIR_ENV: str(tmp_path)}
    assert turns.from_env("c/0", only_dir) is None and turns.requested_side(only_dir) is None
    only_side = {turns.TURNS_SIDE_ENV: "head"}
    assert turns.from_env("c/0", only_side) is None and turns.requested_side(only_side) is None
    both = {**only_dir, turns.TURNS_SIDE_ENV: "sideways"}
    assert turns.requested_side(both) == "sideways"
    with pytest.raises(ValueError, match="base or head"):
        turns.Turns("sideways", None)


class Recorder:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def before(self) -> None:
        self.log.append("wait")

    def after(self) -> None:
        self.log.append("pass")


def test_every_step_warm_up_included_waits_for_its_turn_outside_its_time():
    log: list[str] = []

    def step() -> None:
        log.append("step")

    def probe() -> float:
        log.append("probe")
        return 0.001

    times = time_steps(step, [], 2, 3, probe=probe, turns=Recorder(log))  # type: ignore[arg-type]
    assert len(times) == 3
    assert log == ["wait", "step", "pass"] * 2 + ["wait", "probe", "step", "pass"] * 3


def test_taking_turns_the_warm_up_is_the_fixed_count_so_the_sides_steps_pair_in_time():
    # Steps that still get faster: alone, the warm-up rule runs on past its minimum of 2;
    # taking turns, both sides run exactly 2, whatever their own steps did, so that each
    # side's k-th timed step follows the other's k-th at once.
    def falling() -> Callable[[], None]:
        sleeps = iter([0.2, 0.1, 0.05])
        return lambda: time.sleep(next(sleeps, 0.05))

    def warm_up(taking_turns: Recorder | None) -> int:
        return measure_steps(falling(), [], warmup_steps=2, timed_steps=2, max_time_s=60,
                             interval_target_pct=0,
                             turns=taking_turns).warmup_steps  # type: ignore[arg-type]

    assert warm_up(None) > 2
    log: list[str] = []
    assert warm_up(Recorder(log)) == 2
    assert log == ["wait", "pass"] * 4  # 2 warm-up and 2 timed steps, each in its turn


def test_the_other_sides_cpu_is_not_contention_when_taking_turns():
    load = MachineLoad(cpu_steal_pct=0.5, other_cpu_pct=45.0)
    assert "other processes" in contention(load)
    assert contention(load, turns=True) == ""
    stolen = MachineLoad(cpu_steal_pct=20.0, other_cpu_pct=45.0)
    assert contention(stolen, turns=True).startswith("steal")
    assert "waited for a core" in contention(load, ratio=0.5, turns=True)


# ---- the verdict over step pairs, on synthetic gates -------------------------------------

def machine(rng: np.random.Generator, rounds: int, drift: float = 0.0) -> np.ndarray:
    """The speed probe's synthetic machine (a level per launch, a random walk over its
    steps, a drift over the rounds), moving 5% within a launch: what both steps of a pair
    taken in turns meet."""
    return probe_machine(rng, rounds, within_sd=0.05, drift=drift)


def side(rng: np.random.Generator, speed: np.ndarray, slow: dict[str, float], name: str,
         own_sd: float = 0.03, hiccup: float = 0.15) -> Run:
    """One side's rounds in the speed ``speed``, each step with its own noise (``own_sd``)
    and, one step in ``1/hiccup``, a 25% slowdown of this side's process alone; the case
    slowed by ``slow[case]``."""
    launches = {}
    for c, (cid, level) in enumerate(CASES.items()):
        launches[cid] = {}
        for r in range(speed.shape[0]):
            hiccups = 1 + 0.25 * (rng.random(STEPS) < hiccup)
            launches[cid][r] = (level * (1 + slow.get(cid, 0.0)) * speed[r, c] * hiccups
                                * np.exp(rng.normal(0, own_sd, STEPS)))
    cases = {cid: dict(ROW, strategy=cid.split("_")[0], case_id=cid) for cid in CASES}
    return Run(Path(name), {"turns": name}, cases, launches)


@pytest.mark.parametrize("slow, drift, cid, metric", SCENARIOS)
def test_the_intervals_over_step_pairs_cover_the_true_change(slow, drift, cid, metric):
    rng = np.random.default_rng(23)
    true = 1 + slow.get(cid, 0.0)
    covered, pooled, points, widths, apart_widths = 0, 0, [], [], []
    trials = 400
    for _ in range(trials):
        speed = machine(rng, 5, drift=drift)  # both sides meet the same machine
        base, head = side(rng, speed, {}, "base"), side(rng, speed, slow, "head")
        ch = paired.paired_changes(base, head, cid)[metric]
        assert ch.method in ((paired.METHOD_TURNS, paired.METHOD_TURNS_ROUNDS)
                             if metric == "step_time" else (paired.METHOD_TURNS_ROUNDS,))
        pooled += ch.method == paired.METHOD_TURNS
        covered += ch.ci_low <= true - 1 <= ch.ci_high
        points.append(ch.value)
        widths.append((ch.ci_high - ch.ci_low) / 2)
        # The same sides one after the other: each meets the machine of its own moment.
        base = side(rng, machine(rng, 5, drift=drift), {}, "")
        head = side(rng, machine(rng, 5, drift=drift), slow, "")
        apart = paired.paired_changes(base, head, cid)[metric]
        assert apart.method == paired.METHOD_PAIRED
        apart_widths.append((apart.ci_high - apart.ci_low) / 2)
    assert 0.90 <= covered / trials <= 0.99
    assert np.median(points) == pytest.approx(true - 1, abs=0.006)  # not hidden, full size
    assert np.median(widths) < 0.5 * np.median(apart_widths)  # the lever pays
    if metric == "step_time":  # the rounds' pairs pooled, unless a round stood apart
        assert pooled >= 0.65 * trials


def test_pairs_are_the_kth_timed_steps_of_each_side_as_many_as_the_shorter_has():
    cases = {"single_a": dict(ROW, strategy="single", case_id="single_a")}
    base = Run(Path("b"), {"turns": "base"}, cases,
               {"single_a": {0: np.array([1.0, 2.0, 1.0]), 1: np.array([1.0, 1.0])}})
    head = Run(Path("h"), {"turns": "head"}, cases,
               {"single_a": {0: np.array([1.1, 2.2, 1.1, 9.0]), 1: np.array([2.0, 2.0])}})
    assert paired.pair_figures(base, head, "single_a") == pytest.approx({0: 1.1, 1: 2.0})
    logs = paired.pair_logs(base, head, "single_a")
    assert logs[0] == pytest.approx(np.log([1.1, 1.1, 1.1])) and logs[1] == pytest.approx(
        np.log([2.0, 2.0]))
    assert paired.took_turns(base, head) and not paired.took_turns(head, base)
    one_alone = Run(Path("b"), {}, cases, base.launches)
    assert paired.figures(one_alone, head, "single_a", 1.0)[2] == paired.METHOD_PAIRED


def test_the_method_line_says_which_cases_pooled_their_pairs_and_which_took_rounds():
    def result(cid: str, method: str, speedup: bool = False) -> cmp.CaseResult:
        changes = {"step_time": cmp.Change("step_time", 0.01, -0.01, 0.03, method, 5, 5)}
        if speedup:
            changes["speedup"] = cmp.Change("speedup", 0.0, -0.02, 0.02,
                                            paired.METHOD_TURNS_ROUNDS, 5, 5)
        return cmp.CaseResult(cid, cid.split("_")[0], 1.0, 1.0, changes, "unchanged",
                              "step_time")

    pooled = paired.method_line([result("single_a", paired.METHOD_TURNS)], 5)
    assert "Hodges-Lehmann estimate over every round's pairs" in pooled
    assert "differed" not in pooled and "speedups" not in pooled
    mixed = paired.method_line([result("single_a", paired.METHOD_TURNS),
                                result("ddp_a", paired.METHOD_TURNS_ROUNDS, speedup=True)], 5)
    assert "the step times of ddp_a, whose rounds differed (Kruskal-Wallis p < 0.25)" in mixed
    assert "or whose pairs were under 6" in mixed
    assert "speedups, the t over 5 rounds of each round's median pair" in mixed
