"""The pipeline bubble per device and per schedule: hand-made timelines, the theory table
(checked against torch's own schedules), real traced zero-bubble steps, the cases.csv columns."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as pps
from torch.distributed.pipelining.schedules import _ComputationType as Op

from bench_lib import strategies
from bench_lib.analysis import bubble
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.trace import align, trace_step
from bench_lib.report.gantt import bubble as report_bubble
from bench_lib.rows.bound_columns import bubble_columns
from bench_lib.strategies import BuildContext
from bench_lib.sweep.cases import new_case
from bench_lib.workloads import Workload
from tests.dist_harness import run_ranks
from tests.reference import micro


def ev(rank, device, stage, mb, phase, start, end):
    return {"rank": rank, "device": device, "stage": stage, "microbatch": mb, "phase": phase,
            "start_s": float(start), "end_s": float(end)}


# -- theory ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy,p,m,expected_pct", [
    ("1f1b", 2, 4, 20.0),              # done-when: (p-1)/(m+p-1) = 1/5
    ("interleaved-1f1b", 2, 4, 11.1),  # done-when: (p-1)/(v*m+p-1) = 1/9
    ("interleaved-1f1b", 2, 8, 5.9),   # 1/17
    ("gpipe", 4, 8, 27.3),             # 3/11
    ("pipeline", 2, 4, 20.0),          # the tutorial's pipelining is GPipe-like
    ("mp", 2, None, 50.0),             # (p-1)/p: no micro-batches
    ("interleaved-zb", 2, 4, 4.0),     # (p-1)/(3*v*m+p-1) = 1/25
    ("zbv", 2, 4, 4.0),
    ("zbv", 4, 8, 5.9),                # 3/51
])
def test_theory_per_schedule(strategy, p, m, expected_pct):
    ideal = bubble.theory(strategy, p, m)
    assert round(100 * ideal.fraction, 1) == expected_pct
    assert ideal.p == p and ideal.formula in ideal.describe()


def test_theory_only_for_pipelined_strategies():
    for name in ("single", "ddp", "dp", "fsdp", "accum"):
        assert bubble.theory(name, 2, 4) is None
    # Every strategy that cuts the model into stages has a timeline and a theory.
    cutting = {n for n, s in strategies.REGISTRY.items() if s.uses_partition}
    assert cutting == set(bubble.SCHEDULES)


def _torch_order(cls, p, m, v=2):
    """torch's own per-rank action lists, without the process group its constructor needs."""
    s = object.__new__(cls)
    s.n_local_stages, s.pp_group_size, s._n_microbatches = v, p, m
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    s._num_stages = s.num_stages = v * p
    s.stage_index_to_group_rank = pps.generate_stage_to_rank_mapping(
        p, v * p, style="v" if cls is pps.ScheduleZBVZeroBubble else "loop")
    order = {}
    for rank in range(p):
        s.rank = rank
        order[rank] = [a for a in s._calculate_single_rank_operations(rank) if a is not None]
    return order


def _simulate(order, stages):
    """Run the action lists with T_F = T_B = T_W = 1 (a full backward 2), free transfers:
    each action starts when its rank is free and its inputs are ready. Returns events."""
    done, free, pos, events = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0), []
    progress = True
    while progress:
        progress = False
        for rank, actions in order.items():
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                s, op, mb = a.stage_index, a.computation_type, a.microbatch_index
                if op == Op.FORWARD:
                    key, cost, needs = "F", 1, [("F", s - 1, mb)] if s > 0 else []
                elif op in (Op.BACKWARD_INPUT, Op.FULL_BACKWARD):
                    key, cost = "B", 1 if op == Op.BACKWARD_INPUT else 2
                    needs = [("B", s + 1, mb)] if s < stages - 1 else [("F", s, mb)]
                else:
                    assert op == Op.BACKWARD_WEIGHT, a
                    key, cost, needs = "W", 1, [("B", s, mb)]
                if any(n not in done for n in needs):
                    break
                start = max([free[rank]] + [done[n] for n in needs])
                done[(key, s, mb)] = free[rank] = start + cost
                events.append(ev(rank, f"cpu:{rank}", s, mb, key, start, start + cost))
                pos[rank] += 1
                progress = True
    assert all(pos[r] == len(a) for r, a in order.items()), "the schedule deadlocked"
    return events


@pytest.mark.parametrize("name,cls", [("interleaved-1f1b", pps.ScheduleInterleaved1F1B),
                                      ("interleaved-zb", pps.ScheduleInterleavedZeroBubble),
                                      ("zbv", pps.ScheduleZBVZeroBubble)])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8)])
def test_theory_is_what_torchs_own_schedule_leaves_idle(name, cls, p, m):
    events = _simulate(_torch_order(cls, p, m), 2 * p)
    assert bubble.measured(events) == pytest.approx(bubble.theory(name, p, m).fraction)


# -- measured, per device ----------------------------------------------------------------


def test_perfectly_packed_interleaved_schedule_reads_zero_idle():
    """p=2, v=2, m=8 with no gap on either device: 0% measured, against 1/17 = 5.9% theory.
    Per (rank, stage) row, as before, it read 50%: a row is idle while its sibling runs."""
    events, t = [], {0: 0.0, 1: 0.0}
    for rank in (0, 1):
        for stage in (rank, rank + 2):
            for mb in range(8):
                for phase in ("fwd", "bwd"):
                    events.append(ev(rank, f"cpu:{rank}", stage, mb, phase, t[rank],
                                     t[rank] + 1))
                    t[rank] += 1
    assert bubble.measured(events) == 0.0
    stats = report_bubble(pd.DataFrame(events), bubble.theory("interleaved-1f1b", 2, 8))
    assert stats["bubble_measured"] == 0.0 and stats["devices"] == 2
    assert round(100 * stats["bubble_theoretical"], 1) == 5.9


def test_zero_bubble_timeline_counts_its_weight_gradient_passes():
    """ZB-H1 at p=2, m=2, unit passes: the W passes fill device 0's tail; each device idles
    1 unit of 7 (the theory's (p-1)/(3m+p-1)). Unstamped W passes would read as idle."""
    d0 = [(0, "fwd", 0, 1), (1, "fwd", 1, 2), (0, "bwd", 3, 4), (0, "wgt", 4, 5),
          (1, "bwd", 5, 6), (1, "wgt", 6, 7)]
    d1 = [(0, "fwd", 1, 2), (0, "bwd", 2, 3), (1, "fwd", 3, 4), (1, "bwd", 4, 5),
          (0, "wgt", 5, 6), (1, "wgt", 6, 7)]
    events = ([ev(0, "cpu:0", 0, *e) for e in d0] + [ev(1, "cpu:1", 1, *e) for e in d1])
    assert bubble.idle_by_device(events) == {(0, "cpu:0"): pytest.approx(1 / 7),
                                             (1, "cpu:1"): pytest.approx(1 / 7)}
    no_w = [e for e in events if e["phase"] != "wgt"]
    # Each device then runs 4 units of a 6-unit span (the step would end with B1).
    assert bubble.idle_by_device(no_w) == {(0, "cpu:0"): pytest.approx(2 / 6),
                                           (1, "cpu:1"): pytest.approx(2 / 6)}


def test_device_union_counts_overlaps_once_and_keys_by_rank_and_device():
    events = [ev(0, "cpu", 0, 0, "fwd", 0, 2), ev(0, "cpu", 2, 0, "bwd", 1, 3),
              ev(0, "cpu", 0, 1, "fwd", 5, 6),
              # Another rank's device: the same torch name, a device of its own.
              ev(1, "cpu", 1, 0, "fwd", 0, 6)]
    idle = bubble.idle_by_device(events)
    assert idle == {(0, "cpu"): pytest.approx(1 - 4 / 6), (1, "cpu"): 0.0}
    assert bubble.measured(events) == pytest.approx((1 - 4 / 6) / 2)
    assert bubble.measured([]) is None


# -- real traced steps -------------------------------------------------------------------

TWO_STAGE = ["interleaved-1f1b", "interleaved-zb", "zbv"]


def _traced_rank(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    for name in TWO_STAGE:
        workload = Workload("resnet-tiny", 32, 8)
        ctx = BuildContext(workload, micro(workload, 2), rank, world_size)
        torch.manual_seed(0)
        trainer = strategies.get(name).build(workload.build_model(), [torch.device("cpu")], ctx)
        x, y = workload.make_batch(8, trainer.input_device, seed=0)
        trainer.step(x, y)  # the traced step comes after others, as in the worker
        stages = trainer.timeline_stages()
        dist.barrier()  # the ranks start it together, as in the worker
        start = time.perf_counter()
        traced = trace_step(lambda t=trainer, x=x, y=y: t.step(x, y), stages, trainer.devices,
                            [f"cpu:{rank}"])
        restored = all(m not in vars(s.pipe_stage) for s in stages
                       for m in ("forward_one_chunk", "backward_one_chunk",
                                 "backward_weight_one_chunk"))
        window = (start, time.perf_counter())
        out[name] = ([{"rank": rank, **e} for e in traced.events], traced.step_s, restored,
                     window)
    return out


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_real_traced_step_stamps_every_pass_of_every_microbatch_on_both_ranks():
    rank0, rank1 = run_ranks(_traced_rank, 2)
    for name in TWO_STAGE:
        raw = pd.DataFrame(rank0[name][0] + rank1[name][0])
        # Every stamp was taken inside a rank's step (the ranks' windows: they leave the
        # barrier within a scheduling delay of each other, so neither window holds all).
        windows = [rank0[name][3], rank1[name][3]]
        assert min(w[0] for w in windows) <= raw.start_s.min()
        assert raw.end_s.max() <= max(w[1] for w in windows)
        assert all(0 < r[name][1] <= r[name][3][1] - r[name][3][0] for r in (rank0, rank1))
        events = pd.DataFrame(align(raw.to_dict("records")))
        assert rank0[name][2] and rank1[name][2], f"{name}: methods restored after the trace"
        split = bubble.SCHEDULES[name].w_split
        phases = {"fwd", "bwd", "wgt"} if split else {"fwd", "bwd"}
        for rank in (0, 1):
            mine = events[events["rank"] == rank]
            assert set(mine.device) == {f"cpu:{rank}"}
            assert mine.stage.nunique() == bubble.SCHEDULES[name].stages_per_device
            for (stage, mb), g in mine.groupby(["stage", "microbatch"]):
                at = g.set_index("phase")
                assert set(at.index) == phases and len(g) == len(phases), (name, stage, mb)
                # Forward, then input gradient, then weight gradient.
                assert at.loc["fwd", "end_s"] <= at.loc["bwd", "start_s"]
                if split:
                    assert at.loc["bwd", "end_s"] <= at.loc["wgt", "start_s"]
            assert sorted(mine.microbatch.unique()) == [0, 1, 2, 3]
        assert events.start_s.min() == 0 < events.end_s.max()
        assert 0.0 <= bubble.measured(events.to_dict("records")) < 1.0


# -- cases.csv columns -------------------------------------------------------------------


def test_bubble_columns(cpu_rig):
    case = new_case(cpu_rig, "interleaved-1f1b", "resnet-tiny", 32, 8, split_size=2)
    events = [ev(r, f"cpu:{r}", s, 0, "fwd", r, r + 3) for r, s in ((0, 0), (1, 1))]
    outcome = CaseOutcome("ok", step_times_s=[0.5], timeline=events, traced_step_s=5.5)
    cols = bubble_columns(case, outcome, median_s=5.0)
    assert cols == {"bubble_theory_pct": pytest.approx(100 / 9),
                    "bubble_measured_pct": pytest.approx(25.0), "timeline_span_s": 4.0,
                    "traced_step_s": 5.5, "traced_vs_median_pct": pytest.approx(10.0)}
    # No timeline: the theory stays (a property of the schedule), the measured ones are empty.
    assert bubble_columns(case, CaseOutcome("ok"), 5.0) == {
        "bubble_theory_pct": pytest.approx(100 / 9)}
    assert bubble_columns(new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8), outcome, 5.0) == {}
