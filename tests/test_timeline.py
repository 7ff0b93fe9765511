"""The measured pipeline timeline: stamps on real stages, the bubble per device, timeline.csv."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from bench_lib import strategies
from bench_lib.analysis.bubble import theory, union_length
from bench_lib.measure.trace import align, trace_step
from bench_lib.report.gantt import bubble
from bench_lib.results.read import run_dirs_in
from bench_lib.strategies import BuildContext
from bench_lib.workloads import Workload
from tests.conftest import in_process
from tests.reference import micro


def gpipe_events(stages: int, microbatches: int, unit_s: float = 1.0) -> pd.DataFrame:
    """An ideal GPipe step: all forwards, then all backwards, each taking ``unit_s``."""
    rows, fwd_end = [], (microbatches + stages - 1) * unit_s
    for s in range(stages):
        for m in range(microbatches):
            rows.append({"rank": 0, "stage": s, "device": f"cpu:{s}", "microbatch": m,
                         "phase": "fwd", "start_s": (m + s) * unit_s,
                         "end_s": (m + s + 1) * unit_s})
            back = fwd_end + (microbatches - 1 - m + stages - 1 - s) * unit_s
            rows.append({"rank": 0, "stage": s, "device": f"cpu:{s}", "microbatch": m,
                         "phase": "bwd", "start_s": back, "end_s": back + unit_s})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("stages,microbatches,expected", [(2, 1, 1 / 2), (2, 4, 1 / 5),
                                                          (4, 8, 3 / 11), (1, 6, 0.0)])
def test_theoretical_bubble_by_hand(stages, microbatches, expected):
    assert theory("gpipe", stages, microbatches).fraction == pytest.approx(expected)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (3, 1)])
def test_ideal_gpipe_schedule_measures_its_theoretical_bubble(stages, microbatches):
    stats = bubble(gpipe_events(stages, microbatches, unit_s=0.01),
                   theory("gpipe", stages, microbatches))
    assert stats["stages"] == stats["devices"] == stages
    assert stats["microbatches"] == microbatches
    assert stats["bubble_measured"] == pytest.approx(stats["bubble_theoretical"])
    # Span: forwards and backwards each take M+S-1 units.
    assert stats["span_s"] == pytest.approx(2 * (microbatches + stages - 1) * 0.01)


def test_idle_counts_overlapping_work_once():
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    events = gpipe_events(2, 2)
    busier = pd.concat([events, events.assign(start_s=events.start_s + 0.5,
                                              end_s=events.end_s + 0.5)])
    # Shifted copies overlap the originals: idle shrinks but stays non-negative.
    assert 0.0 <= bubble(busier, None)["bubble_measured"] < bubble(events, None)["bubble_measured"]


def test_align_puts_the_first_start_at_zero():
    events = [{"rank": 1, "start_s": 105.5, "end_s": 106.0},
              {"rank": 0, "start_s": 105.0, "end_s": 105.25}]
    assert align(events) == [{"rank": 1, "start_s": 0.5, "end_s": 1.0},
                             {"rank": 0, "start_s": 0.0, "end_s": 0.25}]
    assert align([]) == []


def build_trainer(name: str, batch: int = 8, split: int | None = 2):
    torch.manual_seed(0)
    workload = Workload("resnet-tiny", 32, batch)
    devices = [torch.device("cpu")] * strategies.get(name).num_devices(_two_rig())
    ctx = BuildContext(workload, micro(workload, split))
    trainer = strategies.get(name).build(workload.build_model(), devices, ctx)
    x, y = workload.make_batch(batch, trainer.input_device, seed=0)
    return trainer, x, y


def _two_rig():
    from bench_lib.rig import Rig

    return Rig("cpu", 2, 1, (0, 0))


def test_timeline_stages_are_the_stages_on_their_device_slots():
    pipe, _, _ = build_trainer("pipeline")
    assert [s.index for s in pipe.timeline_stages()] == [0, 1]
    assert [s.module for s in pipe.timeline_stages()] == pipe.stages
    # One process, two devices: stage i runs on device slot i (both "cpu" to torch).
    assert [(s.index, s.slot, s.pipe_stage) for s in pipe.timeline_stages()] == [(0, 0, None),
                                                                                (1, 1, None)]
    mp, _, _ = build_trainer("mp", split=None)
    assert len(mp.timeline_stages()) == 2
    single, _, _ = build_trainer("single", split=None)
    assert single.timeline_stages() == []


def test_trace_step_stamps_every_stage_microbatch_and_phase():
    trainer, x, y = build_trainer("pipeline", batch=8, split=2)
    traced = trace_step(lambda: trainer.step(x, y), trainer.timeline_stages(), trainer.devices,
                        slot_labels=["cpu:0", "cpu:1"])
    events = pd.DataFrame(traced.events).assign(rank=0)
    assert len(events) == 2 * 4 * 2  # stages x micro-batches x phases
    assert set(zip(events.stage, events.device)) == {(0, "cpu:0"), (1, "cpu:1")}
    # The whole step (optimizer included) holds the stamped passes.
    assert traced.step_s >= events.end_s.max() - events.start_s.min() > 0
    assert set(events.phase) == {"fwd", "bwd"} and (events.end_s >= events.start_s).all()
    at = events.set_index(["stage", "microbatch", "phase"])
    for m in range(4):
        # Stage 1 runs a micro-batch forward after stage 0 has, and backward before it.
        assert at.loc[(0, m, "fwd"), "end_s"] <= at.loc[(1, m, "fwd"), "start_s"]
        assert at.loc[(1, m, "bwd"), "start_s"] <= at.loc[(0, m, "bwd"), "start_s"]
        assert at.loc[(1, m, "fwd"), "end_s"] <= at.loc[(1, m, "bwd"), "start_s"]
    assert 0.0 < bubble(events, None)["bubble_measured"] < 1.0
    for stage in trainer.timeline_stages():  # hooks are gone after the traced step
        module = stage.module
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_traced_step_computes_the_same_gradients():
    traced, x, y = build_trainer("pipeline")
    plain, _, _ = build_trainer("pipeline")
    for t in (traced, plain):
        t.optimizer.param_groups[0]["lr"] = 0.0  # keep weights fixed; compare gradients
    trace_step(lambda: traced.step(x, y), traced.timeline_stages(), traced.devices)
    plain.step(x, y)
    for a, b in zip(traced.parameters_in_order(), plain.parameters_in_order(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.gpu
def test_trace_step_with_cuda_events():
    trainer, x, y = build_trainer("pipeline", batch=8, split=2)
    cuda = torch.device("cuda", 0)
    trainer.stages = [s.to(cuda) for s in trainer.stages]
    trainer.devices = [cuda, cuda]
    x, y = x.to(cuda), y.to(cuda)
    events = pd.DataFrame(align(trace_step(lambda: trainer.step(x, y),
                                           trainer.timeline_stages(), trainer.devices).events))
    assert len(events) == 16 and set(events.device) == {"cuda:0"}
    assert (events.end_s >= events.start_s).all() and events.start_s.min() == 0.0
    at = events.set_index(["stage", "microbatch", "phase"])
    assert at.loc[(0, 0, "fwd"), "end_s"] <= at.loc[(1, 0, "fwd"), "start_s"]


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_run_writes_timeline_csv_and_bubble_columns_for_pipelined_cases_only(tmp_path, capsys):
    proc = in_process(
        capsys, "run", "--profile", "smoke", "--rig", "cpu", "--strategies",
        "single,pipeline,gpipe,zbv", "--models", "resnet-tiny", "--image-sizes", "32",
        "--batch-sizes", "4", "--split-sizes", "2", "--warmup-steps", "1", "--timed-steps", "2",
        "--quiet", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = run_dirs_in(tmp_path)  # not its latest-run link
    timeline = pd.read_csv(run_dir / "timeline.csv")
    assert (timeline.run_id == run_dir.name).all()
    cases = {c.split("_")[0]: t for c, t in timeline.groupby("case_id")}
    assert sorted(cases) == ["gpipe", "pipeline", "zbv"]  # no single
    # stages x micro-batches x phases; zbv: 4 stages, its backward split in input and weight
    sizes = {"pipeline": 2 * 2 * 2, "gpipe": 2 * 2 * 2, "zbv": 4 * 2 * 3}
    for name, events in cases.items():
        assert len(events) == sizes[name], name
        assert events.start_s.min() == 0.0
    # One process over two device slots: the rows tell them apart.
    pipe = cases["pipeline"]
    assert set(pipe["rank"]) == {0} and set(zip(pipe.stage, pipe.device)) == {(0, "cpu:0"),
                                                                             (1, "cpu:1")}
    zbv = cases["zbv"]  # V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert set(zip(zbv["rank"], zbv.stage, zbv.device)) == {
        (0, 0, "cpu:0"), (0, 3, "cpu:0"), (1, 1, "cpu:1"), (1, 2, "cpu:1")}
    assert (zbv.groupby(["stage", "microbatch"]).phase.apply(set)
            == {"fwd", "bwd", "wgt"}).all()
    rows = pd.read_csv(run_dir / "cases.csv").set_index("strategy")
    assert rows.loc["single", ["bubble_measured_pct", "bubble_theory_pct",
                               "traced_step_s"]].isna().all()
    theory = {"pipeline": 100 / 3, "gpipe": 100 / 3, "zbv": 100 / 13}  # p=2, m=2
    for name, pct in theory.items():
        row = rows.loc[name]
        assert row.bubble_theory_pct == pytest.approx(pct)
        assert 0 <= row.bubble_measured_pct < 100
        # The timeline lies within the traced step (ranks leave its barrier about together).
        assert 0 < row.timeline_span_s <= 1.05 * row.traced_step_s
        # The traced step against the median of the timed ones (a loose band: 2 tiny steps).
        assert row.traced_vs_median_pct == pytest.approx(
            100 * (row.traced_step_s / row.step_time_s_median - 1))
        assert -60 < row.traced_vs_median_pct < 150
    # gpipe: one stage per rank; on one time axis, stage 1 gets each micro-batch after
    # stage 0 sent it, and stage 0 its gradient after stage 1 computed it.
    gpipe = cases["gpipe"].set_index(["stage", "microbatch", "phase"])
    assert set(gpipe["rank"]) == {0, 1}
    for m in range(2):
        assert gpipe.loc[(0, m, "fwd"), "end_s"] <= gpipe.loc[(1, m, "fwd"), "start_s"]
        assert gpipe.loc[(1, m, "bwd"), "end_s"] <= gpipe.loc[(0, m, "bwd"), "start_s"]
