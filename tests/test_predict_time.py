"""The step-time predictor (``prediction.step_time``, ``prediction.pipeline_time``) driven by
hand-made calibrations, against the closed forms; the calibration's sizes and
combination (``prediction.calibration``), its files (``prediction.calibration_file``) and the run's
predictor (``prediction.predictor``)."""

from __future__ import annotations

import re

import pytest

from bench_lib.analysis import bound
from bench_lib.analysis.collective_fits import CollectiveFit, Collectives
from bench_lib.analysis.step_parts import FRESH_COPY_BYTES, fsdp_copied_bytes, fsdp_copies_s
from bench_lib.prediction.calibration import (
    CalibrationKey,
    CalibrationSpec,
    calibration_from_ranks,
    sizes_for,
)
from bench_lib.prediction.calibration_data import BatchCosts, Calibration, Sizes
from bench_lib.prediction.case_shape import Shape, shape_of
from bench_lib.prediction.pipeline_time import PipelineParts, stage_passes
from bench_lib.prediction.schedule_orders import schedule_actions
from bench_lib.prediction.step_time import (
    calibration_sizes,
    error_pct,
    predict,
    predict_case,
    speedup,
)
from bench_lib.sweep.cases import new_case
from bench_lib.workloads.sizes import parameter_bytes

OPT = 0.01  # the optimizer step, seconds
FIT = CollectiveFit((1,), (1.0,), alpha_s=0.002, beta_bytes_s=1e8, busbw_gb_s=1.0)


def blocks_cal(forward, backward, batch=4, step=None, devices=2):
    """A calibration whose together costs at ``batch`` are the given blocks; the step adds
    up to them plus the optimizer's (no glue) unless ``step`` says otherwise."""
    whole = sum(forward) + sum(backward) + OPT if step is None else step
    return Calibration(OPT, {}, {batch: BatchCosts(whole, tuple(forward), tuple(backward))},
                       devices)


def fixed(cuts):
    return lambda costs, stages: cuts


@pytest.mark.parametrize(("name", "p", "m"), [("gpipe", 2, 4), ("1f1b", 2, 4),
                                              ("1f1b", 4, 8), ("interleaved-1f1b", 2, 4)])
def test_balanced_pipelines_predict_the_closed_form(name, p, m):
    """Blocks of equal forward f and backward 2f, cut evenly: the textbook step, plus each
    rank's share of the optimizer step."""
    v = 2 if name.startswith("interleaved") else 1
    stages = p * v
    f, per_stage = 0.01, 3  # 3 blocks a stage
    fwd, bwd = [f] * (stages * per_stage), [2 * f] * (stages * per_stage)
    cuts = [per_stage * s for s in range(1, stages)]
    orders = schedule_actions(name, p, m)
    found = predict(Shape(name, 4 * m, p, 4, device_batch=4), blocks_cal(fwd, bwd),
                    pipeline=PipelineParts(orders, fixed(cuts)))
    closed = bound.closed_form(name, p, m, per_stage * f, per_stage * 2 * f)
    assert isinstance(found, bound.Bound)
    assert found.step_s == pytest.approx(closed + OPT / p)
    assert found.other_s == pytest.approx(OPT / p)


def test_the_balanced_partition_cuts_where_the_calibrated_blocks_balance():
    """The cutter gets each block's forward + backward; with partition's own min-max cut
    an uneven model is cut where the stages balance, and the step is the closed form's."""
    from bench_lib.strategies.partition import min_max_cuts

    fwd = [0.01, 0.03, 0.02, 0.02]  # stage costs (x3 with backward) 0.12 | 0.12
    bwd = [2 * v for v in fwd]
    found = predict(Shape("1f1b", 16, 2, 4, device_batch=4), blocks_cal(fwd, bwd),
                    pipeline=PipelineParts(schedule_actions("1f1b", 2, 4),
                                           lambda costs, stages: min_max_cuts(list(costs), 2)))
    assert isinstance(found, bound.Bound) and found.formula.endswith("cut 2")
    assert found.step_s == pytest.approx(bound.closed_form("1f1b", 2, 4, 0.04, 0.08) + OPT / 2)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_unbalanced_gpipe_is_the_flow_shop_with_transfers(m):
    """Stages (f, b) = (0.02, 0.04) and (0.01, 0.02), a transfer of c each way: GPipe's
    exact makespan sum(f+b) + (m-1)(max f + max b) + 2c (``analysis.bound``)."""
    fwd, bwd, c = [0.02, 0.01], [0.04, 0.02], 0.003
    found = predict(Shape("gpipe", 4 * m, 2, 4, device_batch=4), blocks_cal(fwd, bwd),
                    pipeline=PipelineParts(schedule_actions("gpipe", 2, m), fixed([1]),
                                           lambda cuts: [c]))
    expected = 0.09 + (m - 1) * (0.02 + 0.04) + 2 * c
    assert isinstance(found, bound.Bound)
    assert found.step_s == pytest.approx(expected + OPT / 2)
    assert found.comm_s == pytest.approx(2 * c)


def test_stage_passes_scale_the_blocks_to_the_measured_step():
    """Blocks timed apart miss the step's glue: scaled so that they add up to the step less
    the optimizer's; zero-bubble schedules get half the backward as weight gradient."""
    costs = BatchCosts(0.5 + OPT, (0.05, 0.05, 0.1), (0.1, 0.1, 0.0))  # blocks: 0.4
    times = stage_passes(costs, [2], OPT)
    assert times == pytest.approx({(0, "fwd"): 0.125, (0, "bwd"): 0.25,
                                   (1, "fwd"): 0.125, (1, "bwd"): 0.0})
    split = stage_passes(costs, [1], OPT, zero_bubble=True)
    assert split[0, "bwd"] == split[0, "wgt"] == pytest.approx(0.0625)


def test_ddp_without_overlap_adds_the_all_reduce_and_with_overlap_hides_it():
    """A cpu rig: the ranks' step together plus DDP's bucketed all-reduce; GPUs: the
    larger of the two (``data_parallel_bound``)."""
    grads = 60 * 2**20
    comm = bound.ddp_comm_s(grads, FIT)  # 1 MiB bucket + 3 of 25 MiB: 4 calls
    assert comm == pytest.approx(4 * 0.002 + grads / 1e8)
    cal = Calibration(OPT, {}, {8: BatchCosts(0.3)}, 2)
    coll = Collectives({"all_reduce": FIT}, "gloo", 2)
    cpu = predict(Shape("ddp", 16, 2, device_batch=8), cal, coll, grads)
    gpu = predict(Shape("ddp", 16, 2, overlap=True, device_batch=8), cal, coll, grads)
    assert isinstance(cpu, bound.Bound) and isinstance(gpu, bound.Bound)
    assert cpu.step_s == pytest.approx(0.3 + comm)
    assert gpu.step_s == pytest.approx(max(0.3, comm))
    assert gpu.no_overlap_s == pytest.approx(cpu.step_s)
    slow = Calibration(OPT, {}, {8: BatchCosts(0.1)}, 2)  # comm 0.637 s exceeds compute
    hidden = predict(Shape("ddp", 16, 2, overlap=True, device_batch=8), slow, coll, grads)
    assert isinstance(hidden, bound.Bound) and hidden.comm_s == pytest.approx(comm - 0.1)
    half = predict(Shape("ddp", 16, 2, hook="fp16", device_batch=8), cal, coll, grads)
    assert isinstance(half, bound.Bound)
    assert half.step_s == pytest.approx(0.3 + bound.ddp_comm_s(grads / 2, FIT))
    assert "PowerSGD" in str(predict(Shape("ddp", 16, 2, hook="powersgd", device_batch=8), cal,
                                     coll, grads))
    assert "no collective" in str(predict(Shape("ddp", 16, 2, device_batch=8), cal, None, grads))


def test_fsdp_steps_its_shard_and_pays_its_gathers_scatters_and_copies():
    """Per unit of b bytes on 2 devices: 3 copies of b and 3 of b/2 (gathered forward and
    backward, its gradient reduce-scattered); the root's 2 MiB: 2 of each; all at the
    calibrated rate of a copy into fresh pages."""
    mib = 2**20
    units, grads = (10 * mib, 20 * mib), 32 * mib
    copied = 3 * (30 * mib + 15 * mib) + 2 * (2 * mib + mib)
    assert fsdp_copied_bytes(units, 2 * mib, 2) == copied
    copies = {FRESH_COPY_BYTES: FRESH_COPY_BYTES / 1e9}  # 1 GB/s
    assert fsdp_copies_s(units, 2 * mib, 2, copies) == pytest.approx(copied / 1e9)
    cal = Calibration(OPT, {}, {8: BatchCosts(0.3)}, 2, copies=copies)
    coll = Collectives({"all_gather": FIT, "reduce_scatter": FIT}, "gloo", 2)
    found = predict(Shape("fsdp", 16, 2, device_batch=8), cal, coll, grads, units)
    comm = bound.fsdp_comm_s(units, grads - sum(units), FIT, FIT)
    assert isinstance(found, bound.Bound)
    assert found.step_s == pytest.approx(0.3 - OPT + OPT / 2 + comm + copied / 1e9)
    assert (found.comm_s, found.other_s) == (pytest.approx(comm), pytest.approx(copied / 1e9))
    gpu = predict(Shape("fsdp", 16, 2, overlap=True, device_batch=8), cal, coll, grads, units)
    assert isinstance(gpu, bound.Bound)  # the copies are not hidden by the overlap
    assert gpu.step_s == pytest.approx(max(0.3 - OPT + OPT / 2, comm) + copied / 1e9)
    # A calibration without the copy (one made before it, or for no fsdp case) says so.
    old = Calibration(OPT, {}, {8: BatchCosts(0.3)}, 2)
    assert "no copy into a fresh buffer" in str(predict(Shape("fsdp", 16, 2, device_batch=8), old,
                                                        coll, grads, units))
    assert not old.covers(Sizes(copies=frozenset(copies)))


def test_one_process_strategies_from_the_alone_steps():
    """single and mp at the batch; accum and the cpu pipeline run their micro-batches in
    turn and step the optimizer once."""
    cal = Calibration(OPT, {16: BatchCosts(0.26), 4: BatchCosts(0.175)}, {}, 2)
    single = predict(Shape("single", 16, device_batch=16), cal)
    mp = predict(Shape("mp", 16, 2, serial=True, device_batch=16), cal)
    accum = predict(Shape("accum", 16, 1, 4, device_batch=4), cal)
    pipe = predict(Shape("pipeline", 16, 2, 4, serial=True, device_batch=4), cal)
    assert isinstance(single, bound.Bound) and single.step_s == pytest.approx(0.26)
    assert isinstance(mp, bound.Bound) and mp.step_s == pytest.approx(0.26)
    for found in (accum, pipe):
        assert isinstance(found, bound.Bound)
        assert found.step_s == pytest.approx(4 * (0.175 - OPT) + OPT)
    assert predict(Shape("single", 32, device_batch=32), cal) == (
        "no prediction: the calibration has no step at batch 32")
    assert predict(Shape("dp", 16, 2, device_batch=8), cal) == (
        "no prediction: no model of dp's step")
    assert predict(Shape("single", 16, device_batch=16), None) == "no prediction: no calibration"


def test_speedup_and_error_as_the_measured_ones_are_made():
    assert speedup(0.5, 16, 1.0, 16) == pytest.approx(2.0)  # strong: single over case
    assert speedup(0.5, 32, 0.5, 16) == pytest.approx(2.0)  # weak: 32 images in single's 16
    assert error_pct(1.1, 1.0) == pytest.approx(10.0)
    assert error_pct(0.8, 1.0) == pytest.approx(-20.0)


def test_calibration_sizes_are_what_each_strategy_reads():
    assert calibration_sizes(Shape("single", 16, device_batch=16)) == Sizes(frozenset({16}))
    # ddp and the pipelined strategies read single alone at the device batch too: the
    # predicted parts price the smaller batch per device with it.
    assert calibration_sizes(Shape("ddp", 16, 2, device_batch=8)) == Sizes(
        frozenset({16, 8}), frozenset({8}))
    # b = 32 / 2 = 16: single's own batch
    weak = Shape("ddp", 32, 2, workload_batch=16, device_batch=16)
    assert calibration_sizes(weak) == Sizes(frozenset({16}), frozenset({16}))
    assert calibration_sizes(Shape("accum", 16, 1, 4, device_batch=4)) == Sizes(frozenset({16, 4}))
    assert calibration_sizes(Shape("1f1b", 16, 2, 4, device_batch=4)) == Sizes(
        frozenset({16, 4}), frozenset({4}), frozenset({4}))
    assert calibration_sizes(Shape("mp", 32, 2, workload_batch=16, serial=True,
                                   device_batch=32)) == Sizes(frozenset({16, 32}))


def test_a_sweeps_sizes_per_workload(cpu_rig):
    """Strong and weak cases of one image size share a calibration; another size has its
    own; a case that will not run asks for nothing."""
    cases = [new_case(cpu_rig, s, "resnet-tiny", 32, 16, split_size=4, scaling=sc)
             for s in ("single", "ddp", "1f1b", "pipeline") for sc in ("strong", "weak")]
    cases.append(new_case(cpu_rig, "single", "resnet-tiny", 48, 16))
    cases.append(new_case(cpu_rig, "dp", "resnet-tiny", 48, 16))  # unsupported on cpu
    assert cases[-1].status == "unsupported"
    found = sizes_for(cases, cpu_rig)
    # alone: single's 16, the pipelines' micro-batch 4, strong ddp's device batch 8 (weak
    # ddp's is 32 / 2 = 16); together: ddp's 8 and 16, the pipelined schedule's 4.
    assert found == {
        CalibrationKey("resnet-tiny", 32, "fp32", "ce"): Sizes(
            frozenset({16, 8, 4}), frozenset({8, 16, 4}), frozenset({4})),
        CalibrationKey("resnet-tiny", 48, "fp32", "ce"): Sizes(frozenset({16}))}
    # fsdp adds its copy into fresh pages.
    fsdp = new_case(cpu_rig, "fsdp", "resnet-tiny", 48, 16)
    assert sizes_for([fsdp], cpu_rig)[CalibrationKey.of(fsdp)].copies == {FRESH_COPY_BYTES}


def test_shape_of_reads_the_rig(cpu_rig):
    pipe = new_case(cpu_rig, "pipeline", "resnet-tiny", 32, 16, split_size=4)
    # Each of its 2 devices steps its own stage's half of the optimizer.
    assert shape_of(pipe, cpu_rig) == Shape("pipeline", 16, 2, 4, 16, serial=True,
                                            optimizer_share=0.5, device_batch=4)
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 16, scaling="weak")
    assert shape_of(ddp, cpu_rig) == Shape("ddp", 32, 2, None, 16, device_batch=16)


def test_predict_case_prices_a_real_models_collectives_and_cut(cpu_rig):
    """A sweep's cases through ``predict_case``: ddp's gradient bytes are the model's; a
    balanced 1F1B is cut by partition's min-max over the calibrated blocks, its transfers
    at the send/recv fit of the boundary's bytes."""
    from bench_lib.workloads import Workload, blocks
    from bench_lib.workloads.sizes import boundary_bytes

    n = len(blocks(Workload("resnet-tiny", 32, 4).build_model()))
    fwd = tuple(0.001 * (i + 1) for i in range(n))
    bwd = tuple(2 * v for v in fwd)
    cal = Calibration(OPT, {16: BatchCosts(0.2)},
                      {8: BatchCosts(0.15), 4: BatchCosts(sum(fwd) + sum(bwd) + OPT, fwd, bwd)},
                      2)
    coll = Collectives({"all_reduce": FIT, "send_recv": FIT}, "gloo", 2)
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 16)
    found = predict_case(ddp, cpu_rig, cal, coll)
    grads = parameter_bytes("resnet-tiny", 32)[0]
    assert isinstance(found, bound.Bound)
    assert found.step_s == pytest.approx(0.15 + bound.ddp_comm_s(grads, FIT))
    case = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 16, split_size=4, partition="balanced")
    found = predict_case(case, cpu_rig, cal, coll)
    assert isinstance(found, bound.Bound)
    cut = int(found.formula.rsplit(" ", 1)[1])
    costs = [f + b for f, b in zip(fwd, bwd)]
    assert max(sum(costs[:cut]), sum(costs[cut:])) == pytest.approx(
        min(max(sum(costs[:k]), sum(costs[k:])) for k in range(1, n)))
    (edge,) = boundary_bytes("resnet-tiny", 32, 4, (cut,))
    assert found.comm_s > 0 and found.step_s == pytest.approx(bound.pipeline_bound(
        "1f1b", schedule_actions("1f1b", 2, 4), stage_passes(cal.together[4], [cut], OPT),
        [FIT.time_s(edge)], OPT / 2).step_s)
    compiled = new_case(cpu_rig, "single", "resnet-tiny", 32, 16, compile=True)
    assert "torch.compile" in str(predict_case(compiled, cpu_rig, cal, coll))


def test_calibration_round_trips_and_ranks_combine(tmp_path, cpu_rig):
    """Rank 0's alone figures; together, the slowest rank's step and each block's mean."""
    r0 = {"optimizer_s": OPT, "alone": {"16": BatchCosts(0.26).as_dict()},
          "together": {"4": BatchCosts(0.2, (0.01, 0.02), (0.02, 0.04)).as_dict()},
          "copies": {"4096": 0.002}}
    r1 = {"alone": {}, "together": {"4": BatchCosts(0.22, (0.03, 0.02), (0.04, 0.04)).as_dict()},
          "copies": {"4096": 0.003}}
    cal = calibration_from_ranks([r0, r1], 3.0)
    assert cal.copies == {4096: 0.003}  # the slowest rank's
    assert cal.alone == {16: BatchCosts(0.26)}
    assert cal.together[4].step_s == 0.22
    assert cal.together[4].forward_s == pytest.approx((0.02, 0.02))
    assert cal.together[4].backward_s == pytest.approx((0.03, 0.04))
    assert (cal.devices, cal.wall_s) == (2, 3.0)
    assert Calibration.from_dict(cal.as_dict()) == cal
    spec = CalibrationSpec(CalibrationKey("resnet-tiny", 32, "fp32", "ce"), cpu_rig, 2,
                           Sizes(frozenset({16}), frozenset({4}), frozenset({4}),
                                 frozenset({4096})))
    spec.write(tmp_path / "spec.json")
    assert CalibrationSpec.read(tmp_path / "spec.json") == spec


def test_a_calibration_serves_the_sizes_it_measured():
    cal = Calibration(OPT, {16: BatchCosts(0.2)},
                      {8: BatchCosts(0.1), 4: BatchCosts(0.06, (0.01,), (0.02,))}, 2)
    assert cal.covers(Sizes(frozenset({16}), frozenset({8}), frozenset({4})))
    assert cal.covers(Sizes())
    assert not cal.covers(Sizes(frozenset({32})))  # an alone size it did not time
    assert not cal.covers(Sizes(together=frozenset({2})))
    assert not cal.covers(Sizes(blocks=frozenset({8})))  # 8: its step, not its blocks


def _stored(tmp_path, cpu_rig, cal, hardware=None):
    """A run folder holding ``cal`` as resnet-tiny 32 px's calibration, stamped with
    ``hardware`` (default: this machine's)."""
    from bench_lib.prediction.calibration_file import hardware_id, write_calibrations
    from bench_lib.results.schema import CALIBRATION_FILE

    folder = tmp_path / "earlier"
    folder.mkdir()
    write_calibrations(folder / CALIBRATION_FILE,
                       {CalibrationKey("resnet-tiny", 32, "fp32", "ce"): cal},
                       hardware_id(cpu_rig) if hardware is None else hardware)
    return folder


def test_a_reused_calibration_is_checked_then_predicts_without_a_launch(
        tmp_path, cpu_rig, monkeypatch):
    from bench_lib.prediction.calibration_file import given_calibrations
    from bench_lib.prediction.predictor import Predictor
    from bench_lib.results.schema import CALIBRATION_FILE

    single = new_case(cpu_rig, "single", "resnet-tiny", 32, 16)
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 16)
    # ddp at 16 on 2 reads single alone at its device batch 8 as well as together.
    cal = Calibration(OPT, {16: BatchCosts(0.2), 8: BatchCosts(0.11)}, {8: BatchCosts(0.12)},
                      2)
    folder = _stored(tmp_path, cpu_rig, cal)
    source, found = given_calibrations(folder, cpu_rig)  # the folder or its file
    assert source == folder / CALIBRATION_FILE and list(found.values()) == [cal]
    assert given_calibrations(source, cpu_rig) == (source, found)
    launched = []
    monkeypatch.setattr("bench_lib.prediction.predictor.calibrate",
                        lambda key, *a, **k: launched.append(key) or "not launched")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    predictor = Predictor([single, ddp], cpu_rig, run_dir, None, given=(source, found))
    assert predictor.reused == [CalibrationKey.of(single)]
    step, alone = predictor.predict(single)
    assert isinstance(step, bound.Bound) and step.step_s == pytest.approx(0.2)
    assert isinstance(alone, bound.Bound) and alone.step_s == pytest.approx(0.2)
    assert not launched
    import json

    written = json.loads((run_dir / CALIBRATION_FILE).read_text())
    assert written["reused_from"] == str(source) and written["hardware"]
    # A sweep that needs a size the file lacks calibrates that workload again.
    wide = new_case(cpu_rig, "single", "resnet-tiny", 32, 32)
    again = Predictor([wide], cpu_rig, tmp_path, None, given=(source, found))
    assert not again.reused
    assert again.predict(wide)[0] == "no prediction: not launched" and len(launched) == 1


def test_the_calibration_file_keeps_the_runs_collectives_for_a_run_that_reuses_it(
        tmp_path, cpu_rig):
    """calibration.json records the collectives its run measured beside the calibrations
    (they price ddp's predictions), and ``given_collectives`` reads them back for a run
    given the file; a run that measured none records none."""
    from bench_lib.analysis.collective_fits import OPS, CollectiveFit, Collectives
    from bench_lib.prediction.calibration_file import given_calibrations, given_collectives
    from bench_lib.prediction.predictor import Predictor

    cal = Calibration(OPT, {16: BatchCosts(0.2), 8: BatchCosts(0.11)}, {8: BatchCosts(0.12)},
                      2)
    given = given_calibrations(_stored(tmp_path, cpu_rig, cal), cpu_rig)
    assert given_collectives(given) is None and given_collectives(None) is None
    fits = {op: CollectiveFit.of(op, 2, [2**20, 2**22], [0.01, 0.03]) for op in OPS}
    measured = Collectives(fits, "gloo", 2, wall_s=3.9, path="gloo on host memory")
    ddp = new_case(cpu_rig, "ddp", "resnet-tiny", 32, 16)
    for name, collectives in (("measured", measured), ("none", Collectives(skipped="one"))):
        run_dir = tmp_path / name
        run_dir.mkdir()
        Predictor([ddp], cpu_rig, run_dir, collectives, given=given)
        again = given_calibrations(run_dir, cpu_rig)
        assert again[1] == given[1]
        found = given_collectives(again)
        assert found == (measured.as_dict() if name == "measured" else None), name


@pytest.mark.parametrize(("content", "message"), [
    (None, "no calibration.json there"),
    ("{", "unreadable (JSONDecodeError"),
    ("other", "measured on other hardware (abc, this machine's rig cpu:2x1t is "),
    ("devices", "timed on 1 device(s), this rig has 2"),
])
def test_a_calibration_from_elsewhere_is_refused(tmp_path, cpu_rig, content, message):
    from bench_lib.prediction.calibration_file import given_calibrations
    from bench_lib.results.schema import CALIBRATION_FILE

    cal = Calibration(OPT, {16: BatchCosts(0.2)}, {}, 1 if content == "devices" else 2)
    if content is None:
        folder = tmp_path
    elif content == "{":
        folder = tmp_path
        (folder / CALIBRATION_FILE).write_text("{")
    else:
        folder = _stored(tmp_path, cpu_rig, cal, "abc" if content == "other" else None)
    with pytest.raises(ValueError, match=re.escape(message)):
        given_calibrations(folder, cpu_rig)


@pytest.mark.parametrize(("argv", "message"), [
    (["--calibration", "MISSING"], "no calibration.json there"),
    (["--resume", "RUN", "--predict"], "--resume predicts as the run folder's profile says"),
])
def test_the_command_line_refuses_a_calibration_it_cannot_use(tmp_path, capsys, argv, message):
    from bench_lib import commands, exit_codes

    argv = [str(tmp_path / a) if a in ("MISSING", "RUN") else a for a in argv]
    code = commands.main(["run", "--profile", "ci", "--rig", "cpu", *argv,
                     "--out", str(tmp_path / "out")])
    assert code == exit_codes.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_run_predict_then_a_run_that_reuses_its_calibration(tmp_path, capsys, shared_run):
    """--predict turns predictions on in a real run (``tests.conftest.SHARED_RUN``);
    --calibration takes its calibration and launches none."""
    import json

    from bench_lib.results.read import read_cases, run_dirs_in
    from tests.conftest import in_process

    sweep = ["--profile", "smoke", "--rig", "cpu", "--models", "resnet-tiny", "--image-sizes",
             "32", "--batch-sizes", "4", "--strategies", "single,ddp", "--warmup-steps", "1",
             "--timed-steps", "2"]
    first = shared_run  # the same sweep, with --predict (and two launches, --report)
    assert first.returncode == 0, first.stderr
    assert "calibrated resnet-tiny 32 px fp32 in " in first.stderr
    a = first.run_dir
    assert json.loads((a / "env.json").read_text())["profile"]["predict_time"] is True
    assert read_cases(a).step_time_s_predicted.notna().all()
    second = in_process(capsys, "run", *sweep, "--calibration", str(a), "--out",
                        str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert "calibrated " not in second.stderr
    assert f"calibration: 1 workload(s) from {a / 'calibration.json'}" in second.stderr
    (b,) = run_dirs_in(tmp_path / "b")
    assert read_cases(b).step_time_s_predicted.notna().all()
    assert json.loads((a / "duty.json").read_text())["calibration_s"] > 0
    assert json.loads((b / "duty.json").read_text())["calibration_s"] == 0
    # ddp's collectives come with the calibration: measured by the first run, not again.
    env_a, env_b = (json.loads((d / "env.json").read_text()) for d in (a, b))
    assert "measuring collectives" not in second.stderr
    assert env_b["collectives"] == env_a["collectives"] and env_a["collectives"]["ops"]
    assert env_b["collectives_reused_from"] == str(a / "calibration.json")
    assert "collectives_reused_from" not in env_a


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_dry_run_predicts_each_case_and_each_workloads_best_and_writes_nothing(
        tmp_path, capsys):
    from bench_lib import commands

    profile = tmp_path / "p.toml"
    profile.write_text('strategies = ["single", "ddp", "1f1b", "dp"]\n'
                       'models = ["resnet-tiny"]\nimage_sizes = [32]\nbatch_sizes = [8]\n'
                       'split_sizes = [2]\npartitions = ["balanced"]\n')
    code = commands.main(["run", "--rig", "cpu", "--profile", str(profile), "--dry-run",
                     "--predict", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "calibrated resnet-tiny 32 px fp32 in " in err
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("single_", "ddp_", "1f1b_", "dp_"))}
    for case in ("single_resnet-tiny_img32_b8_s-_fp32", "ddp_resnet-tiny_img32_b8_s-_fp32",
                 "1f1b_resnet-tiny_img32_b8_s2_fp32_pbalanced"):
        will, step, gain = rows[case][1:4]
        assert will == "run" and float(step) > 0 and gain.endswith("x")
    assert rows["single_resnet-tiny_img32_b8_s-_fp32"][3] == "1.00x"
    assert rows["dp_resnet-tiny_img32_b8_s-_fp32"][1] == "unsupported"
    assert "predicted best for resnet-tiny 32 px batch 8 (strong): " in out
    assert not (tmp_path / "out").exists()


def _row(strategy, medians, predicted_s, batch=16, speedup_predicted=None, **extra):
    """A cases.csv row of one workload (resnet50 64 px batch 16, strong) with its launch
    medians and its prediction."""
    import statistics as st

    median = st.geometric_mean(medians)
    return {"status": "ok", "strategy": strategy, "model": "resnet50", "image_size": 64,
            "batch_size": batch, "world_size": 1 if strategy == "single" else 2,
            "precision": "fp32", "scaling": "strong", "run_id": "r",
            "launch_medians_s": ";".join(f"{m:.6f}" for m in medians),
            "step_time_s_median": median, "throughput_img_s": batch / median,
            "step_time_s_predicted": predicted_s,
            "prediction_error_pct": error_pct(predicted_s, median),
            "speedup_predicted": speedup_predicted, **extra}


def test_the_score_gives_median_and_worst_error_and_the_best_match():
    from bench_lib.report.time_prediction import matches, score_lines

    single = _row("single", [0.26, 0.27, 0.25], 0.26, speedup_predicted=1.0,
                  speedup_vs_single=1.0)
    ddp = _row("ddp", [0.40, 0.41, 0.39], 0.36, speedup_predicted=0.72,
               speedup_vs_single=0.65)  # -10%
    fsdp = _row("fsdp", [0.70, 0.72, 0.71], 0.55, speedup_predicted=0.47)  # -22.5%
    lines = score_lines([single, ddp, fsdp])
    assert lines[0].startswith("step time predicted before launch: median |error| 10.0%, "
                               "worst 22.5% (fsdp 64 px) over 3 cases")
    assert lines[1] == ("predicted best = measured best (or tied with it) in 1 of 1 "
                        "workloads")
    # Predicted ddp best, single measured clearly faster: a miss, named.
    wrong = dict(ddp, speedup_predicted=1.2)
    (m,) = matches([single, wrong, fsdp])
    assert not m.hit and m.predicted is wrong and m.measured is single
    assert "missed: resnet50 64 px batch 16 (strong): predicted ddp" in score_lines(
        [single, wrong, fsdp])[1]
    # A predicted best within the measured best's tie (its paired interval holds 1): a hit.
    close = _row("ddp", [0.25, 0.28, 0.255], 0.2, speedup_predicted=1.3)
    (m,) = matches([single, close])
    assert m.hit and m.tied and m.predicted is close
    assert score_lines([dict(single, prediction_error_pct=None)]) == []
    assert score_lines([dict(single, batch_curve_of=32)]) == []  # a curve point: not scored


def test_the_figure_and_table_of_predicted_against_measured():
    import pandas as pd

    from bench_lib.report.time_prediction import fig_time_prediction, score_html

    rows = [_row("single", [0.26, 0.27, 0.25], 0.26, speedup_predicted=1.0,
                 prediction_note="single: compute 0.26 s"),
            _row("ddp", [0.40, 0.41, 0.39], 0.36, speedup_predicted=0.72,
                 prediction_note="ddp (collectives not overlapped)")]
    cases = pd.DataFrame(rows).assign(case_id=["single_x", "ddp_x"])
    fig = fig_time_prediction(cases)
    assert fig is not None and "median |error|" in fig.axes[0].get_title()
    page = score_html(cases)
    assert page.index("ddp_x") < page.index("single_x")  # the largest error first
    assert "ddp (collectives not overlapped)" in page and "-10.0%" in page
    assert fig_time_prediction(cases.drop(columns="step_time_s_predicted")) is None


def test_compare_notes_a_prediction_error_that_grew_beyond_ten_points(tmp_path):
    """A model regression is a note beside the verdict, never a failure."""
    from bench_lib import exit_codes
    from bench_lib.compare import verdicts as cmp
    from bench_lib.compare.output import notes, prediction_regressions
    from bench_lib.compare.runs import Run

    def run(errors):
        return Run(tmp_path, {}, {cid: {"prediction_error_pct": e, "status": "ok"}
                                      for cid, e in errors.items()}, {})

    base = run({"ddp": 4.1, "fsdp": -15.0, "mp": 2.0, "single": float("nan")})
    cand = run({"ddp": -18.9, "fsdp": -24.0, "mp": None, "single": 50.0})
    results = [cmp.CaseResult(cid, cid, 1.0, 1.0) for cid in ("ddp", "fsdp", "mp", "single")]
    assert prediction_regressions(results, base, cand) == ["ddp: +4.1% -> -18.9%"]
    said = notes(results, base, cand)
    assert any("the step-time prediction got worse" in n and "ddp: +4.1% -> -18.9%" in n
               for n in said)
    assert cmp.exit_code(results) == exit_codes.EXIT_OK


def test_a_balanced_pipelines_first_launch_takes_its_cut_from_the_calibration(cpu_rig):
    """The cut partition's min-max picks from the calibrated blocks at the case's
    micro-batch, as a label the case runs; nothing where the calibration lacks that size,
    or the partition is not ``balanced`` (or already given)."""
    from bench_lib.prediction.pipeline_time import calibrated_cut
    from bench_lib.strategies.partition import min_max_cuts
    from bench_lib.workloads import Workload, blocks

    n = len(blocks(Workload("resnet-tiny", 32, 4).build_model()))
    fwd = tuple(0.001 * (i + 1) for i in range(n))
    cal = Calibration(OPT, {}, {4: BatchCosts(1.0, fwd, fwd)}, 2)
    case = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 16, split_size=4, partition="balanced")
    expected = min_max_cuts([2 * f for f in fwd], 2)
    assert calibrated_cut(case, cpu_rig, cal) == f"balanced:{expected[0]}"
    other = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 16, split_size=2,
                     partition="balanced")
    tutorial = new_case(cpu_rig, "1f1b", "resnet-tiny", 32, 16, split_size=4)
    mp = new_case(cpu_rig, "mp", "resnet-tiny", 32, 4, partition="balanced")
    assert [calibrated_cut(c, cpu_rig, cal) for c in (other, tutorial, mp)] == ["", "", ""]
    assert calibrated_cut(case, cpu_rig, None) == ""
