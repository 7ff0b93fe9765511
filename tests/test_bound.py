"""The bound of a case from its own parts: schedule makespans against closed forms and hand
computations, the data-parallel bound, the collective micro-benchmark and its fit, the
cases.csv columns, and the report's figure."""

from __future__ import annotations

import math
import random

import pandas as pd
import pytest

from bench_lib.analysis import bound
from bench_lib.analysis.collective_fits import (
    OPS,
    CollectiveFit,
    Collectives,
    bus_factor,
    fit_alpha_beta,
)
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure.collectives import SIZES_MIB, measure, sizes_for
from bench_lib.prediction.collectives import largest_message
from bench_lib.prediction.schedule_orders import schedule_actions
from bench_lib.report import bound_figure, build
from bench_lib.report.runs import load_runs
from bench_lib.results.store import RunWriter, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.rows.bound_columns import bound_columns
from bench_lib.sweep.cases import new_case
from bench_lib.workloads import Workload
from bench_lib.workloads.sizes import boundary_bytes, parameter_bytes
from tests.test_report import env


def stage_times(f, b, w=None):
    """(stage, phase) -> seconds from per-stage lists (wgt only where given)."""
    times = {}
    for s, (fs, bs) in enumerate(zip(f, b)):
        times[s, "fwd"], times[s, "bwd"] = fs, bs
        if w is not None:
            times[s, "wgt"] = w[s]
    return times


def one_f_one_b(p, m):
    return schedule_actions("1f1b", p, m)


# -- schedules: closed forms and hand computations --------------------------------------


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_simulated_torch_schedules_match_the_closed_forms_for_balanced_stages(name, p, m):
    """(m+p-1)(f+b) for GPipe and 1F1B; (v*m+p-1)(f+b) per chunk for interleaved 1F1B."""
    stages = p * (2 if name == "interleaved-1f1b" else 1)
    f, b = 0.3, 0.7
    makespan, busy = bound.replay_schedule(schedule_actions(name, p, m),
                                    stage_times([f] * stages, [b] * stages))
    assert makespan == pytest.approx(bound.closed_form(name, p, m, f, b))
    assert max(busy) == pytest.approx(m * (f + b) * stages / p)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8)])
@pytest.mark.parametrize("name", ["interleaved-zb", "zbv"])
def test_simulated_zero_bubble_schedules_match_the_closed_form(name, p, m):
    """(3*v*m+p-1) t with f = b = w = t per chunk (Qi et al.; analysis.bubble's theory)."""
    t = 0.25
    times = stage_times([t] * 2 * p, [t] * 2 * p, [t] * 2 * p)
    makespan, _ = bound.replay_schedule(schedule_actions(name, p, m), times)
    assert makespan == pytest.approx(bound.closed_form(name, p, m, t, t, t))
    assert makespan == pytest.approx((3 * 2 * m + p - 1) * t)


def test_unbalanced_1f1b_by_hand_beats_the_usual_estimate():
    """p=2, m=3, f=(2,1), b=(4,2) (the module docstring's chart): rank 0 waits 1 unit for
    B0; makespan 19, where sum(f+b) + (m-1) max(f+b) says 21. With a transfer of 0.5 per
    crossing: F0 reaches rank 1 at 2.5, its gradient rank 0 at 8, the last at 14.5 -> 20."""
    times = stage_times([2, 1], [4, 2])
    assert bound.replay_schedule(one_f_one_b(2, 3), times) == (19, [18, 9])
    assert bound.replay_schedule(one_f_one_b(2, 3), times, [0.5])[0] == pytest.approx(20)
    b = bound.pipeline_bound("1f1b", one_f_one_b(2, 3), times, [0.5], other_s=0.25)
    assert (b.compute_s, b.bubble_s, b.comm_s, b.other_s) == pytest.approx((18, 1, 1, 0.25))
    assert b.step_s == pytest.approx(20.25)
    assert b.note() == "1f1b: compute 18 s + bubble 1 s + p2p 1 s + other 0.25 s"


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 8)])
def test_gpipe_with_transfers_and_unbalanced_stages_is_a_flow_shop(p, m):
    """sum(f+b) + (m-1)(max f + max b) + 2(p-1)c, exact for GPipe whatever the stages."""
    rng = random.Random(p * 100 + m)
    f = [rng.uniform(0.1, 1.0) for _ in range(p)]
    b = [rng.uniform(0.2, 2.0) for _ in range(p)]
    c = 0.05
    makespan, _ = bound.replay_schedule(schedule_actions("gpipe", p, m), stage_times(f, b),
                                 [c] * (p - 1))
    expected = sum(f) + sum(b) + (m - 1) * (max(f) + max(b)) + 2 * (p - 1) * c
    assert makespan == pytest.approx(expected)


def test_transfers_count_only_between_ranks_and_zbv_turns_on_one_rank():
    """ZB-V's middle stages (1 and 2 of 4 on 2 ranks) share rank 1: that edge is free."""
    t = 1.0
    times = stage_times([t] * 4, [t] * 4, [t] * 4)
    orders = schedule_actions("zbv", 2, 4)
    free = bound.replay_schedule(orders, times)[0]
    only_middle = bound.replay_schedule(orders, times, [0.0, 5.0, 0.0])[0]
    assert only_middle == free  # stage 1 -> 2 stays on rank 1
    assert bound.replay_schedule(orders, times, [0.5, 0.0, 0.5])[0] > free


def test_deadlocked_action_lists_are_refused():
    times = stage_times([1, 1], [1, 1])
    with pytest.raises(ValueError, match="deadlock"):
        bound.replay_schedule([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], times)


def test_serial_bound_sums_every_pass():
    times = stage_times([1.0, 2.0], [3.0, 4.0])
    b = bound.serial_bound("serial", times, 4, transfer_s=0.5, other_s=0.1)
    assert (b.step_s, b.compute_s, b.bubble_s, b.comm_s) == pytest.approx((40.6, 40, 0, 0.5))
    assert b.note().startswith("serial: compute 40 s + bubble 0 s + transfers 0.5 s")


def test_phase_times_are_each_pass_and_the_median_over_microbatches():
    events = [{"stage": 0, "phase": "fwd", "microbatch": mb, "start_s": s, "end_s": s + d}
              for mb, (s, d) in enumerate(((0, 1.0), (2, 3.0), (9, 2.0)))]
    assert bound.phase_times(events) == {(0, "fwd"): 2.0, (0, "fwd", 0): 1.0,
                                         (0, "fwd", 1): 3.0, (0, "fwd", 2): 2.0}
    assert bound.action_cost({(0, "fwd"): 2.0, (0, "fwd", 1): 3.0}, "F", 0, 1) == 3.0
    assert bound.action_cost({(0, "fwd"): 2.0, (0, "fwd", 1): 3.0}, "F", 0, 2) == 2.0


# A traced 1f1b step (resnet-tiny, 64 px, batch 16, 4 micro-batches, cpu:2x1t), ms: the
# fill's passes, run while the peer idles, are the quick ones.
TRACED_1F1B = {
    0: "F0.0 0 7, F0.1 7 14, B0.0 39 61, F0.2 61 80, B0.1 82 100, F0.3 102 114, "
       "B0.2 115 136, B0.3 150 163",
    1: "F1.0 7 17, B1.0 18 38, F1.1 39 49, B1.1 49 76, F1.2 80 87, B1.2 87 114, "
       "F1.3 115 124, B1.3 124 150"}


def test_replaying_each_traced_pass_never_exceeds_the_traced_span():
    """By hand, each pass at its own time, as early as its inputs allow: rank 1's B0 ends
    at 37, F1 waits for it, ... rank 0's B3 starts at 147 and ends at 160 <= 163. With the
    medians alone (F0 9.5 ms, B0 19.5, F1 9.5, B1 26.5) every step of the fill is slower and
    rank 0's B3 ends at 173, over the trace."""
    events = []
    for rank, text in TRACED_1F1B.items():
        for item in text.split(", "):
            name, start, end = item.split()
            stage, mb = map(int, name[1:].split("."))
            events.append({"rank": rank, "stage": stage, "microbatch": mb,
                           "phase": "fwd" if name[0] == "F" else "bwd",
                           "start_s": int(start) / 1000, "end_s": int(end) / 1000})
    times = bound.phase_times(events)
    assert bound.replay_schedule(one_f_one_b(2, 4), times)[0] == pytest.approx(0.160)
    medians = {k: v for k, v in times.items() if len(k) == 2}
    assert bound.replay_schedule(one_f_one_b(2, 4), medians)[0] == pytest.approx(0.173)


# -- data parallel ------------------------------------------------------------------------


def test_data_parallel_bound_with_and_without_overlap():
    hidden = bound.data_parallel_bound("ddp", compute_s=1.0, comm_s=0.4)
    assert (hidden.step_s, hidden.no_overlap_s, hidden.comm_s) == pytest.approx((1.0, 1.4, 0))
    exposed = bound.data_parallel_bound("fsdp", compute_s=1.0, comm_s=1.5)
    assert (exposed.step_s, exposed.no_overlap_s, exposed.comm_s) == pytest.approx((1.5, 2.5, 0.5))
    assert exposed.note() == "fsdp: max(compute 1 s, comm 1.5 s) with overlap; sum 2.5 s without"


def test_collective_prices_by_hand():
    fit = CollectiveFit((1,), (1.0,), alpha_s=0.001, beta_bytes_s=1e9, busbw_gb_s=1.0)
    mib = 2**20
    # 100 MiB: a first bucket of 1 MiB, then 99 MiB in 4 buckets of 25 MiB: 5 calls.
    assert bound.ddp_comm_s(100 * mib, fit) == pytest.approx(0.005 + 100 * mib / 1e9)
    assert bound.ddp_comm_s(100 * mib, fit, 50 * mib) == pytest.approx(0.002 + 100 * mib / 1e9)
    # Two units gathered twice and scattered once, the root gathered and scattered once.
    gather = CollectiveFit((1,), (1.0,), alpha_s=0.01, beta_bytes_s=1e8, busbw_gb_s=1.0)
    assert bound.fsdp_comm_s([1e8, 2e8], 1e7, gather, fit) == pytest.approx(
        2 * (0.01 + 1 + 0.01 + 2) + (0.001 + 0.1 + 0.001 + 0.2) + (0.01 + 0.1) + (0.001 + 0.01))


def test_parameter_bytes_are_the_models_fp32_gradients():
    model = Workload("resnet-tiny", 32, 8).build_model()
    total, units = parameter_bytes("resnet-tiny", 32)
    assert total == 4 * sum(p.numel() for p in model.parameters())
    assert units and 0 < sum(units) < total  # the root keeps the stem and the head


# -- the micro-benchmark and its fit ----------------------------------------------------


def test_alpha_beta_fit_recovers_a_known_latency_and_bandwidth():
    rng = random.Random(0)
    alpha, beta = 2e-4, 1.5e9
    sizes = [2**20 * s for s in (1, 8, 32, 100)]
    times = [alpha + n / beta * (1 + rng.uniform(-0.01, 0.01)) for n in sizes]
    a, b = fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, abs=5e-4) and b == pytest.approx(beta, rel=0.02)
    exact = fit_alpha_beta(sizes, [alpha + n / beta for n in sizes])
    assert exact == pytest.approx((alpha, beta))


def test_alpha_beta_fit_never_gives_a_negative_latency():
    a, b = fit_alpha_beta([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])  # free fit: alpha = -0.5
    # Through the origin: slope = sum(xy) / sum(x^2) = (0.5 + 3 + 7.5) / (1 + 4 + 9).
    assert a == 0.0 and b == pytest.approx(14 / 11)


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 2) == 0.5 and bus_factor("send_recv", 8) == 1.0
    fit = CollectiveFit.of("all_reduce", 2, [10**6, 10**8], [0.01, 0.1])
    assert fit.busbw_gb_s == pytest.approx(1e8 / 0.1 * 1.0 / 1e9)


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_micro_benchmark_on_two_gloo_ranks_writes_a_well_formed_record(cpu_rig):
    found = measure(cpu_rig, sizes_mib=(0.0625, 0.25, 1.0), repeats=3, timeout_s=90)
    assert not found.skipped, found.skipped
    record = found.as_dict()
    assert record["backend"] == "gloo" and record["world_size"] == 2
    assert set(record["ops"]) == set(OPS)
    for op, fit in record["ops"].items():
        assert len(fit["sizes_bytes"]) == len(fit["times_s"]) == 3, op
        assert fit["sizes_bytes"][-1] == 2**20 and all(t > 0 for t in fit["times_s"]), op
        assert fit["alpha_s"] >= 0 and 0 < fit["beta_bytes_s"] < math.inf, op
    assert Collectives.from_dict(record).as_dict() == record
    assert found.wall_s < 60


def test_sizes_follow_the_sweeps_largest_message(cpu_rig):
    assert sizes_for(200 * 2**20) == SIZES_MIB  # ResNet50's ~100 MB: the full set
    assert sizes_for(10 * 2**20) == pytest.approx(tuple(s / 10 for s in SIZES_MIB))
    assert sizes_for(1000)[-1] == 1.0  # at least 1 MiB
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    grads = parameter_bytes("resnet-tiny", 32)[0]
    assert largest_message([ddp], cpu_rig) == grads
    # Nothing priced with collectives: single, and mp on a cpu rig (one process).
    alone = [new_case(cpu_rig, "single", "resnet-tiny", 32, 8),
             new_case(cpu_rig, "mp", "resnet-tiny", 32, 8)]
    assert largest_message(alone, cpu_rig) is None


def test_micro_benchmark_skips_a_rig_of_one_device():
    found = measure(Rig("cpu", 1, 1, (0,)))
    assert found.fits == {} and "one device" in found.as_dict()["skipped"]
    assert Collectives.from_dict(None).skipped == "not measured"


# -- the cases.csv columns -----------------------------------------------------------------


def traced(stage_rank_f_b, m, unit):
    """A timeline of per-micro-batch passes laid out back to back per rank."""
    events, at = [], {}
    for stage, rank, f, b in stage_rank_f_b:
        for mb in range(m):
            for phase, d in (("fwd", f), ("bwd", b)):
                start = at.get(rank, 0.0)
                events.append({"rank": rank, "device": f"cpu:{rank}", "stage": stage,
                               "microbatch": mb, "phase": phase, "start_s": start,
                               "end_s": start + d * unit})
                at[rank] = start + d * unit
    return events


def test_bound_columns_of_a_pipelined_case(cpu_rig):
    """1F1B, p=2, m=4, f=(2,1), b=(4,2) units of 10 ms: by hand, rank 0 waits 1 unit for
    its first gradient and then never: makespan 25 units (the usual estimate: 27). The
    traced step (0.27 s) is scaled to the median step (0.5 s): every pass and the time
    outside them x 0.5 / 0.27."""
    case = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 8, split_size=2)
    events = traced([(0, 0, 2, 4), (1, 1, 1, 2)], 4, 0.01)
    span = max(e["end_s"] for e in events)  # 0.24: rank 0's passes end to end
    outcome = CaseOutcome("ok", step_times_s=[0.5], timeline=events, traced_step_s=span + 0.03,
                          partition="balanced:3")
    cols = bound_columns(case, cpu_rig, outcome, median_s=0.5)
    k = 0.5 / 0.27
    assert cols["step_time_s_bound"] == pytest.approx((0.25 + 0.03) * k)
    # The made-up trace runs each rank's passes back to back, ignoring the replay's one
    # unit of waiting: the bound is 28 units against a traced step of 27, 103.7%.
    assert cols["efficiency_vs_bound_pct"] == pytest.approx(100 * 0.28 * k / 0.5)
    assert (cols["bound_compute_s"], cols["bound_bubble_s"], cols["bound_comm_s"],
            cols["bound_other_s"]) == pytest.approx((0.24 * k, 0.01 * k, 0.0, 0.03 * k))
    assert cols["step_time_s_bound_no_overlap"] is None
    assert cols["bound_note"].startswith("1f1b (transfers not measured, taken free): compute")
    assert cols["bound_note"].endswith("(traced passes x1.85: scaled to the median step)")
    # With the run's send/recv fit, each crossing costs its activation's bytes.
    send = CollectiveFit((1,), (1.0,), alpha_s=0.002, beta_bytes_s=1e9, busbw_gb_s=1.0)
    priced = bound_columns(case, cpu_rig, outcome, 0.5, collectives=Collectives(
        {"send_recv": send}, "gloo", 2))
    (edge,) = boundary_bytes("resnet-tiny", 32, 2, (3,))
    assert priced["bound_comm_s"] > 0 and priced["bound_note"].startswith("1f1b: compute")
    # The passes and the time outside them are scaled, the transfer (the fit's) is not.
    scaled = {key: t * k for key, t in bound.phase_times(events).items()}
    assert priced["step_time_s_bound"] == pytest.approx(bound.pipeline_bound(
        "1f1b", one_f_one_b(2, 4), scaled, [send.time_s(edge)], 0.03 * k).step_s)


def test_bound_columns_of_data_parallel_cases(cpu_rig):
    case = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    outcome = CaseOutcome("ok", step_times_s=[0.8])
    fit = CollectiveFit((1,), (1.0,), alpha_s=0.01, beta_bytes_s=1e8, busbw_gb_s=1.0)
    coll = Collectives({"all_reduce": fit}, "gloo", 2)
    grads = 4 * sum(p.numel() for p in Workload("resnet-tiny", 32, 8).build_model().parameters())
    assert 2**20 < grads <= 26 * 2**20  # a first bucket of 1 MiB and one of 25 MiB at most
    comm = 2 * 0.01 + grads / 1e8
    cols = bound_columns(case, cpu_rig, outcome, 0.8, single_s=1.0, collectives=coll)
    assert cols["bound_compute_s"] == pytest.approx(0.5)  # half the batch of single's 1 s
    # A cpu rig's collectives run on the cores that compute: none hidden, 0.5 + comm.
    assert cols["step_time_s_bound"] == pytest.approx(0.5 + comm)
    assert cols["bound_comm_s"] == pytest.approx(comm)
    assert cols["step_time_s_bound_no_overlap"] == pytest.approx(0.5 + comm)
    assert cols["efficiency_vs_bound_pct"] == pytest.approx(100 * (0.5 + comm) / 0.8)
    assert cols["bound_note"].endswith("(not overlapped)")
    # On GPUs NCCL's streams overlap the compute: max(compute, comm), comm - 0.5 exposed.
    cuda = Rig("cuda", 2)
    on_gpus = bound_columns(new_case(cuda, "ddp", "resnet-tiny", 32, 8), cuda, outcome, 0.8,
                            single_s=1.0, collectives=coll)
    assert on_gpus["step_time_s_bound"] == pytest.approx(max(0.5, comm))
    assert on_gpus["bound_comm_s"] == pytest.approx(max(0.0, comm - 0.5))
    assert on_gpus["step_time_s_bound_no_overlap"] == pytest.approx(0.5 + comm)
    assert bound_columns(case, cpu_rig, outcome, 0.8, None, coll) == {
        "bound_note": "no bound: no ok single case of this workload in the run"}
    assert "no collective micro-benchmark (a rig" in bound_columns(
        case, cpu_rig, outcome, 0.8, 1.0,
        Collectives(skipped="a rig of one device has no collectives to measure"))["bound_note"]


def test_ddp_bound_takes_compute_from_its_own_no_sync_steps(cpu_rig):
    """Measured compute (the case's no_sync steps) wins over single's linear share, which on
    CPUs is optimistic (per-image cost rises as the batch shrinks); it never exceeds the
    median step, and fsdp, with no such mode, keeps the share and says so."""
    fit = CollectiveFit((1,), (1.0,), alpha_s=0.01, beta_bytes_s=1e8, busbw_gb_s=1.0)
    coll = Collectives({"all_reduce": fit, "all_gather": fit, "reduce_scatter": fit},
                       "gloo", 2)
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)
    measured = CaseOutcome("ok", step_times_s=[0.8], compute_step_s=0.7)
    cols = bound_columns(ddp, cpu_rig, measured, 0.8, single_s=1.0, collectives=coll)
    assert cols["bound_compute_s"] == pytest.approx(0.7)
    assert cols["bound_note"].startswith(
        "ddp (compute: its no_sync steps): compute 0.7 s + collectives ")
    assert cols["bound_note"].endswith(" s (not overlapped)")  # a cpu rig
    slow = CaseOutcome("ok", step_times_s=[0.8], compute_step_s=0.9)  # noise: clipped
    assert bound_columns(ddp, cpu_rig, slow, 0.8, 1.0, coll)["bound_compute_s"] == 0.8
    alone = CaseOutcome("ok", step_times_s=[0.8], compute_step_s=0.7)  # no single needed
    assert bound_columns(ddp, cpu_rig, alone, 0.8, None, coll)["bound_compute_s"] == 0.7
    fsdp = new_case(cpu_rig, "fsdp", "resnet-tiny", 32, 8)
    shared = bound_columns(fsdp, cpu_rig, CaseOutcome("ok", step_times_s=[0.8]), 0.8, 1.0, coll)
    assert shared["bound_compute_s"] == pytest.approx(0.5)
    assert shared["bound_note"].startswith("fsdp (compute: single's step x 4/8)")
    assert shared["bound_other_s"] == 0.0  # no calibrated copy rate: copies left out
    # With the calibration's copy rate (0.01 s per 64 MiB into fresh pages), FSDP2's copies
    # are its own work: each unit of u bytes 3 (u + u/2) over 2 ranks, the root 2 (r + r/2).
    grads, units = parameter_bytes("resnet-tiny", 32)
    root = grads - sum(units)
    rate = {64 * 2**20: 0.01}
    priced = bound_columns(fsdp, cpu_rig, CaseOutcome("ok", step_times_s=[0.8]), 0.8, 1.0,
                           coll, copies=rate)
    copies_s = (4.5 * sum(units) + 3 * root) * 0.01 / 2**26
    assert priced["bound_other_s"] == pytest.approx(copies_s)
    assert priced["step_time_s_bound"] == pytest.approx(
        shared["step_time_s_bound"] + copies_s)
    # fsdp takes a plain ddp case's measured compute of the same local batch where the run
    # has one (rows.workload_rows.ddp_compute_s picks it; knobbed or other world sizes do
    # not count).
    from bench_lib.rows.workload_rows import ddp_compute_s
    from bench_lib.strategies.ddp_knobs import DdpKnobs

    knobbed = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8, ddp=DdpKnobs(comm_hook="fp16"))
    workload = [(knobbed, CaseOutcome("ok", compute_step_s=0.1)),
                (ddp, CaseOutcome("ok", compute_step_s=0.6)), (fsdp, CaseOutcome("ok"))]
    assert ddp_compute_s(fsdp, workload) == 0.6
    assert ddp_compute_s(fsdp, workload[:1]) is None and ddp_compute_s(ddp, workload) is None
    peer = bound_columns(fsdp, cpu_rig, CaseOutcome("ok", step_times_s=[0.8]), 0.8, 1.0, coll,
                         ddp_compute_s=0.6)
    assert peer["bound_compute_s"] == pytest.approx(0.6)
    assert peer["bound_note"].startswith("fsdp (compute: ddp's no_sync steps, the same local")


def test_no_bound_for_other_strategies_failed_cases_or_a_missing_timeline(cpu_rig):
    ok = CaseOutcome("ok", step_times_s=[1.0])
    assert bound_columns(new_case(cpu_rig, "single", "resnet-tiny", 32, 8), cpu_rig, ok,
                         1.0) == {}
    piped = new_case(cpu_rig, "gpipe", "resnet-tiny", 32, 8, split_size=2)
    assert bound_columns(piped, cpu_rig, CaseOutcome("error", "boom"), None) == {}
    assert bound_columns(piped, cpu_rig, CaseOutcome("ok", step_times_s=[1.0],
                                                     trace_note="no timeline: x"), 1.0) == {
        "bound_note": "no bound: no timeline (no timeline: x)"}


def test_mp_bound_is_its_passes_in_turn_on_a_cpu_rig(cpu_rig):
    case = new_case(cpu_rig, "mp", "resnet-tiny", 32, 8)
    events = traced([(0, 0, 2, 4), (1, 0, 1, 2)], 1, 0.1)
    outcome = CaseOutcome("ok", step_times_s=[1.0], timeline=events, traced_step_s=1.0,
                          partition="tutorial:3")
    cols = bound_columns(case, cpu_rig, outcome, 1.0)
    assert cols["step_time_s_bound"] == pytest.approx(1.0)  # 0.9 of passes + 0.1 outside
    assert cols["bound_note"] == ("mp: compute 0.9 s + bubble 0 s + transfers 0 s + "
                                  "other 0.1 s")


def test_a_slow_traced_step_is_scaled_to_the_median_step(cpu_rig):
    """The traced step took 2 s where the median step is 1 s: every traced pass and the
    time outside them count half, so the serial bound of pipeline is the median itself."""
    case = new_case(cpu_rig, "pipeline", "resnet-tiny", 32, 8, split_size=4)
    events = traced([(0, 0, 3, 5), (1, 0, 4, 6)], 2, 0.05)  # 1.8 s of passes
    outcome = CaseOutcome("ok", step_times_s=[1.0], timeline=events, traced_step_s=2.0,
                          partition="tutorial:3")
    cols = bound_columns(case, cpu_rig, outcome, 1.0)
    assert (cols["bound_compute_s"], cols["bound_other_s"]) == pytest.approx((0.9, 0.1))
    assert cols["efficiency_vs_bound_pct"] == pytest.approx(100.0)
    assert cols["bound_note"].endswith("(traced passes x0.50: scaled to the median step)")
    # A traced step faster than the median is scaled up the same way: 1.8 s of passes and
    # 0.1 s outside them x 2.5 / 1.9 = 2.5 s, the median again.
    quick = CaseOutcome("ok", step_times_s=[1.0], timeline=events, traced_step_s=1.9,
                        partition="tutorial:3")
    up = bound_columns(case, cpu_rig, quick, 2.5)
    assert up["step_time_s_bound"] == pytest.approx(2.5)
    assert (up["bound_compute_s"], up["bound_other_s"]) == pytest.approx(
        (1.8 * 2.5 / 1.9, 0.1 * 2.5 / 1.9))
    assert up["bound_note"].endswith("(traced passes x1.32: scaled to the median step)")
    # A traced step as long as the median is not scaled, and the note says nothing of it.
    even = CaseOutcome("ok", step_times_s=[1.9], timeline=events, traced_step_s=1.9,
                       partition="tutorial:3")
    assert "traced passes x" not in bound_columns(case, cpu_rig, even, 1.9)["bound_note"]


# -- the report ------------------------------------------------------------------------


def bound_row(strategy, step, bound_s, split=None, parts=None, no_overlap=None):
    row = {"case_id": f"{strategy}_s{split}", "strategy": strategy, "model": "resnet50",
           "rig": "cpu:2x1t", "world_size": 1 if strategy == "single" else 2,
           "image_size": 128, "batch_size": 32, "split_size": split or "",
           "precision": "fp32", "loss": "ce", "status": "ok", "launches": 1,
           "launch_medians_s": f"{step}", "step_time_s_median": step,
           "throughput_img_s": 32 / step, "speedup_vs_single": 2.0 / step}
    if bound_s is not None:
        row |= {"step_time_s_bound": bound_s, "efficiency_vs_bound_pct": 100 * bound_s / step,
                "step_time_s_bound_no_overlap": no_overlap, "bound_note": "x"}
        row |= dict(zip(["bound_compute_s", "bound_bubble_s", "bound_comm_s",
                         "bound_other_s"], parts or (bound_s, 0.0, 0.0, 0.0)))
    return row


@pytest.mark.integration
def test_bound_figure_renders_from_a_small_cases_csv(tmp_path):
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", env())
    with RunWriter(run_dir) as writer:
        writer.write_case(bound_row("single", 2.0, None))
        writer.write_case(bound_row("ddp", 1.25, 1.0, no_overlap=1.3))
        writer.write_case(bound_row("1f1b", 1.35, 0.95, 8, (0.7, 0.15, 0.05, 0.05)))
    cases = load_runs([run_dir]).cases
    fig = bound_figure.fig_bound(cases)
    top, bottom = fig.axes
    heights = sorted(round(p.get_height(), 6) for p in top.patches)
    assert heights == [0.95, 1.0, 1.25, 1.35]  # measured and bound of ddp and 1f1b
    assert [t.get_text() for t in top.texts] == ["80%", "70%"]
    # Bottom: 1f1b's four parts (0.95 in all), then measured as bound + a 0.4 s gap.
    assert sum(p.get_height() for p in bottom.patches[:4]) == pytest.approx(0.95)
    assert [round(p.get_height(), 6) for p in bottom.patches[4:]] == [0.95, 0.4]
    table = bound_figure.efficiency_table(cases)
    assert list(table.strategy) == ["ddp", "1f1b"]
    # 1f1b: 2.0 / 1.35 = 1.48x measured, 2.0 / 0.95 = 2.11x at its bound.
    assert table.speedup.tolist() == pytest.approx([1.6, 2.0 / 1.35])
    assert table.allowed_speedup.tolist() == pytest.approx([2.0, 2.0 / 0.95])
    assert "median efficiency vs bound" in bound_figure.explain_html(cases)
    build.write_report([run_dir])
    assert (run_dir / "fig9_bound.png").read_bytes().startswith(b"\x89PNG")
    assert "median efficiency vs bound" in (run_dir / "report.html").read_text()


def test_no_bound_figure_without_bounds():
    cases = pd.DataFrame([bound_row("single", 2.0, None)])
    assert bound_figure.fig_bound(cases) is None and bound_figure.explain_html(cases) == ""


def test_a_case_across_nodes_is_not_priced_with_one_nodes_collectives(cpu_rig):
    """The micro-benchmark runs on node 0's devices: its fit prices intra-node traffic, not
    the network a case across nodes crosses (#28 item 11). Such a case gets no bound, and
    says why, rather than one off by the network's cost."""
    from bench_lib.nodes.multinode import plan_nodes
    from bench_lib.sweep.profile import Profile

    fit = CollectiveFit((1,), (1.0,), alpha_s=0.01, beta_bytes_s=1e8, busbw_gb_s=1.0)
    coll = Collectives({"all_reduce": fit, "all_gather": fit, "reduce_scatter": fit,
                        "send_recv": fit}, "gloo", cpu_rig.num_devices)
    profile = Profile(strategies=("single", "ddp", "fsdp", "gpipe"), models=("resnet-tiny",),
                      image_sizes=(32,), batch_sizes=(8,), split_sizes=(2,))
    rig, cases = plan_nodes(profile, cpu_rig, 2)
    spanning = [c for c in cases if c.status is None and c.process_group]
    assert {c.strategy for c in spanning} == {"ddp", "fsdp", "gpipe"}
    for case in spanning:
        cols = bound_columns(case, rig, CaseOutcome("ok", step_times_s=[0.8]), 0.8, 1.0, coll)
        assert cols == {"bound_note": "no bound: the case's ranks span 2 nodes, and the "
                        "collective micro-benchmark measured node 0's devices only"}, case
