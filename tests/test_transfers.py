"""Transfers priced as they happen: one process's ``.to()`` between two GPUs (mp, pipeline) at
the device copy's fit, measured (``measure.device_copy``) or assumed and said so; torch's
pipelining schedules between processes at the send/recv fit; a cpu rig's ``.to()`` no copy
at all; and the activation crossing a cut at the dtype that really crosses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench_lib.analysis import bound
from bench_lib.analysis.collective_fits import (
    ASSUMED_COPY_NOTE,
    ASSUMED_DEVICE_COPY,
    OPS,
    CollectiveFit,
    Collectives,
    device_copy_fit,
)
from bench_lib.launch.protocol import CaseOutcome
from bench_lib.measure import device_copy
from bench_lib.prediction.calibration_data import BatchCosts, Calibration
from bench_lib.prediction.pipeline_time import pipeline_parts
from bench_lib.prediction.step_time import predict_case
from bench_lib.rig import Rig
from bench_lib.rows.bound_columns import bound_columns
from bench_lib.sweep.cases import new_case
from bench_lib.workloads import Workload, split_stages
from bench_lib.workloads.blocks import tutorial_cut
from bench_lib.workloads.sizes import boundary_bytes
from tests.test_bound import traced

SEND = CollectiveFit((1,), (1.0,), alpha_s=0.002, beta_bytes_s=1e8, busbw_gb_s=0.1)
"""A slow send/recv: gloo's or NCCL's between two processes."""
COPY = CollectiveFit((1,), (1.0,), alpha_s=20e-6, beta_bytes_s=40e9, busbw_gb_s=40.0)
"""A fast copy: one process's ``.to()`` from one GPU to the other."""
TWO_GPUS = Rig("cuda", 2)
OUTCOME = CaseOutcome("ok", step_times_s=[1.0], timeline=traced([(0, 0, 2, 4), (1, 0, 1, 2)],
                                                                 1, 0.1),
                      traced_step_s=1.0, partition="tutorial:3")
"""mp's traced step on resnet-tiny: its two stages, one process, cut at block 3."""


@pytest.mark.parametrize("model,image_size", [("resnet-tiny", 32), ("resnet50", 32),
                                              ("toy", 32), ("mlp", 32)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_boundary_bytes_are_the_bytes_of_the_tensor_that_crosses_the_cut(model, image_size,
                                                                          precision):
    """mp's stage 0 run for real on the CPU under the case's autocast, as its forward runs
    it: the tensor handed to stage 1 has the bytes ``boundary_bytes`` counts (bf16 under
    bf16: batch norm keeps a conv's bf16), half of fp32's under bf16."""
    w = Workload(model, image_size, 4, precision=precision)
    net = w.build_model()
    cut = tutorial_cut(net)
    first = split_stages(net, [cut])[0]
    x = w.make_batch(4, torch.device("cpu"))[0]
    with torch.no_grad(), w.autocast(torch.device("cpu")):
        crossing = first(x)
    assert crossing.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    counted = boundary_bytes(model, image_size, 4, (cut,), precision)
    assert counted == (crossing.numel() * crossing.element_size(),)
    if precision == "bf16":
        assert 2 * counted[0] == boundary_bytes(model, image_size, 4, (cut,), "fp32")[0]


def test_mp_on_two_gpus_is_priced_with_the_device_copy_not_send_recv():
    """The bound and the prediction of mp on two GPUs: each cut's activation forward and its
    gradient back at the copy fit; the send/recv fit beside it is not used."""
    case = new_case(TWO_GPUS, "mp", "resnet-tiny", 32, 8)
    coll = Collectives({"send_recv": SEND}, "nccl", 2, device_copy=COPY)
    (edge,) = boundary_bytes("resnet-tiny", 32, 8, (3,), case.precision)
    cols = bound_columns(case, TWO_GPUS, OUTCOME, 1.0, collectives=coll)
    assert cols["bound_comm_s"] == pytest.approx(2 * COPY.time_s(edge))
    assert ASSUMED_COPY_NOTE not in cols["bound_note"]
    cal = Calibration(0.01, {8: BatchCosts(0.5)}, {}, 2)
    found = predict_case(case, TWO_GPUS, cal, coll)
    assert isinstance(found, bound.Bound)
    cut = bound_cut(case)
    (edge,) = boundary_bytes("resnet-tiny", 32, 8, (cut,), case.precision)
    assert found.comm_s == pytest.approx(2 * COPY.time_s(edge))
    assert found.step_s == pytest.approx(0.5 + 2 * COPY.time_s(edge))


def bound_cut(case):
    """The cut mp runs without a timed partition (``fixed_cuts``)."""
    from bench_lib.prediction.pipeline_time import fixed_cuts

    (cut,) = fixed_cuts(case)
    return cut


def test_a_bf16_case_moves_half_the_bytes_of_its_fp32_twin():
    """The activation crosses mp's cut in bf16 under bf16 autocast: the bound's transfer,
    less each copy's latency, is half fp32's."""
    coll = Collectives({}, "nccl", 2, device_copy=COPY)
    comm = {p: bound_columns(new_case(TWO_GPUS, "mp", "resnet-tiny", 32, 8, precision=p),
                             TWO_GPUS, OUTCOME, 1.0, collectives=coll)["bound_comm_s"]
            for p in ("fp32", "bf16")}
    latency = 2 * COPY.alpha_s
    assert comm["bf16"] - latency == pytest.approx((comm["fp32"] - latency) / 2)


def test_without_a_measured_copy_the_assumption_prices_it_and_is_named():
    """No device copy in the run's record (a dry run's, a failed probe's, an old folder's):
    ``ASSUMED_DEVICE_COPY`` prices mp's and pipeline's hand-offs, and the bound's and the
    prediction's notes name it; torch's schedules between processes keep the send/recv."""
    assert device_copy_fit(None) == (ASSUMED_DEVICE_COPY, ASSUMED_COPY_NOTE)
    assert device_copy_fit(Collectives(device_copy=COPY)) == (COPY, "")
    coll = Collectives({"send_recv": SEND}, "nccl", 2)
    mp = new_case(TWO_GPUS, "mp", "resnet-tiny", 32, 8)
    (edge,) = boundary_bytes("resnet-tiny", 32, 8, (3,))
    cols = bound_columns(mp, TWO_GPUS, OUTCOME, 1.0, collectives=coll)
    assert cols["bound_comm_s"] == pytest.approx(2 * ASSUMED_DEVICE_COPY.time_s(edge))
    assert ASSUMED_COPY_NOTE in cols["bound_note"]
    assert ASSUMED_COPY_NOTE in bound_columns(mp, TWO_GPUS, OUTCOME, 1.0)["bound_note"]
    found = predict_case(mp, TWO_GPUS, Calibration(0.01, {8: BatchCosts(0.5)}, {}, 2), coll)
    assert isinstance(found, bound.Bound) and ASSUMED_COPY_NOTE in found.note()
    # The tutorial's pipeline, one process on two GPUs: its edges at the assumed copy.
    pipe = new_case(TWO_GPUS, "pipeline", "resnet-tiny", 32, 8, split_size=4)
    parts = pipeline_parts(pipe, TWO_GPUS, coll)
    (edge,) = boundary_bytes("resnet-tiny", 32, 4, (3,))
    assert parts.edge_s((3,)) == [pytest.approx(ASSUMED_DEVICE_COPY.time_s(edge))]
    assert parts.transfer_note == ASSUMED_COPY_NOTE
    cal = Calibration(0.01, {}, {4: BatchCosts(0.2, (0.01,) * 6, (0.02,) * 6)}, 2)
    found = predict_case(pipe, TWO_GPUS, cal, coll)
    assert isinstance(found, bound.Bound) and ASSUMED_COPY_NOTE in found.formula


@pytest.mark.parametrize("strategy", ["gpipe", "1f1b"])
def test_pipelining_schedules_between_processes_keep_send_recv(strategy):
    """torch's schedules hand activations between processes: the send/recv fit, never the
    copy's, measured or assumed; without one, the transfers are taken free and said so."""
    case = new_case(TWO_GPUS, strategy, "resnet-tiny", 32, 8, split_size=4)
    assert case.process_group
    coll = Collectives({"send_recv": SEND}, "nccl", 2, device_copy=COPY)
    assert bound.transfer_fit(True, coll) == (SEND, "")
    assert bound.transfer_fit(True, None) == (None, "")
    assert bound.transfer_fit(False, coll) == (COPY, "")
    parts = pipeline_parts(case, TWO_GPUS, coll)
    (edge,) = boundary_bytes("resnet-tiny", 32, 4, (3,))
    assert parts.edge_s((3,)) == [pytest.approx(SEND.time_s(edge))]
    assert parts.transfer_note == ""
    outcome = CaseOutcome("ok", step_times_s=[1.0], partition="balanced:3",
                          timeline=traced([(0, 0, 2, 4), (1, 1, 1, 2)], 2, 0.01),
                          traced_step_s=0.2)
    no_send = bound_columns(case, TWO_GPUS, outcome, 0.2,
                            collectives=Collectives({}, "nccl", 2, device_copy=COPY))
    assert "(transfers not measured, taken free)" in no_send["bound_note"]
    assert ASSUMED_COPY_NOTE not in no_send["bound_note"]


def test_a_cpu_rigs_to_copies_nothing_and_is_priced_nothing(cpu_rig):
    """On a cpu rig mp's two "devices" are the one ``cpu`` device: its ``.to()`` returns
    the very tensor, so the bound charges no transfer and assumes nothing."""
    x = torch.ones(3)
    assert x.to(cpu_rig.device(1)) is x and not cpu_rig.moves_between(0, 1)
    case = new_case(cpu_rig, "mp", "resnet-tiny", 32, 8)
    cols = bound_columns(case, cpu_rig, OUTCOME, 1.0, collectives=None)
    assert cols["bound_comm_s"] == 0.0
    assert ASSUMED_COPY_NOTE not in cols["bound_note"]
    assert "taken free" not in cols["bound_note"]


def test_the_copy_probe_times_both_directions_and_fits_them():
    """``time_copies`` with a made-up clock (t = 5 us + n / 20 GB/s): one warm-up and the
    repetitions per size, 0 -> 1 then 1 -> 0, whose fit recovers the clock's figures."""
    calls = []

    def clock(nbytes, src, dst):
        calls.append((nbytes, src, dst))
        return 5e-6 + nbytes / 20e9 + (1e-6 if len(calls) % 3 == 0 else 0.0)

    sizes, times = device_copy.time_copies([2**20, 2**24], 3, clock)
    assert sizes == [2**20, 2**24] * 2
    assert [c[1:] for c in calls] == [(0, 1)] * 8 + [(1, 0)] * 8
    assert [c[0] for c in calls] == ([2**20] * 4 + [2**24] * 4) * 2
    fit = CollectiveFit.of("copy", 2, sizes, times)
    assert fit.alpha_s == pytest.approx(5e-6) and fit.beta_bytes_s == pytest.approx(20e9)


def test_the_copy_probe_process_writes_its_fit(monkeypatch, tmp_path):
    """``measure`` on two GPUs, its process's clock faked (run in this process): the fit
    comes back from the process's result file; a failing process gives the reason; one
    GPU's slots are not probed."""
    def start(server, module, args, log):
        assert module == "bench_lib.measure.device_copy"
        code = device_copy.main(args[:4])
        return FinishedProcess(code)

    monkeypatch.setattr(device_copy, "start_module", start)
    monkeypatch.setattr(device_copy, "copy_clock",
                        lambda devices: lambda n, s, d: 1e-5 + n / 10e9)
    fit, why = device_copy.measure(TWO_GPUS, (1.0, 4.0), repeats=2)
    assert why == "" and fit is not None
    assert fit.sizes_bytes == (2**20, 4 * 2**20) * 2
    assert fit.alpha_s == pytest.approx(1e-5) and fit.beta_bytes_s == pytest.approx(10e9)

    def failing(server, module, args, log):
        Path(log).write_text("RuntimeError: peer access is not supported\n")
        return FinishedProcess(1)

    monkeypatch.setattr(device_copy, "start_module", failing)
    fit, why = device_copy.measure(TWO_GPUS, (1.0,))
    assert fit is None and "exited with 1: RuntimeError: peer access" in why
    fit, why = device_copy.measure(Rig("cuda", 2, gpu_slots=2), (1.0,))
    assert fit is None and "copies nothing" in why


class FinishedProcess:
    """A process that has already exited with ``code``."""

    def __init__(self, code):
        self.returncode = code

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode

    def kill(self):
        raise AssertionError("a finished process is not killed")


@pytest.mark.integration
def test_the_copy_probe_runs_as_its_own_process(monkeypatch, cpu_rig):
    """The probe in a fresh interpreter, as a run starts it (a cpu rig let through the
    two-GPU check: its ``.to()`` copies nothing, but the process, its arguments and its
    result file are the real ones)."""
    monkeypatch.setattr(Rig, "moves_between", lambda self, a, b: True)
    fit, why = device_copy.measure(cpu_rig, (0.5, 1.0), repeats=1)
    assert why == "" and fit is not None
    assert fit.sizes_bytes == (2**19, 2**20) * 2 and all(t > 0 for t in fit.times_s)


def test_env_json_keeps_the_copy_fit_or_why_there_is_none():
    """``collectives.device_copy`` in env.json: the fit, or ``skipped`` with the reason,
    beside the collectives (measured or skipped); read back the same."""
    measured = Collectives({"send_recv": SEND}, "nccl", 2, device_copy=COPY)
    record = json.loads(json.dumps(measured.as_dict()))
    assert record["device_copy"]["beta_bytes_s"] == 40e9
    assert Collectives.from_dict(record).device_copy == COPY
    failed = Collectives(skipped="collective micro-benchmark failed",
                         copy_skipped="device copy probe failed (over 60 s)")
    back = Collectives.from_dict(failed.as_dict())
    assert back.device_copy is None and back.copy_skipped == failed.copy_skipped
    assert "over 60 s" in back.copy_line() and "40.0 GB/s" in measured.copy_line()
    assert "device_copy" not in Collectives(skipped="one device").as_dict()


def test_sweep_collectives_probes_the_copy_only_for_one_process_cases_on_two_gpus(
        monkeypatch):
    """The run's rig figures: the copy probe runs where mp or pipeline hand tensors between
    two GPUs, not for a sweep of ddp alone nor on one GPU's slots."""
    from bench_lib.measure import collectives
    from bench_lib.prediction.collectives import sweep_collectives

    probed = []
    monkeypatch.setattr(collectives, "measure",
                        lambda rig, sizes, server=None: Collectives({"send_recv": SEND},
                                                                    rig.backend, 2))
    monkeypatch.setattr(device_copy, "measure",
                        lambda rig, sizes, server=None: probed.append(rig) or (COPY, ""))
    mp = new_case(TWO_GPUS, "mp", "resnet-tiny", 32, 8)
    found = sweep_collectives(TWO_GPUS, True, [mp], None)
    assert found.device_copy == COPY and probed == [TWO_GPUS]
    ddp = new_case(TWO_GPUS, "ddp", "resnet-tiny", 32, 8)
    assert sweep_collectives(TWO_GPUS, True, [ddp], None).device_copy is None
    slots = Rig("cuda", 2, gpu_slots=2)
    sweep_collectives(slots, True, [new_case(slots, "mp", "resnet-tiny", 32, 8)], None)
    assert probed == [TWO_GPUS]


def _measured_at(rig: Rig, cases: list, copy: CollectiveFit | None = None) -> dict:
    """env.json's record of collectives measured as ``sweep_collectives`` would for
    ``cases`` on ``rig`` (its sizes, backend, world, path), with ``copy`` as the copy fit."""
    from bench_lib.measure.collectives import path_of, sizes_for
    from bench_lib.prediction.collectives import largest_message

    sizes = [int(s * 2**20) for s in sizes_for(largest_message(cases, rig) or 0)]
    fits = {op: CollectiveFit.of(op, rig.num_devices, sizes, [1e-3 + n / 1e9 for n in sizes])
            for op in OPS}
    return Collectives(fits, rig.backend, rig.num_devices, wall_s=4.0, path=path_of(rig),
                       device_copy=copy).as_dict()


def test_collectives_are_reused_only_where_measured_as_the_sweep_would_measure_them(cpu_rig):
    """``run --calibration``'s file's collectives replace the run's measurement only where
    they are what it would measure now: the same sizes (the sweep's largest message),
    backend, devices and path, and the device copy where a case hands tensors between two
    GPUs. Anything else is measured again."""
    from bench_lib.prediction.collectives import reusable_collectives

    ddp = [new_case(cpu_rig, "ddp", "resnet-tiny", 32, 8)]
    given = _measured_at(cpu_rig, ddp)
    found = reusable_collectives(cpu_rig, ddp, given)
    assert found is not None and found.as_dict() == given
    assert reusable_collectives(cpu_rig, ddp, None) is None
    # A sweep of a larger model times larger messages: its own measurement.
    big = [new_case(cpu_rig, "ddp", "resnet50", 64, 8)]
    assert reusable_collectives(cpu_rig, big, given) is None
    assert reusable_collectives(cpu_rig, big, _measured_at(cpu_rig, big)) is not None
    # Nothing of the sweep is priced with collectives: none is measured, none reused.
    alone = [new_case(cpu_rig, "single", "resnet-tiny", 32, 8)]
    assert reusable_collectives(cpu_rig, alone, given) is None
    for other in ({"backend": "nccl"}, {"world_size": 3}, {"path": "gloo on CUDA memory"}):
        assert reusable_collectives(cpu_rig, ddp, given | other) is None, other
    assert reusable_collectives(cpu_rig, ddp, {"skipped": "micro-benchmark failed"}) is None
    fewer = given | {"ops": {k: v for k, v in given["ops"].items() if k != "send_recv"}}
    assert reusable_collectives(cpu_rig, ddp, fewer) is None
    # mp between two GPUs needs the device copy: a record without it is measured again.
    mp = [new_case(TWO_GPUS, "mp", "resnet-tiny", 32, 8),
          new_case(TWO_GPUS, "ddp", "resnet-tiny", 32, 8)]
    assert reusable_collectives(TWO_GPUS, mp, _measured_at(TWO_GPUS, mp)) is None
    with_copy = reusable_collectives(TWO_GPUS, mp, _measured_at(TWO_GPUS, mp, COPY))
    assert with_copy is not None and with_copy.device_copy == COPY
