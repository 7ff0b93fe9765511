"""The one-GPU validation mode (``--gpu-slots``): several device slots on one card.

Everything here runs without a GPU: the slot arithmetic, the process group's backend and
device (a recording fake of ``torch.distributed``), which strategies can run, the labels
every row and the run carry, and a dry run of the default GPU sweep on one GPU's two slots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from bench_lib import rig as rig_module
from bench_lib import rig_detection, strategies
from bench_lib.measure import preflight, preflight_probes, preflight_static
from bench_lib.process_groups import init_process_group
from bench_lib.rig import Rig, RigError
from bench_lib.rig_detection import detect_rig
from bench_lib.sweep.cases import new_case
from tests.conftest import PYTHON, REPO


def test_slots_map_onto_gpus_and_say_what_they_are():
    rig = Rig("cuda", 4, gpu_slots=2)
    assert [rig.cuda_index(i) for i in range(4)] == [0, 0, 1, 1]
    assert rig.devices() == [torch.device("cuda", g) for g in (0, 0, 1, 1)]
    assert rig.num_gpus == 2 and rig.backend == "gloo"
    assert rig.label == "cuda:4slots-on-2gpu-validation"  # never read as cuda:4
    assert "not a 4-GPU measurement" in rig.validation_note
    assert Rig.from_dict(json.loads(json.dumps(rig.as_dict()))) == rig
    plain = Rig("cuda", 2)
    assert plain.backend == "nccl" and plain.num_gpus == 2 and plain.validation_note == ""
    assert plain.devices() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert Rig.from_dict({k: v for k, v in plain.as_dict().items() if k != "gpu_slots"}) == plain


def test_slots_are_refused_where_they_mean_nothing():
    with pytest.raises(RigError, match="only on a cuda rig"):
        Rig("cpu", 1, 1, (0,), gpu_slots=2)
    with pytest.raises(RigError, match=">= 1"):
        Rig("cuda", 2, gpu_slots=0)
    with pytest.raises(RigError, match="needs a cuda rig"):
        detect_rig("cpu", 2, gpu_slots=2)


def test_detection_fits_the_slots_on_the_gpus_there_are(monkeypatch):
    monkeypatch.setattr(rig_detection, "cuda_device_count", lambda: 1)
    assert detect_rig("cuda", 2, gpu_slots=2) == Rig("cuda", 2, gpu_slots=2)
    assert detect_rig(None, None, gpu_slots=2) == Rig("cuda", 2, gpu_slots=2)  # all slots
    with pytest.raises(RigError, match="3 devices asked for at 2 slots per GPU.*1 GPU"):
        detect_rig("cuda", 3, gpu_slots=2)
    monkeypatch.setattr(rig_detection, "cuda_device_count", lambda: 0)
    assert detect_rig("cuda", 2, plan_only=True, gpu_slots=2).label.endswith("validation")


def test_ranks_sharing_a_gpu_join_through_gloo_on_their_gpu(monkeypatch):
    import torch.distributed as dist

    joined: list[dict[str, Any]] = []
    selected: list[int] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: joined.append(kw))
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    shared = Rig("cuda", 4, gpu_slots=2)
    for rank in range(4):
        init_process_group(shared, rank, 4, "/tmp/x", 5.0)
    assert selected == [0, 0, 1, 1]
    assert {kw["backend"] for kw in joined} == {"gloo"}
    assert all(kw["device_id"] is None for kw in joined)  # NCCL's eager binding only
    joined.clear()
    selected.clear()
    init_process_group(Rig("cuda", 2), 1, 2, "/tmp/x", 5.0)  # the real thing: unchanged
    assert joined[0]["backend"] == "nccl" and joined[0]["device_id"] == torch.device("cuda", 1)
    assert selected == [1]


@pytest.mark.parametrize("name, runs", [
    ("single", True), ("mp", True), ("pipeline", True), ("accum", True), ("ddp", True),
    ("dp", False), ("fsdp", False), ("gpipe", False), ("1f1b", False),
    ("interleaved-1f1b", False), ("zbv", False),
])
def test_what_runs_on_shared_gpus_and_why_not(name, runs):
    shared = Rig("cuda", 2, gpu_slots=2)
    reason = strategies.get(name).unsupported_reason(shared)
    assert (reason is None) == runs, reason
    if not runs:
        assert reason.startswith("--gpu-slots 2: ")
        assert ("gloo" in reason) or ("DataParallel" in reason)
    assert strategies.get(name).unsupported_reason(Rig("cuda", 2)) is None


def test_every_case_row_of_a_validation_rig_says_so():
    shared = Rig("cuda", 2, gpu_slots=2)
    case = new_case(shared, "ddp", "resnet50", 64, 16)
    assert case.status is None and "validation run" in case.note
    assert new_case(Rig("cuda", 2), "ddp", "resnet50", 64, 16).note == ""


def _shared_gpu_row(strategy: str) -> dict[str, Any]:
    """The row of a case on a one-GPU validation rig (2 slots), as the runner builds it: the
    sampler read GPU 0 (200 W, 90% busy) once for each slot, the idle power is GPU 0's
    (50 W), and the FLOP peak was probed by both slots at once (each got half the card)."""
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.measure.energy import IdlePower
    from bench_lib.measure.flop_peak import AttainablePeak
    from bench_lib.results.schema import SAMPLE_METRIC_NAMES
    from bench_lib.rows.rows import case_row

    shared = Rig("cuda", 2, gpu_slots=2)
    case = new_case(shared, strategy, "resnet-tiny", 32, 8)
    labels = [str(s) for s in range(case.world_size)]
    samples = [{"time_unix_s": 100 + t, "device": d, **dict.fromkeys(SAMPLE_METRIC_NAMES),
                "energy_j": 200.0 * t, "util_gpu_pct": 90.0}
               for t in (0.0, 0.5, 1.0, 1.5, 2.0) for d in labels]
    outcome = CaseOutcome("ok", step_times_s=[0.5] * 4,
                          peak_mem_mib=dict.fromkeys(labels, 100.0),
                          timed_window_unix_s=(100.0, 102.0), samples=samples)
    half = AttainablePeak({"fp32": {"0": 50.0, "1": 50.0}})
    return case_row(case, shared, outcome, half, IdlePower({"0": 50.0}))


def test_slots_sharing_a_gpu_leave_energy_and_mfu_empty_and_say_why():
    """Validation mode (#28 item 13): both slots read GPU 0's energy, so the gross figure
    counted the card twice and the net one was empty for want of slot 1's idle power; each
    slot's probed peak is a share of the card, so a case's MFU read about 2x."""
    row = _shared_gpu_row("ddp")
    assert row["energy_j_per_img"] is None and row["power_w_mean"] is None
    assert row["energy_j_per_img_net"] is None and row["energy_source"] == ""
    assert "2 slots share 1 GPU" in row["sampler_note"], row["sampler_note"]
    assert row["util_pct_mean"] == 90.0  # the shared card's, read by each slot: kept
    assert row["mfu_pct"] is None and "--gpu-slots 2" in row["mfu_note"], row["mfu_note"]
    assert row["achieved_tflop_s"] > 0  # the case's own rate: kept
    # One slot alone on its GPU: its energy is the card's, once; its MFU still has no peak.
    alone = _shared_gpu_row("single")
    assert alone["energy_j_per_img"] is not None and alone["energy_j_per_img_net"] is not None
    assert alone["mfu_pct"] is None and "--gpu-slots 2" in alone["mfu_note"]


def test_the_peak_probed_by_slots_sharing_a_gpu_says_so_in_env_json(monkeypatch):
    """Validation mode (#28): cases.csv leaves MFU empty because each slot's probed peak is
    a share of its card, but env.json's attainable_peak gave no sign of it."""
    from bench_lib.measure import flop_peak, flop_probe

    class Done:
        returncode = 0

        def poll(self) -> int:
            return 0

        def wait(self) -> int:
            return 0

    def start_module(server: Any, module: str, args: list[str], out: Any, err: Any) -> Done:
        out.write_text(json.dumps({"tflop_s": {"fp32": dict.fromkeys(flop_probe.PROBES, 50.0)},
                                   "window_unix_s": [0.0, 1.0], "math_mode": {},
                                   "math_env": {}}))
        return Done()

    monkeypatch.setattr(flop_peak, "start_module", start_module)
    shared = flop_peak.measure_peak(Rig("cuda", 2, gpu_slots=2), ["fp32"], min_time_s=0.0)
    record = json.loads(json.dumps(shared.as_dict()))  # as env.json holds it
    assert record["tflop_s"] == {"fp32": {"0": 50.0, "1": 50.0}}  # the readers' figures
    assert record["slots_per_gpu"] == 2
    assert "2 slots sharing each GPU" in record["note"] and "not a card's peak" in record["note"]
    assert flop_peak.AttainablePeak.from_dict(record) == shared  # a resumed run keeps the label
    alone = flop_peak.measure_peak(Rig("cuda", 2), ["fp32"], min_time_s=0.0)
    assert alone.note == "" and "note" not in alone.as_dict()
    assert "slots_per_gpu" not in alone.as_dict()


@pytest.mark.integration
def test_dry_run_of_the_default_gpu_sweep_on_one_gpu_with_two_slots(tmp_path):
    proc = subprocess.run(
        [PYTHON, "-m", "bench_lib", "run", "--profile", "default-cuda", "--rig", "cuda",
         "--devices", "2", "--gpu-slots", "2", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "cuda:2slots-on-1gpu-validation" in out
    lines = out.splitlines()
    gpipe = [ln for ln in lines if ln.lstrip().startswith("gpipe")]
    ddp = [ln for ln in lines if ln.lstrip().startswith("ddp")]
    assert gpipe and all("unsupported" in ln for ln in gpipe)
    assert ddp and not any("unsupported" in ln for ln in ddp)
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_the_preflight_ranks_tie_themselves_to_the_runner(monkeypatch, tmp_path):
    """No ``preexec_fn`` (a deadlock hazard in a threaded parent): each rank is given this
    process's pid and asks for the parent-death signal itself."""
    started: list[tuple[list[str], dict[str, Any]]] = []

    class Done:
        pid = 4242
        returncode = 0

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    def popen(cmd: list[str], **kwargs: Any) -> Done:
        started.append((cmd, kwargs))
        return Done()

    monkeypatch.setattr(preflight_probes.subprocess, "Popen", popen)
    monkeypatch.setattr(preflight_probes.os, "killpg", lambda pgid, sig: None)  # 4242 is not ours
    preflight_probes.all_reduce(Rig("cuda", 2, gpu_slots=2), timeout_s=1, command=["rank"])
    assert len(started) == 2
    assert all("preexec_fn" not in kwargs for _, kwargs in started)
    assert all(json.loads(cmd[1])["gpu_slots"] == 2 for cmd, _ in started)
    assert all(cmd[-1] == str(os.getpid()) for cmd, _ in started)


@pytest.mark.integration
def test_a_preflight_rank_whose_runner_is_gone_does_not_start():
    # PARENT_PID names a process that is not this rank's parent: it exits 4 at once.
    rig = json.dumps(Rig("cuda", 2).as_dict())
    proc = subprocess.run(
        [sys.executable, "-m", "bench_lib.measure.preflight_probes", rig, "0", "2", "/nonexistent",
         "/nonexistent.json", "5", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr


DOCKER_SHM = {"path": "/dev/shm", "total_mib": 64.0, "free_mib": 64.0}


@pytest.mark.integration
def test_slots_on_one_gpu_pass_the_preflight_in_a_default_docker_container(monkeypatch):
    """#28 item 2: the slots talk gloo (no NCCL shared memory) and sit on one GPU, which
    NVML sees: neither /dev/shm's 64 MiB nor NVML's one GPU is a reason to stop."""
    from tests.test_gpu_env import GPUS, OK_RANK, topo_nvml

    monkeypatch.setattr(preflight, "SETTLE_S", 0.0)
    monkeypatch.setattr(preflight_probes, "smoke_results", lambda rig, *a, **k: ok_smoke(rig),
                        raising=False)  # the CUDA smoke child, faked (item 3)
    slots = Rig("cuda", 2, gpu_slots=2)
    checks = preflight.check(slots, quiet=True, shm=DOCKER_SHM, environ={},
                             nvml=topo_nvml(gpus=GPUS[:1]),
                             command=[sys.executable, "-c", OK_RANK])
    found = {c.name: c for c in checks}
    assert found["dev_shm"].status == "ok" and "gloo" in found["dev_shm"].detail
    assert found["nvml"].status == "ok", found["nvml"].detail
    # Two GPUs of two slots each: still gloo, still no shared memory; NVML must see 2 GPUs.
    four = Rig("cuda", 4, gpu_slots=2)
    assert preflight_static.shm_check(four, DOCKER_SHM, {}).status == "ok"
    assert preflight_static.nvml_check(four, topo_nvml(), {}).status == "ok"
    few = preflight_static.nvml_check(four, topo_nvml(gpus=GPUS[:1]), {})
    assert few.status == "warn" and "NVML sees 1 of the rig's 2 GPUs" in few.detail
    # Two GPUs without slots talk NCCL: the Docker default still fails there.
    assert preflight_static.shm_check(Rig("cuda", 2), DOCKER_SHM, {}).status == "fail"


def ok_smoke(rig: Rig) -> Any:
    """A CUDA smoke run (``preflight_probes.smoke_results``) in which every GPU passed."""
    return preflight_probes.SmokeProcesses(True, {g: {"ok": True, "device": f"cuda:{g}",
                                                "name": "Fake GPU", "capability": "sm_90"}
                                            for g in range(rig.num_gpus)},
                                     [0] * rig.num_gpus, "", 1.0)


def handed_to_collectives(monkeypatch, rig: Rig, rank: int) -> set[torch.device]:
    """The devices of every tensor ``rank`` of ``rig``'s collective micro-benchmark hands to
    torch.distributed (a recording fake of it), its CUDA buffers fake (FakeTensorMode)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench_lib.measure import collectives

    handed: set[torch.device] = set()

    def record(*args: Any, **kwargs: Any) -> None:
        handed.update(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send",
                 "recv"):
        monkeypatch.setattr(dist, name, record)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_world_size", lambda: rig.num_devices)
    monkeypatch.setattr(rig_module, "synchronize", lambda devices: None)  # no CUDA here

    def slowest(elapsed_s: float, device: torch.device) -> float:
        handed.add(device)  # where the MAX of the ranks' times is all-reduced
        return elapsed_s

    monkeypatch.setattr(collectives, "slowest_s", slowest)
    with FakeTensorMode():
        times = collectives._time_ops(rig, rank, [4096, 8192], repeats=1)
    assert set(times) == set(collectives.OPS)  # every op ran, at both sizes
    assert all(len(t) == 2 for t in times.values())
    return handed


@pytest.mark.parametrize("rank", [0, 1])
def test_gloo_between_gpu_slots_is_handed_host_memory_and_nccl_device_memory(monkeypatch,
                                                                             rank):
    # The first GPU run's micro-benchmark died handing CUDA memory to gloo (writev: "Bad
    # address", tests/data/h100-2026-11-26/smoke-2slots/env.json): gloo moves host memory.
    shared = Rig("cuda", 2, gpu_slots=2)
    assert handed_to_collectives(monkeypatch, shared, rank) == {torch.device("cpu")}
    assert handed_to_collectives(monkeypatch, Rig("cuda", 2), rank) == {
        torch.device("cuda", rank)}


def test_the_slots_collectives_say_they_time_host_copies():
    from bench_lib.analysis.collective_fits import Collectives
    from bench_lib.measure.collectives import path_of, through_host

    shared = Rig("cuda", 2, gpu_slots=2)
    assert through_host(shared) and not through_host(Rig("cuda", 2))
    assert not through_host(Rig("cpu", 2, 1, (0, 1)))  # host memory already: no copy
    assert "copied to the host" in path_of(shared) and path_of(Rig("cuda", 2)) == (
        "nccl on CUDA memory")
    record = Collectives(backend="gloo", world_size=2, path=path_of(shared)).as_dict()
    assert Collectives.from_dict(record).path == path_of(shared)


def send_recv_fit():
    from bench_lib.analysis.collective_fits import CollectiveFit

    return CollectiveFit((1,), (1.0,), alpha_s=0.002, beta_bytes_s=1e9, busbw_gb_s=1.0)


def test_one_process_moves_nothing_between_the_slots_of_one_gpu():
    """mp's two stages on one GPU's two slots: .to() between them is no copy, so the
    bound and the prediction charge no transfer, and no collective is measured for it;
    on two GPUs each boundary costs the device copy's time there and back (tests/
    test_transfers.py: the copy fit, not the send/recv one)."""
    from bench_lib.analysis.collective_fits import Collectives
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.prediction.collectives import largest_message
    from bench_lib.rows.bound_columns import bound_columns
    from tests.test_bound import traced

    shared, two = Rig("cuda", 2, gpu_slots=2), Rig("cuda", 2)
    assert not shared.moves_between(0, 1) and two.moves_between(0, 1)
    assert not Rig("cpu", 2, 1, (0, 1)).moves_between(0, 1)
    coll = Collectives({"send_recv": send_recv_fit()}, "gloo", 2,
                       device_copy=send_recv_fit())
    outcome = CaseOutcome("ok", step_times_s=[1.0], timeline=traced([(0, 0, 2, 4), (1, 0, 1, 2)],
                                                                     1, 0.1),
                          traced_step_s=1.0, partition="tutorial:3")
    on_slots = bound_columns(new_case(shared, "mp", "resnet-tiny", 32, 8), shared, outcome,
                             1.0, collectives=coll)
    on_gpus = bound_columns(new_case(two, "mp", "resnet-tiny", 32, 8), two, outcome, 1.0,
                            collectives=coll)
    assert on_slots["bound_comm_s"] == 0.0 and on_gpus["bound_comm_s"] > 0.002 * 2
    mp = [new_case(shared, "mp", "resnet-tiny", 32, 8)]
    assert largest_message(mp, shared) is None
    assert largest_message(mp, two) is not None


def test_ddp_on_gpu_slots_gets_its_bound_and_communication_part():
    """With the slots' all-reduce measured, a ddp case there is priced like any rig's: its
    bound overlaps compute with the all-reduce, and the waterfall's comm part is what the
    bound leaves exposed."""
    from bench_lib.analysis.collective_fits import CollectiveFit, Collectives
    from bench_lib.launch.protocol import CaseOutcome
    from bench_lib.rows.bound_columns import bound_columns, bound_columns_of, case_bound_or_why
    from bench_lib.rows.waterfall import waterfall_columns
    from bench_lib.workloads.sizes import parameter_bytes

    shared = Rig("cuda", 2, gpu_slots=2)
    ddp = new_case(shared, "ddp", "resnet-tiny", 32, 16)
    fit = CollectiveFit((1,), (1.0,), alpha_s=0.01, beta_bytes_s=1e7, busbw_gb_s=0.01)
    coll = Collectives({"all_reduce": fit}, "gloo", 2)
    comm = 2 * 0.01 + parameter_bytes("resnet-tiny", 32)[0] / 1e7  # 2 buckets, slow enough
    outcome = CaseOutcome("ok", step_times_s=[0.5], compute_step_s=0.1)
    found = case_bound_or_why(ddp, shared, outcome, 0.5, 0.15, coll)
    cols = bound_columns_of(found, 0.5)
    assert cols == bound_columns(ddp, shared, outcome, 0.5, 0.15, coll)
    assert comm > 0.1 and cols["step_time_s_bound"] == pytest.approx(comm)
    assert cols["bound_comm_s"] == pytest.approx(comm - 0.1)
    row = {"step_time_s_median": 0.5, **cols}
    water = waterfall_columns(ddp, shared, outcome, row, {16: 0.15, 8: 0.1}, found=found)
    assert water["waterfall_comm_s"] == pytest.approx(comm - 0.1)
    # ideal 0.15 / 2; each slot computes 8 at T1(8) = 0.1 s, as its no_sync steps did.
    assert (water["waterfall_ideal_s"], water["waterfall_batch_s"],
            water["waterfall_corun_s"]) == pytest.approx((0.075, 0.025, 0.0))
