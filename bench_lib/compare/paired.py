"""The same-job gate's verdicts, read from the run folders its rounds wrote: each side's
rounds as one ``compare`` run (``side_run``), per case and round the ratio head over base,
its interval the t interval over rounds (``paired_change``), the verdict by ``compare``'s
rule (``judge_cases``), and what the gate says and writes of them (notes, Markdown,
gate.json's cases).

What a round shares, the machine's state, cancels in each ratio; what remains is
launch-to-launch noise. Where the sides took turns step by step (``bench_lib.turns``), each
pair of steps shares its second: a case's step-time change pools every round's pairs
(``turns_change``), and the rounds are the units only where they differ.
``bench_lib.gate`` measures the rounds (git, worktrees, each side's ``run`` in its own
process); this module only reads what they wrote. Never imports torch.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench_lib.analysis.stats import (
    POOLING_TEST_LEVEL,
    SIGNED_RANK_METHOD,
    pair_rounds_interval,
    paired_ratio_interval,
)
from bench_lib.compare import output
from bench_lib.compare import verdicts as cmp
from bench_lib.compare.runs import Launches, Run, load_run
from bench_lib.results.read import number

METHOD_PAIRED = "paired t over rounds (base and head in the same job)"
METHOD_TURNS = ("signed rank over the step pairs of every round (base and head at once, "
                "taking turns step by step on the same devices)")
METHOD_TURNS_ROUNDS = ("paired t over rounds of each round's median log ratio of its step pairs "
                       "(base and head taking turns; the rounds differed, or too few pairs)")
METHOD_CONTROLLED = ("paired t over rounds of steps over the speed probe timed before each, "
                     "to the power the gate's steps follow the probe (base and head in the "
                     "same job)")


def order_text(order: Sequence[Sequence[str]]) -> str:
    """``B H | H B``: the sides' order, round by round."""
    return " | ".join(" ".join(side[0].upper() for side in sides) for sides in order)


SAID_PER_ROUND = ("contention", "throttled")
"""cases.csv columns that say why a case's times may be slow (other work on its CPU, GPU
clocks held back): a side's run says each with the rounds it happened in."""


def side_run(path: Path, rounds: Sequence[Run]) -> Run:
    """A side's rounds as one ``compare`` run: launch r is round r's launch. A case's row
    is its first round's, with the status of the first round it did not end ``ok`` in,
    every round's contention and throttling (``SAID_PER_ROUND``) said with the round, and
    the median over rounds of its step-time prediction error (where the side predicts); its
    launches are the rounds it ran ok."""
    cases: dict[str, dict[str, Any]] = {}
    launches: dict[str, Launches] = {}
    probes: dict[str, Launches] = {}
    unprobed: set[str] = set()  # a case some round ran without probes
    said: dict[tuple[str, str], list[str]] = {}  # (case, column) -> "round r: reason"
    errors: dict[str, list[float]] = {}
    for r, run in enumerate(rounds):
        for cid, row in run.cases.items():
            kept = cases.setdefault(cid, dict(row))
            if kept["status"] == "ok" and row["status"] != "ok":
                kept["status"] = row["status"]
            for column in SAID_PER_ROUND:
                reason = row.get(column)
                if isinstance(reason, str) and reason.strip():
                    said.setdefault((cid, column), []).append(f"round {r + 1}: {reason.strip()}")
            if (error := number(row.get("prediction_error_pct"))) is not None:
                errors.setdefault(cid, []).append(error)
        for cid, parts in run.launches.items():
            for samples in parts.values():
                launches.setdefault(cid, {})[r] = samples
            if cid not in run.probes:
                unprobed.add(cid)
            for probe in run.probes.get(cid, {}).values():
                probes.setdefault(cid, {})[r] = probe
    for (cid, column), reasons in said.items():
        cases[cid][column] = "; ".join(reasons)
    for cid, values in errors.items():
        cases[cid]["prediction_error_pct"] = statistics.median(values)
    kept = {cid: parts for cid, parts in probes.items() if cid not in unprobed}
    return Run(path, rounds[0].env if rounds else {}, cases, launches, kept)


def gate_sides(gate_dir: Path) -> tuple[Run, Run]:
    """A kept gate folder's base and head, each its rounds (gate.json's ``runs``, in round
    order) as one run (``side_run``): what a script re-judges a finished gate from."""
    record = json.loads((gate_dir / "gate.json").read_text())
    found = []
    for name in ("base", "head"):
        rounds = sorted((r for r in record["runs"] if r["side"] == name),
                        key=lambda r: r["round"])
        found.append(side_run(gate_dir / name, [load_run(gate_dir / r["run"]) for r in rounds]))
    return found[0], found[1]


def paired_change(metric: str, head: Sequence[float], base: Sequence[float],
                  method: str = METHOD_PAIRED) -> cmp.Change:
    """The change head over base of figures paired by round, with the t interval over the
    rounds of their log ratios."""
    ratio = paired_ratio_interval(head, base)
    return cmp.Change(metric, ratio.point - 1, ratio.low - 1, ratio.high - 1, method,
                      ratio.n, ratio.n)


def same_probe(base: Run, head: Run) -> bool:
    """Whether both sides timed the same speed probe (env.json ``speed_probe``): only then
    are their steps over it comparable."""
    probe = base.env.get("speed_probe")
    return bool(probe) and probe == head.env.get("speed_probe")


def took_turns(base: Run, head: Run) -> bool:
    """Whether the two sides' runs stepped in turns with each other (env.json ``turns``:
    the base's ranks as ``base``, the head's as ``head``; ``bench_lib.turns``)."""
    return base.env.get("turns") == "base" and head.env.get("turns") == "head"


def pair_logs(base: Run, head: Run, case_id: str) -> dict[int, np.ndarray]:
    """Per round, the log ratio of each pair of steps: the k-th timed step of the head's
    launch over the k-th of the base's (as many pairs as the shorter launch has steps).
    Taken in turns after the same warm-up, the two steps of a pair ran one right after the
    other on the same devices (``bench_lib.turns``): the machine's speed of that second
    cancels in each ratio."""
    hb, bb = head.launches[case_id], base.launches[case_id]
    out = {}
    for r in hb:
        if r in bb:
            n = min(hb[r].size, bb[r].size)
            out[r] = np.log(hb[r][:n]) - np.log(bb[r][:n])
    return out


def pair_figures(base: Run, head: Run, case_id: str) -> dict[int, float]:
    """Per round, head over base as the exponential of the median of its pairs' log ratios
    (``pair_logs``): the median keeps a step that a neighbour hit on one side only from
    moving the round. What a speedup's rounds are paired by where the sides took turns."""
    return {r: float(np.exp(np.median(logs)))
            for r, logs in pair_logs(base, head, case_id).items()}


def turns_change(base: Run, head: Run, case_id: str) -> cmp.Change:
    """The step-time change head over base of a case whose sides took turns: every round's
    step pairs pooled, the Hodges-Lehmann estimate and its signed-rank interval; the t over
    rounds of their medians where the rounds differ, or the pairs are too few
    (``pair_rounds_interval``). ``n_base``: the rounds."""
    logs = pair_logs(base, head, case_id)
    ratio = pair_rounds_interval(list(logs.values()))
    method = (METHOD_TURNS if ratio.method.startswith(SIGNED_RANK_METHOD)
              else METHOD_TURNS_ROUNDS)
    return cmp.Change("step_time", ratio.point - 1, ratio.low - 1, ratio.high - 1, method,
                      len(logs), len(logs))


def probe_coefficient(base: Run, head: Run) -> float:
    """How much a launch's median step follows its median speed probe in this gate: the
    least-squares slope of log median step on log median probe, pooled over every case
    both sides probed and over both sides, each (case, side)'s launches taken from their
    own means over the rounds (so that what the head changed, a shift of its level, does
    not enter it), clipped to [0, 1] (0: seconds; 1: the probe taken out whole). 1 where
    no case has two probed rounds.

    Why pooled and per gate: a step follows the machine's speed less than the probe does,
    and by how much moves with the machine's state (0.32-0.74 over seven gates on 2 Intel
    Xeon cores, methodology.md "What the noise is made of"). Dividing by the probe whole then
    adds the probe's own moves; a slope fitted per case from 5 rounds' paired ratios costs
    more than it gains ("Tried and not adopted", ci-gate.md); pooled, the slope has
    (cases x sides x (rounds - 1)) degrees of freedom, 24 in a ``ci`` gate."""
    xy = xx = 0.0
    for run in (base, head):
        for cid in sorted(set(base.probes) & set(head.probes)):
            steps, probes = run.launches.get(cid, {}), run.probes[cid]
            rounds = [r for r in steps if r in probes]
            if len(rounds) < 2:
                continue
            x = np.log([float(np.median(probes[r])) for r in rounds])
            y = np.log([float(np.median(steps[r])) for r in rounds])
            x, y = x - x.mean(), y - y.mean()
            xy, xx = xy + float(x @ y), xx + float(x @ x)
    return 1.0 if xx <= 0 else min(max(xy / xx, 0.0), 1.0)


def figures(base: Run, head: Run, case_id: str, coefficient: float
            ) -> tuple[dict[int, float], dict[int, float], str]:
    """The case's per-round figures on each side (head's, base's) and how they were had:
    where the sides took turns, the round's paired steps (``pair_figures``, over a base of
    1); else the median of each launch's steps over their probes to the power
    ``coefficient`` where both sides timed the same probe in every round
    (``Run.controlled_medians``), else launch medians in seconds."""
    if took_turns(base, head):
        pairs = pair_figures(base, head, case_id)
        return pairs, dict.fromkeys(pairs, 1.0), METHOD_TURNS
    if same_probe(base, head):
        hc = head.controlled_medians(case_id, coefficient)
        bc = base.controlled_medians(case_id, coefficient)
        if hc is not None and bc is not None:
            return hc, bc, METHOD_CONTROLLED
    return head.launch_medians(case_id), base.launch_medians(case_id), METHOD_PAIRED


def paired_changes(base: Run, head: Run, case_id: str,
                   coefficient: float | None = None) -> dict[str, cmp.Change]:
    """The case's paired step-time change and, where both sides ran its ``single`` in the
    same rounds, its paired change of time over single's (None-free: left out otherwise);
    each over the speed probe where both sides timed it (``figures``), to the power
    ``coefficient`` (default: ``probe_coefficient`` of the two sides)."""
    if coefficient is None:
        coefficient = probe_coefficient(base, head)
    hb, bb, method = figures(base, head, case_id, coefficient)
    rounds = [r for r in hb if r in bb]
    out = {"step_time": turns_change(base, head, case_id) if method == METHOD_TURNS else
           paired_change("step_time", [hb[r] for r in rounds], [bb[r] for r in rounds],
                         method)}
    single = head.single_of(case_id)
    if single and single != case_id and single == base.single_of(case_id):
        hs, bs, single_method = figures(base, head, single, coefficient)
        if single_method != method:  # one of the two without probes: both in seconds
            hb, bb = head.launch_medians(case_id), base.launch_medians(case_id)
            hs, bs, method = head.launch_medians(single), base.launch_medians(single), \
                METHOD_PAIRED
        both = [r for r in rounds if r in hs and r in bs]
        if both:  # taking turns: the t over rounds of the rounds' median pairs
            out["speedup"] = paired_change("speedup", [hb[r] / hs[r] for r in both],
                                           [bb[r] / bs[r] for r in both],
                                           METHOD_TURNS_ROUNDS if method == METHOD_TURNS
                                           else method)
    return out


def judge_cases(base: Run, head: Run, threshold_pct: float, metric: str,
                coefficient: float | None = None) -> list[cmp.CaseResult]:
    """Per case of either side, in the head's order: the verdict by the paired rounds;
    ``broken`` where the base ran it ok and the head did not; ``n/a`` (with why) where the
    base did not, or the head's sweep lacks it. ``coefficient``: the probe's power
    (default: ``probe_coefficient`` of the two sides)."""
    results = []
    if coefficient is None:
        coefficient = probe_coefficient(base, head)
    for cid in [*head.cases, *(c for c in base.cases if c not in head.cases)]:
        row = head.cases.get(cid) or base.cases[cid]
        strategy = str(row["strategy"])
        b_ok = cid in base.launches and base.cases[cid]["status"] == "ok"
        h_ok = cid in head.launches and head.cases[cid]["status"] == "ok"
        b_med = base.median_s(cid) if cid in base.launches else None
        h_med = head.median_s(cid) if cid in head.launches else None
        if b_ok and h_ok:
            ch = paired_changes(base, head, cid, coefficient)
            verdict, by = cmp.judge(ch, metric, threshold_pct / 100)
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, ch, verdict, by))
        elif b_ok and cid in head.cases:
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, verdict="broken",
                                          by=f"head status {head.cases[cid]['status']}"))
        elif b_ok:
            results.append(cmp.CaseResult(cid, strategy, b_med, None, verdict="n/a",
                                          by="not in the head's sweep"))
        else:
            status = base.cases[cid]["status"] if cid in base.cases else "absent"
            results.append(cmp.CaseResult(cid, strategy, b_med, h_med, verdict="n/a",
                                          by=f"base status {status}"))
    return results


def gate_notes(results: list[cmp.CaseResult], base: Run, head: Run) -> list[str]:
    """What a reader needs beside the verdicts: busy, contended or throttled rounds, and a
    slowdown that hit every strategy alike."""
    out = []
    for name, run in (("base", base), ("head", head)):
        if busy := output.busy_cases(run):
            out.append(f"the {name}'s steps spread widely within a launch (IQR/median: "
                       f"{', '.join(busy)}): the machine was busy")
        if contended := output.contended_cases(run):
            out.append(f"the {name} was measured under contention: {'; '.join(contended)}")
        if throttled := output.throttled_cases(run):
            out.append(f"the {name} was measured with GPU clocks held back: "
                       f"{'; '.join(throttled)}")
    judged = [r for r in results if r.by in r.changes]
    if len(judged) > 1 and all(r.verdict == "regression" for r in judged):
        out.append("every case regressed: the head slows what all strategies share (the "
                   "model, the step, a setting), not one strategy alone")
    if grown := output.prediction_note(results, base, head):
        out.append(grown)
    return out


def method_line(results: list[cmp.CaseResult], rounds: int,
                coefficient: float | None = None) -> str:
    """How the intervals were had, once; ``coefficient``: the gate's
    ``probe_coefficient``, said where a case was judged over the probe."""
    ns = sorted({ch.n_base for r in results for ch in r.changes.values()})
    if not ns:
        return "no intervals: no case ran ok on both sides"
    methods = {ch.method for r in results for ch in r.changes.values()}
    power = "" if coefficient is None else f"^{coefficient:.2f}"
    if methods & {METHOD_TURNS, METHOD_TURNS_ROUNDS}:
        step = {r.case_id: ch.method for r in results if (ch := r.changes.get("step_time"))}
        apart = [cid for cid, method in step.items() if method == METHOD_TURNS_ROUNDS]
        parts = []
        if METHOD_TURNS in step.values():
            parts.append("step times, the Hodges-Lehmann estimate over every round's pairs "
                         "and its signed-rank interval")
        if apart:
            parts.append(f"the step times of {', '.join(apart)}, whose rounds differed "
                         f"(Kruskal-Wallis p < {POOLING_TEST_LEVEL:g}) or whose pairs were "
                         "under 6, the t over the rounds of each round's median pair")
        if any("speedup" in r.changes for r in results):
            parts.append(f"speedups, the t over {rounds} rounds of each round's median pair")
        return (f"{cmp.CONFIDENCE:.0%} intervals of head over base from step pairs (base and "
                "head at once, taking turns step by step on the same devices: each pair met "
                "the machine in the same second): " + "; ".join(parts))
    return (f"{cmp.CONFIDENCE:.0%} intervals: t over {', '.join(map(str, ns))} of {rounds} "
            "rounds of head over base, paired by round"
            + (f"; one process's cases as each step over the speed probe before it{power} "
               "(the machine's speed taken out as far as this gate's steps followed the "
               "probe)" if METHOD_CONTROLLED in methods else ""))


def markdown_text(results: list[cmp.CaseResult], sides: Mapping[str, str],
                  head: Run, summary: Mapping[str, Any], notes: list[str]) -> str:
    """Markdown for a pull-request comment: the verdict line, what was measured where, the
    table, the notes. ``sides``: each side's description (``base`` and ``head``: the
    commit, what was named, the variables set)."""
    machine = head.env.get("fingerprint") or {}
    versions = head.env.get("versions") or {}
    where = ", ".join(str(x) for x in (machine.get("cpu_model"), machine.get("rig")) if x)
    lines = [f"### parabench same-job gate: {output.verdict_line(results)}", "",
             f"Base `{sides['base']}`, head `{sides['head']}`, both "
             f"measured in this job{f' on {where}' if where else ''}: profile "
             f"`{summary['profile']}`, {summary['rounds']} rounds "
             + ("with both sides at once, taking turns step by step "
                if summary.get("together") else
                f"in the order {order_text(summary['order'])} ") +
             f"({summary['duration_s']:.0f} s). Threshold {summary['threshold_pct']:g}% and "
             f"a {cmp.CONFIDENCE:.0%} interval that excludes 0; changes are + when slower.",
             "", f"{method_line(results, summary['rounds'], summary.get('probe_coefficient'))}.",
             "",
             "| " + " | ".join(output.HEADER) + " |", "|" + "---|" * len(output.HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in output.rows(results)]
    said = [f"torch {versions['torch']}"] if versions.get("torch") else []
    said += [f"python {versions['python']}"] if versions.get("python") else []
    extra = notes + ([f"both sides ran in one environment: {', '.join(said)}"] if said else [])
    if extra:
        lines += [""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def verdicts_json(results: list[cmp.CaseResult], base: Run, head: Run
                  ) -> list[dict[str, Any]]:
    """Per case: its verdict, the metric behind it, every change with its interval, and
    each side's step-time prediction error (the median over its rounds; None where that
    side made no prediction)."""
    def error(run: Run, cid: str) -> float | None:
        return number(run.cases.get(cid, {}).get("prediction_error_pct"))

    return [{"case_id": r.case_id, "strategy": r.strategy, "verdict": r.verdict, "by": r.by,
             "base_median_s": r.base_median_s, "head_median_s": r.cand_median_s,
             "changes": {m: {"value": c.value, "ci_low": c.ci_low, "ci_high": c.ci_high,
                             "rounds": c.n_base}
                         for m, c in r.changes.items()},
             "prediction_error_pct": {"base": error(base, r.case_id),
                                      "head": error(head, r.case_id)}} for r in results]

